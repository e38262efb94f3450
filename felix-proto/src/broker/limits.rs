//! Per-tenant (and per-namespace) publish rate limits and quotas: a token bucket per tenant for
//! records and one for bytes, and the same per namespace of a tenant where a `[[limits]]` entry
//! names one, refilled with the time the driver passes in; a publish must fit both. A publish over the limit is refused
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

/// A tenant's publish limits (`None`: no limit on that measure). With `namespace`, the entry is
/// one namespace's of the tenant: its rates apply to that namespace on top of the tenant's own,
/// and its streams and retained-bytes quotas replace the tenant's for that namespace
/// (connection, subscription and queue quotas are the tenant's alone).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TenantLimit {
    /// The tenant.
    pub tenant_id: String,
    /// One namespace of the tenant, or `None` for the tenant as a whole.
    pub namespace: Option<String>,
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

/// One scope's rates (a tenant, or a namespace of one) and its buckets, made on first use.
#[derive(Debug, Clone, Default)]
struct Rate {
    records: Option<u64>,
    bytes: Option<u64>,
    buckets: Option<(Option<Bucket>, Option<Bucket>)>,
}

impl Rate {
    fn buckets(&mut self, now: u64) -> (Option<&mut Bucket>, Option<&mut Bucket>) {
        let (r, b) = (self.records, self.bytes);
        let (rb, bb) =
            self.buckets.get_or_insert_with(|| (r.map(|r| Bucket::new(r, now)), b.map(|b| Bucket::new(b, now))));
        (rb.as_mut(), bb.as_mut())
    }

    /// Refills at `now`; how long until both buckets are out of debt.
    fn wait(&mut self, now: u64) -> Duration {
        let (rb, bb) = self.buckets(now);
        [rb, bb]
            .into_iter()
            .flatten()
            .map(|b| {
                b.refill(now);
                b.wait()
            })
            .max()
            .unwrap_or_default()
    }

    fn take(&mut self, records: u64, bytes: u64, now: u64) {
        let (rb, bb) = self.buckets(now);
        if let Some(b) = rb {
            b.tokens -= i128::from(records) * MICRO;
        }
        if let Some(b) = bb {
            b.tokens -= i128::from(bytes) * MICRO;
        }
    }
}

/// A tenant's rates: its own, and its namespaces'.
#[derive(Debug, Clone, Default)]
struct TenantRates {
    own: Option<Rate>,
    namespaces: BTreeMap<String, Rate>,
}

/// A namespace's own quotas, replacing the tenant's for it.
#[derive(Debug, Clone, Copy, Default)]
struct NamespaceQuota {
    streams: Option<u32>,
    retained_bytes: Option<u64>,
}

/// A publish over a rate: how long to wait, and whether it was a namespace's rate (else the
/// tenant's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct OverRate {
    pub wait: Duration,
    pub namespace: bool,
}

/// Every tenant's buckets and quotas, and what the quotas are counted against.
#[derive(Debug, Default)]
pub(super) struct RateLimits {
    rates: BTreeMap<String, TenantRates>,
    quotas: BTreeMap<String, Quota>,
    namespace_quotas: BTreeMap<String, BTreeMap<String, NamespaceQuota>>,
    /// Payload bytes waiting for storage, by tenant (only tenants with a queue share).
    queued: BTreeMap<String, u64>,
    /// Payload bytes of history by (tenant, namespace), only for tenants with a retained-bytes
    /// quota: recounted from the logs on every retention sweep, plus what was admitted since.
    retained: BTreeMap<(String, String), u64>,
}

impl RateLimits {
    pub(super) fn new(limits: &[TenantLimit]) -> RateLimits {
        let mut r = RateLimits::default();
        for l in limits {
            let rate = (l.records_per_s.is_some() || l.bytes_per_s.is_some()).then_some(Rate {
                records: l.records_per_s,
                bytes: l.bytes_per_s,
                buckets: None,
            });
            match &l.namespace {
                None => {
                    if let Some(rate) = rate {
                        r.rates.entry(l.tenant_id.clone()).or_default().own = Some(rate);
                    }
                    r.quotas.insert(
                        l.tenant_id.clone(),
                        Quota {
                            connections: l.max_connections,
                            streams: l.max_streams_per_namespace,
                            subscriptions: l.max_subscriptions_per_connection,
                            retained_bytes: l.max_retained_bytes_per_namespace,
                            queued_bytes: l.max_queued_publish_bytes,
                        },
                    );
                }
                Some(ns) => {
                    if let Some(rate) = rate {
                        r.rates.entry(l.tenant_id.clone()).or_default().namespaces.insert(ns.clone(), rate);
                    }
                    r.namespace_quotas.entry(l.tenant_id.clone()).or_default().insert(
                        ns.clone(),
                        NamespaceQuota {
                            streams: l.max_streams_per_namespace,
                            retained_bytes: l.max_retained_bytes_per_namespace,
                        },
                    );
                }
            }
        }
        r
    }

    fn namespace_quota(&self, tenant: &str, ns: &str) -> Option<&NamespaceQuota> {
        self.namespace_quotas.get(tenant).and_then(|n| n.get(ns))
    }

    /// A tenant's connection quota.
    pub(super) fn max_connections(&self, tenant: &str) -> Option<u32> {
        self.quotas.get(tenant).and_then(|q| q.connections)
    }

    /// The streams quota of a tenant's namespace: its own, else the tenant's per-namespace one.
    pub(super) fn max_streams(&self, tenant: &str, ns: &str) -> Option<u32> {
        self.namespace_quota(tenant, ns)
            .and_then(|q| q.streams)
            .or_else(|| self.quotas.get(tenant).and_then(|q| q.streams))
    }

    /// The retained-bytes quota of a tenant's namespace: its own, else the tenant's.
    fn max_retained(&self, tenant: &str, ns: &str) -> Option<u64> {
        self.namespace_quota(tenant, ns)
            .and_then(|q| q.retained_bytes)
            .or_else(|| self.quotas.get(tenant).and_then(|q| q.retained_bytes))
    }

    /// A tenant's subscriptions-per-connection quota.
    pub(super) fn max_subscriptions(&self, tenant: &str) -> Option<u32> {
        self.quotas.get(tenant).and_then(|q| q.subscriptions)
    }

    /// Whether any tenant has a retained-bytes quota (the retention sweep then recounts).
    pub(super) fn counts_retained(&self) -> bool {
        self.retained_tenants().next().is_some()
    }

    /// The tenants with a retained-bytes quota (their own or one of their namespaces').
    pub(super) fn retained_tenants(&self) -> impl Iterator<Item = &str> {
        let own = self.quotas.iter().filter(|(_, q)| q.retained_bytes.is_some()).map(|(t, _)| t.as_str());
        let ns = self
            .namespace_quotas
            .iter()
            .filter(|(t, n)| {
                self.quotas.get(*t).is_none_or(|q| q.retained_bytes.is_none())
                    && n.values().any(|q| q.retained_bytes.is_some())
            })
            .map(|(t, _)| t.as_str());
        own.chain(ns)
    }

    /// Replaces the retained-bytes figures with a fresh count from the logs.
    pub(super) fn set_retained(&mut self, counted: BTreeMap<(String, String), u64>) {
        self.retained = counted;
    }

    /// Whether `bytes` more history fits `tenant`'s namespace `ns`; counts them when it does.
    /// `Err((held, quota))` when it does not.
    pub(super) fn take_retained(&mut self, tenant: &str, ns: &str, bytes: u64) -> Result<(), (u64, u64)> {
        let Some(max) = self.max_retained(tenant, ns) else { return Ok(()) };
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

    /// Whether any tenant has rate limits at all (the common case, none, costs one check).
    pub(super) fn is_empty(&self) -> bool {
        self.rates.is_empty()
    }

    /// Takes `records` records of `bytes` payload bytes from the buckets of `tenant` and of its
    /// namespace `ns` at `now` (in microseconds of the broker's clock), or says how long to
    /// wait, and whose rate it was (nothing taken).
    pub(super) fn admit(&mut self, tenant: &str, ns: &str, records: u64, bytes: u64, now: u64) -> Result<(), OverRate> {
        let Some(t) = self.rates.get_mut(tenant) else { return Ok(()) };
        let own = t.own.as_mut().map_or(Duration::ZERO, |r| r.wait(now));
        let in_ns = t.namespaces.get_mut(ns).map_or(Duration::ZERO, |r| r.wait(now));
        if !own.is_zero() || !in_ns.is_zero() {
            return Err(OverRate { wait: own.max(in_ns), namespace: in_ns > own });
        }
        if let Some(r) = t.own.as_mut() {
            r.take(records, bytes, now);
        }
        if let Some(r) = t.namespaces.get_mut(ns) {
            r.take(records, bytes, now);
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
                if l.admit("t1", "ns", batch, 0, t).is_ok() {
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

    /// A namespace's own rate applies on top of its tenant's; its quotas replace the tenant's
    /// for that namespace only.
    #[test]
    fn a_namespace_has_its_own_rate_on_top_of_its_tenants_and_its_own_quotas() {
        let t0 = 1_700_000_000_000_000u64;
        let mut l = RateLimits::new(&[
            TenantLimit {
                tenant_id: "t1".into(),
                records_per_s: Some(1000),
                max_streams_per_namespace: Some(10),
                max_retained_bytes_per_namespace: Some(100),
                ..TenantLimit::default()
            },
            TenantLimit {
                tenant_id: "t1".into(),
                namespace: Some("slow".into()),
                records_per_s: Some(100),
                max_streams_per_namespace: Some(2),
                ..TenantLimit::default()
            },
            TenantLimit {
                tenant_id: "t2".into(),
                namespace: Some("big".into()),
                max_retained_bytes_per_namespace: Some(1000),
                ..TenantLimit::default()
            },
        ]);
        // The namespace's burst (25) runs out before the tenant's (250).
        let admitted = (0..100).filter(|_| l.admit("t1", "slow", 1, 0, t0).is_ok()).count();
        assert_eq!(admitted, 26, "its quarter-second burst, plus one in debt");
        let over = l.admit("t1", "slow", 1, 0, t0).unwrap_err();
        assert!(over.namespace, "the namespace's rate, not the tenant's");
        // Another namespace of the tenant has only the tenant's rate (of which 26 went).
        let admitted = (0..1000).filter(|_| l.admit("t1", "fast", 1, 0, t0).is_ok()).count();
        assert_eq!(admitted, 251 - 26);
        assert!(!l.admit("t1", "fast", 1, 0, t0).unwrap_err().namespace, "the tenant's rate");
        assert_eq!((l.max_streams("t1", "slow"), l.max_streams("t1", "fast")), (Some(2), Some(10)));
        assert_eq!(l.max_streams("t2", "big"), None);
        assert_eq!(l.take_retained("t2", "big", 1000), Ok(()));
        assert_eq!(l.take_retained("t2", "other", 1 << 40), Ok(()), "no quota outside the namespace");
        assert_eq!(l.take_retained("t1", "slow", 101), Err((0, 100)), "the tenant's quota, as the namespace sets none");
        assert!(l.retained_tenants().eq(["t1", "t2"]));
    }

    #[test]
    fn a_refusal_says_how_long_to_wait_and_other_tenants_are_untouched() {
        let t0 = 1_700_000_000_000_000u64;
        let mut l = limits(None, Some(1000));
        assert!(l.admit("t1", "ns", 1, 750, t0).is_ok(), "a full bucket admits a batch bigger than its burst");
        let wait = l.admit("t1", "ns", 1, 10, t0).unwrap_err().wait;
        assert_eq!(wait, Duration::from_millis(500), "500 bytes of debt at 1000 B/s");
        assert!(l.admit("t1", "ns", 1, 10, t0 + 499_000).is_err());
        assert!(l.admit("t1", "ns", 1, 10, t0 + 500_000).is_ok());
        for _ in 0..1000 {
            assert!(l.admit("t2", "ns", 1000, 1 << 20, t0).is_ok(), "an unlimited tenant");
        }
        // A clock that goes back changes nothing.
        assert!(l.admit("t1", "ns", 1, 10, t0).is_err());
    }
}
