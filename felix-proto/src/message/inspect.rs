//! Operator diagnostics (FEATURE_INSPECT).
//!
//! JSON control messages, one struct each, following the rules in [`super`].

#![allow(missing_docs)] // field docs live in docs/protocol.md; each struct says what it is.

use super::*;
use serde::{Deserialize, Serialize};

/// `shard_inspect`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInspect {
    pub tenant_id: String,
    pub namespace: String,
    pub name: String,
    pub kind: ShardKind,
    pub shard: u32,
    pub request_id: u64,
}

/// Assignment part of an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectAssignment {
    pub generation: u64,
    pub leader: String,
    pub replicas: Vec<String>,
    pub draining: bool,
    pub successor: String,
}

/// Fence part of an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectFence {
    pub took: Vec<String>,
    pub pending: Vec<String>,
    pub attempts: u32,
    pub retry_in_ms: u64,
}

/// Lease part of an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectLease {
    pub held: bool,
    pub remaining_ms: u64,
}

/// One replica in an inspect view.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectReplica {
    pub node_id: String,
    pub role: String,
    pub next_offset: u64,
    pub lag: u64,
    pub fence: bool,
    pub state: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub halted: Option<String>,
}

/// A broker's own view of one shard. Words are open strings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct InspectView {
    pub node_id: String,
    pub shards: u32,
    pub role: String,
    pub phase: String,
    pub serving: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub detail: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub assignment: Option<InspectAssignment>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fence: Option<InspectFence>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lease: Option<InspectLease>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tail: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub committed: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted_generation: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replicas: Option<Vec<InspectReplica>>,
}

/// `shard_inspect_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardInspectInfo {
    pub request_id: u64,
    pub view: Box<InspectView>,
}

/// Filter of `subscriptions_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct SubscriptionFilter {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tenant_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shard: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dropping: Option<bool>,
}

/// Paging cursor of `subscriptions_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionCursor {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub subscriber_id: u64,
}

/// `subscriptions_list`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionsList {
    pub request_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub filter: Option<SubscriptionFilter>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limit: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cursor: Option<SubscriptionCursor>,
}

/// One subscription in `subscriptions_list_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionInfo {
    pub tenant_id: String,
    pub namespace: String,
    pub stream: String,
    pub shard: u32,
    pub subscriber_id: u64,
    pub subscription_id: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub connection: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peer: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub principal: Option<String>,
    pub policy: String,
    pub depth: u64,
    pub capacity: u64,
    pub dropped: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub position: Option<u64>,
    pub tail: u64,
    pub age_ms: u64,
}

/// `subscriptions_list_info`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SubscriptionsListInfo {
    pub request_id: u64,
    pub node_id: String,
    pub subscriptions: Vec<SubscriptionInfo>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub next_cursor: Option<SubscriptionCursor>,
}
