//! Flow and back-pressure: handles dropped, finished streams, stream floods, slow subscribers,
//! held publishers, close and drain.

use super::*;

pub(super) fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            out.extend(walk(&p));
        } else {
            out.push(p);
        }
    }
    out
}

async fn gauge(server: &Server, name: &str) -> u64 {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(server.metrics_addr.unwrap()).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await.unwrap();
    let mut body = String::new();
    s.read_to_string(&mut body).await.unwrap();
    body.lines().find_map(|l| l.strip_prefix(name).and_then(|v| v.trim().parse().ok())).unwrap()
}

#[tokio::test]
async fn dropping_every_client_handle_closes_its_connection() {
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    let _sub = c.subscribe("default", "d", None, None).await.unwrap();
    let c2 = c.clone();
    drop(c);
    assert_eq!(gauge(&server, "felix_connections_open").await, 1, "a clone still holds it");
    drop(c2);
    // The broker hears the close (no idle timeout needed): wait for that event, bounded.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while gauge(&server, "felix_connections_open").await != 0 {
        assert!(tokio::time::Instant::now() < deadline, "the connection was not closed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(gauge(&server, "felix_subscriptions").await, 0);
    assert_eq!(gauge(&server, "felix_driver_stream_writers").await, 0);
    server.shutdown().await;
}

/// An `Auth` frame, for raw QUIC streams.
fn auth_frame() -> Bytes {
    let m = felix_proto::Message::Auth(felix_proto::message::Auth::plain("t1", TOKEN));
    let mut b = bytes::BytesMut::new();
    m.encode(&mut b).unwrap();
    b.freeze()
}

/// A stream's reader ends when the client finishes sending on it, and the driver forgets it
/// then: a long-lived connection making one request after another, each on a stream of its
/// own, holds no reader state for the streams it is done with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_holds_no_reader_for_the_request_streams_it_finished() {
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    let before = gauge(&server, "felix_driver_stream_readers").await;
    let mut subs = Vec::new();
    for i in 0..30 {
        // Each subscription is asked for on a stream of its own, finished once answered.
        subs.push(c.subscribe("default", &format!("s{i}"), None, None).await.unwrap());
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = gauge(&server, "felix_driver_stream_readers").await;
        if now <= before + 2 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "{now} readers after 30 finished requests (from {before})");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    drop(subs);
    server.shutdown().await;
}

/// A peer that opens streams as fast as it can is held at the stream limit by QUIC; the broker
/// keeps serving others, holds at most that many control streams, and frees them all when the
/// peer goes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_flood_is_held_at_the_limit_and_others_are_served() {
    let (server, chain) = start(None).await;
    let tls = felix_driver_tokio::tls::client_config(Trust::Certificates(chain.clone()), true).unwrap();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(crypto)));
    let flood = endpoint.connect(server.local_addr(), "localhost").unwrap().await.unwrap();
    let auth = auth_frame();
    let mut opened = Vec::new();
    let blocked = loop {
        // Below the most the broker grants more as streams are used (a round trip); at it,
        // QUIC says no more streams for now.
        let wait = if opened.len() < 1024 { Duration::from_secs(10) } else { Duration::from_millis(300) };
        match tokio::time::timeout(wait, flood.open_bi()).await {
            Ok(Ok((mut send, recv))) => {
                send.write_all(&auth).await.unwrap();
                opened.push((send, recv));
            }
            Ok(Err(e)) => panic!("{e}"),
            Err(_) => break opened.len(),
        }
        assert!(opened.len() <= 5000, "no stream limit");
    };
    assert_eq!(blocked, 1024, "the configured most");
    // Someone else is served meanwhile.
    let c = connect(&server, &chain).await;
    c.publish("default", "f", vec![Bytes::from("x")], PublishOptions { ack: true, ..Default::default() })
        .await
        .unwrap();
    assert!(gauge(&server, "felix_control_streams").await <= 1024 + 1);
    flood.close(0u32.into(), b"done");
    drop(opened);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while gauge(&server, "felix_control_streams").await > 1 {
        assert!(tokio::time::Instant::now() < deadline, "the flood's streams were not freed");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.shutdown().await;
}

/// A broker whose subscriber queues hold 4 batches, and a client that holds at most 64 KiB of
/// unread events per subscription behind a 128 KiB stream window: a reader that soon pushes back.
async fn small_queues_and_a_reader(mut broker: BrokerConfig) -> (Server, Vec<CertificateDer<'static>>, Client) {
    broker.default_stream.queue_capacity = 4;
    let (server, chain) = start_with(None, broker).await;
    let mut opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain.to_vec()));
    opts.subscription_buffer_bytes = 64 * 1024;
    opts.transport.stream_receive_window = 128 * 1024;
    let reader = Client::connect(server.local_addr(), opts).await.unwrap();
    (server, chain, reader)
}

/// An application that stops reading a subscription does not make the client buffer without
/// bound: past `subscription_buffer_bytes` the client stops reading the event stream, QUIC flow
/// control holds the broker, and the broker's bounded queue ends the (durable) subscription with
/// `subscription_lagged`. Resuming at `lagged_resume_point` then gets the rest, with no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_subscriber_that_stops_reading_pushes_back_instead_of_buffering() {
    let (_server, _chain, c) = small_queues_and_a_reader(BrokerConfig::default()).await;
    let mut sub = c.subscribe("default", "held", None, None).await.unwrap();
    const N: u64 = 400;
    let payload = |i: u64| Bytes::from(format!("{i:06}{}", "x".repeat(4090)));
    for i in 0..N {
        let ack = PublishOptions { ack: true, ..Default::default() };
        c.publish("default", "held", vec![payload(i)], ack).await.unwrap();
    }
    // Only now does the application read.
    let mut got: Vec<u64> = Vec::new();
    let resume_from = loop {
        match tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("items arrive") {
            Some(SubscriptionItem::Events(b)) => {
                got.extend((0..u64::from(b.records.count())).map(|i| b.base_offset.unwrap() + i))
            }
            Some(SubscriptionItem::End(EndReason::Lagged { resume_from })) => break resume_from,
            other => panic!("the broker must have seen the pushback and ended with lagged: {other:?}"),
        }
    };
    assert!((got.len() as u64) < N, "the client did not take everything: {} of {N}", got.len());
    let from = felix_proto::client::lagged_resume_point(got.last().copied(), resume_from);
    let mut rest = c.subscribe("default", "held", Some(StartPosition::Offset(from)), None).await.unwrap();
    got.extend(collect(&mut rest, (N - from) as usize).await.into_iter().map(|(o, p)| {
        assert_eq!(p, payload(o), "offset {o} carries its own record");
        o
    }));
    assert_eq!(got, (0..N).collect::<Vec<_>>(), "nothing lost, nothing twice");
}

/// A paused subscription is read again once the application catches up: past the buffer bound
/// but within the broker's queue, everything arrives, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_subscription_resumes_when_the_application_catches_up() {
    let (server, chain) = start(None).await;
    let mut opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain.to_vec()));
    opts.subscription_buffer_bytes = 16 * 1024;
    let c = Client::connect(server.local_addr(), opts).await.unwrap();
    let mut sub = c.subscribe("default", "paced", None, None).await.unwrap();
    const N: usize = 64;
    for i in 0..N {
        let ack = PublishOptions { ack: true, ..Default::default() };
        c.publish("default", "paced", vec![Bytes::from(format!("{i:06}{}", "y".repeat(4090)))], ack).await.unwrap();
    }
    let got = collect(&mut sub, N).await;
    assert_eq!(got.iter().map(|(o, _)| *o).collect::<Vec<_>>(), (0..N as u64).collect::<Vec<_>>());
}

/// On a stream kept in memory there is no log to catch up from, so a subscriber that stops
/// reading holds its publisher instead of losing records: the broker stops reading the
/// publisher's stream, QUIC flow control blocks its unacknowledged publishes, and once the
/// application reads again every record arrives, in order, none dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unacked_publisher_is_held_for_a_subscriber_of_an_ephemeral_stream_and_nothing_is_lost() {
    let mut broker = BrokerConfig::default();
    broker.default_stream.durable = false;
    let (server, chain, reader) = small_queues_and_a_reader(broker).await;
    let mut sub = reader.subscribe("default", "mem", None, None).await.unwrap();
    const N: usize = 800;
    let payload = |i: usize| Bytes::from(format!("{i:06}{}", "x".repeat(4090)));
    let publisher = connect(&server, &chain).await;
    let publishing = tokio::spawn(async move {
        for i in 0..N {
            publisher.publish("default", "mem", vec![payload(i)], PublishOptions::default()).await.unwrap();
        }
        publisher.close().await.unwrap();
    });
    // The application reads nothing until the broker holds the publisher (3.2 MB sent at a
    // subscriber that takes about 1.3 MB before its windows and queue are full).
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while gauge(&server, "felix_publishers_held_total").await == 0 {
        assert!(tokio::time::Instant::now() < deadline, "the publisher was never held");
        assert!(!publishing.is_finished(), "all {N} went out without a hold");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let mut got = Vec::new();
    while got.len() < N {
        match tokio::time::timeout(Duration::from_secs(10), sub.next()).await.expect("events arrive") {
            Some(SubscriptionItem::Events(b)) => got.extend(b.records.payloads()),
            other => panic!("unexpected {other:?}"),
        }
    }
    tokio::time::timeout(Duration::from_secs(10), publishing).await.expect("the publisher finished").unwrap();
    assert!(got.iter().enumerate().all(|(i, p)| *p == payload(i)), "every record once, in order");
    assert_eq!(gauge(&server, "felix_subscriber_records_dropped_total").await, 0);
    assert_eq!(gauge(&server, "felix_subscribers_excused_total").await, 0);
    server.shutdown().await;
}

/// Fire-and-forget means "no answer", not "may be dropped on a clean exit": `close().await`
/// waits until the broker acknowledged everything written, so every unacked publish lands even
/// when the client's runtime ends the moment `close` returns (as a process does when it exits).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_loses_no_unacknowledged_publish() {
    let (server, chain) = start(None).await;
    let addr = server.local_addr();
    for round in 0..5 {
        let chain = chain.clone();
        // The client lives on a runtime of its own, dropped right after the close: nothing it
        // left unsent gets another chance.
        std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            rt.block_on(async {
                let opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain));
                let c = Client::connect(addr, opts).await.unwrap();
                for i in 0..200 {
                    let p = Bytes::from(format!("r{round}-{i}-{}", "x".repeat(4 << 10)));
                    c.publish("default", "fire", vec![p], PublishOptions::default()).await.unwrap();
                }
                c.close().await.unwrap();
            });
            drop(rt);
        })
        .join()
        .unwrap();
    }
    let c = connect(&server, &chain).await;
    let mut n = 0;
    let mut from = 0;
    loop {
        let page = c.stream_read("default", "fire", 0, from, None, None).await.unwrap();
        if page.records.is_empty() {
            break;
        }
        n += page.records.len();
        from = page.next_offset;
    }
    assert_eq!(n, 1000);
    server.shutdown().await;
}

/// `Server::drain`: with nothing in flight it stops at once (0 cut short), everything
/// acknowledged before is on disk, and the broker takes no connection afterwards.
#[tokio::test]
async fn draining_finishes_what_is_in_flight_then_stops() {
    let dir = tempfile::tempdir().unwrap();
    let (server, chain) = start(Some(dir.path())).await;
    let addr = server.local_addr();
    let client = connect(&server, &chain).await;
    for i in 0..20u8 {
        let o = PublishOptions { ack: true, ..PublishOptions::default() };
        client.publish("default", "orders", vec![Bytes::from(vec![i])], o).await.unwrap();
    }
    let started = std::time::Instant::now();
    let left = server.drain(Duration::from_secs(5)).await;
    assert_eq!(left, 0, "nothing was in flight");
    assert!(started.elapsed() < Duration::from_secs(4), "an idle broker drains at once: {:?}", started.elapsed());
    let opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain.clone()));
    let again = tokio::time::timeout(Duration::from_secs(3), felix_driver_tokio::Client::connect(addr, opts)).await;
    assert!(!matches!(again, Ok(Ok(_))), "a drained broker takes no connection");
    // Restarted on the same directory: the 20 acknowledged records are there.
    let (server, chain) = start(Some(dir.path())).await;
    let client = connect(&server, &chain).await;
    let page = client.stream_read("default", "orders", 0, 0, None, None).await.unwrap();
    assert_eq!(page.records.len(), 20);
    server.shutdown().await;
}
