//! Reading history: `offset_for_time`, `stream_read`.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::*;
use serde::{Deserialize, Serialize};

/// `offset_for_time`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OffsetForTime {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub at_micros: u64,
    pub request_id: u64,
}

/// `offset_value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OffsetValue {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
    pub request_id: u64,
}

/// `stream_read`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamRead {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub from: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub end: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_records: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_bytes: Option<u64>,
    pub request_id: u64,
    /// D51: read this broker's own copy of a replicated shard, follower or not (sent only to
    /// a broker that advertises `FEATURE_STREAM_INFO`; absent: the owner answers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replica_local: Option<bool>,
}

/// One record of `stream_records`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamRecord {
    pub offset: u64,
    pub payload: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    #[serde(default)]
    pub timestamp_micros: u64,
}

/// `stream_records`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamRecords {
    pub records: Vec<StreamRecord>,
    pub next_offset: u64,
    pub request_id: u64,
}
