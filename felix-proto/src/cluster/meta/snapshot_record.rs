//! A snapshot as a record of a member's append-only log file: written whole
//! ([`encode_snapshot_record`]) or piece by piece beside its host's part
//! ([`write_snapshot_record`]), read back whole or a piece at a time
//! ([`read_snapshot_record_piece`]).

use super::*;

/// One [`MetaOutput::PersistSnapshot`] as a record of the same append-only file:
/// `u32 length`, `u8 2`, `"FLXS"`, `u32 length` + the snapshot's protobuf, CRC-32C of the bytes
/// from `"FLXS"` on.
pub fn encode_snapshot_record(snapshot: &Snapshot) -> Vec<u8> {
    let r = SnapshotRecord::new(snapshot);
    let mut out = Vec::with_capacity(r.len());
    for piece in r.pieces() {
        out.extend_from_slice(piece);
    }
    out
}

/// [`encode_snapshot_record`] in three pieces, written one after the other: the snapshot's
/// data, which can be the size of a replicated cache or a stream's commit state, is the middle
/// one, shared and not copied into a record buffer first.
#[derive(Debug, Clone)]
pub struct SnapshotRecord {
    head: Vec<u8>,
    data: bytes::Bytes,
    tail: Vec<u8>,
}

impl SnapshotRecord {
    /// The record of `snapshot`, its data uncopied.
    pub fn new(snapshot: &Snapshot) -> SnapshotRecord {
        use protobuf::Message as _;
        let mut head = vec![0; 4];
        head.push(2);
        let part = head.len();
        head.extend_from_slice(b"FLXS");
        head.extend_from_slice(&[0; 4]);
        // The protobuf by hand around the data: field 1 (data, length-delimited) first, then
        // field 2 (metadata), the order the generated code writes them in. Empty data is not
        // written at all (proto3), so the whole message is then written as generated.
        let (data, mut tail) = if snapshot.data.is_empty() {
            let _ = snapshot.write_to_vec(&mut head);
            (bytes::Bytes::new(), Vec::new())
        } else {
            head.push(0x0a);
            put_varint(&mut head, snapshot.data.len() as u64);
            (snapshot.data.clone(), metadata_field(snapshot))
        };
        let n = (head.len() - part - 8 + data.len() + tail.len()) as u32;
        head[part + 4..part + 8].copy_from_slice(&n.to_be_bytes());
        let crc = [&head[part..], &data[..], &tail[..]].iter().fold(0, |c, p| crate::storage::crc32c_append(c, p));
        tail.extend_from_slice(&crc.to_be_bytes());
        let len = (head.len() + data.len() + tail.len() - 4) as u32;
        head[..4].copy_from_slice(&len.to_be_bytes());
        SnapshotRecord { head, data, tail }
    }

    /// Its bytes, in order.
    pub fn pieces(&self) -> [&[u8]; 3] {
        [&self.head, &self.data, &self.tail]
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.head.len() + self.data.len() + self.tail.len()
    }

    /// Never: a record has at least its header.
    pub fn is_empty(&self) -> bool {
        false
    }
}

/// Bytes handed, in order and in pieces, to the function it is given (a host's state encoded
/// as it is written).
pub type Pieces<'a> = dyn Fn(&mut dyn FnMut(&[u8])) + 'a;

/// The length of the record [`write_snapshot_record`] writes for `snapshot` and `rest_len`
/// more bytes of data (what a writer declares, or reserves, before the pieces).
pub fn snapshot_record_len(snapshot: &Snapshot, rest_len: u64) -> u64 {
    use protobuf::Message as _;
    if rest_len == 0 {
        return SnapshotRecord::new(snapshot).len() as u64;
    }
    let total = snapshot.data.len() as u64 + rest_len;
    let varint = |v: u64| {
        let mut b = Vec::new();
        put_varint(&mut b, v);
        b.len() as u64
    };
    let tail = if snapshot.has_metadata() {
        let meta = snapshot.get_metadata().compute_size() as u64;
        1 + varint(meta) + meta
    } else {
        0
    };
    13 + 1 + varint(total) + total + tail + 4
}

/// Writes the [`SnapshotRecord`] of `snapshot` whose data is `snapshot.data` followed by
/// `rest_len` more bytes that `rest` hands over in pieces (a host's state encoded as it is
/// written, never whole in memory: [`crate::cluster::replica::SnapshotRest`]), to `sink`, in
/// pieces; returns the record's length. The bytes are exactly those of the record of the
/// snapshot whose data holds the rest (the CRC is computed as they go). With no rest it
/// writes [`SnapshotRecord::pieces`].
///
/// # Errors
/// What `sink` returned, or `InvalidData` when `rest` handed over other than `rest_len`
/// bytes (what was written is then a torn record, cut at the next start).
pub fn write_snapshot_record(
    snapshot: &Snapshot,
    rest_len: u64,
    rest: &Pieces<'_>,
    sink: &mut dyn FnMut(&[u8]) -> std::io::Result<()>,
) -> std::io::Result<u64> {
    if rest_len == 0 {
        let record = SnapshotRecord::new(snapshot);
        for piece in record.pieces() {
            sink(piece)?;
        }
        return Ok(record.len() as u64);
    }
    let total = snapshot.data.len() as u64 + rest_len;
    let mut head = vec![0; 4];
    head.push(2);
    head.extend_from_slice(b"FLXS");
    head.extend_from_slice(&[0; 4]);
    head.push(0x0a);
    put_varint(&mut head, total);
    let mut tail = metadata_field(snapshot);
    let n = (head.len() - 13) as u64 + total + tail.len() as u64;
    let n32 = u32::try_from(n)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a snapshot record past 4 GiB"))?;
    head[9..13].copy_from_slice(&n32.to_be_bytes());
    let len = head.len() as u64 + total + tail.len() as u64 + 4;
    head[..4].copy_from_slice(&((len - 4) as u32).to_be_bytes());
    let mut crc = crate::storage::crc32c_append(0, &head[5..]);
    crc = crate::storage::crc32c_append(crc, &snapshot.data);
    sink(&head)?;
    sink(&snapshot.data)?;
    let (mut written, mut failed) = (0u64, None);
    rest(&mut |piece: &[u8]| {
        if failed.is_some() {
            return;
        }
        written += piece.len() as u64;
        crc = crate::storage::crc32c_append(crc, piece);
        if let Err(e) = sink(piece) {
            failed = Some(e);
        }
    });
    if let Some(e) = failed {
        return Err(e);
    }
    if written != rest_len {
        let why = format!("a snapshot's host state declared {rest_len} bytes and gave {written}");
        return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
    }
    crc = crate::storage::crc32c_append(crc, &tail);
    tail.extend_from_slice(&crc.to_be_bytes());
    sink(&tail)?;
    Ok(len)
}

/// A snapshot's metadata as the protobuf field after its data (field 2), as the generated code
/// writes it; nothing when it has none.
pub(super) fn metadata_field(snapshot: &Snapshot) -> Vec<u8> {
    use protobuf::Message as _;
    let mut field = Vec::new();
    if snapshot.has_metadata() {
        field.push(0x12);
        let meta = snapshot.get_metadata().write_to_bytes().unwrap_or_default();
        put_varint(&mut field, meta.len() as u64);
        field.extend_from_slice(&meta);
    }
    field
}

/// A protobuf varint.
pub(super) fn put_varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push(v as u8 | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// The snapshot's protobuf in [`encode_snapshot_record`]'s body, once its magic, CRC and
/// length check out.
pub(super) fn snapshot_record_protobuf(body: &[u8]) -> Option<&[u8]> {
    if body.len() < 12 || &body[..4] != b"FLXS" {
        return None;
    }
    let (part, crc) = body.split_at(body.len() - 4);
    if crate::storage::crc32c(part).to_be_bytes() != crc {
        return None;
    }
    let n = u32::from_be_bytes([part[4], part[5], part[6], part[7]]) as usize;
    part.get(8..).filter(|b| b.len() == n)
}

/// The index of the snapshot in [`encode_snapshot_record`]'s body, read as the generated code
/// reads the whole snapshot, field by field, except that the data (as large as a cache; the
/// CRC covers it) is stepped over rather than copied out: `Some` exactly when
/// [`decode_snapshot_record`] reads it, with the same index.
pub(super) fn snapshot_record_index(body: &[u8]) -> Option<u64> {
    use protobuf::wire_format::WireType;
    let b = snapshot_record_protobuf(body)?;
    let mut rest = b;
    let mut index = 0;
    'fields: while !rest.is_empty() {
        let mut is = protobuf::CodedInputStream::from_bytes(rest);
        while !is.eof().ok()? {
            let (field, wire_type) = is.read_tag_unpack().ok()?;
            match field {
                1 if wire_type == WireType::WireTypeLengthDelimited => {
                    // Stepped over here: the stream's own skip reads the bytes into a buffer
                    // (measured: a copy of a 40 MiB state at each restart's fold).
                    let len = is.read_raw_varint32().ok()? as usize;
                    let at = usize::try_from(is.pos()).ok()?;
                    rest = rest.get(at.checked_add(len)?..)?;
                    continue 'fields;
                }
                2 if wire_type == WireType::WireTypeLengthDelimited => {
                    // A later metadata field replaces an earlier one, as in the generated code.
                    let mut m = raft::eraftpb::SnapshotMetadata::new();
                    is.merge_message(&mut m).ok()?;
                    index = m.index;
                }
                1 | 2 => return None,
                _ => {
                    let mut unknown = protobuf::UnknownFields::new();
                    protobuf::rt::read_unknown_or_skip_group(field, wire_type, &mut is, &mut unknown).ok()?;
                }
            }
        }
        break;
    }
    Some(index)
}

/// Reads [`encode_snapshot_record`]'s body; with the `buffer` it lies in, the snapshot's data
/// shares it (a restart reads a snapshot the size of a cache: it is not copied again).
pub(super) fn decode_snapshot_record(body: &[u8], buffer: Option<&bytes::Bytes>) -> Option<Snapshot> {
    use protobuf::Message as _;
    let b = snapshot_record_protobuf(body)?;
    match buffer.and_then(|buffer| shared_part(buffer, b)) {
        Some(shared) => Snapshot::parse_from_carllerche_bytes(&shared).ok(),
        None => Snapshot::parse_from_bytes(b).ok(),
    }
}

/// A piece of a kept snapshot's data, read from its record on disk
/// ([`read_snapshot_record_piece`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotPiece {
    /// The length of the snapshot's whole data.
    pub total: u64,
    /// The bytes asked for (fewer at the data's end).
    pub data: bytes::Bytes,
}

/// Why a piece of a kept snapshot could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotReadError {
    /// The file could not be read.
    #[error("{0}")]
    Io(String),
    /// The bytes are not a whole, intact snapshot record (its framing, magic or CRC).
    #[error("not an intact snapshot record")]
    Damaged,
    /// The record holds another snapshot (a newer compaction replaced the one asked for).
    #[error("the snapshot kept is at index {kept}, not {wanted}")]
    Replaced {
        /// The index of the snapshot the record holds.
        kept: u64,
        /// The index asked for.
        wanted: u64,
    },
    /// The piece starts past the data's end.
    #[error("byte {offset} lies past the snapshot's {total} bytes of data")]
    OutOfRange {
        /// Where the piece was asked from.
        offset: u64,
        /// The data's length.
        total: u64,
    },
}

/// Bytes of a record read at a time to check its CRC.
const VERIFY_READ_BYTES: usize = 1 << 20;

/// Reads bytes `offset..offset + max` (fewer at the end) of the data of the snapshot at
/// `index`, in the [`SnapshotRecord`] of `record_len` bytes that `read_at(position, buf)` reads
/// (positions from the record's start), without reading the rest of it: what a leader sends
/// a follower behind its compaction, chunk by chunk, never holding the whole state. With
/// `verify`, the whole record's CRC is checked first, streamed through a bounded buffer (once
/// per send, on its first piece). A record laid out otherwise than [`SnapshotRecord`] writes
/// it is read whole and decoded, as before. Never panics.
///
/// # Errors
/// [`SnapshotReadError`]: the read failed, the record is damaged or holds another snapshot,
/// the piece starts past the data.
pub fn read_snapshot_record_piece(
    read_at: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    record_len: u64,
    index: u64,
    offset: u64,
    max: u64,
    verify: bool,
) -> Result<SnapshotPiece, SnapshotReadError> {
    use protobuf::Message as _;
    let io = |e: std::io::Error| SnapshotReadError::Io(e.to_string());
    // [len u32][flag 2]["FLXS"][n u32][protobuf: n bytes][crc u32]
    if record_len < 17 {
        return Err(SnapshotReadError::Damaged);
    }
    let mut head = vec![0; record_len.min(32) as usize];
    read_at(0, &mut head).map_err(io)?;
    let n = u32::from_be_bytes([head[9], head[10], head[11], head[12]]) as u64;
    let framed = u32::from_be_bytes([head[0], head[1], head[2], head[3]]) as u64 == record_len - 4
        && head[4] == 2
        && &head[5..9] == b"FLXS"
        && 17 + n == record_len;
    if !framed {
        return Err(SnapshotReadError::Damaged);
    }
    // The data (field 1) first, then the metadata (field 2), as `SnapshotRecord` writes them.
    let (data_start, total) = match head.get(13) {
        Some(0x0a) => match varint_at(&head, 14) {
            Some((len, at)) => (at as u64, len),
            None => return read_whole_piece(read_at, record_len, index, offset, max),
        },
        Some(0x12) => (13, 0),
        _ => return read_whole_piece(read_at, record_len, index, offset, max),
    };
    let tail_start =
        data_start.checked_add(total).filter(|t| *t <= record_len - 4).ok_or(SnapshotReadError::Damaged)?;
    let mut tail = vec![0; (record_len - 4 - tail_start) as usize];
    read_at(tail_start, &mut tail).map_err(io)?;
    let meta = match (tail.first(), varint_at(&tail, 1)) {
        (Some(0x12), Some((len, at))) if at as u64 + len == tail.len() as u64 => {
            raft::eraftpb::SnapshotMetadata::parse_from_bytes(&tail[at..]).map_err(|_| SnapshotReadError::Damaged)?
        }
        _ => return read_whole_piece(read_at, record_len, index, offset, max),
    };
    if verify {
        let mut crc = 0;
        let mut buf = vec![0; VERIFY_READ_BYTES.min((record_len - 9) as usize)];
        let mut at = 5;
        while at < record_len - 4 {
            let take = buf.len().min((record_len - 4 - at) as usize);
            read_at(at, &mut buf[..take]).map_err(io)?;
            crc = crate::storage::crc32c_append(crc, &buf[..take]);
            at += take as u64;
        }
        let mut stored = [0; 4];
        read_at(record_len - 4, &mut stored).map_err(io)?;
        if crc.to_be_bytes() != stored {
            return Err(SnapshotReadError::Damaged);
        }
    }
    if meta.index != index {
        return Err(SnapshotReadError::Replaced { kept: meta.index, wanted: index });
    }
    if offset > total || (offset == total && total > 0) {
        return Err(SnapshotReadError::OutOfRange { offset, total });
    }
    let mut data = vec![0; max.min(total - offset) as usize];
    read_at(data_start + offset, &mut data).map_err(io)?;
    Ok(SnapshotPiece { total, data: data.into() })
}

/// [`read_snapshot_record_piece`] for a record not laid out as [`SnapshotRecord`] writes it:
/// read whole and decoded (its CRC checked), the piece sliced out.
fn read_whole_piece(
    read_at: &mut dyn FnMut(u64, &mut [u8]) -> std::io::Result<()>,
    record_len: u64,
    index: u64,
    offset: u64,
    max: u64,
) -> Result<SnapshotPiece, SnapshotReadError> {
    let len = usize::try_from(record_len).map_err(|_| SnapshotReadError::Damaged)?;
    let mut record = vec![0; len];
    read_at(0, &mut record).map_err(|e| SnapshotReadError::Io(e.to_string()))?;
    let snap = decode_snapshot_record_alone(&record.into()).ok_or(SnapshotReadError::Damaged)?;
    let kept = snap.get_metadata().index;
    if kept != index {
        return Err(SnapshotReadError::Replaced { kept, wanted: index });
    }
    piece_of(&snap.data, offset, max)
}

/// Bytes `offset..offset + max` (fewer at the end) of a snapshot's `data` held in memory, as
/// [`read_snapshot_record_piece`] reads them from its record (drivers that keep their
/// snapshots in memory, the simulations).
///
/// # Errors
/// [`SnapshotReadError::OutOfRange`] for a piece past the data's end.
pub fn piece_of(data: &bytes::Bytes, offset: u64, max: u64) -> Result<SnapshotPiece, SnapshotReadError> {
    let total = data.len() as u64;
    if offset > total || (offset == total && total > 0) {
        return Err(SnapshotReadError::OutOfRange { offset, total });
    }
    let end = offset.saturating_add(max).min(total);
    Ok(SnapshotPiece { total, data: data.slice(offset as usize..end as usize) })
}

/// A protobuf varint at `at`: its value and where what follows it starts.
pub(super) fn varint_at(b: &[u8], at: usize) -> Option<(u64, usize)> {
    let mut v = 0u64;
    for i in 0..10 {
        let byte = *b.get(at + i)?;
        v |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            return Some((v, at + i + 1));
        }
    }
    None
}

/// The snapshot in one whole [`encode_snapshot_record`] record, as written (length first), read
/// back alone: its data shares `record` (a buffer the record's size: nothing more is kept
/// alive with it). `None` when it is not a whole, intact snapshot record.
pub fn decode_snapshot_record_alone(record: &bytes::Bytes) -> Option<Snapshot> {
    match record_at(record, 0) {
        RecordAt::Whole(end, body) if end == record.len() && body.first() == Some(&2) => {
            decode_snapshot_record(&body[1..], Some(record))
        }
        _ => None,
    }
}
