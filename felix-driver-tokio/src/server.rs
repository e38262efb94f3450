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
        let done = tokio::spawn(async move {
            task.run(rx, shutdown_rx).await;
            accept.abort();
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

enum StorageCmd {
    Write(Vec<PersistRequest>),
    Truncate {
        tenant: String,
        namespace: String,
        stream: String,
        shard: u32,
        start: u64,
        forgotten: Vec<(u64, u64)>,
        state: Option<Bytes>,
    },
    DeleteStream {
        tenant: String,
        namespace: String,
        stream: String,
    },
    CreateStream {
        token: WriteToken,
        tenant: String,
        namespace: String,
        stream: String,
        shards: u32,
    },
    ResetShard {
        tenant: String,
        namespace: String,
        stream: String,
        shard: u32,
    },
    Stop,
}

fn storage_loop(
    mut disk: Option<DiskStorage>,
    rx: std::sync::mpsc::Receiver<StorageCmd>,
    tx: mpsc::UnboundedSender<Input>,
) {
    // Every queued write is written, even once the broker task is gone (at shutdown it sends its
    // last writes, then Stop): results that nobody receives any more are dropped, writes never.
    let mut stop = false;
    while !stop {
        let cmd = match rx.recv_timeout(std::time::Duration::from_millis(20)) {
            Ok(cmd) => cmd,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                // Idle: files under an interval policy still get synced on time.
                if let Some(d) = disk.as_mut() {
                    d.sync_due();
                }
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut truncations = Vec::new();
        let mut reqs = Vec::new();
        // A deletion ends the pass: the writes before it are written, then the stream removed;
        // writes after it (a stream of the same name created again) go in the next pass.
        let mut deletion = None;
        let mut reset = None;
        let mut created = Vec::new();
        let mut cut = false;
        let mut take = |cmd: StorageCmd, stop: &mut bool, cut: &mut bool| match cmd {
            StorageCmd::Write(r) => reqs.extend(r),
            StorageCmd::Truncate { tenant, namespace, stream, shard, start, forgotten, state } => {
                truncations.push((tenant, namespace, stream, shard, start, forgotten, state));
            }
            StorageCmd::DeleteStream { tenant, namespace, stream } => {
                deletion = Some((tenant, namespace, stream));
                *cut = true;
            }
            StorageCmd::ResetShard { tenant, namespace, stream, shard } => {
                reset = Some((tenant, namespace, stream, shard));
                *cut = true;
            }
            StorageCmd::CreateStream { token, tenant, namespace, stream, shards } => {
                created.push((token, tenant, namespace, stream, shards));
            }
            StorageCmd::Stop => *stop = true,
        };
        take(cmd, &mut stop, &mut cut);
        // Group commit: take everything queued since, write it, sync once.
        while !stop && !cut {
            match rx.try_recv() {
                Ok(more) => take(more, &mut stop, &mut cut),
                Err(_) => break,
            }
        }
        if let Some(d) = disk.as_mut() {
            for (t, n, s, shard, start, forgotten, state) in truncations {
                d.truncate_before((&t, &n, &s), shard, start, &forgotten, state.as_deref());
            }
        }
        if !reqs.is_empty() {
            let started = std::time::Instant::now();
            let results = match disk.as_mut() {
                Some(d) => d.write(reqs),
                None => felix_proto::storage::MemoryOnly.write(reqs),
            };
            let micros = started.elapsed().as_micros() as u64;
            let _ = tx.send(Input::Written(results, micros));
        }
        for (token, t, n, s, shards) in created {
            let r = match disk.as_mut() {
                Some(d) => d.record_stream((&t, &n, &s), shards).map_err(|e| e.to_string()),
                None => Ok(()),
            };
            let _ = tx.send(Input::StreamRecorded(token, r));
        }
        if let (Some(d), Some((t, n, s))) = (disk.as_mut(), deletion)
            && let Err(e) = d.delete_stream((&t, &n, &s))
        {
            tracing::error!("deleting stream {n}/{s}: {e}");
        }
        if let (Some(d), Some((t, n, s, shard))) = (disk.as_mut(), reset)
            && let Err(e) = d.reset_shard((&t, &n, &s), shard)
        {
            tracing::error!("emptying shard {shard} of {n}/{s} for the copy moving here: {e}");
        }
    }
    if let Some(d) = disk.as_mut() {
        d.sync_all();
    }
}

/// Answers history reads on their own thread ([`HistoryReader`]), beside the storage thread:
/// a reader that fell behind waits for its read, never for a pass of writes.
///
/// [`HistoryReader`]: felix_driver_common::storage::HistoryReader
fn history_loop(
    mut reader: Option<felix_driver_common::storage::HistoryReader>,
    rx: std::sync::mpsc::Receiver<felix_proto::broker::ReadRequest>,
    tx: mpsc::UnboundedSender<Input>,
) {
    while let Ok(r) = rx.recv() {
        let batches = match reader.as_mut() {
            Some(h) => h.read_range((&r.tenant_id, &r.namespace, &r.stream), r.shard, r.from, r.end, r.max_bytes),
            None => felix_proto::storage::MemoryOnly.read(&r),
        };
        if tx.send(Input::ReadDone(r.token, batches)).is_err() {
            return;
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

/// An operator's change of the cluster's members, from the metrics listener.
#[derive(Debug)]
pub(crate) enum AdminRequest {
    Add { node: String, addr: String },
    Remove { node: String, force: bool },
    Revoke { jti: Option<String>, sub: Option<String> },
    Move { shard: felix_proto::cluster::metadata::ShardId, to: Option<String> },
    Drain { node: String },
    Rebalance,
}

/// [`percent_decode`], for the web view.
pub(crate) fn percent_decode_pub(v: &str) -> String {
    percent_decode(v)
}

/// [`percent_encode`], for the web view's cookie and the banner's link.
pub fn percent_encode_pub(v: &str) -> String {
    percent_encode(v)
}

/// Decodes `%XX` escapes of a query value (anything malformed is kept as it is).
fn percent_decode(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Encodes a query value: unreserved characters as they are, everything else `%XX`.
fn percent_encode(v: &str) -> String {
    v.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"._-:[]".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Reads `POST /cluster/add?node=N&addr=A`, `POST /cluster/remove?node=N[&force=1]` or `POST
/// /cluster/revoke?jti=J&sub=S` (either or both, percent-encoded) with `Authorization: Bearer
/// <cluster secret>`. Anything else is a status and a reason.
fn admin_request(head: &str, secret: Option<&str>) -> Result<AdminRequest, (u16, String)> {
    let mut lines = head.lines();
    let line = lines.next().unwrap_or_default();
    let target = line.strip_prefix("POST ").and_then(|r| r.split(' ').next()).unwrap_or_default();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let Some(secret) = secret else { return Err((404, "not a cluster member".into())) };
    let given = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .and_then(|(_, v)| v.trim().strip_prefix("Bearer ").map(str::trim).map(str::to_owned));
    if !given.is_some_and(|g| crate::cluster::same_secret(&g, secret)) {
        return Err((401, "the cluster secret is missing or wrong (Authorization: Bearer <secret>)".into()));
    }
    let arg = |name: &str| {
        query.split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == name).map(|(_, v)| percent_decode(v))
    };
    if path == "/cluster/rebalance" {
        return Ok(AdminRequest::Rebalance);
    }
    if path == "/cluster/move" {
        let stream = arg("stream").ok_or((400, "stream=NAME is required".to_string()))?;
        let shard = arg("shard")
            .and_then(|s| s.parse::<u32>().ok())
            .ok_or((400, "shard=N (a shard number) is required".to_string()))?;
        let to = arg("to");
        if to.is_none() && arg("cancel").is_none_or(|c| c != "1") {
            return Err((400, "to=NODE (or cancel=1) is required".into()));
        }
        let shard = felix_proto::cluster::metadata::ShardId {
            kind: felix_proto::cluster::metadata::Kind::Stream,
            tenant: arg("tenant").unwrap_or_else(|| "default".into()),
            namespace: arg("namespace").unwrap_or_else(|| "default".into()),
            name: stream,
            shard,
        };
        return Ok(AdminRequest::Move { shard, to });
    }
    if path == "/cluster/revoke" {
        let (jti, sub) = (arg("jti"), arg("sub"));
        if jti.is_none() && sub.is_none() {
            return Err((400, "jti=TOKEN_ID and/or sub=PRINCIPAL is required".into()));
        }
        return Ok(AdminRequest::Revoke { jti, sub });
    }
    let node = arg("node").ok_or((400, "node=ID is required".to_string()))?;
    match path {
        "/cluster/add" => {
            let addr = arg("addr").ok_or((400, "addr=HOST:PORT (its cluster listener) is required".to_string()))?;
            Ok(AdminRequest::Add { node, addr })
        }
        "/cluster/remove" => Ok(AdminRequest::Remove { node, force: arg("force").is_some_and(|f| f == "1") }),
        "/cluster/drain" => Ok(AdminRequest::Drain { node }),
        _ => Err((404, format!("no such admin path {path}"))),
    }
}

/// The web view's listener: `GET /` with the token gets the page; anything else 401 or 404.
async fn web_loop(listener: tokio::net::TcpListener, tx: mpsc::UnboundedSender<Input>, token: String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { return };
        let tx = tx.clone();
        let token = token.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(2), sock.read(&mut buf)).await.ok().and_then(Result::ok);
            let head = n.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned()).unwrap_or_default();
            let path = head.split(' ').nth(1).unwrap_or_default().split('?').next().unwrap_or_default().to_owned();
            let mut extra = String::new();
            let (status, body) = if !head.starts_with("GET ") {
                (405, "GET only (the view is read-only)\n".to_string())
            } else if crate::web::token_in_query(&head, &token) {
                // A login: the cookie keeps the browser logged in, and the address it is sent
                // to has no token in it (out of the address bar, history and screenshots).
                extra = format!(
                    "Set-Cookie: {}={}; HttpOnly; SameSite=Strict; Path=/\r\nLocation: /\r\n",
                    crate::web::COOKIE,
                    crate::server::percent_encode_pub(&token)
                );
                (303, "logged in\n".to_string())
            } else if !crate::web::authorized(&head, &token) {
                (401, crate::web::login_page())
            } else if path != "/" {
                (404, "not found\n".to_string())
            } else {
                let (rtx, rrx) = oneshot::channel();
                let after = head
                    .split(' ')
                    .nth(1)
                    .and_then(|t| t.split_once('?'))
                    .and_then(|(_, q)| q.split('&').find_map(|kv| kv.strip_prefix("after=")))
                    .and_then(|a| felix_proto::cluster::metadata::ShardId::from_cursor(&percent_decode(a)));
                if tx.send(Input::WebView(after, rtx)).is_err() {
                    return;
                }
                let Ok(page) = rrx.await else { return };
                (200, page)
            };
            let reason = match status {
                200 => "OK",
                303 => "See Other",
                401 => "Unauthorized",
                404 => "Not Found",
                _ => "Method Not Allowed",
            };
            let kind = if status == 200 || status == 401 { "text/html; charset=utf-8" } else { "text/plain" };
            let head = format!(
                "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n{extra}Cache-Control: no-store\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

async fn metrics_loop(listener: tokio::net::TcpListener, tx: mpsc::UnboundedSender<Input>, secret: Option<String>) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { return };
        let tx = tx.clone();
        let secret = secret.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = tokio::time::timeout(Duration::from_secs(2), sock.read(&mut buf)).await.ok().and_then(Result::ok);
            let head = n.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned()).unwrap_or_default();
            let cluster = head.starts_with("GET /cluster");
            let (status, kind, body) = if head.starts_with("POST ") {
                let (rtx, rrx) = oneshot::channel();
                let answer = match admin_request(&head, secret.as_deref()) {
                    Ok(req) => {
                        if tx.send(Input::ClusterAdmin(req, rtx)).is_err() {
                            return;
                        }
                        let Ok(a) = rrx.await else { return };
                        a
                    }
                    Err(e) => e,
                };
                (answer.0, "application/json", answer.1)
            } else if cluster {
                let (rtx, rrx) = oneshot::channel();
                match status_page_of(&head) {
                    Ok(page) => {
                        if tx.send(Input::ClusterStatus(page, rtx)).is_err() {
                            return;
                        }
                        match rrx.await {
                            Ok(Ok(body)) => (200, "application/json", body),
                            Ok(Err(e)) => (400, "application/json", format!("{}\n", serde_json::json!({"error": e}))),
                            Err(_) => return,
                        }
                    }
                    Err(e) => (400, "application/json", format!("{}\n", serde_json::json!({"error": e}))),
                }
            } else {
                let (rtx, rrx) = oneshot::channel();
                if tx.send(Input::Metrics(rtx)).is_err() {
                    return;
                }
                let Ok(body) = rrx.await else { return };
                (200, "text/plain; version=0.0.4", body)
            };
            let reason = match status {
                200 => "OK",
                202 => "Accepted",
                400 => "Bad Request",
                401 => "Unauthorized",
                404 => "Not Found",
                _ => "Conflict",
            };
            let head = format!(
                "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

enum WriterCmd {
    Data(Bytes),
    Finish,
}

struct ConnHandle {
    quic: quinn::Connection,
    writers: HashMap<StreamId, crate::queue::Sender<WriterCmd>>,
    gates: HashMap<StreamId, watch::Sender<ReadGate>>,
    /// The client's bidirectional and unidirectional streams open, and how many it may open.
    bi: StreamCredit,
    uni: StreamCredit,
}

impl ConnHandle {
    /// The client opened a stream: grants it more when half of what it may open is open.
    fn stream_opened(&mut self, bi: bool) {
        if bi {
            if let Some(n) = self.bi.opened() {
                self.quic.set_max_concurrent_bi_streams(VarInt::from_u32(n));
            }
        } else if let Some(n) = self.uni.opened() {
            self.quic.set_max_concurrent_uni_streams(VarInt::from_u32(n));
        }
    }
}

/// Held by the tasks serving one of a client's streams; the last to end tells the broker task
/// the stream is over (both halves), so its place counts as free in the connection's
/// [`StreamCredit`].
struct StreamEnd {
    conn: ConnId,
    bi: bool,
    tx: mpsc::UnboundedSender<Input>,
}

impl Drop for StreamEnd {
    fn drop(&mut self) {
        let _ = self.tx.send(Input::StreamEnded { conn: self.conn, bi: self.bi });
    }
}

/// Hands every arriving connection to the broker task, which asks the core whether to admit it
/// before any handshake work is done. A failed handshake ends only that connection.
async fn accept_loop(endpoint: quinn::Endpoint, tx: mpsc::UnboundedSender<Input>) {
    while let Some(incoming) = endpoint.accept().await {
        if tx.send(Input::Incoming(Box::new(incoming))).is_err() {
            return;
        }
    }
}

/// The core's name for a peer: its IP address in 16 bytes (IPv4 mapped into IPv6).
async fn conn_loop(conn: ConnId, quic: quinn::Connection, tx: mpsc::UnboundedSender<Input>) {
    loop {
        tokio::select! {
            bi = quic.accept_bi() => match bi {
                Ok((send, recv)) => { let _ = tx.send(Input::Stream { conn, send: Some(send), recv }); }
                Err(_) => break,
            },
            uni = quic.accept_uni() => match uni {
                Ok(recv) => { let _ = tx.send(Input::Stream { conn, send: None, recv }); }
                Err(_) => break,
            },
        }
    }
    let _ = tx.send(Input::Closed { conn });
}

async fn reader(
    conn: ConnId,
    stream: StreamId,
    recv: quinn::RecvStream,
    gate: watch::Receiver<ReadGate>,
    tx: mpsc::UnboundedSender<Input>,
    _end: Arc<StreamEnd>,
) {
    // Paused while a publish window is full: QUIC flow control holds the client.
    crate::read_gated(recv, gate, |event| match event {
        ReadEvent::Chunks(data) => tx.send(Input::Data { conn, stream, data, fin: false }).is_ok(),
        ReadEvent::Finished => tx.send(Input::Data { conn, stream, data: Vec::new(), fin: true }).is_ok(),
        ReadEvent::Reset => tx.send(Input::Reset { conn, stream }).is_ok(),
        ReadEvent::Failed => false,
    })
    .await
}

async fn writer(
    conn: ConnId,
    stream: StreamId,
    mut send: quinn::SendStream,
    mut rx: crate::queue::Receiver<WriterCmd>,
    tx: mpsc::UnboundedSender<Input>,
    report: bool,
    _end: Option<Arc<StreamEnd>>,
) {
    let mut chunks: Vec<Bytes> = Vec::new();
    while let Some(cmd) = rx.recv().await {
        let mut finish = matches!(cmd, WriterCmd::Finish);
        if let WriterCmd::Data(b) = cmd {
            chunks.push(b);
        }
        // Batch everything already queued into one write.
        while !finish {
            match rx.try_recv() {
                Some(WriterCmd::Data(b)) => chunks.push(b),
                Some(WriterCmd::Finish) => finish = true,
                None => break,
            }
        }
        let n: usize = chunks.iter().map(Bytes::len).sum();
        if n > 0 {
            if let Err(e) = send.write_all_chunks(&mut chunks).await {
                if matches!(e, quinn::WriteError::Stopped(_)) {
                    let _ = tx.send(Input::Stopped { conn, stream });
                }
                return;
            }
            chunks.clear();
            if report {
                let _ = tx.send(Input::Flushed { conn, stream, bytes: n });
            }
        }
        if finish {
            let _ = send.finish();
            return;
        }
    }
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
            self.drain();
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
                    self.handle(input);
                    // Take what else is ready before draining outputs (bounded per turn).
                    for _ in 0..256 {
                        match rx.try_recv() {
                            Ok(i) => self.handle(i),
                            Err(_) => break,
                        }
                    }
                }
                () = sleep => self.node.handle_timeout(now()),
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

    /// `GET /cluster` on the metrics listener: members, leader, every shard's owner and
    /// generation, as JSON (`{"cluster":false}` for a single broker); one page of it with
    /// `?limit=N&after=CURSOR` (D55).
    fn cluster_status(&self) -> String {
        self.cluster_status_page(None)
    }

    fn cluster_status_page(&self, page: Option<&felix_proto::cluster::status::StatusPage>) -> String {
        let Node::Cluster(n) = &self.node else { return "{\"cluster\":false}\n".into() };
        // Serialised straight to text (no JSON value built first: at 10,000 shards that was
        // most of a render's cost, on the broker's task).
        let mut text = String::from_utf8(n.status_page_json(None, page)).unwrap_or_default();
        text.push('\n');
        text
    }

    /// Prometheus text exposition of the broker's and the driver's counters.
    fn metrics(&self) -> String {
        use std::fmt::Write;
        let st = self.node.broker_ref().stats();
        let mut out = String::new();
        let mut m = |name: &str, kind: &str, help: &str, value: u64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}");
        };
        m(
            "felix_connections_open",
            "gauge",
            "Open client connections.",
            self.node.broker_ref().connection_count() as u64,
        );
        m("felix_connections_total", "counter", "Client connections accepted.", st.connections_opened);
        m(
            "felix_publishes_rate_limited_total",
            "counter",
            "Publishes refused (or, unacked, dropped) for their tenant's publish rate limit.",
            st.publishes_rate_limited,
        );
        m(
            "felix_publishes_forwarded_total",
            "counter",
            "Publishes forwarded to the owner of their shard (a cluster).",
            st.publishes_forwarded,
        );
        m(
            "felix_publishes_forwarded_in_total",
            "counter",
            "Publishes other brokers of the cluster forwarded here.",
            st.publishes_forwarded_in,
        );
        m(
            "felix_requests_forwarded_total",
            "counter",
            "Cache and counter requests forwarded to the owner of their cache.",
            st.requests_forwarded,
        );
        m(
            "felix_requests_forwarded_in_total",
            "counter",
            "Cache and counter requests other brokers forwarded here.",
            st.requests_forwarded_in,
        );
        m(
            "felix_unauthenticated_connections",
            "gauge",
            "Connections none of whose streams authenticated yet.",
            self.node.broker_ref().unauthenticated_connections() as u64,
        );
        m(
            "felix_connections_refused_total",
            "counter",
            "Connections refused in the handshake: too many unauthenticated ones (in all or from one address).",
            st.connections_refused,
        );
        m(
            "felix_connections_evicted_total",
            "counter",
            "Unauthenticated connections closed to make room for new ones.",
            st.connections_evicted,
        );
        m(
            "felix_auth_timeouts_total",
            "counter",
            "Control streams ended for not authenticating in time.",
            st.auth_timeouts,
        );
        m("felix_subscriptions", "gauge", "Live subscriptions.", self.node.broker_ref().subscription_count() as u64);
        // Leak detectors: each must come back down when clients go away.
        m(
            "felix_control_streams",
            "gauge",
            "Control streams the broker holds.",
            self.node.broker_ref().control_stream_count() as u64,
        );
        m("felix_driver_connections", "gauge", "Connections the driver holds.", self.conns.len() as u64);
        // QUIC's own view of the open connections: what a record costs in datagrams, system
        // calls and acknowledgements, and whether the path MTU holds (a collapse to 1200 is the
        // black-hole detector reacting to a burst of lost full-size packets).
        let stats: Vec<quinn::ConnectionStats> = self.conns.values().map(|c| c.quic.stats()).collect();
        let sum = |f: fn(&quinn::ConnectionStats) -> u64| stats.iter().map(f).sum::<u64>();
        let quic = [
            ("felix_quic_datagrams_sent", "UDP datagrams sent on open connections.", sum(|s| s.udp_tx.datagrams)),
            (
                "felix_quic_datagrams_received",
                "UDP datagrams received on open connections.",
                sum(|s| s.udp_rx.datagrams),
            ),
            (
                "felix_quic_send_calls",
                "Send system calls (a GSO batch is one) on open connections.",
                sum(|s| s.udp_tx.ios),
            ),
            ("felix_quic_receive_calls", "Receive system calls on open connections.", sum(|s| s.udp_rx.ios)),
            ("felix_quic_acks_sent", "ACK frames sent on open connections.", sum(|s| s.frame_tx.acks)),
            ("felix_quic_acks_received", "ACK frames received on open connections.", sum(|s| s.frame_rx.acks)),
            ("felix_quic_lost_packets", "Packets declared lost on open connections.", sum(|s| s.path.lost_packets)),
            (
                "felix_quic_black_holes",
                "MTU black holes detected on open connections.",
                sum(|s| s.path.black_holes_detected),
            ),
        ];
        for (name, help, v) in quic {
            m(name, "gauge", help, v);
        }
        let mtus = || stats.iter().map(|s| u64::from(s.path.current_mtu));
        m(
            "felix_quic_mtu_min",
            "gauge",
            "Smallest current path MTU among open connections.",
            mtus().min().unwrap_or(0),
        );
        m("felix_quic_mtu_max", "gauge", "Largest current path MTU among open connections.", mtus().max().unwrap_or(0));
        let writers: usize = self.conns.values().map(|c| c.writers.len()).sum();
        let gates: usize = self.conns.values().map(|c| c.gates.len()).sum();
        m("felix_driver_stream_writers", "gauge", "Stream writer tasks.", writers as u64);
        m("felix_driver_stream_readers", "gauge", "Stream reader tasks.", gates as u64);
        if let Node::Cluster(n) = &self.node {
            let r = n.rejoin_counts();
            m(
                "felix_replica_logs_damaged_total",
                "counter",
                "Replica logs found damaged (at start, or shorter than they had acknowledged): each replica rejoins its group afresh.",
                r.damaged,
            );
            m("felix_replica_rejoins_healed_total", "counter", "Of those, the replicas that rejoined.", r.healed);
            m(
                "felix_replicas_rejoining",
                "gauge",
                "Replicas here rejoining their group (granting no vote until it took them out and back in).",
                n.rejoining_replicas().len() as u64,
            );
            m(
                "felix_replicas_readded_total",
                "counter",
                "Other brokers' rejoining replicas this broker, leading their group, took out and added back.",
                r.readded,
            );
            m(
                "felix_replica_groups",
                "gauge",
                "Replicated shards' Raft groups this broker holds a replica of.",
                n.replica_status().len() as u64,
            );
            m(
                "felix_replica_groups_sleeping",
                "gauge",
                "Of those, groups that sleep: settled, they do not tick until something wakes them (hibernation).",
                n.sleeping_replicas() as u64,
            );
            m(
                "felix_replica_leader_handovers_total",
                "counter",
                "Leaderships of settled groups this broker handed to their preferred replica (the first placement names), so leaders spread as placed.",
                n.preferred_handovers(),
            );
            m(
                "felix_replica_balance_moves_total",
                "counter",
                "Replica moves this broker proposed, as the metadata leader, to spread replicated shards' replicas over the active brokers (a broker added takes a fair share).",
                n.balance_moves(),
            );
            let (charged, waits, _, held, drops) = n.move_bandwidth_counts();
            m(
                "felix_move_bytes_total",
                "counter",
                "Bytes moves copied to and from this broker: durable shards' copies received, replicated shards' entries and snapshots sent to a move's target (--move-bandwidth paces them).",
                charged,
            );
            m("felix_move_bandwidth_waits_total", "counter", "Times a move's copy waited for --move-bandwidth.", waits);
            m(
                "felix_move_held_bytes",
                "gauge",
                "Bytes of replicated shards' entries and snapshots for moves' targets held back by --move-bandwidth now.",
                held,
            );
            m(
                "felix_move_dropped_appends_total",
                "counter",
                "Appends to moves' targets dropped (their leader sends them again) with the most --move-bandwidth holds back already held.",
                drops,
            );
            let snaps = n.meta_snapshot_counts();
            m(
                "felix_metadata_log_entries",
                "gauge",
                "Entries of the metadata Raft log this broker holds since its last metadata snapshot (in memory and in raft.log).",
                n.meta_log_entries(),
            );
            m(
                "felix_metadata_snapshots_total",
                "counter",
                "Metadata snapshots this broker took, compacting the metadata log (--metadata-snapshot-entries).",
                snaps.taken,
            );
            m(
                "felix_metadata_snapshots_received_total",
                "counter",
                "Metadata snapshots the metadata leader sent this broker (behind its compacted log) and it restored its metadata from.",
                snaps.received,
            );
            m(
                "felix_metadata_snapshot_bytes",
                "gauge",
                "The size of the last metadata snapshot this broker took.",
                snaps.bytes,
            );
            m(
                "felix_metadata_leads_applied_total",
                "counter",
                "Leadership claims of replicated shards the metadata applied here: each names a shard's new owner (redirects, topology).",
                n.leads_applied(),
            );
            m(
                "felix_replicas_replaying",
                "gauge",
                "Replicas replaying, after a restart, the committed entries their logs hold on disk (they take part in their groups once done).",
                n.replaying_replicas() as u64,
            );
            let (bytes, on_disk) = n.replica_entry_memory();
            m(
                "felix_replica_entry_bytes",
                "gauge",
                "Bytes of replicas' Raft log entries held in memory (each replica keeps its newest, --replica-entry-cache).",
                bytes,
            );
            m(
                "felix_replica_entries_on_disk",
                "gauge",
                "Entries of replicas' Raft logs held only in their log files (read back when a follower or a reader needs them).",
                on_disk,
            );
            m(
                "felix_replica_log_reads_total",
                "counter",
                "Reads of replica log files: entries for a follower behind, history below what memory holds.",
                self.replica_log_reads,
            );
            m(
                "felix_replica_snapshot_reads_total",
                "counter",
                "Reads of pieces of replicas' last snapshots, kept in their log files only, for a follower behind the compaction.",
                self.replica_snapshot_reads,
            );
            m(
                "felix_peer_queued_bytes",
                "gauge",
                "Bytes of messages queued for other brokers and not yet written to their streams (about).",
                self.transport.as_ref().map_or(0, |t| t.queued_bytes()),
            );
            m(
                "felix_replica_catch_up_reads_held_total",
                "counter",
                "Reads of entries for followers behind that a leader held until the links to other brokers drained (felix_peer_queued_bytes under 8 MiB).",
                n.catch_up_reads_held().0,
            );
            let restores = n.restore_counts();
            m(
                "felix_replica_restores_in_pieces_total",
                "counter",
                "Snapshots whose state a replica read back from disk a piece at a time (installed, or kept across a restart; states of 1 MiB or more), finished.",
                restores.finished,
            );
            m(
                "felix_replica_restore_read_failures_total",
                "counter",
                "Reads of a snapshot's state back from disk that failed (each is tried again at the next tick).",
                restores.failed_reads,
            );
            m(
                "felix_replica_restores_given_up_total",
                "counter",
                "Restores whose reads failed for 30 s: the replica dropped its log and rejoined its group afresh.",
                restores.given_up,
            );
            m(
                "felix_replica_restoring",
                "gauge",
                "Replicas whose snapshot's state is being read back from disk (they serve nothing of their shard meanwhile).",
                n.restoring() as u64,
            );
            m(
                "felix_replica_snapshot_bytes",
                "gauge",
                "Bytes of replicas' snapshot data held in memory (only what is being sent: snapshots stay in the log files).",
                n.replica_snapshot_memory(),
            );
            m(
                "felix_replica_checkpoint_bytes",
                "gauge",
                "Bytes of replicas' checkpoints held in memory waiting for retention (a stream's commit state in them is shared with the live state, not counted).",
                n.replica_checkpoint_memory(),
            );
        }
        m(
            "felix_runtime_alive_tasks",
            "gauge",
            "Tasks alive in the broker's runtime.",
            tokio::runtime::Handle::current().metrics().num_alive_tasks() as u64,
        );
        m("felix_streams_opened_total", "counter", "Client-opened QUIC streams.", self.io.streams_opened);
        m("felix_frames_in_total", "counter", "Frames received.", st.frames_in);
        m("felix_frames_in_json_total", "counter", "JSON frames received after auth.", st.frames_in_json);
        m("felix_frames_in_binary_publish_total", "counter", "Binary publish frames received.", st.frames_in_binary);
        m("felix_acks_sent_total", "counter", "Publish answers sent (binary acks and JSON).", st.acks_sent);
        m("felix_bytes_out_events_total", "counter", "Bytes written to event streams.", self.io.bytes_out_events);
        m("felix_bytes_in_total", "counter", "Bytes received on client streams.", self.io.bytes_in);
        m("felix_bytes_out_total", "counter", "Bytes written to client streams.", self.io.bytes_out);
        m("felix_publishes_json_total", "counter", "JSON publish requests.", st.publishes_json);
        m("felix_publishes_binary_total", "counter", "Binary publish frames.", st.publishes_binary);
        m(
            "felix_publishes_compressed_total",
            "counter",
            "Binary publish frames that arrived compressed.",
            st.publishes_compressed,
        );
        m(
            "felix_compressed_bytes_in_total",
            "counter",
            "Compressed bytes of compressed publish batches, as received.",
            st.compressed_bytes_in,
        );
        m(
            "felix_compressed_plain_bytes_in_total",
            "counter",
            "Plain bytes compressed publish batches inflated to.",
            st.compressed_plain_bytes_in,
        );
        m("felix_publishes_refused_total", "counter", "Publishes refused.", st.publishes_refused);
        m(
            "felix_unacked_publish_failures_total",
            "counter",
            "Failed fire-and-forget publishes (never answered).",
            st.unacked_failures,
        );
        m("felix_records_appended_total", "counter", "Records appended.", st.records_appended);
        m(
            "felix_event_batches_delivered_total",
            "counter",
            "Event batches written to subscribers.",
            st.batches_delivered,
        );
        m(
            "felix_subscriber_records_dropped_total",
            "counter",
            "Records dropped from full subscriber queues.",
            st.records_dropped,
        );
        m(
            "felix_publishers_held_total",
            "counter",
            "Times a publishing stream was held for a slow subscriber of a stream kept in memory.",
            st.publishers_held,
        );
        m(
            "felix_subscribers_excused_total",
            "counter",
            "Subscribers that held their publishers as long as allowed and were left behind.",
            st.subscribers_excused,
        );
        m("felix_subscriptions_lagged_total", "counter", "Subscriptions ended with subscription_lagged.", st.lagged);
        m("felix_cache_hits_total", "counter", "Cache reads that found a value.", st.cache_hits);
        m("felix_cache_misses_total", "counter", "Cache reads that found nothing.", st.cache_misses);
        m(
            "felix_protocol_violations_total",
            "counter",
            "Connections closed for a framing violation.",
            st.protocol_violations,
        );
        m(
            "felix_subscriber_queue_bytes",
            "gauge",
            "Bytes queued for subscribers.",
            self.node.broker_ref().queued_event_bytes() as u64,
        );
        m(
            "felix_retained_log_bytes",
            "gauge",
            "Memory the history held in memory costs: payload plus a fixed overhead per batch.",
            self.node.broker_ref().retained_log_bytes(),
        );
        m("felix_storage_writes_total", "counter", "Batches written to storage.", self.io.storage_writes);
        m("felix_storage_write_failures_total", "counter", "Storage writes that failed.", self.io.storage_failures);
        m(
            "felix_storage_full_total",
            "counter",
            "Storage writes that failed for lack of space (the shard then refuses publishes until a write succeeds).",
            self.io.storage_full,
        );
        m(
            "felix_storage_passes_total",
            "counter",
            "Group-commit passes of the storage thread.",
            self.io.storage_passes,
        );
        m(
            "felix_storage_pass_micros_total",
            "counter",
            "Time spent in storage passes (write and sync), microseconds.",
            self.io.storage_micros,
        );
        m("felix_storage_pass_micros_max", "gauge", "Longest storage pass, microseconds.", self.io.storage_micros_max);
        if let Some(t) = &self.transport {
            crate::peer_links::render(&t.links(), &mut out);
        }
        out
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

    /// Carries out what the state machine asks for. Its writes to the replica logs (and the
    /// metadata log) are made at once, in order; with the replica logs synced before answering
    /// (the default), every other output after an append waits in [`ReplicaSyncGate`] until a
    /// sync has put that append on disk, so a vote, an append response, a commit counted with
    /// this broker's own copy, or a client's acknowledgement never goes out ahead of its bytes.
    fn drain(&mut self) {
        use felix_proto::cluster::node::NodeOutput;
        // Metadata log persists waiting to be written: consecutive ones are appended and
        // synced together, before any other output is carried out.
        let mut meta_unwritten = false;
        // How full the links to other brokers are: a leader holds its reads for followers
        // behind while they are full (`CATCH_UP_QUEUE_LIMIT`). Read here, before every drain:
        // the answers of a follower catching up wake this task as the links drain.
        if let (Node::Cluster(n), Some(t)) = (&mut self.node, &self.transport) {
            n.set_peer_queued(t.queued_bytes());
        }
        while let Some(o) = self.node.poll_output() {
            if meta_unwritten && !matches!(o, NodeOutput::PersistRaft { .. }) {
                meta_unwritten = false;
                self.write_meta_log();
            }
            match o {
                NodeOutput::PersistReplica { shard, entries, hard_state } => {
                    // Appended before anything after it is carried out (Raft's rule).
                    if let Some(l) = self.replica_logs.as_mut() {
                        match l.persist(&shard, &entries, hard_state.as_ref()) {
                            Ok(()) => self.gate.wrote(l.syncs_before_answering()),
                            Err(e) => {
                                if let Node::Cluster(n) = &mut self.node {
                                    n.handle_replica_persist_failed(&shard, &e.to_string(), now());
                                }
                            }
                        }
                    }
                }
                NodeOutput::PersistReplicaSnapshot { shard, snapshot, rest } => {
                    if let Some(l) = self.replica_logs.as_mut() {
                        match l.persist_snapshot(&shard, &snapshot, rest.as_ref()) {
                            Ok(()) => self.gate.wrote(l.syncs_before_answering()),
                            Err(e) => {
                                if let Node::Cluster(n) = &mut self.node {
                                    n.handle_replica_persist_failed(&shard, &e.to_string(), now());
                                }
                            }
                        }
                    }
                }
                NodeOutput::DropReplica { shard } => {
                    if let Some(l) = self.replica_logs.as_mut() {
                        l.drop_shard(&shard);
                    }
                }
                NodeOutput::ReadReplicaLog { shard, token, low, high, max_bytes } => {
                    // What was appended is readable now (a sync is not needed to read it), so
                    // the read is not held behind one; it runs on the blocking pool.
                    match self.replica_logs.as_ref().and_then(|l| l.read_job(&shard, low, high, max_bytes)) {
                        Some(job) => {
                            self.replica_log_reads += 1;
                            let tx = self.tx.clone();
                            tokio::task::spawn_blocking(move || {
                                let _ = tx.send(Input::ReplicaLogRead { token, result: job.run() });
                            });
                        }
                        None => {
                            if let Node::Cluster(n) = &mut self.node {
                                n.handle_replica_log_read(token, Err("no log kept for the shard".into()), now());
                            }
                        }
                    }
                }
                NodeOutput::ReadReplicaSnapshotPiece { shard, token, index, offset, len, verify } => {
                    // Like a read of entries: what was appended is readable now; off the task.
                    let job = self
                        .replica_logs
                        .as_ref()
                        .and_then(|l| l.snapshot_piece_job(&shard, index, offset, len, verify));
                    self.replica_snapshot_reads += 1;
                    match job {
                        Some(job) => {
                            let tx = self.tx.clone();
                            tokio::task::spawn_blocking(move || {
                                let _ = tx.send(Input::ReplicaSnapshotPiece { shard, token, result: job.run() });
                            });
                        }
                        None => {
                            if let Node::Cluster(n) = &mut self.node {
                                n.handle_replica_snapshot_piece(token, Err("no snapshot kept".into()), now());
                            }
                        }
                    }
                }
                NodeOutput::PersistRaftSnapshot { snapshot, received } => {
                    // Durable before anything after it is carried out, like a persist (the
                    // persists before it were written above). It stands for the log before
                    // it: the file is rewritten as the snapshot and the entries after it.
                    let index = snapshot.get_metadata().index;
                    if let Some((file, kept)) = self.raft_log.as_mut() {
                        kept.persist_snapshot(&snapshot);
                        if let Some(file) = file
                            && let Err(e) = file.rewrite(kept)
                        {
                            tracing::error!("writing the cluster's Raft log (a metadata snapshot at {index}): {e}");
                        }
                    }
                    if received {
                        tracing::info!(
                            "cluster: the metadata was restored from the leader's snapshot at index {index} ({} bytes)",
                            snapshot.get_data().len()
                        );
                    } else {
                        tracing::debug!(
                            "cluster: metadata log compacted at index {index} (a {} byte snapshot)",
                            snapshot.get_data().len()
                        );
                    }
                }
                NodeOutput::PersistRaft { entries, hard_state } => {
                    // Durable before anything after it is carried out (Raft's rule): written
                    // whole and synced here, on the task, before the next other output.
                    if let Some((_, kept)) = self.raft_log.as_mut() {
                        kept.persist(&entries, hard_state.as_ref());
                        self.meta_parts.push((entries, hard_state));
                        meta_unwritten = true;
                    }
                }
                o => {
                    if let Some(o) = self.gate.hold(o) {
                        self.carry_out(o);
                    }
                }
            }
        }
        if meta_unwritten {
            self.write_meta_log();
        }
        self.start_replica_sync();
        self.flush_storage();
    }

    /// Appends the metadata group's persists of this drain to its file (synced).
    fn write_meta_log(&mut self) {
        let parts = std::mem::take(&mut self.meta_parts);
        if let Some((Some(file), kept)) = self.raft_log.as_mut()
            && let Err(e) = file.append(&parts, kept)
        {
            tracing::error!("writing the cluster's Raft log: {e}");
        }
    }

    /// Hands the replica log files written since the last sync to the sync thread, unless a
    /// sync is already running (the next one then covers them too: group commit).
    fn start_replica_sync(&mut self) {
        let Some(covers) = self.gate.sync_to_start() else { return };
        let files = self.replica_logs.as_mut().map(crate::cluster::ReplicaLogs::take_unsynced).unwrap_or_default();
        if files.is_empty() {
            // Nothing left to sync (a shard dropped meanwhile): done at once.
            self.replica_synced(covers, Ok(()));
            return;
        }
        if self.replica_syncer.send((covers, files)).is_err() {
            self.replica_synced(covers, Err("the replica sync thread is gone".into()));
        }
    }

    /// A sync the sync thread ran has ended: what waited on it is carried out. A failed sync
    /// stops the broker: the kernel may have dropped the pages it failed to write, so what this
    /// broker appended (and told its peers it holds) can no longer be vouched for; the outputs
    /// that waited on it are never carried out (as PostgreSQL does since 2018's fsync
    /// failures). The process exits 74 (EX_IOERR) and a restart reads what is on disk.
    fn replica_synced(&mut self, covers: u64, result: Result<(), String>) {
        if let Err(e) = result {
            tracing::error!(
                "syncing a replica log failed: {e}; the broker stops rather than vouch for what the disk may not hold"
            );
            eprintln!(
                "felix: syncing a replica log failed: {e}; stopping (exit 74) without answering what waited on it"
            );
            std::process::exit(74);
        }
        for o in self.gate.synced(covers) {
            self.carry_out(o);
        }
        self.start_replica_sync();
    }

    /// Carries out one output that is not a write to a replica or metadata log.
    fn carry_out(&mut self, o: felix_proto::cluster::node::NodeOutput) {
        use felix_proto::cluster::node::NodeOutput;
        {
            let o = match o {
                NodeOutput::Broker(o) => o,
                NodeOutput::Peer { to, message } => {
                    let failed = match &self.transport {
                        Some(t) => t.send(&to, message).err().map(|m| *m),
                        None => Some(message),
                    };
                    if let (Some(m), Node::Cluster(n)) = (failed, &mut self.node) {
                        n.handle_undeliverable(m, now());
                    }
                    return;
                }
                NodeOutput::PeerAdded { name, cluster_addr } => {
                    use std::net::ToSocketAddrs;
                    match cluster_addr.to_socket_addrs().ok().and_then(|mut a| a.next()) {
                        Some(addr) => {
                            if let Some(t) = self.transport.as_mut() {
                                t.add_peer(&name, addr);
                            }
                            tracing::info!("cluster: {name} joined the members, at {addr}");
                        }
                        None => tracing::error!("cluster: member {name}'s address {cluster_addr:?} does not resolve"),
                    }
                    return;
                }
                NodeOutput::PeerRefused { name, why } => {
                    tracing::error!("cluster: refused {name}: {why}");
                    return;
                }
                NodeOutput::ReplicaRejoin { shard, what } => {
                    tracing::warn!(
                        "cluster: replica of {}/{}/{} shard {}: {what}",
                        shard.tenant,
                        shard.namespace,
                        shard.name,
                        shard.shard
                    );
                    return;
                }
                NodeOutput::PeerRemoved { name } => {
                    if let Some(t) = self.transport.as_mut() {
                        t.remove_peer(&name);
                    }
                    tracing::info!("cluster: {name} left the members");
                    return;
                }
                // Writes (and reads of replica logs) are made in `drain`, never held.
                NodeOutput::PersistReplica { .. }
                | NodeOutput::PersistReplicaSnapshot { .. }
                | NodeOutput::DropReplica { .. }
                | NodeOutput::ReadReplicaLog { .. }
                | NodeOutput::ReadReplicaSnapshotPiece { .. }
                | NodeOutput::PersistRaft { .. }
                | NodeOutput::PersistRaftSnapshot { .. } => return,
            };
            match o {
                BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data }) => {
                    self.io.bytes_out += data.len() as u64;
                    if stream.initiator() == felix_proto::transport::Side::Broker {
                        self.io.bytes_out_events += data.len() as u64;
                    }
                    if let Some(w) = self.conns.get(&conn).and_then(|h| h.writers.get(&stream)) {
                        let _ = w.send(WriterCmd::Data(data));
                    }
                }
                BrokerOutput::Transport(TransportOutput::Finish { conn, stream }) => {
                    if let Some(w) = self.conns.get_mut(&conn).and_then(|h| h.writers.remove(&stream)) {
                        let _ = w.send(WriterCmd::Finish);
                    }
                }
                BrokerOutput::Transport(TransportOutput::StopSending { conn, stream, code }) => {
                    if let Some(g) = self.conns.get_mut(&conn).and_then(|h| h.gates.remove(&stream)) {
                        let _ = g.send(ReadGate::Stopped(code));
                    }
                }
                BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream }) => {
                    if let Some(g) = self.conns.get(&conn).and_then(|h| h.gates.get(&stream)) {
                        let _ = g.send(ReadGate::Paused);
                    }
                }
                BrokerOutput::Transport(TransportOutput::ResumeReading { conn, stream }) => {
                    if let Some(g) = self.conns.get(&conn).and_then(|h| h.gates.get(&stream)) {
                        let _ = g.send(ReadGate::Open);
                    }
                }
                BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                    if let Some(h) = self.conns.get(&conn) {
                        let quic = h.quic.clone();
                        let tx = self.tx.clone();
                        tokio::spawn(async move {
                            if let Ok(send) = quic.open_uni().await {
                                let _ = tx.send(Input::Opened { conn, token, send });
                            }
                        });
                    }
                }
                BrokerOutput::Storage(StorageOutput::Persist(w)) => self.pending_writes.push(w),
                // What a read asks for was written before it was asked (it is below what the
                // log holds in memory): no flush of pending writes needed.
                BrokerOutput::Storage(StorageOutput::Read(r)) => {
                    let _ = self.history.send(r);
                }
                BrokerOutput::Storage(StorageOutput::Truncate {
                    tenant_id,
                    namespace,
                    stream,
                    shard,
                    start,
                    producers_forgotten,
                    state_checkpoint,
                }) => {
                    // Writes asked for before the truncation go first.
                    self.flush_storage();
                    let _ = self.storage.send(StorageCmd::Truncate {
                        tenant: tenant_id,
                        namespace,
                        stream,
                        shard,
                        start,
                        forgotten: producers_forgotten,
                        state: state_checkpoint,
                    });
                }
                BrokerOutput::Storage(StorageOutput::DeleteStream { tenant_id, namespace, stream }) => {
                    // Writes asked for before the deletion go first.
                    self.flush_storage();
                    let _ = self.storage.send(StorageCmd::DeleteStream { tenant: tenant_id, namespace, stream });
                }
                BrokerOutput::Storage(StorageOutput::CreateStream { token, tenant_id, namespace, stream, shards }) => {
                    let _ = self.storage.send(StorageCmd::CreateStream {
                        token,
                        tenant: tenant_id,
                        namespace,
                        stream,
                        shards,
                    });
                }
                BrokerOutput::Storage(StorageOutput::ResetShard { tenant_id, namespace, stream, shard }) => {
                    self.flush_storage();
                    let _ = self.storage.send(StorageCmd::ResetShard { tenant: tenant_id, namespace, stream, shard });
                }
                // Only a broker of a cluster emits these, and its ClusterNode takes them before
                // they reach here: a single broker answers any it gets as the cluster would.
                BrokerOutput::Cluster(c) => {
                    if let Node::Single(b) = &mut self.node {
                        b.handle_cluster_output_alone(c, now());
                    }
                }
                BrokerOutput::Transport(TransportOutput::CloseConnection { conn, code, reason }) => {
                    if let Some(h) = self.conns.remove(&conn) {
                        h.quic.close(VarInt::from_u64(code).unwrap_or(VarInt::from_u32(0)), reason.as_bytes());
                    }
                }
            }
        }
    }
}

/// The outputs that wait for replica log appends to reach the disk.
///
/// Each append taken from the state machine counts one write; an output polled after it is
/// held, tagged with the writes made so far, and carried out once a sync covering that many
/// writes has ended. Held outputs leave in the order they came (a client stream's frames, a
/// peer's messages), so one held output holds every later one: it is a queue, not a filter.
/// While a sync runs, appends go on and the next sync covers all of them: one `fdatasync` per
/// written file for every append since the last, so the disk's latency is paid once per batch
/// of work, not once per shard or per record.
#[derive(Default)]
struct ReplicaSyncGate {
    /// Appends made that must be synced before what follows them.
    writes: u64,
    /// Appends the last finished sync covered.
    synced: u64,
    /// A sync is running.
    syncing: bool,
    /// Outputs waiting, each with the writes that must be synced first.
    held: std::collections::VecDeque<(u64, felix_proto::cluster::node::NodeOutput)>,
}

impl ReplicaSyncGate {
    /// An append was made; `must_sync`: under the default policy (a lazy one holds nothing).
    fn wrote(&mut self, must_sync: bool) {
        if must_sync {
            self.writes += 1;
        }
    }

    /// `o` if it may be carried out now, else `None` (held).
    fn hold(&mut self, o: felix_proto::cluster::node::NodeOutput) -> Option<felix_proto::cluster::node::NodeOutput> {
        if self.held.is_empty() && self.writes == self.synced {
            return Some(o);
        }
        self.held.push_back((self.writes, o));
        None
    }

    /// The writes a sync started now covers, when one should start.
    fn sync_to_start(&mut self) -> Option<u64> {
        if self.syncing || self.writes == self.synced {
            return None;
        }
        self.syncing = true;
        Some(self.writes)
    }

    /// A sync covering `covers` writes ended: the outputs it released, in order.
    fn synced(&mut self, covers: u64) -> Vec<felix_proto::cluster::node::NodeOutput> {
        self.syncing = false;
        self.synced = self.synced.max(covers);
        let mut out = Vec::new();
        while self.held.front().is_some_and(|(needs, _)| *needs <= self.synced) {
            if let Some((_, o)) = self.held.pop_front() {
                out.push(o);
            }
        }
        out
    }
}

/// The thread that syncs replica log files off the broker task: each job is the files written
/// since the last one and the writes it covers; its end is sent back as an input.
fn replica_sync_thread(
    tx: mpsc::UnboundedSender<Input>,
) -> std::io::Result<std::sync::mpsc::Sender<(u64, Vec<crate::cluster::UnsyncedFile>)>> {
    let (jobs, rx) = std::sync::mpsc::channel::<(u64, Vec<crate::cluster::UnsyncedFile>)>();
    std::thread::Builder::new().name("felix-replica-sync".into()).spawn(move || {
        for (covers, files) in rx {
            let result = crate::cluster::sync_many(&files);
            if tx.send(Input::ReplicaSynced { covers, result }).is_err() {
                return;
            }
        }
    })?;
    Ok(jobs)
}

/// Reads the metrics a broker serves on `addr` (its `metrics_listen`): the Prometheus text,
/// without the HTTP head. For tests and tools.
///
/// # Errors
/// Connection and read failures.
pub async fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    http_get(addr, "/metrics").await
}

/// A broker's cluster state (`GET /cluster` on its metrics listener), as JSON text.
///
/// # Errors
/// Connection and read failures.
pub async fn cluster_status(addr: SocketAddr) -> std::io::Result<String> {
    http_get(addr, "/cluster").await
}

/// One page of a broker's cluster state (`GET /cluster?limit=N&after=CURSOR`, D55): the shards
/// after `after` (a `next` of the page before), `limit` of them. A broker older than pages
/// answers the whole state, without `next`.
///
/// # Errors
/// Connection and read failures.
pub async fn cluster_status_page(addr: SocketAddr, after: Option<&str>, limit: u32) -> std::io::Result<String> {
    let after = after.map(|a| format!("&after={}", percent_encode(a))).unwrap_or_default();
    http_get(addr, &format!("/cluster?limit={limit}{after}")).await
}

/// The page a `GET /cluster` asks for (D55): `None` for the whole status; a reason for a
/// `limit` that is not a number or an `after` that is not a cursor a page gave.
fn status_page_of(head: &str) -> Result<Option<felix_proto::cluster::status::StatusPage>, String> {
    use felix_proto::cluster::{metadata::ShardId, status::StatusPage};
    let target = head.lines().next().and_then(|l| l.split(' ').nth(1)).unwrap_or_default();
    let Some((_, query)) = target.split_once('?') else { return Ok(None) };
    let arg = |name: &str| {
        query.split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == name).map(|(_, v)| percent_decode(v))
    };
    let (limit, after) = (arg("limit"), arg("after"));
    if limit.is_none() && after.is_none() {
        return Ok(None);
    }
    let limit = match limit {
        None => felix_proto::broker::cluster_admin::DEFAULT_STATUS_PAGE,
        Some(l) => l.parse::<usize>().map_err(|_| format!("limit={l:?} is not a number of shards"))?,
    };
    let after = match after {
        None => None,
        Some(a) => Some(ShardId::from_cursor(&a).ok_or_else(|| format!("after={a:?} is not a cursor a page gave"))?),
    };
    Ok(Some(StatusPage { after, limit: limit.clamp(1, felix_proto::cluster::status::STATUS_PAGE_MAX) }))
}

/// Asks a broker of the cluster (at its metrics listener) to change the members:
/// `add` (`node`, its cluster address `addr`) or remove (`node`, `force`). Answers the HTTP
/// status and body: 202 when proposed, 401 for a wrong secret, 409 with the reason when refused.
pub async fn cluster_admin(
    metrics: SocketAddr,
    add: Option<&str>,
    node: &str,
    force: bool,
    secret: &str,
) -> std::io::Result<(u16, String)> {
    let enc = percent_encode;
    let path = match add {
        Some(addr) => format!("/cluster/add?node={}&addr={}", enc(node), enc(addr)),
        None => format!("/cluster/remove?node={}{}", enc(node), if force { "&force=1" } else { "" }),
    };
    admin_post(metrics, &path, secret).await
}

/// Asks a broker of the cluster (at its metrics listener) to move a stream shard to `to`, or
/// with `to` `None` to cancel its move. Answers as [`cluster_admin`].
pub async fn cluster_move(
    metrics: SocketAddr,
    (tenant, namespace, stream): (&str, &str, &str),
    shard: u32,
    to: Option<&str>,
    secret: &str,
) -> std::io::Result<(u16, String)> {
    let enc = percent_encode;
    let what = match to {
        Some(to) => format!("to={}", enc(to)),
        None => "cancel=1".into(),
    };
    let path = format!(
        "/cluster/move?tenant={}&namespace={}&stream={}&shard={shard}&{what}",
        enc(tenant),
        enc(namespace),
        enc(stream)
    );
    admin_post(metrics, &path, secret).await
}

/// Asks a broker of the cluster to drain broker `node` (its shards move to the others), or
/// with `node` `None` to rebalance every shard. Answers as [`cluster_admin`].
pub async fn cluster_drain(metrics: SocketAddr, node: Option<&str>, secret: &str) -> std::io::Result<(u16, String)> {
    let path = match node {
        Some(n) => format!("/cluster/drain?node={}", percent_encode(n)),
        None => "/cluster/rebalance".into(),
    };
    admin_post(metrics, &path, secret).await
}

/// Asks a broker of the cluster (at its metrics listener) to revoke a signed token on every
/// broker, by token id and/or principal. Answers as [`cluster_admin`].
pub async fn cluster_revoke(
    metrics: SocketAddr,
    jti: Option<&str>,
    sub: Option<&str>,
    secret: &str,
) -> std::io::Result<(u16, String)> {
    let mut q = Vec::new();
    if let Some(j) = jti {
        q.push(format!("jti={}", percent_encode(j)));
    }
    if let Some(s) = sub {
        q.push(format!("sub={}", percent_encode(s)));
    }
    admin_post(metrics, &format!("/cluster/revoke?{}", q.join("&")), secret).await
}

async fn admin_post(metrics: SocketAddr, path: &str, secret: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(metrics).await?;
    s.write_all(
        format!("POST {path} HTTP/1.0\r\nAuthorization: Bearer {secret}\r\nContent-Length: 0\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut text = String::new();
    s.read_to_string(&mut text).await?;
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, text.split_once("\r\n\r\n").map_or(text.clone(), |(_, b)| b.to_owned())))
}

async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body.split_once("\r\n\r\n").map_or(body.clone(), |(_, b)| b.to_owned()))
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

#[cfg(test)]
mod admin_tests {
    use super::*;

    fn post(target: &str, secret: &str) -> String {
        format!("POST {target} HTTP/1.0\r\nAuthorization: Bearer {secret}\r\n")
    }

    #[test]
    fn status_pages_are_read_from_the_query() {
        use felix_proto::cluster::metadata::{Kind, ShardId};
        let get = |t: &str| format!("GET {t} HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status_page_of(&get("/cluster")), Ok(None));
        let p = status_page_of(&get("/cluster?limit=20")).unwrap().unwrap();
        assert_eq!((p.after, p.limit), (None, 20));
        let s = ShardId::of(Kind::Cache, "t 1", "ns", "a~b", 3);
        let p = status_page_of(&get(&format!("/cluster?after={}", percent_encode(&s.cursor())))).unwrap().unwrap();
        assert_eq!(p.after, Some(s));
        assert_eq!(p.limit, felix_proto::broker::cluster_admin::DEFAULT_STATUS_PAGE);
        assert_eq!(status_page_of(&get("/cluster?limit=99999")).unwrap().unwrap().limit, 5_000);
        assert!(status_page_of(&get("/cluster?limit=ten")).is_err());
        assert!(status_page_of(&get("/cluster?after=nonsense")).is_err());
    }

    #[test]
    fn admin_requests_are_read_with_their_secret_and_percent_decoded() {
        let ok = |t: &str| admin_request(&post(t, "s"), Some("s"));
        assert!(
            matches!(ok("/cluster/add?node=n4&addr=h:7004"), Ok(AdminRequest::Add { node, addr }) if node == "n4" && addr == "h:7004")
        );
        assert!(matches!(ok("/cluster/remove?node=n4&force=1"), Ok(AdminRequest::Remove { force: true, .. })));
        let j = format!("/cluster/revoke?jti={}", percent_encode("a b/c%"));
        assert!(matches!(ok(&j), Ok(AdminRequest::Revoke { jti: Some(j), sub: None }) if j == "a b/c%"));
        assert!(
            matches!(ok("/cluster/revoke?sub=alice"), Ok(AdminRequest::Revoke { jti: None, sub: Some(s) }) if s == "alice")
        );
        assert_eq!(ok("/cluster/revoke").err().map(|e| e.0), Some(400));
        assert_eq!(ok("/cluster/remove").err().map(|e| e.0), Some(400));
        assert_eq!(ok("/cluster/nope?node=x").err().map(|e| e.0), Some(404));
        assert_eq!(admin_request(&post("/cluster/revoke?sub=a", "wrong"), Some("s")).err().map(|e| e.0), Some(401));
        assert_eq!(admin_request(&post("/cluster/revoke?sub=a", "s"), None).err().map(|e| e.0), Some(404));
        assert_eq!(percent_decode("%zz%4"), "%zz%4", "malformed escapes are kept");
    }
}

#[cfg(test)]
mod replica_sync_gate_tests {
    use super::ReplicaSyncGate;
    use felix_proto::cluster::node::NodeOutput;

    fn out(n: u8) -> NodeOutput {
        NodeOutput::PeerRemoved { name: n.to_string() }
    }

    fn names(v: Vec<NodeOutput>) -> Vec<String> {
        v.into_iter()
            .map(|o| match o {
                NodeOutput::PeerRemoved { name } => name,
                _ => String::from("?"),
            })
            .collect()
    }

    #[test]
    fn outputs_after_an_append_wait_for_its_sync_and_leave_in_order() {
        let mut g = ReplicaSyncGate::default();
        // Nothing written: carried out at once.
        assert!(g.hold(out(1)).is_some());
        assert_eq!(g.sync_to_start(), None);
        g.wrote(true);
        assert!(g.hold(out(2)).is_none(), "after an unsynced append: held");
        assert_eq!(g.sync_to_start(), Some(1));
        // While that sync runs, more appends: the next sync covers them, not this one.
        g.wrote(true);
        assert!(g.hold(out(3)).is_none());
        assert_eq!(g.sync_to_start(), None, "one sync at a time");
        assert_eq!(names(g.synced(1)), ["2"], "only what the first append held");
        assert!(g.hold(out(4)).is_none(), "behind a held output: held, whatever it needs");
        assert_eq!(g.sync_to_start(), Some(2));
        assert_eq!(names(g.synced(2)), ["3", "4"]);
        assert!(g.hold(out(5)).is_some(), "all synced, nothing held: at once again");
    }

    #[test]
    fn a_lazy_policy_holds_nothing() {
        let mut g = ReplicaSyncGate::default();
        g.wrote(false);
        assert!(g.hold(out(1)).is_some());
        assert_eq!(g.sync_to_start(), None);
    }
}
