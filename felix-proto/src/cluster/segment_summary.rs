//! A closed segment of a replica's Raft log, summarised: what folding its records does to the
//! log, without the entries' data. A restart of a replica with a long retained log reads the
//! summaries of its older segments (a few hundred bytes each) instead of every record in them
//! (64 MiB each): the entries they hold are committed and are replayed from the files after
//! the engine starts ([`super::meta::Spill`]), so all the fold needs of them is their terms,
//! their configuration changes, the hard state they leave and where their records start.
//!
//! A driver builds a summary as it appends ([`SummaryBuilder`]), writes it beside the segment
//! when the segment is closed (after the segment is synced), and at a restart hands it to
//! [`super::meta::LogFold::feed_summary`], which takes it only when it is equivalent to
//! folding the segment's records: no entry of it below the last snapshot, every entry in it
//! committed by the hard state it leaves. Otherwise, or when the summary is missing, damaged
//! or names another length than the file's, the driver folds the segment's records as before.
//! So a summary is never trusted over the records it stands for; it only saves reading them.
//! Pure computation: the driver does the IO.

use super::meta::{Entry, HardState};
use raft::eraftpb::EntryType;

/// The summary's magic and version.
const MAGIC: &[u8; 4] = b"FLXU";
const VERSION: u8 = 1;

/// One step of folding a segment, in record order: the net effect of a run of entry records
/// (each may overwrite the tail the ones before it wrote), or a snapshot record (kept whole in
/// the segment: it is read back from there).
#[derive(Debug, Clone, PartialEq)]
pub enum Part {
    /// Entry records (and hard-state-only ones): together they replace the log from `first`
    /// on with entries `first..end` of the terms in `runs`, and leave `hard_state`.
    Entries {
        /// The lowest index written (`first == end`: no entry, a hard state only).
        first: u64,
        /// One past the last entry left.
        end: u64,
        /// (first index, term) of each run of one term, ascending; the last goes on to `end`.
        runs: Vec<(u64, u64)>,
        /// The configuration change entries among them, whole (a few).
        conf: Vec<Entry>,
        /// The last hard state written among these records.
        hard_state: Option<HardState>,
    },
    /// A snapshot record at `pos`, `len` bytes (its length field included).
    Snapshot {
        /// Where it starts in the segment.
        pos: u64,
        /// Its length.
        len: u64,
    },
}

/// What the segment's records did to the sparse index of record starts
/// ([`super::log_read::LogPoints`]), replayed exactly: records that made a point, and the
/// records between them folded into one step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointStep {
    /// [`LogPoints::record`](super::log_read::LogPoints::record) of a record that made a point.
    Record {
        /// Its position.
        pos: u64,
        /// Its length.
        len: u64,
        /// Its first entry.
        first: u64,
        /// Its last entry.
        last: u64,
    },
    /// Records that made no point: `len` bytes, the last entry written `last` (0: none).
    Extend {
        /// Their bytes.
        len: u64,
        /// The last entry among them (0: none).
        last: u64,
    },
}

/// A closed segment's summary (see the module doc).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct SegmentSummary {
    /// The segment's length: the summary stands for exactly these bytes.
    pub len: u64,
    /// The highest entry index any record wrote (0: none).
    pub max_index: u64,
    /// The lowest entry index any record wrote (`u64::MAX`: none).
    pub min_index: u64,
    /// The fold's steps.
    pub parts: Vec<Part>,
    /// The index's steps.
    pub points: Vec<PointStep>,
}

/// Why a summary's bytes were refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SummaryError {
    /// Not a summary, or one of another version.
    #[error("not a segment summary")]
    Magic,
    /// The checksum does not match.
    #[error("a segment summary fails its checksum")]
    Checksum,
    /// The bytes end early, or say more than they hold.
    #[error("a segment summary is cut short or malformed")]
    Malformed,
}

/// `e` with its data and context in allocations of their own: a configuration change a summary
/// or a restart's spill keeps for as long as its segment is appended to (or for ever) must not
/// keep alive the whole segment buffer (up to 64 MiB) it was read in with.
pub(crate) fn detached(e: &Entry) -> Entry {
    let mut d = e.clone();
    d.data = bytes::Bytes::copy_from_slice(&e.data);
    d.context = bytes::Bytes::copy_from_slice(&e.context);
    d
}

/// Builds a segment's summary from its records as they are written (or read), in order.
#[derive(Debug, Clone)]
pub struct SummaryBuilder {
    summary: SegmentSummary,
    /// The index as it would be built over this segment alone (its decisions after the first
    /// record are the whole log's: see [`PointStep`]).
    points: super::log_read::LogPoints,
    /// A record broke the log's rules (a gap): no summary is given.
    broken: bool,
}

impl Default for SummaryBuilder {
    fn default() -> Self {
        SummaryBuilder::new()
    }
}

impl SummaryBuilder {
    /// A summary of an empty segment.
    pub fn new() -> SummaryBuilder {
        SummaryBuilder {
            summary: SegmentSummary { min_index: u64::MAX, ..SegmentSummary::default() },
            points: super::log_read::LogPoints::default(),
            broken: false,
        }
    }

    /// The record at `pos` of `len` bytes wrote `entries` (contiguous, ascending) and
    /// `hard_state`.
    pub fn record(&mut self, pos: u64, len: u64, entries: &[Entry], hard_state: Option<&HardState>) {
        self.summary.len = self.summary.len.max(pos.saturating_add(len));
        if !matches!(self.summary.parts.last(), Some(Part::Entries { .. })) {
            self.summary.parts.push(Part::Entries {
                first: 0,
                end: 0,
                runs: Vec::new(),
                conf: Vec::new(),
                hard_state: None,
            });
        }
        if let Some(Part::Entries { first, end, runs, conf, hard_state: hs }) = self.summary.parts.last_mut() {
            if let Some(a) = entries.first() {
                if *first == *end || a.index < *first {
                    // The first entries of this part, or a write below all of them: the part
                    // now replaces the log from here.
                    *first = a.index;
                    runs.clear();
                    conf.clear();
                } else if a.index > *end {
                    self.broken = true;
                } else {
                    runs.retain(|(start, _)| *start < a.index);
                    conf.retain(|e| e.index < a.index);
                }
                for e in entries {
                    if runs.last().is_none_or(|(_, t)| *t != e.term) {
                        runs.push((e.index, e.term));
                    }
                    if e.get_entry_type() == EntryType::EntryConfChange {
                        conf.push(detached(e));
                    }
                }
                *end = entries.last().map_or(a.index, |b| b.index).saturating_add(1);
            }
            if let Some(h) = hard_state {
                *hs = Some(h.clone());
            }
        }
        if let (Some(a), Some(b)) = (entries.first(), entries.last()) {
            self.summary.max_index = self.summary.max_index.max(b.index);
            self.summary.min_index = self.summary.min_index.min(a.index);
            if self.points.record(0, pos, len, a.index, b.index) {
                self.summary.points.push(PointStep::Record { pos, len, first: a.index, last: b.index });
            } else {
                self.extend(len, b.index);
            }
        } else {
            self.points.skip(len);
            self.extend(len, 0);
        }
    }

    /// The record at `pos` of `len` bytes is a snapshot.
    pub fn snapshot(&mut self, pos: u64, len: u64) {
        self.summary.len = self.summary.len.max(pos.saturating_add(len));
        self.summary.parts.push(Part::Snapshot { pos, len });
        self.points.skip(len);
        self.extend(len, 0);
    }

    fn extend(&mut self, len: u64, last: u64) {
        if let Some(PointStep::Extend { len: l, last: t }) = self.summary.points.last_mut() {
            *l += len;
            if last != 0 {
                *t = last;
            }
        } else {
            self.summary.points.push(PointStep::Extend { len, last });
        }
    }

    /// The summary (`None`: the records broke the log's rules, so the segment must be folded
    /// from its records).
    pub fn finish(self) -> Option<SegmentSummary> {
        (!self.broken).then_some(self.summary)
    }

    /// The last snapshot record written so far: (position, length).
    pub fn last_snapshot(&self) -> Option<(u64, u64)> {
        self.summary.snapshots().last()
    }

    /// The summary so far, as bytes (see [`SegmentSummary::encode`]).
    pub fn encode(&self) -> Option<Vec<u8>> {
        (!self.broken).then(|| self.summary.encode())
    }
}

impl SegmentSummary {
    /// The configuration changes it keeps, over its parts.
    #[cfg(test)]
    pub(crate) fn conf_entries(&self) -> Vec<&Entry> {
        self.parts
            .iter()
            .flat_map(|p| match p {
                Part::Entries { conf, .. } => conf.iter().collect(),
                Part::Snapshot { .. } => Vec::new(),
            })
            .collect()
    }

    /// The snapshot records it names: (position, length).
    pub fn snapshots(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.parts.iter().filter_map(|p| match p {
            Part::Snapshot { pos, len } => Some((*pos, *len)),
            Part::Entries { .. } => None,
        })
    }

    /// The bytes a driver writes beside the segment: `"FLXU"`, version, the fields as
    /// big-endian integers (conf entries and hard states as length + protobuf), CRC-32C of
    /// everything before it.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(64 + self.parts.len() * 48 + self.points.len() * 33);
        out.extend_from_slice(MAGIC);
        out.push(VERSION);
        let u64s = |out: &mut Vec<u8>, vs: &[u64]| vs.iter().for_each(|v| out.extend_from_slice(&v.to_be_bytes()));
        let msg = super::meta::put_message;
        u64s(&mut out, &[self.len, self.max_index, self.min_index]);
        out.extend_from_slice(&(self.parts.len() as u32).to_be_bytes());
        for p in &self.parts {
            match p {
                Part::Entries { first, end, runs, conf, hard_state } => {
                    out.push(1);
                    u64s(&mut out, &[*first, *end]);
                    out.extend_from_slice(&(runs.len() as u32).to_be_bytes());
                    for (i, t) in runs {
                        u64s(&mut out, &[*i, *t]);
                    }
                    out.extend_from_slice(&(conf.len() as u32).to_be_bytes());
                    for e in conf {
                        msg(&mut out, e);
                    }
                    match hard_state {
                        Some(h) => {
                            out.push(1);
                            msg(&mut out, h);
                        }
                        None => out.push(0),
                    }
                }
                Part::Snapshot { pos, len } => {
                    out.push(2);
                    u64s(&mut out, &[*pos, *len]);
                }
            }
        }
        out.extend_from_slice(&(self.points.len() as u32).to_be_bytes());
        for p in &self.points {
            match p {
                PointStep::Record { pos, len, first, last } => {
                    out.push(1);
                    u64s(&mut out, &[*pos, *len, *first, *last]);
                }
                PointStep::Extend { len, last } => {
                    out.push(2);
                    u64s(&mut out, &[*len, *last]);
                }
            }
        }
        let crc = crate::storage::crc32c(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    /// Reads [`encode`](Self::encode)'s bytes. Never panics; what a count claims is checked
    /// against the bytes left before anything is allocated for it.
    ///
    /// # Errors
    /// [`SummaryError`] for bytes that are not a whole, intact summary.
    pub fn decode(data: &[u8]) -> Result<SegmentSummary, SummaryError> {
        use protobuf::Message as _;
        if data.len() < 9 || &data[..4] != MAGIC || data[4] != VERSION {
            return Err(SummaryError::Magic);
        }
        let (body, crc) = data.split_at(data.len() - 4);
        if crate::storage::crc32c(body).to_be_bytes() != crc {
            return Err(SummaryError::Checksum);
        }
        let mut r = Reader { data: body, at: 5 };
        let (len, max_index, min_index) = (r.u64()?, r.u64()?, r.u64()?);
        let n = r.count(17)?;
        let mut parts = Vec::with_capacity(n);
        for _ in 0..n {
            match r.u8()? {
                1 => {
                    let (first, end) = (r.u64()?, r.u64()?);
                    let runs = (0..r.count(16)?).map(|_| Ok((r.u64()?, r.u64()?))).collect::<Result<Vec<_>, _>>()?;
                    let conf = (0..r.count(4)?)
                        .map(|_| Entry::parse_from_bytes(r.bytes()?).map_err(|_| SummaryError::Malformed))
                        .collect::<Result<Vec<_>, _>>()?;
                    let hard_state = match r.u8()? {
                        0 => None,
                        1 => Some(HardState::parse_from_bytes(r.bytes()?).map_err(|_| SummaryError::Malformed)?),
                        _ => return Err(SummaryError::Malformed),
                    };
                    if end < first {
                        return Err(SummaryError::Malformed);
                    }
                    parts.push(Part::Entries { first, end, runs, conf, hard_state });
                }
                2 => parts.push(Part::Snapshot { pos: r.u64()?, len: r.u64()? }),
                _ => return Err(SummaryError::Malformed),
            }
        }
        let n = r.count(17)?;
        let mut points = Vec::with_capacity(n);
        for _ in 0..n {
            points.push(match r.u8()? {
                1 => PointStep::Record { pos: r.u64()?, len: r.u64()?, first: r.u64()?, last: r.u64()? },
                2 => PointStep::Extend { len: r.u64()?, last: r.u64()? },
                _ => return Err(SummaryError::Malformed),
            });
        }
        if r.at != body.len() {
            return Err(SummaryError::Malformed);
        }
        Ok(SegmentSummary { len, max_index, min_index, parts, points })
    }
}

struct Reader<'a> {
    data: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], SummaryError> {
        let b = self.data.get(self.at..self.at.saturating_add(n)).ok_or(SummaryError::Malformed)?;
        self.at += n;
        Ok(b)
    }

    fn u8(&mut self) -> Result<u8, SummaryError> {
        Ok(self.take(1)?[0])
    }

    fn u32(&mut self) -> Result<u32, SummaryError> {
        let b = self.take(4)?;
        Ok(u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, SummaryError> {
        let b = self.take(8)?;
        let mut w = [0; 8];
        w.copy_from_slice(b);
        Ok(u64::from_be_bytes(w))
    }

    /// A count of items of at least `min` bytes each, no more than the bytes left can hold.
    fn count(&mut self, min: usize) -> Result<usize, SummaryError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min) > self.data.len() - self.at {
            return Err(SummaryError::Malformed);
        }
        Ok(n)
    }

    fn bytes(&mut self) -> Result<&'a [u8], SummaryError> {
        let n = self.u32()? as usize;
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entries(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<Entry> {
        range.map(|i| Entry { index: i, term, data: vec![1; 10].into(), ..Entry::default() }).collect()
    }

    /// Overwrites within the segment leave the net runs; a write below the part's start
    /// restarts it; the bytes round-trip; any change to them is refused, never a panic.
    #[test]
    fn a_summary_keeps_the_net_effect_of_its_records_and_refuses_damaged_bytes() {
        let hs = HardState { term: 3, vote: 2, commit: 14, ..HardState::default() };
        let mut b = SummaryBuilder::new();
        b.record(0, 50, &[], Some(&hs));
        b.record(50, 100, &entries(10..=20, 2), None);
        b.record(150, 100, &entries(15..=18, 3), Some(&hs));
        b.snapshot(250, 40);
        b.record(290, 10, &entries(19..=19, 3), None);
        let s = b.finish().expect("a whole summary");
        assert_eq!(s.len, 300);
        assert_eq!((s.min_index, s.max_index), (10, 20));
        assert_eq!(
            s.parts[0],
            Part::Entries { first: 10, end: 19, runs: vec![(10, 2), (15, 3)], conf: vec![], hard_state: Some(hs) }
        );
        assert_eq!(s.parts[1], Part::Snapshot { pos: 250, len: 40 });
        assert_eq!(s.snapshots().collect::<Vec<_>>(), vec![(250, 40)]);
        let bytes = s.encode();
        assert_eq!(SegmentSummary::decode(&bytes), Ok(s.clone()));
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(SegmentSummary::decode(&bad).is_err(), "a flipped byte {i} was taken");
            assert!(SegmentSummary::decode(&bytes[..i]).is_err(), "a cut at {i} was taken");
        }
        // A gap is not a log: no summary.
        let mut b = SummaryBuilder::new();
        b.record(0, 10, &entries(1..=2, 1), None);
        b.record(10, 10, &entries(5..=6, 1), None);
        assert!(b.finish().is_none());
    }

    use crate::cluster::meta::{LogFold, RaftLog, Snapshot, encode_log_record, encode_snapshot_record};
    use proptest::prelude::*;

    /// A replica log written the way a driver writes one, in segments, with a summary built
    /// of each as it is written: appends, overwrites of the uncommitted tail by a newer term,
    /// hard states, configuration changes, snapshots at committed entries, segment rolls that
    /// repeat the hard state at the head of the next.
    fn written(seed: u64) -> (Vec<Vec<u8>>, Vec<SegmentSummary>) {
        use protobuf::Message as _;
        let mut x = seed | 1;
        let mut rnd = move |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % n.max(1)
        };
        let (mut segs, mut sums) = (vec![Vec::new()], Vec::new());
        let mut b = SummaryBuilder::new();
        let mut terms: Vec<u64> = vec![0]; // terms[i]: entry i's (index 0 unused)
        let (mut term, mut commit, mut snap) = (1u64, 0u64, 0u64);
        let mut hs = None;
        for _ in 0..20 + rnd(200) {
            let cur = segs.last_mut().expect("one segment at least");
            let pos = cur.len() as u64;
            match rnd(12) {
                0..=6 => {
                    let last = terms.len() as u64 - 1;
                    let start = if last > commit && rnd(4) == 0 {
                        term += 1;
                        commit + 1 + rnd(last - commit)
                    } else {
                        last + 1
                    };
                    terms.truncate(start as usize);
                    let es: Vec<Entry> = (start..start + 1 + rnd(5))
                        .map(|index| {
                            let mut e = Entry {
                                index,
                                term,
                                data: vec![index as u8; rnd(40) as usize].into(),
                                ..Entry::default()
                            };
                            if rnd(15) == 0 {
                                let mut cc = raft::eraftpb::ConfChange::default();
                                cc.set_node_id(1 + rnd(5));
                                e.set_entry_type(EntryType::EntryConfChange);
                                e.data = cc.write_to_bytes().unwrap_or_default().into();
                            }
                            terms.push(term);
                            e
                        })
                        .collect();
                    let last = terms.len() as u64 - 1;
                    if rnd(2) == 0 {
                        commit = commit.max(commit + rnd(last - commit + 1));
                        hs = Some(HardState { term, vote: 1, commit, ..HardState::default() });
                    }
                    let h = if rnd(2) == 0 { hs.clone() } else { None };
                    let r = encode_log_record(&es, h.as_ref());
                    b.record(pos, r.len() as u64, &es, h.as_ref());
                    cur.extend_from_slice(&r);
                }
                7 | 8 => {
                    let last = terms.len() as u64 - 1;
                    commit = commit.max(commit + rnd(last - commit + 1));
                    let h = HardState { term, vote: 1, commit, ..HardState::default() };
                    let r = encode_log_record(&[], Some(&h));
                    b.record(pos, r.len() as u64, &[], Some(&h));
                    cur.extend_from_slice(&r);
                    hs = Some(h);
                }
                9 if commit > snap => {
                    snap += 1 + rnd(commit - snap);
                    let mut s = Snapshot::default();
                    s.mut_metadata().index = snap;
                    s.mut_metadata().term = terms[snap as usize];
                    s.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
                    s.set_data(b"state".to_vec().into());
                    let r = encode_snapshot_record(&s);
                    b.snapshot(pos, r.len() as u64);
                    cur.extend_from_slice(&r);
                }
                _ => {
                    sums.push(std::mem::take(&mut b).finish().expect("a log's records"));
                    let mut next = Vec::new();
                    if let Some(h) = &hs {
                        next = encode_log_record(&[], Some(h));
                        b.record(0, next.len() as u64, &[], Some(h));
                    }
                    segs.push(next);
                }
            }
        }
        sums.push(b.finish().expect("a log's records"));
        (segs, sums)
    }

    fn floor(segs: &[Vec<u8>]) -> u64 {
        segs.iter().map(|s| LogFold::snapshot_floor(s)).max().unwrap_or(0)
    }

    fn entry_terms(log: &RaftLog) -> Vec<(u64, u64)> {
        let spill = log.spill.iter().flat_map(|s| (s.first()..s.end()).map(|i| (i, s.term(i).unwrap_or(0))));
        spill.chain(log.entries.iter().map(|e| (e.index, e.term))).collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2_000, ..ProptestConfig::default() })]

        /// Folding the closed segments from their summaries (where the fold takes them) gives
        /// what folding every record gives: the hard state, snapshot, voters, every entry's
        /// term, the segments' lengths and the index of record starts; the summaries the fold
        /// builds are the ones built as the records were written; and nothing uncommitted is
        /// left on disk.
        #[test]
        fn a_fold_from_summaries_is_the_fold_from_records(seed in any::<u64>(), keep in 0u64..400) {
            let (segs, sums) = written(seed);
            let n = segs.len();
            let mut whole = LogFold::new(floor(&segs), Some(keep));
            for (i, s) in segs.iter().enumerate() {
                let ok = whole.feed(s, None, i + 1 == n);
                prop_assert!(ok, "{:?}", whole.damage());
            }
            let built: Vec<_> = whole.take_builders().into_iter().map(|b| b.and_then(SummaryBuilder::finish)).collect();
            prop_assert_eq!(built, sums.iter().cloned().map(Some).collect::<Vec<_>>());
            let (a, a_infos, a_damage, a_points) = whole.finish();
            prop_assert!(a_damage.is_none());
            let mut fast = LogFold::new(floor(&segs), Some(keep));
            for (i, (s, sum)) in segs.iter().zip(&sums).enumerate() {
                let snaps: Vec<bytes::Bytes> =
                    sum.snapshots().map(|(p, l)| bytes::Bytes::copy_from_slice(&s[p as usize..(p + l) as usize])).collect();
                let last = i + 1 == n;
                if last || !fast.feed_summary(sum, &snaps, LogFold::last_commit(&segs[n - 1])) {
                    prop_assert!(fast.feed(s, None, last));
                }
            }
            let (b, b_infos, b_damage, b_points) = fast.finish();
            prop_assert!(b_damage.is_none());
            prop_assert_eq!(&a.hard_state, &b.hard_state);
            prop_assert_eq!(&a.snapshot, &b.snapshot);
            prop_assert_eq!(a.voters(), b.voters());
            prop_assert_eq!(entry_terms(&a), entry_terms(&b));
            prop_assert_eq!(a_infos, b_infos);
            prop_assert_eq!(a_points, b_points);
            if let Some(sp) = &b.spill {
                prop_assert!(sp.end() - 1 <= b.hard_state.commit);
            }
        }
    }

    /// Summaries are taken: over many written logs, most closed segments fold from theirs.
    #[test]
    fn most_closed_segments_fold_from_their_summary() {
        let (mut closed, mut taken) = (0, 0);
        for seed in 0..300 {
            let (segs, sums) = written(seed * 7919 + 1);
            let mut fold = LogFold::new(floor(&segs), Some(0));
            for (i, (s, sum)) in segs.iter().zip(&sums).enumerate() {
                let snaps: Vec<bytes::Bytes> = sum
                    .snapshots()
                    .map(|(p, l)| bytes::Bytes::copy_from_slice(&s[p as usize..(p + l) as usize]))
                    .collect();
                if i + 1 < segs.len() && sum.min_index > floor(&segs) && sum.min_index != u64::MAX {
                    closed += 1;
                    if fold.feed_summary(sum, &snaps, LogFold::last_commit(segs.last().expect("one"))) {
                        taken += 1;
                        continue;
                    }
                }
                assert!(fold.feed(s, None, i + 1 == segs.len()));
            }
        }
        assert!(closed > 500 && taken * 2 > closed, "{taken} of {closed} closed segments folded from a summary");
    }
}
