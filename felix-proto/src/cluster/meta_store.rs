//! The Raft engine's storage for one member ([`GroupStore`]): its `MemStorage`, the snapshot
//! it compacted to, and the entries that left memory for the log on disk ([`Spill`]).

use super::*;
use raft::storage::MemStorage;
use raft::{GetEntriesContext, RaftState, Storage};
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
pub(super) struct GroupStore {
    pub(super) mem: MemStorage,
    pub(super) snapshot: Snapshot,
    /// Entries after the snapshot that left memory (the driver's log holds them).
    pub(super) disk: OnDisk,
    /// What `mem` holds, for the cache's byte count.
    pub(super) cached: EntryCache,
    /// Reads of evicted entries asked and answered (the engine reads through `&self`).
    pub(super) reads: std::cell::RefCell<DiskReads>,
    /// Where the snapshot's data is when it is not in `snapshot` ([`SnapshotData`]).
    pub(super) snapshot_data: std::cell::RefCell<SnapshotData>,
}

/// Where a snapshot's data is kept. In memory it would hold the state machine's state a second
/// time (a replicated cache's values, a stream's commit state) for as long as the snapshot is
/// the last one, although it is on disk already and only a follower behind the compaction
/// ever needs it. With [`MetaNode::set_snapshot_on_disk`] the data leaves memory once it is
/// handed to the driver to persist; a follower that needs it waits while it is read back
/// ([`MetaOutput::ReadSnapshot`]), then is sent it (the data dropped again once handed over).
#[derive(Debug, Default)]
pub(super) struct SnapshotData {
    /// Data leaves memory once persisted.
    pub(super) on_disk: bool,
    /// The kept snapshot's data is on disk only (`snapshot` holds none of it).
    pub(super) offloaded: bool,
    /// A read of the data asked by the engine and not yet handed to the driver.
    pub(super) ask: bool,
    /// A read under way.
    pub(super) pending: bool,
    /// The data read back, until the engine takes it.
    pub(super) loaded: Option<bytes::Bytes>,
    /// Followers the engine could not send the snapshot to while it was on disk (sent it once
    /// it is read; a few at most: the engine asks again at its next heartbeat to each).
    pub(super) waiting: Vec<u64>,
    /// The data on disk is not read back for the engine at all: its `MsgSnapshot` goes out
    /// with the metadata only, and the host streams the data from disk in chunks
    /// ([`MetaNode::set_snapshot_by_reference`]).
    pub(super) by_reference: bool,
}

/// The entries `first..end` of the log that are held on disk only, with their terms (the
/// engine asks an entry's term at any time, and must be answered at once): one run per term,
/// a few bytes for millions of entries. Also what a restart's [`Spill`] holds of its entries.
#[derive(Debug, Clone, Default, PartialEq)]
pub(super) struct OnDisk {
    pub(super) first: u64,
    pub(super) end: u64,
    /// (first index, term), ascending; the last run goes on to `end`.
    pub(super) runs: Vec<(u64, u64)>,
}

impl OnDisk {
    pub(super) fn is_empty(&self) -> bool {
        self.first >= self.end
    }

    pub(super) fn term(&self, idx: u64) -> Option<u64> {
        if idx < self.first || idx >= self.end {
            return None;
        }
        let i = self.runs.partition_point(|(start, _)| *start <= idx);
        i.checked_sub(1).map(|i| self.runs[i].1)
    }

    /// Entry `idx` of `term` left memory (entries leave in index order).
    pub(super) fn push(&mut self, idx: u64, term: u64) {
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
    pub(super) fn drop_through(&mut self, index: u64) {
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
    pub(super) fn truncate_from(&mut self, idx: u64) {
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
/// ([`crate::cluster::replica::Replica`]) instead of holding the whole retained log in memory, and the
/// engine starts with them applied.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Spill {
    /// The entries' terms.
    pub(super) disk: OnDisk,
    /// The configuration changes among them, in index order.
    pub(super) conf: Vec<Entry>,
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
    pub(super) fn push(&mut self, e: &Entry) {
        if self.is_empty() {
            self.conf.clear();
        }
        self.disk.push(e.index, e.term);
        if e.get_entry_type() == EntryType::EntryConfChange {
            self.conf.push(crate::cluster::segment_summary::detached(e));
        }
    }

    /// Entries `first..end` of the terms in `runs` (each (first index, term), ascending, the
    /// first at `first`) go to disk, with the configuration changes among them: a segment's
    /// summary, continuing what it holds.
    pub(super) fn push_runs(&mut self, first: u64, end: u64, runs: &[(u64, u64)], conf: &[Entry]) {
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
    pub(super) fn truncate_from(&mut self, idx: u64) {
        self.disk.truncate_from(idx);
        self.conf.retain(|e| e.index < idx);
    }

    /// Entries up to `index` were compacted into a snapshot.
    pub(super) fn drop_through(&mut self, index: u64) {
        self.disk.drop_through(index);
        self.conf.retain(|e| e.index > index);
    }
}

/// The size of each entry `MemStorage` holds, and their sum.
#[derive(Debug, Default)]
pub(super) struct EntryCache {
    /// Most entry bytes kept in memory once applied (`None`: every entry stays).
    pub(super) budget: Option<u64>,
    /// (index, bytes) of each entry in memory, ascending.
    pub(super) sizes: VecDeque<(u64, u64)>,
    pub(super) bytes: u64,
}

impl EntryCache {
    pub(super) fn appended(&mut self, entries: &[Entry]) {
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
    pub(super) fn dropped_below(&mut self, first: u64) {
        while self.sizes.front().is_some_and(|(i, _)| *i < first) {
            let (_, b) = self.sizes.pop_front().unwrap_or_default();
            self.bytes -= b;
        }
    }

    pub(super) fn clear(&mut self) {
        self.sizes.clear();
        self.bytes = 0;
    }
}

/// What an entry in memory costs besides its data (its `Entry`, its place in the log).
pub(super) const ENTRY_OVERHEAD: u64 = 128;

/// Reads of entries held on disk only.
#[derive(Default)]
pub(super) struct DiskReads {
    /// Asked by the engine and not yet handed to the driver: (low, high, max bytes).
    pub(super) asked: Vec<(u64, u64, u64)>,
    /// Reads under way, by their first index.
    pub(super) pending: std::collections::BTreeSet<u64>,
    /// The engine's requests waiting on a read, with the read's first index (tried again
    /// when it is answered). A few at most: the engine asks again on its next heartbeat.
    pub(super) waiting: VecDeque<(u64, GetEntriesContext)>,
    /// Entries read, by their first index, while the engine takes them.
    pub(super) ready: std::collections::BTreeMap<u64, Vec<Entry>>,
}

/// Requests kept waiting on reads of the disk (older ones are dropped: the engine asks again
/// at its next heartbeat to that follower).
pub(super) const MAX_WAITING_READS: usize = 16;

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
        let mut snap = self.snapshot.clone();
        {
            let mut d = self.snapshot_data.borrow_mut();
            if d.offloaded && d.by_reference {
                // The host sends the data from disk, piece by piece, after the message.
                return self.with_conf_of_now(snap, to);
            }
            if d.offloaded {
                // Handed over once: the message holds it while it is sent, and the next
                // follower that needs it waits for another read.
                let Some(data) = d.loaded.take() else {
                    if !d.pending {
                        d.ask = true;
                        d.pending = true;
                    }
                    if to != 0 && !d.waiting.contains(&to) && d.waiting.len() < MAX_WAITING_READS {
                        d.waiting.push(to);
                    }
                    return Err(raft::Error::Store(raft::StorageError::SnapshotTemporarilyUnavailable));
                };
                snap.set_data(data);
            }
        }
        self.with_conf_of_now(snap, to)
    }
}

impl GroupStore {
    /// The snapshot `snap` for follower `to`. A member added after the compaction gets the
    /// configuration of now: the engine refuses a snapshot whose configuration does not name
    /// it, and would be sent this one forever (the changes after the snapshot come again with
    /// the entries that follow it, and re-applying them changes nothing).
    fn with_conf_of_now(&self, mut snap: Snapshot, to: u64) -> raft::Result<Snapshot> {
        let conf = self.snapshot.get_metadata().get_conf_state();
        if to != 0 && !conf.voters.contains(&to) && !conf.learners.contains(&to) {
            snap.mut_metadata().set_conf_state(self.mem.initial_state()?.conf_state);
        }
        Ok(snap)
    }
}

impl GroupStore {
    /// The kept snapshot was handed to the driver to persist: with [`SnapshotData::on_disk`]
    /// its data leaves memory (a read under way or data read back for the one before are
    /// dropped with it).
    pub(super) fn snapshot_persisted(&mut self) {
        let d = self.snapshot_data.get_mut();
        if !d.on_disk {
            return;
        }
        *d = SnapshotData { on_disk: true, by_reference: d.by_reference, ..SnapshotData::default() };
        if !self.snapshot.get_data().is_empty() {
            self.snapshot.set_data(bytes::Bytes::new());
            d.offloaded = true;
        }
    }

    /// Lets applied entries beyond the cache's budget leave memory, oldest first (the last
    /// entry always stays: `MemStorage` reads its last index from its entries).
    pub(super) fn evict(&mut self, applied: u64) {
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
