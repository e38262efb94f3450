//! Publishing: JSON and batch publishes, acks, idempotent producers, conditional publishes, commits and state.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::*;
use crate::binary::{AckMode, ErrorDetail};
use crate::error_code::{ErrorCode, RetryClass};
use serde::{Deserialize, Serialize};

/// `publish`: one message. `shard` (FEATURE_EXPLICIT_SHARD) sits right before `request_id`;
/// `publish_width` (FEATURE_PUBLISH_WIDTH) is appended last.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Publish {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payload: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack: Option<AckMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_width: Option<u32>,
}

/// `publish_batch`: several messages appended in order, answered once.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishBatchMsg {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payloads: Vec<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ack: Option<AckMode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_width: Option<u32>,
}

/// `publish_width` (our extension, FEATURE_PUBLISH_WIDTH): declares, for the rest of this QUIC
/// stream, the shard count the client routes `stream`'s binary keyed batches by. See
/// docs/protocol.md.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishWidth {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub width: u32,
}

/// `publish_ok`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishOk {
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

/// `publish_error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishError {
    pub request_id: u64,
    pub message: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub code: Option<ErrorCode>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry: Option<RetryClass>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<ErrorDetail>,
}

/// `producer_init`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProducerInit {
    pub request_id: u64,
}

/// `producer_init_ok`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProducerInitOk {
    pub request_id: u64,
    pub producer_id: u64,
}

/// `publish_idempotent`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishIdempotent {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payloads: Vec<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<B64>,
    pub request_id: u64,
    pub producer_id: u64,
    pub sequence: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_width: Option<u32>,
}

/// Leader named by a `not_leader` refusal.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LeaderHint {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
}

/// Why a write was refused (externally tagged, as upstream).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RefusedReason {
    SequenceGap { expected: u64 },
    UnknownProducer,
    SequenceExpired,
    SequenceReused,
    OffsetMismatch { tail: u64 },
    NotLeader(LeaderHint),
}

/// `publish_refused`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishRefused {
    pub request_id: u64,
    pub reason: RefusedReason,
    pub message: String,
}

/// `publish_if`: appended only at `expected_offset`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PublishIf {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payloads: Vec<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<B64>,
    pub expected_offset: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub publish_width: Option<u32>,
}

/// One state change of a `commit`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum StateChange {
    Put { key: String, value: B64 },
    Delete { key: String },
}

/// `commit`: an event and state changes as one record.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Commit {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub entity_key: B64,
    pub event: B64,
    pub changes: Vec<StateChange>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected_offset: Option<u64>,
}

/// `commit_ok`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CommitOk {
    pub request_id: u64,
    pub offset: u64,
}

/// `state_get`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateGet {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub entity_key: B64,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    pub request_id: u64,
}

/// `state_value`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateValue {
    #[serde(default)]
    pub value: Option<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub as_of: Option<u64>,
    pub request_id: u64,
}
