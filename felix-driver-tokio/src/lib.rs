//! felix-driver-tokio: runs the `felix-proto` state machines over QUIC (quinn, TLS 1.3 via
//! rustls) on tokio, with durable streams on disk.
//!
//! The driver makes no protocol decision. It moves bytes between QUIC streams and the state
//! machines, turns their outputs into writes, stream opens, flow-control pauses and disk
//! appends, and passes tokio's clock in as `now`.

pub mod client;
pub mod cluster;
pub mod cluster_client;
pub mod envelope;
pub mod following;
pub mod groups;
mod liveness;
mod peer_links;
pub mod producer;
mod queue;
pub mod server;
/// Durable stream shards on disk (shared with every driver: [`felix_driver_common::storage`]).
pub use felix_driver_common::storage;
#[cfg(feature = "testkit")]
pub mod testkit;
pub mod tls;
mod web;

pub use client::{
    CacheWatch, Client, ClientError, ClientOptions, Page, PublishOptions, QuicCounts, Subscription, SubscriptionItem,
    TokenRefresh,
};
pub use cluster_client::ClusterClient;
pub use following::Following;
pub use groups::{GroupInfo, GroupTarget, PollOptions};
pub use producer::{IdempotentProducer, RetryPolicy};
pub use server::{
    DEFAULT_MAX_UDP_PAYLOAD, GSO_SAFE_MAX_UDP_PAYLOAD, Server, ServerError, ServerOptions, TransportTuning, is_loopback,
};
pub use storage::FsyncMode;
pub use tls::{Identity, Trust};

/// The felix stream id of a quinn stream (both use QUIC's own numbering).
pub(crate) fn stream_id(id: quinn::StreamId) -> felix_proto::transport::StreamId {
    use felix_proto::transport::{Dir, Side, StreamId};
    let side = match id.initiator() {
        quinn::Side::Client => Side::Client,
        quinn::Side::Server => Side::Broker,
    };
    let dir = match id.dir() {
        quinn::Dir::Bi => Dir::Bi,
        quinn::Dir::Uni => Dir::Uni,
    };
    StreamId::new(side, dir, id.index())
}

/// What a stream's reader may do: read, wait (QUIC flow control then holds the peer), or stop
/// the stream with a code.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum ReadGate {
    Open,
    Paused,
    Stopped(u64),
}

/// What a gated reader saw.
pub(crate) enum ReadEvent {
    /// Chunks, in order (never empty).
    Chunks(Vec<bytes::Bytes>),
    /// The peer finished the stream.
    Finished,
    /// The peer reset it.
    Reset,
    /// The connection failed.
    Failed,
}

/// Reads `recv` while `gate` allows, handing what it sees to `deliver` until that returns
/// `false` or the stream ends. Broker and client readers are this loop with their own inputs.
pub(crate) async fn read_gated(
    mut recv: quinn::RecvStream,
    mut gate: tokio::sync::watch::Receiver<ReadGate>,
    mut deliver: impl FnMut(ReadEvent) -> bool,
) {
    let mut chunks = ChunkReader::new();
    loop {
        let state = match gate.wait_for(|g| *g != ReadGate::Paused).await {
            Ok(g) => *g,
            Err(_) => return,
        };
        if let ReadGate::Stopped(code) = state {
            let _ = recv.stop(quinn::VarInt::from_u64(code).unwrap_or(quinn::VarInt::from_u32(0)));
            return;
        }
        let event = tokio::select! {
            r = chunks.read(&mut recv) => match r {
                Ok(Some(data)) => ReadEvent::Chunks(data),
                Ok(None) => ReadEvent::Finished,
                Err(quinn::ReadError::Reset(_)) => ReadEvent::Reset,
                Err(_) => ReadEvent::Failed,
            },
            // A pause or stop while a read is pending: the read is cancel-safe.
            changed = gate.changed() => if changed.is_err() { return } else { continue },
        };
        let more = matches!(event, ReadEvent::Chunks(_));
        if !deliver(event) || !more {
            return;
        }
    }
}

/// Chunks taken from a stream in one read: every chunk quinn already holds (up to 32), so a busy
/// stream costs one channel message and one wake-up of the state machine's task per batch of
/// packets rather than per packet.
///
/// While it waits (most of a stream's life: a control stream between requests) it holds no
/// buffer: it waits for the first chunk alone, then takes what else quinn holds at once into
/// an array that lives only for that moment. Before, the 32 slots (1 KB) sat in every reader
/// task, a fifth of what an idle connection cost Felix beside quinn.
pub(crate) struct ChunkReader {
    /// What the stream said after chunks that were delivered (its end, or an error): the next
    /// read's answer.
    held: Option<Result<(), quinn::ReadError>>,
}

/// Chunks taken at once after the first.
const MORE_CHUNKS: usize = 31;

impl ChunkReader {
    pub(crate) fn new() -> ChunkReader {
        ChunkReader { held: None }
    }

    /// The next chunks (never empty), `None` when the stream finished. Cancel-safe, as quinn's
    /// `read_chunk` is, and nothing is awaited after a chunk is taken.
    pub(crate) async fn read(
        &mut self,
        recv: &mut quinn::RecvStream,
    ) -> Result<Option<Vec<bytes::Bytes>>, quinn::ReadError> {
        if let Some(held) = self.held.take() {
            return held.map(|()| None);
        }
        let Some(first) = recv.read_chunk(usize::MAX, true).await? else { return Ok(None) };
        let mut out = vec![first.bytes];
        let held = &mut self.held;
        std::future::poll_fn(|cx| {
            let mut bufs: [bytes::Bytes; MORE_CHUNKS] = Default::default();
            let read = std::pin::pin!(recv.read_chunks(&mut bufs)).poll(cx);
            match read {
                std::task::Poll::Ready(Ok(Some(n))) => out.extend(bufs[..n].iter_mut().map(std::mem::take)),
                std::task::Poll::Ready(Ok(None)) => *held = Some(Ok(())),
                std::task::Poll::Ready(Err(e)) => *held = Some(Err(e)),
                // Nothing more yet: what came is delivered now (dropping a pending read is
                // cancel-safe).
                std::task::Poll::Pending => {}
            }
            std::task::Poll::Ready(())
        })
        .await;
        Ok(Some(out))
    }
}

/// Sleeps until a state machine's `poll_timeout`, or for ever when it has none: the timer arm
/// of every driver loop.
pub(crate) async fn sleep_until(deadline: Option<std::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(tokio::time::Instant::from_std(d)).await,
        None => std::future::pending().await,
    }
}
