//! One replica of a replicated (`quorum`) shard: a member of the shard's own Raft group on the
//! same engine as the metadata group ([`MetaNode`]), whose log *is* the shard's log. Publish
//! batches are Raft entries; an entry is readable (delivered to subscribers, acknowledged to its
//! publisher) only once a majority holds it, so a record once delivered is never lost by a
//! fail-over. The empty entry every new leader appends becomes the spec's generation-start
//! record: it takes an offset and is never delivered.
//!
//! Offsets are assigned when entries are applied, in log order, the same way on every replica
//! (a generation start takes one, a batch one per record), so every replica gives every record
//! the same offset. Idempotent producers are part of the replicated state: a batch whose
//! (producer, sequence) was applied before is applied as a duplicate (no offsets, the original
//! answer), so a producer that retries after `leadership_lost` or `quorum_timeout`, on whichever
//! leader, gets its batch written exactly once.
//!
//! Answers to the publisher (on the leader): `Appended` once its entry committed in the term it
//! was proposed in; `LeadershipLost` when this replica stopped leading or another leader's entry
//! took the index (outcome unknown: it may still commit); `QuorumTimeout` when no majority
//! confirmed it in time (outcome unknown). Sans-IO like the rest: ticks, peer messages and
//! proposals in; what to persist, send, answer and deliver out.

use super::meta::{MetaError, MetaNode, MetaOutput, RaftLog, Snapshot};
use crate::binary::Reader;
use bytes::{BufMut, Bytes};
use raft::eraftpb::{Entry, HardState, Message};
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

pub use crate::shard::replicated::{Answer, ApplyRefusal, BatchError, ReplicatedBatch};

mod host_part;
pub use host_part::{HostPart, SnapshotRest};
mod output;
pub use output::ReplicaOutput;

/// Ticks a proposal may wait for a majority before it is answered `quorum_timeout`.
pub const QUORUM_TIMEOUT_TICKS: u64 = 50;

/// Sequences remembered per producer (a retry older than that is not recognised). At least
/// the client's `MAX_IN_FLIGHT`, so every batch a producer may still resend is answered.
pub const PRODUCER_WINDOW: usize = 256;

/// Producers remembered per shard; beyond it the one whose last batch is oldest in the log is
/// forgotten (the same one on every replica: the choice depends only on the log).
pub const MAX_PRODUCERS: usize = 4096;

/// Entry bytes applied between two checkpoints of the replicated state (the points the log
/// can be compacted to once retention dropped every record before them).
pub const CHECKPOINT_BYTES: u64 = 8 << 20;

/// How long after a leader asked its group to confirm it leads (a read index) it may answer
/// reads from what it applied without asking again: its read lease. A follower whose
/// confirmation counted heard the leader at or after the asking, and grants no vote nor
/// pre-vote until [`super::meta::ELECTION_TICKS`] of its own ticks passed since (the engine's
/// check-quorum lease): at least 900 ms of its clock, its first tick coming at once at worst
/// and the driver ticking no faster than once per 100 ms. Any new leader needs the vote of one
/// such follower (two majorities meet), so none can be elected within 900 ms of the asking by
/// that follower's clock. 700 ms holds while the two clocks' rates differ by less than 22%
/// (docs/cluster.md, "Read leases"); a broker that restarts forgets what it heard, so its
/// replicas grant no vote for [`super::node::VOTE_HOLD`] after it starts.
pub const READ_LEASE: Duration = Duration::from_millis(700);

/// Read-index requests a leader keeps waiting for their confirmation (older ones are
/// forgotten: a later one's confirmation stands for them).
const MAX_READS_ASKED: usize = 16;

/// A majority confirmed this replica led in `term` as of `asked`; it answers reads once it
/// applied `index` (everything committed when it asked).
#[derive(Debug, Clone, Copy)]
struct Lease {
    term: u64,
    asked: Instant,
    index: u64,
}

/// Checkpoints kept (the oldest go first: compaction then waits for the next one).
const MAX_CHECKPOINTS: usize = 64;

/// Bytes of checkpoint data kept waiting for compaction, beyond the oldest checkpoint (which
/// is always kept). A host whose state is large (a cache, a stream's commit state) would
/// otherwise hold up to `MAX_CHECKPOINTS` copies of it while retention's floor catches up;
/// past this, no new checkpoint is taken (nor the host asked for its state) until compaction
/// consumed the older ones, so the log is compacted in coarser steps instead.
pub const MAX_CHECKPOINT_MEMORY: usize = 64 << 20;

/// About how many bytes of entries one read of a restart's replay asks for.
pub const REPLAY_READ_BYTES: u64 = 4 << 20;

/// A restart replaying the committed entries its kept log left on disk ([`Spill`]), in
/// bounded reads, before the engine runs: the state a replica serves from (offsets,
/// producers, the host's log of the shard) is the fold of every committed entry, and the
/// engine was started with them applied. Until the replay ends the replica takes no message,
/// tick or proposal: it is a member that is slow to answer, which Raft copes with.
///
/// [`Spill`]: super::meta::Spill
#[derive(Debug)]
struct Replay {
    /// The next entry to apply.
    next: u64,
    /// One past the last entry on disk.
    end: u64,
    /// A read from `next` was asked and not answered yet.
    asked: bool,
    /// Reads that failed or came back unusable, one after another.
    failures: u32,
    /// About how many bytes one read asks for: [`REPLAY_READ_BYTES`], or the entry cache's
    /// budget when smaller (what the replica holds of its log in memory anyway).
    read_bytes: u64,
}

/// The replicated state right after applying entry `index`: what a snapshot at that index
/// holds.
#[derive(Debug)]
struct Checkpoint {
    index: u64,
    next_offset: u64,
    data: Vec<u8>,
    /// The end of the host's state, kept unencoded until the checkpoint becomes a snapshot
    /// ([`Replica::finish_checkpoint_with`]).
    rest: Option<Box<dyn HostPart>>,
}

impl Checkpoint {
    /// What it holds, or stands for, in encoded bytes (what the checkpoint memory counts).
    fn size(&self) -> usize {
        self.data.len() + self.rest.as_ref().map_or(0, |r| r.encoded_len())
    }

    /// The snapshot's data: the bytes written when it was taken, then the rest encoded now.
    fn into_data(self) -> Vec<u8> {
        let mut data = self.data;
        if let Some(rest) = self.rest {
            rest.encode_into(&mut data);
        }
        data
    }
}

/// What one idempotent producer's batches did on this shard (replicated state: every replica
/// derives it from the same log).
#[derive(Debug, Clone, Default)]
struct ProducerSeqs {
    /// The sequence its next batch must carry.
    next: u64,
    /// Sequence → first offset, the last [`PRODUCER_WINDOW`] appended.
    landed: BTreeMap<u64, u64>,
    /// Log index of its last batch (which producer to forget first).
    last_index: u64,
}

#[derive(Debug)]
struct Proposal {
    token: u64,
    term: u64,
    age: u64,
}

/// One replica of a replicated shard.
pub struct Replica {
    node: MetaNode,
    /// The next offset to assign.
    next_offset: u64,
    /// Per producer: its sequences (replicated state).
    producers: BTreeMap<u64, ProducerSeqs>,
    /// Proposals waiting for their entry to commit, by log index (leader only).
    pending: BTreeMap<u64, Proposal>,
    out: VecDeque<ReplicaOutput>,
    leading: bool,
    /// Points the log can be compacted to, oldest first.
    checkpoints: VecDeque<Checkpoint>,
    /// The host's part of the snapshot being compacted to (by reference), for its
    /// [`ReplicaOutput::PersistSnapshot`], by index.
    compacting_rest: Option<(u64, SnapshotRest)>,
    /// The end of a received snapshot's data, beside its message ([`Self::step_with_rest`]).
    received_rest: Option<(u64, SnapshotRest)>,
    /// Entry bytes applied since the last checkpoint, and how many make one.
    since_checkpoint: u64,
    checkpoint_bytes: u64,
    /// The host's state is part of every checkpoint (a replicated cache: its values are the
    /// fold of the whole log, not something retention drops), and the checkpoint waiting for it.
    host_state: bool,
    /// [`MAX_CHECKPOINT_MEMORY`] unless set.
    checkpoint_memory: usize,
    due: Option<Checkpoint>,
    /// Read-index requests waiting for a majority: counter → (asked at, term).
    reads: BTreeMap<u64, (Instant, u64)>,
    next_read: u64,
    /// The newest confirmation of this replica's leadership.
    lease: Option<Lease>,
    /// A restart's replay of the entries on disk, while under way.
    replay: Option<Replay>,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("id", &self.node.id()).field("next_offset", &self.next_offset).finish()
    }
}

impl Replica {
    /// Replica `id` of a shard whose replicas are `replicas`, starting from what its driver
    /// kept (empty on a first start). A restart replays the committed log: offsets, producers
    /// and deliveries come out again from the first, the same as before.
    ///
    /// # Errors
    /// [`MetaError`] for a configuration or a kept log the engine refuses.
    pub fn new(id: u64, replicas: &[u64], kept: &RaftLog) -> Result<Replica, MetaError> {
        Self::new_ranked(id, replicas, kept, None)
    }

    /// [`new`](Self::new), standing for election in the order of `replicas` (the first stands
    /// first when nobody leads) rather than by id.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn new_ranked(id: u64, replicas: &[u64], kept: &RaftLog, rank: Option<usize>) -> Result<Replica, MetaError> {
        Self::new_hosting(id, replicas, kept, rank, false)
    }

    /// [`new_ranked`](Self::new_ranked) for a host with state of its own in every checkpoint
    /// (`host_state`: see [`set_host_state`](Self::set_host_state)); set from the start, so the
    /// checkpoints of the replay at a restart carry it too.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn new_hosting(
        id: u64,
        replicas: &[u64],
        kept: &RaftLog,
        rank: Option<usize>,
        host_state: bool,
    ) -> Result<Replica, MetaError> {
        let founding: Vec<(u64, Vec<u8>)> = replicas.iter().map(|r| (*r, Vec::new())).collect();
        let mut node = MetaNode::restart_ranked(id, &founding, kept, rank)?;
        node.report_leader_entries();
        let mut r = Replica {
            node,
            next_offset: 0,
            producers: BTreeMap::new(),
            pending: BTreeMap::new(),
            out: VecDeque::new(),
            leading: false,
            checkpoints: VecDeque::new(),
            compacting_rest: None,
            received_rest: None,
            since_checkpoint: 0,
            checkpoint_bytes: CHECKPOINT_BYTES,
            host_state,
            checkpoint_memory: MAX_CHECKPOINT_MEMORY,
            due: None,
            reads: BTreeMap::new(),
            next_read: 0,
            lease: None,
            replay: None,
        };
        if let Some(snap) = kept.snapshot.as_ref() {
            // Its state first: the committed entries replayed next come after it. The end of
            // the data a restart left on disk is read back from there by the host
            // ([`ReplicaOutput::Restored`] says how long it is); the engine never holds the
            // data then, so never sends what it holds of it.
            let beside = kept.snapshot_rest_on_disk.map_or(0, |r| r.len);
            if beside > 0 {
                r.node.set_snapshot_by_reference(true);
            }
            r.restore(snap.data.clone(), snap.get_metadata().index, false, beside);
        }
        if let Some(sp) = kept.spill.as_ref().filter(|s| !s.is_empty()) {
            // The first read is asked once the entry cache is set, or at the first tick.
            let read_bytes = REPLAY_READ_BYTES;
            r.replay = Some(Replay { next: sp.first(), end: sp.end(), asked: false, failures: 0, read_bytes });
        }
        r.drain();
        Ok(r)
    }

    /// Whether it is still replaying a restart's entries from disk (it takes no message,
    /// tick or proposal until done).
    pub fn replaying(&self) -> bool {
        self.replay.is_some()
    }

    /// Asks for the replay's next read, unless one is under way.
    fn ask_replay(&mut self) {
        let Some(rp) = &mut self.replay else { return };
        if rp.asked {
            return;
        }
        rp.asked = true;
        self.out.push_back(ReplicaOutput::ReadEntries { low: rp.next, high: rp.end, max_bytes: rp.read_bytes });
    }

    /// Applies the replay's entries read back from `low` (those that continue it, with the
    /// terms the log has for them); returns whether any were.
    fn replay_read(&mut self, low: u64, entries: Result<Vec<Entry>, String>) -> bool {
        let Some(rp) = self.replay.as_mut() else { return false };
        if low != rp.next || !rp.asked {
            return false;
        }
        rp.asked = false;
        let mut took = false;
        for e in entries.unwrap_or_default() {
            let Some(rp) = self.replay.as_mut() else { break };
            if e.index != rp.next || e.index >= rp.end || self.node.term_of(e.index) != Some(e.term) {
                break;
            }
            rp.next += 1;
            took = true;
            // As the engine applies them (`MetaNode`): normal entries, the empty ones new
            // leaders append included; configuration changes are already in the engine's
            // configuration (the fold gathered them).
            if e.get_entry_type() == raft::eraftpb::EntryType::EntryNormal {
                self.apply_committed(e.index, e.term, e.data);
            }
        }
        let Some(rp) = self.replay.as_mut() else { return took };
        if rp.next >= rp.end {
            self.replay = None;
        } else if took {
            rp.failures = 0;
            self.ask_replay();
        } else {
            // A failed read, or entries that are not the log's: asked again at the next tick.
            rp.failures = rp.failures.saturating_add(1);
        }
        took
    }

    /// This replica's id.
    pub fn id(&self) -> u64 {
        self.node.id()
    }

    /// Whether it leads (it takes proposals).
    pub fn is_leader(&self) -> bool {
        self.node.is_leader()
    }

    /// On the leader: hands the group's leadership to replica `to` ([`MetaNode::transfer_leader`]).
    pub fn transfer_leader(&mut self, to: u64) {
        // The replica it hands over to stands at once, with every vote granted regardless of
        // any lease: no read is answered here from now on.
        if self.replay.is_some() {
            return;
        }
        self.lease = None;
        self.reads.clear();
        self.node.transfer_leader(to);
        self.drain();
    }

    /// On the leader: asks the group to confirm it still leads (a read index), as of `now`.
    /// Once a majority answered, [`read_lease`](Self::read_lease) holds until `now` +
    /// [`READ_LEASE`]. Not asked (`false`) before an entry of its own term committed: the
    /// engine drops a read index asked earlier.
    pub fn confirm_leadership(&mut self, now: Instant) -> bool {
        if self.replay.is_some() || self.node.leader_commit().is_none() || self.node.transferring() {
            return false;
        }
        self.next_read += 1;
        self.reads.insert(self.next_read, (now, self.node.term()));
        while self.reads.len() > MAX_READS_ASKED {
            self.reads.pop_first();
        }
        self.node.read_index(self.next_read.to_be_bytes().to_vec());
        self.drain();
        true
    }

    /// Whether a confirmation of its leadership was asked in this term and not answered yet.
    pub fn confirming(&self) -> bool {
        let term = self.node.term();
        self.reads.values().any(|(_, t)| *t == term)
    }

    /// Until when this replica may answer a read from what it applied (linearizable: no other
    /// leader can have been elected, and everything committed before the confirmation was
    /// asked is applied); `None`: not now (not leading, handing over, never or no longer
    /// confirmed, or still applying).
    pub fn read_lease(&self) -> Option<Instant> {
        let l = self.lease?;
        let holds = self.node.is_leader()
            && !self.node.transferring()
            && l.term == self.node.term()
            && self.node.applied() >= l.index;
        holds.then(|| l.asked.checked_add(READ_LEASE)).flatten()
    }

    /// On the leader: whether nothing is in flight in the group: every replica holds the whole
    /// log, all of it committed and applied here, no proposal or leadership confirmation
    /// waits for an answer, no hand-over is under way and nothing is left to carry out. Only
    /// such a group may stop ticking (hibernate): nothing in it needs a timer to go on.
    pub fn settled(&self) -> bool {
        if self.replay.is_some()
            || !self.node.is_leader()
            || self.node.transferring()
            || !self.pending.is_empty()
            || !self.reads.is_empty()
            || self.due.is_some()
            || !self.out.is_empty()
        {
            return false;
        }
        let (last, commit) = self.node.indexes();
        last == commit && self.node.applied() == last && self.node.progress().iter().all(|(_, m)| *m == last)
    }

    /// On a follower: whether it follows `leader` in `term` and holds, committed and applied,
    /// everything it was sent (what a leader's "sleep" heartbeat asks it to check before it
    /// stops ticking too).
    pub fn settled_under(&self, leader: u64, term: u64) -> bool {
        let (last, commit) = self.node.indexes();
        !self.node.is_leader()
            && self.node.leader() == Some(leader)
            && self.node.term() == term
            && last == commit
            && self.node.applied() == last
            && self.out.is_empty()
    }

    /// The group's voters, as this replica's configuration has them.
    pub fn voters(&self) -> Vec<u64> {
        self.node.voters()
    }

    /// On the leader: whether a configuration change it proposed is not yet applied.
    pub fn has_pending_conf(&self) -> bool {
        self.node.has_pending_conf()
    }

    /// On the leader: proposes adding (`add`) or removing voter `id` (one change at a time).
    ///
    /// # Errors
    /// As [`MetaNode::propose_conf_change`].
    pub fn propose_conf_change(&mut self, add: bool, id: u64) -> Result<(), MetaError> {
        if self.replay.is_some() {
            return Err(MetaError::NotLeader { leader: None });
        }
        let r = self.node.propose_conf_change(add, id, Vec::new());
        self.drain();
        r
    }

    /// Whether it is handing its leadership over.
    pub fn transferring(&self) -> bool {
        self.node.transferring()
    }

    /// The leader it knows of.
    pub fn leader(&self) -> Option<u64> {
        self.node.leader()
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.node.term()
    }

    /// The last log index and the committed index.
    pub fn indexes(&self) -> (u64, u64) {
        self.node.indexes()
    }

    /// The committed index.
    pub fn committed(&self) -> u64 {
        self.node.committed()
    }

    /// On the leader: each replica's id and the highest log index it holds.
    pub fn progress(&self) -> Vec<(u64, u64)> {
        self.node.progress()
    }

    /// The next offset a record would get (the readable bound).
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// Applied entry bytes between checkpoints ([`CHECKPOINT_BYTES`] unless set; the
    /// simulations set it small).
    pub fn set_checkpoint_bytes(&mut self, bytes: u64) {
        self.checkpoint_bytes = bytes.max(1);
    }

    /// The host keeps state of its own that checkpoints must carry (a replicated cache's
    /// values): checkpoints come out as [`ReplicaOutput::CheckpointDue`], completed with
    /// [`complete_checkpoint`](Self::complete_checkpoint), and a restore hands the state back
    /// in [`ReplicaOutput::Restored`].
    pub fn set_host_state(&mut self) {
        self.host_state = true;
    }

    /// Bytes of checkpoint data kept waiting for compaction beyond the oldest checkpoint
    /// ([`MAX_CHECKPOINT_MEMORY`] unless set; tests set less).
    pub fn set_checkpoint_memory(&mut self, bytes: usize) {
        self.checkpoint_memory = bytes;
    }

    /// Completes the checkpoint due after entry `index` with the host's state as of that
    /// entry (a checkpoint asked for earlier and never completed is dropped).
    pub fn complete_checkpoint(&mut self, index: u64, state: &[u8]) {
        if let Some(data) = self.checkpoint_due(index) {
            data.extend_from_slice(state);
        }
        self.finish_checkpoint(index);
    }

    /// The data of the checkpoint due after entry `index` (the group's own state so far), for
    /// the host to append its state to in place, then [`finish_checkpoint`](Self::finish_checkpoint):
    /// [`complete_checkpoint`](Self::complete_checkpoint) without a copy of the host's state
    /// made first. `None` when no such checkpoint is due.
    pub fn checkpoint_due(&mut self, index: u64) -> Option<&mut Vec<u8>> {
        self.due.as_mut().filter(|c| c.index == index).map(|c| &mut c.data)
    }

    /// Keeps the checkpoint due after entry `index` with what its data holds now.
    pub fn finish_checkpoint(&mut self, index: u64) {
        self.finish_checkpoint_with(index, None);
    }

    /// [`finish_checkpoint`](Self::finish_checkpoint), the end of the host's state given as a
    /// part encoded only if the checkpoint becomes a snapshot ([`HostPart`]).
    pub fn finish_checkpoint_with(&mut self, index: u64, rest: Option<Box<dyn HostPart>>) {
        if self.due.as_ref().is_none_or(|c| c.index != index) {
            return;
        }
        let Some(mut cp) = self.due.take() else { return };
        cp.rest = rest;
        self.keep_checkpoint(cp);
    }

    fn keep_checkpoint(&mut self, cp: Checkpoint) {
        self.checkpoints.push_back(cp);
        if self.checkpoints.len() > MAX_CHECKPOINTS {
            self.checkpoints.pop_front();
        }
    }

    /// Bytes of checkpoint data held encoded in memory, waiting for compaction (a
    /// [`HostPart`] shares the host's memory and is not counted).
    pub fn checkpoint_memory(&self) -> usize {
        self.checkpoints.iter().chain(&self.due).map(|c| c.data.capacity()).sum()
    }

    /// The first log index still held (entries before it were compacted into a snapshot).
    pub fn first_index(&self) -> u64 {
        self.node.first_index()
    }

    /// Compacts the log as far as retention allows: to the last checkpoint whose records all
    /// lie below `floor` (the first offset the shard still retains here), so nothing a reader
    /// could still be given exists only in the dropped entries. Comes out as
    /// [`ReplicaOutput::PersistSnapshot`]. Returns whether it compacted.
    pub fn compact_below(&mut self, floor: u64) -> bool {
        if self.replay.is_some() {
            return false;
        }
        let Some(at) = self.checkpoints.iter().rposition(|c| c.next_offset <= floor) else { return false };
        let Some(cp) = self.checkpoints.drain(..=at).next_back() else { return false };
        let done = if self.node.snapshot_by_reference() {
            // The host's part goes beside the snapshot, encoded only as it is written: the
            // engine keeps none of the data (it is on disk once persisted).
            let index = cp.index;
            self.compacting_rest = cp.rest.map(|r| (index, SnapshotRest(std::sync::Arc::from(r))));
            let done = self.node.compact(index, cp.data);
            if !done {
                self.compacting_rest = None;
            }
            done
        } else {
            self.node.compact(cp.index, cp.into_data())
        };
        self.drain();
        done
    }

    /// The replicated state as snapshot data: `u8 version (1)`, `u64 next_offset`,
    /// `u32 producers`, each `u64 id`, `u64 next`, `u64 last_index`, `u32 n` and `n` times
    /// `u64 sequence`, `u64 offset`; then, to the end, the host's state (empty for a stream).
    fn encode_state(&self) -> Vec<u8> {
        let mut b = Vec::with_capacity(13 + self.producers.len() * 28);
        b.put_u8(1);
        b.put_u64(self.next_offset);
        b.put_u32(self.producers.len() as u32);
        for (id, p) in &self.producers {
            b.put_u64(*id);
            b.put_u64(p.next);
            b.put_u64(p.last_index);
            b.put_u32(p.landed.len() as u32);
            for (seq, off) in &p.landed {
                b.put_u64(*seq);
                b.put_u64(*off);
            }
        }
        b
    }

    /// The host's state within snapshot data (`encode_state`'s end),
    /// found by its lengths alone (nothing copied). `None` for data that does not read.
    pub fn host_state_of(data: &[u8]) -> Option<&[u8]> {
        let (&version, rest) = data.split_first()?;
        if version != 1 {
            return None;
        }
        let (_next_offset, rest) = rest.split_at_checked(8)?;
        let (n, mut rest) = rest.split_at_checked(4)?;
        for _ in 0..u32::from_be_bytes(n.try_into().ok()?) {
            let (_seqs, after) = rest.split_at_checked(24)?;
            let (landed, after) = after.split_at_checked(4)?;
            rest = after.get((u32::from_be_bytes(landed.try_into().ok()?) as usize).checked_mul(16)?..)?;
        }
        Some(rest)
    }

    /// Reads `encode_state`'s bytes; the host's state it returns shares `data`'s memory (a
    /// snapshot's data can be the size of a cache: it is not copied). Never panics.
    fn decode_state(data: Bytes) -> Option<(u64, BTreeMap<u64, ProducerSeqs>, Bytes)> {
        let mut r = Reader::new(data);
        if r.u8("version").ok()? != 1 {
            return None;
        }
        let next_offset = r.u64("next_offset").ok()?;
        let n = r.u32("producers").ok()?;
        let mut producers = BTreeMap::new();
        for _ in 0..n {
            let id = r.u64("id").ok()?;
            let mut p =
                ProducerSeqs { next: r.u64("next").ok()?, last_index: r.u64("index").ok()?, ..Default::default() };
            for _ in 0..r.u32("landed").ok()? {
                let seq = r.u64("sequence").ok()?;
                p.landed.insert(seq, r.u64("offset").ok()?);
            }
            producers.insert(id, p);
        }
        Some((next_offset, producers, r.rest()))
    }

    /// Takes the state a snapshot holds. Snapshots are only made by this module; one whose
    /// data does not read leaves the state as it was (the same on every replica).
    fn restore(&mut self, data: Bytes, index: u64, received: bool, beside: u64) {
        let whole = data.len();
        let Some((next_offset, producers, state)) = Self::decode_state(data) else { return };
        let at = whole.saturating_sub(state.len()) as u64;
        let len = state.len() as u64 + beside;
        self.next_offset = next_offset;
        self.producers = producers;
        self.checkpoints.clear();
        self.due = None;
        self.since_checkpoint = 0;
        for (_, p) in std::mem::take(&mut self.pending) {
            self.out.push_back(ReplicaOutput::Answer { token: p.token, answer: Answer::LeadershipLost });
        }
        self.out.push_back(ReplicaOutput::Restored { next_offset, state, index, at, len, received });
    }

    /// A unit of time passed.
    pub fn tick(&mut self) {
        if self.replay.is_some() {
            self.ask_replay();
            return;
        }
        self.node.tick();
        for p in self.pending.values_mut() {
            p.age += 1;
        }
        let expired: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.age >= QUORUM_TIMEOUT_TICKS).map(|(i, _)| *i).collect();
        for i in expired {
            if let Some(p) = self.pending.remove(&i) {
                self.out.push_back(ReplicaOutput::Answer { token: p.token, answer: Answer::QuorumTimeout });
            }
        }
        self.drain();
    }

    /// A message from another replica.
    pub fn step(&mut self, m: Message) {
        if self.replay.is_some() {
            return;
        }
        let _ = self.node.step(m);
        self.drain();
    }

    /// Steps a `MsgSnapshot` whose data holds only the start of the snapshot's data, `rest`
    /// the end of it (the host's state, as its chunks came, never gathered into one buffer):
    /// if the snapshot is taken, `rest` goes beside it to be persisted
    /// ([`ReplicaOutput::PersistSnapshot`]), and the host reads its state back from there
    /// ([`ReplicaOutput::Restored`] says how long it is).
    pub fn step_with_rest(&mut self, m: Message, rest: SnapshotRest) {
        self.received_rest = Some((m.get_snapshot().get_metadata().index, rest));
        self.step(m);
        // Not taken (a stale snapshot): let go.
        self.received_rest = None;
    }

    /// Proposes a batch (on the leader); its answer comes out as [`ReplicaOutput::Answer`]
    /// with `token`.
    ///
    /// # Errors
    /// [`MetaError::NotLeader`] (with the leader known, if any) on a follower.
    pub fn propose(&mut self, token: u64, batch: &ReplicatedBatch) -> Result<(), MetaError> {
        if self.replay.is_some() {
            return Err(MetaError::NotLeader { leader: None });
        }
        let (index, term) = self.node.propose_indexed(batch.encode())?;
        self.pending.insert(index, Proposal { token, term, age: 0 });
        self.drain();
        Ok(())
    }

    /// Stops this replica: the tokens of the proposals it still owed an answer (outcome
    /// unknown: they may commit on the others).
    pub fn abandon(self) -> Vec<u64> {
        let mut owed: Vec<u64> = self.pending.values().map(|p| p.token).collect();
        owed.extend(self.out.iter().filter_map(|o| match o {
            ReplicaOutput::Answer { token, .. } => Some(*token),
            _ => None,
        }));
        owed
    }

    /// Keeps at most `budget` bytes of applied entries of the group's log in memory (see
    /// [`MetaNode::set_entry_cache`]); the host must then answer [`ReplicaOutput::ReadEntries`].
    pub fn set_entry_cache(&mut self, budget: Option<u64>) {
        if let Some(rp) = &mut self.replay {
            // The engine is held until the replay ends: the budget only, no ready yet.
            self.node.set_entry_budget(budget);
            rp.read_bytes = budget.unwrap_or(REPLAY_READ_BYTES).clamp(1, REPLAY_READ_BYTES);
            self.ask_replay();
            return;
        }
        self.node.set_entry_cache(budget);
        self.drain();
    }

    /// Entry bytes of the group's log held in memory, and entries held on disk only.
    pub fn entry_memory(&self) -> (u64, u64) {
        self.node.entry_memory()
    }

    /// Keeps the group's last snapshot on disk only once persisted (see
    /// [`MetaNode::set_snapshot_on_disk`]): a checkpoint holds the host's state, a replicated
    /// cache's values or a stream's commit state, which the host holds already. The host must
    /// then answer [`ReplicaOutput::ReadSnapshot`].
    pub fn set_snapshot_on_disk(&mut self, on: bool) {
        self.node.set_snapshot_on_disk(on);
    }

    /// Keeps the last snapshot on disk only and never reads it back for the engine (see
    /// [`MetaNode::set_snapshot_by_reference`]): a `MsgSnapshot` to a follower carries no
    /// data, and the host sends the data from disk in chunks.
    pub fn set_snapshot_by_reference(&mut self, on: bool) {
        self.node.set_snapshot_by_reference(on);
    }

    /// The index of the last snapshot when its data is on disk only
    /// ([`MetaNode::offloaded_snapshot`]).
    pub fn offloaded_snapshot(&self) -> Option<u64> {
        self.node.offloaded_snapshot()
    }

    /// Bytes of snapshot data the group's engine holds in memory ([`MetaNode::snapshot_memory`]).
    pub fn snapshot_memory(&self) -> usize {
        self.node.snapshot_memory()
    }

    /// The host read back the snapshot a [`ReplicaOutput::ReadSnapshot`] asked for (see
    /// [`MetaNode::handle_snapshot_read`]). Returns whether it was taken.
    pub fn handle_snapshot_read(&mut self, index: u64, read: Result<Snapshot, String>) -> bool {
        if self.replay.is_some() {
            // The engine is held until the replay ends (it never asked: a read asked by an
            // earlier life, answered in this one); its followers are tried again after.
            return false;
        }
        let taken = self.node.handle_snapshot_read(index, read);
        self.drain();
        taken
    }

    /// The host read back the entries a [`ReplicaOutput::ReadEntries`] from `low` asked for
    /// (see [`MetaNode::handle_entries_read`]). Returns whether they were taken.
    pub fn handle_entries_read(&mut self, low: u64, entries: Result<Vec<Entry>, String>) -> bool {
        if self.replay.is_some() {
            let took = self.replay_read(low, entries);
            self.drain();
            return took;
        }
        let taken = self.node.handle_entries_read(low, entries);
        self.drain();
        taken
    }

    /// The next thing to do.
    pub fn poll_output(&mut self) -> Option<ReplicaOutput> {
        self.out.pop_front()
    }

    /// Puts outputs taken from [`poll_output`](Self::poll_output) back in front of what is
    /// left, in their order: a host that held its replica's outputs while it read a restored
    /// state back from disk carries them out after it, as they came.
    pub fn unpoll(&mut self, held: impl DoubleEndedIterator<Item = ReplicaOutput>) {
        for o in held.rev() {
            self.out.push_front(o);
        }
    }

    fn drain(&mut self) {
        while let Some(o) = self.node.poll_output() {
            match o {
                MetaOutput::Persist { entries, hard_state } => {
                    self.out.push_back(ReplicaOutput::Persist { entries, hard_state })
                }
                MetaOutput::PersistSnapshot { snapshot, received } => {
                    // Kept before anything after it; received, the state becomes its.
                    let data = received.then(|| snapshot.data.clone());
                    let index = snapshot.get_metadata().index;
                    // This replica's own compaction's host part, or a received one's.
                    let compacted = self.compacting_rest.take().filter(|(i, _)| !received && *i == index);
                    let sent = self.received_rest.take().filter(|(i, _)| received && *i == index);
                    let rest = compacted.or(sent).map(|(_, r)| r);
                    let beside = rest.as_ref().filter(|_| received).map_or(0, SnapshotRest::len);
                    self.out.push_back(ReplicaOutput::PersistSnapshot { snapshot, rest });
                    if let Some(data) = data {
                        self.restore(data, index, true, beside);
                    }
                }
                MetaOutput::Send { to, message } => self.out.push_back(ReplicaOutput::Send { to, message }),
                MetaOutput::ReadIndex { ctx, index } => self.confirmed(&ctx, index),
                MetaOutput::Committed { index, term, data } => self.apply_committed(index, term, data),
                MetaOutput::ConfChanged { .. } => {}
                MetaOutput::ReadEntries { low, high, max_bytes } => {
                    self.out.push_back(ReplicaOutput::ReadEntries { low, high, max_bytes })
                }
                MetaOutput::ReadSnapshot { index } => self.out.push_back(ReplicaOutput::ReadSnapshot { index }),
            }
        }
        let leading = self.node.is_leader();
        if self.leading && !leading {
            // Deposed: nothing pending here will be answered by a commit we can vouch for.
            for (_, p) in std::mem::take(&mut self.pending) {
                self.out.push_back(ReplicaOutput::Answer { token: p.token, answer: Answer::LeadershipLost });
            }
        }
        self.leading = leading;
    }

    /// Applies committed entry `index` and takes a checkpoint when one is due.
    fn apply_committed(&mut self, index: u64, term: u64, data: Bytes) {
        self.since_checkpoint += data.len() as u64 + 64;
        self.apply(index, term, data);
        if self.since_checkpoint >= self.checkpoint_bytes {
            self.since_checkpoint = 0;
            let held: usize = self.checkpoints.iter().map(Checkpoint::size).sum();
            if !self.checkpoints.is_empty() && held >= self.checkpoint_memory {
                return; // the next one, once compaction made room
            }
            let cp = Checkpoint { index, next_offset: self.next_offset, data: self.encode_state(), rest: None };
            if self.host_state {
                // Completed once the host applied what came out before this.
                self.due = Some(cp);
                self.out.push_back(ReplicaOutput::CheckpointDue { index });
            } else {
                self.keep_checkpoint(cp);
            }
        }
    }

    /// A majority answered read-index request `ctx`: the lease runs from when it was asked
    /// (those asked before it are answered by it too).
    fn confirmed(&mut self, ctx: &[u8], index: u64) {
        let Ok(b) = <[u8; 8]>::try_from(ctx) else { return };
        let id = u64::from_be_bytes(b);
        let Some((asked, term)) = self.reads.remove(&id) else { return };
        self.reads.retain(|k, _| *k > id);
        if term == self.node.term() && self.lease.is_none_or(|l| l.term != term || l.asked < asked) {
            self.lease = Some(Lease { term, asked, index });
        }
    }

    /// Whether producer `pid`'s batch `seq` is new (`Ok(true)`), a duplicate of one that landed
    /// (`Ok(false)`), or out of order (the refusal).
    fn sequence_verdict(&self, pid: u64, seq: u64) -> Result<bool, Answer> {
        let refuse = |r| Err(Answer::Refused(r));
        let Some(p) = self.producers.get(&pid) else {
            return if seq == 0 { Ok(true) } else { refuse(ApplyRefusal::UnknownProducer) };
        };
        if seq == p.next {
            Ok(true)
        } else if seq > p.next {
            refuse(ApplyRefusal::Gap { expected: p.next })
        } else if p.landed.contains_key(&seq) {
            Ok(false)
        } else {
            refuse(ApplyRefusal::Expired)
        }
    }

    /// Records producer `pid`'s batch `seq` landing at `offset` (log index `index`).
    fn landed(&mut self, pid: u64, seq: u64, offset: u64, index: u64) {
        if !self.producers.contains_key(&pid) && self.producers.len() >= MAX_PRODUCERS {
            // Log indexes are unique: the choice is the same on every replica.
            if let Some(cold) = self.producers.iter().min_by_key(|(_, p)| p.last_index).map(|(k, _)| *k) {
                self.producers.remove(&cold);
            }
        }
        let p = self.producers.entry(pid).or_default();
        p.next = seq + 1;
        p.last_index = index;
        p.landed.insert(seq, offset);
        while p.landed.len() > PRODUCER_WINDOW {
            p.landed.pop_first();
        }
    }

    /// Applies one committed entry: offsets, producers, deliveries, answers.
    fn apply(&mut self, index: u64, term: u64, data: Bytes) {
        let answer = if data.is_empty() {
            let offset = self.next_offset;
            self.next_offset += 1;
            self.out.push_back(ReplicaOutput::GenerationStart { offset, index, term });
            None
        } else {
            match ReplicatedBatch::decode_shared(data) {
                // Only this crate proposes; an entry that does not decode takes no offset on
                // any replica alike.
                Err(_) => None,
                Ok(batch) if batch.side => {
                    self.out.push_back(ReplicaOutput::Side { batch });
                    Some(Answer::Applied)
                }
                Ok(batch) => match batch.producer.map(|(pid, seq)| (pid, seq, self.sequence_verdict(pid, seq))) {
                    Some((_, _, Err(refusal))) => Some(refusal),
                    Some((pid, seq, Ok(false))) => {
                        let offset = self.producers.get(&pid).and_then(|p| p.landed.get(&seq).copied());
                        offset.map(|offset| Answer::Appended { offset, duplicate: true })
                    }
                    _ if batch.expected_offset.is_some_and(|e| e != self.next_offset) => {
                        Some(Answer::Refused(ApplyRefusal::OffsetMismatch { tail: self.next_offset }))
                    }
                    verdict => {
                        let offset = self.next_offset;
                        self.next_offset += u64::from(batch.records.count());
                        if let Some((pid, seq, _)) = verdict {
                            self.landed(pid, seq, offset, index);
                        }
                        self.out.push_back(ReplicaOutput::Delivered { offset, index, batch });
                        Some(Answer::Appended { offset, duplicate: false })
                    }
                },
            }
        };
        // Proposals at or below this index: the one at it is answered by what committed there
        // (if its term matches; another term means a newer leader overwrote it).
        while let Some((&i, _)) = self.pending.first_key_value() {
            if i > index {
                break;
            }
            let Some(p) = self.pending.remove(&i) else { break };
            let a = match (&answer, i == index && p.term == term) {
                (Some(a), true) => a.clone(),
                _ => Answer::LeadershipLost,
            };
            self.out.push_back(ReplicaOutput::Answer { token: p.token, answer: a });
        }
    }
}

#[cfg(test)]
mod tests;
