//! Lingering replicas: a replica the metadata no longer names, kept while its group may still
//! count it a voter.
//!
//! Why: two things say who is in a replicated shard's group, and they change apart. The
//! metadata names the replicas (a move's finish or cancel changes it at once); the group's Raft
//! configuration says who votes (its leader changes it, one conf change at a time, and only
//! while it can commit). A broker that dropped its replica as soon as the metadata stopped
//! naming it could leave a group counting a voter that holds nothing:
//! * `felix-node sim --cluster --clients`, seed 545887: a replica move's target was added as a
//!   voter, the move was cancelled, and the target dropped its replica at once. The group of
//!   four (three named, the target) then had two voters able to vote: the third named one had
//!   dropped and restarted its own replica the same way, so its log was gone and it granted no
//!   vote ("rejoining"). No leader, so nobody could take the extra voter out: "electing a
//!   leader" for good once healed.
//!
//! So such a replica lingers: it keeps its log and answers its group (votes, acknowledges
//! appends) while its group shows it still counts it (a request came lately), and is dropped
//! once nothing has come for [`LINGER_TICKS`]. It stands for nothing (it does not tick, so
//! never campaigns: its own configuration can be one its group left long ago, and its vote
//! requests woke sleeping followers, which then stood against their sleeping leader over and
//! over, seed 586), and its broker serves the shard by the metadata, as any other broker does.
//! A metadata that names it again (a new move to it) finds its log still there.

use super::{ClusterNode, Hosted, Replica};
use crate::cluster::metadata::ShardId;
use raft::eraftpb::{Message, MessageType};

/// Ticks a lingering replica is kept after the last request its group sent it. While the
/// group counts it, its leader's appends or heartbeats or its candidates' vote requests keep
/// coming; once the leader removed it nothing does. Thirty seconds: many election timeouts, so
/// a group that counts it is not mistaken for one that does not, and only a partition that long
/// (and a second fault) can still cost the group that vote.
pub const LINGER_TICKS: u64 = 300;

/// [`LINGER_TICKS`] for a replica whose applied configuration no longer lists it (the usual
/// end of a move's leaving replica): three election timeouts, as a leader that adds it back
/// says so within a heartbeat.
pub const REMOVED_LINGER_TICKS: u64 = 3 * super::super::meta::ELECTION_TICKS as u64;

/// Whether a replica the metadata no longer names is kept: it holds something its group may
/// count on (an empty one, a target that never heard from its group, acknowledged nothing),
/// and it sleeps in a settled group (whose leader put it to sleep as a member) or heard from
/// its group lately.
fn lingers(h: &Hosted, ticks: u64) -> bool {
    let holds = h.replica.indexes().0 > 0;
    let voters = h.replica.voters();
    let removed = !voters.is_empty() && !voters.contains(&h.replica.id());
    let linger = if removed { REMOVED_LINGER_TICKS } else { LINGER_TICKS };
    holds && (h.sleep.is_some() || ticks.saturating_sub(h.heard_at) < linger)
}

/// Whether `msg`, sent to a replica, shows that its sender counts it a member of the group:
/// leaders send appends, heartbeats, snapshots and hand-overs only to members, candidates ask
/// only members for votes. Answers do not: a replica asks anyone.
pub(super) fn counts_as_member(msg: &Message) -> bool {
    matches!(
        msg.get_msg_type(),
        MessageType::MsgAppend
            | MessageType::MsgHeartbeat
            | MessageType::MsgSnapshot
            | MessageType::MsgRequestVote
            | MessageType::MsgRequestPreVote
            | MessageType::MsgTimeoutNow
    )
}

/// A leader hands its lead to the voter holding the most, other than itself: a leader the
/// metadata no longer names (lingering), or one removed from its group, or one whose claims are
/// stale. Never by removing itself: the engine's leader that applied its own removal fails at
/// its next commit (raft-rs `maybe_commit` unwraps its own progress; a lingering leader reached
/// it, `felix-node sim --cluster --clients`), so the voter it hands to removes it.
pub(super) fn hand_lead_on(replica: &mut Replica) {
    let (me, voters) = (replica.id(), replica.voters());
    let best = replica.progress().into_iter().filter(|(id, _)| *id != me && voters.contains(id)).max_by_key(|p| p.1);
    if let Some((id, _)) = best {
        replica.transfer_leader(id);
    }
}

impl ClusterNode {
    /// Whether the metadata names this broker a replica of `shard`, or the target of its move
    /// (a replica of it from the moment it joins the group).
    pub(super) fn names_me(&self, shard: &ShardId) -> bool {
        self.metadata.replicas(shard).is_some_and(|r| r.contains(&self.me.id))
            || self.metadata.moving(shard).is_some_and(|m| m.to == self.me.id)
    }

    /// Whether this broker's replica `h` of `shard` goes: the shard was deleted, or the metadata
    /// no longer names this broker and the replica does not linger.
    pub(super) fn leaves(&self, shard: &ShardId, h: &Hosted) -> bool {
        self.metadata.replicas(shard).is_none() || (!self.names_me(shard) && !lingers(h, self.ticks))
    }

    /// Replicas kept here although the metadata no longer names this broker one: their
    /// groups may still count them ([`LINGER_TICKS`]).
    pub fn lingering_replicas(&self) -> usize {
        self.replicas.keys().filter(|s| !self.names_me(s)).count()
    }
}
