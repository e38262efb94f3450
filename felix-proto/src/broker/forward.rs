//! Forwarding: a publish that reaches a broker of a cluster which does not own its shard goes to
//! the owner over the cluster transport, and the client gets the owner's answer (with the
//! owner's identity in the binary ack's 0x0080 section, for a client that offered it).
//!
//! ```text
//!   client ──publish──▶ origin ──ClusterOutput::Forward──▶ (driver, cluster transport)
//!                                                           ──▶ owner.handle_forwarded
//!   client ◀──answer─── origin ◀──handle_forward_answer── ◀── ClusterOutput::ForwardAnswer
//! ```
//!
//! Only plain publishes (JSON or binary, acked or not) are forwarded: idempotent and
//! conditional publishes and commits are owner-only (answered `not_leader`), as the reference
//! says. The origin checked the tenant and the permission; the owner trusts a cluster peer (the
//! transport authenticated it) and appends as if the client were its own. An answer that never
//! comes is `unacknowledged` (outcome unknown) after [`FORWARD_TIMEOUT`]; an owner the driver
//! cannot reach is `shard_unavailable` (retry).

use super::publish::NewBatch;
use super::*;
use crate::binary::{OwnerHint, PublishAck};
use crate::error_code::{ErrorCode, RetryClass};
use crate::flags::Flags;
use crate::routing::shard_for_key;
use crate::shard::metadata::ClusterFacts;
use crate::transport::ConnId;
use bytes::BytesMut;
use std::time::{Duration, Instant};

/// How long the origin waits for the owner's answer to a forwarded acked publish.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(10);

pub use crate::shard::forward::{ForwardOutcome, ForwardedPublish};

/// An acked publish forwarded and not answered yet.
#[derive(Debug)]
pub(super) struct Forwarding {
    waiter: Waiter,
    owner: OwnerHint,
    deadline: Instant,
    /// The shard it went to.
    shard: (Key, u32),
}

impl Broker {
    /// Forwards `req` (which [`route`](Self::route) refused `not_leader`) to the owner of its
    /// shard, when this broker is in a cluster and the request may be forwarded. `Some(req)`:
    /// it was not, and here it is back (the caller answers the refusal). It takes the request
    /// rather than a reference so that its names and records move into the forward, uncopied:
    /// this runs for every batch a forwarding broker passes on.
    pub(super) fn try_forward(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        req: PublishReq,
        reply: Reply,
        now: Instant,
    ) -> Option<PublishReq> {
        if self.membership.view.is_none()
            || req.idempotent.is_some()
            || req.expected_offset.is_some()
            || req.state.is_some()
        {
            return Some(req);
        }
        // A fenced broker (out of touch with the metadata leader) forwards nothing: the owner
        // it knows may be stale and the link to it may be what cut it off (a one-way fault left
        // every forwarded batch unanswered for the whole forward timeout). The refusal stands:
        // `not_leader` names the owner, and the client goes there itself.
        if self.membership.fenced {
            return Some(req);
        }
        let Some((key, entry)) =
            self.node.streams.get_key_value(KeyRef(&req.tenant_id, &req.namespace, &req.stream).q())
        else {
            return Some(req);
        };
        let shards = entry.shards.len() as u32;
        let shard = req.shard.unwrap_or_else(|| shard_for_key(req.key.as_deref(), shards, entry.config.routing));
        // Nobody can write a shard that is unavailable until its owner is back: the refusal
        // route() made stands.
        let Some(Away::Owner(owner)) = entry.shards.get(shard as usize).and_then(|s| s.serving.away()) else {
            return Some(req);
        };
        let Some(sess) = st.session.as_ref() else { return Some(req) };
        let (owner, key) = (owner.clone(), key.clone());
        let publisher = Some(sess.principal.clone()).filter(|p| !p.is_empty());
        let offer = sess.offer;
        let id = self.membership.next_forward;
        self.membership.next_forward += 1;
        let acked = !matches!(reply, Reply::None);
        let (to, generation) = (owner.node_id.clone(), owner.generation);
        if acked {
            let seq = self.owe(conn, st, reply);
            let deadline = crate::transport::after(now, FORWARD_TIMEOUT);
            self.membership.forward_deadlines.insert((deadline, id));
            let waiter = Waiter { conn, stream: st.id, seq, reply, offer };
            self.membership.forwards.insert(id, Forwarding { waiter, owner, deadline, shard: (key, shard) });
        }
        self.stats.publishes_forwarded += 1;
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Forward {
            to,
            publish: ForwardedPublish {
                id,
                tenant_id: req.tenant_id,
                namespace: req.namespace,
                stream: req.stream,
                shard,
                generation,
                key: req.key,
                records: req.records,
                publisher,
                acked,
            },
        }));
        None
    }

    /// A publish another broker of the cluster forwarded here (the owner side). Its answer, for
    /// an acked one, comes out as [`ClusterOutput::ForwardAnswer`] to `from`.
    pub fn handle_forwarded(&mut self, from: &str, p: ForwardedPublish, now: Instant) {
        let now = self.clock.advance(now);
        self.stats.publishes_forwarded_in += 1;
        let (from, id, acked) = (from.to_owned(), p.id, p.acked);
        let refuse =
            |code: ErrorCode, message: String| ForwardOutcome::Refused { retry: code.default_retry(), code, message };
        if let Err(r) = self.owned_here(&p.tenant_id, &p.namespace, &p.stream, p.shard) {
            if acked {
                let o = ForwardOutcome::Refused { code: r.code, retry: r.retry, message: r.message };
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to: from, id, outcome: o }));
            }
            return;
        }
        // The stream's own key, shared: building one per forwarded batch cost four allocations.
        let k = match self.stream_key(&p.tenant_id, &p.namespace, &p.stream) {
            Some(k) => k,
            None => {
                // The registry creates a cluster's streams on every broker; one unknown here was
                // auto-created on the origin.
                let k = key(&p.tenant_id, &p.namespace, &p.stream);
                let cfg = self.cfg.default_stream.clone();
                self.create_stream(k.clone(), cfg);
                k
            }
        };
        let entry = self.node.streams.get(&k).expect("created above");
        let durable = entry.config.durable;
        let outcome = match entry.shards.get(p.shard as usize) {
            None => Some(refuse(ErrorCode::InvalidRequest, format!("stream has no shard {}", p.shard))),
            Some(sh) => sh.serving.away().map(|away| {
                let m = match away {
                    Away::Owner(m) => m,
                    Away::Unavailable { reason, node } => {
                        // Not served here for now (fenced, cutting over a move): retry, as a
                        // client of this broker would be told.
                        let r = reason.refusal(p.shard, node);
                        return ForwardOutcome::Refused { code: r.code, retry: r.retry, message: r.message };
                    }
                };
                refuse(
                    ErrorCode::NotLeader,
                    format!("shard {} is owned by {} (generation {})", p.shard, m.node_id, m.generation),
                )
            }),
        };
        if let Some(o) = outcome {
            if acked {
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to: from, id, outcome: o }));
            }
            return;
        }
        if let Err(r) = self.storage_gate(&k, p.shard, now) {
            if acked {
                let o = ForwardOutcome::Refused { code: r.code, retry: r.retry, message: r.message };
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to: from, id, outcome: o }));
            }
            return;
        }
        let queued = match self.publish_quota(&k, durable, p.records.payload_bytes() as u64) {
            Ok(q) => q,
            Err(r) => {
                if acked {
                    let o = ForwardOutcome::Refused { code: r.code, retry: r.retry, message: r.message };
                    self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer {
                        to: from,
                        id,
                        outcome: o,
                    }));
                }
                return;
            }
        };
        let batch = NewBatch {
            key: p.key,
            records: p.records,
            publisher: p.publisher,
            idempotent: None,
            digest: None,
            state: None,
            expected_offset: None,
        };
        let appended = self.append_batch(&k, p.shard, durable, batch, now);
        if let Some(token) = appended {
            self.count_queued(token, queued);
        }
        match appended {
            None if acked => self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer {
                to: from,
                id,
                outcome: ForwardOutcome::Appended { offset: None },
            })),
            None => {}
            Some(token) if acked => {
                if let Some(ctx) = self.node.writes.get_mut(&token) {
                    ctx.forwards.push((from, id));
                }
            }
            Some(_) => {}
        }
    }

    /// The owner answered a publish forwarded from here: the client gets it.
    pub fn handle_forward_answer(&mut self, id: u64, outcome: ForwardOutcome, now: Instant) {
        let now = self.clock.advance(now);
        let Some(f) = self.membership.forwards.remove(&id) else { return };
        self.membership.forward_deadlines.remove(&(f.deadline, id));
        let result = match outcome {
            ForwardOutcome::Appended { offset } => Ok(offset),
            ForwardOutcome::Refused { code: ErrorCode::NotLeader, message, .. } => {
                // The shard left the broker this one forwarded to before the forward got there
                // (a move, a fail-over): this broker's view was behind. Nothing was written;
                // the client retries, by when this view has caught up (`stale`).
                let mut r = Refusal::new(
                    ErrorCode::ShardUnavailable,
                    format!("the shard moved while the publish was forwarded ({message}); retry"),
                );
                r.retry = RetryClass::Retry;
                r.detail = Some(crate::binary::ErrorDetail { reason: Some("stale".into()), retry_after_ms: Some(100) });
                Err(r)
            }
            ForwardOutcome::Refused { code, retry, message } => {
                let mut r = Refusal::new(code, message);
                r.retry = retry;
                Err(r)
            }
        };
        self.answer_forwarded(f, result.as_ref().map(|o| *o), now);
    }

    /// The driver could not deliver a forwarded publish to its owner (no connection, the owner
    /// is down): `shard_unavailable`, retryable.
    pub fn handle_forward_failed(&mut self, id: u64, now: Instant) {
        let now = self.clock.advance(now);
        let Some(f) = self.membership.forwards.remove(&id) else { return };
        self.membership.forward_deadlines.remove(&(f.deadline, id));
        let mut r = Refusal::new(
            ErrorCode::ShardUnavailable,
            format!("the shard's owner {} cannot be reached", f.owner.node_id),
        );
        r.retry = RetryClass::Retry;
        self.answer_forwarded(f, Err(&r), now);
    }

    /// The driver's connection to peer `peer` was lost: forwarded publishes it carried may
    /// have reached the owner or not, and their answers will not come back on it. Each one is
    /// answered `unacknowledged` (outcome unknown) now, as the forward timeout would 10 s
    /// later: a client told at once goes to the new owner instead of waiting (a one-way fault
    /// held publishers for the whole timeout).
    pub fn handle_peer_connection_lost(&mut self, peer: &str, now: Instant) {
        let now = self.clock.advance(now);
        // In the order they were forwarded: the map's.
        let lost: Vec<u64> =
            self.membership.forwards.iter().filter(|(_, f)| f.owner.node_id == peer).map(|(id, _)| *id).collect();
        self.answer_forwards_unknown(&lost, now, |owner| {
            format!(
                "the connection to the shard's owner {owner} was lost while the publish was forwarded; the batch may have been appended"
            )
        });
        self.request_forwards_on_lost_connection(peer);
    }

    /// Answers the forwarded publishes `ids` (in that order) `unacknowledged`, outcome unknown,
    /// with `why` of their owner.
    fn answer_forwards_unknown(&mut self, ids: &[u64], now: Instant, why: impl Fn(&str) -> String) {
        for id in ids {
            let Some(f) = self.membership.forwards.remove(id) else { continue };
            self.membership.forward_deadlines.remove(&(f.deadline, *id));
            let r = Refusal::new(ErrorCode::Unacknowledged, why(&f.owner.node_id));
            self.answer_forwarded(f, Err(&r), now);
        }
    }

    /// Forwarded publishes whose answer did not come in time: `unacknowledged` (the owner may
    /// have appended them).
    pub(super) fn forwards_timeout(&mut self, now: Instant) {
        while let Some(&(d, id)) = self.membership.forward_deadlines.first()
            && d <= now
        {
            self.membership.forward_deadlines.pop_first();
            if self.forward_request_timed_out(id) {
                continue;
            }
            if let Some(f) = self.membership.forwards.remove(&id) {
                let r = Refusal::new(
                    ErrorCode::Unacknowledged,
                    "the shard's owner did not answer in time; the batch may have been appended",
                );
                self.answer_forwarded(f, Err(&r), now);
            }
        }
    }

    /// Forwarded publishes whose owner the metadata now says is gone: declared down, no longer
    /// a member, or replaced as the leader of a replicated shard at a newer generation. Its
    /// answer may never come (a broker killed with the publish in flight), so waiting out
    /// [`FORWARD_TIMEOUT`] would only hold the client: it is answered `unacknowledged` (outcome
    /// unknown) now, as the timeout would. A shard moved between live brokers keeps waiting:
    /// its old owner answers, and that answer is definite.
    pub(super) fn forwards_to_gone_owners(&mut self, md: &impl ClusterFacts, now: Instant) {
        use crate::shard::{Kind, ShardId};
        // In the order they were forwarded: the map's.
        let gone: Vec<u64> = self
            .membership
            .forwards
            .iter()
            .filter(|(_, f)| {
                let (k, n) = &f.shard;
                if md.is_gone(&f.owner.node_id) {
                    return true;
                }
                let id = ShardId {
                    kind: Kind::Stream,
                    tenant: k.tenant().to_owned(),
                    namespace: k.namespace().to_owned(),
                    name: k.name().to_owned(),
                    shard: *n,
                };
                md.replicas(&id).is_some()
                    && md
                        .owners()
                        .get(&id)
                        .is_some_and(|a| a.owner != f.owner.node_id && a.generation > f.owner.generation)
            })
            .map(|(id, _)| *id)
            .collect();
        self.answer_forwards_unknown(&gone, now, |owner| {
            format!(
                "the shard's owner {owner} went down or lost the shard while the publish was forwarded; the batch may have been appended"
            )
        });
        self.request_forwards_to_gone_owners(md);
    }

    pub(super) fn forward_deadline(&self) -> Option<Instant> {
        self.membership.forward_deadlines.first().map(|(d, _)| *d)
    }

    fn answer_forwarded(&mut self, f: Forwarding, result: Result<Option<u64>, &Refusal>, now: Instant) {
        let w = f.waiter;
        // The binary ack names the owner for a client that offered 0x0080.
        let data = match w.reply {
            Reply::Binary(request_id) if w.offer.offered(Flags::BINARY_PUBLISH_ACK_OWNER) => {
                let mut ack = match result {
                    Ok(offset) => {
                        PublishAck::ok(request_id, offset.filter(|_| w.offer.offered(Flags::BINARY_PUBLISH_ACK_OFFSET)))
                    }
                    Err(r) => {
                        let mut a = PublishAck::error(request_id, r.message.clone(), r.code.clone(), r.retry);
                        a.detail = r.detail.clone();
                        a
                    }
                };
                ack.owner = Some(f.owner);
                let mut b = BytesMut::new();
                let _ = ack.encode(w.offer.flags, &mut b);
                Some(b.freeze())
            }
            _ => Self::publish_answer(&w.offer, w.reply, result),
        };
        self.finish_waiter_with(w, data, now);
    }
}
