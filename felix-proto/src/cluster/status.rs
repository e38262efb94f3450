//! The cluster as one broker sees it, as a JSON document: members, the metadata leader, every
//! shard's owner and generation, moves, and this broker's replicas. The metrics listener serves
//! it whole (`GET /cluster`); a client asks for it over the client protocol (`cluster_status`,
//! D52), scoped to its tenant unless it is the operator. Built here, not in a driver, so both
//! say the same thing.

use super::metadata::{Kind, MemberState, MovePhase, ShardId};
use super::node::ClusterNode;
use serde::Serialize;
use std::ops::Bound;

pub use crate::shard::page::{STATUS_PAGE_MAX, StatusPage};

/// The status document, borrowed from the node: serialised straight to bytes for `GET
/// /cluster` ([`ClusterNode::status_page_json`]) or to a JSON value for the client protocol. It
/// was built as a `serde_json::Value` tree first: with 10,000 shards each render made tens of
/// thousands of maps (a key compared and allocated per field), and a survivor polled for it
/// once a second spent a quarter of its work rendering while it failed over (perf).
#[derive(Serialize)]
struct Doc<'a> {
    cluster: bool,
    node_id: &'a str,
    leader: Option<&'a str>,
    fenced: bool,
    moves: Vec<MoveRow<'a>>,
    move_progress: Vec<ProgressRow<'a>>,
    voters: Vec<String>,
    members: Vec<MemberRow<'a>>,
    shards: Vec<ShardRow<'a>>,
    revoked: Revoked<'a>,
    replicas: Vec<ReplicaRow<'a>>,
    failed_replicas: Vec<FailedRow<'a>>,
    rejoining_replicas: Vec<RejoinRow<'a>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    next: Option<String>,
}

#[derive(Serialize)]
struct MemberRow<'a> {
    node_id: &'a str,
    client_addr: &'a str,
    cluster_addr: &'a str,
    state: MemberState,
}

#[derive(Serialize)]
struct ShardRow<'a> {
    kind: Kind,
    tenant: &'a str,
    namespace: &'a str,
    name: &'a str,
    shard: u32,
    owner: &'a str,
    generation: u64,
}

#[derive(Serialize)]
struct Revoked<'a> {
    jti: Vec<&'a str>,
    sub: Vec<&'a str>,
}

#[derive(Serialize)]
struct FollowerRow<'a> {
    node_id: &'a str,
    matched_index: u64,
    lag: u64,
}

#[derive(Serialize)]
struct ReplicaRow<'a> {
    kind: Kind,
    tenant: &'a str,
    namespace: &'a str,
    name: &'a str,
    shard: u32,
    replicas: Option<&'a [String]>,
    leader: Option<&'a str>,
    term: u64,
    role: &'static str,
    next_offset: u64,
    last_index: u64,
    first_index: u64,
    committed_index: u64,
    followers: Vec<FollowerRow<'a>>,
}

#[derive(Serialize)]
struct FailedRow<'a> {
    name: &'a str,
    namespace: &'a str,
    tenant: &'a str,
    shard: u32,
    failed: &'a str,
}

#[derive(Serialize)]
struct RejoinRow<'a> {
    kind: Kind,
    name: &'a str,
    namespace: &'a str,
    tenant: &'a str,
    shard: u32,
    damaged: &'a str,
}

#[derive(Serialize)]
struct MoveRow<'a> {
    tenant: &'a str,
    namespace: &'a str,
    name: &'a str,
    shard: u32,
    from: &'a str,
    to: &'a str,
    phase: &'static str,
    at: Option<u64>,
}

#[derive(Serialize)]
struct ProgressRow<'a> {
    tenant: &'a str,
    namespace: &'a str,
    name: &'a str,
    shard: u32,
    direction: &'static str,
    peer: &'a str,
    copied: u64,
    source_tail: u64,
    cutting: bool,
}

/// Which shards a document shows: `tenant`'s (all with `None`), after `after` and up to `end`
/// (a page's).
struct Scope<'a> {
    tenant: Option<&'a str>,
    after: Option<&'a ShardId>,
    end: Option<ShardId>,
}

impl Scope<'_> {
    fn keeps(&self, s: &ShardId) -> bool {
        self.tenant.is_none_or(|t| t == s.tenant)
            && self.after.is_none_or(|a| s > a)
            && self.end.as_ref().is_none_or(|e| s <= e)
    }
}

impl ClusterNode {
    /// The status document. `tenant` limits shards, moves and replicas to one tenant's and
    /// leaves revocations out (a tenant's view); `None` is the operator's whole view.
    pub fn status(&self, tenant: Option<&str>) -> serde_json::Value {
        self.status_page(tenant, None)
    }

    /// [`status`](Self::status), one page of it (`None`: whole).
    pub fn status_page(&self, tenant: Option<&str>, page: Option<&StatusPage>) -> serde_json::Value {
        self.render(tenant, page, |doc| serde_json::to_value(doc).unwrap_or_default())
    }

    /// [`status_page`](Self::status_page) as JSON text, serialised without building a value
    /// first (what `GET /cluster` answers).
    pub fn status_page_json(&self, tenant: Option<&str>, page: Option<&StatusPage>) -> Vec<u8> {
        self.render(tenant, page, |doc| serde_json::to_vec(doc).unwrap_or_default())
    }

    /// Builds the document of `tenant`'s shards on `page` and hands it to `out`.
    fn render<R>(&self, tenant: Option<&str>, page: Option<&StatusPage>, out: impl FnOnce(&Doc<'_>) -> R) -> R {
        let scope = Scope { tenant, after: page.and_then(|p| p.after.as_ref()), end: self.page_end(tenant, page) };
        let progress = self.broker.move_progress();
        let reports = self.replica_report_of(|s| scope.keeps(s));
        out(&self.status_doc(&scope, &progress, &reports))
    }

    /// The page's end: the `limit`-th shard with an owner after `after` (of `tenant`'s), when
    /// more follow.
    fn page_end(&self, tenant: Option<&str>, page: Option<&StatusPage>) -> Option<ShardId> {
        let p = page?;
        let limit = p.limit.clamp(1, STATUS_PAGE_MAX);
        let md = self.metadata();
        // Straight to the first shard after `after` (not a walk from the first).
        let mut after_start = match &p.after {
            Some(a) => md.owners().range::<ShardId, _>((Bound::Excluded(a), Bound::Unbounded)),
            None => md.owners().range::<ShardId, _>(..),
        }
        .map(|(s, _)| s)
        .filter(|s| tenant.is_none_or(|t| t == s.tenant));
        let last = after_start.nth(limit - 1)?;
        after_start.next().is_some().then(|| last.clone())
    }

    fn status_doc<'a>(
        &'a self,
        scope: &Scope<'_>,
        progress: &'a [crate::broker::MoveProgress],
        reports: &'a [super::node::ReplicaReport],
    ) -> Doc<'a> {
        let md = self.metadata();
        let (tenant, end) = (scope.tenant, &scope.end);
        let keep_shard = |s: &ShardId| scope.keeps(s);
        // The page's owned shards, found by range rather than by walking them all.
        let owners = match scope.after {
            Some(a) => md.owners().range::<ShardId, _>((Bound::Excluded(a), Bound::Unbounded)),
            None => md.owners().range::<ShardId, _>(..),
        };
        let shards = owners
            .take_while(|(s, _)| end.as_ref().is_none_or(|e| *s <= e))
            .filter(|(s, _)| keep_shard(s))
            .map(|(s, a)| ShardRow {
                kind: s.kind,
                tenant: &s.tenant,
                namespace: &s.namespace,
                name: &s.name,
                shard: s.shard,
                owner: &a.owner,
                generation: a.generation,
            })
            .collect();
        // Who is revoked is the operator's business, not a tenant's.
        let revoked = match tenant {
            None => Revoked {
                jti: md.revoked_jti().iter().map(String::as_str).collect(),
                sub: md.revoked_sub().iter().map(String::as_str).collect(),
            },
            Some(_) => Revoked { jti: Vec::new(), sub: Vec::new() },
        };
        let replicas = reports
            .iter()
            .filter(|r| keep_shard(&r.shard))
            .map(|r| ReplicaRow {
                kind: r.shard.kind,
                tenant: &r.shard.tenant,
                namespace: &r.shard.namespace,
                name: &r.shard.name,
                shard: r.shard.shard,
                replicas: md.replicas(&r.shard),
                leader: r.leader.as_deref(),
                term: r.term,
                role: r.role,
                next_offset: r.next_offset,
                last_index: r.last_index,
                first_index: r.first_index,
                committed_index: r.committed_index,
                followers: r
                    .followers
                    .iter()
                    .map(|(id, matched, lag)| FollowerRow { node_id: id, matched_index: *matched, lag: *lag })
                    .collect(),
            })
            .collect();
        let failed = self
            .failed_replicas()
            .iter()
            .filter(|(s, _)| keep_shard(s))
            .map(|(s, why)| FailedRow {
                name: &s.name,
                namespace: &s.namespace,
                tenant: &s.tenant,
                shard: s.shard,
                failed: why,
            })
            .collect();
        let rejoining = self
            .rejoining_replicas()
            .iter()
            .filter(|(s, _)| keep_shard(s))
            .map(|(s, why)| RejoinRow {
                kind: s.kind,
                name: &s.name,
                namespace: &s.namespace,
                tenant: &s.tenant,
                shard: s.shard,
                damaged: why,
            })
            .collect();
        let moves = md
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
                MoveRow {
                    tenant: &s.tenant,
                    namespace: &s.namespace,
                    name: &s.name,
                    shard: s.shard,
                    from: &m.from,
                    to: &m.to,
                    phase,
                    at,
                }
            })
            .collect();
        let move_progress = progress
            .iter()
            .filter(|p| keep_shard(&p.shard))
            .map(|p| ProgressRow {
                tenant: &p.shard.tenant,
                namespace: &p.shard.namespace,
                name: &p.shard.name,
                shard: p.shard.shard,
                direction: if p.outgoing { "out" } else { "in" },
                peer: &p.peer,
                copied: p.copied,
                source_tail: p.source_tail,
                cutting: p.cutting,
            })
            .collect();
        let members = md
            .members()
            .values()
            .map(|m| MemberRow {
                node_id: &m.id,
                client_addr: &m.client_addr,
                cluster_addr: &m.cluster_addr,
                state: m.state,
            })
            .collect();
        Doc {
            cluster: true,
            node_id: self.node_id(),
            leader: self.leader(),
            fenced: self.broker.is_fenced(),
            moves,
            move_progress,
            voters: self.voters(),
            members,
            shards,
            revoked,
            replicas,
            failed_replicas: failed,
            rejoining_replicas: rejoining,
            next: end.as_ref().map(ShardId::cursor),
        }
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
