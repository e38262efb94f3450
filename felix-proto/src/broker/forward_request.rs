//! Forwarding cache and counter requests: in a cluster every cache has one owner (one shard,
//! placed like a stream's), and, as the reference says, "non-owners forward cache and counter
//! operations". `cache_get`, `cache_put`, `cache_delete`, `cache_put_if`, `cache_delete_if`,
//! `counter_add` and `counter_get` reaching a broker that does not own the cache travel to the
//! owner, which serves them exactly as if the client were its own, and the client gets the
//! owner's answer bytes (built for the client's own flags and features) in its turn on its
//! stream. `cache_watch` is owner-only: `not_leader`.
//!
//! ```text
//!   client ──cache_put──▶ origin ──ForwardRequest──▶ owner: an internal stream of an internal
//!                                                   connection for the origin, vouched for
//!   client ◀──cache_ok─── origin ◀──ForwardRequestAnswer── owner: its answer, intercepted
//! ```
//!
//! The origin checked the tenant and the permission (the owner trusts a cluster peer; the
//! transport authenticated it). An answer that does not come within [`FORWARD_TIMEOUT`] is
//! `unacknowledged` for a write (outcome unknown) and `shard_unavailable` for a read; an owner the
//! driver cannot reach is `shard_unavailable` (retry). A conditional write is never retried by the
//! origin (the reference's rule): nothing here retries anything.

use super::*;
use crate::error_code::{ErrorCode, RetryClass};
use crate::frame::FrameDecoder;
use crate::message::{self, Decoded, Message};
use crate::shard::metadata::ClusterFacts;
use crate::shard::{Kind, ShardId};
use crate::transport::{ConnId, Dir, Side, StreamId};
use crate::{Payload, binary::ErrorDetail};
use std::time::Instant;

pub use super::forward::FORWARD_TIMEOUT;

pub use crate::shard::forward::ForwardedRequest;

/// A forwarded request not answered yet (origin side).
#[derive(Debug)]
pub(super) struct PendingRequest {
    conn: ConnId,
    stream: StreamId,
    offer: ClientOffer,
    write: bool,
    deadline: Instant,
    owner: String,
}

/// The requests the owner serves for other brokers: one internal connection per origin.
#[derive(Debug, Default)]
pub(super) struct Served {
    /// Internal connection → origin node id.
    conns: std::collections::BTreeMap<ConnId, String>,
    by_origin: std::collections::BTreeMap<String, ConnId>,
    /// (internal connection, stream) → the origin's request id.
    streams: std::collections::BTreeMap<(ConnId, StreamId), u64>,
    next_stream: u64,
}

/// The cache and counter requests that go to the cache's owner: (tenant, namespace, cache,
/// write).
fn cache_target(m: &Message) -> Option<(&str, &str, &str, bool)> {
    Some(match m {
        Message::CacheGet(g) => (&g.tenant_id, &g.namespace, &g.cache, false),
        Message::CachePut(p) => (&p.tenant_id, &p.namespace, &p.cache, true),
        Message::CacheDelete(d) => (&d.tenant_id, &d.namespace, &d.cache, true),
        Message::CachePutIf(p) => (&p.tenant_id, &p.namespace, &p.cache, true),
        Message::CacheDeleteIf(d) => (&d.tenant_id, &d.namespace, &d.cache, true),
        Message::CounterAdd(a) => (&a.tenant_id, &a.namespace, &a.cache, true),
        Message::CounterGet(g) => (&g.tenant_id, &g.namespace, &g.cache, false),
        Message::CacheKeys(k) => (&k.tenant_id, &k.namespace, &k.cache, false),
        _ => return None,
    })
}

/// Where a cache is served from, as this broker's view of the cluster says.
enum CacheHome {
    /// Here (or not in a cluster).
    Here,
    /// The cluster does not know it yet.
    Unknown,
    /// At this owner (or replicated cache's leader), which is up.
    Elsewhere(crate::binary::OwnerHint),
    /// Nowhere now: a replicated cache electing its leader, or one settling; this broker
    /// fenced or handing the cache over; its owner down.
    Refused(Refusal),
}

impl Broker {
    fn cache_home(&self, t: &str, ns: &str, c: &str) -> CacheHome {
        let Some(view) = &self.membership.view else { return CacheHome::Here };
        // A replicated cache with a replica here: where its group says it is led.
        match self.quorum_cache_home(&key(t, ns, c)) {
            Some(Ok(leader)) => return CacheHome::Elsewhere(leader),
            Some(Err(r)) => return CacheHome::Refused(r),
            None if self.is_quorum_cache(&key(t, ns, c)) => return CacheHome::Here,
            None => {}
        }
        let id = ShardId { kind: Kind::Cache, tenant: t.into(), namespace: ns.into(), name: c.into(), shard: 0 };
        match view.owners.get(&id) {
            None => CacheHome::Unknown,
            // Named the owner (its group's last recorded leader) of a replicated cache this
            // broker no longer holds a replica of (moved away, the next leader not recorded
            // yet): only a replica serves it. Served here as a plain cache it would acknowledge
            // writes its group never saw (found by the world simulation, seed 506884).
            Some((owner, _, _)) if *owner == view.local && view.replicas.contains_key(&id) => {
                CacheHome::Refused(Unavailable::NoLeader.refusal(0, ""))
            }
            Some((owner, _, _)) if *owner == view.local && self.membership.fenced => {
                CacheHome::Refused(Unavailable::Fenced.refusal(0, owner))
            }
            // Handing the cache over to its next owner: writes and new watches wait.
            Some((owner, _, _)) if *owner == view.local && self.cutting_over(&id).is_some() => {
                let to = self.cutting_over(&id).unwrap_or_default();
                CacheHome::Refused(Unavailable::Moving.refusal(0, to))
            }
            Some((owner, _, _)) if *owner == view.local => CacheHome::Here,
            Some((owner, _, _)) if view.unavailable.contains(&id) => {
                CacheHome::Refused(Unavailable::OwnerDown.refusal(0, owner))
            }
            Some((owner, addr, generation)) => CacheHome::Elsewhere(crate::binary::OwnerHint {
                node_id: owner.clone(),
                addr: addr.clone(),
                generation: *generation,
            }),
        }
    }

    /// A cache the cluster does not know yet: propose it and answer `shard_unavailable`
    /// (reason `creating`), as for a stream.
    fn cache_creating(&mut self, t: &str, ns: &str, c: &str) -> Refusal {
        let spec = self.cfg.caches.iter().find(|s| s.tenant_id == t && s.namespace == ns && s.name == c);
        let replication = spec.map_or(self.cfg.cache_replication, |s| s.replication);
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ProposeCache {
            tenant_id: t.to_owned(),
            namespace: ns.to_owned(),
            cache: c.to_owned(),
            replication,
        }));
        let mut r =
            Refusal::new(ErrorCode::ShardUnavailable, format!("cache {ns}/{c} is being created in the cluster; retry"));
        r.detail = Some(ErrorDetail { reason: Some("creating".into()), retry_after_ms: Some(200) });
        r.retry = RetryClass::Retry;
        r
    }

    /// `cache_watch` in a cluster: served by the owner only. `Some(answer)` when it is not
    /// this broker.
    pub(super) fn cache_watch_elsewhere(&mut self, st: &CtlStream, w: &message::CacheWatch) -> Option<Message> {
        let offer = Self::features_of(st);
        match self.cache_home(&w.tenant_id, &w.namespace, &w.cache) {
            CacheHome::Here => None,
            CacheHome::Unknown => {
                let r = self.cache_creating(&w.tenant_id, &w.namespace, &w.cache);
                Some(Self::error_message(&offer, &r))
            }
            CacheHome::Elsewhere(m) => Some(Self::not_leader_answer(self.server_features, &offer, Away::Owner(&m), 0)),
            CacheHome::Refused(r) => Some(Self::error_message(&offer, &r)),
        }
    }

    /// The shard count `cache_shards` answers in a cluster: 1 once the cluster knows the cache.
    pub(super) fn cluster_cache_shards(&self, t: &str, ns: &str, c: &str) -> Option<u32> {
        let view = self.membership.view.as_ref()?;
        let id = ShardId { kind: Kind::Cache, tenant: t.into(), namespace: ns.into(), name: c.into(), shard: 0 };
        Some(u32::from(view.owners.contains_key(&id)))
    }

    /// Origin side: a cache or counter request for a cache owned elsewhere goes to its owner.
    /// `true` when it was dealt with here (forwarded or refused); `false`: serve it locally.
    pub(super) fn forward_cache_request(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        m: &Message,
        now: Instant,
    ) -> bool {
        if self.membership.view.is_none() {
            return false;
        }
        let Some((t, ns, c, write)) = cache_target(m) else { return false };
        let (t, ns, c) = (t.to_owned(), ns.to_owned(), c.to_owned());
        let action = if write { Action::CacheWrite } else { Action::CacheRead };
        if let Err(r) = check_names(&[("tenant", &t), ("namespace", &ns), ("cache", &c)])
            .and_then(|()| self.authorize(st, &t, &ns, &c, action))
        {
            self.refuse(conn, st, r);
            return true;
        }
        let moved = match self.cache_home(&t, &ns, &c) {
            CacheHome::Here => return false,
            // A listing asks, it never creates (D50).
            CacheHome::Unknown if matches!(m, Message::CacheKeys(_)) => {
                self.refuse(conn, st, Refusal::new(ErrorCode::NotFound, format!("cache {ns}/{c} not found")));
                return true;
            }
            CacheHome::Unknown => {
                let r = match check_new_name("tenant", &t)
                    .and_then(|()| check_new_name("namespace", &ns))
                    .and_then(|()| check_new_name("cache", &c))
                {
                    Ok(()) => self.cache_creating(&t, &ns, &c),
                    Err(r) => r,
                };
                self.refuse(conn, st, r);
                return true;
            }
            CacheHome::Elsewhere(m) => m,
            CacheHome::Refused(r) => {
                self.refuse(conn, st, r);
                return true;
            }
        };
        let Some(sess) = st.session.as_ref() else { return false };
        let mut request = BytesMut::new();
        if m.encode(&mut request).is_err() {
            self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, "request too large to forward"));
            return true;
        }
        let id = self.membership.next_forward;
        self.membership.next_forward += 1;
        let offer = sess.offer;
        let fwd = ForwardedRequest {
            id,
            tenant_id: t,
            principal: sess.principal.clone(),
            flags: offer.flags.0,
            features: offer.features.0,
            request: request.freeze(),
        };
        let deadline = crate::transport::after(now, FORWARD_TIMEOUT);
        self.membership.forward_deadlines.insert((deadline, id));
        self.membership
            .request_forwards
            .insert(id, PendingRequest { conn, stream: st.id, offer, write, deadline, owner: moved.node_id.clone() });
        Self::hold(st, HeldFor::Forward(id));
        self.stats.requests_forwarded += 1;
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardRequest { to: moved.node_id, request: fwd }));
        true
    }

    /// The owner answered a request forwarded from here: the client gets its answer bytes, in
    /// its turn on its stream.
    pub(crate) fn handle_forward_request_answer(&mut self, id: u64, data: Bytes, now: Instant) {
        self.clock.advance(now);
        let Some(p) = self.membership.request_forwards.remove(&id) else { return };
        self.membership.forward_deadlines.remove(&(p.deadline, id));
        self.fill_held(p.conn, p.stream, HeldFor::Forward(id), data);
    }

    /// The driver could not deliver a forwarded request to the cache's owner:
    /// `shard_unavailable` (retry).
    pub(crate) fn handle_forward_request_failed(&mut self, id: u64, now: Instant) {
        self.clock.advance(now);
        let Some(p) = self.membership.request_forwards.remove(&id) else { return };
        self.membership.forward_deadlines.remove(&(p.deadline, id));
        let mut r =
            Refusal::new(ErrorCode::ShardUnavailable, format!("the cache's owner {} cannot be reached", p.owner));
        r.retry = RetryClass::Retry;
        let data = json_frame(&Self::error_message(&p.offer, &r));
        self.fill_held(p.conn, p.stream, HeldFor::Forward(id), data);
    }

    /// Forwarded requests whose answer did not come in time (called with the publish forwards'
    /// deadlines, which share the id space).
    pub(super) fn forward_request_timed_out(&mut self, id: u64) -> bool {
        self.give_up_request_forward(id, "did not answer in time")
    }

    /// Forwarded requests whose owner the metadata now says is gone (declared down, or no
    /// longer a member): answered now as a timeout would answer them, since a killed owner's
    /// answer never comes. In the order they were forwarded.
    pub(super) fn request_forwards_to_gone_owners(&mut self, md: &impl ClusterFacts) {
        let mut gone: Vec<(u64, Instant)> = self
            .membership
            .request_forwards
            .iter()
            .filter(|(_, p)| md.is_gone(&p.owner))
            .map(|(id, p)| (*id, p.deadline))
            .collect();
        gone.sort_unstable();
        for (id, deadline) in gone {
            self.membership.forward_deadlines.remove(&(deadline, id));
            self.give_up_request_forward(id, "went down before it answered");
        }
    }

    /// Cache and counter requests forwarded to `peer` when the connection to it closed: their
    /// answers are not coming on it, so they are answered now (a write's outcome unknown, a read
    /// to be sent again) rather than after the forward timeout. In the order they were
    /// forwarded.
    pub(super) fn request_forwards_on_lost_connection(&mut self, peer: &str) {
        let mut lost: Vec<(u64, Instant)> = self
            .membership
            .request_forwards
            .iter()
            .filter(|(_, p)| p.owner == peer)
            .map(|(id, p)| (*id, p.deadline))
            .collect();
        lost.sort_unstable();
        for (id, deadline) in lost {
            self.membership.forward_deadlines.remove(&(deadline, id));
            self.give_up_request_forward(id, "closed its connection to this broker before it answered");
        }
    }

    /// Answers a forwarded request whose owner's answer is not coming: a write's outcome is
    /// unknown, a read may be sent again.
    fn give_up_request_forward(&mut self, id: u64, why: &str) -> bool {
        let Some(p) = self.membership.request_forwards.remove(&id) else { return false };
        let r = if p.write {
            Refusal::new(
                ErrorCode::Unacknowledged,
                format!("the cache's owner {} {why}; the write may have been applied", p.owner),
            )
        } else {
            let mut r = Refusal::new(ErrorCode::ShardUnavailable, format!("the cache's owner {} {why}", p.owner));
            r.retry = RetryClass::Retry;
            r
        };
        let data = json_frame(&Self::error_message(&p.offer, &r));
        self.fill_held(p.conn, p.stream, HeldFor::Forward(id), data);
        true
    }

    /// Owner side: a cache or counter request another broker forwarded here. Its answer comes
    /// out as [`ClusterOutput::ForwardRequestAnswer`] to `from`.
    pub(crate) fn handle_forwarded_request(&mut self, from: &str, r: ForwardedRequest, now: Instant) {
        let now = self.clock.advance(now);
        self.stats.requests_forwarded_in += 1;
        let offer = ClientOffer {
            negotiating: true,
            flags: crate::flags::Flags(r.flags),
            flags_hi: crate::flags::FlagsHi::EMPTY,
            features: crate::features::Features(r.features),
            extended: true,
        };
        let answer_now = |b: &mut Broker, refusal: Refusal| {
            let data = json_frame(&Self::error_message(&offer, &refusal));
            b.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardRequestAnswer {
                to: from.to_owned(),
                id: r.id,
                data,
            }));
        };
        let mut d = FrameDecoder::new();
        d.push(r.request.clone());
        let m = match d.next_frame().map(|f| f.map(|f| f.decode_payload())) {
            Ok(Some(Ok(Payload::Json(Decoded::Message(m))))) if cache_target(&m).is_some() => m,
            _ => return answer_now(self, Refusal::new(ErrorCode::InvalidRequest, "not a forwardable request")),
        };
        let Some((t, ns, c, _)) = cache_target(&m) else { return };
        if t != r.tenant_id {
            return answer_now(self, Refusal::new(ErrorCode::Forbidden, "forwarded for another tenant"));
        }
        match self.cache_home(t, ns, c) {
            CacheHome::Here => {}
            CacheHome::Unknown => {
                let mut refusal =
                    Refusal::new(ErrorCode::ShardUnavailable, format!("cache {ns}/{c} is not known here yet"));
                refusal.retry = RetryClass::Retry;
                return answer_now(self, refusal);
            }
            CacheHome::Elsewhere(moved) => {
                let data = json_frame(&Self::not_leader_answer(self.server_features, &offer, Away::Owner(&moved), 0));
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardRequestAnswer {
                    to: from.to_owned(),
                    id: r.id,
                    data,
                }));
                return;
            }
            CacheHome::Refused(refusal) => return answer_now(self, refusal),
        }
        // An internal connection per origin, an internal stream per request, vouched for.
        let conn = match self.membership.served.by_origin.get(from) {
            Some(c) => *c,
            None => {
                let c = self.internal_connection(now);
                self.membership.served.by_origin.insert(from.to_owned(), c);
                self.membership.served.conns.insert(c, from.to_owned());
                c
            }
        };
        let stream = StreamId::new(Side::Client, Dir::Bi, self.membership.served.next_stream);
        self.membership.served.next_stream += 1;
        self.membership.served.streams.insert((conn, stream), r.id);
        let mut decoder = FrameDecoder::new();
        decoder.set_max_frame_len(self.cfg.max_frame_len);
        let mut st = Box::new(CtlStream::new(stream, decoder, None));
        st.session = Some(Session {
            tenant_id: r.tenant_id,
            principal: r.principal,
            token: 0,
            vouched: true,
            jwt: None,
            cert: false,
            offer,
            window: None,
            ack_on_commit: false,
            widths: HashMap::new(),
        });
        self.handle_message(conn, &mut st, m, now);
        if !st.done_serving() {
            // Answered later (a counter write waits for storage): keep it until then.
            if let Some(c) = self.conns.get_mut(&conn) {
                c.streams.insert(stream, st);
            }
        }
    }

    /// A connection for requests served on another broker's behalf: authenticated, never
    /// counted as a client's.
    fn internal_connection(&mut self, now: Instant) -> ConnId {
        let c = self.open_conn(None, now);
        self.stats.connections_opened = self.stats.connections_opened.saturating_sub(1);
        self.authenticated(c);
        c
    }

    /// How many of the connections are internal ones.
    pub(super) fn internal_connections(&self) -> usize {
        self.membership.served.conns.len()
    }

    /// Turns an output for an internal connection into what it stands for: the first answer on
    /// an internal stream goes back to the origin; everything else about it is dropped.
    pub(super) fn intercept_internal(&mut self, o: BrokerOutput) -> Option<BrokerOutput> {
        let conn = match &o {
            BrokerOutput::Transport(TransportOutput::Transmit { conn, .. })
            | BrokerOutput::Transport(TransportOutput::Finish { conn, .. })
            | BrokerOutput::Transport(TransportOutput::StopSending { conn, .. })
            | BrokerOutput::Transport(TransportOutput::PauseReading { conn, .. })
            | BrokerOutput::Transport(TransportOutput::ResumeReading { conn, .. })
            | BrokerOutput::Transport(TransportOutput::OpenUni { conn, .. }) => *conn,
            _ => return Some(o),
        };
        let Some(origin) = self.membership.served.conns.get(&conn).cloned() else { return Some(o) };
        let BrokerOutput::Transport(TransportOutput::Transmit { stream, data, .. }) = o else { return None };
        let id = self.membership.served.streams.remove(&(conn, stream))?;
        if let Some(c) = self.conns.get_mut(&conn) {
            c.streams.remove(&stream);
        }
        Some(BrokerOutput::Cluster(ClusterOutput::ForwardRequestAnswer { to: origin, id, data }))
    }
}

impl Served {
    /// No internal connection yet (the common case: outputs pass straight through).
    pub(super) fn is_empty(&self) -> bool {
        self.conns.is_empty()
    }
}

impl CtlStream {
    /// An internal stream that answered and owes nothing more.
    fn done_serving(&self) -> bool {
        self.outstanding == 0 && self.held.is_empty()
    }
}
