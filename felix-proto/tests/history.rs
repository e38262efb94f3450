//! Reading history without subscribing: `stream_read` pages and `offset_for_time`.

mod support;

use bytes::Bytes;
use felix_proto::binary::OwnerHint;
use felix_proto::broker::{
    Action, Broker, BrokerConfig, BrokerOutput, Grant, StorageOutput, TokenGrant, TransportOutput,
};
use felix_proto::client::{ClientConfig, ClientEvent, ClientStream, Reply, StreamReadRequest};
use felix_proto::features::Features;
use felix_proto::message::{self, CursorErrorReason, Message};
use felix_proto::sim::Sim;
use felix_proto::transport::{Dir, Side, StreamId, WallClock};
use std::time::Duration;
use support::*;

fn read(stream: &str, from: u64, end: Option<u64>, max_records: Option<u32>, request_id: u64) -> Bytes {
    json(&Message::StreamRead(message::StreamRead {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        shard: 0,
        from,
        end,
        max_records,
        max_bytes: None,
        request_id,
        replica_local: None,
    }))
}

fn offset_for_time(stream: &str, at_micros: u64, request_id: u64) -> Bytes {
    json(&Message::OffsetForTime(message::OffsetForTime {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        shard: 0,
        at_micros,
        request_id,
    }))
}

fn page(m: &Message) -> (&[message::StreamRecord], u64) {
    match m {
        Message::StreamRecords(r) => (&r.records, r.next_offset),
        other => panic!("expected stream_records, got {other:?}"),
    }
}

/// A shard of 101 offsets: 50 batches of two records with a generation-start record at 42,
/// most of it beyond a small memory budget (so on "disk").
fn spilled_shard() -> (Sim, usize, StreamId) {
    let mut cfg = config();
    cfg.history_reads = true;
    cfg.history_read_bytes = 600;
    cfg.default_stream.memory_bytes = 1000;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0827), None);
    for i in 0..50 {
        sim.raw_send(
            p,
            s,
            publish_binary("orders", &[&format!("{i:03}{}", "x".repeat(100)), &format!("{i:03}b")], None, None),
            false,
        );
        sim.run();
        if i == 20 {
            sim.broker.start_generation("t1", "default", "orders", 0, sim.now);
            sim.run();
        }
    }
    (sim, p, s)
}

#[test]
fn pages_walk_the_whole_shard_from_disk_and_memory_once() {
    let (mut sim, p, s) = spilled_shard();
    let mut from = 0;
    let mut seen = Vec::new();
    let mut pages = 0;
    loop {
        sim.raw_send(p, s, read("orders", from, None, Some(7), pages), false);
        sim.run();
        let ms = messages(&sim.take_received(p, s));
        let (records, next) = page(&ms[0]);
        assert!(records.len() <= 7, "max_records is a cap");
        assert!(next >= from);
        for r in records {
            assert_eq!(r.publisher.as_deref(), Some("dev"), "publisher goes to every reader");
            assert_eq!(r.timestamp_micros, 1_760_000_000_000_000, "append time goes to every reader");
            seen.push(r.offset);
        }
        pages += 1;
        if records.is_empty() {
            assert_eq!(next, from, "an empty page at the tail leaves next_offset where it was");
            break;
        }
        from = next;
    }
    let want: Vec<u64> = (0..101).filter(|o| *o != 42).collect();
    assert_eq!(seen, want, "every record once, in order; the generation-start offset is stepped over");
    assert!(sim.reads > 0, "the old part came from storage");
    assert!(pages > 14, "bounded pages: {pages}");
}

#[test]
fn a_page_stops_at_end_and_an_empty_range_is_an_empty_page() {
    let (mut sim, p, s) = spilled_shard();
    sim.raw_send(p, s, read("orders", 10, Some(13), None, 1), false);
    sim.raw_send(p, s, read("orders", 13, Some(13), None, 2), false);
    sim.raw_send(p, s, read("orders", 20, Some(5), None, 3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let (r, next) = page(&ms[0]);
    assert_eq!(r.iter().map(|r| r.offset).collect::<Vec<_>>(), vec![10, 11, 12]);
    assert_eq!(next, 13);
    assert_eq!(r[0].payload.0, Bytes::from(format!("005{}", "x".repeat(100))));
    assert_eq!(page(&ms[1]), (&[][..], 13));
    assert_eq!(page(&ms[2]), (&[][..], 20));
}

#[test]
fn reads_outside_the_retained_range_are_cursor_errors() {
    let mut cfg = config();
    cfg.default_stream.retention.max_records = Some(4);
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    for i in 0..5 {
        sim.raw_send(p, s, publish_binary("orders", &[&format!("a{i}"), &format!("b{i}")], None, None), false);
        sim.run();
    }
    sim.raw_send(p, s, read("orders", 0, None, None, 1), false);
    sim.raw_send(p, s, read("orders", 11, None, None, 2), false);
    sim.raw_send(p, s, read("orders", 10, None, None, 3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let cursor = |reason, requested, available| {
        Message::SubscribeCursorError(message::SubscribeCursorError { reason, requested, available })
    };
    assert_eq!(ms[0], cursor(CursorErrorReason::TooOld, 0, 6));
    assert_eq!(ms[1], cursor(CursorErrorReason::InFuture, 11, 10));
    assert_eq!(page(&ms[2]), (&[][..], 10), "at the tail: an empty page");
}

#[test]
fn history_requests_are_refused_as_the_spec_says() {
    let mut cfg = config();
    cfg.tokens.push(TokenGrant {
        token: "writer".into(),
        tenant_id: Some("t1".into()),
        principal: "writer".into(),
        grants: vec![Grant { action: Action::Publish, pattern: "*".into() }],
    });
    cfg.streams.push(felix_proto::broker::StreamSpec {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        name: "ticks".into(),
        config: felix_proto::broker::StreamConfig { durable: false, ..Default::default() },
    });
    let mut sim = Sim::new(cfg, epoch());
    let codes = Features::ERROR_CODES.to_words(false).0.unwrap();
    let (p, s, _) = raw_session(&mut sim, None, Some(codes));
    // In-memory streams keep no history.
    sim.raw_send(p, s, read("ticks", 0, None, None, 1), false);
    sim.raw_send(p, s, offset_for_time("ticks", 0, 2), false);
    // A shard the stream does not have.
    let mut bad = message::StreamRead {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "ticks".into(),
        shard: 3,
        from: 0,
        end: None,
        max_records: None,
        max_bytes: None,
        request_id: 3,
        replica_local: None,
    };
    sim.raw_send(p, s, json(&Message::StreamRead(bad.clone())), false);
    // A stream that does not exist: reading it is not_found, and creates nothing.
    sim.raw_send(p, s, read("nosuch", 0, None, None, 4), false);
    sim.raw_send(p, s, offset_for_time("nosuch", 0, 5), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let code = |m: &Message| match m {
        Message::Error(e) => e.code.as_ref().map(|c| c.name().into_owned()),
        other => panic!("expected error, got {other:?}"),
    };
    assert_eq!(code(&ms[0]).as_deref(), Some("invalid_request"));
    assert_eq!(code(&ms[1]).as_deref(), Some("invalid_request"));
    assert_eq!(code(&ms[2]).as_deref(), Some("invalid_request"));
    assert_eq!(code(&ms[3]).as_deref(), Some("not_found"));
    assert_eq!(code(&ms[4]).as_deref(), Some("not_found"));
    assert!(!sim.broker.streams().any(|(_, _, s, _)| s == "nosuch"), "a read created nothing");
    // Reading needs the subscribe permission.
    let w = sim.connect_raw();
    let ws = sim.raw_open_bi(w);
    sim.raw_send(
        w,
        ws,
        json(&Message::Auth(message::Auth {
            tenant_id: "t1".into(),
            token: "writer".into(),
            client_flags: None,
            client_flags_hi: None,
            client_features: Some(codes),
            client_features_hi: None,
        })),
        false,
    );
    sim.run();
    sim.take_received(w, ws);
    bad.shard = 0;
    sim.raw_send(w, ws, json(&Message::StreamRead(bad)), false);
    sim.raw_send(w, ws, offset_for_time("orders", 0, 5), false);
    sim.run();
    let ms = messages(&sim.take_received(w, ws));
    assert_eq!(code(&ms[0]).as_deref(), Some("forbidden"));
    assert_eq!(code(&ms[1]).as_deref(), Some("forbidden"));
}

#[test]
fn a_moved_shard_answers_not_leader_in_the_form_the_client_offered() {
    // Only a clustered broker advertises FEATURE_REDIRECT and answers `not_leader`; to a client
    // that did not offer it, or from a standalone broker, the answer is an `error`.
    for clustered in [true, false] {
        let cfg = BrokerConfig { clustered, ..config() };
        assert_eq!(cfg.server_features().contains(Features::REDIRECT), clustered);
        assert_eq!(cfg.server_features().contains(Features::TOPOLOGY), clustered);
        let mut sim = Sim::new(cfg, epoch());
        let redirect = (Features::REDIRECT | Features::ERROR_CODES).to_words(false).0.unwrap();
        let (a, sa, _) = raw_session(&mut sim, None, Some(redirect));
        let (b, sb, _) = raw_session(&mut sim, None, None);
        sim.raw_send(a, sa, publish_binary("orders", &["one"], None, None), false);
        sim.run();
        let owner = OwnerHint { node_id: "broker-b".into(), addr: None, generation: 4 };
        assert!(sim.broker.move_shard("t1", "default", "orders", 0, owner, sim.now));
        for (p, s) in [(a, sa), (b, sb)] {
            sim.raw_send(p, s, read("orders", 0, None, None, 1), false);
            sim.raw_send(p, s, offset_for_time("orders", 0, 2), false);
        }
        sim.run();
        let ma = messages(&sim.take_received(a, sa));
        if clustered {
            let nl = Message::NotLeader(message::NotLeader { node_id: "broker-b".into(), addr: None, generation: 4 });
            assert_eq!(ma, vec![nl.clone(), nl]);
        } else {
            assert_eq!(ma.len(), 2);
            let not_leader = |m: &Message| matches!(m, Message::Error(e) if e.code.as_ref().is_some_and(|c| c.name() == "not_leader"));
            assert!(ma.iter().all(not_leader), "{ma:?}");
        }
        let legacy = r#"{"type":"error","message":"shard 0 is owned by broker-b"}"#;
        assert_eq!(sim.take_received(b, sb), [json_raw(legacy), json_raw(legacy)].concat());
    }
}

fn json_raw(s: &str) -> Bytes {
    let mut v = b"FLX1".to_vec();
    v.extend_from_slice(&1u16.to_be_bytes());
    v.extend_from_slice(&0u16.to_be_bytes());
    v.extend_from_slice(&(s.len() as u32).to_be_bytes());
    v.extend_from_slice(s.as_bytes());
    Bytes::from(v)
}

#[test]
fn offset_for_time_finds_the_first_record_at_or_after_a_time() {
    let mut cfg = config();
    cfg.history_reads = true;
    cfg.default_stream.memory_bytes = 300;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    let wall0 = 1_760_000_000_000_000u64; // the harness's wall clock at its epoch
    for i in 0..10u64 {
        // One batch of three records every second, starting at +1 s.
        sim.advance(Duration::from_secs(1));
        let body = format!("{i}{}", "y".repeat(99));
        sim.raw_send(p, s, publish_binary("orders", &[&body, &body, &body], None, None), false);
        sim.run();
    }
    let sec = 1_000_000u64;
    let asks = [
        (0, Some(0)),                          // older than everything: the oldest
        (wall0 + sec, Some(0)),                // exactly the first append
        (wall0 + sec + 1, Some(3)),            // just after: the next batch
        (wall0 + 5 * sec + sec / 2, Some(15)), // evicted from memory: still exact
        (wall0 + 10 * sec, Some(27)),          // the last batch (in memory)
        (wall0 + 10 * sec + 1, None),          // after everything
    ];
    for (i, (at, _)) in asks.iter().enumerate() {
        sim.raw_send(p, s, offset_for_time("orders", *at, i as u64), false);
    }
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    for (i, (at, want)) in asks.iter().enumerate() {
        assert_eq!(
            ms[i],
            Message::OffsetValue(message::OffsetValue { offset: *want, request_id: i as u64 }),
            "at {at}"
        );
    }
    assert!(sim.broker.retained_log_bytes() < 3000, "most of the shard was evicted from memory");
}

/// Answers leave in request order even while one waits for storage: `error` carries no request
/// id, so a client matches it to its oldest unanswered request.
#[test]
fn answers_behind_a_storage_read_stay_in_request_order() {
    let mut cfg = config();
    cfg.history_reads = true;
    cfg.default_stream.memory_bytes = 10;
    let t0 = epoch();
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_760_000_000_000_000));
    let conn = b.connection_opened(t0);
    let s = StreamId::new(Side::Client, Dir::Bi, 0);
    b.handle_stream_data(conn, s, auth(None, None, None), false, t0);
    for i in 0..5 {
        b.handle_stream_data(conn, s, publish_binary("orders", &[&format!("{i}-0123456789")], None, None), false, t0);
    }
    let mut writes = Vec::new();
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Storage(StorageOutput::Persist(w)) = o {
            writes.push(w.token);
        }
    }
    for w in writes {
        b.handle_write_complete(w, true, t0);
    }
    while b.poll_output().is_some() {}
    // A read that needs storage...
    b.handle_stream_data(conn, s, read("orders", 0, None, None, 9), false, t0);
    // Then a read of a shard the stream does not have: refused with an `error` at once.
    let bad = message::StreamRead {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        shard: 9,
        from: 0,
        end: None,
        max_records: None,
        max_bytes: None,
        request_id: 10,
        replica_local: None,
    };
    b.handle_stream_data(conn, s, json(&Message::StreamRead(bad)), false, t0);
    let mut read_req = None;
    let mut sent = Vec::new();
    while let Some(o) = b.poll_output() {
        match o {
            BrokerOutput::Storage(StorageOutput::Read(r)) => read_req = Some(r),
            BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => sent.push(data),
            _ => {}
        }
    }
    assert!(sent.is_empty(), "the error waits behind the page: {sent:?}");
    let r = read_req.expect("the page needs storage");
    assert_eq!((r.from, r.end), (0, 4));
    b.handle_read_complete(r.token, Vec::new(), t0);
    let mut order = Vec::new();
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
            order.extend(messages(&data));
        }
    }
    assert!(matches!(&order[0], Message::StreamRecords(p) if p.request_id == 9), "{order:?}");
    assert!(matches!(&order[1], Message::Error(_)), "{order:?}");
    // Storage had nothing below memory (deleted meanwhile): the page steps over the gap to
    // what memory holds rather than answer the same empty page forever.
    let (records, next) = page(&order[0]);
    assert_eq!(records.iter().map(|r| r.offset).collect::<Vec<_>>(), vec![4]);
    assert_eq!(next, 5);
}

#[test]
fn the_client_state_machine_reads_pages_and_maps_cursor_errors_to_the_request() {
    let mut sim = Sim::new(config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let (p, s, _) = raw_session(&mut sim, None, None);
    sim.raw_send(p, s, publish_binary("orders", &["a", "b", "c"], None, None), false);
    sim.run();
    sim.take_events(c);
    let req = |from| StreamReadRequest {
        namespace: "default".into(),
        stream: "orders".into(),
        shard: 0,
        from,
        end: None,
        max_records: Some(2),
        max_bytes: None,
        replica_local: false,
    };
    let r1 = sim.client(c).stream_read(ClientStream(0), req(0)).unwrap();
    let r2 = sim.client(c).stream_read(ClientStream(0), req(9)).unwrap();
    let r3 = sim.client(c).offset_for_time(ClientStream(0), "default", "orders", 0, 0).unwrap();
    sim.run();
    let ev = sim.take_events(c);
    assert!(
        matches!(&ev[0], ClientEvent::Reply { request_id, reply: Reply::StreamRecords { records, next_offset: 2 } }
            if *request_id == r1 && records.iter().map(|r| r.payload.0.clone()).collect::<Vec<_>>() == ["a", "b"]),
        "{ev:?}"
    );
    assert!(
        matches!(&ev[1], ClientEvent::RequestFailed { request_id, cursor: Some(c), .. }
            if *request_id == r2 && c.reason == CursorErrorReason::InFuture && c.available == 3),
        "{ev:?}"
    );
    assert!(
        matches!(&ev[2], ClientEvent::Reply { request_id, reply: Reply::OffsetValue(Some(0)) } if *request_id == r3),
        "{ev:?}"
    );
}

/// Names of new streams follow one grammar (D49), checked where the stream would be created;
/// `stream_shards` asks without creating (0: no such stream).
#[test]
fn new_stream_names_follow_the_grammar_and_questions_create_nothing() {
    let mut sim = Sim::new(config(), epoch());
    let codes = Features::ERROR_CODES.to_words(false).0.unwrap();
    let (p, s, _) = raw_session(&mut sim, None, Some(codes));
    let publish = |stream: &str, request_id: u64| {
        json(&Message::Publish(message::Publish {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: stream.into(),
            payload: message::B64(Bytes::from_static(b"x")),
            key: None,
            shard: None,
            request_id: Some(request_id),
            ack: Some(felix_proto::binary::AckMode::PerMessage),
            publish_width: None,
        }))
    };
    let shards = |stream: &str, request_id: u64| {
        json(&Message::StreamShards(message::StreamShards {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: stream.into(),
            request_id,
        }))
    };
    let bad = ["", "orders.*", "bad stream/name", "..", "naïve"];
    for (i, name) in bad.iter().enumerate() {
        sim.raw_send(p, s, publish(name, i as u64 + 1), false);
    }
    sim.raw_send(p, s, shards("nosuch", 10), false);
    sim.raw_send(p, s, publish("orders-eu.v2_1", 11), false);
    sim.raw_send(p, s, shards("orders-eu.v2_1", 12), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms.len(), bad.len() + 3, "{ms:?}");
    for (m, name) in ms.iter().zip(bad) {
        let (code, text) = match m {
            Message::PublishError(e) => (&e.code, &e.message),
            Message::Error(e) => (&e.code, &e.message),
            other => panic!("{name:?}: expected a refusal, got {other:?}"),
        };
        assert_eq!(code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("invalid_request"), "{name:?}");
        assert!(text.contains("names are 1 to 200"), "{name:?}: {text}");
        match m {
            Message::PublishError(_) | Message::Error(_) => {}
            other => panic!("{name:?}: expected a refusal, got {other:?}"),
        }
    }
    assert!(matches!(&ms[bad.len()], Message::StreamShardsView(v) if v.shards == 0), "{:?}", ms[bad.len()]);
    assert!(matches!(&ms[bad.len() + 1], Message::PublishOk(_)), "{:?}", ms[bad.len() + 1]);
    assert!(matches!(&ms[bad.len() + 2], Message::StreamShardsView(v) if v.shards == 1), "{:?}", ms[bad.len() + 2]);
    let names: Vec<&str> = sim.broker.streams().map(|(_, _, s, _)| s).collect();
    assert_eq!(names, ["orders-eu.v2_1"], "only the good name was created");
}
