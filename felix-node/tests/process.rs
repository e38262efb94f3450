//! Tests against a real `felix-node serve` process: the README's client commands, and crash
//! safety (SIGKILL under acked load, then restart).

use bytes::Bytes;
use felix_driver_tokio::{Client, ClientOptions, PublishOptions, SubscriptionItem, Trust};
use felix_proto::message::StartPosition;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_felix-node");
const TOKEN: &str = "process-test-token";

fn free_port() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

/// A broker process that is killed when dropped, so a failing test leaves no broker behind.
struct Broker(Child);

impl std::ops::Deref for Broker {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Broker {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        // Already gone after a clean stop or a kill in the test; otherwise stop it now.
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Starts `felix-node serve` and waits for its "listening" banner.
fn serve(data: &Path, addr: SocketAddr, extra: &[&str]) -> Broker {
    serve_with_env(data, addr, extra, &[])
}

/// As [`serve`], with more environment variables.
fn serve_with_env(data: &Path, addr: SocketAddr, extra: &[&str], env: &[(&str, &str)]) -> Broker {
    let child = Command::new(BIN)
        .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
        .arg(data)
        .args(["--dev-token", TOKEN])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_banner(child)
}

/// Waits for the broker's "listening" banner, then keeps draining its stdout so it never
/// blocks on a full pipe.
fn wait_for_banner(mut child: Child) -> Broker {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("broker printed its banner").unwrap();
        if line.starts_with("Felix broker listening") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Broker(child)
}

fn client_cmd(data: &Path, addr: SocketAddr) -> Command {
    let mut c = Command::new(BIN);
    c.env("FELIX_ADDR", addr.to_string()).env("FELIX_DATA_DIR", data);
    c
}

/// Runs a client command against `addr`: its exit code, standard output and standard error.
fn run_cli(data: &Path, addr: SocketAddr, args: &[&str]) -> (Option<i32>, String, String) {
    let out = client_cmd(data, addr).args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `felix-node subscribe | head -n 1`: the subscriber writes its output a batch at a time, and
/// must still notice that its reader went away and exit, rather than read on for ever.
#[test]
fn subscribe_exits_once_its_output_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let publish = |what: &str| {
        let p = client_cmd(dir.path(), addr).args(["publish", "orders", what, "--ack"]).output().unwrap();
        assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    };
    publish("first");
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "0\tfirst");
    drop(lines); // the reader goes away, as `head` does
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        // Something more to write: the write meets the closed pipe.
        publish("more");
        if let Some(s) = sub.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > until {
            let _ = sub.kill();
            panic!("the subscriber went on with its output closed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn readme_commands_work_against_a_served_broker() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut broker = serve(dir.path(), addr, &[]);
    assert!(dir.path().join("tls/cert.pem").exists(), "certificate generated on first start");
    let publish = client_cmd(dir.path(), addr).args(["publish", "orders", "hello", "world", "--ack"]).output().unwrap();
    assert!(publish.status.success(), "{}", String::from_utf8_lossy(&publish.stderr));
    let sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest", "--count", "2"])
        .output()
        .unwrap();
    assert!(sub.status.success(), "{}", String::from_utf8_lossy(&sub.stderr));
    assert_eq!(String::from_utf8_lossy(&sub.stdout), "0\thello\n1\tworld\n");
    let json = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "1", "--count", "1", "--json"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&json.stdout).trim(), r#"{"offset":1,"payload":"world","shard":0}"#);
    // History without subscribing, and by time.
    let read = client_cmd(dir.path(), addr).args(["read", "orders", "--from", "1"]).output().unwrap();
    assert!(read.status.success(), "{}", String::from_utf8_lossy(&read.stderr));
    assert_eq!(String::from_utf8_lossy(&read.stdout), "1\tworld\n");
    let since =
        client_cmd(dir.path(), addr).args(["subscribe", "orders", "--since", "1h", "--count", "2"]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&since.stdout),
        "0\thello\n1\tworld\n",
        "{}",
        String::from_utf8_lossy(&since.stderr)
    );
    let add = client_cmd(dir.path(), addr).args(["counter", "add", "stats", "views", "5"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&add.stdout), "5\n", "{}", String::from_utf8_lossy(&add.stderr));
    let add = client_cmd(dir.path(), addr).args(["counter", "add", "stats", "views", "-7"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&add.stdout), "-2\n", "{}", String::from_utf8_lossy(&add.stderr));
    let never = client_cmd(dir.path(), addr).args(["counter", "get", "stats", "clicks"]).output().unwrap();
    assert_eq!(never.status.code(), Some(1), "never written exits 1");
    // Consumer groups: consume acks what it prints; the group's position follows.
    let consume =
        client_cmd(dir.path(), addr).args(["consume", "orders", "--group", "g1", "--count", "2"]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&consume.stdout),
        "0\t1\thello\n1\t1\tworld\n",
        "{}",
        String::from_utf8_lossy(&consume.stderr)
    );
    let describe = client_cmd(dir.path(), addr).args(["group", "describe", "orders", "-g", "g1"]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&describe.stdout).starts_with("position\t2\ntail\t2\n"),
        "{}",
        String::from_utf8_lossy(&describe.stdout)
    );
    let seek = client_cmd(dir.path(), addr).args(["group", "seek", "orders", "-g", "g1", "earliest"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&seek.stdout), "0\n");
    let poll =
        client_cmd(dir.path(), addr).args(["group", "poll", "orders", "-g", "g1", "--max", "1"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&poll.stdout), "0\t1\thello\n");
    let ack = client_cmd(dir.path(), addr).args(["group", "ack", "orders", "-g", "g1", "5"]).output().unwrap();
    assert!(!ack.status.success(), "offset 5 was never written");
    assert!(
        String::from_utf8_lossy(&ack.stderr).contains("invalid_request"),
        "{}",
        String::from_utf8_lossy(&ack.stderr)
    );
    let put0 = client_cmd(dir.path(), addr).args(["cache", "put", "sessions", "user:1", "alice"]).output().unwrap();
    assert!(put0.status.success());
    // A watch prints the current value (--retained), then each change as it happens.
    let mut watch = client_cmd(dir.path(), addr)
        .args(["cache", "watch", "sessions", "user:1", "--retained", "--count", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    assert!(first.ends_with("\tuser:1\talice"), "{first}");
    let del = client_cmd(dir.path(), addr).args(["cache", "delete", "sessions", "user:1"]).output().unwrap();
    assert!(del.status.success());
    let second = lines.next().unwrap().unwrap();
    assert!(second.ends_with("\tuser:1\t<deleted>"), "{second}");
    assert!(watch.wait().unwrap().success());
    let put = client_cmd(dir.path(), addr).args(["cache", "put", "sessions", "user:1", "alice"]).output().unwrap();
    assert!(put.status.success());
    let get = client_cmd(dir.path(), addr).args(["cache", "get", "sessions", "user:1"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&get.stdout), "alice\n");
    let miss = client_cmd(dir.path(), addr).args(["cache", "get", "sessions", "nobody"]).output().unwrap();
    assert_eq!(miss.status.code(), Some(1), "a miss exits 1");
    // A bad token is a clear error, not a hang.
    let bad = client_cmd(dir.path(), addr).args(["--help"]).output().unwrap();
    assert!(bad.status.success());
    let bad = client_cmd(dir.path(), addr).args(["cache", "get", "s", "k", "--token", "nope"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("unauthenticated"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    // The README's bench, briefly, against this broker.
    let bench = Command::new(BIN)
        .args(["bench", "--addr", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--subscribers", "2", "--duration", "1", "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(bench.status.success(), "{}", String::from_utf8_lossy(&bench.stderr));
    let v: serde_json::Value = serde_json::from_slice(&bench.stdout).unwrap();
    assert!(v["published_msgs"].as_u64().unwrap() > 0, "{v}");
    assert!(v["delivered_events"].as_u64().unwrap() > 0, "{v}");
    assert!(v["latency_us"]["samples"].as_u64().unwrap() > 0, "{v}");
    // Graceful shutdown on SIGTERM.
    let pid = broker.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = broker.wait().unwrap();
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");
}

#[test]
fn bench_baseline_reports_fractions_of_raw_quinn_and_the_relay() {
    let out = Command::new(BIN)
        .args(["bench", "--payload", "4096", "--duration", "1", "--baseline", "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let b = &v["baseline"];
    let (raw, relay) = (b["raw_quinn_mb_per_s"].as_f64().unwrap(), b["relay_mb_per_s"].as_f64().unwrap());
    assert!(raw > 0.0 && relay > 0.0, "{v}");
    let delivered = v["delivered_mb_per_s_per_subscriber"].as_f64().unwrap();
    assert!(delivered > 0.0, "{v}");
    assert!((b["fraction_of_raw_quinn"].as_f64().unwrap() - delivered / raw).abs() < 1e-9, "{v}");
    assert!((b["fraction_of_relay"].as_f64().unwrap() - delivered / relay).abs() < 1e-9, "{v}");
    if cfg!(target_os = "linux") {
        assert!(v["cpu_s_per_gb"].as_f64().unwrap() > 0.0, "CPU time is read from procfs: {v}");
        let wire = &v["client_quic_per_record"];
        assert!(wire["publishers"]["datagrams_sent"].as_f64().unwrap() > 0.0, "the publisher's datagrams: {v}");
        assert!(wire["subscribers"]["datagrams_received"].as_f64().unwrap() > 0.0, "the subscriber's: {v}");
        let stolen = v["host_steal_fraction"].as_f64().expect("the host's steal is read from /proc/stat");
        assert!((0.0..=1.0).contains(&stolen), "a fraction of the machine's CPU time: {v}");
    }
}

/// `bench --late-reader`: a subscriber that starts far behind a publisher that goes on reads
/// its backlog from the segment files (the broker keeps 1 MiB in memory) and catches up.
#[test]
fn bench_late_reader_reads_its_backlog_from_disk_and_catches_up() {
    let out = Command::new(BIN)
        .args(["bench", "--subscribers", "0", "--late-reader", "60000", "--memory-bytes", "1048576"])
        .args(["--rate", "40000", "--duration", "3", "--fsync", "never", "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &v["late_reader"];
    assert_eq!(l["skipped_by_retention"], 0, "nothing retention would remove: {v}");
    assert!(l["read"].as_u64().unwrap() >= 60_000, "read at least its backlog: {v}");
    assert!(l["caught_up_after_s"].as_f64().is_some(), "caught up with the live tail: {v}");
    assert!(l["read_per_s_while_behind"].as_f64().unwrap() > 40_000.0, "faster than the publisher: {v}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = Command::new(BIN).args(["serve", "--fsync", "sometimes"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown fsync policy"));
    let out =
        Command::new(BIN).args(["subscribe", "s", "--from", "yesterday", "--addr", "127.0.0.1:1"]).output().unwrap();
    assert!(!out.status.success());
    let out = Command::new(BIN).args(["publish"]).output().unwrap();
    assert!(!out.status.success());
    let out = Command::new(BIN).args(["subscribe", "s", "--since", "10 fortnights"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(BIN).args(["subscribe", "s", "--since", "1m", "--from", "earliest"]).output().unwrap();
    assert!(!out.status.success(), "--since and --from conflict");
    let out = Command::new(BIN).args(["cache", "get", "c", "k", "--data-dir", "/nonexistent-felix"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent-felix"), "names the missing file");
    let out = Command::new(BIN).args(["serve", "--worker-threads", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--worker-threads"), "names the flag");
    let out = Command::new(BIN).args(["serve", "--max-udp-payload", "70000"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-udp-payload"), "names the flag");
    let out = Command::new(BIN).args(["bench", "--cache", "--baseline"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--baseline goes with"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

async fn connect(data: &Path, addr: SocketAddr) -> Client {
    let certs = felix_driver_tokio::tls::load_certs(&data.join("tls/cert.pem")).unwrap();
    Client::connect(addr, ClientOptions::new("t1", TOKEN, Trust::Certificates(certs))).await.unwrap()
}

/// A single broker's acknowledged records (offset → payload) before a power cut, and what its
/// stream holds after it.
async fn power_cut_single_broker(extra: &[&str]) -> (BTreeMap<u64, Bytes>, BTreeMap<u64, Bytes>, u64) {
    use felix_driver_common::sync_journal;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let journal = dir.path().join("sync-journal");
    let journal_s = journal.to_string_lossy().into_owned();
    // A slow disk (20 ms a sync): a broker answering before its sync would be caught.
    let env = [(sync_journal::ENV, journal_s.as_str()), (sync_journal::DELAY_ENV, "20")];
    let addr = free_port();
    let mut broker = serve_with_env(&data, addr, extra, &env);
    let client = connect(&data, addr).await;
    let (acks_tx, mut acks_rx) = tokio::sync::watch::channel(0u64);
    let acks_tx = std::sync::Arc::new(acks_tx);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..8u64 {
        let (c, acks_tx) = (client.clone(), acks_tx.clone());
        tasks.spawn(async move {
            let mut ok = Vec::new();
            for i in 0.. {
                let p = Bytes::from(format!("p{t}-{i}"));
                let opts = PublishOptions { ack: true, ..Default::default() };
                match c.publish("default", "power", vec![p.clone()], opts).await {
                    Ok(Some(off)) => ok.push((off, p)),
                    Ok(None) => panic!("an ack after the write carries an offset"),
                    Err(_) => break, // the power went
                }
                acks_tx.send_modify(|n| *n += 1);
            }
            ok
        });
    }
    tokio::time::timeout(Duration::from_secs(60), acks_rx.wait_for(|n| *n >= 400)).await.expect("acks").unwrap();
    broker.kill().unwrap();
    broker.wait().unwrap();
    let _ = client.close().await;
    let mut acked = BTreeMap::new();
    while let Some(r) = tasks.join_next().await {
        acked.extend(r.unwrap());
    }
    let (_, dropped) = sync_journal::power_cut(&journal).unwrap();
    let mut broker = serve_with_env(&data, addr, extra, &env);
    let client = connect(&data, addr).await;
    let mut stored = BTreeMap::new();
    let mut sub = client.subscribe("default", "power", Some(StartPosition::Earliest), None).await.unwrap();
    // Everything there is arrives in one go after the restart; a quiet second ends it.
    while let Ok(Some(SubscriptionItem::Events(b))) = tokio::time::timeout(Duration::from_secs(1), sub.next()).await {
        for (i, p) in b.records.payloads().enumerate() {
            stored.insert(b.base_offset.unwrap() + i as u64, p);
        }
    }
    broker.kill().unwrap();
    let _ = broker.wait();
    (acked, stored, dropped)
}

/// A single broker under the default policy (`--fsync always`: a write is answered once
/// synced) loses no acknowledged record to a power cut mid-load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_loses_no_acknowledged_record_of_a_single_broker() {
    let (acked, stored, dropped) = power_cut_single_broker(&[]).await;
    for (off, p) in &acked {
        assert_eq!(stored.get(off), Some(p), "the acknowledged record at {off} survived the power cut");
    }
    eprintln!("{} acknowledged, all kept; the cut took {dropped} unsynced bytes back", acked.len());
}

/// The control: under the lazy `interval:MS` policy an operator must choose, the same power
/// cut takes acknowledged records back (docs/storage.md says how much).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_takes_acknowledged_records_of_a_lazy_single_broker_back() {
    let (acked, stored, dropped) = power_cut_single_broker(&["--fsync", "interval:600000"]).await;
    let lost = acked.iter().filter(|(off, p)| stored.get(off) != Some(p)).count();
    eprintln!("lazy: {lost} of {} acknowledged lost ({dropped} bytes)", acked.len());
    assert!(lost > 0, "a power cut of a lazily synced broker lost nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_acked_load_loses_and_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let args = ["--fsync", "always", "--ack-on-commit"];
    // acked offset -> payload, across every run
    let mut acked: BTreeMap<u64, Bytes> = BTreeMap::new();
    let mut counter = 0u64;
    for round in 0..3u64 {
        let mut broker = serve(dir.path(), addr, &args);
        let client = connect(dir.path(), addr).await;
        // Publish acked batches from several tasks; kill the broker while they are in flight,
        // as soon as a round-dependent number of acks has landed.
        let (acks_tx, mut acks_rx) = tokio::sync::watch::channel(0u64);
        let acks_tx = std::sync::Arc::new(acks_tx);
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..4 {
            let c = client.clone();
            let acks_tx = acks_tx.clone();
            let base = counter + t * 1_000_000;
            tasks.spawn(async move {
                let mut ok = Vec::new();
                for i in 0..1_000_000u64 {
                    let p = Bytes::from(format!("r{round}-{}", base + i));
                    match c
                        .publish(
                            "default",
                            "crash",
                            vec![p.clone()],
                            PublishOptions { ack: true, ..Default::default() },
                        )
                        .await
                    {
                        Ok(Some(off)) => ok.push((off, p)),
                        Ok(None) => panic!("ack on commit always carries an offset"),
                        Err(_) => break, // the broker died
                    }
                    acks_tx.send_modify(|n| *n += 1);
                }
                ok
            });
        }
        counter += 4_000_000;
        let target = 200 + 300 * round;
        tokio::time::timeout(Duration::from_secs(60), acks_rx.wait_for(|n| *n >= target))
            .await
            .expect("acks arrive")
            .unwrap();
        broker.kill().unwrap(); // SIGKILL, mid-load
        broker.wait().unwrap();
        // The dead broker sends no close; end our side now instead of waiting for the idle timeout.
        let _ = client.close().await;
        let before = acked.len();
        while let Some(r) = tasks.join_next().await {
            for (off, p) in r.unwrap() {
                assert!(acked.insert(off, p).is_none(), "offset {off} acknowledged twice");
            }
        }
        eprintln!("round {round}: {} acks before SIGKILL", acked.len() - before);
    }
    assert!(acked.len() > 100, "the load ran: {} acks", acked.len());
    // Restart and read everything back.
    let mut broker = serve(dir.path(), addr, &args);
    let client = connect(dir.path(), addr).await;
    let mut sub = client.subscribe("default", "crash", Some(StartPosition::Earliest), None).await.unwrap();
    let tail = *acked.keys().last().unwrap();
    let mut stored: BTreeMap<u64, Bytes> = BTreeMap::new();
    let mut next_expected = None;
    while stored.keys().last().is_none_or(|l| *l < tail) {
        let item = tokio::time::timeout(Duration::from_secs(20), sub.next()).await.expect("replay arrives");
        let Some(SubscriptionItem::Events(b)) = item else { panic!("{item:?}") };
        for (i, p) in b.records.payloads().enumerate() {
            let off = b.base_offset.unwrap() + i as u64;
            if let Some(n) = next_expected {
                assert_eq!(off, n, "offsets are continuous");
            }
            next_expected = Some(off + 1);
            assert!(stored.insert(off, p).is_none(), "offset {off} stored twice");
        }
    }
    for (off, p) in &acked {
        assert_eq!(stored.get(off), Some(p), "acknowledged record at {off} survived");
    }
    eprintln!("{} acknowledged records all present once among {} stored", acked.len(), stored.len());
    let mut payloads: Vec<&Bytes> = stored.values().collect();
    payloads.sort();
    payloads.dedup();
    assert_eq!(payloads.len(), stored.len(), "no record stored twice");
    broker.kill().unwrap();
    let _ = broker.wait();
}

#[test]
fn config_file_tokens_and_permissions_are_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("felix.toml");
    std::fs::write(
        &cfg,
        r#"
[broker]
dev_token = false

[[tokens]]
token = "reader-token"
tenant = "acme"
principal = "reader"
grants = [{ action = "subscribe", pattern = "default/*" }, { action = "cache_read", pattern = "*" }]

[[streams]]
tenant = "acme"
namespace = "default"
name = "orders"
shards = 2
"#,
    )
    .unwrap();
    let addr = free_port();
    let mut broker = {
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
            .arg(dir.path())
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut banner = Vec::new();
        loop {
            let l = lines.next().unwrap().unwrap();
            banner.push(l.clone());
            if l.contains("dev token") {
                assert!(l.contains("none"), "no dev token when the config says so: {l}");
                break;
            }
        }
        std::thread::spawn(move || for _ in lines {});
        child
    };
    let run = |args: &[&str]| {
        client_cmd(dir.path(), addr).args(args).args(["--tenant", "acme", "--token", "reader-token"]).output().unwrap()
    };
    let publish = run(&["publish", "orders", "x", "--ack"]);
    assert!(!publish.status.success());
    assert!(
        String::from_utf8_lossy(&publish.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&publish.stderr)
    );
    let sub = run(&["subscribe", "orders", "--shard", "1", "--count", "0"]);
    assert!(sub.status.success(), "{}", String::from_utf8_lossy(&sub.stderr));
    let sub = run(&["subscribe", "orders", "--shard", "2"]);
    assert!(!sub.status.success(), "the configured stream has 2 shards");
    let other_tenant = client_cmd(dir.path(), addr)
        .args(["cache", "get", "c", "k", "--tenant", "other", "--token", "reader-token"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&other_tenant.stderr).contains("unauthenticated"));
    broker.kill().unwrap();
    let _ = broker.wait();
    // A typo in the file is a clear error at start.
    std::fs::write(&cfg, "[broker]\nlisen = \"127.0.0.1:1\"\n").unwrap();
    let out =
        Command::new(BIN).args(["serve", "--data-dir"]).arg(dir.path()).arg("--config").arg(&cfg).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lisen") && err.contains("felix.toml"), "{err}");
}

/// Starts `felix-node serve` under a file-size limit (`ulimit -f`, with SIGXFSZ ignored, so a
/// write past it fails with EFBIG exactly as on a full disk).
fn serve_limited(data: &Path, addr: SocketAddr, limit_kib: u64, extra: &[&str]) -> Broker {
    let script = format!(
        "trap '' XFSZ; ulimit -S -f {limit_kib}; exec \"$0\" serve --listen {addr} --data-dir \"$1\" --dev-token {TOKEN} {}",
        extra.join(" ")
    );
    let child = Command::new("bash")
        .args(["-c", &script, BIN])
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_banner(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_acks_nothing_unwritten_and_recovers_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    // The broker's default (acks on enqueue allowed): the client asks for acks after the write by
    // default, which is what makes an acknowledgement mean "stored".
    let args = ["--fsync", "always"];
    let mut broker = serve_limited(dir.path(), addr, 64, &args);
    let c = connect(dir.path(), addr).await;
    let acked_opts = || PublishOptions { ack: true, ..Default::default() };
    let mut acked: BTreeMap<u64, Bytes> = BTreeMap::new();
    let mut refused = 0;
    for i in 0..200u64 {
        let p = Bytes::from(format!("{i:05}{}", "d".repeat(995)));
        match c.publish("default", "full", vec![p.clone()], acked_opts()).await {
            Ok(Some(off)) => {
                acked.insert(off, p);
            }
            Ok(None) => panic!("ack on commit carries an offset"),
            Err(e) => {
                // The write that met the full disk fails (`storage`, nothing stored); from then
                // on the broker writes nothing and says so (`overloaded`, wait suggested).
                use felix_proto::error_code::RetryClass;
                match e.code().map(|c| c.name().into_owned()).as_deref() {
                    Some("storage") => assert_eq!(e.retry(), Some(RetryClass::Retry)),
                    Some("overloaded") => assert_eq!(e.retry(), Some(RetryClass::RetryAfter)),
                    other => panic!("{other:?}: {e}"),
                }
                refused += 1;
            }
        }
    }
    assert!(refused > 100 && acked.len() > 20, "{} acked, {refused} refused", acked.len());
    // Space returns: within about a second a probe write succeeds and the broker writes again.
    let pid = broker.id().to_string();
    assert!(Command::new("prlimit").args(["--pid", &pid, "--fsize=unlimited"]).status().unwrap().success());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for i in 0..20u64 {
        let p = Bytes::from(format!("after-{i}"));
        let off = loop {
            match c.publish("default", "full", vec![p.clone()], acked_opts()).await {
                Ok(off) => break off.unwrap(),
                Err(e) if std::time::Instant::now() < deadline => {
                    assert_eq!(e.code().map(|c| c.name().into_owned()).as_deref(), Some("overloaded"), "{e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("writes never resumed: {e}"),
            }
        };
        acked.insert(off, p);
    }
    // Everything acknowledged is there, once, and nothing else: now, and after a restart.
    for round in 0..2 {
        let c = connect(dir.path(), addr).await;
        let mut got = BTreeMap::new();
        let mut from = 0;
        loop {
            let page = c.stream_read("default", "full", 0, from, None, None).await.unwrap();
            if page.records.is_empty() {
                break;
            }
            for r in page.records {
                assert!(got.insert(r.offset, r.payload.0).is_none());
            }
            from = page.next_offset;
        }
        assert_eq!(got.keys().collect::<Vec<_>>(), acked.keys().collect::<Vec<_>>(), "round {round}: offsets");
        assert!(got == acked, "round {round}: exactly the acknowledged records");
        if round == 0 {
            broker.kill().unwrap();
            broker.wait().unwrap();
            broker = serve(dir.path(), addr, &args);
        }
    }
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// A short soak (the full one is `felix-node soak --duration 5m`): connections churn, some die
/// by SIGKILL, and every leak gauge of the broker comes back to where it started.
#[test]
fn a_short_soak_leaks_no_connection_stream_or_task() {
    let out = Command::new(BIN)
        .args(["soak", "--duration", "12s", "--connections", "8", "--streams", "20", "--interval", "3", "--json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(v["leaks"], serde_json::json!([]), "{v}");
    assert!(v["sessions"].as_u64().unwrap() > 10, "{v}");
    assert!(v["delivered"].as_u64().unwrap() > 100, "{v}");
}

/// A subscriber whose broker-side queue holds a single batch falls behind under a burst; on a
/// durable stream `felix-node subscribe` resumes from the log and prints every record once, in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_resumes_after_falling_behind_with_nothing_lost_or_repeated() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut broker = serve(dir.path(), addr, &["--queue-capacity", "1", "--queue-bytes-max", "1"]);
    const N: usize = 3000;
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "burst", "--tenant", "t1", "--from", "earliest", "--count", &N.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The stream does not exist yet: the command says it waits for it (and subscribes from
    // its start once the burst creates it). Its stderr is kept for the resume notices.
    let mut err = BufReader::new(sub.stderr.take().unwrap()).lines();
    let waiting = err.next().unwrap().unwrap();
    assert!(waiting.contains("does not exist yet"), "{waiting}");
    let notices = std::thread::spawn(move || err.map_while(Result::ok).collect::<Vec<_>>());
    // A guard, not a wait: a lost record would leave the subscriber waiting forever.
    let pid = sub.id();
    let (guard_tx, guard_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if guard_rx.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
    });
    let client = connect(dir.path(), addr).await;
    let mut sent = tokio::task::JoinSet::new();
    for i in 0..N {
        let c = client.clone();
        sent.spawn(async move {
            // Large enough that the broker's writer credit (1 MiB) runs out during the burst.
            let p = Bytes::from(format!("r{i:05}{}", "x".repeat(4000)));
            c.publish("default", "burst", vec![p], PublishOptions::default()).await
        });
        if sent.len() >= 64 {
            sent.join_next().await.unwrap().unwrap().unwrap();
        }
    }
    while let Some(r) = sent.join_next().await {
        r.unwrap().unwrap();
    }
    let out = sub.wait_with_output().unwrap();
    let _ = guard_tx.send(());
    let notices = notices.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{notices:?} {} lines, last {:?}", text.lines().count(), text.lines().last());
    let offsets: Vec<u64> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.split('\t').next().unwrap().parse().unwrap()).collect();
    assert_eq!(offsets, (0..N as u64).collect::<Vec<_>>(), "every offset once, in order; {notices:?}");
    assert!(notices.first().is_some_and(|n| n.starts_with("subscribed to")), "{notices:?}");
    eprintln!("resume notices: {}", notices.iter().filter(|n| n.contains("resuming")).count());
    let _ = client.close().await;
    Command::new("kill").args(["-TERM", &broker.id().to_string()]).status().unwrap();
    broker.wait().unwrap();
}

/// A run of the simulation is a function of its seed: the same seed in two separate processes
/// (with their own hash seeds and allocators) prints the same trace digest.
#[test]
fn a_sim_seed_replays_to_the_same_trace_digest_in_another_process() {
    let digest = || {
        let out = Command::new(BIN).args(["sim", "--seed", "11", "--steps", "1500"]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let line = stdout.lines().find(|l| l.starts_with("seed 11 ")).expect("a line for the seed").to_owned();
        assert!(line.contains(" digest "), "{line}");
        line
    };
    let (a, b) = (digest(), digest());
    assert_eq!(a, b);
}

/// `felix-node conformance --addr` against a stand-in for the released Felix broker (no ALPN,
/// `server_flags` 0x003F, no feature bits): every check that applies passes, and the ones about
/// features it does not advertise are reported skipped, not passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_conformance_against_the_released_broker_skips_what_it_does_not_advertise() {
    let legacy = felix_driver_tokio::testkit::LegacyBroker::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("legacy.pem");
    std::fs::write(&ca, legacy.cert_pem()).unwrap();
    let out = tokio::process::Command::new(BIN)
        .args(["conformance", "--addr", &legacy.local_addr().to_string(), "--token", "any", "--tenant", "t1", "--ca"])
        .arg(&ca)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(summary.ends_with("0 failed, 7 skipped"), "{stdout}");
    for skipped in ["error codes", "cache version", "publish_ok offset", "group record"] {
        assert!(stdout.lines().any(|l| l.starts_with("skip ") && l.contains(skipped)), "{skipped}: {stdout}");
    }
    assert!(stdout.contains("oversize frame refused on the header (the broker ended the stream)"), "{stdout}");
}

/// Every record of a stream, in offset order.
async fn read_all(c: &Client, stream: &str) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let page = match c.stream_read("default", stream, 0, from, None, None).await {
            // Not created yet: nothing in it (a read creates no stream).
            Err(e) if e.code() == Some(&felix_proto::ErrorCode::NotFound) => return out,
            r => r.unwrap(),
        };
        if page.records.is_empty() {
            return out;
        }
        out.extend(page.records.into_iter().map(|r| r.payload.0));
        from = page.next_offset;
    }
}

/// Fire-and-forget from the command line loses nothing on a clean exit: 1,000 invocations of
/// `felix-node publish STREAM recN` (one record each, no --ack) all land. Before the client's
/// close waited for the broker, about a quarter of such records were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_unacked_cli_publishes_all_land() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let started = std::time::Instant::now();
    let mut running = Vec::new();
    for i in 0..1000 {
        let mut cmd = tokio::process::Command::from(client_cmd(dir.path(), addr));
        cmd.env("FELIX_TENANT", "t1").args(["publish", "single", &format!("rec{i}")]);
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        running.push(cmd.spawn().unwrap());
        if running.len() == 8 {
            for child in running.drain(..) {
                let out = child.wait_with_output().await.unwrap();
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            }
        }
    }
    for child in running {
        assert!(child.wait_with_output().await.unwrap().status.success());
    }
    eprintln!("1000 invocations in {:?}", started.elapsed());
    let c = connect(dir.path(), addr).await;
    let mut got: Vec<String> = read_all(&c, "single").await.iter().map(|b| String::from_utf8_lossy(b).into()).collect();
    got.sort();
    let mut want: Vec<String> = (0..1000).map(|i| format!("rec{i}")).collect();
    want.sort();
    assert_eq!(got.len(), 1000, "{} of 1000 landed", got.len());
    assert_eq!(got, want);
}

/// `tail -f app.log | felix-node publish logs`: lines are sent as they come (after a short
/// linger, not 64 at a time), and Ctrl-C sends (and, with --ack, acknowledges) what was read
/// before the command exits with 130, saying how many records went. Both parts fail without
/// the change: three lines of a 64-line batch waited for more, and a held line was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_a_pipe_sends_lines_as_they_come_and_ctrl_c_sends_what_was_read() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let publisher = |stream: &str, extra: &[&str]| {
        let mut cmd = tokio::process::Command::from(client_cmd(dir.path(), addr));
        cmd.env("FELIX_TENANT", "t1")
            .args(["publish", stream, "--ack"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd.spawn().unwrap()
    };
    let c = connect(dir.path(), addr).await;
    let wait_records = |stream: &'static str, n: usize| {
        let c = &c;
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let got = read_all(c, stream).await;
                if got.len() >= n {
                    return got;
                }
                assert!(std::time::Instant::now() < deadline, "{stream}: {} of {n} records arrived", got.len());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // Three lines, the pipe left open: they arrive without waiting for 61 more.
    let mut tail = publisher("piped", &[]);
    let mut stdin = tail.stdin.take().unwrap();
    stdin.write_all(b"one\ntwo\nthree\n").await.unwrap();
    assert_eq!(wait_records("piped", 3).await.len(), 3);
    drop(stdin);
    assert!(tail.wait().await.unwrap().success());
    // Batches of two that never linger: two lines arrive as a full batch (its signal handler
    // is in place by then); a third is held until Ctrl-C, which sends it.
    let mut held = publisher("held", &["--batch", "2", "--linger", "1h"]);
    let mut stdin = held.stdin.take().unwrap();
    stdin.write_all(b"a\nb\n").await.unwrap();
    assert_eq!(wait_records("held", 2).await.len(), 2);
    stdin.write_all(b"c\n").await.unwrap();
    let pid = held.id().unwrap().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let out = tokio::time::timeout(Duration::from_secs(20), held.wait_with_output()).await.unwrap().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("published 3 record(s)") && err.contains("interrupted"), "{err}");
    let got = wait_records("held", 3).await;
    assert_eq!(got.len(), 3, "each line once: {got:?}");
}

/// A publisher whose broker stops answering (here: SIGSTOP) exits saying what it could not get
/// confirmed, instead of claiming success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_whose_broker_stops_answering_reports_what_was_not_confirmed() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut broker = serve(dir.path(), addr, &[]);
    let mut cmd = tokio::process::Command::from(client_cmd(dir.path(), addr));
    cmd.env("FELIX_TENANT", "t1")
        .args(["publish", "stalled", "--batch", "1", "--close-timeout", "1s"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut publisher = cmd.spawn().unwrap();
    let mut stdin = publisher.stdin.take().unwrap();
    stdin.write_all(b"first\n").await.unwrap();
    // Connected once its first record is stored.
    let c = connect(dir.path(), addr).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while read_all(&c, "stalled").await.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the first record never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = broker.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    for i in 0..20 {
        stdin.write_all(format!("stalled-{i}\n").as_bytes()).await.unwrap();
    }
    drop(stdin);
    let out =
        tokio::time::timeout(Duration::from_secs(20), publisher.wait_with_output()).await.expect("exits").unwrap();
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("did not confirm receiving them") && stderr.contains("may not have been delivered"),
        "{stderr}"
    );
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// On a full disk, the faster mode (acknowledged on enqueue) stops acknowledging anything that is
/// not stored as soon as the broker learns a write failed for lack of space: publishes are then
/// refused `overloaded` (nothing written) while reads go on, and once space returns a probe write
/// succeeds and publishing resumes. Only batches acknowledged before the broker learned of the
/// failure can be missing, as docs/operations.md says of that mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_full_disk_acks_on_enqueue_stop_and_reads_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let broker = serve_limited(dir.path(), addr, 64, &["--fsync", "always"]);
    let certs = felix_driver_tokio::tls::load_certs(&dir.path().join("tls/cert.pem")).unwrap();
    let mut opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(certs));
    opts.config = opts.config.ack_on_enqueue();
    let c = Client::connect(addr, opts).await.unwrap();
    let acked_opts = PublishOptions { ack: true, ..Default::default() };
    let mut acked: Vec<(usize, Bytes)> = Vec::new();
    let mut first_refusal = None;
    for i in 0..200usize {
        let p = Bytes::from(format!("{i:05}{}", "e".repeat(995)));
        match c.publish("default", "enq", vec![p.clone()], acked_opts.clone()).await {
            Ok(_) => acked.push((i, p)),
            Err(e) => {
                let code = e.code().map(|c| c.name().into_owned());
                assert!(matches!(code.as_deref(), Some("overloaded" | "storage")), "{e}");
                if code.as_deref() == Some("overloaded") {
                    first_refusal.get_or_insert(i);
                }
            }
        }
        // Reads keep working whatever the disk does.
        if i % 50 == 49 {
            c.stream_read("default", "enq", 0, 0, None, Some(1)).await.unwrap();
        }
    }
    let first_refusal = first_refusal.expect("the full disk was noticed");
    let stored: std::collections::HashSet<Bytes> = read_all(&c, "enq").await.into_iter().collect();
    let lost: Vec<usize> = acked.iter().filter(|(_, p)| !stored.contains(p)).map(|(i, _)| *i).collect();
    // How many were in flight when the disk filled depends on how far storage lagged: not
    // bounded, but none acknowledged after the broker knew may be missing.
    assert!(lost.iter().all(|i| *i < first_refusal), "acknowledged after the broker knew, and lost: {lost:?}");
    eprintln!("{} acknowledged on enqueue and lost, all before the first refusal at {first_refusal}", lost.len());
    // Space returns: within about a second a probe write succeeds and publishing resumes.
    assert!(
        Command::new("prlimit")
            .args(["--pid", &broker.id().to_string(), "--fsize=unlimited"])
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match c.publish("default", "enq", vec![Bytes::from("after")], acked_opts.clone()).await {
            Ok(_) => break,
            Err(e) => assert!(std::time::Instant::now() < deadline, "never resumed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(broker);
}

/// An operator's certificate (`--tls-cert/--tls-key`): served instead of the data directory's,
/// clients trust it with `--ca`; half a pair or a bad file is a clear error before anything
/// starts.
#[test]
fn an_operators_certificate_is_served_and_bad_ones_are_refused() {
    // A certificate made by one broker's first start, used by another as "the operator's".
    let issued = tempfile::tempdir().unwrap();
    let first = serve(issued.path(), free_port(), &[]);
    drop(first);
    let (cert, key) = (issued.path().join("tls/cert.pem"), issued.path().join("tls/key.pem"));
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--dev-token", TOKEN, "--tls-cert"])
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut banner = Vec::new();
    loop {
        let line = lines.next().expect("a banner").unwrap();
        let done = line.trim_start().starts_with("sha256");
        banner.push(line);
        if done {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let _broker = Broker(child);
    let text = banner.join("\n");
    assert!(text.contains(&cert.display().to_string()), "{text}");
    let fp = banner.last().unwrap().trim().trim_start_matches("sha256 ").to_owned();
    assert_eq!(fp.len(), 32 * 3 - 1, "{fp}");
    assert!(!dir.path().join("tls/cert.pem").exists(), "no certificate generated when one is given");
    // Trusted through --ca; the data directory's (absent) certificate is not needed.
    let ok =
        client_cmd(dir.path(), addr).args(["publish", "orders", "x", "--ack", "--ca"]).arg(&cert).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    // Half a pair, a missing file, a file that is not PEM: refused at once, saying why.
    let bad = |extra: &[&std::ffi::OsStr]| {
        let out = Command::new(BIN)
            .args(["serve", "--listen", &free_port().to_string(), "--data-dir"])
            .arg(dir.path())
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = bad(&["--tls-cert".as_ref(), cert.as_os_str()]);
    assert!(e.contains("--tls-key"), "{e}");
    let e = bad(&["--tls-cert".as_ref(), "/nonexistent.pem".as_ref(), "--tls-key".as_ref(), key.as_os_str()]);
    assert!(e.contains("nonexistent.pem"), "{e}");
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let e = bad(&["--tls-cert".as_ref(), junk.as_os_str(), "--tls-key".as_ref(), key.as_os_str()]);
    assert!(e.contains("junk.pem"), "{e}");
}

/// Signed tokens end to end: `token keygen` makes a key and its JWK set, `serve --jwks` trusts
/// it, `token mint` makes a token a client uses with `--token @FILE`; what its permissions do not
/// cover is `forbidden`, a token for another tenant or with a bad permission is refused.
#[test]
fn a_minted_token_is_accepted_within_its_permissions() {
    let keys = tempfile::tempdir().unwrap();
    let out = Command::new(BIN).args(["token", "keygen", "--out"]).arg(keys.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again = Command::new(BIN).args(["token", "keygen", "--out"]).arg(keys.path()).output().unwrap();
    assert!(!again.status.success(), "an existing key is never overwritten");
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let jwks = keys.path().join("jwks.json");
    let _broker = serve(dir.path(), addr, &["--jwks", jwks.to_str().unwrap()]);
    let mint = |tenant: &str, perms: &[&str]| {
        let mut c = Command::new(BIN);
        c.args(["token", "mint", "--key"]).arg(keys.path().join("signing-key.pk8")).args(["--tenant", tenant]);
        for p in perms {
            c.args(["--perm", p]);
        }
        let out = c.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, token, err) = mint("acme", &["stream.publish:stream:acme/default/*"]);
    assert!(ok, "{err}");
    let token_file = keys.path().join("token");
    std::fs::write(&token_file, &token).unwrap();
    let as_acme = |args: &[&str]| {
        client_cmd(dir.path(), addr)
            .args(args)
            .args(["--tenant", "acme", "--token", &format!("@{}", token_file.display())])
            .output()
            .unwrap()
    };
    let p = as_acme(&["publish", "orders", "signed", "--ack"]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let r = as_acme(&["read", "orders", "--from", "0"]);
    assert!(
        !r.status.success() && String::from_utf8_lossy(&r.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    // The same token for another tenant: refused.
    let other = client_cmd(dir.path(), addr)
        .args(["publish", "orders", "x", "--ack", "--tenant", "globex", "--token", &token])
        .output()
        .unwrap();
    assert!(!other.status.success() && String::from_utf8_lossy(&other.stderr).contains("unauthenticated"));
    let (ok, _, err) = mint("acme", &["stream.publish:cache:acme/x/y"]);
    assert!(!ok && err.contains("bad permission"), "{err}");
}

/// A revocation added to the configuration and reloaded with SIGHUP ends a live subscription
/// opened with the revoked token (`revoked`), while the broker keeps serving.
#[test]
fn sighup_reloads_revocations_and_ends_what_the_revoked_token_opened() {
    let keys = tempfile::tempdir().unwrap();
    let out = Command::new(BIN).args(["token", "keygen", "--out"]).arg(keys.path()).output().unwrap();
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("felix.toml");
    let jwks = keys.path().join("jwks.json");
    std::fs::write(&conf, format!("[auth]\njwks = {:?}\n", jwks.to_str().unwrap())).unwrap();
    let addr = free_port();
    let broker = serve(dir.path(), addr, &["--config", conf.to_str().unwrap()]);
    let token = Command::new(BIN)
        .args(["token", "mint", "--key"])
        .arg(keys.path().join("signing-key.pk8"))
        .args(["--tenant", "acme", "--jti", "leaked", "--perm", "stream.subscribe:stream:acme/*/*"])
        .args(["--perm", "stream.publish:stream:acme/*/*"])
        .output()
        .unwrap();
    let token = String::from_utf8_lossy(&token.stdout).trim().to_owned();
    let p = client_cmd(dir.path(), addr)
        .args(["publish", "orders", "first", "--ack", "--tenant", "acme", "--token", &token])
        .output()
        .unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest", "--tenant", "acme", "--token", &token])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().ends_with("first"), "the subscriber is live");
    std::fs::write(&conf, format!("[auth]\njwks = {:?}\nrevoked_jti = [\"leaked\"]\n", jwks.to_str().unwrap()))
        .unwrap();
    Command::new("kill").args(["-HUP", &broker.0.id().to_string()]).status().unwrap();
    // The subscriber ends, saying why, within a bounded time.
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = sub.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < until, "the revoked subscription did not end");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut sub.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success() && err.contains("revoked"), "{status:?} {err}");
    // The token no longer authenticates; the broker goes on serving.
    let p = client_cmd(dir.path(), addr)
        .args(["publish", "orders", "again", "--ack", "--tenant", "acme", "--token", &token])
        .output()
        .unwrap();
    assert!(!p.status.success() && String::from_utf8_lossy(&p.stderr).contains("revoked"));
    let ok = client_cmd(dir.path(), addr).args(["publish", "orders", "dev", "--ack"]).output().unwrap();
    assert!(ok.status.success());
}

/// A renewed certificate is served after SIGHUP to new connections, and a subscriber connected
/// with the old one is not dropped.
#[test]
fn a_renewed_certificate_is_served_after_sighup_without_dropping_connections() {
    // Two certificates, made by two brokers' first starts.
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    drop(serve(a.path(), free_port(), &[]));
    drop(serve(b.path(), free_port(), &[]));
    let live = tempfile::tempdir().unwrap();
    let (cert, key) = (live.path().join("cert.pem"), live.path().join("key.pem"));
    std::fs::copy(a.path().join("tls/cert.pem"), &cert).unwrap();
    std::fs::copy(a.path().join("tls/key.pem"), &key).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let broker = serve(dir.path(), addr, &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    let ca_a = a.path().join("tls/cert.pem");
    let ca_b = b.path().join("tls/cert.pem");
    let p =
        client_cmd(dir.path(), addr).args(["publish", "orders", "one", "--ack", "--ca"]).arg(&ca_a).output().unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest", "--count", "2", "--ca"])
        .arg(&ca_a)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().ends_with("one"));
    // Renewed: B's certificate at the same paths, then SIGHUP.
    std::fs::copy(b.path().join("tls/key.pem"), &key).unwrap();
    std::fs::copy(b.path().join("tls/cert.pem"), &cert).unwrap();
    Command::new("kill").args(["-HUP", &broker.0.id().to_string()]).status().unwrap();
    // New connections get B (a client trusting only A is refused once the reload landed).
    let until = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let p = client_cmd(dir.path(), addr)
            .args(["publish", "orders", "two", "--ack", "--ca"])
            .arg(&ca_b)
            .output()
            .unwrap();
        if p.status.success() {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the renewed certificate was not served: {}",
            String::from_utf8_lossy(&p.stderr)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let old =
        client_cmd(dir.path(), addr).args(["publish", "orders", "x", "--ack", "--ca"]).arg(&ca_a).output().unwrap();
    assert!(!old.status.success(), "the old certificate is no longer served to new connections");
    // The subscriber connected with A was not dropped: it gets the record published through B.
    assert!(lines.next().unwrap().unwrap().ends_with("two"));
    assert!(sub.wait().unwrap().success());
}

/// Mutual TLS from the command line: `serve --tls-client-ca` with `[[client_certs]]` in the
/// configuration; `publish --cert --cert-key` with no token authenticates as the mapped principal
/// within its grants; a read outside them is `forbidden`; without a certificate (and no token)
/// the client is told it has no credential; `[[client_certs]]` without a client CA stops the
/// start with the reason.
#[test]
fn a_client_certificate_authenticates_cli_commands() {
    let ca = felix_driver_tokio::tls::CertAuthority::new("clients").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_, cert_pem, key_pem) = ca.issue("svc-orders", &[]).unwrap();
    let (ca_file, cert, key) = (dir.path().join("ca.pem"), dir.path().join("svc.pem"), dir.path().join("svc.key"));
    std::fs::write(&ca_file, ca.cert_pem()).unwrap();
    std::fs::write(&cert, cert_pem).unwrap();
    std::fs::write(&key, key_pem).unwrap();
    let conf = dir.path().join("felix.toml");
    std::fs::write(
        &conf,
        "[[client_certs]]\nname = \"svc-orders\"\ntenant = \"acme\"\nprincipal = \"orders\"\ngrants = [{ action = \"publish\", pattern = \"default/*\" }]\n",
    )
    .unwrap();
    // Without the client CA: refused at start.
    let out = Command::new(BIN)
        .args(["serve", "--listen", &free_port().to_string(), "--data-dir"])
        .arg(dir.path().join("data-refused"))
        .arg("--config")
        .arg(&conf)
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("client_ca"));
    let addr = free_port();
    let data = dir.path().join("data");
    let _broker =
        serve(&data, addr, &["--config", conf.to_str().unwrap(), "--tls-client-ca", ca_file.to_str().unwrap()]);
    let with_cert = |args: &[&str]| {
        client_cmd(&data, addr)
            .args(args)
            .args(["--tenant", "acme", "--cert", cert.to_str().unwrap(), "--cert-key", key.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let p = with_cert(&["publish", "orders", "by-cert", "--ack"]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let r = with_cert(&["read", "orders", "--from", "0"]);
    assert!(!r.status.success() && String::from_utf8_lossy(&r.stderr).contains("forbidden"), "{r:?}");
    let none = client_cmd(&data, addr)
        .args(["publish", "orders", "x", "--ack", "--tenant", "acme", "--token", ""])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(!none.status.success() && err.contains("no client certificate"), "{err}");
    // The dev token still reads what the certificate wrote, recorded with its principal.
    let r = client_cmd(&data, addr).args(["read", "orders", "--from", "0", "--tenant", "acme"]).output().unwrap();
    assert!(String::from_utf8_lossy(&r.stdout).contains("by-cert"), "{r:?}");
}

/// Records the broker at `metrics` appended so far (its Prometheus counter).
fn records_appended(metrics: SocketAddr) -> u64 {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&metrics, Duration::from_secs(2)) else { return 0 };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .find_map(|l| l.strip_prefix("felix_records_appended_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// Tenant isolation (issue 17), a benchmark run by hand, not in CI (it times things): a quiet
/// tenant's 1,000 single-record batches/s, alone and while another tenant limited to 10,000
/// records/s floods the broker unacked, five interleaved rounds; the median publish→deliver p99
/// with the flood must stay within 2× of the median alone. Run it with
/// `cargo test --release -p felix-node --test process -- --ignored tenant_isolation --nocapture`.
#[test]
#[ignore = "a timing benchmark (about 4 minutes): run with --release and --ignored"]
fn tenant_isolation_a_flooding_tenant_leaves_the_others_p99_within_twice_its_quiet_figure() {
    let p99 = |flood: bool| -> u64 {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("felix.toml");
        std::fs::write(&conf, "[[limits]]\ntenant = \"flood\"\npublish_records_per_s = 10000\n").unwrap();
        let (addr, metrics) = (free_port(), free_port());
        let data = dir.path().join("data");
        let _broker = serve(
            &data,
            addr,
            &["--ephemeral", "--config", conf.to_str().unwrap(), "--metrics-listen", &metrics.to_string()],
        );
        let bench = |tenant: &str, extra: &[&str]| {
            let mut c = client_cmd(&data, addr);
            c.args(["bench", "--addr", &addr.to_string(), "--data-dir"])
                .arg(&data)
                .args(["--tenant", tenant, "--stream", tenant, "--quiet", "--json"])
                .args(extra);
            c
        };
        let flooder = flood.then(|| {
            let child =
                bench("flood", &["--duration", "14"]).stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
            let until = std::time::Instant::now() + Duration::from_secs(10);
            while records_appended(metrics) < 10_000 {
                assert!(std::time::Instant::now() < until, "the flood never started");
                std::thread::sleep(Duration::from_millis(50));
            }
            Broker(child)
        });
        let out = bench("quiet", &["--rate", "1000", "--batch", "1", "--duration", "10"]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        drop(flooder);
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        v["latency_us"]["p99"].as_u64().unwrap()
    };
    let (mut alone, mut flooded) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        alone.push(p99(false));
        flooded.push(p99(true));
    }
    alone.sort_unstable();
    flooded.sort_unstable();
    let (a, f) = (alone[2], flooded[2]);
    eprintln!(
        "quiet tenant p99 alone {alone:?} µs, with the flood {flooded:?} µs: medians {a} / {f} = {:.2}",
        f as f64 / a as f64
    );
    assert!(f <= 2 * a, "the flood more than doubled the quiet tenant's p99: {f} µs against {a} µs");
}

/// `serve --durable-caches`: values written through the CLI are there after a SIGKILL and a
/// restart; without the flag a cache starts empty.
#[test]
fn a_durable_cache_keeps_its_values_across_a_sigkill() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut broker = serve(dir.path(), addr, &["--durable-caches"]);
    for (k, v) in [("user:1", "alice"), ("user:2", "bob"), ("user:3", "carol")] {
        let put = client_cmd(dir.path(), addr).args(["cache", "put", "sessions", k, v]).output().unwrap();
        assert!(put.status.success(), "{}", String::from_utf8_lossy(&put.stderr));
    }
    let del = client_cmd(dir.path(), addr).args(["cache", "delete", "sessions", "user:3"]).output().unwrap();
    assert!(del.status.success(), "{}", String::from_utf8_lossy(&del.stderr));
    // Acknowledged means written: killed at once, nothing is lost.
    broker.0.kill().unwrap();
    broker.0.wait().unwrap();
    let get = |k: &str| {
        let out = client_cmd(dir.path(), addr).args(["cache", "get", "sessions", k]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let broker = serve(dir.path(), addr, &["--durable-caches"]);
    assert_eq!(get("user:1"), "alice");
    assert_eq!(get("user:2"), "bob");
    assert_ne!(get("user:3"), "carol", "a delete survives too");
    drop(broker);
    // Served without the flag: what a durable cache wrote is not dropped (it stays durable),
    // while a cache created now lives in memory and starts empty after a restart.
    let broker = serve(dir.path(), addr, &[]);
    assert_eq!(get("user:1"), "alice");
    let put = client_cmd(dir.path(), addr).args(["cache", "put", "scratch", "k", "v"]).output().unwrap();
    assert!(put.status.success());
    drop(broker);
    let _broker = serve(dir.path(), addr, &[]);
    let out = client_cmd(dir.path(), addr).args(["cache", "get", "scratch", "k"]).output().unwrap();
    assert_ne!(String::from_utf8_lossy(&out.stdout).trim(), "v");
}

/// `cluster inspect`: a token minted with exactly `node.view:cluster:*` is shown a broker's own
/// view of a shard and the subscriptions it serves; any other token is refused `forbidden`,
/// with a hint.
#[test]
fn cluster_inspect_shows_a_shard_and_subscriptions_to_a_node_view_token_only() {
    let keys = tempfile::tempdir().unwrap();
    let out = Command::new(BIN).args(["token", "keygen", "--out"]).arg(keys.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let jwks = keys.path().join("jwks.json");
    let _broker = serve(dir.path(), addr, &["--jwks", jwks.to_str().unwrap()]);
    let mint = |perm: &str| {
        let out = Command::new(BIN)
            .args(["token", "mint", "--key"])
            .arg(keys.path().join("signing-key.pk8"))
            .args(["--tenant", "default", "--perm", perm])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let p = client_cmd(dir.path(), addr).args(["publish", "orders", "one", "--ack"]).output().unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let view = mint("node.view:cluster:*");
    let inspect = |token: &str, args: &[&str]| {
        let out = client_cmd(dir.path(), addr)
            .args(["cluster", "inspect"])
            .args(args)
            .args(["--token", token])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, out, err) = inspect(&view, &["orders", "0"]);
    assert!(ok, "{err}");
    assert!(out.contains("role leader, phase active, serving") && out.contains("tail 1"), "{out}");
    let (ok, out, err) = inspect(&view, &["orders", "0", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!((v["serving"].as_bool(), v["tail"].as_u64()), (Some(true), Some(1)), "{v}");
    let (ok, out, err) = inspect(&view, &["--subscriptions"]);
    assert!(ok && out.contains("0 subscription(s)"), "{out}{err}");
    for other in [mint("stream.admin:stream:default/*/*"), "dev-token-is-not-it".into()] {
        let (ok, _, err) = inspect(&other, &["orders", "0"]);
        assert!(!ok && (err.contains("forbidden") || err.contains("unauthenticated")), "{err}");
    }
    // The static dev token may do everything else, but it is no diagnostics token.
    let (ok, _, err) = inspect(TOKEN, &["orders", "0"]);
    assert!(!ok && err.contains("node.view:cluster:*"), "{err}");
}

/// End-to-end encryption from the command line (D58): the broker stores ciphertext and the key
/// id; a subscriber with the keys reads the records through a key rotation; one without a key
/// is told which key it lacks, never shown ciphertext as records.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encrypted_records_are_ciphertext_at_the_broker_and_plain_to_a_subscriber_with_the_keys() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("broker");
    let addr = free_port();
    let _broker = serve(&data, addr, &[]);
    let run = |args: &[&str]| run_cli(&data, addr, args);
    let (k1, k2) = ("11".repeat(32), "22".repeat(32));
    let old = dir.path().join("old.keys");
    let both = dir.path().join("both.keys");
    std::fs::write(&old, format!("k1 {k1}\n")).unwrap();
    std::fs::write(&both, format!("k1 {k1}\nk2 {k2}  # current\n")).unwrap();
    let (old_s, both_s) = (old.to_str().unwrap(), both.to_str().unwrap());
    let (code, _, err) = run(&["publish", "vault", "top secret one", "--ack", "--encrypt-key-file", old_s]);
    assert_eq!(code, Some(0), "{err}");
    // Rotated: new records go under k2.
    let (code, _, err) = run(&["publish", "vault", "top secret two", "--ack", "--encrypt-key-file", both_s]);
    assert_eq!(code, Some(0), "{err}");
    // What the broker holds on disk is ciphertext.
    let mut stored = Vec::new();
    let mut stack = vec![data.clone()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            if e.file_type().unwrap().is_dir() {
                stack.push(e.path());
            } else {
                stored.extend(std::fs::read(e.path()).unwrap());
            }
        }
    }
    assert!(stored.windows(5).any(|w| w == b"\x01\x01\x02k2"), "the envelope is stored");
    assert!(!stored.windows(10).any(|w| w == b"top secret"), "no plaintext on the broker's disk");
    // With both keys: both records, in order.
    let (code, out, err) =
        run(&["subscribe", "vault", "--from", "earliest", "--count", "2", "--encrypt-key-file", both_s]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().collect::<Vec<_>>(), ["0\ttop secret one", "1\ttop secret two"], "{out}");
    // With the old key only: the first, then an error naming the key it lacks.
    let (code, out, err) =
        run(&["subscribe", "vault", "--from", "earliest", "--count", "2", "--encrypt-key-file", old_s]);
    assert_ne!(code, Some(0));
    assert_eq!(out.lines().collect::<Vec<_>>(), ["0\ttop secret one"], "{out}");
    assert!(err.contains(r#"encrypted with key "k2", which the key file does not hold (it holds k1)"#), "{err}");
    // Without keys: an error, no ciphertext printed.
    let (code, out, err) = run(&["subscribe", "vault", "--from", "earliest", "--count", "1"]);
    assert_ne!(code, Some(0));
    assert!(out.is_empty(), "{out}");
    assert!(err.contains("are encrypted end to end (key k1): give --encrypt-key-file"), "{err}");
}

/// `publish --compress` and `subscribe --key/--key-prefix` against a served broker (D56, D57).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn compressed_publishes_and_filtered_subscriptions_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let run = |args: &[&str]| run_cli(dir.path(), addr, args);
    // Keyed records, some compressed (a batch of several alike records shrinks).
    for (key, codec) in
        [("eu-1", "zstd"), ("us-1", "lz4"), ("eu-2", ""), ("us-2", "zstd"), ("ap-1", ""), ("eu-3", "lz4")]
    {
        let body = format!("{{\"region\":\"{key}\",\"action\":\"click\",\"page\":\"/home\"}}");
        let mut args = vec!["publish", "orders", &body, &body, &body, "--key", key, "--ack"];
        if !codec.is_empty() {
            args.extend(["--compress", codec]);
        }
        let (code, _, err) = run(&args);
        assert_eq!(code, Some(0), "{err}");
    }
    let (code, out, err) =
        run(&["subscribe", "orders", "--from", "earliest", "--key-prefix", "eu-", "--count", "9", "--no-resume"]);
    assert_eq!(code, Some(0), "{err}");
    let regions: Vec<&str> =
        out.lines().map(|l| l.split("region\":\"").nth(1).unwrap_or("").split('"').next().unwrap_or("")).collect();
    assert_eq!(regions, ["eu-1", "eu-1", "eu-1", "eu-2", "eu-2", "eu-2", "eu-3", "eu-3", "eu-3"], "{out}");
    let (code, out, err) =
        run(&["subscribe", "orders", "--from", "earliest", "--key", "us-2", "--key", "ap-1", "--count", "6"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().filter(|l| l.contains("us-2")).count(), 3, "{out}");
    assert_eq!(out.lines().filter(|l| l.contains("ap-1")).count(), 3, "{out}");
    // Bad arguments are named, before anything connects.
    let (code, _, err) = run(&["publish", "orders", "x", "--compress", "zstd", "--level", "42"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("zstd takes levels 1–19, not 42"), "{err}");
    let (code, _, err) = run(&["publish", "orders", "x", "--compress", "gzip"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("unknown codec \"gzip\": zstd or lz4"), "{err}");
}

/// A new user's reads on a stream of several shards see every shard (issue 37): `read`,
/// `subscribe` and `consume` cover them all unless `--shard` names one, with the shard on each
/// line; `group` commands that work on one shard's offsets ask which; reads of a stream that
/// does not exist fail, say so and create nothing; `subscribe` waits for such a stream and
/// prints its first records; Ctrl-C ends a subscribe with 130. Without the change a read saw
/// shard 0 only, `read nosuch` exited 0 and created the stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reads_cover_every_shard_and_never_create_a_stream() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &["--default-shards", "3"]);
    let run = |args: &[&str]| run_cli(dir.path(), addr, args);
    // Twelve keys: with three shards each gets some (key routing is fixed, so this is stable).
    let mut shards_hit = std::collections::BTreeSet::new();
    for k in 0..12 {
        let (code, _, err) = run(&["publish", "orders", &format!("r{k}"), "--key", &format!("k{k}"), "--ack"]);
        assert_eq!(code, Some(0), "{err}");
        let shard = err.split("shard ").nth(1).and_then(|t| t.split(' ').next()).unwrap_or_default().to_owned();
        assert!(err.contains(" of 3"), "publish names the shard and the count: {err}");
        shards_hit.insert(shard);
    }
    assert_eq!(shards_hit.len(), 3, "{shards_hit:?}");
    // `read` without --shard: every record, lines SHARD/OFFSET.
    let (code, out, err) = run(&["read", "orders"]);
    assert_eq!(code, Some(0), "{err}");
    let mut payloads: Vec<&str> = out.lines().map(|l| l.split('\t').nth(1).unwrap()).collect();
    payloads.sort_unstable();
    let mut want: Vec<String> = (0..12).map(|k| format!("r{k}")).collect();
    want.sort();
    assert_eq!(payloads, want, "{out}");
    assert!(out.lines().all(|l| l.split('\t').next().unwrap().contains('/')), "{out}");
    assert!(err.contains("read 12 record(s)") && err.contains("3 shards"), "{err}");
    // --shard 9 on a 3-shard stream names the count.
    let (code, _, err) = run(&["read", "orders", "--shard", "9"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("has 3 shard(s)"), "{err}");
    // `subscribe --json` from the start: every record, each with its shard.
    let (code, out, err) = run(&["subscribe", "orders", "--from", "earliest", "--count", "12", "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let seen: Vec<serde_json::Value> = out.lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(seen.len(), 12, "{out}");
    let shards: std::collections::BTreeSet<u64> = seen.iter().map(|v| v["shard"].as_u64().unwrap()).collect();
    assert_eq!(shards.len(), 3, "{out}");
    // `consume` over every shard.
    let (code, out, err) = run(&["consume", "orders", "--group", "g1", "--count", "12"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().count(), 12, "{out}");
    assert!(err.contains("all 3 shards"), "{err}");
    // Offsets are one shard's: `group ack` without --shard asks which.
    let (code, _, err) = run(&["group", "ack", "orders", "--group", "g1", "0"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--shard"), "{err}");
    // `group describe` covers every shard, and says the total lag (nothing left: all acked).
    let (code, out, err) = run(&["group", "describe", "orders", "--group", "g1"]);
    assert_eq!(code, Some(0), "{err}");
    assert_eq!(out.lines().filter(|l| l.starts_with(|c: char| c.is_ascii_digit())).count(), 3, "{out}");
    assert!(out.contains("total lag\t0"), "{out}");
    // Reads of a stream that does not exist: an error saying so, and nothing is created.
    for args in
        [&["read", "nosuch"][..], &["read", "nosuch", "--shard", "0"], &["group", "describe", "nosuch", "-g", "g"]]
    {
        let (code, _, err) = run(args);
        assert_eq!(code, Some(1), "{args:?}: {err}");
        assert!(err.contains("no stream default/nosuch") || err.contains("not found"), "{args:?}: {err}");
    }
    // The CLI's tenant ("default"), which the helper's client is not.
    let certs = felix_driver_tokio::tls::load_certs(&dir.path().join("tls/cert.pem")).unwrap();
    let c = Client::connect(addr, ClientOptions::new("default", TOKEN, Trust::Certificates(certs))).await.unwrap();
    assert_eq!(c.stream_shards("default", "orders").await.unwrap().0, 3, "the right tenant");
    assert_eq!(c.stream_shards("default", "nosuch").await.unwrap().0, 0, "no read created it");
    // `subscribe` to a stream that does not exist yet waits for it, then prints its first
    // records (from the start: they came after the command did).
    let mut sub = tokio::process::Command::from(client_cmd(dir.path(), addr))
        .args(["subscribe", "later"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err_lines = tokio::io::BufReader::new(sub.stderr.take().unwrap()).lines();
    use tokio::io::AsyncBufReadExt;
    let said = tokio::time::timeout(Duration::from_secs(20), err_lines.next_line()).await.unwrap().unwrap().unwrap();
    assert!(said.contains("does not exist yet"), "{said}");
    assert_eq!(c.stream_shards("default", "later").await.unwrap().0, 0, "waiting created nothing");
    let (code, _, err) = run(&["publish", "later", "first", "--ack"]);
    assert_eq!(code, Some(0), "{err}");
    let mut out_lines = tokio::io::BufReader::new(sub.stdout.take().unwrap()).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), out_lines.next_line()).await.unwrap().unwrap().unwrap();
    assert_eq!(line.split('\t').nth(1), Some("first"), "{line}");
    // Ctrl-C: 130, as other command-line tools exit when interrupted.
    let pid = sub.id().unwrap().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let status = tokio::time::timeout(Duration::from_secs(20), sub.wait()).await.unwrap().unwrap();
    assert_eq!(status.code(), Some(130));
    let _ = c.close().await;
}

/// The banner's "Try, from this directory" commands work as printed for a broker on another
/// port and data directory (they named ./felix-data and 127.0.0.1:5000 whatever the broker
/// used), and a second broker on a port in use fails before it writes anything (it used to
/// create a data directory, a certificate and a token first).
#[test]
fn the_banners_hint_works_as_printed_and_a_port_in_use_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut child = Command::new(BIN)
        .current_dir(dir.path())
        .env_remove("FELIX_ADDR")
        .env_remove("FELIX_DATA_DIR")
        .args(["serve", "--listen", &addr.to_string(), "--data-dir", "data"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut hints = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(cmd) = line.trim().strip_prefix("felix-node ") {
            hints.push(cmd.split_whitespace().map(str::to_owned).collect::<Vec<_>>());
        }
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    let _broker = Broker(child);
    std::thread::spawn(move || for _ in lines {});
    assert_eq!(hints.len(), 2, "{hints:?}");
    let run = |args: &[String], more: &[&str]| {
        let out = Command::new(BIN)
            .current_dir(dir.path())
            .env_remove("FELIX_ADDR")
            .env_remove("FELIX_DATA_DIR")
            .args(args)
            .args(more)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let publish = hints.iter().find(|h| h[0] == "publish").unwrap();
    let (ok, _, err) = run(publish, &[]);
    assert!(ok, "{publish:?}: {err}");
    let subscribe = hints.iter().find(|h| h[0] == "subscribe").unwrap();
    let (ok, out, err) = run(subscribe, &["--count", "2"]);
    assert!(ok, "{subscribe:?}: {err}");
    assert_eq!(out, "0\thello\n1\tworld\n");
    // The same port again, with a data directory that does not exist yet.
    let second = Command::new(BIN)
        .current_dir(dir.path())
        .args(["serve", "--listen", &addr.to_string(), "--data-dir", "second"])
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("cannot listen on") && err.contains("nothing was written"), "{err}");
    assert!(!dir.path().join("second").exists(), "no data directory, certificate or token written");
}

/// `bench` draws its `\r` progress line only on a terminal: into a pipe or a log it wrote a
/// long line of carriage returns. Its summary still comes.
#[test]
fn bench_progress_is_drawn_only_on_a_terminal() {
    let out = Command::new(BIN).args(["bench", "--duration", "1", "--subscribers", "1"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!out.stderr.contains(&b'\r'), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!out.stdout.is_empty(), "the summary");
}

/// Help a new user can read: `-h` short and `--help` whole, serve's flags under headings, the
/// connection flags under one; durations with units (`--ttl 500` is refused, not read as 500 s);
/// offsets explained; a variable renamed to follow its flag still read under its old name.
#[test]
fn help_is_grouped_durations_take_units_and_old_variable_names_still_work() {
    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (_, short, _) = run(&["serve", "-h"]);
    let (_, long, _) = run(&["serve", "--help"]);
    assert!(
        short.lines().count() * 2 < long.lines().count(),
        "-h {} lines, --help {}",
        short.lines().count(),
        long.lines().count()
    );
    for heading in ["Listening and TLS:", "Storage:", "Cluster:", "QUIC transport:", "RUST_LOG"] {
        assert!(short.contains(heading), "{heading} in serve -h");
    }
    let (_, read_help, _) = run(&["read", "--help"]);
    assert!(read_help.contains("Connection (every client command):"), "{read_help}");
    let (code, _, err) = run(&["cache", "put", "c", "k", "v", "--ttl", "500"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("give a unit, like 500ms or 500s"), "{err}");
    let (code, _, err) = run(&["read", "orders", "--from", "garbage"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("expected an offset"), "{err}");
    // FELIX_HTTP_LISTEN is FELIX_HTTP now; the old name still opens the web view.
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &free_port().to_string(), "--data-dir"])
        .arg(dir.path())
        .env("FELIX_HTTP_LISTEN", "127.0.0.1:0")
        .env_remove("FELIX_HTTP")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut web = false;
    for line in lines {
        let line = line.unwrap();
        web |= line.contains("web view");
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(web, "the old variable opened the web view");
    assert!(String::from_utf8_lossy(&out.stderr).contains("FELIX_HTTP_LISTEN is now FELIX_HTTP"));
}

/// A failed login is in the broker's log at the default level, with the client's address.
#[test]
fn a_failed_login_is_logged_with_its_address() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().starts_with("Ctrl-C")), "banner");
    let out =
        client_cmd(dir.path(), addr).args(["publish", "orders", "x", "--token", "not-the-token"]).output().unwrap();
    assert!(!out.status.success());
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("login refused (tenant default): invalid token (from 127.0.0.1:"), "{log}");
}

/// `cache keys` lists a cache's live keys in order (paged from the broker), `group list` a
/// stream's groups with their lag: what a user looks for first (issue 37).
#[test]
fn cache_keys_and_group_list_show_what_is_there() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let run = |args: &[&str]| {
        let out = client_cmd(dir.path(), addr).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for k in ["user:2", "user:1", "cart:7"] {
        run(&["cache", "put", "sessions", k, "v"]);
    }
    assert_eq!(run(&["cache", "keys", "sessions"]), "cart:7\nuser:1\nuser:2\n");
    assert_eq!(run(&["cache", "keys", "sessions", "--prefix", "user:", "--max", "1"]), "user:1\n");
    run(&["publish", "orders", "a", "b", "c", "--ack"]);
    run(&["consume", "orders", "--group", "billing", "--count", "2", "--batch", "2"]);
    run(&["group", "seek", "orders", "--group", "audit", "earliest"]);
    let list = run(&["group", "list", "orders"]);
    let rows: Vec<Vec<&str>> = list.lines().skip(1).map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows, [vec!["0", "audit", "0", "3", "0", "0"], vec!["0", "billing", "2", "1", "0", "0"]], "{list}");
    let missing = client_cmd(dir.path(), addr).args(["cache", "keys", "nosuch"]).output().unwrap();
    assert!(!missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("not found"));
}

/// docs/felix.example.toml starts a broker as it is (only the address and directory given on
/// the command line, which win over the file), and its token works as the comments say.
#[test]
fn the_example_configuration_starts_a_broker() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/felix.example.toml");
    let _broker = serve(dir.path(), addr, &["--config", example]);
    let out = Command::new(BIN)
        .args(["publish", "--addr", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .args([
            "--tenant",
            "acme",
            "--namespace",
            "orders",
            "--token",
            "change-me-billing",
            "created",
            "hi",
            "--ack",
            "--key",
            "k1",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("of 4"), "the configured 4 shards: {said}");
}

/// `stream list` and `stream info`: what a new user asks first, answered over the client
/// protocol (D51).
#[test]
fn stream_list_and_info_show_what_the_broker_holds() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &["--default-shards", "2"]);
    let run = |args: &[&str]| {
        let out = client_cmd(dir.path(), addr).args(args).output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    for (ns, stream, n) in [("default", "orders", 3), ("audit", "logins", 1)] {
        for i in 0..n {
            let (ok, _, err) =
                run(&["publish", "--namespace", ns, stream, &format!("r{i}"), "--ack", "--key", &format!("k{i}")]);
            assert!(ok, "{err}");
        }
    }
    let (ok, out, err) = run(&["stream", "list"]);
    assert!(ok, "{err}");
    assert_eq!(out, "audit/logins\t2 shards\ndefault/orders\t2 shards\n");
    let (ok, out, _) = run(&["stream", "list", "--in", "default", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!((v["stream"].as_str(), v["shards"].as_u64()), (Some("orders"), Some(2)));
    let (ok, out, err) = run(&["stream", "info", "orders", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["shards"], 2);
    assert_eq!(v["durable"], true);
    assert_eq!(v["records"], 3, "every shard's records: {v}");
    assert_eq!(v["bytes"], 6);
    assert_eq!(v["per_shard"].as_array().unwrap().len(), 2);
    let next: u64 = v["per_shard"].as_array().unwrap().iter().map(|s| s["next_offset"].as_u64().unwrap()).sum();
    assert_eq!(next, 3);
    let (ok, out, _) = run(&["stream", "info", "orders"]);
    assert!(ok);
    assert!(out.starts_with("default/orders: 2 shard(s), durable (on disk), one copy, retains"), "{out}");
    let (ok, _, err) = run(&["stream", "info", "nosuch"]);
    assert!(!ok);
    assert!(err.contains("no stream default/nosuch"), "{err}");
}

/// Shell completions and man pages come from the same definitions as `--help`: a bash script
/// bash accepts that knows the subcommands, a page per subcommand; a reader that stops early
/// (`| head`) is no error.
#[test]
fn completions_and_man_pages_are_generated() {
    let out = Command::new(BIN).args(["completions", "bash"]).output().unwrap();
    assert!(out.status.success());
    let script = String::from_utf8(out.stdout).unwrap();
    assert!(
        script.contains("felix__node__subcmd__stream__subcmd__info") && script.contains("--connect-timeout"),
        "subcommands and flags"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("felix-node.bash");
    std::fs::write(&file, &script).unwrap();
    let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    assert!(check.status.success(), "bash accepts it: {}", String::from_utf8_lossy(&check.stderr));
    for shell in ["zsh", "fish"] {
        assert!(Command::new(BIN).args(["completions", shell]).output().unwrap().status.success());
    }
    let bad = Command::new(BIN).args(["completions", "tcsh"]).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("possible values"));
    let pages = dir.path().join("man");
    assert!(Command::new(BIN).args(["man", "--out"]).arg(&pages).output().unwrap().status.success());
    for page in ["felix-node.1", "felix-node-serve.1", "felix-node-stream-info.1"] {
        let text = std::fs::read_to_string(pages.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.starts_with(".ie") && text.contains(".TH"), "{page} is a man page");
    }
    // A reader that takes a few bytes and goes away.
    let mut child = Command::new(BIN).args(["completions", "bash"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut first = [0u8; 8];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
    drop(child.stdout.take());
    assert!(child.wait().unwrap().success(), "a closed pipe ends it quietly");
}

/// `--worker-threads` is offered where the runtime matters and left out of the help of
/// commands where it does not (`cluster status`), yet still accepted and checked there.
#[test]
fn worker_threads_is_left_out_of_help_where_it_means_nothing() {
    let help = |args: &[&str]| String::from_utf8(Command::new(BIN).args(args).output().unwrap().stdout).unwrap();
    assert!(help(&["serve", "--help"]).contains("--worker-threads"));
    assert!(help(&["subscribe", "--help"]).contains("--worker-threads"));
    for cmd in [&["cluster", "status", "--help"][..], &["token", "mint", "--help"], &["completions", "--help"]] {
        assert!(!help(cmd).contains("worker-threads"), "{cmd:?}");
    }
    let out = Command::new(BIN)
        .args(["cluster", "status", "--worker-threads", "0", "--metrics", "127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("0 is not in 1..=1024"), "still checked");
}

/// `bench --connections`: a broker started as a child process takes a burst of connections
/// (more than its default per-address cap of 64 unauthenticated at once, which the bench
/// raises), each with two subscriptions; the report gives the broker's own memory and CPU from
/// /proc and every subscription receives the fan-out.
#[test]
fn bench_connections_measures_many_connections_on_a_child_broker() {
    let out = Command::new(BIN)
        .args(["bench", "--connections", "150", "--subscriptions-per-connection", "2", "--idle", "1s", "--json"])
        .args(["--quiet", "--liveness", "off"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["connected"], 150, "{v}");
    assert_eq!(v["failures"], 0, "{v}");
    assert_eq!(v["fanout_deliveries"], v["fanout_expected"], "{v}");
    assert_eq!(v["fanout_expected"], 500 * 150 * 2, "{v}");
    assert!(v["broker_rss_per_connection_kb"].as_f64().is_some_and(|k| k > 0.0), "{v}");
    assert!(v["broker_idle_cpu_share_of_a_core"].as_f64().is_some(), "{v}");
}

/// `stream create` (D60): names on the command line and thousands from a file, each with its
/// shard count; a stream that exists is reported and left as it is; a bad line of the file is
/// named before anything is created; a restart brings the created streams back with their
/// shards before any record was written.
#[test]
fn streams_created_from_the_command_line_and_a_file_survive_a_restart_unwritten() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("broker");
    let addr = free_port();
    let broker = serve(&data, addr, &[]);
    let run = |args: &[&str]| run_cli(&data, addr, args);
    let (code, out, err) = run(&["stream", "create", "orders", "payments", "--shards", "3"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("created 2 stream(s) in default"), "{out}");
    let list = dir.path().join("streams.txt");
    let mut text = String::from("# name shards\n");
    for i in 0..2500 {
        text.push_str(&format!("bulk{i:04} {}\n", 1 + i % 4));
    }
    text.push_str("orders 5\n");
    std::fs::write(&list, &text).unwrap();
    let (code, out, err) = run(&["stream", "create", "--from-file", list.to_str().unwrap(), "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["created"].as_array().map(Vec::len), Some(2500), "{out}");
    assert_eq!(v["existed"], serde_json::json!([{"stream": "orders", "shards": 3}]), "left as it is");
    assert!(err.contains("asked for 2501 of 2501 stream(s)"), "progress: {err}");
    // A bad line is named; nothing of the file is created.
    std::fs::write(&list, "fresh1 2\nfresh2 zero\n").unwrap();
    let (code, _, err) = run(&["stream", "create", "--from-file", list.to_str().unwrap()]);
    assert_ne!(code, Some(0));
    assert!(err.contains("line 2: shard count \"zero\" is not a number from 1 to 4096"), "{err}");
    let (code, _, err) = run(&["stream", "create", "x", "--shards", "0"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--shards"), "{err}");
    // Restarted: the unwritten streams are back with their shards.
    drop(broker);
    let _broker = serve(&data, addr, &[]);
    let (code, out, err) = run(&["stream", "list"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.lines().any(|l| l == "default/orders\t3 shards"), "{out}");
    assert!(out.lines().any(|l| l == "default/bulk0002\t3 shards"), "{out}");
    assert!(!out.contains("fresh1"), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("default/bulk")).count(), 2500);
}
