//! Stream deletion by users (FEATURE_STREAM_ADMIN, `stream_delete`): admin permission, the
//! subscribers told, waiting publishes answered, storage told to remove the files, and a stream
//! of the same name created again from scratch.

mod support;

use bytes::Bytes;
use felix_proto::broker::{StreamConfig, StreamSpec};
use felix_proto::features::Features;
use felix_proto::message::{self, Message};
use felix_proto::sim::{Sim, StorageMode};
use support::*;

fn delete(stream: &str, request_id: u64) -> Bytes {
    json(&Message::StreamDelete(message::StreamDelete {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        request_id,
    }))
}

fn deleted(request_id: u64, existed: bool) -> Message {
    Message::StreamDeleteOk(message::StreamDeleteOk { request_id, existed })
}

fn features(f: Features) -> Option<u32> {
    f.to_words(false).0
}

#[test]
fn deleting_a_stream_ends_its_subscriptions_answers_its_publishes_and_removes_its_files() {
    let mut sim = Sim::new(config(), epoch());
    // A client that offers the second feature word learns the broker serves stream_delete.
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let (lo, hi) = (Features::ERROR_CODES | Features::STREAM_ADMIN | Features::ACK_ON_COMMIT).to_words(true);
    sim.raw_send(p, s, auth(Some(0x1001), lo, hi), false);
    sim.run();
    let auth_ok = messages(&sim.take_received(p, s)).remove(0);
    let Message::AuthOk(a) = &auth_ok else { panic!("{auth_ok:?}") };
    assert!(Features::from_words(a.server_features, a.server_features_hi).contains(Features::STREAM_ADMIN));
    let (q, qs, _) = raw_session(&mut sim, Some(1), None);
    sim.raw_send(
        p,
        s,
        publish_json("orders", "kept-before", Some(1), Some(felix_proto::binary::AckMode::PerMessage)),
        false,
    );
    sim.raw_send(q, qs, subscribe("orders", Some(message::StartPosition::Earliest)), false);
    sim.run();
    sim.take_received(p, s);
    assert!(sim.durable.iter().any(|w| w.stream == "orders"));
    // A publish still on its way to storage when the stream goes (acked after the write).
    sim.storage = StorageMode::Manual;
    sim.raw_send(
        p,
        s,
        publish_json("orders", "in-flight", Some(2), Some(felix_proto::binary::AckMode::PerMessage)),
        false,
    );
    sim.raw_send(p, s, delete("orders", 3), false);
    sim.raw_send(p, s, delete("orders", 4), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::PublishError(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("not_found"), "{e:?}");
    assert_eq!(ms[1..], [deleted(3, true), deleted(4, false)]);
    assert!(sim.durable.iter().all(|w| w.stream != "orders"), "storage removed what it held");
    assert!(sim.pending_writes.is_empty());
    // The subscriber (no FEATURE_STREAM_DELETED) saw its stream end after what it had.
    let ev = event_streams(&sim, q)[0];
    assert!(sim.clients[q].finished.contains(&ev));
    // The name can be used again: a new stream, from offset 0.
    sim.storage = StorageMode::Immediate;
    sim.raw_send(p, s, publish_json("orders", "new", Some(5), Some(felix_proto::binary::AckMode::PerMessage)), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms, [Message::PublishOk(message::PublishOk { request_id: 5, offset: Some(0) })]);
}

#[test]
fn only_an_admin_may_delete_and_the_broker_owns_dollar_streams() {
    let mut cfg = config();
    cfg.tokens.push(publish_only_token());
    let mut sim = Sim::new(cfg, epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let auth = auth_publish_only(features(Features::ERROR_CODES));
    sim.raw_send(p, s, auth, false);
    sim.raw_send(p, s, publish_json("orders", "x", Some(1), Some(felix_proto::binary::AckMode::PerMessage)), false);
    sim.raw_send(p, s, delete("orders", 2), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[2] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("forbidden"));
    assert!(sim.durable.iter().any(|w| w.stream == "orders"), "nothing deleted");
    let (a, sa, _) = raw_session(&mut sim, Some(1), features(Features::ERROR_CODES));
    sim.raw_send(a, sa, delete("$groups.0.orders", 3), false);
    sim.run();
    let ms = messages(&sim.take_received(a, sa));
    assert!(
        matches!(&ms[0], Message::Error(e) if e.code.as_ref().is_some_and(|c| c.name() == "invalid_request")),
        "{ms:?}"
    );
}

#[test]
fn a_configured_stream_comes_back_with_its_configured_width() {
    let mut cfg = config();
    cfg.auto_create = false;
    cfg.streams.push(StreamSpec {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        name: "wide".into(),
        config: StreamConfig { shards: 4, ..StreamConfig::default() },
    });
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(1), features(Features::ERROR_CODES | Features::STREAM_SHARDS));
    sim.raw_send(p, s, delete("wide", 1), false);
    sim.raw_send(
        p,
        s,
        json(&Message::StreamShards(message::StreamShards {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "wide".into(),
            request_id: 2,
        })),
        false,
    );
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms[0], deleted(1, true));
    assert!(matches!(&ms[1], Message::StreamShardsView(v) if v.shards == 4), "{ms:?}");
}

/// Draining: a control stream authenticating after `begin_drain` is refused `draining` (retry)
/// when it offered codes, and gets no answer at all otherwise; streams already open go on being
/// served, and what storage has not confirmed is counted as work in flight.
#[test]
fn a_draining_broker_refuses_new_streams_and_serves_open_ones() {
    use felix_proto::broker::{Broker, BrokerOutput, PeerAddr, StorageOutput, TransportOutput, WriteOutcome};
    use felix_proto::features::Features;
    use felix_proto::transport::{Dir, Side, StreamId, WallClock};
    let now = epoch();
    let mut b = Broker::new(config(), WallClock::new(now, 1_700_000_000_000_000));
    let take = |b: &mut Broker| {
        let mut out = Vec::new();
        let mut writes = Vec::new();
        while let Some(o) = b.poll_output() {
            match o {
                BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => out.extend_from_slice(&data),
                BrokerOutput::Storage(StorageOutput::Persist(w)) => writes.push(w.token),
                _ => {}
            }
        }
        (out, writes)
    };
    let open = StreamId::new(Side::Client, Dir::Bi, 0);
    let conn = b.admit(PeerAddr([1; 16]), now).unwrap();
    b.handle_stream_data(conn, open, auth(Some(0x0001 | 0x0008), None, None), false, now);
    take(&mut b);
    // An acked publish whose write storage has not confirmed yet.
    b.handle_stream_data(
        conn,
        open,
        publish_json("orders", "a", Some(1), Some(felix_proto::binary::AckMode::PerBatch)),
        false,
        now,
    );
    let (mut answers, writes) = take(&mut b);
    assert_eq!(writes.len(), 1);
    assert!(!b.is_draining() && b.work_in_flight() >= 1);
    b.begin_drain(now);
    assert!(b.is_draining());
    // New streams: `draining` with codes, silence without.
    let (lo, hi) = Features::ERROR_CODES.to_words(true);
    let s1 = StreamId::new(Side::Client, Dir::Bi, 1);
    b.handle_stream_data(conn, s1, auth(Some(1), lo, hi), false, now);
    let (out, _) = take(&mut b);
    let m = messages(&out);
    assert!(
        matches!(&m[..], [Message::Error(e)] if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("draining")),
        "{m:?}"
    );
    let s2 = StreamId::new(Side::Client, Dir::Bi, 2);
    b.handle_stream_data(conn, s2, auth(Some(1), None, None), false, now);
    assert!(take(&mut b).0.is_empty(), "a client without codes gets no answer");
    // The open stream is still served; once storage confirms, nothing is in flight.
    b.handle_write_result(writes[0], WriteOutcome::Written, now);
    answers.extend(take(&mut b).0);
    b.handle_stream_data(
        conn,
        open,
        publish_json("orders", "b", Some(2), Some(felix_proto::binary::AckMode::PerBatch)),
        false,
        now,
    );
    let (out, writes) = take(&mut b);
    answers.extend(out);
    assert_eq!(writes.len(), 1, "an open stream still publishes while draining");
    b.handle_write_result(writes[0], WriteOutcome::Written, now);
    answers.extend(take(&mut b).0);
    let m = messages(&answers);
    assert!(matches!(m[..], [Message::PublishOk(_), Message::PublishOk(_)]), "both publishes answered: {m:?}");
    assert_eq!(b.work_in_flight(), 0);
    assert_eq!(b.stats().auths_refused_draining, 2);
}

/// A publisher paused because the stream's writes backed up is let go when the stream is
/// deleted: nothing is left to resume it otherwise, and its next publishes (which create the
/// stream again) would wait for ever.
#[test]
fn deleting_a_stream_lets_go_of_the_publishers_its_storage_paused() {
    let (mut sim, _, _) = publisher_paused_by_storage();
    let asked = sim.writes.len();
    assert!(asked < 20, "paused: {asked} writes asked");
    assert!(sim.broker.delete_stream("t1", "default", "orders", sim.now));
    sim.run();
    assert!(sim.writes.len() > asked, "read again: {} writes asked", sim.writes.len());
}

/// The same for a publisher held by a slow subscriber of a stream kept in memory.
#[test]
fn deleting_a_stream_lets_go_of_the_publishers_its_slow_subscriber_held() {
    let (mut sim, slow, _, (p, s)) = slow_and_fast(ephemeral_config(), 8);
    sim.set_slow(slow, true);
    publish_n(&mut sim, (p, s), 0..50);
    let early = acks(&payloads(&sim.take_received(p, s))).len();
    assert!(early < 20, "held: {early} of 50 answered");
    assert!(sim.broker.delete_stream("t1", "default", "orders", sim.now));
    sim.run();
    assert_eq!(early + acks(&payloads(&sim.take_received(p, s))).len(), 50, "every publish answered, no time passing");
}
