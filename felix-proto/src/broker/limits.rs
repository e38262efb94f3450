//! Per-tenant publish rate limits: a token bucket per tenant for records and one for bytes,
//! refilled with the time the driver passes in. A publish over the limit is refused
//! `overloaded` with reason `tenant_quota` and `retry_after_ms` saying when the tenant is back
//! under (nothing written; an unacked one is dropped and counted), and no other tenant is
//! touched: each tenant has its own buckets.
//!
//! A bucket holds a quarter of a second of its rate (the burst a tenant may send at once, so
//! that over 10 s a tenant gets its rate within 2.5%) and may go into debt by one batch: a batch
//! is admitted whenever the bucket is not in debt, whatever its size, so a batch larger than the
//! burst still passes, and the long-run rate is the configured one (the debt is paid before the
//! next batch). Integer arithmetic in micro-units: no float, no drift.

use std::collections::BTreeMap;
use std::time::Duration;

/// A tenant's publish limits (`None`: no limit on that measure).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TenantLimit {
    /// The tenant.
    pub tenant_id: String,
    /// Records per second.
    pub records_per_s: Option<u64>,
    /// Payload bytes per second.
    pub bytes_per_s: Option<u64>,
    /// Connections of the tenant open at once (counted from their first authenticated stream).
    pub max_connections: Option<u32>,
    /// Streams per namespace of the tenant (creating one more is refused).
    pub max_streams_per_namespace: Option<u32>,
    /// Subscriptions and cache watches open at once on one of the tenant's connections (one more
    /// is refused `limit_exceeded`; the broker-wide cap applies too).
    pub max_subscriptions_per_connection: Option<u32>,
    /// Payload bytes of history a namespace of the tenant retains, written or being written (a
    /// publish that would go past it is refused `limit_exceeded`, nothing written).
    pub max_retained_bytes_per_namespace: Option<u64>,
    /// The tenant's share of the publish queue: payload bytes of its publishes waiting for
    /// storage at once. A publish past it is refused `overloaded` reason `publish_queue_full`
    /// with a short `retry_after_ms`, nothing queued, so one tenant cannot fill the queue every
    /// tenant's writes wait in.
    pub max_queued_publish_bytes: Option<u64>,
}

/// How long a publish refused `publish_queue_full` is told to wait: the queue drains at the
/// speed of a write, so the wait is short.
pub const QUEUE_FULL_RETRY: Duration = Duration::from_millis(20);

/// Micro-units per unit.
const MICRO: i128 = 1_000_000;

#[derive(Debug, Clone)]
struct Bucket {
    /// Units per second.
    rate: u64,
    /// Tokens in micro-units (negative: debt).
    tokens: i128,
    /// When it was last refilled, in microseconds of the broker's clock.
    last: u64,
}

impl Bucket {
    fn new(rate: u64, now: u64) -> Bucket {
        Bucket { rate, tokens: Self::burst(rate), last: now }
    }

    /// What a full bucket holds: a quarter of a second of the rate.
    fn burst(rate: u64) -> i128 {
        i128::from(rate) * MICRO / 4
    }

    fn refill(&mut self, now: u64) {
        let elapsed = now.saturating_sub(self.last);
        self.last = self.last.max(now);
        let add = i128::from(self.rate) * i128::from(elapsed);
        self.tokens = (self.tokens + add).min(Self::burst(self.rate));
    }

    /// How long until the bucket is out of debt (zero when it is not).
    fn wait(&self) -> Duration {
        if self.tokens >= 0 || self.rate == 0 {
            return Duration::ZERO;
        }
        let rate = i128::from(self.rate);
        let micros = (-self.tokens + rate - 1) / rate;
        Duration::from_micros(u64::try_from(micros).unwrap_or(u64::MAX))
    }
}

/// A tenant's quotas (see [`TenantLimit`]).
#[derive(Debug, Clone, Copy, Default)]
struct Quota {
    connections: Option<u32>,
    streams: Option<u32>,
    subscriptions: Option<u32>,
    retained_bytes: Option<u64>,
    queued_bytes: Option<u64>,
}

/// Every tenant's buckets and quotas, and what the quotas are counted against.
#[derive(Debug, Default)]
pub(super) struct RateLimits {
    limits: BTreeMap<String, (Option<u64>, Option<u64>)>,
    buckets: BTreeMap<String, (Option<Bucket>, Option<Bucket>)>,
    quotas: BTreeMap<String, Quota>,
    /// Payload bytes waiting for storage, by tenant (only tenants with a queue share).
    queued: BTreeMap<String, u64>,
    /// Payload bytes of history by (tenant, namespace), only for tenants with a retained-bytes
    /// quota: recounted from the logs on every retention sweep, plus what was admitted since.
    retained: BTreeMap<(String, String), u64>,
}

impl RateLimits {
    pub(super) fn new(limits: &[TenantLimit]) -> RateLimits {
        RateLimits {
            limits: limits
                .iter()
                .filter(|l| l.records_per_s.is_some() || l.bytes_per_s.is_some())
                .map(|l| (l.tenant_id.clone(), (l.records_per_s, l.bytes_per_s)))
                .collect(),
            buckets: BTreeMap::new(),
            quotas: limits
                .iter()
                .map(|l| {
                    let q = Quota {
                        connections: l.max_connections,
                        streams: l.max_streams_per_namespace,
                        subscriptions: l.max_subscriptions_per_connection,
                        retained_bytes: l.max_retained_bytes_per_namespace,
                        queued_bytes: l.max_queued_publish_bytes,
                    };
                    (l.tenant_id.clone(), q)
                })
                .collect(),
            queued: BTreeMap::new(),
            retained: BTreeMap::new(),
        }
    }

    /// A tenant's connection quota.
    pub(super) fn max_connections(&self, tenant: &str) -> Option<u32> {
        self.quotas.get(tenant).and_then(|q| q.connections)
    }

    /// A tenant's streams-per-namespace quota.
    pub(super) fn max_streams(&self, tenant: &str) -> Option<u32> {
        self.quotas.get(tenant).and_then(|q| q.streams)
    }

    /// A tenant's subscriptions-per-connection quota.
    pub(super) fn max_subscriptions(&self, tenant: &str) -> Option<u32> {
        self.quotas.get(tenant).and_then(|q| q.subscriptions)
    }

    /// Whether any tenant has a retained-bytes quota (the retention sweep then recounts).
    pub(super) fn counts_retained(&self) -> bool {
        self.quotas.values().any(|q| q.retained_bytes.is_some())
    }

    /// The tenants with a retained-bytes quota.
    pub(super) fn retained_tenants(&self) -> impl Iterator<Item = &str> {
        self.quotas.iter().filter(|(_, q)| q.retained_bytes.is_some()).map(|(t, _)| t.as_str())
    }

    /// Replaces the retained-bytes figures with a fresh count from the logs.
    pub(super) fn set_retained(&mut self, counted: BTreeMap<(String, String), u64>) {
        self.retained = counted;
    }

    /// Whether `bytes` more history fits `tenant`'s namespace `ns`; counts them when it does.
    /// `Err((held, quota))` when it does not.
    pub(super) fn take_retained(&mut self, tenant: &str, ns: &str, bytes: u64) -> Result<(), (u64, u64)> {
        let Some(max) = self.quotas.get(tenant).and_then(|q| q.retained_bytes) else { return Ok(()) };
        let held = self.retained.entry((tenant.to_owned(), ns.to_owned())).or_insert(0);
        if held.saturating_add(bytes) > max {
            return Err((*held, max));
        }
        *held += bytes;
        Ok(())
    }

    /// Whether `bytes` more of `tenant`'s publishes fit its share of the publish queue; counts
    /// them when they do (a batch is let in whenever nothing of the tenant waits, whatever its
    /// size, so a batch larger than the share still goes through alone). Returns whether the
    /// bytes were counted (they must be [`release_queued`](Self::release_queued) once written).
    pub(super) fn take_queued(&mut self, tenant: &str, bytes: u64) -> Result<bool, ()> {
        let Some(max) = self.quotas.get(tenant).and_then(|q| q.queued_bytes) else { return Ok(false) };
        let q = self.queued.entry(tenant.to_owned()).or_insert(0);
        if *q > 0 && q.saturating_add(bytes) > max {
            return Err(());
        }
        *q += bytes;
        Ok(true)
    }

    /// `bytes` of `tenant`'s publishes left the queue (written, failed or dropped).
    pub(super) fn release_queued(&mut self, tenant: &str, bytes: u64) {
        if let Some(q) = self.queued.get_mut(tenant) {
            *q = q.saturating_sub(bytes);
        }
    }

    /// Bytes of `tenant`'s publishes waiting for storage (its share of the queue in use).
    pub(super) fn queued(&self, tenant: &str) -> u64 {
        self.queued.get(tenant).copied().unwrap_or(0)
    }

    /// Whether a tenant has limits at all (the common case, none, costs one lookup).
    pub(super) fn is_empty(&self) -> bool {
        self.limits.is_empty()
    }

    /// Takes `records` records of `bytes` payload bytes from `tenant`'s buckets at `now` (in
    /// microseconds of the broker's clock), or says how long to wait (nothing taken).
    pub(super) fn admit(&mut self, tenant: &str, records: u64, bytes: u64, now: u64) -> Result<(), Duration> {
        let Some(&(rec_rate, byte_rate)) = self.limits.get(tenant) else { return Ok(()) };
        let (rb, bb) = self
            .buckets
            .entry(tenant.to_owned())
            .or_insert_with(|| (rec_rate.map(|r| Bucket::new(r, now)), byte_rate.map(|r| Bucket::new(r, now))));
        for b in [rb.as_mut(), bb.as_mut()].into_iter().flatten() {
            b.refill(now);
        }
        let wait = [rb.as_ref(), bb.as_ref()].into_iter().flatten().map(Bucket::wait).max().unwrap_or_default();
        if !wait.is_zero() {
            return Err(wait);
        }
        if let Some(b) = rb {
            b.tokens -= i128::from(records) * MICRO;
        }
        if let Some(b) = bb {
            b.tokens -= i128::from(bytes) * MICRO;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(records: Option<u64>, bytes: Option<u64>) -> RateLimits {
        RateLimits::new(&[TenantLimit {
            tenant_id: "t1".into(),
            records_per_s: records,
            bytes_per_s: bytes,
            ..TenantLimit::default()
        }])
    }

    /// Offered far more than the limit for 10 s of virtual time, a tenant gets its rate within
    /// a second's burst.
    #[test]
    fn the_long_run_rate_is_the_configured_one() {
        let start = 1_700_000_000_000_000u64;
        for (rate, batch) in [(1000u64, 10u64), (100, 1), (500, 64), (50, 200)] {
            let mut l = limits(Some(rate), None);
            let mut admitted = 0u64;
            let mut t = start;
            let end = start + 10_000_000;
            while t < end {
                if l.admit("t1", batch, 0, t).is_ok() {
                    admitted += batch;
                }
                t += 500;
            }
            let want = rate * 10;
            // The first burst (a quarter second) plus at most one batch of debt.
            assert!(admitted >= want && admitted <= want + rate / 4 + batch, "rate {rate} batch {batch}: {admitted}");
        }
    }

    #[test]
    fn a_queue_share_lets_one_batch_in_alone_and_refuses_past_the_share() {
        let mut l = RateLimits::new(&[TenantLimit {
            tenant_id: "t1".into(),
            max_queued_publish_bytes: Some(1000),
            max_retained_bytes_per_namespace: Some(5000),
            ..TenantLimit::default()
        }]);
        assert_eq!(l.take_queued("t1", 4000), Ok(true), "alone, a batch bigger than the share goes in");
        assert_eq!(l.take_queued("t1", 1), Err(()), "then nothing more");
        l.release_queued("t1", 4000);
        assert_eq!(l.queued("t1"), 0);
        assert_eq!(l.take_queued("t1", 600), Ok(true));
        assert_eq!(l.take_queued("t1", 400), Ok(true), "exactly the share");
        assert_eq!(l.take_queued("t1", 1), Err(()));
        assert_eq!(l.take_queued("t2", 1 << 40), Ok(false), "another tenant is not counted");
        // Retained bytes: up to the quota exactly, per namespace.
        assert_eq!(l.take_retained("t1", "a", 5000), Ok(()));
        assert_eq!(l.take_retained("t1", "a", 1), Err((5000, 5000)));
        assert_eq!(l.take_retained("t1", "b", 5000), Ok(()), "another namespace has its own");
        l.set_retained(BTreeMap::from([(("t1".into(), "a".into()), 4000)]));
        assert_eq!(l.take_retained("t1", "a", 1000), Ok(()), "a recount after retention frees room");
        assert_eq!(l.take_retained("t1", "b", 1), Ok(()), "a namespace the recount did not see holds nothing");
        assert!(l.counts_retained() && l.retained_tenants().eq(["t1"]));
    }

    #[test]
    fn a_refusal_says_how_long_to_wait_and_other_tenants_are_untouched() {
        let t0 = 1_700_000_000_000_000u64;
        let mut l = limits(None, Some(1000));
        assert!(l.admit("t1", 1, 750, t0).is_ok(), "a full bucket admits a batch bigger than its burst");
        let wait = l.admit("t1", 1, 10, t0).unwrap_err();
        assert_eq!(wait, Duration::from_millis(500), "500 bytes of debt at 1000 B/s");
        assert!(l.admit("t1", 1, 10, t0 + 499_000).is_err());
        assert!(l.admit("t1", 1, 10, t0 + 500_000).is_ok());
        for _ in 0..1000 {
            assert!(l.admit("t2", 1000, 1 << 20, t0).is_ok(), "an unlimited tenant");
        }
        // A clock that goes back changes nothing.
        assert!(l.admit("t1", 1, 10, t0).is_err());
    }
}
