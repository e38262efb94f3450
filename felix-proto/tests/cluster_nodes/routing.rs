//! Publishes, deletes, status, membership changes, caches and revocations through any broker.

use super::*;

#[test]
fn records_published_through_any_broker_land_once_on_their_owner() {
    let mut c = Cluster::new(&NAMES);
    c.until("every broker joined, everywhere", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let leaders: Vec<_> = c.nodes.values().map(|n| n.leader().map(str::to_owned)).collect();
    assert!(leaders.iter().all(|l| l.is_some() && *l == leaders[0]), "one leader, known to all: {leaders:?}");
    // Created through a follower: handed to the leader, committed, applied everywhere.
    let follower = NAMES.iter().find(|n| Some(**n) != c.nodes["n1"].leader()).unwrap().to_string();
    let create = Command::Create {
        kind: Kind::Stream,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "orders".into(),
        shards: 6,
        ephemeral: false,
        replication: 0,
    };
    let now = c.now;
    c.nodes.get_mut(&follower).unwrap().propose(&create, now);
    c.settle();
    c.until("the stream is known everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Stream, "t1", "default", "orders") == Some(6))
    });
    let owners: Vec<String> = (0..6).map(|s| owner(&c, s)).collect();
    for n in NAMES {
        assert!(owners.iter().any(|o| o == n), "{n} owns a share: {owners:?}");
    }
    // Thirty keyed, acked records through each broker (owner section and offsets offered).
    let flags = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;
    let mut acked = 0;
    for (i, n) in NAMES.iter().enumerate() {
        let (conn, st) = c.client(n, flags, i as u64 + 1);
        for k in 0..30 {
            let key = format!("key-{n}-{k}");
            c.send(n, conn, st, publish_binary("orders", &["x"], Some(k + 1), Some(&key)));
        }
        let bytes = c.take(n, conn, st);
        for a in acks(&payloads(&bytes)) {
            assert_eq!(a.status, AckStatus::Ok, "{a:?}");
            if let Some(o) = &a.owner {
                assert_ne!(o.node_id, *n, "an owner section only for forwarded batches");
            }
            acked += 1;
        }
    }
    assert_eq!(acked, 90, "every publish answered");
    let total: u32 = c.stored.values().sum();
    assert_eq!(total, 90, "every record stored once: {:?}", c.stored);
    for (node, shard) in c.stored.keys() {
        assert_eq!(*node, owner(&c, *shard), "shard {shard} written only on its owner");
    }
    // A subscribe through a broker that does not own the shard follows a redirect.
    let theirs = (0..6).find(|s| owners[*s as usize] != "n1").unwrap() as u32;
    let p = c.nodes.get_mut("n1").unwrap().inputs().admit(PeerAddr([9; 16]), c.now).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, 9);
    let (lo, hi) = felix_proto::features::Features::REDIRECT.to_words(true);
    c.nodes.get_mut("n1").unwrap().inputs().handle_stream_data(p, st, auth(Some(1), lo, hi), false, c.now);
    c.settle();
    c.take("n1", p, st);
    let sub = json(&Message::Subscribe(message::Subscribe {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        subscription_id: None,
        start: Some(StartPosition::Earliest),
        shard: Some(theirs),
        queue_capacity: None,
        filter: None,
    }));
    c.send("n1", p, st, sub);
    let ms = messages(&c.take("n1", p, st));
    assert!(matches!(&ms[0], Message::NotLeader(n) if n.node_id == owners[theirs as usize]), "{ms:?}");
    // Every broker holds the same metadata.
    let md = c.nodes["n1"].metadata().clone();
    assert!(c.nodes.values().all(|n| *n.metadata() == md));
}

#[test]
fn a_broker_restarted_from_its_kept_raft_log_rejoins_with_the_same_metadata() {
    let mut c = Cluster::new(&NAMES);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    // n3 crashes; it keeps only its Raft log.
    c.nodes.remove("n3");
    let create = Command::Create {
        kind: Kind::Stream,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "orders".into(),
        shards: 4,
        ephemeral: false,
        replication: 0,
    };
    let now = c.now;
    let any = c.nodes.keys().next().unwrap().clone();
    c.nodes.get_mut(&any).unwrap().propose(&create, now);
    c.settle();
    c.until("the two survivors commit without n3", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Stream, "t1", "default", "orders").is_some())
    });
    let peers: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
    let mut cfg = config();
    cfg.clustered = true;
    let broker = Broker::new(cfg, WallClock::new(c.now, 1_700_000_000_000_000));
    let kept = c.kept.get("n3").cloned().unwrap_or_default();
    assert!(!kept.entries.is_empty(), "n3 kept its log");
    c.nodes.insert("n3".into(), ClusterNode::new(broker, member("n3", 3), &peers, &kept, c.now).unwrap());
    c.until("n3 caught up", |c| {
        c.nodes["n3"].metadata().shard_count(Kind::Stream, "t1", "default", "orders").is_some()
            && c.nodes["n3"].metadata() == c.nodes["n1"].metadata()
    });
}

#[test]
fn a_dead_broker_is_declared_down_its_in_memory_shards_move_and_its_durable_ones_wait_for_it() {
    use felix_proto::cluster::metadata::MemberState;
    use felix_proto::cluster::node::LEASE;
    let mut c = Cluster::new(&NAMES);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let now = c.now;
    for (name, ephemeral) in [("orders", false), ("ticks", true)] {
        let create = Command::Create {
            kind: Kind::Stream,
            tenant: "t1".into(),
            namespace: "default".into(),
            name: name.into(),
            shards: 6,
            ephemeral,
            replication: 0,
        };
        c.nodes.get_mut("n1").unwrap().propose(&create, now);
    }
    c.settle();
    c.until("both streams known everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Stream, "t1", "default", "ticks").is_some())
    });
    let owner_in = |c: &Cluster, at: &str, name: &str, shard: u32| {
        c.nodes[at]
            .metadata()
            .owner(&ShardId {
                kind: Kind::Stream,
                tenant: "t1".into(),
                namespace: "default".into(),
                name: name.into(),
                shard,
            })
            .unwrap()
            .clone()
    };
    // A non-leader dies (SIGKILL: it keeps only its Raft log); nothing reaches it any more.
    let leader = c.nodes["n1"].leader().unwrap().to_owned();
    let victim = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    let survivor = NAMES.iter().find(|n| **n != leader && **n != victim).unwrap().to_string();
    let durable_shard = (0..6).find(|s| owner_in(&c, &leader, "orders", *s).owner == victim).unwrap();
    let memory_shard = (0..6).find(|s| owner_in(&c, &leader, "ticks", *s).owner == victim).unwrap();
    let before = owner_in(&c, &leader, "ticks", memory_shard);
    c.nodes.remove(&victim);
    let died = c.now;
    c.until("the dead broker is declared down and its in-memory shards have new owners everywhere", |c| {
        c.nodes.values().all(|n| {
            n.metadata().members()[&victim].state == MemberState::Down
                && owner_in(c, n.node_id(), "ticks", memory_shard).owner != victim
        })
    });
    let failover = c.now - died;
    assert!(failover > LEASE && failover < LEASE * 3, "fail-over in {failover:?} (lease {LEASE:?})");
    eprintln!("in-memory shards moved {failover:?} after the broker died (cluster time)");
    let after = owner_in(&c, &leader, "ticks", memory_shard);
    assert!(after.generation > before.generation);
    // Its durable shard waits: a write through a survivor is shard_unavailable, not lost.
    assert_eq!(owner_in(&c, &leader, "orders", durable_shard).owner, victim);
    let flags = 0x0001 | 0x0008 | 0x0040 | 0x0200;
    let (conn, st) = c.client(&survivor, flags, 7);
    let key = (0..200)
        .map(|k| format!("k{k}"))
        .find(|k| felix_proto::routing::shard_for_key(Some(k.as_bytes()), 6, message::Routing::Modulo) == durable_shard)
        .unwrap();
    c.send(&survivor, conn, st, publish_binary("orders", &["x"], Some(1), Some(&key)));
    let a = acks(&payloads(&c.take(&survivor, conn, st))).remove(0);
    assert_eq!(a.code.map(|(c, _)| c.name().into_owned()).as_deref(), Some("shard_unavailable"));
    // It comes back from its kept log, still cut off: what it replayed says it owns the
    // in-memory shard that moved while it was down, yet it serves nothing until a leader
    // confirmed what the cluster committed and it applied that (fenced from the start).
    let peers: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
    let mut cfg = config();
    cfg.clustered = true;
    let broker = Broker::new(cfg, WallClock::new(c.now, 1_700_000_000_000_000));
    let i = NAMES.iter().position(|n| **n == victim).unwrap() as u16 + 1;
    let kept = c.kept[&victim].clone();
    c.cut.insert(victim.clone());
    c.nodes.insert(victim.clone(), ClusterNode::new(broker, member(&victim, i), &peers, &kept, c.now).unwrap());
    c.tick();
    assert_eq!(
        c.nodes[&victim]
            .metadata()
            .owner(&ShardId {
                kind: Kind::Stream,
                tenant: "t1".into(),
                namespace: "default".into(),
                name: "ticks".into(),
                shard: memory_shard,
            })
            .map(|a| a.owner.clone()),
        Some(victim.clone()),
        "its replayed view is stale"
    );
    let memory_key = (0..200)
        .map(|k| format!("m{k}"))
        .find(|k| felix_proto::routing::shard_for_key(Some(k.as_bytes()), 6, message::Routing::Modulo) == memory_shard)
        .unwrap();
    let (vconn, vst) = c.client(&victim, 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x0200 | 0x0400 | 0x1000, 8);
    c.send(&victim, vconn, vst, publish_binary("ticks", &["stale"], Some(1), Some(&memory_key)));
    let a = acks(&payloads(&c.take(&victim, vconn, vst))).remove(0);
    assert_eq!(a.detail.as_ref().and_then(|d| d.reason.as_deref()), Some("fenced"), "{a:?}");
    for _ in 0..5 {
        c.tick();
    }
    assert!(c.nodes[&victim].broker().is_fenced(), "no leader heard: still fenced");
    // In contact again: it rejoins active, learns the shard's new owner and forwards to it.
    c.cut.clear();
    c.until("the broker is active again everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().members()[&victim].state == MemberState::Active)
    });
    c.until("no longer fenced", |c| !c.nodes[&victim].broker().is_fenced());
    // (The placement may have handed it back to it, at a newer generation still.)
    let now_owner = owner_in(&c, &leader, "ticks", memory_shard);
    assert_eq!(owner_in(&c, &victim, "ticks", memory_shard), now_owner, "its view is the cluster's");
    assert!(now_owner.generation > before.generation);
    c.send(&victim, vconn, vst, publish_binary("ticks", &["fresh"], Some(2), Some(&memory_key)));
    let a = acks(&payloads(&c.take(&victim, vconn, vst))).remove(0);
    assert_eq!(a.status, AckStatus::Ok, "{a:?}");
    c.send(&survivor, conn, st, publish_binary("orders", &["y"], Some(2), Some(&key)));
    let a = acks(&payloads(&c.take(&survivor, conn, st))).remove(0);
    assert_eq!(a.status, AckStatus::Ok, "{a:?}");
    assert!(c.stored.get(&(victim.clone(), durable_shard)).is_some_and(|n| *n >= 1), "{:?}", c.stored);
}

#[test]
fn a_stream_deleted_through_any_broker_is_deleted_on_every_broker() {
    let mut c = Cluster::new(&NAMES);
    c.create(Kind::Stream, "orders", 3, 0);
    // A subscriber on the owner of shard 0.
    let owner0 = owner(&c, 0);
    let (p, st) = c.client(&owner0, 0x0001 | 0x0020, 5);
    let sub = json(&Message::Subscribe(message::Subscribe {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        subscription_id: None,
        start: Some(StartPosition::Latest),
        shard: Some(0),
        queue_capacity: None,
        filter: None,
    }));
    c.send(&owner0, p, st, sub);
    assert!(matches!(messages(&c.take(&owner0, p, st))[0], Message::Subscribed(_)));
    let has_orders = |c: &Cluster, n: &str| c.nodes[n].broker().streams().any(|(_, _, s, _)| s == "orders");
    assert!(NAMES.iter().all(|n| has_orders(&c, n)));
    // Deleted through another broker.
    let other = NAMES.iter().find(|n| **n != owner0).unwrap().to_string();
    let (q, qs) = c.client(&other, 0x0001, 6);
    let delete = json(&Message::StreamDelete(message::StreamDelete {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        request_id: 1,
    }));
    c.send(&other, q, qs, delete);
    assert_eq!(
        messages(&c.take(&other, q, qs)),
        [Message::StreamDeleteOk(message::StreamDeleteOk { request_id: 1, existed: true })]
    );
    c.until("gone from the metadata everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Stream, "t1", "default", "orders").is_none())
    });
    // Every broker deleted its part (the owner's subscription was told, as a deletion does).
    assert!(NAMES.iter().all(|n| !has_orders(&c, n)));
}

/// D52: any broker answers `cluster_status` over the client protocol with the document the
/// metrics listener serves (a tenant's part of it for a tenant's administrator), and a
/// `shard_move` sent to a broker that does not own the shard is proposed and carried out; a
/// move the metadata refuses comes back as an `error` saying why, in its turn.
#[test]
fn an_operator_reads_the_status_and_moves_a_shard_over_the_client_protocol() {
    let mut c = Cluster::new(&NAMES);
    c.create(Kind::Stream, "orders", 3, 0);
    let owner0 = owner(&c, 0);
    let other = NAMES.iter().find(|n| **n != owner0).unwrap().to_string();
    let codes = felix_proto::features::Features::ERROR_CODES.to_words(false).0.unwrap();
    let (q, qs) = c.client_with(&other, 0x0001, codes, 6);
    c.send(
        &other,
        q,
        qs,
        json(&Message::ClusterStatus(message::ClusterStatus { after: None, limit: None, request_id: 1 })),
    );
    let got = messages(&c.take(&other, q, qs));
    let [Message::ClusterStatusView(v)] = &got[..] else { panic!("{got:?}") };
    assert_eq!(v.request_id, 1);
    let st = &v.status;
    assert_eq!(st["cluster"], true);
    assert_eq!(st["node_id"], other.as_str());
    assert_eq!(st["members"].as_array().map(Vec::len), Some(3));
    let shard0 = st["shards"].as_array().unwrap().iter().find(|s| s["name"] == "orders" && s["shard"] == 0).unwrap();
    assert_eq!(shard0["owner"], owner0.as_str());
    assert_eq!(st["revoked"], serde_json::json!({"jti": [], "sub": []}), "a tenant sees no revocations");
    // A tenant's view holds its shards only; the operator's holds every tenant's.
    let n = &c.nodes[&other];
    assert_eq!(n.status(Some("someone-else"))["shards"], serde_json::json!([]));
    assert_eq!(n.status(None)["shards"], st["shards"]);
    let mv = |to: Option<&str>, cancel, request_id| {
        json(&Message::ShardMove(message::ShardMove {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            shard: 0,
            to: to.map(Into::into),
            cancel,
            request_id,
        }))
    };
    c.send(&other, q, qs, mv(Some("nosuch"), false, 2));
    c.send(&other, q, qs, mv(None, true, 3));
    c.send(&other, q, qs, mv(Some(&other), false, 4));
    let got = messages(&c.take(&other, q, qs));
    assert_eq!(got.len(), 3, "{got:?}");
    assert!(matches!(&got[0], Message::Error(e) if e.message.contains("nosuch")), "{:?}", got[0]);
    assert!(matches!(&got[1], Message::Error(_)), "not moving, nothing to cancel: {:?}", got[1]);
    let Message::ShardMoveOk(ok) = &got[2] else { panic!("{:?}", got[2]) };
    assert_eq!((ok.request_id, ok.proposed.clone()), (4, format!("move t1/default/orders shard 0 to {other}")));
    c.until("shard 0 moved to the broker asked", |c| owner(c, 0) == other);
}

/// D55: a status asked in pages shows every shard once, in order, with the lists about each
/// shard on the page its shard is on; the members on every page; a tenant's pages hold its
/// shards only; a bad cursor is an `error` in its turn, never the first page.
#[test]
fn the_status_is_read_in_pages_that_show_every_shard_once() {
    let mut c = Cluster::new(&NAMES);
    c.create(Kind::Stream, "orders", 7, 0);
    c.create(Kind::Stream, "audit", 5, 0);
    let n = &c.nodes[NAMES[0]];
    let whole = n.status(None);
    let all: Vec<serde_json::Value> = whole["shards"].as_array().unwrap().clone();
    assert_eq!(all.len(), 12);
    for limit in [1usize, 3, 5, 12, 50] {
        let mut after = None;
        let mut seen = Vec::new();
        let mut pages = 0;
        loop {
            let page = felix_proto::cluster::status::StatusPage { after: after.clone(), limit };
            let v = n.status_page(None, Some(&page));
            // The text `GET /cluster` answers (serialised without a value first) says the same.
            let text: serde_json::Value = serde_json::from_slice(&n.status_page_json(None, Some(&page))).unwrap();
            assert_eq!(text, v);
            assert_eq!(v["members"], whole["members"], "members on every page");
            let shards = v["shards"].as_array().unwrap();
            assert!(shards.len() <= limit);
            seen.extend(shards.iter().cloned());
            pages += 1;
            match v["next"].as_str() {
                Some(next) => {
                    assert_eq!(shards.len(), limit, "a page before the last is full");
                    after = Some(ShardId::from_cursor(next).expect("a cursor"));
                }
                None => break,
            }
        }
        assert_eq!(seen, all, "every shard once, in order, with {limit} a page");
        assert_eq!(pages, all.len().div_ceil(limit));
    }
    let page = felix_proto::cluster::status::StatusPage { after: None, limit: 3 };
    assert_eq!(n.status_page(Some("someone-else"), Some(&page))["shards"], serde_json::json!([]));
    // Over the client protocol, to a broker that offers pages.
    let (q, qs) =
        c.client_with(NAMES[1], 0x0001, felix_proto::features::Features::ERROR_CODES.to_words(false).0.unwrap(), 6);
    let ask = |after: Option<&str>, request_id| {
        json(&Message::ClusterStatus(message::ClusterStatus {
            after: after.map(Into::into),
            limit: Some(5),
            request_id,
        }))
    };
    c.send(NAMES[1], q, qs, ask(None, 1));
    let got = messages(&c.take(NAMES[1], q, qs));
    let [Message::ClusterStatusView(v)] = &got[..] else { panic!("{got:?}") };
    assert_eq!(v.status["shards"].as_array().map(Vec::len), Some(5));
    let next = v.status["next"].as_str().expect("more follow").to_owned();
    c.send(NAMES[1], q, qs, ask(Some("not a cursor"), 2));
    c.send(NAMES[1], q, qs, ask(Some(&next), 3));
    let got = messages(&c.take(NAMES[1], q, qs));
    assert!(matches!(&got[0], Message::Error(e) if e.message.contains("cursor")), "{:?}", got[0]);
    let Message::ClusterStatusView(v) = &got[1] else { panic!("{:?}", got[1]) };
    assert_eq!(v.request_id, 3);
    assert_eq!(v.status["shards"].as_array().unwrap()[..], all[5..10]);
}

#[test]
fn an_operator_adds_a_broker_that_takes_a_share_and_removes_one_only_with_force_for_its_durable_shards() {
    use felix_proto::cluster::node::AdminError;
    let mut c = Cluster::new(&NAMES);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let create = Command::Create {
        kind: Kind::Stream,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "orders".into(),
        shards: 8,
        ephemeral: false,
        replication: 0,
    };
    let now = c.now;
    c.nodes.get_mut("n1").unwrap().propose(&create, now);
    c.settle();
    c.until("the stream is known everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Stream, "t1", "default", "orders").is_some())
    });
    // Bad requests are refused up front.
    let n2 = c.nodes.get_mut("n2").unwrap();
    assert_eq!(n2.request_add("n1", "127.0.0.1:7001", now), Err(AdminError::AlreadyMember("n1".into())));
    assert!(matches!(n2.request_add("bad id!", "127.0.0.1:7009", now), Err(AdminError::Bad { .. })));
    assert!(matches!(n2.request_add("n4", "no-port", now), Err(AdminError::Bad { .. })));
    assert_eq!(n2.request_remove("n9", false, now), Err(AdminError::NotMember("n9".into())));
    // n4 starts empty, joining; an operator adds it through a follower.
    let mut cfg = config();
    cfg.clustered = true;
    let broker = Broker::new(cfg, WallClock::new(c.now, 1_700_000_000_000_000));
    c.nodes.insert("n4".into(), ClusterNode::joining(broker, member("n4", 4), &RaftLog::default(), c.now).unwrap());
    let follower = NAMES.iter().find(|n| Some(**n) != c.nodes["n1"].leader()).unwrap().to_string();
    c.nodes.get_mut(&follower).unwrap().request_add("n4", "127.0.0.1:7004", now).unwrap();
    c.settle();
    c.until("n4 is a voter and an active member everywhere, with the whole metadata", |c| {
        c.nodes.values().all(|n| {
            n.voters().len() == 4
                && n.metadata().members().get("n4").is_some_and(|m| m.state == MemberState::Active)
                && n.metadata() == c.nodes["n1"].metadata()
        })
    });
    for n in NAMES {
        assert!(c.peers_added.contains(&(n.into(), "n4".into(), "127.0.0.1:7004".into())), "{n} dials n4");
    }
    // Its share of the durable shards moves to it: copied, then handed over.
    c.until("n4's share was copied to it and handed over", |c| {
        c.nodes.values().all(|n| n.metadata().moves().is_empty())
            && (0..8).filter(|s| owner(c, *s) == "n4").count() == 2
    });
    let owners: Vec<String> = (0..8).map(|s| owner(&c, s)).collect();
    assert_eq!(owners.iter().filter(|o| *o == "n4").count(), 2, "n4 took its share: {owners:?}");
    // Records published through n4 land on their owners.
    let (conn, st) = c.client("n4", 0x0001 | 0x0008 | 0x0040 | 0x0200, 40);
    for k in 0..16 {
        c.send("n4", conn, st, publish_binary("orders", &["x"], Some(k + 1), Some(&format!("key{k}"))));
    }
    let acked = acks(&payloads(&c.take("n4", conn, st)));
    assert_eq!(acked.len(), 16);
    assert!(acked.iter().all(|a| a.status == AckStatus::Ok), "{acked:?}");
    // n4 owns durable shards: removing it needs force.
    let now = c.now;
    let n1 = c.nodes.get_mut("n1").unwrap();
    assert_eq!(n1.request_remove("n4", false, now), Err(AdminError::OwnsDurableShards { id: "n4".into(), count: 2 }));
    n1.request_remove("n4", true, now).unwrap();
    c.settle();
    c.until("n4 is gone everywhere and owns nothing", |c| {
        NAMES.iter().all(|n| {
            let node = &c.nodes[*n];
            node.voters().len() == 3
                && !node.metadata().members().contains_key("n4")
                && node.metadata().owners().values().all(|a| a.owner != "n4")
        })
    });
    for n in NAMES {
        assert!(c.peers_removed.contains(&(n.into(), "n4".into())), "{n} forgets n4");
    }
    // The removed broker does not come back by itself.
    for _ in 0..30 {
        c.tick();
    }
    assert!(!c.nodes["n1"].metadata().members().contains_key("n4"));
    // The three go on.
    let (conn, st) = c.client("n1", 0x0001 | 0x0008 | 0x0040 | 0x0200, 41);
    c.send("n1", conn, st, publish_binary("orders", &["y"], Some(1), Some("after")));
    assert_eq!(acks(&payloads(&c.take("n1", conn, st)))[0].status, AckStatus::Ok);
}

#[test]
fn caches_and_counters_live_on_their_owner_and_every_broker_forwards_to_it() {
    let mut c = Cluster::with(&NAMES, true);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let put = |key: &str, v: &str, rid: u64| {
        json(&Message::CachePut(message::CachePut {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: key.into(),
            value: message::B64::from(v),
            request_id: Some(rid),
            ttl_ms: None,
        }))
    };
    let get = |key: &str, rid: u64| {
        json(&Message::CacheGet(message::CacheGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: key.into(),
            request_id: Some(rid),
        }))
    };
    let add = |delta: i64, rid: u64| {
        json(&Message::CounterAdd(message::CounterAdd {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: "logins".into(),
            delta,
            request_id: rid,
        }))
    };
    // The first request makes the cluster create the cache: retryable until its owner is known.
    let (conn, st) = c.client("n1", 0x0001, 1);
    c.send("n1", conn, st, put("alice", "v1", 1));
    let first = messages(&c.take("n1", conn, st));
    assert!(
        matches!(&first[0], Message::Error(e) if e.message.contains("being created"))
            || first[0] == Message::CacheOk(message::CacheOk { request_id: 1 }),
        "{first:?}"
    );
    c.until("the cache has an owner everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Cache, "t1", "default", "sessions") == Some(1))
    });
    let cache_owner = c.nodes["n1"]
        .metadata()
        .owner(&ShardId {
            kind: Kind::Cache,
            tenant: "t1".into(),
            namespace: "default".into(),
            name: "sessions".into(),
            shard: 0,
        })
        .unwrap()
        .owner
        .clone();
    // A put through every broker, each read back through every other: one cache.
    let mut clients = BTreeMap::new();
    for (i, n) in NAMES.iter().enumerate() {
        clients.insert(*n, c.client(n, 0x0001, 10 + i as u64));
    }
    for (i, n) in NAMES.iter().enumerate() {
        let (conn, st) = clients[n];
        c.send(n, conn, st, put(&format!("k-{n}"), &format!("from-{n}"), 100 + i as u64));
        assert_eq!(messages(&c.take(n, conn, st)), [Message::CacheOk(message::CacheOk { request_id: 100 + i as u64 })]);
    }
    for n in NAMES {
        for m in NAMES {
            let (conn, st) = clients[n];
            c.send(n, conn, st, get(&format!("k-{m}"), 7));
            let got = messages(&c.take(n, conn, st));
            assert!(
                matches!(&got[..], [Message::CacheValue(v)] if v.value.as_ref().map(|b| b.0.as_ref()) == Some(format!("from-{m}").as_bytes())),
                "{n} reading k-{m}: {got:?}"
            );
        }
    }
    // Counters add up across brokers (the owner persists them: a write completes first).
    for (i, n) in NAMES.iter().enumerate() {
        let (conn, st) = clients[n];
        c.send(n, conn, st, add(i as i64 + 1, 200 + i as u64));
        let got = messages(&c.take(n, conn, st));
        assert!(
            matches!(&got[..], [Message::CounterValue(v)] if v.request_id == 200 + i as u64),
            "{n} (owner {cache_owner}): {got:?}"
        );
    }
    let (conn, st) = clients["n2"];
    c.send(
        "n2",
        conn,
        st,
        json(&Message::CounterGet(message::CounterGet {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            key: "logins".into(),
            request_id: 300,
        })),
    );
    assert_eq!(
        messages(&c.take("n2", conn, st)),
        [Message::CounterValue(message::CounterValue { value: Some(6), request_id: 300 })]
    );
    // Only the owner holds the cache; the others served nothing locally.
    let forwarded: u64 = c.nodes.values().map(|n| n.broker().stats().requests_forwarded).sum();
    let served: u64 = c.nodes.values().map(|n| n.broker().stats().requests_forwarded_in).sum();
    assert_eq!(forwarded, served, "every forward served");
    assert_eq!(forwarded, 2 + 6 + 2 + 1, "puts, gets, adds and the get not made on the owner");
    assert_eq!(c.nodes[&cache_owner].broker().stats().requests_forwarded, 0);
    // A watch is owner-only: not_leader to a client that offered the redirect bit, an error
    // with code not_leader to one that offered codes only.
    let other = NAMES.iter().find(|n| **n != cache_owner).unwrap().to_string();
    let watch = json(&Message::CacheWatch(message::CacheWatch {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "sessions".into(),
        key: Some("k-n1".into()),
        prefix: None,
        shard: None,
        from_offset: None,
        retained: false,
        subscription_id: None,
    }));
    let p = c.nodes.get_mut(&other).unwrap().inputs().admit(PeerAddr([50; 16]), c.now).unwrap();
    let ps = StreamId::new(Side::Client, Dir::Bi, 0);
    let (lo, hi) = felix_proto::features::Features::REDIRECT.to_words(true);
    c.nodes.get_mut(&other).unwrap().inputs().handle_stream_data(p, ps, auth(Some(1), lo, hi), false, c.now);
    c.settle();
    c.take(&other, p, ps);
    c.send(&other, p, ps, watch.clone());
    let got = messages(&c.take(&other, p, ps));
    assert!(matches!(&got[..], [Message::NotLeader(l)] if l.node_id == cache_owner), "{got:?}");
    let (lo, hi) = felix_proto::features::Features::ERROR_CODES.to_words(true);
    let q = c.nodes.get_mut(&other).unwrap().inputs().admit(PeerAddr([51; 16]), c.now).unwrap();
    c.nodes.get_mut(&other).unwrap().inputs().handle_stream_data(q, ps, auth(Some(1), lo, hi), false, c.now);
    c.settle();
    c.take(&other, q, ps);
    c.send(&other, q, ps, watch);
    let got = messages(&c.take(&other, q, ps));
    assert!(
        matches!(&got[..], [Message::Error(e)] if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("not_leader")),
        "{got:?}"
    );
    // cache_shards answers from the cluster's registry.
    c.send(
        &other,
        q,
        ps,
        json(&Message::CacheShards(message::CacheShards {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            cache: "sessions".into(),
            request_id: 9,
        })),
    );
    assert_eq!(
        messages(&c.take(&other, q, ps)),
        [Message::CacheShardsView(message::CacheShardsView { shards: 1, request_id: 9 })]
    );
    // Internal connections are not clients.
    assert!(c.nodes[&cache_owner].broker().connection_count() <= 3);
}

#[test]
fn a_broker_back_with_a_wiped_data_directory_is_refused_until_an_operator_removes_and_re_adds_it() {
    use felix_proto::cluster::peer::PeerMessage;
    let mut c = Cluster::new(&NAMES);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let hello = |incarnation: &str| PeerMessage::Hello {
        cluster: "c".into(),
        node_id: "n3".into(),
        secret: String::new(),
        incarnation: incarnation.into(),
        features: 0,
    };
    // Its own data directory: welcome back.
    let now = c.now;
    c.nodes.get_mut("n1").unwrap().handle_peer("n3", hello("n3-first-life"), now);
    assert!(c.refusals.is_empty());
    // n3 dies and comes back wiped: no Raft log, a new incarnation.
    c.nodes.remove("n3");
    let wiped = Member { incarnation: "n3-second-life".into(), ..member("n3", 3) };
    let peers: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
    let mut cfg = config();
    cfg.clustered = true;
    let broker = Broker::new(cfg, WallClock::new(c.now, 1_700_000_000_000_000));
    c.nodes.insert("n3".into(), ClusterNode::new(broker, wiped.clone(), &peers, &RaftLog::default(), c.now).unwrap());
    let now = c.now;
    for n in ["n1", "n2"] {
        c.nodes.get_mut(n).unwrap().handle_peer("n3", hello("n3-second-life"), now);
    }
    c.settle();
    assert_eq!(c.refusals.len(), 2, "{:?}", c.refusals);
    assert!(
        c.refusals
            .iter()
            .all(|(_, p, why)| p == "n3" && why.contains("another data directory") && why.contains("--force"))
    );
    // Ignored from then on: the others declare it down and it never comes back as it is.
    c.until("n3 declared down by the others", |c| {
        ["n1", "n2"].iter().all(|n| c.nodes[*n].metadata().members()["n3"].state == MemberState::Down)
    });
    for _ in 0..50 {
        c.tick();
    }
    assert!(["n1", "n2"].iter().all(|n| c.nodes[*n].metadata().members()["n3"].state == MemberState::Down));
    assert!(c.nodes["n1"].refused_peers().any(|p| p == "n3"));
    // The operator removes it (losing what only it held) and adds it back, joining.
    let now = c.now;
    c.nodes.get_mut("n1").unwrap().request_remove("n3", true, now).unwrap();
    c.settle();
    c.until("n3 removed", |c| ["n1", "n2"].iter().all(|n| !c.nodes[*n].metadata().members().contains_key("n3")));
    let mut cfg = config();
    cfg.clustered = true;
    let broker = Broker::new(cfg, WallClock::new(c.now, 1_700_000_000_000_000));
    c.nodes.insert("n3".into(), ClusterNode::joining(broker, wiped, &RaftLog::default(), c.now).unwrap());
    let now = c.now;
    for n in ["n1", "n2"] {
        c.nodes.get_mut(n).unwrap().handle_peer("n3", hello("n3-second-life"), now);
    }
    c.nodes.get_mut("n2").unwrap().request_add("n3", "127.0.0.1:7003", now).unwrap();
    c.settle();
    c.until("n3 is back, active, with the new incarnation", |c| {
        c.nodes.values().all(|n| {
            n.metadata()
                .members()
                .get("n3")
                .is_some_and(|m| m.state == MemberState::Active && m.incarnation == "n3-second-life")
        })
    });
    assert!(c.nodes["n1"].refused_peers().next().is_none());
}

/// A revocation through the metadata group (`ClusterNode::request_revoke` on any broker):
/// committed, it ends the subscription the revoked token opened on another broker (`revoked`),
/// refuses the token's next request there, and refuses it at `auth` on every broker; another
/// token's subscription goes on. No broker's own configuration lists it.
#[test]
fn a_revocation_through_the_metadata_group_ends_what_the_token_opened_on_every_broker() {
    use felix_proto::jwt::{Claims, Jwks, Verifier, mint, public_key, rfc8032_test_key};
    let mut c = Cluster::new(&NAMES);
    let verifier = Verifier::new(Jwks::single("k1", &public_key(&rfc8032_test_key()).unwrap()));
    for n in c.nodes.values_mut() {
        let now = c.now;
        n.inputs().set_jwt(Some(verifier.clone()), now);
    }
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let now = c.now;
    let create = Command::Create {
        kind: Kind::Stream,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "orders".into(),
        shards: 1,
        ephemeral: false,
        replication: 0,
    };
    c.nodes.get_mut("n1").unwrap().propose(&create, now);
    c.settle();
    c.until("the stream is known everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().shard_count(Kind::Stream, "t1", "default", "orders").is_some())
    });
    let home = owner(&c, 0);
    let secs = 1_700_000_000 + (c.now - epoch()).as_secs();
    let claims = |jti: &str| Claims {
        iss: "felix-auth".into(),
        aud: "felix-broker".into(),
        sub: "alice".into(),
        tid: "t1".into(),
        exp: secs + 3600,
        iat: secs - 10,
        nbf: None,
        jti: Some(jti.into()),
        perms: vec!["stream.subscribe:stream:t1/*/*".into(), "stream.publish:stream:t1/*/*".into()],
    };
    let leaked = mint(&rfc8032_test_key(), "k1", &claims("leaked")).unwrap();
    let fine = mint(&rfc8032_test_key(), "k1", &claims("fine")).unwrap();
    let (lo, hi) = felix_proto::features::Features::ERROR_CODES.to_words(true);
    let auth_with = |token: &str| {
        json(&Message::Auth(message::Auth {
            tenant_id: "t1".into(),
            token: token.into(),
            client_flags: Some(0x0001 | 0x0008),
            client_flags_hi: None,
            client_features: lo,
            client_features_hi: hi,
        }))
    };
    let mut subscribers = Vec::new();
    for (i, token) in [(20u8, &leaked), (21, &fine)] {
        let n = c.nodes.get_mut(&home).unwrap();
        let conn = n.inputs().admit(PeerAddr([i; 16]), c.now).unwrap();
        let st = StreamId::new(Side::Client, Dir::Bi, 0);
        n.inputs().handle_stream_data(conn, st, auth_with(token), false, c.now);
        n.inputs().handle_stream_data(conn, st, subscribe("orders", None), false, c.now);
        let mut events = None;
        while let Some(o) = n.poll_output() {
            if let NodeOutput::Broker(BrokerOutput::Transport(TransportOutput::OpenUni { conn: oc, token })) = o {
                let id = StreamId::new(Side::Broker, Dir::Uni, u64::from(i));
                n.inputs().handle_stream_opened(oc, token, id, c.now);
                events = Some(id);
            }
        }
        c.settle();
        subscribers.push((conn, st, events.expect("an event stream")));
    }
    // Revoked through a broker that is not the subscription's.
    let via = NAMES.iter().find(|n| **n != home).unwrap().to_string();
    assert!(c.nodes.get_mut(&via).unwrap().request_revoke(None, None, now).is_err(), "names nothing");
    c.nodes.get_mut(&via).unwrap().request_revoke(Some("leaked"), None, now).unwrap();
    c.settle();
    c.until("every broker applied the revocation", |c| {
        c.nodes.values().all(|n| n.metadata().revoked_jti().contains("leaked"))
    });
    let (bad_conn, bad_st, bad_events) = subscribers[0];
    let (good_conn, _, good_events) = subscribers[1];
    let ended = payloads(&c.take(&home, bad_conn, bad_events));
    assert!(
        matches!(ended.last(), Some(felix_proto::Payload::Json(message::Decoded::Message(Message::Error(e)))) if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("revoked")),
        "{ended:?}"
    );
    assert!(c.take(&home, good_conn, good_events).is_empty(), "the other token's subscription goes on");
    c.send(&home, bad_conn, bad_st, publish_json("orders", "x", Some(5), Some(felix_proto::binary::AckMode::PerBatch)));
    let ms = messages(&c.take(&home, bad_conn, bad_st));
    assert!(
        matches!(&ms[..], [Message::PublishError(e)] if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("revoked")),
        "{ms:?}"
    );
    for (i, n) in NAMES.iter().enumerate() {
        let node = c.nodes.get_mut(*n).unwrap();
        let conn = node.inputs().admit(PeerAddr([30 + i as u8; 16]), c.now).unwrap();
        let st = StreamId::new(Side::Client, Dir::Bi, 0);
        node.inputs().handle_stream_data(conn, st, auth_with(&leaked), false, c.now);
        c.settle();
        let ms = messages(&c.take(n, conn, st));
        assert!(matches!(&ms[..], [Message::Error(e)] if e.message.contains("revoked")), "{n}: {ms:?}");
    }
}
