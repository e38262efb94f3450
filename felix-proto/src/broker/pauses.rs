//! Why a control stream is not being read: the reasons, and the set of them whose first and
//! last decide when reading stops and resumes.

/// A reason to stop reading a control stream's requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(super) enum Pause {
    /// As many publish answers are owed as the stream's window allows.
    Window = 1,
    /// A shard it publishes to has too much waiting for storage.
    Storage = 2,
    /// Answers written to it are not flushed yet: a client that sends requests and does not
    /// read the answers is slowed by QUIC flow control, not buffered for.
    Flush = 4,
    /// Its tenant is over its publish rate: nothing more is read until the tenant is back
    /// under, so QUIC flow control slows the publisher at its source instead of the broker
    /// reading (and decrypting) what it would refuse.
    Rate = 8,
    /// An ephemeral shard it publishes to has a subscriber whose queue is over half full
    /// (`Hold`).
    Subscribers = 16,
}

/// The set of reasons a stream is paused. Reading stops when the first reason appears and
/// resumes when the last goes, so the driver sees exactly one `PauseReading` and one
/// `ResumeReading` per pause, however many reasons overlap.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Pauses(u8);

impl Pauses {
    pub(super) fn any(self) -> bool {
        self.0 != 0
    }

    pub(super) fn has(self, p: Pause) -> bool {
        self.0 & p as u8 != 0
    }

    /// Adds `p`. True when reading was running until now: the caller owes a `PauseReading`.
    pub(super) fn add(&mut self, p: Pause) -> bool {
        let was_reading = self.0 == 0;
        self.0 |= p as u8;
        was_reading
    }

    /// Removes `p`. True when it was the last reason: the caller owes a `ResumeReading`.
    pub(super) fn remove(&mut self, p: Pause) -> bool {
        if !self.has(p) {
            return false;
        }
        self.0 &= !(p as u8);
        self.0 == 0
    }
}
