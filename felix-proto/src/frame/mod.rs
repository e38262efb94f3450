//! The 12-byte frame header and whole frames.
//!
//! ```text
//! offset size field    value
//! 0      4    magic    0x464C5831 ("FLX1")
//! 4      2    version  1
//! 6      2    flags    payload layout selector (see [`Flags`])
//! 8      4    length   payload bytes that follow
//! ```

pub(crate) mod chunks;
mod decoder;

pub use decoder::{DEFAULT_MAX_FRAME_LEN, FrameDecoder, FrameError};

use crate::flags::Flags;
use bytes::{BufMut, Bytes, BytesMut};

/// `"FLX1"`.
pub const MAGIC: u32 = 0x464C_5831;
/// The protocol version. It stays 1: capabilities are negotiated, never versioned.
pub const VERSION: u16 = 1;
/// Size of the frame header in bytes.
pub const HEADER_LEN: usize = 12;

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FrameHeader {
    /// The flags field, not yet validated.
    pub flags: Flags,
    /// Payload length in bytes.
    pub length: u32,
}

impl FrameHeader {
    /// Writes the 12 header bytes.
    pub fn encode(&self, dst: &mut BytesMut) {
        dst.reserve(HEADER_LEN);
        dst.put_u32(MAGIC);
        dst.put_u16(VERSION);
        dst.put_u16(self.flags.bits());
        dst.put_u32(self.length);
    }

    /// The 12 header bytes as an array (no allocation).
    pub fn to_bytes(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[0..4].copy_from_slice(&MAGIC.to_be_bytes());
        out[4..6].copy_from_slice(&VERSION.to_be_bytes());
        out[6..8].copy_from_slice(&self.flags.bits().to_be_bytes());
        out[8..12].copy_from_slice(&self.length.to_be_bytes());
        out
    }

    /// Parses the raw header fields, checking only magic and version (the two errors after
    /// which the byte stream cannot be trusted). Flags are validated by the caller.
    ///
    /// # Errors
    /// [`FrameError::BadMagic`] or [`FrameError::UnsupportedVersion`].
    pub fn parse(raw: &[u8; HEADER_LEN]) -> Result<FrameHeader, FrameError> {
        let magic = u32::from_be_bytes([raw[0], raw[1], raw[2], raw[3]]);
        if magic != MAGIC {
            return Err(FrameError::BadMagic(magic));
        }
        let version = u16::from_be_bytes([raw[4], raw[5]]);
        if version != VERSION {
            return Err(FrameError::UnsupportedVersion(version));
        }
        Ok(FrameHeader {
            flags: Flags(u16::from_be_bytes([raw[6], raw[7]])),
            length: u32::from_be_bytes([raw[8], raw[9], raw[10], raw[11]]),
        })
    }
}

/// One whole frame: validated flags and its payload, a zero-copy slice of what was received.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// The frame's flags (already validated by the decoder).
    pub flags: Flags,
    /// The payload bytes.
    pub payload: Bytes,
}

impl Frame {
    /// Builds a frame.
    pub fn new(flags: Flags, payload: Bytes) -> Frame {
        Frame { flags, payload }
    }

    /// Header plus payload in one buffer.
    ///
    /// # Panics
    /// If the payload is longer than `u32::MAX` bytes (a caller contract: encoders check limits).
    pub fn to_bytes(&self) -> Bytes {
        let mut out = BytesMut::with_capacity(HEADER_LEN + self.payload.len());
        self.encode(&mut out);
        out.freeze()
    }

    /// Writes header plus payload into `dst`.
    ///
    /// # Panics
    /// If the payload is longer than `u32::MAX` bytes.
    pub fn encode(&self, dst: &mut BytesMut) {
        let length = u32::try_from(self.payload.len()).expect("payload length checked by encoders");
        FrameHeader { flags: self.flags, length }.encode(dst);
        dst.extend_from_slice(&self.payload);
    }
}

/// Writes a frame header for a payload that the caller writes next, returning the position of
/// the length field so it can be patched with [`patch_length`] once the payload is written.
/// This is how every encoder writes header and payload into one buffer without a second pass.
pub(crate) fn begin_frame(dst: &mut BytesMut, flags: Flags) -> usize {
    dst.put_u32(MAGIC);
    dst.put_u16(VERSION);
    dst.put_u16(flags.bits());
    let at = dst.len();
    dst.put_u32(0);
    at
}

/// Patches the length written by [`begin_frame`].
pub(crate) fn patch_length(dst: &mut BytesMut, at: usize) -> Result<(), crate::binary::EncodeError> {
    let len = dst.len() - at - 4;
    let len = u32::try_from(len).map_err(|_| crate::binary::EncodeError::TooLong {
        field: "frame payload",
        len,
        max: u32::MAX as usize,
    })?;
    dst[at..at + 4].copy_from_slice(&len.to_be_bytes());
    Ok(())
}

/// Patches the flags written by [`begin_frame`] (for encoders that learn a bit while writing).
pub(crate) fn patch_flags(dst: &mut BytesMut, length_at: usize, flags: Flags) {
    dst[length_at - 2..length_at].copy_from_slice(&flags.bits().to_be_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = FrameHeader { flags: Flags(0x0049), length: 45 };
        let raw = h.to_bytes();
        assert_eq!(raw, [0x46, 0x4c, 0x58, 0x31, 0, 1, 0, 0x49, 0, 0, 0, 45]);
        assert_eq!(FrameHeader::parse(&raw), Ok(h));
        let mut b = BytesMut::new();
        h.encode(&mut b);
        assert_eq!(&b[..], &raw[..]);
    }

    #[test]
    fn header_errors() {
        let mut raw = FrameHeader { flags: Flags(0), length: 0 }.to_bytes();
        raw[0] = b'G';
        assert_eq!(FrameHeader::parse(&raw), Err(FrameError::BadMagic(0x474C_5831)));
        let mut raw = FrameHeader { flags: Flags(0), length: 0 }.to_bytes();
        raw[5] = 2;
        assert_eq!(FrameHeader::parse(&raw), Err(FrameError::UnsupportedVersion(2)));
    }
}
