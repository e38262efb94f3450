//! An idempotent producer's sequences, as a state machine (REFERENCE §10.3).
//!
//! Per shard it numbers batches from 0, sends each, and resends an unanswered batch under the
//! **same** sequence after a lost connection, a retryable failure or a timeout, until the
//! broker answers it. The broker remembers where the last [`MAX_IN_FLIGHT`] sequences of a
//! producer landed and nothing older, so a batch resent after more than that many newer ones
//! cannot be told apart from one never written: it is refused `sequence_expired` and its fate
//! is lost. This machine therefore never hands out a sequence `s` while a sequence at or below
//! `s - MAX_IN_FLIGHT` is unanswered ([`ProducerError::WindowFull`] instead): every sequence it
//! may resend stays inside what the broker remembers, whatever the network and the broker's
//! storage do. That is the rule docs/protocol.md states for every idempotent producer.
//!
//! It does no IO and reads no clock: the owner sends what [`poll_transmit`] hands out (with
//! [`ClientConnection::publish`](super::ClientConnection::publish) and `idempotent` set),
//! reports each answer with [`handle_outcome`], a lost connection with
//! [`handle_connection_lost`], and time with [`handle_timeout`]. The tokio driver's
//! `IdempotentProducer` and the simulation both drive it.
//!
//! [`poll_transmit`]: ProducerState::poll_transmit
//! [`handle_outcome`]: ProducerState::handle_outcome
//! [`handle_connection_lost`]: ProducerState::handle_connection_lost
//! [`handle_timeout`]: ProducerState::handle_timeout

use super::ErrorInfo;
use crate::error_code::{ErrorCode, RetryClass};
use crate::message::RefusedReason;
use bytes::Bytes;
use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

/// How many sequences of one producer may be unanswered per shard. Equal to how many the
/// broker remembers (`broker::producer::WINDOW` is this constant), so that every batch the
/// producer may still resend is one the broker can answer.
pub const MAX_IN_FLIGHT: u64 = 64;

/// How a producer retries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// Sends per batch, the first included, before the producer gives up (and stops).
    pub attempts: u32,
    /// Wait before the first resend after a failure; doubled each time up to `max_backoff`. A
    /// lost connection resends at once (the new connection is the wait).
    pub backoff: Duration,
    /// Longest wait between sends.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { attempts: 20, backoff: Duration::from_millis(20), max_backoff: Duration::from_secs(2) }
    }
}

/// Names one send of one batch: its outcome is reported under it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SendId {
    /// The shard the batch belongs to.
    pub shard: u32,
    /// Its sequence on that shard.
    pub sequence: u64,
    /// 1 for the first send, then one more per resend. An outcome for an earlier attempt than
    /// the batch's latest (from a connection given up on) changes nothing, unless it says the
    /// batch was appended, which is true whichever copy did it.
    pub attempt: u32,
}

/// A batch handed to the owner to send.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProducerSend {
    /// Which batch and which attempt.
    pub id: SendId,
    /// Payloads.
    pub payloads: Vec<Bytes>,
    /// Routing key (sent with the batch; the shard was chosen from it).
    pub key: Option<Bytes>,
}

/// What the broker (or the connection) said about a sent batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Outcome {
    /// Appended exactly once (a duplicate reports the original offset).
    Appended {
        /// First record's offset, when the broker gave one.
        offset: Option<u64>,
    },
    /// `publish_error`: resent if its retry class allows.
    Failed(ErrorInfo),
    /// `publish_refused`: the producer's own state disagrees with the broker's (gap, reuse,
    /// expiry, unknown producer). Everything stops, except for `not_leader`, which is resent.
    Refused {
        /// Why.
        reason: RefusedReason,
        /// Prose.
        message: String,
    },
    /// The send did not happen (the stream was not ready, or the publish window was full):
    /// the batch goes back to the queue, not counted as an attempt.
    NotSent,
}

/// Something the owner should know. Each is reported once.
#[derive(Debug, Clone, PartialEq)]
pub enum ProducerEvent {
    /// A batch was appended (exactly once).
    Appended {
        /// Shard.
        shard: u32,
        /// Sequence.
        sequence: u64,
        /// First record's offset, when the broker gave one.
        offset: Option<u64>,
    },
    /// The producer stopped: no batch will be sent again. Every unanswered batch is reported
    /// in `unanswered` (their outcome is unknown where they were in flight).
    Stopped {
        /// Why.
        error: ProducerError,
        /// `(shard, sequence)` of every batch that was not answered.
        unanswered: Vec<(u32, u64)>,
    },
}

/// Why the producer refused a batch or stopped.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProducerError {
    /// [`MAX_IN_FLIGHT`] sequences of this shard are unanswered, counting from the oldest: wait
    /// for an `Appended` before pushing more.
    #[error("{MAX_IN_FLIGHT} batches of shard {shard} are unanswered; wait for one to be appended")]
    WindowFull {
        /// Shard.
        shard: u32,
    },
    /// The broker refused a batch with a typed reason (its state and this producer's differ).
    #[error("batch {sequence} on shard {shard} refused ({reason:?}): {message}")]
    Refused {
        /// Shard.
        shard: u32,
        /// Sequence.
        sequence: u64,
        /// Why.
        reason: RefusedReason,
        /// Prose.
        message: String,
    },
    /// The broker failed a batch with a class that forbids resending it.
    #[error("batch {sequence} on shard {shard} failed: {}", error.message)]
    Fatal {
        /// Shard.
        shard: u32,
        /// Sequence.
        sequence: u64,
        /// The broker's error.
        error: ErrorInfo,
    },
    /// A batch was sent `attempts` times without an answer that settles it.
    #[error("batch {sequence} on shard {shard} was sent {attempts} times without being appended")]
    GaveUp {
        /// Shard.
        shard: u32,
        /// Sequence.
        sequence: u64,
        /// Sends.
        attempts: u32,
    },
    /// The producer stopped earlier; create a new one (`producer_init`).
    #[error("the producer stopped: {0}")]
    Stopped(Box<ProducerError>),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting to be handed out by `poll_transmit`.
    Queued,
    /// Sent, not answered.
    InFlight,
    /// Failed retryably; queued again at `until`.
    Backoff { until: Instant },
}

#[derive(Debug, Clone)]
struct Pending {
    payloads: Vec<Bytes>,
    key: Option<Bytes>,
    phase: Phase,
    attempts: u32,
    wait: Duration,
}

#[derive(Debug, Default)]
struct Shard {
    next: u64,
    /// Unanswered batches by sequence.
    pending: BTreeMap<u64, Pending>,
}

impl Shard {
    fn oldest(&self) -> Option<u64> {
        self.pending.keys().next().copied()
    }
}

/// An idempotent producer's sequences and resends (see the module docs).
#[derive(Debug)]
pub struct ProducerState {
    producer_id: u64,
    policy: RetryPolicy,
    shards: BTreeMap<u32, Shard>,
    stopped: Option<ProducerError>,
    events: VecDeque<ProducerEvent>,
}

impl ProducerState {
    /// A producer with the id the broker gave it (`producer_init`).
    pub fn new(producer_id: u64, policy: RetryPolicy) -> ProducerState {
        ProducerState { producer_id, policy, shards: BTreeMap::new(), stopped: None, events: VecDeque::new() }
    }

    /// The broker-chosen producer id.
    pub fn producer_id(&self) -> u64 {
        self.producer_id
    }

    /// How it retries.
    pub fn policy(&self) -> RetryPolicy {
        self.policy
    }

    /// The sequence the next batch pushed to `shard` gets.
    pub fn next_sequence(&self, shard: u32) -> u64 {
        self.shards.get(&shard).map_or(0, |s| s.next)
    }

    /// Unanswered batches over every shard.
    pub fn unanswered(&self) -> usize {
        self.shards.values().map(|s| s.pending.len()).sum()
    }

    /// Whether `push` to `shard` would be accepted now.
    pub fn has_room(&self, shard: u32) -> bool {
        self.stopped.is_none() && self.shards.get(&shard).is_none_or(Self::room)
    }

    fn room(s: &Shard) -> bool {
        s.oldest().is_none_or(|o| s.next - o < MAX_IN_FLIGHT)
    }

    /// Why the producer stopped, once it has.
    pub fn stopped(&self) -> Option<&ProducerError> {
        self.stopped.as_ref()
    }

    /// Queues a batch for `shard` and returns its sequence.
    ///
    /// # Errors
    /// [`ProducerError::WindowFull`] when the shard's oldest unanswered batch is
    /// [`MAX_IN_FLIGHT`] sequences back; [`ProducerError::Stopped`] after the producer stopped.
    /// Nothing changes on an error.
    pub fn push(&mut self, shard: u32, payloads: Vec<Bytes>, key: Option<Bytes>) -> Result<u64, ProducerError> {
        if let Some(e) = &self.stopped {
            return Err(ProducerError::Stopped(Box::new(e.clone())));
        }
        let s = self.shards.entry(shard).or_default();
        if !Self::room(s) {
            return Err(ProducerError::WindowFull { shard });
        }
        let sequence = s.next;
        s.next += 1;
        let wait = self.policy.backoff;
        s.pending.insert(sequence, Pending { payloads, key, phase: Phase::Queued, attempts: 0, wait });
        Ok(sequence)
    }

    /// The next batch to send: the lowest queued sequence of the lowest shard, so that a
    /// shard's batches go out in sequence order (the broker answers a gap otherwise). It counts
    /// as in flight until its outcome is reported.
    #[must_use]
    pub fn poll_transmit(&mut self) -> Option<ProducerSend> {
        if self.stopped.is_some() {
            return None;
        }
        for (&shard, s) in &mut self.shards {
            // Later sequences wait while an earlier one backs off: sent ahead of it they would
            // be refused as a gap.
            let Some((&sequence, p)) = s.pending.iter_mut().find(|(_, p)| p.phase != Phase::InFlight) else {
                continue;
            };
            if p.phase != Phase::Queued {
                continue;
            }
            p.phase = Phase::InFlight;
            p.attempts += 1;
            let id = SendId { shard, sequence, attempt: p.attempts };
            return Some(ProducerSend { id, payloads: p.payloads.clone(), key: p.key.clone() });
        }
        None
    }

    /// What became of a send `poll_transmit` handed out.
    pub fn handle_outcome(&mut self, id: SendId, outcome: Outcome, now: Instant) {
        let SendId { shard, sequence, attempt } = id;
        let policy = self.policy;
        let Some(s) = self.shards.get_mut(&shard) else { return };
        // An earlier batch of the shard not yet appended: it failed and waits to be sent again,
        // or has already gone again (its failure and this refusal were both on the wire when
        // the producer resent it; the broker answers in order, so the gap is its failure).
        let earlier_retry = |expected: u64| expected < sequence && s.pending.contains_key(&expected);
        // `unknown_producer` answers a first batch that is not sequence 0: the gap is behind 0.
        let follows_failure = match &outcome {
            Outcome::Refused { reason: RefusedReason::SequenceGap { expected }, .. } => earlier_retry(*expected),
            Outcome::Refused { reason: RefusedReason::UnknownProducer, .. } => earlier_retry(0),
            _ => false,
        };
        let Some(p) = s.pending.get_mut(&sequence) else { return };
        let current = p.phase == Phase::InFlight && p.attempts == attempt;
        if !current && !matches!(outcome, Outcome::Appended { .. }) {
            return; // about a send already given up on (its resend will be answered)
        }
        match outcome {
            Outcome::Appended { offset } => {
                if let Some(s) = self.shards.get_mut(&shard) {
                    s.pending.remove(&sequence);
                }
                self.events.push_back(ProducerEvent::Appended { shard, sequence, offset });
            }
            Outcome::NotSent => {
                p.phase = Phase::Queued;
                p.attempts -= 1;
            }
            Outcome::Refused { reason: RefusedReason::NotLeader(_), .. } => p.phase = Phase::Queued,
            // Pipelined behind a batch that failed: the broker never saw that one, so this one
            // is a gap. It goes again after the failed one (the spec orders the answers so the
            // failure comes first).
            Outcome::Refused { .. } if follows_failure => p.phase = Phase::Queued,
            Outcome::Refused { reason, message } => {
                self.stop(ProducerError::Refused { shard, sequence, reason, message });
            }
            Outcome::Failed(error) => {
                let class = error.retry.or_else(|| error.code.as_ref().map(ErrorCode::default_retry));
                let resend = match class {
                    // Without codes (a client that offered none) nothing says it is final: the
                    // same sequence is safe to send again.
                    None => true,
                    Some(c) => !matches!(c, RetryClass::Fatal),
                };
                if !resend {
                    return self.stop(ProducerError::Fatal { shard, sequence, error });
                }
                if p.attempts >= policy.attempts {
                    let attempts = p.attempts;
                    return self.stop(ProducerError::GaveUp { shard, sequence, attempts });
                }
                let asked = error.detail.as_ref().and_then(|d| d.retry_after_ms).map(Duration::from_millis);
                let wait = asked.unwrap_or(p.wait).max(p.wait);
                p.wait = (p.wait * 2).min(policy.max_backoff);
                p.phase = Phase::Backoff { until: crate::transport::after(now, wait) };
            }
        }
    }

    /// The connection carrying the in-flight batches is gone: their outcome is unknown, so each
    /// is sent again (same sequence) on the next connection.
    pub fn handle_connection_lost(&mut self) {
        let attempts = self.policy.attempts;
        let mut gave_up = None;
        for (&shard, s) in &mut self.shards {
            for (&sequence, p) in &mut s.pending {
                if p.phase == Phase::InFlight {
                    p.phase = Phase::Queued;
                    if p.attempts >= attempts && gave_up.is_none() {
                        gave_up = Some(ProducerError::GaveUp { shard, sequence, attempts: p.attempts });
                    }
                }
            }
        }
        if let Some(e) = gave_up {
            self.stop(e);
        }
    }

    /// When the next backoff ends.
    pub fn poll_timeout(&self) -> Option<Instant> {
        self.shards
            .values()
            .flat_map(|s| s.pending.values())
            .filter_map(|p| match p.phase {
                Phase::Backoff { until } => Some(until),
                _ => None,
            })
            .min()
    }

    /// Time passed: batches whose backoff ended are queued again.
    pub fn handle_timeout(&mut self, now: Instant) {
        for p in self.shards.values_mut().flat_map(|s| s.pending.values_mut()) {
            if let Phase::Backoff { until } = p.phase
                && until <= now
            {
                p.phase = Phase::Queued;
            }
        }
    }

    /// The next event.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<ProducerEvent> {
        self.events.pop_front()
    }

    fn stop(&mut self, error: ProducerError) {
        let unanswered: Vec<(u32, u64)> =
            self.shards.iter().flat_map(|(&sh, s)| s.pending.keys().map(move |&q| (sh, q))).collect();
        for s in self.shards.values_mut() {
            s.pending.clear();
        }
        self.stopped = Some(error.clone());
        self.events.push_back(ProducerEvent::Stopped { error, unanswered });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::binary::ErrorDetail;

    fn t0() -> Instant {
        thread_local!(static T0: Instant = crate::transport::test_epoch());
        T0.with(|t| *t)
    }

    fn b(s: &str) -> Vec<Bytes> {
        vec![Bytes::from(s.to_owned())]
    }

    fn err(retry: Option<RetryClass>, after: Option<u64>) -> ErrorInfo {
        ErrorInfo {
            message: "x".into(),
            code: retry.map(|_| ErrorCode::Storage),
            retry,
            detail: after.map(|ms| ErrorDetail { reason: None, retry_after_ms: Some(ms) }),
        }
    }

    fn sends(p: &mut ProducerState) -> Vec<SendId> {
        std::iter::from_fn(|| p.poll_transmit()).map(|s| s.id).collect()
    }

    fn appended(p: &mut ProducerState, id: SendId) {
        p.handle_outcome(id, Outcome::Appended { offset: Some(id.sequence) }, t0());
    }

    #[test]
    fn never_more_than_the_window_unanswered_counting_from_the_oldest() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        for i in 0..MAX_IN_FLIGHT {
            assert_eq!(p.push(0, b("x"), None), Ok(i));
        }
        assert_eq!(p.push(0, b("x"), None), Err(ProducerError::WindowFull { shard: 0 }));
        assert!(p.push(1, b("other shard"), None).is_ok(), "windows are per shard");
        let sent: Vec<SendId> = sends(&mut p).into_iter().filter(|s| s.shard == 0).collect();
        assert_eq!(sent.iter().map(|s| s.sequence).collect::<Vec<_>>(), (0..MAX_IN_FLIGHT).collect::<Vec<_>>());
        // Answers for everything but sequence 0 do not open the window: 0 is still unanswered
        // and a resend of it must stay inside what the broker remembers.
        for id in &sent[1..] {
            appended(&mut p, *id);
        }
        assert!(!p.has_room(0));
        appended(&mut p, sent[0]);
        assert!(p.has_room(0));
        assert_eq!(p.push(0, b("x"), None), Ok(MAX_IN_FLIGHT));
    }

    #[test]
    fn a_lost_connection_resends_in_sequence_order_under_the_same_sequences() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        for _ in 0..3 {
            p.push(0, b("x"), None).unwrap();
        }
        let first = sends(&mut p);
        assert_eq!(first.len(), 3);
        assert!(p.poll_transmit().is_none(), "nothing twice while in flight");
        appended(&mut p, first[1]);
        p.handle_connection_lost();
        let again: Vec<(u64, u32)> = sends(&mut p).iter().map(|s| (s.sequence, s.attempt)).collect();
        assert_eq!(again, vec![(0, 2), (2, 2)]);
    }

    #[test]
    fn an_outcome_of_an_abandoned_attempt_changes_nothing_unless_it_is_appended() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        p.push(0, b("x"), None).unwrap();
        p.push(0, b("y"), None).unwrap();
        let old = sends(&mut p);
        p.handle_connection_lost();
        let new = sends(&mut p);
        // The old connection's failure for sequence 0 arrives late: the resend stands.
        p.handle_outcome(old[0], Outcome::Failed(err(Some(RetryClass::Retry), None)), t0());
        assert!(p.poll_timeout().is_none() && p.poll_transmit().is_none());
        // Its success for sequence 1 is true whichever copy did it.
        appended(&mut p, old[1]);
        assert_eq!(p.poll_event(), Some(ProducerEvent::Appended { shard: 0, sequence: 1, offset: Some(1) }));
        appended(&mut p, new[1]); // the resend's duplicate answer: already settled, nothing more
        assert_eq!(p.poll_event(), None);
        assert_eq!(p.unanswered(), 1);
    }

    #[test]
    fn a_retryable_failure_backs_off_honouring_retry_after_and_holds_later_sequences() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        p.push(0, b("a"), None).unwrap();
        p.push(0, b("b"), None).unwrap();
        let s = sends(&mut p);
        p.handle_outcome(s[0], Outcome::Failed(err(Some(RetryClass::RetryAfter), Some(500))), t0());
        p.handle_outcome(s[1], Outcome::Failed(err(Some(RetryClass::Retry), None)), t0());
        // Sequence 1 backs off the default 20 ms; sequence 0 what the broker asked.
        assert_eq!(p.poll_timeout(), Some(t0() + Duration::from_millis(20)));
        p.handle_timeout(t0() + Duration::from_millis(100));
        assert_eq!(p.poll_timeout(), Some(t0() + Duration::from_millis(500)));
        assert!(p.poll_transmit().is_none(), "sequence 1 waits behind sequence 0's backoff");
        p.handle_timeout(t0() + Duration::from_millis(500));
        assert_eq!(sends(&mut p).iter().map(|s| s.sequence).collect::<Vec<_>>(), vec![0, 1]);
    }

    #[test]
    fn a_refusal_or_a_fatal_error_stops_everything_but_not_leader_resends() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        p.push(0, b("a"), None).unwrap();
        p.push(0, b("b"), None).unwrap();
        let s = p.poll_transmit().unwrap().id;
        let hint = crate::message::LeaderHint { node_id: "n2".into(), addr: None };
        let not_leader = Outcome::Refused { reason: RefusedReason::NotLeader(hint), message: String::new() };
        p.handle_outcome(s, not_leader, t0());
        let again = p.poll_transmit().unwrap().id;
        assert_eq!((again.sequence, again.attempt), (0, 2));
        let gap = Outcome::Refused { reason: RefusedReason::SequenceGap { expected: 3 }, message: "gap".into() };
        p.handle_outcome(again, gap, t0());
        match p.poll_event() {
            Some(ProducerEvent::Stopped { error: ProducerError::Refused { sequence: 0, .. }, unanswered }) => {
                assert_eq!(unanswered, vec![(0, 0), (0, 1)])
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(p.push(0, b("c"), None), Err(ProducerError::Stopped(_))));
        assert!(p.poll_transmit().is_none());

        let mut q = ProducerState::new(8, RetryPolicy::default());
        q.push(0, b("a"), None).unwrap();
        let s = q.poll_transmit().unwrap().id;
        q.handle_outcome(s, Outcome::Failed(err(Some(RetryClass::Fatal), None)), t0());
        assert!(matches!(q.stopped(), Some(ProducerError::Fatal { .. })));
    }

    #[test]
    fn a_gap_behind_a_failed_batch_is_sent_again_after_it() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        p.push(0, b("a"), None).unwrap();
        p.push(0, b("b"), None).unwrap();
        let s = sends(&mut p);
        p.handle_outcome(s[0], Outcome::Failed(err(Some(RetryClass::Retry), None)), t0());
        let gap = Outcome::Refused { reason: RefusedReason::SequenceGap { expected: 0 }, message: String::new() };
        p.handle_outcome(s[1], gap, t0());
        assert!(p.stopped().is_none());
        p.handle_timeout(t0() + Duration::from_secs(1));
        assert_eq!(sends(&mut p).iter().map(|s| s.sequence).collect::<Vec<_>>(), vec![0, 1]);
    }

    /// Simulation seed 44: batches 1 and 2 are pipelined behind 0; 0 fails and is sent again
    /// before the gap refusals of 1 and 2 arrive. They are still gaps behind 0, not a reason
    /// to stop.
    #[test]
    fn a_gap_behind_a_batch_already_sent_again_is_sent_again_too() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        for x in ["a", "b", "c"] {
            p.push(0, b(x), None).unwrap();
        }
        let s = sends(&mut p);
        p.handle_outcome(s[0], Outcome::Failed(err(Some(RetryClass::Retry), None)), t0());
        p.handle_timeout(t0() + Duration::from_secs(1));
        let again = sends(&mut p);
        assert_eq!(again.iter().map(|s| (s.sequence, s.attempt)).collect::<Vec<_>>(), vec![(0, 2)]);
        let gap = || Outcome::Refused { reason: RefusedReason::SequenceGap { expected: 0 }, message: String::new() };
        p.handle_outcome(s[1], gap(), t0());
        p.handle_outcome(s[2], gap(), t0());
        assert!(p.stopped().is_none());
        let resent = sends(&mut p);
        assert_eq!(resent.iter().map(|s| (s.sequence, s.attempt)).collect::<Vec<_>>(), vec![(1, 2), (2, 2)]);
        // A gap behind a batch already appended is the broker forgetting: that stops.
        p.handle_outcome(again[0], Outcome::Appended { offset: Some(0) }, t0());
        p.handle_outcome(resent[0], gap(), t0());
        assert!(matches!(p.stopped(), Some(ProducerError::Refused { sequence: 1, .. })));
    }

    /// Simulation seed 502: the producer's very first batch fails, so the broker does not know
    /// the producer when the pipelined second arrives, and says `unknown_producer` rather than
    /// a gap. It is still a gap behind the failure.
    #[test]
    fn unknown_producer_behind_a_failed_first_batch_is_sent_again() {
        let mut p = ProducerState::new(7, RetryPolicy::default());
        p.push(0, b("a"), None).unwrap();
        p.push(0, b("b"), None).unwrap();
        let s = sends(&mut p);
        p.handle_outcome(s[0], Outcome::Failed(err(Some(RetryClass::Retry), None)), t0());
        let unknown = || Outcome::Refused { reason: RefusedReason::UnknownProducer, message: String::new() };
        p.handle_outcome(s[1], unknown(), t0());
        assert!(p.stopped().is_none());
        p.handle_timeout(t0() + Duration::from_secs(1));
        let again = sends(&mut p);
        assert_eq!(again.iter().map(|s| s.sequence).collect::<Vec<_>>(), vec![0, 1]);
        // Once 0 is appended, a broker that does not know the producer has forgotten it: stop.
        p.handle_outcome(again[0], Outcome::Appended { offset: Some(0) }, t0());
        p.handle_outcome(again[1], unknown(), t0());
        assert!(matches!(p.stopped(), Some(ProducerError::Refused { sequence: 1, .. })));
    }

    #[test]
    fn not_sent_is_not_an_attempt_and_attempts_are_bounded() {
        let policy = RetryPolicy { attempts: 2, ..RetryPolicy::default() };
        let mut p = ProducerState::new(7, policy);
        p.push(0, b("a"), None).unwrap();
        let s = p.poll_transmit().unwrap().id;
        p.handle_outcome(s, Outcome::NotSent, t0());
        let s = p.poll_transmit().unwrap().id;
        assert_eq!(s.attempt, 1);
        p.handle_outcome(s, Outcome::Failed(err(None, None)), t0());
        p.handle_timeout(t0() + Duration::from_secs(1));
        let s = p.poll_transmit().unwrap().id;
        assert_eq!(s.attempt, 2);
        p.handle_outcome(s, Outcome::Failed(err(None, None)), t0());
        assert!(matches!(p.stopped(), Some(ProducerError::GaveUp { attempts: 2, .. })));
    }
}
