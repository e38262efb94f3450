//! Carrying out the state machine's outputs: replica and metadata log writes first, then
//! everything else once the sync it waits on is done.

use super::*;

impl BrokerTask {
    /// Carries out what the state machine asks for. Its writes to the replica logs (and the
    /// metadata log) are made at once, in order; with the replica logs synced before answering
    /// (the default), every other output after an append waits in [`ReplicaSyncGate`] until a
    /// sync has put that append on disk, so a vote, an append response, a commit counted with
    /// this broker's own copy, or a client's acknowledgement never goes out ahead of its bytes.
    pub(super) fn drain(&mut self) {
        use felix_proto::cluster::node::NodeOutput;
        // Metadata log persists waiting to be written: consecutive ones are appended and
        // synced together, before any other output is carried out.
        let mut meta_unwritten = false;
        // How full the links to other brokers are: a leader holds its reads for followers
        // behind while they are full (`CATCH_UP_QUEUE_LIMIT`). Read here, before every drain:
        // the answers of a follower catching up wake this task as the links drain.
        if let (Node::Cluster(n), Some(t)) = (&mut self.node, &self.transport) {
            n.set_peer_queued(t.queued_bytes());
        }
        while let Some(o) = self.node.poll_output() {
            if meta_unwritten && !matches!(o, NodeOutput::PersistRaft { .. }) {
                meta_unwritten = false;
                self.write_meta_log();
            }
            match o {
                NodeOutput::PersistReplica { shard, entries, hard_state } => {
                    // Appended before anything after it is carried out (Raft's rule).
                    if let Some(l) = self.replica_logs.as_mut() {
                        match l.persist(&shard, &entries, hard_state.as_ref()) {
                            Ok(()) => self.gate.wrote(l.syncs_before_answering()),
                            Err(e) => {
                                if let Node::Cluster(n) = &mut self.node {
                                    n.handle_replica_persist_failed(&shard, &e.to_string(), now());
                                }
                            }
                        }
                    }
                }
                NodeOutput::PersistReplicaSnapshot { shard, snapshot, rest } => {
                    if let Some(l) = self.replica_logs.as_mut() {
                        match l.persist_snapshot(&shard, &snapshot, rest.as_ref()) {
                            Ok(()) => self.gate.wrote(l.syncs_before_answering()),
                            Err(e) => {
                                if let Node::Cluster(n) = &mut self.node {
                                    n.handle_replica_persist_failed(&shard, &e.to_string(), now());
                                }
                            }
                        }
                    }
                }
                NodeOutput::DropReplica { shard } => {
                    if let Some(l) = self.replica_logs.as_mut() {
                        l.drop_shard(&shard);
                    }
                }
                NodeOutput::ReadReplicaLog { shard, token, low, high, max_bytes } => {
                    // What was appended is readable now (a sync is not needed to read it), so
                    // the read is not held behind one; it runs on the blocking pool.
                    match self.replica_logs.as_ref().and_then(|l| l.read_job(&shard, low, high, max_bytes)) {
                        Some(job) => {
                            self.replica_log_reads += 1;
                            let tx = self.tx.clone();
                            tokio::task::spawn_blocking(move || {
                                let _ = tx.send(Input::ReplicaLogRead { token, result: job.run() });
                            });
                        }
                        None => {
                            if let Node::Cluster(n) = &mut self.node {
                                n.handle_replica_log_read(token, Err("no log kept for the shard".into()), now());
                            }
                        }
                    }
                }
                NodeOutput::ReadReplicaSnapshotPiece { shard, token, index, offset, len, verify } => {
                    // Like a read of entries: what was appended is readable now; off the task.
                    let job = self
                        .replica_logs
                        .as_ref()
                        .and_then(|l| l.snapshot_piece_job(&shard, index, offset, len, verify));
                    self.replica_snapshot_reads += 1;
                    match job {
                        Some(job) => {
                            let tx = self.tx.clone();
                            tokio::task::spawn_blocking(move || {
                                let _ = tx.send(Input::ReplicaSnapshotPiece { shard, token, result: job.run() });
                            });
                        }
                        None => {
                            if let Node::Cluster(n) = &mut self.node {
                                n.handle_replica_snapshot_piece(token, Err("no snapshot kept".into()), now());
                            }
                        }
                    }
                }
                NodeOutput::PersistRaftSnapshot { snapshot, received } => {
                    // Durable before anything after it is carried out, like a persist (the
                    // persists before it were written above). It stands for the log before
                    // it: the file is rewritten as the snapshot and the entries after it.
                    let index = snapshot.get_metadata().index;
                    if let Some((file, kept)) = self.raft_log.as_mut() {
                        kept.persist_snapshot(&snapshot);
                        if let Some(file) = file
                            && let Err(e) = file.rewrite(kept)
                        {
                            tracing::error!("writing the cluster's Raft log (a metadata snapshot at {index}): {e}");
                        }
                    }
                    if received {
                        tracing::info!(
                            "cluster: the metadata was restored from the leader's snapshot at index {index} ({} bytes)",
                            snapshot.get_data().len()
                        );
                    } else {
                        tracing::debug!(
                            "cluster: metadata log compacted at index {index} (a {} byte snapshot)",
                            snapshot.get_data().len()
                        );
                    }
                }
                NodeOutput::PersistRaft { entries, hard_state } => {
                    // Durable before anything after it is carried out (Raft's rule): written
                    // whole and synced here, on the task, before the next other output.
                    if let Some((_, kept)) = self.raft_log.as_mut() {
                        kept.persist(&entries, hard_state.as_ref());
                        self.meta_parts.push((entries, hard_state));
                        meta_unwritten = true;
                    }
                }
                o => {
                    if let Some(o) = self.gate.hold(o) {
                        self.carry_out(o);
                    }
                }
            }
        }
        if meta_unwritten {
            self.write_meta_log();
        }
        self.start_replica_sync();
        self.flush_storage();
    }

    /// Appends the metadata group's persists of this drain to its file (synced).
    pub(super) fn write_meta_log(&mut self) {
        let parts = std::mem::take(&mut self.meta_parts);
        if let Some((Some(file), kept)) = self.raft_log.as_mut()
            && let Err(e) = file.append(&parts, kept)
        {
            tracing::error!("writing the cluster's Raft log: {e}");
        }
    }

    /// Hands the replica log files written since the last sync to the sync thread, unless a
    /// sync is already running (the next one then covers them too: group commit).
    pub(super) fn start_replica_sync(&mut self) {
        let Some(covers) = self.gate.sync_to_start() else { return };
        let files = self.replica_logs.as_mut().map(crate::cluster::ReplicaLogs::take_unsynced).unwrap_or_default();
        if files.is_empty() {
            // Nothing left to sync (a shard dropped meanwhile): done at once.
            self.replica_synced(covers, Ok(()));
            return;
        }
        if self.replica_syncer.send((covers, files)).is_err() {
            self.replica_synced(covers, Err("the replica sync thread is gone".into()));
        }
    }

    /// A sync the sync thread ran has ended: what waited on it is carried out. A failed sync
    /// stops the broker: the kernel may have dropped the pages it failed to write, so what this
    /// broker appended (and told its peers it holds) can no longer be vouched for; the outputs
    /// that waited on it are never carried out (as PostgreSQL does since 2018's fsync
    /// failures). The process exits 74 (EX_IOERR) and a restart reads what is on disk.
    pub(super) fn replica_synced(&mut self, covers: u64, result: Result<(), String>) {
        if let Err(e) = result {
            tracing::error!(
                "syncing a replica log failed: {e}; the broker stops rather than vouch for what the disk may not hold"
            );
            eprintln!(
                "felix: syncing a replica log failed: {e}; stopping (exit 74) without answering what waited on it"
            );
            std::process::exit(74);
        }
        for o in self.gate.synced(covers) {
            self.carry_out(o);
        }
        self.start_replica_sync();
    }

    /// Carries out one output that is not a write to a replica or metadata log.
    pub(super) fn carry_out(&mut self, o: felix_proto::cluster::node::NodeOutput) {
        use felix_proto::cluster::node::NodeOutput;
        {
            let o = match o {
                NodeOutput::Broker(o) => o,
                NodeOutput::Peer { to, message } => {
                    let failed = match &self.transport {
                        Some(t) => t.send(&to, message).err().map(|m| *m),
                        None => Some(message),
                    };
                    if let (Some(m), Node::Cluster(n)) = (failed, &mut self.node) {
                        n.handle_undeliverable(m, now());
                    }
                    return;
                }
                NodeOutput::PeerAdded { name, cluster_addr } => {
                    use std::net::ToSocketAddrs;
                    match cluster_addr.to_socket_addrs().ok().and_then(|mut a| a.next()) {
                        Some(addr) => {
                            if let Some(t) = self.transport.as_mut() {
                                t.add_peer(&name, addr);
                            }
                            tracing::info!("cluster: {name} joined the members, at {addr}");
                        }
                        None => tracing::error!("cluster: member {name}'s address {cluster_addr:?} does not resolve"),
                    }
                    return;
                }
                NodeOutput::PeerRefused { name, why } => {
                    tracing::error!("cluster: refused {name}: {why}");
                    return;
                }
                NodeOutput::ReplicaRejoin { shard, what } => {
                    tracing::warn!(
                        "cluster: replica of {}/{}/{} shard {}: {what}",
                        shard.tenant,
                        shard.namespace,
                        shard.name,
                        shard.shard
                    );
                    return;
                }
                NodeOutput::PeerRemoved { name } => {
                    if let Some(t) = self.transport.as_mut() {
                        t.remove_peer(&name);
                    }
                    tracing::info!("cluster: {name} left the members");
                    return;
                }
                // Writes (and reads of replica logs) are made in `drain`, never held.
                NodeOutput::PersistReplica { .. }
                | NodeOutput::PersistReplicaSnapshot { .. }
                | NodeOutput::DropReplica { .. }
                | NodeOutput::ReadReplicaLog { .. }
                | NodeOutput::ReadReplicaSnapshotPiece { .. }
                | NodeOutput::PersistRaft { .. }
                | NodeOutput::PersistRaftSnapshot { .. } => return,
            };
            match o {
                BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data }) => {
                    self.io.bytes_out += data.len() as u64;
                    if stream.initiator() == felix_proto::transport::Side::Broker {
                        self.io.bytes_out_events += data.len() as u64;
                    }
                    if let Some(w) = self.conns.get(&conn).and_then(|h| h.writers.get(&stream)) {
                        let _ = w.send(WriterCmd::Data(data));
                    }
                }
                BrokerOutput::Transport(TransportOutput::Finish { conn, stream }) => {
                    if let Some(w) = self.conns.get_mut(&conn).and_then(|h| h.writers.remove(&stream)) {
                        let _ = w.send(WriterCmd::Finish);
                    }
                }
                BrokerOutput::Transport(TransportOutput::StopSending { conn, stream, code }) => {
                    if let Some(g) = self.conns.get_mut(&conn).and_then(|h| h.gates.remove(&stream)) {
                        let _ = g.send(ReadGate::Stopped(code));
                    }
                }
                BrokerOutput::Transport(TransportOutput::PauseReading { conn, stream }) => {
                    if let Some(g) = self.conns.get(&conn).and_then(|h| h.gates.get(&stream)) {
                        let _ = g.send(ReadGate::Paused);
                    }
                }
                BrokerOutput::Transport(TransportOutput::ResumeReading { conn, stream }) => {
                    if let Some(g) = self.conns.get(&conn).and_then(|h| h.gates.get(&stream)) {
                        let _ = g.send(ReadGate::Open);
                    }
                }
                BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                    if let Some(h) = self.conns.get(&conn) {
                        let quic = h.quic.clone();
                        let tx = self.tx.clone();
                        tokio::spawn(async move {
                            if let Ok(send) = quic.open_uni().await {
                                let _ = tx.send(Input::Opened { conn, token, send });
                            }
                        });
                    }
                }
                BrokerOutput::Storage(StorageOutput::Persist(w)) => self.pending_writes.push(w),
                // What a read asks for was written before it was asked (it is below what the
                // log holds in memory): no flush of pending writes needed.
                BrokerOutput::Storage(StorageOutput::Read(r)) => {
                    let _ = self.history.send(r);
                }
                BrokerOutput::Storage(StorageOutput::Truncate {
                    tenant_id,
                    namespace,
                    stream,
                    shard,
                    start,
                    producers_forgotten,
                    state_checkpoint,
                }) => {
                    // Writes asked for before the truncation go first.
                    self.flush_storage();
                    let _ = self.storage.send(StorageCmd::Truncate {
                        tenant: tenant_id,
                        namespace,
                        stream,
                        shard,
                        start,
                        forgotten: producers_forgotten,
                        state: state_checkpoint,
                    });
                }
                BrokerOutput::Storage(StorageOutput::DeleteStream { tenant_id, namespace, stream }) => {
                    // Writes asked for before the deletion go first.
                    self.flush_storage();
                    let _ = self.storage.send(StorageCmd::DeleteStream { tenant: tenant_id, namespace, stream });
                }
                BrokerOutput::Storage(StorageOutput::CreateStream { token, tenant_id, namespace, stream, shards }) => {
                    let _ = self.storage.send(StorageCmd::CreateStream {
                        token,
                        tenant: tenant_id,
                        namespace,
                        stream,
                        shards,
                    });
                }
                BrokerOutput::Storage(StorageOutput::ResetShard { tenant_id, namespace, stream, shard }) => {
                    self.flush_storage();
                    let _ = self.storage.send(StorageCmd::ResetShard { tenant: tenant_id, namespace, stream, shard });
                }
                // Only a broker of a cluster emits these, and its ClusterNode takes them before
                // they reach here: a single broker answers any it gets as the cluster would.
                BrokerOutput::Cluster(c) => {
                    if let Node::Single(b) = &mut self.node {
                        b.handle_cluster_output_alone(c, now());
                    }
                }
                BrokerOutput::Transport(TransportOutput::CloseConnection { conn, code, reason }) => {
                    if let Some(h) = self.conns.remove(&conn) {
                        h.quic.close(VarInt::from_u64(code).unwrap_or(VarInt::from_u32(0)), reason.as_bytes());
                    }
                }
            }
        }
    }
}
