//! How a subscription's end reads to the operator, and whether a reader follows it to
//! wherever its shard is served now.

use super::*;

/// Whether a subscription that ended so is followed to wherever its shard is served now: a
/// move or a fail-over (its broker said so, or went away), or a retryable refusal.
pub(crate) fn follows(reason: &EndReason) -> bool {
    match reason {
        EndReason::Moved(_) | EndReason::ConnectionLost(_) | EndReason::Finished | EndReason::Reset => true,
        EndReason::Error(e) => {
            matches!(e.retry, Some(RetryClass::Retry | RetryClass::RetryAfter | RetryClass::Redirect))
        }
        _ => false,
    }
}

pub(crate) fn ended(reason: &EndReason) -> String {
    match reason {
        EndReason::Moved(m) => format!("moved (to {})", m.node_id.as_deref().unwrap_or("a broker being chosen")),
        EndReason::ConnectionLost(why) => format!("lost its connection ({why})"),
        EndReason::Error(e) => format!("ended: {}", e.message),
        _ => "ended by the broker".into(),
    }
}
