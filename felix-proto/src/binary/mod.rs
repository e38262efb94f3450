//! Binary payload layouts: publish batches, publish acks, event batches.
//!
//! Every layout is big-endian with no padding. Decoders take the frame's validated flags and
//! its payload `Bytes` and return typed values whose byte fields are slices of that payload
//! (zero-copy). Every length is checked against the bytes actually left before it is used, and
//! a declared record `count` is bounded by the remaining bytes before anything is allocated.

mod ack;
pub mod compression;
mod event;
mod publish;
mod records;

pub use ack::{AckStatus, ErrorDetail, OwnerHint, PublishAck};
pub use compression::{Codec, CompressError, Compressor, Decompressor, Packed};
pub use event::EventBatch;
pub use publish::{AckMode, AckedPrefix, IdempotentPrefix, PublishBatch};
pub use records::{Record, Records, RecordsIter, SlicesIter};

use bytes::Bytes;

/// Why a binary payload could not be decoded. The frame itself was whole.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PayloadError {
    /// The payload ended inside a field.
    #[error("payload truncated in {field}")]
    Incomplete {
        /// The field being read.
        field: &'static str,
    },
    /// A string field is not UTF-8.
    #[error("{field} is not valid UTF-8")]
    InvalidUtf8 {
        /// The field.
        field: &'static str,
    },
    /// The acked prefix's mode byte is not 1 or 2.
    #[error("invalid ack mode {0}")]
    InvalidAckMode(u8),
    /// The ack status byte is not 0 or 1.
    #[error("invalid ack status {0}")]
    InvalidAckStatus(u8),
    /// A stored commit's state change has an op other than 0 (put) or 1 (delete).
    #[error("invalid state op {0}")]
    InvalidStateOp(u8),
    /// `count` records cannot fit in the bytes left.
    #[error("record count {count} cannot fit in {remaining} bytes")]
    CountTooLarge {
        /// Declared count.
        count: u32,
        /// Bytes left after the count.
        remaining: usize,
    },
    /// Bytes were left after the last field.
    #[error("{0} trailing bytes after the payload")]
    TrailingBytes(usize),
    /// The flags do not select this layout.
    #[error("flags {0:#06x} do not select this payload layout")]
    WrongKind(u16),
    /// An ack section that only goes with the other status (code/detail on success, offset on
    /// failure).
    #[error("flags {flags:#06x} carry a section that an ack with status {status} cannot have")]
    SectionForOtherStatus {
        /// The frame's flags.
        flags: u16,
        /// The status byte.
        status: u8,
    },
    /// The second flag word (D56) breaks a rule: empty, an unknown bit, two codecs, or a bit
    /// this payload kind cannot carry.
    #[error("{0}")]
    FlagsHi(crate::flags::FlagsHiError),
    /// A compressed block (D56) declares too much or does not inflate to what it declares.
    #[error("{0}")]
    Compression(compression::CompressError),
    /// A stored batch names a codec this version does not know.
    #[error("unknown codec {0}")]
    UnknownCodec(u8),
    /// A compressed block (D56) with no record: never sent, so never accepted (a frame
    /// decodes to one value only).
    #[error("a compressed block holds no record")]
    EmptyCompressedBlock,
}

impl PayloadError {
    /// A short stable name for the error kind, used by conformance vectors.
    pub fn kind(&self) -> &'static str {
        match self {
            PayloadError::Incomplete { .. } => "incomplete",
            PayloadError::InvalidUtf8 { .. } => "invalid_utf8",
            PayloadError::InvalidAckMode(_) => "invalid_ack_mode",
            PayloadError::InvalidAckStatus(_) => "invalid_ack_status",
            PayloadError::InvalidStateOp(_) => "invalid_state_op",
            PayloadError::CountTooLarge { .. } => "count_too_large",
            PayloadError::TrailingBytes(_) => "trailing_bytes",
            PayloadError::WrongKind(_) => "wrong_kind",
            PayloadError::SectionForOtherStatus { .. } => "section_for_other_status",
            PayloadError::FlagsHi(crate::flags::FlagsHiError::Empty) => "empty_flags_hi",
            PayloadError::FlagsHi(crate::flags::FlagsHiError::Unknown { .. }) => "unknown_flags_hi",
            PayloadError::FlagsHi(crate::flags::FlagsHiError::TwoCodecs { .. }) => "two_codecs",
            PayloadError::Compression(compression::CompressError::TooLarge { .. }) => "decompressed_too_large",
            PayloadError::Compression(_) => "corrupt_compressed_block",
            PayloadError::EmptyCompressedBlock => "empty_compressed_block",
            PayloadError::UnknownCodec(_) => "unknown_codec",
        }
    }
}

/// Why a value could not be encoded. Encoders refuse rather than truncate (the one exception,
/// as upstream, is an over-long ack error message, which is cut so the ack can be sent).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EncodeError {
    /// A field is longer than its length prefix can say.
    #[error("{field} is {len} bytes; at most {max} fit")]
    TooLong {
        /// The field.
        field: &'static str,
        /// Its length.
        len: usize,
        /// The most its prefix allows.
        max: usize,
    },
    /// The value combines sections the layout does not allow together.
    #[error("invalid combination: {0}")]
    InvalidCombination(&'static str),
    /// JSON serialisation failed (a message whose value cannot be written as JSON).
    #[error("JSON serialisation failed: {0}")]
    Json(String),
}

/// A bounds-checked big-endian reader over a payload. Slices it hands out share the payload's
/// memory.
pub(crate) struct Reader {
    buf: Bytes,
    pos: usize,
}

impl Reader {
    pub(crate) fn new(buf: Bytes) -> Reader {
        Reader { buf, pos: 0 }
    }

    pub(crate) fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], PayloadError> {
        let end = self.pos.checked_add(N).filter(|&e| e <= self.buf.len());
        let end = end.ok_or(PayloadError::Incomplete { field })?;
        let mut out = [0u8; N];
        out.copy_from_slice(&self.buf[self.pos..end]);
        self.pos = end;
        Ok(out)
    }

    pub(crate) fn u8(&mut self, field: &'static str) -> Result<u8, PayloadError> {
        Ok(self.array::<1>(field)?[0])
    }
    pub(crate) fn u16(&mut self, field: &'static str) -> Result<u16, PayloadError> {
        Ok(u16::from_be_bytes(self.array(field)?))
    }
    pub(crate) fn u32(&mut self, field: &'static str) -> Result<u32, PayloadError> {
        Ok(u32::from_be_bytes(self.array(field)?))
    }
    pub(crate) fn u64(&mut self, field: &'static str) -> Result<u64, PayloadError> {
        Ok(u64::from_be_bytes(self.array(field)?))
    }

    pub(crate) fn bytes(&mut self, len: usize, field: &'static str) -> Result<Bytes, PayloadError> {
        if len > self.remaining() {
            return Err(PayloadError::Incomplete { field });
        }
        let out = self.buf.slice(self.pos..self.pos + len);
        self.pos += len;
        Ok(out)
    }

    pub(crate) fn string(&mut self, len: usize, field: &'static str) -> Result<String, PayloadError> {
        if len > self.remaining() {
            return Err(PayloadError::Incomplete { field });
        }
        let s = std::str::from_utf8(&self.buf[self.pos..self.pos + len])
            .map_err(|_| PayloadError::InvalidUtf8 { field })?
            .to_owned();
        self.pos += len;
        Ok(s)
    }

    pub(crate) fn str16(&mut self, field: &'static str) -> Result<String, PayloadError> {
        let len = self.u16(field)? as usize;
        self.string(len, field)
    }

    pub(crate) fn rest(&mut self) -> Bytes {
        let out = self.buf.slice(self.pos..);
        self.pos = self.buf.len();
        out
    }

    pub(crate) fn finish(&self) -> Result<(), PayloadError> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(PayloadError::TrailingBytes(n)),
        }
    }
}

pub(crate) fn put_str16(dst: &mut bytes::BytesMut, s: &[u8], field: &'static str) -> Result<(), EncodeError> {
    use bytes::BufMut;
    let len =
        u16::try_from(s.len()).map_err(|_| EncodeError::TooLong { field, len: s.len(), max: u16::MAX as usize })?;
    dst.put_u16(len);
    dst.extend_from_slice(s);
    Ok(())
}
