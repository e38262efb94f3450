//! What an operator wants in the log. The state machines log nothing themselves (no IO); they
//! queue a [`Notice`] and the driver writes it, at info level: failed logins, elections and
//! leadership changes, peers connecting and going away, replicas falling behind and catching up.

use crate::transport::ConnId;
use std::collections::VecDeque;

/// The most notices kept for a driver that does not take them: a flood of bad logins must not
/// grow memory (about 100 bytes each: under 2 MB). Past it new ones are counted and dropped.
/// Room for every leadership notice of a mass election (a broker of three dying with 10,000
/// shards moves about 3,300 leaderships, said on each survivor between two turns of its driver).
pub const MAX_NOTICES: usize = 16_384;

/// One thing worth a line in the operator's log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice {
    /// An `auth` was refused: a wrong, expired or revoked token, or an unknown certificate.
    LoginRefused {
        /// The connection (the driver knows its address).
        conn: ConnId,
        /// The tenant it asked for.
        tenant: String,
        /// Why, as the client was told.
        reason: String,
    },
    /// Who leads the cluster's metadata group changed; `None` while an election is on.
    MetadataLeader {
        /// The leader's node id.
        leader: Option<String>,
        /// The Raft term.
        term: u64,
    },
    /// This broker's part in a replicated shard's group changed.
    ShardLeader {
        /// The shard, as `tenant/namespace/stream#shard`.
        shard: String,
        /// Who leads it now (this broker's own id when it does), `None` while none does.
        leader: Option<String>,
        /// The Raft term.
        term: u64,
    },
    /// A peer broker opened a connection to this one (its hello).
    PeerConnected {
        /// Its node id.
        peer: String,
    },
    /// The connection to a peer broker closed.
    PeerLost {
        /// Its node id.
        peer: String,
    },
    /// On a shard's leader: one of its replicas lacks more than
    /// [`REPLICA_BEHIND_ENTRIES`](crate::cluster::node::REPLICA_BEHIND_ENTRIES) entries (down,
    /// cut off, slow, or restarted and catching up).
    ReplicaBehind {
        /// The shard, as `tenant/namespace/stream#shard`.
        shard: String,
        /// The replica's node id.
        replica: String,
        /// Entries (batches) it lacks.
        entries: u64,
    },
    /// On a shard's leader: a replica said to be behind holds the log again.
    ReplicaCaughtUp {
        /// The shard.
        shard: String,
        /// The replica's node id.
        replica: String,
    },
    /// A metadata snapshot (D62) was not sent to a peer behind the compacted metadata log: it
    /// did not offer `FEATURE_META_SNAPSHOTS` (an older version) and would leave its metadata
    /// behind. It stays behind until it runs a version that reads one. Told once per peer.
    MetadataSnapshotWithheld {
        /// Its node id.
        peer: String,
    },
    /// On a replicated stream's leader: a replica behind the compacted log was not sent the
    /// shard's snapshot, because the snapshot holds the shard's commit state and the replica's
    /// broker did not offer `FEATURE_COMMIT_STATE` (an older version, D63): it would take the
    /// snapshot without the state and could later serve `state_get` missing every value the
    /// compacted commits wrote. It stays behind until it runs a version that reads the state.
    /// Told once per shard and replica.
    ShardSnapshotWithheld {
        /// The shard, as `tenant/namespace/stream#shard`.
        shard: String,
        /// The replica's node id.
        replica: String,
    },
    /// On a shard's leader: the snapshot a replica behind the compacted log needs could not be
    /// read back from this broker's disk (a damaged or missing record, a read error), so the
    /// send stopped. The engine offers it again as it probes the replica; a damaged record
    /// keeps failing until the next compaction writes a new one.
    ShardSnapshotSendFailed {
        /// The shard, as `tenant/namespace/stream#shard`.
        shard: String,
        /// The replica's node id.
        replica: String,
        /// Why.
        why: String,
    },
    /// A replica could not read back the state of its snapshot (one it installed, or kept
    /// across a restart) from disk, where it restores a large one from a piece at a time: the
    /// shard stays unserved here, and the read is tried again each tick; after 30 s of
    /// failures the replica drops its log and rejoins its group afresh.
    ShardRestoreReadFailed {
        /// The shard, as `tenant/namespace/stream#shard`.
        shard: String,
        /// Why.
        why: String,
    },
    /// A metadata snapshot sent by the leader could not be read (a newer format): this
    /// broker's metadata stays as it was, and behind.
    MetadataSnapshotRefused {
        /// The log index it stood for.
        index: u64,
        /// Why.
        why: String,
    },
    /// A client asked this broker, over the client protocol, for a change to the cluster
    /// (`shard_move`), and it was proposed.
    OperatorRequest {
        /// What, as a sentence ("move t/ns/s shard 1 to n3").
        what: String,
        /// The tenant whose token asked.
        tenant: String,
    },
}

impl std::fmt::Display for Notice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Notice::LoginRefused { tenant, reason, .. } => write!(f, "login refused (tenant {tenant}): {reason}"),
            Notice::MetadataLeader { leader: Some(l), term } => {
                write!(f, "cluster: {l} leads the metadata (term {term})")
            }
            Notice::MetadataLeader { leader: None, term } => write!(f, "cluster: metadata election (term {term})"),
            Notice::ShardLeader { shard, leader: Some(l), term } => {
                write!(f, "cluster: {l} leads {shard} (term {term})")
            }
            Notice::ShardLeader { shard, leader: None, term } => {
                write!(f, "cluster: {shard} has no leader (term {term})")
            }
            Notice::PeerConnected { peer } => write!(f, "cluster: peer {peer} connected"),
            Notice::PeerLost { peer } => write!(f, "cluster: lost the connection to peer {peer}"),
            Notice::ReplicaBehind { shard, replica, entries } => {
                write!(f, "cluster: replica {replica} of {shard} is {entries} entries behind this leader")
            }
            Notice::ReplicaCaughtUp { shard, replica } => write!(f, "cluster: replica {replica} of {shard} caught up"),
            Notice::MetadataSnapshotWithheld { peer } => write!(
                f,
                "cluster: peer {peer} is behind the compacted metadata log and does not read a metadata snapshot; it stays behind until it is upgraded"
            ),
            Notice::ShardSnapshotWithheld { shard, replica } => write!(
                f,
                "cluster: replica {replica} of {shard} is behind the compacted log, and the snapshot it needs holds commit state that broker (an older version) cannot read; it stays behind until it is upgraded"
            ),
            Notice::ShardSnapshotSendFailed { shard, replica, why } => {
                write!(f, "cluster: sending {shard}'s snapshot to replica {replica} stopped: {why}")
            }
            Notice::ShardRestoreReadFailed { shard, why } => {
                write!(
                    f,
                    "cluster: reading back {shard}'s snapshot state failed, retrying each tick (for 30 s, then the \
                     replica rejoins its group afresh): {why}"
                )
            }
            Notice::MetadataSnapshotRefused { index, why } => {
                write!(f, "cluster: the metadata snapshot at index {index} was refused, metadata stays behind: {why}")
            }
            Notice::OperatorRequest { what, tenant } => {
                write!(f, "cluster: a client of tenant {tenant} asked to {what}")
            }
        }
    }
}

/// The queue of notices, bounded.
#[derive(Debug, Default)]
pub(crate) struct Notices {
    queue: VecDeque<Notice>,
    /// Dropped because the queue was full.
    pub(crate) dropped: u64,
}

impl Notices {
    pub(crate) fn push(&mut self, n: Notice) {
        if self.queue.len() >= MAX_NOTICES {
            self.dropped += 1;
        } else {
            self.queue.push_back(n);
        }
    }

    pub(crate) fn pop(&mut self) -> Option<Notice> {
        self.queue.pop_front()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_is_bounded_and_counts_what_it_drops() {
        let mut q = Notices::default();
        for i in 0..MAX_NOTICES + 5 {
            q.push(Notice::PeerLost { peer: i.to_string() });
        }
        assert_eq!(q.dropped, 5);
        assert_eq!(q.pop(), Some(Notice::PeerLost { peer: "0".into() }), "oldest first");
    }

    #[test]
    fn notices_read_as_log_lines() {
        let n = Notice::ShardLeader { shard: "t/ns/s#2".into(), leader: Some("n2".into()), term: 7 };
        assert_eq!(n.to_string(), "cluster: n2 leads t/ns/s#2 (term 7)");
    }
}
