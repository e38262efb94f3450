//! A shard move's two sides as lifecycles: the old owner's ([`Outgoing`]: copying, cutting
//! over, cut over) and the new owner's ([`Incoming`]: its copy's progress and its request to
//! the old owner), each changed only by its `on` (the shape of the broker's `Sub::on`). Pure
//! state, no IO and no broker types: the broker's `moves` drives them from copy answers,
//! written batches and the metadata's word on the move (the move's own lifecycle is the
//! metadata's, [`crate::shard::metadata::Move`]), and what they say decides what it does next.

use super::ShardId;
use std::time::Instant;

/// The old owner's side of a move.
#[derive(Debug, Clone)]
pub(crate) struct Outgoing {
    /// The new owner.
    to: String,
    /// Where the move is, on this side.
    phase: OutPhase,
    /// When it last proposed the cut-over (or the cancel): proposals are retried after
    /// the broker's `PROPOSE_RETRY`.
    proposed: Option<Instant>,
}

/// The old owner's side of a move, phase by phase; [`Outgoing::on`] is the one place it
/// changes.
///
/// ```text
///   copying ──stop (the copy reached the tail)──► cutting over ──metadata: cut at T──► cut over
///      └───────────────────────metadata: cut at T─────────────────────────────────────────┘
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OutPhase {
    /// The new owner copies; this broker serves on.
    Copying,
    /// The new owner caught up: writes are stopped (since `since`) and the cut-over at the
    /// tail is proposed; after the broker's `CUTOVER_GIVE_UP` the move is cancelled.
    CuttingOver {
        /// When writes stopped.
        since: Instant,
    },
    /// The metadata says the cut-over happened, at tail `at`; `since`: when this broker stopped
    /// writes, if it did before it learned.
    CutOver {
        /// The cut-over tail.
        at: u64,
        /// When writes stopped here.
        since: Option<Instant>,
    },
}

/// What moves the old owner's side of a move along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OutEvent {
    /// The copy reached the tail (or what is left is small): stop taking writes.
    Stop(Instant),
    /// The metadata's phase of the move: cut over at this tail, or not (yet).
    Metadata(Option<u64>),
    /// The cut-over (or the cancel) was proposed.
    Proposed(Instant),
}

/// The new owner's side of a move: its copy's phase and its request to the old owner, each
/// changed only by [`Incoming::on`]; the rest is progress (shown) and pacing.
#[derive(Debug, Clone)]
pub(crate) struct Incoming {
    /// The old owner.
    pub(crate) from: String,
    /// How far the copy got.
    copy: InCopy,
    /// The request to the old owner.
    asking: Asking,
    /// The cut-over tail, once the metadata has it.
    cut_at: Option<u64>,
    /// When it last proposed the finish.
    proposed: Option<Instant>,
    /// The old owner's tail in its last answer (progress).
    pub(crate) source_tail: u64,
    /// The old owner's tail in its first answer: below it is the copy the move budget paces,
    /// above it the shard's live writes, which it does not (`--move-bandwidth`).
    pub(crate) copy_floor: Option<u64>,
}

/// How far a move's copy got on the new owner.
///
/// ```text
///   fresh ──copied──► copying ──a write failed──► failed ──writes done, asked again──► fresh
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InCopy {
    /// Nothing copied yet (or starting again): the first answer empties the shard here.
    Fresh,
    /// Copied below `next`; `writing` copied batches are being written here.
    Copying {
        /// The next offset to copy.
        next: u64,
        /// Copied batches being written.
        writing: usize,
    },
    /// A copied write failed: once the `writing` still out are done, it starts again fresh.
    /// (Answers to requests sent before still come, and are written; none of it is used.)
    Failed {
        /// The next offset the copy would have asked for.
        next: u64,
        /// Copied batches still being written.
        writing: usize,
    },
}

/// The new owner's request for the next part of the copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Asking {
    /// Nothing out: ask once `at` comes (`None`: at once; never while copied writes are out).
    Waiting {
        /// When to ask.
        at: Option<Instant>,
    },
    /// A request is out, since then.
    Out {
        /// When it was sent.
        since: Instant,
    },
}

/// What moves the new owner's side of a move along.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum InEvent {
    /// The metadata's phase of the move: cut over at this tail, or not (yet). Learning of the
    /// cut-over asks for what is left at once.
    Metadata {
        /// The cut-over tail.
        cut_at: Option<u64>,
        /// Now.
        now: Instant,
    },
    /// A request went out; a failed copy starts again fresh with it.
    Asked(Instant),
    /// An answer came that gives nothing to write: ask again at this time (`None`: once the
    /// writes out are done).
    Answered(Option<Instant>),
    /// An answer's records: the copy reaches `next`, `writes` of them being written here.
    Copied {
        /// The next offset to copy.
        next: u64,
        /// Copied batches now being written.
        writes: usize,
    },
    /// One copied write settled.
    Written {
        /// Whether it was written.
        ok: bool,
    },
    /// The finish was proposed.
    Proposed(Instant),
}

impl Incoming {
    pub(crate) fn new(from: String, now: Instant) -> Incoming {
        Incoming {
            from,
            copy: InCopy::Fresh,
            asking: Asking::Waiting { at: Some(now) },
            cut_at: None,
            proposed: None,
            source_tail: 0,
            copy_floor: None,
        }
    }

    /// The one place the copy's phase and the request change.
    pub(crate) fn on(&mut self, ev: InEvent) {
        match ev {
            InEvent::Metadata { cut_at, now } => {
                if self.cut_at.is_none() && cut_at.is_some() && matches!(self.asking, Asking::Waiting { .. }) {
                    // Cut over: what is left to copy is final; ask for it now.
                    self.asking = Asking::Waiting { at: Some(now) };
                }
                self.cut_at = cut_at;
            }
            InEvent::Asked(now) => {
                if matches!(self.copy, InCopy::Failed { writing: 0, .. }) {
                    self.copy = InCopy::Fresh;
                    self.copy_floor = None;
                }
                self.asking = Asking::Out { since: now };
            }
            InEvent::Answered(at) => self.asking = Asking::Waiting { at },
            InEvent::Copied { next, writes } => {
                self.copy = match self.copy {
                    InCopy::Fresh => InCopy::Copying { next, writing: writes },
                    InCopy::Copying { writing, .. } => InCopy::Copying { next, writing: writing + writes },
                    InCopy::Failed { writing, .. } => InCopy::Failed { next, writing: writing + writes },
                }
            }
            InEvent::Written { ok } => {
                self.copy = match self.copy {
                    InCopy::Copying { next, writing } if ok => {
                        InCopy::Copying { next, writing: writing.saturating_sub(1) }
                    }
                    InCopy::Copying { next, writing } | InCopy::Failed { next, writing } => {
                        InCopy::Failed { next, writing: writing.saturating_sub(1) }
                    }
                    InCopy::Fresh => InCopy::Fresh,
                }
            }
            InEvent::Proposed(now) => self.proposed = Some(now),
        }
    }

    /// The next offset to copy; `None` before the first answer (which resets the shard here).
    pub(crate) fn next(&self) -> Option<u64> {
        match self.copy {
            InCopy::Copying { next, .. } | InCopy::Failed { next, .. } => Some(next),
            InCopy::Fresh => None,
        }
    }

    /// Copied batches being written here.
    pub(crate) fn writing(&self) -> usize {
        match self.copy {
            InCopy::Copying { writing, .. } | InCopy::Failed { writing, .. } => writing,
            InCopy::Fresh => 0,
        }
    }

    /// A copied write failed (the copy starts again once the others are done).
    pub(crate) fn failed(&self) -> bool {
        matches!(self.copy, InCopy::Failed { .. })
    }

    /// Something was copied here (a cancelled move drops it).
    pub(crate) fn copied_any(&self) -> bool {
        self.copy != InCopy::Fresh
    }

    /// The cut-over tail, once the metadata has it.
    pub(crate) fn cut_at(&self) -> Option<u64> {
        self.cut_at
    }

    /// Whether a request is due (`force`: an answer just came, ask now) or the last one was
    /// lost (out for `retry` or more).
    pub(crate) fn may_ask(&self, now: Instant, force: bool, retry: std::time::Duration) -> (bool, bool) {
        match self.asking {
            Asking::Out { since } => (now.saturating_duration_since(since) >= retry, false),
            Asking::Waiting { at } => (false, force || at.is_none_or(|d| d <= now)),
        }
    }

    /// The finish was proposed within `retry` of `now`.
    pub(crate) fn proposed_within(&self, now: Instant, retry: std::time::Duration) -> bool {
        self.proposed.is_some_and(|p| now.saturating_duration_since(p) < retry)
    }
}

impl Outgoing {
    pub(crate) fn new(to: String) -> Outgoing {
        Outgoing { to, phase: OutPhase::Copying, proposed: None }
    }

    /// The new owner.
    pub(crate) fn to(&self) -> &str {
        &self.to
    }

    /// The one place the phase changes. Learning of the cut-over forgets the last proposal
    /// (the next one, a cancel, is not held back by it).
    pub(crate) fn on(&mut self, ev: OutEvent) {
        self.phase = match (self.phase, ev) {
            (OutPhase::Copying, OutEvent::Stop(now)) => OutPhase::CuttingOver { since: now },
            (OutPhase::CutOver { at, since: None }, OutEvent::Stop(now)) => OutPhase::CutOver { at, since: Some(now) },
            (phase, OutEvent::Stop(_)) => phase,
            (OutPhase::Copying, OutEvent::Metadata(Some(at))) => {
                self.proposed = None;
                OutPhase::CutOver { at, since: None }
            }
            (OutPhase::CuttingOver { since }, OutEvent::Metadata(Some(at))) => {
                self.proposed = None;
                OutPhase::CutOver { at, since: Some(since) }
            }
            (OutPhase::CutOver { since, .. }, OutEvent::Metadata(Some(at))) => OutPhase::CutOver { at, since },
            (OutPhase::CutOver { since: Some(since), .. }, OutEvent::Metadata(None)) => OutPhase::CuttingOver { since },
            (OutPhase::CutOver { since: None, .. }, OutEvent::Metadata(None)) => OutPhase::Copying,
            (phase, OutEvent::Metadata(None)) => phase,
            (phase, OutEvent::Proposed(now)) => {
                self.proposed = Some(now);
                phase
            }
        };
    }

    /// The cut-over (or the cancel) was proposed within `retry` of `now`.
    pub(crate) fn proposed_within(&self, now: Instant, retry: std::time::Duration) -> bool {
        self.proposed.is_some_and(|p| now.saturating_duration_since(p) < retry)
    }

    /// Writes were stopped here for the cut-over (since when).
    pub(crate) fn stopped_since(&self) -> Option<Instant> {
        match self.phase {
            OutPhase::Copying => None,
            OutPhase::CuttingOver { since } => Some(since),
            OutPhase::CutOver { since, .. } => since,
        }
    }

    /// Writes are stopped for the cut-over.
    pub(crate) fn is_cutting(&self) -> bool {
        self.stopped_since().is_some()
    }

    /// Past copying: stopped here, or cut over in the metadata; the shard takes no writes.
    pub(crate) fn past_copying(&self) -> bool {
        self.phase != OutPhase::Copying
    }

    /// The cut-over tail, once the metadata has it.
    pub(crate) fn cut_at(&self) -> Option<u64> {
        match self.phase {
            OutPhase::CutOver { at, .. } => Some(at),
            _ => None,
        }
    }
}

/// What a move in progress looks like from this broker (`cluster status`, inspect).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MoveProgress {
    /// The shard.
    pub shard: ShardId,
    /// This broker sends it (else receives it).
    pub outgoing: bool,
    /// The other broker.
    pub peer: String,
    /// Receiving: the next offset to copy; sending: the tail.
    pub copied: u64,
    /// Receiving: the old owner's tail as last heard.
    pub source_tail: u64,
    /// Sending: writes are stopped for the cut-over.
    pub cutting: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The new owner's copy and request, event by event: a first answer, a poll, a failed
    /// write that starts the copy again once the others settled, the cut-over, the finish.
    #[test]
    fn an_incoming_moves_phase_by_phase() {
        let t0 = crate::transport::test_epoch();
        let later = |ms| t0 + std::time::Duration::from_millis(ms);
        let retry = std::time::Duration::from_secs(1);
        let mut i = Incoming::new("n1".into(), t0);
        assert_eq!((i.copy, i.asking), (InCopy::Fresh, Asking::Waiting { at: Some(t0) }));
        assert_eq!(i.may_ask(t0, false, retry), (false, true), "asks at once");
        i.on(InEvent::Asked(t0));
        assert_eq!(i.may_ask(later(500), false, retry), (false, false), "one request out");
        assert_eq!(i.may_ask(later(1000), false, retry), (true, false), "out too long: lost");
        i.on(InEvent::Answered(None));
        i.on(InEvent::Copied { next: 10, writes: 2 });
        assert_eq!((i.next(), i.writing(), i.copied_any()), (Some(10), 2, true));
        i.on(InEvent::Written { ok: true });
        i.on(InEvent::Written { ok: false });
        assert_eq!(i.copy, InCopy::Failed { next: 10, writing: 0 });
        // Asked again: from scratch.
        i.copy_floor = Some(10);
        i.on(InEvent::Asked(later(10)));
        assert_eq!((i.copy, i.copy_floor, i.next()), (InCopy::Fresh, None, None));
        i.on(InEvent::Answered(None));
        i.on(InEvent::Copied { next: 12, writes: 0 });
        i.on(InEvent::Answered(Some(later(60))));
        assert_eq!(i.may_ask(later(20), false, retry), (false, false), "polls later");
        assert_eq!(i.may_ask(later(20), true, retry), (false, true), "or when told");
        // The metadata's cut-over asks for the rest at once; while a request is out, that
        // request's answer comes first.
        i.on(InEvent::Metadata { cut_at: Some(12), now: later(30) });
        assert_eq!((i.cut_at(), i.asking), (Some(12), Asking::Waiting { at: Some(later(30)) }));
        i.on(InEvent::Asked(later(30)));
        i.on(InEvent::Metadata { cut_at: Some(12), now: later(40) });
        assert_eq!(i.asking, Asking::Out { since: later(30) });
        i.on(InEvent::Proposed(later(40)));
        assert!(i.proposed_within(later(41), retry) && !i.proposed_within(later(1040), retry));
    }

    /// The old owner's phases, event by event: stopping writes, and the metadata's word on the
    /// cut-over (which forgets the last proposal only when it is news).
    #[test]
    fn an_outgoing_moves_phase_by_phase() {
        let t0 = crate::transport::test_epoch();
        let t1 = t0 + std::time::Duration::from_secs(1);
        let mut o = Outgoing::new("n2".into());
        assert_eq!((o.past_copying(), o.is_cutting(), o.cut_at()), (false, false, None));
        o.on(OutEvent::Metadata(None));
        assert_eq!(o.phase, OutPhase::Copying);
        o.on(OutEvent::Stop(t0));
        assert_eq!(o.phase, OutPhase::CuttingOver { since: t0 });
        o.on(OutEvent::Stop(t1));
        assert_eq!(o.stopped_since(), Some(t0), "stopped once, from the first time");
        o.on(OutEvent::Proposed(t1));
        assert!(o.proposed_within(t1, std::time::Duration::from_secs(1)));
        assert_eq!(o.phase, OutPhase::CuttingOver { since: t0 }, "a proposal changes no phase");
        o.on(OutEvent::Metadata(Some(40)));
        assert_eq!(o.phase, OutPhase::CutOver { at: 40, since: Some(t0) });
        assert_eq!(o.proposed, None, "the cut-over is news: the proposal is forgotten");
        o.proposed = Some(t1);
        o.on(OutEvent::Metadata(Some(40)));
        assert_eq!(o.proposed, Some(t1), "not news");
        o.on(OutEvent::Metadata(None));
        assert_eq!(o.phase, OutPhase::CuttingOver { since: t0 }, "the metadata took it back");

        // Cut over before this broker stopped writes (it learned from the metadata first).
        let mut o = Outgoing::new("n3".into());
        o.on(OutEvent::Metadata(Some(7)));
        assert_eq!((o.past_copying(), o.is_cutting(), o.cut_at()), (true, false, Some(7)));
        o.on(OutEvent::Stop(t1));
        assert_eq!(o.phase, OutPhase::CutOver { at: 7, since: Some(t1) });
        let mut o = Outgoing::new("n3".into());
        o.on(OutEvent::Metadata(Some(7)));
        o.on(OutEvent::Metadata(None));
        assert_eq!(o.phase, OutPhase::Copying);
    }
}
