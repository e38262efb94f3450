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
mod tests {
    use super::*;
    use crate::binary::Codec;

    fn batch(base: u64, payloads: &[&str]) -> StoredBatch {
        StoredBatch {
            key: None,
            base_offset: base,
            timestamp_micros: 42,
            generation_start: false,
            publisher: Some(Bytes::from_static(b"alice")),
            producer: None,
            state: None,
            records: Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).unwrap(),
        }
    }

    #[test]
    fn index_round_trip_and_every_bad_index_is_refused() {
        let mut b = batch(7, &["x", "yy"]);
        b.producer = Some((9, 4));
        let entries = vec![IndexEntry::of(&batch(0, &["a"]), 0), IndexEntry::of(&b, 40)];
        assert_eq!(entries[1].producer.map(|p| (p.0, p.1)), Some((9, 4)));
        let idx = encode_index(&entries, 100);
        assert_eq!(decode_index(&idx, 100), Ok(entries));
        assert_eq!(decode_index(&idx, 101), Err(IndexError::Stale { covered: 100, actual: 101 }));
        for i in 0..idx.len() {
            let mut bad = idx.to_vec();
            bad[i] ^= 0x10;
            assert!(decode_index(&bad, 100).is_err(), "flipped byte {i}");
        }
        assert_eq!(decode_index(&idx[..idx.len() - 1], 100), Err(IndexError::Malformed));
        assert_eq!(decode_index(b"", 0), Err(IndexError::Malformed));
    }

    /// The sliced CRC equals the byte-at-a-time definition for every length and split.
    #[test]
    fn crc32c_equals_the_bitwise_definition() {
        fn bytewise(data: &[u8]) -> u32 {
            let mut c = !0u32;
            for &b in data {
                c ^= u32::from(b);
                for _ in 0..8 {
                    c = if c & 1 != 0 { 0x82F6_3B78 ^ (c >> 1) } else { c >> 1 };
                }
            }
            !c
        }
        let data: Vec<u8> = (0..300u32).map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8).collect();
        for len in 0..data.len() {
            assert_eq!(crc32c(&data[..len]), bytewise(&data[..len]), "length {len}");
        }
        for split in 0..64 {
            assert_eq!(crc32c_append(crc32c(&data[..split]), &data[split..]), bytewise(&data), "split {split}");
        }
    }

    #[test]
    fn a_compressed_batch_is_stored_compressed_and_read_back_as_it_was() {
        for codec in [Codec::Zstd, Codec::Lz4] {
            let mut b = batch(5, &crate::samples::COMPRESSIBLE);
            b.records = crate::samples::packed_records(codec);
            b.producer = Some((3, 1));
            let plain = StoredBatch { records: b.records.plain(), ..b.clone() };
            let (mut packed_buf, mut plain_buf) = (BytesMut::new(), BytesMut::new());
            encode_batch(&b, &mut packed_buf);
            encode_batch(&plain, &mut plain_buf);
            assert!(packed_buf.len() < plain_buf.len(), "{codec}: {} vs {}", packed_buf.len(), plain_buf.len());
            assert_eq!(packed_buf[BATCH_HEADER_LEN + 16] & FLAG_COMPRESSED, FLAG_COMPRESSED);
            encode_batch(&batch(9, &["after"]), &mut packed_buf);
            let r = decode_segment(packed_buf.clone().freeze());
            assert_eq!(r.problem, None);
            assert_eq!(r.batches[0], b, "{codec}: the compressed form kept");
            assert_eq!(
                r.batches[0].records.payloads().collect::<Vec<_>>(),
                plain.records.payloads().collect::<Vec<_>>()
            );
            // The producer digest is the plain block's, whichever way the batch is stored.
            assert_eq!(IndexEntry::of(&r.batches[0], 0).producer, IndexEntry::of(&plain, 0).producer);
            // A codec byte this version does not know, under a sound checksum: refused.
            let mut bad = packed_buf[..BATCH_HEADER_LEN + plain_len_of(&b)].to_vec();
            let at = BATCH_HEADER_LEN + 8 + 8 + 1 + 1 + 5 + 16;
            bad[at] = 7;
            let crc = crc32c(&bad[BATCH_HEADER_LEN..]);
            bad[8..12].copy_from_slice(&crc.to_be_bytes());
            let r = decode_segment(Bytes::from(bad));
            assert!(
                matches!(r.problem, Some(SegmentError::Malformed { error: PayloadError::UnknownCodec(7), .. })),
                "{:?}",
                r.problem
            );
        }
    }

    #[test]
    fn a_batch_keeps_its_key_across_a_restart() {
        let mut b = batch(3, &["x", "y"]);
        b.key = Some(Bytes::from_static(b"customer-7"));
        b.producer = Some((1, 2));
        let mut c = batch(5, &["z"]);
        c.key = Some(Bytes::new()); // an empty key is still a key
        c.records =
            crate::samples::packed_records(Codec::Lz4).with_envelope(Some(Bytes::from_static(b"\x01\x01\x02k1")));
        let mut buf = BytesMut::new();
        for x in [&b, &c, &batch(9, &["unkeyed"])] {
            encode_batch(x, &mut buf);
        }
        let r = decode_segment(buf.freeze());
        assert_eq!(r.problem, None);
        assert_eq!(r.batches, vec![b, c, batch(9, &["unkeyed"])]);
        assert_eq!(r.batches[2].key, None);
        assert_eq!(r.batches[1].records.envelope(), Some(&Bytes::from_static(b"\x01\x01\x02k1")), "D58");
    }

    /// The body length of `b` as stored.
    fn plain_len_of(b: &StoredBatch) -> usize {
        let mut buf = BytesMut::new();
        encode_batch(b, &mut buf);
        buf.len() - BATCH_HEADER_LEN
    }

    #[test]
    fn a_batch_header_read_alone_is_checked() {
        let mut buf = BytesMut::new();
        encode_batch(&batch(3, &["abc"]), &mut buf);
        let header: [u8; BATCH_HEADER_LEN] = buf[..BATCH_HEADER_LEN].try_into().unwrap();
        assert_eq!(batch_body_len(&header), Ok(buf.len() - BATCH_HEADER_LEN));
        let mut bad = header;
        bad[0] ^= 1;
        assert!(matches!(batch_body_len(&bad), Err(SegmentError::BadMagic { .. })));
        let mut huge = header;
        huge[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert!(matches!(batch_body_len(&huge), Err(SegmentError::TooLong { .. })));
    }

    #[test]
    fn a_commits_state_round_trips_in_the_segment_and_the_index() {
        let changes: Vec<StateChange> = vec![
            ("balance".into(), Some(Bytes::from_static(b"10"))),
            ("owner".into(), None),
            (String::new(), Some(Bytes::new())),
        ];
        let state = encode_state_changes(&changes).unwrap();
        assert_eq!(decode_state_changes(&state).unwrap(), changes);
        let mut b = batch(7, &["event"]);
        b.state = Some(state);
        b.producer = Some((1, 2));
        let mut buf = BytesMut::new();
        encode_batch(&b, &mut buf);
        encode_batch(&batch(8, &["plain"]), &mut buf);
        let r = decode_segment(buf.freeze());
        assert_eq!(r.problem, None);
        assert_eq!(r.batches, vec![b.clone(), batch(8, &["plain"])]);
        let entries = vec![IndexEntry::of(&b, 0), IndexEntry::of(&batch(8, &["plain"]), 80)];
        assert!(entries[0].state && !entries[1].state);
        assert_eq!(decode_index(&encode_index(&entries, 100), 100), Ok(entries));
        // A key too long for its length field is refused, not cut.
        assert_eq!(encode_state_changes(&[("k".repeat(MAX_STATE_KEY + 1), None)]), None);
    }

    #[test]
    fn bad_state_bytes_are_errors_and_a_batch_carrying_them_is_malformed() {
        let state = encode_state_changes(&[("k".into(), Some(Bytes::from_static(b"v")))]).unwrap();
        for cut in 0..state.len() {
            assert!(decode_state_changes(&state.slice(..cut)).is_err(), "cut at {cut}");
        }
        let mut bad_op = state.to_vec();
        bad_op[4] = 9;
        assert_eq!(decode_state_changes(&Bytes::from(bad_op.clone())), Err(PayloadError::InvalidStateOp(9)));
        let mut not_utf8 = state.to_vec();
        not_utf8[7] = 0xFF;
        assert!(matches!(decode_state_changes(&Bytes::from(not_utf8)), Err(PayloadError::InvalidUtf8 { .. })));
        let mut b = batch(1, &["e"]);
        b.state = Some(Bytes::from(bad_op));
        let mut buf = BytesMut::new();
        encode_batch(&b, &mut buf);
        let r = decode_segment(buf.freeze());
        assert!(r.batches.is_empty());
        assert!(matches!(r.problem, Some(SegmentError::Malformed { .. })), "{:?}", r.problem);
    }

    proptest::proptest! {
        /// Whatever the bytes, decoding state changes returns, and what decodes encodes back.
        #[test]
        fn state_decoding_never_panics(data in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..64)) {
            let data = Bytes::from(data);
            if let Ok(changes) = decode_state_changes(&data) {
                proptest::prop_assert_eq!(encode_state_changes(&changes), Some(data));
            }
        }
    }

    #[test]
    fn producer_id_and_sequence_round_trip() {
        let mut b = batch(7, &["x", "yy"]);
        b.producer = Some((0xDEAD_BEEF_0000_0001, 41));
        let mut buf = BytesMut::new();
        encode_batch(&b, &mut buf);
        encode_batch(&batch(9, &["z"]), &mut buf);
        let r = decode_segment(buf.freeze());
        assert_eq!(r.problem, None);
        assert_eq!(r.batches[0], b);
        assert_eq!(r.batches[1].producer, None);
    }

    #[test]
    fn crc32c_known_value() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
    }

    #[test]
    fn round_trip_and_torn_tail() {
        let mut seg = BytesMut::new();
        encode_batch(&batch(0, &["a", "bb"]), &mut seg);
        encode_batch(&batch(2, &["c"]), &mut seg);
        let whole = decode_segment(seg.clone().freeze());
        assert_eq!(whole.batches, vec![batch(0, &["a", "bb"]), batch(2, &["c"])]);
        assert_eq!((whole.valid_len, whole.problem), (seg.len(), None));
        let first_len = {
            let mut one = BytesMut::new();
            encode_batch(&batch(0, &["a", "bb"]), &mut one);
            one.len()
        };
        for cut in first_len + 1..seg.len() {
            let r = decode_segment(seg.clone().freeze().slice(..cut));
            assert_eq!(r.batches.len(), 1);
            assert_eq!(r.valid_len, first_len);
            assert!(matches!(r.problem, Some(SegmentError::Torn { .. })), "{cut}");
        }
    }

    #[test]
    fn every_flipped_byte_is_caught() {
        let mut seg = BytesMut::new();
        encode_batch(&batch(7, &["payload"]), &mut seg);
        for i in 0..seg.len() {
            let mut bad = seg.clone();
            bad[i] ^= 0x40;
            let r = decode_segment(bad.freeze());
            assert!(r.batches.is_empty() && r.problem.is_some(), "byte {i} flip went unnoticed");
        }
    }

    #[test]
    fn unknown_batch_flags_are_refused_not_masked() {
        let mut seg = BytesMut::new();
        encode_batch(&batch(0, &["a"]), &mut seg);
        // Set an unknown flag bit and fix the checksum, as a newer writer would.
        seg[BATCH_HEADER_LEN + 16] |= 0x40;
        let crc = crc32c(&seg[BATCH_HEADER_LEN..]);
        seg[8..12].copy_from_slice(&crc.to_be_bytes());
        let r = decode_segment(seg.freeze());
        assert!(r.batches.is_empty());
        assert_eq!(r.problem, Some(SegmentError::UnknownFlags { at: 0, flags: 0x40 }));
    }

    #[test]
    fn backward_offsets_stop_reading_and_forward_gaps_do_not() {
        let mut seg = BytesMut::new();
        encode_batch(&batch(0, &["a"]), &mut seg);
        encode_batch(&batch(5, &["b"]), &mut seg); // offsets 1..5: a write that failed
        encode_batch(&batch(3, &["c"]), &mut seg);
        let r = decode_segment(seg.freeze());
        assert_eq!(r.batches.len(), 2);
        assert!(matches!(r.problem, Some(SegmentError::OutOfOrder { got: 3, expected: 6, .. })));
    }

    #[test]
    fn a_corrupt_batch_inside_the_file_is_skipped_and_the_rest_served() {
        let mut seg = BytesMut::new();
        encode_batch(&batch(0, &["a"]), &mut seg);
        let second = seg.len();
        encode_batch(&batch(1, &["bbbb"]), &mut seg);
        let third = seg.len();
        encode_batch(&batch(2, &["c"]), &mut seg);
        let mut bytes = seg.to_vec();
        bytes[third - 2] ^= 0x40; // a flipped bit in the second batch's payload
        let r = decode_segment(Bytes::from(bytes.clone()));
        assert_eq!(r.batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), [0, 2]);
        assert_eq!(r.positions, [0, third]);
        assert_eq!(r.damaged, [SegmentError::BadChecksum { at: second }]);
        assert_eq!((r.problem, r.valid_len), (None, bytes.len()));
        // The same damage in the last batch is a bad tail: cut there.
        bytes[third - 2] ^= 0x40;
        let last = bytes.len() - 2;
        bytes[last] ^= 0x40;
        let r = decode_segment(Bytes::from(bytes));
        assert_eq!(r.batches.len(), 2);
        assert_eq!((r.problem, r.valid_len), (Some(SegmentError::BadChecksum { at: third }), third));
    }

    #[test]
    fn names() {
        assert_eq!(segment_name(42), "00000000000000000042.seg");
        assert_eq!(parse_segment_name("00000000000000000042.seg"), Some(42));
        assert_eq!(parse_segment_name("42.seg"), None);
        for n in ["orders", "../etc", ".hidden", "a/b", "ünï", "", "%41"] {
            let c = path_component(n);
            assert!(!c.contains('/') && c != "." && c != ".." && !c.starts_with('.'), "{c}");
            assert_eq!(parse_path_component(&c).as_deref(), Some(n));
        }
    }
}

/// Magic of a shard's producer-watermark file: "FLXP".
const WATERMARK_MAGIC: u32 = 0x464C_5850;

/// A shard's producer watermarks (`StorageOutput::Truncate::producers_forgotten`, the highest
/// per producer) as the file storage keeps beside the shard and hands back at recovery:
///
/// ```text
/// u32 magic "FLXP", u32 count, count × (u64 producer_id, u64 forgotten_through), u32 crc32c
/// ```
///
/// Pairs are written sorted by producer id, so equal contents make equal files.
pub fn encode_producer_watermarks(pairs: &[(u64, u64)]) -> Bytes {
    let mut sorted = pairs.to_vec();
    sorted.sort_unstable();
    let mut out = BytesMut::with_capacity(12 + 16 * sorted.len());
    out.put_u32(WATERMARK_MAGIC);
    out.put_u32(sorted.len() as u32);
    for (id, through) in sorted {
        out.put_u64(id);
        out.put_u64(through);
    }
    let crc = crc32c(&out);
    out.put_u32(crc);
    out.freeze()
}

/// Reads a producer-watermark file. Never panics.
///
/// # Errors
/// [`IndexError::Malformed`] for a short file, a wrong magic or a count that does not match the
/// length; [`IndexError::BadChecksum`] for damaged contents.
pub fn decode_producer_watermarks(data: &[u8]) -> Result<Vec<(u64, u64)>, IndexError> {
    let word = |at: usize| data.get(at..at + 4).map(|b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]));
    let long = |at: usize| data.get(at..at + 8).and_then(|b| b.try_into().ok()).map(u64::from_be_bytes);
    if word(0) != Some(WATERMARK_MAGIC) {
        return Err(IndexError::Malformed);
    }
    let count = word(4).ok_or(IndexError::Malformed)? as usize;
    let end = count.checked_mul(16).and_then(|n| n.checked_add(8)).ok_or(IndexError::Malformed)?;
    if data.len() != end + 4 {
        return Err(IndexError::Malformed);
    }
    if word(end) != Some(crc32c(&data[..end])) {
        return Err(IndexError::BadChecksum);
    }
    (0..count)
        .map(|i| Some((long(8 + 16 * i)?, long(16 + 16 * i)?)))
        .collect::<Option<Vec<_>>>()
        .ok_or(IndexError::Malformed)
}

/// Magic of a shard's state-checkpoint file: "FLXS".
const STATE_CHECKPOINT_MAGIC: u32 = 0x464C_5853;

/// A shard's commit state at one point of its log (atomic commits, `state_get`): every live
/// key with its value and the offset of the commit that wrote it, and `as_of`, the offset of
/// the last commit it includes. Retention may delete the segments holding the commits that
/// wrote it only once this is on disk; recovery starts from it and replays only the commits
/// after `as_of`. A moving shard's first copy answer carries it too.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StateCheckpoint {
    /// The offset of the last commit applied.
    pub as_of: u64,
    /// `(key, value, version)` in key order; `version` is the offset of the commit that wrote
    /// the value.
    pub values: Vec<(String, Bytes, u64)>,
}

/// Encodes a [`StateCheckpoint`] as storage keeps it beside the shard (`state.checkpoint`)
/// and as a copy answer carries it:
///
/// ```text
/// u32 magic "FLXS", u64 as_of, u32 count,
/// count × (u16 key_len, key (UTF-8), u64 version, u32 value_len, value), u32 crc32c
/// ```
///
/// `None` when a key or value is longer than its length field holds (the broker refuses such
/// commits, so its own state always encodes).
pub fn encode_state_checkpoint(c: &StateCheckpoint) -> Option<Bytes> {
    let size: usize = c.values.iter().map(|(k, v, _)| 14 + k.len() + v.len()).sum();
    let mut out = BytesMut::with_capacity(20 + size);
    out.put_u32(STATE_CHECKPOINT_MAGIC);
    out.put_u64(c.as_of);
    out.put_u32(u32::try_from(c.values.len()).ok()?);
    for (key, value, version) in &c.values {
        out.put_u16(u16::try_from(key.len()).ok()?);
        out.extend_from_slice(key.as_bytes());
        out.put_u64(*version);
        out.put_u32(u32::try_from(value.len()).ok()?);
        out.extend_from_slice(value);
    }
    let crc = crc32c(&out);
    out.put_u32(crc);
    Some(out.freeze())
}

/// The `as_of` of [`encode_state_checkpoint`]'s bytes, read from their header alone (storage
/// keeps it to know which commits the checkpoint on disk holds); `None` for bytes that do not
/// start like a checkpoint.
pub fn state_checkpoint_as_of(data: &[u8]) -> Option<u64> {
    let magic = u32::from_be_bytes(data.get(..4)?.try_into().ok()?);
    (magic == STATE_CHECKPOINT_MAGIC).then_some(())?;
    Some(u64::from_be_bytes(data.get(4..12)?.try_into().ok()?))
}

/// Why a state checkpoint cannot be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// Too short, a wrong magic, or contents that do not add up to the length.
    #[error("not a state checkpoint: {0}")]
    Malformed(&'static str),
    /// The checksum does not match (the file was damaged after it was written).
    #[error("state checkpoint checksum mismatch")]
    BadChecksum,
}

/// Reads [`encode_state_checkpoint`]'s bytes. Never panics; keys come back in the order
/// written and must be strictly increasing (a file that repeats a key is malformed).
///
/// # Errors
/// [`CheckpointError`] for bytes that are not a whole, undamaged checkpoint.
pub fn decode_state_checkpoint(data: &Bytes) -> Result<StateCheckpoint, CheckpointError> {
    if data.len() < 20 {
        return Err(CheckpointError::Malformed("shorter than a header"));
    }
    let body = data.slice(..data.len() - 4);
    let crc =
        u32::from_be_bytes([data[data.len() - 4], data[data.len() - 3], data[data.len() - 2], data[data.len() - 1]]);
    let mut r = Reader::new(body.clone());
    let bad = |_| CheckpointError::Malformed("truncated");
    if r.u32("magic").map_err(bad)? != STATE_CHECKPOINT_MAGIC {
        return Err(CheckpointError::Malformed("wrong magic"));
    }
    if crc != crc32c(&body) {
        return Err(CheckpointError::BadChecksum);
    }
    let as_of = r.u64("as_of").map_err(bad)?;
    let count = r.u32("count").map_err(bad)?;
    // Each value takes at least 14 bytes: a count beyond that is garbage, not an allocation.
    let mut values: Vec<(String, Bytes, u64)> = Vec::with_capacity((count as usize).min(body.len() / 14));
    for _ in 0..count {
        let klen = r.u16("key_len").map_err(bad)? as usize;
        let key = r.string(klen, "key").map_err(|e| match e {
            PayloadError::InvalidUtf8 { .. } => CheckpointError::Malformed("a key is not UTF-8"),
            _ => CheckpointError::Malformed("truncated"),
        })?;
        let version = r.u64("version").map_err(bad)?;
        let vlen = r.u32("value_len").map_err(bad)? as usize;
        let value = r.bytes(vlen, "value").map_err(bad)?;
        if values.last().is_some_and(|(k, _, _)| *k >= key) {
            return Err(CheckpointError::Malformed("keys out of order"));
        }
        values.push((key, value, version));
    }
    r.finish().map_err(|_| CheckpointError::Malformed("bytes after the last value"))?;
    Ok(StateCheckpoint { as_of, values })
}

#[cfg(test)]
mod checkpoint_tests {
    use super::*;

    #[test]
    fn a_state_checkpoint_round_trips_and_refuses_damage() {
        let c = StateCheckpoint {
            as_of: 41,
            values: vec![("a".into(), Bytes::from_static(b"1"), 3), ("b".into(), Bytes::new(), 41)],
        };
        let file = encode_state_checkpoint(&c).unwrap();
        assert_eq!(decode_state_checkpoint(&file), Ok(c));
        assert_eq!(state_checkpoint_as_of(&file), Some(41));
        assert_eq!(state_checkpoint_as_of(&file[..11]), None);
        assert_eq!(state_checkpoint_as_of(b"FLXP and more bytes"), None);
        let empty = encode_state_checkpoint(&StateCheckpoint::default()).unwrap();
        assert_eq!(decode_state_checkpoint(&empty), Ok(StateCheckpoint::default()));
        for cut in 0..file.len() {
            assert!(decode_state_checkpoint(&file.slice(..cut)).is_err(), "truncated at {cut}");
        }
        for at in 4..file.len() {
            let mut flipped = file.to_vec();
            flipped[at] ^= 0x10;
            assert!(decode_state_checkpoint(&Bytes::from(flipped)).is_err(), "flipped at {at}");
        }
        let mut huge = file[..file.len() - 4].to_vec();
        huge[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
        let crc = crc32c(&huge);
        huge.extend_from_slice(&crc.to_be_bytes());
        assert_eq!(decode_state_checkpoint(&Bytes::from(huge)), Err(CheckpointError::Malformed("truncated")));
        let twice =
            StateCheckpoint { as_of: 1, values: vec![("a".into(), Bytes::new(), 1), ("a".into(), Bytes::new(), 1)] };
        let twice = encode_state_checkpoint(&twice).unwrap();
        assert_eq!(decode_state_checkpoint(&twice), Err(CheckpointError::Malformed("keys out of order")));
    }
}

#[cfg(test)]
mod watermark_tests {
    use super::*;

    #[test]
    fn producer_watermarks_round_trip_and_refuse_damage() {
        let pairs = [(9, 3), (7, 100), (u64::MAX, u64::MAX)];
        let file = encode_producer_watermarks(&pairs);
        assert_eq!(decode_producer_watermarks(&file), Ok(vec![(7, 100), (9, 3), (u64::MAX, u64::MAX)]));
        assert_eq!(decode_producer_watermarks(&encode_producer_watermarks(&[])), Ok(vec![]));
        for cut in 0..file.len() {
            assert!(decode_producer_watermarks(&file[..cut]).is_err(), "truncated at {cut}");
        }
        let mut flipped = file.to_vec();
        flipped[12] ^= 1;
        assert_eq!(decode_producer_watermarks(&flipped), Err(IndexError::BadChecksum));
        let mut huge = file.to_vec();
        huge[4..8].copy_from_slice(&u32::MAX.to_be_bytes());
        assert_eq!(decode_producer_watermarks(&huge), Err(IndexError::Malformed));
    }
}
