//! Session: authentication, errors, `unsupported`, extensions.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use crate::binary::ErrorDetail;
use crate::error_code::{ErrorCode, RetryClass};
use serde::{Deserialize, Serialize};

/// `auth`: first frame on every client stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Auth {
    pub tenant_id: String,
    pub token: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_flags: Option<u16>,
    /// The second flag word (D56), sent only with `client_flags` bit 0x8000 set.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_flags_hi: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_features: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_features_hi: Option<u32>,
}

impl Auth {
    /// An `auth` offering no flags and no features: what a client of the protocol's first
    /// version sends.
    pub fn plain(tenant_id: impl Into<String>, token: impl Into<String>) -> Auth {
        Auth {
            tenant_id: tenant_id.into(),
            token: token.into(),
            client_flags: None,
            client_flags_hi: None,
            client_features: None,
            client_features_hi: None,
        }
    }
}

/// `auth_ok`: answer to an `auth` that offered `client_flags`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AuthOk {
    pub server_flags: u16,
    /// The second flag word (D56), sent only to a client that set 0x8000 in `client_flags`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_flags_hi: Option<u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_features: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_features_hi: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub listener_ports: Option<Vec<u16>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_window: Option<u32>,
}

/// `ok`: plain success.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct OkMsg {}

/// `error`: a request failed. Code fields only for a client that offered `FEATURE_ERROR_CODES`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ErrorMsg {
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryClass>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<ErrorDetail>,
}

/// `unsupported`: the broker did not understand a request and keeps the stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Unsupported {
    pub request_type: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub extension: Option<String>,
}

/// `extension`: a request named by string (reserved area; answered `unsupported` today).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Extension {
    pub name: String,
    pub request_id: u64,
    #[serde(default)]
    pub body: serde_json::Value,
}
