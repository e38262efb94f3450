//! Connections over QUIC: packet size, loopback, handshakes and tokens, stream credit, ALPN,
//! shutdown, legacy frames, metrics.

use super::*;

/// The transport's packet size: a loopback client and the broker send packets of the GSO-safe
/// default bound from the first packet (no discovery phase at 1200), and it holds after a burst
/// of bulk traffic; the broker's metrics report the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn loopback_connections_use_the_full_packet_size_from_the_start() {
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    assert_eq!(c.path_mtu(), felix_driver_tokio::DEFAULT_MAX_UDP_PAYLOAD);
    const { assert!(felix_driver_tokio::DEFAULT_MAX_UDP_PAYLOAD <= felix_driver_tokio::GSO_SAFE_MAX_UDP_PAYLOAD) };
    let mut sub = c.subscribe("default", "mtu", None, None).await.unwrap();
    let payloads: Vec<Bytes> = (0..64).map(|i| Bytes::from(vec![i as u8; 4096])).collect();
    for _ in 0..20 {
        c.publish("default", "mtu", payloads.clone(), PublishOptions { ack: true, ..Default::default() })
            .await
            .unwrap();
    }
    assert_eq!(collect(&mut sub, 64 * 20).await.len(), 64 * 20);
    assert_eq!(c.path_mtu(), felix_driver_tokio::DEFAULT_MAX_UDP_PAYLOAD);
    let metrics = felix_driver_tokio::server::scrape(server.metrics_addr.unwrap()).await.unwrap();
    let value = |name: &str| {
        metrics.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse::<u64>().ok())).unwrap()
    };
    assert_eq!(value("felix_quic_mtu_min "), u64::from(felix_driver_tokio::DEFAULT_MAX_UDP_PAYLOAD));
    assert_eq!(value("felix_quic_black_holes "), 0);
    assert!(value("felix_quic_datagrams_sent ") > 0);
}

#[test]
fn loopback_is_recognised_in_every_spelling() {
    for (addr, want) in [
        ("127.0.0.1:1", true),
        ("127.8.9.10:1", true),
        ("[::1]:1", true),
        ("[::ffff:127.0.0.1]:1", true),
        ("10.0.0.1:1", false),
        ("[2001:db8::1]:1", false),
        ("[::ffff:10.0.0.1]:1", false),
    ] {
        assert_eq!(felix_driver_tokio::is_loopback(addr.parse().unwrap()), want, "{addr}");
    }
}

#[tokio::test]
async fn publish_subscribe_replay_and_cache() {
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    assert!(c.negotiated().publish_window.is_some());
    let mut live = c.subscribe("default", "orders", None, None).await.unwrap();
    for i in 0..10 {
        let off = c
            .publish(
                "default",
                "orders",
                vec![Bytes::from(format!("m{i}"))],
                PublishOptions { ack: true, ..Default::default() },
            )
            .await
            .unwrap();
        assert_eq!(off, Some(i), "the client asks for acks after the write: each carries its offset");
    }
    let got = collect(&mut live, 10).await;
    assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), (0..10).collect::<Vec<_>>());
    let mut replay = c.subscribe("default", "orders", Some(StartPosition::Earliest), None).await.unwrap();
    assert_eq!(replay.start_offset, Some(0));
    assert_eq!(collect(&mut replay, 10).await, got);
    c.cache_put("default", "c", "k", Bytes::from("v"), None).await.unwrap();
    assert_eq!(c.cache_get("default", "c", "k").await.unwrap(), Some(Bytes::from("v")));
    assert_eq!(c.cache_delete("default", "c", "k").await.unwrap(), Some(Bytes::from("v")));
    assert_eq!(c.cache_get("default", "c", "k").await.unwrap(), None);
    // Many acked publishes at once: pipelined under the window, all answered.
    let mut tasks = Vec::new();
    for i in 0..500 {
        let c = c.clone();
        tasks.push(tokio::spawn(async move {
            c.publish(
                "default",
                "bulk",
                vec![Bytes::from(format!("b{i}"))],
                PublishOptions { ack: true, ..Default::default() },
            )
            .await
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    server.shutdown().await;
}

#[tokio::test]
async fn durable_data_survives_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (server, chain) = start(Some(dir.path())).await;
        let c = connect(&server, &chain).await;
        for i in 0..20 {
            c.publish(
                "default",
                "orders",
                vec![Bytes::from(format!("m{i}"))],
                PublishOptions { ack: true, ..Default::default() },
            )
            .await
            .unwrap();
        }
        server.shutdown().await;
    }
    let (server, chain) = start(Some(dir.path())).await;
    assert_eq!(server.recovered_records, 20, "repairs: {:?}", server.repairs);
    let c = connect(&server, &chain).await;
    let mut sub = c.subscribe("default", "orders", Some(StartPosition::Earliest), None).await.unwrap();
    let got = collect(&mut sub, 20).await;
    assert_eq!(got[19], (19, Bytes::from("m19")));
    // Offsets continue where they were.
    c.publish("default", "orders", vec![Bytes::from("after")], PublishOptions { ack: true, ..Default::default() })
        .await
        .unwrap();
    assert_eq!(collect(&mut sub, 1).await, vec![(20, Bytes::from("after"))]);
    server.shutdown().await;
}

#[tokio::test]
async fn bad_token_is_unauthenticated() {
    let (server, chain) = start(None).await;
    let opts = ClientOptions::new("t1", "wrong", Trust::Certificates(chain));
    let err = Client::connect(server.local_addr(), opts).await.unwrap_err();
    assert_eq!(err.code(), Some(&ErrorCode::Unauthenticated), "{err}");
    server.shutdown().await;
}

#[tokio::test]
async fn wrong_certificate_fails_the_handshake_quickly() {
    let (server, _) = start(None).await;
    let (other, _, _) = Identity::self_signed(&["localhost"]).unwrap();
    let opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(other.chain));
    let err = tokio::time::timeout(Duration::from_secs(10), Client::connect(server.local_addr(), opts))
        .await
        .expect("no hang")
        .unwrap_err();
    assert!(matches!(err, ClientError::Connect(_)), "{err}");
    server.shutdown().await;
}

/// The broker's stream allowance bounds how many streams a client holds open at once, not what
/// it can do: with room for 2 bidirectional streams and 1 unidirectional one, 24 subscriptions
/// made at once (each asked on a stream of its own), cache writes and acknowledged publishes
/// beside them all complete, and every subscription gets its records. The default allowance is
/// low because QUIC keeps a table entry per allowed stream on every connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_needing_more_streams_than_the_broker_allows_at_once_waits_for_credit_and_completes() {
    let tight = TransportTuning { max_bi_streams: 2, max_uni_streams: 1, ..TransportTuning::default() };
    let (server, chain) = start_tuned("127.0.0.1:0".parse().unwrap(), None, BrokerConfig::default(), tight).await;
    let c = connect(&server, &chain).await;
    let work = async {
        let subs: Vec<_> = (0..24)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.subscribe("default", &format!("s{i}"), Some(StartPosition::Earliest), None).await
                })
            })
            .collect();
        let puts: Vec<_> = (0..24)
            .map(|i| {
                let c = c.clone();
                tokio::spawn(async move { c.cache_put("default", "c", &format!("k{i}"), Bytes::from("v"), None).await })
            })
            .collect();
        for p in puts {
            p.await.unwrap().unwrap();
        }
        let mut subs_done = Vec::new();
        for s in subs {
            subs_done.push(s.await.unwrap());
        }
        let subs = subs_done;
        let mut subs: Vec<_> = subs.into_iter().map(Result::unwrap).collect();
        for i in 0..24 {
            let ack = PublishOptions { ack: true, ..Default::default() };
            c.publish("default", &format!("s{i}"), vec![Bytes::from(format!("r{i}"))], ack).await.unwrap();
        }
        for (i, sub) in subs.iter_mut().enumerate() {
            let got = collect(sub, 1).await;
            assert_eq!(got[0].1, Bytes::from(format!("r{i}")));
        }
    };
    tokio::time::timeout(Duration::from_secs(30), work).await.expect("everything completes within the allowance");
    server.shutdown().await;
}

#[tokio::test]
async fn a_client_offering_no_alpn_is_accepted() {
    let (server, chain) = start(None).await;
    let mut opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain));
    opts.alpn = felix_driver_tokio::tls::AlpnOffer::None;
    let c = Client::connect(server.local_addr(), opts).await.unwrap();
    c.cache_put("default", "c", "k", Bytes::from("v"), None).await.unwrap();
    server.shutdown().await;
}

#[tokio::test]
async fn subscription_ends_when_the_broker_shuts_down() {
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    let mut sub = c.subscribe("default", "orders", None, None).await.unwrap();
    server.shutdown().await;
    let end = tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("no hang");
    assert!(
        matches!(end, None | Some(SubscriptionItem::End(EndReason::Finished | EndReason::ConnectionLost(_)))),
        "{end:?}"
    );
}

/// A client that predates negotiation, speaking raw frames over QUIC: it must receive exactly the
/// frames a pre-negotiation broker sent.
#[tokio::test]
async fn a_legacy_client_gets_the_exact_legacy_frames() {
    use felix_driver_tokio::tls::client_config;
    use std::sync::Arc;
    let (server, chain) = start(None).await;
    let tls = client_config(Trust::Certificates(chain), false).unwrap();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(quinn::ClientConfig::new(Arc::new(crypto)));
    let conn = ep.connect(server.local_addr(), "localhost").unwrap().await.unwrap();
    let frame = |json: &str| {
        let mut v = vec![0x46, 0x4c, 0x58, 0x31, 0, 1, 0, 0];
        v.extend_from_slice(&(json.len() as u32).to_be_bytes());
        v.extend_from_slice(json.as_bytes());
        v
    };
    let (mut send, mut recv) = conn.open_bi().await.unwrap();
    let requests = [
        r#"{"type":"auth","tenant_id":"t1","token":"test-token"}"#,
        r#"{"type":"subscribe","tenant_id":"t1","namespace":"default","stream":"legacy"}"#,
        r#"{"type":"publish","tenant_id":"t1","namespace":"default","stream":"legacy","payload":"aGVsbG8=","request_id":1,"ack":"per_batch"}"#,
        r#"{"type":"cache_get","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key"}"#,
    ];
    for r in requests {
        send.write_all(&frame(r)).await.unwrap();
    }
    let expected: Vec<u8> = [
        r#"{"type":"ok"}"#,
        r#"{"type":"subscribed","subscription_id":1}"#,
        r#"{"type":"publish_ok","request_id":1}"#,
        r#"{"type":"cache_value","tenant_id":"t1","namespace":"default","cache":"primary","key":"demo-key","value":null}"#,
    ]
    .iter()
    .flat_map(|j| frame(j))
    .collect();
    let mut got = vec![0u8; expected.len()];
    tokio::time::timeout(Duration::from_secs(10), recv.read_exact(&mut got)).await.expect("answers").unwrap();
    assert_eq!(String::from_utf8_lossy(&got), String::from_utf8_lossy(&expected));
    // The event stream: hello, then the plain shared batch (flags 0x0004, no offsets).
    let mut uni = tokio::time::timeout(Duration::from_secs(10), conn.accept_uni()).await.unwrap().unwrap();
    let mut want = frame(r#"{"type":"event_stream_hello","subscription_id":1}"#);
    want.extend_from_slice(&[0x46, 0x4c, 0x58, 0x31, 0, 1, 0, 4, 0, 0, 0, 13, 0, 0, 0, 1, 0, 0, 0, 5]);
    want.extend_from_slice(b"hello");
    let mut got = vec![0u8; want.len()];
    tokio::time::timeout(Duration::from_secs(10), uni.read_exact(&mut got)).await.expect("events").unwrap();
    assert_eq!(got, want);
    conn.close(0u32.into(), b"done");
    server.shutdown().await;
}

#[tokio::test]
async fn metrics_are_served_in_prometheus_text() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    c.publish("default", "m", vec![Bytes::from("x")], PublishOptions { ack: true, ..Default::default() })
        .await
        .unwrap();
    c.cache_get("default", "c", "missing").await.unwrap();
    let mut s = tokio::net::TcpStream::connect(server.metrics_addr.unwrap()).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    assert!(body.starts_with("HTTP/1.1 200 OK"), "{body}");
    assert!(body.contains("felix_connections_open 1"), "{body}");
    assert!(body.contains("felix_records_appended_total 1"), "{body}");
    assert!(body.contains("felix_cache_misses_total 1"), "{body}");
    server.shutdown().await;
}
