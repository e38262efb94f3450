//! The cluster transport: QUIC between brokers on a listener of their own (never the client
//! listener), carrying `felix_proto::cluster::peer` messages. The driver decides nothing: the
//! broker's [`ClusterNode`](felix_proto::cluster::node::ClusterNode) says what goes to whom.
//!
//! Each broker dials every other one and sends on one unidirectional stream: first a `hello`
//! with the cluster's name and shared secret, then messages in order. A receiving broker reads
//! the hello before anything else; a stranger (another cluster, a wrong secret, an unknown node
//! id) has its connection closed and is logged. A peer that cannot be reached is dialled again
//! every 200 ms; meanwhile a forwarded publish for it is reported undeliverable (its client gets
//! `shard_unavailable`), and Raft messages are dropped (Raft sends again).

use bytes::BytesMut;
use felix_proto::cluster::peer::{PeerDecoder, PeerMessage, encode, encode_chunks};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

use crate::peer_links::{LinkReport, Links};

/// The ALPN id of the cluster listener (clients never speak it).
pub const CLUSTER_ALPN: &[u8] = b"felix-cluster/1";

/// How a broker joins its cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// This broker's node id.
    pub node_id: String,
    /// Where this broker listens for its peers.
    pub listen: SocketAddr,
    /// Every broker of the cluster (this one included): node id and cluster address.
    pub peers: Vec<(String, SocketAddr)>,
    /// The cluster's name: brokers of another cluster are refused.
    pub name: String,
    /// The secret every broker of the cluster shares: a peer that does not know it is refused.
    pub secret: String,
    /// The client address this broker advertises to clients (default: its client listener).
    pub advertise: Option<String>,
    /// This broker joins a running cluster (an operator adds it with `cluster add`) instead
    /// of founding one with `peers`; `peers` then names the members it knows of.
    pub join: bool,
    /// Entry bytes of its Raft log each replica keeps in memory once applied (older entries
    /// are read back from its log files); `None`: `REPLICA_ENTRY_CACHE` (8 MiB). Only with a
    /// data directory.
    pub replica_entry_cache: Option<u64>,
    /// Bytes a second moves copy at most to and from this broker (`None`: unlimited), see
    /// `felix_proto::cluster::bandwidth`.
    pub move_bandwidth: Option<u64>,
    /// Applied metadata log entries past the last metadata snapshot that make this broker
    /// take one and compact the log (`None`: `META_SNAPSHOT_ENTRIES`, 10,000; `Some(0)`:
    /// never), see `felix_proto::cluster::metadata::snapshot`.
    pub metadata_snapshot_entries: Option<u64>,
}

/// What the transport tells the broker task.
pub(crate) enum PeerInput {
    /// A message from peer `from` (its hello was checked).
    Message { from: String, message: PeerMessage },
    /// A message that could not be sent.
    Undeliverable(PeerMessage),
    /// The connection to peer `name` closed: what was written on it may not have arrived.
    Lost(String),
    /// A chunk of a shard's snapshot at `index` was written to peer `to`'s stream (the send
    /// reads its next one).
    ChunkWritten { to: String, shard: ShardId, index: u64 },
}

/// The sending side: one queue per peer.
pub(crate) struct Transport {
    senders: BTreeMap<String, mpsc::UnboundedSender<PeerMessage>>,
    endpoint: quinn::Endpoint,
    /// Node ids accepted as peers (the cluster's members; changes with `cluster add|remove`).
    known: Known,
    hello: PeerMessage,
    inputs: mpsc::UnboundedSender<PeerInput>,
    me: String,
    /// Bytes of messages queued for peers and not yet written to their streams (about:
    /// [`felix_proto::cluster::peer::size_hint`]), over every peer.
    queued: Arc<std::sync::atomic::AtomicU64>,
    /// Each peer's link, for the metrics.
    links: Links,
}

type Known = Arc<std::sync::RwLock<std::collections::BTreeSet<String>>>;

impl Transport {
    /// Binds the cluster listener and starts dialling every peer.
    pub(crate) fn start(
        opts: &ClusterOptions,
        incarnation: &str,
        identity: crate::Identity,
        inputs: mpsc::UnboundedSender<PeerInput>,
    ) -> Result<Transport, crate::ServerError> {
        let mut tls = crate::tls::server_config(identity)?;
        tls.alpn_protocols = vec![CLUSTER_ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls)
            .map_err(|e| crate::ServerError::Tls(crate::tls::TlsError::Generate(e.to_string())))?;
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        // Peers are on the listener's kind of path (loopback with loopback).
        server.transport_config(peer_transport(opts.listen));
        let tuning = felix_driver_common::transport::TransportTuning::default();
        let socket = crate::server::udp_socket(opts.listen, &tuning)?;
        let endpoint =
            quinn::Endpoint::new(tuning.endpoint_config(), Some(server), socket, Arc::new(quinn::TokioRuntime))?;
        let known: Known = Arc::new(std::sync::RwLock::new(opts.peers.iter().map(|(n, _)| n.clone()).collect()));
        let links = Links::default();
        tokio::spawn(accept_loop(
            endpoint.clone(),
            opts.name.clone(),
            opts.secret.clone(),
            known.clone(),
            inputs.clone(),
            links.clone(),
        ));
        let hello = PeerMessage::Hello {
            cluster: opts.name.clone(),
            node_id: opts.node_id.clone(),
            secret: opts.secret.clone(),
            incarnation: incarnation.to_owned(),
            features: felix_proto::cluster::peer::PEER_FEATURES,
        };
        let queued = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let mut t = Transport {
            senders: BTreeMap::new(),
            endpoint,
            known,
            hello,
            inputs,
            me: opts.node_id.clone(),
            queued,
            links,
        };
        for (name, addr) in &opts.peers {
            t.add_peer(name, *addr);
        }
        Ok(t)
    }

    /// Accepts `name` as a peer and keeps a connection to it at `addr` (a broker added to the
    /// cluster). Idempotent: a peer already dialled keeps its connection.
    pub(crate) fn add_peer(&mut self, name: &str, addr: SocketAddr) {
        if let Ok(mut k) = self.known.write() {
            k.insert(name.to_owned());
        }
        if name == self.me || self.senders.contains_key(name) {
            return;
        }
        let (tx, rx) = mpsc::unbounded_channel();
        self.senders.insert(name.to_owned(), tx);
        let peer = name.to_owned();
        let queue = Queue { rx, queued: self.queued.clone() };
        let link = self.links.clone();
        tokio::spawn(dial_loop(
            self.endpoint.clone(),
            addr,
            peer,
            self.hello.clone(),
            queue,
            self.inputs.clone(),
            link,
        ));
    }

    /// Stops dialling `name` and refuses it as a peer from now on (a broker removed from the
    /// cluster). Its connection task ends when its queue closes.
    pub(crate) fn remove_peer(&mut self, name: &str) {
        if let Ok(mut k) = self.known.write() {
            k.remove(name);
        }
        self.senders.remove(name);
        self.links.remove(name);
    }

    /// Queues a message for peer `to`; a peer not in the cluster's list gets nothing.
    pub(crate) fn send(&self, to: &str, message: PeerMessage) -> Result<(), Box<PeerMessage>> {
        match self.senders.get(to) {
            Some(tx) => {
                // Counted before it is queued: the peer's task may take it at once.
                let size = felix_proto::cluster::peer::size_hint(&message) as u64;
                self.queued.fetch_add(size, std::sync::atomic::Ordering::Relaxed);
                tx.send(message).map_err(|e| {
                    self.queued.fetch_sub(size, std::sync::atomic::Ordering::Relaxed);
                    Box::new(e.0)
                })
            }
            None => Err(Box::new(message)),
        }
    }

    /// Bytes of messages queued for peers and not yet written to their streams.
    pub(crate) fn queued_bytes(&self) -> u64 {
        self.queued.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Each peer's link as the metrics show it, in node id order.
    pub(crate) fn links(&self) -> Vec<LinkReport> {
        self.links.report()
    }

    /// The cluster listener's address.
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    pub(crate) fn close(&self) {
        self.endpoint.close(quinn::VarInt::from_u32(0), b"broker shutting down");
    }
}

/// Writes one record's pieces, in order, to the sink it is given.
type RecordWriter<'a> = dyn FnMut(&mut dyn FnMut(&[u8]) -> std::io::Result<()>) -> std::io::Result<()> + 'a;

/// The most bytes of a snapshot's small pieces gathered into one write.
const SNAPSHOT_WRITE_BYTES: usize = 1 << 20;

/// Peer connections notice a dead broker within this (keep-alives every quarter of it): a
/// connection to a broker that was killed and restarted must not linger for quinn's default
/// 30 s, sending into a process that no longer knows it.
const PEER_IDLE_TIMEOUT: Duration = Duration::from_secs(2);

/// The cluster transport's QUIC settings for a path to `peer`: the client path's tuning
/// (windows, a 6,144-byte MTU from the first packet on loopback, discovery elsewhere: a
/// replicated shard's whole batches cross it, where quinn's defaults, 1,200-byte packets and
/// small windows, held a three-replica stream to a sixth of one replica's throughput), with a
/// short idle timeout.
fn peer_transport(peer: SocketAddr) -> Arc<quinn::TransportConfig> {
    let mut t = felix_driver_common::transport::TransportTuning::default().to_quinn_for(peer);
    if let Ok(idle) = quinn::IdleTimeout::try_from(PEER_IDLE_TIMEOUT) {
        t.max_idle_timeout(Some(idle));
    }
    t.keep_alive_interval(Some(PEER_IDLE_TIMEOUT / 4));
    Arc::new(t)
}

fn client_config(peer: SocketAddr) -> Result<quinn::ClientConfig, String> {
    let mut tls =
        crate::tls::client_config(crate::Trust::DangerAcceptAnyCertificate, false).map_err(|e| e.to_string())?;
    tls.alpn_protocols = vec![CLUSTER_ALPN.to_vec()];
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(peer_transport(peer));
    Ok(cfg)
}

/// Keeps one connection and one stream to a peer, sending what is queued for it.
async fn dial_loop(
    endpoint: quinn::Endpoint,
    addr: SocketAddr,
    peer: String,
    hello: PeerMessage,
    mut queue: Queue,
    inputs: mpsc::UnboundedSender<PeerInput>,
    links: Links,
) {
    let Ok(cfg) = client_config(addr) else { return };
    let bytes_out = links.bytes_out(&peer);
    let mut buf = BytesMut::new();
    loop {
        let conn = match endpoint.connect_with(cfg.clone(), addr, "localhost") {
            Ok(c) => c.await.ok(),
            Err(_) => None,
        };
        let stream = match &conn {
            Some(c) => c.open_uni().await.ok(),
            None => None,
        };
        let Some(mut send) = stream else {
            // Unreachable: what waits is undeliverable now, then dial again.
            let deadline = tokio::time::sleep(Duration::from_millis(200));
            tokio::pin!(deadline);
            loop {
                tokio::select! {
                    m = queue.recv() => match m {
                        Some(m) => { let _ = inputs.send(PeerInput::Undeliverable(m)); }
                        None => return,
                    },
                    () = &mut deadline => break,
                }
            }
            continue;
        };
        buf.clear();
        if encode(&hello, &mut buf).is_err() || send.write_all(&buf).await.is_err() {
            continue;
        }
        bytes_out.fetch_add(buf.len() as u64, std::sync::atomic::Ordering::Relaxed);
        if let Some(c) = &conn {
            links.up(&peer, c);
        }
        let mut chunks: Vec<bytes::Bytes> = Vec::new();
        // Writes and the connection's end, together: a connection that died (the peer went
        // quiet past the idle timeout) is said at once, not when the next write fails.
        let closed = conn.clone();
        let closed = async move {
            if let Some(c) = closed {
                c.closed().await;
            }
        };
        tokio::pin!(closed);
        loop {
            let m = tokio::select! {
                m = queue.recv() => match m {
                    Some(m) => m,
                    None => break,
                },
                () = &mut closed => {
                    let _ = inputs.send(PeerInput::Lost(peer.clone()));
                    break;
                }
            };
            chunks.clear();
            // In pieces: the entries a leader replicates go to QUIC as they are, not copied into
            // a frame buffer (and again into the stream's) for every follower.
            if let Err(e) = encode_chunks(&m, &mut chunks) {
                // The node never makes one (its batches are split): said, not silently lost.
                tracing::warn!("a peer message for {addr} was not sent: {e}");
                continue;
            }
            let len: usize = chunks.iter().map(bytes::Bytes::len).sum();
            if send.write_all_chunks(&mut chunks).await.is_err() {
                let _ = inputs.send(PeerInput::Undeliverable(m));
                let _ = inputs.send(PeerInput::Lost(peer.clone()));
                break;
            }
            bytes_out.fetch_add(len as u64, std::sync::atomic::Ordering::Relaxed);
            if let PeerMessage::SnapshotChunk(c) = m {
                let _ = inputs.send(PeerInput::ChunkWritten { to: peer.clone(), shard: c.shard, index: c.index });
            }
        }
        if let Some(c) = &conn {
            links.down(&peer, c);
        }
        if queue.rx.is_closed() {
            return;
        }
    }
}

/// What is queued for one peer, and the transport's count of queued bytes it takes from.
struct Queue {
    rx: mpsc::UnboundedReceiver<PeerMessage>,
    queued: Arc<std::sync::atomic::AtomicU64>,
}

impl Queue {
    /// The next message, no longer counted as queued.
    async fn recv(&mut self) -> Option<PeerMessage> {
        let m = self.rx.recv().await?;
        let size = felix_proto::cluster::peer::size_hint(&m) as u64;
        // (Added when it was queued: never below zero.)
        let _ =
            self.queued.fetch_update(std::sync::atomic::Ordering::Relaxed, std::sync::atomic::Ordering::Relaxed, |q| {
                Some(q.saturating_sub(size))
            });
        Some(m)
    }
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    cluster: String,
    secret: String,
    known: Known,
    inputs: mpsc::UnboundedSender<PeerInput>,
    links: Links,
) {
    while let Some(incoming) = endpoint.accept().await {
        let (cluster, secret, known, inputs, links) =
            (cluster.clone(), secret.clone(), known.clone(), inputs.clone(), links.clone());
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok(mut recv) = conn.accept_uni().await {
                let (cluster, secret, known, inputs, conn, links) =
                    (cluster.clone(), secret.clone(), known.clone(), inputs.clone(), conn.clone(), links.clone());
                tokio::spawn(async move {
                    let mut d = PeerDecoder::default();
                    let mut from: Option<String> = None;
                    // The peer's count of bytes read, once its hello named it.
                    let mut bytes_in: Option<Arc<std::sync::atomic::AtomicU64>> = None;
                    while let Ok(Some(chunk)) = recv.read_chunk(64 * 1024, true).await {
                        d.push(&chunk.bytes);
                        loop {
                            let m = match d.next_message() {
                                Ok(Some(m)) => m,
                                Ok(None) => break,
                                Err(e) => {
                                    tracing::warn!("peer {}: {e}; connection closed", conn.remote_address());
                                    conn.close(quinn::VarInt::from_u32(1), b"bad peer frame");
                                    return;
                                }
                            };
                            match (&from, m) {
                                (
                                    None,
                                    PeerMessage::Hello { cluster: c, node_id, secret: s, incarnation, features },
                                ) => {
                                    let member = known.read().is_ok_and(|k| k.contains(&node_id));
                                    if c != cluster || !same_secret(&s, &secret) || !member {
                                        tracing::warn!(
                                            "refused a peer at {} claiming to be {node_id:?} of cluster {c:?}: not a broker of this cluster",
                                            conn.remote_address()
                                        );
                                        conn.close(quinn::VarInt::from_u32(2), b"not a broker of this cluster");
                                        return;
                                    }
                                    // The broker judges its incarnation (a wiped data directory
                                    // is refused there).
                                    let hello = PeerMessage::Hello {
                                        cluster: c,
                                        node_id: node_id.clone(),
                                        secret: String::new(),
                                        incarnation,
                                        features,
                                    };
                                    let _ = inputs.send(PeerInput::Message { from: node_id.clone(), message: hello });
                                    bytes_in = Some(links.bytes_in(&node_id));
                                    from = Some(node_id);
                                }
                                (None, _) => {
                                    tracing::warn!("peer {} spoke before its hello; refused", conn.remote_address());
                                    conn.close(quinn::VarInt::from_u32(2), b"hello first");
                                    return;
                                }
                                (Some(f), message) => {
                                    let _ = inputs.send(PeerInput::Message { from: f.clone(), message });
                                }
                            }
                        }
                        // Counted once its hello named the peer (the hello's chunk too).
                        if let Some(n) = &bytes_in {
                            n.fetch_add(chunk.bytes.len() as u64, std::sync::atomic::Ordering::Relaxed);
                        }
                    }
                });
            }
        });
    }
}

/// Compares secrets in time that does not depend on where they differ.
pub(crate) fn same_secret(a: &str, b: &str) -> bool {
    let (a, b) = (a.as_bytes(), b.as_bytes());
    let mut diff = u8::from(a.len() != b.len());
    for i in 0..a.len().max(b.len()) {
        diff |= a.get(i).copied().unwrap_or(0) ^ b.get(i).copied().unwrap_or(0);
    }
    diff == 0
}

/// Where a broker keeps its metadata Raft log (replaced whole, atomically, on every change).
/// This broker's incarnation: read from `DATA_DIR/cluster/incarnation`, or chosen at random and
/// written there (synced) on the data directory's first use. Without a data directory: none.
pub(crate) fn incarnation(data_dir: Option<&std::path::Path>) -> std::io::Result<String> {
    let Some(dir) = data_dir else { return Ok(String::new()) };
    let path = dir.join("cluster").join("incarnation");
    match std::fs::read_to_string(&path) {
        Ok(s) if !s.trim().is_empty() && s.trim().len() <= 64 => return Ok(s.trim().to_owned()),
        Ok(_) => {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: not an incarnation id (move it away only if the data directory is new)", path.display()),
            ));
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let id = format!("{:016x}", felix_driver_common::random_seed());
    write_raft_log(&path, format!("{id}\n").as_bytes())?;
    Ok(id)
}

pub(crate) fn raft_log_path(data_dir: &std::path::Path) -> std::path::PathBuf {
    data_dir.join("cluster").join("raft.log")
}

/// Writes the kept Raft log: to a temporary file, synced, renamed over the old one, directory
/// synced, so the file is always one whole version.
pub(crate) fn write_raft_log(path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path.parent().unwrap_or(std::path::Path::new("."));
    std::fs::create_dir_all(dir)?;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)?;
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// The metadata group's kept Raft log, an append-only file of records (the replica logs'
/// format, [`encode_log_record`]): each run of persists is appended and synced, and the file
/// is rewritten whole (to a temporary file, synced, renamed) only once it grew to several times
/// what the log holds. Before, every persist rewrote the whole log: with thousands of shards
/// (a `Create` each, a `Lead` per election) that was megabytes per persist, on the broker's
/// task. A file in the older whole-log format is read and rewritten as records.
///
/// [`encode_log_record`]: felix_proto::cluster::meta::encode_log_record
pub(crate) struct MetaLog {
    path: std::path::PathBuf,
    file: Option<std::fs::File>,
    /// The file's length, and its length after the last whole rewrite.
    len: u64,
    base: u64,
    scratch: Vec<u8>,
    /// Whole rewrites since it was opened.
    rewrites: u64,
}

/// The file is rewritten whole once it is this many times its last rewrite (and past
/// [`META_LOG_REWRITE_MIN`]).
const META_LOG_REWRITE_FACTOR: u64 = 4;
const META_LOG_REWRITE_MIN: u64 = 1 << 20;

impl MetaLog {
    /// Opens the file at `path` (or starts none) and reads back the log it holds. A torn last
    /// record (a crash mid-append: never synced, never acted on) is cut.
    ///
    /// # Errors
    /// The read's error, or `InvalidData` for a file that is damaged (a checksum that fails, a
    /// break with whole records after it): it is not trusted, and the broker does not start.
    pub(crate) fn open(path: &std::path::Path) -> std::io::Result<(MetaLog, felix_proto::cluster::meta::RaftLog)> {
        use felix_proto::cluster::meta::RaftLog;
        let mut m = MetaLog { path: path.to_owned(), file: None, len: 0, base: 0, scratch: Vec::new(), rewrites: 0 };
        if !path.exists() {
            return Ok((m, RaftLog::default()));
        }
        let bad = |why: String| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: {why} (move it away to rejoin the cluster as a new member)", path.display()),
            )
        };
        let bytes = std::fs::read(path)?;
        if bytes.starts_with(b"FLXR") {
            // The older format: the whole log in one checksummed body. Rewritten as records.
            let log = RaftLog::decode(&bytes).map_err(|e| bad(e.to_string()))?;
            m.rewrite(&log)?;
            return Ok((m, log));
        }
        let (log, infos, damage) = felix_proto::cluster::meta::fold_log_segments_checked(&[&bytes]);
        if let Some(d) = damage {
            return Err(bad(format!("damaged at byte {}: {}", d.offset, d.kind)));
        }
        let whole = infos.first().map_or(0, |i| i.whole) as u64;
        let f = std::fs::OpenOptions::new().append(true).open(path)?;
        if whole < bytes.len() as u64 {
            tracing::warn!(
                "{}: {} bytes after the last whole record (a write cut short) were dropped",
                path.display(),
                bytes.len() as u64 - whole
            );
            f.set_len(whole)?;
        }
        f.sync_all()?;
        m.file = Some(f);
        m.len = whole;
        m.base = whole;
        Ok((m, log))
    }

    /// Appends the persists of one run (entries, hard state), synced before it returns;
    /// then rewrites the file whole if it grew to several times `log` (the log they leave).
    ///
    /// # Errors
    /// The write's or the sync's error.
    pub(crate) fn append(
        &mut self,
        parts: &[(Vec<felix_proto::cluster::meta::Entry>, Option<felix_proto::cluster::meta::HardState>)],
        log: &felix_proto::cluster::meta::RaftLog,
    ) -> std::io::Result<()> {
        use std::io::Write;
        if parts.is_empty() {
            return Ok(());
        }
        if self.file.is_none() {
            return self.rewrite(log);
        }
        let mut buf = std::mem::take(&mut self.scratch);
        buf.clear();
        for (entries, hs) in parts {
            if !entries.is_empty() || hs.is_some() {
                felix_proto::cluster::meta::encode_log_record_into(&mut buf, entries, hs.as_ref());
            }
        }
        let r = match self.file.as_mut() {
            Some(f) => f.write_all(&buf).and_then(|()| f.sync_data()),
            None => Ok(()),
        };
        self.len += buf.len() as u64;
        self.scratch = buf;
        r?;
        if self.len > META_LOG_REWRITE_MIN && self.len > self.base.saturating_mul(META_LOG_REWRITE_FACTOR) {
            self.rewrite(log)?;
        }
        Ok(())
    }

    /// Writes `log` whole as a new file (a snapshot record if it has one, then one record of
    /// its entries and hard state), synced and renamed over the old one. A metadata snapshot
    /// (D62) is written this way: the records before it are no longer needed.
    ///
    /// # Errors
    /// The write's, the sync's or the rename's error (the old file is then still whole).
    pub(crate) fn rewrite(&mut self, log: &felix_proto::cluster::meta::RaftLog) -> std::io::Result<()> {
        use felix_proto::cluster::meta::{HardState, encode_log_record, encode_snapshot_record};
        let mut bytes = Vec::new();
        if let Some(s) = &log.snapshot {
            bytes.extend_from_slice(&encode_snapshot_record(s));
        }
        // A record's hard state is one Raft wrote, never the zero one (the fold checks it).
        let hs = (log.hard_state != HardState::default()).then_some(&log.hard_state);
        if !log.entries.is_empty() || hs.is_some() {
            bytes.extend_from_slice(&encode_log_record(&log.entries, hs));
        }
        write_raft_log(&self.path, &bytes)?;
        self.file = Some(std::fs::OpenOptions::new().append(true).open(&self.path)?);
        self.len = bytes.len() as u64;
        self.base = self.len.max(1);
        self.rewrites += 1;
        Ok(())
    }
}

/// Where a broker keeps the Raft logs of its replicas of replicated shards: append-only
/// segment files per shard under `DATA_DIR/cluster/replicas/`. A shard's files *are* its
/// records (the stream's log): nothing else is written for a replicated shard. Appends go to
/// the page cache at once, on the broker task. By default (`sync_every` `None`) they reach the
/// disk before anything that depends on them is carried out: the broker task holds every
/// output after an append until [`take_unsynced`](Self::take_unsynced)'s files were synced off
/// the task (group commit: one `fdatasync` per written file for every append since the last
/// sync, whatever the number of shards). A vote, an append response or the leader's own count
/// toward a commit is never made of bytes a power cut can take back. With a lazy policy
/// (`sync_every` `Some`, chosen explicitly) they are synced on that interval instead. A segment
/// is closed at [`SEGMENT_BYTES`]; once a snapshot covers every entry of a closed segment
/// (retention dropped those records), the segment is deleted, so disk use follows retention.
pub(crate) struct ReplicaLogs {
    dir: Option<std::path::PathBuf>,
    shards: std::collections::BTreeMap<ShardId, ShardFiles>,
    dirty: std::collections::BTreeSet<ShardId>,
    sync_every: Option<std::time::Duration>,
    last_sync: std::time::Instant,
    /// Write failures (logged; the replica's peers carry on with a majority).
    pub(crate) failures: u64,
    /// [`SEGMENT_BYTES`] (tests make it small).
    segment_bytes: u64,
    /// The buffer records are encoded into.
    scratch: Vec<u8>,
}

/// What [`ReplicaLogs::open`] read back.
pub(crate) struct OpenedReplicaLogs {
    /// The logs, to append to.
    pub(crate) logs: ReplicaLogs,
    /// Every intact replica's log.
    pub(crate) kept: std::collections::BTreeMap<ShardId, felix_proto::cluster::meta::RaftLog>,
    /// Replicas whose log was found damaged (and set aside), and why.
    pub(crate) damaged: std::collections::BTreeMap<ShardId, String>,
    /// Closed segments folded from their summaries rather than their records (the tests'
    /// view; the broker logs it with the summary line).
    #[cfg_attr(not(test), allow(dead_code))]
    pub(crate) summarised: usize,
}

/// Moves a damaged replica log's segments to `replicas/damaged/` (each name gets the time it
/// was set aside, so a second damage of the same shard never overwrites the first), synced so
/// the move survives a power cut; returns the directory.
fn quarantine(dir: &std::path::Path, shard: &ShardId, seqs: &[u64]) -> std::io::Result<std::path::PathBuf> {
    let aside = dir.join("damaged");
    std::fs::create_dir_all(&aside)?;
    let stamp = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    for seq in seqs {
        let name = replica_file_name(shard, *seq);
        let mut to = aside.join(format!("{name}.{stamp}"));
        let mut n = 1;
        while to.exists() {
            to = aside.join(format!("{name}.{stamp}-{n}"));
            n += 1;
        }
        std::fs::rename(dir.join(&name), &to)?;
        let _ = std::fs::remove_file(dir.join(summary_file_name(shard, *seq)));
    }
    std::fs::File::open(&aside)?.sync_all()?;
    std::fs::File::open(dir)?.sync_all()?;
    Ok(aside)
}

/// Bytes after which a replica's segment is closed and a new one started.
pub(crate) const SEGMENT_BYTES: u64 = 64 << 20;

/// One shard's segments.
#[derive(Default)]
struct ShardFiles {
    /// (sequence, highest entry index in it), oldest first; the last is appended to.
    segments: Vec<(u64, u64)>,
    /// The last segment, open for appending (shared with the sync thread).
    file: Option<Arc<std::fs::File>>,
    /// Its length.
    len: u64,
    /// The last hard state written (repeated at the head of every new segment, so deleting
    /// old segments never loses it).
    hard_state: Option<felix_proto::cluster::meta::HardState>,
    /// Where its records start (sparse): how entries that left the replica's memory are read
    /// back ([`ReplicaLogs::read_job`]).
    points: felix_proto::cluster::log_read::LogPoints,
    /// The summary of the last segment so far, written beside it when it is closed (`None`
    /// once an append failed: what the file holds is then unknown).
    summary: Option<felix_proto::cluster::segment_summary::SummaryBuilder>,
    /// Where the last snapshot record is: (segment, position, length). A replica keeps its
    /// snapshot's data here only ([`ReplicaLogs::snapshot_job`]).
    snapshot: Option<(u64, u64, u64)>,
}

/// A read of a replica's last snapshot record, run off the broker's task
/// ([`ReplicaSnapshotRead::run`]).
pub(crate) struct ReplicaSnapshotRead {
    path: std::path::PathBuf,
    pos: u64,
    len: u64,
    index: u64,
    offset: u64,
    max: u64,
    verify: bool,
}

impl ReplicaSnapshotRead {
    /// Reads the piece from the record where it lies, the rest of the record unread (its CRC
    /// streamed through a bounded buffer first when `verify`).
    pub(crate) fn run(self) -> Result<felix_proto::cluster::meta::SnapshotPiece, String> {
        use std::os::unix::fs::FileExt;
        let at = |e: &dyn std::fmt::Display| format!("{}, record at byte {}: {e}", self.path.display(), self.pos);
        let f = std::fs::File::open(&self.path).map_err(|e| at(&e))?;
        let pos = self.pos;
        let mut read_at = |rel: u64, buf: &mut [u8]| f.read_exact_at(buf, pos + rel);
        felix_proto::cluster::meta::read_snapshot_record_piece(
            &mut read_at,
            self.len,
            self.index,
            self.offset,
            self.max,
            self.verify,
        )
        .map_err(|e| at(&e))
    }
}

/// A read of entries of one replica's log, run off the broker's task
/// ([`ReplicaLogRead::run`]): from a point of its index, record by record, until it holds what
/// was asked for and nothing after can rewrite it.
pub(crate) struct ReplicaLogRead {
    dir: std::path::PathBuf,
    shard: ShardId,
    /// The segments from the one the read starts in, oldest first.
    segments: Vec<u64>,
    start: felix_proto::cluster::log_read::Point,
    /// The points after the start, up to the first past the range.
    after: Vec<felix_proto::cluster::log_read::Point>,
    low: u64,
    high: u64,
    max_bytes: u64,
}

impl ReplicaLogRead {
    /// Reads the entries. A segment deleted meanwhile (a compaction) ends the read with what
    /// was found; other errors are returned.
    pub(crate) fn run(self) -> Result<Vec<felix_proto::cluster::meta::Entry>, String> {
        use felix_proto::cluster::log_read::EntryCollector;
        use std::io::{BufRead, Read, Seek, SeekFrom};
        let mut c = EntryCollector::new(self.low, self.high, self.max_bytes);
        let mut next = self.after.iter().peekable();
        let mut record = Vec::new();
        let last_segment = self.segments.last().copied();
        let last_segment = last_segment.as_ref();
        'segments: for seq in self.segments {
            let path = self.dir.join(replica_file_name(&self.shard, seq));
            let file = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => break,
                Err(e) => return Err(format!("{}: {e}", path.display())),
            };
            let mut r = std::io::BufReader::with_capacity(256 << 10, file);
            let mut at = if seq == self.start.segment { self.start.pos } else { 0 };
            r.seek(SeekFrom::Start(at)).map_err(|e| format!("{}: {e}", path.display()))?;
            loop {
                while next.peek().is_some_and(|p| (p.segment, p.pos) < (seq, at)) {
                    next.next();
                }
                if next.peek().is_some_and(|p| (p.segment, p.pos) == (seq, at)) && c.done(next.peek().copied()) {
                    break 'segments;
                }
                let mut len = [0u8; 4];
                if r.read_exact(&mut len).is_err() {
                    break; // the end of this segment (a torn tail is never read: it is past what was asked)
                }
                let n = u32::from_be_bytes(len) as usize;
                // A snapshot record (flag 2) holds no entries: stepped over unread. Read, a
                // stream's commit state or a cache's values came into memory twice (the record,
                // then its decoding) for every read of entries that passed it: a follower
                // catching up after a compaction.
                if n > 0 && r.fill_buf().map_err(|e| format!("{}: {e}", path.display()))?.first() == Some(&2) {
                    if r.seek_relative(n as i64).is_err() {
                        break;
                    }
                    at += 4 + n as u64;
                    continue;
                }
                record.clear();
                record.extend_from_slice(&len);
                record.resize(4 + n, 0);
                if r.read_exact(&mut record[4..]).is_err() {
                    break;
                }
                match felix_proto::cluster::meta::read_log_record(&record, 0) {
                    Some((_, Some(part))) => c.feed(part),
                    Some((_, None)) if record.get(4) == Some(&2) => {} // a snapshot
                    // In the segment being appended to, the record being written (a read runs
                    // beside the appends): the end of what there is to read.
                    _ if Some(&seq) == last_segment => break,
                    // A whole record of a closed segment that fails its checksum: the restart
                    // that folded this segment from its summary did not read it (see
                    // `ReplicaLogs::open`).
                    _ => {
                        let _ = std::fs::remove_file(self.dir.join(summary_file_name(&self.shard, seq)));
                        return Err(format!(
                            "{}, byte {at}: {DAMAGED_RECORD}: a record fails its checksum. The segment's summary \
                             was removed: the next start reads the segment whole, finds the damage, sets the log \
                             aside and has this replica rejoin its group afresh",
                            path.display()
                        ));
                    }
                }
                at += 4 + n as u64;
            }
        }
        Ok(c.finish())
    }
}

use felix_proto::cluster::metadata::{Kind, ShardId};

/// What a read error says when a record read back is damaged (see [`ReplicaLogRead::run`]).
pub(crate) const DAMAGED_RECORD: &str = "damaged replica log";

/// A closed segment's summary file name (`….log` → `….sum`).
fn summary_file_name(s: &ShardId, seq: u64) -> String {
    let name = replica_file_name(s, seq);
    format!("{}.sum", name.strip_suffix(".log").unwrap_or(&name))
}

/// The summary beside a closed segment of `len` bytes, if there is one that is whole and
/// stands for exactly those bytes (anything else: `None`, and the segment is folded from its
/// records).
fn read_summary(
    dir: &std::path::Path,
    shard: &ShardId,
    seq: u64,
    len: u64,
) -> Option<felix_proto::cluster::segment_summary::SegmentSummary> {
    let bytes = std::fs::read(dir.join(summary_file_name(shard, seq))).ok()?;
    match felix_proto::cluster::segment_summary::SegmentSummary::decode(&bytes) {
        Ok(s) if s.len == len => Some(s),
        Ok(_) => None,
        Err(e) => {
            tracing::warn!("{}: {e}; its segment is read whole", summary_file_name(shard, seq));
            None
        }
    }
}

/// Writes a closed segment's summary beside it (through a temporary file and a rename, so a
/// crash leaves the old one, none or the new one; not synced: one lost or cut short by a power
/// cut fails its length or checksum check and the segment is read whole).
fn write_summary(dir: &std::path::Path, shard: &ShardId, seq: u64, bytes: &[u8]) -> std::io::Result<()> {
    let name = summary_file_name(shard, seq);
    let tmp = dir.join(format!("{name}.tmp"));
    std::fs::write(&tmp, bytes)?;
    std::fs::rename(&tmp, dir.join(name))
}

/// The commit index the last hard state of a segment file says (0: none), reading record
/// headers and the last record that carries a hard state.
fn last_commit_of(path: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let (mut at, mut with_state) = (0u64, Vec::new());
    let mut head = [0u8; 5];
    while at + 5 <= len {
        f.read_exact_at(&mut head, at)?;
        let n = u64::from(u32::from_be_bytes([head[0], head[1], head[2], head[3]]));
        if n == 0 || at + 4 + n > len {
            break;
        }
        if head[4] == 1 {
            with_state.push((at, n));
        }
        at += 4 + n;
    }
    // From the last: a record that fails its checksum says nothing (the fold judges it).
    for (at, n) in with_state.into_iter().rev() {
        let mut record = vec![0; 4 + n as usize];
        f.read_exact_at(&mut record, at)?;
        let commit = felix_proto::cluster::meta::LogFold::last_commit(&record);
        if commit > 0 {
            return Ok(commit);
        }
    }
    Ok(0)
}

/// [`LogFold::snapshot_floor`] of a segment file, reading only each record's length and flag
/// (and the snapshot records whole): a restart's first pass, without reading the entries
/// (the fold reads them once, next).
///
/// [`LogFold::snapshot_floor`]: felix_proto::cluster::meta::LogFold::snapshot_floor
fn snapshot_floor_of(path: &std::path::Path) -> std::io::Result<u64> {
    use std::os::unix::fs::FileExt;
    let f = std::fs::File::open(path)?;
    let len = f.metadata()?.len();
    let (mut at, mut floor) = (0u64, 0u64);
    let mut head = [0u8; 5];
    while at + 5 <= len {
        f.read_exact_at(&mut head, at)?;
        let n = u64::from(u32::from_be_bytes([head[0], head[1], head[2], head[3]]));
        if n == 0 || at + 4 + n > len {
            break; // a torn or damaged tail: the fold judges it
        }
        if head[4] == 2 {
            let mut record = vec![0; 4 + n as usize];
            f.read_exact_at(&mut record, at)?;
            floor = floor.max(felix_proto::cluster::meta::LogFold::snapshot_floor(&record));
        }
        at += 4 + n;
    }
    Ok(floor)
}

/// A shard's segment file name: sequence 0 is `KIND~tenant~ns~name~shard.log` (the name a
/// replica's single file had before segments), later ones add `~SEQUENCE`.
fn replica_file_name(s: &ShardId, seq: u64) -> String {
    use felix_proto::storage::path_component as pc;
    let kind = if s.kind == Kind::Cache { "cache" } else { "stream" };
    let base = format!("{kind}~{}~{}~{}~{}", pc(&s.tenant), pc(&s.namespace), pc(&s.name), s.shard);
    if seq == 0 { format!("{base}.log") } else { format!("{base}~{seq:020}.log") }
}

fn parse_replica_file_name(n: &str) -> Option<(ShardId, u64)> {
    use felix_proto::storage::parse_path_component as pc;
    let n = n.strip_suffix(".log")?;
    let parts: Vec<&str> = n.split('~').collect();
    let (kind, t, ns, name, shard, seq) = match parts.as_slice() {
        [kind, t, ns, name, shard] => (kind, t, ns, name, shard, 0),
        [kind, t, ns, name, shard, seq] if seq.len() == 20 => (kind, t, ns, name, shard, seq.parse().ok()?),
        _ => return None,
    };
    let kind = match *kind {
        "stream" => Kind::Stream,
        "cache" => Kind::Cache,
        _ => return None,
    };
    Some((ShardId { kind, tenant: pc(t)?, namespace: pc(ns)?, name: pc(name)?, shard: shard.parse().ok()? }, seq))
}

impl ReplicaLogs {
    /// Opens the directory (nothing is kept without a data directory) and reads back every
    /// replica's log. A segment torn by a crash mid-append is cut back to its last whole
    /// record; a file whose name is not a shard's is left alone and said. A log found damaged
    /// (a flipped bit, a closed segment cut short, a gap: [`LogDamage`]) is neither served
    /// nor voted from: its files are moved to `replicas/damaged/` (kept for an operator, never
    /// read again) and the shard is returned among the damaged, with why, for its replica to
    /// rejoin its group afresh ([`ClusterNode::set_damaged_replicas`]).
    ///
    /// [`LogDamage`]: felix_proto::cluster::meta::LogDamage
    /// [`ClusterNode::set_damaged_replicas`]: felix_proto::cluster::node::ClusterNode::set_damaged_replicas
    ///
    /// With `keep`, a log is read one segment at a time and its committed entries beyond
    /// `keep` bytes are left on disk ([`LogFold`]): the replica replays them in bounded reads
    /// ([`ReplicaLogs::read_job`]) as it starts, so a restart holds one segment, the
    /// uncommitted tail and `keep` bytes, whatever the retained log. `None`: every entry is
    /// held (tests).
    ///
    /// [`LogFold`]: felix_proto::cluster::meta::LogFold
    pub(crate) fn open(
        data_dir: Option<&std::path::Path>,
        sync_every: Option<std::time::Duration>,
        keep: Option<u64>,
    ) -> std::io::Result<OpenedReplicaLogs> {
        let dir = data_dir.map(|d| d.join("cluster").join("replicas"));
        let mut kept = std::collections::BTreeMap::new();
        let mut damaged = std::collections::BTreeMap::new();
        let mut shards = std::collections::BTreeMap::new();
        let (mut read_from_summaries, mut read_whole) = (0usize, 0usize);
        if let Some(dir) = &dir
            && dir.exists()
        {
            let mut found: std::collections::BTreeMap<ShardId, Vec<u64>> = Default::default();
            for e in std::fs::read_dir(dir)? {
                let e = e?;
                if e.file_type()?.is_dir() {
                    continue; // `damaged/`: logs set aside
                }
                let name = e.file_name().to_string_lossy().into_owned();
                if name.ends_with(".sum") {
                    continue; // a closed segment's summary, read with it
                }
                let Some((shard, seq)) = parse_replica_file_name(&name) else {
                    if !name.ends_with(".tmp") {
                        tracing::warn!("{}: not a replica's log, left alone", e.path().display());
                    }
                    continue;
                };
                found.entry(shard).or_default().push(seq);
            }
            for (shard, mut seqs) in found {
                seqs.sort_unstable();
                let path_of = |seq: u64| dir.join(replica_file_name(&shard, seq));
                // Which closed segments fold from their summary: with a budget, every one whose
                // summary stands for exactly the file (what stays in memory then comes from the
                // last segment, read whole: reading a 64 MiB segment to keep a few MiB of it
                // cost more than replaying them).
                let mut lens = Vec::with_capacity(seqs.len());
                for seq in &seqs {
                    lens.push(std::fs::metadata(path_of(*seq))?.len());
                }
                let mut summaries: Vec<Option<felix_proto::cluster::segment_summary::SegmentSummary>> =
                    vec![None; seqs.len()];
                if keep.is_some() {
                    for i in 0..seqs.len().saturating_sub(1) {
                        summaries[i] = read_summary(dir, &shard, seqs[i], lens[i]);
                    }
                }
                let commit = match (summaries.iter().any(Option::is_some), seqs.last()) {
                    (true, Some(last)) => last_commit_of(&path_of(*last))?,
                    _ => 0,
                };
                // The snapshot records a summary names, read from its segment.
                let snapshots_of = |seq: u64, sum: &felix_proto::cluster::segment_summary::SegmentSummary| {
                    use std::os::unix::fs::FileExt;
                    let f = std::fs::File::open(path_of(seq))?;
                    sum.snapshots()
                        .map(|(pos, len)| {
                            let mut b = vec![0; len as usize];
                            f.read_exact_at(&mut b, pos).map(|()| b)
                        })
                        .collect::<std::io::Result<Vec<Vec<u8>>>>()
                };
                // Two passes, one segment at a time: the last snapshot's index, then the fold.
                // Each segment is read into one buffer that the entries folded from it share:
                // a buffer is freed once its entries left memory (spilled, with `keep`).
                use felix_proto::cluster::meta::LogFold;
                let mut floor = 0;
                for (seq, sum) in seqs.iter().zip(&summaries) {
                    let f = match sum {
                        Some(sum) => {
                            snapshots_of(*seq, sum)?.iter().map(|r| LogFold::snapshot_floor(r)).max().unwrap_or(0)
                        }
                        None => snapshot_floor_of(&path_of(*seq))?,
                    };
                    floor = floor.max(f);
                }
                let mut fold = LogFold::new(floor, keep);
                let mut summarised = vec![false; seqs.len()];
                for (i, seq) in seqs.iter().enumerate() {
                    if let Some(sum) = &summaries[i] {
                        let records: Vec<bytes::Bytes> = snapshots_of(*seq, sum)?.into_iter().map(Into::into).collect();
                        if fold.feed_summary(sum, &records, commit) {
                            summarised[i] = true;
                            if fold.damage().is_some() {
                                break;
                            }
                            continue;
                        }
                    }
                    let data = bytes::Bytes::from(std::fs::read(path_of(*seq))?);
                    lens[i] = data.len() as u64;
                    if !fold.feed(&data, Some(&data), i + 1 == seqs.len()) {
                        break;
                    }
                }
                let builders = fold.take_builders();
                // The last snapshot record, where a follower behind is read it from.
                let last_snapshot = (0..seqs.len()).rev().find_map(|i| {
                    let at = match (&summaries[i], builders.get(i).and_then(Option::as_ref)) {
                        (_, Some(b)) => b.last_snapshot(),
                        (Some(sum), None) => sum.snapshots().last(),
                        (None, None) => None,
                    };
                    at.map(|(pos, len)| (seqs[i], pos, len))
                });
                let (mut log, infos, damage, mut points) = fold.finish();
                if keep.is_some() {
                    // The entries left in memory (at most `keep` bytes) share the buffer their
                    // segment was read into, up to 64 MiB of which the rest is entries now on
                    // disk only and the snapshot the host restores from (and then copies its
                    // values out of). Copied out, that buffer goes once the replica started,
                    // rather than living as long as the newest of them: on an idle shard, for
                    // ever. (Without a budget every entry stays: sharing is then the smaller.)
                    for e in &mut log.entries {
                        e.data = bytes::Bytes::copy_from_slice(&e.data);
                        e.context = bytes::Bytes::copy_from_slice(&e.context);
                    }
                }
                if let Some(d) = damage {
                    let path = dir.join(replica_file_name(&shard, seqs[d.segment.min(seqs.len() - 1)]));
                    let why = format!("{}, byte {}: {}", path.display(), d.offset, d.kind);
                    let aside = quarantine(dir, &shard, &seqs)?;
                    tracing::error!(
                        "replica log damaged: {why}. It is neither served nor voted from: moved to {}; the \
                         replica rejoins its group afresh and catches up from its peers",
                        aside.display()
                    );
                    damaged.insert(shard, why);
                    continue;
                }
                // A large host state in the kept snapshot stays on disk: the replica reads it
                // back from the last snapshot record a piece at a time as it starts, rather
                // than the record (read whole above, let go now) and the state built from it
                // being in memory together, for every replica until each started. Only when
                // that record reads as this snapshot's (it is the last one written).
                if keep.is_some()
                    && let (Some((seq, pos, len)), Some(s)) = (last_snapshot, log.snapshot.as_ref())
                {
                    let index = s.get_metadata().index;
                    let (path, max, verify) = (path_of(seq), 1, false);
                    let probe = ReplicaSnapshotRead { path, pos, len, index, offset: 0, max, verify };
                    if probe.run().is_ok_and(|p| p.total == s.get_data().len() as u64) {
                        use felix_proto::cluster::node::{ClusterNode, RESTORE_IN_PIECES_MIN};
                        ClusterNode::leave_kept_state_on_disk(&mut log, RESTORE_IN_PIECES_MIN);
                    }
                }
                points.map_segments(|i| seqs.get(i as usize).copied().unwrap_or(u64::MAX));
                let mut files = ShardFiles {
                    hard_state: Some(log.hard_state.clone()),
                    points,
                    snapshot: last_snapshot,
                    ..ShardFiles::default()
                };
                let n = seqs.len();
                for (i, (((seq, info), len), builder)) in seqs.iter().zip(&infos).zip(&lens).zip(builders).enumerate() {
                    let path = dir.join(replica_file_name(&shard, *seq));
                    let len = *len as usize;
                    if i + 1 == n {
                        // Appended to again: the builder goes on; a summary left from a crash
                        // just after it was closed no longer stands for it.
                        files.summary = builder;
                        let _ = std::fs::remove_file(dir.join(summary_file_name(&shard, *seq)));
                    } else if let Some(b) = builder.and_then(|b| b.encode()) {
                        // Read whole without a summary (an older broker's, or one lost): it
                        // gets one, so the next restart need not read it.
                        if summaries[i].is_none()
                            && !dir.join(summary_file_name(&shard, *seq)).exists()
                            && let Err(e) = write_summary(dir, &shard, *seq, &b)
                        {
                            tracing::warn!("writing the summary of {}: {e}", path.display());
                        }
                    }
                    if info.whole < len {
                        tracing::warn!(
                            "{}: {} bytes after the last whole record (a write cut short) were dropped",
                            path.display(),
                            len - info.whole
                        );
                        let f = std::fs::OpenOptions::new().write(true).open(&path)?;
                        f.set_len(info.whole as u64)?;
                        f.sync_all()?;
                    } else {
                        // What the broker wrote before it was killed but had not synced is still
                        // in the page cache: it reaches the disk now, before this replica says it
                        // holds any of it (else a power cut after the restart could take back
                        // an entry it acknowledged since).
                        std::fs::File::open(&path)?.sync_data()?;
                    }
                    felix_driver_common::sync_journal::synced(&path, info.whole as u64);
                    files.segments.push((*seq, info.max_index));
                    files.len = info.whole as u64;
                }
                read_from_summaries += summarised.iter().filter(|s| **s).count();
                read_whole += summarised.iter().filter(|s| !**s).count();
                shards.insert(shard.clone(), files);
                kept.insert(shard, log);
            }
            let spilled: u64 = kept.values().filter_map(|l| l.spill.as_ref()).map(|s| s.end() - s.first()).sum();
            let held: u64 = kept.values().map(|l| l.entries.len() as u64).sum();
            if !kept.is_empty() {
                tracing::info!(
                    "replica logs read back: {} shards, {held} entries held, {spilled} committed entries left on disk \
                     (replayed from the files as each replica starts: felix_replicas_replaying); {read_from_summaries} \
                     closed segments folded from their summaries, {read_whole} segments read whole",
                    kept.len()
                );
            }
        }
        let logs = ReplicaLogs {
            dir,
            shards,
            dirty: Default::default(),
            sync_every,
            last_sync: std::time::Instant::now(),
            failures: 0,
            segment_bytes: SEGMENT_BYTES,
            scratch: Vec::new(),
        };
        Ok(OpenedReplicaLogs { logs, kept, damaged, summarised: read_from_summaries })
    }

    /// Appends a replica's persisted state. Synced at once when the policy says `always`.
    ///
    /// # Errors
    /// The write's error: the replica must stop (it cannot vouch for what it did not keep).
    pub(crate) fn persist(
        &mut self,
        shard: &ShardId,
        entries: &[felix_proto::cluster::meta::Entry],
        hard_state: Option<&felix_proto::cluster::meta::HardState>,
    ) -> std::io::Result<()> {
        if entries.is_empty() && hard_state.is_none() {
            return Ok(());
        }
        // Into the one reused buffer: no fresh allocation (faulted in and zeroed) per write.
        let mut record = std::mem::take(&mut self.scratch);
        record.clear();
        felix_proto::cluster::meta::encode_log_record_into(&mut record, entries, hard_state);
        let max = entries.last().map_or(0, |e| e.index);
        let r = self.append(shard, &[&record], max);
        let len = record.len() as u64;
        self.scratch = record;
        let (seq, pos) = r?;
        if let Some(f) = self.shards.get_mut(shard) {
            if let Some(b) = &mut f.summary {
                b.record(pos, len, entries, hard_state);
            }
            if let Some(hs) = hard_state {
                f.hard_state = Some(hs.clone());
            }
            match (entries.first(), entries.last()) {
                (Some(a), Some(b)) => {
                    f.points.record(seq, pos, len, a.index, b.index);
                }
                _ => f.points.skip(len),
            }
        }
        Ok(())
    }

    /// A read of entries `low..high` of the shard's log (about `max_bytes`), to run off the
    /// task; `None` when nothing is kept for it (no data directory, an unknown shard).
    pub(crate) fn read_job(&self, shard: &ShardId, low: u64, high: u64, max_bytes: u64) -> Option<ReplicaLogRead> {
        let dir = self.dir.clone()?;
        let f = self.shards.get(shard)?;
        let (start, after) = f.points.plan(low, high)?;
        let segments = f.segments.iter().map(|(s, _)| *s).filter(|s| *s >= start.segment).collect();
        Some(ReplicaLogRead { dir, shard: shard.clone(), segments, start, after, low, high, max_bytes })
    }

    /// A read of bytes `offset..offset + max` of the data of the shard's last snapshot record
    /// (which must be the snapshot at `index`), to run off the task; `None` when none is kept
    /// (no data directory, an unknown shard, no snapshot).
    pub(crate) fn snapshot_piece_job(
        &self,
        shard: &ShardId,
        index: u64,
        offset: u64,
        max: u64,
        verify: bool,
    ) -> Option<ReplicaSnapshotRead> {
        let dir = self.dir.as_ref()?;
        let (seq, pos, len) = self.shards.get(shard)?.snapshot?;
        let path = dir.join(replica_file_name(shard, seq));
        Some(ReplicaSnapshotRead { path, pos, len, index, offset, max, verify })
    }

    /// Appends a snapshot of a replica's log, then deletes the closed segments it made useless
    /// (every entry in them below its index: the one holding the entry at its index stays, see below).
    ///
    /// # Errors
    /// As [`persist`](Self::persist).
    pub(crate) fn persist_snapshot(
        &mut self,
        shard: &ShardId,
        snapshot: &felix_proto::cluster::meta::Snapshot,
        rest: Option<&felix_proto::cluster::replica::SnapshotRest>,
    ) -> std::io::Result<()> {
        // In pieces: the snapshot's data (a cache's size) is written from where it is, and
        // a host's part still unencoded (a stream's commit state) is encoded as it is written.
        let record_len = felix_proto::cluster::meta::snapshot_record_len(snapshot, rest.map_or(0, |r| r.len()));
        let (seq, pos) = self.append_with(shard, record_len, 0, &mut |sink| {
            let rest_len = rest.map_or(0, |r| r.len());
            let pieces = |each: &mut dyn FnMut(&[u8])| {
                if let Some(r) = rest {
                    r.pieces(each)
                }
            };
            // A commit state comes in pieces of a few bytes (each value's header) between its
            // values: gathered into writes of up to 1 MiB, a large piece written from where it is.
            let mut buf: Vec<u8> = Vec::new();
            let mut gathered = |piece: &[u8]| -> std::io::Result<()> {
                let large = piece.len() >= SNAPSHOT_WRITE_BYTES / 4;
                if !buf.is_empty() && (large || buf.len() + piece.len() > SNAPSHOT_WRITE_BYTES) {
                    sink(&buf)?;
                    buf.clear();
                }
                if large {
                    return sink(piece);
                }
                buf.extend_from_slice(piece);
                Ok(())
            };
            felix_proto::cluster::meta::write_snapshot_record(snapshot, rest_len, &pieces, &mut gathered)?;
            if buf.is_empty() { Ok(()) } else { sink(&buf) }
        })?;
        let index = snapshot.get_metadata().index;
        let (Some(dir), Some(f)) = (&self.dir, self.shards.get_mut(shard)) else { return Ok(()) };
        f.snapshot = Some((seq, pos, record_len));
        f.points.skip(record_len);
        if let Some(b) = &mut f.summary {
            b.snapshot(pos, record_len);
        }
        let current = f.segments.last().map(|(s, _)| *s);
        let mut deleted = Vec::new();
        f.segments.retain(|(seq, max)| {
            // Strictly below: the segment holding the entry at the snapshot's index stays, so a
            // restart's fold finds that entry and keeps the entries after it (a snapshot whose
            // entry is missing reads as one that replaced a log that did not match).
            let useless = Some(*seq) != current && *max < index;
            if useless {
                deleted.push(*seq);
            }
            !useless
        });
        let kept: Vec<u64> = f.segments.iter().map(|(s, _)| *s).collect();
        f.points.retain_segments(|s| kept.contains(&s));
        for seq in deleted {
            if let Err(e) = std::fs::remove_file(dir.join(replica_file_name(shard, seq))) {
                tracing::warn!("removing a compacted segment of {shard:?}'s replica log: {e}");
            }
            let _ = std::fs::remove_file(dir.join(summary_file_name(shard, seq)));
        }
        Ok(())
    }

    /// Appends one record, given in pieces written one after the other, to the shard's last
    /// segment (a new one past [`SEGMENT_BYTES`]); returns the segment and the position it was
    /// written at.
    fn append(&mut self, shard: &ShardId, pieces: &[&[u8]], max_index: u64) -> std::io::Result<(u64, u64)> {
        let len = pieces.iter().map(|p| p.len() as u64).sum();
        self.append_with(shard, len, max_index, &mut |sink| {
            for piece in pieces {
                sink(piece)?;
            }
            Ok(())
        })
    }

    /// [`append`](Self::append) of a record of `len` bytes that `write` hands to the sink it
    /// is given, piece by piece (written as they come); a record that comes out of another
    /// length is an error (and torn: cut at the next start).
    fn append_with(
        &mut self,
        shard: &ShardId,
        len: u64,
        max_index: u64,
        write: &mut RecordWriter<'_>,
    ) -> std::io::Result<(u64, u64)> {
        use std::io::Write;
        let Some(dir) = self.dir.clone() else { return Ok((0, 0)) };
        let segment_bytes = self.segment_bytes;
        let f = self.shards.entry(shard.clone()).or_default();
        let r = (|| -> std::io::Result<(u64, u64)> {
            if f.file.is_some() && f.len >= segment_bytes {
                // Closed: made durable now (it is not appended to again), and the next one
                // starts with the hard state.
                if let Some(file) = f.file.take() {
                    let seq = f.segments.last().map_or(0, |(s, _)| *s);
                    let path = dir.join(replica_file_name(shard, seq));
                    UnsyncedFile { shard: shard.clone(), path, len: f.len, file }.sync()?;
                    // Its summary, for a restart to read instead of its records.
                    if let Some(b) = f.summary.take().and_then(|b| b.encode())
                        && let Err(e) = write_summary(&dir, shard, seq, &b)
                    {
                        tracing::warn!("writing the summary of {shard:?}'s replica log segment {seq}: {e}");
                    }
                }
                let seq = f.segments.last().map_or(0, |(s, _)| s + 1);
                f.segments.push((seq, 0));
                f.len = 0;
                let file = open_segment(&dir, shard, seq)?;
                let mut summary = felix_proto::cluster::segment_summary::SummaryBuilder::new();
                if let Some(hs) = &f.hard_state {
                    let head = felix_proto::cluster::meta::encode_log_record(&[], Some(hs));
                    (&*file).write_all(&head)?;
                    summary.record(0, head.len() as u64, &[], Some(hs));
                    f.len += head.len() as u64;
                }
                f.summary = Some(summary);
                f.file = Some(file);
            }
            if f.file.is_none() {
                if f.segments.is_empty() {
                    f.segments.push((0, 0));
                    f.summary = Some(felix_proto::cluster::segment_summary::SummaryBuilder::new());
                }
                let seq = f.segments.last().map_or(0, |(s, _)| *s);
                f.file = Some(open_segment(&dir, shard, seq)?);
            }
            let file = f.file.as_ref().expect("opened above");
            let declared = usize::try_from(len)
                .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "a record past the address space"))?;
            felix_driver_common::sync_journal::before_append(declared)?;
            let mut written = 0u64;
            write(&mut |piece: &[u8]| {
                written += piece.len() as u64;
                (&**file).write_all(piece)
            })?;
            if written != len {
                let why = format!("a record declared {len} bytes and wrote {written}");
                return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, why));
            }
            let at = (f.segments.last().map_or(0, |(s, _)| *s), f.len);
            f.len += len;
            if let Some(last) = f.segments.last_mut() {
                last.1 = last.1.max(max_index);
            }
            Ok(at)
        })();
        match &r {
            Ok(_) => {
                self.dirty.insert(shard.clone());
            }
            Err(e) => {
                self.failures += 1;
                // What was appended of it may be torn: the file is cut back at the next start.
                f.file = None;
                f.summary = None;
                tracing::error!("writing {shard:?}'s replica log: {e}; the replica stops until the broker restarts");
            }
        }
        r
    }

    /// Whether appends are synced before what depends on them is carried out (the default)
    /// rather than on an interval.
    pub(crate) fn syncs_before_answering(&self) -> bool {
        self.dir.is_some() && self.sync_every.is_none()
    }

    /// The files appended to since the last call, each with its path and its length now, to be
    /// synced (off the broker task) before anything output after those appends is carried out.
    pub(crate) fn take_unsynced(&mut self) -> Vec<UnsyncedFile> {
        let Some(dir) = &self.dir else {
            self.dirty.clear();
            return Vec::new();
        };
        let mut out = Vec::with_capacity(self.dirty.len());
        for s in std::mem::take(&mut self.dirty) {
            if let Some(f) = self.shards.get(&s)
                && let (Some(file), Some((seq, _))) = (&f.file, f.segments.last())
            {
                out.push(UnsyncedFile {
                    shard: s.clone(),
                    path: dir.join(replica_file_name(&s, *seq)),
                    len: f.len,
                    file: file.clone(),
                });
            }
        }
        out
    }

    /// Syncs what was appended since the last sync, when the interval has passed (a lazy
    /// policy only).
    pub(crate) fn sync_due(&mut self, now: std::time::Instant) {
        let Some(every) = self.sync_every else { return };
        if self.dirty.is_empty() || now.saturating_duration_since(self.last_sync) < every {
            return;
        }
        self.last_sync = now;
        for f in self.take_unsynced() {
            if let Err(e) = f.sync() {
                self.failures += 1;
                tracing::error!("syncing {:?}'s replica log: {e}", f.shard);
            }
        }
    }

    /// The shard is gone (its stream deleted): its log is removed.
    pub(crate) fn drop_shard(&mut self, shard: &ShardId) {
        self.dirty.remove(shard);
        if let (Some(dir), Some(f)) = (&self.dir, self.shards.remove(shard)) {
            for (seq, _) in f.segments {
                let _ = std::fs::remove_file(dir.join(replica_file_name(shard, seq)));
                let _ = std::fs::remove_file(dir.join(summary_file_name(shard, seq)));
            }
        }
    }

    /// Segment files kept per shard (diagnostics and tests).
    #[cfg(test)]
    fn segments(&self, shard: &ShardId) -> Vec<u64> {
        self.shards.get(shard).map(|f| f.segments.iter().map(|(s, _)| *s).collect()).unwrap_or_default()
    }
}

fn open_segment(dir: &std::path::Path, shard: &ShardId, seq: u64) -> std::io::Result<Arc<std::fs::File>> {
    std::fs::create_dir_all(dir)?;
    let path = dir.join(replica_file_name(shard, seq));
    let f = std::fs::OpenOptions::new().create(true).append(true).open(&path)?;
    if felix_driver_common::sync_journal::len_of(&f) == 0 {
        felix_driver_common::sync_journal::created(&path);
    }
    Ok(Arc::new(f))
}

/// A replica log file with appends not yet on disk: what the sync thread syncs.
pub(crate) struct UnsyncedFile {
    pub(crate) shard: ShardId,
    path: std::path::PathBuf,
    len: u64,
    file: Arc<std::fs::File>,
}

impl UnsyncedFile {
    /// `fdatasync`s the file (said in the sync journal once done).
    ///
    /// # Errors
    /// The sync's: the kernel may have dropped the pages, so nothing appended to the file
    /// since its last good sync may be vouched for.
    pub(crate) fn sync(&self) -> std::io::Result<()> {
        felix_driver_common::sync_journal::before_sync()?;
        self.file.sync_data()?;
        felix_driver_common::sync_journal::synced(&self.path, self.len);
        Ok(())
    }
}

/// From this many files a sync pass makes them durable with one `syncfs` per filesystem
/// rather than one `fdatasync` each.
pub(crate) const SYNCFS_FROM: usize = 4;

/// Makes the appends of every file in `files` durable (each said in the sync journal once
/// done); the error names what failed.
///
/// Why `syncfs`: a broker holds one log per replicated shard, and a sync pass covers every log
/// appended to since the last (thousands when thousands of groups elect at once: a cluster
/// created with 10,000 shards made 2,400 `fdatasync`s a second on each broker and fell behind,
/// and what waited on them, its Raft messages included, with it). One `syncfs` writes back and
/// waits for everything dirty on the filesystem, with one journal commit; since Linux 5.8 it
/// reports a writeback error of any file on it, so a failure still stops the broker. Files are
/// grouped by the filesystem they live on (a data directory may span mounts). Elsewhere than
/// Linux, and for a few files, each is synced on its own.
pub(crate) fn sync_many(files: &[UnsyncedFile]) -> Result<(), String> {
    #[cfg(target_os = "linux")]
    if files.len() >= SYNCFS_FROM {
        use std::os::unix::fs::MetadataExt;
        let mut by_fs: BTreeMap<u64, Vec<&UnsyncedFile>> = BTreeMap::new();
        for f in files {
            let dev = f.file.metadata().map_err(|e| format!("{:?}: {e}", f.shard))?.dev();
            by_fs.entry(dev).or_default().push(f);
        }
        for list in by_fs.values() {
            let Some(first) = list.first() else { continue };
            felix_driver_common::sync_journal::before_sync().map_err(|e| format!("{:?}: {e}", first.shard))?;
            rustix::fs::syncfs(&*first.file)
                .map_err(|e| format!("syncfs of {} replica logs (with {:?}): {e}", list.len(), first.shard))?;
            for f in list {
                felix_driver_common::sync_journal::synced(&f.path, f.len);
            }
        }
        return Ok(());
    }
    for f in files {
        f.sync().map_err(|e| format!("{:?}: {e}", f.shard))?;
    }
    Ok(())
}

#[cfg(test)]
mod meta_log_tests {
    use super::*;
    use felix_proto::cluster::meta::{Entry, HardState, RaftLog};

    fn entry(index: u64, term: u64) -> Entry {
        Entry { index, term, data: format!("command {index}").into_bytes().into(), ..Entry::default() }
    }

    /// Persists are appended (not the whole log each time) and read back as the log they
    /// leave, an overwritten tail included; the file is rewritten whole only once it grew to
    /// several times the log; a torn last record is cut; a file of the older whole-log format
    /// is read and rewritten as records; a damaged one refuses to open.
    #[test]
    fn the_metadata_log_is_appended_read_back_rewritten_when_large_and_refused_when_damaged() {
        let dir = std::env::temp_dir().join(format!("felix-meta-log-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("raft.log");
        let (mut m, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, RaftLog::default());
        let mut want = RaftLog::default();
        let mut max = 0;
        for i in 1..=3000u64 {
            // A new leader overwrites the uncommitted tail now and then.
            let (from, term) = if i % 500 == 0 { (i - 3, 1 + i / 500) } else { (i, 1 + i / 500) };
            let entries: Vec<Entry> = (from..=i).map(|k| entry(k, term)).collect();
            let hs = HardState { term, commit: i.saturating_sub(2), ..HardState::default() };
            want.persist(&entries, Some(&hs));
            // Most persists change only the hard state (a commit): the file grows, the log not.
            let commits: Vec<_> = (0..20).map(|_| (Vec::new(), Some(hs.clone()))).collect();
            m.append(&[(entries, Some(hs.clone()))], &want).unwrap();
            m.append(&commits, &want).unwrap();
            max = max.max(std::fs::metadata(&path).unwrap().len());
        }
        let whole = (want.encode().len() + 64) as u64;
        assert!((2..20).contains(&m.rewrites), "{} whole rewrites in 6000 appends", m.rewrites);
        assert!(
            max <= (META_LOG_REWRITE_FACTOR * whole).max(META_LOG_REWRITE_MIN) + (64 << 10),
            "the file reached {max} bytes for a log of {whole}"
        );
        drop(m);
        let (mut m, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want, "read back");
        // A torn last record is cut, and what came before stands.
        let e = entry(3001, 7);
        let hs = HardState { term: 7, commit: 2999, ..HardState::default() };
        m.append(&[(vec![e.clone()], Some(hs.clone()))], &want).unwrap();
        drop(m);
        let len = std::fs::metadata(&path).unwrap().len();
        std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(len - 3).unwrap();
        let (_, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want, "the torn record was cut");
        assert!(std::fs::metadata(&path).unwrap().len() < len - 3);
        // The older format: read, and rewritten as records.
        write_raft_log(&path, &want.encode()).unwrap();
        let (mut m, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want);
        assert!(!std::fs::read(&path).unwrap().starts_with(b"FLXR"), "rewritten as records");
        want.persist(std::slice::from_ref(&e), Some(&hs));
        m.append(&[(vec![e], Some(hs))], &want).unwrap();
        drop(m);
        assert_eq!(MetaLog::open(&path).unwrap().1, want);
        // A flipped bit in the middle: refused, with the file named.
        let mut bytes = std::fs::read(&path).unwrap();
        let mid = bytes.len() / 2;
        bytes[mid] ^= 0x40;
        std::fs::write(&path, &bytes).unwrap();
        let err = MetaLog::open(&path).err().expect("refused");
        assert_eq!(err.kind(), std::io::ErrorKind::InvalidData);
        assert!(err.to_string().contains("raft.log"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A metadata snapshot (D62) rewrites the file as the snapshot and the entries after it:
    /// the records before it are gone from the disk, appends go on after it, and it all
    /// reads back as the log the broker holds.
    #[test]
    fn a_metadata_snapshot_replaces_the_records_before_it_in_the_file() {
        use felix_proto::cluster::meta::Snapshot;
        let dir = std::env::temp_dir().join(format!("felix-meta-snap-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("raft.log");
        let (mut m, _) = MetaLog::open(&path).unwrap();
        let mut want = RaftLog::default();
        for i in 1..=2000u64 {
            let hs = HardState { term: 1, commit: i, ..HardState::default() };
            want.persist(&[entry(i, 1)], Some(&hs));
            m.append(&[(vec![entry(i, 1)], Some(hs))], &want).unwrap();
        }
        let before = std::fs::metadata(&path).unwrap().len();
        let mut snap = Snapshot::default();
        snap.set_data(b"the metadata at 1990".to_vec().into());
        snap.mut_metadata().index = 1990;
        snap.mut_metadata().term = 1;
        want.persist_snapshot(&snap);
        m.rewrite(&want).unwrap();
        let after = std::fs::metadata(&path).unwrap().len();
        assert!(after * 20 < before, "{after} bytes after the snapshot, {before} before");
        for i in 2001..=2010u64 {
            let hs = HardState { term: 1, commit: i, ..HardState::default() };
            want.persist(&[entry(i, 1)], Some(&hs));
            m.append(&[(vec![entry(i, 1)], Some(hs))], &want).unwrap();
        }
        drop(m);
        let (_, kept) = MetaLog::open(&path).unwrap();
        assert_eq!(kept, want);
        assert_eq!(kept.snapshot.as_ref().map(|s| s.get_metadata().index), Some(1990));
        assert_eq!(kept.entries.first().map(|e| e.index), Some(1991));
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[cfg(test)]
mod replica_log_tests {
    use super::*;
    use felix_proto::cluster::meta::Entry;

    /// A fresh data directory for one test (`tag` names it), the shard its logs are of, and
    /// the logs opened there (lazily synced) with segments closed at `segment_bytes`.
    fn ledger_logs(tag: &str, segment_bytes: u64) -> (std::path::PathBuf, ShardId, ReplicaLogs) {
        let dir = std::env::temp_dir().join(format!("felix-replica-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shard = ShardId::of(Kind::Stream, "t", "ns", "ledger", 0);
        let mut logs = ReplicaLogs::open(Some(&dir), Some(std::time::Duration::from_secs(1)), None).unwrap().logs;
        logs.segment_bytes = segment_bytes;
        (dir, shard, logs)
    }

    /// Entry `index` of `term`, 90 bytes of data.
    fn entry(index: u64, term: u64) -> Entry {
        Entry { index, term, data: vec![index as u8; 90].into(), ..Entry::default() }
    }

    /// Entries are read back from the files by index, across segments, with an overwritten
    /// tail giving its last write, after a snapshot deleted the oldest segments, and after a
    /// restart (whose index is rebuilt by the fold). The index holds a point per segment, not
    /// per record.
    #[test]
    fn a_replica_logs_entries_are_read_back_by_index_across_segments_and_restarts() {
        use felix_proto::cluster::meta::{HardState, Snapshot};
        let (dir, shard, mut logs) = ledger_logs("reads", 4000);
        for index in 1..=200u64 {
            let hs = HardState { term: 1, commit: index.saturating_sub(5), ..HardState::default() };
            logs.persist(&shard, &[entry(index, 1)], Some(&hs)).unwrap();
        }
        // A new leader (term 2) overwrote the uncommitted tail 196..=200.
        let tail: Vec<Entry> = (196..=203).map(|i| entry(i, 2)).collect();
        logs.persist(&shard, &tail, Some(&HardState { term: 2, commit: 203, ..HardState::default() })).unwrap();
        let read = |logs: &ReplicaLogs, low, high, max| -> Vec<(u64, u64)> {
            let job = logs.read_job(&shard, low, high, max).expect("kept");
            job.run().unwrap().iter().map(|e| (e.index, e.term)).collect()
        };
        let want = |low: u64, high: u64| -> Vec<(u64, u64)> {
            (low..high).map(|i| (i, if i >= 196 { 2 } else { 1 })).collect()
        };
        let segments = logs.segments(&shard).len();
        assert!(segments > 5, "rolled into {segments} segments");
        assert!(logs.shards[&shard].points.len() <= segments + 1, "{} points", logs.shards[&shard].points.len());
        for (low, high) in [(1, 4), (37, 120), (190, 204), (196, 199)] {
            assert_eq!(read(&logs, low, high, u64::MAX), want(low, high), "{low}..{high}");
        }
        assert_eq!(read(&logs, 10, 200, 400), want(10, 15), "about 400 bytes: five entries of 90");
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 100;
        snap.mut_metadata().term = 1;
        logs.persist_snapshot(&shard, &snap, None).unwrap();
        assert!(logs.segments(&shard).len() < segments, "a snapshot deleted segments");
        // The restart's first pass reads headers only, and finds what reading it all finds.
        let floors: Vec<u64> = logs
            .segments(&shard)
            .iter()
            .map(|seq| {
                let path = logs.dir.as_ref().expect("a directory").join(replica_file_name(&shard, *seq));
                let whole = felix_proto::cluster::meta::LogFold::snapshot_floor(&std::fs::read(&path).unwrap());
                assert_eq!(snapshot_floor_of(&path).unwrap(), whole, "{}", path.display());
                whole
            })
            .collect();
        assert!(floors.contains(&100), "{floors:?}");
        assert_eq!(read(&logs, 150, 160, u64::MAX), want(150, 160));
        drop(logs);
        let logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
        assert_eq!(read(&logs, 150, 160, u64::MAX), want(150, 160), "after a restart");
        assert_eq!(read(&logs, 190, 204, u64::MAX), want(190, 204), "after a restart");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A restart with a budget holds the newest committed entries within it and the
    /// uncommitted tail; the committed entries before them are left on disk (their terms and
    /// the configuration changes among them kept), readable by index as the replica replays
    /// them. What it holds and what it left add up to the whole fold's log.
    #[test]
    fn a_restart_with_a_budget_leaves_the_committed_front_of_the_log_on_disk() {
        use felix_proto::cluster::meta::HardState;
        let (dir, shard, mut logs) = ledger_logs("spill", 3000);
        for index in 1..=300u64 {
            let term = 1 + index / 100;
            let hs = HardState { term, commit: index.saturating_sub(20), ..HardState::default() };
            logs.persist(&shard, &[entry(index, term)], Some(&hs)).unwrap();
        }
        drop(logs);
        let whole = ReplicaLogs::open(Some(&dir), None, None).unwrap().kept.remove(&shard).expect("kept");
        assert!(whole.spill.is_none() && whole.entries.len() == 300);
        let OpenedReplicaLogs { logs, mut kept, damaged, .. } =
            ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
        assert!(damaged.is_empty());
        let part = kept.remove(&shard).expect("kept");
        let spill = part.spill.as_ref().expect("the committed front left on disk");
        assert_eq!(spill.first(), 1);
        assert_eq!(spill.end(), part.entries[0].index, "the log goes on in memory where the disk part ends");
        // 20 uncommitted entries stay whatever the budget, and about 2000 bytes of committed ones.
        let committed_held = part.entries.iter().filter(|e| e.index <= part.hard_state.commit).count();
        assert!(part.entries.len() >= 20 && committed_held <= 10, "{} held", part.entries.len());
        assert_eq!(part.hard_state, whole.hard_state);
        for e in &whole.entries {
            match spill.term(e.index) {
                Some(t) => assert_eq!(t, e.term, "{}", e.index),
                None => assert!(part.entries.iter().any(|p| p == e), "{}", e.index),
            }
        }
        // The replay's reads give the entries left on disk back, in bounded reads.
        let mut next = spill.first();
        let mut reads = 0;
        while next < spill.end() {
            let got = logs.read_job(&shard, next, spill.end(), 1000).expect("kept").run().unwrap();
            assert!(!got.is_empty() && got.len() < 20, "{} entries in one read", got.len());
            for e in got.iter().take_while(|e| e.index < spill.end()) {
                assert_eq!(e, &whole.entries[e.index as usize - 1]);
                next = e.index + 1;
            }
            reads += 1;
        }
        assert!(reads > 10);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// Closed segments get a summary as they are closed; a restart with a budget folds the
    /// older ones from it (their records unread) to the same log, the same disk part and the
    /// same reads as a restart that reads every record, and gives summaries to segments that
    /// had none. A record damaged in a segment folded from its summary is found when it is
    /// read back (an error that says so, and the summary removed), and the restart after that
    /// reads the segment whole and sets the log aside as damaged.
    #[test]
    fn a_restart_folds_closed_segments_from_their_summaries_to_the_same_log() {
        use felix_proto::cluster::meta::{HardState, Snapshot};
        let (dir, shard, mut logs) = ledger_logs("summary", 3000);
        let mut term = 1;
        for index in 1..=400u64 {
            // A new leader now and then overwrites the uncommitted tail.
            if index % 97 == 0 {
                term += 1;
                let from = index - 5;
                let es: Vec<Entry> = (from..index).map(|i| entry(i, term)).collect();
                logs.persist(&shard, &es, None).unwrap();
            }
            let hs = HardState { term, vote: 2, commit: index.saturating_sub(20), ..HardState::default() };
            logs.persist(&shard, &[entry(index, term)], Some(&hs)).unwrap();
            if index == 150 {
                let mut snap = Snapshot::default();
                snap.mut_metadata().index = 60;
                snap.mut_metadata().term = 1;
                snap.set_data(b"state".to_vec().into());
                logs.persist_snapshot(&shard, &snap, None).unwrap();
            }
        }
        drop(logs);
        let files = dir.join("cluster").join("replicas");
        let summary_files = || {
            std::fs::read_dir(&files)
                .unwrap()
                .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".sum"))
                .count()
        };
        let written = summary_files();
        assert!(written > 5, "summaries written as segments closed: {written}");
        let fast = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
        assert!(fast.damaged.is_empty());
        assert!(fast.summarised > 5, "{} folded from summaries", fast.summarised);
        let kept_fast = fast.kept.get(&shard).expect("kept").clone();
        // The same from every record (the summaries removed).
        for e in std::fs::read_dir(&files).unwrap() {
            let p = e.unwrap().path();
            if p.extension().is_some_and(|x| x == "sum") {
                std::fs::remove_file(p).unwrap();
            }
        }
        let slow = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
        assert_eq!(slow.summarised, 0);
        assert_eq!(slow.kept.get(&shard), Some(&kept_fast), "the same log, disk part and all");
        assert_eq!(slow.logs.shards[&shard].points, fast.logs.shards[&shard].points, "the same index");
        let spill = kept_fast.spill.as_ref().expect("a disk part");
        for low in [spill.first(), spill.first() + 7, spill.end() - 3] {
            let a = fast.logs.read_job(&shard, low, spill.end(), 1500).unwrap().run().unwrap();
            let b = slow.logs.read_job(&shard, low, spill.end(), 1500).unwrap().run().unwrap();
            assert!(!a.is_empty() && a == b, "reads from {low}");
        }
        // That restart gave the segments their summaries back.
        assert_eq!(summary_files(), written);
        drop((fast, slow));
        // A bit flipped in the middle of an old segment's record (the second oldest: the
        // oldest holds the snapshot's entry, so it is read whole).
        let mut segs: Vec<_> = std::fs::read_dir(&files)
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        segs.sort();
        let first = segs[1].clone();
        let mut bytes = std::fs::read(&first).unwrap();
        let at = bytes.len() / 2;
        bytes[at] ^= 0x10;
        std::fs::write(&first, &bytes).unwrap();
        let opened = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
        assert!(opened.damaged.is_empty(), "not read at the restart");
        let sp = opened.kept[&shard].spill.clone().expect("a disk part");
        let mut found = None;
        let mut next = sp.first();
        while next < sp.end() && found.is_none() {
            match opened.logs.read_job(&shard, next, sp.end(), 1500).unwrap().run() {
                Ok(got) => next = got.last().map_or(sp.end(), |e| e.index + 1),
                Err(e) => found = Some(e),
            }
        }
        let e = found.expect("the damaged record found when read");
        assert!(e.contains(DAMAGED_RECORD), "{e}");
        drop(opened);
        let again = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
        assert!(again.damaged.contains_key(&shard), "set aside at the next restart");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_replica_log_rolls_segments_and_a_snapshot_deletes_the_ones_it_covers() {
        use felix_proto::cluster::meta::{Entry, HardState, Snapshot};
        let dir = std::env::temp_dir().join(format!("felix-replica-segments-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shard =
            ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "ledger".into(), shard: 0 };
        let OpenedReplicaLogs { mut logs, kept, .. } =
            ReplicaLogs::open(Some(&dir), Some(std::time::Duration::from_secs(1)), None).unwrap();
        assert!(kept.is_empty());
        logs.segment_bytes = 1000;
        let mut expect = felix_proto::cluster::meta::RaftLog::default();
        for index in 1..=100u64 {
            let e = vec![Entry { index, term: 1, data: vec![7; 50].into(), ..Entry::default() }];
            let hs = HardState { term: 1, commit: index, ..HardState::default() };
            logs.persist(&shard, &e, Some(&hs)).unwrap();
            expect.persist(&e, Some(&hs));
        }
        let before = logs.segments(&shard);
        assert!(before.len() > 5, "rolled: {before:?}");
        let mut snap = Snapshot::default();
        snap.mut_metadata().index = 80;
        snap.mut_metadata().term = 1;
        snap.set_data(b"state".to_vec().into());
        logs.persist_snapshot(&shard, &snap, None).unwrap();
        expect.persist_snapshot(&snap);
        let after = logs.segments(&shard);
        assert!(after.len() < before.len() / 2, "deleted: {before:?} -> {after:?}");
        let files = std::fs::read_dir(dir.join("cluster").join("replicas"))
            .unwrap()
            .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "log"))
            .count();
        assert_eq!(files, after.len());
        // Written on after the snapshot, then read back: the same log.
        let e = vec![Entry { index: 101, term: 1, data: vec![8; 50].into(), ..Entry::default() }];
        logs.persist(&shard, &e, None).unwrap();
        expect.persist(&e, None);
        drop(logs);
        let kept = ReplicaLogs::open(Some(&dir), None, None).unwrap().kept;
        assert_eq!(kept.get(&shard), Some(&expect));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A host's part of a snapshot kept apart (a stream's commit state) is encoded as it is
    /// written: the record on disk is byte for byte the one of the whole data, reads back as
    /// that snapshot (whole at a restart's fold, and in pieces for a follower), and a part that
    /// gives other than the length it declared fails the write rather than leaving a record
    /// that lies.
    #[test]
    fn a_snapshot_whose_host_part_is_written_piece_by_piece_reads_back_whole_and_in_pieces() {
        use felix_proto::cluster::meta::{Entry, HardState, Snapshot};
        use felix_proto::cluster::replica::{HostPart, SnapshotRest};
        #[derive(Debug)]
        struct Part(Vec<u8>, usize);
        impl HostPart for Part {
            fn encode_into(&self, out: &mut Vec<u8>) {
                out.extend_from_slice(&self.0);
            }
            fn encoded_len(&self) -> usize {
                self.1
            }
            fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
                // Small pieces and one past the write buffer's quarter, in order.
                let (a, b) = self.0.split_at(self.0.len() / 2);
                for piece in a.chunks(7) {
                    each(piece);
                }
                each(b);
            }
        }
        let dir = std::env::temp_dir().join(format!("felix-replica-snapshot-rest-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shard =
            ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "s".into(), shard: 0 };
        let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
        for index in 1..=30 {
            let e = vec![Entry { index, term: 2, data: vec![7; 50].into(), ..Entry::default() }];
            logs.persist(&shard, &e, Some(&HardState { term: 2, commit: index, ..HardState::default() })).unwrap();
        }
        let mut head = Snapshot::default();
        head.mut_metadata().index = 20;
        head.mut_metadata().term = 2;
        // A replica's own state (version 1, next offset 9, no producers), the host's after it.
        let own = [&[1u8][..], &9u64.to_be_bytes(), &0u32.to_be_bytes()].concat();
        head.set_data(own.clone().into());
        let part: Vec<u8> = (0..(1 << 20) + 333).map(|i| (i % 241) as u8).collect();
        let rest = SnapshotRest::new(std::sync::Arc::new(Part(part.clone(), part.len())));
        logs.persist_snapshot(&shard, &head, Some(&rest)).unwrap();
        let mut whole = head.clone();
        rest.append_to(&mut whole);
        let mut data = Vec::new();
        while data.len() < whole.data.len() {
            let job = logs.snapshot_piece_job(&shard, 20, data.len() as u64, 300_000, data.is_empty()).unwrap();
            data.extend_from_slice(&job.run().unwrap().data);
        }
        assert_eq!(data, whole.data, "read back in pieces, the CRC checked");
        drop(logs);
        let opened = ReplicaLogs::open(Some(&dir), None, None).unwrap();
        assert_eq!(opened.kept[&shard].snapshot, Some(whole.clone()), "folded at a restart");
        drop(opened);
        // As `serve` opens it (with an entry budget): the host's state, 1 MiB or more, left on
        // disk for the replica to read back in pieces; the data kept, the group's own state.
        let opened = ReplicaLogs::open(Some(&dir), None, Some(1 << 20)).unwrap();
        let kept = &opened.kept[&shard];
        let want = felix_proto::cluster::meta::RestOnDisk { len: part.len() as u64, holds_commits: false };
        assert_eq!(kept.snapshot_rest_on_disk, Some(want));
        let mut cut = whole.clone();
        cut.set_data(own.clone().into());
        assert_eq!(kept.snapshot, Some(cut), "the group's own state alone");
        let job = opened.logs.snapshot_piece_job(&shard, 20, own.len() as u64, 4096, true).unwrap();
        assert_eq!(job.run().unwrap().data[..], part[..4096], "read back from where it stayed");
        // A part that says one length and gives another.
        let mut logs = opened.logs;
        let lying = SnapshotRest::new(std::sync::Arc::new(Part(part.clone(), part.len() + 1)));
        let mut next = head.clone();
        next.mut_metadata().index = 25;
        let e = logs.persist_snapshot(&shard, &next, Some(&lying)).unwrap_err();
        assert!(e.to_string().contains("declared"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A replica keeps its last snapshot in its log files only: the piece jobs find the last
    /// snapshot record where it was written, and at a restart where the fold saw it (in the
    /// last segment, read whole; in a closed one, from its summary), and read its data a piece
    /// at a time; the first piece of a send checks the whole record's CRC.
    #[test]
    fn the_last_snapshot_is_read_back_in_pieces_from_where_it_was_written_and_after_a_restart() {
        use felix_proto::cluster::meta::{Entry, HardState, Snapshot};
        let dir = std::env::temp_dir().join(format!("felix-replica-snapshot-read-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shard =
            ShardId { kind: Kind::Cache, tenant: "t".into(), namespace: "ns".into(), name: "c".into(), shard: 0 };
        let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
        logs.segment_bytes = 1000;
        assert!(logs.snapshot_piece_job(&shard, 20, 0, 1000, true).is_none(), "nothing kept");
        // The data, as a send reads it: in pieces of 1,000 bytes, the first one checked.
        let read = |logs: &ReplicaLogs, index: u64| -> Result<Snapshot, String> {
            let mut data = Vec::new();
            loop {
                let job = logs.snapshot_piece_job(&shard, index, data.len() as u64, 1000, data.is_empty()).unwrap();
                let piece = job.run()?;
                data.extend_from_slice(&piece.data);
                if data.len() as u64 == piece.total {
                    let mut s = Snapshot::default();
                    s.mut_metadata().index = index;
                    s.mut_metadata().term = 2;
                    s.set_data(data.into());
                    return Ok(s);
                }
            }
        };
        let write = |logs: &mut ReplicaLogs, from: u64, to: u64| {
            for index in from..=to {
                let e = vec![Entry { index, term: 2, data: vec![7; 50].into(), ..Entry::default() }];
                logs.persist(&shard, &e, Some(&HardState { term: 2, commit: index, ..HardState::default() })).unwrap();
            }
        };
        let snapshot = |index: u64, fill: u8| {
            let mut s = Snapshot::default();
            s.mut_metadata().index = index;
            s.mut_metadata().term = 2;
            s.set_data(vec![fill; 3000].into());
            s
        };
        write(&mut logs, 1, 30);
        logs.persist_snapshot(&shard, &snapshot(20, 1), None).unwrap();
        assert_eq!(read(&logs, 20), Ok(snapshot(20, 1)));
        write(&mut logs, 31, 32);
        logs.persist_snapshot(&shard, &snapshot(30, 2), None).unwrap();
        assert_eq!(read(&logs, 30), Ok(snapshot(30, 2)), "the newest");
        let e = read(&logs, 20).unwrap_err();
        assert!(e.contains("the snapshot kept is at index 30, not 20"), "{e}");
        drop(logs);
        // Restarted with the snapshot in the last segment (read whole).
        let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
        logs.segment_bytes = 1000;
        assert_eq!(read(&logs, 30), Ok(snapshot(30, 2)));
        // Written on until its segment is closed (with a summary), then restarted.
        write(&mut logs, 33, 80);
        assert!(logs.segments(&shard).len() > 3);
        drop(logs);
        let logs = ReplicaLogs::open(Some(&dir), None, Some(1 << 20)).unwrap();
        assert!(logs.summarised > 0, "closed segments folded from their summaries");
        assert_eq!(read(&logs.logs, 30), Ok(snapshot(30, 2)));
        assert_eq!(logs.kept[&shard].snapshot, Some(snapshot(30, 2)), "the one the fold kept");
        // A record that no longer reads (a bit flipped on disk) is an error, not a snapshot.
        let (seq, pos, _) = logs.logs.shards[&shard].snapshot.unwrap();
        assert_ne!(Some(seq), logs.logs.segments(&shard).last().copied(), "found in a closed segment's summary");
        let path = dir.join("cluster").join("replicas").join(replica_file_name(&shard, seq));
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[pos as usize + 100] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let e = read(&logs.logs, 30).unwrap_err();
        assert!(e.contains("not an intact snapshot record"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_damaged_replica_log_is_set_aside_and_said_while_a_torn_one_is_cut_and_kept() {
        use felix_proto::cluster::meta::{Entry, HardState};
        let dir = std::env::temp_dir().join(format!("felix-replica-damaged-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let shard = |name: &str| ShardId {
            kind: Kind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: name.into(),
            shard: 0,
        };
        let (damaged, torn) = (shard("damaged"), shard("torn"));
        let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
        for index in 1..=10u64 {
            let e = vec![Entry { index, term: 1, data: vec![7; 50].into(), ..Entry::default() }];
            let hs = HardState { term: 1, vote: 2, commit: index, ..HardState::default() };
            logs.persist(&damaged, &e, Some(&hs)).unwrap();
            logs.persist(&torn, &e, Some(&hs)).unwrap();
        }
        drop(logs);
        let replicas = dir.join("cluster").join("replicas");
        let path = |s: &ShardId| replicas.join(replica_file_name(s, 0));
        // One bit flipped in the middle of one log; the other's last record half written.
        let mut bytes = std::fs::read(path(&damaged)).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x04;
        std::fs::write(path(&damaged), &bytes).unwrap();
        let whole = std::fs::metadata(path(&torn)).unwrap().len();
        let mut f = std::fs::OpenOptions::new().append(true).open(path(&torn)).unwrap();
        std::io::Write::write_all(&mut f, &felix_proto::cluster::meta::encode_log_record(&[], None)[..7]).unwrap();
        drop(f);
        let opened = ReplicaLogs::open(Some(&dir), None, None).unwrap();
        // The torn one is cut back to its whole records and kept.
        assert_eq!(opened.kept.get(&torn).map(|l| l.entries.len()), Some(10));
        assert_eq!(std::fs::metadata(path(&torn)).unwrap().len(), whole);
        // The damaged one is neither kept nor left where it would be read again: it is in
        // `damaged/`, byte for byte, and said with its file and why.
        assert!(!opened.kept.contains_key(&damaged));
        let why = &opened.damaged[&damaged];
        assert!(why.contains(&replica_file_name(&damaged, 0)) && why.contains(", byte "), "{why}");
        assert!(!path(&damaged).exists());
        let aside: Vec<_> = std::fs::read_dir(replicas.join("damaged")).unwrap().map(|e| e.unwrap().path()).collect();
        assert_eq!(aside.len(), 1);
        assert_eq!(std::fs::read(&aside[0]).unwrap(), bytes);
        // Its replica starts a fresh log; the next open reads that, and leaves `damaged/` alone.
        let mut logs = opened.logs;
        let e = vec![Entry { index: 1, term: 3, data: vec![1].into(), ..Entry::default() }];
        logs.persist(&damaged, &e, Some(&HardState { term: 3, commit: 1, ..HardState::default() })).unwrap();
        drop(logs);
        let again = ReplicaLogs::open(Some(&dir), None, None).unwrap();
        assert!(again.damaged.is_empty());
        assert_eq!(again.kept.get(&damaged).map(|l| l.hard_state.term), Some(3));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn replica_file_names_round_trip_and_strangers_are_refused() {
        let s = ShardId {
            kind: Kind::Stream,
            tenant: "t.1".into(),
            namespace: "ns/x".into(),
            name: "or ders".into(),
            shard: 7,
        };
        assert_eq!(parse_replica_file_name(&replica_file_name(&s, 0)), Some((s.clone(), 0)));
        assert_eq!(parse_replica_file_name(&replica_file_name(&s, 12)), Some((s, 12)));
        for bad in ["x.log", "stream~a~b~c~d.log", "queue~a~b~c~1.log", "stream~a~b~c~1", "stream~a~b~c~1~2.log", ""] {
            assert_eq!(parse_replica_file_name(bad), None, "{bad}");
        }
    }
}

#[cfg(test)]
mod link_tests {
    use super::*;

    /// A cluster listener that accepts and holds connections, and a dialling endpoint.
    fn endpoints() -> (quinn::Endpoint, quinn::Endpoint, SocketAddr) {
        let (id, _, _) = crate::Identity::self_signed(&["localhost"]).unwrap();
        let mut tls = crate::tls::server_config(id).unwrap();
        tls.alpn_protocols = vec![CLUSTER_ALPN.to_vec()];
        let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).unwrap();
        let mut server = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        let here = SocketAddr::from(([127, 0, 0, 1], 0));
        server.transport_config(peer_transport(here));
        let listener = quinn::Endpoint::server(server, here).unwrap();
        let addr = listener.local_addr().unwrap();
        let dialler = quinn::Endpoint::client(here).unwrap();
        (listener, dialler, addr)
    }

    /// A link made, lost and made again counts both and sums what each connection sent; a
    /// connection that ended after a newer one came up (a peer removed and added again at once)
    /// does not take the newer one down.
    #[tokio::test]
    async fn a_link_lost_and_made_again_counts_both_and_a_stale_end_changes_nothing() {
        let (listener, dialler, addr) = endpoints();
        tokio::spawn(async move {
            let mut held = Vec::new();
            while let Some(i) = listener.accept().await {
                if let Ok(c) = i.await {
                    held.push(c);
                }
            }
        });
        let dial =
            async || dialler.connect_with(client_config(addr).unwrap(), addr, "localhost").unwrap().await.unwrap();
        let links = Links::default();
        let first = dial().await;
        links.up("n2", &first);
        let r = &links.report()[0];
        assert!(r.up && r.rtt_micros.is_some() && r.datagrams_sent > 0, "{r:?}");
        assert_eq!((r.connects, r.lost), (1, 0));
        let sent_by_first = first.stats().udp_tx.datagrams;
        first.close(0u32.into(), b"");
        links.down("n2", &first);
        let r = &links.report()[0];
        assert!(!r.up && r.rtt_micros.is_none(), "{r:?}");
        assert_eq!((r.connects, r.lost), (1, 1));
        assert!(r.datagrams_sent >= sent_by_first, "kept after the link ended: {r:?}");
        let second = dial().await;
        links.up("n2", &second);
        // The first connection's end said again (late) leaves the second one up.
        links.down("n2", &first);
        let r = &links.report()[0];
        assert!(r.up, "{r:?}");
        assert_eq!((r.connects, r.lost), (2, 1));
        assert!(r.datagrams_sent > sent_by_first, "both connections' datagrams: {r:?}");
        links.down("n2", &second);
        assert_eq!((links.report()[0].up, links.report()[0].lost), (false, 2));
    }
}
