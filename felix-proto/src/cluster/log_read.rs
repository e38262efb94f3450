//! Reading entries of a replica's kept Raft log back from its append-only files (a follower far
//! behind, a reader of older history), without holding the log in memory.
//!
//! The files are records in write order ([`super::meta::encode_log_record`]); an entry may be
//! written more than once (a new leader overwrites an uncommitted tail), and the last write of
//! an index is the one the log holds. [`LogPoints`] is a sparse index of where records start:
//! every [`POINT_EVERY`] bytes, at each segment's first entries, and at every record that
//! overwrites entries, which also drops the points of what it overwrote. So the points stay in
//! order both by file position and by entry index, and any record that rewrites an entry `i`
//! lies at or after a point whose index is at most `i`. A read of `low..high` starts at the last
//! point at or below `low` and may stop once it holds what it wants and the next point's index
//! is past the last entry it holds: nothing after that point rewrites them. [`EntryCollector`]
//! folds records in file order with those rules. Pure computation: the driver does the IO.

use super::meta::{Entry, RaftLog};

/// Bytes of records between two points of the index (at most one such stretch is read in
/// vain before the entries wanted).
pub const POINT_EVERY: u64 = 256 << 10;

/// Where a record starts: the first entry it holds, its segment (the driver's number for the
/// file) and its byte position in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Point {
    /// The index of the record's first entry.
    pub index: u64,
    /// The segment.
    pub segment: u64,
    /// Its position in the segment.
    pub pos: u64,
}

/// The sparse index of one replica log's records (see the module doc).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LogPoints {
    points: Vec<Point>,
    /// The last entry index written.
    last: u64,
    /// Bytes written since the last point.
    since: u64,
    /// The segment of the last point.
    segment: Option<u64>,
}

impl LogPoints {
    /// A record of `len` bytes was written at `pos` of `segment`, holding entries
    /// `first..=last`. Returns whether it made a point.
    pub fn record(&mut self, segment: u64, pos: u64, len: u64, first: u64, last: u64) -> bool {
        let overwrites = first <= self.last;
        if overwrites {
            self.points.retain(|p| p.index < first);
        }
        let point = overwrites
            || Some(first) != self.last.checked_add(1)
            || self.segment != Some(segment)
            || self.since >= POINT_EVERY
            || self.points.is_empty();
        if point {
            self.points.push(Point { index: first, segment, pos });
            self.since = 0;
            self.segment = Some(segment);
        }
        self.since += len;
        self.last = last;
        point
    }

    /// Records that made no point were written: `len` bytes, the last entry among them `last`
    /// (0: none). What [`record`](Self::record) and [`skip`](Self::skip) of each would have done
    /// (a segment's summary replays them in one step).
    pub fn extend(&mut self, len: u64, last: u64) {
        self.since += len;
        if last != 0 {
            self.last = last;
        }
    }

    /// A record without entries (a hard state, a snapshot) of `len` bytes was written.
    pub fn skip(&mut self, len: u64) {
        self.since += len;
    }

    /// Only the segments `keep` says stay (the others were deleted).
    pub fn retain_segments(&mut self, keep: impl Fn(u64) -> bool) {
        self.points.retain(|p| keep(p.segment));
    }

    /// Renumbers segments (an index built over files counted from 0, whose driver names them
    /// otherwise).
    pub fn map_segments(&mut self, f: impl Fn(u64) -> u64) {
        for p in &mut self.points {
            p.segment = f(p.segment);
        }
        self.segment = self.segment.map(f);
    }

    /// Where a read of entries `low..high` starts (`None`: no point, nothing to read), and the
    /// points after it up to the first at or past `high` (what [`EntryCollector::done`] is
    /// asked with as the read goes).
    pub fn plan(&self, low: u64, high: u64) -> Option<(Point, Vec<Point>)> {
        let i = self.points.partition_point(|p| p.index <= low).saturating_sub(1);
        let start = *self.points.get(i)?;
        let mut after = Vec::new();
        for p in &self.points[i + 1..] {
            after.push(*p);
            if p.index >= high {
                break;
            }
        }
        Some((start, after))
    }

    /// Points held (a gauge).
    pub fn len(&self) -> usize {
        self.points.len()
    }

    /// Whether it holds no point.
    pub fn is_empty(&self) -> bool {
        self.points.is_empty()
    }
}

/// Gathers the entries `low..high` (about `max_bytes` of them from `low` on) from records fed
/// in file order, with later writes of an index replacing earlier ones.
#[derive(Debug)]
pub struct EntryCollector {
    low: u64,
    high: u64,
    max_bytes: u64,
    entries: Vec<Entry>,
    bytes: u64,
}

impl EntryCollector {
    /// A read of `low..high`, about `max_bytes` (one entry at least).
    pub fn new(low: u64, high: u64, max_bytes: u64) -> EntryCollector {
        EntryCollector { low, high, max_bytes, entries: Vec::new(), bytes: 0 }
    }

    /// One record's entries, in file order.
    pub fn feed(&mut self, part: RaftLog) {
        for e in part.entries {
            // A write of an index held drops it and everything after it (the leader that wrote
            // it replaced the tail from there).
            if self.entries.last().is_some_and(|l| e.index <= l.index) {
                let keep = self.entries.partition_point(|x| x.index < e.index);
                for x in self.entries.drain(keep..) {
                    self.bytes -= x.data.len() as u64;
                }
            }
            if e.index < self.low || e.index >= self.high || self.full() {
                continue;
            }
            if self.entries.last().is_none_or(|l| l.index.checked_add(1) == Some(e.index)) {
                self.bytes += e.data.len() as u64;
                self.entries.push(e);
            }
        }
    }

    fn full(&self) -> bool {
        !self.entries.is_empty() && self.bytes >= self.max_bytes
    }

    /// Whether the read may stop before the record at point `next` (`None`: no point follows,
    /// so only appends come after): nothing after `next` rewrites what is held, and either
    /// what is wanted is held or nothing after `next` holds any of it.
    pub fn done(&self, next: Option<&Point>) -> bool {
        let Some(next) = next else { return false };
        if next.index >= self.high {
            return true;
        }
        let Some(last) = self.entries.last() else { return false };
        next.index > last.index && (last.index.saturating_add(1) >= self.high || self.full())
    }

    /// The entries gathered.
    pub fn finish(self) -> Vec<Entry> {
        self.entries
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::meta::{HardState, encode_log_record, fold_log_segments_indexed, read_log_record};

    fn entries(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<Entry> {
        range.map(|i| Entry { index: i, term, data: vec![i as u8; 1000].into(), ..Entry::default() }).collect()
    }

    /// Reads `low..high` from one file the way a driver does: from the planned point on,
    /// record by record, until the collector is done.
    fn read(file: &[u8], points: &LogPoints, low: u64, high: u64, max: u64) -> Vec<Entry> {
        let Some((start, after)) = points.plan(low, high) else { return Vec::new() };
        let mut c = EntryCollector::new(low, high, max);
        let mut at = start.pos as usize;
        let mut next = after.iter().peekable();
        while let Some((end, part)) = read_log_record(file, at) {
            while next.peek().is_some_and(|p| (p.pos as usize) < at) {
                next.next();
            }
            if next.peek().is_some_and(|p| p.pos as usize == at) && c.done(next.peek().copied()) {
                break;
            }
            if let Some(part) = part {
                c.feed(part);
            }
            at = end;
        }
        c.finish()
    }

    /// A log of 600 entries of 1 KB in records of 10, whose tail 580..=600 of term 1 was
    /// overwritten by a term-2 leader from 585 on (and 590..=600 again later, term 3): every
    /// read gives the last write of each index, whatever range and size it asks for, and the
    /// index holds a point per 256 KiB, not per record.
    #[test]
    fn reads_give_the_last_write_of_every_index_from_a_sparse_index() {
        let mut file = Vec::new();
        let mut truth: std::collections::BTreeMap<u64, u64> = Default::default();
        let mut write = |file: &mut Vec<u8>, es: Vec<Entry>| {
            // As Raft's log: a write replaces everything from its first index on.
            truth.retain(|i, _| *i < es[0].index);
            truth.extend(es.iter().map(|e| (e.index, e.term)));
            file.extend(encode_log_record(&es, Some(&HardState { term: es[0].term, ..HardState::default() })));
        };
        for r in 0..60 {
            write(&mut file, entries(r * 10 + 1..=r * 10 + 10, 1));
        }
        write(&mut file, entries(585..=600, 2));
        write(&mut file, entries(601..=650, 2));
        write(&mut file, entries(590..=600, 3));
        let (log, _, damage, points) = fold_log_segments_indexed(&[&file]);
        assert!(damage.is_none());
        assert_eq!(log.entries.last().map(|e| e.index), Some(600));
        assert!(points.len() < 40, "{} points for {} bytes", points.len(), file.len());
        let want =
            |low: u64, n: usize| -> Vec<(u64, u64)> { truth.range(low..).take(n).map(|(i, t)| (*i, *t)).collect() };
        for low in [1, 5, 250, 579, 584, 585, 589, 590, 595, 600] {
            for (high, max) in [(601, u64::MAX), (low + 3, u64::MAX), (601, 4000)] {
                let got: Vec<(u64, u64)> =
                    read(&file, &points, low, high, max).iter().map(|e| (e.index, e.term)).collect();
                let n = if max == 4000 { 4 } else { (high - low) as usize };
                assert_eq!(got, want(low, n), "read {low}..{high} max {max}");
            }
        }
        // Past the end, and below the start: nothing invented.
        assert!(read(&file, &points, 601, 700, u64::MAX).is_empty());
    }

    #[test]
    fn points_follow_segments_and_overwrites() {
        let mut p = LogPoints::default();
        p.record(0, 0, 100, 1, 10);
        p.record(0, 100, 100, 11, 20);
        assert_eq!(p.len(), 1, "appends within 256 KiB share a point");
        p.record(1, 0, 100, 21, 30);
        assert_eq!(p.len(), 2, "a new segment starts with a point");
        p.record(1, 100, 100, 15, 16);
        assert_eq!(p.plan(12, 20).map(|(s, _)| (s.index, s.segment, s.pos)), Some((1, 0, 0)));
        assert_eq!(p.plan(17, 20).map(|(s, _)| (s.index, s.segment, s.pos)), Some((15, 1, 100)));
        assert_eq!(p.len(), 2, "the overwrite dropped the point of 21, which it replaced");
        p.retain_segments(|s| s == 1);
        assert_eq!(p.plan(1, 5).map(|(s, _)| s.index), Some(15), "segment 0 is gone");
    }
}
