//! Idempotent producers: per shard, per producer, the next expected sequence and where the last
//! batches landed, so a retried batch is appended once and answered with the original offset.
//!
//! Durable shards keep this state in the log itself (each batch carries its producer id and
//! sequence), so a restart rebuilds it from the recovered batches. See REFERENCE §10.3.

use crate::transport::WriteToken;
use std::collections::{BTreeMap, HashMap};

/// Sequences remembered per producer: the last `WINDOW` below its next expected one. A producer
/// keeps at most this many unanswered (`client::producer::MAX_IN_FLIGHT`, the same number), so
/// every batch it may resend is one this table can answer.
pub(crate) const WINDOW: u64 = crate::client::producer::MAX_IN_FLIGHT;
/// Producers remembered per shard; the least recently used goes first beyond it.
pub(crate) const MAX_PRODUCERS: usize = 4096;

/// Where a remembered batch landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Landed {
    base: u64,
    end: u64,
    digest: u64,
    /// The write is still going to storage (a duplicate waits for it).
    pending: Option<WriteToken>,
    /// The write failed: the batch is not in the log, and a resend appends it.
    failed: bool,
}

#[derive(Debug, Clone, Default)]
struct Producer {
    next: u64,
    /// Sequences in `[next - WINDOW, next)` that landed (or are landing), by sequence. Keyed
    /// by sequence rather than by arrival, so that a resent batch that failed long ago, or a
    /// log recovered in an order other than sequence order, cannot push out a sequence the
    /// producer may still resend.
    window: BTreeMap<u64, Landed>,
    last_used: u64,
    /// The highest sequence whose batch retention removed: an absent sequence at or below it
    /// may have landed, so it is expired rather than appended.
    forgotten_through: Option<u64>,
}

impl Producer {
    /// Drops what fell below the window.
    fn slide(&mut self) {
        let floor = self.next.saturating_sub(WINDOW);
        while let Some(e) = self.window.first_entry() {
            if *e.key() >= floor || e.get().pending.is_some() {
                break;
            }
            e.remove();
        }
    }
}

/// What to do with an incoming idempotent batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Append it (a new sequence, or the resend of one whose write failed or that never landed).
    Append,
    /// Already in the log at `base` (or on its way there: wait for `pending`).
    Duplicate { base: u64, pending: Option<WriteToken> },
    /// A remembered sequence with different payloads.
    Reused,
    /// Older than the remembered window: cannot tell whether it landed.
    Expired,
    /// Past the next expected sequence.
    Gap { expected: u64 },
    /// No state for this producer and the sequence is not 0.
    Unknown,
}

/// The producers of one shard.
#[derive(Debug, Default)]
pub(crate) struct Producers {
    map: HashMap<u64, Producer>,
    tick: u64,
}

impl Producers {
    /// Decides what an incoming batch is, without changing anything.
    pub fn check(&self, id: u64, sequence: u64, digest: u64) -> Verdict {
        let Some(p) = self.map.get(&id) else {
            return if sequence == 0 { Verdict::Append } else { Verdict::Unknown };
        };
        if sequence == p.next {
            return Verdict::Append;
        }
        if sequence > p.next {
            return Verdict::Gap { expected: p.next };
        }
        match p.window.get(&sequence) {
            Some(l) if l.failed => Verdict::Append,
            Some(l) if l.digest == digest => Verdict::Duplicate { base: l.base, pending: l.pending },
            Some(_) => Verdict::Reused,
            None if sequence + WINDOW < p.next => Verdict::Expired,
            None if p.forgotten_through.is_some_and(|f| sequence <= f) => Verdict::Expired,
            // Inside the window and absent: every batch of it that landed is remembered, so this
            // one never landed (its write failed before a restart forgot the failure).
            None => Verdict::Append,
        }
    }

    /// Records an appended batch `[base, end)`.
    pub fn appended(&mut self, id: u64, sequence: u64, digest: u64, base: u64, end: u64, pending: Option<WriteToken>) {
        self.tick += 1;
        if !self.map.contains_key(&id) && self.map.len() >= MAX_PRODUCERS {
            // Forget the coldest producer (its next batch other than sequence 0 is refused
            // `unknown_producer`, as the spec says). Ticks are unique, so the choice does not
            // depend on the map's order.
            if let Some(cold) = self.map.iter().min_by_key(|(_, p)| p.last_used).map(|(k, _)| *k) {
                self.map.remove(&cold);
            }
        }
        let p = self.map.entry(id).or_default();
        p.last_used = self.tick;
        p.next = p.next.max(sequence + 1);
        if sequence + WINDOW >= p.next {
            p.window.insert(sequence, Landed { base, end, digest, pending, failed: false });
        }
        p.slide();
    }

    /// A write settled: a landed batch is final, a failed one may be sent again.
    pub fn settled(&mut self, id: u64, sequence: u64, ok: bool) {
        if let Some(p) = self.map.get_mut(&id) {
            if let Some(l) = p.window.get_mut(&sequence) {
                l.pending = None;
                l.failed = !ok;
            }
            p.slide();
        }
    }

    /// Retention moved the shard's start: forget batches wholly below it, and producers with
    /// none left. Returns `(producer, forgotten_through)` for each producer still remembered whose
    /// watermark moved: storage must keep these, since after a restart nothing else says that
    /// those sequences landed (see [`restore_forgotten`](Self::restore_forgotten)). Sorted, so the
    /// output does not depend on the map's order.
    pub fn retain_from(&mut self, start: u64) -> Vec<(u64, u64)> {
        let mut moved = Vec::new();
        self.map.retain(|&id, p| {
            let gone: Vec<u64> =
                p.window.iter().filter(|(_, l)| l.end <= start && l.pending.is_none()).map(|(s, _)| *s).collect();
            for s in &gone {
                p.window.remove(s);
            }
            if let Some(&last) = gone.last() {
                let through = p.forgotten_through.map_or(last, |f| f.max(last));
                p.forgotten_through = Some(through);
                if !p.window.is_empty() {
                    moved.push((id, through));
                }
            }
            !p.window.is_empty()
        });
        moved.sort_unstable();
        moved
    }

    /// Restores the watermarks [`retain_from`](Self::retain_from) reported before a restart
    /// (storage keeps them beside the shard): a sequence retention removed stays expired, rather
    /// than look like one that never landed. Call after the shard's batches were restored.
    pub fn restore_forgotten(&mut self, forgotten: &[(u64, u64)]) {
        for &(id, through) in forgotten {
            if let Some(p) = self.map.get_mut(&id) {
                p.forgotten_through = Some(p.forgotten_through.map_or(through, |f| f.max(through)));
            }
        }
    }

    /// Producers remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }
}

/// CRC-64 of a batch's encoded records (lengths included, so record boundaries count):
/// [`crate::storage::crc64`], which storage keeps with each batch an idempotent producer wrote.
pub fn digest(data: &[u8]) -> u64 {
    crate::storage::crc64(data)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc64_xz_check_value() {
        assert_eq!(digest(b"123456789"), 0x995D_C9BB_DF19_39FA);
    }

    #[test]
    fn the_table_of_answers() {
        let mut p = Producers::default();
        assert_eq!(p.check(7, 1, 0), Verdict::Unknown);
        assert_eq!(p.check(7, 0, 0), Verdict::Append);
        p.appended(7, 0, 11, 0, 3, Some(WriteToken(1)));
        assert_eq!(p.check(7, 0, 11), Verdict::Duplicate { base: 0, pending: Some(WriteToken(1)) });
        p.settled(7, 0, true);
        assert_eq!(p.check(7, 0, 11), Verdict::Duplicate { base: 0, pending: None });
        assert_eq!(p.check(7, 0, 12), Verdict::Reused);
        assert_eq!(p.check(7, 2, 0), Verdict::Gap { expected: 1 });
        assert_eq!(p.check(7, 1, 0), Verdict::Append);
        for s in 1..=WINDOW {
            p.appended(7, s, s, s * 3, s * 3 + 3, None);
        }
        assert_eq!(p.check(7, 0, 11), Verdict::Expired, "fell out of the window");
        // A failed write may be sent again.
        p.appended(7, 65, 5, 200, 201, Some(WriteToken(2)));
        p.settled(7, 65, false);
        assert_eq!(p.check(7, 65, 99), Verdict::Append);
        // A sequence inside the window that is not remembered never landed: appended.
        let mut q = Producers::default();
        q.appended(8, 1, 5, 10, 11, None);
        assert_eq!(q.check(8, 0, 9), Verdict::Append);
        // A hole inside the remembered range never landed: appended.
        p.appended(7, 67, 5, 300, 301, None);
        assert_eq!(p.check(7, 66, 1), Verdict::Append);
        // Retention forgetting a batch inside the window makes it expired, not appendable.
        let mut r = Producers::default();
        r.appended(9, 0, 1, 0, 1, None);
        r.appended(9, 1, 1, 1, 2, None);
        r.retain_from(1);
        assert_eq!(r.check(9, 0, 1), Verdict::Expired);
        assert_eq!(r.check(9, 1, 1), Verdict::Duplicate { base: 1, pending: None });
        // Retention forgets a producer with nothing left.
        p.retain_from(10_000);
        assert_eq!(p.len(), 0);
        assert_eq!(p.check(7, 66, 0), Verdict::Unknown);
    }

    /// The producer's rule (at most `WINDOW` unanswered, counted from the oldest) is enough for
    /// every resend to be answered, however arrivals interleave: a batch that failed early and
    /// is resent after `WINDOW - 1` later ones (arrival order far from sequence order) is still
    /// told apart from a duplicate.
    #[test]
    fn a_resend_inside_the_producers_window_is_never_expired() {
        let mut p = Producers::default();
        p.appended(7, 0, 100, 0, 1, Some(WriteToken(1)));
        p.settled(7, 0, false);
        for s in 1..WINDOW {
            p.appended(7, s, s, s, s + 1, None);
        }
        assert_eq!(p.check(7, 0, 100), Verdict::Append);
        p.appended(7, 0, 100, 70, 71, None);
        // A recovery that replays the log in arrival order (0 last) rebuilds the same answers.
        let mut r = Producers::default();
        for s in 1..WINDOW {
            r.appended(7, s, s, s, s + 1, None);
        }
        r.appended(7, 0, 100, 70, 71, None);
        for s in 0..WINDOW {
            let want = if s == 0 {
                Verdict::Duplicate { base: 70, pending: None }
            } else {
                Verdict::Duplicate { base: s, pending: None }
            };
            assert_eq!(p.check(7, s, if s == 0 { 100 } else { s }), want);
            assert_eq!(r.check(7, s, if s == 0 { 100 } else { s }), want);
        }
    }

    #[test]
    fn what_retention_forgot_stays_expired_across_a_restart() {
        let mut p = Producers::default();
        for s in 0..20 {
            p.appended(7, s, s, 100 + s, 101 + s, None);
        }
        // Retention removes sequences 0..=9; 10.. stay.
        assert_eq!(p.retain_from(110), vec![(7, 9)]);
        assert_eq!(p.check(7, 9, 9), Verdict::Expired);
        // A restart rebuilds the window from the log (10..20) and the kept watermark.
        let mut r = Producers::default();
        for s in 10..20 {
            r.appended(7, s, s, 100 + s, 101 + s, None);
        }
        assert_eq!(r.check(7, 9, 9), Verdict::Append, "without the watermark it would look never landed");
        r.restore_forgotten(&[(7, 9), (8, 3)]);
        assert_eq!(r.check(7, 9, 9), Verdict::Expired);
        assert_eq!(r.check(7, 10, 10), Verdict::Duplicate { base: 110, pending: None });
        assert_eq!(r.check(8, 1, 1), Verdict::Unknown, "a producer with nothing left stays forgotten");
        // A log that merely starts late (its first write failed) forgets nothing.
        let mut q = Producers::default();
        q.appended(9, 1, 1, 5, 6, None);
        assert_eq!(q.check(9, 0, 0), Verdict::Append);
    }

    #[test]
    fn the_coldest_producer_goes_first() {
        let mut p = Producers::default();
        for id in 0..MAX_PRODUCERS as u64 + 1 {
            p.appended(id, 0, 0, id, id + 1, None);
        }
        assert_eq!(p.len(), MAX_PRODUCERS);
        assert_eq!(p.check(0, 1, 0), Verdict::Unknown, "producer 0 was the coldest");
        assert_eq!(p.check(1, 1, 0), Verdict::Append);
    }
}
