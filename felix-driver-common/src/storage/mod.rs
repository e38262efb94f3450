//! Durable stream shards on disk: the file IO around `felix_proto::storage`'s byte format.
//!
//! Layout under the data directory:
//!
//! ```text
//! streams/<tenant>/<namespace>/<stream>/meta          "shards=N\n"
//! streams/<tenant>/<namespace>/<stream>/<shard>/<first offset, 20 digits>.seg
//! ```
//!
//! Names are escaped with `felix_proto::storage::path_component`, so no stream name can leave
//! the data directory. Writes run on one dedicated thread: it takes every request queued since
//! its last pass, appends them, syncs each touched file once (group commit) according to the
//! fsync policy, then reports every write. With `FsyncMode::Always` a write is reported only
//! once it is on disk.

use bytes::{Bytes, BytesMut};
use felix_proto::broker::{PersistRequest, WriteOutcome};
use felix_proto::storage::{
    IndexEntry, StateCheckpoint, StoredBatch, crc32c_append, decode_index, decode_producer_watermarks, decode_segment,
    decode_state_checkpoint, encode_batch, encode_index, encode_index_entry, encode_index_trailer,
    encode_producer_watermarks, parse_path_component, parse_segment_name, path_component, segment_name,
    state_checkpoint_as_of,
};
use felix_proto::transport::WriteToken;
use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::Instant;

mod history;
pub use history::*;
mod index;
use index::*;
mod recovery;
use recovery::*;
#[cfg(test)]
mod tests;

/// When appended data is forced to disk: the broker's own setting, one type for both.
pub use felix_proto::broker::FsyncMode;

pub use felix_proto::storage::RecoveredShard;

#[derive(Debug)]
struct OpenSegment {
    file: File,
    len: u64,
}

/// A thread that runs interval fsyncs on duplicated file handles (an fsync through any handle
/// of a file syncs the file), so the storage thread keeps appending meanwhile.
#[derive(Debug)]
struct Syncer {
    tx: Option<std::sync::mpsc::Sender<(PathBuf, File, u64)>>,
}

impl Syncer {
    fn start() -> Syncer {
        let (tx, rx) = std::sync::mpsc::channel::<(PathBuf, File, u64)>();
        let spawned = std::thread::Builder::new().name("felix-fsync".into()).spawn(move || {
            for (path, file, len) in rx {
                let _ = sync_file(&path, &file, len);
            }
        });
        match spawned {
            Ok(_) => Syncer { tx: Some(tx) },
            Err(e) => {
                tracing::warn!("no fsync thread ({e}): interval syncs run on the storage thread");
                Syncer { tx: None }
            }
        }
    }

    /// Syncs `file` on the syncer thread, or here when there is none or the handle cannot be
    /// duplicated.
    fn sync(&self, path: &Path, file: &File, len: u64) {
        if let (Some(tx), Ok(dup)) = (&self.tx, file.try_clone())
            && tx.send((path.to_path_buf(), dup, len)).is_ok()
        {
            return;
        }
        let _ = sync_file(path, file, len);
    }
}

/// `fdatasync` of a segment of `len` bytes, said in the sync journal once it returned; a
/// failure is logged and returned.
fn sync_file(path: &Path, file: &File, len: u64) -> std::io::Result<()> {
    match crate::sync_journal::before_sync().and_then(|()| file.sync_data()) {
        Ok(()) => {
            crate::sync_journal::synced(path, len);
            Ok(())
        }
        Err(e) => {
            tracing::error!("fsync {} failed: {e}", path.display());
            Err(e)
        }
    }
}

/// Appends batches to segment files.
#[derive(Debug)]
pub struct DiskStorage {
    root: PathBuf,
    policy: FsyncMode,
    segment_bytes: u64,
    open: HashMap<PathBuf, OpenSegment>,
    dirty: HashSet<PathBuf>,
    known_meta: HashSet<PathBuf>,
    /// Segments a failed write left with a partial batch that could not be cut off: never
    /// appended to again.
    poisoned: HashSet<PathBuf>,
    /// When each file written under an interval policy is due to be synced.
    deadlines: HashMap<PathBuf, Instant>,
    /// fsync calls made (for metrics and tests).
    syncs: u64,
    /// Interval syncs run here, on their own thread, so that the writes behind them do not
    /// wait for the disk (see [`Syncer`]).
    syncer: Syncer,
    /// Per segment: `(first offset of a batch, byte position)`, in order. Lets a history read
    /// seek to the batch it needs instead of reading the whole segment.
    /// A sparse seek index per segment: `(first offset, byte position)` of every
    /// `SPARSE_EVERY`th batch (and the first), so memory stays small whatever a segment holds.
    index: HashMap<PathBuf, Vec<(u64, u64)>>,
    /// The index file being written beside each open segment (entries go to disk as batches
    /// are appended; the trailer seals it when the segment is sealed).
    idx_open: HashMap<PathBuf, IdxWriter>,
    /// Index entries recovery found for the newest segments, to start their index files with.
    idx_seed: HashMap<PathBuf, Vec<IndexEntry>>,
    /// Per segment holding commits: the offset of its newest one. Retention deletes such a
    /// segment only once the shard's state checkpoint holds that commit.
    commits_in: HashMap<PathBuf, u64>,
    /// Per shard directory: the `as_of` of its state checkpoint on disk.
    checkpoints: HashMap<PathBuf, u64>,
    /// Per shard directory, as its segments were last listed: the base offset of its second
    /// oldest segment (`u64::MAX`: it had one segment or none). Retention deletes a segment
    /// only once the next one's base is at or below the new start, so a truncation whose
    /// start is below this deletes nothing and need not list the directory. A stream at its
    /// retention limit asks for a truncation with every batch it appends, and listing its
    /// directory each time was 9% of a broker's CPU at full speed (`perf`, 2026-12-07). Kept
    /// true by forgetting a directory's entry whenever a segment is started in it or its
    /// files are removed; truncations set it from the listing they make.
    first_boundary: HashMap<PathBuf, u64>,
    /// Segment directory listings made by retention (for tests).
    retention_listings: u64,
    /// Per shard directory, the segment open for appends there (a key of `open`): found by
    /// the directory rather than by walking every open segment at each write, which with
    /// thousands of shards cost thousands of path comparisons a batch.
    appending: HashMap<PathBuf, PathBuf>,
    /// The stream directory last asked for, by (tenant, namespace, stream).
    last_dir: Option<(String, String, String, PathBuf)>,
}

/// The name a deleted stream's directory takes while it is removed.
const GRAVE_PREFIX: &str = ".deleted-";

fn io_err(path: &Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

impl DiskStorage {
    /// Opens (creating) the data directory.
    ///
    /// # Errors
    /// If the directory cannot be created.
    pub fn open(root: &Path, policy: FsyncMode) -> std::io::Result<DiskStorage> {
        std::fs::create_dir_all(root.join("streams")).map_err(|e| io_err(root, e))?;
        Ok(DiskStorage {
            root: root.to_path_buf(),
            policy,
            segment_bytes: 64 << 20,
            open: HashMap::new(),
            dirty: HashSet::new(),
            known_meta: HashSet::new(),
            poisoned: HashSet::new(),
            idx_open: HashMap::new(),
            idx_seed: HashMap::new(),
            deadlines: HashMap::new(),
            syncs: 0,
            syncer: Syncer::start(),
            index: HashMap::new(),
            commits_in: HashMap::new(),
            checkpoints: HashMap::new(),
            first_boundary: HashMap::new(),
            retention_listings: 0,
            appending: HashMap::new(),
            last_dir: None,
        })
    }

    /// Sets the size at which a new segment file is started.
    pub fn set_segment_bytes(&mut self, n: u64) {
        self.segment_bytes = n.max(1);
    }

    /// A reader of this directory's history for another thread ([`HistoryReader`]).
    pub fn history_reader(&self) -> HistoryReader {
        HistoryReader::new(&self.root)
    }

    /// The stream's directory. The last one asked for is kept: a storage thread writes and
    /// truncates the same few streams batch after batch, and making each name safe as a path
    /// component, then joining them, was 2.3% of a broker's CPU under one busy stream.
    fn stream_dir(&mut self, tenant: &str, ns: &str, stream: &str) -> PathBuf {
        if let Some((t, n, s, dir)) = &self.last_dir
            && (t.as_str(), n.as_str(), s.as_str()) == (tenant, ns, stream)
        {
            return dir.clone();
        }
        let dir = stream_dir(&self.root, tenant, ns, stream);
        match &mut self.last_dir {
            // Streams taking turns: the names' buffers are reused, not allocated again.
            Some((t, n, s, d)) => {
                for (buf, name) in [(t, tenant), (n, ns), (s, stream)] {
                    buf.clear();
                    buf.push_str(name);
                }
                d.clone_from(&dir);
            }
            None => self.last_dir = Some((tenant.to_owned(), ns.to_owned(), stream.to_owned(), dir.clone())),
        }
        dir
    }
}

impl DiskStorage {
    /// Appends the batches, syncs per policy (each stream's own, or the storage's), and
    /// reports each write. A write under `always` is reported only once its file is synced.
    pub fn write(&mut self, reqs: Vec<PersistRequest>) -> Vec<(WriteToken, WriteOutcome)> {
        let mut results = Vec::with_capacity(reqs.len());
        let mut buf = BytesMut::new();
        // Files written under `always` in this pass, with the results that wait on them.
        let mut always: HashMap<PathBuf, Vec<usize>> = HashMap::new();
        for r in reqs {
            buf.clear();
            encode_batch(&r.to_stored(), &mut buf);
            let policy = r.fsync.unwrap_or(self.policy);
            match self.append(&r, &buf) {
                Ok(path) => {
                    if r.state.is_some() {
                        let newest = self.commits_in.entry(path.clone()).or_insert(r.base_offset);
                        *newest = (*newest).max(r.base_offset);
                    }
                    match policy {
                        FsyncMode::Always => always.entry(path.clone()).or_default().push(results.len()),
                        FsyncMode::Interval(d) => {
                            self.deadlines.entry(path.clone()).or_insert_with(|| Instant::now() + d);
                        }
                        FsyncMode::Never => {
                            self.dirty.remove(&path);
                        }
                    }
                    results.push((r.token, WriteOutcome::Written));
                }
                Err(e) => {
                    tracing::error!("storage write failed: {e}");
                    results.push((r.token, outcome_of(&e)));
                }
            }
        }
        // Nothing that may not be on disk is reported as written.
        for (path, waiting) in always {
            self.syncs += 1;
            if let Some(seg) = self.open.get(&path)
                && let Err(e) = sync_file(&path, &seg.file, seg.len)
            {
                for i in waiting {
                    results[i].1 = outcome_of(&e);
                }
            }
            self.dirty.remove(&path);
        }
        self.sync_due();
        results
    }

    /// Syncs the files written under an interval policy whose interval (since their first
    /// unsynced write) has passed: each stream's own interval. The storage thread also calls
    /// this when idle, so a quiet stream is synced on time too. The syncs run on the syncer
    /// thread: an interval policy promises the disk within the interval, not before the write
    /// is reported, so neither the writes of this pass nor the ones queued behind it wait for
    /// the disk (inline, one fsync every 100 ms put its whole duration on the p99 of live
    /// delivery from a durable stream).
    pub fn sync_due(&mut self) {
        let now = Instant::now();
        let due: Vec<PathBuf> = self.deadlines.iter().filter(|(_, t)| **t <= now).map(|(p, _)| p.clone()).collect();
        for path in due {
            self.deadlines.remove(&path);
            if self.dirty.remove(&path)
                && let Some(seg) = self.open.get(&path)
            {
                self.syncs += 1;
                self.syncer.sync(&path, &seg.file, seg.len);
            }
        }
    }

    /// fsync calls made so far.
    pub fn syncs(&self) -> u64 {
        self.syncs
    }

    /// Deletes the segments of a shard that lie wholly below `start` (retention). The newest
    /// segment is always kept. Returns how many files were deleted.
    ///
    /// `producers_forgotten` (from the broker's `Truncate`) is merged into the shard's
    /// producer-watermark file, kept (highest per producer) and synced before any segment goes,
    /// so that a restart never takes a sequence retention removed for one that never landed.
    ///
    /// `state_checkpoint` (the shard's commit state, from the same `Truncate`) replaces the
    /// shard's `state.checkpoint`, written whole and synced before any segment goes: the
    /// commits that wrote the state may be in them. If it cannot be written, nothing is deleted.
    pub fn truncate_before(
        &mut self,
        (tenant, ns, stream): (&str, &str, &str),
        shard: u32,
        start: u64,
        producers_forgotten: &[(u64, u64)],
        state_checkpoint: Option<&[u8]>,
    ) -> usize {
        let dir = self.stream_dir(tenant, ns, stream).join(shard.to_string());
        if state_checkpoint.is_none()
            && producers_forgotten.is_empty()
            && self.first_boundary.get(&dir).is_some_and(|&b| start < b)
        {
            return 0; // no segment ends at or below `start`
        }
        // The checkpoint is written when a segment is about to go (the commits in it may have
        // written the state), and into a shard holding no segment yet (a moved shard's copy,
        // whose older commits never were here). Otherwise every commit since the last
        // checkpoint is still on disk: a state of many megabytes is not rewritten and synced at
        // every retention sweep for nothing.
        self.retention_listings += 1;
        let segs = segments(&dir).unwrap_or_default();
        let deletes = segs.windows(2).any(|pair| pair[1].0 <= start);
        if let Some(c) = state_checkpoint.filter(|_| deletes || segs.is_empty()) {
            let made = std::fs::create_dir_all(&dir).and_then(|()| write_atomically(&dir.join(STATE_CHECKPOINT), c));
            if let Err(e) = made {
                tracing::error!("retention: writing the state checkpoint in {}: {e}; segments kept", dir.display());
                return 0;
            }
            if let Some(as_of) = state_checkpoint_as_of(c) {
                self.checkpoints.insert(dir.clone(), as_of);
            }
        }
        // A segment holding a commit the checkpoint on disk does not hold is kept, and every
        // segment after it (retention is late, never lossy): the broker hands storage its state
        // once a second, not with every truncation.
        let as_of = self.checkpoints.get(&dir).copied();
        if !producers_forgotten.is_empty() {
            let mut repairs = Vec::new();
            let mut kept: BTreeMap<u64, u64> = read_watermarks(&dir, &mut repairs).into_iter().collect();
            for r in repairs {
                tracing::warn!("{r}");
            }
            for &(id, through) in producers_forgotten {
                let e = kept.entry(id).or_insert(through);
                *e = (*e).max(through);
            }
            let pairs: Vec<(u64, u64)> = kept.into_iter().collect();
            if let Err(e) = write_atomically(&dir.join(WATERMARKS), &encode_producer_watermarks(&pairs)) {
                // Keeping the segments is safe (retention is only late); deleting them without
                // the watermark is not.
                tracing::error!("retention: writing producer watermarks in {}: {e}; segments kept", dir.display());
                return 0;
            }
        }
        let mut deleted = 0;
        // The oldest segment kept: the base of the one after it bounds the next deletion.
        let mut kept_from = segs.len().saturating_sub(1);
        let mut failed = false;
        for (i, pair) in segs.windows(2).enumerate() {
            let (_, path) = &pair[0];
            let (next_base, _) = pair[1];
            if next_base > start || self.commits_in.get(path).is_some_and(|newest| as_of.is_none_or(|a| *newest > a)) {
                kept_from = i;
                break;
            }
            self.open.remove(path);
            self.dirty.remove(path);
            self.index.remove(path);
            self.idx_open.remove(path);
            self.commits_in.remove(path);
            let _ = std::fs::remove_file(index_path(path));
            let _ = std::fs::remove_file(part_path(path));
            match std::fs::remove_file(path) {
                Ok(()) => deleted += 1,
                Err(e) => {
                    tracing::warn!("retention: removing {}: {e}", path.display());
                    failed = true;
                }
            }
        }
        // A segment held back by a commit leaves a boundary at or below `start`, so the next
        // truncation lists the directory again, as it must; one that could not be removed is
        // still there, and is tried again at the next.
        match segs.get(kept_from + 1) {
            _ if failed => self.first_boundary.remove(&dir),
            Some((b, _)) => self.first_boundary.insert(dir, *b),
            None => self.first_boundary.insert(dir, u64::MAX),
        };
        deleted
    }

    /// Segment directory listings retention made (each truncation that could delete a
    /// segment lists its shard's directory; one that cannot does not).
    pub fn retention_listings(&self) -> u64 {
        self.retention_listings
    }

    /// Records a created stream's shard count (`stream_create`, D60): its directory's `meta`,
    /// written whole and synced with the directories above it, so a restart brings the stream
    /// back with its shards before its first record. A stream that has a `meta` keeps it (a
    /// stream's shard count never changes).
    ///
    /// # Errors
    /// The directories or the file cannot be written.
    pub fn record_stream(&mut self, (tenant, ns, stream): (&str, &str, &str), shards: u32) -> std::io::Result<()> {
        let sdir = self.stream_dir(tenant, ns, stream);
        let meta = sdir.join("meta");
        if meta.exists() {
            self.known_meta.insert(meta);
            return Ok(());
        }
        std::fs::create_dir_all(&sdir).map_err(|e| io_err(&sdir, e))?;
        // The new directories' entries, up to the streams root, survive a crash too.
        let mut d = sdir.parent();
        while let Some(dir) = d {
            File::open(dir).and_then(|f| f.sync_all()).map_err(|e| io_err(dir, e))?;
            if dir == self.root {
                break;
            }
            d = dir.parent();
        }
        write_atomically(&meta, format!("shards={shards}\n").as_bytes()).map_err(|e| io_err(&meta, e))?;
        self.known_meta.insert(meta);
        Ok(())
    }

    /// Removes a deleted stream's files. The directory is first renamed to a name no stream can
    /// have (escaped names never start with a dot) and the rename synced, so a crash half way
    /// leaves either the whole stream or a grave that the next start removes, never a partial
    /// stream that comes back. Writes queued before this must have been written first.
    ///
    /// # Errors
    /// The rename failing (the stream is then still whole on disk).
    pub fn delete_stream(&mut self, (tenant, ns, stream): (&str, &str, &str)) -> std::io::Result<()> {
        let dir = self.stream_dir(tenant, ns, stream);
        self.forget_under(&dir);
        if !dir.exists() {
            return Ok(());
        }
        let Some(parent) = dir.parent() else { return Ok(()) };
        let name = dir.file_name().and_then(|f| f.to_str()).unwrap_or("stream");
        let mut grave = parent.join(format!("{GRAVE_PREFIX}{name}"));
        let mut n = 0;
        while grave.exists() {
            n += 1;
            grave = parent.join(format!("{GRAVE_PREFIX}{name}.{n}"));
        }
        std::fs::rename(&dir, &grave).map_err(|e| io_err(&dir, e))?;
        if let Ok(p) = File::open(parent) {
            let _ = p.sync_all();
        }
        if let Err(e) = std::fs::remove_dir_all(&grave) {
            tracing::warn!("removing {}: {e} (removed at the next start)", grave.display());
        }
        Ok(())
    }

    /// Forgets every open file, index and pending sync under `dir` (about to be removed).
    fn forget_under(&mut self, dir: &Path) {
        let under = |p: &PathBuf| p.starts_with(dir);
        self.open.retain(|p, _| !under(p));
        self.dirty.retain(|p| !under(p));
        self.known_meta.retain(|p| !under(p));
        self.poisoned.retain(|p| !under(p));
        self.deadlines.retain(|p, _| !under(p));
        self.index.retain(|p, _| !under(p));
        self.idx_open.retain(|p, _| !under(p));
        self.idx_seed.retain(|p, _| !under(p));
        self.commits_in.retain(|p, _| !under(p));
        self.checkpoints.retain(|p, _| !under(p));
        self.first_boundary.retain(|p, _| !under(p));
        self.appending.retain(|p, _| !under(p));
    }

    /// Removes everything held of one shard (a shard moving here is copied from its old
    /// owner's start). Writes queued before this must have been written first. A crash half way
    /// leaves part of the old files, which the copy's next start removes again.
    ///
    /// # Errors
    /// Removing the shard's directory failing.
    pub fn reset_shard(&mut self, (tenant, ns, stream): (&str, &str, &str), shard: u32) -> std::io::Result<()> {
        let dir = self.stream_dir(tenant, ns, stream).join(shard.to_string());
        self.forget_under(&dir);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(io_err(&dir, e)),
        }
    }

    /// Reads stored batches of a shard: from the one holding `from`, stopping before `end` or
    /// after about `max_bytes` of payload. Problems end the read early (what was read is
    /// returned); nothing here panics on bad data.
    pub fn read_range(
        &mut self,
        (tenant, ns, stream): (&str, &str, &str),
        shard: u32,
        from: u64,
        end: u64,
        max_bytes: usize,
    ) -> Vec<StoredBatch> {
        let dir = self.stream_dir(tenant, ns, stream).join(shard.to_string());
        let Ok(segs) = segments(&dir) else { return Vec::new() };
        let first = segs.iter().rposition(|(base, _)| *base <= from).unwrap_or(0);
        let mut read = RangeRead::new(from, end, max_bytes);
        for (_, path) in &segs[first..] {
            // Unflushed appends must be visible to the read.
            if let Some(seg) = self.open.get_mut(path) {
                let _ = seg.file.flush();
            }
            let pos = self
                .index
                .get(path)
                .and_then(|ix| ix.iter().rev().find(|(base, _)| *base <= from).map(|(_, pos)| *pos))
                .unwrap_or(0);
            if !read.segment(path, pos) {
                break;
            }
        }
        read.out
    }

    /// Syncs everything written (at shutdown).
    pub fn sync_all(&mut self) {
        for (path, seg) in &self.open {
            let _ = sync_file(path, &seg.file, seg.len);
        }
        self.dirty.clear();
    }

    fn append(&mut self, r: &PersistRequest, bytes: &[u8]) -> std::io::Result<PathBuf> {
        let sdir = self.stream_dir(&r.tenant_id, &r.namespace, &r.stream);
        let meta = sdir.join("meta");
        if !self.known_meta.contains(&meta) {
            std::fs::create_dir_all(&sdir).map_err(|e| io_err(&sdir, e))?;
            if !meta.exists() {
                std::fs::write(&meta, format!("shards={}\n", r.stream_shards)).map_err(|e| io_err(&meta, e))?;
            }
            self.known_meta.insert(meta);
        }
        let dir = sdir.join(r.shard.to_string());
        let current = self.appending.get(&dir).filter(|p| self.open.contains_key(*p)).cloned();
        let path = match current {
            Some(p) if self.open.get(&p).is_some_and(|s| s.len < self.segment_bytes) => p,
            old => {
                if let Some(old) = old {
                    if let Some(seg) = self.open.remove(&old) {
                        let _ = sync_file(&old, &seg.file, seg.len);
                        // Sealed: its index lets recovery skip reading it.
                        if let Some(w) = self.idx_open.remove(&old) {
                            w.seal(&old, seg.len);
                        }
                    }
                    self.dirty.remove(&old);
                }
                std::fs::create_dir_all(&dir).map_err(|e| io_err(&dir, e))?;
                // A segment may start here: retention lists the directory again.
                self.first_boundary.remove(&dir);
                let existing = last_segment(&dir)?;
                let path = match existing {
                    Some((p, len)) if len < self.segment_bytes && !self.poisoned.contains(&p) => p,
                    other => {
                        // A full segment from before a restart is sealed now, from what recovery
                        // found in it.
                        if let Some((p, len)) = other
                            && let Some(entries) = self.idx_seed.remove(&p)
                        {
                            write_index(&p, &entries, len);
                        }
                        dir.join(segment_name(r.base_offset))
                    }
                };
                let file = OpenOptions::new().create(true).append(true).open(&path).map_err(|e| io_err(&path, e))?;
                let len = file.metadata().map_err(|e| io_err(&path, e))?.len();
                if len == 0 {
                    crate::sync_journal::created(&path);
                }
                self.open.insert(path.clone(), OpenSegment { file, len });
                self.appending.insert(dir.clone(), path.clone());
                let seed = self.idx_seed.remove(&path).unwrap_or_default();
                match IdxWriter::start(&path, &seed) {
                    Ok(w) => {
                        self.idx_open.insert(path.clone(), w);
                    }
                    Err(e) => tracing::warn!("index of {}: {e} (recovery will scan the segment)", path.display()),
                }
                path
            }
        };
        let seg = self.open.get_mut(&path).expect("opened above");
        let pos = seg.len;
        if let Err(e) = seg.file.write_all(bytes) {
            // A write that failed part-way (disk full, file too large) may have left some of
            // the batch behind: cut it off, so the next batch follows a whole one. If even that
            // fails, leave the segment: the next write starts a new one, and recovery cuts this
            // tail.
            if seg.file.set_len(pos).is_err() {
                self.open.remove(&path);
                self.dirty.remove(&path);
                self.idx_open.remove(&path);
                self.poisoned.insert(path.clone());
            }
            return Err(io_err(&path, e));
        }
        seg.len += bytes.len() as u64;
        let entry = IndexEntry {
            base_offset: r.base_offset,
            position: pos,
            count: if r.generation_start { 1 } else { u64::from(r.records.count()) },
            timestamp_micros: r.timestamp_micros,
            payload_bytes: r.records.payload_bytes() as u64,
            generation_start: r.generation_start,
            producer: r.producer.map(|(id, seq)| (id, seq, felix_proto::storage::records_digest(&r.records))),
            state: r.state.is_some(),
        };
        let seen = self.idx_open.get(&path).map_or(0, |w| w.count);
        if let Some(w) = self.idx_open.get_mut(&path)
            && w.add(&entry).is_err()
        {
            self.idx_open.remove(&path); // recovery rebuilds it from the segment
        }
        let ix = self.index.entry(path.clone()).or_default();
        if ix.is_empty() || seen.is_multiple_of(SPARSE_EVERY) {
            ix.push((entry.base_offset, entry.position));
        }
        self.dirty.insert(path.clone());
        Ok(path)
    }
}

fn read_dirs(dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io_err(dir, e)),
    };
    for e in entries {
        let p = e.map_err(|e| io_err(dir, e))?.path();
        if p.is_dir() {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

fn name_of(p: &Path) -> Option<String> {
    parse_path_component(p.file_name()?.to_str()?)
}

fn read_meta(p: &Path) -> Option<u32> {
    let text = std::fs::read_to_string(p).ok()?;
    text.lines().find_map(|l| l.strip_prefix("shards=")).and_then(|v| v.trim().parse().ok())
}

/// Where a stream's shards live under a data directory (names made safe as path components).
fn stream_dir(root: &Path, tenant: &str, ns: &str, stream: &str) -> PathBuf {
    root.join("streams").join(path_component(tenant)).join(path_component(ns)).join(path_component(stream))
}

fn segments(dir: &Path) -> std::io::Result<Vec<(u64, PathBuf)>> {
    let mut segs = Vec::new();
    for e in std::fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let p = e.map_err(|e| io_err(dir, e))?.path();
        if let Some(base) = p.file_name().and_then(|f| f.to_str()).and_then(parse_segment_name) {
            segs.push((base, p));
        }
    }
    segs.sort();
    Ok(segs)
}

fn last_segment(dir: &Path) -> std::io::Result<Option<(PathBuf, u64)>> {
    match segments(dir)?.pop() {
        Some((_, p)) => {
            let len = std::fs::metadata(&p).map_err(|e| io_err(&p, e))?.len();
            Ok(Some((p, len)))
        }
        None => Ok(None),
    }
}

/// Writes a sealed segment's index (best effort: a missing or bad index is rebuilt at start).
/// How a failed write is reported: lack of space (a full disk, a quota, a file-size limit) is
/// told apart, since the broker then stops taking writes for the shard until space returns.
fn outcome_of(e: &std::io::Error) -> WriteOutcome {
    use std::io::ErrorKind;
    match e.kind() {
        ErrorKind::StorageFull | ErrorKind::QuotaExceeded | ErrorKind::FileTooLarge => WriteOutcome::NoSpace,
        _ => WriteOutcome::Failed,
    }
}

/// Writes `data` to `path` whole or not at all: a synced temporary file renamed into place, and
/// the directory synced so the rename survives a crash.
fn write_atomically(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, data)?;
    File::open(&tmp)?.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Some(dir) = path.parent() {
        File::open(dir)?.sync_all()?;
    }
    Ok(())
}
