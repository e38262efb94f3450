//! Where a durable subscription resumes after it ended early, so that it sees every record once:
//! no gap, no duplicate. A state machine beside the connection: feed it what the subscription
//! saw, ask it where to subscribe again.

use super::EndReason;
use crate::binary::EventBatch;
use crate::error_code::RetryClass;
use crate::message::StartPosition;

/// Where to subscribe again after `subscription_lagged`, for no gap and no duplicate: right after
/// the last event received, or at `resume_from` when none was. The spec's rule: a frame below
/// `resume_from` may still have been dropped by the connection writer's queue (unreported), so
/// `resume_from` alone is only safe when nothing arrived.
pub fn lagged_resume_point(last_received: Option<u64>, resume_from: u64) -> u64 {
    match last_received {
        Some(last) => last.saturating_add(1),
        None => resume_from,
    }
}

/// What one subscription has seen, and where it resumes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SubscriptionCursor {
    /// Offset of the last event received.
    last: Option<u64>,
    /// `start_offset` of the latest confirmation: where an idle subscription resumes.
    start: Option<u64>,
}

impl SubscriptionCursor {
    /// A cursor for a new subscription.
    pub fn new() -> SubscriptionCursor {
        SubscriptionCursor::default()
    }

    /// The subscription was confirmed with this `start_offset`.
    pub fn subscribed(&mut self, start_offset: Option<u64>) {
        if self.last.is_none() {
            self.start = start_offset.or(self.start);
        }
    }

    /// A batch arrived.
    pub fn delivered(&mut self, batch: &EventBatch) {
        if let Some(base) = batch.base_offset
            && batch.records.count() > 0
        {
            self.last = Some(base + u64::from(batch.records.count()) - 1);
        }
    }

    /// The offset of the last event received.
    pub fn last(&self) -> Option<u64> {
        self.last
    }

    /// Where to subscribe again after the subscription ended with `reason`, or `None` when it
    /// must not (the stream was deleted, a fatal error). Without offsets (an in-memory stream)
    /// there is nothing to resume from: the new subscription starts at the tail.
    pub fn resume(&self, reason: &EndReason) -> Option<StartPosition> {
        let after_last =
            || self.last.map(|l| l + 1).or(self.start).map_or(StartPosition::Latest, StartPosition::Offset);
        match reason {
            EndReason::Lagged { resume_from } => {
                Some(StartPosition::Offset(lagged_resume_point(self.last, *resume_from)))
            }
            EndReason::Moved(m) => Some(match (m.resume_from, self.last) {
                (Some(r), Some(l)) => StartPosition::Offset(r.max(l + 1)),
                (Some(r), None) => StartPosition::Offset(self.start.map_or(r, |s| s.max(r))),
                (None, _) => after_last(),
            }),
            EndReason::Deleted => None,
            EndReason::Error(e) if e.retry == Some(RetryClass::Fatal) => None,
            EndReason::Error(_)
            | EndReason::Finished
            | EndReason::Reset
            | EndReason::ConnectionLost(_)
            | EndReason::WatchLagged { .. } => Some(after_last()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::binary::Records;
    use crate::message::ShardMoved;

    fn batch(base: u64, n: usize) -> EventBatch {
        let records = Records::from_payloads((0..n).map(|i| format!("r{i}"))).unwrap();
        EventBatch { base_offset: Some(base), ..EventBatch::shared(records) }
    }

    fn moved(resume_from: Option<u64>) -> EndReason {
        EndReason::Moved(ShardMoved { subscription_id: 1, resume_from, node_id: None, addr: None, generation: 2 })
    }

    #[test]
    fn resumes_after_the_last_event_or_where_the_broker_says() {
        let mut c = SubscriptionCursor::new();
        c.subscribed(Some(10));
        // Nothing seen: an idle subscription resumes at its start offset, not at the tail.
        assert_eq!(c.resume(&EndReason::ConnectionLost("x".into())), Some(StartPosition::Offset(10)));
        assert_eq!(c.resume(&EndReason::Lagged { resume_from: 12 }), Some(StartPosition::Offset(12)));
        c.delivered(&batch(10, 3)); // 10, 11, 12
        assert_eq!(c.last(), Some(12));
        assert_eq!(c.resume(&EndReason::Lagged { resume_from: 20 }), Some(StartPosition::Offset(13)));
        assert_eq!(c.resume(&EndReason::Finished), Some(StartPosition::Offset(13)));
        // A move: the larger of after-the-last and the broker's resume_from.
        assert_eq!(c.resume(&moved(Some(11))), Some(StartPosition::Offset(13)));
        assert_eq!(c.resume(&moved(Some(15))), Some(StartPosition::Offset(15)));
        assert_eq!(c.resume(&moved(None)), Some(StartPosition::Offset(13)));
        assert_eq!(c.resume(&EndReason::Deleted), None);
        // A later confirmation (the resumed subscription) does not move a cursor that saw events.
        c.subscribed(Some(13));
        assert_eq!(c.last(), Some(12));
    }

    #[test]
    fn without_offsets_it_resumes_at_the_tail() {
        let mut c = SubscriptionCursor::new();
        c.subscribed(None);
        c.delivered(&EventBatch::shared(Records::from_payloads(["x"]).unwrap()));
        assert_eq!(c.resume(&EndReason::Finished), Some(StartPosition::Latest));
    }
}
