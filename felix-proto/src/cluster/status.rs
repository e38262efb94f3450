//! The cluster as one broker sees it, as a JSON document: members, the metadata leader, every
//! shard's owner and generation, moves, and this broker's replicas. The metrics listener serves
//! it whole (`GET /cluster`); a client asks for it over the client protocol (`cluster_status`,
//! D52), scoped to its tenant unless it is the operator. Built here, not in a driver, so both
//! say the same thing.

use super::metadata::{MovePhase, ShardId};
use super::node::ClusterNode;

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

impl ClusterNode {
    /// The status document. `tenant` limits shards, moves and replicas to one tenant's and
    /// leaves revocations out (a tenant's view); `None` is the operator's whole view.
    pub fn status(&self, tenant: Option<&str>) -> serde_json::Value {
        self.status_page(tenant, None)
    }

    /// [`status`](Self::status), one page of it (`None`: whole).
    pub fn status_page(&self, tenant: Option<&str>, page: Option<&StatusPage>) -> serde_json::Value {
        let md = self.metadata();
        // The page's end: the `limit`-th owned shard after `after`, when more follow.
        let mut end = None;
        if let Some(p) = page {
            let limit = p.limit.clamp(1, STATUS_PAGE_MAX);
            let mut after_start = md
                .owners()
                .keys()
                .filter(|s| tenant.is_none_or(|t| t == s.tenant))
                .filter(|s| p.after.as_ref().is_none_or(|a| *s > a));
            if let Some(last) = after_start.nth(limit - 1)
                && after_start.next().is_some()
            {
                end = Some(last.clone());
            }
        }
        let in_page = |s: &ShardId| {
            page.is_none_or(|p| p.after.as_ref().is_none_or(|a| s > a)) && end.as_ref().is_none_or(|e| s <= e)
        };
        let keep_shard = |s: &ShardId| tenant.is_none_or(|x| x == s.tenant) && in_page(s);
        let members: Vec<serde_json::Value> = md
            .members()
            .values()
            .map(|m| {
                serde_json::json!({"node_id": m.id, "client_addr": m.client_addr, "cluster_addr": m.cluster_addr,
                    "state": format!("{:?}", m.state).to_lowercase()})
            })
            .collect();
        let shards: Vec<serde_json::Value> = md
            .owners()
            .iter()
            .filter(|(s, _)| keep_shard(s))
            .map(|(s, a)| {
                serde_json::json!({"kind": format!("{:?}", s.kind).to_lowercase(), "tenant": s.tenant,
                    "namespace": s.namespace, "name": s.name, "shard": s.shard, "owner": a.owner, "generation": a.generation})
            })
            .collect();
        // Who is revoked is the operator's business, not a tenant's.
        let revoked = match tenant {
            None => serde_json::json!({"jti": md.revoked_jti(), "sub": md.revoked_sub()}),
            Some(_) => serde_json::json!({"jti": [], "sub": []}),
        };
        let replicas: Vec<serde_json::Value> = self
            .replica_report()
            .into_iter()
            .filter(|r| keep_shard(&r.shard))
            .map(|r| {
                let followers: Vec<serde_json::Value> = r
                    .followers
                    .iter()
                    .map(|(id, matched, lag)| serde_json::json!({"node_id": id, "matched_index": matched, "lag": lag}))
                    .collect();
                serde_json::json!({"kind": format!("{:?}", r.shard.kind).to_lowercase(), "tenant": r.shard.tenant,
                    "namespace": r.shard.namespace, "name": r.shard.name, "shard": r.shard.shard,
                    "replicas": md.replicas(&r.shard), "leader": r.leader, "term": r.term, "role": r.role,
                    "next_offset": r.next_offset, "last_index": r.last_index, "first_index": r.first_index, "committed_index": r.committed_index,
                    "followers": followers})
            })
            .collect();
        let failed: Vec<serde_json::Value> = self
            .failed_replicas()
            .iter()
            .filter(|(s, _)| keep_shard(s))
            .map(|(s, why)| {
                serde_json::json!({"name": s.name, "namespace": s.namespace, "tenant": s.tenant,
                "shard": s.shard, "failed": why})
            })
            .collect();
        let rejoining: Vec<serde_json::Value> = self
            .rejoining_replicas()
            .iter()
            .filter(|(s, _)| keep_shard(s))
            .map(|(s, why)| {
                serde_json::json!({"kind": format!("{:?}", s.kind).to_lowercase(), "name": s.name,
                "namespace": s.namespace, "tenant": s.tenant, "shard": s.shard, "damaged": why})
            })
            .collect();
        let moves: Vec<serde_json::Value> = md
            .moves()
            .iter()
            .filter(|(s, _)| keep_shard(s))
            .map(|(s, m)| {
                let (phase, at) = match m.phase {
                    // A replicated shard's move: to another replica, its group's leadership
                    // is being handed over; to a broker outside the group, it joins the group
                    // (catches up) and takes the leaving replica's place.
                    _ if md.replicas(s).is_some_and(|r| r.contains(&m.to)) => ("transferring_leadership", None),
                    _ if md.replicas(s).is_some() => ("joining_group", None),
                    MovePhase::CatchingUp => ("catching_up", None),
                    MovePhase::CutOver { at } => ("cut_over", Some(at)),
                };
                serde_json::json!({"tenant": s.tenant, "namespace": s.namespace, "name": s.name, "shard": s.shard,
                    "from": m.from, "to": m.to, "phase": phase, "at": at})
            })
            .collect();
        let progress: Vec<serde_json::Value> = self
            .broker
            .move_progress()
            .into_iter()
            .filter(|p| keep_shard(&p.shard))
            .map(|p| {
                serde_json::json!({"tenant": p.shard.tenant, "namespace": p.shard.namespace, "name": p.shard.name,
                    "shard": p.shard.shard, "direction": if p.outgoing { "out" } else { "in" }, "peer": p.peer,
                    "copied": p.copied, "source_tail": p.source_tail, "cutting": p.cutting})
            })
            .collect();
        let mut doc = serde_json::json!({"cluster": true, "node_id": self.node_id(), "leader": self.leader(),
            "fenced": self.broker.is_fenced(), "moves": moves, "move_progress": progress,
            "voters": self.voters(), "members": members, "shards": shards, "revoked": revoked, "replicas": replicas,
            "failed_replicas": failed, "rejoining_replicas": rejoining});
        if let Some(e) = end {
            doc["next"] = e.cursor().into();
        }
        doc
    }
}

#[cfg(test)]
mod tests {
    use super::super::metadata::{Kind, ShardId};

    /// A cursor reads back as the shard it names, whatever the names hold (`~`, `%`, empty);
    /// strings no cursor could be are refused.
    #[test]
    fn a_shard_cursor_round_trips_and_strangers_are_refused() {
        for s in [
            ShardId::of(Kind::Stream, "t1", "default", "orders", 0),
            ShardId::of(Kind::Cache, "a~b", "%", "", u32::MAX),
            ShardId::of(Kind::Stream, "ünï", "n s", "x/y", 7),
        ] {
            assert_eq!(ShardId::from_cursor(&s.cursor()), Some(s.clone()), "{}", s.cursor());
            assert_eq!(s.cursor().matches('~').count(), 4);
        }
        for bad in [
            "",
            "stream",
            "queue~t~n~s~0",
            "stream~t~n~s~-1",
            "stream~t~n~s~+1",
            "stream~t~n~s~0~1",
            "stream~%zz~n~s~0",
        ] {
            assert_eq!(ShardId::from_cursor(bad), None, "{bad}");
        }
    }
}
