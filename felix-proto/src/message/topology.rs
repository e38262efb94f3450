//! Topology and shard discovery: brokers, shard counts, owners, `not_leader`.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use serde::{Deserialize, Serialize};

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
