//! How the world carries out its brokers' outputs: peer messages onto the simulated network
//! (lost, delayed, cut), writes to the simulated disks, reads answered, and the checks that
//! judge a write when it is asked for (only an owner writes its shard).

use super::*;

impl World {
    pub(super) fn output(&mut self, name: &str, o: NodeOutput, rng: &mut Rng, faults: bool) -> Result<(), Violation> {
        let now = self.now;
        match o {
            NodeOutput::PersistRaft { entries, hard_state } => {
                self.kept.entry(name.to_owned()).or_default().persist(&entries, hard_state.as_ref());
            }
            NodeOutput::PersistRaftSnapshot { snapshot, received } => {
                self.report.meta_snapshots += 1;
                self.report.meta_snapshots_received += u64::from(received);
                self.kept.entry(name.to_owned()).or_default().persist_snapshot(&snapshot);
            }
            NodeOutput::PersistReplica { shard, entries, hard_state } => {
                self.kept_replicas
                    .entry(name.to_owned())
                    .or_default()
                    .entry(shard)
                    .or_default()
                    .persist(&entries, hard_state.as_ref());
            }
            NodeOutput::PersistReplicaSnapshot { shard, mut snapshot, rest } => {
                if let Some(rest) = rest {
                    rest.append_to(&mut snapshot);
                    self.report.snapshots_with_rest += 1;
                }
                self.report.snapshots += 1;
                self.kept_replicas
                    .entry(name.to_owned())
                    .or_default()
                    .entry(shard)
                    .or_default()
                    .persist_snapshot(&snapshot);
            }
            NodeOutput::DropReplica { shard } => {
                if let Some(k) = self.kept_replicas.get_mut(name) {
                    k.remove(&shard);
                }
            }
            NodeOutput::ReadReplicaLog { shard, token, low, high, max_bytes } => {
                let kept = self.kept_replicas.get(name).and_then(|k| k.get(&shard));
                let entries = kept.map(|l| l.read(low, high, max_bytes)).unwrap_or_default();
                if let Some(n) = self.nodes.get_mut(name) {
                    n.handle_replica_log_read(token, Ok(entries), now);
                }
            }
            NodeOutput::ReadReplicaSnapshotPiece { shard, token, index, offset, len, .. } => {
                self.report.snapshot_reads += 1;
                let kept = self.kept_replicas.get(name).and_then(|k| k.get(&shard)).and_then(|l| l.snapshot.as_ref());
                let read = match kept {
                    Some(s) if s.get_metadata().index == index => {
                        crate::cluster::meta::piece_of(&s.data, offset, len).map_err(|e| e.to_string())
                    }
                    Some(s) => Err(format!("the snapshot kept is at {}, not {index}", s.get_metadata().index)),
                    None => Err("no snapshot kept".to_owned()),
                };
                if let Some(n) = self.nodes.get_mut(name) {
                    n.handle_replica_snapshot_piece(token, read, now);
                }
            }
            NodeOutput::Peer { to, message } => {
                if matches!(message, crate::cluster::peer::PeerMessage::SnapshotChunk(_)) {
                    self.report.snapshot_chunks += 1;
                }
                let cut = self.cut.contains(name) != self.cut.contains(&to) || !self.nodes.contains_key(&to);
                if cut && rng.chance(500) {
                    // The transport knows the link is down: it says so.
                    self.report.lost += 1;
                    if let Some(n) = self.nodes.get_mut(name) {
                        n.handle_undeliverable(message, now);
                    }
                    return Ok(());
                }
                if let (crate::cluster::peer::PeerMessage::SnapshotChunk(c), Some(n)) =
                    (&message, self.nodes.get_mut(name))
                {
                    // The transport took it (whether it arrives or not).
                    n.handle_snapshot_chunk_written(&to, &c.shard, c.index, now);
                }
                if cut || (faults && rng.chance(30)) {
                    // Lost in flight (a connection that died with it).
                    self.report.lost += 1;
                    return Ok(());
                }
                let mut b = BytesMut::new();
                encode(&message, &mut b).map_err(|e| self.violation(format!("peer message does not encode: {e}")))?;
                let delay = if faults { TICK * rng.below(4) as u32 } else { Duration::ZERO };
                self.network.push((now + delay, name.to_owned(), to, b.freeze()));
            }
            NodeOutput::Broker(b) => self.broker_output(name, b)?,
            // This simulation's voters are the founding ones.
            NodeOutput::PeerAdded { .. } | NodeOutput::PeerRemoved { .. } => {}
            // Every restart here keeps its data directory: a refusal is a bug.
            NodeOutput::PeerRefused { why, .. } => return Err(self.violation(format!("{name} refused a peer: {why}"))),
            // The world damages no kept log; a leader that saw a replica answer below what it
            // acknowledged takes it out and back in, which changes no history.
            NodeOutput::ReplicaRejoin { what, .. } => {
                if std::env::var_os("FELIX_WORLD_DEBUG").is_some() {
                    eprintln!("{name}: {what}");
                }
            }
        }
        Ok(())
    }

    pub(super) fn broker_output(&mut self, name: &str, o: BrokerOutput) -> Result<(), Violation> {
        let now = self.now;
        match o {
            BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data })
                if self.is_follower(name, conn) =>
            {
                self.give_follower(name, conn, stream, data, false);
            }
            BrokerOutput::Transport(TransportOutput::Finish { conn, stream }) if self.is_follower(name, conn) => {
                self.give_follower(name, conn, stream, Bytes::new(), true);
            }
            BrokerOutput::Transport(TransportOutput::CloseConnection { conn, reason, .. }) => {
                self.follower_lost(name, Some(conn), &reason)
            }
            BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data }) => {
                if stream == StreamId::new(Side::Client, Dir::Bi, 0)
                    && let Some(p) = self.pending.get_mut(&(name.to_owned(), conn))
                {
                    p.bytes.extend_from_slice(&data);
                    self.answer(name, conn)?;
                }
            }
            BrokerOutput::Storage(StorageOutput::Persist(w)) => {
                if STREAMS.iter().any(|(s, _, ephemeral, _)| *s == w.stream && *ephemeral) {
                    return Err(self.violation(format!("{name} persists {}, created in memory only", w.stream)));
                }
                if w.stream == LEDGER {
                    return Err(self.violation(format!("{name} writes the replicated {LEDGER} beside its Raft log")));
                }
                if w.stream == ORDERS && w.tenant_id == TENANT {
                    let b = crate::storage::StoredBatch {
                        key: None,
                        base_offset: w.base_offset,
                        timestamp_micros: w.timestamp_micros,
                        generation_start: w.generation_start,
                        publisher: w.publisher.clone(),
                        producer: w.producer,
                        state: w.state.clone(),
                        records: w.records.clone(),
                    };
                    self.disks.entry(name.to_owned()).or_default().entry(w.shard).or_default().insert(w.base_offset, b);
                }
                if !w.generation_start && w.tenant_id == TENANT {
                    let node = &self.nodes[name];
                    let s = shard_id(&w.stream, w.shard);
                    let owner = node.metadata().owner(&s).map(|a| a.owner.clone());
                    // A moving shard's new owner writes the copy of its records.
                    let copying = node.metadata().moving(&s).is_some_and(|m| m.to == name);
                    if owner.as_deref() != Some(name) && !copying {
                        return Err(self.violation(format!("{name} writes {s:?} owned by {owner:?}")));
                    }
                    self.report.persisted += u64::from(w.records.count());
                }
                if let Some(n) = self.nodes.get_mut(name) {
                    n.broker.handle_write_result(w.token, WriteOutcome::Written, now);
                }
            }
            BrokerOutput::Storage(StorageOutput::Read(r)) => {
                // From the batch holding `from`, before `end`, about `max_bytes` at most.
                let mut batches = Vec::new();
                if r.stream == ORDERS
                    && let Some(disk) = self.disks.get(name).and_then(|d| d.get(&r.shard))
                {
                    let mut bytes = 0;
                    for b in disk.values() {
                        if b.base_offset + b.count() <= r.from {
                            continue;
                        }
                        if b.base_offset >= r.end || (!batches.is_empty() && bytes >= r.max_bytes) {
                            break;
                        }
                        bytes += b.records.payload_bytes();
                        batches.push(b.clone());
                    }
                }
                if let Some(n) = self.nodes.get_mut(name) {
                    n.broker.handle_read_complete(r.token, batches, now);
                }
            }
            BrokerOutput::Storage(StorageOutput::ResetShard { stream, shard, .. }) => {
                if stream == ORDERS
                    && let Some(d) = self.disks.get_mut(name)
                {
                    d.remove(&shard);
                }
            }
            BrokerOutput::Storage(StorageOutput::Truncate { stream, shard, start, .. }) => {
                if stream == ORDERS
                    && let Some(disk) = self.disks.get_mut(name).and_then(|d| d.get_mut(&shard))
                {
                    disk.retain(|_, b| b.base_offset + b.count() > start);
                }
            }
            BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                self.next_uni += 1;
                let id = StreamId::new(Side::Broker, Dir::Uni, self.next_uni);
                if let Some(n) = self.nodes.get_mut(name) {
                    n.broker.handle_stream_opened(conn, token, id, now);
                }
            }
            _ => {}
        }
        Ok(())
    }
}
