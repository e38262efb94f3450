//! Stalls said in the log: a turn of the broker task over [`SLOW_TURN`], naming what it handled,
//! and a runtime that ran no timer for as long (a stopped process, a starved machine, a task
//! that blocks a worker). A peer that hears nothing for its idle timeout drops the link, so
//! these are what to look for when elections follow a quiet spell.

use super::Input;

/// One turn of the broker task longer than this is said: the task holds every connection's
/// and peer's work meanwhile, and a peer that hears nothing for its idle timeout (2 s) drops
/// the link.
pub(super) const SLOW_TURN: std::time::Duration = std::time::Duration::from_millis(250);

/// Says a turn of the broker task that took longer than [`SLOW_TURN`]; when it ended.
pub(super) fn slow_turn(began: std::time::Instant, what: &str) -> std::time::Instant {
    let ended = std::time::Instant::now();
    let took = ended.saturating_duration_since(began);
    if took > SLOW_TURN {
        tracing::warn!("the broker task spent {} ms {what}", took.as_millis());
    }
    ended
}

/// Says when the runtime ran nothing for a while (a stopped process, a starved machine, a task
/// that blocks a worker): a timer due every 100 ms that fired this much late.
pub(super) async fn stall_watch() {
    let every = std::time::Duration::from_millis(100);
    loop {
        let before = std::time::Instant::now();
        tokio::time::sleep(every).await;
        let late = before.elapsed().saturating_sub(every);
        if late > SLOW_TURN {
            tracing::warn!("the runtime ran no timer for {} ms (stopped, starved or blocked)", late.as_millis());
        }
    }
}

impl Input {
    /// What it is, for the log.
    pub(super) fn kind(&self) -> &'static str {
        use crate::cluster::PeerInput;
        use felix_proto::cluster::peer::PeerMessage as M;
        match self {
            Input::Incoming(_) | Input::Connected(..) | Input::HandshakeFailed(_) => "handling a connection",
            Input::Stream { .. } | Input::Opened { .. } | Input::Reset { .. } | Input::Stopped { .. } => {
                "handling a stream's event"
            }
            Input::Data { .. } => "handling a client's bytes",
            Input::Flushed { .. } => "handling flushed bytes",
            Input::Written(..) | Input::StreamRecorded(..) => "handling written records",
            Input::ReadDone(..) => "handling records read",
            Input::Closed { .. } | Input::StreamEnded { .. } => "handling a closed connection",
            Input::Metrics(_) => "answering the metrics",
            Input::ClusterStatus(..) | Input::WebView(..) => "answering the status",
            Input::ClusterAdmin(..) => "answering an operator",
            Input::SetJwt(_) | Input::SetIdentity(..) => "reloading credentials",
            Input::Drain { .. } => "beginning a drain",
            Input::ReplicaSynced { .. } => "handling a replica log's sync",
            Input::ReplicaLogRead { .. } => "handling a replica log's read",
            Input::ReplicaSnapshotPiece { .. } => "handling a snapshot's piece",
            Input::Peer(PeerInput::Message { message, .. }) => match message {
                M::Hello { .. } => "handling a peer's hello",
                M::Raft(_) | M::Propose(_) => "handling a metadata message",
                M::ShardRaft(_) => "handling replicas' Raft messages",
                M::Heartbeats(_) => "handling replicas' heartbeats",
                M::SnapshotChunk(_) => "handling a snapshot chunk",
                M::CopyRequest(_) | M::CopyAnswer(_) => "handling a move's copy",
                M::Forward(_) | M::ForwardBatch(_) | M::ForwardAnswer { .. } | M::ForwardAnswers(_) => {
                    "handling forwarded publishes"
                }
                M::Request(_) | M::RequestAnswer { .. } => "handling a forwarded request",
            },
            Input::Peer(PeerInput::Undeliverable(_)) => "handling an undeliverable peer message",
            Input::Peer(PeerInput::Lost(_)) => "handling a lost peer",
            Input::Peer(PeerInput::ChunkWritten { .. }) => "handling a written chunk",
        }
    }
}
