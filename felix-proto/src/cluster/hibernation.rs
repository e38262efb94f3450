//! Hibernation: shard groups with nothing to do stop ticking, as TiKV's hibernate regions do.
//!
//! Why: a broker hosts one Raft group per replicated shard. Ticked every [`TICK`](super::TICK), each costs a
//! walk of its state and, on the leader, a heartbeat to every follower every
//! [`HEARTBEAT_TICKS`] ticks: at thousands of groups an idle broker spends a third of a core
//! saying that nothing happened. A settled group (every replica holds the whole log, committed
//! and applied; nothing proposed, asked or moving) needs no timer: nothing in it can time out.
//!
//! How:
//! * A leader whose group stayed settled for [`QUIET_AFTER_TICKS`] ticks sends each follower a
//!   "sleep" heartbeat (context [`QUIET_CONTEXT`]) and stops ticking the group. A follower that
//!   follows it in that term and holds everything it was sent stops too; one that does not
//!   goes on ticking and, standing for election in time, wakes the leader.
//! * Anything else for the group wakes it: a proposal, any other message of its group (a
//!   vote request, an append from a new leader), a change of the metadata that concerns it
//!   (a move, a member declared down or draining), a replica's broker saying hello again or
//!   its connection lost.
//! * A leader's broker that dies says nothing, so every broker sends each peer that offered
//!   [`FEATURE_HIBERNATION`] an empty coalesced-heartbeats message every heartbeat interval,
//!   and wakes the groups a peer led once nothing was heard from it for [`PEER_SILENT_TICKS`]:
//!   their followers then stand for election as if the leader had stopped sending heartbeats
//!   (an election timeout later, as awake). O(peers) per tick, not O(groups). A peer heard
//!   again before then (busy, not dead) puts them back to sleep.
//! * Only groups whose every broker offered [`FEATURE_HIBERNATION`] sleep: an older follower
//!   would stand for election as soon as its leader went quiet.
//! * Asleep groups are visited a few per tick ([`SWEEP_PER_TICK`]) for what time alone changes:
//!   retention's compaction of their log, and a check that they may still sleep.
//!
//! Sleeping changes no Raft state and skips no message: it only withholds ticks, which Raft's
//! safety never depends on; liveness is what the wake-ups above keep.

use super::{ClusterNode, NodeOutput, raft_id};
use crate::broker::ReplicaRole;
use crate::cluster::meta::{ELECTION_TICKS, HEARTBEAT_TICKS};
use crate::cluster::metadata::{MemberState, ShardId};
use crate::cluster::peer::{FEATURE_HIBERNATION, PeerMessage};
use raft::eraftpb::{Message, MessageType};
use std::time::Instant;

/// The context of a leader's "sleep" heartbeat (see the module's documentation).
pub const QUIET_CONTEXT: &[u8] = b"felix:quiet";

/// Ticks a leader's group stays settled before it sleeps: a publisher pausing for less than
/// this keeps its group awake.
pub const QUIET_AFTER_TICKS: u32 = ELECTION_TICKS as u32;

/// Nothing heard from a peer for this many ticks wakes the groups it led or follows in: one
/// election timeout, so their followers stand about when they would have without hibernation.
/// Counted in ticks, as Raft counts a leader's silence: a broker too busy to tick on time
/// (thousands of groups waking at once) does not take the backlog for its peers' silence.
pub const PEER_SILENT_TICKS: u64 = ELECTION_TICKS as u64;

/// Sleeping groups visited per tick for retention and a check that they may still sleep.
pub const SWEEP_PER_TICK: usize = 64;

/// A hosted replica that stopped ticking, and why it may.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Sleep {
    /// It leads a settled group.
    Leading,
    /// It follows `leader` (a node id), which said its group was settled.
    Following { leader: String },
}

impl ClusterNode {
    /// Groups hosted here that sleep (do not tick).
    pub fn sleeping_replicas(&self) -> usize {
        self.replicas.values().filter(|h| h.sleep.is_some()).count()
    }

    /// The group of `shard` ticks again (see the module's documentation).
    pub(super) fn wake(&mut self, shard: &ShardId) {
        let Some(h) = self.replicas.get_mut(shard) else { return };
        if h.sleep.take().is_some() {
            h.settled_ticks = 0;
            // Asleep it was a member its leader put to sleep: counted as heard until now, so a
            // replica the metadata stops naming as its group wakes is not let go before the
            // leader's first heartbeat ([`super::linger`]).
            h.heard_at = self.ticks;
            self.awake.insert(shard.clone());
        }
    }

    /// Wakes every sleeping group `peer` leads or has a replica of.
    pub(super) fn wake_involving(&mut self, peer: &str) {
        let woken: Vec<ShardId> = self
            .replicas
            .iter()
            .filter(|(_, h)| match &h.sleep {
                Some(Sleep::Following { leader }) => leader == peer,
                Some(Sleep::Leading) => h.names.values().any(|n| n == peer),
                None => false,
            })
            .map(|(s, _)| s.clone())
            .collect();
        for s in woken {
            self.wake(&s);
        }
    }

    /// `peer` went silent: the groups it is in wake. Its followers then count an election
    /// timeout as they would have awake and stand if still nothing comes. The groups it led
    /// are remembered with their term: a peer that was only slow (busy, not dead) is heard
    /// again within that timeout, and they go back to sleep ([`Self::heard_again`]) rather
    /// than thousands of groups electing anew because one broker paused for a second.
    fn wake_led_by_silent(&mut self, peer: &str) {
        let led: Vec<(ShardId, u64)> = self
            .replicas
            .iter()
            .filter(|(_, h)| matches!(&h.sleep, Some(Sleep::Following { leader }) if leader == peer))
            .map(|(s, h)| (s.clone(), h.replica.term()))
            .collect();
        self.wake_involving(peer);
        if !led.is_empty() {
            self.woken_by_silence.insert(peer.to_owned(), led);
        }
    }

    /// `peer`, found silent, was heard again: the groups its silence woke go back to sleep
    /// where nothing happened meanwhile (still following it in the same term, holding
    /// everything); the others stay awake.
    pub(super) fn heard_again(&mut self, peer: &str) {
        let Some(woken) = self.woken_by_silence.remove(peer) else { return };
        let leader = raft_id(peer);
        for (shard, term) in woken {
            let Some(h) = self.replicas.get_mut(&shard) else { continue };
            if h.sleep.is_none() && h.replica.settled_under(leader, term) && !self.rejoining.contains_key(&shard) {
                h.sleep = Some(Sleep::Following { leader: peer.to_owned() });
                h.settled_ticks = 0;
                self.awake.remove(&shard);
            }
        }
    }

    /// Whether `peer` (a node id) lets groups sleep: it offered [`FEATURE_HIBERNATION`], is an
    /// active member, was heard from lately and is not refused.
    fn peer_sleeps(&self, peer: &str) -> bool {
        self.offers & FEATURE_HIBERNATION != 0
            && self.peer_features.get(peer).is_some_and(|f| f & FEATURE_HIBERNATION != 0)
            && self.metadata.members().get(peer).is_some_and(|m| m.state == MemberState::Active)
            && !self.silent.contains(peer)
            && !self.refused.contains(peer)
    }

    /// On this broker, leading `shard`'s group: whether the group may sleep now (everything but
    /// how long it has been settled).
    fn may_sleep_leading(&self, shard: &ShardId) -> bool {
        let Some(h) = self.replicas.get(shard) else { return false };
        if h.role != Some(ReplicaRole::Leading)
            || !h.replica.settled()
            || !h.rejoins.is_empty()
            || !h.behind.is_empty()
            || self.rejoining.contains_key(shard)
            || self.broker.is_fenced()
            || self.broker.wants_read_lease(shard)
            || self.metadata.moving(shard).is_some()
            || self.metadata.owner(shard).is_none_or(|a| a.owner != self.me.id)
            || self.metadata.members().get(&self.me.id).is_none_or(|m| m.state != MemberState::Active)
        {
            return false;
        }
        // The group is the one the metadata names (no configuration change half done), and
        // every other replica's broker sleeps groups too.
        let Some(members) = self.metadata.replicas(shard) else { return false };
        let mut wanted: Vec<u64> = members.iter().map(|n| raft_id(n)).collect();
        wanted.sort_unstable();
        let mut voters = h.replica.voters();
        voters.sort_unstable();
        voters == wanted && members.iter().all(|n| *n == self.me.id || self.peer_sleeps(n))
    }

    /// Whether a sleeping group may go on sleeping (what the metadata or a peer's state says
    /// now); `false` wakes it.
    fn may_stay_asleep(&self, shard: &ShardId) -> bool {
        let Some(h) = self.replicas.get(shard) else { return false };
        match &h.sleep {
            Some(Sleep::Leading) => self.may_sleep_leading(shard),
            Some(Sleep::Following { leader }) => {
                self.peer_sleeps(leader)
                    && !self.rejoining.contains_key(shard)
                    && self.metadata.moving(shard).is_none()
                    && self.metadata.replicas(shard).is_some_and(|r| r.contains(leader) && r.contains(&self.me.id))
            }
            None => true,
        }
    }

    /// At a tick, for an awake group this broker leads: counts the ticks it has been settled
    /// and, after [`QUIET_AFTER_TICKS`], sends its followers the sleep heartbeat and stops
    /// ticking it.
    pub(super) fn consider_sleep(&mut self, shard: &ShardId) {
        if !self.may_sleep_leading(shard) {
            if let Some(h) = self.replicas.get_mut(shard) {
                h.settled_ticks = 0;
            }
            return;
        }
        let Some(h) = self.replicas.get_mut(shard) else { return };
        h.settled_ticks += 1;
        if h.settled_ticks < QUIET_AFTER_TICKS {
            return;
        }
        if self.hand_to_preferred(shard) {
            return;
        }
        let Some(h) = self.replicas.get_mut(shard) else { return };
        let (last, _) = h.replica.indexes();
        let (me, term) = (h.replica.id(), h.replica.term());
        for id in h.replica.voters() {
            let Some(name) = h.names.get(&id).filter(|_| id != me) else { continue };
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgHeartbeat);
            m.from = me;
            m.to = id;
            m.term = term;
            m.commit = last;
            m.context = QUIET_CONTEXT.to_vec().into();
            self.shard_sends
                .entry(name.clone())
                .or_default()
                .push((shard.clone(), crate::cluster::meta::encode_message_parts(&m)));
        }
        h.sleep = Some(Sleep::Leading);
        h.settled_ticks = 0;
        self.awake.remove(shard);
    }

    /// A settled group led here, whose preferred replica (the first the metadata names, which
    /// stands first when nobody leads) is another active broker: hands it the leadership,
    /// once a term and a few groups per tick, and returns `true`. Leaderships spread as
    /// placement chose them, whatever the races of elections (after thousands of groups
    /// elected at once, one broker of three led 741 of 10,000 and another 5,329), as Kafka's
    /// preferred leader election does; so a broker's death moves its share, not more. The
    /// group sleeps once settled under its new leader.
    fn hand_to_preferred(&mut self, shard: &ShardId) -> bool {
        if self.handovers_left == 0 {
            return false;
        }
        let Some(preferred) = self.metadata.replicas(shard).and_then(|r| r.first()).cloned() else { return false };
        let active = self.metadata.members().get(&preferred).is_some_and(|m| m.state == MemberState::Active);
        if preferred == self.me.id || !active || self.silent.contains(&preferred) {
            return false;
        }
        let Some(h) = self.replicas.get_mut(shard) else { return false };
        let term = h.replica.term();
        if h.preferred_tried == Some(term) {
            return false;
        }
        h.preferred_tried = Some(term);
        h.settled_ticks = 0;
        h.replica.transfer_leader(raft_id(&preferred));
        self.handovers_left -= 1;
        self.handovers += 1;
        let now = self.last_now;
        self.drain_replica(shard, now);
        true
    }

    /// After a message of `shard`'s group from peer `from` was stepped: a sleep heartbeat
    /// puts a follower holding everything to sleep, a leader's sleeping group stays asleep on
    /// the answers to its own; anything else wakes the group.
    pub(super) fn after_group_message(&mut self, shard: &ShardId, from: &str, kind: MessageType, quiet: bool) {
        let asleep = match self.replicas.get(shard) {
            None => return,
            Some(h) => match kind {
                MessageType::MsgHeartbeat if quiet => {
                    h.replica.settled_under(raft_id(from), h.replica.term())
                        && self.peer_sleeps(from)
                        && !self.rejoining.contains_key(shard)
                }
                MessageType::MsgHeartbeatResponse if quiet => {
                    h.sleep == Some(Sleep::Leading) && self.may_sleep_leading(shard)
                }
                _ => false,
            },
        };
        if !asleep {
            self.wake(shard);
            return;
        }
        if kind == MessageType::MsgHeartbeat
            && let Some(h) = self.replicas.get_mut(shard)
        {
            h.sleep = Some(Sleep::Following { leader: from.to_owned() });
            h.settled_ticks = 0;
            self.awake.remove(shard);
        }
    }

    /// A tick's share of hibernation: the empty heartbeat to each peer that offered it (every
    /// [`HEARTBEAT_TICKS`] ticks), peers gone silent, sleeping groups the metadata's last
    /// changes concern, and a few sleeping groups' retention.
    pub(super) fn hibernation_tick(&mut self, now: Instant) {
        if self.offers & FEATURE_HIBERNATION == 0 {
            return;
        }
        let peers: Vec<String> = self
            .peer_features
            .iter()
            .filter(|(n, f)| **f & FEATURE_HIBERNATION != 0 && **n != self.me.id && !self.refused.contains(*n))
            .filter(|(n, _)| self.metadata.members().contains_key(*n))
            .map(|(n, _)| n.clone())
            .collect();
        for peer in peers {
            if self.ticks.is_multiple_of(HEARTBEAT_TICKS as u64) {
                self.out.push_back(NodeOutput::Peer { to: peer.clone(), message: PeerMessage::Heartbeats(Vec::new()) });
            }
            let heard = self.heard_at.get(&peer).copied().unwrap_or(0);
            if self.ticks.saturating_sub(heard) > PEER_SILENT_TICKS && self.silent.insert(peer.clone()) {
                self.wake_led_by_silent(&peer);
            }
        }
        if self.quiet_checked != self.metadata_changes {
            self.quiet_checked = self.metadata_changes;
            let asleep: Vec<ShardId> =
                self.replicas.iter().filter(|(_, h)| h.sleep.is_some()).map(|(s, _)| s.clone()).collect();
            for s in asleep {
                if !self.may_stay_asleep(&s) {
                    self.wake(&s);
                }
            }
        }
        // A few sleeping groups, in turn: what retention dropped leaves their log too, and
        // what changed without a message (a read lease wanted) wakes them.
        use std::ops::Bound;
        let start = self.sweep_after.take();
        let from = start.as_ref().map_or(Bound::Unbounded, Bound::Excluded);
        let range: Vec<ShardId> = self
            .replicas
            .range::<ShardId, _>((from, Bound::Unbounded))
            .filter(|(_, h)| h.sleep.is_some())
            .take(SWEEP_PER_TICK)
            .map(|(s, _)| s.clone())
            .collect();
        let mut visited = 0;
        let mut last = None;
        for s in range {
            visited += 1;
            if !self.may_stay_asleep(&s) {
                self.wake(&s);
            } else if let Some(floor) = self.broker.replicated_start(&s)
                && let Some(h) = self.replicas.get_mut(&s)
                && h.replica.compact_below(floor)
            {
                self.drain_replica(&s, now);
            }
            last = Some(s);
        }
        // A short turn reached the end: the next starts from the first again.
        if visited == SWEEP_PER_TICK {
            self.sweep_after = last;
        }
    }
}
