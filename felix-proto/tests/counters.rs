//! Counters (FEATURE_COUNTERS): durable sums folded from a system log.

mod support;

use bytes::Bytes;
use felix_proto::broker::{Action, Grant, TokenGrant};
use felix_proto::client::{ClientConfig, ClientEvent, ClientStream, Reply};
use felix_proto::features::Features;
use felix_proto::message::{self, Message};
use felix_proto::sim::{Sim, StorageMode};
use support::*;

fn durable_config() -> felix_proto::broker::BrokerConfig {
    let mut c = config();
    c.history_reads = true; // the driver has storage
    c
}

fn add(key: &str, delta: i64, request_id: u64) -> Bytes {
    json(&Message::CounterAdd(message::CounterAdd {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "hits".into(),
        key: key.into(),
        delta,
        request_id,
    }))
}

fn get(key: &str, request_id: u64) -> Bytes {
    json(&Message::CounterGet(message::CounterGet {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "hits".into(),
        key: key.into(),
        request_id,
    }))
}

fn value(v: Option<i64>, request_id: u64) -> Message {
    Message::CounterValue(message::CounterValue { value: v, request_id })
}

fn features(f: Features) -> Option<u32> {
    f.to_words(false).0
}

#[test]
fn adds_answer_the_sum_once_durable_and_absent_is_not_zero() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s, auth_ok) = raw_session(&mut sim, Some(1), features(Features::COUNTERS));
    let Message::AuthOk(a) = auth_ok else { panic!("{auth_ok:?}") };
    assert!(a.server_features.unwrap() & features(Features::COUNTERS).unwrap() != 0, "advertised with storage");
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, get("a", 1), false);
    sim.raw_send(p, s, add("a", 5, 2), false);
    sim.raw_send(p, s, add("a", -2, 3), false);
    sim.raw_send(p, s, add("b", 0, 4), false);
    sim.run();
    assert_eq!(messages(&sim.take_received(p, s)), vec![value(None, 1)], "nothing answered before the disk");
    sim.complete_all_writes();
    sim.raw_send(p, s, get("a", 5), false);
    sim.raw_send(p, s, get("b", 6), false);
    sim.run();
    assert_eq!(
        messages(&sim.take_received(p, s)),
        vec![value(Some(5), 2), value(Some(3), 3), value(Some(0), 4), value(Some(3), 5), value(Some(0), 6)],
    );
}

#[test]
fn a_failed_write_leaves_the_counter_unchanged_and_later_answers_wait_their_turn() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s, _) = raw_session(&mut sim, None, features(Features::COUNTERS | Features::ERROR_CODES));
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, add("a", 5, 1), false);
    // Refused at once, but answered after the add before it (errors carry no request id).
    sim.raw_send(
        p,
        s,
        json(&Message::CacheGet(message::CacheGet {
            tenant_id: "other-tenant".into(),
            namespace: "default".into(),
            cache: "c".into(),
            key: "k".into(),
            request_id: Some(2),
        })),
        false,
    );
    sim.run();
    assert!(sim.take_received(p, s).is_empty());
    let w = sim.pending_writes[0].token;
    sim.complete_write(w, false);
    sim.raw_send(p, s, get("a", 3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("storage"));
    let Message::Error(e) = &ms[1] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("forbidden"));
    assert_eq!(ms[2], value(None, 3), "the failed add counted nothing");
}

#[test]
fn sums_survive_a_restart_and_checkpoints_truncate_the_log() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s, _) = raw_session(&mut sim, None, features(Features::COUNTERS));
    let mut want = std::collections::HashMap::new();
    for i in 0..10_000i64 {
        let k = format!("k{}", i % 5);
        *want.entry(k.clone()).or_insert(0) += i;
        sim.raw_send(p, s, add(&k, i, i as u64), false);
        if i % 100 == 0 {
            sim.run();
        }
    }
    sim.run();
    sim.take_received(p, s);
    let cut = sim.truncations.iter().filter(|t| t.0 == "$counters.hits").count();
    assert!(cut >= 2, "checkpoints let the log be truncated: {cut}");
    let kept = sim.durable.iter().filter(|w| w.stream == "$counters.hits").count();
    assert!(kept < 5000, "storage holds a checkpoint and the deltas after it, not all 10000: {kept}");
    sim.restart();
    let (p, s, _) = raw_session(&mut sim, None, features(Features::COUNTERS));
    for i in 0..5 {
        sim.raw_send(p, s, get(&format!("k{i}"), i), false);
    }
    sim.raw_send(p, s, add("k0", 1, 9), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    for i in 0..5u64 {
        assert_eq!(ms[i as usize], value(Some(want[&format!("k{i}")]), i));
    }
    assert_eq!(ms[5], value(Some(want["k0"] + 1), 9));
}

#[test]
fn a_broker_without_storage_does_not_offer_counters() {
    let mut sim = Sim::new(config(), epoch());
    let f = Features::COUNTERS | Features::UNSUPPORTED;
    let (p, s, auth_ok) = raw_session(&mut sim, Some(1), features(f));
    let Message::AuthOk(a) = auth_ok else { panic!("{auth_ok:?}") };
    assert_eq!(a.server_features.unwrap() & features(Features::COUNTERS).unwrap(), 0);
    sim.raw_send(p, s, add("a", 1, 7), false);
    sim.run();
    assert_eq!(
        messages(&sim.take_received(p, s)),
        vec![Message::Unsupported(message::Unsupported {
            request_type: "counter_add".into(),
            request_id: Some(7),
            extension: None
        })]
    );
    // A client that offered neither bit: the old behaviour, the stream is closed.
    let (q, qs, _) = raw_session(&mut sim, None, None);
    sim.raw_send(q, qs, add("a", 1, 8), false);
    sim.run();
    assert!(sim.clients[q].finished.contains(&qs) && sim.clients[q].stopped.contains(&qs));
}

#[test]
fn counters_need_cache_permissions_and_reserved_names_stay_reserved() {
    let mut cfg = durable_config();
    cfg.tokens.push(TokenGrant {
        token: "reader".into(),
        tenant_id: Some("t1".into()),
        principal: "reader".into(),
        grants: vec![
            Grant { action: Action::CacheRead, pattern: "*".into() },
            Grant { action: Action::Publish, pattern: "*".into() },
        ],
    });
    let mut sim = Sim::new(cfg, epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    sim.raw_send(
        p,
        s,
        json(&Message::Auth(message::Auth {
            tenant_id: "t1".into(),
            token: "reader".into(),
            client_flags: None,
            client_flags_hi: None,
            client_features: features(Features::COUNTERS | Features::ERROR_CODES),
            client_features_hi: None,
        })),
        false,
    );
    sim.run();
    sim.take_received(p, s);
    sim.raw_send(p, s, add("a", 1, 1), false);
    sim.raw_send(p, s, get("a", 2), false);
    sim.raw_send(
        p,
        s,
        publish_json("$counters.hits", "forged", Some(3), Some(felix_proto::binary::AckMode::PerMessage)),
        false,
    );
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("forbidden"));
    assert_eq!(ms[1], value(None, 2));
    let Message::PublishError(e) = &ms[2] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("invalid_request"));
}

#[test]
fn the_client_state_machine_adds_and_reads() {
    let mut sim = Sim::new(durable_config(), epoch());
    let mut cfg = ClientConfig::new("t1", TOKEN);
    cfg.features |= Features::COUNTERS;
    let c = sim.connect(cfg);
    sim.run();
    sim.take_events(c);
    let a = sim.client(c).counter_add(ClientStream(0), "default", "hits", "x", 41).unwrap();
    let b = sim.client(c).counter_add(ClientStream(0), "default", "hits", "x", 1).unwrap();
    let g = sim.client(c).counter_get(ClientStream(0), "default", "hits", "nope").unwrap();
    sim.run();
    assert_eq!(
        sim.take_events(c),
        vec![
            ClientEvent::Reply { request_id: a, reply: Reply::CounterValue(Some(41)) },
            ClientEvent::Reply { request_id: b, reply: Reply::CounterValue(Some(42)) },
            ClientEvent::Reply { request_id: g, reply: Reply::CounterValue(None) },
        ]
    );
}
