//! The binary frames' samples: publish batches of every flag combination, acks, event batches,
//! and the compressible records they share.

use super::s;
use crate::binary::{
    AckMode, AckStatus, AckedPrefix, Codec, Compressor, ErrorDetail, EventBatch, IdempotentPrefix, OwnerHint,
    PublishAck, PublishBatch, Records,
};
use crate::error_code::{ErrorCode, RetryClass};
use bytes::Bytes;

fn records(payloads: &[&str]) -> Records {
    Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).expect("small payloads")
}

/// Four JSON-like records, alike enough to compress.
pub const COMPRESSIBLE: [&str; 4] = [
    r#"{"user":"alice","action":"click","page":"/home","ms":120}"#,
    r#"{"user":"alice","action":"click","page":"/cart","ms":95}"#,
    r#"{"user":"bob","action":"click","page":"/home","ms":130}"#,
    r#"{"user":"alice","action":"click","page":"/home","ms":118}"#,
];

/// [`COMPRESSIBLE`] compressed with `codec` at its default level (D56).
pub fn packed_records(codec: Codec) -> Records {
    let mut c = Compressor::new(codec, codec.default_level()).expect("the default level is valid");
    let r = records(&COMPRESSIBLE).compressed(&mut c);
    debug_assert!(r.packed().is_some(), "the sample shrinks");
    r
}

/// Every publish-batch flag combination: 0x0001, 0x0041, 0x0009 (both modes), 0x0049, 0x0109,
/// 0x0149.
pub fn publish_batches() -> Vec<(&'static str, PublishBatch)> {
    let base = |acked, idempotent, key: Option<&str>| PublishBatch {
        acked,
        idempotent,
        key: key.map(|k| Bytes::copy_from_slice(k.as_bytes())),
        tenant_id: s("t1"),
        namespace: s("default"),
        stream: s("demo"),
        records: records(&["hello", "world"]),
    };
    let acked = |mode| Some(AckedPrefix { request_id: 7, ack_mode: mode });
    let idem = Some(IdempotentPrefix { producer_id: 0x1234_5678_9abc_def0, sequence: 3 });
    let mut empty = base(None, None, None);
    empty.records = Records::default();
    vec![
        ("binary_publish_plain", base(None, None, None)),
        ("binary_publish_plain_empty_batch", empty),
        ("binary_publish_keyed_two", base(None, None, Some("customer-1"))),
        ("binary_publish_keyed_empty_key", base(None, None, Some(""))),
        ("binary_publish_acked_per_message", base(acked(AckMode::PerMessage), None, None)),
        ("binary_publish_acked_per_batch", base(acked(AckMode::PerBatch), None, None)),
        ("binary_publish_acked_keyed_two", base(acked(AckMode::PerBatch), None, Some("customer-1"))),
        ("binary_publish_idempotent", base(acked(AckMode::PerBatch), idem, None)),
        ("binary_publish_idempotent_keyed", base(acked(AckMode::PerBatch), idem, Some("customer-1"))),
        ("binary_publish_zstd", PublishBatch { records: packed_records(Codec::Zstd), ..base(None, None, None) }),
        (
            "binary_publish_envelope",
            PublishBatch {
                records: records(&["\u{1}sealed-one", "\u{1}sealed-two"])
                    .with_envelope(Some(Bytes::from_static(b"\x01\x01\x06key-07"))),
                ..base(acked(AckMode::PerBatch), None, Some("customer-1"))
            },
        ),
        (
            "binary_publish_zstd_envelope",
            PublishBatch {
                records: packed_records(Codec::Zstd).with_envelope(Some(Bytes::from_static(b"\x01\x01\x06key-07"))),
                ..base(None, None, None)
            },
        ),
        (
            "binary_publish_lz4_idempotent_keyed",
            PublishBatch {
                records: packed_records(Codec::Lz4),
                ..base(acked(AckMode::PerBatch), idem, Some("customer-1"))
            },
        ),
    ]
}

/// Every publish-ack shape: success with any of owner/offset, failure with any of code,
/// code+detail, owner.
pub fn acks() -> Vec<(&'static str, PublishAck)> {
    let owner = || Some(OwnerHint { node_id: s("broker-b"), addr: Some(s("10.0.0.5:5000")), generation: 9 });
    let ok = |offset, owner| PublishAck {
        status: AckStatus::Ok,
        request_id: 7,
        message: s(""),
        code: None,
        detail: None,
        owner,
        offset,
    };
    let err = |code: bool, detail: bool, owner| PublishAck {
        status: AckStatus::Error,
        request_id: 9,
        message: s("shard is moving"),
        code: code.then_some((ErrorCode::ShardUnavailable, RetryClass::Retry)),
        detail: detail.then(|| ErrorDetail { reason: Some(s("moving")), retry_after_ms: Some(250) }),
        owner,
        offset: None,
    };
    let mut stale = err(true, false, None);
    stale.code = Some((ErrorCode::StaleWidth, RetryClass::Retry));
    stale.message = s("stream has 4 shards, batch was routed by 8");
    let mut no_addr = ok(None, owner());
    if let Some(o) = no_addr.owner.as_mut() {
        o.addr = None;
    }
    let mut detail_empty = err(true, true, None);
    detail_empty.detail = Some(ErrorDetail::default());
    vec![
        ("binary_ack_ok_offset", ok(Some(100), None)),
        ("binary_ack_ok_owner", ok(None, owner())),
        ("binary_ack_ok_owner_no_addr", no_addr),
        ("binary_ack_ok_owner_offset", ok(Some(100), owner())),
        ("binary_ack_error_code", err(true, false, None)),
        ("binary_ack_error_code_detail", err(true, true, None)),
        ("binary_ack_error_detail_empty", detail_empty),
        ("binary_ack_error_owner", err(false, false, owner())),
        ("binary_ack_error_code_owner", err(true, false, owner())),
        ("binary_ack_error_code_detail_owner", err(true, true, owner())),
        ("binary_ack_error_stale_width", stale),
    ]
}

/// Every event-batch flag combination: legacy (0x0002) and shared (0x0004), each with no
/// offsets / offsets / offsets+skipped, with and without publisher, with and without timestamps.
pub fn event_batches() -> Vec<(String, EventBatch)> {
    let mut out = Vec::new();
    for legacy in [true, false] {
        for offsets in 0..3 {
            for publisher in [false, true] {
                for timed in [false, true] {
                    let mut name = String::from(if legacy { "binary_event_legacy" } else { "binary_event_shared" });
                    match offsets {
                        1 => name.push_str("_offsets"),
                        2 => name.push_str("_offsets_skipped"),
                        _ => {}
                    }
                    if publisher {
                        name.push_str("_publisher");
                    }
                    if timed {
                        name.push_str("_timestamps");
                    }
                    let plain = records(&["alpha", "beta"]);
                    out.push((
                        name,
                        EventBatch {
                            subscription_id: legacy.then_some(42),
                            base_offset: (offsets > 0).then_some(100),
                            skipped_before: (offsets == 2).then_some(1),
                            publisher: publisher.then(|| Bytes::from_static(b"alice")),
                            records: if timed { plain.with_timestamp(1_760_000_000_000_000) } else { plain },
                        },
                    ));
                }
            }
        }
    }
    // Compressed (D56): the shared form only, as a publisher's block was stored.
    out.push((
        "binary_event_shared_offsets_zstd".into(),
        EventBatch {
            subscription_id: None,
            base_offset: Some(100),
            skipped_before: None,
            publisher: None,
            records: packed_records(Codec::Zstd),
        },
    ));
    out.push((
        "binary_event_shared_offsets_envelope".into(),
        EventBatch {
            subscription_id: None,
            base_offset: Some(100),
            skipped_before: None,
            publisher: None,
            records: records(&["\u{1}sealed-one"]).with_envelope(Some(Bytes::from_static(b"\x01\x01\x06key-07"))),
        },
    ));
    out.push((
        "binary_event_shared_offsets_skipped_publisher_timestamps_lz4".into(),
        EventBatch {
            subscription_id: None,
            base_offset: Some(100),
            skipped_before: Some(1),
            publisher: Some(Bytes::from_static(b"alice")),
            records: packed_records(Codec::Lz4).with_timestamp(1_760_000_000_000_000),
        },
    ));
    out
}
