//! Opening the replica logs at start: each shard's segments read back (from their summaries
//! where one is kept), their last commit and snapshot floor found, damaged files quarantined.

use super::*;

/// Moves a damaged replica log's segments to `replicas/damaged/` (each name gets the time it
/// was set aside, so a second damage of the same shard never overwrites the first), synced so
/// the move survives a power cut; returns the directory.
fn quarantine(dir: &std::path::Path, shard: &ShardId, seqs: &[u64]) -> std::io::Result<std::path::PathBuf> {
    let aside = dir.join("damaged");
    std::fs::create_dir_all(&aside)?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    for seq in seqs {
        let name = replica_file_name(shard, *seq);
        let mut to = aside.join(format!("{name}.{stamp}"));
        let mut n = 1;
        while to.exists() {
            to = aside.join(format!("{name}.{stamp}-{n}"));
            n += 1;
        }
        std::fs::rename(dir.join(&name), &to)?;
        let _ = std::fs::remove_file(dir.join(summary_file_name(shard, *seq)));
    }
    std::fs::File::open(&aside)?.sync_all()?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(aside)
}

/// A closed segment's summary file name (`….log` → `….sum`).
pub(super) fn summary_file_name(s: &ShardId, seq: u64) -> String {
    let name = replica_file_name(s, seq);
    format!("{}.sum", name.strip_suffix(".log").unwrap_or(&name))
}

/// The summary beside a closed segment of `len` bytes, if there is one that is whole and
/// stands for exactly those bytes (anything else: `None`, and the segment is folded from its
/// records).
fn read_summary(
    dir: &std::path::Path,
    shard: &ShardId,
    seq: u64,
    len: u64,
) -> Option<felix_proto::cluster::segment_summary::SegmentSummary> {
    let bytes = std::fs::read(dir.join(summary_file_name(shard, seq))).ok()?;
    match felix_proto::cluster::segment_summary::SegmentSummary::decode(&bytes) {
        Ok(s) if s.len == len => Some(s),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!("{}: {e}; its segment is read whole", summary_file_name(shard, seq));
            None
        }
    }
}

/// Writes a closed segment's summary beside it (through a temporary file and a rename, so a
/// crash leaves the old one, none or the new one; not synced: one lost or cut short by a power
/// cut fails its length or checksum check and the segment is read whole).
pub(super) fn write_summary(dir: &std::path::Path, shard: &ShardId, seq: u64, bytes: &[u8]) -> std::io::Result<()> {
    let name = summary_file_name(shard, seq);
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(name))
}

/// The commit index the last hard state of a segment file says (0: none), reading record
/// headers and the last record that carries a hard state.
fn last_commit_of(path: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let (mut at, mut with_state) = (0u64, Vec::new());
    let mut head = [0u8; 5];
    while at + 5 <= len {
        f.read_exact_at(&mut head, at)?;
        let n = u64::from(u32::from_be_bytes([head[0], head[1], head[2], head[3]]));
        if n == 0 || at + 4 + n > len {
            break;
        }
        if head[4] == 1 {
            with_state.push((at, n));
        }
        at += 4 + n;
    }
    // From the last: a record that fails its checksum says nothing (the fold judges it).
    for (at, n) in with_state.into_iter().rev() {
        let mut record = vec![0; 4 + n as usize];
        f.read_exact_at(&mut record, at)?;
        let commit = felix_proto::cluster::meta::LogFold::last_commit(&record);
        if commit > 0 {
            return Ok(commit);
        }
    }
    Ok(0)
}

/// [`LogFold::snapshot_floor`] of a segment file, reading only each record's length and flag
/// (and the snapshot records whole): a restart's first pass, without reading the entries
/// (the fold reads them once, next).
///
/// [`LogFold::snapshot_floor`]: felix_proto::cluster::meta::LogFold::snapshot_floor
pub(super) fn snapshot_floor_of(path: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let (mut at, mut floor) = (0u64, 0u64);
    let mut head = [0u8; 5];
    while at + 5 <= len {
        f.read_exact_at(&mut head, at)?;
        let n = u64::from(u32::from_be_bytes([head[0], head[1], head[2], head[3]]));
        if n == 0 || at + 4 + n > len {
            break; // a torn or damaged tail: the fold judges it
        }
        if head[4] == 2 {
            let mut record = vec![0; 4 + n as usize];
            f.read_exact_at(&mut record, at)?;
            floor = floor.max(felix_proto::cluster::meta::LogFold::snapshot_floor(&record));
        }
        at += 4 + n;
    }
    Ok(floor)
}

impl ReplicaLogs {
    /// Opens the directory (nothing is kept without a data directory) and reads back every
    /// replica's log. A segment torn by a crash mid-append is cut back to its last whole
    /// record; a file whose name is not a shard's is left alone and said. A log found damaged
    /// (a flipped bit, a closed segment cut short, a gap: [`LogDamage`]) is neither served
    /// nor voted from: its files are moved to `replicas/damaged/` (kept for an operator, never
    /// read again) and the shard is returned among the damaged, with why, for its replica to
    /// rejoin its group afresh ([`ClusterNode::set_damaged_replicas`]).
    ///
    /// [`LogDamage`]: felix_proto::cluster::meta::LogDamage
    /// [`ClusterNode::set_damaged_replicas`]: felix_proto::cluster::node::ClusterNode::set_damaged_replicas
    ///
    /// With `keep`, a log is read one segment at a time and its committed entries beyond
    /// `keep` bytes are left on disk ([`LogFold`]): the replica replays them in bounded reads
    /// ([`ReplicaLogs::read_job`]) as it starts, so a restart holds one segment, the
    /// uncommitted tail and `keep` bytes, whatever the retained log. `None`: every entry is
    /// held (tests).
    ///
    /// [`LogFold`]: felix_proto::cluster::meta::LogFold
    pub(crate) fn open(
        data_dir: Option<&std::path::Path>,
        sync_every: Option<std::time::Duration>,
        keep: Option<u64>,
    ) -> std::io::Result<OpenedReplicaLogs> {
        let dir = data_dir.map(|d| d.join("cluster").join("replicas"));
        let mut kept = std::collections::BTreeMap::new();
        let mut damaged = std::collections::BTreeMap::new();
        let mut shards = std::collections::BTreeMap::new();
        let (mut read_from_summaries, mut read_whole) = (0usize, 0usize);
        if let Some(dir) = &dir
            && dir.exists()
        {
            let mut found: std::collections::BTreeMap<ShardId, Vec<u64>> = Default::default();
            for e in std::fs::read_dir(dir)? {
                let e = e?;
                if e.file_type()?.is_dir() {
                    continue; // `damaged/`: logs set aside
                }
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".sum") {
                    continue; // a closed segment's summary, read with it
                }
                let Some((shard, seq)) = parse_replica_file_name(&name) else {
                    if !name.ends_with(".tmp") {
                        tracing::warn!("{}: not a replica's log, left alone", e.path().display());
                    }
                    continue;
                };
                found.entry(shard).or_default().push(seq);
            }
            for (shard, mut seqs) in found {
                seqs.sort_unstable();
                let path_of = |seq: u64| dir.join(replica_file_name(&shard, seq));
                // Which closed segments fold from their summary: with a budget, every one whose
                // summary stands for exactly the file (what stays in memory then comes from the
                // last segment, read whole: reading a 64 MiB segment to keep a few MiB of it
                // cost more than replaying them).
                let mut lens = Vec::with_capacity(seqs.len());
                for seq in &seqs {
                    lens.push(std::fs::metadata(path_of(*seq))?.len());
                }
                let mut summaries: Vec<Option<felix_proto::cluster::segment_summary::SegmentSummary>> =
                    vec![None; seqs.len()];
                if keep.is_some() {
                    for i in 0..seqs.len().saturating_sub(1) {
                        summaries[i] = read_summary(dir, &shard, seqs[i], lens[i]);
                    }
                }
                let commit = match (summaries.iter().any(Option::is_some), seqs.last()) {
                    (true, Some(last)) => last_commit_of(&path_of(*last))?,
                    _ => 0,
                };
                // The snapshot records a summary names, read from its segment.
                let snapshots_of = |seq: u64, sum: &felix_proto::cluster::segment_summary::SegmentSummary| {
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::File::open(path_of(seq))?;
                    sum.snapshots()
                        .map(|(pos, len)| {
                            let mut b = vec![0; len as usize];
                            f.read_exact_at(&mut b, pos).map(|()| b)
                        })
                        .collect::<std::io::Result<Vec<Vec<u8>>>>()
                };
                // Two passes, one segment at a time: the last snapshot's index, then the fold.
                // Each segment is read into one buffer that the entries folded from it share:
                // a buffer is freed once its entries left memory (spilled, with `keep`).
                use felix_proto::cluster::meta::LogFold;
                let mut floor = 0;
                for (seq, sum) in seqs.iter().zip(&summaries) {
                    let f = match sum {
                        Some(sum) => {
                            snapshots_of(*seq, sum)?.iter().map(|r| LogFold::snapshot_floor(r)).max().unwrap_or(0)
                        }
                        None => snapshot_floor_of(&path_of(*seq))?,
                    };
                    floor = floor.max(f);
                }
                let mut fold = LogFold::new(floor, keep);
                let mut summarised = vec![false; seqs.len()];
                for (i, seq) in seqs.iter().enumerate() {
                    if let Some(sum) = &summaries[i] {
                        let records: Vec<bytes::Bytes> = snapshots_of(*seq, sum)?.into_iter().map(Into::into).collect();
                        if fold.feed_summary(sum, &records, commit) {
                            summarised[i] = true;
                            if fold.damage().is_some() {
                                break;
                            }
                            continue;
                        }
                    }
                    let data = bytes::Bytes::from(std::fs::read(path_of(*seq))?);
                    lens[i] = data.len() as u64;
                    if !fold.feed(&data, Some(&data), i + 1 == seqs.len()) {
                        break;
                    }
                }
                let builders = fold.take_builders();
                // The last snapshot record, where a follower behind is read it from.
                let last_snapshot = (0..seqs.len()).rev().find_map(|i| {
                    let at = match (&summaries[i], builders.get(i).and_then(Option::as_ref)) {
                        (_, Some(b)) => b.last_snapshot(),
                        (Some(sum), None) => sum.snapshots().last(),
                        (None, None) => None,
                    };
                    at.map(|(pos, len)| (seqs[i], pos, len))
                });
                let (mut log, infos, damage, mut points) = fold.finish();
                if keep.is_some() {
                    // The entries left in memory (at most `keep` bytes) share the buffer their
                    // segment was read into, up to 64 MiB of which the rest is entries now on
                    // disk only and the snapshot the host restores from (and then copies its
                    // values out of). Copied out, that buffer goes once the replica started,
                    // rather than living as long as the newest of them: on an idle shard, for
                    // ever. (Without a budget every entry stays: sharing is then the smaller.)
                    for e in &mut log.entries {
                        e.data = bytes::Bytes::copy_from_slice(&e.data);
                        e.context = bytes::Bytes::copy_from_slice(&e.context);
                    }
                }
                if let Some(d) = damage {
                    let path = dir.join(replica_file_name(&shard, seqs[d.segment.min(seqs.len() - 1)]));
                    let why = format!("{}, byte {}: {}", path.display(), d.offset, d.kind);
                    let aside = quarantine(dir, &shard, &seqs)?;
                    tracing::error!(
                        "replica log damaged: {why}. It is neither served nor voted from: moved to {}; the \
                         replica rejoins its group afresh and catches up from its peers",
                        aside.display()
                    );
                    damaged.insert(shard, why);
                    continue;
                }
                // A large host state in the kept snapshot stays on disk: the replica reads it
                // back from the last snapshot record a piece at a time as it starts, rather
                // than the record (read whole above, let go now) and the state built from it
                // being in memory together, for every replica until each started. Only when
                // that record reads as this snapshot's (it is the last one written).
                if keep.is_some()
                    && let (Some((seq, pos, len)), Some(s)) = (last_snapshot, log.snapshot.as_ref())
                {
                    let index = s.get_metadata().index;
                    let (path, max, verify) = (path_of(seq), 1, false);
                    let probe = ReplicaSnapshotRead { path, pos, len, index, offset: 0, max, verify };
                    if probe.run().is_ok_and(|p| p.total == s.get_data().len() as u64) {
                        use felix_proto::cluster::node::{ClusterNode, RESTORE_IN_PIECES_MIN};
                        ClusterNode::leave_kept_state_on_disk(&mut log, RESTORE_IN_PIECES_MIN);
                    }
                }
                points.map_segments(|i| seqs.get(i as usize).copied().unwrap_or(u64::MAX));
                let mut files = ShardFiles {
                    hard_state: Some(log.hard_state.clone()),
                    points,
                    snapshot: last_snapshot,
                    ..ShardFiles::default()
                };
                let n = seqs.len();
                for (i, (((seq, info), len), builder)) in seqs.iter().zip(&infos).zip(&lens).zip(builders).enumerate() {
                    let path = dir.join(replica_file_name(&shard, *seq));
                    let len = *len as usize;
                    if i + 1 == n {
                        // Appended to again: the builder goes on; a summary left from a crash
                        // just after it was closed no longer stands for it.
                        files.summary = builder;
                        let _ = std::fs::remove_file(dir.join(summary_file_name(&shard, *seq)));
                    } else if let Some(b) = builder.and_then(|b| b.encode()) {
                        // Read whole without a summary (an older broker's, or one lost): it
                        // gets one, so the next restart need not read it.
                        if summaries[i].is_none()
                            && !dir.join(summary_file_name(&shard, *seq)).exists()
                            && let Err(e) = write_summary(dir, &shard, *seq, &b)
                        {
                            tracing::warn!("writing the summary of {}: {e}", path.display());
                        }
                    }
                    if info.whole < len {
                        tracing::warn!(
                            "{}: {} bytes after the last whole record (a write cut short) were dropped",
                            path.display(),
                            len - info.whole
                        );
                        let f = std::fs::OpenOptions::new().write(true).open(&path)?;
                        f.set_len(info.whole as u64)?;
                        f.sync_all()?;
                    } else {
                        // What the broker wrote before it was killed but had not synced is still
                        // in the page cache: it reaches the disk now, before this replica says it
                        // holds any of it (else a power cut after the restart could take back
                        // an entry it acknowledged since).
                        std::fs::File::open(&path)?.sync_data()?;
                    }
                    felix_driver_common::sync_journal::synced(&path, info.whole as u64);
                    files.segments.push((*seq, info.max_index));
                    files.len = info.whole as u64;
                }
                read_from_summaries += summarised.iter().filter(|s| **s).count();
                read_whole += summarised.iter().filter(|s| !**s).count();
                shards.insert(shard.clone(), files);
                kept.insert(shard, log);
            }
            let spilled: u64 = kept.values().filter_map(|l| l.spill.as_ref()).map(|s| s.end() - s.first()).sum();
            let held: u64 = kept.values().map(|l| l.entries.len() as u64).sum();
            if !kept.is_empty() {
                tracing::info!(
                    "replica logs read back: {} shards, {held} entries held, {spilled} committed entries left on disk \
                     (replayed from the files as each replica starts: felix_replicas_replaying); {read_from_summaries} \
                     closed segments folded from their summaries, {read_whole} segments read whole",
                    kept.len()
                );
            }
        }
        let logs = ReplicaLogs {
            dir,
            shards,
            dirty: Default::default(),
            sync_every,
            last_sync: std::time::Instant::now(),
            failures: 0,
            segment_bytes: SEGMENT_BYTES,
            scratch: Vec::new(),
        };
        Ok(OpenedReplicaLogs { logs, kept, damaged, summarised: read_from_summaries })
    }
}
