//! A follower's install of a replicated shard's snapshot sent by its leader: its chunks taken
//! in order ([`ClusterNode::take_chunk`]), and the host's state (a stream's commit state, a
//! cache's values) written to disk as it came and read back from there a piece at a time.
//!
//! Why: the snapshot's data was gathered into one buffer from its chunks (the chunks and the
//! buffer in memory together), and the state restored from that buffer (the buffer and the
//! state built from it in memory together): twice the state at each step (measured: 102–104
//! MB for a follower installing a 40 MiB commit state). With history reads a snapshot of
//! [`RESTORE_IN_PIECES_MIN`] or more is not gathered: its Raft message carries the group's own
//! state alone, the host's state goes beside it as the chunks came ([`split_received`]), is
//! written to the replica's log file before anything after it is carried out
//! ([`NodeOutput::PersistReplicaSnapshot`]) and let go, and is read back from that record a
//! piece at a time ([`NodeOutput::ReadReplicaSnapshotPiece`]), each value copied out as its
//! bytes come ([`HostStateReader`]). A snapshot sent whole (to a broker that reads no
//! chunks, or small) is restored the same way once written, when its state is that large.
//!
//! Until the state is whole the replica's later outputs that touch the host (records
//! delivered, side entries, checkpoints due, answers, a generation's start) are held, in
//! order, and carried out after it; the broker is told the replica follows, so it serves
//! nothing of the shard meanwhile (not even when its replica was elected: it would serve the
//! state from before the snapshot). A read that fails is tried again at each tick (said
//! once), unless a newer snapshot replaced the one being read, which is restored instead.
//! A child of [`super`] in a file of its own, as [`hibernation`](super::hibernation) is.

use super::*;
use crate::broker::HostStateReader;
use crate::cluster::meta::SnapshotPiece;
use crate::cluster::replica::{HostPart, SnapshotRest};
use crate::shard::Kind;

/// A snapshot a leader sent whose data (in chunks) or host state (sent whole) is at least this
/// many bytes has its host state read back from disk a piece at a time (with history reads); a
/// smaller one is restored at once from the data in hand, where the second copy costs little.
pub const RESTORE_IN_PIECES_MIN: u64 = 1 << 20;

/// Bytes of each read of a restore's state.
pub const RESTORE_PIECE_BYTES: u64 = 1 << 20;

/// A restore whose reads have failed for this long, without a piece read since, gives up: the
/// replica drops its log (the driver deletes its files) and rejoins its group afresh, taking
/// a new snapshot from its leader ([`ClusterNode::rejoining_replicas`]). Until then a failed
/// read is tried again at each tick: a disk that stalls for seconds is waited out.
pub const RESTORE_GIVE_UP: std::time::Duration = std::time::Duration::from_secs(30);

/// A follower's restore of a snapshot's host state from disk, under way.
#[derive(Debug)]
pub(super) struct Restoring {
    /// The snapshot's index (a record holding another is an error).
    index: u64,
    /// The next offset the group gives after the snapshot.
    next_offset: u64,
    /// The next byte of the snapshot's data to read.
    next: u64,
    /// The data's end (the host's state runs to it).
    end: u64,
    /// The read under way.
    token: Option<u64>,
    reader: HostStateReader,
    /// The replica's outputs that came after the snapshot and touch the host, in order.
    held: VecDeque<ReplicaOutput>,
    /// A failed read was said (once per restore).
    said: bool,
    /// The next read checks the whole record's CRC first: the first, and the first after a
    /// failure.
    verify: bool,
    /// When the reads started failing, none read since.
    failing_since: Option<Instant>,
}

/// The node's side of restores: settings, the reads under way and counts.
#[derive(Debug)]
pub(super) struct Restores {
    /// Host states this large or larger are read back in pieces.
    pub(super) min: u64,
    /// Bytes a read asks for.
    piece: u64,
    /// Reads under way, by token.
    reads: BTreeMap<u64, ShardId>,
    /// Shards restoring (tried again at each tick while no read is under way).
    active: BTreeSet<ShardId>,
    pub(super) counts: RestoreCounts,
}

impl Default for Restores {
    fn default() -> Self {
        Restores {
            min: RESTORE_IN_PIECES_MIN,
            piece: RESTORE_PIECE_BYTES,
            reads: BTreeMap::new(),
            active: BTreeSet::new(),
            counts: RestoreCounts::default(),
        }
    }
}

/// What a node's restores from disk did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RestoreCounts {
    /// Restores started.
    pub started: u64,
    /// Restores whole (the broker took the state).
    pub finished: u64,
    /// Pieces read.
    pub pieces: u64,
    /// Reads that failed (tried again).
    pub failed_reads: u64,
    /// Restores given up for a newer snapshot's.
    pub superseded: u64,
    /// Restores given up after their reads failed for [`RESTORE_GIVE_UP`]: the replica
    /// dropped its log and rejoined its group afresh.
    pub given_up: u64,
    /// Leaderships a restoring replica handed over (it was elected meanwhile).
    pub handed_over: u64,
    /// Leaderships handed to a restoring replica that it did not take.
    pub handovers_refused: u64,
    /// Snapshots received in chunks whose host state was never gathered into one buffer
    /// (written to disk as the chunks came, then read back).
    pub never_gathered: u64,
    /// Restores of a snapshot kept across a restart, whose host state the restart left on
    /// disk ([`ClusterNode::leave_kept_state_on_disk`]).
    pub at_restart: u64,
    /// The most bytes a restore held besides the values it read (the head gathered, a value
    /// cut by a piece's end), and the most outputs it held.
    pub most_held_bytes: u64,
    /// See `most_held_bytes`.
    pub most_held_outputs: u64,
}

/// The most bytes gathered to find where a received snapshot's own state ends (it is a few
/// bytes, more with many idempotent producers): past it the data is gathered whole, as
/// before, and the check that drops data that is not a replica's state reads it so.
const OWN_STATE_MAX: usize = 4 << 20;

/// A received snapshot's host state as its chunks came ([`split_received`]): written beside
/// the snapshot's data, piece by piece, then let go.
#[derive(Debug)]
struct ReceivedState {
    chunks: Vec<Bytes>,
    len: usize,
    commits: bool,
}

impl HostPart for ReceivedState {
    fn encode_into(&self, out: &mut Vec<u8>) {
        for c in &self.chunks {
            out.extend_from_slice(c);
        }
    }

    fn encoded_len(&self) -> usize {
        self.len
    }

    fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        for c in &self.chunks {
            each(c);
        }
    }

    fn holds_commits(&self) -> bool {
        self.commits
    }
}

/// Splits a received snapshot's chunks where the group's own state ends: its bytes (gathered:
/// a few), and the host's state as the chunks hold it, beside. `Err` (the chunks, unchanged)
/// when they do not start with a replica's state.
pub(super) fn split_received(chunks: Vec<Bytes>, kind: Kind) -> Result<(Bytes, SnapshotRest), Vec<Bytes>> {
    let mut head = Vec::new();
    let mut own = None;
    for c in &chunks {
        let take = c.len().min(OWN_STATE_MAX.saturating_sub(head.len()));
        head.extend_from_slice(&c[..take]);
        if let Some(host) = Replica::host_state_of(&head) {
            own = Some(head.len() - host.len());
            break;
        }
        if take < c.len() {
            break;
        }
    }
    let Some(own) = own else { return Err(chunks) };
    let mut rest = Vec::with_capacity(chunks.len());
    let mut at = 0;
    for c in chunks {
        let end = at + c.len();
        if end > own {
            rest.push(c.slice(own.saturating_sub(at)..));
        }
        at = end;
    }
    let len = rest.iter().map(Bytes::len).sum();
    let commits = kind == Kind::Stream && crate::broker::stream_state_holds_commits_in(&rest);
    let own = Bytes::copy_from_slice(&head[..own]);
    Ok((own, SnapshotRest::new(std::sync::Arc::new(ReceivedState { chunks: rest, len, commits }))))
}

/// The most snapshot data a chunked snapshot may claim (16 GiB): a claim past it is dropped.
pub const MAX_SNAPSHOT_BYTES: u64 = 16 << 30;

/// A snapshot being received in chunks.
#[derive(Debug)]
pub(super) struct Assembly {
    pub(super) index: u64,
    pub(super) term: u64,
    pub(super) total: u64,
    /// The `MsgSnapshot`, its data left out.
    header: Message,
    /// The chunks' data as they came, put together once, when the last arrives, into a
    /// buffer of the snapshot's size. (One buffer grown as they came carried up to twice
    /// the data's size in capacity into the install. Measured, that cost no resident
    /// memory: glibc grows a large buffer in place and leaves spare room untouched; this
    /// does not rest on it.)
    chunks: Vec<Bytes>,
    /// Bytes of data in `chunks`.
    received: u64,
}

impl Assembly {
    /// The snapshot's data whole: the one chunk as it came, or every chunk copied once into
    /// a buffer of exactly their size.
    fn data(chunks: Vec<Bytes>, received: u64) -> Bytes {
        if chunks.len() == 1 {
            return chunks.into_iter().next().unwrap_or_default();
        }
        let mut data = Vec::with_capacity(received as usize);
        for c in chunks {
            data.extend_from_slice(&c);
        }
        Bytes::from(data)
    }
}

/// Whether a replica's output waits for its host's state while it is read back: everything
/// that reads or changes the host's state, or answers what did.
fn waits_for_restore(o: &ReplicaOutput) -> bool {
    matches!(
        o,
        ReplicaOutput::Restored { .. }
            | ReplicaOutput::CheckpointDue { .. }
            | ReplicaOutput::Delivered { .. }
            | ReplicaOutput::Side { .. }
            | ReplicaOutput::Answer { .. }
            | ReplicaOutput::GenerationStart { .. }
    )
}

/// Asks for the restore's next piece.
fn ask(
    restores: &mut Restores,
    next_token: &mut u64,
    out: &mut VecDeque<NodeOutput>,
    shard: &ShardId,
    r: &mut Restoring,
) {
    let token = *next_token;
    *next_token += 1;
    restores.reads.insert(token, shard.clone());
    r.token = Some(token);
    let len = restores.piece.max(1).min(r.end - r.next);
    out.push_back(NodeOutput::ReadReplicaSnapshotPiece {
        shard: shard.clone(),
        token,
        index: r.index,
        offset: r.next,
        len,
        verify: r.verify,
    });
}

/// Holds `o` if `h` is restoring and `o` waits for it; gives it back otherwise. A restart's
/// replay waits too (its reads of the entries after the snapshot): read on, the entries would
/// pile up, delivered and held, behind the restore, however many the restart left on disk.
pub(super) fn hold_for_restore(h: &mut Hosted, restores: &mut Restores, o: ReplicaOutput) -> Option<ReplicaOutput> {
    let replay = h.replica.replaying() && matches!(o, ReplicaOutput::ReadEntries { .. });
    match h.restoring.as_mut() {
        Some(r) if replay || waits_for_restore(&o) => {
            r.held.push_back(o);
            restores.counts.most_held_outputs = restores.counts.most_held_outputs.max(r.held.len() as u64);
            None
        }
        _ => Some(o),
    }
}

/// Starts reading back the host's state of a snapshot, if it is one to read in pieces: one
/// the leader sent to `h` (with history reads, at least [`Restores::min`] bytes), or one whose
/// end is not in hand (never gathered, [`split_received`]; left on disk by a restart,
/// [`ClusterNode::leave_kept_state_on_disk`]). `state` (what is in hand) is let go. False:
/// the caller restores it from `state`.
#[allow(clippy::too_many_arguments)]
pub(super) fn begin_restore(
    h: &mut Hosted,
    restores: &mut Restores,
    next_token: &mut u64,
    out: &mut VecDeque<NodeOutput>,
    shard: &ShardId,
    history_reads: bool,
    (next_offset, state, index, at, len, received): (u64, &Bytes, u64, u64, u64, bool),
) -> bool {
    // A state whose end went to disk without being gathered is read from there, whatever
    // its size.
    let in_hand = state.len() as u64 == len;
    let pieces = len > 0 && (!in_hand || (received && history_reads && len >= restores.min));
    if !pieces {
        return false;
    }
    if !received {
        restores.counts.at_restart += 1;
    }
    let mut r = Box::new(Restoring {
        index,
        next_offset,
        next: at,
        end: at + len,
        token: None,
        reader: HostStateReader::new(shard.kind),
        held: VecDeque::new(),
        said: false,
        // The record's CRC is checked whole before the first piece, as a send's first is.
        verify: true,
        failing_since: None,
    });
    ask(restores, next_token, out, shard, &mut r);
    // (A newer snapshot's outputs wait behind the restore under way, so none is.)
    if h.restoring.replace(r).is_some() {
        restores.counts.superseded += 1;
    }
    restores.active.insert(shard.clone());
    restores.counts.started += 1;
    true
}

impl ClusterNode {
    /// Leaves the host's state of `log`'s kept snapshot on disk when it is `min` bytes or more
    /// ([`RESTORE_IN_PIECES_MIN`] for a driver): the snapshot's data is cut to the group's own
    /// state (a copy of a few bytes, so the buffer the record was read into can go), and as
    /// the replica starts its host reads the rest back from the kept record a piece at a time
    /// ([`NodeOutput::ReadReplicaSnapshotPiece`], which the driver answers from the last
    /// snapshot record of the shard's files: the one this is). Returns whether it did.
    ///
    /// Why: a restart read the record whole and restored the state from it, the record and
    /// the state built from it in memory together (twice the state), and every replica's
    /// record was held until its replica started. A driver calls this on each log its fold
    /// gives, before the next is read.
    pub fn leave_kept_state_on_disk(log: &mut RaftLog, min: u64) -> bool {
        let Some(snap) = log.snapshot.as_mut().filter(|_| log.snapshot_rest_on_disk.is_none()) else {
            return false;
        };
        let data = snap.get_data();
        let Some(host) = Replica::host_state_of(data) else { return false };
        let len = host.len() as u64;
        if len == 0 || len < min {
            return false;
        }
        let holds_commits = Broker::stream_state_holds_commits(host);
        let own = Bytes::copy_from_slice(&data[..data.len() - host.len()]);
        snap.set_data(own);
        log.snapshot_rest_on_disk = Some(crate::cluster::meta::RestOnDisk { len, holds_commits });
        true
    }

    /// Takes a chunk of a snapshot from `from`; the snapshot's message once its data is whole.
    /// Chunks come in order on one connection: one that does not continue what is held (a
    /// connection lost midway, a newer snapshot) drops it, and a first chunk starts afresh;
    /// the leader sends the snapshot again when its follower still needs one. Chunks of a
    /// shard this broker holds no replica of, or that claim more than [`MAX_SNAPSHOT_BYTES`],
    /// are dropped.
    ///
    /// With history reads, a snapshot of [`restore::RESTORE_IN_PIECES_MIN`] or more is not
    /// gathered: its message's data is the group's own state alone, and the host's state
    /// goes beside it as the chunks came, to be written to disk and read back from there
    /// ([`restore`]). Gathered, the chunks and the one buffer they were copied into were in
    /// memory together, twice the data at the peak of the install.
    #[allow(clippy::type_complexity)]
    pub(super) fn take_chunk(
        &mut self,
        from: &str,
        c: SnapshotChunk,
    ) -> Option<(ShardId, Message, Option<SnapshotRest>)> {
        let key = (from.to_owned(), c.shard.clone());
        if !self.replicas.contains_key(&c.shard) || c.total > MAX_SNAPSHOT_BYTES {
            self.assemblies.remove(&key);
            return None;
        }
        if c.offset == 0 {
            let mut header = decode_message(&c.header).ok().filter(|m| {
                m.get_msg_type() == MessageType::MsgSnapshot
                    && m.get_snapshot().get_metadata().index == c.index
                    && m.get_snapshot().get_metadata().term == c.term
            })?;
            header.mut_snapshot().set_data(Bytes::new());
            // Memory as the data arrives, not as the first chunk claims.
            let a = Assembly { index: c.index, term: c.term, total: c.total, header, chunks: Vec::new(), received: 0 };
            self.assemblies.insert(key.clone(), a);
        }
        let a = self.assemblies.get_mut(&key)?;
        let fits = a.index == c.index
            && a.term == c.term
            && a.total == c.total
            && c.offset == a.received
            && a.received + c.data.len() as u64 <= a.total;
        if !fits {
            self.assemblies.remove(&key);
            return None;
        }
        a.received += c.data.len() as u64;
        if !c.data.is_empty() {
            a.chunks.push(c.data);
        }
        if a.received < a.total {
            return None;
        }
        let Assembly { mut header, chunks, received, .. } = self.assemblies.remove(&key)?;
        let aside = self.broker.config().history_reads && received >= self.restores.min.max(1);
        let chunks = if aside {
            match restore::split_received(chunks, c.shard.kind) {
                Ok((own, rest)) => {
                    self.restores.counts.never_gathered += 1;
                    header.mut_snapshot().set_data(own);
                    return Some((c.shard, header, Some(rest)));
                }
                Err(chunks) => chunks,
            }
        } else {
            chunks
        };
        header.mut_snapshot().set_data(Assembly::data(chunks, received));
        Some((c.shard, header, None))
    }

    /// A follower's host states of at least `min` bytes in snapshots its leaders send are read
    /// back from disk `piece` bytes at a time ([`RESTORE_IN_PIECES_MIN`] and
    /// [`RESTORE_PIECE_BYTES`] unless set; simulations set both small). Only with history
    /// reads, where the snapshot is kept on disk.
    pub fn set_restore_in_pieces(&mut self, min: u64, piece: u64) {
        self.restores.min = min;
        self.restores.piece = piece.max(1);
    }

    /// What restores from disk did.
    pub fn restore_counts(&self) -> RestoreCounts {
        self.restores.counts
    }

    /// The value of `key` in the commit state this broker holds of `shard` (checkers and
    /// tests; changes nothing).
    #[cfg(any(test, feature = "testkit"))]
    pub fn commit_state_peek(&self, shard: &ShardId, key: &str) -> Option<Bytes> {
        self.broker.commit_state_peek(shard, key)
    }

    /// Shards whose host state is being read back from disk.
    pub fn restoring(&self) -> usize {
        self.restores.active.len()
    }

    /// The driver read a piece a restore asked for ([`Self::handle_replica_snapshot_piece`]
    /// hands every piece here first): taken, or handed back (`Err`) when `token` is not a
    /// restore's.
    pub(super) fn take_restore_piece(
        &mut self,
        token: u64,
        read: Result<SnapshotPiece, String>,
        now: Instant,
    ) -> Result<(), Result<SnapshotPiece, String>> {
        let Some(shard) = self.restores.reads.remove(&token) else { return Err(read) };
        let Some(h) = self.replicas.get_mut(&shard) else {
            self.restores.active.remove(&shard);
            return Ok(());
        };
        let Some(r) = h.restoring.as_mut().filter(|r| r.token == Some(token)) else { return Ok(()) };
        r.token = None;
        let why = match read {
            Ok(p) if p.total == r.end && !p.data.is_empty() && p.data.len() as u64 <= r.end - r.next => {
                r.reader.feed(&p.data);
                r.next += p.data.len() as u64;
                r.verify = false;
                r.failing_since = None;
                self.restores.counts.pieces += 1;
                self.restores.counts.most_held_bytes = self.restores.counts.most_held_bytes.max(r.reader.held() as u64);
                None
            }
            Ok(p) => {
                Some(format!("a piece of {} bytes of data {} long, at {} of {}", p.data.len(), p.total, r.next, r.end))
            }
            Err(e) => Some(e),
        };
        if let Some(why) = why {
            self.restores.counts.failed_reads += 1;
            if r.held.iter().any(|o| matches!(o, ReplicaOutput::Restored { .. })) {
                // A newer snapshot replaced the one on disk: what came after this one is
                // carried out, the newer one's restore with it (which holds what they did).
                if let Some(r) = h.restoring.take() {
                    h.replica.unpoll(r.held.into_iter());
                }
                self.restores.active.remove(&shard);
                self.restores.counts.superseded += 1;
                self.drain_replica(&shard, now);
                return Ok(());
            }
            r.verify = true;
            let since = *r.failing_since.get_or_insert(now);
            if !r.said {
                r.said = true;
                let label = format!("{}/{}/{}#{}", shard.tenant, shard.namespace, shard.name, shard.shard);
                self.broker.notice(Notice::ShardRestoreReadFailed { shard: label, why: why.clone() });
            }
            if now.saturating_duration_since(since) >= RESTORE_GIVE_UP {
                self.give_up_restore(&shard, &why, now);
            }
            return Ok(()); // asked again at the next tick
        }
        if r.next < r.end {
            ask(&mut self.restores, &mut self.next_replica_read, &mut self.out, &shard, r);
            return Ok(());
        }
        let Some(r) = h.restoring.take() else { return Ok(()) };
        let Restoring { next_offset, reader, held, .. } = *r;
        self.restores.active.remove(&shard);
        self.restores.counts.finished += 1;
        self.broker.restore_replicated_read(&shard, next_offset, reader, now);
        if let Some(h) = self.replicas.get_mut(&shard) {
            h.replica.unpoll(held.into_iter());
            // The role it is told is worked out again: it may serve now.
            h.role_from = None;
        }
        self.drain_replica(&shard, now);
        Ok(())
    }

    /// A restore whose reads kept failing ([`RESTORE_GIVE_UP`]): the replica is dropped with
    /// its log (what it owed answered `LeadershipLost`, the outcome unknown to this broker)
    /// and started again at the next tick, empty and rejoining its group, as one whose kept
    /// log was found damaged at a start is. It grants no vote until its group took it out and
    /// added it back (it forgets what it voted and acknowledged), and its leader sends it a
    /// new snapshot, written anew. Why: a record that never reads again (a bad sector) left
    /// the replica a voter for ever that could serve nothing, retrying each tick.
    fn give_up_restore(&mut self, shard: &ShardId, why: &str, now: Instant) {
        let Some(mut h) = self.replicas.remove(shard) else { return };
        self.restores.active.remove(shard);
        self.restores.counts.given_up += 1;
        self.awake.remove(shard);
        let (me, term) = (h.replica.id(), h.replica.term());
        let held = h.restoring.take().map(|r| r.held).unwrap_or_default();
        let owed = held.into_iter().filter_map(|o| match o {
            ReplicaOutput::Answer { token, .. } => Some(token),
            _ => None,
        });
        let owed: Vec<u64> = owed.chain(h.replica.abandon()).collect();
        for token in owed {
            self.broker.handle_replicated(crate::transport::WriteToken(token), Answer::LeadershipLost, now);
        }
        // Its group may sleep (settled: it held the whole log) and its new replica, rejoining,
        // never stands for election to wake it: each of the other replicas is told at once,
        // as a rejoining replica tells them on every message (the leader takes it out and
        // adds it back; the others note it). In the term it knew, which the leader's engine
        // takes as a heartbeat's answer.
        for (&id, name) in h.names.iter().filter(|(id, _)| **id != me) {
            let mut m = Message::default();
            m.set_msg_type(MessageType::MsgHeartbeatResponse);
            (m.from, m.to, m.term) = (me, id, term);
            m.context = REJOIN_CONTEXT.to_vec().into();
            self.ship_replica_message(name.clone(), shard, m);
        }
        self.flush_shard_sends();
        self.out.push_back(NodeOutput::DropReplica { shard: shard.clone() });
        let secs = RESTORE_GIVE_UP.as_secs();
        let why = format!("its snapshot's state could not be read back for {secs} s ({why})");
        let what = format!("{why}: it drops its log and rejoins its group afresh");
        start_rejoin(&mut self.rejoining, &mut self.rejoin_counts, &mut self.out, shard, why, what);
        // Started again, empty, at the next tick.
        self.synced = None;
    }

    /// Restores whose last read failed ask again (at each tick). A replica elected while its
    /// state is read back serves nothing of its shard, so it hands its leadership to the
    /// voter most caught up, which serves the shard meanwhile. (Leadership is not handed to
    /// a restoring replica: it ignores the leader's `MsgTimeoutNow`, so the two never bounce
    /// it between them.)
    pub(super) fn retry_restores(&mut self, now: Instant) {
        // (A replica dropped while it restored takes its restore with it.)
        let replicas = &self.replicas;
        self.restores.active.retain(|s| replicas.get(s).is_some_and(|h| h.restoring.is_some()));
        let due: Vec<ShardId> = (self.restores.active.iter())
            .filter(|s| self.replicas.get(*s).and_then(|h| h.restoring.as_ref()).is_some_and(|r| r.token.is_none()))
            .cloned()
            .collect();
        for shard in due {
            if let Some(r) = self.replicas.get_mut(&shard).and_then(|h| h.restoring.as_mut()) {
                ask(&mut self.restores, &mut self.next_replica_read, &mut self.out, &shard, r);
            }
        }
        let elected: Vec<ShardId> = (self.restores.active.iter())
            .filter(|s| self.replicas.get(*s).is_some_and(|h| h.replica.is_leader() && !h.replica.transferring()))
            .cloned()
            .collect();
        for shard in elected {
            let Some(h) = self.replicas.get_mut(&shard) else { continue };
            let me = h.replica.id();
            let to = (h.replica.progress().into_iter())
                .filter(|(id, _)| *id != me)
                .max_by_key(|(id, matched)| (*matched, std::cmp::Reverse(*id)))
                .map(|(id, _)| id);
            if let Some(to) = to {
                h.replica.transfer_leader(to);
                self.restores.counts.handed_over += 1;
                self.drain_replica(&shard, now);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica's state as snapshot data: the group's own (version 1, next offset 9, one
    /// producer with one sequence landed) then `host`.
    fn snapshot_data(host: &[u8]) -> Vec<u8> {
        let mut d = vec![1];
        d.extend_from_slice(&9u64.to_be_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&[0; 24]);
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&[0; 16]);
        d.extend_from_slice(host);
        d
    }

    fn chunks(data: &[u8], size: usize) -> Vec<Bytes> {
        data.chunks(size).map(Bytes::copy_from_slice).collect()
    }

    #[test]
    fn a_received_snapshot_is_split_where_the_groups_own_state_ends_its_chunks_kept_as_they_came() {
        let host = stream_state_with_commits(300);
        let data = snapshot_data(&host);
        let own = data.len() - host.len();
        // Chunks of 7 bytes: the group's own state ends inside one.
        let sent = chunks(&data, 7);
        let (head, rest) = split_received(sent.clone(), Kind::Stream).unwrap();
        assert_eq!(&head[..], &data[..own]);
        assert_eq!(rest.len(), host.len() as u64);
        assert!(rest.holds_commits(), "a commit section");
        let mut pieces = Vec::new();
        rest.pieces(&mut |p| pieces.push(p.to_vec()));
        assert_eq!(pieces.concat(), host);
        assert!(pieces.len() >= host.len() / 7, "handed over as the chunks came");
        // Beside the message's data, the record's data is the snapshot's, byte for byte.
        let mut s = crate::cluster::meta::Snapshot::default();
        s.set_data(head);
        rest.append_to(&mut s);
        assert_eq!(&s.data[..], &data[..]);
        // A cache's state holds no commits; a stream's without the section neither.
        assert!(!split_received(sent, Kind::Cache).unwrap().1.holds_commits());
        let plain = snapshot_data(&host[..13]);
        assert!(!split_received(chunks(&plain, 5), Kind::Stream).unwrap().1.holds_commits());
        // Not a replica's state: the chunks come back as they were.
        let junk = chunks(&[9u8; 40], 16);
        assert_eq!(split_received(junk.clone(), Kind::Stream).unwrap_err(), junk);
    }

    /// A stream's host state with a commit section (version, timestamp, no groups, the
    /// section) holding one value of `n` bytes.
    fn stream_state_with_commits(n: usize) -> Vec<u8> {
        let checkpoint = crate::storage::encode_state_checkpoint(&crate::storage::StateCheckpoint {
            as_of: 3,
            values: vec![("k".into(), Bytes::from(vec![7u8; n]), 3)],
        })
        .unwrap();
        let mut host = vec![1];
        host.extend_from_slice(&5u64.to_be_bytes());
        host.extend_from_slice(&0u32.to_be_bytes());
        host.push(1);
        host.extend_from_slice(&(checkpoint.len() as u32).to_be_bytes());
        host.extend_from_slice(&checkpoint);
        host
    }

    fn kept(data: Vec<u8>) -> RaftLog {
        let mut s = crate::cluster::meta::Snapshot::default();
        s.set_data(data.into());
        s.mut_metadata().index = 40;
        RaftLog { snapshot: Some(s), ..RaftLog::default() }
    }

    #[test]
    fn a_kept_snapshots_host_state_is_left_on_disk_from_its_size_on_and_the_rest_kept_whole() {
        use crate::cluster::meta::RestOnDisk;
        let host = stream_state_with_commits(300);
        let data = snapshot_data(&host);
        let own = data.len() - host.len();
        let len = host.len() as u64;
        // From `min` on: the data cut where the group's own state ends, the rest's length and
        // what it holds said beside.
        let mut log = kept(data.clone());
        assert!(ClusterNode::leave_kept_state_on_disk(&mut log, len));
        assert_eq!(log.snapshot.as_ref().unwrap().get_data(), &data[..own]);
        assert_eq!(log.snapshot_rest_on_disk, Some(RestOnDisk { len, holds_commits: true }));
        // What the replica restores from it: its own state, and the host's state to read back.
        let mut r = Replica::new_hosting(1, &[1], &log, Some(0), true).unwrap();
        let restored = std::iter::from_fn(|| r.poll_output()).find_map(|o| match o {
            ReplicaOutput::Restored { next_offset, state, at, len, received, .. } => {
                Some((next_offset, state.len(), at, len, received))
            }
            _ => None,
        });
        assert_eq!(restored, Some((9, 0, own as u64, host.len() as u64, false)));
        // Left once: called again, nothing changes.
        let before = log.clone();
        assert!(!ClusterNode::leave_kept_state_on_disk(&mut log, 0));
        assert_eq!(log, before);
        // A newer snapshot kept is whole again.
        let mut newer = crate::cluster::meta::Snapshot::default();
        newer.set_data(data.clone().into());
        newer.mut_metadata().index = 50;
        log.persist_snapshot(&newer);
        assert_eq!(log.snapshot_rest_on_disk, None);
        // Below `min`, with no host state, or data that does not read: left whole.
        for (data, min) in [(data.clone(), len + 1), (snapshot_data(&[]), 0), (vec![9u8; 40], 0)] {
            let mut log = kept(data);
            let before = log.clone();
            assert!(!ClusterNode::leave_kept_state_on_disk(&mut log, min));
            assert_eq!(log, before);
        }
        // A state without commits says so.
        let mut log = kept(snapshot_data(&host[..13]));
        assert!(ClusterNode::leave_kept_state_on_disk(&mut log, 1));
        assert_eq!(log.snapshot_rest_on_disk, Some(RestOnDisk { len: 13, holds_commits: false }));
    }
}
