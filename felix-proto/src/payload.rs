//! What a whole frame carries, chosen by its (validated) flags.

use crate::binary::{EventBatch, PayloadError, PublishAck, PublishBatch};
use crate::flags::Flags;
use crate::frame::Frame;
use crate::message::{self, Decoded, MessageError};

/// The payload layout a flag set selects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum PayloadKind {
    /// Flags 0: a JSON control message.
    Json,
    /// 0x0001: a binary publish batch.
    Publish,
    /// 0x0010: a binary publish ack.
    Ack,
    /// 0x0002 or 0x0004: a binary event batch.
    Events,
}

impl PayloadKind {
    /// The kind a validated flag set selects. `None` for a set with modifiers but no kind bit,
    /// which [`Flags::validate`] never lets through.
    pub fn of(flags: Flags) -> Option<PayloadKind> {
        if flags.contains(Flags::BINARY_PUBLISH_BATCH) {
            Some(PayloadKind::Publish)
        } else if flags.contains(Flags::BINARY_PUBLISH_ACK) {
            Some(PayloadKind::Ack)
        } else if flags.intersects(Flags::BINARY_EVENT_BATCH | Flags::BINARY_EVENT_BATCH_SHARED) {
            Some(PayloadKind::Events)
        } else if flags.is_empty() {
            Some(PayloadKind::Json)
        } else {
            None
        }
    }
}

/// A decoded frame payload.
#[derive(Debug, Clone, PartialEq)]
pub enum Payload {
    /// A JSON control message (or an unknown type).
    Json(Decoded),
    /// A binary publish batch.
    Publish(PublishBatch),
    /// A binary publish ack.
    Ack(PublishAck),
    /// A binary event batch.
    Events(EventBatch),
}

/// Why a frame's payload could not be decoded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PayloadDecodeError {
    /// A binary layout was malformed.
    #[error(transparent)]
    Binary(#[from] PayloadError),
    /// A JSON message was malformed.
    #[error(transparent)]
    Json(#[from] MessageError),
}

impl PayloadDecodeError {
    /// A short stable name for the error kind.
    pub fn kind(&self) -> &'static str {
        match self {
            PayloadDecodeError::Binary(e) => e.kind(),
            PayloadDecodeError::Json(e) => e.kind(),
        }
    }
}

impl Frame {
    /// Decodes the payload according to the frame's flags.
    ///
    /// # Errors
    /// See [`PayloadDecodeError`].
    pub fn decode_payload(&self) -> Result<Payload, PayloadDecodeError> {
        match PayloadKind::of(self.flags) {
            Some(PayloadKind::Json) => Ok(Payload::Json(message::decode(&self.payload)?)),
            Some(PayloadKind::Publish) => Ok(Payload::Publish(PublishBatch::decode(self.flags, self.payload.clone())?)),
            Some(PayloadKind::Ack) => Ok(Payload::Ack(PublishAck::decode(self.flags, self.payload.clone())?)),
            Some(PayloadKind::Events) => Ok(Payload::Events(EventBatch::decode(self.flags, self.payload.clone())?)),
            None => Err(PayloadError::WrongKind(self.flags.bits()).into()),
        }
    }
}
