//! What a cluster node asks its driver to do ([`NodeOutput`]), and the one place it is handed
//! out ([`ClusterNode::poll_output`]): a child of `node` (it reads the node's fields), in a file
//! of its own.

use super::*;

/// What the node asks its driver to do, in order.
#[derive(Debug)]
pub enum NodeOutput {
    /// A client-facing duty of the broker (everything but its peer traffic).
    Broker(BrokerOutput),
    /// Send to peer broker `to` on the cluster transport. When it cannot be delivered, report
    /// [`ClusterNode::handle_undeliverable`].
    Peer {
        /// Node id.
        to: String,
        /// The message.
        message: PeerMessage,
    },
    /// A broker became a voter of the cluster (an operator added it): dial it at
    /// `cluster_addr` and accept it as a peer. Repeated on a restart's replay: idempotent.
    PeerAdded {
        /// Node id.
        name: String,
        /// Its cluster listener.
        cluster_addr: String,
    },
    /// A broker left the cluster: stop dialling it, refuse it as a peer.
    PeerRemoved {
        /// Node id.
        name: String,
    },
    /// A peer was refused (log it; close its connection): it came back with another data
    /// directory than the one the cluster knows (its Raft state and records are gone).
    PeerRefused {
        /// Node id.
        name: String,
        /// What happened and what the operator can do.
        why: String,
    },
    /// Make this state of a replicated shard's Raft group durable (its log: the shard's
    /// records) before carrying out any later output, as for [`NodeOutput::PersistRaft`]. Keep
    /// it per shard and hand it back at a restart ([`ClusterNode::set_kept_replicas`]).
    PersistReplica {
        /// The shard.
        shard: ShardId,
        /// New entries (replacing the log from the first one's index).
        entries: Vec<Entry>,
        /// The new hard state.
        hard_state: Option<HardState>,
    },
    /// Make this snapshot of a replicated shard's Raft group durable before carrying out any
    /// later output: it replaces the shard's kept log up to its index
    /// ([`crate::cluster::meta::RaftLog::persist_snapshot`]; in a file, an
    /// [`crate::cluster::meta::encode_snapshot_record`] record, written with its `rest` by
    /// [`crate::cluster::meta::write_snapshot_record`]).
    PersistReplicaSnapshot {
        /// The shard.
        shard: ShardId,
        /// The snapshot.
        snapshot: crate::cluster::meta::Snapshot,
        /// The end of its data, still unencoded (a stream's commit state, with history
        /// reads): the data is `snapshot`'s followed by it, written piece by piece.
        rest: Option<crate::cluster::replica::SnapshotRest>,
    },
    /// This broker no longer holds a replica of the shard (its stream was deleted): its kept
    /// Raft state may be removed.
    DropReplica {
        /// The shard.
        shard: ShardId,
    },
    /// A step of a replica's rejoin after its kept log was found damaged (log it): this
    /// broker's replica starts one, or heals; a leader takes a replica out of its group and
    /// adds it back.
    ReplicaRejoin {
        /// The shard.
        shard: ShardId,
        /// What happened, for an operator.
        what: String,
    },
    /// Make this snapshot of the metadata group durable before carrying out any later output
    /// (D62): it replaces the kept metadata log up to its index
    /// ([`crate::cluster::meta::RaftLog::persist_snapshot`]; in a file, an
    /// [`crate::cluster::meta::encode_snapshot_record`] record, after which the records before it may
    /// go). This broker compacted its log, or was sent the snapshot by the leader, being too
    /// far behind (a broker added late, one down a long while).
    PersistRaftSnapshot {
        /// The snapshot (its data a [`MetaSnapshot`]).
        snapshot: crate::cluster::meta::Snapshot,
        /// The leader sent it (this broker's metadata was restored from it); else this broker
        /// compacted its own log.
        received: bool,
    },
    /// Make this Raft state durable before carrying out any later output
    /// ([`crate::cluster::meta::MetaOutput::Persist`]).
    PersistRaft {
        /// New entries (replacing the log from the first one's index).
        entries: Vec<Entry>,
        /// The new hard state.
        hard_state: Option<HardState>,
    },
    /// Read entries `low..high` of the shard's kept Raft log back from disk (about
    /// `max_bytes` of them from `low` on, one at least; fewer where the log ends) and hand
    /// them to [`ClusterNode::handle_replica_log_read`] with `token`. A replica keeps only its
    /// newest entries in memory and a replicated shard's broker log only its newest batches
    /// (with [`BrokerConfig::history_reads`](crate::broker::BrokerConfig::history_reads), which
    /// says the driver reads back what it kept): a follower far behind and a reader of older
    /// history are served from here. Carry it out off the state machine's task; it depends on
    /// no sync (the entries were written before they were asked for) and nothing waits on it
    /// but the read.
    ReadReplicaLog {
        /// The shard.
        shard: ShardId,
        /// Handed back with the entries.
        token: u64,
        /// First index wanted.
        low: u64,
        /// Stop before this index.
        high: u64,
        /// About how many bytes of entries at most.
        max_bytes: u64,
    },
    /// Read bytes `offset..offset + len` (fewer at the end) of the data of the snapshot at
    /// `index` of the shard's kept Raft log (the last [`NodeOutput::PersistReplicaSnapshot`] of
    /// it) and hand them, with the data's whole length, to
    /// [`ClusterNode::handle_replica_snapshot_piece`] with `token`
    /// ([`crate::cluster::meta::read_snapshot_record_piece`] reads them from a record). With
    /// [`BrokerConfig::history_reads`](crate::broker::BrokerConfig::history_reads) a replica
    /// keeps its snapshot's data (its host's state, a second time) on disk only, and sends it
    /// to a follower behind the compaction a chunk at a time. `verify`: check the whole
    /// record's CRC first (the first piece of a send). Carry it out off the state machine's
    /// task, after the persists before it (a sync is not needed to read what was written).
    ReadReplicaSnapshotPiece {
        /// The shard.
        shard: ShardId,
        /// Handed back with the piece.
        token: u64,
        /// The snapshot's index (a record holding another is an error).
        index: u64,
        /// Where in the data the piece starts.
        offset: u64,
        /// Its length at most.
        len: u64,
        /// Check the whole record's CRC first.
        verify: bool,
    },
}

impl ClusterNode {
    /// The next thing to do.
    pub fn poll_output(&mut self) -> Option<NodeOutput> {
        if let Some(o) = self.out.pop_front() {
            return Some(o);
        }
        let Some(o) = self.broker.poll_output() else {
            // Proposals made while draining the broker go out together, one message per peer;
            // so do publishes forwarded and answers to them.
            self.flush_forwards();
            if !self.shard_sends.is_empty() {
                self.flush_shard_sends();
            }
            return self.out.pop_front();
        };
        Some(match o {
            BrokerOutput::Storage(StorageOutput::Read(r)) => {
                // History of a replicated shard below what the broker's log of it holds in
                // memory is in the shard's Raft log on disk; anything else is the driver's
                // segment storage.
                let shard = ShardId {
                    kind: crate::cluster::metadata::Kind::Stream,
                    tenant: r.tenant_id.clone(),
                    namespace: r.namespace.clone(),
                    name: r.stream.clone(),
                    shard: r.shard,
                };
                let range = self.replicas.contains_key(&shard).then(|| self.broker.replicated_read_range(&r)).flatten();
                let Some((low, high)) = range else {
                    return Some(NodeOutput::Broker(BrokerOutput::Storage(StorageOutput::Read(r))));
                };
                let token = self.next_replica_read;
                self.next_replica_read += 1;
                self.replica_reads.insert(token, ReplicaRead::History { shard: shard.clone(), read: r.token });
                // The whole range: it was sized by the batches' payload.
                NodeOutput::ReadReplicaLog { shard, token, low, high, max_bytes: u64::MAX }
            }
            BrokerOutput::Cluster(ClusterOutput::Replicate { token, shard, batch }) => {
                let now = self.broker.last_now();
                // A version 4 entry (key, envelope, compressed block) only for a group whose
                // every replica reads it (D59); the others get the batch as before D59.
                let batch = if batch.has_meta() && !self.group_reads_meta(&shard) {
                    match batch.without_meta() {
                        Some(b) => b,
                        None => {
                            self.broker.handle_replicated(token, Answer::NoEnvelopes, now);
                            return self.poll_output();
                        }
                    }
                } else {
                    batch
                };
                // A leader handing its leadership over takes no proposal (the engine drops it):
                // nothing is written, so the writer is told to send it again.
                self.wake(&shard);
                let transferring = self.replicas.get(&shard).is_some_and(|h| h.replica.transferring());
                let proposed = self.replicas.get_mut(&shard).map(|h| h.replica.propose(token.0, &batch));
                match proposed {
                    Some(Ok(())) => self.drain_replica(&shard, now),
                    _ if transferring => self.broker.handle_replicated(token, Answer::NotProposed, now),
                    // Not (or no longer) leading: the batch was not proposed, but the broker
                    // asked in the belief it leads; outcome unknown is the safe answer.
                    _ => self.broker.handle_replicated(token, Answer::LeadershipLost, now),
                }
                return self.poll_output();
            }
            BrokerOutput::Cluster(ClusterOutput::Forward { to, publish }) => {
                if self.peer_reads_forward_batches(&to) && self.peer_reads_meta(&to) {
                    self.forward_sends.entry(to).or_default().push(publish);
                    return self.poll_output();
                } else if self.peer_reads_meta(&to) {
                    NodeOutput::Peer { to, message: PeerMessage::Forward(publish) }
                } else {
                    let (id, acked) = (publish.id, publish.acked);
                    match publish.without_meta() {
                        Some(p) => NodeOutput::Peer { to, message: PeerMessage::Forward(p) },
                        None => {
                            // An owner that would keep the ciphertext without its envelope:
                            // nothing is sent (an unacked publish is dropped, as any refused
                            // unacked publish is: it asked for no answer).
                            if acked {
                                let now = self.broker.last_now();
                                let outcome = ForwardOutcome::Refused {
                                    code: ErrorCode::InvalidRequest,
                                    retry: RetryClass::Fatal,
                                    message: format!(
                                        "the shard's owner {to} runs an older broker that does not keep envelopes: nothing was written"
                                    ),
                                };
                                self.broker.handle_forward_answer(id, outcome, now);
                            }
                            return self.poll_output();
                        }
                    }
                }
            }
            BrokerOutput::Cluster(ClusterOutput::ForwardAnswer { to, id, outcome }) => {
                if self.peer_reads_forward_batches(&to) {
                    self.answer_sends.entry(to).or_default().push((id, outcome));
                    return self.poll_output();
                }
                NodeOutput::Peer { to, message: PeerMessage::ForwardAnswer { id, outcome } }
            }
            BrokerOutput::Cluster(ClusterOutput::ForwardRequest { to, request }) => {
                NodeOutput::Peer { to, message: PeerMessage::Request(request) }
            }
            BrokerOutput::Cluster(ClusterOutput::ForwardRequestAnswer { to, id, data }) => {
                NodeOutput::Peer { to, message: PeerMessage::RequestAnswer { id, data } }
            }
            BrokerOutput::Cluster(ClusterOutput::ProposeCache { tenant_id, namespace, cache, replication }) => {
                // One shard; durable like the counters it holds (they live on its owner's disk,
                // or with `replication` above 1 in its own Raft group's log).
                let c = Command::Create {
                    kind: crate::cluster::metadata::Kind::Cache,
                    tenant: tenant_id,
                    namespace,
                    name: cache,
                    shards: 1,
                    ephemeral: false,
                    replication: if replication > 1 { replication } else { 0 },
                };
                self.pending.push_back(c.encode());
                return self.poll_output();
            }
            BrokerOutput::Cluster(ClusterOutput::ProposeStreamDeletion { tenant_id, namespace, stream }) => {
                let c = Command::Delete {
                    kind: crate::cluster::metadata::Kind::Stream,
                    tenant: tenant_id,
                    namespace,
                    name: stream,
                };
                // Handed to the leader at the next tick, like a creation.
                self.pending.push_back(c.encode());
                return self.poll_output();
            }
            BrokerOutput::Cluster(ClusterOutput::ProposeStream {
                tenant_id,
                namespace,
                stream,
                shards,
                ephemeral,
                replication,
            }) => {
                let c = Command::Create {
                    kind: crate::cluster::metadata::Kind::Stream,
                    tenant: tenant_id,
                    namespace,
                    name: stream,
                    shards,
                    ephemeral,
                    replication,
                };
                // Proposed at most once per request burst: a create of an existing stream is
                // refused by the metadata and changes nothing.
                self.pending.push_back(c.encode());
                return self.poll_output();
            }
            BrokerOutput::Cluster(ClusterOutput::Copy { to, message }) => {
                // A peer that did not offer FEATURE_SHARD_COPY (FEATURE_CACHE_COPY for a cache;
                // an older broker) cannot take part in a copy: the new owner gives the move up
                // (the shard stays home).
                let needs = match &message {
                    crate::cluster::peer::CopyMessage::Request(q)
                        if q.shard.kind == crate::cluster::metadata::Kind::Cache =>
                    {
                        crate::cluster::peer::FEATURE_CACHE_COPY
                    }
                    crate::cluster::peer::CopyMessage::Answer(a)
                        if a.shard.kind == crate::cluster::metadata::Kind::Cache =>
                    {
                        crate::cluster::peer::FEATURE_CACHE_COPY
                    }
                    _ => crate::cluster::peer::FEATURE_SHARD_COPY,
                };
                if self.peer_features.get(&to).is_some_and(|f| f & needs == 0) {
                    if let crate::cluster::peer::CopyMessage::Request(q) = &message {
                        self.pending.push_back(Command::CancelMove { shard: q.shard.clone() }.encode());
                    }
                    return self.poll_output();
                }
                let message = if self.peer_reads_meta(&to) { message } else { copy_without_meta(message) };
                let takes_state =
                    self.peer_features.get(&to).is_none_or(|f| f & crate::cluster::peer::FEATURE_COMMIT_STATE != 0);
                let message = if takes_state { message } else { copy_without_state(message) };
                let takes_groups =
                    self.peer_features.get(&to).is_none_or(|f| f & crate::cluster::peer::FEATURE_GROUP_COPY != 0);
                let message = if takes_groups { message } else { copy_without_groups(message) };
                NodeOutput::Peer { to, message: message.into() }
            }
            BrokerOutput::Cluster(ClusterOutput::ProposeCluster(c)) => {
                // A move's step: handed to the leader now, not at the next tick (writes to
                // the shard wait for it).
                self.pending.push_back(c.encode());
                let now = self.last_now;
                self.flush_pending(now);
                return self.poll_output();
            }
            BrokerOutput::Cluster(ClusterOutput::ClusterAdmin { id, request }) => {
                use crate::broker::cluster_admin::{ClusterAdminAnswer as A, ClusterAdminRequest as R};
                let now = self.last_now;
                let name = |s: &ShardId| format!("{}/{}/{} shard {}", s.tenant, s.namespace, s.name, s.shard);
                let mut tenant = None;
                let answer = match request {
                    R::Status { tenant: scope, page } => A::Status(self.status_page(scope.as_deref(), page.as_ref())),
                    R::Move { shard, to } => {
                        tenant = Some(shard.tenant.clone());
                        let what = format!("move {} to {to}", name(&shard));
                        self.request_move(shard, &to, now)
                            .map_or_else(|e| A::Refused(e.to_string()), |()| A::Proposed(what))
                    }
                    R::CancelMove { shard } => {
                        tenant = Some(shard.tenant.clone());
                        let what = format!("cancel the move of {}", name(&shard));
                        self.request_cancel_move(shard, now)
                            .map_or_else(|e| A::Refused(e.to_string()), |()| A::Proposed(what))
                    }
                };
                if let (A::Proposed(what), Some(tenant)) = (&answer, tenant) {
                    self.broker.notice(Notice::OperatorRequest { what: what.clone(), tenant });
                }
                self.broker.handle_cluster_admin_answer(id, answer);
                return self.poll_output();
            }
            other => NodeOutput::Broker(other),
        })
    }
}

/// A shard copy's answer as a new owner that did not offer [`FEATURE_COMMIT_STATE`] reads it
/// (D63): without the shard's commit state it would serve a state missing every value the
/// commits retention deleted wrote, so an answer carrying state is refused instead (the move
/// goes no further; the shard stays where it is).
fn copy_without_state(message: crate::cluster::peer::CopyMessage) -> crate::cluster::peer::CopyMessage {
    use crate::cluster::peer::{CopyAnswer, CopyBody, CopyMessage};
    match message {
        CopyMessage::Answer(CopyAnswer { shard, body: CopyBody::Batches { state: Some(_), .. } }) => {
            let why = "the shard holds commit state older than its log, which the new owner (an older broker) \
                       cannot take"
                .to_owned();
            CopyMessage::Answer(CopyAnswer { shard, body: CopyBody::Refused(why) })
        }
        other => other,
    }
}

/// A shard copy's answer as a new owner that did not offer [`FEATURE_GROUP_COPY`] reads it
/// (D65): it would finish the move with none of the shard's consumer groups, and hand out
/// again what they acknowledged, so an answer carrying groups is refused instead (the move
/// goes no further; the shard stays where it is). Answers without groups are as before.
fn copy_without_groups(message: crate::cluster::peer::CopyMessage) -> crate::cluster::peer::CopyMessage {
    use crate::cluster::peer::{CopyAnswer, CopyBody, CopyMessage};
    match message {
        CopyMessage::Answer(CopyAnswer { shard, body: CopyBody::Batches { groups: Some(_), .. } }) => {
            let why = "the shard has consumer groups, which the new owner (an older broker) cannot take".to_owned();
            CopyMessage::Answer(CopyAnswer { shard, body: CopyBody::Refused(why) })
        }
        other => other,
    }
}

/// A shard copy's answer as a new owner that did not offer [`FEATURE_BATCH_META`] reads it
/// (D59): its batches without keys and with plain records (the segment format's flag bits
/// for them are unknown to it). A batch with an envelope cannot go without it: the copy is
/// refused, and the new owner gives the move up (the shard stays where it is).
fn copy_without_meta(message: crate::cluster::peer::CopyMessage) -> crate::cluster::peer::CopyMessage {
    use crate::cluster::peer::{CopyAnswer, CopyBody, CopyMessage};
    let CopyMessage::Answer(CopyAnswer {
        shard,
        body: CopyBody::Batches { start, tail, cutting, batches, state, groups },
    }) = message
    else {
        return message;
    };
    if batches.iter().any(|b| b.records.envelope().is_some()) {
        let why =
            "the shard holds batches with envelopes, which the new owner (an older broker) does not keep".to_owned();
        return CopyMessage::Answer(CopyAnswer { shard, body: CopyBody::Refused(why) });
    }
    let batches = batches
        .into_iter()
        .map(|b| crate::storage::StoredBatch { key: None, records: b.records.plain(), ..b })
        .collect();
    CopyMessage::Answer(CopyAnswer { shard, body: CopyBody::Batches { start, tail, cutting, batches, state, groups } })
}

/// The most forwarded payload one `forward_batch` frame carries (D64): a drain's forwards to one
/// peer beyond it go in further frames, so no one frame holds the peer transport for long.
pub const FORWARD_BATCH_BYTES: usize = 1 << 20;

/// The most answers one `forward_answers` frame carries.
pub const FORWARD_ANSWERS_MAX: usize = 4096;

impl ClusterNode {
    /// Sends the forwarded publishes and the answers gathered while draining the broker: one
    /// frame per peer (more past [`FORWARD_BATCH_BYTES`] or [`FORWARD_ANSWERS_MAX`]), a lone
    /// one in the frame it always had (kind 3 or 4).
    pub(super) fn flush_forwards(&mut self) {
        for (to, list) in std::mem::take(&mut self.forward_sends) {
            let mut part: Vec<ForwardedPublish> = Vec::new();
            let mut bytes = 0;
            for p in list {
                let size = p.records.block_len();
                if !part.is_empty() && bytes + size > FORWARD_BATCH_BYTES {
                    self.out.push_back(forward_frame(&to, std::mem::take(&mut part)));
                    bytes = 0;
                }
                bytes += size;
                part.push(p);
            }
            if !part.is_empty() {
                self.out.push_back(forward_frame(&to, part));
            }
        }
        for (to, list) in std::mem::take(&mut self.answer_sends) {
            for part in list.chunks(FORWARD_ANSWERS_MAX) {
                let message = match part {
                    [(id, outcome)] => PeerMessage::ForwardAnswer { id: *id, outcome: outcome.clone() },
                    _ => PeerMessage::ForwardAnswers(part.to_vec()),
                };
                self.out.push_back(NodeOutput::Peer { to: to.clone(), message });
            }
        }
    }
}

/// One frame of forwarded publishes to `to`: kind 3 for one, kind 15 for more.
fn forward_frame(to: &str, mut part: Vec<ForwardedPublish>) -> NodeOutput {
    let message = if part.len() == 1
        && let Some(p) = part.pop()
    {
        PeerMessage::Forward(p)
    } else {
        PeerMessage::ForwardBatch(part)
    };
    NodeOutput::Peer { to: to.to_owned(), message }
}
