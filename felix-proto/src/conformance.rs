//! Conformance vectors: checking one `NAME.json` + `NAME.hex` pair.
//!
//! This module is pure: callers read the files and hand over their text. The format is
//! described in `vectors/README.md`; in short, `kind` selects how a vector is checked:
//!
//! * absent or `json_message`: `payload_json` is the canonical payload. The frame must decode to
//!   the same message as `payload_json`, and re-encode to exactly the frame bytes.
//! * `json_unknown_type`: the payload must decode to an unknown type named `type_name`.
//! * `binary_publish_batch` / `binary_acked_publish_batch`, `binary_publish_ack`,
//!   `binary_event_batch`: the described fields are built into a value, which must equal what
//!   the frame decodes to and must encode to exactly the frame bytes.
//! * `invalid`: the frame must fail at `expect.stage` (`frame`, `payload` or `finish`) with the
//!   error kind `expect.error`.

use crate::binary::{
    AckMode, AckStatus, AckedPrefix, Codec, ErrorDetail, EventBatch, IdempotentPrefix, OwnerHint, PublishAck,
    PublishBatch, Records,
};
use crate::error_code::{ErrorCode, RetryClass};
use crate::flags::Flags;
use crate::frame::{Frame, FrameDecoder, FrameError, HEADER_LEN};
use crate::message::{self, Decoded};
use crate::payload::Payload;
use bytes::{Bytes, BytesMut};
use serde_json::{Map, Value};

/// Why a vector failed: one line per problem found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", .0.join("; "))]
pub struct VectorFailure(pub Vec<String>);

fn fail<T>(msg: impl Into<String>) -> Result<T, VectorFailure> {
    Err(VectorFailure(vec![msg.into()]))
}

/// Parses lowercase or uppercase hex, ignoring whitespace.
///
/// # Errors
/// A non-hex character or an odd number of digits.
pub fn parse_hex(s: &str) -> Result<Vec<u8>, VectorFailure> {
    let digits: Vec<u8> = s.bytes().filter(|b| !b.is_ascii_whitespace()).collect();
    if !digits.len().is_multiple_of(2) {
        return fail("hex has an odd number of digits");
    }
    let val = |c: u8| -> Result<u8, VectorFailure> {
        match c {
            b'0'..=b'9' => Ok(c - b'0'),
            b'a'..=b'f' => Ok(c - b'a' + 10),
            b'A'..=b'F' => Ok(c - b'A' + 10),
            _ => fail(format!("not a hex digit: {:?}", c as char)),
        }
    };
    digits.chunks(2).map(|p| Ok(val(p[0])? << 4 | val(p[1])?)).collect()
}

/// Lowercase hex of bytes.
pub fn to_hex(b: &[u8]) -> String {
    use std::fmt::Write;
    b.iter().fold(String::with_capacity(b.len() * 2), |mut s, x| {
        let _ = write!(s, "{x:02x}");
        s
    })
}

/// Checks one vector given the text of its `.json` and `.hex` files.
///
/// # Errors
/// Every mismatch found.
pub fn check_vector(json_text: &str, hex_text: &str) -> Result<(), VectorFailure> {
    let desc: Value = serde_json::from_str(json_text).or_else(|e| fail(format!("vector JSON: {e}")))?;
    let Some(desc) = desc.as_object() else { return fail("vector JSON is not an object") };
    let frame = parse_hex(hex_text)?;
    if let Some(fh) = desc.get("frame_hex").and_then(Value::as_str)
        && parse_hex(fh)? != frame
    {
        return fail("frame_hex differs from the .hex file");
    }
    if let Some(ph) = desc.get("payload_hex").and_then(Value::as_str)
        && (frame.len() < HEADER_LEN || parse_hex(ph)? != frame[HEADER_LEN..])
    {
        return fail("payload_hex differs from the frame's payload");
    }
    let kind = desc.get("kind").and_then(Value::as_str).unwrap_or("json_message");
    match kind {
        "invalid" => check_invalid(desc, &frame),
        "json_message" | "json_unknown_type" => check_json(kind, desc, &frame),
        "binary_publish_batch" | "binary_acked_publish_batch" | "binary_publish_ack" | "binary_event_batch" => {
            check_binary(kind, desc, &frame)
        }
        other => fail(format!("unknown vector kind {other:?}")),
    }
}

fn decode_one(frame: &[u8], desc: &Map<String, Value>) -> Result<Frame, FrameError> {
    let mut dec = FrameDecoder::new();
    // A vector shows a layout to a peer that negotiated it: bit 15 (D56) included, unless the
    // vector names what its receiver accepts.
    dec.set_accepted_flags(Flags::KNOWN);
    if let Some(max) = desc.get("max_frame_len").and_then(Value::as_u64) {
        dec.set_max_frame_len(u32::try_from(max).unwrap_or(u32::MAX));
    }
    if let Some(acc) = desc.get("accepted_flags").and_then(Value::as_u64) {
        dec.set_accepted_flags(Flags(u16::try_from(acc).unwrap_or(u16::MAX)));
    }
    dec.push(Bytes::copy_from_slice(frame));
    match dec.next_frame()? {
        Some(f) => {
            if dec.buffered() != 0 {
                // Bytes after the frame: report them as a truncated second frame.
                return Err(FrameError::Truncated { have: dec.buffered(), need: HEADER_LEN });
            }
            Ok(f)
        }
        None => Err(dec.finish().err().unwrap_or(FrameError::Truncated { have: frame.len(), need: HEADER_LEN })),
    }
}

fn whole_frame(frame: &[u8], desc: &Map<String, Value>) -> Result<Frame, VectorFailure> {
    let f = decode_one(frame, desc).or_else(|e| fail(format!("frame does not decode: {e}")))?;
    if let Some(want) = desc.get("flags").and_then(Value::as_u64)
        && u64::from(f.flags.bits()) != want
    {
        return fail(format!("flags {:#06x}, described {want:#06x}", f.flags.bits()));
    }
    Ok(f)
}

fn check_invalid(desc: &Map<String, Value>, frame: &[u8]) -> Result<(), VectorFailure> {
    let Some(expect) = desc.get("expect").and_then(Value::as_object) else {
        return fail("invalid vector without expect");
    };
    let stage = expect.get("stage").and_then(Value::as_str).unwrap_or("frame");
    let want = expect.get("error").and_then(Value::as_str).unwrap_or("");
    let got = match decode_one(frame, desc) {
        Err(e) => ("frame", e.kind().to_owned(), e.is_fatal()),
        Ok(f) => match f.decode_payload() {
            Err(e) => ("payload", e.kind().to_owned(), false),
            Ok(Payload::Json(Decoded::Unknown(u))) => {
                return fail(format!("decoded to unknown type {:?}, expected {stage}/{want}", u.type_name));
            }
            Ok(_) => return fail(format!("frame decoded, expected {stage}/{want}")),
        },
    };
    let stage_ok = got.0 == stage || (stage == "finish" && got.1 == "truncated");
    if !stage_ok || got.1 != want {
        return fail(format!("failed at {}/{}, expected {stage}/{want}", got.0, got.1));
    }
    if let Some(fatal) = expect.get("fatal").and_then(Value::as_bool)
        && fatal != got.2
    {
        return fail(format!("error fatal={}, expected fatal={fatal}", got.2));
    }
    Ok(())
}

fn check_json(kind: &str, desc: &Map<String, Value>, frame: &[u8]) -> Result<(), VectorFailure> {
    let f = whole_frame(frame, desc)?;
    if !f.flags.is_empty() {
        return fail("JSON vector with non-zero flags");
    }
    let Some(pj) = desc.get("payload_json").and_then(Value::as_str) else { return fail("payload_json missing") };
    if pj.as_bytes() != &f.payload[..] {
        return fail("payload_json differs from the frame payload");
    }
    let decoded = message::decode(&f.payload).or_else(|e| fail(format!("payload does not decode: {e}")))?;
    match (kind, decoded) {
        ("json_unknown_type", Decoded::Unknown(u)) => {
            let want = desc.get("type_name").and_then(Value::as_str).unwrap_or("");
            if u.type_name != want {
                return fail(format!("unknown type {:?}, described {want:?}", u.type_name));
            }
            let want_id = desc.get("request_id").and_then(Value::as_u64);
            if u.request_id != want_id {
                return fail(format!("request_id {:?}, described {want_id:?}", u.request_id));
            }
            Ok(())
        }
        ("json_message", Decoded::Message(m)) => {
            if let Some(t) = desc.get("type").and_then(Value::as_str)
                && m.type_name() != t
            {
                return fail(format!("type {}, described {t}", m.type_name()));
            }
            let again = m.to_json().or_else(|e| fail(format!("re-encode: {e}")))?;
            if again != f.payload {
                return fail(format!(
                    "re-encoded payload differs:\n  got  {}\n  want {}",
                    String::from_utf8_lossy(&again),
                    pj
                ));
            }
            let mut whole = BytesMut::new();
            m.encode(&mut whole).or_else(|e| fail(format!("re-encode frame: {e}")))?;
            if whole[..] != *frame {
                return fail("re-encoded frame differs");
            }
            Ok(())
        }
        (_, other) => fail(format!("decoded to {other:?}, vector kind {kind}")),
    }
}

fn bytes_field(desc: &Map<String, Value>, base: &str) -> Result<Option<Bytes>, VectorFailure> {
    if let Some(v) = desc.get(&format!("{base}_utf8")) {
        return match v {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(Bytes::copy_from_slice(s.as_bytes()))),
            _ => fail(format!("{base}_utf8 is not a string")),
        };
    }
    if let Some(v) = desc.get(&format!("{base}_hex")) {
        return match v {
            Value::Null => Ok(None),
            Value::String(s) => Ok(Some(Bytes::from(parse_hex(s)?))),
            _ => fail(format!("{base}_hex is not a string")),
        };
    }
    Ok(None)
}

/// A compressed vector's `codec` and `compressed_hex` (D56), when it has them.
fn packed_field(desc: &Map<String, Value>) -> Result<Option<(Codec, Bytes)>, VectorFailure> {
    let Some(name) = desc.get("codec").and_then(Value::as_str) else { return Ok(None) };
    let Some(codec) = Codec::from_name(name) else { return fail(format!("unknown codec {name:?}")) };
    match bytes_field(desc, "compressed")? {
        Some(data) => Ok(Some((codec, data))),
        None => fail("a compressed vector needs compressed_hex"),
    }
}

/// The described records with the described compressed form, which must inflate to them.
fn from_packed(plain: &Records, codec: Codec, data: Bytes) -> Result<Records, VectorFailure> {
    let r = Records::from_packed(plain.count(), codec, data, plain.raw().len(), plain.raw().len())
        .or_else(|e| fail(format!("compressed_hex: {e}")))?;
    if r.raw() != plain.raw() {
        return fail("compressed_hex does not inflate to the described records");
    }
    Ok(r.with_envelope(plain.envelope().cloned()))
}

fn str_field(desc: &Map<String, Value>, name: &str) -> Result<String, VectorFailure> {
    match desc.get(name) {
        Some(Value::String(s)) => Ok(s.clone()),
        _ => fail(format!("{name} missing or not a string")),
    }
}

fn u64_field(desc: &Map<String, Value>, name: &str) -> Result<Option<u64>, VectorFailure> {
    match desc.get(name) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v.as_u64().map(Some).map_or_else(|| fail(format!("{name} is not a u64")), Ok),
    }
}

fn payload_list(desc: &Map<String, Value>) -> Result<Vec<Bytes>, VectorFailure> {
    if let Some(Value::Array(a)) = desc.get("payloads_utf8") {
        return a
            .iter()
            .map(|v| v.as_str().map(|s| Bytes::copy_from_slice(s.as_bytes())))
            .collect::<Option<Vec<_>>>()
            .map_or_else(|| fail("payloads_utf8 holds a non-string"), Ok);
    }
    if let Some(Value::Array(a)) = desc.get("payloads_hex") {
        return a
            .iter()
            .map(|v| {
                v.as_str().map_or_else(|| fail("payloads_hex holds a non-string"), |s| parse_hex(s).map(Bytes::from))
            })
            .collect();
    }
    fail("payloads_utf8 / payloads_hex missing")
}

fn ack_mode(desc: &Map<String, Value>) -> Result<AckMode, VectorFailure> {
    match desc.get("ack_mode").and_then(Value::as_str) {
        Some("per_batch") => Ok(AckMode::PerBatch),
        Some("per_message") => Ok(AckMode::PerMessage),
        other => fail(format!("ack_mode {other:?}")),
    }
}

/// Builds the value a binary vector describes.
fn build_binary(kind: &str, desc: &Map<String, Value>) -> Result<Payload, VectorFailure> {
    let enc = |e: crate::binary::EncodeError| VectorFailure(vec![format!("described value: {e}")]);
    match kind {
        "binary_publish_batch" | "binary_acked_publish_batch" => {
            let acked = match u64_field(desc, "request_id")? {
                Some(request_id) => Some(AckedPrefix { request_id, ack_mode: ack_mode(desc)? }),
                None => None,
            };
            let idempotent = match (u64_field(desc, "producer_id")?, u64_field(desc, "sequence")?) {
                (Some(producer_id), Some(sequence)) => Some(IdempotentPrefix { producer_id, sequence }),
                (None, None) => None,
                _ => return fail("producer_id and sequence go together"),
            };
            Ok(Payload::Publish(PublishBatch {
                acked,
                idempotent,
                key: bytes_field(desc, "key")?,
                tenant_id: str_field(desc, "tenant_id")?,
                namespace: str_field(desc, "namespace")?,
                stream: str_field(desc, "stream")?,
                records: match packed_field(desc)? {
                    Some((codec, data)) => {
                        let plain = Records::from_payloads(payload_list(desc)?).map_err(enc)?;
                        from_packed(&plain, codec, data)?
                    }
                    None => Records::from_payloads(payload_list(desc)?).map_err(enc)?,
                }
                .with_envelope(bytes_field(desc, "envelope")?),
            }))
        }
        "binary_publish_ack" => {
            let status = match desc.get("status").and_then(Value::as_str) {
                Some("ok") => AckStatus::Ok,
                Some("error") => AckStatus::Error,
                other => return fail(format!("status {other:?}")),
            };
            let code = match desc.get("code") {
                None | Some(Value::Null) => None,
                Some(Value::String(name)) => {
                    let retry =
                        desc.get("retry").and_then(Value::as_str).map_or(RetryClass::Fatal, RetryClass::from_name);
                    Some((ErrorCode::from_name(name), retry))
                }
                Some(_) => return fail("code is not a string"),
            };
            let detail = match desc.get("detail") {
                None | Some(Value::Null) => None,
                Some(v) => {
                    Some(serde_json::from_value::<ErrorDetail>(v.clone()).or_else(|e| fail(format!("detail: {e}")))?)
                }
            };
            let owner = match desc.get("owner").and_then(Value::as_object) {
                None => None,
                Some(o) => Some(OwnerHint {
                    node_id: str_field(o, "node_id")?,
                    addr: o.get("addr").and_then(Value::as_str).map(str::to_owned),
                    generation: u64_field(o, "generation")?.unwrap_or(0),
                }),
            };
            Ok(Payload::Ack(PublishAck {
                status,
                request_id: u64_field(desc, "request_id")?.unwrap_or(0),
                message: desc.get("message").and_then(Value::as_str).unwrap_or("").to_owned(),
                code,
                detail,
                owner,
                offset: u64_field(desc, "offset")?,
            }))
        }
        "binary_event_batch" => {
            let Some(Value::Array(events)) = desc.get("events") else { return fail("events missing") };
            let mut timed = Vec::new();
            let mut plain = Vec::new();
            for e in events {
                let Some(e) = e.as_object() else { return fail("event is not an object") };
                let p = bytes_field(e, "payload")?.unwrap_or_default();
                match u64_field(e, "timestamp_micros")? {
                    Some(t) => timed.push((t, p)),
                    None => plain.push(p),
                }
            }
            let mut records = match (timed.is_empty(), plain.is_empty()) {
                (true, _) => Records::from_payloads(plain).map_err(enc)?,
                (false, true) => Records::from_timed(timed.clone()).map_err(enc)?,
                (false, false) => return fail("either every event has a timestamp or none does"),
            };
            if let Some(e) = bytes_field(desc, "envelope")? {
                records = records.with_envelope(Some(e));
            }
            if let Some((codec, data)) = packed_field(desc)? {
                let untimed = records.without_timestamps();
                records = from_packed(&untimed, codec, data)?;
                if let Some((t, _)) = timed.first() {
                    if timed.iter().any(|(u, _)| u != t) {
                        return fail("the events of a compressed batch share one timestamp");
                    }
                    records = records.with_timestamp(*t);
                }
            }
            Ok(Payload::Events(EventBatch {
                subscription_id: u64_field(desc, "subscription_id")?,
                base_offset: u64_field(desc, "base_offset")?,
                skipped_before: u64_field(desc, "skipped_before")?,
                publisher: bytes_field(desc, "publisher")?,
                records,
            }))
        }
        other => fail(format!("not a binary kind: {other}")),
    }
}

fn check_binary(kind: &str, desc: &Map<String, Value>, frame: &[u8]) -> Result<(), VectorFailure> {
    let f = whole_frame(frame, desc)?;
    let want = build_binary(kind, desc)?;
    let got = f.decode_payload().or_else(|e| fail(format!("payload does not decode: {e}")))?;
    let mut problems = Vec::new();
    if got != want {
        problems.push(format!("decoded {got:?}\n  described {want:?}"));
    }
    let mut out = BytesMut::new();
    let encoded = match &want {
        Payload::Publish(b) => b.encode(&mut out),
        Payload::Ack(a) => a.encode(Flags::KNOWN, &mut out).map(|_| ()),
        Payload::Events(e) => e.encode(&mut out),
        Payload::Json(_) => Ok(()),
    };
    if let Err(e) = encoded {
        problems.push(format!("described value does not encode: {e}"));
    } else if out[..] != *frame {
        problems.push(format!("encoding differs:\n  got  {}\n  want {}", to_hex(&out), to_hex(frame)));
    }
    if problems.is_empty() { Ok(()) } else { Err(VectorFailure(problems)) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_json_vector_passes_and_a_tampered_one_fails() {
        let json = r#"{"name":"ok","payload_json":"{\"type\":\"ok\"}"}"#;
        assert_eq!(check_vector(json, "464c5831000100000000000d7b2274797065223a226f6b227d\n"), Ok(()));
        assert!(check_vector(json, "464c5831000100000000000d7b2274797065223a226f6b217d").is_err());
    }

    #[test]
    fn invalid_vector_checks_stage_and_kind() {
        let json = r#"{"kind":"invalid","expect":{"stage":"frame","error":"bad_magic","fatal":true}}"#;
        assert_eq!(check_vector(json, "464c583200010000000000007b7d"), Ok(()));
        let wrong = r#"{"kind":"invalid","expect":{"stage":"frame","error":"unsupported_version"}}"#;
        assert!(check_vector(wrong, "464c583200010000000000007b7d").is_err());
    }
}
