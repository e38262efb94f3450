//! What the multi-process cluster tests share: free ports, a broker's `GET /cluster`, and a
//! bounded wait on a condition.

#![allow(dead_code)] // each test crate uses its own part

pub mod brokers;
pub mod faultnet;
pub mod history;

use std::io::Read;
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::time::{Duration, Instant};

pub fn free_udp() -> SocketAddr {
    UdpSocket::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
}

pub fn free_tcp() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap()
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
    if let Some(err) = child.stderr.take() {
        let tail = tail.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
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
