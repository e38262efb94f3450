//! Binary publish batch (flag 0x0001) with its optional prefixes.
//!
//! Payload assembly, in this order:
//! ```text
//! u64 request_id, u8 ack_mode          if 0x0008 (acked)
//! u64 producer_id, u64 sequence        if 0x0100 (idempotent; needs 0x0008)
//! u16 key_len, key                     if 0x0040 (keyed)
//! u16 tenant_len, tenant_id, u16 namespace_len, namespace, u16 stream_len, stream
//! u32 count, count × (u32 payload_len, payload)
//! ```
//! With [`Flags::EXTENDED`] (D56) the payload opens with `u16 flags_hi`, before everything
//! above; a codec bit in it ([`FlagsHi::COMPRESSED_ZSTD`], [`FlagsHi::COMPRESSED_LZ4`]) makes
//! the record block `u32 count, u32 raw_len, compressed bytes` (see [`super::compression`]).
//! The acked prefix comes first so a broker can read `request_id` before parsing anything else
//! and answer a malformed body with an error its client can match ([`PublishBatch::peek_request_id`]).

use super::compression::{Codec, Compressor, Decompressor};
use super::{EncodeError, PayloadError, Reader, Records, put_str16};
use crate::flags::{Flags, FlagsHi};
use crate::frame::{begin_frame, patch_length};
use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// How a publish is acknowledged. On the binary path only `PerMessage` and `PerBatch` have a byte
/// (an unacknowledged publish is a plain 0x0001 frame), and both mean one answer per frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AckMode {
    /// Fire and forget.
    #[default]
    None,
    /// Acknowledged (`1` on the binary path).
    PerMessage,
    /// Acknowledged (`2` on the binary path).
    PerBatch,
}

impl AckMode {
    /// The binary byte; `None` has none.
    pub const fn to_byte(self) -> Option<u8> {
        match self {
            AckMode::None => None,
            AckMode::PerMessage => Some(1),
            AckMode::PerBatch => Some(2),
        }
    }
    /// Reads the binary byte.
    ///
    /// # Errors
    /// [`PayloadError::InvalidAckMode`] for anything but 1 or 2.
    pub const fn from_byte(b: u8) -> Result<AckMode, PayloadError> {
        match b {
            1 => Ok(AckMode::PerMessage),
            2 => Ok(AckMode::PerBatch),
            other => Err(PayloadError::InvalidAckMode(other)),
        }
    }
    /// Whether an answer is owed.
    pub const fn is_acked(self) -> bool {
        !matches!(self, AckMode::None)
    }
}

/// The 0x0008 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AckedPrefix {
    /// Correlation id echoed by the ack.
    pub request_id: u64,
    /// `PerMessage` or `PerBatch`.
    pub ack_mode: AckMode,
}

/// The 0x0100 prefix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IdempotentPrefix {
    /// Id from `producer_init_ok`.
    pub producer_id: u64,
    /// The producer's batch number on the shard, from 0.
    pub sequence: u64,
}

/// A binary publish batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishBatch {
    /// 0x0008: answered with a binary ack (or JSON, when idempotent).
    pub acked: Option<AckedPrefix>,
    /// 0x0100: idempotent producer id and sequence. Requires `acked`.
    pub idempotent: Option<IdempotentPrefix>,
    /// 0x0040: routing key shared by every record. An empty key is still a key.
    pub key: Option<Bytes>,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// The records; sent compressed when they hold a compressed form (D56).
    pub records: Records,
}

/// Reads the envelope section (D58) when the second word says there is one.
pub(crate) fn read_envelope(r: &mut Reader, hi: FlagsHi) -> Result<Option<Bytes>, PayloadError> {
    if !hi.contains(FlagsHi::ENVELOPE) {
        return Ok(None);
    }
    let len = r.u16("envelope_len")?;
    Ok(Some(r.bytes(usize::from(len), "envelope")?))
}

/// Writes the envelope section (D58), if the records carry one.
pub(crate) fn put_envelope(dst: &mut BytesMut, records: &Records) -> Result<(), EncodeError> {
    match records.envelope() {
        Some(e) => put_str16(dst, e, "envelope"),
        None => Ok(()),
    }
}

/// Reads the second flag word of a payload framed with `flags`, when it has one, and checks it
/// against the bits this payload kind may carry.
pub(crate) fn read_flags_hi(r: &mut Reader, flags: Flags, allowed: FlagsHi) -> Result<FlagsHi, PayloadError> {
    if !flags.contains(Flags::EXTENDED) {
        return Ok(FlagsHi::EMPTY);
    }
    let hi = FlagsHi(r.u16("flags_hi")?).validate().map_err(PayloadError::FlagsHi)?;
    let other = hi.0 & !allowed.0;
    if other != 0 {
        return Err(PayloadError::FlagsHi(crate::flags::FlagsHiError::Unknown { flags: hi.0, unknown: other }));
    }
    Ok(hi)
}

impl PublishBatch {
    /// The flags this batch is framed with.
    pub fn flags(&self) -> Flags {
        let mut f = Flags::BINARY_PUBLISH_BATCH;
        f = f.with(Flags::BINARY_PUBLISH_ACKED, self.acked.is_some());
        f = f.with(Flags::BINARY_PUBLISH_IDEMPOTENT, self.idempotent.is_some());
        f = f.with(Flags::EXTENDED, !self.flags_hi().is_empty());
        f.with(Flags::BINARY_PUBLISH_KEYED, self.key.is_some())
    }

    /// The second flag word this batch is framed with (empty: none is sent).
    pub fn flags_hi(&self) -> FlagsHi {
        let codec = self.records.codec().map_or(FlagsHi::EMPTY, Codec::flag);
        if self.records.envelope().is_some() { codec | FlagsHi::ENVELOPE } else { codec }
    }

    /// Decodes a payload framed with `flags` (already validated), taking a compressed block
    /// of up to [`crate::frame::DEFAULT_MAX_FRAME_LEN`] plain bytes.
    ///
    /// # Errors
    /// See [`PayloadError`].
    pub fn decode(flags: Flags, payload: Bytes) -> Result<PublishBatch, PayloadError> {
        PublishBatch::decode_limited(flags, payload, crate::frame::DEFAULT_MAX_FRAME_LEN as usize)
    }

    /// Decodes a payload framed with `flags`, refusing a compressed block that declares more
    /// than `limit` plain bytes before inflating it (a broker passes its frame limit: a batch
    /// may not grow past what it could have sent plain).
    ///
    /// # Errors
    /// See [`PayloadError`].
    pub fn decode_limited(flags: Flags, payload: Bytes, limit: usize) -> Result<PublishBatch, PayloadError> {
        PublishBatch::decode_with(flags, payload, limit, &mut Decompressor::new())
    }

    /// [`decode_limited`](Self::decode_limited) with the receiver's decompression contexts.
    ///
    /// # Errors
    /// See [`PayloadError`].
    pub fn decode_with(
        flags: Flags,
        payload: Bytes,
        limit: usize,
        dec: &mut Decompressor,
    ) -> Result<PublishBatch, PayloadError> {
        if !flags.contains(Flags::BINARY_PUBLISH_BATCH) {
            return Err(PayloadError::WrongKind(flags.bits()));
        }
        let mut r = Reader::new(payload);
        let hi = read_flags_hi(&mut r, flags, FlagsHi::CODECS | FlagsHi::ENVELOPE)?;
        let acked = if flags.contains(Flags::BINARY_PUBLISH_ACKED) {
            let request_id = r.u64("request_id")?;
            let ack_mode = AckMode::from_byte(r.u8("ack_mode")?)?;
            Some(AckedPrefix { request_id, ack_mode })
        } else {
            None
        };
        let idempotent = if flags.contains(Flags::BINARY_PUBLISH_IDEMPOTENT) {
            Some(IdempotentPrefix { producer_id: r.u64("producer_id")?, sequence: r.u64("sequence")? })
        } else {
            None
        };
        let key = if flags.contains(Flags::BINARY_PUBLISH_KEYED) {
            let len = r.u16("key_len")? as usize;
            Some(r.bytes(len, "key")?)
        } else {
            None
        };
        let tenant_id = r.str16("tenant_id")?;
        let namespace = r.str16("namespace")?;
        let stream = r.str16("stream")?;
        let envelope = read_envelope(&mut r, hi)?;
        let records = match Codec::of(hi) {
            Some(codec) => Records::decode_packed(&mut r, codec, false, limit, dec)?,
            None => Records::decode(&mut r, false)?,
        };
        let records = if envelope.is_some() { records.with_envelope(envelope) } else { records };
        r.finish()?;
        Ok(PublishBatch { acked, idempotent, key, tenant_id, namespace, stream, records })
    }

    /// Reads just the `request_id` of an acked frame, however broken the rest is. This is what
    /// lets a broker answer a malformed acked publish with an error its client can match.
    pub fn peek_request_id(flags: Flags, payload: &[u8]) -> Option<u64> {
        let at = if flags.contains(Flags::EXTENDED) { 2 } else { 0 };
        if flags.contains(Flags::BINARY_PUBLISH_ACKED) && payload.len() >= at + 8 {
            let mut id = [0u8; 8];
            id.copy_from_slice(&payload[at..at + 8]);
            Some(u64::from_be_bytes(id))
        } else {
            None
        }
    }

    /// Payload length when encoded.
    pub fn encoded_payload_len(&self) -> usize {
        let mut n = 6 + self.tenant_id.len() + self.namespace.len() + self.stream.len();
        n += self.records_encoded_len();
        if !self.flags_hi().is_empty() {
            n += 2;
        }
        if let Some(e) = self.records.envelope() {
            n += 2 + e.len();
        }
        if self.acked.is_some() {
            n += 9;
        }
        if self.idempotent.is_some() {
            n += 16;
        }
        if let Some(k) = &self.key {
            n += 2 + k.len();
        }
        n
    }

    /// Writes the whole frame (header and payload) into `dst`.
    ///
    /// # Errors
    /// A string too long for its prefix, an acked prefix with mode `None`, or an idempotent
    /// prefix without an acked one. Nothing is left in `dst` on error.
    pub fn encode(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        self.encode_with(dst, self.flags(), self.flags_hi(), self.records_encoded_len(), |dst| {
            match self.records.packed() {
                Some(p) => {
                    self.records.encode_packed_head(dst);
                    dst.extend_from_slice(&p.data);
                }
                None => self.records.encode(dst),
            }
            Ok(())
        })
    }

    fn records_encoded_len(&self) -> usize {
        self.records.packed_encoded_len().unwrap_or_else(|| self.records.encoded_len())
    }

    /// Writes the frame with `payloads` as its records, compressed by `compressor` when that
    /// makes the block smaller (plain otherwise; the `records` field is ignored): the bytes of
    /// [`encode`](Self::encode) with `Records::from_payloads(payloads).compressed(compressor)`.
    /// One copy of the payloads into a scratch block, one compression.
    ///
    /// # Errors
    /// As [`encode_payloads`](Self::encode_payloads).
    pub fn encode_payloads_compressed<P: AsRef<[u8]>>(
        &self,
        payloads: &[P],
        compressor: &mut Compressor,
        dst: &mut BytesMut,
    ) -> Result<(), EncodeError> {
        let records = Records::from_payloads(payloads)?.compressed(compressor);
        if records.packed().is_none() {
            return self.encode_payloads(payloads, dst);
        }
        PublishBatch { records, ..self.clone_head() }.encode(dst)
    }

    /// This batch's prefixes and names, with no records.
    fn clone_head(&self) -> PublishBatch {
        PublishBatch {
            acked: self.acked,
            idempotent: self.idempotent,
            key: self.key.clone(),
            tenant_id: self.tenant_id.clone(),
            namespace: self.namespace.clone(),
            stream: self.stream.clone(),
            records: Records::default(),
        }
    }

    /// Writes the frame with `payloads` as its records (the `records` field is ignored): the
    /// same bytes as [`encode`](Self::encode) with `Records::from_payloads(payloads)`, but each
    /// payload is copied once, straight into `dst`, which is reserved to the exact size first.
    /// This is the publisher's hot path.
    ///
    /// # Errors
    /// As [`encode`](Self::encode), and a payload or count over `u32::MAX`.
    pub fn encode_payloads<P: AsRef<[u8]>>(&self, payloads: &[P], dst: &mut BytesMut) -> Result<(), EncodeError> {
        let len = super::records::payloads_encoded_len(payloads);
        let flags = self.flags().difference(Flags::EXTENDED);
        self.encode_with(dst, flags, FlagsHi::EMPTY, len, |dst| super::records::encode_payloads(payloads, dst))
    }

    /// Writes the frame with `records` writing the record block (`records_len` bytes); nothing
    /// is left in `dst` on error.
    fn encode_with(
        &self,
        dst: &mut BytesMut,
        flags: Flags,
        hi: FlagsHi,
        records_len: usize,
        records: impl FnOnce(&mut BytesMut) -> Result<(), EncodeError>,
    ) -> Result<(), EncodeError> {
        if self.idempotent.is_some() && self.acked.is_none() {
            return Err(EncodeError::InvalidCombination("an idempotent publish must be acked"));
        }
        let start = dst.len();
        let write = || -> Result<(), EncodeError> {
            dst.reserve(14 + self.encoded_payload_len() - self.records_encoded_len() + records_len);
            let at = begin_frame(dst, flags);
            if !hi.is_empty() {
                dst.put_u16(hi.bits());
            }
            if let Some(a) = &self.acked {
                let mode = a.ack_mode.to_byte().ok_or(EncodeError::InvalidCombination(
                    "an acked prefix needs ack mode per_message or per_batch",
                ))?;
                dst.put_u64(a.request_id);
                dst.put_u8(mode);
            }
            if let Some(i) = &self.idempotent {
                dst.put_u64(i.producer_id);
                dst.put_u64(i.sequence);
            }
            if let Some(k) = &self.key {
                put_str16(dst, k, "key")?;
            }
            put_str16(dst, self.tenant_id.as_bytes(), "tenant_id")?;
            put_str16(dst, self.namespace.as_bytes(), "namespace")?;
            put_str16(dst, self.stream.as_bytes(), "stream")?;
            if !hi.is_empty() {
                put_envelope(dst, &self.records)?;
            }
            records(dst)?;
            patch_length(dst, at)
        };
        let res = write();
        if res.is_err() {
            dst.truncate(start);
        }
        res
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    #[test]
    fn upstream_acked_keyed_vector() {
        let frame = hex(
            "464c5831000100490000002d00000000000000070200026b3700027431000764656661756c74000464656d6f000000010000000568656c6c6f",
        );
        let b = PublishBatch::decode(Flags(0x49), Bytes::from(frame[12..].to_vec())).unwrap();
        assert_eq!(b.acked, Some(AckedPrefix { request_id: 7, ack_mode: AckMode::PerBatch }));
        assert_eq!(b.key.as_deref(), Some(&b"k7"[..]));
        assert_eq!((b.tenant_id.as_str(), b.namespace.as_str(), b.stream.as_str()), ("t1", "default", "demo"));
        assert_eq!(b.records.payloads().collect::<Vec<_>>(), vec![Bytes::from("hello")]);
        let mut out = BytesMut::new();
        b.encode(&mut out).unwrap();
        assert_eq!(&out[..], &frame[..]);
        assert_eq!(PublishBatch::peek_request_id(Flags(0x49), &frame[12..]), Some(7));
    }

    #[test]
    fn malformed_bodies() {
        assert_eq!(
            PublishBatch::decode(Flags(0x09), Bytes::from_static(&[0, 0, 0, 0, 0, 0, 0, 1, 3])),
            Err(PayloadError::InvalidAckMode(3))
        );
        assert_eq!(
            PublishBatch::decode(Flags(0x01), Bytes::from_static(&[0, 2, 0xff, 0xfe])),
            Err(PayloadError::InvalidUtf8 { field: "tenant_id" })
        );
        assert_eq!(
            PublishBatch::decode(Flags(0x01), Bytes::from_static(&[0, 9, b'a'])),
            Err(PayloadError::Incomplete { field: "tenant_id" })
        );
        assert_eq!(PublishBatch::decode(Flags(0x04), Bytes::new()), Err(PayloadError::WrongKind(4)));
    }

    #[test]
    fn encode_refuses_bad_combinations_and_leaves_nothing() {
        let mut b = PublishBatch {
            acked: None,
            idempotent: Some(IdempotentPrefix { producer_id: 1, sequence: 0 }),
            key: None,
            tenant_id: "t".into(),
            namespace: "n".into(),
            stream: "s".into(),
            records: Records::from_payloads(["x"]).unwrap(),
        };
        let mut out = BytesMut::from(&b"keep"[..]);
        assert!(b.encode(&mut out).is_err());
        assert_eq!(&out[..], b"keep");
        b.idempotent = None;
        b.tenant_id = "x".repeat(70_000);
        assert!(matches!(b.encode(&mut out), Err(EncodeError::TooLong { field: "tenant_id", .. })));
        assert_eq!(&out[..], b"keep");
    }

    proptest::proptest! {
        /// The publisher's one-copy path writes exactly the bytes of the general encoder.
        #[test]
        fn encode_payloads_matches_encode(
            payloads in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..40), 0..8),
            acked in proptest::option::of(proptest::num::u64::ANY),
            idempotent in proptest::option::of((proptest::num::u64::ANY, proptest::num::u64::ANY)),
            key in proptest::option::of(proptest::collection::vec(proptest::num::u8::ANY, 0..5)),
        ) {
            let b = PublishBatch {
                acked: acked.map(|request_id| AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
                idempotent: idempotent.map(|(producer_id, sequence)| IdempotentPrefix { producer_id, sequence }),
                key: key.map(Bytes::from),
                tenant_id: "t".into(),
                namespace: "ns".into(),
                stream: "s".into(),
                records: Records::from_payloads(&payloads).unwrap(),
            };
            let (mut general, mut direct) = (BytesMut::from(&b"x"[..]), BytesMut::from(&b"x"[..]));
            let r1 = b.encode(&mut general);
            let r2 = PublishBatch { records: Records::default(), ..b }.encode_payloads(&payloads, &mut direct);
            proptest::prop_assert_eq!(r1.is_ok(), r2.is_ok());
            proptest::prop_assert_eq!(general, direct);
        }
    }
}
