//! A subscription to one shard that follows the shard wherever the cluster serves it: across
//! moves (`shard_moved`, straight to the broker it names), leader fail-overs, a broker going
//! away, and a subscriber falling behind, with no gap and no duplicate
//! ([`felix_proto::client::SubscriptionCursor`]: it resumes at max(last delivered + 1,
//! `resume_from`)).
//!
//! ```no_run
//! # async fn f(cc: felix_driver_tokio::ClusterClient) -> Result<(), felix_driver_tokio::ClientError> {
//! use felix_proto::message::StartPosition;
//! let mut f = cc.follow("default", "orders", 3, Some(StartPosition::Earliest)).await?;
//! loop {
//!     let batch = f.next().await?;
//!     println!("{} records from offset {:?}", batch.records.count(), batch.base_offset);
//! }
//! # }
//! ```

use crate::client::{ClientError, Subscription, SubscriptionItem};
use crate::cluster_client::ClusterClient;
use felix_proto::binary::EventBatch;
use felix_proto::client::{EndReason, ErrorInfo, SubscriptionCursor};
use felix_proto::error_code::RetryClass;
use felix_proto::message::StartPosition;
use std::net::SocketAddr;
use std::time::Duration;

/// How long a follower keeps trying to subscribe again before it gives up (every broker
/// refusing, unreachable, or the shard without an owner that long).
pub const RESUME_WAIT: Duration = Duration::from_secs(60);

/// The first pause between attempts to subscribe again (doubling to 2 s).
const FIRST_PAUSE: Duration = Duration::from_millis(50);

/// A subscription that follows its shard (see the module doc). Made by
/// [`ClusterClient::follow`].
#[derive(Debug)]
pub struct Following<'a> {
    cluster: &'a ClusterClient,
    namespace: String,
    stream: String,
    shard: u32,
    sub: Subscription,
    cursor: SubscriptionCursor,
    resumes: u64,
    last_end: Option<String>,
}

impl ClusterClient {
    /// Subscribes to one shard from `start` on its owner, following it from then on: see
    /// [`Following`].
    ///
    /// # Errors
    /// As [`subscribe`](Self::subscribe).
    pub async fn follow(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        start: Option<StartPosition>,
    ) -> Result<Following<'_>, ClientError> {
        let sub = self.subscribe(namespace, stream, start, shard).await?;
        let mut cursor = SubscriptionCursor::new();
        cursor.subscribed(sub.start_offset);
        Ok(Following {
            cluster: self,
            namespace: namespace.to_owned(),
            stream: stream.to_owned(),
            shard,
            sub,
            cursor,
            resumes: 0,
            last_end: None,
        })
    }
}

impl Following<'_> {
    /// The next batch, wherever the shard is served by then.
    ///
    /// # Errors
    /// [`ClientError::Refused`] when the subscription cannot go on: the stream was deleted, a
    /// refusal that retrying cannot cure (a revoked token), or no broker took the subscription
    /// again within [`RESUME_WAIT`] (the last refusal).
    pub async fn next(&mut self) -> Result<EventBatch, ClientError> {
        loop {
            let reason = match self.sub.next().await {
                Some(SubscriptionItem::Events(batch)) => {
                    self.cursor.delivered(&batch);
                    return Ok(batch);
                }
                Some(SubscriptionItem::CacheChange(_)) => continue, // never on a stream
                Some(SubscriptionItem::End(reason)) => reason,
                None => EndReason::ConnectionLost("the connection closed".into()),
            };
            self.resume(reason).await?;
        }
    }

    /// Offset of the last event delivered.
    pub fn last_offset(&self) -> Option<u64> {
        self.cursor.last()
    }

    /// How many times the subscription was made again (moves, fail-overs, lags).
    pub fn resumes(&self) -> u64 {
        self.resumes
    }

    /// Why the subscription last had to be made again, for a person to read.
    pub fn last_end(&self) -> Option<&str> {
        self.last_end.as_deref()
    }

    /// Subscribes again after `reason`: at the broker a move named first, else wherever the
    /// cluster's view (refreshed, redirects followed) says, with a growing pause between
    /// refusals.
    async fn resume(&mut self, reason: EndReason) -> Result<(), ClientError> {
        let from = match self.cursor.resume(&reason) {
            Some(from) if follows(&reason) => from,
            _ => return Err(ClientError::Refused(ended(&reason))),
        };
        self.last_end = Some(describe(&reason));
        let mut hint: Option<SocketAddr> = match &reason {
            EndReason::Moved(m) => m.addr.as_deref().and_then(|a| a.parse().ok()),
            _ => None,
        };
        let until = tokio::time::Instant::now() + RESUME_WAIT;
        let mut pause = FIRST_PAUSE;
        loop {
            let (ns, stream, shard) = (&self.namespace, &self.stream, self.shard);
            let r = match hint.take() {
                Some(addr) => match self.cluster.at(addr).await {
                    Ok(c) => c.subscribe(ns, stream, Some(from), Some(shard)).await,
                    Err(e) => Err(e),
                },
                None => self.cluster.subscribe(ns, stream, Some(from), shard).await,
            };
            match r {
                Ok(sub) => {
                    self.cursor.subscribed(sub.start_offset);
                    self.sub = sub;
                    self.resumes += 1;
                    return Ok(());
                }
                Err(e) if retryable(&e) && tokio::time::Instant::now() < until => {
                    self.cluster.forget(ns, stream);
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(Duration::from_secs(2));
                }
                Err(e) => return Err(e),
            }
        }
    }
}

/// Whether a subscription that ended so goes on elsewhere: a move, a fail-over, its broker
/// gone, a lag (the log keeps what was missed), or a refusal that says to retry.
fn follows(reason: &EndReason) -> bool {
    match reason {
        EndReason::Moved(_)
        | EndReason::Lagged { .. }
        | EndReason::ConnectionLost(_)
        | EndReason::Finished
        | EndReason::Reset => true,
        EndReason::Error(e) => {
            matches!(e.retry, Some(RetryClass::Retry | RetryClass::RetryAfter | RetryClass::Redirect))
        }
        EndReason::Deleted | EndReason::WatchLagged { .. } => false,
    }
}

/// Whether a failed subscribe is worth another go: a redirect, a shard being handed over or
/// without a leader, a broker that is unreachable or went away. A subscribe changes nothing,
/// so an outcome it cannot know (its connection lost mid-request: the broker went quiet under
/// load) is worth another go too.
fn retryable(e: &ClientError) -> bool {
    match e {
        ClientError::NotLeader { .. } | ClientError::Connect(_) | ClientError::Closed(_) => true,
        ClientError::Refused(i) => {
            matches!(
                i.retry,
                Some(RetryClass::Retry | RetryClass::RetryAfter | RetryClass::Redirect | RetryClass::OutcomeUnknown)
            ) || matches!(i.code, Some(felix_proto::ErrorCode::NotLeader | felix_proto::ErrorCode::ShardUnavailable))
        }
        _ => false,
    }
}

fn describe(reason: &EndReason) -> String {
    match reason {
        EndReason::Moved(m) => {
            format!("its shard moved to {}", m.node_id.as_deref().unwrap_or("a broker being chosen"))
        }
        EndReason::Lagged { resume_from } => format!("it fell behind (the broker dropped from offset {resume_from})"),
        EndReason::ConnectionLost(why) => format!("its connection was lost ({why})"),
        EndReason::Finished | EndReason::Reset => "its broker ended it".into(),
        EndReason::Error(e) => format!("it ended: {}", e.message),
        EndReason::Deleted => "the stream was deleted".into(),
        EndReason::WatchLagged { resume_from } => format!("it fell behind at {resume_from}"),
    }
}

fn ended(reason: &EndReason) -> ErrorInfo {
    match reason {
        EndReason::Error(e) => e.clone(),
        other => ErrorInfo { message: describe(other), code: None, retry: Some(RetryClass::Fatal), detail: None },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::ErrorCode;

    fn refused(code: ErrorCode, retry: RetryClass) -> ClientError {
        ClientError::Refused(ErrorInfo { message: "x".into(), code: Some(code), retry: Some(retry), detail: None })
    }

    #[test]
    fn moves_fail_overs_and_lags_are_followed_a_deletion_is_not() {
        assert!(follows(&EndReason::Finished));
        assert!(follows(&EndReason::ConnectionLost("gone".into())));
        assert!(follows(&EndReason::Lagged { resume_from: 4 }));
        assert!(!follows(&EndReason::Deleted));
        let fatal = ErrorInfo { message: "revoked".into(), code: None, retry: Some(RetryClass::Fatal), detail: None };
        assert!(!follows(&EndReason::Error(fatal.clone())));
        assert_eq!(ended(&EndReason::Error(fatal.clone())), fatal);
        assert_eq!(ended(&EndReason::Deleted).retry, Some(RetryClass::Fatal));
    }

    #[test]
    fn redirects_and_hand_overs_are_retried_bad_requests_are_not() {
        assert!(retryable(&refused(ErrorCode::ShardUnavailable, RetryClass::RetryAfter)));
        assert!(retryable(&ClientError::NotLeader { node_id: "n2".into(), addr: None, generation: 3 }));
        assert!(retryable(&ClientError::Connect("refused".into())));
        // Found by the fault schedule: the subscribe sent again on a connection that went
        // quiet ended "connection lost", outcome unknown, and the follower gave up.
        let lost = ErrorInfo {
            message: "connection lost: the broker sent nothing for 2.0 s (unresponsive)".into(),
            code: None,
            retry: Some(RetryClass::OutcomeUnknown),
            detail: None,
        };
        assert!(retryable(&ClientError::Refused(lost)));
        assert!(!retryable(&refused(ErrorCode::Forbidden, RetryClass::Fatal)));
        assert!(!retryable(&ClientError::Invalid("name too long".into())));
    }
}
