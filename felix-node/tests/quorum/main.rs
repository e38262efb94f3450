//! A replicated (`quorum`) stream on three `felix-node serve` processes: acknowledged publishes
//! through the cluster (a full-speed publisher on the Rust cluster client throughout, and CLI
//! publishes between the kills) while the shard's leader is killed with SIGKILL again and again
//! (and restarted from its data directory each time). Afterwards every acknowledged record is in
//! the stream exactly once and in order, nothing is written twice, and the killed brokers caught
//! up.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_driver_tokio::{ClientError, ClientOptions, ClusterClient, PublishOptions, Trust};
use felix_proto::error_code::RetryClass;

#[path = "../common/mod.rs"]
mod common;
use common::brokers::*;
use common::faultnet::{FaultNet, Link};
use common::{cluster_status as status, wait_for};

mod kills_and_power_cuts;
mod replicas;
use replicas::*;
mod faults;
mod scale;

/// A full-speed acked publisher on the ledger of three brokers, started once a CLI publish
/// created it.
struct Load {
    stop: Arc<AtomicBool>,
    acks: Arc<std::sync::Mutex<Vec<Instant>>>,
    fast: std::thread::JoinHandle<FastOutcome>,
}

impl Load {
    fn start(nodes: &[Node], lanes: usize) -> Load {
        let addrs = nodes.iter().map(|n| n.client.to_string()).collect::<Vec<_>>().join(",");
        let dir = nodes[0].dir.clone();
        wait_for("the ledger is created", 60, || {
            cli(&addrs, &dir, &["publish", "ledger", "first", "--ack", "--close-timeout", "3s"]).0
        });
        let stop = Arc::new(AtomicBool::new(false));
        let acks = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
        let fast = fast_publisher(nodes.iter().map(|n| n.client).collect(), lanes, stop.clone(), acks.clone());
        Load { stop, acks, fast }
    }

    /// Acknowledgements so far.
    fn count(&self) -> usize {
        self.acks.lock().unwrap().len()
    }

    /// Waits (at most 60 s) for `n` more acknowledgements than `from`.
    fn wait_acks(&self, what: &str, from: usize, n: usize) {
        wait_for(what, 60, || self.count() >= from + n);
    }

    /// The longest stretch without an acknowledgement from `since` to the last one.
    fn longest_gap(&self, since: Instant) -> Duration {
        let mut times: Vec<Instant> = self.acks.lock().unwrap().iter().filter(|t| **t > since).copied().collect();
        times.sort();
        std::iter::once(since)
            .chain(times)
            .collect::<Vec<_>>()
            .windows(2)
            .map(|w| w[1] - w[0])
            .max()
            .unwrap_or_default()
    }

    /// Stops the publisher: what it sent, none refused as fatal.
    fn finish(self) -> FastOutcome {
        self.stop.store(true, Ordering::Relaxed);
        let fast = self.fast.join().expect("the publisher");
        assert!(fast.fatal.is_empty(), "{:?}", fast.fatal);
        fast
    }
}

/// Waits (at most 30 s) for the ledger to have a leader; its index in `nodes`.
fn leader_index(nodes: &[Node]) -> usize {
    let mut lead = None;
    wait_for("a leader", 30, || {
        lead = leader(nodes);
        lead.is_some()
    });
    nodes.iter().position(|n| Some(&n.name) == lead.as_ref()).expect("a broker of ours leads")
}

/// Whether `n`'s own replica of the ledger has `role` (`leader`, `follower`).
fn ledger_role_is(n: &Node, role: &str) -> bool {
    status(n.metrics).is_some_and(|v| {
        v["replicas"].as_array().is_some_and(|r| r.iter().any(|r| r["name"] == "ledger" && r["role"] == role))
    })
}

/// Reads the ledger back from any live broker (waiting up to 60 s for every acknowledged
/// record) and checks it: every record in `acked` present, none twice, none that was never
/// sent (only `acked`, `unknown` and the first CLI record were).
fn check_ledger(nodes: &[Node], dir: &Path, acked: &[String], unknown: &[String]) {
    let mut records = Vec::new();
    wait_for("every acknowledged record is read back", 60, || {
        let Some(out) = nodes.iter().filter(|n| n.proc.is_some()).find_map(|n| {
            let (ok, out, _) = cli(&n.client.to_string(), dir, &["read", "ledger", "--from", "0", "--json"]);
            ok.then_some(out)
        }) else {
            return false;
        };
        records = out
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| v["payload"].as_str().map(str::to_owned))
            .collect();
        let have: std::collections::BTreeSet<&String> = records.iter().collect();
        acked.iter().all(|a| have.contains(a))
    });
    let mut seen = std::collections::BTreeSet::new();
    for r in &records {
        assert!(seen.insert(r), "{r} is in the ledger twice");
        assert!(r == "first" || acked.contains(r) || unknown.contains(r), "{r} is in the ledger but was never sent");
    }
}

/// What [`under_a_fault`] saw.
struct FaultRun {
    acked: usize,
    /// Acknowledgements per second before the fault, during it, and after it healed.
    rates: [f64; 3],
    /// The longest stretch without an acknowledgement, from the fault's start to the end.
    longest_gap: Duration,
    /// Peer datagrams forwarded, dropped and duplicated by the fault network.
    datagrams: (u64, u64, u64),
}

/// Three brokers behind a fault network, a full-speed acked publisher (8 lanes) throughout:
/// `fault` is applied (given the network and the ledger leader's name) for `hold`, then healed.
/// Afterwards every acknowledged record is in the ledger exactly once and nothing never sent
/// is; the broker that led when the fault began is checked to follow a leader once healed when
/// `deposes` says the fault must have replaced it. `FELIX_FAULT_DEBUG=1` prints every broker's
/// view at the end of the fault and every slow or refused publish.
fn under_a_fault(seed: u64, hold: Duration, deposes: bool, fault: impl FnOnce(&FaultNet, &str)) -> FaultRun {
    let (_dirs, nodes, net) = three_brokers_through_faults(seed);
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    let count = || load.count();
    let started = Instant::now();
    load.wait_acks("the publisher is acknowledged", 0, 300);
    let old = leader_index(&nodes);
    let lead = nodes[old].name.clone();
    let began = Instant::now();
    let before = count();
    fault(&net, &lead);
    if deposes {
        let others: Vec<usize> = (0..3).filter(|i| *i != old).collect();
        wait_for("another broker leads", 30, || others.iter().any(|i| ledger_role_is(&nodes[*i], "leader")));
    }
    while began.elapsed() < hold {
        std::thread::sleep(Duration::from_millis(100));
    }
    if std::env::var_os("FELIX_FAULT_DEBUG").is_some() {
        for n in &nodes {
            if let Some(v) = status(n.metrics) {
                eprintln!("{}: leader {} fenced {} replicas {}", n.name, v["leader"], v["fenced"], v["replicas"]);
            }
        }
    }
    let during = count() - before;
    net.heal();
    let healed = Instant::now();
    if deposes {
        wait_for("the old leader follows once healed", 60, || ledger_role_is(&nodes[old], "follower"));
    }
    let after_heal = count();
    wait_for("acknowledged again after the heal", 60, || count() >= after_heal + 300);
    let after = count() - after_heal;
    let after_secs = healed.elapsed().as_secs_f64();
    let longest_gap = load.longest_gap(began);
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    check_ledger(&nodes, &any_dir, &acked, &fast.unknown);
    let c = &net.counts;
    FaultRun {
        acked: acked.len(),
        rates: [
            before as f64 / began.duration_since(started).as_secs_f64(),
            during as f64 / hold.as_secs_f64(),
            after as f64 / after_secs,
        ],
        longest_gap,
        datagrams: (
            c.forwarded.load(Ordering::Relaxed),
            c.dropped.load(Ordering::Relaxed),
            c.duplicated.load(Ordering::Relaxed),
        ),
    }
}

/// The ledger's leader is cut off from both other brokers for 8 s (clients still reach it):
/// the other two elect a leader and take the writes; the cut-off one acknowledges nothing it
/// could not commit (anything it did would be missing afterwards), and follows once healed.
#[test]
fn a_partitioned_leader_is_replaced_acknowledges_nothing_it_cannot_commit_and_follows_once_healed() {
    let r = under_a_fault(1, Duration::from_secs(8), true, |net, leader| net.isolate(leader));
    eprintln!(
        "partitioned leader: {} acknowledged, none lost or doubled; rates before/during/after {:.0?}/s; \
         longest stretch without an ack {:?}; datagrams forwarded/dropped {:?}",
        r.acked, r.rates, r.longest_gap, r.datagrams
    );
    assert!(
        r.longest_gap < Duration::from_secs(5),
        "no write acknowledged for {:?} of an 8 s partition",
        r.longest_gap
    );
}

/// One way only: the leader's datagrams to both others are dropped while theirs reach it.
/// They stop hearing it and elect another; it hears the new term and steps down.
#[test]
fn a_leader_whose_outgoing_traffic_is_lost_one_way_is_replaced_with_nothing_lost_or_doubled() {
    let r = under_a_fault(2, Duration::from_secs(8), true, |net, leader| {
        for o in ["n1", "n2", "n3"].into_iter().filter(|o| *o != leader) {
            net.set(leader, o, Link { blocked: true, ..Link::default() });
        }
    });
    eprintln!(
        "one-way loss from the leader: {} acknowledged, none lost or doubled; rates {:.0?}/s; longest stretch without an ack {:?}",
        r.acked, r.rates, r.longest_gap
    );
    // A deposed leader that learns the new one from its appends before it fences itself
    // forwards the publishers' batches over the dead direction; they are answered outcome
    // unknown once its peer connection times out (2 s), not after the 10 s forward timeout
    // (it stalled 11 s in one run of four before that).
    assert!(r.longest_gap < Duration::from_secs(8), "no write acknowledged for {:?} of an 8 s fault", r.longest_gap);
}

/// Every peer link at once drops 5 % of datagrams, duplicates 5 % and delays each 0–20 ms
/// (so reorders them) for 10 s under load: writes go on, nothing is lost or written twice.
#[test]
fn lossy_duplicating_reordering_peer_links_lose_and_double_nothing() {
    let bad = Link { blocked: false, loss: 50, duplicate: 50, delay_ms: (0, 20) };
    let r = under_a_fault(3, Duration::from_secs(10), false, |net, _| net.set_all(bad));
    eprintln!(
        "lossy links: {} acknowledged, none lost or doubled; rates {:.0?}/s; datagrams forwarded/dropped/duplicated {:?}",
        r.acked, r.rates, r.datagrams
    );
    assert!(r.datagrams.1 > 100 && r.datagrams.2 > 100, "the faults happened: {:?}", r.datagrams);
    assert!(r.rates[1] > 0.0, "no write acknowledged on lossy links");
}

/// What the full-speed publisher's lanes did.
#[derive(Default)]
struct FastOutcome {
    /// Each lane's acknowledged records, in the order it published them.
    acked: Vec<Vec<String>>,
    /// Records whose outcome is unknown (in flight when their leader died or was deposed).
    unknown: Vec<String>,
    /// Refusals that say retrying cannot help (there must be none).
    fatal: Vec<String>,
}

/// An acknowledged publisher at full speed through the Rust cluster client: `lanes` tasks,
/// each publishing its own numbered records one after another as fast as they are
/// acknowledged, until `stop`. A record refused before it was written is sent again; one whose
/// outcome is unknown is noted and the lane goes on with the next (a plain producer never
/// resends what may have been written).
fn fast_publisher(
    seeds: Vec<SocketAddr>,
    lanes: usize,
    stop: Arc<AtomicBool>,
    acks: Arc<std::sync::Mutex<Vec<Instant>>>,
) -> std::thread::JoinHandle<FastOutcome> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
        rt.block_on(async move {
            let opts = ClientOptions::new("default", TOKEN, Trust::DangerAcceptAnyCertificate);
            let client = Arc::new(ClusterClient::connect(&seeds, opts).await.expect("the publisher connects"));
            let mut tasks = Vec::new();
            for lane in 0..lanes {
                let (client, stop, acks) = (client.clone(), stop.clone(), acks.clone());
                tasks.push(tokio::spawn(async move {
                    let (mut acked, mut unknown, mut fatal) = (Vec::new(), Vec::new(), Vec::new());
                    let mut n = 0u64;
                    'records: while !stop.load(Ordering::Relaxed) {
                        let p = format!("fast-{lane}-{n}");
                        n += 1;
                        loop {
                            let ack = PublishOptions { ack: true, ..PublishOptions::default() };
                            let t0 = Instant::now();
                            let r = client.publish("default", "ledger", vec![Bytes::from(p.clone())], ack).await;
                            if std::env::var_os("FELIX_FAULT_DEBUG").is_some() && t0.elapsed() > Duration::from_secs(1)
                            {
                                eprintln!(
                                    "lane {lane}: a publish took {:?}: {:?}",
                                    t0.elapsed(),
                                    r.as_ref().map(|_| ())
                                );
                            }
                            match r {
                                Ok(_) => {
                                    acks.lock().unwrap().push(Instant::now());
                                    acked.push(p)
                                }
                                Err(e) if not_written(&e) => {
                                    if std::env::var_os("FELIX_FAULT_DEBUG").is_some() {
                                        eprintln!("lane {lane}: {e}");
                                    }
                                    if stop.load(Ordering::Relaxed) {
                                        break 'records;
                                    }
                                    tokio::time::sleep(Duration::from_millis(20)).await;
                                    continue;
                                }
                                Err(ClientError::Refused(i)) if i.retry == Some(RetryClass::Fatal) => {
                                    fatal.push(format!("{p}: {}", i.message))
                                }
                                Err(e) => {
                                    if std::env::var_os("FELIX_FAULT_DEBUG").is_some() {
                                        eprintln!("lane {lane}: unknown: {e}");
                                    }
                                    unknown.push(p)
                                }
                            }
                            break;
                        }
                    }
                    (acked, unknown, fatal)
                }));
            }
            let mut out = FastOutcome::default();
            for t in tasks {
                let (a, u, f) = t.await.expect("a publisher lane");
                out.acked.push(a);
                out.unknown.extend(u);
                out.fatal.extend(f);
            }
            client.close().await;
            out
        })
    })
}
