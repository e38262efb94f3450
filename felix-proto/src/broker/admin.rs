//! What the driver and operators do outside the protocol: recovery at start, stream listing,
//! deletion and shard moves.

use super::*;
use crate::binary::OwnerHint;
use crate::error_code::ErrorCode;
use crate::message::{self, Message};
use crate::transport::{ConnId, WriteToken};
use std::time::Instant;

impl Broker {
    /// Restores one shard storage recovered at start, in the order recovery needs: older
    /// history from index entries, then the batches read whole, then what retention made the
    /// shard forget about idempotent producers. A stream not configured otherwise is restored
    /// durable, with the default stream settings and the shard count storage recorded for it.
    /// Call for every recovered shard before accepting connections. Returns how many records
    /// the shard holds.
    pub fn restore(&mut self, shard: crate::storage::RecoveredShard, now: Instant) -> u64 {
        let records = shard.summaries.iter().filter(|e| !e.generation_start).map(|e| e.count).sum::<u64>()
            + shard.batches.iter().filter(|b| !b.generation_start).map(|b| b.count()).sum::<u64>();
        let mut cfg = self.cfg.default_stream.clone();
        cfg.durable = true;
        cfg.shards = shard.stream_shards.max(1);
        let name = (shard.tenant_id.as_str(), shard.namespace.as_str(), shard.stream.as_str());
        // The state retention checkpointed, then the commits after it.
        if let Some(c) = &shard.state_checkpoint {
            self.restore_state_checkpoint(name, cfg.clone(), shard.shard, c, now);
        }
        self.restore_shard_summaries(name, cfg.clone(), shard.shard, &shard.summaries, now);
        // The state older commits wrote, before the newer batches (which may change it again).
        if let Some(s) = self
            .node
            .streams
            .get_mut(KeyRef(name.0, name.1, name.2).q())
            .and_then(|e| e.shards.get_mut(shard.shard as usize))
        {
            for b in &shard.state_batches {
                s.state.apply_stored(b);
            }
        }
        self.restore_shard(name, cfg, shard.shard, shard.batches, now);
        self.restore_producer_watermarks(name, shard.shard, &shard.producer_watermarks);
        records
    }

    /// Restores a durable shard from what storage recovered at start. `name` is
    /// `(tenant, namespace, stream)`. Creates the stream (with `config`) if it does not exist yet.
    /// Commit batches among them apply their state changes. Call before accepting connections.
    pub fn restore_shard(
        &mut self,
        (tenant, ns, stream): (&str, &str, &str),
        config: StreamConfig,
        shard: u32,
        batches: Vec<crate::storage::StoredBatch>,
        now: Instant,
    ) {
        let now = self.clock.advance(now);
        let k = key(tenant, ns, stream);
        let config = if syslog::is_sys(&k) {
            self.sys_restore(&k, &batches);
            syslog::sys_stream_config()
        } else {
            config
        };
        if !self.node.streams.contains_key(&k) {
            self.create_stream(k.clone(), config);
        }
        let Some(s) = self.node.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard as usize)) else { return };
        for b in batches {
            if let Some((pid, seq)) = b.producer {
                let end = b.base_offset + b.count();
                s.producers.appended(pid, seq, producer::digest(b.records.raw()), b.base_offset, end, None);
            }
            s.state.apply_stored(&b);
            s.log.restore(b);
        }
        self.enforce_retention(Some(&k), now, true);
    }

    /// Restores what retention made a shard forget about idempotent producers (the
    /// `producers_forgotten` of its `Truncate` outputs, as storage kept them). Call after
    /// [`restore_shard`](Self::restore_shard).
    pub fn restore_producer_watermarks(
        &mut self,
        (tenant, ns, stream): (&str, &str, &str),
        shard: u32,
        forgotten: &[(u64, u64)],
    ) {
        if let Some(s) =
            self.node.streams.get_mut(KeyRef(tenant, ns, stream).q()).and_then(|e| e.shards.get_mut(shard as usize))
        {
            s.producers.restore_forgotten(forgotten);
        }
    }

    /// Restores a durable shard's commit state from the checkpoint storage kept
    /// ([`crate::storage::RecoveredShard::state_checkpoint`]). Call before
    /// [`restore_shard_summaries`](Self::restore_shard_summaries) and
    /// [`restore_shard`](Self::restore_shard): the commits they replay apply on top of it, and
    /// those at or below its `as_of` (already part of it) are skipped. Creates the stream (with
    /// `config`) if it does not exist yet.
    pub fn restore_state_checkpoint(
        &mut self,
        (tenant, ns, stream): (&str, &str, &str),
        config: StreamConfig,
        shard: u32,
        checkpoint: &crate::storage::StateCheckpoint,
        now: Instant,
    ) {
        self.clock.advance(now);
        let k = key(tenant, ns, stream);
        if syslog::is_sys(&k) {
            return; // system logs keep their own checkpoints, in their logs
        }
        if !self.node.streams.contains_key(&k) {
            self.create_stream(k.clone(), config);
        }
        if let Some(s) = self.node.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard as usize)) {
            s.state.restore_checkpoint(checkpoint);
        }
    }

    /// Restores a durable shard's older history from index entries alone (its records stay on
    /// disk and are read back on demand). Call before [`restore_shard`](Self::restore_shard)
    /// with the newer batches. Creates the stream (with `config`) if it does not exist yet.
    pub fn restore_shard_summaries(
        &mut self,
        (tenant, ns, stream): (&str, &str, &str),
        config: StreamConfig,
        shard: u32,
        entries: &[crate::storage::IndexEntry],
        now: Instant,
    ) {
        self.clock.advance(now);
        let k = key(tenant, ns, stream);
        if entries.is_empty() || syslog::is_sys(&k) {
            return; // system logs are restored whole, by restore_shard
        }
        if !self.node.streams.contains_key(&k) {
            self.create_stream(k.clone(), config);
        }
        let Some(s) = self.node.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard as usize)) else { return };
        for e in entries {
            if let Some((pid, seq, digest)) = e.producer {
                s.producers.appended(pid, seq, digest, e.base_offset, e.base_offset + e.count, None);
            }
            s.log.restore_summary(e);
        }
    }

    /// How many payload bytes of a durable stream's history the broker keeps in memory per
    /// shard (what a driver reads whole at start; older history it restores from indexes).
    pub fn memory_budget(&self, tenant: &str, ns: &str, stream: &str) -> u64 {
        if stream.starts_with(syslog::SYS_PREFIX) {
            return u64::MAX; // system logs are folded whole
        }
        self.node
            .streams
            .get(KeyRef(tenant, ns, stream).q())
            .map_or(self.cfg.default_stream.memory_bytes, |e| e.config.memory_bytes)
    }

    /// Every stream with its configuration, in name order.
    pub fn streams(&self) -> impl Iterator<Item = (&str, &str, &str, &StreamConfig)> {
        let mut v: Vec<_> = self
            .node
            .streams
            .iter()
            .filter(|(k, _)| !syslog::is_sys(k))
            .map(|(k, e)| (k.tenant(), k.namespace(), k.name(), &e.config))
            .collect();
        v.sort_unstable_by_key(|(t, n, s, _)| (*t, *n, *s));
        v.into_iter()
    }

    /// Deletes a stream and everything it holds: its subscriptions end after delivering what
    /// they have queued, with `stream_deleted` for clients that read it; publishes still waiting
    /// for their write are refused `not_found` (nothing of them will be read); its consumer
    /// groups go too; storage is told to remove its files ([`StorageOutput::DeleteStream`]), so a
    /// restart does not bring it back. A stream of the same name can then be created again,
    /// with the width its configuration gives it then.
    pub fn delete_stream(&mut self, tenant: &str, ns: &str, stream: &str, now: Instant) -> bool {
        let now = self.clock.advance(now);
        let Some(waiters) = self.remove_stream(tenant, ns, stream) else { return false };
        let r = Self::deleted_refusal(ns, stream);
        for w in waiters {
            self.finish_waiter(w, Err(&r), now);
        }
        self.run_events(now);
        true
    }

    fn deleted_refusal(ns: &str, stream: &str) -> Refusal {
        Refusal::new(ErrorCode::NotFound, format!("stream {ns}/{stream} was deleted; nothing was stored"))
    }

    /// [`delete_stream`](Self::delete_stream) without answering the publishes that waited for a
    /// write: they are returned, for the caller to answer (one of them may wait on the control
    /// stream the caller holds).
    fn remove_stream(&mut self, tenant: &str, ns: &str, stream: &str) -> Option<Vec<Waiter>> {
        let k = key(tenant, ns, stream);
        let mut entry = self.node.streams.remove(&k)?;
        self.node.aged_streams -= usize::from(entry.config.retention.max_age.is_some());
        for (shard, sh) in entry.shards.iter_mut().enumerate() {
            let (paused, hold) = (std::mem::take(&mut sh.paused), sh.hold.take());
            self.let_go_of(&k, shard as u32, paused, hold);
        }
        // The stream's consumer groups and their system logs.
        let mut gone = vec![k.clone()];
        for shard in 0..entry.shards.len() as u32 {
            self.node.groups.remove(&(k.clone(), shard));
            let log = consume::groups_key(&k, shard);
            if let Some(e) = self.node.streams.remove(&log) {
                self.node.aged_streams -= usize::from(e.config.retention.max_age.is_some());
                self.node.group_ops.remove(&log);
                gone.push(log);
            }
        }
        // Writes still on their way: nobody will read them; say so to whoever waits.
        let mut pending: Vec<WriteToken> =
            self.node.writes.iter().filter(|(_, c)| gone.contains(&c.key)).map(|(t, _)| *t).collect();
        pending.sort_unstable();
        let ctxs: Vec<WriteCtx> = pending.into_iter().filter_map(|t| self.take_write(&t)).collect();
        let r = Self::deleted_refusal(ns, stream);
        let mut waiters = Vec::new();
        for ctx in ctxs {
            waiters.extend(ctx.waiters);
            for (to, id) in ctx.forwards {
                let outcome =
                    ForwardOutcome::Refused { code: r.code.clone(), retry: r.retry, message: r.message.clone() };
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to, id, outcome }));
            }
        }
        // Files: the stream's own when it is durable, its groups' system logs always.
        for g in gone.iter().filter(|g| entry.config.durable || **g != k) {
            self.out.push_back(BrokerOutput::Storage(StorageOutput::DeleteStream {
                tenant_id: g.tenant().to_owned(),
                namespace: g.namespace().to_owned(),
                stream: g.name().to_owned(),
            }));
        }
        for shard in entry.shards {
            for (conn, id) in shard.subs {
                if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) {
                    sub.on(SubEvent::End(Ending::Deleted));
                    self.pump(conn, id);
                }
            }
        }
        Some(waiters)
    }

    /// `stream_delete` (FEATURE_STREAM_ADMIN): needs the admin permission on the stream.
    pub(super) fn stream_delete(&mut self, conn: ConnId, st: &mut CtlStream, d: message::StreamDelete, now: Instant) {
        if let Err(r) =
            requests::check_names(&[("tenant", &d.tenant_id), ("namespace", &d.namespace), ("stream", &d.stream)])
                .and_then(|()| self.authorize(st, &d.tenant_id, &d.namespace, &d.stream, Action::Admin))
        {
            return self.refuse(conn, st, r);
        }
        if d.stream.starts_with(syslog::SYS_PREFIX) {
            let r = Refusal::new(ErrorCode::InvalidRequest, "streams starting with $ belong to the broker");
            return self.refuse(conn, st, r);
        }
        let now = self.clock.advance(now);
        if let Some(view) = &self.membership.view {
            // In a cluster the stream is the cluster's: its deletion goes through the metadata
            // group, and every broker deletes its shards when it is committed.
            let existed = view.owners.keys().any(|s| {
                s.kind == crate::shard::Kind::Stream
                    && (s.tenant.as_str(), s.namespace.as_str(), s.name.as_str())
                        == (d.tenant_id.as_str(), d.namespace.as_str(), d.stream.as_str())
            });
            if existed {
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ProposeStreamDeletion {
                    tenant_id: d.tenant_id.clone(),
                    namespace: d.namespace.clone(),
                    stream: d.stream.clone(),
                }));
            }
            let m = Message::StreamDeleteOk(message::StreamDeleteOk { request_id: d.request_id, existed });
            return self.send(conn, st, json_frame(&m));
        }
        let waiters = self.remove_stream(&d.tenant_id, &d.namespace, &d.stream);
        let existed = waiters.is_some();
        let r = Self::deleted_refusal(&d.namespace, &d.stream);
        for w in waiters.into_iter().flatten() {
            if w.conn == conn && w.stream == st.id {
                // Waiting on this very stream, which the caller holds.
                let data = Self::publish_answer(&w.offer, w.reply, Err(&r));
                self.answering().deliver_answer(conn, st, w.seq, data);
            } else {
                self.finish_waiter(w, Err(&r), now);
            }
        }
        let m = Message::StreamDeleteOk(message::StreamDeleteOk { request_id: d.request_id, existed });
        self.send(conn, st, json_frame(&m));
    }

    /// Records that a shard moved to another broker: its subscriptions end with `shard_moved`
    /// (for clients that read it), new subscribes are redirected, publishes refused
    /// `not_leader`.
    pub fn move_shard(
        &mut self,
        tenant: &str,
        ns: &str,
        stream: &str,
        shard: u32,
        owner: OwnerHint,
        now: Instant,
    ) -> bool {
        let now = self.clock.advance(now);
        self.shard_on(&key(tenant, ns, stream), shard, ServingEvent::MovedTo(owner), now)
    }

    // -----------------------------------------------------------------------------------------
    // Cache
}
