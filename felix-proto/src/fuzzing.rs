//! Fuzz target bodies. The cargo-fuzz harnesses in `fuzz/` call these, and `cargo test` runs
//! them over the committed corpora, so a regression found once stays found.
//!
//! Each body asserts the properties that must hold for *any* input: no panic, and the
//! round-trip oracle: whatever decodes re-encodes to exactly the bytes it came from.

use crate::binary::{EventBatch, PublishAck, PublishBatch};
use crate::flags::Flags;
use crate::frame::{Frame, FrameDecoder, FrameError, HEADER_LEN};
use crate::message::{self, Decoded};
use crate::payload::Payload;
use bytes::{Bytes, BytesMut};

/// `frame` target: the first two bytes pick a chunk size and a frame limit, the rest is fed to a
/// [`FrameDecoder`] in chunks. Frames must never exceed the limit, every frame's payload must
/// decode or fail cleanly, and frames that decode must re-encode to their own bytes.
pub fn frame(data: &[u8]) {
    let (Some(&a), Some(&b)) = (data.first(), data.get(1)) else { return };
    let chunk = usize::from(a % 64) + 1;
    let max = u32::from(b) * 16;
    let input = &data[2..];
    let mut dec = FrameDecoder::new();
    dec.set_max_frame_len(max);
    let mut whole = Vec::new();
    for piece in input.chunks(chunk) {
        dec.push(Bytes::copy_from_slice(piece));
        loop {
            match dec.next_frame() {
                Ok(Some(f)) => {
                    assert!(f.payload.len() <= max as usize);
                    check_frame(&f);
                    whole.push(Ok(f));
                }
                Ok(None) => break,
                Err(e) => {
                    let fatal = e.is_fatal();
                    whole.push(Err(e));
                    if fatal {
                        break;
                    }
                }
            }
        }
        if dec.is_poisoned() {
            break;
        }
    }
    let _ = dec.finish();
    // The same bytes in one piece must give the same frames and errors.
    let mut one = FrameDecoder::new();
    one.set_max_frame_len(max);
    one.push(Bytes::copy_from_slice(input));
    let mut again = Vec::new();
    loop {
        match one.next_frame() {
            Ok(Some(f)) => again.push(Ok(f)),
            Ok(None) => break,
            Err(e) => {
                let fatal = e.is_fatal();
                again.push(Err(e));
                if fatal {
                    break;
                }
            }
        }
    }
    assert_eq!(whole, again, "chunking changed the result");
}

fn check_frame(f: &Frame) {
    if let Ok(p) = f.decode_payload() {
        let mut out = BytesMut::new();
        match p {
            Payload::Publish(b) => b.encode(&mut out).expect("decoded batch re-encodes"),
            Payload::Events(e) => e.encode(&mut out).expect("decoded batch re-encodes"),
            Payload::Ack(a) => {
                // An unknown retry byte is read as `fatal` (the spec's rule), so an ack is not
                // byte-canonical: its decoded value must be a fixpoint instead.
                let flags = a.encode(Flags::KNOWN, &mut out).expect("decoded ack re-encodes");
                assert_eq!(flags, f.flags, "an ack re-encodes with the flags it came with");
                let again =
                    PublishAck::decode(flags, out.freeze().slice(HEADER_LEN..)).expect("re-encoded ack decodes");
                assert_eq!(again, a, "ack value round trip");
                return;
            }
            Payload::Json(_) => return, // JSON is not byte-canonical on input
        }
        assert_eq!(&out[HEADER_LEN..], &f.payload[..], "binary round trip");
    }
}

/// `binary_payload` target: the first two bytes are flags, the rest a payload. Any flag set
/// that validates must decode cleanly or fail with a typed error, and re-encode byte for byte.
pub fn binary_payload(data: &[u8]) {
    let (Some(&a), Some(&b)) = (data.first(), data.get(1)) else { return };
    let flags = Flags(u16::from_be_bytes([a, b]));
    let payload = Bytes::copy_from_slice(&data[2..]);
    let _ = PublishBatch::peek_request_id(flags, &payload);
    if let Ok(flags) = flags.validate() {
        let f = Frame::new(flags, payload.clone());
        check_frame(&f);
    }
    // Each decoder also directly, whatever the flags say.
    let _ = PublishBatch::decode(flags, payload.clone());
    let _ = PublishAck::decode(flags, payload.clone());
    let _ = EventBatch::decode(flags, payload);
}

/// `json_message` target: any bytes as a JSON payload. A decoded message must re-encode, and
/// decoding the re-encoding must give the same message (canonical fixpoint).
pub fn json_message(data: &[u8]) {
    if let Ok(Decoded::Message(m)) = message::decode(data) {
        let once = m.to_json().expect("decoded message re-encodes");
        match message::decode(&once) {
            Ok(Decoded::Message(m2)) => {
                assert_eq!(m2.to_json().expect("re-encodes"), once, "canonical form is a fixpoint");
            }
            other => panic!("re-encoded message did not decode: {other:?}"),
        }
    }
}

/// Every error a decoder can report is either fatal or leaves the stream usable; this helper
/// exists so the fuzz harness can name the property.
pub fn error_is_classified(e: &FrameError) -> bool {
    e.is_fatal() || matches!(e, FrameError::Flags { .. })
}

/// `broker_session` target: a broker with two authenticated streams (one offering every flag and
/// feature, one legacy), then the input drives it: each step picks a stream (control, publish,
/// or one of the broker's event streams), a chunk of bytes, whether to finish, and a time step.
/// Storage completes in order and readers flush. The oracle: no panic, and every output names a
/// connection that exists.
///
/// `t0` is any instant (the caller's clock reading: this crate reads none).
pub fn broker_session(data: &[u8], t0: std::time::Instant) {
    use crate::broker::{Broker, BrokerConfig, BrokerOutput, StorageOutput, TokenGrant, TransportOutput};
    use crate::transport::{Dir, Side, StreamId, WallClock};
    use std::time::Duration;
    let cfg = BrokerConfig {
        tokens: vec![TokenGrant::dev("t")],
        publish_window: 2,
        event_stream_inflight_bytes: 64,
        max_pending_write_bytes: 256,
        history_reads: true,
        ..BrokerConfig::default()
    };
    let mut b = Broker::new(cfg, WallClock::new(t0, 0));
    let conn = b.connection_opened(t0);
    let auth = |flags: Option<u16>, features: Option<u32>| {
        let m = crate::Message::Auth(crate::message::Auth {
            tenant_id: "t1".into(),
            token: "t".into(),
            client_flags: flags,
            client_flags_hi: None,
            client_features: features,
            client_features_hi: features.map(|_| 0xF),
        });
        let mut out = BytesMut::new();
        m.encode(&mut out).expect("auth encodes");
        out.freeze()
    };
    let s0 = StreamId::new(Side::Client, Dir::Bi, 0);
    let s1 = StreamId::new(Side::Client, Dir::Bi, 1);
    let u0 = StreamId::new(Side::Client, Dir::Uni, 0);
    b.handle_stream_data(conn, s0, auth(Some(0x7FFF), Some(u32::MAX)), false, t0);
    b.handle_stream_data(conn, s1, auth(None, None), false, t0);
    let mut now = t0;
    let mut event_streams: Vec<StreamId> = Vec::new();
    let mut next_uni = 0u64;
    let mut rest = data;
    let mut steps = 0;
    while rest.len() >= 3 && steps < 256 {
        steps += 1;
        let (sel, len, flags) = (rest[0], usize::from(rest[1]), rest[2]);
        rest = &rest[3..];
        let take = len.min(rest.len());
        let chunk = Bytes::copy_from_slice(&rest[..take]);
        rest = &rest[take..];
        let fin = flags & 1 != 0;
        now += Duration::from_millis(u64::from(flags >> 1) * 10);
        match sel % 6 {
            0 => b.handle_stream_data(conn, s0, chunk, fin, now),
            // The same bytes handed over as two chunks at once, as the driver's readers do.
            1 if flags & 4 != 0 => {
                let mid = chunk.len() / 2;
                b.handle_stream_chunks(conn, s1, [chunk.slice(..mid), chunk.slice(mid..)], fin, now)
            }
            1 => b.handle_stream_data(conn, s1, chunk, fin, now),
            2 => b.handle_stream_data(conn, u0, chunk, fin, now),
            3 => b.handle_stream_reset(conn, if flags & 2 != 0 { s0 } else { s1 }, now),
            4 => {
                if let Some(s) = event_streams.get(usize::from(sel) % event_streams.len().max(1)) {
                    b.handle_stream_stopped(conn, *s, now);
                }
            }
            _ => b.handle_timeout(now),
        }
        let mut guard = 0;
        while let Some(o) = b.poll_output() {
            guard += 1;
            assert!(guard < 100_000, "output loop does not settle");
            match o {
                BrokerOutput::Transport(TransportOutput::Transmit { conn: c, stream, data }) => {
                    assert_eq!(c, conn);
                    if stream.initiator() == Side::Broker {
                        b.handle_stream_flushed(conn, stream, data.len(), now);
                    }
                }
                BrokerOutput::Transport(TransportOutput::OpenUni { conn: c, token }) => {
                    assert_eq!(c, conn);
                    let s = StreamId::new(Side::Broker, Dir::Uni, next_uni);
                    next_uni += 1;
                    event_streams.push(s);
                    b.handle_stream_opened(conn, token, s, now);
                }
                BrokerOutput::Storage(StorageOutput::Persist(w)) => {
                    b.handle_write_complete(w.token, flags & 4 == 0, now)
                }
                BrokerOutput::Storage(StorageOutput::Read(r)) => b.handle_read_complete(r.token, Vec::new(), now),
                BrokerOutput::Transport(TransportOutput::CloseConnection { .. }) => return,
                _ => {}
            }
        }
        // No unbounded growth: what subscribers have queued stays within their capacity.
        assert!(b.queued_event_bytes() <= 64 << 20, "queued {} bytes", b.queued_event_bytes());
    }
}

/// `client_session` target: a client state machine, authenticated by a scripted `auth_ok`
/// offering everything, then fed arbitrary operations: broker bytes on its control stream or on
/// broker-opened event streams, stream ends, and commands of every kind (publish, subscribe,
/// cache, stream_read, counters, groups, watches). The oracle: no panic, and bounded work (every
/// input settles, events and outputs are drained each step).
pub fn client_session(data: &[u8], t0: std::time::Instant) {
    use crate::client::{
        CacheWatchRequest, ClientConfig, ClientConnection, ClientOutput, ClientStream, PublishRequest,
        StreamReadRequest, SubscribeRequest, WatchOn,
    };
    use crate::transport::{Dir, Side, StreamId};
    use std::time::Duration;
    let mut c = ClientConnection::new(ClientConfig::new("t1", "t"), t0);
    let s0 = StreamId::new(Side::Client, Dir::Bi, 0);
    let mut opened = 0u64;
    let mut now = t0;
    let drain = |c: &mut ClientConnection, now: std::time::Instant, opened: &mut u64| {
        let mut guard = 0;
        while let Some(o) = c.poll_output() {
            guard += 1;
            assert!(guard < 100_000, "output loop does not settle");
            if let ClientOutput::OpenBi { token } = o {
                let s = StreamId::new(Side::Client, Dir::Bi, *opened);
                *opened += 1;
                c.handle_stream_opened(token, s, now);
            }
        }
        let mut events = 0;
        while c.poll_event().is_some() {
            events += 1;
            assert!(events < 100_000, "event loop does not settle");
        }
    };
    drain(&mut c, now, &mut opened);
    let auth_ok = crate::Message::AuthOk(crate::message::AuthOk {
        server_flags: crate::Flags::KNOWN.bits(),
        server_flags_hi: None,
        server_features: Some(crate::Features::known().to_words(true).0.unwrap_or(0)),
        server_features_hi: crate::Features::known().to_words(true).1,
        listener_ports: None,
        publish_window: Some(4),
    });
    let mut out = BytesMut::new();
    auth_ok.encode(&mut out).expect("auth_ok encodes");
    c.handle_stream_data(s0, out.freeze(), false, now);
    drain(&mut c, now, &mut opened);
    let mut rest = data;
    let mut steps = 0;
    while rest.len() >= 3 && steps < 256 {
        steps += 1;
        let (sel, len, arg) = (rest[0], usize::from(rest[1]), rest[2]);
        rest = &rest[3..];
        let take = len.min(rest.len());
        let chunk = Bytes::copy_from_slice(&rest[..take]);
        rest = &rest[take..];
        now += Duration::from_millis(u64::from(arg >> 4));
        let text = String::from_utf8_lossy(&chunk).into_owned();
        let stream = ClientStream(u32::from(arg & 1));
        match sel % 12 {
            0 => c.handle_stream_data(s0, chunk, arg & 2 != 0, now),
            // Event streams get their bytes as two chunks at once, as the driver's readers
            // hand them over.
            1 => {
                let mid = chunk.len() / 2;
                c.handle_stream_chunks(
                    StreamId::new(Side::Broker, Dir::Uni, u64::from(arg % 4)),
                    [chunk.slice(..mid), chunk.slice(mid..)],
                    arg & 2 != 0,
                    now,
                )
            }
            2 => c.handle_stream_data(StreamId::new(Side::Client, Dir::Bi, u64::from(arg % 3)), chunk, false, now),
            3 => {
                let mut req = PublishRequest::new("ns", text.clone(), vec![chunk.clone()]);
                req.ack = arg & 2 != 0;
                req.json = arg & 4 != 0;
                req.key = (arg & 8 != 0).then(|| chunk.clone());
                req.idempotent = (arg & 16 != 0).then_some((u64::from(arg), u64::from(sel)));
                req.expected_offset = (arg & 32 != 0).then_some(u64::from(sel));
                let _ = c.publish(stream, req, now);
            }
            4 => {
                let req = SubscribeRequest {
                    namespace: "ns".into(),
                    stream: text,
                    start: None,
                    shard: (arg & 2 != 0).then_some(u32::from(sel)),
                    queue_capacity: (arg & 4 != 0).then_some(u32::from(arg)),
                    filter: None,
                };
                let _ = c.subscribe(stream, req, now);
            }
            5 => {
                let _ = c.cache_put(stream, "ns", "c", &text, chunk, (arg & 2 != 0).then_some(5));
            }
            6 => {
                let _ = c.cache_get(stream, "ns", "c", &text);
                let _ = c.cache_delete(stream, "ns", "c", &text);
            }
            7 => {
                let req = StreamReadRequest {
                    namespace: "ns".into(),
                    stream: text,
                    shard: 0,
                    from: u64::from(arg),
                    end: None,
                    max_records: Some(u32::from(sel)),
                    max_bytes: None,
                    replica_local: sel & 1 == 1,
                };
                let _ = c.stream_read(stream, req);
                let _ = c.offset_for_time(stream, "ns", "s", 0, u64::from(arg));
            }
            8 => {
                let _ = c.counter_add(stream, "ns", "c", &text, i64::from(arg) - 128);
                let _ = c.counter_get(stream, "ns", "c", &text);
                let _ = c.producer_init(stream);
                let _ = c.stream_shards(stream, "ns", &text);
            }
            9 => {
                let filter = if arg & 2 != 0 { WatchOn::Key(text) } else { WatchOn::Prefix(text) };
                let req = CacheWatchRequest {
                    namespace: "ns".into(),
                    cache: "c".into(),
                    filter,
                    from_offset: (arg & 4 != 0).then_some(u64::from(sel)),
                    retained: arg & 8 != 0,
                };
                let _ = c.cache_watch(stream, req);
            }
            10 => {
                let _ = c.unsubscribe(u64::from(arg % 8), now);
                if arg & 2 != 0 {
                    let _ = c.open_stream(now);
                }
            }
            _ => {
                let _ = c.request(stream, |request_id| {
                    crate::Message::GroupPoll(crate::message::GroupPoll {
                        tenant_id: "t1".into(),
                        namespace: "ns".into(),
                        stream: text,
                        shard: 0,
                        group: "g".into(),
                        max_records: u32::from(arg),
                        wait_ms: 0,
                        request_id,
                        consumer: None,
                        reclaim: None,
                        visibility_ms: None,
                    })
                });
            }
        }
        drain(&mut c, now, &mut opened);
    }
}

/// `snapshot_record` target: any bytes as a kept snapshot record that a leader sends a
/// follower from, a piece at a time. The first two bytes pick where the piece starts (a
/// fraction of the record) and how long it is; the rest is the record. Reading a piece never
/// panics; a read that checks the CRC and succeeds agrees with the whole record's decoder (the
/// index it holds, the data's length, the piece's bytes), and the piece an unchecked read
/// gives of a record that decodes is that slice too.
pub fn snapshot_record(data: &[u8]) {
    use crate::cluster::meta::{decode_snapshot_record_alone, read_snapshot_record_piece};
    let (knobs, record) = data.split_at(data.len().min(2));
    let (at, len) = (knobs.first().copied().unwrap_or(0), knobs.get(1).copied().unwrap_or(0));
    let offset = (usize::from(at) * record.len() / 256) as u64;
    let max = u64::from(len) * 4 + 1;
    let whole = decode_snapshot_record_alone(&bytes::Bytes::copy_from_slice(record));
    let index = whole.as_ref().map_or(7, |s| s.get_metadata().index);
    let mut read_at = |pos: u64, buf: &mut [u8]| {
        let from = usize::try_from(pos).map_err(|_| std::io::ErrorKind::InvalidInput)?;
        let src = record.get(from..from.saturating_add(buf.len())).ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    };
    for verify in [true, false] {
        let piece = read_snapshot_record_piece(&mut read_at, record.len() as u64, index, offset, max, verify);
        match (&whole, piece) {
            (Some(s), Ok(p)) => {
                let from = offset as usize;
                let to = (from + p.data.len()).min(s.data.len());
                assert_eq!(p.total, s.data.len() as u64, "the data's length");
                assert_eq!(&p.data[..], &s.data[from.min(to)..to], "the piece is the data's slice");
            }
            (None, Ok(_)) => assert!(!verify, "a checked read of a record that does not decode"),
            (Some(s), Err(e)) => {
                let past = offset >= s.data.len() as u64 && !(offset == 0 && s.data.is_empty());
                assert!(past, "a record that decodes, read from {offset}: {e}");
            }
            (None, Err(_)) => {}
        }
    }
}

/// `replica_log` target: any bytes as a replicated shard's Raft log, cut into up to three
/// segments at the positions its first two bytes name. The fold never panics; a torn tail is
/// never past the bytes given; a log folded without damage leaves its commit within its
/// entries; and a log that folds without damage, cut anywhere inside its last segment's torn
/// tail, still folds without damage to the same log.
pub fn replica_log(data: &[u8]) {
    use crate::cluster::meta::fold_log_segments_checked;
    let (cuts, body) = data.split_at(data.len().min(2));
    let mut at: Vec<usize> = cuts.iter().map(|c| usize::from(*c) * body.len() / 256).collect();
    at.sort_unstable();
    let mut segments = Vec::new();
    let mut from = 0;
    for a in at.into_iter().chain(std::iter::once(body.len())) {
        segments.push(&body[from..a.max(from)]);
        from = a.max(from);
    }
    let (log, infos, damage) = fold_log_segments_checked(&segments);
    // The fold over shared buffers (a restart's) reaches the same log and verdict.
    let shared: Vec<bytes::Bytes> = segments.iter().map(|s| bytes::Bytes::copy_from_slice(s)).collect();
    let (shared_log, shared_infos, shared_damage, points) = crate::cluster::meta::fold_log_segments_shared(&shared);
    assert!(shared_log == log && shared_infos == infos && shared_damage == damage, "the shared fold differs");
    // The streaming fold of a restart, spilling committed entries past a small budget, finds
    // the same verdict, hard state and snapshot; what it holds and what it left on disk are
    // the whole log's entries (the spill's by term), and everything spilled is committed.
    {
        use crate::cluster::meta::LogFold;
        let floor = segments.iter().map(|s| LogFold::snapshot_floor(s)).max().unwrap_or(0);
        for s in &segments {
            assert_eq!(LogFold::snapshot_floor(s), LogFold::snapshot_floor_parsed(s), "a snapshot's index read alone");
        }
        let mut fold = LogFold::new(floor, Some(200));
        for (i, seg) in segments.iter().enumerate() {
            if !fold.feed(seg, None, i + 1 == segments.len()) {
                break;
            }
        }
        let summaries: Vec<_> = fold.take_builders().into_iter().map(|b| b.and_then(|b| b.finish())).collect();
        let (part, part_infos, part_damage, part_points) = fold.finish();
        // Folding the closed segments from the summaries the fold built gives the same.
        if part_damage.is_none() && summaries.len() == segments.len() {
            let commit = segments.last().map_or(0, |s| LogFold::last_commit(s));
            let mut fast = LogFold::new(floor, Some(200));
            for (i, (seg, sum)) in segments.iter().zip(&summaries).enumerate() {
                let last = i + 1 == segments.len();
                let snaps: Vec<Bytes> = (sum.iter().flat_map(|s| s.snapshots()))
                    .map(|(p, l)| Bytes::copy_from_slice(&seg[p as usize..(p + l) as usize]))
                    .collect();
                let taken = !last && sum.as_ref().is_some_and(|s| fast.feed_summary(s, &snaps, commit));
                if !taken {
                    fast.feed(seg, None, last);
                }
            }
            // What a driver reads back for a follower behind a compaction: every snapshot
            // record a summary names reads alone, and the fold's snapshot is one of them.
            if summaries.iter().all(Option::is_some) {
                let alone: Vec<_> = segments
                    .iter()
                    .zip(&summaries)
                    .flat_map(|(seg, sum)| {
                        sum.iter().flat_map(|s| s.snapshots()).map(|(p, l)| {
                            let record = bytes::Bytes::copy_from_slice(&seg[p as usize..(p + l) as usize]);
                            crate::cluster::meta::decode_snapshot_record_alone(&record)
                        })
                    })
                    .collect();
                assert!(alone.iter().all(Option::is_some), "a snapshot a summary names does not read alone");
                if let Some(kept) = &part.snapshot {
                    assert!(alone.iter().flatten().any(|s| s == kept), "the fold's snapshot is not read back alone");
                }
            }
            let (f, f_infos, f_damage, f_points) = fast.finish();
            assert!(
                f_damage.is_none() && f_infos == part_infos && f_points == part_points,
                "the summary fold's verdict differs"
            );
            assert!(f.hard_state == part.hard_state && f.snapshot == part.snapshot, "the summary fold differs");
            assert_eq!(f.voters(), part.voters(), "the summary fold's voters differ");
            let terms = |l: &crate::cluster::meta::RaftLog| {
                let sp = l.spill.iter().flat_map(|s| (s.first()..s.end()).map(|i| (i, s.term(i))));
                sp.chain(l.entries.iter().map(|e| (e.index, Some(e.term)))).collect::<Vec<_>>()
            };
            assert_eq!(terms(&f), terms(&part), "the summary fold's entries differ");
        }
        assert!(part_infos == infos && part_damage == damage, "the streaming fold's verdict differs");
        assert!(part.hard_state == log.hard_state && part.snapshot == log.snapshot, "the streaming fold differs");
        let spilled = part.spill.as_ref().map_or(0, |s| s.end() - s.first());
        assert_eq!(spilled as usize + part.entries.len(), log.entries.len(), "entries lost or invented");
        if let Some(sp) = &part.spill {
            assert!(sp.end() - 1 <= part.hard_state.commit, "an uncommitted entry left on disk");
            assert!(part.entries.first().is_none_or(|e| e.index == sp.end()), "a gap after the disk part");
        }
        for e in &log.entries {
            match part.spill.as_ref().and_then(|s| s.term(e.index)) {
                Some(t) => assert_eq!(t, e.term, "a spilled entry's term differs"),
                None => assert!(part.entries.contains(e), "an entry lost"),
            }
        }
        assert_eq!(part.voters(), log.voters(), "voters differ");
    }
    // Reading entries back with the index, from any start, invents nothing: every entry it
    // gives decodes from a record of the bytes, at the index asked or after, in order.
    if let Some(first) = log.entries.first().map(|e| e.index) {
        let last = log.entries.last().map_or(first, |e| e.index);
        for low in [first, (first + last) / 2, last] {
            let mut c = crate::cluster::log_read::EntryCollector::new(low, last + 1, 1 << 20);
            if let Some((start, _)) = points.plan(low, last + 1)
                && let Some(seg) = segments.get(start.segment as usize)
            {
                let mut at = start.pos as usize;
                while let Some((end, part)) = crate::cluster::meta::read_log_record(seg, at) {
                    if let Some(part) = part {
                        c.feed(part);
                    }
                    at = end;
                }
            }
            let got = c.finish();
            assert!(got.first().is_none_or(|e| e.index >= low), "an entry before the one asked");
            assert!(got.windows(2).all(|w| w[1].index == w[0].index + 1), "a gap in what was read back");
        }
    }
    // The same bytes as a segment summary: read (a typed error, never a panic), and, sealed
    // with a checksum so they decode, fed to a fold: a summary file that lies (a bug of a
    // broker that wrote it, a checksum that happens to hold) never makes the fold panic.
    {
        use crate::cluster::meta::LogFold;
        use crate::cluster::segment_summary::SegmentSummary;
        let _ = SegmentSummary::decode(body);
        let mut sealed = b"FLXU\x01".to_vec();
        sealed.extend_from_slice(body);
        let crc = crate::storage::crc32c(&sealed);
        sealed.extend_from_slice(&crc.to_be_bytes());
        if let Ok(sum) = SegmentSummary::decode(&sealed) {
            let floor = segments.iter().map(|s| LogFold::snapshot_floor(s)).max().unwrap_or(0);
            let mut fold = LogFold::new(floor, Some(200));
            if let Some(first) = segments.first() {
                fold.feed(first, None, segments.len() == 1);
            }
            let snaps: Vec<Bytes> = segments.last().map(|s| vec![Bytes::copy_from_slice(s)]).unwrap_or_default();
            let commit = data.first().map_or(0, |c| u64::from(*c));
            fold.feed_summary(&sum, &snaps, commit);
            let _ = fold.take_builders();
            let (log, _, damage, _) = fold.finish();
            let _ = (log.voters(), log.last_index(), log.read(0, u64::MAX, 1 << 20));
            // What the driver starts a replica with when the fold found nothing wrong: the
            // engine refuses what does not hold together, it does not panic.
            if damage.is_none() {
                let _ = crate::cluster::meta::MetaNode::restart_ranked(1, &[(1, Vec::new())], &log, None);
            }
            let _ = sum.encode();
        }
    }
    assert!(infos.len() <= segments.len());
    for (info, seg) in infos.iter().zip(&segments) {
        assert!(info.whole <= seg.len());
    }
    if damage.is_none() {
        assert_eq!(infos.len(), segments.len());
        let last = log.entries.last().map(|e| e.index).or(log.snapshot.as_ref().map(|s| s.get_metadata().index));
        assert!(log.hard_state.commit <= last.unwrap_or(0), "commit past the entries kept, said to be intact");
        // What the driver does: cut the torn tail; the cut log folds the same, intact.
        if let (Some(info), Some(seg)) = (infos.last(), segments.last()) {
            let mut cut: Vec<&[u8]> = segments.clone();
            let n = cut.len();
            cut[n - 1] = &seg[..info.whole];
            let (again, _, d) = fold_log_segments_checked(&cut);
            assert!(d.is_none() && again == log, "a cut tail changed the log");
        }
    }
}

/// `storage_segment` target: any bytes as a segment file. Recovery never panics, never returns
/// a batch that does not re-encode to exactly the bytes it was read from (so its checksum held),
/// keeps offsets strictly following each other, and reports a problem exactly when it stopped
/// before the end.
pub fn storage_segment(data: &[u8]) {
    use crate::storage::{crc32c, decode_segment, encode_batch};
    let r = decode_segment(Bytes::copy_from_slice(data));
    assert!(r.valid_len <= data.len());
    assert_eq!(r.problem.is_some(), r.valid_len < data.len(), "a problem exactly when reading stopped early");
    assert_eq!(r.positions.len(), r.batches.len());
    let mut next: Option<u64> = None;
    let mut end_of_last = 0;
    for (b, &at) in r.batches.iter().zip(&r.positions) {
        if let Some(n) = next {
            assert!(b.base_offset >= n, "offsets only move forwards");
        }
        next = Some(b.base_offset + b.count());
        assert!(at >= end_of_last, "batches do not overlap");
        let mut again = BytesMut::new();
        encode_batch(b, &mut again);
        // The body's checksum in what we re-encoded must match the bytes on "disk", and every
        // returned batch is exactly what was stored.
        let body = &again[crate::storage::BATCH_HEADER_LEN..];
        assert_eq!(crc32c(body).to_be_bytes(), again[8..12]);
        assert_eq!(&again[..], &data[at..at + again.len()]);
        end_of_last = at + again.len();
    }
    assert!(end_of_last <= r.valid_len);
    // The same bytes as an index file: refused or sound, never a panic.
    if let Ok(entries) = crate::storage::decode_index(data, data.len() as u64) {
        assert!(entries.windows(2).all(|w| w[1].base_offset >= w[0].base_offset + w[0].count));
        assert!(entries.iter().all(|e| e.position < data.len() as u64 && e.count > 0));
    }
    // The same bytes as a shard's state checkpoint: refused, or read back to a state that
    // encodes to exactly these bytes (keys strictly in order, nothing left over).
    let bytes = Bytes::copy_from_slice(data);
    if let Ok(c) = crate::storage::decode_state_checkpoint(&bytes) {
        assert!(c.values.windows(2).all(|w| w[0].0 < w[1].0));
        assert_eq!(crate::storage::encode_state_checkpoint(&c).as_deref(), Some(data));
    }
}

/// `peer_message` target: any bytes from a cluster peer, in any chunking, and the same bytes as
/// a kept Raft log file. Never a panic; what decodes encodes again to a frame that decodes to the
/// same message. The same bytes go through a replicated cache's entry and snapshot decoders
/// (`t0`: the instant its expiries are mapped to) and the metadata snapshot's.
pub fn peer_message(data: &[u8], t0: std::time::Instant) {
    use crate::cluster::peer::{PeerDecoder, encode};
    let split = data.first().map_or(1, |b| usize::from(*b % 7) + 1);
    let mut d = PeerDecoder::default();
    for chunk in data.chunks(split) {
        d.push(chunk);
        loop {
            match d.next_message() {
                Ok(Some(m)) => {
                    let mut out = BytesMut::new();
                    if encode(&m, &mut out).is_ok() {
                        let mut again = PeerDecoder::default();
                        again.push(&out);
                        assert_eq!(again.next_message().ok().flatten().as_ref(), Some(&m));
                        // In pieces (shard Raft messages, forwards: D64) the same bytes.
                        let mut parts = Vec::new();
                        if crate::cluster::peer::encode_chunks(&m, &mut parts).is_ok() {
                            assert_eq!(parts.concat(), out.to_vec());
                        }
                    }
                }
                Ok(None) => break,
                Err(_) => return,
            }
        }
    }
    if let Ok(log) = crate::cluster::meta::RaftLog::decode(data) {
        assert_eq!(crate::cluster::meta::RaftLog::decode(&log.encode()).ok(), Some(log));
    }
    // The same bytes as a replica's snapshot data and a replicated stream's checkpoint state,
    // as a leader probes them before sending a snapshot to an older replica (D63).
    if let Some(host) = crate::cluster::replica::Replica::host_state_of(data) {
        let _ = crate::broker::Broker::stream_state_holds_commits(host);
    }
    let _ = crate::broker::Broker::stream_state_holds_commits(data);
    // The same bytes as a replicated cache's entry and snapshot state.
    crate::broker::fuzz_cache_entry(data, t0);
    // And as a metadata snapshot (D62, from the leader in a `raft` message): one that reads
    // back encodes to itself, and its metadata takes commands and becomes a broker's view
    // without a panic.
    if let Ok(s) = crate::cluster::metadata::snapshot::MetaSnapshot::decode(data) {
        assert_eq!(crate::cluster::metadata::snapshot::MetaSnapshot::decode(&s.encode()).as_ref(), Ok(&s));
        let mut md = s.metadata;
        let _ = md.apply(&crate::cluster::metadata::Command::Rebalance);
        let cfg = crate::broker::BrokerConfig { clustered: true, ..crate::broker::BrokerConfig::default() };
        let mut b = crate::broker::Broker::new(cfg, crate::transport::WallClock::new(t0, 0));
        b.apply_cluster(&md, "n1", t0);
    }
}

/// Seeds for `peer_message`'s replicated-cache decoders: an entry with one operation of each
/// kind, and a cache's snapshot state.
pub fn cache_entry_seeds(t0: std::time::Instant) -> (Vec<u8>, Vec<u8>) {
    crate::broker::cache_entry_samples(t0)
}

/// `jwt` target: any bytes as a signed token (against a fixed key set, at a fixed time), as a
/// JWK set and as a permission string. Never a panic; a token that verifies names the tenant and
/// permissions it was signed with (the fuzzer cannot forge a signature, so the seeds' tokens are
/// the ones that verify).
pub fn jwt(data: &[u8]) {
    use crate::jwt::{Jwks, Perm, Verifier};
    let text = String::from_utf8_lossy(data);
    let public = crate::jwt::public_key(&crate::jwt::rfc8032_test_key()).unwrap_or_default();
    let v = Verifier::new(Jwks::single("k1", &public));
    if let Ok((claims, perms)) = v.verify(&text, 1_700_000_000) {
        assert_eq!(perms.len(), claims.perms.len());
    }
    let _ = Jwks::parse(data);
    let _ = Perm::parse(&text);
}
