//! Subscriptions (positions, join offsets, replay joining live delivery, queues, resume) and
//! the cache.

mod support;

use bytes::Bytes;
use felix_proto::broker::{Broker, BrokerOutput, Retention, StorageOutput, StreamConfig, StreamSpec, TransportOutput};
use felix_proto::client::{
    ClientConfig, ClientEvent, ClientStream, EndReason, PublishRequest, Reply, SubscribeRequest,
};
use felix_proto::features::Features;
use felix_proto::message::{self, CursorErrorReason, Message, StartPosition};
use felix_proto::sim::Sim;
use felix_proto::transport::{StreamId, WallClock};
use felix_proto::{Decoded, Payload};
use std::time::Duration;
use support::*;

fn offsets_of(batches: &[felix_proto::EventBatch]) -> Vec<u64> {
    batches.iter().flat_map(|b| (0..u64::from(b.records.count())).map(move |i| b.base_offset.unwrap() + i)).collect()
}

#[test]
fn hello_first_then_join_offsets_for_latest_earliest_and_offset() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0027), None);
    for i in 0..3 {
        sim.raw_send(p, s, publish_binary("orders", &[&format!("m{i}"), &format!("n{i}")], None, None), false);
    }
    sim.run();
    for start in [None, Some(StartPosition::Earliest), Some(StartPosition::Offset(3))] {
        sim.raw_send(p, s, subscribe("orders", start), false);
    }
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let joins: Vec<_> = ms
        .iter()
        .map(|m| match m {
            Message::Subscribed(x) => (x.start_offset, x.live_offset),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(joins, vec![(Some(6), Some(6)), (Some(0), Some(6)), (Some(3), Some(6))]);
    let es = event_streams(&sim, p);
    assert_eq!(es.len(), 3);
    let replayed: Vec<Vec<u64>> = es
        .iter()
        .map(|e| {
            let got = payloads(&sim.take_received(p, *e));
            assert!(matches!(&got[0], Payload::Json(Decoded::Message(Message::EventStreamHello(_)))));
            offsets_of(&event_batches(&got))
        })
        .collect();
    assert_eq!(
        replayed,
        vec![vec![], vec![0, 1, 2, 3, 4, 5], vec![3, 4, 5]],
        "resume inside a batch starts at the offset"
    );
}

#[test]
fn cursor_errors_name_what_is_available() {
    let mut cfg = config();
    cfg.default_stream.retention = Retention { max_records: Some(2), max_bytes: None, max_age: None };
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0027), None);
    for i in 0..3 {
        sim.raw_send(p, s, publish_binary("orders", &[&format!("m{i}")], None, None), false);
    }
    sim.run();
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Offset(0))), false);
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Offset(9))), false);
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Earliest)), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(
        ms[0],
        Message::SubscribeCursorError(message::SubscribeCursorError {
            reason: CursorErrorReason::TooOld,
            requested: 0,
            available: 1
        })
    );
    assert_eq!(
        ms[1],
        Message::SubscribeCursorError(message::SubscribeCursorError {
            reason: CursorErrorReason::InFuture,
            requested: 9,
            available: 3
        })
    );
    let Message::Subscribed(x) = &ms[2] else { panic!() };
    assert_eq!(x.start_offset, Some(1), "earliest is the oldest retained, not 0");
}

#[test]
fn replay_joins_live_delivery_without_gap_or_duplicate() {
    let mut sim = Sim::new(config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let s0 = ClientStream(0);
    let now = sim.now;
    for i in 0..50 {
        let req = PublishRequest::new("default", "orders", vec![Bytes::from(format!("pre{i}"))]);
        sim.client(c).publish(s0, req, now).unwrap();
    }
    sim.run();
    let sub = sim
        .client(c)
        .subscribe(
            s0,
            SubscribeRequest {
                namespace: "default".into(),
                stream: "orders".into(),
                start: Some(StartPosition::Earliest),
                shard: None,
                queue_capacity: None,
                filter: None,
            },
            now,
        )
        .unwrap();
    // Publish more while the replay is being written (interleaved one step at a time).
    for i in 0..50 {
        let req = PublishRequest::new("default", "orders", vec![Bytes::from(format!("live{i}"))]);
        sim.client(c).publish(s0, req, now).unwrap();
        sim.run();
    }
    let ev = sim.take_events(c);
    let mut offsets = Vec::new();
    let mut payloads_seen = Vec::new();
    for e in &ev {
        if let ClientEvent::Events { sub: s, batch } = e {
            assert_eq!(*s, sub);
            for (i, p) in batch.records.payloads().enumerate() {
                offsets.push(batch.base_offset.unwrap() + i as u64);
                payloads_seen.push(p);
            }
        }
    }
    assert_eq!(offsets, (0..100).collect::<Vec<_>>());
    assert_eq!(payloads_seen[50], Bytes::from("live0"));
}

#[test]
fn one_encoding_per_batch_is_shared_by_every_subscriber_of_a_shape() {
    let now = epoch();
    let mut b = Broker::new(config(), WallClock::new(now, 0));
    let mut subs = Vec::new();
    for _ in 0..3 {
        let conn = b.connection_opened(now);
        let s = StreamId(0);
        b.handle_stream_data(conn, s, auth(Some(0x0027), None, None), false, now);
        b.handle_stream_data(conn, s, subscribe("orders", None), false, now);
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) = o {
                b.handle_stream_opened(conn, token, StreamId(3), now);
            }
        }
        subs.push(conn);
    }
    let publisher = b.connection_opened(now);
    b.handle_stream_data(publisher, StreamId(0), auth(Some(0x0027), None, None), false, now);
    while b.poll_output().is_some() {}
    b.handle_stream_data(publisher, StreamId(0), publish_binary("orders", &["x", "y"], None, None), false, now);
    let mut heads = Vec::new();
    let mut writes = Vec::new();
    while let Some(o) = b.poll_output() {
        match o {
            BrokerOutput::Transport(TransportOutput::Transmit { conn, data, .. }) if subs.contains(&conn) => {
                heads.push(data)
            }
            BrokerOutput::Storage(StorageOutput::Persist(w)) => writes.push(w),
            _ => {}
        }
    }
    assert_eq!(writes.len(), 1);
    b.handle_write_complete(writes[0].token, true, now);
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Transport(TransportOutput::Transmit { conn, data, .. }) = o
            && subs.contains(&conn)
        {
            heads.push(data);
        }
    }
    // Each subscriber got the head and the record block; all three share both buffers.
    assert_eq!(heads.len(), 6);
    for pair in heads.chunks(2) {
        assert_eq!(pair[0].as_ptr(), heads[0].as_ptr(), "one encoded head for every subscriber");
        assert_eq!(pair[1].as_ptr(), heads[1].as_ptr(), "one record block for every subscriber");
    }
    // And the block is the very bytes the publisher sent.
    assert_eq!(writes[0].records.raw().as_ptr(), heads[1].as_ptr());
}

#[test]
fn queue_capacity_is_clamped_and_echoed() {
    let mut cfg = config();
    cfg.subscriber_queue_capacity_max = 16;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0027), Some(Features::SUBSCRIBE_QUEUE.0 as u32));
    for q in [Some(0u32), Some(8), Some(1000), None] {
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
                queue_capacity: q,
                filter: None,
            })),
            false,
        );
    }
    sim.run();
    let caps: Vec<_> = messages(&sim.take_received(p, s))
        .into_iter()
        .map(|m| match m {
            Message::Subscribed(x) => x.queue_capacity,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(caps, vec![Some(1), Some(8), Some(16), None]);
}

#[test]
fn a_slow_subscriber_never_blocks_publishers_and_memory_stays_bounded() {
    let (mut sim, slow, fast, (p, s)) = slow_and_fast(config(), 4);
    sim.set_slow(slow, true);
    let payload = "x".repeat(256);
    for i in 0..200 {
        sim.raw_send(p, s, publish_binary("orders", &[&payload], Some(i), None), false);
        sim.run();
        // Bounded: at most `capacity` batches (plus the writer credit) are held for the slow one.
        assert!(sim.broker.queued_event_bytes() <= 4 * 400, "{}", sim.broker.queued_event_bytes());
    }
    assert_eq!(acks(&payloads(&sim.take_received(p, s))).len(), 200, "every publish answered");
    let fe = event_streams(&sim, fast)[0];
    assert_eq!(offsets_of(&event_batches(&payloads(&sim.take_received(fast, fe)))), (0..200).collect::<Vec<_>>());
    sim.set_slow(slow, false);
    sim.run();
    let se = event_streams(&sim, slow)[0];
    let got = offsets_of(&event_batches(&payloads(&sim.take_received(slow, se))));
    assert!(got.len() < 200 && got.windows(2).all(|w| w[0] < w[1]), "drops show as jumps, order kept: {got:?}");
    assert!(sim.broker.stats().records_dropped > 0);
}

/// An ephemeral stream with a slow subscriber and a fast one (queues of 8 batches, 1 KiB of
/// writer credit), and its publisher: the three parties.
fn ephemeral_slow_and_fast(hold: Duration) -> (Sim, usize, usize, (usize, StreamId)) {
    let mut cfg = ephemeral_config();
    cfg.publisher_hold_max = hold;
    slow_and_fast(cfg, 8)
}

/// The numbers of the records party `who` received on its first event stream.
fn numbers(sim: &mut Sim, who: usize) -> Vec<u64> {
    let e = event_streams(sim, who)[0];
    event_batches(&payloads(&sim.take_received(who, e)))
        .iter()
        .flat_map(|b| b.records.payloads().collect::<Vec<_>>())
        .map(|p| String::from_utf8_lossy(&p).trim().parse().expect("a number"))
        .collect()
}

/// The slow subscriber stops reading and `n` records are published: the publisher is held
/// (fewer than 20 answered). Returns the parties and how many were answered.
fn held_after(n: u64) -> (Sim, usize, usize, (usize, StreamId), usize) {
    let (mut sim, slow, fast, (p, s)) = ephemeral_slow_and_fast(Duration::from_secs(1));
    sim.set_slow(slow, true);
    publish_n(&mut sim, (p, s), 0..n);
    let early = acks(&payloads(&sim.take_received(p, s))).len();
    assert!(early < 20, "the publisher is held, {early} of {n} answered");
    assert!(sim.broker.stats().publishers_held >= 1);
    (sim, slow, fast, (p, s), early)
}

#[test]
fn an_ephemeral_stream_holds_its_publisher_for_a_slow_subscriber_and_loses_nothing() {
    let (mut sim, slow, fast, (p, s), early) = held_after(100);
    // Held: the publisher's stream is not read while the slow queue is over half full.
    assert!(sim.broker.queued_event_bytes() <= 8 * 400, "{}", sim.broker.queued_event_bytes());
    // The subscriber reads again: its queue drains, the publisher goes on, nothing is lost,
    // and no time had to pass.
    sim.set_slow(slow, false);
    sim.run();
    assert_eq!(early + acks(&payloads(&sim.take_received(p, s))).len(), 100, "every publish answered");
    for who in [slow, fast] {
        assert_eq!(numbers(&mut sim, who), (0..100).collect::<Vec<_>>(), "party {who} got every record, in order");
    }
    let st = sim.broker.stats();
    assert_eq!((st.records_dropped, st.subscribers_excused), (0, 0));
}

#[test]
fn a_stopped_subscriber_holds_its_publisher_only_as_long_as_allowed_and_holds_again_once_drained() {
    let (mut sim, slow, fast, (p, s), early) = held_after(100);
    sim.advance(Duration::from_millis(999));
    assert_eq!(acks(&payloads(&sim.take_received(p, s))).len(), 0, "still held before the deadline");
    sim.advance(Duration::from_millis(1));
    // Past the deadline: the stopped subscriber is left behind and loses what overflows its
    // queue; the publisher and the fast subscriber go on.
    assert_eq!(early + acks(&payloads(&sim.take_received(p, s))).len(), 100, "every publish answered");
    assert_eq!(numbers(&mut sim, fast), (0..100).collect::<Vec<_>>());
    assert_eq!(sim.broker.stats().subscribers_excused, 1);
    assert!(sim.broker.stats().records_dropped > 0);
    // Excused, it holds no one while it stays behind...
    let held = sim.broker.stats().publishers_held;
    publish_n(&mut sim, (p, s), 100..120);
    assert_eq!(acks(&payloads(&sim.take_received(p, s))).len(), 20);
    assert_eq!(sim.broker.stats().publishers_held, held);
    // ...and once it caught up it is held for again.
    sim.set_slow(slow, false);
    sim.run();
    let got = numbers(&mut sim, slow);
    assert!(got.len() < 100 && got.windows(2).all(|w| w[0] < w[1]), "what its queue held, in order: {got:?}");
    sim.set_slow(slow, true);
    publish_n(&mut sim, (p, s), 120..200);
    assert!(sim.broker.stats().publishers_held > held, "a drained subscriber holds again");
    assert!(acks(&payloads(&sim.take_received(p, s))).len() < 20);
}

#[test]
fn a_holding_subscriber_that_goes_away_releases_its_publisher_at_once() {
    let (mut sim, slow, fast, (p, s), early) = held_after(50);
    sim.drop_connection(slow);
    sim.run();
    assert_eq!(early + acks(&payloads(&sim.take_received(p, s))).len(), 50, "released without waiting");
    assert_eq!(numbers(&mut sim, fast), (0..50).collect::<Vec<_>>());
}

#[test]
fn with_no_hold_allowed_an_ephemeral_stream_drops_for_a_slow_subscriber_at_once() {
    let (mut sim, slow, fast, (p, s)) = ephemeral_slow_and_fast(Duration::ZERO);
    sim.set_slow(slow, true);
    publish_n(&mut sim, (p, s), 0..100);
    assert_eq!(acks(&payloads(&sim.take_received(p, s))).len(), 100, "never held");
    assert_eq!(numbers(&mut sim, fast), (0..100).collect::<Vec<_>>());
    let st = sim.broker.stats();
    assert!(st.records_dropped > 0);
    assert_eq!(st.publishers_held, 0);
}

#[test]
fn a_slow_subscriber_queue_is_bounded_in_bytes_not_only_in_batches() {
    // Room for 1000 batches, but big batches: the byte bound is what holds.
    let mut cfg = config();
    cfg.event_stream_inflight_bytes = 1024;
    cfg.subscriber_queue_bytes_max = 64 * 1024;
    cfg.default_stream = StreamConfig { queue_capacity: 1000, ..StreamConfig::default() };
    let mut sim = Sim::new(cfg, epoch());
    let (slow, ss, _) = raw_session(&mut sim, Some(0x0027), None);
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), None);
    sim.raw_send(slow, ss, subscribe("orders", None), false);
    sim.run();
    sim.set_slow(slow, true);
    let payload = "x".repeat(16 * 1024);
    for i in 0..100 {
        sim.raw_send(p, s, publish_binary("orders", &[&payload], Some(i), None), false);
        sim.run();
        let q = sim.broker.queued_event_bytes();
        assert!(q <= 64 * 1024, "queue bytes bounded: {q}");
    }
    assert!(sim.broker.queued_event_bytes() > 32 * 1024, "the queue filled up to the bound");
    assert!(sim.broker.stats().records_dropped > 0, "past the bound batches are dropped");
    assert_eq!(acks(&payloads(&sim.take_received(p, s))).len(), 100, "publishers are never held");
    sim.set_slow(slow, false);
    sim.run();
    let se = event_streams(&sim, slow)[0];
    let got = offsets_of(&event_batches(&payloads(&sim.take_received(slow, se))));
    assert!(got.len() < 100 && got.windows(2).all(|w| w[0] < w[1]), "drops show as jumps: {got:?}");
    // One batch larger than the bound still reaches a subscriber that keeps up.
    let huge = "y".repeat(100 * 1024);
    sim.raw_send(p, s, publish_binary("orders", &[&huge], Some(1000), None), false);
    sim.run();
    let got = event_batches(&payloads(&sim.take_received(slow, se)));
    assert_eq!(got.len(), 1, "an empty queue takes any one batch");
}

#[test]
fn ephemeral_streams_have_no_offsets_and_no_history() {
    let mut sim = Sim::new(ephemeral_config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(Features::ERROR_CODES.0 as u32));
    sim.raw_send(p, s, publish_binary("live", &["before"], None, None), false);
    sim.raw_send(p, s, subscribe("live", Some(StartPosition::Earliest)), false);
    sim.raw_send(p, s, subscribe("live", Some(StartPosition::Offset(0))), false);
    sim.raw_send(p, s, publish_binary("live", &["after"], Some(1), None), false);
    sim.run();
    let got = payloads(&sim.take_received(p, s));
    let Payload::Json(Decoded::Message(Message::Subscribed(x))) = &got[0] else { panic!("{got:?}") };
    assert_eq!((x.start_offset, x.live_offset), (None, None));
    assert!(matches!(&got[1], Payload::Json(Decoded::Message(Message::Error(_)))));
    let e = event_streams(&sim, p)[0];
    let batches = event_batches(&payloads(&sim.take_received(p, e)));
    assert_eq!(batches.len(), 1);
    assert_eq!(batches[0].base_offset, None);
    assert_eq!(batches[0].records.payloads().collect::<Vec<_>>(), vec![Bytes::from("after")]);
    assert!(batches[0].publisher.is_some() && !batches[0].records.is_timed(), "publisher yes, timestamps never");
    assert!(sim.writes.is_empty(), "nothing persisted");
}

#[test]
fn unsubscribe_ends_delivery() {
    let mut sim = Sim::new(config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let now = sim.now;
    let req = SubscribeRequest {
        namespace: "default".into(),
        stream: "orders".into(),
        start: None,
        shard: None,
        queue_capacity: None,
        filter: None,
    };
    let sub = sim.client(c).subscribe(ClientStream(0), req, now).unwrap();
    sim.run();
    assert_eq!(sim.broker.subscription_count(), 1);
    sim.client(c).unsubscribe(sub, now).unwrap();
    sim.run();
    assert_eq!(sim.broker.subscription_count(), 0);
}

#[test]
fn client_sees_lagged_end_with_resume_point() {
    let mut cfg = config();
    cfg.event_stream_inflight_bytes = 1;
    cfg.default_stream = StreamConfig { queue_capacity: 1, ..StreamConfig::default() };
    let mut sim = Sim::new(cfg, epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let now = sim.now;
    let req = SubscribeRequest {
        namespace: "default".into(),
        stream: "orders".into(),
        start: None,
        shard: None,
        queue_capacity: None,
        filter: None,
    };
    let sub = sim.client(c).subscribe(ClientStream(0), req, now).unwrap();
    sim.run();
    sim.set_slow(c, true);
    for i in 0..4 {
        let req = PublishRequest::new("default", "orders", vec![Bytes::from(format!("m{i}"))]);
        sim.client(c).publish(ClientStream(0), req, now).unwrap();
        sim.run();
    }
    sim.set_slow(c, false);
    sim.run();
    let ev = sim.take_events(c);
    let ended = ev.iter().find_map(|e| match e {
        ClientEvent::SubscriptionEnded { sub: s, reason } if *s == sub => Some(reason.clone()),
        _ => None,
    });
    assert_eq!(ended, Some(EndReason::Lagged { resume_from: 2 }));
    // Subscribing again at lagged_resume_point reads the rest from the log: nothing lost,
    // nothing twice.
    let mut got: Vec<u64> = ev.iter().flat_map(event_offsets).collect();
    let from = felix_proto::client::lagged_resume_point(got.last().copied(), 2);
    let req = SubscribeRequest {
        namespace: "default".into(),
        stream: "orders".into(),
        start: Some(StartPosition::Offset(from)),
        shard: None,
        queue_capacity: None,
        filter: None,
    };
    sim.client(c).subscribe(ClientStream(0), req, now).unwrap();
    sim.run();
    got.extend(sim.take_events(c).iter().flat_map(event_offsets));
    assert_eq!(got, vec![0, 1, 2, 3]);
}

/// The offsets of the events in a client event (none for anything else).
fn event_offsets(e: &ClientEvent) -> Vec<u64> {
    match e {
        ClientEvent::Events { batch, .. } => match batch.base_offset {
            Some(b) => (0..u64::from(batch.records.count())).map(|i| b + i).collect(),
            None => Vec::new(),
        },
        _ => Vec::new(),
    }
}

#[test]
fn lagged_resume_point_follows_the_spec() {
    use felix_proto::client::lagged_resume_point;
    assert_eq!(lagged_resume_point(None, 7), 7, "nothing received: resume_from");
    assert_eq!(lagged_resume_point(Some(4), 7), 5, "right after the last event received");
    assert_eq!(lagged_resume_point(Some(u64::MAX), 7), u64::MAX, "never overflows");
}

#[test]
fn cache_put_get_delete_ttl_and_answers() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), None);
    let put = |key: &str, ttl: Option<u64>, rid: Option<u64>| {
        json(&Message::CachePut(message::CachePut {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "primary".into(),
            key: key.into(),
            value: "v".into(),
            request_id: rid,
            ttl_ms: ttl,
        }))
    };
    let get = |key: &str, rid: Option<u64>| {
        json(&Message::CacheGet(message::CacheGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "primary".into(),
            key: key.into(),
            request_id: rid,
        }))
    };
    sim.raw_send(p, s, put("a", None, Some(1)), false);
    sim.raw_send(p, s, put("b", Some(100), None), false);
    sim.raw_send(p, s, get("a", Some(2)), false);
    sim.raw_send(p, s, get("b", None), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms[0], Message::CacheOk(message::CacheOk { request_id: 1 }));
    assert_eq!(ms[1], Message::Ok(message::OkMsg {}), "a write without request_id gets plain ok");
    let Message::CacheValue(v) = &ms[2] else { panic!() };
    assert_eq!((v.value.as_ref().map(|b| b.0.clone()), v.request_id), (Some(Bytes::from("v")), Some(2)));
    assert!(matches!(&ms[3], Message::CacheValue(v) if v.value.is_some() && v.request_id.is_none()));
    sim.advance(Duration::from_millis(100));
    sim.raw_send(p, s, get("b", Some(3)), false);
    sim.raw_send(
        p,
        s,
        json(&Message::CacheDelete(message::CacheDelete {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "primary".into(),
            key: "a".into(),
            request_id: Some(4),
        })),
        false,
    );
    sim.raw_send(p, s, get("a", Some(5)), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let values: Vec<_> = ms
        .iter()
        .map(|m| match m {
            Message::CacheValue(v) => (v.request_id, v.value.as_ref().map(|b| b.0.clone())),
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(values, vec![(Some(3), None), (Some(4), Some(Bytes::from("v"))), (Some(5), None)]);
    // The JSON bytes of a miss carry value null, as every old client expects.
    assert!(std::str::from_utf8(&json(&ms[0])).unwrap().contains("\"value\":null"));
}

#[test]
fn cache_requests_pipeline_over_several_streams() {
    let mut sim = Sim::new(config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let now = sim.now;
    let streams: Vec<ClientStream> = (0..3).map(|_| sim.client(c).open_stream(now)).collect();
    sim.run();
    let mut want = Vec::new();
    for (i, s) in streams.iter().enumerate() {
        for j in 0..10 {
            let key = format!("k{i}-{j}");
            sim.client(c).cache_put(*s, "default", "c", &key, Bytes::from(key.clone()), None).unwrap();
            let rid = sim.client(c).cache_get(*s, "default", "c", &key).unwrap();
            want.push((rid, key));
        }
    }
    sim.run();
    let ev = sim.take_events(c);
    for (rid, key) in want {
        assert!(
            ev.iter().any(|e| matches!(e, ClientEvent::Reply { request_id, reply: Reply::CacheValue { value: Some(v), version: Some(_) } }
            if *request_id == rid && v[..] == *key.as_bytes()))
        );
    }
}

#[test]
fn configured_multi_shard_stream_reports_its_width() {
    let mut cfg = config();
    cfg.streams.push(StreamSpec {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        name: "wide".into(),
        config: StreamConfig { shards: 4, ..StreamConfig::default() },
    });
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), None);
    sim.raw_send(
        p,
        s,
        json(&Message::StreamShards(message::StreamShards {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "wide".into(),
            request_id: 7,
        })),
        false,
    );
    sim.run();
    assert_eq!(
        messages(&sim.take_received(p, s))[0],
        Message::StreamShardsView(message::StreamShardsView { shards: 4, request_id: 7, routing: None })
    );
}

#[test]
fn retention_by_age_drops_old_records_on_a_timer() {
    let mut cfg = config();
    cfg.default_stream.retention =
        Retention { max_records: None, max_bytes: None, max_age: Some(Duration::from_secs(5)) };
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0027), None);
    sim.raw_send(p, s, publish_binary("orders", &["old"], None, None), false);
    sim.run();
    sim.advance(Duration::from_secs(3));
    sim.raw_send(p, s, publish_binary("orders", &["new"], None, None), false);
    sim.run();
    assert_eq!(sim.broker.shard_state("t1", "default", "orders", 0).unwrap().0, 0);
    // The broker asks to be woken for the sweep; nothing else needs to happen.
    assert!(sim.broker.poll_timeout().is_some());
    sim.advance(Duration::from_secs(3));
    let (start, _, _, retained) = sim.broker.shard_state("t1", "default", "orders", 0).unwrap();
    assert_eq!((start, retained), (1, 1), "the 6 s old record is gone, the 3 s old one stays");
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Offset(0))), false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(p, s))[0], Message::SubscribeCursorError(_)));
}

#[test]
fn retention_tells_storage_what_it_may_delete() {
    let mut cfg = config();
    cfg.default_stream.retention = Retention { max_records: Some(4), max_bytes: None, max_age: None };
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0027), None);
    for i in 0..6 {
        sim.raw_send(p, s, publish_binary("orders", &[&format!("m{i}")], None, None), false);
        sim.run();
    }
    assert_eq!(sim.truncations, vec![("orders".to_string(), 0, 1), ("orders".to_string(), 0, 2)]);
    // Ephemeral streams keep nothing on disk: no truncation is ever asked for.
    let mut sim = Sim::new(ephemeral_config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0027), None);
    sim.raw_send(p, s, publish_binary("live", &["x"], None, None), false);
    sim.run();
    assert!(sim.truncations.is_empty());
}

#[test]
fn history_beyond_the_memory_budget_is_read_back_from_storage() {
    let mut cfg = config();
    cfg.history_reads = true;
    cfg.history_read_bytes = 600;
    cfg.default_stream.memory_bytes = 1000;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0827), None);
    let payload = "x".repeat(100);
    for i in 0..50 {
        sim.raw_send(
            p,
            s,
            publish_binary("orders", &[&format!("{i:03}{payload}"), &format!("{i:03}b")], None, None),
            false,
        );
        sim.run();
        if i == 20 {
            sim.broker.start_generation("t1", "default", "orders", 0, sim.now);
            sim.run();
        }
    }
    // Memory holds about the budget, not the history.
    assert!(sim.broker.retained_log_bytes() <= 1000 + 110, "{}", sim.broker.retained_log_bytes());
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Earliest)), false);
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Offset(7))), false);
    sim.run();
    assert!(sim.reads > 2, "history came from storage in bounded reads: {}", sim.reads);
    let es = event_streams(&sim, p);
    let mut all = Vec::new();
    for e in &es {
        let got = event_batches(&payloads(&sim.take_received(p, *e)));
        all.push(got);
    }
    let earliest = offsets_of(&all[0]);
    let want: Vec<u64> = (0..101).filter(|o| *o != 42).collect();
    assert_eq!(earliest, want, "every record once, in order, the generation-start offset skipped");
    assert_eq!(offsets_of(&all[1]), want.iter().copied().filter(|o| *o >= 7).collect::<Vec<_>>());
    let after_gen = all[0].iter().find(|b| b.base_offset == Some(43)).expect("batch after the generation start");
    assert_eq!(after_gen.skipped_before, Some(1));
    // Live delivery continues after the replay.
    sim.raw_send(p, s, publish_binary("orders", &["live"], None, None), false);
    sim.run();
    let more = event_batches(&payloads(&sim.take_received(p, es[0])));
    assert_eq!(offsets_of(&more), vec![101]);
}

/// A subscriber reading history asks for its next read while one read's worth is still being
/// sent (the read overlaps the sending), and no more than that: a subscriber that takes
/// nothing pins at most its in-flight limit plus two reads.
#[test]
fn a_subscriber_behind_reads_one_read_ahead_of_what_it_was_sent_and_no_more() {
    let mut cfg = config();
    cfg.history_reads = true;
    cfg.history_read_bytes = 600;
    cfg.event_stream_inflight_bytes = 500;
    cfg.default_stream.memory_bytes = 1000;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(0x0827), None);
    let payload = "x".repeat(100);
    for i in 0..60 {
        sim.raw_send(p, s, publish_binary("orders", &[&format!("{i:03}{payload}")], None, None), false);
        sim.run();
    }
    let (q, sq, _) = raw_session(&mut sim, Some(0x0827), None);
    sim.set_slow(q, true);
    sim.raw_send(q, sq, subscribe("orders", Some(StartPosition::Earliest)), false);
    sim.run();
    assert_eq!(sim.reads, 2, "the first read, and one more while the first is being sent");
    sim.advance(Duration::from_secs(1));
    sim.run();
    assert_eq!(sim.reads, 2, "nothing more until the subscriber takes what was sent");
    sim.set_slow(q, false);
    sim.run();
    assert!(sim.reads > 4, "{}", sim.reads);
    let es = event_streams(&sim, q);
    let got = event_batches(&payloads(&sim.take_received(q, es[0])));
    assert_eq!(offsets_of(&got), (0..60).collect::<Vec<_>>(), "every record once, in order");
}

#[test]
fn conditional_cache_writes_and_version_only_when_offered() {
    let mut sim = Sim::new(config(), epoch());
    let (lo, hi) = (Features::CACHE_CONDITIONAL.0 as u32, None::<u32>);
    let _ = hi;
    let (p, s, _) = raw_session(&mut sim, Some(0x7FFF), Some(lo));
    let (q, sq, _) = raw_session(&mut sim, None, None);
    let put_if = |cond, rid| {
        json(&Message::CachePutIf(message::CachePutIf {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "c".into(),
            key: "k".into(),
            value: "v".into(),
            ttl_ms: None,
            condition: cond,
            request_id: rid,
        }))
    };
    let get = |rid| {
        json(&Message::CacheGet(message::CacheGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "c".into(),
            key: "k".into(),
            request_id: Some(rid),
        }))
    };
    sim.raw_send(p, s, put_if(message::CacheCondition::Absent, 1), false);
    sim.raw_send(p, s, put_if(message::CacheCondition::Absent, 2), false);
    sim.raw_send(p, s, get(3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::CacheConditionResult(first) = &ms[0] else { panic!("{ms:?}") };
    assert!(first.applied && first.version.is_some());
    assert_eq!(
        ms[1],
        Message::CacheConditionResult(message::CacheConditionResult {
            applied: false,
            version: first.version,
            request_id: 2
        })
    );
    let Message::CacheValue(v) = &ms[2] else { panic!() };
    assert_eq!(v.version, first.version, "a client that offered the bit reads the version");
    let v1 = first.version.unwrap();
    sim.raw_send(p, s, put_if(message::CacheCondition::Version(v1), 4), false);
    sim.raw_send(p, s, put_if(message::CacheCondition::Version(v1), 5), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::CacheConditionResult(r4) = &ms[0] else { panic!() };
    let Message::CacheConditionResult(r5) = &ms[1] else { panic!() };
    assert!(r4.applied && r4.version > Some(v1));
    assert!(!r5.applied && r5.version == r4.version, "a stale version is refused with the current one");
    let del = |version, rid| {
        json(&Message::CacheDeleteIf(message::CacheDeleteIf {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "c".into(),
            key: "k".into(),
            version,
            request_id: rid,
        }))
    };
    sim.raw_send(p, s, del(v1, 6), false);
    sim.raw_send(p, s, del(r4.version.unwrap(), 7), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(
        ms[0],
        Message::CacheConditionResult(message::CacheConditionResult {
            applied: false,
            version: r4.version,
            request_id: 6
        })
    );
    assert_eq!(
        ms[1],
        Message::CacheConditionResult(message::CacheConditionResult { applied: true, version: None, request_id: 7 })
    );
    // A client that did not offer the bit gets the cache_value bytes it always got.
    sim.raw_send(p, s, put_if(message::CacheCondition::Absent, 8), false);
    sim.run();
    sim.take_received(p, s);
    sim.raw_send(q, sq, get(9), false);
    sim.run();
    assert_eq!(
        sim.take_received(q, sq),
        json(&Message::CacheValue(message::CacheValue {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "c".into(),
            key: "k".into(),
            value: Some("v".into()),
            request_id: Some(9),
            version: None,
        }))
    );
}

/// Age-based retention counts from when a record was appended, even across a restart.
#[test]
fn restored_history_ages_from_its_append_time_not_the_restart() {
    use felix_proto::broker::{Broker, Retention, StreamConfig};
    use felix_proto::storage::StoredBatch;
    use felix_proto::transport::WallClock;
    use std::time::Duration;
    let now = epoch();
    let wall = 1_800_000_000_000_000u64;
    let mut b = Broker::new(config(), WallClock::new(now, wall));
    let cfg = StreamConfig {
        retention: Retention { max_age: Some(Duration::from_secs(3600)), ..Retention::default() },
        ..StreamConfig::default()
    };
    let batch = |base: u64, age_secs: u64| StoredBatch {
        key: None,
        base_offset: base,
        timestamp_micros: wall - age_secs * 1_000_000,
        generation_start: false,
        publisher: None,
        producer: None,
        state: None,
        records: felix_proto::Records::from_payloads([&b"x"[..]]).unwrap(),
    };
    b.restore_shard(("t1", "default", "aged"), cfg, 0, vec![batch(0, 7200), batch(1, 5000), batch(2, 60)], now);
    let (start, ..) = b.shard_state("t1", "default", "aged", 0).unwrap();
    assert_eq!(start, 2, "the two records older than an hour are gone at once");
}
