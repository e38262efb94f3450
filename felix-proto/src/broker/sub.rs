//! A subscription (or cache watch) and its lifecycle.
//!
//! ```text
//!            subscribe (start behind the tail of a durable shard)
//!   opening ───────────────────────────────► catching up ──caught up──► live
//!      │ (start at the tail, or a watch)          │ ▲ reading             │
//!      └────────────────────────────────────────────────────────────────► │
//!                  end (lagged, deleted, moved) from any phase            ▼
//!                                                                      ending ──► gone
//! ```
//!
//! *Opening* is not a phase of its own: it is `stream == None`, and the subscription is
//! otherwise in whichever phase it starts in (nothing is written until the driver opens the
//! stream). An ending after a shard move keeps delivering the history up to the move (the
//! `resume_from` it announces is the shard's tail); an ending after a deletion drops it.

use super::Key;
use super::log::Shape;
use super::watch::WatchFilter;
use crate::message;
use crate::negotiate::ClientOffer;
use crate::transport::{ReadToken, StreamId};
use bytes::Bytes;
use std::collections::VecDeque;

/// Why a subscription ends; decides its terminal message.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Ending {
    /// Its queue overflowed: `subscription_lagged`.
    Lagged { resume_from: u64 },
    /// A watch's queue overflowed: `cache_watch_lagged`.
    WatchLagged { resume_from: u64 },
    /// The shard moved to another broker: `shard_moved`.
    Moved(message::ShardMoved),
    /// The stream was deleted: `stream_deleted`.
    Deleted,
    /// The credential it was opened with expired (`expired`) or was revoked: a final `error`
    /// code `revoked` (to a client that offered codes; the stream simply ends for others).
    Revoked { expired: bool },
}

/// Delivering history from the log before anything live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct CatchUp {
    /// The next offset to deliver.
    pub cursor: u64,
    /// History below the memory window was asked of storage and has not come back.
    pub reading: Option<ReadToken>,
}

/// Where a subscription is in its life.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum Phase {
    /// Delivering history from the log; live batches are read from the log too, not queued.
    CatchingUp(CatchUp),
    /// Fed by fan-out through its queue.
    Live,
    /// Writes what it still owes (its queue, and after a move its history up to the move),
    /// then its terminal message, then finishes its stream.
    Ending { why: Ending, catch_up: Option<CatchUp> },
}

/// What happens to a subscription; [`Sub::on`] is the one place its phase changes.
#[derive(Debug)]
pub(super) enum SubEvent {
    /// History was asked of storage with this token.
    Reading(CatchUp),
    /// History was delivered (or skipped) up to `cursor`, nothing is being read.
    Delivered { cursor: u64 },
    /// The log has nothing more from the cursor: from here on it is fed live.
    CaughtUp,
    /// It has to end. The first reason wins.
    End(Ending),
}

#[derive(Debug)]
pub(super) struct Sub {
    pub id: u64,
    pub key: Key,
    pub shard: u32,
    /// Its event stream; `None` while the driver opens it.
    pub stream: Option<StreamId>,
    pub shape: Shape,
    pub offer: ClientOffer,
    pub queue: VecDeque<[Bytes; 2]>,
    /// Bytes of the frames in `queue`.
    pub queued_bytes: usize,
    pub capacity: usize,
    /// Bytes written to its stream and not yet reported flushed.
    pub inflight: usize,
    pub phase: Phase,
    /// A cache watch (its key is the cache's): what it follows.
    pub watch: Option<WatchFilter>,
    /// Records its full queue dropped (diagnostics).
    pub dropped: u64,
    /// The offset after the last batch offered to it (queued or dropped), on a stream with
    /// offsets (diagnostics).
    pub offered: Option<u64>,
    /// Its queue passed half full on an ephemeral shard: the shard's publishers are held until
    /// it is back under a quarter.
    pub holding: bool,
    /// It held the publishers as long as allowed: it holds no one again until its queue is
    /// back under a quarter.
    pub excused: bool,
    /// Its filter on record keys (D57), shared with every subscription that has the same one
    /// (interned by the broker, so fan-out judges a batch once per distinct filter).
    pub filter: Option<std::sync::Arc<message::KeyFilter>>,
    /// Offsets its filter passed over since the last batch it was sent (and the records no
    /// batch holds before them): the next batch's `skipped_before` says so.
    pub filtered: u64,
}

impl Sub {
    /// A subscription that catches up from `from` first, or is live at once.
    pub fn new(id: u64, key: Key, shard: u32, shape: Shape, offer: ClientOffer, from: Option<u64>) -> Sub {
        Sub {
            id,
            key,
            shard,
            stream: None,
            shape,
            offer,
            queue: VecDeque::new(),
            queued_bytes: 0,
            capacity: 0,
            inflight: 0,
            phase: match from {
                Some(cursor) => Phase::CatchingUp(CatchUp { cursor, reading: None }),
                None => Phase::Live,
            },
            watch: None,
            dropped: 0,
            offered: None,
            holding: false,
            excused: false,
            filter: None,
            filtered: 0,
        }
    }

    /// Whether its filter lets a batch with this key through (no filter: every batch).
    pub fn wants(&self, key: Option<&Bytes>) -> bool {
        self.filter.as_ref().is_none_or(|f| f.matches(key.map(|k| &k[..])))
    }

    /// The one transition function.
    pub fn on(&mut self, ev: SubEvent) {
        let phase = std::mem::replace(&mut self.phase, Phase::Live);
        self.phase = match (phase, ev) {
            (Phase::CatchingUp(_), SubEvent::Reading(c)) => Phase::CatchingUp(c),
            (Phase::Ending { why, catch_up: Some(_) }, SubEvent::Reading(c)) => {
                Phase::Ending { why, catch_up: Some(c) }
            }
            (Phase::CatchingUp(_), SubEvent::Delivered { cursor }) => {
                Phase::CatchingUp(CatchUp { cursor, reading: None })
            }
            (Phase::Ending { why, catch_up: Some(_) }, SubEvent::Delivered { cursor }) => {
                Phase::Ending { why, catch_up: Some(CatchUp { cursor, reading: None }) }
            }
            (Phase::CatchingUp(_), SubEvent::CaughtUp) => Phase::Live,
            (Phase::Ending { why, .. }, SubEvent::CaughtUp) => Phase::Ending { why, catch_up: None },
            (Phase::CatchingUp(c), SubEvent::End(why)) => {
                // After a move, the history up to the move is still owed; after a deletion
                // there is none.
                let keep = matches!(why, Ending::Moved(_));
                Phase::Ending { why, catch_up: keep.then_some(c) }
            }
            (Phase::Live, SubEvent::End(why)) => Phase::Ending { why, catch_up: None },
            (Phase::Ending { why, catch_up }, SubEvent::End(later)) => {
                // The first reason stands; a deletion still drops the history a move kept.
                let catch_up = catch_up.filter(|_| later != Ending::Deleted);
                Phase::Ending { why, catch_up }
            }
            // Events that do not apply to the phase (a late read for a subscription that
            // caught up some other way) change nothing.
            (phase, _) => phase,
        };
    }

    /// Its catch-up, if it is catching up (also while ending after a move).
    pub fn catch_up(&self) -> Option<CatchUp> {
        match &self.phase {
            Phase::CatchingUp(c) | Phase::Ending { catch_up: Some(c), .. } => Some(*c),
            _ => None,
        }
    }

    /// Fed by fan-out: live and not ending.
    pub fn live(&self) -> bool {
        matches!(self.phase, Phase::Live)
    }

    pub fn ending(&self) -> bool {
        matches!(self.phase, Phase::Ending { .. })
    }

    /// Whether a frame of `len` bytes would overflow the queue: `capacity` batches, or
    /// `bytes_max` bytes (an empty queue takes any one frame).
    pub fn full(&self, len: usize, bytes_max: usize) -> bool {
        self.queue.len() >= self.capacity || (!self.queue.is_empty() && self.queued_bytes + len > bytes_max)
    }

    /// Over half its queue (in batches, or in bytes of `bytes_max`): time to hold publishers.
    pub fn over_half(&self, bytes_max: usize) -> bool {
        self.queue.len() * 2 >= self.capacity.max(2) || self.queued_bytes * 2 >= bytes_max
    }

    /// Under a quarter of its queue: publishers held for it may go on.
    pub fn under_quarter(&self, bytes_max: usize) -> bool {
        self.queue.len() * 4 <= self.capacity && self.queued_bytes * 4 <= bytes_max
    }

    pub fn push(&mut self, frame: [Bytes; 2]) {
        self.queued_bytes += frame_len(&frame);
        self.queue.push_back(frame);
    }
}

/// Bytes of an event frame held as header and body.
pub(super) fn frame_len(frame: &[Bytes; 2]) -> usize {
    frame[0].len() + frame[1].len()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sub(from: Option<u64>) -> Sub {
        let key: Key = super::super::key("t", "n", "s");
        let offer = ClientOffer {
            negotiating: false,
            flags: Default::default(),
            flags_hi: Default::default(),
            features: Default::default(),
            extended: false,
        };
        Sub::new(1, key, 0, Shape::default(), offer, from)
    }

    fn moved() -> Ending {
        Ending::Moved(message::ShardMoved {
            subscription_id: 1,
            resume_from: Some(10),
            node_id: None,
            addr: None,
            generation: 2,
        })
    }

    #[test]
    fn catching_up_reads_then_goes_live() {
        let mut s = sub(Some(3));
        assert_eq!(s.catch_up(), Some(CatchUp { cursor: 3, reading: None }));
        assert!(!s.live());
        s.on(SubEvent::Reading(CatchUp { cursor: 3, reading: Some(ReadToken(7)) }));
        assert_eq!(s.catch_up().and_then(|c| c.reading), Some(ReadToken(7)));
        s.on(SubEvent::Delivered { cursor: 8 });
        assert_eq!(s.catch_up(), Some(CatchUp { cursor: 8, reading: None }));
        s.on(SubEvent::CaughtUp);
        assert!(s.live() && s.catch_up().is_none());
        // Catch-up events after it is live change nothing.
        s.on(SubEvent::Delivered { cursor: 99 });
        assert!(s.live());
    }

    #[test]
    fn a_move_keeps_the_history_a_deletion_drops_it() {
        let mut s = sub(Some(3));
        s.on(SubEvent::End(moved()));
        assert!(s.ending() && !s.live());
        assert_eq!(s.catch_up().map(|c| c.cursor), Some(3), "history up to the move still owed");
        s.on(SubEvent::Delivered { cursor: 10 });
        assert_eq!(s.catch_up().map(|c| c.cursor), Some(10));
        s.on(SubEvent::CaughtUp);
        assert!(s.ending() && s.catch_up().is_none());

        let mut s = sub(Some(3));
        s.on(SubEvent::End(Ending::Deleted));
        assert!(s.ending() && s.catch_up().is_none(), "nothing more to read");
    }

    #[test]
    fn the_first_reason_to_end_stands() {
        let mut s = sub(None);
        s.on(SubEvent::End(Ending::Lagged { resume_from: 4 }));
        s.on(SubEvent::End(Ending::Deleted));
        assert_eq!(s.phase, Phase::Ending { why: Ending::Lagged { resume_from: 4 }, catch_up: None });

        let mut s = sub(Some(0));
        s.on(SubEvent::End(moved()));
        s.on(SubEvent::End(Ending::Deleted));
        assert!(matches!(&s.phase, Phase::Ending { why: Ending::Moved(_), catch_up: None }));
    }
}
