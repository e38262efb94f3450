//! What every broker of a cluster agrees on, as data the broker and the cluster both name:
//! members, owners, moves, and the [`Command`]s the metadata group commits; and
//! [`ClusterFacts`], the metadata as a broker reads it. The metadata state machine that applies
//! commands is [`crate::cluster::metadata::Metadata`]; the broker takes it as `impl
//! ClusterFacts`, so it never names the cluster module.

use super::{Kind, ShardId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Whether a member takes shards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemberState {
    /// Owns its share of shards.
    Active,
    /// Being emptied: owns nothing, still a member (left out of `topology`).
    Draining,
    /// Declared down by the leader (its lease ran out): its in-memory shards went to the others;
    /// its durable shards stay its own and are unavailable until it comes back (a `Join`), as
    /// nobody else holds their records.
    Down,
}

/// A broker of the cluster.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Member {
    /// Node id (unique, never reused for another broker).
    pub id: String,
    /// Where clients reach it.
    pub client_addr: String,
    /// Where brokers reach it.
    pub cluster_addr: String,
    /// Active or draining.
    pub state: MemberState,
    /// Which life of its data directory the broker is in: chosen at random when its data
    /// directory is first used, kept there. A broker that comes back with another one lost its
    /// Raft state and records (a wiped data directory) and is refused by its peers.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub incarnation: String,
}

/// Who owns a shard, and since which change.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Assignment {
    /// The owning member.
    pub owner: String,
    /// Bumped on every change of owner; only grows.
    pub generation: u64,
}

/// A shard on its way from one broker to another. Only a single-replica durable stream shard
/// moves this way (its records are on its owner alone, so they are copied first); an in-memory
/// shard just changes owner, and a replicated shard's replicas are its Raft group's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Move {
    /// The owner it leaves (it serves on until the move is done).
    pub from: String,
    /// The broker it goes to (it copies the shard's records meanwhile).
    pub to: String,
    /// Where the move stands.
    pub phase: MovePhase,
}

/// Where a [`Move`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "phase", rename_all = "snake_case")]
pub enum MovePhase {
    /// The new owner copies the shard's records from the old one, which serves on.
    CatchingUp,
    /// The old owner stopped taking writes with its tail at `at`: the new owner copies what is
    /// below `at`, then takes over ([`Command::FinishMove`]).
    CutOver {
        /// The old owner's tail: the first offset the new owner writes.
        at: u64,
    },
}

/// A change to the metadata, as the metadata group commits it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Command {
    /// A broker joins (or comes back active with new addresses).
    Join {
        /// The member.
        member: Member,
    },
    /// A broker hands its shards to the others and takes no more.
    Drain {
        /// Node id.
        id: String,
    },
    /// A broker leaves the cluster (or is declared dead): its shards go to the others.
    Remove {
        /// Node id.
        id: String,
    },
    /// A stream or cache is created with `shards` shards.
    Create {
        /// Stream or cache.
        kind: Kind,
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
        /// Shard count (at least 1).
        shards: u32,
        /// Kept in memory only: its shards move freely when their owner goes down.
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        ephemeral: bool,
        /// Replicas of each shard (`quorum` durability): 0 or 1 is a single replica on its
        /// owner's disk; more makes every shard its own Raft group over that many brokers.
        #[serde(default, skip_serializing_if = "is_single")]
        replication: u32,
    },
    /// A replica of a replicated shard says it leads the shard's Raft group in `term` (its
    /// generation-start record committed): it becomes the shard's owner, and the shard's
    /// generation grows. An older term than the one recorded changes nothing.
    Lead {
        /// The shard.
        shard: ShardId,
        /// The leading replica's node id.
        node: String,
        /// Its Raft term.
        term: u64,
    },
    /// The leader declares a member down (it has not been heard from for a lease).
    MarkDown {
        /// Node id.
        id: String,
    },
    /// A broker becomes a voter of the metadata group (an operator's `cluster add`). Carried
    /// as a Raft configuration change; it changes no metadata (the broker then joins).
    AddVoter {
        /// Node id.
        id: String,
        /// Where brokers reach it (empty for a founding voter: every broker was given those).
        #[serde(default, skip_serializing_if = "String::is_empty")]
        cluster_addr: String,
    },
    /// A broker stops being a voter and leaves (an operator's `cluster remove`): a Raft
    /// configuration change, and its shards go to the others like [`Command::Remove`].
    RemoveVoter {
        /// Node id.
        id: String,
        /// The operator accepted losing the records only it held (its durable shards).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        force: bool,
    },
    /// A signed token is revoked on every broker of the cluster (an operator's `cluster
    /// revoke`), by its id (`jti`) and/or its principal (`sub`): what it opened ends `revoked`
    /// and it no longer authenticates, whatever each broker's own files say.
    Revoke {
        /// The token id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        jti: Option<String>,
        /// The principal: every token it holds.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        sub: Option<String>,
    },
    /// An operator moves a stream shard to broker `to` (`cluster move`): an in-memory shard
    /// changes owner at once; a durable one starts a [`Move`]. The shard stays on `to` until
    /// an operator moves it again or `to` stops being active (placement leaves it there).
    MoveShard {
        /// The shard.
        shard: ShardId,
        /// The broker it goes to.
        to: String,
    },
    /// A replicated shard's replica on `from`, a follower or its leader, goes to broker `to`
    /// outside its group: `to` joins the group, catches up, and `from` leaves it (handing the
    /// leadership over first if it leads), done with [`Command::FinishMove`], `to` in
    /// `from`'s place. [`Command::MoveShard`] always replaces the leader's replica; this
    /// moves the replica of the broker holding the most (replica balancing, D61). Proposed
    /// only when every member offered `FEATURE_REPLICA_MOVES`: an older broker cannot read it.
    MoveReplica {
        /// The shard.
        shard: ShardId,
        /// The replica that leaves.
        from: String,
        /// The broker outside the group that takes its place.
        to: String,
    },
    /// The old owner of a moving shard stopped taking writes, its tail at `at` ([`MovePhase::CutOver`]).
    CutOver {
        /// The shard.
        shard: ShardId,
        /// The old owner (a stale proposal from another changes nothing).
        from: String,
        /// Its tail.
        at: u64,
    },
    /// The new owner of a cut-over shard holds every record below `at`: it owns the shard now
    /// (the next generation), and the old owner's readers end with `shard_moved`.
    FinishMove {
        /// The shard.
        shard: ShardId,
        /// The new owner.
        to: String,
        /// The cut-over tail it copied up to.
        at: u64,
    },
    /// A move is given up (an operator's `cluster move --cancel`, or the old owner when the
    /// new one did not finish in time): the old owner keeps the shard and serves it again at
    /// the next generation; placement leaves it there until an operator moves it.
    CancelMove {
        /// The shard.
        shard: ShardId,
    },
    /// Placement may move every shard again (an operator's `cluster rebalance`): what
    /// operators placed and cancelled moves left is placed afresh.
    Rebalance,
    /// A stream or cache is deleted.
    Delete {
        /// Stream or cache.
        kind: Kind,
        /// Tenant.
        tenant: String,
        /// Namespace.
        namespace: String,
        /// Name.
        name: String,
    },
}

fn is_single(r: &u32) -> bool {
    *r <= 1
}

/// The cluster's metadata as a broker reads it to route, forward, fence and move shards
/// (implemented by [`crate::cluster::metadata::Metadata`], whose methods of the same names
/// document each).
pub trait ClusterFacts {
    /// Every member, by node id.
    fn members(&self) -> &BTreeMap<String, Member>;
    /// Whether member `id` is gone (not a member, or declared down).
    fn is_gone(&self, id: &str) -> bool;
    /// Every shard's owner.
    fn owners(&self) -> &BTreeMap<ShardId, Assignment>;
    /// A shard's owner.
    fn owner(&self, shard: &ShardId) -> Option<&Assignment>;
    /// A replicated shard's replicas.
    fn replicas(&self, shard: &ShardId) -> Option<&[String]>;
    /// Every replicated shard with its replicas.
    fn replicated_shards(&self) -> impl Iterator<Item = (&ShardId, &[String])>;
    /// A stream's or cache's replication factor (1 when not replicated).
    fn replication(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> u32;
    /// A stream's or cache's shard count, if registered.
    fn shard_count(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> Option<u32>;
    /// Whether a registered name is kept in memory only.
    fn is_ephemeral(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> bool;
    /// Moves in progress.
    fn moves(&self) -> &BTreeMap<ShardId, Move>;
    /// A shard's move in progress.
    fn moving(&self, shard: &ShardId) -> Option<&Move>;
    /// Whether a shard cannot be served now (its owner down with records only it holds).
    fn unavailable(&self, shard: &ShardId) -> bool;
    /// Signed tokens revoked cluster-wide, by id.
    fn revoked_jti(&self) -> &BTreeSet<String>;
    /// Signed tokens revoked cluster-wide, by principal.
    fn revoked_sub(&self) -> &BTreeSet<String>;
}
