//! This broker's view of a cluster: which shards it owns, who owns the others, and the answers
//! that come from it (`topology_view`, `shard_owners_view`, the redirects).
//!
//! The view is the metadata group's state ([`crate::cluster::metadata::Metadata`]) as applied on
//! this broker: the driver hands it over after every committed change
//! ([`Broker::apply_cluster`]). Every broker applies the same commands in the same order, so
//! every broker holds the same view at the same log index. A shard owned elsewhere is marked
//! moved: owner-only requests are answered `not_leader` (or `error` code `not_leader` to a client
//! without FEATURE_REDIRECT), its subscriptions here end with `shard_moved`. A shard whose owner
//! comes back here serves again.

use super::*;
use crate::binary::OwnerHint;
use crate::message::{self, Message};
use crate::shard::metadata::ClusterFacts;
use crate::shard::metadata::MemberState;
use crate::shard::{Kind, ShardId};
use crate::transport::ConnId;
use std::collections::BTreeMap;
use std::time::Instant;

pub(super) use crate::shard::view::ClusterView;

impl Broker {
    /// Takes the cluster's metadata as committed (after every change the metadata group
    /// applied): streams of the registry are created here with their shard counts, shards owned
    /// elsewhere are marked moved (their local subscriptions end with `shard_moved`), shards
    /// owned here serve. `local` is this broker's node id.
    pub fn apply_cluster(&mut self, md: &impl ClusterFacts, local: &str, now: Instant) {
        let now = self.clock.advance(now);
        let addr_of = |id: &str| md.members().get(id).map(|m| m.client_addr.clone());
        let brokers = md
            .members()
            .values()
            .filter(|m| m.state == MemberState::Active && !m.client_addr.is_empty())
            .map(|m| (m.id.clone(), m.client_addr.clone()))
            .collect();
        let owners: BTreeMap<ShardId, (String, Option<String>, u64)> =
            md.owners().iter().map(|(s, a)| (s.clone(), (a.owner.clone(), addr_of(&a.owner), a.generation))).collect();
        self.note_quorum_caches(md, local);
        self.note_moves(md, local, now);
        self.note_caches(md, local);
        self.forwards_to_gone_owners(md, now);
        let fenced = self.membership.fenced;
        for (shard, (owner, addr, generation)) in &owners {
            if shard.kind != Kind::Stream {
                continue;
            }
            let k = key(&shard.tenant, &shard.namespace, &shard.name);
            if !self.node.streams.contains_key(&k) {
                let shards = md.shard_count(Kind::Stream, &shard.tenant, &shard.namespace, &shard.name).unwrap_or(1);
                // Durable or in memory as the cluster created it, whatever this broker's default.
                let durable = !md.is_ephemeral(Kind::Stream, &shard.tenant, &shard.namespace, &shard.name);
                let replication = md.replication(Kind::Stream, &shard.tenant, &shard.namespace, &shard.name);
                let cfg = StreamConfig { shards, durable, replication, ..self.cfg.default_stream.clone() };
                self.create_stream(k.clone(), cfg);
            }
            // A replicated shard this broker holds a replica of is served by its role in the
            // shard's Raft group ([`Broker::set_replica_role`]), not by the metadata's owner (which
            // learns of a new leader only after it took over). Until its group says, it is
            // electing.
            // (The target of a replica move is one from the moment it joins the group, before
            // the metadata lists it; a broker that left a group is not one any more.)
            let joining = md.replicas(shard).is_some() && md.moving(shard).is_some_and(|m| m.to == local);
            let ev = if md.replicas(shard).is_some_and(|r| r.iter().any(|n| n == local)) || joining {
                ServingEvent::JoinedGroup
            } else if owner == local && md.replicas(shard).is_some() {
                // Named the owner of a replicated shard it holds no replica of (a replica move
                // given up after its target led): only a replica serves it; the group's leader
                // claims it again.
                ServingEvent::OwnedWithoutReplica
            } else if owner == local {
                // A fenced broker does not take its shards back until it is in contact again
                // (it never names itself as the owner to go to); one cutting over a move takes
                // no writes.
                ServingEvent::OwnedHere { fenced, cutting: self.cutting_over(shard).map(str::to_owned) }
            } else {
                let owner = OwnerHint { node_id: owner.clone(), addr: addr.clone(), generation: *generation };
                ServingEvent::OwnedElsewhere { owner, down: md.unavailable(shard) }
            };
            self.shard_on(&k, shard.shard, ev, now);
        }
        // Streams the metadata no longer has were deleted in the cluster: delete them here.
        let names = |o: &BTreeMap<ShardId, (String, Option<String>, u64)>| -> std::collections::BTreeSet<(String, String, String)> {
            o.keys()
                .filter(|s| s.kind == Kind::Stream)
                .map(|s| (s.tenant.clone(), s.namespace.clone(), s.name.clone()))
                .collect()
        };
        let before = self.membership.view.as_ref().map(|c| names(&c.owners)).unwrap_or_default();
        let after = names(&owners);
        let unavailable = md.owners().keys().filter(|s| md.unavailable(s)).cloned().collect();
        let moves = md.moves().clone();
        let replicas = md.replicated_shards().map(|(s, r)| (s.clone(), r.to_vec())).collect();
        self.membership.view =
            Some(ClusterView { brokers, owners, unavailable, local: local.to_owned(), moves, replicas });
        self.set_cluster_revocations(md.revoked_jti(), md.revoked_sub(), now);
        for (t, ns, s) in before.difference(&after) {
            self.delete_stream(t, ns, s, now);
        }
    }

    /// Whether this broker may write shard `shard` of a stream: outside a cluster always; in
    /// a cluster only while its view names it the owner. A shard its view does not know yet (a
    /// broker just restarted, still replaying the metadata) is `shard_unavailable`, retryable:
    /// never written by a broker that cannot tell it owns it.
    pub(super) fn owned_here(&self, t: &str, ns: &str, s: &str, shard: u32) -> Result<(), Refusal> {
        let Some(c) = &self.membership.view else { return Ok(()) };
        if let Some(sh) = self.node.streams.get(KeyRef(t, ns, s).q()).and_then(|e| e.shards.get(shard as usize))
            && sh.serving.is_replica()
        {
            // A replica: its role in the shard's group decides.
            return match sh.serving.away() {
                None => Ok(()),
                Some(Away::Unavailable { reason, node }) => Err(reason.refusal(shard, node)),
                Some(Away::Owner(m)) => {
                    Err(Refusal::new(ErrorCode::NotLeader, format!("shard {shard} is led by {}", m.node_id)))
                }
            };
        }
        let id = ShardId { kind: Kind::Stream, tenant: t.into(), namespace: ns.into(), name: s.into(), shard };
        if c.replicas.get(&id).is_some_and(|r| !r.contains(&c.local))
            && c.owners.get(&id).is_some_and(|o| o.0 == c.local)
        {
            // Named the owner of a replicated shard without a replica of it here: only its
            // group writes it.
            return Err(Unavailable::NoLeader.refusal(shard, ""));
        }
        match c.owners.get(&id) {
            Some((owner, _, _)) if *owner == c.local => Ok(()),
            Some((owner, _, generation)) => Err(Refusal::new(
                ErrorCode::NotLeader,
                format!("shard {shard} is owned by {owner} (generation {generation})"),
            )),
            None => {
                let mut r = Refusal::new(
                    ErrorCode::ShardUnavailable,
                    format!("shard {shard} of {s} is not known to this broker's view of the cluster yet"),
                );
                r.retry = RetryClass::Retry;
                Err(r)
            }
        }
    }

    /// `topology`: the brokers that serve clients (draining ones left out).
    pub(super) fn topology(&mut self, conn: ConnId, st: &mut CtlStream) {
        let brokers = self
            .membership
            .view
            .as_ref()
            .map(|c| {
                c.brokers
                    .iter()
                    .map(|(id, addr)| message::BrokerAddr { node_id: id.clone(), addr: addr.clone() })
                    .collect()
            })
            .unwrap_or_default();
        self.send(conn, st, json_frame(&Message::TopologyView(message::TopologyView { brokers })));
    }

    /// `shard_owners`: one entry per shard in shard order; empty for an unknown name.
    pub(super) fn shard_owners(&mut self, conn: ConnId, st: &mut CtlStream, q: message::ShardOwners) {
        let kind = match q.kind {
            message::ShardKind::Stream => Kind::Stream,
            message::ShardKind::Cache => Kind::Cache,
        };
        let action = if kind == Kind::Stream { Action::Subscribe } else { Action::CacheRead };
        if let Err(r) = self.authorize(st, &q.tenant_id, &q.namespace, &q.name, action) {
            return self.refuse(conn, st, r);
        }
        let owners = match &self.membership.view {
            Some(c) => c
                .owners
                .range(
                    ShardId {
                        kind,
                        tenant: q.tenant_id.clone(),
                        namespace: q.namespace.clone(),
                        name: q.name.clone(),
                        shard: 0,
                    }..=ShardId {
                        kind,
                        tenant: q.tenant_id.clone(),
                        namespace: q.namespace.clone(),
                        name: q.name.clone(),
                        shard: u32::MAX,
                    },
                )
                .map(|(s, (owner, addr, generation))| {
                    if c.unavailable.contains(s) {
                        // Unservable: no owner named, the reason instead.
                        return message::ShardOwner {
                            shard: s.shard,
                            node_id: None,
                            addr: None,
                            generation: *generation,
                            unavailable: Some("owner_down".into()),
                        };
                    }
                    message::ShardOwner {
                        shard: s.shard,
                        node_id: Some(owner.clone()),
                        addr: addr.clone(),
                        generation: *generation,
                        unavailable: None,
                    }
                })
                .collect(),
            // Outside a cluster: one shard, no owner named, generation 0.
            None => vec![message::ShardOwner { shard: 0, node_id: None, addr: None, generation: 0, unavailable: None }],
        };
        let m = Message::ShardOwnersView(message::ShardOwnersView { request_id: q.request_id, owners });
        self.send(conn, st, json_frame(&m));
    }
}

impl Broker {
    /// Streams this broker's configuration declares that the cluster's registry does not have
    /// yet, as the registry's creation asks for them: `(tenant, namespace, name, shards,
    /// ephemeral, replication)`. The metadata leader proposes them, so a configured stream is
    /// in the cluster (its shards placed, listed by `cluster status`) before its first use.
    pub(crate) fn configured_streams_to_register(&self) -> Vec<(String, String, String, u32, bool, u32)> {
        let Some(view) = &self.membership.view else { return Vec::new() };
        self.cfg
            .streams
            .iter()
            .filter(|s| !view.knows_stream(&s.tenant_id, &s.namespace, &s.name))
            .map(|s| {
                let c = &s.config;
                (s.tenant_id.clone(), s.namespace.clone(), s.name.clone(), c.shards.max(1), !c.durable, c.replication)
            })
            .collect()
    }

    /// In a cluster: whether this broker is fenced ([`set_fenced`](Self::set_fenced)).
    pub fn is_fenced(&self) -> bool {
        self.membership.fenced
    }

    /// The cluster node says this broker lost contact with the metadata leader (`true`), or is
    /// back in contact (`false`). Fenced, it may have been declared down and its shards given
    /// to others, so it serves none of its own: its subscriptions on them end as on a move
    /// (after what they were sent), and publishes, subscribes and cache requests for them are
    /// refused `shard_unavailable` reason `fenced` (retry) until it is back. Replicated shards
    /// are their Raft groups' to decide (a leader that lost its majority steps down).
    pub fn set_fenced(&mut self, fenced: bool, now: Instant) {
        let now = self.clock.advance(now);
        if self.membership.fenced == fenced {
            return;
        }
        self.membership.fenced = fenced;
        if !fenced {
            // Copies into this broker waited for a current view (see `ask_copy`).
            let due: Vec<crate::shard::ShardId> = self.membership.moves_in.keys().cloned().collect();
            for s in due {
                self.ask_copy(&s, now, false);
            }
        }
        if self.membership.view.is_none() {
            return;
        }
        // Fenced: the shards served here; back in contact: the shards fenced (both in order).
        let mut owned: Vec<(Key, u32)> = Vec::new();
        for (k, e) in &self.node.streams {
            for (i, sh) in e.shards.iter().enumerate() {
                let ours = if fenced { sh.serving == Serving::Here } else { sh.serving == Serving::Fenced };
                if ours && !syslog::is_sys(k) {
                    owned.push((k.clone(), i as u32));
                }
            }
        }
        owned.sort();
        for (k, n) in owned {
            let ev = if fenced {
                ServingEvent::Fence
            } else {
                // Back in contact, a shard cutting over a move still takes no writes (its new
                // owner may already have started at the cut-over tail).
                let id = ShardId {
                    kind: Kind::Stream,
                    tenant: k.tenant().to_owned(),
                    namespace: k.namespace().to_owned(),
                    name: k.name().to_owned(),
                    shard: n,
                };
                ServingEvent::Unfence { cutting: self.cutting_over(&id).map(str::to_owned) }
            };
            self.shard_on(&k, n, ev, now);
        }
    }
}
