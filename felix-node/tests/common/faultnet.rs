//! A fault-injecting UDP network between brokers, in the test process: every broker reaches
//! each peer through a proxy of its own (one per direction of each pair), so a test can drop,
//! delay (and so reorder), duplicate or block each direction's datagrams, and cut a broker off
//! (a partition) while clients still reach it directly. Userspace on loopback: no root, no
//! kernel `netem` (this machine's kernel has none), nothing installed. QUIC sees a real lossy
//! network: its own retransmission, congestion control and idle timeouts react as they would.

use std::collections::{BTreeMap, BinaryHeap};
use std::net::{SocketAddr, UdpSocket};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// What happens to the datagrams of one direction (from one broker to another).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Link {
    /// Dropped entirely (a partition, or one side of a one-way fault).
    pub blocked: bool,
    /// Per mille dropped.
    pub loss: u32,
    /// Per mille sent twice.
    pub duplicate: u32,
    /// Each datagram held this long, drawn uniformly from the range (ms): a range reorders.
    pub delay_ms: (u64, u64),
}

/// Datagrams seen, dropped, duplicated (over every direction).
#[derive(Debug, Default)]
pub struct Counts {
    pub forwarded: AtomicU64,
    pub dropped: AtomicU64,
    pub duplicated: AtomicU64,
}

type Rules = Arc<Mutex<BTreeMap<(String, String), Link>>>;

struct Due {
    at: Instant,
    seq: u64,
    socket: Arc<UdpSocket>,
    to: SocketAddr,
    data: Vec<u8>,
}

impl PartialEq for Due {
    fn eq(&self, o: &Self) -> bool {
        (self.at, self.seq) == (o.at, o.seq)
    }
}
impl Eq for Due {}
impl PartialOrd for Due {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Due {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        // A max-heap: the earliest first.
        (o.at, o.seq).cmp(&(self.at, self.seq))
    }
}

type Queue = Arc<(Mutex<BinaryHeap<Due>>, Condvar)>;

/// The proxies, running until dropped.
pub struct FaultNet {
    rules: Rules,
    names: Vec<String>,
    stop: Arc<AtomicBool>,
    queue: Queue,
    threads: Vec<std::thread::JoinHandle<()>>,
    pub counts: Arc<Counts>,
}

/// A small deterministic generator (xorshift64*): faults replay for a seed.
struct Rng(u64);

impl Rng {
    fn per_mille(&mut self) -> u32 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) as u32 % 1000
    }
}

impl FaultNet {
    /// Proxies between every ordered pair of `brokers` (node id, cluster address). Returns the
    /// network and, per broker, the `--peers` list it must be started with (itself at its own
    /// address, every other one at the proxy that carries its traffic to it).
    pub fn new(brokers: &[(String, SocketAddr)], seed: u64) -> (FaultNet, BTreeMap<String, String>) {
        let rules: Rules = Arc::default();
        let stop = Arc::new(AtomicBool::new(false));
        let queue: Queue = Arc::default();
        let counts = Arc::new(Counts::default());
        let mut threads = Vec::new();
        let mut peers = BTreeMap::new();
        let mut n = 0;
        for (a, a_addr) in brokers {
            let mut list = vec![format!("{a}={a_addr}")];
            for (b, b_addr) in brokers.iter().filter(|(b, _)| b != a) {
                n += 1;
                // `listen`: where `a` sends for `b`; `out`: what `b` sees `a`'s traffic come from.
                let listen = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
                let out = Arc::new(UdpSocket::bind("127.0.0.1:0").unwrap());
                list.push(format!("{b}={}", listen.local_addr().unwrap()));
                let client: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
                for (from_a, recv, send) in [(true, listen.clone(), out.clone()), (false, out, listen.clone())] {
                    let (rules, stop, queue, counts, client) =
                        (rules.clone(), stop.clone(), queue.clone(), counts.clone(), client.clone());
                    let key = if from_a { (a.clone(), b.clone()) } else { (b.clone(), a.clone()) };
                    let b_addr = *b_addr;
                    let mut rng = Rng(seed.wrapping_mul(31).wrapping_add(n * 2 + u64::from(from_a)) | 1);
                    recv.set_read_timeout(Some(Duration::from_millis(50))).unwrap();
                    threads.push(std::thread::spawn(move || {
                        let mut buf = vec![0u8; 65536];
                        let mut seq = 0u64;
                        while !stop.load(Ordering::Relaxed) {
                            let Ok((len, src)) = recv.recv_from(&mut buf) else { continue };
                            let to = if from_a {
                                *client.lock().unwrap() = Some(src);
                                b_addr
                            } else {
                                match *client.lock().unwrap() {
                                    Some(c) => c,
                                    None => continue,
                                }
                            };
                            let link = rules.lock().unwrap().get(&key).copied().unwrap_or_default();
                            if link.blocked || rng.per_mille() < link.loss {
                                counts.dropped.fetch_add(1, Ordering::Relaxed);
                                continue;
                            }
                            let copies = if rng.per_mille() < link.duplicate { 2 } else { 1 };
                            if copies == 2 {
                                counts.duplicated.fetch_add(1, Ordering::Relaxed);
                            }
                            for _ in 0..copies {
                                let (lo, hi) = link.delay_ms;
                                let delay = if hi > lo { lo + u64::from(rng.per_mille()) % (hi - lo + 1) } else { lo };
                                if delay == 0 {
                                    let _ = send.send_to(&buf[..len], to);
                                } else {
                                    seq += 1;
                                    let due = Due {
                                        at: Instant::now() + Duration::from_millis(delay),
                                        seq: (n << 40) | seq,
                                        socket: send.clone(),
                                        to,
                                        data: buf[..len].to_vec(),
                                    };
                                    queue.0.lock().unwrap().push(due);
                                    queue.1.notify_one();
                                }
                                counts.forwarded.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }));
                }
            }
            peers.insert(a.clone(), list.join(","));
        }
        // The delayed datagrams go out when due.
        let (q, s) = (queue.clone(), stop.clone());
        threads.push(std::thread::spawn(move || {
            let (lock, cv) = &*q;
            let mut heap = lock.lock().unwrap();
            while !s.load(Ordering::Relaxed) {
                let now = Instant::now();
                match heap.peek().map(|d| d.at) {
                    Some(at) if at <= now => {
                        let d = heap.pop().unwrap();
                        let _ = d.socket.send_to(&d.data, d.to);
                    }
                    Some(at) => heap = cv.wait_timeout(heap, (at - now).min(Duration::from_millis(50))).unwrap().0,
                    None => heap = cv.wait_timeout(heap, Duration::from_millis(50)).unwrap().0,
                }
            }
        }));
        let names = brokers.iter().map(|(n, _)| n.clone()).collect();
        (FaultNet { rules, names, stop, queue, threads, counts }, peers)
    }

    /// Sets what happens to datagrams from `from` to `to`.
    pub fn set(&self, from: &str, to: &str, link: Link) {
        self.rules.lock().unwrap().insert((from.to_owned(), to.to_owned()), link);
    }

    /// Sets every direction between every pair.
    pub fn set_all(&self, link: Link) {
        for a in &self.names {
            for b in self.names.iter().filter(|b| *b != a) {
                self.set(a, b, link);
            }
        }
    }

    /// Cuts `name` off from every other broker, both ways (clients still reach it).
    pub fn isolate(&self, name: &str) {
        let blocked = Link { blocked: true, ..Link::default() };
        for o in self.names.iter().filter(|o| *o != name) {
            self.set(name, o, blocked);
            self.set(o, name, blocked);
        }
    }

    /// Every fault lifted.
    pub fn heal(&self) {
        self.rules.lock().unwrap().clear();
    }
}

impl Drop for FaultNet {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.queue.1.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
