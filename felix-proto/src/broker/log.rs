//! The log of one stream shard.
//!
//! Design: a durable shard assigns offsets when a batch is appended, hands the batch to storage
//! (an output the driver turns into a disk write) and makes it visible — to subscribers and to
//! readers — only once storage confirms it, in offset order. An ephemeral shard keeps nothing:
//! an appended batch is fanned out at once and forgotten.
//!
//! ```text
//!   start            committed_tail          next_offset
//!     |  committed (visible) | pending (writing) |
//! ```
//!
//! A generation-start record takes an offset and is never delivered; the first batch after a
//! run of them carries `skipped_before` for clients that read it.

use super::config::Retention;
use crate::binary::{Codec, EventBatch, Records};
use crate::flags::FlagsHi;
use crate::transport::WriteToken;
use bytes::Bytes;
use std::collections::VecDeque;

/// Bytes a batch held in memory costs beyond its payload: its log entry, the record block's
/// allocation and the encoded event-frame heads cached per subscriber shape. Measured as about
/// 500 bytes per single-record batch in the soak (334 MB of RSS for 400k such batches holding
/// 51 MB of payload); without it a `memory_bytes` budget understated small batches several times.
pub const BATCH_OVERHEAD: u64 = 512;

/// What a batch counts against the memory budget (nothing for a generation-start marker, which
/// holds no records).
fn held_bytes(b: &LogBatch) -> u64 {
    // A batch that arrived compressed holds its compressed form beside the plain one.
    let packed = b.records.packed().map_or(0, |p| p.data.len() as u64);
    if b.generation_start { 0 } else { b.records.payload_bytes() as u64 + packed + BATCH_OVERHEAD }
}

/// Which optional event-batch sections a subscriber receives (decided by what it offered and
/// by the stream). One encoding per shape per batch is shared by every subscriber of that shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub(crate) struct Shape {
    pub offsets: bool,
    pub skipped: bool,
    pub publisher: bool,
    pub timestamps: bool,
    /// The codecs the subscriber decodes (D56): a batch stored compressed with one of them is
    /// sent as stored; any other batch goes plain.
    pub codecs: FlagsHi,
    /// It reads envelopes (D58): a batch's envelope is sent to it; to anyone else, not.
    pub envelope: bool,
}

impl Shape {
    /// This shape as far as a batch compressed with `codec` (or plain) is concerned: the
    /// codecs narrowed to the one that decides its encoding, so subscribers whose codec sets
    /// differ but who get the same bytes share one encoding.
    pub fn for_codec(self, codec: Option<Codec>) -> Shape {
        let codecs = match codec {
            Some(c) if self.codecs.contains(c.flag()) => c.flag(),
            _ => FlagsHi::EMPTY,
        };
        Shape { codecs, ..self }
    }
}

/// The event batch a subscriber of `shape` receives for these records.
pub(crate) fn event_batch(
    shape: Shape,
    records: Records,
    base: u64,
    skipped: u64,
    publisher: Option<&Bytes>,
    timestamp_micros: u64,
) -> EventBatch {
    let packed = records.codec().is_some_and(|c| shape.codecs.contains(c.flag()));
    let records = if packed { records } else { records.plain() };
    let records = if shape.envelope || records.envelope().is_none() { records } else { records.with_envelope(None) };
    EventBatch {
        subscription_id: None,
        base_offset: shape.offsets.then_some(base),
        skipped_before: (shape.offsets && shape.skipped && skipped > 0).then_some(skipped),
        publisher: publisher.cloned().filter(|_| shape.publisher),
        records: if shape.timestamps { records.with_timestamp(timestamp_micros) } else { records },
    }
}

/// What is kept of a batch evicted from memory but still retained on disk.
#[derive(Debug, Clone, Copy)]
struct Evicted {
    base: u64,
    end: u64,
    timestamp_micros: u64,
    generation_start: bool,
    records: u64,
    bytes: u64,
    /// A replicated shard's batch: its entry's index in the shard's Raft log, where it is
    /// read back from (0: a batch of segment storage).
    entry: u64,
}

/// One appended batch.
#[derive(Debug)]
pub(crate) struct LogBatch {
    pub base: u64,
    pub records: Records,
    pub timestamp_micros: u64,
    pub publisher: Option<Bytes>,
    pub skipped_before: u64,
    /// A generation-start record: one offset, never delivered.
    pub generation_start: bool,
    /// The idempotent producer that wrote it, as stored (a moving shard's copy carries it).
    pub producer: Option<(u64, u64)>,
    /// A commit's state changes, as stored.
    pub state: Option<Bytes>,
    /// A replicated shard's batch: its entry's index in the Raft log (0 otherwise).
    pub entry: u64,
    /// The key it was published with (what a subscription's filter matches, D57).
    pub key: Option<Bytes>,
    encoded: Vec<(Shape, [Bytes; 2])>,
}

impl LogBatch {
    pub fn count(&self) -> u64 {
        if self.generation_start { 1 } else { u64::from(self.records.count()) }
    }
    pub fn end(&self) -> u64 {
        self.base + self.count()
    }

    fn event_batch(&self, shape: Shape, records: Records, base: u64, skipped: u64) -> EventBatch {
        event_batch(shape, records, base, skipped, self.publisher.as_ref(), self.timestamp_micros)
    }

    /// The event frame for `shape`, encoded once and cached.
    pub fn frame(&mut self, shape: Shape) -> [Bytes; 2] {
        let shape = shape.for_codec(self.records.codec());
        if let Some((_, f)) = self.encoded.iter().find(|(s, _)| *s == shape) {
            return f.clone();
        }
        let e = self.event_batch(shape, self.records.clone(), self.base, self.skipped_before);
        // A batch was validated on the way in and the publisher is capped at 255 bytes, so
        // encoding cannot fail; an empty frame would only ever be skipped by the writer.
        let f = e.encode_parts().unwrap_or_default();
        self.encoded.push((shape, f.clone()));
        f
    }

    /// The event frame for `shape` with `extra` more offsets skipped before it (a filtered
    /// subscription's, D57): the cached frame when there are none, else encoded for it alone.
    pub fn frame_skipping(&mut self, shape: Shape, extra: u64) -> [Bytes; 2] {
        if extra == 0 {
            return self.frame(shape);
        }
        let e = self.event_batch(shape, self.records.clone(), self.base, self.skipped_before + extra);
        e.encode_parts().unwrap_or_default()
    }

    /// Offsets a filtered subscription passes over when this batch is not for it, from
    /// `cursor`: its records there, and the records no batch holds just before it.
    pub fn passed_over(&self, cursor: u64) -> u64 {
        let from = cursor.max(self.base);
        let before = if from == self.base { self.skipped_before } else { 0 };
        before + self.end().saturating_sub(from)
    }

    /// The event frame for the part of this batch from `from` on (a resumed subscription that
    /// starts inside a batch). Not cached: it happens once per subscription.
    pub fn frame_from(&self, shape: Shape, from: u64) -> [Bytes; 2] {
        let skip = from.saturating_sub(self.base);
        let records = self.records.skip(skip as u32);
        let skipped = if skip == 0 { self.skipped_before } else { 0 };
        self.event_batch(shape, records, from.max(self.base), skipped).encode_parts().unwrap_or_default()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WriteState {
    Writing,
    Done,
    Failed,
}

#[derive(Debug)]
struct Pending {
    batch: LogBatch,
    token: WriteToken,
    state: WriteState,
}

/// What became of the writes a storage completion settled.
#[derive(Debug, Default)]
pub(crate) struct Settled {
    /// Batches now visible (indices into `committed`, as offset ranges).
    pub committed: Vec<(u64, u64)>,
    /// Writes that failed: `(token, base, end)`.
    pub failed: Vec<(WriteToken, u64, u64)>,
    /// Writes now visible: `(token, base)`.
    pub done: Vec<(WriteToken, u64)>,
}

/// The log of one shard.
#[derive(Debug)]
pub(crate) struct ShardLog {
    pub durable: bool,
    committed: VecDeque<LogBatch>,
    pending: VecDeque<Pending>,
    next_offset: u64,
    start: u64,
    bytes: u64,
    records: u64,
    skip_next: u64,
    retention: Retention,
    /// Batches evicted from memory, oldest first (only with a memory budget).
    evicted: VecDeque<Evicted>,
    /// Payload bytes of history kept in memory; `None` keeps all retained history.
    memory_budget: Option<u64>,
    mem_bytes: u64,
    pending_bytes: u64,
    /// The newest timestamp any batch of this log was given (see [`stamp`](Self::stamp)).
    last_ts: u64,
}

impl ShardLog {
    pub fn new(durable: bool, retention: Retention) -> ShardLog {
        ShardLog {
            durable,
            committed: VecDeque::new(),
            pending: VecDeque::new(),
            next_offset: 0,
            start: 0,
            bytes: 0,
            records: 0,
            skip_next: 0,
            retention,
            evicted: VecDeque::new(),
            memory_budget: None,
            mem_bytes: 0,
            pending_bytes: 0,
            last_ts: 0,
        }
    }

    /// The timestamp for the next batch, from the clock's `wall_micros`: never less than the
    /// last batch's, so timestamps never go back along the offsets whatever a broker's clock
    /// says (a restarted broker whose clock was set back, a new leader whose clock is behind
    /// the old one's). `offset_for_time`'s search and age retention count on that. A clock set
    /// ahead is not undone: later batches keep its time until the clocks pass it.
    pub fn stamp(&self, wall_micros: u64) -> u64 {
        wall_micros.max(self.last_ts)
    }

    /// The newest timestamp given (a replica's checkpoint keeps it: every replica clamps the
    /// same way after restoring one).
    pub fn last_timestamp(&self) -> u64 {
        self.last_ts
    }

    /// Raises the newest timestamp given to at least `ts` (a snapshot's).
    pub fn raise_timestamp(&mut self, ts: u64) {
        self.last_ts = self.last_ts.max(ts);
    }

    /// Empties the log, which goes on from `offset` (a replicated shard restored from a
    /// snapshot: everything before `offset` is gone).
    pub fn reset_to(&mut self, offset: u64) {
        self.committed.clear();
        self.pending.clear();
        self.evicted.clear();
        self.next_offset = offset;
        self.start = offset;
        self.bytes = 0;
        self.records = 0;
        self.skip_next = 0;
        self.mem_bytes = 0;
        self.pending_bytes = 0;
    }

    /// Payload bytes appended and not yet confirmed by storage.
    pub fn pending_bytes(&self) -> u64 {
        self.pending_bytes
    }

    /// Keeps at most `budget` payload bytes of history in memory; older batches are read back
    /// from storage on demand.
    pub fn set_memory_budget(&mut self, budget: Option<u64>) {
        self.memory_budget = budget;
    }

    /// First offset held in memory (history below it must be read from storage).
    pub fn memory_start(&self) -> u64 {
        self.committed.front().map_or_else(|| self.committed_tail(), |b| b.base)
    }

    /// Memory the history held in memory costs: payload bytes plus [`BATCH_OVERHEAD`] per
    /// batch (what `memory_bytes` budgets are spent against).
    pub fn memory_bytes(&self) -> u64 {
        self.mem_bytes
    }

    fn evict_to_budget(&mut self) {
        let Some(budget) = self.memory_budget else { return };
        while self.mem_bytes > budget && self.committed.len() > 1 {
            let b = self.committed.pop_front().expect("len > 1");
            self.mem_bytes -= held_bytes(&b);
            let bytes = if b.generation_start { 0 } else { b.records.payload_bytes() as u64 };
            let records = if b.generation_start { 0 } else { b.count() };
            self.evicted.push_back(Evicted {
                base: b.base,
                end: b.end(),
                timestamp_micros: b.timestamp_micros,
                generation_start: b.generation_start,
                records,
                bytes,
                entry: b.entry,
            });
        }
    }

    /// Oldest retained offset.
    pub fn start(&self) -> u64 {
        self.start
    }

    /// First offset not yet visible.
    pub fn committed_tail(&self) -> u64 {
        self.pending.front().map_or(self.next_offset, |p| p.batch.base)
    }

    /// The committed tail short of the generation-start records the log ends with: where a
    /// `latest` subscriber starts.
    pub fn readable_tail(&self) -> u64 {
        let mut t = self.committed_tail();
        for b in self.committed.iter().rev() {
            if b.generation_start && b.end() == t {
                t = b.base;
            } else {
                break;
            }
        }
        t
    }

    /// Next offset to be assigned (raw tail, counting pending writes).
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// Payload bytes of history retained, counting batches still being written.
    pub fn retained_bytes(&self) -> u64 {
        self.bytes + self.pending_bytes
    }

    /// Records retained (committed, not counting generation-start records).
    pub fn retained_records(&self) -> u64 {
        self.records
    }

    /// Appends a batch. A durable log keeps it pending until [`settle`](Self::settle); an
    /// ephemeral one returns it for immediate fan-out.
    pub fn append(
        &mut self,
        records: Records,
        timestamp_micros: u64,
        publisher: Option<Bytes>,
        token: Option<WriteToken>,
    ) -> (u64, Option<LogBatch>) {
        let base = self.next_offset;
        let timestamp_micros = self.stamp(timestamp_micros);
        self.last_ts = timestamp_micros;
        let batch = LogBatch {
            key: None,
            base,
            records,
            timestamp_micros,
            publisher,
            skipped_before: std::mem::take(&mut self.skip_next),
            generation_start: false,
            producer: None,
            state: None,
            entry: 0,
            encoded: Vec::new(),
        };
        self.next_offset += batch.count();
        match token {
            Some(token) if self.durable => {
                self.pending_bytes += batch.records.payload_bytes() as u64;
                self.pending.push_back(Pending { batch, token, state: WriteState::Writing });
                (base, None)
            }
            _ => (base, Some(batch)),
        }
    }

    /// The key the batch just appended was published with (D57).
    pub fn note_key(&mut self, key: Option<Bytes>) {
        if let Some(p) = self.pending.back_mut() {
            p.batch.key = key;
        }
    }

    /// What is stored with the batch just appended besides its records (the producer that
    /// wrote it, a commit's state changes): kept for a copy of the shard to another broker.
    pub fn note_last(&mut self, producer: Option<(u64, u64)>, state: Option<Bytes>) {
        if let Some(p) = self.pending.back_mut() {
            p.batch.producer = producer;
            p.batch.state = state;
        }
    }

    /// The batches held in memory from the one holding `from` up to the committed tail, about
    /// `max_bytes` of payload at most (one at least), as storage holds them: what a moving
    /// shard's new owner is sent. Empty when `from` is below what memory holds.
    pub fn stored_from(&self, from: u64, max_bytes: usize) -> Vec<crate::storage::StoredBatch> {
        if from < self.memory_start() {
            return Vec::new();
        }
        let i = self.committed.partition_point(|b| b.end() <= from);
        let mut out = Vec::new();
        let mut bytes = 0;
        for b in self.committed.iter().skip(i) {
            if !out.is_empty() && bytes + b.records.payload_bytes() > max_bytes {
                break;
            }
            bytes += b.records.payload_bytes();
            out.push(crate::storage::StoredBatch {
                key: b.key.clone(),
                base_offset: b.base,
                timestamp_micros: b.timestamp_micros,
                generation_start: b.generation_start,
                publisher: b.publisher.clone(),
                producer: b.producer,
                state: b.state.clone(),
                records: b.records.clone(),
            });
        }
        out
    }

    /// Whether no write is in flight: the committed tail is final until the next append.
    pub fn settled(&self) -> bool {
        self.pending.is_empty()
    }

    /// Restores a batch read back from storage at start: it is committed as it stands. Batches
    /// must come in offset order; the first one sets where the log starts.
    pub fn restore(&mut self, b: crate::storage::StoredBatch) {
        if self.committed.is_empty() && self.evicted.is_empty() && self.pending.is_empty() && self.records == 0 {
            self.start = b.base_offset;
            self.next_offset = b.base_offset;
        }
        if b.base_offset < self.next_offset {
            return; // already have it
        }
        let skipped_before = if b.generation_start { 0 } else { std::mem::take(&mut self.skip_next) };
        if b.generation_start {
            self.skip_next += 1;
        }
        self.last_ts = self.last_ts.max(b.timestamp_micros);
        let batch = LogBatch {
            key: b.key,
            base: b.base_offset,
            records: b.records,
            timestamp_micros: b.timestamp_micros,
            publisher: b.publisher,
            skipped_before,
            generation_start: b.generation_start,
            producer: b.producer,
            state: b.state,
            entry: 0,
            encoded: Vec::new(),
        };
        self.next_offset = batch.end();
        if !batch.generation_start {
            self.records += batch.count();
            self.bytes += batch.records.payload_bytes() as u64;
        }
        self.mem_bytes += held_bytes(&batch);
        self.committed.push_back(batch);
        self.evict_to_budget();
    }

    /// Restores a batch known only by its index entry (older history, kept on disk): what
    /// retention, `offset_for_time` and the position checks need, without its records. Entries
    /// must come in offset order, before the batches restored whole.
    pub fn restore_summary(&mut self, e: &crate::storage::IndexEntry) {
        if self.committed.is_empty() && self.evicted.is_empty() && self.pending.is_empty() && self.records == 0 {
            self.start = e.base_offset;
            self.next_offset = e.base_offset;
        }
        if e.base_offset < self.next_offset {
            return;
        }
        let records = if e.generation_start { 0 } else { e.count };
        let bytes = if e.generation_start { 0 } else { e.payload_bytes };
        self.last_ts = self.last_ts.max(e.timestamp_micros);
        self.evicted.push_back(Evicted {
            base: e.base_offset,
            end: e.base_offset + e.count,
            timestamp_micros: e.timestamp_micros,
            generation_start: e.generation_start,
            records,
            bytes,
            entry: 0,
        });
        self.records += records;
        self.bytes += bytes;
        self.next_offset = e.base_offset + e.count;
        // A batch after a run of generation-start records carries skipped_before; a summary
        // is never delivered from memory, so the count restarts with what follows.
        self.skip_next = if e.generation_start { self.skip_next + 1 } else { 0 };
    }

    /// Appends a batch already committed elsewhere at offset `base` (a replicated shard's
    /// entry, committed by its Raft group, which assigned the offset): visible at once. A batch
    /// below the tail is one the log holds (a replay) and is ignored; one above it (a log that
    /// starts later than this one's tail) leaves the offsets between as a gap. Returns the
    /// batch's end when it was appended.
    pub fn append_committed(&mut self, base: u64, c: Committed, generation_start: bool, entry: u64) -> Option<u64> {
        let Committed { records, timestamp_micros, publisher, key } = c;
        if base < self.next_offset || !self.pending.is_empty() {
            return None;
        }
        if self.committed.is_empty() && self.evicted.is_empty() && self.records == 0 {
            self.start = base;
        }
        let skipped_before = if generation_start { 0 } else { std::mem::take(&mut self.skip_next) };
        if generation_start {
            self.skip_next += 1;
        }
        // Clamped alike on every replica (the same entries in the same order).
        let timestamp_micros = self.stamp(timestamp_micros);
        self.last_ts = timestamp_micros;
        let batch = LogBatch {
            key,
            base,
            records,
            timestamp_micros,
            publisher,
            skipped_before,
            generation_start,
            producer: None,
            state: None,
            entry,
            encoded: Vec::new(),
        };
        self.next_offset = batch.end();
        if !generation_start {
            self.records += batch.count();
            self.bytes += batch.records.payload_bytes() as u64;
        }
        self.mem_bytes += held_bytes(&batch);
        self.committed.push_back(batch);
        // Only batches that know their entry leave memory: they are read back from the Raft
        // log by index.
        if entry > 0 {
            self.evict_to_budget();
        }
        Some(self.next_offset)
    }

    /// For a read of `from..end` below memory on a replicated shard: the range of Raft log
    /// indexes holding the evicted batches from the one holding `from` on, about `max_bytes`
    /// of payload (one batch at least). `None` when no evicted batch of a replicated shard
    /// holds `from`.
    pub fn entry_range(&self, from: u64, end: u64, max_bytes: usize) -> Option<(u64, u64)> {
        let i = self.evicted.partition_point(|b| b.end <= from);
        let first = self.evicted.get(i).filter(|b| b.entry > 0 && b.base < end)?;
        let (mut last, mut bytes) = (first, 0u64);
        for b in self.evicted.range(i..) {
            if b.base >= end || b.entry == 0 || (bytes > 0 && bytes + b.bytes > max_bytes as u64) {
                break;
            }
            bytes += b.bytes;
            last = b;
        }
        Some((first.entry, last.entry + 1))
    }

    /// The evicted batch whose entry is `entry`: its offset, time and whether it is a
    /// generation start (what a read of a replicated shard needs besides the entry's bytes).
    pub fn evicted_entry(&self, entry: u64) -> Option<(u64, u64, bool)> {
        let i = self.evicted.partition_point(|b| b.entry < entry);
        self.evicted.get(i).filter(|b| b.entry == entry).map(|b| (b.base, b.timestamp_micros, b.generation_start))
    }

    /// The batches held in memory from `from` on: (base offset, generation start, payloads).
    pub fn held_from(&self, from: u64) -> Vec<(u64, bool, Vec<Bytes>)> {
        let i = self.committed.partition_point(|b| b.end() <= from);
        self.committed.iter().skip(i).map(|b| (b.base, b.generation_start, b.records.payloads().collect())).collect()
    }

    /// Appends a generation-start record: it takes one offset and is never delivered.
    pub fn append_generation_start(&mut self, timestamp_micros: u64, token: WriteToken) -> u64 {
        let base = self.next_offset;
        let timestamp_micros = self.stamp(timestamp_micros);
        self.last_ts = timestamp_micros;
        self.next_offset += 1;
        self.skip_next += 1;
        let batch = LogBatch {
            key: None,
            base,
            records: Records::default(),
            timestamp_micros,
            publisher: None,
            skipped_before: 0,
            generation_start: true,
            producer: None,
            state: None,
            entry: 0,
            encoded: Vec::new(),
        };
        self.pending.push_back(Pending { batch, token, state: WriteState::Writing });
        base
    }

    /// Records the outcome of a write, then makes visible every settled write at the front, in
    /// offset order. A failed write never becomes visible; its offsets stay a gap.
    pub fn settle(&mut self, token: WriteToken, ok: bool) -> Settled {
        if let Some(p) = self.pending.iter_mut().find(|p| p.token == token) {
            p.state = if ok { WriteState::Done } else { WriteState::Failed };
        }
        let mut out = Settled::default();
        while let Some(front) = self.pending.front() {
            match front.state {
                WriteState::Writing => break,
                WriteState::Failed => {
                    let p = self.pending.pop_front().expect("front exists");
                    self.pending_bytes -= p.batch.records.payload_bytes() as u64;
                    out.failed.push((p.token, p.batch.base, p.batch.end()));
                }
                WriteState::Done => {
                    let p = self.pending.pop_front().expect("front exists");
                    self.pending_bytes -= p.batch.records.payload_bytes() as u64;
                    out.done.push((p.token, p.batch.base));
                    out.committed.push((p.batch.base, p.batch.end()));
                    if !p.batch.generation_start {
                        self.records += p.batch.count();
                        self.bytes += p.batch.records.payload_bytes() as u64;
                    }
                    self.mem_bytes += held_bytes(&p.batch);
                    self.committed.push_back(p.batch);
                }
            }
        }
        out
    }

    /// Moves history beyond the memory budget out of memory (after subscribers that were fed
    /// live got it).
    pub fn trim_memory(&mut self) {
        self.evict_to_budget();
    }

    /// The committed batch holding `offset`, if retained.
    pub fn batch_at(&mut self, offset: u64) -> Option<&mut LogBatch> {
        let i = self.committed.partition_point(|b| b.end() <= offset);
        self.committed.get_mut(i).filter(|b| b.base <= offset)
    }

    /// The first committed, deliverable batch that ends after `offset`.
    pub fn next_deliverable(&mut self, offset: u64) -> Option<&mut LogBatch> {
        let i = self.committed.partition_point(|b| b.end() <= offset);
        self.committed.range_mut(i..).find(|b| !b.generation_start)
    }

    /// First committed offset whose batch was appended at or after `at_micros` (a binary search:
    /// append times follow the broker's clock, so they are monotone unless it stepped back).
    /// Generation-start records are passed over; `None` when no readable record is that recent.
    pub fn offset_for_time(&self, at_micros: u64) -> Option<u64> {
        let e = self.evicted.partition_point(|b| b.timestamp_micros < at_micros);
        let evicted = self.evicted.range(e..).map(|b| (b.base, b.generation_start));
        let c = self.committed.partition_point(|b| b.timestamp_micros < at_micros);
        let committed = self.committed.range(c..).map(|b| (b.base, b.generation_start));
        // Everything evicted precedes everything in memory, so when the search lands past the
        // evicted list the answer lies in memory.
        let found = if e < self.evicted.len() {
            evicted.chain(self.committed.iter().map(|b| (b.base, b.generation_start))).find(|(_, g)| !g)
        } else {
            committed.into_iter().find(|(_, g)| !g)
        };
        found.map(|(base, _)| base.max(self.start))
    }

    /// Adds the committed records from `page.next` up to `end` held in memory to `page`, within
    /// its caps. The caller has read anything below [`memory_start`](Self::memory_start) from
    /// storage first.
    pub fn read_page(&self, end: u64, page: &mut Page) {
        let i = self.committed.partition_point(|b| b.end() <= page.next);
        for b in self.committed.range(i..) {
            if !page.take_batch(
                b.base,
                b.end(),
                b.generation_start,
                &b.records,
                b.publisher.as_ref(),
                b.timestamp_micros,
                end,
            ) {
                break;
            }
        }
    }

    /// What offset `o` (below the committed tail) holds: a record, or something a reader steps
    /// over up to `end` (a generation-start record, offsets a failed write left empty, history
    /// retention removed).
    pub fn slot(&self, o: u64) -> Slot {
        if o < self.start {
            return Slot::Skip { end: self.start };
        }
        let i = self.evicted.partition_point(|b| b.end <= o);
        if let Some(b) = self.evicted.get(i) {
            return if b.base > o {
                Slot::Skip { end: b.base }
            } else if b.generation_start {
                Slot::Skip { end: b.end }
            } else {
                Slot::Record
            };
        }
        let i = self.committed.partition_point(|b| b.end() <= o);
        match self.committed.get(i) {
            Some(b) if b.base > o => Slot::Skip { end: b.base },
            Some(b) if b.generation_start => Slot::Skip { end: b.end() },
            Some(_) => Slot::Record,
            None => Slot::Skip { end: self.committed_tail().max(o + 1) },
        }
    }

    /// The record at `o` if it is held in memory: `(payload, publisher, append time)`.
    pub fn record_at(&self, o: u64) -> Option<(Bytes, Option<Bytes>, u64)> {
        let i = self.committed.partition_point(|b| b.end() <= o);
        let b = self.committed.get(i).filter(|b| b.base <= o && !b.generation_start)?;
        let payload = b.records.payloads().nth(usize::try_from(o - b.base).ok()?)?;
        Some((payload, b.publisher.clone(), b.timestamp_micros))
    }

    /// Drops every committed batch below `start` (a system log truncated under a checkpoint).
    pub fn truncate_before(&mut self, start: u64) {
        while self.evicted.front().is_some_and(|b| b.end <= start) {
            let b = self.evicted.pop_front().expect("front exists");
            self.records -= b.records;
            self.bytes -= b.bytes;
        }
        while self.committed.front().is_some_and(|b| b.end() <= start) {
            let b = self.committed.pop_front().expect("front exists");
            if !b.generation_start {
                self.records -= b.count();
                self.bytes -= b.records.payload_bytes() as u64;
            }
            self.mem_bytes -= held_bytes(&b);
        }
        self.start = self.start.max(start);
    }

    /// Drops the oldest batches beyond the retention limits. Returns the new start.
    /// Age is measured on append times (wall clock), so it holds across restarts.
    pub fn enforce_retention(&mut self, now_micros: u64) -> u64 {
        while let Some(front) = self.evicted.front().copied() {
            let over_records = self.retention.max_records.is_some_and(|m| self.records > m);
            let over_bytes = self.retention.max_bytes.is_some_and(|m| self.bytes > m);
            let too_old = self.retention.max_age.is_some_and(|age| aged(now_micros, front.timestamp_micros, age));
            if !(over_records || over_bytes || too_old) {
                return self.start;
            }
            self.evicted.pop_front();
            self.records -= front.records;
            self.bytes -= front.bytes;
            self.start = front.end;
        }
        while let Some(front) = self.committed.front() {
            let over_records = self.retention.max_records.is_some_and(|m| self.records > m);
            let over_bytes = self.retention.max_bytes.is_some_and(|m| self.bytes > m);
            let too_old = self.retention.max_age.is_some_and(|age| aged(now_micros, front.timestamp_micros, age));
            if !(over_records || over_bytes || too_old) {
                break;
            }
            let b = self.committed.pop_front().expect("front exists");
            if !b.generation_start {
                self.records -= b.count();
                self.bytes -= b.records.payload_bytes() as u64;
            }
            self.mem_bytes -= held_bytes(&b);
            self.start = b.end();
        }
        self.start
    }
}

/// Whether a record appended at `appended_micros` is older than `age` at `now_micros`.
fn aged(now_micros: u64, appended_micros: u64, age: std::time::Duration) -> bool {
    now_micros.saturating_sub(appended_micros) > u64::try_from(age.as_micros()).unwrap_or(u64::MAX)
}

/// What an offset holds (see [`ShardLog::slot`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Slot {
    /// A record a reader is given.
    Record,
    /// Nothing to give up to `end`.
    Skip { end: u64 },
}

/// One record of a `stream_read` page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PageRecord {
    pub offset: u64,
    pub payload: Bytes,
    pub publisher: Option<Bytes>,
    pub timestamp_micros: u64,
}

/// A `stream_read` page being filled, from storage and then from memory, in offset order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Page {
    pub records: Vec<PageRecord>,
    /// Where the next page starts: after the last record taken, or after what was stepped
    /// over (generation-start records, offsets no write filled).
    pub next: u64,
    bytes: u64,
    max_records: usize,
    max_bytes: u64,
}

impl Page {
    pub fn new(from: u64, max_records: usize, max_bytes: u64) -> Page {
        Page { records: Vec::new(), next: from, bytes: 0, max_records: max_records.max(1), max_bytes }
    }

    pub fn is_full(&self) -> bool {
        self.records.len() >= self.max_records || self.bytes >= self.max_bytes
    }

    /// Takes the records of one batch `[base, batch_end)` from `self.next` on, stopping before
    /// `end` or when the page is full (a first record larger than the byte cap still comes,
    /// alone). Returns whether the page can take more after this batch.
    #[allow(clippy::too_many_arguments)] // a batch's fields, apart so stored batches fit too
    pub fn take_batch(
        &mut self,
        base: u64,
        batch_end: u64,
        generation_start: bool,
        records: &Records,
        publisher: Option<&Bytes>,
        timestamp_micros: u64,
        end: u64,
    ) -> bool {
        if batch_end <= self.next {
            return true;
        }
        if base >= end || self.is_full() {
            return false;
        }
        if generation_start {
            self.next = batch_end;
            return true;
        }
        for (i, payload) in records.payloads().enumerate() {
            let offset = base + i as u64;
            if offset < self.next {
                continue;
            }
            if offset >= end || self.records.len() >= self.max_records {
                return false;
            }
            let len = payload.len() as u64;
            if !self.records.is_empty() && self.bytes + len > self.max_bytes {
                return false;
            }
            self.bytes += len;
            self.records.push(PageRecord { offset, payload, publisher: publisher.cloned(), timestamp_micros });
            self.next = offset + 1;
        }
        !self.is_full()
    }
}

/// What [`ShardLog::append_committed`] appends: a replicated shard's committed batch.
#[derive(Debug, Default)]
pub struct Committed {
    /// The records.
    pub records: Records,
    /// Its append time (clamped so times never go back).
    pub timestamp_micros: u64,
    /// Who published it.
    pub publisher: Option<Bytes>,
    /// The key it was published with (D57, D59).
    pub key: Option<Bytes>,
}

#[cfg(test)]
mod tests;
