//! Idempotent producers: per shard, per producer, the next expected sequence and where the last
//! batches landed, so a retried batch is appended once and answered with the original offset.
//!
//! Durable shards keep this state in the log itself (each batch carries its producer id and
//! sequence), so a restart rebuilds it from the recovered batches. See REFERENCE §10.3.

use crate::io::WriteToken;
use std::collections::{HashMap, VecDeque};

/// Batches remembered per producer (clients keep at most this many in flight).
pub(crate) const WINDOW: usize = 64;
/// Producers remembered per shard; the least recently used goes first beyond it.
pub(crate) const MAX_PRODUCERS: usize = 4096;

/// Where a remembered batch landed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Landed {
    sequence: u64,
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
    window: VecDeque<Landed>,
    last_used: u64,
    /// The window lost batches (it overflowed, or retention removed them): a sequence below
    /// its oldest entry may have landed.
    trimmed: bool,
}

/// What to do with an incoming idempotent batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Append it (a new sequence, or the resend of one whose write failed).
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
        match p.window.iter().find(|l| l.sequence == sequence) {
            Some(l) if l.failed => Verdict::Append,
            Some(l) if l.digest == digest => Verdict::Duplicate { base: l.base, pending: l.pending },
            Some(_) => Verdict::Reused,
            // Absent, and the window holds every batch of this producer that landed at or
            // above it: it never landed (its write failed before a restart forgot the
            // failure), so it may be appended now.
            None if !p.trimmed || p.window.front().is_some_and(|l| sequence > l.sequence) => Verdict::Append,
            None => Verdict::Expired,
        }
    }

    /// Records an appended batch `[base, end)`.
    pub fn appended(&mut self, id: u64, sequence: u64, digest: u64, base: u64, end: u64, pending: Option<WriteToken>) {
        self.tick += 1;
        if !self.map.contains_key(&id) && self.map.len() >= MAX_PRODUCERS {
            // Forget the coldest producer (its next batch other than sequence 0 is refused
            // `unknown_producer`, as the spec says).
            if let Some(cold) = self.map.iter().min_by_key(|(_, p)| p.last_used).map(|(k, _)| *k) {
                self.map.remove(&cold);
            }
        }
        let p = self.map.entry(id).or_default();
        p.last_used = self.tick;
        let landed = Landed { sequence, base, end, digest, pending, failed: false };
        if let Some(l) = p.window.iter_mut().find(|l| l.sequence == sequence) {
            *l = landed; // the resend of a failed write
        } else {
            p.window.push_back(landed);
            if p.window.len() > WINDOW {
                p.window.pop_front();
                p.trimmed = true;
            }
        }
        p.next = p.next.max(sequence + 1);
    }

    /// A write settled: a landed batch is final, a failed one may be sent again.
    pub fn settled(&mut self, id: u64, sequence: u64, ok: bool) {
        if let Some(l) = self.map.get_mut(&id).and_then(|p| p.window.iter_mut().find(|l| l.sequence == sequence)) {
            l.pending = None;
            l.failed = !ok;
        }
    }

    /// Retention moved the shard's start: forget batches wholly below it, and producers with
    /// none left.
    pub fn retain_from(&mut self, start: u64) {
        self.map.retain(|_, p| {
            let before = p.window.len();
            p.window.retain(|l| l.end > start || l.pending.is_some());
            p.trimmed |= p.window.len() < before;
            !p.window.is_empty()
        });
    }

    /// Producers remembered.
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.map.len()
    }
}

const fn crc64_table() -> [u64; 256] {
    // CRC-64/XZ (ECMA-182 polynomial, reflected).
    let mut t = [0u64; 256];
    let mut i = 0;
    while i < 256 {
        let mut c = i as u64;
        let mut k = 0;
        while k < 8 {
            c = if c & 1 != 0 { 0xC96C_5795_D787_0F42 ^ (c >> 1) } else { c >> 1 };
            k += 1;
        }
        t[i] = c;
        i += 1;
    }
    t
}

static CRC64_TABLE: [u64; 256] = crc64_table();

/// CRC-64 of a batch's encoded records (lengths included, so record boundaries count).
pub fn digest(data: &[u8]) -> u64 {
    let mut c = !0u64;
    for &b in data {
        c = CRC64_TABLE[((c ^ u64::from(b)) & 0xFF) as usize] ^ (c >> 8);
    }
    !c
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
        for s in 1..=WINDOW as u64 {
            p.appended(7, s, s, s * 3, s * 3 + 3, None);
        }
        assert_eq!(p.check(7, 0, 11), Verdict::Expired, "fell out of the window");
        // A failed write may be sent again.
        p.appended(7, 65, 5, 200, 201, Some(WriteToken(2)));
        p.settled(7, 65, false);
        assert_eq!(p.check(7, 65, 99), Verdict::Append);
        // A sequence below a window that never overflowed never landed: appended.
        let mut q = Producers::default();
        q.appended(8, 1, 5, 10, 11, None);
        assert_eq!(q.check(8, 0, 9), Verdict::Append);
        // A hole inside the remembered range never landed: appended.
        p.appended(7, 67, 5, 300, 301, None);
        assert_eq!(p.check(7, 66, 1), Verdict::Append);
        // Retention forgets a producer with nothing left.
        p.retain_from(10_000);
        assert_eq!(p.len(), 0);
        assert_eq!(p.check(7, 66, 0), Verdict::Unknown);
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
