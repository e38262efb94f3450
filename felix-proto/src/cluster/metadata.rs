//! The cluster's metadata: members, the registry of streams and caches, and the owner of every
//! shard. It is the state machine of the metadata Raft group ([`super::meta`]): every broker
//! applies the same committed [`Command`]s in the same order and so holds the same metadata.
//! Applying is deterministic (ordered maps, placement a pure function) and never panics.
//!
//! Owners follow [`super::placement::place`] over the active members after every change, and
//! every change of a shard's owner bumps its generation, which only grows: a request or answer
//! naming an older generation is stale.

use std::collections::BTreeMap;

pub mod snapshot;

pub use crate::shard::metadata::{Assignment, ClusterFacts, Command, Member, MemberState, Move, MovePhase};
pub use crate::shard::{Kind, MAX_SHARDS, ShardId};

/// Moves in progress at once, cluster-wide, that placement starts by itself (a join, a drain):
/// each copies a shard's records, and a joining broker should not be flooded.
pub const MAX_PLACEMENT_MOVES: usize = 4;

/// A stream's or cache's registry key: kind, tenant, namespace, name.
type Name = (Kind, String, String, String);

/// Why a command changed nothing.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommandError {
    /// No member with that id.
    #[error("no member {0}")]
    UnknownMember(String),
    /// Created already (with this many shards).
    #[error("{name} exists with {shards} shard(s)")]
    Exists {
        /// Its name.
        name: String,
        /// Its shard count.
        shards: u32,
    },
    /// Nothing by that name.
    #[error("no {0}")]
    Unknown(String),
    /// Zero shards, or more than the cluster takes.
    #[error("a shard count must be 1..={max}, not {got}")]
    BadShardCount {
        /// What was asked.
        got: u32,
        /// The largest allowed.
        max: u32,
    },
    /// The bytes are not a command.
    #[error("undecodable command: {0}")]
    Decode(String),
    /// A revocation naming neither a token id nor a principal.
    #[error("a revocation names a token id (jti), a principal (sub) or both")]
    EmptyRevocation,
    /// A move that cannot be made or a move step that does not match the move in progress.
    #[error("{0}")]
    Move(String),
    /// A leadership claim from a broker that is not a replica of the shard, or for a shard
    /// that is not replicated, or older than the leadership recorded.
    #[error("stale or foreign leadership claim for {0}")]
    StaleLead(String),
}

/// The largest replication factor of a stream or cache.
pub const MAX_REPLICATION: u32 = 7;

/// The metadata every broker of a cluster holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Metadata {
    members: BTreeMap<String, Member>,
    registry: BTreeMap<(Kind, String, String, String), u32>,
    /// Registered names kept in memory only.
    ephemeral: std::collections::BTreeSet<(Kind, String, String, String)>,
    owners: BTreeMap<ShardId, Assignment>,
    /// Replicated (`quorum`) names: their replication factor.
    replication: BTreeMap<(Kind, String, String, String), u32>,
    /// Every replicated shard's replicas (fixed when it is created) and the newest term a
    /// replica claimed leadership in.
    replicas: BTreeMap<ShardId, (Vec<String>, u64)>,
    /// Signed tokens revoked cluster-wide, by id and by principal.
    revoked_jti: std::collections::BTreeSet<String>,
    revoked_sub: std::collections::BTreeSet<String>,
    /// Moves in progress.
    moves: BTreeMap<ShardId, Move>,
    /// Shards an operator placed (or whose move was cancelled): placement leaves them on
    /// that broker while it is active.
    pins: BTreeMap<ShardId, String>,
}

impl Metadata {
    /// Token ids revoked cluster-wide ([`Command::Revoke`]).
    pub fn revoked_jti(&self) -> &std::collections::BTreeSet<String> {
        &self.revoked_jti
    }

    /// Principals whose tokens are revoked cluster-wide.
    pub fn revoked_sub(&self) -> &std::collections::BTreeSet<String> {
        &self.revoked_sub
    }

    /// Moves in progress.
    pub fn moves(&self) -> &BTreeMap<ShardId, Move> {
        &self.moves
    }

    /// The move of one shard, if it is moving.
    pub fn moving(&self, shard: &ShardId) -> Option<&Move> {
        self.moves.get(shard)
    }

    /// Shards placed by an operator (or left where a cancelled move found them), and where.
    pub fn pins(&self) -> &BTreeMap<ShardId, String> {
        &self.pins
    }

    /// The members, by id.
    pub fn members(&self) -> &BTreeMap<String, Member> {
        &self.members
    }

    /// Whether `id` is gone: not a member, or declared down (what it was asked may never be
    /// answered).
    pub fn is_gone(&self, id: &str) -> bool {
        self.members.get(id).is_none_or(|m| m.state == MemberState::Down)
    }

    /// Every shard's owner.
    pub fn owners(&self) -> &BTreeMap<ShardId, Assignment> {
        &self.owners
    }

    /// The owner of one shard.
    pub fn owner(&self, shard: &ShardId) -> Option<&Assignment> {
        self.owners.get(shard)
    }

    /// The replicas of a replicated shard (`None` for a single-replica one), in the order
    /// they were chosen.
    pub fn replicas(&self, shard: &ShardId) -> Option<&[String]> {
        self.replicas.get(shard).map(|(r, _)| r.as_slice())
    }

    /// The highest term in which a replica of `shard` claimed its lead ([`Command::Lead`]): a
    /// claim for that term or an earlier one is stale.
    pub fn lead_term(&self, shard: &ShardId) -> Option<u64> {
        self.replicas.get(shard).map(|(_, led)| *led)
    }

    /// Every replicated shard with its replicas.
    pub fn replicated_shards(&self) -> impl Iterator<Item = (&ShardId, &[String])> {
        self.replicas.iter().map(|(s, (r, _))| (s, r.as_slice()))
    }

    /// The replication factor of a stream or cache (1 when it is not replicated).
    pub fn replication(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> u32 {
        self.replication.get(&(kind, tenant.to_owned(), namespace.to_owned(), name.to_owned())).copied().unwrap_or(1)
    }

    /// How many shards a stream or cache has, if it exists.
    pub fn shard_count(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> Option<u32> {
        self.registry.get(&(kind, tenant.to_owned(), namespace.to_owned(), name.to_owned())).copied()
    }

    /// The durable shards `id` owns: their records are only on it.
    pub fn durable_shards_of(&self, id: &str) -> usize {
        self.owners
            .iter()
            .filter(|(s, a)| {
                a.owner == id
                    && !self.is_ephemeral(s.kind, &s.tenant, &s.namespace, &s.name)
                    && !self.replicas.contains_key(s)
            })
            .count()
    }

    /// Whether a shard owned by `owner` is copied to its new owner when it moves (a move
    /// with a copy and a cut-over), rather than changing owner at once: a durable stream's
    /// shard, and a cache (in memory or not: a planned move does not empty it), while its
    /// owner is a member that holds them. An in-memory stream's records mean nothing
    /// elsewhere; a replicated shard's replicas are its Raft group's.
    pub fn copied_on_move(&self, shard: &ShardId, owner: &str) -> bool {
        let kept = match shard.kind {
            Kind::Stream => !self.is_ephemeral(shard.kind, &shard.tenant, &shard.namespace, &shard.name),
            Kind::Cache => true,
        };
        kept && !self.replicas.contains_key(shard) && self.members.contains_key(owner)
    }

    /// Whether a stream or cache was created kept in memory only.
    pub fn is_ephemeral(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> bool {
        self.ephemeral.contains(&(kind, tenant.to_owned(), namespace.to_owned(), name.to_owned()))
    }

    /// Applies a committed command. A refused command changes nothing (every member refuses it
    /// the same way, so they stay equal).
    ///
    /// # Errors
    /// [`CommandError`] saying why nothing changed.
    pub fn apply(&mut self, c: &Command) -> Result<(), CommandError> {
        self.apply_inner(c, false)
    }

    /// [`apply`](Self::apply); `always_rebalance` runs the whole placement after every command
    /// that changed something, even where it is known to change nothing (what the tests
    /// compare the shortcut with).
    fn apply_inner(&mut self, c: &Command, always_rebalance: bool) -> Result<(), CommandError> {
        match c {
            Command::Join { member } => {
                // A draining member stays draining (restarted, it joins again): an operator
                // asked for it.
                let state = match self.members.get(&member.id) {
                    Some(m) if m.state == MemberState::Draining => MemberState::Draining,
                    _ => MemberState::Active,
                };
                self.members.insert(member.id.clone(), Member { state, ..member.clone() });
            }
            Command::Drain { id } => {
                let m = self.members.get_mut(id).ok_or_else(|| CommandError::UnknownMember(id.clone()))?;
                m.state = MemberState::Draining;
            }
            Command::Remove { id } => {
                self.members.remove(id).ok_or_else(|| CommandError::UnknownMember(id.clone()))?;
            }
            Command::AddVoter { .. } => return Ok(()),
            Command::RemoveVoter { id, .. } => {
                self.members.remove(id);
            }
            Command::MarkDown { id } => {
                let m = self.members.get_mut(id).ok_or_else(|| CommandError::UnknownMember(id.clone()))?;
                m.state = MemberState::Down;
            }
            Command::Create { kind, tenant, namespace, name, shards, ephemeral, replication } => {
                if *shards == 0 || *shards > MAX_SHARDS {
                    return Err(CommandError::BadShardCount { got: *shards, max: MAX_SHARDS });
                }
                let key = (*kind, tenant.clone(), namespace.clone(), name.clone());
                if let Some(&n) = self.registry.get(&key) {
                    return Err(CommandError::Exists { name: name.clone(), shards: n });
                }
                if *ephemeral {
                    self.ephemeral.insert(key.clone());
                }
                self.registry.insert(key.clone(), *shards);
                // A replicated stream kept in memory makes no sense (its log is its Raft log):
                // ephemeral wins.
                if *replication > 1 && !*ephemeral {
                    // Its replicas are chosen in `rebalance`, once enough brokers are active.
                    let rf = (*replication).min(MAX_REPLICATION);
                    self.replication.insert(key, rf);
                    let settled =
                        self.moves.is_empty() && self.members.values().all(|m| m.state != MemberState::Draining);
                    if !always_rebalance && settled {
                        // A replicated stream's shards are no broker's to place (their groups
                        // elect their leaders), so while no move is under way and no member
                        // drains (the rebalance's other work), placement of every other shard
                        // is as the last rebalance left it: only its replicas are chosen, now.
                        // The whole rebalance is a walk of every shard, which made declaring
                        // thousands of streams quadratic.
                        self.place_replicas(*kind, tenant, namespace, name, *shards, rf);
                        // Owned by its first replica until one claims the lead (as in
                        // `rebalance`).
                        for shard in 0..*shards {
                            let id = ShardId {
                                kind: *kind,
                                tenant: tenant.clone(),
                                namespace: namespace.clone(),
                                name: name.clone(),
                                shard,
                            };
                            if self.owners.contains_key(&id) {
                                continue;
                            }
                            if let Some(first) = self.replicas.get(&id).and_then(|(r, _)| r.first()).cloned() {
                                self.owners.insert(id, Assignment { owner: first, generation: 1 });
                            }
                        }
                        return Ok(());
                    }
                } else if !always_rebalance && self.place_new_shards(*kind, tenant, namespace, name, *shards) {
                    return Ok(());
                }
            }
            Command::Lead { shard, node, term } => {
                let Some((replicas, led)) = self.replicas.get_mut(shard) else {
                    return Err(CommandError::StaleLead(shard.name.clone()));
                };
                // (A replica move's target leads before the finish makes it a replica.)
                let joining = self.moves.get(shard).is_some_and(|m| m.to == *node);
                if !(replicas.contains(node) || joining) || *term <= *led {
                    return Err(CommandError::StaleLead(shard.name.clone()));
                }
                *led = *term;
                let generation = self.owners.get(shard).map_or(1, |a| a.generation + 1);
                self.owners.insert(shard.clone(), Assignment { owner: node.clone(), generation });
                // A leadership move to it is done (a replica move ends with its finish).
                if self.moves.get(shard).is_some_and(|m| m.to == *node) && replicas.contains(node) {
                    self.moves.remove(shard);
                }
                // Nothing else moves.
                return Ok(());
            }
            Command::Revoke { jti, sub } => {
                if jti.is_none() && sub.is_none() {
                    return Err(CommandError::EmptyRevocation);
                }
                self.revoked_jti.extend(jti.clone());
                self.revoked_sub.extend(sub.clone());
                // Ownership does not change.
                return Ok(());
            }
            Command::MoveShard { shard, to } => self.move_shard(shard, to)?,
            Command::MoveReplica { shard, from, to } => self.move_replica(shard, from, to)?,
            Command::Rebalance => self.pins.clear(),
            Command::CutOver { shard, from, at } => {
                let m = self
                    .moves
                    .get_mut(shard)
                    .ok_or_else(|| CommandError::Move(format!("{} is not moving", shard.name)))?;
                if m.from != *from || m.phase != MovePhase::CatchingUp {
                    return Err(CommandError::Move(format!("stale cut-over of {} from {from}", shard.name)));
                }
                m.phase = MovePhase::CutOver { at: *at };
                return Ok(());
            }
            Command::FinishMove { shard, to, at } => {
                let Some(m) = self.moves.get(shard).cloned() else {
                    return Err(CommandError::Move(format!("{} is not moving", shard.name)));
                };
                if let Some((replicas, _)) = self.replicas.get_mut(shard) {
                    // A replica move: its target takes the leaving replica's place in the group
                    // (whose configuration already says so: the finish comes from its leader).
                    if m.to != *to || replicas.contains(to) {
                        return Err(CommandError::Move(format!("stale finish of {}'s move to {to}", shard.name)));
                    }
                    match replicas.iter().position(|r| *r == m.from) {
                        Some(i) => replicas[i] = to.clone(),
                        None => replicas.push(to.clone()),
                    }
                    self.moves.remove(shard);
                    return Ok(());
                }
                if m.to != *to || m.phase != (MovePhase::CutOver { at: *at }) {
                    return Err(CommandError::Move(format!("stale finish of {}'s move to {to}", shard.name)));
                }
                self.moves.remove(shard);
                let generation = self.owners.get(shard).map_or(1, |a| a.generation + 1);
                self.owners.insert(shard.clone(), Assignment { owner: to.clone(), generation });
            }
            Command::CancelMove { shard } => {
                let m = self
                    .moves
                    .remove(shard)
                    .ok_or_else(|| CommandError::Move(format!("{} is not moving", shard.name)))?;
                self.cancelled(shard, &m);
            }
            Command::Delete { kind, tenant, namespace, name } => {
                let key = (*kind, tenant.clone(), namespace.clone(), name.clone());
                self.registry.remove(&key).ok_or_else(|| CommandError::Unknown(name.clone()))?;
                let named = |s: &ShardId| (s.kind, &s.tenant, &s.namespace, &s.name) == (key.0, &key.1, &key.2, &key.3);
                self.moves.retain(|s, _| !named(s));
                self.pins.retain(|s, _| !named(s));
                self.ephemeral.remove(&key);
                self.replication.remove(&key);
                self.replicas
                    .retain(|s, _| (s.kind, &s.tenant, &s.namespace, &s.name) != (key.0, &key.1, &key.2, &key.3));
                self.owners
                    .retain(|s, _| (s.kind, &s.tenant, &s.namespace, &s.name) != (key.0, &key.1, &key.2, &key.3));
            }
        }
        self.rebalance();
        Ok(())
    }

    /// [`Command::MoveShard`].
    fn move_shard(&mut self, shard: &ShardId, to: &str) -> Result<(), CommandError> {
        let name = || format!("{}/{}/{} shard {}", shard.tenant, shard.namespace, shard.name, shard.shard);
        let Some(a) = self.owners.get(shard).cloned() else {
            return Err(CommandError::Unknown(name()));
        };
        if !self.members.get(to).is_some_and(|m| m.state == MemberState::Active) {
            return Err(CommandError::Move(format!("{to} is not an active member")));
        }
        if let Some(m) = self.moves.get(shard) {
            return Err(CommandError::Move(format!("{} is already moving ({} → {})", name(), m.from, m.to)));
        }
        if a.owner == to {
            return Err(CommandError::Move(format!("{} is on {to} already", name())));
        }
        if self.replicas.contains_key(shard) {
            // A replicated shard is served by its group's leader. To another of its replicas
            // it moves by a leadership transfer, done when that one claims the lead; to a
            // broker outside the group, that broker replaces the leader's replica in the group
            // (added, caught up, handed the leadership, the old one removed), done with
            // [`Command::FinishMove`].
            self.moves.insert(shard.clone(), Move { from: a.owner, to: to.to_owned(), phase: MovePhase::CatchingUp });
            return Ok(());
        }
        self.pins.insert(shard.clone(), to.to_owned());
        if !self.copied_on_move(shard, &a.owner) {
            // Nothing to copy (in memory, or its owner is gone): it changes owner now.
            self.owners.insert(shard.clone(), Assignment { owner: to.to_owned(), generation: a.generation + 1 });
        } else {
            self.moves.insert(shard.clone(), Move { from: a.owner, to: to.to_owned(), phase: MovePhase::CatchingUp });
        }
        Ok(())
    }

    /// [`Command::MoveReplica`].
    fn move_replica(&mut self, shard: &ShardId, from: &str, to: &str) -> Result<(), CommandError> {
        let name = || format!("{}/{}/{} shard {}", shard.tenant, shard.namespace, shard.name, shard.shard);
        let Some((replicas, _)) = self.replicas.get(shard) else {
            return Err(CommandError::Move(format!("{} is not replicated", name())));
        };
        if !replicas.iter().any(|r| r == from) {
            return Err(CommandError::Move(format!("{from} holds no replica of {}", name())));
        }
        if replicas.iter().any(|r| r == to) {
            return Err(CommandError::Move(format!("{to} holds a replica of {} already", name())));
        }
        if !self.members.get(to).is_some_and(|m| m.state == MemberState::Active) {
            return Err(CommandError::Move(format!("{to} is not an active member")));
        }
        if let Some(m) = self.moves.get(shard) {
            return Err(CommandError::Move(format!("{} is already moving ({} → {})", name(), m.from, m.to)));
        }
        self.moves
            .insert(shard.clone(), Move { from: from.to_owned(), to: to.to_owned(), phase: MovePhase::CatchingUp });
        Ok(())
    }

    /// A move was given up: the old owner keeps the shard at the next generation (it serves
    /// again; a cut-over had stopped its writes) and placement leaves it there.
    fn cancelled(&mut self, shard: &ShardId, m: &Move) {
        if let Some((replicas, _)) = self.replicas.get(shard) {
            // Its group's leader leads on. A replica move's target that led before it was
            // given up is no replica: the shard goes back to the leaving one until the group's
            // leader claims it.
            if let Some(a) = self.owners.get_mut(shard)
                && !replicas.contains(&a.owner)
            {
                *a = Assignment { owner: m.from.clone(), generation: a.generation + 1 };
            }
            return;
        }
        if let Some(a) = self.owners.get_mut(shard) {
            a.generation += 1;
        }
        self.pins.insert(shard.clone(), m.from.clone());
    }

    /// Chooses each shard's replicas of a replicated stream: `rf` active members, starting at a
    /// different member for each shard so leaders and load spread, in a deterministic order.
    /// The first is the shard's first owner, until a replica claims leadership
    /// ([`Command::Lead`]). A replica set is a Raft group's founding voters, so it is chosen
    /// once, when `rf` brokers are active: a stream created earlier waits (its shards have no
    /// owner and are refused, retryable) rather than start with fewer replicas than asked.
    fn place_replicas(&mut self, kind: Kind, tenant: &str, namespace: &str, name: &str, shards: u32, rf: u32) {
        let active: Vec<String> =
            self.members.values().filter(|m| m.state == MemberState::Active).map(|m| m.id.clone()).collect();
        if active.len() < rf as usize {
            return;
        }
        // Where this stream starts on the ring: a stable hash of its name, so streams with
        // one shard each do not all lead on the same broker.
        let start = name.bytes().fold(0usize, |h, b| h.wrapping_mul(31).wrapping_add(usize::from(b)));
        let n = active.len();
        for shard in 0..shards {
            let first = (start + shard as usize) % n;
            let replicas: Vec<String> = (0..(rf as usize).min(n)).map(|i| active[(first + i) % n].clone()).collect();
            let id = ShardId::of(kind, tenant, namespace, name, shard);
            self.replicas.entry(id).or_insert((replicas, 0));
        }
    }

    /// Places the shards of a stream with one copy just created as the whole rebalance would,
    /// without walking every other shard: while every member is active and no move is under
    /// way, the last placement holds for every other shard, and what [`placement::place`] does
    /// with `shards` more is to give each broker its quota (the most loaded the extra ones,
    /// ties to the lower id) and fill the room left, in id order, with the new shards in
    /// order. Returns `false` (the caller runs the whole rebalance) when that does not hold:
    /// a member not active, a move, or a shard without an active owner or over its quota.
    /// The whole rebalance after every create made declaring thousands of streams quadratic
    /// (10,000 shards took 48 s to have owners).
    ///
    /// [`placement::place`]: super::placement::place
    fn place_new_shards(&mut self, kind: Kind, tenant: &str, namespace: &str, name: &str, shards: u32) -> bool {
        if !self.moves.is_empty()
            || self.members.is_empty()
            || self.members.values().any(|m| m.state != MemberState::Active)
        {
            return false;
        }
        // What the rebalance places: every registered shard of a stream with one copy that no
        // operator pinned (with every member active, none is unavailable). A replicated
        // shard has an owner only once it has replicas.
        let placed_here = |s: &ShardId| !self.replicas.contains_key(s) && !self.pins.contains_key(s);
        let mut counts: BTreeMap<&str, usize> = self.members.keys().map(|k| (k.as_str(), 0)).collect();
        let mut held = 0usize;
        for (s, a) in &self.owners {
            if !placed_here(s) {
                continue;
            }
            match counts.get_mut(a.owner.as_str()) {
                Some(c) => *c += 1,
                None => return false,
            }
            held += 1;
        }
        let registered: usize =
            self.registry.iter().filter(|(k, _)| !self.replication.contains_key(*k)).map(|(_, n)| *n as usize).sum();
        let pinned = self
            .pins
            .keys()
            .filter(|s| {
                !self.replicas.contains_key(*s)
                    && self
                        .registry
                        .get(&(s.kind, s.tenant.clone(), s.namespace.clone(), s.name.clone()))
                        .is_some_and(|n| s.shard < *n)
            })
            .count();
        let total = registered.saturating_sub(pinned);
        // Every other shard has an active owner (else the rebalance would place it too).
        if held + shards as usize != total {
            return false;
        }
        let m = counts.len();
        let (base, extra) = (total / m, total % m);
        let mut by_load: Vec<(&str, usize)> = counts.iter().map(|(k, c)| (*k, *c)).collect();
        by_load.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(b.0)));
        let mut room: BTreeMap<String, usize> = BTreeMap::new();
        for (i, (node, c)) in by_load.iter().enumerate() {
            let quota = base + usize::from(i < extra);
            if *c > quota {
                return false; // the rebalance would move one of its shards
            }
            room.insert((*node).to_owned(), quota - c);
        }
        let owners: Vec<String> = room.into_iter().flat_map(|(node, r)| std::iter::repeat_n(node, r)).collect();
        if owners.len() != shards as usize {
            return false;
        }
        for (shard, owner) in (0..shards).zip(owners) {
            let id = ShardId::of(kind, tenant, namespace, name, shard);
            let generation = self.owners.get(&id).map_or(1, |a| a.generation + 1);
            self.owners.insert(id, Assignment { owner, generation });
        }
        true
    }

    /// Whether a shard's owner is down with records only it holds (a durable shard of a member
    /// declared down): the shard waits for it.
    pub fn unavailable(&self, shard: &ShardId) -> bool {
        if self.replicas.contains_key(shard) {
            // Its replicas elect another leader; the group decides, not the lease.
            return false;
        }
        let durable =
            !self.ephemeral.contains(&(shard.kind, shard.tenant.clone(), shard.namespace.clone(), shard.name.clone()));
        durable
            && self
                .owners
                .get(shard)
                .and_then(|a| self.members.get(&a.owner))
                .is_some_and(|m| m.state == MemberState::Down)
    }

    /// Owners by placement over the active members; a changed owner gets the next generation.
    /// A durable shard whose owner is down keeps it (see [`MemberState::Down`]).
    fn rebalance(&mut self) {
        // Replicated streams still waiting for enough brokers get their replicas.
        let waiting: Vec<(Name, u32, u32)> = self
            .replication
            .iter()
            .filter_map(|(k, rf)| {
                let shards = *self.registry.get(k)?;
                let first =
                    ShardId { kind: k.0, tenant: k.1.clone(), namespace: k.2.clone(), name: k.3.clone(), shard: 0 };
                (!self.replicas.contains_key(&first)).then(|| (k.clone(), shards, *rf))
            })
            .collect();
        for ((kind, t, ns, name), shards, rf) in waiting {
            self.place_replicas(kind, &t, &ns, &name, shards, rf);
        }
        // Moves that cannot finish: the new owner is no longer active (given up: the old owner
        // serves on), or the old owner is gone with the records (placement decides afresh).
        let stuck: Vec<(ShardId, Move)> = self
            .moves
            .iter()
            .filter(|(_, m)| {
                !self.members.get(&m.to).is_some_and(|t| t.state == MemberState::Active)
                    || !self.members.contains_key(&m.from)
            })
            .map(|(s, m)| (s.clone(), m.clone()))
            .collect();
        for (s, m) in stuck {
            self.moves.remove(&s);
            if self.members.contains_key(&m.from) {
                self.cancelled(&s, &m);
            }
        }
        // A replicated shard with a replica on a draining broker: that replica is replaced by
        // an active broker outside the group when there is one; else, when it leads, its
        // leadership moves to another replica that is active.
        let active = |id: &String| self.members.get(id).is_some_and(|m| m.state == MemberState::Active);
        let draining = |id: &String| self.members.get(id).is_some_and(|m| m.state == MemberState::Draining);
        let handing: Vec<(ShardId, Move)> = self
            .replicas
            .iter()
            .filter(|(s, _)| !self.moves.contains_key(*s))
            .filter_map(|(s, (replicas, _))| {
                let owner = &self.owners.get(s)?.owner;
                let leaving = replicas.iter().find(|r| draining(r))?;
                let outside = self.members.keys().find(|m| active(m) && !replicas.contains(m));
                let (from, to) = match outside {
                    Some(to) => (leaving, to),
                    None if leaving == owner => (owner, replicas.iter().find(|r| active(r))?),
                    None => return None,
                };
                Some((s.clone(), Move { from: from.clone(), to: to.clone(), phase: MovePhase::CatchingUp }))
            })
            .collect();
        self.moves.extend(handing);
        // A pin holds while its broker is active.
        let members = &self.members;
        self.pins.retain(|_, n| members.get(n).is_some_and(|m| m.state == MemberState::Active));
        let pinned: BTreeMap<ShardId, Assignment> = self
            .owners
            .iter()
            .filter(|(s, _)| self.unavailable(s) || self.pins.contains_key(*s))
            .map(|(s, a)| (s.clone(), a.clone()))
            .collect();
        let shards: Vec<ShardId> = self
            .registry
            .iter()
            .flat_map(|((kind, tenant, namespace, name), n)| {
                (0..*n).map(move |shard| ShardId {
                    kind: *kind,
                    tenant: tenant.clone(),
                    namespace: namespace.clone(),
                    name: name.clone(),
                    shard,
                })
            })
            .filter(|s| {
                !pinned.contains_key(s)
                    && !self.replication.contains_key(&(s.kind, s.tenant.clone(), s.namespace.clone(), s.name.clone()))
            })
            .collect();
        let active: Vec<String> =
            self.members.values().filter(|m| m.state == MemberState::Active).map(|m| m.id.clone()).collect();
        // A moving shard counts as where it is going.
        let current: BTreeMap<ShardId, String> = self
            .owners
            .iter()
            .map(|(s, a)| (s.clone(), self.moves.get(s).map_or_else(|| a.owner.clone(), |m| m.to.clone())))
            .collect();
        let placed = super::placement::place(&shards, &active, &current);
        let mut next = BTreeMap::new();
        let mut starts = Vec::new();
        for s in shards {
            let old = self.owners.get(&s);
            match (placed.get(&s), old) {
                (Some(owner), Some(a)) if *owner == a.owner || self.moves.contains_key(&s) => {
                    // In place, or on its way (a later change may move it again once there).
                    next.insert(s, a.clone());
                }
                (Some(owner), Some(a)) if self.copied_on_move(&s, &a.owner) => {
                    // A durable shard or a cache whose owner still has its contents: it moves
                    // (copied first), a few at a time; the rest wait for a later change.
                    if self.moves.len() + starts.len() < MAX_PLACEMENT_MOVES {
                        starts.push((
                            s.clone(),
                            Move { from: a.owner.clone(), to: owner.clone(), phase: MovePhase::CatchingUp },
                        ));
                    }
                    next.insert(s, a.clone());
                }
                (Some(owner), old) => {
                    // New, in memory, or its owner is gone: nothing to copy.
                    let generation = old.map_or(1, |a| a.generation + 1);
                    next.insert(s, Assignment { owner: owner.clone(), generation });
                }
                // No active member: the shard keeps its last assignment (its owner is gone or
                // draining, so it is unavailable, not lost), and its generation.
                (None, Some(a)) => {
                    next.insert(s, a.clone());
                }
                (None, None) => {}
            }
        }
        next.extend(pinned);
        self.moves.extend(starts);
        // A replicated shard is owned by the replica that claimed leadership last; before any
        // did, by its first replica (so requests have somewhere to go while it elects).
        for (s, (replicas, _)) in &self.replicas {
            match self.owners.get(s) {
                Some(a) => {
                    next.insert(s.clone(), a.clone());
                }
                None => {
                    if let Some(first) = replicas.first() {
                        next.insert(s.clone(), Assignment { owner: first.clone(), generation: 1 });
                    }
                }
            }
        }
        self.owners = next;
    }
}

impl Command {
    /// The command as bytes to propose.
    pub fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// A committed command's bytes.
    ///
    /// # Errors
    /// [`CommandError::Decode`] for bytes that are not a command.
    pub fn decode(bytes: &[u8]) -> Result<Command, CommandError> {
        serde_json::from_slice(bytes).map_err(|e| CommandError::Decode(e.to_string()))
    }
}

/// What the broker reads of the metadata ([`ClusterFacts`]): the same answers as the methods
/// of the same names.
impl ClusterFacts for Metadata {
    fn members(&self) -> &BTreeMap<String, Member> {
        Metadata::members(self)
    }
    fn is_gone(&self, id: &str) -> bool {
        Metadata::is_gone(self, id)
    }
    fn owners(&self) -> &BTreeMap<ShardId, Assignment> {
        Metadata::owners(self)
    }
    fn owner(&self, shard: &ShardId) -> Option<&Assignment> {
        Metadata::owner(self, shard)
    }
    fn replicas(&self, shard: &ShardId) -> Option<&[String]> {
        Metadata::replicas(self, shard)
    }
    fn replicated_shards(&self) -> impl Iterator<Item = (&ShardId, &[String])> {
        Metadata::replicated_shards(self)
    }
    fn replication(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> u32 {
        Metadata::replication(self, kind, tenant, namespace, name)
    }
    fn shard_count(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> Option<u32> {
        Metadata::shard_count(self, kind, tenant, namespace, name)
    }
    fn is_ephemeral(&self, kind: Kind, tenant: &str, namespace: &str, name: &str) -> bool {
        Metadata::is_ephemeral(self, kind, tenant, namespace, name)
    }
    fn moves(&self) -> &BTreeMap<ShardId, Move> {
        Metadata::moves(self)
    }
    fn moving(&self, shard: &ShardId) -> Option<&Move> {
        Metadata::moving(self, shard)
    }
    fn unavailable(&self, shard: &ShardId) -> bool {
        Metadata::unavailable(self, shard)
    }
    fn revoked_jti(&self) -> &std::collections::BTreeSet<String> {
        Metadata::revoked_jti(self)
    }
    fn revoked_sub(&self) -> &std::collections::BTreeSet<String> {
        Metadata::revoked_sub(self)
    }
}

#[cfg(test)]
mod tests;
