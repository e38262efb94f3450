//! A page of the cluster's status (D55): which shards one answer holds. The broker reads it
//! from a client's `cluster_status` request and the cluster node renders the page
//! ([`crate::cluster::status`]).

use super::ShardId;

/// Most shards one page of the status holds (D55).
pub const STATUS_PAGE_MAX: usize = 5_000;

/// One page of the status document (D55): its per-shard lists (`shards`, `replicas`, `moves`,
/// `move_progress`, `failed_replicas`, `rejoining_replicas`) hold only the shards after
/// `after`, up to and including the `limit`-th shard with an owner after it; the document's
/// `next` names that shard when more follow. Pages partition the shards by their order
/// (kind, tenant, namespace, name, shard), so paging through them shows each once however the
/// other lists are spread. The members, leader and revocations are on every page.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusPage {
    /// Where the page starts (exclusive); `None`: at the first shard.
    pub after: Option<ShardId>,
    /// Shards with an owner on the page (at least 1, at most [`STATUS_PAGE_MAX`]).
    pub limit: usize,
}
