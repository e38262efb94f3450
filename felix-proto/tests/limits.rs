//! Per-tenant publish rate limits through the broker: a limited tenant gets its rate (within a
//! second's burst) over 10 s of offered overload, each refusal says `overloaded` reason
//! `tenant_quota` with when to retry, nothing refused is written, and another tenant publishing
//! at the same time is never refused.

mod support;

use bytes::Bytes;
use felix_proto::binary::AckMode;
use felix_proto::broker::{Broker, BrokerOutput, PeerAddr, StorageOutput, TenantLimit, TransportOutput};
use felix_proto::features::Features;
use felix_proto::message::{self, Message};
use felix_proto::transport::{ConnId, Dir, Side, StreamId, WallClock};
use std::time::Duration;
use support::*;

fn auth_as(tenant: &str, features: Features) -> Bytes {
    let (lo, hi) = features.to_words(true);
    json(&Message::Auth(message::Auth {
        tenant_id: tenant.into(),
        token: TOKEN.into(),
        client_flags: Some(0x0001 | 0x0008),
        client_flags_hi: None,
        client_features: lo,
        client_features_hi: hi,
    }))
}

fn publish_as(tenant: &str, request_id: Option<u64>) -> Bytes {
    json(&Message::Publish(message::Publish {
        tenant_id: tenant.into(),
        namespace: "default".into(),
        stream: "orders".into(),
        payload: message::B64::from("x"),
        key: None,
        shard: None,
        request_id,
        ack: request_id.map(|_| AckMode::PerBatch),
        publish_width: None,
    }))
}

#[test]
fn a_tenant_over_its_rate_is_refused_with_when_to_retry_and_others_are_untouched() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    cfg.tenant_limits =
        vec![TenantLimit { tenant_id: "t1".into(), records_per_s: Some(100), ..TenantLimit::default() }];
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_700_000_000_000_000));
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let open = |b: &mut Broker, tenant: &str, i: u8| -> ConnId {
        let c = b.admit(PeerAddr([i; 16]), t0).unwrap();
        b.handle_stream_data(c, st, auth_as(tenant, Features::ERROR_CODES), false, t0);
        c
    };
    let c1 = open(&mut b, "t1", 1);
    let c2 = open(&mut b, "t2", 2);
    while b.poll_output().is_some() {}
    let (mut ok1, mut refused1, mut ok2, mut sent1, mut paused1, mut pauses) = (0u64, 0u64, 0u64, 0u64, false, 0u64);
    let mut t = t0;
    let mut rid = 1;
    // 200 publishes per second offered by each tenant for 10 s; the limited one is paused by the
    // broker when over (its QUIC flow control would hold it), and sends only while read.
    while t < t0 + Duration::from_secs(10) {
        if b.poll_timeout().is_some_and(|d| d <= t) {
            b.handle_timeout(t);
        }
        for (c, tenant) in [(c1, "t1"), (c2, "t2")] {
            if c == c1 && paused1 {
                continue;
            }
            b.handle_stream_data(c, st, publish_as(tenant, Some(rid)), false, t);
            sent1 += u64::from(c == c1);
            rid += 1;
            while let Some(o) = b.poll_output() {
                match &o {
                    BrokerOutput::Transport(TransportOutput::PauseReading { conn, .. }) if *conn == c1 => {
                        paused1 = true;
                        pauses += 1;
                    }
                    BrokerOutput::Transport(TransportOutput::ResumeReading { conn, .. }) if *conn == c1 => {
                        paused1 = false
                    }
                    _ => {}
                }
                let BrokerOutput::Transport(TransportOutput::Transmit { conn, data, .. }) = o else { continue };
                for m in messages(&data) {
                    match (conn == c1, m) {
                        (true, Message::PublishOk(_)) => ok1 += 1,
                        (false, Message::PublishOk(_)) => ok2 += 1,
                        (true, Message::PublishError(e)) => {
                            refused1 += 1;
                            assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("overloaded"));
                            let d = e.detail.unwrap();
                            assert_eq!(d.reason.as_deref(), Some("tenant_quota"));
                            assert!(d.retry_after_ms.is_some_and(|ms| (1..=10).contains(&ms)), "{d:?}");
                        }
                        other => panic!("{other:?}"),
                    }
                }
            }
        }
        // Resumed by a timeout: the stream is read again.
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::ResumeReading { conn, .. }) = o
                && conn == c1
            {
                paused1 = false;
            }
        }
        t += Duration::from_millis(5);
        if b.poll_timeout().is_some_and(|d| d <= t) {
            b.handle_timeout(t);
            while let Some(o) = b.poll_output() {
                if let BrokerOutput::Transport(TransportOutput::ResumeReading { conn, .. }) = o
                    && conn == c1
                {
                    paused1 = false;
                }
            }
        }
    }
    assert_eq!(ok2, 2000, "the other tenant is never refused");
    assert_eq!(ok1 + refused1, sent1, "every publish answered");
    assert_eq!(pauses, refused1, "each refusal pauses reading until the tenant is back under");
    // 100/s over 10 s, plus at most the first burst (a quarter second): within 2.5%.
    assert!((1000..=1026).contains(&ok1), "{ok1} records admitted at 100/s over 10 s");
    eprintln!("admitted {ok1} records at 100/s over 10 s ({:+.1}%)", (ok1 as f64 / 1000.0 - 1.0) * 100.0);
    assert_eq!(b.stats().publishes_rate_limited, refused1);
    let (_, _, next, _) = b.shard_state("t1", "default", "orders", 0).unwrap();
    assert_eq!(next, ok1, "nothing refused was written");
    // A binary acked publish over the limit carries the same in its ack, for a client that
    // offered codes (0x0200) and details (0x0400).
    let c3 = b.admit(PeerAddr([3; 16]), t).unwrap();
    let s3 = StreamId::new(Side::Client, Dir::Bi, 4);
    b.handle_stream_data(c3, s3, auth(Some(0x0001 | 0x0008 | 0x0200 | 0x0400), None, None), false, t);
    while b.poll_output().is_some() {}
    let mut acks_seen = Vec::new();
    for r in 0..20 {
        b.handle_stream_data(c3, s3, publish_binary("orders", &["y"], Some(r + 1), None), false, t);
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
                acks_seen.extend(acks(&payloads(&data)));
            }
        }
    }
    let refused = acks_seen.iter().find(|a| a.code.is_some()).expect("some binary publish refused");
    assert_eq!(refused.code.as_ref().map(|(c, _)| c.name().into_owned()).as_deref(), Some("overloaded"));
    assert_eq!(refused.detail.as_ref().and_then(|d| d.reason.as_deref()), Some("tenant_quota"));
    // An unacked publish over the limit is dropped and counted, with no answer.
    let before = b.stats().publishes_rate_limited;
    for _ in 0..200 {
        b.handle_stream_data(c1, st, publish_as("t1", None), false, t);
    }
    let answered = std::iter::from_fn(|| b.poll_output())
        .any(|o| matches!(o, BrokerOutput::Transport(TransportOutput::Transmit { .. })));
    assert!(!answered);
    assert!(b.stats().publishes_rate_limited > before);
}

fn publish_to(tenant: &str, ns: &str, stream: &str, request_id: u64) -> Bytes {
    json(&Message::Publish(message::Publish {
        tenant_id: tenant.into(),
        namespace: ns.into(),
        stream: stream.into(),
        payload: message::B64::from("x"),
        key: None,
        shard: None,
        request_id: Some(request_id),
        ack: Some(AckMode::PerBatch),
        publish_width: None,
    }))
}

fn answers(b: &mut Broker) -> Vec<Message> {
    let mut out = Vec::new();
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
            out.extend(messages(&data));
        }
    }
    out
}

fn code(m: &Message) -> Option<String> {
    match m {
        Message::Error(e) => e.code.as_ref().map(|c| c.name().into_owned()),
        Message::PublishError(e) => e.code.as_ref().map(|c| c.name().into_owned()),
        _ => None,
    }
}

/// Quotas: a tenant's connections (one more than allowed is refused `limit_exceeded`, a closed
/// one frees its place, another tenant is not counted) and streams per namespace (creating one
/// more is refused; the existing ones and other namespaces go on).
#[test]
fn a_tenant_at_its_quotas_is_refused_limit_exceeded_and_nothing_else_is() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    cfg.tenant_limits = vec![TenantLimit {
        tenant_id: "t1".into(),
        max_connections: Some(2),
        max_streams_per_namespace: Some(2),
        ..TenantLimit::default()
    }];
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_700_000_000_000_000));
    let st = |i: u64| StreamId::new(Side::Client, Dir::Bi, i);
    let mut conns = Vec::new();
    for i in 0..3u8 {
        let c = b.admit(PeerAddr([i; 16]), t0).unwrap();
        b.handle_stream_data(c, st(0), auth_as("t1", Features::ERROR_CODES), false, t0);
        conns.push(c);
    }
    let got = answers(&mut b);
    assert!(matches!(got[0], Message::AuthOk(_)) && matches!(got[1], Message::AuthOk(_)), "{got:?}");
    assert_eq!(code(&got[2]).as_deref(), Some("limit_exceeded"), "{got:?}");
    // A second stream on a counted connection is not another connection.
    b.handle_stream_data(conns[0], st(4), auth_as("t1", Features::ERROR_CODES), false, t0);
    assert!(matches!(answers(&mut b)[..], [Message::AuthOk(_)]));
    // Another tenant is not counted.
    let other = b.admit(PeerAddr([9; 16]), t0).unwrap();
    b.handle_stream_data(other, st(0), auth_as("t2", Features::ERROR_CODES), false, t0);
    assert!(matches!(answers(&mut b)[..], [Message::AuthOk(_)]));
    // A closed connection frees its place.
    b.connection_closed(conns[1], t0);
    let c = b.admit(PeerAddr([5; 16]), t0).unwrap();
    b.handle_stream_data(c, st(0), auth_as("t1", Features::ERROR_CODES), false, t0);
    assert!(matches!(answers(&mut b)[..], [Message::AuthOk(_)]));
    // Streams per namespace: two are made, the third is refused, the first two still take writes,
    // and another namespace has its own two.
    let c0 = conns[0];
    for (i, (ns, s)) in
        [("default", "a"), ("default", "b"), ("default", "c"), ("default", "a"), ("other", "c")].into_iter().enumerate()
    {
        b.handle_stream_data(c0, st(0), publish_to("t1", ns, s, i as u64 + 1), false, t0);
        let got = answers(&mut b);
        if s == "c" && ns == "default" {
            assert_eq!(code(&got[0]).as_deref(), Some("limit_exceeded"), "{got:?}");
        } else {
            assert!(matches!(got[..], [Message::PublishOk(_)]), "{ns}/{s}: {got:?}");
        }
    }
    assert!(b.shard_state("t1", "default", "c", 0).is_none(), "the refused stream was not created");
    assert_eq!(b.stats().quota_refusals, 2);
}

/// Completes every write the broker asked storage for.
fn complete_writes(b: &mut Broker, t: std::time::Instant) -> Vec<Message> {
    let mut got = Vec::new();
    loop {
        let mut tokens = Vec::new();
        while let Some(o) = b.poll_output() {
            match o {
                BrokerOutput::Storage(StorageOutput::Persist(p)) => tokens.push(p.token),
                BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => got.extend(messages(&data)),
                _ => {}
            }
        }
        if tokens.is_empty() {
            return got;
        }
        for tok in tokens {
            b.handle_write_complete(tok, true, t);
        }
    }
}

/// A tenant's share of the publish queue: while its publishes fill it (storage has not written
/// them), one more is refused `overloaded` reason `publish_queue_full` with a short
/// `retry_after_ms`, nothing queued; another tenant's publishes are queued meanwhile; once
/// storage writes, the tenant is admitted again.
#[test]
fn a_tenant_whose_share_of_the_publish_queue_is_full_is_refused_publish_queue_full() {
    let t0 = epoch();
    let mut cfg = config();
    cfg.tenant_limits =
        vec![TenantLimit { tenant_id: "t1".into(), max_queued_publish_bytes: Some(10), ..TenantLimit::default() }];
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_700_000_000_000_000));
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let c1 = b.admit(PeerAddr([1; 16]), t0).unwrap();
    let c2 = b.admit(PeerAddr([2; 16]), t0).unwrap();
    b.handle_stream_data(c1, st, auth_as("t1", Features::ERROR_CODES), false, t0);
    b.handle_stream_data(c2, st, auth_as("t2", Features::ERROR_CODES), false, t0);
    let mut writes: Vec<(String, felix_proto::transport::WriteToken)> = Vec::new();
    let mut refusals: Vec<(u64, message::PublishError)> = Vec::new();
    let publish = |b: &mut Broker,
                   c: ConnId,
                   tenant: &str,
                   rid: u64,
                   writes: &mut Vec<(String, felix_proto::transport::WriteToken)>,
                   refusals: &mut Vec<(u64, message::PublishError)>| {
        b.handle_stream_data(c, st, publish_as(tenant, Some(rid)), false, t0);
        while let Some(o) = b.poll_output() {
            match o {
                BrokerOutput::Storage(StorageOutput::Persist(p)) => writes.push((p.tenant_id.clone(), p.token)),
                BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => {
                    refusals.extend(messages(&data).into_iter().filter_map(|m| match m {
                        Message::PublishError(e) => Some((rid, e)),
                        _ => None,
                    }))
                }
                _ => {}
            }
        }
    };
    for rid in 1..=12 {
        publish(&mut b, c1, "t1", rid, &mut writes, &mut refusals);
        publish(&mut b, c2, "t2", 100 + rid, &mut writes, &mut refusals);
    }
    assert_eq!(writes.iter().filter(|(t, _)| t == "t1").count(), 10, "ten 1-byte publishes fill t1's share");
    assert_eq!(writes.iter().filter(|(t, _)| t == "t2").count(), 12, "t2 has no share: all queued");
    assert_eq!(refusals.iter().map(|(rid, _)| *rid).collect::<Vec<_>>(), [11, 12]);
    for (_, e) in &refusals {
        assert_eq!(e.code.as_ref().map(|c| c.name().into_owned()).as_deref(), Some("overloaded"));
        let d = e.detail.as_ref().expect("a detail");
        assert_eq!(d.reason.as_deref(), Some("publish_queue_full"));
        assert_eq!(d.retry_after_ms, Some(20));
    }
    assert_eq!(b.stats().quota_refusals, 2);
    // Storage writes what waits: the share is free again.
    for (_, tok) in writes.drain(..) {
        b.handle_write_complete(tok, true, t0);
    }
    complete_writes(&mut b, t0);
    refusals.clear();
    publish(&mut b, c1, "t1", 13, &mut writes, &mut refusals);
    assert!(refusals.is_empty(), "{refusals:?}");
    assert_eq!(writes.len(), 1);
    // A failed write gives its bytes back too.
    b.handle_write_complete(writes[0].1, false, t0);
    for rid in 14..24 {
        publish(&mut b, c1, "t1", rid, &mut writes, &mut refusals);
    }
    assert!(refusals.is_empty(), "{refusals:?}");
    let (_, _, next, _) = b.shard_state("t1", "default", "orders", 0).unwrap();
    assert_eq!(next, 10 + 1 + 10, "nothing refused was written");
}

/// A namespace's retained-history quota: a publish that would take it past the quota is refused
/// `limit_exceeded` with nothing written (another namespace and another tenant go on); when
/// retention drops old records, the next sweep's recount makes room again.
#[test]
fn a_namespace_at_its_retained_bytes_quota_refuses_publishes_until_retention_frees_room() {
    let t0 = epoch();
    let mut cfg = config();
    cfg.default_stream.retention.max_records = Some(4);
    cfg.tenant_limits = vec![TenantLimit {
        tenant_id: "t1".into(),
        max_retained_bytes_per_namespace: Some(10),
        ..TenantLimit::default()
    }];
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_700_000_000_000_000));
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let c1 = b.admit(PeerAddr([1; 16]), t0).unwrap();
    b.handle_stream_data(c1, st, auth_as("t1", Features::ERROR_CODES), false, t0);
    let c2 = b.admit(PeerAddr([2; 16]), t0).unwrap();
    b.handle_stream_data(c2, st, auth_as("t2", Features::ERROR_CODES), false, t0);
    complete_writes(&mut b, t0);
    let mut refused = Vec::new();
    for rid in 1..=12 {
        // Two streams of one namespace share its quota.
        let stream = if rid % 2 == 0 { "a" } else { "b" };
        b.handle_stream_data(c1, st, publish_to("t1", "default", stream, rid), false, t0);
        for m in complete_writes(&mut b, t0) {
            if let Some(c) = code(&m) {
                refused.push((rid, c));
            }
        }
    }
    // Retention keeps 4 records a stream, but the figure is recounted only on the sweep: ten
    // bytes admitted, then refused.
    assert_eq!(refused, [(11, "limit_exceeded".to_string()), (12, "limit_exceeded".to_string())]);
    let held = |b: &Broker, s: &str| b.shard_state("t1", "default", s, 0).map(|(_, _, next, _)| next).unwrap();
    assert_eq!(held(&b, "a") + held(&b, "b"), 10, "nothing refused was written");
    // Another namespace and another tenant are not held back.
    b.handle_stream_data(c1, st, publish_to("t1", "other", "a", 50), false, t0);
    b.handle_stream_data(c2, st, publish_to("t2", "default", "a", 51), false, t0);
    assert!(complete_writes(&mut b, t0).iter().all(|m| code(m).is_none()));
    // The sweep recounts: 4 + 4 records retained, room for 2 more.
    let t1 = t0 + Duration::from_secs(2);
    assert!(b.poll_timeout().is_some_and(|d| d <= t1), "the broker asks to sweep");
    b.handle_timeout(t1);
    let mut results = Vec::new();
    for rid in 60..63 {
        b.handle_stream_data(c1, st, publish_to("t1", "default", "a", rid), false, t1);
        results.push(complete_writes(&mut b, t1).iter().find_map(code));
    }
    assert_eq!(results, [None, None, Some("limit_exceeded".to_string())]);
}

/// A tenant's subscriptions per connection: one more than its quota on a connection is refused
/// `limit_exceeded` (another connection has its own; another tenant has only the broker-wide
/// cap).
#[test]
fn a_tenant_at_its_subscriptions_per_connection_quota_is_refused_limit_exceeded() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    cfg.tenant_limits = vec![TenantLimit {
        tenant_id: "t1".into(),
        max_subscriptions_per_connection: Some(2),
        ..TenantLimit::default()
    }];
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_700_000_000_000_000));
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let subscribe_as = |tenant: &str| {
        json(&Message::Subscribe(message::Subscribe {
            tenant_id: tenant.into(),
            namespace: "default".into(),
            stream: "orders".into(),
            subscription_id: None,
            start: None,
            shard: None,
            queue_capacity: None,
            filter: None,
        }))
    };
    let outcome = |b: &mut Broker, i: u8, tenant: &str, n: usize| {
        let c = b.admit(PeerAddr([i; 16]), t0).unwrap();
        b.handle_stream_data(c, st, auth_as(tenant, Features::ERROR_CODES), false, t0);
        for _ in 0..n {
            b.handle_stream_data(c, st, subscribe_as(tenant), false, t0);
        }
        answers(b)
            .iter()
            .filter_map(|m| match m {
                Message::Subscribed(_) => Some("subscribed".to_string()),
                Message::AuthOk(_) => None,
                other => Some(code(other).unwrap_or_else(|| format!("{other:?}"))),
            })
            .collect::<Vec<_>>()
    };
    assert_eq!(outcome(&mut b, 1, "t1", 3), ["subscribed", "subscribed", "limit_exceeded"]);
    assert_eq!(outcome(&mut b, 2, "t1", 2), ["subscribed", "subscribed"], "another connection has its own");
    assert_eq!(outcome(&mut b, 3, "t2", 3), ["subscribed"; 3], "another tenant has no quota");
}

/// A namespace's own rate through the broker: publishes to it past its burst are refused
/// `overloaded`/`tenant_quota` naming the namespace, while the tenant's other namespaces go on
/// (on another control stream: the one that went over is paused until the namespace is back
/// under).
#[test]
fn a_namespace_over_its_own_rate_is_refused_and_the_tenants_other_namespaces_go_on() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    cfg.tenant_limits = vec![TenantLimit {
        tenant_id: "t1".into(),
        namespace: Some("slow".into()),
        records_per_s: Some(100),
        ..TenantLimit::default()
    }];
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_700_000_000_000_000));
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let c = b.admit(PeerAddr([1; 16]), t0).unwrap();
    b.handle_stream_data(c, st, auth_as("t1", Features::ERROR_CODES), false, t0);
    answers(&mut b);
    // Another control stream of the connection, for the other namespace: the stream that went
    // over is paused until the namespace is back under (flow control slows its publisher).
    let other = StreamId::new(Side::Client, Dir::Bi, 4);
    b.handle_stream_data(c, other, auth_as("t1", Features::ERROR_CODES), false, t0);
    answers(&mut b);
    let mut outcome = |ns: &str, rid: u64| {
        let st = if ns == "slow" { st } else { other };
        b.handle_stream_data(c, st, publish_to("t1", ns, "s", rid), false, t0);
        // Read again at once, as a driver would once the pause ends.
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
                return messages(&data).pop();
            }
        }
        None
    };
    let slow: Vec<Option<Message>> = (1..=40).map(|rid| outcome("slow", rid)).collect();
    let ok = slow.iter().filter(|m| matches!(m, Some(Message::PublishOk(_)))).count();
    assert_eq!(ok, 26, "the namespace's quarter-second burst and one in debt");
    let refused = slow.iter().find_map(|m| match m {
        Some(Message::PublishError(e)) => Some(e.clone()),
        _ => None,
    });
    let e = refused.expect("a refusal");
    assert!(e.message.contains("namespace t1/slow"), "{}", e.message);
    assert_eq!(e.detail.and_then(|d| d.reason).as_deref(), Some("tenant_quota"));
    assert!((100..140).all(|rid| matches!(outcome("default", rid), Some(Message::PublishOk(_)))));
}

/// A stream paused with frames already buffered (a rate-limited flood that was read ahead) is
/// not read again by the driver until the broker processed them: every rate resume processes
/// from the backlog, and `ResumeReading` comes once, when nothing complete is left, so the
/// broker never holds more than what was read before the first pause.
#[test]
fn a_paused_stream_is_read_again_only_once_its_backlog_is_processed() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    cfg.tenant_limits =
        vec![TenantLimit { tenant_id: "t1".into(), records_per_s: Some(100), ..TenantLimit::default() }];
    let mut b = Broker::new(cfg, WallClock::new(t0, 1_700_000_000_000_000));
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let c = b.admit(PeerAddr([1; 16]), t0).unwrap();
    b.handle_stream_data(c, st, auth_as("t1", Features::ERROR_CODES), false, t0);
    answers(&mut b);
    // 60 acked publishes in one chunk: more than the burst.
    let mut chunk = Vec::new();
    for rid in 1..=60 {
        chunk.extend_from_slice(&publish_as("t1", Some(rid)));
    }
    b.handle_stream_data(c, st, Bytes::from(chunk), false, t0);
    let (mut answered, mut resumes, mut t) = (0, 0, t0);
    let mut answered_at_resume = Vec::new();
    for _ in 0..2000 {
        while let Some(o) = b.poll_output() {
            match o {
                BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) => answered += messages(&data).len(),
                BrokerOutput::Transport(TransportOutput::ResumeReading { .. }) => {
                    resumes += 1;
                    answered_at_resume.push(answered);
                }
                _ => {}
            }
        }
        if answered == 60 {
            break;
        }
        t = b.poll_timeout().expect("a rate resume is due").max(t);
        b.handle_timeout(t);
    }
    assert_eq!(answered, 60, "every publish answered (admitted or refused)");
    assert_eq!(answered_at_resume, [60], "the driver is told to read again once, after the backlog");
    assert_eq!(resumes, 1);
}
