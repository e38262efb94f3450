//! The client role: one QUIC connection to a broker, with no IO.
//!
//! [`ClientConnection`] opens control streams (each authenticates on its own with `auth`),
//! chooses every encoding from what the broker advertised (never from its own set), keeps the
//! publish window of each stream, and turns the broker's event streams into [`ClientEvent`]s.
//!
//! Drive it like the broker: feed inputs (`handle_*`, each with `now`), then drain
//! [`poll_output`](ClientConnection::poll_output) and [`poll_event`](ClientConnection::poll_event).

use crate::binary::{
    AckMode, AckStatus, AckedPrefix, ErrorDetail, EventBatch, OwnerHint, PublishAck, PublishBatch, Records,
};
use crate::error_code::{ErrorCode, RetryClass};
use crate::features::Features;
use crate::flags::Flags;
use crate::frame::{Frame, FrameDecoder};
use crate::io::{Clock, Dir, OpenToken, Side, StreamId};
use crate::message::{self, B64, Decoded, Message, StartPosition};
use crate::negotiate::Negotiated;
use crate::payload::Payload;
use bytes::{Bytes, BytesMut};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

pub mod needs;
pub mod producer;

/// Client settings.
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Tenant to authenticate for.
    pub tenant_id: String,
    /// Bearer token.
    pub token: String,
    /// Flags to offer; `None` behaves as a legacy client that predates negotiation (it sends no
    /// `client_flags` and expects plain `ok`).
    pub flags: Option<Flags>,
    /// Features to offer.
    pub features: Features,
    /// Largest frame accepted from the broker.
    pub max_frame_len: u32,
}

impl ClientConfig {
    /// A client offering everything this implementation reads. Its acknowledged publishes are
    /// answered after the write (`FEATURE_ACK_ON_COMMIT`, with the offset): an acknowledgement
    /// means the records are stored, as a user who asks for one expects (Kafka's acks=all,
    /// JetStream's publish ack). [`ack_on_enqueue`](Self::ack_on_enqueue) trades that for speed.
    pub fn new(tenant_id: impl Into<String>, token: impl Into<String>) -> ClientConfig {
        ClientConfig {
            tenant_id: tenant_id.into(),
            token: token.into(),
            flags: Some(Flags::KNOWN),
            features: Features::ERROR_CODES
                | Features::SHARD_MOVED
                | Features::UNSUPPORTED
                | Features::PUBLISH_PIPELINE
                | Features::SUBSCRIPTION_LAGGED
                | Features::REDIRECT
                | Features::STREAM_DELETED
                | Features::CACHE_CONDITIONAL
                | Features::SEQUENCE_REUSED
                | Features::GROUP_SKIPPED
                | Features::GROUP_PUBLISHER
                | Features::RECORD_TIMESTAMPS
                | Features::ACK_ON_COMMIT,
            max_frame_len: crate::frame::DEFAULT_MAX_FRAME_LEN,
        }
    }

    /// The faster mode: acknowledged publishes may be answered as soon as the broker queued
    /// them for storage (without an offset), unless the broker acknowledges after the write
    /// anyway. Such an acknowledgement survives neither a broker crash nor a write that then
    /// fails (docs/operations.md, "What an acknowledgement promises").
    pub fn ack_on_enqueue(mut self) -> ClientConfig {
        self.features = self.features.difference(Features::ACK_ON_COMMIT);
        self
    }
}

/// A control stream of this client (index 0 is opened by [`ClientConnection::new`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientStream(pub u32);

/// Names a publish until it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublishId(pub u64);

/// An error a broker reported, with the code fields when the client offered them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorInfo {
    /// Prose.
    pub message: String,
    /// Code, when sent.
    pub code: Option<ErrorCode>,
    /// Retry class, when sent.
    pub retry: Option<RetryClass>,
    /// Detail, when sent.
    pub detail: Option<ErrorDetail>,
}

/// Why a subscription ended.
#[derive(Debug, Clone, PartialEq)]
pub enum EndReason {
    /// The broker's queue dropped records; resume from `resume_from` (see the spec).
    Lagged {
        /// First offset not sent.
        resume_from: u64,
    },
    /// The shard moved.
    Moved(message::ShardMoved),
    /// The stream was deleted.
    Deleted,
    /// A cache watch fell behind; watch again from `resume_from` for no gap.
    WatchLagged {
        /// First change not delivered.
        resume_from: u64,
    },
    /// An `error` ended the stream.
    Error(ErrorInfo),
    /// The stream ended with no terminal frame.
    Finished,
}

/// Where to subscribe again after `subscription_lagged`, for no gap and no duplicate: right after
/// the last event received, or at `resume_from` when none was. The spec's rule: a frame below
/// `resume_from` may still have been dropped by the connection writer's queue (unreported), so
/// `resume_from` alone is only safe when nothing arrived.
pub fn lagged_resume_point(last_received: Option<u64>, resume_from: u64) -> u64 {
    match last_received {
        Some(last) => last.saturating_add(1),
        None => resume_from,
    }
}

/// Something that happened. Each is reported once (edge-triggered).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum ClientEvent {
    /// A control stream authenticated.
    Connected {
        /// The stream.
        stream: ClientStream,
        /// What was negotiated on it.
        negotiated: Negotiated,
    },
    /// `auth` was refused.
    AuthFailed {
        /// The stream.
        stream: ClientStream,
        /// Why.
        error: ErrorInfo,
    },
    /// An acked publish succeeded.
    PublishAcked {
        /// The publish.
        id: PublishId,
        /// First record's offset, when the broker gave one.
        offset: Option<u64>,
        /// Owner hint of a forwarded batch.
        owner: Option<OwnerHint>,
    },
    /// An acked publish failed.
    PublishFailed {
        /// The publish.
        id: PublishId,
        /// Why.
        error: ErrorInfo,
    },
    /// An idempotent or conditional publish was refused with a typed reason; nothing was
    /// written.
    PublishRefused {
        /// The publish.
        id: PublishId,
        /// Why (`sequence_gap`, `offset_mismatch`...).
        reason: message::RefusedReason,
        /// Prose.
        message: String,
    },
    /// A request sent with [`ClientConnection::request`] answered (consumer-group answers).
    Answer {
        /// Request id.
        request_id: u64,
        /// The answer.
        message: Box<Message>,
    },
    /// `stream_shards` answered.
    StreamShards {
        /// Request id.
        request_id: u64,
        /// Shards (0: the stream does not exist).
        shards: u32,
        /// How keys map to shards.
        routing: message::Routing,
    },
    /// `producer_init` answered.
    ProducerReady {
        /// Request id.
        request_id: u64,
        /// The producer id the broker chose.
        producer_id: u64,
    },
    /// A stream whose publish window was full has room again.
    PublishWindowOpen {
        /// The stream.
        stream: ClientStream,
    },
    /// A subscription was confirmed.
    Subscribed {
        /// Its id.
        sub: u64,
        /// First offset it delivers (durable streams, offsets negotiated).
        start_offset: Option<u64>,
        /// Tail at join.
        live_offset: Option<u64>,
        /// Granted queue capacity.
        queue_capacity: Option<u32>,
    },
    /// A subscribe was refused.
    SubscribeFailed {
        /// Its id.
        sub: u64,
        /// Why (a cursor error is reported as an `invalid_request`-like error with prose).
        error: ErrorInfo,
        /// For `subscribe_cursor_error`: the reason and the available offset.
        cursor: Option<message::SubscribeCursorError>,
        /// For `not_leader`: the owner.
        redirect: Option<message::NotLeader>,
    },
    /// Events arrived.
    Events {
        /// Subscription.
        sub: u64,
        /// The batch.
        batch: EventBatch,
    },
    /// A subscription ended.
    SubscriptionEnded {
        /// Subscription.
        sub: u64,
        /// Why.
        reason: EndReason,
    },
    /// A cache watch was confirmed.
    CacheWatchStarted {
        /// Its subscription id.
        sub: u64,
        /// Live delivery begins here.
        resume_offset: u64,
        /// The asked history was compacted: the watch starts with current values instead.
        resnapshot: bool,
        /// With `retained`: how many current values come before live changes.
        retained_count: Option<u64>,
    },
    /// A change on a cache watch.
    CacheEvent {
        /// Subscription.
        sub: u64,
        /// The change (`value` absent: deleted or expired).
        event: message::CacheEvent,
    },
    /// A cache read (or delete) answered.
    CacheValue {
        /// Request id.
        request_id: u64,
        /// The value (the removed one for a delete), `None` on a miss.
        value: Option<Bytes>,
        /// The value's version (a hit, from a broker with FEATURE_CACHE_CONDITIONAL).
        version: Option<u64>,
    },
    /// A conditional cache write answered.
    CacheConditionResult {
        /// Request id.
        request_id: u64,
        /// Whether the write applied.
        applied: bool,
        /// The version written (applied), or the key's current version (not applied; `None`
        /// when it has no live entry).
        version: Option<u64>,
    },
    /// A cache write answered.
    CacheOk {
        /// Request id.
        request_id: u64,
    },
    /// A `stream_read` page.
    StreamRecords {
        /// Request id.
        request_id: u64,
        /// The records, in offset order.
        records: Vec<message::StreamRecord>,
        /// Where the next page starts.
        next_offset: u64,
    },
    /// An `offset_for_time` answer.
    OffsetValue {
        /// Request id.
        request_id: u64,
        /// The offset; `None` when no readable record is that recent.
        offset: Option<u64>,
    },
    /// A counter's value.
    CounterValue {
        /// Request id.
        request_id: u64,
        /// The sum; `None` when the counter was never written (not the same as 0).
        value: Option<i64>,
    },
    /// A request other than a publish or subscribe was refused.
    RequestFailed {
        /// Request id.
        request_id: u64,
        /// Why.
        error: ErrorInfo,
        /// For `subscribe_cursor_error` (a `stream_read` outside the retained range).
        cursor: Option<message::SubscribeCursorError>,
        /// For `not_leader`: the owner.
        redirect: Option<message::NotLeader>,
    },
    /// The broker answered a request with `unsupported`.
    Unsupported {
        /// The request type.
        request_type: String,
    },
    /// An error no pending request claims.
    Error {
        /// The stream.
        stream: ClientStream,
        /// The error.
        error: ErrorInfo,
    },
    /// The broker closed a control stream.
    StreamClosed {
        /// The stream.
        stream: ClientStream,
    },
    /// The broker sent something this client cannot parse (it is reported, not trusted).
    ProtocolError {
        /// What went wrong.
        reason: String,
    },
}

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ClientOutput {
    /// Open a bidirectional stream and report its id with `handle_stream_opened(token)`.
    OpenBi {
        /// Names the stream until it has an id.
        token: OpenToken,
    },
    /// Write bytes on a stream.
    Transmit {
        /// Stream.
        stream: StreamId,
        /// Bytes.
        data: Bytes,
    },
    /// Finish our side of a stream.
    Finish {
        /// Stream.
        stream: StreamId,
    },
    /// Stop reading a stream (unsubscribe).
    StopSending {
        /// Stream.
        stream: StreamId,
        /// Code.
        code: u64,
    },
}

/// Why a command was refused (nothing was sent; the state is unchanged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CommandError {
    /// The stream has not authenticated yet (wait for `Connected`).
    #[error("stream not authenticated yet")]
    NotConnected,
    /// The publish window is full (wait for `PublishWindowOpen`).
    #[error("publish window full")]
    WindowFull,
    /// The broker does not offer what the command needs.
    #[error("the broker did not advertise {0}")]
    NotNegotiated(&'static str),
    /// No such stream or subscription.
    #[error("unknown stream or subscription")]
    Unknown,
    /// The request cannot be encoded.
    #[error("cannot encode: {0}")]
    Encode(String),
}

/// A publish.
#[derive(Debug, Clone)]
pub struct PublishRequest {
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Payloads (one batch).
    pub payloads: Vec<Bytes>,
    /// Routing key.
    pub key: Option<Bytes>,
    /// Explicit shard (FEATURE_EXPLICIT_SHARD).
    pub shard: Option<u32>,
    /// Whether an answer is wanted.
    pub ack: bool,
    /// Force the JSON encoding.
    pub json: bool,
    /// An idempotent producer's `(producer_id, sequence)` (FEATURE_IDEMPOTENT_PRODUCER). The
    /// batch is always acked; a refusal comes as `PublishRefused`.
    pub idempotent: Option<(u64, u64)>,
    /// `publish_if` (FEATURE_PUBLISH_CONDITIONAL): append only if the shard's next offset is
    /// this. Always acked; a mismatch comes as `PublishRefused` with the tail.
    pub expected_offset: Option<u64>,
}

impl PublishRequest {
    /// An unkeyed, unacked batch.
    pub fn new(namespace: impl Into<String>, stream: impl Into<String>, payloads: Vec<Bytes>) -> PublishRequest {
        PublishRequest {
            namespace: namespace.into(),
            stream: stream.into(),
            payloads,
            key: None,
            shard: None,
            ack: false,
            json: false,
            idempotent: None,
            expected_offset: None,
        }
    }
    /// Asks for an acknowledgement.
    pub fn acked(mut self) -> PublishRequest {
        self.ack = true;
        self
    }
    /// Routes by key.
    pub fn keyed(mut self, key: impl Into<Bytes>) -> PublishRequest {
        self.key = Some(key.into());
        self
    }
}

/// A subscribe.
#[derive(Debug, Clone)]
pub struct SubscribeRequest {
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Where to start; `None` sends no `start` (latest).
    pub start: Option<StartPosition>,
    /// Shard.
    pub shard: Option<u32>,
    /// Queue capacity to ask for (sent only to a broker advertising FEATURE_SUBSCRIBE_QUEUE).
    pub queue_capacity: Option<u32>,
}

#[derive(Debug)]
struct Ctl {
    id: Option<StreamId>,
    pending: Vec<Bytes>,
    decoder: FrameDecoder,
    negotiated: Option<Negotiated>,
    inflight: u32,
    was_full: bool,
    /// Requests not yet answered, in the order sent: answers with no request id (`error`,
    /// `subscribe_cursor_error`, `not_leader`) belong to the oldest.
    awaiting: VecDeque<Awaiting>,
    closed: bool,
    /// A stream opened for one subscription or cache watch: what to send once it authenticated;
    /// our side is finished once it is answered (as upstream clients do; a released broker stops
    /// a subscription's control stream after `subscribed`).
    dedicated: Option<Dedicated>,
}

/// The request a dedicated control stream carries.
#[derive(Debug)]
enum Dedicated {
    /// Not sent yet (the stream is authenticating).
    Subscribe(u64, SubscribeRequest),
    /// Not sent yet.
    Watch(u64, CacheWatchRequest),
    /// Sent; the stream is finished once its answer comes.
    Sent,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Awaiting {
    Sub(u64),
    Request(u64),
}

#[derive(Debug)]
struct EventStream {
    decoder: FrameDecoder,
    sub: Option<u64>,
    ended: bool,
}

/// What a cache watch follows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WatchOn {
    /// One key.
    Key(String),
    /// Every key starting with this (empty: every key).
    Prefix(String),
}

/// A cache watch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheWatchRequest {
    /// Namespace.
    pub namespace: String,
    /// Cache.
    pub cache: String,
    /// Key or prefix.
    pub filter: WatchOn,
    /// Replay from this change offset (a previous event's offset + 1).
    pub from_offset: Option<u64>,
    /// Start with each matching key's current value.
    pub retained: bool,
}

/// A `stream_read`: a page of a durable shard from `from`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamReadRequest {
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard.
    pub shard: u32,
    /// First offset to read.
    pub from: u64,
    /// Stop before this offset (`None`: the committed tail).
    pub end: Option<u64>,
    /// Most records (`None`: the broker's cap).
    pub max_records: Option<u32>,
    /// Most payload bytes (`None`: the broker's cap).
    pub max_bytes: Option<u64>,
}

/// The client state machine.
#[derive(Debug)]
pub struct ClientConnection {
    cfg: ClientConfig,
    clock: Clock,
    ctls: Vec<Ctl>,
    opens: HashMap<OpenToken, usize>,
    next_open: u64,
    next_request: u64,
    next_sub: u64,
    publishes: HashMap<u64, (PublishId, usize)>,
    shared_inflight: u32,
    event_streams: HashMap<StreamId, EventStream>,
    subs: HashMap<u64, Option<StreamId>>,
    out: VecDeque<ClientOutput>,
    events: VecDeque<ClientEvent>,
}

fn frame_of(m: &Message) -> Result<Bytes, CommandError> {
    let mut b = BytesMut::new();
    m.encode(&mut b).map_err(|e| CommandError::Encode(e.to_string()))?;
    Ok(b.freeze())
}

fn error_info(e: message::ErrorMsg) -> ErrorInfo {
    ErrorInfo { message: e.message, code: e.code, retry: e.retry, detail: e.detail }
}

impl ClientConnection {
    /// A client; opens its first control stream and queues `auth` on it.
    pub fn new(cfg: ClientConfig, now: Instant) -> ClientConnection {
        let mut c = ClientConnection {
            cfg,
            clock: Clock::new(),
            ctls: Vec::new(),
            opens: HashMap::new(),
            next_open: 1,
            next_request: 1,
            next_sub: 1,
            publishes: HashMap::new(),
            shared_inflight: 0,
            event_streams: HashMap::new(),
            subs: HashMap::new(),
            out: VecDeque::new(),
            events: VecDeque::new(),
        };
        c.clock.advance(now);
        c.open_stream(now);
        c
    }

    /// Opens another control stream (it authenticates on its own).
    pub fn open_stream(&mut self, now: Instant) -> ClientStream {
        self.clock.advance(now);
        let mut decoder = FrameDecoder::new();
        decoder.set_max_frame_len(self.cfg.max_frame_len);
        decoder.set_accepted_flags(Flags::BROKER_SENDS);
        let auth = Message::Auth(message::Auth {
            tenant_id: self.cfg.tenant_id.clone(),
            token: self.cfg.token.clone(),
            client_flags: self.cfg.flags.map(Flags::bits),
            client_features: self.cfg.features.to_words(true).0,
            client_features_hi: self.cfg.features.to_words(true).1,
        });
        let idx = self.ctls.len();
        self.ctls.push(Ctl {
            id: None,
            pending: frame_of(&auth).into_iter().collect(),
            decoder,
            negotiated: None,
            inflight: 0,
            was_full: false,
            awaiting: VecDeque::new(),
            closed: false,
            dedicated: None,
        });
        let token = OpenToken(self.next_open);
        self.next_open += 1;
        self.opens.insert(token, idx);
        self.out.push_back(ClientOutput::OpenBi { token });
        ClientStream(idx as u32)
    }

    /// What a stream negotiated, once `Connected`.
    pub fn negotiated(&self, stream: ClientStream) -> Option<&Negotiated> {
        self.ctls.get(stream.0 as usize)?.negotiated.as_ref()
    }

    /// The flags this client offers (what it may receive).
    fn offered_flags(&self) -> Flags {
        self.cfg.flags.unwrap_or(Flags::ORIGINAL_V1)
    }

    /// The next output.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<ClientOutput> {
        self.out.pop_front()
    }

    /// The event stream subscription (or watch) `sub` is delivered on, once its first frame
    /// named it: what a driver pauses when the application falls behind.
    pub fn subscription_stream(&self, sub: u64) -> Option<StreamId> {
        self.event_streams.iter().find(|(_, es)| es.sub == Some(sub) && !es.ended).map(|(id, _)| *id)
    }

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// The driver opened the stream asked for with `token`.
    pub fn handle_stream_opened(&mut self, token: OpenToken, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        let Some(idx) = self.opens.remove(&token) else { return };
        let ctl = &mut self.ctls[idx];
        ctl.id = Some(stream);
        for data in ctl.pending.drain(..) {
            self.out.push_back(ClientOutput::Transmit { stream, data });
        }
    }

    fn send(&mut self, idx: usize, data: Bytes) {
        let ctl = &mut self.ctls[idx];
        match ctl.id {
            Some(stream) => self.out.push_back(ClientOutput::Transmit { stream, data }),
            None => ctl.pending.push(data),
        }
    }

    fn ctl_index(&self, stream: ClientStream) -> Result<usize, CommandError> {
        let idx = stream.0 as usize;
        let ctl = self.ctls.get(idx).ok_or(CommandError::Unknown)?;
        if ctl.negotiated.is_none() || ctl.closed {
            return Err(CommandError::NotConnected);
        }
        Ok(idx)
    }

    // -----------------------------------------------------------------------------------------
    // Commands

    /// Publishes a batch on `stream`. The encoding is chosen from what the broker advertised:
    /// binary when it can carry the request, JSON otherwise.
    ///
    /// # Errors
    /// [`CommandError::WindowFull`] when the stream's (or the connection's) publish window is
    /// full; nothing is sent and the window state is unchanged.
    pub fn publish(
        &mut self,
        stream: ClientStream,
        req: PublishRequest,
        now: Instant,
    ) -> Result<PublishId, CommandError> {
        self.clock.advance(now);
        let idx = self.ctl_index(stream)?;
        let neg = self.ctls[idx].negotiated.expect("checked");
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
        let request_id = self.next_request;
        let binary = !req.json
            && req.shard.is_none()
            && req.expected_offset.is_none()
            && (req.key.is_none() || neg.may_send(Flags::BINARY_PUBLISH_KEYED))
            && (!req.ack || neg.may_send(Flags::BINARY_PUBLISH_ACKED))
            && (req.idempotent.is_none() || neg.may_send(Flags::BINARY_PUBLISH_IDEMPOTENT));
        let data = if binary {
            let b = PublishBatch {
                acked: req.ack.then_some(AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
                idempotent: req
                    .idempotent
                    .map(|(producer_id, sequence)| crate::binary::IdempotentPrefix { producer_id, sequence }),
                key: req.key.clone(),
                tenant_id: self.cfg.tenant_id.clone(),
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                records: Records::default(),
            };
            let mut out = BytesMut::new();
            b.encode_payloads(&req.payloads, &mut out).map_err(|e| CommandError::Encode(e.to_string()))?;
            out.freeze()
        } else if let Some((producer_id, sequence)) = req.idempotent {
            frame_of(&Message::PublishIdempotent(message::PublishIdempotent {
                tenant_id: self.cfg.tenant_id.clone(),
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                payloads: req.payloads.iter().cloned().map(B64).collect(),
                key: req.key.clone().map(B64),
                request_id,
                producer_id,
                sequence,
                publish_width: None,
            }))?
        } else if let Some(expected_offset) = req.expected_offset {
            frame_of(&Message::PublishIf(message::PublishIf {
                tenant_id: self.cfg.tenant_id.clone(),
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                payloads: req.payloads.iter().cloned().map(B64).collect(),
                key: req.key.clone().map(B64),
                expected_offset,
                shard: req.shard,
                request_id,
                publish_width: None,
            }))?
        } else {
            let m = Message::PublishBatch(message::PublishBatchMsg {
                tenant_id: self.cfg.tenant_id.clone(),
                namespace: req.namespace.clone(),
                stream: req.stream.clone(),
                payloads: req.payloads.iter().cloned().map(B64).collect(),
                key: req.key.clone().map(B64),
                shard: req.shard,
                request_id: req.ack.then_some(request_id),
                ack: req.ack.then_some(AckMode::PerBatch),
                publish_width: None,
            });
            frame_of(&m)?
        };
        self.next_request += 1;
        let id = PublishId(request_id);
        if req.ack {
            self.publishes.insert(request_id, (id, idx));
            self.ctls[idx].inflight += 1;
            self.shared_inflight += 1;
        }
        self.send(idx, data);
        Ok(id)
    }

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
        let sub = self.next_sub;
        self.send_subscribe(stream, sub, req)?;
        self.next_sub += 1;
        Ok(sub)
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
    /// broker lacks what the request needs (nothing is opened).
    pub fn subscribe_dedicated(&mut self, req: SubscribeRequest, now: Instant) -> Result<u64, CommandError> {
        if let Some(neg) = self.any_negotiated() {
            Self::check_subscribe(&neg, &req)?;
        }
        Ok(self.dedicate(Dedicated::Subscribe(0, req), now))
    }

    /// [`subscribe_dedicated`](Self::subscribe_dedicated) for a cache watch.
    ///
    /// # Errors
    /// As [`subscribe_dedicated`](Self::subscribe_dedicated).
    pub fn cache_watch_dedicated(&mut self, req: CacheWatchRequest, now: Instant) -> Result<u64, CommandError> {
        if let Some(neg) = self.any_negotiated() {
            Self::check_watch(&neg, &req)?;
        }
        Ok(self.dedicate(Dedicated::Watch(0, req), now))
    }

    fn dedicate(&mut self, d: Dedicated, now: Instant) -> u64 {
        let sub = self.next_sub;
        self.next_sub += 1;
        let s = self.open_stream(now);
        self.subs.insert(sub, None);
        self.ctls[s.0 as usize].dedicated = Some(match d {
            Dedicated::Subscribe(_, req) => Dedicated::Subscribe(sub, req),
            Dedicated::Watch(_, req) => Dedicated::Watch(sub, req),
            Dedicated::Sent => Dedicated::Sent,
        });
        sub
    }

    /// What some stream of this connection negotiated (every stream negotiates the same with
    /// one broker).
    fn any_negotiated(&self) -> Option<Negotiated> {
        self.ctls.iter().find_map(|c| c.negotiated)
    }

    fn check_subscribe(neg: &Negotiated, req: &SubscribeRequest) -> Result<(), CommandError> {
        needs::check(neg, &Self::subscribe_message(String::new(), 0, req.clone()))
    }

    fn check_watch(neg: &Negotiated, req: &CacheWatchRequest) -> Result<(), CommandError> {
        needs::check(neg, &Self::watch_message(String::new(), 0, req.clone()))
    }

    fn subscribe_message(tenant_id: String, sub: u64, req: SubscribeRequest) -> Message {
        Message::Subscribe(message::Subscribe {
            tenant_id,
            namespace: req.namespace,
            stream: req.stream,
            subscription_id: Some(sub),
            start: req.start,
            shard: req.shard,
            queue_capacity: req.queue_capacity,
        })
    }

    fn watch_message(tenant_id: String, sub: u64, req: CacheWatchRequest) -> Message {
        let (key, prefix) = match req.filter {
            WatchOn::Key(k) => (Some(k), None),
            WatchOn::Prefix(p) => (None, Some(p)),
        };
        Message::CacheWatch(message::CacheWatch {
            tenant_id,
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

    fn send_subscribe(&mut self, stream: ClientStream, sub: u64, req: SubscribeRequest) -> Result<(), CommandError> {
        let idx = self.ctl_index(stream)?;
        let m = Self::subscribe_message(self.cfg.tenant_id.clone(), sub, req);
        needs::check(&self.ctls[idx].negotiated.expect("checked"), &m)?;
        let data = frame_of(&m)?;
        self.subs.insert(sub, None);
        self.ctls[idx].awaiting.push_back(Awaiting::Sub(sub));
        self.send(idx, data);
        Ok(())
    }

    /// Watches a cache key or prefix (FEATURE_CACHE_WATCH). Returns the subscription id;
    /// confirmed by `CacheWatchStarted`, changes come as `CacheEvent`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature (or without
    /// FEATURE_CACHE_WATCH_RETAINED for `retained`).
    pub fn cache_watch(&mut self, stream: ClientStream, req: CacheWatchRequest) -> Result<u64, CommandError> {
        let sub = self.next_sub;
        self.send_watch(stream, sub, req)?;
        self.next_sub += 1;
        Ok(sub)
    }

    fn send_watch(&mut self, stream: ClientStream, sub: u64, req: CacheWatchRequest) -> Result<(), CommandError> {
        let idx = self.ctl_index(stream)?;
        let m = Self::watch_message(self.cfg.tenant_id.clone(), sub, req);
        needs::check(&self.ctls[idx].negotiated.expect("checked"), &m)?;
        let data = frame_of(&m)?;
        self.subs.insert(sub, None);
        self.ctls[idx].awaiting.push_back(Awaiting::Sub(sub));
        self.send(idx, data);
        Ok(())
    }

    /// A dedicated stream authenticated: send what it carries. A request the broker cannot take
    /// fails the subscription (nothing is sent).
    fn send_dedicated(&mut self, idx: usize) {
        let d = match self.ctls[idx].dedicated.take() {
            Some(Dedicated::Sent) | None => return,
            Some(d) => d,
        };
        self.ctls[idx].dedicated = Some(Dedicated::Sent);
        let stream = ClientStream(idx as u32);
        let (sub, sent) = match d {
            Dedicated::Subscribe(sub, req) => (sub, self.send_subscribe(stream, sub, req)),
            Dedicated::Watch(sub, req) => (sub, self.send_watch(stream, sub, req)),
            Dedicated::Sent => return,
        };
        if let Err(e) = sent {
            self.subs.remove(&sub);
            let error = ErrorInfo { message: e.to_string(), code: None, retry: Some(RetryClass::Fatal), detail: None };
            self.events.push_back(ClientEvent::SubscribeFailed { sub, error, cursor: None, redirect: None });
            self.finish_dedicated(idx);
        }
    }

    /// A dedicated stream's request was answered: our side is finished.
    fn finish_dedicated(&mut self, idx: usize) {
        let ctl = &mut self.ctls[idx];
        if matches!(ctl.dedicated, Some(Dedicated::Sent)) && ctl.awaiting.is_empty() {
            ctl.dedicated = None;
            ctl.closed = true;
            if let Some(stream) = ctl.id {
                self.out.push_back(ClientOutput::Finish { stream });
            }
        }
    }

    /// Ends a subscription: asks the broker to stop sending on its event stream.
    ///
    /// # Errors
    /// [`CommandError::Unknown`] for an unknown or not yet bound subscription.
    pub fn unsubscribe(&mut self, sub: u64, now: Instant) -> Result<(), CommandError> {
        self.clock.advance(now);
        let Some(Some(stream)) = self.subs.remove(&sub) else { return Err(CommandError::Unknown) };
        self.event_streams.remove(&stream);
        self.out.push_back(ClientOutput::StopSending { stream, code: crate::io::close_code::STREAM_CLOSED });
        Ok(())
    }

    fn cache_request(&mut self, stream: ClientStream, build: impl FnOnce(u64) -> Message) -> Result<u64, CommandError> {
        let idx = self.ctl_index(stream)?;
        let request_id = self.next_request;
        let m = build(request_id);
        needs::check(&self.ctls[idx].negotiated.expect("checked"), &m)?;
        let data = frame_of(&m)?;
        self.next_request += 1;
        self.ctls[idx].awaiting.push_back(Awaiting::Request(request_id));
        self.send(idx, data);
        Ok(request_id)
    }

    /// Reads a bounded page of a durable shard without subscribing (FEATURE_STREAM_READ).
    /// Answered by `StreamRecords`, or `RequestFailed` (a cursor outside the retained range
    /// comes with `cursor`).
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn stream_read(&mut self, stream: ClientStream, req: StreamReadRequest) -> Result<u64, CommandError> {
        self.require(stream, Features::STREAM_READ, "FEATURE_STREAM_READ")?;
        let tenant_id = self.cfg.tenant_id.clone();
        self.cache_request(stream, |request_id| {
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
            })
        })
    }

    /// Asks for the first offset of a durable shard appended at or after `at_micros`
    /// (FEATURE_RECORD_TIMESTAMPS). Answered by `OffsetValue`.
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
        self.require(stream, Features::RECORD_TIMESTAMPS, "FEATURE_RECORD_TIMESTAMPS")?;
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

    /// Adds `delta` to a counter (FEATURE_COUNTERS). Answered by `CounterValue` with the sum
    /// including it, once it is durable.
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
        self.require(stream, Features::COUNTERS, "FEATURE_COUNTERS")?;
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

    /// Reads a counter (FEATURE_COUNTERS). Answered by `CounterValue` (`None`: never written).
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
        self.require(stream, Features::COUNTERS, "FEATURE_COUNTERS")?;
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
    /// `ProducerReady`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn producer_init(&mut self, stream: ClientStream) -> Result<u64, CommandError> {
        self.require(stream, Features::IDEMPOTENT_PRODUCER, "FEATURE_IDEMPOTENT_PRODUCER")?;
        self.cache_request(stream, |request_id| Message::ProducerInit(message::ProducerInit { request_id }))
    }

    /// Asks how many shards a stream has and how keys map to them (FEATURE_STREAM_SHARDS).
    /// Answered by `StreamShards`.
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] against a broker without the feature.
    pub fn stream_shards(&mut self, stream: ClientStream, namespace: &str, name: &str) -> Result<u64, CommandError> {
        self.require(stream, Features::STREAM_SHARDS, "FEATURE_STREAM_SHARDS")?;
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

    /// Sends any request that carries a `request_id` (consumer groups and the rest of the
    /// catalogue), built around the id this returns. Its answer comes as `Answer` (or
    /// `CacheOk`, or `RequestFailed`).
    ///
    /// # Errors
    /// [`CommandError::NotNegotiated`] when the broker lacks what the request (or one of its
    /// optional fields) needs ([`needs`]); nothing is sent.
    pub fn request(&mut self, stream: ClientStream, build: impl FnOnce(u64) -> Message) -> Result<u64, CommandError> {
        self.cache_request(stream, build)
    }

    /// The request an answer with `request_id` settles (removed from the order), or the oldest
    /// request when the answer carries no id.
    fn settle_request(&mut self, idx: usize, request_id: Option<u64>) -> Option<u64> {
        let awaiting = &mut self.ctls[idx].awaiting;
        match request_id {
            Some(id) => {
                awaiting.retain(|a| *a != Awaiting::Request(id));
                Some(id)
            }
            None => {
                let i = awaiting.iter().position(|a| matches!(a, Awaiting::Request(_)))?;
                match awaiting.remove(i) {
                    Some(Awaiting::Request(id)) => Some(id),
                    _ => None,
                }
            }
        }
    }

    /// An answer with no request id (`error`, `subscribe_cursor_error`, `not_leader`) settles
    /// the oldest unanswered request on the stream.
    fn fail_oldest(
        &mut self,
        idx: usize,
        error: ErrorInfo,
        cursor: Option<message::SubscribeCursorError>,
        redirect: Option<message::NotLeader>,
    ) {
        match self.ctls[idx].awaiting.pop_front() {
            Some(Awaiting::Sub(sub)) => {
                self.subs.remove(&sub);
                self.events.push_back(ClientEvent::SubscribeFailed { sub, error, cursor, redirect });
                self.finish_dedicated(idx);
            }
            Some(Awaiting::Request(request_id)) => {
                self.events.push_back(ClientEvent::RequestFailed { request_id, error, cursor, redirect })
            }
            None => self.events.push_back(ClientEvent::Error { stream: ClientStream(idx as u32), error }),
        }
    }

    /// Stores a cache value. Answered by `CacheOk` with the returned request id.
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

    /// Reads a cache value. Answered by `CacheValue`.
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

    /// Deletes a cache value (FEATURE_CACHE_DELETE). Answered by `CacheValue` with the removed
    /// value.
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
        self.require(stream, Features::CACHE_DELETE, "FEATURE_CACHE_DELETE")?;
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
    /// (FEATURE_CACHE_CONDITIONAL). Answered by `CacheConditionResult`.
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
        self.require(stream, Features::CACHE_CONDITIONAL, "FEATURE_CACHE_CONDITIONAL")?;
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
    /// Answered by `CacheConditionResult`.
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
        self.require(stream, Features::CACHE_CONDITIONAL, "FEATURE_CACHE_CONDITIONAL")?;
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

    fn require(&self, stream: ClientStream, f: Features, name: &'static str) -> Result<(), CommandError> {
        let idx = self.ctl_index(stream)?;
        if self.ctls[idx].negotiated.expect("checked").broker_has(f) {
            Ok(())
        } else {
            Err(CommandError::NotNegotiated(name))
        }
    }

    // -----------------------------------------------------------------------------------------
    // Inputs

    /// Bytes arrived on a stream: a control stream we opened, or an event stream the broker
    /// opened.
    pub fn handle_stream_data(&mut self, stream: StreamId, data: Bytes, fin: bool, now: Instant) {
        self.handle_stream_chunks(stream, std::iter::once(data), fin, now);
    }

    /// [`handle_stream_data`](Self::handle_stream_data) for several chunks that arrived
    /// together, in order: the stream is looked up and decoded once for all of them.
    pub fn handle_stream_chunks<I>(&mut self, stream: StreamId, chunks: I, fin: bool, now: Instant)
    where
        I: IntoIterator<Item = Bytes>,
    {
        self.clock.advance(now);
        if stream.initiator() == Side::Broker && stream.dir() == Dir::Uni {
            return self.event_stream_data(stream, chunks, fin);
        }
        let Some(idx) = self.ctls.iter().position(|c| c.id == Some(stream)) else { return };
        for data in chunks {
            self.ctls[idx].decoder.push(data);
        }
        loop {
            match self.ctls[idx].decoder.next_frame() {
                Ok(Some(f)) => self.control_frame(idx, f),
                Ok(None) => break,
                Err(e) => {
                    self.events.push_back(ClientEvent::ProtocolError { reason: e.to_string() });
                    if e.is_fatal() {
                        break;
                    }
                }
            }
        }
        if fin {
            self.ctls[idx].closed = true;
            self.fail_pending(idx);
            self.events.push_back(ClientEvent::StreamClosed { stream: ClientStream(idx as u32) });
        }
    }

    fn control_frame(&mut self, idx: usize, f: Frame) {
        let stream = ClientStream(idx as u32);
        match f.decode_payload() {
            Ok(Payload::Ack(a)) => self.on_ack(a),
            Ok(Payload::Json(Decoded::Message(m))) => self.control_message(idx, m),
            Ok(Payload::Json(Decoded::Unknown(u))) => self
                .events
                .push_back(ClientEvent::ProtocolError { reason: format!("unknown message type {}", u.type_name) }),
            Ok(_) => self.events.push_back(ClientEvent::ProtocolError { reason: "unexpected frame kind".into() }),
            Err(e) => self.events.push_back(ClientEvent::ProtocolError { reason: e.to_string() }),
        }
        let _ = stream;
    }

    /// The subscription a dedicated stream carries, sent or not.
    fn dedicated_sub(&self, idx: usize) -> Option<u64> {
        match &self.ctls[idx].dedicated {
            Some(Dedicated::Subscribe(sub, _) | Dedicated::Watch(sub, _)) => Some(*sub),
            Some(Dedicated::Sent) => self.ctls[idx].awaiting.iter().find_map(|a| match a {
                Awaiting::Sub(s) => Some(*s),
                Awaiting::Request(_) => None,
            }),
            None => None,
        }
    }

    /// The broker ended a control stream: whatever was waiting on it will never be answered.
    /// Each is failed now, with a typed error (`outcome_unknown`: a request may have been carried
    /// out before the stream ended), rather than left to hang until the connection goes.
    fn fail_pending(&mut self, idx: usize) {
        let closed = || ErrorInfo {
            message: "the broker closed the control stream before answering".into(),
            code: None,
            retry: Some(RetryClass::OutcomeUnknown),
            detail: None,
        };
        if let Some(Dedicated::Subscribe(sub, _) | Dedicated::Watch(sub, _)) = self.ctls[idx].dedicated.take() {
            self.subs.remove(&sub);
            self.events.push_back(ClientEvent::SubscribeFailed { sub, error: closed(), cursor: None, redirect: None });
        }
        for a in std::mem::take(&mut self.ctls[idx].awaiting) {
            match a {
                Awaiting::Sub(sub) => {
                    self.subs.remove(&sub);
                    let error = closed();
                    self.events.push_back(ClientEvent::SubscribeFailed { sub, error, cursor: None, redirect: None });
                }
                Awaiting::Request(request_id) => {
                    let error = closed();
                    self.events.push_back(ClientEvent::RequestFailed {
                        request_id,
                        error,
                        cursor: None,
                        redirect: None,
                    });
                }
            }
        }
        let mut stranded: Vec<u64> =
            self.publishes.iter().filter(|(_, (_, i))| *i == idx).map(|(request_id, _)| *request_id).collect();
        stranded.sort_unstable();
        for request_id in stranded {
            if let Some(id) = self.publish_done(request_id) {
                self.events.push_back(ClientEvent::PublishFailed { id, error: closed() });
            }
        }
    }

    fn publish_done(&mut self, request_id: u64) -> Option<PublishId> {
        let (id, idx) = self.publishes.remove(&request_id)?;
        let neg = self.ctls[idx].negotiated;
        self.ctls[idx].inflight = self.ctls[idx].inflight.saturating_sub(1);
        self.shared_inflight = self.shared_inflight.saturating_sub(1);
        if let Some(neg) = neg {
            if neg.per_stream_window {
                if self.ctls[idx].was_full {
                    self.ctls[idx].was_full = false;
                    self.events.push_back(ClientEvent::PublishWindowOpen { stream: ClientStream(idx as u32) });
                }
            } else {
                // One shared window: every stream that found it full may go on.
                for (i, c) in self.ctls.iter_mut().enumerate() {
                    if c.was_full {
                        c.was_full = false;
                        self.events.push_back(ClientEvent::PublishWindowOpen { stream: ClientStream(i as u32) });
                    }
                }
            }
        }
        Some(id)
    }

    fn on_ack(&mut self, a: PublishAck) {
        let Some(id) = self.publish_done(a.request_id) else {
            return self
                .events
                .push_back(ClientEvent::ProtocolError { reason: format!("ack for unknown request {}", a.request_id) });
        };
        match a.status {
            AckStatus::Ok => self.events.push_back(ClientEvent::PublishAcked { id, offset: a.offset, owner: a.owner }),
            AckStatus::Error => {
                let (code, retry) = a.code.map_or((None, None), |(c, r)| (Some(c), Some(r)));
                let error = ErrorInfo { message: a.message, code, retry, detail: a.detail };
                self.events.push_back(ClientEvent::PublishFailed { id, error });
            }
        }
    }

    fn control_message(&mut self, idx: usize, m: Message) {
        let stream = ClientStream(idx as u32);
        let flags = self.offered_flags();
        let features = self.cfg.features;
        match m {
            Message::AuthOk(a) if self.ctls[idx].negotiated.is_none() => {
                let n = Negotiated::from_auth_ok(&a, flags, features);
                self.ctls[idx].negotiated = Some(n);
                self.events.push_back(ClientEvent::Connected { stream, negotiated: n });
                self.send_dedicated(idx);
            }
            Message::Ok(_) if self.ctls[idx].negotiated.is_none() => {
                let n = Negotiated::legacy(flags, features);
                self.ctls[idx].negotiated = Some(n);
                self.events.push_back(ClientEvent::Connected { stream, negotiated: n });
                self.send_dedicated(idx);
            }
            Message::Error(e) if self.ctls[idx].negotiated.is_none() => {
                let error = error_info(e);
                if let Some(sub) = self.dedicated_sub(idx) {
                    self.subs.remove(&sub);
                    self.ctls[idx].dedicated = None;
                    let e = error.clone();
                    self.events.push_back(ClientEvent::SubscribeFailed { sub, error: e, cursor: None, redirect: None });
                }
                self.events.push_back(ClientEvent::AuthFailed { stream, error });
            }
            Message::PublishOk(p) => {
                if let Some(id) = self.publish_done(p.request_id) {
                    self.events.push_back(ClientEvent::PublishAcked { id, offset: p.offset, owner: None });
                }
            }
            Message::PublishRefused(p) => {
                if let Some(id) = self.publish_done(p.request_id) {
                    self.events.push_back(ClientEvent::PublishRefused { id, reason: p.reason, message: p.message });
                }
            }
            Message::StreamShardsView(v) => {
                self.settle_request(idx, Some(v.request_id));
                self.events.push_back(ClientEvent::StreamShards {
                    request_id: v.request_id,
                    shards: v.shards,
                    routing: v.routing.unwrap_or(message::Routing::Modulo),
                });
            }
            Message::GroupRecords(_)
            | Message::GroupExtended(_)
            | Message::GroupDeadLetterList(_)
            | Message::GroupPosition(_)
            | Message::GroupInfo(_)
            | Message::GroupDeleted(_) => {
                let Some(request_id) = m.request_id() else { return };
                self.settle_request(idx, Some(request_id));
                self.events.push_back(ClientEvent::Answer { request_id, message: Box::new(m) });
            }
            Message::ProducerInitOk(p) => {
                self.settle_request(idx, Some(p.request_id));
                self.events
                    .push_back(ClientEvent::ProducerReady { request_id: p.request_id, producer_id: p.producer_id });
            }
            Message::PublishError(p) => {
                if let Some(id) = self.publish_done(p.request_id) {
                    let error = ErrorInfo { message: p.message, code: p.code, retry: p.retry, detail: p.detail };
                    self.events.push_back(ClientEvent::PublishFailed { id, error });
                }
            }
            Message::CacheWatchStarted(w) => {
                self.ctls[idx].awaiting.retain(|x| *x != Awaiting::Sub(w.subscription_id));
                self.events.push_back(ClientEvent::CacheWatchStarted {
                    sub: w.subscription_id,
                    resume_offset: w.resume_offset,
                    resnapshot: w.resnapshot,
                    retained_count: w.retained_count,
                });
                self.finish_dedicated(idx);
            }
            Message::Subscribed(s) => {
                self.ctls[idx].awaiting.retain(|x| *x != Awaiting::Sub(s.subscription_id));
                self.events.push_back(ClientEvent::Subscribed {
                    sub: s.subscription_id,
                    start_offset: s.start_offset,
                    live_offset: s.live_offset,
                    queue_capacity: s.queue_capacity,
                });
                self.finish_dedicated(idx);
            }
            Message::SubscribeCursorError(c) => {
                let error = ErrorInfo {
                    message: format!("cursor {:?}: requested {}, available {}", c.reason, c.requested, c.available),
                    code: None,
                    retry: None,
                    detail: None,
                };
                self.fail_oldest(idx, error, Some(c), None);
            }
            Message::NotLeader(n) => {
                let error = ErrorInfo {
                    message: format!("shard owned by {}", n.node_id),
                    code: Some(ErrorCode::NotLeader),
                    retry: Some(RetryClass::Redirect),
                    detail: None,
                };
                self.fail_oldest(idx, error, None, Some(n));
            }
            // Errors carry no request id: the oldest unanswered request on the stream claims it
            // (a broker answers a stream's requests in order).
            Message::Error(e) => self.fail_oldest(idx, error_info(e), None, None),
            Message::CacheValue(v) => {
                if let Some(request_id) = self.settle_request(idx, v.request_id) {
                    self.events.push_back(ClientEvent::CacheValue {
                        request_id,
                        value: v.value.map(|b| b.0),
                        version: v.version,
                    });
                }
            }
            Message::CacheConditionResult(c) => {
                self.settle_request(idx, Some(c.request_id));
                self.events.push_back(ClientEvent::CacheConditionResult {
                    request_id: c.request_id,
                    applied: c.applied,
                    version: c.version,
                });
            }
            Message::CacheOk(c) => {
                self.settle_request(idx, Some(c.request_id));
                self.events.push_back(ClientEvent::CacheOk { request_id: c.request_id });
            }
            // A legacy broker answers a cache write with a bare `ok`.
            Message::Ok(_) => {
                if let Some(request_id) = self.settle_request(idx, None) {
                    self.events.push_back(ClientEvent::CacheOk { request_id });
                }
            }
            Message::StreamRecords(r) => {
                self.settle_request(idx, Some(r.request_id));
                self.events.push_back(ClientEvent::StreamRecords {
                    request_id: r.request_id,
                    records: r.records,
                    next_offset: r.next_offset,
                });
            }
            Message::CounterValue(v) => {
                self.settle_request(idx, Some(v.request_id));
                self.events.push_back(ClientEvent::CounterValue { request_id: v.request_id, value: v.value });
            }
            Message::OffsetValue(v) => {
                self.settle_request(idx, Some(v.request_id));
                self.events.push_back(ClientEvent::OffsetValue { request_id: v.request_id, offset: v.offset });
            }
            Message::Unsupported(u) => {
                let awaited = u.request_id.filter(|id| self.ctls[idx].awaiting.contains(&Awaiting::Request(*id)));
                if let Some(request_id) = awaited {
                    self.settle_request(idx, Some(request_id));
                    let error = ErrorInfo {
                        message: format!("the broker does not serve {}", u.request_type),
                        code: Some(ErrorCode::UnknownName("unsupported".into())),
                        retry: Some(RetryClass::Fatal),
                        detail: None,
                    };
                    self.events.push_back(ClientEvent::RequestFailed {
                        request_id,
                        error,
                        cursor: None,
                        redirect: None,
                    });
                }
                self.events.push_back(ClientEvent::Unsupported { request_type: u.request_type });
            }
            other => self.events.push_back(ClientEvent::ProtocolError {
                reason: format!("unexpected {} on a control stream", other.type_name()),
            }),
        }
    }

    fn event_stream_data(&mut self, stream: StreamId, chunks: impl IntoIterator<Item = Bytes>, fin: bool) {
        let max = self.cfg.max_frame_len;
        let accepted = Flags::BROKER_SENDS.intersection(self.offered_flags().union(Flags::ORIGINAL_V1));
        let es = self.event_streams.entry(stream).or_insert_with(|| {
            let mut decoder = FrameDecoder::new();
            decoder.set_max_frame_len(max);
            decoder.set_accepted_flags(accepted);
            EventStream { decoder, sub: None, ended: false }
        });
        if es.ended {
            return;
        }
        for data in chunks {
            es.decoder.push(data);
        }
        loop {
            let Some(es) = self.event_streams.get_mut(&stream) else { return };
            let next = es.decoder.next_frame();
            let sub = es.sub;
            match next {
                Ok(Some(f)) => self.event_frame(stream, sub, f),
                Ok(None) => break,
                Err(e) => {
                    self.events.push_back(ClientEvent::ProtocolError { reason: format!("event stream: {e}") });
                    if e.is_fatal() {
                        break;
                    }
                }
            }
        }
        if fin
            && let Some(es) = self.event_streams.remove(&stream)
            && let (Some(sub), false) = (es.sub, es.ended)
        {
            self.subs.remove(&sub);
            self.events.push_back(ClientEvent::SubscriptionEnded { sub, reason: EndReason::Finished });
        }
    }

    fn end_sub(&mut self, stream: StreamId, sub: Option<u64>, reason: EndReason) {
        if let Some(es) = self.event_streams.get_mut(&stream) {
            es.ended = true;
        }
        if let Some(sub) = sub {
            self.subs.remove(&sub);
            self.events.push_back(ClientEvent::SubscriptionEnded { sub, reason });
        }
    }

    fn event_frame(&mut self, stream: StreamId, sub: Option<u64>, f: Frame) {
        let payload = match f.decode_payload() {
            Ok(p) => p,
            Err(e) => {
                return self.events.push_back(ClientEvent::ProtocolError { reason: format!("event stream: {e}") });
            }
        };
        match (sub, payload) {
            (None, Payload::Json(Decoded::Message(Message::EventStreamHello(h)))) => {
                if let Some(es) = self.event_streams.get_mut(&stream) {
                    es.sub = Some(h.subscription_id);
                }
                self.subs.insert(h.subscription_id, Some(stream));
            }
            (None, _) => self.events.push_back(ClientEvent::ProtocolError {
                reason: "event stream did not start with event_stream_hello".into(),
            }),
            (Some(sub), Payload::Events(batch)) => self.events.push_back(ClientEvent::Events { sub, batch }),
            (Some(sub), Payload::Json(Decoded::Message(m))) => match m {
                Message::SubscriptionLagged(l) => {
                    self.end_sub(stream, Some(sub), EndReason::Lagged { resume_from: l.resume_from })
                }
                Message::ShardMoved(m) => self.end_sub(stream, Some(sub), EndReason::Moved(m)),
                Message::StreamDeleted(_) => self.end_sub(stream, Some(sub), EndReason::Deleted),
                Message::CacheEvent(event) => self.events.push_back(ClientEvent::CacheEvent { sub, event }),
                Message::CacheWatchLagged(l) => {
                    self.end_sub(stream, Some(sub), EndReason::WatchLagged { resume_from: l.resume_from })
                }
                Message::Error(e) => self.end_sub(stream, Some(sub), EndReason::Error(error_info(e))),
                Message::Event(e) => {
                    let records = Records::from_payloads([e.payload.0]).unwrap_or_default();
                    let batch = EventBatch { base_offset: e.offset, ..EventBatch::shared(records) };
                    self.events.push_back(ClientEvent::Events { sub, batch });
                }
                Message::EventBatch(e) => {
                    let records = Records::from_payloads(e.payloads.into_iter().map(|p| p.0)).unwrap_or_default();
                    let batch = EventBatch { base_offset: e.base_offset, ..EventBatch::shared(records) };
                    self.events.push_back(ClientEvent::Events { sub, batch });
                }
                other => self.events.push_back(ClientEvent::ProtocolError {
                    reason: format!("unexpected {} on an event stream", other.type_name()),
                }),
            },
            (Some(_), _) => self
                .events
                .push_back(ClientEvent::ProtocolError { reason: "unexpected frame on an event stream".into() }),
        }
    }
}
