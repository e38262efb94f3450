//! The broker over QUIC.
//!
//! One task owns the [`Broker`] state machine and is the only place protocol decisions are
//! taken. Around it:
//! * an accept task per connection turns new QUIC streams into inputs;
//! * a reader task per client stream forwards `read_chunk` results (cancel-safe) and can be
//!   paused (a full publish window: QUIC flow control then slows the client) or stopped;
//! * a writer task per stream writes what the broker transmits (writes are not cancel-safe, so
//!   they never sit in a `select!`), and reports flushed bytes (answer backpressure, subscriber credit);
//! * a storage thread appends durable records and reports each write.
//!
//! No task ever waits on an acknowledgement-driven event (`SendStream::stopped()`): finishing a
//! stream is fire-and-forget.

use crate::storage::{DiskStorage, FsyncMode, RecoveredShard};
use crate::tls::{Identity, quic_server_crypto_with};
use crate::{ReadEvent, ReadGate};
use bytes::Bytes;
pub use felix_driver_common::transport::{
    DEFAULT_MAX_UDP_PAYLOAD, GSO_SAFE_MAX_UDP_PAYLOAD, TransportTuning, is_loopback,
};
use felix_driver_common::transport::{INITIAL_BI_STREAMS, INITIAL_UNI_STREAMS, StreamCredit};
use felix_proto::broker::{
    Broker, BrokerConfig, BrokerOutput, PersistRequest, StorageOutput, TransportOutput, WriteOutcome,
};
use felix_proto::transport::{ConnId, OpenToken, StreamId, WallClock, WriteToken, close_code};
use quinn::VarInt;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot, watch};

mod storage_thread;
use storage_thread::*;
mod http;
pub use http::*;
mod stalls;
use stalls::{slow_turn, stall_watch};
mod streams;
use streams::*;
mod metrics;
mod outputs;

/// A UDP socket bound to `addr` with the buffers `tuning` asks for (GSO/GRO and ECN are
/// enabled by quinn-udp where the platform has them).
pub(crate) fn udp_socket(addr: SocketAddr, tuning: &TransportTuning) -> std::io::Result<std::net::UdpSocket> {
    let socket = std::net::UdpSocket::bind(addr)?;
    let s = socket2::SockRef::from(&socket);
    for (what, res) in [
        ("receive", s.set_recv_buffer_size(tuning.udp_buffer_bytes)),
        ("send", s.set_send_buffer_size(tuning.udp_buffer_bytes)),
    ] {
        if let Err(e) = res {
            tracing::warn!("could not set the UDP {what} buffer to {} bytes: {e}", tuning.udp_buffer_bytes);
        }
    }
    tracing::debug!("UDP buffers: receive {:?}, send {:?}", s.recv_buffer_size().ok(), s.send_buffer_size().ok());
    Ok(socket)
}

/// Everything a broker needs to start.
#[derive(Debug)]
pub struct ServerOptions {
    /// UDP address to listen on.
    pub listen: SocketAddr,
    /// The protocol configuration.
    pub broker: BrokerConfig,
    /// TLS certificate and key.
    pub identity: Identity,
    /// Where durable streams live; `None` keeps durable streams in memory only.
    pub data_dir: Option<PathBuf>,
    /// When appends are forced to disk.
    pub fsync: FsyncMode,
    /// QUIC settings.
    pub transport: TransportTuning,
    /// Refuse clients that offer no ALPN (by default they are accepted, as existing clients
    /// offer none).
    pub require_alpn: bool,
    /// Serve Prometheus metrics over HTTP on this TCP address (off when `None`); with a
    /// cluster, `GET /cluster` there answers the cluster's state as JSON.
    pub metrics_listen: Option<SocketAddr>,
    /// Serve the operator web view on this TCP address, behind this token (off when `None`).
    pub http: Option<(SocketAddr, String)>,
    /// Run as a broker of a cluster (`None`: a single broker, as always).
    pub cluster: Option<crate::cluster::ClusterOptions>,
    /// Ask clients for a certificate and verify it against these CA certificates (mutual
    /// TLS); the names of a verified one are given to the broker, which maps them to a
    /// credential (`BrokerConfig::client_certs`). `None`: no client certificates.
    pub client_ca: Option<Vec<crate::tls::CertificateDer<'static>>>,
}

/// Why the server could not start (shared with the blocking driver).
pub use felix_driver_common::StartError as ServerError;

/// A running broker.
#[derive(Debug)]
pub struct Server {
    local_addr: SocketAddr,
    /// Feeds the broker task (to ask it to drain).
    inputs: mpsc::UnboundedSender<Input>,
    shutdown: Option<oneshot::Sender<()>>,
    done: Option<tokio::task::JoinHandle<()>>,
    /// What storage repaired at start (torn or corrupt tails).
    pub repairs: Vec<String>,
    /// Records recovered at start.
    pub recovered_records: u64,
    /// Where metrics are served, when enabled.
    pub metrics_addr: Option<SocketAddr>,
    /// Where the web view is served, when enabled.
    pub http_addr: Option<SocketAddr>,
    /// Where the cluster listener is, for a broker of a cluster.
    pub cluster_addr: Option<SocketAddr>,
}

impl Server {
    /// The address the broker listens on (useful with port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Serves another certificate (a renewed one) to new connections from now on; connections
    /// already open keep theirs and are not dropped.
    ///
    /// # Errors
    /// A certificate and key rustls refuses (nothing changes then).
    pub async fn set_identity(&self, identity: Identity) -> Result<(), String> {
        let (tx, rx) = oneshot::channel();
        self.inputs
            .send(Input::SetIdentity(Box::new(identity), tx))
            .map_err(|_| "the broker has stopped".to_string())?;
        rx.await.map_err(|_| "the broker has stopped".to_string())?
    }

    /// Replaces the signed-token configuration of the running broker (a reloaded JWK set or
    /// revocations: [`felix_proto::broker::Broker::set_jwt`]).
    pub fn set_jwt(&self, verifier: Option<felix_proto::jwt::Verifier>) {
        let _ = self.inputs.send(Input::SetJwt(verifier));
    }

    /// Drains, then stops: takes no new work (new connections are refused, a control stream
    /// authenticating is answered `draining`: connect elsewhere), serves what is open and
    /// waits for what is in flight (writes storage has not confirmed, forwards not answered)
    /// for at most `grace`, then stops as [`shutdown`](Self::shutdown) does. Returns how much
    /// work was still in flight when it stopped (0: nothing was cut short).
    pub async fn drain(mut self, grace: std::time::Duration) -> usize {
        let (tx, rx) = oneshot::channel();
        let left = if self.inputs.send(Input::Drain { grace, reply: tx }).is_ok() { rx.await.unwrap_or(0) } else { 0 };
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
        left
    }

    /// Stops accepting, flushes storage, and closes every connection with code 0.
    pub async fn shutdown(mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(done) = self.done.take() {
            let _ = done.await;
        }
    }

    /// Starts a broker: recovers storage, binds, and serves until [`shutdown`](Self::shutdown).
    ///
    /// # Errors
    /// TLS, socket or storage failures.
    pub async fn start(opts: ServerOptions) -> Result<Server, ServerError> {
        let (qcfg, loopback_cfg) =
            server_configs(opts.identity, opts.require_alpn, opts.client_ca.as_deref(), &opts.transport)?;
        let loopback_cfg = Arc::new(loopback_cfg);
        if opts.transport.max_udp_payload > GSO_SAFE_MAX_UDP_PAYLOAD {
            tracing::warn!(
                "max UDP payload {} is above {GSO_SAFE_MAX_UDP_PAYLOAD}: the kernel refuses segmentation-offload batches that large, so packets go out one system call each",
                opts.transport.max_udp_payload
            );
        }
        let socket = udp_socket(opts.listen, &opts.transport)?;
        let endpoint =
            quinn::Endpoint::new(opts.transport.endpoint_config(), Some(qcfg), socket, Arc::new(quinn::TokioRuntime))?;
        let local_addr = endpoint.local_addr()?;

        let now = tokio::time::Instant::now().into_std();
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_micros() as u64).unwrap_or(0);
        let unix = felix_driver_common::fault_clock::wall_micros(unix);
        let mut bcfg = opts.broker;
        // With a data directory, history beyond each shard's memory budget is read from disk.
        bcfg.history_reads = opts.data_dir.is_some();
        // Randomness for the broker's choices (producer ids): the core gathers none itself.
        bcfg.random_seed = felix_driver_common::random_seed();
        bcfg.clustered |= opts.cluster.is_some();
        let mut broker = Broker::new(bcfg, WallClock::new(now, unix));

        let mut repairs = Vec::new();
        let mut recovered_records = 0;
        let storage = match &opts.data_dir {
            Some(dir) => {
                let mut disk = DiskStorage::open(dir, opts.fsync)?;
                // Older history is restored from segment indexes; only what the broker keeps in
                // memory is read whole.
                let shards: Vec<RecoveredShard> = disk.recover_within(|t, n, st| broker.memory_budget(t, n, st))?;
                for mut s in shards {
                    repairs.append(&mut s.repairs);
                    recovered_records += broker.restore(s, now);
                }
                Some(disk)
            }
            None => None,
        };

        let (tx, rx) = mpsc::unbounded_channel();
        let mut replica_logs = None;
        let (node, transport, raft_log) = match &opts.cluster {
            None => (Node::Single(Box::new(broker)), None, None),
            Some(c) => {
                let path = opts.data_dir.as_deref().map(crate::cluster::raft_log_path);
                let (path, kept) = match &path {
                    Some(p) => {
                        let (file, kept) = crate::cluster::MetaLog::open(p).map_err(ServerError::Io)?;
                        (Some(file), kept)
                    }
                    None => (None, felix_proto::cluster::meta::RaftLog::default()),
                };
                let incarnation = crate::cluster::incarnation(opts.data_dir.as_deref())?;
                let me = felix_proto::cluster::metadata::Member {
                    id: c.node_id.clone(),
                    client_addr: c.advertise.clone().unwrap_or_else(|| local_addr.to_string()),
                    cluster_addr: c.listen.to_string(),
                    state: felix_proto::cluster::metadata::MemberState::Active,
                    incarnation: incarnation.clone(),
                };
                let peers: Vec<String> = c.peers.iter().map(|(n, _)| n.clone()).collect();
                use felix_proto::cluster::node::ClusterNode;
                let node = if c.join {
                    ClusterNode::joining(broker, me, &kept, now)
                } else {
                    ClusterNode::new(broker, me, &peers, &kept, now)
                }
                .map_err(|e| ServerError::Io(std::io::Error::new(std::io::ErrorKind::InvalidInput, e.to_string())))?;
                let mut node = node;
                if let Some(bytes) = c.replica_entry_cache {
                    node.set_replica_entry_cache(bytes);
                }
                node.set_move_bandwidth(c.move_bandwidth);
                match c.metadata_snapshot_entries {
                    Some(0) => node.set_meta_snapshot_entries(None),
                    Some(n) => node.set_meta_snapshot_entries(Some(n)),
                    None => {}
                }
                // A restart holds as much of each replica's committed log as its entry cache
                // would; the rest is replayed from the files in reads.
                let keep = c.replica_entry_cache.unwrap_or(felix_proto::cluster::node::REPLICA_ENTRY_CACHE);
                // Replicated shards' logs follow the broker's fsync policy (`never` still syncs
                // once a second: a replica's log is what a fail-over stands on).
                let sync_every = match opts.fsync {
                    FsyncMode::Always => None,
                    FsyncMode::Interval(d) => Some(d),
                    FsyncMode::Never => Some(std::time::Duration::from_secs(1)),
                };
                let opened = crate::cluster::ReplicaLogs::open(opts.data_dir.as_deref(), sync_every, Some(keep))
                    .map_err(ServerError::Io)?;
                node.set_kept_replicas(opened.kept);
                node.set_damaged_replicas(opened.damaged);
                replica_logs = Some(opened.logs);
                let secret = c.secret.clone();
                let (ptx, mut prx) = mpsc::unbounded_channel();
                let (cluster_id, _, _) = Identity::self_signed(&["localhost"])?;
                let transport = crate::cluster::Transport::start(c, &incarnation, cluster_id, ptx)?;
                let fwd = tx.clone();
                tokio::spawn(async move {
                    while let Some(p) = prx.recv().await {
                        if fwd.send(Input::Peer(p)).is_err() {
                            return;
                        }
                    }
                });
                (Node::Cluster(Box::new(node)), Some((transport, secret)), Some((path, kept)))
            }
        };
        let cluster_addr = transport.as_ref().and_then(|(t, _)| t.local_addr().ok());
        let (transport, cluster_secret) = match transport {
            Some((t, s)) => (Some(t), Some(s)),
            None => (None, None),
        };
        let metrics_addr = match opts.metrics_listen {
            Some(addr) => {
                let listener = tokio::net::TcpListener::bind(addr).await?;
                let bound = listener.local_addr()?;
                tokio::spawn(metrics_loop(listener, tx.clone(), cluster_secret.clone()));
                Some(bound)
            }
            None => None,
        };
        let http_addr = match &opts.http {
            Some((addr, token)) => {
                let listener = tokio::net::TcpListener::bind(addr).await?;
                let bound = listener.local_addr()?;
                tokio::spawn(web_loop(listener, tx.clone(), token.clone()));
                Some(bound)
            }
            None => None,
        };
        let (htx, hrx) = std::sync::mpsc::channel();
        {
            let (tx, reader) = (tx.clone(), storage.as_ref().map(DiskStorage::history_reader));
            std::thread::Builder::new()
                .name("felix-history".into())
                .spawn(move || history_loop(reader, hrx, tx))
                .map_err(ServerError::Io)?;
        }
        let (stx, srx) = std::sync::mpsc::channel::<StorageCmd>();
        let storage_thread = {
            let tx = tx.clone();
            std::thread::Builder::new()
                .name("felix-storage".into())
                .spawn(move || storage_loop(storage, srx, tx))
                .map_err(ServerError::Io)?
        };
        let (shutdown_tx, shutdown_rx) = oneshot::channel();
        let task = BrokerTask {
            node,
            transport,
            raft_log,
            meta_parts: Vec::new(),
            replica_logs,
            replica_log_reads: 0,
            replica_snapshot_reads: 0,
            gate: ReplicaSyncGate::default(),
            replica_syncer: replica_sync_thread(tx.clone()).map_err(ServerError::Io)?,
            endpoint: endpoint.clone(),
            loopback_cfg,
            conns: HashMap::new(),
            tx: tx.clone(),
            storage: stx,
            history: htx,
            pending_writes: Vec::new(),
            io: IoCounters::default(),
            transport_tuning: opts.transport.clone(),
            require_alpn: opts.require_alpn,
            client_ca: opts.client_ca,
            draining: None,
            started: now,
            web_sample: None,
        };
        let accept = tokio::spawn(accept_loop(endpoint.clone(), tx.clone()));
        let watch = tokio::spawn(stall_watch());
        let done = tokio::spawn(async move {
            task.run(rx, shutdown_rx).await;
            accept.abort();
            watch.abort();
            let _ = tokio::task::spawn_blocking(move || storage_thread.join()).await;
            endpoint.wait_idle().await;
        });
        Ok(Server {
            local_addr,
            inputs: tx.clone(),
            shutdown: Some(shutdown_tx),
            done: Some(done),
            repairs,
            recovered_records,
            metrics_addr,
            http_addr,
            cluster_addr,
        })
    }
}

/// The state machine the broker task drives: a single broker, or a broker of a cluster.
enum Node {
    Single(Box<Broker>),
    Cluster(Box<felix_proto::cluster::node::ClusterNode>),
}

impl Node {
    /// What the driver feeds the broker, single or in a cluster.
    fn inputs(&mut self) -> felix_proto::broker::ConnectionInputs<'_> {
        match self {
            Node::Single(b) => b.inputs(),
            Node::Cluster(n) => n.inputs(),
        }
    }
    fn broker_ref(&self) -> &Broker {
        match self {
            Node::Single(b) => b,
            Node::Cluster(n) => n.broker(),
        }
    }
    fn poll_timeout(&self) -> Option<std::time::Instant> {
        match self {
            Node::Single(b) => b.poll_timeout(),
            Node::Cluster(n) => n.poll_timeout(),
        }
    }
    fn handle_timeout(&mut self, now: std::time::Instant) {
        match self {
            Node::Single(b) => b.handle_timeout(now),
            Node::Cluster(n) => n.handle_timeout(now),
        }
    }
    fn poll_output(&mut self) -> Option<felix_proto::cluster::node::NodeOutput> {
        match self {
            Node::Single(b) => b.poll_output().map(felix_proto::cluster::node::NodeOutput::Broker),
            Node::Cluster(n) => n.poll_output(),
        }
    }
}

/// What the tasks around the broker tell it.
enum Input {
    Incoming(Box<quinn::Incoming>),
    Connected(ConnId, quinn::Connection),
    HandshakeFailed(ConnId),
    Stream {
        conn: ConnId,
        send: Option<quinn::SendStream>,
        recv: quinn::RecvStream,
    },
    Data {
        conn: ConnId,
        stream: StreamId,
        data: Vec<Bytes>,
        fin: bool,
    },
    Reset {
        conn: ConnId,
        stream: StreamId,
    },
    Stopped {
        conn: ConnId,
        stream: StreamId,
    },
    Opened {
        conn: ConnId,
        token: OpenToken,
        send: quinn::SendStream,
    },
    Flushed {
        conn: ConnId,
        stream: StreamId,
        bytes: usize,
    },
    Written(Vec<(WriteToken, WriteOutcome)>, u64),
    ReadDone(felix_proto::transport::ReadToken, Vec<felix_proto::storage::StoredBatch>),
    StreamRecorded(WriteToken, Result<(), String>),
    Closed {
        conn: ConnId,
    },
    /// A client's stream ended, both halves ([`StreamEnd`]).
    StreamEnded {
        conn: ConnId,
        bi: bool,
    },
    Metrics(oneshot::Sender<String>),
    /// `GET /cluster`, whole or one page (D55): the answer, or a 400's reason.
    ClusterStatus(Option<felix_proto::cluster::status::StatusPage>, oneshot::Sender<Result<String, String>>),
    /// The web view's page.
    /// The web view's page, from the shard after this cursor on (D55).
    WebView(Option<felix_proto::cluster::metadata::ShardId>, oneshot::Sender<String>),
    /// `POST /cluster/add|remove` (its secret checked): the answer's status and body.
    ClusterAdmin(AdminRequest, oneshot::Sender<(u16, String)>),
    /// A reloaded signed-token configuration.
    SetJwt(Option<felix_proto::jwt::Verifier>),
    /// A renewed certificate for new connections.
    SetIdentity(Box<Identity>, oneshot::Sender<Result<(), String>>),
    /// Stop taking work, finish what is in flight (at most `grace`), then stop; the reply says
    /// how much was left.
    Drain {
        grace: Duration,
        reply: oneshot::Sender<usize>,
    },
    Peer(crate::cluster::PeerInput),
    /// The replica sync thread synced the files of the appends up to `covers`.
    ReplicaSynced {
        covers: u64,
        result: Result<(), String>,
    },
    /// A read of a replica's log ([`NodeOutput::ReadReplicaLog`]) ended.
    ///
    /// [`NodeOutput::ReadReplicaLog`]: felix_proto::cluster::node::NodeOutput::ReadReplicaLog
    ReplicaLogRead {
        token: u64,
        result: Result<Vec<felix_proto::cluster::meta::Entry>, String>,
    },
    /// A read of a piece of a replica's last snapshot ([`NodeOutput::ReadReplicaSnapshotPiece`])
    /// ended.
    ///
    /// [`NodeOutput::ReadReplicaSnapshotPiece`]: felix_proto::cluster::node::NodeOutput::ReadReplicaSnapshotPiece
    ReplicaSnapshotPiece {
        shard: felix_proto::cluster::metadata::ShardId,
        token: u64,
        result: Result<felix_proto::cluster::meta::SnapshotPiece, String>,
    },
}

/// Counters the driver keeps (the protocol's own are in `BrokerStats`).
#[derive(Debug, Default)]
struct IoCounters {
    bytes_in: u64,
    bytes_out: u64,
    bytes_out_events: u64,
    streams_opened: u64,
    storage_passes: u64,
    storage_writes: u64,
    storage_failures: u64,
    storage_full: u64,
    storage_micros: u64,
    storage_micros_max: u64,
}

struct BrokerTask {
    node: Node,
    /// The cluster transport, for a broker of a cluster.
    transport: Option<crate::cluster::Transport>,
    /// The metadata Raft log's file (none without a data directory), and what it holds.
    raft_log: Option<(Option<crate::cluster::MetaLog>, felix_proto::cluster::meta::RaftLog)>,
    /// The metadata persists of this drain not yet appended to its file.
    meta_parts: Vec<(Vec<felix_proto::cluster::meta::Entry>, Option<felix_proto::cluster::meta::HardState>)>,
    /// Where this broker's replicas of replicated shards keep their logs.
    replica_logs: Option<crate::cluster::ReplicaLogs>,
    /// Reads of replica log files started (metrics).
    replica_log_reads: u64,
    /// Reads of replicas' last snapshots, kept on disk only, for followers behind.
    replica_snapshot_reads: u64,
    /// What waits for the replica logs to be synced.
    gate: ReplicaSyncGate,
    /// The replica sync thread's queue.
    replica_syncer: std::sync::mpsc::Sender<(u64, Vec<crate::cluster::UnsyncedFile>)>,
    endpoint: quinn::Endpoint,
    /// The server configuration for loopback peers ([`TransportTuning::to_quinn_for`]).
    loopback_cfg: Arc<quinn::ServerConfig>,
    conns: HashMap<ConnId, ConnHandle>,
    tx: mpsc::UnboundedSender<Input>,
    storage: std::sync::mpsc::Sender<StorageCmd>,
    /// History reads, answered beside the storage thread ([`history_loop`]).
    history: std::sync::mpsc::Sender<felix_proto::broker::ReadRequest>,
    pending_writes: Vec<PersistRequest>,
    io: IoCounters,
    /// What the server configuration is built from, to rebuild it with a renewed certificate.
    transport_tuning: TransportTuning,
    require_alpn: bool,
    client_ca: Option<Vec<crate::tls::CertificateDer<'static>>>,
    /// Draining: until when, and who waits for the end.
    draining: Option<(std::time::Instant, oneshot::Sender<usize>)>,
    /// When the broker started (the web view's uptime).
    started: std::time::Instant,
    /// The web view's last sample of each shard's tail and subscriber positions, for rates.
    web_sample: Option<(std::time::Instant, WebSample)>,
}

/// Per shard (tenant, namespace, stream, shard): its tail and its subscribers' positions.
type WebSample = std::collections::BTreeMap<(String, String, String, u32), (u64, u64)>;

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

impl BrokerTask {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Input>, mut shutdown: oneshot::Receiver<()>) {
        loop {
            let turn = std::time::Instant::now();
            self.drain();
            slow_turn(turn, "carrying out outputs");
            self.log_notices();
            if let Some(l) = self.replica_logs.as_mut() {
                l.sync_due(now());
            }
            if let Some((until, _)) = &self.draining {
                let left = self.node.broker_ref().work_in_flight();
                if left == 0 || now() >= *until {
                    if let Some((_, reply)) = self.draining.take() {
                        let _ = reply.send(left);
                    }
                    break;
                }
            }
            let deadline = [self.node.poll_timeout(), self.draining.as_ref().map(|d| d.0)].into_iter().flatten().min();
            let sleep = crate::sleep_until(deadline);
            tokio::select! {
                input = rx.recv() => {
                    let Some(input) = input else { break };
                    // One clock read per input: each one's end is the next one's start.
                    let mut began = self.handle_timed(input, std::time::Instant::now());
                    // Take what else is ready before draining outputs (bounded per turn).
                    for _ in 0..256 {
                        match rx.try_recv() {
                            Ok(i) => began = self.handle_timed(i, began),
                            Err(_) => break,
                        }
                    }
                }
                () = sleep => {
                    let turn = std::time::Instant::now();
                    self.node.handle_timeout(now());
                    slow_turn(turn, "a timeout");
                }
                _ = &mut shutdown => break,
            }
        }
        // Shutdown: flush storage, then close every connection cleanly.
        self.flush_storage();
        let _ = self.storage.send(StorageCmd::Stop);
        self.endpoint
            .close(VarInt::from_u64(close_code::SHUTDOWN).unwrap_or(VarInt::from_u32(0)), b"broker shutting down");
        if let Some(t) = &self.transport {
            t.close();
        }
    }
}

impl BrokerTask {
    /// [`handle`](Self::handle) of an input taken at `began`, said when it takes longer than
    /// [`stalls::SLOW_TURN`]; when it ended.
    fn handle_timed(&mut self, input: Input, began: std::time::Instant) -> std::time::Instant {
        let what = input.kind();
        self.handle(input);
        slow_turn(began, what)
    }

    fn flush_storage(&mut self) {
        if !self.pending_writes.is_empty() {
            let _ = self.storage.send(StorageCmd::Write(std::mem::take(&mut self.pending_writes)));
        }
    }

    fn handle(&mut self, input: Input) {
        let now = now();
        match input {
            Input::Incoming(incoming) if self.draining.is_some() => incoming.refuse(),
            Input::SetJwt(v) => self.node.inputs().set_jwt(v, now),
            Input::SetIdentity(identity, reply) => {
                let r = server_configs(*identity, self.require_alpn, self.client_ca.as_deref(), &self.transport_tuning)
                    .map(|(cfg, loopback)| {
                        self.endpoint.set_server_config(Some(cfg));
                        self.loopback_cfg = Arc::new(loopback);
                    })
                    .map_err(|e| e.to_string());
                let _ = reply.send(r);
            }
            Input::Drain { grace, reply } => {
                self.node.inputs().begin_drain(now);
                self.flush_storage();
                self.draining = Some((now + grace, reply));
            }
            Input::Incoming(incoming) => {
                match self.node.inputs().admit(felix_driver_common::peer_addr(incoming.remote_address().ip()), now) {
                    Ok(conn) => {
                        let tx = self.tx.clone();
                        let connecting = if is_loopback(incoming.remote_address()) {
                            incoming.accept_with(self.loopback_cfg.clone())
                        } else {
                            incoming.accept()
                        };
                        tokio::spawn(async move {
                            let quic = match connecting {
                                Ok(c) => c.await,
                                Err(e) => Err(e),
                            };
                            let _ = match quic {
                                Ok(quic) => tx.send(Input::Connected(conn, quic)),
                                Err(e) => {
                                    tracing::debug!("handshake failed: {e}");
                                    tx.send(Input::HandshakeFailed(conn))
                                }
                            };
                        });
                    }
                    Err(e) => {
                        tracing::debug!("refused a connection from {}: {e}", incoming.remote_address());
                        incoming.refuse();
                    }
                }
            }
            Input::Connected(conn, quic) => {
                // A client certificate the handshake verified: its names, for the broker to map
                // to a credential.
                let certs =
                    quic.peer_identity().and_then(|a| a.downcast::<Vec<crate::tls::CertificateDer<'static>>>().ok());
                if let Some(leaf) = certs.as_deref().and_then(|c| c.first()) {
                    let names = crate::tls::cert_names(leaf);
                    tracing::debug!("connection {conn:?} presented a client certificate for {names:?}");
                    self.node.inputs().set_peer_certificate(conn, names);
                }
                tokio::spawn(conn_loop(conn, quic.clone(), self.tx.clone()));
                let t = &self.transport_tuning;
                self.conns.insert(
                    conn,
                    ConnHandle {
                        quic,
                        writers: HashMap::new(),
                        gates: HashMap::new(),
                        bi: StreamCredit::new(INITIAL_BI_STREAMS, t.max_bi_streams),
                        uni: StreamCredit::new(INITIAL_UNI_STREAMS, t.max_uni_streams),
                    },
                );
            }
            Input::HandshakeFailed(conn) => self.node.inputs().connection_closed(conn, now),
            Input::Stream { conn, send, recv } => {
                let Some(h) = self.conns.get_mut(&conn) else { return };
                let stream = crate::stream_id(recv.id());
                self.io.streams_opened += 1;
                let bi = send.is_some();
                h.stream_opened(bi);
                let end = Arc::new(StreamEnd { conn, bi, tx: self.tx.clone() });
                let (gate_tx, gate_rx) = watch::channel(ReadGate::Open);
                h.gates.insert(stream, gate_tx);
                tokio::spawn(reader(conn, stream, recv, gate_rx, self.tx.clone(), end.clone()));
                if let Some(send) = send {
                    let (wtx, wrx) = crate::queue::queue();
                    h.writers.insert(stream, wtx);
                    tokio::spawn(writer(conn, stream, send, wrx, self.tx.clone(), true, Some(end)));
                }
            }
            Input::Data { conn, stream, data, fin } => {
                self.io.bytes_in += data.iter().map(|c| c.len() as u64).sum::<u64>();
                if fin {
                    // Its reader is done: nothing more to gate (a connection doing many
                    // requests, each on a stream of its own, kept every gate till it closed).
                    if let Some(h) = self.conns.get_mut(&conn) {
                        h.gates.remove(&stream);
                    }
                }
                self.node.inputs().handle_stream_chunks(conn, stream, data, fin, now);
            }
            Input::Reset { conn, stream } => {
                if let Some(h) = self.conns.get_mut(&conn) {
                    h.gates.remove(&stream);
                }
                self.node.inputs().handle_stream_reset(conn, stream, now)
            }
            Input::Stopped { conn, stream } => self.node.inputs().handle_stream_stopped(conn, stream, now),
            Input::Opened { conn, token, send } => {
                let Some(h) = self.conns.get_mut(&conn) else { return };
                let stream = crate::stream_id(send.id());
                let (wtx, wrx) = crate::queue::queue();
                h.writers.insert(stream, wtx);
                tokio::spawn(writer(conn, stream, send, wrx, self.tx.clone(), true, None));
                self.node.inputs().handle_stream_opened(conn, token, stream, now);
            }
            Input::Flushed { conn, stream, bytes } => {
                self.node.inputs().handle_stream_flushed(conn, stream, bytes, now)
            }
            Input::Written(results, micros) => {
                self.io.storage_passes += 1;
                self.io.storage_micros += micros;
                self.io.storage_micros_max = self.io.storage_micros_max.max(micros);
                for (token, outcome) in results {
                    self.io.storage_writes += 1;
                    self.io.storage_failures += u64::from(outcome != WriteOutcome::Written);
                    self.io.storage_full += u64::from(outcome == WriteOutcome::NoSpace);
                    self.node.inputs().handle_write_result(token, outcome, now);
                }
            }
            Input::ReadDone(token, batches) => self.node.inputs().handle_read_complete(token, batches, now),
            Input::StreamRecorded(token, r) => self.node.inputs().handle_stream_recorded(token, r, now),
            Input::Metrics(reply) => {
                let _ = reply.send(self.metrics());
            }
            Input::ClusterStatus(page, reply) => {
                let _ = reply.send(Ok(self.cluster_status_page(page.as_ref())));
            }
            Input::WebView(after, reply) => {
                let status: serde_json::Value =
                    serde_json::from_str(&self.cluster_status()).unwrap_or(serde_json::Value::Null);
                let b = self.node.broker_ref();
                let shards = b.shard_summaries();
                // Rates since the previous page: the tail's and the subscribers' positions'
                // change over the time between them.
                let at = now;
                let rates: Vec<Option<(f64, f64)>> = shards
                    .iter()
                    .map(|x| {
                        let (then, prev) = self.web_sample.as_ref()?;
                        let secs = at.duration_since(*then).as_secs_f64();
                        let key = (x.tenant.clone(), x.namespace.clone(), x.stream.clone(), x.shard);
                        let (tail, delivered) = prev.get(&key)?;
                        (secs > 0.0).then(|| {
                            (
                                x.tail.saturating_sub(*tail) as f64 / secs,
                                x.delivered_positions.saturating_sub(*delivered) as f64 / secs,
                            )
                        })
                    })
                    .collect();
                let sample = shards
                    .iter()
                    .map(|x| {
                        (
                            (x.tenant.clone(), x.namespace.clone(), x.stream.clone(), x.shard),
                            (x.tail, x.delivered_positions),
                        )
                    })
                    .collect();
                let unix =
                    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                let links = self.transport.as_ref().map(crate::cluster::Transport::links).unwrap_or_default();
                let view = crate::web::View {
                    status: &status,
                    shards: &shards,
                    rates: &rates,
                    subs: &b.subscriptions_snapshot(),
                    version: env!("CARGO_PKG_VERSION"),
                    uptime: at.duration_since(self.started),
                    now_unix: unix,
                    after,
                    links: &links,
                };
                let _ = reply.send(crate::web::page(&view));
                self.web_sample = Some((at, sample));
            }
            Input::ClusterAdmin(req, reply) => {
                let answer = match &mut self.node {
                    Node::Single(_) => (404, "not a cluster member".to_string()),
                    Node::Cluster(n) => {
                        let (what, r) = match &req {
                            AdminRequest::Add { node, addr } => (format!("add {node}"), n.request_add(node, addr, now)),
                            AdminRequest::Remove { node, force } => {
                                (format!("remove {node}"), n.request_remove(node, *force, now))
                            }
                            AdminRequest::Revoke { jti, sub } => (
                                format!(
                                    "revoke{}{}",
                                    jti.as_ref().map(|j| format!(" jti {j}")).unwrap_or_default(),
                                    sub.as_ref().map(|s| format!(" sub {s}")).unwrap_or_default()
                                ),
                                n.request_revoke(jti.as_deref(), sub.as_deref(), now),
                            ),
                            AdminRequest::Move { shard, to: Some(to) } => (
                                format!(
                                    "move {}/{}/{} shard {} to {to}",
                                    shard.tenant, shard.namespace, shard.name, shard.shard
                                ),
                                n.request_move(shard.clone(), to, now),
                            ),
                            AdminRequest::Move { shard, to: None } => (
                                format!(
                                    "cancel the move of {}/{}/{} shard {}",
                                    shard.tenant, shard.namespace, shard.name, shard.shard
                                ),
                                n.request_cancel_move(shard.clone(), now),
                            ),
                            AdminRequest::Drain { node } => (format!("drain {node}"), n.request_drain(node, now)),
                            AdminRequest::Rebalance => {
                                n.request_rebalance(now);
                                ("rebalance".to_string(), Ok(()))
                            }
                        };
                        match r {
                            Ok(()) => {
                                tracing::info!("cluster: an operator asked to {what}");
                                (202, serde_json::json!({"proposed": what}).to_string())
                            }
                            Err(e) => (409, serde_json::json!({"error": e.to_string()}).to_string()),
                        }
                    }
                };
                let _ = reply.send((answer.0, format!("{}\n", answer.1)));
            }
            Input::Peer(p) => {
                if let Node::Cluster(n) = &mut self.node {
                    match p {
                        crate::cluster::PeerInput::Message { from, message } => n.handle_peer(&from, message, now),
                        crate::cluster::PeerInput::Undeliverable(m) => n.handle_undeliverable(m, now),
                        crate::cluster::PeerInput::Lost(peer) => n.handle_peer_lost(&peer, now),
                        crate::cluster::PeerInput::ChunkWritten { to, shard, index } => {
                            n.handle_snapshot_chunk_written(&to, &shard, index, now)
                        }
                    }
                }
            }
            Input::Closed { conn } => {
                self.conns.remove(&conn);
                self.node.inputs().connection_closed(conn, now);
            }
            Input::StreamEnded { conn, bi } => {
                if let Some(h) = self.conns.get_mut(&conn) {
                    if bi { h.bi.closed() } else { h.uni.closed() }
                }
            }
            Input::ReplicaSynced { covers, result } => self.replica_synced(covers, result),
            Input::ReplicaLogRead { token, result } => {
                if let Err(e) = &result {
                    tracing::warn!("reading a replica's log back: {e}");
                }
                if let Node::Cluster(n) = &mut self.node {
                    n.handle_replica_log_read(token, result, now);
                }
            }
            Input::ReplicaSnapshotPiece { shard, token, result } => {
                if let Err(e) = &result {
                    tracing::warn!("reading the snapshot of {shard:?}'s replica back: {e}");
                }
                if let Node::Cluster(n) = &mut self.node {
                    n.handle_replica_snapshot_piece(token, result, now);
                }
            }
        }
    }

    /// Writes the state machine's operator notices (failed logins, elections, leadership
    /// changes, peers) to the log at info level, with the client's address for a login.
    fn log_notices(&mut self) {
        while let Some(n) = self.node.inputs().poll_notice() {
            match &n {
                felix_proto::broker::Notice::LoginRefused { conn, .. } => {
                    let from = self.conns.get(conn).map(|c| c.quic.remote_address().to_string());
                    tracing::info!("{n} (from {})", from.as_deref().unwrap_or("a closed connection"));
                }
                _ => tracing::info!("{n}"),
            }
        }
    }
}

/// The QUIC server configurations for a certificate: for remote peers and for loopback ones
/// ([`TransportTuning::to_quinn_for`]).
fn server_configs(
    identity: Identity,
    require_alpn: bool,
    client_ca: Option<&[crate::tls::CertificateDer<'static>]>,
    transport: &TransportTuning,
) -> Result<(quinn::ServerConfig, quinn::ServerConfig), ServerError> {
    let mut qcfg = quinn::ServerConfig::with_crypto(quic_server_crypto_with(identity, require_alpn, client_ca)?);
    let mut loopback = qcfg.clone();
    // A connection starts with a few streams and is granted more as it uses them
    // ([`StreamCredit`]): quinn's table of allowed streams is most of an idle connection.
    let first_credit = |mut t: quinn::TransportConfig| {
        t.max_concurrent_bidi_streams(VarInt::from_u32(INITIAL_BI_STREAMS.min(transport.max_bi_streams)));
        t.max_concurrent_uni_streams(VarInt::from_u32(INITIAL_UNI_STREAMS.min(transport.max_uni_streams)));
        Arc::new(t)
    };
    qcfg.transport_config(first_credit(transport.to_quinn()));
    loopback.transport_config(first_credit(transport.to_quinn_for(SocketAddr::from(([127, 0, 0, 1], 0)))));
    Ok((qcfg, loopback))
}
