//! The files storage keeps beside a shard's segments: its producer watermarks (what retention
//! forgot of idempotent producers) and its commit state's checkpoint (D63).

use super::*;

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
pub(super) const STATE_CHECKPOINT_MAGIC: u32 = 0x464C_5853;

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
    let mut out = Vec::new();
    let values = c.values.iter().map(|(k, v, version)| (k.as_str(), v.as_ref(), *version));
    encode_state_checkpoint_into(c.as_of, values, &mut out)?;
    Some(out.into())
}

/// [`encode_state_checkpoint`] of the state as of `as_of` with `values` (in key order),
/// appended to `out` straight from where the values live: nothing gathered or copied first (a
/// replicated shard's snapshot holds it). On `None` (a key or value longer than its length
/// field), `out` is left as it was.
pub fn encode_state_checkpoint_into<'a, I>(as_of: u64, values: I, out: &mut Vec<u8>) -> Option<()>
where
    I: ExactSizeIterator<Item = (&'a str, &'a [u8], u64)> + Clone,
{
    let start = out.len();
    let size: usize = values.clone().map(|(k, v, _)| 14 + k.len() + v.len()).sum();
    out.reserve(20 + size);
    let fits = (|| {
        out.put_u32(STATE_CHECKPOINT_MAGIC);
        out.put_u64(as_of);
        out.put_u32(u32::try_from(values.len()).ok()?);
        for (key, value, version) in values {
            out.put_u16(u16::try_from(key.len()).ok()?);
            out.extend_from_slice(key.as_bytes());
            out.put_u64(version);
            out.put_u32(u32::try_from(value.len()).ok()?);
            out.extend_from_slice(value);
        }
        Some(())
    })();
    if fits.is_none() {
        out.truncate(start);
        return None;
    }
    let crc = crc32c(&out[start..]);
    out.put_u32(crc);
    Some(())
}

/// [`encode_state_checkpoint_into`]'s bytes handed to `each` in pieces as they are encoded
/// (each value from where it is, never copied into one buffer), with the CRC computed as they
/// go: a replicated stream's commit state written into a snapshot on disk. `None`, and
/// nothing handed over, when it cannot be encoded (a key over 65,535 bytes, a value or a
/// count over 4 GiB).
pub fn encode_state_checkpoint_pieces<'a, I>(as_of: u64, values: I, each: &mut dyn FnMut(&[u8])) -> Option<()>
where
    I: ExactSizeIterator<Item = (&'a str, &'a [u8], u64)> + Clone,
{
    let count = u32::try_from(values.len()).ok()?;
    let fits = values.clone().all(|(k, v, _)| k.len() <= usize::from(u16::MAX) && u32::try_from(v.len()).is_ok());
    if !fits {
        return None;
    }
    let mut head = [0u8; 16];
    head[..4].copy_from_slice(&STATE_CHECKPOINT_MAGIC.to_be_bytes());
    head[4..12].copy_from_slice(&as_of.to_be_bytes());
    head[12..].copy_from_slice(&count.to_be_bytes());
    let mut crc = crc32c(&head);
    each(&head);
    for (key, value, version) in values {
        let mut h = [0u8; 2];
        h.copy_from_slice(&(key.len() as u16).to_be_bytes());
        let mut after = [0u8; 12];
        after[..8].copy_from_slice(&version.to_be_bytes());
        after[8..].copy_from_slice(&(value.len() as u32).to_be_bytes());
        for piece in [&h[..], key.as_bytes(), &after[..], value] {
            crc = crate::storage::crc32c_append(crc, piece);
            each(piece);
        }
    }
    each(&crc.to_be_bytes());
    Some(())
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
    fn a_state_checkpoint_in_pieces_is_the_same_bytes_and_hands_over_nothing_it_cannot_encode() {
        let big = vec![9u8; 100_000];
        let values: Vec<(String, Vec<u8>, u64)> =
            vec![("a".into(), b"x".to_vec(), 3), ("k".repeat(300), big, 7), ("z".into(), Vec::new(), 9)];
        let iter = || values.iter().map(|(k, v, n)| (k.as_str(), v.as_slice(), *n));
        let mut whole = Vec::new();
        encode_state_checkpoint_into(42, iter(), &mut whole).unwrap();
        let mut pieces = Vec::new();
        let mut largest = 0;
        encode_state_checkpoint_pieces(42, iter(), &mut |p| {
            largest = largest.max(p.len());
            pieces.extend_from_slice(p);
        })
        .unwrap();
        assert_eq!(pieces, whole);
        assert_eq!(largest, 100_000, "each value handed over from where it is");
        let long = "k".repeat(70_000);
        let bad = [(long.as_str(), &b"v"[..], 1u64)];
        let mut handed = 0;
        assert!(encode_state_checkpoint_pieces(1, bad.iter().copied(), &mut |_| handed += 1).is_none());
        assert_eq!(handed, 0);
    }

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
