//! Operator diagnostics (FEATURE_INSPECT, REFERENCE.md §9.10): `shard_inspect`, this broker's
//! own view of one shard, and `subscriptions_list`, the subscriptions it serves. Only a signed
//! token holding exactly `node.view:cluster:*` may ask (wildcards such as `node.view:*` do not
//! count, nor does any static token): everyone else is refused `forbidden` and the stream stays
//! open. Answered from what this broker holds, never forwarded, changing nothing.

use super::*;
use crate::error_code::ErrorCode;
use crate::message::{self, Message};
use crate::shard::{Kind, ShardId};
use crate::transport::ConnId;

/// Subscriptions one `subscriptions_list` answer lists at most.
const LIST_MAX: u32 = 1000;
/// ... when the request names no limit.
const LIST_DEFAULT: u32 = 100;

impl Broker {
    /// Whether the stream's session holds exactly `node.view:cluster:*`.
    pub(super) fn may_inspect(st: &CtlStream) -> bool {
        st.session
            .as_ref()
            .and_then(|s| s.jwt.as_ref())
            .is_some_and(|j| j.perms.iter().any(crate::jwt::Perm::is_cluster_view))
    }

    fn refuse_inspect(&mut self, conn: ConnId, st: &mut CtlStream) {
        let r = Refusal::new(
            ErrorCode::Forbidden,
            "diagnostics need a signed token with exactly the permission node.view:cluster:*",
        );
        self.refuse(conn, st, r);
    }

    /// `shard_inspect`.
    pub(super) fn shard_inspect(&mut self, conn: ConnId, st: &mut CtlStream, q: message::ShardInspect) {
        if !Self::may_inspect(st) {
            return self.refuse_inspect(conn, st);
        }
        let view = self.inspect_view(&q);
        let m = Message::ShardInspectInfo(message::ShardInspectInfo { request_id: q.request_id, view: Box::new(view) });
        self.send(conn, st, json_frame(&m));
    }

    fn inspect_view(&self, q: &message::ShardInspect) -> message::InspectView {
        let kind = match q.kind {
            message::ShardKind::Stream => Kind::Stream,
            message::ShardKind::Cache => Kind::Cache,
        };
        let id = ShardId {
            kind,
            tenant: q.tenant_id.clone(),
            namespace: q.namespace.clone(),
            name: q.name.clone(),
            shard: q.shard,
        };
        let node_id = self.membership.view.as_ref().map(|c| c.local.clone()).unwrap_or_default();
        let k = KeyRef(&q.tenant_id, &q.namespace, &q.name);
        let mut view = message::InspectView {
            node_id: node_id.clone(),
            shards: 0,
            role: "none".into(),
            phase: "unassigned".into(),
            serving: false,
            reason: Some("not_assigned_here".into()),
            detail: None,
            generation: None,
            assignment: None,
            fence: None,
            lease: None,
            tail: None,
            committed: None,
            accepted_generation: None,
            replicas: None,
        };
        // What this broker holds of it: shard count, tail, whether it serves it.
        let (shards, local, unavailable, replica) = match kind {
            Kind::Stream => match self.node.streams.get(k.q()) {
                Some(e) => {
                    let sh = e.shards.get(q.shard as usize);
                    (
                        e.shards.len() as u32,
                        sh.map(|s| (s.log.committed_tail(), s.log.readable_tail())),
                        sh.and_then(|s| match s.serving.away() {
                            Some(Away::Unavailable { reason, .. }) => Some(reason),
                            _ => None,
                        }),
                        sh.and_then(|s| s.serving.replica().cloned()),
                    )
                }
                None => (0, None, None, None),
            },
            Kind::Cache => match self.node.caches.get(k.q()) {
                Some(c) => (1, (q.shard == 0).then(|| (c.tail(), c.tail())), None, c.replica.clone()),
                None => (0, None, None, None),
            },
        };
        view.shards = self.membership.view.as_ref().and_then(|c| c.shard_count(&id)).unwrap_or(shards);
        if view.shards == 0 || q.shard >= view.shards {
            view.shards = view.shards.max(shards);
            return view;
        }
        let Some(c) = &self.membership.view else {
            // A broker alone serves everything it has.
            view.role = "leader".into();
            view.phase = "active".into();
            view.serving = local.is_some();
            view.reason = None;
            view.tail = local.map(|l| l.0);
            view.committed = local.map(|l| l.1);
            return view;
        };
        let owner = c.owners.get(&id).cloned();
        let moving = c.moves.get(&id).map(|m| m.to.clone());
        if let Some((leader, _, generation)) = &owner {
            view.generation = Some(*generation);
            view.assignment = Some(message::InspectAssignment {
                generation: *generation,
                leader: leader.clone(),
                replicas: c.replicas.get(&id).cloned().unwrap_or_else(|| vec![leader.clone()]),
                draining: !c.brokers.iter().any(|(n, _)| n == leader),
                successor: moving.clone().unwrap_or_default(),
            });
        }
        let mine = match &replica {
            Some(ReplicaRole::Leading) => {
                view.role = "leader".into();
                true
            }
            Some(_) => {
                view.role = "follower".into();
                false
            }
            None => {
                let here = owner.as_ref().is_some_and(|(o, _, _)| *o == c.local);
                if here {
                    view.role = "leader".into();
                }
                here
            }
        };
        if mine || replica.is_some() {
            view.tail = local.map(|l| l.0);
            view.committed = local.map(|l| l.1);
        }
        let (phase, reason) = match (unavailable, mine) {
            _ if self.membership.fenced && mine => ("fencing", Some("lease_lapsed")),
            (Some(Unavailable::Moving), true) => ("draining", Some("draining")),
            (Some(Unavailable::Fenced), true) => ("fencing", Some("lease_lapsed")),
            (Some(_), true) => ("opening", Some("opening")),
            (None, true) => ("active", None),
            (_, false) if replica.is_some() => ("active", Some("not_assigned_here")),
            (_, false) => ("unassigned", Some("not_assigned_here")),
        };
        view.phase = phase.into();
        view.serving = mine && reason.is_none();
        view.reason = reason.map(str::to_owned);
        if let Some(to) = moving.filter(|_| mine) {
            view.detail = Some(format!("moving to {to}"));
        }
        view
    }

    /// Every stream subscription this broker serves, in (tenant, namespace, stream, shard,
    /// subscriber id) order, with its queue depth, capacity, drops and position.
    pub fn subscriptions_snapshot(&self) -> Vec<message::SubscriptionInfo> {
        let mut all: Vec<message::SubscriptionInfo> = Vec::new();
        for (cid, c) in self.conns.iter() {
            for sub in c.subs.values() {
                if sub.watch.is_some() {
                    continue; // a cache watch, not a subscription
                }
                let entry = self.node.streams.get(&sub.key);
                let log = entry.and_then(|e| e.shards.get(sub.shard as usize)).map(|s| &s.log);
                // A stream kept in memory holds its publishers for a subscriber over half full
                // (for a while: one that held them as long as allowed is excused and drops); a
                // durable stream's full queue drops the newest batch, for this subscriber only.
                let blocks =
                    entry.is_some_and(|e| !e.config.durable) && !self.cfg.publisher_hold_max.is_zero() && !sub.excused;
                all.push(message::SubscriptionInfo {
                    tenant_id: sub.key.tenant().to_owned(),
                    namespace: sub.key.namespace().to_owned(),
                    stream: sub.key.name().to_owned(),
                    shard: sub.shard,
                    subscriber_id: sub.id,
                    subscription_id: sub.id,
                    connection: Some(cid.0),
                    peer: None,
                    principal: None,
                    policy: if blocks { "block" } else { "drop_new" }.into(),
                    depth: sub.queue.len() as u64,
                    capacity: sub.capacity as u64,
                    dropped: sub.dropped,
                    position: sub.offered,
                    tail: log.map_or(0, ShardLog::committed_tail),
                    age_ms: 0,
                });
            }
        }
        all.sort_by(|a, b| {
            (&a.tenant_id, &a.namespace, &a.stream, a.shard, a.subscriber_id).cmp(&(
                &b.tenant_id,
                &b.namespace,
                &b.stream,
                b.shard,
                b.subscriber_id,
            ))
        });
        all
    }

    /// `subscriptions_list`: in (tenant, namespace, stream, shard, subscriber id) order, from
    /// after `cursor`, at most `limit` (100 by default, 1,000 at most).
    pub(super) fn subscriptions_list(&mut self, conn: ConnId, st: &mut CtlStream, q: message::SubscriptionsList) {
        if !Self::may_inspect(st) {
            return self.refuse_inspect(conn, st);
        }
        let limit = q.limit.unwrap_or(LIST_DEFAULT).clamp(1, LIST_MAX) as usize;
        let f = q.filter.unwrap_or_default();
        let after = q.cursor.map(|c| (c.tenant_id, c.namespace, c.stream, c.shard, c.subscriber_id));
        let all: Vec<message::SubscriptionInfo> = self
            .subscriptions_snapshot()
            .into_iter()
            .filter(|info| {
                f.tenant_id.as_ref().is_none_or(|x| *x == info.tenant_id)
                    && f.namespace.as_ref().is_none_or(|x| *x == info.namespace)
                    && f.stream.as_ref().is_none_or(|x| *x == info.stream)
                    && f.shard.is_none_or(|x| x == info.shard)
                    && f.principal.as_ref().is_none_or(|x| info.principal.as_ref() == Some(x))
                    && f.dropping.is_none_or(|d| d == (info.dropped > 0))
            })
            .collect();
        let order = |i: &message::SubscriptionInfo| {
            (i.tenant_id.clone(), i.namespace.clone(), i.stream.clone(), i.shard, i.subscriber_id)
        };
        let mut page: Vec<message::SubscriptionInfo> =
            all.into_iter().filter(|i| after.as_ref().is_none_or(|a| order(i) > *a)).take(limit + 1).collect();
        let next_cursor = (page.len() > limit).then(|| {
            page.truncate(limit);
            let last = page.last().map(order).unwrap_or_default();
            message::SubscriptionCursor {
                tenant_id: last.0,
                namespace: last.1,
                stream: last.2,
                shard: last.3,
                subscriber_id: last.4,
            }
        });
        let m = Message::SubscriptionsListInfo(message::SubscriptionsListInfo {
            request_id: q.request_id,
            node_id: self.membership.view.as_ref().map(|c| c.local.clone()).unwrap_or_default(),
            subscriptions: page,
            next_cursor,
        });
        self.send(conn, st, json_frame(&m));
    }
}

/// One shard this broker holds, as the operator web view shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardSummary {
    /// Tenant, namespace and stream.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard number.
    pub shard: u32,
    /// Kept on disk (offsets, history).
    pub durable: bool,
    /// This broker serves it (not moved away, not a follower's copy).
    pub served: bool,
    /// Offsets retained: `start..tail`.
    pub start: u64,
    /// The committed tail: records ever appended.
    pub tail: u64,
    /// Records and payload bytes retained.
    pub records: u64,
    /// Payload bytes retained.
    pub bytes: u64,
    /// Live subscribers here, and the sum of their positions (the driver turns its change into
    /// a delivery rate).
    pub subscribers: u64,
    /// Σ of each subscriber's next offset to deliver.
    pub delivered_positions: u64,
    /// Consumer groups: name, position (next offset owed), lag, records claimed and unsettled.
    pub groups: Vec<(String, Option<u64>, u64, u64)>,
}

impl Broker {
    /// Every shard this broker holds, sorted by name: what the web view lists per stream and
    /// shard. Reads nothing it does not hold in memory and changes nothing.
    pub fn shard_summaries(&self) -> Vec<ShardSummary> {
        let mut all = Vec::new();
        for (k, e) in &self.node.streams {
            if syslog::is_sys(k) {
                continue;
            }
            for (i, s) in e.shards.iter().enumerate() {
                let shard = i as u32;
                let mut subscribers = 0;
                let mut delivered_positions = 0u64;
                for (cid, id) in &s.subs {
                    if let Some(sub) = self.conns.get(cid).and_then(|c| c.subs.get(id)) {
                        subscribers += 1;
                        delivered_positions = delivered_positions.saturating_add(sub.offered.unwrap_or(0));
                    }
                }
                let tail = s.log.committed_tail();
                let mut groups: Vec<(String, Option<u64>, u64, u64)> = self
                    .node
                    .groups
                    .get(&(k.clone(), shard))
                    .into_iter()
                    .flatten()
                    .map(|(name, g)| {
                        let pos = g.durable.cursor;
                        let lag = tail.saturating_sub(pos.unwrap_or(s.log.start()));
                        (name.clone(), pos, lag, g.counts().0)
                    })
                    .collect();
                groups.sort();
                all.push(ShardSummary {
                    tenant: k.tenant().to_owned(),
                    namespace: k.namespace().to_owned(),
                    stream: k.name().to_owned(),
                    shard,
                    durable: e.config.durable,
                    served: s.serving.here(),
                    start: s.log.start(),
                    tail,
                    records: s.log.retained_records(),
                    bytes: s.log.retained_bytes(),
                    subscribers,
                    delivered_positions,
                    groups,
                });
            }
        }
        all.sort_by(|a, b| {
            (&a.tenant, &a.namespace, &a.stream, a.shard).cmp(&(&b.tenant, &b.namespace, &b.stream, b.shard))
        });
        all
    }
}
