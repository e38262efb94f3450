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
use felix_proto::cluster::peer::{PeerDecoder, PeerMessage, encode};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

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
}

/// What the transport tells the broker task.
pub(crate) enum PeerInput {
    /// A message from peer `from` (its hello was checked).
    Message { from: String, message: PeerMessage },
    /// A message that could not be sent.
    Undeliverable(PeerMessage),
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
        tokio::spawn(accept_loop(
            endpoint.clone(),
            opts.name.clone(),
            opts.secret.clone(),
            known.clone(),
            inputs.clone(),
        ));
        let hello = PeerMessage::Hello {
            cluster: opts.name.clone(),
            node_id: opts.node_id.clone(),
            secret: opts.secret.clone(),
            incarnation: incarnation.to_owned(),
        };
        let mut t = Transport { senders: BTreeMap::new(), endpoint, known, hello, inputs, me: opts.node_id.clone() };
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
        tokio::spawn(dial_loop(self.endpoint.clone(), addr, self.hello.clone(), rx, self.inputs.clone()));
    }

    /// Stops dialling `name` and refuses it as a peer from now on (a broker removed from the
    /// cluster). Its connection task ends when its queue closes.
    pub(crate) fn remove_peer(&mut self, name: &str) {
        if let Ok(mut k) = self.known.write() {
            k.remove(name);
        }
        self.senders.remove(name);
    }

    /// Queues a message for peer `to`; a peer not in the cluster's list gets nothing.
    pub(crate) fn send(&self, to: &str, message: PeerMessage) -> Result<(), Box<PeerMessage>> {
        match self.senders.get(to) {
            Some(tx) => tx.send(message).map_err(|e| Box::new(e.0)),
            None => Err(Box::new(message)),
        }
    }

    /// The cluster listener's address.
    pub(crate) fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.endpoint.local_addr()
    }

    pub(crate) fn close(&self) {
        self.endpoint.close(quinn::VarInt::from_u32(0), b"broker shutting down");
    }
}

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
    hello: PeerMessage,
    mut rx: mpsc::UnboundedReceiver<PeerMessage>,
    inputs: mpsc::UnboundedSender<PeerInput>,
) {
    let Ok(cfg) = client_config(addr) else { return };
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
                    m = rx.recv() => match m {
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
        while let Some(m) = rx.recv().await {
            buf.clear();
            if encode(&m, &mut buf).is_err() {
                continue;
            }
            if send.write_all(&buf).await.is_err() {
                let _ = inputs.send(PeerInput::Undeliverable(m));
                break;
            }
        }
        if rx.is_closed() {
            return;
        }
    }
}

async fn accept_loop(
    endpoint: quinn::Endpoint,
    cluster: String,
    secret: String,
    known: Known,
    inputs: mpsc::UnboundedSender<PeerInput>,
) {
    while let Some(incoming) = endpoint.accept().await {
        let (cluster, secret, known, inputs) = (cluster.clone(), secret.clone(), known.clone(), inputs.clone());
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok(mut recv) = conn.accept_uni().await {
                let (cluster, secret, known, inputs, conn) =
                    (cluster.clone(), secret.clone(), known.clone(), inputs.clone(), conn.clone());
                tokio::spawn(async move {
                    let mut d = PeerDecoder::default();
                    let mut from: Option<String> = None;
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
                                (None, PeerMessage::Hello { cluster: c, node_id, secret: s, incarnation }) => {
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
                                    };
                                    let _ = inputs.send(PeerInput::Message { from: node_id.clone(), message: hello });
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

/// Where a broker keeps the Raft logs of its replicas of replicated shards: one append-only
/// file per shard under `DATA_DIR/cluster/replicas/`. A shard's file *is* its records (the
/// stream's log): nothing else is written for a replicated shard. Appends go to the page cache
/// at once (before any message that depends on them is sent, so a killed process loses none)
/// and reach the disk on the interval the broker's fsync policy names, or before every answer
/// with `--fsync always`.
pub(crate) struct ReplicaLogs {
    dir: Option<std::path::PathBuf>,
    files: std::collections::BTreeMap<ShardId, std::fs::File>,
    dirty: std::collections::BTreeSet<ShardId>,
    sync_every: Option<std::time::Duration>,
    last_sync: std::time::Instant,
    /// Write failures (logged; the replica's peers carry on with a majority).
    pub(crate) failures: u64,
}

use felix_proto::cluster::metadata::{Kind, ShardId};

fn replica_file_name(s: &ShardId) -> String {
    use felix_proto::storage::path_component as pc;
    let kind = if s.kind == Kind::Cache { "cache" } else { "stream" };
    format!("{kind}~{}~{}~{}~{}.log", pc(&s.tenant), pc(&s.namespace), pc(&s.name), s.shard)
}

fn parse_replica_file_name(n: &str) -> Option<ShardId> {
    use felix_proto::storage::parse_path_component as pc;
    let n = n.strip_suffix(".log")?;
    let parts: Vec<&str> = n.split('~').collect();
    let [kind, t, ns, name, shard] = parts.as_slice() else { return None };
    let kind = match *kind {
        "stream" => Kind::Stream,
        "cache" => Kind::Cache,
        _ => return None,
    };
    Some(ShardId { kind, tenant: pc(t)?, namespace: pc(ns)?, name: pc(name)?, shard: shard.parse().ok()? })
}

impl ReplicaLogs {
    /// Opens the directory (nothing is kept without a data directory) and reads back every
    /// replica's log. A file torn by a crash mid-append is cut back to its last whole record;
    /// a file whose name is not a shard's is left alone and said.
    pub(crate) fn open(
        data_dir: Option<&std::path::Path>,
        sync_every: Option<std::time::Duration>,
    ) -> std::io::Result<(ReplicaLogs, std::collections::BTreeMap<ShardId, felix_proto::cluster::meta::RaftLog>)> {
        let dir = data_dir.map(|d| d.join("cluster").join("replicas"));
        let mut kept = std::collections::BTreeMap::new();
        if let Some(dir) = &dir
            && dir.exists()
        {
            for e in std::fs::read_dir(dir)? {
                let e = e?;
                let name = e.file_name().to_string_lossy().into_owned();
                let Some(shard) = parse_replica_file_name(&name) else {
                    if !name.ends_with(".tmp") {
                        tracing::warn!("{}: not a replica's log, left alone", e.path().display());
                    }
                    continue;
                };
                let bytes = std::fs::read(e.path())?;
                let (log, whole) = felix_proto::cluster::meta::fold_log_records(&bytes);
                if whole < bytes.len() {
                    tracing::warn!(
                        "{}: {} bytes after the last whole record (a write cut short) were dropped",
                        e.path().display(),
                        bytes.len() - whole
                    );
                    let f = std::fs::OpenOptions::new().write(true).open(e.path())?;
                    f.set_len(whole as u64)?;
                    f.sync_all()?;
                }
                kept.insert(shard, log);
            }
        }
        let logs = ReplicaLogs {
            dir,
            files: Default::default(),
            dirty: Default::default(),
            sync_every,
            last_sync: std::time::Instant::now(),
            failures: 0,
        };
        Ok((logs, kept))
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
        use std::io::Write;
        let Some(dir) = &self.dir else { return Ok(()) };
        if entries.is_empty() && hard_state.is_none() {
            return Ok(());
        }
        let record = felix_proto::cluster::meta::encode_log_record(entries, hard_state);
        let r = (|| -> std::io::Result<()> {
            if !self.files.contains_key(shard) {
                std::fs::create_dir_all(dir)?;
                let f =
                    std::fs::OpenOptions::new().create(true).append(true).open(dir.join(replica_file_name(shard)))?;
                self.files.insert(shard.clone(), f);
            }
            let f = self.files.get_mut(shard).expect("opened above");
            f.write_all(&record)?;
            if self.sync_every.is_none() {
                f.sync_data()?;
            } else {
                self.dirty.insert(shard.clone());
            }
            Ok(())
        })();
        if let Err(e) = &r {
            self.failures += 1;
            // What was appended of it may be torn: the file is cut back at the next start.
            self.files.remove(shard);
            tracing::error!("writing {shard:?}'s replica log: {e}; the replica stops until the broker restarts");
        }
        r
    }

    /// Syncs what was appended since the last sync, when the interval has passed.
    pub(crate) fn sync_due(&mut self, now: std::time::Instant) {
        let Some(every) = self.sync_every else { return };
        if self.dirty.is_empty() || now.saturating_duration_since(self.last_sync) < every {
            return;
        }
        self.last_sync = now;
        for s in std::mem::take(&mut self.dirty) {
            if let Some(f) = self.files.get(&s)
                && let Err(e) = f.sync_data()
            {
                self.failures += 1;
                tracing::error!("syncing {s:?}'s replica log: {e}");
            }
        }
    }

    /// The shard is gone (its stream deleted): its log is removed.
    pub(crate) fn drop_shard(&mut self, shard: &ShardId) {
        self.files.remove(shard);
        self.dirty.remove(shard);
        if let Some(dir) = &self.dir {
            let _ = std::fs::remove_file(dir.join(replica_file_name(shard)));
        }
    }
}

#[cfg(test)]
mod replica_log_tests {
    use super::*;

    #[test]
    fn replica_file_names_round_trip_and_strangers_are_refused() {
        let s = ShardId {
            kind: Kind::Stream,
            tenant: "t.1".into(),
            namespace: "ns/x".into(),
            name: "or ders".into(),
            shard: 7,
        };
        assert_eq!(parse_replica_file_name(&replica_file_name(&s)), Some(s));
        for bad in ["x.log", "stream~a~b~c~d.log", "queue~a~b~c~1.log", "stream~a~b~c~1", ""] {
            assert_eq!(parse_replica_file_name(bad), None, "{bad}");
        }
    }
}
