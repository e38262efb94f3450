//! A leader sending a follower a snapshot whose data is on disk only: the `MsgSnapshot` the
//! engine made carries the metadata and no data ([`Replica::set_snapshot_by_reference`]); the
//! data is read from the kept log a chunk at a time and shipped as it comes, in the same
//! `snapshot_chunk`s (kind 14) as a snapshot held in memory, or whole in one `shard_raft` to a
//! peer that does not read chunks (or when it fits in one chunk), byte for byte what the
//! in-memory path sends.
//!
//! Why: read back whole, a stream's commit state or a cache's values were in memory a second
//! time for every follower sent them, as large as they are. Here a send holds at most
//! [`SEND_WINDOW`] chunks: the next read is asked only once the transport took all but one of
//! the chunks before it, so a slow link does not make the reads pile up. (To a peer without
//! chunks the data is gathered whole: that peer can take it no other way.)
//!
//! [`Replica::set_snapshot_by_reference`]: super::replica::Replica::set_snapshot_by_reference

use super::meta::{SnapshotPiece, encode_message};
use super::node::MAX_SNAPSHOT_BYTES;
use super::peer::SnapshotChunk;
use crate::shard::ShardId;
use bytes::{Bytes, BytesMut};
use raft::eraftpb::Message;
use std::time::{Duration, Instant};

/// Chunks of one send read and not yet taken by the transport, at most.
pub const SEND_WINDOW: u32 = 2;

/// A send that made no progress for this long (a read never answered, a transport that took
/// nothing) gives way to the engine's next `MsgSnapshot` to the same follower, which starts
/// afresh; until then such a message is the same send asked again and changes nothing.
pub const SEND_STALL: Duration = Duration::from_secs(10);

/// Where a send is.
#[derive(Debug)]
enum Phase {
    /// No piece read yet: the data's length, and so how it goes, is not known.
    Starting,
    /// In `snapshot_chunk`s of the data's `total` bytes.
    Chunks {
        /// The data's length.
        total: u64,
    },
    /// Whole, in one message, once gathered.
    Whole {
        /// The data's length.
        total: u64,
        /// What was read so far.
        gathered: BytesMut,
    },
    /// Everything read and shipped.
    Shipped,
}

/// What to put on the wire after a read.
#[derive(Debug)]
pub enum Ship {
    /// A chunk, for the peer's stream.
    Chunk(SnapshotChunk),
    /// The whole message, data in it.
    Whole(Message),
}

/// Why a send ends early.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SendError {
    /// The read failed.
    #[error("reading the snapshot: {0}")]
    Read(String),
    /// A piece that does not continue the data read before it (the snapshot on disk changed).
    #[error("a piece of {got} bytes at {offset} of {total} does not continue the snapshot read before")]
    Mismatch {
        /// Where it was asked from.
        offset: u64,
        /// Its length.
        got: u64,
        /// The data's length it claims.
        total: u64,
    },
    /// Data larger than a receiver takes ([`MAX_SNAPSHOT_BYTES`]).
    #[error("a snapshot of {0} bytes is larger than a peer takes")]
    TooLarge(u64),
}

/// One snapshot on its way to one follower, its data read from disk.
#[derive(Debug)]
pub struct SnapshotSend {
    shard: ShardId,
    /// The engine's message, without data.
    message: Message,
    index: u64,
    term: u64,
    /// The peer reads `snapshot_chunk`s.
    takes_chunks: bool,
    /// Bytes of data per chunk (and per read).
    chunk: u64,
    /// The send is a move's copy: each read is charged to the move budget.
    charged: bool,
    phase: Phase,
    /// The next offset to read.
    next: u64,
    /// The token of the read under way.
    reading: Option<u64>,
    /// Chunks shipped and not yet taken by the transport.
    unwritten: u32,
    /// When it last moved on.
    progressed: Instant,
}

impl SnapshotSend {
    /// A send of the engine's `message` (a `MsgSnapshot` without data) of `shard`, in chunks of
    /// `chunk` bytes to a peer that `takes_chunks`.
    pub fn new(
        shard: ShardId,
        message: Message,
        takes_chunks: bool,
        chunk: usize,
        charged: bool,
        now: Instant,
    ) -> Self {
        let m = message.get_snapshot().get_metadata();
        let (index, term) = (m.index, m.term);
        SnapshotSend {
            shard,
            message,
            index,
            term,
            takes_chunks,
            chunk: chunk.max(1) as u64,
            charged,
            phase: Phase::Starting,
            next: 0,
            reading: None,
            unwritten: 0,
            progressed: now,
        }
    }

    /// The snapshot's index.
    pub fn index(&self) -> u64 {
        self.index
    }

    /// Whether its reads are charged to the move budget.
    pub fn charged(&self) -> bool {
        self.charged
    }

    /// Whether it made no progress for [`SEND_STALL`].
    pub fn stalled(&self, now: Instant) -> bool {
        now.saturating_duration_since(self.progressed) >= SEND_STALL
    }

    /// The read to ask now, offset and length: none while one is under way, while the window
    /// is full, or once everything was read.
    pub fn next_read(&self) -> Option<(u64, u64)> {
        if self.reading.is_some() || self.unwritten >= SEND_WINDOW {
            return None;
        }
        match &self.phase {
            Phase::Starting => Some((0, self.chunk)),
            Phase::Chunks { total } | Phase::Whole { total, .. } if self.next < *total => {
                Some((self.next, self.chunk.min(total - self.next)))
            }
            _ => None,
        }
    }

    /// The read of [`Self::next_read`] was asked with `token`.
    pub fn asked(&mut self, token: u64) {
        self.reading = Some(token);
    }

    /// The read asked with `token` came back: what to ship, if anything. An error ends the
    /// send (the engine sends the snapshot again as it probes the follower).
    ///
    /// # Errors
    /// [`SendError`]: the read failed, or gave a piece that does not continue the data.
    pub fn on_read(
        &mut self,
        token: u64,
        read: Result<SnapshotPiece, String>,
        now: Instant,
    ) -> Result<Option<Ship>, SendError> {
        if self.reading != Some(token) {
            return Ok(None);
        }
        self.reading = None;
        let piece = read.map_err(SendError::Read)?;
        let (offset, got) = (self.next, piece.data.len() as u64);
        let total = match &self.phase {
            Phase::Starting => piece.total,
            Phase::Chunks { total } | Phase::Whole { total, .. } => *total,
            Phase::Shipped => return Ok(None),
        };
        let expected = self.chunk.min(total.saturating_sub(offset));
        if piece.total != total || got != expected {
            return Err(SendError::Mismatch { offset, got, total: piece.total });
        }
        if total > MAX_SNAPSHOT_BYTES {
            return Err(SendError::TooLarge(total));
        }
        self.progressed = now;
        self.next += got;
        if matches!(self.phase, Phase::Starting) {
            self.phase = if self.takes_chunks && total > self.chunk {
                Phase::Chunks { total }
            } else {
                // (Room as the data arrives, not as the first piece claims.)
                Phase::Whole { total, gathered: BytesMut::with_capacity(piece.data.len()) }
            };
        }
        let done = self.next >= total;
        let ship = match &mut self.phase {
            Phase::Chunks { total } => {
                self.unwritten += 1;
                Ship::Chunk(SnapshotChunk {
                    shard: self.shard.clone(),
                    index: self.index,
                    term: self.term,
                    total: *total,
                    offset,
                    header: if offset == 0 { Bytes::from(encode_message(&self.message)) } else { Bytes::new() },
                    data: piece.data,
                })
            }
            Phase::Whole { gathered, .. } => {
                if !done {
                    gathered.extend_from_slice(&piece.data);
                    return Ok(None);
                }
                let data = if gathered.is_empty() {
                    piece.data
                } else {
                    gathered.extend_from_slice(&piece.data);
                    std::mem::take(gathered).freeze()
                };
                let mut m = self.message.clone();
                m.mut_snapshot().set_data(data);
                Ship::Whole(m)
            }
            Phase::Starting | Phase::Shipped => return Ok(None),
        };
        if done {
            self.phase = Phase::Shipped;
        }
        Ok(Some(ship))
    }

    /// The transport took the chunk at `offset` (of this send's snapshot).
    pub fn on_written(&mut self, now: Instant) {
        if self.unwritten > 0 {
            self.unwritten -= 1;
            self.progressed = now;
        }
    }

    /// Everything shipped and taken by the transport.
    pub fn done(&self) -> bool {
        matches!(self.phase, Phase::Shipped) && self.unwritten == 0
    }

    /// Bytes of data it holds (gathered for a peer that takes the data whole).
    pub fn held(&self) -> usize {
        match &self.phase {
            Phase::Whole { gathered, .. } => gathered.len(),
            _ => 0,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cluster::meta::{decode_message, piece_of};
    use raft::eraftpb::MessageType;

    fn shard() -> ShardId {
        ShardId {
            kind: crate::shard::Kind::Stream,
            tenant: "t".into(),
            namespace: "n".into(),
            name: "s".into(),
            shard: 0,
        }
    }

    fn message() -> Message {
        let mut m = Message::default();
        m.set_msg_type(MessageType::MsgSnapshot);
        m.to = 2;
        m.mut_snapshot().mut_metadata().index = 40;
        m.mut_snapshot().mut_metadata().term = 3;
        m
    }

    /// Runs a send of `data` to the end, the transport taking a chunk only once `lag` more
    /// were shipped after it; returns what was shipped and the most chunks ever unwritten.
    fn run(data: &Bytes, takes_chunks: bool, chunk: usize, lag: usize) -> (Vec<Ship>, u32) {
        let now = crate::transport::test_epoch();
        let mut s = SnapshotSend::new(shard(), message(), takes_chunks, chunk, false, now);
        let (mut shipped, mut most, mut token) = (Vec::new(), 0, 0);
        let mut unwritten = 0usize;
        for _ in 0..10_000 {
            if s.done() {
                break;
            }
            match s.next_read() {
                Some((offset, len)) => {
                    token += 1;
                    s.asked(token);
                    if let Some(ship) =
                        s.on_read(token, piece_of(data, offset, len).map_err(|e| e.to_string()), now).unwrap()
                    {
                        unwritten += usize::from(matches!(ship, Ship::Chunk(_)));
                        shipped.push(ship);
                    }
                }
                None => {
                    assert!(unwritten > 0, "a send that neither reads nor waits for the transport");
                    unwritten -= 1;
                    s.on_written(now);
                }
            }
            most = most.max(s.unwritten);
            if unwritten > lag && s.next_read().is_some() {
                unwritten -= 1;
                s.on_written(now);
            }
        }
        assert!(s.done());
        (shipped, most)
    }

    #[test]
    fn chunks_are_the_data_in_order_the_message_in_the_first_and_never_more_than_the_window_unwritten() {
        let data = Bytes::from((0..1000u32).map(|i| (i % 251) as u8).collect::<Vec<_>>());
        for lag in [0, 1, 5] {
            let (shipped, most) = run(&data, true, 64, lag);
            assert!(most <= SEND_WINDOW, "{most} chunks unwritten at once");
            let mut whole = Vec::new();
            for (i, ship) in shipped.iter().enumerate() {
                let Ship::Chunk(c) = ship else { panic!("a whole message to a peer that reads chunks") };
                assert_eq!((c.index, c.term, c.total, c.offset), (40, 3, 1000, whole.len() as u64));
                if i == 0 {
                    let m = decode_message(&c.header).unwrap();
                    assert_eq!(m.get_snapshot().get_metadata().index, 40);
                    assert!(m.get_snapshot().get_data().is_empty());
                } else {
                    assert!(c.header.is_empty());
                }
                whole.extend_from_slice(&c.data);
            }
            assert_eq!(shipped.len(), 16);
            assert_eq!(whole, data);
        }
    }

    #[test]
    fn data_within_a_chunk_or_to_a_peer_without_chunks_goes_whole_in_the_message() {
        let data = Bytes::from(vec![7u8; 300]);
        for (takes_chunks, chunk) in [(true, 300), (true, 1000), (false, 64)] {
            let (shipped, _) = run(&data, takes_chunks, chunk, 0);
            let [Ship::Whole(m)] = &shipped[..] else { panic!("{shipped:?}") };
            assert_eq!(m.get_snapshot().get_data(), &data[..]);
            assert_eq!(m.get_snapshot().get_metadata().index, 40);
        }
    }

    #[test]
    fn a_failed_read_or_a_piece_that_does_not_continue_the_data_ends_the_send() {
        let now = crate::transport::test_epoch();
        let data = Bytes::from(vec![1u8; 200]);
        let mut s = SnapshotSend::new(shard(), message(), true, 64, false, now);
        s.asked(1);
        assert!(matches!(s.on_read(1, Err("disk gone".into()), now), Err(SendError::Read(_))));
        let mut s = SnapshotSend::new(shard(), message(), true, 64, false, now);
        s.asked(1);
        assert!(s.on_read(1, piece_of(&data, 0, 64).map_err(|e| e.to_string()), now).unwrap().is_some());
        s.asked(2);
        // The snapshot on disk was replaced by a longer one between two reads.
        let other = Bytes::from(vec![1u8; 300]);
        let e = s.on_read(2, piece_of(&other, 64, 64).map_err(|e| e.to_string()), now).unwrap_err();
        assert_eq!(e, SendError::Mismatch { offset: 64, got: 64, total: 300 });
        // An answer to a read this send did not ask changes nothing.
        let mut s = SnapshotSend::new(shard(), message(), true, 64, false, now);
        s.asked(5);
        assert!(s.on_read(4, piece_of(&data, 0, 64).map_err(|e| e.to_string()), now).unwrap().is_none());
        assert_eq!(s.next_read(), None, "its own read is still under way");
        assert!(s.stalled(now + SEND_STALL) && !s.stalled(now + SEND_STALL / 2));
    }
}
