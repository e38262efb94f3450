//! Replicated (`quorum`) shards, the broker's side. A replicated shard's log is its Raft
//! group's log ([`crate::cluster::replica::Replica`], hosted by the
//! [`crate::cluster::node::ClusterNode`]): this broker never assigns its offsets. On the leader a
//! publish becomes a proposal ([`ClusterOutput::Replicate`]) and waits for the group; on every
//! replica, the leader included, committed entries are appended as they come out of the group
//! ([`Broker::apply_replicated`]), so subscribers only ever see records a majority holds, at the
//! offsets every replica gives them.
//!
//! The role of this broker's replica decides what clients get: the leader serves once its
//! generation-start record committed (its readable bound is settled); before that it refuses
//! readers and writers `shard_unavailable` reason `not_ready`; a follower redirects to the leader
//! it knows (`not_leader`) or, while there is none, answers `shard_unavailable` reason
//! `no_leader`. A deposed leader ends its subscriptions after delivering what committed, as on
//! a shard move, and its unanswered publishes end `leadership_lost` (outcome unknown).

use super::*;
use crate::error_code::ErrorCode;
use crate::message::RefusedReason;
use crate::shard::replicated::{Answer, ApplyRefusal, ReplicatedBatch};
use crate::shard::{Kind, ShardId};
use crate::transport::{ReadToken, WriteToken};
use bytes::Bytes;
use raft::eraftpb::Entry;
use std::time::Instant;

/// The end of a replicated shard's checkpoint, kept unencoded until the checkpoint becomes a
/// snapshot ([`Broker::checkpoint_replicated_state`]).
#[derive(Debug, Clone)]
pub(crate) enum HostSection {
    /// A stream's commit state (D63).
    Commits(CommitSection),
    /// A cache's values and counters: the whole of its state.
    Cache(super::quorum_cache::CacheSection),
}

impl HostSection {
    /// Appends its bytes.
    pub(crate) fn encode_into(&self, b: &mut Vec<u8>) {
        match self {
            HostSection::Commits(c) => c.encode_into(b),
            HostSection::Cache(c) => c.encode_into(b),
        }
    }

    /// [`encode_into`](Self::encode_into)'s bytes handed to `each` in pieces.
    pub(crate) fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        match self {
            HostSection::Commits(c) => c.encode_pieces(each),
            HostSection::Cache(c) => c.encode_pieces(each),
        }
    }

    /// The bytes [`encode_into`](Self::encode_into) appends, exactly.
    pub(crate) fn encoded_len(&self) -> usize {
        match self {
            HostSection::Commits(c) => c.encoded_len(),
            HostSection::Cache(c) => c.encoded_len(),
        }
    }

    /// Whether it is a stream's commit state, which a broker from before commit state must
    /// not be sent (D63); a cache's state every broker reads.
    pub(crate) fn holds_commits(&self) -> bool {
        matches!(self, HostSection::Commits(_))
    }
}

impl Broker {
    /// The latest time the broker was given (its clock never goes back).
    pub(crate) fn last_now(&self) -> Instant {
        self.clock.last().unwrap_or_else(|| self.wall.anchor())
    }

    /// Sets the role of this broker's replica of a replicated shard (the cluster node calls it
    /// when the shard's Raft group changes leader). Becoming a follower ends the shard's
    /// subscriptions like a shard move (after what committed was delivered), with the leader's
    /// address for clients that read `shard_moved`.
    pub fn set_replica_role(&mut self, shard: &ShardId, role: ReplicaRole, now: Instant) {
        let now = self.clock.advance(now);
        if shard.kind == Kind::Cache {
            return self.set_cache_replica_role(shard, role);
        }
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        self.shard_on(&k, shard.shard, ServingEvent::Role(role), now);
    }

    /// Whether a replicated stream's checkpoint state (the host's part of a replica's snapshot
    /// data) carries the shard's commit state (D63), which a broker that did not offer
    /// `FEATURE_COMMIT_STATE` cannot read. Read from lengths alone.
    pub fn stream_state_holds_commits(state: &[u8]) -> bool {
        stream_state::stream_state_holds_commits(state)
    }

    /// Whether every member of the cluster reads a replicated stream's commit state in its
    /// snapshots (the cluster node says so as its peers' hellos and the members change): only
    /// then does retention compact a replicated shard that holds state (D63).
    pub(crate) fn set_commit_state_snapshots(&mut self, every_member_reads_them: bool) {
        self.membership.commit_state_snapshots = every_member_reads_them;
    }

    /// The committed batches of a shard held in memory from offset `from` on: base offset,
    /// whether it is a generation-start record, payloads (checkers and diagnostics).
    pub fn committed_batches(&self, shard: &ShardId, from: u64) -> Vec<(u64, bool, Vec<Bytes>)> {
        if shard.kind != Kind::Stream {
            return Vec::new();
        }
        self.node
            .streams
            .get(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())
            .and_then(|e| e.shards.get(shard.shard as usize))
            .map(|s| s.log.held_from(from))
            .unwrap_or_default()
    }

    /// The first offset a replicated shard still retains here (retention dropped what is
    /// before it), or `None` for a shard this broker does not hold.
    pub fn replicated_start(&self, shard: &ShardId) -> Option<u64> {
        if shard.kind == Kind::Cache {
            // A cache's checkpoints hold all of it: its log can go up to the latest one.
            return Some(u64::MAX);
        }
        let e = self.node.streams.get(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())?;
        Some(e.shards.get(shard.shard as usize)?.log.start())
    }

    /// A replicated shard's replica was restored from a snapshot: what is held goes (every
    /// record before `next_offset` was dropped by retention), and the log goes on from
    /// `next_offset`. Readers of the shard (a follower has none) end as on a move.
    pub(crate) fn restore_replicated(&mut self, shard: &ShardId, next_offset: u64, state: &Bytes, now: Instant) {
        self.clock.advance(now);
        if shard.kind == Kind::Cache {
            return self.restore_quorum_cache(shard, state);
        }
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        self.restore_replicated_stream(&k, shard.shard, state);
        self.restored_from(&k, shard.shard, next_offset);
    }

    /// [`restore_replicated`](Self::restore_replicated) of a state read back from
    /// the snapshot on disk a piece at a time (a follower that installed one a leader sent:
    /// see [`crate::cluster::node`]'s restores), whole now.
    pub(crate) fn restore_replicated_read(
        &mut self,
        shard: &ShardId,
        next_offset: u64,
        state: HostStateReader,
        now: Instant,
    ) {
        self.clock.advance(now);
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        match state {
            HostStateReader::Cache(r) => self.restore_quorum_cache_read(shard, r),
            HostStateReader::Stream(r) => {
                self.restore_replicated_stream_read(&k, shard.shard, r);
                self.restored_from(&k, shard.shard, next_offset);
            }
        }
    }

    /// A restored shard's log goes on from the snapshot's next offset.
    fn restored_from(&mut self, k: &Key, shard: u32, next_offset: u64) {
        let Some(sh) = self.node.streams.get_mut(k).and_then(|e| e.shards.get_mut(shard as usize)) else { return };
        if sh.log.next_offset() == next_offset && sh.log.start() == next_offset {
            return;
        }
        sh.log.reset_to(next_offset);
    }

    /// What a replicated shard's checkpoint carries besides the group's own state: a cache's
    /// values and counters; a stream's consumer groups (their settlements are side entries of
    /// its log), its last timestamp and its commit state. A stream's records are not part of its
    /// snapshots: retention dropped them before its log is compacted.
    /// Appended to `out`: a checkpoint's data, which holds the group's own state before it
    /// ([`crate::cluster::replica::Replica::checkpoint_due`]), so the host's state is written
    /// once, in place, not built apart and copied in. A stream's commit state, the end, is
    /// returned unencoded instead ([`CommitSection`]: shared with the live state, not copied),
    /// and so is a cache's whole state when its values are worth keeping aside
    /// ([`CacheSection`]), each to be encoded only if the checkpoint becomes a snapshot
    /// ([`crate::cluster::replica::HostPart`]).
    pub(crate) fn checkpoint_replicated_state(&self, shard: &ShardId, out: &mut Vec<u8>) -> Option<HostSection> {
        if shard.kind == Kind::Cache {
            self.quorum_cache_state(shard, out).map(HostSection::Cache)
        } else {
            self.replicated_stream_state_head(&key(&shard.tenant, &shard.namespace, &shard.name), shard.shard, out)
                .map(HostSection::Commits)
        }
    }

    /// [`checkpoint_replicated_state`](Self::checkpoint_replicated_state) encoded whole (the
    /// checkers compare it across replicas).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn replicated_state(&self, shard: &ShardId) -> Vec<u8> {
        let mut b = Vec::new();
        if let Some(rest) = self.checkpoint_replicated_state(shard, &mut b) {
            rest.encode_into(&mut b);
        }
        b
    }

    /// [`replicated_state`](Self::replicated_state) without its consumer groups: the version,
    /// the last timestamp and the commit state. The groups' part differs in form between
    /// replicas that agree: a leader's polls fold finished offsets into a group's cursor, which
    /// followers, never polled, do not ([`group_finished`](Self::group_finished) compares them).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn replicated_commit_state(&self, shard: &ShardId) -> Vec<u8> {
        let mut head = Vec::new();
        let rest = self.checkpoint_replicated_state(shard, &mut head);
        // Version (1 byte) and timestamp (8); group records follow.
        head.truncate(9);
        if let Some(rest) = rest {
            rest.encode_into(&mut head);
        }
        head
    }

    /// The offsets of `[lo, hi)` holding a record that consumer group `group` of replicated
    /// stream shard `shard` has finished here (acked or dead-lettered), read without moving
    /// its cursor: what replicas that agree agree on, whatever form their states are in.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn group_finished(&self, shard: &ShardId, group: &str, (lo, hi): (u64, u64)) -> Vec<u64> {
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let Some(log) = self.node.streams.get(&k).and_then(|e| e.shards.get(shard.shard as usize)).map(|s| &s.log)
        else {
            return Vec::new();
        };
        let Some(d) = self.node.groups.get(&(k.clone(), shard.shard)).and_then(|g| g.get(group)).map(|g| &g.durable)
        else {
            return Vec::new();
        };
        (lo..hi)
            .filter(|o| matches!(log.slot(*o), log::Slot::Record))
            .filter(|o| d.cursor.is_some_and(|c| *o < c) || d.finished.contains(o))
            .collect()
    }

    /// A stream shard's log here: its start and its committed tail.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn log_bounds(&self, shard: &ShardId) -> Option<(u64, u64)> {
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let log = &self.node.streams.get(&k)?.shards.get(shard.shard as usize)?.log;
        Some((log.start(), log.committed_tail()))
    }

    /// A side entry of a replicated shard committed (on every replica, in log order with its
    /// records): a stream's consumer-group settlements, folded into its groups here. It took
    /// no offset.
    pub(crate) fn apply_replicated_side(&mut self, shard: &ShardId, batch: ReplicatedBatch, now: Instant) {
        self.clock.advance(now);
        if shard.kind != Kind::Stream {
            return;
        }
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        self.fold_group_ops(&k, shard.shard, batch.records.payloads());
    }

    /// The live value and version of `key` in a cache held here (checkers and diagnostics;
    /// changes nothing).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn cache_peek(&self, tenant: &str, namespace: &str, cache: &str, key: &str) -> Option<(Bytes, u64)> {
        self.node.caches.get(KeyRef(tenant, namespace, cache).q())?.peek(key, self.last_now())
    }

    /// The sum of counter `key` of a cache held here (checkers; changes nothing).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn counter_peek(&self, tenant: &str, namespace: &str, cache: &str, key: &str) -> Option<i64> {
        self.node.counters.get(KeyRef(tenant, namespace, cache).q())?.sums.get(key).copied()
    }

    /// The value of `key` in a stream shard's commit state held here (checkers; changes
    /// nothing).
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn commit_state_peek(&self, shard: &ShardId, key: &str) -> Option<Bytes> {
        let e = self.node.streams.get(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())?;
        e.shards.get(shard.shard as usize)?.state.peek(key).cloned()
    }

    /// The role of this broker's replica of a shard, if it holds one.
    pub fn replica_role(&self, shard: &ShardId) -> Option<&ReplicaRole> {
        if shard.kind == Kind::Cache {
            return self.node.caches.get(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())?.replica.as_ref();
        }
        self.node
            .streams
            .get(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())?
            .shards
            .get(shard.shard as usize)?
            .serving
            .replica()
    }

    /// An entry of a replicated shard committed (on every replica, in log order): the batch
    /// becomes visible at `offset`, the offset the group gave it, and live subscribers get it.
    pub(crate) fn apply_replicated(
        &mut self,
        shard: &ShardId,
        offset: u64,
        entry: u64,
        batch: ReplicatedBatch,
        now: Instant,
    ) {
        let now = self.clock.advance(now);
        if shard.kind == Kind::Cache {
            return self.apply_replicated_cache(shard, offset, batch, now);
        }
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let Some(sh) = self.node.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard.shard as usize)) else {
            return;
        };
        let count = u64::from(batch.records.count());
        let state = batch.state;
        let c = super::log::Committed {
            records: batch.records,
            timestamp_micros: batch.timestamp_micros,
            publisher: batch.publisher,
            key: batch.key,
        };
        let Some(end) = sh.log.append_committed(offset, c, false, entry) else {
            return;
        };
        // A commit: its state changes take effect with its event, alike on every replica
        // (the leader checked they encode; bytes that do not decode change nothing anywhere).
        if let Some(changes) = state.as_ref().and_then(|s| crate::storage::decode_state_changes(s).ok()) {
            sh.state.apply(offset, &changes);
        }
        self.stats.records_appended += count;
        self.fanout_committed(&k, shard.shard, offset, end);
        self.wake_groups(&k, shard.shard, now);
        self.enforce_retention(Some(&k), now, false);
    }

    /// A generation-start record of a replicated shard committed at `offset` (a new leader's
    /// first entry): it takes the offset and is never delivered; the next batch carries
    /// `skipped_before` for clients that read it.
    pub(crate) fn apply_replicated_generation(&mut self, shard: &ShardId, offset: u64, entry: u64, now: Instant) {
        self.clock.advance(now);
        if shard.kind == Kind::Cache {
            // It takes the offset; a cache has no record to keep for it.
            return;
        }
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let Some(sh) = self.node.streams.get_mut(&k).and_then(|e| e.shards.get_mut(shard.shard as usize)) else {
            return;
        };
        // The entry carries no time: it takes the last batch's, alike on every replica (this
        // broker's own clock would differ from the others').
        let _ = sh.log.append_committed(offset, super::log::Committed::default(), true, entry);
    }

    /// The group's answer to a batch proposed for the publish `token`: publishers (and brokers
    /// that forwarded it) are answered. `leadership_lost` and `quorum_timeout` are outcome
    /// unknown: the batch may still commit, and an idempotent producer's retry is written once.
    pub(crate) fn handle_replicated(&mut self, token: WriteToken, answer: Answer, now: Instant) {
        let now = self.clock.advance(now);
        if self.handle_cache_answer(token, &answer).is_some() {
            return;
        }
        if let Some(p) = self.node.group_proposals.remove(&token) {
            return self.group_answered(token, p, answer, now);
        }
        let Some(ctx) = self.take_write(&token) else { return };
        let mut resume = Vec::new();
        if let Some(sh) = self.node.streams.get_mut(&ctx.key).and_then(|e| e.shards.get_mut(ctx.shard as usize)) {
            sh.replicating = sh.replicating.saturating_sub(ctx.replicated);
            if sh.replicating <= self.cfg.max_pending_write_bytes / 2 {
                resume = std::mem::take(&mut sh.paused);
            }
        }
        let result = match answer {
            Answer::Appended { offset, .. } => Ok(offset),
            Answer::LeadershipLost => Err(Refusal::new(
                ErrorCode::LeadershipLost,
                "this broker stopped leading the shard before a majority confirmed the batch: it may or may not be written",
            )),
            Answer::QuorumTimeout => Err(Refusal::new(
                ErrorCode::QuorumTimeout,
                "no majority of the shard's replicas confirmed the batch in time: it may or may not be written",
            )),
            Answer::Refused(why) => Err(sequence_refusal(why)),
            Answer::NotProposed => Err(Unavailable::Moving.refusal(ctx.shard, "another of its replicas")),
            Answer::NoEnvelopes => Err(Refusal::new(
                ErrorCode::InvalidRequest,
                "a replica of this shard runs an older broker that does not keep envelopes: nothing was written",
            )),
            // Only group settlements are side entries, and those are answered above.
            Answer::Applied => Err(Refusal::new(ErrorCode::Internal, "a publish was answered as a side entry")),
        };
        for w in ctx.waiters {
            self.finish_waiter(w, result.as_ref().map(|o| Some(*o)), now);
        }
        for (to, id) in ctx.forwards {
            let outcome = match &result {
                Ok(o) => ForwardOutcome::Appended { offset: Some(*o) },
                Err(r) => ForwardOutcome::Refused { code: r.code.clone(), retry: r.retry, message: r.message.clone() },
            };
            self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to, id, outcome }));
        }
        for (conn, sid) in resume {
            let Some(st) = self.conns.get_mut(&conn).and_then(|c| c.streams.get_mut(&sid)) else { continue };
            if st.pauses.remove(Pause::Storage) {
                st.resume_owed = true;
                self.drive_stream(conn, sid, now);
            }
        }
    }

    /// For a history read ([`StorageOutput::Read`]) of a replicated shard below what its log
    /// holds in memory: the Raft log indexes `low..high` holding the batches to read back.
    /// `None` for a shard whose older history is not in a Raft log.
    pub(crate) fn replicated_read_range(&self, r: &ReadRequest) -> Option<(u64, u64)> {
        let sh =
            self.node.streams.get(KeyRef(&r.tenant_id, &r.namespace, &r.stream).q())?.shards.get(r.shard as usize)?;
        sh.log.entry_range(r.from, r.end, r.max_bytes)
    }

    /// The entries a history read of a replicated shard asked for
    /// ([`replicated_read_range`](Self::replicated_read_range)), read back: the read completes
    /// with the batches they hold, at the offsets and times the log gave them. Entries that
    /// hold no batch the log knows (side entries, configuration changes, refused batches)
    /// are passed over.
    pub(crate) fn replicated_read_complete(
        &mut self,
        token: ReadToken,
        shard: &ShardId,
        entries: Vec<Entry>,
        now: Instant,
    ) {
        let k = KeyRef(&shard.tenant, &shard.namespace, &shard.name);
        let log = self.node.streams.get(k.q()).and_then(|e| e.shards.get(shard.shard as usize)).map(|s| &s.log);
        let mut batches = Vec::with_capacity(entries.len());
        for e in entries {
            let Some((base_offset, timestamp_micros, generation_start)) = log.and_then(|l| l.evicted_entry(e.index))
            else {
                continue;
            };
            let stored = if generation_start {
                crate::storage::StoredBatch {
                    key: None,
                    base_offset,
                    timestamp_micros,
                    generation_start,
                    publisher: None,
                    producer: None,
                    state: None,
                    records: crate::binary::Records::default(),
                }
            } else {
                let Ok(b) = ReplicatedBatch::decode_shared(e.data) else { continue };
                if b.side {
                    continue;
                }
                crate::storage::StoredBatch {
                    key: b.key,
                    base_offset,
                    timestamp_micros,
                    generation_start,
                    publisher: b.publisher,
                    producer: b.producer,
                    state: b.state,
                    records: b.records,
                }
            };
            batches.push(stored);
        }
        self.handle_read_complete(token, batches, now);
    }

    /// Proposes a batch to a replicated shard this broker leads: nothing is appended here until
    /// the group commits it. Returns the write whose context (no waiters yet) is registered.
    pub(super) fn replicate_batch(&mut self, k: &Key, shard: u32, b: publish::NewBatch, now: Instant) -> WriteToken {
        let token = self.ids.write();
        let bytes = b.records.payload_bytes() as u64;
        let batch = ReplicatedBatch {
            producer: b.idempotent,
            timestamp_micros: self.wall.micros(now),
            publisher: b.publisher,
            key: b.key,
            records: b.records,
            expected_offset: b.expected_offset,
            state: b.state,
            side: false,
        };
        if let Some(sh) = self.node.streams.get_mut(k).and_then(|e| e.shards.get_mut(shard as usize)) {
            sh.replicating += bytes;
        }
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Replicate {
            token,
            shard: stream_shard(k, shard),
            batch,
        }));
        let ctx = WriteCtx { replicated: bytes, ..WriteCtx::new(k.clone(), shard) };
        self.node.writes.insert(token, ctx);
        token
    }
}

/// The cluster's name for shard `shard` of stream `k`.
pub(super) fn stream_shard(k: &Key, shard: u32) -> ShardId {
    ShardId {
        kind: Kind::Stream,
        tenant: k.tenant().to_owned(),
        namespace: k.namespace().to_owned(),
        name: k.name().to_owned(),
        shard,
    }
}

/// The `publish_refused` for a batch its group refused when applying it (the same reasons as
/// a single broker's).
fn sequence_refusal(why: ApplyRefusal) -> Refusal {
    let (reason, message) = match why {
        ApplyRefusal::Gap { expected } => {
            (RefusedReason::SequenceGap { expected }, format!("sequence out of order, expected {expected}"))
        }
        ApplyRefusal::Expired => {
            (RefusedReason::SequenceExpired, "sequence is older than the remembered window".to_owned())
        }
        ApplyRefusal::UnknownProducer => {
            (RefusedReason::UnknownProducer, "unknown producer (its first batch is not sequence 0)".to_owned())
        }
        ApplyRefusal::OffsetMismatch { tail } => {
            (RefusedReason::OffsetMismatch { tail }, format!("the expected offset was taken; the tail is {tail}"))
        }
    };
    Refusal::new(ErrorCode::InvalidRequest, message).with_reason(reason)
}

/// A replicated shard's host state read a piece at a time ([`Broker::restore_replicated_read`]):
/// a stream's or a cache's, each value copied out as it comes.
#[derive(Debug)]
pub(crate) enum HostStateReader {
    /// A stream's groups and commit state.
    Stream(super::StreamStateReader),
    /// A cache's entries and counters.
    Cache(super::CacheStateReader),
}

impl HostStateReader {
    /// A reader for a shard of `kind`.
    pub(crate) fn new(kind: Kind) -> HostStateReader {
        match kind {
            Kind::Cache => HostStateReader::Cache(Default::default()),
            _ => HostStateReader::Stream(Default::default()),
        }
    }

    /// Takes the next bytes of the state.
    pub(crate) fn feed(&mut self, piece: &[u8]) {
        match self {
            HostStateReader::Stream(r) => r.feed(piece),
            HostStateReader::Cache(r) => r.feed(piece),
        }
    }

    /// Bytes it holds besides the values read.
    pub(crate) fn held(&self) -> usize {
        match self {
            HostStateReader::Stream(r) => r.held(),
            HostStateReader::Cache(r) => r.held(),
        }
    }
}
