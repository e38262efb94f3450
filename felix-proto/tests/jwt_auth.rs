//! Signed tokens through the broker: a matrix of tokens (valid, expired, not yet valid, bad
//! signature, unknown key, wrong audience, wrong issuer, another tenant, a permission missing,
//! a wildcard permission, tenant.manage) over JSON and binary publishes, subscribe, cache put,
//! get and delete (and, in their own tests, group polls and client certificates):
//! each answered with the right code, nothing written or served when refused; a token that
//! expires during a session makes its next request `revoked`.

mod support;

use bytes::Bytes;
use felix_proto::binary::AckMode;
use felix_proto::broker::{Broker, BrokerOutput, PeerAddr, TransportOutput};
use felix_proto::features::Features;
use felix_proto::jwt::{Claims, Jwks, Verifier, mint, public_key};
use felix_proto::message::{self, Message};
use felix_proto::transport::{Dir, Side, StreamId, WallClock};
use std::time::Duration;
use support::*;

/// RFC 8032's first test secret.
fn key() -> Vec<u8> {
    felix_proto::jwt::rfc8032_test_key()
}

/// Another key (all-ones seed).
fn other_key() -> Vec<u8> {
    let mut der = vec![0x30, 0x2e, 0x02, 0x01, 0x00, 0x30, 0x05, 0x06, 0x03, 0x2b, 0x65, 0x70, 0x04, 0x22, 0x04, 0x20];
    der.extend_from_slice(&[1u8; 32]);
    der
}

/// The wall clock starts at 1,700,000,000 s.
const NOW: u64 = 1_700_000_000;

fn claims(perms: &[&str]) -> Claims {
    Claims {
        iss: "felix-auth".into(),
        aud: "felix-broker".into(),
        sub: "alice".into(),
        tid: "t1".into(),
        exp: NOW + 60,
        iat: NOW - 10,
        nbf: None,
        jti: None,
        perms: perms.iter().map(|p| p.to_string()).collect(),
    }
}

fn auth_with(token: &str) -> Bytes {
    let (lo, hi) = Features::ERROR_CODES.to_words(true);
    json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: token.into(),
        // 0x0200: binary acks carry the error code too.
        client_flags: Some(0x0001 | 0x0008 | 0x0200),
        client_flags_hi: None,
        client_features: lo,
        client_features_hi: hi,
    }))
}

fn requests() -> Vec<(&'static str, Bytes)> {
    vec![
        ("publish", publish_json("orders", "x", Some(1), Some(AckMode::PerBatch))),
        ("subscribe", subscribe("orders", None)),
        (
            "cache_put",
            json(&Message::CachePut(message::CachePut {
                tenant_id: "t1".into(),
                namespace: "default".into(),
                cache: "sessions".into(),
                key: "k".into(),
                value: message::B64::from("v"),
                request_id: Some(2),
                ttl_ms: None,
            })),
        ),
        (
            "cache_get",
            json(&Message::CacheGet(message::CacheGet {
                tenant_id: "t1".into(),
                namespace: "default".into(),
                cache: "sessions".into(),
                key: "k".into(),
                request_id: Some(3),
            })),
        ),
        ("binary_publish", publish_binary("orders", &["b"], Some(4), None)),
        (
            "cache_delete",
            json(&Message::CacheDelete(message::CacheDelete {
                tenant_id: "t1".into(),
                namespace: "default".into(),
                cache: "sessions".into(),
                key: "gone".into(),
                request_id: Some(5),
            })),
        ),
    ]
}

/// What each request got: "ok" or the error code.
fn run(token: &str, advance: Duration) -> Result<Vec<(&'static str, String)>, String> {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    let pk = public_key(&key()).unwrap();
    cfg.jwt = Some(Verifier::new(Jwks::single("k1", &pk)));
    let mut b = Broker::new(cfg, WallClock::new(t0, NOW * 1_000_000));
    let conn = b.admit(PeerAddr([1; 16]), t0).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    b.handle_stream_data(conn, st, auth_with(token), false, t0);
    let mut out = Vec::new();
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
            out.extend_from_slice(&data);
        }
    }
    match messages(&out).first() {
        Some(Message::AuthOk(_)) => {}
        Some(Message::Error(e)) => return Err(e.code.as_ref().map(|c| c.name().into_owned()).unwrap_or_default()),
        other => panic!("{other:?}"),
    }
    let t = t0 + advance;
    let mut results = Vec::new();
    for (name, req) in requests() {
        b.handle_stream_data(conn, st, req, false, t);
        let mut out = Vec::new();
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::Transmit { data, stream, .. }) = o
                && stream == st
            {
                out.extend_from_slice(&data);
            }
        }
        use felix_proto::Payload;
        let json_code = |m: &Message| match m {
            Message::Error(e) => e.code.as_ref().map(|c| c.name().into_owned()).unwrap_or_default(),
            Message::PublishError(e) => e.code.as_ref().map(|c| c.name().into_owned()).unwrap_or_default(),
            _ => "ok".into(),
        };
        let got = match payloads(&out).first() {
            Some(Payload::Json(message::Decoded::Message(m))) => json_code(m),
            Some(Payload::Ack(a)) => a.code.as_ref().map_or("ok".into(), |(c, _)| c.name().into_owned()),
            Some(other) => format!("{other:?}"),
            None => "nothing".into(),
        };
        results.push((name, got));
    }
    let (_, _, next, _) = b.shard_state("t1", "default", "orders", 0).unwrap_or_default();
    if results[0].1 != "ok" {
        assert_eq!(next, 0, "a refused publish wrote nothing");
    }
    Ok(results)
}

fn all(code: &str) -> Vec<(&'static str, String)> {
    requests().into_iter().map(|(n, _)| (n, code.to_owned())).collect()
}

#[test]
fn every_kind_of_token_gets_the_right_answer_on_every_request() {
    let k = key();
    let everything = [
        "stream.publish:stream:t1/default/orders",
        "stream.subscribe:stream:t1/default/orders",
        "cache.write:cache:t1/default/sessions",
        "cache.read:cache:t1/default/sessions",
    ];
    let good = mint(&k, "k1", &claims(&everything)).unwrap();
    assert_eq!(run(&good, Duration::ZERO), Ok(all("ok")));
    // Refused at auth: unauthenticated, whatever the flaw.
    let refused = |c: Claims, key: &[u8], kid: &str| run(&mint(key, kid, &c).unwrap(), Duration::ZERO);
    let unauth = Err("unauthenticated".to_string());
    assert_eq!(refused(Claims { exp: NOW - 1, ..claims(&everything) }, &k, "k1"), unauth, "expired");
    assert_eq!(refused(Claims { nbf: Some(NOW + 30), ..claims(&everything) }, &k, "k1"), unauth, "not yet valid");
    assert_eq!(refused(claims(&everything), &other_key(), "k1"), unauth, "bad signature");
    assert_eq!(refused(claims(&everything), &k, "k9"), unauth, "unknown key");
    assert_eq!(refused(Claims { aud: "elsewhere".into(), ..claims(&everything) }, &k, "k1"), unauth, "audience");
    assert_eq!(refused(Claims { iss: "mallory".into(), ..claims(&everything) }, &k, "k1"), unauth, "issuer");
    assert_eq!(refused(Claims { tid: "t2".into(), ..claims(&everything) }, &k, "k1"), unauth, "another tenant");
    assert_eq!(run("not.a.token", Duration::ZERO), unauth, "garbage");
    assert_eq!(run("static-but-unknown", Duration::ZERO), unauth, "unknown static token");
    // A permission missing: forbidden for that request only.
    let publish_only = mint(&k, "k1", &claims(&everything[..1])).unwrap();
    let got = run(&publish_only, Duration::ZERO).unwrap();
    let codes: Vec<&str> = got.iter().map(|(_, c)| c.as_str()).collect();
    assert_eq!(codes, ["ok", "forbidden", "forbidden", "forbidden", "ok", "forbidden"], "{got:?}");
    // Wildcards and tenant.manage.
    let wild = mint(&k, "k1", &claims(&["stream.publish:stream:t1/*/*", "cache.read:cache:t1/*/sessions"])).unwrap();
    let got = run(&wild, Duration::ZERO).unwrap();
    assert_eq!(
        got.iter().map(|(_, c)| c.as_str()).collect::<Vec<_>>(),
        ["ok", "forbidden", "forbidden", "ok", "ok", "forbidden"]
    );
    let manager = mint(&k, "k1", &claims(&["tenant.manage:tenant:t1"])).unwrap();
    assert_eq!(run(&manager, Duration::ZERO), Ok(all("ok")));
    // Expiring during the session: every request afterwards is `revoked`.
    assert_eq!(run(&good, Duration::from_secs(61)), Ok(all("revoked")));
}

/// A subscription opened with a signed token ends with a final `error` code `revoked` on its
/// event stream when the token expires, at the time the broker asked to be woken; one opened
/// with a static token on the same broker goes on.
#[test]
fn a_subscription_ends_revoked_when_its_token_expires() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    cfg.jwt = Some(Verifier::new(Jwks::single("k1", &public_key(&key()).unwrap())));
    let mut b = Broker::new(cfg, WallClock::new(t0, NOW * 1_000_000));
    let short = mint(&key(), "k1", &Claims { exp: NOW + 5, ..claims(&["stream.subscribe:stream:t1/*/*"]) }).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let subscribe_with = |b: &mut Broker, i: u8, auth: Bytes| {
        let conn = b.admit(PeerAddr([i; 16]), t0).unwrap();
        b.handle_stream_data(conn, st, auth, false, t0);
        b.handle_stream_data(conn, st, subscribe("orders", None), false, t0);
        let mut event_stream = None;
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::OpenUni { conn: c, token }) = o {
                let id = StreamId::new(Side::Broker, Dir::Uni, u64::from(i));
                b.handle_stream_opened(c, token, id, t0);
                event_stream = Some(id);
            }
        }
        while b.poll_output().is_some() {}
        (conn, event_stream.expect("an event stream"))
    };
    let (signed_conn, signed_events) = subscribe_with(&mut b, 1, auth_with(&short));
    let (static_conn, _) =
        subscribe_with(&mut b, 2, auth(Some(0x0001 | 0x0002), Features::ERROR_CODES.to_words(true).0, None));
    let wake = b.poll_timeout().expect("a wake-up for the expiry");
    assert!(wake <= t0 + Duration::from_secs(5), "{:?}", wake - t0);
    b.handle_timeout(t0 + Duration::from_secs(5));
    let mut ended = Vec::new();
    let mut finished = Vec::new();
    while let Some(o) = b.poll_output() {
        match o {
            BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data })
                if conn == signed_conn && stream == signed_events =>
            {
                ended.extend(payloads(&data))
            }
            BrokerOutput::Transport(TransportOutput::Finish { conn, stream }) => finished.push((conn, stream)),
            _ => {}
        }
    }
    let last = ended.last().expect("a final frame");
    assert!(
        matches!(last, felix_proto::Payload::Json(message::Decoded::Message(Message::Error(e))) if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("revoked")),
        "{last:?}"
    );
    assert!(finished.contains(&(signed_conn, signed_events)));
    assert!(finished.iter().all(|(c, _)| *c != static_conn), "the static token's subscription goes on");
    assert_eq!(b.subscription_count(), 1);
}

/// A revocation reloaded live (`Broker::set_jwt`): the subscription opened with the revoked
/// token ends `revoked` at once, its control stream's next request is `revoked`, and the token
/// no longer authenticates; another token's subscription goes on.
#[test]
fn a_revocation_reloaded_live_ends_what_the_token_opened() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    let verifier = Verifier::new(Jwks::single("k1", &public_key(&key()).unwrap()));
    cfg.jwt = Some(verifier.clone());
    let mut b = Broker::new(cfg, WallClock::new(t0, NOW * 1_000_000));
    let perms = ["stream.subscribe:stream:t1/*/*", "stream.publish:stream:t1/*/*"];
    let bad = mint(&key(), "k1", &Claims { jti: Some("leaked".into()), ..claims(&perms) }).unwrap();
    let good = mint(&key(), "k1", &Claims { jti: Some("fine".into()), ..claims(&perms) }).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let open = |b: &mut Broker, i: u8, token: &str| {
        let conn = b.admit(PeerAddr([i; 16]), t0).unwrap();
        b.handle_stream_data(conn, st, auth_with(token), false, t0);
        b.handle_stream_data(conn, st, subscribe("orders", None), false, t0);
        let mut events = None;
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::OpenUni { conn: c, token }) = o {
                let id = StreamId::new(Side::Broker, Dir::Uni, u64::from(i));
                b.handle_stream_opened(c, token, id, t0);
                events = Some(id);
            }
        }
        while b.poll_output().is_some() {}
        (conn, events.unwrap())
    };
    let (bad_conn, bad_events) = open(&mut b, 1, &bad);
    let (good_conn, _) = open(&mut b, 2, &good);
    let mut revoking = verifier;
    revoking.revoked_jti.insert("leaked".into());
    b.set_jwt(Some(revoking), t0);
    let mut last = None;
    let mut finished = Vec::new();
    while let Some(o) = b.poll_output() {
        match o {
            BrokerOutput::Transport(TransportOutput::Transmit { conn, stream, data })
                if conn == bad_conn && stream == bad_events =>
            {
                last = payloads(&data).pop()
            }
            BrokerOutput::Transport(TransportOutput::Finish { conn, .. }) => finished.push(conn),
            _ => {}
        }
    }
    assert!(
        matches!(&last, Some(felix_proto::Payload::Json(message::Decoded::Message(Message::Error(e)))) if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("revoked")),
        "{last:?}"
    );
    assert!(finished.contains(&bad_conn) && !finished.contains(&good_conn));
    // Its control stream: revoked.
    b.handle_stream_data(bad_conn, st, publish_json("orders", "x", Some(9), Some(AckMode::PerBatch)), false, t0);
    let mut out = Vec::new();
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
            out.extend_from_slice(&data);
        }
    }
    assert!(
        matches!(&messages(&out)[..], [Message::PublishError(e)] if e.code.as_ref().map(|c| c.name().into_owned()).as_deref() == Some("revoked"))
    );
    // And it no longer authenticates.
    let conn = b.admit(PeerAddr([3; 16]), t0).unwrap();
    b.handle_stream_data(conn, st, auth_with(&bad), false, t0);
    let mut out = Vec::new();
    while let Some(o) = b.poll_output() {
        if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
            out.extend_from_slice(&data);
        }
    }
    assert!(matches!(&messages(&out)[..], [Message::Error(e)] if e.message.contains("revoked")));
    assert_eq!(b.subscription_count(), 1);
}

/// Consumer-group long polls opened with a signed token end `revoked`: one parked when its token
/// expires (the broker asks to be woken at the expiry, not at the end of the poll's wait), one
/// parked when its token is revoked live; a poll opened with a static token keeps waiting and is
/// answered by the next record.
#[test]
fn group_long_polls_end_revoked_when_their_token_expires_or_is_revoked() {
    let now = felix_proto::sim::SIM_WALL_EPOCH_MICROS / 1_000_000;
    let mut cfg = support::config();
    cfg.history_reads = true;
    let verifier = Verifier::new(Jwks::single("k1", &public_key(&key()).unwrap()));
    cfg.jwt = Some(verifier.clone());
    let mut sim = felix_proto::sim::Sim::new(cfg, epoch());
    let t0 = sim.now;
    let perms = ["group.consume:stream:t1/*/*"];
    let base = Claims { iat: now - 10, exp: now + 60, ..claims(&perms) };
    let short = mint(&key(), "k1", &Claims { exp: now + 5, ..base.clone() }).unwrap();
    let leaked = mint(&key(), "k1", &Claims { jti: Some("leaked".into()), ..base }).unwrap();
    let features = (Features::CONSUMER_GROUP | Features::ERROR_CODES).to_words(false).0;
    let poll = |rid: u64, wait_ms: u64| {
        json(&Message::GroupPoll(message::GroupPoll {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "jobs".into(),
            shard: 0,
            group: "workers".into(),
            max_records: 10,
            wait_ms,
            request_id: rid,
            consumer: None,
            reclaim: None,
            visibility_ms: None,
        }))
    };
    let session = |sim: &mut felix_proto::sim::Sim, token: &str| {
        let p = sim.connect_raw();
        let s = sim.raw_open_bi(p);
        let a = json(&Message::Auth(message::Auth {
            tenant_id: "t1".into(),
            token: token.into(),
            client_flags: Some(0x0001),
            client_flags_hi: None,
            client_features: features,
            client_features_hi: None,
        }));
        sim.raw_send(p, s, a, false);
        sim.run();
        assert!(matches!(messages(&sim.take_received(p, s))[..], [Message::AuthOk(_)]));
        (p, s)
    };
    // The stream exists with one record, which a first poll takes: the group is then empty.
    let (setup, ss) = session(&mut sim, support::TOKEN);
    sim.raw_send(setup, ss, publish_binary("jobs", &["first"], None, None), false);
    sim.run();
    sim.raw_send(setup, ss, poll(1, 0), false);
    sim.run();
    assert!(matches!(&messages(&sim.take_received(setup, ss))[..], [Message::GroupRecords(r)] if r.records.len() == 1));
    let parties = [session(&mut sim, &short), session(&mut sim, &leaked), session(&mut sim, support::TOKEN)];
    for (i, (p, s)) in parties.iter().enumerate() {
        sim.raw_send(*p, *s, poll(10 + i as u64, 30_000), false);
    }
    sim.run();
    let answered = |sim: &mut felix_proto::sim::Sim| -> Vec<(usize, Vec<Message>)> {
        parties
            .iter()
            .enumerate()
            .map(|(i, (p, s))| (i, messages(&sim.take_received(*p, *s))))
            .filter(|(_, m)| !m.is_empty())
            .collect()
    };
    assert!(answered(&mut sim).is_empty(), "every poll is parked");
    let code_of = |m: &[Message]| match m {
        [Message::Error(e)] => e.code.as_ref().map(|c| c.name().into_owned()).unwrap_or_default(),
        other => format!("{other:?}"),
    };
    // Revoked live: that poll ends at once, the others wait.
    let mut revoking = verifier;
    revoking.revoked_jti.insert("leaked".into());
    sim.broker.set_jwt(Some(revoking), sim.now);
    sim.run();
    let out = answered(&mut sim);
    assert_eq!(out.iter().map(|(i, m)| (*i, code_of(m))).collect::<Vec<_>>(), [(1, "revoked".to_string())]);
    // The expiring one: woken at its expiry (5 s), not at the end of its 30 s wait.
    let wake = sim.broker.poll_timeout().expect("a wake-up");
    assert!(wake <= t0 + Duration::from_secs(5), "{:?}", wake - t0);
    sim.advance(Duration::from_secs(5));
    sim.run();
    let out = answered(&mut sim);
    assert_eq!(out.iter().map(|(i, m)| (*i, code_of(m))).collect::<Vec<_>>(), [(0, "revoked".to_string())]);
    // The static token's poll still waits, and is answered by the next record.
    sim.raw_send(setup, ss, publish_binary("jobs", &["second"], None, None), false);
    sim.run();
    let out = answered(&mut sim);
    assert!(
        matches!(&out[..], [(2, m)] if matches!(&m[..], [Message::GroupRecords(r)] if r.records.len() == 1)),
        "{out:?}"
    );
}

/// Client certificates as credentials (the driver verified the chain and reports the names): an
/// empty token on a connection whose certificate names a `client_certs` entry authenticates as
/// that entry (its tenant, principal and grants); the same connection cannot use it for another
/// tenant; a connection without a certificate, or one whose names are not mapped, is
/// `unauthenticated`, saying so.
#[test]
fn a_client_certificate_authenticates_an_empty_token_as_its_mapped_principal() {
    use felix_proto::broker::{Action, Grant, TokenGrant};
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    cfg.client_certs = vec![TokenGrant {
        token: "orders.internal".into(),
        tenant_id: Some("t1".into()),
        principal: "orders-service".into(),
        grants: vec![Grant { action: Action::Publish, pattern: "*".into() }],
    }];
    let mut b = Broker::new(cfg, WallClock::new(t0, NOW * 1_000_000));
    let st = StreamId::new(Side::Client, Dir::Bi, 0);
    let attempt = |b: &mut Broker, i: u8, names: &[&str], tenant: &str| {
        let conn = b.admit(PeerAddr([i; 16]), t0).unwrap();
        if !names.is_empty() {
            b.set_peer_certificate(conn, names.iter().map(|s| s.to_string()).collect());
        }
        let mut m = messages(&auth_with("")).remove(0);
        if let Message::Auth(a) = &mut m {
            a.tenant_id = tenant.into();
        }
        b.handle_stream_data(conn, st, json(&m), false, t0);
        b.handle_stream_data(conn, st, publish_json("orders", "x", Some(1), Some(AckMode::PerBatch)), false, t0);
        b.handle_stream_data(conn, st, subscribe("orders", None), false, t0);
        let mut out = Vec::new();
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::Transmit { data, .. }) = o {
                out.extend_from_slice(&data);
            }
        }
        messages(&out)
            .into_iter()
            .map(|m| match m {
                Message::AuthOk(_) => "auth_ok".to_string(),
                Message::PublishOk(_) => "publish_ok".to_string(),
                Message::Error(e) => {
                    format!("{}: {}", e.code.as_ref().map(|c| c.name().into_owned()).unwrap_or_default(), e.message)
                }
                other => format!("{other:?}"),
            })
            .collect::<Vec<_>>()
    };
    let got = attempt(&mut b, 1, &["svc-orders", "orders.internal"], "t1");
    assert_eq!(got[..2], ["auth_ok", "publish_ok"]);
    assert!(got[2].starts_with("forbidden"), "the certificate's grants apply: {got:?}");
    let got = attempt(&mut b, 2, &["orders.internal"], "t2");
    assert!(got[0].starts_with("unauthenticated") && got[0].contains("not granted tenant t2"), "{got:?}");
    let got = attempt(&mut b, 3, &["svc-billing"], "t1");
    assert!(got[0].starts_with("unauthenticated"), "{got:?}");
    let got = attempt(&mut b, 4, &[], "t1");
    assert!(got[0].contains("no client certificate"), "{got:?}");
    let (_, _, next, _) = b.shard_state("t1", "default", "orders", 0).unwrap();
    assert_eq!(next, 1, "only the authenticated publish was written");
}

/// `shard_inspect` and `subscriptions_list` (FEATURE_INSPECT): answered only for a signed
/// token holding exactly `node.view:cluster:*`; `forbidden` (the stream open) for a wildcard
/// `node.view`, any other permission, and the static dev token. Answers come from what the
/// broker holds: the shard's tail, the subscriptions with their queue depth and drops.
#[test]
fn diagnostics_answer_only_a_token_with_exactly_node_view_cluster() {
    let t0 = epoch();
    let mut cfg = ephemeral_config();
    let pk = public_key(&key()).unwrap();
    cfg.jwt = Some(Verifier::new(Jwks::single("k1", &pk)));
    let mut b = Broker::new(cfg, WallClock::new(t0, NOW * 1_000_000));
    assert!(ephemeral_config().server_features().contains(Features::INSPECT));
    let take = |b: &mut Broker, st: StreamId| {
        let mut out = Vec::new();
        while let Some(o) = b.poll_output() {
            if let BrokerOutput::Transport(TransportOutput::Transmit { data, stream, .. }) = o
                && stream == st
            {
                out.extend_from_slice(&data);
            }
        }
        messages(&out)
    };
    let session = |b: &mut Broker, token: &str, i: u8| {
        let conn = b.admit(PeerAddr([i; 16]), t0).unwrap();
        let st = StreamId::new(Side::Client, Dir::Bi, 0);
        let (lo, hi) = (Features::ERROR_CODES | Features::INSPECT).to_words(true);
        let auth = json(&Message::Auth(message::Auth {
            tenant_id: "t1".into(),
            token: token.into(),
            client_flags: Some(0x0001),
            client_flags_hi: None,
            client_features: lo,
            client_features_hi: hi,
        }));
        b.handle_stream_data(conn, st, auth, false, t0);
        assert!(matches!(take(b, st).first(), Some(Message::AuthOk(_))));
        (conn, st)
    };
    // Something to look at: a subscriber and three records.
    let writer = mint(
        &key(),
        "k1",
        &claims(&["stream.publish:stream:t1/default/orders", "stream.subscribe:stream:t1/default/orders"]),
    )
    .unwrap();
    let (wc, ws) = session(&mut b, &writer, 1);
    b.handle_stream_data(wc, ws, subscribe("orders", None), false, t0);
    assert!(matches!(take(&mut b, ws).first(), Some(Message::Subscribed(_))));
    for i in 0..3 {
        b.handle_stream_data(wc, ws, publish_json("orders", "x", Some(10 + i), Some(AckMode::PerBatch)), false, t0);
    }
    take(&mut b, ws);
    let inspect = json(&Message::ShardInspect(message::ShardInspect {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        name: "orders".into(),
        kind: message::ShardKind::Stream,
        shard: 0,
        request_id: 5,
    }));
    let list = json(&Message::SubscriptionsList(message::SubscriptionsList {
        request_id: 6,
        filter: Some(message::SubscriptionFilter { stream: Some("orders".into()), ..Default::default() }),
        limit: None,
        cursor: None,
    }));
    let refused = |m: &[Message]| matches!(m.first(), Some(Message::Error(e)) if e.code.as_ref().is_some_and(|c| c.name() == "forbidden"));
    for (i, perms) in [vec!["node.view:cluster:x"], vec!["stream.admin:stream:t1/*/*"], vec!["tenant.manage:tenant:t1"]]
        .into_iter()
        .enumerate()
    {
        let token = mint(&key(), "k1", &claims(&perms)).unwrap();
        let (c, st) = session(&mut b, &token, 10 + i as u8);
        b.handle_stream_data(c, st, inspect.clone(), false, t0);
        assert!(refused(&take(&mut b, st)), "{perms:?}");
        b.handle_stream_data(c, st, list.clone(), false, t0);
        assert!(refused(&take(&mut b, st)), "{perms:?}: the stream stays open");
    }
    let (dc, ds) = session(&mut b, TOKEN, 20);
    b.handle_stream_data(dc, ds, inspect.clone(), false, t0);
    assert!(refused(&take(&mut b, ds)), "the static dev token is no diagnostics token");
    // Exactly node.view:cluster:*.
    let operator = mint(&key(), "k1", &claims(&["node.view:cluster:*"])).unwrap();
    let (oc, os) = session(&mut b, &operator, 30);
    b.handle_stream_data(oc, os, inspect, false, t0);
    match take(&mut b, os).first() {
        Some(Message::ShardInspectInfo(i)) => {
            assert_eq!(i.request_id, 5);
            let v = &i.view;
            assert_eq!(
                (v.shards, v.role.as_str(), v.phase.as_str(), v.serving),
                (1, "leader", "active", true),
                "{v:?}"
            );
            assert_eq!(v.tail, Some(3));
        }
        other => panic!("{other:?}"),
    }
    b.handle_stream_data(oc, os, list, false, t0);
    match take(&mut b, os).first() {
        Some(Message::SubscriptionsListInfo(l)) => {
            assert_eq!(l.subscriptions.len(), 1, "{l:?}");
            let s = &l.subscriptions[0];
            assert_eq!((s.stream.as_str(), s.shard, s.tail, s.dropped), ("orders", 0, 3, 0));
            // A stream kept in memory holds its publishers for a full subscriber (for a while).
            assert_eq!(s.policy, "block");
            assert!(l.next_cursor.is_none());
        }
        other => panic!("{other:?}"),
    }
}

/// A refused login is an operator notice (the driver logs it at info, with the address); a
/// good one is not.
#[test]
fn a_refused_login_is_noticed_for_the_operators_log() {
    use felix_proto::broker::Notice;
    let mut sim = felix_proto::sim::Sim::new(support::config(), support::epoch());
    let (_, _, ok) = support::raw_session(&mut sim, None, None);
    assert!(matches!(ok, Message::Ok(_) | Message::AuthOk(_)), "{ok:?}");
    assert_eq!(sim.broker.poll_notice(), None, "a good login is not noticed");
    let p = sim.connect_raw();
    let s = sim.raw_open_bi(p);
    let bad = support::json(&Message::Auth(message::Auth {
        tenant_id: "t1".into(),
        token: "wrong".into(),
        client_flags: None,
        client_flags_hi: None,
        client_features: None,
        client_features_hi: None,
    }));
    sim.raw_send(p, s, bad, false);
    sim.run();
    match sim.broker.poll_notice() {
        Some(Notice::LoginRefused { tenant, reason, .. }) => {
            assert_eq!(tenant, "t1");
            assert_eq!(reason, "invalid token");
        }
        other => panic!("{other:?}"),
    }
}
