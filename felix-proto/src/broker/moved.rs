//! Where a shard this broker does not serve is, and why it is unavailable when it is: the mark
//! a shard carries while another broker owns it, it moves, or its group has no leader here.

use super::*;

#[derive(Debug)]
pub(super) struct Moved {
    pub(super) node_id: String,
    pub(super) addr: Option<String>,
    pub(super) generation: u64,
    /// The owner is down with records only it holds: requests are `shard_unavailable` (retry)
    /// until it comes back, not redirected or forwarded to it.
    pub(super) down: bool,
    /// Why it is unavailable when `down`.
    pub(super) reason: Unavailable,
}

/// Why a shard is unavailable here (a [`Moved`] mark that is `down`): the `reason` word of
/// the `shard_unavailable` answer, what it says and how soon to retry. One type, matched by
/// the compiler, where the words were once compared as strings in several files.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unavailable {
    /// The owner is down, and holds the shard's records (`owner_down`).
    OwnerDown,
    /// A replicated shard's new leader is settling its readable bound (`not_ready`).
    NotReady,
    /// A replicated shard's replicas are electing a leader (`no_leader`).
    NoLeader,
    /// The leader is confirming it still leads before it answers a read (`confirming_leader`).
    ConfirmingLeader,
    /// The shard is cutting over to another broker (`moving`).
    Moving,
    /// This broker lost contact with the metadata leader (`fenced`).
    Fenced,
}

impl Unavailable {
    /// The word on the wire (`ErrorDetail::reason`).
    pub(super) fn wire(self) -> &'static str {
        match self {
            Unavailable::OwnerDown => "owner_down",
            Unavailable::NotReady => "not_ready",
            Unavailable::NoLeader => "no_leader",
            Unavailable::ConfirmingLeader => "confirming_leader",
            Unavailable::Moving => "moving",
            Unavailable::Fenced => "fenced",
        }
    }
}

impl Moved {
    /// The answer for a shard whose owner is down.
    pub(super) fn unavailable(&self, shard: u32) -> Refusal {
        let (message, retry_ms) = match self.reason {
            Unavailable::NotReady => (format!("shard {shard}'s new leader is settling its readable bound; retry"), 50),
            Unavailable::NoLeader => (format!("shard {shard}'s replicas are electing a leader; retry"), 200),
            Unavailable::ConfirmingLeader => {
                (format!("shard {shard}'s leader is confirming with its replicas that it still leads; retry"), 50)
            }
            Unavailable::Moving => (format!("shard {shard} is moving to {}: retry (then ask it)", self.node_id), 50),
            Unavailable::Fenced => (
                format!(
                    "this broker lost contact with the cluster's metadata leader: it serves shard {shard} again once back in contact; retry (another broker may own it by then)"
                ),
                500,
            ),
            Unavailable::OwnerDown => (
                format!("shard {shard} is owned by {}, which is down; it holds the shard's records", self.node_id),
                1000,
            ),
        };
        let mut r = Refusal::new(ErrorCode::ShardUnavailable, message);
        let reason = self.reason.wire();
        r.detail = Some(crate::binary::ErrorDetail { reason: Some(reason.into()), retry_after_ms: Some(retry_ms) });
        r.retry = RetryClass::Retry;
        r
    }
}
