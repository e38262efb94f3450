//! Counters.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use serde::{Deserialize, Serialize};

/// `counter_add`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CounterAdd {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub delta: i64,
    pub request_id: u64,
}

/// `counter_get`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CounterGet {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub request_id: u64,
}

/// `counter_value`. Absent `value` = never written (≠ 0).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CounterValue {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<i64>,
    pub request_id: u64,
}
