//! `stream_create` (FEATURE_STREAM_CREATE, D60): many streams in one request, each with its
//! shard count; answered once storage recorded the durable ones (so a restart brings them
//! back with their shards before their first record); a bad request creates nothing.

mod support;

use bytes::Bytes;
use felix_proto::broker::{Broker, BrokerOutput, StorageOutput, TransportOutput};
use felix_proto::features::Features;
use felix_proto::message::{self, Message, NewStream};
use felix_proto::sim::Sim;
use felix_proto::transport::{StreamId, WallClock};
use support::*;

fn create(streams: Vec<NewStream>, request_id: u64) -> Bytes {
    json(&Message::StreamCreate(message::StreamCreate {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        streams,
        request_id,
    }))
}

fn new(stream: &str, shards: Option<u32>) -> NewStream {
    NewStream { stream: stream.into(), shards, replication: None, durable: None }
}

fn codes() -> Option<u32> {
    Features::ERROR_CODES.to_words(false).0
}

fn shards_of(sim: &mut Sim, stream: &str) -> Message {
    let (p, s, _) = raw_session(sim, Some(1), (Features::STREAM_SHARDS | Features::ERROR_CODES).to_words(false).0);
    sim.raw_send(
        p,
        s,
        json(&Message::StreamShards(message::StreamShards {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: stream.into(),
            request_id: 9,
        })),
        false,
    );
    sim.run();
    messages(&sim.take_received(p, s)).remove(0)
}

#[test]
fn streams_are_created_with_their_shards_and_come_back_after_a_restart_before_any_record() {
    let mut sim = Sim::new(config(), epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let (lo, hi) = (Features::ERROR_CODES | Features::STREAM_CREATE).to_words(true);
    sim.raw_send(p, s, auth(Some(1), lo, hi), false);
    sim.run();
    let Message::AuthOk(ok) = messages(&sim.take_received(p, s)).remove(0) else { panic!() };
    assert!(Features::from_words(ok.server_features, ok.server_features_hi).contains(Features::STREAM_CREATE));
    // One that exists already (used once, default width 1) is reported, left as it is.
    sim.raw_send(p, s, publish_json("used", "x", Some(1), Some(felix_proto::binary::AckMode::PerMessage)), false);
    sim.run();
    sim.take_received(p, s);
    let mut streams: Vec<NewStream> = (0..50).map(|i| new(&format!("s{i:02}"), Some(1 + i % 4))).collect();
    streams.push(new("used", Some(8)));
    streams.push(NewStream { durable: Some(false), ..new("scratch", Some(2)) });
    sim.raw_send(p, s, create(streams, 2), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::StreamCreateOk(ok) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(ok.request_id, 2);
    assert_eq!(ok.created.len(), 51);
    assert_eq!(ok.existed, vec![message::ExistingStream { stream: "used".into(), shards: 1 }]);
    assert!(matches!(shards_of(&mut sim, "s03"), Message::StreamShardsView(v) if v.shards == 4));
    // Storage recorded every durable one, and only those.
    assert_eq!(sim.created_streams.len(), 50);
    assert!(!sim.created_streams.contains_key(&("t1".into(), "default".into(), "scratch".into())));
    // Restarted before any record was written: the created streams are back, with their shards;
    // the in-memory one is not.
    sim.restart();
    assert!(matches!(shards_of(&mut sim, "s03"), Message::StreamShardsView(v) if v.shards == 4));
    assert!(matches!(shards_of(&mut sim, "s10"), Message::StreamShardsView(v) if v.shards == 3));
    // Asked again: every one existed.
    let (p, s, _) = raw_session(&mut sim, Some(1), codes());
    sim.raw_send(p, s, create(vec![new("s03", Some(1))], 3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert!(
        matches!(&ms[0], Message::StreamCreateOk(ok) if ok.created.is_empty() && ok.existed[0].shards == 4),
        "{ms:?}"
    );
}

#[test]
fn the_answer_waits_for_storage_to_record_the_streams_and_names_a_failure() {
    let mut b = Broker::new(config(), WallClock::new(epoch(), 1_700_000_000_000_000));
    let now = epoch();
    let conn = b.admit(felix_proto::broker::PeerAddr([1; 16]), now).unwrap();
    let st = StreamId(0);
    b.handle_stream_data(conn, st, auth(Some(1), codes(), None), false, now);
    b.handle_stream_data(conn, st, create(vec![new("a", Some(2)), new("b", Some(3))], 7), false, now);
    let mut tokens = Vec::new();
    let mut sent = Vec::new();
    while let Some(o) = b.poll_output() {
        match o {
            BrokerOutput::Storage(StorageOutput::CreateStream { token, stream, shards, .. }) => {
                tokens.push((token, stream, shards))
            }
            BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => sent.extend_from_slice(&data),
            _ => {}
        }
    }
    assert_eq!(tokens.iter().map(|(_, s, n)| (s.as_str(), *n)).collect::<Vec<_>>(), [("a", 2), ("b", 3)]);
    assert_eq!(messages(&sent).len(), 1, "only auth_ok: the answer waits for storage");
    b.handle_stream_recorded(tokens[0].0, Ok(()), now);
    b.handle_stream_recorded(tokens[1].0, Err("No space left on device".into()), now);
    let mut sent = Vec::new();
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
            sent.extend_from_slice(&data);
        }
    }
    let ms = messages(&sent);
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("storage"));
    assert!(e.message.contains("No space left on device"), "{e:?}");
}

#[test]
fn a_bad_request_creates_nothing_and_says_why() {
    let mut cfg = config();
    cfg.tokens.push(publish_only_token());
    // Nothing made on first use either: a stream exists only if a request created it.
    cfg.auto_create = false;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(1), codes());
    let too_many: Vec<NewStream> = (0..10_001).map(|i| new(&format!("n{i}"), None)).collect();
    let cases: Vec<(Vec<NewStream>, &str, &str)> = vec![
        (vec![], "invalid_request", "names 0 streams"),
        (too_many, "invalid_request", "names 10001 streams"),
        (vec![new("a", None), new("a", Some(2))], "invalid_request", "named twice"),
        (vec![new("ok", None), new("bad", Some(0))], "invalid_request", "asks for 0 shards"),
        (vec![new("bad", Some(5000))], "invalid_request", "asks for 5000 shards"),
        (
            vec![NewStream { replication: Some(3), ..new("r", None) }],
            "invalid_request",
            "a broker that runs alone keeps one",
        ),
        (vec![NewStream { replication: Some(9), ..new("r", None) }], "invalid_request", "1 to 7"),
        (vec![new("$groups.x", None)], "invalid_request", "reserved for the broker"),
        (vec![new("has/slash", None)], "invalid_request", ""),
    ];
    for (i, (streams, code, says)) in cases.into_iter().enumerate() {
        sim.raw_send(p, s, create(streams, i as u64), false);
        sim.run();
        let ms = messages(&sim.take_received(p, s));
        let Message::Error(e) = &ms[0] else { panic!("case {i}: {ms:?}") };
        assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some(code), "case {i}: {e:?}");
        assert!(e.message.contains(says), "case {i}: {e:?}");
    }
    assert!(sim.created_streams.is_empty(), "nothing created");
    let m = shards_of(&mut sim, "ok");
    assert!(matches!(&m, Message::StreamShardsView(v) if v.shards == 0), "not even the good one: {m:?}");
    // Without the admin permission: forbidden, nothing created.
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let auth = auth_publish_only(codes());
    sim.raw_send(p, s, auth, false);
    sim.raw_send(p, s, create(vec![new("mine", None)], 1), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[1] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("forbidden"));
    assert!(sim.created_streams.is_empty());
    // Explicit creation works where nothing is created on first use.
    let (p, s, _) = raw_session(&mut sim, Some(1), codes());
    sim.raw_send(p, s, create(vec![new("ok", Some(2))], 1), false);
    sim.run();
    assert!(matches!(&messages(&sim.take_received(p, s))[0], Message::StreamCreateOk(_)));
    assert!(matches!(shards_of(&mut sim, "ok"), Message::StreamShardsView(v) if v.shards == 2));
}

#[test]
fn a_namespace_quota_counts_every_stream_of_the_request() {
    let mut cfg = config();
    cfg.tenant_limits = vec![felix_proto::broker::TenantLimit {
        tenant_id: "t1".into(),
        max_streams_per_namespace: Some(2),
        ..felix_proto::broker::TenantLimit::default()
    }];
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(1), codes());
    sim.raw_send(p, s, create(vec![new("a", None), new("b", None), new("c", None)], 1), false);
    sim.raw_send(p, s, create(vec![new("a", None), new("b", None)], 2), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("limit_exceeded"), "{e:?}");
    assert!(matches!(&ms[1], Message::StreamCreateOk(ok) if ok.created.len() == 2), "{ms:?}");
}
