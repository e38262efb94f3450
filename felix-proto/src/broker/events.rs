//! What handling one input asks of the rest of the broker, as typed events run in the order
//! they were raised once that input's own work is done.
//!
//! A frame is handled with its control stream out of the connection's table
//! ([`Broker::drive_stream`]), so work that reaches other control streams (answering a group's
//! parked polls, reading a held publisher again) cannot run in the middle of it: the stream in
//! hand might be one of them. Such work is raised here instead, as quinn-proto's connections
//! raise endpoint events, and [`Broker::run_events`] carries it out at the end of every input
//! that can raise any, first raised first run, including what the events themselves raise (a
//! resumed stream's frames may end another hold). One queue for every kind, so nothing raised
//! late waits for the next input because its kind's runner already ran (which a wake-up raised
//! by a stream resumed on a timer used to), and the order of the outputs is the order of the
//! causes.

use super::*;

/// See the [module](self).
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Event {
    /// Connection → node: a group of this shard may hand a record to its parked polls now (a
    /// `group_nack` made one visible again); answered once the nack's own answer is out.
    GroupsMayTake(Key, u32),
    /// Connection → node: a subscriber that held this shard's publishers drained under a
    /// quarter of its queue, or went: the hold ends unless another subscriber still holds it.
    HoldMayEnd(Key, u32),
    /// Node → connection: the last pause of this control stream went with the shard that
    /// caused it (its stream was deleted): read it again.
    Resume(ConnId, StreamId),
}

/// The events raised and not yet run.
#[derive(Debug, Default)]
pub(super) struct Events(VecDeque<Event>);

impl Events {
    pub(super) fn raise(&mut self, e: Event) {
        self.0.push_back(e);
    }

    /// Whether any is waiting: a hold may end or a stream be read again at once.
    pub(super) fn pending(&self) -> bool {
        !self.0.is_empty()
    }

    fn next(&mut self) -> Option<Event> {
        self.0.pop_front()
    }
}

impl Broker {
    /// Runs every event raised (and every event those raise) in the order raised. Called at
    /// the end of each input that may raise one, with no control stream out of its table.
    pub(super) fn run_events(&mut self, now: Instant) {
        while let Some(e) = self.events.next() {
            match e {
                Event::GroupsMayTake(k, shard) => self.wake_groups(&k, shard, now),
                Event::HoldMayEnd(k, shard) => self.release(&k, shard, now),
                Event::Resume(conn, stream) => self.drive_stream(conn, stream, now),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn events_run_first_raised_first() {
        let mut q = Events::default();
        assert!(!q.pending());
        let k = key("t", "n", "s");
        q.raise(Event::HoldMayEnd(k.clone(), 1));
        q.raise(Event::GroupsMayTake(k.clone(), 0));
        q.raise(Event::Resume(ConnId(3), StreamId(4)));
        assert!(q.pending());
        assert_eq!(q.next(), Some(Event::HoldMayEnd(k.clone(), 1)));
        assert_eq!(q.next(), Some(Event::GroupsMayTake(k, 0)));
        assert_eq!(q.next(), Some(Event::Resume(ConnId(3), StreamId(4))));
        assert_eq!(q.next(), None);
        assert!(!q.pending());
    }
}
