//! Segment indexes: a sparse entry every few batches, written beside each segment (built in a
//! `.part` file, then renamed) so a restart reads indexes rather than every record.

use super::*;

pub(super) type SegmentIndex = HashMap<PathBuf, Vec<IndexEntry>>;

/// One seek point per this many batches in the in-memory index.
pub(super) const SPARSE_EVERY: u32 = 64;

pub(super) fn sparse(entries: &[IndexEntry]) -> Vec<(u64, u64)> {
    entries.iter().step_by(SPARSE_EVERY as usize).map(|e| (e.base_offset, e.position)).collect()
}

/// The index file of an open segment, being written.
pub(super) fn part_path(seg: &Path) -> PathBuf {
    seg.with_extension("idx.part")
}

/// Writes an open segment's index entries as they come (buffered, never synced: a crash
/// leaves it without its trailer, and recovery rebuilds it from the segment).
#[derive(Debug)]
pub(super) struct IdxWriter {
    pub(super) file: std::io::BufWriter<File>,
    pub(super) crc: u32,
    pub(super) count: u32,
}

impl IdxWriter {
    pub(super) fn start(seg: &Path, seed: &[IndexEntry]) -> std::io::Result<IdxWriter> {
        let file = File::create(part_path(seg))?;
        let mut w = IdxWriter { file: std::io::BufWriter::with_capacity(64 * 1024, file), crc: 0, count: 0 };
        for e in seed {
            w.add(e)?;
        }
        Ok(w)
    }

    pub(super) fn add(&mut self, e: &IndexEntry) -> std::io::Result<()> {
        let mut b = BytesMut::with_capacity(felix_proto::storage::INDEX_ENTRY_LEN);
        encode_index_entry(e, &mut b);
        self.crc = crc32c_append(self.crc, &b);
        self.count += 1;
        self.file.write_all(&b)
    }

    /// Seals the index: trailer, sync, then renamed into place (whole or absent).
    pub(super) fn seal(mut self, seg: &Path, len: u64) {
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
pub(super) fn index_path(seg: &Path) -> PathBuf {
    seg.with_extension("idx")
}

pub(super) fn write_index(seg: &Path, entries: &[IndexEntry], len: u64) {
    let tmp = seg.with_extension("idx.tmp");
    let ok = std::fs::write(&tmp, encode_index(entries, len))
        .and_then(|()| File::open(&tmp)?.sync_all())
        .and_then(|()| std::fs::rename(&tmp, index_path(seg)));
    if let Err(e) = ok {
        tracing::warn!("writing the index of {}: {e}", seg.display());
    }
}
