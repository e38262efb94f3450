//! A stream shard's place in the cluster as this broker sees it: who serves it, and why not
//! this broker when it does not. One enum, [`Serving`], changed only by [`Serving::on`] (the
//! shape of [`Sub::on`](super::Sub::on)); every request, subscription and forward reads it
//! through [`Serving::away`].
//!
//! ```text
//!   here ──fence──► fenced ──unfence──► here, or cutting over (a move out still cutting over)
//!   here ──cut over (a move out reached the tail)──► cutting over
//!   any ──owned elsewhere──► elsewhere(owner, down or up)
//!   any ──owned here──► here, fenced or cutting over (as this broker is)
//!   any ──owned here, replicated, no replica here──► orphaned (`no_leader`)
//!   not a replica ──joined group──► replica(following, no leader)
//!   any ──role──► replica(settling | leading | following a leader)
//! ```
//!
//! Leaving *here* (or a leading replica) ends the shard's subscriptions as a move does
//! (`shard_moved`, after what committed was delivered) and answers the polls waiting on it:
//! [`Serving::on`] says so by returning the owner to name. Backpressure on a served shard
//! (`Shard::hold`, `Shard::full`) is not part of this lifecycle: it only exists while the
//! shard is served here. The full table is in docs/architecture.md ("A shard's lifecycle").

use super::*;
use crate::binary::OwnerHint;

/// Who serves a stream shard, as this broker sees it. Outside a cluster always [`Here`].
///
/// [`Here`]: Serving::Here
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub(super) enum Serving {
    /// Served here: a single broker's shard, or the one the cluster names this broker the
    /// owner of (a shard with one replica).
    #[default]
    Here,
    /// Another broker owns it: requests are redirected or forwarded there; while it is
    /// `down` (it holds records only it has) they are `shard_unavailable` (`owner_down`).
    Elsewhere {
        /// The owner.
        owner: OwnerHint,
        /// The owner is down.
        down: bool,
    },
    /// Owned here, and this broker lost contact with the metadata leader: it takes nothing
    /// until back in contact (`fenced`).
    Fenced,
    /// Owned here and cutting over a move to `to`: new writes and readers wait (`moving`).
    CuttingOver {
        /// The move's target.
        to: String,
    },
    /// Named the owner of a replicated shard this broker holds no replica of (a replica move
    /// given up after its target led): only a replica serves it (`no_leader`).
    Orphaned,
    /// A replica of the shard's Raft group: its role there decides.
    Replica(ReplicaRole),
}

/// What moves a shard along its lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum ServingEvent {
    /// The metadata names another broker the owner.
    OwnedElsewhere {
        /// The owner.
        owner: OwnerHint,
        /// It is down and holds records only it has.
        down: bool,
    },
    /// The metadata names this broker the owner of a shard with one replica.
    OwnedHere {
        /// This broker is out of contact with the metadata leader.
        fenced: bool,
        /// The move out this broker is cutting over, if any (its target).
        cutting: Option<String>,
    },
    /// The metadata names this broker the owner of a replicated shard it holds no replica of.
    OwnedWithoutReplica,
    /// This broker holds (or is joining as) a replica of the shard's group.
    JoinedGroup,
    /// The replica's role in its group changed.
    Role(ReplicaRole),
    /// This broker lost contact with the metadata leader.
    Fence,
    /// Back in contact with the metadata leader; `cutting`: a move out still cutting over.
    Unfence {
        /// The move's target.
        cutting: Option<String>,
    },
    /// A move out of this broker reached the tail: cut over to `to`.
    CutOver {
        /// The move's target.
        to: String,
    },
    /// Moved to `owner` by hand ([`Broker::move_shard`]).
    MovedTo(OwnerHint),
}

/// Why a shard is unavailable here: the `reason` word of the `shard_unavailable` answer,
/// what it says and how soon to retry. One type, matched by the compiler, where the words
/// were once compared as strings in several files.
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

/// Where a request for a shard not served here goes, borrowed from its [`Serving`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Away<'a> {
    /// To its owner (or its group's leader): a redirect, or a forward.
    Owner(&'a OwnerHint),
    /// Nowhere for now: `shard_unavailable`, retry. `node` is the broker the answer names
    /// (the owner that is down, the move's target), empty when it names none.
    Unavailable {
        /// Why.
        reason: Unavailable,
        /// The broker named.
        node: &'a str,
    },
}

impl Serving {
    /// Where a request for this shard goes instead of being served here; `None` when it is
    /// served here.
    pub(super) fn away(&self) -> Option<Away<'_>> {
        let unavailable = |reason, node| Some(Away::Unavailable { reason, node });
        match self {
            Serving::Here | Serving::Replica(ReplicaRole::Leading) => None,
            Serving::Elsewhere { owner, down: false }
            | Serving::Replica(ReplicaRole::Following { leader: Some(owner) }) => Some(Away::Owner(owner)),
            Serving::Elsewhere { owner, down: true } => unavailable(Unavailable::OwnerDown, &owner.node_id),
            Serving::Fenced => unavailable(Unavailable::Fenced, ""),
            Serving::CuttingOver { to } => unavailable(Unavailable::Moving, to),
            Serving::Orphaned | Serving::Replica(ReplicaRole::Following { leader: None }) => {
                unavailable(Unavailable::NoLeader, "")
            }
            Serving::Replica(ReplicaRole::Settling) => unavailable(Unavailable::NotReady, ""),
        }
    }

    /// Served here.
    pub(super) fn here(&self) -> bool {
        self.away().is_none()
    }

    /// This broker's role in the shard's Raft group, when it holds a replica of it.
    pub(super) fn replica(&self) -> Option<&ReplicaRole> {
        match self {
            Serving::Replica(role) => Some(role),
            _ => None,
        }
    }

    /// This broker holds a replica of the shard (its writes go through the group).
    pub(super) fn is_replica(&self) -> bool {
        matches!(self, Serving::Replica(_))
    }

    /// The one place a shard's serving state changes. Returns the owner to name when the
    /// change ends the shard's readers here (its subscriptions end with `shard_moved`, after
    /// what committed was delivered; its waiting polls answer): an empty node id when there
    /// is no owner to name yet.
    pub(super) fn on(&mut self, ev: ServingEvent) -> Option<OwnerHint> {
        let nobody = || OwnerHint { node_id: String::new(), addr: None, generation: 0 };
        let (next, end) = match ev {
            ServingEvent::OwnedElsewhere { owner, down } => {
                // The same owner at the same generation: only whether it is down changes.
                let same = self.owner().is_some_and(|h| h.node_id == owner.node_id && h.generation == owner.generation);
                let end = (!same).then(|| owner.clone());
                (Serving::Elsewhere { owner, down }, end)
            }
            ServingEvent::OwnedHere { fenced, cutting } => (Self::owned_here(fenced, cutting), None),
            ServingEvent::OwnedWithoutReplica => (Serving::Orphaned, None),
            ServingEvent::JoinedGroup if self.is_replica() => return None,
            ServingEvent::JoinedGroup => (Serving::Replica(ReplicaRole::Following { leader: None }), None),
            ServingEvent::Role(role) if self.replica() == Some(&role) => return None,
            ServingEvent::Role(role) => {
                let end = match &role {
                    ReplicaRole::Leading => None,
                    ReplicaRole::Settling | ReplicaRole::Following { leader: None } => self.here().then(nobody),
                    ReplicaRole::Following { leader: Some(h) } => Some(h.clone()),
                };
                (Serving::Replica(role), end)
            }
            ServingEvent::Fence if *self == Serving::Here => (Serving::Fenced, Some(nobody())),
            ServingEvent::Unfence { cutting } if *self == Serving::Fenced => (Self::owned_here(false, cutting), None),
            ServingEvent::CutOver { to } if *self == Serving::Here => (Serving::CuttingOver { to }, None),
            ServingEvent::Fence | ServingEvent::Unfence { .. } | ServingEvent::CutOver { .. } => return None,
            ServingEvent::MovedTo(owner) => (Serving::Elsewhere { owner: owner.clone(), down: false }, Some(owner)),
        };
        *self = next;
        end
    }

    /// The owner this broker knows of, when another broker owns or leads it.
    fn owner(&self) -> Option<&OwnerHint> {
        match self {
            Serving::Elsewhere { owner, .. } | Serving::Replica(ReplicaRole::Following { leader: Some(owner) }) => {
                Some(owner)
            }
            _ => None,
        }
    }

    fn owned_here(fenced: bool, cutting: Option<String>) -> Serving {
        match cutting {
            _ if fenced => Serving::Fenced,
            Some(to) => Serving::CuttingOver { to },
            None => Serving::Here,
        }
    }
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

    /// The `shard_unavailable` refusal for shard `shard`, naming `node` (the owner that is
    /// down, the move's target) where the reason names one.
    pub(super) fn refusal(self, shard: u32, node: &str) -> Refusal {
        let (message, retry_ms) = match self {
            Unavailable::NotReady => (format!("shard {shard}'s new leader is settling its readable bound; retry"), 50),
            Unavailable::NoLeader => (format!("shard {shard}'s replicas are electing a leader; retry"), 200),
            Unavailable::ConfirmingLeader => {
                (format!("shard {shard}'s leader is confirming with its replicas that it still leads; retry"), 50)
            }
            Unavailable::Moving => (format!("shard {shard} is moving to {node}: retry (then ask it)"), 50),
            Unavailable::Fenced => (
                format!(
                    "this broker lost contact with the cluster's metadata leader: it serves shard {shard} again once back in contact; retry (another broker may own it by then)"
                ),
                500,
            ),
            Unavailable::OwnerDown => {
                (format!("shard {shard} is owned by {node}, which is down; it holds the shard's records"), 1000)
            }
        };
        let mut r = Refusal::new(ErrorCode::ShardUnavailable, message);
        r.detail =
            Some(crate::binary::ErrorDetail { reason: Some(self.wire().into()), retry_after_ms: Some(retry_ms) });
        r.retry = RetryClass::Retry;
        r
    }
}

impl Broker {
    /// Moves shard `n` of stream `k` along its lifecycle ([`Serving::on`]); when that ends
    /// its readers here, they end as on a move: subscriptions with `shard_moved` (for clients
    /// that read it; a durable shard's says where to resume), polls waiting on it answered.
    /// `false` when there is no such shard.
    pub(super) fn shard_on(&mut self, k: &Key, n: u32, ev: ServingEvent, now: Instant) -> bool {
        let Some(entry) = self.node.streams.get_mut(k) else { return false };
        let durable = entry.config.durable;
        let Some(s) = entry.shards.get_mut(n as usize) else { return false };
        let Some(owner) = s.serving.on(ev) else { return true };
        let resume_from = durable.then(|| s.log.committed_tail());
        for (conn, id) in std::mem::take(&mut s.subs) {
            if let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) {
                let m = message::ShardMoved {
                    subscription_id: id,
                    resume_from,
                    // No leader yet (a replicated shard electing): the client asks again.
                    node_id: Some(owner.node_id.clone()).filter(|n| !n.is_empty()),
                    addr: owner.addr.clone(),
                    generation: owner.generation,
                };
                sub.on(SubEvent::End(Ending::Moved(m)));
                self.pump(conn, id);
            }
        }
        self.wake_groups(k, n, now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hint(node: &str, generation: u64) -> OwnerHint {
        OwnerHint { node_id: node.into(), addr: Some(format!("{node}:7000")), generation }
    }

    fn nobody() -> OwnerHint {
        OwnerHint { node_id: String::new(), addr: None, generation: 0 }
    }

    fn elsewhere(node: &str, generation: u64, down: bool) -> Serving {
        Serving::Elsewhere { owner: hint(node, generation), down }
    }

    fn following(leader: Option<OwnerHint>) -> Serving {
        Serving::Replica(ReplicaRole::Following { leader })
    }

    /// The lifecycle's table: from a state, an event leads to a state, ending the shard's
    /// readers (naming an owner) or not. docs/architecture.md prints the same table.
    #[test]
    fn every_transition_of_the_table() {
        use ServingEvent as E;
        let to = |t: &str| Some(t.to_owned());
        let owned_elsewhere = |node: &str, generation, down| E::OwnedElsewhere { owner: hint(node, generation), down };
        let rows: Vec<(Serving, ServingEvent, Serving, Option<OwnerHint>)> = vec![
            // The metadata names another owner: readers end unless it named that one already.
            (Serving::Here, owned_elsewhere("n2", 1, false), elsewhere("n2", 1, false), Some(hint("n2", 1))),
            (elsewhere("n2", 1, false), owned_elsewhere("n2", 1, true), elsewhere("n2", 1, true), None),
            (elsewhere("n2", 1, true), owned_elsewhere("n2", 1, false), elsewhere("n2", 1, false), None),
            (
                elsewhere("n2", 1, false),
                owned_elsewhere("n2", 2, false),
                elsewhere("n2", 2, false),
                Some(hint("n2", 2)),
            ),
            (
                elsewhere("n2", 1, false),
                owned_elsewhere("n3", 1, false),
                elsewhere("n3", 1, false),
                Some(hint("n3", 1)),
            ),
            (Serving::Fenced, owned_elsewhere("n2", 3, false), elsewhere("n2", 3, false), Some(hint("n2", 3))),
            (
                Serving::CuttingOver { to: "n2".into() },
                owned_elsewhere("n2", 2, false),
                elsewhere("n2", 2, false),
                Some(hint("n2", 2)),
            ),
            (following(Some(hint("n2", 4))), owned_elsewhere("n2", 4, false), elsewhere("n2", 4, false), None),
            (Serving::Orphaned, owned_elsewhere("n2", 1, false), elsewhere("n2", 1, false), Some(hint("n2", 1))),
            // The metadata names this broker: it serves, unless fenced or cutting over.
            (elsewhere("n2", 1, false), E::OwnedHere { fenced: false, cutting: None }, Serving::Here, None),
            (elsewhere("n2", 1, false), E::OwnedHere { fenced: true, cutting: to("n3") }, Serving::Fenced, None),
            (
                Serving::Here,
                E::OwnedHere { fenced: false, cutting: to("n3") },
                Serving::CuttingOver { to: "n3".into() },
                None,
            ),
            (
                Serving::Replica(ReplicaRole::Leading),
                E::OwnedHere { fenced: false, cutting: None },
                Serving::Here,
                None,
            ),
            (Serving::Here, E::OwnedWithoutReplica, Serving::Orphaned, None),
            // Fencing ends what is served here, and only that.
            (Serving::Here, E::Fence, Serving::Fenced, Some(nobody())),
            (elsewhere("n2", 1, false), E::Fence, elsewhere("n2", 1, false), None),
            (Serving::Replica(ReplicaRole::Leading), E::Fence, Serving::Replica(ReplicaRole::Leading), None),
            (Serving::Fenced, E::Unfence { cutting: None }, Serving::Here, None),
            (Serving::Fenced, E::Unfence { cutting: to("n2") }, Serving::CuttingOver { to: "n2".into() }, None),
            (Serving::Here, E::Unfence { cutting: None }, Serving::Here, None),
            // A move out cutting over: readers wait for the new owner, nothing ends yet.
            (Serving::Here, E::CutOver { to: "n2".into() }, Serving::CuttingOver { to: "n2".into() }, None),
            (elsewhere("n2", 1, false), E::CutOver { to: "n3".into() }, elsewhere("n2", 1, false), None),
            // A replica: its group's role decides.
            (Serving::Here, E::JoinedGroup, following(None), None),
            (elsewhere("n2", 1, false), E::JoinedGroup, following(None), None),
            (Serving::Replica(ReplicaRole::Leading), E::JoinedGroup, Serving::Replica(ReplicaRole::Leading), None),
            (following(None), E::Role(ReplicaRole::Settling), Serving::Replica(ReplicaRole::Settling), None),
            (
                Serving::Replica(ReplicaRole::Settling),
                E::Role(ReplicaRole::Leading),
                Serving::Replica(ReplicaRole::Leading),
                None,
            ),
            (
                Serving::Replica(ReplicaRole::Leading),
                E::Role(ReplicaRole::Settling),
                Serving::Replica(ReplicaRole::Settling),
                Some(nobody()),
            ),
            (
                Serving::Replica(ReplicaRole::Leading),
                E::Role(ReplicaRole::Following { leader: None }),
                following(None),
                Some(nobody()),
            ),
            (Serving::Here, E::Role(ReplicaRole::Following { leader: None }), following(None), Some(nobody())),
            (
                Serving::Replica(ReplicaRole::Settling),
                E::Role(ReplicaRole::Following { leader: Some(hint("n2", 5)) }),
                following(Some(hint("n2", 5))),
                Some(hint("n2", 5)),
            ),
            (
                following(None),
                E::Role(ReplicaRole::Following { leader: Some(hint("n2", 5)) }),
                following(Some(hint("n2", 5))),
                Some(hint("n2", 5)),
            ),
            (
                following(Some(hint("n2", 5))),
                E::Role(ReplicaRole::Following { leader: Some(hint("n2", 5)) }),
                following(Some(hint("n2", 5))),
                None,
            ),
            // By hand.
            (Serving::Here, E::MovedTo(hint("n2", 1)), elsewhere("n2", 1, false), Some(hint("n2", 1))),
            (Serving::Fenced, E::MovedTo(hint("n2", 1)), elsewhere("n2", 1, false), Some(hint("n2", 1))),
        ];
        for (i, (from, ev, want, want_end)) in rows.into_iter().enumerate() {
            let mut s = from.clone();
            let end = s.on(ev.clone());
            assert_eq!((&s, &end), (&want, &want_end), "row {i}: {from:?} --{ev:?}-->");
        }
    }

    /// What each state tells a request: served here, a redirect, or a reason to retry (the
    /// words on the wire, and the broker the answer names).
    #[test]
    fn what_each_state_answers() {
        let o = hint("n2", 3);
        let unavailable = |reason, node| Some(Away::Unavailable { reason, node });
        let cutting = Serving::CuttingOver { to: "n4".into() };
        let cases: Vec<(Serving, Option<Away<'_>>)> = vec![
            (Serving::Here, None),
            (Serving::Replica(ReplicaRole::Leading), None),
            (elsewhere("n2", 3, false), Some(Away::Owner(&o))),
            (following(Some(hint("n2", 3))), Some(Away::Owner(&o))),
            (elsewhere("n2", 3, true), unavailable(Unavailable::OwnerDown, "n2")),
            (Serving::Fenced, unavailable(Unavailable::Fenced, "")),
            (cutting.clone(), unavailable(Unavailable::Moving, "n4")),
            (Serving::Orphaned, unavailable(Unavailable::NoLeader, "")),
            (following(None), unavailable(Unavailable::NoLeader, "")),
            (Serving::Replica(ReplicaRole::Settling), unavailable(Unavailable::NotReady, "")),
        ];
        for (s, want) in &cases {
            assert_eq!(s.away(), *want, "{s:?}");
            assert_eq!(s.here(), want.is_none(), "{s:?}");
            assert_eq!(s.is_replica(), s.replica().is_some(), "{s:?}");
        }
        let r = Unavailable::Moving.refusal(2, "n4");
        assert_eq!(r.code, ErrorCode::ShardUnavailable);
        assert_eq!(r.retry, RetryClass::Retry);
        assert!(r.message.contains("moving to n4"), "{}", r.message);
        let detail = r.detail.expect("a reason word");
        assert_eq!((detail.reason.as_deref(), detail.retry_after_ms), (Some("moving"), Some(50)));
        let words: Vec<&str> = [
            Unavailable::OwnerDown,
            Unavailable::NotReady,
            Unavailable::NoLeader,
            Unavailable::ConfirmingLeader,
            Unavailable::Moving,
            Unavailable::Fenced,
        ]
        .iter()
        .map(|u| u.wire())
        .collect();
        assert_eq!(words, ["owner_down", "not_ready", "no_leader", "confirming_leader", "moving", "fenced"]);
    }
}
