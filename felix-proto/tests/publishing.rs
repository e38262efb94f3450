//! Publishing: every encoding, replies matching the request's encoding, routing, pipelined
//! windows, acknowledgement on commit, storage failures and malformed input.

mod support;

use bytes::Bytes;
use felix_proto::binary::{AckMode, AckStatus};
use felix_proto::broker::{StreamConfig, StreamSpec};
use felix_proto::client::{ClientConfig, ClientEvent, ClientStream, CommandError, PublishRequest};
use felix_proto::error_code::ErrorCode;
use felix_proto::features::Features;
use felix_proto::message::{self, Message, Routing};
use felix_proto::routing::shard_for_key;
use felix_proto::sim::{Sim, StorageMode};
use felix_proto::transport::close_code;
use felix_proto::{Decoded, Payload};
use support::*;

fn ok_of(p: &Payload) -> Option<(u64, Option<u64>)> {
    match p {
        Payload::Json(Decoded::Message(Message::PublishOk(ok))) => Some((ok.request_id, ok.offset)),
        _ => None,
    }
}

#[test]
fn json_ack_modes_and_binary_forms_get_the_matching_reply() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    sim.raw_send(p, s, publish_json("orders", "none", Some(1), None), false); // D9: no ack, no answer
    sim.raw_send(p, s, publish_json("orders", "none2", None, Some(AckMode::None)), false);
    sim.raw_send(p, s, publish_json("orders", "pm", Some(2), Some(AckMode::PerMessage)), false);
    sim.raw_send(
        p,
        s,
        json(&Message::PublishBatch(message::PublishBatchMsg {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            payloads: vec!["a".into(), "b".into()],
            key: None,
            shard: None,
            request_id: Some(3),
            ack: Some(AckMode::PerBatch),
            publish_width: None,
        })),
        false,
    );
    sim.raw_send(p, s, publish_binary("orders", &["plain"], None, None), false);
    sim.raw_send(p, s, publish_binary("orders", &["acked"], Some(4), None), false);
    sim.raw_send(p, s, publish_binary("orders", &["keyed"], Some(5), Some("k")), false);
    sim.run();
    let got = payloads(&sim.take_received(p, s));
    assert_eq!(got.len(), 4, "{got:?}");
    assert_eq!(ok_of(&got[0]), Some((2, None)));
    assert_eq!(ok_of(&got[1]), Some((3, None)));
    let a = acks(&got);
    assert_eq!(
        a.iter().map(|a| (a.request_id, a.status)).collect::<Vec<_>>(),
        vec![(4, AckStatus::Ok), (5, AckStatus::Ok)]
    );
    assert_eq!(sim.broker.shard_state("t1", "default", "orders", 0).unwrap().2, 8, "every record appended once");
}

#[test]
fn keyed_routing_uses_the_documented_hash_and_explicit_shards_are_checked() {
    let mut cfg = config();
    cfg.streams.push(StreamSpec {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        name: "wide".into(),
        config: StreamConfig { shards: 8, ..StreamConfig::default() },
    });
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    for k in ["customer-0", "customer-4", "customer-1", "customer-6", "customer-2"] {
        sim.raw_send(p, s, publish_binary("wide", &["x"], None, Some(k)), false);
    }
    sim.raw_send(p, s, publish_binary("wide", &["x"], None, None), false);
    sim.run();
    let counts: Vec<u64> = (0..8).map(|i| sim.broker.shard_state("t1", "default", "wide", i).unwrap().2).collect();
    // customer-0→0, -4→2, -1→3, -6→4, -2→6, unkeyed→0.
    assert_eq!(counts, vec![2, 0, 1, 1, 1, 0, 1, 0]);
    assert_eq!(shard_for_key(Some(b"customer-6"), 8, Routing::Modulo), 4);
    // Explicit shard: honoured, and an unknown one is refused.
    let explicit = |shard, rid| {
        json(&Message::Publish(message::Publish {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "wide".into(),
            payload: "e".into(),
            key: Some("customer-0".into()),
            shard: Some(shard),
            request_id: Some(rid),
            ack: Some(AckMode::PerBatch),
            publish_width: None,
        }))
    };
    sim.raw_send(p, s, explicit(5, 10), false);
    sim.raw_send(p, s, explicit(8, 11), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert!(matches!(ms[0], Message::PublishOk(_)));
    let Message::PublishError(e) = &ms[1] else { panic!("{ms:?}") };
    assert_eq!((e.request_id, e.code.clone()), (11, Some(ErrorCode::InvalidRequest)));
    assert_eq!(sim.broker.shard_state("t1", "default", "wide", 5).unwrap().2, 1);
}

#[test]
fn stale_width_refuses_keyed_batches_routed_by_another_width() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    sim.raw_send(
        p,
        s,
        json(&Message::PublishWidth(message::PublishWidth {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            width: 8,
        })),
        false,
    );
    sim.raw_send(p, s, publish_binary("orders", &["k"], Some(1), Some("key")), false);
    sim.raw_send(p, s, publish_binary("orders", &["u"], Some(2), None), false); // unkeyed: not checked
    sim.run();
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!(a[0].status, AckStatus::Error);
    assert_eq!(a[0].code.as_ref().map(|(c, _)| c.number()), Some(17));
    assert_eq!(a[1].status, AckStatus::Ok);
}

#[test]
fn ack_on_commit_answers_after_storage_with_offsets() {
    let mut sim = Sim::new(config(), epoch());
    sim.storage = StorageMode::Manual;
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ACK_ON_COMMIT.0 as u32));
    let (q, sq, _) = raw_session(&mut sim, Some(0x7FFF), None);
    sim.raw_send(p, s, publish_binary("orders", &["a", "b"], Some(1), None), false);
    sim.raw_send(q, sq, publish_binary("orders", &["c"], Some(9), None), false);
    sim.run();
    assert!(sim.take_received(p, s).is_empty(), "nothing answered before the write");
    let b = acks(&payloads(&sim.take_received(q, sq)));
    assert_eq!((b[0].request_id, b[0].offset), (9, None), "acked on enqueue, with no invented offset");
    assert_eq!(sim.pending_writes.len(), 2);
    sim.complete_all_writes();
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!((a[0].request_id, a[0].offset), (1, Some(0)));
}

#[test]
fn a_failed_write_is_answered_with_storage_and_never_delivered() {
    let mut sim = Sim::new(config(), epoch());
    sim.storage = StorageMode::Manual;
    let (p, s, _) =
        raw_session(&mut sim, Some(0x7FFF), Some((Features::ACK_ON_COMMIT | Features::ERROR_CODES).0 as u32));
    sim.raw_send(p, s, subscribe("orders", None), false);
    sim.raw_send(p, s, publish_binary("orders", &["lost"], Some(1), None), false);
    sim.raw_send(p, s, publish_binary("orders", &["kept"], Some(2), None), false);
    sim.run();
    let first = sim.pending_writes[0].token;
    let second = sim.pending_writes[1].token;
    sim.complete_write(second, true);
    assert!(acks(&payloads(&sim.take_received(p, s))).is_empty(), "the later write waits for the earlier");
    sim.complete_write(first, false);
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!(a.len(), 2);
    assert_eq!((a[0].request_id, a[0].status), (2, AckStatus::Ok));
    assert_eq!((a[1].request_id, a[1].status), (1, AckStatus::Error));
    assert_eq!(a[1].code.as_ref().map(|(c, _)| c.clone()), Some(ErrorCode::Storage));
    let e = event_streams(&sim, p)[0];
    let batches = event_batches(&payloads(&sim.take_received(p, e)));
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].records.payloads().collect::<Vec<_>>(), vec![Bytes::from("kept")]);
}

/// A write that failed for lack of space: the shard acknowledges nothing on enqueue and writes
/// nothing (`overloaded`, reason `storage_full`, with a suggested wait) until a write succeeds
/// again; one publish a second goes through as a probe, answered after its write; reads go on.
#[test]
fn a_full_disk_stops_acks_on_enqueue_and_refuses_publishes_until_a_write_succeeds() {
    use felix_proto::broker::WriteOutcome;
    let mut sim = Sim::new(config(), epoch());
    sim.storage = StorageMode::Manual;
    // Acknowledged on enqueue (no FEATURE_ACK_ON_COMMIT), with error codes and details.
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    sim.raw_send(p, s, publish_binary("full", &["a"], Some(1), None), false);
    sim.run();
    assert_eq!(acks(&payloads(&sim.take_received(p, s)))[0].status, AckStatus::Ok, "on enqueue, as before");
    let t = sim.pending_writes[0].token;
    sim.complete_write_with(t, WriteOutcome::NoSpace);
    // Now nothing is written or acknowledged on enqueue: acked, unacked and JSON alike.
    sim.raw_send(p, s, publish_binary("full", &["b"], Some(2), None), false);
    sim.raw_send(p, s, publish_binary("full", &["c"], None, None), false);
    sim.raw_send(p, s, publish_json("full", "d", Some(3), Some(AckMode::PerBatch)), false);
    sim.run();
    assert!(sim.pending_writes.is_empty(), "nothing was written");
    let answers = payloads(&sim.take_received(p, s));
    let a = acks(&answers);
    assert_eq!((a[0].request_id, a[0].status), (2, AckStatus::Error));
    assert_eq!(a[0].code.as_ref().map(|(c, _)| c.clone()), Some(ErrorCode::Overloaded));
    let detail = a[0].detail.clone().unwrap();
    assert_eq!(detail.reason.as_deref(), Some("storage_full"));
    assert!(detail.retry_after_ms.is_some_and(|ms| ms > 0 && ms <= 1000), "{detail:?}");
    let json: Vec<Message> = answers
        .iter()
        .filter_map(|p| match p {
            Payload::Json(Decoded::Message(m)) => Some(m.clone()),
            _ => None,
        })
        .collect();
    assert!(matches!(&json[0], Message::PublishError(e) if e.code == Some(ErrorCode::Overloaded)), "{json:?}");
    assert_eq!(sim.broker.stats().unacked_failures, 1, "the unacked one is counted");
    // Reads keep working.
    sim.raw_send(p, s, subscribe("full", Some(message::StartPosition::Earliest)), false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(p, s))[0], Message::Subscribed(_)));
    // A second later one publish is let through as a probe, answered only after its write.
    sim.advance(std::time::Duration::from_millis(1001));
    sim.raw_send(p, s, publish_binary("full", &["probe"], Some(4), None), false);
    sim.raw_send(p, s, publish_binary("full", &["behind"], Some(5), None), false);
    sim.run();
    assert_eq!(sim.pending_writes.len(), 1, "only the probe is written");
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!(a.iter().map(|a| (a.request_id, a.status)).collect::<Vec<_>>(), vec![(5, AckStatus::Error)]);
    let t = sim.pending_writes[0].token;
    sim.complete_write_with(t, WriteOutcome::Written);
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!((a[0].request_id, a[0].status, a[0].offset.is_some()), (4, AckStatus::Ok, true));
    // Space is back: publishes are taken, and acknowledged on enqueue again.
    sim.raw_send(p, s, publish_binary("full", &["e"], Some(6), None), false);
    sim.run();
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!((a[0].request_id, a[0].status, a[0].offset), (6, AckStatus::Ok, None));
}

#[test]
fn pipelined_answers_come_in_stream_order_and_the_window_pauses_reading() {
    let mut cfg = config();
    cfg.publish_window = 2;
    let mut sim = Sim::new(cfg, epoch());
    sim.storage = StorageMode::Manual;
    let features = (Features::PUBLISH_PIPELINE | Features::ACK_ON_COMMIT).0 as u32;
    let (p, s, answer) = raw_session(&mut sim, Some(0x7FFF), Some(features));
    let Message::AuthOk(ok) = answer else { panic!() };
    assert_eq!(ok.publish_window, Some(2));
    // Two streams of the same connection, on two different streams (so two shards' writes).
    let s2 = sim.raw_open_bi(p);
    sim.raw_send(p, s2, auth(Some(0x7FFF), Some(features), None), false);
    sim.run();
    sim.take_received(p, s2);
    for i in 0..4 {
        sim.raw_send(p, s, publish_binary(&format!("stream{i}"), &["x"], Some(i), None), false);
    }
    sim.raw_send(p, s2, publish_binary("other", &["y"], Some(100), None), false);
    sim.run();
    // Stream s stopped at its window (2 writes asked for); s2 kept flowing.
    let streams: Vec<String> = sim.pending_writes.iter().map(|w| w.stream.clone()).collect();
    assert_eq!(streams, vec!["stream0", "stream1", "other"]);
    // Complete in reverse order: answers still come in request order.
    let tokens: Vec<_> = sim.pending_writes.iter().map(|w| w.token).collect();
    sim.complete_write(tokens[2], true);
    assert_eq!(acks(&payloads(&sim.take_received(p, s2)))[0].request_id, 100);
    sim.complete_write(tokens[1], true);
    assert!(sim.take_received(p, s).is_empty(), "request 1 is held behind request 0");
    sim.complete_write(tokens[0], true);
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!(a.iter().map(|a| a.request_id).collect::<Vec<_>>(), vec![0, 1]);
    // Reading resumed: the other two were read and asked to be written.
    sim.complete_all_writes();
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!(a.iter().map(|a| a.request_id).collect::<Vec<_>>(), vec![2, 3]);
}

#[test]
fn without_pipelining_answers_come_in_completion_order() {
    let mut sim = Sim::new(config(), epoch());
    sim.storage = StorageMode::Manual;
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ACK_ON_COMMIT.0 as u32));
    sim.raw_send(p, s, publish_binary("a", &["x"], Some(1), None), false);
    sim.raw_send(p, s, publish_binary("b", &["x"], Some(2), None), false);
    sim.run();
    let t: Vec<_> = sim.pending_writes.iter().map(|w| w.token).collect();
    sim.complete_write(t[1], true);
    sim.complete_write(t[0], true);
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!(a.iter().map(|a| a.request_id).collect::<Vec<_>>(), vec![2, 1]);
}

#[test]
fn client_window_is_per_stream_against_a_per_stream_broker() {
    let mut cfg = config();
    cfg.publish_window = 1;
    let mut sim = Sim::new(cfg, epoch());
    sim.storage = StorageMode::Manual;
    let mut cc = ClientConfig::new("t1", TOKEN);
    cc.features |= Features::ACK_ON_COMMIT;
    let c = sim.connect(cc);
    sim.run();
    let s0 = ClientStream(0);
    let now = sim.now;
    let s1 = sim.client(c).open_stream(now);
    sim.run();
    assert!(sim.client(c).negotiated(s0).unwrap().per_stream_window);
    let req = || PublishRequest::new("default", "orders", vec![Bytes::from("x")]).acked();
    sim.client(c).publish(s0, req(), now).unwrap();
    assert_eq!(sim.client(c).publish(s0, req(), now), Err(CommandError::WindowFull));
    assert!(sim.client(c).publish(s1, req(), now).is_ok(), "the other stream has its own window");
    sim.run();
    sim.complete_all_writes();
    let ev = sim.take_events(c);
    assert!(ev.iter().any(|e| matches!(e, ClientEvent::PublishWindowOpen { stream } if *stream == s0)), "{ev:?}");
    assert_eq!(ev.iter().filter(|e| matches!(e, ClientEvent::PublishAcked { offset: Some(_), .. })).count(), 2);
    assert!(sim.client(c).publish(s0, req(), now).is_ok());
}

#[test]
fn client_shares_one_window_against_a_broker_without_the_per_stream_bit() {
    use felix_proto::client::{ClientConnection, ClientOutput};
    use felix_proto::transport::{Dir, Side, StreamId};
    let now = epoch();
    let mut c = ClientConnection::new(ClientConfig::new("t1", TOKEN), now);
    let s1 = c.open_stream(now);
    let ids = [StreamId::new(Side::Client, Dir::Bi, 0), StreamId::new(Side::Client, Dir::Bi, 1)];
    let mut n = 0;
    while let Some(o) = c.poll_output() {
        if let ClientOutput::OpenBi { token } = o {
            c.handle_stream_opened(token, ids[n], now);
            n += 1;
        }
    }
    // An older broker: pipelining with a window of 1, but no FEATURE_STREAM_PUBLISH_WINDOW.
    let ok = json(&Message::AuthOk(message::AuthOk {
        server_flags: 0x7FFF,
        server_flags_hi: None,
        server_features: Some(Features::PUBLISH_PIPELINE.0 as u32),
        server_features_hi: None,
        listener_ports: None,
        publish_window: Some(1),
    }));
    for id in ids {
        c.handle_stream_data(id, ok.clone(), false, now);
    }
    while c.poll_event().is_some() {}
    let req = || PublishRequest::new("default", "orders", vec![Bytes::from("x")]).acked();
    let first = c.publish(ClientStream(0), req(), now).unwrap();
    assert_eq!(c.publish(s1, req(), now), Err(CommandError::WindowFull), "one window for the connection");
    let mut ack = bytes::BytesMut::new();
    felix_proto::binary::PublishAck::ok(first.0, None).encode(felix_proto::Flags::KNOWN, &mut ack).unwrap();
    c.handle_stream_data(ids[0], ack.freeze(), false, now);
    let ev: Vec<_> = std::iter::from_fn(|| c.poll_event()).collect();
    assert!(ev.contains(&ClientEvent::PublishWindowOpen { stream: s1 }), "{ev:?}");
    assert!(c.publish(s1, req(), now).is_ok());
}

#[test]
fn malformed_acked_binary_publish_is_answered_with_its_request_id() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    let mut bad = publish_binary("orders", &["x"], Some(42), None).to_vec();
    let n = bad.len();
    bad[n - 6] = 0xff; // payload_len far past the end
    sim.raw_send(p, s, Bytes::from(bad), false);
    // Unknown flag bit on an acked frame: also answered by request id (D7).
    let mut flagged = publish_binary("orders", &["x"], Some(43), None).to_vec();
    flagged[6] = 0x80;
    sim.raw_send(p, s, Bytes::from(flagged), false);
    // And the stream still works.
    sim.raw_send(p, s, publish_binary("orders", &["ok"], Some(44), None), false);
    sim.run();
    let a = acks(&payloads(&sim.take_received(p, s)));
    assert_eq!(
        a.iter().map(|a| (a.request_id, a.status)).collect::<Vec<_>>(),
        vec![(42, AckStatus::Error), (43, AckStatus::Error), (44, AckStatus::Ok)]
    );
    assert_eq!(a[0].code.as_ref().map(|(c, _)| c.clone()), Some(ErrorCode::InvalidRequest));
}

#[test]
fn malformed_header_closes_the_connection_with_a_protocol_code() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), None);
    sim.raw_send(p, s, Bytes::from_static(b"FLX2\x00\x01\x00\x00\x00\x00\x00\x00"), false);
    sim.run();
    let (code, reason) = sim.clients[p].closed.clone().unwrap();
    assert_eq!(code, close_code::PROTOCOL_VIOLATION);
    assert!(reason.contains("magic"), "{reason}");
    assert_eq!(sim.broker.connection_count(), 0);
    // An oversized frame likewise, on the header alone.
    let (q, sq, _) = raw_session(&mut sim, Some(0x7FFF), None);
    let mut h = bytes::BytesMut::new();
    felix_proto::frame::FrameHeader { flags: felix_proto::Flags(1), length: 17 << 20 }.encode(&mut h);
    sim.raw_send(q, sq, h.freeze(), false);
    sim.run();
    assert_eq!(sim.clients[q].closed.as_ref().map(|c| c.0), Some(close_code::PROTOCOL_VIOLATION));
}

#[test]
fn invalid_json_is_answered_and_closes_the_stream() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    let mut bad = bytes::BytesMut::new();
    felix_proto::frame::FrameHeader { flags: felix_proto::Flags(0), length: 5 }.encode(&mut bad);
    bad.extend_from_slice(b"{nope");
    sim.raw_send(p, s, bad.freeze(), false);
    sim.raw_send(p, s, publish_binary("orders", &["x"], Some(1), None), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms.len(), 1, "nothing after the error: {ms:?}");
    let Message::Error(e) = &ms[0] else { panic!() };
    assert_eq!(e.code, Some(ErrorCode::InvalidRequest));
    assert!(sim.clients[p].stopped.contains(&s));
}

#[test]
fn requests_before_auth_and_bad_tokens_are_refused() {
    let mut sim = Sim::new(config(), epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    sim.raw_send(p, s, subscribe("orders", None), false);
    sim.run();
    let Message::Error(e) = &messages(&sim.take_received(p, s))[0] else { panic!() };
    assert_eq!(e.message, "authenticate first");
    // A binary publish first ends the stream.
    let s2 = sim.raw_open_bi(p);
    sim.raw_send(p, s2, publish_binary("orders", &["x"], None, None), false);
    sim.run();
    assert!(sim.clients[p].stopped.contains(&s2));
    // A bad token: unauthenticated, with the code for a client that offered it.
    let s3 = sim.raw_open_bi(p);
    let bad = json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: "wrong".into(),
        client_flags: Some(25),
        client_flags_hi: None,
        client_features: Some(Features::ERROR_CODES.0 as u32),
        client_features_hi: None,
    }));
    sim.raw_send(p, s3, bad, false);
    sim.run();
    let Message::Error(e) = &messages(&sim.take_received(p, s3))[0] else { panic!() };
    assert_eq!(e.code, Some(ErrorCode::Unauthenticated));
}

/// Auth is per stream: a connection that authenticated nothing is not closed for it (existing
/// clients open pooled connections and authenticate a stream only when they first use it).
#[test]
fn an_idle_unauthenticated_connection_stays_open() {
    let mut sim = Sim::new(config(), epoch());
    let p = sim.connect_raw();
    sim.advance(std::time::Duration::from_secs(60));
    assert!(sim.clients[p].closed.is_none());
    // Then a stream authenticates and is served.
    let s = sim.raw_open_bi(p);
    sim.raw_send(p, s, auth(None, None, None), false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(p, s))[0], Message::Ok(_)));
}

/// A stream that does not authenticate within the auth timeout is ended with `unauthenticated`;
/// its connection and the connection's other streams are untouched.
#[test]
fn a_stream_that_does_not_authenticate_in_time_is_ended_alone() {
    let mut sim = Sim::new(config(), epoch());
    let p = sim.connect_raw();
    let ok = sim.raw_open_bi(p);
    sim.raw_send(p, ok, auth(None, None, None), false);
    let silent = sim.raw_open_bi(p);
    sim.raw_send(p, silent, &b"FLX1"[..], false); // a header begun, never finished
    sim.run();
    sim.take_received(p, ok);
    sim.advance(std::time::Duration::from_secs(9));
    assert!(sim.take_received(p, silent).is_empty());
    sim.advance(std::time::Duration::from_secs(2));
    let Message::Error(e) = &messages(&sim.take_received(p, silent))[0] else { panic!() };
    assert_eq!(e.message, "authentication timeout");
    assert!(sim.clients[p].stopped.contains(&silent), "the broker stopped reading it");
    assert!(sim.clients[p].closed.is_none(), "the connection stays");
    assert_eq!(sim.broker.stats().auth_timeouts, 1);
    // The authenticated stream still works.
    let get = json(&Message::CacheGet(message::CacheGet {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "c".into(),
        key: "k".into(),
        request_id: None,
    }));
    sim.raw_send(p, ok, get, false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(p, ok))[0], Message::CacheValue(_)));
}

#[test]
fn admission_caps_unauthenticated_connections_per_peer_and_in_all() {
    use felix_proto::broker::{AdmitError, Broker, PeerAddr};
    let t0 = epoch();
    let cfg = felix_proto::broker::BrokerConfig {
        max_unauthenticated_connections: 4,
        max_unauthenticated_per_peer: 3,
        ..config()
    };
    let mut b = Broker::new(cfg, felix_proto::transport::WallClock::new(t0, 0));
    let (a, z) = (PeerAddr([1; 16]), PeerAddr([2; 16]));
    let from_a: Vec<_> = (0..3).map(|_| b.admit(a, t0).unwrap()).collect();
    assert_eq!(b.admit(a, t0), Err(AdmitError::TooManyFromPeer { max: 3 }));
    let first_z = b.admit(z, t0).unwrap();
    // Four unauthenticated, none older than the auth timeout: the fifth is refused.
    assert_eq!(b.admit(z, t0), Err(AdmitError::TooManyUnauthenticated { max: 4 }));
    // An authenticated connection does not count: authenticate one of them.
    let s =
        felix_proto::transport::StreamId::new(felix_proto::transport::Side::Client, felix_proto::transport::Dir::Bi, 0);
    b.handle_stream_data(first_z, s, auth(None, None, None), false, t0);
    while b.poll_output().is_some() {}
    b.admit(z, t0).unwrap();
    assert_eq!(b.unauthenticated_connections(), 4);
    // Past the auth timeout, the oldest unauthenticated connection makes room.
    let later = t0 + std::time::Duration::from_secs(11);
    let newest = b.admit(z, later).unwrap();
    // The connections the broker closed, with their codes.
    let closes = |b: &mut Broker| -> Vec<_> {
        std::iter::from_fn(|| b.poll_output())
            .filter_map(|o| match o {
                felix_proto::broker::BrokerOutput::Transport(
                    felix_proto::broker::TransportOutput::CloseConnection { conn, code, .. },
                ) => Some((conn, code)),
                _ => None,
            })
            .collect()
    };
    let closed = closes(&mut b);
    assert_eq!(closed.len(), 1);
    assert_eq!(closed[0].1, close_code::AUTH_TIMEOUT);
    assert_ne!(closed[0].0, first_z, "the authenticated one is never chosen");
    assert_ne!(closed[0].0, newest);
    assert_eq!(closed[0].0, from_a[0], "the oldest goes");
    assert_eq!(b.stats().connections_evicted, 1);
    assert_eq!(b.stats().connections_refused, 2);
    // A connection that goes frees its room, in all and for its peer.
    b.connection_closed(from_a[1], later);
    assert_eq!(b.unauthenticated_connections(), 3);
    b.admit(a, later).unwrap();
    assert_eq!(b.unauthenticated_connections(), 4);
    while b.poll_output().is_some() {}
    // Full again: the oldest left (a's last from t0) makes room, and a's room is counted right.
    b.admit(a, later).unwrap();
    let evicted: Vec<_> = closes(&mut b).into_iter().map(|(conn, _)| conn).collect();
    assert_eq!(evicted, [from_a[2]]);
    // a holds two now; a third (z's last from t0 makes room), then a's cap.
    b.admit(a, later).unwrap();
    assert_eq!(b.admit(a, later), Err(AdmitError::TooManyFromPeer { max: 3 }));
    assert_eq!(b.unauthenticated_connections(), 4);
}

#[test]
fn unknown_stream_is_not_found_without_auto_create() {
    let mut cfg = config();
    cfg.auto_create = false;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    sim.raw_send(p, s, publish_json("nope", "x", Some(1), Some(AckMode::PerBatch)), false);
    sim.raw_send(p, s, subscribe("nope", None), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::PublishError(pe) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(pe.code, Some(ErrorCode::NotFound));
    let Message::Error(e) = &ms[1] else { panic!() };
    assert_eq!(e.code, Some(ErrorCode::NotFound));
}

#[test]
fn forbidden_without_permission() {
    use felix_proto::broker::{Action, Grant, TokenGrant};
    let mut cfg = config();
    cfg.tokens.push(TokenGrant {
        token: "reader".into(),
        tenant_id: Some("t1".into()),
        principal: "bob".into(),
        grants: vec![Grant { action: Action::Subscribe, pattern: "default/*".into() }],
    });
    let mut sim = Sim::new(cfg, epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let a = json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: "reader".into(),
        client_flags: Some(0x7FFF),
        client_flags_hi: None,
        client_features: Some(Features::ERROR_CODES.0 as u32),
        client_features_hi: None,
    }));
    sim.raw_send(p, s, a, false);
    sim.raw_send(p, s, publish_binary("orders", &["x"], Some(1), None), false);
    sim.raw_send(p, s, subscribe("orders", None), false);
    sim.run();
    let got = payloads(&sim.take_received(p, s));
    let a = acks(&got);
    assert_eq!(a[0].code.as_ref().map(|(c, _)| c.clone()), Some(ErrorCode::Forbidden));
    assert!(got.iter().any(|p| matches!(p, Payload::Json(Decoded::Message(Message::Subscribed(_))))));
}

#[test]
fn publishers_are_paused_when_storage_falls_behind() {
    let (mut sim, _, _) = publisher_paused_by_storage();
    // Reading stopped once about 1000 bytes waited for storage: the rest stays with the client
    // (QUIC flow control), not in the broker.
    let asked = sim.pending_writes.len();
    assert!((10..=12).contains(&asked), "{asked} writes pending");
    // As storage catches up, reading resumes and every record is eventually written once.
    while !sim.pending_writes.is_empty() {
        sim.complete_all_writes();
        sim.run();
    }
    assert_eq!(sim.writes.len(), 50);
    assert_eq!(sim.broker.shard_state("t1", "default", "orders", 0).unwrap().1, 50);
}

/// A client that floods requests and never reads the answers is slowed by flow control, not
/// buffered for: past the unflushed-answer limit the broker stops reading its stream, and reads
/// again once the answers drain.
#[test]
fn a_client_that_does_not_read_its_answers_is_paused_not_buffered() {
    use felix_proto::broker::{Broker, BrokerOutput, TransportOutput};
    use felix_proto::transport::{Dir, Side, StreamId, WallClock};
    let mut cfg = config();
    cfg.control_stream_unflushed_bytes = 4096;
    let t0 = epoch();
    let mut b = Broker::new(cfg, WallClock::new(t0, 0));
    let conn = b.connection_opened(t0);
    let s = StreamId::new(Side::Client, Dir::Bi, 0);
    b.handle_stream_data(conn, s, auth(None, None, None), false, t0);
    while b.poll_output().is_some() {}
    let get = json(&Message::CacheGet(message::CacheGet {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "c".into(),
        key: "k".into(),
        request_id: Some(1),
    }));
    let flood: Vec<u8> = (0..1000).flat_map(|_| get.to_vec()).collect();
    b.handle_stream_data(conn, s, bytes::Bytes::from(flood), false, t0);
    let (mut written, mut paused) = (0usize, false);
    while let Some(o) = b.poll_output() {
        match o {
            BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => written += data.len(),
            BrokerOutput::Transport(TransportOutput::PauseReading { .. }) => paused = true,
            _ => {}
        }
    }
    assert!(paused, "the stream is paused");
    assert!(written < 4096 + 500, "answers stop near the limit: {written}");
    // The client reads: answers flow again, and in the end every request is answered.
    let mut total = written;
    for _ in 0..100 {
        b.handle_stream_flushed(conn, s, written, t0);
        written = 0;
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
                written += data.len();
            }
        }
        total += written;
        if written == 0 {
            break;
        }
    }
    let one = {
        let mut b2 = bytes::BytesMut::new();
        Message::CacheValue(message::CacheValue {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "c".into(),
            key: "k".into(),
            value: None,
            request_id: Some(1),
            version: None,
        })
        .encode(&mut b2)
        .unwrap();
        b2.len()
    };
    assert_eq!(total, 1000 * one, "every request answered once");
}

/// Oversized names in every request kind are refused up front (they would become file names).
#[test]
fn oversized_names_are_refused() {
    let mut cfg = config();
    cfg.history_reads = true;
    let mut sim = Sim::new(cfg, epoch());
    let codes = Features::ERROR_CODES.to_words(false).0;
    let (p, s, _) = raw_session(&mut sim, Some(1), codes);
    let long = "x".repeat(201);
    let escaped = "é".repeat(50); // 100 bytes, 300 as a file name
    let reqs = [
        json(&Message::PublishBatch(message::PublishBatchMsg {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: long.clone(),
            payloads: vec![message::B64::from("x")],
            key: None,
            shard: None,
            request_id: Some(1),
            ack: Some(AckMode::PerBatch),
            publish_width: None,
        })),
        subscribe(&escaped, None),
        json(&Message::CacheGet(message::CacheGet {
            tenant_id: "t1".into(),
            namespace: long.clone(),
            cache: "c".into(),
            key: "k".into(),
            request_id: Some(2),
        })),
        json(&Message::GroupDescribe(message::GroupRef {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "s".into(),
            shard: 0,
            group: long.clone(),
            request_id: 3,
        })),
    ];
    for r in reqs {
        sim.raw_send(p, s, r, false);
    }
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms.len(), 4, "{ms:?}");
    for m in &ms {
        let code = match m {
            Message::PublishError(e) => e.code.clone(),
            Message::Error(e) => e.code.clone(),
            other => panic!("{other:?}"),
        };
        assert_eq!(code.map(|c| c.name().into_owned()).as_deref(), Some("invalid_request"), "{m:?}");
    }
    assert!(sim.writes.is_empty(), "nothing written");
}

proptest::proptest! {
    /// Chunks handed over together (`handle_stream_chunks`) are the same input as the same
    /// chunks handed over one by one: the broker's outputs match exactly, whatever the cuts.
    #[test]
    fn chunks_together_or_one_by_one_give_the_same_outputs(
        cuts in proptest::collection::vec(1usize..200, 1..40),
        group in 1usize..8,
    ) {
        use felix_proto::broker::Broker;
        use felix_proto::transport::{Dir, Side, StreamId, WallClock};
        let t0 = epoch();
        let mut wire = Vec::new();
        wire.extend_from_slice(&auth(Some(0x7FFF), None, None));
        wire.extend_from_slice(&subscribe("orders", None));
        for i in 0..5u64 {
            wire.extend_from_slice(&publish_binary("orders", &["a", "bb", "ccc"], Some(i + 1), None));
        }
        // Cut the stream at the generated sizes (the rest is one last chunk).
        let mut chunks = Vec::new();
        let mut at = 0;
        for c in cuts {
            if at >= wire.len() {
                break;
            }
            let end = (at + c).min(wire.len());
            chunks.push(Bytes::copy_from_slice(&wire[at..end]));
            at = end;
        }
        if at < wire.len() {
            chunks.push(Bytes::copy_from_slice(&wire[at..]));
        }
        let s = StreamId::new(Side::Client, Dir::Bi, 0);
        let run = |together: bool| {
            let mut b = Broker::new(config(), WallClock::new(t0, 0));
            let conn = b.connection_opened(t0);
            let mut out = Vec::new();
            if together {
                for g in chunks.chunks(group) {
                    b.handle_stream_chunks(conn, s, g.iter().cloned(), false, t0);
                    out.extend(std::iter::from_fn(|| b.poll_output()).map(|o| format!("{o:?}")));
                }
            } else {
                for g in chunks.chunks(group) {
                    for c in g {
                        b.handle_stream_data(conn, s, c.clone(), false, t0);
                    }
                    out.extend(std::iter::from_fn(|| b.poll_output()).map(|o| format!("{o:?}")));
                }
            }
            out
        };
        let (one_by_one, together) = (run(false), run(true));
        proptest::prop_assert!(one_by_one.iter().any(|o| o.contains("Transmit")), "the session answered");
        proptest::prop_assert_eq!(one_by_one, together);
    }
}

/// Two reasons to pause one stream overlap (storage behind, then answers unread while it
/// is): the driver sees one `PauseReading`, and one `ResumeReading` only when the last goes.
#[test]
fn overlapping_pauses_pause_and_resume_once() {
    use felix_proto::broker::{Broker, BrokerOutput, StorageOutput, TransportOutput, WriteOutcome};
    use felix_proto::transport::{Dir, Side, StreamId, WallClock, WriteToken};
    #[derive(Default)]
    struct Seen {
        pauses: u32,
        resumes: u32,
        unflushed: usize,
        writes: std::collections::VecDeque<WriteToken>,
    }
    fn drain(b: &mut Broker, seen: &mut Seen) {
        while let Some(o) = b.poll_output() {
            match o {
                BrokerOutput::Transport(TransportOutput::PauseReading { .. }) => seen.pauses += 1,
                BrokerOutput::Transport(TransportOutput::ResumeReading { .. }) => seen.resumes += 1,
                BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => seen.unflushed += data.len(),
                BrokerOutput::Storage(StorageOutput::Persist(p)) => seen.writes.push_back(p.token),
                _ => {}
            }
        }
    }
    let mut cfg = config();
    cfg.max_pending_write_bytes = 1000;
    cfg.control_stream_unflushed_bytes = 50;
    let t0 = epoch();
    let mut b = Broker::new(cfg, WallClock::new(t0, 0));
    let conn = b.connection_opened(t0);
    let s = StreamId::new(Side::Client, Dir::Bi, 0);
    // Acks after the write: answers appear as storage completes, while it is still behind.
    b.handle_stream_data(conn, s, auth(None, Some(Features::ACK_ON_COMMIT.0 as u32), None), false, t0);
    let mut seen = Seen::default();
    drain(&mut b, &mut seen);
    b.handle_stream_flushed(conn, s, std::mem::take(&mut seen.unflushed), t0);
    let payload = "z".repeat(100);
    let many: Vec<u8> =
        (0..50u64).flat_map(|i| publish_binary("orders", &[&payload], Some(i + 1), None).to_vec()).collect();
    b.handle_stream_data(conn, s, bytes::Bytes::from(many), false, t0);
    drain(&mut b, &mut seen);
    let behind = seen.writes.len();
    assert!(behind >= 10, "storage behind: {behind} writes");
    assert_eq!((seen.pauses, seen.resumes), (1, 0), "paused for storage");
    // Storage catches up while the client reads none of its acks: the pause for storage ends,
    // the one for unread answers has begun, reading stays paused throughout.
    let mut written = 0;
    while let Some(t) = seen.writes.pop_front() {
        b.handle_write_result(t, WriteOutcome::Written, t0);
        written += 1;
        drain(&mut b, &mut seen);
    }
    assert_eq!(written, behind);
    assert_eq!((seen.pauses, seen.resumes), (1, 0), "still paused: {} answer bytes unread", seen.unflushed);
    // The client reads its acks: reading resumes once, and in the end everything is written.
    while written < 50 {
        b.handle_stream_flushed(conn, s, std::mem::take(&mut seen.unflushed), t0);
        drain(&mut b, &mut seen);
        while let Some(t) = seen.writes.pop_front() {
            b.handle_write_result(t, WriteOutcome::Written, t0);
            written += 1;
            drain(&mut b, &mut seen);
        }
    }
    b.handle_stream_flushed(conn, s, std::mem::take(&mut seen.unflushed), t0);
    drain(&mut b, &mut seen);
    assert!(seen.resumes >= 1);
    assert_eq!(seen.pauses, seen.resumes, "every pause resumed once");
    assert_eq!(b.shard_state("t1", "default", "orders", 0).unwrap().1, 50);
}

/// One publish crosses both limits at once (storage behind, and its ack makes the unread
/// answers too many): still one `PauseReading`, not one per reason.
#[test]
fn one_publish_crossing_two_limits_pauses_once() {
    use felix_proto::broker::{Broker, BrokerOutput, StorageOutput, TransportOutput};
    use felix_proto::transport::{Dir, Side, StreamId, WallClock};
    // Returns (publishes read before the pause, ack bytes written, PauseReading count).
    fn run(unflushed_limit: usize) -> (usize, usize, usize) {
        let mut cfg = config();
        cfg.max_pending_write_bytes = 1000;
        cfg.control_stream_unflushed_bytes = unflushed_limit;
        let t0 = epoch();
        let mut b = Broker::new(cfg, WallClock::new(t0, 0));
        let conn = b.connection_opened(t0);
        let s = StreamId::new(Side::Client, Dir::Bi, 0);
        b.handle_stream_data(conn, s, auth(None, None, None), false, t0);
        let mut auth_bytes = 0;
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
                auth_bytes += data.len();
            }
        }
        b.handle_stream_flushed(conn, s, auth_bytes, t0);
        let payload = "z".repeat(100);
        let many: Vec<u8> =
            (0..50u64).flat_map(|i| publish_binary("orders", &[&payload], Some(i + 1), None).to_vec()).collect();
        b.handle_stream_data(conn, s, bytes::Bytes::from(many), false, t0);
        let (mut writes, mut acked, mut pauses) = (0, 0, 0);
        while let Some(o) = b.poll_output() {
            match o {
                BrokerOutput::Storage(StorageOutput::Persist(_)) => writes += 1,
                BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => acked += data.len(),
                BrokerOutput::Transport(TransportOutput::PauseReading { .. }) => pauses += 1,
                _ => {}
            }
        }
        (writes, acked, pauses)
    }
    // Where storage alone pauses the stream, and how many ack bytes that took.
    let (n, acked, pauses) = run(usize::MAX);
    assert_eq!(pauses, 1);
    // An unread-answer limit the same publish's ack crosses.
    let (m, _, pauses) = run(acked - 1);
    assert_eq!(m, n, "the same publish crosses both limits");
    assert_eq!(pauses, 1, "one pause for two reasons");
}

/// Streams' first bytes come in any order (packets reorder, and a driver reads each stream on
/// its own): a stream overtaken by a later one is still a new stream and is answered, while
/// bytes for a stream that was closed are still ignored.
#[test]
fn a_stream_whose_first_bytes_come_after_a_later_streams_is_answered() {
    use felix_proto::broker::{Broker, BrokerOutput, TransportOutput};
    use felix_proto::transport::{Dir, Side, StreamId, WallClock};
    let t0 = epoch();
    let mut b = Broker::new(config(), WallClock::new(t0, 0));
    let conn = b.connection_opened(t0);
    let answered = |b: &mut Broker| -> Vec<u64> {
        let mut on = Vec::new();
        while let Some(o) = b.poll_output() {
            // The answer to an `Auth` is `{"type":"ok"}`.
            if let BrokerOutput::Transport(TransportOutput::Transmit { stream, data, .. }) = o
                && !messages(&data).is_empty()
            {
                on.push(stream.index());
            }
        }
        on
    };
    let s = |i| StreamId::new(Side::Client, Dir::Bi, i);
    for i in [2, 0, 3, 1] {
        b.handle_stream_data(conn, s(i), auth(None, None, None), false, t0);
        assert_eq!(answered(&mut b), [i], "stream {i} answered");
    }
    // Closed (the client finished it, the broker answered and finished): bytes that straggle
    // in after are not a new stream.
    b.handle_stream_data(conn, s(1), Bytes::new(), true, t0);
    let _ = answered(&mut b);
    b.handle_stream_data(conn, s(1), auth(None, None, None), false, t0);
    assert_eq!(answered(&mut b), Vec::<u64>::new(), "a closed stream is not opened again");
}
