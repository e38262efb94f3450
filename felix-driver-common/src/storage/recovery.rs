//! Recovery at start: every shard's segments scanned (torn tails cut, damage repaired and
//! reported), its producers' watermarks and commit-state checkpoint read back, within a memory
//! budget per stream.

use super::*;

impl DiskStorage {
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
}

/// The file beside a shard's segments that keeps its producer watermarks.
pub(super) const WATERMARKS: &str = "producers.watermarks";

/// Reads a shard's producer watermarks; a damaged file is reported in `repairs` and read as
/// none (recovery goes on: the broker then treats retention-removed sequences inside a
/// producer's window as never landed, as it did before this file existed).
pub(super) fn read_watermarks(shard_dir: &Path, repairs: &mut Vec<String>) -> Vec<(u64, u64)> {
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
pub(super) const STATE_CHECKPOINT: &str = "state.checkpoint";

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
    pub(super) fn entries(&self) -> &[IndexEntry] {
        match self {
            Part::Indexed(e) | Part::Scanned(_, e) => e,
        }
    }
}

/// What recovery found in one shard's directory.
struct ShardFiles {
    /// Entries of the segments known by their index only.
    pub(super) summaries: Vec<IndexEntry>,
    /// The newest batches, read whole.
    pub(super) batches: Vec<StoredBatch>,
    /// The commit batches among `summaries`, read whole for their state.
    pub(super) state_batches: Vec<StoredBatch>,
    pub(super) repairs: Vec<String>,
    pub(super) index: SegmentIndex,
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
