//! Broker configuration: pure data, built by the driver from files, flags and the environment.

use super::auth::TokenGrant;
use crate::features::Features;
use crate::flags::Flags;
use crate::message::Routing;
use std::time::Duration;

/// How long a shard keeps records in memory (and, for durable streams, on disk).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Retention {
    /// Keep at most this many records.
    pub max_records: Option<u64>,
    /// Keep at most this many payload bytes.
    pub max_bytes: Option<u64>,
    /// Drop records older than this.
    pub max_age: Option<Duration>,
}

/// When a stream's appends reach the disk: storage's policy (defined with storage).
pub use crate::storage::FsyncMode;

/// Configuration of one stream.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamConfig {
    /// Durable streams give records offsets and persist them; ephemeral ones keep no history.
    pub durable: bool,
    /// Number of shards (at least 1).
    pub shards: u32,
    /// How keys map to shards.
    pub routing: Routing,
    /// Retention of a durable stream's history.
    pub retention: Retention,
    /// Default subscriber queue capacity, in published batches.
    pub queue_capacity: u32,
    /// Payload bytes of a durable shard's history kept in memory when the broker can read
    /// history back from storage (`BrokerConfig::history_reads`); older history is read from
    /// disk on demand.
    pub memory_bytes: u64,
    /// This stream's fsync policy; `None` uses the storage's default.
    pub fsync: Option<FsyncMode>,
    /// Replicas of each shard in a cluster (`quorum` durability): 1 keeps a shard on its
    /// owner's disk; 3 (say) makes every shard its own Raft group over three brokers, a write
    /// acknowledged once a majority holds it. Ignored outside a cluster and for streams kept
    /// in memory.
    pub replication: u32,
}

/// The default subscriber queue, in published batches (the in-process bench always used it).
/// A subscriber paused for a moment is not dropped from as soon: 1024 batches of 64 small
/// records are 38 ms at 1.7M records/s, and on a 2-core machine shared by `serve` and a bench
/// publishing unacked as fast as it can, 1024 dropped in 5 runs of 6 and 4096 in 2 of 6 (a
/// subscriber given less CPU than its publisher for seconds falls behind whatever the queue).
/// The queue's bytes stay capped by `subscriber_queue_bytes_max` whatever the count, so large
/// records take no more memory.
pub const DEFAULT_SUBSCRIBER_QUEUE_CAPACITY: u32 = 4096;

/// The default [`BrokerConfig::publisher_hold_max`]: a subscriber paused by its machine for a
/// moment (a busy core, a collector) slows its publishers instead of losing records, and one
/// that stopped costs them a second, once.
pub const DEFAULT_PUBLISHER_HOLD_MAX: Duration = Duration::from_secs(1);

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            durable: true,
            shards: 1,
            routing: Routing::Modulo,
            retention: Retention { max_records: Some(1_000_000), max_bytes: Some(256 << 20), max_age: None },
            queue_capacity: DEFAULT_SUBSCRIBER_QUEUE_CAPACITY,
            memory_bytes: 64 << 20,
            fsync: None,
            replication: 1,
        }
    }
}

/// A stream named in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamSpec {
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream name.
    pub name: String,
    /// Its configuration.
    pub config: StreamConfig,
}

/// A cache named in the configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheSpec {
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Cache name.
    pub name: String,
    /// Its values survive a restart: every change is written to its system log
    /// (`$cache.NAME`) before the write is answered.
    pub durable: bool,
    /// Replicas of the cache in a cluster (`quorum` durability): 1 keeps it on its owner;
    /// 3 (say) makes its changes the log of a Raft group over three brokers, a write answered
    /// once a majority holds it. Ignored outside a cluster.
    pub replication: u32,
}

/// Everything the broker state machine needs to know about its configuration.
#[derive(Debug, Clone)]
pub struct BrokerConfig {
    /// This node's id (in `not_leader`, `shard_moved`, inspect answers).
    pub node_id: String,
    /// Part of a cluster, where a shard can be owned by another broker: advertises
    /// FEATURE_REDIRECT and answers a request for a shard owned elsewhere `not_leader` to a
    /// client that offered it. A standalone broker (the default) advertises neither REDIRECT nor
    /// TOPOLOGY: it owns every shard, and a client must not be told it may be redirected.
    pub clustered: bool,
    /// Largest payload after `auth`.
    pub max_frame_len: u32,
    /// Largest payload on a stream that has not authenticated yet.
    pub preauth_max_frame_len: u32,
    /// Pipelined-publish window granted per stream; 0 disables pipelining.
    pub publish_window: u32,
    /// Answer every acked publish only after its write (with offsets), for every client.
    pub ack_on_commit: bool,
    /// Credentials.
    pub tokens: Vec<TokenGrant>,
    /// Client certificates (mutual TLS) as credentials: an `auth` with an empty token on a
    /// connection whose verified certificate carries the name in `token` (its subject common
    /// name or a subject alternative name, as the driver reports it with
    /// [`Broker::set_peer_certificate`](super::Broker::set_peer_certificate)) authenticates as
    /// that entry's tenant and principal, with its grants.
    pub client_certs: Vec<TokenGrant>,
    /// Per-tenant publish rate limits (none: unlimited).
    pub tenant_limits: Vec<super::TenantLimit>,
    /// Signed tokens (JWT, EdDSA) accepted besides the static ones.
    pub jwt: Option<crate::jwt::Verifier>,
    /// Streams created at start.
    pub streams: Vec<StreamSpec>,
    /// Caches created at start.
    pub caches: Vec<CacheSpec>,
    /// Caches created on first use are durable (their values survive a restart).
    pub durable_caches: bool,
    /// Replicas of a cache a cluster creates on first use (1: on its owner only).
    pub cache_replication: u32,
    /// Create unknown streams and caches on first use (with `default_stream`), instead of
    /// answering `not_found`.
    pub auto_create: bool,
    /// Configuration of auto-created streams.
    pub default_stream: StreamConfig,
    /// Largest subscriber queue a subscriber may ask for (`queue_capacity` is clamped to it).
    pub subscriber_queue_capacity_max: u32,
    /// Bytes of event frames one subscriber's queue may hold, whatever its capacity in batches:
    /// batches can be up to `max_frame_len` each, so a count alone does not bound the memory a
    /// slow subscriber pins. A batch that would pass it is dropped as one over the capacity is
    /// (a gap, or `subscription_lagged`); a batch always fits an empty queue.
    pub subscriber_queue_bytes_max: usize,
    /// Most subscriptions one connection may hold.
    pub max_subscriptions_per_connection: u32,
    /// Bytes written to one event stream and not yet flushed by the driver, before the broker
    /// stops writing to it and lets the subscriber's queue fill.
    pub event_stream_inflight_bytes: usize,
    /// How long an ephemeral stream's publishers may be held for a slow subscriber. When a live
    /// subscriber's queue of a stream kept in memory passes half its capacity (in batches or
    /// bytes), the broker stops reading the streams that publish to that shard, so QUIC flow
    /// control slows the publishers instead of the subscriber losing records; they are read
    /// again once every such queue is back under a quarter. A subscriber that holds them this
    /// long (stopped, or far slower than its publishers) is left behind: it no longer holds
    /// anyone until its queue drains, and what overflows its queue is dropped (offset gaps, or
    /// `subscription_lagged`). Zero: never hold, drop at once when a queue is full. Durable
    /// streams never hold: a subscriber that falls behind reads on from the log.
    pub publisher_hold_max: Duration,
    /// A control stream that does not authenticate within this is ended with `unauthenticated`
    /// (the connection stays). Also how long a connection may stay unauthenticated before it
    /// can be closed to make room under `max_unauthenticated_connections`.
    pub auth_timeout: Duration,
    /// Connections that authenticated no stream yet, in all (see `Broker::admit`).
    pub max_unauthenticated_connections: usize,
    /// Connections that authenticated no stream yet, per peer address.
    pub max_unauthenticated_per_peer: usize,
    /// The driver can read history back from storage (`StorageOutput::Read`), so durable shards
    /// keep only `memory_bytes` of history in memory. Off: all retained history stays in memory.
    pub history_reads: bool,
    /// Most payload bytes one history read returns.
    pub history_read_bytes: usize,
    /// Payload bytes a durable shard may have waiting for storage before the broker stops
    /// reading the streams that publish to it (resumed below half of it). Keeps memory bounded
    /// when publishers outrun the disk.
    pub max_pending_write_bytes: u64,
    /// Most records one `stream_read` page returns (FELIX_MAX_RECORDS_PER_READ).
    pub max_records_per_read: u32,
    /// Most payload bytes one `stream_read` page returns (a single larger record still comes).
    pub max_read_bytes: u64,
    /// Answer bytes a control stream may have handed to the driver and not yet flushed to the
    /// client before the broker stops reading its requests (resumed below half of it).
    pub control_stream_unflushed_bytes: usize,
    /// Consumer-group limits.
    pub group_limits: super::group::GroupLimits,
    /// Seed of the broker's random choices (producer ids). The driver passes real randomness;
    /// this crate never gathers any itself.
    pub random_seed: u64,
}

impl Default for BrokerConfig {
    fn default() -> Self {
        BrokerConfig {
            node_id: "felix-1".into(),
            clustered: false,
            max_frame_len: crate::frame::DEFAULT_MAX_FRAME_LEN,
            preauth_max_frame_len: 64 * 1024,
            publish_window: 256,
            ack_on_commit: false,
            tokens: Vec::new(),
            client_certs: Vec::new(),
            tenant_limits: Vec::new(),
            jwt: None,
            streams: Vec::new(),
            caches: Vec::new(),
            durable_caches: false,
            cache_replication: 1,
            auto_create: true,
            default_stream: StreamConfig::default(),
            subscriber_queue_capacity_max: 65_536,
            subscriber_queue_bytes_max: 256 << 20,
            max_subscriptions_per_connection: 4096,
            event_stream_inflight_bytes: 1 << 20,
            publisher_hold_max: DEFAULT_PUBLISHER_HOLD_MAX,
            auth_timeout: Duration::from_secs(10),
            max_unauthenticated_connections: 1024,
            max_unauthenticated_per_peer: 64,
            history_reads: false,
            history_read_bytes: 1 << 20,
            max_pending_write_bytes: 32 << 20,
            max_records_per_read: 1000,
            max_read_bytes: 4 << 20,
            random_seed: 0,
            group_limits: super::group::GroupLimits::default(),
            control_stream_unflushed_bytes: 4 << 20,
        }
    }
}

impl BrokerConfig {
    /// The flag bits this broker implements (advertised in full, decision D8).
    pub fn server_flags(&self) -> Flags {
        Flags::KNOWN
    }

    /// The second-word flag bits this broker implements (D56, D58): both codecs and
    /// envelopes, in a cluster too (forwarded and replicated batches carry them, D59). Shown
    /// only to a client that set [`Flags::EXTENDED`].
    pub fn server_flags_hi(&self) -> crate::flags::FlagsHi {
        crate::flags::FlagsHi::KNOWN
    }

    /// The feature bits this broker advertises: only what it serves end to end.
    pub fn server_features(&self) -> Features {
        let mut f = Features::CACHE_DELETE
            | Features::STREAM_SHARDS
            | Features::CACHE_SHARDS
            | Features::ERROR_CODES
            | Features::SHARD_MOVED
            | Features::UNSUPPORTED
            | Features::ACK_ON_COMMIT
            | Features::SUBSCRIPTION_LAGGED
            | Features::SUBSCRIBE_QUEUE
            | Features::STREAM_DELETED
            | Features::PUBLISH_WIDTH
            | Features::EXPLICIT_SHARD
            | Features::CACHE_CONDITIONAL
            | Features::STREAM_READ
            | Features::RECORD_TIMESTAMPS
            | Features::IDEMPOTENT_PRODUCER
            | Features::SEQUENCE_REUSED
            | Features::PUBLISH_CONDITIONAL
            | Features::CACHE_WATCH
            | Features::CACHE_WATCH_RETAINED
            | Features::STREAM_ADMIN
            | Features::LISTING
            | Features::STREAM_INFO
            | Features::CLUSTER_ADMIN
            | Features::STATUS_PAGES
            | Features::INSPECT;
        if self.history_reads {
            // Counters, group positions and commit state must survive a restart: only a broker
            // with storage offers them.
            f |= Features::ATOMIC_COMMIT
                | Features::COUNTERS
                | Features::CONSUMER_GROUP
                | Features::GROUP_DEAD_LETTERS
                | Features::GROUP_CLAIM_CONTROL
                | Features::GROUP_CONSUMER
                | Features::GROUP_ADMIN
                | Features::GROUP_SKIPPED
                | Features::GROUP_PUBLISHER;
        }
        if self.publish_window > 0 {
            f |= Features::PUBLISH_PIPELINE | Features::STREAM_PUBLISH_WINDOW;
        }
        if self.clustered {
            f |= Features::REDIRECT | Features::TOPOLOGY | Features::SHARD_OWNERS;
        }
        // In a cluster too: forwarded and replicated batches carry their keys (D59).
        f |= Features::STREAM_FILTER | Features::STREAM_CREATE;
        f
    }
}
