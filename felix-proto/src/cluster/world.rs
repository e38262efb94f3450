//! A deterministic simulation of a whole cluster: N brokers ([`ClusterNode`]s, each a
//! [`Broker`] and a member of the metadata group) and clients, on a network that loses, delays
//! (so reorders) and partitions the brokers' messages, with brokers that crash and restart from
//! the Raft log they kept (everything else they held is gone). Everything is drawn from one
//! seed, so a failure replays exactly ([`run`]; `felix-node sim --cluster --clients`).
//!
//! Clients open connections to random live brokers and send keyed, acknowledged publishes (to
//! a durable and an in-memory stream, through whichever broker: non-owners forward), cache puts
//! and gets (non-owners forward them to the cache's owner) and subscribes to one shard
//! (owner-only: non-owners redirect), as legacy clients and as clients that offered the
//! redirect feature and the owner section.
//!
//! Checked as the run goes:
//! * **one owner per generation**: for every shard and generation, every broker that saw it
//!   names the same owner, across crashes;
//! * **generations only grow** within one life of a broker;
//! * **only the owner writes**: a broker persists records of a shard only while its own view
//!   says it owns it (or that the shard is moving to it: the copy), and a broker answers
//!   `subscribed` to a shard only while it owns it;
//! * **every request answered**: every request on a live connection gets an answer (the ack,
//!   `subscribed`, `not_leader`, `shard_unavailable`, `unacknowledged`) within
//!   [`FORWARD_TIMEOUT`] and a little: never a hang, never a silent drop. A request whose
//!   broker crashed is answered by the lost connection;
//! * **only expected refusals**: no other error code comes back;
//! * **moves keep records**: operators move durable shards, cancel moves and rebalance
//!   throughout (each broker's disk survives its crashes); every record a broker holds
//!   committed at an offset is the one ever held there (the new owner's copy included), every
//!   move finishes once healed, the final owner holds every acknowledged record at the offset
//!   its ack named (what retention kept), and no broker serves a reader of a shard it does
//!   not own;
//! * **followers see everything once**: a subscriber per durable shard (real client state
//!   machines, some legacy) follows it through moves, fail-overs and crashes, and is given
//!   every committed record once, in order, catching up on the final owner ([`follow`]);
//! * **progress**: once the faults stop (links healed, every broker back), a publish through
//!   every broker to every shard is acknowledged `ok`, and a cache put and get through every
//!   broker are answered by the cache's owner.

use super::metadata::{Command, Kind, Member, MemberState, ShardId};
use super::node::{ClusterNode, NodeOutput, TICK};
use super::peer::{PeerDecoder, encode};
use crate::binary::{AckMode, AckStatus, AckedPrefix, PublishBatch, Records};
use crate::broker::{
    Broker, BrokerConfig, BrokerOutput, PeerAddr, StorageOutput, TokenGrant, TransportOutput, WriteOutcome,
};
use crate::features::Features;
use crate::frame::FrameDecoder;
use crate::message::{self, Decoded, Message, StartPosition};
use crate::transport::{ConnId, Dir, Side, StreamId, WallClock};
use crate::{ErrorCode, Payload};
use bytes::{Bytes, BytesMut};
use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use super::sim::Rng;
pub use super::sim::Violation;

mod follow;
use follow::Follower;
// What the world is checked against: the history, the metadata, the caches, the durable stream.
mod checks;
// The simulated clients: what they ask, and how they read the answers.
mod clients;
// How the brokers' outputs are carried out: the network, the disks.
mod outputs;
mod report;
pub use report::WorldReport;

/// How long a forwarding broker waits for the owner's answer (the broker's own constant).
pub const FORWARD_TIMEOUT: Duration = crate::broker::FORWARD_TIMEOUT;

/// A request must be answered within this (cluster time) after it was sent.
const ANSWER_WITHIN: Duration = Duration::from_secs(13);

const TOKEN: &str = "sim-token";
const TENANT: &str = "t1";
const NS: &str = "default";
/// (stream, shards, kept in memory only, replicas). `fleet` puts hundreds of shards on every
/// seed's brokers: placement, ownership and the progress check over many shards at once.
const STREAMS: [(&str, u32, bool, u32); 4] =
    [("orders", 6, false, 1), ("ticks", 4, true, 1), ("ledger", 2, false, 3), ("fleet", 200, true, 1)];
/// The replicated stream: every shard a Raft group of three brokers.
const LEDGER: &str = "ledger";
/// The cache every client uses (one shard, owned by one broker).
const CACHE: &str = "sessions";
/// The replicated cache: a Raft group of three brokers; its puts carry unique values.
const QCACHE: &str = "leases";
/// Keys of the replicated cache.
const QKEYS: u64 = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ask {
    Publish,
    Subscribe,
    /// A cache put (forwarded by non-owners).
    CachePut,
    /// A cache get (forwarded by non-owners).
    CacheGet,
    /// A commit to the replicated stream: its event, and a put to its state (owner-only).
    Commit,
    /// An add of one to a counter of the replicated cache (forwarded by non-owners), in the
    /// seeds [`World::counts`] picks.
    CounterAdd,
    /// A poll of the replicated stream's consumer group (leader-only: others redirect), in
    /// the seeds [`World::consumes`] picks.
    GroupPoll,
    /// An ack of a record the group handed out (leader-only), in the same seeds.
    GroupAck,
}

/// The consumer group the world's clients poll the replicated stream with.
const GROUP: &str = "g";

/// Adds to one counter of the replicated cache: how many were sent, and the sum each
/// acknowledged one was answered with.
#[derive(Debug, Default)]
struct Counted {
    sent: u64,
    sums: Vec<i64>,
}

/// Writes of unique values to keys, by value: the key, when sent, when acknowledged.
type Puts = BTreeMap<Bytes, (String, Instant, Option<Instant>)>;

/// A request in flight: on which broker, connection and stream, since when.
struct Pending {
    node: String,
    conn: ConnId,
    ask: Ask,
    shard: ShardId,
    sent: Instant,
    /// Must be answered `ok` (the calm phase's progress check).
    must_succeed: bool,
    bytes: BytesMut,
    /// The auth answer was read.
    authed: bool,
}

struct World {
    seed: u64,
    now: Instant,
    names: Vec<String>,
    nodes: BTreeMap<String, ClusterNode>,
    kept: BTreeMap<String, crate::cluster::meta::RaftLog>,
    /// Per broker, what it kept of its replicas' Raft state.
    kept_replicas: BTreeMap<String, BTreeMap<ShardId, crate::cluster::meta::RaftLog>>,
    /// The replicated stream's history as any broker ever held it committed: offset → record
    /// (a generation start as an empty one). Two brokers, or one broker at two times, holding
    /// different records at one offset is a lost or rewritten record.
    history: BTreeMap<(ShardId, u64), Bytes>,
    /// Per (broker, shard): offsets below this were checked against `history` (this life).
    checked: BTreeMap<(String, ShardId), u64>,
    /// Per broker: its metadata's change count when [`World::check_metadata`] last looked
    /// (this life): an unchanged view is not walked again.
    meta_checked: BTreeMap<String, u64>,
    /// Payloads of acknowledged publishes to the replicated stream.
    quorum_acked: BTreeMap<Bytes, ShardId>,
    /// Payloads of the replicated stream's publishes in flight, by connection.
    quorum_payloads: BTreeMap<(String, ConnId), Bytes>,
    /// Every put to the replicated cache, by its (unique) value: key, sent, acknowledged.
    qputs: Puts,
    /// The same for the single-replica cache.
    cache_puts: Puts,
    /// The same for the replicated stream's commits, by shard: the state key each put.
    commits: BTreeMap<u32, Puts>,
    /// Adds to the replicated cache's counters, by counter.
    counters: BTreeMap<String, Counted>,
    /// The counter of each add in flight, by connection.
    adding: BTreeMap<(String, ConnId), String>,
    /// Records of the replicated stream its group handed out and no ack of which was answered
    /// yet: (shard, offset) → the payload.
    handed: BTreeMap<(u32, u64), Bytes>,
    /// Acks of the group answered `ok`: (shard, offset) → when. A poll sent after that never
    /// hands the record out again.
    group_acked: BTreeMap<(u32, u64), Instant>,
    /// The (shard, offset) of each group ack in flight, by connection.
    acking: BTreeMap<(String, ConnId), (u32, u64)>,
    /// Every record the group handed out: (shard, offset, payload).
    handed_log: Vec<(u32, u64, Bytes)>,
    /// Crashed brokers and when they come back.
    down: BTreeMap<String, Instant>,
    /// In flight between brokers: (deliver at, from, to, bytes).
    network: Vec<(Instant, String, String, Bytes)>,
    /// Brokers cut off from the others.
    cut: BTreeSet<String>,
    /// Every owner seen, by shard and generation.
    owners: BTreeMap<(ShardId, u64), String>,
    /// Per broker life: the last generation seen per shard.
    generations: BTreeMap<String, BTreeMap<ShardId, u64>>,
    pending: BTreeMap<(String, ConnId), Pending>,
    /// Event-stream ids handed out per connection.
    next_uni: u64,
    /// Per broker, what its disk holds of the durable stream (kept across its crashes).
    disks: BTreeMap<String, BTreeMap<u32, BTreeMap<u64, crate::storage::StoredBatch>>>,
    /// Acknowledged publishes to the durable stream: (shard, offset, payload).
    durable_acked: Vec<(u32, u64, Bytes)>,
    /// The durable stream's owners as last seen (moves counted).
    last_owner: BTreeMap<u32, String>,
    /// The replicated stream's replica sets as last seen (replica moves counted).
    last_group: BTreeMap<u32, Vec<String>>,
    /// Subscribers that follow the durable stream's shards.
    followers: Vec<Follower>,
    report: WorldReport,
}

/// The durable (single-replica) stream: its shards move with their records.
const ORDERS: &str = "orders";

/// Records each stream shard retains.
const RETAINED: u64 = 8;
/// Entry bytes between a replica's checkpoints.
const CHECKPOINT_BYTES: u64 = 150;

fn member(name: &str, i: usize) -> Member {
    Member {
        id: name.to_owned(),
        client_addr: format!("10.0.0.{}:5000", i + 1),
        cluster_addr: format!("10.0.0.{}:7000", i + 1),
        state: MemberState::Active,
        incarnation: String::new(),
    }
}

fn broker(now: Instant, history_reads: bool) -> Broker {
    let mut cfg = BrokerConfig { tokens: vec![TokenGrant::dev(TOKEN)], clustered: true, ..BrokerConfig::default() };
    // In half the seeds the broker reads back what it kept, as `serve` with a data directory
    // does: replicas keep their last snapshot on disk only, read back for a replica behind.
    cfg.history_reads = history_reads;
    // Streams retain few records, so replicas compact their logs within a run (and a
    // replica that was down is sent a snapshot).
    cfg.default_stream.retention.max_records = Some(RETAINED);
    Broker::new(cfg, WallClock::new(now, 1_700_000_000_000_000))
}

impl World {
    /// Whether this seed's brokers read back what they kept, as `serve` with a data directory
    /// does (half the seeds): their replicas keep their last snapshot on disk only, and they
    /// offer what needs storage (commits among it).
    fn history_reads(&self) -> bool {
        self.seed % 4 >= 2
    }

    /// Whether this seed's clients add to the replicated cache's counters: where brokers offer
    /// counters (those with history reads), in two seeds of five, those whose residues none of
    /// the kept seeds (`seeds_that_once_failed`) has, so that each kept seed still runs as it
    /// failed.
    fn counts(&self) -> bool {
        self.history_reads() && matches!(self.seed % 5, 1 | 2)
    }

    /// Whether this seed's clients consume the replicated stream through a consumer group:
    /// where brokers offer groups (those with history reads), in two seeds of five, again
    /// residues none of the kept seeds has.
    fn consumes(&self) -> bool {
        self.history_reads() && matches!(self.seed % 5, 2 | 4)
    }
}

fn shard_id(stream: &str, shard: u32) -> ShardId {
    ShardId { kind: Kind::Stream, tenant: TENANT.into(), namespace: NS.into(), name: stream.into(), shard }
}

fn encode_json(m: &Message, out: &mut BytesMut) {
    // Our own messages always encode.
    let _ = m.encode(out);
}

/// Applied metadata entries past the last snapshot that make a broker take one, here.
const META_SNAPSHOT_ENTRIES: u64 = 40;

impl World {
    fn violation(&self, what: String) -> Violation {
        let step = self.report.requests;
        Violation { seed: self.seed, step, what }
    }

    fn mix(&mut self, v: u64) {
        self.report.digest = (self.report.digest ^ v).wrapping_mul(0x0100_0000_01B3);
    }

    fn start(&mut self, name: &str) -> Result<(), Violation> {
        let i = self.names.iter().position(|n| n == name).unwrap_or(0);
        let kept = self.kept.get(name).cloned().unwrap_or_default();
        // What its disk holds of the durable stream comes back, as a driver recovers it.
        let mut b = broker(self.now, self.history_reads());
        let shards = STREAMS.iter().find(|s| s.0 == ORDERS).map_or(1, |s| s.1);
        for (shard, batches) in self.disks.get(name).into_iter().flatten() {
            if batches.is_empty() {
                continue;
            }
            let r = crate::storage::RecoveredShard {
                tenant_id: TENANT.into(),
                namespace: NS.into(),
                stream: ORDERS.into(),
                shard: *shard,
                stream_shards: shards,
                summaries: Vec::new(),
                batches: batches.values().cloned().collect(),
                state_batches: Vec::new(),
                repairs: Vec::new(),
                producer_watermarks: Vec::new(),
                state_checkpoint: None,
            };
            b.restore(r, self.now);
        }
        let mut node = ClusterNode::new(b, member(name, i), &self.names, &kept, self.now)
            .map_err(|e| self.violation(format!("{name} does not restart from its kept log: {e}")))?;
        // In two seeds of three a restart leaves the committed front of each replica's log on
        // disk, as the driver's fold does with a long log: all of it, or all but the newest
        // few entries. The replica replays it in reads answered from the whole kept log.
        let keep = match self.seed % 3 {
            0 => None,
            1 => Some(0),
            _ => Some(600),
        };
        let mut replicas = self.kept_replicas.get(name).cloned().unwrap_or_default();
        if let Some(keep) = keep {
            for log in replicas.values_mut() {
                log.spill_committed(keep);
                self.report.replayed += log.spill.as_ref().map_or(0, |s| s.end() - s.first());
            }
        }
        let in_pieces = self.history_reads() && self.seed % 8 >= 6;
        if in_pieces {
            // Its kept snapshots' host states are left on disk and read back from there a
            // few bytes at a time, as `serve`'s fold leaves a large one.
            for log in replicas.values_mut() {
                ClusterNode::leave_kept_state_on_disk(log, 0);
            }
        }
        node.set_kept_replicas(replicas);
        node.set_replica_checkpoint_bytes(CHECKPOINT_BYTES);
        // The metadata log is compacted every few dozen entries, so restarts restore from a
        // kept snapshot and brokers cut off are sent one (D62).
        node.set_meta_snapshot_entries(Some(META_SNAPSHOT_ENTRIES));
        if self.seed % 2 == 1 {
            node.set_snapshot_chunk_bytes(24);
        }
        if in_pieces {
            // A follower reads back every state of a snapshot it installed from the copy on
            // disk, a few bytes at a time (pieces cut through every item of the state), as
            // one installing a large state does.
            node.set_restore_in_pieces(0, 1 + self.seed / 8 % 40);
        }
        // In one seed of three the first broker plays an older version (see the hellos below).
        if self.seed.is_multiple_of(3) && self.names.first().is_some_and(|f| f == name) {
            node.set_offered_features(0);
        }
        self.nodes.insert(name.to_owned(), node);
        // New connections both ways, each opened by a hello saying what its broker reads (in
        // one seed of three the first broker is an older one: no coalesced heartbeats).
        let hello = |from: &str, seed: u64, names: &[String]| super::peer::PeerMessage::Hello {
            cluster: String::new(),
            node_id: from.to_owned(),
            secret: String::new(),
            incarnation: String::new(),
            features: if seed.is_multiple_of(3) && names.first().is_some_and(|f| f == from) {
                0
            } else {
                super::peer::PEER_FEATURES
            },
        };
        let others: Vec<String> = self.nodes.keys().filter(|n| *n != name).cloned().collect();
        for o in others {
            let (to_me, to_them) = (hello(&o, self.seed, &self.names), hello(name, self.seed, &self.names));
            let now = self.now;
            if let Some(n) = self.nodes.get_mut(name) {
                n.handle_peer(&o, to_me, now);
            }
            if let Some(n) = self.nodes.get_mut(&o) {
                n.handle_peer(name, to_them, now);
            }
        }
        self.checked.retain(|(n, _), _| n != name);
        self.meta_checked.remove(name);
        self.generations.insert(name.to_owned(), BTreeMap::new());
        Ok(())
    }

    /// Adds what `node`'s restores from disk did to the report (it crashed, or the run ended).
    fn count_restores(&mut self, node: &ClusterNode) {
        let counts = node.restore_counts();
        self.report.restores_from_disk += counts.finished;
        self.report.restores_at_restart += counts.at_restart;
    }

    fn crash(&mut self, name: &str, back_at: Instant) {
        let Some(node) = self.nodes.remove(name) else { return };
        self.count_restores(&node);
        self.report.crashes += 1;
        self.down.insert(name.to_owned(), back_at);
        self.follower_lost(name, None, "the broker crashed");
        let lost: Vec<_> = self.pending.keys().filter(|(n, _)| n == name).cloned().collect();
        for k in lost {
            self.pending.remove(&k);
            self.quorum_payloads.remove(&k);
            self.acking.remove(&k);
            self.report.lost_with_broker += 1;
        }
    }

    /// Carries out every broker's outputs and delivers what is due, until quiet.
    fn settle(&mut self, rng: &mut Rng, faults: bool) -> Result<(), Violation> {
        loop {
            let mut moved = false;
            let names: Vec<String> = self.nodes.keys().cloned().collect();
            for name in &names {
                moved |= self.drain(name, rng, faults)?;
            }
            let now = self.now;
            let (due, later): (Vec<_>, Vec<_>) =
                std::mem::take(&mut self.network).into_iter().partition(|m| m.0 <= now);
            self.network = later;
            for (_, from, to, bytes) in due {
                moved = true;
                let mut d = PeerDecoder::default();
                d.push_chunk(bytes);
                let m = match d.next_message() {
                    Ok(Some(m)) => m,
                    other => return Err(self.violation(format!("a peer message did not decode: {other:?}"))),
                };
                if let Some(n) = self.nodes.get_mut(&to) {
                    n.handle_peer(&from, m, now);
                    // Its outputs before its next input, as the drivers do: a write it asks for
                    // is judged against the view it had when it asked.
                    self.drain(&to, rng, faults)?;
                }
            }
            moved |= self.pump_followers(rng)?;
            self.check_metadata()?;
            if !moved {
                return Ok(());
            }
        }
    }

    /// Carries out everything broker `name` asks for; whether it asked for anything.
    fn drain(&mut self, name: &str, rng: &mut Rng, faults: bool) -> Result<bool, Violation> {
        let mut any = false;
        while let Some(o) = self.nodes.get_mut(name).and_then(ClusterNode::poll_output) {
            any = true;
            self.output(name, o, rng, faults)?;
        }
        Ok(any)
    }

    fn tick(&mut self, rng: &mut Rng, faults: bool) -> Result<(), Violation> {
        self.now += TICK;
        let now = self.now;
        let back: Vec<String> = self.down.iter().filter(|(_, t)| **t <= now).map(|(n, _)| n.clone()).collect();
        for n in back {
            self.down.remove(&n);
            self.start(&n)?;
        }
        for n in self.nodes.values_mut() {
            n.handle_timeout(now);
        }
        self.tick_followers();
        self.settle(rng, faults)?;
        self.check_history()?;
        self.check_followers()?;
        // Owner changes of the durable stream's shards (moves with a copy), and replica set
        // changes of the replicated one's, as one broker sees.
        if let Some(node) = self.nodes.values().next() {
            for (s, r) in node.metadata().replicated_shards() {
                if s.name == LEDGER
                    && let Some(was) = self.last_group.insert(s.shard, r.to_vec())
                    && was != r
                {
                    self.report.replica_moves += 1;
                }
            }
            for (s, a) in node.metadata().owners() {
                if s.name == ORDERS
                    && let Some(was) = self.last_owner.insert(s.shard, a.owner.clone())
                    && was != a.owner
                {
                    self.report.moves_done += 1;
                }
            }
        }
        let late: Vec<String> = self
            .pending
            .values()
            .filter(|p| now.saturating_duration_since(p.sent) > ANSWER_WITHIN)
            .map(|p| format!("{} on {} ({:?} {:?})", p.conn.0, p.node, p.ask, p.shard))
            .collect();
        if let Some(l) = late.first() {
            return Err(self.violation(format!("unanswered after {ANSWER_WITHIN:?}: {l}")));
        }
        Ok(())
    }
}

/// Runs one seed: `fault_ticks` of faults and traffic, then healing and the progress check.
///
/// # Errors
/// The first [`Violation`] met.
pub fn run(seed: u64, epoch: Instant, fault_ticks: u32) -> Result<WorldReport, Violation> {
    let mut rng = Rng(seed ^ 0x5EED_C1A5_7E55);
    let n = 3 + 2 * (seed % 3) as usize;
    let names: Vec<String> = (1..=n).map(|i| format!("n{i}")).collect();
    let mut w = World {
        seed,
        now: epoch,
        names: names.clone(),
        nodes: BTreeMap::new(),
        kept: BTreeMap::new(),
        kept_replicas: BTreeMap::new(),
        history: BTreeMap::new(),
        checked: BTreeMap::new(),
        meta_checked: BTreeMap::new(),
        quorum_acked: BTreeMap::new(),
        quorum_payloads: BTreeMap::new(),
        qputs: BTreeMap::new(),
        cache_puts: BTreeMap::new(),
        commits: BTreeMap::new(),
        counters: BTreeMap::new(),
        adding: BTreeMap::new(),
        handed: BTreeMap::new(),
        group_acked: BTreeMap::new(),
        acking: BTreeMap::new(),
        handed_log: Vec::new(),
        down: BTreeMap::new(),
        network: Vec::new(),
        cut: BTreeSet::new(),
        owners: BTreeMap::new(),
        generations: BTreeMap::new(),
        pending: BTreeMap::new(),
        next_uni: 0,
        disks: BTreeMap::new(),
        durable_acked: Vec::new(),
        last_owner: BTreeMap::new(),
        last_group: BTreeMap::new(),
        followers: Vec::new(),
        report: WorldReport { nodes: n, digest: seed, ..WorldReport::default() },
    };
    for name in &names {
        w.start(name)?;
    }
    // Formation: every broker joins and the streams are created, on a quiet network.
    let formed = |w: &World| {
        w.nodes.values().all(|node| {
            node.metadata().members().len() == n
                && STREAMS.iter().all(|(s, _, _, _)| node.metadata().shard_count(Kind::Stream, TENANT, NS, s).is_some())
                && node.metadata().shard_count(Kind::Cache, TENANT, NS, CACHE).is_some()
                && node.metadata().shard_count(Kind::Cache, TENANT, NS, QCACHE).is_some()
        })
    };
    for i in 0..200 {
        if formed(&w) {
            break;
        }
        if i % 20 == 5 {
            let first = names[0].clone();
            let now = w.now;
            for (name, shards, ephemeral, replication) in STREAMS {
                let c = Command::Create {
                    kind: Kind::Stream,
                    tenant: TENANT.into(),
                    namespace: NS.into(),
                    name: name.into(),
                    shards,
                    ephemeral,
                    replication,
                };
                if let Some(node) = w.nodes.get_mut(&first) {
                    node.propose(&c, now);
                }
            }
            let c = Command::Create {
                kind: Kind::Cache,
                tenant: TENANT.into(),
                namespace: NS.into(),
                name: CACHE.into(),
                shards: 1,
                ephemeral: false,
                replication: 0,
            };
            if let Some(node) = w.nodes.get_mut(&first) {
                node.propose(&c, now);
            }
            let c = Command::Create {
                kind: Kind::Cache,
                tenant: TENANT.into(),
                namespace: NS.into(),
                name: QCACHE.into(),
                shards: 1,
                ephemeral: false,
                replication: 3,
            };
            if let Some(node) = w.nodes.get_mut(&first) {
                node.propose(&c, now);
            }
        }
        w.tick(&mut rng, false)?;
    }
    if !formed(&w) {
        return Err(w.violation("the cluster did not form on a quiet network".into()));
    }
    // A subscriber follows every shard of the durable stream from its start; every third is a
    // legacy client.
    for shard in 0..STREAMS.iter().find(|s| s.0 == ORDERS).map_or(0, |s| s.1) {
        w.followers.push(Follower::new(shard, shard % 3 == 2, w.now));
    }
    // Faults and traffic.
    for _ in 0..fault_ticks {
        match rng.below(1000) {
            0..=7 => {
                let victim = names[rng.below(n as u64) as usize].clone();
                let back = w.now + TICK * (10 + rng.below(140)) as u32;
                w.crash(&victim, back);
            }
            8..=12 => {
                let cut = names[rng.below(n as u64) as usize].clone();
                w.cut.insert(cut);
            }
            13..=30 => w.cut.clear(),
            // An operator moves a durable shard, gives a move up, or rebalances.
            31..=40 => {
                let live: Vec<String> = w.nodes.keys().cloned().collect();
                if !live.is_empty() {
                    let via = live[rng.below(live.len() as u64) as usize].clone();
                    let to = names[rng.below(n as u64) as usize].clone();
                    let shards = STREAMS.iter().find(|s| s.0 == ORDERS).map_or(1, |s| s.1);
                    let mut shard = shard_id(ORDERS, rng.below(u64::from(shards)) as u32);
                    if rng.chance(200) {
                        // The replicated stream: its leadership moves to the replica named (a
                        // broker outside its group is refused).
                        let shards = STREAMS.iter().find(|s| s.0 == LEDGER).map_or(1, |s| s.1);
                        shard = shard_id(LEDGER, rng.below(u64::from(shards)) as u32);
                    } else if rng.chance(250) {
                        // The single-replica cache: copied too.
                        shard = ShardId {
                            kind: Kind::Cache,
                            tenant: TENANT.into(),
                            namespace: NS.into(),
                            name: CACHE.into(),
                            shard: 0,
                        };
                    }
                    let c = match rng.below(10) {
                        0..=6 if shard.name == LEDGER && rng.chance(500) => {
                            // One broker's replica of it, a follower's or the leader's, to
                            // another (refused when that one holds a replica already, or the
                            // first holds none): replica balancing's move (D61).
                            let from = names[rng.below(n as u64) as usize].clone();
                            w.report.follower_moves_asked += 1;
                            Command::MoveReplica { shard, from, to }
                        }
                        0..=6 => Command::MoveShard { shard, to },
                        7 | 8 => Command::CancelMove { shard },
                        _ => Command::Rebalance,
                    };
                    let now = w.now;
                    w.report.moves_asked += 1;
                    if let Some(node) = w.nodes.get_mut(&via) {
                        node.propose(&c, now);
                    }
                }
            }
            _ => {}
        }
        for _ in 0..rng.below(3) {
            let live: Vec<String> = w.nodes.keys().cloned().collect();
            if live.is_empty() {
                break;
            }
            let at = live[rng.below(live.len() as u64) as usize].clone();
            let (stream, shards, _, _) = STREAMS[rng.below(STREAMS.len() as u64) as usize];
            let shard = rng.below(u64::from(shards)) as u32;
            let (ask, target) = match rng.below(12) {
                0..=5 => (Ask::Publish, (stream, shard)),
                6 | 7 => (Ask::Subscribe, (stream, shard)),
                8 => (Ask::CachePut, (stream, shard)),
                9 => (Ask::CacheGet, (stream, shard)),
                10 => (Ask::CachePut, (QCACHE, rng.below(QKEYS) as u32)),
                _ => (Ask::CacheGet, (QCACHE, rng.below(QKEYS) as u32)),
            };
            let modern = rng.chance(500);
            w.request(&at, ask, target, modern, false, &mut rng);
            w.settle(&mut rng, true)?;
        }
        // In the seeds that consume, the group's own client: it polls the replicated stream
        // where a broker says its shard is led (a stale leader redirects) and acks what it was
        // handed. Draws of its own: no kept seed consumes.
        if w.consumes() && rng.chance(300) {
            let shards = STREAMS.iter().find(|s| s.0 == LEDGER).map_or(1, |s| s.1);
            let shard = rng.below(u64::from(shards)) as u32;
            let id = shard_id(LEDGER, shard);
            let leaders: Vec<String> = w
                .nodes
                .iter()
                .filter(|(_, n)| n.broker.replica_role(&id) == Some(&crate::broker::ReplicaRole::Leading))
                .map(|(name, _)| name.clone())
                .collect();
            let live: Vec<String> = w.nodes.keys().cloned().collect();
            let pool = if leaders.is_empty() { &live } else { &leaders };
            if !pool.is_empty() {
                let at = pool[rng.below(pool.len() as u64) as usize].clone();
                let ask = if rng.chance(600) { Ask::GroupAck } else { Ask::GroupPoll };
                let modern = rng.chance(500);
                w.request(&at, ask, (LEDGER, shard), modern, false, &mut rng);
                w.settle(&mut rng, true)?;
            }
        }
        w.tick(&mut rng, true)?;
    }
    // Heal: links up, every broker back; let leases and joins settle, and what was in flight
    // be answered.
    w.cut.clear();
    let now = w.now;
    for t in w.down.values_mut() {
        *t = now;
    }
    for _ in 0..150 {
        w.tick(&mut rng, false)?;
    }
    let settled = |w: &World| {
        w.nodes.values().all(|node| node.metadata().members().values().all(|m| m.state == MemberState::Active))
    };
    for _ in 0..200 {
        if settled(&w) && w.pending.is_empty() {
            break;
        }
        w.tick(&mut rng, false)?;
    }
    if !settled(&w) {
        return Err(w.violation("healed, but not every broker is active again".into()));
    }
    // Every move finishes (or is given up) once healed.
    for _ in 0..300 {
        if w.nodes.values().all(|node| node.metadata().moves().is_empty()) {
            break;
        }
        w.tick(&mut rng, false)?;
    }
    if let Some((s, m)) = w.nodes.values().flat_map(|node| node.metadata().moves().iter()).next() {
        // What each broker's replica of it says (a replicated shard's move is its group's).
        let groups: Vec<String> = w
            .nodes
            .iter()
            .filter_map(|(n, node)| {
                let (_, leader, term, _) = node.replica_status().into_iter().find(|r| r.0 == *s)?;
                Some(format!("{n}: voters {:?}, leader {leader:?}, term {term}", node.replica_voters(s)?))
            })
            .collect();
        let replicas = w.nodes.values().next().and_then(|n| n.metadata().replicas(s).map(<[String]>::to_vec));
        return Err(w.violation(format!(
            "healed, but the move of {s:?} ({} → {}) did not finish (replicas {replicas:?}; {})",
            m.from,
            m.to,
            groups.join("; ")
        )));
    }
    // Progress: through every broker, to every shard, acked ok.
    for name in &names {
        for (stream, shards, _, _) in STREAMS {
            for shard in 0..shards {
                let modern = rng.chance(500);
                w.request(name, Ask::Publish, (stream, shard), modern, true, &mut rng);
            }
        }
    }
    for name in &names {
        let modern = rng.chance(500);
        w.request(name, Ask::CachePut, ("", 0), modern, true, &mut rng);
        w.request(name, Ask::CacheGet, ("", 0), modern, true, &mut rng);
        w.request(name, Ask::CachePut, (QCACHE, 0), modern, true, &mut rng);
        w.request(name, Ask::CacheGet, (QCACHE, 0), modern, true, &mut rng);
        if w.counts() {
            w.request(name, Ask::CounterAdd, (QCACHE, 0), modern, true, &mut rng);
        }
    }
    w.settle(&mut rng, false)?;
    for _ in 0..50 {
        if w.pending.is_empty() {
            break;
        }
        w.tick(&mut rng, false)?;
    }
    if let Some(p) = w.pending.values().next() {
        return Err(w.violation(format!("healed, but {:?} {:?} on {} is unanswered", p.ask, p.shard, p.node)));
    }
    let first = w.nodes[&names[0]].metadata().clone();
    if let Some(n) = w.nodes.values().find(|n| *n.metadata() != first) {
        return Err(w.violation(format!("{}'s metadata differs after healing", n.node_id())));
    }
    // The replicated stream, healed: every replica holds one and the same history (checked
    // record by record against everything ever committed), and every acknowledged record is
    // in it exactly once.
    w.check_history()?;
    for (shard, replicas) in first.replicated_shards() {
        let ends: Vec<(String, u64)> = replicas
            .iter()
            .filter_map(|r| Some((r.clone(), w.checked.get(&(r.clone(), shard.clone())).copied()?)))
            .collect();
        if let Some((a, b)) = ends.iter().zip(ends.iter().skip(1)).find(|(a, b)| a.1 != b.1) {
            return Err(w.violation(format!(
                "healed, but {shard:?}'s replicas differ: {} holds up to {}, {} up to {}",
                a.0, a.1, b.0, b.1
            )));
        }
    }
    let mut count: BTreeMap<&Bytes, u32> = BTreeMap::new();
    for ((shard, _), p) in &w.history {
        if !p.is_empty() && shard.name == LEDGER {
            *count.entry(p).or_default() += 1;
        }
    }
    if let Some((p, n)) = count.iter().find(|(_, n)| **n > 1) {
        return Err(w.violation(format!("{p:?} was written {n} times to {LEDGER}")));
    }
    if let Some((p, s)) = w.quorum_acked.iter().find(|(p, _)| !count.contains_key(p)) {
        return Err(w.violation(format!("{p:?} was acknowledged on {s:?} and is not in its history")));
    }
    w.check_quorum_cache(&first, &mut rng)?;
    w.check_commit_state(&first)?;
    w.check_group()?;
    w.check_cache(&first)?;
    // Every follower ends on its shard's owner with everything it committed.
    for _ in 0..300 {
        if w.followers_caught_up() {
            break;
        }
        w.tick(&mut rng, false)?;
    }
    if !w.followers_caught_up() {
        return Err(w.violation(format!("healed, but not every follower caught up: {}", w.followers_behind())));
    }
    w.check_durable(&first)?;
    let nodes = std::mem::take(&mut w.nodes);
    for node in nodes.values() {
        w.count_restores(node);
    }
    Ok(w.report)
}
