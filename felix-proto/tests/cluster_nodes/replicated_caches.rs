//! Replicated caches: no stale read from a partitioned leader, fail-over with values, versions,
//! counters and watch offsets, snapshots.

use super::*;

pub(super) fn sessions() -> ShardId {
    ShardId { kind: Kind::Cache, tenant: "t1".into(), namespace: "default".into(), name: "sessions".into(), shard: 0 }
}

pub(super) fn cache_leader(c: &Cluster) -> Option<String> {
    leader_of(c, &sessions())
}

/// Creates `sessions` replicated three ways and waits for its leader.
/// Names `sessions` in every broker's configuration (kept on disk or not, its replication) and
/// restarts them with it, a few milliseconds apart (each seeds a configured cache's versions
/// from its own clock).
pub(super) fn configure_sessions(c: &mut Cluster, durable: bool, replication: u32) {
    c.cache_specs = vec![felix_proto::broker::CacheSpec {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        name: "sessions".into(),
        durable,
        replication,
    }];
    for (i, n) in NAMES.iter().enumerate() {
        c.now += std::time::Duration::from_millis(7 * i as u64 + 1);
        let now = c.now;
        c.start(n, &RaftLog::default(), now);
    }
}

pub(super) fn create_sessions(c: &mut Cluster) {
    c.create(Kind::Cache, "sessions", 1, 3);
    c.until("a replica leads the cache and the metadata names it", |c| {
        cache_leader(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&sessions()).unwrap().owner == l))
    });
}

pub(super) mod quorum_cache {
    use super::*;
    use felix_proto::features::Features;
    use felix_proto::message::{B64, CacheCondition};

    pub fn put(key: &str, v: &str, ttl_ms: Option<u64>, rid: u64) -> Bytes {
        json(&Message::CachePut(message::CachePut {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: key.into(),
            value: B64::from(v),
            request_id: Some(rid),
            ttl_ms,
        }))
    }

    pub fn put_if(key: &str, v: &str, condition: CacheCondition, rid: u64) -> Bytes {
        json(&Message::CachePutIf(message::CachePutIf {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: key.into(),
            value: B64::from(v),
            ttl_ms: None,
            condition,
            request_id: rid,
        }))
    }

    pub fn get(key: &str, rid: u64) -> Bytes {
        json(&Message::CacheGet(message::CacheGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: key.into(),
            request_id: Some(rid),
        }))
    }

    pub fn add(delta: i64, rid: u64) -> Bytes {
        json(&Message::CounterAdd(message::CounterAdd {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: "logins".into(),
            delta,
            request_id: rid,
        }))
    }

    pub fn watch(from_offset: Option<u64>) -> Bytes {
        json(&Message::CacheWatch(message::CacheWatch {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: None,
            prefix: Some(String::new()),
            shard: None,
            from_offset,
            retained: false,
            subscription_id: None,
        }))
    }

    /// A client on `node` that offered codes, conditional caches, watches and shard moves.
    pub fn client(c: &mut Cluster, node: &str, index: u64) -> (ConnId, StreamId) {
        let f = Features::ERROR_CODES | Features::CACHE_CONDITIONAL | Features::CACHE_WATCH | Features::SHARD_MOVED;
        let (lo, hi) = f.to_words(true);
        let n = c.nodes.get_mut(node).unwrap();
        let conn = n.inputs().admit(PeerAddr([index as u8; 16]), c.now).unwrap();
        let stream = StreamId::new(Side::Client, Dir::Bi, index);
        n.inputs().handle_stream_data(conn, stream, auth(Some(1), lo, hi), false, c.now);
        c.settle();
        let hello = messages(&c.take(node, conn, stream));
        assert!(matches!(&hello[..], [Message::AuthOk(_)]), "{hello:?}");
        (conn, stream)
    }

    pub fn ask(c: &mut Cluster, node: &str, (conn, st): (ConnId, StreamId), b: Bytes) -> Message {
        c.send(node, conn, st, b);
        let mut got = messages(&c.take(node, conn, st));
        assert_eq!(got.len(), 1, "one answer: {got:?}");
        got.remove(0)
    }

    /// The value and version `key` reads on `node`.
    pub fn read(c: &mut Cluster, node: &str, key: &str, index: u64) -> Option<(String, Option<u64>)> {
        let cl = client(c, node, index);
        match ask(c, node, cl, get(key, 1)) {
            Message::CacheValue(v) => v.value.map(|b| (String::from_utf8_lossy(&b.0).into_owned(), v.version)),
            other => panic!("{node} reading {key}: {other:?}"),
        }
    }

    /// Cache events received on `node` for the connection, by event stream, with any final
    /// `shard_moved`.
    pub fn events(
        c: &mut Cluster,
        node: &str,
        conn: ConnId,
    ) -> (Vec<message::CacheEvent>, Option<message::ShardMoved>) {
        let keys: Vec<_> =
            c.received.keys().filter(|(n, cn, s)| n == node && *cn == conn && s.dir() == Dir::Uni).cloned().collect();
        let (mut events, mut moved) = (Vec::new(), None);
        for k in keys {
            let bytes = c.received.remove(&k).unwrap();
            for p in payloads(&bytes) {
                match p {
                    felix_proto::Payload::Json(felix_proto::Decoded::Message(Message::CacheEvent(e))) => events.push(e),
                    felix_proto::Payload::Json(felix_proto::Decoded::Message(Message::ShardMoved(m))) => {
                        moved = Some(m)
                    }
                    _ => {}
                }
            }
        }
        (events, moved)
    }
}

/// A replicated cache's leader is cut off from the other two brokers while its clients still
/// reach it. Tick by tick, a client reads through it while the others elect a leader and take
/// a newer value: the cut-off one answers no read with what it held once the newer value could
/// exist (a stale read). Its read lease ran out before any election could end, so it refuses
/// reads (retry) until it learns it was deposed. Before the cut, reads were answered.
#[test]
fn a_partitioned_cache_leader_answers_no_stale_read_once_a_new_leader_could_exist() {
    use quorum_cache::*;
    let mut c = Cluster::with(&NAMES, true);
    create_sessions(&mut c);
    let old = cache_leader(&c).unwrap();
    let cl = client(&mut c, &old, 1);
    assert_eq!(ask(&mut c, &old, cl, put("k", "v1", None, 2)), Message::CacheOk(message::CacheOk { request_id: 2 }));
    c.tick();
    assert_eq!(read(&mut c, &old, "k", 2).map(|v| v.0).as_deref(), Some("v1"), "answered while it leads");
    c.cut.insert(old.clone());
    let others: Vec<String> = NAMES.iter().filter(|n| **n != old).map(|n| n.to_string()).collect();
    let (mut written, mut refused, mut answered) = (None, 0, 0);
    for step in 0..60u64 {
        c.tick();
        let new = leading_among(&c, &others, &sessions());
        if written.is_none()
            && let Some(new) = new.cloned()
        {
            let w = client(&mut c, &new, 10 + step);
            if ask(&mut c, &new, w, put("k", "v2", None, 3)) == Message::CacheOk(message::CacheOk { request_id: 3 }) {
                written = Some(step);
            }
        }
        match ask(&mut c, &old, cl, get("k", 100 + step)) {
            Message::CacheValue(v) => {
                answered += 1;
                assert!(written.is_none(), "a stale read at step {step}, after {new:?} took v2: {v:?}");
            }
            Message::Error(e) => {
                refused += 1;
                assert!(e.retry == Some(felix_proto::RetryClass::Retry), "{e:?}");
            }
            other => panic!("{other:?}"),
        }
    }
    assert!(written.is_some(), "the other two elected a leader that took v2");
    assert!(refused > 0, "the cut-off leader refused reads");
    eprintln!(
        "cut-off cache leader: {answered} reads answered inside its lease, then {refused} refused; v2 written at tick {written:?}"
    );
}

#[test]
fn a_replicated_cache_fails_over_with_its_values_versions_counters_and_watch_offsets() {
    use felix_proto::message::CacheCondition;
    use quorum_cache::*;
    let mut c = Cluster::with(&NAMES, true);
    // Named in the configuration too (a configured cache starts its versions after a wall-clock
    // seed of its own broker's; replicated, they are the group's offsets everywhere).
    configure_sessions(&mut c, false, 3);
    create_sessions(&mut c);
    let first = cache_leader(&c).unwrap();
    let cl = client(&mut c, &first, 1);
    // A watch on the leader sees every change, at the offsets the group gives them.
    let w = ask(&mut c, &first, cl, watch(None));
    let Message::CacheWatchStarted(started) = w else { panic!("{w:?}") };
    assert_eq!(
        ask(&mut c, &first, cl, put("alice", "a1", None, 2)),
        Message::CacheOk(message::CacheOk { request_id: 2 })
    );
    let Message::CacheConditionResult(r) = ask(&mut c, &first, cl, put_if("bob", "b1", CacheCondition::Absent, 3))
    else {
        panic!()
    };
    assert!(r.applied);
    let bob_v1 = r.version.unwrap();
    // A second "absent" put of bob fails on every replica alike, with bob's version.
    let Message::CacheConditionResult(r) = ask(&mut c, &first, cl, put_if("bob", "b2", CacheCondition::Absent, 4))
    else {
        panic!()
    };
    assert_eq!((r.applied, r.version), (false, Some(bob_v1)));
    let Message::CacheConditionResult(r) =
        ask(&mut c, &first, cl, put_if("bob", "b2", CacheCondition::Version(bob_v1), 5))
    else {
        panic!()
    };
    assert!(r.applied && r.version > Some(bob_v1));
    let bob_v2 = r.version.unwrap();
    for (i, d) in [3i64, 4].iter().enumerate() {
        let m = ask(&mut c, &first, cl, add(*d, 10 + i as u64));
        assert!(matches!(m, Message::CounterValue(ref v) if v.value == Some(if i == 0 { 3 } else { 7 })), "{m:?}");
    }
    // A short-lived key: written, then deleted by the leader's expiry pass (an entry of the log).
    assert_eq!(
        ask(&mut c, &first, cl, put("eve", "e1", Some(500), 6)),
        Message::CacheOk(message::CacheOk { request_id: 6 })
    );
    for _ in 0..25 {
        c.tick();
    }
    assert_eq!(read(&mut c, &first, "eve", 20), None, "expired");
    let (seen, _) = events(&mut c, &first, cl.0);
    let changes: Vec<(String, bool)> = seen.iter().map(|e| (e.key.clone(), e.value.is_some())).collect();
    assert_eq!(
        changes,
        [
            ("alice".into(), true),
            ("bob".into(), true),
            ("bob".into(), true),
            ("eve".into(), true),
            ("eve".into(), false)
        ],
        "every change once, the expiry as a delete"
    );
    assert!(seen.windows(2).all(|w| w[0].offset < w[1].offset));
    assert!(seen[0].offset >= started.resume_offset);
    assert_eq!(seen[2].offset, bob_v2, "an event's offset is the version written");
    // Every replica holds the same cache: a follower forwards to the leader, and the group's
    // state is one.
    for n in NAMES {
        assert_eq!(read(&mut c, n, "bob", 30), Some(("b2".into(), Some(bob_v2))), "{n}");
    }
    // The leader dies. Its watch ended (it is gone); a follower takes over with every value,
    // version and counter, and a watch resuming after the last event seen misses nothing and
    // repeats nothing.
    c.nodes.remove(&first);
    c.until("another replica leads the cache", |c| cache_leader(c).is_some());
    let second = cache_leader(&c).unwrap();
    assert_ne!(second, first);
    assert_eq!(read(&mut c, &second, "alice", 40), Some(("a1".into(), Some(seen[0].offset))));
    assert_eq!(read(&mut c, &second, "bob", 41), Some(("b2".into(), Some(bob_v2))));
    assert_eq!(read(&mut c, &second, "eve", 42), None);
    let cl2 = client(&mut c, &second, 43);
    let m = ask(
        &mut c,
        &second,
        cl2,
        json(&Message::CounterGet(message::CounterGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: "logins".into(),
            request_id: 44,
        })),
    );
    assert_eq!(m, Message::CounterValue(message::CounterValue { value: Some(7), request_id: 44 }));
    let last = seen.last().unwrap().offset;
    let w = ask(&mut c, &second, cl2, watch(Some(last + 1)));
    assert!(matches!(w, Message::CacheWatchStarted(ref s) if !s.resnapshot), "{w:?}");
    assert_eq!(
        ask(&mut c, &second, cl2, put("carol", "c1", None, 45)),
        Message::CacheOk(message::CacheOk { request_id: 45 })
    );
    let (after, _) = events(&mut c, &second, cl2.0);
    assert_eq!(after.iter().map(|e| e.key.as_str()).collect::<Vec<_>>(), ["carol"], "no gap, no repeat");
    assert!(after[0].offset > last);
    // The old leader comes back from its kept logs and serves the same cache once it leads.
    restart(&mut c, &first);
    c.until("the old leader caught up", |c| {
        c.nodes[&first].replica_report().iter().any(|r| r.shard == sessions() && r.committed_index > 0)
    });
    for _ in 0..10 {
        c.tick();
    }
    // Its leader dies too: the restarted replica and the third lead on with everything.
    c.nodes.remove(&second);
    c.until("a replica leads again", |c| cache_leader(c).is_some());
    let third = cache_leader(&c).unwrap();
    for (k, v) in [("alice", "a1"), ("bob", "b2"), ("carol", "c1")] {
        assert_eq!(read(&mut c, &third, k, 50).map(|x| x.0), Some(v.to_owned()), "{k} on {third}");
    }
    // A leader deposed (its group says another leads) ends its watches after what they were
    // sent, with shard_moved naming the new leader and where to resume: the next offset.
    let cl3 = client(&mut c, &third, 60);
    let w = ask(&mut c, &third, cl3, watch(None));
    let Message::CacheWatchStarted(st3) = w else { panic!("{w:?}") };
    let other = NAMES.iter().find(|n| **n != third && c.nodes.contains_key(**n)).unwrap().to_string();
    let hint = felix_proto::binary::OwnerHint { node_id: other.clone(), addr: None, generation: 9 };
    let now = c.now;
    let role = felix_proto::broker::ReplicaRole::Following { leader: Some(hint) };
    c.nodes.get_mut(&third).unwrap().broker_mut().set_replica_role(&sessions(), role, now);
    c.settle();
    let (_, moved) = events(&mut c, &third, cl3.0);
    let moved = moved.expect("shard_moved to a client that offered it");
    assert_eq!(moved.node_id.as_deref(), Some(other.as_str()));
    assert_eq!(moved.resume_from, Some(st3.resume_offset));
    // It now sends writes to the leader it was told of (which, leading in fact, says it is
    // `third`: the client is told to go there).
    let m = ask(&mut c, &third, cl3, put("dave", "d1", None, 61));
    assert!(matches!(&m, Message::Error(e) if e.code.as_ref().is_some_and(|c| c.name() == "not_leader")), "{m:?}");
}

/// The replicated cache `sessions` with a follower down: 200 writes of `value(i)` over `keys`
/// keys (the log grows, the cache does not) and a counter at 5, until the leader compacted.
/// Returns the cluster, the leader and the follower that is down.
fn a_cache_compacted_with_a_follower_down(keys: u64, value: impl Fn(u64) -> String) -> (Cluster, String, String) {
    use quorum_cache::*;
    let mut c = Cluster::retaining(&NAMES, 30);
    create_sessions(&mut c);
    let leader = cache_leader(&c).unwrap();
    let behind = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    c.nodes.remove(&behind);
    let cl = client(&mut c, &leader, 1);
    for i in 0..200u64 {
        let m = ask(&mut c, &leader, cl, put(&format!("k{}", i % keys), &value(i), None, i + 1));
        assert_eq!(m, Message::CacheOk(message::CacheOk { request_id: i + 1 }));
    }
    let _ = ask(&mut c, &leader, cl, add(5, 1000));
    for _ in 0..3 {
        c.tick();
    }
    let report = c.nodes[&leader].replica_report();
    let r = report.iter().find(|r| r.shard == sessions()).unwrap();
    assert!(r.first_index > 150, "compacted to a checkpoint: the log starts at {} of {}", r.first_index, r.last_index);
    (c, leader, behind)
}

/// The follower down comes back behind the leader's compaction: it is sent a snapshot holding
/// the cache's values, and installs it.
fn a_follower_behind_a_cache_catches_up_from_its_snapshot(c: &mut Cluster, leader: &str, behind: &str) {
    restart(c, behind);
    c.until("the follower caught up", |c| {
        let lead = c.nodes[leader].replica_report();
        let l = lead.iter().find(|r| r.shard == sessions()).unwrap().last_index;
        c.nodes[behind].replica_report().iter().any(|r| r.shard == sessions() && r.committed_index >= l)
    });
    assert!(c.kept_replicas[behind][&sessions()].snapshot.is_some(), "it installed a snapshot");
}

#[test]
fn a_replicated_caches_log_is_compacted_into_snapshots_of_its_values_and_a_follower_catches_up_from_one() {
    use quorum_cache::*;
    let (mut c, leader, behind) = a_cache_compacted_with_a_follower_down(20, |i| format!("v{i}"));
    a_follower_behind_a_cache_catches_up_from_its_snapshot(&mut c, &leader, &behind);
    // It takes over (the leader dies): every key's last value, and the counter.
    c.nodes.remove(&leader);
    c.until("a replica leads the cache", |c| cache_leader(c).is_some());
    let now_leader = cache_leader(&c).unwrap();
    for k in 0..20u64 {
        assert_eq!(read(&mut c, &now_leader, &format!("k{k}"), 100 + k).map(|x| x.0), Some(format!("v{}", 180 + k)));
    }
    // Everyone restarted from compacted logs: the same values again.
    for n in NAMES {
        if c.nodes.contains_key(n) {
            restart(&mut c, n);
        }
    }
    restart(&mut c, &leader);
    c.until("a replica leads the cache", |c| cache_leader(c).is_some());
    let l = cache_leader(&c).unwrap();
    assert_eq!(read(&mut c, &l, "k7", 200).map(|x| x.0), Some("v187".to_owned()));
    let cl = client(&mut c, &l, 201);
    let m = ask(&mut c, &l, cl, add(1, 202));
    assert_eq!(m, Message::CounterValue(message::CounterValue { value: Some(6), request_id: 202 }));
}

/// A replicated cache's values go into its snapshots from where they are, never encoded
/// whole (issue 32): with 40 KiB of values (1 KiB each, rewritten five times over), every
/// snapshot a compaction persists hands over a few bytes encoded and the values beside them,
/// written piece by piece (the harness checks the record is byte for byte the whole data's,
/// and reads it back). A follower behind is sent the snapshot, and, leading, reads every
/// key's last value and the counter. The follower reads the cache it installed back from the
/// copy it wrote to disk, in pieces of 1,000 bytes (cut through its values).
#[test]
fn a_replicated_caches_values_go_into_its_snapshots_from_where_they_are() {
    use quorum_cache::*;
    let value = |i: u64| format!("{i:>1024}");
    let (mut c, leader, behind) = a_cache_compacted_with_a_follower_down(40, value);
    assert!(c.snapshots_with_rest > 0, "the values written beside the snapshot, piece by piece");
    let encoded = c.largest_encoded_snapshot;
    assert!(encoded < 16 << 10, "a snapshot handed over {encoded} bytes encoded: the 40 KiB of values");
    c.restore_in_pieces = Some((16 << 10, 1000));
    a_follower_behind_a_cache_catches_up_from_its_snapshot(&mut c, &leader, &behind);
    let counts = c.nodes[&behind].restore_counts();
    assert_eq!((counts.started, counts.finished), (1, 1), "read back from disk: {counts:?}");
    assert!(counts.pieces >= 40, "{counts:?}");
    c.nodes.remove(&leader);
    c.until("a replica leads the cache", |c| cache_leader(c).is_some());
    let now_leader = cache_leader(&c).unwrap();
    for k in 0..40u64 {
        assert_eq!(read(&mut c, &now_leader, &format!("k{k}"), 100 + k).map(|x| x.0), Some(value(160 + k)));
    }
    let cl = client(&mut c, &now_leader, 201);
    let m = ask(&mut c, &now_leader, cl, add(1, 202));
    assert_eq!(m, Message::CounterValue(message::CounterValue { value: Some(6), request_id: 202 }));
}
