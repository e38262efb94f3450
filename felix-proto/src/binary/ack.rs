//! Binary publish acknowledgement (flag 0x0010, broker → client).
//!
//! ```text
//! u8 status (0 ok, 1 error), u64 request_id, u16 message_len, message
//! u16 code, u8 retry                                       if 0x0200 (failed acks only)
//! u16 reason_len, reason, u64 retry_after_ms               if 0x0400 (only with 0x0200)
//! u16 node_id_len, node_id, u16 addr_len, addr, u64 gen    if 0x0080
//! u64 offset                                               if 0x1000 (successful acks only; last)
//! ```
//! Each extension is written only for a client that offered its bit: [`PublishAck::encode`]
//! takes the client's offered flags and leaves out every section the client cannot read, so a
//! client that offered nothing receives exactly the bytes a pre-extension broker sent.

use super::{EncodeError, PayloadError, Reader, put_str16};
use crate::error_code::{ErrorCode, RetryClass};
use crate::flags::Flags;
use crate::frame::{begin_frame, patch_flags, patch_length};
use bytes::{BufMut, Bytes, BytesMut};
use serde::{Deserialize, Serialize};

/// Ack status byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum AckStatus {
    /// `0`: accepted.
    Ok,
    /// `1`: refused; `message` says why.
    Error,
}

/// An error's detail: JSON `detail`, binary 0x0400 section.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Why, e.g. `moving` for `shard_unavailable`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// Suggested wait in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_ms: Option<u64>,
}

/// Who owns the shard a forwarded batch was written to (0x0080).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OwnerHint {
    /// The owner's node id.
    pub node_id: String,
    /// Its client address, when it has one (an empty address on the wire means none).
    pub addr: Option<String>,
    /// Ownership generation the hint was true for.
    pub generation: u64,
}

/// A binary publish ack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishAck {
    /// Ok or error.
    pub status: AckStatus,
    /// The acked publish's `request_id`.
    pub request_id: u64,
    /// Error text; empty when ok.
    pub message: String,
    /// 0x0200: code and retry class (failed acks only).
    pub code: Option<(ErrorCode, RetryClass)>,
    /// 0x0400: detail (failed acks with a code only).
    pub detail: Option<ErrorDetail>,
    /// 0x0080: owner hint.
    pub owner: Option<OwnerHint>,
    /// 0x1000: offset of the batch's first record (successful acks only).
    pub offset: Option<u64>,
}

impl PublishAck {
    /// A successful ack.
    pub fn ok(request_id: u64, offset: Option<u64>) -> PublishAck {
        PublishAck {
            status: AckStatus::Ok,
            request_id,
            message: String::new(),
            code: None,
            detail: None,
            owner: None,
            offset,
        }
    }

    /// A failed ack.
    pub fn error(request_id: u64, message: impl Into<String>, code: ErrorCode, retry: RetryClass) -> PublishAck {
        PublishAck {
            status: AckStatus::Error,
            request_id,
            message: message.into(),
            code: Some((code, retry)),
            detail: None,
            owner: None,
            offset: None,
        }
    }

    /// The flags this ack would carry toward a client that offered `offered`.
    pub fn flags_for(&self, offered: Flags) -> Flags {
        let mut f = Flags::BINARY_PUBLISH_ACK;
        let err = self.status == AckStatus::Error;
        let code = err && self.code.is_some() && offered.contains(Flags::BINARY_PUBLISH_ACK_CODE);
        f = f.with(Flags::BINARY_PUBLISH_ACK_CODE, code);
        f = f.with(
            Flags::BINARY_PUBLISH_ACK_DETAIL,
            code && self.detail.is_some() && offered.contains(Flags::BINARY_PUBLISH_ACK_DETAIL),
        );
        f = f.with(
            Flags::BINARY_PUBLISH_ACK_OWNER,
            self.owner.is_some() && offered.contains(Flags::BINARY_PUBLISH_ACK_OWNER),
        );
        f.with(
            Flags::BINARY_PUBLISH_ACK_OFFSET,
            !err && self.offset.is_some() && offered.contains(Flags::BINARY_PUBLISH_ACK_OFFSET),
        )
    }

    /// Decodes a payload framed with `flags` (already validated).
    ///
    /// # Errors
    /// See [`PayloadError`].
    pub fn decode(flags: Flags, payload: Bytes) -> Result<PublishAck, PayloadError> {
        if !flags.contains(Flags::BINARY_PUBLISH_ACK) {
            return Err(PayloadError::WrongKind(flags.bits()));
        }
        let mut r = Reader::new(payload);
        let status_byte = r.u8("status")?;
        let status = match status_byte {
            0 => AckStatus::Ok,
            1 => AckStatus::Error,
            other => return Err(PayloadError::InvalidAckStatus(other)),
        };
        let wrong_section = match status {
            AckStatus::Ok => Flags::BINARY_PUBLISH_ACK_CODE | Flags::BINARY_PUBLISH_ACK_DETAIL,
            AckStatus::Error => Flags::BINARY_PUBLISH_ACK_OFFSET,
        };
        if flags.intersects(wrong_section) {
            return Err(PayloadError::SectionForOtherStatus { flags: flags.bits(), status: status_byte });
        }
        let request_id = r.u64("request_id")?;
        let message = r.str16("message")?;
        let code = if flags.contains(Flags::BINARY_PUBLISH_ACK_CODE) {
            let code = ErrorCode::from_number(r.u16("code")?);
            Some((code, RetryClass::from_number(r.u8("retry")?)))
        } else {
            None
        };
        let detail = if flags.contains(Flags::BINARY_PUBLISH_ACK_DETAIL) {
            let reason = r.str16("reason")?;
            let wait = r.u64("retry_after_ms")?;
            Some(ErrorDetail {
                reason: (!reason.is_empty()).then_some(reason),
                retry_after_ms: (wait != 0).then_some(wait),
            })
        } else {
            None
        };
        let owner = if flags.contains(Flags::BINARY_PUBLISH_ACK_OWNER) {
            let node_id = r.str16("node_id")?;
            let addr = r.str16("addr")?;
            let generation = r.u64("generation")?;
            Some(OwnerHint { node_id, addr: (!addr.is_empty()).then_some(addr), generation })
        } else {
            None
        };
        let offset = if flags.contains(Flags::BINARY_PUBLISH_ACK_OFFSET) { Some(r.u64("offset")?) } else { None };
        r.finish()?;
        Ok(PublishAck { status, request_id, message, code, detail, owner, offset })
    }

    /// Writes the whole frame into `dst`, with only the sections `offered` allows (pass
    /// [`Flags::KNOWN`] for all). An error message longer than 65535 bytes is cut at a character
    /// boundary so that the ack can always be sent. Returns the flags written.
    ///
    /// # Errors
    /// A node id, address or reason longer than 65535 bytes. Nothing is left in `dst` on error.
    pub fn encode(&self, offered: Flags, dst: &mut BytesMut) -> Result<Flags, EncodeError> {
        let start = dst.len();
        let res = self.encode_inner(offered, dst);
        if res.is_err() {
            dst.truncate(start);
        }
        res
    }

    fn encode_inner(&self, offered: Flags, dst: &mut BytesMut) -> Result<Flags, EncodeError> {
        let flags = self.flags_for(offered);
        let at = begin_frame(dst, flags);
        dst.put_u8(match self.status {
            AckStatus::Ok => 0,
            AckStatus::Error => 1,
        });
        dst.put_u64(self.request_id);
        let mut msg = self.message.as_str();
        if msg.len() > u16::MAX as usize {
            let mut cut = u16::MAX as usize;
            while !msg.is_char_boundary(cut) {
                cut -= 1;
            }
            msg = &msg[..cut];
        }
        put_str16(dst, msg.as_bytes(), "message")?;
        if flags.contains(Flags::BINARY_PUBLISH_ACK_CODE) {
            let (code, retry) = self.code.as_ref().expect("flag set only with a code");
            dst.put_u16(code.number());
            dst.put_u8(retry.number());
        }
        if flags.contains(Flags::BINARY_PUBLISH_ACK_DETAIL) {
            let d = self.detail.as_ref().expect("flag set only with a detail");
            put_str16(dst, d.reason.as_deref().unwrap_or("").as_bytes(), "reason")?;
            dst.put_u64(d.retry_after_ms.unwrap_or(0));
        }
        if flags.contains(Flags::BINARY_PUBLISH_ACK_OWNER) {
            let o = self.owner.as_ref().expect("flag set only with an owner");
            put_str16(dst, o.node_id.as_bytes(), "node_id")?;
            put_str16(dst, o.addr.as_deref().unwrap_or("").as_bytes(), "addr")?;
            dst.put_u64(o.generation);
        }
        if flags.contains(Flags::BINARY_PUBLISH_ACK_OFFSET) {
            dst.put_u64(self.offset.expect("flag set only with an offset"));
        }
        patch_flags(dst, at, flags);
        patch_length(dst, at)?;
        Ok(flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_ack_is_byte_identical_for_a_client_that_offered_nothing() {
        let mut a = PublishAck::error(9, "stream not found", ErrorCode::NotFound, RetryClass::RetryAfter);
        a.detail = Some(ErrorDetail { reason: Some("x".into()), retry_after_ms: Some(5) });
        a.owner = Some(OwnerHint { node_id: "n".into(), addr: None, generation: 1 });
        let mut out = BytesMut::new();
        let f = a.encode(Flags::ORIGINAL_V1, &mut out).unwrap();
        assert_eq!(f, Flags::BINARY_PUBLISH_ACK);
        let want = "464c5831000100100000001b010000000000000009001073747265616d206e6f7420666f756e64";
        let got: String = out.iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn full_error_ack_round_trips() {
        let mut a = PublishAck::error(3, "moving", ErrorCode::ShardUnavailable, RetryClass::Retry);
        a.detail = Some(ErrorDetail { reason: Some("moving".into()), retry_after_ms: Some(250) });
        a.owner = Some(OwnerHint { node_id: "b".into(), addr: Some("h:1".into()), generation: 4 });
        let mut out = BytesMut::new();
        let f = a.encode(Flags::KNOWN, &mut out).unwrap();
        assert_eq!(f, Flags(0x0690));
        let back = PublishAck::decode(f, out.freeze().slice(12..)).unwrap();
        assert_eq!(back, a);
    }

    #[test]
    fn sections_for_the_other_status_are_rejected() {
        let mut out = BytesMut::new();
        PublishAck::ok(1, Some(5)).encode(Flags::KNOWN, &mut out).unwrap();
        let payload = out.freeze().slice(12..);
        assert!(matches!(PublishAck::decode(Flags(0x1210), payload), Err(PayloadError::SectionForOtherStatus { .. })));
    }

    #[test]
    fn long_messages_are_cut_at_a_char_boundary() {
        let a = PublishAck::error(1, "é".repeat(40_000), ErrorCode::Internal, RetryClass::Fatal);
        let mut out = BytesMut::new();
        a.encode(Flags::EMPTY, &mut out).unwrap();
        let back = PublishAck::decode(Flags(0x10), out.freeze().slice(12..)).unwrap();
        assert_eq!(back.message.len(), 65_534);
    }
}
