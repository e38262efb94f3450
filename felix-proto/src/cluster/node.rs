//! A broker of a cluster, sans-IO: its [`Broker`], its member of the metadata Raft group
//! ([`MetaNode`]) and the [`Metadata`] that group replicates, wired together. The driver feeds
//! it client traffic (through [`ClusterNode::broker`]), peer messages and time, and carries out
//! what [`ClusterNode::poll_output`] asks: client-facing duties, messages to peer brokers, and
//! Raft state to make durable before anything after it.
//!
//! What it decides: a broker proposes its own membership when it starts (and again until the
//! group committed it); a follower hands commands to the leader; every committed command is
//! applied to the metadata and the broker's view of the cluster ([`Broker::apply_cluster`]);
//! publishes the broker forwards travel as peer messages.

use super::meta::{MetaError, MetaNode, MetaOutput, RaftLog, decode_message, encode_message};
use super::metadata::ShardId;
use super::metadata::snapshot::MetaSnapshot;
use super::metadata::{Command, Member, MemberState, Metadata};
use super::peer::{
    Beat, FEATURE_BATCH_META, FEATURE_COALESCED_HEARTBEATS, FEATURE_COMMIT_STATE, FEATURE_FORWARD_BATCH,
    FEATURE_META_SNAPSHOTS, FEATURE_REPLICA_MOVES, FEATURE_SNAPSHOT_CHUNKS, PeerMessage, RaftBytes, SnapshotChunk,
};
use super::replica::{Answer, Replica, ReplicaOutput};
use crate::binary::OwnerHint;
use crate::broker::{
    Broker, BrokerOutput, ClusterOutput, ForwardOutcome, ForwardedPublish, Notice, ReplicaRole, StorageOutput,
};
use crate::error_code::{ErrorCode, RetryClass};
use bytes::Bytes;
use raft::eraftpb::{Entry, HardState, Message, MessageType};
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::{Duration, Instant};

// A child of this module (it keeps the node's fields private), in a file of its own.
#[path = "hibernation.rs"]
mod hibernation;
// The replicas this node hosts (one Raft group per replicated shard), likewise.
#[path = "node_admin.rs"]
mod admin;
#[path = "node_meta.rs"]
mod metadata_group;
#[path = "node_replicas.rs"]
mod replicas;
#[path = "node_restore.rs"]
mod restore;
#[path = "node_snapshots.rs"]
mod snapshots;
pub use restore::{MAX_SNAPSHOT_BYTES, RESTORE_GIVE_UP, RESTORE_IN_PIECES_MIN, RESTORE_PIECE_BYTES, RestoreCounts};
// What the node asks its driver to do, and `poll_output`, which hands it out.
#[path = "node_linger.rs"]
mod linger;
#[path = "node_output.rs"]
mod output;
pub use admin::AdminError;
use hibernation::Sleep;
pub use hibernation::{PEER_SILENT_TICKS, QUIET_AFTER_TICKS, QUIET_CONTEXT, SWEEP_PER_TICK};
use linger::counts_as_member;
pub use linger::{LINGER_TICKS, REMOVED_LINGER_TICKS};
pub use output::NodeOutput;
pub use replicas::{MAX_BEATS_PER_MESSAGE, SHARD_RAFT_BATCH_BYTES};
// Messages from peers, and peers lost.
#[path = "node_peers.rs"]
mod peers;

/// How often the Raft group's clock ticks. With [`super::meta::ELECTION_TICKS`] of 10 a
/// follower stands for election after about a second without a leader.
pub const TICK: Duration = Duration::from_millis(100);

/// Ticks between two proposals of this broker's own membership while it is not committed.
const JOIN_RETRY_TICKS: u64 = 10;

/// At most this many replicated shards move at once to balance replicas (each copies its log
/// to its new replica: the throttle that keeps a rebalance from taking the publishers' share of
/// the disks and links).
pub const MAX_BALANCE_MOVES: usize = 4;

/// A leader says in the operator's log that a replica of a shard it leads fell behind when the
/// replica lacks more than this many entries (batches), and that it caught up once it lacks
/// at most [`REPLICA_CAUGHT_UP_ENTRIES`]; the gap between the two keeps a replica that hovers
/// around one bound from filling the log. Checked once a second (`JOIN_RETRY_TICKS`).
pub const REPLICA_BEHIND_ENTRIES: u64 = 256;
/// See [`REPLICA_BEHIND_ENTRIES`].
pub const REPLICA_CAUGHT_UP_ENTRIES: u64 = 16;

/// How long the leader waits without hearing from a member before it declares it down (its
/// in-memory shards then move; its durable ones wait for it). Raft heartbeats run every
/// 300 ms, so a live member is heard about ten times per lease.
pub const LEASE: Duration = Duration::from_secs(3);

/// Without a word from a metadata leader for this long, a broker fences itself (serves none of
/// its own shards): well inside [`LEASE`], after which the leader may declare it down and give
/// its in-memory shards to others, so two brokers never serve one shard. Five heartbeats.
pub const FENCE_AFTER: Duration = Duration::from_millis(1500);

/// How long after it starts a broker's replicas grant no vote nor pre-vote. A broker that
/// restarts forgot which leaders it heard: without the hold it could vote at once for a
/// candidate while a leader it confirmed a moment before its crash still holds a read lease
/// ([`super::replica::READ_LEASE`]) counting on it. One election timeout
/// ([`super::meta::ELECTION_TICKS`] ticks), the time a follower that heard that leader would
/// have waited.
pub const VOTE_HOLD: Duration = Duration::from_secs(1);

/// Keeps the read lease of a replicated cache's leader (or a stream's, while it has consumer
/// groups) fresh: asks its group again when it holds no
/// lease or less than half of one is left. Between ticks only when nothing asked in this term
/// is still waiting; at a tick regardless (a request or its answers can be lost). `true` when
/// it asked.
fn renew_read_lease(replica: &mut Replica, now: Instant, at_tick: bool) -> bool {
    let renew = crate::transport::after(now, super::replica::READ_LEASE / 2);
    let due = replica.is_leader() && replica.read_lease().is_none_or(|until| until <= renew);
    due && (at_tick || !replica.confirming()) && replica.confirm_leadership(now)
}

/// The metadata log is compacted into a snapshot (D62) once it holds this many applied entries
/// beyond the last one: with 10,000 shards a snapshot is under a megabyte, while ten thousand
/// entries (a `Lead` each, as a failed broker's leaderships move) are about as much.
pub const META_SNAPSHOT_ENTRIES: u64 = 10_000;

/// Replicas a broker starts per tick at most (see `sync_replicas`): 2,000 a second.
pub const NEW_REPLICAS_PER_TICK: usize = 200;

/// Entry bytes of a replicated shard's Raft log each replica keeps in memory once applied
/// (with history reads): enough for followers a few seconds behind at full speed; older
/// entries are read back from the log on disk.
pub const REPLICA_ENTRY_CACHE: u64 = 8 << 20;

/// Settled groups a broker hands over to their preferred replica per tick, at most (the
/// newly elected leaders of thousands of groups would otherwise all stand down at once).
pub const PREFERRED_HANDOVERS_PER_TICK: usize = 32;

/// A shard group's snapshot with more data than this goes to peers that read
/// `snapshot_chunk` (kind 14) in chunks of it: a snapshot is never larger than a frame can
/// carry, and no one frame holds the transport for long.
pub const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

/// Bytes queued for other brokers from which a leader holds its reads of entries for
/// followers behind ([`ClusterNode::set_peer_queued`]). The engine sends a follower behind up
/// to 256 appends of 1 MiB without waiting for an answer, each read back from disk: measured,
/// a follower 3M records behind had 83 to 180 MiB queued for it on the leader (+87 to +186 MB
/// RSS). Past this
/// much the link is busy for a while; the next read waits until it drains.
pub const CATCH_UP_QUEUE_LIMIT: u64 = 8 << 20;

/// The longest a leader holds a read for a follower behind while the links stay full: links
/// kept full by the other shards' traffic must not starve a follower's catch-up, which then
/// goes on at a read (up to 1 MiB) per hold.
pub const CATCH_UP_HOLD_MAX: Duration = Duration::from_secs(1);

/// A message for a move's target held back by the move budget.
#[derive(Debug)]
struct HeldMove {
    to: String,
    shard: ShardId,
    message: Message,
    /// The bytes of the move's copy it carries (charged when it goes).
    copy: u64,
    /// Its entries' or snapshot's bytes (what holding it costs).
    size: u64,
}

/// The bytes of a move's copy a message to its target carries: its entries up to `floor`
/// (what the group held when the leader first sent it some), or its whole snapshot. With
/// `u64::MAX`, every byte of log it carries (what holding it costs).
fn copy_bytes(m: &Message, floor: u64) -> u64 {
    let entries: usize = m.entries.iter().filter(|e| e.index <= floor).map(|e| e.data.len() + e.context.len()).sum();
    (entries + m.get_snapshot().get_data().len()) as u64
}

/// Queues `message` (a `MsgSnapshot`) to `to` as `snapshot_chunk`s of `chunk` bytes of data
/// each, the message itself (without the data) in the first; returns how many. The chunks'
/// data are slices of the snapshot's (no copy here).
fn send_snapshot_chunks(
    out: &mut VecDeque<NodeOutput>,
    to: &str,
    shard: &ShardId,
    mut message: Message,
    chunk: usize,
) -> u64 {
    let (index, term) = (message.get_snapshot().get_metadata().index, message.get_snapshot().get_metadata().term);
    let data = message.mut_snapshot().take_data();
    let mut header = Bytes::from(encode_message(&message));
    let mut n = 0;
    let mut offset = 0;
    while offset < data.len() {
        let end = (offset + chunk).min(data.len());
        let c = SnapshotChunk {
            shard: shard.clone(),
            index,
            term,
            total: data.len() as u64,
            offset: offset as u64,
            header: std::mem::take(&mut header),
            data: data.slice(offset..end),
        };
        out.push_back(NodeOutput::Peer { to: to.to_owned(), message: PeerMessage::SnapshotChunk(c) });
        n += 1;
        offset = end;
    }
    n
}

/// Who asked for a read of a replica's log.
#[derive(Debug)]
enum ReplicaRead {
    /// The replica's Raft engine, for a follower behind: the read's first index.
    Raft { shard: ShardId, low: u64 },
    /// The broker, for history below what its log of the shard holds in memory.
    History { shard: ShardId, read: crate::transport::ReadToken },
}

/// A node's Raft id: a stable 63-bit hash of its node id (never 0), the same on every broker,
/// so a broker added later has an id nobody has to hand out.
pub fn raft_id(name: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in name.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    (h & 0x7FFF_FFFF_FFFF_FFFF).max(1)
}

/// On a replica: whether `msg` shows its sender asks to rejoin the group afresh
/// ([`REJOIN_CONTEXT`]: its kept log was damaged, or it found it lost entries it had
/// acknowledged). A sender already told it is back in, who stopped asking, is forgotten.
/// (A rejected append below what the sender had acknowledged is no such sign: the network
/// may deliver an old rejection after newer acceptances.)
fn note_rejoin(h: &mut Hosted, msg: &Message) {
    if msg.context.as_ref() == REJOIN_CONTEXT {
        h.rejoins.entry(msg.from).or_insert(RejoinStep::Remove);
    } else if h.rejoins.get(&msg.from) == Some(&RejoinStep::Readded) {
        h.rejoins.remove(&msg.from);
    }
}

/// On a replica not yet rejoining: whether `msg`, a heartbeat, shows it lost entries it
/// acknowledged, and then (why, what to log). A leader's heartbeat carries its commit only up
/// to what this replica acknowledged holding; one past the end of its log means its disk gave
/// back less than it had (a truncated file, a lazy fsync policy's power cut). It must not vote
/// from that log: it rejoins like a replica whose log was found damaged.
fn lost_acknowledged(h: &Hosted, msg: &Message, rejoining: bool) -> Option<(String, String)> {
    let (last, _) = h.replica.indexes();
    if rejoining || msg.get_msg_type() != MessageType::MsgHeartbeat || msg.commit <= last {
        return None;
    }
    let why = format!(
        "its leader counts it as holding index {} but its log ends at {last}: entries it acknowledged are gone",
        msg.commit
    );
    let what = format!("{why}; it grants no vote and rejoins its group afresh");
    Some((why, what))
}

/// This broker's replica of `shard` rejoins its group afresh (see
/// [`ClusterNode::set_damaged_replicas`]): counted, said, and from now on gated. (Fields, not
/// `&mut ClusterNode`: it is called with one of the node's replicas borrowed.)
fn start_rejoin(
    rejoining: &mut BTreeMap<ShardId, String>,
    counts: &mut RejoinCounts,
    out: &mut VecDeque<NodeOutput>,
    shard: &ShardId,
    why: String,
    what: String,
) {
    counts.damaged += 1;
    out.push_back(NodeOutput::ReplicaRejoin { shard: shard.clone(), what });
    rejoining.insert(shard.clone(), why);
}

/// What a broker did with metadata snapshots (D62), for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MetaSnapshotCounts {
    /// Snapshots this broker took (compacting its metadata log).
    pub taken: u64,
    /// Snapshots it was sent by the leader and restored its metadata from.
    pub received: u64,
    /// Snapshots it was sent and could not read (a newer format).
    pub refused: u64,
    /// Snapshots it did not send, as the metadata leader, to a peer behind its compacted log
    /// that does not read one (an older version).
    pub withheld: u64,
    /// The last snapshot's size, in bytes.
    pub bytes: u64,
}

/// Whether `name` is a usable node id.
pub fn valid_node_id(name: &str) -> bool {
    !name.is_empty() && name.len() <= 64 && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
}

/// A broker of a cluster.
pub struct ClusterNode {
    /// The broker: client connections, logs, caches. Reached from outside through
    /// [`broker`](Self::broker) (to read) and the node's own inputs (to change): everything
    /// that changes it goes through the node, which sees its outputs.
    pub(crate) broker: Broker,
    meta: MetaNode,
    metadata: Metadata,
    /// How many times `metadata` changed in this life ([`ClusterNode::metadata_changes`]).
    metadata_changes: u64,
    me: Member,
    /// Raft id ↔ node id of every voter.
    names: BTreeMap<u64, String>,
    /// The cluster address each voter was added with (`cluster add`), by node id; and the
    /// voters removed: what the metadata log said of the voters besides their names, kept in
    /// a metadata snapshot (D62) with `names` and the metadata.
    voter_addrs: BTreeMap<String, String>,
    removed_voters: BTreeSet<String>,
    /// Applied metadata log entries past the last snapshot that make this broker take one
    /// ([`META_SNAPSHOT_ENTRIES`]; `None`: never).
    meta_snapshot_every: Option<u64>,
    /// Metadata snapshots taken, received (and restored), and refused; the last one's size.
    meta_snapshot_counts: MetaSnapshotCounts,
    /// Peers a metadata snapshot was withheld from (they do not read one), told once each.
    withheld: BTreeSet<String>,
    /// Replicas a shard's snapshot holding commit state was withheld from (their brokers do
    /// not read it, D63), told once each; and how many such snapshots were not sent.
    withheld_shard_snapshots: BTreeSet<(ShardId, String)>,
    shard_snapshots_withheld: u64,
    /// A metadata snapshot was restored and the broker not yet told (see `drain_meta`).
    meta_restored: bool,
    /// Leadership claims (`Lead`) the metadata applied here: how fast a dead broker's shards
    /// get their new owner is the time to apply as many as it led.
    leads_applied: u64,
    out: VecDeque<NodeOutput>,
    next_tick: Option<Instant>,
    ticks: u64,
    /// Commands waiting for a leader to take them.
    pending: VecDeque<Vec<u8>>,
    /// When each peer was last heard from (kept by the leader for leases), and whether this
    /// broker led at the last tick.
    last_seen: BTreeMap<String, Instant>,
    was_leader: bool,
    /// Replica moves proposed to balance replicas (metrics, tests).
    balance_moves: u64,
    /// The metadata's change count when it last proposed some (see `check_replica_balance`).
    balance_proposed_at: Option<u64>,
    /// Members this leader proposed to mark down (not again until their state changes).
    marked: std::collections::BTreeSet<String>,
    /// This broker was removed from the cluster: it proposes nothing any more.
    removed: bool,
    /// Peers refused for an incarnation the cluster does not know (a wiped data directory):
    /// what they send is ignored until the operator removes them.
    refused: std::collections::BTreeSet<String>,
    /// This broker's replicas of replicated shards.
    replicas: BTreeMap<ShardId, Hosted>,
    /// What the driver kept of replicas' Raft state, taken when each replica starts.
    kept_replicas: BTreeMap<ShardId, RaftLog>,
    /// Replicas stopped because their state could not be kept (a failed or full disk), and why:
    /// they take no part until the broker restarts.
    failed_replicas: BTreeMap<ShardId, String>,
    /// Replicas whose kept log was found damaged, and why: each starts empty and rejoins its
    /// group afresh ([`ClusterNode::set_damaged_replicas`]).
    rejoining: BTreeMap<ShardId, String>,
    /// Rejoins started and finished here since the start (for metrics).
    rejoin_counts: RejoinCounts,
    /// Entry bytes between a replica's checkpoints (`None`: the default).
    checkpoint_bytes: Option<u64>,
    /// Entry bytes a replica keeps in memory (`None`: [`REPLICA_ENTRY_CACHE`]).
    entry_cache: Option<u64>,
    /// Shard Raft messages waiting to go, per peer: sent as one message per peer.
    shard_sends: BTreeMap<String, Vec<(ShardId, RaftBytes)>>,
    /// Publishes forwarded, and answers to publishes forwarded here, waiting to go to peers
    /// that read them batched ([`FEATURE_FORWARD_BATCH`]): what one drain of the broker's
    /// outputs makes goes as one frame per peer ([`ClusterNode::poll_output`]).
    forward_sends: BTreeMap<String, Vec<ForwardedPublish>>,
    answer_sends: BTreeMap<String, Vec<(u64, ForwardOutcome)>>,
    /// Log entries and snapshots for moves' targets held back by the move budget, in the
    /// order they were made ([`super::bandwidth`]), and their bytes.
    held_moves: VecDeque<HeldMove>,
    held_bytes: u64,
    /// A replica's messages to its peers between its drain and their sending (kept, emptied).
    replica_sends: Vec<(String, Message, Option<u64>)>,
    /// Appends for moves' targets dropped with [`super::bandwidth::HELD_BYTES_MAX`] held.
    move_drops: u64,
    /// Shard groups' heartbeats waiting to go, per peer that reads them coalesced.
    beats: BTreeMap<String, Vec<(ShardId, Beat)>>,
    /// What each peer's hello offered ([`super::peer::PEER_FEATURES`]).
    peer_features: BTreeMap<String, u64>,
    /// Shard groups' snapshots over this many bytes of data go in chunks of it to peers that
    /// read them ([`SNAPSHOT_CHUNK_BYTES`]; simulations set it small).
    snapshot_chunk_bytes: usize,
    /// Snapshots being received in chunks, by sender and shard.
    assemblies: BTreeMap<(String, ShardId), restore::Assembly>,
    /// Leaderships this broker may still hand to preferred replicas in this tick.
    handovers_left: usize,
    /// Leaderships handed to preferred replicas (settled groups led elsewhere).
    handovers: u64,
    /// Snapshot chunks sent and snapshots put together from chunks received.
    snapshot_chunk_counts: (u64, u64),
    /// Snapshots on their way to followers, their data read from disk a chunk at a time, by
    /// shard and follower ([`super::snapshot_send`]).
    snapshot_sends: BTreeMap<(ShardId, String), super::snapshot_send::SnapshotSend>,
    /// Reads of those snapshots' data under way, by token.
    snapshot_send_reads: BTreeMap<u64, (ShardId, String)>,
    /// Snapshot sends from disk: started, finished, ended early.
    snapshot_send_counts: (u64, u64, u64),
    /// Snapshots whose send from disk failed, by shard, replica and index (said once each).
    snapshot_send_failures: BTreeSet<(ShardId, String, u64)>,
    /// Shard snapshots received whose data is not a replica's state, dropped.
    snapshots_refused: u64,
    /// When a metadata leader was last heard from (or this broker last led).
    leader_contact: Instant,
    /// Where this broker stands on knowing the cluster's current metadata ([`Currency`]).
    currency: Currency,
    /// The last read-index request's context (a counter).
    read_ctx: u64,
    /// The time of the latest input (what a proposal the broker asked for between inputs is
    /// made at).
    last_now: Instant,
    /// The metadata leader and term last noticed (a change is an operator notice).
    meta_leader_seen: (Option<u64>, u64),
    /// When this node started: its replicas grant no vote until [`VOTE_HOLD`] after.
    started: Instant,
    /// Reads of replica logs under way ([`NodeOutput::ReadReplicaLog`]), by token.
    replica_reads: BTreeMap<u64, ReplicaRead>,
    next_replica_read: u64,
    /// Followers' restores of installed snapshots from disk ([`restore`]).
    restores: restore::Restores,
    /// Bytes queued for other brokers and not yet written, as the driver last said
    /// ([`ClusterNode::set_peer_queued`]).
    peer_queued: u64,
    /// A leader's reads of entries for followers behind, held while [`peer_queued`] is at
    /// [`CATCH_UP_QUEUE_LIMIT`] or more (at most [`CATCH_UP_HOLD_MAX`]), in the order asked,
    /// with when; and how many ever were.
    ///
    /// [`peer_queued`]: Self::peer_queued
    held_catch_up_reads: VecDeque<(Instant, NodeOutput)>,
    catch_up_reads_held: u64,
    /// The replicas that tick (the others sleep: [`hibernation`]).
    awake: BTreeSet<ShardId>,
    /// Where the last tick's visit of sleeping groups stopped.
    sweep_after: Option<ShardId>,
    /// `metadata_changes` when sleeping groups were last checked against the metadata.
    quiet_checked: u64,
    /// Peers not heard from for [`PEER_SILENT_TICKS`] ticks (the groups they led were woken); a
    /// word from one takes it out.
    silent: BTreeSet<String>,
    /// The tick at which each peer was last heard from (silence is counted in ticks, as Raft
    /// counts a leader's: a broker too busy to tick on time does not find its peers silent).
    heard_at: BTreeMap<String, u64>,
    /// Groups woken because their leader's broker went silent, with the term they followed
    /// it in, by that broker (see `hibernation`).
    woken_by_silence: BTreeMap<String, Vec<(ShardId, u64)>>,
    /// `metadata_changes` when the replicas were last brought in line with the metadata.
    synced: Option<u64>,
    /// The broker was not yet told the latest metadata (only leader claims changed since).
    view_behind: bool,
    /// What this broker offers its peers ([`super::peer::PEER_FEATURES`] unless a test or a
    /// simulation plays an older version): it hibernates groups only if it offers that.
    offers: u64,
}

/// Whether this broker's applied metadata is known to be current: a broker that (re)starts
/// replays its own log, and one cut off may have missed entries (its shards given to others),
/// so contact with a leader alone does not make its view current (the entries may follow the
/// heartbeat). It is fenced until a read index ([`MetaNode::read_index`]) asked after the
/// contact resumed was confirmed and applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Currency {
    /// Not known current: a read index (context at least `since`) was asked at `asked`, while
    /// the leader known and the commit index were `of`. A follower that knows no leader cannot
    /// ask, and a leader drops what is asked before it committed an entry of its term: asked
    /// again when either changes (and every [`READ_INDEX_RETRY`], for what a network lost).
    Unconfirmed { since: u64, asked: Option<Instant>, of: (Option<u64>, u64) },
    /// The leader confirmed index `index` (for a request of this period); applied once this
    /// broker applied up to it.
    Confirmed { index: u64 },
    /// Applied the confirmed index: current while contact lasts.
    Current,
}

/// A read-index request unanswered for this long is asked again (it or its answer was lost).
const READ_INDEX_RETRY: Duration = Duration::from_millis(300);

/// One replica of a replicated shard as its broker sees it ([`ClusterNode::replica_report`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaReport {
    /// The shard.
    pub shard: ShardId,
    /// The leader this replica knows of.
    pub leader: Option<String>,
    /// Its Raft term.
    pub term: u64,
    /// `leader`, `settling` (leads, generation start not committed) or `follower`.
    pub role: &'static str,
    /// The readable bound: the next offset a record gets.
    pub next_offset: u64,
    /// Its last Raft log index.
    pub last_index: u64,
    /// The first index its log still holds (what is before it was compacted into a snapshot,
    /// once retention dropped those records).
    pub first_index: u64,
    /// The highest committed index it knows.
    pub committed_index: u64,
    /// On the leader: (replica, replicated index, lag in entries) of every replica.
    pub followers: Vec<(String, u64, u64)>,
}

/// Counts of replica rejoins (see [`ClusterNode::set_damaged_replicas`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RejoinCounts {
    /// This broker's replicas that found their kept log damaged and started a rejoin.
    pub damaged: u64,
    /// Of those, the ones that have rejoined (their group took them out and back in).
    pub healed: u64,
    /// Replicas of other brokers this broker, leading their group, took out and back in.
    pub readded: u64,
}

/// The context a rejoining replica puts on every Raft message it sends: "my log was damaged;
/// take me out of the group and add me back". A broker that does not know it ignores it (the
/// engine does not read a response's context), so the replica stays a non-voting follower.
pub const REJOIN_CONTEXT: &[u8] = b"felix:rejoin";
/// The context a leader puts on its messages to a replica it took out of the group and added
/// back, once that re-addition committed: the replica may vote again.
pub const READDED_CONTEXT: &[u8] = b"felix:readded";

/// A leader's progress in taking a rejoining replica out of its group and back in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RejoinStep {
    /// Removal proposed until the configuration no longer has it.
    Remove,
    /// Addition proposed until the configuration has it again.
    ReAdd,
    /// Back in (committed): the replica is told so on every message until it stops asking.
    Readded,
}

/// A replica this broker hosts, and what it told the broker about it.
struct Hosted {
    replica: Replica,
    /// Replica Raft id → node id of the shard's replicas.
    names: BTreeMap<u64, String>,
    /// On the leader: replicas that asked to rejoin (their log was damaged, or they answered
    /// below what they had acknowledged), by Raft id.
    rejoins: BTreeMap<u64, RejoinStep>,
    /// The role the broker was told.
    role: Option<ReplicaRole>,
    /// The term whose generation-start record committed while this replica led it.
    ready_term: Option<u64>,
    /// The read lease the broker was told (a replicated cache's).
    lease: Option<Instant>,
    /// On the leader: replicas (Raft ids) it said were behind and has not yet said caught up.
    behind: BTreeSet<u64>,
    /// It does not tick ([`hibernation`]), and why.
    sleep: Option<Sleep>,
    /// The commit index when its log was last offered to retention's compaction.
    compacted_at: Option<u64>,
    /// `metadata_changes` when `names` last learnt the replicas' names from the metadata.
    names_at: Option<u64>,
    /// On the leader: `metadata_changes` when its group was last found in line with the
    /// metadata (no move, the voters it names): nothing to drive until either changes.
    in_line_at: Option<u64>,
    /// On the leader, for a move's target: its name and the group's last index when this
    /// leader first sent it entries. Entries up to it are the copy the move budget paces;
    /// later ones are the shard's live writes, which it does not ([`super::bandwidth`]).
    move_floor: Option<(String, u64)>,
    /// What the role the broker was told was worked out from: (leads, its generation start
    /// committed, the leader known, `metadata_changes`, names known).
    role_from: Option<(bool, bool, Option<u64>, u64, usize)>,
    /// On the leader, awake: ticks its group has been settled in a row.
    settled_ticks: u32,
    /// The term in which this leader last handed its leadership to the group's preferred
    /// replica (at most once a term: a hand-over that failed is not tried again until a new
    /// term).
    preferred_tried: Option<u64>,
    /// The index of the last snapshot persisted (or kept) and whether its host state holds a
    /// stream's commit state: known when its data was in hand, for when it is sent from disk.
    snapshot_commits: Option<(u64, bool)>,
    /// Its host's state being read back from the snapshot on disk ([`restore`]).
    restoring: Option<Box<restore::Restoring>>,
    /// `ticks` when a replica of its group last sent it a request (an append, a heartbeat, a
    /// snapshot, a vote request, a hand-over): a sign the group still counts it a member. A
    /// replica the metadata no longer names lingers while it hears one ([`linger`]).
    heard_at: u64,
}

/// On a leader: which of the shard's other replicas fell behind since the last look, and which
/// caught up (operator notices); elsewhere it forgets what it said.
fn replicas_behind(h: &mut Hosted, shard: &ShardId, me: &str) -> Vec<Notice> {
    if h.role != Some(ReplicaRole::Leading) {
        h.behind.clear();
        return Vec::new();
    }
    let name = || format!("{}/{}/{}#{}", shard.tenant, shard.namespace, shard.name, shard.shard);
    let (last, _) = h.replica.indexes();
    let mut out = Vec::new();
    for (id, matched) in h.replica.progress() {
        let Some(replica) = h.names.get(&id).filter(|n| n.as_str() != me) else { continue };
        let lag = last.saturating_sub(matched);
        if lag > REPLICA_BEHIND_ENTRIES && h.behind.insert(id) {
            out.push(Notice::ReplicaBehind { shard: name(), replica: replica.clone(), entries: lag });
        } else if lag <= REPLICA_CAUGHT_UP_ENTRIES && h.behind.remove(&id) {
            out.push(Notice::ReplicaCaughtUp { shard: name(), replica: replica.clone() });
        }
    }
    out
}

impl std::fmt::Debug for ClusterNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterNode").field("node", &self.me.id).field("leader", &self.meta.leader()).finish()
    }
}

impl ClusterNode {
    /// Broker `me` of a cluster whose voters are `peers` (node ids; every broker is given the
    /// same list, and a node's Raft id is its position in the sorted list, from 1), starting
    /// from `kept` (what its driver kept of the Raft log; empty on a first start). The Raft
    /// clock starts at `now`.
    ///
    /// # Errors
    /// [`MetaError`] when `me` is not among the peers or the kept log is refused.
    pub fn new(
        broker: Broker,
        me: Member,
        peers: &[String],
        kept: &RaftLog,
        now: Instant,
    ) -> Result<ClusterNode, MetaError> {
        if !peers.contains(&me.id) {
            return Err(MetaError::Raft(raft::Error::ConfigInvalid(format!("{} is not among the peers", me.id))));
        }
        Self::start(broker, me, peers, kept, now)
    }

    /// Broker `me` joining a running cluster (after `cluster add`): it takes part once the
    /// leader replicates the group's log to it, and learns every member from that log. `kept`
    /// as for [`new`](Self::new).
    ///
    /// # Errors
    /// [`MetaError`] when the kept log is refused.
    pub fn joining(broker: Broker, me: Member, kept: &RaftLog, now: Instant) -> Result<ClusterNode, MetaError> {
        Self::start(broker, me, &[], kept, now)
    }

    fn start(
        broker: Broker,
        me: Member,
        founding: &[String],
        kept: &RaftLog,
        now: Instant,
    ) -> Result<ClusterNode, MetaError> {
        let mut names: BTreeMap<u64, String> = BTreeMap::new();
        for n in founding {
            if let Some(other) = names.insert(raft_id(n), n.clone())
                && other != *n
            {
                return Err(MetaError::Raft(raft::Error::ConfigInvalid(format!(
                    "node ids {other} and {n} collide; rename one"
                ))));
            }
        }
        let voters: Vec<(u64, Vec<u8>)> = names
            .iter()
            .map(|(id, n)| (*id, Command::AddVoter { id: n.clone(), cluster_addr: String::new() }.encode()))
            .collect();
        let meta = MetaNode::restart(raft_id(&me.id), &voters, kept)?;
        // A member of a cluster from the start: nothing is served as if alone while it joins.
        let mut broker = broker;
        broker.apply_cluster(&Metadata::default(), &me.id, now);
        let mut node = ClusterNode {
            broker,
            meta,
            metadata: Metadata::default(),
            metadata_changes: 0,
            me,
            names,
            voter_addrs: BTreeMap::new(),
            removed_voters: BTreeSet::new(),
            meta_snapshot_every: Some(META_SNAPSHOT_ENTRIES),
            meta_snapshot_counts: MetaSnapshotCounts::default(),
            withheld: BTreeSet::new(),
            withheld_shard_snapshots: BTreeSet::new(),
            shard_snapshots_withheld: 0,
            meta_restored: false,
            leads_applied: 0,
            out: VecDeque::new(),
            next_tick: Some(crate::transport::after(now, TICK)),
            ticks: 0,
            pending: VecDeque::new(),
            last_seen: BTreeMap::new(),
            was_leader: false,
            balance_moves: 0,
            balance_proposed_at: None,
            marked: std::collections::BTreeSet::new(),
            removed: false,
            refused: std::collections::BTreeSet::new(),
            replicas: BTreeMap::new(),
            kept_replicas: BTreeMap::new(),
            failed_replicas: BTreeMap::new(),
            rejoining: BTreeMap::new(),
            rejoin_counts: RejoinCounts::default(),
            checkpoint_bytes: None,
            entry_cache: None,
            shard_sends: BTreeMap::new(),
            forward_sends: BTreeMap::new(),
            answer_sends: BTreeMap::new(),
            held_moves: VecDeque::new(),
            held_bytes: 0,
            replica_sends: Vec::new(),
            move_drops: 0,
            beats: BTreeMap::new(),
            replica_reads: BTreeMap::new(),
            next_replica_read: 1,
            restores: restore::Restores::default(),
            peer_queued: 0,
            held_catch_up_reads: VecDeque::new(),
            catch_up_reads_held: 0,
            peer_features: BTreeMap::new(),
            snapshot_chunk_bytes: SNAPSHOT_CHUNK_BYTES,
            assemblies: BTreeMap::new(),
            handovers_left: 0,
            handovers: 0,
            snapshot_chunk_counts: (0, 0),
            snapshot_sends: BTreeMap::new(),
            snapshot_send_reads: BTreeMap::new(),
            snapshot_send_counts: (0, 0, 0),
            snapshot_send_failures: BTreeSet::new(),
            snapshots_refused: 0,
            leader_contact: now,
            currency: Currency::Unconfirmed { since: 1, asked: None, of: (None, 0) },
            read_ctx: 0,
            last_now: now,
            meta_leader_seen: (None, 0),
            started: now,
            awake: BTreeSet::new(),
            sweep_after: None,
            quiet_checked: 0,
            silent: BTreeSet::new(),
            heard_at: BTreeMap::new(),
            woken_by_silence: BTreeMap::new(),
            synced: None,
            view_behind: false,
            offers: super::peer::PEER_FEATURES,
        };
        // A kept snapshot stands for the log before it (D62): its state first, then the
        // entries after it replay.
        if let Some(snap) = kept.snapshot.as_ref().filter(|s| s.get_metadata().index > 0) {
            let restored = MetaSnapshot::decode(snap.get_data()).map_err(|e| {
                MetaError::Decode(format!("kept metadata snapshot at {}: {e}", snap.get_metadata().index))
            })?;
            node.restore_meta_snapshot(restored);
        }
        node.names.insert(node.meta.id(), node.me.id.clone());
        // The replay comes out now, with the snapshot before it: the broker is first told of
        // the state after both (a snapshot's state alone, some entries old, once showed a
        // finished move into this broker as under way, and its copy replaced what the shard
        // took here since).
        node.meta.replay_kept();
        node.pending.push_back(Command::Join { member: node.me.clone() }.encode());
        // The founding entries (or a replay) come out now.
        node.drain_meta(now);
        // What was replayed is not known current: fenced until confirmed.
        node.check_fence(now);
        Ok(node)
    }

    /// What this broker says it reads in its hello ([`super::peer::PEER_FEATURES`] by
    /// default); it also acts by it (an older version is played by offering less).
    pub fn offered_features(&self) -> u64 {
        self.offers
    }

    /// Plays a broker that offers only `features` (tests and simulations of mixed versions):
    /// say it in the hellos, and this node acts by it.
    pub fn set_offered_features(&mut self, features: u64) {
        self.offers = features;
    }

    /// Whether `peer` reads forwarded publishes and their answers batched (D64): this broker
    /// and `peer` (by its hello on the current connection) offered [`FEATURE_FORWARD_BATCH`].
    fn peer_reads_forward_batches(&self, peer: &str) -> bool {
        self.offers & FEATURE_FORWARD_BATCH != 0
            && self.peer_features.get(peer).is_some_and(|f| f & FEATURE_FORWARD_BATCH != 0)
    }

    /// Whether a batch's key, envelope and compressed block may travel to `peer` (D59): this
    /// broker and `peer` (by its hello on the current connection) offered
    /// [`FEATURE_BATCH_META`].
    fn peer_reads_meta(&self, peer: &str) -> bool {
        self.offers & FEATURE_BATCH_META != 0
            && self.peer_features.get(peer).is_some_and(|f| f & FEATURE_BATCH_META != 0)
    }

    /// Whether `shard`'s group may be proposed version 4 entries (D59): its replicas, as the
    /// metadata names them and as the group's voters are (no configuration change half done),
    /// all run brokers that read them. A replica added later is a broker of the cluster that
    /// offered the bit too, or it refuses such entries (docs/protocol.md, D59).
    fn group_reads_meta(&self, shard: &ShardId) -> bool {
        if self.offers & FEATURE_BATCH_META == 0 {
            return false;
        }
        let (Some(members), Some(h)) = (self.metadata.replicas(shard), self.replicas.get(shard)) else { return false };
        let mut wanted: Vec<u64> = members.iter().map(|n| raft_id(n)).collect();
        wanted.sort_unstable();
        let mut voters = h.replica.voters();
        voters.sort_unstable();
        voters == wanted && members.iter().all(|n| *n == self.me.id || self.peer_reads_meta(n))
    }

    /// Leaderships this broker handed to their group's preferred replica.
    pub fn preferred_handovers(&self) -> u64 {
        self.handovers
    }

    /// The broker this node runs, to read: its counters, its shards, its connections.
    pub fn broker(&self) -> &Broker {
        &self.broker
    }

    /// The broker, to change: for tests that play a part of the cluster on it (a group saying
    /// another replica leads, say) without running that part.
    #[cfg(any(test, feature = "testkit"))]
    pub fn broker_mut(&mut self) -> &mut Broker {
        &mut self.broker
    }

    /// A driver's inputs to this node's broker: its connections' bytes and events, storage's
    /// answers, notices. What the cluster changes on the broker only the node itself does.
    pub fn inputs(&mut self) -> crate::broker::ConnectionInputs<'_> {
        self.broker.inputs()
    }

    /// This broker's node id.
    pub fn node_id(&self) -> &str {
        &self.me.id
    }

    /// The metadata as applied here.
    pub fn metadata(&self) -> &Metadata {
        &self.metadata
    }

    /// How many times [`ClusterNode::metadata`] changed since this node was made: equal
    /// counts of one node mean the same metadata, so a watcher (a status page, the world
    /// simulation's checker) can skip a view it already looked at instead of walking
    /// thousands of shards again.
    pub fn metadata_changes(&self) -> u64 {
        self.metadata_changes
    }

    /// The leader of the metadata group, as this broker knows it.
    pub fn leader(&self) -> Option<&str> {
        self.meta.leader().and_then(|l| self.names.get(&l)).map(String::as_str)
    }

    /// Proposes a metadata command (through the leader, wherever it is).
    pub fn propose(&mut self, c: &Command, now: Instant) {
        self.pending.push_back(c.encode());
        self.flush_pending(now);
    }

    /// When to call [`handle_timeout`](Self::handle_timeout): the next Raft tick or the broker's
    /// own deadline.
    pub fn poll_timeout(&self) -> Option<Instant> {
        [self.next_tick, self.broker.poll_timeout()].into_iter().flatten().min()
    }

    /// Time passed: Raft ticks due, then the broker's timers.
    pub fn handle_timeout(&mut self, now: Instant) {
        self.last_now = self.last_now.max(now);
        let next = *self.next_tick.get_or_insert(now);
        if next <= now {
            if self.view_behind {
                self.view_behind = false;
                self.apply_view(now);
            }
            self.meta.tick();
            self.ticks += 1;
            self.next_tick = Some(crate::transport::after(now, TICK));
            while self
                .held_catch_up_reads
                .front()
                .is_some_and(|(at, _)| now.saturating_duration_since(*at) >= CATCH_UP_HOLD_MAX)
            {
                self.out.extend(self.held_catch_up_reads.pop_front().map(|(_, read)| read));
            }
            // Every member reads a replicated stream's commit state in its snapshots (D63).
            let commit_state = self.offers & FEATURE_COMMIT_STATE != 0
                && self.metadata.members().keys().all(|m| {
                    *m == self.me.id || self.peer_features.get(m).is_some_and(|f| f & FEATURE_COMMIT_STATE != 0)
                });
            self.broker.set_commit_state_snapshots(commit_state);
            // Not an active member (yet, or any more): ask again (a proposal can be lost with a
            // leader; a member declared down comes back this way).
            // (A draining broker stays draining: an operator asked for it.)
            let active = self
                .metadata
                .members()
                .get(&self.me.id)
                .is_some_and(|m| matches!(m.state, MemberState::Active | MemberState::Draining));
            if self.ticks.is_multiple_of(JOIN_RETRY_TICKS) && !active && !self.removed {
                self.pending.push_back(Command::Join { member: self.me.clone() }.encode());
            }
            // The metadata leader registers the streams its configuration declares (each
            // broker of a cluster is given the same file): placed and listed before first use.
            if self.ticks.is_multiple_of(JOIN_RETRY_TICKS) && active && self.leader() == Some(self.me.id.as_str()) {
                for (tenant, namespace, name, shards, ephemeral, replication) in
                    self.broker.configured_streams_to_register()
                {
                    let kind = super::metadata::Kind::Stream;
                    let c = Command::Create { kind, tenant, namespace, name, shards, ephemeral, replication };
                    self.pending.push_back(c.encode());
                }
            }
            self.check_leases(now);
            if self.ticks.is_multiple_of(JOIN_RETRY_TICKS) {
                self.check_replica_balance();
            }
            self.check_fence(now);
            self.broker.tick_moves(now);
            // The replicas follow the metadata: looked at when it changed (and every ten
            // seconds regardless), not at every tick: a walk of every replicated shard.
            if self.synced != Some(self.metadata_changes) || self.ticks.is_multiple_of(10 * JOIN_RETRY_TICKS) {
                self.synced = Some(self.metadata_changes);
                self.sync_replicas(now);
            }
            // Sleeping groups do not tick ([`hibernation`]).
            // (Taken, not cloned: thousands of shard ids a tick. What wakes meanwhile lands in
            // the new set; what went to sleep is left out below.)
            self.handovers_left = PREFERRED_HANDOVERS_PER_TICK;
            let shards = std::mem::take(&mut self.awake);
            // Once a second per group: notices, lead claims, and retention's compaction of a
            // group that committed nothing since (a group that did is looked at each tick).
            let slow = self.ticks.is_multiple_of(JOIN_RETRY_TICKS);
            for shard in &shards {
                let committed = self.replicas.get(shard).map(|h| (h.replica.committed(), h.compacted_at));
                let floor = match committed {
                    Some((now_at, then)) if slow || then != Some(now_at) => {
                        if let Some(h) = self.replicas.get_mut(shard) {
                            h.compacted_at = Some(now_at);
                        }
                        self.broker.replicated_start(shard)
                    }
                    _ => None,
                };
                self.drive_replica_move(shard);
                self.drive_rejoins(shard);
                let named = self.names_me(shard);
                if let Some(h) = self.replicas.get_mut(shard) {
                    // A rejoining replica never campaigns (its vote for itself could be a
                    // second one in a term): it only answers its leader. Nor does a lingering
                    // one, whose configuration may be one its group left long ago ([`linger`]).
                    if !self.rejoining.contains_key(shard) && named {
                        h.replica.tick();
                    }
                    if h.replica.is_leader() && self.broker.wants_read_lease(shard) {
                        renew_read_lease(&mut h.replica, now, true);
                    }
                    // What retention dropped here need not stay in the Raft log either.
                    if let Some(floor) = floor {
                        h.replica.compact_below(floor);
                    }
                    if slow {
                        let notices = replicas_behind(h, shard, &self.me.id);
                        for n in notices {
                            self.broker.notice(n);
                        }
                    }
                }
                self.drain_replica(shard, now);
                if slow {
                    self.claim_lead(shard, now);
                }
                self.consider_sleep(shard);
            }
            // Those that went to sleep are left out; those that woke or started meanwhile are in
            // the new set.
            // (In place: collecting a new set re-inserted thousands of shard ids a tick, 6% of
            // a survivor's work while a dead broker's groups elected.)
            let mut still = shards;
            still.retain(|s| self.replicas.get(s).is_some_and(|h| h.sleep.is_none()));
            if self.awake.len() * 8 < still.len() {
                // The few woken meanwhile, inserted (an append rebuilds the whole tree).
                still.extend(std::mem::take(&mut self.awake));
            } else {
                still.append(&mut self.awake);
            }
            self.awake = still;
            self.hibernation_tick(now);
            self.release_held_moves(now);
            self.resume_snapshot_sends(now);
            self.retry_restores(now);
            self.flush_pending(now);
            self.drain_meta(now);
            self.maybe_snapshot_meta(now);
            self.flush_shard_sends();
        }
        if self.broker.poll_timeout().is_some_and(|t| t <= now) {
            self.broker.handle_timeout(now);
        }
    }
}
