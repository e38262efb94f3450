//! Capability negotiation, and every "sent only to a client that offered X" rule, checked byte
//! for byte against what a client that did not offer X receives.

mod support;

use bytes::Bytes;
use felix_proto::binary::{AckMode, OwnerHint};
use felix_proto::client::{ClientConfig, ClientConnection, ClientEvent, ClientOutput, PublishRequest};
use felix_proto::features::Features;
use felix_proto::flags::Flags;
use felix_proto::message::{self, Message, StartPosition};
use felix_proto::sim::Sim;
use felix_proto::transport::{Dir, OpenToken, Side, StreamId};
use felix_proto::{Payload, frame::Frame};

use support::*;

#[test]
fn row1_negotiating_client_and_broker_get_auth_ok() {
    let mut sim = Sim::new(config(), epoch());
    let (_, _, answer) = raw_session(&mut sim, Some(25), Some(0x0800));
    let Message::AuthOk(ok) = answer else { panic!("{answer:?}") };
    assert_eq!(ok.server_flags, 0x7FFF, "the broker's full set, not the intersection (D8)");
    let f = Features::from_words(ok.server_features, ok.server_features_hi);
    assert!(f.contains(Features::ERROR_CODES));
    assert_eq!(ok.server_features_hi, None, "no second word toward a client without FEATURE_EXTENDED");
    assert_eq!(ok.publish_window, None, "no window for a client that did not offer pipelining");

    // The state-machine client sees the same and chooses binary acked publishes.
    let mut sim = Sim::new(config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let ev = sim.take_events(c);
    let Some(ClientEvent::Connected { negotiated, .. }) = ev.first() else { panic!("{ev:?}") };
    assert!(negotiated.may_send(Flags::BINARY_PUBLISH_ACKED));
    assert_eq!(negotiated.publish_window, Some(256));
    assert!(negotiated.per_stream_window);
}

#[test]
fn row2_negotiating_client_and_legacy_broker_falls_back_to_json() {
    // A legacy broker answers plain `ok` and ignores client_flags.
    let now = epoch();
    let mut c = ClientConnection::new(ClientConfig::new("t1", TOKEN), now);
    let Some(ClientOutput::OpenBi { token }) = c.poll_output() else { panic!() };
    let s = StreamId::new(Side::Client, Dir::Bi, 0);
    c.handle_stream_opened(token, s, now);
    let Some(ClientOutput::Transmit { data, .. }) = c.poll_output() else { panic!() };
    let Message::Auth(a) = messages(&data).remove(0) else { panic!() };
    // Bit 15 with the codecs it decodes and envelopes (D56, D58); a legacy broker masks both off.
    assert_eq!((a.client_flags, a.client_flags_hi), (Some(0xFFFF), Some(7)));
    c.handle_stream_data(s, json(&Message::Ok(message::OkMsg {})), false, now);
    let Some(ClientEvent::Connected { negotiated, .. }) = c.poll_event() else { panic!() };
    assert_eq!(negotiated.server_flags, Flags::ORIGINAL_V1);
    assert_eq!(negotiated.publish_window, None);
    // An acked publish goes as JSON and a plain one as a 0x0001 frame. A keyed one is refused:
    // a broker that did not advertise 0x0040 does not route by key (the released one drops a
    // JSON publish's key), so sending it would silently change ordering.
    let stream = felix_proto::client::ClientStream(0);
    let p = |k: Option<&str>, ack| PublishRequest {
        key: k.map(|k| Bytes::copy_from_slice(k.as_bytes())),
        ack,
        ..PublishRequest::new("default", "s", vec![Bytes::from("x")])
    };
    c.publish(stream, p(None, true), now).unwrap();
    assert_eq!(
        c.publish(stream, p(Some("k"), false), now),
        Err(felix_proto::client::CommandError::NotNegotiated("FLAG_BINARY_PUBLISH_KEYED (routing by key)"))
    );
    c.publish(stream, p(None, false), now).unwrap();
    let sent: Vec<Frame> = std::iter::from_fn(|| c.poll_output())
        .flat_map(|o| match o {
            ClientOutput::Transmit { data, .. } => frames(&data),
            _ => vec![],
        })
        .collect();
    assert_eq!(sent.iter().map(|f| f.flags.bits()).collect::<Vec<_>>(), vec![0, 1]);
    let Payload::Json(felix_proto::Decoded::Message(Message::PublishBatch(pb))) = sent[0].decode_payload().unwrap()
    else {
        panic!()
    };
    assert_eq!((pb.ack, pb.request_id.is_some()), (Some(AckMode::PerBatch), true));
    // Explicit shards need a broker that advertised them.
    let mut ps = p(None, false);
    ps.shard = Some(1);
    assert!(c.publish(stream, ps, now).is_err());
    let _ = OpenToken(0);
}

#[test]
fn row3_legacy_client_and_negotiating_broker_gets_ok_and_old_frames() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, answer) = raw_session(&mut sim, None, None);
    assert_eq!(answer, Message::Ok(message::OkMsg {}), "plain ok, never auth_ok");
    // An error carries no code fields.
    sim.raw_send(p, s, publish_json("orders", "x", None, Some(AckMode::PerBatch)), false);
    sim.run();
    let got = sim.take_received(p, s);
    assert_eq!(
        got,
        json(&Message::Error(message::ErrorMsg {
            message: "an acked publish needs a request_id".into(),
            code: None,
            retry: None,
            detail: None
        }))
    );
    // A subscription: no join offsets; events as plain 0x0004 batches.
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Earliest)), false);
    sim.raw_send(p, s, publish_json("orders", "hello", Some(1), Some(AckMode::PerBatch)), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(
        ms[0],
        Message::Subscribed(message::Subscribed {
            subscription_id: 1,
            start_offset: None,
            live_offset: None,
            queue_capacity: None
        })
    );
    assert_eq!(ms[1], Message::PublishOk(message::PublishOk { request_id: 1, offset: None }));
    let es = event_streams(&sim, p);
    let bytes = sim.take_received(p, es[0]);
    let fs = frames(&bytes);
    assert_eq!(fs[0].payload, Bytes::from_static(br#"{"type":"event_stream_hello","subscription_id":1}"#));
    assert_eq!(fs[1].flags, Flags::BINARY_EVENT_BATCH_SHARED, "no offsets, publisher or timestamps");
}

#[test]
fn row4_legacy_client_sends_no_client_flags() {
    let now = epoch();
    let mut cfg = ClientConfig::new("t1", TOKEN);
    cfg.flags = None;
    cfg.features = Features::NONE;
    let mut c = ClientConnection::new(cfg, now);
    let Some(ClientOutput::OpenBi { token }) = c.poll_output() else { panic!() };
    c.handle_stream_opened(token, StreamId(0), now);
    let Some(ClientOutput::Transmit { data, .. }) = c.poll_output() else { panic!() };
    assert_eq!(data, auth(None, None, None));
    c.handle_stream_data(StreamId(0), json(&Message::Ok(message::OkMsg {})), false, now);
    assert!(matches!(c.poll_event(), Some(ClientEvent::Connected { .. })));
}

#[test]
fn extended_word_only_to_a_client_that_set_the_marker() {
    let mut sim = Sim::new(config(), epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    sim.raw_send(p, s, auth(Some(25), Some(0x8000_0000 | 0x0800), Some(0x2)), false);
    sim.run();
    let Message::AuthOk(ok) = messages(&sim.take_received(p, s)).remove(0) else { panic!() };
    let f = Features::from_words(ok.server_features, ok.server_features_hi);
    assert!(ok.server_features.unwrap() & 0x8000_0000 != 0);
    assert!(f.contains(Features::PUBLISH_WIDTH) && f.contains(Features::EXPLICIT_SHARD));
}

/// Two raw sessions: one offering everything, one offering nothing (legacy).
fn pair(sim: &mut Sim) -> ((usize, StreamId), (usize, StreamId)) {
    let (lo, hi) = Features::known().to_words(true);
    let a = sim.connect_raw();
    let sa = sim.raw_open_bi(a);
    sim.raw_send(a, sa, auth(Some(0x7FFF), lo, hi), false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(a, sa))[0], Message::AuthOk(_)));
    let (b, sb, _) = raw_session(sim, None, None);
    ((a, sa), (b, sb))
}

#[test]
fn error_codes_only_for_error_codes_clients() {
    let mut sim = Sim::new(config(), epoch());
    let ((a, sa), (b, sb)) = pair(&mut sim);
    for (p, s) in [(a, sa), (b, sb)] {
        sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Offset(999))), false);
        let mut bad = subscribe("orders", None).to_vec();
        bad.truncate(bad.len() - 1);
        // a cursor error is not an error; use an unknown shard instead
        let _ = bad;
        sim.raw_send(
            p,
            s,
            json(&Message::Subscribe(message::Subscribe {
                tenant_id: "t1".into(),
                namespace: "default".into(),
                stream: "orders".into(),
                subscription_id: None,
                start: None,
                shard: Some(7),
                queue_capacity: None,
                filter: None,
            })),
            false,
        );
    }
    sim.run();
    let ma = messages(&sim.take_received(a, sa));
    let mb = messages(&sim.take_received(b, sb));
    let Message::Error(ea) = &ma[1] else { panic!("{ma:?}") };
    assert_eq!(ea.code.as_ref().map(|c| c.name()).as_deref(), Some("invalid_request"));
    assert_eq!(json(&mb[1]), json_raw(r#"{"type":"error","message":"stream has no shard 7 (it has 1)"}"#));
}

/// In a cluster (the only place a shard is owned elsewhere, and the only broker that advertises
/// FEATURE_REDIRECT): `not_leader` only to clients that offered it.
#[test]
fn not_leader_only_for_redirect_clients() {
    let mut sim = Sim::new(felix_proto::broker::BrokerConfig { clustered: true, ..config() }, epoch());
    let ((a, sa), (b, sb)) = pair(&mut sim);
    sim.raw_send(a, sa, subscribe("orders", None), false);
    sim.run();
    sim.take_received(a, sa);
    let owner = OwnerHint { node_id: "broker-b".into(), addr: Some("10.0.0.5:5000".into()), generation: 9 };
    assert!(sim.broker.move_shard("t1", "default", "orders", 0, owner, sim.now));
    for (p, s) in [(a, sa), (b, sb)] {
        sim.raw_send(p, s, subscribe("orders", None), false);
    }
    sim.run();
    assert_eq!(
        sim.take_received(a, sa),
        json(&Message::NotLeader(message::NotLeader {
            node_id: "broker-b".into(),
            addr: Some("10.0.0.5:5000".into()),
            generation: 9
        }))
    );
    assert_eq!(sim.take_received(b, sb), json_raw(r#"{"type":"error","message":"shard 0 is owned by broker-b"}"#));
}

#[test]
fn shard_moved_only_for_shard_moved_clients() {
    let mut sim = Sim::new(config(), epoch());
    let ((a, sa), (b, sb)) = pair(&mut sim);
    for (p, s) in [(a, sa), (b, sb)] {
        sim.raw_send(p, s, subscribe("orders", None), false);
    }
    sim.run();
    sim.raw_send(a, sa, publish_binary("orders", &["one"], None, None), false);
    sim.run();
    let owner = OwnerHint { node_id: "broker-b".into(), addr: None, generation: 3 };
    sim.broker.move_shard("t1", "default", "orders", 0, owner, sim.now);
    sim.run();
    let ea = event_streams(&sim, a)[0];
    let eb = event_streams(&sim, b)[0];
    assert!(sim.clients[a].finished.contains(&ea) && sim.clients[b].finished.contains(&eb));
    let pa = payloads(&sim.take_received(a, ea));
    let Payload::Json(felix_proto::Decoded::Message(Message::ShardMoved(m))) = pa.last().unwrap() else {
        panic!("{pa:?}")
    };
    assert_eq!((m.resume_from, m.generation, m.node_id.as_deref()), (Some(1), 3, Some("broker-b")));
    // The legacy client: hello, its event, then the plain end.
    let pb = payloads(&sim.take_received(b, eb));
    assert_eq!(pb.len(), 2);
    assert!(matches!(pb[1], Payload::Events(_)));
}

#[test]
fn stream_deleted_only_for_stream_deleted_clients() {
    let mut sim = Sim::new(config(), epoch());
    let ((a, sa), (b, sb)) = pair(&mut sim);
    for (p, s) in [(a, sa), (b, sb)] {
        sim.raw_send(p, s, subscribe("orders", None), false);
    }
    sim.run();
    assert!(sim.broker.delete_stream("t1", "default", "orders", sim.now));
    sim.run();
    let ea = event_streams(&sim, a)[0];
    let eb = event_streams(&sim, b)[0];
    let pa = messages(&sim.take_received(a, ea));
    assert_eq!(pa.last().unwrap(), &Message::StreamDeleted(message::StreamDeleted { subscription_id: 1 }));
    let pb = messages(&sim.take_received(b, eb));
    assert_eq!(pb.len(), 1, "only the hello: the stream just ends");
    assert!(sim.clients[b].finished.contains(&eb));
}

#[test]
fn unsupported_only_for_unsupported_clients() {
    let mut sim = Sim::new(config(), epoch());
    let ((a, sa), (b, sb)) = pair(&mut sim);
    let unknown = json_raw(r#"{"type":"frobnicate","request_id":4}"#);
    sim.raw_send(a, sa, unknown.clone(), false);
    sim.raw_send(b, sb, unknown, false);
    sim.run();
    assert_eq!(
        sim.take_received(a, sa),
        json(&Message::Unsupported(message::Unsupported {
            request_type: "frobnicate".into(),
            request_id: Some(4),
            extension: None
        }))
    );
    assert!(!sim.clients[a].stopped.contains(&sa), "the stream is kept");
    assert_eq!(sim.take_received(b, sb), Bytes::new(), "nothing is answered");
    assert!(sim.clients[b].stopped.contains(&sb), "the stream is closed");
    // A catalogue request whose feature the broker does not serve is treated the same way.
    sim.raw_send(a, sa, json(&Message::Topology(message::Topology {})), false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(a, sa))[0], Message::Unsupported(_)));
}

/// One admission table (`client::needs::request_feature`): a broker without storage does not
/// advertise counters, and a counter request is then answered as unknown; with storage it is
/// advertised and served.
#[test]
fn a_request_is_served_exactly_when_its_feature_is_advertised() {
    for storage in [false, true] {
        let mut cfg = config();
        cfg.history_reads = storage;
        assert_eq!(cfg.server_features().contains(felix_proto::Features::COUNTERS), storage);
        let mut sim = Sim::new(cfg, epoch());
        let ((a, sa), _) = pair(&mut sim);
        let get = message::CounterGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "hits".into(),
            key: "k".into(),
            request_id: 9,
        };
        sim.raw_send(a, sa, json(&Message::CounterGet(get)), false);
        sim.run();
        let answer = messages(&sim.take_received(a, sa)).remove(0);
        match (storage, answer) {
            (false, Message::Unsupported(u)) => {
                assert_eq!((u.request_type.as_str(), u.request_id), ("counter_get", Some(9)))
            }
            (true, Message::CounterValue(v)) => assert_eq!(v.request_id, 9),
            other => panic!("{other:?}"),
        }
    }
}

fn json_raw(s: &str) -> Bytes {
    let mut b = bytes::BytesMut::new();
    felix_proto::frame::FrameHeader { flags: Flags::EMPTY, length: s.len() as u32 }.encode(&mut b);
    b.extend_from_slice(s.as_bytes());
    b.freeze()
}

#[test]
fn publish_ok_offset_only_for_offset_clients() {
    let mut cfg = config();
    cfg.ack_on_commit = true;
    let mut sim = Sim::new(cfg, epoch());
    let (a, sa, _) = raw_session(&mut sim, Some(0x7FFF), None);
    let (b, sb, _) = raw_session(&mut sim, Some(0x0019), None);
    let (c, sc, _) = raw_session(&mut sim, None, None);
    sim.raw_send(a, sa, publish_json("orders", "x", Some(1), Some(AckMode::PerBatch)), false);
    sim.raw_send(b, sb, publish_json("orders", "x", Some(1), Some(AckMode::PerBatch)), false);
    sim.raw_send(c, sc, publish_json("orders", "x", Some(1), Some(AckMode::PerBatch)), false);
    sim.raw_send(a, sa, publish_binary("orders", &["y"], Some(2), None), false);
    sim.raw_send(b, sb, publish_binary("orders", &["y"], Some(2), None), false);
    sim.run();
    let ra = payloads(&sim.take_received(a, sa));
    let rb = payloads(&sim.take_received(b, sb));
    assert_eq!(
        ra[0],
        Payload::Json(felix_proto::Decoded::Message(Message::PublishOk(message::PublishOk {
            request_id: 1,
            offset: Some(0)
        })))
    );
    assert_eq!(acks(&ra)[0].offset, Some(1), "a's second publish follows its first (parties run in order)");
    assert_eq!(json(&messages(&sim.take_received(c, sc))[0]), json_raw(r#"{"type":"publish_ok","request_id":1}"#));
    // 0x0019 did not offer 0x1000: plain JSON answer and the plain 11-byte binary ack.
    let Payload::Json(felix_proto::Decoded::Message(Message::PublishOk(okb))) = &rb[0] else { panic!() };
    assert_eq!(okb.offset, None);
    let plain = acks(&rb)[0].clone();
    assert_eq!(plain.offset, None);
}

fn event_frames_for(flags: Option<u16>, gen_start: bool) -> Vec<Frame> {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, flags, None);
    sim.raw_send(p, s, publish_binary("orders", &["a"], None, None), false);
    sim.run();
    if gen_start {
        sim.broker.start_generation("t1", "default", "orders", 0, sim.now);
        sim.run();
    }
    sim.raw_send(p, s, publish_binary("orders", &["b", "c"], None, None), false);
    sim.run();
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Earliest)), false);
    sim.run();
    let e = event_streams(&sim, p)[0];
    frames(&sim.take_received(p, e)).into_iter().skip(1).collect()
}

#[test]
fn offsets_skipped_publisher_timestamps_only_when_offered() {
    // Legacy: plain shared batches, byte-identical to a pre-negotiation broker's.
    let legacy = event_frames_for(None, true);
    assert!(legacy.iter().all(|f| f.flags == Flags::BINARY_EVENT_BATCH_SHARED));
    assert_eq!(&legacy[1].payload[..], b"\x00\x00\x00\x02\x00\x00\x00\x01b\x00\x00\x00\x01c");
    // Offsets only.
    let offsets = event_frames_for(Some(0x0027), true);
    assert!(offsets.iter().all(|f| f.flags == Flags(0x0024)));
    // Offsets and skipped_before: only the batch right after the generation-start record has it.
    let skipped = event_frames_for(Some(0x0827), true);
    assert_eq!(skipped[0].flags, Flags(0x0024));
    assert_eq!(skipped[1].flags, Flags(0x0824));
    let Payload::Events(e) = skipped[1].decode_payload().unwrap() else { panic!() };
    assert_eq!((e.base_offset, e.skipped_before), (Some(2), Some(1)));
    // Without a generation start nobody sees 0x0800.
    assert!(event_frames_for(Some(0x0827), false).iter().all(|f| f.flags == Flags(0x0024)));
    // Publisher and timestamps.
    let all = event_frames_for(Some(0x7FFF), true);
    let Payload::Events(e) = all[1].decode_payload().unwrap() else { panic!() };
    assert_eq!(all[1].flags, Flags(0x6824));
    assert_eq!(e.publisher.as_deref(), Some(&b"dev"[..]));
    assert!(e.records.iter().all(|r| r.timestamp_micros == Some(1_760_000_000_000_000)));
}

#[test]
fn subscription_lagged_only_with_the_feature_and_offsets() {
    for (flags, features, lagged) in
        [(Some(0x0027u16), Some(0x0020_0000u32), true), (Some(0x0007), Some(0x0020_0000), false), (None, None, false)]
    {
        // A writer credit of one byte: once the hello is written, batches wait in the queue
        // until the slow reader flushes.
        let mut cfg = config();
        cfg.event_stream_inflight_bytes = 1;
        let mut sim = Sim::new(cfg, epoch());
        let (p, s, _) = raw_session(&mut sim, flags, features);
        sim.raw_send(
            p,
            s,
            json(&Message::Subscribe(message::Subscribe {
                tenant_id: "t1".into(),
                namespace: "default".into(),
                stream: "orders".into(),
                subscription_id: None,
                start: None,
                shard: None,
                queue_capacity: Some(2),
                filter: None,
            })),
            false,
        );
        sim.run();
        sim.set_slow(p, true);
        for i in 0..5 {
            sim.raw_send(p, s, publish_binary("orders", &[&format!("m{i}")], None, None), false);
            sim.run();
        }
        // The first batch is in flight, two are queued, the other two were dropped.
        sim.set_slow(p, false);
        sim.run();
        let e = event_streams(&sim, p)[0];
        let got = payloads(&sim.take_received(p, e));
        let batches = event_batches(&got);
        assert_eq!(batches.len(), 3, "{flags:?}");
        // A lagged subscription is offered nothing after its first drop.
        assert_eq!(sim.broker.stats().records_dropped, if lagged { 1 } else { 2 });
        let last = got.last().unwrap();
        if lagged {
            assert_eq!(
                last,
                &Payload::Json(felix_proto::Decoded::Message(Message::SubscriptionLagged(
                    message::SubscriptionLagged { subscription_id: 1, resume_from: 3 }
                )))
            );
            assert!(sim.clients[p].finished.contains(&e));
        } else {
            assert!(matches!(last, Payload::Events(_)));
            assert!(!sim.clients[p].finished.contains(&e), "the subscription goes on");
            // The drop shows as a jump in offsets to a client that reads them.
            sim.raw_send(p, s, publish_binary("orders", &["late"], None, None), false);
            sim.run();
            let more = event_batches(&payloads(&sim.take_received(p, e)));
            assert_eq!(more.len(), 1);
            assert_eq!(more[0].base_offset, None, "offsets were not negotiated");
        }
    }
}
