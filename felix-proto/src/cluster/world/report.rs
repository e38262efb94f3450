//! What a world simulation run counts ([`WorldReport`]), summed over seeds.

/// What a run did.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct WorldReport {
    /// Brokers.
    pub nodes: usize,
    /// Requests sent.
    pub requests: u64,
    /// Publishes acknowledged `ok`.
    pub acked: u64,
    /// ... of them through a broker that forwarded them (the ack named the owner).
    pub forwarded: u64,
    /// Subscribes answered `subscribed`.
    pub subscribed: u64,
    /// Cache requests answered by the cache's owner (directly or forwarded).
    pub cache_answers: u64,
    /// Answered `not_leader` (message or error code).
    pub redirected: u64,
    /// Answered `shard_unavailable` or `unacknowledged`.
    pub unavailable: u64,
    /// Lost with a crashed broker's connection.
    pub lost_with_broker: u64,
    /// Broker crashes.
    pub crashes: u64,
    /// Peer messages lost or cut.
    pub lost: u64,
    /// Records persisted (all brokers, all lives).
    pub persisted: u64,
    /// Publishes to the replicated stream acknowledged (a majority held each).
    pub quorum_acked: u64,
    /// ... answered outcome unknown (`leadership_lost`, `quorum_timeout`).
    pub quorum_unknown: u64,
    /// Committed records of the replicated stream checked against every replica's history.
    pub quorum_checked: u64,
    /// Replica logs compacted into a snapshot, or restored from one (sent by the leader to
    /// a replica behind its compaction, or read back at a restart).
    pub snapshots: u64,
    /// ... of which persisted with a host's part beside them, unencoded until written (a
    /// stream's commit state, a cache's values kept aside).
    pub snapshots_with_rest: u64,
    /// Puts to the replicated cache acknowledged (a majority held each).
    pub qcache_acked: u64,
    /// Adds to the replicated cache's counters acknowledged (with the sum they made).
    pub counter_adds_acked: u64,
    /// Records the replicated stream's consumer group handed out, and its acks answered `ok`.
    pub group_records: u64,
    /// See `group_records`.
    pub group_acks_acked: u64,
    /// Operator moves (and cancels, rebalances) proposed.
    pub moves_asked: u64,
    /// Moves of the durable stream's shards completed (its owner changed with a copy).
    pub moves_done: u64,
    /// Replica moves of the replicated stream finished (a broker took another's place in a
    /// shard's Raft group).
    pub replica_moves: u64,
    /// Operator moves of one broker's replica of the replicated stream (`MoveReplica`, a
    /// follower's or the leader's) proposed.
    pub follower_moves_asked: u64,
    /// Records given to the subscribers that follow the durable stream's shards (each checked
    /// once, in order, against what was committed there).
    pub followed: u64,
    /// ... times such a subscriber was told its shard moved (`shard_moved`) and followed it.
    pub follows: u64,
    /// Committed entries a restart left on disk and its replicas replayed in reads (the
    /// seeds that restart as the driver does with a long log: see `World::start`).
    pub replayed: u64,
    /// Metadata snapshots taken (the metadata log compacted: every 40 entries here), and
    /// restored from one the metadata leader sent (a broker behind its compacted log) (D62).
    pub meta_snapshots: u64,
    /// ... of them sent by the leader and restored from.
    pub meta_snapshots_received: u64,
    /// Snapshot chunks sent (kind 14: in odd seeds a snapshot over 24 bytes of data goes in
    /// chunks of 24, except to and from a broker playing an older version).
    pub snapshot_chunks: u64,
    /// Reads of a replica's last snapshot, kept on disk only, asked of the driver (a follower
    /// behind its leader's compaction waited for one).
    pub snapshot_reads: u64,
    /// Snapshots whose host state a replica read back from disk a piece at a time, whole:
    /// installed ones, and ones kept across a restart (in a quarter of the seeds every one
    /// is: see `World::start`).
    pub restores_from_disk: u64,
    /// Restores from disk started at a restart (its fold left the kept snapshot's host state
    /// on disk, as `serve`'s does with a large one).
    pub restores_at_restart: u64,
    /// Commits (an event and a state change, D63) to the replicated stream acknowledged: every
    /// third publish to it is one; its state is checked once healed.
    pub commits_acked: u64,
    /// A digest of the run: equal for equal seeds.
    pub digest: u64,
}

impl WorldReport {
    /// Adds another run's counts (for totals over seeds; `nodes` and `digest` are per run).
    pub fn absorb(&mut self, r: &WorldReport) {
        self.requests += r.requests;
        self.acked += r.acked;
        self.forwarded += r.forwarded;
        self.subscribed += r.subscribed;
        self.cache_answers += r.cache_answers;
        self.redirected += r.redirected;
        self.unavailable += r.unavailable;
        self.lost_with_broker += r.lost_with_broker;
        self.crashes += r.crashes;
        self.lost += r.lost;
        self.persisted += r.persisted;
        self.quorum_acked += r.quorum_acked;
        self.quorum_unknown += r.quorum_unknown;
        self.quorum_checked += r.quorum_checked;
        self.snapshots += r.snapshots;
        self.snapshots_with_rest += r.snapshots_with_rest;
        self.qcache_acked += r.qcache_acked;
        self.counter_adds_acked += r.counter_adds_acked;
        self.group_records += r.group_records;
        self.group_acks_acked += r.group_acks_acked;
        self.moves_asked += r.moves_asked;
        self.moves_done += r.moves_done;
        self.followed += r.followed;
        self.replica_moves += r.replica_moves;
        self.follower_moves_asked += r.follower_moves_asked;
        self.follows += r.follows;
        self.replayed += r.replayed;
        self.snapshot_chunks += r.snapshot_chunks;
        self.snapshot_reads += r.snapshot_reads;
        self.restores_from_disk += r.restores_from_disk;
        self.restores_at_restart += r.restores_at_restart;
        self.commits_acked += r.commits_acked;
        self.meta_snapshots += r.meta_snapshots;
        self.meta_snapshots_received += r.meta_snapshots_received;
    }
}
