//! Forwarding in a cluster: a publish for a shard owned by another broker goes to that broker
//! (`ClusterOutput::Forward` → `handle_forwarded`) and its answer comes back
//! (`ForwardAnswer` → `handle_forward_answer`), the binary ack naming the owner for a client that
//! offered 0x0080. Two simulations, one per broker; the test carries what goes between them.

mod support;

use felix_proto::binary::AckStatus;
use felix_proto::broker::{BrokerOutput, ClusterOutput, FORWARD_TIMEOUT};
use felix_proto::cluster::metadata::{Command, Metadata};
use felix_proto::features::Features;
use felix_proto::message::{self, Message};
use felix_proto::routing::shard_for_key;
use felix_proto::sim::Sim;
use support::*;

fn metadata() -> Metadata {
    cluster_metadata(&[("n1", 5001), ("n2", 5002)], 4)
}

fn owner(md: &Metadata, shard: u32) -> (String, u64) {
    orders_owner(md, shard)
}

/// Two brokers of one cluster, each in its own simulation.
fn pair() -> (Sim, Sim, Metadata) {
    let md = metadata();
    let mut cfg = config();
    cfg.clustered = true;
    let mut a = Sim::new(cfg.clone(), epoch());
    let mut b = Sim::new(cfg, epoch());
    a.broker.apply_cluster(&md, "n1", a.now);
    b.broker.apply_cluster(&md, "n2", b.now);
    a.run();
    b.run();
    (a, b, md)
}

/// A key whose shard `who` owns.
fn key_owned_by(md: &Metadata, who: &str) -> (String, u32) {
    (0..1000)
        .map(|i| format!("k{i}"))
        .map(|k| {
            let s = shard_for_key(Some(k.as_bytes()), 4, message::Routing::Modulo);
            (k, s)
        })
        .find(|(_, s)| owner(md, *s).0 == who)
        .unwrap()
}

/// Carries everything `from` asked to send to its peers into `to`, then runs `to`.
fn carry(from: &mut Sim, from_id: &str, to: &mut Sim) -> usize {
    let out = std::mem::take(&mut from.to_peers);
    let n = out.len();
    for o in out {
        match o {
            BrokerOutput::Cluster(ClusterOutput::Forward { publish, .. }) => {
                to.broker.handle_forwarded(from_id, publish, to.now)
            }
            BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { id, outcome, .. }) => {
                to.broker.handle_forward_answer(id, outcome, to.now)
            }
            other => panic!("{other:?}"),
        }
    }
    to.run();
    n
}

#[test]
fn an_acked_binary_publish_lands_on_the_owner_and_the_ack_names_it() {
    let (mut a, mut b, md) = pair();
    let (key, shard) = key_owned_by(&md, "n2");
    let (_, generation) = owner(&md, shard);
    // Flags: offsets (0x0020), acked binary (0x0008), owner section (0x0080), ack offset (0x1000).
    let (p, s, _) = raw_session(&mut a, Some(0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000), None);
    a.raw_send(p, s, publish_binary("orders", &["one", "two"], Some(9), Some(&key)), false);
    a.run();
    assert!(a.take_received(p, s).is_empty(), "answered only once the owner answered");
    assert!(a.durable.is_empty(), "nothing written on the origin");
    assert_eq!(carry(&mut a, "n1", &mut b), 1);
    let landed: Vec<_> = b.durable.iter().filter(|w| w.stream == "orders").collect();
    assert_eq!(landed.len(), 1);
    assert_eq!((landed[0].shard, landed[0].records.count()), (shard, 2));
    assert_eq!(carry(&mut b, "n2", &mut a), 1);
    let ack = acks(&payloads(&a.take_received(p, s))).remove(0);
    assert_eq!((ack.status, ack.request_id, ack.offset), (AckStatus::Ok, 9, Some(0)));
    let o = ack.owner.expect("the owner section, offered");
    assert_eq!((o.node_id.as_str(), o.addr.as_deref(), o.generation), ("n2", Some("127.0.0.1:5002"), generation));
    assert_eq!(a.broker.stats().publishes_forwarded, 1);
    assert_eq!(b.broker.stats().publishes_forwarded_in, 1);
}

#[test]
fn legacy_and_unacked_publishes_are_forwarded_too_and_owner_only_ones_are_not() {
    let (mut a, mut b, md) = pair();
    let (key, shard) = key_owned_by(&md, "n2");
    // A legacy client: JSON, acked, keyed; it gets a plain publish_ok.
    let (p, s, _) = raw_session(&mut a, None, None);
    let m = json(&Message::Publish(message::Publish {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        payload: message::B64(bytes::Bytes::from_static(b"legacy")),
        key: Some(message::B64(bytes::Bytes::copy_from_slice(key.as_bytes()))),
        shard: None,
        request_id: Some(1),
        ack: Some(felix_proto::binary::AckMode::PerMessage),
        publish_width: None,
    }));
    a.raw_send(p, s, m, false);
    // Unacked binary: forwarded, not tracked.
    a.raw_send(p, s, publish_binary("orders", &["quiet"], None, Some(&key)), false);
    a.run();
    carry(&mut a, "n1", &mut b);
    carry(&mut b, "n2", &mut a);
    let ms = messages(&a.take_received(p, s));
    assert_eq!(ms, [Message::PublishOk(message::PublishOk { request_id: 1, offset: None })]);
    let on_owner: Vec<_> = b.durable.iter().filter(|w| w.stream == "orders" && w.shard == shard).collect();
    assert_eq!(on_owner.len(), 2, "both landed on the owner");
    // An idempotent publish is owner-only: refused with reason not_leader (the reference's
    // answer), never forwarded.
    let (q, qs, _) = raw_session(&mut a, Some(0x0001), Features::ERROR_CODES.to_words(false).0);
    a.raw_send(
        q,
        qs,
        json(&Message::PublishIdempotent(message::PublishIdempotent {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            payloads: vec![message::B64(bytes::Bytes::from_static(b"x"))],
            key: Some(message::B64(bytes::Bytes::copy_from_slice(key.as_bytes()))),
            request_id: 5,
            producer_id: 1,
            sequence: 0,
            publish_width: None,
        })),
        false,
    );
    a.run();
    assert!(a.to_peers.is_empty(), "not forwarded");
    let ms = messages(&a.take_received(q, qs));
    assert!(
        matches!(&ms[0], Message::PublishRefused(r) if matches!(&r.reason, message::RefusedReason::NotLeader(h) if h.node_id == "n2")),
        "{ms:?}"
    );
}

/// Broker n1 with two acked publishes (request ids 1 and 2) forwarded to their owner n2: the
/// broker, the client's connection and stream, and what went to the peers.
fn two_forwarded_to_n2() -> (Sim, usize, felix_proto::transport::StreamId, Vec<BrokerOutput>) {
    let (mut a, _b, md) = pair();
    let (key, _) = key_owned_by(&md, "n2");
    let (p, s, _) = raw_session(&mut a, Some(0x0001 | 0x0008 | 0x0040 | 0x0200), None);
    a.raw_send(p, s, publish_binary("orders", &["x"], Some(1), Some(&key)), false);
    a.raw_send(p, s, publish_binary("orders", &["y"], Some(2), Some(&key)), false);
    a.run();
    let out = std::mem::take(&mut a.to_peers);
    (a, p, s, out)
}

#[test]
fn an_unreachable_owner_is_shard_unavailable_and_a_silent_one_unacknowledged() {
    let (mut a, p, s, out) = two_forwarded_to_n2();
    let BrokerOutput::Cluster(ClusterOutput::Forward { publish, .. }) = &out[0] else { panic!("{out:?}") };
    // The driver cannot reach n2 for the first; the second is never answered.
    a.broker.handle_forward_failed(publish.id, a.now);
    a.run();
    a.advance(FORWARD_TIMEOUT + std::time::Duration::from_millis(1));
    a.run();
    let acks = acks(&payloads(&a.take_received(p, s)));
    let codes: Vec<_> =
        acks.iter().map(|a| (a.request_id, a.code.as_ref().map(|(c, _)| c.name().into_owned()))).collect();
    assert_eq!(
        codes,
        [(1, Some("shard_unavailable".to_string())), (2, Some("unacknowledged".to_string()))],
        "in request order"
    );
}

#[test]
fn a_broker_that_no_longer_owns_the_shard_refuses_the_forward_and_the_client_is_told_to_retry() {
    let (mut a, mut b, md) = pair();
    let (key, _) = key_owned_by(&md, "n2");
    let (p, s, _) = raw_session(&mut a, Some(0x0001 | 0x0008 | 0x0040 | 0x0200), None);
    a.raw_send(p, s, publish_binary("orders", &["x"], Some(1), Some(&key)), false);
    a.run();
    // Meanwhile n2 left: it owns nothing any more, and says so.
    let mut md2 = md.clone();
    md2.apply(&Command::Remove { id: "n2".into() }).unwrap();
    b.broker.apply_cluster(&md2, "n2", b.now);
    b.run();
    carry(&mut a, "n1", &mut b);
    assert!(b.durable.iter().all(|w| w.stream != "orders"), "nothing written");
    carry(&mut b, "n2", &mut a);
    // The origin's view was behind: nothing was written, and its client is told to retry
    // (`shard_unavailable`, reason `stale`), by when the origin knows the new owner.
    let ack = acks(&payloads(&a.take_received(p, s))).remove(0);
    assert_eq!(
        ack.code.map(|(c, r)| (c.name().into_owned(), r)),
        Some(("shard_unavailable".into(), felix_proto::RetryClass::Retry))
    );
    assert!(ack.message.contains("moved while the publish was forwarded"), "{}", ack.message);
}

/// The owner a publish was forwarded to is declared down (killed with the publish in flight):
/// its answer may never come, so the client is answered `unacknowledged` (outcome unknown) as
/// soon as the metadata says so, not after the whole forward timeout. A forward to an owner
/// that is still up keeps waiting for its answer.
#[test]
fn a_forward_to_an_owner_declared_down_is_answered_at_once() {
    let (mut a, _b, mut md) = pair();
    let (key, _) = key_owned_by(&md, "n2");
    let (p, s, _) = raw_session(&mut a, Some(0x0001 | 0x0008 | 0x0040 | 0x0200), None);
    a.raw_send(p, s, publish_binary("orders", &["x"], Some(1), Some(&key)), false);
    a.run();
    assert_eq!(std::mem::take(&mut a.to_peers).len(), 1, "forwarded to n2");
    // A view that changes nothing about n2 leaves it waiting.
    a.broker.apply_cluster(&md, "n1", a.now);
    a.run();
    assert!(a.take_received(p, s).is_empty(), "still waiting for the owner's answer");
    md.apply(&Command::MarkDown { id: "n2".into() }).unwrap();
    a.advance(std::time::Duration::from_millis(10));
    a.broker.apply_cluster(&md, "n1", a.now);
    a.run();
    let acks = acks(&payloads(&a.take_received(p, s)));
    let codes: Vec<_> =
        acks.iter().map(|a| (a.request_id, a.code.as_ref().map(|(c, _)| c.name().into_owned()))).collect();
    assert_eq!(codes, [(1, Some("unacknowledged".to_string()))], "answered when n2 was declared down");
}

/// The driver's connection to the owner closed with two publishes forwarded on it: both are
/// answered `unacknowledged` (outcome unknown) at once, in request order, not after the
/// forward timeout; a later answer from the owner for either changes nothing.
#[test]
fn forwards_on_a_lost_peer_connection_are_answered_outcome_unknown_at_once() {
    let (mut a, p, s, out) = two_forwarded_to_n2();
    assert_eq!(out.len(), 2, "{out:?}");
    // A connection to another peer closing changes nothing.
    a.broker.handle_peer_connection_lost("n3", a.now);
    a.run();
    assert!(a.take_received(p, s).is_empty());
    a.broker.handle_peer_connection_lost("n2", a.now);
    a.run();
    let acks = acks(&payloads(&a.take_received(p, s)));
    let codes: Vec<_> =
        acks.iter().map(|a| (a.request_id, a.code.as_ref().map(|(c, _)| c.name().into_owned()))).collect();
    assert_eq!(codes, [(1, Some("unacknowledged".to_string())), (2, Some("unacknowledged".to_string()))]);
    assert!(acks[0].message.contains("connection to the shard's owner n2 was lost"), "{}", acks[0].message);
    // The forward timeout later answers nothing twice.
    a.advance(FORWARD_TIMEOUT + std::time::Duration::from_millis(1));
    a.run();
    assert!(a.take_received(p, s).is_empty());
}
