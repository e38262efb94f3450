//! Shard groups' snapshots a leader sends from disk ([`super::super::snapshot_send`]): a
//! follower behind the compaction is sent the engine's `MsgSnapshot`, its data read from the
//! kept log a chunk at a time ([`NodeOutput::ReadReplicaSnapshotPiece`]) and shipped as it
//! comes, paced by what the transport took ([`ClusterNode::handle_snapshot_chunk_written`]) and,
//! for a move's copy, by the move budget. A child of [`super`] in a file of its own, as
//! [`hibernation`](super::hibernation) is: it keeps the node's fields private.

use super::*;
use crate::cluster::meta::{Snapshot, SnapshotPiece};
use crate::cluster::replica::SnapshotRest;
use crate::cluster::snapshot_send::{Ship, SnapshotSend};

/// The index of `snapshot` and whether its host state holds a stream's commit state (what
/// decides whether it may go to a peer that does not read commit state, D63). A `rest` of
/// any bytes is one: the only part a host keeps apart is a stream's commit section.
pub(super) fn snapshot_holds_commits(snapshot: &Snapshot, rest: Option<&SnapshotRest>) -> (u64, bool) {
    let holds = Replica::host_state_of(snapshot.get_data()).is_some_and(Broker::stream_state_holds_commits)
        || rest.is_some_and(SnapshotRest::holds_commits);
    (snapshot.get_metadata().index, holds)
}

impl ClusterNode {
    /// Shard groups' snapshots with more data than `bytes` go in chunks of it (to peers that
    /// read them); [`SNAPSHOT_CHUNK_BYTES`] unless set (simulations set it small).
    pub fn set_snapshot_chunk_bytes(&mut self, bytes: usize) {
        self.snapshot_chunk_bytes = bytes.max(1);
    }

    /// Snapshots of replicated streams not sent to a replica whose broker cannot read the
    /// commit state they hold (D63; each retry counts).
    pub fn shard_snapshots_withheld(&self) -> u64 {
        self.shard_snapshots_withheld
    }

    /// Snapshot chunks sent, and snapshots put together from chunks received.
    pub fn snapshot_chunk_counts(&self) -> (u64, u64) {
        self.snapshot_chunk_counts
    }

    /// Whether `message` is a `MsgSnapshot` of `shard`'s group whose data is on disk only, for
    /// this broker to send from there ([`Replica::set_snapshot_by_reference`]). Any of its
    /// group's snapshots without data is: a replica's snapshot data is never empty (it starts
    /// with the state's version), and one of an older compaction (replaced between the engine
    /// making the message and its sending) must not go out without its data either; its send
    /// ends at once and the engine offers the newer one.
    pub(super) fn snapshot_by_reference(&self, shard: &ShardId, message: &Message) -> bool {
        message.get_msg_type() == MessageType::MsgSnapshot
            && message.get_snapshot().get_data().is_empty()
            && self.replicas.contains_key(shard)
    }

    /// Whether a snapshot of `shard` whose host state `holds_commits` must not go to `name`:
    /// an older broker would take it without the commit state and could later serve a state
    /// missing every value the compacted commits wrote (D63). It waits, behind, for an
    /// upgrade (every snapshot sent is reported sent, so the engine offers it again as the
    /// follower is probed: sent once it reads it). Said once per replica.
    pub(super) fn withhold_snapshot(&mut self, name: &str, shard: &ShardId, holds_commits: bool) -> bool {
        let withhold = holds_commits
            && shard.kind == crate::shard::Kind::Stream
            && self.offers & FEATURE_COMMIT_STATE != 0
            && self.peer_features.get(name).is_none_or(|f| f & FEATURE_COMMIT_STATE == 0);
        if withhold {
            self.shard_snapshots_withheld += 1;
            if self.withheld_shard_snapshots.insert((shard.clone(), name.to_owned())) {
                let label = format!("{}/{}/{}#{}", shard.tenant, shard.namespace, shard.name, shard.shard);
                self.broker.notice(Notice::ShardSnapshotWithheld { shard: label, replica: name.to_owned() });
            }
        }
        withhold
    }

    /// Starts sending `message` (a `MsgSnapshot` whose data is on disk) to replica `name`;
    /// `charged`: it is a move's copy, paced by the move budget. The engine offers the same
    /// snapshot again at each probe of a follower still behind: while a send of it makes
    /// progress that changes nothing, and a stalled one starts afresh.
    pub(super) fn start_snapshot_send(
        &mut self,
        name: String,
        shard: &ShardId,
        message: Message,
        charged: bool,
        now: Instant,
    ) {
        let index = message.get_snapshot().get_metadata().index;
        // Known whenever the data was in hand (persisted, or kept at the start); else the
        // safe side: not to a peer that would drop the commit state.
        let holds = self.replicas.get(shard).and_then(|h| h.snapshot_commits).is_none_or(|(i, c)| i != index || c);
        if self.withhold_snapshot(&name, shard, holds) {
            return;
        }
        let key = (shard.clone(), name);
        if let Some(s) = self.snapshot_sends.get(&key)
            && s.index() == index
            && !s.stalled(now)
        {
            return;
        }
        self.snapshot_send_reads.retain(|_, k| *k != key);
        // Failures said of older snapshots to this replica are forgotten (a newer one is sent).
        self.snapshot_send_failures.retain(|(s, n, i)| !(*s == key.0 && *n == key.1 && *i < index));
        let takes_chunks = self.offers & FEATURE_SNAPSHOT_CHUNKS != 0
            && self.peer_features.get(&key.1).is_some_and(|f| f & FEATURE_SNAPSHOT_CHUNKS != 0);
        let send = SnapshotSend::new(shard.clone(), message, takes_chunks, self.snapshot_chunk_bytes, charged, now);
        self.snapshot_sends.insert(key.clone(), send);
        self.snapshot_send_counts.0 += 1;
        self.pump_snapshot_send(&key, now);
    }

    /// Asks the next read of a send, if it may go on now (its window has room, the move
    /// budget allows a move's copy); ends a send whose snapshot is no longer the group's last.
    fn pump_snapshot_send(&mut self, key: &(ShardId, String), now: Instant) {
        let Some(s) = self.snapshot_sends.get_mut(key) else { return };
        if s.done() {
            self.snapshot_sends.remove(key);
            self.snapshot_send_counts.1 += 1;
            return;
        }
        let current = self.replicas.get(&key.0).and_then(|h| h.replica.offloaded_snapshot()) == Some(s.index());
        if !current {
            // Compacted again (or the replica is gone): the engine offers the newer one.
            self.snapshot_sends.remove(key);
            self.snapshot_send_reads.retain(|_, k| k != key);
            self.snapshot_send_counts.2 += 1;
            return;
        }
        let Some((offset, len)) = s.next_read() else { return };
        if s.charged() {
            let budget = &mut self.broker.membership.move_bandwidth;
            if !budget.may_send(now) {
                return; // the next tick tries again
            }
            budget.charge(len, now);
        }
        let token = self.next_replica_read;
        self.next_replica_read += 1;
        s.asked(token);
        self.snapshot_send_reads.insert(token, key.clone());
        self.out.push_back(NodeOutput::ReadReplicaSnapshotPiece {
            shard: key.0.clone(),
            token,
            index: s.index(),
            offset,
            len,
            verify: offset == 0,
        });
    }

    /// Each tick: sends waiting for the move budget go on where it allows.
    pub(super) fn resume_snapshot_sends(&mut self, now: Instant) {
        if self.snapshot_sends.is_empty() {
            return;
        }
        let keys: Vec<(ShardId, String)> = self.snapshot_sends.keys().cloned().collect();
        for key in keys {
            self.pump_snapshot_send(&key, now);
        }
    }

    /// The driver read the piece a [`NodeOutput::ReadReplicaSnapshotPiece`] asked for
    /// (`Err`: it could not, and why): it goes to the follower, and the next is asked when
    /// the send's window has room. A failed read ends the send; the engine sends the snapshot
    /// again as it probes the follower.
    pub fn handle_replica_snapshot_piece(&mut self, token: u64, read: Result<SnapshotPiece, String>, now: Instant) {
        self.last_now = self.last_now.max(now);
        let now = self.last_now;
        let Err(read) = self.take_restore_piece(token, read, now) else { return };
        let Some(key) = self.snapshot_send_reads.remove(&token) else { return };
        let Some(s) = self.snapshot_sends.get_mut(&key) else { return };
        match s.on_read(token, read, now) {
            Ok(Some(Ship::Chunk(c))) => {
                self.snapshot_chunk_counts.0 += 1;
                self.out.push_back(NodeOutput::Peer { to: key.1.clone(), message: PeerMessage::SnapshotChunk(c) });
            }
            Ok(Some(Ship::Whole(m))) => {
                let parts = crate::cluster::meta::encode_message_parts(&m);
                self.shard_sends.entry(key.1.clone()).or_default().push((key.0.clone(), parts));
                self.flush_shard_sends();
            }
            Ok(None) => {}
            Err(e) => {
                let index = s.index();
                self.snapshot_sends.remove(&key);
                self.snapshot_send_counts.2 += 1;
                // Said once per snapshot and replica: the engine offers it again at each probe,
                // and a damaged record fails each time until the next compaction replaces it.
                if !self.snapshot_send_failures.insert((key.0.clone(), key.1.clone(), index)) {
                    return;
                }
                let label = format!("{}/{}/{}#{}", key.0.tenant, key.0.namespace, key.0.name, key.0.shard);
                self.broker.notice(Notice::ShardSnapshotSendFailed {
                    shard: label,
                    replica: key.1,
                    why: e.to_string(),
                });
                return;
            }
        }
        self.pump_snapshot_send(&key, now);
    }

    /// The transport took a `snapshot_chunk` of `shard`'s snapshot at `index` for peer `to`
    /// (written to its stream: not an acknowledgement, which would hold each chunk for a
    /// round trip): the send may read its next one.
    pub fn handle_snapshot_chunk_written(&mut self, to: &str, shard: &ShardId, index: u64, now: Instant) {
        self.last_now = self.last_now.max(now);
        let now = self.last_now;
        let key = (shard.clone(), to.to_owned());
        let Some(s) = self.snapshot_sends.get_mut(&key) else { return };
        if s.index() != index {
            return;
        }
        s.on_written(now);
        self.pump_snapshot_send(&key, now);
    }

    /// Ends the sends a lost connection or an undeliverable chunk cut short (`to`: every send
    /// to that peer; else every send of `shard`'s snapshot at `index`, the chunk not saying to
    /// whom): the engine sends the snapshot again as it probes the follower.
    pub(super) fn end_snapshot_sends(&mut self, to: Option<&str>, chunk: Option<(&ShardId, u64)>) {
        let before = self.snapshot_sends.len();
        self.snapshot_sends.retain(|(shard, name), s| {
            let cut = to.is_some_and(|t| t == name) || chunk.is_some_and(|(sh, i)| sh == shard && s.index() == i);
            !cut
        });
        self.snapshot_send_counts.2 += (before - self.snapshot_sends.len()) as u64;
        let sends = &self.snapshot_sends;
        self.snapshot_send_reads.retain(|_, k| sends.contains_key(k));
    }

    /// Snapshot sends from disk: started, finished, ended early (a read failed, the
    /// connection was lost, a newer snapshot replaced it).
    pub fn snapshot_send_counts(&self) -> (u64, u64, u64) {
        self.snapshot_send_counts
    }

    /// Shard snapshots received whose data is not a replica's state (none: a message whose
    /// data was to follow), dropped rather than installed.
    pub fn snapshots_refused(&self) -> u64 {
        self.snapshots_refused
    }

    /// Bytes of snapshot data the sends under way hold: none for a peer that reads chunks
    /// (what was read is in the transport), the data gathered so far for one that takes it
    /// whole.
    pub fn snapshot_send_memory(&self) -> u64 {
        self.snapshot_sends.values().map(|s| s.held() as u64).sum()
    }
}
