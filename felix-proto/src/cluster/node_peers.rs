//! A cluster node's side of its peers: each peer message handled, a peer whose data directory
//! was wiped refused, messages that could not be delivered and connections lost. A child of
//! `node` (it reads the node's fields), in a file of its own.

use super::*;

impl ClusterNode {
    /// A message from peer broker `from` (its hello already checked by the transport).
    pub fn handle_peer(&mut self, from: &str, m: PeerMessage, now: Instant) {
        self.last_now = self.last_now.max(now);
        if let PeerMessage::Hello { incarnation, features, .. } = &m {
            // A new connection: what it reads is what this hello says (a peer restarted as an
            // older version reads fewer kinds).
            self.peer_features.insert(from.to_owned(), *features);
            self.check_incarnation(from, incarnation);
            self.broker.notice(Notice::PeerConnected { peer: from.to_owned() });
            // It may have restarted (its replicas forgot who leads): the groups it is in tick
            // until they settle again (not put back to sleep as after a mere silence).
            self.woken_by_silence.remove(from);
            self.wake_involving(from);
            return;
        }
        if self.refused.contains(from) {
            return;
        }
        // The leader's lease on a member (`check_leases`) counts what it says as a member of
        // the cluster, not the empty heartbeat hibernation sends every peer regardless: a
        // broker cut off from the leader's messages (one way) would keep its lease with those
        // alone, and the leader would never declare it down.
        let keepalive = matches!(&m, PeerMessage::Heartbeats(list) if list.is_empty());
        if !keepalive {
            self.last_seen.insert(from.to_owned(), now);
        }
        if self.silent.remove(from) {
            self.heard_again(from);
        }
        match self.heard_at.get_mut(from) {
            Some(t) => *t = self.ticks,
            None => {
                self.heard_at.insert(from.to_owned(), self.ticks);
            }
        }
        match m {
            PeerMessage::Hello { .. } => {}
            PeerMessage::Raft(bytes) => {
                // A message that does not decode, or that the engine refuses (another group,
                // a stale term), changes nothing.
                if let Ok(msg) = decode_message(&bytes) {
                    // A broker that joined learns who its peers are from what they send (the
                    // transport checked who is speaking) before its log tells it.
                    if msg.from == raft_id(from) {
                        self.names.entry(msg.from).or_insert_with(|| from.to_owned());
                    }
                    // Only a leader sends these: it is in contact (its lease holds).
                    if matches!(
                        msg.get_msg_type(),
                        MessageType::MsgHeartbeat | MessageType::MsgAppend | MessageType::MsgSnapshot
                    ) && msg.term >= self.meta.term()
                    {
                        self.leader_contact = now;
                    }
                    let _ = self.meta.step(msg);
                    // Not known current: asked as soon as there is a leader to ask.
                    if self.currency != Currency::Current {
                        self.check_fence(now);
                    }
                }
            }
            PeerMessage::CopyRequest(q) => self.broker.handle_copy_request(from, q, now),
            PeerMessage::CopyAnswer(a) => self.broker.handle_copy_answer(from, a, now),
            PeerMessage::Forward(p) => self.broker.handle_forwarded(from, p, now),
            PeerMessage::ForwardAnswer { id, outcome } => self.broker.handle_forward_answer(id, outcome, now),
            PeerMessage::ForwardBatch(list) => {
                for p in list {
                    self.broker.handle_forwarded(from, p, now);
                }
            }
            PeerMessage::ForwardAnswers(list) => {
                for (id, outcome) in list {
                    self.broker.handle_forward_answer(id, outcome, now);
                }
            }
            PeerMessage::Request(q) => self.broker.handle_forwarded_request(from, q, now),
            PeerMessage::RequestAnswer { id, data } => self.broker.handle_forward_request_answer(id, data, now),
            PeerMessage::Propose(data) => {
                self.pending.push_back(data.to_vec());
                self.flush_pending(now);
            }
            PeerMessage::ShardRaft(list) => {
                for (shard, bytes) in list {
                    // One that does not decode changes nothing; Raft resends.
                    let Ok(msg) = crate::cluster::meta::decode_message_shared(&bytes.to_bytes()) else { continue };
                    self.step_shard(from, shard, msg, now);
                }
            }
            PeerMessage::SnapshotChunk(c) => {
                if let Some((shard, msg, rest)) = self.take_chunk(from, c) {
                    self.snapshot_chunk_counts.1 += 1;
                    self.step_shard_with(from, shard, msg, rest, now);
                }
            }
            PeerMessage::Heartbeats(list) => {
                let sender = raft_id(from);
                for (shard, beat) in list {
                    let Some(h) = self.replicas.get_mut(&shard) else { continue };
                    if h.names.get(&sender).is_none_or(|n| n != from) {
                        continue; // only a shard's own replicas speak for it
                    }
                    let mut msg = Message::default();
                    msg.set_msg_type(if beat.response {
                        MessageType::MsgHeartbeatResponse
                    } else {
                        MessageType::MsgHeartbeat
                    });
                    if !beat.response {
                        h.heard_at = self.ticks;
                    }
                    msg.from = sender;
                    msg.to = h.replica.id();
                    msg.term = beat.term;
                    msg.commit = beat.commit;
                    if let Some((why, what)) = lost_acknowledged(h, &msg, self.rejoining.contains_key(&shard)) {
                        start_rejoin(&mut self.rejoining, &mut self.rejoin_counts, &mut self.out, &shard, why, what);
                    }
                    h.replica.step(msg);
                    self.drain_replica(&shard, now);
                    self.wake(&shard);
                }
            }
        }
        if !self.pending.is_empty() {
            self.flush_pending(now);
        }
        self.drain_meta(now);
        self.flush_shard_sends();
    }

    /// A peer said hello with `incarnation`: one the cluster does not know for it (another than
    /// the one it joined with) means its data directory was wiped or replaced. Its Raft state
    /// (votes, log) and records are gone; letting it take part could elect two leaders in a term
    /// and serve its durable shards empty. So it is refused until an operator removes it (and
    /// adds it back with `--join`) or restores its data directory.
    fn check_incarnation(&mut self, from: &str, incarnation: &str) {
        let known = self.metadata.members().get(from).map(|m| m.incarnation.as_str()).unwrap_or("");
        if known.is_empty() || incarnation == known {
            self.refused.remove(from);
            return;
        }
        if self.refused.insert(from.to_owned()) {
            let why = format!(
                "{from} came back with another data directory (incarnation {incarnation:?}, the cluster knows \
                 {known:?}): its Raft state and the records only it held are gone. Restore its data directory, \
                 or remove it (`felix-node cluster remove {from} --force`) and add it back started with --join"
            );
            self.out.push_back(NodeOutput::PeerRefused { name: from.to_owned(), why });
        }
    }

    /// Peers refused for a wiped data directory.
    pub fn refused_peers(&self) -> impl Iterator<Item = &String> {
        self.refused.iter()
    }

    /// A message to `to` could not be delivered (no connection): a forwarded publish is then
    /// answered `shard_unavailable`; Raft retries on its own; a proposal is retried.
    pub fn handle_undeliverable(&mut self, message: PeerMessage, now: Instant) {
        match message {
            PeerMessage::Forward(p) => self.broker.handle_forward_failed(p.id, now),
            PeerMessage::ForwardBatch(list) => {
                for p in list {
                    self.broker.handle_forward_failed(p.id, now);
                }
            }
            PeerMessage::Request(q) => self.broker.handle_forward_request_failed(q.id, now),
            PeerMessage::Propose(data) => self.pending.push_back(data.to_vec()),
            PeerMessage::SnapshotChunk(c) => self.end_snapshot_sends(None, Some((&c.shard, c.index))),
            _ => {}
        }
    }

    /// The driver's connection to peer `peer` closed (it went quiet past the idle timeout, or
    /// was closed): what was forwarded on it is answered now, outcome unknown
    /// ([`Broker::handle_peer_connection_lost`]); Raft resends on its own.
    pub fn handle_peer_lost(&mut self, peer: &str, now: Instant) {
        // Snapshots it was sending in chunks will not go on where they stopped.
        self.assemblies.retain(|(from, _), _| from != peer);
        self.end_snapshot_sends(Some(peer), None);
        self.broker.notice(Notice::PeerLost { peer: peer.to_owned() });
        self.wake_involving(peer);
        self.broker.handle_peer_connection_lost(peer, now);
    }
}
