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
}

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

/// Every tenant's buckets.
#[derive(Debug, Default)]
pub(super) struct RateLimits {
    limits: BTreeMap<String, (Option<u64>, Option<u64>)>,
    buckets: BTreeMap<String, (Option<Bucket>, Option<Bucket>)>,
    /// Quotas: (connections, streams per namespace) by tenant.
    quotas: BTreeMap<String, (Option<u32>, Option<u32>)>,
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
                .map(|l| (l.tenant_id.clone(), (l.max_connections, l.max_streams_per_namespace)))
                .collect(),
        }
    }

    /// A tenant's connection quota.
    pub(super) fn max_connections(&self, tenant: &str) -> Option<u32> {
        self.quotas.get(tenant).and_then(|q| q.0)
    }

    /// A tenant's streams-per-namespace quota.
    pub(super) fn max_streams(&self, tenant: &str) -> Option<u32> {
        self.quotas.get(tenant).and_then(|q| q.1)
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
