//! Test doubles (feature `testkit`): stand-ins for peers we cannot ship.
//!
//! [`LegacyBroker`] behaves as the released upstream Felix broker was observed to behave, so
//! that our client and the live conformance suite are tested against it, not only against our
//! own broker:
//! * no ALPN: a client offering one is refused in the handshake (TLS alert 120);
//! * a self-signed certificate for `localhost`, new at every start;
//! * `auth` on every bidirectional stream; `auth_ok` with `server_flags` 0x003F and no feature
//!   bits to a client that offered flags, plain `ok` to one that offered none;
//! * publishes binary (0x0001, acked 0x0008) or JSON; a JSON publish's `key` is dropped
//!   silently (everything lands on shard 0), and a frame with a flag bit outside 0x003F is
//!   refused with `error` (an acked one with a failed binary ack naming its request id);
//! * a subscription opens its event stream (`event_stream_hello`) **before** answering
//!   `subscribed`, then stops its control stream; events are plain 0x0004 batches (with
//!   `base_offset` for a client that offered 0x0020);
//! * `cache_put`/`cache_get`, `error` without code fields, an unknown type closes the stream, a
//!   frame header past 16 MiB ends the stream.
//!
//! It is small on purpose: one task per stream, state under a mutex. Not for production.
//!
//! [`UdpRelay`] sits between two QUIC endpoints and makes one of them go silent, or answer
//! late, on the test's word.

mod relay;
pub use relay::{RelayMode, UdpRelay};

use crate::tls::{Identity, TlsError, server_config};
use bytes::{Bytes, BytesMut};
use felix_proto::binary::{EventBatch, PublishAck, PublishBatch};
use felix_proto::flags::Flags;
use felix_proto::frame::{Frame, FrameDecoder};
use felix_proto::message::{self, B64, Decoded, Message};
use felix_proto::{ErrorCode, Payload, Records, RetryClass};
use rustls::pki_types::CertificateDer;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The flags the released broker advertises.
pub const LEGACY_SERVER_FLAGS: u16 = 0x003F;

#[derive(Default)]
struct State {
    /// Stream → records in order (what a subscriber from the start would see).
    streams: HashMap<String, Vec<Bytes>>,
    /// Stream → event stream senders of its subscribers, with whether each offered offsets.
    subscribers: HashMap<String, Vec<(mpsc::UnboundedSender<Bytes>, bool)>>,
    cache: HashMap<(String, String), Bytes>,
    next_sub: u64,
    /// Keys of JSON publishes, which this broker drops (kept here so tests can see it did).
    dropped_keys: u64,
}

/// A running stand-in for the released Felix broker (see the module docs).
pub struct LegacyBroker {
    addr: SocketAddr,
    chain: Vec<CertificateDer<'static>>,
    cert_pem: String,
    state: Arc<Mutex<State>>,
    endpoint: quinn::Endpoint,
}

impl std::fmt::Debug for LegacyBroker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LegacyBroker").field("addr", &self.addr).finish()
    }
}

impl LegacyBroker {
    /// Starts one on `127.0.0.1` (any port).
    ///
    /// # Errors
    /// Certificate generation or binding failures.
    pub async fn start() -> Result<LegacyBroker, TlsError> {
        let (id, cert_pem, _) = Identity::self_signed(&["localhost"])?;
        let chain = id.chain.clone();
        let mut tls = server_config(id)?;
        tls.alpn_protocols.clear(); // knows no ALPN id: rustls then refuses a client offering one
        let crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| TlsError::Generate(e.to_string()))?;
        let cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        let endpoint = quinn::Endpoint::server(cfg, "127.0.0.1:0".parse().expect("literal"))
            .map_err(|e| TlsError::Generate(e.to_string()))?;
        let addr = endpoint.local_addr().map_err(|e| TlsError::Generate(e.to_string()))?;
        let state = Arc::new(Mutex::new(State { next_sub: 1, ..State::default() }));
        tokio::spawn(accept(endpoint.clone(), state.clone()));
        Ok(LegacyBroker { addr, chain, cert_pem, state, endpoint })
    }

    /// Its address.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Its certificate chain (to trust it).
    pub fn chain(&self) -> Vec<CertificateDer<'static>> {
        self.chain.clone()
    }

    /// Its certificate as PEM (for a client's `--ca`).
    pub fn cert_pem(&self) -> &str {
        &self.cert_pem
    }

    /// The records of `stream`, in order.
    pub fn records(&self, stream: &str) -> Vec<Bytes> {
        self.lock().streams.get(stream).cloned().unwrap_or_default()
    }

    /// How many routing keys it dropped (JSON publishes with a `key`).
    pub fn dropped_keys(&self) -> u64 {
        self.lock().dropped_keys
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for LegacyBroker {
    fn drop(&mut self) {
        self.endpoint.close(0u32.into(), b"test double stopped");
    }
}

async fn accept(endpoint: quinn::Endpoint, state: Arc<Mutex<State>>) {
    while let Some(incoming) = endpoint.accept().await {
        let state = state.clone();
        tokio::spawn(async move {
            let Ok(conn) = incoming.await else { return };
            while let Ok((send, recv)) = conn.accept_bi().await {
                tokio::spawn(serve_stream(conn.clone(), send, recv, state.clone()));
            }
        });
    }
}

fn frame(m: &Message) -> Bytes {
    let mut b = BytesMut::new();
    let _ = m.encode(&mut b);
    b.freeze()
}

fn error(message: &str) -> Bytes {
    frame(&Message::Error(message::ErrorMsg { message: message.into(), code: None, retry: None, detail: None }))
}

async fn serve_stream(
    conn: quinn::Connection,
    mut send: quinn::SendStream,
    mut recv: quinn::RecvStream,
    state: Arc<Mutex<State>>,
) {
    let mut dec = FrameDecoder::new();
    dec.set_accepted_flags(Flags(0xFFFF)); // judged below, as the released broker does
    let mut offered: Option<Flags> = None;
    loop {
        let f = match dec.next_frame() {
            Ok(Some(f)) => f,
            Ok(None) => match recv.read_chunk(64 * 1024, true).await {
                Ok(Some(c)) => {
                    dec.push(c.bytes);
                    continue;
                }
                _ => return,
            },
            // Flags it does not take: refused, the frame skipped, the stream goes on (an acked
            // publish is answered by the request id at the front of its payload).
            Err(felix_proto::FrameError::Flags { error, payload }) => {
                let flags = match error {
                    felix_proto::flags::FlagError::Unknown { flags, .. }
                    | felix_proto::flags::FlagError::ConflictingKinds { flags }
                    | felix_proto::flags::FlagError::MissingBase { flags, .. } => flags,
                    _ => 0,
                };
                let answer = refuse_flags(Flags(flags), &payload);
                if send.write_all(&answer).await.is_err() {
                    return;
                }
                continue;
            }
            // A frame it cannot take (past 16 MiB, bad magic): the stream ends.
            Err(_) => {
                let _ = send.finish();
                let _ = recv.stop(0u32.into());
                return;
            }
        };
        let Some(flags) = offered else {
            // The first frame must be auth.
            match f.decode_payload() {
                Ok(Payload::Json(Decoded::Message(Message::Auth(a)))) => {
                    let answer = match a.client_flags {
                        Some(_) => Message::AuthOk(message::AuthOk {
                            server_flags: LEGACY_SERVER_FLAGS,
                            server_flags_hi: None,
                            server_features: None,
                            server_features_hi: None,
                            listener_ports: None,
                            publish_window: None,
                        }),
                        None => Message::Ok(message::OkMsg {}),
                    };
                    offered = Some(Flags(a.client_flags.unwrap_or(Flags::ORIGINAL_V1.bits())));
                    if send.write_all(&frame(&answer)).await.is_err() {
                        return;
                    }
                }
                _ => {
                    let _ = send.write_all(&error("unauthenticated")).await;
                    let _ = send.finish();
                    return;
                }
            }
            continue;
        };
        match handle(&conn, &f, flags, &state).await {
            Answer::Write(b) => {
                if send.write_all(&b).await.is_err() {
                    return;
                }
            }
            Answer::Nothing => {}
            Answer::Close(last) => {
                if let Some(b) = last {
                    let _ = send.write_all(&b).await;
                }
                let _ = send.finish();
                let _ = recv.stop(0u32.into());
                return;
            }
        }
    }
}

enum Answer {
    Write(Bytes),
    Nothing,
    /// Write this (if any), then end the stream.
    Close(Option<Bytes>),
}

fn failed_ack(request_id: u64, why: &str) -> Bytes {
    let mut b = BytesMut::new();
    let ack = PublishAck::error(request_id, why, ErrorCode::InvalidRequest, RetryClass::Fatal);
    match ack.encode(Flags::BINARY_PUBLISH_ACK, &mut b) {
        Ok(_) => b.freeze(),
        Err(_) => error(why),
    }
}

/// The answer to a frame whose flags it does not take: a failed binary ack naming the request
/// when the frame is an acked publish with its id readable, `error` otherwise.
fn refuse_flags(flags: Flags, payload: &[u8]) -> Bytes {
    let id = payload.get(..8).map(|b| u64::from_be_bytes(b.try_into().expect("8 bytes")));
    match (flags.contains(Flags::BINARY_PUBLISH_ACKED), id) {
        (true, Some(id)) => failed_ack(id, "unsupported frame flags"),
        _ => error("unsupported frame flags"),
    }
}

async fn handle(conn: &quinn::Connection, f: &Frame, offered: Flags, state: &Arc<Mutex<State>>) -> Answer {
    let acked_id = || (f.payload.len() >= 8).then(|| u64::from_be_bytes(f.payload[..8].try_into().expect("8 bytes")));
    if f.flags.bits() & !LEGACY_SERVER_FLAGS != 0 {
        return Answer::Write(refuse_flags(f.flags, &f.payload));
    }
    if f.flags.contains(Flags::BINARY_PUBLISH_BATCH) {
        return match PublishBatch::decode(f.flags, f.payload.clone()) {
            Ok(b) => {
                publish(state, &b.stream, b.records.payloads());
                match b.acked {
                    Some(a) => {
                        let mut out = BytesMut::new();
                        match PublishAck::ok(a.request_id, None).encode(Flags::BINARY_PUBLISH_ACK, &mut out) {
                            Ok(_) => Answer::Write(out.freeze()),
                            Err(e) => Answer::Write(error(&e.to_string())),
                        }
                    }
                    None => Answer::Nothing,
                }
            }
            Err(e) => match (f.flags.contains(Flags::BINARY_PUBLISH_ACKED), acked_id()) {
                (true, Some(id)) => Answer::Write(failed_ack(id, &e.to_string())),
                _ => Answer::Write(error(&e.to_string())),
            },
        };
    }
    let m = match f.decode_payload() {
        Ok(Payload::Json(Decoded::Message(m))) => m,
        // Unknown types and malformed JSON end the stream.
        _ => return Answer::Close(None),
    };
    match m {
        Message::Publish(p) => json_publish(state, &p.stream, vec![p.payload.0], p.key.is_some(), p.ack, p.request_id),
        Message::PublishBatch(p) => json_publish(
            state,
            &p.stream,
            p.payloads.into_iter().map(|b| b.0).collect(),
            p.key.is_some(),
            p.ack,
            p.request_id,
        ),
        Message::Subscribe(s) => {
            let id = {
                let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
                st.next_sub += 1;
                st.next_sub - 1
            };
            let Ok(mut uni) = conn.open_uni().await else { return Answer::Close(None) };
            let hello = frame(&Message::EventStreamHello(message::EventStreamHello { subscription_id: id }));
            if uni.write_all(&hello).await.is_err() {
                return Answer::Close(None);
            }
            let (tx, mut rx) = mpsc::unbounded_channel::<Bytes>();
            let offsets = offered.contains(Flags::EVENT_BATCH_OFFSETS);
            state
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .subscribers
                .entry(s.stream.clone())
                .or_default()
                .push((tx, offsets));
            tokio::spawn(async move {
                while let Some(b) = rx.recv().await {
                    if uni.write_all(&b).await.is_err() {
                        return;
                    }
                }
            });
            // The event stream is already open when `subscribed` goes out; then the control
            // stream of the subscription is stopped.
            let subscribed = Message::Subscribed(message::Subscribed {
                subscription_id: id,
                start_offset: None,
                live_offset: None,
                queue_capacity: None,
            });
            Answer::Close(Some(frame(&subscribed)))
        }
        Message::CachePut(c) => {
            state.lock().unwrap_or_else(|e| e.into_inner()).cache.insert((c.cache, c.key), c.value.0);
            match c.request_id {
                Some(request_id) => Answer::Write(frame(&Message::CacheOk(message::CacheOk { request_id }))),
                None => Answer::Write(frame(&Message::Ok(message::OkMsg {}))),
            }
        }
        Message::CacheGet(c) => {
            let value =
                state.lock().unwrap_or_else(|e| e.into_inner()).cache.get(&(c.cache.clone(), c.key.clone())).cloned();
            Answer::Write(frame(&Message::CacheValue(message::CacheValue {
                tenant_id: c.tenant_id,
                namespace: c.namespace,
                cache: c.cache,
                key: c.key,
                value: value.map(B64),
                request_id: c.request_id,
                version: None,
            })))
        }
        // Anything else it does not serve: the stream is closed.
        _ => Answer::Close(None),
    }
}

fn json_publish(
    state: &Arc<Mutex<State>>,
    stream: &str,
    payloads: Vec<Bytes>,
    keyed: bool,
    ack: Option<felix_proto::binary::AckMode>,
    request_id: Option<u64>,
) -> Answer {
    let acked = ack.is_some_and(|a| a != felix_proto::binary::AckMode::None);
    if acked && request_id.is_none() {
        return Answer::Write(error("an acknowledged publish needs a request_id"));
    }
    if keyed {
        state.lock().unwrap_or_else(|e| e.into_inner()).dropped_keys += 1;
    }
    publish(state, stream, payloads.into_iter());
    match (acked, request_id) {
        (true, Some(request_id)) => {
            Answer::Write(frame(&Message::PublishOk(message::PublishOk { request_id, offset: None })))
        }
        _ => Answer::Nothing,
    }
}

fn publish(state: &Arc<Mutex<State>>, stream: &str, payloads: impl Iterator<Item = Bytes>) {
    let mut st = state.lock().unwrap_or_else(|e| e.into_inner());
    let payloads: Vec<Bytes> = payloads.collect();
    let log = st.streams.entry(stream.to_owned()).or_default();
    let base = log.len() as u64;
    log.extend(payloads.iter().cloned());
    let Ok(records) = Records::from_payloads(payloads) else { return };
    if let Some(subs) = st.subscribers.get_mut(stream) {
        subs.retain(|(tx, offsets)| {
            let batch = EventBatch { base_offset: offsets.then_some(base), ..EventBatch::shared(records.clone()) };
            let mut out = BytesMut::new();
            match batch.encode(&mut out) {
                Ok(()) => tx.send(out.freeze()).is_ok(),
                Err(_) => true,
            }
        });
    }
}
