//! A schedule of faults against three `felix-node serve` processes under a concurrent workload,
//! judged afterwards by an independent checker over what was recorded ([`common::history`]).
//!
//! The brokers' peer traffic goes through a fault network ([`FaultNet`]); clients reach the
//! brokers directly, so a partitioned leader is still asked by clients. Each episode applies
//! one fault for a few seconds and heals it: a partitioned leader, one-way loss from a leader,
//! lossy, duplicating, reordering links, a bridge, a paused leader (SIGSTOP), a killed leader
//! (SIGKILL, restarted), a power cut of one broker (what it wrote but had not synced is taken
//! back), a follower's replica log with a bit flipped while it is down, and a clock jump (the
//! leader restarts with its wall clock an hour behind or ten minutes ahead, then again with it
//! right: a broker reads the system clock only at start). The fault's target alternates between
//! the stream's leader and the cache's.
//!
//! The workload throughout: acknowledged publishes (plain and keyed lanes through the cluster
//! client, an idempotent producer), conditional appends (`publish_if`) to a second stream, a
//! subscriber following the stream, and one cache client per broker doing reads, puts,
//! conditional puts and deletes on keys of their own per episode; a third stream of jobs (an
//! acknowledged producer) worked through by a consumer group (polls, acks, one first delivery
//! in ten left to lapse and come back), drained to the end after the last episode; and a
//! committer writing an event and the state key it sets together (`commit`) to a fourth.
//!
//! Afterwards: every acknowledged record once, at the offset its acknowledgement gave, and on
//! every replica's disk; nothing unsent; the subscriber's sequence gap-free against the stream;
//! no two replicas with different committed entries at one index; every key's history
//! linearizable (a stale read fails it); the group never handed out a job after its ack came
//! back, nor something the stream does not hold, and settled every job by the end. The short schedule runs in CI; the long one
//! (`FELIX_CHAOS_EPISODES`, default 200) is ignored and run by hand.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_driver_tokio::{
    Client, ClientError, ClientOptions, ClusterClient, GroupTarget, IdempotentProducer, PollOptions, PublishOptions,
    Trust,
};
use felix_proto::RetryClass;
use felix_proto::message::{CacheCondition, StartPosition};

#[path = "../common/mod.rs"]
mod common;
use common::brokers::*;
use common::faultnet::{FaultNet, Link};
use common::history::{
    CacheCall, CacheOp, CacheReturn, GroupHistory, ReplicaLog, check_group, check_stream, check_subscriber, divergent,
    linearizable,
};
use common::{cluster_status as status, wait_for};

mod clients;
use clients::*;

/// The kinds of fault, in the order a schedule goes through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Partition,
    OneWayLoss,
    LossyLinks,
    Bridge,
    Pause,
    Kill,
    PowerCut,
    CorruptFollower,
    ClockJump,
}

const KINDS: [Fault; 9] = [
    Fault::Partition,
    Fault::OneWayLoss,
    Fault::LossyLinks,
    Fault::Bridge,
    Fault::Pause,
    Fault::Kill,
    Fault::PowerCut,
    Fault::CorruptFollower,
    Fault::ClockJump,
];

/// The stream and the cache the workload uses.
const STREAM: &str = "ledger";

/// The stream the conditional writer appends to (one writer: each append names the offset it
/// must land at).
const COND: &str = "cond";

const CACHE: &str = "sessions";

/// The stream of jobs and the consumer group working through it.
const JOBS: &str = "jobs";

const GROUP: &str = "workers";

/// The stream a committer writes events and state to together (`commit`): one key, whose
/// value is the event that wrote it.
const ACCOUNTS: &str = "accounts";

/// How long a job handed out stays claimed (one left unacknowledged comes back after it).
const VISIBILITY: Duration = Duration::from_secs(3);

/// Keys per episode.
const KEYS: usize = 3;

/// xorshift64*: the schedule replays for a seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % n.max(1)
    }
}

/// What the workload recorded.
#[derive(Default)]
struct History {
    /// Acknowledged publishes: the record and the offset its acknowledgement gave.
    acked: Vec<(String, Option<u64>)>,
    /// When each acknowledgement came.
    ack_times: Vec<Instant>,
    /// Published with an unknown outcome.
    unknown: BTreeSet<String>,
    /// What the subscriber saw: (offset, record).
    seen: Vec<(u64, String)>,
    /// The conditional writer's appends acknowledged (record, offset), those whose outcome is
    /// unknown, and any acknowledged at another offset than the one it named.
    cond_acked: Vec<(String, Option<u64>)>,
    cond_unknown: BTreeSet<String>,
    cond_misplaced: Vec<String>,
    /// Each key's cache operations.
    cache: BTreeMap<String, Vec<CacheOp>>,
    /// Cache operations answered, and refused before taking effect.
    cache_answered: u64,
    cache_refused: u64,
    /// The jobs acknowledged (record, offset) and those whose outcome is unknown.
    jobs_acked: Vec<(String, Option<u64>)>,
    jobs_unknown: BTreeSet<String>,
    /// What the consumer group handed out and settled.
    group: GroupHistory,
    /// Polls refused or failed.
    polls_failed: u64,
    /// Commits acknowledged (event, offset), and those whose outcome is unknown.
    commits_acked: Vec<(String, Option<u64>)>,
    commits_unknown: BTreeSet<String>,
}

struct Workload {
    stop: Arc<AtomicBool>,
    /// The episode whose keys the cache clients use.
    episode: Arc<AtomicU64>,
    history: Arc<Mutex<History>>,
    thread: std::thread::JoinHandle<()>,
}

fn opts() -> ClientOptions {
    ClientOptions::new("default", TOKEN, Trust::DangerAcceptAnyCertificate)
}

/// Whether a refusal or error says the operation did not take effect.
fn refused(e: &ClientError) -> bool {
    not_written(e)
}

fn elapsed(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

impl Workload {
    fn start(brokers: Vec<SocketAddr>, t0: Instant) -> Workload {
        let stop = Arc::new(AtomicBool::new(false));
        let episode = Arc::new(AtomicU64::new(0));
        let history = Arc::new(Mutex::new(History::default()));
        let (s, e, h) = (stop.clone(), episode.clone(), history.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async move {
                let cc = Arc::new(ClusterClient::connect(&brokers, opts()).await.expect("the workload connects"));
                let mut tasks = Vec::new();
                for lane in 0..4 {
                    tasks.push(tokio::spawn(publisher(cc.clone(), lane, s.clone(), h.clone())));
                }
                tasks.push(tokio::spawn(idempotent(brokers.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(subscriber(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(conditional(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(jobs(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(committer(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(consumer(cc.clone(), t0, s.clone(), h.clone())));
                for (i, addr) in brokers.iter().enumerate() {
                    tasks.push(tokio::spawn(cache_client(i, *addr, t0, s.clone(), e.clone(), h.clone())));
                }
                for t in tasks {
                    t.await.expect("a workload task");
                }
                cc.close().await;
            });
        });
        Workload { stop, episode, history, thread }
    }

    fn acks(&self) -> usize {
        self.history.lock().unwrap().acked.len()
    }

    fn finish(self) -> History {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the workload");
        Arc::try_unwrap(self.history).ok().expect("the workload's tasks ended").into_inner().unwrap()
    }
}

/// What one episode measured.
struct Episode {
    kind: Fault,
    /// From the heal (restart, resume) to the next acknowledged publish.
    unavailable_after_heal: Duration,
    /// The longest stretch without an acknowledged publish, from the fault's start until the
    /// cluster settled after the heal.
    longest_gap: Duration,
}

/// Flips one bit in the middle of `node`'s replica log of the stream (while it is down).
fn flip_a_bit(node: &Node) {
    let replicas = node.dir.join("cluster").join("replicas");
    let file = std::fs::read_dir(&replicas)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .find(|p| p.file_name().unwrap().to_string_lossy().contains(&format!("~{STREAM}~")))
        .expect("the stream's replica log");
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
}

/// The broker leading replicated shard `name`, by its own status.
fn leading(nodes: &[Node], name: &str) -> Option<usize> {
    nodes.iter().position(|n| {
        n.proc.is_some()
            && status(n.metrics).is_some_and(|v| {
                v["replicas"].as_array().is_some_and(|r| r.iter().any(|r| r["name"] == name && r["role"] == "leader"))
            })
    })
}

/// Every broker up and its replicas of the stream and the cache leading or following.
fn settled(nodes: &[Node]) -> bool {
    nodes.iter().all(|n| {
        status(n.metrics).is_some_and(|v| {
            let role = |name: &str| {
                v["replicas"].as_array().is_some_and(|r| {
                    r.iter().any(|r| r["name"] == name && (r["role"] == "leader" || r["role"] == "follower"))
                })
            };
            role(STREAM) && role(CACHE)
        })
    })
}

fn signal(node: &Node, s: &str) {
    let pid = node.proc.as_ref().expect("running").0.id().to_string();
    assert!(Command::new("kill").args([s, &pid]).status().unwrap().success());
}

/// For `hold`, what the brokers other than `target` say of the cluster, each time it changes
/// (`FELIX_CHAOS_TRACE`): the metadata leader they hear, whether they are fenced, the stream's
/// owner and the leader of its group as they see them.
fn trace_views(nodes: &[Node], target: usize, hold: Duration) {
    let t0 = Instant::now();
    let mut last = String::new();
    while t0.elapsed() < hold {
        let mut line = String::new();
        for (i, n) in nodes.iter().enumerate() {
            if i == target || n.proc.is_none() {
                continue;
            }
            let Some(v) = status(n.metrics) else {
                line.push_str(&format!(" {}: no status;", n.name));
                continue;
            };
            let owner = v["shards"]
                .as_array()
                .and_then(|r| r.iter().find(|r| r["name"] == STREAM))
                .map(|r| format!("{}@{}", r["owner"].as_str().unwrap_or("?"), r["generation"]));
            let replica = v["replicas"].as_array().and_then(|r| r.iter().find(|r| r["name"] == STREAM)).map(|r| {
                format!("{} {} t{}", r["role"].as_str().unwrap_or("?"), r["leader"].as_str().unwrap_or("-"), r["term"])
            });
            line.push_str(&format!(
                " {}: meta {} fenced {} owner {} replica {};",
                n.name,
                v["leader"].as_str().unwrap_or("-"),
                v["fenced"],
                owner.unwrap_or_default(),
                replica.unwrap_or_default()
            ));
        }
        if line != last {
            eprintln!("  +{:>5} ms{line}", t0.elapsed().as_millis());
            last = line;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Applies `kind` to the broker `target` for `hold`, then heals it.
fn apply(
    kind: Fault,
    nodes: &mut [Node],
    net: &FaultNet,
    peers: &BTreeMap<String, String>,
    target: usize,
    hold: Duration,
) {
    let name = nodes[target].name.clone();
    let other = (0..nodes.len()).find(|i| *i != target).unwrap();
    let hold_then = |f: &mut dyn FnMut()| {
        std::thread::sleep(hold);
        f();
    };
    match kind {
        Fault::Partition => {
            net.isolate(&name);
            hold_then(&mut || net.heal());
        }
        Fault::OneWayLoss => {
            for o in nodes.iter().filter(|o| o.name != name) {
                net.set(&name, &o.name, Link { blocked: true, ..Link::default() });
            }
            hold_then(&mut || net.heal());
        }
        Fault::LossyLinks => {
            net.set_all(Link { loss: 150, duplicate: 50, delay_ms: (0, 25), ..Link::default() });
            hold_then(&mut || net.heal());
        }
        Fault::Bridge => {
            let cut = nodes[other].name.clone();
            net.set(&name, &cut, Link { blocked: true, ..Link::default() });
            net.set(&cut, &name, Link { blocked: true, ..Link::default() });
            hold_then(&mut || net.heal());
        }
        Fault::Pause => {
            signal(&nodes[target], "-STOP");
            if std::env::var("FELIX_CHAOS_TRACE").is_ok() {
                trace_views(nodes, target, hold);
            } else {
                std::thread::sleep(hold);
            }
            signal(&nodes[target], "-CONT");
        }
        Fault::Kill => {
            nodes[target].kill();
            std::thread::sleep(hold);
            nodes[target].start(&peers[&name]);
        }
        Fault::PowerCut => {
            nodes[target].kill();
            let journal = nodes[target].journal.clone().expect("a journal");
            felix_driver_common::sync_journal::power_cut(&journal).expect("the power cut");
            std::thread::sleep(hold);
            nodes[target].start(&peers[&name]);
        }
        Fault::ClockJump => {
            // Stepped back an hour, or ahead ten minutes (the hold's parity picks), then right.
            let off = if hold.as_millis().is_multiple_of(2) { "-3600000" } else { "600000" };
            let env = (felix_driver_common::fault_clock::WALL_OFFSET_ENV.to_owned(), off.to_owned());
            nodes[target].kill();
            nodes[target].env.push(env.clone());
            nodes[target].start(&peers[&name]);
            // It leads the stream while its clock is off (the stream's leadership handed to it;
            // bounded: a move that cannot finish is given up).
            let metrics = nodes[other].metrics.to_string();
            let mut why = String::new();
            let moved = (0..5).any(|_| {
                if leading(nodes, STREAM) == Some(target) {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(500));
                let out = std::process::Command::new("timeout")
                    .arg("15")
                    .arg(BIN)
                    .args(["cluster", "move", STREAM, "0", "--to", &name, "--metrics", &metrics])
                    .args(["--cluster-secret", "s"])
                    .output();
                why = out.as_ref().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default();
                out.is_ok_and(|o| o.status.success())
            });
            if !moved {
                eprintln!("  (the stream's leadership did not move to {name}: {})", why.trim());
            }
            std::thread::sleep(hold);
            nodes[target].kill();
            nodes[target].env.retain(|e| *e != env);
            nodes[target].start(&peers[&name]);
        }
        Fault::CorruptFollower => {
            // A follower of the stream (the target may lead it).
            let lead = leading(nodes, STREAM);
            let f = (0..nodes.len()).find(|i| Some(*i) != lead).unwrap();
            let fname = nodes[f].name.clone();
            nodes[f].kill();
            flip_a_bit(&nodes[f]);
            std::thread::sleep(hold);
            nodes[f].start(&peers[&fname]);
        }
    }
}

/// The stream read back whole through the cluster: (offset, record), and the offsets whose
/// timestamp is older than the record's before them (timestamps never go back).
fn read_stream(brokers: &[SocketAddr], stream: &str) -> (Vec<(u64, String)>, Vec<u64>) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(brokers, opts()).await.expect("the reader connects");
        let mut out = Vec::new();
        let (mut back, mut last_ts) = (Vec::new(), 0);
        let mut from = 0;
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            match cc.stream_read("default", stream, 0, from, Some(10_000)).await {
                Ok(page) if page.records.is_empty() => break,
                Ok(page) => {
                    for r in page.records {
                        if r.timestamp_micros < last_ts {
                            back.push(r.offset);
                        }
                        last_ts = last_ts.max(r.timestamp_micros);
                        out.push((r.offset, String::from_utf8_lossy(&r.payload.0).into_owned()));
                    }
                    from = page.next_offset;
                }
                Err(e) => {
                    assert!(Instant::now() < until, "the stream is not readable: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        cc.close().await;
        (out, back)
    })
}

/// Each key's final value read through every broker, after everything healed: one more
/// operation per broker at the end of each key's history.
fn final_reads(brokers: &[SocketAddr], t0: Instant, keys: &[String]) -> Vec<(String, CacheOp)> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut out = Vec::new();
        for (i, addr) in brokers.iter().enumerate() {
            let c = Client::connect(*addr, opts()).await.expect("a final reader connects");
            for k in keys {
                let until = Instant::now() + Duration::from_secs(30);
                loop {
                    let invoked = elapsed(t0);
                    match c.cache_get_versioned("default", CACHE, k).await {
                        Ok((v, ver)) => {
                            let ret = CacheReturn::Value(v.map(|v| (String::from_utf8_lossy(&v).into_owned(), ver)));
                            let op = CacheOp {
                                client: 100 + i,
                                invoked,
                                answered: Some((elapsed(t0), ret)),
                                call: CacheCall::Get,
                            };
                            out.push((k.clone(), op));
                            break;
                        }
                        Err(e) => {
                            assert!(Instant::now() < until, "{k} is not readable through {addr}: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }
            let _ = c.close().await;
        }
        out
    })
}

/// Each broker's replica log of the stream, as its files hold it (read with the brokers
/// stopped).
fn replica_logs(nodes: &[Node]) -> Vec<ReplicaLog> {
    nodes
        .iter()
        .map(|n| {
            let dir = n.dir.join("cluster").join("replicas");
            let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.is_file() && p.file_name().unwrap().to_string_lossy().contains(&format!("~{STREAM}~")))
                .collect();
            files.sort();
            let datas: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
            let views: Vec<&[u8]> = datas.iter().map(Vec::as_slice).collect();
            let (log, _, damage) = felix_proto::cluster::meta::fold_log_segments_checked(&views);
            assert!(damage.is_none(), "{}: its replica log is damaged: {damage:?}", n.name);
            ReplicaLog {
                broker: n.name.clone(),
                entries: log.entries.iter().map(|e| (e.index, e.term, e.data.to_vec())).collect(),
                commit: log.hard_state.commit,
            }
        })
        .collect()
}

/// The records a replica's committed entries hold.
fn committed_records(log: &ReplicaLog) -> BTreeSet<String> {
    log.entries
        .iter()
        .filter(|e| e.0 <= log.commit && !e.2.is_empty())
        .filter_map(|e| felix_proto::cluster::replica::ReplicatedBatch::decode(&e.2).ok())
        .flat_map(|b| b.payloads())
        .map(|p| String::from_utf8_lossy(&p).into_owned())
        .collect()
}

/// Runs `episodes` faults (kinds in turn, holds and targets from `seed`) and checks the
/// history. Returns the report.
fn schedule(episodes: usize, seed: u64) -> String {
    // `FELIX_CHAOS_KINDS` (names, comma-separated) keeps only those kinds.
    let only = std::env::var("FELIX_CHAOS_KINDS").unwrap_or_default();
    let kinds: Vec<Fault> =
        KINDS.into_iter().filter(|k| only.is_empty() || only.split(',').any(|o| o == format!("{k:?}"))).collect();
    assert!(!kinds.is_empty(), "FELIX_CHAOS_KINDS names no kind of {KINDS:?}");
    let (_dirs, mut nodes, net, peers) = three_brokers_through_faults_with(seed, true);
    let clients: Vec<SocketAddr> = nodes.iter().map(|n| n.client).collect();
    let addrs = clients.iter().map(SocketAddr::to_string).collect::<Vec<_>>().join(",");
    let any_dir = nodes[0].dir.clone();
    // The stream and the cache exist before the workload starts.
    wait_for("the stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", STREAM, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the conditional stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", COND, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the jobs' stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", JOBS, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the committed stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", ACCOUNTS, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the cache is created", 60, || {
        cli(&addrs, &any_dir, &["cache", "put", CACHE, "warm", "up", "--close-timeout", "3s"]).0
    });
    wait_for("the cluster settles", 60, || settled(&nodes));
    let t0 = Instant::now();
    let load = Workload::start(clients.clone(), t0);
    wait_for("the workload is acknowledged", 60, || load.acks() >= 100);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9) | 1);
    let mut done = Vec::new();
    for ep in 0..episodes {
        load.episode.store(ep as u64, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(800));
        let kind = kinds[ep % kinds.len()];
        // Each kind is aimed at the stream's leader and the cache's in turn.
        let shard = if (ep % kinds.len() + ep / kinds.len()).is_multiple_of(2) { STREAM } else { CACHE };
        let mut target = None;
        wait_for("a leader to aim at", 60, || {
            target = leading(&nodes, shard);
            target.is_some()
        });
        let hold = Duration::from_millis(1500 + rng.below(3500));
        // A paused leader stays stopped 1 to 20 s (a VM stall, a long GC pause): the same draw,
        // spread wider.
        let hold = match kind {
            Fault::Pause => Duration::from_millis(1000 + (hold.as_millis() as u64 - 1500) * 19_000 / 3_500),
            _ => hold,
        };
        eprintln!("episode {ep}: {kind:?} on {} (leads {shard}) for {hold:?}", nodes[target.unwrap()].name);
        let began = Instant::now();
        apply(kind, &mut nodes, &net, &peers, target.unwrap(), hold);
        let healed = Instant::now();
        let before = load.acks();
        wait_for("a publish is acknowledged after the heal", 90, || load.acks() > before);
        let first = load.history.lock().unwrap().ack_times.iter().filter(|t| **t > healed).min().copied();
        wait_for("the cluster settles after the heal", 120, || settled(&nodes));
        let longest_gap = {
            let h = load.history.lock().unwrap();
            let mut times: Vec<Instant> = h.ack_times.iter().filter(|t| **t > began).copied().collect();
            times.sort();
            std::iter::once(began).chain(times).collect::<Vec<_>>().windows(2).map(|w| w[1] - w[0]).max()
        };
        let e = Episode {
            kind,
            unavailable_after_heal: first.map(|t| t - healed).unwrap_or_default(),
            longest_gap: longest_gap.unwrap_or_default(),
        };
        // Each episode's own figures, so that a worst case in the summary can be traced to its
        // fault and target.
        eprintln!("  healed in {:.0?}, longest stretch without an ack {:.0?}", e.unavailable_after_heal, e.longest_gap);
        done.push(e);
    }
    net.heal();
    std::thread::sleep(Duration::from_secs(1));
    let h = load.finish();
    let h = Mutex::new(h);
    let dead = drain_group(&clients, t0, &h);
    let mut h = h.into_inner().unwrap();
    // Dead letters are settled (by the group, after five lapsed claims).
    h.group.ack_unknown.extend(dead.iter().copied());
    // The final word: the streams read back, each key read through every broker.
    let (log, back) = read_stream(&clients, STREAM);
    let (cond_log, cond_back) = read_stream(&clients, COND);
    let (jobs_log, jobs_back) = read_stream(&clients, JOBS);
    let (accounts_log, accounts_back) = read_stream(&clients, ACCOUNTS);
    let times_back = back.len() + cond_back.len() + jobs_back.len() + accounts_back.len();
    let state = read_state(&clients);
    let keys: Vec<String> = h.cache.keys().cloned().collect();
    let mut cache = h.cache.clone();
    for (k, op) in final_reads(&clients, t0, &keys) {
        cache.entry(k).or_default().push(op);
    }
    // Let followers apply what the leader committed last, then stop every broker and read its
    // files.
    std::thread::sleep(Duration::from_secs(2));
    for n in &mut nodes {
        n.kill();
    }
    let replicas = replica_logs(&nodes);

    // The verdicts.
    let mut unknown = h.unknown.clone();
    unknown.insert("first".into());
    let stream = check_stream(&log, &h.acked, &unknown);
    let subscriber = check_subscriber(&h.seen, &log);
    let mut cond_unknown = h.cond_unknown.clone();
    cond_unknown.insert("first".into());
    let cond = check_stream(&cond_log, &h.cond_acked, &cond_unknown);
    let mut jobs_unknown = h.jobs_unknown.clone();
    jobs_unknown.insert("first".into());
    let jobs = check_stream(&jobs_log, &h.jobs_acked, &jobs_unknown);
    let group = check_group(&jobs_log, &h.group);
    let mut commits_unknown = h.commits_unknown.clone();
    commits_unknown.insert("first".into());
    let commits = check_stream(&accounts_log, &h.commits_acked, &commits_unknown);
    // The state is the last commit's, at its offset: event and state went together.
    let last_commit = accounts_log.iter().rev().find(|(_, p)| p.starts_with("commit-"));
    let state_ok = state == (last_commit.map(|(_, p)| p.clone()), last_commit.map(|(o, _)| *o));
    let diverged = divergent(&replicas);
    let mut missing_on_disk = Vec::new();
    for r in &replicas {
        let held = committed_records(r);
        let missing = h.acked.iter().filter(|(p, _)| !held.contains(p)).count();
        if missing > 0 {
            missing_on_disk.push(format!("{}: {missing} acknowledged records not in its committed log", r.broker));
        }
    }
    let mut stale = Vec::new();
    let mut ops = 0;
    for (k, history) in &cache {
        ops += history.len();
        if let Err(why) = linearizable(history) {
            stale.push(format!("{k}: {why}"));
        }
    }
    let mut by_kind: BTreeMap<Fault, (Vec<Duration>, Vec<Duration>)> = BTreeMap::new();
    for e in &done {
        let k = by_kind.entry(e.kind).or_default();
        k.0.push(e.unavailable_after_heal);
        k.1.push(e.longest_gap);
    }
    let mut report = format!(
        "{} episodes; {} records acknowledged, {} unknown; lost {}, duplicated {}, misplaced {}, phantom {}; \
         subscriber saw {} with {} faults; {} divergent indexes; {} not on every replica's disk; \
         cache: {} keys, {} operations ({} answered, {} refused), {} keys not linearizable; \
         conditional appends: {} acknowledged, {} unknown, {} not at their offset, clean: {}; \
         jobs: {} acknowledged, {} unknown, clean: {}; group: {} handed out, {} acks ({} unknown), \
         {} dead letters, {} polls failed, {} handed out after their ack, {} never settled, {} phantom; \
         {} records older than the one before; commits: {} acknowledged, {} unknown, clean: {}, \
         state is the last commit's: {}\n",
        done.len(),
        h.acked.len(),
        h.unknown.len(),
        stream.lost.len(),
        stream.duplicated.len(),
        stream.misplaced.len(),
        stream.phantom.len(),
        h.seen.len(),
        subscriber.len(),
        diverged.len(),
        missing_on_disk.len(),
        cache.len(),
        ops,
        h.cache_answered,
        h.cache_refused,
        stale.len(),
        h.cond_acked.len(),
        h.cond_unknown.len(),
        h.cond_misplaced.len(),
        cond.is_clean(),
        h.jobs_acked.len(),
        h.jobs_unknown.len(),
        jobs.is_clean(),
        h.group.delivered.len(),
        h.group.acked.len(),
        h.group.ack_unknown.len() - dead.len().min(h.group.ack_unknown.len()),
        dead.len(),
        h.polls_failed,
        group.redelivered.len(),
        group.lost.len(),
        group.phantom.len(),
        times_back,
        h.commits_acked.len(),
        h.commits_unknown.len(),
        commits.is_clean(),
        state_ok,
    );
    for (kind, (after, gaps)) in &mut by_kind {
        after.sort();
        gaps.sort();
        report.push_str(&format!(
            "  {kind:?}: {} episodes; heal to the next acknowledged write: median {:.0?}, worst {:.0?}; \
             longest stretch without one from the fault's start: median {:.0?}, worst {:.0?}\n",
            after.len(),
            after[after.len() / 2],
            after[after.len() - 1],
            gaps[gaps.len() / 2],
            gaps[gaps.len() - 1]
        ));
    }
    eprintln!("{report}");
    assert!(stream.is_clean(), "the stream: {stream:?}");
    assert!(cond.is_clean() && h.cond_misplaced.is_empty(), "conditional appends: {cond:?} {:?}", h.cond_misplaced);
    assert!(subscriber.is_empty(), "the subscriber: {:?}", &subscriber[..subscriber.len().min(10)]);
    assert!(jobs.is_clean(), "the jobs: {jobs:?}");
    assert!(commits.is_clean(), "the commits: {commits:?}");
    assert!(state_ok, "the state {state:?} is not the last commit's {last_commit:?}");
    assert!(times_back == 0, "timestamps go back at {back:?} {cond_back:?} {jobs_back:?}");
    assert!(group.is_clean(), "the consumer group: {group:?}");
    assert!(diverged.is_empty(), "replicas diverge: {diverged:?}");
    assert!(missing_on_disk.is_empty(), "{missing_on_disk:?}");
    assert!(stale.is_empty(), "not linearizable: {}", stale.join("\n"));
    report
}

/// Two episodes of each kind of fault (CI).
#[test]
fn a_short_fault_schedule_loses_doubles_and_reads_nothing_stale() {
    // Each kind twice: once at the stream's leader, once at the cache's.
    schedule(2 * KINDS.len(), 1);
}

/// The long schedule: `FELIX_CHAOS_EPISODES` episodes (default 200), `FELIX_CHAOS_SEED`.
#[test]
#[ignore = "long: about a minute per eight episodes; run by hand and reported"]
fn a_long_fault_schedule_loses_doubles_and_reads_nothing_stale() {
    let n = std::env::var("FELIX_CHAOS_EPISODES").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let seed = std::env::var("FELIX_CHAOS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
    schedule(n, seed);
}
