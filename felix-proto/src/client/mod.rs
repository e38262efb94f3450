//! The client role: one QUIC connection to a broker, with no IO.
//!
//! [`ClientConnection`] holds every protocol decision a client makes, so that a driver only
//! moves bytes and time (and the simulation reaches all of it):
//! * which control stream a request goes on: the main one, a stream of its own for each
//!   subscription and cache watch (as upstream clients do), a stream for long polls so they hold
//!   up nothing else; streams are opened, authenticated and reopened as needed, and a request is
//!   held until its stream authenticated;
//! * what may be sent: every request and optional field is checked against what the broker
//!   advertised ([`needs`]), encodings are chosen from the broker's flags, never from our own;
//! * publish windows: a publish sent with [`publish_auto`](ClientConnection::publish_auto)
//!   waits in a queue while its stream's window is full and goes out when it opens;
//! * answers: matched to requests (by id, or by order for the id-less `error`) and reported as
//!   typed [`Reply`]s; a request the broker never answers fails after `request_timeout`; a
//!   stream the broker ends or resets, or a lost connection, fails what was pending on it;
//! * subscriptions: events never reach the application before their subscription's
//!   confirmation, and a subscription whose events the application has not taken past
//!   `subscription_buffer_bytes` has its event stream paused (QUIC flow control then holds the
//!   broker, whose bounded queue and `subscription_lagged` take it from there);
//! * an idempotent producer's sequences ([`producer`]) and where a subscription resumes
//!   ([`resume`]) are state machines of their own beside it.
//!
//! Drive it like the broker: feed inputs (`handle_*`, each with `now`), then drain
//! [`poll_output`](ClientConnection::poll_output) and [`poll_event`](ClientConnection::poll_event)
//! until `None`, and call [`handle_timeout`](ClientConnection::handle_timeout) at
//! [`poll_timeout`](ClientConnection::poll_timeout).

use crate::binary::{Codec, Compressor, Decompressor, ErrorDetail, EventBatch, OwnerHint};
use crate::error_code::{ErrorCode, RetryClass};
use crate::features::Features;
use crate::flags::{Flags, FlagsHi};
use crate::frame::FrameDecoder;
use crate::message::{self, Message, StartPosition};
use crate::negotiate::Negotiated;
use crate::transport::{Clock, OpenToken, StreamId};
use bytes::{Bytes, BytesMut};
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

mod commands;
mod control;
mod events;
pub mod needs;
pub mod producer;
pub mod resume;

pub use commands::{commit_message, stream_read_message};
pub use events::event_bytes;
pub use resume::{SubscriptionCursor, lagged_resume_point};

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
    /// The second flag word to offer (D56), with [`Flags::EXTENDED`] in `flags`: the codecs
    /// this client decodes (both by default), so a publisher's compressed batches reach it as
    /// they were stored.
    pub flags_hi: FlagsHi,
    /// Compress published batches with this codec at this level, when the broker takes it and
    /// the batch shrinks (`None`, the default: publish plain).
    pub compress: Option<(Codec, i32)>,
    /// Features to offer.
    pub features: Features,
    /// Largest frame accepted from the broker.
    pub max_frame_len: u32,
    /// A request, subscribe or acked publish the broker has not answered after this fails with
    /// `outcome_unknown` (a long poll gets its `wait_ms` on top).
    pub request_timeout: Duration,
    /// Event bytes one subscription may hold that the application has not taken
    /// ([`handle_consumed`](ClientConnection::handle_consumed)) before its event stream is paused;
    /// it is read again below half of it.
    pub subscription_buffer_bytes: usize,
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
            flags_hi: FlagsHi::KNOWN,
            compress: None,
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
            request_timeout: Duration::from_secs(30),
            subscription_buffer_bytes: 64 << 20,
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ClientStream(pub u32);

/// Names a publish until it is answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PublishId(pub u64);

/// An error a broker reported (or the client concluded), with the code fields when known.
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

impl ErrorInfo {
    /// An error the client concluded itself (no answer, a stream or connection gone): the
    /// request may or may not have been carried out.
    pub(crate) fn unknown_outcome(message: impl Into<String>) -> ErrorInfo {
        ErrorInfo { message: message.into(), code: None, retry: Some(RetryClass::OutcomeUnknown), detail: None }
    }
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
    /// The broker reset the event stream.
    Reset,
    /// The connection is gone.
    ConnectionLost(String),
}

/// A typed answer to a request ([`ClientEvent::Reply`]).
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    /// `cache_value`: the value (the removed one for a delete), `None` on a miss, and its version
    /// (a hit, from a broker with FEATURE_CACHE_CONDITIONAL).
    CacheValue {
        /// The value.
        value: Option<Bytes>,
        /// Its version.
        version: Option<u64>,
    },
    /// `cache_ok` (or a legacy broker's bare `ok`): a cache write, or a group ack, nack, extend
    /// or dead-letter operation, was applied.
    Done,
    /// `cache_condition_result`.
    CacheCondition {
        /// Whether the write applied.
        applied: bool,
        /// The version written (applied), or the key's current version (not applied; `None`
        /// when it has no live entry).
        version: Option<u64>,
    },
    /// `counter_value`: the sum; `None` when the counter was never written (not the same as 0).
    CounterValue(Option<i64>),
    /// `stream_records`: a page of a shard.
    StreamRecords {
        /// The records, in offset order.
        records: Vec<message::StreamRecord>,
        /// Where the next page starts.
        next_offset: u64,
    },
    /// `offset_value`: `None` when no readable record is that recent.
    OffsetValue(Option<u64>),
    /// `producer_init_ok`: the producer id the broker chose.
    ProducerId(u64),
    /// `stream_shards_view`.
    StreamShards {
        /// Shards (0: the stream does not exist).
        shards: u32,
        /// How keys map to shards.
        routing: message::Routing,
    },
    /// `shard_owners_view`: each shard's owner, in shard order.
    ShardOwners(Vec<message::ShardOwner>),
    /// `shard_inspect_info`: the broker's own view of one shard.
    ShardInspect(Box<message::InspectView>),
    /// `subscriptions_list_info`: one page of the subscriptions the broker serves.
    Subscriptions(Box<message::SubscriptionsListInfo>),
    /// `group_records`.
    GroupRecords(Vec<message::GroupRecord>),
    /// `group_extended`: how long the claim now stands, ms.
    GroupExtended(u64),
    /// `group_dead_letter_list`: offsets, lowest first.
    GroupDeadLetters(Vec<u64>),
    /// `group_position`.
    GroupPosition {
        /// The group's position.
        offset: u64,
        /// Whether the seek moved it.
        moved: bool,
    },
    /// `group_info`.
    GroupInfo(message::GroupInfo),
    /// `group_list_view`: a shard's groups, by name.
    GroupList(Vec<message::GroupSummary>),
    /// `cache_keys_view`: a page of keys, and the key to continue after when more follow.
    CacheKeys {
        /// The keys, in byte order.
        keys: Vec<String>,
        /// The last key, when more follow.
        next: Option<String>,
    },
    /// `stream_list_view`: a page of streams, and where the next starts when more follow.
    StreamList {
        /// The streams, in `namespace/stream` order.
        streams: Vec<message::StreamEntry>,
        /// The last one's `namespace/stream`, when more follow.
        next: Option<String>,
    },
    /// `stream_info_view`: the stream's configuration and one shard's state.
    StreamInfo(Box<message::StreamInfoView>),
    /// `cluster_status_view`: the status document (D52).
    ClusterStatus(Box<serde_json::Value>),
    /// `shard_move_ok`: what was proposed.
    ShardMoveProposed(String),
    /// `group_deleted`: whether the group existed.
    GroupDeleted(bool),
    /// `stream_delete_ok`: whether there was such a stream.
    StreamDeleted(bool),
    /// `stream_create_ok` (D60): the streams created (proposed, in a cluster) and those that
    /// existed, with their shard counts.
    StreamsCreated {
        /// Created.
        created: Vec<String>,
        /// Existed already.
        existed: Vec<message::ExistingStream>,
    },
    /// `commit_ok`: where the commit's event is read, and the version of every key it wrote.
    Committed(u64),
    /// `state_value`: a key's value (`None`: never written, or deleted), the offset of the
    /// commit that wrote it, and the offset of the last commit the state reflects.
    State {
        /// The value.
        value: Option<Bytes>,
        /// Offset of the commit that wrote it.
        version: Option<u64>,
        /// Offset of the last commit applied.
        as_of: Option<u64>,
    },
    /// `publish_refused` answering a request (a `commit` whose `expected_offset` was not the
    /// shard's tail): nothing was written.
    Refused {
        /// Why (`offset_mismatch` with the tail).
        reason: message::RefusedReason,
        /// Prose.
        message: String,
    },
}

/// Something that happened. Each is reported once (edge-triggered).
#[derive(Debug, Clone, PartialEq)]
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
    /// An acked publish failed (by the broker's answer, or because it cannot be answered any
    /// more: `retry` is `outcome_unknown` then).
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
    /// A stream whose publish window was full has room again.
    PublishWindowOpen {
        /// The stream.
        stream: ClientStream,
    },
    /// A request was answered.
    Reply {
        /// Request id.
        request_id: u64,
        /// The answer.
        reply: Reply,
    },
    /// A request was refused (or cannot be answered any more: `retry` is `outcome_unknown`).
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
    /// A subscription was confirmed. Its events come after this, never before.
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
    /// A subscribe (or cache watch) was refused.
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
    /// Events arrived. Report their size to [`handle_consumed`](ClientConnection::handle_consumed)
    /// once the application took them ([`EventBatch`] `records.payload_bytes()`).
    Events {
        /// Subscription.
        sub: u64,
        /// The batch.
        batch: EventBatch,
    },
    /// A subscription or cache watch ended.
    SubscriptionEnded {
        /// Subscription.
        sub: u64,
        /// Why.
        reason: EndReason,
    },
    /// A cache watch was confirmed. Its changes come after this.
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
    /// The broker closed a control stream (what was pending on it failed first).
    StreamClosed {
        /// The stream.
        stream: ClientStream,
    },
    /// The broker sent something this client cannot parse (it is reported, not trusted).
    ProtocolError {
        /// What went wrong.
        reason: String,
    },
    /// The connection is gone ([`handle_connection_lost`](ClientConnection::handle_connection_lost)):
    /// everything pending failed, every subscription ended. Nothing more comes.
    ConnectionLost {
        /// Why.
        reason: String,
    },
}

/// Something the driver must do. Match it exhaustively: a new variant is a new duty.
#[derive(Debug, Clone, PartialEq, Eq)]
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
    /// Stop reading a stream for now (its subscription holds too much the application has not
    /// taken): QUIC flow control then holds the broker. Bytes already read are still delivered.
    PauseReading {
        /// Stream.
        stream: StreamId,
    },
    /// Read a paused stream again.
    ResumeReading {
        /// Stream.
        stream: StreamId,
    },
}

/// Why a command was refused (nothing was sent; the state is unchanged).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
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
    /// The request cannot be encoded (a name or value too long for its field).
    #[error("cannot encode: {0}")]
    Encode(String),
    /// The connection is gone.
    #[error("connection lost: {0}")]
    ConnectionLost(String),
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
    /// An envelope sent with the batch (D58): opaque to the broker, stored and delivered with
    /// it to subscribers that read envelopes (end-to-end encryption's key id and algorithm).
    pub envelope: Option<Bytes>,
}

impl PublishRequest {
    /// An unkeyed, unacked batch.
    pub fn new(namespace: impl Into<String>, stream: impl Into<String>, payloads: Vec<Bytes>) -> PublishRequest {
        PublishRequest {
            envelope: None,
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
    /// Only batches whose key this matches (D57; refused before sending to a broker that does
    /// not advertise FEATURE_STREAM_FILTER).
    pub filter: Option<message::KeyFilter>,
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

/// A `commit`: an event and the state changes it makes, written as one record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommitRequest {
    /// Namespace.
    pub namespace: String,
    /// Stream (durable).
    pub stream: String,
    /// Routes the commit to its shard (as a publish key does); the state is per shard.
    pub entity_key: Bytes,
    /// The event, read by subscribers as one record.
    pub event: Bytes,
    /// `(key, Some(value))` puts, `(key, None)` deletes, applied in order.
    pub changes: Vec<(String, Option<Bytes>)>,
    /// Commit only if the shard's next offset is this (FEATURE_PUBLISH_CONDITIONAL).
    pub expected_offset: Option<u64>,
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
    /// Read the asked broker's own copy of a replicated shard (D51), not the leader's.
    pub replica_local: bool,
}

/// What a deadline in the timer table is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum Timer {
    /// A request (by id) or an acked publish (by its request id).
    Request(u64),
    /// A subscribe or cache watch (by subscription id).
    Subscribe(u64),
}

/// The client state machine.
#[derive(Debug)]
pub struct ClientConnection {
    cfg: ClientConfig,
    /// The publish compressor, once a compressed publish was made (`cfg.compress`).
    compressor: Option<Compressor>,
    /// Decompression contexts for compressed event batches (D56), made once.
    decompressor: Decompressor,
    clock: Clock,
    /// Control streams, by [`ClientStream`] index.
    ctls: Vec<control::Ctl>,
    /// The stream ordinary requests go on (reopened when the broker ends it).
    main: usize,
    /// The stream long polls go on, once opened.
    long: Option<usize>,
    opens: HashMap<OpenToken, usize>,
    next_open: u64,
    next_request: u64,
    next_sub: u64,
    /// Acked publishes sent and not answered: request id → publish and stream.
    publishes: HashMap<u64, (PublishId, usize)>,
    /// Publishes of `publish_auto` waiting for their stream (to authenticate, or its window).
    queued_publishes: VecDeque<(PublishId, PublishRequest)>,
    shared_inflight: u32,
    event_streams: HashMap<StreamId, events::EventStream>,
    subs: HashMap<u64, events::SubEntry>,
    /// Deadlines of requests, acked publishes and subscribes, earliest first.
    timers: BTreeSet<(Instant, Timer)>,
    deadlines: HashMap<Timer, Instant>,
    /// Why the connection is gone, once it is.
    lost: Option<String>,
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
            compressor: None,
            decompressor: Decompressor::new(),
            clock: Clock::new(),
            ctls: Vec::new(),
            main: 0,
            long: None,
            opens: HashMap::new(),
            next_open: 1,
            next_request: 1,
            next_sub: 1,
            publishes: HashMap::new(),
            queued_publishes: VecDeque::new(),
            shared_inflight: 0,
            event_streams: HashMap::new(),
            subs: HashMap::new(),
            timers: BTreeSet::new(),
            deadlines: HashMap::new(),
            lost: None,
            out: VecDeque::new(),
            events: VecDeque::new(),
        };
        c.clock.advance(now);
        c.main = c.open_stream(now).0 as usize;
        c
    }

    /// The flags this client offers (what it may receive). Bit 15 only with a second word
    /// to offer, so a client that offers none sends the `auth` it always did.
    fn offered_flags(&self) -> Flags {
        let f = self.cfg.flags.unwrap_or(Flags::ORIGINAL_V1);
        f.with(Flags::EXTENDED, f.contains(Flags::EXTENDED) && !self.cfg.flags_hi.is_empty())
    }

    /// The second flag word this client offers (D56): empty unless bit 15 is offered.
    fn offered_flags_hi(&self) -> FlagsHi {
        if self.offered_flags().contains(Flags::EXTENDED) { self.cfg.flags_hi } else { FlagsHi::EMPTY }
    }

    /// The next output.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<ClientOutput> {
        self.out.pop_front()
    }

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ClientEvent> {
        self.events.pop_front()
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next: the earliest deadline of an
    /// unanswered request.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.timers.first().map(|(t, _)| *t)
    }

    /// Time passed: requests, acked publishes and subscribes unanswered past their deadline
    /// fail (`outcome_unknown`: the broker may have carried them out). Idempotent; may be
    /// called early.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock.advance(now);
        while let Some(&(t, timer)) = self.timers.first()
            && t <= now
        {
            self.timers.pop_first();
            self.deadlines.remove(&timer);
            let why = ErrorInfo::unknown_outcome(format!(
                "no answer within {:?}; the broker may still have carried it out",
                self.cfg.request_timeout
            ));
            match timer {
                Timer::Request(id) => self.expire_request(id, why),
                Timer::Subscribe(sub) => self.expire_subscribe(sub, why),
            }
        }
    }

    /// Sets a deadline `request_timeout` (plus `extra`) after the latest time the client was
    /// told (commands that take no `now` count from the latest input's).
    fn arm(&mut self, timer: Timer, extra: Duration) {
        let Some(now) = self.clock.last() else { return };
        let at = crate::transport::after(now, self.cfg.request_timeout.saturating_add(extra));
        if let Some(old) = self.deadlines.insert(timer, at) {
            self.timers.remove(&(old, timer));
        }
        self.timers.insert((at, timer));
    }

    fn disarm(&mut self, timer: Timer) {
        if let Some(at) = self.deadlines.remove(&timer) {
            self.timers.remove(&(at, timer));
        }
    }

    /// The connection is gone (closed by either side, or lost). Everything pending fails
    /// (`outcome_unknown`), every subscription ends, queued requests and publishes fail, and
    /// every later command is refused with [`CommandError::ConnectionLost`].
    pub fn handle_connection_lost(&mut self, reason: impl Into<String>, now: Instant) {
        self.clock.advance(now);
        if self.lost.is_some() {
            return;
        }
        let reason = reason.into();
        self.lost = Some(reason.clone());
        let why = || ErrorInfo::unknown_outcome(format!("connection lost: {reason}"));
        for idx in 0..self.ctls.len() {
            self.fail_stream(idx, &why());
        }
        for (id, _) in std::mem::take(&mut self.queued_publishes) {
            self.events.push_back(ClientEvent::PublishFailed { id, error: why() });
        }
        let mut subs: Vec<u64> = self.subs.keys().copied().collect();
        subs.sort_unstable();
        for sub in subs {
            self.end_subscription(sub, EndReason::ConnectionLost(reason.clone()));
        }
        self.timers.clear();
        self.deadlines.clear();
        self.events.push_back(ClientEvent::ConnectionLost { reason });
    }

    /// The broker reset a stream: a control stream's pending requests fail as for a closed one;
    /// an event stream's subscription ends ([`EndReason::Reset`]).
    pub fn handle_stream_reset(&mut self, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        if self.is_event_stream(stream) {
            return self.event_stream_reset(stream);
        }
        if let Some(idx) = self.ctls.iter().position(|c| c.id == Some(stream)) {
            self.stream_ended(idx);
        }
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
        if self.is_event_stream(stream) {
            return self.event_stream_data(stream, chunks, fin);
        }
        let Some(idx) = self.ctls.iter().position(|c| c.id == Some(stream)) else { return };
        self.control_data(idx, chunks, fin);
    }

    fn is_event_stream(&self, stream: StreamId) -> bool {
        stream.initiator() == crate::transport::Side::Broker && stream.dir() == crate::transport::Dir::Uni
    }

    fn new_decoder(&self) -> FrameDecoder {
        let mut decoder = FrameDecoder::new();
        decoder.set_max_frame_len(self.cfg.max_frame_len);
        decoder
    }
}
