//! `stream_list` and `stream_info` (D51, FEATURE_STREAM_INFO): what streams a tenant has, and
//! one shard described by the broker that serves it. Neither creates anything.

mod support;

use bytes::Bytes;
use felix_proto::broker::{Action, Grant, StreamConfig, StreamSpec, TokenGrant};
use felix_proto::features::Features;
use felix_proto::message::{self, Message};
use felix_proto::sim::Sim;
use support::*;

fn list(namespace: Option<&str>, after: Option<&str>, limit: Option<u32>, request_id: u64) -> Bytes {
    json(&Message::StreamList(message::StreamList {
        tenant_id: "t1".into(),
        namespace: namespace.map(Into::into),
        after: after.map(Into::into),
        limit,
        request_id,
    }))
}

fn info(stream: &str, shard: u32, request_id: u64) -> Bytes {
    json(&Message::StreamInfo(message::StreamInfo {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        shard,
        request_id,
    }))
}

fn names(m: &Message) -> (Vec<String>, Option<String>) {
    match m {
        Message::StreamListView(v) => {
            (v.streams.iter().map(|e| format!("{}/{}:{}", e.namespace, e.stream, e.shards)).collect(), v.next.clone())
        }
        other => panic!("{other:?}"),
    }
}

/// A token that may only publish to `default/orders`.
fn writer() -> TokenGrant {
    TokenGrant {
        token: "writer".into(),
        tenant_id: Some("t1".into()),
        principal: "writer".into(),
        grants: vec![Grant { action: Action::Publish, pattern: "default/orders".into() }],
    }
}

/// A session authenticated with [`writer`]'s token, offering error codes.
fn writer_session(sim: &mut Sim) -> (usize, felix_proto::transport::StreamId) {
    let w = sim.connect_raw();
    let ws = sim.raw_open_bi(w);
    let auth = Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: "writer".into(),
        client_flags: None,
        client_flags_hi: None,
        client_features: Features::ERROR_CODES.to_words(false).0,
        client_features_hi: None,
    });
    sim.raw_send(w, ws, json(&auth), false);
    sim.run();
    sim.take_received(w, ws);
    (w, ws)
}

fn code(m: &Message) -> Option<String> {
    match m {
        Message::Error(e) => e.code.as_ref().map(|c| c.name().into_owned()),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// Streams used and streams the configuration declares, in `namespace/stream` order, paged;
/// a namespace narrows it; a token sees only streams it may publish to or read; another
/// tenant's list is forbidden.
#[test]
fn stream_list_pages_what_the_token_may_use_in_order() {
    let mut cfg = config();
    cfg.tokens.push(writer());
    cfg.streams.push(StreamSpec {
        tenant_id: "t1".into(),
        namespace: "other".into(),
        name: "audit".into(),
        config: StreamConfig { shards: 2, ..Default::default() },
    });
    assert!(cfg.server_features().contains(Features::STREAM_INFO));
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, None, None);
    sim.raw_send(p, s, publish_binary("orders", &["a"], None, None), false);
    sim.raw_send(p, s, publish_binary("events", &["b"], None, None), false);
    sim.run();
    let _ = sim.take_received(p, s);
    let before = sim.broker.streams().count();
    sim.raw_send(p, s, list(None, None, None, 1), false);
    sim.raw_send(p, s, list(None, None, Some(2), 2), false);
    sim.raw_send(p, s, list(None, Some("default/orders"), Some(2), 3), false);
    sim.raw_send(p, s, list(Some("other"), None, None, 4), false);
    sim.raw_send(
        p,
        s,
        json(&Message::StreamList(message::StreamList {
            tenant_id: "t2".into(),
            namespace: None,
            after: None,
            limit: None,
            request_id: 5,
        })),
        false,
    );
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let all = vec!["default/events:1".to_owned(), "default/orders:1".into(), "other/audit:2".into()];
    assert_eq!(names(&ms[0]), (all.clone(), None), "used and configured streams, in order");
    assert_eq!(names(&ms[1]), (all[..2].to_vec(), Some("default/orders".into())), "a page, and where to go on");
    assert_eq!(names(&ms[2]), (all[2..].to_vec(), None));
    assert_eq!(names(&ms[3]), (all[2..].to_vec(), None), "one namespace");
    assert!(matches!(&ms[4], Message::Error(_)), "another tenant's list: {:?}", ms[4]);
    assert_eq!(sim.broker.streams().count(), before, "listing created nothing");
    // A token that may publish to one stream lists that one.
    let (w, ws) = writer_session(&mut sim);
    sim.raw_send(w, ws, list(None, None, None, 6), false);
    sim.run();
    assert_eq!(names(&messages(&sim.take_received(w, ws))[0]).0, ["default/orders:1"]);
}

/// A shard's description: configuration, offsets, what is retained, subscribers; a missing
/// stream is `not_found` (and not created), a missing shard `invalid_request`.
#[test]
fn stream_info_describes_a_shard_and_creates_nothing() {
    let mut sim = Sim::new(config(), epoch());
    let codes = Features::ERROR_CODES.to_words(false).0.unwrap();
    let (p, s, _) = raw_session(&mut sim, None, Some(codes));
    sim.raw_send(p, s, publish_binary("orders", &["a", "bb", "ccc"], None, None), false);
    sim.raw_send(p, s, subscribe("orders", None), false);
    sim.run();
    let _ = sim.take_received(p, s);
    sim.raw_send(p, s, info("orders", 0, 1), false);
    sim.raw_send(p, s, info("nosuch", 0, 2), false);
    sim.raw_send(p, s, info("orders", 3, 3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    let Message::StreamInfoView(v) = &ms[0] else { panic!("{:?}", ms[0]) };
    let d = StreamConfig::default();
    let want = message::StreamInfoView {
        shards: 1,
        shard: 0,
        durable: true,
        replication: 1,
        retention_records: d.retention.max_records,
        retention_bytes: d.retention.max_bytes,
        retention_secs: d.retention.max_age.map(|a| a.as_secs()),
        start: 0,
        next_offset: 3,
        records: 3,
        bytes: 6,
        subscribers: 1,
        groups: 0,
        request_id: 1,
    };
    assert_eq!(*v, want);
    assert_eq!(code(&ms[1]).as_deref(), Some("not_found"));
    assert_eq!(code(&ms[2]).as_deref(), Some("invalid_request"));
    assert!(!sim.broker.streams().any(|(_, _, s, _)| s == "nosuch"), "asking created nothing");
}

/// In a cluster any broker lists every stream of the registry, and a shard is described by
/// its owner: elsewhere the answer is `not_leader` naming it.
#[test]
fn in_a_cluster_the_list_is_the_registry_and_info_comes_from_the_owner() {
    let md = cluster_metadata(&[("n1", 5001), ("n2", 5002)], 4);
    let mut cfg = config();
    cfg.clustered = true;
    let mut sim = Sim::new(cfg, epoch());
    sim.broker.apply_cluster(&md, "n1", sim.now);
    let theirs = (0..4).find(|s| orders_owner(&md, *s).0 != "n1").unwrap();
    let mine = (0..4).find(|s| orders_owner(&md, *s).0 == "n1").unwrap();
    let (lo, hi) = (Features::REDIRECT | Features::ERROR_CODES).to_words(true);
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    sim.raw_send(p, s, auth(None, lo, hi), false);
    sim.run();
    sim.take_received(p, s);
    sim.raw_send(p, s, list(None, None, None, 1), false);
    sim.raw_send(p, s, info("orders", theirs, 2), false);
    sim.raw_send(p, s, info("orders", mine, 3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(names(&ms[0]).0, ["default/orders:4"], "from the registry");
    let (owner, generation) = orders_owner(&md, theirs);
    assert!(matches!(&ms[1], Message::NotLeader(n) if n.node_id == owner && n.generation == generation), "{:?}", ms[1]);
    assert!(matches!(&ms[2], Message::StreamInfoView(v) if v.shard == mine && v.shards == 4), "{:?}", ms[2]);
}

/// D52 on a broker that runs alone: `cluster_status` says so, `shard_move` is refused with
/// why, and a token without the admin permission on the whole tenant is refused `forbidden`
/// (its stream stays open and answers the next request).
#[test]
fn cluster_requests_on_a_lone_broker_say_it_runs_alone_and_need_the_admin_permission() {
    let mut cfg = config();
    cfg.tokens.push(writer());
    assert!(cfg.server_features().contains(Features::CLUSTER_ADMIN));
    let mut sim = Sim::new(cfg, epoch());
    let codes = Features::ERROR_CODES.to_words(false).0.unwrap();
    let (p, s, _) = raw_session(&mut sim, None, Some(codes));
    let status =
        |request_id| json(&Message::ClusterStatus(message::ClusterStatus { after: None, limit: None, request_id }));
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
    sim.raw_send(p, s, status(1), false);
    sim.raw_send(p, s, mv(Some("n2"), false, 2), false);
    sim.raw_send(p, s, status(3), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(
        ms[0],
        Message::ClusterStatusView(message::ClusterStatusView {
            status: serde_json::json!({"cluster": false}),
            request_id: 1
        })
    );
    assert_eq!(code(&ms[1]).as_deref(), Some("invalid_request"));
    assert!(matches!(&ms[2], Message::ClusterStatusView(v) if v.request_id == 3), "the stream goes on");
    let (w, ws) = writer_session(&mut sim);
    sim.raw_send(w, ws, status(4), false);
    sim.raw_send(w, ws, mv(Some("n2"), false, 5), false);
    sim.raw_send(w, ws, mv(None, true, 6), false);
    sim.run();
    let ms = messages(&sim.take_received(w, ws));
    assert_eq!(
        ms.iter().map(code).collect::<Vec<_>>(),
        [Some("forbidden".to_string()), Some("forbidden".into()), Some("forbidden".into())]
    );
}
