//! Publish → fan-out through the broker state machine, no IO: `cargo bench -p felix-proto --bench fanout`.
//!
//! Each iteration feeds one binary publish frame (64 × 256 B records) to the broker, completes
//! its storage write at once (durable streams), and drains every output, returning each event
//! stream's writer credit as a fast reader would. Throughput is delivered events (records ×
//! subscribers). Before the timed runs the bench prints peak memory held by subscriber queues
//! and shard logs over a long run.

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use felix_proto::Records;
use felix_proto::binary::PublishBatch;
use felix_proto::broker::{
    Broker, BrokerConfig, BrokerOutput, Retention, StorageOutput, StreamConfig, TokenGrant, TransportOutput,
};
use felix_proto::message::{self, Message};
use felix_proto::transport::{ConnId, StreamId, WallClock};
use std::collections::HashMap;
use std::time::Instant;

const BATCH: usize = 64;
const SIZE: usize = 256;

struct Bench {
    broker: Broker,
    publisher: ConnId,
    frame: Bytes,
    now: Instant,
    credit: HashMap<(ConnId, StreamId), usize>,
}

fn json(m: &Message) -> Bytes {
    let mut b = BytesMut::new();
    m.encode(&mut b).expect("encodes");
    b.freeze()
}

fn auth() -> Bytes {
    json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: "tok".into(),
        client_flags: Some(0x0027),
        client_flags_hi: None,
        client_features: None,
        client_features_hi: None,
    }))
}

impl Bench {
    #[allow(clippy::disallowed_methods)] // the bench is the driver: it owns the clock
    fn new(durable: bool, fanout: usize) -> Bench {
        Bench::with_limits(durable, fanout, Vec::new())
    }

    #[allow(clippy::disallowed_methods)] // the bench is the driver: it owns the clock
    fn with_limits(durable: bool, fanout: usize, tenant_limits: Vec<felix_proto::broker::TenantLimit>) -> Bench {
        let now = Instant::now();
        let cfg = BrokerConfig {
            tokens: vec![TokenGrant::dev("tok")],
            default_stream: StreamConfig {
                durable,
                retention: Retention { max_records: Some(100_000), max_bytes: None, max_age: None },
                ..StreamConfig::default()
            },
            tenant_limits,
            ..BrokerConfig::default()
        };
        let mut broker = Broker::new(cfg, WallClock::new(now, 0));
        for _ in 0..fanout {
            let c = broker.connection_opened(now);
            broker.handle_stream_data(c, StreamId(0), auth(), false, now);
            let sub = json(&Message::Subscribe(message::Subscribe {
                tenant_id: "t1".into(),
                namespace: "default".into(),
                stream: "orders".into(),
                subscription_id: None,
                start: None,
                shard: None,
                queue_capacity: None,
                filter: None,
            }));
            broker.handle_stream_data(c, StreamId(0), sub, false, now);
        }
        let publisher = broker.connection_opened(now);
        broker.handle_stream_data(publisher, StreamId(0), auth(), false, now);
        let batch = PublishBatch {
            acked: None,
            idempotent: None,
            key: None,
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            records: Records::from_payloads((0..BATCH).map(|i| vec![i as u8; SIZE])).expect("small"),
        };
        let mut frame = BytesMut::new();
        batch.encode(&mut frame).expect("encodes");
        let mut b = Bench { broker, publisher, frame: frame.freeze(), now, credit: HashMap::new() };
        b.drain();
        b
    }

    fn drain(&mut self) -> usize {
        let mut delivered = 0;
        loop {
            while let Some(o) = self.broker.poll_output() {
                match o {
                    BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data }) if stream.0 & 3 == 3 => {
                        delivered += data.len();
                        *self.credit.entry((conn, stream)).or_default() += data.len();
                    }
                    BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                        self.broker.handle_stream_opened(conn, token, StreamId(3), self.now);
                    }
                    BrokerOutput::Storage(StorageOutput::Persist(w)) => {
                        self.broker.handle_write_complete(w.token, true, self.now)
                    }
                    _ => {}
                }
            }
            if self.credit.is_empty() {
                return delivered;
            }
            // The readers flushed what they were given.
            for ((conn, stream), n) in std::mem::take(&mut self.credit) {
                self.broker.handle_stream_flushed(conn, stream, n, self.now);
            }
        }
    }

    fn publish(&mut self) -> usize {
        self.broker.handle_stream_data(self.publisher, StreamId(0), self.frame.clone(), false, self.now);
        let n = self.drain();
        debug_assert!(self.broker.stats().records_dropped == 0);
        n
    }
}

fn report_memory() {
    for durable in [false, true] {
        for fanout in [1usize, 10] {
            let mut b = Bench::new(durable, fanout);
            let (mut peak_queues, mut peak_log) = (0usize, 0u64);
            for _ in 0..20_000 {
                b.publish();
                peak_queues = peak_queues.max(b.broker.queued_event_bytes());
                peak_log = peak_log.max(b.broker.retained_log_bytes());
            }
            let dropped = b.broker.stats().records_dropped;
            let delivered = b.broker.stats().batches_delivered;
            assert_eq!(dropped, 0, "a fast reader drops nothing");
            assert_eq!(delivered, 20_000 * fanout as u64, "every batch reached every subscriber");
            eprintln!(
                "memory durable={durable} fanout={fanout}: peak subscriber-queue bytes {peak_queues}, peak retained log bytes {peak_log} (retention 100000 records), batches delivered {delivered}"
            );
        }
    }
}

fn fanout(c: &mut Criterion) {
    report_memory();
    let mut g = c.benchmark_group("publish_fanout_64x256B");
    for durable in [false, true] {
        for n in [1usize, 10] {
            let mut b = Bench::new(durable, n);
            g.throughput(Throughput::Elements((BATCH * n) as u64));
            let id = format!("{}/fanout{n}", if durable { "durable" } else { "ephemeral" });
            g.bench_function(BenchmarkId::from_parameter(id), |bench| bench.iter(|| black_box(b.publish())));
        }
    }
    g.finish();
}

/// What the rate limiter costs per publish batch: the same ephemeral publish (no subscriber)
/// with no limit, and with a tenant rate and a namespace rate far above the load (never
/// refusing), so the difference is the buckets' lookups and arithmetic.
fn limits(c: &mut Criterion) {
    use felix_proto::broker::TenantLimit;
    let far = Some(1u64 << 50);
    let configured = vec![
        TenantLimit { tenant_id: "t1".into(), records_per_s: far, bytes_per_s: far, ..TenantLimit::default() },
        TenantLimit {
            tenant_id: "t1".into(),
            namespace: Some("default".into()),
            records_per_s: far,
            ..TenantLimit::default()
        },
    ];
    let mut g = c.benchmark_group("rate_limit_per_batch");
    for (name, l) in [("none", Vec::new()), ("tenant+namespace", configured)] {
        let mut b = Bench::with_limits(false, 0, l);
        g.bench_function(BenchmarkId::from_parameter(name), |bench| bench.iter(|| black_box(b.publish())));
        assert_eq!(b.broker.stats().publishes_rate_limited, 0, "never refused");
    }
    g.finish();
}

criterion_group!(benches, fanout, limits);
criterion_main!(benches);
