//! `felix-node bench --connections N`: what many connections cost one broker (issue 33,
//! "many connections"). A broker is started as a child process (or one given with `--addr`
//! and `--broker-pid`), so its memory and CPU are its own, read from `/proc`:
//!
//! 1. a connect storm: N connections made at once (at most `--handshakes` in flight), each
//!    subscribing `--subscriptions-per-connection` times to one in-memory stream; time and
//!    failures;
//! 2. the broker's resident memory per connection (with its subscriptions), once settled;
//! 3. the broker's CPU while the connections sit idle (`--idle`), as a share of one core: a
//!    timer or keep-alive that cost work per connection per tick would show here;
//! 4. fan-out: records published to the stream reach every subscription; deliveries per second.

use crate::bench::BenchArgs;
use bytes::Bytes;
use felix_driver_tokio::{Client, ClientOptions, PublishOptions, SubscriptionItem, Trust};
use felix_proto::message::StartPosition;
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The stream every connection subscribes to.
const STREAM: &str = "connections";
/// Linux's clock ticks per second for `/proc/PID/stat` (`sysconf(_SC_CLK_TCK)`, 100 on every
/// mainstream architecture).
const TICKS_PER_S: f64 = 100.0;

/// A broker process started for the run, killed when dropped.
struct Child(std::process::Child, tempfile::TempDir);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Resident memory of `pid`, bytes.
fn rss(pid: u32) -> Option<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let line = s.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// CPU time `pid` used so far (user + system), seconds.
fn cpu(pid: u32) -> Option<f64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces: fields are counted after its ')'.
    let rest = &s[s.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
    Some(ticks as f64 / TICKS_PER_S)
}

/// Starts `felix-node serve` on a free loopback port with in-memory streams, admitting
/// `handshakes` connections from this one address while they authenticate (every client here
/// shares 127.0.0.1, which the default per-address cap of 64 is meant to stop).
fn start_broker(
    handshakes: usize,
    max_udp_payload: u16,
    max_streams: Option<u32>,
) -> Result<(Child, SocketAddr), String> {
    use std::io::{BufRead, BufReader};
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map_err(|e| format!("a free port: {e}"))?
        .port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().map_err(|e| format!("{e}"))?;
    let dir = tempfile::tempdir().map_err(|e| format!("temporary data dir: {e}"))?;
    let exe = std::env::current_exe().map_err(|e| format!("this program's path: {e}"))?;
    let mut child = std::process::Command::new(exe)
        .args(["serve", "--listen", &addr.to_string(), "--ephemeral", "--dev-token", "bench", "--data-dir"])
        .arg(dir.path())
        .arg("--max-unauthenticated-per-address")
        .arg((2 * handshakes).to_string())
        .arg("--max-unauthenticated-connections")
        .arg((2 * handshakes).max(1024).to_string())
        .arg("--max-udp-payload")
        .arg(max_udp_payload.to_string())
        .args(max_streams.map(|m| format!("--max-streams={m}")))
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("starting the broker: {e}"))?;
    let out = child.stdout.take().ok_or("the broker's output")?;
    let mut child = Child(child, dir);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if line.starts_with("Felix broker listening") {
                let _ = tx.send(());
            }
        }
    });
    if rx.recv_timeout(Duration::from_secs(30)).is_err() {
        let _ = child.0.kill();
        return Err("the broker did not start within 30 s".into());
    }
    Ok((child, addr))
}

pub async fn run(a: &BenchArgs, n: usize) -> Result<ExitCode, String> {
    let per = a.subscriptions_per_connection;
    let (child, addr, pid, token, trust) = match a.addr {
        Some(addr) => {
            let token = match &a.token {
                Some(t) => t.clone(),
                None => std::fs::read_to_string(crate::node::DataDir::new(&a.data_dir).token())
                    .map(|t| t.trim().to_owned())
                    .map_err(|e| format!("no --token and no dev token in {}: {e}", a.data_dir.display()))?,
            };
            let trust = crate::node::client_trust(a.ca.as_deref(), &a.data_dir, false)?;
            (None, addr, a.broker_pid, token, trust)
        }
        None => {
            let (child, addr) =
                start_broker(a.handshakes.max(1), a.tuning_pub().max_udp_payload, a.broker_max_streams)?;
            let pid = child.0.id();
            let cert = child.1.path().join("tls").join("cert.pem");
            let certs = felix_driver_tokio::tls::load_certs(&cert).map_err(|e| e.to_string())?;
            (Some(child), addr, Some(pid), "bench".to_owned(), Trust::Certificates(certs))
        }
    };
    let mut opts = ClientOptions::new(a.tenant.clone(), token, trust);
    opts.transport = a.tuning_pub();
    if a.liveness == "off" {
        opts.unresponsive_after = None;
    }
    let rss0 = pid.and_then(rss);
    let delivered = Arc::new(AtomicU64::new(0));
    let handshakes = Arc::new(tokio::sync::Semaphore::new(a.handshakes.max(1)));
    let start = Instant::now();
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (opts, sem, delivered) = (opts.clone(), handshakes.clone(), delivered.clone());
        tasks.spawn(async move {
            let permit = sem.acquire_owned().await.map_err(|e| e.to_string())?;
            let c = Client::connect(addr, opts).await.map_err(|e| e.to_string())?;
            let mut subs = Vec::with_capacity(per);
            for _ in 0..per {
                subs.push(
                    c.subscribe("bench", STREAM, Some(StartPosition::Latest), None).await.map_err(|e| e.to_string())?,
                );
            }
            drop(permit);
            Ok::<_, String>((c, subs, delivered))
        });
    }
    let mut clients = Vec::with_capacity(n);
    let mut failures: Vec<String> = Vec::new();
    while let Some(r) = tasks.join_next().await {
        match r.map_err(|e| e.to_string()).and_then(|r| r) {
            Ok((c, subs, delivered)) => {
                for mut s in subs {
                    let d = delivered.clone();
                    tokio::spawn(async move {
                        while let Some(item) = s.next().await {
                            match item {
                                SubscriptionItem::Events(b) => {
                                    d.fetch_add(u64::from(b.records.count()), Ordering::Relaxed);
                                }
                                SubscriptionItem::End(_) => return,
                                SubscriptionItem::CacheChange(_) => {}
                            }
                        }
                    });
                }
                clients.push(c);
            }
            Err(e) => failures.push(e),
        }
        let done = clients.len() + failures.len();
        if !a.quiet && done.is_multiple_of(1000) {
            eprintln!("  {done} of {n} connections ({:.1} s)", start.elapsed().as_secs_f64());
        }
    }
    let storm = start.elapsed();
    let connected = clients.len();
    // Let the broker settle (handshake state freed, queues allocated) before reading memory.
    tokio::time::sleep(Duration::from_secs(2)).await;
    let rss1 = pid.and_then(rss);
    let cpu0 = pid.and_then(cpu);
    tokio::time::sleep(a.idle).await;
    let cpu1 = pid.and_then(cpu);
    // Fan-out: 50 batches of 10 records, acknowledged, to every subscription.
    let records = 500u64;
    let want = records * (connected * per) as u64;
    let publisher = Client::connect(addr, opts.clone()).await.map_err(|e| e.to_string())?;
    let before = delivered.load(Ordering::Relaxed);
    let f0 = Instant::now();
    for i in 0..50u64 {
        let batch: Vec<Bytes> = (0..10).map(|j| Bytes::from(format!("{:<64}", i * 10 + j))).collect();
        publisher
            .publish("bench", STREAM, batch, PublishOptions { ack: true, ..Default::default() })
            .await
            .map_err(|e| e.to_string())?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    while delivered.load(Ordering::Relaxed) - before < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let fan_time = f0.elapsed();
    let got = delivered.load(Ordering::Relaxed) - before;
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    let per_conn_kb = match (rss0, rss1) {
        (Some(r0), Some(r1)) if connected > 0 => Some(r1.saturating_sub(r0) as f64 / connected as f64 / 1024.0),
        _ => None,
    };
    let idle_share = match (cpu0, cpu1) {
        (Some(c0), Some(c1)) => Some((c1 - c0) / a.idle.as_secs_f64()),
        _ => None,
    };
    let report = serde_json::json!({
        "connections": n, "connected": connected, "liveness": a.liveness, "failures": failures.len(),
        "first_failure": failures.first(), "subscriptions_per_connection": per,
        "connect_storm_s": storm.as_secs_f64(), "broker_rss_before_mb": rss0.map(mb), "broker_rss_after_mb": rss1.map(mb),
        "broker_rss_per_connection_kb": per_conn_kb, "idle_s": a.idle.as_secs_f64(),
        "broker_idle_cpu_share_of_a_core": idle_share, "fanout_records": records, "fanout_deliveries": got,
        "fanout_expected": want, "fanout_s": fan_time.as_secs_f64(),
        "fanout_deliveries_per_s": got as f64 / fan_time.as_secs_f64(),
    });
    if a.json {
        println!("{report}");
    } else {
        println!(
            "Felix connection bench: {n} connections, {per} subscription(s) each, client liveness {}, broker pid {}",
            a.liveness,
            pid.map_or_else(|| "unknown".into(), |p| p.to_string())
        );
        println!("  connected              {connected} in {:.2} s ({} failed)", storm.as_secs_f64(), failures.len());
        if let Some(f) = failures.first() {
            println!("  first failure          {f}");
        }
        if let (Some(r0), Some(r1), Some(k)) = (rss0, rss1, per_conn_kb) {
            println!("  broker memory          {:.1} MiB → {:.1} MiB: {k:.1} KiB per connection", mb(r0), mb(r1));
        }
        if let Some(s) = idle_share {
            println!("  broker CPU, idle {:>4.0}s {:.2}% of a core", a.idle.as_secs_f64(), s * 100.0);
        }
        println!(
            "  fan-out                {got} of {want} deliveries in {:.2} s: {:.0} deliveries/s",
            fan_time.as_secs_f64(),
            got as f64 / fan_time.as_secs_f64()
        );
    }
    for c in &clients {
        c.close_now();
    }
    drop(child);
    Ok(if failures.is_empty() && got == want { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
