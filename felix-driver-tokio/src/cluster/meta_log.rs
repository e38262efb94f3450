//! The metadata group's Raft log on disk: one file, appended and synced, rewritten whole once it
//! has grown to several times what it keeps.

pub(crate) fn raft_log_path(data_dir: &std::path::Path) -> std::path::PathBuf {
    data_dir.join("cluster").join("raft.log")
}

/// Writes the kept Raft log: to a temporary file, synced, renamed over the old one, directory
/// synced, so the file is always one whole version.
pub(crate) fn write_raft_log(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The metadata group's kept Raft log, an append-only file of records (the replica logs'
/// format, [`encode_log_record`]): each run of persists is appended and synced, and the file
/// is rewritten whole (to a temporary file, synced, renamed) only once it grew to several times
/// what the log holds. Before, every persist rewrote the whole log: with thousands of shards
/// (a `Create` each, a `Lead` per election) that was megabytes per persist, on the broker's
/// task. A file in the older whole-log format is read and rewritten as records.
///
/// [`encode_log_record`]: felix_proto::cluster::meta::encode_log_record
pub(crate) struct MetaLog {
    pub(super) path: std::path::PathBuf,
    pub(super) file: Option<std::fs::File>,
    /// The file's length, and its length after the last whole rewrite.
    pub(super) len: u64,
    pub(super) base: u64,
    pub(super) scratch: Vec<u8>,
    /// Whole rewrites since it was opened.
    pub(super) rewrites: u64,
}

/// The file is rewritten whole once it is this many times its last rewrite (and past
/// [`META_LOG_REWRITE_MIN`]).
const META_LOG_REWRITE_FACTOR: u64 = 4;

const META_LOG_REWRITE_MIN: u64 = 1 << 20;

impl MetaLog {
    /// Opens the file at `path` (or starts none) and reads back the log it holds. A torn last
    /// record (a crash mid-append: never synced, never acted on) is cut.
    ///
    /// # Errors
    /// The read's error, or `InvalidData` for a file that is damaged (a checksum that fails, a
    /// break with whole records after it): it is not trusted, and the broker does not start.
    pub(crate) fn open(path: &std::path::Path) -> std::io::Result<(MetaLog, felix_proto::cluster::meta::RaftLog)> {
        use felix_proto::cluster::meta::RaftLog;
        let mut m = MetaLog { path: path.to_owned(), file: None, len: 0, base: 0, scratch: Vec::new(), rewrites: 0 };
        if !path.exists() {
            return Ok((m, RaftLog::default()));
        }
        let bad = |why: String| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {why} (move it away to rejoin the cluster as a new member)", path.display()),
            )
        };
        let bytes = std::fs::read(path)?;
        if bytes.starts_with(b"FLXR") {
            // The older format: the whole log in one checksummed body. Rewritten as records.
            let log = RaftLog::decode(&bytes).map_err(|e| bad(e.to_string()))?;
            m.rewrite(&log)?;
            return Ok((m, log));
        }
        let (log, infos, damage) = felix_proto::cluster::meta::fold_log_segments_checked(&[&bytes]);
        if let Some(d) = damage {
            return Err(bad(format!("damaged at byte {}: {}", d.offset, d.kind)));
        }
        let whole = infos.first().map_or(0, |i| i.whole) as u64;
        let f = std::fs::OpenOptions::new().append(true).open(path)?;
        if whole < bytes.len() as u64 {
            tracing::warn!(
                "{}: {} bytes after the last whole record (a write cut short) were dropped",
                path.display(),
                bytes.len() as u64 - whole
            );
            f.set_len(whole)?;
        }
        f.sync_all()?;
        m.file = Some(f);
        m.len = whole;
        m.base = whole;
        Ok((m, log))
    }

    /// Appends the persists of one run (entries, hard state), synced before it returns;
    /// then rewrites the file whole if it grew to several times `log` (the log they leave).
    ///
    /// # Errors
    /// The write's or the sync's error.
    pub(crate) fn append(
        &mut self,
        parts: &[(Vec<felix_proto::cluster::meta::Entry>, Option<felix_proto::cluster::meta::HardState>)],
        log: &felix_proto::cluster::meta::RaftLog,
    ) -> std::io::Result<()> {
        use std::io::Write;
        if parts.is_empty() {
            return Ok(());
        }
        if self.file.is_none() {
            return self.rewrite(log);
        }
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        for (entries, hs) in parts {
            if !entries.is_empty() || hs.is_some() {
                felix_proto::cluster::meta::encode_log_record_into(&mut buf, entries, hs.as_ref());
            }
        }
        let r = match self.file.as_mut() {
            Some(f) => f.write_all(&buf).and_then(|()| f.sync_data()),
            None => Ok(()),
        };
        self.len += buf.len() as u64;
        self.scratch = buf;
        r?;
        if self.len > META_LOG_REWRITE_MIN && self.len > self.base.saturating_mul(META_LOG_REWRITE_FACTOR) {
            self.rewrite(log)?;
        }
        Ok(())
    }

    /// Writes `log` whole as a new file (a snapshot record if it has one, then one record of
    /// its entries and hard state), synced and renamed over the old one. A metadata snapshot
    /// (D62) is written this way: the records before it are no longer needed.
    ///
    /// # Errors
    /// The write's, the sync's or the rename's error (the old file is then still whole).
    pub(crate) fn rewrite(&mut self, log: &felix_proto::cluster::meta::RaftLog) -> std::io::Result<()> {
        use felix_proto::cluster::meta::{HardState, encode_log_record, encode_snapshot_record};
        let mut bytes = Vec::new();
        if let Some(s) = &log.snapshot {
            bytes.extend_from_slice(&encode_snapshot_record(s));
        }
        // A record's hard state is one Raft wrote, never the zero one (the fold checks it).
        let hs = (log.hard_state != HardState::default()).then_some(&log.hard_state);
        if !log.entries.is_empty() || hs.is_some() {
            bytes.extend_from_slice(&encode_log_record(&log.entries, hs));
        }
        write_raft_log(&self.path, &bytes)?;
        self.file = Some(std::fs::OpenOptions::new().append(true).open(&self.path)?);
        self.len = bytes.len() as u64;
        self.base = self.len.max(1);
        self.rewrites += 1;
        Ok(())
    }
}

#[cfg(test)]
mod meta_log_tests {
    use super::*;
    use felix_proto::cluster::meta::{Entry, HardState, RaftLog};

    pub(super) fn entry(index: u64, term: u64) -> Entry {
        Entry { index, term, data: format!("command {index}").into_bytes().into(), ..Entry::default() }
    }

    /// Persists are appended (not the whole log each time) and read back as the log they
    /// leave, an overwritten tail included; the file is rewritten whole only once it grew to
    /// several times the log; a torn last record is cut; a file of the older whole-log format
    /// is read and rewritten as records; a damaged one refuses to open.
    #[test]
    pub(super) fn the_metadata_log_is_appended_read_back_rewritten_when_large_and_refused_when_damaged() {
        let dir = std::env::temp_dir().join(format!("felix-meta-log-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("raft.log");
        let (mut m, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, RaftLog::default());
        let mut want = RaftLog::default();
        let mut max = 0;
        for i in 1..=3000u64 {
            // A new leader overwrites the uncommitted tail now and then.
            let (from, term) = if i % 500 == 0 { (i - 3, 1 + i / 500) } else { (i, 1 + i / 500) };
            let entries: Vec<Entry> = (from..=i).map(|k| entry(k, term)).collect();
            let hs = HardState { term, commit: i.saturating_sub(2), ..HardState::default() };
            want.persist(&entries, Some(&hs));
            // Most persists change only the hard state (a commit): the file grows, the log not.
            let commits: Vec<_> = (0..20).map(|_| (Vec::new(), Some(hs.clone()))).collect();
            m.append(&[(entries, Some(hs.clone()))], &want).unwrap();
            m.append(&commits, &want).unwrap();
            max = max.max(std::fs::metadata(&path).unwrap().len());
        }
        let whole = (want.encode().len() + 64) as u64;
        assert!((2..20).contains(&m.rewrites), "{} whole rewrites in 6000 appends", m.rewrites);
        assert!(
            max <= (META_LOG_REWRITE_FACTOR * whole).max(META_LOG_REWRITE_MIN) + (64 << 10),
            "the file reached {max} bytes for a log of {whole}"
        );
        drop(m);
        let (mut m, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want, "read back");
        // A torn last record is cut, and what came before stands.
        let e = entry(3001, 7);
        let hs = HardState { term: 7, commit: 2999, ..HardState::default() };
        m.append(&[(vec![e.clone()], Some(hs.clone()))], &want).unwrap();
        drop(m);
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 3).unwrap();
        let (_, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want, "the torn record was cut");
        assert!(std::fs::metadata(&path).unwrap().len() < len - 3);
        // The older format: read, and rewritten as records.
        write_raft_log(&path, &want.encode()).unwrap();
        let (mut m, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want);
        assert!(!std::fs::read(&path).unwrap().starts_with(b"FLXR"), "rewritten as records");
        want.persist(std::slice::from_ref(&e), Some(&hs));
        m.append(&[(vec![e], Some(hs))], &want).unwrap();
        drop(m);
        assert_eq!(MetaLog::open(&path).unwrap().1, want);
        // A flipped bit in the middle: refused, with the file named.
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let err = MetaLog::open(&path).err().expect("refused");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("raft.log"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A metadata snapshot (D62) rewrites the file as the snapshot and the entries after it:
    /// the records before it are gone from the disk, appends go on after it, and it all
    /// reads back as the log the broker holds.
    #[test]
    pub(super) fn a_metadata_snapshot_replaces_the_records_before_it_in_the_file() {
        use felix_proto::cluster::meta::Snapshot;
        let dir = std::env::temp_dir().join(format!("felix-meta-snap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("raft.log");
        let (mut m, _) = MetaLog::open(&path).unwrap();
        let mut want = RaftLog::default();
        for i in 1..=2000u64 {
            let hs = HardState { term: 1, commit: i, ..HardState::default() };
            want.persist(&[entry(i, 1)], Some(&hs));
            m.append(&[(vec![entry(i, 1)], Some(hs))], &want).unwrap();
        }
        let before = std::fs::metadata(&path).unwrap().len();
        let mut snap = Snapshot::default();
        snap.set_data(b"the metadata at 1990".to_vec().into());
        snap.mut_metadata().index = 1990;
        snap.mut_metadata().term = 1;
        want.persist_snapshot(&snap);
        m.rewrite(&want).unwrap();
        let after = std::fs::metadata(&path).unwrap().len();
        assert!(after * 20 < before, "{after} bytes after the snapshot, {before} before");
        for i in 2001..=2010u64 {
            let hs = HardState { term: 1, commit: i, ..HardState::default() };
            want.persist(&[entry(i, 1)], Some(&hs));
            m.append(&[(vec![entry(i, 1)], Some(hs))], &want).unwrap();
        }
        drop(m);
        let (_, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want);
        assert_eq!(kept.snapshot.as_ref().map(|s| s.get_metadata().index), Some(1990));
        assert_eq!(kept.entries.first().map(|e| e.index), Some(1991));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
