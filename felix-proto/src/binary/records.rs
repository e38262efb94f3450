//! A validated block of length-prefixed records, kept as one `Bytes`.
//!
//! Publish batches and event batches share the per-record layout `u32 payload_len, payload`
//! (event batches optionally put a `u64 timestamp_micros` before each). The block is validated
//! once when decoded and then kept as the raw bytes: iterating hands out slices, and a broker can
//! put the very same bytes of a publish batch into the event batch it fans out, without touching
//! a payload.

use super::compression::{self, Codec, Compressor, Decompressor, Packed};
use super::{EncodeError, PayloadError, Reader};
use bytes::{BufMut, Bytes, BytesMut};

/// `count` records, optionally each with a timestamp, as validated raw bytes.
///
/// A block that travelled compressed (D56) also keeps its compressed form (`packed`): the
/// plain block is what every reader of records uses, the compressed one is what is stored and
/// sent on, as it came, to a peer that takes its codec. Every `Records` holding a packed form
/// holds the plain block it inflates to, and at least one record; a timed one has one append
/// time for every record (a compressed block carries one).
#[derive(Clone, PartialEq, Eq, Default)]
pub struct Records {
    count: u32,
    timed: bool,
    payload_bytes: usize,
    raw: Bytes,
    packed: Option<Packed>,
    envelope: Option<Bytes>,
}

/// One record of a [`Records`] block.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    /// Append time in microseconds since the Unix epoch, when the block is timed.
    pub timestamp_micros: Option<u64>,
    /// The payload, a slice of the block.
    pub payload: Bytes,
}

impl std::fmt::Debug for Records {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Records")
            .field("count", &self.count)
            .field("timed", &self.timed)
            .field("payload_bytes", &self.payload_bytes)
            .field("packed", &self.packed.as_ref().map(|p| (p.codec, p.data.len())))
            .field("envelope", &self.envelope.as_ref().map(Bytes::len))
            .finish()
    }
}

impl Records {
    /// Reads `u32 count` then the records, from the reader's position to the end.
    pub(crate) fn decode(r: &mut Reader, timed: bool) -> Result<Records, PayloadError> {
        let count = r.u32("count")?;
        Records::validate(count, r.rest(), timed)
    }

    /// Reads a compressed block (D56) from the reader's position to the end: `u32 count`, the
    /// shared `u64 timestamp_micros` when `timed`, `u32 raw_len`, then the compressed bytes.
    /// The plain block is inflated (refused before any allocation when it declares more than
    /// `limit` bytes) and validated as `count` untimed records.
    pub(crate) fn decode_packed(
        r: &mut Reader,
        codec: Codec,
        timed: bool,
        limit: usize,
        dec: &mut Decompressor,
    ) -> Result<Records, PayloadError> {
        let count = r.u32("count")?;
        if count == 0 {
            return Err(PayloadError::EmptyCompressedBlock);
        }
        let timestamp = if timed { Some(r.u64("timestamp_micros")?) } else { None };
        let raw_len = r.u32("raw_len")? as usize;
        // Every record takes at least its four-byte length: bounded before inflating.
        if count as usize > raw_len / 4 {
            return Err(PayloadError::CountTooLarge { count, remaining: raw_len });
        }
        let data = r.rest();
        let plain = dec.decompress(codec, &data, raw_len, limit).map_err(PayloadError::Compression)?;
        let mut records = Records::validate(count, plain, false)?;
        records.packed = Some(Packed { codec, data });
        Ok(match timestamp {
            Some(t) => records.with_timestamp(t),
            None => records,
        })
    }

    /// Checks that `raw` holds exactly `count` records.
    fn validate(count: u32, raw: Bytes, timed: bool) -> Result<Records, PayloadError> {
        let per = if timed { 12 } else { 4 };
        let remaining = raw.len();
        if count as usize > remaining / per {
            return Err(PayloadError::CountTooLarge { count, remaining });
        }
        let mut pos = 0usize;
        let mut payload_bytes = 0usize;
        for _ in 0..count {
            if timed {
                if raw.len() - pos < 8 {
                    return Err(PayloadError::Incomplete { field: "timestamp_micros" });
                }
                pos += 8;
            }
            if raw.len() - pos < 4 {
                return Err(PayloadError::Incomplete { field: "payload_len" });
            }
            let len = u32::from_be_bytes([raw[pos], raw[pos + 1], raw[pos + 2], raw[pos + 3]]) as usize;
            pos += 4;
            if raw.len() - pos < len {
                return Err(PayloadError::Incomplete { field: "payload" });
            }
            pos += len;
            payload_bytes += len;
        }
        if pos != raw.len() {
            return Err(PayloadError::TrailingBytes(raw.len() - pos));
        }
        Ok(Records { count, timed, payload_bytes, raw, packed: None, envelope: None })
    }

    /// Builds an untimed block from payloads (one copy of each payload).
    ///
    /// # Errors
    /// A payload over `u32::MAX` bytes, or more than `u32::MAX` payloads.
    pub fn from_payloads<I, P>(payloads: I) -> Result<Records, EncodeError>
    where
        I: IntoIterator<Item = P>,
        P: AsRef<[u8]>,
    {
        Self::build(payloads.into_iter().map(|p| (None, p)), false)
    }

    /// Builds a timed block from `(timestamp_micros, payload)` pairs.
    ///
    /// # Errors
    /// As [`from_payloads`](Self::from_payloads).
    pub fn from_timed<I, P>(items: I) -> Result<Records, EncodeError>
    where
        I: IntoIterator<Item = (u64, P)>,
        P: AsRef<[u8]>,
    {
        Self::build(items.into_iter().map(|(t, p)| (Some(t), p)), true)
    }

    fn build<I, P>(items: I, timed: bool) -> Result<Records, EncodeError>
    where
        I: Iterator<Item = (Option<u64>, P)>,
        P: AsRef<[u8]>,
    {
        let mut raw = BytesMut::new();
        let mut count = 0usize;
        let mut payload_bytes = 0usize;
        for (t, p) in items {
            let p = p.as_ref();
            let len = as_u32("payload", p.len())?;
            if let Some(t) = t {
                raw.put_u64(t);
            }
            raw.put_u32(len);
            raw.extend_from_slice(p);
            payload_bytes += p.len();
            count += 1;
        }
        Ok(Records {
            count: as_u32("count", count)?,
            timed,
            payload_bytes,
            raw: raw.freeze(),
            packed: None,
            envelope: None,
        })
    }

    /// Number of records.
    pub fn count(&self) -> u32 {
        self.count
    }
    /// Whether no record is held.
    pub fn is_empty(&self) -> bool {
        self.count == 0
    }
    /// Whether each record carries a timestamp.
    pub fn is_timed(&self) -> bool {
        self.timed
    }
    /// Sum of the payload lengths.
    pub fn payload_bytes(&self) -> usize {
        self.payload_bytes
    }
    /// The raw block (without the count), for zero-copy re-framing.
    pub fn raw(&self) -> &Bytes {
        &self.raw
    }
    /// Iterates the records.
    pub fn iter(&self) -> RecordsIter<'_> {
        RecordsIter { records: self, pos: 0, left: self.count }
    }
    /// Iterates just the payloads, as owned `Bytes` (one reference-count increment each).
    pub fn payloads(&self) -> impl Iterator<Item = Bytes> + '_ {
        self.iter().map(|r| r.payload)
    }
    /// Iterates the payloads as borrowed slices: no reference counting, for consumers that
    /// only read them (hashing, printing, writing to storage).
    pub fn slices(&self) -> SlicesIter<'_> {
        SlicesIter { raw: &self.raw, pos: 0, left: self.count, timed: self.timed }
    }
    /// The envelope it travels with (D58): opaque bytes its publisher attached (end-to-end
    /// encryption's key id and algorithm), stored and delivered as sent.
    pub fn envelope(&self) -> Option<&Bytes> {
        self.envelope.as_ref()
    }
    /// This block with `envelope` attached (or removed).
    pub fn with_envelope(&self, envelope: Option<Bytes>) -> Records {
        Records { envelope, ..self.clone() }
    }
    /// The compressed form this block travelled in, if it did.
    pub fn packed(&self) -> Option<&Packed> {
        self.packed.as_ref()
    }
    /// The codec of the compressed form, if any.
    pub fn codec(&self) -> Option<Codec> {
        self.packed.as_ref().map(|p| p.codec)
    }
    /// This block without its compressed form (no copy): what a peer that does not take its
    /// codec is sent.
    pub fn plain(&self) -> Records {
        Records { packed: None, ..self.clone() }
    }
    /// This block with a compressed form made by `compressor`, when that shrinks it (an
    /// untimed block with at least one record); otherwise the block as it is.
    pub fn compressed(&self, compressor: &mut Compressor) -> Records {
        if self.timed || self.count == 0 {
            return self.clone();
        }
        match compressor.compress(&self.raw) {
            Some(data) => Records { packed: Some(Packed { codec: compressor.codec(), data }), ..self.clone() },
            None => self.plain(),
        }
    }
    /// Rebuilds a block from a stored compressed form: `count` records whose plain block,
    /// `raw_len` bytes, is `data` inflated (refused over `limit`).
    ///
    /// # Errors
    /// As a compressed publish batch's block.
    pub fn from_packed(
        count: u32,
        codec: Codec,
        data: Bytes,
        raw_len: usize,
        limit: usize,
    ) -> Result<Records, PayloadError> {
        if count == 0 {
            return Err(PayloadError::EmptyCompressedBlock);
        }
        if count as usize > raw_len / 4 {
            return Err(PayloadError::CountTooLarge { count, remaining: raw_len });
        }
        let plain = compression::decompress(codec, &data, raw_len, limit).map_err(PayloadError::Compression)?;
        let mut records = Records::validate(count, plain, false)?;
        records.packed = Some(Packed { codec, data });
        Ok(records)
    }
    /// Length of the plain untimed block: what a compressed form declares as `raw_len`.
    pub fn plain_len(&self) -> usize {
        if self.timed { self.raw.len() - 8 * self.count as usize } else { self.raw.len() }
    }
    /// The append time shared by every record of a timed block (its first record's).
    pub(crate) fn first_timestamp(&self) -> Option<u64> {
        self.iter().next().and_then(|r| r.timestamp_micros)
    }

    /// This block with every record stamped `timestamp_micros` (one copy of the block; a
    /// compressed form is kept, as it carries one time for all).
    pub fn with_timestamp(&self, timestamp_micros: u64) -> Records {
        if self.timed {
            return self.clone();
        }
        let mut raw = BytesMut::with_capacity(self.raw.len() + 8 * self.count as usize);
        for r in self.iter() {
            raw.put_u64(timestamp_micros);
            raw.put_u32(r.payload.len() as u32);
            raw.extend_from_slice(&r.payload);
        }
        Records {
            count: self.count,
            timed: true,
            payload_bytes: self.payload_bytes,
            raw: raw.freeze(),
            packed: self.packed.clone(),
            envelope: self.envelope.clone(),
        }
    }
    /// This block without timestamps (one copy of the block when it had them).
    pub fn without_timestamps(&self) -> Records {
        if !self.timed {
            return self.clone();
        }
        let mut raw = BytesMut::with_capacity(self.raw.len() - 8 * self.count as usize);
        for r in self.iter() {
            raw.put_u32(r.payload.len() as u32);
            raw.extend_from_slice(&r.payload);
        }
        Records {
            count: self.count,
            timed: false,
            payload_bytes: self.payload_bytes,
            raw: raw.freeze(),
            packed: self.packed.clone(),
            envelope: self.envelope.clone(),
        }
    }
    /// This block without its first `n` records (a slice of the same bytes, no copy).
    pub fn skip(&self, n: u32) -> Records {
        if n == 0 {
            return self.clone();
        }
        if n >= self.count {
            return Records {
                count: 0,
                timed: self.timed,
                payload_bytes: 0,
                raw: Bytes::new(),
                packed: None,
                envelope: self.envelope.clone(),
            };
        }
        let mut it = self.iter();
        let mut skipped_bytes = 0usize;
        for _ in 0..n {
            if let Some(r) = it.next() {
                skipped_bytes += r.payload.len();
            }
        }
        Records {
            count: self.count - n,
            timed: self.timed,
            payload_bytes: self.payload_bytes - skipped_bytes,
            raw: self.raw.slice(it.pos..),
            packed: None,
            envelope: self.envelope.clone(),
        }
    }
    /// Whether [`put_block`](Self::put_block) writes this block compressed: it has a
    /// compressed form and is untimed (a stored, replicated or forwarded block is).
    pub fn stores_packed(&self) -> bool {
        self.packed.is_some() && !self.timed
    }

    /// Bytes [`put_block`](Self::put_block) writes.
    pub fn block_len(&self) -> usize {
        match self.packed.as_ref().filter(|_| !self.timed) {
            Some(p) => 1 + 4 + 4 + p.data.len(),
            None => 4 + self.raw.len(),
        }
    }

    /// Writes the block as it is kept outside a client frame (a stored batch, a replicated
    /// entry, a forwarded publish), the last thing in its container: compressed when
    /// [`stores_packed`](Self::stores_packed), `u8 codec (1 zstd, 2 lz4), u32 count, u32
    /// raw_len`, the compressed bytes; else `u32 count` and the plain block.
    pub fn put_block(&self, dst: &mut impl BufMut) {
        let body = self.put_block_header(dst);
        dst.put_slice(body);
    }

    /// [`put_block`](Self::put_block) in two parts: writes the block's header to `dst` and
    /// returns its body, for a writer that hands large bodies on as they
    /// are.
    pub(crate) fn put_block_header(&self, dst: &mut impl BufMut) -> &Bytes {
        match self.packed.as_ref().filter(|_| !self.timed) {
            Some(p) => {
                dst.put_u8(p.codec.byte());
                dst.put_u32(self.count);
                dst.put_u32(self.raw.len() as u32);
                &p.data
            }
            None => {
                dst.put_u32(self.count);
                &self.raw
            }
        }
    }

    /// Reads [`put_block`](Self::put_block)'s bytes, to the reader's end (`packed`: its
    /// container said the block is compressed). A compressed block is inflated, refused
    /// before any allocation when it declares more than `limit` plain bytes.
    ///
    /// # Errors
    /// An unknown codec, a block that does not inflate or does not hold its records.
    pub(crate) fn read_block(r: &mut Reader, packed: bool, limit: usize) -> Result<Records, PayloadError> {
        if !packed {
            return Records::decode(r, false);
        }
        let byte = r.u8("codec")?;
        let codec = Codec::from_byte(byte).ok_or(PayloadError::UnknownCodec(byte))?;
        let count = r.u32("count")?;
        let raw_len = r.u32("raw_len")? as usize;
        Records::from_packed(count, codec, r.rest(), raw_len, limit)
    }

    /// Writes `u32 count` and the block.
    pub(crate) fn encode(&self, dst: &mut BytesMut) {
        dst.put_u32(self.count);
        dst.extend_from_slice(&self.raw);
    }
    /// Encoded size: count plus block.
    pub(crate) fn encoded_len(&self) -> usize {
        4 + self.raw.len()
    }
    /// Writes a compressed block's head: `u32 count`, the shared time when timed, `u32
    /// raw_len` (the compressed bytes follow). `None` when the block has no compressed form.
    pub(crate) fn encode_packed_head(&self, dst: &mut BytesMut) -> Option<()> {
        self.packed.as_ref()?;
        dst.put_u32(self.count);
        if self.timed {
            dst.put_u64(self.first_timestamp().unwrap_or(0));
        }
        dst.put_u32(self.plain_len() as u32);
        Some(())
    }
    /// Bytes of [`encode_packed_head`](Self::encode_packed_head) and the compressed data.
    pub(crate) fn packed_encoded_len(&self) -> Option<usize> {
        let p = self.packed.as_ref()?;
        Some(8 + if self.timed { 8 } else { 0 } + p.data.len())
    }
}

/// The encoded size (count plus block) of an untimed block holding `payloads`.
pub(crate) fn payloads_encoded_len<P: AsRef<[u8]>>(payloads: &[P]) -> usize {
    4 + payloads.iter().map(|p| 4 + p.as_ref().len()).sum::<usize>()
}

/// Writes an untimed block (count, then each length and payload) holding `payloads`: the bytes
/// of `Records::from_payloads(payloads)` encoded, with one copy of each payload.
pub(crate) fn encode_payloads<P: AsRef<[u8]>>(payloads: &[P], dst: &mut BytesMut) -> Result<(), EncodeError> {
    dst.put_u32(as_u32("count", payloads.len())?);
    for p in payloads {
        let p = p.as_ref();
        dst.put_u32(as_u32("payload", p.len())?);
        dst.extend_from_slice(p);
    }
    Ok(())
}

/// A count or length as the `u32` the wire holds, or `TooLong` naming the field.
fn as_u32(field: &'static str, len: usize) -> Result<u32, EncodeError> {
    u32::try_from(len).map_err(|_| EncodeError::TooLong { field, len, max: u32::MAX as usize })
}

/// Iterator over a [`Records`] block.
pub struct RecordsIter<'a> {
    records: &'a Records,
    pos: usize,
    left: u32,
}

impl Iterator for RecordsIter<'_> {
    type Item = Record;

    fn next(&mut self) -> Option<Record> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let raw = &self.records.raw;
        // The block was validated when it was built, so every read below is in bounds.
        let mut p = self.pos;
        let timestamp_micros = if self.records.timed {
            let mut t = [0u8; 8];
            t.copy_from_slice(&raw[p..p + 8]);
            p += 8;
            Some(u64::from_be_bytes(t))
        } else {
            None
        };
        let len = u32::from_be_bytes([raw[p], raw[p + 1], raw[p + 2], raw[p + 3]]) as usize;
        p += 4;
        let payload = raw.slice(p..p + len);
        self.pos = p + len;
        Some(Record { timestamp_micros, payload })
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for RecordsIter<'_> {}

/// Borrowed iterator over a [`Records`] block's payloads.
pub struct SlicesIter<'a> {
    raw: &'a [u8],
    pos: usize,
    left: u32,
    timed: bool,
}

impl<'a> Iterator for SlicesIter<'a> {
    type Item = &'a [u8];

    fn next(&mut self) -> Option<&'a [u8]> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        // Validated when the block was built: every read is in bounds.
        let p = self.pos + if self.timed { 8 } else { 0 };
        let raw = self.raw;
        let len = u32::from_be_bytes([raw[p], raw[p + 1], raw[p + 2], raw[p + 3]]) as usize;
        self.pos = p + 4 + len;
        Some(&raw[p + 4..p + 4 + len])
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.left as usize, Some(self.left as usize))
    }
}

impl ExactSizeIterator for SlicesIter<'_> {}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn build_iterate_and_convert() {
        let r = Records::from_payloads(["a", "", "ccc"]).unwrap();
        assert_eq!(r.count(), 3);
        assert_eq!(r.payload_bytes(), 4);
        let p: Vec<Bytes> = r.payloads().collect();
        assert_eq!(p, vec![Bytes::from("a"), Bytes::new(), Bytes::from("ccc")]);
        assert_eq!(r.slices().collect::<Vec<_>>(), vec![&b"a"[..], b"", b"ccc"]);
        let t = r.with_timestamp(9);
        assert_eq!(t.slices().collect::<Vec<_>>(), vec![&b"a"[..], b"", b"ccc"]);
        assert!(t.iter().all(|x| x.timestamp_micros == Some(9)));
        assert_eq!(t.without_timestamps(), r);
        assert_eq!(r.skip(1).payloads().collect::<Vec<_>>(), vec![Bytes::new(), Bytes::from("ccc")]);
        assert_eq!(r.skip(1).payload_bytes(), 3);
        assert!(r.skip(5).is_empty());
        assert_eq!(t.skip(2).slices().collect::<Vec<_>>(), vec![&b"ccc"[..]]);
    }

    #[test]
    fn count_is_bounded_before_walking() {
        let mut raw = BytesMut::new();
        raw.put_u32(u32::MAX);
        let mut rd = Reader::new(raw.freeze());
        assert_eq!(Records::decode(&mut rd, false), Err(PayloadError::CountTooLarge { count: u32::MAX, remaining: 0 }));
    }
}
