//! The broker role: every protocol decision a Felix broker makes, with no IO.
//!
//! # Theory of operation
//!
//! [`Broker`] owns all broker state: streams and their shard logs, caches, and every client
//! connection's streams and subscriptions. A driver feeds it inputs (`handle_*` methods, each
//! taking `now`) and drains its outputs with [`Broker::poll_output`], then sleeps until
//! [`Broker::poll_timeout`]:
//!
//! ```text
//!   driver                               Broker
//!   ------                               ------
//!   connection arriving  ──────────────▶ admit(peer, now) -> Result<ConnId, AdmitError>
//!   bytes on stream S    ──────────────▶ handle_stream_data(conn, S, bytes, fin, now)
//!   uni stream opened    ──────────────▶ handle_stream_opened(conn, token, S, now)
//!   bytes written        ──────────────▶ handle_stream_flushed(conn, S, n, now)
//!   storage wrote W      ──────────────▶ handle_write_complete(W, ok, now)
//!   timer fired          ──────────────▶ handle_timeout(now)
//!                        ◀────────────── poll_output(): Transmit / Finish / OpenUni /
//!                                         Pause/ResumeReading / Persist / CloseConnection ...
//! ```
//!
//! Call order: after any input, drain `poll_output` until `None`, then read `poll_timeout`.
//! `now` must not go backwards (it is clamped if it does). Every output is a deterministic
//! function of the inputs.
//!
//! Decisions that depend on what a client offered are taken per control stream, from the
//! `auth` that opened it: a frame or field a client did not offer is never sent to it.

pub mod auth;
mod cache;
pub mod config;
mod consume;
mod group;
mod history;
mod log;
mod producer;
mod syslog;
mod watch;

pub use auth::{Action, Grant, TokenGrant};
pub use config::{BrokerConfig, CacheSpec, FsyncMode, Retention, StreamConfig, StreamSpec};
pub use group::GroupLimits;
pub(crate) use producer::digest as records_digest;

use crate::binary::{ErrorDetail, OwnerHint, PublishAck, PublishBatch, Records};
use crate::error_code::{ErrorCode, RetryClass};
use crate::features::Features;
use crate::flags::{FlagError, Flags};
use crate::frame::{Frame, FrameDecoder, FrameError};
use crate::io::{Clock, ConnId, Dir, OpenToken, ReadToken, Side, StreamId, WallClock, WriteToken, close_code};
use crate::message::{self, B64, Decoded, Direction, Message};
use crate::negotiate::{ClientOffer, broker_answer};
use crate::payload::PayloadKind;
use crate::routing::shard_for_key;
use bytes::{Bytes, BytesMut};
use cache::Cache;
use log::{Shape, ShardLog};
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// Something the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum BrokerOutput {
    /// Write `data` on `stream` (after everything written on it before).
    Transmit {
        /// Connection.
        conn: ConnId,
        /// Stream.
        stream: StreamId,
        /// Bytes (whole frames, or the second part of a two-part event frame).
        data: Bytes,
    },
    /// Finish (FIN) our sending side of `stream` once everything before is written.
    Finish {
        /// Connection.
        conn: ConnId,
        /// Stream.
        stream: StreamId,
    },
    /// Ask the peer to stop sending on `stream` (we will read nothing more from it).
    StopSending {
        /// Connection.
        conn: ConnId,
        /// Stream.
        stream: StreamId,
        /// QUIC application error code.
        code: u64,
    },
    /// Open a unidirectional stream and report its id with `handle_stream_opened(token)`.
    OpenUni {
        /// Connection.
        conn: ConnId,
        /// Names the stream until it has an id.
        token: OpenToken,
    },
    /// Stop reading `stream` (QUIC flow control then slows the client): its publish window is
    /// full.
    PauseReading {
        /// Connection.
        conn: ConnId,
        /// Stream.
        stream: StreamId,
    },
    /// Read `stream` again.
    ResumeReading {
        /// Connection.
        conn: ConnId,
        /// Stream.
        stream: StreamId,
    },
    /// Persist records, then report with `handle_write_complete(token, ok)`. Writes of one shard
    /// should complete in the order they were asked for (they become visible in offset order
    /// either way).
    Persist(PersistRequest),
    /// Read history back from storage and report it with `handle_read_complete(token, batches)`:
    /// the stored batches of a shard from the one holding `from` up to (not including) `end`,
    /// stopping after about `max_bytes` of payload. Return what is there (an empty answer is
    /// fine: the subscriber then sees a gap).
    Read(ReadRequest),
    /// Retention moved a durable shard's start: storage may delete whatever lies wholly below
    /// `start` (whole segments).
    Truncate {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: u32,
        /// The new oldest retained offset.
        start: u64,
        /// `(producer_id, forgotten_through)` of idempotent producers whose remembered window
        /// this truncation cut into: storage keeps the highest per producer and hands them back
        /// at recovery ([`Broker::restore_producer_watermarks`]), so a resent sequence that
        /// retention removed is refused `sequence_expired` after a restart too, never appended
        /// twice. Almost always empty.
        producers_forgotten: Vec<(u64, u64)>,
    },
    /// Close the connection.
    CloseConnection {
        /// Connection.
        conn: ConnId,
        /// QUIC application error code (see [`close_code`]).
        code: u64,
        /// Human-readable reason.
        reason: String,
    },
}

/// A storage write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistRequest {
    /// Reported back on completion.
    pub token: WriteToken,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard.
    pub shard: u32,
    /// Offset of the first record.
    pub base_offset: u64,
    /// The records (empty for a generation-start record).
    pub records: Records,
    /// Append time, microseconds since the Unix epoch.
    pub timestamp_micros: u64,
    /// The publishing principal.
    pub publisher: Option<Bytes>,
    /// A generation-start record (one offset, never delivered).
    pub generation_start: bool,
    /// The idempotent producer that wrote it: `(producer_id, sequence)`, kept with the batch so
    /// producer state survives a restart.
    pub producer: Option<(u64, u64)>,
    /// The stream's fsync policy (`None`: storage's default).
    pub fsync: Option<FsyncMode>,
    /// How many shards the stream has (for the storage layer's metadata).
    pub stream_shards: u32,
}

/// A history read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// Reported back on completion.
    pub token: ReadToken,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard.
    pub shard: u32,
    /// First offset wanted.
    pub from: u64,
    /// Stop before this offset (the start of what the broker holds in memory).
    pub end: u64,
    /// About how many payload bytes to return at most.
    pub max_bytes: usize,
}

/// Counters, for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BrokerStats {
    /// Connections opened.
    pub connections_opened: u64,
    /// Frames received.
    pub frames_in: u64,
    /// JSON frames received (after `auth`).
    pub frames_in_json: u64,
    /// Binary publish frames received.
    pub frames_in_binary: u64,
    /// Publish answers sent (binary acks and JSON `publish_ok`/`publish_error`/`publish_refused`).
    pub acks_sent: u64,
    /// Publish requests by path.
    pub publishes_json: u64,
    /// Binary publish frames.
    pub publishes_binary: u64,
    /// Records appended.
    pub records_appended: u64,
    /// Publishes refused.
    pub publishes_refused: u64,
    /// Failed unacknowledged binary publishes (no answer is sent for these).
    pub unacked_failures: u64,
    /// Event batches written to event streams.
    pub batches_delivered: u64,
    /// Records dropped from subscriber queues.
    pub records_dropped: u64,
    /// Subscriptions ended with `subscription_lagged`.
    pub lagged: u64,
    /// Cache hits and misses.
    pub cache_hits: u64,
    /// Cache misses.
    pub cache_misses: u64,
    /// Protocol violations that closed a connection.
    pub protocol_violations: u64,
    /// Connections refused at admission (too many unauthenticated ones).
    pub connections_refused: u64,
    /// Unauthenticated connections closed to make room for new ones.
    pub connections_evicted: u64,
    /// Control streams ended for not authenticating in time.
    pub auth_timeouts: u64,
}

/// A peer's address, as the driver names it to the core (an IP address in 16 bytes, IPv4
/// mapped into IPv6): connections from one peer share a cap. Opaque to the core.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerAddr(pub [u8; 16]);

/// How a write ended ([`Broker::handle_write_result`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// On storage (as far as the stream's fsync policy promises).
    Written,
    /// Failed; nothing of it is stored.
    Failed,
    /// Failed for lack of space (a full disk, a quota, a file-size limit); nothing of it is
    /// stored. The shard refuses publishes until a write succeeds again.
    NoSpace,
}

/// How long a shard whose storage is full refuses publishes before it tries one write again.
const FULL_PROBE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(1);

/// Why a connection was not admitted ([`Broker::admit`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum AdmitError {
    /// The peer already holds this many connections that authenticated nothing.
    #[error("too many unauthenticated connections from this address (at most {max})")]
    TooManyFromPeer {
        /// The cap.
        max: usize,
    },
    /// This many connections authenticated nothing, none of them for longer than the auth
    /// timeout.
    #[error("too many unauthenticated connections (at most {max})")]
    TooManyUnauthenticated {
        /// The cap.
        max: usize,
    },
}

type Key = (String, String, String);

#[derive(Debug)]
struct Moved {
    node_id: String,
    addr: Option<String>,
    generation: u64,
}

#[derive(Debug)]
struct Shard {
    log: ShardLog,
    subs: Vec<(ConnId, u64)>,
    moved: Option<Moved>,
    /// Streams paused because this shard's writes backed up.
    paused: Vec<(ConnId, StreamId)>,
    /// Idempotent producers' sequences on this shard.
    producers: producer::Producers,
    /// Storage ran out of space writing this shard: publishes are refused `overloaded` with
    /// nothing written (nothing is acknowledged on enqueue either), except one probe write at
    /// or after this time, answered after its write; the first write that succeeds ends it.
    full: Option<Instant>,
}

#[derive(Debug)]
struct StreamEntry {
    config: StreamConfig,
    shards: Vec<Shard>,
}

#[derive(Debug, Clone)]
struct Session {
    tenant_id: String,
    principal: Bytes,
    token: usize,
    offer: ClientOffer,
    window: Option<u32>,
    ack_on_commit: bool,
    widths: HashMap<Key, u32>,
}

#[derive(Debug)]
struct Owed {
    seq: u64,
    answer: Option<Bytes>,
}

#[derive(Debug)]
struct CtlStream {
    id: StreamId,
    uni: bool,
    decoder: FrameDecoder,
    session: Option<Session>,
    owed: VecDeque<Owed>,
    next_seq: u64,
    outstanding: usize,
    paused: bool,
    /// Paused because a shard it publishes to has too much waiting for storage.
    storage_paused: bool,
    /// Paused because answers written to it are not flushed yet (a client that sends requests
    /// and does not read the answers is slowed by QUIC flow control, not buffered for).
    flush_paused: bool,
    /// Answer bytes handed to the driver and not yet reported flushed.
    unflushed: usize,
    fin_recv: bool,
    closed: bool,
    send_finished: bool,
    /// A stream must authenticate by then (auth is per stream; the connection is not judged).
    auth_deadline: Option<Instant>,
    /// Answers held back behind a request answered from storage (`stream_read`), so that every
    /// answer leaves in request order: id-less answers (`error`, `subscribe_cursor_error`) are
    /// matched by order.
    held: VecDeque<Held>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldFor {
    Read(ReadToken),
    Write(WriteToken),
    /// A group poll (long-polling, or reading its records back).
    Poll(u64),
}

#[derive(Debug)]
enum Held {
    Waiting(HeldFor),
    Ready(Bytes),
}

/// Who asked for a storage read.
#[derive(Debug)]
enum ReadFor {
    /// A subscription catching up: `(conn, subscription id)`.
    Sub(ConnId, u64),
    /// A `stream_read` page.
    Page(PageRead),
    /// Records a group poll handed out.
    Poll(Box<consume::PollFill>),
}

#[derive(Debug)]
struct PageRead {
    conn: ConnId,
    stream: StreamId,
    request_id: u64,
    key: Key,
    shard: u32,
    end: u64,
    page: log::Page,
}

#[derive(Debug, Clone, PartialEq)]
enum Ending {
    Lagged { resume_from: u64 },
    WatchLagged { resume_from: u64 },
    Moved(message::ShardMoved),
    Deleted,
}

#[derive(Debug)]
struct Sub {
    id: u64,
    key: Key,
    shard: u32,
    stream: Option<StreamId>,
    shape: Shape,
    offer: ClientOffer,
    queue: VecDeque<[Bytes; 2]>,
    /// Bytes of the frames in `queue`.
    queued_bytes: usize,
    capacity: usize,
    inflight: usize,
    cursor: Option<u64>,
    ending: Option<Ending>,
    reading: Option<ReadToken>,
    /// A cache watch (its key is the cache's): what it follows.
    watch: Option<watch::WatchFilter>,
}

impl Sub {
    /// Whether a frame of `len` bytes would overflow the queue: `capacity` batches, or
    /// `bytes_max` bytes (an empty queue takes any one frame).
    fn full(&self, len: usize, bytes_max: usize) -> bool {
        self.queue.len() >= self.capacity || (!self.queue.is_empty() && self.queued_bytes + len > bytes_max)
    }

    fn push(&mut self, frame: [Bytes; 2]) {
        self.queued_bytes += frame_len(&frame);
        self.queue.push_back(frame);
    }
}

/// Bytes of an event frame held as header and body.
fn frame_len(frame: &[Bytes; 2]) -> usize {
    frame[0].len() + frame[1].len()
}

#[derive(Debug)]
struct Conn {
    streams: HashMap<StreamId, CtlStream>,
    subs: HashMap<u64, Sub>,
    opens: HashMap<OpenToken, u64>,
    /// Some stream of it authenticated. Until then it counts against the caps on
    /// unauthenticated connections.
    authenticated: bool,
    opened_at: Instant,
    peer: Option<PeerAddr>,
    next_sub: u64,
    /// Highest stream index the client opened, per direction. QUIC stream ids only grow, so a
    /// stream at or below it with no state here was closed: bytes for it are ignored rather
    /// than taken for a new, unauthenticated stream.
    max_bi: Option<u64>,
    max_uni: Option<u64>,
}

#[derive(Debug, Clone, Copy)]
enum Reply {
    None,
    Json(u64),
    /// JSON, and a refusal with a typed reason is `publish_refused` (idempotent and
    /// conditional publishes).
    Refusable(u64),
    Binary(u64),
}

#[derive(Debug)]
struct Waiter {
    conn: ConnId,
    stream: StreamId,
    seq: Option<u64>,
    reply: Reply,
    offer: ClientOffer,
}

#[derive(Debug)]
struct WriteCtx {
    key: Key,
    shard: u32,
    waiters: Vec<Waiter>,
    /// A system-log write: what to do once it settles.
    sys: Option<syslog::SysPending>,
    /// An idempotent batch's `(producer_id, sequence)`.
    producer: Option<(u64, u64)>,
}

/// A refusal, with everything needed to word it for any client.
#[derive(Debug, Clone)]
struct Refusal {
    code: ErrorCode,
    retry: RetryClass,
    message: String,
    detail: Option<ErrorDetail>,
    /// Ends the request stream after the answer.
    close_stream: bool,
    /// For requests answered with `publish_refused` (idempotent and conditional publishes): the
    /// typed reason.
    refused: Option<Box<message::RefusedReason>>,
}

impl Refusal {
    fn new(code: ErrorCode, message: impl Into<String>) -> Refusal {
        let retry = code.default_retry();
        Refusal { code, retry, message: message.into(), detail: None, close_stream: false, refused: None }
    }
    fn with_reason(mut self, reason: message::RefusedReason) -> Refusal {
        self.refused = Some(Box::new(reason));
        self
    }
    fn closing(mut self) -> Refusal {
        self.close_stream = true;
        self
    }
}

/// The broker state machine. See the module documentation for the driving contract.
#[derive(Debug)]
pub struct Broker {
    cfg: BrokerConfig,
    clock: Clock,
    wall: WallClock,
    conns: HashMap<ConnId, Conn>,
    /// Authentication deadlines of control streams, earliest first, so `poll_timeout` reads one
    /// entry instead of scanning every stream. Entries of streams that authenticated or went
    /// away are removed when that happens, or skipped when they come due.
    auth_deadlines: std::collections::BTreeSet<(Instant, ConnId, StreamId)>,
    /// Streams whose retention is by age (they need the once-a-second sweep).
    aged_streams: usize,
    next_conn: u64,
    streams: HashMap<Key, StreamEntry>,
    caches: HashMap<Key, Cache>,
    writes: HashMap<WriteToken, WriteCtx>,
    next_write: u64,
    next_open: u64,
    out: VecDeque<BrokerOutput>,
    stats: BrokerStats,
    server_flags: Flags,
    server_features: Features,
    next_sweep: Option<Instant>,
    reads: HashMap<ReadToken, ReadFor>,
    next_read: u64,
    /// Counters by cache, folded from their system logs.
    counters: HashMap<Key, syslog::Counters>,
    /// State of the random sequence (splitmix64), seeded from the configuration.
    rng: u64,
    /// Consumer groups by (stream, shard), then name.
    groups: HashMap<(Key, u32), HashMap<String, group::Group>>,
    /// Durable group operations since the last checkpoint, per `$groups` log.
    group_ops: HashMap<Key, u64>,
    next_poll: u64,
    /// Group wake-ups deferred until the control stream being handled is back in place.
    wakes: Vec<(Key, u32)>,
    /// Cache watches by cache.
    cache_watchers: HashMap<Key, Vec<(ConnId, u64)>>,
}

/// The group a consumer-group request names.
fn group_name(m: &Message) -> Option<&str> {
    Some(match m {
        Message::GroupPoll(p) => &p.group,
        Message::GroupAck(a) | Message::GroupDeadLetter(a) | Message::GroupDiscard(a) | Message::GroupRedrive(a) => {
            &a.group
        }
        Message::GroupNack(n) => &n.group,
        Message::GroupExtend(e) => &e.group,
        Message::GroupSeek(s) => &s.group,
        Message::GroupDeadLetters(r) | Message::GroupDescribe(r) | Message::GroupDelete(r) => &r.group,
        _ => return None,
    })
}

/// The longest tenant, namespace, stream, cache or group name, in bytes. Names become file
/// names (escaped: a byte outside `[A-Za-z0-9_.-]` takes three), so the escaped form must also
/// fit a file name with room for a system log's prefix.
pub const MAX_NAME_BYTES: usize = 200;
const MAX_ESCAPED_NAME: usize = 230;

fn check_names(names: &[(&str, &str)]) -> Result<(), Refusal> {
    for (what, name) in names {
        let escaped = crate::storage::path_component(name).len();
        if name.len() > MAX_NAME_BYTES || escaped > MAX_ESCAPED_NAME {
            return Err(Refusal::new(
                ErrorCode::InvalidRequest,
                format!(
                    "{what} name is {} bytes ({escaped} as a file name); the most is {MAX_NAME_BYTES} ({MAX_ESCAPED_NAME})",
                    name.len()
                ),
            ));
        }
    }
    Ok(())
}

fn key(t: &str, n: &str, s: &str) -> Key {
    (t.to_owned(), n.to_owned(), s.to_owned())
}

fn json_frame(m: &Message) -> Bytes {
    let mut b = BytesMut::new();
    // Every message this broker builds is plain data; encoding cannot fail. An empty frame would
    // be the visible symptom if it ever did.
    let _ = m.encode(&mut b);
    b.freeze()
}

impl Broker {
    /// A broker with `config`. `wall` anchors wall-clock time (record timestamps) to the
    /// monotonic time the driver passes in.
    pub fn new(config: BrokerConfig, wall: WallClock) -> Broker {
        let server_flags = config.server_flags();
        let server_features = config.server_features();
        let mut b = Broker {
            cfg: config,
            clock: Clock::new(),
            wall,
            conns: HashMap::new(),
            auth_deadlines: std::collections::BTreeSet::new(),
            aged_streams: 0,
            next_conn: 1,
            streams: HashMap::new(),
            caches: HashMap::new(),
            writes: HashMap::new(),
            next_write: 1,
            next_open: 1,
            out: VecDeque::new(),
            stats: BrokerStats::default(),
            server_flags,
            server_features,
            next_sweep: None,
            reads: HashMap::new(),
            next_read: 1,
            counters: HashMap::new(),
            rng: 0,
            groups: HashMap::new(),
            group_ops: HashMap::new(),
            next_poll: 1,
            wakes: Vec::new(),
            cache_watchers: HashMap::new(),
        };
        b.rng = b.cfg.random_seed;
        for s in b.cfg.streams.clone() {
            b.create_stream(key(&s.tenant_id, &s.namespace, &s.name), s.config);
        }
        let seed = wall.micros(wall.anchor());
        for c in b.cfg.caches.clone() {
            b.caches.insert(key(&c.tenant_id, &c.namespace, &c.name), Cache::with_version_seed(seed));
        }
        b
    }

    /// The configuration.
    pub fn config(&self) -> &BrokerConfig {
        &self.cfg
    }

    /// Counters.
    pub fn stats(&self) -> &BrokerStats {
        &self.stats
    }

    /// Number of open connections.
    pub fn connection_count(&self) -> usize {
        self.conns.len()
    }

    /// Control streams held, over every connection (a leak detector for drivers).
    pub fn control_stream_count(&self) -> usize {
        self.conns.values().map(|c| c.streams.len()).sum()
    }

    /// Number of subscriptions across connections.
    pub fn subscription_count(&self) -> usize {
        self.conns.values().map(|c| c.subs.len()).sum()
    }

    /// `(start, committed tail, next offset, retained records)` of a shard, if the stream exists.
    pub fn shard_state(&self, tenant: &str, ns: &str, stream: &str, shard: u32) -> Option<(u64, u64, u64, u64)> {
        let s = self.streams.get(&key(tenant, ns, stream))?.shards.get(shard as usize)?;
        Some((s.log.start(), s.log.committed_tail(), s.log.next_offset(), s.log.retained_records()))
    }

    /// Payload bytes of history every shard log holds in memory.
    pub fn retained_log_bytes(&self) -> u64 {
        self.streams.values().flat_map(|e| e.shards.iter()).map(|s| s.log.memory_bytes()).sum()
    }

    /// Bytes queued for subscribers and not yet handed to the driver (memory held by queues).
    pub fn queued_event_bytes(&self) -> usize {
        self.conns
            .values()
            .flat_map(|c| c.subs.values())
            .flat_map(|s| s.queue.iter())
            .map(|[a, b]| a.len() + b.len())
            .sum()
    }

    /// The next output, `None` when there is nothing to do.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<BrokerOutput> {
        self.out.pop_front()
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next: the earliest authentication
    /// deadline of a stream, or the next retention sweep (once a second while any stream retains
    /// by age).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let auth = self.auth_deadlines.first().map(|(d, _, _)| *d);
        let sweep = self.next_sweep.filter(|_| self.aged_streams > 0 || !self.caches.is_empty());
        [auth, sweep, self.groups_deadline()].into_iter().flatten().min()
    }

    /// Timers: ends control streams that did not authenticate in time (the connection stays:
    /// existing clients open pooled connections and authenticate a stream only when they first
    /// use it), applies retention.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock.advance(now);
        let mut expired = Vec::new();
        while let Some(&(d, conn, sid)) = self.auth_deadlines.first()
            && d <= now
        {
            self.auth_deadlines.pop_first();
            expired.push((conn, sid));
        }
        for (conn, sid) in expired {
            let Some(mut st) = self.conns.get_mut(&conn).and_then(|c| c.streams.remove(&sid)) else { continue };
            if st.auth_deadline.is_none() {
                // Authenticated since: put it back untouched.
                if let Some(c) = self.conns.get_mut(&conn) {
                    c.streams.insert(sid, st);
                }
                continue;
            }
            st.auth_deadline = None;
            if !st.closed {
                self.stats.auth_timeouts += 1;
                let r = Refusal::new(ErrorCode::Unauthenticated, "authentication timeout").closing();
                self.refuse(conn, &mut st, r);
                self.maybe_finish(conn, &mut st);
            }
            if let Some(c) = self.conns.get_mut(&conn) {
                c.streams.insert(sid, st);
            }
        }
        if self.next_sweep.is_none_or(|t| t <= now) {
            self.enforce_retention(None, now);
            self.cache_sweep(now);
            self.next_sweep = Some(crate::io::after(now, std::time::Duration::from_secs(1)));
        }
        self.groups_timeout(now);
    }

    /// Applies retention to every shard of `k` (or every stream when `None`), telling storage
    /// when a durable shard's start moved.
    fn enforce_retention(&mut self, only: Option<&Key>, now: Instant) {
        let now_micros = self.wall.micros(now);
        // In key order: the truncations it asks storage for come in the same order every run.
        let mut keys: Vec<Key> = match only {
            Some(k) => vec![k.clone()],
            None => self.streams.keys().cloned().collect(),
        };
        keys.sort_unstable();
        for k in &keys {
            let Some(entry) = self.streams.get_mut(k) else { continue };
            for (i, shard) in entry.shards.iter_mut().enumerate() {
                let before = shard.log.start();
                let after = shard.log.enforce_retention(now_micros);
                if after <= before {
                    continue;
                }
                let producers_forgotten = shard.producers.retain_from(after);
                if entry.config.durable {
                    self.out.push_back(BrokerOutput::Truncate {
                        tenant_id: k.0.clone(),
                        namespace: k.1.clone(),
                        stream: k.2.clone(),
                        shard: i as u32,
                        start: after,
                        producers_forgotten,
                    });
                }
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Connections and streams

    /// A client connected (from a peer the driver does not name: not counted against the
    /// per-peer cap). Returns its id.
    pub fn connection_opened(&mut self, now: Instant) -> ConnId {
        let now = self.clock.advance(now);
        self.open_conn(None, now)
    }

    /// A client wants to connect from `peer`: call before its handshake. It is admitted (its
    /// id is returned; report a failed handshake with [`connection_closed`](Self::connection_closed))
    /// unless that would pass the caps on connections that authenticated no stream yet:
    /// * per peer (`max_unauthenticated_per_peer`): refused;
    /// * in all (`max_unauthenticated_connections`): the oldest unauthenticated connection that
    ///   has been so for longer than `auth_timeout` is closed (code 1) to make room, or, if none
    ///   has, the new one is refused.
    ///
    /// Authenticated connections never count, so a flood of idle connections cannot crowd out
    /// clients that authenticate.
    ///
    /// # Errors
    /// [`AdmitError`] naming the cap; refuse the connection in the handshake.
    pub fn admit(&mut self, peer: PeerAddr, now: Instant) -> Result<ConnId, AdmitError> {
        let now = self.clock.advance(now);
        let unauth = |c: &&Conn| !c.authenticated;
        let from_peer = self.conns.values().filter(unauth).filter(|c| c.peer == Some(peer)).count();
        if from_peer >= self.cfg.max_unauthenticated_per_peer {
            self.stats.connections_refused += 1;
            return Err(AdmitError::TooManyFromPeer { max: self.cfg.max_unauthenticated_per_peer });
        }
        if self.unauthenticated_connections() >= self.cfg.max_unauthenticated_connections {
            let stale = self
                .conns
                .iter()
                .filter(|(_, c)| !c.authenticated && crate::io::after(c.opened_at, self.cfg.auth_timeout) <= now)
                .min_by_key(|(id, c)| (c.opened_at, **id))
                .map(|(id, _)| *id);
            let Some(old) = stale else {
                self.stats.connections_refused += 1;
                return Err(AdmitError::TooManyUnauthenticated { max: self.cfg.max_unauthenticated_connections });
            };
            self.stats.connections_evicted += 1;
            self.out.push_back(BrokerOutput::CloseConnection {
                conn: old,
                code: close_code::AUTH_TIMEOUT,
                reason: "unauthenticated for too long while others wait".into(),
            });
            self.drop_conn(old);
        }
        Ok(self.open_conn(Some(peer), now))
    }

    fn open_conn(&mut self, peer: Option<PeerAddr>, now: Instant) -> ConnId {
        self.next_sweep.get_or_insert(crate::io::after(now, std::time::Duration::from_secs(1)));
        let id = ConnId(self.next_conn);
        self.next_conn += 1;
        self.stats.connections_opened += 1;
        self.conns.insert(
            id,
            Conn {
                streams: HashMap::new(),
                subs: HashMap::new(),
                opens: HashMap::new(),
                authenticated: false,
                opened_at: now,
                peer,
                next_sub: 1,
                max_bi: None,
                max_uni: None,
            },
        );
        id
    }

    /// Connections none of whose streams authenticated yet.
    pub fn unauthenticated_connections(&self) -> usize {
        self.conns.values().filter(|c| !c.authenticated).count()
    }

    /// The connection is gone (closed by either side or lost). Its subscriptions end.
    pub fn connection_closed(&mut self, conn: ConnId, now: Instant) {
        self.clock.advance(now);
        self.drop_conn(conn);
    }

    fn drop_conn(&mut self, conn: ConnId) {
        if let Some(c) = self.conns.remove(&conn) {
            for (sid, st) in &c.streams {
                if let Some(d) = st.auth_deadline {
                    self.auth_deadlines.remove(&(d, conn, *sid));
                }
            }
            for sub in c.subs.values() {
                self.unlink_sub(conn, sub);
            }
        }
    }

    fn unlink_sub(&mut self, conn: ConnId, sub: &Sub) {
        if sub.watch.is_some() {
            if let Some(w) = self.cache_watchers.get_mut(&sub.key) {
                w.retain(|(c, id)| !(*c == conn && *id == sub.id));
            }
            return;
        }
        if let Some(shard) = self.streams.get_mut(&sub.key).and_then(|e| e.shards.get_mut(sub.shard as usize)) {
            shard.subs.retain(|(c, id)| !(*c == conn && *id == sub.id));
        }
    }

    /// Bytes arrived on a stream the client opened (bidirectional control stream or
    /// unidirectional publish stream). `fin` says the client finished it.
    pub fn handle_stream_data(&mut self, conn: ConnId, stream: StreamId, data: Bytes, fin: bool, now: Instant) {
        self.handle_stream_chunks(conn, stream, std::iter::once(data), fin, now);
    }

    /// [`handle_stream_data`](Self::handle_stream_data) for several chunks that arrived
    /// together, in order: the stream is looked up and driven once for all of them (a busy
    /// stream hands over dozens of packet-sized chunks at a time).
    pub fn handle_stream_chunks<I>(&mut self, conn: ConnId, stream: StreamId, chunks: I, fin: bool, now: Instant)
    where
        I: IntoIterator<Item = Bytes>,
    {
        let now = self.clock.advance(now);
        let preauth = self.cfg.preauth_max_frame_len;
        let auth_timeout = self.cfg.auth_timeout;
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if stream.initiator() != Side::Client {
            // Our own event streams are unidirectional: a client cannot send on them.
            return;
        }
        if !c.streams.contains_key(&stream) {
            let max = if stream.dir() == Dir::Bi { &mut c.max_bi } else { &mut c.max_uni };
            if max.is_some_and(|m| stream.index() <= m) {
                return; // a stream that was closed
            }
            *max = Some(stream.index());
        }
        let auth_deadlines = &mut self.auth_deadlines;
        let st = c.streams.entry(stream).or_insert_with(|| {
            let deadline = crate::io::after(now, auth_timeout);
            auth_deadlines.insert((deadline, conn, stream));
            let mut decoder = FrameDecoder::new();
            decoder.set_max_frame_len(preauth);
            decoder.set_accepted_flags(Flags::CLIENT_SENDS);
            CtlStream {
                id: stream,
                uni: stream.dir() == Dir::Uni,
                decoder,
                session: None,
                owed: VecDeque::new(),
                next_seq: 0,
                outstanding: 0,
                paused: false,
                storage_paused: false,
                flush_paused: false,
                unflushed: 0,
                fin_recv: false,
                closed: false,
                send_finished: false,
                auth_deadline: Some(deadline),
                held: VecDeque::new(),
            }
        });
        if st.closed {
            return;
        }
        for data in chunks {
            st.decoder.push(data);
        }
        st.fin_recv |= fin;
        self.drive_stream(conn, stream, now);
        self.run_wakes(now);
    }

    /// The client reset its sending side of `stream`: drop what was buffered for it.
    pub fn handle_stream_reset(&mut self, conn: ConnId, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        if let Some(c) = self.conns.get_mut(&conn)
            && let Some(st) = c.streams.get_mut(&stream)
        {
            st.closed = true;
            st.decoder = FrameDecoder::new();
            if st.outstanding == 0 {
                c.streams.remove(&stream);
            }
        }
    }

    /// The client asked us to stop sending on `stream`. On an event stream that ends the
    /// subscription (this is how a client unsubscribes).
    pub fn handle_stream_stopped(&mut self, conn: ConnId, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let sub_id = c.subs.values().find(|s| s.stream == Some(stream)).map(|s| s.id);
        if let Some(id) = sub_id {
            if let Some(sub) = c.subs.remove(&id) {
                self.unlink_sub(conn, &sub);
            }
        } else if let Some(st) = c.streams.get_mut(&stream) {
            st.send_finished = true;
        }
    }

    /// The driver opened the unidirectional stream asked for with `token`.
    pub fn handle_stream_opened(&mut self, conn: ConnId, token: OpenToken, stream: StreamId, now: Instant) {
        self.clock.advance(now);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        let Some(sub_id) = c.opens.remove(&token) else { return };
        let Some(sub) = c.subs.get_mut(&sub_id) else {
            // The subscription ended before its stream opened: close the stream at once.
            self.out.push_back(BrokerOutput::Finish { conn, stream });
            return;
        };
        sub.stream = Some(stream);
        let hello = json_frame(&Message::EventStreamHello(message::EventStreamHello { subscription_id: sub.id }));
        sub.inflight += hello.len();
        self.out.push_back(BrokerOutput::Transmit { conn, stream, data: hello });
        self.pump(conn, sub_id);
    }

    /// The driver finished writing `bytes` previously transmitted on `stream` (event streams
    /// only): the writer credit comes back and more queued batches are written.
    pub fn handle_stream_flushed(&mut self, conn: ConnId, stream: StreamId, bytes: usize, now: Instant) {
        let now = self.clock.advance(now);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if let Some(st) = c.streams.get_mut(&stream) {
            // A control stream: its answers were read.
            st.unflushed = st.unflushed.saturating_sub(bytes);
            if st.flush_paused && st.unflushed <= self.cfg.control_stream_unflushed_bytes / 2 {
                st.flush_paused = false;
                if !st.paused && !st.storage_paused {
                    self.out.push_back(BrokerOutput::ResumeReading { conn, stream });
                    self.drive_stream(conn, stream, now);
                    self.run_wakes(now);
                }
            }
            return;
        }
        let Some(sub) = c.subs.values_mut().find(|s| s.stream == Some(stream)) else { return };
        sub.inflight = sub.inflight.saturating_sub(bytes);
        let id = sub.id;
        self.pump(conn, id);
    }

    fn drive_stream(&mut self, conn: ConnId, sid: StreamId, now: Instant) {
        let Some(mut st) = self.conns.get_mut(&conn).and_then(|c| c.streams.remove(&sid)) else { return };
        loop {
            if st.paused || st.storage_paused || st.flush_paused || st.closed {
                break;
            }
            match st.decoder.next_frame() {
                Ok(Some(frame)) => {
                    self.stats.frames_in += 1;
                    self.handle_frame(conn, &mut st, frame, now);
                    if !self.conns.contains_key(&conn) {
                        return; // the frame closed the connection
                    }
                }
                Ok(None) => break,
                Err(FrameError::Flags { error, payload }) => self.reject_flags(conn, &mut st, error, &payload),
                Err(e) => {
                    // Bad magic, bad version, oversized frame: the byte stream cannot be
                    // trusted any more. Close the connection (decision D10).
                    self.stats.protocol_violations += 1;
                    self.out.push_back(BrokerOutput::CloseConnection {
                        conn,
                        code: close_code::PROTOCOL_VIOLATION,
                        reason: e.to_string(),
                    });
                    self.drop_conn(conn);
                    return;
                }
            }
        }
        if st.fin_recv
            && !st.paused
            && !st.storage_paused
            && !st.flush_paused
            && !st.closed
            && st.decoder.finish().is_err()
        {
            // The client finished the stream inside a frame: nothing more can come.
            st.closed = true;
        }
        self.maybe_finish(conn, &mut st);
        let keep = !(st.send_finished && st.outstanding == 0);
        if let Some(c) = self.conns.get_mut(&conn)
            && keep
        {
            c.streams.insert(sid, st);
        }
    }

    /// Finishes our side of a control stream once the client finished and every answer owed on
    /// it is written.
    fn maybe_finish(&mut self, conn: ConnId, st: &mut CtlStream) {
        let drained = st.decoder.buffered() == 0 || st.closed;
        if (st.fin_recv || st.closed) && drained && st.outstanding == 0 && !st.send_finished {
            st.send_finished = true;
            if !st.uni {
                self.out.push_back(BrokerOutput::Finish { conn, stream: st.id });
            }
        }
    }

    /// Ends a request stream after an answer: finish our side, stop reading theirs.
    fn close_stream(&mut self, conn: ConnId, st: &mut CtlStream) {
        if st.closed {
            return;
        }
        st.closed = true;
        self.out.push_back(BrokerOutput::StopSending { conn, stream: st.id, code: close_code::STREAM_CLOSED });
    }

    // -----------------------------------------------------------------------------------------
    // Answers

    fn features_of(st: &CtlStream) -> ClientOffer {
        st.session.as_ref().map_or(
            ClientOffer { negotiating: false, flags: Flags::ORIGINAL_V1, features: Features::NONE, extended: false },
            |s| s.offer,
        )
    }

    fn error_message(offer: &ClientOffer, r: &Refusal) -> Message {
        let codes = offer.has(Features::ERROR_CODES);
        Message::Error(message::ErrorMsg {
            message: r.message.clone(),
            code: codes.then(|| r.code.clone()),
            retry: codes.then_some(r.retry),
            detail: r.detail.clone().filter(|_| codes),
        })
    }

    fn publish_answer(offer: &ClientOffer, reply: Reply, result: Result<Option<u64>, &Refusal>) -> Option<Bytes> {
        match reply {
            Reply::None => None,
            Reply::Refusable(request_id) if result.is_err_and(|r| r.refused.is_some()) => {
                let r = result.err()?;
                let reason = *r.refused.clone()?;
                Some(json_frame(&Message::PublishRefused(message::PublishRefused {
                    request_id,
                    reason,
                    message: r.message.clone(),
                })))
            }
            Reply::Json(request_id) | Reply::Refusable(request_id) => {
                let m = match result {
                    Ok(offset) => Message::PublishOk(message::PublishOk {
                        request_id,
                        offset: offset.filter(|_| offer.offered(Flags::BINARY_PUBLISH_ACK_OFFSET)),
                    }),
                    Err(r) => {
                        let codes = offer.has(Features::ERROR_CODES);
                        Message::PublishError(message::PublishError {
                            request_id,
                            message: r.message.clone(),
                            code: codes.then(|| r.code.clone()),
                            retry: codes.then_some(r.retry),
                            detail: r.detail.clone().filter(|_| codes),
                        })
                    }
                };
                Some(json_frame(&m))
            }
            Reply::Binary(request_id) => {
                let ack = match result {
                    Ok(offset) => PublishAck::ok(request_id, offset),
                    Err(r) => {
                        let mut a = PublishAck::error(request_id, r.message.clone(), r.code.clone(), r.retry);
                        a.detail = r.detail.clone();
                        a
                    }
                };
                let mut b = BytesMut::new();
                // Strings were checked on the way in; the message is cut to fit if needed.
                let _ = ack.encode(offer.flags, &mut b);
                Some(b.freeze())
            }
        }
    }

    /// Sends a non-publish answer (never held back by the pipeline).
    fn send(&mut self, conn: ConnId, st: &mut CtlStream, data: Bytes) {
        if st.uni || st.send_finished {
            return;
        }
        if st.held.is_empty() {
            Self::count_unflushed(&mut self.out, self.cfg.control_stream_unflushed_bytes, conn, st, data.len());
            self.out.push_back(BrokerOutput::Transmit { conn, stream: st.id, data });
        } else {
            st.held.push_back(Held::Ready(data));
        }
    }

    /// Counts answer bytes handed to the driver; past the limit, stops reading the stream's
    /// requests until the client reads what it was sent.
    fn count_unflushed(out: &mut VecDeque<BrokerOutput>, limit: usize, conn: ConnId, st: &mut CtlStream, n: usize) {
        st.unflushed += n;
        if st.unflushed > limit && !st.flush_paused {
            st.flush_paused = true;
            out.push_back(BrokerOutput::PauseReading { conn, stream: st.id });
        }
    }

    /// Fills the held slot `slot` of a control stream with its answer, writes whatever is now
    /// ready in order, and finishes the stream if that was the last thing owed on it.
    fn fill_held(&mut self, conn: ConnId, stream: StreamId, slot: HeldFor, data: Bytes) {
        let Some(mut st) = self.conns.get_mut(&conn).and_then(|c| c.streams.remove(&stream)) else { return };
        if let Some(h) = st.held.iter_mut().find(|h| matches!(h, Held::Waiting(t) if *t == slot)) {
            *h = Held::Ready(data);
        }
        st.outstanding = st.outstanding.saturating_sub(1);
        Self::release_held(&mut self.out, conn, &mut st);
        self.maybe_finish(conn, &mut st);
        let keep = !(st.send_finished && st.outstanding == 0);
        if let Some(c) = self.conns.get_mut(&conn)
            && keep
        {
            c.streams.insert(stream, st);
        }
    }

    /// Reserves an answer slot that later answers on the stream wait behind.
    fn hold(st: &mut CtlStream, slot: HeldFor) {
        st.held.push_back(Held::Waiting(slot));
        st.outstanding += 1;
    }

    /// Writes the held answers that are ready, in order, up to the first still waiting.
    fn release_held(out: &mut VecDeque<BrokerOutput>, conn: ConnId, st: &mut CtlStream) {
        while let Some(Held::Ready(_)) = st.held.front() {
            if let Some(Held::Ready(data)) = st.held.pop_front()
                && !st.send_finished
            {
                st.unflushed += data.len();
                out.push_back(BrokerOutput::Transmit { conn, stream: st.id, data });
            }
        }
    }

    fn refuse(&mut self, conn: ConnId, st: &mut CtlStream, r: Refusal) {
        let m = Self::error_message(&Self::features_of(st), &r);
        self.send(conn, st, json_frame(&m));
        if r.close_stream {
            self.close_stream(conn, st);
        }
    }

    /// Reserves the answer slot of an owed publish (pipelined streams answer in order).
    fn owe(&mut self, conn: ConnId, st: &mut CtlStream, reply: Reply) -> Option<u64> {
        if matches!(reply, Reply::None) {
            return None;
        }
        st.outstanding += 1;
        let window = st.session.as_ref().and_then(|s| s.window)?;
        let seq = st.next_seq;
        st.next_seq += 1;
        st.owed.push_back(Owed { seq, answer: None });
        if st.owed.len() >= window as usize && !st.paused {
            st.paused = true;
            self.out.push_back(BrokerOutput::PauseReading { conn, stream: st.id });
        }
        Some(seq)
    }

    /// Delivers an owed publish answer: at once, or in order behind earlier ones when the
    /// stream is pipelined. Returns whether the stream should be driven again (it was paused
    /// and has room now).
    fn deliver_answer(&mut self, conn: ConnId, st: &mut CtlStream, seq: Option<u64>, data: Option<Bytes>) -> bool {
        st.outstanding = st.outstanding.saturating_sub(1);
        self.stats.acks_sent += u64::from(data.is_some());
        match seq {
            None => {
                if let Some(d) = data {
                    self.send(conn, st, d);
                }
                false
            }
            Some(seq) => {
                if let Some(o) = st.owed.iter_mut().find(|o| o.seq == seq) {
                    o.answer = Some(data.unwrap_or_default());
                }
                while st.owed.front().is_some_and(|o| o.answer.is_some()) {
                    let o = st.owed.pop_front().expect("front exists");
                    if let Some(d) = o.answer.filter(|d| !d.is_empty()) {
                        self.send(conn, st, d);
                    }
                }
                let window = st.session.as_ref().and_then(|s| s.window).unwrap_or(u32::MAX) as usize;
                if st.paused && st.owed.len() < window {
                    st.paused = false;
                    if !st.storage_paused && !st.flush_paused {
                        self.out.push_back(BrokerOutput::ResumeReading { conn, stream: st.id });
                    }
                    return true;
                }
                false
            }
        }
    }

    // -----------------------------------------------------------------------------------------
    // Frames

    fn reject_flags(&mut self, conn: ConnId, st: &mut CtlStream, error: FlagError, payload: &[u8]) {
        let flags = match error {
            FlagError::Unknown { flags, .. }
            | FlagError::ConflictingKinds { flags }
            | FlagError::MissingBase { flags, .. }
            | FlagError::NotNegotiated { flags, .. } => Flags(flags),
        };
        let r = Refusal::new(ErrorCode::InvalidRequest, "unsupported frame flags");
        if st.session.is_none() {
            return self.refuse(conn, st, Refusal::new(ErrorCode::Unauthenticated, "authenticate first").closing());
        }
        // Decision D7: an acked publish is answered with its request id whatever else is wrong.
        match PublishBatch::peek_request_id(flags, payload) {
            Some(request_id) => {
                let offer = Self::features_of(st);
                let seq = self.owe(conn, st, Reply::Binary(request_id));
                let data = Self::publish_answer(&offer, Reply::Binary(request_id), Err(&r));
                self.deliver_answer(conn, st, seq, data);
            }
            None => self.refuse(conn, st, r),
        }
    }

    fn handle_frame(&mut self, conn: ConnId, st: &mut CtlStream, frame: Frame, now: Instant) {
        if st.session.is_none() {
            return self.handle_preauth(conn, st, frame, now);
        }
        match PayloadKind::of(frame.flags) {
            Some(PayloadKind::Json) => {
                self.stats.frames_in_json += 1;
                match message::decode(&frame.payload) {
                    Ok(Decoded::Message(m)) => self.handle_message(conn, st, m, now),
                    Ok(Decoded::Unknown(u)) => self.handle_unknown(conn, st, &u.type_name, u.request_id, None),
                    Err(e) => {
                        // JSON that does not decode is fatal to the stream (decision D16).
                        self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, e.to_string()).closing());
                    }
                }
            }
            Some(PayloadKind::Publish) => {
                self.stats.frames_in_binary += 1;
                self.handle_binary_publish(conn, st, frame, now)
            }
            // The decoder accepts only client-sendable flags, so nothing else reaches here.
            _ => self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, "unexpected frame kind").closing()),
        }
    }

    fn handle_preauth(&mut self, conn: ConnId, st: &mut CtlStream, frame: Frame, now: Instant) {
        if !frame.flags.is_empty() {
            // A binary publish before auth: refused and the stream ends.
            return self.refuse(conn, st, Refusal::new(ErrorCode::Unauthenticated, "authenticate first").closing());
        }
        match message::decode(&frame.payload) {
            Ok(Decoded::Message(Message::Auth(a))) => self.handle_auth(conn, st, a, now),
            Ok(_) => self.refuse(conn, st, Refusal::new(ErrorCode::Unauthenticated, "authenticate first")),
            Err(e) => self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, e.to_string()).closing()),
        }
    }

    fn handle_auth(&mut self, conn: ConnId, st: &mut CtlStream, a: message::Auth, _now: Instant) {
        let offer = ClientOffer::from_auth(&a);
        let found = self
            .cfg
            .tokens
            .iter()
            .position(|t| t.token == a.token && t.tenant_id.as_ref().is_none_or(|tt| *tt == a.tenant_id));
        let Some(token) = found else {
            // The broker reads the feature offer before answering, so even a refused auth
            // carries a code for a client that offered it.
            let r = Refusal::new(ErrorCode::Unauthenticated, "invalid token").closing();
            let m = Self::error_message(&offer, &r);
            self.send(conn, st, json_frame(&m));
            return self.close_stream(conn, st);
        };
        let grant = &self.cfg.tokens[token];
        let mut principal = grant.principal.clone().into_bytes();
        principal.truncate(255);
        let window =
            (offer.has(Features::PUBLISH_PIPELINE) && self.cfg.publish_window > 0).then_some(self.cfg.publish_window);
        let ack_on_commit = self.cfg.ack_on_commit || offer.has(Features::ACK_ON_COMMIT);
        st.session = Some(Session {
            tenant_id: a.tenant_id,
            principal: Bytes::from(principal),
            token,
            offer,
            window,
            ack_on_commit,
            widths: HashMap::new(),
        });
        st.decoder.set_max_frame_len(self.cfg.max_frame_len);
        st.decoder.set_accepted_flags(Flags::CLIENT_SENDS.intersection(self.server_flags));
        if let Some(d) = st.auth_deadline.take() {
            self.auth_deadlines.remove(&(d, conn, st.id));
        }
        if let Some(c) = self.conns.get_mut(&conn) {
            c.authenticated = true;
        }
        let answer = match broker_answer(&offer, self.server_flags, self.server_features, self.cfg.publish_window) {
            Some(ok) => Message::AuthOk(ok),
            None => Message::Ok(message::OkMsg {}),
        };
        self.send(conn, st, json_frame(&answer));
    }

    fn handle_unknown(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        type_name: &str,
        request_id: Option<u64>,
        extension: Option<String>,
    ) {
        let offer = Self::features_of(st);
        if offer.has(Features::UNSUPPORTED) && self.server_features.contains(Features::UNSUPPORTED) {
            let m = Message::Unsupported(message::Unsupported {
                request_type: type_name.to_owned(),
                request_id,
                extension,
            });
            self.send(conn, st, json_frame(&m));
        } else {
            // The old behaviour: the stream is closed.
            self.send_finish_and_stop(conn, st);
        }
    }

    fn send_finish_and_stop(&mut self, conn: ConnId, st: &mut CtlStream) {
        self.close_stream(conn, st);
    }

    fn handle_message(&mut self, conn: ConnId, st: &mut CtlStream, m: Message, now: Instant) {
        if let Some(g) = group_name(&m)
            && let Err(r) = check_names(&[("group", g)])
        {
            return self.refuse(conn, st, r);
        }
        if st.uni && !matches!(m, Message::Publish(_) | Message::PublishBatch(_) | Message::PublishWidth(_)) {
            // A publish-only stream carries publishes only; anything else closes it.
            return self.close_stream(conn, st);
        }
        match m {
            Message::Auth(_) => self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, "already authenticated")),
            // A single publish is a batch of one.
            Message::Publish(p) => {
                let batch = message::PublishBatchMsg {
                    tenant_id: p.tenant_id,
                    namespace: p.namespace,
                    stream: p.stream,
                    payloads: vec![p.payload],
                    key: p.key,
                    shard: p.shard,
                    request_id: p.request_id,
                    ack: p.ack,
                    publish_width: p.publish_width,
                };
                self.publish_json(conn, st, batch, now);
            }
            Message::PublishBatch(p) => self.publish_json(conn, st, p, now),
            Message::PublishWidth(w) => {
                if let Some(s) = st.session.as_mut() {
                    s.widths.insert(key(&w.tenant_id, &w.namespace, &w.stream), w.width);
                }
            }
            Message::Subscribe(s) => self.subscribe(conn, st, s, now),
            Message::CachePut(p) => self.cache_put(conn, st, p, now),
            Message::CacheGet(g) => self.cache_get(conn, st, g, now),
            Message::CacheDelete(d) => self.cache_delete(conn, st, d, now),
            Message::CachePutIf(p) => self.cache_put_if(conn, st, p, now),
            Message::CacheDeleteIf(d) => self.cache_delete_if(conn, st, d, now),
            Message::StreamRead(r) => self.stream_read(conn, st, r),
            Message::CacheWatch(w) if self.server_features.contains(Features::CACHE_WATCH) => {
                self.cache_watch(conn, st, w, now)
            }
            Message::ProducerInit(p) => {
                let producer_id = self.random();
                let m = Message::ProducerInitOk(message::ProducerInitOk { request_id: p.request_id, producer_id });
                self.send(conn, st, json_frame(&m));
            }
            Message::PublishIdempotent(p) => {
                self.stats.publishes_json += 1;
                let req = PublishReq {
                    idempotent: Some((p.producer_id, p.sequence)),
                    ..PublishReq::json(p.tenant_id, p.namespace, p.stream, p.payloads, p.key, None, p.publish_width)
                };
                self.publish(conn, st, req, Reply::Refusable(p.request_id), now);
            }
            Message::PublishIf(p) => {
                self.stats.publishes_json += 1;
                let req = PublishReq {
                    expected_offset: Some(p.expected_offset),
                    ..PublishReq::json(p.tenant_id, p.namespace, p.stream, p.payloads, p.key, p.shard, p.publish_width)
                };
                self.publish(conn, st, req, Reply::Refusable(p.request_id), now);
            }
            Message::CounterAdd(a) if self.server_features.contains(Features::COUNTERS) => {
                self.counter_add(conn, st, a, now)
            }
            Message::CounterGet(g) if self.server_features.contains(Features::COUNTERS) => {
                self.counter_get(conn, st, g)
            }
            Message::GroupPoll(p) if self.serves_groups() => self.group_poll(conn, st, p, now),
            Message::GroupAck(a) if self.serves_groups() => self.group_ack(conn, st, a, now),
            Message::GroupNack(n) if self.serves_groups() => self.group_nack(conn, st, n, now),
            Message::GroupExtend(e) if self.serves_groups() => self.group_extend(conn, st, e, now),
            Message::GroupDeadLetter(a) if self.serves_groups() => self.group_dead_letter(conn, st, a, now),
            Message::GroupDeadLetters(r) if self.serves_groups() => self.group_dead_letters(conn, st, r),
            Message::GroupDiscard(a) if self.serves_groups() => self.group_dead_letter_op(conn, st, a, false, now),
            Message::GroupRedrive(a) if self.serves_groups() => self.group_dead_letter_op(conn, st, a, true, now),
            Message::GroupSeek(q) if self.serves_groups() => self.group_seek(conn, st, q, now),
            Message::GroupDescribe(r) if self.serves_groups() => self.group_describe(conn, st, r),
            Message::GroupDelete(r) if self.serves_groups() => self.group_delete(conn, st, r, now),
            Message::OffsetForTime(q) => self.offset_for_time(conn, st, q),
            Message::StreamShards(q) => {
                let shards =
                    self.lookup_stream(st, &q.tenant_id, &q.namespace, &q.stream, Action::Subscribe).map_or(0, |e| e);
                let routing = self
                    .streams
                    .get(&key(&q.tenant_id, &q.namespace, &q.stream))
                    .map(|e| e.config.routing)
                    .filter(|r| *r == message::Routing::JumpHash);
                let m =
                    Message::StreamShardsView(message::StreamShardsView { shards, request_id: q.request_id, routing });
                self.send(conn, st, json_frame(&m));
            }
            Message::CacheShards(q) => {
                let known = self.caches.contains_key(&key(&q.tenant_id, &q.namespace, &q.cache));
                let m = Message::CacheShardsView(message::CacheShardsView {
                    shards: u32::from(known),
                    request_id: q.request_id,
                });
                self.send(conn, st, json_frame(&m));
            }
            Message::Extension(e) => self.handle_unknown(conn, st, "extension", Some(e.request_id), Some(e.name)),
            Message::Error(_) => self.close_stream(conn, st),
            other if other.direction() == Direction::ToClient => self.refuse(
                conn,
                st,
                Refusal::new(ErrorCode::InvalidRequest, format!("unexpected message type {}", other.type_name()))
                    .closing(),
            ),
            // A request of the catalogue this broker does not serve (it does not advertise its
            // feature bit): answered like an unknown type.
            other => {
                let rid = other.request_id();
                self.handle_unknown(conn, st, other.type_name(), rid, None)
            }
        }
    }

    /// The next number of the broker's random sequence (splitmix64 over the configured seed).
    fn random(&mut self) -> u64 {
        self.rng = self.rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.rng;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    // -----------------------------------------------------------------------------------------
    // Streams and permissions

    fn create_stream(&mut self, k: Key, config: StreamConfig) -> u32 {
        let shards = config.shards.max(1);
        let budget = (config.durable && self.cfg.history_reads).then_some(config.memory_bytes);
        let entry = StreamEntry {
            shards: (0..shards)
                .map(|_| {
                    let mut log = ShardLog::new(config.durable, config.retention);
                    log.set_memory_budget(budget);
                    Shard {
                        log,
                        subs: Vec::new(),
                        moved: None,
                        paused: Vec::new(),
                        producers: Default::default(),
                        full: None,
                    }
                })
                .collect(),
            config,
        };
        self.aged_streams += usize::from(entry.config.retention.max_age.is_some());
        if let Some(old) = self.streams.insert(k, entry) {
            self.aged_streams -= usize::from(old.config.retention.max_age.is_some());
        }
        shards
    }

    /// Whether the stream's credential may do `action` on `t`'s `ns/name`.
    fn authorize(&self, st: &CtlStream, t: &str, ns: &str, name: &str, action: Action) -> Result<(), Refusal> {
        let Some(sess) = st.session.as_ref() else {
            return Err(Refusal::new(ErrorCode::Unauthenticated, "authenticate first"));
        };
        if sess.tenant_id != t {
            return Err(Refusal::new(ErrorCode::Forbidden, format!("token is not valid for tenant {t}")));
        }
        if !self.cfg.tokens[sess.token].allows(action, ns, name) {
            return Err(Refusal::new(ErrorCode::Forbidden, format!("not allowed to {} {ns}/{name}", action.name())));
        }
        Ok(())
    }

    /// Checks tenant and permission, then finds (or auto-creates) the stream. Returns its shard
    /// count.
    fn lookup_stream(&mut self, st: &CtlStream, t: &str, ns: &str, s: &str, action: Action) -> Result<u32, Refusal> {
        check_names(&[("tenant", t), ("namespace", ns), ("stream", s)])?;
        self.authorize(st, t, ns, s, action)?;
        if s.starts_with(syslog::SYS_PREFIX) {
            return Err(Refusal::new(
                ErrorCode::InvalidRequest,
                format!("stream names starting with {} are reserved for the broker", syslog::SYS_PREFIX),
            ));
        }
        let k = key(t, ns, s);
        if let Some(e) = self.streams.get(&k) {
            return Ok(e.shards.len() as u32);
        }
        if self.cfg.auto_create {
            let cfg = self.cfg.default_stream.clone();
            return Ok(self.create_stream(k, cfg));
        }
        Err(Refusal::new(ErrorCode::NotFound, format!("stream {ns}/{s} not found")))
    }

    // -----------------------------------------------------------------------------------------
    // Publishing

    fn publish_json(&mut self, conn: ConnId, st: &mut CtlStream, p: message::PublishBatchMsg, now: Instant) {
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

    fn handle_binary_publish(&mut self, conn: ConnId, st: &mut CtlStream, frame: Frame, now: Instant) {
        self.stats.publishes_binary += 1;
        let reply = match PublishBatch::peek_request_id(frame.flags, &frame.payload) {
            Some(id) if frame.flags.contains(Flags::BINARY_PUBLISH_IDEMPOTENT) => Reply::Refusable(id),
            Some(id) => Reply::Binary(id),
            None => Reply::None,
        };
        match PublishBatch::decode(frame.flags, frame.payload) {
            Ok(b) => {
                let width = b.key.as_ref().and_then(|_| {
                    st.session.as_ref().and_then(|s| s.widths.get(&key(&b.tenant_id, &b.namespace, &b.stream)).copied())
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

    fn answer_now(&mut self, conn: ConnId, st: &mut CtlStream, reply: Reply, result: Result<Option<u64>, &Refusal>) {
        let offer = Self::features_of(st);
        let seq = self.owe(conn, st, reply);
        let data = Self::publish_answer(&offer, reply, result);
        if !matches!(reply, Reply::None) {
            self.deliver_answer(conn, st, seq, data);
        }
    }

    fn publish(&mut self, conn: ConnId, st: &mut CtlStream, req: PublishReq, reply: Reply, now: Instant) {
        let routed = self.route(st, &req);
        let (shard, durable) = match routed {
            Ok(v) => v,
            Err(r) => {
                self.stats.publishes_refused += 1;
                if matches!(reply, Reply::None) {
                    self.stats.unacked_failures += 1; // decision D5: counted, not answered
                    return;
                }
                return self.answer_now(conn, st, reply, Err(&r));
            }
        };
        let k = key(&req.tenant_id, &req.namespace, &req.stream);
        // A shard whose storage is full writes nothing and acknowledges nothing on enqueue; one
        // publish a second goes through as a probe, answered after its write.
        let mut probe = false;
        if let Some(sh) = self.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard as usize))
            && let Some(next) = sh.full
        {
            if now < next {
                self.stats.publishes_refused += 1;
                if matches!(reply, Reply::None) {
                    self.stats.unacked_failures += 1;
                    return;
                }
                let mut r = Refusal::new(ErrorCode::Overloaded, "storage is full: nothing was written");
                r.detail = Some(ErrorDetail {
                    reason: Some("storage_full".into()),
                    retry_after_ms: Some(next.saturating_duration_since(now).as_millis().max(1) as u64),
                });
                return self.answer_now(conn, st, reply, Err(&r));
            }
            sh.full = Some(crate::io::after(now, FULL_PROBE_INTERVAL));
            probe = true;
        }
        let sess = st.session.as_ref().expect("route checked the session");
        let offer = sess.offer;
        let publisher = Some(sess.principal.clone()).filter(|p| !p.is_empty());
        // Idempotent and conditional batches are answered after the write, with the offset.
        let ack_on_commit = sess.ack_on_commit || probe || req.idempotent.is_some() || req.expected_offset.is_some();
        let digest = req.idempotent.map(|_| producer::digest(req.records.raw()));
        if let Some(verdict) = self.precheck(conn, st, &k, shard, durable, &req, digest, reply) {
            return verdict;
        }
        let count = u64::from(req.records.count());
        self.stats.records_appended += count;
        let ts = self.wall.micros(now);
        if !durable {
            let entry = self.streams.get_mut(&k).expect("routed stream exists");
            let sh = &mut entry.shards[shard as usize];
            let (base, batch) = sh.log.append(req.records, ts, publisher, None);
            if let (Some((pid, seq)), Some(d)) = (req.idempotent, digest) {
                sh.producers.appended(pid, seq, d, base, base + count, None);
            }
            if let Some(b) = batch {
                self.fanout(&k, shard, b);
            }
            return self.answer_now(conn, st, reply, Ok(None));
        }
        let token = WriteToken(self.next_write);
        self.next_write += 1;
        let entry = self.streams.get_mut(&k).expect("routed stream exists");
        let entry_shards = entry.shards.len() as u32;
        let records = req.records.clone();
        let sh = &mut entry.shards[shard as usize];
        let (base, _) = sh.log.append(req.records, ts, publisher.clone(), Some(token));
        if let (Some((pid, seq)), Some(d)) = (req.idempotent, digest) {
            sh.producers.appended(pid, seq, d, base, base + count, Some(token));
        }
        self.out.push_back(BrokerOutput::Persist(PersistRequest {
            token,
            tenant_id: req.tenant_id,
            namespace: req.namespace,
            stream: req.stream,
            shard,
            base_offset: base,
            records,
            timestamp_micros: ts,
            publisher,
            generation_start: false,
            producer: req.idempotent,
            fsync: entry.config.fsync,
            stream_shards: entry_shards,
        }));
        // Backpressure when storage falls behind: stop reading this stream until it catches up.
        let limit = self.cfg.max_pending_write_bytes;
        let sh = &mut self.streams.get_mut(&k).expect("routed stream exists").shards[shard as usize];
        if sh.log.pending_bytes() > limit && !st.storage_paused {
            st.storage_paused = true;
            sh.paused.push((conn, st.id));
            if !st.paused {
                self.out.push_back(BrokerOutput::PauseReading { conn, stream: st.id });
            }
        }
        let mut ctx = WriteCtx { key: k, shard, waiters: Vec::new(), sys: None, producer: req.idempotent };
        if !matches!(reply, Reply::None) {
            let seq = self.owe(conn, st, reply);
            if ack_on_commit {
                ctx.waiters.push(Waiter { conn, stream: st.id, seq, reply, offer });
            } else {
                // Acknowledged on enqueue: no offset (the broker never invents one).
                let data = Self::publish_answer(&offer, reply, Ok(None));
                self.deliver_answer(conn, st, seq, data);
            }
        }
        self.writes.insert(token, ctx);
    }

    /// The checks of an idempotent or conditional publish, made where offsets are assigned.
    /// Returns `Some(())` when the batch was answered here (a duplicate, or a refusal) and must
    /// not be appended.
    #[allow(clippy::too_many_arguments)] // the publish's parts, already taken apart by the caller
    fn precheck(
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
        let sh = &self.streams.get(k)?.shards[shard as usize];
        if let Some(expected) = req.expected_offset {
            let tail = sh.log.next_offset();
            let refusal = if !durable {
                Some(Refusal::new(ErrorCode::InvalidRequest, "publish_if needs a stream with a log (durable)"))
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
            producer::Verdict::Duplicate { pending: Some(token), .. } if self.writes.contains_key(&token) => {
                // The first copy is still on its way to storage: this one gets the same answer,
                // at the same time.
                let seq_slot = self.owe(conn, st, reply);
                if let Some(ctx) = self.writes.get_mut(&token) {
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
    fn route(&mut self, st: &CtlStream, req: &PublishReq) -> Result<(u32, bool), Refusal> {
        let shards = self.lookup_stream(st, &req.tenant_id, &req.namespace, &req.stream, Action::Publish)?;
        let entry = self.streams.get(&key(&req.tenant_id, &req.namespace, &req.stream)).expect("looked up");
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
        if let Some(m) = &entry.shards[shard as usize].moved {
            let mut r = Refusal::new(ErrorCode::NotLeader, format!("shard {shard} is owned by {}", m.node_id))
                .with_reason(message::RefusedReason::NotLeader(message::LeaderHint {
                    node_id: m.node_id.clone(),
                    addr: m.addr.clone(),
                }));
            r.retry = RetryClass::Redirect;
            return Err(r);
        }
        Ok((shard, entry.config.durable))
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
        let ok = outcome == WriteOutcome::Written;
        let Some(ctx) = self.writes.get(&token) else { return };
        let (k, shard) = (ctx.key.clone(), ctx.shard);
        let Some(entry) = self.streams.get_mut(&k) else {
            self.writes.remove(&token);
            return;
        };
        let sh = &mut entry.shards[shard as usize];
        match outcome {
            WriteOutcome::Written => sh.full = None,
            WriteOutcome::NoSpace if sh.full.is_none() => sh.full = Some(crate::io::after(now, FULL_PROBE_INTERVAL)),
            _ => {}
        }
        let settled = entry.shards[shard as usize].log.settle(token, ok);
        if syslog::is_sys(&k) {
            for (tok, base) in settled.done {
                if let Some(p) = self.writes.remove(&tok).and_then(|c| c.sys) {
                    self.sys_settled(tok, &k, Some(base), p, now);
                }
            }
            for (tok, _, _) in settled.failed {
                if let Some(p) = self.writes.remove(&tok).and_then(|c| c.sys) {
                    self.sys_settled(tok, &k, None, p, now);
                }
            }
            if let Some(e) = self.streams.get_mut(&k) {
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
            if let Some(ctx) = self.writes.remove(&tok) {
                if let (Some((pid, seq)), Some(e)) = (ctx.producer, self.streams.get_mut(&k)) {
                    e.shards[shard as usize].producers.settled(pid, seq, true);
                }
                for w in ctx.waiters {
                    self.finish_waiter(w, Ok(Some(base)), now);
                }
            }
        }
        for (tok, _, _) in settled.failed {
            if let Some(ctx) = self.writes.remove(&tok) {
                if let (Some((pid, seq)), Some(e)) = (ctx.producer, self.streams.get_mut(&k)) {
                    e.shards[shard as usize].producers.settled(pid, seq, false);
                }
                let r = Refusal::new(ErrorCode::Storage, "the write failed; nothing was stored");
                let mut r = r;
                r.retry = RetryClass::Retry;
                for w in ctx.waiters {
                    self.finish_waiter(w, Err(&r), now);
                }
            }
        }
        self.enforce_retention(Some(&k), now);
        let limit = self.cfg.max_pending_write_bytes;
        let mut resume = Vec::new();
        if let Some(entry) = self.streams.get_mut(&k) {
            let sh = &mut entry.shards[shard as usize];
            sh.log.trim_memory();
            if sh.log.pending_bytes() <= limit / 2 {
                resume = std::mem::take(&mut sh.paused);
            }
        }
        for (conn, sid) in resume {
            let Some(st) = self.conns.get_mut(&conn).and_then(|c| c.streams.get_mut(&sid)) else { continue };
            st.storage_paused = false;
            if !st.paused && !st.flush_paused {
                self.out.push_back(BrokerOutput::ResumeReading { conn, stream: sid });
                self.drive_stream(conn, sid, now);
            }
        }
    }

    fn finish_waiter(&mut self, w: Waiter, result: Result<Option<u64>, &Refusal>, now: Instant) {
        let data = Self::publish_answer(&w.offer, w.reply, result);
        let Some(mut st) = self.conns.get_mut(&w.conn).and_then(|c| c.streams.remove(&w.stream)) else { return };
        let resume = self.deliver_answer(w.conn, &mut st, w.seq, data);
        if let Some(c) = self.conns.get_mut(&w.conn) {
            c.streams.insert(w.stream, st);
        }
        if resume {
            self.drive_stream(w.conn, w.stream, now);
        } else if let Some(mut st) = self.conns.get_mut(&w.conn).and_then(|c| c.streams.remove(&w.stream)) {
            self.maybe_finish(w.conn, &mut st);
            let keep = !(st.send_finished && st.outstanding == 0);
            if let Some(c) = self.conns.get_mut(&w.conn)
                && keep
            {
                c.streams.insert(w.stream, st);
            }
        }
    }

    /// Appends a generation-start record to a durable shard (what a leader does when it starts
    /// serving a shard at a new generation). It takes one offset and is never delivered.
    pub fn start_generation(&mut self, tenant: &str, ns: &str, stream: &str, shard: u32, now: Instant) -> Option<u64> {
        let now = self.clock.advance(now);
        let k = key(tenant, ns, stream);
        let entry = self.streams.get_mut(&k)?;
        if !entry.config.durable {
            return None;
        }
        let token = WriteToken(self.next_write);
        self.next_write += 1;
        let stream_shards = entry.shards.len() as u32;
        let s = entry.shards.get_mut(shard as usize)?;
        let base = s.log.append_generation_start(self.wall.micros(now), token);
        self.out.push_back(BrokerOutput::Persist(PersistRequest {
            token,
            tenant_id: k.0.clone(),
            namespace: k.1.clone(),
            stream: k.2.clone(),
            shard,
            base_offset: base,
            records: Records::default(),
            timestamp_micros: self.wall.micros(now),
            publisher: None,
            generation_start: true,
            producer: None,
            fsync: entry.config.fsync,
            stream_shards,
        }));
        self.writes.insert(token, WriteCtx { key: k, shard, waiters: Vec::new(), sys: None, producer: None });
        Some(base)
    }

    // -----------------------------------------------------------------------------------------
    // Delivery

    fn fanout_committed(&mut self, k: &Key, shard: u32, base: u64, end: u64) {
        let Some(entry) = self.streams.get_mut(k) else { return };
        let s = &mut entry.shards[shard as usize];
        let subs = s.subs.clone();
        let Some(b) = s.log.batch_at(base) else { return };
        if b.generation_start || b.base != base || b.end() != end {
            return;
        }
        let count = b.count();
        // One encoding per subscriber shape, shared by every subscriber of that shape.
        let mut frames: Vec<(Shape, [Bytes; 2])> = Vec::new();
        for (conn, id) in subs {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            if sub.cursor.is_some() || sub.ending.is_some() {
                continue; // catching up from the log, or ending
            }
            let frame = match frames.iter().find(|(sh, _)| *sh == sub.shape) {
                Some((_, f)) => f.clone(),
                None => {
                    let Some(b) = self.streams.get_mut(k).and_then(|e| e.shards[shard as usize].log.batch_at(base))
                    else {
                        return;
                    };
                    let f = b.frame(sub.shape);
                    frames.push((sub.shape, f.clone()));
                    f
                }
            };
            let sub = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)).expect("present");
            Self::enqueue(&mut self.stats, sub, frame, base, count, self.cfg.subscriber_queue_bytes_max);
            self.pump(conn, id);
        }
    }

    fn fanout(&mut self, k: &Key, shard: u32, mut batch: log::LogBatch) {
        let Some(entry) = self.streams.get(k) else { return };
        let subs = entry.shards[shard as usize].subs.clone();
        let count = batch.count();
        for (conn, id) in subs {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            if sub.ending.is_some() {
                continue;
            }
            let frame = batch.frame(sub.shape);
            Self::enqueue(&mut self.stats, sub, frame, batch.base, count, self.cfg.subscriber_queue_bytes_max);
            self.pump(conn, id);
        }
    }

    /// Queues a batch for a subscriber, or drops it when the queue is full (in batches, or in
    /// bytes past `bytes_max`). A client that reads `subscription_lagged` (and offsets, on a
    /// durable stream) has its subscription ended at the first drop; any other sees the drop as
    /// a jump in offsets.
    fn enqueue(stats: &mut BrokerStats, sub: &mut Sub, frame: [Bytes; 2], base: u64, count: u64, bytes_max: usize) {
        if sub.full(frame_len(&frame), bytes_max) {
            stats.records_dropped += count;
            if sub.shape.offsets && sub.offer.has(Features::SUBSCRIPTION_LAGGED) {
                stats.lagged += 1;
                sub.ending = Some(Ending::Lagged { resume_from: base });
            }
            return;
        }
        sub.push(frame);
    }

    /// Writes what a subscriber has ready, within its writer credit; ends it when it is ending
    /// and everything before the end is written.
    fn pump(&mut self, conn: ConnId, id: u64) {
        let limit = self.cfg.event_stream_inflight_bytes;
        loop {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { return };
            let Some(stream) = sub.stream else { return };
            if sub.inflight >= limit {
                return;
            }
            if let Some(cursor) = sub.cursor {
                // Catching up from the log.
                if sub.reading.is_some() {
                    return; // waiting for history from storage
                }
                let (k, shard, shape) = (sub.key.clone(), sub.shard, sub.shape);
                let Some(entry) = self.streams.get_mut(&k) else { return };
                let log = &mut entry.shards[shard as usize].log;
                // Retention may have passed the cursor: that history is gone (a visible gap).
                let cursor = cursor.max(log.start());
                if cursor < log.memory_start() {
                    let token = ReadToken(self.next_read);
                    self.next_read += 1;
                    let end = log.memory_start();
                    self.reads.insert(token, ReadFor::Sub(conn, id));
                    self.out.push_back(BrokerOutput::Read(ReadRequest {
                        token,
                        tenant_id: k.0.clone(),
                        namespace: k.1.clone(),
                        stream: k.2.clone(),
                        shard,
                        from: cursor,
                        end,
                        max_bytes: self.cfg.history_read_bytes,
                    }));
                    let sub = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)).expect("present");
                    sub.cursor = Some(cursor);
                    sub.reading = Some(token);
                    return;
                }
                let tail = log.committed_tail();
                let next = log.next_deliverable(cursor).map(|b| {
                    let f = if b.base >= cursor { b.frame(shape) } else { b.frame_from(shape, cursor) };
                    (f, b.end())
                });
                let sub = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)).expect("present");
                match next {
                    Some((frame, end)) => {
                        sub.cursor = Some(end);
                        sub.inflight += frame[0].len() + frame[1].len();
                        self.stats.batches_delivered += 1;
                        self.write_frame(conn, stream, frame);
                    }
                    None => {
                        // Caught up: from here on the subscriber is fed live.
                        let _ = tail;
                        sub.cursor = None;
                    }
                }
                continue;
            }
            if let Some(frame) = sub.queue.pop_front() {
                // Saturating: a watch's initial replay is queued without being counted.
                sub.queued_bytes = sub.queued_bytes.saturating_sub(frame_len(&frame));
                sub.inflight += frame_len(&frame);
                self.stats.batches_delivered += 1;
                self.write_frame(conn, stream, frame);
                continue;
            }
            if let Some(ending) = sub.ending.clone() {
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
                };
                if let Some(m) = terminal {
                    self.out.push_back(BrokerOutput::Transmit { conn, stream, data: json_frame(&m) });
                }
                self.out.push_back(BrokerOutput::Finish { conn, stream });
                if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.remove(&id)) {
                    self.unlink_sub(conn, &sub);
                }
            }
            return;
        }
    }

    /// Storage returned history asked for with `BrokerOutput::Read`. The batches are delivered
    /// to the subscriber that asked, in order, and its catch-up continues.
    pub fn handle_read_complete(&mut self, token: ReadToken, batches: Vec<crate::storage::StoredBatch>, now: Instant) {
        self.clock.advance(now);
        let (conn, id) = match self.reads.remove(&token) {
            Some(ReadFor::Sub(conn, id)) => (conn, id),
            Some(ReadFor::Page(p)) => return self.page_read_complete(token, p, batches),
            Some(ReadFor::Poll(p)) => return self.poll_read_complete(*p, batches),
            None => return,
        };
        let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { return };
        if sub.reading != Some(token) {
            return;
        }
        sub.reading = None;
        let (Some(stream), Some(mut cursor)) = (sub.stream, sub.cursor) else { return };
        let shape = sub.shape;
        let memory_start = self
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
            let records = b.records.skip((from - b.base_offset) as u32);
            let skipped = if from == b.base_offset { skip } else { 0 };
            skip = 0;
            let e = log::event_batch(shape, records, from, skipped, b.publisher.as_ref(), b.timestamp_micros);
            if let Ok(f) = e.encode_parts() {
                frames.push(f);
            }
            cursor = end;
        }
        if frames.is_empty() {
            // Storage had nothing there (deleted by retention, or unreadable): skip to what is in
            // memory rather than ask again forever. The subscriber sees the gap in offsets.
            cursor = cursor.max(memory_start);
        }
        let sub = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)).expect("present");
        sub.cursor = Some(cursor);
        for f in &frames {
            sub.inflight += f[0].len() + f[1].len();
        }
        self.stats.batches_delivered += frames.len() as u64;
        for f in frames {
            self.write_frame(conn, stream, f);
        }
        self.pump(conn, id);
    }

    fn write_frame(&mut self, conn: ConnId, stream: StreamId, [head, body]: [Bytes; 2]) {
        self.out.push_back(BrokerOutput::Transmit { conn, stream, data: head });
        if !body.is_empty() {
            self.out.push_back(BrokerOutput::Transmit { conn, stream, data: body });
        }
    }

    // -----------------------------------------------------------------------------------------
    // Subscriptions

    fn subscribe(&mut self, conn: ConnId, st: &mut CtlStream, s: message::Subscribe, _now: Instant) {
        let shards = match self.lookup_stream(st, &s.tenant_id, &s.namespace, &s.stream, Action::Subscribe) {
            Ok(n) => n,
            Err(r) => return self.refuse(conn, st, r),
        };
        let offer = Self::features_of(st);
        let shard = s.shard.unwrap_or(0);
        if shard >= shards {
            let r = Refusal::new(ErrorCode::InvalidRequest, format!("stream has no shard {shard} (it has {shards})"));
            return self.refuse(conn, st, r);
        }
        let k = key(&s.tenant_id, &s.namespace, &s.stream);
        let max_subs = self.cfg.max_subscriptions_per_connection as usize;
        let cap_max = self.cfg.subscriber_queue_capacity_max.max(1);
        let entry = self.streams.get_mut(&k).expect("looked up");
        let durable = entry.config.durable;
        let default_cap = entry.config.queue_capacity.clamp(1, cap_max);
        let sh = &mut entry.shards[shard as usize];
        if let Some(m) = &sh.moved {
            let msg = Self::not_leader_answer(&offer, m, shard);
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
        let id = match s.subscription_id {
            Some(id) if c.subs.contains_key(&id) => {
                let r = Refusal::new(ErrorCode::InvalidRequest, format!("subscription {id} already exists"));
                return self.refuse(conn, st, r);
            }
            Some(id) => id,
            None => {
                while c.subs.contains_key(&c.next_sub) {
                    c.next_sub += 1;
                }
                c.next_sub += 1;
                c.next_sub - 1
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
        };
        let token = OpenToken(self.next_open);
        self.next_open += 1;
        c.opens.insert(token, id);
        c.subs.insert(
            id,
            Sub {
                id,
                key: k.clone(),
                shard,
                stream: None,
                shape,
                offer,
                queue: VecDeque::new(),
                queued_bytes: 0,
                capacity,
                inflight: 0,
                cursor: (durable && cursor < tail).then_some(cursor),
                ending: None,
                reading: None,
                watch: None,
            },
        );
        let entry = self.streams.get_mut(&k).expect("looked up");
        entry.shards[shard as usize].subs.push((conn, id));
        let answer = Message::Subscribed(message::Subscribed {
            subscription_id: id,
            start_offset: offsets.then_some(cursor),
            live_offset: offsets.then_some(tail.max(cursor)),
            queue_capacity: if self.server_features.contains(Features::SUBSCRIBE_QUEUE) { granted } else { None },
        });
        self.send(conn, st, json_frame(&answer));
        self.out.push_back(BrokerOutput::OpenUni { conn, token });
    }

    /// The answer to a request for a shard that moved away: `not_leader` for a client that
    /// offered FEATURE_REDIRECT, an `error` with code `not_leader` for any other.
    fn not_leader_answer(offer: &ClientOffer, m: &Moved, shard: u32) -> Message {
        if offer.has(Features::REDIRECT) {
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

    /// Restores a durable shard from what storage recovered at start. `name` is
    /// `(tenant, namespace, stream)`. Creates the stream (with `config`) if it does not exist yet.
    /// Call before accepting connections.
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
        if !self.streams.contains_key(&k) {
            self.create_stream(k.clone(), config);
        }
        let Some(s) = self.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard as usize)) else { return };
        for b in batches {
            if let Some((pid, seq)) = b.producer {
                let end = b.base_offset + b.count();
                s.producers.appended(pid, seq, producer::digest(b.records.raw()), b.base_offset, end, None);
            }
            s.log.restore(b);
        }
        self.enforce_retention(Some(&k), now);
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
        if let Some(s) = self.streams.get_mut(&key(tenant, ns, stream)).and_then(|e| e.shards.get_mut(shard as usize)) {
            s.producers.restore_forgotten(forgotten);
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
        if !self.streams.contains_key(&k) {
            self.create_stream(k.clone(), config);
        }
        let Some(s) = self.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard as usize)) else { return };
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
        self.streams
            .get(&key(tenant, ns, stream))
            .map_or(self.cfg.default_stream.memory_bytes, |e| e.config.memory_bytes)
    }

    /// Every stream with its configuration, in name order.
    pub fn streams(&self) -> impl Iterator<Item = (&str, &str, &str, &StreamConfig)> {
        let mut v: Vec<_> = self
            .streams
            .iter()
            .filter(|(k, _)| !syslog::is_sys(k))
            .map(|((t, n, s), e)| (t.as_str(), n.as_str(), s.as_str(), &e.config))
            .collect();
        v.sort_unstable_by_key(|(t, n, s, _)| (*t, *n, *s));
        v.into_iter()
    }

    /// Deletes a stream. Its subscriptions end after delivering what they have queued, with
    /// `stream_deleted` for clients that read it.
    pub fn delete_stream(&mut self, tenant: &str, ns: &str, stream: &str, now: Instant) -> bool {
        self.clock.advance(now);
        let Some(entry) = self.streams.remove(&key(tenant, ns, stream)) else { return false };
        self.aged_streams -= usize::from(entry.config.retention.max_age.is_some());
        for shard in entry.shards {
            for (conn, id) in shard.subs {
                if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) {
                    sub.cursor = None;
                    sub.ending.get_or_insert(Ending::Deleted);
                    self.pump(conn, id);
                }
            }
        }
        true
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
        self.clock.advance(now);
        let Some(entry) = self.streams.get_mut(&key(tenant, ns, stream)) else { return false };
        let durable = entry.config.durable;
        let Some(s) = entry.shards.get_mut(shard as usize) else { return false };
        let resume_from = durable.then(|| s.log.committed_tail());
        s.moved =
            Some(Moved { node_id: owner.node_id.clone(), addr: owner.addr.clone(), generation: owner.generation });
        let subs = std::mem::take(&mut s.subs);
        for (conn, id) in subs {
            if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) {
                let m = message::ShardMoved {
                    subscription_id: id,
                    resume_from,
                    node_id: Some(owner.node_id.clone()),
                    addr: owner.addr.clone(),
                    generation: owner.generation,
                };
                sub.ending.get_or_insert(Ending::Moved(m));
                self.pump(conn, id);
            }
        }
        // Polls waiting on the shard answer empty.
        self.wake_groups(&key(tenant, ns, stream), shard, now);
        true
    }

    // -----------------------------------------------------------------------------------------
    // Cache

    fn cache_entry(&mut self, st: &CtlStream, t: &str, ns: &str, c: &str, action: Action) -> Result<Key, Refusal> {
        check_names(&[("tenant", t), ("namespace", ns), ("cache", c)])?;
        self.authorize(st, t, ns, c, action)?;
        let k = key(t, ns, c);
        if !self.caches.contains_key(&k) {
            if !self.cfg.auto_create {
                return Err(Refusal::new(ErrorCode::NotFound, format!("cache {ns}/{c} not found")));
            }
            let seed = self.wall.micros(self.clock.last().unwrap_or_else(|| self.wall.anchor()));
            self.caches.insert(k.clone(), Cache::with_version_seed(seed));
        }
        Ok(k)
    }

    fn counter_add(&mut self, conn: ConnId, st: &mut CtlStream, a: message::CounterAdd, now: Instant) {
        let k = match self.cache_entry(st, &a.tenant_id, &a.namespace, &a.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        if a.key.len() > u16::MAX as usize {
            return self.refuse(
                conn,
                st,
                Refusal::new(ErrorCode::InvalidRequest, "counter key longer than 65535 bytes"),
            );
        }
        let record = syslog::CounterOp::Add { key: a.key.clone(), delta: a.delta }.encode();
        let pending = syslog::SysPending::CounterAdd { conn, stream: st.id, request_id: a.request_id, key: a.key };
        let token = self.sys_append(&syslog::counters_key(&k), vec![record], pending, now);
        Self::hold(st, HeldFor::Write(token));
    }

    fn counter_get(&mut self, conn: ConnId, st: &mut CtlStream, g: message::CounterGet) {
        let k = match self.cache_entry(st, &g.tenant_id, &g.namespace, &g.cache, Action::CacheRead) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let value = self.counters.get(&k).and_then(|c| c.sums.get(&g.key).copied());
        let m = Message::CounterValue(message::CounterValue { value, request_id: g.request_id });
        self.send(conn, st, json_frame(&m));
    }

    fn cache_put_if(&mut self, conn: ConnId, st: &mut CtlStream, p: message::CachePutIf, now: Instant) {
        let k = match self.cache_entry(st, &p.tenant_id, &p.namespace, &p.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let expires = p.ttl_ms.map(|ms| crate::io::after(now, std::time::Duration::from_millis(ms)));
        let condition = match p.condition {
            message::CacheCondition::Absent => None,
            message::CacheCondition::Version(v) => Some(v),
        };
        let (applied, version) =
            self.caches.get_mut(&k).expect("created").put_if(p.key, p.value.0, expires, condition, now);
        self.cache_fanout(&k);
        let m =
            Message::CacheConditionResult(message::CacheConditionResult { applied, version, request_id: p.request_id });
        self.send(conn, st, json_frame(&m));
    }

    fn cache_delete_if(&mut self, conn: ConnId, st: &mut CtlStream, d: message::CacheDeleteIf, now: Instant) {
        let k = match self.cache_entry(st, &d.tenant_id, &d.namespace, &d.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let (applied, version) = self.caches.get_mut(&k).expect("created").delete_if(&d.key, d.version, now);
        self.cache_fanout(&k);
        let m =
            Message::CacheConditionResult(message::CacheConditionResult { applied, version, request_id: d.request_id });
        self.send(conn, st, json_frame(&m));
    }

    fn cache_put(&mut self, conn: ConnId, st: &mut CtlStream, p: message::CachePut, now: Instant) {
        let k = match self.cache_entry(st, &p.tenant_id, &p.namespace, &p.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let expires = p.ttl_ms.map(|ms| crate::io::after(now, std::time::Duration::from_millis(ms)));
        self.caches.get_mut(&k).expect("created").put(p.key, p.value.0, expires);
        self.cache_fanout(&k);
        let answer = match p.request_id {
            Some(request_id) => Message::CacheOk(message::CacheOk { request_id }),
            None => Message::Ok(message::OkMsg {}),
        };
        self.send(conn, st, json_frame(&answer));
    }

    fn cache_get(&mut self, conn: ConnId, st: &mut CtlStream, g: message::CacheGet, now: Instant) {
        let k = match self.cache_entry(st, &g.tenant_id, &g.namespace, &g.cache, Action::CacheRead) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let hit = self.caches.get_mut(&k).expect("created").get(&g.key, now);
        self.cache_fanout(&k); // a lazy expiry is a change too
        if hit.is_some() {
            self.stats.cache_hits += 1;
        } else {
            self.stats.cache_misses += 1;
        }
        // `version` only on a hit, and only for a client that offered FEATURE_CACHE_CONDITIONAL.
        let offered = Self::features_of(st).has(Features::CACHE_CONDITIONAL);
        let version = hit.as_ref().map(|(_, v)| *v).filter(|_| offered);
        let m = Message::CacheValue(message::CacheValue {
            tenant_id: g.tenant_id,
            namespace: g.namespace,
            cache: g.cache,
            key: g.key,
            value: hit.map(|(v, _)| B64(v)),
            request_id: g.request_id,
            version,
        });
        self.send(conn, st, json_frame(&m));
    }

    fn cache_delete(&mut self, conn: ConnId, st: &mut CtlStream, d: message::CacheDelete, now: Instant) {
        let k = match self.cache_entry(st, &d.tenant_id, &d.namespace, &d.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let removed = self.caches.get_mut(&k).expect("created").delete(&d.key, now);
        self.cache_fanout(&k);
        let m = Message::CacheValue(message::CacheValue {
            tenant_id: d.tenant_id,
            namespace: d.namespace,
            cache: d.cache,
            key: d.key,
            value: removed.map(B64),
            request_id: d.request_id,
            version: None,
        });
        self.send(conn, st, json_frame(&m));
    }
}

/// A publish, whatever encoding it came in.
#[derive(Debug)]
struct PublishReq {
    tenant_id: String,
    namespace: String,
    stream: String,
    key: Option<Bytes>,
    shard: Option<u32>,
    width: Option<u32>,
    records: Records,
    /// An idempotent producer's `(producer_id, sequence)`.
    idempotent: Option<(u64, u64)>,
    /// `publish_if`: append only at this offset.
    expected_offset: Option<u64>,
}

impl PublishReq {
    /// A plain batch from the fields every JSON publish form shares.
    fn json(
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
        }
    }
}
