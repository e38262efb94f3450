//! Conformance vectors.
//!
//! * `vectors/` (ours) is generated from `felix_proto::samples` plus hand-built negative cases;
//!   `committed_vectors_are_current` fails when the files and the generator disagree. Run with
//!   `FELIX_BLESS=1` to rewrite them after an intended change, then review the diff.
//! * Both `vectors/` and upstream's published vectors, vendored unchanged in `vectors/upstream/`
//!   (`.ci/run` checks they still equal `../shared/vectors-upstream` when that is beside the
//!   repository), must pass the conformance checker byte for byte. Nothing here reads a file
//!   outside the repository.

use bytes::BytesMut;
use felix_proto::binary::{EventBatch, PublishAck, PublishBatch};
use felix_proto::conformance::{check_vector, to_hex};
use felix_proto::flags::Flags;
use felix_proto::frame::FrameHeader;
use felix_proto::message::{Direction, Message};
use felix_proto::samples;
use serde_json::{Map, Value, json};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn upstream_dir() -> PathBuf {
    repo().join("vectors/upstream")
}

struct Vector {
    desc: Map<String, Value>,
    frame: Vec<u8>,
}

fn with_frame(mut desc: Map<String, Value>, frame: &[u8]) -> Vector {
    if frame.len() >= 12 {
        desc.insert("payload_hex".into(), Value::String(to_hex(&frame[12..])));
    }
    desc.insert("frame_hex".into(), Value::String(to_hex(frame)));
    Vector { desc, frame: frame.to_vec() }
}

fn obj(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => unreachable!("json! object"),
    }
}

fn json_vector(name: &str, m: &Message, note: Option<&str>) -> Vector {
    let mut frame = BytesMut::new();
    m.encode(&mut frame).expect("sample encodes");
    let dir = match m.direction() {
        Direction::ToBroker => "client_to_broker",
        Direction::ToClient => "broker_to_client",
        Direction::Both => "both",
    };
    let mut d = obj(json!({
        "name": name,
        "kind": "json_message",
        "type": m.type_name(),
        "direction": dir,
        "payload_json": String::from_utf8(m.to_json().expect("sample encodes")).expect("JSON is UTF-8"),
    }));
    if let Some(n) = note {
        d.insert("note".into(), Value::String(n.into()));
    }
    with_frame(d, &frame)
}

fn bytes_desc(d: &mut Map<String, Value>, base: &str, b: &[u8]) {
    match std::str::from_utf8(b) {
        Ok(s) => d.insert(format!("{base}_utf8"), Value::String(s.into())),
        Err(_) => d.insert(format!("{base}_hex"), Value::String(to_hex(b))),
    };
}

fn publish_vector(name: &str, b: &PublishBatch) -> Vector {
    let mut frame = BytesMut::new();
    b.encode(&mut frame).expect("sample encodes");
    let kind = if b.acked.is_some() { "binary_acked_publish_batch" } else { "binary_publish_batch" };
    let mut d = obj(json!({"name": name, "kind": kind, "flags": b.flags().bits()}));
    if let Some(a) = &b.acked {
        d.insert("request_id".into(), json!(a.request_id));
        d.insert("ack_mode".into(), serde_json::to_value(a.ack_mode).expect("enum"));
    }
    if let Some(i) = &b.idempotent {
        d.insert("producer_id".into(), json!(i.producer_id));
        d.insert("sequence".into(), json!(i.sequence));
    }
    if let Some(k) = &b.key {
        bytes_desc(&mut d, "key", k);
    }
    d.insert("tenant_id".into(), json!(b.tenant_id));
    d.insert("namespace".into(), json!(b.namespace));
    d.insert("stream".into(), json!(b.stream));
    let payloads: Vec<String> =
        b.records.payloads().map(|p| String::from_utf8(p.to_vec()).expect("utf8 samples")).collect();
    d.insert("payloads_utf8".into(), json!(payloads));
    packed_desc(&mut d, &b.records, b.flags_hi().bits());
    with_frame(d, &frame)
}

/// A compressed block's codec, second flag word and compressed bytes (D56).
fn packed_desc(d: &mut Map<String, Value>, records: &felix_proto::Records, flags_hi: u16) {
    if flags_hi != 0 {
        d.insert("flags_hi".into(), json!(flags_hi));
    }
    if let Some(e) = records.envelope() {
        d.insert("envelope_hex".into(), json!(to_hex(e)));
    }
    if let Some(p) = records.packed() {
        d.insert("codec".into(), json!(p.codec.name()));
        d.insert("raw_len".into(), json!(records.plain_len()));
        d.insert("compressed_hex".into(), json!(to_hex(&p.data)));
    }
}

fn ack_vector(name: &str, a: &PublishAck) -> Vector {
    let mut frame = BytesMut::new();
    let flags = a.encode(Flags::KNOWN, &mut frame).expect("sample encodes");
    let status = match a.status {
        felix_proto::binary::AckStatus::Ok => "ok",
        felix_proto::binary::AckStatus::Error => "error",
    };
    let mut d = obj(json!({
        "name": name, "kind": "binary_publish_ack", "flags": flags.bits(), "status": status,
        "request_id": a.request_id,
        "message": if a.message.is_empty() { Value::Null } else { json!(a.message) },
    }));
    if let Some((code, retry)) = &a.code {
        d.insert("code".into(), json!(code.name()));
        d.insert("code_number".into(), json!(code.number()));
        d.insert("retry".into(), json!(retry.name()));
        d.insert("retry_number".into(), json!(retry.number()));
    }
    if let Some(det) = &a.detail {
        d.insert("detail".into(), serde_json::to_value(det).expect("detail"));
    }
    if let Some(o) = &a.owner {
        let mut m = obj(json!({"node_id": o.node_id, "generation": o.generation}));
        if let Some(addr) = &o.addr {
            m.insert("addr".into(), json!(addr));
        }
        d.insert("owner".into(), Value::Object(m));
    }
    if let Some(o) = a.offset {
        d.insert("offset".into(), json!(o));
    }
    with_frame(d, &frame)
}

fn event_vector(name: &str, e: &EventBatch) -> Vector {
    let mut frame = BytesMut::new();
    e.encode(&mut frame).expect("sample encodes");
    let mut d = obj(json!({"name": name, "kind": "binary_event_batch", "flags": e.flags().bits()}));
    for (k, v) in
        [("subscription_id", e.subscription_id), ("base_offset", e.base_offset), ("skipped_before", e.skipped_before)]
    {
        if let Some(v) = v {
            d.insert(k.into(), json!(v));
        }
    }
    if let Some(p) = &e.publisher {
        bytes_desc(&mut d, "publisher", p);
    }
    let events: Vec<Value> = e
        .records
        .iter()
        .map(|r| {
            let mut m = Map::new();
            if let Some(t) = r.timestamp_micros {
                m.insert("timestamp_micros".into(), json!(t));
            }
            bytes_desc(&mut m, "payload", &r.payload);
            Value::Object(m)
        })
        .collect();
    d.insert("events".into(), Value::Array(events));
    packed_desc(&mut d, &e.records, e.flags_hi().bits());
    with_frame(d, &frame)
}

fn header(flags: u16, len: u32) -> Vec<u8> {
    FrameHeader { flags: Flags(flags), length: len }.to_bytes().to_vec()
}

fn raw_frame(flags: u16, payload: &[u8]) -> Vec<u8> {
    let mut v = header(flags, payload.len() as u32);
    v.extend_from_slice(payload);
    v
}

fn invalid(
    name: &str,
    frame: Vec<u8>,
    stage: &str,
    error: &str,
    fatal: Option<bool>,
    extra: Value,
    note: &str,
) -> Vector {
    let mut expect = obj(json!({"stage": stage, "error": error}));
    if let Some(f) = fatal {
        expect.insert("fatal".into(), json!(f));
    }
    let mut d = obj(json!({"name": name, "kind": "invalid", "expect": expect, "note": note}));
    if let Value::Object(m) = extra {
        d.extend(m);
    }
    with_frame(d, &frame)
}

fn negative_vectors() -> Vec<Vector> {
    let publish_body: Vec<u8> = {
        let mut f = BytesMut::new();
        samples::publish_batches()[0].1.encode(&mut f).expect("encodes");
        f[12..].to_vec()
    };
    let mut bad_magic = raw_frame(0, b"{\"type\":\"ok\"}");
    bad_magic[3] = b'2';
    let mut bad_version = raw_frame(0, b"{\"type\":\"ok\"}");
    bad_version[5] = 2;
    let mut version_zero = raw_frame(0, b"{\"type\":\"ok\"}");
    version_zero[5] = 0;
    let none = Value::Null;
    let mut v = vec![
        invalid("invalid_bad_magic", bad_magic, "frame", "bad_magic", Some(true), none.clone(), "FLX2 instead of FLX1: the stream cannot be trusted; close the connection"),
        invalid("invalid_version_2", bad_version, "frame", "unsupported_version", Some(true), none.clone(), "version stays 1 forever"),
        invalid("invalid_version_0", version_zero, "frame", "unsupported_version", Some(true), none.clone(), "version stays 1 forever"),
        invalid("invalid_frame_too_large_default", header(0, 16 * 1024 * 1024 + 1), "frame", "frame_too_large", Some(true), none.clone(), "refused on the header alone, before buffering: 16 MiB + 1 over the default limit"),
        invalid("invalid_frame_too_large_preauth", raw_frame(0, &[b' '; 17]), "frame", "frame_too_large", Some(true), json!({"max_frame_len": 16}), "a configured limit (here 16 bytes, as a pre-auth cap would be) applies before the payload arrives"),
        invalid("invalid_truncated_header", b"FLX1\x00\x01".to_vec(), "finish", "truncated", Some(true), none.clone(), "the stream ended inside a header"),
        invalid("invalid_truncated_body", { let mut f = header(0, 13); f.extend_from_slice(b"{\"ty"); f }, "finish", "truncated", Some(true), none.clone(), "the stream ended inside a payload"),
        invalid("invalid_flag_bit15", raw_frame(0x8001, &publish_body), "frame", "flag_not_negotiated", Some(false), json!({"accepted_flags": 0x7FFF}), "bit 15 (D56: a second flag word opens the payload) from a peer that did not negotiate it: rejected, never masked; the payload is skipped and the stream continues"),
        invalid("invalid_flag_bit15_on_ack", raw_frame(0x8010, &[0; 13]), "frame", "missing_base_flag", Some(false), none.clone(), "a second flag word exists only on publish batches and shared event batches"),
        invalid("invalid_flags_hi_empty", raw_frame(0x8001, &[&[0u8, 0][..], &publish_body].concat()), "payload", "empty_flags_hi", None, none.clone(), "a frame with nothing in its second word does not carry one (one encoding per value)"),
        invalid("invalid_flags_hi_unknown", raw_frame(0x8001, &[&[0u8, 8][..], &publish_body].concat()), "payload", "unknown_flags_hi", None, none.clone(), "an unknown bit of the second word is refused like one of the first"),
        invalid("invalid_flags_hi_two_codecs", raw_frame(0x8001, &[&[0u8, 3][..], &publish_body].concat()), "payload", "two_codecs", None, none.clone(), "a block has one codec"),
        invalid("invalid_compressed_too_large", raw_frame(0x8001, &[&[0u8, 1, 0, 1, b't', 0, 1, b'n', 0, 1, b's', 0, 0, 0, 1, 0x01, 0, 0, 1][..], &[0x28, 0xb5, 0x2f, 0xfd, 0, 0, 0, 0]].concat()), "payload", "decompressed_too_large", None, none.clone(), "raw_len over the receiver's frame limit (16 MiB + 1 here) is refused before anything is inflated"),
        invalid("invalid_compressed_corrupt", raw_frame(0x8001, &[0, 2, 0, 1, b't', 0, 1, b'n', 0, 1, b's', 0, 0, 0, 1, 0, 0, 0, 9, 0xff, 0xff]), "payload", "corrupt_compressed_block", None, none.clone(), "bytes that do not inflate to exactly raw_len"),
        invalid("invalid_envelope_past_end", raw_frame(0x8001, &[0, 4, 0, 1, b't', 0, 1, b'n', 0, 1, b's', 0, 9, 1, 1]), "payload", "incomplete", None, none.clone(), "envelope_len past the end of the frame (D58)"),
        invalid("invalid_compressed_empty", raw_frame(0x8001, &[0, 2, 0, 1, b't', 0, 1, b'n', 0, 1, b's', 0, 0, 0, 0, 0, 0, 0, 0]), "payload", "empty_compressed_block", None, none.clone(), "a compressed block holds at least one record"),
        invalid("invalid_compressed_count_over_raw_len", raw_frame(0x8001, &[0, 2, 0, 1, b't', 0, 1, b'n', 0, 1, b's', 0, 0, 0, 9, 0, 0, 0, 8, 0x80, 0, 0, 0, 0]), "payload", "count_too_large", None, none.clone(), "each record takes at least 4 plain bytes: count is bounded by raw_len before inflating"),
        invalid("invalid_flags_two_kinds_publish_ack", raw_frame(0x0011, &publish_body), "frame", "conflicting_kinds", Some(false), none.clone(), "0x0001 and 0x0010 both select a layout"),
        invalid("invalid_flags_two_kinds_events", raw_frame(0x0006, &[0, 0, 0, 0]), "frame", "conflicting_kinds", Some(false), none.clone(), "0x0002 and 0x0004 both select a layout"),
        invalid("invalid_flags_acked_without_batch", raw_frame(0x0008, &publish_body), "frame", "missing_base_flag", Some(false), none.clone(), "0x0008 modifies 0x0001"),
        invalid("invalid_flags_keyed_without_batch", raw_frame(0x0040, &publish_body), "frame", "missing_base_flag", Some(false), none.clone(), "0x0040 modifies 0x0001"),
        invalid("invalid_flags_idempotent_without_acked", raw_frame(0x0101, &publish_body), "frame", "missing_base_flag", Some(false), none.clone(), "0x0100 modifies 0x0008: an idempotent publish must be acked"),
        invalid("invalid_flags_detail_without_code", raw_frame(0x0410, &[1; 11]), "frame", "missing_base_flag", Some(false), none.clone(), "0x0400 modifies 0x0200"),
        invalid("invalid_flags_owner_without_ack", raw_frame(0x0080, &[0; 11]), "frame", "missing_base_flag", Some(false), none.clone(), "0x0080 modifies 0x0010"),
        invalid("invalid_flags_offset_without_ack", raw_frame(0x1000, &[0; 11]), "frame", "missing_base_flag", Some(false), none.clone(), "0x1000 modifies 0x0010"),
        invalid("invalid_flags_skipped_without_offsets", raw_frame(0x0804, &[0; 12]), "frame", "missing_base_flag", Some(false), none.clone(), "0x0800 modifies 0x0020"),
        invalid("invalid_flags_offsets_without_events", raw_frame(0x0020, &[0; 12]), "frame", "missing_base_flag", Some(false), none.clone(), "0x0020 modifies 0x0002/0x0004"),
        invalid("invalid_flags_publisher_without_events", raw_frame(0x2000, &[0; 5]), "frame", "missing_base_flag", Some(false), none.clone(), "0x2000 modifies 0x0002/0x0004"),
        invalid("invalid_flags_timestamps_without_events", raw_frame(0x4000, &[0; 4]), "frame", "missing_base_flag", Some(false), none.clone(), "0x4000 modifies 0x0002/0x0004"),
        invalid("invalid_flags_not_negotiated_acked", raw_frame(0x0009, &[0; 9]), "frame", "flag_not_negotiated", Some(false), json!({"accepted_flags": 7}), "a broker that advertised only ORIGINAL_V1_FLAGS refuses an acked batch"),
        invalid("invalid_flags_not_negotiated_offsets", raw_frame(0x0024, &[0; 12]), "frame", "flag_not_negotiated", Some(false), json!({"accepted_flags": 0x0016}), "a client that did not offer 0x0020 refuses a batch carrying offsets"),
        invalid("invalid_ack_mode_0", raw_frame(0x0009, &[0, 0, 0, 0, 0, 0, 0, 7, 0]), "payload", "invalid_ack_mode", None, none.clone(), "there is no byte for ack none"),
        invalid("invalid_ack_mode_3", raw_frame(0x0009, &[0, 0, 0, 0, 0, 0, 0, 7, 3]), "payload", "invalid_ack_mode", None, none.clone(), "only 1 and 2 exist"),
        invalid("invalid_ack_status_2", raw_frame(0x0010, &[2, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0]), "payload", "invalid_ack_status", None, none.clone(), "only 0 and 1 exist"),
        invalid("invalid_ack_offset_on_error", raw_frame(0x1010, &[1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]), "payload", "section_for_other_status", None, none.clone(), "0x1000 goes only on successful acks"),
        invalid("invalid_ack_code_on_ok", raw_frame(0x0210, &[0, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 4, 5]), "payload", "section_for_other_status", None, none.clone(), "0x0200 goes only on failed acks"),
        invalid("invalid_publish_count_too_large", raw_frame(0x0001, &[0, 1, b't', 0, 1, b'n', 0, 1, b's', 0xff, 0xff, 0xff, 0xff]), "payload", "count_too_large", None, none.clone(), "count is bounded by the bytes left before anything is allocated"),
        invalid("invalid_publish_payload_len_past_end", raw_frame(0x0001, &[0, 1, b't', 0, 1, b'n', 0, 1, b's', 0, 0, 0, 1, 0, 0, 0, 9, b'x']), "payload", "incomplete", None, none.clone(), "a payload length past the end of the frame"),
        invalid("invalid_publish_tenant_utf8", raw_frame(0x0001, &[0, 2, 0xff, 0xfe, 0, 1, b'n', 0, 1, b's', 0, 0, 0, 0]), "payload", "invalid_utf8", None, none.clone(), "tenant, namespace and stream are UTF-8"),
        invalid("invalid_publish_trailing_bytes", { let mut p = publish_body.clone(); p.push(0); raw_frame(0x0001, &p) }, "payload", "trailing_bytes", None, none.clone(), "bytes after the last record"),
        invalid("invalid_publish_truncated_key", raw_frame(0x0041, &[0, 5, b'k']), "payload", "incomplete", None, none.clone(), "key_len past the end"),
        invalid("invalid_event_publisher_past_end", raw_frame(0x2004, &[9, b'a', 0, 0, 0, 0]), "payload", "incomplete", None, none.clone(), "publisher_len past the end"),
        invalid("invalid_event_timestamp_missing", raw_frame(0x4004, &[0, 0, 0, 1, 0, 0, 0, 0]), "payload", "count_too_large", None, none.clone(), "a timed event needs at least 12 bytes"),
        invalid("invalid_json_syntax", raw_frame(0, b"{\"type\":\"ok\""), "payload", "invalid_json", None, none.clone(), "JSON that does not parse is fatal to the stream"),
        invalid("invalid_json_not_object", raw_frame(0, b"[\"ok\"]"), "payload", "not_an_object", None, none.clone(), "a control message is a JSON object"),
        invalid("invalid_json_missing_type", raw_frame(0, b"{\"request_id\":1}"), "payload", "missing_type", None, none.clone(), "no type field"),
        invalid("invalid_json_missing_field", raw_frame(0, b"{\"type\":\"publish\",\"tenant_id\":\"t1\"}"), "payload", "invalid_fields", None, none.clone(), "a known type with a required field missing"),
        invalid("invalid_json_bad_base64", raw_frame(0, b"{\"type\":\"publish\",\"tenant_id\":\"t1\",\"namespace\":\"d\",\"stream\":\"s\",\"payload\":\"aGVsbG8\"}"), "payload", "invalid_fields", None, none.clone(), "base64 is standard with padding, decoded strictly"),
        invalid("invalid_json_flags_out_of_range", raw_frame(0, b"{\"type\":\"auth\",\"tenant_id\":\"t1\",\"token\":\"x\",\"client_flags\":65536}"), "payload", "invalid_fields", None, none.clone(), "client_flags is a u16"),
    ];
    // Unknown types are not errors: they decode to a distinct result naming the type.
    let unknown = b"{\"type\":\"frobnicate\",\"request_id\":5}";
    let mut d = obj(json!({
        "name": "json_unknown_type", "kind": "json_unknown_type", "type_name": "frobnicate", "request_id": 5,
        "payload_json": std::str::from_utf8(unknown).expect("ascii"),
        "note": "decodes to an unknown type carrying its name and request_id, answered unsupported (FEATURE_UNSUPPORTED) or by closing the stream",
    }));
    d.insert("flags".into(), json!(0));
    v.push(with_frame(d, &raw_frame(0, unknown)));
    v
}

/// Every vector we publish, by name.
fn generate() -> BTreeMap<String, Vector> {
    let mut out = BTreeMap::new();
    let mut add = |name: &str, v: Vector| {
        assert!(out.insert(name.to_owned(), v).is_none(), "duplicate vector name {name}");
    };
    // The spec's list, identical to upstream's vectors.
    let spec_list = [
        ("auth_with_capabilities", r#"{"type":"auth","tenant_id":"t1","token":"demo-token","client_flags":25}"#),
        ("auth_ok", r#"{"type":"auth_ok","server_flags":25}"#),
        (
            "publish",
            r#"{"type":"publish","tenant_id":"t1","namespace":"default","stream":"demo","payload":"aGVsbG8="}"#,
        ),
        ("subscribe", r#"{"type":"subscribe","tenant_id":"t1","namespace":"default","stream":"demo"}"#),
        ("event", r#"{"type":"event","tenant_id":"t1","namespace":"default","stream":"demo","payload":"d29ybGQ="}"#),
        (
            "cache_put",
            r#"{"type":"cache_put","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key","value":"Y2FjaGVk","ttl_ms":1000}"#,
        ),
        (
            "cache_get",
            r#"{"type":"cache_get","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key"}"#,
        ),
        (
            "cache_value",
            r#"{"type":"cache_value","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key","value":"Y2FjaGVk"}"#,
        ),
        ("ok", r#"{"type":"ok"}"#),
        ("error", r#"{"type":"error","message":"oops"}"#),
    ];
    for (name, text) in spec_list {
        let felix_proto::Decoded::Message(m) = felix_proto::message::decode(text.as_bytes()).expect("spec example")
        else {
            panic!("spec example {name} is a known type")
        };
        add(name, json_vector(name, &m, Some("same bytes as the upstream vector of this name")));
    }
    let hello = |k: Option<&str>, acked: bool| {
        let mut b = samples::publish_batches()[0].1.clone();
        b.records = felix_proto::Records::from_payloads(["hello"]).expect("small");
        b.key = k.map(|k| bytes::Bytes::copy_from_slice(k.as_bytes()));
        b.acked = acked.then_some(felix_proto::binary::AckedPrefix {
            request_id: 7,
            ack_mode: felix_proto::binary::AckMode::PerBatch,
        });
        b
    };
    add("binary_publish_keyed", publish_vector("binary_publish_keyed", &hello(Some("k7"), false)));
    add("binary_publish_acked", publish_vector("binary_publish_acked", &hello(None, true)));
    add("binary_publish_acked_keyed", publish_vector("binary_publish_acked_keyed", &hello(Some("k7"), true)));
    add("binary_publish_ack_ok", ack_vector("binary_publish_ack_ok", &PublishAck::ok(7, None)));
    let mut err = PublishAck::ok(9, None);
    err.status = felix_proto::binary::AckStatus::Error;
    err.message = "stream not found".into();
    add("binary_publish_ack_error", ack_vector("binary_publish_ack_error", &err));
    // Every message type, fully populated.
    for m in samples::messages() {
        let name = format!("json_{}", m.type_name());
        add(&name, json_vector(&name, &m, None));
    }
    for (name, m) in samples::message_variants() {
        let name = format!("json_{name}");
        add(&name, json_vector(&name, &m, None));
    }
    for (name, b) in samples::publish_batches() {
        add(name, publish_vector(name, &b));
    }
    for (name, a) in samples::acks() {
        add(name, ack_vector(name, &a));
    }
    for (name, e) in samples::event_batches() {
        add(&name, event_vector(&name, &e));
    }
    for v in negative_vectors() {
        let name = v.desc["name"].as_str().expect("named").to_owned();
        add(&name, v);
    }
    out
}

fn render(v: &Vector) -> (String, String) {
    let json = serde_json::to_string_pretty(&Value::Object(v.desc.clone())).expect("serialises") + "\n";
    (json, to_hex(&v.frame) + "\n")
}

#[test]
fn committed_vectors_are_current() {
    let dir = repo().join("vectors");
    let generated = generate();
    let bless = std::env::var_os("FELIX_BLESS").is_some();
    let mut stale = Vec::new();
    for (name, v) in &generated {
        let (json, hex) = render(v);
        let jp = dir.join(format!("{name}.json"));
        let hp = dir.join(format!("{name}.hex"));
        let same = std::fs::read_to_string(&jp).ok().as_deref() == Some(&json)
            && std::fs::read_to_string(&hp).ok().as_deref() == Some(&hex);
        if !same {
            if bless {
                std::fs::write(&jp, json).expect("write vector");
                std::fs::write(&hp, hex).expect("write vector");
            } else {
                stale.push(name.clone());
            }
        }
    }
    for entry in std::fs::read_dir(&dir).expect("vectors/ exists") {
        let p = entry.expect("dir entry").path();
        let (Some(stem), Some(ext)) = (p.file_stem(), p.extension()) else { continue };
        if (ext == "json" || ext == "hex") && !generated.contains_key(&*stem.to_string_lossy()) {
            if bless {
                std::fs::remove_file(&p).expect("remove stale vector");
            } else {
                stale.push(p.display().to_string());
            }
        }
    }
    assert!(
        stale.is_empty(),
        "vectors out of date (run FELIX_BLESS=1 cargo test -p felix-proto --test vectors): {stale:?}"
    );
}

fn check_dir(dir: &Path) -> (usize, Vec<String>) {
    let mut passed = 0;
    let mut failures = Vec::new();
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.expect("dir entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .collect();
    names.sort();
    for jp in names {
        let json = std::fs::read_to_string(&jp).expect("read json");
        let hex = std::fs::read_to_string(jp.with_extension("hex")).expect("read hex");
        match check_vector(&json, &hex) {
            Ok(()) => passed += 1,
            Err(e) => failures.push(format!("{}: {e}", jp.display())),
        }
    }
    (passed, failures)
}

#[test]
fn our_vectors_pass() {
    let (passed, failures) = check_dir(&repo().join("vectors"));
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(passed, generate().len());
}

#[test]
fn every_upstream_vector_passes_byte_for_byte() {
    let dir = upstream_dir();
    assert!(dir.is_dir(), "upstream vectors expected at {}", dir.display());
    let (passed, failures) = check_dir(&dir);
    assert!(failures.is_empty(), "{failures:#?}");
    assert_eq!(passed, 15);
}

#[test]
fn our_copies_of_the_spec_list_equal_upstream() {
    let ours = generate();
    let dir = upstream_dir();
    for name in [
        "auth_ok",
        "auth_with_capabilities",
        "publish",
        "subscribe",
        "event",
        "cache_put",
        "cache_get",
        "cache_value",
        "ok",
        "error",
        "binary_publish_keyed",
        "binary_publish_acked",
        "binary_publish_acked_keyed",
        "binary_publish_ack_ok",
        "binary_publish_ack_error",
    ] {
        let up = std::fs::read_to_string(dir.join(format!("{name}.hex"))).expect("upstream vector");
        let up = felix_proto::conformance::parse_hex(&up).expect("hex");
        assert_eq!(ours[name].frame, up, "{name}");
    }
}

#[test]
fn every_message_type_has_a_vector() {
    let ours = generate();
    for t in Message::TYPE_NAMES {
        assert!(ours.contains_key(&format!("json_{t}")), "no vector for {t}");
    }
}
