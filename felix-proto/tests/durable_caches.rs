//! Durable caches: every change written to the cache's system log (`$cache.NAME`) before the
//! write is answered, so values, versions and expiries survive a restart; checkpoints keep the
//! log short.

mod support;

use bytes::Bytes;
use felix_proto::broker::CacheSpec;
use felix_proto::features::Features;
use felix_proto::message::{self, B64, Message};
use felix_proto::sim::{Sim, StorageMode};
use std::time::Duration;
use support::*;

fn durable_config(durable: bool) -> felix_proto::broker::BrokerConfig {
    let mut c = config();
    c.history_reads = true; // the driver has storage
    c.caches.push(CacheSpec {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        name: "sessions".into(),
        durable,
        replication: 1,
    });
    c
}

fn put(key: &str, value: &str, ttl_ms: Option<u64>, request_id: u64) -> Bytes {
    json(&Message::CachePut(message::CachePut {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "sessions".into(),
        key: key.into(),
        value: B64(Bytes::copy_from_slice(value.as_bytes())),
        request_id: Some(request_id),
        ttl_ms,
    }))
}

fn get(key: &str, request_id: u64) -> Bytes {
    json(&Message::CacheGet(message::CacheGet {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "sessions".into(),
        key: key.into(),
        request_id: Some(request_id),
    }))
}

fn delete(key: &str, request_id: u64) -> Bytes {
    json(&Message::CacheDelete(message::CacheDelete {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "sessions".into(),
        key: key.into(),
        request_id: Some(request_id),
    }))
}

/// (value, version) of every `cache_value` answer, in order.
fn values(ms: &[Message]) -> Vec<(Option<String>, Option<u64>)> {
    ms.iter()
        .filter_map(|m| match m {
            Message::CacheValue(v) => {
                Some((v.value.as_ref().map(|b| String::from_utf8_lossy(&b.0).into_owned()), v.version))
            }
            _ => None,
        })
        .collect()
}

fn session(sim: &mut Sim) -> (usize, felix_proto::transport::StreamId) {
    let f = Features::CACHE_CONDITIONAL | Features::CACHE_DELETE;
    let (p, s, _) = raw_session(sim, Some(1), f.to_words(false).0);
    (p, s)
}

#[test]
fn a_durable_cache_answers_a_write_once_it_is_on_disk_and_keeps_it_across_a_restart() {
    let mut sim = Sim::new(durable_config(true), epoch());
    let (p, s) = session(&mut sim);
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, put("a", "1", None, 1), false);
    sim.run();
    assert!(messages(&sim.take_received(p, s)).is_empty(), "nothing answered before the disk");
    sim.complete_all_writes();
    sim.run();
    assert_eq!(messages(&sim.take_received(p, s)), vec![Message::CacheOk(message::CacheOk { request_id: 1 })]);
    sim.storage = StorageMode::Immediate;
    sim.raw_send(p, s, put("b", "2", None, 2), false);
    sim.raw_send(p, s, put("gone", "x", None, 3), false);
    sim.raw_send(p, s, delete("gone", 4), false);
    sim.raw_send(p, s, put("brief", "y", Some(1_000), 5), false);
    sim.raw_send(p, s, get("a", 6), false);
    sim.raw_send(p, s, get("b", 7), false);
    sim.run();
    let before = values(&messages(&sim.take_received(p, s)));
    assert_eq!(before.len(), 3, "{before:?}");
    let (va, vb) = (before[1].1.expect("a version"), before[2].1.expect("b version"));
    sim.restart();
    let (p, s) = session(&mut sim);
    for (i, k) in ["a", "b", "gone", "brief"].into_iter().enumerate() {
        sim.raw_send(p, s, get(k, 10 + i as u64), false);
    }
    sim.run();
    let after = values(&messages(&sim.take_received(p, s)));
    assert_eq!(
        after[..3],
        [(Some("1".into()), Some(va)), (Some("2".into()), Some(vb)), (None, None)],
        "values and versions as before the restart; the deleted key stays deleted"
    );
    assert_eq!(after[3].0.as_deref(), Some("y"), "an expiry not yet due survives");
    // Its expiry still holds after the restart; a new write takes a later version.
    sim.advance(Duration::from_secs(2));
    sim.raw_send(p, s, get("brief", 20), false);
    sim.raw_send(p, s, put("a", "3", None, 21), false);
    sim.raw_send(p, s, get("a", 22), false);
    sim.run();
    let later = values(&messages(&sim.take_received(p, s)));
    assert_eq!(later[0], (None, None), "expired on time after the restart");
    assert!(later[1].0.as_deref() == Some("3") && later[1].1 > Some(vb), "{later:?}");
}

#[test]
fn a_cache_kept_in_memory_starts_empty_after_a_restart() {
    let mut sim = Sim::new(durable_config(false), epoch());
    let (p, s) = session(&mut sim);
    sim.raw_send(p, s, put("a", "1", None, 1), false);
    sim.run();
    assert!(sim.durable.iter().all(|w| !w.stream.starts_with("$cache.")), "nothing written");
    sim.restart();
    let (p, s) = session(&mut sim);
    sim.raw_send(p, s, get("a", 2), false);
    sim.run();
    assert_eq!(values(&messages(&sim.take_received(p, s))), vec![(None, None)]);
}

#[test]
fn checkpoints_keep_a_durable_caches_log_short_and_fold_to_the_same_values() {
    let mut sim = Sim::new(durable_config(true), epoch());
    let (p, s) = session(&mut sim);
    for i in 0..10_000u64 {
        sim.raw_send(p, s, put(&format!("k{}", i % 5), &i.to_string(), None, i), false);
        if i % 100 == 0 {
            sim.run();
        }
    }
    sim.run();
    sim.take_received(p, s);
    let cut = sim.truncations.iter().filter(|t| t.0 == "$cache.sessions").count();
    assert!(cut >= 2, "checkpoints let the log be truncated: {cut}");
    let kept = sim.durable.iter().filter(|w| w.stream == "$cache.sessions").count();
    assert!(kept < 5000, "storage holds a checkpoint and the changes after it, not all 10000: {kept}");
    sim.restart();
    let (p, s) = session(&mut sim);
    for i in 0..5 {
        sim.raw_send(p, s, get(&format!("k{i}"), i), false);
    }
    sim.run();
    let got: Vec<Option<String>> = values(&messages(&sim.take_received(p, s))).into_iter().map(|v| v.0).collect();
    let want: Vec<Option<String>> = (0..5).map(|i| Some((9995 + i).to_string())).collect();
    assert_eq!(got, want);
}
