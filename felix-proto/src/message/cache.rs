//! The cache: put, get, delete, conditional writes, watches.
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::*;
use serde::{Deserialize, Serialize};

/// `cache_put`. `ttl_ms` is always written (`null` = no expiry).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachePut {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub value: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    #[serde(default)]
    pub ttl_ms: Option<u64>,
}

/// `cache_get`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheGet {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
}

/// `cache_delete` (FEATURE_CACHE_DELETE): answered with the removed value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheDelete {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
}

/// `cache_value`. `value` is always written (`null` on a miss).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheValue {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    #[serde(default)]
    pub value: Option<B64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_id: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
}

/// `cache_ok`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheOk {
    pub request_id: u64,
}

/// A conditional cache write's condition: `"absent"` or `{"version": n}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheCondition {
    Absent,
    Version(u64),
}

/// `cache_put_if`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CachePutIf {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub value: B64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ttl_ms: Option<u64>,
    pub condition: CacheCondition,
    pub request_id: u64,
}

/// `cache_delete_if`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheDeleteIf {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    pub key: String,
    pub version: u64,
    pub request_id: u64,
}

/// `cache_condition_result`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheConditionResult {
    pub applied: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<u64>,
    pub request_id: u64,
}

/// `cache_watch`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheWatch {
    pub tenant_id: String,
    pub namespace: String,
    pub cache: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prefix: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub from_offset: Option<u64>,
    #[serde(default, skip_serializing_if = "is_false")]
    pub retained: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub subscription_id: Option<u64>,
}

/// `cache_watch_started`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheWatchStarted {
    pub subscription_id: u64,
    pub resume_offset: u64,
    #[serde(default)]
    pub resnapshot: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retained_count: Option<u64>,
}

/// `cache_event`: one change on a watch's event stream.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheEvent {
    pub key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub value: Option<B64>,
    pub offset: u64,
    #[serde(default)]
    pub expires_at_millis: u64,
}

/// `cache_watch_lagged`: terminal frame of a watch that fell behind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CacheWatchLagged {
    pub resume_from: u64,
}
