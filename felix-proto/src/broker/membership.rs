//! What a broker holds as a member of a cluster: the view of the metadata it routes by,
//! publishes and requests it forwarded and serves for others, operators' requests, moves in
//! and out, fencing, the move budget, cluster-wide revocations. On a single broker all of it
//! stays empty. Kept apart from the broker's own state (connections, shards, logs, caches) so
//! the two are told apart by type.

use super::*;

/// See the [module](self).
#[derive(Debug)]
pub(crate) struct Membership {
    /// The cluster this broker belongs to, as its metadata last said ([`ownership`]).
    pub(super) view: Option<crate::shard::view::ClusterView>,
    /// Acked publishes forwarded to their owner and not answered yet, by forward id. A
    /// `BTreeMap`: ids grow, so inserts land at its end and answers (mostly in order) remove
    /// near its start, without hashing a key per forwarded batch; and walking it goes in the
    /// order they were forwarded, which is the order their answers must take.
    pub(super) forwards: std::collections::BTreeMap<u64, forward::Forwarding>,
    pub(super) forward_deadlines: std::collections::BTreeSet<(Instant, u64)>,
    pub(super) next_forward: u64,
    /// Cache and counter requests forwarded to the cache's owner, by forward id.
    pub(super) request_forwards: HashMap<u64, forward_request::PendingRequest>,
    /// Operator requests the cluster node is answering, by id (from `next_forward`).
    pub(super) admin: std::collections::BTreeMap<u64, cluster_admin::PendingAdmin>,
    /// Requests this broker serves for others (it owns their caches).
    pub(super) served: forward_request::Served,
    /// In a cluster, this broker lost contact with the metadata leader (its lease may have
    /// lapsed and its shards been given to others): it serves none of its own shards.
    pub(super) fenced: bool,
    /// Moves of shards this broker owns, to others.
    pub(super) moves_out: std::collections::BTreeMap<crate::shard::ShardId, moves::Outgoing>,
    /// Moves of shards to this broker: their copies.
    pub(super) moves_in: std::collections::BTreeMap<crate::shard::ShardId, moves::Incoming>,
    /// The byte budget of moves' copies, to and from this broker (`--move-bandwidth`); the
    /// cluster node charges replicated shards' catch-up to it too.
    pub(crate) move_bandwidth: crate::shard::bandwidth::Bandwidth,
    /// Copied batches being written.
    pub(super) import_writes:
        std::collections::BTreeMap<WriteToken, (crate::shard::ShardId, crate::storage::StoredBatch)>,
    /// Signed tokens revoked through the cluster's metadata (by id, by principal), besides the
    /// revocations of the broker's own configuration.
    pub(super) revoked: (std::collections::BTreeSet<String>, std::collections::BTreeSet<String>),
    /// Every member reads a replicated stream's commit state in its snapshots (peer hello bit
    /// `FEATURE_COMMIT_STATE`), so retention may compact a replicated shard that holds state.
    pub(super) commit_state_snapshots: bool,
}

impl Default for Membership {
    fn default() -> Membership {
        Membership {
            view: None,
            forwards: std::collections::BTreeMap::new(),
            forward_deadlines: std::collections::BTreeSet::new(),
            next_forward: 1,
            request_forwards: HashMap::new(),
            admin: std::collections::BTreeMap::new(),
            served: forward_request::Served::default(),
            fenced: false,
            moves_out: Default::default(),
            moves_in: Default::default(),
            move_bandwidth: crate::shard::bandwidth::Bandwidth::new(None),
            import_writes: Default::default(),
            revoked: Default::default(),
            commit_state_snapshots: false,
        }
    }
}
