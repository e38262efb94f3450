//! Operators' requests to a cluster node (`felix-node cluster add/remove/move/drain/rebalance/revoke`,
//! from the metrics listener or the client protocol): each checked against the metadata as
//! applied here, then proposed to the metadata group. A child of [`super`] in a file of its
//! own, as [`hibernation`](super::hibernation) is: it keeps the node's fields private.

use super::*;

/// Why an operator's change of members was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminError {
    /// Already a voter.
    #[error("{0} is already a member of the cluster")]
    AlreadyMember(String),
    /// Not a voter.
    #[error("{0} is not a member of the cluster")]
    NotMember(String),
    /// The last voter cannot leave.
    #[error("{0} is the cluster's last member")]
    LastMember(String),
    /// Its durable shards would lose the records only it holds.
    #[error(
        "{id} owns {count} durable shard(s) whose records only it holds: drain it first (`cluster drain {id}` \
         copies them to the others), or pass force to remove it and lose them"
    )]
    OwnsDurableShards {
        /// Node id.
        id: String,
        /// How many.
        count: usize,
    },
    /// A move, drain or cancel the metadata refuses (why, as it says).
    #[error("{0}")]
    Refused(String),
    /// A node id must be 1 to 64 of `[A-Za-z0-9._-]`; an address must be HOST:PORT.
    #[error("bad {what}: {value:?}")]
    Bad {
        /// Which argument.
        what: &'static str,
        /// What was given.
        value: String,
    },
}

impl ClusterNode {
    /// The voters of the metadata group, by node id.
    pub fn voters(&self) -> Vec<String> {
        let mut v: Vec<String> = self.meta.voters().iter().filter_map(|id| self.names.get(id).cloned()).collect();
        v.sort();
        v
    }

    /// An operator adds broker `name`, reachable by its peers at `cluster_addr`, as a voter
    /// (`felix-node cluster add`). It is proposed through the leader; once committed every
    /// broker dials it and the leader replicates the log to it.
    ///
    /// # Errors
    /// [`AdminError`] for a bad name or address or a broker already a member.
    pub fn request_add(&mut self, name: &str, cluster_addr: &str, now: Instant) -> Result<(), AdminError> {
        if !valid_node_id(name) {
            return Err(AdminError::Bad { what: "node id", value: name.into() });
        }
        if cluster_addr.rsplit_once(':').is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err()) {
            return Err(AdminError::Bad { what: "cluster address", value: cluster_addr.into() });
        }
        if self.voters().iter().any(|v| v == name) {
            return Err(AdminError::AlreadyMember(name.into()));
        }
        self.propose(&Command::AddVoter { id: name.into(), cluster_addr: cluster_addr.into() }, now);
        Ok(())
    }

    /// An operator removes broker `name` (`felix-node cluster remove`): it stops being a voter
    /// and its shards go to the others. A broker owning durable shards holds records nobody
    /// else has: refused unless `force` (they are lost; moving them is a shard move).
    ///
    /// # Errors
    /// [`AdminError`] for a non-member, the last member, or durable shards without `force`.
    pub fn request_remove(&mut self, name: &str, force: bool, now: Instant) -> Result<(), AdminError> {
        let voters = self.voters();
        if !voters.iter().any(|v| v == name) {
            return Err(AdminError::NotMember(name.into()));
        }
        if voters.len() == 1 {
            return Err(AdminError::LastMember(name.into()));
        }
        let count = self.metadata.durable_shards_of(name);
        if count > 0 && !force {
            return Err(AdminError::OwnsDurableShards { id: name.into(), count });
        }
        self.propose(&Command::RemoveVoter { id: name.into(), force }, now);
        Ok(())
    }

    /// Checks a command against the metadata as applied here (every broker applies it the same
    /// way, so a refusal here is a refusal there), then proposes it.
    pub(super) fn request_checked(&mut self, c: Command, now: Instant) -> Result<(), AdminError> {
        self.metadata.clone().apply(&c).map_err(|e| AdminError::Refused(e.to_string()))?;
        self.propose(&c, now);
        Ok(())
    }

    /// An operator moves a stream shard to broker `to` (`felix-node cluster move`): an
    /// in-memory one changes owner at once; a durable one is copied to `to`, then handed over
    /// (its readers follow, nothing is lost). It stays on `to` until moved again.
    ///
    /// # Errors
    /// [`AdminError::Refused`] for an unknown shard, a target that is not an active member, a
    /// shard already there or already moving, a replicated shard.
    pub fn request_move(&mut self, shard: ShardId, to: &str, now: Instant) -> Result<(), AdminError> {
        self.request_checked(Command::MoveShard { shard, to: to.to_owned() }, now)
    }

    /// An operator gives a move up (`cluster move --cancel`): the shard stays with its old
    /// owner, which serves it on.
    ///
    /// # Errors
    /// [`AdminError::Refused`] when the shard is not moving.
    pub fn request_cancel_move(&mut self, shard: ShardId, now: Instant) -> Result<(), AdminError> {
        self.request_checked(Command::CancelMove { shard }, now)
    }

    /// An operator drains broker `name` (`felix-node cluster drain`): it takes no more shards,
    /// leaves the topology view, and its shards move to the others (durable ones copied, a few
    /// at a time); it answers `not_leader` with their new owners meanwhile.
    ///
    /// # Errors
    /// [`AdminError::NotMember`] for a broker that is not a member.
    pub fn request_drain(&mut self, name: &str, now: Instant) -> Result<(), AdminError> {
        if !self.metadata.members().contains_key(name) {
            return Err(AdminError::NotMember(name.into()));
        }
        self.request_checked(Command::Drain { id: name.to_owned() }, now)
    }

    /// An operator rebalances (`felix-node cluster rebalance`): placement may move every shard
    /// again, the ones operators placed and the ones cancelled moves left too.
    pub fn request_rebalance(&mut self, now: Instant) {
        self.propose(&Command::Rebalance, now);
    }

    /// An operator revokes a signed token on every broker (`felix-node cluster revoke`): by
    /// its id, its principal, or both. Proposed through the leader; once committed, every
    /// broker ends what the token opened (`revoked`) and refuses it at `auth`, whatever its
    /// own configuration files say. Revocations are kept in the metadata for good.
    ///
    /// # Errors
    /// [`AdminError::Bad`] for a revocation naming neither, or an empty or oversized name.
    pub fn request_revoke(&mut self, jti: Option<&str>, sub: Option<&str>, now: Instant) -> Result<(), AdminError> {
        for (what, v) in [("token id (jti)", jti), ("principal (sub)", sub)] {
            if let Some(v) = v
                && (v.is_empty() || v.len() > 1024)
            {
                return Err(AdminError::Bad { what, value: v.chars().take(64).collect() });
            }
        }
        if jti.is_none() && sub.is_none() {
            return Err(AdminError::Bad { what: "revocation (give jti, sub or both)", value: String::new() });
        }
        self.propose(&Command::Revoke { jti: jti.map(str::to_owned), sub: sub.map(str::to_owned) }, now);
        Ok(())
    }
}
