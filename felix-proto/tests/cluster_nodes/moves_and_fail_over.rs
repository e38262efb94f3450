//! Commit state across a fail-over, fencing, moves of durable, replicated and cached shards with
//! their subscribers and watches, forwarded cache writes, damaged replica logs.

use super::*;

#[test]
fn a_commit_on_a_replicated_stream_keeps_its_event_and_state_together_across_a_fail_over() {
    use felix_proto::features::Features;
    use felix_proto::message::{B64, StateChange};
    let mut c = Cluster::with(&NAMES, true);
    create_ledger(&mut c);
    c.until("the metadata names the ledger's leader", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let first = leading(&c).unwrap();
    let f = Features::ATOMIC_COMMIT | Features::PUBLISH_CONDITIONAL | Features::ERROR_CODES;
    let open = |c: &mut Cluster, node: &str, index: u64| client_offering(c, node, index, f);
    let commit = |event: &str, changes: Vec<StateChange>, rid: u64, expected: Option<u64>| {
        json(&Message::Commit(message::Commit {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "ledger".into(),
            entity_key: B64(Bytes::from_static(b"account-1")),
            event: B64(Bytes::copy_from_slice(event.as_bytes())),
            changes,
            shard: None,
            request_id: rid,
            expected_offset: expected,
        }))
    };
    let get = |key: &str, rid: u64| {
        json(&Message::StateGet(message::StateGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "ledger".into(),
            entity_key: B64(Bytes::from_static(b"account-1")),
            key: key.into(),
            shard: None,
            request_id: rid,
        }))
    };
    let put = |k: &str, v: &str| StateChange::Put { key: k.into(), value: B64(Bytes::copy_from_slice(v.as_bytes())) };
    let (conn, st) = open(&mut c, &first, 1);
    c.send(&first, conn, st, commit("opened", vec![put("balance", "10"), put("owner", "ann")], 1, None));
    let got = messages(&c.take(&first, conn, st));
    let [Message::CommitOk(ok)] = &got[..] else { panic!("{got:?}") };
    let opened_at = ok.offset;
    c.send(&first, conn, st, commit("deposit", vec![put("balance", "25")], 2, Some(opened_at + 1)));
    let got = messages(&c.take(&first, conn, st));
    let [Message::CommitOk(ok)] = &got[..] else { panic!("{got:?}") };
    let deposit_at = ok.offset;
    assert_eq!(deposit_at, opened_at + 1);
    // A commit expecting a taken offset is refused, its state untouched.
    c.send(&first, conn, st, commit("late", vec![put("balance", "0")], 3, Some(opened_at)));
    let got = messages(&c.take(&first, conn, st));
    assert!(matches!(&got[..], [Message::PublishRefused(_)] | [Message::Error(_)]), "{got:?}");
    c.send(&first, conn, st, get("balance", 4));
    assert_eq!(
        messages(&c.take(&first, conn, st)),
        [Message::StateValue(message::StateValue {
            value: Some(B64(Bytes::from_static(b"25"))),
            version: Some(deposit_at),
            as_of: Some(deposit_at),
            request_id: 4
        })]
    );
    // The leader dies: the new one has the events and the state they wrote, at the same offsets.
    c.settle();
    c.nodes.remove(&first);
    c.until("a follower leads", |c| leading(c).is_some());
    let second = leading(&c).unwrap();
    let (conn, st) = open(&mut c, &second, 2);
    for (key, want, at) in [("balance", "25", deposit_at), ("owner", "ann", opened_at)] {
        c.send(&second, conn, st, get(key, 5));
        let got = messages(&c.take(&second, conn, st));
        let [Message::StateValue(v)] = &got[..] else { panic!("{got:?}") };
        assert_eq!(v.value.as_ref().map(|b| b.0.as_ref()), Some(want.as_bytes()), "{key}");
        assert_eq!(v.version, Some(at), "{key}");
    }
    let (records, _) = history(&c, &second);
    let events: Vec<&[u8]> = records.iter().map(|(_, p)| p.as_ref()).collect();
    assert_eq!(events, [&b"opened"[..], b"deposit"], "every committed event once, the refused one absent");
    // And a restarted replica rebuilds the state from its log.
    restart(&mut c, &first);
    c.until("the old leader caught up", |c| history(c, &first).0 == history(c, &second).0);
    c.nodes.remove(&second);
    c.until("a replica leads again", |c| leading(c).is_some());
    let third = leading(&c).unwrap();
    let (conn, st) = open(&mut c, &third, 3);
    c.send(&third, conn, st, get("balance", 6));
    let got = messages(&c.take(&third, conn, st));
    assert!(matches!(&got[..], [Message::StateValue(v)] if v.version == Some(deposit_at)), "{got:?}");
}

/// Three brokers, n3 an older version (its hello offers no peer feature, and it acts so).
pub(super) fn with_an_older_n3() -> Cluster {
    let mut c = Cluster::new(&NAMES);
    c.old_peers.insert("n3".into());
    c.hellos("n3");
    c
}

#[test]
fn shard_groups_heartbeats_are_coalesced_for_peers_that_read_them_and_whole_for_one_that_does_not() {
    // n3 says in its hello it is an older broker: it reads no coalesced heartbeats.
    let mut c = with_an_older_n3();
    create_ledger(&mut c);
    create_sessions(&mut c);
    c.sent_kinds.clear();
    for _ in 0..30 {
        c.tick();
    }
    let sent = |from: &str, to: &str, kind: &str| {
        c.sent_kinds.get(&(from.to_owned(), to.to_owned(), kind)).copied().unwrap_or(0)
    };
    let leader = leading(&c).unwrap();
    let mut coalesced = 0;
    for to in NAMES.iter().filter(|n| **n != leader) {
        if *to == "n3" {
            assert_eq!(sent(&leader, to, "heartbeats"), 0, "nothing n3 cannot read");
            assert!(sent(&leader, to, "shard_raft heartbeats") > 0, "n3 gets its heartbeats as Raft messages");
        } else {
            coalesced += sent(&leader, to, "heartbeats");
            assert_eq!(sent(&leader, to, "shard_raft heartbeats"), 0, "{leader} → {to}: every heartbeat coalesced");
        }
    }
    assert!(coalesced > 0, "{:?}", c.sent_kinds);
    // The groups are healthy on coalesced heartbeats: no election while quiet, and a write
    // commits on the followers.
    let term = c.nodes[&leader].replica_report().iter().find(|r| r.shard == ledger()).unwrap().term;
    for _ in 0..50 {
        c.tick();
    }
    assert_eq!(leading(&c), Some(leader.clone()));
    assert_eq!(c.nodes[&leader].replica_report().iter().find(|r| r.shard == ledger()).unwrap().term, term);
}

#[test]
fn a_broker_cut_off_from_the_metadata_leader_fences_itself_before_its_lease_lapses_and_serves_again_once_back() {
    use felix_proto::binary::AckStatus;
    let mut c = Cluster::new(&NAMES);
    c.create(Kind::Stream, "orders", 3, 0);
    // A broker that owns a shard and does not lead the metadata group.
    let meta_leader = c.nodes["n1"].leader().unwrap().to_owned();
    let (victim, shard) =
        (0..3).map(|s| (owner(&c, s), s)).find(|(o, _)| *o != meta_leader).expect("a shard owned by a follower");
    let key = (0..1000)
        .map(|k| format!("k{k}"))
        .find(|k| felix_proto::routing::shard_for_key(Some(k.as_bytes()), 3, message::Routing::Modulo) == shard)
        .unwrap();
    let flags = 0x0001 | 0x0008 | 0x0040 | 0x0200 | 0x0400;
    let (conn, st) = c.client(&victim, flags, 1);
    c.send(&victim, conn, st, publish_binary("orders", &["before"], Some(1), Some(&key)));
    let a = acks(&payloads(&c.take(&victim, conn, st)));
    assert!(a.len() == 1 && a[0].status == AckStatus::Ok, "{a:?}");
    // Cut off: within FENCE_AFTER (before the leader's LEASE could give its shards away) it
    // stops serving them, with a reason a client can act on.
    c.cut.insert(victim.clone());
    let mut ticks = 0;
    while !c.nodes[&victim].broker().is_fenced() {
        c.tick();
        ticks += 1;
        assert!(ticks < 30, "fenced within 3 s");
    }
    assert!(felix_proto::cluster::node::TICK * ticks < felix_proto::cluster::node::LEASE, "{ticks} ticks");
    c.send(&victim, conn, st, publish_binary("orders", &["while cut"], Some(2), Some(&key)));
    let a = acks(&payloads(&c.take(&victim, conn, st)));
    assert!(a.len() == 1 && a[0].status != AckStatus::Ok, "{a:?}");
    assert_eq!(a[0].detail.as_ref().and_then(|d| d.reason.as_deref()), Some("fenced"), "{a:?}");
    // Back in contact: it serves its durable shard again (it kept it: its records are there).
    c.cut.clear();
    c.until("no longer fenced", |c| !c.nodes[&victim].broker().is_fenced());
    c.until("every broker is active again", |c| {
        c.nodes.values().all(|n| n.metadata().members().values().all(|m| m.state == MemberState::Active))
    });
    c.send(&victim, conn, st, publish_binary("orders", &["after"], Some(3), Some(&key)));
    let a = acks(&payloads(&c.take(&victim, conn, st)));
    assert!(a.len() == 1 && a[0].status == AckStatus::Ok, "{a:?}");
}

/// A key that routes to `shard` of a stream with `shards` shards.
pub(super) fn key_for(shard: u32, shards: u32) -> String {
    (0..10_000)
        .map(|k| format!("k{k}"))
        .find(|k| felix_proto::routing::shard_for_key(Some(k.as_bytes()), shards, message::Routing::Modulo) == shard)
        .unwrap()
}

fn subscribe_shard(shard: u32, from: u64) -> Bytes {
    subscribe_shard_of("orders", shard, from)
}

pub(super) fn subscribe_shard_of(stream: &str, shard: u32, from: u64) -> Bytes {
    json(&Message::Subscribe(message::Subscribe {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        subscription_id: None,
        start: Some(StartPosition::Offset(from)),
        shard: Some(shard),
        queue_capacity: None,
        filter: None,
    }))
}

#[test]
fn a_durable_shard_moves_with_its_records_under_load_and_a_subscriber_follows_it_with_no_gap_and_no_duplicate() {
    let mut c = Cluster::new(&NAMES);
    c.create(Kind::Stream, "orders", 3, 0);
    let from = owner(&c, 0);
    let to = NAMES.iter().find(|n| **n != from).unwrap().to_string();
    let before = c.nodes["n1"].metadata().owner(&orders_shard(0)).unwrap().clone();
    let key = key_for(0, 3);
    // Publishes through the old owner all along: binary, keyed, acked with codes, details and
    // offsets.
    let pub_flags = 0x0001 | 0x0008 | 0x0040 | 0x0200 | 0x0400 | 0x1000;
    let (pc, ps) = c.client(&from, pub_flags, 1);
    let mut acked: Vec<String> = Vec::new();
    let mut next = 0u64;
    let publish = |c: &mut Cluster, acked: &mut Vec<String>, next: &mut u64| -> Option<String> {
        let payload = format!("r{next}");
        c.send(&from, pc, ps, publish_binary("orders", &[&payload], Some(*next + 1), Some(&key)));
        let a = acks(&payloads(&c.take(&from, pc, ps)));
        assert_eq!(a.len(), 1, "answered at once: {a:?}");
        if a[0].status == AckStatus::Ok {
            acked.push(payload);
            *next += 1;
            None
        } else {
            Some(a[0].detail.as_ref().and_then(|d| d.reason.clone()).unwrap_or_else(|| a[0].message.clone()))
        }
    };
    for _ in 0..20 {
        assert_eq!(publish(&mut c, &mut acked, &mut next), None);
    }
    // A subscriber on the old owner from the start; it reads `shard_moved`.
    let sub_flags = 0x0001 | 0x0020 | 0x0800;
    let (sc, ss) = c.client_with(&from, sub_flags, 0x1000, 2);
    c.send(&from, sc, ss, subscribe_shard(0, 0));
    assert!(matches!(messages(&c.take(&from, sc, ss))[0], Message::Subscribed(_)));
    // The operator moves the shard; writes go on meanwhile, one per tick.
    let now = c.now;
    c.nodes.get_mut(&from).unwrap().propose(&Command::MoveShard { shard: orders_shard(0), to: to.clone() }, now);
    let mut refusals = 0;
    let mut phases = std::collections::BTreeSet::new();
    for _ in 0..200 {
        let md = c.nodes["n1"].metadata();
        if let Some(m) = md.moving(&orders_shard(0)) {
            phases.insert(format!("{:?}", m.phase).split(' ').next().unwrap().to_owned());
        } else if md.owner(&orders_shard(0)).is_some_and(|a| a.owner == to) {
            break;
        }
        if let Some(why) = publish(&mut c, &mut acked, &mut next) {
            assert_eq!(why, "moving", "a write in the cut-over is refused moving (retry)");
            refusals += 1;
        }
        c.tick();
    }
    let after = c.nodes["n1"].metadata().owner(&orders_shard(0)).unwrap().clone();
    assert_eq!(after.owner, to, "moved: {phases:?}");
    assert!(after.generation > before.generation);
    eprintln!(
        "{} records acked, {refusals} writes refused `moving` during the cut-over; phases seen {phases:?}",
        acked.len()
    );
    assert!(refusals <= 5, "the cut-over is short: {refusals} refusals");
    // Writes through the old owner go on, forwarded to the new one.
    for _ in 0..5 {
        assert_eq!(publish(&mut c, &mut acked, &mut next), None);
    }
    // The old owner's subscriber got everything it committed, then `shard_moved`.
    let (seen, moved) = c.stream_events(&from, sc);
    let moved = moved.expect("shard_moved");
    assert_eq!(moved.node_id.as_deref(), Some(to.as_str()));
    assert_eq!(moved.generation, after.generation);
    let resume_from = moved.resume_from.expect("a durable shard names where to resume");
    assert_eq!(seen.iter().map(|(o, _)| *o).collect::<Vec<_>>(), (0..resume_from).collect::<Vec<_>>());
    // It resumes on the new owner at max(last + 1, resume_from): the rest, once, in order.
    let last = seen.last().map(|(o, _)| *o);
    let resume = last.map_or(resume_from, |l| (l + 1).max(resume_from));
    let (tc, ts) = c.client_with(&to, sub_flags, 0x1000, 3);
    c.send(&to, tc, ts, subscribe_shard(0, resume));
    assert!(matches!(messages(&c.take(&to, tc, ts))[0], Message::Subscribed(_)));
    let (rest, none) = c.stream_events(&to, tc);
    assert!(none.is_none());
    let got: Vec<String> = seen.iter().chain(&rest).map(|(_, p)| p.clone()).collect();
    assert_eq!(got, acked, "every acknowledged record once, in order");
    // The new owner's log below the cut-over is the old owner's, offset for offset; its own
    // generation starts at the cut-over tail.
    let old: Vec<_> = c.nodes[&from].broker().committed_batches(&orders_shard(0), 0);
    let new: Vec<_> = c.nodes[&to].broker().committed_batches(&orders_shard(0), 0);
    let below = |v: &Vec<(u64, bool, Vec<Bytes>)>| v.iter().filter(|b| b.0 < resume_from).cloned().collect::<Vec<_>>();
    assert_eq!(below(&new), below(&old));
    assert!(new.iter().any(|(base, gen_start, _)| *base == resume_from && *gen_start), "{new:?}");
    // The old owner holds no reader and takes no write of it any more.
    assert!(c.nodes[&from].broker().move_progress().is_empty() && c.nodes[&to].broker().move_progress().is_empty());
}

/// A single-replica shard whose retention deleted the commits that wrote its state moves
/// with that state (the first copy answer carries it, and the new owner keeps it on disk),
/// but not to an older broker, which could not take it: that copy is refused, and the old
/// owner goes on serving the shard and its state.
#[test]
fn a_compacted_shard_holding_commit_state_moves_with_its_state_but_never_to_a_broker_that_cannot_take_it() {
    use felix_proto::cluster::peer::{FEATURE_COMMIT_STATE, PEER_FEATURES};
    use felix_proto::features::Features;
    for new_owner_takes_state in [true, false] {
        let mut c = Cluster::retaining(&NAMES, 3);
        c.create(Kind::Stream, "accounts", 1, 0);
        let shard = ShardId { name: "accounts".into(), ..orders_shard(0) };
        let from = c.nodes["n1"].metadata().owner(&shard).unwrap().owner.clone();
        let to = NAMES.iter().find(|n| **n != from).unwrap().to_string();
        if !new_owner_takes_state {
            c.features.insert(to.clone(), PEER_FEATURES & !FEATURE_COMMIT_STATE);
            c.hellos(&to);
        }
        let f = Features::ATOMIC_COMMIT | Features::ERROR_CODES;
        let open = |c: &mut Cluster, node: &str, index: u64| client_offering(c, node, index, f);
        let (conn, st) = open(&mut c, &from, 1);
        for i in 0..10u64 {
            let value = Bytes::from(i.to_string());
            let m = commit_put("accounts", format!("k{i}"), value, i);
            c.send(&from, conn, st, m);
            let got = messages(&c.take(&from, conn, st));
            assert!(matches!(&got[..], [Message::CommitOk(ok)] if ok.offset == i), "{got:?}");
        }
        c.until("retention compacts the shard, its state checkpointed", |c| {
            c.state_checkpoints.iter().any(|(n, s, start)| *n == from && s == "accounts" && *start > 0)
        });
        let now = c.now;
        c.nodes.get_mut(&from).unwrap().propose(&Command::MoveShard { shard: shard.clone(), to: to.clone() }, now);
        let get = |key: &str, rid: u64| state_get("accounts", key, rid);
        let serving = if new_owner_takes_state {
            c.until("the shard moved", |c| c.nodes["n1"].metadata().owner(&shard).is_some_and(|o| o.owner == to));
            assert!(
                c.state_checkpoints.iter().any(|(n, s, _)| *n == to && s == "accounts"),
                "the new owner keeps the state on disk: {:?}",
                c.state_checkpoints
            );
            to.clone()
        } else {
            for _ in 0..100 {
                c.tick();
            }
            assert_eq!(c.nodes["n1"].metadata().owner(&shard).unwrap().owner, from, "the shard stays home");
            assert!(c.state_checkpoints.iter().all(|(n, ..)| *n != to), "{:?}", c.state_checkpoints);
            from.clone()
        };
        let (conn, st) = open(&mut c, &serving, 7);
        c.send(&serving, conn, st, get("k0", 20));
        c.send(&serving, conn, st, get("k9", 21));
        let got = messages(&c.take(&serving, conn, st));
        let values = state_values(&got);
        assert_eq!(
            values,
            vec![(Some(Bytes::from_static(b"0")), Some(0)), (Some(Bytes::from_static(b"9")), Some(9))],
            "served by {serving} (new owner takes state: {new_owner_takes_state})"
        );
    }
}

/// A client on `node` whose hello offers `features` (and flag 0x0001), authenticated.
pub(super) fn client_offering(
    c: &mut Cluster,
    node: &str,
    index: u64,
    features: felix_proto::features::Features,
) -> (ConnId, StreamId) {
    let (lo, hi) = features.to_words(true);
    let n = c.nodes.get_mut(node).unwrap();
    let conn = n.inputs().admit(PeerAddr([index as u8; 16]), c.now).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, index);
    n.inputs().handle_stream_data(conn, st, auth(Some(1), lo, hi), false, c.now);
    c.settle();
    let hello = messages(&c.take(node, conn, st));
    assert!(matches!(&hello[..], [Message::AuthOk(_)]), "{hello:?}");
    (conn, st)
}

/// The value and version of each answer, which must all be `state_value`s.
pub(super) fn state_values(answers: &[Message]) -> Vec<(Option<Bytes>, Option<u64>)> {
    answers
        .iter()
        .map(|m| match m {
            Message::StateValue(v) => (v.value.as_ref().map(|b| b.0.clone()), v.version),
            other => panic!("{other:?}"),
        })
        .collect()
}

/// The ledger's compacted group fails over to followers that hold no entry below the
/// compaction: `behind` (which was away) is restarted and sent a snapshot, the other follower is
/// restarted from its own, then `leader` dies. Returns the follower that leads then.
pub(super) fn fail_over_to_snapshots(c: &mut Cluster, leader: &str, behind: &str) -> String {
    restart(c, behind);
    c.until("the follower caught up", |c| history(c, behind).0 == history(c, leader).0);
    assert!(c.kept_replicas[behind][&ledger()].snapshot.is_some(), "it installed a snapshot");
    let other = NAMES.iter().find(|n| **n != leader && **n != behind).unwrap().to_string();
    restart(c, &other);
    c.nodes.remove(leader);
    c.until("a follower leads", |c| leading(c).is_some());
    leading(c).unwrap()
}

pub(super) fn orders_shard(shard: u32) -> ShardId {
    ShardId { kind: Kind::Stream, tenant: "t1".into(), namespace: "default".into(), name: "orders".into(), shard }
}

#[test]
fn a_legacy_subscriber_of_a_moved_shard_sees_its_stream_end_cleanly_and_can_subscribe_again() {
    let mut c = Cluster::new(&NAMES);
    c.create(Kind::Stream, "orders", 3, 0);
    let from = owner(&c, 0);
    let to = NAMES.iter().find(|n| **n != from).unwrap().to_string();
    let key = key_for(0, 3);
    let (pc, ps) = c.client(&from, 0x0001 | 0x0008 | 0x0040 | 0x1000, 1);
    for k in 0..5u64 {
        c.send(&from, pc, ps, publish_binary("orders", &[&format!("r{k}")], Some(k + 1), Some(&key)));
    }
    assert!(acks(&payloads(&c.take(&from, pc, ps))).iter().all(|a| a.status == AckStatus::Ok));
    // A client that offered no SHARD_MOVED (no features at all), with offsets.
    let (sc, ss) = c.client(&from, 0x0001 | 0x0020, 2);
    c.send(&from, sc, ss, subscribe_shard(0, 0));
    assert!(matches!(messages(&c.take(&from, sc, ss))[0], Message::Subscribed(_)));
    let now = c.now;
    c.nodes.get_mut(&from).unwrap().propose(&Command::MoveShard { shard: orders_shard(0), to: to.clone() }, now);
    c.until("moved", |c| c.nodes.values().all(|n| n.metadata().owner(&orders_shard(0)).is_some_and(|a| a.owner == to)));
    // Its event stream carried the records, then simply ended: no frame it cannot read.
    let keys: Vec<_> =
        c.received.keys().filter(|(n, cn, s)| *n == from && *cn == sc && s.dir() == Dir::Uni).cloned().collect();
    assert_eq!(keys.len(), 1);
    let bytes = c.received.get(&keys[0]).cloned().unwrap();
    let ps = payloads(&bytes);
    assert!(
        ps.iter()
            .all(|p| !matches!(p, felix_proto::Payload::Json(felix_proto::Decoded::Message(Message::ShardMoved(_))))),
        "no shard_moved for a client that did not offer it: {ps:?}"
    );
    assert!(c.finished.contains(&(from.clone(), sc, keys[0].2)), "the event stream was finished");
    let (seen, moved) = c.stream_events(&from, sc);
    assert!(moved.is_none());
    assert_eq!(seen.iter().map(|(_, p)| p.as_str()).collect::<Vec<_>>(), ["r0", "r1", "r2", "r3", "r4"]);
    // It subscribes again where it stopped (asking the old owner first: it is told where to go).
    c.send(&from, sc, ss, subscribe_shard(0, 5));
    let answer = messages(&c.take(&from, sc, ss));
    assert!(matches!(&answer[0], Message::Error(e) if e.message.contains(to.as_str())), "{answer:?}");
    let (tc, ts) = c.client(&to, 0x0001 | 0x0020, 3);
    c.send(&to, tc, ts, subscribe_shard(0, 5));
    assert!(matches!(messages(&c.take(&to, tc, ts))[0], Message::Subscribed(_)));
    let (pc2, ps2) = c.client(&to, 0x0001 | 0x0008 | 0x0040 | 0x1000, 4);
    c.send(&to, pc2, ps2, publish_binary("orders", &["r5"], Some(9), Some(&key)));
    assert!(acks(&payloads(&c.take(&to, pc2, ps2))).iter().all(|a| a.status == AckStatus::Ok));
    let (rest, _) = c.stream_events(&to, tc);
    assert_eq!(rest.iter().map(|(_, p)| p.as_str()).collect::<Vec<_>>(), ["r5"]);
}

#[test]
fn a_cache_moves_with_its_values_versions_and_counters_and_its_watch_resumes_on_the_new_owner_with_no_gap() {
    use felix_proto::message::CacheCondition;
    use quorum_cache::*;
    let mut c = Cluster::with(&NAMES, true);
    // Kept on disk (its system log), one replica.
    configure_sessions(&mut c, true, 1);
    c.create(Kind::Cache, "sessions", 1, 1);
    c.until("the cache has an owner", |c| c.nodes.values().all(|n| n.metadata().owner(&sessions()).is_some()));
    let from = c.nodes["n1"].metadata().owner(&sessions()).unwrap().owner.clone();
    let to = NAMES.iter().find(|n| **n != from).unwrap().to_string();
    let before = c.nodes["n1"].metadata().owner(&sessions()).unwrap().generation;
    let cl = client(&mut c, &from, 1);
    let w = ask(&mut c, &from, cl, watch(None));
    assert!(matches!(w, Message::CacheWatchStarted(_)), "{w:?}");
    for i in 0..10u64 {
        let p = put(&format!("k{i}"), &format!("v{i}"), None, 10 + i);
        assert_eq!(ask(&mut c, &from, cl, p), Message::CacheOk(message::CacheOk { request_id: 10 + i }));
    }
    let (_, v3) = read(&mut c, &from, "k3", 2).unwrap();
    let v3 = v3.expect("versions offered");
    assert!(matches!(ask(&mut c, &from, cl, add(5, 30)), Message::CounterValue(v) if v.value == Some(5)));
    // The operator moves it; puts through the old owner go on, one per tick.
    let now = c.now;
    c.nodes.get_mut(&from).unwrap().propose(&Command::MoveShard { shard: sessions(), to: to.clone() }, now);
    let (mut refusals, mut puts) = (0, 0u64);
    for i in 0..200u64 {
        let md = c.nodes["n1"].metadata();
        if md.moving(&sessions()).is_none() && md.owner(&sessions()).is_some_and(|a| a.owner == to) {
            break;
        }
        match ask(&mut c, &from, cl, put("during", &format!("d{i}"), None, 100 + i)) {
            Message::CacheOk(_) => puts += 1,
            Message::Error(e) => {
                assert_eq!(e.detail.and_then(|d| d.reason).as_deref(), Some("moving"), "{}", e.message);
                refusals += 1;
            }
            other => panic!("{other:?}"),
        }
        c.tick();
    }
    let after = c.nodes["n1"].metadata().owner(&sessions()).unwrap().clone();
    assert_eq!(after.owner, to);
    assert!(after.generation > before);
    eprintln!("{puts} puts during the copy, {refusals} refused in the cut-over");
    assert!(puts > 0 && refusals <= 5, "{puts} puts during the copy, {refusals} refused in the cut-over");
    // The old owner's watch got every change, then `shard_moved` naming the new owner and the
    // tail.
    let (seen, moved) = events(&mut c, &from, cl.0);
    let moved = moved.expect("shard_moved");
    assert_eq!(moved.node_id.as_deref(), Some(to.as_str()));
    let resume_from = moved.resume_from.expect("a cache handed over with its contents names its tail");
    assert_eq!(seen.len() as u64, 10 + puts, "every change once: {seen:?}");
    assert!(seen.iter().all(|e| e.offset < resume_from));
    // The new owner has the values at their versions, and the counters.
    assert_eq!(read(&mut c, &to, "k3", 3), Some(("v3".to_owned(), Some(v3))));
    let cl2 = client(&mut c, &to, 4);
    assert!(matches!(ask(&mut c, &to, cl2, add(1, 31)), Message::CounterValue(v) if v.value == Some(6)));
    // A conditional write on the version read before the move applies: versions went on.
    let Message::CacheConditionResult(r) = ask(&mut c, &to, cl2, put_if("k3", "v3b", CacheCondition::Version(v3), 32))
    else {
        panic!()
    };
    assert!(r.applied);
    // The watch resumes at max(last + 1, resume_from) on the new owner: the next change is the
    // first one it sees, with nothing in between.
    let last = seen.last().map(|e| e.offset);
    let resume = last.map_or(resume_from, |l| (l + 1).max(resume_from));
    let w = ask(&mut c, &to, cl2, watch(Some(resume)));
    assert!(matches!(&w, Message::CacheWatchStarted(s) if !s.resnapshot), "{w:?}");
    let (rest, none) = events(&mut c, &to, cl2.0);
    assert!(none.is_none());
    // The counter add and the conditional put came after the hand-over: offsets from the tail.
    assert_eq!(rest.first().map(|e| e.offset), Some(resume_from), "{rest:?}");
    assert_eq!(rest.last().and_then(|e| e.value.as_ref()).map(|v| v.0.as_ref()), Some(&b"v3b"[..]));
    // The old owner dropped its copy: reads through it are the new owner's.
    assert_eq!(read(&mut c, &from, "k3", 5).map(|v| v.0), Some("v3b".to_owned()));
    assert!(c.nodes[&from].broker().move_progress().is_empty() && c.nodes[&to].broker().move_progress().is_empty());
}

#[test]
fn a_replicated_shard_moves_by_handing_its_leadership_to_another_replica_and_its_subscriber_follows() {
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    c.until("a replica leads and the metadata names it", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let first = leading(&c).unwrap();
    let to = NAMES.iter().find(|n| **n != first).unwrap().to_string();
    let generation = c.nodes["n1"].metadata().owner(&ledger()).unwrap().generation;
    let flags = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;
    // A subscriber on the leader from the start, offering SHARD_MOVED.
    let (sc, _) = ten_acked_then_a_subscriber(&mut c, &first, flags);
    // A move to a broker outside the group is refused (its replicas are its Raft group's).
    let refused =
        c.nodes["n1"].metadata().clone().apply(&Command::MoveShard { shard: ledger(), to: "n9".into() }).unwrap_err();
    assert!(refused.to_string().contains("not an active member"), "{refused}");
    // The operator moves it to another replica: its leadership is handed over.
    let now = c.now;
    c.nodes.get_mut(&first).unwrap().propose(&Command::MoveShard { shard: ledger(), to: to.clone() }, now);
    c.until("the other replica leads, and the metadata says so", |c| {
        leading(c).as_deref() == Some(to.as_str())
            && c.nodes.values().all(|n| {
                n.metadata().owner(&ledger()).is_some_and(|a| a.owner == to) && n.metadata().moving(&ledger()).is_none()
            })
    });
    assert!(c.nodes["n1"].metadata().owner(&ledger()).unwrap().generation > generation);
    // The old leader's subscriber got every record, then `shard_moved` naming the new leader.
    let (seen, moved) = c.stream_events(&first, sc);
    let moved = moved.expect("shard_moved");
    let resume_from = moved.resume_from.expect("a replicated stream names where to resume");
    assert_eq!(
        seen.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
        (0..10).map(|k| format!("a{k}")).collect::<Vec<_>>()
    );
    // It resumes on the new leader with nothing missed; writes go on there.
    let (conn, st) = c.client(&to, flags, 3);
    for k in 0..5u64 {
        c.send(&to, conn, st, publish_binary("ledger", &[&format!("b{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(&to, conn, st)));
    assert!(a.len() == 5 && a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
    let last = seen.last().map(|(o, _)| *o).unwrap();
    let (tc, ts) = c.client_with(&to, MOVED_SUB_FLAGS, 0x1000, 4);
    c.send(&to, tc, ts, subscribe_shard_of("ledger", 0, (last + 1).max(resume_from)));
    assert!(matches!(messages(&c.take(&to, tc, ts))[0], Message::Subscribed(_)));
    c.settle();
    let (rest, _) = c.stream_events(&to, tc);
    assert_eq!(
        rest.iter().map(|(_, p)| p.clone()).collect::<Vec<_>>(),
        (0..5).map(|k| format!("b{k}")).collect::<Vec<_>>()
    );
    // Every replica holds one history.
    for n in NAMES {
        assert_eq!(history(&c, n).0, history(&c, &to).0, "{n}");
    }
}

#[test]
fn a_draining_broker_hands_the_leadership_of_its_replicated_shards_to_another_replica() {
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    c.until("a replica leads and the metadata names it", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let first = leading(&c).unwrap();
    let now = c.now;
    c.nodes.get_mut(&first).unwrap().propose(&Command::Drain { id: first.clone() }, now);
    c.until("another replica leads, and the metadata says so", |c| {
        leading(c).is_some_and(|l| l != first)
            && c.nodes.values().all(|n| {
                n.metadata().owner(&ledger()).is_some_and(|a| a.owner != first) && n.metadata().moves().is_empty()
            })
    });
}

#[test]
fn a_replicated_shard_moves_to_a_broker_outside_its_group_which_takes_the_leaders_place() {
    let four = ["n1", "n2", "n3", "n4"];
    let mut c = Cluster::new(&four);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 4));
    create_ledger(&mut c);
    c.until("a replica leads and the metadata names it", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let first = leading(&c).unwrap();
    let group = c.nodes["n1"].metadata().replicas(&ledger()).unwrap().to_vec();
    let outside = four.iter().find(|n| !group.iter().any(|g| g == *n)).unwrap().to_string();
    let flags = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;
    let (sc, _) = ten_acked_then_a_subscriber(&mut c, &first, flags);
    // The operator moves it to the broker outside the group: it joins, catches up, takes the
    // lead, and the old leader leaves.
    let now = c.now;
    c.nodes.get_mut(&first).unwrap().propose(&Command::MoveShard { shard: ledger(), to: outside.clone() }, now);
    c.until("the new broker leads the group the old leader left", |c| {
        leading(c).as_deref() == Some(outside.as_str())
            && c.nodes.values().all(|n| {
                let md = n.metadata();
                md.moving(&ledger()).is_none()
                    && md.replicas(&ledger()).is_some_and(|r| r.contains(&outside) && !r.contains(&first))
                    && md.owner(&ledger()).is_some_and(|a| a.owner == outside)
            })
    });
    // Its history is the group's, record for record; the old leader holds no replica now.
    c.settle();
    let now_group = c.nodes["n1"].metadata().replicas(&ledger()).unwrap().to_vec();
    assert_eq!(now_group.len(), 3);
    for n in &now_group {
        assert_eq!(history(&c, n).0, history(&c, &outside).0, "{n}");
    }
    assert_eq!(history(&c, &outside).0.len(), 10);
    c.until("the old leader dropped its replica", |c| {
        c.nodes[&first].replica_status().iter().all(|(s, ..)| *s != ledger())
    });
    // The old leader's subscriber got every record, then `shard_moved`; writes go on.
    let (seen, moved) = c.stream_events(&first, sc);
    assert!(moved.is_some(), "shard_moved");
    assert_eq!(seen.len(), 10);
    let (conn, st) = c.client(&outside, flags, 3);
    for k in 0..5u64 {
        c.send(&outside, conn, st, publish_binary("ledger", &[&format!("b{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(&outside, conn, st)));
    assert!(a.len() == 5 && a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
    c.settle();
    for n in &now_group {
        assert_eq!(history(&c, n).0.len(), 15, "{n}");
    }
}

/// A cache put as JSON (request id `rid`) to `sessions`.
pub(super) fn sessions_put(v: &str, rid: u64) -> Bytes {
    json(&Message::CachePut(message::CachePut {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "sessions".into(),
        key: "k".into(),
        value: message::B64::from(v),
        request_id: Some(rid),
        ttl_ms: None,
    }))
}

/// Three brokers with the `sessions` cache created, and a put already served through a broker
/// that is not its owner: the owner's name, that broker's, and its client's connection and
/// stream.
fn a_cache_served_through_another_broker(c: &mut Cluster) -> (String, String, ConnId, StreamId) {
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let (conn, st) = c.client("n1", 0x0001, 1);
    c.send("n1", conn, st, sessions_put("first", 1));
    c.until("the cache has an owner everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Cache, "t1", "default", "sessions") == Some(1))
    });
    let id = ShardId {
        kind: Kind::Cache,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "sessions".into(),
        shard: 0,
    };
    let owner = c.nodes["n1"].metadata().owner(&id).unwrap().owner.clone();
    let via = NAMES.iter().find(|n| **n != owner).unwrap().to_string();
    let (conn, st) = c.client(&via, 0x0001, 2);
    c.send(&via, conn, st, sessions_put("second", 2));
    assert_eq!(messages(&c.take(&via, conn, st)), [Message::CacheOk(message::CacheOk { request_id: 2 })], "served");
    (owner, via, conn, st)
}

/// A cache write forwarded to the cache's owner, which dies with it in flight (SIGKILL: no
/// answer ever comes), is answered as soon as the metadata declares the owner down, outcome
/// unknown, well inside the forward timeout it used to wait out (cluster time).
#[test]
fn a_cache_write_forwarded_to_an_owner_that_dies_is_answered_once_it_is_declared_down() {
    use felix_proto::broker::FORWARD_TIMEOUT;
    let mut c = Cluster::with(&NAMES, true);
    let (owner, via, conn, st) = a_cache_served_through_another_broker(&mut c);
    // The owner dies; the next put is forwarded to it and never answered by it.
    c.nodes.remove(&owner);
    let sent = c.now;
    c.send(&via, conn, st, sessions_put("third", 3));
    c.until("the forwarded put is answered", |c| {
        c.received.get(&(via.clone(), conn, st)).is_some_and(|b| !b.is_empty())
    });
    let waited = c.now - sent;
    let got = messages(&c.take(&via, conn, st));
    assert!(
        matches!(&got[..], [Message::Error(e)] if e.message.contains("went down")),
        "outcome unknown once the owner is declared down: {got:?}"
    );
    assert!(waited < FORWARD_TIMEOUT, "answered after {waited:?}, inside the {FORWARD_TIMEOUT:?} forward timeout");
    eprintln!("answered {waited:?} after the owner died (cluster time)");
}

/// The connection to the cache's owner closes with a put forwarded on it: the put is answered
/// at once, outcome unknown (`unacknowledged`: it may have been applied), not after the
/// forward timeout; the owner's late answer changes nothing.
#[test]
fn a_cache_write_forwarded_on_a_connection_that_closes_is_answered_outcome_unknown_at_once() {
    let mut c = Cluster::with(&NAMES, true);
    let (owner, via, conn, st) = a_cache_served_through_another_broker(&mut c);
    // Sent into a link that carries nothing any more: held, waiting for the owner's answer.
    c.cut.insert(owner.clone());
    c.send(&via, conn, st, sessions_put("third", 3));
    assert!(c.take(&via, conn, st).is_empty(), "waiting for the owner's answer");
    let now = c.now;
    c.nodes.get_mut(&via).unwrap().handle_peer_lost(&owner, now);
    c.settle();
    let got = messages(&c.take(&via, conn, st));
    assert!(
        matches!(&got[..], [Message::Error(e)] if e.message.contains("closed its connection")
            && e.message.contains("may have been applied")),
        "outcome unknown at once: {got:?}"
    );
}

/// A subscriber's flags: binary, offsets, generation-start skips (with FEATURE_SHARD_MOVED).
pub(super) const MOVED_SUB_FLAGS: u16 = 0x0001 | 0x0020 | 0x0800;

/// Ten acked publishes (`a0`..`a9`, with `flags`) to the ledger on its leader `first`, then a
/// subscriber there from offset 0 offering SHARD_MOVED: the subscriber's connection and stream.
fn ten_acked_then_a_subscriber(c: &mut Cluster, first: &str, flags: u16) -> (ConnId, StreamId) {
    let (conn, st) = c.client(first, flags, 1);
    for k in 0..10u64 {
        c.send(first, conn, st, publish_binary("ledger", &[&format!("a{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(first, conn, st)));
    assert!(a.len() == 10 && a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
    let (sc, ss) = c.client_with(first, MOVED_SUB_FLAGS, 0x1000, 2);
    c.send(first, sc, ss, subscribe_shard_of("ledger", 0, 0));
    assert!(matches!(messages(&c.take(first, sc, ss))[0], Message::Subscribed(_)));
    c.settle();
    (sc, ss)
}

/// Restarts `name` as a broker whose kept log of the ledger's replica was found damaged: the
/// driver set it aside and says why.
fn restart_damaged(c: &mut Cluster, name: &str) {
    c.kept_replicas.entry(name.to_owned()).or_default().remove(&ledger());
    restart(c, name);
    let why = "segment 0, byte 4096: a whole record fails its checksum".to_string();
    c.nodes.get_mut(name).unwrap().set_damaged_replicas([(ledger(), why)].into_iter().collect());
}

pub(super) fn rejoining(c: &Cluster, name: &str) -> bool {
    c.nodes[name].rejoining_replicas().contains_key(&ledger())
}

pub(super) const ACKED: u16 = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;

/// `n` acked publishes through `node` (offsets offered from `first`), all acknowledged `ok`.
pub(super) fn publish_acked(c: &mut Cluster, node: &str, index: u64, prefix: &str, n: u64) {
    let (conn, st) = c.client(node, ACKED, index);
    for k in 0..n {
        c.send(node, conn, st, publish_binary("ledger", &[&format!("{prefix}{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(node, conn, st)));
    assert!(a.len() == n as usize && a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
}

/// Three brokers, the ledger with twenty acknowledged records everywhere: the cluster, its
/// leader and a follower.
fn twenty_acked() -> (Cluster, String, String) {
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    let leader = leading(&c).unwrap();
    publish_acked(&mut c, &leader, 1, "a", 20);
    c.settle();
    let follower = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    (c, leader, follower)
}

#[test]
fn a_replica_whose_kept_log_is_damaged_rejoins_afresh_catches_up_and_votes_again() {
    let (mut c, leader, follower) = twenty_acked();
    // The follower restarts; its replica's log was found damaged and set aside.
    c.nodes.remove(&follower);
    restart_damaged(&mut c, &follower);
    assert!(rejoining(&c, &follower));
    c.until("its replica started, rejoining", |c| {
        c.nodes[&follower].replica_report().iter().any(|r| r.shard == ledger() && r.role == "rejoining")
    });
    // The leader takes it out of the group and adds it back; it catches up from the leader and
    // is told it may vote again.
    c.until("the damaged replica rejoined", |c| !rejoining(c, &follower));
    c.until("it holds the whole history", |c| history(c, &follower).0 == history(c, &leader).0);
    assert_eq!(history(&c, &follower).0.len(), 20);
    let counts = c.nodes[&follower].rejoin_counts();
    assert_eq!((counts.damaged, counts.healed), (1, 1));
    assert_eq!(c.nodes[&leader].rejoin_counts().readded, 1);
    let notes: Vec<&str> = c.rejoin_notes.iter().map(|(_, w)| w.as_str()).collect();
    assert!(notes.iter().any(|w| w.contains("took") && w.contains("out of the group")), "{notes:?}");
    assert!(notes.iter().any(|w| w.starts_with("rejoined its group")), "{notes:?}");
    assert_eq!(c.nodes[&leader].replica_voters(&ledger()).map(|v| v.len()), Some(3));
    // A full voter again: with the leader gone, it and the third replica elect a leader that
    // holds every acknowledged record and takes writes.
    c.nodes.remove(&leader);
    c.until("a new leader", |c| leading(c).is_some());
    let second = leading(&c).unwrap();
    publish_acked(&mut c, &second, 2, "b", 5);
    let (records, _) = history(&c, &second);
    assert_eq!(records.len(), 25);
    c.until("the rejoined replica holds it all", |c| history(c, &follower).0 == history(c, &second).0);
}

#[test]
fn a_damaged_replica_grants_no_vote_so_a_replica_without_the_acknowledged_records_cannot_lead() {
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    let leader = leading(&c).unwrap();
    let others: Vec<String> = NAMES.iter().filter(|n| **n != leader).map(|n| n.to_string()).collect();
    let (holder, behind) = (others[0].clone(), others[1].clone());
    // `behind` is cut off while ten records are acknowledged by the leader and `holder`.
    c.cut.insert(behind.clone());
    publish_acked(&mut c, &leader, 1, "a", 10);
    c.settle();
    assert_eq!(history(&c, &behind).0.len(), 0);
    // `holder` loses them (its kept log damaged, set aside) and the leader dies: the only
    // replica that could lead is `behind`, which never had them. An empty replica that voted
    // for it would lose ten acknowledged records; this one grants no vote, so nobody leads.
    c.nodes.remove(&leader);
    c.nodes.remove(&holder);
    c.cut.clear();
    restart_damaged(&mut c, &holder);
    for _ in 0..100 {
        c.tick();
    }
    assert_eq!(leading(&c), None, "a leader without the acknowledged records");
    assert!(rejoining(&c, &holder));
    // The old leader comes back with its log: it leads (or hands over) with every record, and
    // the damaged replica rejoins and catches up.
    restart(&mut c, &leader);
    c.until("a leader again", |c| leading(c).is_some());
    c.until("the damaged replica rejoined", |c| !rejoining(c, &holder));
    let now_leader = leading(&c).unwrap();
    let payloads: Vec<Bytes> = history(&c, &now_leader).0.into_iter().map(|(_, p)| p).collect();
    for k in 0..10 {
        assert!(payloads.iter().any(|p| p.as_ref() == format!("a{k}").as_bytes()), "a{k} lost: {payloads:?}");
    }
    c.until("every replica holds the same history", |c| same_history_everywhere(c, &now_leader));
}

#[test]
fn a_replica_whose_log_comes_back_shorter_than_it_acknowledged_rejoins_when_its_leader_says_so() {
    let (mut c, leader, follower) = twenty_acked();
    // Its kept log comes back cut at a record boundary (a truncated file looks whole to its
    // owner): the leader sees it answer below what it had acknowledged.
    let kept = c.kept_replicas.get_mut(&follower).unwrap().get_mut(&ledger()).unwrap();
    let keep = kept.entries.len() / 2;
    kept.entries.truncate(keep);
    kept.hard_state.commit = kept.hard_state.commit.min(kept.entries.last().map_or(0, |e| e.index));
    c.nodes.remove(&follower);
    restart(&mut c, &follower);
    c.until("it saw it lost entries it acknowledged", |c| rejoining(c, &follower));
    c.until("the leader took it out and added it back", |c| c.nodes[&leader].rejoin_counts().readded == 1);
    c.until("it rejoined", |c| !rejoining(c, &follower));
    c.until("it holds the whole history", |c| history(c, &follower).0 == history(c, &leader).0);
    let counts = c.nodes[&follower].rejoin_counts();
    assert_eq!((counts.damaged, counts.healed), (1, 1));
    assert_eq!(c.nodes[&leader].replica_voters(&ledger()).map(|v| v.len()), Some(3));
}
