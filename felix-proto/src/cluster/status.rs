//! The cluster as one broker sees it, as a JSON document: members, the metadata leader, every
//! shard's owner and generation, moves, and this broker's replicas. The metrics listener serves
//! it whole (`GET /cluster`); a client asks for it over the client protocol (`cluster_status`,
//! D52), scoped to its tenant unless it is the operator. Built here, not in a driver, so both
//! say the same thing.

use super::metadata::MovePhase;
use super::node::ClusterNode;

impl ClusterNode {
    /// The status document. `tenant` limits shards, moves and replicas to one tenant's and
    /// leaves revocations out (a tenant's view); `None` is the operator's whole view.
    pub fn status(&self, tenant: Option<&str>) -> serde_json::Value {
        let keep = |t: &str| tenant.is_none_or(|x| x == t);
        let md = self.metadata();
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
            .filter(|(s, _)| keep(&s.tenant))
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
            .filter(|r| keep(&r.shard.tenant))
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
            .filter(|(s, _)| keep(&s.tenant))
            .map(|(s, why)| {
                serde_json::json!({"name": s.name, "namespace": s.namespace, "tenant": s.tenant,
                "shard": s.shard, "failed": why})
            })
            .collect();
        let rejoining: Vec<serde_json::Value> = self
            .rejoining_replicas()
            .iter()
            .filter(|(s, _)| keep(&s.tenant))
            .map(|(s, why)| {
                serde_json::json!({"kind": format!("{:?}", s.kind).to_lowercase(), "name": s.name,
                "namespace": s.namespace, "tenant": s.tenant, "shard": s.shard, "damaged": why})
            })
            .collect();
        let moves: Vec<serde_json::Value> = md
            .moves()
            .iter()
            .filter(|(s, _)| keep(&s.tenant))
            .map(|(s, m)| {
                let (phase, at) = match m.phase {
                    // A replicated shard's move: its group's leadership is being handed over.
                    _ if md.replicas(s).is_some() => ("transferring_leadership", None),
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
            .filter(|p| keep(&p.shard.tenant))
            .map(|p| {
                serde_json::json!({"tenant": p.shard.tenant, "namespace": p.shard.namespace, "name": p.shard.name,
                    "shard": p.shard.shard, "direction": if p.outgoing { "out" } else { "in" }, "peer": p.peer,
                    "copied": p.copied, "source_tail": p.source_tail, "cutting": p.cutting})
            })
            .collect();
        serde_json::json!({"cluster": true, "node_id": self.node_id(), "leader": self.leader(),
            "fenced": self.broker.is_fenced(), "moves": moves, "move_progress": progress,
            "voters": self.voters(), "members": members, "shards": shards, "revoked": revoked, "replicas": replicas,
            "failed_replicas": failed, "rejoining_replicas": rejoining})
    }
}
