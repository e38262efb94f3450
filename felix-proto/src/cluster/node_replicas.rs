//! The replicas a cluster node hosts, one Raft group per replicated shard: kept logs handed
//! over at a start, rejoins of damaged ones, persistence, moves of a replica to another broker
//! (throttled by the move budget), what each group's engine outputs (messages, entries to
//! apply, snapshots), leases, and reads of a replica's log from disk. A child of
//! [`super`] in a file of its own, as [`hibernation`](super::hibernation) is: it keeps the
//! node's fields private.

use super::snapshots::snapshot_holds_commits;
use super::*;
use crate::cluster::replica::{HostPart, SnapshotRest};

impl ClusterNode {
    /// Hands over what the driver kept of this broker's replicas (their Raft logs, read back at
    /// a restart), before the first [`handle_timeout`](Self::handle_timeout): each replica
    /// starts from its own when the metadata names it.
    pub fn set_kept_replicas(&mut self, kept: BTreeMap<ShardId, RaftLog>) {
        self.kept_replicas = kept;
    }

    /// Hands over the replicas whose kept log the driver found damaged (and why), before the
    /// first [`handle_timeout`](Self::handle_timeout). The bytes past the damage may have held
    /// this replica's vote in a term and entries it acknowledged, so what is left of the log is
    /// neither served nor voted from: each such replica starts empty, grants no vote and never
    /// campaigns, and asks its group's leader (on every message, [`REJOIN_CONTEXT`]) to take it
    /// out of the group and add it back. The leader does so once the rest of the group can
    /// commit without it; from the re-addition on (committed by a majority that excludes it, so
    /// in a term at least as high as any it could have voted in) it is a fresh member, and votes
    /// again when the leader says so ([`READDED_CONTEXT`]). It catches up from the leader like a
    /// move's target. A leader that does not know the signal leaves it a non-voting follower:
    /// safe, with one failure less to spare.
    pub fn set_damaged_replicas(&mut self, damaged: BTreeMap<ShardId, String>) {
        for (shard, why) in damaged {
            let what = format!("its kept log is damaged ({why}): it starts empty and rejoins its group afresh");
            start_rejoin(&mut self.rejoining, &mut self.rejoin_counts, &mut self.out, &shard, why, what);
        }
    }

    /// This broker's replicas rejoining their group (their kept log was damaged), and why.
    pub fn rejoining_replicas(&self) -> &BTreeMap<ShardId, String> {
        &self.rejoining
    }

    /// Rejoins started, finished and carried out here.
    pub fn rejoin_counts(&self) -> RejoinCounts {
        self.rejoin_counts
    }

    /// The leader's part in rejoins (each tick, each step tried again until the configuration
    /// shows it done): a replica that must rejoin is removed from the group's configuration,
    /// then added back; once the addition is applied (committed) it is told so.
    pub(super) fn drive_rejoins(&mut self, shard: &ShardId) {
        if self.replicas.get(shard).is_none_or(|h| h.rejoins.is_empty()) {
            return;
        }
        let members: Vec<String> = self.metadata.replicas(shard).map(<[String]>::to_vec).unwrap_or_default();
        let Some(h) = self.replicas.get_mut(shard) else { return };
        if h.rejoins.is_empty() || !h.replica.is_leader() || h.replica.transferring() {
            return;
        }
        // Only the shard's own replicas rejoin (one moved away meanwhile is forgotten).
        let names = &h.names;
        h.rejoins.retain(|id, _| names.get(id).is_some_and(|n| members.contains(n)));
        let voters = h.replica.voters();
        let progress = h.replica.progress();
        let me = h.replica.id();
        for (id, step) in h.rejoins.iter_mut() {
            let name = h.names.get(id).cloned().unwrap_or_default();
            match step {
                // The leader itself never rejoins from here (it would have to hand over first).
                RejoinStep::Remove if *id == me => {}
                // Taken out only while every other voter is caught up (a proxy for alive): the
                // group without it must still be able to commit.
                RejoinStep::Remove if voters.contains(id) => {
                    let (_, commit) = h.replica.indexes();
                    let others_current =
                        progress.iter().filter(|(v, _)| v != id && voters.contains(v)).all(|(_, m)| *m >= commit);
                    if others_current {
                        let _ = h.replica.propose_conf_change(false, *id);
                    }
                }
                RejoinStep::Remove => {
                    *step = RejoinStep::ReAdd;
                    let what = format!("took {name}'s replica out of the group to add it back afresh");
                    self.out.push_back(NodeOutput::ReplicaRejoin { shard: shard.clone(), what });
                }
                RejoinStep::ReAdd if voters.contains(id) => {
                    *step = RejoinStep::Readded;
                    self.rejoin_counts.readded += 1;
                    let what = format!("added {name}'s replica back: a fresh member");
                    self.out.push_back(NodeOutput::ReplicaRejoin { shard: shard.clone(), what });
                }
                RejoinStep::ReAdd => {
                    let _ = h.replica.propose_conf_change(true, *id);
                }
                RejoinStep::Readded => {}
            }
        }
    }

    /// The replicated shards this broker holds a replica of: shard, leader (node id), term,
    /// the next offset (the readable bound).
    pub fn replica_status(&self) -> Vec<(ShardId, Option<String>, u64, u64)> {
        self.replicas
            .iter()
            .map(|(s, h)| {
                let leader = h.replica.leader().and_then(|l| h.names.get(&l).cloned());
                (s.clone(), leader, h.replica.term(), h.replica.next_offset())
            })
            .collect()
    }

    /// The voters of this broker's replica of `shard`, by node id, as its configuration has
    /// them (`None`: no replica here).
    pub fn replica_voters(&self, shard: &ShardId) -> Option<Vec<String>> {
        let h = self.replicas.get(shard)?;
        Some(h.replica.voters().iter().map(|v| h.names.get(v).cloned().unwrap_or_else(|| format!("#{v}"))).collect())
    }

    /// This broker's replicas in detail, for `cluster status`: per shard its leader, term,
    /// role, readable bound (next offset), last and committed log index, and on the leader
    /// every replica's replicated index and lag (entries behind the leader's last).
    pub fn replica_report(&self) -> Vec<ReplicaReport> {
        self.replica_report_of(|_| true)
    }

    /// [`replica_report`](Self::replica_report) of the shards `keep` keeps (a status page's).
    pub(crate) fn replica_report_of(&self, keep: impl Fn(&ShardId) -> bool) -> Vec<ReplicaReport> {
        self.replicas
            .iter()
            .filter(|(s, _)| keep(s))
            .map(|(s, h)| {
                let (last, committed) = h.replica.indexes();
                let followers = h
                    .replica
                    .progress()
                    .into_iter()
                    .filter_map(|(id, matched)| {
                        Some((h.names.get(&id)?.clone(), matched, last.saturating_sub(matched)))
                    })
                    .collect();
                ReplicaReport {
                    shard: s.clone(),
                    leader: h.replica.leader().and_then(|l| h.names.get(&l).cloned()),
                    term: h.replica.term(),
                    role: match &h.role {
                        _ if self.rejoining.contains_key(s) => "rejoining",
                        Some(ReplicaRole::Leading) => "leader",
                        Some(ReplicaRole::Settling) => "settling",
                        _ => "follower",
                    },
                    next_offset: h.replica.next_offset(),
                    last_index: last,
                    first_index: h.replica.first_index(),
                    committed_index: committed,
                    followers,
                }
            })
            .collect()
    }

    /// The driver could not keep what a replica asked it to persist ([`NodeOutput::PersistReplica`]
    /// failed: an I/O error, a full disk). Raft's promise rests on that state being kept before
    /// anything after it is sent, so the replica stops here and now: what it was about to send
    /// (acknowledgements of entries it does not hold) is withdrawn, it votes and acknowledges
    /// nothing more, its unanswered proposals end `leadership_lost` (outcome unknown), and the
    /// shard's other replicas carry on while a majority of them is healthy. It comes back when
    /// the broker restarts (from what it did keep). Meanwhile the shard is served here as by a
    /// replica that knows no leader.
    pub fn handle_replica_persist_failed(&mut self, shard: &ShardId, why: &str, now: Instant) {
        let Some(h) = self.replicas.remove(shard) else { return };
        self.awake.remove(shard);
        self.failed_replicas.insert(shard.clone(), why.to_owned());
        for token in h.replica.abandon() {
            self.broker.handle_replicated(crate::transport::WriteToken(token), Answer::LeadershipLost, now);
        }
        self.held_moves.retain(|h| h.shard != *shard);
        self.held_bytes = self.held_moves.iter().map(|h| h.size).sum();
        let strip = |list: &mut Vec<(ShardId, RaftBytes)>| list.retain(|(s, _)| s != shard);
        for list in self.shard_sends.values_mut() {
            strip(list);
        }
        for list in self.beats.values_mut() {
            list.retain(|(s, _)| s != shard);
        }
        for o in self.out.iter_mut() {
            if let NodeOutput::Peer { message: PeerMessage::ShardRaft(list), .. } = o {
                strip(list);
            }
            if let NodeOutput::Peer { message: PeerMessage::Heartbeats(list), .. } = o {
                list.retain(|(s, _)| s != shard);
            }
        }
        // Nor does it persist anything more.
        self.out.retain(|o| {
            !matches!(o, NodeOutput::PersistReplica { shard: s, .. } | NodeOutput::PersistReplicaSnapshot { shard: s, .. } if s == shard)
        });
        self.broker.set_replica_role(shard, ReplicaRole::Following { leader: None }, now);
    }

    /// Entry bytes between the checkpoints a replica's log can be compacted to (tests and
    /// simulations make it small; [`crate::cluster::replica::CHECKPOINT_BYTES`] otherwise). For
    /// replicas started after the call.
    pub fn set_replica_checkpoint_bytes(&mut self, bytes: u64) {
        self.checkpoint_bytes = Some(bytes);
    }

    /// Entry bytes each replica started after this keeps in memory once applied, in place of
    /// [`REPLICA_ENTRY_CACHE`] (tests make it small). Only with history reads.
    pub fn set_replica_entry_cache(&mut self, bytes: u64) {
        self.entry_cache = Some(bytes);
    }

    /// This broker's replicas still replaying, after a restart, the committed entries their
    /// kept logs left on disk (they take part in their groups once done).
    pub fn replaying_replicas(&self) -> usize {
        self.replicas.values().filter(|h| h.replica.replaying()).count()
    }

    /// Over this broker's replicas: entry bytes of their Raft logs held in memory, and entries
    /// held on disk only (read back when asked for).
    pub fn replica_entry_memory(&self) -> (u64, u64) {
        self.replicas.values().map(|h| h.replica.entry_memory()).fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }

    /// Replicas stopped for a failed write, and why.
    pub fn failed_replicas(&self) -> &BTreeMap<ShardId, String> {
        &self.failed_replicas
    }

    /// Starts a replica for every replicated shard the metadata names this broker a replica
    /// of, and stops those of deleted shards.
    pub(super) fn sync_replicas(&mut self, now: Instant) {
        let me = self.me.id.clone();
        // (A replica move's target joins the group: it starts knowing no voters and learns
        // them from the leader's log.)
        let joining = |md: &Metadata, s: &ShardId| md.moving(s).is_some_and(|m| m.to == me);
        let wanted: Vec<(ShardId, Vec<String>, bool)> = self
            .metadata
            .replicated_shards()
            .filter(|(s, r)| {
                // (A replica kept from before a restart that the metadata no longer names
                // starts too, and lingers like one it stopped naming since.)
                (r.contains(&me) || joining(&self.metadata, s) || self.kept_replicas.contains_key(*s))
                    && !self.replicas.contains_key(*s)
                    && !self.failed_replicas.contains_key(*s)
            })
            .map(|(s, r)| (s.clone(), r.to_vec(), !r.contains(&me)))
            .take(NEW_REPLICAS_PER_TICK + 1)
            .collect();
        // A few hundred at a time: each starts a Raft group, makes its state durable (a file)
        // and soon stands for election; thousands at once (a configuration declaring them)
        // kept this broker from its other work for seconds, long enough for its peers to
        // elect another metadata leader. The rest start at the next tick.
        if wanted.len() > NEW_REPLICAS_PER_TICK {
            self.synced = None;
        }
        for (shard, names, joins) in wanted.into_iter().take(NEW_REPLICAS_PER_TICK) {
            // A rejoining replica (its kept log was damaged) starts like a move's target: an
            // empty log, no voters known; it learns both from the leader.
            let rejoins = self.rejoining.contains_key(&shard);
            let ids: Vec<u64> = if joins || rejoins { Vec::new() } else { names.iter().map(|n| raft_id(n)).collect() };
            let rank = names.iter().position(|n| *n == self.me.id);
            let kept = self.kept_replicas.remove(&shard).filter(|_| !rejoins).unwrap_or_default();
            // A cache's values, and a stream's consumer groups, are the fold of the whole log
            // (not something retention drops): they are part of its checkpoints.
            let hosting = true;
            let on_disk = kept.snapshot_rest_on_disk.is_some_and(|r| r.holds_commits);
            let snapshot_commits = kept.snapshot.as_ref().map(|s| {
                let (index, holds) = snapshot_holds_commits(s, None);
                (index, holds || on_disk)
            });
            match Replica::new_hosting(raft_id(&self.me.id), &ids, &kept, rank, hosting) {
                Ok(mut replica) => {
                    if let Some(b) = self.checkpoint_bytes {
                        replica.set_checkpoint_bytes(b);
                    }
                    if self.broker.config().history_reads {
                        // The driver reads the kept log back: entries beyond the cache, and the
                        // last snapshot, stay on disk only.
                        replica.set_snapshot_by_reference(true);
                        replica.set_entry_cache(Some(self.entry_cache.unwrap_or(REPLICA_ENTRY_CACHE)));
                    }
                    let names = names.iter().chain(std::iter::once(&me)).map(|n| (raft_id(n), n.clone())).collect();
                    self.replicas.insert(
                        shard.clone(),
                        Hosted {
                            replica,
                            names,
                            rejoins: BTreeMap::new(),
                            role: None,
                            ready_term: None,
                            lease: None,
                            behind: BTreeSet::new(),
                            sleep: None,
                            compacted_at: None,
                            names_at: None,
                            in_line_at: None,
                            move_floor: None,
                            role_from: None,
                            settled_ticks: 0,
                            preferred_tried: None,
                            snapshot_commits,
                            restoring: None,
                            heard_at: self.ticks,
                        },
                    );
                    self.awake.insert(shard.clone());
                    self.drain_replica(&shard, now);
                }
                // A kept log the engine refuses: the replica stays out (its peers carry on
                // with a majority); said once in the status.
                Err(_) => continue,
            }
        }
        // Deleted shards, and groups this broker left (a replica move took its place, or one
        // that brought it in was given up) once its group no longer counts it.
        let gone: Vec<ShardId> =
            self.replicas.iter().filter(|(s, h)| self.leaves(s, h)).map(|(s, _)| s.clone()).collect();
        for shard in gone {
            self.awake.remove(&shard);
            if let Some(h) = self.replicas.remove(&shard) {
                for token in h.replica.abandon() {
                    self.broker.handle_replicated(crate::transport::WriteToken(token), Answer::LeadershipLost, now);
                }
            }
            self.broker.forget_replica_state(&shard);
            self.out.push_back(NodeOutput::DropReplica { shard });
        }
    }

    /// The leader's part in a move of its shard (each tick, one step at a time, each tried
    /// again until the log or the metadata shows it done):
    /// * to another replica of the group: hand the leadership over (Raft's transfer), until
    ///   that one claims the lead;
    /// * to a broker outside the group (it replaces `from`): add it as a voter; once it holds
    ///   everything committed, remove `from` (first handing it the leadership if `from`
    ///   leads); then propose the finish, which makes it a replica in the metadata;
    /// * none: the group's configuration is brought back to the metadata's replica set (a
    ///   replica move given up half way is undone: a missing member added back, then an extra
    ///   one removed).
    pub(super) fn drive_replica_move(&mut self, shard: &ShardId) {
        let changes = self.metadata_changes;
        let fenced = self.broker.is_fenced();
        let Some(h) = self.replicas.get_mut(shard) else { return };
        // The replicas' names, learnt from the metadata when it changed.
        if h.names_at != Some(changes) {
            h.names_at = Some(changes);
            let mv = self.metadata.moving(shard);
            let members = self.metadata.replicas(shard).unwrap_or_default();
            for n in members.iter().chain(mv.iter().map(|m| &m.to)) {
                h.names.entry(raft_id(n)).or_insert_with(|| n.clone());
            }
        }
        // (Nor while a configuration change is on its way: the voters seen are about to change,
        // and a finish proposed from them could take a replica out of the metadata that the
        // change puts back in the group.)
        if !h.replica.is_leader() || h.replica.transferring() || fenced || h.replica.has_pending_conf() {
            h.in_line_at = None;
            return;
        }
        // Nothing to do when it was found in line with the metadata since it last changed
        // (looked at again once a second all the same).
        if h.in_line_at == Some(changes) && !self.ticks.is_multiple_of(JOIN_RETRY_TICKS) {
            return;
        }
        h.in_line_at = None;
        let mv = self.metadata.moving(shard).cloned();
        let members: Vec<String> = self.metadata.replicas(shard).map(<[String]>::to_vec).unwrap_or_default();
        let me = self.me.id.clone();
        let voters = h.replica.voters();
        if !voters.contains(&h.replica.id()) {
            // Removed from the group while it led it (a removal another leader proposed
            // committed under this one): the engine takes no proposal from it any more, so it
            // hands the lead to the voter holding the most.
            linger::hand_lead_on(&mut h.replica);
            return;
        }
        match mv {
            Some(m) if members.contains(&m.to) => {
                if m.to != me {
                    h.replica.transfer_leader(raft_id(&m.to));
                }
            }
            Some(m) => {
                let (to, from) = (raft_id(&m.to), raft_id(&m.from));
                if !voters.contains(&to) {
                    let _ = h.replica.propose_conf_change(true, to);
                } else if voters.contains(&from) {
                    let (_, commit) = h.replica.indexes();
                    let caught_up = h.replica.progress().iter().any(|(id, matched)| *id == to && *matched >= commit);
                    if !caught_up {
                        return;
                    }
                    if from == h.replica.id() {
                        h.replica.transfer_leader(to);
                    } else {
                        let _ = h.replica.propose_conf_change(false, from);
                    }
                } else {
                    let c = Command::FinishMove { shard: shard.clone(), to: m.to.clone(), at: 0 };
                    self.pending.push_back(c.encode());
                }
            }
            None => {
                // (A later move's copy is counted from its own start.)
                h.move_floor = None;
                // The group as the metadata has it: a replica move given up half way (its
                // target added, maybe the leaving replica removed) is undone, a missing member
                // added back before an extra one is removed.
                // Never itself ([`linger::hand_lead_on`] says why).
                let (ids, me): (Vec<u64>, u64) = (members.iter().map(|n| raft_id(n)).collect(), h.replica.id());
                if let Some(missing) = ids.iter().find(|id| !voters.contains(id)) {
                    let _ = h.replica.propose_conf_change(true, *missing);
                } else if let Some(extra) = voters.iter().find(|v| !ids.contains(v) && **v != me) {
                    let _ = h.replica.propose_conf_change(false, *extra);
                } else if !ids.contains(&me) {
                    linger::hand_lead_on(&mut h.replica);
                } else {
                    h.in_line_at = Some(changes);
                }
            }
        }
    }

    /// A group's message to replica `name`. For a move's target that is not a replica yet,
    /// `copy` is the bytes of the move's copy it carries: they wait for the move budget
    /// ([`crate::shard::bandwidth`]), and so does anything after them to the same target and shard
    /// (in order). The shard's live writes to it (entries after the copy) are not charged:
    /// however slow the budget, a move of a shard written faster than it still ends. The
    /// rest goes at once.
    pub(super) fn send_replica_message(
        &mut self,
        name: String,
        shard: &ShardId,
        message: Message,
        copy: Option<u64>,
        now: Instant,
    ) {
        if self.snapshot_by_reference(shard, &message) {
            // Its data is on disk: read and sent a chunk at a time, a move's copy paced by the
            // budget as it goes.
            self.start_snapshot_send(name, shard, message, copy.is_some(), now);
            return;
        }
        let Some(copy) = copy else {
            self.ship_replica_message(name, shard, message);
            return;
        };
        let queued = self.held_moves.iter().any(|h| h.to == name && h.shard == *shard);
        if !queued && (copy == 0 || self.broker.membership.move_bandwidth.may_send(now)) {
            self.broker.membership.move_bandwidth.charge(copy, now);
            self.ship_replica_message(name, shard, message);
            return;
        }
        let size = copy_bytes(&message, u64::MAX);
        if message.get_msg_type() == MessageType::MsgAppend {
            // The same append again (the leader resends what it has no answer to at each
            // heartbeat answer) is not queued twice: it would be paid for twice. Nor is one
            // past the most held. Raft sends it again (a message may always be lost).
            let again = self.held_moves.iter().any(|h| {
                h.to == name
                    && h.shard == *shard
                    && h.message.get_msg_type() == MessageType::MsgAppend
                    && h.message.term == message.term
                    && h.message.index == message.index
                    && h.message.entries.len() == message.entries.len()
            });
            if again || self.held_bytes.saturating_add(size) > crate::shard::bandwidth::HELD_BYTES_MAX {
                self.move_drops += 1;
                return;
            }
        }
        self.held_bytes += size;
        self.held_moves.push_back(HeldMove { to: name, shard: shard.clone(), message, copy, size });
    }

    /// Releases the held messages for moves' targets the move budget allows now: in order per
    /// target and shard, one carrying no copy as soon as nothing before it to the same target
    /// and shard waits.
    pub(super) fn release_held_moves(&mut self, now: Instant) {
        if self.held_moves.is_empty() {
            return;
        }
        let mut waiting: BTreeSet<(String, ShardId)> = BTreeSet::new();
        let mut kept = VecDeque::new();
        let mut budget = true;
        for h in std::mem::take(&mut self.held_moves) {
            let key = (h.to.clone(), h.shard.clone());
            let mut go = !waiting.contains(&key);
            if go && h.copy > 0 {
                budget = budget && self.broker.membership.move_bandwidth.may_send(now);
                go = budget;
            }
            if !go {
                waiting.insert(key);
                kept.push_back(h);
                continue;
            }
            self.held_bytes = self.held_bytes.saturating_sub(h.size);
            self.broker.membership.move_bandwidth.charge(h.copy, now);
            self.ship_replica_message(h.to, &h.shard, h.message);
        }
        self.held_moves = kept;
    }

    /// Puts a group's message to replica `name` on its way: a large snapshot in chunks, a
    /// heartbeat coalesced with the others to that peer, the rest batched per peer.
    pub(super) fn ship_replica_message(&mut self, name: String, shard: &ShardId, message: Message) {
        if message.get_msg_type() == MessageType::MsgSnapshot {
            let holds = Replica::host_state_of(message.get_snapshot().get_data())
                .is_some_and(Broker::stream_state_holds_commits);
            if self.withhold_snapshot(&name, shard, holds) {
                return;
            }
        }
        let chunked = message.get_msg_type() == MessageType::MsgSnapshot
            && message.get_snapshot().get_data().len() > self.snapshot_chunk_bytes
            && self.offers & FEATURE_SNAPSHOT_CHUNKS != 0
            && self.peer_features.get(&name).is_some_and(|f| f & FEATURE_SNAPSHOT_CHUNKS != 0);
        if chunked {
            let n = send_snapshot_chunks(&mut self.out, &name, shard, message, self.snapshot_chunk_bytes);
            self.snapshot_chunk_counts.0 += n;
            return;
        }
        let heartbeat = matches!(message.get_msg_type(), MessageType::MsgHeartbeat | MessageType::MsgHeartbeatResponse);
        let coalesce = heartbeat
            && message.context.is_empty()
            && self.peer_features.get(&name).is_some_and(|f| f & FEATURE_COALESCED_HEARTBEATS != 0);
        if coalesce {
            let beat = Beat {
                response: message.get_msg_type() == MessageType::MsgHeartbeatResponse,
                term: message.term,
                commit: message.commit,
            };
            self.beats.entry(name).or_default().push((shard.clone(), beat));
        } else {
            self.shard_sends
                .entry(name)
                .or_default()
                .push((shard.clone(), crate::cluster::meta::encode_message_parts(&message)));
        }
    }

    /// Move budget: bytes charged, times a move waited for it, catch-up messages held now
    /// (and their bytes), appends dropped with the most held.
    pub fn move_bandwidth_counts(&self) -> (u64, u64, usize, u64, u64) {
        let (charged, waits) = self.broker.membership.move_bandwidth.counts();
        (charged, waits, self.held_moves.len(), self.held_bytes, self.move_drops)
    }

    /// Moves copy at most `bytes` a second to and from this broker (`serve --move-bandwidth`;
    /// `None`: as fast as they go), see [`crate::shard::bandwidth`].
    pub fn set_move_bandwidth(&mut self, bytes: Option<u64>) {
        self.broker.membership.move_bandwidth = crate::shard::bandwidth::Bandwidth::new(bytes);
    }

    /// Gives the broker the cluster's view, then tells it again the role of each replica here
    /// whose role the view reset. A view that makes this broker one of a group again (a move's
    /// target, or listed again after a view in which it was not: `JoinedGroup`) resets the
    /// broker's copy to a follower that knows no leader, and the group, told once, had no
    /// reason to say its leader again: a quiet group's follower answered "electing a leader"
    /// for good (found by the world simulation, seed 506623).
    pub(super) fn apply_view(&mut self, now: Instant) {
        self.broker.apply_cluster(&self.metadata, &self.me.id, now);
        for (shard, h) in &self.replicas {
            let Some(role) = &h.role else { continue };
            if self.broker.replica_role(shard).is_some_and(|r| r != role) {
                self.broker.set_replica_role(shard, role.clone(), now);
            }
        }
    }

    /// Carries a replica's outputs: state to keep, messages to its peers (batched per peer),
    /// commits into the broker's log, answers to publishers; then tells the broker its role.
    pub(super) fn drain_replica(&mut self, shard: &ShardId, now: Instant) {
        // (One buffer, kept: this runs for every replicated write.)
        let mut sends = std::mem::take(&mut self.replica_sends);
        self.drain_replica_outputs(shard, now, &mut sends);
        for (name, message, copy) in sends.drain(..) {
            self.send_replica_message(name, shard, message, copy, now);
        }
        self.replica_sends = sends;
    }

    /// [`Self::drain_replica`], the messages to peers left in `sends` with the bytes of a
    /// move's copy each carries, for a move's target (they go once the group's entry is no
    /// longer borrowed).
    pub(super) fn drain_replica_outputs(
        &mut self,
        shard: &ShardId,
        now: Instant,
        sends: &mut Vec<(String, Message, Option<u64>)>,
    ) {
        let Some(h) = self.replicas.get_mut(shard) else { return };
        while let Some(o) = h.replica.poll_output() {
            let Some(o) = restore::hold_for_restore(h, &mut self.restores, o) else { continue };
            match o {
                ReplicaOutput::Persist { entries, hard_state } => {
                    self.out.push_back(NodeOutput::PersistReplica { shard: shard.clone(), entries, hard_state })
                }
                ReplicaOutput::PersistSnapshot { snapshot, rest } => {
                    h.snapshot_commits = Some(snapshot_holds_commits(&snapshot, rest.as_ref()));
                    self.out.push_back(NodeOutput::PersistReplicaSnapshot { shard: shard.clone(), snapshot, rest })
                }
                ReplicaOutput::Restored { next_offset, state, index, at, len, received } => {
                    let history = self.broker.config().history_reads;
                    let (restores, token, out) = (&mut self.restores, &mut self.next_replica_read, &mut self.out);
                    let found = (next_offset, &state, index, at, len, received);
                    if !restore::begin_restore(h, restores, token, out, shard, history, found) {
                        self.broker.restore_replicated(shard, next_offset, &state, now)
                    }
                }
                ReplicaOutput::CheckpointDue { index } => {
                    let rest = h.replica.checkpoint_due(index).and_then(|data| {
                        let rest = self.broker.checkpoint_replicated_state(shard, data)?;
                        Some(Box::new(rest) as Box<dyn HostPart>)
                    });
                    h.replica.finish_checkpoint_with(index, rest);
                }
                ReplicaOutput::Send { to, mut message } => {
                    let Some(name) = h.names.get(&to) else { continue };
                    // The rejoin's two signals ride on the engine's own messages.
                    if message.context.is_empty() {
                        if self.rejoining.contains_key(shard) {
                            message.context = REJOIN_CONTEXT.to_vec().into();
                        } else if h.rejoins.get(&to) == Some(&RejoinStep::Readded)
                            && matches!(
                                message.get_msg_type(),
                                MessageType::MsgAppend | MessageType::MsgHeartbeat | MessageType::MsgSnapshot
                            )
                        {
                            message.context = READDED_CONTEXT.to_vec().into();
                        }
                    }
                    // Log entries and snapshots for a move's target that is not a replica
                    // yet: how many bytes of them are the copy (entries the group held when
                    // this leader first sent it some; a snapshot, whole).
                    let target = matches!(message.get_msg_type(), MessageType::MsgAppend | MessageType::MsgSnapshot)
                        && !self.metadata.moves().is_empty()
                        && self.metadata.moving(shard).is_some_and(|m| m.to == *name)
                        && !self.metadata.replicas(shard).is_some_and(|r| r.contains(name));
                    let copy = target.then(|| {
                        let floor = match &h.move_floor {
                            Some((to, floor)) if to == name => *floor,
                            _ => {
                                let last = h.replica.indexes().0;
                                h.move_floor = Some((name.clone(), last));
                                last
                            }
                        };
                        copy_bytes(&message, floor)
                    });
                    sends.push((name.clone(), message, copy));
                }
                ReplicaOutput::Answer { token, answer } => {
                    self.broker.handle_replicated(crate::transport::WriteToken(token), answer, now)
                }
                ReplicaOutput::Delivered { offset, index, batch } => {
                    self.broker.apply_replicated(shard, offset, index, batch, now)
                }
                ReplicaOutput::Side { batch } => self.broker.apply_replicated_side(shard, batch, now),
                ReplicaOutput::ReadEntries { low, high, max_bytes } => {
                    let token = self.next_replica_read;
                    self.next_replica_read += 1;
                    self.replica_reads.insert(token, ReplicaRead::Raft { shard: shard.clone(), low });
                    let read = NodeOutput::ReadReplicaLog { shard: shard.clone(), token, low, high, max_bytes };
                    // A leader's read for a follower behind waits while the links are full
                    // (a restart's replay, on a replica not leading yet, never does).
                    if h.replica.is_leader() && self.peer_queued >= CATCH_UP_QUEUE_LIMIT {
                        self.held_catch_up_reads.push_back((now, read));
                        self.catch_up_reads_held += 1;
                    } else {
                        self.out.push_back(read);
                    }
                }
                // Never asked: a replica's snapshot is sent from disk by reference (above).
                ReplicaOutput::ReadSnapshot { .. } => {}
                ReplicaOutput::GenerationStart { offset, index, term } => {
                    self.broker.apply_replicated_generation(shard, offset, index, now);
                    if h.replica.is_leader() && term == h.replica.term() {
                        h.ready_term = Some(term);
                        // The metadata learns who leads (routing, `shard_owners`, generations).
                        let c = Command::Lead { shard: shard.clone(), node: self.me.id.clone(), term };
                        self.pending.push_back(c.encode());
                    }
                }
            }
        }
        // Worked out again only when what it depends on changed (a drain per message and per
        // tick: the follower's hint costs lookups by name).
        // A replica whose state is being read back serves nothing, elected or not.
        let leads = h.replica.is_leader() && h.restoring.is_none();
        let from =
            (leads, h.ready_term == Some(h.replica.term()), h.replica.leader(), self.metadata_changes, h.names.len());
        if h.role_from == Some(from) {
            if (from.0 || h.lease.is_some()) && self.broker.wants_read_lease(shard) {
                self.drain_lease(shard, now);
            }
            return;
        }
        h.role_from = Some(from);
        let role = if leads {
            if h.ready_term == Some(h.replica.term()) { ReplicaRole::Leading } else { ReplicaRole::Settling }
        } else {
            let leader = h.replica.leader().and_then(|l| h.names.get(&l)).filter(|n| **n != self.me.id).map(|n| {
                let addr = self.metadata.members().get(n).map(|m| m.client_addr.clone()).filter(|a| !a.is_empty());
                let generation = self.metadata.owner(shard).map_or(0, |a| a.generation);
                OwnerHint { node_id: n.clone(), addr, generation }
            });
            ReplicaRole::Following { leader }
        };
        let told = h.role.as_ref() == Some(&role);
        // (`names_me`, by field: `h` borrows the replicas.)
        let me = &self.me.id;
        let named = self.metadata.replicas(shard).is_some_and(|r| r.contains(me))
            || self.metadata.moving(shard).is_some_and(|m| m.to == *me);
        if !told {
            let leader = match &role {
                ReplicaRole::Leading => Some(self.me.id.clone()),
                ReplicaRole::Settling => None,
                ReplicaRole::Following { leader } => leader.as_ref().map(|l| l.node_id.clone()),
            };
            // Settling (elected, its first entry not yet committed) is said once it leads.
            if !matches!(role, ReplicaRole::Settling) {
                let name = format!("{}/{}/{}#{}", shard.tenant, shard.namespace, shard.name, shard.shard);
                self.broker.notice(Notice::ShardLeader { shard: name, leader, term: h.replica.term() });
            }
            h.role = Some(role.clone());
        }
        // (The broker's copy too, which a new view can reset: [`Self::apply_view`]. Not a
        // lingering replica's, which the metadata does not name: the broker serves that shard
        // as any other broker does, by the metadata's owner.)
        if named && (!told || self.broker.replica_role(shard).is_some_and(|r| *r != role)) {
            self.broker.set_replica_role(shard, role, now);
        }
        if self.broker.wants_read_lease(shard) {
            self.drain_lease(shard, now);
        }
    }

    /// A leader's read lease, as the broker is told it, renewed when due.
    pub(super) fn drain_lease(&mut self, shard: &ShardId, now: Instant) {
        let Some(h) = self.replicas.get_mut(shard) else { return };
        {
            // (No lease is held while its state is being read back.)
            let lease = h.replica.read_lease().filter(|_| h.restoring.is_none());
            if h.lease != lease {
                h.lease = lease;
                self.broker.set_read_lease(shard, lease);
            }
            // A new leader asks for its first lease as soon as its first entry committed, not
            // at the next tick (and what that sends goes out now).
            if renew_read_lease(&mut h.replica, now, false) {
                self.drain_replica(shard, now);
            }
        }
    }

    /// Sends the shard Raft messages gathered, one message per peer.
    pub(super) fn flush_shard_sends(&mut self) {
        for (to, list) in std::mem::take(&mut self.beats) {
            if self.refused.contains(&to) {
                continue;
            }
            for part in list.chunks(MAX_BEATS_PER_MESSAGE) {
                self.out
                    .push_back(NodeOutput::Peer { to: to.clone(), message: PeerMessage::Heartbeats(part.to_vec()) });
            }
        }
        for (to, list) in std::mem::take(&mut self.shard_sends) {
            if self.refused.contains(&to) {
                continue;
            }
            for part in split_shard_sends(list, SHARD_RAFT_BATCH_BYTES) {
                self.out.push_back(NodeOutput::Peer { to: to.clone(), message: PeerMessage::ShardRaft(part) });
            }
        }
    }

    /// A Raft message of a shard's group from peer `from`.
    pub(super) fn step_shard(&mut self, from: &str, shard: ShardId, msg: Message, now: Instant) {
        self.step_shard_with(from, shard, msg, None, now);
    }

    /// [`step_shard`](Self::step_shard) of a snapshot whose data's end, the host's state, came
    /// beside it as `rest` (chunks as they came: [`Self::take_chunk`]).
    pub(super) fn step_shard_with(
        &mut self,
        from: &str,
        shard: ShardId,
        msg: Message,
        rest: Option<SnapshotRest>,
        now: Instant,
    ) {
        // A message for a shard this broker holds no replica of (yet: it starts at the next
        // tick) changes nothing; Raft resends.
        let Some(h) = self.replicas.get_mut(&shard) else { return };
        if h.names.get(&msg.from).is_none_or(|n| n != from) {
            return; // only a shard's own replicas speak for it
        }
        if counts_as_member(&msg) {
            h.heard_at = self.ticks;
        }
        if h.restoring.is_some() && msg.get_msg_type() == MessageType::MsgTimeoutNow {
            // A leader hands its leadership over (to the preferred replica, at a drain): not
            // to one whose state is being read back, which would serve nothing (the leader's
            // transfer lapses and it leads on).
            self.restores.counts.handovers_refused += 1;
            return;
        }
        if let Some((why, what)) = lost_acknowledged(h, &msg, self.rejoining.contains_key(&shard)) {
            start_rejoin(&mut self.rejoining, &mut self.rejoin_counts, &mut self.out, &shard, why, what);
        }
        let vote = matches!(msg.get_msg_type(), MessageType::MsgRequestVote | MessageType::MsgRequestPreVote);
        if vote && now < crate::transport::after(self.started, VOTE_HOLD) {
            return; // just started: see VOTE_HOLD
        }
        if vote && h.replica.voters().is_empty() {
            // Joined (started empty, knowing no voters) and not yet given the group's
            // configuration by a leader: no vote. A stale configuration can still list this
            // broker from an earlier replica of it (removed, then added back empty under the
            // same id); a member whose log is behind, standing in it, could win with this
            // empty replica's vote and overwrite committed entries (`felix-node sim --cluster
            // --clients`, seed 503908: a record acknowledged at offset 1 replaced by a
            // generation start). Once a leader gave it the configuration, its log holds what
            // was committed up to its addition, and such a candidate cannot win its vote.
            return;
        }
        if let Some(why) = self.rejoining.get(&shard) {
            // Rejoining: it may have voted in a term it no longer remembers and acknowledged
            // entries it no longer holds, so it grants no vote until its group took it out and
            // added it back.
            if vote {
                return;
            }
            if msg.context.as_ref() == READDED_CONTEXT {
                let what = format!("rejoined its group (its damaged log: {why})");
                self.rejoining.remove(&shard);
                self.rejoin_counts.healed += 1;
                self.out.push_back(NodeOutput::ReplicaRejoin { shard: shard.clone(), what });
            }
        }
        if msg.get_msg_type() == MessageType::MsgSnapshot
            && Replica::host_state_of(msg.get_snapshot().get_data()).is_none()
        {
            // Data that is not a replica's state (none at all: a message whose data was to
            // follow and did not): installed, the engine would take the log as replaced while
            // the state stayed as it was. Dropped; the leader sends the snapshot again.
            self.snapshots_refused += 1;
            return;
        }
        note_rejoin(h, &msg);
        let (kind, quiet) = (msg.get_msg_type(), msg.context.as_ref() == QUIET_CONTEXT);
        match rest {
            Some(rest) => h.replica.step_with_rest(msg, rest),
            None => h.replica.step(msg),
        }
        self.drain_replica(&shard, now);
        self.after_group_message(&shard, from, kind, quiet);
    }

    /// The driver's count of bytes queued for other brokers and not yet written to their
    /// streams, given before it takes this node's outputs (and at each tick). While it is at
    /// [`CATCH_UP_QUEUE_LIMIT`] or more a leader holds its reads of entries for followers
    /// behind (each at most [`CATCH_UP_HOLD_MAX`]); below, the held reads go out, in order.
    pub fn set_peer_queued(&mut self, bytes: u64) {
        self.peer_queued = bytes;
        if bytes < CATCH_UP_QUEUE_LIMIT {
            self.out.extend(self.held_catch_up_reads.drain(..).map(|(_, read)| read));
        }
    }

    /// Reads of entries for followers behind held until the links drained (ever), and held
    /// now.
    pub fn catch_up_reads_held(&self) -> (u64, usize) {
        (self.catch_up_reads_held, self.held_catch_up_reads.len())
    }

    /// Over this broker's replicas: bytes of snapshot data their engines hold in memory, and
    /// their sends hold (none with history reads but what a peer that takes a snapshot
    /// whole is gathered: the data is sent from disk a chunk at a time).
    pub fn replica_snapshot_memory(&self) -> u64 {
        self.replicas.values().map(|h| h.replica.snapshot_memory() as u64).sum::<u64>() + self.snapshot_send_memory()
    }

    /// Bytes of encoded checkpoints this broker's replicas hold waiting for compaction
    /// ([`Replica::checkpoint_memory`]); a stream's commit state in them is shared with the
    /// live state and not counted.
    pub fn replica_checkpoint_memory(&self) -> u64 {
        self.replicas.values().map(|h| h.replica.checkpoint_memory() as u64).sum()
    }

    /// The driver read back what a [`NodeOutput::ReadReplicaLog`] asked for (`Err`: it could
    /// not, and why). A follower behind is sent the entries (or tried again at the next
    /// heartbeat, when they are not the log's); a history read completes with the batches
    /// they hold (on an error, with none: the reader skips to what memory holds, as with a
    /// segment that could not be read).
    pub fn handle_replica_log_read(&mut self, token: u64, entries: Result<Vec<Entry>, String>, now: Instant) {
        self.last_now = self.last_now.max(now);
        let now = self.last_now;
        match self.replica_reads.remove(&token) {
            Some(ReplicaRead::Raft { shard, low }) => {
                if let Some(h) = self.replicas.get_mut(&shard) {
                    h.replica.handle_entries_read(low, entries);
                    self.drain_replica(&shard, now);
                    self.flush_shard_sends();
                }
            }
            Some(ReplicaRead::History { shard, read }) => match entries {
                Ok(entries) => self.broker.replicated_read_complete(read, &shard, entries, now),
                Err(_) => self.broker.handle_read_complete(read, Vec::new(), now),
            },
            None => {}
        }
    }
}

/// Bytes of Raft messages one `shard_raft` peer message carries at most (one message more
/// than that alone). A leader catching a follower up sends up to `max_inflight_msgs` appends
/// of 1 MiB at once; gathered into one peer frame they passed its 64 MiB limit and the frame
/// was refused whole, so the follower got one append per heartbeat (measured: a catch-up at
/// 3 MB/s).
pub const SHARD_RAFT_BATCH_BYTES: usize = 4 << 20;

/// Coalesced heartbeats one `heartbeats` peer message carries at most (23 bytes each: well
/// under the peer frame limit).
pub const MAX_BEATS_PER_MESSAGE: usize = 100_000;

/// Splits one peer's Raft messages, in order, into runs of at most `max` bytes (a message
/// bigger than that alone in its run).
fn split_shard_sends(list: Vec<(ShardId, RaftBytes)>, max: usize) -> Vec<Vec<(ShardId, RaftBytes)>> {
    let mut parts: Vec<Vec<(ShardId, RaftBytes)>> = Vec::new();
    let mut size = 0;
    for (shard, bytes) in list {
        let n = bytes.len() + shard.name.len() + 64;
        match parts.last_mut() {
            Some(last) if size + n <= max => last.push((shard, bytes)),
            _ => {
                parts.push(vec![(shard, bytes)]);
                size = 0;
            }
        }
        size += n;
    }
    parts
}

/// A stream's commit state, or a cache's values, in a checkpoint stay shared with the live
/// state until the checkpoint becomes a snapshot.
impl HostPart for crate::broker::HostSection {
    fn encode_into(&self, out: &mut Vec<u8>) {
        crate::broker::HostSection::encode_into(self, out)
    }

    fn encoded_len(&self) -> usize {
        crate::broker::HostSection::encoded_len(self)
    }

    fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        crate::broker::HostSection::encode_pieces(self, each)
    }

    fn holds_commits(&self) -> bool {
        crate::broker::HostSection::holds_commits(self)
    }
}

#[cfg(test)]
mod split_tests {
    use super::*;

    #[test]
    fn a_flood_of_raft_messages_goes_in_frames_under_the_peer_limit_in_order() {
        let shard = |i: u32| ShardId {
            kind: crate::cluster::metadata::Kind::Stream,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: "ledger".into(),
            shard: i,
        };
        // 256 appends of 1 MiB: one frame would be 256 MiB.
        let list: Vec<(ShardId, RaftBytes)> =
            (0..256).map(|i| (shard(i), RaftBytes::from(Bytes::from(vec![i as u8; 1 << 20])))).collect();
        let parts = split_shard_sends(list.clone(), SHARD_RAFT_BATCH_BYTES);
        assert!(parts.len() >= 64, "{} parts", parts.len());
        for p in &parts {
            let mut b = bytes::BytesMut::new();
            crate::cluster::peer::encode(&PeerMessage::ShardRaft(p.clone()), &mut b).expect("under the frame limit");
        }
        assert_eq!(parts.concat(), list, "every message, in order");
        // One message bigger than the limit still goes, alone.
        let big = vec![
            (shard(0), RaftBytes::from(Bytes::from(vec![0; 5 << 20]))),
            (shard(1), RaftBytes::from(Bytes::from_static(b"x"))),
        ];
        assert_eq!(split_shard_sends(big, SHARD_RAFT_BATCH_BYTES).len(), 2);
        assert!(split_shard_sends(Vec::new(), SHARD_RAFT_BATCH_BYTES).is_empty());
    }
}
