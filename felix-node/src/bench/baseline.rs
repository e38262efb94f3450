//! `bench --raw-quinn` and `--baseline`: the same bytes through bare quinn (one hop, or two
//! through a relay), the floor Felix's figures are read against; the process's CPU and steal
//! time.

use super::*;

/// The watch bench's time origin (writes stamp their values with nanoseconds since it).
pub(super) static BENCH_EPOCH: std::sync::LazyLock<Instant> = std::sync::LazyLock::new(Instant::now);

pub(super) async fn raw_quinn(a: &BenchArgs) -> Result<ExitCode, String> {
    let relay = a.relay;
    let run = raw_quinn_run(a, relay).await?;
    if a.json {
        out!(
            "{}",
            serde_json::json!({"raw_quinn_mb_per_s": run.mb_per_s, "relay": relay, "duration_s": run.secs,
                "cpu_s_per_gb": run.cpu_s_per_gb()})
        );
    } else if relay {
        out!(
            "raw quinn relay (two hops, one forwarding process), same TLS and transport settings: {:.1} MB/s",
            run.mb_per_s
        );
    } else {
        out!("raw quinn, one stream, same TLS and transport settings: {:.1} MB/s", run.mb_per_s);
    }
    Ok(ExitCode::SUCCESS)
}

/// What one measured run moved, and the CPU it took.
#[derive(Debug, Clone, Copy)]
pub(super) struct Throughput {
    pub(super) mb_per_s: f64,
    pub(super) secs: f64,
    /// CPU seconds the whole process used during the run (user + system), when known.
    pub(super) cpu_s: Option<f64>,
}

impl Throughput {
    /// CPU seconds per GB delivered: the cost of the path, whatever else the machine was doing.
    pub(super) fn cpu_s_per_gb(&self) -> Option<f64> {
        let gb = self.mb_per_s * self.secs / 1e3;
        self.cpu_s.filter(|_| gb > 0.0).map(|c| c / gb)
    }
}

/// CPU time the hypervisor gave other guests while this machine's CPUs wanted to run (the
/// `steal` column of `/proc/stat`, all CPUs), seconds; `None` where there is no procfs. A run
/// with much steal measured the host's contention as well as the code: on this project's
/// 2-core VM, 10% steal took 10,000 rec/s p99 from 0.5 ms to 2–25 ms with the same binary.
pub(super) fn steal_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let cpu = stat.lines().find(|l| l.starts_with("cpu "))?;
    let steal = cpu.split_whitespace().nth(8)?.parse::<u64>().ok()?;
    Some(steal as f64 / 100.0)
}

/// CPU time this process has used (user + system), from `/proc/self/stat`; `None` where there is
/// no procfs. The kernel reports it in USER_HZ ticks, 100 per second on every Linux ABI.
pub(super) fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may hold spaces, so cut at its closing paren).
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let (utime, stime) = (f.get(11)?.parse::<u64>().ok()?, f.get(12)?.parse::<u64>().ok()?);
    Some((utime + stime) as f64 / 100.0)
}

/// The broker's `felix_quic_*` metrics, without the prefix: datagrams, system calls and ACK
/// frames each way, lost packets, black holes and the smallest and largest path MTU.
pub(super) async fn broker_quic(metrics: SocketAddr) -> serde_json::Value {
    let Ok(text) = felix_driver_tokio::server::scrape(metrics).await else { return serde_json::Value::Null };
    let mut m = serde_json::Map::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        if let Some((name, v)) = line.split_once(' ')
            && let (Some(name), Ok(v)) = (name.strip_prefix("felix_quic_"), v.parse::<u64>())
        {
            m.insert(name.to_owned(), v.into());
        }
    }
    serde_json::Value::Object(m)
}

pub(super) async fn raw_quinn_run(a: &BenchArgs, relay: bool) -> Result<Throughput, String> {
    let (id, _, _) = Identity::self_signed(&["localhost"]).map_err(|e| e.to_string())?;
    let chain = id.chain.clone();
    let tls = felix_driver_tokio::tls::server_config(id).map_err(|e| e.to_string())?;
    let crypto = quinn::crypto::rustls::QuicServerConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut scfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
    scfg.transport_config(Arc::new(a.tuning().to_quinn_for(SocketAddr::from(([127, 0, 0, 1], 0)))));
    let endpoint = |server: Option<quinn::ServerConfig>| -> Result<quinn::Endpoint, String> {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        quinn::Endpoint::new(a.tuning().endpoint_config(), server, socket, Arc::new(quinn::TokioRuntime))
            .map_err(|e| e.to_string())
    };
    let server = endpoint(Some(scfg))?;
    let addr = server.local_addr().map_err(|e| e.to_string())?;
    let received = Arc::new(AtomicU64::new(0));
    let r2 = received.clone();
    tokio::spawn(async move {
        let Some(inc) = server.accept().await else { return };
        let Ok(conn) = inc.await else { return };
        if relay {
            // The second connection is the reader: forward the first one's stream to it.
            let Some(inc2) = server.accept().await else { return };
            let Ok(reader) = inc2.await else { return };
            let (Ok(mut uni), Ok(mut out)) = (conn.accept_uni().await, reader.open_uni().await) else { return };
            // Take every chunk quinn holds and write them in one call, as the broker's driver
            // does: the ceiling is a good relay, not a naive one.
            let mut bufs: [Bytes; 32] = Default::default();
            while let Ok(Some(n)) = uni.read_chunks(&mut bufs).await {
                if out.write_all_chunks(&mut bufs[..n]).await.is_err() {
                    return;
                }
            }
            return;
        }
        if let Ok(mut uni) = conn.accept_uni().await {
            while let Ok(Some(c)) = uni.read_chunk(1 << 20, true).await {
                r2.fetch_add(c.bytes.len() as u64, Ordering::Relaxed);
            }
        }
    });
    let tls = felix_driver_tokio::tls::client_config(Trust::Certificates(chain), true).map_err(|e| e.to_string())?;
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(tls).map_err(|e| e.to_string())?;
    let mut ccfg = quinn::ClientConfig::new(Arc::new(crypto));
    ccfg.transport_config(Arc::new(a.tuning().to_quinn_for(SocketAddr::from(([127, 0, 0, 1], 0)))));
    let mut ep = endpoint(None)?;
    ep.set_default_client_config(ccfg.clone());
    let conn = ep.connect(addr, "localhost").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
    let _reader = if relay {
        let mut rep = endpoint(None)?;
        rep.set_default_client_config(ccfg);
        let rconn = rep.connect(addr, "localhost").map_err(|e| e.to_string())?.await.map_err(|e| e.to_string())?;
        let r3 = received.clone();
        let rc = rconn.clone();
        tokio::spawn(async move {
            if let Ok(mut uni) = rc.accept_uni().await {
                while let Ok(Some(c)) = uni.read_chunk(1 << 20, true).await {
                    r3.fetch_add(c.bytes.len() as u64, Ordering::Relaxed);
                }
            }
        });
        Some((rep, rconn))
    } else {
        None
    };
    let mut send = conn.open_uni().await.map_err(|e| e.to_string())?;
    // Paced (`--rate` records/s of `--payload` bytes), it writes what a publisher's batches
    // would carry, a batch's worth at a time: the same bytes per second as a Felix run at that
    // rate, so that CPU per GB compares paths at the same load (a path run flat out amortises
    // each wake-up, system call and ACK over more bytes than one at a third of that).
    let pace = (a.rate > 0).then_some(a.rate as f64 * a.payload as f64);
    let chunk_len = if pace.is_some() { (a.batch * a.payload).clamp(1, 1 << 20) } else { 64 * 1024 };
    let chunk = Bytes::from(vec![7u8; chunk_len]);
    let total = a.duration;
    let cpu0 = cpu_seconds();
    let start = Instant::now();
    let mut last = Instant::now();
    let mut sent = 0u64;
    while start.elapsed() < total {
        if let Some(bytes_per_s) = pace {
            let due = start + Duration::from_secs_f64(sent as f64 / bytes_per_s);
            if due > Instant::now() {
                tokio::time::sleep_until(due.into()).await;
            }
        }
        send.write_chunk(chunk.clone()).await.map_err(|e| e.to_string())?;
        sent += chunk_len as u64;
        if last.elapsed() > Duration::from_millis(250) {
            last = Instant::now();
            let mb = received.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64() / 1e6;
            progress(a.quiet, start, total, format!("{mb:.0} MB/s"));
        }
    }
    let secs = start.elapsed().as_secs_f64();
    let mb = received.load(Ordering::Relaxed) as f64 / secs / 1e6;
    let cpu_s = cpu_seconds().zip(cpu0).map(|(b, a)| b - a);
    if !a.quiet && progress_shown() {
        eprintln!();
    }
    conn.close(0u32.into(), b"done");
    Ok(Throughput { mb_per_s: mb, secs, cpu_s })
}
