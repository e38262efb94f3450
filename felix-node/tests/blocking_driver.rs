//! The blocking driver (felix-driver-blocking: no tokio, one thread, quinn-proto) serving the
//! unchanged `felix-node` client commands and passing the live conformance suite; its client
//! talking to both drivers; a restart recovering what it stored.

use bytes::Bytes;
use felix_driver_blocking::{BlockingBroker, BlockingClient, BrokerOptions, ConnectOptions, StopHandle};
use felix_driver_common::data_dir::DataDir;
use felix_driver_common::transport::TransportTuning;
use felix_driver_common::{FsyncMode, Trust};
use felix_proto::broker::{BrokerConfig, TokenGrant};
use felix_proto::client::{ClientConnection, ClientEvent, ClientStream, CommandError, Reply};
use felix_proto::message::{Message, StartPosition};
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_felix-node");
const TOKEN: &str = "blocking-test-token";

struct Running {
    addr: SocketAddr,
    stop: StopHandle,
    thread: Option<JoinHandle<()>>,
    recovered: u64,
}

impl Running {
    fn stop(mut self) {
        self.stop.stop();
        if let Some(t) = self.thread.take() {
            t.join().expect("the broker thread ended cleanly");
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.stop.stop();
    }
}

/// A blocking broker on its own thread, with `dir` as its data directory (certificate and dev
/// token where `felix-node` clients look for them).
fn start(dir: &Path) -> Running {
    start_tuned(dir, Default::default())
}

/// [`start`] with these QUIC settings.
fn start_tuned(dir: &Path, transport: TransportTuning) -> Running {
    let data = DataDir::new(dir);
    let token = data.dev_token(Some(TOKEN)).unwrap();
    let (identity, _) = data.identity().unwrap();
    let broker = BlockingBroker::bind(BrokerOptions {
        listen: "127.0.0.1:0".parse().unwrap(),
        broker: BrokerConfig { tokens: vec![TokenGrant::dev(token)], ..BrokerConfig::default() },
        identity,
        data_dir: Some(dir.to_path_buf()),
        fsync: FsyncMode::Always,
        transport,
    })
    .unwrap();
    let addr = broker.local_addr().unwrap();
    let stop = broker.stop_handle();
    let recovered = broker.recovered_records;
    let thread = std::thread::spawn(move || broker.run().unwrap());
    Running { addr, stop, thread: Some(thread), recovered }
}

/// The tokio driver's broker with `dir` as its data directory, on a runtime of its own.
fn start_tokio(dir: &Path) -> (tokio::runtime::Runtime, felix_driver_tokio::Server) {
    start_tokio_tuned(dir, Default::default())
}

/// [`start_tokio`] with these QUIC settings.
fn start_tokio_tuned(dir: &Path, transport: TransportTuning) -> (tokio::runtime::Runtime, felix_driver_tokio::Server) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let (identity, _) = DataDir::new(dir).identity().unwrap();
    let server = rt
        .block_on(felix_driver_tokio::Server::start(felix_driver_tokio::ServerOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            broker: BrokerConfig { tokens: vec![TokenGrant::dev(TOKEN)], ..BrokerConfig::default() },
            identity,
            data_dir: Some(dir.to_path_buf()),
            fsync: FsyncMode::Always,
            transport,
            require_alpn: false,
            metrics_listen: None,
            http: None,
            cluster: None,
            client_ca: None,
        }))
        .unwrap();
    (rt, server)
}

fn cli(dir: &Path, addr: SocketAddr, args: &[&str]) -> (bool, String, String) {
    let out =
        Command::new(BIN).env("FELIX_ADDR", addr.to_string()).env("FELIX_DATA_DIR", dir).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn felix_node_commands_and_live_conformance_pass_against_the_blocking_driver() {
    let dir = tempfile::tempdir().unwrap();
    let b = start(dir.path());
    let (ok, _, err) = cli(dir.path(), b.addr, &["publish", "orders", "hello", "world", "--ack"]);
    assert!(ok, "{err}");
    let (ok, out, err) = cli(dir.path(), b.addr, &["subscribe", "orders", "--from", "earliest", "--count", "2"]);
    assert!(ok, "{err}");
    assert_eq!(out, "0\thello\n1\tworld\n");
    let (_, out, err) = cli(dir.path(), b.addr, &["read", "orders", "--from", "1"]);
    assert_eq!(out, "1\tworld\n", "{err}");
    let (ok, _, err) = cli(dir.path(), b.addr, &["cache", "put", "sessions", "user:1", "alice"]);
    assert!(ok, "{err}");
    let (_, out, err) = cli(dir.path(), b.addr, &["cache", "get", "sessions", "user:1"]);
    assert_eq!(out, "alice\n", "{err}");
    let (_, out, err) = cli(dir.path(), b.addr, &["consume", "orders", "--group", "g1", "--count", "2"]);
    assert_eq!(out, "0\t1\thello\n1\t1\tworld\n", "{err}");
    // Exactly once from the command line: lines of a file, two per batch, pipelined.
    let lines = dir.path().join("lines.txt");
    std::fs::write(&lines, "a\nb\nc\n").unwrap();
    let (ok, _, err) = cli(
        dir.path(),
        b.addr,
        &["publish", "once", "--idempotent", "--batch", "2", "--file", lines.to_str().unwrap()],
    );
    assert!(ok && err.contains("published 3 record(s) exactly once"), "{err}");
    let (_, out, err) = cli(dir.path(), b.addr, &["read", "once"]);
    assert_eq!(out, "0\ta\n1\tb\n2\tc\n", "{err}");
    let (ok, _, err) = cli(dir.path(), b.addr, &["publish", "once", "x", "--idempotent", "--ack-on-enqueue"]);
    assert!(!ok && err.contains("cannot be used with"), "{err}");

    let ca = dir.path().join("tls/cert.pem");
    let out = Command::new(BIN)
        .args(["conformance", "--addr", &b.addr.to_string(), "--token", TOKEN, "--tenant", "t1", "--ca"])
        .arg(&ca)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(stdout.lines().last(), Some("15 passed, 0 failed, 0 skipped"), "{stdout}");
    b.stop();
}

#[test]
fn the_blocking_client_talks_to_both_drivers() {
    let dir = tempfile::tempdir().unwrap();
    let blocking = start(dir.path());
    let tokio_dir = tempfile::tempdir().unwrap();
    let (rt, server) = start_tokio(tokio_dir.path());
    for (addr, data) in [(blocking.addr, dir.path()), (server.local_addr(), tokio_dir.path())] {
        let certs = felix_driver_common::tls::load_certs(&data.join("tls/cert.pem")).unwrap();
        let mut c =
            BlockingClient::connect(ConnectOptions::new(addr, Trust::Certificates(certs), "t1", TOKEN)).unwrap();
        let first = c.publish("default", "orders", vec![Bytes::from_static(b"a"), Bytes::from_static(b"b")]).unwrap();
        let second = c.publish("default", "orders", vec![Bytes::from_static(b"c")]).unwrap();
        assert_eq!((first, second), (Some(0), Some(2)), "offsets after the write");
        let sub = c.subscribe("default", "orders", StartPosition::Earliest).unwrap();
        let mut got = Vec::new();
        while got.len() < 3 {
            let batch = c.next_batch(sub, Duration::from_secs(5)).unwrap().expect("a batch within 5 s");
            got.extend(batch.records.iter().map(|r| r.payload.clone()));
        }
        assert_eq!(got, [&b"a"[..], b"b", b"c"]);
        c.cache_put("default", "sessions", "k", Bytes::from_static(b"v")).unwrap();
        assert_eq!(c.cache_get("default", "sessions", "k").unwrap(), Some(Bytes::from_static(b"v")));
        assert_eq!(c.cache_get("default", "sessions", "missing").unwrap(), None);
        // A refusal is a typed error, not a hang.
        let long = "x".repeat(300);
        let err = c.publish("default", &long, vec![Bytes::new()]).unwrap_err();
        assert!(matches!(err, felix_driver_blocking::ClientError::Refused(_)), "{err}");
        c.close();
    }
    blocking.stop();
    rt.block_on(server.shutdown());
}

#[test]
fn a_restarted_blocking_broker_serves_what_it_stored() {
    let dir = tempfile::tempdir().unwrap();
    let b = start(dir.path());
    let (ok, _, err) = cli(dir.path(), b.addr, &["publish", "orders", "one", "two", "three", "--ack"]);
    assert!(ok, "{err}");
    b.stop();
    let b = start(dir.path());
    assert_eq!(b.recovered, 3);
    let (_, out, err) = cli(dir.path(), b.addr, &["subscribe", "orders", "--from", "earliest", "--count", "3"]);
    assert_eq!(out, "0\tone\n1\ttwo\n2\tthree\n", "{err}");
    // Deleted by an operator: gone from disk, not back after a restart, the name free again.
    let (ok, _, err) = cli(dir.path(), b.addr, &["stream", "delete", "orders"]);
    assert!(!ok && err.contains("--yes"), "a deletion without a terminal needs --yes: {err}");
    let (ok, out, err) = cli(dir.path(), b.addr, &["stream", "delete", "orders", "--yes"]);
    assert!(ok && out == "deleted default/orders\n", "{out}{err}");
    let (ok, _, err) = cli(dir.path(), b.addr, &["stream", "delete", "orders", "--yes"]);
    assert!(!ok && err.contains("no stream default/orders"), "{err}");
    assert!(!dir.path().join("streams/t1/default/orders").exists(), "its files are removed");
    b.stop();
    let b = start(dir.path());
    assert_eq!(b.recovered, 0);
    let (ok, _, err) = cli(dir.path(), b.addr, &["publish", "orders", "fresh", "--ack"]);
    assert!(ok && err.contains("offset 0"), "{err}");
    b.stop();
}

/// A client as the scenario below drives it: the same `ClientConnection` commands, whatever
/// moves its bytes.
trait Party {
    /// Runs a command and waits for its answer, written out (`Debug` of the reply or refusal).
    fn ask(&mut self, cmd: &dyn Fn(&mut ClientConnection, Instant) -> Result<Asked, CommandError>) -> String;
}

/// What a command returned: a request's id or a publish's.
enum Asked {
    Request(u64),
    Publish(felix_proto::client::PublishId),
}

fn answer_of(e: &ClientEvent, asked: &Asked) -> Option<String> {
    match (e, asked) {
        // Cache versions start from the broker's wall clock (unique across restarts): only
        // whether there is one is the same everywhere.
        (ClientEvent::Reply { request_id, reply: Reply::CacheValue { value, version } }, Asked::Request(r))
            if request_id == r =>
        {
            Some(format!("CacheValue {{ value: {value:?}, versioned: {} }}", version.is_some()))
        }
        (ClientEvent::Reply { request_id, reply }, Asked::Request(r)) if request_id == r => Some(format!("{reply:?}")),
        (ClientEvent::RequestFailed { request_id, error, .. }, Asked::Request(r)) if request_id == r => {
            Some(format!("failed {:?} {:?}", error.code, error.message))
        }
        (ClientEvent::PublishAcked { id, offset, .. }, Asked::Publish(p)) if id == p => {
            Some(format!("acked {offset:?}"))
        }
        (ClientEvent::PublishFailed { id, error }, Asked::Publish(p)) if id == p => {
            Some(format!("publish failed {:?}", error.code))
        }
        (ClientEvent::PublishRefused { id, reason, .. }, Asked::Publish(p)) if id == p => {
            Some(format!("refused {reason:?}"))
        }
        _ => None,
    }
}

impl Party for BlockingClient {
    fn ask(&mut self, cmd: &dyn Fn(&mut ClientConnection, Instant) -> Result<Asked, CommandError>) -> String {
        let asked = match cmd(self.core(), Instant::now()) {
            Ok(a) => a,
            Err(e) => return format!("not sent: {e}"),
        };
        self.wait_for(|e| answer_of(e, &asked).map(Ok)).unwrap()
    }
}

/// The deterministic simulation: broker and client state machines in memory, no QUIC.
struct SimParty {
    sim: felix_proto::sim::Sim,
    c: usize,
}

impl Party for SimParty {
    fn ask(&mut self, cmd: &dyn Fn(&mut ClientConnection, Instant) -> Result<Asked, CommandError>) -> String {
        let now = self.sim.now;
        let asked = match cmd(self.sim.client(self.c), now) {
            Ok(a) => a,
            Err(e) => return format!("not sent: {e}"),
        };
        self.sim.run();
        let events = self.sim.take_events(self.c);
        events.iter().find_map(|e| answer_of(e, &asked)).unwrap_or_else(|| panic!("no answer in {events:?}"))
    }
}

/// One scenario over every feature the drivers carry differently (acked publishes answered after
/// the write, caches, counters and commits on storage, conditional writes, refusals, deletion):
/// its transcript.
fn scenario(p: &mut dyn Party) -> Vec<String> {
    use felix_proto::client::{CommitRequest, PublishRequest};
    let main = ClientStream(0);
    let publish = |stream: &'static str, payloads: &'static [&'static str]| {
        move |c: &mut ClientConnection, now: Instant| {
            let req = PublishRequest::new(
                "default",
                stream,
                payloads.iter().map(|s| Bytes::from_static(s.as_bytes())).collect(),
            )
            .acked();
            c.publish_auto(req, now).map(Asked::Publish)
        }
    };
    let commit = |expected_offset: Option<u64>, value: &'static str| {
        move |c: &mut ClientConnection, _: Instant| {
            c.commit(
                main,
                CommitRequest {
                    namespace: "default".into(),
                    stream: "accounts".into(),
                    entity_key: Bytes::from_static(b"acct"),
                    event: Bytes::from_static(b"event"),
                    changes: vec![("balance".into(), Some(Bytes::from_static(value.as_bytes())))],
                    expected_offset,
                },
            )
            .map(Asked::Request)
        }
    };
    vec![
        p.ask(&publish("orders", &["a", "b"])),
        p.ask(&publish("orders", &["c"])),
        p.ask(&|c, _| c.cache_put(main, "default", "s", "k", Bytes::from_static(b"v"), None).map(Asked::Request)),
        p.ask(&|c, _| c.cache_get(main, "default", "s", "k").map(Asked::Request)),
        p.ask(&|c, _| c.cache_get(main, "default", "s", "missing").map(Asked::Request)),
        p.ask(&|c, _| c.counter_add(main, "default", "stats", "views", 5).map(Asked::Request)),
        p.ask(&|c, _| c.counter_add(main, "default", "stats", "views", -2).map(Asked::Request)),
        p.ask(&commit(None, "10")),
        p.ask(&commit(Some(0), "20")),
        p.ask(&commit(Some(1), "30")),
        p.ask(&|c, _| {
            c.state_get(main, "default", "accounts", Bytes::from_static(b"acct"), "balance").map(Asked::Request)
        }),
        p.ask(&|c, _| c.stream_shards(main, "default", "orders").map(Asked::Request)),
        // A name longer than names may be: refused, with a code.
        p.ask(&|c, now| {
            let req = PublishRequest::new("default", "x".repeat(300), vec![Bytes::from_static(b"x")]).acked();
            c.publish_auto(req, now).map(Asked::Publish)
        }),
        p.ask(&|c, _| {
            c.request(main, |request_id| {
                Message::StreamDelete(felix_proto::message::StreamDelete {
                    tenant_id: "t1".into(),
                    namespace: "default".into(),
                    stream: "orders".into(),
                    request_id,
                })
            })
            .map(Asked::Request)
        }),
        p.ask(&publish("orders", &["again"])),
    ]
}

/// The same scenario through the simulation and through both drivers over QUIC gives the same
/// transcript, answer for answer: the drivers decide nothing.
#[test]
fn one_scenario_gives_one_transcript_in_the_simulation_and_through_both_drivers() {
    let mut cfg = BrokerConfig { tokens: vec![TokenGrant::dev(TOKEN)], ..BrokerConfig::default() };
    cfg.history_reads = true; // the drivers run with storage
    let mut sim = felix_proto::sim::Sim::new(cfg, Instant::now());
    let c = sim.connect(felix_proto::client::ClientConfig::new("t1", TOKEN));
    sim.run();
    sim.take_events(c);
    let expected = scenario(&mut SimParty { sim, c });
    assert!(expected.iter().any(|l| l.contains("Committed(0)")), "{expected:#?}");
    assert!(expected.iter().any(|l| l.contains("OffsetMismatch")), "{expected:#?}");

    let dir = tempfile::tempdir().unwrap();
    let blocking = start(dir.path());
    let tokio_dir = tempfile::tempdir().unwrap();
    let (rt, server) = start_tokio(tokio_dir.path());
    for (name, addr, data) in
        [("blocking", blocking.addr, dir.path()), ("tokio", server.local_addr(), tokio_dir.path())]
    {
        let certs = felix_driver_common::tls::load_certs(&data.join("tls/cert.pem")).unwrap();
        let mut c =
            BlockingClient::connect(ConnectOptions::new(addr, Trust::Certificates(certs), "t1", TOKEN)).unwrap();
        assert_eq!(scenario(&mut c), expected, "the {name} driver");
        c.close();
    }
    blocking.stop();
    rt.block_on(server.shutdown());
}

/// Opens bidirectional streams on `addr` with a raw QUIC client and returns how many opened
/// before QUIC held it: first with nothing sent on them (the broker cannot know of them), then
/// each holding an `Auth`, so the broker grants more as they are used.
async fn streams_granted(
    addr: SocketAddr,
    certs: Vec<felix_driver_common::tls::CertificateDer<'static>>,
    most: usize,
) -> (usize, usize) {
    let tls = felix_driver_tokio::tls::client_config(Trust::Certificates(certs), true).unwrap();
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).unwrap();
    let mut endpoint = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    endpoint.set_default_client_config(quinn::ClientConfig::new(std::sync::Arc::new(crypto)));
    let conn = endpoint.connect(addr, "localhost").unwrap().await.unwrap();
    let mut streams = Vec::new();
    while let Ok(s) = tokio::time::timeout(Duration::from_millis(300), conn.open_bi()).await {
        streams.push(s.unwrap());
        assert!(streams.len() <= most, "more streams than the most");
    }
    let first = streams.len();
    let mut auth = bytes::BytesMut::new();
    Message::Auth(felix_proto::message::Auth::plain("t1", TOKEN)).encode(&mut auth).unwrap();
    for (send, _) in &mut streams {
        send.write_all(&auth).await.unwrap();
    }
    loop {
        // Below the most a grant is a round trip away; at it none comes.
        let wait = if streams.len() < most { Duration::from_secs(10) } else { Duration::from_millis(300) };
        let Ok(s) = tokio::time::timeout(wait, conn.open_bi()).await else { break };
        let (mut send, recv) = s.unwrap();
        send.write_all(&auth).await.unwrap();
        streams.push((send, recv));
        assert!(streams.len() <= most, "more streams than the most");
    }
    for (_, recv) in &mut streams {
        let mut head = [0u8; 12];
        tokio::time::timeout(Duration::from_secs(10), recv.read_exact(&mut head)).await.unwrap().unwrap();
        assert_eq!(&head[..4], b"FLX1", "each stream was answered");
    }
    conn.close(0u32.into(), b"done");
    (first, streams.len())
}

/// Both drivers start a connection with a few streams (quinn keeps a table entry per stream a
/// peer may open: most of an idle connection's memory at the full allowance) and grant more as
/// they are used, up to the configured most.
#[test]
fn both_drivers_grant_streams_as_a_connection_uses_them_up_to_the_most() {
    const MOST: usize = 40;
    let tuning = TransportTuning { max_bi_streams: MOST as u32, ..Default::default() };
    let (dir, tokio_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (rt, server) = start_tokio_tuned(tokio_dir.path(), tuning.clone());
    let blocking = start_tuned(dir.path(), tuning);
    let certs = |d: &Path| felix_driver_common::tls::load_certs(&d.join("tls/cert.pem")).unwrap();
    let first = felix_driver_common::transport::INITIAL_BI_STREAMS as usize;
    let got = rt.block_on(streams_granted(blocking.addr, certs(dir.path()), MOST));
    assert_eq!(got, (first, MOST), "the blocking driver");
    blocking.stop();
    let got = rt.block_on(streams_granted(server.local_addr(), certs(tokio_dir.path()), MOST));
    assert_eq!(got, (first, MOST), "the tokio driver");
    rt.block_on(server.shutdown());
}
