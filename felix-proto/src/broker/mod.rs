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

/// Credentials and permissions live on a floor below the broker (jwt.rs reads them too).
pub use crate::auth;
mod cache;
mod cache_state;
#[cfg(feature = "testkit")]
pub(crate) use cache::FREEZE_MIN_VALUE;
#[cfg(test)]
pub(crate) use group::group_record_samples;
pub(crate) use group::is_group_record;
pub mod config;
mod consume;
mod group;
mod history;
mod log;
mod producer;
mod syslog;
mod timers;
mod watch;

mod admin;
mod answers;
mod cache_moves;
mod cache_requests;
mod catalog;
pub mod cluster_admin;
mod connection;
mod create;
mod events;
mod forward;
mod forward_request;
mod hold;
mod ids;
mod inputs;
mod inspect;
mod key;
mod limits;
mod membership;
mod moves;
mod node;
pub mod notice;
mod output;
mod ownership;
mod pauses;
mod publish;
mod quorum_cache;
#[cfg(any(test, fuzzing, feature = "testkit"))]
pub(crate) use quorum_cache::{cache_entry_samples, fuzz_cache_entry};
mod replicated;
mod requests;
mod seen_streams;
mod serving;
mod state;
mod stream_state;
mod sub;
mod subscription;

use key::{KeyRef, StreamKey};
use sub::{Ending, Sub, SubEvent, frame_len};

pub use crate::shard::moving::MoveProgress;
pub use crate::shard::replicated::ReplicaRole;
pub use auth::{Action, Grant, TokenGrant};
pub(crate) use cache_state::CacheStateReader;
pub use config::{
    BrokerConfig, CacheSpec, DEFAULT_PUBLISHER_HOLD_MAX, DEFAULT_SUBSCRIBER_QUEUE_CAPACITY, FsyncMode, Retention,
    StreamConfig, StreamSpec,
};
pub use forward::{FORWARD_TIMEOUT, ForwardOutcome, ForwardedPublish};
pub use forward_request::ForwardedRequest;
pub use group::GroupLimits;
pub use inputs::ConnectionInputs;
pub use inspect::ShardSummary;
pub use limits::TenantLimit;
pub use notice::Notice;
pub use output::{
    AdmitError, BrokerOutput, BrokerStats, ClusterOutput, PeerAddr, PersistRequest, ReadRequest, StorageOutput,
    TransportOutput, WriteOutcome,
};
pub(crate) use replicated::{HostSection, HostStateReader};
pub use requests::{MAX_NAME_BYTES, name_problem};
pub(crate) use stream_state::{CommitSection, StreamStateReader, stream_state_holds_commits_in};

use publish::PublishReq;
use requests::{Missing, check_names, check_new_name};

use crate::binary::ErrorDetail;
use crate::error_code::{ErrorCode, RetryClass};
use crate::features::Features;
use crate::flags::Flags;
use crate::frame::FrameDecoder;
use crate::message::{self, Message};
use crate::negotiate::ClientOffer;
use crate::transport::{Clock, ConnId, OpenToken, ReadToken, StreamId, WallClock, WriteToken};
use bytes::{Bytes, BytesMut};
use cache::Cache;
use log::ShardLog;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

type Key = StreamKey;
use pauses::{Pause, Pauses};
use serving::{Away, Serving, ServingEvent, Unavailable};

#[derive(Debug)]
struct Shard {
    log: ShardLog,
    subs: Vec<(ConnId, u64)>,
    /// Who serves it: here, another broker, nobody for now, or its group ([`serving`]).
    serving: Serving,
    /// Streams paused because this shard's writes backed up.
    paused: Vec<(ConnId, StreamId)>,
    /// An ephemeral shard's publishers held for a slow subscriber
    /// ([`BrokerConfig::publisher_hold_max`]).
    hold: Option<Hold>,
    /// Idempotent producers' sequences on this shard.
    producers: producer::Producers,
    /// Storage ran out of space writing this shard: publishes are refused `overloaded` with
    /// nothing written (nothing is acknowledged on enqueue either), except one probe write at
    /// or after this time, answered after its write; the first write that succeeds ends it.
    full: Option<Instant>,
    /// What `commit`s wrote ([`state`]).
    state: state::ShardState,
    /// Payload bytes proposed to the shard's Raft group and not yet answered.
    replicating: u64,
    /// A replicated shard's leader serves its consumer groups' polls and reads until then
    /// (its read lease; asked for only while the shard has groups here).
    read_lease: Option<Instant>,
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
    /// A request another broker of the cluster forwarded: it checked the permission.
    vouched: bool,
    /// Authenticated by a signed token, instead of the static token `token`.
    jwt: Option<Box<SignedSession>>,
    /// Authenticated by the connection's client certificate: `token` indexes
    /// `client_certs`, not `tokens`.
    cert: bool,
    offer: ClientOffer,
    window: Option<u32>,
    ack_on_commit: bool,
    widths: HashMap<Key, u32>,
}

/// What a control stream authenticated with a signed token holds of it.
#[derive(Debug, Clone)]
struct SignedSession {
    perms: Vec<crate::jwt::Perm>,
    /// Expiry, seconds since the epoch.
    exp: u64,
    /// Its id and principal, to recognise a revocation.
    credential: Credential,
}

/// A signed token's id and principal.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Credential {
    jti: Option<String>,
    sub: String,
}

/// Publishers of an ephemeral shard held (not read) while one of its subscribers' queues is
/// over half full, until every such queue is under a quarter or the deadline comes
/// ([`hold`]).
#[derive(Debug)]
struct Hold {
    deadline: Instant,
    streams: Vec<(ConnId, StreamId)>,
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
    /// Why its requests are not being read, if they are not.
    pauses: Pauses,
    /// The last pause reason went, but the driver is told to read again only once the frames
    /// the stream already holds are processed ([`Broker::drive_stream`] ends with none
    /// complete): a stream paused with a backlog (a rate-limited flood) would otherwise have the
    /// driver read, and the broker buffer, more than it processes, without bound.
    resume_owed: bool,
    /// Answer bytes handed to the driver and not yet reported flushed.
    unflushed: usize,
    recv: Recv,
    /// Our side is finished (or the client stopped it): nothing more is written.
    send_finished: bool,
    /// A stream must authenticate by then (auth is per stream; the connection is not judged).
    auth_deadline: Option<Instant>,
    /// Answers held back behind a request answered from storage (`stream_read`), so that every
    /// answer leaves in request order: id-less answers (`error`, `subscribe_cursor_error`) are
    /// matched by order.
    held: VecDeque<Held>,
}

impl CtlStream {
    /// A fresh stream, not authenticated yet.
    fn new(id: StreamId, decoder: FrameDecoder, auth_deadline: Option<Instant>) -> CtlStream {
        CtlStream {
            id,
            uni: id.dir() == crate::transport::Dir::Uni,
            decoder,
            session: None,
            owed: VecDeque::new(),
            next_seq: 0,
            outstanding: 0,
            pauses: Pauses::default(),
            resume_owed: false,
            unflushed: 0,
            recv: Recv::Open,
            send_finished: false,
            auth_deadline,
            held: VecDeque::new(),
        }
    }

    /// Nothing more will be written and nothing is owed: the stream's state can go.
    fn done(&self) -> bool {
        self.send_finished && self.outstanding == 0
    }

    /// Adds a pause reason. True when the driver must be told to stop reading: it is reading
    /// now (not when another reason holds it, nor when a resume was owed but not yet told,
    /// which is then simply withdrawn), so it sees one `PauseReading` per `ResumeReading`.
    fn pause(&mut self, p: Pause) -> bool {
        if !self.pauses.add(p) {
            return false;
        }
        !std::mem::take(&mut self.resume_owed)
    }

    /// Requests are read (not paused, not closed).
    fn reading(&self) -> bool {
        !self.pauses.any() && self.recv != Recv::Closed
    }
}

/// The receiving side of a control stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Recv {
    /// More requests may come.
    Open,
    /// The client finished its side; what is buffered is still read.
    Finished,
    /// Nothing more is read: the client reset it, we stopped it after a closing refusal, or
    /// it ended inside a frame.
    Closed,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum HeldFor {
    Read(ReadToken),
    Write(WriteToken),
    /// A group poll (long-polling, or reading its records back).
    Poll(u64),
    /// A cache or counter request forwarded to the cache's owner.
    Forward(u64),
    /// A `commit`'s answer (it may fail with an `error`, which carries no request id, so it
    /// keeps its turn among the stream's other answers).
    Commit(u64),
    /// An operator request the cluster node answers.
    Admin(u64),
    /// A `stream_create` waiting for storage to record its streams.
    Create(u64),
}

/// Where an owed publish answer goes once it is known.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum AnswerSlot {
    /// Sent when ready (a publish answer carries its request id).
    Now,
    /// In order behind earlier ones on a pipelined stream (this sequence number).
    Owed(u64),
    /// In its turn among the stream's held answers ([`HeldFor::Commit`]).
    Held(u64),
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
    /// Records a moving shard's new owner asked for.
    Copy { to: String, shard: crate::shard::ShardId, max: usize, first: bool },
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

#[derive(Debug)]
struct Conn {
    streams: HashMap<StreamId, Box<CtlStream>>,
    subs: HashMap<u64, Sub>,
    opens: HashMap<OpenToken, u64>,
    /// Some stream of it authenticated. Until then it counts against the caps on
    /// unauthenticated connections.
    authenticated: bool,
    opened_at: Instant,
    peer: Option<PeerAddr>,
    /// The tenant its first authenticated stream named (for the tenant's connection quota).
    tenant: Option<String>,
    /// The names of the client certificate the driver verified in the handshake, if any.
    cert_names: Vec<String>,
    next_sub: u64,
    /// The stream indexes the client opened, per direction: a stream seen before with no
    /// state here was closed, and bytes for it are ignored rather than taken for a new,
    /// unauthenticated stream.
    seen_bi: seen_streams::SeenStreams,
    seen_uni: seen_streams::SeenStreams,
}

impl Conn {
    /// The id of a new subscription or watch: the one the client chose, or the next free one.
    /// `Err(id)` when the client chose an id already in use.
    fn claim_sub_id(&mut self, asked: Option<u64>) -> Result<u64, u64> {
        match asked {
            Some(id) if self.subs.contains_key(&id) => Err(id),
            Some(id) => Ok(id),
            None => {
                while self.subs.contains_key(&self.next_sub) {
                    self.next_sub += 1;
                }
                self.next_sub += 1;
                Ok(self.next_sub - 1)
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Reply {
    None,
    Json(u64),
    /// JSON, and a refusal with a typed reason is `publish_refused` (idempotent and
    /// conditional publishes).
    Refusable(u64),
    Binary(u64),
    /// A `commit`: `commit_ok`, `publish_refused` for an offset mismatch, `error` otherwise.
    Commit(u64),
}

#[derive(Debug)]
struct Waiter {
    conn: ConnId,
    stream: StreamId,
    seq: AnswerSlot,
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
    /// A commit's state changes, applied when the write settles.
    state: Option<Bytes>,
    /// Forwarded publishes waiting for this write: (origin node, forward id).
    forwards: Vec<(String, u64)>,
    /// Payload bytes counted against the tenant's share of the publish queue (0: not counted),
    /// given back when the write leaves ([`Broker::take_write`]).
    queued: u64,
    /// Payload bytes proposed to a replicated shard's group (0: a write to storage).
    replicated: u64,
}

impl WriteCtx {
    /// A write to shard `shard` of `key` that nobody waits for yet.
    fn new(key: Key, shard: u32) -> WriteCtx {
        WriteCtx {
            key,
            shard,
            waiters: Vec::new(),
            sys: None,
            producer: None,
            state: None,
            forwards: Vec::new(),
            queued: 0,
            replicated: 0,
        }
    }
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
    /// Operator notices waiting for the driver's log ([`Broker::poll_notice`]).
    notices: notice::Notices,
    /// Scratch for fan-out (a shard's subscribers, copied because delivering may end one): kept
    /// between batches so that fanning a batch out allocates nothing.
    fanout_subs: Vec<(ConnId, u64)>,
    clock: Clock,
    wall: WallClock,
    conns: HashMap<ConnId, Box<Conn>>,
    /// The connections not authenticated yet (the caps of [`Broker::admit`]).
    unauthenticated: connection::Unauthenticated,
    /// What comes due at a time of its own, each kind in deadline order.
    timers: timers::Timers,
    /// The next id of each kind this broker hands out.
    ids: ids::Ids,
    out: VecDeque<BrokerOutput>,
    stats: BrokerStats,
    server_flags: Flags,
    server_features: Features,
    /// Decompression contexts for compressed publishes (D56), made once.
    decompressor: crate::binary::Decompressor,
    /// State of the random sequence (splitmix64), seeded from the configuration.
    rng: u64,
    /// Shutting down: no new control stream is authenticated ([`Broker::begin_drain`]).
    draining: bool,
    /// Work that reaches other control streams than the one in hand, run at the end of the
    /// input that raised it ([`events`]).
    events: events::Events,
    /// What this broker holds as a member of a cluster (nothing in use on a single broker).
    pub(crate) membership: membership::Membership,
    /// What it holds for everyone, apart from any connection.
    node: node::Node,
}

impl Broker {
    /// The key a stream is stored under (shared, not allocated), if it exists.
    fn stream_key(&self, t: &str, n: &str, s: &str) -> Option<Key> {
        self.node.streams.get_key_value(KeyRef(t, n, s).q()).map(|(k, _)| k.clone())
    }
}

fn key(t: &str, n: &str, s: &str) -> Key {
    StreamKey::new(t, n, s)
}

/// A copy of `value` in an allocation of its own, for what a cache or a stream's commit state
/// keeps for as long as the key lives. A value arrives as a slice of some larger buffer: a
/// client's frame, a peer frame carrying other shards' entries, a snapshot, or a 64 MiB
/// segment read back at a restart. Kept as that slice, it would keep the whole buffer alive,
/// unseen by the limits, which count key and value bytes; one small copy per stored value
/// bounds what is held by what is counted. (Records in a log are kept as slices: they leave in
/// order, with their neighbours, so the buffers they share go too.)
pub(crate) fn owned(value: &Bytes) -> Bytes {
    Bytes::copy_from_slice(value)
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
            unauthenticated: Default::default(),
            timers: timers::Timers::default(),
            ids: ids::Ids::default(),
            out: VecDeque::new(),
            fanout_subs: Vec::new(),
            stats: BrokerStats::default(),
            notices: notice::Notices::default(),
            server_flags,
            decompressor: crate::binary::Decompressor::new(),
            server_features,
            rng: 0,
            draining: false,
            events: events::Events::default(),
            membership: membership::Membership::default(),
            node: node::Node::default(),
        };
        b.rng = b.cfg.random_seed;
        b.node.limits = limits::RateLimits::new(&b.cfg.tenant_limits);
        for s in b.cfg.streams.clone() {
            b.create_stream(key(&s.tenant_id, &s.namespace, &s.name), s.config);
        }
        let seed = wall.micros(wall.anchor());
        for c in b.cfg.caches.clone() {
            let mut cache = Cache::with_version_seed(seed);
            cache.durable = c.durable;
            b.node.caches.insert(key(&c.tenant_id, &c.namespace, &c.name), cache);
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

    /// Replaces the signed-token configuration (a reloaded JWK set, new revocations): new
    /// `auth`s are checked against it; every subscription and watch opened with a token it now
    /// revokes ends with a final `revoked`, and every further request of a control stream
    /// authenticated with one is refused `revoked`. `None`: signed tokens are no longer
    /// accepted (what is open keeps its permissions until it expires).
    pub fn set_jwt(&mut self, verifier: Option<crate::jwt::Verifier>, now: Instant) {
        self.clock.advance(now);
        self.cfg.jwt = verifier;
        if self.cfg.jwt.is_some() {
            self.end_revoked(now);
        }
    }

    /// Whether a signed token is revoked, by the broker's configuration or by the cluster.
    fn is_revoked(&self, jti: Option<&str>, sub: &str) -> bool {
        let listed = |ids: &std::collections::BTreeSet<String>, subs: &std::collections::BTreeSet<String>| {
            jti.is_some_and(|j| ids.contains(j)) || subs.contains(sub)
        };
        self.cfg.jwt.as_ref().is_some_and(|v| listed(&v.revoked_jti, &v.revoked_sub))
            || listed(&self.membership.revoked.0, &self.membership.revoked.1)
    }

    /// Revocations through the cluster's metadata changed: what a newly revoked token opened
    /// ends now.
    pub(super) fn set_cluster_revocations(
        &mut self,
        jti: &std::collections::BTreeSet<String>,
        sub: &std::collections::BTreeSet<String>,
        now: Instant,
    ) {
        if self.membership.revoked.0 == *jti && self.membership.revoked.1 == *sub {
            return;
        }
        self.membership.revoked = (jti.clone(), sub.clone());
        self.end_revoked(now);
    }

    /// Ends every subscription, watch and group long-poll opened with a token now revoked.
    fn end_revoked(&mut self, now: Instant) {
        let revoked: Vec<(u64, ConnId, u64, Credential)> = self
            .timers
            .expiries
            .iter()
            .filter(|(_, _, _, c)| self.is_revoked(c.jti.as_deref(), &c.sub))
            .cloned()
            .collect();
        for e in revoked {
            self.timers.expiries.remove(&e);
            let (_, conn, id, _) = e;
            if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) {
                sub.on(SubEvent::End(Ending::Revoked { expired: false }));
                self.pump(conn, id);
            }
        }
        // Group long-polls waiting with a revoked token end now too.
        self.wake_all_groups(now);
    }

    /// The broker is shutting down: it takes no new work (a control stream authenticating from
    /// now on is refused `draining`, retry: connect elsewhere; the driver stops admitting
    /// connections) and finishes what is in flight ([`work_in_flight`](Self::work_in_flight)),
    /// serving everything already open meanwhile.
    pub fn begin_drain(&mut self, now: Instant) {
        self.clock.advance(now);
        self.draining = true;
    }

    /// Whether [`begin_drain`](Self::begin_drain) was called.
    pub fn is_draining(&self) -> bool {
        self.draining
    }

    /// What a clean stop would cut short: writes storage has not confirmed (and the publishes
    /// waiting on them), publishes and requests forwarded to other brokers and not answered.
    pub fn work_in_flight(&self) -> usize {
        self.node.writes.len() + self.membership.forwards.len() + self.membership.request_forwards.len()
    }

    /// Open client connections (internal ones serving other brokers' forwarded requests are
    /// not counted).
    pub fn connection_count(&self) -> usize {
        self.conns.len() - self.internal_connections()
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
        let s = self.node.streams.get(KeyRef(tenant, ns, stream).q())?.shards.get(shard as usize)?;
        Some((s.log.start(), s.log.committed_tail(), s.log.next_offset(), s.log.retained_records()))
    }

    /// Payload bytes of history every shard log holds in memory.
    pub fn retained_log_bytes(&self) -> u64 {
        self.node.streams.values().flat_map(|e| e.shards.iter()).map(|s| s.log.memory_bytes()).sum()
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

    /// The next operator notice, oldest first (a driver logs them; see [`Notice`]).
    pub fn poll_notice(&mut self) -> Option<Notice> {
        self.notices.pop()
    }

    /// Queues an operator notice (the cluster layer's too).
    pub(crate) fn notice(&mut self, n: Notice) {
        self.notices.push(n);
    }

    /// The next output, `None` when there is nothing to do.
    #[must_use]
    pub fn poll_output(&mut self) -> Option<BrokerOutput> {
        loop {
            let o = self.out.pop_front()?;
            if self.membership.served.is_empty() {
                return Some(o);
            }
            if let Some(o) = self.intercept_internal(o) {
                return Some(o);
            }
        }
    }

    /// When to call [`handle_timeout`](Self::handle_timeout) next: the earliest authentication
    /// deadline of a stream, or the next retention sweep (once a second while any stream retains
    /// by age).
    pub fn poll_timeout(&self) -> Option<Instant> {
        let auth = self.timers.auth.first().map(|(d, _, _)| *d);
        let sweep = if self.timers.checkpoint_owed {
            self.timers.sweep.or_else(|| self.clock.last())
        } else {
            self.timers.sweep.filter(|_| {
                self.node.aged_streams > 0 || !self.node.caches.is_empty() || self.node.limits.counts_retained()
            })
        };
        let expiry =
            self.timers.expiries.first().map(|(secs, _, _, _)| self.wall.instant_at(secs.saturating_mul(1_000_000)));
        let resume = self.timers.rate.first().map(|(t, _, _)| *t);
        // An event waiting (a hold that may end, a stream to read again) is due at once; a hold
        // ends at its deadline.
        let hold =
            if !self.events.pending() { self.timers.holds.first().map(|(t, _, _)| *t) } else { self.clock.last() };
        [auth, sweep, self.groups_deadline(), self.forward_deadline(), expiry, resume, hold].into_iter().flatten().min()
    }

    /// Timers: ends control streams that did not authenticate in time (the connection stays:
    /// existing clients open pooled connections and authenticate a stream only when they first
    /// use it), applies retention.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock.advance(now);
        self.expire_holds(now);
        // Streams paused for their tenant's rate are read again once it is back under.
        while let Some(&(at, conn, stream)) = self.timers.rate.first()
            && at <= now
        {
            self.timers.rate.pop_first();
            let resumed = self
                .conns
                .get_mut(&conn)
                .and_then(|c| c.streams.get_mut(&stream))
                .is_some_and(|st| st.pauses.remove(Pause::Rate));
            if resumed {
                self.owe_resume(conn, stream);
                self.drive_stream(conn, stream, now);
            }
        }
        // Subscriptions and watches whose signed token expired end `revoked`.
        let secs = self.wall.micros(now) / 1_000_000;
        while let Some((exp, conn, id, _)) = self.timers.expiries.first().cloned()
            && exp <= secs
        {
            self.timers.expiries.pop_first();
            if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) {
                sub.on(SubEvent::End(Ending::Revoked { expired: true }));
                self.pump(conn, id);
            }
        }
        let mut expired = Vec::new();
        while let Some(&(d, conn, sid)) = self.timers.auth.first()
            && d <= now
        {
            self.timers.auth.pop_first();
            expired.push((conn, sid));
        }
        for (conn, sid) in expired {
            let Some((st, mut a)) = self.stream_answering(conn, sid) else { continue };
            if st.auth_deadline.take().is_none() {
                // Authenticated since.
                continue;
            }
            if st.recv != Recv::Closed {
                a.stats.auth_timeouts += 1;
                let r = Refusal::new(ErrorCode::Unauthenticated, "authentication timeout").closing();
                a.refuse(conn, st, r);
                a.maybe_finish(conn, st);
            }
        }
        self.forwards_timeout(now);
        if self.timers.sweep.is_none_or(|t| t <= now) {
            self.enforce_retention(None, now, true);
            self.recount_retained();
            self.cache_sweep(now);
            self.timers.sweep = Some(crate::transport::after(now, std::time::Duration::from_secs(1)));
        }
        self.groups_timeout(now);
        self.run_events(now);
    }

    /// Applies retention to every shard of `k` (or every stream when `None`), telling storage
    /// when a durable shard's start moved, with the state of a shard that holds commit state
    /// when its start moved since it last did: at most once a second from a write (encoding a
    /// large state with every write would cost more than the write), at once when `checkpoint`
    /// (the sweep, a restore).
    fn enforce_retention(&mut self, only: Option<&Key>, now: Instant, checkpoint: bool) {
        let now_micros = self.wall.micros(now);
        // In key order: the truncations it asks storage for come in the same order every run.
        let mut keys: Vec<Key> = match only {
            Some(k) => vec![k.clone()],
            None => self.node.streams.keys().cloned().collect(),
        };
        keys.sort_unstable();
        if only.is_none() {
            self.timers.checkpoint_owed = false; // every shard is looked at now
        }
        let mut owed = false;
        for k in &keys {
            let Some(entry) = self.node.streams.get_mut(k) else { continue };
            for (i, shard) in entry.shards.iter_mut().enumerate() {
                let replicated = entry.config.replication > 1 || shard.serving.is_replica();
                if shard.state.holds_state() && replicated && !self.membership.commit_state_snapshots {
                    // Some member would take a snapshot of the shard without its commit state:
                    // its log is where the state lives, so nothing may go.
                    continue;
                }
                let before = shard.log.start();
                let after = shard.log.enforce_retention(now_micros);
                // The commits that wrote the state may go with the segments: storage keeps the
                // state itself first. (A replica's state goes in its group's snapshots.)
                let state_checkpoint = if entry.config.durable && !replicated {
                    shard.state.due_checkpoint(after, now, checkpoint)
                } else {
                    None
                };
                owed |= state_checkpoint.is_none() && shard.state.checkpoint_owed(after) && !replicated;
                if after <= before && state_checkpoint.is_none() {
                    continue;
                }
                let producers_forgotten = if after > before { shard.producers.retain_from(after) } else { Vec::new() };
                if entry.config.durable {
                    self.out.push_back(BrokerOutput::Storage(StorageOutput::Truncate {
                        tenant_id: k.tenant().to_owned(),
                        namespace: k.namespace().to_owned(),
                        stream: k.name().to_owned(),
                        shard: i as u32,
                        start: after,
                        producers_forgotten,
                        state_checkpoint,
                    }));
                }
            }
        }
        self.timers.checkpoint_owed |= owed;
    }

    // -----------------------------------------------------------------------------------------
    // Connections and streams

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
}

#[cfg(test)]
mod tests {
    use super::{Pause, Pauses};

    /// Whether `part` lies within `whole`'s memory (a slice of it, not a copy).
    pub(super) fn within(part: &[u8], whole: &[u8]) -> bool {
        let (p, w) = (part.as_ptr() as usize, whole.as_ptr() as usize);
        !part.is_empty() && p >= w && p + part.len() <= w + whole.len()
    }

    #[test]
    fn owned_copies_out_of_the_buffer() {
        let buffer = bytes::Bytes::from(vec![1u8; 4096]);
        let slice = buffer.slice(10..20);
        assert!(within(&slice, &buffer), "the check sees a slice");
        let copy = super::owned(&slice);
        assert_eq!(copy, slice);
        assert!(!within(&copy, &buffer));
    }

    #[test]
    fn pauses_owe_one_pause_and_one_resume_however_reasons_overlap() {
        let mut p = Pauses::default();
        assert!(!p.any());
        assert!(p.add(Pause::Storage), "first reason: pause");
        assert!(!p.add(Pause::Flush), "second reason: already paused");
        assert!(!p.add(Pause::Flush), "same reason twice");
        assert!(!p.remove(Pause::Window), "a reason it did not have");
        assert!(!p.remove(Pause::Storage), "one reason left");
        assert!(p.any() && p.has(Pause::Flush) && !p.has(Pause::Storage));
        assert!(p.remove(Pause::Flush), "last reason: resume");
        assert!(!p.remove(Pause::Flush), "resumed once");
        assert!(!p.any());
    }
}
