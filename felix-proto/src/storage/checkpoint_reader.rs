//! A state checkpoint read as its bytes come, a piece at a time ([`StateCheckpointReader`]).
//!
//! Why: a follower that installs a replicated stream's snapshot restores its commit state from
//! the snapshot on disk. Read whole, the snapshot's data and the state built from it were in
//! memory together, twice the state at the peak; read in pieces, each value is copied out as
//! it completes and the piece it came in goes, so the peak is the state and one piece.

use super::beside::STATE_CHECKPOINT_MAGIC;
use super::pieces::{ItemLen, Items, feed_items};
use super::*;

/// What [`StateCheckpointReader`] waits for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// The 16-byte header: magic, `as_of`, count.
    Header,
    /// The next value; this many are left.
    Values(u32),
    /// Only the CRC is left (it ends the bytes).
    Crc,
}

/// Reads [`encode_state_checkpoint`]'s bytes handed over in pieces of any size, as
/// [`decode_state_checkpoint`] reads them whole: the same checkpoint, or an error for the same
/// bytes (the first error found, which may be another of the kinds than the whole read's).
///
/// Each value is copied out into an allocation of its own as soon as its bytes are in: only an
/// item cut by a piece's end is held over (up to one value). Never panics.
#[derive(Debug, Default)]
pub struct StateCheckpointReader {
    /// The start of an item cut by a piece's end.
    carry: Vec<u8>,
    read: Read,
    failed: Option<CheckpointError>,
}

/// What [`StateCheckpointReader`] read so far.
#[derive(Debug)]
struct Read {
    step: Step,
    /// CRC of every byte taken so far (the CRC itself excepted).
    crc: u32,
    /// The CRC's bytes, at the end.
    stored: Vec<u8>,
    as_of: u64,
    values: Vec<(String, Bytes, u64)>,
}

impl Default for Read {
    fn default() -> Self {
        Read { step: Step::Header, crc: 0, stored: Vec::new(), as_of: 0, values: Vec::new() }
    }
}

impl Items for Read {
    type Error = CheckpointError;

    fn len(&self, b: &[u8]) -> ItemLen {
        let whole = |n: usize| if b.len() >= n { ItemLen::Whole(n) } else { ItemLen::Needs(n) };
        match self.step {
            Step::Header => whole(16),
            Step::Crc => ItemLen::Tail,
            Step::Values(_) => {
                let Some(k) = b.get(..2) else { return ItemLen::Needs(2) };
                let klen = u16::from_be_bytes([k[0], k[1]]) as usize;
                let Some(v) = b.get(2 + klen + 8..2 + klen + 12) else { return ItemLen::Needs(2 + klen + 12) };
                whole(2 + klen + 12 + u32::from_be_bytes([v[0], v[1], v[2], v[3]]) as usize)
            }
        }
    }

    fn take(&mut self, b: &[u8]) -> Result<(), CheckpointError> {
        self.crc = crc32c_append(self.crc, b);
        let word = |at: usize| b.get(at..at + 4).map_or(0, |w| u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
        let long = |at: usize| b.get(at..at + 8).and_then(|w| w.try_into().ok()).map_or(0, u64::from_be_bytes);
        match self.step {
            Step::Header => {
                if word(0) != STATE_CHECKPOINT_MAGIC {
                    return Err(CheckpointError::Malformed("wrong magic"));
                }
                self.as_of = long(4);
                let count = word(12);
                // Grown as values come: a count is not an allocation.
                self.values.reserve((count as usize).min(1024));
                self.step = if count == 0 { Step::Crc } else { Step::Values(count) };
            }
            Step::Values(left) => {
                let klen = b.get(..2).map_or(0, |k| u16::from_be_bytes([k[0], k[1]]) as usize);
                let (Some(key), Some(value)) = (b.get(2..2 + klen), b.get(2 + klen + 12..)) else {
                    return Err(CheckpointError::Malformed("truncated"));
                };
                let key =
                    std::str::from_utf8(key).map_err(|_| CheckpointError::Malformed("a key is not UTF-8"))?.to_owned();
                if self.values.last().is_some_and(|(k, _, _)| *k >= key) {
                    return Err(CheckpointError::Malformed("keys out of order"));
                }
                self.values.push((key, Bytes::copy_from_slice(value), long(2 + klen)));
                self.step = if left == 1 { Step::Crc } else { Step::Values(left - 1) };
            }
            Step::Crc => return self.tail(b),
        }
        Ok(())
    }

    fn tail(&mut self, b: &[u8]) -> Result<(), CheckpointError> {
        self.stored.extend_from_slice(b);
        if self.stored.len() > 4 {
            return Err(CheckpointError::Malformed("bytes after the last value"));
        }
        Ok(())
    }
}

impl StateCheckpointReader {
    /// A reader at the start of a checkpoint.
    pub fn new() -> StateCheckpointReader {
        StateCheckpointReader::default()
    }

    /// Bytes it holds over (an item cut by a piece's end), for accounting.
    pub fn held(&self) -> usize {
        self.carry.capacity()
    }

    /// Takes the next bytes of the checkpoint.
    ///
    /// # Errors
    /// [`CheckpointError`] once the bytes cannot be a checkpoint (and for every piece after).
    pub fn feed(&mut self, piece: &[u8]) -> Result<(), CheckpointError> {
        if let Some(e) = &self.failed {
            return Err(e.clone());
        }
        let r = feed_items(&mut self.carry, &mut self.read, piece);
        if let Err(e) = &r {
            self.failed = Some(e.clone());
            self.carry = Vec::new();
            self.read = Read::default();
        }
        r
    }

    /// The checkpoint, once every byte was fed.
    ///
    /// # Errors
    /// [`CheckpointError`] for bytes that are not a whole, undamaged checkpoint.
    pub fn finish(self) -> Result<StateCheckpoint, CheckpointError> {
        if let Some(e) = self.failed {
            return Err(e);
        }
        let r = self.read;
        if r.step != Step::Crc || r.stored.len() != 4 || !self.carry.is_empty() {
            return Err(CheckpointError::Malformed("truncated"));
        }
        if r.stored[..] != r.crc.to_be_bytes() {
            return Err(CheckpointError::BadChecksum);
        }
        Ok(StateCheckpoint { as_of: r.as_of, values: r.values })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn read_in(bytes: &[u8], cuts: &[usize]) -> Result<StateCheckpoint, CheckpointError> {
        let mut r = StateCheckpointReader::new();
        let mut at = 0;
        for &c in cuts.iter().chain(std::iter::once(&bytes.len())) {
            let c = c.clamp(at, bytes.len());
            r.feed(&bytes[at..c])?;
            at = c;
        }
        r.finish()
    }

    fn sample() -> Bytes {
        let c = StateCheckpoint {
            as_of: 41,
            values: vec![
                ("a".into(), Bytes::from_static(b"1"), 3),
                ("b".into(), Bytes::new(), 41),
                ("k".repeat(300), Bytes::from(vec![7u8; 5000]), 9),
                ("z".into(), Bytes::from_static(b"last"), 40),
            ],
        };
        encode_state_checkpoint(&c).unwrap()
    }

    #[test]
    fn a_checkpoint_read_a_byte_at_a_time_or_whole_is_the_same_and_holds_over_one_item_at_most() {
        let file = sample();
        let whole = decode_state_checkpoint(&file).unwrap();
        assert_eq!(read_in(&file, &[]), Ok(whole.clone()));
        let mut r = StateCheckpointReader::new();
        let mut most = 0;
        for b in file.iter() {
            r.feed(&[*b]).unwrap();
            most = most.max(r.carry.len());
        }
        assert!(most <= 2 + 300 + 12 + 5000, "held over at most one value: {most}");
        let c = r.finish().unwrap();
        assert_eq!(c, whole);
        // Each value an allocation of its own, not a slice of what was fed.
        assert!(c.values.iter().all(|(_, v, _)| !file.as_ptr_range().contains(&v.as_ptr()) || v.is_empty()));
        let empty = encode_state_checkpoint(&StateCheckpoint::default()).unwrap();
        assert_eq!(read_in(&empty, &[3, 17]), Ok(StateCheckpoint::default()));
    }

    #[test]
    fn a_damaged_or_cut_checkpoint_read_in_pieces_is_refused() {
        let file = sample();
        for cut in 0..file.len() {
            assert!(read_in(&file[..cut], &[cut / 2]).is_err(), "truncated at {cut}");
        }
        for at in 0..file.len() {
            let mut flipped = file.to_vec();
            flipped[at] ^= 0x10;
            assert!(read_in(&flipped, &[at, at + 1]).is_err(), "flipped at {at}");
        }
        let mut longer = file.to_vec();
        longer.push(0);
        assert_eq!(read_in(&longer, &[5]), Err(CheckpointError::Malformed("bytes after the last value")));
        let twice =
            StateCheckpoint { as_of: 1, values: vec![("a".into(), Bytes::new(), 1), ("a".into(), Bytes::new(), 1)] };
        let twice = encode_state_checkpoint(&twice).unwrap();
        assert_eq!(read_in(&twice, &[17]), Err(CheckpointError::Malformed("keys out of order")));
        // A count far past the bytes reserves nothing much and reads as cut short.
        let mut huge = file[..file.len() - 4].to_vec();
        huge[12..16].copy_from_slice(&u32::MAX.to_be_bytes());
        let crc = crc32c(&huge);
        huge.extend_from_slice(&crc.to_be_bytes());
        assert!(read_in(&huge, &[20]).is_err());
        // Once refused, every later piece is too.
        let mut r = StateCheckpointReader::new();
        assert!(r.feed(b"FLXP and more bytes").is_err());
        assert!(r.feed(&file).is_err());
    }

    proptest! {
        #[test]
        fn any_bytes_in_any_pieces_read_as_the_whole_read_does(
            values in proptest::collection::btree_map("[a-z]{0,6}", proptest::collection::vec(any::<u8>(), 0..40), 0..12),
            as_of in any::<u64>(),
            cuts in proptest::collection::vec(0usize..2000, 0..8),
            flip in proptest::option::of((0usize..2000, any::<u8>())),
        ) {
            let c = StateCheckpoint {
                as_of,
                values: values.into_iter().enumerate().map(|(i, (k, v))| (k, Bytes::from(v), i as u64)).collect(),
            };
            let mut file = encode_state_checkpoint(&c).unwrap().to_vec();
            if let Some((at, x)) = flip {
                let n = file.len();
                file[at % n] ^= x;
            }
            let mut cuts = cuts;
            cuts.sort_unstable();
            let whole = decode_state_checkpoint(&Bytes::from(file.clone()));
            let pieces = read_in(&file, &cuts);
            prop_assert_eq!(whole.is_ok(), pieces.is_ok());
            if let (Ok(w), Ok(p)) = (whole, pieces) {
                prop_assert_eq!(w, p);
            }
        }
    }
}
