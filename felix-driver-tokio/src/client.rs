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

/// Watches a connection for a broker that went silent: every eighth of `after` it reads how
/// many datagrams arrived; when none did for `after` *and* for eight checks in a row (so a
/// client process that was not scheduled for a while, and wakes to a full socket buffer, does
/// not mistake its own pause for the broker's), the connection is closed with that reason.
async fn watch_liveness(quic: quinn::Connection, after: std::time::Duration, tx: mpsc::UnboundedSender<Input>) {
    const CHECKS: u32 = 8;
    let mut tick = tokio::time::interval((after / CHECKS).max(std::time::Duration::from_millis(5)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last = quic.stats().udp_rx.datagrams;
    let mut heard = tokio::time::Instant::now();
    let mut silent = 0u32;
    loop {
        tokio::select! {
            _ = quic.closed() => return,
            _ = tick.tick() => {}
        }
        let rx = quic.stats().udp_rx.datagrams;
        if rx != last {
            (last, heard, silent) = (rx, tokio::time::Instant::now(), 0);
            continue;
        }
        silent += 1;
        if silent >= CHECKS && heard.elapsed() >= after {
            let why = format!("the broker sent nothing for {:.1} s (unresponsive)", heard.elapsed().as_secs_f64());
            let _ = tx.send(Input::Closed(why));
            quic.close(quinn::VarInt::from_u32(UNRESPONSIVE_CODE), b"broker unresponsive");
            return;
        }
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

    /// Publishes one batch of an idempotent producer (see [`crate::IdempotentProducer`], which
    /// keeps the sequences and retries): appended once however often it is sent. Returns the
    /// first record's offset (the original one for a duplicate) when the broker gives offsets.
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] with the sequence's problem; the broker's error; a
    /// closed connection (the outcome is then unknown: send again with the same sequence).
    pub async fn publish_idempotent(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        key: Option<Bytes>,
        producer_id: u64,
        sequence: u64,
    ) -> Result<Option<u64>, ClientError> {
        self.start_publish_idempotent(namespace, stream, payloads, key, producer_id, sequence).await
    }

    /// [`publish_idempotent`](Self::publish_idempotent), queued on the connection now (not
    /// when the returned future is first polled): batches started one after another go out in
    /// that order, which an idempotent producer needs (a batch that overtakes an earlier one
    /// of its shard is refused `sequence_gap`).
    pub fn start_publish_idempotent(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        key: Option<Bytes>,
        producer_id: u64,
        sequence: u64,
    ) -> impl std::future::Future<Output = Result<Option<u64>, ClientError>> + Send + 'static {
        let mut req = PublishRequest::new(namespace, stream, payloads);
        req.key = key;
        req.ack = true;
        req.idempotent = Some((producer_id, sequence));
        let (reply, rx) = oneshot::channel();
        let queued = self.tx.send(Input::Cmd(Cmd::Publish { req, reply })).is_ok();
        let me = self.clone();
        async move {
            if !queued {
                return Err(me.closed_error());
            }
            rx.await.map_err(|_| me.closed_error())?
        }
    }

    /// Appends a batch only if the shard's next offset is `expected_offset` (`publish_if`).
    /// Returns the offset it landed at (when the broker gives offsets).
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] with `offset_mismatch { tail }` when another write got
    /// there first; [`ClientError::Unsupported`] without FEATURE_PUBLISH_CONDITIONAL.
    pub async fn publish_if(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        key: Option<Bytes>,
        expected_offset: u64,
    ) -> Result<Option<u64>, ClientError> {
        let mut req = PublishRequest::new(namespace, stream, payloads);
        req.key = key;
        req.ack = true;
        req.expected_offset = Some(expected_offset);
        self.call(|reply| Cmd::Publish { req, reply }).await
    }

    /// A new producer id from the broker (FEATURE_IDEMPOTENT_PRODUCER).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn producer_init(&self) -> Result<u64, ClientError> {
        match self.request(|_, request_id| Message::ProducerInit(message::ProducerInit { request_id })).await? {
            core::Reply::ProducerId(id) => Ok(id),
            other => Err(unexpected(&other)),
        }
    }

    /// How many shards a stream has and how keys map to them.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_STREAM_SHARDS.
    pub async fn stream_shards(&self, namespace: &str, stream: &str) -> Result<(u32, Routing), ClientError> {
        let (namespace, stream) = (namespace.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamShards(message::StreamShards { tenant_id, namespace, stream, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamShards { shards, routing } => Ok((shards, routing)),
            other => Err(unexpected(&other)),
        }
    }

    /// Who owns each shard of a stream, in shard order (FEATURE_SHARD_OWNERS: a broker of a
    /// cluster). An empty list: the cluster does not know the stream.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker outside a cluster.
    pub async fn shard_owners(&self, namespace: &str, stream: &str) -> Result<Vec<message::ShardOwner>, ClientError> {
        let (namespace, name) = (namespace.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::ShardOwners(message::ShardOwners {
                    tenant_id,
                    namespace,
                    name,
                    kind: message::ShardKind::Stream,
                    request_id,
                })
            })
            .await?;
        match r {
            core::Reply::ShardOwners(owners) => Ok(owners),
            other => Err(unexpected(&other)),
        }
    }

    /// The broker's own view of one shard (FEATURE_INSPECT; the token must hold exactly
    /// `node.view:cluster:*`).
    ///
    /// # Errors
    /// `forbidden` for any other token; [`ClientError::Unsupported`] against a broker without
    /// the feature.
    pub async fn shard_inspect(
        &self,
        namespace: &str,
        name: &str,
        kind: message::ShardKind,
        shard: u32,
    ) -> Result<message::InspectView, ClientError> {
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::ShardInspect(message::ShardInspect { tenant_id, namespace, name, kind, shard, request_id })
            })
            .await?;
        match r {
            core::Reply::ShardInspect(v) => Ok(*v),
            other => Err(unexpected(&other)),
        }
    }

    /// One page of the subscriptions the broker serves (FEATURE_INSPECT, as
    /// [`shard_inspect`](Self::shard_inspect)).
    ///
    /// # Errors
    /// As [`shard_inspect`](Self::shard_inspect).
    pub async fn subscriptions_list(
        &self,
        filter: Option<message::SubscriptionFilter>,
        limit: Option<u32>,
        cursor: Option<message::SubscriptionCursor>,
    ) -> Result<message::SubscriptionsListInfo, ClientError> {
        let r = self
            .request(move |_, request_id| {
                Message::SubscriptionsList(message::SubscriptionsList { request_id, filter, limit, cursor })
            })
            .await?;
        match r {
            core::Reply::Subscriptions(l) => Ok(*l),
            other => Err(unexpected(&other)),
        }
    }

    /// Publishes a batch. With `ack`, waits for the broker and returns the first record's
    /// offset when the broker gave one; without, returns once the batch is handed to QUIC.
    ///
    /// # Errors
    /// The broker's refusal (with code and retry class), or a closed connection.
    pub async fn publish(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        opts: PublishOptions,
    ) -> Result<Option<u64>, ClientError> {
        let mut req = PublishRequest::new(namespace, stream, payloads);
        req.key = opts.key;
        req.envelope = opts.envelope;
        req.ack = opts.ack;
        req.json = opts.json;
        self.call(|reply| Cmd::Publish { req, reply }).await
    }

    /// Subscribes to one shard of a stream.
    ///
    /// # Errors
    /// The broker's refusal (a cursor error names what is available), or a closed connection.
    pub async fn subscribe(
        &self,
        namespace: &str,
        stream: &str,
        start: Option<StartPosition>,
        shard: Option<u32>,
    ) -> Result<Subscription, ClientError> {
        self.subscribe_filtered(namespace, stream, start, shard, None).await
    }

    /// [`subscribe`](Self::subscribe), delivering only the batches whose key `filter` matches
    /// (D57); the offsets passed over show as `skipped_before` and gaps.
    ///
    /// # Errors
    /// As [`subscribe`](Self::subscribe), and `NotNegotiated` from a broker that does not
    /// filter (a broker in a cluster, or an older one).
    pub async fn subscribe_filtered(
        &self,
        namespace: &str,
        stream: &str,
        start: Option<StartPosition>,
        shard: Option<u32>,
        filter: Option<felix_proto::message::KeyFilter>,
    ) -> Result<Subscription, ClientError> {
        let req = SubscribeRequest {
            filter,
            namespace: namespace.into(),
            stream: stream.into(),
            start,
            shard,
            queue_capacity: None,
        };
        self.call(|reply| Cmd::Subscribe { req, reply }).await
    }

    /// Stores a value (with an optional TTL in milliseconds).
    ///
    /// # Errors
    /// The broker's refusal, or a closed connection.
    pub async fn cache_put(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
    ) -> Result<(), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CachePut(message::CachePut {
                    tenant_id,
                    namespace,
                    cache,
                    key,
                    value: B64(value),
                    request_id: Some(request_id),
                    ttl_ms,
                })
            })
            .await?;
        match r {
            core::Reply::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a value; `None` on a miss or after expiry.
    ///
    /// # Errors
    /// The broker's refusal, or a closed connection.
    pub async fn cache_get(&self, ns: &str, cache: &str, key: &str) -> Result<Option<Bytes>, ClientError> {
        Ok(self.cache_get_versioned(ns, cache, key).await?.0)
    }

    /// A page of a cache's live keys in byte order (FEATURE_LISTING): those starting with
    /// `prefix`, after `after`, at most `limit` (the broker caps it at 1000); and the key to
    /// continue after when more follow.
    ///
    /// # Errors
    /// `not_found` for a cache that does not exist; [`ClientError::Unsupported`] against a
    /// broker without the feature.
    pub async fn cache_keys(
        &self,
        ns: &str,
        cache: &str,
        prefix: Option<&str>,
        after: Option<&str>,
        limit: Option<u32>,
    ) -> Result<(Vec<String>, Option<String>), ClientError> {
        let (namespace, cache) = (ns.to_owned(), cache.to_owned());
        let (prefix, after) = (prefix.map(str::to_owned), after.map(str::to_owned));
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheKeys(message::CacheKeys { tenant_id, namespace, cache, prefix, after, limit, request_id })
            })
            .await?;
        match r {
            core::Reply::CacheKeys { keys, next } => Ok((keys, next)),
            other => Err(unexpected(&other)),
        }
    }

    /// A page of the tenant's streams this token may publish to or read (FEATURE_STREAM_INFO),
    /// in `namespace/stream` order: `namespace` narrows it, `after` is the previous page's
    /// `next`. Any broker of a cluster lists every stream of the cluster.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn stream_list(
        &self,
        namespace: Option<&str>,
        after: Option<&str>,
        limit: Option<u32>,
    ) -> Result<(Vec<message::StreamEntry>, Option<String>), ClientError> {
        let (namespace, after) = (namespace.map(str::to_owned), after.map(str::to_owned));
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamList(message::StreamList { tenant_id, namespace, after, limit, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamList { streams, next } => Ok((streams, next)),
            other => Err(unexpected(&other)),
        }
    }

    /// The cluster as this broker sees it (FEATURE_CLUSTER_ADMIN, D52): the document `GET
    /// /cluster` serves on the metrics listener, limited to the token's tenant unless the
    /// token holds `node.view:cluster:*`; `{"cluster": false}` from a broker that runs alone.
    ///
    /// # Errors
    /// `forbidden` without the admin permission on the whole tenant;
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn cluster_status(&self) -> Result<serde_json::Value, ClientError> {
        let r = self
            .request(move |_, request_id| {
                Message::ClusterStatus(message::ClusterStatus { after: None, limit: None, request_id })
            })
            .await?;
        match r {
            core::Reply::ClusterStatus(v) => Ok(*v),
            other => Err(unexpected(&other)),
        }
    }

    /// One page of [`Client::cluster_status`] (FEATURE_STATUS_PAGES, D55): the shards after
    /// `after` (the `next` of the page before; `None`: from the first), `limit` of them with
    /// an owner (at most 5,000), and every list about them; the document's `next` is the next
    /// page's `after` when more follow. Paging through shows each shard once.
    ///
    /// # Errors
    /// As [`Client::cluster_status`]; [`ClientError::Unsupported`] against a broker without
    /// pages (ask it for the whole status); `invalid_request` for an `after` no page gave.
    pub async fn cluster_status_page(&self, after: Option<&str>, limit: u32) -> Result<serde_json::Value, ClientError> {
        let after = after.map(str::to_owned);
        let r = self
            .request(move |_, request_id| {
                Message::ClusterStatus(message::ClusterStatus { after, limit: Some(limit), request_id })
            })
            .await?;
        match r {
            core::Reply::ClusterStatus(v) => Ok(*v),
            other => Err(unexpected(&other)),
        }
    }

    /// Moves one shard of a stream to broker `to`, or (`to` absent) gives its move up
    /// (FEATURE_CLUSTER_ADMIN, D52); what was proposed. The move's progress shows in
    /// [`Client::cluster_status`]'s `moves`.
    ///
    /// # Errors
    /// `forbidden` without the admin permission on the stream; `invalid_request` with the
    /// metadata's reason (no such shard, not a member, already there, not moving).
    pub async fn shard_move(
        &self,
        ns: &str,
        stream: &str,
        shard: u32,
        to: Option<&str>,
    ) -> Result<String, ClientError> {
        let (namespace, stream, to) = (ns.to_owned(), stream.to_owned(), to.map(str::to_owned));
        let r = self
            .request(move |tenant_id, request_id| {
                let cancel = to.is_none();
                Message::ShardMove(message::ShardMove { tenant_id, namespace, stream, shard, to, cancel, request_id })
            })
            .await?;
        match r {
            core::Reply::ShardMoveProposed(what) => Ok(what),
            other => Err(unexpected(&other)),
        }
    }

    /// One shard of a stream described by the broker that serves it (FEATURE_STREAM_INFO):
    /// configuration, offsets, retained records and bytes, subscribers, groups.
    ///
    /// # Errors
    /// `not_found` for a stream that does not exist; [`ClientError::NotLeader`] from a broker
    /// of a cluster that does not serve the shard.
    pub async fn stream_info(
        &self,
        ns: &str,
        stream: &str,
        shard: u32,
    ) -> Result<message::StreamInfoView, ClientError> {
        let (namespace, stream) = (ns.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamInfo(message::StreamInfo { tenant_id, namespace, stream, shard, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamInfo(i) => Ok(*i),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes a value, returning what was removed.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_CACHE_DELETE.
    pub async fn cache_delete(&self, ns: &str, cache: &str, key: &str) -> Result<Option<Bytes>, ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheDelete(message::CacheDelete {
                    tenant_id,
                    namespace,
                    cache,
                    key,
                    request_id: Some(request_id),
                })
            })
            .await?;
        match r {
            core::Reply::CacheValue { value, .. } => Ok(value),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a value and its version (FEATURE_CACHE_CONDITIONAL brokers send one on a hit).
    ///
    /// # Errors
    /// The broker's refusal, or a closed connection.
    pub async fn cache_get_versioned(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
    ) -> Result<(Option<Bytes>, Option<u64>), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheGet(message::CacheGet { tenant_id, namespace, cache, key, request_id: Some(request_id) })
            })
            .await?;
        match r {
            core::Reply::CacheValue { value, version } => Ok((value, version)),
            other => Err(unexpected(&other)),
        }
    }

    /// Stores a value only if the key's live entry matches `condition`; returns whether it
    /// applied and the version written (or the current one).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_CACHE_CONDITIONAL.
    pub async fn cache_put_if(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
        condition: CacheCondition,
    ) -> Result<(bool, Option<u64>), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CachePutIf(message::CachePutIf {
                    tenant_id,
                    namespace,
                    cache,
                    key,
                    value: B64(value),
                    ttl_ms,
                    condition,
                    request_id,
                })
            })
            .await?;
        condition_result(r)
    }

    /// Deletes a key only if its live entry has `version`.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_CACHE_CONDITIONAL.
    pub async fn cache_delete_if(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
        version: u64,
    ) -> Result<(bool, Option<u64>), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheDeleteIf(message::CacheDeleteIf { tenant_id, namespace, cache, key, version, request_id })
            })
            .await?;
        condition_result(r)
    }

    /// Reads a bounded page of a durable shard without subscribing: records from `from` up to
    /// `end` (the committed tail when `None`), within the broker's caps (and `max_records`
    /// when given).
    ///
    /// # Errors
    /// [`ClientError::Cursor`] when `from` is outside the retained range;
    /// [`ClientError::Unsupported`] against a broker without FEATURE_STREAM_READ.
    pub async fn stream_read(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: u64,
        end: Option<u64>,
        max_records: Option<u32>,
    ) -> Result<Page, ClientError> {
        self.read_page(namespace, stream, shard, from, end, max_records, false).await
    }

    /// [`stream_read`](Self::stream_read) of this broker's own copy of a replicated shard,
    /// follower or not (D51): what an operator compares to check that replicas agree.
    ///
    /// # Errors
    /// [`ClientError::NotLeader`] from a broker that keeps no copy of the shard;
    /// [`ClientError::Unsupported`] against a broker without FEATURE_STREAM_INFO.
    pub async fn stream_read_replica(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: u64,
        end: Option<u64>,
        max_records: Option<u32>,
    ) -> Result<Page, ClientError> {
        self.read_page(namespace, stream, shard, from, end, max_records, true).await
    }

    #[allow(clippy::too_many_arguments)] // the request's fields
    async fn read_page(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: u64,
        end: Option<u64>,
        max_records: Option<u32>,
        replica_local: bool,
    ) -> Result<Page, ClientError> {
        let req = StreamReadRequest {
            namespace: namespace.into(),
            stream: stream.into(),
            shard,
            from,
            end,
            max_records,
            max_bytes: None,
            replica_local,
        };
        let r = self
            .request(move |tenant_id, request_id| felix_proto::client::stream_read_message(tenant_id, req, request_id))
            .await?;
        match r {
            core::Reply::StreamRecords { records, next_offset } => Ok(Page { records, next_offset }),
            other => Err(unexpected(&other)),
        }
    }

    /// The first offset of a durable shard appended at or after `at_micros` (microseconds
    /// since the Unix epoch); `None` when no record is that recent.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_RECORD_TIMESTAMPS.
    pub async fn offset_for_time(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        at_micros: u64,
    ) -> Result<Option<u64>, ClientError> {
        let (namespace, stream) = (namespace.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::OffsetForTime(message::OffsetForTime {
                    tenant_id,
                    namespace,
                    stream,
                    shard,
                    at_micros,
                    request_id,
                })
            })
            .await?;
        match r {
            core::Reply::OffsetValue(o) => Ok(o),
            other => Err(unexpected(&other)),
        }
    }

    /// Adds `delta` (negative to subtract) to a counter and returns the sum including it, once
    /// it is durable. A retry after a lost answer counts twice (counters are at-least-once).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_COUNTERS (brokers without
    /// storage do not offer it).
    pub async fn counter_add(&self, ns: &str, cache: &str, key: &str, delta: i64) -> Result<i64, ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CounterAdd(message::CounterAdd { tenant_id, namespace, cache, key, delta, request_id })
            })
            .await?;
        match r {
            core::Reply::CounterValue(Some(v)) => Ok(v),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes a stream and everything it holds (FEATURE_STREAM_ADMIN; needs the admin
    /// permission): its subscribers are told `stream_deleted`, its files removed. Returns
    /// whether there was such a stream.
    ///
    /// # Errors
    /// `forbidden` without the permission; [`ClientError::Unsupported`] against a broker
    /// without the feature.
    pub async fn stream_delete(&self, ns: &str, stream: &str) -> Result<bool, ClientError> {
        let (namespace, stream) = (ns.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamDelete(message::StreamDelete { tenant_id, namespace, stream, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamDeleted(existed) => Ok(existed),
            other => Err(unexpected(&other)),
        }
    }

    /// Creates streams in namespace `ns` (FEATURE_STREAM_CREATE, D60; needs the admin
    /// permission on each), at most [`message::MAX_STREAMS_PER_CREATE`] in one request.
    /// Returns the names created (in a cluster: proposed, created on every broker once the
    /// metadata group commits them) and the streams that existed already, left as they are.
    ///
    /// # Errors
    /// `invalid_request` (nothing created) for a bad name, shard count or replication, or a
    /// name given twice; `forbidden`; `limit_exceeded` past the namespace's stream quota;
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn stream_create(
        &self,
        ns: &str,
        streams: Vec<message::NewStream>,
    ) -> Result<(Vec<String>, Vec<message::ExistingStream>), ClientError> {
        let namespace = ns.to_owned();
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamCreate(message::StreamCreate { tenant_id, namespace, streams, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamsCreated { created, existed } => Ok((created, existed)),
            other => Err(unexpected(&other)),
        }
    }

    /// Commits an event and state changes as one record (FEATURE_ATOMIC_COMMIT; brokers with
    /// storage offer it) and returns its offset (the version of every key it wrote), once
    /// durable.
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] with `offset_mismatch { tail }` when `expected_offset`
    /// was set and another write got there first (nothing written); the broker's error;
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn commit(&self, req: core::CommitRequest) -> Result<u64, ClientError> {
        let r = self.request(move |tenant_id, request_id| core::commit_message(tenant_id, req, request_id)).await?;
        match r {
            core::Reply::Committed(offset) => Ok(offset),
            core::Reply::Refused { reason, message } => Err(ClientError::PublishRefused { reason, message }),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads one key of the state of the shard `entity_key` routes to: its value (`None`: never
    /// written or deleted) and the offset of the commit that wrote it.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_ATOMIC_COMMIT.
    pub async fn state_get(
        &self,
        ns: &str,
        stream: &str,
        entity_key: Bytes,
        key: &str,
    ) -> Result<(Option<Bytes>, Option<u64>), ClientError> {
        let (namespace, stream, key) = (ns.to_owned(), stream.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StateGet(message::StateGet {
                    tenant_id,
                    namespace,
                    stream,
                    entity_key: B64(entity_key),
                    key,
                    shard: None,
                    request_id,
                })
            })
            .await?;
        match r {
            core::Reply::State { value, version, .. } => Ok((value, version)),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a counter; `None` when it was never written (which is not the same as 0).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_COUNTERS.
    pub async fn counter_get(&self, ns: &str, cache: &str, key: &str) -> Result<Option<i64>, ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CounterGet(message::CounterGet { tenant_id, namespace, cache, key, request_id })
            })
            .await?;
        match r {
            core::Reply::CounterValue(v) => Ok(v),
            other => Err(unexpected(&other)),
        }
    }

    /// Watches a cache key or prefix: from now, from a change offset (`from_offset`, a previous
    /// change's offset + 1), or starting with current values (`retained`).
    ///
    /// # Errors
    /// [`ClientError::Cursor`] for a `from_offset` past the tail; the broker's refusal (both
    /// `retained` and `from_offset`...); [`ClientError::Unsupported`] without FEATURE_CACHE_WATCH.
    pub async fn cache_watch(
        &self,
        namespace: &str,
        cache: &str,
        filter: WatchOn,
        from_offset: Option<u64>,
        retained: bool,
    ) -> Result<CacheWatch, ClientError> {
        let req = CacheWatchRequest { namespace: namespace.into(), cache: cache.into(), filter, from_offset, retained };
        self.call(|reply| Cmd::Watch { req, reply }).await
    }

    /// Closes the connection without losing what was written: every control stream is finished,
    /// and the close waits (up to `ClientOptions::close_timeout`) until the broker finished its
    /// side of each, which it does only after it processed everything written on it (QUIC
    /// discards data the broker has not read when a connection closes). A fire-and-forget
    /// publish means "no answer", not "may be dropped on a clean exit". Acked publishes and
    /// requests still waiting for an answer fail.
    ///
    /// # Errors
    /// [`ClientError::Unconfirmed`] with how many fire-and-forget publishes (at most) may not
    /// have reached the broker: the wait timed out or the connection was lost first.
    pub async fn close(&self) -> Result<(), ClientError> {
        let r = self.call(|reply| Cmd::Close { reply }).await;
        match r {
            // Already closed, with nothing left to confirm.
            Err(ClientError::Closed(_)) => Ok(()),
            other => other,
        }
    }

    /// Closes the connection at once, without waiting for anything written to be acknowledged
    /// (data in flight may be lost).
    pub fn close_now(&self) {
        self.quic.close(quinn::VarInt::from_u32(0), b"client closing");
    }
}

fn condition_result(r: core::Reply) -> Result<(bool, Option<u64>), ClientError> {
    match r {
        core::Reply::CacheCondition { applied, version } => Ok((applied, version)),
        other => Err(unexpected(&other)),
    }
}

async fn accept_uni(quic: quinn::Connection, tx: mpsc::UnboundedSender<Input>) {
    loop {
        match quic.accept_uni().await {
            Ok(recv) => {
                if tx.send(Input::IncomingUni(recv)).is_err() {
                    return;
                }
            }
            Err(e) => {
                let _ = tx.send(Input::Closed(e.to_string()));
                return;
            }
        }
    }
}

async fn reader(
    stream: StreamId,
    recv: quinn::RecvStream,
    gate: watch::Receiver<ReadGate>,
    tx: mpsc::UnboundedSender<Input>,
) {
    crate::read_gated(recv, gate, |event| match event {
        ReadEvent::Chunks(data) => tx.send(Input::Data { stream, data, fin: false }).is_ok(),
        ReadEvent::Finished => tx.send(Input::Data { stream, data: Vec::new(), fin: true }).is_ok(),
        ReadEvent::Reset => tx.send(Input::Reset(stream)).is_ok(),
        // The connection failed: `accept_uni` reports it once, for every stream.
        ReadEvent::Failed => false,
    })
    .await
}

enum WriterCmd {
    /// Bytes, and the unacknowledged publishes to complete once they are handed to QUIC.
    Data(Bytes, Vec<Reply<Option<u64>>>),
    Finish,
    /// Finish the stream and report once the broker acknowledged all its data.
    Close(oneshot::Sender<Result<(), Unconfirmed>>),
}

/// What a stream's writer could not get acknowledged at close.
#[derive(Debug, Clone, Copy, Default)]
struct Unconfirmed {
    publishes: u64,
    bytes: u64,
    lost: bool,
}

async fn writer(mut send: quinn::SendStream, mut rx: mpsc::UnboundedReceiver<WriterCmd>) {
    let mut chunks = Vec::new();
    let mut done: Vec<Reply<Option<u64>>> = Vec::new();
    // Everything written on this stream, for the report at close.
    let mut written = Unconfirmed::default();
    while let Some(cmd) = rx.recv().await {
        let mut finish = false;
        let mut close = None;
        match cmd {
            WriterCmd::Data(b, d) => {
                chunks.push(b);
                done.extend(d);
            }
            WriterCmd::Finish => finish = true,
            WriterCmd::Close(r) => close = Some(r),
        }
        while !finish && close.is_none() {
            match rx.try_recv() {
                Ok(WriterCmd::Data(b, d)) => {
                    chunks.push(b);
                    done.extend(d);
                }
                Ok(WriterCmd::Finish) => finish = true,
                Ok(WriterCmd::Close(r)) => close = Some(r),
                Err(_) => break,
            }
        }
        if !chunks.is_empty() {
            written.bytes += chunks.iter().map(|c| c.len() as u64).sum::<u64>();
            written.publishes += done.len() as u64;
            // Completing an unacknowledged publish only once QUIC took its bytes is what gives
            // fire-and-forget publishers backpressure (flow control, not acknowledgements).
            let res = send.write_all_chunks(&mut chunks).await;
            for d in done.drain(..) {
                let _ = d.send(match &res {
                    Ok(()) => Ok(None),
                    Err(e) => Err(ClientError::Closed(e.to_string())),
                });
            }
            if res.is_err() {
                if let Some(r) = close {
                    let _ = r.send(Err(Unconfirmed { lost: true, ..written }));
                }
                return;
            }
            chunks.clear();
        }
        if finish {
            let _ = send.finish();
            return;
        }
        if let Some(r) = close {
            // Once, at close: waiting on the peer's acknowledgement per request would cost a
            // delayed ACK each time, but a close waits for it exactly once.
            let _ = send.finish();
            let confirmed = matches!(send.stopped().await, Ok(None));
            let _ = r.send(if confirmed || written.bytes == 0 { Ok(()) } else { Err(written) });
            return;
        }
    }
}

struct Task {
    machine: ClientConnection,
    tenant: String,
    quic: quinn::Connection,
    tx: mpsc::UnboundedSender<Input>,
    writers: HashMap<StreamId, mpsc::UnboundedSender<WriterCmd>>,
    gates: HashMap<StreamId, watch::Sender<ReadGate>>,
    ready: Option<oneshot::Sender<Result<Negotiated, ClientError>>>,
    publishes: HashMap<PublishId, Reply<Option<u64>>>,
    /// Fire-and-forget publishes, completed once their bytes are handed to QUIC.
    written: Vec<Reply<Option<u64>>>,
    requests: HashMap<u64, Reply<core::Reply>>,
    subs: HashMap<u64, mpsc::UnboundedSender<(SubscriptionItem, usize)>>,
    sub_replies: HashMap<u64, Reply<Subscription>>,
    watch_replies: HashMap<u64, Reply<CacheWatch>>,
    closed: watch::Sender<Option<String>>,
    endpoint: quinn::Endpoint,
    /// `ClientOptions::close_timeout`.
    close_timeout: std::time::Duration,
    /// A close is under way: nothing more is written.
    closing: bool,
    /// What was handed to each stream's writer (for the report of a close that times out).
    written_totals: HashMap<StreamId, Unconfirmed>,
    /// During a close: the control streams the broker has not finished yet, and whom to tell
    /// once it finished them all.
    closing_fins: Option<(std::collections::HashSet<StreamId>, oneshot::Sender<()>)>,
}

fn now() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

fn command_error(e: CommandError) -> ClientError {
    match e {
        CommandError::NotNegotiated(what) => ClientError::Unsupported(what.into()),
        CommandError::Encode(why) => ClientError::Invalid(why),
        other => ClientError::Closed(other.to_string()),
    }
}

fn refused(
    error: ErrorInfo,
    cursor: Option<SubscribeCursorError>,
    redirect: Option<felix_proto::message::NotLeader>,
) -> ClientError {
    if let Some(n) = redirect {
        return ClientError::NotLeader { node_id: n.node_id, addr: n.addr, generation: n.generation };
    }
    cursor.map_or(ClientError::Refused(error), ClientError::Cursor)
}

impl Task {
    async fn run(mut self, mut rx: mpsc::UnboundedReceiver<Input>) {
        let mut reason = String::from("connection task ended");
        loop {
            self.drain();
            let deadline = self.machine.poll_timeout();
            let sleep = crate::sleep_until(deadline);
            tokio::select! {
                input = rx.recv() => {
                    let Some(input) = input else { break };
                    if let Input::Closed(why) = input {
                        reason = why;
                        break;
                    }
                    self.handle(input);
                    for _ in 0..256 {
                        match rx.try_recv() {
                            Ok(Input::Closed(why)) => {
                                reason = why;
                                return self.lost(reason);
                            }
                            Ok(i) => self.handle(i),
                            Err(_) => break,
                        }
                    }
                }
                () = sleep => self.machine.handle_timeout(now()),
            }
        }
        self.lost(reason);
    }

    /// The connection is gone: the state machine fails everything pending, and the replies get
    /// those failures.
    fn lost(mut self, reason: String) {
        self.machine.handle_connection_lost(reason.clone(), now());
        self.drain();
        if let Some(r) = self.ready.take() {
            let _ = r.send(Err(ClientError::Connect(reason.clone())));
        }
        for r in self.written.drain(..) {
            let _ = r.send(Err(ClientError::Closed(reason.clone())));
        }
        let _ = self.closed.send(Some(reason));
    }

    fn handle(&mut self, input: Input) {
        let now = now();
        match input {
            Input::Cmd(Cmd::Close { reply }) => self.close(reply),
            Input::Cmd(Cmd::SetToken(token)) => self.machine.set_token(token, now),
            Input::Cmd(Cmd::Publish { req, reply }) => {
                let ack = req.ack || req.idempotent.is_some() || req.expected_offset.is_some();
                match self.machine.publish_auto(req, now) {
                    Ok(id) if ack => {
                        self.publishes.insert(id, reply);
                    }
                    Ok(_) => self.written.push(reply),
                    Err(e) => drop(reply.send(Err(command_error(e)))),
                }
            }
            Input::Cmd(Cmd::Request { build, reply }) => {
                let tenant = self.tenant.clone();
                match self.machine.request_auto(|id| build(tenant, id), now) {
                    Ok(id) => {
                        self.requests.insert(id, reply);
                    }
                    Err(e) => drop(reply.send(Err(command_error(e)))),
                }
            }
            // Each subscription on a control stream of its own, as upstream clients do.
            Input::Cmd(Cmd::Subscribe { req, reply }) => match self.machine.subscribe_dedicated(req, now) {
                Ok(id) => {
                    self.sub_replies.insert(id, reply);
                }
                Err(e) => drop(reply.send(Err(command_error(e)))),
            },
            Input::Cmd(Cmd::Watch { req, reply }) => match self.machine.cache_watch_dedicated(req, now) {
                Ok(id) => {
                    self.watch_replies.insert(id, reply);
                }
                Err(e) => drop(reply.send(Err(command_error(e)))),
            },
            Input::OpenedBi { token, send, recv } => {
                let id = crate::stream_id(send.id());
                let (wtx, wrx) = mpsc::unbounded_channel();
                self.writers.insert(id, wtx);
                tokio::spawn(writer(send, wrx));
                let (gtx, grx) = watch::channel(ReadGate::Open);
                self.gates.insert(id, gtx);
                tokio::spawn(reader(id, recv, grx, self.tx.clone()));
                self.machine.handle_stream_opened(token, id, now);
            }
            Input::IncomingUni(recv) => {
                let id = crate::stream_id(recv.id());
                let (gtx, grx) = watch::channel(ReadGate::Open);
                self.gates.insert(id, gtx);
                tokio::spawn(reader(id, recv, grx, self.tx.clone()));
            }
            Input::Consumed(sub, bytes) => self.machine.handle_consumed(sub, bytes, now),
            Input::Data { stream, data, fin } => {
                self.machine.handle_stream_chunks(stream, data, fin, now);
                if fin {
                    self.stream_finished(stream);
                }
            }
            Input::Reset(stream) => {
                self.machine.handle_stream_reset(stream, now);
                self.stream_finished(stream);
            }
            Input::Closed(_) => {}
        }
    }

    /// The broker ended a stream; during a close, that is the confirmation awaited.
    fn stream_finished(&mut self, stream: StreamId) {
        self.gates.remove(&stream);
        if let Some((waiting, _)) = &mut self.closing_fins {
            waiting.remove(&stream);
            if waiting.is_empty()
                && let Some((_, done)) = self.closing_fins.take()
            {
                let _ = done.send(());
            }
        }
    }

    fn drain(&mut self) {
        loop {
            let mut progress = false;
            while let Some(o) = self.machine.poll_output() {
                progress = true;
                self.output(o);
            }
            while let Some(e) = self.machine.poll_event() {
                progress = true;
                self.event(e);
            }
            if !progress {
                return;
            }
        }
    }

    fn output(&mut self, o: ClientOutput) {
        match o {
            ClientOutput::OpenBi { token } => {
                let quic = self.quic.clone();
                let tx = self.tx.clone();
                tokio::spawn(async move {
                    match quic.open_bi().await {
                        Ok((send, recv)) => drop(tx.send(Input::OpenedBi { token, send, recv })),
                        Err(e) => drop(tx.send(Input::Closed(e.to_string()))),
                    }
                });
            }
            ClientOutput::Transmit { stream, data } => {
                if let Some(w) = self.writers.get(&stream) {
                    let t = self.written_totals.entry(stream).or_default();
                    t.bytes += data.len() as u64;
                    t.publishes += self.written.len() as u64;
                    let _ = w.send(WriterCmd::Data(data, std::mem::take(&mut self.written)));
                }
            }
            ClientOutput::Finish { stream } => {
                if let Some(w) = self.writers.remove(&stream) {
                    let _ = w.send(WriterCmd::Finish);
                }
            }
            ClientOutput::StopSending { stream, code } => {
                if let Some(g) = self.gates.remove(&stream) {
                    let _ = g.send(ReadGate::Stopped(code));
                }
            }
            ClientOutput::PauseReading { stream } => {
                if let Some(g) = self.gates.get(&stream) {
                    let _ = g.send(ReadGate::Paused);
                }
            }
            ClientOutput::ResumeReading { stream } => {
                if let Some(g) = self.gates.get(&stream) {
                    let _ = g.send(ReadGate::Open);
                }
            }
        }
    }

    /// A channel for a confirmed subscription or watch (the state machine delivers nothing for
    /// it before the confirmation).
    fn item_channel(&mut self, sub: u64) -> ItemRx {
        let (tx, rx) = mpsc::unbounded_channel();
        self.subs.insert(sub, tx);
        ItemRx { sub, rx, task: self.tx.clone() }
    }

    fn deliver(&mut self, sub: u64, e: &ClientEvent, item: SubscriptionItem) {
        let bytes = core::event_bytes(e);
        match self.subs.get(&sub) {
            Some(tx) if tx.send((item, bytes)).is_ok() => {}
            // The application dropped the subscription: what it would have taken is taken.
            _ => self.machine.handle_consumed(sub, bytes, now()),
        }
    }

    fn event(&mut self, e: ClientEvent) {
        match e {
            ClientEvent::Connected { negotiated, .. } => {
                if let Some(r) = self.ready.take() {
                    let _ = r.send(Ok(negotiated));
                }
            }
            ClientEvent::AuthFailed { error, .. } => {
                if let Some(r) = self.ready.take() {
                    let _ = r.send(Err(ClientError::Refused(error)));
                }
            }
            ClientEvent::PublishAcked { id, offset, .. } => {
                if let Some(r) = self.publishes.remove(&id) {
                    let _ = r.send(Ok(offset));
                }
            }
            ClientEvent::PublishFailed { id, error } => {
                if let Some(r) = self.publishes.remove(&id) {
                    let _ = r.send(Err(ClientError::Refused(error)));
                }
            }
            ClientEvent::PublishRefused { id, reason, message } => {
                if let Some(r) = self.publishes.remove(&id) {
                    let _ = r.send(Err(ClientError::PublishRefused { reason, message }));
                }
            }
            ClientEvent::Reply { request_id, reply } => {
                if let Some(r) = self.requests.remove(&request_id) {
                    let _ = r.send(Ok(reply));
                }
            }
            ClientEvent::RequestFailed { request_id, error, cursor, redirect } => {
                if let Some(r) = self.requests.remove(&request_id) {
                    let _ = r.send(Err(refused(error, cursor, redirect)));
                }
            }
            ClientEvent::Subscribed { sub, start_offset, live_offset, .. } => {
                if let Some(r) = self.sub_replies.remove(&sub) {
                    let rx = self.item_channel(sub);
                    let _ = r.send(Ok(Subscription { id: sub, start_offset, live_offset, rx }));
                }
            }
            ClientEvent::CacheWatchStarted { sub, resume_offset, resnapshot, retained_count } => {
                if let Some(r) = self.watch_replies.remove(&sub) {
                    let rx = self.item_channel(sub);
                    let _ = r.send(Ok(CacheWatch { id: sub, resume_offset, resnapshot, retained_count, rx }));
                }
            }
            ClientEvent::SubscribeFailed { sub, error, cursor, redirect } => {
                let err = refused(error, cursor, redirect);
                if let Some(r) = self.sub_replies.remove(&sub) {
                    let _ = r.send(Err(err));
                } else if let Some(r) = self.watch_replies.remove(&sub) {
                    let _ = r.send(Err(err));
                }
            }
            ClientEvent::Events { sub, ref batch } => {
                let item = SubscriptionItem::Events(batch.clone());
                self.deliver(sub, &e, item);
            }
            ClientEvent::CacheEvent { sub, ref event } => {
                let item = SubscriptionItem::CacheChange(event.clone());
                self.deliver(sub, &e, item);
            }
            ClientEvent::SubscriptionEnded { sub, reason } => {
                if let Some(tx) = self.subs.remove(&sub) {
                    let _ = tx.send((SubscriptionItem::End(reason), 0));
                }
            }
            ClientEvent::Error { error, .. } => tracing::warn!("broker error: {}", error.message),
            ClientEvent::ProtocolError { reason } => tracing::warn!("protocol error from broker: {reason}"),
            ClientEvent::PublishWindowOpen { .. }
            | ClientEvent::Unsupported { .. }
            | ClientEvent::StreamClosed { .. }
            | ClientEvent::ConnectionLost { .. } => {}
        }
    }

    /// Finishes every send stream, waits (bounded) for the broker to take all they carried,
    /// then closes the connection and answers `reply` with what could not be confirmed.
    fn close(&mut self, reply: Reply<()>) {
        if self.closing {
            let _ = reply.send(Ok(()));
            return;
        }
        self.closing = true;
        // The broker finishes its side of a control stream once it read our finish and answered
        // everything before it: that, not QUIC's acknowledgement (which only says the bytes
        // reached the broker's QUIC stack, whose unread data a close discards), is what says the
        // broker took every publish.
        let (fins_tx, fins_rx) = oneshot::channel();
        let control: std::collections::HashSet<StreamId> = self.writers.keys().copied().collect();
        if control.is_empty() {
            let _ = fins_tx.send(());
        } else {
            self.closing_fins = Some((control, fins_tx));
        }
        let totals = std::mem::take(&mut self.written_totals);
        let waits: Vec<(Unconfirmed, oneshot::Receiver<Result<(), Unconfirmed>>)> = self
            .writers
            .drain()
            .filter_map(|(id, w)| {
                let (tx, rx) = oneshot::channel();
                let written = totals.get(&id).copied().unwrap_or_default();
                w.send(WriterCmd::Close(tx)).ok().map(|()| (written, rx))
            })
            .collect();
        let (quic, endpoint, timeout) = (self.quic.clone(), self.endpoint.clone(), self.close_timeout);
        tokio::spawn(async move {
            let deadline = tokio::time::Instant::now() + timeout;
            let mut missing = Unconfirmed::default();
            let mut timed_out = false;
            for (written, w) in waits {
                let (publishes, bytes, lost) = match tokio::time::timeout_at(deadline, w).await {
                    Ok(Ok(Ok(()))) => continue,
                    Ok(Ok(Err(u))) => (u.publishes, u.bytes, u.lost),
                    // The writer is gone: its stream failed earlier.
                    Ok(Err(_)) => (written.publishes, written.bytes, true),
                    Err(_) => {
                        timed_out = true;
                        (written.publishes, written.bytes, false)
                    }
                };
                missing.publishes += publishes;
                missing.bytes += bytes;
                missing.lost |= lost;
            }
            if tokio::time::timeout_at(deadline, fins_rx).await.is_err() && missing.bytes == 0 {
                // The bytes were acknowledged but the broker did not finish its side in time:
                // what it had not read yet may be lost with the connection.
                timed_out = true;
                for w in totals.values() {
                    missing.publishes += w.publishes;
                    missing.bytes += w.bytes;
                }
            }
            let result = if missing.bytes == 0 {
                Ok(())
            } else {
                let reason = if timed_out {
                    format!("no acknowledgement within {timeout:?}")
                } else if missing.lost {
                    "the connection was lost".into()
                } else {
                    "the broker stopped a stream".into()
                };
                Err(ClientError::Unconfirmed { publishes: missing.publishes, bytes: missing.bytes, reason })
            };
            quic.close(quinn::VarInt::from_u32(0), b"client closing");
            // Let the endpoint send the close frame before the caller (perhaps a process about to
            // exit) goes on, so the broker need not wait out its idle timeout. Not the whole
            // draining period `wait_idle` would wait for: everything was confirmed already.
            let _ = tokio::time::timeout(std::time::Duration::from_millis(20), endpoint.wait_idle()).await;
            let _ = reply.send(result);
        });
    }
}
