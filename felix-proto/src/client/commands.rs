//! Commands: publishes and requests, each on the stream it belongs on. The `*_auto` commands
//! choose the stream themselves (the main stream, or the long-poll stream) and hold a request
//! until its stream authenticated; the others take an explicit, authenticated stream.

use super::control::{Awaiting, CtlState, Queued, Role, SubRequest};
use super::{
    CacheWatchRequest, ClientConnection, ClientStream, CommandError, CommitRequest, ErrorInfo, PublishId,
    PublishRequest, StreamReadRequest, SubscribeRequest, Timer, WatchOn, frame_of, needs,
};
use crate::binary::{AckMode, AckedPrefix, Compressor, PublishBatch, Records};
use crate::error_code::RetryClass;
use crate::flags::Flags;
use crate::message::{self, B64, Message};
use crate::negotiate::Negotiated;
use bytes::{Bytes, BytesMut};
use std::time::{Duration, Instant};

impl ClientConnection {
    // -----------------------------------------------------------------------------------------
    // Publishing

    /// Publishes a batch on `stream`. The encoding is chosen from what the broker advertised:
    /// binary when it can carry the request, JSON otherwise.
    ///
    /// # Errors
    /// [`CommandError::WindowFull`] when the stream's (or the connection's) publish window is
    /// full; [`CommandError::NotNegotiated`] for anything the broker did not advertise (a key
    /// without flag 0x0040, an explicit shard, an idempotent or conditional publish). Nothing is
    /// sent and the window state is unchanged.
    pub fn publish(
        &mut self,
        stream: ClientStream,
        req: PublishRequest,
        now: Instant,
    ) -> Result<PublishId, CommandError> {
        self.clock.advance(now);
        let idx = self.ctl_index(stream)?;
        let id = PublishId(self.next_request);
        self.send_publish(idx, id, req)?;
        self.next_request += 1;
        Ok(id)
    }

    /// Publishes a batch on the main stream, whatever its state: held until the stream
    /// authenticated and while its publish window is full, then sent in order. The answer (for
    /// an acked publish) comes as `PublishAcked`, `PublishFailed` or `PublishRefused`; a publish
    /// that cannot be sent when its turn comes (the broker lacks what it needs) fails with
    /// `PublishFailed`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] when the connection already knows the broker lacks what
    /// it needs; [`CommandError::ConnectionLost`].
    pub fn publish_auto(&mut self, req: PublishRequest, now: Instant) -> Result<PublishId, CommandError> {
        self.clock.advance(now);
        if let Some(why) = &self.lost {
            return Err(CommandError::ConnectionLost(why.clone()));
        }
        if let Some(neg) = self.any_negotiated() {
            check_publish(&neg, &req)?;
        }
        let id = PublishId(self.next_request);
        self.next_request += 1;
        self.ensure_main();
        self.queued_publishes.push_back((id, req));
        self.flush_publishes();
        Ok(id)
    }

    /// Sends queued publishes while the main stream is ready and its window has room.
    pub(super) fn flush_publishes(&mut self) {
        while let Some((id, req)) = self.queued_publishes.pop_front() {
            let idx = self.main;
            if !matches!(self.ctls[idx].state, CtlState::Ready(_)) {
                self.queued_publishes.push_front((id, req));
                return;
            }
            match self.send_publish(idx, id, req.clone()) {
                Ok(()) => {}
                Err(CommandError::WindowFull) => {
                    self.queued_publishes.push_front((id, req));
                    return;
                }
                Err(e) => {
                    let error =
                        ErrorInfo { message: e.to_string(), code: None, retry: Some(RetryClass::Fatal), detail: None };
                    self.events.push_back(super::ClientEvent::PublishFailed { id, error });
                }
            }
        }
    }

    fn send_publish(&mut self, idx: usize, id: PublishId, req: PublishRequest) -> Result<(), CommandError> {
        let neg = self.negotiated_at(idx);
        check_publish(&neg, &req)?;
        let mut req = req;
        req.ack |= req.idempotent.is_some() || req.expected_offset.is_some();
        if req.ack
            && let Some(w) = neg.publish_window
        {
            let used = if neg.per_stream_window { self.ctls[idx].inflight } else { self.shared_inflight };
            if used >= w {
                self.ctls[idx].was_full = true;
                return Err(CommandError::WindowFull);
            }
        }
        let data = self.encode_publish(&neg, id.0, &req)?;
        if req.ack {
            self.publishes.insert(id.0, (id, idx));
            self.ctls[idx].inflight += 1;
            self.shared_inflight += 1;
            self.arm(Timer::Request(id.0), Duration::ZERO);
        }
        self.send(idx, data);
        Ok(())
    }

    fn encode_publish(
        &mut self,
        neg: &Negotiated,
        request_id: u64,
        req: &PublishRequest,
    ) -> Result<Bytes, CommandError> {
        let binary = !req.json
            && req.shard.is_none()
            && req.expected_offset.is_none()
            && (req.key.is_none() || neg.may_send(Flags::BINARY_PUBLISH_KEYED))
            && (!req.ack || neg.may_send(Flags::BINARY_PUBLISH_ACKED))
            && (req.idempotent.is_none() || neg.may_send(Flags::BINARY_PUBLISH_IDEMPOTENT));
        let tenant_id = self.cfg.tenant_id.clone();
        let payloads = || req.payloads.iter().cloned().map(B64).collect();
        if binary {
            let b = PublishBatch {
                acked: req.ack.then_some(AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
                idempotent: req
                    .idempotent
                    .map(|(producer_id, sequence)| crate::binary::IdempotentPrefix { producer_id, sequence }),
                key: req.key.clone(),
                tenant_id,
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                records: Records::default(),
            };
            let mut out = BytesMut::new();
            let encoded = match (self.compressor(neg)?, &req.envelope) {
                (c, Some(envelope)) => {
                    // With an envelope (D58): the block built once, compressed if asked.
                    let records =
                        Records::from_payloads(&req.payloads).map_err(|e| CommandError::Encode(e.to_string()))?;
                    let records = match c {
                        Some(c) => records.compressed(c),
                        None => records,
                    };
                    PublishBatch { records: records.with_envelope(Some(envelope.clone())), ..b }.encode(&mut out)
                }
                (Some(c), None) => b.encode_payloads_compressed(&req.payloads, c, &mut out),
                (None, None) => b.encode_payloads(&req.payloads, &mut out),
            };
            encoded.map_err(|e| CommandError::Encode(e.to_string()))?;
            return Ok(out.freeze());
        }
        frame_of(&match (req.idempotent, req.expected_offset) {
            (Some((producer_id, sequence)), _) => Message::PublishIdempotent(message::PublishIdempotent {
                tenant_id,
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                payloads: payloads(),
                key: req.key.clone().map(B64),
                request_id,
                producer_id,
                sequence,
                publish_width: None,
            }),
            (None, Some(expected_offset)) => Message::PublishIf(message::PublishIf {
                tenant_id,
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                payloads: payloads(),
                key: req.key.clone().map(B64),
                expected_offset,
                shard: req.shard,
                request_id,
                publish_width: None,
            }),
            (None, None) => Message::PublishBatch(message::PublishBatchMsg {
                tenant_id,
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                payloads: payloads(),
                key: req.key.clone().map(B64),
                shard: req.shard,
                request_id: req.ack.then_some(request_id),
                ack: req.ack.then_some(AckMode::PerBatch),
                publish_width: None,
            }),
        })
    }

    /// The compressor for binary publishes, when compression is configured and the broker
    /// takes its codec (D56); made once and kept, as zstd's context is worth keeping.
    fn compressor(&mut self, neg: &Negotiated) -> Result<Option<&mut Compressor>, CommandError> {
        let Some((codec, level)) = self.cfg.compress else { return Ok(None) };
        if !neg.may_send_hi(codec.flag()) {
            return Ok(None);
        }
        if self.compressor.as_ref().is_none_or(|c| c.codec() != codec || c.level() != level) {
            self.compressor = Some(Compressor::new(codec, level).map_err(CommandError::Encode)?);
        }
        Ok(self.compressor.as_mut())
    }

    // -----------------------------------------------------------------------------------------
    // Subscriptions

    /// Subscribes on `stream`. Returns the subscription id (chosen by the client).
    ///
    /// # Errors
    /// [`CommandError::NotConnected`] before the stream authenticated;
    /// [`CommandError::NotNegotiated`] for a queue capacity the broker does not honour.
    pub fn subscribe(
        &mut self,
        stream: ClientStream,
        req: SubscribeRequest,
        now: Instant,
    ) -> Result<u64, CommandError> {
        self.clock.advance(now);
        self.start_sub(stream, SubRequest::Subscribe(req))
    }

    /// Subscribes on a control stream of its own: opened now, authenticated, then the subscribe,
    /// and our side finished once it is answered. This is how upstream clients subscribe, and
    /// the only way that works with a released broker, which stops a subscription's control
    /// stream after `subscribed` (anything else pending on it would be lost). Answered by
    /// `Subscribed` or `SubscribeFailed` (also when the stream's `auth` is refused, or the broker
    /// lacks what the request needs).
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] when a stream of this connection already learned that the
    /// broker lacks what the request needs (nothing is opened); [`CommandError::ConnectionLost`].
    pub fn subscribe_dedicated(&mut self, req: SubscribeRequest, now: Instant) -> Result<u64, CommandError> {
        self.start_sub_dedicated(SubRequest::Subscribe(req), now)
    }

    /// Watches a cache key or prefix on `stream` (FEATURE_CACHE_WATCH). Returns the
    /// subscription id; confirmed by `CacheWatchStarted`, changes come as `CacheEvent`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature (or without
    /// FEATURE_CACHE_WATCH_RETAINED for `retained`).
    pub fn cache_watch(&mut self, stream: ClientStream, req: CacheWatchRequest) -> Result<u64, CommandError> {
        self.start_sub(stream, SubRequest::Watch(req))
    }

    /// [`subscribe_dedicated`](Self::subscribe_dedicated) for a cache watch.
    ///
    /// # Errors
    /// As [`subscribe_dedicated`](Self::subscribe_dedicated).
    pub fn cache_watch_dedicated(&mut self, req: CacheWatchRequest, now: Instant) -> Result<u64, CommandError> {
        self.start_sub_dedicated(SubRequest::Watch(req), now)
    }

    fn start_sub(&mut self, stream: ClientStream, req: SubRequest) -> Result<u64, CommandError> {
        let idx = self.ctl_index(stream)?;
        let sub = self.next_sub;
        self.send_sub(idx, sub, req)?;
        self.next_sub += 1;
        Ok(sub)
    }

    fn start_sub_dedicated(&mut self, req: SubRequest, now: Instant) -> Result<u64, CommandError> {
        self.clock.advance(now);
        if let Some(neg) = self.any_negotiated() {
            needs::check(&neg, &self.sub_message(0, req.clone()))?;
        }
        let sub = self.dedicate(now)?;
        let idx = self.open_dedicated();
        self.queue_on(idx, Queued::Sub { sub, req });
        Ok(sub)
    }

    fn dedicate(&mut self, _now: Instant) -> Result<u64, CommandError> {
        if let Some(why) = &self.lost {
            return Err(CommandError::ConnectionLost(why.clone()));
        }
        let sub = self.next_sub;
        self.next_sub += 1;
        self.subs.insert(sub, super::events::SubEntry::pending());
        self.arm(Timer::Subscribe(sub), Duration::ZERO);
        Ok(sub)
    }

    fn open_dedicated(&mut self) -> usize {
        self.open_ctl(Role::Dedicated).0 as usize
    }

    fn sub_message(&self, sub: u64, req: SubRequest) -> Message {
        match req {
            SubRequest::Subscribe(r) => self.subscribe_message(sub, r),
            SubRequest::Watch(r) => self.watch_message(sub, r),
        }
    }

    fn subscribe_message(&self, sub: u64, req: SubscribeRequest) -> Message {
        Message::Subscribe(message::Subscribe {
            tenant_id: self.cfg.tenant_id.clone(),
            namespace: req.namespace,
            stream: req.stream,
            subscription_id: Some(sub),
            start: req.start,
            shard: req.shard,
            queue_capacity: req.queue_capacity,
            filter: req.filter,
        })
    }

    fn watch_message(&self, sub: u64, req: CacheWatchRequest) -> Message {
        let (key, prefix) = match req.filter {
            WatchOn::Key(k) => (Some(k), None),
            WatchOn::Prefix(p) => (None, Some(p)),
        };
        Message::CacheWatch(message::CacheWatch {
            tenant_id: self.cfg.tenant_id.clone(),
            namespace: req.namespace,
            cache: req.cache,
            key,
            prefix,
            shard: None,
            from_offset: req.from_offset,
            retained: req.retained,
            subscription_id: Some(sub),
        })
    }

    fn send_sub(&mut self, idx: usize, sub: u64, req: SubRequest) -> Result<(), CommandError> {
        let m = self.sub_message(sub, req);
        self.send_sub_request(idx, sub, &m)
    }

    fn send_sub_request(&mut self, idx: usize, sub: u64, m: &Message) -> Result<(), CommandError> {
        needs::check(&self.negotiated_at(idx), m)?;
        let data = frame_of(m)?;
        self.subs.entry(sub).or_insert_with(super::events::SubEntry::pending);
        self.ctls[idx].awaiting.push_back(Awaiting::Sub(sub));
        self.arm(Timer::Subscribe(sub), Duration::ZERO);
        self.send(idx, data);
        Ok(())
    }

    // -----------------------------------------------------------------------------------------
    // Requests

    /// Sends any request that carries a `request_id` on `stream`, built around the id this
    /// returns. Its answer comes as `Reply` or `RequestFailed`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] when the broker lacks what the request (or one of its
    /// optional fields) needs ([`needs`]); nothing is sent.
    pub fn request(&mut self, stream: ClientStream, build: impl FnOnce(u64) -> Message) -> Result<u64, CommandError> {
        let idx = self.ctl_index(stream)?;
        let request_id = self.next_request;
        let m = build(request_id);
        self.send_request(idx, request_id, &m, long_wait(&m))?;
        self.next_request += 1;
        Ok(request_id)
    }

    /// Sends a request on the stream it belongs on: long polls (a `group_poll` that may wait)
    /// on a stream of their own, so they hold up no other answer, the rest on the main stream.
    /// Held until that stream authenticated.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] when the connection already knows the broker lacks what
    /// the request needs; [`CommandError::ConnectionLost`].
    pub fn request_auto(&mut self, build: impl FnOnce(u64) -> Message, now: Instant) -> Result<u64, CommandError> {
        self.clock.advance(now);
        if let Some(why) = &self.lost {
            return Err(CommandError::ConnectionLost(why.clone()));
        }
        let request_id = self.next_request;
        let m = build(request_id);
        if let Some(neg) = self.any_negotiated() {
            needs::check(&neg, &m)?;
        }
        frame_of(&m)?;
        self.next_request += 1;
        let extra = long_wait(&m);
        let idx = if extra.is_zero() { self.ensure_main() } else { self.ensure_long() };
        self.queue_on(idx, Queued::Request { request_id, message: m, extra });
        Ok(request_id)
    }

    fn send_request(&mut self, idx: usize, request_id: u64, m: &Message, extra: Duration) -> Result<(), CommandError> {
        needs::check(&self.negotiated_at(idx), m)?;
        let data = frame_of(m)?;
        self.ctls[idx].awaiting.push_back(Awaiting::Request(request_id));
        self.arm(Timer::Request(request_id), extra);
        self.send(idx, data);
        Ok(())
    }

    /// Puts a request on a stream: at once if it authenticated, else when it does.
    fn queue_on(&mut self, idx: usize, q: Queued) {
        match self.ctls[idx].state {
            CtlState::Ready(_) => self.send_queued(idx, q),
            CtlState::Authenticating => self.ctls[idx].queued.push(q),
            CtlState::Refused | CtlState::Closed => {
                let error = ErrorInfo::unknown_outcome("its control stream was closed");
                self.fail_queued(q, error);
            }
        }
    }

    /// Sends what waited for its stream to authenticate (or fails it when the broker turns out
    /// to lack what it needs).
    pub(super) fn send_queued(&mut self, idx: usize, q: Queued) {
        let sent = match &q {
            Queued::Request { request_id, message, extra } => self.send_request(idx, *request_id, message, *extra),
            Queued::Sub { sub, req } => self.send_sub(idx, *sub, req.clone()),
        };
        if let Err(e) = sent {
            let error = ErrorInfo { message: e.to_string(), code: None, retry: Some(RetryClass::Fatal), detail: None };
            self.fail_queued(q, error);
            self.finish_dedicated(idx);
        }
    }

    pub(super) fn fail_queued(&mut self, q: Queued, error: ErrorInfo) {
        match q {
            Queued::Request { request_id, .. } => self.request_failed(request_id, error, None, None),
            Queued::Sub { sub, .. } => self.subscribe_failed(sub, error, None, None),
        }
    }

    /// The main stream, opened again if the broker ended it.
    fn ensure_main(&mut self) -> usize {
        if matches!(self.ctls[self.main].state, CtlState::Closed | CtlState::Refused) {
            self.main = self.open_ctl(Role::Main).0 as usize;
        }
        self.main
    }

    /// The long-poll stream, opened on first use (and again if the broker ended it).
    fn ensure_long(&mut self) -> usize {
        match self.long {
            Some(i) if !matches!(self.ctls[i].state, CtlState::Closed | CtlState::Refused) => i,
            _ => {
                let i = self.open_ctl(Role::Long).0 as usize;
                self.long = Some(i);
                i
            }
        }
    }

    fn cache_request(&mut self, stream: ClientStream, build: impl FnOnce(u64) -> Message) -> Result<u64, CommandError> {
        self.request(stream, build)
    }

    /// Reads a bounded page of a durable shard without subscribing (FEATURE_STREAM_READ).
    /// Answered by `Reply::StreamRecords`, or `RequestFailed` (a cursor outside the retained
    /// range comes with `cursor`).
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn stream_read(&mut self, stream: ClientStream, req: StreamReadRequest) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| stream_read_message(tenant_id, req, request_id))
    }

    /// Commits an event and state changes as one record (FEATURE_ATOMIC_COMMIT) to the shard
    /// `entity_key` routes to; with `expected_offset` (FEATURE_PUBLISH_CONDITIONAL) only if the
    /// shard's next offset is that. Answered by `Reply::Committed` once durable, `Reply::Refused`
    /// (`offset_mismatch`), or `RequestFailed`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the features it needs.
    pub fn commit(&mut self, stream: ClientStream, req: CommitRequest) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.request(stream, |request_id| commit_message(tenant_id, req, request_id))
    }

    /// Reads one key of the state of the shard `entity_key` routes to (FEATURE_ATOMIC_COMMIT).
    /// Answered by `Reply::State`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn state_get(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        name: &str,
        entity_key: Bytes,
        key: &str,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.request(stream, |request_id| {
            Message::StateGet(message::StateGet {
                tenant_id,
                namespace: namespace.into(),
                stream: name.into(),
                entity_key: B64(entity_key),
                key: key.into(),
                shard: None,
                request_id,
            })
        })
    }

    /// Asks for the first offset of a durable shard appended at or after `at_micros`
    /// (FEATURE_RECORD_TIMESTAMPS). Answered by `Reply::OffsetValue`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn offset_for_time(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        name: &str,
        shard: u32,
        at_micros: u64,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::OffsetForTime(message::OffsetForTime {
                tenant_id,
                namespace: namespace.into(),
                stream: name.into(),
                shard,
                at_micros,
                request_id,
            })
        })
    }

    /// Adds `delta` to a counter (FEATURE_COUNTERS). Answered by `Reply::CounterValue` with
    /// the sum including it, once it is durable.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn counter_add(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        cache: &str,
        key: &str,
        delta: i64,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::CounterAdd(message::CounterAdd {
                tenant_id,
                namespace: namespace.into(),
                cache: cache.into(),
                key: key.into(),
                delta,
                request_id,
            })
        })
    }

    /// Reads a counter (FEATURE_COUNTERS). Answered by `Reply::CounterValue` (`None`: never
    /// written).
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn counter_get(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::CounterGet(message::CounterGet {
                tenant_id,
                namespace: namespace.into(),
                cache: cache.into(),
                key: key.into(),
                request_id,
            })
        })
    }

    /// Asks the broker for a producer id (FEATURE_IDEMPOTENT_PRODUCER). Answered by
    /// `Reply::ProducerId`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn producer_init(&mut self, stream: ClientStream) -> Result<u64, CommandError> {
        self.cache_request(stream, |request_id| Message::ProducerInit(message::ProducerInit { request_id }))
    }

    /// Asks how many shards a stream has and how keys map to them (FEATURE_STREAM_SHARDS).
    /// Answered by `Reply::StreamShards`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn stream_shards(&mut self, stream: ClientStream, namespace: &str, name: &str) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::StreamShards(message::StreamShards {
                tenant_id,
                namespace: namespace.into(),
                stream: name.into(),
                request_id,
            })
        })
    }

    /// Stores a cache value. Answered by `Reply::Done`.
    ///
    /// # Errors
    /// [`CommandError::NotConnected`] before the stream authenticated.
    pub fn cache_put(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::CachePut(message::CachePut {
                tenant_id,
                namespace: namespace.into(),
                cache: cache.into(),
                key: key.into(),
                value: B64(value),
                request_id: Some(request_id),
                ttl_ms,
            })
        })
    }

    /// Reads a cache value. Answered by `Reply::CacheValue`.
    ///
    /// # Errors
    /// [`CommandError::NotConnected`] before the stream authenticated.
    pub fn cache_get(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::CacheGet(message::CacheGet {
                tenant_id,
                namespace: namespace.into(),
                cache: cache.into(),
                key: key.into(),
                request_id: Some(request_id),
            })
        })
    }

    /// Deletes a cache value (FEATURE_CACHE_DELETE). Answered by `Reply::CacheValue` with the
    /// removed value.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn cache_delete(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        cache: &str,
        key: &str,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::CacheDelete(message::CacheDelete {
                tenant_id,
                namespace: namespace.into(),
                cache: cache.into(),
                key: key.into(),
                request_id: Some(request_id),
            })
        })
    }

    /// Stores `value` only if the key's live entry matches `condition`
    /// (FEATURE_CACHE_CONDITIONAL). Answered by `Reply::CacheCondition`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    #[allow(clippy::too_many_arguments)] // mirrors the message's fields
    pub fn cache_put_if(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
        condition: message::CacheCondition,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::CachePutIf(message::CachePutIf {
                tenant_id,
                namespace: namespace.into(),
                cache: cache.into(),
                key: key.into(),
                value: B64(value),
                ttl_ms,
                condition,
                request_id,
            })
        })
    }

    /// Deletes the key only if its live entry has `version` (FEATURE_CACHE_CONDITIONAL).
    /// Answered by `Reply::CacheCondition`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn cache_delete_if(
        &mut self,
        stream: ClientStream,
        namespace: &str,
        cache: &str,
        key: &str,
        version: u64,
    ) -> Result<u64, CommandError> {
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
            Message::CacheDeleteIf(message::CacheDeleteIf {
                tenant_id,
                namespace: namespace.into(),
                cache: cache.into(),
                key: key.into(),
                version,
                request_id,
            })
        })
    }
}

/// Refuses a publish the broker cannot take as asked.
fn check_publish(neg: &Negotiated, req: &PublishRequest) -> Result<(), CommandError> {
    use crate::features::Features;
    if req.shard.is_some() && !neg.broker_has(Features::EXPLICIT_SHARD) {
        return Err(CommandError::NotNegotiated("FEATURE_EXPLICIT_SHARD"));
    }
    if req.idempotent.is_some() && !neg.broker_has(Features::IDEMPOTENT_PRODUCER) {
        return Err(CommandError::NotNegotiated("FEATURE_IDEMPOTENT_PRODUCER"));
    }
    if req.expected_offset.is_some() && !neg.broker_has(Features::PUBLISH_CONDITIONAL) {
        return Err(CommandError::NotNegotiated("FEATURE_PUBLISH_CONDITIONAL"));
    }
    // A broker that reads no keyed batches does not route by key: the key would be dropped
    // (JSON) or the frame refused (binary), and ordering silently changed.
    if req.key.is_some() && !neg.may_send(Flags::BINARY_PUBLISH_KEYED) {
        return Err(CommandError::NotNegotiated("FLAG_BINARY_PUBLISH_KEYED (routing by key)"));
    }
    // An envelope goes only in a binary batch, to a broker that keeps it (D58): dropping it
    // would deliver ciphertext as if it were plain records.
    if req.envelope.is_some() {
        if !neg.may_send_hi(crate::flags::FlagsHi::ENVELOPE) {
            return Err(CommandError::NotNegotiated("FLAG_HI_ENVELOPE (end-to-end encryption envelopes)"));
        }
        if req.json || req.shard.is_some() || req.expected_offset.is_some() {
            return Err(CommandError::Encode(
                "an envelope goes in a binary batch only (not with json, an explicit shard or an expected offset)"
                    .into(),
            ));
        }
    }
    Ok(())
}

/// How long a request may wait at the broker besides the usual answer time: a group poll's
/// `wait_ms` (so it goes on the long-poll stream).
fn long_wait(m: &Message) -> Duration {
    match m {
        Message::GroupPoll(p) if p.wait_ms > 0 => Duration::from_millis(p.wait_ms),
        _ => Duration::ZERO,
    }
}

/// The `commit` message for `req` (what [`ClientConnection::commit`] sends; for drivers that
/// build requests themselves).
pub fn commit_message(tenant_id: String, req: CommitRequest, request_id: u64) -> Message {
    Message::Commit(message::Commit {
        tenant_id,
        namespace: req.namespace,
        stream: req.stream,
        entity_key: B64(req.entity_key),
        event: B64(req.event),
        changes: req
            .changes
            .into_iter()
            .map(|(key, value)| match value {
                Some(v) => message::StateChange::Put { key, value: B64(v) },
                None => message::StateChange::Delete { key },
            })
            .collect(),
        shard: None,
        request_id,
        expected_offset: req.expected_offset,
    })
}

/// The `stream_read` message for `req`, as the client sends it (also for drivers that build
/// their own request through a generic request path).
pub fn stream_read_message(tenant_id: String, req: StreamReadRequest, request_id: u64) -> Message {
    Message::StreamRead(message::StreamRead {
        tenant_id,
        namespace: req.namespace,
        stream: req.stream,
        shard: req.shard,
        from: req.from,
        end: req.end,
        max_records: req.max_records,
        max_bytes: req.max_bytes,
        request_id,
        replica_local: req.replica_local.then_some(true),
    })
}
