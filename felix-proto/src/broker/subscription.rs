//! Subscriptions: joining a shard, catching up from the log (memory, then storage), live fan-out
//! with one encoding per subscriber shape, bounded queues, writer credit, and the end of one.

use super::*;
use crate::binary::Records;
use crate::error_code::{ErrorCode, RetryClass};
use crate::features::Features;
use crate::flags::Flags;
use crate::message::{self, Message};
use crate::negotiate::ClientOffer;
use crate::transport::{ConnId, ReadToken, StreamId};
use bytes::Bytes;
use log::Shape;
use std::time::Instant;

impl Broker {
    /// Subscriptions and watches one connection may hold: the broker-wide cap, or the stream's
    /// tenant's quota when it is lower.
    pub(super) fn max_subscriptions(&self, st: &CtlStream) -> usize {
        let cap = self.cfg.max_subscriptions_per_connection;
        let quota = st.session.as_ref().and_then(|s| self.node.limits.max_subscriptions(&s.tenant_id));
        quota.map_or(cap, |q| q.min(cap)) as usize
    }

    /// Appends a generation-start record to a durable shard (what a leader does when it starts
    /// serving a shard at a new generation). It takes one offset and is never delivered.
    pub fn start_generation(&mut self, tenant: &str, ns: &str, stream: &str, shard: u32, now: Instant) -> Option<u64> {
        let now = self.clock.advance(now);
        let k = key(tenant, ns, stream);
        let entry = self.node.streams.get_mut(&k)?;
        if !entry.config.durable {
            return None;
        }
        let token = self.ids.write();
        let stream_shards = entry.shards.len() as u32;
        let s = entry.shards.get_mut(shard as usize)?;
        let ts = s.log.stamp(self.wall.micros(now));
        let base = s.log.append_generation_start(ts, token);
        self.out.push_back(BrokerOutput::Storage(StorageOutput::Persist(PersistRequest {
            key: None,
            token,
            tenant_id: k.tenant().to_owned(),
            namespace: k.namespace().to_owned(),
            stream: k.name().to_owned(),
            shard,
            base_offset: base,
            records: Records::default(),
            timestamp_micros: ts,
            publisher: None,
            generation_start: true,
            producer: None,
            state: None,
            fsync: entry.config.fsync,
            stream_shards,
        })));
        self.node.writes.insert(token, WriteCtx::new(k, shard));
        Some(base)
    }

    // -----------------------------------------------------------------------------------------
    // Delivery

    pub(super) fn fanout_committed(&mut self, k: &Key, shard: u32, base: u64, end: u64) {
        let Some(entry) = self.node.streams.get_mut(k) else { return };
        let s = &mut entry.shards[shard as usize];
        let Some(b) = s.log.batch_at(base) else { return };
        if b.generation_start || b.base != base || b.end() != end {
            return;
        }
        let count = b.count();
        let (key, passed_over) = (b.key.clone(), b.passed_over(base));
        let mut subs = std::mem::take(&mut self.fanout_subs);
        subs.clear();
        subs.extend_from_slice(&s.subs);
        // One encoding per subscriber shape, shared by every subscriber of that shape: the first
        // 16 shapes seen are kept on the stack (subscribers share a handful in practice); any
        // other comes from the batch's own cache of encodings.
        let mut frames: [Option<(Shape, [Bytes; 2])>; 16] = Default::default();
        let mut verdicts = Verdicts::default();
        for &(conn, id) in &subs {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            if !sub.live() {
                continue; // catching up from the log, or ending
            }
            if !verdicts.wants(&mut self.stats, sub, key.as_ref()) {
                sub.filtered += passed_over;
                sub.offered = Some(end);
                continue;
            }
            let shape = sub.shape;
            if sub.filtered > 0 {
                // Offsets its filter passed over: said in this frame alone.
                let extra = std::mem::take(&mut sub.filtered);
                let Some(b) = self.node.streams.get_mut(k).and_then(|e| e.shards[shard as usize].log.batch_at(base))
                else {
                    break;
                };
                let frame = b.frame_skipping(shape, extra);
                let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
                Self::enqueue(&mut self.stats, sub, frame, base, count, self.cfg.subscriber_queue_bytes_max);
                self.pump(conn, id);
                continue;
            }
            let frame = match frames.iter().flatten().find(|(sh, _)| *sh == shape) {
                Some((_, f)) => f.clone(),
                None => {
                    let Some(b) =
                        self.node.streams.get_mut(k).and_then(|e| e.shards[shard as usize].log.batch_at(base))
                    else {
                        break;
                    };
                    let f = b.frame(shape);
                    if let Some(slot) = frames.iter_mut().find(|f| f.is_none()) {
                        *slot = Some((shape, f.clone()));
                    }
                    f
                }
            };
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            Self::enqueue(&mut self.stats, sub, frame, base, count, self.cfg.subscriber_queue_bytes_max);
            self.pump(conn, id);
        }
        self.fanout_subs = subs;
    }

    /// Fans a batch of an ephemeral shard out to its subscribers. True when one of them (live,
    /// not excused) is left with its queue over half full: the shard's publishers are to be
    /// held ([`BrokerConfig::publisher_hold_max`]).
    pub(super) fn fanout(&mut self, k: &Key, shard: u32, mut batch: log::LogBatch) -> bool {
        let Some(entry) = self.node.streams.get(k) else { return false };
        let mut subs = std::mem::take(&mut self.fanout_subs);
        subs.clear();
        subs.extend_from_slice(&entry.shards[shard as usize].subs);
        let count = batch.count();
        let bytes_max = self.cfg.subscriber_queue_bytes_max;
        let holds = !self.cfg.publisher_hold_max.is_zero();
        let mut hold = false;
        let mut verdicts = Verdicts::default();
        for &(conn, id) in &subs {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            if sub.ending() || !verdicts.wants(&mut self.stats, sub, batch.key.as_ref()) {
                continue;
            }
            let frame = batch.frame(sub.shape);
            Self::enqueue(&mut self.stats, sub, frame, batch.base, count, bytes_max);
            // Judged before the writer takes what its credit allows (no second look-up on
            // this path); a queue the writer drains under a quarter releases at once.
            if holds && sub.live() && !sub.excused && sub.over_half(bytes_max) {
                sub.holding = true;
                hold = true;
            }
            self.pump(conn, id);
        }
        self.fanout_subs = subs;
        hold
    }

    /// Queues a batch for a subscriber, or drops it when the queue is full (in batches, or in
    /// bytes past `bytes_max`). A client that reads `subscription_lagged` (and offsets, on a
    /// durable stream) has its subscription ended at the first drop; any other sees the drop as
    /// a jump in offsets.
    pub(super) fn enqueue(
        stats: &mut BrokerStats,
        sub: &mut Sub,
        frame: [Bytes; 2],
        base: u64,
        count: u64,
        bytes_max: usize,
    ) {
        sub.offered = Some(base + count);
        if sub.full(frame_len(&frame), bytes_max) {
            stats.records_dropped += count;
            sub.dropped += count;
            if sub.shape.offsets && sub.offer.has(Features::SUBSCRIPTION_LAGGED) {
                stats.lagged += 1;
                sub.on(SubEvent::End(Ending::Lagged { resume_from: base }));
            }
            return;
        }
        sub.push(frame);
    }

    /// Writes what a subscriber has ready, within its writer credit; ends it when it is ending
    /// and everything before the end is written.
    pub(super) fn pump(&mut self, conn: ConnId, id: u64) {
        let limit = self.cfg.event_stream_inflight_bytes;
        loop {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { return };
            let Some(stream) = sub.stream else { return };
            // A subscriber reading history asks for its next read while up to one read's worth
            // is still being sent: the read (storage, or a replica's log on another thread)
            // overlaps the sending instead of waiting for it.
            let over = sub.inflight >= limit;
            let read_ahead = sub.inflight < limit.saturating_add(self.cfg.history_read_bytes);
            if over && !(read_ahead && sub.catch_up().is_some()) {
                return;
            }
            if let Some(catch_up) = sub.catch_up() {
                // Catching up from the log.
                if catch_up.reading.is_some() {
                    return; // waiting for history from storage
                }
                let cursor = catch_up.cursor;
                let (k, shard, shape) = (sub.key.clone(), sub.shard, sub.shape);
                let Some(entry) = self.node.streams.get_mut(&k) else { return };
                let log = &mut entry.shards[shard as usize].log;
                // Retention may have passed the cursor: that history is gone (a visible gap).
                let cursor = cursor.max(log.start());
                if cursor >= log.memory_start() && over {
                    return; // what is next is in memory: sent once the stream has room
                }
                if cursor < log.memory_start() {
                    let token = self.ids.read();
                    let end = log.memory_start();
                    self.node.reads.insert(token, ReadFor::Sub(conn, id));
                    self.out.push_back(BrokerOutput::Storage(StorageOutput::Read(ReadRequest {
                        token,
                        tenant_id: k.tenant().to_owned(),
                        namespace: k.namespace().to_owned(),
                        stream: k.name().to_owned(),
                        shard,
                        from: cursor,
                        end,
                        max_bytes: self.cfg.history_read_bytes,
                    })));
                    let sub = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)).expect("present");
                    sub.on(SubEvent::Reading(sub::CatchUp { cursor, reading: Some(token) }));
                    return;
                }
                let filter = sub.filter.clone();
                let extra = sub.filtered;
                let next = log.next_deliverable(cursor).map(|b| {
                    if filter.as_ref().is_some_and(|f| !f.matches(b.key.as_deref())) {
                        return (Err(b.passed_over(cursor)), b.end());
                    }
                    let f = if b.base >= cursor { b.frame_skipping(shape, extra) } else { b.frame_from(shape, cursor) };
                    (Ok(f), b.end())
                });
                let sub = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)).expect("present");
                if filter.is_some() && next.is_some() {
                    self.stats.filter_evaluations += 1;
                }
                match next {
                    Some((Err(passed), end)) => {
                        // Not for its filter: passed over, said in the next frame it is sent.
                        sub.filtered += passed;
                        sub.on(SubEvent::Delivered { cursor: end });
                    }
                    Some((Ok(frame), end)) => {
                        sub.filtered = 0;
                        sub.on(SubEvent::Delivered { cursor: end });
                        sub.inflight += frame[0].len() + frame[1].len();
                        self.stats.batches_delivered += 1;
                        self.write_frame(conn, stream, frame);
                    }
                    None => {
                        // Caught up: from here on the subscriber is fed live.
                        sub.on(SubEvent::CaughtUp);
                    }
                }
                continue;
            }
            if let Some(frame) = sub.queue.pop_front() {
                // Saturating: a watch's initial replay is queued without being counted.
                sub.queued_bytes = sub.queued_bytes.saturating_sub(frame_len(&frame));
                if (sub.holding || sub.excused) && sub.under_quarter(self.cfg.subscriber_queue_bytes_max) {
                    if sub.holding {
                        self.events.raise(events::Event::HoldMayEnd(sub.key.clone(), sub.shard));
                    }
                    sub.holding = false;
                    sub.excused = false;
                }
                sub.inflight += frame_len(&frame);
                self.stats.batches_delivered += 1;
                self.write_frame(conn, stream, frame);
                continue;
            }
            if let sub::Phase::Ending { why: ending, .. } = sub.phase.clone() {
                let offer = sub.offer;
                let sub_id = sub.id;
                let terminal = match ending {
                    Ending::Lagged { resume_from } => Some(Message::SubscriptionLagged(message::SubscriptionLagged {
                        subscription_id: sub_id,
                        resume_from,
                    })),
                    Ending::WatchLagged { resume_from } => {
                        Some(Message::CacheWatchLagged(message::CacheWatchLagged { resume_from }))
                    }
                    Ending::Moved(m) => offer.has(Features::SHARD_MOVED).then_some(Message::ShardMoved(m)),
                    Ending::Deleted => offer
                        .has(Features::STREAM_DELETED)
                        .then_some(Message::StreamDeleted(message::StreamDeleted { subscription_id: sub_id })),
                    Ending::Revoked { expired } => offer.has(Features::ERROR_CODES).then(|| {
                        let why = if expired { "expired" } else { "was revoked" };
                        Self::error_message(
                            &offer,
                            &Refusal::new(
                                ErrorCode::Revoked,
                                format!("the token this subscription was opened with {why}"),
                            ),
                        )
                    }),
                };
                if let Some(m) = terminal {
                    self.out.push_back(BrokerOutput::Transport(TransportOutput::Transmit {
                        conn,
                        stream,
                        data: json_frame(&m),
                    }));
                }
                self.out.push_back(BrokerOutput::Transport(TransportOutput::Finish { conn, stream }));
                if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.remove(&id)) {
                    self.unlink_sub(conn, &sub);
                }
            }
            return;
        }
    }

    /// Storage returned history asked for with `StorageOutput::Read`. The batches are delivered
    /// to the subscriber that asked, in order, and its catch-up continues.
    pub fn handle_read_complete(&mut self, token: ReadToken, batches: Vec<crate::storage::StoredBatch>, now: Instant) {
        let now = self.clock.advance(now);
        self.read_complete(token, batches, now);
        // A subscriber fed here may have drained under a quarter and ended a hold.
        self.run_events(now);
    }

    fn read_complete(&mut self, token: ReadToken, batches: Vec<crate::storage::StoredBatch>, now: Instant) {
        let (conn, id) = match self.node.reads.remove(&token) {
            Some(ReadFor::Sub(conn, id)) => (conn, id),
            Some(ReadFor::Page(p)) => return self.page_read_complete(token, p, batches),
            Some(ReadFor::Poll(p)) => return self.poll_read_complete(*p, batches),
            Some(ReadFor::Copy { to, shard, max, first }) => {
                return self.copy_read_complete(to, shard, max, first, batches, now);
            }
            None => return,
        };
        let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { return };
        let Some(catch_up) = sub.catch_up().filter(|c| c.reading == Some(token)) else { return };
        let mut cursor = catch_up.cursor;
        sub.on(SubEvent::Delivered { cursor });
        let Some(stream) = sub.stream else { return };
        let shape = sub.shape;
        let filter = sub.filter.clone();
        // Offsets a filter passed over (D57), carried from frame to frame until one is sent.
        let mut filtered = std::mem::take(&mut sub.filtered);
        let asked_from = cursor;
        let memory_start = self
            .node
            .streams
            .get(&sub.key)
            .and_then(|e| e.shards.get(sub.shard as usize))
            .map_or(cursor, |s| s.log.memory_start());
        let mut frames = Vec::new();
        let mut skip = 0u64;
        for b in batches {
            if b.generation_start {
                skip += 1;
                continue;
            }
            let end = b.base_offset + b.count();
            if end <= cursor || b.base_offset >= memory_start {
                skip = 0;
                continue;
            }
            let from = cursor.max(b.base_offset);
            if let Some(f) = &filter {
                self.stats.filter_evaluations += 1;
                if !f.matches(b.key.as_deref()) {
                    filtered += if from == b.base_offset { skip } else { 0 } + (end - from);
                    skip = 0;
                    cursor = end;
                    continue;
                }
            }
            let records = b.records.skip((from - b.base_offset) as u32);
            let skipped = if from == b.base_offset { skip } else { 0 } + std::mem::take(&mut filtered);
            skip = 0;
            let e = log::event_batch(shape, records, from, skipped, b.publisher.as_ref(), b.timestamp_micros);
            if let Ok(f) = e.encode_parts() {
                frames.push(f);
            }
            cursor = end;
        }
        if frames.is_empty() && cursor == asked_from {
            // Storage had nothing there (deleted by retention, or unreadable): skip to what is in
            // memory rather than ask again forever. The subscriber sees the gap in offsets.
            cursor = cursor.max(memory_start);
        }
        let sub = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)).expect("present");
        sub.on(SubEvent::Delivered { cursor });
        sub.filtered += filtered;
        for f in &frames {
            sub.inflight += f[0].len() + f[1].len();
        }
        self.stats.batches_delivered += frames.len() as u64;
        for f in frames {
            self.write_frame(conn, stream, f);
        }
        self.pump(conn, id);
    }

    /// The shared copy of a subscription filter (D57): subscriptions with equal filters hold
    /// one, so fan-out judges each batch once per distinct filter.
    fn intern_filter(&mut self, f: &message::KeyFilter) -> std::sync::Arc<message::KeyFilter> {
        if let Some(shared) = self.node.filters.get(f).and_then(std::sync::Weak::upgrade) {
            return shared;
        }
        if self.node.filters.len() >= 64 {
            self.node.filters.retain(|_, w| w.strong_count() > 0);
        }
        let shared = std::sync::Arc::new(f.clone());
        self.node.filters.insert(f.clone(), std::sync::Arc::downgrade(&shared));
        shared
    }

    pub(super) fn write_frame(&mut self, conn: ConnId, stream: StreamId, [head, body]: [Bytes; 2]) {
        self.out.push_back(BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data: head }));
        if !body.is_empty() {
            self.out.push_back(BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data: body }));
        }
    }

    // -----------------------------------------------------------------------------------------
    // Subscriptions

    pub(super) fn subscribe(&mut self, conn: ConnId, st: &mut CtlStream, s: message::Subscribe, _now: Instant) {
        let shards =
            match self.lookup_stream(st, &s.tenant_id, &s.namespace, &s.stream, Action::Subscribe, Missing::Create) {
                Ok(n) => n,
                Err(r) => return self.refuse(conn, st, r),
            };
        let offer = Self::features_of(st);
        let filter = match &s.filter {
            None => None,
            Some(f) => match f.check() {
                Ok(()) => Some(self.intern_filter(f)),
                Err(why) => return self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, why)),
            },
        };
        let shard = s.shard.unwrap_or(0);
        if shard >= shards {
            let r = Refusal::new(ErrorCode::InvalidRequest, format!("stream has no shard {shard} (it has {shards})"));
            return self.refuse(conn, st, r);
        }
        let Some(k) = self.stream_key(&s.tenant_id, &s.namespace, &s.stream) else { return };
        let max_subs = self.max_subscriptions(st);
        let cap_max = self.cfg.subscriber_queue_capacity_max.max(1);
        let entry = self.node.streams.get_mut(&k).expect("looked up");
        let durable = entry.config.durable;
        let default_cap = entry.config.queue_capacity.clamp(1, cap_max);
        let sh = &mut entry.shards[shard as usize];
        if let Some(m) = sh.serving.away() {
            let msg = Self::not_leader_answer(self.server_features, &offer, m, shard);
            return self.send(conn, st, json_frame(&msg));
        }
        // Where the subscription starts. A client that negotiated offsets is told where it
        // joined, and its subscribe with no start is an explicit `latest`.
        let start_pos = s.start.unwrap_or(message::StartPosition::Latest);
        let tail = sh.log.readable_tail();
        let cursor = if durable {
            match start_pos {
                message::StartPosition::Latest => tail,
                message::StartPosition::Earliest => sh.log.start(),
                message::StartPosition::Offset(n) => {
                    let cursor_error = |reason, available| {
                        Message::SubscribeCursorError(message::SubscribeCursorError { reason, requested: n, available })
                    };
                    if n < sh.log.start() {
                        let m = cursor_error(message::CursorErrorReason::TooOld, sh.log.start());
                        return self.send(conn, st, json_frame(&m));
                    }
                    if n > sh.log.committed_tail() {
                        let m = cursor_error(message::CursorErrorReason::InFuture, sh.log.committed_tail());
                        return self.send(conn, st, json_frame(&m));
                    }
                    n
                }
            }
        } else {
            if matches!(start_pos, message::StartPosition::Offset(_)) {
                let r = Refusal::new(ErrorCode::InvalidRequest, "an ephemeral stream keeps no history to resume from");
                return self.refuse(conn, st, r);
            }
            0
        };
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.subs.len() >= max_subs {
            let r = Refusal::new(ErrorCode::LimitExceeded, format!("at most {max_subs} subscriptions per connection"));
            return self.refuse(conn, st, r);
        }
        let id = match c.claim_sub_id(s.subscription_id) {
            Ok(id) => id,
            Err(id) => {
                let r = Refusal::new(ErrorCode::InvalidRequest, format!("subscription {id} already exists"));
                return self.refuse(conn, st, r);
            }
        };
        let granted = s.queue_capacity.map(|q| q.clamp(1, cap_max));
        let capacity = granted.unwrap_or(default_cap) as usize;
        let offsets = durable && offer.offered(Flags::EVENT_BATCH_OFFSETS);
        let shape = Shape {
            offsets,
            skipped: offsets && offer.offered(Flags::EVENT_BATCH_SKIPPED),
            publisher: offer.offered(Flags::EVENT_BATCH_PUBLISHER),
            timestamps: durable && offer.offered(Flags::EVENT_BATCH_TIMESTAMPS),
            codecs: if offer.offered(Flags::EXTENDED) {
                offer.flags_hi.intersection(crate::flags::FlagsHi::CODECS)
            } else {
                crate::flags::FlagsHi::EMPTY
            },
            envelope: offer.offered_hi(crate::flags::FlagsHi::ENVELOPE),
        };
        let token = self.ids.open();
        c.opens.insert(token, id);
        if let Some(j) = st.session.as_ref().and_then(|s| s.jwt.as_ref()) {
            self.timers.expiries.insert((j.exp, conn, id, j.credential.clone()));
        }
        let Some(c) = self.conns.get_mut(&conn) else { return };
        c.subs.insert(
            id,
            Sub {
                capacity,
                filter,
                ..Sub::new(id, k.clone(), shard, shape, offer, (durable && cursor < tail).then_some(cursor))
            },
        );
        let entry = self.node.streams.get_mut(&k).expect("looked up");
        entry.shards[shard as usize].subs.push((conn, id));
        let answer = Message::Subscribed(message::Subscribed {
            subscription_id: id,
            start_offset: offsets.then_some(cursor),
            live_offset: offsets.then_some(tail.max(cursor)),
            queue_capacity: if self.server_features.contains(Features::SUBSCRIBE_QUEUE) { granted } else { None },
        });
        self.send(conn, st, json_frame(&answer));
        self.out.push_back(BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }));
    }

    /// The answer to a request for a shard that moved away: `not_leader` for a client that
    /// offered FEATURE_REDIRECT to a broker that advertised it (a clustered one), an `error`
    /// with code `not_leader` for any other.
    pub(super) fn not_leader_answer(server: Features, offer: &ClientOffer, away: Away<'_>, shard: u32) -> Message {
        let m = match away {
            Away::Owner(m) => m,
            Away::Unavailable { reason, node } => return Self::error_message(offer, &reason.refusal(shard, node)),
        };
        if offer.has(Features::REDIRECT) && server.contains(Features::REDIRECT) {
            Message::NotLeader(message::NotLeader {
                node_id: m.node_id.clone(),
                addr: m.addr.clone(),
                generation: m.generation,
            })
        } else {
            let mut r = Refusal::new(ErrorCode::NotLeader, format!("shard {shard} is owned by {}", m.node_id));
            r.retry = RetryClass::Redirect;
            Self::error_message(offer, &r)
        }
    }

    // -----------------------------------------------------------------------------------------
    // Operator actions
}

/// Which distinct filters let one batch through (D57): each is judged once per batch, however
/// many subscriptions share it (the broker interns filters, so sharing is pointer equality).
#[derive(Default)]
struct Verdicts(Vec<(*const message::KeyFilter, bool)>);

impl Verdicts {
    /// Whether `sub` takes a batch with this key.
    fn wants(&mut self, stats: &mut BrokerStats, sub: &Sub, key: Option<&Bytes>) -> bool {
        let Some(f) = &sub.filter else { return true };
        let at = std::sync::Arc::as_ptr(f);
        if let Some((_, v)) = self.0.iter().find(|(p, _)| *p == at) {
            return *v;
        }
        stats.filter_evaluations += 1;
        let v = sub.wants(key);
        self.0.push((at, v));
        v
    }
}
