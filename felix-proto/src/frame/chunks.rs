//! The bytes of a stream received and not read yet, kept as the chunks they arrived in.
//!
//! QUIC hands a stream over in chunks whose boundaries mean nothing to what they carry. Both
//! the client frame decoder and the cluster's peer decoder cut messages out of such a queue: a
//! message inside one chunk comes out as a slice of it (no copy), one spread over several is
//! copied once into a buffer of exactly its size. Appending to one growing buffer instead
//! copied every byte once and, each time a message was split off, the unread rest again
//! (`BytesMut::reserve` on a buffer shared with what was split off: 1.3% of an owner's CPU
//! under forwarded publishes).

use bytes::{Buf, Bytes, BytesMut};
use std::collections::VecDeque;

/// See the [module](self).
#[derive(Debug, Default)]
pub(crate) struct Chunks {
    chunks: VecDeque<Bytes>,
    buffered: usize,
}

impl Chunks {
    /// Appends received bytes, uncopied.
    pub(crate) fn push(&mut self, data: Bytes) {
        if !data.is_empty() {
            self.buffered += data.len();
            self.chunks.push_back(data);
        }
    }

    /// Bytes held.
    pub(crate) fn len(&self) -> usize {
        self.buffered
    }

    /// Drops everything held.
    pub(crate) fn clear(&mut self) {
        self.chunks.clear();
        self.buffered = 0;
    }

    /// Copies the first `out.len()` bytes into `out` without consuming them; `false` (and
    /// `out` untouched) when fewer are held.
    pub(crate) fn peek(&self, out: &mut [u8]) -> bool {
        if self.buffered < out.len() {
            return false;
        }
        let mut filled = 0;
        for c in &self.chunks {
            if filled == out.len() {
                break;
            }
            let n = c.len().min(out.len() - filled);
            out[filled..filled + n].copy_from_slice(&c[..n]);
            filled += n;
        }
        true
    }

    /// Drops the first `n` bytes (at most what is held).
    pub(crate) fn skip(&mut self, mut n: usize) {
        n = n.min(self.buffered);
        self.buffered -= n;
        while n > 0 {
            let Some(front) = self.chunks.front_mut() else { return };
            let k = front.len().min(n);
            front.advance(k);
            n -= k;
            if front.is_empty() {
                self.chunks.pop_front();
            }
        }
    }

    /// Takes the first `len` bytes: a slice of the front chunk when it holds them all, else
    /// one copy into a buffer of exactly `len` bytes. `None` (nothing consumed) when fewer are
    /// held.
    pub(crate) fn take(&mut self, len: usize) -> Option<Bytes> {
        if self.buffered < len {
            return None;
        }
        if len == 0 {
            return Some(Bytes::new());
        }
        if let Some(front) = self.chunks.front_mut()
            && front.len() >= len
        {
            let out = front.split_to(len);
            if front.is_empty() {
                self.chunks.pop_front();
            }
            self.buffered -= len;
            return Some(out);
        }
        let mut out = BytesMut::with_capacity(len);
        while out.len() < len {
            let Some(front) = self.chunks.front_mut() else { break };
            let n = front.len().min(len - out.len());
            out.extend_from_slice(&front[..n]);
            front.advance(n);
            if front.is_empty() {
                self.chunks.pop_front();
            }
        }
        self.buffered -= out.len();
        Some(out.freeze())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn held(parts: &[&[u8]]) -> Chunks {
        let mut c = Chunks::default();
        for p in parts {
            c.push(Bytes::copy_from_slice(p));
        }
        c
    }

    #[test]
    fn a_message_inside_one_chunk_is_a_slice_of_it_and_one_across_chunks_is_copied_whole() {
        let mut c = held(&[b"abcdef", b"gh", b"", b"ijk"]);
        assert_eq!(c.len(), 11);
        let first = c.take(4).unwrap();
        assert_eq!(&first[..], b"abcd");
        let spread = c.take(5).unwrap();
        assert_eq!(&spread[..], b"efghi");
        assert_eq!(c.len(), 2);
        assert_eq!(c.take(3), None, "more than is held: nothing consumed");
        assert_eq!(&c.take(2).unwrap()[..], b"jk");
        assert_eq!((c.len(), c.take(0)), (0, Some(Bytes::new())));
    }

    #[test]
    fn peek_reads_across_chunks_without_consuming_and_skip_drops_exactly() {
        let mut c = held(&[b"ab", b"c", b"defg"]);
        let mut four = [0u8; 4];
        assert!(c.peek(&mut four));
        assert_eq!(&four, b"abcd");
        assert_eq!(c.len(), 7);
        let mut eight = [0u8; 8];
        assert!(!c.peek(&mut eight), "fewer held than asked");
        c.skip(3);
        assert_eq!(&c.take(4).unwrap()[..], b"defg");
        c.push(Bytes::from_static(b"xy"));
        c.skip(10);
        assert_eq!(c.len(), 0);
        c.push(Bytes::from_static(b"z"));
        c.clear();
        assert_eq!(c.take(1), None);
    }
}
