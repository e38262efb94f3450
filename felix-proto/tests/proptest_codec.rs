//! Property tests for the codec: encode → decode round trips for every layout and for JSON
//! messages with arbitrary contents, and the frame decoder under arbitrary input and chunking.

use bytes::{Bytes, BytesMut};
use felix_proto::binary::{
    AckMode, AckStatus, AckedPrefix, ErrorDetail, EventBatch, IdempotentPrefix, OwnerHint, PublishAck, PublishBatch,
};
use felix_proto::error_code::{ErrorCode, RetryClass};
use felix_proto::flags::Flags;
use felix_proto::frame::{Frame, FrameDecoder, FrameError, HEADER_LEN};
use felix_proto::message::{self, B64, Decoded, Message};
use felix_proto::{Payload, Records};
use proptest::prelude::*;

fn text() -> impl Strategy<Value = String> {
    prop_oneof![
        "[a-z0-9._-]{0,12}",
        any::<String>().prop_map(|s| s.chars().take(24).collect()),
        Just(String::from("quote\" backslash\\ newline\n nul\u{0} emoji\u{1F600}")),
    ]
}

fn blob(max: usize) -> impl Strategy<Value = Bytes> {
    prop::collection::vec(any::<u8>(), 0..max).prop_map(Bytes::from)
}

fn records(timed: bool) -> impl Strategy<Value = Records> {
    prop::collection::vec((any::<u64>(), blob(48)), 0..8).prop_map(move |items| {
        if timed {
            Records::from_timed(items).expect("small")
        } else {
            Records::from_payloads(items.into_iter().map(|(_, p)| p)).expect("small")
        }
    })
}

fn publish_batch() -> impl Strategy<Value = PublishBatch> {
    (
        prop::option::of((any::<u64>(), prop_oneof![Just(AckMode::PerMessage), Just(AckMode::PerBatch)])),
        prop::option::of((any::<u64>(), any::<u64>())),
        prop::option::of(blob(16)),
        (text(), text(), text()),
        records(false),
    )
        .prop_map(|(acked, idem, key, (tenant_id, namespace, stream), records)| {
            let acked = acked.map(|(request_id, ack_mode)| AckedPrefix { request_id, ack_mode });
            // An idempotent prefix only goes with an acked one.
            let idempotent = acked.and(idem).map(|(producer_id, sequence)| IdempotentPrefix { producer_id, sequence });
            PublishBatch { acked, idempotent, key, tenant_id, namespace, stream, records }
        })
}

fn ack() -> impl Strategy<Value = PublishAck> {
    let nonempty = || prop::option::of(text().prop_filter("non-empty", |s| !s.is_empty()));
    (
        any::<bool>(),
        any::<u64>(),
        text(),
        prop::option::of((1u16.., prop::sample::select(RetryClass::ALL.to_vec()))),
        prop::option::of((nonempty(), prop::option::of(1u64..))),
        prop::option::of((text(), nonempty(), any::<u64>())),
        prop::option::of(any::<u64>()),
    )
        .prop_map(|(ok, request_id, message, code, detail, owner, offset)| {
            let status = if ok { AckStatus::Ok } else { AckStatus::Error };
            let code = code.filter(|_| !ok).map(|(n, r)| (ErrorCode::from_number(n), r));
            let detail = detail
                .filter(|_| code.is_some())
                .map(|(reason, retry_after_ms)| ErrorDetail { reason, retry_after_ms });
            PublishAck {
                status,
                request_id,
                message: if ok { String::new() } else { message },
                code,
                detail,
                owner: owner.map(|(node_id, addr, generation)| OwnerHint { node_id, addr, generation }),
                offset: offset.filter(|_| ok),
            }
        })
}

fn event_batch() -> impl Strategy<Value = EventBatch> {
    (
        prop::option::of(any::<u64>()),
        prop::option::of((any::<u64>(), prop::option::of(any::<u64>()))),
        prop::option::of(blob(255)),
        any::<bool>().prop_flat_map(records),
    )
        .prop_map(|(subscription_id, offsets, publisher, records)| EventBatch {
            subscription_id,
            base_offset: offsets.map(|(b, _)| b),
            skipped_before: offsets.and_then(|(_, s)| s),
            publisher,
            records,
        })
}

fn decode_frame(bytes: &[u8]) -> Frame {
    let mut d = FrameDecoder::new();
    d.push(Bytes::copy_from_slice(bytes));
    let f = d.next_frame().expect("valid frame").expect("whole frame");
    assert_eq!(d.buffered(), 0);
    f
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn publish_batch_round_trips(b in publish_batch()) {
        let mut out = BytesMut::new();
        b.encode(&mut out).unwrap();
        prop_assert_eq!(out.len(), HEADER_LEN + b.encoded_payload_len());
        let f = decode_frame(&out);
        prop_assert_eq!(f.flags, b.flags());
        prop_assert_eq!(f.decode_payload().unwrap(), Payload::Publish(b.clone()));
        if let Some(a) = b.acked {
            prop_assert_eq!(PublishBatch::peek_request_id(f.flags, &f.payload), Some(a.request_id));
        }
    }

    #[test]
    fn ack_round_trips(a in ack()) {
        let mut out = BytesMut::new();
        let flags = a.encode(Flags::KNOWN, &mut out).unwrap();
        let f = decode_frame(&out);
        prop_assert_eq!(f.flags, flags);
        prop_assert_eq!(f.decode_payload().unwrap(), Payload::Ack(a));
    }

    #[test]
    fn ack_restricted_to_an_old_client_is_the_plain_ack(a in ack()) {
        let mut out = BytesMut::new();
        let flags = a.encode(Flags::ORIGINAL_V1, &mut out).unwrap();
        prop_assert_eq!(flags, Flags::BINARY_PUBLISH_ACK);
        let Payload::Ack(back) = decode_frame(&out).decode_payload().unwrap() else { unreachable!() };
        prop_assert_eq!((back.status, back.request_id, &back.message), (a.status, a.request_id, &a.message));
        prop_assert!(back.code.is_none() && back.detail.is_none() && back.owner.is_none() && back.offset.is_none());
    }

    #[test]
    fn event_batch_round_trips(e in event_batch()) {
        let mut out = BytesMut::new();
        e.encode(&mut out).unwrap();
        let [head, body] = e.encode_parts().unwrap();
        prop_assert_eq!(&out[..head.len()], &head[..]);
        prop_assert_eq!(&out[head.len()..], &body[..]);
        let f = decode_frame(&out);
        prop_assert_eq!(f.flags, e.flags());
        prop_assert_eq!(f.decode_payload().unwrap(), Payload::Events(e));
    }

    #[test]
    fn restricting_an_event_batch_never_sets_an_unoffered_bit(e in event_batch(), offered in any::<u16>()) {
        let offered = Flags(offered);
        let r = e.restricted_to(offered, felix_proto::FlagsHi::EMPTY);
        let extra = r.flags().difference(offered).difference(Flags::BINARY_EVENT_BATCH | Flags::BINARY_EVENT_BATCH_SHARED);
        prop_assert!(extra.is_empty(), "{:?} offered {:?}", r.flags(), offered);
        prop_assert_eq!(r.records.payloads().collect::<Vec<_>>(), e.records.payloads().collect::<Vec<_>>());
    }

    #[test]
    fn json_publish_round_trips(
        (tenant_id, namespace, stream) in (text(), text(), text()),
        payload in blob(300),
        key in prop::option::of(blob(20)),
        request_id in prop::option::of(any::<u64>()),
        shard in prop::option::of(any::<u32>()),
    ) {
        let m = Message::Publish(message::Publish {
            tenant_id, namespace, stream, payload: B64(payload), key: key.map(B64), shard, request_id,
            ack: request_id.map(|_| AckMode::PerBatch), publish_width: None,
        });
        let json = m.to_json().unwrap();
        prop_assert_eq!(message::decode(&json).unwrap(), Decoded::Message(m));
    }

    #[test]
    fn json_cache_and_error_round_trip(key in text(), value in blob(64), ttl in prop::option::of(any::<u64>()),
                                       msg in text(), code in prop::option::of(1u16..)) {
        let put = Message::CachePut(message::CachePut {
            tenant_id: "t".into(), namespace: "n".into(), cache: "c".into(), key, value: B64(value),
            request_id: None, ttl_ms: ttl,
        });
        let json = put.to_json().unwrap();
        prop_assert_eq!(message::decode(&json).unwrap(), Decoded::Message(put));
        let err = Message::Error(message::ErrorMsg {
            message: msg, code: code.map(ErrorCode::from_number), retry: code.map(|_| RetryClass::Retry), detail: None,
        });
        let json = err.to_json().unwrap();
        prop_assert_eq!(message::decode(&json).unwrap(), Decoded::Message(err));
    }

    #[test]
    fn decoder_survives_anything_in_any_chunking(
        data in prop::collection::vec(any::<u8>(), 0..600),
        valid in prop::collection::vec(publish_batch(), 0..4),
        cuts in prop::collection::vec(1usize..40, 1..30),
        max in 0u32..400,
    ) {
        // Mix well-formed frames with arbitrary bytes.
        let mut stream = BytesMut::new();
        for b in &valid {
            b.encode(&mut stream).unwrap();
        }
        stream.extend_from_slice(&data);
        let run = |pieces: &[&[u8]]| {
            let mut d = FrameDecoder::new();
            d.set_max_frame_len(max);
            let mut out: Vec<Result<Frame, FrameError>> = Vec::new();
            for p in pieces {
                d.push(Bytes::copy_from_slice(p));
                loop {
                    match d.next_frame() {
                        Ok(Some(f)) => {
                            assert!(f.payload.len() <= max as usize, "frame longer than the limit");
                            let _ = f.decode_payload();
                            out.push(Ok(f));
                        }
                        Ok(None) => break,
                        Err(e) => {
                            let fatal = e.is_fatal();
                            out.push(Err(e));
                            if fatal { break; }
                        }
                    }
                }
                if d.is_poisoned() { break; }
            }
            let _ = d.finish();
            out
        };
        let mut pieces: Vec<&[u8]> = Vec::new();
        let mut at = 0;
        for c in cuts.iter().cycle() {
            if at >= stream.len() { break; }
            let end = (at + c).min(stream.len());
            pieces.push(&stream[at..end]);
            at = end;
        }
        prop_assert_eq!(run(&pieces), run(&[&stream[..]]));
    }

    #[test]
    fn json_decode_never_panics(data in prop::collection::vec(any::<u8>(), 0..200)) {
        felix_proto::fuzzing::json_message(&data);
    }

    #[test]
    fn binary_payloads_never_panic(data in prop::collection::vec(any::<u8>(), 0..200)) {
        felix_proto::fuzzing::binary_payload(&data);
    }
}

#[test]
fn every_sample_message_round_trips() {
    for m in felix_proto::samples::messages()
        .into_iter()
        .chain(felix_proto::samples::message_variants().into_iter().map(|(_, m)| m))
    {
        let json = m.to_json().unwrap();
        assert_eq!(message::decode(&json).unwrap(), Decoded::Message(m.clone()), "{}", m.type_name());
        let mut frame = BytesMut::new();
        m.encode(&mut frame).unwrap();
        assert_eq!(decode_frame(&frame).decode_payload().unwrap(), Payload::Json(Decoded::Message(m)));
    }
}
