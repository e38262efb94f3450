//! A client for a plain `fn main`: `felix_proto::client::ClientConnection` and QUIC on the
//! calling thread. Every call drives the connection until its answer comes (or its timeout).
//!
//! ```no_run
//! use felix_driver_blocking::{BlockingClient, ConnectOptions};
//! use felix_driver_common::Trust;
//!
//! let mut c = BlockingClient::connect(ConnectOptions::new(
//!     "127.0.0.1:5000".parse().unwrap(),
//!     Trust::DangerAcceptAnyCertificate,
//!     "t1",
//!     "dev-token",
//! ))?;
//! let offset = c.publish("default", "orders", vec!["hello".into()])?;
//! let sub = c.subscribe("default", "orders", felix_proto::message::StartPosition::Earliest)?;
//! let batch = c.next_batch(sub, std::time::Duration::from_secs(5))?;
//! # Ok::<(), felix_driver_blocking::ClientError>(())
//! ```

use crate::quic::{Happening, Quic};
use bytes::Bytes;
use felix_driver_common::tls::{TlsError, Trust, quic_client_crypto};
use felix_driver_common::transport::TransportTuning;
use felix_proto::binary::EventBatch;
use felix_proto::client::{
    ClientConfig, ClientConnection, ClientEvent, ClientOutput, ClientStream, ErrorInfo, PublishId, PublishRequest,
    Reply, SubscribeRequest,
};
use felix_proto::message::StartPosition;
use felix_proto::transport::OpenToken;
use quinn_proto::ConnectionHandle;
use std::collections::VecDeque;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

/// Where and how to connect.
#[derive(Debug, Clone)]
pub struct ConnectOptions {
    /// The broker.
    pub addr: SocketAddr,
    /// The name its certificate is checked against.
    pub server_name: String,
    /// How its certificate is trusted.
    pub trust: Trust,
    /// Tenant and token to authenticate with.
    pub tenant: String,
    /// Bearer token.
    pub token: String,
    /// How long a call waits for its answer.
    pub timeout: Duration,
}

impl ConnectOptions {
    /// Options with the defaults: server name `localhost`, a 10 s timeout.
    pub fn new(addr: SocketAddr, trust: Trust, tenant: &str, token: &str) -> ConnectOptions {
        ConnectOptions {
            addr,
            server_name: "localhost".into(),
            trust,
            tenant: tenant.into(),
            token: token.into(),
            timeout: Duration::from_secs(10),
        }
    }
}

/// Why a call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ClientError {
    /// TLS setup failed.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The socket or the poller failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
    /// QUIC refused to start the connection.
    #[error("connect: {0}")]
    Connect(#[from] quinn_proto::ConnectError),
    /// The broker refused (an error with its code when it sent one).
    #[error("{}{}", .0.code.as_ref().map(|c| format!("{c}: ")).unwrap_or_default(), .0.message)]
    Refused(ErrorInfo),
    /// The command cannot be sent to this broker.
    #[error(transparent)]
    Command(#[from] felix_proto::client::CommandError),
    /// No answer in time.
    #[error("no answer within {0:?}")]
    Timeout(Duration),
    /// The connection is gone.
    #[error("connection lost: {0}")]
    Lost(String),
}

/// A connection to a broker, driven on the caller's thread.
pub struct BlockingClient {
    core: ClientConnection,
    quic: Quic,
    ch: ConnectionHandle,
    main: ClientStream,
    timeout: Duration,
    /// Events that came while waiting for something else, in order.
    backlog: VecDeque<ClientEvent>,
}

impl BlockingClient {
    /// Connects and authenticates.
    ///
    /// # Errors
    /// TLS, socket, handshake or authentication failures.
    pub fn connect(opts: ConnectOptions) -> Result<BlockingClient, ClientError> {
        let bind: SocketAddr = if opts.addr.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().expect("literal");
        let tuning = TransportTuning::default();
        let (mut quic, _waker) = Quic::bind(bind, &tuning, None)?;
        let crypto = quic_client_crypto(opts.trust, true)?;
        let now = Instant::now();
        let mut cfg = quinn_proto::ClientConfig::new(crypto);
        cfg.transport_config(std::sync::Arc::new(tuning.to_quinn_for(opts.addr)));
        let ch = quic.connect(cfg, opts.addr, &opts.server_name, now)?;
        let core = ClientConnection::new(ClientConfig::new(opts.tenant, opts.token), now);
        let mut c =
            BlockingClient { core, quic, ch, main: ClientStream(0), timeout: opts.timeout, backlog: VecDeque::new() };
        c.main = c.wait_for(|e| match e {
            ClientEvent::Connected { stream, .. } => Some(Ok(*stream)),
            ClientEvent::AuthFailed { error, .. } => Some(Err(ClientError::Refused(error.clone()))),
            _ => None,
        })?;
        Ok(c)
    }

    /// Publishes a batch and waits for its acknowledgement (after the write on a durable
    /// stream). Returns the first record's offset when the broker gave one.
    ///
    /// # Errors
    /// The broker's refusal, a timeout, a lost connection.
    pub fn publish(&mut self, namespace: &str, stream: &str, payloads: Vec<Bytes>) -> Result<Option<u64>, ClientError> {
        let id = self.core.publish_auto(PublishRequest::new(namespace, stream, payloads).acked(), Instant::now())?;
        self.wait_for(|e| publish_outcome(e, id))
    }

    /// Subscribes on a stream of its own (as upstream clients do). Returns the subscription.
    ///
    /// # Errors
    /// The broker's refusal, a timeout, a lost connection.
    pub fn subscribe(&mut self, namespace: &str, stream: &str, start: StartPosition) -> Result<u64, ClientError> {
        let req = SubscribeRequest {
            namespace: namespace.into(),
            stream: stream.into(),
            start: Some(start),
            shard: None,
            queue_capacity: None,
            filter: None,
        };
        let sub = self.core.subscribe_dedicated(req, Instant::now())?;
        self.wait_for(|e| match e {
            ClientEvent::Subscribed { sub: s, .. } if *s == sub => Some(Ok(sub)),
            ClientEvent::SubscribeFailed { sub: s, error, .. } if *s == sub => {
                Some(Err(ClientError::Refused(error.clone())))
            }
            _ => None,
        })
    }

    /// The next batch of a subscription, waiting up to `wait`; `None` when none came in time.
    ///
    /// # Errors
    /// The subscription ended, or the connection is gone.
    pub fn next_batch(&mut self, sub: u64, wait: Duration) -> Result<Option<EventBatch>, ClientError> {
        let found = self.wait_until(Instant::now() + wait, |e| match e {
            ClientEvent::Events { sub: s, batch } if *s == sub => Some(Ok(batch.clone())),
            ClientEvent::SubscriptionEnded { sub: s, reason } if *s == sub => {
                Some(Err(ClientError::Lost(format!("subscription ended: {reason:?}"))))
            }
            _ => None,
        });
        match found {
            Ok(batch) => {
                self.core.handle_consumed(sub, batch.records.payload_bytes(), Instant::now());
                Ok(Some(batch))
            }
            Err(ClientError::Timeout(_)) => Ok(None),
            Err(e) => Err(e),
        }
    }

    /// Stores a cache value.
    ///
    /// # Errors
    /// The broker's refusal, a timeout, a lost connection.
    pub fn cache_put(&mut self, namespace: &str, cache: &str, key: &str, value: Bytes) -> Result<(), ClientError> {
        let rid = self.core.cache_put(self.main, namespace, cache, key, value, None)?;
        self.wait_for(|e| reply_to(e, rid)).map(|_| ())
    }

    /// Reads a cache value (`None`: a miss).
    ///
    /// # Errors
    /// The broker's refusal, a timeout, a lost connection.
    pub fn cache_get(&mut self, namespace: &str, cache: &str, key: &str) -> Result<Option<Bytes>, ClientError> {
        let rid = self.core.cache_get(self.main, namespace, cache, key)?;
        match self.wait_for(|e| reply_to(e, rid))? {
            Reply::CacheValue { value, .. } => Ok(value),
            other => Err(ClientError::Lost(format!("unexpected answer {other:?}"))),
        }
    }

    /// The state machine, for everything the calls above do not cover: issue a command on it,
    /// then [`wait_for`](Self::wait_for) its answer.
    pub fn core(&mut self) -> &mut ClientConnection {
        &mut self.core
    }

    /// Drives the connection until `pick` accepts an event (events it passes over are kept for
    /// later calls), for at most the connection's timeout.
    ///
    /// # Errors
    /// What `pick` returns, a timeout, or a lost connection.
    pub fn wait_for<T>(
        &mut self,
        pick: impl FnMut(&ClientEvent) -> Option<Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        let until = Instant::now() + self.timeout;
        self.wait_until(until, pick)
    }

    fn wait_until<T>(
        &mut self,
        until: Instant,
        mut pick: impl FnMut(&ClientEvent) -> Option<Result<T, ClientError>>,
    ) -> Result<T, ClientError> {
        if let Some(i) = self.backlog.iter().position(|e| pick(e).is_some()) {
            let e = self.backlog.remove(i).expect("found");
            return pick(&e).expect("picked");
        }
        loop {
            while let Some(e) = self.core.poll_event() {
                if let Some(r) = pick(&e) {
                    return r;
                }
                if let ClientEvent::ConnectionLost { reason } = &e {
                    return Err(ClientError::Lost(reason.clone()));
                }
                self.backlog.push_back(e);
            }
            let now = Instant::now();
            if now >= until {
                return Err(ClientError::Timeout(self.timeout));
            }
            self.turn(until)?;
        }
    }

    /// One turn of the loop: outputs out, wait, inputs in.
    fn turn(&mut self, until: Instant) -> Result<(), ClientError> {
        while let Some(o) = self.core.poll_output() {
            match o {
                ClientOutput::OpenBi { token } => self.quic.open(self.ch, token.0, true),
                ClientOutput::Transmit { stream, data } => self.quic.write(self.ch, stream, data),
                ClientOutput::Finish { stream } => self.quic.finish(self.ch, stream),
                ClientOutput::StopSending { stream, code } => self.quic.stop(self.ch, stream, code),
                ClientOutput::PauseReading { stream } => self.quic.set_paused(self.ch, stream, true),
                ClientOutput::ResumeReading { stream } => self.quic.set_paused(self.ch, stream, false),
            }
        }
        self.quic.transmit();
        let deadline = self.core.poll_timeout().map_or(until, |t| t.min(until));
        self.quic.wait(Some(deadline))?;
        let now = Instant::now();
        if self.core.poll_timeout().is_some_and(|t| t <= now) {
            self.core.handle_timeout(now);
        }
        while let Some(h) = self.quic.poll_happening() {
            match h {
                Happening::Data { stream, chunks, fin, .. } => self.core.handle_stream_chunks(stream, chunks, fin, now),
                Happening::Reset { stream, .. } => self.core.handle_stream_reset(stream, now),
                Happening::Opened { token, stream, .. } => {
                    self.core.handle_stream_opened(OpenToken(token), stream, now)
                }
                Happening::Lost(_, why) => self.core.handle_connection_lost(why, now),
                // A stopped stream fails what waits on it when the broker's answer says so; QUIC
                // credit and handshakes need nothing from the core.
                Happening::Stopped { .. } | Happening::Flushed { .. } => {}
                Happening::Incoming(i) => self.quic.refuse(*i),
            }
        }
        Ok(())
    }

    /// Closes the connection (code 0) and sends the close.
    pub fn close(mut self) {
        self.quic.close(self.ch, 0, "done");
        self.quic.transmit();
    }
}

fn publish_outcome(e: &ClientEvent, id: PublishId) -> Option<Result<Option<u64>, ClientError>> {
    match e {
        ClientEvent::PublishAcked { id: i, offset, .. } if *i == id => Some(Ok(*offset)),
        ClientEvent::PublishFailed { id: i, error } if *i == id => Some(Err(ClientError::Refused(error.clone()))),
        ClientEvent::PublishRefused { id: i, message, .. } if *i == id => Some(Err(ClientError::Refused(ErrorInfo {
            message: message.clone(),
            code: None,
            retry: None,
            detail: None,
        }))),
        _ => None,
    }
}

fn reply_to(e: &ClientEvent, rid: u64) -> Option<Result<Reply, ClientError>> {
    match e {
        ClientEvent::Reply { request_id, reply } if *request_id == rid => Some(Ok(reply.clone())),
        ClientEvent::RequestFailed { request_id, error, .. } if *request_id == rid => {
            Some(Err(ClientError::Refused(error.clone())))
        }
        _ => None,
    }
}
