//! `felix-node soak`: a bounded soak test against a real `felix-node serve` process.
//!
//! Many connections churn over many streams: each connects, subscribes to two streams,
//! publishes for a few seconds while its subscriptions measure publish→deliver latency, then
//! goes away — cleanly, or abruptly (no close: the broker finds out by idle timeout). Every
//! interval the broker's RSS (from /proc), its leak gauges (connections, control streams,
//! subscriptions, driver stream tasks, runtime tasks) and the interval's latency are sampled. At
//! the end the clients stop and the gauges must come back to where they started; RSS after
//! warm-up must stay flat; p99 must stay stable.

use bytes::{BufMut, BytesMut};
use clap::Args;
use felix_driver_tokio::{Client, ClientOptions, PublishOptions, SubscriptionItem, Trust};
use hdrhistogram::Histogram;
use std::collections::BTreeMap;
use std::io::BufRead;
use std::net::SocketAddr;
use std::process::{ExitCode, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Args, Debug)]
pub struct SoakArgs {
    /// How long to churn (e.g. 5m).
    #[arg(long, value_parser = crate::commands::parse_duration, default_value = "5m")]
    duration: Duration,
    /// Concurrent client connections.
    #[arg(long, default_value_t = 50)]
    connections: usize,
    /// Streams the clients spread over.
    #[arg(long, default_value_t = 200)]
    streams: usize,
    /// Records per second each connection publishes.
    #[arg(long, default_value_t = 100)]
    rate: u64,
    /// Records each shard retains (the warm-up lasts until the retained history is full).
    #[arg(long, default_value_t = 2000)]
    retention_records: u64,
    /// Time between samples (e.g. 10s, 1m; a bare number is seconds).
    #[arg(long, default_value = "10s", value_parser = crate::commands::parse_duration)]
    interval: Duration,
    /// Print results as JSON.
    #[arg(long)]
    json: bool,
}

const GAUGES: [&str; 7] = [
    "felix_connections_open",
    "felix_control_streams",
    "felix_subscriptions",
    "felix_driver_connections",
    "felix_driver_stream_writers",
    "felix_driver_stream_readers",
    "felix_runtime_alive_tasks",
];

/// The history the broker keeps in memory: it fills up to the retention and `--memory-bytes`
/// bounds, and the warm-up lasts until it has.
const HISTORY: &str = "felix_retained_log_bytes";

fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

async fn gauges(metrics: SocketAddr) -> BTreeMap<&'static str, u64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut out = BTreeMap::new();
    let Ok(mut s) = tokio::net::TcpStream::connect(metrics).await else { return out };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n").await;
    let mut body = String::new();
    let _ = s.read_to_string(&mut body).await;
    for g in GAUGES.iter().chain([&HISTORY]) {
        let v = body.lines().find_map(|l| l.strip_prefix(g).and_then(|r| r.trim().parse().ok()));
        out.insert(*g, v.unwrap_or(0));
    }
    out
}

fn free_addr(udp: bool) -> Result<SocketAddr, String> {
    let a = if udp {
        std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr())
    } else {
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|s| s.local_addr())
    };
    a.map_err(|e| format!("finding a free port: {e}"))
}

struct Interval {
    at: u64,
    rss_kib: u64,
    gauges: BTreeMap<&'static str, u64>,
    delivered: u64,
    p50_us: u64,
    p99_us: u64,
}

pub async fn run(a: SoakArgs) -> Result<ExitCode, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temporary data dir: {e}"))?;
    let (addr, metrics) = (free_addr(true)?, free_addr(false)?);
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut child = std::process::Command::new(exe)
        .args(["serve", "--listen", &addr.to_string(), "--metrics-listen", &metrics.to_string()])
        .arg("--data-dir")
        .arg(dir.path())
        .args(["--dev-token", "soak", "--idle-timeout-ms", "3000"])
        // Durable streams with small retention and in-memory history: once it is full (the
        // warm-up), a flat RSS means nothing else grows.
        .args(["--retention-records", &a.retention_records.to_string(), "--memory-bytes", "262144"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("starting the broker: {e}"))?;
    let pid = child.id();
    let mut lines = std::io::BufReader::new(child.stdout.take().ok_or("no broker stdout")?).lines();
    loop {
        match lines.next() {
            Some(Ok(l)) if l.starts_with("Felix broker listening") => break,
            Some(Ok(_)) => {}
            _ => return Err("the broker did not start".into()),
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let certs = felix_driver_tokio::tls::load_certs(&dir.path().join("tls/cert.pem")).map_err(|e| e.to_string())?;
    let opts = ClientOptions::new("soak", "soak", Trust::Certificates(certs));
    let cert = dir.path().join("tls/cert.pem");
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let baseline = gauges(metrics).await;
    let epoch = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let delivered = Arc::new(AtomicU64::new(0));
    let sessions = Arc::new(AtomicU64::new(0));
    let hist = Arc::new(Mutex::new(Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds")));
    let mut workers = Vec::new();
    for w in 0..a.connections {
        let (opts, stop, delivered, sessions, hist) =
            (opts.clone(), stop.clone(), delivered.clone(), sessions.clone(), hist.clone());
        let (exe, cert) = (exe.clone(), cert.clone());
        let (streams, rate) = (a.streams.max(2), a.rate.max(1));
        workers.push(tokio::spawn(async move {
            let mut n = w as u64;
            while !stop.load(Ordering::Relaxed) {
                n = n.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if (n >> 20) % 10 >= 7 {
                    // An abrupt end: a subscriber process killed with SIGKILL (no close; the
                    // broker finds out by idle timeout).
                    let child = tokio::process::Command::new(&exe)
                        .args(["subscribe", &format!("s{}", (n >> 33) as usize % streams.max(2))])
                        .args([
                            "--addr",
                            &addr.to_string(),
                            "--token",
                            "soak",
                            "--tenant",
                            "soak",
                            "--namespace",
                            "soak",
                        ])
                        .arg("--ca")
                        .arg(&cert)
                        .stdout(Stdio::null())
                        .stderr(Stdio::null())
                        .kill_on_drop(true)
                        .spawn();
                    if let Ok(mut child) = child {
                        sessions.fetch_add(1, Ordering::Relaxed);
                        tokio::time::sleep(Duration::from_millis(1000 + (n >> 40) % 4000)).await;
                        let _ = child.start_kill();
                        let _ = child.wait().await;
                    }
                    continue;
                }
                let Ok(c) = Client::connect(addr, opts.clone()).await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                };
                sessions.fetch_add(1, Ordering::Relaxed);
                let s1 = format!("s{}", (n >> 33) as usize % streams);
                let s2 = format!("s{}", (n >> 13) as usize % streams);
                let mut subs = Vec::new();
                for s in [&s1, &s2] {
                    if let Ok(sub) = c.subscribe("soak", s, None, None).await {
                        subs.push(sub);
                    }
                }
                let readers: Vec<_> = subs
                    .into_iter()
                    .map(|mut sub| {
                        let (delivered, hist) = (delivered.clone(), hist.clone());
                        tokio::spawn(async move {
                            while let Some(SubscriptionItem::Events(b)) = sub.next().await {
                                let now = epoch.elapsed().as_micros() as u64;
                                let mut h = hist.lock().unwrap_or_else(|e| e.into_inner());
                                for p in b.records.payloads() {
                                    if p.len() >= 8 {
                                        let sent = u64::from_be_bytes(p[..8].try_into().expect("8 bytes"));
                                        let _ = h.record(now.saturating_sub(sent).max(1));
                                    }
                                    delivered.fetch_add(1, Ordering::Relaxed);
                                }
                            }
                        })
                    })
                    .collect();
                // Publish for 1 to 5 seconds.
                let until = Instant::now() + Duration::from_millis(1000 + (n >> 40) % 4000);
                let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / rate));
                while Instant::now() < until && !stop.load(Ordering::Relaxed) {
                    tick.tick().await;
                    let mut p = BytesMut::with_capacity(256);
                    p.put_u64(epoch.elapsed().as_micros() as u64);
                    p.resize(256, b's');
                    let target = if n & 1 == 0 { &s1 } else { &s2 };
                    if c.publish("soak", target, vec![p.freeze()], PublishOptions::default()).await.is_err() {
                        break;
                    }
                }
                let _ = c.close().await;
                drop(c);
                for r in readers {
                    r.abort();
                }
            }
        }));
    }
    let mut samples: Vec<Interval> = Vec::new();
    let start = Instant::now();
    let mut last_delivered = 0;
    while start.elapsed() < a.duration {
        tokio::time::sleep(a.interval.max(Duration::from_secs(1))).await;
        let d = delivered.load(Ordering::Relaxed);
        let (p50, p99) = {
            let mut h = hist.lock().unwrap_or_else(|e| e.into_inner());
            let v = (h.value_at_quantile(0.5), h.value_at_quantile(0.99));
            h.reset();
            v
        };
        let s = Interval {
            at: start.elapsed().as_secs(),
            rss_kib: rss_kib(pid),
            gauges: gauges(metrics).await,
            delivered: d - last_delivered,
            p50_us: p50,
            p99_us: p99,
        };
        last_delivered = d;
        eprintln!(
            "[{:>4}s] rss {:>7} KiB, {:>3} conns, {:>3} subs, {:>4} tasks, {:>8} delivered, p50 {:>6} µs, p99 {:>7} µs, {} sessions",
            s.at,
            s.rss_kib,
            s.gauges["felix_connections_open"],
            s.gauges["felix_subscriptions"],
            s.gauges["felix_runtime_alive_tasks"],
            s.delivered,
            s.p50_us,
            s.p99_us,
            sessions.load(Ordering::Relaxed)
        );
        samples.push(s);
    }
    stop.store(true, Ordering::Relaxed);
    for w in workers {
        let _ = w.await;
    }
    // Killed processes' connections end by idle timeout (3 s here): give the broker time.
    let mut end = gauges(metrics).await;
    for _ in 0..50 {
        if GAUGES.iter().all(|g| end[g] <= baseline.get(g).copied().unwrap_or(0)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        end = gauges(metrics).await;
    }
    let end_rss = rss_kib(pid);
    let _ = child.kill();
    let _ = child.wait();
    // Verdicts.
    // Warm-up ends once the retained history has stopped growing (within 5% of its largest
    // size), and not before a fifth of the run: from then on nothing may grow. How long the
    // history takes to fill depends on the rates, so a fixed fraction alone misjudged long runs.
    let history = |s: &Interval| s.gauges.get(HISTORY).copied().unwrap_or(0);
    let full = samples.iter().map(history).max().unwrap_or(0);
    let filled = samples.iter().position(|s| history(s) as f64 >= 0.95 * full as f64).unwrap_or(0);
    let warm = filled.max(samples.len() / 5);
    // At least three samples after the warm-up, or there is nothing to judge RSS on.
    let judged = samples.len() >= warm + 3;
    let warm_s = samples.get(warm).map_or(0, |s| s.at);
    let after_warm = samples.get(warm).map_or(0, |s| s.rss_kib);
    let max_rss = samples.iter().skip(warm).map(|s| s.rss_kib).max().unwrap_or(0);
    let growth = if after_warm > 0 { max_rss as f64 / after_warm as f64 - 1.0 } else { 0.0 };
    let mut p99s: Vec<u64> = samples.iter().skip(warm).map(|s| s.p99_us).collect();
    p99s.sort_unstable();
    let median_p99 = p99s.get(p99s.len() / 2).copied().unwrap_or(0);
    let worst_p99 = p99s.last().copied().unwrap_or(0);
    let leaks: Vec<String> = GAUGES
        .iter()
        .filter(|g| end[*g] > baseline.get(*g).copied().unwrap_or(0))
        .map(|g| format!("{g} {} (was {})", end[g], baseline.get(g).copied().unwrap_or(0)))
        .collect();
    let rss_ok = judged && growth < 0.25;
    let p99_ok = worst_p99 <= median_p99.saturating_mul(4).max(20_000);
    let ok = leaks.is_empty() && rss_ok && p99_ok;
    let result = serde_json::json!({
        "duration_s": start.elapsed().as_secs(), "connections": a.connections, "streams": a.streams,
        "sessions": sessions.load(Ordering::Relaxed), "delivered": delivered.load(Ordering::Relaxed),
        "warmup_ends_s": warm_s, "rss_judged": judged, "rss_kib_after_warmup": after_warm, "rss_kib_max_after_warmup": max_rss, "rss_kib_end": end_rss,
        "rss_growth_after_warmup": growth, "p99_us_median_interval": median_p99, "p99_us_worst_interval": worst_p99,
        "leaks": leaks, "ok": ok,
    });
    if a.json {
        out!("{result}");
    } else {
        out!(
            "Felix soak: {} connections churning over {} streams for {} s",
            a.connections,
            a.streams,
            start.elapsed().as_secs()
        );
        out!("  sessions (connect, subscribe, publish, leave)  {}", sessions.load(Ordering::Relaxed));
        out!("  records delivered                              {}", delivered.load(Ordering::Relaxed));
        out!("  warm-up (retained history full) ends at        {warm_s} s");
        if judged {
            out!(
                "  broker RSS after warm-up / max / end (KiB)     {after_warm} / {max_rss} / {end_rss} ({:+.1}%)",
                growth * 100.0
            );
        } else {
            out!(
                "  broker RSS                                     not judged: the history filled too late, run longer"
            );
        }
        out!("  p99 publish→deliver, median / worst interval   {median_p99} / {worst_p99} µs");
        out!(
            "  leak gauges back to baseline                   {}",
            if leaks.is_empty() { "yes".to_owned() } else { leaks.join(", ") }
        );
        out!("  verdict                                        {}", if ok { "PASS" } else { "FAIL" });
    }
    Ok(if ok { ExitCode::SUCCESS } else { ExitCode::FAILURE })
}
