//! The metadata group as a cluster node takes part in it: fencing while no metadata leader is
//! heard, members' leases, the leader's placement of replicas onto the least loaded brokers,
//! the metadata log compacted into snapshots and restored from one, and proposals handed to
//! the leader. A child of [`super`] in a file of its own, as [`hibernation`](super::hibernation)
//! is: it keeps the node's fields private.

use super::*;

impl ClusterNode {
    /// Fences the broker while no metadata leader was heard from for [`FENCE_AFTER`] (a
    /// broker alone in its cluster never is), and lifts it once one is.
    pub(super) fn check_fence(&mut self, now: Instant) {
        if self.meta.is_leader() {
            self.leader_contact = now;
        }
        let alone = self.meta.voters().len() <= 1;
        let lost = now.saturating_duration_since(self.leader_contact) > FENCE_AFTER;
        if lost && !matches!(self.currency, Currency::Unconfirmed { .. }) {
            // Entries may be missed from now on: a new confirmation, asked after contact
            // resumes, is needed.
            self.currency = Currency::Unconfirmed { since: self.read_ctx + 1, asked: None, of: (None, 0) };
        }
        if let Currency::Confirmed { index } = self.currency
            && self.meta.applied() >= index
        {
            self.currency = Currency::Current;
        }
        if let Currency::Unconfirmed { .. } = self.currency
            && let Some(index) = self.meta.leader_commit()
        {
            // The leader itself: its committed log has everything (Raft's leader completeness).
            self.currency =
                if self.meta.applied() >= index { Currency::Current } else { Currency::Confirmed { index } };
        }
        let at = (self.meta.leader(), self.meta.indexes().1);
        if let Currency::Unconfirmed { since, asked, of } = self.currency
            && !lost
            && !alone
            && at.0.is_some()
            && (of != at || asked.is_none_or(|a| now.saturating_duration_since(a) >= READ_INDEX_RETRY))
        {
            self.read_ctx += 1;
            self.currency = Currency::Unconfirmed { since, asked: Some(now), of: at };
            self.meta.read_index(self.read_ctx.to_be_bytes().to_vec());
            self.drain_meta(now);
        }
        let current = self.currency == Currency::Current;
        let fenced = !alone && !self.removed && (lost || !current);
        if fenced != self.broker.is_fenced() {
            self.broker.set_fenced(fenced, now);
        }
    }

    /// The leader declares down the active members it has not heard from for [`LEASE`]. A new
    /// leader starts every lease afresh.
    pub(super) fn check_leases(&mut self, now: Instant) {
        let leading = self.meta.is_leader();
        if leading && !self.was_leader {
            for name in self.names.values() {
                self.last_seen.insert(name.clone(), now);
            }
            self.marked.clear();
        }
        self.was_leader = leading;
        if !leading {
            return;
        }
        let mut down = Vec::new();
        for m in self.metadata.members().values() {
            if m.id == self.me.id || m.state != MemberState::Active {
                self.marked.remove(&m.id);
                continue;
            }
            let seen = self.last_seen.get(&m.id).copied().unwrap_or(now);
            if now.saturating_duration_since(seen) > LEASE && self.marked.insert(m.id.clone()) {
                down.push(Command::MarkDown { id: m.id.clone() });
            }
        }
        for c in down {
            self.pending.push_back(c.encode());
        }
    }

    /// A leader the metadata does not name claims its lead again (once a second: a claim can be
    /// lost with the metadata leader it was sent to, and a repeated claim for a term already
    /// recorded changes nothing). When the metadata recorded a claim for this term or a later
    /// one and still names another broker, no claim for this term can succeed: a move given up
    /// after its target led and claimed puts the shard back on the move's leaving replica, and
    /// when a later move then took that one out of the group, the shard was refused "electing a
    /// leader" for good (`felix-node sim --cluster --clients`, seed 562733). The leader then
    /// hands its lead to the follower holding the most, which claims it in a new term.
    pub(super) fn claim_lead(&mut self, shard: &ShardId, now: Instant) {
        let Some(h) = self.replicas.get_mut(shard) else { return };
        let named = self.metadata.owner(shard).is_some_and(|a| a.owner == self.me.id);
        let Some(term) = h.ready_term.filter(|_| h.role == Some(ReplicaRole::Leading) && !named) else { return };
        if self.metadata.lead_term(shard).is_none_or(|led| led < term) {
            let me = self.me.id.clone();
            self.pending.push_back(Command::Lead { shard: shard.clone(), node: me, term }.encode());
            return;
        }
        if h.replica.transferring() {
            return;
        }
        linger::hand_lead_on(&mut h.replica);
        self.drain_replica(shard, now);
    }

    /// The metadata leader spreads replicated shards' replicas over the active members (issue
    /// 33): a broker added to the cluster takes a fair share of the replica sets, and with them
    /// of the leaderships, without an operator. While every member is active (a drain and a
    /// dead broker have moves of their own) and fewer than [`MAX_BALANCE_MOVES`] replicated
    /// shards are moving, it proposes a move of a shard led by the broker holding the most
    /// replicas to the one holding the fewest (outside that shard's group), as long as they
    /// differ by more than one: the operator's `MoveShard`, which any broker's metadata applies
    /// alike (the decision is the proposer's, so brokers of other versions agree on the
    /// result), and whose target joins the group, catches up and takes the leader's place.
    /// The fewest moves that balance are made: a shard moves only off a broker above its share
    /// and onto one below. Looked at once a second.
    pub(super) fn check_replica_balance(&mut self) {
        // Its last proposals first take effect (or are lost with a leadership): counted
        // before they apply, they would be proposed again, or more shards moved than needed.
        if !self.meta.is_leader() || self.removed || self.balance_proposed_at == Some(self.metadata_changes) {
            return;
        }
        let md = &self.metadata;
        if md.members().values().any(|m| m.state != MemberState::Active) {
            return;
        }
        let moving = md.moves().keys().filter(|s| md.replicas(s).is_some()).count();
        if moving >= MAX_BALANCE_MOVES {
            return;
        }
        // Every member reads a follower's replica move (D61).
        let replica_moves = self.offers & FEATURE_REPLICA_MOVES != 0
            && md
                .members()
                .keys()
                .all(|m| *m == self.me.id || self.peer_features.get(m).is_some_and(|f| f & FEATURE_REPLICA_MOVES != 0));
        // Replicas per active member, a moving replica counted where it is going.
        let mut counts: BTreeMap<&str, usize> = md.members().keys().map(|k| (k.as_str(), 0)).collect();
        for (s, replicas) in md.replicated_shards() {
            let m = md.moving(s);
            for r in replicas {
                let at = match m {
                    Some(m) if m.from == *r => m.to.as_str(),
                    _ => r.as_str(),
                };
                if let Some(c) = counts.get_mut(at) {
                    *c += 1;
                }
            }
        }
        let mut chosen: BTreeSet<ShardId> = BTreeSet::new();
        let mut proposals = Vec::new();
        for _ in moving..MAX_BALANCE_MOVES {
            // The most loaded (ties: the higher id) and the least (ties: the lower id).
            let Some((&most, &high)) = counts.iter().max_by(|a, b| a.1.cmp(b.1).then_with(|| a.0.cmp(b.0))) else {
                break;
            };
            let Some((&least, &low)) = counts.iter().min_by(|a, b| a.1.cmp(b.1).then_with(|| a.0.cmp(b.0))) else {
                break;
            };
            if high <= low + 1 {
                break;
            }
            // A shard `most` leads moves with its leadership (leaderships spread too); else,
            // where every member reads it, a shard `most` follows (one it leads may be none).
            let candidate = |s: &ShardId, replicas: &[String]| {
                md.moving(s).is_none()
                    && !chosen.contains(s)
                    && replicas.iter().any(|r| r == most)
                    && !replicas.iter().any(|r| r == least)
            };
            let led = md
                .replicated_shards()
                .find(|(s, replicas)| candidate(s, replicas) && md.owner(s).is_some_and(|a| a.owner == most));
            let command = match led {
                Some((shard, _)) => Command::MoveShard { shard: shard.clone(), to: least.to_owned() },
                None if replica_moves => {
                    let Some((shard, _)) = md.replicated_shards().find(|(s, replicas)| candidate(s, replicas)) else {
                        break;
                    };
                    Command::MoveReplica { shard: shard.clone(), from: most.to_owned(), to: least.to_owned() }
                }
                None => break,
            };
            if let Command::MoveShard { shard, .. } | Command::MoveReplica { shard, .. } = &command {
                chosen.insert(shard.clone());
            }
            proposals.push(command);
            if let Some(c) = counts.get_mut(most) {
                *c -= 1;
            }
            if let Some(c) = counts.get_mut(least) {
                *c += 1;
            }
        }
        self.balance_moves += proposals.len() as u64;
        if !proposals.is_empty() {
            self.balance_proposed_at = Some(self.metadata_changes);
        }
        for c in proposals {
            self.pending.push_back(c.encode());
        }
    }

    /// Takes a metadata snapshot and compacts the metadata log up to what was applied (D62),
    /// once the log holds [`META_SNAPSHOT_ENTRIES`] (or what
    /// [`set_meta_snapshot_entries`](Self::set_meta_snapshot_entries) said) past the last one,
    /// and only while every voter offered [`FEATURE_META_SNAPSHOTS`]: a broker that may lead
    /// sends the snapshot to a peer behind its log, and an older one could not take it in.
    /// Called right after the metadata's outputs were all applied: `metadata` is the state at
    /// the applied index.
    pub(super) fn maybe_snapshot_meta(&mut self, now: Instant) {
        let Some(every) = self.meta_snapshot_every else { return };
        let applied = self.meta.applied();
        let since = applied.saturating_sub(self.meta.first_index().saturating_sub(1));
        if since < every || self.offers & FEATURE_META_SNAPSHOTS == 0 {
            return;
        }
        let all_read = self.meta.voters().iter().all(|v| {
            self.names.get(v).is_some_and(|n| {
                *n == self.me.id || self.peer_features.get(n).is_some_and(|f| f & FEATURE_META_SNAPSHOTS != 0)
            })
        });
        if !all_read {
            return;
        }
        let data = MetaSnapshot::encode_state(&self.metadata, &self.names, &self.voter_addrs, &self.removed_voters);
        let bytes = data.len() as u64;
        if self.meta.compact(applied, data) {
            self.meta_snapshot_counts.taken += 1;
            self.meta_snapshot_counts.bytes = bytes;
            self.drain_meta(now);
        }
    }

    /// Takes in a metadata snapshot (kept, or sent by the leader): the metadata, the voters'
    /// names and addresses, and those removed, as the log before it left them. The driver is
    /// told the peers it names (as a replay of that log would: idempotent).
    pub(super) fn restore_meta_snapshot(&mut self, s: MetaSnapshot) {
        self.meta_restored = true;
        self.metadata = s.metadata;
        self.names.extend(s.names);
        self.voter_addrs = s.addrs;
        self.removed_voters = s.removed;
        for (name, cluster_addr) in &self.voter_addrs {
            if *name != self.me.id {
                self.out.push_back(NodeOutput::PeerAdded { name: name.clone(), cluster_addr: cluster_addr.clone() });
            }
        }
        for name in &self.removed_voters {
            self.last_seen.remove(name);
            self.refused.remove(name);
            if *name != self.me.id {
                self.out.push_back(NodeOutput::PeerRemoved { name: name.clone() });
            }
        }
        self.removed = self.removed_voters.contains(&self.me.id);
        if self.removed {
            self.pending.clear();
        }
    }

    /// Applied metadata log entries past the last snapshot that make this broker take one
    /// (`None`: never); [`META_SNAPSHOT_ENTRIES`] unless set (tests and simulations set it
    /// small, an operator with `--metadata-snapshot-entries`).
    pub fn set_meta_snapshot_entries(&mut self, entries: Option<u64>) {
        self.meta_snapshot_every = entries.map(|e| e.max(1));
    }

    /// Metadata snapshots taken, received and refused, and the last one's size.
    pub fn meta_snapshot_counts(&self) -> MetaSnapshotCounts {
        self.meta_snapshot_counts
    }

    /// Leadership claims of replicated shards (`Lead`) the metadata applied on this broker.
    pub fn leads_applied(&self) -> u64 {
        self.leads_applied
    }

    /// Entries of the metadata log this broker holds (since its last snapshot).
    pub fn meta_log_entries(&self) -> u64 {
        self.meta.applied().saturating_sub(self.meta.first_index().saturating_sub(1))
    }

    /// Replica moves the metadata leader proposed to balance replicas (see
    /// `check_replica_balance`), for metrics and tests.
    pub fn balance_moves(&self) -> u64 {
        self.balance_moves
    }

    /// Hands waiting commands to the leader (itself or a peer). The leader proposes a change
    /// of voters as a Raft configuration change (one at a time: another waits for the next
    /// tick), and drops the join of a broker that is not a voter (a removed one).
    pub(super) fn flush_pending(&mut self, now: Instant) {
        let mut later = Vec::new();
        // Plain commands go to the engine together (one ready for all: a configuration
        // declaring thousands of streams is thousands of commands at once); a configuration
        // change is proposed after the ones before it, in order.
        let mut plain: Vec<Vec<u8>> = Vec::new();
        while let Some(data) = self.pending.front().cloned() {
            if self.meta.is_leader() {
                self.pending.pop_front();
                match Command::decode(&data) {
                    Ok(Command::AddVoter { id, .. }) => {
                        let _ = self.meta.propose_all(std::mem::take(&mut plain));
                        if self.meta.propose_conf_change(true, raft_id(&id), data.clone()).is_err() {
                            later.push(data);
                        }
                    }
                    Ok(Command::RemoveVoter { id, .. }) => {
                        let _ = self.meta.propose_all(std::mem::take(&mut plain));
                        if self.meta.propose_conf_change(false, raft_id(&id), data.clone()).is_err() {
                            later.push(data);
                        }
                    }
                    Ok(Command::Join { member }) if !self.meta.voters().contains(&raft_id(&member.id)) => {}
                    _ => plain.push(data),
                }
            } else if let Some(leader) = self.leader().map(str::to_owned) {
                self.pending.pop_front();
                self.out.push_back(NodeOutput::Peer { to: leader, message: PeerMessage::Propose(Bytes::from(data)) });
            } else {
                break;
            }
        }
        if !plain.is_empty() {
            let _ = self.meta.propose_all(plain);
        }
        self.pending.extend(later);
        self.drain_meta(now);
    }

    /// Carries the metadata member's outputs: Raft state to keep, messages to peers, commands
    /// to apply.
    pub(super) fn drain_meta(&mut self, now: Instant) {
        let seen = (self.meta.leader(), self.meta.term());
        if seen != self.meta_leader_seen {
            self.meta_leader_seen = seen;
            let leader = seen.0.map(|l| self.names.get(&l).cloned().unwrap_or_else(|| format!("raft id {l}")));
            self.broker.notice(Notice::MetadataLeader { leader, term: seen.1 });
        }
        let mut changed = false;
        let mut urgent = false;
        let mut confirmed = false;
        while let Some(o) = self.meta.poll_output() {
            match o {
                // The metadata group keeps its log since the last snapshot in memory (no
                // entry cache): it never reads back.
                MetaOutput::ReadEntries { .. } => {}
                // Nor its snapshot (it is small, and not kept on disk only).
                MetaOutput::ReadSnapshot { .. } => {}
                MetaOutput::PersistSnapshot { snapshot, received } => {
                    if received {
                        // This broker was behind the leader's compacted log: the snapshot
                        // stands for it, and the committed entries after it follow.
                        match MetaSnapshot::decode(snapshot.get_data()) {
                            Ok(restored) => {
                                self.meta_snapshot_counts.received += 1;
                                self.restore_meta_snapshot(restored);
                            }
                            Err(e) => {
                                // Only a newer broker's format does this (a damaged one
                                // does not pass the peer transport): its metadata stays as
                                // it was, behind, and an operator is told.
                                self.meta_snapshot_counts.refused += 1;
                                self.broker.notice(Notice::MetadataSnapshotRefused {
                                    index: snapshot.get_metadata().index,
                                    why: e.to_string(),
                                });
                            }
                        }
                    }
                    self.out.push_back(NodeOutput::PersistRaftSnapshot { snapshot, received });
                }
                MetaOutput::Persist { entries, hard_state } => {
                    self.out.push_back(NodeOutput::PersistRaft { entries, hard_state })
                }
                MetaOutput::Send { to, message } => {
                    if let Some(name) = self.names.get(&to)
                        && !self.refused.contains(name)
                    {
                        if message.get_msg_type() == MessageType::MsgSnapshot
                            && self.peer_features.get(name).is_none_or(|f| f & FEATURE_META_SNAPSHOTS == 0)
                        {
                            // An older broker would take the snapshot into its log and leave
                            // its metadata behind (D62): it waits, behind, for an upgrade.
                            self.meta_snapshot_counts.withheld += 1;
                            if self.withheld.insert(name.clone()) {
                                self.broker.notice(Notice::MetadataSnapshotWithheld { peer: name.clone() });
                            }
                            continue;
                        }
                        let message = PeerMessage::Raft(Bytes::from(encode_message(&message)));
                        self.out.push_back(NodeOutput::Peer { to: name.clone(), message });
                    }
                }
                MetaOutput::ConfChanged { added, id, context, .. } => {
                    let named = match Command::decode(&context) {
                        Ok(Command::AddVoter { id: n, cluster_addr }) => Some((n, cluster_addr)),
                        Ok(Command::RemoveVoter { id: n, .. }) => Some((n, String::new())),
                        _ => None,
                    };
                    let Some((name, cluster_addr)) =
                        named.or_else(|| self.names.get(&id).map(|n| (n.clone(), String::new())))
                    else {
                        continue;
                    };
                    if added {
                        self.names.insert(id, name.clone());
                        self.removed_voters.remove(&name);
                        if !cluster_addr.is_empty() {
                            self.voter_addrs.insert(name.clone(), cluster_addr.clone());
                        }
                        if name == self.me.id {
                            // Added (again: a replay passes through an earlier removal first).
                            self.removed = false;
                        }
                        if name != self.me.id && !cluster_addr.is_empty() {
                            self.out.push_back(NodeOutput::PeerAdded { name, cluster_addr });
                        }
                    } else {
                        self.voter_addrs.remove(&name);
                        self.removed_voters.insert(name.clone());
                        if name == self.me.id {
                            self.removed = true;
                            self.pending.clear();
                        } else {
                            self.out.push_back(NodeOutput::PeerRemoved { name: name.clone() });
                        }
                        self.last_seen.remove(&name);
                        self.refused.remove(&name);
                        // Every broker applies the removal at the same log index.
                        changed |= self.metadata.apply(&Command::RemoveVoter { id: name, force: true }).is_ok();
                    }
                }
                MetaOutput::ReadIndex { ctx, index } => {
                    let ctx = ctx.try_into().map(u64::from_be_bytes).unwrap_or(0);
                    if let Currency::Unconfirmed { since, .. } = self.currency
                        && ctx >= since
                    {
                        self.currency = Currency::Confirmed { index };
                        confirmed = true;
                    }
                }
                MetaOutput::Committed { data, .. } => {
                    // A command that does not decode or is refused changes nothing, here as on
                    // every other broker.
                    if let Ok(c) = Command::decode(&data) {
                        let applied = self.metadata.apply(&c).is_ok();
                        changed |= applied;
                        let lead = matches!(c, Command::Lead { .. });
                        urgent |= applied && !lead;
                        self.leads_applied += u64::from(applied && lead);
                    }
                }
            }
        }
        // A restored snapshot is a change the broker is told of with what follows it (at a
        // restart, the kept entries after it), never alone: the view it gives the broker is
        // the one after the whole replay, as without a snapshot.
        if std::mem::take(&mut self.meta_restored) {
            changed = true;
            urgent = true;
        }
        if changed {
            self.metadata_changes += 1;
            // The broker's view is a walk of every shard. A replicated shard's leader claim
            // (`Lead`) changes only whom it redirects to (the group itself decides who serves
            // it): thousands of those, as thousands of groups elect, are told at the next tick
            // together. Anything else is told now.
            if urgent {
                self.apply_view(now);
                self.view_behind = false;
            } else {
                self.view_behind = true;
            }
        }
        // Unfenced as soon as what was confirmed is applied (not at the next tick).
        if matches!(self.currency, Currency::Confirmed { index } if self.meta.applied() >= index) || confirmed {
            self.check_fence(now);
        }
    }
}
