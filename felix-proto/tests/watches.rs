//! Cache watches (FEATURE_CACHE_WATCH, FEATURE_CACHE_WATCH_RETAINED).

mod support;

use bytes::Bytes;
use felix_proto::client::{CacheWatchRequest, ClientConfig, ClientEvent, ClientStream, EndReason, WatchOn};
use felix_proto::message::{self, CacheEvent, Message};
use felix_proto::sim::{SIM_WALL_EPOCH_MICROS, Sim};
use felix_proto::transport::StreamId;
use felix_proto::{Decoded, Payload};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::time::Duration;
use support::*;

fn put(key: &str, value: &str, ttl_ms: Option<u64>) -> Bytes {
    json(&Message::CachePut(message::CachePut {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "c".into(),
        key: key.into(),
        value: message::B64::from(value),
        request_id: Some(1),
        ttl_ms,
    }))
}

fn delete(key: &str) -> Bytes {
    json(&Message::CacheDelete(message::CacheDelete {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "c".into(),
        key: key.into(),
        request_id: Some(2),
    }))
}

fn watch(key: Option<&str>, prefix: Option<&str>, from_offset: Option<u64>, retained: bool) -> Bytes {
    json(&Message::CacheWatch(message::CacheWatch {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "c".into(),
        key: key.map(Into::into),
        prefix: prefix.map(Into::into),
        shard: None,
        from_offset,
        retained,
        subscription_id: None,
    }))
}

fn started(m: &Message) -> &message::CacheWatchStarted {
    match m {
        Message::CacheWatchStarted(s) => s,
        other => panic!("expected cache_watch_started, got {other:?}"),
    }
}

/// The cache events (and a terminal lag) received on party `p`'s event streams.
fn events(sim: &mut Sim, p: usize, es: StreamId) -> (Vec<CacheEvent>, Option<u64>) {
    let mut out = Vec::new();
    let mut lag = None;
    for pl in payloads(&sim.take_received(p, es)) {
        match pl {
            Payload::Json(Decoded::Message(Message::CacheEvent(e))) => out.push(e),
            Payload::Json(Decoded::Message(Message::CacheWatchLagged(l))) => lag = Some(l.resume_from),
            Payload::Json(Decoded::Message(Message::EventStreamHello(_))) => {}
            other => panic!("unexpected {other:?}"),
        }
    }
    (out, lag)
}

fn kv(e: &[CacheEvent]) -> Vec<(String, Option<String>)> {
    e.iter().map(|e| (e.key.clone(), e.value.as_ref().map(|v| String::from_utf8_lossy(&v.0).into_owned()))).collect()
}

fn send(sim: &mut Sim, p: usize, s: StreamId, b: Bytes) -> Vec<Message> {
    sim.raw_send(p, s, b, false);
    sim.run();
    messages(&sim.take_received(p, s))
}

#[test]
fn key_and_prefix_watches_see_only_their_changes_in_order() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    let k = started(&send(&mut sim, p, s, watch(Some("user:1"), None, None, false))[0]).clone();
    let all = started(&send(&mut sim, p, s, watch(None, Some(""), None, false))[0]).clone();
    let users = started(&send(&mut sim, p, s, watch(None, Some("user:"), None, false))[0]).clone();
    assert!(!k.resnapshot && k.retained_count.is_none());
    for b in [put("user:1", "a", None), put("order:9", "x", None), put("user:2", "b", Some(60_000)), delete("user:1")] {
        send(&mut sim, p, s, b);
    }
    let es = event_streams(&sim, p);
    let (ek, _) = events(&mut sim, p, es[0]);
    let (eall, _) = events(&mut sim, p, es[1]);
    let (eusers, _) = events(&mut sim, p, es[2]);
    assert_eq!(kv(&ek), [("user:1".into(), Some("a".into())), ("user:1".into(), None)]);
    assert_eq!(eall.len(), 4);
    assert_eq!(kv(&eusers).len(), 3);
    assert!(eall.windows(2).all(|w| w[0].offset < w[1].offset), "cache-log order");
    assert_eq!(eall[0].offset, k.resume_offset, "live delivery begins at resume_offset");
    let ttl = eall.iter().find(|e| e.key == "user:2").unwrap();
    assert_eq!(ttl.expires_at_millis, (SIM_WALL_EPOCH_MICROS / 1000) + 60_000);
    assert_eq!(eall[0].expires_at_millis, 0);
    let _ = (all, users);
}

#[test]
fn resume_from_an_offset_replays_then_follows_and_compacted_history_resnapshots() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    let first = started(&send(&mut sim, p, s, watch(None, Some(""), None, false))[0]).resume_offset;
    for (i, k) in ["a", "b", "a", "c"].iter().enumerate() {
        send(&mut sim, p, s, put(k, &i.to_string(), None));
    }
    // From the second change on: replayed, then live.
    let st = started(&send(&mut sim, p, s, watch(None, Some(""), Some(first + 1), false))[0]).clone();
    assert_eq!(st.resume_offset, first + 4);
    send(&mut sim, p, s, delete("b"));
    let es = event_streams(&sim, p);
    let (replay, _) = events(&mut sim, p, es[1]);
    assert_eq!(
        kv(&replay),
        [
            ("b".into(), Some("1".into())),
            ("a".into(), Some("2".into())),
            ("c".into(), Some("3".into())),
            ("b".into(), None)
        ]
    );
    // Past the tail: a cursor error naming the tail.
    let m = send(&mut sim, p, s, watch(Some("a"), None, Some(first + 99), false));
    assert_eq!(
        m[0],
        Message::SubscribeCursorError(message::SubscribeCursorError {
            reason: message::CursorErrorReason::InFuture,
            requested: first + 99,
            available: first + 5
        })
    );
    // From before the log (an offset of an earlier run): the current values, flagged.
    let st = started(&send(&mut sim, p, s, watch(None, Some(""), Some(3), false))[0]).clone();
    assert!(st.resnapshot);
    let es = event_streams(&sim, p);
    let (snap, _) = events(&mut sim, p, *es.last().unwrap());
    assert_eq!(kv(&snap), [("a".into(), Some("2".into())), ("c".into(), Some("3".into()))]);
}

#[test]
fn retained_starts_with_current_values_and_says_how_many() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    send(&mut sim, p, s, put("k1", "v1", None));
    send(&mut sim, p, s, put("k2", "v2", None));
    let st = started(&send(&mut sim, p, s, watch(None, Some("k"), None, true))[0]).clone();
    assert_eq!(st.retained_count, Some(2));
    let none = started(&send(&mut sim, p, s, watch(Some("missing"), None, None, true))[0]).clone();
    assert_eq!(none.retained_count, Some(0), "0 is an answer");
    send(&mut sim, p, s, put("k1", "v3", None));
    let es = event_streams(&sim, p);
    let (got, _) = events(&mut sim, p, es[0]);
    assert_eq!(
        kv(&got),
        [("k1".into(), Some("v1".into())), ("k2".into(), Some("v2".into())), ("k1".into(), Some("v3".into()))]
    );
}

#[test]
fn bad_watches_are_refused() {
    let mut sim = Sim::new(config(), epoch());
    let codes = felix_proto::features::Features::ERROR_CODES.to_words(false).0;
    let (p, s, _) = raw_session(&mut sim, Some(1), codes);
    for b in [
        watch(Some("a"), Some("b"), None, false),
        watch(None, None, None, false),
        watch(Some("a"), None, Some(1), true),
    ] {
        let m = send(&mut sim, p, s, b);
        assert!(
            matches!(&m[0], Message::Error(e) if e.code.as_ref().is_some_and(|c| c.name() == "invalid_request")),
            "{m:?}"
        );
    }
    let mut w = message::CacheWatch {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "c".into(),
        key: None,
        prefix: Some("p".into()),
        shard: Some(3),
        from_offset: None,
        retained: false,
        subscription_id: None,
    };
    let m = send(&mut sim, p, s, json(&Message::CacheWatch(w.clone())));
    assert!(matches!(&m[0], Message::Error(_)), "a cache has one shard: {m:?}");
    w.shard = Some(0);
    assert!(matches!(send(&mut sim, p, s, json(&Message::CacheWatch(w)))[0], Message::CacheWatchStarted(_)));
}

#[test]
fn expiry_reaches_watchers_as_a_delete() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    send(&mut sim, p, s, watch(Some("session"), None, None, false));
    send(&mut sim, p, s, put("session", "token", Some(1_500)));
    assert!(sim.broker.poll_timeout().is_some(), "the broker sweeps expiries");
    sim.advance(Duration::from_secs(1));
    sim.advance(Duration::from_secs(1));
    let es = event_streams(&sim, p);
    let (got, _) = events(&mut sim, p, es[0]);
    assert_eq!(kv(&got), [("session".into(), Some("token".into())), ("session".into(), None)]);
}

#[test]
fn a_watch_that_falls_behind_lags_with_a_gapless_resume_point() {
    let mut cfg = config();
    cfg.default_stream.queue_capacity = 4;
    cfg.event_stream_inflight_bytes = 1;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    let (w, ws, _) = raw_session(&mut sim, None, None);
    send(&mut sim, w, ws, watch(None, Some(""), None, false));
    sim.set_slow(w, true);
    for i in 0..20 {
        send(&mut sim, p, s, put(&format!("k{i}"), "v", None));
    }
    sim.set_slow(w, false);
    sim.run();
    let es = event_streams(&sim, w);
    let (got, lag) = events(&mut sim, w, es[0]);
    let resume = lag.expect("cache_watch_lagged ends the watch");
    assert!(sim.clients[w].finished.contains(&es[0]));
    assert_eq!(got.last().unwrap().offset + 1, resume, "resume_from is the first change not delivered");
    // Watching again from there misses nothing.
    send(&mut sim, w, ws, watch(None, Some(""), Some(resume), false));
    let second = *event_streams(&sim, w).iter().find(|e| **e != es[0]).expect("a new event stream");
    let (rest, _) = events(&mut sim, w, second);
    assert_eq!(got.len() + rest.len(), 20);
}

#[test]
fn the_client_state_machine_watches() {
    let mut sim = Sim::new(config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    sim.take_events(c);
    let req = CacheWatchRequest {
        namespace: "default".into(),
        cache: "c".into(),
        filter: WatchOn::Key("k".into()),
        from_offset: None,
        retained: true,
    };
    let sub = sim.client(c).cache_watch(ClientStream(0), req).unwrap();
    sim.run();
    let (p, s, _) = raw_session(&mut sim, None, None);
    send(&mut sim, p, s, put("k", "hello", None));
    let ev = sim.take_events(c);
    assert!(
        matches!(ev[0], ClientEvent::CacheWatchStarted { sub: x, retained_count: Some(0), .. } if x == sub),
        "{ev:?}"
    );
    assert!(
        matches!(&ev[1], ClientEvent::CacheEvent { sub: x, event } if *x == sub && event.value.as_ref().is_some_and(|v| v.0 == "hello")),
        "{ev:?}"
    );
    let _ = EndReason::Finished;
}

proptest! {
    /// A watch replayed from any offset of the cache log, applied on top of the state at that
    /// offset, folds to the cache's current state.
    #[test]
    fn a_replay_from_any_offset_folds_to_the_cache(ops in proptest::collection::vec((0u8..3, 0u8..5, any::<u8>()), 1..60), at in any::<prop::sample::Index>()) {
        let mut sim = Sim::new(config(), epoch());
        let (p, s, _) = raw_session(&mut sim, None, None);
        let base = started(&send(&mut sim, p, s, watch(None, Some(""), None, false))[0]).resume_offset;
        for (op, key, v) in &ops {
            let key = format!("k{key}");
            match op {
                0 | 1 => { send(&mut sim, p, s, put(&key, &v.to_string(), None)); }
                _ => { send(&mut sim, p, s, delete(&key)); }
            }
        }
        let es = event_streams(&sim, p);
        let (all, _) = events(&mut sim, p, es[0]);
        // The state at a random point of the log, folded from the full watch...
        let cut = at.index(all.len() + 1);
        let mut state: BTreeMap<String, Option<String>> = BTreeMap::new();
        for (k, v) in kv(&all[..cut]) { state.insert(k, v); }
        // ...plus a watch replayed from that point...
        let from = all.get(cut).map_or(base + all.len() as u64, |e| e.offset);
        send(&mut sim, p, s, watch(None, Some(""), Some(from), false));
        let second = *event_streams(&sim, p).iter().find(|e| **e != es[0]).expect("a new event stream");
        let (replay, _) = events(&mut sim, p, second);
        for (k, v) in kv(&replay) { state.insert(k, v); }
        // ...equals what the cache holds now.
        let live: BTreeMap<String, String> = state.into_iter().filter_map(|(k, v)| v.map(|v| (k, v))).collect();
        let mut now: BTreeMap<String, String> = BTreeMap::new();
        for key in 0..5 {
            let m = send(&mut sim, p, s, json(&Message::CacheGet(message::CacheGet {
                tenant_id: "t1".into(), namespace: "default".into(), cache: "c".into(), key: format!("k{key}"), request_id: Some(3),
            })));
            if let Message::CacheValue(v) = &m[0] && let Some(v) = &v.value {
                now.insert(format!("k{key}"), String::from_utf8_lossy(&v.0).into_owned());
            }
        }
        prop_assert_eq!(live, now);
    }
}

/// `cache_keys` (D50): live keys in byte order, by prefix, paged with `after`/`next`; an
/// expired key is not listed; a cache that does not exist is `not_found` and is not created.
#[test]
fn cache_keys_pages_live_keys_in_order_and_never_creates_a_cache() {
    let mut sim = Sim::new(config(), epoch());
    let codes = felix_proto::features::Features::ERROR_CODES.to_words(false).0.unwrap();
    let (p, s, _) = raw_session(&mut sim, None, Some(codes));
    for k in ["user:3", "user:1", "order:9", "user:2", "user:10"] {
        sim.raw_send(p, s, put(k, "v", None), false);
    }
    sim.raw_send(p, s, put("user:0", "short", Some(10)), false);
    sim.run();
    let _ = sim.take_received(p, s);
    sim.advance(Duration::from_millis(50));
    let keys = |cache: &str, prefix: Option<&str>, after: Option<&str>, limit: Option<u32>, request_id: u64| {
        json(&Message::CacheKeys(message::CacheKeys {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: cache.into(),
            prefix: prefix.map(Into::into),
            after: after.map(Into::into),
            limit,
            request_id,
        }))
    };
    sim.raw_send(p, s, keys("c", Some("user:"), None, Some(2), 1), false);
    sim.raw_send(p, s, keys("c", Some("user:"), Some("user:10"), Some(2), 2), false);
    sim.raw_send(p, s, keys("c", None, None, None, 3), false);
    sim.raw_send(p, s, keys("nosuch", None, None, None, 4), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let view = |m: &Message| match m {
        Message::CacheKeysView(v) => (v.keys.clone(), v.next.clone()),
        other => panic!("{other:?}"),
    };
    assert_eq!(
        view(&ms[0]),
        (vec!["user:1".to_owned(), "user:10".into()], Some("user:10".into())),
        "expired user:0 is not listed"
    );
    assert_eq!(view(&ms[1]), (vec!["user:2".to_owned(), "user:3".into()], None));
    assert_eq!(view(&ms[2]).0, ["order:9", "user:1", "user:10", "user:2", "user:3"]);
    assert!(
        matches!(&ms[3], Message::Error(e) if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("not_found")),
        "{:?}",
        ms[3]
    );
    sim.raw_send(p, s, keys("nosuch", None, None, None, 5), false);
    sim.run();
    assert!(
        matches!(&messages(&sim.take_received(p, s))[0], Message::Error(_)),
        "still not there: the listing created nothing"
    );
}
