//! What a broker holds for everyone, apart from any one connection: its streams (their shards,
//! logs and subscribers' positions), caches, consumer groups, the writes and reads storage is
//! working on, and the per-tenant limits. `Broker` is this node plus its connections
//! ([`Conn`]), so a method can borrow the node and one connection's state at once, as
//! quinn-proto's `Endpoint` and `Connection` are apart (issue 35).

use super::*;

/// See the [module](self).
#[derive(Debug, Default)]
pub(super) struct Node {
    /// Streams by key: their configuration and shards.
    pub(super) streams: HashMap<Key, StreamEntry>,
    /// Streams whose retention is by age (they need the once-a-second sweep).
    pub(super) aged_streams: usize,
    /// Caches by key.
    pub(super) caches: HashMap<Key, Cache>,
    /// Writes storage is working on, by token.
    pub(super) writes: HashMap<WriteToken, WriteCtx>,
    /// Operations proposed to replicated caches' groups, waiting for their answer.
    pub(super) cache_writes: std::collections::BTreeMap<WriteToken, quorum_cache::CacheWrite>,
    /// Consumer-group settlements proposed to replicated shards, by the token of their entry.
    pub(super) group_proposals: std::collections::BTreeMap<WriteToken, consume::GroupProposal>,
    /// Reads storage is working on, by token.
    pub(super) reads: HashMap<ReadToken, ReadFor>,
    /// Counters by cache, folded from their system logs.
    pub(super) counters: HashMap<Key, syslog::Counters>,
    /// Consumer groups by (stream, shard), then name.
    pub(super) groups: HashMap<(Key, u32), HashMap<String, group::Group>>,
    /// Durable group operations since the last checkpoint, per `$groups` log.
    pub(super) group_ops: HashMap<Key, u64>,
    /// Cache watches by cache.
    pub(super) cache_watchers: HashMap<Key, Vec<(ConnId, u64)>>,
    /// `stream_create` requests waiting for storage (D60).
    pub(super) creates: create::Creates,
    /// Subscription filters (D57), interned: looked up, never iterated in an order that
    /// decides output.
    pub(super) filters: HashMap<message::KeyFilter, std::sync::Weak<message::KeyFilter>>,
    /// Per-tenant publish rate limits.
    pub(super) limits: limits::RateLimits,
}
