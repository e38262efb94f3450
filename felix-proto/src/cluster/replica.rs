//! One replica of a replicated (`quorum`) shard: a member of the shard's own Raft group on the
//! same engine as the metadata group ([`MetaNode`]), whose log *is* the shard's log. Publish
//! batches are Raft entries; an entry is readable (delivered to subscribers, acknowledged to its
//! publisher) only once a majority holds it, so a record once delivered is never lost by a
//! fail-over. The empty entry every new leader appends becomes the spec's generation-start
//! record: it takes an offset and is never delivered.
//!
//! Offsets are assigned when entries are applied, in log order, the same way on every replica
//! (a generation start takes one, a batch one per record), so every replica gives every record
//! the same offset. Idempotent producers are part of the replicated state: a batch whose
//! (producer, sequence) was applied before is applied as a duplicate (no offsets, the original
//! answer), so a producer that retries after `leadership_lost` or `quorum_timeout`, on whichever
//! leader, gets its batch written exactly once.
//!
//! Answers to the publisher (on the leader): `Appended` once its entry committed in the term it
//! was proposed in; `LeadershipLost` when this replica stopped leading or another leader's entry
//! took the index (outcome unknown: it may still commit); `QuorumTimeout` when no majority
//! confirmed it in time (outcome unknown). Sans-IO like the rest: ticks, peer messages and
//! proposals in; what to persist, send, answer and deliver out.

use super::meta::{MetaError, MetaNode, MetaOutput, RaftLog};
use crate::binary::{Reader, Records};
use bytes::{BufMut, Bytes};
use raft::eraftpb::{Entry, HardState, Message};
use std::collections::{BTreeMap, VecDeque};

/// Ticks a proposal may wait for a majority before it is answered `quorum_timeout`.
pub const QUORUM_TIMEOUT_TICKS: u64 = 50;

/// Sequences remembered per producer (a retry older than that is not recognised).
pub const PRODUCER_WINDOW: usize = 256;

/// A batch as replicated: everything a replica needs to hold the same batch as its leader
/// (the records block as published, the append time the leader gave it, the publisher), and,
/// for an idempotent producer, its sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicatedBatch {
    /// (producer id, sequence) of an idempotent producer.
    pub producer: Option<(u64, u64)>,
    /// Append time the leader gave it, microseconds since the Unix epoch.
    pub timestamp_micros: u64,
    /// Who published it (principal), when known.
    pub publisher: Option<Bytes>,
    /// The records (an untimed block, as published).
    pub records: Records,
}

/// Why replicated bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed replicated batch: {0}")]
pub struct BatchError(&'static str);

impl ReplicatedBatch {
    /// A batch of these payloads (tests and the simulation).
    pub fn from_payloads(producer: Option<(u64, u64)>, payloads: &[Bytes]) -> ReplicatedBatch {
        ReplicatedBatch {
            producer,
            timestamp_micros: 0,
            publisher: None,
            records: Records::from_payloads(payloads.iter()).unwrap_or_default(),
        }
    }

    /// Its payloads, in order.
    pub fn payloads(&self) -> Vec<Bytes> {
        self.records.payloads().collect()
    }

    /// Its bytes in the Raft log: `u8 version (2)`, `u8 flags` (0x1 producer, 0x2 publisher),
    /// `u64 producer`, `u64 sequence`, `u64 timestamp_micros`, `u8 publisher_len` + publisher,
    /// then the records block as in a publish batch (`u32 count`, each `u32 len` + payload).
    pub fn encode(&self) -> Vec<u8> {
        let publisher = self.publisher.as_ref().filter(|p| p.len() <= 255);
        let mut b = Vec::with_capacity(32 + publisher.map_or(0, |p| p.len()) + self.records.raw().len());
        b.put_u8(2);
        let (pid, seq) = self.producer.unwrap_or((0, 0));
        b.put_u8(u8::from(self.producer.is_some()) | (u8::from(publisher.is_some()) << 1));
        b.put_u64(pid);
        b.put_u64(seq);
        b.put_u64(self.timestamp_micros);
        let p = publisher.map_or(&[][..], |p| p.as_ref());
        b.put_u8(p.len() as u8);
        b.extend_from_slice(p);
        b.put_u32(self.records.count());
        b.extend_from_slice(self.records.raw());
        b
    }

    /// Reads [`encode`](Self::encode)'s bytes. Never panics.
    ///
    /// # Errors
    /// [`BatchError`] for bytes that are not a whole batch.
    pub fn decode(data: &[u8]) -> Result<ReplicatedBatch, BatchError> {
        Self::decode_shared(Bytes::copy_from_slice(data))
    }

    /// [`decode`](Self::decode) from shared bytes: the records are a slice of `data`, not a
    /// copy (the Raft log already holds the entry).
    ///
    /// # Errors
    /// As [`decode`](Self::decode).
    pub fn decode_shared(data: Bytes) -> Result<ReplicatedBatch, BatchError> {
        let mut r = Reader::new(data);
        let bad = |what: &'static str| move |_| BatchError(what);
        if r.u8("version").map_err(bad("version"))? != 2 {
            return Err(BatchError("unknown version"));
        }
        let flags = r.u8("flags").map_err(bad("flags"))?;
        let pid = r.u64("producer").map_err(bad("producer"))?;
        let seq = r.u64("sequence").map_err(bad("sequence"))?;
        let timestamp_micros = r.u64("timestamp").map_err(bad("timestamp"))?;
        let plen = r.u8("publisher_len").map_err(bad("publisher length"))?;
        let publisher = r.bytes(usize::from(plen), "publisher").map_err(bad("publisher"))?;
        let records = Records::decode(&mut r, false).map_err(bad("records"))?;
        Ok(ReplicatedBatch {
            producer: (flags & 1 != 0).then_some((pid, seq)),
            timestamp_micros,
            publisher: (flags & 2 != 0).then_some(publisher),
            records,
        })
    }
}

/// The answer to a proposed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Committed: the first record's offset (a duplicate's original one).
    Appended {
        /// Offset of the first record.
        offset: u64,
        /// It was a duplicate of a batch applied before (nothing new was written).
        duplicate: bool,
    },
    /// This replica stopped leading, or a newer leader's entry took the index: the batch may
    /// or may not commit (outcome unknown; an idempotent producer sends it again).
    LeadershipLost,
    /// No majority confirmed it in time (outcome unknown).
    QuorumTimeout,
}

/// What a replica asks its driver to do, in order.
#[derive(Debug, Clone, PartialEq)]
pub enum ReplicaOutput {
    /// Make durable before carrying out anything after it (as [`MetaOutput::Persist`]).
    Persist {
        /// New entries.
        entries: Vec<Entry>,
        /// The new hard state.
        hard_state: Option<HardState>,
    },
    /// Send to replica `to`.
    Send {
        /// Peer id.
        to: u64,
        /// The message.
        message: Message,
    },
    /// The answer to proposal `token`.
    Answer {
        /// The token the proposal was made with.
        token: u64,
        /// What became of it.
        answer: Answer,
    },
    /// Records became readable (committed), in offset order: deliver them.
    Delivered {
        /// Offset of the first.
        offset: u64,
        /// The batch.
        batch: ReplicatedBatch,
    },
    /// A new leader's generation starts at `offset` (an offset never delivered; readers skip
    /// it, `skipped_before` for clients that offered 0x0800).
    GenerationStart {
        /// Its offset.
        offset: u64,
        /// The leader's term.
        term: u64,
    },
}

#[derive(Debug)]
struct Proposal {
    token: u64,
    term: u64,
    age: u64,
}

/// One replica of a replicated shard.
pub struct Replica {
    node: MetaNode,
    /// The next offset to assign.
    next_offset: u64,
    /// Per producer: sequence → first offset, the last [`PRODUCER_WINDOW`].
    producers: BTreeMap<u64, BTreeMap<u64, u64>>,
    /// Proposals waiting for their entry to commit, by log index (leader only).
    pending: BTreeMap<u64, Proposal>,
    out: VecDeque<ReplicaOutput>,
    leading: bool,
}

impl std::fmt::Debug for Replica {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replica").field("id", &self.node.id()).field("next_offset", &self.next_offset).finish()
    }
}

impl Replica {
    /// Replica `id` of a shard whose replicas are `replicas`, starting from what its driver
    /// kept (empty on a first start). A restart replays the committed log: offsets, producers
    /// and deliveries come out again from the first, the same as before.
    ///
    /// # Errors
    /// [`MetaError`] for a configuration or a kept log the engine refuses.
    pub fn new(id: u64, replicas: &[u64], kept: &RaftLog) -> Result<Replica, MetaError> {
        Self::new_ranked(id, replicas, kept, None)
    }

    /// [`new`](Self::new), standing for election in the order of `replicas` (the first stands
    /// first when nobody leads) rather than by id.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn new_ranked(id: u64, replicas: &[u64], kept: &RaftLog, rank: Option<usize>) -> Result<Replica, MetaError> {
        let founding: Vec<(u64, Vec<u8>)> = replicas.iter().map(|r| (*r, Vec::new())).collect();
        let mut node = MetaNode::restart_ranked(id, &founding, kept, rank)?;
        node.report_leader_entries();
        let mut r = Replica {
            node,
            next_offset: 0,
            producers: BTreeMap::new(),
            pending: BTreeMap::new(),
            out: VecDeque::new(),
            leading: false,
        };
        r.drain();
        Ok(r)
    }

    /// This replica's id.
    pub fn id(&self) -> u64 {
        self.node.id()
    }

    /// Whether it leads (it takes proposals).
    pub fn is_leader(&self) -> bool {
        self.node.is_leader()
    }

    /// The leader it knows of.
    pub fn leader(&self) -> Option<u64> {
        self.node.leader()
    }

    /// The current term.
    pub fn term(&self) -> u64 {
        self.node.term()
    }

    /// The last log index and the committed index.
    pub fn indexes(&self) -> (u64, u64) {
        self.node.indexes()
    }

    /// On the leader: each replica's id and the highest log index it holds.
    pub fn progress(&self) -> Vec<(u64, u64)> {
        self.node.progress()
    }

    /// The next offset a record would get (the readable bound).
    pub fn next_offset(&self) -> u64 {
        self.next_offset
    }

    /// A unit of time passed.
    pub fn tick(&mut self) {
        self.node.tick();
        for p in self.pending.values_mut() {
            p.age += 1;
        }
        let expired: Vec<u64> =
            self.pending.iter().filter(|(_, p)| p.age >= QUORUM_TIMEOUT_TICKS).map(|(i, _)| *i).collect();
        for i in expired {
            if let Some(p) = self.pending.remove(&i) {
                self.out.push_back(ReplicaOutput::Answer { token: p.token, answer: Answer::QuorumTimeout });
            }
        }
        self.drain();
    }

    /// A message from another replica.
    pub fn step(&mut self, m: Message) {
        let _ = self.node.step(m);
        self.drain();
    }

    /// Proposes a batch (on the leader); its answer comes out as [`ReplicaOutput::Answer`]
    /// with `token`.
    ///
    /// # Errors
    /// [`MetaError::NotLeader`] (with the leader known, if any) on a follower.
    pub fn propose(&mut self, token: u64, batch: &ReplicatedBatch) -> Result<(), MetaError> {
        let (index, term) = self.node.propose_indexed(batch.encode())?;
        self.pending.insert(index, Proposal { token, term, age: 0 });
        self.drain();
        Ok(())
    }

    /// Stops this replica: the tokens of the proposals it still owed an answer (outcome
    /// unknown: they may commit on the others).
    pub fn abandon(self) -> Vec<u64> {
        let mut owed: Vec<u64> = self.pending.values().map(|p| p.token).collect();
        owed.extend(self.out.iter().filter_map(|o| match o {
            ReplicaOutput::Answer { token, .. } => Some(*token),
            _ => None,
        }));
        owed
    }

    /// The next thing to do.
    pub fn poll_output(&mut self) -> Option<ReplicaOutput> {
        self.out.pop_front()
    }

    fn drain(&mut self) {
        while let Some(o) = self.node.poll_output() {
            match o {
                MetaOutput::Persist { entries, hard_state } => {
                    self.out.push_back(ReplicaOutput::Persist { entries, hard_state })
                }
                MetaOutput::Send { to, message } => self.out.push_back(ReplicaOutput::Send { to, message }),
                MetaOutput::Committed { index, term, data } => self.apply(index, term, data),
                MetaOutput::ConfChanged { .. } => {}
            }
        }
        let leading = self.node.is_leader();
        if self.leading && !leading {
            // Deposed: nothing pending here will be answered by a commit we can vouch for.
            for (_, p) in std::mem::take(&mut self.pending) {
                self.out.push_back(ReplicaOutput::Answer { token: p.token, answer: Answer::LeadershipLost });
            }
        }
        self.leading = leading;
    }

    /// Applies one committed entry: offsets, producers, deliveries, answers.
    fn apply(&mut self, index: u64, term: u64, data: Bytes) {
        let answer = if data.is_empty() {
            let offset = self.next_offset;
            self.next_offset += 1;
            self.out.push_back(ReplicaOutput::GenerationStart { offset, term });
            None
        } else {
            match ReplicatedBatch::decode_shared(data) {
                // Only this crate proposes; an entry that does not decode takes no offset on
                // any replica alike.
                Err(_) => None,
                Ok(batch) => {
                    let seen = batch.producer.and_then(|(pid, seq)| self.producers.get(&pid)?.get(&seq).copied());
                    match seen {
                        Some(offset) => Some(Answer::Appended { offset, duplicate: true }),
                        None => {
                            let offset = self.next_offset;
                            self.next_offset += u64::from(batch.records.count());
                            if let Some((pid, seq)) = batch.producer {
                                let seqs = self.producers.entry(pid).or_default();
                                seqs.insert(seq, offset);
                                while seqs.len() > PRODUCER_WINDOW {
                                    seqs.pop_first();
                                }
                            }
                            self.out.push_back(ReplicaOutput::Delivered { offset, batch });
                            Some(Answer::Appended { offset, duplicate: false })
                        }
                    }
                }
            }
        };
        // Proposals at or below this index: the one at it is answered by what committed there
        // (if its term matches; another term means a newer leader overwrote it).
        while let Some((&i, _)) = self.pending.first_key_value() {
            if i > index {
                break;
            }
            let Some(p) = self.pending.remove(&i) else { break };
            let a = match (&answer, i == index && p.term == term) {
                (Some(a), true) => a.clone(),
                _ => Answer::LeadershipLost,
            };
            self.out.push_back(ReplicaOutput::Answer { token: p.token, answer: a });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_round_trips_and_garbage_is_refused() {
        let mut b = ReplicatedBatch::from_payloads(Some((7, 9)), &[Bytes::from_static(b"a"), Bytes::new()]);
        b.publisher = Some(Bytes::from_static(b"alice"));
        b.timestamp_micros = 42;
        assert_eq!(ReplicatedBatch::decode(&b.encode()), Ok(b.clone()));
        let bytes = b.encode();
        for cut in 0..bytes.len() {
            assert!(ReplicatedBatch::decode(&bytes[..cut]).is_err(), "cut {cut}");
        }
        assert!(ReplicatedBatch::decode(&[1]).is_err());
        let mut huge = vec![2u8, 0];
        huge.extend_from_slice(&[0; 24]);
        huge.extend_from_slice(&[0, 0xFF, 0xFF, 0xFF, 0xFF]);
        assert!(ReplicatedBatch::decode(&huge).is_err());
    }
}
