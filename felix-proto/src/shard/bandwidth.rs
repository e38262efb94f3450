//! The byte budget of moves (`serve --move-bandwidth`): how fast this broker copies shards to
//! brokers taking them over, so that a rebalance (brokers added, a drain, an operator's moves)
//! leaves the publishers their share of the disks, the network and the CPU.
//!
//! What it counts is what a move sends that live traffic would not: a durable shard's copy
//! (the new owner asks for the next chunk only while there is budget, and the answer's bytes
//! are charged), and a replicated shard's Raft log entries and snapshots sent to a move's
//! target that is not a replica yet (held here in order while the budget is spent, then
//! released as it refills). Heartbeats, votes and everything sent to a group's replicas go as
//! before: a throttled copy never slows a fail-over or the writes of the group it joins.
//!
//! A token bucket that may go into debt: a send is allowed while the balance is positive and
//! charged in full, however large (one copy chunk, one append), so pacing holds for any size
//! without splitting messages; the balance refills at the rate up to one second's worth.
//! Sans-IO: time comes in as `now`.

use std::time::{Duration, Instant};

/// Bytes a move holds back for a throttled target at most, per broker: past it a new Raft
/// append is dropped rather than queued (the leader sends it again; Raft's messages may be
/// lost) so that a slow budget never holds a growing queue in memory.
pub const HELD_BYTES_MAX: u64 = 64 << 20;

/// A byte-rate budget (see the module).
#[derive(Debug, Clone)]
pub struct Bandwidth {
    /// Bytes per second; `None`: unlimited.
    rate: Option<u64>,
    /// The balance in bytes (negative: a debt being paid off).
    balance: i64,
    /// When the balance was last brought up to date.
    at: Option<Instant>,
    /// Bytes charged in all.
    charged: u64,
    /// Times a send was held back or deferred for lack of budget.
    waits: u64,
}

impl Bandwidth {
    /// A budget of `rate` bytes a second (`None` or 0: unlimited).
    pub fn new(rate: Option<u64>) -> Bandwidth {
        Bandwidth { rate: rate.filter(|r| *r > 0), balance: 0, at: None, charged: 0, waits: 0 }
    }

    /// The rate, bytes a second (`None`: unlimited).
    pub fn rate(&self) -> Option<u64> {
        self.rate
    }

    /// Brings the balance up to `now`: the rate for the time passed, at most one second's
    /// worth in hand.
    fn refill(&mut self, now: Instant) {
        let Some(rate) = self.rate else { return };
        let cap = i64::try_from(rate).unwrap_or(i64::MAX);
        match self.at {
            None => self.balance = cap,
            Some(at) => {
                let passed = now.saturating_duration_since(at);
                let earned = u128::from(rate) * passed.as_nanos() / 1_000_000_000;
                let earned = i64::try_from(earned).unwrap_or(i64::MAX);
                self.balance = self.balance.saturating_add(earned).min(cap);
            }
        }
        self.at = Some(now);
    }

    /// Whether a move may send now (the balance is positive, or there is no limit). A `false`
    /// is counted as a wait.
    pub fn may_send(&mut self, now: Instant) -> bool {
        if self.rate.is_none() {
            return true;
        }
        self.refill(now);
        let ok = self.balance > 0;
        if !ok {
            self.waits += 1;
        }
        ok
    }

    /// Charges `bytes` sent (or received, for a copy asked for) by a move.
    pub fn charge(&mut self, bytes: u64, now: Instant) {
        self.charged = self.charged.saturating_add(bytes);
        if self.rate.is_none() {
            return;
        }
        self.refill(now);
        self.balance = self.balance.saturating_sub(i64::try_from(bytes).unwrap_or(i64::MAX));
    }

    /// The largest chunk a copy should ask for: a tenth of a second's worth (at least 16 KiB),
    /// never more than `max`, so a slow budget is paced in small steps, not one long pause
    /// after each megabyte.
    pub fn chunk(&self, max: u32) -> u32 {
        match self.rate {
            None => max,
            Some(r) => u32::try_from((r / 10).max(16 << 10)).unwrap_or(u32::MAX).min(max),
        }
    }

    /// When the balance is positive again (`None`: now, or no limit).
    pub fn ready_at(&self) -> Option<Instant> {
        let (rate, at) = (self.rate?, self.at?);
        if self.balance > 0 {
            return None;
        }
        let owed = u128::from(self.balance.unsigned_abs()) + 1;
        let nanos = owed * 1_000_000_000 / u128::from(rate);
        Some(crate::transport::after(at, Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))))
    }

    /// Bytes charged in all, and times a send waited (metrics).
    pub fn counts(&self) -> (u64, u64) {
        (self.charged, self.waits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unlimited_always_sends_and_still_counts() {
        let t = crate::transport::test_epoch();
        let mut b = Bandwidth::new(None);
        for _ in 0..10 {
            assert!(b.may_send(t));
            b.charge(1 << 30, t);
        }
        assert_eq!(b.counts(), (10 << 30, 0));
        assert_eq!(Bandwidth::new(Some(0)).rate(), None);
        assert_eq!(b.chunk(1 << 20), 1 << 20);
    }

    #[test]
    fn a_budget_paces_any_sizes_to_its_rate() {
        // 1 MB/s, sends of 300 KB asked for every millisecond over ten seconds: about ten
        // megabytes go (one second's worth in hand at the start, one sent into debt at the end).
        let t0 = crate::transport::test_epoch();
        let mut b = Bandwidth::new(Some(1_000_000));
        let mut sent = 0u64;
        for ms in 0..10_000u64 {
            let now = t0 + Duration::from_millis(ms);
            if b.may_send(now) {
                b.charge(300_000, now);
                sent += 300_000;
            }
        }
        assert!((10_000_000..=11_400_000).contains(&sent), "{sent}");
        assert!(b.counts().1 > 9_000);
        // In debt: ready once the debt is paid, not before.
        let end = t0 + Duration::from_secs(10);
        b.charge(500_000, end);
        let ready = b.ready_at().unwrap();
        assert!(ready > end + Duration::from_millis(400), "{:?}", ready - end);
        assert!(!b.may_send(ready - Duration::from_millis(5)));
        assert!(b.may_send(ready + Duration::from_millis(1)));
        assert_eq!(b.ready_at(), None);
    }

    #[test]
    fn an_idle_budget_keeps_at_most_one_second_in_hand() {
        let t0 = crate::transport::test_epoch();
        let mut b = Bandwidth::new(Some(100_000));
        assert!(b.may_send(t0));
        // An hour idle: still one second's worth, so two 100 KB sends at once leave a debt.
        let later = t0 + Duration::from_secs(3600);
        assert!(b.may_send(later));
        b.charge(100_000, later);
        assert!(!b.may_send(later));
        assert_eq!(b.chunk(1 << 20), 16 << 10);
        assert_eq!(Bandwidth::new(Some(100 << 20)).chunk(1 << 20), 1 << 20);
    }
}
