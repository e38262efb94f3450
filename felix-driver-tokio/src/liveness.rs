//! Telling a peer that went silent from a live one, sooner and more surely than QUIC's idle
//! timeout does.
//!
//! QUIC's idle timeout is at least three probe timeouts (RFC 9000 §10.1), and the probe
//! timeout follows the smoothed round trip. A process that was stopped (SIGSTOP, a VM paused,
//! a long GC-like stall) and resumed reads, from its socket buffer, acknowledgements that
//! waited there for the whole pause: each is a round-trip sample as long as the pause. By RFC
//! 9002's arithmetic one 17 s sample takes a loopback link's smoothed round trip to about 2 s
//! and its probe timeout to about 19 s, so the idle timeout to most of a minute. In the fault
//! that showed it, the peer had dropped the connection after 2 s, but the stopped side sent
//! nothing more on it (its congestion window full of packets not yet declared lost), so it
//! drew no stateless reset: the link stayed "up" and carried nothing until its next probe, 19 s
//! after it resumed, and two brokers could not elect a leader over it meanwhile. A relay that
//! delays a peer's answers 1.6 s and then drops everything reproduces it: QUIC alone held the
//! link 8.8 s (`cluster::link_tests`). Counting datagrams received depends on none of that.

use std::time::Duration;

/// Checks per `after`: a connection is judged silent only after this many checks in a row
/// saw nothing arrive.
const CHECKS: u32 = 8;

/// Returns once nothing arrived on `quic` for `after` (the time it was silent), or `None`
/// if the connection closed first.
///
/// Silence counts only over `CHECKS` checks in a row, each an eighth of `after` apart: a
/// process that was not scheduled for a while wakes to a full socket buffer, and its first
/// check, before the datagrams waiting there are read, must not mistake its own pause for the
/// peer's.
pub(crate) async fn silence(quic: &quinn::Connection, after: Duration) -> Option<Duration> {
    let mut tick = tokio::time::interval((after / CHECKS).max(Duration::from_millis(5)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut watch = Watch::new(quic.stats().udp_rx.datagrams, tokio::time::Instant::now());
    let closed = quic.closed();
    tokio::pin!(closed);
    loop {
        tokio::select! {
            _ = &mut closed => return None,
            _ = tick.tick() => {}
        }
        let now = tokio::time::Instant::now();
        if let Some(silent) = watch.check(quic.stats().udp_rx.datagrams, now, after) {
            return Some(silent);
        }
    }
}

/// The count of datagrams received as last seen, when it last changed, and how many checks
/// in a row saw it unchanged.
#[derive(Debug, Clone, Copy)]
struct Watch {
    seen: u64,
    heard: tokio::time::Instant,
    quiet_checks: u32,
}

impl Watch {
    fn new(seen: u64, now: tokio::time::Instant) -> Watch {
        Watch { seen, heard: now, quiet_checks: 0 }
    }

    /// One check: `received` datagrams so far at `now`. `Some(silence)` when nothing arrived
    /// for `after` and over `CHECKS` checks in a row.
    fn check(&mut self, received: u64, now: tokio::time::Instant, after: Duration) -> Option<Duration> {
        if received != self.seen {
            *self = Watch::new(received, now);
            return None;
        }
        self.quiet_checks = self.quiet_checks.saturating_add(1);
        let silent = now.saturating_duration_since(self.heard);
        (self.quiet_checks >= CHECKS && silent >= after).then_some(silent)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AFTER: Duration = Duration::from_secs(2);

    #[test]
    fn silent_only_after_the_whole_time_and_every_check_in_a_row() {
        let t0 = tokio::time::Instant::now();
        let mut w = Watch::new(10, t0);
        // Seven quiet checks reaching past `after` (the process was stopped, then checked at
        // once): not yet.
        for i in 1..CHECKS {
            assert_eq!(w.check(10, t0 + AFTER * i, AFTER), None, "check {i}");
        }
        // The eighth.
        assert_eq!(w.check(10, t0 + AFTER * CHECKS, AFTER), Some(AFTER * CHECKS));
    }

    #[test]
    fn a_datagram_starts_the_silence_over() {
        let t0 = tokio::time::Instant::now();
        let step = AFTER / CHECKS;
        let mut w = Watch::new(0, t0);
        for i in 1..=CHECKS * 3 {
            // Something arrives every eighth check (seven quiet ones between): never silent.
            let received = u64::from(i / CHECKS);
            assert_eq!(w.check(received, t0 + step * i, AFTER), None, "check {i}");
        }
        // Then nothing: silent after eight quiet checks covering `after`.
        let from = t0 + step * (CHECKS * 3);
        let received = 3;
        let mut judged = None;
        for i in 1..=CHECKS {
            judged = w.check(received, from + step * i, AFTER);
            assert_eq!(judged.is_some(), i == CHECKS, "check {i}");
        }
        assert!(judged.is_some_and(|s| s >= AFTER), "{judged:?}");
    }

    #[test]
    fn quick_checks_alone_do_not_make_a_silence() {
        let t0 = tokio::time::Instant::now();
        let mut w = Watch::new(0, t0);
        // A hundred checks a millisecond apart: many in a row, but not `after` long.
        for i in 1..=100 {
            assert_eq!(w.check(0, t0 + Duration::from_millis(i), AFTER), None);
        }
    }
}
