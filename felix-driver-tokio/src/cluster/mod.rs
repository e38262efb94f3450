//! The cluster transport: QUIC between brokers on a listener of their own (never the client
//! listener), carrying `felix_proto::cluster::peer` messages. The driver decides nothing: the
//! broker's [`ClusterNode`](felix_proto::cluster::node::ClusterNode) says what goes to whom.
//!
//! Each broker dials every other one and sends on one unidirectional stream: first a `hello`
//! with the cluster's name and shared secret, then messages in order. A receiving broker reads
//! the hello before anything else; a stranger (another cluster, a wrong secret, an unknown node
//! id) has its connection closed and is logged. A peer that cannot be reached is dialled again
//! every 200 ms; meanwhile a forwarded publish for it is reported undeliverable (its client gets
//! `shard_unavailable`), and Raft messages are dropped (Raft sends again). A link on which
//! nothing arrived for `PEER_SILENCE` is closed and dialled again, whatever QUIC still holds
//! (a pause inflates QUIC's own idle timeout; `liveness` says how).

use bytes::BytesMut;
use felix_proto::cluster::peer::{PeerDecoder, PeerMessage, encode, encode_chunks};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::mpsc;

use crate::peer_links::{LinkReport, Links};

mod meta_log;
pub(crate) use meta_log::*;
mod replica_open;
use replica_open::*;
mod replica_logs;
pub(crate) use replica_logs::*;
#[cfg(test)]
mod replica_log_tests;

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
        // Writes and the connection's end, together: a connection that died (closed, or its
        // peer went silent) is said at once, not when the next write fails. A write the peer's
        // flow control holds up ends there too.
        let gone = link_gone(conn.clone());
        tokio::pin!(gone);
        loop {
            let m = tokio::select! {
                m = queue.recv() => match m {
                    Some(m) => m,
                    None => break,
                },
                g = &mut gone => {
                    g.say(&peer);
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
            let written = {
                let write = send.write_all_chunks(&mut chunks);
                tokio::pin!(write);
                tokio::select! {
                    r = &mut write => r.is_ok(),
                    g = &mut gone => {
                        g.say(&peer);
                        false
                    }
                }
            };
            if !written {
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

/// A peer link that carried nothing for this long is dead, whatever QUIC still holds (see
/// [`crate::liveness`]): closed, and dialled again. Keep-alives every quarter of it keep a live
/// link from ever being this quiet.
const PEER_SILENCE: Duration = PEER_IDLE_TIMEOUT;

/// QUIC application error code of a peer link closed because the peer went silent.
const SILENT_PEER_CODE: u32 = 3;

/// How a dialled link ended.
enum Gone {
    /// The connection closed (the peer closed it, QUIC's idle timeout, a stateless reset).
    Closed,
    /// Nothing arrived on it for this long: this broker closed it.
    Silent(Duration),
}

impl Gone {
    fn say(&self, peer: &str) {
        if let Gone::Silent(d) = self {
            tracing::warn!(
                "cluster: peer {peer} sent nothing for {:.1} s on a link QUIC still held open; dialling it again",
                d.as_secs_f64()
            );
        }
    }
}

/// Ends when the dialled link on `conn` closes or goes silent (closing it then).
async fn link_gone(conn: Option<quinn::Connection>) -> Gone {
    let Some(c) = conn else { return std::future::pending().await };
    match crate::liveness::silence(&c, PEER_SILENCE).await {
        Some(d) => {
            c.close(quinn::VarInt::from_u32(SILENT_PEER_CODE), b"peer silent");
            Gone::Silent(d)
        }
        None => Gone::Closed,
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
                        let got = chunk.bytes.len() as u64;
                        d.push_chunk(chunk.bytes);
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
                            n.fetch_add(got, std::sync::atomic::Ordering::Relaxed);
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

use felix_proto::cluster::metadata::{Kind, ShardId};

#[cfg(test)]
mod link_tests {
    use super::*;
    use crate::testkit::{RelayMode, UdpRelay};

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

    /// The pause that kept a cluster from electing for 19 s: a dialler that reads its peer's
    /// acknowledgements late (here held by a relay; in the fault, read from its own socket
    /// buffer after a SIGSTOP) takes them for round trips as long as the wait, and QUIC's idle
    /// timeout (three probe timeouts at least) stretches to many seconds. The peer is gone
    /// right after (everything dropped): the link must still be given up, and dialled again,
    /// within `PEER_SILENCE` and its checks, not when QUIC's stretched idle timeout ends.
    #[tokio::test]
    async fn a_link_whose_answers_came_late_and_then_stopped_is_given_up_within_the_silence_bound() {
        let (listener, dialler, addr) = endpoints();
        let (heard_tx, mut heard) = mpsc::unbounded_channel();
        tokio::spawn(async move {
            while let Some(i) = listener.accept().await {
                let Ok(c) = i.await else { continue };
                let heard_tx = heard_tx.clone();
                tokio::spawn(async move {
                    while let Ok(mut recv) = c.accept_uni().await {
                        let heard_tx = heard_tx.clone();
                        tokio::spawn(async move {
                            while let Ok(Some(_)) = recv.read_chunk(64 * 1024, true).await {
                                let _ = heard_tx.send(());
                            }
                        });
                    }
                });
            }
        });
        let relay = UdpRelay::start(addr);
        let (queue_tx, rx) = mpsc::unbounded_channel();
        let (inputs_tx, mut inputs) = mpsc::unbounded_channel();
        let hello = PeerMessage::Hello {
            cluster: "c".into(),
            node_id: "n1".into(),
            secret: "s".into(),
            incarnation: String::new(),
            features: 0,
        };
        let queue = Queue { rx, queued: Arc::default() };
        tokio::spawn(dial_loop(dialler, relay.addr(), "n2".into(), hello.clone(), queue, inputs_tx, Links::default()));
        let bound = Duration::from_secs(10);
        tokio::time::timeout(bound, heard.recv()).await.expect("the link came up").expect("listener running");

        // Messages the listener acknowledges into the hold, then the hold (the pause).
        relay.set(RelayMode::HoldReplies);
        for _ in 0..20 {
            queue_tx.send(hello.clone()).unwrap();
        }
        tokio::time::sleep(Duration::from_millis(1600)).await;
        relay.set(RelayMode::ReleaseThenDrop);
        let released = tokio::time::Instant::now();

        // The late answers arrive; then nothing. Keep the dialler busy meanwhile (a broker
        // always has something for its peers).
        let lost = tokio::time::timeout(bound, async {
            loop {
                let _ = queue_tx.send(hello.clone());
                tokio::select! {
                    i = inputs.recv() => match i {
                        Some(PeerInput::Lost(p)) => return p,
                        Some(_) => {}
                        None => panic!("the dial loop ended"),
                    },
                    () = tokio::time::sleep(Duration::from_millis(100)) => {}
                }
            }
        })
        .await
        .expect("the silent link was given up");
        let took = released.elapsed();
        assert_eq!(lost, "n2");
        // Silence is judged over `PEER_SILENCE` from the last late answer, checked every
        // eighth of it (2.2 s measured); QUIC alone gave the link up after 8.8 s here.
        assert!(took < PEER_SILENCE * 3, "given up {took:?} after the peer went silent");
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
