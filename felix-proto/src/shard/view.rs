//! What a broker knows of the cluster it belongs to ([`ClusterView`]): the metadata group's
//! state as applied on that broker (members serving clients, every shard's owner, shards
//! unavailable, moves, replicas). Data only: the broker's `ownership` builds it from
//! [`ClusterFacts`](crate::shard::metadata::ClusterFacts) after each committed change and routes
//! by it.

use super::{Kind, ShardId};
use std::collections::BTreeMap;

/// What this broker knows of the cluster it belongs to.
#[derive(Debug, Clone, Default)]
pub(crate) struct ClusterView {
    /// Active members that serve clients: node id → client address.
    pub(crate) brokers: Vec<(String, String)>,
    /// Every shard's owner: node id, client address, generation.
    pub(crate) owners: BTreeMap<ShardId, (String, Option<String>, u64)>,
    /// Shards whose owner is down with their records.
    pub(crate) unavailable: std::collections::BTreeSet<ShardId>,
    /// This broker's node id.
    pub(crate) local: String,
    /// Moves in progress.
    pub(crate) moves: BTreeMap<ShardId, crate::shard::metadata::Move>,
    /// Replicated shards' replicas.
    pub(crate) replicas: BTreeMap<ShardId, Vec<String>>,
}

impl ClusterView {
    /// How many shards the registry gives the stream or cache of `id`, if it has it.
    pub(crate) fn shard_count(&self, id: &ShardId) -> Option<u32> {
        let first = ShardId { shard: 0, ..id.clone() };
        let n = self
            .owners
            .range(first..)
            .take_while(|(s, _)| {
                (s.kind, &s.tenant, &s.namespace, &s.name) == (id.kind, &id.tenant, &id.namespace, &id.name)
            })
            .count();
        (n > 0).then_some(n as u32)
    }

    /// Whether the cluster's registry has this stream.
    pub(crate) fn knows_stream(&self, t: &str, ns: &str, s: &str) -> bool {
        let first = ShardId { kind: Kind::Stream, tenant: t.into(), namespace: ns.into(), name: s.into(), shard: 0 };
        self.owners.contains_key(&first)
    }
}
