//! One member of a Raft group, on tikv's `raft` engine, driven sans-IO: time comes in as ticks,
//! messages from peers come in as inputs, and messages to peers and committed commands come out
//! of [`MetaNode::poll_output`]. The election, the log and its replication are the engine's; this
//! module only runs its ready loop (persist, send, apply, advance) and makes it deterministic.
//!
//! Determinism: the engine draws each election timeout at random from
//! `[min_election_tick, max_election_tick)`. Here that range holds one value per node, staggered
//! by node id, so the same inputs give the same elections (the simulation replays seeds), and
//! the lowest id times out first when nobody leads.
//!
//! Storage: the engine works on its `MemStorage`; what must survive a crash comes out as
//! [`MetaOutput::Persist`] (new log entries, the hard state), *before* the messages that depend
//! on it, and the driver makes it durable before it carries out the next output. A member
//! restarts from what was kept ([`RaftLog`], [`MetaNode::restart`]) and replays its committed
//! commands, so the metadata is rebuilt by applying them again.

// The engine's storage and the log kept on disk: child modules of this one, in files of
// their own (the shape `node` has).
#[path = "meta_log.rs"]
mod log;
#[path = "meta_store.rs"]
mod store;

pub use log::*;
use raft::eraftpb::{ConfChange, ConfChangeType, ConfState, EntryType, Message};
pub use raft::eraftpb::{Entry, HardState, Snapshot};
use raft::storage::MemStorage;
use raft::{Config, GetEntriesContext, RawNode, StateRole, Storage};
use std::collections::VecDeque;
pub use store::Spill;
use store::{EntryCache, GroupStore, OnDisk};

/// Ticks without a heartbeat before a follower stands for election (before staggering).
pub const ELECTION_TICKS: usize = 10;
/// Ticks between a leader's heartbeats.
pub const HEARTBEAT_TICKS: usize = 3;
/// The most entry bytes one append message carries (at least one entry, whatever its size).
pub const MAX_APPEND_BYTES: u64 = 1 << 20;

/// Why a Raft input was refused.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// Only the leader takes proposals; the client is told who leads, when known.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader this node knows of.
        leader: Option<u64>,
    },
    /// The engine refused the input (a bad configuration, a message for another group).
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    /// A message from a peer that does not decode.
    #[error("undecodable raft message: {0}")]
    Decode(String),
}

/// What the node asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaOutput {
    /// Make these durable before carrying out any later output: the entries replace the log
    /// from the first one's index on (a new leader may overwrite an uncommitted tail), and the
    /// hard state (term, vote, commit) replaces the old one. Fold it into a [`RaftLog`].
    Persist {
        /// New entries, in index order (may be empty).
        entries: Vec<Entry>,
        /// The new hard state, when it changed.
        hard_state: Option<HardState>,
    },
    /// Make this snapshot durable before carrying out any later output: it stands for the log
    /// up to its index (entries at or below it are dropped; later ones stay if the entry at
    /// its index has its term, else all go). Fold it into a [`RaftLog`] with
    /// [`RaftLog::persist_snapshot`].
    PersistSnapshot {
        /// The snapshot (its data is the state machine's, at its index).
        snapshot: Snapshot,
        /// It came from the leader (this member was behind its compacted log): the state
        /// machine is restored from its data, and the committed entries after it follow.
        /// Otherwise this member compacted its own log ([`MetaNode::compact`]).
        received: bool,
    },
    /// Send this message to peer `to` (encode it with [`encode_message`]).
    Send {
        /// Peer id.
        to: u64,
        /// The message.
        message: Message,
    },
    /// A change of the group's voters committed (and applied to the engine), in log order
    /// with the commands: `added` or removed voter `id`, with the context it was proposed with.
    ConfChanged {
        /// Its log index.
        index: u64,
        /// Added (else removed).
        added: bool,
        /// The voter's Raft id.
        id: u64,
        /// What the proposer attached (the founding voters' own: their names).
        context: Vec<u8>,
    },
    /// A read-index request ([`MetaNode::read_index`]) was confirmed by the leader: once this
    /// member applied up to `index`, its state is at least as new as the group's was when the
    /// request was made (the leader checked with a majority that it still leads).
    ReadIndex {
        /// What the request was made with.
        ctx: Vec<u8>,
        /// The leader's commit index when it confirmed.
        index: u64,
    },
    /// Read the entries `low..high` of this member's kept log (about `max_bytes` of them from
    /// `low` on, one at least; fewer when the log ends sooner) and hand them to
    /// [`MetaNode::handle_entries_read`]. Only with an entry cache
    /// ([`MetaNode::set_entry_cache`]): entries that left memory, wanted by a follower behind.
    /// Off the state machine's task: nothing waits on it but that follower.
    ReadEntries {
        /// First index wanted.
        low: u64,
        /// Stop before this index.
        high: u64,
        /// About how many bytes of entries to return at most.
        max_bytes: u64,
    },
    /// Read the snapshot at `index` back from this member's kept log (the last one persisted,
    /// [`MetaOutput::PersistSnapshot`]) and hand it to [`MetaNode::handle_snapshot_read`]. Only
    /// with [`MetaNode::set_snapshot_on_disk`]: a follower behind the compaction waits for it.
    /// Off the state machine's task: nothing else waits on it.
    ReadSnapshot {
        /// The snapshot's index.
        index: u64,
    },
    /// A command committed by the group, in log order: apply it. (With
    /// [`MetaNode::report_leader_entries`], also the empty entry each new leader appends: `data`
    /// empty.)
    Committed {
        /// Its log index.
        index: u64,
        /// The term it was proposed in (a proposal whose index commits with another term was
        /// overwritten by a newer leader).
        term: u64,
        /// The command as proposed (shared with the log: no copy).
        data: bytes::Bytes,
    },
}

/// A member of a Raft group.
pub struct MetaNode {
    raw: RawNode<GroupStore>,
    out: VecDeque<MetaOutput>,
    /// Report the empty entries new leaders append (a replicated shard's generation starts).
    report_empty: bool,
    /// Followers sent a snapshot in this round (reported to the engine as sent).
    snapshots_sent: Vec<u64>,
    /// A candidate's extra wait before it stands again ([`stand_delay`]): the term it is for
    /// and the ticks still withheld.
    stand_hold: (u64, usize),
}

/// The most ticks a candidate that did not win waits, beyond its election timeout, before it
/// stands again ([`stand_delay`]).
pub const STAND_JITTER_TICKS: usize = ELECTION_TICKS;

/// The extra ticks node `id`, a candidate in `term` that has not won, waits before it stands
/// again: spread over `0..STAND_JITTER_TICKS` by its id and the term, so it differs between two
/// nodes and from one term to the next.
///
/// Why: election timeouts here are not random (outputs are a function of inputs); they are
/// staggered by each node's rank in its group, fixed when the node's replica was made. After
/// moves change a group's members, two live nodes can hold the same rank: they time out at the
/// same tick, both stand, split the votes, and do it again every term. `felix-node sim
/// --cluster --clients` found a group of four voters (one gone, moved away) whose two
/// equal-ranked live replicas did that for the rest of the run: no leader, the shard
/// unavailable, however long healed (seed 501290). A stand that did not win now waits a
/// different number of ticks on each node, so one stands alone and wins; a first stand, the
/// common case, keeps the order the ranks give.
pub fn stand_delay(id: u64, term: u64) -> usize {
    let mut z = id ^ term.rotate_left(32) ^ 0x9E37_79B9_7F4A_7C15;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^= z >> 31;
    (z % STAND_JITTER_TICKS as u64) as usize
}

impl std::fmt::Debug for MetaNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaNode").field("id", &self.id()).field("leader", &self.leader()).finish()
    }
}

impl MetaNode {
    /// Member `id` of a group whose founding voters are `voters` (ids are never 0).
    ///
    /// # Errors
    /// [`MetaError::Raft`] for a configuration the engine refuses (id 0, `id` not a voter...).
    pub fn new(id: u64, voters: &[u64]) -> Result<MetaNode, MetaError> {
        let founding: Vec<(u64, Vec<u8>)> = voters.iter().map(|v| (*v, Vec::new())).collect();
        Self::restart(id, &founding, &RaftLog::default())
    }

    /// Member `id` starting from what its driver kept: the log and hard state folded from every
    /// [`MetaOutput::Persist`] before (empty on a first start). Committed commands come out
    /// again as [`MetaOutput::Committed`] from the first, so the state machine is rebuilt by
    /// replaying.
    ///
    /// The group's voters are in its log: the founding voters `founding` (id and a context,
    /// the same on every founding member) are written as its first entries on a first start,
    /// like etcd's bootstrap, and every later change of voters is a logged configuration change
    /// ([`propose_conf_change`](Self::propose_conf_change)). So a member added later learns
    /// the whole membership by replicating the log, and a restart recovers it from the log.
    /// A member that joins an existing group starts with `founding` empty and an empty log: it
    /// waits, voting for nobody, until the leader replicates to it.
    ///
    /// # Errors
    /// [`MetaError::Raft`] for id 0, a founding list without `id`, or a kept log the engine
    /// refuses.
    pub fn restart(id: u64, founding: &[(u64, Vec<u8>)], kept: &RaftLog) -> Result<MetaNode, MetaError> {
        Self::restart_ranked(id, founding, kept, None)
    }

    /// [`restart`](Self::restart) with this member's place in the order its group's members
    /// stand for election when nobody leads (0 first). `None`: by id, lowest first. Groups of
    /// replicated shards give each shard another order, so their leaders spread over brokers.
    ///
    /// # Errors
    /// As [`restart`](Self::restart).
    pub fn restart_ranked(
        id: u64,
        founding: &[(u64, Vec<u8>)],
        kept: &RaftLog,
        rank: Option<usize>,
    ) -> Result<MetaNode, MetaError> {
        let founders: Vec<u64> = founding.iter().map(|(v, _)| *v).collect();
        if id == 0 || (!founders.is_empty() && !founders.contains(&id)) {
            return Err(MetaError::Raft(raft::Error::ConfigInvalid(format!(
                "node {id} is not a founding voter of {founders:?}"
            ))));
        }
        let mut kept = kept.clone();
        let mut first_persist = None;
        if kept.entries.is_empty() && !founding.is_empty() && kept.hard_state.term == 0 {
            kept = RaftLog::founding(founding);
            first_persist =
                Some(MetaOutput::Persist { entries: kept.entries.clone(), hard_state: Some(kept.hard_state.clone()) });
        }
        // Voters as the committed configuration changes of the log leave them. A log from
        // before voters were logged has none: the founding list then says.
        let snapshot = kept.snapshot.clone().unwrap_or_default();
        let snap_voters = (snapshot.get_metadata().index > 0)
            .then(|| snapshot.get_metadata().get_conf_state().voters.clone())
            .filter(|v| !v.is_empty());
        let voters = kept.voters().or(snap_voters).unwrap_or(founders);
        let storage = MemStorage::new_with_conf_state(ConfState::from((voters.clone(), vec![])));
        // Committed entries left on disk: the engine starts with them applied (the replica
        // replays them from its driver's files first), and the in-memory log starts after them.
        let spill = kept.spill.clone().filter(|s| !s.is_empty());
        if let Some(sp) = &spill {
            let contiguous = sp.first() == snapshot.get_metadata().index + 1
                && kept.entries.first().is_none_or(|e| e.index == sp.end())
                && sp.end() - 1 <= kept.hard_state.commit;
            if !contiguous {
                return Err(MetaError::Decode(format!(
                    "kept log: entries {}..{} on disk do not fit the snapshot at {} and the log after",
                    sp.first(),
                    sp.end(),
                    snapshot.get_metadata().index
                )));
            }
        }
        {
            let mut w = storage.wl();
            if snapshot.get_metadata().index > 0 {
                w.apply_snapshot(snapshot.clone())?;
            }
            if let Some(sp) = &spill {
                // The in-memory log's own start: a placeholder at the last entry on disk (the
                // snapshot sent to followers stays the real one, `GroupStore::snapshot`).
                let mut start = Snapshot::default();
                let m = start.mut_metadata();
                m.index = sp.end() - 1;
                m.term = sp.term(sp.end() - 1).unwrap_or(0);
                m.set_conf_state(ConfState::from((voters.clone(), vec![])));
                w.apply_snapshot(start)?;
            }
            let after: Vec<Entry> =
                kept.entries.iter().filter(|e| e.index > snapshot.get_metadata().index).cloned().collect();
            if !after.is_empty() {
                w.append(&after)?;
            }
            let mut hs = kept.hard_state.clone();
            // The kept commit cannot point past the kept log (a commit learnt before the entries
            // it covers were written).
            let last = kept.last_index().max(snapshot.get_metadata().index);
            hs.commit = hs.commit.min(last).max(snapshot.get_metadata().index);
            w.set_hardstate(hs);
        }
        let mut cached = EntryCache::default();
        cached.appended(
            &kept.entries.iter().filter(|e| e.index > snapshot.get_metadata().index).cloned().collect::<Vec<_>>(),
        );
        let disk = spill.as_ref().map_or_else(OnDisk::default, |sp| sp.disk.clone());
        let applied = spill.as_ref().map_or(0, |sp| sp.end() - 1);
        let storage = GroupStore {
            mem: storage,
            snapshot,
            disk,
            cached,
            reads: Default::default(),
            snapshot_data: Default::default(),
        };
        // One election timeout per node, staggered by id: deterministic, and apart enough that
        // two nodes rarely stand at once.
        let rank = rank.unwrap_or_else(|| voters.iter().filter(|v| **v < id).count());
        let min = ELECTION_TICKS + 2 * rank;
        let cfg = Config {
            id,
            election_tick: ELECTION_TICKS,
            heartbeat_tick: HEARTBEAT_TICKS,
            min_election_tick: min,
            max_election_tick: min + 1,
            check_quorum: true,
            pre_vote: true,
            // Several entries per append message (the engine's default is one): a replicated
            // shard's publish batches are entries, and one message each cost a peer frame and a
            // transport write per batch.
            max_size_per_msg: MAX_APPEND_BYTES,
            max_inflight_msgs: 256,
            applied,
            ..Config::default()
        };
        cfg.validate()?;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let raw = RawNode::new(&cfg, storage, &logger)?;
        Ok(MetaNode {
            raw,
            out: first_persist.into_iter().collect(),
            report_empty: false,
            snapshots_sent: Vec::new(),
            stand_hold: (0, 0),
        })
    }

    /// Hands out now what the kept log holds committed and not yet applied (a restart's
    /// replay), rather than at the first tick or step: a host that restored its state from
    /// the kept snapshot tells its users of that state and of the replay after it together.
    pub fn replay_kept(&mut self) {
        self.process_ready();
    }

    /// Reports the empty entry every new leader appends as a [`MetaOutput::Committed`] with
    /// empty data (a replicated shard makes it its generation-start record). Set before the
    /// first tick or step: a restart's replay reports them too.
    pub fn report_leader_entries(&mut self) {
        self.report_empty = true;
    }

    /// Compacts the log through `index` (at most the applied index): the entries up to it are
    /// dropped, replaced by a snapshot of `data`, the state machine's state right after
    /// applying entry `index`. A follower that needs a dropped entry is sent the snapshot.
    /// Comes out as [`MetaOutput::PersistSnapshot`] (not `received`). Returns whether it
    /// compacted (not for an index past what was applied, or not past the last snapshot).
    pub fn compact(&mut self, index: u64, data: Vec<u8>) -> bool {
        let applied = self.raw.raft.raft_log.applied;
        let conf = self.raw.raft.prs().conf().to_conf_state();
        let store = self.raw.mut_store();
        if index > applied || index <= store.snapshot.get_metadata().index {
            return false;
        }
        let Ok(term) = store.term(index) else { return false };
        let mut snap = Snapshot::default();
        snap.set_data(data.into());
        let m = snap.mut_metadata();
        m.index = index;
        m.term = term;
        m.set_conf_state(conf);
        // The last entry stays, whatever the snapshot covers: the in-memory log reads its last
        // index from its entries, and with none it would fall back to its own (older) snapshot
        // and take the next proposal below the committed index.
        let last = store.mem.last_index().unwrap_or(0);
        if store.mem.wl().compact((index + 1).min(last)).is_err() {
            return false;
        }
        store.disk.drop_through(index);
        if let Ok(first) = store.mem.first_index() {
            store.cached.dropped_below(first);
        }
        store.snapshot = snap.clone();
        store.snapshot_persisted();
        self.out.push_back(MetaOutput::PersistSnapshot { snapshot: snap, received: false });
        true
    }

    /// The term of entry `idx` of the log, if it still holds it (in memory or on disk).
    pub fn term_of(&self, idx: u64) -> Option<u64> {
        self.raw.store().term(idx).ok().filter(|_| idx >= self.raw.store().first_index().unwrap_or(u64::MAX))
    }

    /// The first index the log still holds (after the last snapshot).
    pub fn first_index(&self) -> u64 {
        self.raw.raft.raft_log.first_index()
    }

    /// Proposes like [`propose`](Self::propose) and says where the entry went: its log index
    /// and term. It commits there with that term, or was overwritten (another term at that
    /// index) by a newer leader.
    ///
    /// # Errors
    /// As [`propose`](Self::propose).
    pub fn propose_indexed(&mut self, data: Vec<u8>) -> Result<(u64, u64), MetaError> {
        if !self.is_leader() {
            return Err(MetaError::NotLeader { leader: self.leader() });
        }
        let before = self.raw.raft.raft_log.last_index();
        let term = self.raw.raft.term;
        self.raw.propose(Vec::new(), data)?;
        let index = self.raw.raft.raft_log.last_index();
        self.process_ready();
        if index == before {
            return Err(MetaError::Raft(raft::Error::ProposalDropped));
        }
        Ok((index, term))
    }

    /// The current voters (ascending).
    pub fn voters(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.raw.raft.prs().conf().voters().ids().iter().collect();
        v.sort_unstable();
        v
    }

    /// On the leader: whether a configuration change it proposed is not yet applied (one at a
    /// time: another is refused until then).
    pub fn has_pending_conf(&self) -> bool {
        self.raw.raft.has_pending_conf()
    }

    /// Proposes adding (`add`) or removing voter `id`; `context` comes back with
    /// [`MetaOutput::ConfChanged`] on every member. One change at a time: the engine drops a
    /// second while the first is not applied.
    ///
    /// # Errors
    /// [`MetaError::NotLeader`] on a follower; [`MetaError::Raft`] when the engine drops it.
    pub fn propose_conf_change(&mut self, add: bool, id: u64, context: Vec<u8>) -> Result<(), MetaError> {
        if !self.is_leader() {
            return Err(MetaError::NotLeader { leader: self.leader() });
        }
        if self.raw.raft.has_pending_conf() {
            return Err(MetaError::Raft(raft::Error::ProposalDropped));
        }
        let mut cc = ConfChange::default();
        cc.set_change_type(if add { ConfChangeType::AddNode } else { ConfChangeType::RemoveNode });
        cc.set_node_id(id);
        cc.set_context(context.clone().into());
        let r = self.raw.propose_conf_change(context, cc);
        self.process_ready();
        r.map_err(MetaError::from)
    }

    /// This node's id.
    pub fn id(&self) -> u64 {
        self.raw.raft.id
    }

    /// The leader this node knows of.
    pub fn leader(&self) -> Option<u64> {
        Some(self.raw.raft.leader_id).filter(|l| *l != 0)
    }

    /// Whether this node leads.
    pub fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.raw.raft.term
    }

    /// The index of the last entry in the log, and the highest committed.
    pub fn indexes(&self) -> (u64, u64) {
        (self.raw.raft.raft_log.last_index(), self.raw.raft.raft_log.committed)
    }

    /// The highest committed index (without asking the storage for the last one).
    pub fn committed(&self) -> u64 {
        self.raw.raft.raft_log.committed
    }

    /// On the leader: each voter and the highest index it is known to hold (its replication
    /// progress), in id order. Empty on a follower.
    pub fn progress(&self) -> Vec<(u64, u64)> {
        if !self.is_leader() {
            return Vec::new();
        }
        let mut v: Vec<(u64, u64)> = self.raw.raft.prs().iter().map(|(id, p)| (*id, p.matched)).collect();
        v.sort_unstable();
        v
    }

    /// One unit of time passed (the driver ticks every 100 ms, say).
    pub fn tick(&mut self) {
        // A member that stood in this term and has not won withholds a few ticks of its
        // election timer, a different number on each node ([`stand_delay`]): a candidate still
        // counting votes, or one the engine made a follower again when a majority rejected it
        // (its vote is still its own, and it knows no leader). The second is what two
        // equal-ranked members do when the third rejects them both (it holds an entry they
        // lack), and that third never stands itself, since each newer term's vote request
        // resets its timer (seed 511375).
        let r = &self.raw.raft;
        let stood = r.state == StateRole::Candidate
            || (r.state == StateRole::Follower && r.vote == r.id && r.leader_id == raft::INVALID_ID);
        if stood {
            if self.stand_hold.0 != r.term {
                self.stand_hold = (r.term, stand_delay(r.id, r.term));
            }
            if self.stand_hold.1 > 0 {
                self.stand_hold.1 -= 1;
                return;
            }
        }
        self.raw.tick();
        self.process_ready();
    }

    /// A message from a peer.
    ///
    /// # Errors
    /// [`MetaError::Raft`] when the engine refuses it (a message for another group).
    pub fn step(&mut self, mut message: Message) -> Result<(), MetaError> {
        // A heartbeat's commit is the leader's belief about this member's log. The engine
        // trusts it and panics when it points past the log's end, which a member whose log was
        // lost (a wiped data directory) would meet. Clamped, it only delays a commit the next
        // append brings anyway: a peer's message never panics this node.
        if message.get_msg_type() == raft::eraftpb::MessageType::MsgHeartbeat {
            let last = self.raw.raft.raft_log.last_index();
            message.commit = message.commit.min(last);
        }
        let r = self.raw.step(message);
        self.process_ready();
        r.map_err(MetaError::from)
    }

    /// Proposes a command; it comes out as [`MetaOutput::Committed`] on every member once the
    /// group committed it.
    ///
    /// # Errors
    /// [`MetaError::NotLeader`] on a follower; [`MetaError::Raft`] if the engine drops it.
    pub fn propose(&mut self, data: Vec<u8>) -> Result<(), MetaError> {
        if !self.is_leader() {
            return Err(MetaError::NotLeader { leader: self.leader() });
        }
        let r = self.raw.propose(Vec::new(), data);
        self.process_ready();
        r.map_err(MetaError::from)
    }

    /// Proposes several commands at once: one ready (one write, one sync, one append message
    /// per follower) for all of them rather than one each. Stops at the first the engine
    /// refuses; the ones before it stand.
    ///
    /// # Errors
    /// As [`propose`](Self::propose); with the count proposed before the refusal.
    pub fn propose_all(&mut self, data: Vec<Vec<u8>>) -> Result<(), (usize, MetaError)> {
        if !self.is_leader() {
            return Err((0, MetaError::NotLeader { leader: self.leader() }));
        }
        let mut done = 0;
        let mut failed = None;
        for d in data {
            if let Err(e) = self.raw.propose(Vec::new(), d) {
                failed = Some(MetaError::from(e));
                break;
            }
            done += 1;
        }
        self.process_ready();
        failed.map_or(Ok(()), |e| Err((done, e)))
    }

    /// Asks the leader for its commit index, confirmed with a majority (Raft's read index):
    /// answered by a [`MetaOutput::ReadIndex`] with `ctx`, or never (no leader, or a message
    /// lost: ask again later).
    pub fn read_index(&mut self, ctx: Vec<u8>) {
        self.raw.read_index(ctx);
        self.process_ready();
    }

    /// On the leader: hands leadership to voter `to` (Raft's leadership transfer: it stops
    /// taking proposals, brings `to` up to date, and tells it to stand at once). Given up by
    /// the engine after an election timeout if `to` does not take over.
    pub fn transfer_leader(&mut self, to: u64) {
        if self.is_leader() && to != self.id() {
            self.raw.transfer_leader(to);
            self.process_ready();
        }
    }

    /// Whether a leadership transfer is in progress (on the leader).
    pub fn transferring(&self) -> bool {
        self.raw.raft.lead_transferee.is_some()
    }

    /// On the leader, once an entry of its own term committed: its commit index, which covers
    /// everything the group ever committed (the condition under which Raft's leader answers a
    /// read index). `None` elsewhere.
    pub fn leader_commit(&self) -> Option<u64> {
        let log = &self.raw.raft.raft_log;
        (self.is_leader() && log.term(log.committed).is_ok_and(|t| t == self.term())).then_some(log.committed)
    }

    /// The index up to which committed entries were handed out (every entry, the engine's
    /// own empty ones too).
    pub fn applied(&self) -> u64 {
        self.raw.raft.raft_log.applied()
    }

    /// The next thing to do.
    pub fn poll_output(&mut self) -> Option<MetaOutput> {
        self.out.pop_front()
    }

    /// The engine's ready loop: store entries and hard state, send, apply, advance.
    fn process_ready(&mut self) {
        while self.raw.has_ready() {
            let mut rd = self.raw.ready();
            self.send(rd.take_messages());
            if !rd.snapshot().is_empty() {
                let snap = rd.snapshot().clone();
                // A snapshot from the leader replaces the log; MemStorage takes it whole. It
                // is kept (and the state machine restored from it) before anything after it.
                if self.raw.mut_store().mem.wl().apply_snapshot(snap.clone()).is_ok() {
                    let store = self.raw.mut_store();
                    store.snapshot = snap.clone();
                    store.snapshot_persisted();
                    store.disk = OnDisk::default();
                    store.cached.clear();
                    self.out.push_back(MetaOutput::PersistSnapshot { snapshot: snap, received: true });
                }
            }
            self.apply(rd.take_committed_entries());
            for r in rd.take_read_states() {
                self.out.push_back(MetaOutput::ReadIndex { ctx: r.request_ctx, index: r.index });
            }
            if !rd.entries().is_empty() {
                let store = self.raw.mut_store();
                if store.mem.wl().append(rd.entries()).is_ok() {
                    store.cached.appended(rd.entries());
                }
            }
            if let Some(hs) = rd.hs() {
                self.raw.mut_store().mem.wl().set_hardstate(hs.clone());
            }
            if !rd.entries().is_empty() || rd.hs().is_some() {
                self.out
                    .push_back(MetaOutput::Persist { entries: rd.entries().to_vec(), hard_state: rd.hs().cloned() });
            }
            // Only now, with entries and hard state stored (and asked to be made durable), may
            // these go out.
            self.send(rd.take_persisted_messages());
            let mut light = self.raw.advance(rd);
            if let Some(commit) = light.commit_index() {
                self.raw.mut_store().mem.wl().mut_hard_state().set_commit(commit);
            }
            self.send(light.take_messages());
            self.apply(light.take_committed_entries());
            self.raw.advance_apply();
            self.report_snapshots();
        }
        let applied = self.raw.raft.raft_log.applied;
        let store = self.raw.mut_store();
        store.evict(applied);
        for (low, high, max_bytes) in std::mem::take(&mut store.reads.get_mut().asked) {
            self.out.push_back(MetaOutput::ReadEntries { low, high, max_bytes });
        }
        let index = store.snapshot.get_metadata().index;
        let d = store.snapshot_data.get_mut();
        // Read back at most once per round (dropped at once if nobody took it: it is asked
        // only for a send that failed without it).
        d.loaded = None;
        if std::mem::take(&mut d.ask) {
            self.out.push_back(MetaOutput::ReadSnapshot { index });
        }
    }

    /// Keeps the data of the last snapshot on disk only, once persisted, rather than in
    /// memory too ([`MetaOutput::ReadSnapshot`] reads it back when a follower needs it). A
    /// driver that sets it must answer those reads. The snapshot kept now (a restart's, read
    /// from the kept log) is on disk already: its data leaves memory at once.
    pub fn set_snapshot_on_disk(&mut self, on: bool) {
        let store = self.raw.mut_store();
        let was = std::mem::replace(&mut store.snapshot_data.get_mut().on_disk, on);
        // Once: again, it would forget that the data it let go is on disk (and the engine
        // would send the snapshot without it).
        if on && !was {
            store.snapshot_persisted();
        }
    }

    /// Like [`set_snapshot_on_disk`](Self::set_snapshot_on_disk), and the data is never read
    /// back for the engine: a follower behind the compaction is sent a `MsgSnapshot` holding
    /// the snapshot's metadata and no data, which the host completes from disk in chunks
    /// ([`Self::offloaded_snapshot`] says which snapshot's data it is). Why: read back whole,
    /// the state was in memory twice again for every follower sent it (a cache's values, a
    /// stream's commit state), however large.
    pub fn set_snapshot_by_reference(&mut self, on: bool) {
        self.raw.mut_store().snapshot_data.get_mut().by_reference = on;
        if on {
            self.set_snapshot_on_disk(true);
        }
    }

    /// Whether the last snapshot's data is sent by reference
    /// ([`Self::set_snapshot_by_reference`]).
    pub fn snapshot_by_reference(&self) -> bool {
        self.raw.store().snapshot_data.borrow().by_reference
    }

    /// The index of the last snapshot when its data is on disk only (not in memory): a
    /// `MsgSnapshot` at that index without data is one whose data the host sends
    /// ([`Self::set_snapshot_by_reference`]).
    pub fn offloaded_snapshot(&self) -> Option<u64> {
        let s = self.raw.store();
        s.snapshot_data.borrow().offloaded.then(|| s.snapshot.get_metadata().index)
    }

    /// Bytes of snapshot data held in memory for the engine (the last snapshot's, unless it is
    /// on disk only).
    pub fn snapshot_memory(&self) -> usize {
        let s = self.raw.store();
        s.snapshot.get_data().len() + s.snapshot_data.borrow().loaded.as_ref().map_or(0, bytes::Bytes::len)
    }

    /// The driver read back the snapshot a [`MetaOutput::ReadSnapshot`] asked for (`Err`: it
    /// could not, and why). The snapshot at that index, if it still is the last one, is sent to
    /// the followers that waited for it; anything else (a newer snapshot since, metadata that
    /// is not the snapshot's) is refused, and they are tried again at the engine's next
    /// heartbeat, which asks again. Returns whether it was taken.
    pub fn handle_snapshot_read(&mut self, index: u64, read: Result<Snapshot, String>) -> bool {
        let store = self.raw.mut_store();
        let (kept_index, kept_term) = (store.snapshot.get_metadata().index, store.snapshot.get_metadata().term);
        let d = store.snapshot_data.get_mut();
        if kept_index != index || !d.offloaded {
            // A newer snapshot replaced it: its own read, if any, is under way.
            return false;
        }
        d.pending = false;
        let waiting = std::mem::take(&mut d.waiting);
        let Some(mut snap) =
            read.ok().filter(|s| (s.get_metadata().index, s.get_metadata().term) == (index, kept_term))
        else {
            return false;
        };
        d.loaded = Some(snap.take_data());
        if self.raw.raft.state == StateRole::Leader {
            for to in waiting {
                // (The engine's send unwraps the follower's progress: only members it has.)
                if to != self.raw.raft.id && self.raw.raft.prs().get(to).is_some() {
                    self.raw.raft.send_append(to);
                }
            }
        }
        self.process_ready();
        true
    }

    /// Keeps at most `budget` bytes of applied entries in memory (`None`, the default: every
    /// entry stays); older ones are read back from the driver's log when a follower needs
    /// them ([`MetaOutput::ReadEntries`]). A driver that sets it must answer those reads.
    pub fn set_entry_cache(&mut self, budget: Option<u64>) {
        self.raw.mut_store().cached.budget = budget;
        self.process_ready();
    }

    /// [`set_entry_cache`](Self::set_entry_cache) without running the engine (its next tick
    /// or step does): for a member whose host holds it back a while.
    pub fn set_entry_budget(&mut self, budget: Option<u64>) {
        self.raw.mut_store().cached.budget = budget;
    }

    /// Entry bytes held in memory (with `ENTRY_OVERHEAD` each), and how many entries of the
    /// log are on disk only.
    pub fn entry_memory(&self) -> (u64, u64) {
        let s = self.raw.store();
        (s.cached.bytes, s.disk.end.saturating_sub(s.disk.first))
    }

    /// The driver read the entries a [`MetaOutput::ReadEntries`] from `low` asked for (or
    /// failed to: `Err` says why). Entries that are not the log's (another term at an index, a
    /// gap, not starting at `low`) are refused and the read counts as failed; the follower
    /// waiting on them is tried again at the engine's next heartbeat. Returns whether they were
    /// taken.
    pub fn handle_entries_read(&mut self, low: u64, entries: Result<Vec<Entry>, String>) -> bool {
        let store = self.raw.mut_store();
        store.reads.get_mut().pending.remove(&low);
        let taken = match entries {
            Ok(mut entries) => {
                entries.retain(|e| e.index < store.disk.end);
                let fits = entries.first().is_some_and(|e| e.index == low)
                    && entries.windows(2).all(|w| w[0].index.checked_add(1) == Some(w[1].index))
                    && entries.iter().all(|e| store.term(e.index).is_ok_and(|t| t == e.term));
                if fits {
                    store.reads.get_mut().ready.insert(low, entries);
                }
                fits
            }
            Err(_) => false,
        };
        let reads = store.reads.get_mut();
        let waiting: Vec<GetEntriesContext> = {
            let (now, later): (VecDeque<_>, VecDeque<_>) =
                std::mem::take(&mut reads.waiting).into_iter().partition(|(l, _)| *l == low);
            reads.waiting = later;
            now.into_iter().map(|(_, c)| c).collect()
        };
        if taken {
            for context in waiting {
                self.raw.on_entries_fetched(context);
            }
        }
        self.raw.mut_store().reads.get_mut().ready.remove(&low);
        self.process_ready();
        taken
    }

    fn send(&mut self, messages: Vec<Message>) {
        for m in messages {
            if m.get_msg_type() == raft::eraftpb::MessageType::MsgSnapshot {
                self.snapshots_sent.push(m.to);
            }
            self.out.push_back(MetaOutput::Send { to: m.to, message: m });
        }
    }

    /// A snapshot goes over the same lossy transport as everything else: the engine is told it
    /// went, so it probes the follower again (and sends another if this one was lost) rather
    /// than waiting for it forever.
    fn report_snapshots(&mut self) {
        for to in std::mem::take(&mut self.snapshots_sent) {
            self.raw.report_snapshot(to, raft::SnapshotStatus::Finish);
        }
    }

    fn apply(&mut self, entries: Vec<Entry>) {
        use protobuf::Message as _;
        for e in entries {
            match e.get_entry_type() {
                // Empty entries are the engine's own (a new leader's first entry).
                EntryType::EntryNormal if !e.data.is_empty() || self.report_empty => {
                    self.out.push_back(MetaOutput::Committed { index: e.index, term: e.term, data: e.data.clone() });
                }
                EntryType::EntryConfChange => {
                    // Every member applies the same entry the same way; one the engine refuses
                    // (it cannot be, as it was proposed through it) changes nothing.
                    let Ok(cc) = ConfChange::parse_from_bytes(&e.data) else { continue };
                    if let Ok(cs) = self.raw.apply_conf_change(&cc) {
                        self.raw.mut_store().mem.wl().set_conf_state(cs);
                        self.out.push_back(MetaOutput::ConfChanged {
                            index: e.index,
                            added: cc.get_change_type() != ConfChangeType::RemoveNode,
                            id: cc.get_node_id(),
                            context: cc.get_context().to_vec(),
                        });
                    }
                }
                _ => {}
            }
        }
    }
}

/// A Raft message as bytes for the cluster transport.
pub fn encode_message(m: &Message) -> Vec<u8> {
    use protobuf::Message as _;
    m.write_to_bytes().unwrap_or_default()
}

/// Entry bytes below which a message is encoded the plain way (one buffer).
const PARTS_MIN: usize = 16 << 10;

/// [`encode_message`] in pieces, the entries' data shared rather than copied: a leader sends
/// every entry to every follower, and copying each into a fresh buffer per follower was most
/// of what its memory copies cost. The bytes decode to the same message; field order differs
/// from the canonical encoding (entries last, each entry's data last within it), which
/// protobuf parsers accept (fields come in any order, repeated ones in theirs).
pub fn encode_message_parts(m: &Message) -> crate::cluster::peer::RaftBytes {
    use crate::cluster::peer::RaftBytes;
    use bytes::BufMut;
    use protobuf::Message as _;
    let data: usize = m.entries.iter().map(|e| e.data.len()).sum();
    if data < PARTS_MIN {
        return RaftBytes::from(bytes::Bytes::from(encode_message(m)));
    }
    fn varint(b: &mut bytes::BytesMut, mut v: u64) {
        while v >= 0x80 {
            b.put_u8((v as u8) | 0x80);
            v >>= 7;
        }
        b.put_u8(v as u8);
    }
    fn varint_len(v: u64) -> usize {
        (64 - (v | 1).leading_zeros() as usize).div_ceil(7)
    }
    let mut head = m.clone();
    head.entries.clear();
    let mut parts = vec![bytes::Bytes::from(head.write_to_bytes().unwrap_or_default())];
    let mut small = bytes::BytesMut::new();
    for e in &m.entries {
        let mut bare = e.clone();
        bare.data = bytes::Bytes::new();
        let b = bare.write_to_bytes().unwrap_or_default();
        let n = e.data.len() as u64;
        let inner = b.len() as u64 + if n > 0 { 1 + varint_len(n) as u64 + n } else { 0 };
        small.put_u8(0x3A); // field 7 (entries), length-delimited
        varint(&mut small, inner);
        small.extend_from_slice(&b);
        if n > 0 {
            small.put_u8(0x22); // field 4 (data), length-delimited
            varint(&mut small, n);
            parts.push(small.split().freeze());
            parts.push(e.data.clone());
        }
    }
    if !small.is_empty() {
        parts.push(small.freeze());
    }
    RaftBytes::from_parts(parts)
}

/// A Raft message from the cluster transport.
///
/// # Errors
/// [`MetaError::Decode`] for bytes that are not a Raft message.
pub fn decode_message(bytes: &[u8]) -> Result<Message, MetaError> {
    use protobuf::Message as _;
    Message::parse_from_bytes(bytes).map_err(|e| MetaError::Decode(e.to_string()))
}

/// [`decode_message`] from shared bytes: the entries' data are slices of `bytes`, not copies
/// (a replicated shard's entries are whole publish batches).
///
/// # Errors
/// As [`decode_message`].
pub fn decode_message_shared(bytes: &bytes::Bytes) -> Result<Message, MetaError> {
    use protobuf::Message as _;
    Message::parse_from_carllerche_bytes(bytes).map_err(|e| MetaError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests;
