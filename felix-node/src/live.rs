//! `felix-node conformance --addr HOST:PORT`: behavioural checks against a running broker,
//! speaking raw frames over QUIC (the bytes an old or a new client would send), one line per
//! check and `N passed, M failed, K skipped` at the end. A check that cannot apply to the broker
//! (it does not advertise the feature the check is about) is reported skipped, never passed.

use bytes::{Bytes, BytesMut};
use felix_driver_tokio::Trust;
use felix_proto::binary::{AckMode, AckStatus, AckedPrefix, PublishAck, PublishBatch};
use felix_proto::features::Features;
use felix_proto::flags::Flags;
use felix_proto::frame::{Frame, FrameDecoder, FrameHeader};
use felix_proto::message::{self, Decoded, Message};
use felix_proto::{Payload, Records};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

const WAIT: Duration = Duration::from_secs(5);

pub struct Target {
    pub addr: SocketAddr,
    pub trust: Trust,
    pub server_name: String,
    pub tenant: String,
    pub token: String,
    pub alpn: felix_driver_tokio::tls::AlpnOffer,
}

struct Conn {
    quic: quinn::Connection,
    _ep: quinn::Endpoint,
}

struct Stream {
    send: quinn::SendStream,
    recv: quinn::RecvStream,
    dec: FrameDecoder,
}

impl Stream {
    async fn send(&mut self, data: &[u8]) -> Result<(), String> {
        self.send.write_all(data).await.map_err(|e| format!("write: {e}"))
    }

    /// The next frame, `Ok(None)` when the broker finished or stopped the stream.
    async fn next(&mut self) -> Result<Option<Frame>, String> {
        loop {
            if let Some(f) = self.dec.next_frame().map_err(|e| format!("broker sent a bad frame: {e}"))? {
                return Ok(Some(f));
            }
            match tokio::time::timeout(WAIT, self.recv.read_chunk(64 * 1024, true)).await {
                Err(_) => return Err("no answer within 5 s".into()),
                Ok(Ok(Some(c))) => self.dec.push(c.bytes),
                Ok(Ok(None)) | Ok(Err(_)) => return Ok(None),
            }
        }
    }

    async fn message(&mut self) -> Result<Message, String> {
        match self.next().await? {
            Some(f) => match f.decode_payload().map_err(|e| e.to_string())? {
                Payload::Json(Decoded::Message(m)) => Ok(m),
                other => Err(format!("expected a JSON message, got {other:?}")),
            },
            None => Err("the stream ended".into()),
        }
    }
}

fn json(m: &Message) -> Bytes {
    let mut b = BytesMut::new();
    let _ = m.encode(&mut b);
    b.freeze()
}

impl Target {
    async fn connect(&self) -> Result<Conn, String> {
        let bind: SocketAddr = if self.addr.is_ipv6() { "[::]:0" } else { "0.0.0.0:0" }.parse().expect("literal");
        let ep = quinn::Endpoint::client(bind).map_err(|e| e.to_string())?;
        let cfg = |offer: bool| -> Result<quinn::ClientConfig, String> {
            let tls = felix_driver_tokio::tls::client_config(self.trust.clone(), offer).map_err(|e| e.to_string())?;
            let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
            Ok(quinn::ClientConfig::new(Arc::new(crypto)))
        };
        let dial = felix_driver_tokio::tls::dial(&ep, self.addr, &self.server_name, self.alpn, cfg);
        let quic = tokio::time::timeout(WAIT, dial).await.map_err(|_| "handshake timed out".to_string())??;
        Ok(Conn { quic, _ep: ep })
    }

    fn auth(&self, flags: Option<u16>, features: Option<u32>) -> Bytes {
        json(&Message::Auth(message::Auth {
            tenant_id: self.tenant.clone(),
            token: self.token.clone(),
            client_flags: flags,
            client_flags_hi: None,
            client_features: features,
            client_features_hi: None,
        }))
    }

    /// A fresh stream, authenticated with the given offer; returns the auth answer too.
    async fn session(&self, c: &Conn, flags: Option<u16>, features: Option<u32>) -> Result<(Stream, Message), String> {
        let (send, recv) = c.quic.open_bi().await.map_err(|e| e.to_string())?;
        let mut s = Stream { send, recv, dec: FrameDecoder::new() };
        s.send(&self.auth(flags, features)).await?;
        let answer = s.message().await?;
        Ok((s, answer))
    }

    fn publish_binary(&self, stream: &str, request_id: Option<u64>) -> Bytes {
        let b = PublishBatch {
            acked: request_id.map(|request_id| AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
            idempotent: None,
            key: None,
            tenant_id: self.tenant.clone(),
            namespace: "conformance".into(),
            stream: stream.into(),
            records: Records::from_payloads(["hello"]).expect("small"),
        };
        let mut out = BytesMut::new();
        let _ = b.encode(&mut out);
        out.freeze()
    }

    fn subscribe(&self, stream: &str) -> Bytes {
        json(&Message::Subscribe(message::Subscribe {
            tenant_id: self.tenant.clone(),
            namespace: "conformance".into(),
            stream: stream.into(),
            subscription_id: None,
            start: None,
            shard: None,
            queue_capacity: None,
            filter: None,
        }))
    }
}

/// What a check found: `Ok(Verdict)`, or `Err(why it failed)`.
type Check = Result<Verdict, String>;

/// A check that did not fail.
enum Verdict {
    /// It held; the note says how, when there is more than one way to hold.
    Passed(Option<String>),
    /// It cannot apply to this broker (why).
    Skipped(String),
}

const PASSED: Verdict = Verdict::Passed(None);

fn skipped(why: impl Into<String>) -> Check {
    Ok(Verdict::Skipped(why.into()))
}
type CheckFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = Check> + 'a>>;

fn expect(cond: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if cond { Ok(()) } else { Err(what()) }
}

async fn row1_negotiating(t: &Target) -> Check {
    let c = t.connect().await?;
    let (_, answer) = t.session(&c, Some(0x0019), None).await?;
    match answer {
        Message::AuthOk(ok) => {
            expect(Flags(ok.server_flags).contains(Flags::ORIGINAL_V1), || {
                format!("server_flags {:#x} lack ORIGINAL_V1", ok.server_flags)
            })?;
            expect(ok.publish_window.is_none(), || {
                "publish_window granted to a client that did not offer pipelining".into()
            })?;
            Ok(PASSED)
        }
        other => Err(format!("expected auth_ok, got {other:?}")),
    }
}

async fn row3_legacy_gets_plain_ok(t: &Target) -> Check {
    let c = t.connect().await?;
    let (send, recv) = c.quic.open_bi().await.map_err(|e| e.to_string())?;
    let mut s = Stream { send, recv, dec: FrameDecoder::new() };
    s.send(&t.auth(None, None)).await?;
    let f = s.next().await?.ok_or("stream ended")?;
    expect(f.flags.is_empty() && &f.payload[..] == br#"{"type":"ok"}"#, || {
        format!("expected exactly {{\"type\":\"ok\"}}, got {:?}", String::from_utf8_lossy(&f.payload))
    })?;
    Ok(PASSED)
}

async fn legacy_frames_are_the_old_frames(t: &Target) -> Check {
    let c = t.connect().await?;
    let (mut s, _) = t.session(&c, None, None).await?;
    let stream = format!("legacy-{}", std::process::id());
    s.send(&t.subscribe(&stream)).await?;
    let sub = s.next().await?.ok_or("stream ended")?;
    let text = String::from_utf8_lossy(&sub.payload).into_owned();
    expect(text.starts_with(r#"{"type":"subscribed","subscription_id":"#) && !text.contains("offset"), || {
        format!("subscribed carries more than a legacy client reads: {text}")
    })?;
    // Publish on a stream of its own: a broker may stop a subscription's control stream once it
    // answered `subscribed` (the existing Felix broker does).
    let (mut p, _) = t.session(&c, None, None).await?;
    p.send(&t.publish_binary(&stream, None)).await?;
    let frames = next_event_frames(&c, 2).await?;
    let hello = String::from_utf8_lossy(&frames[0].payload).into_owned();
    expect(hello.starts_with(r#"{"type":"event_stream_hello","subscription_id":"#), || format!("first frame {hello}"))?;
    expect(frames[1].flags == Flags::BINARY_EVENT_BATCH_SHARED, || {
        format!("events for a legacy client must be plain 0x0004 batches, got {}", frames[1].flags)
    })?;
    Ok(PASSED)
}

/// The frames of the next event stream the broker opens on `c`, until `n` are read.
async fn next_event_frames(c: &Conn, n: usize) -> Result<Vec<Frame>, String> {
    let mut uni = tokio::time::timeout(WAIT, c.quic.accept_uni())
        .await
        .map_err(|_| "no event stream")?
        .map_err(|e| e.to_string())?;
    let mut dec = FrameDecoder::new();
    dec.set_accepted_flags(Flags::KNOWN);
    let mut frames = Vec::new();
    while frames.len() < n {
        let chunk = tokio::time::timeout(WAIT, uni.read_chunk(64 * 1024, true)).await.map_err(|_| "no events")?;
        match chunk.map_err(|e| e.to_string())? {
            Some(c) => dec.push(c.bytes),
            None => return Err("event stream ended early".into()),
        }
        while let Some(f) = dec.next_frame().map_err(|e| e.to_string())? {
            frames.push(f);
        }
    }
    Ok(frames)
}

/// D56: a compressed batch reaches a subscriber that offered its codec compressed, and one
/// that did not as the plain frame it always got. Skipped against a broker that does not
/// advertise zstd in its second flag word.
async fn compressed_batches_only_when_offered(t: &Target) -> Check {
    let auth = |hi: Option<u16>, flags: u16| {
        json(&Message::Auth(message::Auth {
            tenant_id: t.tenant.clone(),
            token: t.token.clone(),
            client_flags: Some(flags),
            client_flags_hi: hi,
            client_features: None,
            client_features_hi: None,
        }))
    };
    let open = |c: &Conn, a: Bytes| {
        let quic = c.quic.clone();
        async move {
            let (send, recv) = quic.open_bi().await.map_err(|e| e.to_string())?;
            let mut s = Stream { send, recv, dec: FrameDecoder::new() };
            s.send(&a).await?;
            let answer = s.message().await?;
            Ok::<_, String>((s, answer))
        }
    };
    let (pc, zc, lc) = (t.connect().await?, t.connect().await?, t.connect().await?);
    let (mut p, answer) = open(&pc, auth(Some(0x1), 0xFFFF)).await?;
    let Message::AuthOk(ok) = answer else { return skipped("no auth_ok") };
    if ok.server_flags & 0x8000 == 0 || ok.server_flags_hi.unwrap_or(0) & 0x1 == 0 {
        return skipped("the broker does not advertise COMPRESSED_ZSTD (D56)");
    }
    let stream = format!("compressed-{}", std::process::id());
    let (mut zs, _) = open(&zc, auth(Some(0x1), 0xFFFF)).await?;
    zs.send(&t.subscribe(&stream)).await?;
    zs.message().await?;
    let (mut ls, _) = open(&lc, auth(None, 0x0007)).await?;
    ls.send(&t.subscribe(&stream)).await?;
    ls.message().await?;
    let payloads: Vec<String> =
        (0..32).map(|i| format!(r#"{{"user":"u{}","action":"click","page":"/home","n":{i}}}"#, i % 3)).collect();
    let b = PublishBatch {
        acked: None,
        idempotent: None,
        key: None,
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        stream: stream.clone(),
        records: Records::default(),
    };
    let mut frame = BytesMut::new();
    let mut z = felix_proto::Compressor::new(felix_proto::Codec::Zstd, 3).map_err(|e| e.to_string())?;
    b.encode_payloads_compressed(&payloads, &mut z, &mut frame).map_err(|e| e.to_string())?;
    p.send(&frame).await?;
    let zf = next_event_frames(&zc, 2).await?;
    let lf = next_event_frames(&lc, 2).await?;
    expect(zf[1].flags.contains(Flags::EXTENDED), || format!("zstd subscriber got flags {}", zf[1].flags))?;
    expect(lf[1].flags == Flags::BINARY_EVENT_BATCH_SHARED, || format!("legacy subscriber got flags {}", lf[1].flags))?;
    for f in [&zf[1], &lf[1]] {
        let Ok(Payload::Events(e)) = f.decode_payload() else {
            return Err("an event batch that does not decode".into());
        };
        let got: Vec<Bytes> = e.records.payloads().collect();
        expect(got.len() == payloads.len() && got.iter().zip(&payloads).all(|(g, p)| g == p.as_bytes()), || {
            "the records differ from those published".into()
        })?;
    }
    Ok(PASSED)
}

/// A raw session on its own connection with this offer (the second flag word and the second
/// feature word included).
async fn raw_session(
    t: &Target,
    flags: Option<u16>,
    flags_hi: Option<u16>,
    features: Features,
) -> Result<(Conn, Stream, Message), String> {
    let c = t.connect().await?;
    let (lo, hi) = features.to_words(true);
    let auth = json(&Message::Auth(message::Auth {
        tenant_id: t.tenant.clone(),
        token: t.token.clone(),
        client_flags: flags,
        client_flags_hi: flags_hi,
        client_features: lo,
        client_features_hi: hi,
    }));
    let (send, recv) = c.quic.open_bi().await.map_err(|e| e.to_string())?;
    let mut s = Stream { send, recv, dec: FrameDecoder::new() };
    s.send(&auth).await?;
    let answer = s.message().await?;
    Ok((c, s, answer))
}

/// A binary publish of `payloads` with `key` and, when given, an envelope (D58).
fn keyed_publish(t: &Target, stream: &str, key: &str, payloads: &[&str], envelope: Option<&[u8]>) -> Bytes {
    let records = Records::from_payloads(payloads).expect("small");
    let b = PublishBatch {
        acked: None,
        idempotent: None,
        key: Some(Bytes::copy_from_slice(key.as_bytes())),
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        stream: stream.into(),
        records: records.with_envelope(envelope.map(Bytes::copy_from_slice)),
    };
    let mut out = BytesMut::new();
    let _ = b.encode(&mut out);
    out.freeze()
}

/// D57: a filtered subscription gets only its key's batches, and what it was not sent as
/// `skipped_before`. Skipped against a broker that does not advertise FEATURE_STREAM_FILTER.
async fn filtered_subscription_when_offered(t: &Target) -> Check {
    let (c, mut s, answer) = raw_session(t, Some(0x0827), None, Features::STREAM_FILTER).await?;
    let Message::AuthOk(ok) = answer else { return skipped("no auth_ok") };
    if !Features::from_words(ok.server_features, ok.server_features_hi).contains(Features::STREAM_FILTER) {
        return skipped("the broker does not advertise FEATURE_STREAM_FILTER (D57)");
    }
    let stream = format!("filtered-{}", std::process::id());
    let filter = message::KeyFilter { keys: vec![message::B64(Bytes::from_static(b"k-a"))], key_prefixes: vec![] };
    s.send(&json(&Message::Subscribe(message::Subscribe {
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        stream: stream.clone(),
        subscription_id: None,
        start: Some(message::StartPosition::Earliest),
        shard: None,
        queue_capacity: None,
        filter: Some(filter),
    })))
    .await?;
    s.message().await?;
    let (_pc, mut p, _) = raw_session(t, Some(0x0001), None, Features::NONE).await?;
    for (key, payload) in [("k-a", "first"), ("k-b", "other"), ("k-a", "second")] {
        p.send(&keyed_publish(t, &stream, key, &[payload], None)).await?;
    }
    let frames = next_event_frames(&c, 3).await?;
    let mut got = Vec::new();
    for f in &frames[1..] {
        let Ok(Payload::Events(e)) = f.decode_payload() else {
            return Err("an event batch that does not decode".into());
        };
        got.push((e.base_offset, e.skipped_before, e.records.payloads().collect::<Vec<_>>()));
    }
    let want = vec![
        (Some(0), None, vec![Bytes::from_static(b"first")]),
        (Some(2), Some(1), vec![Bytes::from_static(b"second")]),
    ];
    expect(got == want, || format!("got {got:?}"))?;
    Ok(PASSED)
}

/// D58: an envelope reaches a subscriber that reads envelopes as sent, and one that does not
/// gets the plain frame it always got. Skipped against a broker that does not advertise
/// FLAG_HI_ENVELOPE.
async fn envelopes_only_when_offered(t: &Target) -> Check {
    let (_pc, mut p, answer) = raw_session(t, Some(0xFFFF), Some(0x4), Features::NONE).await?;
    let Message::AuthOk(ok) = answer else { return skipped("no auth_ok") };
    if ok.server_flags & 0x8000 == 0 || ok.server_flags_hi.unwrap_or(0) & 0x4 == 0 {
        return skipped("the broker does not advertise FLAG_HI_ENVELOPE (D58)");
    }
    let stream = format!("sealed-{}", std::process::id());
    let (ec, mut es, _) = raw_session(t, Some(0xFFFF), Some(0x4), Features::NONE).await?;
    es.send(&t.subscribe(&stream)).await?;
    es.message().await?;
    let (lc, mut ls, _) = raw_session(t, Some(0x0007), None, Features::NONE).await?;
    ls.send(&t.subscribe(&stream)).await?;
    ls.message().await?;
    let envelope = b"\x01\x01\x02k1";
    p.send(&keyed_publish(t, &stream, "k", &["sealed"], Some(envelope))).await?;
    let ef = next_event_frames(&ec, 2).await?;
    let lf = next_event_frames(&lc, 2).await?;
    let Ok(Payload::Events(e)) = ef[1].decode_payload() else {
        return Err("an event batch that does not decode".into());
    };
    expect(e.records.envelope().map(|e| &e[..]) == Some(&envelope[..]), || {
        format!("envelope {:?}", e.records.envelope())
    })?;
    expect(lf[1].flags == Flags::BINARY_EVENT_BATCH_SHARED, || format!("legacy subscriber got flags {}", lf[1].flags))?;
    Ok(PASSED)
}

async fn error_codes_only_when_offered(t: &Target) -> Check {
    let c = t.connect().await?;
    let bad = json(&Message::Publish(message::Publish {
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        stream: "codes".into(),
        payload: "x".into(),
        key: None,
        shard: None,
        request_id: None,
        ack: Some(AckMode::PerBatch),
        publish_width: None,
    }));
    let (mut legacy, _) = t.session(&c, None, None).await?;
    legacy.send(&bad).await?;
    match legacy.message().await? {
        Message::Error(e) => expect(e.code.is_none() && e.retry.is_none() && e.detail.is_none(), || {
            "an error to a client without FEATURE_ERROR_CODES carries code fields".into()
        })?,
        other => return Err(format!("expected error, got {other:?}")),
    }
    let (mut modern, answer) = t.session(&c, Some(0x0019), Some(Features::ERROR_CODES.0 as u32)).await?;
    let advertised = matches!(&answer, Message::AuthOk(ok)
        if Features::from_words(ok.server_features, ok.server_features_hi).contains(Features::ERROR_CODES));
    modern.send(&bad).await?;
    match modern.message().await? {
        Message::Error(e) if advertised => {
            expect(e.code.is_some(), || "no code for a client that offered FEATURE_ERROR_CODES".into())?;
            Ok(PASSED)
        }
        // A broker without the feature sends no code fields to anyone; the half that applies held.
        Message::Error(e) => {
            expect(e.code.is_none(), || {
                "code fields from a broker that does not advertise FEATURE_ERROR_CODES".into()
            })?;
            skipped("the broker does not advertise FEATURE_ERROR_CODES (checked only that nobody gets code fields)")
        }
        other => Err(format!("expected error, got {other:?}")),
    }
}

async fn unknown_flag_bit_is_rejected_not_masked(t: &Target) -> Check {
    let c = t.connect().await?;
    let (mut s, _) = t.session(&c, Some(0x7FFF), None).await?;
    let mut frame = t.publish_binary("flags", Some(77)).to_vec();
    frame[6] |= 0x80; // bit 15
    s.send(&frame).await?;
    let f = s.next().await?.ok_or("stream ended instead of answering")?;
    match f.decode_payload().map_err(|e| e.to_string())? {
        Payload::Ack(a) => expect(a.status == AckStatus::Error && a.request_id == 77, || format!("{a:?}"))?,
        Payload::Json(Decoded::Message(Message::Error(_))) => {}
        other => return Err(format!("expected a refusal, got {other:?}")),
    }
    // The stream still works: the frame was skipped, not misparsed.
    s.send(&t.publish_binary("flags", Some(78))).await?;
    let f = s.next().await?.ok_or("stream ended")?;
    match f.decode_payload().map_err(|e| e.to_string())? {
        Payload::Ack(a) => {
            expect(a.status == AckStatus::Ok && a.request_id == 78, || format!("{a:?}")).map(|()| PASSED)
        }
        other => Err(format!("expected an ok ack, got {other:?}")),
    }
}

async fn unknown_type_unsupported_or_closed(t: &Target) -> Check {
    let c = t.connect().await?;
    let unknown = {
        let body = br#"{"type":"conformance_probe","request_id":9}"#;
        let mut b = BytesMut::new();
        FrameHeader { flags: Flags::EMPTY, length: body.len() as u32 }.encode(&mut b);
        b.extend_from_slice(body);
        b.freeze()
    };
    let (mut with, answer) = t.session(&c, Some(0x0019), Some(Features::UNSUPPORTED.0 as u32)).await?;
    let advertised = match &answer {
        Message::AuthOk(ok) => {
            Features::from_words(ok.server_features, ok.server_features_hi).contains(Features::UNSUPPORTED)
        }
        _ => false,
    };
    with.send(&unknown).await?;
    if advertised {
        match with.message().await? {
            Message::Unsupported(u) => {
                expect(u.request_type == "conformance_probe" && u.request_id == Some(9), || format!("{u:?}"))?
            }
            other => return Err(format!("expected unsupported, got {other:?}")),
        }
    }
    let (mut without, _) = t.session(&c, Some(0x0019), None).await?;
    without.send(&unknown).await?;
    match without.next().await {
        Ok(None) if advertised => Ok(PASSED),
        Ok(None) => Ok(Verdict::Passed(Some(
            "the broker does not advertise FEATURE_UNSUPPORTED: checked the stream is closed".into(),
        ))),
        Ok(Some(f)) => Err(format!(
            "a client without FEATURE_UNSUPPORTED got an answer: {:?}",
            String::from_utf8_lossy(&f.payload)
        )),
        Err(e) => Err(format!("the stream was not closed: {e}")),
    }
}

async fn malformed_acked_publish_answered_by_request_id(t: &Target) -> Check {
    let c = t.connect().await?;
    let (mut s, _) = t.session(&c, Some(0x7FFF), None).await?;
    let mut frame = t.publish_binary("malformed", Some(4242)).to_vec();
    let n = frame.len();
    frame[n - 8] = 0xFF; // a payload length far past the end
    s.send(&frame).await?;
    let f = s.next().await?.ok_or("stream ended")?;
    match f.decode_payload().map_err(|e| e.to_string())? {
        Payload::Ack(a) => {
            expect(a.status == AckStatus::Error && a.request_id == 4242, || format!("{a:?}")).map(|()| PASSED)
        }
        other => Err(format!("expected an error ack naming request 4242, got {other:?}")),
    }
}

async fn reply_matches_request_encoding(t: &Target) -> Check {
    let c = t.connect().await?;
    let (mut s, _) = t.session(&c, Some(0x7FFF), None).await?;
    s.send(&json(&Message::PublishBatch(message::PublishBatchMsg {
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        stream: "encoding".into(),
        payloads: vec!["a".into()],
        key: None,
        shard: None,
        request_id: Some(5),
        ack: Some(AckMode::PerBatch),
        publish_width: None,
    })))
    .await?;
    match s.message().await? {
        Message::PublishOk(ok) => expect(ok.request_id == 5, || format!("{ok:?}"))?,
        other => return Err(format!("a JSON publish must get a JSON answer, got {other:?}")),
    }
    s.send(&t.publish_binary("encoding", Some(6))).await?;
    let f = s.next().await?.ok_or("stream ended")?;
    expect(f.flags.contains(Flags::BINARY_PUBLISH_ACK), || {
        format!("a binary acked publish must get a binary ack, got flags {}", f.flags)
    })?;
    let a = PublishAck::decode(f.flags, f.payload).map_err(|e| e.to_string())?;
    expect(a.request_id == 6, || format!("{a:?}")).map(|()| PASSED)
}

async fn oversize_frame_is_refused(t: &Target) -> Check {
    let c = t.connect().await?;
    let (mut s, _) = t.session(&c, Some(0x0019), None).await?;
    let mut h = BytesMut::new();
    FrameHeader { flags: Flags::BINARY_PUBLISH_BATCH, length: u32::MAX }.encode(&mut h);
    s.send(&h).await?;
    // The broker refuses on the header alone, by ending the stream (the existing Felix broker)
    // or by closing the connection (ours: a framing violation, DECISIONS.md). Either is right;
    // waiting for the payload is not.
    let ended = async {
        loop {
            match s.recv.read_chunk(64 * 1024, true).await {
                Ok(Some(_)) => continue,
                Ok(None) | Err(quinn::ReadError::Reset(_)) => return "ended the stream",
                Err(_) => return "closed the connection",
            }
        }
    };
    let how = tokio::select! {
        how = ended => how,
        _ = c.quic.closed() => "closed the connection",
        () = tokio::time::sleep(WAIT) => return Err("a 4 GiB frame header neither ended the stream nor closed the connection".into()),
    };
    Ok(Verdict::Passed(Some(format!("the broker {how}"))))
}

fn features(f: Features) -> Option<u32> {
    f.to_words(false).0
}

/// Whether the broker advertises `f` (from a fully negotiating session).
async fn advertises(t: &Target, c: &Conn, f: Features) -> Result<bool, String> {
    match t.session(c, Some(0x7FFF), features(Features::ERROR_CODES)).await?.1 {
        Message::AuthOk(ok) => {
            let words = Features::from_words(ok.server_features, ok.server_features_hi);
            Ok(words.contains(f))
        }
        other => Err(format!("expected auth_ok, got {other:?}")),
    }
}

/// `version` on `cache_value` only for a client that offered FEATURE_CACHE_CONDITIONAL.
async fn cache_version_only_when_offered(t: &Target) -> Check {
    let c = t.connect().await?;
    if !advertises(t, &c, Features::CACHE_CONDITIONAL).await? {
        return skipped("the broker does not advertise FEATURE_CACHE_CONDITIONAL");
    }
    let put = json(&Message::CachePut(message::CachePut {
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        cache: "versions".into(),
        key: "k".into(),
        value: "v".into(),
        request_id: Some(1),
        ttl_ms: None,
    }));
    let get = json(&Message::CacheGet(message::CacheGet {
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        cache: "versions".into(),
        key: "k".into(),
        request_id: Some(2),
    }));
    let (mut modern, _) = t.session(&c, Some(0x0001), features(Features::CACHE_CONDITIONAL)).await?;
    modern.send(&put).await?;
    modern.message().await?;
    modern.send(&get).await?;
    match modern.message().await? {
        Message::CacheValue(v) => expect(v.version.is_some(), || "no version for a client that offered it".into())?,
        other => return Err(format!("expected cache_value, got {other:?}")),
    }
    let (mut legacy, _) = t.session(&c, None, None).await?;
    legacy.send(&get).await?;
    match legacy.message().await? {
        Message::CacheValue(v) => expect(v.version.is_none() && v.value.is_some(), || {
            "a client that did not offer FEATURE_CACHE_CONDITIONAL got a version".into()
        })
        .map(|()| PASSED),
        other => Err(format!("expected cache_value, got {other:?}")),
    }
}

/// `offset` on `publish_ok` only for a client that offered flag 0x1000 (answered after the
/// write: FEATURE_ACK_ON_COMMIT offered by both).
async fn publish_offset_only_when_offered(t: &Target) -> Check {
    let c = t.connect().await?;
    if !advertises(t, &c, Features::ACK_ON_COMMIT).await? {
        return skipped("the broker does not advertise FEATURE_ACK_ON_COMMIT (no offsets to check)");
    }
    let publish = json(&Message::Publish(message::Publish {
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        stream: "offsets".into(),
        payload: "x".into(),
        key: None,
        shard: None,
        request_id: Some(7),
        ack: Some(AckMode::PerBatch),
        publish_width: None,
    }));
    for (flags, want) in [(0x1001u16, true), (0x0001, false)] {
        let (mut s, _) = t.session(&c, Some(flags), features(Features::ACK_ON_COMMIT)).await?;
        s.send(&publish).await?;
        match s.message().await? {
            Message::PublishOk(ok) => {
                expect(ok.offset.is_some() == want, || format!("client_flags {flags:#06x}: offset {:?}", ok.offset))?
            }
            other => return Err(format!("expected publish_ok, got {other:?}")),
        }
    }
    Ok(PASSED)
}

/// `publisher` and `timestamp_micros` on group records only for clients that offered
/// FEATURE_GROUP_PUBLISHER / FEATURE_RECORD_TIMESTAMPS.
async fn group_record_fields_only_when_offered(t: &Target) -> Check {
    let c = t.connect().await?;
    if !advertises(t, &c, Features::CONSUMER_GROUP | Features::ACK_ON_COMMIT).await? {
        return skipped("the broker does not advertise FEATURE_CONSUMER_GROUP and FEATURE_ACK_ON_COMMIT");
    }
    let stream = format!("groups-{}", std::process::id());
    let publish = json(&Message::Publish(message::Publish {
        tenant_id: t.tenant.clone(),
        namespace: "conformance".into(),
        stream: stream.clone(),
        payload: "x".into(),
        key: None,
        shard: None,
        request_id: Some(1),
        ack: Some(AckMode::PerBatch),
        publish_width: None,
    }));
    let (mut p, _) = t.session(&c, Some(0x0001), features(Features::ACK_ON_COMMIT)).await?;
    p.send(&publish).await?;
    p.message().await?;
    let poll = |group: &str| {
        json(&Message::GroupPoll(message::GroupPoll {
            tenant_id: t.tenant.clone(),
            namespace: "conformance".into(),
            stream: stream.clone(),
            shard: 0,
            group: group.into(),
            max_records: 1,
            wait_ms: 0,
            request_id: 9,
            consumer: None,
            reclaim: None,
            visibility_ms: None,
        }))
    };
    let rich = Features::CONSUMER_GROUP | Features::GROUP_PUBLISHER | Features::RECORD_TIMESTAMPS;
    for (f, group, want) in [(rich, "rich", true), (Features::CONSUMER_GROUP, "plain", false)] {
        let (mut s, _) = t.session(&c, Some(0x0001), features(f)).await?;
        s.send(&poll(group)).await?;
        match s.message().await? {
            Message::GroupRecords(r) => {
                let rec = r.records.first().ok_or("no record polled")?;
                expect(rec.publisher.is_some() == want && rec.timestamp_micros.is_some() == want, || {
                    format!("group {group}: publisher {:?}, timestamp {:?}", rec.publisher, rec.timestamp_micros)
                })?;
            }
            other => return Err(format!("expected group_records, got {other:?}")),
        }
    }
    Ok(PASSED)
}

/// Runs every check; prints one line each and the totals.
pub async fn run(t: Target) -> ExitCode {
    let checks: Vec<(&str, CheckFuture<'_>)> = vec![
        ("negotiating client gets auth_ok", Box::pin(row1_negotiating(&t))),
        ("legacy client gets exactly {\"type\":\"ok\"}", Box::pin(row3_legacy_gets_plain_ok(&t))),
        ("legacy client gets the legacy frames", Box::pin(legacy_frames_are_the_old_frames(&t))),
        ("error codes only for FEATURE_ERROR_CODES clients", Box::pin(error_codes_only_when_offered(&t))),
        ("bit 15 not negotiated: rejected, not masked", Box::pin(unknown_flag_bit_is_rejected_not_masked(&t))),
        ("compressed batches only to their codec's subscribers", Box::pin(compressed_batches_only_when_offered(&t))),
        ("filtered subscription: its keys, the rest as skipped", Box::pin(filtered_subscription_when_offered(&t))),
        ("envelopes only to subscribers that read them", Box::pin(envelopes_only_when_offered(&t))),
        ("unknown type: unsupported or stream closed", Box::pin(unknown_type_unsupported_or_closed(&t))),
        (
            "malformed acked publish answered by request_id",
            Box::pin(malformed_acked_publish_answered_by_request_id(&t)),
        ),
        ("reply matches the request's encoding", Box::pin(reply_matches_request_encoding(&t))),
        ("oversize frame refused on the header", Box::pin(oversize_frame_is_refused(&t))),
        ("cache version only for FEATURE_CACHE_CONDITIONAL clients", Box::pin(cache_version_only_when_offered(&t))),
        ("publish_ok offset only for flag 0x1000 clients", Box::pin(publish_offset_only_when_offered(&t))),
        ("group record publisher/timestamp only when offered", Box::pin(group_record_fields_only_when_offered(&t))),
    ];
    let (mut passed, mut failed, mut skipped) = (0, 0, 0);
    for (name, check) in checks {
        match check.await {
            Ok(Verdict::Passed(note)) => {
                passed += 1;
                match note {
                    Some(n) => out!("ok   {name} ({n})"),
                    None => out!("ok   {name}"),
                }
            }
            Ok(Verdict::Skipped(why)) => {
                skipped += 1;
                out!("skip {name}: {why}");
            }
            Err(e) => {
                failed += 1;
                out!("FAIL {name}: {e}");
            }
        }
    }
    out!("{passed} passed, {failed} failed, {skipped} skipped");
    if failed == 0 { ExitCode::SUCCESS } else { ExitCode::FAILURE }
}
