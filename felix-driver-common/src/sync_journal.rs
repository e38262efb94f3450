//! What reached the disk, for power-cut tests.
//!
//! A SIGKILL loses nothing the broker wrote: the kernel's page cache keeps it. A power cut (or
//! a kernel crash) loses every byte written since the file's last `fsync`, and that is where a
//! broker that acknowledges too early loses acknowledged records (Jepsen's NATS 2.12 analysis).
//! With `FELIX_SYNC_JOURNAL=PATH` in its environment, a broker appends one line to `PATH` each
//! time a file it keeps reaches the disk (`LEN\tPATH`: the file's length when the sync began)
//! and each time it creates one (length 0). [`power_cut`] then does to a stopped broker's files
//! what a power cut would have: every journalled file is cut back to the length it last
//! reached the disk at, so what was only in the page cache is gone. Like Jepsen's LazyFS, but
//! in the process: no FUSE, no root.
//!
//! `FELIX_FAULT_SYNC_DELAY_MS=N` makes every such sync take N ms longer (a slow disk): the
//! window in which written bytes are not yet on disk grows from a fraction of a millisecond to
//! N ms, so a test can tell a broker that waits for its syncs from one that does not.
//! `FELIX_FAULT_SYNC_FAIL_AFTER=N` makes every such sync after the first N fail with `EIO` (a
//! failing disk): what the broker does then (it stops, exit 74) can be tested.
//!
//! `FELIX_FAULT_FULL_AFTER_BYTES=N` makes every append to a replica log fail with `ENOSPC`
//! once N bytes were appended (a full disk): what the broker does then (that replica stops,
//! said in `cluster status`; the others carry on) can be tested.
//!
//! Off (the default) each costs one load of an initialised `OnceLock` per sync or append.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

static JOURNAL: OnceLock<Option<Mutex<std::fs::File>>> = OnceLock::new();

/// The environment variable that turns the journal on.
pub const ENV: &str = "FELIX_SYNC_JOURNAL";

fn journal() -> Option<&'static Mutex<std::fs::File>> {
    JOURNAL
        .get_or_init(|| {
            let path = std::env::var_os(ENV)?;
            match std::fs::OpenOptions::new().create(true).append(true).open(&path) {
                Ok(f) => Some(Mutex::new(f)),
                Err(e) => {
                    tracing::error!("{ENV}={}: {e}; no sync journal is kept", Path::new(&path).display());
                    None
                }
            }
        })
        .as_ref()
}

/// The environment variable that slows every sync down (a slow disk, for tests).
pub const DELAY_ENV: &str = "FELIX_FAULT_SYNC_DELAY_MS";

static DELAY: OnceLock<Option<std::time::Duration>> = OnceLock::new();

/// The environment variable that makes every sync after the first N fail (a failing disk,
/// for tests): `EIO`, as the kernel reports a write-back error.
pub const FAIL_AFTER_ENV: &str = "FELIX_FAULT_SYNC_FAIL_AFTER";

static FAIL_AFTER: OnceLock<Option<u64>> = OnceLock::new();
static SYNCS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// The environment variable that makes replica-log appends fail with `ENOSPC` once this many
/// bytes were appended (a full disk, for tests).
pub const FULL_AFTER_ENV: &str = "FELIX_FAULT_FULL_AFTER_BYTES";

static FULL_AFTER: OnceLock<Option<u64>> = OnceLock::new();
static APPENDED: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Call right before appending `len` bytes to a replica log: fails with `ENOSPC` once the
/// configured number of bytes went in (a full disk; nothing of this append is written).
///
/// # Errors
/// The injected failure (`ENOSPC`), with `FELIX_FAULT_FULL_AFTER_BYTES` set.
pub fn before_append(len: usize) -> std::io::Result<()> {
    let full_after = FULL_AFTER.get_or_init(|| std::env::var(FULL_AFTER_ENV).ok()?.parse().ok());
    if let Some(n) = full_after {
        let before = APPENDED.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
        if before + len as u64 > *n {
            return Err(std::io::Error::from_raw_os_error(28)); // ENOSPC
        }
    }
    Ok(())
}

/// Call right before an `fsync` of a file the journal covers: sleeps for the configured delay,
/// if any (a slow disk), and fails once the configured number of syncs went through (a failing
/// disk).
///
/// # Errors
/// The injected failure (`EIO`), with `FELIX_FAULT_SYNC_FAIL_AFTER` set.
pub fn before_sync() -> std::io::Result<()> {
    let delay = DELAY.get_or_init(|| {
        let ms: u64 = std::env::var(DELAY_ENV).ok()?.parse().ok()?;
        (ms > 0).then(|| std::time::Duration::from_millis(ms))
    });
    if let Some(d) = delay {
        std::thread::sleep(*d);
    }
    let fail_after = FAIL_AFTER.get_or_init(|| std::env::var(FAIL_AFTER_ENV).ok()?.parse().ok());
    if let Some(n) = fail_after
        && SYNCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed) >= *n
    {
        return Err(std::io::Error::from_raw_os_error(5)); // EIO
    }
    Ok(())
}

/// `path` reached the disk with its first `len` bytes (call after the sync returned, with the
/// length taken before it began).
pub fn synced(path: &Path, len: u64) {
    let Some(j) = journal() else { return };
    let line = format!("{len}\t{}\n", path.display());
    if let Ok(mut f) = j.lock() {
        let _ = f.write_all(line.as_bytes());
    }
}

/// `path` was just created: until its first sync, a power cut leaves it empty.
pub fn created(path: &Path) {
    synced(path, 0);
}

/// `file`'s length now (0 when it cannot be read: the journal then under-states what was kept,
/// which makes a power-cut test harsher, never more lenient).
pub fn len_of(file: &std::fs::File) -> u64 {
    file.metadata().map(|m| m.len()).unwrap_or(0)
}

/// Cuts every file the journal at `journal` names back to the length it last reached the disk
/// at: what a power cut would leave of a stopped broker's files. Returns the files cut and the
/// bytes dropped. Files that no longer exist are passed over.
///
/// # Errors
/// The journal cannot be read, or a file cannot be cut.
pub fn power_cut(journal: &Path) -> std::io::Result<(usize, u64)> {
    let text = std::fs::read_to_string(journal)?;
    let mut last: std::collections::BTreeMap<PathBuf, u64> = Default::default();
    for line in text.lines() {
        let Some((len, path)) = line.split_once('\t') else { continue };
        let Ok(len) = len.parse::<u64>() else { continue };
        last.insert(PathBuf::from(path), len);
    }
    let (mut files, mut bytes) = (0, 0);
    for (path, len) in last {
        let Ok(meta) = std::fs::metadata(&path) else { continue };
        if meta.len() > len {
            let f = std::fs::OpenOptions::new().write(true).open(&path)?;
            f.set_len(len)?;
            f.sync_all()?;
            files += 1;
            bytes += meta.len() - len;
        }
    }
    Ok((files, bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_power_cut_keeps_what_was_synced_and_drops_the_rest() {
        let dir = tempfile::tempdir().unwrap();
        let journal = dir.path().join("journal");
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::write(&a, b"0123456789").unwrap();
        std::fs::write(&b, b"abc").unwrap();
        // Written by hand in the journal's format (the process-wide journal is off in tests).
        std::fs::write(&journal, format!("0\t{}\n4\t{}\n3\t{}\n", a.display(), a.display(), b.display())).unwrap();
        assert_eq!(power_cut(&journal).unwrap(), (1, 6));
        assert_eq!(std::fs::read(&a).unwrap(), b"0123");
        assert_eq!(std::fs::read(&b).unwrap(), b"abc");
        // A file only created (never synced) is left empty.
        std::fs::write(&journal, format!("0\t{}\n", b.display())).unwrap();
        assert_eq!(power_cut(&journal).unwrap(), (1, 3));
        assert!(std::fs::read(&b).unwrap().is_empty());
    }
}
