//! Compressed batches (D56): negotiated by bit 15 and the second flag word, stored as they
//! came, sent as stored to every subscriber that took the codec, plain to every other one, and
//! refused before inflating when they declare more than the frame limit.

mod support;

use bytes::{Bytes, BytesMut};
use felix_proto::binary::{AckMode, AckStatus, AckedPrefix, Codec, Compressor, PublishBatch};
use felix_proto::broker::{Broker, BrokerOutput, StorageOutput, TransportOutput};
use felix_proto::client::{ClientConfig, ClientConnection, ClientEvent, ClientOutput, ClientStream, PublishRequest};
use felix_proto::features::Features;
use felix_proto::flags::Flags;
use felix_proto::message::{self, Message, StartPosition};
use felix_proto::samples::COMPRESSIBLE;
use felix_proto::storage::PersistRequest;
use felix_proto::transport::{ConnId, Dir, Side, StreamId, WallClock};
use felix_proto::{Payload, Records};
use support::*;

fn auth_hi(flags: u16, hi: Option<u16>) -> Bytes {
    json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: TOKEN.into(),
        client_flags: Some(flags),
        client_flags_hi: hi,
        client_features: None,
        client_features_hi: None,
    }))
}

fn compressed_publish<P: AsRef<[u8]>>(codec: Codec, request_id: Option<u64>, payloads: &[P]) -> Bytes {
    let b = PublishBatch {
        acked: request_id.map(|request_id| AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
        idempotent: None,
        key: None,
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        records: Records::default(),
    };
    let mut out = BytesMut::new();
    let mut c = Compressor::new(codec, codec.default_level()).unwrap();
    b.encode_payloads_compressed(payloads, &mut c, &mut out).unwrap();
    assert!(Flags(u16::from_be_bytes([out[6], out[7]])).contains(Flags::EXTENDED), "the sample compresses");
    out.freeze()
}

/// Everything the broker sent each connection, and the writes it asked for (each settled as
/// written), until it has nothing more to do.
fn drain(b: &mut Broker, now: std::time::Instant) -> (Vec<(ConnId, Bytes)>, Vec<PersistRequest>) {
    let mut sent = Vec::new();
    let mut writes: Vec<PersistRequest> = Vec::new();
    loop {
        let before = writes.len();
        let mut any = false;
        while let Some(o) = b.poll_output() {
            any = true;
            match o {
                BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }) => {
                    b.handle_stream_opened(conn, token, StreamId(3), now)
                }
                BrokerOutput::Transport(TransportOutput::Transmit { conn, data, .. }) => sent.push((conn, data)),
                BrokerOutput::Storage(StorageOutput::Persist(w)) => writes.push(w),
                _ => {}
            }
        }
        for w in &writes[before..] {
            b.handle_write_complete(w.token, true, now);
        }
        if !any {
            return (sent, writes);
        }
    }
}

/// A broker with a subscriber to `orders` per offer (`client_flags`, `client_flags_hi`) and a
/// publisher offering 0xFFFF and `publisher_hi`, with the publisher's `auth_ok`.
fn subscribers_and_publisher(
    offers: &[(u16, Option<u16>)],
    publisher_hi: Option<u16>,
) -> (Broker, std::time::Instant, Vec<ConnId>, ConnId, message::AuthOk) {
    let now = epoch();
    let mut b = Broker::new(config(), WallClock::new(now, 0));
    let mut subs = Vec::new();
    for &(flags, hi) in offers {
        let conn = b.connection_opened(now);
        b.handle_stream_data(conn, StreamId(0), auth_hi(flags, hi), false, now);
        b.handle_stream_data(conn, StreamId(0), subscribe("orders", None), false, now);
        subs.push(conn);
    }
    let publisher = b.connection_opened(now);
    b.handle_stream_data(publisher, StreamId(0), auth_hi(0xFFFF, publisher_hi), false, now);
    let (sent, _) = drain(&mut b, now);
    let Some(Message::AuthOk(ok)) = messages(&bytes_to(&sent, publisher)).into_iter().next() else { panic!() };
    (b, now, subs, publisher, ok)
}

fn bytes_to(sent: &[(ConnId, Bytes)], conn: ConnId) -> Vec<u8> {
    sent.iter().filter(|(c, _)| *c == conn).flat_map(|(_, d)| d.to_vec()).collect()
}

/// Event frames in what a connection received (its event stream's bytes follow the control
/// answers; the decoder here accepts bit 15 so a frame the subscriber could not read shows).
fn event_frames(bytes: &[u8]) -> Vec<felix_proto::Frame> {
    let mut d = felix_proto::FrameDecoder::new();
    d.set_accepted_flags(Flags::KNOWN);
    d.push(Bytes::copy_from_slice(bytes));
    let mut out = Vec::new();
    while let Ok(Some(f)) = d.next_frame() {
        if f.flags.intersects(Flags::BINARY_EVENT_BATCH_SHARED) {
            out.push(f);
        }
    }
    out
}

/// Every frame in `bytes`, bit 15 accepted.
fn event_frames_any(bytes: &[u8]) -> Vec<felix_proto::Frame> {
    let mut d = felix_proto::FrameDecoder::new();
    d.set_accepted_flags(Flags::KNOWN);
    d.push(Bytes::copy_from_slice(bytes));
    std::iter::from_fn(|| d.next_frame().ok().flatten()).collect()
}

#[test]
fn a_compressed_batch_is_stored_as_it_came_and_sent_as_stored_only_to_subscribers_of_its_codec() {
    // Both codecs; lz4 only; a subscriber that predates D56 (the original flags, nothing else).
    let (mut b, now, subs, publisher, ok) =
        subscribers_and_publisher(&[(0xFFFF, Some(0x3)), (0xFFFF, Some(0x2)), (0x0007, None)], Some(0x3));
    assert_eq!((ok.server_flags, ok.server_flags_hi), (0xFFFF, Some(0x7)));

    let frame = compressed_publish(Codec::Zstd, None, &COMPRESSIBLE);
    b.handle_stream_data(publisher, StreamId(0), frame.clone(), false, now);
    let (sent, writes) = drain(&mut b, now);
    assert_eq!(writes.len(), 1);
    let stored = writes[0].records.packed().expect("stored compressed");
    assert_eq!(stored.codec, Codec::Zstd);
    assert!(frame.ends_with(&stored.data), "the stored block is the publisher's");
    // Header, second word, three names, count and raw_len: the rest is the block.
    assert_eq!(frame.len() - stored.data.len(), 12 + 2 + (2 + 2) + (2 + 7) + (2 + 6) + 4 + 4, "and all of it");
    let plain: Vec<Bytes> = COMPRESSIBLE.iter().map(|p| Bytes::from(p.as_bytes())).collect();

    // Both codecs: the publisher's block, as stored.
    let f = event_frames(&bytes_to(&sent, subs[0]));
    assert_eq!(f.len(), 1);
    assert!(f[0].flags.contains(Flags::EXTENDED));
    assert!(f[0].payload.ends_with(&stored.data), "sent as stored");
    let Ok(Payload::Events(e)) = f[0].decode_payload() else { panic!() };
    assert_eq!(e.records.payloads().collect::<Vec<_>>(), plain);
    // lz4 only, and the legacy subscriber: plain.
    for (i, conn) in subs[1..].iter().enumerate() {
        let f = event_frames(&bytes_to(&sent, *conn));
        assert_eq!(f.len(), 1, "subscriber {i}");
        assert!(!f[0].flags.contains(Flags::EXTENDED), "subscriber {i}: plain");
        let Ok(Payload::Events(e)) = f[0].decode_payload() else { panic!() };
        assert_eq!(e.records.payloads().collect::<Vec<_>>(), plain);
    }
    // The legacy subscriber's frame is byte-identical to the one a plain publish gives it.
    let legacy_compressed = event_frames(&bytes_to(&sent, subs[2]));
    b.handle_stream_data(publisher, StreamId(0), publish_binary("orders", &COMPRESSIBLE, None, None), false, now);
    let (sent, _) = drain(&mut b, now);
    let legacy_plain = event_frames(&bytes_to(&sent, subs[2]));
    assert_eq!(legacy_compressed[0].payload, legacy_plain[0].payload);
    assert_eq!(legacy_compressed[0].flags, legacy_plain[0].flags);
    assert_eq!(legacy_plain[0].flags, Flags::BINARY_EVENT_BATCH_SHARED);
}

#[test]
fn a_subscriber_starting_inside_a_compressed_batch_gets_the_rest_of_it_plain() {
    let mut sim = felix_proto::sim::Sim::new(config(), epoch());
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    sim.raw_send(p, s, auth_hi(0xFFFF, Some(0x3)), false);
    sim.run();
    sim.take_received(p, s);
    sim.raw_send(p, s, compressed_publish(Codec::Lz4, None, &COMPRESSIBLE), false);
    sim.run();
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Earliest)), false);
    sim.raw_send(p, s, subscribe("orders", Some(StartPosition::Offset(2))), false);
    sim.run();
    let answers = messages(&sim.take_received(p, s));
    let es = event_streams(&sim, p);
    assert_eq!(es.len(), 2, "{answers:?}");
    let whole = event_frames(&sim.take_received(p, es[0]));
    let tail = event_frames(&sim.take_received(p, es[1]));
    assert!(whole[0].flags.contains(Flags::EXTENDED), "from the batch's first offset: as stored");
    assert!(!tail[0].flags.contains(Flags::EXTENDED), "from inside it: the rest, plain");
    let Ok(Payload::Events(e)) = tail[0].decode_payload() else { panic!() };
    assert_eq!(e.base_offset, Some(2));
    assert_eq!(
        e.records.payloads().collect::<Vec<_>>(),
        vec![Bytes::from(COMPRESSIBLE[2]), Bytes::from(COMPRESSIBLE[3])]
    );
}

#[test]
fn a_batch_declaring_more_than_the_frame_limit_is_refused_before_it_is_inflated_and_nothing_is_written() {
    let mut cfg = config();
    cfg.max_frame_len = 64 << 10;
    let now = epoch();
    let mut b = Broker::new(cfg, WallClock::new(now, 0));
    let conn = b.connection_opened(now);
    b.handle_stream_data(conn, StreamId(0), auth_hi(0xFFFF, Some(0x3)), false, now);
    drain(&mut b, now);
    // 4 MiB of zeros packs into a few hundred bytes: a frame far under the limit.
    let zeros = vec![0u8; 4 << 20];
    for codec in Codec::ALL {
        let bomb = compressed_publish(codec, Some(9), &[&zeros[..]]);
        assert!(bomb.len() < 32 << 10, "{codec}: {}", bomb.len());
        b.handle_stream_data(conn, StreamId(0), bomb, false, now);
        let (sent, writes) = drain(&mut b, now);
        assert!(writes.is_empty(), "{codec}: nothing written");
        let a = acks(&payloads(&bytes_to(&sent, conn)));
        assert_eq!(a.len(), 1);
        assert_eq!((a[0].request_id, a[0].status), (9, AckStatus::Error));
        assert!(a[0].message.contains("at most 65536"), "{}", a[0].message);
    }
    // The stream goes on.
    b.handle_stream_data(conn, StreamId(0), compressed_publish(Codec::Zstd, Some(10), &COMPRESSIBLE), false, now);
    let (sent, writes) = drain(&mut b, now);
    assert_eq!(writes.len(), 1);
    assert_eq!(acks(&payloads(&bytes_to(&sent, conn)))[0].status, AckStatus::Ok);
}

#[test]
fn bit_15_is_refused_from_a_client_that_was_not_shown_it() {
    let now = epoch();
    let mut b = Broker::new(config(), WallClock::new(now, 0));
    let conn = b.connection_opened(now);
    // The second word without bit 15 counts for nothing: the answer is the pre-D56 one.
    b.handle_stream_data(conn, StreamId(0), auth_hi(0x7FFF, Some(0x3)), false, now);
    let (sent, _) = drain(&mut b, now);
    let Some(Message::AuthOk(ok)) = messages(&bytes_to(&sent, conn)).into_iter().next() else { panic!() };
    assert_eq!((ok.server_flags, ok.server_flags_hi), (0x7FFF, None));
    // A compressed batch is refused; a peer that predates D56 and set the then reserved bit
    // is answered by its request id where it put it (D7).
    b.handle_stream_data(conn, StreamId(0), compressed_publish(Codec::Zstd, Some(5), &COMPRESSIBLE), false, now);
    let mut reserved = publish_binary("orders", &["x"], Some(6), None).to_vec();
    reserved[6] |= 0x80;
    b.handle_stream_data(conn, StreamId(0), Bytes::from(reserved), false, now);
    let (sent, writes) = drain(&mut b, now);
    assert!(writes.is_empty());
    let a = acks(&payloads(&bytes_to(&sent, conn)));
    assert_eq!(a.len(), 2);
    assert!(a.iter().all(|a| a.status == AckStatus::Error));
    assert_eq!(a[1].request_id, 6, "answered by its request id (D7)");
}

fn client_after(auth_ok: Message, compress: Option<(Codec, i32)>) -> (ClientConnection, StreamId) {
    let now = epoch();
    let cfg = ClientConfig { compress, ..ClientConfig::new("t1", TOKEN) };
    let mut c = ClientConnection::new(cfg, now);
    let Some(ClientOutput::OpenBi { token }) = c.poll_output() else { panic!() };
    let s = StreamId::new(Side::Client, Dir::Bi, 0);
    c.handle_stream_opened(token, s, now);
    while c.poll_output().is_some() {}
    c.handle_stream_data(s, json(&auth_ok), false, now);
    assert!(matches!(c.poll_event(), Some(ClientEvent::Connected { .. })));
    (c, s)
}

fn published_flags(c: &mut ClientConnection) -> Flags {
    let req = PublishRequest::new("default", "orders", COMPRESSIBLE.iter().map(|p| Bytes::from(*p)).collect());
    c.publish(ClientStream(0), req, epoch()).unwrap();
    loop {
        match c.poll_output() {
            Some(ClientOutput::Transmit { data, .. }) => return event_frames_any(&data)[0].flags,
            Some(_) => {}
            None => panic!("nothing sent"),
        }
    }
}

#[test]
fn a_client_compresses_only_for_a_broker_that_takes_its_codec() {
    let ok = |flags: u16, hi: Option<u16>| {
        Message::AuthOk(message::AuthOk {
            server_flags: flags,
            server_flags_hi: hi,
            server_features: Some(Features::ERROR_CODES.0 as u32),
            server_features_hi: None,
            listener_ports: None,
            publish_window: None,
        })
    };
    let zstd = Some((Codec::Zstd, 3));
    assert!(published_flags(&mut client_after(ok(0xFFFF, Some(3)), zstd).0).contains(Flags::EXTENDED));
    // A broker that takes lz4 only, one that predates D56, and a client not asked to compress.
    assert!(!published_flags(&mut client_after(ok(0xFFFF, Some(2)), zstd).0).contains(Flags::EXTENDED));
    assert!(!published_flags(&mut client_after(ok(0x7FFF, None), zstd).0).contains(Flags::EXTENDED));
    assert!(!published_flags(&mut client_after(ok(0xFFFF, Some(3)), None).0).contains(Flags::EXTENDED));
    // A level the codec does not take is a clear error, not a panic.
    let mut c = client_after(ok(0xFFFF, Some(3)), Some((Codec::Zstd, 42))).0;
    let req = PublishRequest::new("default", "orders", vec![Bytes::from_static(b"x")]);
    match c.publish(ClientStream(0), req, epoch()) {
        Err(e) => assert!(e.to_string().contains("zstd takes levels 1–19, not 42"), "{e}"),
        Ok(_) => panic!("a level zstd does not take is refused"),
    }
}

#[test]
fn clients_compress_and_read_compressed_batches_end_to_end() {
    let mut sim = felix_proto::sim::Sim::new(config(), epoch());
    let publisher = sim.connect(ClientConfig { compress: Some((Codec::Zstd, 3)), ..ClientConfig::new("t1", TOKEN) });
    let reader = sim.connect(ClientConfig::new("t1", TOKEN));
    let legacy = sim.connect(ClientConfig { flags: Some(Flags(0x7FFF)), ..ClientConfig::new("t1", TOKEN) });
    sim.run();
    let mut ids = Vec::new();
    for who in [reader, legacy] {
        let now = sim.now;
        let req = felix_proto::client::SubscribeRequest {
            namespace: "default".into(),
            stream: "orders".into(),
            start: None,
            shard: None,
            queue_capacity: None,
            filter: None,
        };
        ids.push(sim.client(who).subscribe(ClientStream(0), req, now).unwrap());
    }
    sim.run();
    let payloads: Vec<Bytes> =
        (0..50).map(|i| Bytes::from(format!("{{\"n\":{i},\"{}\"}}", COMPRESSIBLE[i % 4]))).collect();
    let now = sim.now;
    sim.client(publisher)
        .publish(ClientStream(0), PublishRequest::new("default", "orders", payloads.clone()), now)
        .unwrap();
    sim.run();
    for (who, id) in [reader, legacy].into_iter().zip(ids) {
        assert_eq!(delivered_payloads(&sim, who, id), payloads, "client {who}");
    }
    assert!(sim.broker.stats().publishes_compressed >= 1);
}

/// D58: an envelope travels with its batch, stored and delivered as sent, only to subscribers
/// that read envelopes; everyone else gets the frame they always got.
#[test]
fn an_envelope_is_stored_and_delivered_only_to_subscribers_that_read_envelopes() {
    let (mut b, now, subs, publisher, ok) =
        subscribers_and_publisher(&[(0xFFFF, Some(0x7)), (0xFFFF, Some(0x3)), (0x0007, None)], Some(0x7));
    assert_eq!(ok.server_flags_hi, Some(0x7), "a single broker keeps envelopes");
    let envelope = Bytes::from_static(b"\x01\x01\x02k1");
    let batch = PublishBatch {
        acked: Some(AckedPrefix { request_id: 3, ack_mode: AckMode::PerBatch }),
        idempotent: None,
        key: None,
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        records: Records::from_payloads(COMPRESSIBLE).unwrap().with_envelope(Some(envelope.clone())),
    };
    let mut frame = BytesMut::new();
    batch.encode(&mut frame).unwrap();
    b.handle_stream_data(publisher, StreamId(0), frame.freeze(), false, now);
    let (sent, writes) = drain(&mut b, now);
    assert_eq!(writes.len(), 1);
    assert_eq!(writes[0].records.envelope(), Some(&envelope), "stored with its envelope");
    let got = event_frames(&bytes_to(&sent, subs[0]));
    let Ok(Payload::Events(e)) = got[0].decode_payload() else { panic!() };
    assert_eq!(e.records.envelope(), Some(&envelope), "delivered as sent");
    for conn in &subs[1..] {
        let got = event_frames(&bytes_to(&sent, *conn));
        let Ok(Payload::Events(e)) = got[0].decode_payload() else { panic!() };
        assert_eq!(e.records.envelope(), None);
        assert_eq!(e.records.payloads().count(), COMPRESSIBLE.len());
    }
    let legacy = event_frames(&bytes_to(&sent, subs[2]));
    assert_eq!(legacy[0].flags, Flags::BINARY_EVENT_BATCH_SHARED, "the frame a legacy subscriber always got");
}

#[test]
fn a_client_sends_an_envelope_only_to_a_broker_that_keeps_it() {
    let ok = |hi: Option<u16>| {
        Message::AuthOk(message::AuthOk {
            server_flags: 0xFFFF,
            server_flags_hi: hi,
            server_features: None,
            server_features_hi: None,
            listener_ports: None,
            publish_window: None,
        })
    };
    let sealed = || {
        let mut req = PublishRequest::new("default", "orders", vec![Bytes::from_static(b"ciphertext")]);
        req.envelope = Some(Bytes::from_static(b"\x01\x01\x02k1"));
        req
    };
    // A broker in a cluster shows the codecs only.
    let (mut c, _) = client_after(ok(Some(0x3)), None);
    let e = c.publish(ClientStream(0), sealed(), epoch()).expect_err("not advertised");
    assert!(e.to_string().contains("FLAG_HI_ENVELOPE"), "{e}");
    let (mut c, _) = client_after(ok(Some(0x7)), None);
    c.publish(ClientStream(0), sealed(), epoch()).unwrap();
    let data = std::iter::from_fn(|| c.poll_output())
        .find_map(|o| match o {
            ClientOutput::Transmit { data, .. } => Some(data),
            _ => None,
        })
        .unwrap();
    let f = &event_frames_any(&data)[0];
    let Ok(Payload::Publish(p)) = f.decode_payload() else { panic!() };
    assert_eq!(p.records.envelope(), Some(&Bytes::from_static(b"\x01\x01\x02k1")));
}
