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

use raft::eraftpb::{ConfChange, ConfChangeType, ConfState, EntryType, Message};
pub use raft::eraftpb::{Entry, HardState, Snapshot};
use raft::storage::MemStorage;
use raft::{Config, GetEntriesContext, RaftState, RawNode, StateRole, Storage};
use std::collections::VecDeque;

/// The engine's storage: its `MemStorage`, and the snapshot this member compacted its log to
/// (or installed from its leader), which the engine hands a follower that needs entries the
/// log no longer holds. `MemStorage`'s own snapshots carry no data (and the commit index, not
/// the compaction point), so snapshots are answered here.
///
/// With an entry cache ([`MetaNode::set_entry_cache`]) `MemStorage` holds only the newest
/// entries: once applied, older ones leave memory while the log on disk keeps them
/// ([`OnDisk`]). The engine asks for those only to send them to a follower that is behind
/// (`SendAppend`, the one context it lets storage answer later): they are asked of the driver
/// ([`MetaOutput::ReadEntries`]), and the send is tried again once they arrive
/// ([`MetaNode::handle_entries_read`]). Every other read the engine makes (committed entries to
/// apply, a pending configuration change before a transfer) lies after the applied index, which
/// the cache always holds.
struct GroupStore {
    mem: MemStorage,
    snapshot: Snapshot,
    /// Entries after the snapshot that left memory (the driver's log holds them).
    disk: OnDisk,
    /// What `mem` holds, for the cache's byte count.
    cached: EntryCache,
    /// Reads of evicted entries asked and answered (the engine reads through `&self`).
    reads: std::cell::RefCell<DiskReads>,
}

/// The entries `first..end` of the log that are held on disk only, with their terms (the
/// engine asks an entry's term at any time, and must be answered at once): one run per term,
/// a few bytes for millions of entries. Also what a restart's [`Spill`] holds of its entries.
#[derive(Debug, Clone, Default, PartialEq)]
struct OnDisk {
    first: u64,
    end: u64,
    /// (first index, term), ascending; the last run goes on to `end`.
    runs: Vec<(u64, u64)>,
}

impl OnDisk {
    fn is_empty(&self) -> bool {
        self.first >= self.end
    }

    fn term(&self, idx: u64) -> Option<u64> {
        if idx < self.first || idx >= self.end {
            return None;
        }
        let i = self.runs.partition_point(|(start, _)| *start <= idx);
        i.checked_sub(1).map(|i| self.runs[i].1)
    }

    /// Entry `idx` of `term` left memory (entries leave in index order).
    fn push(&mut self, idx: u64, term: u64) {
        if self.is_empty() {
            self.first = idx;
            self.runs.clear();
        }
        if self.runs.last().is_none_or(|(_, t)| *t != term) {
            self.runs.push((idx, term));
        }
        self.end = idx.saturating_add(1);
    }

    /// Everything at or below `index` was compacted away.
    fn drop_through(&mut self, index: u64) {
        if index < self.first {
            return;
        }
        let next = index.saturating_add(1);
        if next >= self.end {
            *self = OnDisk::default();
            return;
        }
        let keep = self.runs.partition_point(|(start, _)| *start <= next).saturating_sub(1);
        self.runs.drain(..keep);
        if let Some(r) = self.runs.first_mut() {
            r.0 = next;
        }
        self.first = next;
    }

    /// Entries from `idx` on are gone (a newer leader's entries replace them).
    fn truncate_from(&mut self, idx: u64) {
        if idx >= self.end {
            return;
        }
        if idx <= self.first {
            *self = OnDisk::default();
            return;
        }
        self.runs.retain(|(start, _)| *start < idx);
        self.end = idx;
    }
}

/// The committed entries `first..end` of a kept log that a restart leaves on disk (the front
/// of the log, folded with [`RaftLog::spill_committed`] or [`LogFold`]): their terms, one run
/// per term, and the configuration changes among them (a few entries). A replica restarted
/// from such a log replays them from its driver's files in bounded reads
/// ([`super::replica::Replica`]) instead of holding the whole retained log in memory, and the
/// engine starts with them applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Spill {
    /// The entries' terms.
    disk: OnDisk,
    /// The configuration changes among them, in index order.
    conf: Vec<Entry>,
}

impl Spill {
    /// The first entry it holds.
    pub fn first(&self) -> u64 {
        self.disk.first
    }

    /// One past the last entry it holds.
    pub fn end(&self) -> u64 {
        self.disk.end
    }

    /// Whether it holds no entry.
    pub fn is_empty(&self) -> bool {
        self.disk.is_empty()
    }

    /// The term of entry `idx`, if it holds it.
    pub fn term(&self, idx: u64) -> Option<u64> {
        self.disk.term(idx)
    }

    /// Entry `e` goes to disk (entries go in index order, each continuing the last).
    fn push(&mut self, e: &Entry) {
        if self.is_empty() {
            self.conf.clear();
        }
        self.disk.push(e.index, e.term);
        if e.get_entry_type() == EntryType::EntryConfChange {
            self.conf.push(e.clone());
        }
    }

    /// Entries `first..end` of the terms in `runs` (each (first index, term), ascending, the
    /// first at `first`) go to disk, with the configuration changes among them: a segment's
    /// summary, continuing what it holds.
    fn push_runs(&mut self, first: u64, end: u64, runs: &[(u64, u64)], conf: &[Entry]) {
        if first >= end {
            return;
        }
        if self.is_empty() {
            self.conf.clear();
            self.disk = OnDisk { first, end: first, runs: Vec::new() };
        }
        for (start, term) in runs {
            if *start >= end {
                break;
            }
            self.disk.push(*start, *term);
        }
        self.disk.end = end;
        self.conf.extend(conf.iter().filter(|e| e.index >= first && e.index < end).cloned());
    }

    /// Entries from `idx` on are gone (a newer leader's entries replace them; never a
    /// committed one, which is all a spill holds, but a file is not trusted to say so).
    fn truncate_from(&mut self, idx: u64) {
        self.disk.truncate_from(idx);
        self.conf.retain(|e| e.index < idx);
    }

    /// Entries up to `index` were compacted into a snapshot.
    fn drop_through(&mut self, index: u64) {
        self.disk.drop_through(index);
        self.conf.retain(|e| e.index > index);
    }
}

/// The size of each entry `MemStorage` holds, and their sum.
#[derive(Debug, Default)]
struct EntryCache {
    /// Most entry bytes kept in memory once applied (`None`: every entry stays).
    budget: Option<u64>,
    /// (index, bytes) of each entry in memory, ascending.
    sizes: VecDeque<(u64, u64)>,
    bytes: u64,
}

impl EntryCache {
    fn appended(&mut self, entries: &[Entry]) {
        let Some(first) = entries.first() else { return };
        while self.sizes.back().is_some_and(|(i, _)| *i >= first.index) {
            let (_, b) = self.sizes.pop_back().unwrap_or_default();
            self.bytes -= b;
        }
        for e in entries {
            let b = e.data.len() as u64 + ENTRY_OVERHEAD;
            self.sizes.push_back((e.index, b));
            self.bytes += b;
        }
    }

    /// Entries below `first` left memory.
    fn dropped_below(&mut self, first: u64) {
        while self.sizes.front().is_some_and(|(i, _)| *i < first) {
            let (_, b) = self.sizes.pop_front().unwrap_or_default();
            self.bytes -= b;
        }
    }

    fn clear(&mut self) {
        self.sizes.clear();
        self.bytes = 0;
    }
}

/// What an entry in memory costs besides its data (its `Entry`, its place in the log).
const ENTRY_OVERHEAD: u64 = 128;

/// Reads of entries held on disk only.
#[derive(Default)]
struct DiskReads {
    /// Asked by the engine and not yet handed to the driver: (low, high, max bytes).
    asked: Vec<(u64, u64, u64)>,
    /// Reads under way, by their first index.
    pending: std::collections::BTreeSet<u64>,
    /// The engine's requests waiting on a read, with the read's first index (tried again
    /// when it is answered). A few at most: the engine asks again on its next heartbeat.
    waiting: VecDeque<(u64, GetEntriesContext)>,
    /// Entries read, by their first index, while the engine takes them.
    ready: std::collections::BTreeMap<u64, Vec<Entry>>,
}

/// Requests kept waiting on reads of the disk (older ones are dropped: the engine asks again
/// at its next heartbeat to that follower).
const MAX_WAITING_READS: usize = 16;

impl Storage for GroupStore {
    fn initial_state(&self) -> raft::Result<RaftState> {
        self.mem.initial_state()
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        let max_size = max_size.into();
        if self.disk.is_empty() || low >= self.disk.end {
            return self.mem.entries(low, high, max_size, context);
        }
        if low < self.disk.first {
            return Err(raft::Error::Store(raft::StorageError::Compacted));
        }
        let mut reads = self.reads.borrow_mut();
        if let Some(got) = reads.ready.get(&low) {
            let mut ents: Vec<Entry> = got.iter().take_while(|e| e.index < high).cloned().collect();
            raft::util::limit_size(&mut ents, max_size);
            return Ok(ents);
        }
        if !context.can_async() {
            // Never met: the engine reads synchronously only after the applied index, and only
            // applied entries leave memory. Compacted is what the engine copes with.
            return Err(raft::Error::Store(raft::StorageError::Compacted));
        }
        if reads.pending.insert(low) {
            let max = max_size.unwrap_or(MAX_APPEND_BYTES).min(MAX_APPEND_BYTES);
            reads.asked.push((low, high.min(self.disk.end), max));
        }
        if reads.waiting.len() >= MAX_WAITING_READS {
            reads.waiting.pop_front();
        }
        reads.waiting.push_back((low, context));
        Err(raft::Error::Store(raft::StorageError::LogTemporarilyUnavailable))
    }

    fn term(&self, idx: u64) -> raft::Result<u64> {
        // The entry before the log's first: the snapshot's, or index 0 (term 0) of a log never
        // compacted (the in-memory log may start later, after entries left on disk at a
        // restart, and would call 0 compacted: a new member would then wait for a snapshot).
        let m = self.snapshot.get_metadata();
        if idx == m.index {
            return Ok(m.term);
        }
        if let Some(t) = self.disk.term(idx) {
            return Ok(t);
        }
        self.mem.term(idx)
    }

    fn first_index(&self) -> raft::Result<u64> {
        if self.disk.is_empty() { self.mem.first_index() } else { Ok(self.disk.first) }
    }

    fn last_index(&self) -> raft::Result<u64> {
        self.mem.last_index()
    }

    fn snapshot(&self, request_index: u64, to: u64) -> raft::Result<Snapshot> {
        let index = self.snapshot.get_metadata().index;
        if index == 0 || index < request_index {
            return Err(raft::Error::Store(raft::StorageError::SnapshotTemporarilyUnavailable));
        }
        let conf = self.snapshot.get_metadata().get_conf_state();
        if to != 0 && !conf.voters.contains(&to) && !conf.learners.contains(&to) {
            // A member added after the compaction: the engine refuses a snapshot whose
            // configuration does not name it, and would be sent this one forever. It gets the
            // configuration of now (the changes after the snapshot come again with the entries
            // that follow it, and re-applying them changes nothing).
            let mut snap = self.snapshot.clone();
            snap.mut_metadata().set_conf_state(self.mem.initial_state()?.conf_state);
            return Ok(snap);
        }
        Ok(self.snapshot.clone())
    }
}

impl GroupStore {
    /// Lets applied entries beyond the cache's budget leave memory, oldest first (the last
    /// entry always stays: `MemStorage` reads its last index from its entries).
    fn evict(&mut self, applied: u64) {
        let Some(budget) = self.cached.budget else { return };
        if self.cached.bytes <= budget {
            return;
        }
        let mut bytes = self.cached.bytes;
        let mut until = None;
        for (i, (idx, b)) in self.cached.sizes.iter().enumerate() {
            if bytes <= budget || *idx > applied || i + 1 == self.cached.sizes.len() {
                break;
            }
            bytes -= b;
            until = Some(*idx);
        }
        let Some(until) = until else { return };
        let Ok(first) = self.mem.first_index() else { return };
        for idx in first..=until {
            match self.mem.term(idx) {
                Ok(t) => self.disk.push(idx, t),
                Err(_) => return,
            }
        }
        if self.mem.wl().compact(until + 1).is_ok() {
            self.cached.dropped_below(until + 1);
        }
    }
}

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
        let storage = GroupStore { mem: storage, snapshot, disk, cached, reads: Default::default() };
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
        Ok(MetaNode { raw, out: first_persist.into_iter().collect(), report_empty: false, snapshots_sent: Vec::new() })
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

    /// Entry bytes held in memory (with [`ENTRY_OVERHEAD`] each), and how many entries of the
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

/// What a member must keep across a crash: its log and hard state, folded from its
/// [`MetaOutput::Persist`] outputs in order. The driver keeps one per member on disk (written
/// before the next output is carried out); the simulation keeps it in memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RaftLog {
    /// The log, in index order, without gaps.
    pub entries: Vec<Entry>,
    /// Term, vote and commit.
    pub hard_state: HardState,
    /// The snapshot the log was compacted to (it stands for every entry up to its index).
    pub snapshot: Option<Snapshot>,
    /// Committed entries after the snapshot and before `entries` that are on disk only (a
    /// restart's fold leaves them there: see [`Spill`]).
    pub spill: Option<Spill>,
}

impl RaftLog {
    /// A founding member's first log: one committed configuration change adding each founding
    /// voter (in id order, at term 1), identical on every founding member.
    pub fn founding(founding: &[(u64, Vec<u8>)]) -> RaftLog {
        use protobuf::Message as _;
        let mut voters = founding.to_vec();
        voters.sort_by_key(|(id, _)| *id);
        voters.dedup_by_key(|(id, _)| *id);
        let entries: Vec<Entry> = voters
            .iter()
            .enumerate()
            .map(|(i, (id, context))| {
                let mut cc = ConfChange::default();
                cc.set_change_type(ConfChangeType::AddNode);
                cc.set_node_id(*id);
                cc.set_context(context.clone().into());
                let mut e = Entry::default();
                e.set_entry_type(EntryType::EntryConfChange);
                e.index = i as u64 + 1;
                e.term = 1;
                e.data = cc.write_to_bytes().unwrap_or_default().into();
                e
            })
            .collect();
        let hard_state = HardState { term: 1, commit: entries.len() as u64, ..HardState::default() };
        RaftLog { entries, hard_state, snapshot: None, spill: None }
    }

    /// The voters the committed configuration changes of this log leave, or `None` for a log
    /// that has none.
    pub fn voters(&self) -> Option<Vec<u64>> {
        use protobuf::Message as _;
        // From the configuration the snapshot holds, when there is one: the changes after it
        // are changes to that, not to an empty group. (Replayed from nothing, a replica that
        // joined by a snapshot and then saw itself re-added restarted believing it was its
        // group's only voter, elected itself alone and committed an entry its group never
        // had: found by the world simulation, seed 473, once replicas moved more often.)
        let (base, at) = match &self.snapshot {
            Some(s) if s.get_metadata().index > 0 => {
                (s.get_metadata().get_conf_state().voters.clone(), s.get_metadata().index)
            }
            _ => (Vec::new(), 0),
        };
        let mut any = !base.is_empty();
        let mut voters: std::collections::BTreeSet<u64> = base.into_iter().collect();
        let spilled = self.spill.iter().flat_map(|s| s.conf.iter());
        for e in spilled.chain(self.entries.iter().take_while(|e| e.index <= self.hard_state.commit)) {
            if e.get_entry_type() != EntryType::EntryConfChange || e.index <= at {
                continue;
            }
            let Ok(cc) = ConfChange::parse_from_bytes(&e.data) else { continue };
            any = true;
            if cc.get_change_type() == ConfChangeType::RemoveNode {
                voters.remove(&cc.get_node_id());
            } else {
                voters.insert(cc.get_node_id());
            }
        }
        any.then(|| voters.into_iter().collect())
    }

    /// Folds one [`MetaOutput::PersistSnapshot`] in: entries up to its index go, and so do
    /// later ones unless the entry at its index has its term (a compaction keeps them; a
    /// snapshot from the leader replaced a log that did not match).
    pub fn persist_snapshot(&mut self, snapshot: &Snapshot) {
        let m = snapshot.get_metadata();
        if self.snapshot.as_ref().is_some_and(|s| s.get_metadata().index >= m.index) {
            return;
        }
        let matches = self.entries.iter().any(|e| e.index == m.index && e.term == m.term)
            || self.spill.as_ref().is_some_and(|s| s.term(m.index) == Some(m.term));
        if matches {
            self.entries.retain(|e| e.index > m.index);
            if let Some(s) = &mut self.spill {
                s.drop_through(m.index);
            }
        } else {
            self.entries.clear();
            self.spill = None;
        }
        if self.spill.as_ref().is_some_and(Spill::is_empty) {
            self.spill = None;
        }
        self.hard_state.commit = self.hard_state.commit.max(m.index);
        self.hard_state.term = self.hard_state.term.max(m.term);
        self.snapshot = Some(snapshot.clone());
    }

    /// The entries `low..high` it holds, about `max_bytes` of them from `low` on (one at
    /// least): what a driver keeping the log in memory answers [`MetaOutput::ReadEntries`]
    /// (and a replica log read) with.
    pub fn read(&self, low: u64, high: u64, max_bytes: u64) -> Vec<Entry> {
        let from = self.entries.partition_point(|e| e.index < low);
        let mut bytes = 0u64;
        let mut out = Vec::new();
        for e in self.entries[from..].iter().take_while(|e| e.index < high) {
            if !out.is_empty() && bytes + e.data.len() as u64 > max_bytes {
                break;
            }
            bytes += e.data.len() as u64;
            out.push(e.clone());
        }
        out
    }

    /// Bytes of entry data the log holds (what a compaction would give back).
    pub fn entry_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.data.len() as u64 + 24).sum()
    }

    /// Folds one `Persist` in: its entries replace the log from the first one's index on.
    ///
    /// The log is in index order, so where they go is a binary search: a scan from the start
    /// made a restart's fold of a long log quadratic (a replica of 1.9M entries took minutes
    /// to start).
    pub fn persist(&mut self, entries: &[Entry], hard_state: Option<&HardState>) {
        if let Some(first) = entries.first() {
            let keep = self.entries.partition_point(|e| e.index < first.index);
            self.entries.truncate(keep);
            if let Some(s) = &mut self.spill {
                s.truncate_from(first.index);
                if s.is_empty() {
                    self.spill = None;
                }
            }
            self.entries.extend_from_slice(entries);
        }
        if let Some(hs) = hard_state {
            self.hard_state = hs.clone();
        }
    }

    /// The last entry's index, in memory or spilled (or the snapshot's; 0 for none).
    pub fn last_index(&self) -> u64 {
        let spilled = self.spill.as_ref().map(|s| s.end().saturating_sub(1));
        self.entries
            .last()
            .map(|e| e.index)
            .or(spilled)
            .or(self.snapshot.as_ref().map(|s| s.get_metadata().index))
            .unwrap_or(0)
    }

    /// Moves committed entries from the front of `entries` into the [`Spill`] (terms and
    /// configuration changes only) while the entries left in memory hold more than `keep`
    /// bytes of data: what a restart needs in memory of a long log is its uncommitted tail and
    /// a cache's worth of the newest committed entries; the rest it replays from disk.
    pub fn spill_committed(&mut self, keep: u64) {
        let mut bytes: u64 = self.entries.iter().map(|e| e.data.len() as u64 + ENTRY_OVERHEAD).sum();
        let mut n = 0;
        for e in &self.entries {
            if bytes <= keep || e.index > self.hard_state.commit {
                break;
            }
            bytes -= e.data.len() as u64 + ENTRY_OVERHEAD;
            n += 1;
        }
        if n == 0 {
            return;
        }
        let spill = self.spill.get_or_insert_with(Spill::default);
        for e in self.entries.drain(..n) {
            spill.push(&e);
        }
    }

    /// The bytes a driver keeps in a file: `"FLXR"`, u32 entry count, each entry and then the
    /// hard state as u32 length + protobuf, and a CRC-32C of everything before it.
    pub fn encode(&self) -> Vec<u8> {
        use protobuf::Message as _;
        let mut out = Vec::new();
        out.extend_from_slice(b"FLXR");
        out.extend_from_slice(&(self.entries.len() as u32).to_be_bytes());
        let mut put = |b: Vec<u8>| {
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(&b);
        };
        for e in &self.entries {
            put(e.write_to_bytes().unwrap_or_default());
        }
        put(self.hard_state.write_to_bytes().unwrap_or_default());
        let crc = crate::storage::crc32c(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    /// Reads [`encode`](Self::encode)'s bytes. Never panics.
    ///
    /// # Errors
    /// [`MetaError::Decode`] for bytes that are not a whole, intact Raft log.
    pub fn decode(data: &[u8]) -> Result<RaftLog, MetaError> {
        Self::decode_in(data, None)
    }

    /// [`decode`](Self::decode), the entries' data shared with `buffer` (of which `data` is a
    /// part) rather than copied: a log read back at a restart is then held once, and a
    /// segment's buffer is freed whole once its entries left memory. Never panics.
    ///
    /// # Errors
    /// As [`decode`](Self::decode).
    fn decode_in(data: &[u8], buffer: Option<&bytes::Bytes>) -> Result<RaftLog, MetaError> {
        use protobuf::Message as _;
        let bad = |why: &str| MetaError::Decode(format!("raft log: {why}"));
        if data.len() < 12 || &data[..4] != b"FLXR" {
            return Err(bad("not a Raft log file"));
        }
        let (body, crc) = data.split_at(data.len() - 4);
        if crate::storage::crc32c(body).to_be_bytes() != crc {
            return Err(bad("checksum mismatch"));
        }
        let mut at = 4;
        let word = |at: &mut usize| -> Result<u32, MetaError> {
            let w = body.get(*at..*at + 4).ok_or_else(|| bad("truncated"))?;
            *at += 4;
            Ok(u32::from_be_bytes([w[0], w[1], w[2], w[3]]))
        };
        let count = word(&mut at)?;
        let mut entries = Vec::new();
        for _ in 0..count {
            let len = word(&mut at)? as usize;
            let b = body.get(at..at + len).ok_or_else(|| bad("truncated entry"))?;
            at += len;
            let e = match buffer.and_then(|buf| shared_part(buf, b)) {
                Some(shared) => Entry::parse_from_carllerche_bytes(&shared),
                None => Entry::parse_from_bytes(b),
            };
            entries.push(e.map_err(|e| bad(&e.to_string()))?);
        }
        let len = word(&mut at)? as usize;
        let b = body.get(at..at + len).ok_or_else(|| bad("truncated hard state"))?;
        let hard_state = HardState::parse_from_bytes(b).map_err(|e| bad(&e.to_string()))?;
        if at + len != body.len() {
            return Err(bad("trailing bytes"));
        }
        // The engine assumes a gapless log in index order: a file that says otherwise is
        // refused here rather than handed to it.
        if entries.windows(2).any(|w| w[1].index != w[0].index + 1) || entries.first().is_some_and(|e| e.index == 0) {
            return Err(bad("entries out of order"));
        }
        Ok(RaftLog { entries, hard_state, snapshot: None, spill: None })
    }
}

/// One [`MetaOutput::Persist`] as a record of an append-only file (how a driver keeps a
/// replicated shard's Raft log, appended to on every write rather than rewritten):
/// `u32 length`, `u8 has_hard_state`, then the persisted part as a [`RaftLog`] (whose own
/// checksum covers it).
pub fn encode_log_record(entries: &[Entry], hard_state: Option<&HardState>) -> Vec<u8> {
    let mut out = Vec::new();
    encode_log_record_into(&mut out, entries, hard_state);
    out
}

/// [`encode_log_record`] appended to `out`: a driver that clears and reuses one buffer writes
/// every record from warm memory rather than a fresh allocation (each new page of a fresh
/// 1 MiB buffer is faulted in and zeroed by the kernel).
pub fn encode_log_record_into(out: &mut Vec<u8>, entries: &[Entry], hard_state: Option<&HardState>) {
    use protobuf::Message as _;
    // Written straight into one buffer (each entry's bytes copied once): the same bytes as
    // `RaftLog::encode` of the part, behind the record's length and flag.
    let none = HardState::default();
    let hs = hard_state.unwrap_or(&none);
    let size: usize = entries.iter().map(|e| e.compute_size() as usize + 4).sum::<usize>() + hs.compute_size() as usize;
    out.reserve(size + 21);
    let start = out.len();
    out.extend_from_slice(&[0; 4]);
    out.push(u8::from(hard_state.is_some()));
    let part = out.len();
    out.extend_from_slice(b"FLXR");
    out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
    let put = put_message;
    for e in entries {
        put(out, e);
    }
    put(out, hs);
    seal_record_at(out, start, part);
}

/// Appends `m` as `u32 length` + its protobuf (how a log record and a segment summary hold
/// entries and hard states).
pub(crate) fn put_message(out: &mut Vec<u8>, m: &dyn protobuf::Message) {
    let at = out.len();
    out.extend_from_slice(&[0; 4]);
    // Writing a message to a Vec does not fail.
    let _ = m.write_to_vec(out);
    let n = (out.len() - at - 4) as u32;
    out[at..at + 4].copy_from_slice(&n.to_be_bytes());
}

/// Ends a record begun with 4 placeholder bytes: the CRC-32C of its part from `part` on, then
/// its length in front.
fn seal_record(mut out: Vec<u8>, part: usize) -> Vec<u8> {
    seal_record_at(&mut out, 0, part);
    out
}

/// [`seal_record`] for a record that starts at `start` of `out`.
fn seal_record_at(out: &mut Vec<u8>, start: usize, part: usize) {
    let crc = crate::storage::crc32c(&out[part..]);
    out.extend_from_slice(&crc.to_be_bytes());
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
}

/// One [`MetaOutput::PersistSnapshot`] as a record of the same append-only file:
/// `u32 length`, `u8 2`, `"FLXS"`, `u32 length` + the snapshot's protobuf, CRC-32C of the bytes
/// from `"FLXS"` on.
pub fn encode_snapshot_record(snapshot: &Snapshot) -> Vec<u8> {
    use protobuf::Message as _;
    let mut out = vec![0; 4];
    out.push(2);
    let part = out.len();
    out.extend_from_slice(b"FLXS");
    out.extend_from_slice(&[0; 4]);
    let _ = snapshot.write_to_vec(&mut out);
    let n = (out.len() - part - 8) as u32;
    out[part + 4..part + 8].copy_from_slice(&n.to_be_bytes());
    seal_record(out, part)
}

fn decode_snapshot_record(body: &[u8]) -> Option<Snapshot> {
    use protobuf::Message as _;
    if body.len() < 12 || &body[..4] != b"FLXS" {
        return None;
    }
    let (part, crc) = body.split_at(body.len() - 4);
    if crate::storage::crc32c(part).to_be_bytes() != crc {
        return None;
    }
    let n = u32::from_be_bytes([part[4], part[5], part[6], part[7]]) as usize;
    let b = part.get(8..).filter(|b| b.len() == n)?;
    Snapshot::parse_from_bytes(b).ok()
}

/// Folds an append-only file of [`encode_log_record`] (and [`encode_snapshot_record`])
/// records into the log they leave, and says how many bytes of it were whole records. A torn
/// record ends the file there (a crash mid-append): what came before it stands, and the driver
/// cuts the file to that length before appending again. Damage (see [`LogDamage`]) also ends
/// it there; [`fold_log_segments_checked`] tells the two apart. Never panics.
pub fn fold_log_records(data: &[u8]) -> (RaftLog, usize) {
    let (log, segments) = fold_log_segments(&[data]);
    (log, segments.first().map_or(0, |s| s.whole))
}

/// What [`fold_log_segments`] found in one file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SegmentInfo {
    /// Bytes of whole records (a torn tail after them is cut).
    pub whole: usize,
    /// The highest entry index it holds (0: none). A segment whose entries all lie at or
    /// below the log's snapshot is no longer needed.
    pub max_index: u64,
}

/// Why a kept replica log cannot be trusted. A crash mid-append leaves a *torn tail*: the
/// last record runs past the end of the file (or its length was only partly written), and
/// nothing whole follows it; what was torn was never synced, so never acknowledged, and is
/// cut. Anything else is damage: a bit flip, a truncation, a lost block. The bytes past it may
/// have held entries this replica acknowledged and the vote it gave in a term, so the log
/// neither serves nor votes from what is left: the replica rejoins its group afresh.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("segment {segment}, byte {offset}: {kind}")]
pub struct LogDamage {
    /// Which segment (0: the oldest given).
    pub segment: usize,
    /// Where in it the damage starts.
    pub offset: usize,
    /// What was found.
    pub kind: DamageKind,
}

/// What [`LogDamage`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum DamageKind {
    /// A record whose bytes are all there fails its checksum or does not decode.
    #[error("a whole record fails its checksum")]
    Checksum,
    /// The last record's length says it runs past the end of the file, yet the bytes after
    /// the length are a whole record: the length itself was damaged (a torn write leaves a
    /// body that fails its checksum).
    #[error("a record's length field is damaged")]
    Length,
    /// The framing breaks, yet a whole record follows later in the file (not a torn tail).
    #[error("the framing breaks with whole records after it")]
    RecordsAfterBreak,
    /// A closed segment (one a later segment follows) ends short: it was synced whole when
    /// it was closed.
    #[error("a closed segment ends short")]
    ClosedSegmentShort,
    /// A record's entries do not continue the log.
    #[error("entries leave a gap")]
    Gap,
    /// The kept hard state says entries were committed past the last one kept (a truncation).
    #[error("the commit index lies past the last entry kept")]
    CommitPastEntries,
}

/// What is at `at` in an append-only file.
enum RecordAt<'a> {
    /// The end of the file.
    End,
    /// Framing that does not hold: fewer than 4 bytes, a zero length, or a length past the end.
    Short,
    /// A whole record (by its framing): its end and its body.
    Whole(usize, &'a [u8]),
}

fn record_at(data: &[u8], at: usize) -> RecordAt<'_> {
    if at >= data.len() {
        return RecordAt::End;
    }
    let Some(w) = data.get(at..at + 4) else { return RecordAt::Short };
    let len = u32::from_be_bytes([w[0], w[1], w[2], w[3]]) as usize;
    match data.get(at + 4..(at + 4).saturating_add(len)) {
        Some(body) if !body.is_empty() => RecordAt::Whole(at + 4 + len, body),
        _ => RecordAt::Short,
    }
}

/// A record body that decodes: a snapshot (`Ok(Ok)`), a log part (`Ok(Err)`), or damage
/// (`Err`). The flag byte lies outside the checksum, so it is checked against what it flags:
/// a record with a hard state carries one Raft wrote (never the all-zero initial one), a
/// record without carries the zero placeholder. A flipped flag would otherwise forget a vote
/// or put term 0 in its place.
/// `part` as a slice of `buffer` (no copy), when it lies within it.
fn shared_part(buffer: &bytes::Bytes, part: &[u8]) -> Option<bytes::Bytes> {
    let start = (part.as_ptr() as usize).checked_sub(buffer.as_ptr() as usize)?;
    (start + part.len() <= buffer.len()).then(|| buffer.slice(start..start + part.len()))
}

fn decode_body(body: &[u8]) -> Result<Result<Snapshot, RaftLog>, ()> {
    decode_body_in(body, None)
}

/// [`decode_body`], entries sharing `buffer` (see [`RaftLog::decode_in`]).
fn decode_body_in(body: &[u8], buffer: Option<&bytes::Bytes>) -> Result<Result<Snapshot, RaftLog>, ()> {
    match body[0] {
        2 => decode_snapshot_record(&body[1..]).map(Ok).ok_or(()),
        flag @ (0 | 1) => {
            let part = RaftLog::decode_in(&body[1..], buffer).map_err(|_| ())?;
            if (flag == 1) == (part.hard_state == HardState::default()) {
                return Err(());
            }
            Ok(Err(part))
        }
        _ => Err(()),
    }
}

/// Whether a whole record that decodes starts anywhere after `from` (a cheap check of its
/// flag and magic first: a scan of garbage costs one comparison per byte).
fn whole_record_after(data: &[u8], from: usize) -> bool {
    (from + 1..data.len().saturating_sub(8)).any(|at| {
        let flag = data[at + 4];
        let magic = &data[at + 5..at + 9];
        let plausible = (flag <= 1 && magic == b"FLXR") || (flag == 2 && magic == b"FLXS");
        plausible && matches!(record_at(data, at), RecordAt::Whole(_, body) if decode_body(body).is_ok())
    })
}

/// Folds a log kept as several append-only files (segments, oldest first) into the log they
/// leave. Segments a snapshot made useless may have been deleted, so the fold starts from the
/// last snapshot: entries below its index are skipped wherever they are, and the ones after it
/// must follow without a gap. A torn tail or damage ends the fold there (see
/// [`fold_log_segments_checked`] to tell them apart). Never panics.
pub fn fold_log_segments(segments: &[&[u8]]) -> (RaftLog, Vec<SegmentInfo>) {
    let (log, infos, _) = fold_log_segments_checked(segments);
    (log, infos)
}

/// [`fold_log_segments`], and the first damage found (`None`: at most a torn tail, which
/// [`SegmentInfo::whole`] says where to cut). After damage the fold stops: the log returned is
/// what came before it, which a driver must not serve or vote from. Never panics.
pub fn fold_log_segments_checked(segments: &[&[u8]]) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>) {
    let (log, infos, damage, _) = fold_log_segments_indexed(segments);
    (log, infos, damage)
}

/// The record at `at` of an append-only log file: where it ends, and its entries and hard
/// state (`None` for a snapshot record, or one that does not decode). `None` at the end of the
/// file or where the framing breaks. Never panics.
pub fn read_log_record(data: &[u8], at: usize) -> Option<(usize, Option<RaftLog>)> {
    match record_at(data, at) {
        RecordAt::Whole(end, body) => Some((end, decode_body(body).ok().and_then(Result::err))),
        RecordAt::End | RecordAt::Short => None,
    }
}

/// [`fold_log_segments_checked`], and the sparse index of where its records start
/// ([`super::log_read::LogPoints`], segments numbered from 0 in the order given): what a driver
/// reads entries back with once they left memory. Never panics.
pub fn fold_log_segments_indexed(
    segments: &[&[u8]],
) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, super::log_read::LogPoints) {
    fold_segments(segments, None)
}

/// [`fold_log_segments_indexed`] over segments read into shared buffers: the entries' data are
/// slices of them, not copies (a restart holds the log once; a segment's buffer goes whole once
/// its entries left memory). Never panics.
pub fn fold_log_segments_shared(
    segments: &[bytes::Bytes],
) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, super::log_read::LogPoints) {
    let views: Vec<&[u8]> = segments.iter().map(|b| b.as_ref()).collect();
    fold_segments(&views, Some(segments))
}

fn fold_segments(
    segments: &[&[u8]],
    buffers: Option<&[bytes::Bytes]>,
) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, super::log_read::LogPoints) {
    // Pass 1: the last snapshot's index (entry records are decoded once, in pass 2).
    let floor = segments.iter().map(|d| LogFold::snapshot_floor(d)).max().unwrap_or(0);
    // Pass 2: every record in order, entries below the floor skipped.
    let mut fold = LogFold::new(floor, None);
    for (segment, data) in segments.iter().enumerate() {
        if !fold.feed(data, buffers.and_then(|b| b.get(segment)), segment + 1 == segments.len()) {
            break;
        }
    }
    fold.finish()
}

/// The fold of a kept log's segments one at a time, oldest first (what
/// [`fold_log_segments_indexed`] does over all of them at once): a driver reads, feeds and
/// drops one segment after another, and with a `keep` budget the committed entries beyond it
/// go to the log's [`Spill`] as they are folded, so a restart of a long log holds a bounded
/// part of it (the segment being read, the uncommitted tail and `keep` bytes of entries).
/// Never panics.
#[derive(Debug)]
pub struct LogFold {
    floor: u64,
    keep: Option<u64>,
    log: RaftLog,
    infos: Vec<SegmentInfo>,
    damage: Option<LogDamage>,
    points: super::log_read::LogPoints,
    /// A summary of each segment folded from its records (`None` for one folded from its
    /// summary): what a driver writes beside a closed segment that has none, and goes on
    /// building for the last one as it appends.
    builders: Vec<Option<SummaryBuilder>>,
}

use super::segment_summary::{Part, PointStep, SegmentSummary, SummaryBuilder};

impl LogFold {
    /// The highest snapshot index among the whole snapshot records of one segment (0: none):
    /// the fold's first pass, over every segment, before the first [`feed`](Self::feed).
    /// Segments a snapshot made useless may have been deleted, so entries below the last
    /// snapshot are skipped wherever they are, and the ones after it must follow without a gap.
    pub fn snapshot_floor(data: &[u8]) -> u64 {
        let mut floor = 0;
        let mut at = 0;
        while let RecordAt::Whole(end, body) = record_at(data, at) {
            if body[0] == 2
                && let Some(snap) = decode_snapshot_record(&body[1..])
            {
                floor = floor.max(snap.get_metadata().index);
            }
            at = end;
        }
        floor
    }

    /// A fold from the floor [`snapshot_floor`](Self::snapshot_floor) found; `keep`: spill
    /// committed entries beyond that many bytes (`None`: every entry stays in memory).
    pub fn new(floor: u64, keep: Option<u64>) -> LogFold {
        LogFold {
            floor,
            keep,
            log: RaftLog::default(),
            infos: Vec::new(),
            damage: None,
            points: super::log_read::LogPoints::default(),
            builders: Vec::new(),
        }
    }

    /// The index the next entry continues the log at: after the last entry held, or, with
    /// none held, after the snapshot folded or at the floor, whichever is higher (entries
    /// below the floor were skipped, so an older snapshot folded on the way there says
    /// nothing of where the entries kept go on).
    fn next_index(log: &RaftLog, floor: u64) -> u64 {
        let next = log.entries.last().map(|l| l.index + 1);
        let next = next.or(log.spill.as_ref().map(Spill::end));
        next.unwrap_or_else(|| log.snapshot.as_ref().map_or(0, |s| s.get_metadata().index + 1).max(floor).max(1))
    }

    /// Folds the next segment from its summary instead of its records (`snapshots`: the
    /// snapshot records it names, read from the segment, in order), when that is the same as
    /// folding the records and the fold keeps no entry of it in memory: a `keep` budget is
    /// set, no entry of it lies at or below the last snapshot, and every entry in it is
    /// committed by the hard state it leaves. Returns `false`, changing nothing, otherwise: the
    /// driver then feeds the records ([`feed`](Self::feed)). A gap is damage, as from the
    /// records (see [`damage`](Self::damage)).
    ///
    /// `commit` is the commit index the log's last segment leaves ([`last_commit`]): the last
    /// entries of a segment are usually committed only by hard states written after it was
    /// closed. What the fold spills is checked against the hard state it ends with
    /// ([`finish`](Self::finish)).
    ///
    /// [`last_commit`]: Self::last_commit
    pub fn feed_summary(&mut self, summary: &SegmentSummary, snapshots: &[&[u8]], commit: u64) -> bool {
        if self.damage.is_some() || self.keep.is_none() {
            return false;
        }
        if summary.min_index != u64::MAX && summary.min_index <= self.floor {
            return false;
        }
        let mut snaps = Vec::new();
        for (&record, (_, len)) in snapshots.iter().zip(summary.snapshots()) {
            match record_at(record, 0) {
                RecordAt::Whole(end, body) if end as u64 == len && body[0] == 2 => {
                    match decode_snapshot_record(&body[1..]) {
                        Some(snap) => snaps.push(snap),
                        None => return false,
                    }
                }
                _ => return false,
            }
        }
        if snaps.len() != snapshots.len() || snaps.len() != summary.snapshots().count() {
            return false;
        }
        // Every entry it writes committed.
        let commit = commit.max(self.log.hard_state.commit);
        if summary
            .parts
            .iter()
            .any(|p| matches!(p, Part::Entries { first, end, .. } if end > first && end - 1 > commit))
        {
            return false;
        }
        let segment = self.infos.len();
        let mut snaps = snaps.into_iter();
        for p in &summary.parts {
            match p {
                Part::Snapshot { .. } => {
                    if let Some(snap) = snaps.next().filter(|s| s.get_metadata().index >= self.floor) {
                        self.log.persist_snapshot(&snap);
                    }
                }
                Part::Entries { first, end, runs, conf, hard_state } => {
                    if end > first {
                        if *first > Self::next_index(&self.log, self.floor) {
                            self.damage = Some(LogDamage { segment, offset: 0, kind: DamageKind::Gap });
                            self.infos.push(SegmentInfo::default());
                            self.builders.push(None);
                            return true;
                        }
                        // What this writes replaces the log from `first`; what is left before
                        // it is committed (it lies below entries the hard state commits), so
                        // it goes to disk too, and the spill stays in front of memory.
                        let log = &mut self.log;
                        log.persist(&[], hard_state.as_ref());
                        let keep = log.entries.partition_point(|e| e.index < *first);
                        log.entries.truncate(keep);
                        let spill = log.spill.get_or_insert_with(Spill::default);
                        spill.truncate_from(*first);
                        for e in log.entries.drain(..) {
                            spill.push(&e);
                        }
                        spill.push_runs(*first, *end, runs, conf);
                    } else {
                        self.log.persist(&[], hard_state.as_ref());
                    }
                }
            }
        }
        let seq = segment as u64;
        for step in &summary.points {
            match *step {
                PointStep::Record { pos, len, first, last } => {
                    self.points.record(seq, pos, len, first, last);
                }
                PointStep::Extend { len, last } => self.points.extend(len, last),
            }
        }
        self.infos.push(SegmentInfo { whole: summary.len as usize, max_index: summary.max_index });
        self.builders.push(None);
        true
    }

    /// The commit index of the last whole hard-state record of a segment (0: none): what the
    /// last segment says is committed, for [`feed_summary`](Self::feed_summary). Reads each
    /// record's framing and checksum, not its entries.
    pub fn last_commit(data: &[u8]) -> u64 {
        use protobuf::Message as _;
        let mut at = 0;
        let mut commit = 0;
        while let RecordAt::Whole(end, body) = record_at(data, at) {
            at = end;
            if body[0] != 1 || body.len() < 13 || &body[1..5] != b"FLXR" {
                continue;
            }
            let part = &body[1..];
            let (inner, crc) = part.split_at(part.len() - 4);
            if crate::storage::crc32c(inner).to_be_bytes() != crc {
                break;
            }
            let word = |i: usize| inner.get(i..i + 4).map(|w| u32::from_be_bytes([w[0], w[1], w[2], w[3]]) as usize);
            let Some(count) = word(4) else { break };
            let mut i = 8;
            for _ in 0..count {
                match word(i) {
                    Some(n) => i = i.saturating_add(4).saturating_add(n),
                    None => break,
                }
            }
            let hs = word(i).and_then(|n| inner.get(i + 4..i + 4 + n));
            match hs.map(HardState::parse_from_bytes) {
                Some(Ok(h)) => commit = h.commit,
                _ => break,
            }
        }
        commit
    }

    /// The damage found so far.
    pub fn damage(&self) -> Option<&LogDamage> {
        self.damage.as_ref()
    }

    /// A summary builder for each segment fed, in order: `Some` for one folded from its
    /// records (the builder of the last goes on as the driver appends to it), `None` for one
    /// folded from its summary.
    pub fn take_builders(&mut self) -> Vec<Option<SummaryBuilder>> {
        std::mem::take(&mut self.builders)
    }

    /// Folds the next segment (`buffer`: the same bytes, shared, for the entries' data to be
    /// slices of; `last`: no segment follows, so a short end is a torn tail rather than
    /// damage). Returns `false` once damage was found: the fold stops there.
    pub fn feed(&mut self, data: &[u8], buffer: Option<&bytes::Bytes>, last: bool) -> bool {
        if self.damage.is_some() {
            return false;
        }
        let segment = self.infos.len();
        let mut info = SegmentInfo::default();
        let mut builder = SummaryBuilder::new();
        let log = &mut self.log;
        let floor = self.floor;
        let damaged = |offset, kind| Some(LogDamage { segment, offset, kind });
        loop {
            let body = match record_at(data, info.whole) {
                RecordAt::End => break,
                RecordAt::Whole(_, body) => body,
                RecordAt::Short if !last => {
                    self.damage = damaged(info.whole, DamageKind::ClosedSegmentShort);
                    break;
                }
                RecordAt::Short if data.len() > info.whole + 5 && decode_body(&data[info.whole + 4..]).is_ok() => {
                    self.damage = damaged(info.whole, DamageKind::Length);
                    break;
                }
                RecordAt::Short if whole_record_after(data, info.whole) => {
                    self.damage = damaged(info.whole, DamageKind::RecordsAfterBreak);
                    break;
                }
                // A torn tail: cut here.
                RecordAt::Short => break,
            };
            let end = info.whole + 4 + body.len();
            let mut part = match decode_body_in(body, buffer) {
                Ok(Ok(snap)) => {
                    // One older than the floor is superseded by the floor's, later in the
                    // files; folded, it would find the entry at its index skipped (below the
                    // floor) and drop the entries kept as if it replaced a log that did not
                    // match.
                    if snap.get_metadata().index >= floor {
                        log.persist_snapshot(&snap);
                    }
                    builder.snapshot(info.whole as u64, (end - info.whole) as u64);
                    self.points.skip((end - info.whole) as u64);
                    info.whole = end;
                    continue;
                }
                Ok(Err(part)) => part,
                Err(()) => {
                    self.damage = damaged(info.whole, DamageKind::Checksum);
                    break;
                }
            };
            // Entries below the last snapshot are covered by it (the one at its index stays
            // until the snapshot is folded in: it says whether later entries match).
            let below = log.snapshot.as_ref().map_or(floor, |s| s.get_metadata().index + 1).max(floor);
            let hs = (body[0] != 0).then_some(&part.hard_state);
            builder.record(info.whole as u64, (end - info.whole) as u64, &part.entries, hs);
            let max_index = part.entries.last().map_or(0, |e| e.index);
            part.entries.retain(|e| e.index >= below);
            // The entries must continue the log (or overwrite its tail): a record that would
            // leave a gap is damage, not a crash.
            let next = Self::next_index(log, floor);
            if part.entries.first().is_some_and(|e| e.index > next) {
                self.damage = damaged(info.whole, DamageKind::Gap);
                break;
            }
            info.max_index = info.max_index.max(max_index);
            let len = (end - info.whole) as u64;
            match (part.entries.first(), part.entries.last()) {
                (Some(f), Some(l)) => {
                    self.points.record(segment as u64, info.whole as u64, len, f.index, l.index);
                }
                _ => self.points.skip(len),
            }
            log.persist(&part.entries, (body[0] != 0).then_some(&part.hard_state));
            info.whole = end;
        }
        self.infos.push(info);
        self.builders.push(Some(builder));
        if let Some(keep) = self.keep {
            self.log.spill_committed(keep);
        }
        self.damage.is_none()
    }

    /// The log folded, what each segment fed held, the first damage found (`None`: at most
    /// a torn tail, which [`SegmentInfo::whole`] says where to cut) and the index of where
    /// the records start. After damage the log is what came before it, which a driver must
    /// not serve or vote from.
    pub fn finish(self) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, super::log_read::LogPoints) {
        let LogFold { log, infos, mut damage, points, .. } = self;
        // A commit past every entry kept: entries this replica held (and may have
        // acknowledged) are gone, though every record left is whole (a file cut at a record
        // boundary).
        let last_index = log.last_index();
        // Entries folded from summaries went to disk on the strength of the commit the driver
        // read from the last segment: the hard state folded must say the same.
        let spilled_past_commit = log.spill.as_ref().is_some_and(|s| s.end() - 1 > log.hard_state.commit);
        if damage.is_none() && (log.hard_state.commit > last_index || spilled_past_commit) {
            let segment = infos.len().saturating_sub(1);
            let offset = infos.last().map_or(0, |i| i.whole);
            damage = Some(LogDamage { segment, offset, kind: DamageKind::CommitPastEntries });
        }
        (log, infos, damage, points)
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
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    /// A kept log's voters start from its snapshot's configuration: the changes after it are
    /// changes to that group. Read from nothing, a replica that joined by a snapshot and was
    /// then re-added (a move given up and undone) restarted as its group's only voter, elected
    /// itself alone and committed an entry the group never had (world simulation, seed 473).
    #[test]
    fn a_kept_logs_voters_start_from_its_snapshots_configuration() {
        use protobuf::Message as _;
        let change = |index: u64, add: bool, id: u64| {
            let mut cc = ConfChange::default();
            cc.set_change_type(if add { ConfChangeType::AddNode } else { ConfChangeType::RemoveNode });
            cc.set_node_id(id);
            let mut e = Entry { index, term: 4, ..Entry::default() };
            e.set_entry_type(EntryType::EntryConfChange);
            e.data = cc.write_to_bytes().unwrap().into();
            e
        };
        let mut snapshot = Snapshot::default();
        snapshot.mut_metadata().index = 10;
        snapshot.mut_metadata().term = 3;
        snapshot.mut_metadata().set_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
        let mut log = RaftLog { snapshot: Some(snapshot), ..RaftLog::default() };
        log.hard_state.commit = 12;
        assert_eq!(log.voters(), Some(vec![1, 2, 3]), "the snapshot's alone");
        log.entries = vec![change(11, false, 3), change(12, true, 3)];
        assert_eq!(log.voters(), Some(vec![1, 2, 3]), "3 removed, then added back");
        log.entries.push(change(13, true, 4));
        assert_eq!(log.voters(), Some(vec![1, 2, 3]), "an uncommitted change counts for nothing");
        log.hard_state.commit = 13;
        assert_eq!(log.voters(), Some(vec![1, 2, 3, 4]));
        // A founding log (no snapshot): its own changes from the first entry.
        let founding = RaftLog::founding(&[(5, Vec::new()), (6, Vec::new())]);
        assert_eq!(founding.voters(), Some(vec![5, 6]));
    }

    /// `persist` appends, and a write from an index already held replaces the log from there
    /// (a new leader overwrote an unconfirmed tail), wherever in the log it lands; folding a
    /// long log one entry at a time keeps every entry once, in order.
    #[test]
    fn persist_appends_and_overwrites_a_tail_at_the_right_place() {
        let entry = |index: u64, term: u64| Entry { index, term, ..Entry::default() };
        let mut log = RaftLog::default();
        for i in 1..=200_000u64 {
            log.persist(&[entry(i, 1)], None);
        }
        assert_eq!(log.entries.len(), 200_000);
        log.persist(&[entry(199_998, 2), entry(199_999, 2)], None);
        let tail: Vec<(u64, u64)> = log.entries[199_995..].iter().map(|e| (e.index, e.term)).collect();
        assert_eq!(tail, vec![(199_996, 1), (199_997, 1), (199_998, 2), (199_999, 2)]);
        log.persist(&[entry(3, 3)], None);
        assert_eq!(log.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(), vec![(1, 1), (2, 1), (3, 3)]);
        log.persist(&[entry(4, 3)], None);
        assert_eq!(log.entries.len(), 4);
    }

    #[test]
    fn a_message_in_pieces_decodes_to_the_message() {
        use raft::eraftpb::{EntryType, MessageType};
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgAppend);
        m.to = 3;
        m.from = 1;
        m.term = 9;
        m.log_term = 8;
        m.index = 41;
        m.commit = 40;
        m.context = bytes::Bytes::from_static(b"ctx");
        for (i, size) in [0usize, 1, 127, 128, 20_000, 300_000].into_iter().enumerate() {
            let mut e = Entry::default();
            e.set_entry_type(if i == 2 { EntryType::EntryConfChange } else { EntryType::EntryNormal });
            e.term = 9;
            e.index = 42 + i as u64;
            e.data = bytes::Bytes::from(vec![i as u8; size]);
            if i == 3 {
                e.context = bytes::Bytes::from_static(b"entry context");
            }
            m.entries.push(e);
        }
        let parts = encode_message_parts(&m);
        assert!(parts.parts().len() > 2, "in pieces: {}", parts.parts().len());
        assert_eq!(decode_message(&parts.to_bytes()).expect("decodes"), m);
        assert_eq!(decode_message_shared(&parts.to_bytes()).expect("decodes"), m);
        // A small message is one piece, byte for byte the canonical encoding.
        let mut small = m.clone();
        small.entries.truncate(3);
        let one = encode_message_parts(&small);
        assert_eq!(one.parts().len(), 1);
        assert_eq!(one.to_bytes().as_ref(), encode_message(&small).as_slice());
    }

    #[test]
    fn a_kept_raft_log_round_trips_and_bad_bytes_are_refused() {
        let mut g = Group::new(&[1, 2, 3]);
        for _ in 0..30 {
            for n in g.nodes.values_mut() {
                n.tick();
            }
            g.settle();
        }
        let leader = *g.nodes.keys().find(|id| g.nodes[id].is_leader()).unwrap();
        g.nodes.get_mut(&leader).unwrap().propose(b"cmd".to_vec()).unwrap();
        g.settle();
        let kept = g.kept[&1].clone();
        assert!(!kept.entries.is_empty() && kept.hard_state.term > 0);
        let bytes = kept.encode();
        assert_eq!(RaftLog::decode(&bytes).unwrap(), kept);
        for cut in [0, 3, 11, bytes.len() - 1] {
            assert!(RaftLog::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(RaftLog::decode(&bad).is_err(), "flipped byte {i}");
        }
    }

    #[test]
    fn an_append_only_log_folds_back_and_stops_at_a_torn_record() {
        let e =
            |index: u64, term: u64, data: &[u8]| Entry { index, term, data: data.to_vec().into(), ..Entry::default() };
        let hs = |term: u64, commit: u64| HardState { term, vote: 1, commit, ..HardState::default() };
        let mut file = Vec::new();
        file.extend(encode_log_record(&[e(1, 1, b"a"), e(2, 1, b"b"), e(3, 1, b"c")], Some(&hs(1, 1))));
        // A new leader overwrote the tail from index 3; no hard state change in this one.
        file.extend(encode_log_record(&[e(3, 2, b"x")], None));
        file.extend(encode_log_record(&[], Some(&hs(2, 3))));
        let whole = file.len();
        let (log, len) = fold_log_records(&file);
        assert_eq!(len, whole);
        assert_eq!(log.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(), vec![(1, 1), (2, 1), (3, 2)]);
        assert_eq!(log.hard_state, hs(2, 3));
        // Torn anywhere in the last record: the records before it stand.
        let last = encode_log_record(&[e(4, 2, b"y")], None);
        for cut in 0..last.len() {
            let mut torn = file.clone();
            torn.extend_from_slice(&last[..cut]);
            let (l, n) = fold_log_records(&torn);
            assert_eq!((l.entries.len(), n), (3, whole), "cut at {cut}");
        }
        // A damaged byte inside a record ends the file there, and is said to be damage.
        let mut bad = file.clone();
        bad[whole - 3] ^= 0x10;
        assert!(fold_log_records(&bad).1 < whole);
        assert_eq!(fold_log_segments_checked(&[&bad]).2.map(|d| d.kind), Some(DamageKind::Checksum));
        // A record that would leave a gap is refused.
        let mut gap = file.clone();
        gap.extend(encode_log_record(&[e(9, 2, b"z")], None));
        assert_eq!(fold_log_records(&gap).1, whole);
        assert_eq!(fold_log_segments_checked(&[&gap]).2.map(|d| d.kind), Some(DamageKind::Gap));
        assert_eq!(fold_log_records(&[0xFF; 7]).1, 0);
    }

    /// Three records as a replica writes them: entries with a hard state, entries without,
    /// entries with a newer hard state (a vote in term 2).
    fn three_records() -> (Vec<u8>, [usize; 3]) {
        let hs = |term, commit| HardState { term, vote: 2, commit, ..HardState::default() };
        let mut file = encode_log_record(&entries(1..=3, 1), Some(&hs(1, 1)));
        let a = file.len();
        file.extend(encode_log_record(&entries(4..=5, 1), None));
        let b = file.len();
        file.extend(encode_log_record(&entries(6..=6, 2), Some(&hs(2, 5))));
        (file.clone(), [a, b, file.len()])
    }

    #[test]
    fn every_single_bit_flip_in_a_replica_log_is_found_as_damage_never_taken_for_a_torn_tail() {
        let (file, _) = three_records();
        assert_eq!(fold_log_segments_checked(&[&file]).2, None);
        for at in 0..file.len() {
            for bit in 0..8 {
                let mut bad = file.clone();
                bad[at] ^= 1 << bit;
                let (_, _, damage) = fold_log_segments_checked(&[&bad]);
                assert!(damage.is_some(), "a flip of bit {bit} of byte {at} passed as intact or torn");
            }
        }
    }

    #[test]
    fn a_tail_torn_anywhere_is_cut_without_damage_and_what_came_before_stands() {
        let (file, [a, b, end]) = three_records();
        for cut in 0..end {
            let (log, infos, damage) = fold_log_segments_checked(&[&file[..cut]]);
            assert_eq!(damage, None, "cut at {cut}");
            let kept = if cut >= b {
                b
            } else if cut >= a {
                a
            } else {
                0
            };
            assert_eq!(infos[0].whole, kept, "cut at {cut}");
            assert_eq!(log.entries.len(), [0, 3, 5][[0, a, b].iter().position(|k| *k == kept).unwrap()]);
        }
        // Zeros after the last record (space the filesystem gave but the write never filled)
        // are a torn tail too.
        let mut zeros = file.clone();
        zeros.extend_from_slice(&[0; 100]);
        let (log, infos, damage) = fold_log_segments_checked(&[&zeros]);
        assert_eq!((damage, infos[0].whole, log.hard_state.term), (None, end, 2));
    }

    /// The shared fold gives the same log, index and verdict as the copying one, and its
    /// entries' data lie in the segment buffers (nothing copied), damage included.
    #[test]
    fn a_shared_fold_gives_the_same_log_with_entries_in_the_segment_buffers() {
        let (file, [a, ..]) = three_records();
        let hs = HardState { term: 2, vote: 2, commit: 6, ..HardState::default() };
        let next = encode_log_record(&entries(7..=8, 2), Some(&hs));
        let segments = [bytes::Bytes::from(file.clone()), bytes::Bytes::from(next.clone())];
        let (log, infos, damage, _) = fold_log_segments_shared(&segments);
        let (copied, copied_infos, copied_damage, _) = fold_log_segments_indexed(&[&file, &next]);
        assert_eq!((&log, &infos, &damage), (&copied, &copied_infos, &copied_damage));
        assert_eq!(log.entries.len(), 8);
        let within = |e: &Entry| {
            segments.iter().any(|s| {
                let (p, d) = (s.as_ptr() as usize, e.data.as_ptr() as usize);
                !e.data.is_empty() && d >= p && d + e.data.len() <= p + s.len()
            })
        };
        assert!(log.entries.iter().filter(|e| !e.data.is_empty()).all(within), "entries share the buffers");
        // A flipped bit is damage the same way.
        let mut bad = file.clone();
        bad[a / 2] ^= 1;
        let (_, _, d, _) = fold_log_segments_shared(&[bytes::Bytes::from(bad.clone())]);
        assert_eq!(d, fold_log_segments_checked(&[&bad]).2);
        assert!(d.is_some());
    }

    #[test]
    fn damage_in_a_closed_segment_or_a_commit_past_the_entries_kept_is_found() {
        let (file, [a, ..]) = three_records();
        let hs = HardState { term: 2, vote: 2, commit: 6, ..HardState::default() };
        let next = encode_log_record(&entries(7..=8, 2), Some(&hs));
        // The first segment cut short (its tail lost) while the next one goes on.
        let (_, _, damage) = fold_log_segments_checked(&[&file[..a + 5], &next]);
        assert_eq!(damage.map(|d| (d.segment, d.offset, d.kind)), Some((0, a, DamageKind::ClosedSegmentShort)));
        // Whole, but the next segment's entries do not follow the first's.
        let (_, _, damage) = fold_log_segments_checked(&[&file[..a], &next]);
        assert_eq!(damage.map(|d| (d.segment, d.kind)), Some((1, DamageKind::Gap)));
        // A record framing break in the middle with whole records after it.
        let mut broken = file.clone();
        broken[a..a + 4].copy_from_slice(&u32::MAX.to_be_bytes());
        let (log, _, damage) = fold_log_segments_checked(&[&broken]);
        assert_eq!(damage.map(|d| d.kind), Some(DamageKind::RecordsAfterBreak));
        assert_eq!(log.entries.len(), 3, "what came before the damage is what the fold returns");
        // A hard state that says more was committed than the entries left.
        let mut past = encode_log_record(&entries(1..=2, 1), None);
        past.extend(encode_log_record(&[], Some(&HardState { term: 1, commit: 4, ..HardState::default() })));
        assert_eq!(fold_log_segments_checked(&[&past]).2.map(|d| d.kind), Some(DamageKind::CommitPastEntries));
        // Every kind of damage says where it is.
        let d = LogDamage { segment: 1, offset: 40, kind: DamageKind::Length };
        assert_eq!(d.to_string(), "segment 1, byte 40: a record's length field is damaged");
    }

    /// Three members and a network that delivers in order, dropping what touches a cut node.
    struct Group {
        nodes: BTreeMap<u64, MetaNode>,
        applied: BTreeMap<u64, Vec<Vec<u8>>>,
        cut: BTreeSet<u64>,
        leaders_by_term: BTreeMap<u64, BTreeSet<u64>>,
        kept: BTreeMap<u64, RaftLog>,
        changes: BTreeMap<u64, Vec<(bool, u64)>>,
        reads: BTreeMap<u64, Vec<(Vec<u8>, u64)>>,
        /// Reads of kept logs answered and taken.
        disk_reads: u64,
        /// Answer reads of kept logs with entries of another term (a disk gone wrong).
        corrupt_reads: bool,
    }

    impl Group {
        fn new(ids: &[u64]) -> Group {
            let nodes = ids.iter().map(|&id| (id, MetaNode::new(id, ids).unwrap())).collect();
            Group {
                nodes,
                applied: BTreeMap::new(),
                cut: BTreeSet::new(),
                leaders_by_term: BTreeMap::new(),
                kept: BTreeMap::new(),
                changes: BTreeMap::new(),
                reads: BTreeMap::new(),
                disk_reads: 0,
                corrupt_reads: false,
            }
        }

        /// Delivers every message (through the wire encoding) until the network is quiet.
        fn settle(&mut self) {
            loop {
                let mut msgs = Vec::new();
                let mut asks = Vec::new();
                for (&id, n) in self.nodes.iter_mut() {
                    while let Some(o) = n.poll_output() {
                        match o {
                            MetaOutput::Send { to, message } => msgs.push((id, to, encode_message(&message))),
                            MetaOutput::Committed { data, .. } => {
                                self.applied.entry(id).or_default().push(data.to_vec())
                            }
                            MetaOutput::PersistSnapshot { snapshot, .. } => {
                                self.kept.entry(id).or_default().persist_snapshot(&snapshot)
                            }
                            MetaOutput::Persist { entries, hard_state } => {
                                self.kept.entry(id).or_default().persist(&entries, hard_state.as_ref())
                            }
                            MetaOutput::ConfChanged { added, id: voter, .. } => {
                                self.changes.entry(id).or_default().push((added, voter))
                            }
                            MetaOutput::ReadIndex { ctx, index } => {
                                self.reads.entry(id).or_default().push((ctx, index))
                            }
                            MetaOutput::ReadEntries { low, high, max_bytes } => asks.push((id, low, high, max_bytes)),
                        }
                    }
                }
                if msgs.is_empty() && asks.is_empty() {
                    break;
                }
                for (id, low, high, max_bytes) in asks {
                    let mut entries = self.kept.get(&id).map(|k| k.read(low, high, max_bytes)).unwrap_or_default();
                    if self.corrupt_reads {
                        entries.iter_mut().for_each(|e| e.term += 1);
                    }
                    if let Some(n) = self.nodes.get_mut(&id)
                        && n.handle_entries_read(low, Ok(entries))
                    {
                        self.disk_reads += 1;
                    }
                }
                for (from, to, bytes) in msgs {
                    if self.cut.contains(&from) || self.cut.contains(&to) {
                        continue;
                    }
                    if let Some(n) = self.nodes.get_mut(&to) {
                        let _ = n.step(decode_message(&bytes).unwrap());
                    }
                }
            }
            for n in self.nodes.values() {
                if n.is_leader() {
                    self.leaders_by_term.entry(n.term()).or_default().insert(n.id());
                }
            }
        }

        fn run(&mut self, ticks: usize) {
            for _ in 0..ticks {
                for n in self.nodes.values_mut() {
                    n.tick();
                }
                self.settle();
            }
        }

        fn leaders(&self) -> Vec<u64> {
            self.nodes.values().filter(|n| n.is_leader() && !self.cut.contains(&n.id())).map(|n| n.id()).collect()
        }
    }

    /// With an entry cache, applied entries past its budget leave memory (their terms stay, a
    /// run per term); a follower cut off while they were written is sent them read back from
    /// the kept log. A read that comes back wrong (entries of another term) is refused, and
    /// the follower waits for a good one.
    #[test]
    fn entries_past_the_cache_leave_memory_and_a_follower_behind_is_sent_them_read_back() {
        let mut g = Group::new(&[1, 2, 3]);
        for n in g.nodes.values_mut() {
            n.set_entry_cache(Some(2048));
        }
        g.run(30);
        assert_eq!(g.leaders(), vec![1]);
        g.cut.insert(3);
        for i in 0..200u8 {
            g.nodes.get_mut(&1).unwrap().propose(vec![i; 40]).unwrap();
            g.settle();
        }
        for id in [1, 2] {
            let (bytes, on_disk) = g.nodes[&id].entry_memory();
            assert!(bytes <= 2048 && on_disk > 150, "node {id}: {bytes} bytes in memory, {on_disk} on disk only");
        }
        // Terms of entries on disk only are still answered (the engine asks them at once).
        assert_eq!(g.nodes[&1].raw.raft.raft_log.term(10).ok(), Some(g.nodes[&1].term()));
        g.corrupt_reads = true;
        g.cut.clear();
        g.run(10);
        assert_eq!(g.disk_reads, 0);
        assert!(g.applied.get(&3).map_or(0, Vec::len) < 100, "entries of another term were not taken");
        g.corrupt_reads = false;
        g.run(10);
        assert!(g.disk_reads > 0);
        assert_eq!(g.applied[&3], g.applied[&1], "the follower caught up with what was read back");
        let (bytes, on_disk) = g.nodes[&3].entry_memory();
        assert!(bytes <= 2048 && on_disk > 150, "and it keeps only its cache too: {bytes}, {on_disk}");
    }

    /// A member restarted from a kept log whose committed entries were all left on disk (a
    /// restart's fold of a long, never compacted log) starts with them applied, answers their
    /// terms (index 0's too: the log starts at 1), and as leader brings a member added later
    /// up from entry 1 with entries read back. Before index 0 was answered, the leader took
    /// the new member for one behind a compaction and waited for a snapshot there was none of.
    #[test]
    fn a_member_restarted_with_its_committed_log_on_disk_brings_a_new_member_up_from_the_start() {
        let mut g = Group::new(&[1, 2]);
        g.run(30);
        assert_eq!(g.leaders(), vec![1]);
        for i in 0..50u8 {
            g.nodes.get_mut(&1).unwrap().propose(vec![i; 40]).unwrap();
        }
        g.run(3);
        for id in [1, 2] {
            let mut kept = g.kept[&id].clone();
            kept.spill_committed(0);
            let spill = kept.spill.clone().expect("left on disk");
            assert_eq!(spill.first(), 1);
            let founding = [(1, Vec::new()), (2, Vec::new())];
            let n = MetaNode::restart(id, &founding, &kept).unwrap();
            assert_eq!(n.applied(), spill.end() - 1, "node {id} starts with what is on disk applied");
            assert_eq!(n.raw.raft.raft_log.term(0).ok(), Some(0));
            assert_eq!(n.term_of(spill.end() - 1), kept_term(&g.kept[&id], spill.end() - 1));
            g.nodes.insert(id, n);
        }
        g.applied.clear();
        g.run(40);
        let leader = g.leaders()[0];
        g.nodes.insert(3, MetaNode::restart(3, &[], &RaftLog::default()).unwrap());
        g.nodes.get_mut(&leader).unwrap().propose_conf_change(true, 3, Vec::new()).unwrap();
        g.run(40);
        assert!(g.disk_reads > 0, "the new member was sent entries read back");
        let got: Vec<Vec<u8>> = g.applied[&3].iter().filter(|d| d.len() == 40).cloned().collect();
        let want: Vec<Vec<u8>> = (0..50u8).map(|i| vec![i; 40]).collect();
        assert_eq!(got, want, "the new member applied the whole log");
    }

    fn kept_term(log: &RaftLog, idx: u64) -> Option<u64> {
        log.entries.iter().find(|e| e.index == idx).map(|e| e.term)
    }

    #[test]
    fn three_members_elect_one_leader_replicate_and_fail_over() {
        let mut g = Group::new(&[1, 2, 3]);
        g.run(30);
        // Deterministic: the lowest id times out first and wins.
        assert_eq!(g.leaders(), vec![1]);
        for i in 0..5u8 {
            g.nodes.get_mut(&1).unwrap().propose(vec![i]).unwrap();
        }
        assert!(matches!(g.nodes.get_mut(&2).unwrap().propose(vec![9]), Err(MetaError::NotLeader { leader: Some(1) })));
        g.run(5);
        let want: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i]).collect();
        for id in [1, 2, 3] {
            assert_eq!(g.applied[&id], want, "node {id}");
        }
        // The leader is cut off: the other two elect one of themselves and go on.
        g.cut.insert(1);
        g.run(60);
        let new = g.leaders();
        assert_eq!(new.len(), 1, "{new:?}");
        assert_ne!(new[0], 1);
        g.nodes.get_mut(&new[0]).unwrap().propose(vec![42]).unwrap();
        g.run(5);
        for id in [2, 3] {
            assert_eq!(g.applied[&id].last(), Some(&vec![42]), "node {id}");
        }
        // Healed: the old leader steps down and catches up; one leader per term throughout.
        g.cut.clear();
        g.run(40);
        assert_eq!(g.leaders().len(), 1);
        assert_eq!(g.applied[&1].last(), Some(&vec![42]));
        assert!(g.leaders_by_term.values().all(|l| l.len() == 1), "{:?}", g.leaders_by_term);
    }

    #[test]
    fn a_read_index_is_the_leaders_commit_confirmed_and_none_comes_without_a_majority() {
        let mut g = Group::new(&[1, 2, 3]);
        g.run(30);
        for i in 0..3u8 {
            g.nodes.get_mut(&1).unwrap().propose(vec![i]).unwrap();
        }
        g.settle();
        let committed = g.nodes[&1].indexes().1;
        // A follower asks: the leader answers with its commit index, which the follower applied
        // (or will apply) up to.
        g.nodes.get_mut(&3).unwrap().read_index(b"r1".to_vec());
        g.settle();
        let (ctx, index) = g.reads[&3].last().cloned().unwrap();
        assert_eq!((ctx.as_slice(), index), (&b"r1"[..], committed));
        assert!(g.nodes[&3].applied() >= index);
        // The leader cut off from both followers: it cannot confirm it still leads, and a
        // follower cut off cannot ask: nothing is answered.
        g.cut.insert(1);
        g.nodes.get_mut(&1).unwrap().read_index(b"r2".to_vec());
        g.settle();
        assert!(g.reads.get(&1).is_none_or(|r| r.is_empty()), "{:?}", g.reads.get(&1));
        g.cut.clear();
        g.cut.insert(2);
        g.nodes.get_mut(&2).unwrap().read_index(b"r3".to_vec());
        g.settle();
        assert_eq!(g.reads[&3].len() + g.reads.get(&2).map_or(0, Vec::len), 1);
    }

    #[test]
    fn a_voter_added_later_learns_everything_from_the_log_and_a_removed_one_stops_counting() {
        let mut g = Group::new(&[1, 2, 3]);
        g.run(30);
        assert_eq!(g.changes[&2], vec![(true, 1), (true, 2), (true, 3)], "the founding voters, from the log");
        let leader = g.leaders()[0];
        g.nodes.get_mut(&leader).unwrap().propose(b"before".to_vec()).unwrap();
        g.run(3);
        // A fourth broker starts empty and is added.
        g.nodes.insert(4, MetaNode::restart(4, &[], &RaftLog::default()).unwrap());
        g.nodes.get_mut(&leader).unwrap().propose_conf_change(true, 4, b"n4".to_vec()).unwrap();
        g.run(20);
        assert_eq!(g.applied[&4], vec![b"before".to_vec()], "the newcomer replayed what was committed");
        assert_eq!(g.nodes[&4].voters(), vec![1, 2, 3, 4]);
        assert_eq!(g.nodes[&1].voters(), vec![1, 2, 3, 4]);
        // Its kept log says who the voters are: a restart knows them without being told.
        assert_eq!(g.kept[&4].voters(), Some(vec![1, 2, 3, 4]));
        let again = MetaNode::restart(4, &[], &g.kept[&4]).unwrap();
        assert_eq!(again.voters(), vec![1, 2, 3, 4]);
        // Two of four cut off: no quorum of four... until one of them is removed.
        let leader = g.leaders()[0];
        let others: Vec<u64> = [1, 2, 3, 4].into_iter().filter(|v| *v != leader).collect();
        g.nodes.get_mut(&leader).unwrap().propose_conf_change(false, others[0], Vec::new()).unwrap();
        g.run(5);
        assert_eq!(g.nodes[&leader].voters().len(), 3);
        g.cut.insert(others[0]);
        g.cut.insert(others[1]);
        g.nodes.get_mut(&leader).unwrap().propose(b"after".to_vec()).unwrap();
        g.run(5);
        assert_eq!(g.applied[&leader].last(), Some(&b"after".to_vec()), "two of three commit");
        // A second change while one is pending is refused, not lost silently.
        let l = g.nodes.get_mut(&leader).unwrap();
        l.propose_conf_change(true, 9, Vec::new()).unwrap();
        assert!(l.propose_conf_change(true, 10, Vec::new()).is_err());
    }

    #[test]
    fn the_same_inputs_give_the_same_run() {
        let trace = || {
            let mut g = Group::new(&[1, 2, 3]);
            g.run(30);
            g.nodes.get_mut(&1).unwrap().propose(b"x".to_vec()).unwrap();
            g.cut.insert(1);
            g.run(60);
            (g.leaders(), g.leaders_by_term.clone(), g.applied.clone())
        };
        assert_eq!(trace(), trace());
    }

    #[test]
    fn bad_members_and_bad_bytes_are_errors() {
        assert!(MetaNode::new(0, &[1, 2]).is_err());
        assert!(MetaNode::new(4, &[1, 2, 3]).is_err());
        assert!(matches!(decode_message(&[0xFF, 0xFF, 0xFF]), Err(MetaError::Decode(_))));
    }

    fn entries(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<Entry> {
        range.map(|index| Entry { index, term, data: vec![index as u8].into(), ..Entry::default() }).collect()
    }

    fn snapshot_at(index: u64, term: u64) -> Snapshot {
        let mut s = Snapshot::default();
        s.mut_metadata().index = index;
        s.mut_metadata().term = term;
        s.set_data(b"state".to_vec().into());
        s
    }

    #[test]
    fn a_record_encoded_into_a_reused_buffer_is_the_same_bytes() {
        let hs = HardState { term: 3, commit: 2, ..HardState::default() };
        let mut buf = b"left over".to_vec();
        buf.clear();
        encode_log_record_into(&mut buf, &entries(1..=3, 1), Some(&hs));
        assert_eq!(buf, encode_log_record(&entries(1..=3, 1), Some(&hs)));
        let mut two = encode_log_record(&entries(1..=2, 1), None);
        let first = two.len();
        encode_log_record_into(&mut two, &entries(3..=3, 1), Some(&hs));
        assert_eq!(&two[first..], &encode_log_record(&entries(3..=3, 1), Some(&hs))[..]);
    }

    #[test]
    fn segments_fold_from_the_last_snapshot_even_with_older_segments_deleted() {
        let hs = |commit| HardState { term: 1, commit, ..HardState::default() };
        let mut a = encode_log_record(&entries(1..=10, 1), Some(&hs(10)));
        a.extend_from_slice(&encode_log_record(&entries(11..=12, 1), None));
        let mut b = encode_log_record(&[], Some(&hs(12)));
        b.extend_from_slice(&encode_log_record(&entries(13..=20, 1), Some(&hs(20))));
        b.extend_from_slice(&encode_snapshot_record(&snapshot_at(15, 1)));
        b.extend_from_slice(&encode_log_record(&entries(21..=22, 1), Some(&hs(22))));
        // Both segments: the snapshot stands for 1..=15, entries 16..=22 follow.
        let (log, infos) = fold_log_segments(&[&a, &b]);
        assert_eq!(log.snapshot.as_ref().map(|s| s.get_metadata().index), Some(15));
        assert_eq!(log.entries.iter().map(|e| e.index).collect::<Vec<_>>(), (16..=22).collect::<Vec<_>>());
        assert_eq!(log.hard_state.commit, 22);
        assert_eq!(infos.iter().map(|i| i.max_index).collect::<Vec<_>>(), vec![12, 22]);
        assert_eq!(infos[1].whole, b.len());
        // The first segment deleted (all its entries are below the snapshot): the same log.
        let (alone, _) = fold_log_segments(&[&b]);
        assert_eq!(alone, log);
        // A snapshot from the leader that does not match the log replaces it whole.
        let mut c = encode_log_record(&entries(1..=10, 1), Some(&hs(5)));
        c.extend_from_slice(&encode_snapshot_record(&snapshot_at(8, 2)));
        c.extend_from_slice(&encode_log_record(&entries(9..=9, 2), None));
        let (log, _) = fold_log_records(&c);
        assert_eq!(log.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(), vec![(9, 2)]);
        assert_eq!((log.hard_state.commit, log.hard_state.term), (8, 2));
        // A torn snapshot record ends the file there.
        let cut = c.len() - encode_log_record(&entries(9..=9, 2), None).len() - 3;
        let (log, whole) = fold_log_records(&c[..cut]);
        assert!(log.snapshot.is_none() && whole < cut);
    }
}
