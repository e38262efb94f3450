//! The client over QUIC: an async API around the `ClientConnection` state machine.
//!
//! One task owns the state machine and the QUIC connection and takes no protocol decision: which
//! stream a request goes on, what the broker may be sent, windows, queues, timeouts, the order of
//! a subscription's events, when to pause an event stream, all of that is
//! [`ClientConnection`]'s. The task turns [`Client`] calls into its commands, its outputs into
//! QUIC operations, and its events into the answers the calls await: a map from ids to replies.

use crate::tls::{AlpnOffer, TlsError, Trust, client_config_with, dial};
use crate::{ReadEvent, ReadGate};
use bytes::Bytes;
use felix_proto::binary::EventBatch;
use felix_proto::client::{
    self as core, CacheWatchRequest, ClientConfig, ClientConnection, ClientEvent, ClientOutput, CommandError,
    EndReason, ErrorInfo, PublishId, PublishRequest, StreamReadRequest, SubscribeRequest, WatchOn,
};
use felix_proto::error_code::{ErrorCode, RetryClass};
use felix_proto::message::{
    self, B64, CacheCondition, CursorErrorReason, Message, RefusedReason, Routing, StartPosition, StreamRecord,
    SubscribeCursorError,
};
use felix_proto::negotiate::Negotiated;
use felix_proto::transport::{OpenToken, StreamId};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot, watch};

mod requests;
mod task;
use task::*;

/// How to reach and authenticate to a broker.
#[derive(Debug, Clone)]
pub struct ClientOptions {
    /// What to offer and how to authenticate.
    pub config: ClientConfig,
    /// How to trust the broker's certificate.
    pub trust: Trust,
    /// The name the certificate must hold (existing Felix peers use `localhost`).
    pub server_name: String,
    /// Which ALPN id to offer ([`AlpnOffer::Auto`]: `felix/1`, then none if the broker refuses
    /// it, so both released brokers, which know no ALPN, and current ones are reached).
    pub alpn: AlpnOffer,
    /// QUIC settings.
    pub transport: crate::server::TransportTuning,
    /// Event bytes one subscription may hold for the application before the client stops
    /// reading its event stream (and reads again below half of it).
    pub subscription_buffer_bytes: usize,
    /// How long [`Client::close`] waits for the broker to acknowledge everything written.
    pub close_timeout: std::time::Duration,
    /// A client certificate and key to present when the broker asks for one (mutual TLS):
    /// with it, an empty token authenticates as what the broker maps the certificate to.
    pub client_cert: Option<Arc<crate::tls::Identity>>,
    /// Refresh the token before it expires ([`TokenRefresh`]); `None`: the token is used as
    /// long as the connection lives.
    pub token_refresh: Option<TokenRefresh>,
    /// Give the connection up when the broker sent nothing at all for this long (default 2 s):
    /// what is waiting for an answer ends outcome unknown and subscriptions end, as on a lost
    /// connection, so a client of a broker that died (SIGKILL, a host gone: no close reaches
    /// it) fails over in seconds instead of waiting out QUIC's idle timeout (30 s). The client
    /// sends keep-alives at a quarter of it, which a live broker acknowledges within its ACK
    /// delay however busy its application is. `None`: only the idle timeout ends it.
    pub unresponsive_after: Option<std::time::Duration>,
}

impl ClientOptions {
    /// Options for `tenant` with `token`, trusting `trust`.
    pub fn new(tenant: impl Into<String>, token: impl Into<String>, trust: Trust) -> ClientOptions {
        ClientOptions {
            config: ClientConfig::new(tenant, token),
            trust,
            server_name: "localhost".into(),
            alpn: AlpnOffer::Auto,
            transport: crate::server::TransportTuning::default(),
            subscription_buffer_bytes: 64 << 20,
            close_timeout: std::time::Duration::from_secs(10),
            client_cert: None,
            token_refresh: None,
            unresponsive_after: Some(DEFAULT_UNRESPONSIVE_AFTER),
        }
    }
}

/// A connection's QUIC counters ([`Client::quic_counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuicCounts {
    /// UDP datagrams sent.
    pub datagrams_sent: u64,
    /// UDP datagrams received.
    pub datagrams_received: u64,
    /// Send system calls (fewer than datagrams with segmentation offload).
    pub send_calls: u64,
    /// Receive system calls (fewer than datagrams with batched receives or GRO).
    pub receive_calls: u64,
    /// ACK frames sent.
    pub acks_sent: u64,
    /// ACK frames received.
    pub acks_received: u64,
    /// UDP payload bytes sent (QUIC packets: headers, frames, encryption overhead included).
    pub bytes_sent: u64,
    /// UDP payload bytes received.
    pub bytes_received: u64,
}

impl std::ops::AddAssign for QuicCounts {
    fn add_assign(&mut self, o: QuicCounts) {
        self.datagrams_sent += o.datagrams_sent;
        self.datagrams_received += o.datagrams_received;
        self.send_calls += o.send_calls;
        self.receive_calls += o.receive_calls;
        self.acks_sent += o.acks_sent;
        self.acks_received += o.acks_received;
        self.bytes_sent += o.bytes_sent;
        self.bytes_received += o.bytes_received;
    }
}

/// The default [`ClientOptions::unresponsive_after`].
pub const DEFAULT_UNRESPONSIVE_AFTER: std::time::Duration = std::time::Duration::from_secs(2);

/// QUIC application error code of a connection the client gave up because the broker went
/// silent.
const UNRESPONSIVE_CODE: u32 = 0x10;

/// Watches a connection for a broker that went silent (nothing arrived for `after`, see
/// [`crate::liveness`]): the connection is then closed with that reason.
async fn watch_liveness(quic: quinn::Connection, after: std::time::Duration, tx: mpsc::UnboundedSender<Input>) {
    if let Some(silent) = crate::liveness::silence(&quic, after).await {
        let why = format!("the broker sent nothing for {:.1} s (unresponsive)", silent.as_secs_f64());
        let _ = tx.send(Input::Closed(why));
        quic.close(quinn::VarInt::from_u32(UNRESPONSIVE_CODE), b"broker unresponsive");
    }
}

/// Why a client operation failed.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// Could not connect (address, handshake, certificate).
    #[error("connecting: {0}")]
    Connect(String),
    /// TLS setup failed.
    #[error("TLS: {0}")]
    Tls(String),
    /// The broker refused the request.
    #[error("{}{}", .0.message, .0.code.as_ref().map(|c| format!(" ({c})")).unwrap_or_default())]
    Refused(ErrorInfo),
    /// The offset asked for is outside what the shard retains (`subscribe_cursor_error`):
    /// `available` is the oldest retained offset (too old) or the tail (in the future).
    #[error("offset {} is {}: available {}", .0.requested, match .0.reason { CursorErrorReason::TooOld => "too old", CursorErrorReason::InFuture => "past the tail" }, .0.available)]
    Cursor(SubscribeCursorError),
    /// An idempotent or conditional publish was refused with a typed reason; nothing was
    /// written (`offset_mismatch` carries the tail to resume from).
    #[error("publish refused ({reason:?}): {message}")]
    PublishRefused {
        /// Why.
        reason: RefusedReason,
        /// Prose.
        message: String,
    },
    /// Another broker of the cluster owns the shard (`not_leader`): ask it (`addr`, when the
    /// broker knows it) instead. A redirect naming an older generation than one already
    /// followed is stale.
    #[error("shard owned by {node_id}{} (not_leader, generation {generation})", .addr.as_ref().map(|a| format!(" at {a}")).unwrap_or_default())]
    NotLeader {
        /// The owner's node id.
        node_id: String,
        /// Its client address.
        addr: Option<String>,
        /// The ownership generation the answer describes.
        generation: u64,
    },
    /// The broker does not offer what the request needs.
    #[error("the broker does not support this: {0}")]
    Unsupported(String),
    /// The connection is gone, or a request cannot be answered any more (`retry` tells whether
    /// it may have been carried out).
    #[error("connection closed: {0}")]
    Closed(String),
    /// The request cannot be sent as asked (a name or value too long for its field): a
    /// programming or input error, never worth a retry.
    #[error("invalid request: {0}")]
    Invalid(String),
    /// [`Client::close`]: the broker did not acknowledge receiving everything this client wrote
    /// (within `close_timeout`, or the connection was lost first). Up to `publishes`
    /// fire-and-forget publishes (`bytes` bytes written on the streams concerned) may not have
    /// reached it.
    #[error(
        "the broker did not confirm receipt of up to {publishes} unacknowledged publish(es) ({bytes} bytes): {reason}"
    )]
    Unconfirmed {
        /// Fire-and-forget publishes written on streams whose data was not acknowledged.
        publishes: u64,
        /// Bytes written on those streams.
        bytes: u64,
        /// Why (timed out, connection lost, stream stopped).
        reason: String,
    },
}

impl ClientError {
    /// The protocol error code, when the broker sent one.
    pub fn code(&self) -> Option<&ErrorCode> {
        match self {
            ClientError::Refused(e) => e.code.as_ref(),
            _ => None,
        }
    }
    /// The retry class, when the broker sent one.
    pub fn retry(&self) -> Option<RetryClass> {
        match self {
            ClientError::Refused(e) => e.retry,
            _ => None,
        }
    }
}

impl From<TlsError> for ClientError {
    fn from(e: TlsError) -> ClientError {
        ClientError::Tls(e.to_string())
    }
}

/// A publish's options.
#[derive(Debug, Clone, Default)]
pub struct PublishOptions {
    /// Routing key.
    pub key: Option<Bytes>,
    /// Wait for the broker's acknowledgement.
    pub ack: bool,
    /// Use the JSON encoding even when binary is available.
    pub json: bool,
    /// An envelope sent with the batch (D58): end-to-end encryption's key id and algorithm
    /// ([`crate::envelope::KeyRing::seal`]), opaque to the broker.
    pub envelope: Option<Bytes>,
}

/// What a subscription yields.
#[derive(Debug, Clone, PartialEq)]
pub enum SubscriptionItem {
    /// A batch of events.
    Events(EventBatch),
    /// A change on a cache watch.
    CacheChange(felix_proto::message::CacheEvent),
    /// The subscription ended.
    End(EndReason),
}

/// A live subscription. It lives as long as its [`Client`]: dropping every handle of the
/// client closes the connection, which ends the subscription.
#[derive(Debug)]
pub struct Subscription {
    /// Its id.
    pub id: u64,
    /// First offset it delivers (durable streams, offsets negotiated).
    pub start_offset: Option<u64>,
    /// Tail at join.
    pub live_offset: Option<u64>,
    rx: ItemRx,
}

impl Subscription {
    /// The next batch or the end; `None` once the connection is gone.
    pub async fn next(&mut self) -> Option<SubscriptionItem> {
        self.rx.next().await
    }
}

/// The application's end of a subscription's (or watch's) channel. Each item taken is reported
/// to the state machine, which paused the event stream if the application fell behind and reads
/// it again once it caught up (QUIC flow control holds the broker meanwhile).
#[derive(Debug)]
struct ItemRx {
    sub: u64,
    rx: mpsc::UnboundedReceiver<(SubscriptionItem, usize)>,
    task: mpsc::UnboundedSender<Input>,
}

impl ItemRx {
    async fn next(&mut self) -> Option<SubscriptionItem> {
        let (item, bytes) = self.rx.recv().await?;
        if bytes > 0 {
            let _ = self.task.send(Input::Consumed(self.sub, bytes));
        }
        Some(item)
    }
}

pub(crate) type Reply<T> = oneshot::Sender<Result<T, ClientError>>;

/// A live cache watch: its changes in cache-log order.
#[derive(Debug)]
pub struct CacheWatch {
    /// Its id.
    pub id: u64,
    /// Live delivery begins at this offset (what came before was replayed or snapshotted).
    pub resume_offset: u64,
    /// The history asked for was compacted: the watch began with current values instead.
    pub resnapshot: bool,
    /// With `retained`: how many current values precede live changes.
    pub retained_count: Option<u64>,
    rx: ItemRx,
}

impl CacheWatch {
    /// The next change, or the end (`SubscriptionItem::End`); `None` once the connection is
    /// gone.
    pub async fn next(&mut self) -> Option<SubscriptionItem> {
        self.rx.next().await
    }
}

/// A request built around the request id the state machine gives it (with the tenant).
pub(crate) type Build = Box<dyn FnOnce(String, u64) -> Message + Send>;

pub(crate) enum Cmd {
    /// Finish every send stream and report once the broker acknowledged their data.
    Close {
        reply: Reply<()>,
    },
    Publish {
        req: PublishRequest,
        reply: Reply<Option<u64>>,
    },
    Request {
        build: Build,
        reply: Reply<core::Reply>,
    },
    Subscribe {
        req: SubscribeRequest,
        reply: Reply<Subscription>,
    },
    Watch {
        req: CacheWatchRequest,
        reply: Reply<CacheWatch>,
    },
    /// A refreshed token: new control streams authenticate with it.
    SetToken(String),
}

/// Where a client gets a fresh token before the one it holds expires: a callback the embedder
/// supplies (it may ask an identity service; it runs on a blocking thread). The client calls it
/// at 80% of a signed token's lifetime (from its unverified `iat`/`exp` claims), or every
/// [`every`](Self::every) for opaque tokens, and moves new work to a control stream
/// authenticated with the answer ([`Client::set_token`]). A failed call is retried every second
/// until the old token expires.
#[derive(Clone)]
pub struct TokenRefresh {
    fetch: Arc<dyn Fn() -> Result<String, String> + Send + Sync>,
    every: Option<std::time::Duration>,
}

impl std::fmt::Debug for TokenRefresh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenRefresh").field("every", &self.every).finish_non_exhaustive()
    }
}

impl TokenRefresh {
    /// Refreshes signed tokens at 80% of their lifetime with `fetch`.
    pub fn new(fetch: impl Fn() -> Result<String, String> + Send + Sync + 'static) -> TokenRefresh {
        TokenRefresh { fetch: Arc::new(fetch), every: None }
    }

    /// Refreshes every `period` instead (for tokens whose lifetime the client cannot read).
    #[must_use]
    pub fn every(mut self, period: std::time::Duration) -> TokenRefresh {
        self.every = Some(period);
        self
    }

    /// How long to wait before refreshing `token` at wall time `now_secs`; `None`: never.
    fn delay(&self, token: &str, now_secs: u64) -> Option<std::time::Duration> {
        if let Some(p) = self.every {
            return Some(p);
        }
        let (iat, exp) = felix_proto::jwt::Verifier::unverified_lifetime(token)?;
        let at = iat + exp.saturating_sub(iat) * 4 / 5;
        Some(std::time::Duration::from_secs(at.saturating_sub(now_secs)))
    }

    /// Calls the embedder's callback and hands each fresh token to the client, until the
    /// connection is gone.
    async fn run(self, mut token: String, tx: mpsc::UnboundedSender<Input>) {
        let wall = || std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        loop {
            let Some(wait) = self.delay(&token, wall()) else { return };
            tokio::time::sleep(wait).await;
            let fresh = loop {
                if tx.is_closed() {
                    return;
                }
                let fetch = self.fetch.clone();
                match tokio::task::spawn_blocking(move || fetch()).await {
                    Ok(Ok(t)) => break t,
                    Ok(Err(e)) => tracing::warn!("refreshing the token failed: {e}; trying again in 1 s"),
                    Err(e) => tracing::warn!("the token refresh callback panicked: {e}; trying again in 1 s"),
                }
                tokio::time::sleep(std::time::Duration::from_secs(1)).await;
            };
            if tx.send(Input::Cmd(Cmd::SetToken(fresh.clone()))).is_err() {
                return;
            }
            token = fresh;
        }
    }
}

/// A page of a durable shard read with [`Client::stream_read`].
#[derive(Debug, Clone, PartialEq)]
pub struct Page {
    /// The records, in offset order (each with its offset, payload, publisher, append time).
    pub records: Vec<StreamRecord>,
    /// Where the next page starts. An empty page whose `next_offset` equals the `from` asked
    /// for means nothing is committed there yet.
    pub next_offset: u64,
}

enum Input {
    Cmd(Cmd),
    OpenedBi {
        token: OpenToken,
        send: quinn::SendStream,
        recv: quinn::RecvStream,
    },
    IncomingUni(quinn::RecvStream),
    Data {
        stream: StreamId,
        data: Vec<Bytes>,
        fin: bool,
    },
    Reset(StreamId),
    /// The application took this many bytes of a subscription's events.
    Consumed(u64, usize),
    Closed(String),
}

/// A connection to a broker. Clones share the connection; when the last one is dropped the
/// connection is closed as [`Client::close`] does, as far as the runtime lets it.
#[derive(Debug, Clone)]
pub struct Client {
    tx: mpsc::UnboundedSender<Input>,
    negotiated: Negotiated,
    closed: watch::Receiver<Option<String>>,
    quic: quinn::Connection,
    _close_on_drop: Arc<CloseOnDrop>,
}

/// Closes the connection when the last [`Client`] handle goes away: as [`Client::close`] does
/// (every stream finished, the broker's acknowledgement awaited, bounded), as far as a drop can,
/// which is as long as the runtime keeps running the connection's task.
#[derive(Debug)]
struct CloseOnDrop(mpsc::UnboundedSender<Input>);

impl Drop for CloseOnDrop {
    fn drop(&mut self) {
        let (reply, _) = oneshot::channel();
        let _ = self.0.send(Input::Cmd(Cmd::Close { reply }));
    }
}

fn unexpected(r: &core::Reply) -> ClientError {
    ClientError::Closed(format!("unexpected answer {r:?}"))
}

impl Client {
    /// Connects and authenticates.
    ///
    /// # Errors
    /// Connection, TLS or authentication failures, each with what the broker said.
    pub async fn connect(addr: SocketAddr, opts: ClientOptions) -> Result<Client, ClientError> {
        let mut tuning = opts.transport.clone();
        if let Some(after) = opts.unresponsive_after {
            // Keep-alives often enough that a live broker is heard several times per period.
            tuning.keep_alive = tuning.keep_alive.min(after / 4);
        }
        let transport = Arc::new(tuning.to_quinn_for(addr));
        let quic_config = |offer_alpn: bool| -> Result<quinn::ClientConfig, String> {
            let tls = client_config_with(opts.trust.clone(), offer_alpn, opts.client_cert.as_deref())
                .map_err(|e| e.to_string())?;
            let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
            let mut qcfg = quinn::ClientConfig::new(Arc::new(crypto));
            qcfg.transport_config(transport.clone());
            Ok(qcfg)
        };
        // The configuration is known to build before any packet is sent.
        quic_config(false).map_err(ClientError::Tls)?;
        let bind: SocketAddr = if addr.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().expect("valid literal");
        let socket =
            crate::server::udp_socket(bind, &opts.transport).map_err(|e| ClientError::Connect(e.to_string()))?;
        let endpoint =
            quinn::Endpoint::new(opts.transport.endpoint_config(), None, socket, Arc::new(quinn::TokioRuntime))
                .map_err(|e| ClientError::Connect(e.to_string()))?;
        let quic =
            dial(&endpoint, addr, &opts.server_name, opts.alpn, quic_config).await.map_err(ClientError::Connect)?;
        let mut config = opts.config.clone();
        config.subscription_buffer_bytes = opts.subscription_buffer_bytes.max(1);
        let machine = ClientConnection::new(config, now());
        let (tx, rx) = mpsc::unbounded_channel();
        let (ready_tx, ready_rx) = oneshot::channel();
        let (closed_tx, closed_rx) = watch::channel(None);
        let task = Task {
            tenant: opts.config.tenant_id.clone(),
            machine,
            quic: quic.clone(),
            tx: tx.clone(),
            writers: HashMap::new(),
            gates: HashMap::new(),
            ready: Some(ready_tx),
            publishes: HashMap::new(),
            written: Vec::new(),
            requests: HashMap::new(),
            subs: HashMap::new(),
            sub_replies: HashMap::new(),
            watch_replies: HashMap::new(),
            closed: closed_tx,
            endpoint,
            close_timeout: opts.close_timeout,
            closing: false,
            written_totals: HashMap::new(),
            closing_fins: None,
        };
        tokio::spawn(accept_uni(quic.clone(), tx.clone()));
        if let Some(after) = opts.unresponsive_after {
            tokio::spawn(watch_liveness(quic.clone(), after, tx.clone()));
        }
        tokio::spawn(task.run(rx));
        if let Some(r) = opts.token_refresh.clone() {
            tokio::spawn(r.run(opts.config.token.clone(), tx.clone()));
        }
        let negotiated = ready_rx.await.map_err(|_| ClientError::Closed("connection task ended".into()))??;
        let guard = Arc::new(CloseOnDrop(tx.clone()));
        Ok(Client { tx, negotiated, closed: closed_rx, quic, _close_on_drop: guard })
    }

    /// Replaces the token: the control streams requests go on are replaced by ones
    /// authenticated with `token` (what was sent on the old ones is still answered there), so a
    /// long-lived client keeps working past its old token's expiry. Subscriptions and watches
    /// already open stay on the token they were opened with (the broker ends them `revoked`
    /// when it expires). [`TokenRefresh`] calls this for you.
    ///
    /// # Errors
    /// [`ClientError::Closed`] when the connection is gone.
    pub fn set_token(&self, token: impl Into<String>) -> Result<(), ClientError> {
        self.tx.send(Input::Cmd(Cmd::SetToken(token.into()))).map_err(|_| self.closed_error())
    }

    /// Whether the connection is gone (a new one is needed).
    pub fn is_closed(&self) -> bool {
        self.closed.borrow().is_some() || self.quic.close_reason().is_some()
    }

    /// What this connection's QUIC layer has sent and received so far (datagrams, system calls,
    /// ACK frames): what a record costs on the wire, counted from the client's side.
    pub fn quic_counts(&self) -> QuicCounts {
        let s = self.quic.stats();
        QuicCounts {
            bytes_sent: s.udp_tx.bytes,
            bytes_received: s.udp_rx.bytes,
            datagrams_sent: s.udp_tx.datagrams,
            datagrams_received: s.udp_rx.datagrams,
            send_calls: s.udp_tx.ios,
            receive_calls: s.udp_rx.ios,
            acks_sent: s.frame_tx.acks,
            acks_received: s.frame_rx.acks,
        }
    }

    /// The broker's address.
    pub fn remote_address(&self) -> SocketAddr {
        self.quic.remote_address()
    }

    /// What was negotiated with the broker.
    pub fn negotiated(&self) -> &Negotiated {
        &self.negotiated
    }

    /// The largest UDP payload this side currently sends on the connection (its path MTU, as
    /// MTU discovery found it).
    pub fn path_mtu(&self) -> u16 {
        self.quic.stats().path.current_mtu
    }

    pub(crate) async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Cmd) -> Result<T, ClientError> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Input::Cmd(make(reply))).map_err(|_| self.closed_error())?;
        rx.await.map_err(|_| self.closed_error())?
    }

    /// Sends a request (the state machine picks its stream and checks what it needs) and awaits
    /// its typed answer.
    pub(crate) async fn request(
        &self,
        build: impl FnOnce(String, u64) -> Message + Send + 'static,
    ) -> Result<core::Reply, ClientError> {
        self.call(|reply| Cmd::Request { build: Box::new(build), reply }).await
    }

    fn closed_error(&self) -> ClientError {
        ClientError::Closed(self.closed.borrow().clone().unwrap_or_else(|| "connection task ended".into()))
    }
}

fn condition_result(r: core::Reply) -> Result<(bool, Option<u64>), ClientError> {
    match r {
        core::Reply::CacheCondition { applied, version } => Ok((applied, version)),
        other => Err(unexpected(&other)),
    }
}
