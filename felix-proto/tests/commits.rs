//! Atomic commits (FEATURE_ATOMIC_COMMIT): `commit` writes an event and state changes as one
//! record; `state_get` reads the state.

mod support;

use bytes::Bytes;
use felix_proto::features::Features;
use felix_proto::message::{self, B64, Message, RefusedReason, StateChange};
use felix_proto::sim::{Sim, StorageMode};
use support::*;

fn durable_config() -> felix_proto::broker::BrokerConfig {
    let mut c = config();
    c.history_reads = true; // the driver has storage
    c
}

fn features(f: Features) -> Option<u32> {
    f.to_words(false).0
}

fn put(key: &str, value: &str) -> StateChange {
    StateChange::Put { key: key.into(), value: B64(Bytes::copy_from_slice(value.as_bytes())) }
}

fn del(key: &str) -> StateChange {
    StateChange::Delete { key: key.into() }
}

fn commit(stream: &str, event: &str, changes: Vec<StateChange>, request_id: u64, expected: Option<u64>) -> Bytes {
    json(&Message::Commit(message::Commit {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        entity_key: B64(Bytes::from_static(b"account-1")),
        event: B64(Bytes::copy_from_slice(event.as_bytes())),
        changes,
        shard: None,
        request_id,
        expected_offset: expected,
    }))
}

fn get(key: &str, request_id: u64) -> Bytes {
    json(&Message::StateGet(message::StateGet {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "accounts".into(),
        entity_key: B64(Bytes::from_static(b"account-1")),
        key: key.into(),
        shard: None,
        request_id,
    }))
}

fn value(v: Option<&str>, version: Option<u64>, as_of: Option<u64>, request_id: u64) -> Message {
    Message::StateValue(message::StateValue {
        value: v.map(|s| B64(Bytes::copy_from_slice(s.as_bytes()))),
        version,
        as_of,
        request_id,
    })
}

fn commit_ok(request_id: u64, offset: u64) -> Message {
    Message::CommitOk(message::CommitOk { request_id, offset })
}

const ALL: Features = Features::ATOMIC_COMMIT.union(Features::PUBLISH_CONDITIONAL).union(Features::ERROR_CODES);

#[test]
fn a_commit_is_one_record_and_its_state_appears_with_its_event() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s, auth_ok) = raw_session(&mut sim, Some(1), features(ALL));
    let Message::AuthOk(a) = auth_ok else { panic!("{auth_ok:?}") };
    assert!(a.server_features.unwrap() & features(Features::ATOMIC_COMMIT).unwrap() != 0, "advertised with storage");
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, commit("accounts", "opened", vec![put("balance", "10"), put("owner", "ann")], 1, None), false);
    sim.raw_send(p, s, get("balance", 2), false);
    sim.run();
    // Nothing is visible before the write: not the state, not the answer (the read, answered
    // with the state as it was, keeps its turn behind the commit).
    assert_eq!(messages(&sim.take_received(p, s)), vec![]);
    assert_eq!(sim.pending_writes.len(), 1, "event and state go to storage as one batch");
    assert_eq!(sim.pending_writes[0].records.count(), 1);
    assert!(sim.pending_writes[0].state.is_some());
    sim.complete_all_writes();
    assert_eq!(messages(&sim.take_received(p, s)), vec![commit_ok(1, 0), value(None, None, None, 2)]);
    sim.raw_send(p, s, commit("accounts", "deposit", vec![put("balance", "15"), del("owner")], 3, None), false);
    sim.run();
    sim.complete_all_writes();
    for (i, k) in ["balance", "owner", "never"].iter().enumerate() {
        sim.raw_send(p, s, get(k, 10 + i as u64), false);
    }
    sim.run();
    assert_eq!(
        messages(&sim.take_received(p, s)),
        vec![
            commit_ok(3, 1),
            value(Some("15"), Some(1), Some(1), 10),
            value(None, None, Some(1), 11),
            value(None, None, Some(1), 12),
        ]
    );
    // The events are ordinary records of the stream.
    let events: Vec<Bytes> = sim.durable.iter().flat_map(|w| w.records.iter().map(|r| r.payload)).collect();
    assert_eq!(events, [&b"opened"[..], b"deposit"]);
}

#[test]
fn a_failed_write_applies_nothing_and_a_mismatched_expectation_writes_nothing() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(1), features(ALL));
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, commit("accounts", "e", vec![put("balance", "10")], 1, None), false);
    sim.run();
    let w = sim.pending_writes[0].token;
    sim.complete_write(w, false);
    sim.raw_send(p, s, get("balance", 2), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("storage"));
    assert_eq!(ms[1], value(None, None, None, 2), "the failed commit changed no state");
    // With expected_offset: refused when the shard's tail differs, nothing written.
    sim.raw_send(p, s, commit("accounts", "e", vec![put("balance", "10")], 3, Some(5)), false);
    sim.run();
    assert!(sim.pending_writes.is_empty(), "nothing written");
    let ms = messages(&sim.take_received(p, s));
    let Message::PublishRefused(r) = &ms[0] else { panic!("{ms:?}") };
    let tail = match r.reason {
        RefusedReason::OffsetMismatch { tail } => tail,
        ref other => panic!("{other:?}"),
    };
    assert_eq!(r.request_id, 3);
    // At the tail it names, it goes through.
    sim.raw_send(p, s, commit("accounts", "e", vec![put("balance", "10")], 4, Some(tail)), false);
    sim.run();
    sim.complete_all_writes();
    assert_eq!(messages(&sim.take_received(p, s)), vec![commit_ok(4, tail)]);
}

/// Retention compacts a shard that holds state: the state goes to storage as a checkpoint with
/// the truncation, and a restart rebuilds it from the checkpoint and the commits after it
/// (values, versions and `as_of` as before; a key deleted after the checkpoint stays deleted).
#[test]
fn retention_compacts_a_shard_holding_state_and_a_restart_rebuilds_it_from_the_checkpoint() {
    let mut cfg = durable_config();
    cfg.default_stream.retention.max_records = Some(2);
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(1), features(ALL));
    for i in 0..10u64 {
        sim.raw_send(p, s, commit("accounts", "e", vec![put(&format!("k{i}"), &i.to_string())], i, None), false);
    }
    sim.run();
    sim.take_received(p, s);
    // Written within one second: the state went with the first truncation only, and the
    // broker asks for its sweep to hand over the rest, idle as it is otherwise.
    let due = sim.broker.poll_timeout().expect("a checkpoint is owed");
    assert!(due <= sim.now + std::time::Duration::from_secs(1));
    sim.advance(std::time::Duration::from_secs(2));
    assert_eq!(sim.broker.poll_timeout(), None, "nothing owed after the sweep");
    let start = sim.truncations.iter().filter(|t| t.0 == "accounts").map(|t| t.2).max();
    assert_eq!(start, Some(8), "retention keeps two records: {:?}", sim.truncations);
    assert!(sim.durable.iter().all(|w| w.stream != "accounts" || w.base_offset >= 8), "older commits are gone");
    // After the checkpoint: one key deleted, one overwritten.
    sim.raw_send(p, s, commit("accounts", "e", vec![del("k0"), put("k1", "one")], 30, None), false);
    sim.run();
    sim.take_received(p, s);
    sim.restart();
    let (p, s, _) = raw_session(&mut sim, Some(1), features(ALL));
    for (i, k) in ["k0", "k1", "k2", "k9"].iter().enumerate() {
        sim.raw_send(p, s, get(k, 20 + i as u64), false);
    }
    sim.run();
    assert_eq!(
        messages(&sim.take_received(p, s)),
        vec![
            value(None, None, Some(10), 20),
            value(Some("one"), Some(10), Some(10), 21),
            value(Some("2"), Some(2), Some(10), 22),
            value(Some("9"), Some(9), Some(10), 23),
        ]
    );
}

#[test]
fn commits_need_a_durable_stream_and_a_broker_with_storage() {
    // An ephemeral stream has no log to hold state.
    let mut cfg = ephemeral_config();
    cfg.tokens = config().tokens;
    cfg.history_reads = true;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(1), features(ALL));
    sim.raw_send(p, s, commit("ticks", "e", vec![put("k", "v")], 1, None), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("invalid_request"), "{e:?}");
    // Without storage the feature is not advertised, and a commit is an unknown request.
    let mut sim = Sim::new(config(), epoch());
    let (p, s, auth_ok) = raw_session(&mut sim, Some(1), features(ALL | Features::UNSUPPORTED));
    let Message::AuthOk(a) = auth_ok else { panic!("{auth_ok:?}") };
    assert_eq!(a.server_features.unwrap() & features(Features::ATOMIC_COMMIT).unwrap(), 0);
    sim.raw_send(p, s, commit("accounts", "e", vec![put("k", "v")], 1, None), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert!(matches!(&ms[0], Message::Unsupported(u) if u.request_type == "commit"), "{ms:?}");
    assert!(sim.durable.is_empty());
}

#[test]
fn the_client_state_machine_commits_and_reads_state() {
    use felix_proto::client::{ClientConfig, ClientEvent, ClientStream, CommitRequest, Reply};
    let mut sim = Sim::new(durable_config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    sim.take_events(c);
    let req = |changes: Vec<(String, Option<Bytes>)>, expected_offset| CommitRequest {
        namespace: "default".into(),
        stream: "accounts".into(),
        entity_key: Bytes::from_static(b"account-1"),
        event: Bytes::from_static(b"event"),
        changes,
        expected_offset,
    };
    let a =
        sim.client(c).commit(ClientStream(0), req(vec![("k".into(), Some(Bytes::from_static(b"v")))], None)).unwrap();
    sim.run();
    let b = sim.client(c).commit(ClientStream(0), req(vec![("k".into(), None)], Some(0))).unwrap();
    sim.run();
    let g =
        sim.client(c).state_get(ClientStream(0), "default", "accounts", Bytes::from_static(b"account-1"), "k").unwrap();
    sim.run();
    let ev = sim.take_events(c);
    assert_eq!(ev[0], ClientEvent::Reply { request_id: a, reply: Reply::Committed(0) });
    assert!(
        matches!(&ev[1], ClientEvent::Reply { request_id, reply: Reply::Refused { reason: RefusedReason::OffsetMismatch { tail: 1 }, .. } } if *request_id == b),
        "the second expected the shard empty: {ev:?}"
    );
    assert_eq!(
        ev[2],
        ClientEvent::Reply {
            request_id: g,
            reply: Reply::State { value: Some(Bytes::from_static(b"v")), version: Some(0), as_of: Some(0) }
        }
    );
    // Against a broker without storage the client refuses to send it.
    let mut sim = Sim::new(config(), epoch());
    let c = sim.connect(ClientConfig::new("t1", TOKEN));
    sim.run();
    let err = sim.client(c).commit(ClientStream(0), req(vec![], None)).unwrap_err();
    assert_eq!(err, felix_proto::client::CommandError::NotNegotiated("FEATURE_ATOMIC_COMMIT"));
}

/// FEATURE_ATOMIC_COMMIT is a broker bit: a client that offered nothing (a legacy `auth`) is
/// served the same, and its answers carry no field it did not ask for (no error codes).
#[test]
fn a_client_that_offered_nothing_is_served_alike() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s, ok) = raw_session(&mut sim, None, None);
    assert_eq!(ok, Message::Ok(message::OkMsg {}), "a legacy client gets plain ok");
    sim.raw_send(p, s, commit("accounts", "e", vec![put("k", "v")], 1, None), false);
    sim.raw_send(p, s, commit("other", "e", vec![], 3, Some(7)), false);
    sim.run();
    // Answers carry their request id; a refusal made at once may overtake an answer that
    // waits for its write.
    let ms = messages(&sim.take_received(p, s));
    assert!(ms.contains(&commit_ok(1, 0)), "{ms:?}");
    assert!(
        ms.iter().any(|m| matches!(m, Message::PublishRefused(r) if r.request_id == 3 && r.reason == RefusedReason::OffsetMismatch { tail: 0 })),
        "{ms:?}"
    );
    sim.raw_send(p, s, get("k", 2), false);
    sim.run();
    assert_eq!(messages(&sim.take_received(p, s)), [value(Some("v"), Some(0), Some(0), 2)]);
}

/// A commit's answer keeps its turn on its stream: an `error` carries no request id, so a
/// client gives one to its oldest unanswered request, and a later request's immediate refusal
/// sent ahead of a commit still waiting for its write would be taken as the commit's (the
/// fault schedule's committer sent a written commit again after a `stale_claim` meant for a
/// group ack, and the stream held it twice). Here a `state_get` of a stream that does not
/// exist is refused at once while the commit before it waits for its write: the commit's
/// `commit_ok` still comes first. Without the held turn the refusal came first.
#[test]
fn a_refusal_never_overtakes_a_commit_still_waiting_for_its_write() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(1), features(ALL));
    // The stream exists (its first commit written) before the one that waits.
    sim.raw_send(p, s, commit("accounts", "e0", vec![put("balance", "0")], 1, None), false);
    sim.run();
    sim.take_received(p, s);
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, commit("accounts", "e1", vec![put("balance", "10")], 2, None), false);
    let mut missing = json(&Message::StateGet(message::StateGet {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "$reserved".into(),
        entity_key: B64(Bytes::from_static(b"account-1")),
        key: "balance".into(),
        shard: None,
        request_id: 3,
    }))
    .to_vec();
    missing.extend_from_slice(&get("balance", 4));
    sim.raw_send(p, s, Bytes::from(missing), false);
    sim.run();
    assert!(messages(&sim.take_received(p, s)).is_empty(), "nothing before the commit's answer");
    sim.complete_all_writes();
    let ms = messages(&sim.take_received(p, s));
    assert!(
        matches!(&ms[..], [Message::CommitOk(c), Message::Error(_), Message::StateValue(v)]
        if c.request_id == 2 && v.request_id == 4),
        "{ms:?}"
    );
}
