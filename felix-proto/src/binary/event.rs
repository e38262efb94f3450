//! Binary event batches (broker → client, on event streams).
//!
//! ```text
//! u64 subscription_id                      legacy 0x0002 form only
//! u64 base_offset                          if 0x0020
//! u64 skipped_before                       if 0x0800 (only with 0x0020)
//! u8 publisher_len, publisher              if 0x2000
//! u32 count
//! count × ( u64 timestamp_micros if 0x4000, u32 payload_len, payload )
//! ```
//! With [`Flags::EXTENDED`] (D56, shared form only) the payload opens with `u16 flags_hi`; a
//! codec bit in it makes the block `u32 count, u64 timestamp_micros if 0x4000 (one append time
//! for every record of the batch), u32 raw_len, compressed bytes`: the publisher's compressed
//! block, sent as it was stored.
//!
//! The broker emits only the shared 0x0004 form: `event_stream_hello` already bound the stream to
//! its subscription, so one encoded buffer serves every subscriber of the same shape.

use super::compression::{Codec, Decompressor};
use super::publish::{put_envelope, read_envelope, read_flags_hi};
use super::{EncodeError, PayloadError, Reader, Records};
use crate::flags::{Flags, FlagsHi};
use crate::frame::{HEADER_LEN, begin_frame, patch_length};
use bytes::{BufMut, Bytes, BytesMut};

/// A binary event batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventBatch {
    /// `Some` for the legacy per-subscriber 0x0002 form; `None` for the shared 0x0004 form.
    pub subscription_id: Option<u64>,
    /// 0x0020: offset of the first event; event `i` is at `base_offset + i`.
    pub base_offset: Option<u64>,
    /// 0x0800: offsets just below `base_offset` that hold no event. Requires `base_offset`.
    pub skipped_before: Option<u64>,
    /// 0x2000: principal that published these events (at most 255 bytes).
    pub publisher: Option<Bytes>,
    /// The events; timed (0x4000) when they carry append times; sent compressed when they
    /// hold a compressed form (D56; the shared form only).
    pub records: Records,
}

impl EventBatch {
    /// A shared batch of `records` with nothing optional.
    pub fn shared(records: Records) -> EventBatch {
        EventBatch { subscription_id: None, base_offset: None, skipped_before: None, publisher: None, records }
    }

    /// The flags this batch is framed with.
    pub fn flags(&self) -> Flags {
        let kind =
            if self.subscription_id.is_some() { Flags::BINARY_EVENT_BATCH } else { Flags::BINARY_EVENT_BATCH_SHARED };
        kind.with(Flags::EVENT_BATCH_OFFSETS, self.base_offset.is_some())
            .with(Flags::EVENT_BATCH_SKIPPED, self.skipped_before.is_some())
            .with(Flags::EVENT_BATCH_PUBLISHER, self.publisher.is_some())
            .with(Flags::EVENT_BATCH_TIMESTAMPS, self.records.is_timed())
            .with(Flags::EXTENDED, !self.flags_hi().is_empty())
    }

    /// The second flag word this batch is framed with (empty: none is sent). The legacy
    /// per-subscriber form never carries one.
    pub fn flags_hi(&self) -> FlagsHi {
        match self.subscription_id {
            Some(_) => FlagsHi::EMPTY,
            None => {
                let codec = self.records.codec().map_or(FlagsHi::EMPTY, Codec::flag);
                if self.records.envelope().is_some() { codec | FlagsHi::ENVELOPE } else { codec }
            }
        }
    }

    /// This batch with every section the client did not offer left out: what a client that
    /// offered `offered` may receive. Timestamps are stripped by copying the block; everything
    /// else is free.
    /// A compressed form is kept only for a client that offered its codec (`offered_hi`).
    pub fn restricted_to(&self, offered: Flags, offered_hi: FlagsHi) -> EventBatch {
        let offsets = offered.contains(Flags::EVENT_BATCH_OFFSETS);
        let packed =
            offered.contains(Flags::EXTENDED) && self.records.codec().is_some_and(|c| offered_hi.contains(c.flag()));
        let records = if packed { self.records.clone() } else { self.records.plain() };
        let envelope = offered.contains(Flags::EXTENDED) && offered_hi.contains(FlagsHi::ENVELOPE);
        let records = if envelope { records } else { records.with_envelope(None) };
        EventBatch {
            subscription_id: self.subscription_id,
            base_offset: self.base_offset.filter(|_| offsets),
            skipped_before: self.skipped_before.filter(|_| offsets && offered.contains(Flags::EVENT_BATCH_SKIPPED)),
            publisher: self.publisher.clone().filter(|_| offered.contains(Flags::EVENT_BATCH_PUBLISHER)),
            records: if offered.contains(Flags::EVENT_BATCH_TIMESTAMPS) {
                records
            } else {
                records.without_timestamps()
            },
        }
    }

    /// Decodes a payload framed with `flags` (already validated).
    ///
    /// # Errors
    /// See [`PayloadError`].
    pub fn decode(flags: Flags, payload: Bytes) -> Result<EventBatch, PayloadError> {
        EventBatch::decode_limited(flags, payload, crate::frame::DEFAULT_MAX_FRAME_LEN as usize)
    }

    /// Decodes a payload framed with `flags`, refusing a compressed block that declares more
    /// than `limit` plain bytes before inflating it.
    ///
    /// # Errors
    /// See [`PayloadError`].
    pub fn decode_limited(flags: Flags, payload: Bytes, limit: usize) -> Result<EventBatch, PayloadError> {
        EventBatch::decode_with(flags, payload, limit, &mut Decompressor::new())
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
    ) -> Result<EventBatch, PayloadError> {
        let legacy = flags.contains(Flags::BINARY_EVENT_BATCH);
        if !legacy && !flags.contains(Flags::BINARY_EVENT_BATCH_SHARED) {
            return Err(PayloadError::WrongKind(flags.bits()));
        }
        let mut r = Reader::new(payload);
        let hi = read_flags_hi(&mut r, flags, FlagsHi::CODECS | FlagsHi::ENVELOPE)?;
        let subscription_id = if legacy { Some(r.u64("subscription_id")?) } else { None };
        let base_offset = if flags.contains(Flags::EVENT_BATCH_OFFSETS) { Some(r.u64("base_offset")?) } else { None };
        let skipped_before =
            if flags.contains(Flags::EVENT_BATCH_SKIPPED) { Some(r.u64("skipped_before")?) } else { None };
        let publisher = if flags.contains(Flags::EVENT_BATCH_PUBLISHER) {
            let len = r.u8("publisher_len")? as usize;
            Some(r.bytes(len, "publisher")?)
        } else {
            None
        };
        let timed = flags.contains(Flags::EVENT_BATCH_TIMESTAMPS);
        let envelope = read_envelope(&mut r, hi)?;
        let records = match Codec::of(hi) {
            Some(codec) => Records::decode_packed(&mut r, codec, timed, limit, dec)?,
            None => Records::decode(&mut r, timed)?,
        };
        let records = if envelope.is_some() { records.with_envelope(envelope) } else { records };
        r.finish()?;
        Ok(EventBatch { subscription_id, base_offset, skipped_before, publisher, records })
    }

    fn check(&self) -> Result<(), EncodeError> {
        if self.skipped_before.is_some() && self.base_offset.is_none() {
            return Err(EncodeError::InvalidCombination("skipped_before needs base_offset"));
        }
        if let Some(p) = &self.publisher
            && p.len() > u8::MAX as usize
        {
            return Err(EncodeError::TooLong { field: "publisher", len: p.len(), max: 255 });
        }
        if let Some(e) = self.records.envelope()
            && e.len() > u16::MAX as usize
        {
            return Err(EncodeError::TooLong { field: "envelope", len: e.len(), max: u16::MAX as usize });
        }
        Ok(())
    }

    /// Whether the block goes compressed (the shared form, with a compressed form).
    fn uses_packed(&self) -> bool {
        self.subscription_id.is_none() && self.records.packed().is_some()
    }

    /// The block after the head: the compressed bytes, or the plain block.
    fn body(&self) -> &Bytes {
        match (self.uses_packed(), self.records.packed()) {
            (true, Some(p)) => &p.data,
            _ => self.records.raw(),
        }
    }

    fn head_len(&self) -> usize {
        let mut n = HEADER_LEN + 4;
        if !self.flags_hi().is_empty() {
            // flags_hi, raw_len, and the one time of a timed block.
            n += 2;
            if self.uses_packed() {
                n += 4 + 8 * usize::from(self.records.is_timed());
            }
            if let Some(e) = self.records.envelope() {
                n += 2 + e.len();
            }
        }
        n += 8 * usize::from(self.subscription_id.is_some());
        n += 8 * usize::from(self.base_offset.is_some());
        n += 8 * usize::from(self.skipped_before.is_some());
        n + self.publisher.as_ref().map_or(0, |p| 1 + p.len())
    }

    fn put_head(&self, dst: &mut BytesMut, length: u32) {
        let at = begin_frame(dst, self.flags());
        dst[at..at + 4].copy_from_slice(&length.to_be_bytes());
        let hi = self.flags_hi();
        if !hi.is_empty() {
            dst.put_u16(hi.bits());
        }
        if let Some(id) = self.subscription_id {
            dst.put_u64(id);
        }
        if let Some(o) = self.base_offset {
            dst.put_u64(o);
        }
        if let Some(s) = self.skipped_before {
            dst.put_u64(s);
        }
        if let Some(p) = &self.publisher {
            dst.put_u8(p.len() as u8);
            dst.extend_from_slice(p);
        }
        if !hi.is_empty() {
            // `check` made sure an envelope fits its u16 length.
            let _ = put_envelope(dst, &self.records);
        }
        if !self.uses_packed() || self.records.encode_packed_head(dst).is_none() {
            dst.put_u32(self.records.count());
        }
    }

    /// Writes the whole frame into `dst` (one copy of the records).
    ///
    /// # Errors
    /// `skipped_before` without `base_offset`, a publisher over 255 bytes, or a frame over 4 GiB.
    pub fn encode(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        let [head, body] = self.encode_parts()?;
        dst.reserve(head.len() + body.len());
        dst.extend_from_slice(&head);
        dst.extend_from_slice(&body);
        Ok(())
    }

    /// The frame as two buffers, header-and-prefix then the record block, without copying any
    /// payload: the block is shared with the batch's records (for a publish fanned out as it
    /// came, with the very bytes the publisher sent). Write both, in order.
    ///
    /// # Errors
    /// As [`encode`](Self::encode).
    pub fn encode_parts(&self) -> Result<[Bytes; 2], EncodeError> {
        self.check()?;
        let payload_len = self.head_len() - HEADER_LEN + self.body().len();
        let length = u32::try_from(payload_len).map_err(|_| EncodeError::TooLong {
            field: "frame payload",
            len: payload_len,
            max: u32::MAX as usize,
        })?;
        let mut head = BytesMut::with_capacity(self.head_len());
        self.put_head(&mut head, length);
        Ok([head.freeze(), self.body().clone()])
    }

    /// Writes the frame into `dst` with a single check of the payload length (used by encoders
    /// that batch many frames into one buffer).
    ///
    /// # Errors
    /// As [`encode`](Self::encode).
    pub fn encode_into(&self, dst: &mut BytesMut) -> Result<(), EncodeError> {
        self.check()?;
        let start = dst.len();
        dst.reserve(self.head_len() + self.body().len());
        self.put_head(dst, 0);
        dst.extend_from_slice(self.body());
        patch_length(dst, start + 8)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_unit_test_bytes() {
        // Legacy batch: subscription 3, base offset 5, publisher "p", one event "hi".
        let want: &[u8] = &[
            0x46, 0x4c, 0x58, 0x31, 0, 1, 0x20, 0x22, 0, 0, 0, 0x1c, 0, 0, 0, 0, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0, 5, 1,
            0x70, 0, 0, 0, 1, 0, 0, 0, 2, 0x68, 0x69,
        ];
        let b = EventBatch {
            subscription_id: Some(3),
            base_offset: Some(5),
            skipped_before: None,
            publisher: Some(Bytes::from_static(b"p")),
            records: Records::from_payloads(["hi"]).unwrap(),
        };
        let mut out = BytesMut::new();
        b.encode(&mut out).unwrap();
        assert_eq!(&out[..], want);
        let mut out2 = BytesMut::new();
        b.encode_into(&mut out2).unwrap();
        assert_eq!(out, out2);
        assert_eq!(EventBatch::decode(Flags(0x2022), Bytes::copy_from_slice(&want[12..])).unwrap(), b);
    }

    #[test]
    fn restricted_to_an_old_client_is_the_plain_shared_form() {
        let full = EventBatch {
            subscription_id: None,
            base_offset: Some(10),
            skipped_before: Some(1),
            publisher: Some(Bytes::from_static(b"alice")),
            records: Records::from_timed([(7u64, "a"), (7, "b")]).unwrap(),
        };
        assert_eq!(full.flags(), Flags(0x6824));
        let old = full.restricted_to(Flags::ORIGINAL_V1, FlagsHi::EMPTY);
        assert_eq!(old.flags(), Flags(0x0004));
        assert_eq!(old, EventBatch::shared(Records::from_payloads(["a", "b"]).unwrap()));
        let offsets_only = full.restricted_to(Flags::ORIGINAL_V1 | Flags::EVENT_BATCH_OFFSETS, FlagsHi::EMPTY);
        assert_eq!(offsets_only.flags(), Flags(0x0024));
    }

    #[test]
    fn parts_share_the_record_block() {
        let records = Records::from_payloads(["x", "yy"]).unwrap();
        let b = EventBatch::shared(records.clone());
        let [_, body] = b.encode_parts().unwrap();
        assert_eq!(body.as_ptr(), records.raw().as_ptr());
    }

    #[test]
    fn invalid_combinations_refused() {
        let mut b = EventBatch::shared(Records::default());
        b.skipped_before = Some(1);
        assert!(b.encode(&mut BytesMut::new()).is_err());
        b.skipped_before = None;
        b.publisher = Some(Bytes::from(vec![b'a'; 256]));
        assert!(b.encode(&mut BytesMut::new()).is_err());
    }
}
