//! Runs every fuzz target's body over its committed corpus (`fuzz/corpus/<target>/`), so that
//! a crash found once by the fuzzer stays fixed, and CI exercises the targets without nightly.
//!
//! The seeds are derived from the conformance vectors; `FELIX_BLESS=1` rewrites them.

use felix_proto::conformance::parse_hex;
use std::path::{Path, PathBuf};

fn fuzz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus")
}

/// (target, seed name, bytes) from every vector.
fn seeds() -> Vec<(&'static str, String, Vec<u8>)> {
    let vectors = Path::new(env!("CARGO_MANIFEST_DIR")).join("../vectors");
    let mut out = Vec::new();
    // Kept snapshot records a leader reads pieces of: data written whole, and with its end
    // (a commit state) written piece by piece; a piece from the middle, and one past the end.
    {
        use felix_proto::cluster::meta::{Snapshot, encode_snapshot_record, write_snapshot_record};
        let mut s = Snapshot::default();
        s.mut_metadata().index = 12;
        s.mut_metadata().term = 3;
        s.mut_metadata().mut_conf_state().voters = vec![1, 2, 3];
        s.set_data((0..600u32).map(|i| (i % 251) as u8).collect::<Vec<u8>>().into());
        let mut seed = vec![128, 40];
        seed.extend_from_slice(&encode_snapshot_record(&s));
        out.push(("snapshot_record", "seed-whole".to_owned(), seed));
        let rest: Vec<u8> = (0..300u32).map(|i| (i % 13) as u8).collect();
        let mut seed = vec![250, 255];
        write_snapshot_record(&s, rest.len() as u64, &|each| each(&rest), &mut |p| {
            seed.extend_from_slice(p);
            Ok(())
        })
        .expect("in memory");
        out.push(("snapshot_record", "seed-with-rest".to_owned(), seed));
    }
    // A shard's state checkpoint, as storage keeps it beside the shard.
    let checkpoint = felix_proto::storage::StateCheckpoint {
        as_of: 41,
        values: vec![
            ("balance".into(), bytes::Bytes::from_static(b"15"), 7),
            ("owner".into(), bytes::Bytes::from_static(b"ann"), 41),
        ],
    };
    let file = felix_proto::storage::encode_state_checkpoint(&checkpoint).expect("small");
    out.push(("storage_segment", "seed-state-checkpoint".to_owned(), file.to_vec()));
    let mut names: Vec<PathBuf> = std::fs::read_dir(&vectors)
        .expect("vectors/")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "hex"))
        .collect();
    names.sort();
    for p in names {
        let stem = p.file_stem().expect("stem").to_string_lossy().into_owned();
        let frame = parse_hex(&std::fs::read_to_string(&p).expect("read")).expect("hex");
        // frame: chunk size 7, limit 255 * 16 bytes.
        let mut f = vec![6u8, 255];
        f.extend_from_slice(&frame);
        out.push(("frame", format!("seed-{stem}"), f));
        // broker_session: the frame on the capable stream, then on the legacy stream, in steps of
        // (selector, length, flags) + bytes.
        let mut session = Vec::new();
        for sel in [0u8, 1] {
            for piece in frame.chunks(255) {
                session.extend([sel, piece.len() as u8, 0]);
                session.extend_from_slice(piece);
            }
        }
        out.push(("broker_session", format!("seed-{stem}"), session));
        // client_session: the frame from the broker on the control stream, then on an event
        // stream.
        let mut session = Vec::new();
        for sel in [0u8, 1] {
            for piece in frame.chunks(255) {
                session.extend([sel, piece.len() as u8, 0]);
                session.extend_from_slice(piece);
            }
        }
        out.push(("client_session", format!("seed-{stem}"), session));
        // storage_segment: the frame's payload stored as one batch (a valid segment of one).
        if frame.len() >= 12 {
            let mut seg = bytes::BytesMut::new();
            let records = felix_proto::Records::from_payloads([&frame[12..]]).expect("small");
            felix_proto::storage::encode_batch(
                &felix_proto::storage::StoredBatch {
                    key: None,
                    base_offset: frame.len() as u64,
                    timestamp_micros: 7,
                    generation_start: false,
                    publisher: Some(bytes::Bytes::from_static(b"seed")),
                    producer: None,
                    // Commit seeds carry a state section, so the fuzzer starts inside it too.
                    state: stem.contains("commit").then(|| {
                        felix_proto::storage::encode_state_changes(&[
                            ("balance".into(), Some(bytes::Bytes::from_static(b"10"))),
                            ("draft".into(), None),
                        ])
                        .expect("small")
                    }),
                    records,
                },
                &mut seg,
            );
            out.push(("storage_segment", format!("seed-{stem}"), seg.to_vec()));
        }
        if frame.len() >= 12 {
            let mut b = frame[6..8].to_vec();
            b.extend_from_slice(&frame[12..]);
            if frame[6..8] == [0, 0] {
                out.push(("json_message", format!("seed-{stem}"), frame[12..].to_vec()));
            } else {
                out.push(("binary_payload", format!("seed-{stem}"), b));
            }
        }
    }
    // peer_message: one of each message a cluster peer sends, and a kept Raft log.
    {
        use felix_proto::broker::{ForwardOutcome, ForwardedPublish};
        use felix_proto::cluster::peer::{PeerMessage, encode};
        let records = felix_proto::Records::from_payloads(["a", "bb"]).expect("small");
        // An acked plain publish forwarded to orders#2 (what each forward seed varies).
        let to_orders = |id: u64| ForwardedPublish {
            id,
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            shard: 2,
            generation: 3,
            key: None,
            records: records.clone(),
            publisher: None,
            acked: true,
        };
        let messages = [
            (
                "hello",
                PeerMessage::Hello {
                    cluster: "c".into(),
                    node_id: "n1".into(),
                    secret: "s".into(),
                    incarnation: "9e1c".into(),
                    features: felix_proto::cluster::peer::PEER_FEATURES,
                },
            ),
            (
                "heartbeats",
                PeerMessage::Heartbeats(vec![(
                    felix_proto::cluster::metadata::ShardId {
                        kind: felix_proto::cluster::metadata::Kind::Stream,
                        tenant: "t".into(),
                        namespace: "ns".into(),
                        name: "ledger".into(),
                        shard: 0,
                    },
                    felix_proto::cluster::peer::Beat { response: false, term: 3, commit: 17 },
                )]),
            ),
            ("raft", PeerMessage::Raft(bytes::Bytes::from_static(b"\x08\x01\x10\x02"))),
            (
                "forward",
                PeerMessage::Forward(ForwardedPublish {
                    publisher: Some(bytes::Bytes::from_static(b"alice")),
                    ..to_orders(1)
                }),
            ),
            (
                "forward_meta",
                PeerMessage::Forward(ForwardedPublish {
                    key: Some(bytes::Bytes::from_static(b"eu-7")),
                    records: felix_proto::samples::packed_records(felix_proto::binary::Codec::Zstd)
                        .with_envelope(Some(bytes::Bytes::from_static(b"\x01\x01\x02k1"))),
                    acked: false,
                    ..to_orders(2)
                }),
            ),
            ("answer", PeerMessage::ForwardAnswer { id: 1, outcome: ForwardOutcome::Appended { offset: Some(9) } }),
            ("forward_batch", PeerMessage::ForwardBatch((3..5).map(to_orders).collect())),
            (
                "forward_answers",
                PeerMessage::ForwardAnswers(vec![
                    (3, ForwardOutcome::Appended { offset: Some(10) }),
                    (
                        4,
                        ForwardOutcome::Refused {
                            code: felix_proto::error_code::ErrorCode::NotLeader,
                            retry: felix_proto::error_code::RetryClass::Redirect,
                            message: "moved".into(),
                        },
                    ),
                ]),
            ),
            ("propose", PeerMessage::Propose(bytes::Bytes::from_static(br#"{"op":"drain","id":"n2"}"#))),
            (
                "request",
                PeerMessage::Request(felix_proto::broker::ForwardedRequest {
                    id: 2,
                    tenant_id: "t1".into(),
                    principal: bytes::Bytes::from_static(b"alice"),
                    flags: 1,
                    features: 2,
                    request: bytes::Bytes::from_static(br#"FLX1 cache_get"#),
                }),
            ),
            ("request-answer", PeerMessage::RequestAnswer { id: 2, data: bytes::Bytes::from_static(b"answer") }),
            (
                "copy-request",
                PeerMessage::CopyRequest(felix_proto::cluster::peer::CopyRequest {
                    shard: orders(),
                    from: Some(7),
                    max_bytes: 1 << 20,
                }),
            ),
            (
                "copy-answer-state",
                PeerMessage::CopyAnswer(felix_proto::cluster::peer::CopyAnswer {
                    shard: orders(),
                    body: felix_proto::cluster::peer::CopyBody::Batches {
                        start: 7,
                        tail: 9,
                        cutting: false,
                        state: felix_proto::storage::encode_state_checkpoint(&felix_proto::storage::StateCheckpoint {
                            as_of: 6,
                            values: vec![("balance".into(), bytes::Bytes::from_static(b"15"), 2)],
                        }),
                        batches: Vec::new(),
                        groups: None,
                    },
                }),
            ),
            (
                "copy-answer-groups",
                PeerMessage::CopyAnswer(felix_proto::cluster::peer::CopyAnswer {
                    shard: orders(),
                    body: felix_proto::cluster::peer::CopyBody::Batches {
                        start: 0,
                        tail: 9,
                        cutting: true,
                        state: None,
                        batches: Vec::new(),
                        // A `$groups` checkpoint: a reset (op 7), then group "g"'s state (op 8).
                        groups: Some(vec![bytes::Bytes::from_static(&[7]), group_state_record()]),
                    },
                }),
            ),
            (
                "copy-answer",
                PeerMessage::CopyAnswer(felix_proto::cluster::peer::CopyAnswer {
                    shard: orders(),
                    body: felix_proto::cluster::peer::CopyBody::Batches {
                        start: 0,
                        tail: 9,
                        cutting: true,
                        state: None,
                        batches: vec![felix_proto::storage::StoredBatch {
                            key: None,
                            base_offset: 7,
                            timestamp_micros: 1,
                            generation_start: false,
                            publisher: Some(bytes::Bytes::from_static(b"alice")),
                            producer: Some((4, 2)),
                            state: None,
                            records: felix_proto::binary::Records::from_payloads(["a", "bb"]).expect("small"),
                        }],
                        groups: None,
                    },
                }),
            ),
            (
                "cache-copy-answer",
                PeerMessage::CopyAnswer(felix_proto::cluster::peer::CopyAnswer {
                    shard: felix_proto::cluster::metadata::ShardId {
                        kind: felix_proto::cluster::metadata::Kind::Cache,
                        tenant: "t1".into(),
                        namespace: "default".into(),
                        name: "sessions".into(),
                        shard: 0,
                    },
                    body: felix_proto::cluster::peer::CopyBody::Cache {
                        tail: 12,
                        cutting: true,
                        full: false,
                        records: vec![bytes::Bytes::from_static(&[2, 0, 0, 0, 0, 0, 0, 0, 9, 0, 1, b'k'])],
                        counters: vec![bytes::Bytes::from_static(&[2])],
                    },
                }),
            ),
            (
                "snapshot-chunk",
                PeerMessage::SnapshotChunk(felix_proto::cluster::peer::SnapshotChunk {
                    shard: felix_proto::cluster::metadata::ShardId {
                        kind: felix_proto::cluster::metadata::Kind::Stream,
                        tenant: "t1".into(),
                        namespace: "default".into(),
                        name: "ledger".into(),
                        shard: 0,
                    },
                    index: 40,
                    term: 2,
                    total: 6,
                    offset: 0,
                    header: bytes::Bytes::from(felix_proto::cluster::meta::encode_message(&{
                        let mut m = raft::eraftpb::Message::default();
                        m.set_msg_type(raft::eraftpb::MessageType::MsgSnapshot);
                        m.mut_snapshot().mut_metadata().index = 40;
                        m.mut_snapshot().mut_metadata().term = 2;
                        m
                    })),
                    data: bytes::Bytes::from_static(b"abc"),
                }),
            ),
        ];
        let mut all = bytes::BytesMut::new();
        for (name, m) in messages {
            let mut one = bytes::BytesMut::new();
            encode(&m, &mut one).expect("small");
            all.extend_from_slice(&one);
            out.push(("peer_message", format!("seed-{name}"), one.to_vec()));
        }
        out.push(("peer_message", "seed-all".into(), all.to_vec()));
        out.push(("peer_message", "seed-raft-log".into(), felix_proto::cluster::meta::RaftLog::default().encode()));
        // replica_log: records with and without a hard state, and a snapshot, as one segment
        // and as two (the first two bytes say where segments are cut).
        use felix_proto::cluster::meta::{Entry, HardState, Snapshot, encode_log_record, encode_snapshot_record};
        let entries = |r: std::ops::RangeInclusive<u64>, term| -> Vec<Entry> {
            r.map(|index| Entry { index, term, data: vec![index as u8; 3].into(), ..Entry::default() }).collect()
        };
        let mut log = encode_log_record(
            &entries(1..=3, 1),
            Some(&HardState { term: 1, vote: 2, commit: 2, ..HardState::default() }),
        );
        log.extend(encode_log_record(&entries(4..=5, 1), None));
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 4;
        snap.mut_metadata().term = 1;
        log.extend(encode_snapshot_record(&snap));
        log.extend(encode_log_record(
            &entries(6..=6, 2),
            Some(&HardState { term: 2, vote: 1, commit: 5, ..HardState::default() }),
        ));
        let mut one = vec![255, 255];
        one.extend_from_slice(&log);
        out.push(("replica_log", "seed-one-segment".into(), one));
        let mut two = vec![128, 255];
        two.extend_from_slice(&log);
        out.push(("replica_log", "seed-two-segments".into(), two));
        // A segment summary's fields (the body reads them sealed with the magic and a checksum).
        let mut b = felix_proto::cluster::segment_summary::SummaryBuilder::new();
        b.record(0, 40, &entries(1..=3, 1), Some(&HardState { term: 1, vote: 2, commit: 2, ..HardState::default() }));
        b.snapshot(40, 30);
        b.record(70, 40, &entries(3..=6, 2), None);
        let sum = b.encode().expect("a whole summary");
        let mut seed = vec![255, 255];
        seed.extend_from_slice(&sum[5..sum.len() - 4]);
        out.push(("replica_log", "seed-summary".into(), seed));
        #[allow(clippy::disallowed_methods)]
        let (entry, state) = felix_proto::fuzzing::cache_entry_seeds(std::time::Instant::now());
        out.push(("peer_message", "seed-cache-entry".into(), entry));
        out.push(("peer_message", "seed-cache-state".into(), state));
    }
    // peer_message: a metadata snapshot (D62) of members, a replicated stream with a leader,
    // a durable one moving, a revocation.
    {
        use felix_proto::cluster::metadata::snapshot::MetaSnapshot;
        use felix_proto::cluster::metadata::{Command, Kind, Member, MemberState, Metadata, ShardId};
        let mut md = Metadata::default();
        for id in ["n1", "n2", "n3"] {
            let member = Member {
                id: id.into(),
                client_addr: format!("{id}:5000"),
                cluster_addr: format!("{id}:7000"),
                state: MemberState::Active,
                incarnation: String::new(),
            };
            md.apply(&Command::Join { member }).expect("a join");
        }
        for (name, replication) in [("ledger", 3), ("orders", 1)] {
            let c = Command::Create {
                kind: Kind::Stream,
                tenant: "t1".into(),
                namespace: "default".into(),
                name: name.into(),
                shards: 2,
                ephemeral: false,
                replication,
            };
            md.apply(&c).expect("a create");
        }
        let ledger = ShardId::of(Kind::Stream, "t1", "default", "ledger", 0);
        let node = md.replicas(&ledger).expect("replicated")[0].clone();
        md.apply(&Command::Lead { shard: ledger, node, term: 2 }).expect("a lead");
        let orders = ShardId::of(Kind::Stream, "t1", "default", "orders", 1);
        let to = if md.owner(&orders).expect("owned").owner == "n1" { "n2" } else { "n1" };
        md.apply(&Command::MoveShard { shard: orders, to: to.into() }).expect("a move");
        md.apply(&Command::Revoke { jti: Some("j".into()), sub: None }).expect("a revocation");
        let s = MetaSnapshot {
            metadata: md,
            names: [(1, "n1".to_owned()), (2, "n2".to_owned()), (3, "n3".to_owned())].into(),
            addrs: [("n3".to_owned(), "n3:7000".to_owned())].into(),
            removed: Default::default(),
        };
        out.push(("peer_message", "seed-meta-snapshot".into(), s.encode()));
    }
    // jwt: a token signed by the target's key (RFC 8032's first test secret), a JWK set, a
    // permission.
    {
        let key = felix_proto::jwt::rfc8032_test_key();
        let claims = felix_proto::jwt::Claims {
            iss: "felix-auth".into(),
            aud: "felix-broker".into(),
            sub: "alice".into(),
            tid: "t1".into(),
            exp: 2_000_000_000,
            iat: 1_600_000_000,
            nbf: None,
            jti: Some("j".into()),
            perms: vec!["stream.publish:stream:t1/*/*".into(), "tenant.manage:tenant:t1".into()],
        };
        let token = felix_proto::jwt::mint(&key, "k1", &claims).expect("the test key signs");
        out.push(("jwt", "seed-token".into(), token.into_bytes()));
        let public = felix_proto::jwt::public_key(&key).expect("the test key");
        out.push(("jwt", "seed-jwks".into(), felix_proto::jwt::Jwks::single("k1", &public).to_json().into_bytes()));
        out.push(("jwt", "seed-perm".into(), b"cache.read:cache:t1/*/sessions".to_vec()));
    }
    out
}

/// The test's clock reading, for the bodies that need an epoch.
#[allow(clippy::disallowed_methods)]
fn broker_session(data: &[u8]) {
    felix_proto::fuzzing::broker_session(data, std::time::Instant::now());
}

#[allow(clippy::disallowed_methods)]
fn peer_message(data: &[u8]) {
    felix_proto::fuzzing::peer_message(data, std::time::Instant::now());
}

#[allow(clippy::disallowed_methods)]
fn client_session(data: &[u8]) {
    felix_proto::fuzzing::client_session(data, std::time::Instant::now());
}

#[test]
fn fuzz_bodies_pass_over_their_corpora() {
    let bless = std::env::var_os("FELIX_BLESS").is_some();
    let seeds = seeds();
    let mut missing = Vec::new();
    for (target, name, bytes) in &seeds {
        let p = fuzz_dir().join(target).join(name);
        if bless {
            std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
            std::fs::write(&p, bytes).expect("write seed");
        } else if std::fs::read(&p).ok().as_deref() != Some(bytes) {
            missing.push(p.display().to_string());
        }
    }
    assert!(
        missing.is_empty(),
        "seeds out of date (FELIX_BLESS=1 cargo test -p felix-proto --test fuzz_corpus): {missing:?}"
    );
    let mut ran = 0;
    for (target, body) in [
        ("frame", felix_proto::fuzzing::frame as fn(&[u8])),
        ("binary_payload", felix_proto::fuzzing::binary_payload),
        ("json_message", felix_proto::fuzzing::json_message),
        ("broker_session", broker_session),
        ("client_session", client_session),
        ("storage_segment", felix_proto::fuzzing::storage_segment),
        ("replica_log", felix_proto::fuzzing::replica_log),
        ("snapshot_record", felix_proto::fuzzing::snapshot_record),
        ("peer_message", peer_message),
        ("jwt", felix_proto::fuzzing::jwt),
    ] {
        let dir = fuzz_dir().join(target);
        for e in std::fs::read_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
            let p = e.expect("entry").path();
            if p.is_file() {
                body(&std::fs::read(&p).expect("read"));
                ran += 1;
            }
        }
    }
    assert!(ran >= seeds.len());
}

fn orders() -> felix_proto::cluster::metadata::ShardId {
    felix_proto::cluster::metadata::ShardId {
        kind: felix_proto::cluster::metadata::Kind::Stream,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: "orders".into(),
        shard: 2,
    }
}

/// Group "g"'s state as a `$groups` checkpoint record (op 8): cursor 4, offset 6 finished, none
/// dead or redriven.
fn group_state_record() -> bytes::Bytes {
    let mut b = vec![8, 0, 1, b'g', 1];
    b.extend_from_slice(&4u64.to_be_bytes());
    b.extend_from_slice(&1u32.to_be_bytes());
    b.extend_from_slice(&6u64.to_be_bytes());
    b.extend_from_slice(&0u32.to_be_bytes());
    b.extend_from_slice(&0u32.to_be_bytes());
    bytes::Bytes::from(b)
}
