//! Every output is a deterministic function of the inputs: a scenario in which many keys meet
//! where the broker iterates its maps to emit outputs (retention over many streams, many cache
//! entries expiring in one sweep, claims lapsing in many groups, many streams timing out at
//! once), run several times in one process (each run's maps get new hash keys), produces the same
//! byte-for-byte trace every time.

mod support;

use bytes::Bytes;
use felix_proto::broker::{BrokerConfig, Retention, StreamConfig};
use felix_proto::client::{CacheWatchRequest, ClientConfig, ClientStream, PublishRequest, WatchOn};
use felix_proto::features::Features;
use felix_proto::message::{self, Message};
use felix_proto::sim::Sim;
use std::time::{Duration, Instant};
use support::{TOKEN, config};

const S: ClientStream = ClientStream(0);

fn scenario(t0: Instant) -> (u64, u64) {
    let cfg = BrokerConfig {
        history_reads: true,
        default_stream: StreamConfig {
            retention: Retention { max_age: Some(Duration::from_secs(1)), ..Retention::default() },
            ..StreamConfig::default()
        },
        ..config()
    };
    let mut sim = Sim::new(cfg, t0);
    let mut c = ClientConfig::new("t1", TOKEN);
    c.features |= Features::GROUP_CONSUMER | Features::GROUP_CLAIM_CONTROL;
    let a = sim.connect(c);
    sim.run();
    let now = sim.now;
    // 20 streams with history that retention by age removes in one sweep; 10 groups each
    // claiming a record briefly.
    for i in 0..20 {
        let req = PublishRequest::new("default", format!("s{i:02}"), vec![Bytes::from(format!("r{i}"))]).acked();
        sim.client(a).publish(S, req, now).unwrap();
    }
    sim.run();
    for g in 0..10 {
        sim.client(a)
            .request(S, |request_id| {
                Message::GroupPoll(message::GroupPoll {
                    tenant_id: "t1".into(),
                    namespace: "default".into(),
                    stream: format!("s{:02}", g % 4),
                    shard: 0,
                    group: format!("g{g}"),
                    max_records: 1,
                    wait_ms: 0,
                    request_id,
                    consumer: None,
                    reclaim: None,
                    visibility_ms: Some(300),
                })
            })
            .unwrap();
    }
    // 5 caches, each watched by prefix, with 10 entries that expire together.
    for cache in 0..5 {
        let w = CacheWatchRequest {
            namespace: "default".into(),
            cache: format!("c{cache}"),
            filter: WatchOn::Prefix(String::new()),
            from_offset: None,
            retained: false,
        };
        sim.client(a).cache_watch(S, w).unwrap();
    }
    sim.run();
    for cache in 0..5 {
        for k in 0..10 {
            let v = Bytes::from(format!("v{k}"));
            sim.client(a).cache_put(S, "default", &format!("c{cache}"), &format!("k{k}"), v, Some(200)).unwrap();
        }
    }
    // 20 raw streams that never authenticate.
    let raw = sim.connect_raw();
    for _ in 0..20 {
        let s = sim.raw_open_bi(raw);
        sim.raw_send(raw, s, &b"FLX1"[..], false);
    }
    sim.run();
    // Time passes: claims lapse, entries expire, history ages out, streams time out.
    for _ in 0..12 {
        sim.advance(Duration::from_millis(1000));
    }
    sim.run();
    let truncations = sim.truncations.len() as u64;
    (sim.trace.value(), truncations)
}

#[test]
fn the_same_inputs_give_the_same_outputs_byte_for_byte() {
    let t0 = support::epoch();
    let (first, truncations) = scenario(t0);
    assert!(truncations >= 20, "retention truncated the streams ({truncations})");
    for run in 1..6 {
        assert_eq!(scenario(t0), (first, truncations), "run {run} differs");
    }
}

/// A subscriber holding the publishers of many ephemeral streams (its queues over half full)
/// goes away: the broker releases each held publisher, and the order of those releases (which
/// stream is read again first) is the same in every run. `drop_conn` once walked the
/// connection's subscriptions in hash-map order.
fn releases(t0: Instant) -> u64 {
    use support::*;
    let mut cfg = support::ephemeral_config();
    cfg.publisher_hold_max = Duration::from_secs(10);
    cfg.event_stream_inflight_bytes = 1024;
    cfg.default_stream.queue_capacity = 4;
    let mut sim = Sim::new(cfg, t0);
    let (slow, ss, _) = raw_session(&mut sim, Some(0x0027), None);
    let mut publishers = Vec::new();
    for i in 0..16 {
        sim.raw_send(slow, ss, subscribe(&format!("e{i:02}"), None), false);
        publishers.push(raw_session(&mut sim, Some(0x7FFF), None));
    }
    sim.run();
    sim.set_slow(slow, true);
    let payload = "h".repeat(256);
    for round in 0..12u64 {
        for (i, (p, s, _)) in publishers.iter().enumerate() {
            sim.raw_send(*p, *s, publish_binary(&format!("e{i:02}"), &[&payload], Some(round), None), false);
        }
        sim.run();
    }
    assert!(sim.broker.stats().publishers_held >= 16, "every publisher is held");
    sim.drop_connection(slow);
    sim.run();
    sim.trace.value()
}

#[test]
fn a_subscriber_holding_many_publishers_releases_them_in_the_same_order_every_run() {
    let t0 = support::epoch();
    let first = releases(t0);
    for run in 1..8 {
        assert_eq!(releases(t0), first, "run {run} differs");
    }
}
