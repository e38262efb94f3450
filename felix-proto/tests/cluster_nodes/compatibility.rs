//! Keys, envelopes and compressed blocks through forwarding and replication, and older brokers
//! sent only what they read.

use super::*;

/// Offers everything a D56–D58 client does: both codecs and envelopes (bit 15 and the second
/// flag word), binary publishes and events, offsets, keys, skips, and the filter feature.
fn auth_everything() -> Bytes {
    let (lo, hi) =
        (felix_proto::features::Features::STREAM_FILTER | felix_proto::features::Features::SHARD_MOVED).to_words(true);
    json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: TOKEN.into(),
        client_flags: Some(0x0827 | ACKED | 0x8000),
        client_flags_hi: Some(0x7),
        client_features: lo,
        client_features_hi: hi,
    }))
}

/// A client on `node` that offered everything; its connection, stream and `auth_ok`.
fn client_everything(c: &mut Cluster, node: &str, index: u64) -> (ConnId, StreamId, message::AuthOk) {
    let n = c.nodes.get_mut(node).unwrap();
    let conn = n.inputs().admit(PeerAddr([index as u8; 16]), c.now).unwrap();
    let stream = StreamId::new(Side::Client, Dir::Bi, index);
    n.inputs().handle_stream_data(conn, stream, auth_everything(), false, c.now);
    c.settle();
    let Some(Message::AuthOk(ok)) = messages(&c.take(node, conn, stream)).into_iter().next() else { panic!() };
    (conn, stream, ok)
}

/// A keyed, acked binary publish to `stream` whose records are the compressible sample
/// (compressed with `codec`, when given) and carry `envelope`.
fn publish_meta(
    stream: &str,
    request_id: u64,
    key: &str,
    codec: Option<felix_proto::binary::Codec>,
    envelope: Option<&'static [u8]>,
) -> Bytes {
    use felix_proto::binary::{AckMode, AckedPrefix, PublishBatch};
    let records = match codec {
        Some(codec) => felix_proto::samples::packed_records(codec),
        None => felix_proto::Records::from_payloads(felix_proto::samples::COMPRESSIBLE).unwrap(),
    };
    let b = PublishBatch {
        acked: Some(AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
        idempotent: None,
        key: Some(Bytes::from(key.to_owned())),
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        records: records.with_envelope(envelope.map(Bytes::from_static)),
    };
    let mut out = bytes::BytesMut::new();
    b.encode(&mut out).unwrap();
    out.freeze()
}

/// The event batches a connection's event streams on `node` carried (bit 15 read).
fn meta_events(c: &mut Cluster, node: &str, conn: ConnId) -> Vec<(felix_proto::flags::Flags, felix_proto::EventBatch)> {
    let keys: Vec<_> =
        c.received.keys().filter(|(n, cn, s)| n == node && *cn == conn && s.dir() == Dir::Uni).cloned().collect();
    let mut out = Vec::new();
    for k in keys {
        let bytes = c.received.remove(&k).unwrap();
        let mut d = felix_proto::FrameDecoder::new();
        d.set_accepted_flags(felix_proto::flags::Flags::KNOWN);
        d.push(Bytes::from(bytes));
        while let Ok(Some(f)) = d.next_frame() {
            if let Ok(felix_proto::Payload::Events(e)) = f.decode_payload() {
                out.push((f.flags, e));
            }
        }
    }
    out
}

fn eu_only() -> Option<message::KeyFilter> {
    Some(message::KeyFilter { keys: vec![], key_prefixes: vec![message::B64(Bytes::from_static(b"eu-"))] })
}

/// The version byte of every batch entry `node` kept of `shard`'s replica log.
fn entry_versions(c: &Cluster, node: &str, shard: &ShardId) -> Vec<u8> {
    let log = &c.kept_replicas[node][shard];
    log.entries
        .iter()
        .filter(|e| !e.get_data().is_empty() && e.get_entry_type() == raft::eraftpb::EntryType::EntryNormal)
        .map(|e| e.get_data()[0])
        .collect()
}

const SEALED: &[u8] = b"\x01\x01\x02k1";

/// D59: in a cluster, a filtered subscriber and an envelope reader get what a single broker
/// gives them, whether the batch was published on the owner, forwarded to it, or replicated
/// and read from a replica that became leader; a compressed batch stays compressed in the Raft
/// log.
#[test]
fn keys_envelopes_and_compressed_blocks_travel_through_forwarding_and_replication() {
    use felix_proto::binary::Codec;
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    c.until("the metadata names the leader", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let leader = leading(&c).unwrap();
    let follower = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    // A broker in a cluster advertises filters and envelopes now.
    let (pc, ps, ok) = client_everything(&mut c, &follower, 1);
    assert_eq!(ok.server_flags_hi, Some(0x7));
    let f = felix_proto::features::Features::from_words(ok.server_features, ok.server_features_hi);
    assert!(f.contains(felix_proto::features::Features::STREAM_FILTER));
    // A subscriber on the leader that takes only "eu-" keys.
    let (sc, ss, _) = client_everything(&mut c, &leader, 2);
    c.send(&leader, sc, ss, subscribe_filtered("ledger", Some(StartPosition::Earliest), eu_only()));
    assert!(matches!(messages(&c.take(&leader, sc, ss))[0], Message::Subscribed(_)));
    // Through the follower (forwarded to the leader): eu compressed and sealed, us plain, eu
    // lz4.
    c.send(&follower, pc, ps, publish_meta("ledger", 1, "eu-1", Some(Codec::Zstd), Some(SEALED)));
    c.send(&follower, pc, ps, publish_meta("ledger", 2, "us-1", None, None));
    c.send(&follower, pc, ps, publish_meta("ledger", 3, "eu-2", Some(Codec::Lz4), None));
    let a = acks(&payloads(&c.take(&follower, pc, ps)));
    assert!(a.len() == 3 && a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
    assert!(a.iter().all(|a| a.owner.as_ref().is_some_and(|o| o.node_id == leader)), "forwarded: {a:?}");
    c.settle();
    let plain: Vec<Bytes> = felix_proto::samples::COMPRESSIBLE.iter().map(|p| Bytes::from(p.as_bytes())).collect();
    let check = |events: &[(felix_proto::flags::Flags, felix_proto::EventBatch)], who: &str| {
        assert_eq!(events.len(), 2, "{who}: the two eu batches only: {events:?}");
        let (f0, e0) = &events[0];
        assert!(f0.contains(felix_proto::flags::Flags::EXTENDED), "{who}: sent as stored");
        assert_eq!(e0.records.envelope().map(|e| e.as_ref()), Some(SEALED), "{who}: with its envelope");
        assert_eq!(e0.records.codec(), Some(Codec::Zstd), "{who}: compressed as published");
        assert_eq!(e0.records.payloads().collect::<Vec<_>>(), plain);
        let (_, e1) = &events[1];
        assert_eq!(e1.records.envelope(), None);
        assert_eq!(e1.records.codec(), Some(Codec::Lz4));
        let n = plain.len() as u64;
        assert_eq!(e1.base_offset, e0.base_offset.map(|b| b + 2 * n), "{who}: offsets keep their meaning");
        assert_eq!(e1.skipped_before, Some(n), "{who}: the us batch passed over, said");
    };
    check(&meta_events(&mut c, &leader, sc), "the leader's subscriber");
    // Every replica keeps them as version 4 entries, compressed.
    for n in NAMES {
        assert_eq!(entry_versions(&c, n, &ledger()), vec![4, 4, 4], "{n}");
    }
    // The leader dies; a follower leads and serves the same from its own log.
    c.nodes.remove(&leader);
    c.until("a follower leads", |c| leading(c).is_some_and(|l| l != leader));
    let second = leading(&c).unwrap();
    let (sc, ss, _) = client_everything(&mut c, &second, 3);
    c.send(&second, sc, ss, subscribe_filtered("ledger", Some(StartPosition::Earliest), eu_only()));
    assert!(matches!(messages(&c.take(&second, sc, ss))[0], Message::Subscribed(_)));
    c.settle();
    check(&meta_events(&mut c, &second, sc), "the new leader's subscriber");
}

/// D59 both ways with an older broker (n3 offers no peer feature): a forward to it carries no
/// key and a plain block, a batch with an envelope is refused rather than sent without it;
/// a group with n3 in it is proposed version 2 entries only, and refuses envelopes.
#[test]
fn an_older_broker_is_sent_keys_and_blocks_as_before_and_never_a_batch_without_its_envelope() {
    use felix_proto::binary::Codec;
    let mut c = with_an_older_n3();
    c.create(Kind::Stream, "orders", 3, 0);
    let theirs = (0..3).find(|s| owner(&c, *s) == "n3").expect("n3 owns a shard");
    let key = key_for(theirs, 3);
    let (pc, ps, _) = client_everything(&mut c, "n1", 1);
    let before = c.stored.get(&("n3".to_string(), theirs)).copied().unwrap_or(0);
    c.send("n1", pc, ps, publish_meta("orders", 1, &key, Some(Codec::Zstd), Some(SEALED)));
    c.send("n1", pc, ps, publish_meta("orders", 2, &key, Some(Codec::Zstd), None));
    let a = acks(&payloads(&c.take("n1", pc, ps)));
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0].status, AckStatus::Error, "{a:?}");
    assert!(a[0].message.contains("does not keep envelopes"), "{a:?}");
    assert_eq!(a[1].status, AckStatus::Ok, "{a:?}");
    let n = felix_proto::samples::COMPRESSIBLE.len() as u32;
    assert_eq!(c.stored.get(&("n3".to_string(), theirs)).copied().unwrap_or(0), before + n, "only the second");
    // The peer frame n3 got was the one an older broker reads: flags byte 1 (acked), then
    // the plain block (checked by re-encoding what n3's decoder produced below).
    let forward = felix_proto::broker::ForwardedPublish {
        id: 0,
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        shard: theirs,
        generation: 0,
        key: Some(Bytes::from(key.clone())),
        records: felix_proto::samples::packed_records(Codec::Zstd),
        publisher: None,
        acked: true,
    };
    let old = forward.clone().without_meta().unwrap();
    assert_eq!((old.key.as_ref(), old.records.packed()), (None, None));
    let (mut new_bytes, mut old_bytes) = (bytes::BytesMut::new(), bytes::BytesMut::new());
    encode(&felix_proto::cluster::peer::PeerMessage::Forward(forward), &mut new_bytes).unwrap();
    encode(&felix_proto::cluster::peer::PeerMessage::Forward(old), &mut old_bytes).unwrap();
    assert!(new_bytes.len() < old_bytes.len(), "compressed to a peer that reads it");

    // The ledger's group has n3 in it: version 2 entries, no envelope.
    create_ledger(&mut c);
    c.until("the metadata names the leader", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let leader = leading(&c).unwrap();
    let (lc, ls, _) = client_everything(&mut c, &leader, 2);
    c.send(&leader, lc, ls, publish_meta("ledger", 1, "eu-1", Some(Codec::Lz4), Some(SEALED)));
    c.send(&leader, lc, ls, publish_meta("ledger", 2, "eu-1", Some(Codec::Lz4), None));
    let a = acks(&payloads(&c.take(&leader, lc, ls)));
    assert_eq!(a.len(), 2, "{a:?}");
    assert_eq!(a[0].status, AckStatus::Error, "{a:?}");
    assert!(a[0].message.contains("does not keep envelopes"), "{a:?}");
    assert_eq!(a[1].status, AckStatus::Ok, "{a:?}");
    c.settle();
    for n in NAMES {
        assert_eq!(entry_versions(&c, n, &ledger()), vec![2], "{n}: the one batch, as before D59");
    }
}

/// D60 in a cluster: one `stream_create` through any broker proposes every stream to the
/// metadata group, which creates them on every broker with their shard counts and replicas;
/// asked again, each existed.
/// D64 both ways: the publishes one round of input forwards to an owner that reads batches go
/// in one `forward_batch` frame and its answers come back in one `forward_answers`; an older
/// owner (n3) is sent a `forward` per publish and answers each, as before. Every client gets
/// its ack, in order, either way.
#[test]
fn publishes_forwarded_in_one_round_share_a_frame_to_an_owner_that_reads_batches_and_not_to_an_older_one() {
    let mut c = with_an_older_n3();
    c.create(Kind::Stream, "orders", 3, 0);
    let shard_of = |c: &Cluster, who: &str| (0..3).find(|s| owner(c, *s) == who).expect("it owns a shard");
    let (new, old) = (shard_of(&c, "n2"), shard_of(&c, "n3"));
    let (pc, ps, _) = client_everything(&mut c, "n1", 1);
    for (shard, to) in [(new, "n2"), (old, "n3")] {
        let key = key_for(shard, 3);
        let before = c.stored.get(&(to.to_string(), shard)).copied().unwrap_or(0);
        c.sent_kinds.clear();
        // Five acked batches in one read of the client's stream: one round of input.
        let mut frames = bytes::BytesMut::new();
        for id in 1..=5 {
            frames.extend_from_slice(&publish_meta("orders", id, &key, None, None));
        }
        let now = c.now;
        c.nodes.get_mut("n1").unwrap().inputs().handle_stream_data(pc, ps, frames.freeze(), false, now);
        c.settle();
        let a = acks(&payloads(&c.take("n1", pc, ps)));
        assert_eq!(a.iter().map(|a| a.request_id).collect::<Vec<_>>(), vec![1, 2, 3, 4, 5], "{to}: {a:?}");
        assert!(a.iter().all(|a| a.status == AckStatus::Ok), "{to}: {a:?}");
        let n = felix_proto::samples::COMPRESSIBLE.len() as u32;
        assert_eq!(c.stored.get(&(to.to_string(), shard)).copied().unwrap_or(0), before + 5 * n, "{to}");
        let sent = |from: &str, to: &str, kind: &str| {
            c.sent_kinds.get(&(from.to_owned(), to.to_owned(), kind)).copied().unwrap_or(0)
        };
        if to == "n2" {
            assert_eq!((sent("n1", to, "forward_batch"), sent("n1", to, "forward")), (1, 0), "{:?}", c.sent_kinds);
            let (batches, singles) = (sent(to, "n1", "forward_answers"), sent(to, "n1", "forward_answer"));
            assert!(batches >= 1 && batches + singles < 5, "answers share frames: {:?}", c.sent_kinds);
        } else {
            assert_eq!((sent("n1", to, "forward_batch"), sent("n1", to, "forward")), (0, 5), "{:?}", c.sent_kinds);
            assert_eq!(
                (sent(to, "n1", "forward_answers"), sent(to, "n1", "forward_answer")),
                (0, 5),
                "{:?}",
                c.sent_kinds
            );
        }
    }
}

#[test]
fn streams_created_in_one_request_through_any_broker_exist_on_every_broker() {
    let mut c = Cluster::new(&NAMES);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 3));
    let (lo, hi) =
        (felix_proto::features::Features::STREAM_CREATE | felix_proto::features::Features::ERROR_CODES).to_words(true);
    let n = c.nodes.get_mut("n2").unwrap();
    let conn = n.inputs().admit(PeerAddr([7; 16]), c.now).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, 7);
    n.inputs().handle_stream_data(conn, st, auth(Some(1), lo, hi), false, c.now);
    c.settle();
    let Message::AuthOk(ok) = messages(&c.take("n2", conn, st)).remove(0) else { panic!() };
    let f = felix_proto::features::Features::from_words(ok.server_features, ok.server_features_hi);
    assert!(f.contains(felix_proto::features::Features::STREAM_CREATE));
    let streams: Vec<message::NewStream> = (0..100u32)
        .map(|i| message::NewStream {
            stream: format!("bulk{i:03}"),
            shards: Some(1 + i % 3),
            replication: Some(if i % 10 == 0 { 3 } else { 1 }),
            durable: None,
        })
        .collect();
    let req = |streams, request_id| {
        json(&Message::StreamCreate(message::StreamCreate {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            streams,
            request_id,
        }))
    };
    c.send("n2", conn, st, req(streams, 1));
    let ms = messages(&c.take("n2", conn, st));
    assert!(
        matches!(&ms[0], Message::StreamCreateOk(ok) if ok.created.len() == 100 && ok.existed.is_empty()),
        "{ms:?}"
    );
    c.until("every broker knows every stream", |c| {
        c.nodes.values().all(|n| {
            (0..100u32).all(|i| {
                n.metadata().shard_count(Kind::Stream, "t1", "default", &format!("bulk{i:03}")) == Some(1 + i % 3)
            })
        })
    });
    let quorum = ShardId {
        kind: Kind::Stream,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "bulk010".into(),
        shard: 0,
    };
    assert_eq!(c.nodes["n1"].metadata().replicas(&quorum).map(<[String]>::len), Some(3));
    let single = ShardId { name: "bulk011".into(), ..quorum.clone() };
    assert_eq!(c.nodes["n1"].metadata().replicas(&single), None);
    // Asked again through another broker: every one existed, with its shards.
    let n = c.nodes.get_mut("n3").unwrap();
    let conn = n.inputs().admit(PeerAddr([8; 16]), c.now).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, 8);
    n.inputs().handle_stream_data(conn, st, auth(Some(1), lo, hi), false, c.now);
    c.settle();
    c.take("n3", conn, st);
    let again =
        vec![message::NewStream { stream: "bulk005".into(), shards: Some(9), replication: None, durable: None }];
    c.send("n3", conn, st, req(again, 2));
    let ms = messages(&c.take("n3", conn, st));
    assert!(
        matches!(&ms[0], Message::StreamCreateOk(ok) if ok.created.is_empty() && ok.existed == vec![message::ExistingStream { stream: "bulk005".into(), shards: 3 }]),
        "{ms:?}"
    );
}

/// A replicated cache moved to a broker outside its group: the broker whose replica it
/// replaced serves the cache as any other broker does (forwarding to the new leader).
#[test]
fn a_brokers_replica_of_a_cache_moved_away_stops_answering_for_it() {
    let mut c = Cluster::new(&NAMES);
    configure_sessions(&mut c, false, 3);
    create_sessions(&mut c);
    let old = cache_leader(&c).unwrap();
    // A fourth broker; the cache's group moves onto it, replacing the leader's replica.
    let mut cfg = config();
    cfg.clustered = true;
    cfg.caches = c.cache_specs.clone();
    let broker = Broker::new(cfg, WallClock::new(c.now, 1_700_000_000_000_000));
    c.nodes.insert("n4".into(), ClusterNode::joining(broker, member("n4", 4), &RaftLog::default(), c.now).unwrap());
    let now = c.now;
    c.nodes.get_mut("n1").unwrap().request_add("n4", "127.0.0.1:7004", now).unwrap();
    c.settle();
    c.until("n4 is an active member everywhere", |c| {
        c.nodes.values().all(|n| n.metadata().members().get("n4").is_some_and(|m| m.state == MemberState::Active))
    });
    let now = c.now;
    c.nodes.get_mut("n1").unwrap().propose(&Command::MoveShard { shard: sessions(), to: "n4".into() }, now);
    c.settle();
    c.until("the move finished: n4 replaced the old leader's replica", |c| {
        c.nodes.values().all(|n| {
            n.metadata().moving(&sessions()).is_none()
                && n.metadata().replicas(&sessions()).is_some_and(|r| r.iter().any(|x| x == "n4") && !r.contains(&old))
        })
    });
    c.until("a leader serves it", |c| cache_leader(c).is_some());
    for _ in 0..20 {
        c.tick();
    }
    // Through the broker that held the replica: served (forwarded to the leader).
    let (conn, st) = c.client(&old, 0x0001, 9);
    c.send(&old, conn, st, sessions_put("after-the-move", 1));
    let ms = messages(&c.take(&old, conn, st));
    assert!(matches!(&ms[0], Message::CacheOk(_)), "{old}: {ms:?}");
}
