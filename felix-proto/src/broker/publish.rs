//! Publishing: routing a batch to its shard, the idempotent and conditional checks, appending, the
//! write to storage and the answers that wait for it, and a shard whose storage is full.

use super::*;
use crate::binary::{ErrorDetail, PublishBatch, Records};
use crate::error_code::{ErrorCode, RetryClass};
use crate::features::Features;
use crate::flags::Flags;
use crate::frame::Frame;
use crate::message::{self};
use crate::routing::shard_for_key;
use crate::transport::{ConnId, WriteToken};
use bytes::Bytes;
use std::time::Instant;

/// How long a shard whose storage is full refuses publishes before it tries one write again.
const FULL_PROBE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

impl Broker {
    pub(super) fn publish_json(&mut self, conn: ConnId, st: &mut CtlStream, p: message::PublishBatchMsg, now: Instant) {
        self.stats.publishes_json += 1;
        let acked = p.ack.is_some_and(|a| a.is_acked());
        let reply = match (acked, p.request_id) {
            (true, Some(id)) => Reply::Json(id),
            (true, None) => {
                return self.refuse(
                    conn,
                    st,
                    Refusal::new(ErrorCode::InvalidRequest, "an acked publish needs a request_id"),
                );
            }
            // Decision D9: a request_id without ack is fire-and-forget.
            (false, _) => Reply::None,
        };
        let req = PublishReq::json(p.tenant_id, p.namespace, p.stream, p.payloads, p.key, p.shard, p.publish_width);
        self.publish(conn, st, req, reply, now);
    }

    pub(super) fn handle_binary_publish(&mut self, conn: ConnId, st: &mut CtlStream, frame: Frame, now: Instant) {
        self.stats.publishes_binary += 1;
        let reply = match PublishBatch::peek_request_id(frame.flags, &frame.payload) {
            Some(id) if frame.flags.contains(Flags::BINARY_PUBLISH_IDEMPOTENT) => Reply::Refusable(id),
            Some(id) => Reply::Binary(id),
            None => Reply::None,
        };
        let limit = self.cfg.max_frame_len as usize;
        match PublishBatch::decode_with(frame.flags, frame.payload, limit, &mut self.decompressor) {
            Ok(b) => {
                if let Some(p) = b.records.packed() {
                    self.stats.publishes_compressed += 1;
                    self.stats.compressed_bytes_in += p.data.len() as u64;
                    self.stats.compressed_plain_bytes_in += b.records.raw().len() as u64;
                }
                let width = b.key.as_ref().and_then(|_| {
                    st.session
                        .as_ref()
                        .and_then(|s| s.widths.get(KeyRef(&b.tenant_id, &b.namespace, &b.stream).q()).copied())
                });
                let req = PublishReq {
                    tenant_id: b.tenant_id,
                    namespace: b.namespace,
                    stream: b.stream,
                    key: b.key,
                    shard: None,
                    width,
                    records: b.records,
                    idempotent: b.idempotent.map(|i| (i.producer_id, i.sequence)),
                    expected_offset: None,
                    state: None,
                };
                self.publish(conn, st, req, reply, now);
            }
            Err(e) => {
                let r = Refusal::new(ErrorCode::InvalidRequest, format!("malformed publish batch: {e}"));
                if matches!(reply, Reply::None) {
                    self.stats.unacked_failures += 1;
                } else {
                    self.answer_now(conn, st, reply, Err(&r));
                }
            }
        }
    }

    pub(super) fn publish(&mut self, conn: ConnId, st: &mut CtlStream, req: PublishReq, reply: Reply, now: Instant) {
        if !self.node.limits.is_empty()
            && let Err(limits::OverRate { wait, namespace }) = self.node.limits.admit(
                &req.tenant_id,
                &req.namespace,
                u64::from(req.records.count()),
                req.records.payload_bytes() as u64,
                self.wall.micros(now),
            )
        {
            // Over the tenant's rate: nothing written; the client is told when it is back
            // under. An unacked publish is dropped and counted (it has no answer to carry it).
            self.stats.publishes_rate_limited += 1;
            self.stats.publishes_refused += 1;
            // Read nothing more from this stream until the tenant is back under: the publisher
            // is slowed by flow control rather than read, decrypted and refused.
            if !st.pauses.has(Pause::Rate) {
                if st.pause(Pause::Rate) {
                    self.out.push_back(BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream: st.id }));
                }
                self.timers.rate.insert((crate::transport::after(now, wait), conn, st.id));
            }
            let whose = if namespace {
                format!("namespace {}/{}", req.tenant_id, req.namespace)
            } else {
                format!("tenant {}", req.tenant_id)
            };
            let mut r = Refusal::new(
                ErrorCode::Overloaded,
                format!("{whose} is over its publish rate; retry in {} ms", wait.as_millis().max(1)),
            );
            r.retry = RetryClass::RetryAfter;
            r.detail = Some(crate::binary::ErrorDetail {
                reason: Some("tenant_quota".into()),
                retry_after_ms: Some(u64::try_from(wait.as_millis().max(1)).unwrap_or(u64::MAX)),
            });
            if matches!(reply, Reply::None) {
                self.stats.unacked_failures += 1;
                return;
            }
            return self.answer_now(conn, st, reply, Err(&r));
        }
        let routed = self.route(st, &req);
        let (shard, durable) = match routed {
            Ok(Route::Here { shard, durable }) => (shard, durable),
            // In a cluster, a plain publish for a shard owned elsewhere goes to its owner (the
            // refusal is worded only when it does not).
            Ok(Route::Owner(shard)) => {
                let Some(req) = self.try_forward(conn, st, req, reply, now) else { return };
                let sh = self
                    .node
                    .streams
                    .get(KeyRef(&req.tenant_id, &req.namespace, &req.stream).q())
                    .and_then(|e| e.shards.get(shard as usize));
                let Some(r) = sh.and_then(|sh| Self::moved_refusal(shard, sh)) else { return };
                return self.refuse_publish(conn, st, reply, &r);
            }
            Err(r) => {
                return self.refuse_publish(conn, st, reply, &r);
            }
        };
        let Some(k) = self.stream_key(&req.tenant_id, &req.namespace, &req.stream) else { return };
        let probe = match self.storage_gate(&k, shard, now) {
            Ok(probe) => probe,
            Err(r) => {
                return self.refuse_publish(conn, st, reply, &r);
            }
        };
        let replicated = self.node.streams.get(&k).is_some_and(|e| e.shards[shard as usize].serving.is_replica());
        if replicated && req.expected_offset.is_some() && req.records.is_empty() {
            let r = Refusal::new(ErrorCode::InvalidRequest, "publish_if with no records");
            return self.refuse_publish(conn, st, reply, &r);
        }
        let sess = st.session.as_ref().expect("route checked the session");
        let offer = sess.offer;
        let publisher = Some(sess.principal.clone()).filter(|p| !p.is_empty());
        // Idempotent and conditional batches are answered after the write, with the offset; on
        // a replicated shard every acknowledgement waits for a majority (what quorum promises).
        let ack_on_commit = sess.ack_on_commit
            || probe
            || replicated
            || req.idempotent.is_some()
            || req.expected_offset.is_some()
            || req.state.is_some();
        let digest = req.idempotent.map(|_| producer::digest(req.records.raw()));
        // A replicated shard's producers are part of its replicated state: its group answers a
        // retry with the original offset, whichever replica led when it was first written.
        if !replicated && let Some(verdict) = self.precheck(conn, st, &k, shard, durable, &req, digest, reply) {
            return verdict;
        }
        let bytes = req.records.payload_bytes() as u64;
        let queued = match self.publish_quota(&k, durable, bytes) {
            Ok(queued) => queued,
            Err(r) => {
                return self.refuse_publish(conn, st, reply, &r);
            }
        };
        // On a replicated shard the expected offset is checked where offsets are assigned: when
        // the group applies the entry (the same on every replica).
        let batch = NewBatch {
            records: req.records,
            publisher,
            idempotent: req.idempotent,
            digest,
            state: req.state,
            expected_offset: req.expected_offset,
            key: req.key,
        };
        let Some(token) = self.append_batch(&k, shard, durable, batch, now) else {
            self.hold_publisher(conn, st, &k, shard);
            return self.answer_now(conn, st, reply, Ok(None));
        };
        self.count_queued(token, queued);
        // Backpressure when storage (or the shard's group) falls behind: stop reading this
        // stream until it catches up.
        let limit = self.cfg.max_pending_write_bytes;
        let sh = &mut self.node.streams.get_mut(&k).expect("routed stream exists").shards[shard as usize];
        if sh.log.pending_bytes() + sh.replicating > limit && !st.pauses.has(Pause::Storage) {
            sh.paused.push((conn, st.id));
            if st.pause(Pause::Storage) {
                self.out.push_back(BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream: st.id }));
            }
        }
        if !matches!(reply, Reply::None) {
            let seq = self.owe(conn, st, reply);
            if ack_on_commit {
                if let Some(ctx) = self.node.writes.get_mut(&token) {
                    ctx.waiters.push(Waiter { conn, stream: st.id, seq, reply, offer });
                }
            } else {
                // Acknowledged on enqueue: no offset (the broker never invents one).
                let data = Self::publish_answer(&offer, reply, Ok(None));
                self.answering().deliver_answer(conn, st, seq, data);
            }
        }
    }

    /// A publish refused before anything was written: counted, and answered when it is acked
    /// (an unacked one is only counted: decision D5).
    fn refuse_publish(&mut self, conn: ConnId, st: &mut CtlStream, reply: Reply, r: &Refusal) {
        self.stats.publishes_refused += 1;
        if matches!(reply, Reply::None) {
            self.stats.unacked_failures += 1;
            return;
        }
        self.answer_now(conn, st, reply, Err(r));
    }

    /// The tenant's quotas on what a publish of `bytes` payload bytes to `k` adds: the
    /// namespace's retained history (`limit_exceeded`) and, for a durable stream, its share of
    /// the publish queue (`overloaded` reason `publish_queue_full`). Nothing is counted when it
    /// is refused; `Ok(q)`: `q` bytes were counted against the queue share, to be tied to the
    /// write ([`count_queued`](Self::count_queued)).
    pub(super) fn publish_quota(&mut self, k: &Key, durable: bool, bytes: u64) -> Result<u64, Refusal> {
        let tenant = k.tenant();
        let queued = if durable {
            match self.node.limits.take_queued(tenant, bytes) {
                Ok(counted) => {
                    if counted {
                        bytes
                    } else {
                        0
                    }
                }
                Err(()) => {
                    self.stats.quota_refusals += 1;
                    let mut r = Refusal::new(
                        ErrorCode::Overloaded,
                        format!(
                            "tenant {tenant} has {} bytes of publishes waiting for storage, its share of the publish queue: nothing was queued",
                            self.node.limits.queued(tenant)
                        ),
                    );
                    r.detail = Some(ErrorDetail {
                        reason: Some("publish_queue_full".into()),
                        retry_after_ms: Some(limits::QUEUE_FULL_RETRY.as_millis() as u64),
                    });
                    return Err(r);
                }
            }
        } else {
            0
        };
        if let Err((held, max)) = self.node.limits.take_retained(tenant, k.namespace(), bytes) {
            self.node.limits.release_queued(tenant, queued);
            self.stats.quota_refusals += 1;
            return Err(Refusal::new(
                ErrorCode::LimitExceeded,
                format!(
                    "namespace {tenant}/{} retains {held} bytes of history, its quota is {max}: nothing was written",
                    k.namespace()
                ),
            ));
        }
        Ok(queued)
    }

    /// Ties `queued` bytes counted by [`publish_quota`](Self::publish_quota) to the write
    /// `token` (given back when it leaves), or gives them back at once when there is no write.
    pub(super) fn count_queued(&mut self, token: WriteToken, queued: u64) {
        if queued == 0 {
            return;
        }
        if let Some(ctx) = self.node.writes.get_mut(&token) {
            ctx.queued = queued;
        }
    }

    /// Removes a write's context, giving its bytes back to its tenant's share of the queue.
    pub(super) fn take_write(&mut self, token: &WriteToken) -> Option<WriteCtx> {
        let ctx = self.node.writes.remove(token)?;
        if ctx.queued > 0 {
            self.node.limits.release_queued(ctx.key.tenant(), ctx.queued);
        }
        Some(ctx)
    }

    /// Recounts every limited namespace's retained history from the logs (on the retention
    /// sweep, so what retention dropped makes room again).
    pub(super) fn recount_retained(&mut self) {
        if !self.node.limits.counts_retained() {
            return;
        }
        let tenants: std::collections::BTreeSet<String> =
            self.node.limits.retained_tenants().map(str::to_owned).collect();
        let mut counted = std::collections::BTreeMap::new();
        for (k, e) in &self.node.streams {
            if !tenants.contains(k.tenant()) || syslog::is_sys(k) {
                continue;
            }
            let bytes: u64 = e.shards.iter().map(|s| s.log.retained_bytes()).sum();
            *counted.entry((k.tenant().to_owned(), k.namespace().to_owned())).or_insert(0) += bytes;
        }
        self.node.limits.set_retained(counted);
    }

    /// A shard whose storage is full writes nothing and acknowledges nothing on enqueue; one
    /// publish a second goes through as a probe, answered after its write. `Ok(true)`: this one
    /// is the probe.
    pub(super) fn storage_gate(&mut self, k: &Key, shard: u32, now: Instant) -> Result<bool, Refusal> {
        let Some(sh) = self.node.streams.get_mut(k).and_then(|e| e.shards.get_mut(shard as usize)) else {
            return Ok(false);
        };
        let Some(next) = sh.full else { return Ok(false) };
        if now < next {
            let mut r = Refusal::new(ErrorCode::Overloaded, "storage is full: nothing was written");
            r.detail = Some(ErrorDetail {
                reason: Some("storage_full".into()),
                retry_after_ms: Some(next.saturating_duration_since(now).as_millis().max(1) as u64),
            });
            return Err(r);
        }
        sh.full = Some(crate::transport::after(now, FULL_PROBE_INTERVAL));
        Ok(true)
    }

    /// Appends a batch to a routed shard: an ephemeral one fans it out at once (`None`); a
    /// durable one asks storage to write it and returns the write, whose context (with no
    /// waiters yet) is registered.
    pub(super) fn append_batch(
        &mut self,
        k: &Key,
        shard: u32,
        durable: bool,
        b: NewBatch,
        now: Instant,
    ) -> Option<WriteToken> {
        if self.node.streams.get(k).and_then(|e| e.shards.get(shard as usize)).is_some_and(|s| s.serving.is_replica()) {
            // A replicated shard: its group writes it (counted when it commits).
            return Some(self.replicate_batch(k, shard, b, now));
        }
        let count = u64::from(b.records.count());
        self.stats.records_appended += count;
        let wall = self.wall.micros(now);
        let entry = self.node.streams.get_mut(k).expect("routed stream exists");
        // What the log will give the batch (never less than its last one's).
        let ts = entry.shards[shard as usize].log.stamp(wall);
        if !durable {
            let sh = &mut entry.shards[shard as usize];
            let (base, batch) = sh.log.append(b.records, ts, b.publisher, None);
            if let (Some((pid, seq)), Some(d)) = (b.idempotent, b.digest) {
                sh.producers.appended(pid, seq, d, base, base + count, None);
            }
            if let Some(mut batch) = batch
                && {
                    batch.key = b.key;
                    self.fanout(k, shard, batch)
                }
            {
                self.start_hold(k, shard, now);
            }
            return None;
        }
        let token = self.ids.write();
        let entry_shards = entry.shards.len() as u32;
        let fsync = entry.config.fsync;
        let records = b.records.clone();
        let sh = &mut entry.shards[shard as usize];
        let (base, _) = sh.log.append(b.records, ts, b.publisher.clone(), Some(token));
        if b.idempotent.is_some() || b.state.is_some() {
            sh.log.note_last(b.idempotent, b.state.clone());
        }
        if b.key.is_some() {
            sh.log.note_key(b.key.clone());
        }
        if let (Some((pid, seq)), Some(d)) = (b.idempotent, b.digest) {
            sh.producers.appended(pid, seq, d, base, base + count, Some(token));
        }
        self.out.push_back(BrokerOutput::Storage(StorageOutput::Persist(PersistRequest {
            token,
            tenant_id: k.tenant().to_owned(),
            namespace: k.namespace().to_owned(),
            stream: k.name().to_owned(),
            shard,
            base_offset: base,
            records,
            timestamp_micros: ts,
            publisher: b.publisher,
            generation_start: false,
            producer: b.idempotent,
            state: b.state.clone(),
            key: b.key,
            fsync,
            stream_shards: entry_shards,
        })));
        let ctx = WriteCtx { producer: b.idempotent, state: b.state, ..WriteCtx::new(k.clone(), shard) };
        self.node.writes.insert(token, ctx);
        Some(token)
    }

    /// The checks of an idempotent or conditional publish, made where offsets are assigned.
    /// Returns `Some(())` when the batch was answered here (a duplicate, or a refusal) and must
    /// not be appended.
    #[allow(clippy::too_many_arguments)] // the publish's parts, already taken apart by the caller
    pub(super) fn precheck(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        k: &Key,
        shard: u32,
        durable: bool,
        req: &PublishReq,
        digest: Option<u64>,
        reply: Reply,
    ) -> Option<()> {
        use message::RefusedReason as Why;
        if req.idempotent.is_none() && req.expected_offset.is_none() {
            return None;
        }
        let offer = Self::features_of(st);
        let sh = &self.node.streams.get(k)?.shards[shard as usize];
        if let Some(expected) = req.expected_offset {
            let tail = sh.log.next_offset();
            let refusal = if !durable {
                Some(Refusal::new(ErrorCode::InvalidRequest, "a conditional write needs a stream with a log (durable)"))
            } else if req.records.is_empty() {
                Some(Refusal::new(ErrorCode::InvalidRequest, "publish_if with no records"))
            } else if expected != tail {
                Some(
                    Refusal::new(ErrorCode::InvalidRequest, format!("expected offset {expected}, the tail is {tail}"))
                        .with_reason(Why::OffsetMismatch { tail }),
                )
            } else {
                None
            };
            let r = refusal?;
            self.answer_now(conn, st, reply, Err(&r));
            return Some(());
        }
        let ((pid, seq), digest) = (req.idempotent?, digest?);
        let refuse = |why: Why, msg: String| Err(Refusal::new(ErrorCode::InvalidRequest, msg).with_reason(why));
        let answer: Result<Option<u64>, Refusal> = match sh.producers.check(pid, seq, digest) {
            producer::Verdict::Append => return None,
            producer::Verdict::Duplicate { pending: Some(token), .. } if self.node.writes.contains_key(&token) => {
                // The first copy is still on its way to storage: this one gets the same answer,
                // at the same time.
                let seq_slot = self.owe(conn, st, reply);
                if let Some(ctx) = self.node.writes.get_mut(&token) {
                    ctx.waiters.push(Waiter { conn, stream: st.id, seq: seq_slot, reply, offer });
                }
                return Some(());
            }
            producer::Verdict::Duplicate { base, .. } => Ok(durable.then_some(base)),
            producer::Verdict::Reused if offer.has(Features::SEQUENCE_REUSED) => {
                refuse(Why::SequenceReused, format!("sequence {seq} was used for a different batch"))
            }
            // A client that cannot read `sequence_reused` is told ok, and nothing is written.
            producer::Verdict::Reused => Ok(None),
            producer::Verdict::Expired => {
                refuse(Why::SequenceExpired, format!("sequence {seq} is older than the remembered window"))
            }
            producer::Verdict::Gap { expected } => {
                refuse(Why::SequenceGap { expected }, format!("sequence {seq}, expected {expected}"))
            }
            producer::Verdict::Unknown => {
                refuse(Why::UnknownProducer, format!("unknown producer {pid} (sequence {seq} is not 0)"))
            }
        };
        self.answer_now(conn, st, reply, answer.as_ref().map(|o| *o));
        Some(())
    }

    /// Picks the shard of a publish: permission, stream, explicit shard, key hash, width check.
    pub(super) fn route(&mut self, st: &CtlStream, req: &PublishReq) -> Result<Route, Refusal> {
        let shards =
            self.lookup_stream(st, &req.tenant_id, &req.namespace, &req.stream, Action::Publish, Missing::Create)?;
        let entry = self.node.streams.get(KeyRef(&req.tenant_id, &req.namespace, &req.stream).q()).expect("looked up");
        if let (Some(w), Some(_)) = (req.width, &req.key)
            && w != shards
        {
            return Err(Refusal::new(
                ErrorCode::StaleWidth,
                format!("stream has {shards} shards; the batch was routed by {w}"),
            ));
        }
        let shard = match req.shard {
            Some(s) if s >= shards => {
                return Err(Refusal::new(
                    ErrorCode::InvalidRequest,
                    format!("stream has no shard {s} (it has {shards})"),
                ));
            }
            Some(s) => s,
            None => shard_for_key(req.key.as_deref(), shards, entry.config.routing),
        };
        let sh = &entry.shards[shard as usize];
        if let Some(Away::Owner(_)) = sh.serving.away() {
            return Ok(Route::Owner(shard));
        }
        if let Some(r) = Self::moved_refusal(shard, sh) {
            return Err(r);
        }
        Ok(Route::Here { shard, durable: entry.config.durable })
    }

    /// The refusal for a request reaching a shard that moved to another broker.
    pub(super) fn moved_refusal(shard: u32, sh: &Shard) -> Option<Refusal> {
        let m = match sh.serving.away()? {
            Away::Owner(m) => m,
            Away::Unavailable { reason, node } => return Some(reason.refusal(shard, node)),
        };
        let mut r = Refusal::new(ErrorCode::NotLeader, format!("shard {shard} is owned by {}", m.node_id)).with_reason(
            message::RefusedReason::NotLeader(message::LeaderHint { node_id: m.node_id.clone(), addr: m.addr.clone() }),
        );
        r.retry = RetryClass::Redirect;
        Some(r)
    }

    /// Storage finished a write: durable records become visible (in offset order), their
    /// subscribers get them, and publishes waiting for the write are answered.
    pub fn handle_write_complete(&mut self, token: WriteToken, ok: bool, now: Instant) {
        let outcome = if ok { WriteOutcome::Written } else { WriteOutcome::Failed };
        self.handle_write_result(token, outcome, now);
    }

    /// [`handle_write_complete`](Self::handle_write_complete), telling a failure for lack of
    /// space apart: the shard then refuses publishes (`overloaded`, reason `storage_full`,
    /// nothing written, nothing acknowledged on enqueue) until a write succeeds again, trying
    /// one write a second. Reads are not affected.
    pub fn handle_write_result(&mut self, token: WriteToken, outcome: WriteOutcome, now: Instant) {
        let now = self.clock.advance(now);
        self.write_result(token, outcome, now);
        // Streams read again and subscribers fed here may have raised events.
        self.run_events(now);
    }

    fn write_result(&mut self, token: WriteToken, outcome: WriteOutcome, now: Instant) {
        let ok = outcome == WriteOutcome::Written;
        if self.import_written(token, ok, now) {
            return;
        }
        let Some(ctx) = self.node.writes.get(&token) else { return };
        let (k, shard) = (ctx.key.clone(), ctx.shard);
        let Some(entry) = self.node.streams.get_mut(&k) else {
            self.take_write(&token);
            return;
        };
        let sh = &mut entry.shards[shard as usize];
        match outcome {
            WriteOutcome::Written => sh.full = None,
            WriteOutcome::NoSpace if sh.full.is_none() => {
                sh.full = Some(crate::transport::after(now, FULL_PROBE_INTERVAL))
            }
            _ => {}
        }
        let settled = entry.shards[shard as usize].log.settle(token, ok);
        if !self.membership.moves_out.is_empty() {
            // A shard cutting over a move proposes its cut-over once its last write landed.
            let id = crate::shard::ShardId {
                kind: crate::shard::Kind::Stream,
                tenant: k.tenant().to_owned(),
                namespace: k.namespace().to_owned(),
                name: k.name().to_owned(),
                shard,
            };
            if self.cutting_over(&id).is_some() {
                self.maybe_cut_over(&id, now);
            }
        }
        if syslog::is_sys(&k) {
            for (tok, base) in settled.done {
                if let Some(p) = self.take_write(&tok).and_then(|c| c.sys) {
                    self.sys_settled(tok, &k, Some(base), p, now);
                }
            }
            for (tok, _, _) in settled.failed {
                if let Some(p) = self.take_write(&tok).and_then(|c| c.sys) {
                    self.sys_settled(tok, &k, None, p, now);
                }
            }
            if let Some(e) = self.node.streams.get_mut(&k) {
                e.shards[0].log.trim_memory();
            }
            return;
        }
        for (base, end) in &settled.committed {
            self.fanout_committed(&k, shard, *base, *end);
        }
        if !settled.committed.is_empty() {
            self.wake_groups(&k, shard, now);
        }
        for (tok, base) in settled.done {
            if let Some(ctx) = self.take_write(&tok) {
                if let (Some((pid, seq)), Some(e)) = (ctx.producer, self.node.streams.get_mut(&k)) {
                    e.shards[shard as usize].producers.settled(pid, seq, true);
                }
                // A commit's state changes take effect with its event, in offset order.
                if let (Some(state), Some(e)) = (&ctx.state, self.node.streams.get_mut(&k))
                    && let Ok(changes) = crate::storage::decode_state_changes(state)
                {
                    e.shards[shard as usize].state.apply(base, &changes);
                }
                for w in ctx.waiters {
                    self.finish_waiter(w, Ok(Some(base)), now);
                }
                for (to, id) in ctx.forwards {
                    let outcome = ForwardOutcome::Appended { offset: Some(base) };
                    self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to, id, outcome }));
                }
            }
        }
        for (tok, _, _) in settled.failed {
            if let Some(ctx) = self.take_write(&tok) {
                if let (Some((pid, seq)), Some(e)) = (ctx.producer, self.node.streams.get_mut(&k)) {
                    e.shards[shard as usize].producers.settled(pid, seq, false);
                }
                let r = Refusal::new(ErrorCode::Storage, "the write failed; nothing was stored");
                let mut r = r;
                r.retry = RetryClass::Retry;
                for w in ctx.waiters {
                    self.finish_waiter(w, Err(&r), now);
                }
                for (to, id) in ctx.forwards {
                    let outcome =
                        ForwardOutcome::Refused { code: r.code.clone(), retry: r.retry, message: r.message.clone() };
                    self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to, id, outcome }));
                }
            }
        }
        self.enforce_retention(Some(&k), now, false);
        let limit = self.cfg.max_pending_write_bytes;
        let mut resume = Vec::new();
        if let Some(entry) = self.node.streams.get_mut(&k) {
            let sh = &mut entry.shards[shard as usize];
            sh.log.trim_memory();
            if sh.log.pending_bytes() <= limit / 2 {
                resume = std::mem::take(&mut sh.paused);
            }
        }
        for (conn, sid) in resume {
            let Some(st) = self.conns.get_mut(&conn).and_then(|c| c.streams.get_mut(&sid)) else { continue };
            if st.pauses.remove(Pause::Storage) {
                st.resume_owed = true;
                self.drive_stream(conn, sid, now);
            }
        }
    }

    pub(super) fn finish_waiter(&mut self, w: Waiter, result: Result<Option<u64>, &Refusal>, now: Instant) {
        let data = Self::publish_answer(&w.offer, w.reply, result);
        self.finish_waiter_with(w, data, now);
    }

    /// Delivers an answer already encoded to a waiter (on its stream, in its turn).
    pub(super) fn finish_waiter_with(&mut self, w: Waiter, data: Option<Bytes>, now: Instant) {
        let Some((st, mut a)) = self.stream_answering(w.conn, w.stream) else { return };
        if a.deliver_answer(w.conn, st, w.seq, data) {
            self.drive_stream(w.conn, w.stream, now);
        } else {
            a.maybe_finish(w.conn, st);
            self.forget_if_done(w.conn, w.stream);
        }
    }
}

/// A batch about to be appended, after its checks.
pub(super) struct NewBatch {
    pub(super) records: Records,
    pub(super) publisher: Option<Bytes>,
    /// An idempotent producer's `(producer_id, sequence)` and the batch's digest.
    pub(super) idempotent: Option<(u64, u64)>,
    pub(super) digest: Option<u64>,
    /// A commit's state changes.
    pub(super) state: Option<Bytes>,
    /// A conditional publish's expected offset (checked by a replicated shard's group; a
    /// single broker checked it before).
    pub(super) expected_offset: Option<u64>,
    /// The key it was published with, kept with it for subscriptions' filters (D57).
    pub(super) key: Option<Bytes>,
}

/// A publish, whatever encoding it came in.
#[derive(Debug)]
pub(super) struct PublishReq {
    pub(super) tenant_id: String,
    pub(super) namespace: String,
    pub(super) stream: String,
    pub(super) key: Option<Bytes>,
    pub(super) shard: Option<u32>,
    pub(super) width: Option<u32>,
    pub(super) records: Records,
    /// An idempotent producer's `(producer_id, sequence)`.
    pub(super) idempotent: Option<(u64, u64)>,
    /// `publish_if`: append only at this offset.
    pub(super) expected_offset: Option<u64>,
    /// A `commit`'s state changes (encoded as stored), written with its one record.
    pub(super) state: Option<Bytes>,
}

impl PublishReq {
    /// A plain batch from the fields every JSON publish form shares.
    pub(super) fn json(
        tenant_id: String,
        namespace: String,
        stream: String,
        payloads: Vec<message::B64>,
        key: Option<message::B64>,
        shard: Option<u32>,
        width: Option<u32>,
    ) -> PublishReq {
        PublishReq {
            tenant_id,
            namespace,
            stream,
            key: key.map(|k| k.0),
            shard,
            width,
            // Payloads come from a frame no larger than the frame limit, so they always fit.
            records: Records::from_payloads(payloads.into_iter().map(|b| b.0)).unwrap_or_default(),
            idempotent: None,
            expected_offset: None,
            state: None,
        }
    }
}

/// Where a publish goes ([`Broker::route`]).
#[derive(Debug, Clone, Copy)]
pub(super) enum Route {
    /// This broker serves its shard (durable or not).
    Here { shard: u32, durable: bool },
    /// Another broker of the cluster owns its shard: forwarded, or refused `not_leader`.
    Owner(u32),
}
