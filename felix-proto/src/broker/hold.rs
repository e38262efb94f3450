//! Holding an ephemeral shard's publishers for a slow subscriber.
//!
//! A stream kept in memory has no log to send a lagging subscriber back to: what overflows its
//! queue is gone. So when a live subscriber's queue passes half full, the broker stops reading
//! the control streams that publish to the shard ([`Pause::Subscribers`]) and QUIC flow control
//! slows the publishers at their source; they are read again once every holding queue is back
//! under a quarter. On a small machine this is what keeps an unacked publisher from starving
//! its own subscriber of CPU and then dropping its records: held, it yields the core.
//!
//! The hold is bounded ([`BrokerConfig::publisher_hold_max`]): a subscriber that keeps its
//! queue over a quarter for that long (stopped, or far slower than the publishers) is
//! *excused* and left behind, losing what overflows its queue, rather than stalling every other
//! subscriber of the shard. It holds no one again until its queue drains under a quarter.
//! Publishes forwarded by another broker are not held (the forwarding peer's stream carries
//! other shards' publishes too); durable shards never hold, their subscribers read on from
//! the log.

use super::*;

impl Broker {
    /// A fan-out left a subscriber over half full: the shard holds from now, if it did not
    /// already.
    pub(super) fn start_hold(&mut self, k: &Key, shard: u32, now: Instant) {
        let Some(sh) = self.node.streams.get_mut(k).and_then(|e| e.shards.get_mut(shard as usize)) else { return };
        if sh.hold.is_some() {
            return;
        }
        let deadline = crate::transport::after(now, self.cfg.publisher_hold_max);
        sh.hold = Some(Hold { deadline, streams: Vec::new() });
        self.timers.holds.insert((deadline, k.clone(), shard));
    }

    /// A publish to `k`/`shard` was just fanned out on `st`: if the shard holds, this stream
    /// is not read again until the hold ends.
    pub(super) fn hold_publisher(&mut self, conn: ConnId, st: &mut CtlStream, k: &Key, shard: u32) {
        let Some(hold) =
            self.node.streams.get_mut(k).and_then(|e| e.shards.get_mut(shard as usize)).and_then(|s| s.hold.as_mut())
        else {
            return;
        };
        if st.pauses.has(Pause::Subscribers) {
            return;
        }
        hold.streams.push((conn, st.id));
        self.stats.publishers_held += 1;
        if st.pause(Pause::Subscribers) {
            self.out.push_back(BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream: st.id }));
        }
    }

    /// A shard is going away (its stream deleted): the streams it paused, for its storage or
    /// for its subscribers, are let go (read again once the caller's input is handled), or
    /// they would stay paused with nothing left to resume them.
    pub(super) fn let_go_of(&mut self, k: &Key, shard: u32, paused: Vec<(ConnId, StreamId)>, hold: Option<Hold>) {
        let held = hold.map(|h| {
            self.timers.holds.remove(&(h.deadline, k.clone(), shard));
            h.streams
        });
        let storage = paused.into_iter().map(|s| (s, Pause::Storage));
        for ((conn, sid), why) in storage.chain(held.into_iter().flatten().map(|s| (s, Pause::Subscribers))) {
            if let Some(st) = self.conns.get_mut(&conn).and_then(|c| c.streams.get_mut(&sid))
                && st.pauses.remove(why)
            {
                st.resume_owed = true;
                self.events.raise(events::Event::Resume(conn, sid));
            }
        }
    }

    /// Holds past their deadline: the subscribers still holding are excused, and the
    /// publishers go on.
    pub(super) fn expire_holds(&mut self, now: Instant) {
        while let Some((at, k, shard)) = self.timers.holds.first().cloned()
            && at <= now
        {
            self.timers.holds.pop_first();
            let Some(sh) = self.node.streams.get(&k).and_then(|e| e.shards.get(shard as usize)) else { continue };
            if sh.hold.as_ref().is_none_or(|h| h.deadline != at) {
                continue;
            }
            for &(conn, id) in &sh.subs {
                if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id))
                    && sub.holding
                {
                    sub.holding = false;
                    sub.excused = true;
                    self.stats.subscribers_excused += 1;
                }
            }
            self.release(&k, shard, now);
        }
        self.run_events(now);
    }

    /// Ends `k`/`shard`'s hold unless one of its subscribers still holds it.
    pub(super) fn release(&mut self, k: &Key, shard: u32, now: Instant) {
        let Some(sh) = self.node.streams.get_mut(k).and_then(|e| e.shards.get_mut(shard as usize)) else { return };
        let conns = &self.conns;
        let still =
            sh.subs.iter().any(|(conn, id)| conns.get(conn).and_then(|c| c.subs.get(id)).is_some_and(|s| s.holding));
        if still {
            return;
        }
        let Some(hold) = sh.hold.take() else { return };
        self.timers.holds.remove(&(hold.deadline, k.clone(), shard));
        for (conn, sid) in hold.streams {
            let Some(st) = self.conns.get_mut(&conn).and_then(|c| c.streams.get_mut(&sid)) else { continue };
            if st.pauses.remove(Pause::Subscribers) {
                st.resume_owed = true;
                self.drive_stream(conn, sid, now);
            }
        }
    }
}
