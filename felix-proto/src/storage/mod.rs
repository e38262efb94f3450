//! The on-disk format of durable stream shards: pure encode/decode, no file IO (the driver does
//! the IO; the fuzzer reaches this code directly).
//!
//! A shard is a directory of segment files named by their first offset. A segment is a run of
//! batches, each framed and checksummed so a torn or corrupt tail is detected on recovery:
//!
//! ```text
//! u32 magic            "FLXB" (0x464C5842)
//! u32 body_len         bytes of the body below
//! u32 crc32c           CRC-32C (Castagnoli) of the body
//! body:
//!   u64 base_offset
//!   u64 timestamp_micros
//!   u8  flags           bit 0: generation-start record; bit 1: idempotent producer
//!   u8  publisher_len, publisher
//!   [u16 key_len, key]                only with flags bit 4 (D57)
//!   [u64 producer_id, u64 sequence]   only with flags bit 1
//!   [u32 state_len, state]            only with flags bit 2
//!   u32 count
//!   count × (u32 payload_len, payload)
//!   -- or, with flags bit 3 (a batch that arrived compressed, D56, stored as it came):
//!   u8 codec (1 zstd, 2 lz4), u32 count, u32 raw_len, compressed bytes
//! ```
//!
//! See docs/storage.md.

use crate::binary::{PayloadError, Reader, Records};
use bytes::{BufMut, Bytes, BytesMut};

mod requests;
pub use requests::{FsyncMode, PersistRequest, ReadRequest, WriteOutcome};
mod beside;
mod checkpoint_reader;
pub mod pieces;
pub use beside::{
    CheckpointError, StateCheckpoint, decode_producer_watermarks, decode_state_checkpoint, encode_producer_watermarks,
    encode_state_checkpoint, encode_state_checkpoint_into, encode_state_checkpoint_pieces, state_checkpoint_as_of,
};
pub use checkpoint_reader::StateCheckpointReader;

/// Batch magic, "FLXB".
pub const BATCH_MAGIC: u32 = 0x464C_5842;
/// Bytes before a batch's body.
pub const BATCH_HEADER_LEN: usize = 12;
/// Batch flag bits this version knows: bit 0, generation-start record; bit 1, the batch carries
/// its idempotent producer's id and sequence; bit 2, the batch is a `commit` and carries the
/// state changes it applies ([`encode_state_changes`]); bit 3, the records are stored
/// compressed, as they were published (D56); bit 4, the batch carries the key it was published
/// with (D57).
const BATCH_FLAGS_KNOWN: u8 = 0x3F;
const FLAG_KEY: u8 = 0x10;
/// Bit 5: the batch carries its publisher's envelope (D58), `u16 envelope_len, envelope`.
const FLAG_ENVELOPE: u8 = 0x20;
const FLAG_GENERATION_START: u8 = 0x01;
const FLAG_PRODUCER: u8 = 0x02;
const FLAG_STATE: u8 = 0x04;
const FLAG_COMPRESSED: u8 = 0x08;

/// The largest body a reader accepts (a defence against a corrupt length).
pub const MAX_BATCH_BODY: usize = 256 << 20;

/// CRC-32C (Castagnoli), as used by iSCSI, ext4 and most log formats.
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c_append(0, data)
}

const fn crc64_table() -> [u64; 256] {
    // CRC-64/XZ (ECMA-182 polynomial, reflected).
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u64;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0xC96C_5795_D787_0F42 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

static CRC64_TABLE: [u64; 256] = crc64_table();

/// CRC-64/XZ of `data`: the digest of a batch's encoded records (lengths included, so record
/// boundaries count) that idempotent producers compare.
pub fn crc64(data: &[u8]) -> u64 {
    let mut c = !0u64;
    for &b in data {
        c = CRC64_TABLE[((c ^ u64::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
}

/// Continues a CRC-32C over more bytes: `crc32c_append(crc32c(a), b) == crc32c(a ++ b)`.
///
/// By the processor's CRC instruction where it has one (the `crc32c` crate; tables otherwise):
/// every byte a replica keeps is checksummed, and our own slicing-by-8 tables were a fifth of a
/// follower's CPU at 100 MB/s (`perf`, three replicas, 4 KiB records).
pub fn crc32c_append(crc: u32, data: &[u8]) -> u32 {
    crc32c::crc32c_append(crc, data)
}

/// One stored batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredBatch {
    /// Offset of the first record.
    pub base_offset: u64,
    /// Append time, µs since the Unix epoch.
    pub timestamp_micros: u64,
    /// A generation-start record (one offset, no records).
    pub generation_start: bool,
    /// The publishing principal.
    pub publisher: Option<Bytes>,
    /// The idempotent producer that wrote it: `(producer_id, sequence)`.
    pub producer: Option<(u64, u64)>,
    /// A `commit`'s state changes ([`encode_state_changes`]), stored with its event so that
    /// both are written, or neither.
    pub state: Option<Bytes>,
    /// The key it was published with (flags bit 4; D57): what subscriptions' filters match.
    pub key: Option<Bytes>,
    /// The records.
    pub records: Records,
}

impl StoredBatch {
    /// Offsets the batch takes.
    pub fn count(&self) -> u64 {
        if self.generation_start { 1 } else { u64::from(self.records.count()) }
    }
}

/// Appends one framed batch to `dst`.
pub fn encode_batch(b: &StoredBatch, dst: &mut BytesMut) {
    let publisher = b.publisher.as_deref().unwrap_or(&[]);
    let publisher = &publisher[..publisher.len().min(255)];
    let producer_len = if b.producer.is_some() { 16 } else { 0 };
    // A key longer than its u16 length cannot have been published (keys are u16-prefixed on
    // the wire); such a key is not stored rather than cut.
    let key = b.key.as_ref().filter(|k| k.len() <= usize::from(u16::MAX));
    let key_len = key.map_or(0, |k| 2 + k.len());
    // An envelope is u16-prefixed on the wire too.
    let envelope = b.records.envelope().filter(|e| e.len() <= usize::from(u16::MAX));
    let key_len = key_len + envelope.map_or(0, |e| 2 + e.len());
    let state_len = b.state.as_ref().map_or(0, |s| 4 + s.len());
    let records_len = b.records.block_len();
    let body_len = 8 + 8 + 1 + 1 + publisher.len() + key_len + producer_len + state_len + records_len;
    dst.reserve(BATCH_HEADER_LEN + body_len);
    dst.put_u32(BATCH_MAGIC);
    dst.put_u32(body_len as u32);
    let crc_at = dst.len();
    dst.put_u32(0);
    let body_at = dst.len();
    dst.put_u64(b.base_offset);
    dst.put_u64(b.timestamp_micros);
    let mut flags = 0;
    if b.generation_start {
        flags |= FLAG_GENERATION_START;
    }
    if b.producer.is_some() {
        flags |= FLAG_PRODUCER;
    }
    if b.state.is_some() {
        flags |= FLAG_STATE;
    }
    if b.records.stores_packed() {
        flags |= FLAG_COMPRESSED;
    }
    if key.is_some() {
        flags |= FLAG_KEY;
    }
    if envelope.is_some() {
        flags |= FLAG_ENVELOPE;
    }
    dst.put_u8(flags);
    dst.put_u8(publisher.len() as u8);
    dst.extend_from_slice(publisher);
    if let Some(k) = key {
        dst.put_u16(k.len() as u16);
        dst.extend_from_slice(k);
    }
    if let Some(e) = envelope {
        dst.put_u16(e.len() as u16);
        dst.extend_from_slice(e);
    }
    if let Some((id, seq)) = b.producer {
        dst.put_u64(id);
        dst.put_u64(seq);
    }
    if let Some(state) = &b.state {
        dst.put_u32(state.len() as u32);
        dst.extend_from_slice(state);
    }
    b.records.put_block(dst);
    let crc = crc32c(&dst[body_at..]);
    dst[crc_at..crc_at + 4].copy_from_slice(&crc.to_be_bytes());
}

/// Why reading a segment stopped before its end.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SegmentError {
    /// The file ends inside a batch (a torn write).
    #[error("torn batch at byte {at}: {have} of {need} bytes")]
    Torn {
        /// Where the batch starts.
        at: usize,
        /// Bytes present.
        have: usize,
        /// Bytes needed.
        need: usize,
    },
    /// The magic is wrong.
    #[error("bad batch magic {magic:#010x} at byte {at}")]
    BadMagic {
        /// Where the batch starts.
        at: usize,
        /// What was there.
        magic: u32,
    },
    /// The checksum does not match.
    #[error("checksum mismatch at byte {at}")]
    BadChecksum {
        /// Where the batch starts.
        at: usize,
    },
    /// The body is too long to be real.
    #[error("batch at byte {at} claims {len} bytes")]
    TooLong {
        /// Where the batch starts.
        at: usize,
        /// Claimed length.
        len: usize,
    },
    /// The body passed its checksum but does not parse.
    #[error("malformed batch at byte {at}: {error}")]
    Malformed {
        /// Where the batch starts.
        at: usize,
        /// What is wrong.
        error: PayloadError,
    },
    /// The batch flags carry a bit this version does not know (a newer format, or damage that
    /// kept the checksum): refused rather than masked, as frame flags are.
    #[error("batch at byte {at} has unknown flags {flags:#04x}")]
    UnknownFlags {
        /// Where the batch starts.
        at: usize,
        /// The flags byte.
        flags: u8,
    },
    /// Offsets go backwards (a gap forwards is a write that failed, and is fine).
    #[error("batch at byte {at} starts at offset {got}, below {expected}")]
    OutOfOrder {
        /// Where the batch starts.
        at: usize,
        /// Its base offset.
        got: u64,
        /// The offset the previous batch ended at.
        expected: u64,
    },
}

/// The body length a batch header announces, checked: the magic must be right and the length
/// believable. For a reader that reads a segment one batch at a time (a header, then its body)
/// instead of whole ([`decode_segment`]); the batch itself is then checked by `decode_segment`.
pub fn batch_body_len(header: &[u8; BATCH_HEADER_LEN]) -> Result<usize, SegmentError> {
    let word = |i: usize| u32::from_be_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
    let magic = word(0);
    if magic != BATCH_MAGIC {
        return Err(SegmentError::BadMagic { at: 0, magic });
    }
    let len = word(4) as usize;
    if len > MAX_BATCH_BODY {
        return Err(SegmentError::TooLong { at: 0, len });
    }
    Ok(len)
}

/// A shard read back at start.
#[derive(Debug)]
pub struct RecoveredShard {
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard number.
    pub shard: u32,
    /// The stream's shard count (from its metadata).
    pub stream_shards: u32,
    /// Older history, known by index entries only (its records stay on disk), in offset
    /// order. Restore these first.
    pub summaries: Vec<IndexEntry>,
    /// Valid batches read whole (the newest, within the memory budget), in offset order.
    pub batches: Vec<StoredBatch>,
    /// The `commit` batches among `summaries`, read whole for their state changes (the shard's
    /// state is rebuilt from every commit it holds), in offset order.
    pub state_batches: Vec<StoredBatch>,
    /// Problems found and repaired (torn or corrupt tails truncated).
    pub repairs: Vec<String>,
    /// What retention made the broker forget about idempotent producers on this shard
    /// ([`crate::broker::Broker::restore_producer_watermarks`]).
    pub producer_watermarks: Vec<(u64, u64)>,
    /// The shard's commit state as retention last checkpointed it (written before the
    /// segments holding those commits were deleted): restore it first
    /// ([`crate::broker::Broker::restore_state_checkpoint`]); `state_batches` and `batches`
    /// then hold only what came after (older commits are skipped by their offsets).
    pub state_checkpoint: Option<StateCheckpoint>,
}

/// Storage for a broker run without a data directory: durable streams then live in memory only.
/// Every write is reported written at once (the records are in the broker's log; nothing
/// survives a restart, which `serve` says when it starts) and history reads find nothing, as
/// nothing older than the in-memory log exists. The rule lives here, not in a driver, so that
/// every driver run without disk behaves the same.
#[derive(Debug, Clone, Copy, Default)]
pub struct MemoryOnly;

impl MemoryOnly {
    /// The outcome of each write: written.
    pub fn write(
        &self,
        requests: impl IntoIterator<Item = PersistRequest>,
    ) -> Vec<(crate::transport::WriteToken, WriteOutcome)> {
        requests.into_iter().map(|r| (r.token, WriteOutcome::Written)).collect()
    }
    /// What a history read finds: nothing.
    pub fn read(&self, _request: &ReadRequest) -> Vec<StoredBatch> {
        Vec::new()
    }
}

/// What a segment holds, up to the first problem.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovered {
    /// The valid batches, in order.
    pub batches: Vec<StoredBatch>,
    /// Where each of `batches` starts in the file.
    pub positions: Vec<usize>,
    /// Corrupt batches skipped in the middle of the file (their offsets are lost; what follows
    /// them is served).
    pub damaged: Vec<SegmentError>,
    /// Bytes of the file that hold them: truncate the file here to drop a bad tail.
    pub valid_len: usize,
    /// Why reading stopped early, if it did.
    pub problem: Option<SegmentError>,
}

/// Reads a segment. Never panics; every batch returned passed its checksum, and offsets
/// strictly increase (a forward gap is a write that failed). A batch whose checksum fails in the
/// middle of the file, followed by a sound batch header, is skipped and reported in `damaged`;
/// any other problem stops reading there (the tail from it is to be truncated).
pub fn decode_segment(data: Bytes) -> Recovered {
    let mut batches = Vec::new();
    let mut positions = Vec::new();
    let mut damaged = Vec::new();
    let mut at = 0usize;
    let mut expected: Option<u64> = None;
    let problem = loop {
        if at == data.len() {
            break None;
        }
        let left = data.len() - at;
        if left < BATCH_HEADER_LEN {
            break Some(SegmentError::Torn { at, have: left, need: BATCH_HEADER_LEN });
        }
        let word = |i: usize| u32::from_be_bytes([data[i], data[i + 1], data[i + 2], data[i + 3]]);
        let magic = word(at);
        if magic != BATCH_MAGIC {
            break Some(SegmentError::BadMagic { at, magic });
        }
        let len = word(at + 4) as usize;
        if len > MAX_BATCH_BODY {
            break Some(SegmentError::TooLong { at, len });
        }
        if left - BATCH_HEADER_LEN < len {
            break Some(SegmentError::Torn { at, have: left, need: BATCH_HEADER_LEN + len });
        }
        let body = data.slice(at + BATCH_HEADER_LEN..at + BATCH_HEADER_LEN + len);
        if crc32c(&body) != word(at + 8) {
            let next = at + BATCH_HEADER_LEN + len;
            let sound_next = data.len() - next >= BATCH_HEADER_LEN && word(next) == BATCH_MAGIC;
            if sound_next {
                // Damage inside the file, not a torn tail: skip this batch, serve the rest.
                damaged.push(SegmentError::BadChecksum { at });
                at = next;
                continue;
            }
            break Some(SegmentError::BadChecksum { at });
        }
        if body.len() > 16 && body[16] & !BATCH_FLAGS_KNOWN != 0 {
            break Some(SegmentError::UnknownFlags { at, flags: body[16] });
        }
        let batch = match decode_body(body) {
            Ok(b) => b,
            Err(error) => break Some(SegmentError::Malformed { at, error }),
        };
        if let Some(e) = expected
            && batch.base_offset < e
        {
            break Some(SegmentError::OutOfOrder { at, got: batch.base_offset, expected: e });
        }
        expected = Some(batch.base_offset + batch.count());
        batches.push(batch);
        positions.push(at);
        at += BATCH_HEADER_LEN + len;
    };
    Recovered { batches, positions, damaged, valid_len: at, problem }
}

fn decode_body(body: Bytes) -> Result<StoredBatch, PayloadError> {
    let mut r = Reader::new(body);
    let base_offset = r.u64("base_offset")?;
    let timestamp_micros = r.u64("timestamp_micros")?;
    let flags = r.u8("flags")?;
    let plen = r.u8("publisher_len")? as usize;
    let publisher = r.bytes(plen, "publisher")?;
    let key = if flags & FLAG_KEY != 0 {
        let len = r.u16("key_len")?;
        Some(r.bytes(usize::from(len), "key")?)
    } else {
        None
    };
    let envelope = if flags & FLAG_ENVELOPE != 0 {
        let len = r.u16("envelope_len")?;
        Some(r.bytes(usize::from(len), "envelope")?)
    } else {
        None
    };
    let producer = if flags & FLAG_PRODUCER != 0 { Some((r.u64("producer_id")?, r.u64("sequence")?)) } else { None };
    let state = if flags & FLAG_STATE != 0 {
        let len = r.u32("state_len")? as usize;
        let state = r.bytes(len, "state")?;
        decode_state_changes(&state)?;
        Some(state)
    } else {
        None
    };
    let records = Records::read_block(&mut r, flags & FLAG_COMPRESSED != 0, MAX_BATCH_BODY)?;
    let records = if envelope.is_some() { records.with_envelope(envelope) } else { records };
    r.finish()?;
    Ok(StoredBatch {
        key,
        base_offset,
        timestamp_micros,
        generation_start: flags & FLAG_GENERATION_START != 0,
        publisher: (!publisher.is_empty()).then_some(publisher),
        producer,
        state,
        records,
    })
}

/// One change a `commit` makes to its shard's state: a value put, or (`None`) a key deleted.
pub type StateChange = (String, Option<Bytes>);

/// The longest state key, in bytes (what the encoding's length field holds).
pub const MAX_STATE_KEY: usize = u16::MAX as usize;

/// Encodes a commit's state changes as stored with its batch:
///
/// ```text
/// u32 count, then per change: u8 op (0 put, 1 delete), u16 key_len, key (UTF-8),
///                             and for a put: u32 value_len, value
/// ```
///
/// `None` when a key is longer than [`MAX_STATE_KEY`] (the broker refuses such a commit).
pub fn encode_state_changes(changes: &[StateChange]) -> Option<Bytes> {
    let mut out = BytesMut::new();
    out.put_u32(u32::try_from(changes.len()).ok()?);
    for (key, value) in changes {
        out.put_u8(u8::from(value.is_none()));
        out.put_u16(u16::try_from(key.len()).ok()?);
        out.extend_from_slice(key.as_bytes());
        if let Some(v) = value {
            out.put_u32(u32::try_from(v.len()).ok()?);
            out.extend_from_slice(v);
        }
    }
    Some(out.freeze())
}

/// Decodes [`encode_state_changes`]. Never panics.
///
/// # Errors
/// [`PayloadError`] for truncated or malformed bytes (an unknown op, a key that is not UTF-8).
pub fn decode_state_changes(data: &Bytes) -> Result<Vec<StateChange>, PayloadError> {
    let mut r = Reader::new(data.clone());
    let count = r.u32("state_count")?;
    let mut out = Vec::new();
    for _ in 0..count {
        let op = r.u8("state_op")?;
        let klen = r.u16("state_key_len")? as usize;
        let key = r.string(klen, "state_key")?;
        let value = match op {
            0 => {
                let vlen = r.u32("state_value_len")? as usize;
                Some(r.bytes(vlen, "state_value")?)
            }
            1 => None,
            other => return Err(PayloadError::InvalidStateOp(other)),
        };
        out.push((key, value));
    }
    r.finish()?;
    Ok(out)
}

/// What recovery needs of a batch without reading it: where it is, what offsets it takes, its
/// append time and size, and (for an idempotent producer's batch) its producer, sequence and
/// payload digest. A sealed segment's entries are kept in an index file beside it
/// (`NNNN.idx`), so recovery reads indexes, not whole logs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IndexEntry {
    /// First offset.
    pub base_offset: u64,
    /// Byte position of the batch in its segment.
    pub position: u64,
    /// Offsets the batch takes.
    pub count: u64,
    /// Append time, µs since the Unix epoch.
    pub timestamp_micros: u64,
    /// Payload bytes.
    pub payload_bytes: u64,
    /// A generation-start record.
    pub generation_start: bool,
    /// `(producer_id, sequence, payload digest)` of an idempotent producer's batch.
    pub producer: Option<(u64, u64, u64)>,
    /// A `commit`: the batch carries state changes, which recovery reads even from a segment
    /// it otherwise knows by its index only.
    pub state: bool,
}

impl IndexEntry {
    /// The entry of `b`, stored at `position`.
    pub fn of(b: &StoredBatch, position: u64) -> IndexEntry {
        IndexEntry {
            base_offset: b.base_offset,
            position,
            count: b.count(),
            timestamp_micros: b.timestamp_micros,
            payload_bytes: b.records.payload_bytes() as u64,
            generation_start: b.generation_start,
            producer: b.producer.map(|(id, seq)| (id, seq, records_digest(&b.records))),
            state: b.state.is_some(),
        }
    }
}

/// CRC-64/XZ of a batch's encoded records (what idempotent producers compare).
pub fn records_digest(records: &Records) -> u64 {
    crc64(records.raw())
}

/// Index file magic, "FLXI".
pub const INDEX_MAGIC: u32 = 0x464C_5849;
/// Bytes of one index entry.
pub const INDEX_ENTRY_LEN: usize = 8 * 8 + 1;
/// Bytes of an index file's trailer.
pub const INDEX_TRAILER_LEN: usize = 20;

/// Why an index file cannot be used (recovery then scans the segment and writes a new one).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum IndexError {
    /// Too short, wrong magic, or a length that does not add up.
    #[error("not an index file")]
    Malformed,
    /// The checksum does not match.
    #[error("index checksum mismatch")]
    BadChecksum,
    /// It describes a segment of another length (written before the segment changed).
    #[error("index covers {covered} bytes, the segment has {actual}")]
    Stale {
        /// Segment length the index was written for.
        covered: u64,
        /// Segment length now.
        actual: u64,
    },
}

/// Appends one entry of an index to `dst`. An index file is its entries, written as batches are
/// appended (no need to hold them in memory), then a trailer once the segment is sealed:
///
/// ```text
/// count × (u64 base, u64 position, u64 count, u64 timestamp_micros, u64 payload_bytes,
///          u64 producer_id, u64 sequence, u64 digest, u8 flags: bit 0 generation start,
///          bit 1 producer present, bit 2 state changes present)
/// u32 magic "FLXI", u64 segment_len, u32 count, u32 crc32c (of the entries)
/// ```
pub fn encode_index_entry(e: &IndexEntry, dst: &mut BytesMut) {
    dst.put_u64(e.base_offset);
    dst.put_u64(e.position);
    dst.put_u64(e.count);
    dst.put_u64(e.timestamp_micros);
    dst.put_u64(e.payload_bytes);
    let (id, seq, digest) = e.producer.unwrap_or_default();
    dst.put_u64(id);
    dst.put_u64(seq);
    dst.put_u64(digest);
    dst.put_u8(u8::from(e.generation_start) | (u8::from(e.producer.is_some()) << 1) | (u8::from(e.state) << 2));
}

/// The trailer that seals an index of `count` entries whose bytes have CRC-32C `crc`.
pub fn encode_index_trailer(segment_len: u64, count: u32, crc: u32, dst: &mut BytesMut) {
    dst.put_u32(INDEX_MAGIC);
    dst.put_u64(segment_len);
    dst.put_u32(count);
    dst.put_u32(crc);
}

/// A whole index file (entries and trailer).
pub fn encode_index(entries: &[IndexEntry], segment_len: u64) -> Bytes {
    let mut out = BytesMut::with_capacity(entries.len() * INDEX_ENTRY_LEN + INDEX_TRAILER_LEN);
    for e in entries {
        encode_index_entry(e, &mut out);
    }
    let crc = crc32c(&out);
    encode_index_trailer(segment_len, entries.len() as u32, crc, &mut out);
    out.freeze()
}

/// Decodes an index written for a segment now `segment_len` bytes long. Never panics.
///
/// # Errors
/// [`IndexError`] when the file cannot be trusted.
pub fn decode_index(data: &[u8], segment_len: u64) -> Result<Vec<IndexEntry>, IndexError> {
    let word = |i: usize| -> Result<u32, IndexError> {
        Ok(u32::from_be_bytes(
            data.get(i..i + 4).ok_or(IndexError::Malformed)?.try_into().map_err(|_| IndexError::Malformed)?,
        ))
    };
    let long = |d: &[u8], i: usize| -> u64 { u64::from_be_bytes(d[i..i + 8].try_into().expect("8 bytes")) };
    if data.len() < INDEX_TRAILER_LEN {
        return Err(IndexError::Malformed);
    }
    let t = data.len() - INDEX_TRAILER_LEN;
    if word(t)? != INDEX_MAGIC {
        return Err(IndexError::Malformed);
    }
    let covered = long(data, t + 4);
    let count = word(t + 12)? as usize;
    let body = &data[..t];
    if count.checked_mul(INDEX_ENTRY_LEN) != Some(body.len()) {
        return Err(IndexError::Malformed);
    }
    if crc32c(body) != word(t + 16)? {
        return Err(IndexError::BadChecksum);
    }
    if covered != segment_len {
        return Err(IndexError::Stale { covered, actual: segment_len });
    }
    let mut out = Vec::with_capacity(count);
    let mut last_end: Option<u64> = None;
    for e in body.chunks_exact(INDEX_ENTRY_LEN) {
        let flags = e[64];
        let entry = IndexEntry {
            base_offset: long(e, 0),
            position: long(e, 8),
            count: long(e, 16),
            timestamp_micros: long(e, 24),
            payload_bytes: long(e, 32),
            generation_start: flags & 1 != 0,
            producer: (flags & 2 != 0).then(|| (long(e, 40), long(e, 48), long(e, 56))),
            state: flags & 4 != 0,
        };
        // Offsets only move forward and positions lie inside the segment.
        if entry.position >= segment_len || last_end.is_some_and(|end| entry.base_offset < end) || entry.count == 0 {
            return Err(IndexError::Malformed);
        }
        last_end = Some(entry.base_offset.saturating_add(entry.count));
        out.push(entry);
    }
    Ok(out)
}

/// The file name of the segment whose first offset is `base`.
pub fn segment_name(base: u64) -> String {
    format!("{base:020}.seg")
}

/// The first offset of a segment file name, if it is one.
pub fn parse_segment_name(name: &str) -> Option<u64> {
    let digits = name.strip_suffix(".seg")?;
    if digits.len() != 20 || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// A tenant, namespace or stream name as a safe path component: bytes outside
/// `[A-Za-z0-9_-]` (and a leading `.`) become `%XX`, so no name can climb out of the data
/// directory or collide with another.
pub fn path_component(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    for (i, b) in name.bytes().enumerate() {
        let safe = b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0);
        if safe {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    if out.is_empty() {
        out.push('%');
    }
    out
}

/// The length of [`path_component`]`(name)`, without building it (checked on every publish).
pub fn path_component_len(name: &str) -> usize {
    let escaped = name
        .bytes()
        .enumerate()
        .filter(|&(i, b)| !(b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || (b == b'.' && i > 0)))
        .count();
    (name.len() + 2 * escaped).max(1)
}

/// Inverse of [`path_component`]; `None` for a string it could not have produced.
pub fn parse_path_component(s: &str) -> Option<String> {
    if s == "%" {
        return Some(String::new());
    }
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = s.get(i + 1..i + 3)?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests;
