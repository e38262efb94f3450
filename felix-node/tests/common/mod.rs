//! What the multi-process cluster tests share: free ports, a broker's `GET /cluster`, and a
//! bounded wait on a condition.

#![allow(dead_code)] // each test crate uses its own part

pub mod brokers;
pub mod faultnet;
pub mod history;

use std::io::Read;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

/// A port for a broker to listen on, free when asked. Taken below Linux's ephemeral range
/// (32768–60999), which is where the kernel picks the port of every socket bound to port 0: a
/// port taken from there (by binding to 0 and letting go) was sometimes given to a client's
/// socket before the broker bound it, and the broker then failed to start ("Address already in
/// use"). Below it only these helpers hand ports out, each once per test process (a counter
/// from a point that depends on the process id).
fn free_port(taken: impl Fn(u16) -> bool) -> u16 {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    const FIRST: u32 = 12_000;
    const SPAN: u32 = 20_000;
    let base = std::process::id().wrapping_mul(7_919);
    loop {
        let port = (FIRST + base.wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)) % SPAN) as u16;
        if !taken(port) {
            return port;
        }
    }
}

pub fn free_udp() -> SocketAddr {
    let port = free_port(|p| {
        UdpSocket::bind(("127.0.0.1", p)).is_err() || std::net::TcpListener::bind(("127.0.0.1", p)).is_err()
    });
    SocketAddr::from(([127, 0, 0, 1], port))
}

pub fn free_tcp() -> SocketAddr {
    free_udp()
}

/// `GET /cluster` on a broker's metrics listener (`None` while it does not answer).
pub fn cluster_status(metrics: SocketAddr) -> Option<serde_json::Value> {
    serde_json::from_str(&http_get(metrics, "/cluster")?).ok()
}

/// The body of `GET path` on a broker's metrics listener (`None` while it does not answer).
pub fn http_get(metrics: SocketAddr, path: &str) -> Option<String> {
    let mut s = TcpStream::connect_timeout(&metrics, Duration::from_secs(2)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
    std::io::Write::write_all(&mut s, format!("GET {path} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes()).ok()?;
    let mut body = String::new();
    s.read_to_string(&mut body).ok()?;
    body.split("\r\n\r\n").nth(1).map(str::to_owned)
}

/// Polls `check` (every 50 ms) until it holds, for at most `secs`.
pub fn wait_for(what: &str, secs: u64, mut check: impl FnMut() -> bool) {
    let until = Instant::now() + Duration::from_secs(secs);
    while Instant::now() < until {
        if check() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("not within {secs} s: {what}");
}

/// How long a `serve` child may take to print its banner (a restart folds its logs first).
pub const BANNER_WAIT: Duration = Duration::from_secs(60);

/// Waits (at most [`BANNER_WAIT`]) for a `serve` child's "listening" banner on its stdout
/// (piped), and keeps draining the rest so the broker never blocks on a full pipe. With its
/// stderr piped too, the last lines it wrote there are kept (and drained likewise). A child that
/// does not print the banner in time, or exits first, is killed and the test fails saying how
/// it ended and what it last wrote (a port another test took meanwhile, say).
pub fn wait_for_banner(child: &mut std::process::Child) {
    use std::io::{BufRead, BufReader};
    let lines = BufReader::new(child.stdout.take().expect("stdout piped")).lines();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in lines.map_while(Result::ok) {
            if line.starts_with("Felix broker listening")
                && let Some(tx) = tx.take()
            {
                let _ = tx.send(());
            }
        }
    });
    let tail = std::sync::Arc::new(std::sync::Mutex::new(std::collections::VecDeque::<String>::new()));
    // `FELIX_TEST_LOG_DIR`: every line also kept in a file per broker process, to read after
    // a run (what a broker said around a fault).
    let kept = std::env::var_os("FELIX_TEST_LOG_DIR").and_then(|d| {
        let path = std::path::Path::new(&d).join(format!("broker-{}.log", child.id()));
        std::fs::OpenOptions::new().create(true).append(true).open(path).ok()
    });
    if let Some(err) = child.stderr.take() {
        let tail = tail.clone();
        std::thread::spawn(move || {
            let mut kept = kept;
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                if let Some(f) = kept.as_mut() {
                    use std::io::Write;
                    let _ = writeln!(f, "{line}");
                }
                let Ok(mut t) = tail.lock() else { return };
                if t.len() == 20 {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
    }
    if rx.recv_timeout(BANNER_WAIT).is_err() {
        let ended = child.try_wait().ok().flatten();
        let _ = child.kill();
        let _ = child.wait();
        let said = tail.lock().map(|t| Vec::from(t.clone()).join("\n")).unwrap_or_default();
        panic!(
            "the broker printed no banner within {BANNER_WAIT:?} (ended first: {ended:?}); its last lines on stderr:\n{said}"
        );
    }
}
