//! One member of a Raft group, on tikv's `raft` engine, driven sans-IO: time comes in as ticks,
//! messages from peers come in as inputs, and messages to peers and committed commands come out
//! of [`MetaNode::poll_output`]. The election, the log and its replication are the engine's; this
//! module only runs its ready loop (persist, send, apply, advance) and makes it deterministic.
//!
//! Determinism: the engine draws each election timeout at random from
//! `[min_election_tick, max_election_tick)`. Here that range holds one value per node, staggered
//! by node id, so the same inputs give the same elections (the simulation replays seeds), and
//! the lowest id times out first when nobody leads.
//!
//! Storage: the engine works on its `MemStorage`; what must survive a crash comes out as
//! [`MetaOutput::Persist`] (new log entries, the hard state), *before* the messages that depend
//! on it, and the driver makes it durable before it carries out the next output. A member
//! restarts from what was kept ([`RaftLog`], [`MetaNode::restart`]) and replays its committed
//! commands, so the metadata is rebuilt by applying them again.

use raft::eraftpb::{ConfChange, ConfChangeType, ConfState, EntryType, Message};
pub use raft::eraftpb::{Entry, HardState};
use raft::storage::MemStorage;
use raft::{Config, RawNode, StateRole};
use std::collections::VecDeque;

/// Ticks without a heartbeat before a follower stands for election (before staggering).
pub const ELECTION_TICKS: usize = 10;
/// Ticks between a leader's heartbeats.
pub const HEARTBEAT_TICKS: usize = 3;
/// The most entry bytes one append message carries (at least one entry, whatever its size).
pub const MAX_APPEND_BYTES: u64 = 1 << 20;

/// Why a Raft input was refused.
#[derive(Debug, thiserror::Error)]
pub enum MetaError {
    /// Only the leader takes proposals; the client is told who leads, when known.
    #[error("not the leader (leader: {leader:?})")]
    NotLeader {
        /// The leader this node knows of.
        leader: Option<u64>,
    },
    /// The engine refused the input (a bad configuration, a message for another group).
    #[error("raft: {0}")]
    Raft(#[from] raft::Error),
    /// A message from a peer that does not decode.
    #[error("undecodable raft message: {0}")]
    Decode(String),
}

/// What the node asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaOutput {
    /// Make these durable before carrying out any later output: the entries replace the log
    /// from the first one's index on (a new leader may overwrite an uncommitted tail), and the
    /// hard state (term, vote, commit) replaces the old one. Fold it into a [`RaftLog`].
    Persist {
        /// New entries, in index order (may be empty).
        entries: Vec<Entry>,
        /// The new hard state, when it changed.
        hard_state: Option<HardState>,
    },
    /// Send this message to peer `to` (encode it with [`encode_message`]).
    Send {
        /// Peer id.
        to: u64,
        /// The message.
        message: Message,
    },
    /// A change of the group's voters committed (and applied to the engine), in log order
    /// with the commands: `added` or removed voter `id`, with the context it was proposed with.
    ConfChanged {
        /// Its log index.
        index: u64,
        /// Added (else removed).
        added: bool,
        /// The voter's Raft id.
        id: u64,
        /// What the proposer attached (the founding voters' own: their names).
        context: Vec<u8>,
    },
    /// A command committed by the group, in log order: apply it. (With
    /// [`MetaNode::report_leader_entries`], also the empty entry each new leader appends: `data`
    /// empty.)
    Committed {
        /// Its log index.
        index: u64,
        /// The term it was proposed in (a proposal whose index commits with another term was
        /// overwritten by a newer leader).
        term: u64,
        /// The command as proposed (shared with the log: no copy).
        data: bytes::Bytes,
    },
}

/// A member of a Raft group.
pub struct MetaNode {
    raw: RawNode<MemStorage>,
    out: VecDeque<MetaOutput>,
    /// Report the empty entries new leaders append (a replicated shard's generation starts).
    report_empty: bool,
}

impl std::fmt::Debug for MetaNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetaNode").field("id", &self.id()).field("leader", &self.leader()).finish()
    }
}

impl MetaNode {
    /// Member `id` of a group whose founding voters are `voters` (ids are never 0).
    ///
    /// # Errors
    /// [`MetaError::Raft`] for a configuration the engine refuses (id 0, `id` not a voter...).
    pub fn new(id: u64, voters: &[u64]) -> Result<MetaNode, MetaError> {
        let founding: Vec<(u64, Vec<u8>)> = voters.iter().map(|v| (*v, Vec::new())).collect();
        Self::restart(id, &founding, &RaftLog::default())
    }

    /// Member `id` starting from what its driver kept: the log and hard state folded from every
    /// [`MetaOutput::Persist`] before (empty on a first start). Committed commands come out
    /// again as [`MetaOutput::Committed`] from the first, so the state machine is rebuilt by
    /// replaying.
    ///
    /// The group's voters are in its log: the founding voters `founding` (id and a context,
    /// the same on every founding member) are written as its first entries on a first start,
    /// like etcd's bootstrap, and every later change of voters is a logged configuration change
    /// ([`propose_conf_change`](Self::propose_conf_change)). So a member added later learns
    /// the whole membership by replicating the log, and a restart recovers it from the log.
    /// A member that joins an existing group starts with `founding` empty and an empty log: it
    /// waits, voting for nobody, until the leader replicates to it.
    ///
    /// # Errors
    /// [`MetaError::Raft`] for id 0, a founding list without `id`, or a kept log the engine
    /// refuses.
    pub fn restart(id: u64, founding: &[(u64, Vec<u8>)], kept: &RaftLog) -> Result<MetaNode, MetaError> {
        Self::restart_ranked(id, founding, kept, None)
    }

    /// [`restart`](Self::restart) with this member's place in the order its group's members
    /// stand for election when nobody leads (0 first). `None`: by id, lowest first. Groups of
    /// replicated shards give each shard another order, so their leaders spread over brokers.
    ///
    /// # Errors
    /// As [`restart`](Self::restart).
    pub fn restart_ranked(
        id: u64,
        founding: &[(u64, Vec<u8>)],
        kept: &RaftLog,
        rank: Option<usize>,
    ) -> Result<MetaNode, MetaError> {
        let founders: Vec<u64> = founding.iter().map(|(v, _)| *v).collect();
        if id == 0 || (!founders.is_empty() && !founders.contains(&id)) {
            return Err(MetaError::Raft(raft::Error::ConfigInvalid(format!(
                "node {id} is not a founding voter of {founders:?}"
            ))));
        }
        let mut kept = kept.clone();
        let mut first_persist = None;
        if kept.entries.is_empty() && !founding.is_empty() && kept.hard_state.term == 0 {
            kept = RaftLog::founding(founding);
            first_persist =
                Some(MetaOutput::Persist { entries: kept.entries.clone(), hard_state: Some(kept.hard_state.clone()) });
        }
        // Voters as the committed configuration changes of the log leave them. A log from
        // before voters were logged has none: the founding list then says.
        let voters = kept.voters().unwrap_or(founders);
        let storage = MemStorage::new_with_conf_state(ConfState::from((voters.clone(), vec![])));
        {
            let mut w = storage.wl();
            if !kept.entries.is_empty() {
                w.append(&kept.entries)?;
            }
            let mut hs = kept.hard_state.clone();
            // The kept commit cannot point past the kept log (a commit learnt before the entries
            // it covers were written).
            let last = kept.entries.last().map_or(0, |e| e.index);
            hs.commit = hs.commit.min(last);
            w.set_hardstate(hs);
        }
        // One election timeout per node, staggered by id: deterministic, and apart enough that
        // two nodes rarely stand at once.
        let rank = rank.unwrap_or_else(|| voters.iter().filter(|v| **v < id).count());
        let min = ELECTION_TICKS + 2 * rank;
        let cfg = Config {
            id,
            election_tick: ELECTION_TICKS,
            heartbeat_tick: HEARTBEAT_TICKS,
            min_election_tick: min,
            max_election_tick: min + 1,
            check_quorum: true,
            pre_vote: true,
            // Several entries per append message (the engine's default is one): a replicated
            // shard's publish batches are entries, and one message each cost a peer frame and a
            // transport write per batch.
            max_size_per_msg: MAX_APPEND_BYTES,
            max_inflight_msgs: 256,
            ..Config::default()
        };
        cfg.validate()?;
        let logger = slog::Logger::root(slog::Discard, slog::o!());
        let raw = RawNode::new(&cfg, storage, &logger)?;
        Ok(MetaNode { raw, out: first_persist.into_iter().collect(), report_empty: false })
    }

    /// Reports the empty entry every new leader appends as a [`MetaOutput::Committed`] with
    /// empty data (a replicated shard makes it its generation-start record). Set before the
    /// first tick or step: a restart's replay reports them too.
    pub fn report_leader_entries(&mut self) {
        self.report_empty = true;
    }

    /// Proposes like [`propose`](Self::propose) and says where the entry went: its log index
    /// and term. It commits there with that term, or was overwritten (another term at that
    /// index) by a newer leader.
    ///
    /// # Errors
    /// As [`propose`](Self::propose).
    pub fn propose_indexed(&mut self, data: Vec<u8>) -> Result<(u64, u64), MetaError> {
        if !self.is_leader() {
            return Err(MetaError::NotLeader { leader: self.leader() });
        }
        let before = self.raw.raft.raft_log.last_index();
        let term = self.raw.raft.term;
        self.raw.propose(Vec::new(), data)?;
        let index = self.raw.raft.raft_log.last_index();
        self.process_ready();
        if index == before {
            return Err(MetaError::Raft(raft::Error::ProposalDropped));
        }
        Ok((index, term))
    }

    /// The current voters (ascending).
    pub fn voters(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.raw.raft.prs().conf().voters().ids().iter().collect();
        v.sort_unstable();
        v
    }

    /// Proposes adding (`add`) or removing voter `id`; `context` comes back with
    /// [`MetaOutput::ConfChanged`] on every member. One change at a time: the engine drops a
    /// second while the first is not applied.
    ///
    /// # Errors
    /// [`MetaError::NotLeader`] on a follower; [`MetaError::Raft`] when the engine drops it.
    pub fn propose_conf_change(&mut self, add: bool, id: u64, context: Vec<u8>) -> Result<(), MetaError> {
        if !self.is_leader() {
            return Err(MetaError::NotLeader { leader: self.leader() });
        }
        if self.raw.raft.has_pending_conf() {
            return Err(MetaError::Raft(raft::Error::ProposalDropped));
        }
        let mut cc = ConfChange::default();
        cc.set_change_type(if add { ConfChangeType::AddNode } else { ConfChangeType::RemoveNode });
        cc.set_node_id(id);
        cc.set_context(context.clone().into());
        let r = self.raw.propose_conf_change(context, cc);
        self.process_ready();
        r.map_err(MetaError::from)
    }

    /// This node's id.
    pub fn id(&self) -> u64 {
        self.raw.raft.id
    }

    /// The leader this node knows of.
    pub fn leader(&self) -> Option<u64> {
        Some(self.raw.raft.leader_id).filter(|l| *l != 0)
    }

    /// Whether this node leads.
    pub fn is_leader(&self) -> bool {
        self.raw.raft.state == StateRole::Leader
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.raw.raft.term
    }

    /// The index of the last entry in the log, and the highest committed.
    pub fn indexes(&self) -> (u64, u64) {
        (self.raw.raft.raft_log.last_index(), self.raw.raft.raft_log.committed)
    }

    /// On the leader: each voter and the highest index it is known to hold (its replication
    /// progress), in id order. Empty on a follower.
    pub fn progress(&self) -> Vec<(u64, u64)> {
        if !self.is_leader() {
            return Vec::new();
        }
        let mut v: Vec<(u64, u64)> = self.raw.raft.prs().iter().map(|(id, p)| (*id, p.matched)).collect();
        v.sort_unstable();
        v
    }

    /// One unit of time passed (the driver ticks every 100 ms, say).
    pub fn tick(&mut self) {
        self.raw.tick();
        self.process_ready();
    }

    /// A message from a peer.
    ///
    /// # Errors
    /// [`MetaError::Raft`] when the engine refuses it (a message for another group).
    pub fn step(&mut self, mut message: Message) -> Result<(), MetaError> {
        // A heartbeat's commit is the leader's belief about this member's log. The engine
        // trusts it and panics when it points past the log's end, which a member whose log was
        // lost (a wiped data directory) would meet. Clamped, it only delays a commit the next
        // append brings anyway: a peer's message never panics this node.
        if message.get_msg_type() == raft::eraftpb::MessageType::MsgHeartbeat {
            let last = self.raw.raft.raft_log.last_index();
            message.commit = message.commit.min(last);
        }
        let r = self.raw.step(message);
        self.process_ready();
        r.map_err(MetaError::from)
    }

    /// Proposes a command; it comes out as [`MetaOutput::Committed`] on every member once the
    /// group committed it.
    ///
    /// # Errors
    /// [`MetaError::NotLeader`] on a follower; [`MetaError::Raft`] if the engine drops it.
    pub fn propose(&mut self, data: Vec<u8>) -> Result<(), MetaError> {
        if !self.is_leader() {
            return Err(MetaError::NotLeader { leader: self.leader() });
        }
        let r = self.raw.propose(Vec::new(), data);
        self.process_ready();
        r.map_err(MetaError::from)
    }

    /// The next thing to do.
    pub fn poll_output(&mut self) -> Option<MetaOutput> {
        self.out.pop_front()
    }

    /// The engine's ready loop: store entries and hard state, send, apply, advance.
    fn process_ready(&mut self) {
        while self.raw.has_ready() {
            let mut rd = self.raw.ready();
            self.send(rd.take_messages());
            if !rd.snapshot().is_empty() {
                let snap = rd.snapshot().clone();
                // A snapshot from the leader replaces the log; MemStorage takes it whole.
                let _ = self.raw.mut_store().wl().apply_snapshot(snap);
            }
            self.apply(rd.take_committed_entries());
            if !rd.entries().is_empty() {
                let _ = self.raw.mut_store().wl().append(rd.entries());
            }
            if let Some(hs) = rd.hs() {
                self.raw.mut_store().wl().set_hardstate(hs.clone());
            }
            if !rd.entries().is_empty() || rd.hs().is_some() {
                self.out
                    .push_back(MetaOutput::Persist { entries: rd.entries().to_vec(), hard_state: rd.hs().cloned() });
            }
            // Only now, with entries and hard state stored (and asked to be made durable), may
            // these go out.
            self.send(rd.take_persisted_messages());
            let mut light = self.raw.advance(rd);
            if let Some(commit) = light.commit_index() {
                self.raw.mut_store().wl().mut_hard_state().set_commit(commit);
            }
            self.send(light.take_messages());
            self.apply(light.take_committed_entries());
            self.raw.advance_apply();
        }
    }

    fn send(&mut self, messages: Vec<Message>) {
        self.out.extend(messages.into_iter().map(|m| MetaOutput::Send { to: m.to, message: m }));
    }

    fn apply(&mut self, entries: Vec<Entry>) {
        use protobuf::Message as _;
        for e in entries {
            match e.get_entry_type() {
                // Empty entries are the engine's own (a new leader's first entry).
                EntryType::EntryNormal if !e.data.is_empty() || self.report_empty => {
                    self.out.push_back(MetaOutput::Committed { index: e.index, term: e.term, data: e.data.clone() });
                }
                EntryType::EntryConfChange => {
                    // Every member applies the same entry the same way; one the engine refuses
                    // (it cannot be, as it was proposed through it) changes nothing.
                    let Ok(cc) = ConfChange::parse_from_bytes(&e.data) else { continue };
                    if let Ok(cs) = self.raw.apply_conf_change(&cc) {
                        self.raw.mut_store().wl().set_conf_state(cs);
                        self.out.push_back(MetaOutput::ConfChanged {
                            index: e.index,
                            added: cc.get_change_type() != ConfChangeType::RemoveNode,
                            id: cc.get_node_id(),
                            context: cc.get_context().to_vec(),
                        });
                    }
                }
                _ => {}
            }
        }
    }
}

/// What a member must keep across a crash: its log and hard state, folded from its
/// [`MetaOutput::Persist`] outputs in order. The driver keeps one per member on disk (written
/// before the next output is carried out); the simulation keeps it in memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RaftLog {
    /// The log, in index order, without gaps.
    pub entries: Vec<Entry>,
    /// Term, vote and commit.
    pub hard_state: HardState,
}

impl RaftLog {
    /// A founding member's first log: one committed configuration change adding each founding
    /// voter (in id order, at term 1), identical on every founding member.
    pub fn founding(founding: &[(u64, Vec<u8>)]) -> RaftLog {
        use protobuf::Message as _;
        let mut voters = founding.to_vec();
        voters.sort_by_key(|(id, _)| *id);
        voters.dedup_by_key(|(id, _)| *id);
        let entries: Vec<Entry> = voters
            .iter()
            .enumerate()
            .map(|(i, (id, context))| {
                let mut cc = ConfChange::default();
                cc.set_change_type(ConfChangeType::AddNode);
                cc.set_node_id(*id);
                cc.set_context(context.clone().into());
                let mut e = Entry::default();
                e.set_entry_type(EntryType::EntryConfChange);
                e.index = i as u64 + 1;
                e.term = 1;
                e.data = cc.write_to_bytes().unwrap_or_default().into();
                e
            })
            .collect();
        let hard_state = HardState { term: 1, commit: entries.len() as u64, ..HardState::default() };
        RaftLog { entries, hard_state }
    }

    /// The voters the committed configuration changes of this log leave, or `None` for a log
    /// that has none.
    pub fn voters(&self) -> Option<Vec<u64>> {
        use protobuf::Message as _;
        let mut voters = std::collections::BTreeSet::new();
        let mut any = false;
        for e in self.entries.iter().take_while(|e| e.index <= self.hard_state.commit) {
            if e.get_entry_type() != EntryType::EntryConfChange {
                continue;
            }
            let Ok(cc) = ConfChange::parse_from_bytes(&e.data) else { continue };
            any = true;
            if cc.get_change_type() == ConfChangeType::RemoveNode {
                voters.remove(&cc.get_node_id());
            } else {
                voters.insert(cc.get_node_id());
            }
        }
        any.then(|| voters.into_iter().collect())
    }

    /// Folds one `Persist` in: its entries replace the log from the first one's index on.
    pub fn persist(&mut self, entries: &[Entry], hard_state: Option<&HardState>) {
        if let Some(first) = entries.first() {
            let keep = self.entries.iter().take_while(|e| e.index < first.index).count();
            self.entries.truncate(keep);
            self.entries.extend_from_slice(entries);
        }
        if let Some(hs) = hard_state {
            self.hard_state = hs.clone();
        }
    }

    /// The bytes a driver keeps in a file: `"FLXR"`, u32 entry count, each entry and then the
    /// hard state as u32 length + protobuf, and a CRC-32C of everything before it.
    pub fn encode(&self) -> Vec<u8> {
        use protobuf::Message as _;
        let mut out = Vec::new();
        out.extend_from_slice(b"FLXR");
        out.extend_from_slice(&(self.entries.len() as u32).to_be_bytes());
        let mut put = |b: Vec<u8>| {
            out.extend_from_slice(&(b.len() as u32).to_be_bytes());
            out.extend_from_slice(&b);
        };
        for e in &self.entries {
            put(e.write_to_bytes().unwrap_or_default());
        }
        put(self.hard_state.write_to_bytes().unwrap_or_default());
        let crc = crate::storage::crc32c(&out);
        out.extend_from_slice(&crc.to_be_bytes());
        out
    }

    /// Reads [`encode`](Self::encode)'s bytes. Never panics.
    ///
    /// # Errors
    /// [`MetaError::Decode`] for bytes that are not a whole, intact Raft log.
    pub fn decode(data: &[u8]) -> Result<RaftLog, MetaError> {
        use protobuf::Message as _;
        let bad = |why: &str| MetaError::Decode(format!("raft log: {why}"));
        if data.len() < 12 || &data[..4] != b"FLXR" {
            return Err(bad("not a Raft log file"));
        }
        let (body, crc) = data.split_at(data.len() - 4);
        if crate::storage::crc32c(body).to_be_bytes() != crc {
            return Err(bad("checksum mismatch"));
        }
        let mut at = 4;
        let word = |at: &mut usize| -> Result<u32, MetaError> {
            let w = body.get(*at..*at + 4).ok_or_else(|| bad("truncated"))?;
            *at += 4;
            Ok(u32::from_be_bytes([w[0], w[1], w[2], w[3]]))
        };
        let count = word(&mut at)?;
        let mut entries = Vec::new();
        for _ in 0..count {
            let len = word(&mut at)? as usize;
            let b = body.get(at..at + len).ok_or_else(|| bad("truncated entry"))?;
            at += len;
            entries.push(Entry::parse_from_bytes(b).map_err(|e| bad(&e.to_string()))?);
        }
        let len = word(&mut at)? as usize;
        let b = body.get(at..at + len).ok_or_else(|| bad("truncated hard state"))?;
        let hard_state = HardState::parse_from_bytes(b).map_err(|e| bad(&e.to_string()))?;
        if at + len != body.len() {
            return Err(bad("trailing bytes"));
        }
        // The engine assumes a gapless log in index order: a file that says otherwise is
        // refused here rather than handed to it.
        if entries.windows(2).any(|w| w[1].index != w[0].index + 1) || entries.first().is_some_and(|e| e.index == 0) {
            return Err(bad("entries out of order"));
        }
        Ok(RaftLog { entries, hard_state })
    }
}

/// One [`MetaOutput::Persist`] as a record of an append-only file (how a driver keeps a
/// replicated shard's Raft log, appended to on every write rather than rewritten):
/// `u32 length`, `u8 has_hard_state`, then the persisted part as a [`RaftLog`] (whose own
/// checksum covers it).
pub fn encode_log_record(entries: &[Entry], hard_state: Option<&HardState>) -> Vec<u8> {
    use protobuf::Message as _;
    // Written straight into one buffer (each entry's bytes copied once): the same bytes as
    // `RaftLog::encode` of the part, behind the record's length and flag.
    let none = HardState::default();
    let hs = hard_state.unwrap_or(&none);
    let size: usize = entries.iter().map(|e| e.compute_size() as usize + 4).sum::<usize>() + hs.compute_size() as usize;
    let mut out = Vec::with_capacity(size + 21);
    out.extend_from_slice(&[0; 4]);
    out.push(u8::from(hard_state.is_some()));
    let part = out.len();
    out.extend_from_slice(b"FLXR");
    out.extend_from_slice(&(entries.len() as u32).to_be_bytes());
    let put = |out: &mut Vec<u8>, m: &dyn protobuf::Message| {
        let at = out.len();
        out.extend_from_slice(&[0; 4]);
        // Writing a message to a Vec does not fail.
        let _ = m.write_to_vec(out);
        let n = (out.len() - at - 4) as u32;
        out[at..at + 4].copy_from_slice(&n.to_be_bytes());
    };
    for e in entries {
        put(&mut out, e);
    }
    put(&mut out, hs);
    let crc = crate::storage::crc32c(&out[part..]);
    out.extend_from_slice(&crc.to_be_bytes());
    let len = (out.len() - 4) as u32;
    out[..4].copy_from_slice(&len.to_be_bytes());
    out
}

/// Folds an append-only file of [`encode_log_record`] records into the log they leave, and
/// says how many bytes of it were whole records. A torn or damaged record ends the file there
/// (a crash mid-append): what came before it stands, and the driver cuts the file to that
/// length before appending again. Never panics.
pub fn fold_log_records(data: &[u8]) -> (RaftLog, usize) {
    let mut log = RaftLog::default();
    let mut at = 0usize;
    while let Some(w) = data.get(at..at + 4) {
        let len = u32::from_be_bytes([w[0], w[1], w[2], w[3]]) as usize;
        let Some(body) = data.get(at + 4..at + 4 + len).filter(|b| !b.is_empty()) else { break };
        let Ok(part) = RaftLog::decode(&body[1..]) else { break };
        // The entries must continue the log (or overwrite its tail): a record that would leave
        // a gap is damage, not a crash, and ends the file like one.
        if part.entries.first().is_some_and(|e| e.index > log.entries.last().map_or(1, |l| l.index + 1)) {
            break;
        }
        log.persist(&part.entries, (body[0] != 0).then_some(&part.hard_state));
        at += 4 + len;
    }
    (log, at)
}

/// A Raft message as bytes for the cluster transport.
pub fn encode_message(m: &Message) -> Vec<u8> {
    use protobuf::Message as _;
    m.write_to_bytes().unwrap_or_default()
}

/// A Raft message from the cluster transport.
///
/// # Errors
/// [`MetaError::Decode`] for bytes that are not a Raft message.
pub fn decode_message(bytes: &[u8]) -> Result<Message, MetaError> {
    use protobuf::Message as _;
    Message::parse_from_bytes(bytes).map_err(|e| MetaError::Decode(e.to_string()))
}

/// [`decode_message`] from shared bytes: the entries' data are slices of `bytes`, not copies
/// (a replicated shard's entries are whole publish batches).
///
/// # Errors
/// As [`decode_message`].
pub fn decode_message_shared(bytes: &bytes::Bytes) -> Result<Message, MetaError> {
    use protobuf::Message as _;
    Message::parse_from_carllerche_bytes(bytes).map_err(|e| MetaError::Decode(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, BTreeSet};

    #[test]
    fn a_kept_raft_log_round_trips_and_bad_bytes_are_refused() {
        let mut g = Group::new(&[1, 2, 3]);
        for _ in 0..30 {
            for n in g.nodes.values_mut() {
                n.tick();
            }
            g.settle();
        }
        let leader = *g.nodes.keys().find(|id| g.nodes[id].is_leader()).unwrap();
        g.nodes.get_mut(&leader).unwrap().propose(b"cmd".to_vec()).unwrap();
        g.settle();
        let kept = g.kept[&1].clone();
        assert!(!kept.entries.is_empty() && kept.hard_state.term > 0);
        let bytes = kept.encode();
        assert_eq!(RaftLog::decode(&bytes).unwrap(), kept);
        for cut in [0, 3, 11, bytes.len() - 1] {
            assert!(RaftLog::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        for i in 0..bytes.len() {
            let mut bad = bytes.clone();
            bad[i] ^= 0x40;
            assert!(RaftLog::decode(&bad).is_err(), "flipped byte {i}");
        }
    }

    #[test]
    fn an_append_only_log_folds_back_and_stops_at_a_torn_record() {
        let e =
            |index: u64, term: u64, data: &[u8]| Entry { index, term, data: data.to_vec().into(), ..Entry::default() };
        let hs = |term: u64, commit: u64| HardState { term, vote: 1, commit, ..HardState::default() };
        let mut file = Vec::new();
        file.extend(encode_log_record(&[e(1, 1, b"a"), e(2, 1, b"b"), e(3, 1, b"c")], Some(&hs(1, 1))));
        // A new leader overwrote the tail from index 3; no hard state change in this one.
        file.extend(encode_log_record(&[e(3, 2, b"x")], None));
        file.extend(encode_log_record(&[], Some(&hs(2, 3))));
        let whole = file.len();
        let (log, len) = fold_log_records(&file);
        assert_eq!(len, whole);
        assert_eq!(log.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(), vec![(1, 1), (2, 1), (3, 2)]);
        assert_eq!(log.hard_state, hs(2, 3));
        // Torn anywhere in the last record: the records before it stand.
        let last = encode_log_record(&[e(4, 2, b"y")], None);
        for cut in 0..last.len() {
            let mut torn = file.clone();
            torn.extend_from_slice(&last[..cut]);
            let (l, n) = fold_log_records(&torn);
            assert_eq!((l.entries.len(), n), (3, whole), "cut at {cut}");
        }
        // A damaged byte inside a record ends the file there.
        let mut bad = file.clone();
        bad[whole - 3] ^= 0x10;
        assert!(fold_log_records(&bad).1 < whole);
        // A record that would leave a gap is refused.
        let mut gap = file.clone();
        gap.extend(encode_log_record(&[e(9, 2, b"z")], None));
        assert_eq!(fold_log_records(&gap).1, whole);
        assert_eq!(fold_log_records(&[0xFF; 7]).1, 0);
    }

    /// Three members and a network that delivers in order, dropping what touches a cut node.
    struct Group {
        nodes: BTreeMap<u64, MetaNode>,
        applied: BTreeMap<u64, Vec<Vec<u8>>>,
        cut: BTreeSet<u64>,
        leaders_by_term: BTreeMap<u64, BTreeSet<u64>>,
        kept: BTreeMap<u64, RaftLog>,
        changes: BTreeMap<u64, Vec<(bool, u64)>>,
    }

    impl Group {
        fn new(ids: &[u64]) -> Group {
            let nodes = ids.iter().map(|&id| (id, MetaNode::new(id, ids).unwrap())).collect();
            Group {
                nodes,
                applied: BTreeMap::new(),
                cut: BTreeSet::new(),
                leaders_by_term: BTreeMap::new(),
                kept: BTreeMap::new(),
                changes: BTreeMap::new(),
            }
        }

        /// Delivers every message (through the wire encoding) until the network is quiet.
        fn settle(&mut self) {
            loop {
                let mut msgs = Vec::new();
                for (&id, n) in self.nodes.iter_mut() {
                    while let Some(o) = n.poll_output() {
                        match o {
                            MetaOutput::Send { to, message } => msgs.push((id, to, encode_message(&message))),
                            MetaOutput::Committed { data, .. } => {
                                self.applied.entry(id).or_default().push(data.to_vec())
                            }
                            MetaOutput::Persist { entries, hard_state } => {
                                self.kept.entry(id).or_default().persist(&entries, hard_state.as_ref())
                            }
                            MetaOutput::ConfChanged { added, id: voter, .. } => {
                                self.changes.entry(id).or_default().push((added, voter))
                            }
                        }
                    }
                }
                if msgs.is_empty() {
                    break;
                }
                for (from, to, bytes) in msgs {
                    if self.cut.contains(&from) || self.cut.contains(&to) {
                        continue;
                    }
                    if let Some(n) = self.nodes.get_mut(&to) {
                        let _ = n.step(decode_message(&bytes).unwrap());
                    }
                }
            }
            for n in self.nodes.values() {
                if n.is_leader() {
                    self.leaders_by_term.entry(n.term()).or_default().insert(n.id());
                }
            }
        }

        fn run(&mut self, ticks: usize) {
            for _ in 0..ticks {
                for n in self.nodes.values_mut() {
                    n.tick();
                }
                self.settle();
            }
        }

        fn leaders(&self) -> Vec<u64> {
            self.nodes.values().filter(|n| n.is_leader() && !self.cut.contains(&n.id())).map(|n| n.id()).collect()
        }
    }

    #[test]
    fn three_members_elect_one_leader_replicate_and_fail_over() {
        let mut g = Group::new(&[1, 2, 3]);
        g.run(30);
        // Deterministic: the lowest id times out first and wins.
        assert_eq!(g.leaders(), vec![1]);
        for i in 0..5u8 {
            g.nodes.get_mut(&1).unwrap().propose(vec![i]).unwrap();
        }
        assert!(matches!(g.nodes.get_mut(&2).unwrap().propose(vec![9]), Err(MetaError::NotLeader { leader: Some(1) })));
        g.run(5);
        let want: Vec<Vec<u8>> = (0..5u8).map(|i| vec![i]).collect();
        for id in [1, 2, 3] {
            assert_eq!(g.applied[&id], want, "node {id}");
        }
        // The leader is cut off: the other two elect one of themselves and go on.
        g.cut.insert(1);
        g.run(60);
        let new = g.leaders();
        assert_eq!(new.len(), 1, "{new:?}");
        assert_ne!(new[0], 1);
        g.nodes.get_mut(&new[0]).unwrap().propose(vec![42]).unwrap();
        g.run(5);
        for id in [2, 3] {
            assert_eq!(g.applied[&id].last(), Some(&vec![42]), "node {id}");
        }
        // Healed: the old leader steps down and catches up; one leader per term throughout.
        g.cut.clear();
        g.run(40);
        assert_eq!(g.leaders().len(), 1);
        assert_eq!(g.applied[&1].last(), Some(&vec![42]));
        assert!(g.leaders_by_term.values().all(|l| l.len() == 1), "{:?}", g.leaders_by_term);
    }

    #[test]
    fn a_voter_added_later_learns_everything_from_the_log_and_a_removed_one_stops_counting() {
        let mut g = Group::new(&[1, 2, 3]);
        g.run(30);
        assert_eq!(g.changes[&2], vec![(true, 1), (true, 2), (true, 3)], "the founding voters, from the log");
        let leader = g.leaders()[0];
        g.nodes.get_mut(&leader).unwrap().propose(b"before".to_vec()).unwrap();
        g.run(3);
        // A fourth broker starts empty and is added.
        g.nodes.insert(4, MetaNode::restart(4, &[], &RaftLog::default()).unwrap());
        g.nodes.get_mut(&leader).unwrap().propose_conf_change(true, 4, b"n4".to_vec()).unwrap();
        g.run(20);
        assert_eq!(g.applied[&4], vec![b"before".to_vec()], "the newcomer replayed what was committed");
        assert_eq!(g.nodes[&4].voters(), vec![1, 2, 3, 4]);
        assert_eq!(g.nodes[&1].voters(), vec![1, 2, 3, 4]);
        // Its kept log says who the voters are: a restart knows them without being told.
        assert_eq!(g.kept[&4].voters(), Some(vec![1, 2, 3, 4]));
        let again = MetaNode::restart(4, &[], &g.kept[&4]).unwrap();
        assert_eq!(again.voters(), vec![1, 2, 3, 4]);
        // Two of four cut off: no quorum of four... until one of them is removed.
        let leader = g.leaders()[0];
        let others: Vec<u64> = [1, 2, 3, 4].into_iter().filter(|v| *v != leader).collect();
        g.nodes.get_mut(&leader).unwrap().propose_conf_change(false, others[0], Vec::new()).unwrap();
        g.run(5);
        assert_eq!(g.nodes[&leader].voters().len(), 3);
        g.cut.insert(others[0]);
        g.cut.insert(others[1]);
        g.nodes.get_mut(&leader).unwrap().propose(b"after".to_vec()).unwrap();
        g.run(5);
        assert_eq!(g.applied[&leader].last(), Some(&b"after".to_vec()), "two of three commit");
        // A second change while one is pending is refused, not lost silently.
        let l = g.nodes.get_mut(&leader).unwrap();
        l.propose_conf_change(true, 9, Vec::new()).unwrap();
        assert!(l.propose_conf_change(true, 10, Vec::new()).is_err());
    }

    #[test]
    fn the_same_inputs_give_the_same_run() {
        let trace = || {
            let mut g = Group::new(&[1, 2, 3]);
            g.run(30);
            g.nodes.get_mut(&1).unwrap().propose(b"x".to_vec()).unwrap();
            g.cut.insert(1);
            g.run(60);
            (g.leaders(), g.leaders_by_term.clone(), g.applied.clone())
        };
        assert_eq!(trace(), trace());
    }

    #[test]
    fn bad_members_and_bad_bytes_are_errors() {
        assert!(MetaNode::new(0, &[1, 2]).is_err());
        assert!(MetaNode::new(4, &[1, 2, 3]).is_err());
        assert!(matches!(decode_message(&[0xFF, 0xFF, 0xFF]), Err(MetaError::Decode(_))));
    }
}
