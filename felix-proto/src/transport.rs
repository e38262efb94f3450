//! The transport vocabulary shared by the state machines and their drivers: QUIC stream ids,
//! connection ids, the tokens that name a stream opening, a write or a read until the driver
//! reports it, close codes, and the clock the caller passes in. (Named for what it describes;
//! the crate itself does no IO.)

use std::time::{Duration, Instant};

/// A QUIC stream id (the transport's own number). The two low bits say who opened it and
/// whether it is bidirectional, exactly as in QUIC (RFC 9000 §2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct StreamId(pub u64);

/// Which side opened a stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Side {
    /// The client.
    Client,
    /// The broker.
    Broker,
}

/// Stream direction.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Dir {
    /// Both sides send.
    Bi,
    /// Only the opener sends.
    Uni,
}

impl StreamId {
    /// The stream id `index` of the given kind (QUIC numbering).
    pub const fn new(initiator: Side, dir: Dir, index: u64) -> StreamId {
        let side = match initiator {
            Side::Client => 0,
            Side::Broker => 1,
        };
        let d = match dir {
            Dir::Bi => 0,
            Dir::Uni => 2,
        };
        StreamId(index << 2 | d | side)
    }
    /// Who opened it.
    pub const fn initiator(self) -> Side {
        if self.0 & 1 == 0 { Side::Client } else { Side::Broker }
    }
    /// Its direction.
    pub const fn dir(self) -> Dir {
        if self.0 & 2 == 0 { Dir::Bi } else { Dir::Uni }
    }
    /// Its index among streams of the same kind.
    pub const fn index(self) -> u64 {
        self.0 >> 2
    }
}

/// A connection, as the broker numbers them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ConnId(pub u64);

/// Names a stream the core asked the driver to open, until the driver says which id it got.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct OpenToken(pub u64);

/// Names a storage write until the driver reports its outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WriteToken(pub u64);

/// Names a history read until the driver returns its records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ReadToken(pub u64);

/// QUIC application error codes the protocol uses when it closes a connection or a stream.
pub mod close_code {
    /// The broker is shutting down.
    pub const SHUTDOWN: u64 = 0;
    /// No stream authenticated in time.
    pub const AUTH_TIMEOUT: u64 = 1;
    /// A fatal framing error (bad magic, bad version, oversized frame).
    pub const PROTOCOL_VIOLATION: u64 = 2;
    /// A stream was abandoned (reset / stop-sending) by the protocol.
    pub const STREAM_CLOSED: u64 = 3;
}

/// Converts a monotonic `Instant` into wall-clock microseconds, anchored once by the caller.
/// The core never reads a clock: the driver gives it one pair `(Instant, unix micros)` at start.
#[derive(Debug, Clone, Copy)]
pub struct WallClock {
    anchor: Instant,
    anchor_micros: u64,
}

impl WallClock {
    /// Anchors wall time `unix_micros` at `at`.
    pub fn new(at: Instant, unix_micros: u64) -> WallClock {
        WallClock { anchor: at, anchor_micros: unix_micros }
    }
    /// The instant the wall clock was anchored at.
    pub fn anchor(&self) -> Instant {
        self.anchor
    }
    /// The instant wall time reads `unix_micros` (the anchor for earlier times).
    pub fn instant_at(&self, unix_micros: u64) -> Instant {
        self.anchor + std::time::Duration::from_micros(unix_micros.saturating_sub(self.anchor_micros))
    }
    /// Wall time at `now`, in microseconds since the Unix epoch.
    pub fn micros(&self, now: Instant) -> u64 {
        let d = now.saturating_duration_since(self.anchor);
        self.anchor_micros.saturating_add(u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
    }
}

/// Keeps `now` monotonic whatever the caller passes (the core clamps rather than panics).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Clock {
    last: Option<Instant>,
}

impl Clock {
    pub(crate) fn new() -> Clock {
        Clock { last: None }
    }
    pub(crate) fn last(&self) -> Option<Instant> {
        self.last
    }
    pub(crate) fn advance(&mut self, now: Instant) -> Instant {
        let now = match self.last {
            Some(l) if l > now => l,
            _ => now,
        };
        self.last = Some(now);
        now
    }
}

/// Adds a duration, saturating at a far future instead of panicking on overflow.
pub(crate) fn after(now: Instant, d: Duration) -> Instant {
    now.checked_add(d).unwrap_or(now + Duration::from_secs(86_400 * 365))
}

/// Test-only: an arbitrary starting instant. The only clock reading in this crate, and it is
/// compiled for unit tests alone.
#[cfg(test)]
#[allow(clippy::disallowed_methods)]
pub(crate) fn test_epoch() -> Instant {
    Instant::now()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quic_stream_numbering() {
        assert_eq!(StreamId::new(Side::Client, Dir::Bi, 0), StreamId(0));
        assert_eq!(StreamId::new(Side::Broker, Dir::Bi, 0), StreamId(1));
        assert_eq!(StreamId::new(Side::Client, Dir::Uni, 0), StreamId(2));
        assert_eq!(StreamId::new(Side::Broker, Dir::Uni, 1), StreamId(7));
        let s = StreamId(7);
        assert_eq!((s.initiator(), s.dir(), s.index()), (Side::Broker, Dir::Uni, 1));
    }

    #[test]
    fn clock_never_goes_back() {
        let t0 = test_epoch();
        let mut c = Clock::new();
        assert_eq!(c.advance(t0 + Duration::from_secs(2)), t0 + Duration::from_secs(2));
        assert_eq!(c.advance(t0), t0 + Duration::from_secs(2));
    }
}
