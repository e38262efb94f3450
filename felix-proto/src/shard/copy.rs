//! A shard's copy from its old owner to its new one while it moves (a durable stream shard's
//! records, a cache's values): what the new owner asks and the old one answers. The broker
//! serves and writes copies; the cluster carries them between brokers (peer kinds 10 and 11,
//! encoded in [`crate::cluster::peer`]).

use super::ShardId;
use bytes::Bytes;

/// A moving shard's new owner asks the old one for its records (kind 10).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyRequest {
    /// The stream shard.
    pub shard: ShardId,
    /// The first offset wanted; `None` for a first request (from the shard's start).
    pub from: Option<u64>,
    /// About how many payload bytes to send at most.
    pub max_bytes: u32,
}

/// The old owner's answer to a [`CopyRequest`] (kind 11).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CopyAnswer {
    /// The stream shard.
    pub shard: ShardId,
    /// What it sends, or why not.
    pub body: CopyBody,
}

/// A shard copy's message, as a broker hands it to its cluster node to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyMessage {
    /// To the old owner.
    Request(CopyRequest),
    /// To the new owner.
    Answer(CopyAnswer),
}

/// What a [`CopyAnswer`] carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CopyBody {
    /// Records in offset order from the one asked for (fewer than asked near the tail).
    Batches {
        /// The old owner's oldest retained offset.
        start: u64,
        /// Its committed tail: the first offset it has not written (yet).
        tail: u64,
        /// It stopped taking writes for the cut-over: `tail` is final.
        cutting: bool,
        /// The batches.
        batches: Vec<crate::storage::StoredBatch>,
        /// The shard's commit state, whole ([`crate::storage::encode_state_checkpoint`]), in
        /// the answer to a first request of a shard whose retention may have deleted commits
        /// that wrote it (it holds state and its log no longer starts at 0). The new owner
        /// takes it as its state and keeps it on disk before the batches; commits among the
        /// batches at or below its `as_of` are already in it. Sent only to a peer that offered
        /// [`crate::cluster::peer::FEATURE_COMMIT_STATE`].
        state: Option<bytes::Bytes>,
        /// The shard's consumer groups' durable state (what they acked and dead-lettered),
        /// whole, in an answer that says `cutting` (group requests are refused from then on,
        /// and none is still being written): the records of a `$groups` checkpoint (a reset,
        /// then each group's state), which the new owner writes to its own `$groups` log before
        /// it finishes the move. Only when the shard has groups, and only to a peer that
        /// offered [`crate::cluster::peer::FEATURE_GROUP_COPY`].
        groups: Option<Vec<bytes::Bytes>>,
    },
    /// A cache's values (and counters), whole or what changed since the offset asked for.
    Cache {
        /// The offset the cache's next change takes there.
        tail: u64,
        /// It stopped taking writes for the cut-over: `tail` is final.
        cutting: bool,
        /// `records` are the whole cache (a reset first), not changes.
        full: bool,
        /// Cache records (the system log's encoding), in offset order.
        records: Vec<Bytes>,
        /// The counters, whole (a reset, then every value).
        counters: Vec<Bytes>,
    },
    /// It cannot serve the copy (not the shard's owner, no such move, a read that failed):
    /// ask again later.
    Refused(String),
}
