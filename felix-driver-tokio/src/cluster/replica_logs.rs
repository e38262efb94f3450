//! The replicated shards' logs on disk: segment files per shard, appended (synced before
//! answering by default), read back by jobs off the broker task, snapshots written in pieces.

use super::*;

/// Writes one record's pieces, in order, to the sink it is given.
type RecordWriter<'a> = dyn FnMut(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> + 'a;

/// The most bytes of a snapshot's small pieces gathered into one write.
const SNAPSHOT_WRITE_BYTES: usize = 1 << 20;

/// Where a broker keeps the Raft logs of its replicas of replicated shards: append-only
/// segment files per shard under `DATA_DIR/cluster/replicas/`. A shard's files *are* its
/// records (the stream's log): nothing else is written for a replicated shard. Appends go to
/// the page cache at once, on the broker task. By default (`sync_every` `None`) they reach the
/// disk before anything that depends on them is carried out: the broker task holds every
/// output after an append until [`take_unsynced`](Self::take_unsynced)'s files were synced off
/// the task (group commit: one `fdatasync` per written file for every append since the last
/// sync, whatever the number of shards). A vote, an append response or the leader's own count
/// toward a commit is never made of bytes a power cut can take back. With a lazy policy
/// (`sync_every` `Some`, chosen explicitly) they are synced on that interval instead. A segment
/// is closed at [`SEGMENT_BYTES`]; once a snapshot covers every entry of a closed segment
/// (retention dropped those records), the segment is deleted, so disk use follows retention.
pub(crate) struct ReplicaLogs {
    pub(super) dir: Option<std::path::PathBuf>,
    pub(super) shards: std::collections::BTreeMap<ShardId, ShardFiles>,
    pub(super) dirty: std::collections::BTreeSet<ShardId>,
    pub(super) sync_every: Option<std::time::Duration>,
    pub(super) last_sync: std::time::Instant,
    /// Write failures (logged; the replica's peers carry on with a majority).
    pub(crate) failures: u64,
    /// [`SEGMENT_BYTES`] (tests make it small).
    pub(super) segment_bytes: u64,
    /// The buffer records are encoded into.
    pub(super) scratch: Vec<u8>,
}

/// What [`ReplicaLogs::open`] read back.
pub(crate) struct OpenedReplicaLogs {
    /// The logs, to append to.
    pub(crate) logs: ReplicaLogs,
    /// Every intact replica's log.
    pub(crate) kept: std::collections::BTreeMap<ShardId, felix_proto::cluster::meta::RaftLog>,
    /// Replicas whose log was found damaged (and set aside), and why.
    pub(crate) damaged: std::collections::BTreeMap<ShardId, String>,
    /// Closed segments folded from their summaries rather than their records (the tests'
    /// view; the broker logs it with the summary line).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) summarised: usize,
}

/// Bytes after which a replica's segment is closed and a new one started.
pub(crate) const SEGMENT_BYTES: u64 = 64 << 20;

/// One shard's segments.
#[derive(Default)]
pub(super) struct ShardFiles {
    /// (sequence, highest entry index in it), oldest first; the last is appended to.
    pub(super) segments: Vec<(u64, u64)>,
    /// The last segment, open for appending (shared with the sync thread).
    pub(super) file: Option<Arc<std::fs::File>>,
    /// Its length.
    pub(super) len: u64,
    /// The last hard state written (repeated at the head of every new segment, so deleting
    /// old segments never loses it).
    pub(super) hard_state: Option<felix_proto::cluster::meta::HardState>,
    /// Where its records start (sparse): how entries that left the replica's memory are read
    /// back ([`ReplicaLogs::read_job`]).
    pub(super) points: felix_proto::cluster::log_read::LogPoints,
    /// The summary of the last segment so far, written beside it when it is closed (`None`
    /// once an append failed: what the file holds is then unknown).
    pub(super) summary: Option<felix_proto::cluster::segment_summary::SummaryBuilder>,
    /// Where the last snapshot record is: (segment, position, length). A replica keeps its
    /// snapshot's data here only ([`ReplicaLogs::snapshot_job`]).
    pub(super) snapshot: Option<(u64, u64, u64)>,
}

/// A read of a replica's last snapshot record, run off the broker's task
/// ([`ReplicaSnapshotRead::run`]).
pub(crate) struct ReplicaSnapshotRead {
    pub(super) path: std::path::PathBuf,
    pub(super) pos: u64,
    pub(super) len: u64,
    pub(super) index: u64,
    pub(super) offset: u64,
    pub(super) max: u64,
    pub(super) verify: bool,
}

impl ReplicaSnapshotRead {
    /// Reads the piece from the record where it lies, the rest of the record unread (its CRC
    /// streamed through a bounded buffer first when `verify`).
    pub(crate) fn run(self) -> Result<felix_proto::cluster::meta::SnapshotPiece, String> {
        use std::os::unix::fs::FileExt;
        let at = |e: &dyn std::fmt::Display| format!("{}, record at byte {}: {e}", self.path.display(), self.pos);
        let f = std::fs::File::open(&self.path).map_err(|e| at(&e))?;
        let pos = self.pos;
        let mut read_at = |rel: u64, buf: &mut [u8]| f.read_exact_at(buf, pos + rel);
        felix_proto::cluster::meta::read_snapshot_record_piece(
            &mut read_at,
            self.len,
            self.index,
            self.offset,
            self.max,
            self.verify,
        )
        .map_err(|e| at(&e))
    }
}

/// A read of entries of one replica's log, run off the broker's task
/// ([`ReplicaLogRead::run`]): from a point of its index, record by record, until it holds what
/// was asked for and nothing after can rewrite it.
pub(crate) struct ReplicaLogRead {
    pub(super) dir: std::path::PathBuf,
    pub(super) shard: ShardId,
    /// The segments from the one the read starts in, oldest first.
    pub(super) segments: Vec<u64>,
    pub(super) start: felix_proto::cluster::log_read::Point,
    /// The points after the start, up to the first past the range.
    pub(super) after: Vec<felix_proto::cluster::log_read::Point>,
    pub(super) low: u64,
    pub(super) high: u64,
    pub(super) max_bytes: u64,
}

impl ReplicaLogRead {
    /// Reads the entries. A segment deleted meanwhile (a compaction) ends the read with what
    /// was found; other errors are returned.
    pub(crate) fn run(self) -> Result<Vec<felix_proto::cluster::meta::Entry>, String> {
        use felix_proto::cluster::log_read::EntryCollector;
        use std::io::{BufRead, Read, Seek, SeekFrom};
        let mut c = EntryCollector::new(self.low, self.high, self.max_bytes);
        let mut next = self.after.iter().peekable();
        let mut record = Vec::new();
        let last_segment = self.segments.last().copied();
        let last_segment = last_segment.as_ref();
        'segments: for seq in self.segments {
            let path = self.dir.join(replica_file_name(&self.shard, seq));
            let file = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) => return Err(format!("{}: {e}", path.display())),
            };
            let mut r = std::io::BufReader::with_capacity(256 << 10, file);
            let mut at = if seq == self.start.segment { self.start.pos } else { 0 };
            r.seek(SeekFrom::Start(at)).map_err(|e| format!("{}: {e}", path.display()))?;
            loop {
                while next.peek().is_some_and(|p| (p.segment, p.pos) < (seq, at)) {
                    next.next();
                }
                if next.peek().is_some_and(|p| (p.segment, p.pos) == (seq, at)) && c.done(next.peek().copied()) {
                    break 'segments;
                }
                let mut len = [0u8; 4];
                if r.read_exact(&mut len).is_err() {
                    break; // the end of this segment (a torn tail is never read: it is past what was asked)
                }
                let n = u32::from_be_bytes(len) as usize;
                // A snapshot record (flag 2) holds no entries: stepped over unread. Read, a
                // stream's commit state or a cache's values came into memory twice (the record,
                // then its decoding) for every read of entries that passed it: a follower
                // catching up after a compaction.
                if n > 0 && r.fill_buf().map_err(|e| format!("{}: {e}", path.display()))?.first() == Some(&2) {
                    if r.seek_relative(n as i64).is_err() {
                        break;
                    }
                    at += 4 + n as u64;
                    continue;
                }
                record.clear();
                record.extend_from_slice(&len);
                record.resize(4 + n, 0);
                if r.read_exact(&mut record[4..]).is_err() {
                    break;
                }
                match felix_proto::cluster::meta::read_log_record(&record, 0) {
                    Some((_, Some(part))) => c.feed(part),
                    Some((_, None)) if record.get(4) == Some(&2) => {} // a snapshot
                    // In the segment being appended to, the record being written (a read runs
                    // beside the appends): the end of what there is to read.
                    _ if Some(&seq) == last_segment => break,
                    // A whole record of a closed segment that fails its checksum: the restart
                    // that folded this segment from its summary did not read it (see
                    // `ReplicaLogs::open`).
                    _ => {
                        let _ = std::fs::remove_file(self.dir.join(summary_file_name(&self.shard, seq)));
                        return Err(format!(
                            "{}, byte {at}: {DAMAGED_RECORD}: a record fails its checksum. The segment's summary \
                             was removed: the next start reads the segment whole, finds the damage, sets the log \
                             aside and has this replica rejoin its group afresh",
                            path.display()
                        ));
                    }
                }
                at += 4 + n as u64;
            }
        }
        Ok(c.finish())
    }
}

/// What a read error says when a record read back is damaged (see [`ReplicaLogRead::run`]).
pub(crate) const DAMAGED_RECORD: &str = "damaged replica log";

/// A shard's segment file name: sequence 0 is `KIND~tenant~ns~name~shard.log` (the name a
/// replica's single file had before segments), later ones add `~SEQUENCE`.
pub(super) fn replica_file_name(s: &ShardId, seq: u64) -> String {
    use felix_proto::storage::path_component as pc;
    let kind = if s.kind == Kind::Cache { "cache" } else { "stream" };
    let base = format!("{kind}~{}~{}~{}~{}", pc(&s.tenant), pc(&s.namespace), pc(&s.name), s.shard);
    if seq == 0 { format!("{base}.log") } else { format!("{base}~{seq:020}.log") }
}

pub(super) fn parse_replica_file_name(n: &str) -> Option<(ShardId, u64)> {
    use felix_proto::storage::parse_path_component as pc;
    let n = n.strip_suffix(".log")?;
    let parts: Vec<&str> = n.split('~').collect();
    let (kind, t, ns, name, shard, seq) = match parts.as_slice() {
        [kind, t, ns, name, shard] => (kind, t, ns, name, shard, 0),
        [kind, t, ns, name, shard, seq] if seq.len() == 20 => (kind, t, ns, name, shard, seq.parse().ok()?),
        _ => return None,
    };
    let kind = match *kind {
        "stream" => Kind::Stream,
        "cache" => Kind::Cache,
        _ => return None,
    };
    Some((ShardId { kind, tenant: pc(t)?, namespace: pc(ns)?, name: pc(name)?, shard: shard.parse().ok()? }, seq))
}

impl ReplicaLogs {
    /// Appends a replica's persisted state. Synced at once when the policy says `always`.
    ///
    /// # Errors
    /// The write's error: the replica must stop (it cannot vouch for what it did not keep).
    pub(crate) fn persist(
        &mut self,
        shard: &ShardId,
        entries: &[felix_proto::cluster::meta::Entry],
        hard_state: Option<&felix_proto::cluster::meta::HardState>,
    ) -> std::io::Result<()> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(());
        }
        // Into the one reused buffer: no fresh allocation (faulted in and zeroed) per write.
        let mut record = std::mem::take(&mut self.scratch);
        record.clear();
        felix_proto::cluster::meta::encode_log_record_into(&mut record, entries, hard_state);
        let max = entries.last().map_or(0, |e| e.index);
        let r = self.append(shard, &[&record], max);
        let len = record.len() as u64;
        self.scratch = record;
        let (seq, pos) = r?;
        if let Some(f) = self.shards.get_mut(shard) {
            if let Some(b) = &mut f.summary {
                b.record(pos, len, entries, hard_state);
            }
            if let Some(hs) = hard_state {
                f.hard_state = Some(hs.clone());
            }
            match (entries.first(), entries.last()) {
                (Some(a), Some(b)) => {
                    f.points.record(seq, pos, len, a.index, b.index);
                }
                _ => f.points.skip(len),
            }
        }
        Ok(())
    }

    /// A read of entries `low..high` of the shard's log (about `max_bytes`), to run off the
    /// task; `None` when nothing is kept for it (no data directory, an unknown shard).
    pub(crate) fn read_job(&self, shard: &ShardId, low: u64, high: u64, max_bytes: u64) -> Option<ReplicaLogRead> {
        let dir = self.dir.clone()?;
        let f = self.shards.get(shard)?;
        let (start, after) = f.points.plan(low, high)?;
        let segments = f.segments.iter().map(|(s, _)| *s).filter(|s| *s >= start.segment).collect();
        Some(ReplicaLogRead { dir, shard: shard.clone(), segments, start, after, low, high, max_bytes })
    }

    /// A read of bytes `offset..offset + max` of the data of the shard's last snapshot record
    /// (which must be the snapshot at `index`), to run off the task; `None` when none is kept
    /// (no data directory, an unknown shard, no snapshot).
    pub(crate) fn snapshot_piece_job(
        &self,
        shard: &ShardId,
        index: u64,
        offset: u64,
        max: u64,
        verify: bool,
    ) -> Option<ReplicaSnapshotRead> {
        let dir = self.dir.as_ref()?;
        let (seq, pos, len) = self.shards.get(shard)?.snapshot?;
        let path = dir.join(replica_file_name(shard, seq));
        Some(ReplicaSnapshotRead { path, pos, len, index, offset, max, verify })
    }

    /// Appends a snapshot of a replica's log, then deletes the closed segments it made useless
    /// (every entry in them below its index: the one holding the entry at its index stays, see below).
    ///
    /// # Errors
    /// As [`persist`](Self::persist).
    pub(crate) fn persist_snapshot(
        &mut self,
        shard: &ShardId,
        snapshot: &felix_proto::cluster::meta::Snapshot,
        rest: Option<&felix_proto::cluster::replica::SnapshotRest>,
    ) -> std::io::Result<()> {
        // In pieces: the snapshot's data (a cache's size) is written from where it is, and
        // a host's part still unencoded (a stream's commit state) is encoded as it is written.
        let record_len = felix_proto::cluster::meta::snapshot_record_len(snapshot, rest.map_or(0, |r| r.len()));
        let (seq, pos) = self.append_with(shard, record_len, 0, &mut |sink| {
            let rest_len = rest.map_or(0, |r| r.len());
            let pieces = |each: &mut dyn FnMut(&[u8])| {
                if let Some(r) = rest {
                    r.pieces(each)
                }
            };
            // A commit state comes in pieces of a few bytes (each value's header) between its
            // values: gathered into writes of up to 1 MiB, a large piece written from where it is.
            let mut buf: Vec<u8> = Vec::new();
            let mut gathered = |piece: &[u8]| -> std::io::Result<()> {
                let large = piece.len() >= SNAPSHOT_WRITE_BYTES / 4;
                if !buf.is_empty() && (large || buf.len() + piece.len() > SNAPSHOT_WRITE_BYTES) {
                    sink(&buf)?;
                    buf.clear();
                }
                if large {
                    return sink(piece);
                }
                buf.extend_from_slice(piece);
                Ok(())
            };
            felix_proto::cluster::meta::write_snapshot_record(snapshot, rest_len, &pieces, &mut gathered)?;
            if buf.is_empty() { Ok(()) } else { sink(&buf) }
        })?;
        let index = snapshot.get_metadata().index;
        let (Some(dir), Some(f)) = (&self.dir, self.shards.get_mut(shard)) else { return Ok(()) };
        f.snapshot = Some((seq, pos, record_len));
        f.points.skip(record_len);
        if let Some(b) = &mut f.summary {
            b.snapshot(pos, record_len);
        }
        let current = f.segments.last().map(|(s, _)| *s);
        let mut deleted = Vec::new();
        f.segments.retain(|(seq, max)| {
            // Strictly below: the segment holding the entry at the snapshot's index stays, so a
            // restart's fold finds that entry and keeps the entries after it (a snapshot whose
            // entry is missing reads as one that replaced a log that did not match).
            let useless = Some(*seq) != current && *max < index;
            if useless {
                deleted.push(*seq);
            }
            !useless
        });
        let kept: Vec<u64> = f.segments.iter().map(|(s, _)| *s).collect();
        f.points.retain_segments(|s| kept.contains(&s));
        for seq in deleted {
            if let Err(e) = std::fs::remove_file(dir.join(replica_file_name(shard, seq))) {
                tracing::warn!("removing a compacted segment of {shard:?}'s replica log: {e}");
            }
            let _ = std::fs::remove_file(dir.join(summary_file_name(shard, seq)));
        }
        Ok(())
    }

    /// Appends one record, given in pieces written one after the other, to the shard's last
    /// segment (a new one past [`SEGMENT_BYTES`]); returns the segment and the position it was
    /// written at.
    pub(super) fn append(&mut self, shard: &ShardId, pieces: &[&[u8]], max_index: u64) -> std::io::Result<(u64, u64)> {
        let len = pieces.iter().map(|p| p.len() as u64).sum();
        self.append_with(shard, len, max_index, &mut |sink| {
            for piece in pieces {
                sink(piece)?;
            }
            Ok(())
        })
    }

    /// [`append`](Self::append) of a record of `len` bytes that `write` hands to the sink it
    /// is given, piece by piece (written as they come); a record that comes out of another
    /// length is an error (and torn: cut at the next start).
    pub(super) fn append_with(
        &mut self,
        shard: &ShardId,
        len: u64,
        max_index: u64,
        write: &mut RecordWriter<'_>,
    ) -> std::io::Result<(u64, u64)> {
        use std::io::Write;
        let Some(dir) = self.dir.clone() else { return Ok((0, 0)) };
        let segment_bytes = self.segment_bytes;
        let f = self.shards.entry(shard.clone()).or_default();
        let r = (|| -> std::io::Result<(u64, u64)> {
            if f.file.is_some() && f.len >= segment_bytes {
                // Closed: made durable now (it is not appended to again), and the next one
                // starts with the hard state.
                if let Some(file) = f.file.take() {
                    let seq = f.segments.last().map_or(0, |(s, _)| *s);
                    let path = dir.join(replica_file_name(shard, seq));
                    UnsyncedFile { shard: shard.clone(), path, len: f.len, file }.sync()?;
                    // Its summary, for a restart to read instead of its records.
                    if let Some(b) = f.summary.take().and_then(|b| b.encode())
                        && let Err(e) = write_summary(&dir, shard, seq, &b)
                    {
                        tracing::warn!("writing the summary of {shard:?}'s replica log segment {seq}: {e}");
                    }
                }
                let seq = f.segments.last().map_or(0, |(s, _)| s + 1);
                f.segments.push((seq, 0));
                f.len = 0;
                let file = open_segment(&dir, shard, seq)?;
                let mut summary = felix_proto::cluster::segment_summary::SummaryBuilder::new();
                if let Some(hs) = &f.hard_state {
                    let head = felix_proto::cluster::meta::encode_log_record(&[], Some(hs));
                    (&*file).write_all(&head)?;
                    summary.record(0, head.len() as u64, &[], Some(hs));
                    f.len += head.len() as u64;
                }
                f.summary = Some(summary);
                f.file = Some(file);
            }
            if f.file.is_none() {
                if f.segments.is_empty() {
                    f.segments.push((0, 0));
                    f.summary = Some(felix_proto::cluster::segment_summary::SummaryBuilder::new());
                }
                let seq = f.segments.last().map_or(0, |(s, _)| *s);
                f.file = Some(open_segment(&dir, shard, seq)?);
            }
            let file = f.file.as_ref().expect("opened above");
            let declared = usize::try_from(len)
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a record past the address space"))?;
            felix_driver_common::sync_journal::before_append(declared)?;
            let mut written = 0u64;
            write(&mut |piece: &[u8]| {
                written += piece.len() as u64;
                (&**file).write_all(piece)
            })?;
            if written != len {
                let why = format!("a record declared {len} bytes and wrote {written}");
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
            }
            let at = (f.segments.last().map_or(0, |(s, _)| *s), f.len);
            f.len += len;
            if let Some(last) = f.segments.last_mut() {
                last.1 = last.1.max(max_index);
            }
            Ok(at)
        })();
        match &r {
            Ok(_) => {
                self.dirty.insert(shard.clone());
            }
            Err(e) => {
                self.failures += 1;
                // What was appended of it may be torn: the file is cut back at the next start.
                f.file = None;
                f.summary = None;
                tracing::error!("writing {shard:?}'s replica log: {e}; the replica stops until the broker restarts");
            }
        }
        r
    }

    /// Whether appends are synced before what depends on them is carried out (the default)
    /// rather than on an interval.
    pub(crate) fn syncs_before_answering(&self) -> bool {
        self.dir.is_some() && self.sync_every.is_none()
    }

    /// The files appended to since the last call, each with its path and its length now, to be
    /// synced (off the broker task) before anything output after those appends is carried out.
    pub(crate) fn take_unsynced(&mut self) -> Vec<UnsyncedFile> {
        let Some(dir) = &self.dir else {
            self.dirty.clear();
            return Vec::new();
        };
        let mut out = Vec::with_capacity(self.dirty.len());
        for s in std::mem::take(&mut self.dirty) {
            if let Some(f) = self.shards.get(&s)
                && let (Some(file), Some((seq, _))) = (&f.file, f.segments.last())
            {
                out.push(UnsyncedFile {
                    shard: s.clone(),
                    path: dir.join(replica_file_name(&s, *seq)),
                    len: f.len,
                    file: file.clone(),
                });
            }
        }
        out
    }

    /// Syncs what was appended since the last sync, when the interval has passed (a lazy
    /// policy only).
    pub(crate) fn sync_due(&mut self, now: std::time::Instant) {
        let Some(every) = self.sync_every else { return };
        if self.dirty.is_empty() || now.saturating_duration_since(self.last_sync) < every {
            return;
        }
        self.last_sync = now;
        for f in self.take_unsynced() {
            if let Err(e) = f.sync() {
                self.failures += 1;
                tracing::error!("syncing {:?}'s replica log: {e}", f.shard);
            }
        }
    }

    /// The shard is gone (its stream deleted): its log is removed.
    pub(crate) fn drop_shard(&mut self, shard: &ShardId) {
        self.dirty.remove(shard);
        if let (Some(dir), Some(f)) = (&self.dir, self.shards.remove(shard)) {
            for (seq, _) in f.segments {
                let _ = std::fs::remove_file(dir.join(replica_file_name(shard, seq)));
                let _ = std::fs::remove_file(dir.join(summary_file_name(shard, seq)));
            }
        }
    }

    /// Segment files kept per shard (diagnostics and tests).
    #[cfg(test)]
    pub(super) fn segments(&self, shard: &ShardId) -> Vec<u64> {
        self.shards.get(shard).map(|f| f.segments.iter().map(|(s, _)| *s).collect()).unwrap_or_default()
    }
}

fn open_segment(dir: &std::path::Path, shard: &ShardId, seq: u64) -> std::io::Result<Arc<std::fs::File>> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(replica_file_name(shard, seq));
    let f = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
    if felix_driver_common::sync_journal::len_of(&f) == 0 {
        felix_driver_common::sync_journal::created(&path);
    }
    Ok(Arc::new(f))
}

/// A replica log file with appends not yet on disk: what the sync thread syncs.
pub(crate) struct UnsyncedFile {
    pub(crate) shard: ShardId,
    pub(super) path: std::path::PathBuf,
    pub(super) len: u64,
    pub(super) file: Arc<std::fs::File>,
}

impl UnsyncedFile {
    /// `fdatasync`s the file (said in the sync journal once done).
    ///
    /// # Errors
    /// The sync's: the kernel may have dropped the pages, so nothing appended to the file
    /// since its last good sync may be vouched for.
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        felix_driver_common::sync_journal::before_sync()?;
        self.file.sync_data()?;
        felix_driver_common::sync_journal::synced(&self.path, self.len);
        Ok(())
    }
}

/// From this many files a sync pass makes them durable with one `syncfs` per filesystem
/// rather than one `fdatasync` each.
pub(crate) const SYNCFS_FROM: usize = 4;

/// Makes the appends of every file in `files` durable (each said in the sync journal once
/// done); the error names what failed.
///
/// Why `syncfs`: a broker holds one log per replicated shard, and a sync pass covers every log
/// appended to since the last (thousands when thousands of groups elect at once: a cluster
/// created with 10,000 shards made 2,400 `fdatasync`s a second on each broker and fell behind,
/// and what waited on them, its Raft messages included, with it). One `syncfs` writes back and
/// waits for everything dirty on the filesystem, with one journal commit; since Linux 5.8 it
/// reports a writeback error of any file on it, so a failure still stops the broker. Files are
/// grouped by the filesystem they live on (a data directory may span mounts). Elsewhere than
/// Linux, and for a few files, each is synced on its own.
pub(crate) fn sync_many(files: &[UnsyncedFile]) -> Result<(), String> {
    #[cfg(target_os = "linux")]
    if files.len() >= SYNCFS_FROM {
        use std::os::unix::fs::MetadataExt;
        let mut by_fs: BTreeMap<u64, Vec<&UnsyncedFile>> = BTreeMap::new();
        for f in files {
            let dev = f.file.metadata().map_err(|e| format!("{:?}: {e}", f.shard))?.dev();
            by_fs.entry(dev).or_default().push(f);
        }
        for list in by_fs.values() {
            let Some(first) = list.first() else { continue };
            felix_driver_common::sync_journal::before_sync().map_err(|e| format!("{:?}: {e}", first.shard))?;
            rustix::fs::syncfs(&*first.file)
                .map_err(|e| format!("syncfs of {} replica logs (with {:?}): {e}", list.len(), first.shard))?;
            for f in list {
                felix_driver_common::sync_journal::synced(&f.path, f.len);
            }
        }
        return Ok(());
    }
    for f in files {
        f.sync().map_err(|e| format!("{:?}: {e}", f.shard))?;
    }
    Ok(())
}
