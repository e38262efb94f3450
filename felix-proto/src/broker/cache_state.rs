//! A replicated cache's state as its snapshots carry it: its entries
//! ([`Cache::encode_state_into`](super::cache::Cache::encode_state_into)) then its counters' sums. Read by one reader
//! ([`CacheStateReader`]), whether the bytes are in hand or come from disk a piece at a time
//! (a follower that installed a snapshot reads its state back from the copy it wrote, so the
//! snapshot's data and the cache built from it are never in memory together).
//!
//! ```text
//! u8 version (1), u64 next_version, u32 entries,
//! entries × (u16 key_len, key, u64 version, u64 expires_wall, u32 value_len, value),
//! u32 counters, counters × (u16 key_len, key, u64 sum)   (bytes after them are ignored)
//! ```

use crate::storage::pieces::{ItemLen, Items, feed_items};
use bytes::Bytes;
use std::collections::HashMap;

/// What [`CacheStateReader`] waits for next.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    /// Version, next version, count of entries.
    Header,
    /// The next entry; this many are left.
    Entries(u32),
    /// The count of counters.
    CountersHead,
    /// The next counter; this many are left.
    Counters(u32),
    /// What follows is ignored (the counters ended, or did not read).
    Ignored,
}

/// One entry as read: key, value (a copy of its own), version, expiry (wall-clock micros, 0
/// for none).
pub(crate) type EntryRead = (String, Bytes, u64, u64);

/// A cache's entries as read (see [`Cache::restore_state`](super::cache::Cache::restore_state)): the next version, once the
/// header read, and the entries, when they all read.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct CacheState {
    pub(crate) next_version: Option<u64>,
    pub(crate) entries: Option<Vec<EntryRead>>,
}

/// Reads a replicated cache's state from bytes handed over in pieces of any size: each entry's
/// value copied out into an allocation of its own as soon as its bytes are in, only an item
/// cut by a piece's end held over. Never panics.
#[derive(Debug, Default)]
pub(crate) struct CacheStateReader {
    carry: Vec<u8>,
    read: Read,
}

#[derive(Debug)]
struct Read {
    step: Step,
    next_version: Option<u64>,
    entries: Vec<EntryRead>,
    sums: Vec<(String, i64)>,
    /// The entries did not read: the cache is restored empty, without counters.
    entries_failed: bool,
    /// The counters did not read: none are restored.
    counters_failed: bool,
}

impl Default for Read {
    fn default() -> Self {
        Read {
            step: Step::Header,
            next_version: None,
            entries: Vec::new(),
            sums: Vec::new(),
            entries_failed: false,
            counters_failed: false,
        }
    }
}

impl Items for Read {
    type Error = ();

    fn len(&self, b: &[u8]) -> ItemLen {
        let whole = |n: usize| if b.len() >= n { ItemLen::Whole(n) } else { ItemLen::Needs(n) };
        let key = || b.get(..2).map(|k| u16::from_be_bytes([k[0], k[1]]) as usize);
        match self.step {
            Step::Header => whole(13),
            Step::CountersHead => whole(4),
            Step::Ignored => ItemLen::Tail,
            Step::Entries(_) => {
                let Some(klen) = key() else { return ItemLen::Needs(2) };
                let Some(v) = b.get(2 + klen + 16..2 + klen + 20) else { return ItemLen::Needs(2 + klen + 20) };
                whole(2 + klen + 20 + u32::from_be_bytes([v[0], v[1], v[2], v[3]]) as usize)
            }
            Step::Counters(_) => match key() {
                Some(klen) => whole(2 + klen + 8),
                None => ItemLen::Needs(2),
            },
        }
    }

    fn take(&mut self, b: &[u8]) -> Result<(), ()> {
        let word = |at: usize| b.get(at..at + 4).map_or(0, |w| u32::from_be_bytes([w[0], w[1], w[2], w[3]]));
        let long = |at: usize| b.get(at..at + 8).and_then(|w| w.try_into().ok()).map_or(0, u64::from_be_bytes);
        let key = || {
            let klen = b.get(..2).map_or(0, |k| u16::from_be_bytes([k[0], k[1]]) as usize);
            let key = std::str::from_utf8(b.get(2..2 + klen)?).ok()?;
            Some((key.to_owned(), 2 + klen))
        };
        match self.step {
            Step::Header => {
                if b.first() != Some(&1) {
                    return Err(());
                }
                self.next_version = Some(long(1));
                let count = word(9);
                self.entries.reserve((count as usize).min(1024));
                self.step = if count == 0 { Step::CountersHead } else { Step::Entries(count) };
            }
            Step::Entries(left) => {
                let (key, at) = key().ok_or(())?;
                let value = b.get(at + 20..).ok_or(())?;
                self.entries.push((key, Bytes::copy_from_slice(value), long(at), long(at + 8)));
                self.step = if left == 1 { Step::CountersHead } else { Step::Entries(left - 1) };
            }
            Step::CountersHead => {
                let count = word(0);
                self.sums.reserve((count as usize).min(1024));
                self.step = if count == 0 { Step::Ignored } else { Step::Counters(count) };
            }
            Step::Counters(left) => match key() {
                Some((key, at)) => {
                    self.sums.push((key, long(at) as i64));
                    self.step = if left == 1 { Step::Ignored } else { Step::Counters(left - 1) };
                }
                None => {
                    self.counters_failed = true;
                    self.step = Step::Ignored;
                }
            },
            Step::Ignored => {}
        }
        Ok(())
    }

    fn tail(&mut self, _: &[u8]) -> Result<(), ()> {
        Ok(())
    }
}

impl CacheStateReader {
    /// Takes the next bytes of the state.
    pub(crate) fn feed(&mut self, piece: &[u8]) {
        if self.read.entries_failed {
            return;
        }
        if feed_items(&mut self.carry, &mut self.read, piece).is_err() {
            let next_version = self.read.next_version;
            self.read = Read { next_version, entries_failed: true, ..Read::default() };
            self.carry = Vec::new();
        }
    }

    /// Bytes it holds over (an item cut by a piece's end).
    pub(crate) fn held(&self) -> usize {
        self.carry.capacity()
    }

    /// The state once every byte was fed: the cache's entries, and its counters' sums when
    /// they read (by key: a key written twice keeps its last sum).
    pub(crate) fn finish(self) -> (CacheState, HashMap<String, i64>) {
        let r = self.read;
        let entries_whole = !r.entries_failed && !matches!(r.step, Step::Header | Step::Entries(_));
        let counters_whole = entries_whole && !r.counters_failed && r.step == Step::Ignored;
        let sums = if counters_whole { r.sums.into_iter().collect() } else { HashMap::new() };
        (CacheState { next_version: r.next_version, entries: entries_whole.then_some(r.entries) }, sums)
    }
}

#[cfg(any(test, fuzzing, feature = "testkit"))]
impl super::cache::Cache {
    /// The state of bytes in hand, read whole ([`CacheStateReader`]).
    pub(crate) fn read_state(state: &[u8]) -> (CacheState, HashMap<String, i64>) {
        let mut r = CacheStateReader::default();
        r.feed(state);
        r.finish()
    }
}

#[cfg(test)]
mod tests {
    use super::super::cache::Cache;
    use super::*;

    /// A cache's state read a piece at a time is what reading it whole gives, wherever the
    /// pieces are cut; entries that do not read leave the cache empty and without counters,
    /// counters that do not read leave the entries and no counters, as whole.
    #[test]
    fn a_cache_state_read_in_pieces_is_the_state_read_whole() {
        let mut c = Cache::default();
        for i in 0..6u64 {
            c.put(format!("k{i}"), Bytes::from(vec![i as u8; 50]), None);
        }
        let mut state = c.encode_state();
        let entries_end = state.len();
        state.extend_from_slice(&2u32.to_be_bytes());
        for (k, v) in [("a", 5u64), ("b", 7)] {
            state.extend_from_slice(&(k.len() as u16).to_be_bytes());
            state.extend_from_slice(k.as_bytes());
            state.extend_from_slice(&v.to_be_bytes());
        }
        let in_pieces = |bytes: &[u8], size: usize| {
            let mut r = CacheStateReader::default();
            for p in bytes.chunks(size.max(1)) {
                r.feed(p);
            }
            r.finish()
        };
        let whole = Cache::read_state(&state);
        assert_eq!(whole.0.entries.as_ref().map(Vec::len), Some(6));
        assert_eq!(whole.1.len(), 2);
        for size in [1, 3, 22, 64, state.len()] {
            assert_eq!(in_pieces(&state, size), whole, "pieces of {size}");
        }
        // Cut inside the counters: the entries, no counters.
        let cut = in_pieces(&state[..state.len() - 3], 7);
        assert_eq!((cut.0.entries.map(|e| e.len()), cut.1.len()), (Some(6), 0));
        // Cut inside the entries: none of either.
        let cut = in_pieces(&state[..entries_end - 10], 7);
        assert_eq!((cut.0.entries, cut.1.len()), (None, 0));
        // A wrong version reads nothing.
        let mut v2 = state.clone();
        v2[0] = 2;
        assert_eq!(in_pieces(&v2, 4).0, CacheState::default());
    }
}
