//! Helpers shared by the scenario tests.
#![allow(dead_code)]

use bytes::{Bytes, BytesMut};
use felix_proto::binary::{AckMode, AckedPrefix, EventBatch, PublishAck, PublishBatch};
use felix_proto::broker::{BrokerConfig, StreamConfig, TokenGrant};
use felix_proto::frame::{Frame, FrameDecoder};
use felix_proto::message::{self, Decoded, Message};
use felix_proto::sim::Sim;
use felix_proto::transport::StreamId;
use felix_proto::{Payload, Records};

pub const TOKEN: &str = "dev-token";

/// The tests' clock reading: the harness starts its virtual time here (felix-proto itself never
/// reads a clock).
#[allow(clippy::disallowed_methods)]
pub fn epoch() -> std::time::Instant {
    std::time::Instant::now()
}

pub fn config() -> BrokerConfig {
    BrokerConfig { tokens: vec![TokenGrant::dev(TOKEN)], ..BrokerConfig::default() }
}

pub fn ephemeral_config() -> BrokerConfig {
    let mut c = config();
    c.default_stream = StreamConfig { durable: false, ..StreamConfig::default() };
    c
}

pub fn json(m: &Message) -> Bytes {
    let mut b = BytesMut::new();
    m.encode(&mut b).unwrap();
    b.freeze()
}

pub fn auth(flags: Option<u16>, features: Option<u32>, hi: Option<u32>) -> Bytes {
    json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: TOKEN.into(),
        client_flags: flags,
        client_flags_hi: None,
        client_features: features,
        client_features_hi: hi,
    }))
}

/// A token of tenant t1 that may publish to every stream and do nothing else (no `admin`).
pub fn publish_only_token() -> TokenGrant {
    TokenGrant {
        token: "writer".into(),
        tenant_id: Some("t1".into()),
        principal: "w".into(),
        grants: vec![felix_proto::broker::Grant { action: felix_proto::broker::Action::Publish, pattern: "*".into() }],
    }
}

/// `auth` with [`publish_only_token`], binary publishes and these first-word features.
pub fn auth_publish_only(features: Option<u32>) -> Bytes {
    json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: "writer".into(),
        client_flags: Some(1),
        client_flags_hi: None,
        client_features: features,
        client_features_hi: None,
    }))
}

pub fn frames(bytes: &[u8]) -> Vec<Frame> {
    let mut d = FrameDecoder::new();
    d.push(Bytes::copy_from_slice(bytes));
    let mut out = Vec::new();
    while let Some(f) = d.next_frame().unwrap() {
        out.push(f);
    }
    assert_eq!(d.buffered(), 0, "trailing partial frame");
    out
}

pub fn payloads(bytes: &[u8]) -> Vec<Payload> {
    frames(bytes).iter().map(|f| f.decode_payload().unwrap()).collect()
}

pub fn messages(bytes: &[u8]) -> Vec<Message> {
    payloads(bytes)
        .into_iter()
        .map(|p| match p {
            Payload::Json(Decoded::Message(m)) => m,
            other => panic!("expected a JSON message, got {other:?}"),
        })
        .collect()
}

pub fn publish_json(stream: &str, payload: &str, request_id: Option<u64>, ack: Option<AckMode>) -> Bytes {
    json(&Message::Publish(message::Publish {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        payload: message::B64::from(payload),
        key: None,
        shard: None,
        request_id,
        ack,
        publish_width: None,
    }))
}

pub fn publish_binary(stream: &str, payloads: &[&str], request_id: Option<u64>, key: Option<&str>) -> Bytes {
    let b = PublishBatch {
        acked: request_id.map(|request_id| AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
        idempotent: None,
        key: key.map(|k| Bytes::copy_from_slice(k.as_bytes())),
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        records: Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).unwrap(),
    };
    let mut out = BytesMut::new();
    b.encode(&mut out).unwrap();
    out.freeze()
}

pub fn subscribe(stream: &str, start: Option<message::StartPosition>) -> Bytes {
    subscribe_filtered(stream, start, None)
}

/// A subscribe with a filter on record keys (D57).
pub fn subscribe_filtered(
    stream: &str,
    start: Option<message::StartPosition>,
    filter: Option<message::KeyFilter>,
) -> Bytes {
    json(&Message::Subscribe(message::Subscribe {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        subscription_id: None,
        start,
        shard: None,
        queue_capacity: None,
        filter,
    }))
}

/// A raw peer authenticated on a fresh bidi stream; returns (party, stream) after consuming the
/// auth answer.
pub fn raw_session(sim: &mut Sim, flags: Option<u16>, features: Option<u32>) -> (usize, StreamId, Message) {
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    sim.raw_send(p, s, auth(flags, features, None), false);
    sim.run();
    let answer = messages(&sim.take_received(p, s)).remove(0);
    (p, s, answer)
}

/// The event streams the broker opened toward party `p`.
pub fn event_streams(sim: &Sim, p: usize) -> Vec<StreamId> {
    sim.clients[p].received.keys().copied().filter(|s| s.0 & 3 == 3).collect()
}

pub fn event_batches(payloads: &[Payload]) -> Vec<EventBatch> {
    payloads
        .iter()
        .filter_map(|p| match p {
            Payload::Events(e) => Some(e.clone()),
            _ => None,
        })
        .collect()
}

pub fn acks(payloads: &[Payload]) -> Vec<PublishAck> {
    payloads
        .iter()
        .filter_map(|p| match p {
            Payload::Ack(a) => Some(a.clone()),
            _ => None,
        })
        .collect()
}

/// A cluster member named `id` whose client port is `port` (cluster port `port + 2000`).
pub fn cluster_member(id: &str, port: u16) -> felix_proto::cluster::metadata::Member {
    felix_proto::cluster::metadata::Member {
        id: id.into(),
        client_addr: format!("127.0.0.1:{port}"),
        cluster_addr: format!("127.0.0.1:{}", port + 2000),
        state: felix_proto::cluster::metadata::MemberState::Active,
        incarnation: String::new(),
    }
}

/// Cluster metadata: `members` (node id, client port) joined, and durable stream t1/default/orders
/// of `shards` shards spread over them.
pub fn cluster_metadata(members: &[(&str, u16)], shards: u32) -> felix_proto::cluster::metadata::Metadata {
    use felix_proto::cluster::metadata::{Command, Kind, Metadata};
    let mut md = Metadata::default();
    for (id, port) in members {
        md.apply(&Command::Join { member: cluster_member(id, *port) }).unwrap();
    }
    let create = Command::Create {
        kind: Kind::Stream,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "orders".into(),
        shards,
        ephemeral: false,
        replication: 0,
    };
    md.apply(&create).unwrap();
    md
}

/// Owner and generation of shard `shard` of t1/default/orders.
pub fn orders_owner(md: &felix_proto::cluster::metadata::Metadata, shard: u32) -> (String, u64) {
    use felix_proto::cluster::metadata::{Kind, ShardId};
    let id =
        ShardId { kind: Kind::Stream, tenant: "t1".into(), namespace: "default".into(), name: "orders".into(), shard };
    let a = md.owner(&id).expect("a registered shard has an owner");
    (a.owner.clone(), a.generation)
}

/// Two subscribers of `orders` (queues of `queue` batches, 1 KiB of writer credit), the one to
/// be made slow first, and a publisher: the parties.
pub fn slow_and_fast(mut cfg: BrokerConfig, queue: u32) -> (Sim, usize, usize, (usize, StreamId)) {
    cfg.event_stream_inflight_bytes = 1024;
    cfg.default_stream.queue_capacity = queue;
    let mut sim = Sim::new(cfg, epoch());
    let (slow, ss, _) = raw_session(&mut sim, Some(0x0027), None);
    let (fast, fs, _) = raw_session(&mut sim, Some(0x0027), None);
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), None);
    sim.raw_send(slow, ss, subscribe("orders", None), false);
    sim.raw_send(fast, fs, subscribe("orders", None), false);
    sim.run();
    (sim, slow, fast, (p, s))
}

/// A publisher of fifty unacked 100-byte records to `orders`, with storage completing nothing
/// (manual) and room for 1000 bytes waiting for it: the broker stopped reading it after about
/// ten. Returns the sim and the publisher's party and stream.
pub fn publisher_paused_by_storage() -> (Sim, usize, StreamId) {
    let mut cfg = config();
    cfg.max_pending_write_bytes = 1000;
    let mut sim = Sim::new(cfg, epoch());
    sim.storage = felix_proto::sim::StorageMode::Manual;
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), None);
    let payload = "z".repeat(100);
    for _ in 0..50 {
        sim.raw_send(p, s, publish_binary("orders", &[&payload], None, None), false);
    }
    sim.run();
    (sim, p, s)
}

/// Publishes records `ids`, one per batch, each payload its number (ephemeral streams have no
/// offsets) padded to 256 bytes.
pub fn publish_n(sim: &mut Sim, (p, s): (usize, StreamId), ids: std::ops::Range<u64>) {
    for i in ids {
        let payload = format!("{i:<256}");
        sim.raw_send(p, s, publish_binary("orders", &[&payload], Some(i), None), false);
        sim.run();
    }
}

/// Every payload client `who` of the simulation was delivered on subscription `id`, in order.
pub fn delivered_payloads(sim: &felix_proto::sim::Sim, who: usize, id: u64) -> Vec<Bytes> {
    sim.clients[who]
        .events
        .iter()
        .filter_map(|e| match e {
            felix_proto::client::ClientEvent::Events { sub, batch } if *sub == id => Some(batch.records.payloads()),
            _ => None,
        })
        .flatten()
        .collect()
}
