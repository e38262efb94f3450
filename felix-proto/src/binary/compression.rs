//! Batch compression (D56): a publish batch's record block compressed once by its publisher,
//! stored as it came and sent as stored to every subscriber that took the codec.
//!
//! On the wire, a compressed block replaces `count × (u32 payload_len, payload)` with
//!
//! ```text
//! u32 raw_len           bytes of the plain block (what the records would take uncompressed)
//! compressed bytes      to the end of the payload: one zstd frame, or one lz4 block
//! ```
//!
//! `count` stays plain before it, so a broker assigns offsets without looking inside. The codec
//! is named by the frame's second flag word ([`FlagsHi`]). Decompression is bounded before it
//! starts: a block declaring more than the receiver's frame limit is refused without allocating
//! (a zip bomb costs its sender, not us), and a block that inflates to anything but exactly
//! `raw_len` bytes is refused. Pure computation over byte slices: no IO, no clock, no threads.

use crate::flags::FlagsHi;
use bytes::Bytes;

/// A compression codec a batch may carry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Codec {
    /// Zstandard (RFC 8878), one frame per block.
    Zstd,
    /// LZ4, one raw block (the `lz4_flex` block format, no frame header: `raw_len` is ours).
    Lz4,
}

impl Codec {
    /// Both codecs, in flag order.
    pub const ALL: [Codec; 2] = [Codec::Zstd, Codec::Lz4];

    /// The second-word flag bit that names this codec on a frame and offers it in `auth`.
    pub const fn flag(self) -> FlagsHi {
        match self {
            Codec::Zstd => FlagsHi::COMPRESSED_ZSTD,
            Codec::Lz4 => FlagsHi::COMPRESSED_LZ4,
        }
    }

    /// The codec a (validated) second flag word names, if any.
    pub fn of(flags: FlagsHi) -> Option<Codec> {
        Codec::ALL.into_iter().find(|c| flags.contains(c.flag()))
    }

    /// The codec's byte where a block names it outside a frame's flags (a stored batch, a
    /// replicated entry, a forwarded publish): 1 zstd, 2 lz4.
    pub const fn byte(self) -> u8 {
        match self {
            Codec::Zstd => 1,
            Codec::Lz4 => 2,
        }
    }

    /// The codec [`byte`](Self::byte) names, if any.
    pub const fn from_byte(b: u8) -> Option<Codec> {
        match b {
            1 => Some(Codec::Zstd),
            2 => Some(Codec::Lz4),
            _ => None,
        }
    }

    /// The name used by the CLI, metrics and docs.
    pub const fn name(self) -> &'static str {
        match self {
            Codec::Zstd => "zstd",
            Codec::Lz4 => "lz4",
        }
    }

    /// Reads a name as given on a command line.
    pub fn from_name(name: &str) -> Option<Codec> {
        Codec::ALL.into_iter().find(|c| c.name().eq_ignore_ascii_case(name))
    }

    /// The level a client uses when it names none: zstd's own default (3), the level Kafka and
    /// most zstd users run; lz4 has one level.
    pub const fn default_level(self) -> i32 {
        match self {
            Codec::Zstd => 3,
            Codec::Lz4 => 0,
        }
    }

    /// The levels this codec takes: zstd 1–19 (the fast negative levels and the slow 20–22 are
    /// left out: neither pays on a message bus), lz4 only 0.
    pub const fn levels(self) -> std::ops::RangeInclusive<i32> {
        match self {
            Codec::Zstd => 1..=19,
            Codec::Lz4 => 0..=0,
        }
    }
}

impl std::fmt::Display for Codec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A record block as it travels compressed: the codec and the compressed bytes (the plain
/// block's length is the length of the [`Records`](super::Records) block that holds this).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Packed {
    /// The codec.
    pub codec: Codec,
    /// The compressed bytes: for a batch that arrived compressed, a slice of its frame.
    pub data: Bytes,
}

/// Why a compressed block was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CompressError {
    /// The block declares more plain bytes than the receiver takes in one frame.
    #[error("compressed block declares {declared} plain bytes; at most {limit} are accepted")]
    TooLarge {
        /// `raw_len` as declared.
        declared: usize,
        /// The receiver's limit.
        limit: usize,
    },
    /// The codec refused the bytes, or they inflate to a length other than the one declared.
    #[error("{codec} block does not decompress to its {declared} declared bytes: {reason}")]
    Corrupt {
        /// The codec named.
        codec: Codec,
        /// `raw_len` as declared.
        declared: usize,
        /// What the codec said.
        reason: String,
    },
}

/// Compression state a publisher keeps: zstd's context is reused across batches (creating one
/// costs more than compressing a small batch).
pub struct Compressor {
    codec: Codec,
    level: i32,
    zstd: Option<zstd::bulk::Compressor<'static>>,
}

impl std::fmt::Debug for Compressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compressor").field("codec", &self.codec).field("level", &self.level).finish()
    }
}

impl Compressor {
    /// A compressor for `codec` at `level` (see [`Codec::levels`]).
    ///
    /// # Errors
    /// A level outside the codec's range, or zstd refusing to make a context.
    pub fn new(codec: Codec, level: i32) -> Result<Compressor, String> {
        if !codec.levels().contains(&level) {
            let r = codec.levels();
            return Err(format!("{codec} takes levels {}–{}, not {level}", r.start(), r.end()));
        }
        let zstd = match codec {
            Codec::Zstd => Some(zstd::bulk::Compressor::new(level).map_err(|e| format!("zstd: {e}"))?),
            Codec::Lz4 => None,
        };
        Ok(Compressor { codec, level, zstd })
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// The level.
    pub fn level(&self) -> i32 {
        self.level
    }

    /// `plain` compressed, or `None` when that saves less than an eighth of it (the batch then
    /// goes plain: every subscriber of a compressed batch pays a decompression, which a
    /// one-percent saving does not repay; an incompressible 1 KiB record still shrinks by its
    /// repeated length and time fields).
    ///
    /// A block over [`PROBE`] bytes is first judged by its first `PROBE` bytes: if they do not
    /// shrink by an eighth, the whole block is not tried. That keeps what incompressible data
    /// costs to a sixteenth of a 64 KiB batch's compression.
    pub fn compress(&mut self, plain: &[u8]) -> Option<Bytes> {
        if plain.len() > 2 * PROBE {
            let probe = self.compress_all(&plain[..PROBE])?;
            if !worth_it(probe.len(), PROBE) {
                return None;
            }
        }
        let out = self.compress_all(plain)?;
        worth_it(out.len() + 4, plain.len()).then(|| Bytes::from(out))
    }

    fn compress_all(&mut self, plain: &[u8]) -> Option<Vec<u8>> {
        match (self.codec, self.zstd.as_mut()) {
            (Codec::Zstd, Some(z)) => z.compress(plain).ok(),
            (Codec::Zstd, None) => None,
            (Codec::Lz4, _) => Some(lz4_flex::block::compress(plain)),
        }
    }
}

/// The head of a block [`Compressor::compress`] tries first.
pub const PROBE: usize = 4096;

/// Whether `packed` bytes for `plain` save at least an eighth.
fn worth_it(packed: usize, plain: usize) -> bool {
    packed.saturating_mul(8) <= plain.saturating_mul(7)
}

/// Inflates `data` to exactly `raw_len` bytes, refusing before any allocation a `raw_len` over
/// `limit` (with a decompression context made for the call: see [`Decompressor`]).
///
/// # Errors
/// [`CompressError::TooLarge`] or [`CompressError::Corrupt`].
pub fn decompress(codec: Codec, data: &[u8], raw_len: usize, limit: usize) -> Result<Bytes, CompressError> {
    Decompressor::new().decompress(codec, data, raw_len, limit)
}

/// Decompression state a receiver keeps: zstd's context, made once. Making one per batch was
/// 13% of a fan-out bench's CPU (`perf`: `ZSTD_createDCtx`, ten subscribers of 64-record
/// batches), more than the bytes it saved.
#[derive(Default)]
pub struct Decompressor {
    zstd: Option<zstd::bulk::Decompressor<'static>>,
}

impl std::fmt::Debug for Decompressor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Decompressor").field("zstd", &self.zstd.is_some()).finish()
    }
}

impl Decompressor {
    /// A decompressor; contexts are made when first needed.
    pub fn new() -> Decompressor {
        Decompressor::default()
    }

    /// Inflates `data` to exactly `raw_len` bytes, refusing before any allocation a `raw_len`
    /// over `limit`.
    ///
    /// # Errors
    /// [`CompressError::TooLarge`] or [`CompressError::Corrupt`].
    pub fn decompress(
        &mut self,
        codec: Codec,
        data: &[u8],
        raw_len: usize,
        limit: usize,
    ) -> Result<Bytes, CompressError> {
        if raw_len > limit {
            return Err(CompressError::TooLarge { declared: raw_len, limit });
        }
        let corrupt = |reason: String| CompressError::Corrupt { codec, declared: raw_len, reason };
        let out = match codec {
            Codec::Zstd => {
                let z = match &mut self.zstd {
                    Some(z) => z,
                    slot => slot.insert(zstd::bulk::Decompressor::new().map_err(|e| corrupt(e.to_string()))?),
                };
                // Bounded by `raw_len`: zstd stops with an error rather than write past it.
                let mut out = vec![0u8; raw_len];
                let n = z.decompress_to_buffer(data, &mut out[..]).map_err(|e| corrupt(e.to_string()))?;
                if n != raw_len {
                    return Err(corrupt(format!("{n} bytes")));
                }
                out
            }
            Codec::Lz4 => {
                let mut out = vec![0u8; raw_len];
                let n = lz4_flex::block::decompress_into(data, &mut out).map_err(|e| corrupt(e.to_string()))?;
                if n != raw_len {
                    return Err(corrupt(format!("{n} bytes")));
                }
                out
            }
        };
        Ok(Bytes::from(out))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json_like(n: usize) -> Vec<u8> {
        let mut v = Vec::new();
        for i in 0..n {
            v.extend_from_slice(format!("{{\"id\":{i},\"user\":\"user-{}\",\"action\":\"click\"}}", i % 17).as_bytes());
        }
        v
    }

    #[test]
    fn both_codecs_round_trip_and_shrink_repetitive_data() {
        let plain = json_like(200);
        for codec in Codec::ALL {
            let mut c = Compressor::new(codec, codec.default_level()).unwrap();
            let packed = c.compress(&plain).expect("shrinks");
            assert!(packed.len() * 3 < plain.len(), "{codec}: {} of {}", packed.len(), plain.len());
            assert_eq!(decompress(codec, &packed, plain.len(), 1 << 20).unwrap(), plain);
        }
    }

    #[test]
    fn a_block_whose_head_does_not_shrink_is_not_tried_and_a_small_saving_stays_plain() {
        let mut x = 7u64;
        let mut noise = |n: usize| -> Vec<u8> {
            (0..n)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect()
        };
        // Noise then a long compressible tail: judged by the noise at its head.
        let mut block = noise(PROBE);
        block.extend(json_like(2000));
        for codec in Codec::ALL {
            let mut c = Compressor::new(codec, codec.default_level()).unwrap();
            assert_eq!(c.compress(&block), None, "{codec}");
            // Ten percent of zeros in noise: it shrinks, by less than an eighth.
            let mut mostly = noise(900);
            mostly.extend([0u8; 100]);
            assert_eq!(c.compress(&mostly), None, "{codec}");
        }
    }

    #[test]
    fn data_that_does_not_shrink_stays_plain() {
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let noise: Vec<u8> = (0..4096)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        for codec in Codec::ALL {
            assert_eq!(Compressor::new(codec, codec.default_level()).unwrap().compress(&noise), None);
        }
    }

    #[test]
    fn a_declared_length_over_the_limit_is_refused_before_anything_is_inflated() {
        let plain = vec![0u8; 1 << 20];
        for codec in Codec::ALL {
            let packed = Compressor::new(codec, codec.default_level()).unwrap().compress(&plain).unwrap();
            assert!(packed.len() < 8 << 10, "a megabyte of zeros packs small: {}", packed.len());
            assert_eq!(
                decompress(codec, &packed, plain.len(), 64 << 10),
                Err(CompressError::TooLarge { declared: 1 << 20, limit: 64 << 10 })
            );
            // A lie about the length, within the limit, is found by the codec.
            assert!(matches!(decompress(codec, &packed, 1000, 2 << 20), Err(CompressError::Corrupt { .. })));
            assert!(matches!(decompress(codec, &packed, (1 << 20) + 1, 2 << 20), Err(CompressError::Corrupt { .. })));
        }
    }

    #[test]
    fn garbage_is_refused_not_a_panic() {
        for codec in Codec::ALL {
            for junk in [&b""[..], b"\x00", b"\xff\xff\xff\xff", b"\x28\xb5\x2f\xfd\x00\x00garbage"] {
                for raw_len in [0, 1, 7, 4096] {
                    let _ = decompress(codec, junk, raw_len, 1 << 20);
                }
            }
        }
    }

    #[test]
    fn levels_outside_the_codec_are_refused() {
        assert!(Compressor::new(Codec::Zstd, 0).is_err());
        assert!(Compressor::new(Codec::Zstd, 20).is_err());
        assert!(Compressor::new(Codec::Lz4, 1).is_err());
        assert_eq!(Codec::from_name("ZSTD"), Some(Codec::Zstd));
        assert_eq!(Codec::from_name("gzip"), None);
    }
}
