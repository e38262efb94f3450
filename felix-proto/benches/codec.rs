//! Codec benchmarks: `cargo bench -p felix-proto --bench codec`.
//!
//! Per-payload figures come from `Throughput::Elements(count)`. Decoding is zero-copy, so its
//! cost per payload should not depend on payload size (compare the 256 B and 64 KiB cases).

use bytes::{Bytes, BytesMut};
use criterion::{BenchmarkId, Criterion, Throughput, black_box, criterion_group, criterion_main};
use felix_proto::binary::{AckMode, AckedPrefix, EventBatch, PublishBatch};
use felix_proto::frame::FrameDecoder;
use felix_proto::message::{self, B64, Message};
use felix_proto::{Flags, Records};

fn batch(count: usize, size: usize) -> PublishBatch {
    let payloads: Vec<Vec<u8>> = (0..count).map(|i| vec![(i % 251) as u8; size]).collect();
    PublishBatch {
        acked: Some(AckedPrefix { request_id: 7, ack_mode: AckMode::PerBatch }),
        idempotent: None,
        key: Some(Bytes::from_static(b"customer-1")),
        tenant_id: "tenant-1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        records: Records::from_payloads(payloads).expect("small"),
    }
}

fn encoded(b: &PublishBatch) -> Bytes {
    let mut out = BytesMut::new();
    b.encode(&mut out).expect("encodes");
    out.freeze()
}

fn publish(c: &mut Criterion) {
    let mut g = c.benchmark_group("publish_batch");
    for (count, size) in [(64usize, 256usize), (16, 4096), (64, 65536)] {
        let b = batch(count, size);
        let frame = encoded(&b);
        let payload = frame.slice(12..);
        g.throughput(Throughput::Elements(count as u64));
        let id = format!("{count}x{size}B");
        g.bench_with_input(BenchmarkId::new("decode", &id), &payload, |bench, p| {
            bench.iter(|| black_box(PublishBatch::decode(Flags(0x49), p.clone()).expect("valid")))
        });
        g.bench_with_input(BenchmarkId::new("decode_iter_slices", &id), &payload, |bench, p| {
            bench.iter(|| {
                let b = PublishBatch::decode(Flags(0x49), p.clone()).expect("valid");
                let mut n = 0usize;
                for r in b.records.slices() {
                    n += r.len();
                }
                black_box(n)
            })
        });
        g.bench_with_input(BenchmarkId::new("decode_iter_owned", &id), &payload, |bench, p| {
            bench.iter(|| {
                let b = PublishBatch::decode(Flags(0x49), p.clone()).expect("valid");
                let mut n = 0usize;
                for r in b.records.payloads() {
                    n += r.len();
                }
                black_box(n)
            })
        });
        g.bench_with_input(BenchmarkId::new("frame_and_decode", &id), &frame, |bench, f| {
            bench.iter(|| {
                let mut d = FrameDecoder::new();
                d.set_max_frame_len(u32::MAX);
                d.push(f.clone());
                let frame = d.next_frame().expect("valid").expect("whole");
                black_box(PublishBatch::decode(frame.flags, frame.payload).expect("valid"))
            })
        });
        let mut out = BytesMut::with_capacity(frame.len() * 2);
        g.bench_with_input(BenchmarkId::new("encode", &id), &b, |bench, b| {
            bench.iter(|| {
                out.clear();
                b.encode(&mut out).expect("encodes");
                black_box(out.len())
            })
        });
    }
    g.finish();
}

fn events(c: &mut Criterion) {
    let mut g = c.benchmark_group("shared_event_batch");
    for (count, size) in [(64usize, 256usize), (16, 4096)] {
        let b = batch(count, size);
        let mut e = EventBatch::shared(b.records.clone());
        e.base_offset = Some(1000);
        let id = format!("{count}x{size}B");
        g.throughput(Throughput::Elements(count as u64));
        g.bench_with_input(BenchmarkId::new("encode_parts_zero_copy", &id), &e, |bench, e| {
            bench.iter(|| black_box(e.encode_parts().expect("encodes")))
        });
        let mut out = BytesMut::with_capacity(count * (size + 8) + 64);
        g.bench_with_input(BenchmarkId::new("encode_copy", &id), &e, |bench, e| {
            bench.iter(|| {
                out.clear();
                e.encode_into(&mut out).expect("encodes");
                black_box(out.len())
            })
        });
        // Fan-out to 10 subscribers: one encode, ten clones.
        g.bench_with_input(BenchmarkId::new("encode_once_fanout_10", &id), &e, |bench, e| {
            bench.iter(|| {
                let parts = e.encode_parts().expect("encodes");
                let mut sent = 0usize;
                for _ in 0..10 {
                    let [h, body] = parts.clone();
                    sent += h.len() + body.len();
                }
                black_box(sent)
            })
        });
    }
    g.finish();
}

fn json(c: &mut Criterion) {
    let mut g = c.benchmark_group("json_publish");
    let m = Message::Publish(message::Publish {
        tenant_id: "tenant-1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        payload: B64(Bytes::from(vec![7u8; 256])),
        key: None,
        shard: None,
        request_id: Some(7),
        ack: Some(AckMode::PerBatch),
        publish_width: None,
    });
    let payload = m.to_json().expect("encodes");
    g.throughput(Throughput::Elements(1));
    g.bench_function("decode_256B", |bench| bench.iter(|| black_box(message::decode(&payload).expect("valid"))));
    g.bench_function("encode_256B", |bench| bench.iter(|| black_box(m.to_json().expect("encodes"))));
    // The binary equivalent of one JSON publish: a one-record acked batch.
    let one = batch(1, 256);
    let frame = encoded(&one).slice(12..);
    g.bench_function("binary_equivalent_decode_256B", |bench| {
        bench.iter(|| black_box(PublishBatch::decode(Flags(0x49), frame.clone()).expect("valid")))
    });
    g.finish();
}

/// Verifying a signed token (EdDSA signature, claims, permissions): what an `auth` with one costs.
fn jwt(c: &mut Criterion) {
    use felix_proto::jwt::{Claims, Jwks, Verifier, mint, public_key};
    let mut key = vec![0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    key.extend_from_slice(&[7u8; 32]);
    let claims = Claims {
        iss: "felix-auth".into(),
        aud: "felix-broker".into(),
        sub: "alice".into(),
        tid: "t1".into(),
        exp: 2_000_000_000,
        iat: 1_700_000_000,
        nbf: None,
        jti: Some("j1".into()),
        perms: vec!["stream.publish:stream:t1/orders/*".into(), "cache.read:cache:t1/*/sessions".into()],
    };
    let token = mint(&key, "k1", &claims).expect("signs");
    let v = Verifier::new(Jwks::single("k1", &public_key(&key).expect("key")));
    let mut g = c.benchmark_group("jwt");
    g.throughput(Throughput::Elements(1));
    g.bench_function("verify", |bench| bench.iter(|| black_box(v.verify(&token, 1_800_000_000).expect("valid"))));
    g.finish();
}

criterion_group!(benches, publish, events, json, jwt);
criterion_main!(benches);
