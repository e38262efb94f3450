//! A deterministic simulation of the metadata group: N brokers' [`MetaNode`]s and [`Metadata`],
//! a network that loses, duplicates, delays (so reorders) and partitions messages, brokers that
//! crash and restart from the Raft log they kept, and a stream of membership and registry
//! commands. Everything is drawn from one seed, so a failure replays exactly.
//!
//! Checked after every step:
//! * **one history**: no two brokers ever apply different commands at the same log index;
//! * **one owner per generation**: for every shard and generation, every broker that saw it
//!   names the same owner;
//! * **generations only grow**: within one life of a broker, a shard's generation never goes
//!   down (a restart replays from the start, through the same generations);
//! * **progress**: once the faults stop (partitions healed, crashed brokers back, no loss), a
//!   command proposed to the leader is applied by every broker within a bounded time.

use super::meta::{MetaNode, MetaOutput, RaftLog, decode_message, encode_message};
use super::metadata::{Command, Kind, Member, MemberState, Metadata, ShardId};
use std::collections::{BTreeMap, BTreeSet};

/// A rule the run broke, with where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("seed {seed}, step {step}: {what}")]
pub struct Violation {
    /// The seed (replay it with [`run`]).
    pub seed: u64,
    /// The step it was found at.
    pub step: u64,
    /// What went wrong.
    pub what: String,
}

/// What a run did, for reports and for checking that a seed replays.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Outcome {
    /// Brokers in the group.
    pub nodes: usize,
    /// Commands applied (summed over brokers and lives).
    pub applied: u64,
    /// Crashes (each followed by a restart from the kept log).
    pub crashes: u64,
    /// Leader changes seen.
    pub elections: u64,
    /// Messages lost or cut by a partition.
    pub lost: u64,
    /// A digest of every broker's applied history: equal for equal seeds.
    pub digest: u64,
}

/// splitmix64: a simulation run's only source of randomness (shared by the cluster
/// simulations).
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    pub(crate) fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    pub(crate) fn chance(&mut self, per_mille: u64) -> bool {
        self.below(1000) < per_mille
    }
}

/// One broker: its Raft member (absent while crashed), what it kept, what it applied.
struct Broker {
    node: Option<MetaNode>,
    kept: RaftLog,
    metadata: Metadata,
    /// Generation per shard in this life (reset by a restart, which replays).
    generations: BTreeMap<ShardId, u64>,
    last_applied: u64,
}

struct World {
    seed: u64,
    step: u64,
    ids: Vec<u64>,
    brokers: BTreeMap<u64, Broker>,
    /// In flight: (deliver at step, from, to, bytes).
    network: Vec<(u64, u64, u64, Vec<u8>)>,
    /// Links cut by a partition (both directions listed).
    cut: BTreeSet<(u64, u64)>,
    /// Every command applied anywhere, by log index.
    history: BTreeMap<u64, Vec<u8>>,
    /// Every owner seen, by shard and generation.
    owners: BTreeMap<(ShardId, u64), String>,
    outcome: Outcome,
    leader: Option<u64>,
    digest: u64,
}

fn node_name(id: u64) -> String {
    format!("n{id}")
}

impl World {
    fn violation(&self, what: String) -> Violation {
        Violation { seed: self.seed, step: self.step, what }
    }

    /// Carries out everything broker `id` asks for, in order: keep, send, apply.
    fn drain(&mut self, id: u64, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        loop {
            let Some(b) = self.brokers.get_mut(&id) else { return Ok(()) };
            let Some(out) = b.node.as_mut().and_then(MetaNode::poll_output) else { return Ok(()) };
            match out {
                MetaOutput::Persist { entries, hard_state } => b.kept.persist(&entries, hard_state.as_ref()),
                MetaOutput::PersistSnapshot { snapshot, .. } => b.kept.persist_snapshot(&snapshot),
                MetaOutput::Send { to, message } => {
                    let bytes = encode_message(&message);
                    if self.cut.contains(&(id, to)) || (lossy && rng.chance(50)) {
                        self.outcome.lost += 1;
                        continue;
                    }
                    let delay = if lossy { rng.below(4) } else { 0 };
                    self.network.push((self.step + 1 + delay, id, to, bytes.clone()));
                    if lossy && rng.chance(20) {
                        self.network.push((self.step + 1 + rng.below(6), id, to, bytes));
                    }
                }
                MetaOutput::Committed { index, data, .. } => self.apply(id, index, data.to_vec())?,
                // The founding voters' own entries; this simulation changes no voters.
                // (No entry cache here: nothing is read back.)
                MetaOutput::ConfChanged { .. }
                | MetaOutput::ReadIndex { .. }
                | MetaOutput::ReadEntries { .. }
                | MetaOutput::ReadSnapshot { .. } => {}
            }
        }
    }

    fn apply(&mut self, id: u64, index: u64, data: Vec<u8>) -> Result<(), Violation> {
        match self.history.get(&index) {
            Some(seen) if *seen != data => {
                return Err(self.violation(format!("n{id} applied a different command at index {index}")));
            }
            Some(_) => {}
            None => {
                self.history.insert(index, data.clone());
            }
        }
        let step = self.step;
        let b = self.brokers.get_mut(&id).expect("exists");
        if index <= b.last_applied {
            return Err(Violation {
                seed: self.seed,
                step,
                what: format!("n{id} applied index {index} after {}", b.last_applied),
            });
        }
        b.last_applied = index;
        // A command that does not decode or is refused changes nothing, on every broker alike.
        if let Ok(c) = Command::decode(&data) {
            let _ = b.metadata.apply(&c);
        }
        self.outcome.applied += 1;
        self.digest = self.digest.rotate_left(7) ^ (id << 48) ^ (index << 16) ^ data.len() as u64;
        let mut seen = Vec::new();
        for (shard, a) in b.metadata.owners() {
            if let Some(&g) = b.generations.get(shard)
                && a.generation < g
            {
                return Err(Violation {
                    seed: self.seed,
                    step,
                    what: format!("n{id}: {shard:?} went from generation {g} to {}", a.generation),
                });
            }
            b.generations.insert(shard.clone(), a.generation);
            seen.push(((shard.clone(), a.generation), a.owner.clone()));
        }
        for (k, owner) in seen {
            match self.owners.get(&k) {
                Some(o) if *o != owner => {
                    return Err(self.violation(format!("{:?} generation {} has two owners: {o} and {owner}", k.0, k.1)));
                }
                Some(_) => {}
                None => {
                    self.owners.insert(k, owner);
                }
            }
        }
        Ok(())
    }

    /// Restarts a crashed broker from its kept log (its metadata is rebuilt by replay); `false`
    /// when it was running.
    fn restart(&mut self, id: u64) -> Result<bool, Violation> {
        let (seed, step, ids) = (self.seed, self.step, self.ids.clone());
        let b = self.brokers.get_mut(&id).expect("exists");
        if b.node.is_some() {
            return Ok(false);
        }
        let founding: Vec<(u64, Vec<u8>)> = ids.iter().map(|i| (*i, Vec::new())).collect();
        b.node = Some(MetaNode::restart(id, &founding, &b.kept).map_err(|e| Violation {
            seed,
            step,
            what: format!("n{id} could not restart from its log: {e}"),
        })?);
        b.metadata = Metadata::default();
        b.generations.clear();
        b.last_applied = 0;
        Ok(true)
    }

    /// Delivers what is due this step.
    fn deliver(&mut self) {
        let now = self.step;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.network).into_iter().partition(|m| m.0 <= now);
        self.network = later;
        for (_, from, to, bytes) in due {
            if self.cut.contains(&(from, to)) {
                self.outcome.lost += 1;
                continue;
            }
            if let Some(n) = self.brokers.get_mut(&to).and_then(|b| b.node.as_mut())
                && let Ok(m) = decode_message(&bytes)
            {
                // A message for a past term or a restarted peer is the engine's to ignore.
                let _ = n.step(m);
            }
        }
    }

    fn tick_all(&mut self, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        self.deliver();
        let ids = self.ids.clone();
        for &id in &ids {
            if let Some(n) = self.brokers.get_mut(&id).and_then(|b| b.node.as_mut()) {
                n.tick();
            }
            self.drain(id, rng, lossy)?;
        }
        let leader = ids.iter().copied().find(|id| self.brokers[id].node.as_ref().is_some_and(MetaNode::is_leader));
        if leader.is_some() && leader != self.leader {
            self.outcome.elections += 1;
        }
        self.leader = leader.or(self.leader);
        Ok(())
    }

    fn propose(&mut self, c: &Command, rng: &mut Rng, lossy: bool) -> Result<(), Violation> {
        let ids = self.ids.clone();
        for id in ids {
            if let Some(n) = self.brokers.get_mut(&id).and_then(|b| b.node.as_mut())
                && n.is_leader()
            {
                let _ = n.propose(c.encode());
                self.drain(id, rng, lossy)?;
            }
        }
        Ok(())
    }
}

fn command(rng: &mut Rng, ids: &[u64], made: &mut u64) -> Command {
    let id = ids[rng.below(ids.len() as u64) as usize];
    match rng.below(10) {
        0..=2 => Command::Join {
            member: Member {
                id: node_name(id),
                client_addr: format!("127.0.0.1:{}", 5000 + id),
                cluster_addr: format!("127.0.0.1:{}", 7000 + id),
                state: MemberState::Active,
                incarnation: String::new(),
            },
        },
        3 => Command::Drain { id: node_name(id) },
        9 => Command::MarkDown { id: node_name(id) },
        4 => Command::Remove { id: node_name(id) },
        5 if *made > 0 => Command::Delete {
            kind: Kind::Stream,
            tenant: "t1".into(),
            namespace: "default".into(),
            name: format!("s{}", rng.below(*made)),
        },
        _ => {
            *made += 1;
            Command::Create {
                kind: if rng.chance(200) { Kind::Cache } else { Kind::Stream },
                tenant: "t1".into(),
                namespace: "default".into(),
                name: format!("s{}", *made - 1),
                shards: 1 + rng.below(8) as u32,
                ephemeral: rng.chance(300),
                replication: 0,
            }
        }
    }
}

/// Runs one seed for `steps` steps of faults, then heals everything and checks progress.
///
/// # Errors
/// The first [`Violation`].
pub fn run(seed: u64, steps: u64) -> Result<Outcome, Violation> {
    let mut rng = Rng(seed);
    let n = if rng.chance(500) { 3 } else { 5 };
    let ids: Vec<u64> = (1..=n).collect();
    let mut brokers = BTreeMap::new();
    for &id in &ids {
        let node = MetaNode::new(id, &ids).map_err(|e| Violation { seed, step: 0, what: e.to_string() })?;
        brokers.insert(
            id,
            Broker {
                node: Some(node),
                kept: RaftLog::default(),
                metadata: Metadata::default(),
                generations: BTreeMap::new(),
                last_applied: 0,
            },
        );
    }
    let mut w = World {
        seed,
        step: 0,
        ids: ids.clone(),
        brokers,
        network: Vec::new(),
        cut: BTreeSet::new(),
        history: BTreeMap::new(),
        owners: BTreeMap::new(),
        outcome: Outcome { nodes: n as usize, ..Outcome::default() },
        leader: None,
        digest: seed,
    };
    let mut made = 0;
    // Every broker joins first (proposed until the leader took them; lost proposals are retried
    // like any other).
    for _ in 0..steps {
        w.step += 1;
        w.tick_all(&mut rng, true)?;
        match rng.below(100) {
            0..=19 => {
                let c = command(&mut rng, &ids, &mut made);
                w.propose(&c, &mut rng, true)?;
            }
            20 | 21 => {
                // Crash a running broker: it keeps only what it persisted.
                let id = ids[rng.below(n) as usize];
                let b = w.brokers.get_mut(&id).expect("exists");
                if b.node.take().is_some() {
                    w.outcome.crashes += 1;
                }
            }
            22..=24 => {
                // Restart a crashed one from its kept log; its metadata is rebuilt by replay.
                let id = ids[rng.below(n) as usize];
                if w.restart(id)? {
                    w.drain(id, &mut rng, true)?;
                }
            }
            25 => {
                // Partition: one broker cut off from the others.
                let id = ids[rng.below(n) as usize];
                for &o in &ids {
                    if o != id {
                        w.cut.insert((id, o));
                        w.cut.insert((o, id));
                    }
                }
            }
            26..=28 => w.cut.clear(),
            _ => {}
        }
    }
    // Heal: every link up, every broker back, nothing lost. Then one last command must reach
    // every broker.
    w.cut.clear();
    for &id in &ids {
        w.restart(id)?;
    }
    let marker = Command::Create {
        kind: Kind::Cache,
        tenant: "t1".into(),
        namespace: "default".into(),
        name: format!("final-{seed}"),
        shards: 1,
        ephemeral: false,
        replication: 0,
    };
    let deadline = w.step + 400;
    loop {
        w.step += 1;
        w.tick_all(&mut rng, false)?;
        let done = ids.iter().all(|id| {
            w.brokers[id].metadata.shard_count(Kind::Cache, "t1", "default", &format!("final-{seed}")).is_some()
        });
        if done {
            break;
        }
        if w.step >= deadline {
            let leader = w.leader;
            return Err(w.violation(format!("no progress after healing (leader {leader:?})")));
        }
        if w.step.is_multiple_of(20) {
            w.propose(&marker, &mut rng, false)?;
        }
    }
    // Everyone agrees at the end.
    let first = &w.brokers[&ids[0]].metadata;
    if let Some(id) = ids.iter().find(|id| w.brokers[id].metadata != *first) {
        return Err(w.violation(format!("n{id}'s metadata differs from n{}'s after healing", ids[0])));
    }
    w.outcome.digest = w.digest;
    Ok(w.outcome)
}
