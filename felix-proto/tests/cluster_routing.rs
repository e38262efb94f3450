//! A broker in a cluster (`Broker::apply_cluster`): shards owned elsewhere are redirected,
//! `topology` and `shard_owners` answer from the metadata, and each answer goes only to a client
//! that offered its bit.

mod support;

use felix_proto::cluster::metadata::{Command, Metadata};
use felix_proto::features::Features;
use felix_proto::message::{self, Message, StartPosition};
use felix_proto::sim::Sim;
use support::*;

/// Three members and a stream of six shards spread over them.
fn metadata() -> Metadata {
    cluster_metadata(&[("n1", 5001), ("n2", 5002), ("n3", 5003)], 6)
}

fn owner_of(md: &Metadata, shard: u32) -> (String, u64) {
    orders_owner(md, shard)
}

fn subscribe_shard(shard: u32) -> bytes::Bytes {
    json(&Message::Subscribe(message::Subscribe {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        subscription_id: None,
        start: Some(StartPosition::Latest),
        shard: Some(shard),
        queue_capacity: None,
        filter: None,
    }))
}

fn clustered() -> felix_proto::broker::BrokerConfig {
    let mut cfg = config();
    cfg.clustered = true;
    cfg
}

fn words(f: Features) -> (Option<u32>, Option<u32>) {
    f.to_words(true)
}

#[test]
fn shards_owned_elsewhere_are_redirected_and_the_view_is_answered() {
    let md = metadata();
    let mut sim = Sim::new(clustered(), epoch());
    sim.broker.apply_cluster(&md, "n1", sim.now);
    let mine = (0..6).find(|s| owner_of(&md, *s).0 == "n1").unwrap();
    let theirs = (0..6).find(|s| owner_of(&md, *s).0 != "n1").unwrap();
    let (owner, generation) = owner_of(&md, theirs);

    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let (lo, hi) = words(Features::REDIRECT | Features::TOPOLOGY | Features::SHARD_OWNERS | Features::ERROR_CODES);
    sim.raw_send(p, s, auth(Some(0x0021), lo, hi), false);
    sim.run();
    let Message::AuthOk(a) = messages(&sim.take_received(p, s)).remove(0) else { panic!() };
    let advertised = Features::from_words(a.server_features, a.server_features_hi);
    assert!(advertised.contains(Features::REDIRECT | Features::TOPOLOGY | Features::SHARD_OWNERS));

    sim.raw_send(p, s, json(&Message::Topology(message::Topology {})), false);
    sim.raw_send(
        p,
        s,
        json(&Message::ShardOwners(message::ShardOwners {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            name: "orders".into(),
            kind: message::ShardKind::Stream,
            request_id: 7,
        })),
        false,
    );
    sim.raw_send(p, s, subscribe_shard(theirs), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::TopologyView(t) = &ms[0] else { panic!("{ms:?}") };
    let ids: Vec<&str> = t.brokers.iter().map(|b| b.node_id.as_str()).collect();
    assert_eq!(ids, ["n1", "n2", "n3"]);
    let Message::ShardOwnersView(v) = &ms[1] else { panic!("{ms:?}") };
    assert_eq!(v.owners.len(), 6);
    for o in &v.owners {
        let (id, g) = owner_of(&md, o.shard);
        assert_eq!((o.node_id.as_deref(), o.generation), (Some(id.as_str()), g));
        assert!(o.addr.is_some());
    }
    assert_eq!(
        ms[2],
        Message::NotLeader(message::NotLeader {
            node_id: owner.clone(),
            addr: md.members()[&owner].client_addr.clone().into(),
            generation,
        })
    );
    // The shard it owns is served.
    sim.raw_send(p, s, subscribe_shard(mine), false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(p, s))[0], Message::Subscribed(_)));
}

#[test]
fn a_client_without_the_bits_gets_the_single_broker_answers() {
    let md = metadata();
    let mut sim = Sim::new(clustered(), epoch());
    sim.broker.apply_cluster(&md, "n1", sim.now);
    let theirs = (0..6).find(|s| owner_of(&md, *s).0 != "n1").unwrap();
    // Error codes but no FEATURE_REDIRECT: `error` with code not_leader.
    let (p, s, _) = raw_session(&mut sim, Some(1), Features::ERROR_CODES.to_words(false).0);
    sim.raw_send(p, s, subscribe_shard(theirs), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("not_leader"));
    // A legacy client: plain `error`, no code; `topology` is an unknown type to it (the stream is
    // closed, as a broker that knows no such request does).
    let (q, qs, ok) = raw_session(&mut sim, None, None);
    assert_eq!(ok, Message::Ok(message::OkMsg {}));
    sim.raw_send(q, qs, subscribe_shard(theirs), false);
    sim.run();
    let ms = messages(&sim.take_received(q, qs));
    let Message::Error(e) = &ms[0] else { panic!("{ms:?}") };
    assert_eq!((e.code.clone(), e.retry), (None, None), "no code fields for a client that did not offer them");
}

#[test]
fn a_standalone_broker_advertises_no_cluster_bits() {
    let mut sim = Sim::new(config(), epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let (lo, hi) = words(Features::REDIRECT | Features::TOPOLOGY | Features::SHARD_OWNERS | Features::UNSUPPORTED);
    sim.raw_send(p, s, auth(Some(1), lo, hi), false);
    sim.run();
    let Message::AuthOk(a) = messages(&sim.take_received(p, s)).remove(0) else { panic!() };
    let advertised = Features::from_words(a.server_features, a.server_features_hi);
    for bit in [Features::REDIRECT, Features::TOPOLOGY, Features::SHARD_OWNERS] {
        assert!(!advertised.contains(bit));
    }
    sim.raw_send(p, s, json(&Message::Topology(message::Topology {})), false);
    sim.run();
    assert!(matches!(messages(&sim.take_received(p, s))[0], Message::Unsupported(_)));
}

#[test]
fn a_new_owner_takes_over_with_a_newer_generation_and_the_old_ends_its_subscriptions() {
    let mut md = metadata();
    let mut sim = Sim::new(clustered(), epoch());
    sim.broker.apply_cluster(&md, "n1", sim.now);
    let mine = (0..6).find(|s| owner_of(&md, *s).0 == "n1").unwrap();
    let theirs = (0..6).find(|s| owner_of(&md, *s).0 == "n2").unwrap();
    let (_, before) = owner_of(&md, theirs);
    let (lo, hi) = words(Features::REDIRECT | Features::SHARD_MOVED | Features::ERROR_CODES);
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    sim.raw_send(p, s, auth(Some(0x0021), lo, hi), false);
    sim.raw_send(p, s, subscribe_shard(mine), false);
    sim.run();
    sim.take_received(p, s);
    // n2 leaves: its shards go to the others (some to n1, which serves them now); n1 leaves
    // next, and its own subscription ends with shard_moved naming the new owner.
    md.apply(&Command::Remove { id: "n2".into() }).unwrap();
    sim.broker.apply_cluster(&md, "n1", sim.now);
    let (now_owner, after) = owner_of(&md, theirs);
    assert!(after > before, "a change of owner bumps the generation");
    sim.raw_send(p, s, subscribe_shard(theirs), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    if now_owner == "n1" {
        assert!(matches!(ms[0], Message::Subscribed(_)), "{ms:?}");
    } else {
        assert!(matches!(&ms[0], Message::NotLeader(n) if n.node_id == now_owner && n.generation == after), "{ms:?}");
    }
    md.apply(&Command::Remove { id: "n1".into() }).unwrap();
    sim.broker.apply_cluster(&md, "n1", sim.now);
    sim.run();
    let ev = event_streams(&sim, p)[0];
    let events = messages(&sim.take_received(p, ev));
    assert!(
        events.iter().any(|m| matches!(m, Message::ShardMoved(m) if m.node_id.as_deref() == Some("n3"))),
        "{events:?}"
    );
}

/// A fenced broker's view may be behind: a move into it there may have finished long ago and
/// the shard taken writes here since, which the copy's first answer would replace. So the new
/// owner of a move asks for no copy and takes in no answer while fenced, and asks once its view
/// is current again.
#[test]
fn a_fenced_broker_copies_no_shard_into_itself_until_its_view_is_current() {
    use felix_proto::broker::{BrokerOutput, ClusterOutput};
    use felix_proto::cluster::metadata::{Kind, ShardId};
    let mut md = metadata();
    let theirs = (0..6).find(|s| owner_of(&md, *s).0 != "n1").unwrap();
    let shard = ShardId::of(Kind::Stream, "t1", "default", "orders", theirs);
    md.apply(&Command::MoveShard { shard: shard.clone(), to: "n1".into() }).unwrap();
    assert!(md.moving(&shard).is_some());
    let copies = |sim: &mut Sim| {
        std::mem::take(&mut sim.to_peers)
            .into_iter()
            .filter(|o| matches!(o, BrokerOutput::Cluster(ClusterOutput::Copy { .. })))
            .count()
    };
    let mut sim = Sim::new(clustered(), epoch());
    sim.broker.set_fenced(true, sim.now);
    sim.broker.apply_cluster(&md, "n1", sim.now);
    sim.run();
    for _ in 0..50 {
        sim.advance(std::time::Duration::from_millis(100));
    }
    assert_eq!(copies(&mut sim), 0, "no copy asked while fenced");
    sim.broker.set_fenced(false, sim.now);
    sim.advance(std::time::Duration::from_millis(100));
    assert!(copies(&mut sim) > 0, "asked once current");
    // The same broker never fenced asks at once (what the test above is measured against).
    let mut sim = Sim::new(clustered(), epoch());
    sim.broker.apply_cluster(&md, "n1", sim.now);
    sim.run();
    assert!(copies(&mut sim) > 0);
}

/// A broker the metadata still names the leader of a replicated cache whose replica here was
/// moved away (the group's next leader not recorded yet) holds none of the cache: it must not
/// serve a put or a get from a plain cache of its own. Seen in the world simulation (seed
/// 506884): the put was acknowledged and never reached the group, so the key's later value
/// was older than an acknowledged write.
#[test]
fn a_recorded_cache_leader_without_a_replica_serves_nothing_of_the_cache() {
    use felix_proto::cluster::metadata::{Command, Kind, ShardId};
    let mut md = Metadata::default();
    for (id, port) in [("n1", 5001), ("n2", 5002), ("n3", 5003), ("n4", 5004)] {
        md.apply(&Command::Join { member: cluster_member(id, port) }).unwrap();
    }
    md.apply(&Command::Create {
        kind: Kind::Cache,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "leases".into(),
        shards: 1,
        ephemeral: false,
        replication: 3,
    })
    .unwrap();
    let q = ShardId {
        kind: Kind::Cache,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "leases".into(),
        shard: 0,
    };
    let replicas = md.replicas(&q).unwrap().to_vec();
    let led = replicas[0].clone();
    md.apply(&Command::Lead { shard: q.clone(), node: led.clone(), term: 2 }).unwrap();
    let outsider = ["n1", "n2", "n3", "n4"].into_iter().find(|n| !replicas.contains(&(*n).to_owned())).unwrap();
    md.apply(&Command::MoveShard { shard: q.clone(), to: outsider.into() }).unwrap();
    md.apply(&Command::FinishMove { shard: q.clone(), to: outsider.into(), at: 0 }).unwrap();
    assert!(!md.replicas(&q).unwrap().contains(&led));
    assert_eq!(md.owner(&q).map(|a| a.owner.as_str()), Some(led.as_str()), "still recorded as the leader");

    let mut sim = Sim::new(clustered(), epoch());
    sim.broker.apply_cluster(&md, &led, sim.now);
    let (p, s, _) = raw_session(&mut sim, Some(1), Features::ERROR_CODES.to_words(false).0);
    let put = Message::CachePut(message::CachePut {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "leases".into(),
        key: "k".into(),
        value: message::B64(bytes::Bytes::from_static(b"v")),
        request_id: Some(1),
        ttl_ms: None,
    });
    let get = Message::CacheGet(message::CacheGet {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        cache: "leases".into(),
        key: "k".into(),
        request_id: Some(2),
    });
    for m in [put, get] {
        sim.raw_send(p, s, json(&m), false);
        sim.run();
        let ms = messages(&sim.take_received(p, s));
        let Some(Message::Error(e)) = ms.first() else { panic!("{m:?} answered {ms:?}") };
        let reason = e.detail.as_ref().and_then(|d| d.reason.as_deref());
        assert_eq!(
            (e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), reason),
            (Some("shard_unavailable"), Some("no_leader")),
            "{e:?}"
        );
    }
}
