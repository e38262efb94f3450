//! A member's log as kept across a crash ([`RaftLog`]): its records on disk (entries, hard
//! state, snapshots; checksummed), folding segment files back into a log, and the damage a fold
//! finds ([`LogDamage`]).

use super::store::ENTRY_OVERHEAD;
use super::*;

// Snapshot records (written whole or piece by piece, read back whole or a piece at a time):
// a child of this module in a file of its own.
#[path = "meta/snapshot_record.rs"]
mod snapshot_record;
pub use snapshot_record::*;
use snapshot_record::{decode_snapshot_record, snapshot_record_index};

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
    /// The end of `snapshot`'s data that a restart left on disk (the host's state, which the
    /// host reads back in pieces from the kept record rather than holding it twice at once:
    /// the data in hand and the state built from it). `snapshot`'s data then holds only the
    /// group's own state. `None`: the data is whole.
    pub snapshot_rest_on_disk: Option<RestOnDisk>,
}

/// The end of a kept snapshot's data left on disk ([`RaftLog::snapshot_rest_on_disk`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestOnDisk {
    /// Its length (it runs to the end of the data).
    pub len: u64,
    /// Whether it holds a stream's commit state (which an older replica cannot read: D63).
    pub holds_commits: bool,
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
        RaftLog { entries, hard_state, snapshot: None, spill: None, snapshot_rest_on_disk: None }
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
        self.snapshot_rest_on_disk = None;
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
        Ok(RaftLog { entries, hard_state, snapshot: None, spill: None, snapshot_rest_on_disk: None })
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

/// Ends a record begun at `start` of `out` with 4 placeholder bytes: the CRC-32C of its part
/// from `part` on, then its length in front.
pub(super) fn seal_record_at(out: &mut Vec<u8>, start: usize, part: usize) {
    let crc = crate::storage::crc32c(&out[part..]);
    out.extend_from_slice(&crc.to_be_bytes());
    let len = (out.len() - start - 4) as u32;
    out[start..start + 4].copy_from_slice(&len.to_be_bytes());
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
        2 => decode_snapshot_record(&body[1..], buffer).map(Ok).ok_or(()),
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
/// ([`crate::cluster::log_read::LogPoints`], segments numbered from 0 in the order given): what a driver
/// reads entries back with once they left memory. Never panics.
pub fn fold_log_segments_indexed(
    segments: &[&[u8]],
) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, crate::cluster::log_read::LogPoints) {
    fold_segments(segments, None)
}

/// [`fold_log_segments_indexed`] over segments read into shared buffers: the entries' data are
/// slices of them, not copies (a restart holds the log once; a segment's buffer goes whole once
/// its entries left memory). Never panics.
pub fn fold_log_segments_shared(
    segments: &[bytes::Bytes],
) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, crate::cluster::log_read::LogPoints) {
    let views: Vec<&[u8]> = segments.iter().map(|b| b.as_ref()).collect();
    fold_segments(&views, Some(segments))
}

fn fold_segments(
    segments: &[&[u8]],
    buffers: Option<&[bytes::Bytes]>,
) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, crate::cluster::log_read::LogPoints) {
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
    points: crate::cluster::log_read::LogPoints,
    /// A summary of each segment folded from its records (`None` for one folded from its
    /// summary): what a driver writes beside a closed segment that has none, and goes on
    /// building for the last one as it appends.
    builders: Vec<Option<SummaryBuilder>>,
}

use crate::cluster::segment_summary::{Part, PointStep, SegmentSummary, SummaryBuilder};

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
                && let Some(index) = snapshot_record_index(&body[1..])
            {
                floor = floor.max(index);
            }
            at = end;
        }
        floor
    }

    /// [`snapshot_floor`](Self::snapshot_floor) by parsing each snapshot whole (what it did
    /// before it read indexes alone): the fuzzer checks the two agree on any bytes.
    #[cfg(any(test, feature = "testkit"))]
    pub fn snapshot_floor_parsed(data: &[u8]) -> u64 {
        let mut floor = 0;
        let mut at = 0;
        while let RecordAt::Whole(end, body) = record_at(data, at) {
            if body[0] == 2
                && let Some(snap) = decode_snapshot_record(&body[1..], None)
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
            points: crate::cluster::log_read::LogPoints::default(),
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
    /// snapshot records it names, read from the segment, in order; the snapshot kept shares
    /// its record's memory), when that is the same as
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
    pub fn feed_summary(&mut self, summary: &SegmentSummary, snapshots: &[bytes::Bytes], commit: u64) -> bool {
        if self.damage.is_some() || self.keep.is_none() {
            return false;
        }
        if summary.min_index != u64::MAX && summary.min_index <= self.floor {
            return false;
        }
        let mut snaps = Vec::new();
        for (record, (_, len)) in snapshots.iter().zip(summary.snapshots()) {
            match record_at(record, 0) {
                RecordAt::Whole(end, body) if end as u64 == len && body[0] == 2 => {
                    // Its data shares the record's buffer (a cache's size: not copied again).
                    match decode_snapshot_record(&body[1..], Some(record)) {
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
    pub fn finish(self) -> (RaftLog, Vec<SegmentInfo>, Option<LogDamage>, crate::cluster::log_read::LogPoints) {
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

#[cfg(test)]
#[path = "meta/log_tests.rs"]
mod tests;
