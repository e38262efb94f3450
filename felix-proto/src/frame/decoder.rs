//! Incremental frame decoder: bytes in, whole frames out.
//!
//! Design: QUIC hands a stream's bytes over in chunks whose boundaries mean nothing. The
//! decoder keeps the chunks it was given (as `Bytes`, without copying) and cuts frames out of
//! them. A frame that lies inside one chunk is returned as a slice of that chunk (zero-copy);
//! only a frame spread over several chunks is copied once into a buffer of exactly its size.
//!
//! The declared `length` is checked against the limit *before* anything is buffered for it, so a
//! peer cannot make us reserve 4 GiB with a 12-byte header.
//!
//! Errors come in two kinds:
//! * **fatal** ([`FrameError::is_fatal`]): bad magic, bad version, length over the limit. The
//!   byte stream can no longer be trusted; the decoder is poisoned and returns the same error
//!   forever (the connection is closed, as the spec says);
//! * **recoverable**: flag errors. The length is trustworthy, so the decoder skips exactly the
//!   payload and carries on; the error carries the skipped payload so that a broker can still
//!   read the `request_id` of an acked publish and answer it.

use super::chunks::Chunks;
use super::{FrameHeader, HEADER_LEN};
use crate::flags::{FlagError, Flags};
use crate::frame::Frame;
use bytes::Bytes;

/// The default maximum payload length: 16 MiB, as the spec suggests.
pub const DEFAULT_MAX_FRAME_LEN: u32 = 16 * 1024 * 1024;

/// Why the decoder could not produce a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// The first four bytes are not `FLX1`. Fatal.
    #[error("bad frame magic {0:#010x}")]
    BadMagic(u32),
    /// The version is not 1. Fatal.
    #[error("unsupported version {0}")]
    UnsupportedVersion(u16),
    /// The declared payload length exceeds the configured maximum. Fatal: nothing is buffered.
    #[error("frame length {len} exceeds the maximum {max}")]
    FrameTooLarge {
        /// Declared length.
        len: u32,
        /// Configured maximum.
        max: u32,
    },
    /// The stream ended in the middle of a frame.
    #[error("stream ended inside a frame: {have} of {need} bytes")]
    Truncated {
        /// Bytes of the frame that arrived (header included).
        have: usize,
        /// Bytes the frame needed (header included), or 12 when the header itself was cut.
        need: usize,
    },
    /// The flags are not acceptable. The payload was skipped; the stream may continue.
    #[error("{error}")]
    Flags {
        /// What is wrong with them.
        error: FlagError,
        /// The skipped payload (so an acked publish's `request_id` can still be read).
        payload: Bytes,
    },
}

impl FrameError {
    /// Whether the byte stream is no longer trustworthy (the decoder is poisoned).
    pub fn is_fatal(&self) -> bool {
        !matches!(self, FrameError::Flags { .. })
    }

    /// A short stable name for the error kind, used by conformance vectors.
    pub fn kind(&self) -> &'static str {
        match self {
            FrameError::BadMagic(_) => "bad_magic",
            FrameError::UnsupportedVersion(_) => "unsupported_version",
            FrameError::FrameTooLarge { .. } => "frame_too_large",
            FrameError::Truncated { .. } => "truncated",
            FrameError::Flags { error, .. } => match error {
                FlagError::Unknown { .. } => "unknown_flags",
                FlagError::ConflictingKinds { .. } => "conflicting_kinds",
                FlagError::MissingBase { .. } => "missing_base_flag",
                FlagError::NotNegotiated { .. } => "flag_not_negotiated",
            },
        }
    }
}

/// Cuts a byte stream into frames. Feed bytes with [`push`](Self::push), then call
/// [`next_frame`](Self::next_frame) until it returns `Ok(None)` ("need more bytes").
#[derive(Debug)]
pub struct FrameDecoder {
    chunks: Chunks,
    header: Option<FrameHeader>,
    max_frame_len: u32,
    accept: Flags,
    poisoned: Option<FrameError>,
}

impl Default for FrameDecoder {
    fn default() -> Self {
        Self::new()
    }
}

impl FrameDecoder {
    /// A decoder with the default 16 MiB limit that accepts every known flag bit but bit 15,
    /// the second word's marker (D56), which a peer must have negotiated
    /// ([`set_accepted_flags`](Self::set_accepted_flags)).
    pub fn new() -> FrameDecoder {
        FrameDecoder {
            chunks: Chunks::default(),
            header: None,
            max_frame_len: DEFAULT_MAX_FRAME_LEN,
            accept: Flags::KNOWN.difference(Flags::EXTENDED),
            poisoned: None,
        }
    }

    /// Sets the maximum payload length. Applies to the next header read (a broker lowers it
    /// before `auth` and raises it after).
    pub fn set_max_frame_len(&mut self, max: u32) {
        self.max_frame_len = max;
    }

    /// The current maximum payload length.
    pub fn max_frame_len(&self) -> u32 {
        self.max_frame_len
    }

    /// Sets the flag bits this side accepts on received frames: what it negotiated, restricted
    /// to what the peer's role may send. A valid frame using any other bit is refused with
    /// [`FlagError::NotNegotiated`].
    pub fn set_accepted_flags(&mut self, accept: Flags) {
        self.accept = accept;
    }

    /// The accepted flag bits.
    pub fn accepted_flags(&self) -> Flags {
        self.accept
    }

    /// Appends received bytes. Never copies them.
    pub fn push(&mut self, data: Bytes) {
        self.chunks.push(data);
    }

    /// Bytes received and not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.chunks.len()
    }

    /// Whether the decoder hit a fatal error.
    pub fn is_poisoned(&self) -> bool {
        self.poisoned.is_some()
    }

    /// The next whole frame, `Ok(None)` if more bytes are needed.
    ///
    /// # Errors
    /// See [`FrameError`]. After a fatal error every call returns it again.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, FrameError> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        let header = match self.header {
            Some(h) => h,
            None => {
                let mut raw = [0u8; HEADER_LEN];
                if !self.chunks.peek(&mut raw) {
                    return Ok(None);
                }
                self.chunks.skip(HEADER_LEN);
                let h = match FrameHeader::parse(&raw) {
                    Ok(h) => h,
                    Err(e) => return Err(self.poison(e)),
                };
                if h.length > self.max_frame_len {
                    return Err(self.poison(FrameError::FrameTooLarge { len: h.length, max: self.max_frame_len }));
                }
                self.header = Some(h);
                h
            }
        };
        let Some(payload) = self.chunks.take(header.length as usize) else { return Ok(None) };
        self.header = None;
        let checked = header.flags.validate().and_then(|f| {
            let extra = f.difference(self.accept);
            if extra.is_empty() { Ok(f) } else { Err(FlagError::NotNegotiated { flags: f.bits(), bits: extra.bits() }) }
        });
        match checked {
            Ok(flags) => Ok(Some(Frame { flags, payload })),
            Err(error) => Err(FrameError::Flags { error, payload }),
        }
    }

    /// Call when the peer finished the stream. `Ok(())` when it ended on a frame boundary.
    ///
    /// # Errors
    /// [`FrameError::Truncated`] when a partial frame is left, or the poisoning error.
    pub fn finish(&self) -> Result<(), FrameError> {
        if let Some(e) = &self.poisoned {
            return Err(e.clone());
        }
        match self.header {
            Some(h) => Err(FrameError::Truncated {
                have: HEADER_LEN + self.chunks.len(),
                need: HEADER_LEN + h.length as usize,
            }),
            None if self.chunks.len() > 0 => Err(FrameError::Truncated { have: self.chunks.len(), need: HEADER_LEN }),
            None => Ok(()),
        }
    }

    fn poison(&mut self, e: FrameError) -> FrameError {
        self.chunks.clear();
        self.poisoned = Some(e.clone());
        e
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(flags: u16, payload: &[u8]) -> Vec<u8> {
        let mut v = FrameHeader { flags: Flags(flags), length: payload.len() as u32 }.to_bytes().to_vec();
        v.extend_from_slice(payload);
        v
    }

    fn all(dec: &mut FrameDecoder) -> Vec<Result<Frame, FrameError>> {
        let mut out = Vec::new();
        loop {
            match dec.next_frame() {
                Ok(Some(f)) => out.push(Ok(f)),
                Ok(None) => return out,
                Err(e) => {
                    let fatal = e.is_fatal();
                    out.push(Err(e));
                    if fatal {
                        return out;
                    }
                }
            }
        }
    }

    #[test]
    fn whole_byte_by_byte_and_trailing() {
        let mut stream = frame(0, b"{\"type\":\"ok\"}");
        stream.extend(frame(1, b"abc"));
        stream.extend(frame(0, b""));
        // whole
        let mut d = FrameDecoder::new();
        d.push(Bytes::from(stream.clone()));
        let whole = all(&mut d);
        assert_eq!(whole.len(), 3);
        assert_eq!(d.finish(), Ok(()));
        // byte by byte
        let mut d = FrameDecoder::new();
        let mut got = Vec::new();
        for b in &stream {
            d.push(Bytes::copy_from_slice(&[*b]));
            got.extend(all(&mut d));
        }
        assert_eq!(got, whole);
        // trailing partial frame
        let mut d = FrameDecoder::new();
        d.push(Bytes::from(stream[..stream.len() - 3].to_vec()));
        assert_eq!(all(&mut d).len(), 2);
        assert_eq!(d.finish(), Err(FrameError::Truncated { have: 9, need: 12 }));
    }

    #[test]
    fn frame_inside_one_chunk_is_not_copied() {
        let data = Bytes::from(frame(1, b"payload"));
        let mut d = FrameDecoder::new();
        d.push(data.clone());
        let f = d.next_frame().unwrap().unwrap();
        assert_eq!(f.payload.as_ptr(), data[12..].as_ptr());
    }

    #[test]
    fn oversize_is_refused_on_the_header_and_poisons() {
        let mut d = FrameDecoder::new();
        d.set_max_frame_len(4);
        d.push(Bytes::from(FrameHeader { flags: Flags(0), length: 5 }.to_bytes().to_vec()));
        let e = FrameError::FrameTooLarge { len: 5, max: 4 };
        assert_eq!(d.next_frame(), Err(e.clone()));
        d.push(Bytes::from(frame(0, b"")));
        assert_eq!(d.next_frame(), Err(e));
        assert!(d.is_poisoned());
    }

    #[test]
    fn bad_magic_and_version_poison() {
        let mut bad = frame(0, b"");
        bad[3] = b'2';
        let mut d = FrameDecoder::new();
        d.push(Bytes::from(bad));
        assert!(matches!(d.next_frame(), Err(FrameError::BadMagic(0x464C_5832))));
        let mut bad = frame(0, b"");
        bad[5] = 0;
        let mut d = FrameDecoder::new();
        d.push(Bytes::from(bad));
        assert_eq!(d.next_frame(), Err(FrameError::UnsupportedVersion(0)));
        assert!(d.is_poisoned());
    }

    #[test]
    fn flag_errors_skip_the_payload_and_continue() {
        let mut stream = frame(0x8001, b"xx"); // bit 15 (D56) not negotiated here
        stream.extend(frame(0x0008, b"yy"));
        stream.extend(frame(0x0010, b"zz"));
        stream.extend(frame(0, b"ok"));
        let mut d = FrameDecoder::new();
        d.set_accepted_flags(Flags::CLIENT_SENDS.difference(Flags::EXTENDED));
        d.push(Bytes::from(stream));
        let got = all(&mut d);
        assert_eq!(got.len(), 4);
        assert_eq!(got[0].as_ref().unwrap_err().kind(), "flag_not_negotiated");
        assert_eq!(got[1].as_ref().unwrap_err().kind(), "missing_base_flag");
        assert_eq!(got[2].as_ref().unwrap_err().kind(), "flag_not_negotiated");
        match &got[2] {
            Err(FrameError::Flags { payload, .. }) => assert_eq!(&payload[..], b"zz"),
            other => panic!("{other:?}"),
        }
        assert_eq!(got[3].as_ref().unwrap().payload, Bytes::from_static(b"ok"));
    }

    #[test]
    fn truncated_header() {
        let mut d = FrameDecoder::new();
        d.push(Bytes::from_static(b"FLX"));
        assert_eq!(d.next_frame(), Ok(None));
        assert_eq!(d.finish(), Err(FrameError::Truncated { have: 3, need: 12 }));
    }
}
