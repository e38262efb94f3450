//! Subscription filters on record keys (D57): a subscriber gets only the batches whose key its
//! filter matches; the offsets it is not sent show as `skipped_before` (and as gaps), live,
//! catching up from memory and reading history from storage alike; a filter shared by several
//! subscriptions is judged once per batch.

mod support;

use bytes::Bytes;
use felix_proto::client::{ClientConfig, ClientConnection, ClientEvent, ClientOutput, ClientStream, SubscribeRequest};
use felix_proto::features::Features;
use felix_proto::message::{self, B64, KeyFilter, Message, StartPosition};
use felix_proto::sim::Sim;
use felix_proto::transport::{Dir, Side, StreamId};
use support::*;

/// Offsets, event stream hello excepted, with what each batch says it skipped.
fn batches(sim: &mut Sim, p: usize, es: StreamId) -> Vec<(u64, Option<u64>, Vec<Bytes>)> {
    event_batches(&payloads(&sim.take_received(p, es)))
        .into_iter()
        .map(|b| (b.base_offset.unwrap_or(u64::MAX), b.skipped_before, b.records.payloads().collect()))
        .collect()
}

/// A raw session offering offsets and skipped_before (0x0827) and the filter feature.
fn session(sim: &mut Sim) -> (usize, StreamId) {
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let features = Features::STREAM_FILTER.to_words(true);
    sim.raw_send(p, s, auth(Some(0x0827), features.0, features.1), false);
    sim.run();
    let Some(Message::AuthOk(ok)) = messages(&sim.take_received(p, s)).into_iter().next() else { panic!() };
    assert!(
        Features::from_words(ok.server_features, ok.server_features_hi).contains(Features::STREAM_FILTER),
        "a single broker advertises the filter"
    );
    (p, s)
}

/// A client subscription to `orders` with `filter`.
fn orders_request(filter: Option<KeyFilter>) -> SubscribeRequest {
    SubscribeRequest {
        namespace: "default".into(),
        stream: "orders".into(),
        start: None,
        shard: None,
        queue_capacity: None,
        filter,
    }
}

fn keys(k: &[&str]) -> Option<KeyFilter> {
    Some(KeyFilter {
        keys: k.iter().map(|k| B64(Bytes::copy_from_slice(k.as_bytes()))).collect(),
        key_prefixes: vec![],
    })
}

fn prefixes(k: &[&str]) -> Option<KeyFilter> {
    Some(KeyFilter {
        keys: vec![],
        key_prefixes: k.iter().map(|k| B64(Bytes::copy_from_slice(k.as_bytes()))).collect(),
    })
}

/// Keyed batches at offsets: a 0, b1 1–2, c 3, a 4, unkeyed 5, b2 6.
fn publish_mix(sim: &mut Sim, p: usize, s: StreamId) {
    for (key, payloads) in [
        (Some("a"), &["a0"][..]),
        (Some("b1"), &["b1", "b2"]),
        (Some("c"), &["c3"]),
        (Some("a"), &["a4"]),
        (None, &["n5"]),
        (Some("b2"), &["b6"]),
    ] {
        sim.raw_send(p, s, publish_binary("orders", payloads, None, key), false);
        sim.run();
    }
}

fn want_a() -> Vec<(u64, Option<u64>, Vec<Bytes>)> {
    vec![(0, None, vec![Bytes::from("a0")]), (4, Some(3), vec![Bytes::from("a4")])]
}

fn want_b() -> Vec<(u64, Option<u64>, Vec<Bytes>)> {
    vec![(1, Some(1), vec![Bytes::from("b1"), Bytes::from("b2")]), (6, Some(3), vec![Bytes::from("b6")])]
}

#[test]
fn live_subscribers_get_only_what_their_filter_matches_and_the_rest_as_skipped() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s) = session(&mut sim);
    for f in [keys(&["a"]), prefixes(&["b"]), None, keys(&["a"])] {
        sim.raw_send(p, s, subscribe_filtered("orders", None, f), false);
    }
    sim.run();
    let es = event_streams(&sim, p);
    assert_eq!(es.len(), 4);
    let before = sim.broker.stats().filter_evaluations;
    publish_mix(&mut sim, p, s);
    assert_eq!(batches(&mut sim, p, es[0]), want_a());
    assert_eq!(batches(&mut sim, p, es[1]), want_b());
    let all = batches(&mut sim, p, es[2]);
    assert_eq!(all.iter().map(|b| b.0).collect::<Vec<_>>(), vec![0, 1, 3, 4, 5, 6], "no filter: everything");
    assert_eq!(batches(&mut sim, p, es[3]), want_a());
    // Two distinct filters (the two `a` subscriptions share one), six batches.
    assert_eq!(sim.broker.stats().filter_evaluations - before, 12);
}

#[test]
fn catching_up_from_memory_and_from_storage_filters_the_same_way() {
    // History in memory.
    let mut sim = Sim::new(config(), epoch());
    let (p, s) = session(&mut sim);
    publish_mix(&mut sim, p, s);
    sim.raw_send(p, s, subscribe_filtered("orders", Some(StartPosition::Earliest), keys(&["a"])), false);
    sim.raw_send(p, s, subscribe_filtered("orders", Some(StartPosition::Earliest), prefixes(&["b"])), false);
    sim.raw_send(p, s, subscribe_filtered("orders", Some(StartPosition::Offset(2)), prefixes(&["b"])), false);
    sim.run();
    let es = event_streams(&sim, p);
    assert_eq!(batches(&mut sim, p, es[0]), want_a());
    assert_eq!(batches(&mut sim, p, es[1]), want_b());
    // Resuming inside a batch it takes: the rest of that batch, then on as before.
    assert_eq!(
        batches(&mut sim, p, es[2]),
        vec![(2, None, vec![Bytes::from("b2")]), (6, Some(3), vec![Bytes::from("b6")])]
    );

    // History read back from storage: a memory budget far below the history.
    let mut cfg = config();
    cfg.history_reads = true;
    cfg.history_read_bytes = 40;
    cfg.default_stream.memory_bytes = 1;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s) = session(&mut sim);
    publish_mix(&mut sim, p, s);
    for round in 0..20u64 {
        let key = if round % 2 == 0 { "a" } else { "z" };
        sim.raw_send(p, s, publish_binary("orders", &[&format!("{key}{}", 7 + round)], None, Some(key)), false);
        sim.run();
    }
    sim.raw_send(p, s, subscribe_filtered("orders", Some(StartPosition::Earliest), keys(&["a"])), false);
    sim.run();
    assert!(sim.reads > 1, "history came from storage: {}", sim.reads);
    let es = event_streams(&sim, p);
    let got = batches(&mut sim, p, es[0]);
    let offsets: Vec<u64> = got.iter().map(|b| b.0).collect();
    let want: Vec<u64> = [0, 4].into_iter().chain((7..27).filter(|o| (o - 7) % 2 == 0)).collect();
    assert_eq!(offsets, want);
    // Every offset is accounted for: what was sent plus what each batch says it skipped.
    let mut next = 0;
    for (base, skipped, records) in &got {
        assert_eq!(base - skipped.unwrap_or(0), next, "batch at {base}");
        next = base + records.len() as u64;
    }
}

#[test]
fn an_ephemeral_stream_sends_a_filtered_subscriber_only_its_batches() {
    let mut sim = Sim::new(ephemeral_config(), epoch());
    let (p, s) = session(&mut sim);
    sim.raw_send(p, s, subscribe_filtered("orders", None, prefixes(&["b"])), false);
    sim.run();
    let es = event_streams(&sim, p);
    publish_mix(&mut sim, p, s);
    let got: Vec<Vec<Bytes>> = batches(&mut sim, p, es[0]).into_iter().map(|b| b.2).collect();
    assert_eq!(got, vec![vec![Bytes::from("b1"), Bytes::from("b2")], vec![Bytes::from("b6")]]);
}

#[test]
fn a_filter_that_is_empty_or_too_big_is_refused() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s) = session(&mut sim);
    let big = KeyFilter { keys: (0..300).map(|i| B64(Bytes::from(format!("k{i}")))).collect(), key_prefixes: vec![] };
    for (f, why) in [
        (KeyFilter::default(), "at least one key"),
        (big, "at most 256"),
        (KeyFilter { keys: vec![B64(Bytes::from(vec![b'k'; 70_000]))], key_prefixes: vec![] }, "at most 65536 bytes"),
    ] {
        sim.raw_send(p, s, subscribe_filtered("orders", None, Some(f)), false);
        sim.run();
        let m = messages(&sim.take_received(p, s));
        match &m[..] {
            [Message::Error(e)] => assert!(e.message.contains(why), "{}", e.message),
            other => panic!("{other:?}"),
        }
    }
    assert!(event_streams(&sim, p).is_empty());
}

#[test]
fn a_client_sends_a_filter_only_to_a_broker_that_advertises_it() {
    let now = epoch();
    let mut c = ClientConnection::new(ClientConfig::new("t1", TOKEN), now);
    let Some(ClientOutput::OpenBi { token }) = c.poll_output() else { panic!() };
    let s = StreamId::new(Side::Client, Dir::Bi, 0);
    c.handle_stream_opened(token, s, now);
    while c.poll_output().is_some() {}
    let ok = Message::AuthOk(message::AuthOk {
        server_flags: 0x7FFF,
        server_flags_hi: None,
        server_features: Some(Features::ERROR_CODES.0 as u32),
        server_features_hi: None,
        listener_ports: None,
        publish_window: None,
    });
    c.handle_stream_data(s, json(&ok), false, now);
    assert!(matches!(c.poll_event(), Some(ClientEvent::Connected { .. })));
    let req = orders_request(keys(&["a"]));
    let e = c.subscribe(ClientStream(0), req, now).expect_err("not advertised");
    assert!(e.to_string().contains("FEATURE_STREAM_FILTER"), "{e}");
}

#[test]
fn a_client_subscription_with_a_filter_gets_only_its_keys() {
    let mut sim = Sim::new(config(), epoch());
    let publisher = sim.connect(ClientConfig::new("t1", TOKEN));
    let reader = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let now = sim.now;
    let req = orders_request(prefixes(&["eu-"]));
    let id = sim.client(reader).subscribe(ClientStream(0), req, now).unwrap();
    sim.run();
    for key in ["eu-1", "us-1", "eu-2", "ap-1"] {
        let now = sim.now;
        let mut req =
            felix_proto::client::PublishRequest::new("default", "orders", vec![Bytes::from(format!("from {key}"))]);
        req.key = Some(Bytes::copy_from_slice(key.as_bytes()));
        sim.client(publisher).publish(ClientStream(0), req, now).unwrap();
        sim.run();
    }
    assert_eq!(delivered_payloads(&sim, reader, id), vec![Bytes::from("from eu-1"), Bytes::from("from eu-2")]);
}

/// A filtered subscriber reading history that storage no longer has, after a read whose every
/// batch its filter passed over: it moves on to what memory holds instead of asking storage
/// for the same offsets again (it did, for ever, while the offsets passed over were unsent).
#[test]
fn a_filtered_history_read_that_storage_cannot_answer_moves_on() {
    use felix_proto::broker::{Broker, BrokerOutput, StorageOutput, TransportOutput};
    use felix_proto::transport::WallClock;
    let mut cfg = config();
    cfg.history_reads = true;
    cfg.history_read_bytes = 40;
    cfg.default_stream.memory_bytes = 1;
    let now = epoch();
    let mut b = Broker::new(cfg, WallClock::new(now, 0));
    let conn = b.connection_opened(now);
    let features = Features::STREAM_FILTER.to_words(true);
    b.handle_stream_data(conn, StreamId(0), auth(Some(0x0827), features.0, features.1), false, now);
    let mut stored = Vec::new();
    let mut reads = Vec::new();
    let settle = |b: &mut Broker, stored: &mut Vec<felix_proto::storage::StoredBatch>, reads: &mut Vec<_>| loop {
        let mut writes = Vec::new();
        while let Some(o) = b.poll_output() {
            match o {
                BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                    b.handle_stream_opened(conn, token, StreamId(3), now)
                }
                BrokerOutput::Storage(StorageOutput::Persist(w)) => writes.push(w),
                BrokerOutput::Storage(StorageOutput::Read(r)) => reads.push(r),
                _ => {}
            }
        }
        if writes.is_empty() {
            return;
        }
        for w in writes {
            stored.push(w.to_stored());
            b.handle_write_complete(w.token, true, now);
        }
    };
    for i in 0..12 {
        let key = if i == 11 { "a" } else { "z" };
        b.handle_stream_data(
            conn,
            StreamId(0),
            publish_binary("orders", &[&format!("{key}{i:02}")], None, Some(key)),
            false,
            now,
        );
        settle(&mut b, &mut stored, &mut reads);
    }
    b.handle_stream_data(
        conn,
        StreamId(0),
        subscribe_filtered("orders", Some(StartPosition::Earliest), keys(&["a"])),
        false,
        now,
    );
    settle(&mut b, &mut stored, &mut reads);
    // The first read: every batch there is passed over.
    let first = reads.pop().expect("history is read from storage");
    let some: Vec<_> =
        stored.iter().filter(|s| s.base_offset >= first.from && s.base_offset < first.from + 3).cloned().collect();
    b.handle_read_complete(first.token, some, now);
    settle(&mut b, &mut stored, &mut reads);
    // The next: storage has nothing any more (retention took it).
    let second = reads.pop().expect("the read goes on");
    assert!(second.from > first.from);
    b.handle_read_complete(second.token, Vec::new(), now);
    settle(&mut b, &mut stored, &mut reads);
    assert!(reads.iter().all(|r| r.from != second.from), "asked again for what storage does not have: {reads:?}");
}
