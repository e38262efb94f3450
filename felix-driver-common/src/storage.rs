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

    fn stream_dir(&self, tenant: &str, ns: &str, stream: &str) -> PathBuf {
        stream_dir(&self.root, tenant, ns, stream)
    }

    /// Reads every shard back whole (tests, tools): see [`recover_within`](Self::recover_within).
    ///
    /// # Errors
    /// Only for IO failures; bad data is repaired, never an error.
    pub fn recover(&mut self) -> std::io::Result<Vec<RecoveredShard>> {
        self.recover_within(|_, _, _| u64::MAX)
    }

    /// Recovers every shard without reading the whole log: a sealed segment with a sound index
    /// file is known by its index alone, unless its records fall within the newest `budget`
    /// payload bytes of the shard (`budget(tenant, namespace, stream)`), which are read whole.
    /// The newest segment is always scanned: a torn or corrupt tail is truncated, a corrupt
    /// batch inside it skipped, each repair reported. A missing or stale index is rebuilt.
    ///
    /// # Errors
    /// Only for IO failures; bad data is repaired, never an error.
    pub fn recover_within(&mut self, budget: impl Fn(&str, &str, &str) -> u64) -> std::io::Result<Vec<RecoveredShard>> {
        let mut out = Vec::new();
        let streams = self.root.join("streams");
        for t in read_dirs(&streams)? {
            for n in read_dirs(&t)? {
                for s in read_dirs(&n)? {
                    if s.file_name().and_then(|f| f.to_str()).is_some_and(|f| f.starts_with(GRAVE_PREFIX)) {
                        // A deletion that crashed half way: finish it.
                        if let Err(e) = std::fs::remove_dir_all(&s) {
                            tracing::warn!("removing {} left by a stream deletion: {e}", s.display());
                        }
                        continue;
                    }
                    let (Some(tenant), Some(namespace), Some(stream)) = (name_of(&t), name_of(&n), name_of(&s)) else {
                        continue;
                    };
                    let stream_shards = read_meta(&s.join("meta")).unwrap_or(1);
                    self.known_meta.insert(s.join("meta"));
                    let before = out.len();
                    for shard_dir in read_dirs(&s)? {
                        let Some(shard) =
                            shard_dir.file_name().and_then(|f| f.to_str()).and_then(|f| f.parse::<u32>().ok())
                        else {
                            continue;
                        };
                        let keep = budget(&tenant, &namespace, &stream);
                        let state_checkpoint = read_state_checkpoint(&shard_dir)?;
                        let as_of = state_checkpoint.as_ref().map(|c| c.as_of);
                        if let Some(a) = as_of {
                            self.checkpoints.insert(shard_dir.clone(), a);
                        }
                        let ShardFiles { summaries, batches, state_batches, mut repairs, index } =
                            recover_shard(&shard_dir, keep, as_of)?;
                        let producer_watermarks = read_watermarks(&shard_dir, &mut repairs);
                        if let Some((newest, entries)) =
                            index.iter().max_by_key(|(p, _)| p.file_name().map(|f| f.to_owned()))
                        {
                            self.idx_seed.insert(newest.clone(), entries.clone());
                        }
                        for (p, e) in &index {
                            if let Some(newest) = e.iter().filter(|e| e.state).map(|e| e.base_offset).max() {
                                self.commits_in.insert(p.clone(), newest);
                            }
                        }
                        self.index.extend(index.into_iter().map(|(p, e)| (p, sparse(&e))));
                        out.push(RecoveredShard {
                            tenant_id: tenant.clone(),
                            namespace: namespace.clone(),
                            stream: stream.clone(),
                            shard,
                            stream_shards,
                            summaries,
                            batches,
                            state_batches,
                            repairs,
                            producer_watermarks,
                            state_checkpoint,
                        });
                    }
                    // A stream created (D60) and never written: its shards, empty.
                    if out.len() == before && s.join("meta").exists() {
                        out.push(RecoveredShard {
                            tenant_id: tenant.clone(),
                            namespace: namespace.clone(),
                            stream: stream.clone(),
                            shard: 0,
                            stream_shards,
                            summaries: Vec::new(),
                            batches: Vec::new(),
                            state_batches: Vec::new(),
                            repairs: Vec::new(),
                            producer_watermarks: Vec::new(),
                            state_checkpoint: None,
                        });
                    }
                }
            }
        }
        Ok(out)
    }

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
        // The checkpoint is written when a segment is about to go (the commits in it may have
        // written the state), and into a shard holding no segment yet (a moved shard's copy,
        // whose older commits never were here). Otherwise every commit since the last
        // checkpoint is still on disk: a state of many megabytes is not rewritten and synced at
        // every retention sweep for nothing.
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
        for pair in segs.windows(2) {
            let (_, path) = &pair[0];
            let (next_base, _) = pair[1];
            if self.commits_in.get(path).is_some_and(|newest| as_of.is_none_or(|a| *newest > a)) {
                break;
            }
            if next_base <= start {
                self.open.remove(path);
                self.dirty.remove(path);
                self.index.remove(path);
                self.idx_open.remove(path);
                self.commits_in.remove(path);
                let _ = std::fs::remove_file(index_path(path));
                let _ = std::fs::remove_file(part_path(path));
                match std::fs::remove_file(path) {
                    Ok(()) => deleted += 1,
                    Err(e) => tracing::warn!("retention: removing {}: {e}", path.display()),
                }
            }
        }
        deleted
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
        let current = self.open.keys().find(|p| p.parent() == Some(dir.as_path())).cloned();
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

/// One history read in progress: batches from the one holding `from`, stopping before `end`
/// or after about `max_bytes` of payload.
struct RangeRead {
    from: u64,
    end: u64,
    max_bytes: usize,
    bytes: usize,
    out: Vec<StoredBatch>,
}

impl RangeRead {
    fn new(from: u64, end: u64, max_bytes: usize) -> RangeRead {
        RangeRead { from, end, max_bytes, bytes: 0, out: Vec::new() }
    }

    /// Reads on from byte `pos` of one segment; false once the read is over (it has what was
    /// asked for, or met something it cannot read past: a torn or damaged batch, a file gone).
    fn segment(&mut self, path: &Path, pos: u64) -> bool {
        use std::io::{Read, Seek, SeekFrom};
        let Ok(f) = File::open(path) else { return false };
        let mut f = std::io::BufReader::with_capacity(256 << 10, f);
        if f.seek(SeekFrom::Start(pos)).is_err() {
            return false;
        }
        let mut header = [0u8; felix_proto::storage::BATCH_HEADER_LEN];
        loop {
            if f.read_exact(&mut header).is_err() {
                return true; // the end of this segment: the next one goes on
            }
            let Ok(len) = felix_proto::storage::batch_body_len(&header) else { return false };
            let mut frame = BytesMut::with_capacity(header.len() + len);
            frame.extend_from_slice(&header);
            frame.resize(header.len() + len, 0);
            if f.read_exact(&mut frame[header.len()..]).is_err() {
                return false;
            }
            let r = decode_segment(frame.freeze());
            let Some(b) = r.batches.into_iter().next() else { return false };
            if b.base_offset >= self.end {
                return false;
            }
            if b.base_offset + b.count() > self.from {
                self.bytes += b.records.payload_bytes();
                self.out.push(b);
                if self.bytes >= self.max_bytes {
                    return false;
                }
            }
        }
    }
}

/// Reads history from the segment files on a thread of its own, beside the thread that
/// appends ([`DiskStorage`]), so a reader that fell behind is never queued behind a pass of
/// writes (under a saturating publisher a pass took 30–145 ms, and a 1 MiB read 1 ms).
///
/// Only what was written may be asked for: the broker reads storage below what it holds in
/// memory, and a batch leaves memory only after its write completed, so every byte asked for
/// is in the file (the page cache) before the read is asked. It keeps its own sparse seek
/// points, found by reading batch headers, never a lock shared with the writer. A segment
/// removed meanwhile (retention, a deleted stream) ends the read with what was found, as a read
/// on the storage thread would.
#[derive(Debug)]
pub struct HistoryReader {
    root: PathBuf,
    seeks: HashMap<PathBuf, SeekPoints>,
}

/// Where batches start in one segment, as far as it was scanned.
#[derive(Debug, Default)]
struct SeekPoints {
    /// The file these points are of (a segment removed and made again is another file).
    inode: u64,
    /// `(first offset, byte position)` of every `SPARSE_EVERY`th batch, and the first.
    points: Vec<(u64, u64)>,
    /// Batches scanned, and the byte position the scan goes on from.
    batches: u32,
    scanned: u64,
}

impl SeekPoints {
    /// Scans batch headers from where the last scan stopped until a batch starting after
    /// `from` (or the end of what is in the file).
    fn scan_to(&mut self, f: &File, len: u64, from: u64) {
        use std::os::unix::fs::FileExt;
        let mut head = [0u8; felix_proto::storage::BATCH_HEADER_LEN + 8];
        while self.scanned + head.len() as u64 <= len {
            if f.read_exact_at(&mut head, self.scanned).is_err() {
                return;
            }
            let mut h = [0u8; felix_proto::storage::BATCH_HEADER_LEN];
            h.copy_from_slice(&head[..felix_proto::storage::BATCH_HEADER_LEN]);
            let Ok(body) = felix_proto::storage::batch_body_len(&h) else { return };
            let next = self.scanned + (felix_proto::storage::BATCH_HEADER_LEN + body) as u64;
            if next > len {
                return; // still being written
            }
            let mut b = [0u8; 8];
            b.copy_from_slice(&head[felix_proto::storage::BATCH_HEADER_LEN..]);
            let base = u64::from_be_bytes(b);
            if self.points.is_empty() || self.batches.is_multiple_of(SPARSE_EVERY) {
                self.points.push((base, self.scanned));
            }
            self.batches += 1;
            self.scanned = next;
            if base > from {
                return;
            }
        }
    }

    /// Where to start reading for `from`, if the batch found there is the one the point
    /// names (a file removed and made again can reuse an inode: its points are then checked,
    /// not trusted).
    fn seek(&self, f: &File, from: u64) -> Option<u64> {
        use std::os::unix::fs::FileExt;
        let i = self.points.partition_point(|(base, _)| *base <= from);
        if i == 0 {
            return Some(0);
        }
        let (base, pos) = self.points[i - 1];
        let mut head = [0u8; felix_proto::storage::BATCH_HEADER_LEN + 8];
        f.read_exact_at(&mut head, pos).ok()?;
        let mut h = [0u8; felix_proto::storage::BATCH_HEADER_LEN];
        h.copy_from_slice(&head[..felix_proto::storage::BATCH_HEADER_LEN]);
        felix_proto::storage::batch_body_len(&h).ok()?;
        let mut b = [0u8; 8];
        b.copy_from_slice(&head[felix_proto::storage::BATCH_HEADER_LEN..]);
        (u64::from_be_bytes(b) == base).then_some(pos)
    }
}

impl HistoryReader {
    /// A reader of the data directory a [`DiskStorage`] writes.
    pub fn new(root: &Path) -> HistoryReader {
        HistoryReader { root: root.to_path_buf(), seeks: HashMap::new() }
    }

    /// The same read as [`DiskStorage::read_range`], from this thread.
    pub fn read_range(
        &mut self,
        (tenant, ns, stream): (&str, &str, &str),
        shard: u32,
        from: u64,
        end: u64,
        max_bytes: usize,
    ) -> Vec<StoredBatch> {
        use std::os::unix::fs::MetadataExt;
        let dir = stream_dir(&self.root, tenant, ns, stream).join(shard.to_string());
        let Ok(segs) = segments(&dir) else { return Vec::new() };
        // Points of segments no longer there are forgotten (memory follows retention).
        self.seeks.retain(|p, _| p.parent() != Some(dir.as_path()) || segs.iter().any(|(_, s)| s == p));
        let first = segs.iter().rposition(|(base, _)| *base <= from).unwrap_or(0);
        let mut read = RangeRead::new(from, end, max_bytes);
        for (i, (_, path)) in segs[first..].iter().enumerate() {
            let pos = if i == 0 {
                let Ok(f) = File::open(path) else { break };
                let Ok(meta) = f.metadata() else { break };
                let points = self.seeks.entry(path.clone()).or_default();
                if points.inode != meta.ino() || points.scanned > meta.len() {
                    *points = SeekPoints { inode: meta.ino(), ..SeekPoints::default() };
                }
                points.scan_to(&f, meta.len(), from);
                match points.seek(&f, from) {
                    Some(pos) => pos,
                    None => {
                        *points = SeekPoints { inode: meta.ino(), ..SeekPoints::default() };
                        points.scan_to(&f, meta.len(), from);
                        points.seek(&f, from).unwrap_or(0)
                    }
                }
            } else {
                0
            };
            if !read.segment(path, pos) {
                break;
            }
        }
        read.out
    }
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

type SegmentIndex = HashMap<PathBuf, Vec<IndexEntry>>;

/// One seek point per this many batches in the in-memory index.
const SPARSE_EVERY: u32 = 64;

fn sparse(entries: &[IndexEntry]) -> Vec<(u64, u64)> {
    entries.iter().step_by(SPARSE_EVERY as usize).map(|e| (e.base_offset, e.position)).collect()
}

/// The index file of an open segment, being written.
fn part_path(seg: &Path) -> PathBuf {
    seg.with_extension("idx.part")
}

/// Writes an open segment's index entries as they come (buffered, never synced: a crash
/// leaves it without its trailer, and recovery rebuilds it from the segment).
#[derive(Debug)]
struct IdxWriter {
    file: std::io::BufWriter<File>,
    crc: u32,
    count: u32,
}

impl IdxWriter {
    fn start(seg: &Path, seed: &[IndexEntry]) -> std::io::Result<IdxWriter> {
        let file = File::create(part_path(seg))?;
        let mut w = IdxWriter { file: std::io::BufWriter::with_capacity(64 * 1024, file), crc: 0, count: 0 };
        for e in seed {
            w.add(e)?;
        }
        Ok(w)
    }

    fn add(&mut self, e: &IndexEntry) -> std::io::Result<()> {
        let mut b = BytesMut::with_capacity(felix_proto::storage::INDEX_ENTRY_LEN);
        encode_index_entry(e, &mut b);
        self.crc = crc32c_append(self.crc, &b);
        self.count += 1;
        self.file.write_all(&b)
    }

    /// Seals the index: trailer, sync, then renamed into place (whole or absent).
    fn seal(mut self, seg: &Path, len: u64) {
        let mut t = BytesMut::new();
        encode_index_trailer(len, self.count, self.crc, &mut t);
        let ok = self
            .file
            .write_all(&t)
            .and_then(|()| self.file.flush())
            .and_then(|()| self.file.get_ref().sync_all())
            .and_then(|()| std::fs::rename(part_path(seg), index_path(seg)));
        if let Err(e) = ok {
            tracing::warn!("sealing the index of {}: {e}", seg.display());
        }
    }
}

/// The index file of a segment.
fn index_path(seg: &Path) -> PathBuf {
    seg.with_extension("idx")
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

/// The file beside a shard's segments that keeps its producer watermarks.
const WATERMARKS: &str = "producers.watermarks";

/// Reads a shard's producer watermarks; a damaged file is reported in `repairs` and read as
/// none (recovery goes on: the broker then treats retention-removed sequences inside a
/// producer's window as never landed, as it did before this file existed).
fn read_watermarks(shard_dir: &Path, repairs: &mut Vec<String>) -> Vec<(u64, u64)> {
    let path = shard_dir.join(WATERMARKS);
    match std::fs::read(&path) {
        Ok(bytes) => decode_producer_watermarks(&bytes).unwrap_or_else(|e| {
            repairs.push(format!("{}: {e}; ignored", path.display()));
            Vec::new()
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            repairs.push(format!("{}: {e}; ignored", path.display()));
            Vec::new()
        }
    }
}

/// The file beside a shard's segments that keeps its commit state as retention last
/// checkpointed it.
const STATE_CHECKPOINT: &str = "state.checkpoint";

/// Reads a shard's state checkpoint, if it has one. A damaged one stops recovery: the commits
/// that wrote that state were deleted once it was on disk, so starting without it would serve
/// a state missing every value they wrote, and say nothing. The error names the file and what
/// moving it aside costs.
fn read_state_checkpoint(shard_dir: &Path) -> std::io::Result<Option<StateCheckpoint>> {
    let path = shard_dir.join(STATE_CHECKPOINT);
    let bytes = match std::fs::read(&path) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path, e)),
    };
    decode_state_checkpoint(&bytes::Bytes::from(bytes)).map(Some).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!(
                "{}: {e}. It holds the shard's commit state from commits retention has deleted; \
                 restore it from a backup, or move it aside to start with only the state of the \
                 commits still on disk (every value older commits wrote is then lost)",
                path.display()
            ),
        )
    })
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

fn write_index(seg: &Path, entries: &[IndexEntry], len: u64) {
    let tmp = seg.with_extension("idx.tmp");
    let ok = std::fs::write(&tmp, encode_index(entries, len))
        .and_then(|()| File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, index_path(seg)));
    if let Err(e) = ok {
        tracing::warn!("writing the index of {}: {e}", seg.display());
    }
}

/// Reads and repairs one segment whole. Returns its batches and their index entries.
fn scan_segment(path: &Path, repairs: &mut Vec<String>) -> std::io::Result<(Vec<StoredBatch>, Vec<IndexEntry>)> {
    let data = std::fs::read(path).map_err(|e| io_err(path, e))?;
    let total = data.len();
    let r = decode_segment(Bytes::from(data));
    for d in &r.damaged {
        let msg = format!("{}: {d}; that batch is skipped (its offsets are lost), the rest is served", path.display());
        tracing::error!("{msg}");
        repairs.push(msg);
    }
    if let Some(problem) = r.problem {
        let msg = format!(
            "{}: {problem}; truncated from {total} to {} bytes ({} batches kept)",
            path.display(),
            r.valid_len,
            r.batches.len()
        );
        tracing::warn!("{msg}");
        repairs.push(msg);
        let f = OpenOptions::new().write(true).open(path).map_err(|e| io_err(path, e))?;
        f.set_len(r.valid_len as u64).map_err(|e| io_err(path, e))?;
        f.sync_all().map_err(|e| io_err(path, e))?;
        crate::sync_journal::synced(path, r.valid_len as u64);
    } else {
        // What a crashed broker wrote but had not synced is still in the page cache and reads
        // back whole: it reaches the disk now, before any of it is served (a power cut after
        // the restart must not take back what subscribers were since given).
        let f = File::open(path).map_err(|e| io_err(path, e))?;
        f.sync_data().map_err(|e| io_err(path, e))?;
        crate::sync_journal::synced(path, total as u64);
    }
    let entries = r.batches.iter().zip(&r.positions).map(|(b, at)| IndexEntry::of(b, *at as u64)).collect();
    Ok((r.batches, entries))
}

/// What recovery knows of a segment.
enum Part {
    /// Its index only.
    Indexed(Vec<IndexEntry>),
    /// Read whole.
    Scanned(Vec<StoredBatch>, Vec<IndexEntry>),
}

impl Part {
    fn entries(&self) -> &[IndexEntry] {
        match self {
            Part::Indexed(e) | Part::Scanned(_, e) => e,
        }
    }
}

/// What recovery found in one shard's directory.
struct ShardFiles {
    /// Entries of the segments known by their index only.
    summaries: Vec<IndexEntry>,
    /// The newest batches, read whole.
    batches: Vec<StoredBatch>,
    /// The commit batches among `summaries`, read whole for their state.
    state_batches: Vec<StoredBatch>,
    repairs: Vec<String>,
    index: SegmentIndex,
}

/// `as_of`: the last commit a state checkpoint holds (commits at or below it are not read).
fn recover_shard(dir: &Path, budget: u64, as_of: Option<u64>) -> std::io::Result<ShardFiles> {
    let mut repairs = Vec::new();
    let segs = segments(dir)?;
    let mut parts: Vec<(PathBuf, Part)> = Vec::with_capacity(segs.len());
    for (i, (_, path)) in segs.iter().enumerate() {
        let newest = i + 1 == segs.len();
        if !newest {
            let len = std::fs::metadata(path).map_err(|e| io_err(path, e))?.len();
            if let Ok(bytes) = std::fs::read(index_path(path))
                && let Ok(entries) = decode_index(&bytes, len)
            {
                parts.push((path.clone(), Part::Indexed(entries)));
                continue;
            }
        }
        let (batches, entries) = scan_segment(path, &mut repairs)?;
        if !newest {
            let len = std::fs::metadata(path).map_err(|e| io_err(path, e))?.len();
            write_index(path, &entries, len);
        }
        parts.push((path.clone(), Part::Scanned(batches, entries)));
    }
    // The newest segments whose payload fits the budget are handed over whole.
    let mut whole_from = parts.len();
    let mut bytes = 0u64;
    while whole_from > 0 && bytes < budget {
        whole_from -= 1;
        bytes = bytes.saturating_add(parts[whole_from].1.entries().iter().map(|e| e.payload_bytes).sum::<u64>());
    }
    let mut summaries = Vec::new();
    let mut batches = Vec::new();
    let mut state_batches = Vec::new();
    let mut index = HashMap::new();
    for (i, (path, part)) in parts.into_iter().enumerate() {
        let entries = part.entries().to_vec();
        if i < whole_from {
            summaries.extend_from_slice(&entries);
            // Commits carry state the broker rebuilds at start: read those batches whole (but
            // not the ones a checkpoint already holds).
            let newer = |base: u64| as_of.is_none_or(|a| base > a);
            if entries.iter().any(|e| e.state && newer(e.base_offset)) {
                let whole = match part {
                    Part::Scanned(b, _) => b,
                    Part::Indexed(_) => scan_segment(&path, &mut repairs)?.0,
                };
                state_batches.extend(whole.into_iter().filter(|b| b.state.is_some() && newer(b.base_offset)));
            }
        } else {
            match part {
                Part::Scanned(b, _) => batches.extend(b),
                Part::Indexed(_) => batches.extend(scan_segment(&path, &mut repairs)?.0),
            }
        }
        index.insert(path, entries);
    }
    Ok(ShardFiles { summaries, batches, state_batches, repairs, index })
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::Records;
    use std::time::Duration;

    fn req(token: u64, base: u64, payloads: &[&str]) -> PersistRequest {
        PersistRequest {
            key: None,
            token: WriteToken(token),
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "../orders".into(),
            shard: 0,
            base_offset: base,
            records: Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).unwrap(),
            timestamp_micros: 5,
            publisher: None,
            generation_start: false,
            producer: None,
            state: None,
            fsync: None,
            stream_shards: 1,
        }
    }

    #[test]
    fn write_recover_and_repair_a_torn_tail() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
        s.set_segment_bytes(60);
        let res = s.write(vec![req(1, 0, &["a", "b"]), req(2, 2, &["c"]), req(3, 3, &["d"])]);
        assert!(res.iter().all(|r| r.1 == WriteOutcome::Written));
        drop(s);
        // Tear the last segment's tail.
        let shard = dir.path().join("streams/t1/default/%2E.%2Forders/0");
        let segs = segments(&shard).unwrap();
        assert!(segs.len() >= 2, "segments roll at the size limit");
        let last = &segs.last().unwrap().1;
        let len = std::fs::metadata(last).unwrap().len();
        OpenOptions::new().write(true).open(last).unwrap().set_len(len - 3).unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
        let rec = s.recover().unwrap();
        assert_eq!(rec.len(), 1);
        assert_eq!(rec[0].stream, "../orders");
        let offsets: Vec<u64> = rec[0].batches.iter().map(|b| b.base_offset).collect();
        assert_eq!(offsets, vec![0, 2]);
        assert_eq!(rec[0].repairs.len(), 1);
        // After the repair, appending continues cleanly.
        assert_eq!(s.write(vec![req(4, 3, &["d"])])[0].1, WriteOutcome::Written);
        let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
        assert_eq!(rec[0].batches.len(), 3);
        assert!(rec[0].repairs.is_empty());
    }

    /// D60: a created stream's shard count is on disk before its first record, and recovery
    /// hands it back as one empty shard carrying the count; a written stream's `meta` is kept.
    #[test]
    fn a_recorded_stream_is_recovered_with_its_shards_before_any_record() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
        s.record_stream(("t1", "default", "wide"), 8).unwrap();
        s.record_stream(("t1", "default", "wide"), 2).unwrap(); // a shard count never changes
        s.write(vec![req(1, 0, &["a"])]);
        s.record_stream(("t1", "default", "../orders"), 5).unwrap(); // written already: kept
        drop(s);
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
        let got = s.recover().unwrap();
        let wide = got.iter().find(|r| r.stream == "wide").expect("recovered unwritten");
        assert_eq!((wide.shard, wide.stream_shards, wide.batches.len()), (0, 8, 0));
        let orders = got.iter().find(|r| r.stream == "../orders").expect("written");
        assert_eq!(orders.batches.len(), 1);
        assert_ne!(orders.stream_shards, 5, "the meta its first write made stands");
    }

    #[test]
    fn retention_deletes_whole_segments_below_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(1);
        // One batch per segment: bases 0, 2, 3, 4.
        s.write(vec![req(1, 0, &["a", "b"]), req(2, 2, &["c"]), req(3, 3, &["d"]), req(4, 4, &["e"])]);
        let name = ("t1", "default", "../orders");
        assert_eq!(s.truncate_before(name, 0, 3, &[], None), 2, "segments [0,2) and [2,3) go");
        assert_eq!(s.truncate_before(name, 0, 100, &[], None), 1, "the newest segment stays");
        let rec = s.recover().unwrap();
        assert_eq!(rec[0].batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![4]);
        assert!(rec[0].producer_watermarks.is_empty());
    }

    #[test]
    fn producer_watermarks_are_kept_beside_the_shard_and_survive_a_restart() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(1);
        s.write(vec![req(1, 0, &["a"]), req(2, 1, &["b"]), req(3, 2, &["c"])]);
        let name = ("t1", "default", "../orders");
        s.truncate_before(name, 0, 1, &[(7, 4), (9, 1)], None);
        s.truncate_before(name, 0, 2, &[(7, 3), (8, 5)], None); // the highest per producer is kept
        let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
        assert_eq!(rec[0].producer_watermarks, vec![(7, 4), (8, 5), (9, 1)]);
        assert!(rec[0].repairs.is_empty());
        // A damaged file is reported and read as none; recovery goes on.
        let file = dir.path().join("streams").join("t1").join("default");
        let shard_dir = std::fs::read_dir(&file).unwrap().next().unwrap().unwrap().path().join("0");
        std::fs::write(shard_dir.join(WATERMARKS), b"FLXP garbage").unwrap();
        let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
        assert!(rec[0].producer_watermarks.is_empty());
        assert_eq!(rec[0].repairs.len(), 1, "{:?}", rec[0].repairs);
    }

    #[test]
    fn history_reads_seek_to_the_batch_they_need() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(100);
        let reqs: Vec<_> = (0..20).map(|i| req(i + 1, i, &[&format!("payload-{i:02}")])).collect();
        s.write(reqs);
        let name = ("t1", "default", "../orders");
        let got: Vec<u64> = s.read_range(name, 0, 7, 12, 1 << 20).iter().map(|b| b.base_offset).collect();
        assert_eq!(got, (7..12).collect::<Vec<_>>());
        let capped = s.read_range(name, 0, 0, 20, 25);
        assert_eq!(capped.len(), 3, "stops once max_bytes is reached");
        // The same after a restart, from the index rebuilt by recovery.
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.recover().unwrap();
        let got: Vec<u64> = s.read_range(name, 0, 15, 100, 1 << 20).iter().map(|b| b.base_offset).collect();
        assert_eq!(got, (15..20).collect::<Vec<_>>());
        assert!(s.read_range(("t1", "default", "nope"), 0, 0, 10, 100).is_empty());
    }

    /// The reader beside the writer gives what the writer's own read gives, from any offset,
    /// while the writer appends, across rolled segments, through the sparse seek points.
    #[test]
    fn the_history_reader_beside_the_writer_reads_what_the_writer_reads() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(4 << 10);
        let name = ("t1", "default", "../orders");
        let mut h = s.history_reader();
        let mut next = 0u64;
        for round in 0..6u64 {
            // 200 one-record batches a round: several segments, more than SPARSE_EVERY batches each.
            let reqs: Vec<_> = (0..200).map(|i| req(next + i + 1, next + i, &[&format!("r{round}-{i:03}")])).collect();
            next += 200;
            assert!(s.write(reqs).iter().all(|r| r.1 == WriteOutcome::Written));
            for from in [0, next / 3, next - 150, next - 1] {
                let theirs: Vec<u64> =
                    s.read_range(name, 0, from, next, 1 << 20).iter().map(|b| b.base_offset).collect();
                let ours: Vec<u64> = h.read_range(name, 0, from, next, 1 << 20).iter().map(|b| b.base_offset).collect();
                assert_eq!(ours, (from..next).collect::<Vec<_>>(), "round {round}, from {from}");
                assert_eq!(ours, theirs);
            }
        }
        let capped = h.read_range(name, 0, 10, next, 25);
        assert_eq!(capped.len(), 5, "stops once max_bytes is reached (6-byte records)");
        assert_eq!(capped[0].records.slices().next().unwrap(), b"r0-010");
        assert!(h.read_range(("t1", "default", "nope"), 0, 0, 10, 100).is_empty());
        // From another thread, as the tokio driver runs it.
        let got = std::thread::spawn(move || h.read_range(name, 0, 700, 705, 1 << 20)).join().unwrap();
        assert_eq!(got.iter().map(|b| b.base_offset).collect::<Vec<_>>(), (700..705).collect::<Vec<_>>());
    }

    /// Segments removed behind the reader's back (retention) and a shard emptied and written
    /// again (a copy moving here) are read as they are now, never through stale seek points.
    #[test]
    fn the_history_reader_follows_retention_and_a_shard_written_again() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(2 << 10);
        let name = ("t1", "default", "../orders");
        let mut h = s.history_reader();
        s.write((0..300).map(|i| req(i + 1, i, &[&format!("old-{i:03}")])).collect());
        assert_eq!(h.read_range(name, 0, 250, 300, 1 << 20).len(), 50);
        assert!(s.truncate_before(name, 0, 200, &[], None) > 0);
        let after: Vec<u64> = h.read_range(name, 0, 0, 300, 1 << 20).iter().map(|b| b.base_offset).collect();
        assert!(after[0] > 0 && after[0] <= 200, "retention removed the oldest segments: {}", after[0]);
        assert_eq!(*after.last().unwrap(), 299);
        // Emptied and written again from 0 with other contents and other batch sizes.
        s.reset_shard(name, 0).unwrap();
        s.write((0..100).map(|i| req(1000 + i, i * 3, &["new-a", "new-b", "new-c"])).collect());
        let got = h.read_range(name, 0, 151, 300, 1 << 20);
        assert_eq!(got.iter().map(|b| b.base_offset).collect::<Vec<_>>(), (50..100).map(|i| i * 3).collect::<Vec<_>>());
        assert_eq!(got[0].records.slices().next().unwrap(), b"new-a");
    }

    /// A segment rewritten in place (the same inode, as a file removed and made again may
    /// get): seek points found before are checked against the file, not trusted.
    #[test]
    fn the_history_reader_checks_its_seek_points_against_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        let name = ("t1", "default", "../orders");
        let mut h = s.history_reader();
        s.write((0..300).map(|i| req(i + 1, i, &[&format!("old-{i:03}")])).collect());
        assert_eq!(h.read_range(name, 0, 250, 300, 1 << 20)[0].base_offset, 250);
        drop(s);
        let shard = dir.path().join("streams/t1/default/%2E.%2Forders/0");
        let segs = segments(&shard).unwrap();
        assert_eq!(segs.len(), 1);
        let mut rewritten = BytesMut::new();
        for i in 0..200u64 {
            let b = StoredBatch {
                key: None,
                base_offset: i * 3,
                timestamp_micros: 5,
                generation_start: false,
                publisher: None,
                producer: None,
                state: None,
                records: Records::from_payloads([b"new-a".as_slice(), b"new-bb", b"new-ccc"]).unwrap(),
            };
            encode_batch(&b, &mut rewritten);
        }
        std::fs::write(&segs[0].1, &rewritten).unwrap();
        let got = h.read_range(name, 0, 201, 240, 1 << 20);
        assert_eq!(got.iter().map(|b| b.base_offset).collect::<Vec<_>>(), (67..80).map(|i| i * 3).collect::<Vec<_>>());
    }

    /// A commit in an old segment (known by its index only at start) still gives the broker its
    /// state: recovery reads the commit batches whole.
    #[test]
    fn commits_in_summarized_segments_are_read_for_their_state() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(200);
        let mut first = req(1, 0, &["opened"]);
        first.state =
            felix_proto::storage::encode_state_changes(&[("balance".into(), Some(Bytes::from_static(b"10")))]);
        let mut reqs = vec![first];
        reqs.extend((1..60).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])));
        s.write(reqs);
        drop(s);
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        let rec = s.recover_within(|_, _, _| 60).unwrap();
        assert!(rec[0].summaries.first().is_some_and(|e| e.base_offset == 0 && e.state), "the commit is summarized");
        assert_eq!(rec[0].state_batches.len(), 1);
        assert_eq!(rec[0].state_batches[0].base_offset, 0);
        assert_eq!(
            felix_proto::storage::decode_state_changes(rec[0].state_batches[0].state.as_ref().unwrap()).unwrap(),
            vec![("balance".to_string(), Some(Bytes::from_static(b"10")))]
        );
    }

    /// Retention's state checkpoint is on disk before any segment goes, comes back at
    /// recovery, and spares recovery the commits it holds (only later ones are read). A
    /// damaged one stops recovery with an error that names the file.
    #[test]
    fn a_state_checkpoint_is_kept_before_segments_go_and_bounds_what_recovery_reads() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(200);
        let commit = |token: u64, base: u64, key: &str| {
            let mut r = req(token, base, &["c"]);
            r.state = felix_proto::storage::encode_state_changes(&[(key.into(), Some(Bytes::from_static(b"v")))]);
            r
        };
        let mut reqs = vec![commit(1, 0, "old")];
        reqs.extend((1..30).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])));
        reqs.push(commit(31, 30, "mid"));
        reqs.extend((31..60).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])));
        s.write(reqs);
        let checkpoint = felix_proto::storage::StateCheckpoint {
            as_of: 30,
            values: vec![("mid".into(), Bytes::from_static(b"v"), 30), ("old".into(), Bytes::from_static(b"v"), 0)],
        };
        let file = felix_proto::storage::encode_state_checkpoint(&checkpoint).unwrap();
        // Retention below offset 20: the first commit's segment goes, the checkpoint stays.
        let name = ("t1", "default", "../orders");
        let ns = dir.path().join("streams").join("t1").join("default");
        let shard_dir = std::fs::read_dir(&ns).unwrap().next().unwrap().unwrap().path().join("0");
        // A truncation that deletes nothing writes nothing: every commit is still on disk.
        assert_eq!(s.truncate_before(name, 0, 1, &[], Some(&file)), 0);
        assert!(!shard_dir.join(STATE_CHECKPOINT).exists());
        assert!(s.truncate_before(name, 0, 20, &[], Some(&file)) > 0);
        assert_eq!(std::fs::read(shard_dir.join(STATE_CHECKPOINT)).unwrap(), file);
        drop(s);
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        let rec = s.recover_within(|_, _, _| 60).unwrap();
        assert_eq!(rec[0].state_checkpoint.as_ref(), Some(&checkpoint));
        assert!(rec[0].summaries.iter().any(|e| e.base_offset == 30 && e.state), "the later commit is summarized");
        assert!(rec[0].state_batches.is_empty(), "the checkpoint holds every commit: none is read");
        // A flipped bit: recovery stops and says which file and what moving it aside costs.
        let mut damaged = file.to_vec();
        damaged[10] ^= 1;
        std::fs::write(shard_dir.join(STATE_CHECKPOINT), damaged).unwrap();
        drop(s);
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        let e = s.recover_within(|_, _, _| 60).unwrap_err().to_string();
        assert!(e.contains("state.checkpoint") && e.contains("checksum") && e.contains("move it aside"), "{e}");
        // A shard holding no segment yet (a moved shard's copy, emptied for it) takes it.
        let empty = ("t1", "default", "fresh");
        s.truncate_before(empty, 0, 40, &[], Some(&file));
        let fresh = std::fs::read_dir(&ns).unwrap().flatten().map(|e| e.path()).find(|p| p.ends_with("fresh")).unwrap();
        assert_eq!(std::fs::read(fresh.join("0").join(STATE_CHECKPOINT)).unwrap(), file);
        std::fs::remove_dir_all(fresh).unwrap();
        // Moved aside: recovery goes on with the commits still on disk.
        std::fs::remove_file(shard_dir.join(STATE_CHECKPOINT)).unwrap();
        let rec = s.recover_within(|_, _, _| 60).unwrap();
        assert_eq!(rec[0].state_checkpoint, None);
        assert_eq!(rec[0].state_batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![30]);
    }

    /// Retention deletes no segment holding a commit the checkpoint on disk does not hold (nor
    /// any after it), whatever the truncation asks: the broker hands its state over once a
    /// second, not with every write. Across a restart too (the segments' commits come from
    /// their indexes, the checkpoint's `as_of` from its file).
    #[test]
    fn retention_keeps_a_segment_with_a_commit_newer_than_the_checkpoint() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(1);
        let mut commit = req(3, 2, &["c"]);
        commit.state = felix_proto::storage::encode_state_changes(&[("k".into(), Some(Bytes::from_static(b"v")))]);
        // One batch per segment: 0, 1, the commit at 2, 3, 4.
        s.write(vec![req(1, 0, &["a"]), req(2, 1, &["b"]), commit, req(4, 3, &["d"]), req(5, 4, &["e"])]);
        let name = ("t1", "default", "../orders");
        assert_eq!(s.truncate_before(name, 0, 4, &[], None), 2, "0 and 1 go; the commit and what follows stay");
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        let rec = s.recover().unwrap();
        assert_eq!(rec[0].batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![2, 3, 4]);
        assert_eq!(s.truncate_before(name, 0, 4, &[], None), 0, "still no checkpoint holding it");
        let older = felix_proto::storage::StateCheckpoint { as_of: 1, values: Vec::new() };
        let older = felix_proto::storage::encode_state_checkpoint(&older).unwrap();
        assert_eq!(s.truncate_before(name, 0, 4, &[], Some(&older)), 0, "a checkpoint before the commit");
        let holding =
            felix_proto::storage::StateCheckpoint { as_of: 2, values: vec![("k".into(), Bytes::from_static(b"v"), 2)] };
        let holding = felix_proto::storage::encode_state_checkpoint(&holding).unwrap();
        assert_eq!(s.truncate_before(name, 0, 4, &[], Some(&holding)), 2, "held by the checkpoint: it goes");
        let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
        assert_eq!(rec[0].batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![4]);
        assert_eq!(rec[0].state_checkpoint.as_ref().map(|c| c.as_of), Some(2));
    }

    #[test]
    fn recovery_reads_indexes_not_old_segments_and_rebuilds_a_bad_index() {
        use felix_proto::broker::{Broker, BrokerConfig, StreamConfig};
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        s.set_segment_bytes(200);
        let mut producer_req = req(1000, 100, &["idem"]);
        producer_req.producer = Some((77, 0));
        let mut reqs: Vec<_> = (0..100).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])).collect();
        reqs.push(producer_req);
        s.write(reqs);
        drop(s);
        let shard = dir.path().join("streams/t1/default/%2E.%2Forders/0");
        let segs = segments(&shard).unwrap();
        assert!(segs.len() > 10);
        let sealed = &segs[..segs.len() - 1];
        assert!(sealed.iter().all(|(_, p)| index_path(p).exists()), "every sealed segment has an index");
        // Make an old segment unreadable: recovery must not need it (its index says enough).
        let victim = &sealed[1].1;
        let original = std::fs::read(victim).unwrap();
        let mut garbage = original.clone();
        garbage.iter_mut().skip(20).for_each(|b| *b = 0xAA);
        std::fs::write(victim, &garbage).unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        let rec = s.recover_within(|_, _, _| 60).unwrap();
        assert!(rec[0].repairs.is_empty(), "{:?}", rec[0].repairs);
        let summarized: u64 = rec[0].summaries.iter().map(|e| e.count).sum();
        let whole: u64 = rec[0].batches.iter().map(|b| b.count()).sum();
        assert_eq!(summarized + whole, 101);
        assert!(whole <= 15 && summarized >= 85, "only the newest part is read whole: {whole}");
        assert_eq!(rec[0].batches.last().unwrap().producer, Some((77, 0)));
        // The broker rebuilds the same state from summaries as from whole batches.
        let restore = |rec: &RecoveredShard| {
            let cfg = BrokerConfig { history_reads: true, ..BrokerConfig::default() };
            let t0 = felix_proto::transport::WallClock::new(std::time::Instant::now(), 0); // test clock
            let mut b = Broker::new(cfg, t0);
            let now = std::time::Instant::now();
            let name = ("t1", "default", "../orders");
            b.restore_shard_summaries(name, StreamConfig::default(), 0, &rec.summaries, now);
            b.restore_shard(name, StreamConfig::default(), 0, rec.batches.clone(), now);
            b.shard_state("t1", "default", "../orders", 0)
        };
        std::fs::write(victim, &original).unwrap();
        let full = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
        assert_eq!(restore(&rec[0]), restore(&full[0]));
        // A damaged index is rebuilt from its segment.
        let idx = index_path(&sealed[3].1);
        std::fs::write(&idx, b"FLXI nonsense").unwrap();
        let rec2 = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover_within(|_, _, _| 60).unwrap();
        assert_eq!(rec2[0].summaries, rec[0].summaries);
        assert!(decode_index(&std::fs::read(&idx).unwrap(), std::fs::metadata(&sealed[3].1).unwrap().len()).is_ok());
        // The newest segment, continued after the restart, gets a whole index when it is sealed
        // (its entries from before the restart included).
        let newest = segs.last().unwrap().1.clone();
        let more: Vec<_> = (0..10).map(|i| req(2000 + i, 101 + i, &[&format!("later-{i:03}")])).collect();
        s.set_segment_bytes(200);
        assert!(s.write(more).iter().all(|r| r.1 == WriteOutcome::Written));
        let sealed_now =
            decode_index(&std::fs::read(index_path(&newest)).unwrap(), std::fs::metadata(&newest).unwrap().len())
                .expect("sealed with a sound index");
        let scanned = decode_segment(Bytes::from(std::fs::read(&newest).unwrap()));
        assert_eq!(sealed_now.len(), scanned.batches.len());
        assert_eq!(sealed_now.last().map(|e| e.base_offset), scanned.batches.last().map(|b| b.base_offset));
        // History reads still find old records through the recovered index.
        let got: Vec<u64> =
            s.read_range(("t1", "default", "../orders"), 0, 5, 8, 1 << 20).iter().map(|b| b.base_offset).collect();
        assert_eq!(got, vec![5, 6, 7]);
    }

    #[test]
    fn each_stream_keeps_its_own_fsync_policy() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
        let mut always = req(1, 0, &["a"]);
        always.fsync = Some(felix_proto::broker::FsyncMode::Always);
        let mut plain = req(2, 0, &["b"]);
        plain.stream = "other".into();
        let res = s.write(vec![always, plain]);
        assert!(res.iter().all(|r| r.1 == WriteOutcome::Written));
        assert_eq!(s.syncs(), 1, "only the `always` stream's file was synced");
        let mut interval = req(3, 1, &["c"]);
        interval.fsync = Some(felix_proto::broker::FsyncMode::Interval(Duration::ZERO));
        s.write(vec![interval]);
        assert_eq!(s.syncs(), 2, "an interval of zero is due at once");
        let mut never = req(4, 1, &["d"]);
        never.stream = "other".into();
        s.write(vec![never]);
        s.sync_due();
        assert_eq!(s.syncs(), 2, "the storage default here is never");
    }

    #[test]
    fn fsync_policy_parses() {
        assert_eq!("always".parse(), Ok(FsyncMode::Always));
        assert_eq!("interval:50".parse(), Ok(FsyncMode::Interval(Duration::from_millis(50))));
        assert!("sometimes".parse::<FsyncMode>().is_err());
        for m in [FsyncMode::Always, FsyncMode::Never, FsyncMode::Interval(Duration::from_millis(100))] {
            assert_eq!(m.to_string().parse(), Ok(m), "printed as it is written: {m}");
        }
    }
}
