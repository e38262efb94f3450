//! The JSON control messages, one struct each, fields in upstream's serialisation order.
//!
//! Rules every struct follows (so that an old peer sees byte-identical frames):
//! * an optional field is `Option<_>` with `skip_serializing_if`, so "absent" means "what it
//!   meant before the field existed";
//! * a few fields upstream always writes (`cache_put.ttl_ms`, `cache_value.value`,
//!   `state_value.value`, `group_poll.wait_ms`, group record `attempts`,
//!   `cache_event.expires_at_millis`, `cache_watch_started.resnapshot`) are always written here
//!   too, and accepted when absent;
//! * unknown fields are ignored on decode (serde's default), which is what makes additive fields
//!   safe.

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::B64;
use crate::binary::{AckMode, ErrorDetail};
use crate::error_code::{ErrorCode, RetryClass};
use serde::{Deserialize, Serialize};

fn is_false(b: &bool) -> bool {
    !*b
}

// ---------------------------------------------------------------------------------------------
// Session

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

// ---------------------------------------------------------------------------------------------
// Topology and shard discovery

/// `topology`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Topology {}

/// One broker in a `topology_view`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BrokerAddr {
    pub node_id: String,
    pub addr: String,
}

/// `topology_view`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopologyView {
    pub brokers: Vec<BrokerAddr>,
}

/// `not_leader`: another broker owns the shard (client offered `FEATURE_REDIRECT`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NotLeader {
    pub node_id: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    pub generation: u64,
}

/// `stream_shards`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamShards {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub request_id: u64,
}

/// How keys map to shards on a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    Modulo,
    JumpHash,
}

/// `stream_shards_view`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamShardsView {
    pub shards: u32,
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub routing: Option<Routing>,
}

/// `cache_shards`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheShards {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub request_id: u64,
}

/// `cache_shards_view`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheShardsView {
    pub shards: u32,
    pub request_id: u64,
}

/// Whether a name is a stream or a cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardKind {
    Stream,
    Cache,
}

/// `shard_owners`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardOwners {
    pub tenant_id: String,
    pub namespace: String,
    pub name: String,
    pub kind: ShardKind,
    pub request_id: u64,
}

/// One shard's owner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardOwner {
    pub shard: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    #[serde(default)]
    pub generation: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unavailable: Option<String>,
}

/// `shard_owners_view`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardOwnersView {
    pub request_id: u64,
    pub owners: Vec<ShardOwner>,
}

// ---------------------------------------------------------------------------------------------
// Publishing

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

// ---------------------------------------------------------------------------------------------
// Subscriptions

/// Where a subscription (or a group seek) starts: `"latest"`, `"earliest"` or `{"offset": n}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartPosition {
    Latest,
    Earliest,
    Offset(u64),
}

/// `subscribe`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Subscribe {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartPosition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_capacity: Option<u32>,
    /// Only batches whose key this matches (D57); sent only to a broker advertising
    /// `FEATURE_STREAM_FILTER`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<KeyFilter>,
}

/// A subscription's filter on record keys (D57): a batch is delivered when its key equals one
/// of `keys` or starts with one of `key_prefixes` (an empty prefix matches every keyed batch);
/// an unkeyed batch never matches. Keys are bytes, base64 as a publish's key is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct KeyFilter {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<B64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key_prefixes: Vec<B64>,
}

impl KeyFilter {
    /// The most keys and prefixes a filter holds, together.
    pub const MAX_ENTRIES: usize = 256;
    /// The most bytes its keys and prefixes hold, together.
    pub const MAX_BYTES: usize = 64 << 10;

    /// Whether a batch with this key is delivered.
    pub fn matches(&self, key: Option<&[u8]>) -> bool {
        let Some(key) = key else { return false };
        self.keys.iter().any(|k| k.0[..] == *key) || self.key_prefixes.iter().any(|p| key.starts_with(&p.0))
    }

    /// Checks the filter's size: at least one entry, at most [`MAX_ENTRIES`](Self::MAX_ENTRIES)
    /// and [`MAX_BYTES`](Self::MAX_BYTES).
    ///
    /// # Errors
    /// What is wrong, in words.
    pub fn check(&self) -> Result<(), String> {
        let n = self.keys.len() + self.key_prefixes.len();
        if n == 0 {
            return Err("a filter needs at least one key or key prefix".into());
        }
        if n > Self::MAX_ENTRIES {
            return Err(format!("a filter holds at most {} keys and prefixes, not {n}", Self::MAX_ENTRIES));
        }
        let bytes: usize = self.keys.iter().chain(&self.key_prefixes).map(|k| k.0.len()).sum();
        if bytes > Self::MAX_BYTES {
            return Err(format!("a filter's keys and prefixes hold at most {} bytes, not {bytes}", Self::MAX_BYTES));
        }
        Ok(())
    }
}

/// `subscribed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Subscribed {
    pub subscription_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_offset: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_offset: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_capacity: Option<u32>,
}

/// Why a cursor cannot be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CursorErrorReason {
    TooOld,
    InFuture,
}

/// `subscribe_cursor_error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscribeCursorError {
    pub reason: CursorErrorReason,
    pub requested: u64,
    pub available: u64,
}

/// `event_stream_hello`: first frame of every event stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventStreamHello {
    pub subscription_id: u64,
}

/// `event`: one event (JSON delivery form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payload: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

/// `event_batch`: several events (JSON delivery form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventBatchMsg {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payloads: Vec<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_offset: Option<u64>,
}

/// `subscription_lagged`: terminal frame after a queue drop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionLagged {
    pub subscription_id: u64,
    pub resume_from: u64,
}

/// `shard_moved`: terminal frame when the shard moved away.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardMoved {
    pub subscription_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    pub generation: u64,
}

/// `stream_deleted`: terminal frame when the stream was deleted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamDeleted {
    pub subscription_id: u64,
}

/// `stream_delete` (FEATURE_STREAM_ADMIN, our D43): delete a stream and everything it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamDelete {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub request_id: u64,
}

/// `stream_delete_ok`: `existed` says whether there was such a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamDeleteOk {
    pub request_id: u64,
    pub existed: bool,
}

// ---------------------------------------------------------------------------------------------
// Reading history

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

// ---------------------------------------------------------------------------------------------
// Cache

/// `cache_put`. `ttl_ms` is always written (`null` = no expiry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachePut {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub value: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    #[serde(default)]
    pub ttl_ms: Option<u64>,
}

/// `cache_get`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheGet {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
}

/// `cache_delete` (FEATURE_CACHE_DELETE): answered with the removed value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheDelete {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
}

/// `cache_value`. `value` is always written (`null` on a miss).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheValue {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    #[serde(default)]
    pub value: Option<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
}

/// `cache_ok`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheOk {
    pub request_id: u64,
}

/// A conditional cache write's condition: `"absent"` or `{"version": n}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheCondition {
    Absent,
    Version(u64),
}

/// `cache_put_if`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachePutIf {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub value: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    pub condition: CacheCondition,
    pub request_id: u64,
}

/// `cache_delete_if`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheDeleteIf {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub version: u64,
    pub request_id: u64,
}

/// `cache_condition_result`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheConditionResult {
    pub applied: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    pub request_id: u64,
}

/// `cache_watch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheWatch {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_offset: Option<u64>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub retained: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_id: Option<u64>,
}

/// `cache_watch_started`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheWatchStarted {
    pub subscription_id: u64,
    pub resume_offset: u64,
    #[serde(default)]
    pub resnapshot: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retained_count: Option<u64>,
}

/// `cache_event`: one change on a watch's event stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEvent {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<B64>,
    pub offset: u64,
    #[serde(default)]
    pub expires_at_millis: u64,
}

/// `cache_watch_lagged`: terminal frame of a watch that fell behind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheWatchLagged {
    pub resume_from: u64,
}

// ---------------------------------------------------------------------------------------------
// Counters

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

// ---------------------------------------------------------------------------------------------
// Consumer groups

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

/// `cache_keys` (D50, FEATURE_LISTING): a page of a cache's live keys, in byte order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheKeys {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    /// Only keys starting with this.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    /// Only keys after this one (the `next` of the previous page).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// Most keys (the broker caps it at 1000; 100 when absent).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    pub request_id: u64,
}

/// `cache_keys_view`: keys in byte order; `next` (the last key) when more follow.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheKeysView {
    pub keys: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    pub request_id: u64,
}

/// `group_list` (D50, FEATURE_LISTING): the consumer groups of one shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupList {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub request_id: u64,
}

/// One group of a `group_list_view`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GroupSummary {
    pub group: String,
    /// The next offset owed (absent: never started).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<u64>,
    /// Records from its position to the shard's tail.
    pub lag: u64,
    pub in_flight: u64,
    pub dead_letters: u64,
}

/// `group_list_view`: groups by name.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupListView {
    pub groups: Vec<GroupSummary>,
    pub request_id: u64,
}

/// `stream_list` (D51, FEATURE_STREAM_INFO): the streams of the token's tenant it may publish
/// to or read, by namespace and name, a page at a time.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamList {
    pub tenant_id: String,
    /// Only this namespace (absent: every namespace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// Start strictly after this `namespace/stream` (the previous page's `next`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    /// At most this many (100 when absent, at most 1000).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    pub request_id: u64,
}

/// `stream_create` (FEATURE_STREAM_CREATE, our D60): create many streams in one request, each
/// with its own shard count and replication.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamCreate {
    pub tenant_id: String,
    pub namespace: String,
    /// The streams (at least 1, at most [`MAX_STREAMS_PER_CREATE`], distinct names).
    pub streams: Vec<NewStream>,
    pub request_id: u64,
}

/// The most streams one `stream_create` names.
pub const MAX_STREAMS_PER_CREATE: usize = 10_000;

/// One stream of a `stream_create`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NewStream {
    pub stream: String,
    /// Shards (1..=4096; absent: the broker's default).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shards: Option<u32>,
    /// Replicas per shard (absent: the broker's default; above 1 only in a cluster).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<u32>,
    /// Kept on disk (absent: the broker's default; `false`: in memory only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub durable: Option<bool>,
}

/// `stream_create_ok`: the streams created (in a cluster: proposed to the metadata group,
/// which creates them on every broker once it commits) and those that already existed, with
/// their shard counts (left as they are).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamCreateOk {
    pub request_id: u64,
    pub created: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub existed: Vec<ExistingStream>,
}

/// A stream a `stream_create` named that existed already.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExistingStream {
    pub stream: String,
    pub shards: u32,
}

/// One stream of a `stream_list_view`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamEntry {
    pub namespace: String,
    pub stream: String,
    pub shards: u32,
}

/// `stream_list_view`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamListView {
    pub streams: Vec<StreamEntry>,
    /// The last entry's `namespace/stream` when more follow (the next page's `after`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next: Option<String>,
    pub request_id: u64,
}

/// `cluster_status` (D52, FEATURE_CLUSTER_ADMIN): the cluster as the answering broker sees
/// it, for an operator who holds the client address and a token rather than the metrics
/// listener.
///
/// `after` and `limit` (D55, only to a broker that advertises FEATURE_STATUS_PAGES) ask for
/// one page: the per-shard lists hold the shards after the cursor `after`, up to `limit` of
/// them with an owner (1,000 when absent, at most 5,000), and the document's `next` is the
/// cursor of the next page when more follow.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterStatus {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub after: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    pub request_id: u64,
}

/// `cluster_status_view`: `status` is the document `GET /cluster` serves (docs/cluster.md):
/// members, leader, shards with owners and generations, moves, this broker's replicas. For a
/// tenant's administrator it holds that tenant's shards only and no revocations;
/// `{"cluster": false}` from a broker that runs alone.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatusView {
    pub status: serde_json::Value,
    pub request_id: u64,
}

/// `shard_move` (D52): move one shard of a stream to another broker, or (`cancel`) give its
/// move up. Proposed to the metadata group; `cluster_status`'s `moves` shows it until done.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMove {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    /// The broker it goes to (its node id); absent with `cancel`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub to: Option<String>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub cancel: bool,
    pub request_id: u64,
}

/// `shard_move_ok`: the move (or its cancellation) was proposed; `proposed` says what.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardMoveOk {
    pub proposed: String,
    pub request_id: u64,
}

/// `stream_info` (D51): one shard of a stream, described by the broker that serves it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamInfo {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub request_id: u64,
}

/// `stream_info_view`: the stream's configuration and one shard's state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamInfoView {
    pub shards: u32,
    pub shard: u32,
    /// Kept on disk (offsets, history); false: in memory only.
    pub durable: bool,
    /// Copies of each shard (1: not replicated).
    pub replication: u32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_records: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_bytes: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retention_secs: Option<u64>,
    /// The oldest retained offset and the next offset to be written.
    pub start: u64,
    pub next_offset: u64,
    /// Records and payload bytes retained.
    pub records: u64,
    pub bytes: u64,
    /// Live subscriptions to this shard on this broker, and its consumer groups.
    pub subscribers: u64,
    pub groups: u64,
    pub request_id: u64,
}

/// `group_deleted`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupDeleted {
    pub existed: bool,
    pub request_id: u64,
}

// ---------------------------------------------------------------------------------------------
// Operator diagnostics (FEATURE_INSPECT)

/// `shard_inspect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInspect {
    pub tenant_id: String,
    pub namespace: String,
    pub name: String,
    pub kind: ShardKind,
    pub shard: u32,
    pub request_id: u64,
}

/// Assignment part of an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectAssignment {
    pub generation: u64,
    pub leader: String,
    pub replicas: Vec<String>,
    pub draining: bool,
    pub successor: String,
}

/// Fence part of an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectFence {
    pub took: Vec<String>,
    pub pending: Vec<String>,
    pub attempts: u32,
    pub retry_in_ms: u64,
}

/// Lease part of an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectLease {
    pub held: bool,
    pub remaining_ms: u64,
}

/// One replica in an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectReplica {
    pub node_id: String,
    pub role: String,
    pub next_offset: u64,
    pub lag: u64,
    pub fence: bool,
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halted: Option<String>,
}

/// A broker's own view of one shard. Words are open strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectView {
    pub node_id: String,
    pub shards: u32,
    pub role: String,
    pub phase: String,
    pub serving: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignment: Option<InspectAssignment>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<InspectFence>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<InspectLease>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_generation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<InspectReplica>>,
}

/// `shard_inspect_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInspectInfo {
    pub request_id: u64,
    pub view: Box<InspectView>,
}

/// Filter of `subscriptions_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct SubscriptionFilter {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropping: Option<bool>,
}

/// Paging cursor of `subscriptions_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionCursor {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub subscriber_id: u64,
}

/// `subscriptions_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionsList {
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<SubscriptionFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<SubscriptionCursor>,
}

/// One subscription in `subscriptions_list_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionInfo {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub subscriber_id: u64,
    pub subscription_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    pub policy: String,
    pub depth: u64,
    pub capacity: u64,
    pub dropped: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<u64>,
    pub tail: u64,
    pub age_ms: u64,
}

/// `subscriptions_list_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionsListInfo {
    pub request_id: u64,
    pub node_id: String,
    pub subscriptions: Vec<SubscriptionInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<SubscriptionCursor>,
}
