//! Subscriptions: subscribe, filters, event streams, lag, moved shards, stream deletion.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::*;
use serde::{Deserialize, Serialize};

/// Where a subscription (or a group seek) starts: `"latest"`, `"earliest"` or `{"offset": n}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StartPosition {
    Latest,
    Earliest,
    Offset(u64),
}

/// `subscribe`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Subscribe {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start: Option<StartPosition>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_capacity: Option<u32>,
    /// Only batches whose key this matches (D57); sent only to a broker advertising
    /// `FEATURE_STREAM_FILTER`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<KeyFilter>,
}

/// A subscription's filter on record keys (D57): a batch is delivered when its key equals one
/// of `keys` or starts with one of `key_prefixes` (an empty prefix matches every keyed batch);
/// an unkeyed batch never matches. Keys are bytes, base64 as a publish's key is.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize, Default)]
pub struct KeyFilter {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub keys: Vec<B64>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub key_prefixes: Vec<B64>,
}

impl KeyFilter {
    /// The most keys and prefixes a filter holds, together.
    pub const MAX_ENTRIES: usize = 256;
    /// The most bytes its keys and prefixes hold, together.
    pub const MAX_BYTES: usize = 64 << 10;

    /// Whether a batch with this key is delivered.
    pub fn matches(&self, key: Option<&[u8]>) -> bool {
        let Some(key) = key else { return false };
        self.keys.iter().any(|k| k.0[..] == *key) || self.key_prefixes.iter().any(|p| key.starts_with(&p.0))
    }

    /// Checks the filter's size: at least one entry, at most [`MAX_ENTRIES`](Self::MAX_ENTRIES)
    /// and [`MAX_BYTES`](Self::MAX_BYTES).
    ///
    /// # Errors
    /// What is wrong, in words.
    pub fn check(&self) -> Result<(), String> {
        let n = self.keys.len() + self.key_prefixes.len();
        if n == 0 {
            return Err("a filter needs at least one key or key prefix".into());
        }
        if n > Self::MAX_ENTRIES {
            return Err(format!("a filter holds at most {} keys and prefixes, not {n}", Self::MAX_ENTRIES));
        }
        let bytes: usize = self.keys.iter().chain(&self.key_prefixes).map(|k| k.0.len()).sum();
        if bytes > Self::MAX_BYTES {
            return Err(format!("a filter's keys and prefixes hold at most {} bytes, not {bytes}", Self::MAX_BYTES));
        }
        Ok(())
    }
}

/// `subscribed`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Subscribed {
    pub subscription_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub start_offset: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub live_offset: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_capacity: Option<u32>,
}

/// Why a cursor cannot be served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CursorErrorReason {
    TooOld,
    InFuture,
}

/// `subscribe_cursor_error`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscribeCursorError {
    pub reason: CursorErrorReason,
    pub requested: u64,
    pub available: u64,
}

/// `event_stream_hello`: first frame of every event stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventStreamHello {
    pub subscription_id: u64,
}

/// `event`: one event (JSON delivery form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payload: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub offset: Option<u64>,
}

/// `event_batch`: several events (JSON delivery form).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EventBatchMsg {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub payloads: Vec<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub base_offset: Option<u64>,
}

/// `subscription_lagged`: terminal frame after a queue drop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionLagged {
    pub subscription_id: u64,
    pub resume_from: u64,
}

/// `shard_moved`: terminal frame when the shard moved away.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardMoved {
    pub subscription_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub node_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<String>,
    pub generation: u64,
}

/// `stream_deleted`: terminal frame when the stream was deleted.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamDeleted {
    pub subscription_id: u64,
}

/// `stream_delete` (FEATURE_STREAM_ADMIN, our D43): delete a stream and everything it holds.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamDelete {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub request_id: u64,
}

/// `stream_delete_ok`: `existed` says whether there was such a stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StreamDeleteOk {
    pub request_id: u64,
    pub existed: bool,
}
