//! Consumer groups: polls, acks, nacks, extensions, dead letters, seeks.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::*;
use serde::{Deserialize, Serialize};

/// `group_poll`. `wait_ms` is always written.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupPoll {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub group: String,
    pub max_records: u32,
    #[serde(default)]
    pub wait_ms: u64,
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub consumer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reclaim: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub visibility_ms: Option<u64>,
}

/// One record of `group_records`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupRecord {
    pub offset: u64,
    pub payload: B64,
    #[serde(default)]
    pub attempts: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_before: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publisher: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub timestamp_micros: Option<u64>,
}

/// `group_records`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupRecords {
    pub records: Vec<GroupRecord>,
    pub request_id: u64,
}

/// `group_ack`, `group_dead_letter`, `group_discard`, `group_redrive`: one offset of a group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupOffset {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub group: String,
    pub offset: u64,
    pub request_id: u64,
}

/// `group_nack`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupNack {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub group: String,
    pub offset: u64,
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub delay_ms: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub attempts: Option<u32>,
}

/// `group_extend`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupExtend {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub group: String,
    pub offset: u64,
    pub attempts: u32,
    pub extend_ms: u64,
    pub request_id: u64,
}

/// `group_extended`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupExtended {
    pub visible_ms: u64,
    pub request_id: u64,
}

/// `group_dead_letters`, `group_describe`, `group_delete`: a whole group.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupRef {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub group: String,
    pub request_id: u64,
}

/// `group_dead_letter_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupDeadLetterList {
    pub offsets: Vec<u64>,
    pub request_id: u64,
}

/// `group_seek`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupSeek {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub group: String,
    pub start: StartPosition,
    #[serde(default, skip_serializing_if = "is_false")]
    pub if_new: bool,
    pub request_id: u64,
}

/// `group_position`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupPosition {
    pub offset: u64,
    pub moved: bool,
    pub request_id: u64,
}

/// `group_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupInfo {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committed: Option<u64>,
    pub tail: u64,
    pub in_flight: u64,
    pub owed: u64,
    pub dead_letters: u64,
    pub request_id: u64,
}
