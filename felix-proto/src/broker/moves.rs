//! Shard moves, this broker's part: copying a moving durable shard's records to its new owner,
//! the cut-over, and the hand-over (REFERENCE.md §10.7; the lifecycle is the metadata's,
//! [`crate::cluster::metadata::Move`]).
//!
//! The old owner serves on while the new one copies: the new owner asks for records from its
//! next offset (`copy_request`), writes what it is sent to its own storage at the same offsets
//! (with the producer and commit state stored beside them), and asks again. When an answer
//! reaches the old owner's tail, the old owner stops taking writes (`shard_unavailable` reason
//! `moving`, retry), waits for the writes already in flight, and proposes the cut-over at its
//! tail. The new owner copies up to it and proposes the finish: it owns the shard at the next
//! generation, starting it with a generation-start record, and the old owner's readers end
//! with `shard_moved` (`resume_from` its tail) after everything it committed. A cut-over that
//! does not finish in [`CUTOVER_GIVE_UP`] is cancelled by the old owner, which then serves on.
//!
//! Registering a reader and ending readers happen in one step of this state machine, so there
//! is no window in which a subscribe lands on a broker that already ended its readers: while
//! the shard is cutting over, new subscribes are refused `moving` anyway (its routes are about
//! to change), and once the move is done they are answered `not_leader` with the new owner.

use super::*;
use crate::shard::copy::{CopyAnswer, CopyBody, CopyMessage, CopyRequest};
use crate::shard::metadata::ClusterFacts;
use crate::shard::metadata::{Command, MovePhase};
use crate::shard::{Kind, ShardId};
use crate::storage::StoredBatch;
use crate::transport::WriteToken;
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

pub(super) use crate::shard::moving::{InEvent, Incoming, MoveProgress, OutEvent, Outgoing};

/// Payload bytes one copy answer carries at most.
pub const COPY_CHUNK_BYTES: u32 = 1 << 20;

/// A copy request unanswered for this long is asked again (it or its answer was lost).
const COPY_RETRY: Duration = Duration::from_millis(1000);

/// Between two requests that found nothing new (the old owner not cutting over yet).
pub(super) const COPY_POLL: Duration = Duration::from_millis(50);

/// A move proposal (cut-over, finish, cancel) not applied yet is proposed again after this.
const PROPOSE_RETRY: Duration = Duration::from_millis(1000);

/// An old owner that stopped taking writes for a cut-over that did not finish in this long
/// cancels the move and serves on (its new owner is slow or gone).
pub const CUTOVER_GIVE_UP: Duration = Duration::from_secs(5);

impl Broker {
    /// The moves of the metadata as applied here: starts sending and receiving the ones that
    /// involve this broker, and ends the ones that are over (the new owner starts its
    /// generation; a cancelled move's old owner starts a new one, a cancelled copy is dropped).
    pub(super) fn note_moves(&mut self, md: &impl ClusterFacts, local: &str, now: Instant) {
        let mut outgoing = BTreeMap::new();
        let mut incoming = BTreeMap::new();
        for (s, m) in md.moves() {
            if md.replicas(s).is_some() {
                // A replicated shard's move is its group's leadership transfer (the node's).
                continue;
            }
            let cut_at = match m.phase {
                MovePhase::CutOver { at } => Some(at),
                MovePhase::CatchingUp => None,
            };
            if m.from == local {
                // (Another move of the shard than the one this broker knew: started afresh.)
                let mut o = self
                    .membership
                    .moves_out
                    .remove(s)
                    .filter(|o| o.to() == m.to)
                    .unwrap_or_else(|| Outgoing::new(m.to.clone()));
                o.on(OutEvent::Metadata(cut_at));
                outgoing.insert(s.clone(), o);
            } else if m.to == local {
                let mut i = self
                    .membership
                    .moves_in
                    .remove(s)
                    .filter(|i| i.from == m.from)
                    .unwrap_or_else(|| Incoming::new(m.from.clone(), now));
                i.on(InEvent::Metadata { cut_at, now });
                incoming.insert(s.clone(), i);
            }
        }
        // What is left is over.
        for (s, o) in std::mem::take(&mut self.membership.moves_out) {
            let home = md.owner(&s).is_some_and(|a| a.owner == local);
            match s.kind {
                // Cancelled: this broker serves on, at a new generation.
                Kind::Stream if home => {
                    self.start_generation(&s.tenant, &s.namespace, &s.name, s.shard, now);
                }
                // Handed over: its watches go to the new owner, which goes on from the tail.
                Kind::Cache if !home => self.cache_gone(&s, o.cut_at(), md),
                // (A cancelled cache move serves on: its writes are taken again.)
                _ => {}
            }
        }
        for (s, i) in std::mem::take(&mut self.membership.moves_in) {
            if md.owner(&s).is_some_and(|a| a.owner == local) {
                // Done: it is ours from the cut-over tail on (a cache's versions go on there).
                if s.kind == Kind::Stream {
                    self.start_generation(&s.tenant, &s.namespace, &s.name, s.shard, now);
                }
            } else if i.copied_any() {
                // Cancelled: what was copied is dropped (a later move starts afresh).
                match s.kind {
                    Kind::Stream => self.reset_moved_shard(&s),
                    Kind::Cache => self.cache_gone(&s, None, md),
                }
            }
        }
        self.membership.moves_out = outgoing;
        self.membership.moves_in = incoming;
        // The new owners ask at once.
        let due: Vec<ShardId> = self.membership.moves_in.keys().cloned().collect();
        for s in due {
            self.ask_copy(&s, now, false);
        }
    }

    /// Whether writes to a shard are stopped for a cut-over here.
    pub(super) fn cutting_over(&self, shard: &ShardId) -> Option<&str> {
        self.membership.moves_out.get(shard).filter(|o| o.past_copying()).map(|o| o.to())
    }

    /// The moves this broker takes part in.
    pub fn move_progress(&self) -> Vec<MoveProgress> {
        let mut v: Vec<MoveProgress> = self
            .membership
            .moves_out
            .iter()
            .map(|(s, o)| {
                let tail = match s.kind {
                    Kind::Stream => self.shard_log(s).map_or(0, ShardLog::committed_tail),
                    Kind::Cache => {
                        self.node.caches.get(KeyRef(&s.tenant, &s.namespace, &s.name).q()).map_or(0, |c| c.tail())
                    }
                };
                MoveProgress {
                    shard: s.clone(),
                    outgoing: true,
                    peer: o.to().to_owned(),
                    copied: tail,
                    source_tail: tail,
                    cutting: o.past_copying(),
                }
            })
            .collect();
        v.extend(self.membership.moves_in.iter().map(|(s, i)| MoveProgress {
            shard: s.clone(),
            outgoing: false,
            peer: i.from.clone(),
            copied: i.next().unwrap_or(0),
            source_tail: i.source_tail,
            cutting: i.cut_at().is_some(),
        }));
        v
    }

    /// How many subscriptions this broker serves on one stream shard.
    #[cfg(any(test, feature = "testkit"))]
    pub(crate) fn subscribers_of(&self, s: &ShardId) -> usize {
        self.node
            .streams
            .get(KeyRef(&s.tenant, &s.namespace, &s.name).q())
            .and_then(|e| e.shards.get(s.shard as usize))
            .map_or(0, |sh| sh.subs.len())
    }

    fn shard_log(&self, s: &ShardId) -> Option<&ShardLog> {
        self.node
            .streams
            .get(KeyRef(&s.tenant, &s.namespace, &s.name).q())
            .and_then(|e| e.shards.get(s.shard as usize))
            .map(|sh| &sh.log)
    }

    /// Empties a shard's copy here, in memory and in storage.
    fn reset_moved_shard(&mut self, s: &ShardId) {
        let Some(sh) = self
            .node
            .streams
            .get_mut(KeyRef(&s.tenant, &s.namespace, &s.name).q())
            .and_then(|e| e.shards.get_mut(s.shard as usize))
        else {
            return;
        };
        sh.log.reset_to(0);
        sh.producers = Default::default();
        sh.state = Default::default();
        self.out.push_back(BrokerOutput::Storage(StorageOutput::ResetShard {
            tenant_id: s.tenant.clone(),
            namespace: s.namespace.clone(),
            stream: s.name.clone(),
            shard: s.shard,
        }));
    }

    /// Time passed: lost copy requests asked again, cut-overs and finishes proposed (again),
    /// a cut-over that took too long given up.
    pub(crate) fn tick_moves(&mut self, now: Instant) {
        let now = self.clock.advance(now);
        let ins: Vec<ShardId> = self.membership.moves_in.keys().cloned().collect();
        for s in ins {
            self.ask_copy(&s, now, false);
            self.maybe_finish_move(&s, now);
        }
        let outs: Vec<ShardId> = self.membership.moves_out.keys().cloned().collect();
        for s in outs {
            self.maybe_cut_over(&s, now);
        }
    }

    /// The new owner asks for what it has not copied yet, unless a request or writes are out
    /// (`force`: an answer just came, ask now).
    pub(super) fn ask_copy(&mut self, s: &ShardId, now: Instant, force: bool) {
        // A fenced broker's view may be behind (a restart's replay stops at the commit it
        // kept; a cut-off broker misses entries): a move into it there may have finished
        // long ago, and the shard taken writes here since. The copy, whose first answer
        // replaces what this broker holds of the shard, waits for a view known current.
        if self.membership.fenced {
            return;
        }
        let Some(i) = self.membership.moves_in.get_mut(s) else { return };
        if i.writing() > 0 || (!i.failed() && i.cut_at().is_some_and(|at| i.next().is_some_and(|n| n >= at))) {
            return;
        }
        let (lost, due) = i.may_ask(now, force, COPY_RETRY);
        if !(lost || due) {
            return;
        }
        // A throttled copy asks once there is budget again (the tick comes back); past what
        // the old owner held when the copy began, it keeps up unpaced.
        let copying = i.failed() || i.copy_floor.is_none_or(|f| i.next().is_none_or(|n| n < f));
        if !lost && copying && !self.membership.move_bandwidth.may_send(now) {
            return;
        }
        // (A failed copy starts again from scratch.)
        i.on(InEvent::Asked(now));
        let max_bytes = if copying { self.membership.move_bandwidth.chunk(COPY_CHUNK_BYTES) } else { COPY_CHUNK_BYTES };
        let message = CopyMessage::Request(CopyRequest { shard: s.clone(), from: i.next(), max_bytes });
        let to = i.from.clone();
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Copy { to, message }));
    }

    /// The new owner, with everything below the cut-over tail written: it proposes the finish.
    pub(super) fn maybe_finish_move(&mut self, s: &ShardId, now: Instant) {
        let local = self.membership.view.as_ref().map(|c| c.local.clone()).unwrap_or_default();
        let Some(i) = self.membership.moves_in.get_mut(s) else { return };
        let Some(at) = i.cut_at() else { return };
        if i.writing() > 0 || i.failed() || i.next().is_none_or(|n| n < at) {
            return;
        }
        if i.proposed_within(now, PROPOSE_RETRY) {
            return;
        }
        i.on(InEvent::Proposed(now));
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ProposeCluster(Command::FinishMove {
            shard: s.clone(),
            to: local,
            at,
        })));
    }

    /// The old owner, writes stopped: once the writes in flight are done it proposes the
    /// cut-over at its tail; after [`CUTOVER_GIVE_UP`] it cancels the move.
    pub(super) fn maybe_cut_over(&mut self, s: &ShardId, now: Instant) {
        let local = self.membership.view.as_ref().map(|c| c.local.clone()).unwrap_or_default();
        let Some(o) = self.membership.moves_out.get(s) else { return };
        let Some(since) = o.stopped_since().or(o.cut_at().map(|_| now)) else { return };
        let retry = !o.proposed_within(now, PROPOSE_RETRY);
        let cut = o.cut_at().is_some();
        if now.saturating_duration_since(since) >= CUTOVER_GIVE_UP && o.is_cutting() {
            if retry {
                if let Some(o) = self.membership.moves_out.get_mut(s) {
                    o.on(OutEvent::Proposed(now));
                }
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ProposeCluster(Command::CancelMove {
                    shard: s.clone(),
                })));
            }
            return;
        }
        if cut || !retry {
            return;
        }
        let at = match s.kind {
            Kind::Stream => {
                let Some(log) = self.shard_log(s) else { return };
                if !log.settled() {
                    return;
                }
                log.committed_tail()
            }
            Kind::Cache => {
                let k = key(&s.tenant, &s.namespace, &s.name);
                if !self.cache_settled(&k) {
                    return;
                }
                self.cache_tail(&k)
            }
        };
        if let Some(o) = self.membership.moves_out.get_mut(s) {
            o.on(OutEvent::Proposed(now));
        }
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ProposeCluster(Command::CutOver {
            shard: s.clone(),
            from: local,
            at,
        })));
    }

    /// A new owner asks for records (it copies a shard moving here from this broker).
    pub(crate) fn handle_copy_request(&mut self, from: &str, q: CopyRequest, now: Instant) {
        let now = self.clock.advance(now);
        if q.shard.kind == Kind::Cache {
            return self.handle_cache_copy_request(from, q, now);
        }
        let s = q.shard;
        let refuse = |why: String| CopyMessage::Answer(CopyAnswer { shard: s.clone(), body: CopyBody::Refused(why) });
        if self.membership.moves_out.get(&s).is_none_or(|o| o.to() != from) {
            let m = refuse(format!("no move of {} shard {} to {from} here", s.name, s.shard));
            return self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Copy { to: from.to_owned(), message: m }));
        }
        let Some(log) = self.shard_log(&s) else {
            let m = refuse(format!("{} is not here", s.name));
            return self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Copy { to: from.to_owned(), message: m }));
        };
        let max = (q.max_bytes.clamp(1, COPY_CHUNK_BYTES * 16)) as usize;
        let first = q.from.is_none();
        let want = q.from.unwrap_or_else(|| log.start()).max(log.start());
        let memory_start = log.memory_start();
        if want < memory_start && want < log.committed_tail() {
            // Older history is on disk: read it, answer when storage has.
            let token = self.ids.read();
            self.out.push_back(BrokerOutput::Storage(StorageOutput::Read(ReadRequest {
                token,
                tenant_id: s.tenant.clone(),
                namespace: s.namespace.clone(),
                stream: s.name.clone(),
                shard: s.shard,
                from: want,
                end: memory_start,
                max_bytes: max,
            })));
            self.node.reads.insert(token, ReadFor::Copy { to: from.to_owned(), shard: s, max, first });
            return;
        }
        let batches = log.stored_from(want, max);
        self.answer_copy(from, s, batches, first, now);
    }

    /// Storage answered the read of a copy: what it holds, or (a broker that keeps nothing on
    /// disk) from memory on.
    pub(super) fn copy_read_complete(
        &mut self,
        to: String,
        shard: ShardId,
        max: usize,
        first: bool,
        batches: Vec<StoredBatch>,
        now: Instant,
    ) {
        let batches = if batches.is_empty() {
            let Some(log) = self.shard_log(&shard) else { return };
            log.stored_from(log.memory_start(), max)
        } else {
            batches
        };
        self.answer_copy(&to, shard, batches, first, now);
    }

    /// `first`: the answer to the new owner's first request, which carries the shard's commit
    /// state when retention may have deleted commits that wrote it (the copy starts at the
    /// log's start, and those commits are not in it).
    fn answer_copy(&mut self, to: &str, s: ShardId, batches: Vec<StoredBatch>, first: bool, now: Instant) {
        let Some(log) = self.shard_log(&s) else { return };
        let (start, tail) = (log.start(), log.committed_tail());
        let state = if first && start > 0 {
            self.node
                .streams
                .get(KeyRef(&s.tenant, &s.namespace, &s.name).q())
                .and_then(|e| e.shards.get(s.shard as usize))
                .and_then(|sh| sh.state.checkpoint())
        } else {
            None
        };
        let reaches_tail = batches.last().is_none_or(|b| b.base_offset + b.count() >= tail);
        let settled = log.settled();
        // This answer brings the new owner up to the tail: stop taking writes for the cut-over.
        if reaches_tail
            && let Some(o) = self.membership.moves_out.get_mut(&s)
            && !o.is_cutting()
        {
            o.on(OutEvent::Stop(now));
            self.mark_moving(&s);
        }
        let k = key(&s.tenant, &s.namespace, &s.name);
        // The groups' state is final once their requests are refused (the cut-over) and none
        // is still being written: until then the tail is not called final either.
        let groups_settled = !self.node.writes.values().any(|w| {
            matches!(&w.sys, Some(syslog::SysPending::Group { data, shard, .. }) if *data == k && *shard == s.shard)
        });
        let cutting = self.membership.moves_out.get(&s).is_some_and(Outgoing::is_cutting) && settled && groups_settled;
        let groups = if cutting { self.groups_checkpoint(&k, s.shard) } else { None };
        let message = CopyMessage::Answer(CopyAnswer {
            shard: s.clone(),
            body: CopyBody::Batches { start, tail, cutting, batches, state, groups },
        });
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Copy { to: to.to_owned(), message }));
        self.maybe_cut_over(&s, now);
    }

    /// New writes and readers of a shard cutting over are refused `moving` (retry).
    fn mark_moving(&mut self, s: &ShardId) {
        let to = self.membership.moves_out.get(s).map(|o| o.to().to_owned()).unwrap_or_default();
        if let Some(sh) = self
            .node
            .streams
            .get_mut(KeyRef(&s.tenant, &s.namespace, &s.name).q())
            .and_then(|e| e.shards.get_mut(s.shard as usize))
        {
            // (Nothing ends: readers wait for the cut-over, then move.)
            sh.serving.on(ServingEvent::CutOver { to });
        }
    }

    /// The old owner's answer to a copy request.
    pub(crate) fn handle_copy_answer(&mut self, from: &str, a: CopyAnswer, now: Instant) {
        let now = self.clock.advance(now);
        let s = a.shard;
        let fenced = self.membership.fenced;
        let Some(i) = self.membership.moves_in.get_mut(&s) else { return };
        if i.from != from {
            return;
        }
        if fenced {
            // Asked before this broker was fenced: asked again once its view is current (see
            // `ask_copy`).
            return i.on(InEvent::Answered(Some(now)));
        }
        let (start, tail, batches, state, groups) = match a.body {
            CopyBody::Refused(_) => {
                // Not ready there yet (its metadata behind ours): ask again later.
                return i.on(InEvent::Answered(Some(crate::transport::after(now, COPY_RETRY))));
            }
            body @ CopyBody::Cache { .. } => {
                i.on(InEvent::Answered(None));
                return self.cache_copy_answer(&s, body, now);
            }
            CopyBody::Batches { start, tail, batches, state, groups, .. } => (start, tail, batches, state, groups),
        };
        i.on(InEvent::Answered(None));
        i.source_tail = tail;
        let floor = *i.copy_floor.get_or_insert(tail);
        let bytes: usize = batches.iter().filter(|b| b.base_offset < floor).map(|b| b.records.block_len()).sum();
        self.membership.move_bandwidth.charge(bytes as u64, now);
        let first = i.next().is_none();
        let mut next = i.next().unwrap_or_else(|| batches.first().map_or(start, |b| b.base_offset.min(start)));
        let k = key(&s.tenant, &s.namespace, &s.name);
        if first {
            // Whatever this broker held of the shard before (an older stay here) goes: the copy
            // is the old owner's log from its start.
            self.reset_moved_shard(&s);
            if let Some(sh) = self.node.streams.get_mut(&k).and_then(|e| e.shards.get_mut(s.shard as usize)) {
                sh.log.reset_to(next);
                // The old owner's commit state (its log no longer holds every commit that
                // wrote it): this broker's state from now on, and on its disk before the
                // batches, as retention would have kept it.
                let checkpoint = state.as_ref().and_then(|b| crate::storage::decode_state_checkpoint(b).ok());
                if let (Some(c), Some(bytes)) = (checkpoint, state) {
                    sh.state.restore_checkpoint(&c);
                    self.out.push_back(BrokerOutput::Storage(StorageOutput::Truncate {
                        tenant_id: s.tenant.clone(),
                        namespace: s.namespace.clone(),
                        stream: s.name.clone(),
                        shard: s.shard,
                        start: next,
                        producers_forgotten: Vec::new(),
                        state_checkpoint: Some(bytes),
                    }));
                }
            }
        }
        let Some(entry) = self.node.streams.get(&k) else { return };
        let (fsync, stream_shards) = (entry.config.fsync, entry.shards.len() as u32);
        let mut writes = 0;
        for b in batches {
            let end = b.base_offset + b.count();
            if end <= next {
                continue; // had it
            }
            // A gap (a write that failed there) stays a gap here.
            next = end;
            let token = self.ids.write();
            self.out.push_back(BrokerOutput::Storage(StorageOutput::Persist(PersistRequest {
                key: b.key.clone(),
                token,
                tenant_id: s.tenant.clone(),
                namespace: s.namespace.clone(),
                stream: s.name.clone(),
                shard: s.shard,
                base_offset: b.base_offset,
                records: b.records.clone(),
                timestamp_micros: b.timestamp_micros,
                publisher: b.publisher.clone(),
                generation_start: b.generation_start,
                producer: b.producer,
                state: b.state.clone(),
                fsync,
                stream_shards,
            })));
            self.membership.import_writes.insert(token, (s.clone(), b));
            writes += 1;
        }
        if let Some(records) = groups {
            // The shard's consumer groups, final (the old owner cut over): this broker's from
            // now on, and on its disk before the move finishes.
            self.take_copied_groups(&k, &s, records, now);
            writes += 1;
        }
        let Some(i) = self.membership.moves_in.get_mut(&s) else { return };
        if writes == 0 && next < tail && !first {
            // Nothing new, and offsets without records (a write that failed on the old owner).
            next = tail;
        }
        i.on(InEvent::Copied { next, writes });
        if writes == 0 {
            // Nothing new: up to date with the old owner for now.
            i.on(InEvent::Answered(Some(crate::transport::after(now, COPY_POLL))));
            self.maybe_finish_move(&s, now);
        }
    }

    /// A copied batch was written here (or not). Returns whether `token` was one.
    pub(super) fn import_written(&mut self, token: WriteToken, ok: bool, now: Instant) -> bool {
        let Some((s, b)) = self.membership.import_writes.remove(&token) else { return false };
        let Some(i) = self.membership.moves_in.get_mut(&s) else { return true };
        i.on(InEvent::Written { ok });
        let done = i.writing() == 0;
        let failed = i.failed();
        if ok
            && !failed
            && let Some(sh) = self
                .node
                .streams
                .get_mut(KeyRef(&s.tenant, &s.namespace, &s.name).q())
                .and_then(|e| e.shards.get_mut(s.shard as usize))
        {
            if let Some((pid, seq)) = b.producer {
                let end = b.base_offset + b.count();
                sh.producers.appended(pid, seq, producer::digest(b.records.raw()), b.base_offset, end, None);
            }
            sh.state.apply_stored(&b);
            sh.log.restore(b);
        }
        if done {
            self.ask_copy(&s, now, true);
            self.maybe_finish_move(&s, now);
        }
        true
    }
}
