//! What the broker tells its driver: outputs, storage requests and results, admission, counters.

use super::*;
use crate::transport::{ConnId, OpenToken, StreamId};
use bytes::Bytes;

/// Storage's requests and results: defined with storage (a floor below the broker), named here
/// too because the broker's outputs carry them.
pub use crate::storage::{PersistRequest, ReadRequest, WriteOutcome};

/// Something the driver must do. Match it exhaustively (it is deliberately not
/// `#[non_exhaustive]`): a new variant is a new duty, and a catch-all arm would drop it silently.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BrokerOutput {
    /// For the transport ([`TransportOutput`]).
    Transport(TransportOutput),
    /// For storage ([`StorageOutput`]).
    Storage(StorageOutput),
    /// For the cluster ([`ClusterOutput`]).
    Cluster(ClusterOutput),
}

/// What the driver does on the client connections' transport: write, finish or stop a stream,
/// open one, pause or resume reading one, close a connection.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TransportOutput {
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
    /// Close the connection.
    CloseConnection {
        /// Connection.
        conn: ConnId,
        /// QUIC application error code (see [`close_code`](crate::transport::close_code)).
        code: u64,
        /// Human-readable reason.
        reason: String,
    },
}

/// What the driver's storage does: persist a batch, read history, truncate for retention, delete
/// a stream or reset a shard. A broker without storage answers writes itself (see
/// [`crate::storage::MemoryOnly`]).
#[derive(Debug, Clone, PartialEq, Eq)]
// A write is the output of every durable publish: boxing it would cost an allocation per batch
// to save bytes in the rarer variants' slots.
#[allow(clippy::large_enum_variant)]
pub enum StorageOutput {
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
        /// The shard's commit state as a checkpoint
        /// ([`crate::storage::encode_state_checkpoint`]) when it holds any: storage writes it
        /// whole and durably (replacing the last one) *before* deleting a segment, and hands
        /// it back at recovery as [`crate::storage::RecoveredShard::state_checkpoint`], since
        /// the commits that wrote it go with the segments. A new owner of a moved shard asks
        /// for it with `start` at its copy's start (nothing to delete).
        state_checkpoint: Option<Bytes>,
    },
    /// A stream was deleted: storage removes everything it holds (after the writes asked for
    /// before this), so a restart does not bring it back.
    DeleteStream {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
    },
    /// A durable stream was created (`stream_create`, D60): storage records its shard count
    /// (the stream directory's `meta`) and syncs it, then reports with
    /// [`Broker::handle_stream_recorded`], so a restart brings the stream back with its shards
    /// even before its first record.
    CreateStream {
        /// Names the report.
        token: crate::transport::WriteToken,
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Its shard count.
        shards: u32,
    },
    /// Storage removes everything it holds of one shard (after the writes asked for before
    /// this): a shard moving here is copied from the old owner's start, whatever was here
    /// from an earlier stay. Writes asked for after this land in the emptied shard.
    ResetShard {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Shard.
        shard: u32,
    },
}

/// What only a broker of a cluster produces, for [`crate::cluster::node::ClusterNode`] (which
/// turns each into peer messages or metadata proposals). A single broker never emits one: its
/// driver matches the group once and has nothing to do for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ClusterOutput {
    /// Send a publish to the broker `to` owns its shard (a clustered broker): deliver it to
    /// that broker's [`Broker::handle_forwarded`], or, when it cannot be reached, report
    /// [`Broker::handle_forward_failed`] (an acked one is then answered `shard_unavailable`).
    Forward {
        /// The owner's node id.
        to: String,
        /// The publish.
        publish: super::ForwardedPublish,
    },
    /// The answer to a publish broker `to` forwarded here: deliver it to that broker's
    /// [`Broker::handle_forward_answer`].
    ForwardAnswer {
        /// The origin's node id.
        to: String,
        /// The forward id the origin named it by.
        id: u64,
        /// Appended (with the offset) or refused.
        outcome: super::ForwardOutcome,
    },
    /// Send a cache or counter request to the broker `to` that owns its cache: deliver it to
    /// that broker's `Broker::handle_forwarded_request`, or, when it cannot be reached,
    /// report `Broker::handle_forward_request_failed`.
    ForwardRequest {
        /// The owner's node id.
        to: String,
        /// The request.
        request: super::ForwardedRequest,
    },
    /// The answer to a request broker `to` forwarded here: deliver it to that broker's
    /// `Broker::handle_forward_request_answer`.
    ForwardRequestAnswer {
        /// The origin's node id.
        to: String,
        /// The forward id the origin named it by.
        id: u64,
        /// The answer, as frames built for the client.
        data: Bytes,
    },
    /// A clustered broker met a cache the cluster does not know yet: propose its creation
    /// (one shard) to the metadata group.
    ProposeCache {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Cache.
        cache: String,
        /// Its replicas (1: not replicated).
        replication: u32,
    },
    /// A clustered broker met a stream the cluster does not know yet: propose its creation to
    /// the metadata group ([`crate::cluster::node::ClusterNode`] does). Meanwhile requests for
    /// it are answered `shard_unavailable` (retry): no broker writes a stream nobody owns.
    ProposeStream {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
        /// Its shard count.
        shards: u32,
        /// Kept in memory only (its shards move freely when their owner goes down).
        ephemeral: bool,
        /// Replicas per shard (1: one, on its owner's disk; more: a `quorum` stream).
        replication: u32,
    },
    /// Propose this batch to the Raft group of a replicated shard this broker leads
    /// ([`crate::cluster::node::ClusterNode`] does): it becomes visible once the group commits
    /// it (`Broker::apply_replicated`), and the publish is answered with the group's answer
    /// (`Broker::handle_replicated`, same `token`).
    Replicate {
        /// Names the publish in the answer.
        token: crate::transport::WriteToken,
        /// The shard.
        shard: crate::shard::ShardId,
        /// The batch as replicated.
        batch: crate::shard::replicated::ReplicatedBatch,
    },
    /// A clustered broker was asked to delete a stream: propose the deletion to the metadata
    /// group; every broker deletes its part once it is committed ([`Broker::apply_cluster`]).
    ProposeStreamDeletion {
        /// Tenant.
        tenant_id: String,
        /// Namespace.
        namespace: String,
        /// Stream.
        stream: String,
    },
    /// Send this message to broker `to` of the cluster (a shard copy's request or answer;
    /// [`crate::cluster::node::ClusterNode`] does).
    Copy {
        /// Node id.
        to: String,
        /// The message.
        message: crate::shard::copy::CopyMessage,
    },
    /// Propose this metadata command (a move's cut-over, finish or cancel;
    /// [`crate::cluster::node::ClusterNode`] does).
    ProposeCluster(crate::shard::metadata::Command),
    /// An operator's request over the client protocol (D52) for the cluster node to answer
    /// with `Broker::handle_cluster_admin_answer`. Never sent by a broker that runs alone.
    ClusterAdmin {
        /// Echoed in the answer.
        id: u64,
        /// What is asked.
        request: super::cluster_admin::ClusterAdminRequest,
    },
}

impl Broker {
    /// A [`ClusterOutput`] that reached a driver without a cluster (a single broker's, or
    /// one whose cluster node did not take it): what needs an answer gets the one a cluster
    /// that cannot be reached gives (a forward failed: `shard_unavailable`; a replicated
    /// write: leadership lost, outcome unknown), the rest needs nothing. A single-broker
    /// driver matches [`BrokerOutput::Cluster`] once and hands it here, so no output is dropped
    /// without an answer.
    pub fn handle_cluster_output_alone(&mut self, out: ClusterOutput, now: std::time::Instant) {
        match out {
            ClusterOutput::Forward { publish, .. } => self.handle_forward_failed(publish.id, now),
            ClusterOutput::ForwardRequest { request, .. } => self.handle_forward_request_failed(request.id, now),
            ClusterOutput::Replicate { token, .. } => {
                self.handle_replicated(token, crate::shard::replicated::Answer::LeadershipLost, now);
            }
            ClusterOutput::ForwardAnswer { .. }
            | ClusterOutput::ForwardRequestAnswer { .. }
            | ClusterOutput::ProposeCache { .. }
            | ClusterOutput::ProposeStream { .. }
            | ClusterOutput::ProposeStreamDeletion { .. }
            | ClusterOutput::Copy { .. }
            | ClusterOutput::ProposeCluster(_)
            | ClusterOutput::ClusterAdmin { .. } => {}
        }
    }
}

/// Counters, for metrics and tests.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct BrokerStats {
    /// Connections opened.
    pub connections_opened: u64,
    /// Publishes forwarded to the owner of their shard (clustered brokers).
    pub publishes_forwarded: u64,
    /// Publishes other brokers forwarded here.
    pub publishes_forwarded_in: u64,
    /// Cache and counter requests forwarded to their cache's owner.
    pub requests_forwarded: u64,
    /// Control streams refused `draining` (authenticated while the broker was shutting down).
    pub auths_refused_draining: u64,
    /// Cache and counter requests other brokers forwarded here.
    pub requests_forwarded_in: u64,
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
    /// Binary publish frames that arrived compressed (D56), and their bytes: compressed as
    /// received, and plain.
    pub publishes_compressed: u64,
    /// Compressed bytes of those frames' record blocks.
    pub compressed_bytes_in: u64,
    /// Plain bytes those blocks inflated to.
    pub compressed_plain_bytes_in: u64,
    /// Times a subscription filter (D57) judged a batch: once per batch and distinct filter
    /// at fan-out, once per batch and subscription when catching up.
    pub filter_evaluations: u64,
    /// Records appended.
    pub records_appended: u64,
    /// Publishes refused.
    pub publishes_refused: u64,
    /// Publishes refused (or, unacked, dropped) for their tenant's rate limit.
    pub publishes_rate_limited: u64,
    /// Requests refused `limit_exceeded` by a tenant's quota (connections, streams).
    pub quota_refusals: u64,
    /// Failed unacknowledged binary publishes (no answer is sent for these).
    pub unacked_failures: u64,
    /// Event batches written to event streams.
    pub batches_delivered: u64,
    /// Records dropped from subscriber queues.
    pub records_dropped: u64,
    /// Times a publishing stream was held (not read) for an ephemeral shard's slow subscriber.
    pub publishers_held: u64,
    /// Subscribers that held their shard's publishers as long as allowed and were left behind.
    pub subscribers_excused: u64,
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
