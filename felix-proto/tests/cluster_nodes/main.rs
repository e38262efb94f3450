//! Three brokers of one cluster (`cluster::node::ClusterNode`), wired in memory: they elect a
//! metadata leader, join, spread a stream's shards, and every record published through any of
//! them lands once, on its shard's owner.

#[path = "../support/mod.rs"]
mod support;

use bytes::Bytes;
use felix_proto::binary::AckStatus;
use felix_proto::broker::{Broker, BrokerOutput, PeerAddr, StorageOutput, TransportOutput, WriteOutcome};
use felix_proto::cluster::meta::RaftLog;
use felix_proto::cluster::metadata::{Command, Kind, Member, MemberState, ShardId};
use felix_proto::cluster::node::{ClusterNode, NodeOutput, TICK};
use felix_proto::cluster::peer::{PeerDecoder, encode};
use felix_proto::message::{self, Message, StartPosition};
use felix_proto::transport::{ConnId, Dir, Side, StreamId, WallClock};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Instant;
use support::*;

mod replicated_streams;
mod routing;
use replicated_streams::*;
mod replicated_caches;
use replicated_caches::*;
mod moves_and_fail_over;
use moves_and_fail_over::*;
mod groups_and_snapshots;
use groups_and_snapshots::*;
mod compatibility;
mod group_moves;
mod leadership;
mod lingering;
mod placement_and_metadata;
use placement_and_metadata::*;

struct Cluster {
    now: Instant,
    nodes: BTreeMap<String, ClusterNode>,
    kept: BTreeMap<String, RaftLog>,
    /// What each broker kept of its replicas' Raft logs.
    kept_replicas: BTreeMap<String, BTreeMap<ShardId, RaftLog>>,
    /// Brokers whose disk refuses their replicas' writes.
    failing_disks: std::collections::BTreeSet<String>,
    network: VecDeque<(String, String, Bytes)>,
    /// Bytes each client stream received: (node, conn, stream).
    received: BTreeMap<(String, ConnId, StreamId), Vec<u8>>,
    /// Records stored per (node, shard).
    stored: BTreeMap<(String, u32), u32>,
    /// Records written to system logs (`$groups…`, `$cache…`), by broker and log, in order.
    sys_writes: BTreeMap<(String, String), Vec<Bytes>>,
    /// Every broker's truncations that carried a state checkpoint: (broker, stream, start).
    state_checkpoints: Vec<(String, String, u64)>,
    /// (at, peer, address) the driver was told to dial; (at, peer) to forget.
    peers_added: Vec<(String, String, String)>,
    peers_removed: Vec<(String, String)>,
    /// (at, peer, why) refused.
    refusals: Vec<(String, String, String)>,
    /// Streams retain this many records, and replicas checkpoint every few hundred bytes (so
    /// their logs are compacted within a test).
    retain: Option<u64>,
    /// Broker-opened streams handed out so far.
    next_uni: u64,
    /// Brokers (re)started with storage (counters, groups).
    history: bool,
    /// Brokers that say in their hello they read no coalesced heartbeats (an older version).
    old_peers: std::collections::BTreeSet<String>,
    /// Peer messages sent, by kind: (from, to, kind) → count.
    sent_kinds: BTreeMap<(String, String, &'static str), u64>,
    /// Brokers cut off from the others: what they send and what is sent to them is lost.
    cut: std::collections::BTreeSet<String>,
    /// Caches named in the configuration of brokers (re)started by `start`.
    cache_specs: Vec<felix_proto::broker::CacheSpec>,
    stream_specs: Vec<felix_proto::broker::StreamSpec>,
    /// Streams the brokers finished (FIN), by broker, connection and stream.
    finished: std::collections::BTreeSet<(String, ConnId, StreamId)>,
    /// Steps of replica rejoins the brokers said: (broker, what).
    rejoin_notes: Vec<(String, String)>,
    /// Brokers (re)started by `start` with their wall clock this many microseconds off.
    wall_skew: BTreeMap<String, i64>,
    /// Brokers whose clock runs at a rate of their own from an instant on: (since, rate).
    rates: BTreeMap<String, (Instant, f64)>,
    /// Brokers (re)started by `start` keep this much of a stream's history in memory, and
    /// this many entry bytes of each replica's Raft log (`None`: the defaults).
    memory: Option<(u64, u64)>,
    /// Reads of kept replica logs answered.
    replica_reads: u64,
    /// Reads of pieces of kept snapshots answered, and the most bytes one asked for.
    snapshot_reads: u64,
    largest_snapshot_piece: u64,
    /// Snapshots persisted with their host's part beside them (written piece by piece), and
    /// the most data one handed over encoded (beside any such part).
    snapshots_with_rest: u64,
    largest_encoded_snapshot: usize,
    /// Snapshot chunks the transport does not report taken until the test says so (a slow
    /// link): (sender, receiver, shard, index).
    hold_chunk_writes: bool,
    held_chunk_writes: Vec<(String, String, ShardId, u64)>,
    /// Reads of kept snapshots fail (a damaged record) while set.
    failing_snapshot_reads: bool,
    /// Reads of kept snapshots fail on these brokers (a disk that does not answer).
    failing_reads_on: BTreeSet<String>,
    /// Brokers (re)started by `start` read an installed snapshot's state back from disk in
    /// pieces: (from this many bytes, pieces of this many).
    restore_in_pieces: Option<(u64, u64)>,
    /// Brokers (re)started by `start` find the committed entries of their replicas' kept logs
    /// past this many bytes left on disk (as `serve`'s fold of a long log leaves them).
    spill_on_start: Option<u64>,
    /// Brokers (re)started by `start` find the host's state of their replicas' kept snapshots
    /// of this many bytes or more left on disk (as `serve`'s fold leaves it).
    state_on_disk_on_start: Option<u64>,
    /// Brokers (re)started by `start` send shard snapshots in chunks of this many bytes.
    chunk_bytes: Option<usize>,
    /// Brokers that offer these peer features (and act by them) rather than all of them.
    features: BTreeMap<String, u64>,
    /// Brokers (re)started by `start` compact the metadata log every this many entries.
    meta_snapshot_entries: Option<u64>,
}

fn member(name: &str, i: u16) -> Member {
    Member {
        id: name.into(),
        client_addr: format!("127.0.0.1:{}", 5000 + i),
        cluster_addr: format!("127.0.0.1:{}", 7000 + i),
        state: MemberState::Active,
        incarnation: format!("{name}-first-life"),
    }
}

impl Cluster {
    fn new(names: &[&str]) -> Cluster {
        Self::with(names, false)
    }

    /// `history`: brokers with storage (counters, groups), as `serve` runs them.
    fn with(names: &[&str], history: bool) -> Cluster {
        let now = epoch();
        let peers: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let mut nodes = BTreeMap::new();
        for (i, n) in names.iter().enumerate() {
            let mut cfg = config();
            cfg.clustered = true;
            cfg.history_reads = history;
            let broker = Broker::new(cfg, WallClock::new(now, 1_700_000_000_000_000));
            let node = ClusterNode::new(broker, member(n, i as u16 + 1), &peers, &RaftLog::default(), now).unwrap();
            nodes.insert(n.to_string(), node);
        }
        let mut c = Cluster {
            now,
            nodes,
            kept: BTreeMap::new(),
            kept_replicas: BTreeMap::new(),
            failing_disks: Default::default(),
            network: VecDeque::new(),
            received: BTreeMap::new(),
            stored: BTreeMap::new(),
            sys_writes: BTreeMap::new(),
            state_checkpoints: Vec::new(),
            peers_added: Vec::new(),
            peers_removed: Vec::new(),
            refusals: Vec::new(),
            retain: None,
            next_uni: 0,
            history,
            old_peers: Default::default(),
            sent_kinds: BTreeMap::new(),
            cut: Default::default(),
            cache_specs: Vec::new(),
            stream_specs: Vec::new(),
            finished: Default::default(),
            rejoin_notes: Vec::new(),
            wall_skew: BTreeMap::new(),
            rates: BTreeMap::new(),
            memory: None,
            replica_reads: 0,
            snapshot_reads: 0,
            largest_snapshot_piece: 0,
            snapshots_with_rest: 0,
            largest_encoded_snapshot: 0,
            hold_chunk_writes: false,
            held_chunk_writes: Vec::new(),
            failing_snapshot_reads: false,
            failing_reads_on: BTreeSet::new(),
            restore_in_pieces: None,
            state_on_disk_on_start: None,
            spill_on_start: None,
            chunk_bytes: None,
            features: BTreeMap::new(),
            meta_snapshot_entries: None,
        };
        for n in names {
            c.hellos(n);
        }
        c
    }

    /// Brokers whose streams retain `records` records, compacting their replicas' logs.
    fn retaining(names: &[&str], records: u64) -> Cluster {
        let mut c = Self::new(names);
        c.retain = Some(records);
        c.history = true;
        let now = c.now;
        for name in names {
            c.start(name, &RaftLog::default(), now);
        }
        c
    }

    /// (Re)starts broker `name` from its kept Raft log and replica logs.
    fn start(&mut self, name: &str, kept: &RaftLog, now: Instant) {
        let peers: Vec<String> = NAMES.iter().map(|s| s.to_string()).collect();
        let mut cfg = config();
        cfg.clustered = true;
        cfg.history_reads = self.history;
        cfg.caches = self.cache_specs.clone();
        cfg.streams = self.stream_specs.clone();
        if let Some(r) = self.retain {
            cfg.default_stream.retention.max_records = Some(r);
        }
        if let Some((history, _)) = self.memory {
            cfg.default_stream.memory_bytes = history;
        }
        let i = NAMES.iter().position(|n| *n == name).unwrap() as u16 + 1;
        // Each broker's own clock: wall times a few milliseconds apart, as on real machines.
        let skew = self.wall_skew.get(name).copied().unwrap_or(0);
        let wall = (1_700_000_000_000_000 + i64::from(i) * 7_000 + skew) as u64;
        let broker = Broker::new(cfg, WallClock::new(now, wall));
        let mut node = ClusterNode::new(broker, member(name, i), &peers, kept, now).unwrap();
        if self.retain.is_some() {
            node.set_replica_checkpoint_bytes(300);
        }
        if let Some((_, entries)) = self.memory {
            node.set_replica_entry_cache(entries);
        }
        let mut replicas = self.kept_replicas.get(name).cloned().unwrap_or_default();
        if let Some(keep) = self.spill_on_start {
            for log in replicas.values_mut() {
                log.spill_committed(keep);
            }
        }
        if let Some(min) = self.state_on_disk_on_start {
            for log in replicas.values_mut() {
                ClusterNode::leave_kept_state_on_disk(log, min);
            }
        }
        node.set_kept_replicas(replicas);
        if let Some(b) = self.chunk_bytes {
            node.set_snapshot_chunk_bytes(b);
        }
        if let Some((min, piece)) = self.restore_in_pieces {
            node.set_restore_in_pieces(min, piece);
        }
        if let Some(e) = self.meta_snapshot_entries {
            node.set_meta_snapshot_entries(Some(e));
        }
        self.nodes.insert(name.to_owned(), node);
        self.hellos(name);
    }

    /// The hellos of new connections between `name` and every other broker, both ways (what
    /// each reads: coalesced heartbeats unless `old_peers` names it).
    fn hellos(&mut self, name: &str) {
        use felix_proto::cluster::peer::{PEER_FEATURES, PeerMessage};
        let hello = |c: &Cluster, from: &str| PeerMessage::Hello {
            cluster: "c".into(),
            node_id: from.into(),
            secret: String::new(),
            incarnation: format!("{from}-first-life"),
            features: if c.old_peers.contains(from) {
                0
            } else {
                c.features.get(from).copied().unwrap_or(PEER_FEATURES)
            },
        };
        let now = self.now;
        // An older broker also acts as one: it offers nothing, so it hibernates nothing.
        for (n, node) in self.nodes.iter_mut() {
            if self.old_peers.contains(n) {
                node.set_offered_features(0);
            } else if let Some(f) = self.features.get(n) {
                node.set_offered_features(*f);
            }
        }
        let others: Vec<String> = self.nodes.keys().filter(|n| *n != name).cloned().collect();
        for o in others {
            let to_me = hello(self, &o);
            let to_them = hello(self, name);
            if let Some(n) = self.nodes.get_mut(name) {
                n.handle_peer(&o, to_me, now);
            }
            if let Some(n) = self.nodes.get_mut(&o) {
                n.handle_peer(name, to_them, now);
            }
        }
    }

    /// Carries out every node's outputs, delivers the network, until all is quiet.
    fn settle(&mut self) {
        loop {
            let mut moved = false;
            let names: Vec<String> = self.nodes.keys().cloned().collect();
            for name in &names {
                let node = self.nodes.get_mut(name).unwrap();
                while let Some(o) = node.poll_output() {
                    moved = true;
                    match o {
                        NodeOutput::Broker(BrokerOutput::Transport(TransportOutput::Transmit {
                            conn,
                            stream,
                            data,
                        })) => {
                            self.received.entry((name.clone(), conn, stream)).or_default().extend_from_slice(&data);
                        }
                        NodeOutput::Broker(BrokerOutput::Transport(TransportOutput::Finish { conn, stream })) => {
                            self.finished.insert((name.clone(), conn, stream));
                        }
                        NodeOutput::Broker(BrokerOutput::Transport(TransportOutput::OpenUni { conn, token })) => {
                            // Event streams (cache watches) get ids of their own.
                            self.next_uni += 1;
                            let s = StreamId::new(Side::Broker, Dir::Uni, self.next_uni);
                            node.inputs().handle_stream_opened(conn, token, s, now_of(&self.rates, name, self.now));
                        }
                        NodeOutput::Broker(BrokerOutput::Storage(StorageOutput::Persist(w))) => {
                            if !w.generation_start && !w.stream.starts_with('$') {
                                *self.stored.entry((name.clone(), w.shard)).or_default() += w.records.count();
                            }
                            if w.stream.starts_with('$') {
                                let log = self.sys_writes.entry((name.clone(), w.stream.clone())).or_default();
                                log.extend(w.records.payloads());
                            }
                            let now = now_of(&self.rates, name, self.now);
                            node.inputs().handle_write_result(w.token, WriteOutcome::Written, now);
                        }
                        NodeOutput::Broker(BrokerOutput::Storage(StorageOutput::Truncate {
                            stream,
                            start,
                            state_checkpoint: Some(_),
                            ..
                        })) => self.state_checkpoints.push((name.clone(), stream, start)),
                        NodeOutput::Broker(o) => {
                            if std::env::var("DBG").is_ok() {
                                eprintln!("{name}: {o:?}");
                            }
                        }
                        NodeOutput::Peer { to, message } => {
                            use felix_proto::cluster::peer::PeerMessage;
                            let kind = match &message {
                                PeerMessage::Heartbeats(list) if list.is_empty() => "empty heartbeats",
                                PeerMessage::Heartbeats(_) => "heartbeats",
                                PeerMessage::ShardRaft(list)
                                    if list.iter().all(|(_, b)| {
                                        felix_proto::cluster::meta::decode_message(&b.to_bytes()).is_ok_and(|m| {
                                            matches!(
                                                m.get_msg_type(),
                                                raft::eraftpb::MessageType::MsgHeartbeat
                                                    | raft::eraftpb::MessageType::MsgHeartbeatResponse
                                            )
                                        })
                                    }) =>
                                {
                                    "shard_raft heartbeats"
                                }
                                PeerMessage::ShardRaft(_) => "shard_raft",
                                PeerMessage::Forward(_) => "forward",
                                PeerMessage::ForwardBatch(_) => "forward_batch",
                                PeerMessage::ForwardAnswer { .. } => "forward_answer",
                                PeerMessage::ForwardAnswers(_) => "forward_answers",
                                _ => "other",
                            };
                            *self.sent_kinds.entry((name.clone(), to.clone(), kind)).or_default() += 1;
                            if let PeerMessage::SnapshotChunk(c) = &message {
                                let written = (name.clone(), to.clone(), c.shard.clone(), c.index);
                                if self.hold_chunk_writes {
                                    self.held_chunk_writes.push(written);
                                } else {
                                    node.handle_snapshot_chunk_written(&to, &c.shard, c.index, self.now);
                                }
                            }
                            // Through the wire encoding, as the transport would.
                            let mut b = bytes::BytesMut::new();
                            encode(&message, &mut b).unwrap();
                            self.network.push_back((name.clone(), to, b.freeze()));
                        }
                        NodeOutput::PeerAdded { name: peer, cluster_addr } => {
                            self.peers_added.push((name.clone(), peer, cluster_addr));
                        }
                        NodeOutput::PeerRemoved { name: peer } => self.peers_removed.push((name.clone(), peer)),
                        NodeOutput::PeerRefused { name: peer, why } => self.refusals.push((name.clone(), peer, why)),
                        NodeOutput::ReplicaRejoin { what, .. } => self.rejoin_notes.push((name.clone(), what)),
                        NodeOutput::PersistRaft { entries, hard_state } => {
                            self.kept.entry(name.clone()).or_default().persist(&entries, hard_state.as_ref());
                        }
                        NodeOutput::PersistRaftSnapshot { snapshot, .. } => {
                            self.kept.entry(name.clone()).or_default().persist_snapshot(&snapshot);
                        }
                        NodeOutput::PersistReplica { shard, entries, hard_state } => {
                            if self.failing_disks.contains(name) {
                                node.handle_replica_persist_failed(&shard, "No space left on device", self.now);
                                continue;
                            }
                            let k = self.kept_replicas.entry(name.clone()).or_default();
                            k.entry(shard).or_default().persist(&entries, hard_state.as_ref());
                        }
                        NodeOutput::PersistReplicaSnapshot { shard, mut snapshot, rest } => {
                            // Written as the driver writes it, the host's part piece by piece,
                            // and read back.
                            self.largest_encoded_snapshot =
                                self.largest_encoded_snapshot.max(snapshot.get_data().len());
                            if let Some(rest) = rest {
                                snapshot = written_and_read_back(&snapshot, &rest);
                                self.snapshots_with_rest += 1;
                            }
                            if self.failing_disks.contains(name) {
                                node.handle_replica_persist_failed(&shard, "No space left on device", self.now);
                                continue;
                            }
                            let k = self.kept_replicas.entry(name.clone()).or_default();
                            k.entry(shard).or_default().persist_snapshot(&snapshot);
                        }
                        NodeOutput::DropReplica { shard } => {
                            self.kept_replicas.entry(name.clone()).or_default().remove(&shard);
                        }
                        NodeOutput::ReadReplicaLog { shard, token, low, high, max_bytes } => {
                            let kept = self.kept_replicas.get(name.as_str()).and_then(|k| k.get(&shard));
                            let entries = kept.map(|l| l.read(low, high, max_bytes)).unwrap_or_default();
                            self.replica_reads += 1;
                            node.handle_replica_log_read(token, Ok(entries), self.now);
                        }
                        NodeOutput::ReadReplicaSnapshotPiece { shard, token, index, offset, len, verify } => {
                            // Read from the snapshot's record as written to disk, as the driver
                            // reads it: the piece alone.
                            use felix_proto::cluster::meta::{encode_snapshot_record, read_snapshot_record_piece};
                            let kept = self.kept_replicas.get(name.as_str()).and_then(|k| k.get(&shard));
                            let read = match kept.and_then(|l| l.snapshot.as_ref()) {
                                Some(_) if self.failing_snapshot_reads || self.failing_reads_on.contains(name) => {
                                    Err("replicas/t1-ledger.log, byte 4096: not an intact snapshot record".to_owned())
                                }
                                Some(snap) => {
                                    let record = encode_snapshot_record(snap);
                                    let mut read_at = |pos: u64, buf: &mut [u8]| {
                                        let at = pos as usize;
                                        buf.copy_from_slice(&record[at..at + buf.len()]);
                                        Ok(())
                                    };
                                    read_snapshot_record_piece(
                                        &mut read_at,
                                        record.len() as u64,
                                        index,
                                        offset,
                                        len,
                                        verify,
                                    )
                                    .map_err(|e| e.to_string())
                                }
                                None => Err("none kept".to_owned()),
                            };
                            self.snapshot_reads += 1;
                            self.largest_snapshot_piece = self.largest_snapshot_piece.max(len);
                            node.handle_replica_snapshot_piece(token, read, self.now);
                        }
                    }
                }
            }
            while let Some((from, to, bytes)) = self.network.pop_front() {
                moved = true;
                if self.cut.contains(&from) != self.cut.contains(&to) {
                    continue;
                }
                let mut d = PeerDecoder::default();
                d.push(&bytes);
                let m = d.next_message().unwrap().unwrap();
                if let Some(n) = self.nodes.get_mut(&to) {
                    n.handle_peer(&from, m, now_of(&self.rates, &to, self.now));
                }
            }
            if !moved {
                return;
            }
        }
    }

    fn tick(&mut self) {
        self.now += TICK;
        for (name, n) in self.nodes.iter_mut() {
            n.handle_timeout(now_of(&self.rates, name, self.now));
        }
        self.settle();
    }

    fn until(&mut self, what: &str, done: impl Fn(&Cluster) -> bool) {
        for _ in 0..300 {
            if done(self) {
                return;
            }
            self.tick();
        }
        panic!("not within 30 s of cluster time: {what}");
    }

    /// Once every broker joined: creates a stream or cache (`replication` 0 or 1: not
    /// replicated) through the metadata group, and waits until every broker knows it.
    fn create(&mut self, kind: Kind, name: &str, shards: u32, replication: u32) {
        self.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == c.nodes.len()));
        let create = Command::Create {
            kind,
            tenant: "t1".into(),
            namespace: "default".into(),
            name: name.into(),
            shards,
            ephemeral: false,
            replication,
        };
        let now = self.now;
        self.nodes.get_mut("n1").unwrap().propose(&create, now);
        self.settle();
        self.until("every broker knows it", |c| {
            c.nodes.values().all(|n| n.metadata().shard_count(kind, "t1", "default", name) == Some(shards))
        });
    }

    /// A raw client on `node`: an authenticated control stream.
    fn client(&mut self, node: &str, flags: u16, index: u64) -> (ConnId, StreamId) {
        let n = self.nodes.get_mut(node).unwrap();
        let now = now_of(&self.rates, node, self.now);
        let conn = n.inputs().admit(PeerAddr([index as u8; 16]), now).unwrap();
        let stream = StreamId::new(Side::Client, Dir::Bi, index);
        n.inputs().handle_stream_data(conn, stream, auth(Some(flags), None, None), false, now);
        self.settle();
        self.received.remove(&(node.to_string(), conn, stream));
        (conn, stream)
    }

    /// A client whose hello offers `features` besides `flags`.
    fn client_with(&mut self, node: &str, flags: u16, features: u32, index: u64) -> (ConnId, StreamId) {
        let n = self.nodes.get_mut(node).unwrap();
        let now = now_of(&self.rates, node, self.now);
        let conn = n.inputs().admit(PeerAddr([index as u8; 16]), now).unwrap();
        let stream = StreamId::new(Side::Client, Dir::Bi, index);
        n.inputs().handle_stream_data(conn, stream, auth(Some(flags), Some(features), None), false, now);
        self.settle();
        self.received.remove(&(node.to_string(), conn, stream));
        (conn, stream)
    }

    /// What a connection's event streams on `node` carried: each event's offset and payload,
    /// and a final `shard_moved`.
    fn stream_events(&mut self, node: &str, conn: ConnId) -> (Vec<(u64, String)>, Option<message::ShardMoved>) {
        let keys: Vec<_> = self
            .received
            .keys()
            .filter(|(n, cn, s)| n == node && *cn == conn && s.dir() == Dir::Uni)
            .cloned()
            .collect();
        let (mut events, mut moved) = (Vec::new(), None);
        for k in keys {
            let bytes = self.received.remove(&k).unwrap();
            let ps = payloads(&bytes);
            for b in event_batches(&ps) {
                let base = b.base_offset.unwrap();
                for (i, r) in b.records.iter().enumerate() {
                    events.push((base + i as u64, String::from_utf8_lossy(&r.payload).into_owned()));
                }
            }
            for p in ps {
                if let felix_proto::Payload::Json(felix_proto::Decoded::Message(Message::ShardMoved(m))) = p {
                    moved = Some(m);
                }
            }
        }
        (events, moved)
    }

    fn send(&mut self, node: &str, conn: ConnId, stream: StreamId, data: Bytes) {
        let now = now_of(&self.rates, node, self.now);
        self.nodes.get_mut(node).unwrap().inputs().handle_stream_data(conn, stream, data, false, now);
        self.settle();
    }

    fn take(&mut self, node: &str, conn: ConnId, stream: StreamId) -> Vec<u8> {
        self.received.remove(&(node.to_string(), conn, stream)).unwrap_or_default()
    }
}

const NAMES: [&str; 3] = ["n1", "n2", "n3"];

/// Broker `name`'s clock when the cluster's is `now`: its own rate from when one was set.
fn now_of(rates: &BTreeMap<String, (Instant, f64)>, name: &str, now: Instant) -> Instant {
    match rates.get(name) {
        Some((since, rate)) => *since + now.saturating_duration_since(*since).mul_f64(*rate),
        None => now,
    }
}

fn owner(c: &Cluster, shard: u32) -> String {
    c.nodes["n1"]
        .metadata()
        .owner(&ShardId {
            kind: Kind::Stream,
            tenant: "t1".into(),
            namespace: "default".into(),
            name: "orders".into(),
            shard,
        })
        .unwrap()
        .owner
        .clone()
}
