//! The storage and history threads the broker task hands its writes and reads to, and the
//! replica logs' sync thread with the gate that holds every output behind the sync of what it
//! depends on.

use super::*;

pub(super) enum StorageCmd {
    Write(Vec<PersistRequest>),
    Truncate {
        tenant: String,
        namespace: String,
        stream: String,
        shard: u32,
        start: u64,
        forgotten: Vec<(u64, u64)>,
        state: Option<Bytes>,
    },
    DeleteStream {
        tenant: String,
        namespace: String,
        stream: String,
    },
    CreateStream {
        token: WriteToken,
        tenant: String,
        namespace: String,
        stream: String,
        shards: u32,
    },
    ResetShard {
        tenant: String,
        namespace: String,
        stream: String,
        shard: u32,
    },
    Stop,
}

pub(super) fn storage_loop(
    mut disk: Option<DiskStorage>,
    rx: std::sync::mpsc::Receiver<StorageCmd>,
    tx: mpsc::UnboundedSender<Input>,
) {
    // Every queued write is written, even once the broker task is gone (at shutdown it sends its
    // last writes, then Stop): results that nobody receives any more are dropped, writes never.
    let mut stop = false;
    while !stop {
        let cmd = match rx.recv_timeout(std::time::Duration::from_millis(20)) {
            Ok(cmd) => cmd,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                // Idle: files under an interval policy still get synced on time.
                if let Some(d) = disk.as_mut() {
                    d.sync_due();
                }
                continue;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => break,
        };
        let mut truncations = Vec::new();
        let mut reqs = Vec::new();
        // A deletion ends the pass: the writes before it are written, then the stream removed;
        // writes after it (a stream of the same name created again) go in the next pass.
        let mut deletion = None;
        let mut reset = None;
        let mut created = Vec::new();
        let mut cut = false;
        let mut take = |cmd: StorageCmd, stop: &mut bool, cut: &mut bool| match cmd {
            StorageCmd::Write(r) => reqs.extend(r),
            StorageCmd::Truncate { tenant, namespace, stream, shard, start, forgotten, state } => {
                truncations.push((tenant, namespace, stream, shard, start, forgotten, state));
            }
            StorageCmd::DeleteStream { tenant, namespace, stream } => {
                deletion = Some((tenant, namespace, stream));
                *cut = true;
            }
            StorageCmd::ResetShard { tenant, namespace, stream, shard } => {
                reset = Some((tenant, namespace, stream, shard));
                *cut = true;
            }
            StorageCmd::CreateStream { token, tenant, namespace, stream, shards } => {
                created.push((token, tenant, namespace, stream, shards));
            }
            StorageCmd::Stop => *stop = true,
        };
        take(cmd, &mut stop, &mut cut);
        // Group commit: take everything queued since, write it, sync once.
        while !stop && !cut {
            match rx.try_recv() {
                Ok(more) => take(more, &mut stop, &mut cut),
                Err(_) => break,
            }
        }
        if let Some(d) = disk.as_mut() {
            for (t, n, s, shard, start, forgotten, state) in truncations {
                d.truncate_before((&t, &n, &s), shard, start, &forgotten, state.as_deref());
            }
        }
        if !reqs.is_empty() {
            let started = std::time::Instant::now();
            let results = match disk.as_mut() {
                Some(d) => d.write(reqs),
                None => felix_proto::storage::MemoryOnly.write(reqs),
            };
            let micros = started.elapsed().as_micros() as u64;
            let _ = tx.send(Input::Written(results, micros));
        }
        for (token, t, n, s, shards) in created {
            let r = match disk.as_mut() {
                Some(d) => d.record_stream((&t, &n, &s), shards).map_err(|e| e.to_string()),
                None => Ok(()),
            };
            let _ = tx.send(Input::StreamRecorded(token, r));
        }
        if let (Some(d), Some((t, n, s))) = (disk.as_mut(), deletion)
            && let Err(e) = d.delete_stream((&t, &n, &s))
        {
            tracing::error!("deleting stream {n}/{s}: {e}");
        }
        if let (Some(d), Some((t, n, s, shard))) = (disk.as_mut(), reset)
            && let Err(e) = d.reset_shard((&t, &n, &s), shard)
        {
            tracing::error!("emptying shard {shard} of {n}/{s} for the copy moving here: {e}");
        }
    }
    if let Some(d) = disk.as_mut() {
        d.sync_all();
    }
}

/// Answers history reads on their own thread ([`HistoryReader`]), beside the storage thread:
/// a reader that fell behind waits for its read, never for a pass of writes.
///
/// [`HistoryReader`]: felix_driver_common::storage::HistoryReader
pub(super) fn history_loop(
    mut reader: Option<felix_driver_common::storage::HistoryReader>,
    rx: std::sync::mpsc::Receiver<felix_proto::broker::ReadRequest>,
    tx: mpsc::UnboundedSender<Input>,
) {
    while let Ok(r) = rx.recv() {
        let batches = match reader.as_mut() {
            Some(h) => h.read_range((&r.tenant_id, &r.namespace, &r.stream), r.shard, r.from, r.end, r.max_bytes),
            None => felix_proto::storage::MemoryOnly.read(&r),
        };
        if tx.send(Input::ReadDone(r.token, batches)).is_err() {
            return;
        }
    }
}

/// The outputs that wait for replica log appends to reach the disk.
///
/// Each append taken from the state machine counts one write; an output polled after it is
/// held, tagged with the writes made so far, and carried out once a sync covering that many
/// writes has ended. Held outputs leave in the order they came (a client stream's frames, a
/// peer's messages), so one held output holds every later one: it is a queue, not a filter.
/// While a sync runs, appends go on and the next sync covers all of them: one `fdatasync` per
/// written file for every append since the last, so the disk's latency is paid once per batch
/// of work, not once per shard or per record.
#[derive(Default)]
pub(super) struct ReplicaSyncGate {
    /// Appends made that must be synced before what follows them.
    pub(super) writes: u64,
    /// Appends the last finished sync covered.
    pub(super) synced: u64,
    /// A sync is running.
    pub(super) syncing: bool,
    /// Outputs waiting, each with the writes that must be synced first.
    pub(super) held: std::collections::VecDeque<(u64, felix_proto::cluster::node::NodeOutput)>,
}

impl ReplicaSyncGate {
    /// An append was made; `must_sync`: under the default policy (a lazy one holds nothing).
    pub(super) fn wrote(&mut self, must_sync: bool) {
        if must_sync {
            self.writes += 1;
        }
    }

    /// `o` if it may be carried out now, else `None` (held).
    pub(super) fn hold(
        &mut self,
        o: felix_proto::cluster::node::NodeOutput,
    ) -> Option<felix_proto::cluster::node::NodeOutput> {
        if self.held.is_empty() && self.writes == self.synced {
            return Some(o);
        }
        self.held.push_back((self.writes, o));
        None
    }

    /// The writes a sync started now covers, when one should start.
    pub(super) fn sync_to_start(&mut self) -> Option<u64> {
        if self.syncing || self.writes == self.synced {
            return None;
        }
        self.syncing = true;
        Some(self.writes)
    }

    /// A sync covering `covers` writes ended: the outputs it released, in order.
    pub(super) fn synced(&mut self, covers: u64) -> Vec<felix_proto::cluster::node::NodeOutput> {
        self.syncing = false;
        self.synced = self.synced.max(covers);
        let mut out = Vec::new();
        while self.held.front().is_some_and(|(needs, _)| *needs <= self.synced) {
            if let Some((_, o)) = self.held.pop_front() {
                out.push(o);
            }
        }
        out
    }
}

/// The thread that syncs replica log files off the broker task: each job is the files written
/// since the last one and the writes it covers; its end is sent back as an input.
pub(super) fn replica_sync_thread(
    tx: mpsc::UnboundedSender<Input>,
) -> std::io::Result<std::sync::mpsc::Sender<(u64, Vec<crate::cluster::UnsyncedFile>)>> {
    let (jobs, rx) = std::sync::mpsc::channel::<(u64, Vec<crate::cluster::UnsyncedFile>)>();
    std::thread::Builder::new().name("felix-replica-sync".into()).spawn(move || {
        for (covers, files) in rx {
            let result = crate::cluster::sync_many(&files);
            if tx.send(Input::ReplicaSynced { covers, result }).is_err() {
                return;
            }
        }
    })?;
    Ok(jobs)
}

#[cfg(test)]
mod replica_sync_gate_tests {
    use super::ReplicaSyncGate;
    use felix_proto::cluster::node::NodeOutput;

    pub(super) fn out(n: u8) -> NodeOutput {
        NodeOutput::PeerRemoved { name: n.to_string() }
    }

    pub(super) fn names(v: Vec<NodeOutput>) -> Vec<String> {
        v.into_iter()
            .map(|o| match o {
                NodeOutput::PeerRemoved { name } => name,
                _ => String::from("?"),
            })
            .collect()
    }

    #[test]
    pub(super) fn outputs_after_an_append_wait_for_its_sync_and_leave_in_order() {
        let mut g = ReplicaSyncGate::default();
        // Nothing written: carried out at once.
        assert!(g.hold(out(1)).is_some());
        assert_eq!(g.sync_to_start(), None);
        g.wrote(true);
        assert!(g.hold(out(2)).is_none(), "after an unsynced append: held");
        assert_eq!(g.sync_to_start(), Some(1));
        // While that sync runs, more appends: the next sync covers them, not this one.
        g.wrote(true);
        assert!(g.hold(out(3)).is_none());
        assert_eq!(g.sync_to_start(), None, "one sync at a time");
        assert_eq!(names(g.synced(1)), ["2"], "only what the first append held");
        assert!(g.hold(out(4)).is_none(), "behind a held output: held, whatever it needs");
        assert_eq!(g.sync_to_start(), Some(2));
        assert_eq!(names(g.synced(2)), ["3", "4"]);
        assert!(g.hold(out(5)).is_some(), "all synced, nothing held: at once again");
    }

    #[test]
    pub(super) fn a_lazy_policy_holds_nothing() {
        let mut g = ReplicaSyncGate::default();
        g.wrote(false);
        assert!(g.hold(out(1)).is_some());
        assert_eq!(g.sync_to_start(), None);
    }
}
