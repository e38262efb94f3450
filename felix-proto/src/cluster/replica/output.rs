//! What a replica asks its driver to do ([`ReplicaOutput`]).

use super::*;

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
    /// Make this snapshot durable before carrying out anything after it (as
    /// [`MetaOutput::PersistSnapshot`]): the log up to its index is replaced by it.
    PersistSnapshot {
        /// The snapshot.
        snapshot: Snapshot,
        /// The end of its data, when it is still unencoded (by reference only: see
        /// [`SnapshotRest`]); the data is `snapshot`'s followed by it.
        rest: Option<SnapshotRest>,
    },
    /// The replica's state was restored from a snapshot (at a restart from a compacted log,
    /// or sent by the leader because this replica fell behind its compaction): the shard's
    /// records before `next_offset` are gone (retention dropped them everywhere); drop what
    /// is held and go on from `next_offset`.
    Restored {
        /// The next offset the group gives.
        next_offset: u64,
        /// The host's state in the snapshot ([`Replica::complete_checkpoint`]; empty for a
        /// stream, whose records are not part of its snapshots).
        state: Bytes,
        /// The snapshot's index.
        index: u64,
        /// Where the host's state starts in the snapshot's data (it runs to the end): where a
        /// host that reads it back from the snapshot kept on disk finds it.
        at: u64,
        /// The host's state's length in the snapshot's data: `state`'s, unless its end was
        /// sent to disk beside the data without being gathered ([`Replica::step_with_rest`]),
        /// or left there by a restart ([`RaftLog::snapshot_rest_on_disk`]): then only the
        /// snapshot on disk holds it whole.
        ///
        /// [`RaftLog::snapshot_rest_on_disk`]: crate::cluster::meta::RaftLog::snapshot_rest_on_disk
        len: u64,
        /// The leader sent the snapshot (else it is this replica's own, kept across a
        /// restart).
        received: bool,
    },
    /// A checkpoint is due right after entry `index` (everything up to it was delivered):
    /// for a replica whose host keeps state of its own ([`Replica::set_host_state`]), hand
    /// that state to [`Replica::complete_checkpoint`].
    CheckpointDue {
        /// The last entry the checkpoint covers.
        index: u64,
    },
    /// Records became readable (committed), in offset order: deliver them.
    Delivered {
        /// Offset of the first.
        offset: u64,
        /// The entry's index in the group's log (where to read it back once it left memory).
        index: u64,
        /// The batch.
        batch: ReplicatedBatch,
    },
    /// A side entry committed (in log order with the deliveries): apply its operations to the
    /// host's state of the shard. It took no offset.
    Side {
        /// The entry.
        batch: ReplicatedBatch,
    },
    /// A new leader's generation starts at `offset` (an offset never delivered; readers skip
    /// it, `skipped_before` for clients that offered 0x0800).
    GenerationStart {
        /// Its offset.
        offset: u64,
        /// The entry's index in the group's log.
        index: u64,
        /// The leader's term.
        term: u64,
    },
    /// Read entries of the kept log back (as [`MetaOutput::ReadEntries`]) and hand them to
    /// [`Replica::handle_entries_read`].
    ReadEntries {
        /// First index wanted.
        low: u64,
        /// Stop before this index.
        high: u64,
        /// About how many bytes of entries at most.
        max_bytes: u64,
    },
    /// Read the snapshot at `index` back from the kept log (as [`MetaOutput::ReadSnapshot`])
    /// and hand it to [`Replica::handle_snapshot_read`].
    ReadSnapshot {
        /// The snapshot's index.
        index: u64,
    },
}
