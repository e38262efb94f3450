use super::*;
use crate::shard::forward::ForwardedRequest;
use proptest::prelude::*;

fn samples() -> Vec<PeerMessage> {
    vec![
        PeerMessage::Hello {
            cluster: "prod".into(),
            node_id: "n1".into(),
            secret: "s3cret".into(),
            incarnation: "7f3a".into(),
            features: 0,
        },
        PeerMessage::Hello {
            cluster: "prod".into(),
            node_id: "n1".into(),
            secret: "s3cret".into(),
            incarnation: String::new(),
            features: PEER_FEATURES,
        },
        PeerMessage::Heartbeats(vec![
            (
                ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "s".into(), shard: 3 },
                Beat { response: false, term: 7, commit: 99 },
            ),
            (
                ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "s".into(), shard: 4 },
                Beat { response: true, term: 7, commit: 98 },
            ),
            (
                ShardId { kind: Kind::Cache, tenant: "t".into(), namespace: "ns".into(), name: "s".into(), shard: 0 },
                Beat { response: false, term: 1, commit: 0 },
            ),
        ]),
        PeerMessage::Heartbeats(Vec::new()),
        PeerMessage::SnapshotChunk(SnapshotChunk {
            shard: ShardId {
                kind: Kind::Cache,
                tenant: "t".into(),
                namespace: "ns".into(),
                name: "c".into(),
                shard: 2,
            },
            index: 900,
            term: 4,
            total: 10,
            offset: 0,
            header: Bytes::from_static(b"\x08\x07snap"),
            data: Bytes::from_static(b"abcd"),
        }),
        PeerMessage::SnapshotChunk(SnapshotChunk {
            shard: ShardId {
                kind: Kind::Stream,
                tenant: "t".into(),
                namespace: "ns".into(),
                name: "s".into(),
                shard: 0,
            },
            index: 900,
            term: 4,
            total: 10,
            offset: 4,
            header: Bytes::new(),
            data: Bytes::from_static(b"efghij"),
        }),
        PeerMessage::Hello {
            cluster: "c".into(),
            node_id: "n2".into(),
            secret: "s".into(),
            incarnation: String::new(),
            features: 0,
        },
        PeerMessage::Raft(Bytes::from_static(b"\x08\x01raft")),
        PeerMessage::ShardRaft(vec![
            (
                ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "s".into(), shard: 3 },
                RaftBytes::from(Bytes::from_static(b"\x08\x02")),
            ),
            (
                ShardId { kind: Kind::Cache, tenant: "t".into(), namespace: "ns".into(), name: "c".into(), shard: 0 },
                RaftBytes::from_parts(vec![Bytes::new(), Bytes::from(vec![7u8; 5000]), Bytes::from_static(b"end")]),
            ),
        ]),
        PeerMessage::ShardRaft(Vec::new()),
        PeerMessage::Forward(forwards()[0].clone()),
        PeerMessage::Forward(forwards()[1].clone()),
        PeerMessage::Forward(forwards()[2].clone()),
        PeerMessage::ForwardAnswer { id: answers()[0].0, outcome: answers()[0].1.clone() },
        PeerMessage::ForwardAnswer { id: answers()[1].0, outcome: answers()[1].1.clone() },
        PeerMessage::ForwardAnswer { id: answers()[2].0, outcome: answers()[2].1.clone() },
        PeerMessage::ForwardBatch(forwards()),
        PeerMessage::ForwardAnswers(answers()),
        PeerMessage::Propose(Bytes::from_static(br#"{"op":"drain","id":"n2"}"#)),
        PeerMessage::Request(ForwardedRequest {
            id: 4,
            tenant_id: "t1".into(),
            principal: Bytes::from_static(b"alice"),
            flags: 0x0001,
            features: 1 << 36 | 2,
            request: Bytes::from_static(b"FLX1 then a cache_get"),
        }),
        PeerMessage::RequestAnswer { id: 4, data: Bytes::from_static(b"answer frames") },
        PeerMessage::CopyRequest(CopyRequest { shard: orders(2), from: None, max_bytes: 1 << 20 }),
        PeerMessage::CopyRequest(CopyRequest { shard: orders(2), from: Some(41), max_bytes: 4096 }),
        PeerMessage::CopyAnswer(CopyAnswer {
            shard: orders(2),
            body: CopyBody::Batches {
                start: 3,
                tail: 12,
                cutting: true,
                state: None,
                groups: None,
                batches: vec![
                    crate::storage::StoredBatch {
                        key: None,
                        base_offset: 3,
                        timestamp_micros: 17,
                        generation_start: false,
                        publisher: Some(Bytes::from_static(b"alice")),
                        producer: Some((9, 4)),
                        state: None,
                        records: Records::from_payloads(["a", "bb"]).unwrap(),
                    },
                    crate::storage::StoredBatch {
                        key: None,
                        base_offset: 5,
                        timestamp_micros: 18,
                        generation_start: true,
                        publisher: None,
                        producer: None,
                        state: None,
                        records: Records::default(),
                    },
                ],
            },
        }),
        PeerMessage::CopyAnswer(CopyAnswer {
            shard: orders(0),
            body: CopyBody::Batches {
                start: 0,
                tail: 0,
                cutting: false,
                batches: Vec::new(),
                state: None,
                groups: None,
            },
        }),
        PeerMessage::CopyAnswer(CopyAnswer {
            shard: orders(1),
            body: CopyBody::Batches {
                start: 40,
                tail: 41,
                cutting: false,
                batches: Vec::new(),
                state: crate::storage::encode_state_checkpoint(&crate::storage::StateCheckpoint {
                    as_of: 39,
                    values: vec![("balance".into(), Bytes::from_static(b"15"), 7)],
                }),
                groups: None,
            },
        }),
        // The final answer with the shard's consumer groups (D65): with and without state.
        PeerMessage::CopyAnswer(CopyAnswer {
            shard: orders(1),
            body: CopyBody::Batches {
                start: 40,
                tail: 41,
                cutting: true,
                batches: Vec::new(),
                state: None,
                groups: Some(vec![crate::broker::group_record_samples().0, crate::broker::group_record_samples().1]),
            },
        }),
        PeerMessage::CopyAnswer(CopyAnswer {
            shard: orders(1),
            body: CopyBody::Batches {
                start: 40,
                tail: 41,
                cutting: true,
                batches: Vec::new(),
                state: crate::storage::encode_state_checkpoint(&crate::storage::StateCheckpoint {
                    as_of: 39,
                    values: vec![("balance".into(), Bytes::from_static(b"15"), 7)],
                }),
                groups: Some(vec![crate::broker::group_record_samples().0]),
            },
        }),
        PeerMessage::CopyAnswer(CopyAnswer { shard: orders(1), body: CopyBody::Refused("not moving".into()) }),
        PeerMessage::CopyRequest(CopyRequest { shard: sessions(), from: None, max_bytes: 1 << 20 }),
        PeerMessage::CopyRequest(CopyRequest { shard: sessions(), from: Some(1_700_000_000_000_007), max_bytes: 9 }),
        PeerMessage::CopyAnswer(CopyAnswer {
            shard: sessions(),
            body: CopyBody::Cache {
                tail: 1_700_000_000_000_012,
                cutting: false,
                full: true,
                records: vec![Bytes::from_static(&[3]), Bytes::from_static(b"\x01put")],
                counters: vec![Bytes::from_static(&[2])],
            },
        }),
        PeerMessage::CopyAnswer(CopyAnswer {
            shard: sessions(),
            body: CopyBody::Cache { tail: 4, cutting: true, full: false, records: Vec::new(), counters: Vec::new() },
        }),
        PeerMessage::CopyAnswer(CopyAnswer { shard: sessions(), body: CopyBody::Refused("no move".into()) }),
    ]
}

/// The publishes of the `forward` samples.
fn forwards() -> Vec<ForwardedPublish> {
    vec![
        ForwardedPublish {
            id: 7,
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            shard: 3,
            generation: 9,
            key: None,
            records: Records::from_payloads(["a", "bb"]).unwrap(),
            publisher: Some(Bytes::from_static(b"alice")),
            acked: true,
        },
        ForwardedPublish {
            id: 8,
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            shard: 3,
            generation: 9,
            key: Some(Bytes::from_static(b"eu-7")),
            records: crate::samples::packed_records(crate::binary::Codec::Lz4)
                .with_envelope(Some(Bytes::from_static(b"\x01\x01\x02k1"))),
            publisher: Some(Bytes::from_static(b"alice")),
            acked: true,
        },
        ForwardedPublish {
            id: 10,
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "orders".into(),
            shard: 1,
            generation: 2,
            key: None,
            records: Records::from_payloads([vec![b'x'; 5000], vec![b'y'; 3]]).unwrap(),
            publisher: None,
            acked: false,
        },
    ]
}

/// The answers of the `forward_answer` samples.
fn answers() -> Vec<(u64, ForwardOutcome)> {
    vec![
        (7, ForwardOutcome::Appended { offset: Some(41) }),
        (8, ForwardOutcome::Appended { offset: None }),
        (
            9,
            ForwardOutcome::Refused {
                code: ErrorCode::NotLeader,
                retry: RetryClass::Redirect,
                message: "moved".into(),
            },
        ),
    ]
}

/// A batch's items are the single messages' bodies, byte for byte (D64): `u32 count`, then
/// `u32 len` + body each.
#[test]
fn a_forward_batch_holds_each_forwards_own_body() {
    let singles: Vec<PeerMessage> = forwards().into_iter().map(PeerMessage::Forward).collect();
    let singles_answers: Vec<PeerMessage> =
        answers().into_iter().map(|(id, outcome)| PeerMessage::ForwardAnswer { id, outcome }).collect();
    for (batch, singles, kind) in [
        (PeerMessage::ForwardBatch(forwards()), singles, 15u8),
        (PeerMessage::ForwardAnswers(answers()), singles_answers, 16),
    ] {
        let mut want = BytesMut::new();
        want.put_u32(singles.len() as u32);
        for m in &singles {
            let mut one = BytesMut::new();
            encode(m, &mut one).unwrap();
            want.put_u32(one.len() as u32 - 5);
            want.extend_from_slice(&one[5..]);
        }
        let mut got = BytesMut::new();
        encode(&batch, &mut got).unwrap();
        assert_eq!(got[4], kind);
        assert_eq!(&got[5..], &want[..], "{batch:?}");
    }
}

/// A forwarded payload large enough is handed to the transport as the client's bytes, not
/// copied into the frame (D64), alone or in a batch.
#[test]
fn a_large_forwarded_payload_goes_to_the_transport_uncopied() {
    let list = forwards();
    let raw = list[2].records.raw().clone();
    for m in [PeerMessage::Forward(list[2].clone()), PeerMessage::ForwardBatch(list)] {
        let mut parts = Vec::new();
        encode_chunks(&m, &mut parts).unwrap();
        assert!(parts.iter().any(|p| p.as_ptr() == raw.as_ptr() && p.len() == raw.len()), "{m:?}");
    }
}

/// A snapshot chunk's data goes to the transport as the snapshot's bytes, not copied into the
/// frame, and the pieces are the frame; a chunk past the frame limit is refused as the frame
/// is.
#[test]
fn a_snapshot_chunks_data_goes_to_the_transport_uncopied() {
    let data = Bytes::from(vec![5u8; 256 * 1024]);
    let c = SnapshotChunk {
        shard: ShardId { kind: Kind::Cache, tenant: "t".into(), namespace: "ns".into(), name: "c".into(), shard: 0 },
        index: 9,
        term: 2,
        total: 1 << 20,
        offset: 0,
        header: Bytes::from_static(b"\x08\x07snap"),
        data: data.clone(),
    };
    let m = PeerMessage::SnapshotChunk(c.clone());
    let mut parts = Vec::new();
    encode_chunks(&m, &mut parts).unwrap();
    assert!(parts.iter().any(|p| p.as_ptr() == data.as_ptr() && p.len() == data.len()), "shared");
    let mut one = BytesMut::new();
    encode(&m, &mut one).unwrap();
    assert_eq!(parts.concat(), one.to_vec());
    let mut d = PeerDecoder::default();
    d.push(&one);
    assert_eq!(d.next_message(), Ok(Some(m)));
    let huge = PeerMessage::SnapshotChunk(SnapshotChunk { data: Bytes::from(vec![0u8; MAX_PEER_FRAME]), ..c });
    assert!(matches!(encode_chunks(&huge, &mut Vec::new()), Err(PeerError::TooLong(_))));
    assert!(matches!(encode(&huge, &mut BytesMut::new()), Err(PeerError::TooLong(_))));
}

/// A batch that claims more items than its bytes could hold, or whose item is cut short
/// or is not a forward, is refused as a whole: nothing in it is handled.
#[test]
fn a_forward_batch_that_does_not_add_up_is_malformed() {
    let frame = |kind: u8, body: &[u8]| {
        let mut f = BytesMut::new();
        f.put_u32(body.len() as u32 + 1);
        f.put_u8(kind);
        f.extend_from_slice(body);
        f
    };
    let mut good = BytesMut::new();
    encode(&PeerMessage::ForwardBatch(forwards()), &mut good).unwrap();
    let body = good.split_off(5);
    for kind in [15u8, 16] {
        let lie = [0u8, 0x10, 0, 0, 0, 0, 0, 1, 7];
        let cut = &body[..body.len() - 3];
        let mut not_a_forward = BytesMut::new();
        not_a_forward.put_u32(2);
        not_a_forward.put_u32(3);
        not_a_forward.extend_from_slice(b"abc");
        not_a_forward.put_u32(0);
        for bad in [&lie[..], cut, &not_a_forward[..]] {
            let mut d = PeerDecoder::default();
            d.push(&frame(kind, bad));
            assert!(matches!(d.next_message(), Err(PeerError::Malformed(_))), "kind {kind}: {bad:?}");
        }
    }
}

fn sessions() -> ShardId {
    ShardId { kind: Kind::Cache, tenant: "t1".into(), namespace: "default".into(), name: "sessions".into(), shard: 0 }
}

#[test]
fn a_copy_answer_whose_body_is_not_for_its_shards_kind_does_not_encode() {
    let cache = CopyBody::Cache { tail: 1, cutting: false, full: true, records: Vec::new(), counters: Vec::new() };
    let batches =
        CopyBody::Batches { start: 0, tail: 0, cutting: false, batches: Vec::new(), state: None, groups: None };
    for (shard, body) in [(orders(0), cache), (sessions(), batches)] {
        let m = PeerMessage::CopyAnswer(CopyAnswer { shard, body });
        assert!(matches!(encode(&m, &mut BytesMut::new()), Err(PeerError::Mismatched(_))), "{m:?}");
    }
}

#[test]
fn a_cache_copy_answer_claiming_more_records_than_it_holds_is_malformed() {
    // kind 13, the shard, status 0, tail, cutting, full, then 1,000,000 records of which
    // none is there.
    let mut body = BytesMut::new();
    put_stream_shard(&mut body, &sessions()).unwrap();
    body.put_u8(0);
    body.put_u64(5);
    body.put_u8(0);
    body.put_u8(1);
    body.put_u32(1_000_000);
    let mut frame = BytesMut::new();
    frame.put_u32(body.len() as u32 + 1);
    frame.put_u8(13);
    frame.extend_from_slice(&body);
    let mut d = PeerDecoder::default();
    d.push(&frame);
    assert!(matches!(d.next_message(), Err(PeerError::Malformed(_))));
}

/// A moving shard's groups (D65) are written to the new owner's `$groups` log as they come:
/// a record that is not a `$groups` checkpoint record (an ack, bytes of nothing) makes the
/// answer malformed, and a count past what the frame holds too.
#[test]
fn a_copy_answer_whose_groups_are_not_group_records_is_malformed() {
    let (reset, state) = crate::broker::group_record_samples();
    for (groups, ok) in [
        (vec![reset.clone(), state.clone()], true),
        (vec![reset.clone(), Bytes::from_static(b"\x01\x00\x01g\x00\x00\x00\x00\x00\x00\x00\x05")], false),
        (vec![Bytes::from_static(b"")], false),
        (vec![Bytes::from_static(&[99])], false),
    ] {
        let m = PeerMessage::CopyAnswer(CopyAnswer {
            shard: orders(0),
            body: CopyBody::Batches {
                start: 0,
                tail: 3,
                cutting: true,
                batches: Vec::new(),
                state: None,
                groups: Some(groups),
            },
        });
        let mut bytes = BytesMut::new();
        encode(&m, &mut bytes).unwrap();
        let mut d = PeerDecoder::default();
        d.push(&bytes);
        match d.next_message() {
            Ok(Some(back)) => assert!(ok && back == m, "{back:?}"),
            other => assert!(!ok && matches!(other, Err(PeerError::Malformed(_))), "{other:?}"),
        }
    }
    // Status 4 claiming a million groups, none there.
    let mut body = BytesMut::new();
    put_stream_shard(&mut body, &orders(0)).unwrap();
    body.put_u8(4);
    body.put_u64(0);
    body.put_u64(3);
    body.put_u8(1);
    body.put_u32(1_000_000);
    let mut frame = BytesMut::new();
    frame.put_u32(body.len() as u32 + 1);
    frame.put_u8(11);
    frame.extend_from_slice(&body);
    let mut d = PeerDecoder::default();
    d.push(&frame);
    assert!(matches!(d.next_message(), Err(PeerError::Malformed(_))));
}

fn orders(shard: u32) -> ShardId {
    ShardId { kind: Kind::Stream, tenant: "t1".into(), namespace: "default".into(), name: "orders".into(), shard }
}

#[test]
fn every_message_round_trips_whatever_the_chunking() {
    let mut all = BytesMut::new();
    for m in samples() {
        encode(&m, &mut all).unwrap();
    }
    for chunk in [1, 3, 7, 64, all.len()] {
        let mut d = PeerDecoder::default();
        let mut got = Vec::new();
        for piece in all.chunks(chunk) {
            d.push(piece);
            while let Some(m) = d.next_message().unwrap() {
                got.push(m);
            }
        }
        assert_eq!(got, samples(), "chunks of {chunk}");
    }
}

#[test]
fn pieces_are_the_same_bytes_as_one_frame() {
    for m in samples() {
        let mut one = BytesMut::new();
        encode(&m, &mut one).unwrap();
        let mut parts = Vec::new();
        encode_chunks(&m, &mut parts).unwrap();
        let joined: Vec<u8> = parts.iter().flat_map(|p| p.iter().copied()).collect();
        assert_eq!(joined, one.to_vec(), "{m:?}");
    }
}

#[test]
fn bad_frames_are_errors() {
    let mut d = PeerDecoder::default();
    d.push(&[0xFF, 0xFF, 0xFF, 0xFF]);
    assert!(matches!(d.next_message(), Err(PeerError::TooLong(_))));
    let mut d = PeerDecoder::default();
    d.push(&[0, 0, 0, 1, 99]);
    assert_eq!(d.next_message(), Err(PeerError::UnknownKind(99)));
    let mut d = PeerDecoder::default();
    d.push(&[0, 0, 0, 3, 1, 0, 5]);
    assert!(matches!(d.next_message(), Err(PeerError::Malformed(_))));
}

proptest! {
    /// Arbitrary bytes never panic the decoder.
    #[test]
    fn arbitrary_bytes_never_panic(data in proptest::collection::vec(any::<u8>(), 0..200)) {
        let mut d = PeerDecoder::default();
        d.push(&data);
        for _ in 0..8 {
            match d.next_message() {
                Ok(Some(_)) => continue,
                _ => break,
            }
        }
    }
}
