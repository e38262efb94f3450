//! A deterministic simulation of one replicated shard ([`Replica`]s of a Raft group) with
//! idempotent producers, under message loss, duplication, delay (so reordering), partitions and
//! crashes — a crash can come between any two outputs of a replica, so what it had not yet made
//! durable (and everything after) is lost, the leader mid-write included — with restarts from
//! the Raft log kept. Everything comes from one seed, so a failure replays exactly
//! (`felix-node sim --replicated --seed N`).
//!
//! A linearizability-style checker, as the run goes and at its end:
//! * **one history**: every replica delivers the same batch at the same offset (a record once
//!   delivered — committed — is never lost or changed by a fail-over);
//! * **offsets only grow** within one life of a replica, with no gaps but generation starts;
//! * **at most one leader per term**;
//! * **exactly once**: an acknowledged batch is in the history at the offset it was answered
//!   with, and no (producer, sequence) is in the history twice, however often it was retried;
//! * **progress**: once healed, every producer's batches are acknowledged and every replica
//!   holds the same log;
//! * **the host's state travels with the log**: each replica's host keeps state of its own
//!   folded from the records (as a replicated cache's values or a stream's commit state are),
//!   carried in checkpoints, written in place when taken (even seeds, a cache's way) or held
//!   unencoded and encoded only when the log is compacted to it (odd seeds, a commit state's
//!   way: [`HostPart`]); whatever offset a replica's host reaches, by delivering records or by
//!   restoring a snapshot, its state there is the one every other replica's had there.

use super::meta::{RaftLog, decode_message, encode_message};
use super::replica::{Answer, HostPart, Replica, ReplicaOutput, ReplicatedBatch};
use super::sim::{Rng, Violation};
use bytes::Bytes;
use std::collections::{BTreeMap, BTreeSet};

/// What a run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ReplicaReport {
    /// Replicas.
    pub replicas: usize,
    /// Batches acknowledged.
    pub acked: u64,
    /// Of them, answered as duplicates of an earlier send (a retry of a batch that committed).
    pub duplicates: u64,
    /// Answers `leadership_lost` or `quorum_timeout` (then retried).
    pub outcome_unknown: u64,
    /// Crashes (each a restart from the kept log).
    pub crashes: u64,
    /// Leader changes seen.
    pub elections: u64,
    /// Generation starts delivered (over every replica and life: a restart replays them).
    pub generations: u64,
    /// Messages lost or cut.
    pub lost: u64,
    /// Digest of the history: equal for equal seeds.
    pub digest: u64,
    /// Logs compacted into a snapshot (a replica's retention dropped the records before it).
    pub compactions: u64,
    /// Replicas that caught up from a leader's snapshot (they were behind its compaction).
    pub snapshots_installed: u64,
    /// Reads of entries that had left a replica's memory, answered from its kept log and
    /// taken (a follower behind was sent them).
    pub entry_reads: u64,
    /// Committed entries restarts left on disk and replayed in reads (two seeds of three).
    pub replayed: u64,
    /// Reads of a leader's last snapshot, kept on disk only, answered and taken (a follower
    /// behind its compaction was sent it).
    pub snapshot_reads: u64,
    /// Host states restored from a snapshot (at a restart, or sent) and found to be the state
    /// every replica had at its offset.
    pub host_restores: u64,
}

impl ReplicaReport {
    /// Adds another run's counts (for totals over seeds; `replicas` and `digest` are per run).
    pub fn absorb(&mut self, r: &ReplicaReport) {
        self.acked += r.acked;
        self.duplicates += r.duplicates;
        self.outcome_unknown += r.outcome_unknown;
        self.crashes += r.crashes;
        self.replayed += r.replayed;
        self.elections += r.elections;
        self.generations += r.generations;
        self.lost += r.lost;
        self.compactions += r.compactions;
        self.snapshots_installed += r.snapshots_installed;
        self.entry_reads += r.entry_reads;
        self.snapshot_reads += r.snapshot_reads;
        self.host_restores += r.host_restores;
    }
}

/// Entry bytes between checkpoints: small, so logs are compacted (and lagging replicas sent
/// snapshots) within a run.
const CHECKPOINT_BYTES: u64 = 400;

/// Entry bytes a replica keeps in memory once applied: about two entries, so a follower a
/// few entries behind is served from the kept log (the driver's disk, here).
const ENTRY_CACHE: u64 = 300;

/// What a slot of the shared history holds.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Slot {
    Generation,
    Record { producer: Option<(u64, u64)>, at: u64, payload: Bytes },
}

struct Node {
    replica: Option<Replica>,
    kept: RaftLog,
    /// The next offset this life expects to deliver.
    next: u64,
    /// The host's state, this life.
    host: Host,
}

/// A host's state of its own, folded from the records delivered: how many, and each
/// producer's last payload (a value per key, shared with the record it came in, as a
/// replicated cache or a commit state keeps values).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Host {
    records: u64,
    last: BTreeMap<u64, Bytes>,
}

impl Host {
    fn apply(&mut self, producer: Option<(u64, u64)>, payload: &Bytes) {
        self.records += 1;
        self.last.insert(producer.map_or(0, |p| p.0), payload.clone());
    }

    /// A digest of the state (compared across replicas at each offset).
    fn digest(&self) -> u64 {
        let mut d = self.records;
        for (k, v) in &self.last {
            d = d.rotate_left(7) ^ k;
            for b in v.iter() {
                d = d.rotate_left(3) ^ u64::from(*b);
            }
        }
        d
    }

    /// The state as checkpoint bytes: `u64 records`, `u32 n`, then `n` times `u64 key`,
    /// `u32 len` and the value.
    fn encode_into(&self, out: &mut Vec<u8>) {
        out.extend_from_slice(&self.records.to_be_bytes());
        out.extend_from_slice(&(self.last.len() as u32).to_be_bytes());
        for (k, v) in &self.last {
            out.extend_from_slice(&k.to_be_bytes());
            out.extend_from_slice(&(v.len() as u32).to_be_bytes());
            out.extend_from_slice(v);
        }
    }

    /// Reads [`encode_into`](Self::encode_into)'s bytes; `None` for bytes that do not read
    /// whole.
    fn decode(mut b: &[u8]) -> Option<Host> {
        let mut take = |n: usize| -> Option<&[u8]> {
            let (head, rest) = b.split_at_checked(n)?;
            b = rest;
            Some(head)
        };
        let records = u64::from_be_bytes(take(8)?.try_into().ok()?);
        let n = u32::from_be_bytes(take(4)?.try_into().ok()?);
        let mut last = BTreeMap::new();
        for _ in 0..n {
            let k = u64::from_be_bytes(take(8)?.try_into().ok()?);
            let len = u32::from_be_bytes(take(4)?.try_into().ok()?) as usize;
            last.insert(k, Bytes::copy_from_slice(take(len)?));
        }
        b.is_empty().then_some(Host { records, last })
    }
}

/// A host's state kept unencoded in a checkpoint until the log is compacted to it: a copy of
/// the map, its values shared with the live state's (the way a commit state is kept).
#[derive(Debug)]
struct FrozenHost(Host);

impl HostPart for FrozenHost {
    fn encode_into(&self, out: &mut Vec<u8>) {
        self.0.encode_into(out);
    }

    fn encoded_len(&self) -> usize {
        12 + self.0.last.values().map(|v| 12 + v.len()).sum::<usize>()
    }
}

/// An idempotent producer: one batch in flight at a time, retried under the same sequence
/// until acknowledged.
struct Producer {
    id: u64,
    seq: u64,
    /// Sent to (replica, token) at step; `None` when it must be (re)sent.
    inflight: Option<(u64, u64, u64)>,
    target: u64,
    acked: BTreeMap<u64, u64>,
}

struct World {
    seed: u64,
    step: u64,
    ids: Vec<u64>,
    nodes: BTreeMap<u64, Node>,
    network: Vec<(u64, u64, u64, Vec<u8>)>,
    cut: BTreeSet<(u64, u64)>,
    history: BTreeMap<u64, Slot>,
    leaders: BTreeMap<u64, u64>,
    producers: Vec<Producer>,
    next_token: u64,
    /// token → (producer index, sequence)
    tokens: BTreeMap<u64, (usize, u64)>,
    report: ReplicaReport,
    leader: Option<u64>,
    /// Once healing: producers stop at these sequences, so the replicas can converge.
    stop_at: Option<Vec<u64>>,
    /// Offsets each replica retains (its log is compacted below them).
    retain: u64,
    /// Reads of kept logs asked for: (due step, replica, low, high, max bytes).
    reads: Vec<(u64, u64, u64, u64, u64)>,
    /// Reads of kept snapshots asked for: (due step, replica, index).
    snapshot_reads: Vec<(u64, u64, u64)>,
    /// The digest of the host's state every replica reached at an offset (after delivering
    /// what precedes it), the first time one did.
    host_states: BTreeMap<u64, u64>,
}

impl World {
    fn violation(&self, what: String) -> Violation {
        Violation { seed: self.seed, step: self.step, what }
    }

    /// Carries out replica `id`'s outputs in order; with `crash_chance`, it may crash between
    /// two of them (losing the rest: what was not yet persisted, and what depended on it).
    fn drain(&mut self, id: u64, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        loop {
            if lossy && rng.chance(2) && self.nodes.get(&id).is_some_and(|n| n.replica.is_some()) {
                self.crash(id);
                return Ok(());
            }
            let Some(o) = self.nodes.get_mut(&id).and_then(|n| n.replica.as_mut()).and_then(Replica::poll_output)
            else {
                return Ok(());
            };
            match o {
                ReplicaOutput::Persist { entries, hard_state } => {
                    if let Some(n) = self.nodes.get_mut(&id) {
                        n.kept.persist(&entries, hard_state.as_ref());
                    }
                }
                ReplicaOutput::PersistSnapshot { mut snapshot, rest } => {
                    if let Some(rest) = rest {
                        rest.append_to(&mut snapshot);
                    }
                    if let Some(n) = self.nodes.get_mut(&id) {
                        n.kept.persist_snapshot(&snapshot);
                    }
                }
                // The host's state as of the checkpoint: everything before it was delivered.
                ReplicaOutput::CheckpointDue { index } => {
                    let frozen = self.seed % 2 == 1;
                    if let Some(n) = self.nodes.get_mut(&id)
                        && let Some(r) = n.replica.as_mut()
                    {
                        if frozen {
                            r.finish_checkpoint_with(index, Some(Box::new(FrozenHost(n.host.clone()))));
                        } else if let Some(data) = r.checkpoint_due(index) {
                            n.host.encode_into(data);
                            r.finish_checkpoint(index);
                        }
                    }
                }
                ReplicaOutput::Restored { next_offset, state, .. } => {
                    let Some(host) = Host::decode(&state) else {
                        return Err(self.violation(format!("r{id} restored a host state that does not read")));
                    };
                    match self.host_states.get(&next_offset) {
                        Some(d) if *d != host.digest() => {
                            return Err(self.violation(format!(
                                "r{id} restored a snapshot at offset {next_offset} whose host state ({} records) is not the one replicas had there",
                                host.records
                            )));
                        }
                        Some(_) => self.report.host_restores += 1,
                        None => {
                            return Err(self.violation(format!(
                                "r{id} restored a host state at offset {next_offset}, which no replica reached"
                            )));
                        }
                    }
                    if let Some(n) = self.nodes.get_mut(&id) {
                        n.host = host;
                    }
                    let next = self.nodes.get(&id).map_or(0, |n| n.next);
                    if next_offset < next {
                        return Err(self.violation(format!(
                            "r{id} restored a snapshot at offset {next_offset}, behind what it delivered ({next})"
                        )));
                    }
                    if next_offset > self.history.len() as u64 {
                        return Err(self.violation(format!(
                            "r{id} restored a snapshot at offset {next_offset}, past every offset committed ({})",
                            self.history.len()
                        )));
                    }
                    // A restart starts from 0; a life already under way was sent the snapshot.
                    if next > 0 {
                        self.report.snapshots_installed += 1;
                    }
                    if let Some(n) = self.nodes.get_mut(&id) {
                        n.next = next_offset;
                    }
                }
                ReplicaOutput::Send { to, message } => {
                    let bytes = encode_message(&message);
                    if self.cut.contains(&(id, to)) || (lossy && rng.chance(50)) {
                        self.report.lost += 1;
                        continue;
                    }
                    let delay = if lossy { rng.below(4) } else { 0 };
                    self.network.push((self.step + 1 + delay, id, to, bytes.clone()));
                    if lossy && rng.chance(20) {
                        self.network.push((self.step + 1 + rng.below(6), id, to, bytes));
                    }
                }
                ReplicaOutput::GenerationStart { offset, .. } => {
                    self.deliver(id, offset, Slot::Generation)?;
                    self.report.generations += 1;
                }
                ReplicaOutput::Delivered { offset, batch, .. } => {
                    for (i, p) in batch.payloads().iter().enumerate() {
                        let slot = Slot::Record { producer: batch.producer, at: i as u64, payload: p.clone() };
                        self.deliver(id, offset + i as u64, slot)?;
                    }
                }
                ReplicaOutput::Answer { token, answer } => self.answer(token, answer)?,
                // (This simulation proposes no side entries.)
                ReplicaOutput::Side { .. } => {}
                ReplicaOutput::ReadEntries { low, high, max_bytes } => {
                    let due = self.step + if lossy { rng.below(4) } else { 0 };
                    self.reads.push((due, id, low, high, max_bytes));
                }
                ReplicaOutput::ReadSnapshot { index } => {
                    let due = self.step + if lossy { rng.below(4) } else { 0 };
                    self.snapshot_reads.push((due, id, index));
                }
            }
        }
    }

    fn crash(&mut self, id: u64) {
        if let Some(n) = self.nodes.get_mut(&id)
            && n.replica.take().is_some()
        {
            self.report.crashes += 1;
        }
    }

    fn restart(&mut self, id: u64) -> Result<(), Violation> {
        let ids = self.ids.clone();
        let (seed, step) = (self.seed, self.step);
        let Some(n) = self.nodes.get_mut(&id) else { return Ok(()) };
        if n.replica.is_some() {
            return Ok(());
        }
        // In two seeds of three the restart leaves the committed front of the log on disk, as
        // the driver's fold of a long log does (all of it, or all but the newest few entries),
        // and the replica replays it in reads answered from the whole kept log.
        let mut kept = n.kept.clone();
        match seed % 3 {
            1 => kept.spill_committed(0),
            2 => kept.spill_committed(300),
            _ => {}
        }
        self.report.replayed += kept.spill.as_ref().map_or(0, |s| s.end() - s.first());
        let Some(n) = self.nodes.get_mut(&id) else { return Ok(()) };
        let mut r = Replica::new_hosting(id, &ids, &kept, None, true).map_err(|e| Violation {
            seed,
            step,
            what: format!("r{id} does not restart from its kept log: {e}"),
        })?;
        r.set_checkpoint_bytes(CHECKPOINT_BYTES);
        r.set_entry_cache(Some(ENTRY_CACHE));
        r.set_snapshot_on_disk(true);
        n.replica = Some(r);
        // A new life replays the log from the start (or from its snapshot).
        n.next = 0;
        n.host = Host::default();
        Ok(())
    }

    /// Replica `id` delivered `slot` at `offset`: it must be the next offset of this life, and
    /// the same slot every replica delivered there.
    fn deliver(&mut self, id: u64, offset: u64, slot: Slot) -> Result<(), Violation> {
        let next = self.nodes.get(&id).map_or(0, |n| n.next);
        if offset != next {
            return Err(self.violation(format!("r{id} delivered offset {offset}, expected {next}")));
        }
        if let Some(n) = self.nodes.get_mut(&id) {
            n.next = offset + 1;
            if let Slot::Record { producer, payload, .. } = &slot {
                n.host.apply(*producer, payload);
            }
        }
        let digest = self.nodes.get(&id).map_or(0, |n| n.host.digest());
        match self.host_states.get(&(offset + 1)) {
            Some(d) if *d != digest => {
                return Err(self.violation(format!(
                    "r{id}'s host state at offset {} is not the one another replica had there",
                    offset + 1
                )));
            }
            Some(_) => {}
            None => {
                self.host_states.insert(offset + 1, digest);
            }
        }
        match self.history.get(&offset) {
            Some(s) if *s != slot => {
                return Err(self.violation(format!(
                    "offset {offset}: r{id} delivered {slot:?}, another replica delivered {s:?} (a delivered record was lost)"
                )));
            }
            Some(_) => {}
            None => {
                if let Slot::Record { producer: Some(ps), at: 0, .. } = &slot
                    && self
                        .history
                        .values()
                        .any(|s| matches!(s, Slot::Record { producer: Some(p), at: 0, .. } if p == ps))
                {
                    return Err(self.violation(format!("batch {ps:?} written twice (offset {offset})")));
                }
                self.report.digest =
                    self.report.digest.rotate_left(5) ^ offset ^ u64::from(matches!(slot, Slot::Generation));
                self.history.insert(offset, slot);
            }
        }
        Ok(())
    }

    fn answer(&mut self, token: u64, answer: Answer) -> Result<(), Violation> {
        let Some((p, seq)) = self.tokens.remove(&token) else { return Ok(()) };
        let prod = &mut self.producers[p];
        // Only the answer to what is in flight now counts (an old send's late answer is moot).
        if prod.inflight.is_none_or(|(_, t, _)| t != token) {
            return Ok(());
        }
        match answer {
            Answer::Appended { offset, duplicate } => {
                let pid = prod.id;
                prod.acked.insert(seq, offset);
                prod.seq += 1;
                prod.inflight = None;
                self.report.acked += 1;
                self.report.duplicates += u64::from(duplicate);
                match self.history.get(&offset) {
                    Some(Slot::Record { producer: Some((q, s)), at: 0, .. }) if *q == pid && *s == seq => {}
                    other => {
                        return Err(self.violation(format!(
                            "producer {pid} seq {seq} acknowledged at offset {offset}, which holds {other:?}"
                        )));
                    }
                }
            }
            Answer::LeadershipLost | Answer::QuorumTimeout => {
                self.report.outcome_unknown += 1;
                prod.inflight = None;
            }
            // (This simulation moves no leadership.)
            Answer::NotProposed => prod.inflight = None,
            // One batch in flight, resent under its sequence until answered: never out of order;
            // and it proposes no side entries.
            Answer::Refused(_) | Answer::Applied | Answer::NoEnvelopes => {
                let pid = prod.id;
                return Err(self.violation(format!("producer {pid} seq {seq} answered {answer:?}")));
            }
        }
        Ok(())
    }

    fn deliver_network(&mut self, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        let now = self.step;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.network).into_iter().partition(|m| m.0 <= now);
        self.network = later;
        for (_, from, to, bytes) in due {
            if self.cut.contains(&(from, to)) {
                self.report.lost += 1;
                continue;
            }
            if let Some(r) = self.nodes.get_mut(&to).and_then(|n| n.replica.as_mut())
                && let Ok(m) = decode_message(&bytes)
            {
                r.step(m);
                self.drain(to, rng, lossy)?;
            }
        }
        Ok(())
    }

    /// Reads of kept logs that are due are answered from what each replica kept (one in ten
    /// fails when lossy, as a disk read may); a replica that crashed meanwhile gets the answer
    /// in its new life, which never asked for it.
    fn answer_reads(&mut self, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        let now = self.step;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.reads).into_iter().partition(|r| r.0 <= now);
        self.reads = later;
        for (_, id, low, high, max_bytes) in due {
            let Some(n) = self.nodes.get_mut(&id) else { continue };
            let entries = if lossy && rng.chance(10) {
                Err("the disk failed the read".to_owned())
            } else {
                Ok(n.kept.read(low, high, max_bytes))
            };
            if let Some(r) = n.replica.as_mut()
                && r.handle_entries_read(low, entries)
            {
                self.report.entry_reads += 1;
            }
            self.drain(id, rng, lossy)?;
        }
        let (due, later): (Vec<_>, Vec<_>) =
            std::mem::take(&mut self.snapshot_reads).into_iter().partition(|r| r.0 <= now);
        self.snapshot_reads = later;
        for (_, id, index) in due {
            let Some(n) = self.nodes.get_mut(&id) else { continue };
            // The last snapshot kept, whatever its index (a newer one may have replaced the
            // one asked for: the replica refuses it).
            let read = match &n.kept.snapshot {
                _ if lossy && rng.chance(10) => Err("the disk failed the read".to_owned()),
                Some(s) => Ok(s.clone()),
                None => Err("no snapshot kept".to_owned()),
            };
            if let Some(r) = n.replica.as_mut()
                && r.handle_snapshot_read(index, read)
            {
                self.report.snapshot_reads += 1;
            }
            self.drain(id, rng, lossy)?;
        }
        Ok(())
    }

    fn tick(&mut self, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        self.step += 1;
        self.deliver_network(rng, lossy)?;
        self.answer_reads(rng, lossy)?;
        for id in self.ids.clone() {
            let retain = self.retain;
            if let Some(n) = self.nodes.get_mut(&id)
                && let Some(r) = n.replica.as_mut()
            {
                r.tick();
                // Retention keeps the last `retain` offsets this replica delivered.
                if r.compact_below(n.next.saturating_sub(retain)) {
                    self.report.compactions += 1;
                }
            }
            self.drain(id, rng, lossy)?;
        }
        for id in self.ids.clone() {
            if let Some(r) = self.nodes.get(&id).and_then(|n| n.replica.as_ref())
                && r.is_leader()
            {
                match self.leaders.get(&r.term()) {
                    Some(l) if *l != id => {
                        return Err(self.violation(format!("term {} has two leaders: r{l} and r{id}", r.term())));
                    }
                    _ => {
                        self.leaders.insert(r.term(), id);
                    }
                }
                if self.leader != Some(id) {
                    self.report.elections += 1;
                    self.leader = Some(id);
                }
            }
        }
        self.send_batches(rng, lossy)
    }

    /// Producers with nothing in flight send their batch; one in flight too long (its replica
    /// crashed, its answer lost) is sent again under the same sequence.
    fn send_batches(&mut self, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        for p in 0..self.producers.len() {
            if self.stop_at.as_ref().is_some_and(|g| self.producers[p].seq >= g[p]) {
                continue;
            }
            let stale = self.producers[p].inflight.is_some_and(|(_, _, at)| self.step - at > 80);
            if stale {
                self.producers[p].inflight = None;
            }
            if self.producers[p].inflight.is_some() {
                continue;
            }
            let target = self.producers[p].target;
            let (pid, seq) = (self.producers[p].id, self.producers[p].seq);
            let payloads: Vec<Bytes> = (0..1 + seq % 3).map(|i| Bytes::from(format!("p{pid}-s{seq}-{i}"))).collect();
            let batch = ReplicatedBatch::from_payloads(Some((pid, seq)), &payloads);
            let token = self.next_token;
            self.next_token += 1;
            let Some(r) = self.nodes.get_mut(&target).and_then(|n| n.replica.as_mut()) else {
                // Down: try another.
                self.producers[p].target = self.ids[rng.below(self.ids.len() as u64) as usize];
                continue;
            };
            match r.propose(token, &batch) {
                Ok(()) => {
                    self.tokens.insert(token, (p, seq));
                    self.producers[p].inflight = Some((target, token, self.step));
                    self.drain(target, rng, lossy)?;
                }
                Err(super::meta::MetaError::NotLeader { leader: Some(l) }) => self.producers[p].target = l,
                Err(_) => self.producers[p].target = self.ids[rng.below(self.ids.len() as u64) as usize],
            }
        }
        Ok(())
    }
}

/// Runs one seed: `steps` steps with faults, then healing and the progress check.
///
/// # Errors
/// The first [`Violation`] met.
pub fn run(seed: u64, steps: u64) -> Result<ReplicaReport, Violation> {
    let mut rng = Rng(seed ^ 0x00DD_BA11_5EED);
    let n = 3 + 2 * (seed % 2);
    let ids: Vec<u64> = (1..=n).collect();
    let mut w = World {
        seed,
        step: 0,
        ids: ids.clone(),
        nodes: BTreeMap::new(),
        network: Vec::new(),
        cut: BTreeSet::new(),
        history: BTreeMap::new(),
        leaders: BTreeMap::new(),
        producers: (0..2)
            .map(|i| Producer { id: 100 + i, seq: 0, inflight: None, target: 1, acked: BTreeMap::new() })
            .collect(),
        next_token: 1,
        tokens: BTreeMap::new(),
        report: ReplicaReport { replicas: n as usize, digest: seed, ..ReplicaReport::default() },
        leader: None,
        stop_at: None,
        // One seed in three retains everything: its logs are never compacted, so a follower
        // behind is always sent entries read back from the kept log rather than a snapshot.
        retain: if seed.is_multiple_of(3) { u64::MAX } else { 4 + seed % 16 },
        reads: Vec::new(),
        snapshot_reads: Vec::new(),
        host_states: BTreeMap::from([(0, Host::default().digest())]),
    };
    for &id in &ids {
        w.nodes.insert(id, Node { replica: None, kept: RaftLog::default(), next: 0, host: Host::default() });
        w.restart(id)?;
    }
    for _ in 0..steps {
        match rng.below(100) {
            0 | 1 => {
                let id = ids[rng.below(n) as usize];
                w.crash(id);
            }
            2..=4 => {
                let id = ids[rng.below(n) as usize];
                w.restart(id)?;
            }
            5 => {
                let id = ids[rng.below(n) as usize];
                for &o in &ids {
                    if o != id {
                        w.cut.insert((id, o));
                        w.cut.insert((o, id));
                    }
                }
            }
            6..=8 => w.cut.clear(),
            _ => {}
        }
        w.tick(&mut rng, true)?;
    }
    // Heal: every link up, every replica back, nothing lost. Every producer's next batch must
    // be acknowledged, and every replica must hold the same log.
    w.cut.clear();
    for &id in &ids {
        w.restart(id)?;
    }
    let goal: Vec<u64> = w.producers.iter().map(|p| p.seq + 2).collect();
    w.stop_at = Some(goal.clone());
    let deadline = w.step + 1500;
    loop {
        w.tick(&mut rng, false)?;
        let done = w.producers.iter().zip(&goal).all(|(p, g)| p.seq >= *g);
        let same = w.nodes.values().all(|n| n.next == w.history.len() as u64);
        if done && same {
            break;
        }
        if w.step >= deadline {
            let seqs: Vec<u64> = w.producers.iter().map(|p| p.seq).collect();
            let nexts: Vec<u64> = w.nodes.values().map(|n| n.next).collect();
            return Err(w.violation(format!(
                "no progress after healing: producers at {seqs:?} (goal {goal:?}), replicas at {nexts:?} of {}",
                w.history.len()
            )));
        }
    }
    // Exactly once, at the acknowledged offsets.
    for p in &w.producers {
        for (seq, offset) in &p.acked {
            let n = w
                .history
                .values()
                .filter(|s| matches!(s, Slot::Record { producer: Some((q, s)), .. } if *q == p.id && s == seq))
                .count();
            let first = w.history.get(offset);
            if !matches!(first, Some(Slot::Record { producer: Some((q, s)), at: 0, .. }) if *q == p.id && s == seq) {
                return Err(w.violation(format!("producer {} seq {seq} not at its offset {offset}", p.id)));
            }
            let size = 1 + seq % 3;
            if n as u64 != size {
                return Err(w.violation(format!("producer {} seq {seq}: {n} records, sent {size}", p.id)));
            }
        }
    }
    Ok(w.report)
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_seed_runs_and_replays() {
        let a = super::run(5, 600).unwrap_or_else(|v| panic!("{v}"));
        assert!(a.acked > 10, "{a:?}");
        assert_eq!(super::run(5, 600), Ok(a));
    }
}
