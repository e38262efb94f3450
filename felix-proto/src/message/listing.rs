//! Listing and operators' requests: cache keys, groups, streams, stream creation, cluster status, shard moves, stream info.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::*;
use serde::{Deserialize, Serialize};

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
