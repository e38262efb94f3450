//! What one broker hands another on a client's behalf (forwarding, D36 and after): a publish
//! for a shard it does not own and the owner's answer, and a cache or counter request. The
//! broker builds and serves them; the cluster carries them (peer kinds, encoded in
//! [`crate::cluster::peer`]).

use crate::binary::Records;
use crate::error_code::{ErrorCode, RetryClass};
use bytes::Bytes;

/// A publish forwarded to its shard's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardedPublish {
    /// Names it on the origin until its answer comes back.
    pub id: u64,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// The shard the origin routed it to.
    pub shard: u32,
    /// The owner's generation the origin routed by.
    pub generation: u64,
    /// The key it was published with (D57; sent only to an owner that offered
    /// [`FEATURE_BATCH_META`](crate::cluster::peer::FEATURE_BATCH_META), D59).
    pub key: Option<Bytes>,
    /// The records, as the client sent them (with their envelope and compressed form only to
    /// an owner that offered `FEATURE_BATCH_META`).
    pub records: Records,
    /// The publishing principal (recorded as the publisher).
    pub publisher: Option<Bytes>,
    /// Whether the client waits for an answer.
    pub acked: bool,
}

impl ForwardedPublish {
    /// What an owner that did not offer
    /// [`FEATURE_BATCH_META`](crate::cluster::peer::FEATURE_BATCH_META) reads (D59): no key,
    /// the plain block. `None` for a batch with an envelope: its records are ciphertext that
    /// no subscriber could open without it, so it is refused rather than sent without it.
    pub fn without_meta(self) -> Option<ForwardedPublish> {
        if self.records.envelope().is_some() {
            return None;
        }
        Some(ForwardedPublish { key: None, records: self.records.plain(), ..self })
    }
}

/// The owner's answer to a forwarded publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ForwardOutcome {
    /// Appended; the first record's offset on a durable shard.
    Appended {
        /// Offset of the first record.
        offset: Option<u64>,
    },
    /// Refused; nothing was appended.
    Refused {
        /// Code.
        code: ErrorCode,
        /// Retry class.
        retry: RetryClass,
        /// Prose.
        message: String,
    },
}

/// A cache or counter request forwarded to the cache's owner.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardedRequest {
    /// Names it on the origin until its answer comes back.
    pub id: u64,
    /// The client's tenant (the origin checked its permission).
    pub tenant_id: String,
    /// The client's principal.
    pub principal: Bytes,
    /// The client's flags, so that the answer is built for it.
    pub flags: u16,
    /// The client's features.
    pub features: u64,
    /// The request, as one JSON frame.
    pub request: Bytes,
}
