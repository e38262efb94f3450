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

mod common;
use common::brokers::*;
use common::faultnet::{FaultNet, Link};
use common::{cluster_status as status, wait_for};

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

fn kill_loop(kills: usize, per_round: usize, idempotent_lines: usize) {
    let (_dirs, mut nodes, peers) = three_brokers();
    let addrs = nodes.iter().map(|n| n.client.to_string()).collect::<Vec<_>>().join(",");
    let any_dir = nodes[0].dir.clone();
    let metrics: Vec<SocketAddr> = nodes.iter().map(|n| n.metrics).collect();
    // Publishes one record, retrying refusals (nothing was written) until it is acknowledged
    // (`Ok(true)`) or its outcome is unknown (`Ok(false)`: the broker died or was deposed with it
    // in flight; never retried, it is a plain producer).
    let publish = |payload: &str| -> bool {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let (ok, _, err) = cli(&addrs, &any_dir, &["publish", "ledger", payload, "--ack", "--close-timeout", "3s"]);
            if ok {
                return true;
            }
            let refused = refused_before_writing(&err);
            if !refused {
                return false;
            }
            if Instant::now() >= until {
                let seen: Vec<String> = metrics
                    .iter()
                    .filter_map(|m| status(*m))
                    .map(|v| format!("{} replicas {} shards {}", v["node_id"], v["replicas"], v["shards"]))
                    .collect();
                panic!("no broker took {payload} for 30 s: {err}\n{}", seen.join("\n"));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    let mut acked: Vec<String> = Vec::new();
    let mut unknown: Vec<String> = Vec::new();
    // The first record creates the stream; then a subscriber from the start follows every
    // fail-over (the CLI resumes after the last event it printed).
    assert!(publish("rec-first"), "the first record is acknowledged");
    acked.push("rec-first".into());
    let mut subscriber = Command::new(BIN)
        .env("FELIX_ADDR", &addrs)
        .env("FELIX_DATA_DIR", &any_dir)
        .env("FELIX_TOKEN", TOKEN)
        .args(["subscribe", "ledger", "--from", "earliest", "--json", "--insecure-accept-any-certificate"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let printed = std::sync::Arc::new(std::sync::Mutex::new(Vec::<(u64, String)>::new()));
    {
        let printed = printed.clone();
        let out = subscriber.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line)
                    && let (Some(o), Some(p)) = (v["offset"].as_u64(), v["payload"].as_str())
                {
                    printed.lock().unwrap().push((o, p.to_owned()));
                }
            }
        });
    }
    let subscriber = Proc(subscriber);
    // The acknowledged publisher at full speed, running through every kill.
    let stop = Arc::new(AtomicBool::new(false));
    let fast_started = Instant::now();
    let fast_acks = Arc::new(std::sync::Mutex::new(Vec::<Instant>::new()));
    let fast = fast_publisher(nodes.iter().map(|n| n.client).collect(), 4, stop.clone(), fast_acks.clone());
    let mut kill_times: Vec<Instant> = Vec::new();
    let mut failovers: Vec<Duration> = Vec::new();
    let mut elections: Vec<Duration> = Vec::new();
    let mut i = 0;
    for round in 0..=kills {
        for _ in 0..per_round {
            let p = format!("rec-{i}");
            i += 1;
            if publish(&p) { acked.push(p) } else { unknown.push(p) }
        }
        if round == kills {
            break;
        }
        // Each kill lands while the full-speed publisher is being acknowledged.
        let before = fast_acks.lock().unwrap().len();
        wait_for("the full-speed publisher is acknowledged", 30, || fast_acks.lock().unwrap().len() >= before + 100);
        let mut who = None;
        wait_for("the ledger's leader is known", 30, || {
            who = leader(&nodes);
            who.is_some()
        });
        let who = who.unwrap();
        let victim = nodes.iter().position(|n| n.name == who).unwrap();
        let killed = Instant::now();
        kill_times.push(killed);
        nodes[victim].kill();
        // The shard's fail-over proper: a survivor's replica leads (its generation start
        // committed), polled on the survivors' status.
        wait_for("a survivor leads the ledger", 30, || {
            nodes.iter().filter(|n| n.proc.is_some()).filter_map(|n| status(n.metrics)).any(|v| {
                v["replicas"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r["name"] == "ledger" && r["role"] == "leader"))
            })
        });
        elections.push(killed.elapsed());
        // Fail-over: the first acknowledged write after the kill (a write in flight to the
        // dead leader ends outcome unknown; the next one is a new record).
        loop {
            let p = format!("rec-{i}");
            i += 1;
            if publish(&p) {
                failovers.push(killed.elapsed());
                acked.push(p);
                break;
            }
            unknown.push(p);
            assert!(killed.elapsed() < Duration::from_secs(60), "no write acknowledged within 60 s of the kill");
        }
        nodes[victim].start(&peers);
        // The next kill only once the restarted broker follows again and has caught up (so
        // each kill is a fail-over with a healthy majority, not an outage).
        let back = nodes[victim].name.clone();
        wait_for("the restarted broker caught up", 60, || {
            nodes.iter().filter(|n| n.name != back).filter_map(|n| status(n.metrics)).any(|v| {
                v["replicas"].as_array().is_some_and(|r| {
                    r.iter().any(|r| {
                        r["name"] == "ledger"
                            && r["role"] == "leader"
                            && r["followers"].as_array().is_some_and(|f| {
                                f.iter()
                                    .any(|f| f["node_id"] == back.as_str() && f["lag"].as_u64().is_some_and(|l| l < 64))
                            })
                    })
                })
            })
        });
    }
    // The long-lived publisher's own fail-over after the last kill may still be under way (a
    // batch in flight to the killed leader ends only when its connection is given up): the
    // last round's CLI publishes can be quicker. Wait for it (bounded) before stopping it, so
    // the check below counts every kill; how long it took is checked there.
    if let Some(last) = kill_times.last().copied() {
        wait_for("the full-speed publisher is acknowledged after the last kill", 30, || {
            fast_acks.lock().unwrap().iter().any(|a| *a > last)
        });
    }
    stop.store(true, Ordering::Relaxed);
    let fast = fast.join().expect("the full-speed publisher");
    let fast_secs = fast_started.elapsed().as_secs_f64();
    // The long-lived client's fail-over: from each kill to its next acknowledged record.
    let mut fast_failovers: Vec<Duration> = {
        let acks = fast_acks.lock().unwrap();
        kill_times.iter().filter_map(|k| acks.iter().find(|a| *a > k).map(|a| *a - *k)).collect()
    };
    fast_failovers.sort();
    assert!(fast.fatal.is_empty(), "refusals no retry can cure: {:?}", fast.fatal);
    let fast_acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    assert!(
        fast.acked.iter().all(|lane| lane.len() > 10),
        "every lane of the full-speed publisher had records acknowledged: {:?}",
        fast.acked.iter().map(Vec::len).collect::<Vec<_>>()
    );
    // An idempotent producer through the cluster while the leader is killed under it: every
    // batch it sent is appended exactly once (it goes to the new leader and resends the
    // unanswered ones under their sequences).
    let lines: Vec<String> = (0..idempotent_lines).map(|k| format!("idem-{k}")).collect();
    let mut idem = None;
    if idempotent_lines > 0 {
        // Its records come on standard input over about six seconds, so the kill, once some
        // committed, lands while it publishes.
        let mut child = Command::new(BIN)
            .env("FELIX_ADDR", &addrs)
            .env("FELIX_DATA_DIR", &any_dir)
            .env("FELIX_TOKEN", TOKEN)
            .args(["publish", "ledger", "--idempotent", "--insecure-accept-any-certificate"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut stdin = child.stdin.take().unwrap();
        let feed = lines.clone();
        let writer = std::thread::spawn(move || {
            use std::io::Write;
            let chunk = feed.len().div_ceil(60).max(1);
            for part in feed.chunks(chunk) {
                if stdin.write_all((part.join("\n") + "\n").as_bytes()).is_err() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        });
        // Killed once the leader committed some of its records (and long before the last).
        // The leader is looked up at each poll: a settled group hands its leadership back to
        // its preferred replica meanwhile, so the broker that led at first may not lead now.
        let bound = |v: &serde_json::Value| {
            v["replicas"].as_array()?.iter().find(|r| r["name"] == "ledger" && r["role"] == "leader")?["next_offset"]
                .as_u64()
        };
        let leading_bound = |nodes: &[Node]| {
            let who = leader(nodes)?;
            let m = nodes.iter().find(|n| n.name == who)?.metrics;
            Some((who, status(m).as_ref().and_then(bound)?))
        };
        let (_, start) = leading_bound(&nodes).expect("the leader's readable bound");
        wait_for("the idempotent producer is under way", 30, || {
            leading_bound(&nodes).is_some_and(|(_, o)| o > start + 100)
        });
        let (who, at_kill) =
            leading_bound(&nodes).map_or((leader(&nodes).expect("a leader"), None), |(w, o)| (w, Some(o)));
        let victim = nodes.iter().position(|n| n.name == who).unwrap();
        eprintln!("killing {who} at readable bound {at_kill:?} (the producer started at {start})");
        nodes[victim].kill();
        writer.join().unwrap();
        // Bounded: a producer that never ends fails the test (its stderr read beside it; the
        // guard kills it either way).
        let mut child = Proc(child);
        let mut stderr = child.0.stderr.take().unwrap();
        let said = std::thread::spawn(move || {
            let mut s = String::new();
            let _ = std::io::Read::read_to_string(&mut stderr, &mut s);
            s
        });
        let mut status = None;
        wait_for("the idempotent producer finished", 120, || {
            status = child.0.try_wait().unwrap();
            status.is_some()
        });
        let said = said.join().unwrap();
        assert!(status.is_some_and(|s| s.success()), "the idempotent producer failed: {said}");
        nodes[victim].start(&peers);
        idem = Some(said);
    }
    // Everything, read back through the cluster from the start.
    let mut records: Vec<String> = Vec::new();
    let mut offsets: std::collections::BTreeMap<String, u64> = Default::default();
    wait_for("the whole ledger is readable", 60, || {
        // Through any broker (a follower redirects to the leader).
        let Some(out) = nodes.iter().find_map(|n| {
            let (ok, out, _) = cli(&n.client.to_string(), &any_dir, &["read", "ledger", "--from", "0", "--json"]);
            ok.then_some(out)
        }) else {
            return false;
        };
        let parsed: Vec<(u64, String)> = out
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| Some((v["offset"].as_u64()?, v["payload"].as_str()?.to_owned())))
            .collect();
        records = parsed.iter().map(|(_, p)| p.clone()).collect();
        offsets = parsed.into_iter().map(|(o, p)| (p, o)).collect();
        let have: std::collections::BTreeSet<&String> = records.iter().collect();
        acked.iter().chain(&fast_acked).chain(&lines).all(|a| have.contains(a))
    });
    let mut seen = std::collections::BTreeSet::new();
    for r in &records {
        assert!(seen.insert(r.clone()), "{r} is in the ledger twice");
        assert!(
            acked.contains(r) || unknown.contains(r) || lines.contains(r) || r.starts_with("fast-"),
            "{r} was never published"
        );
    }
    // Of the full-speed publisher's records: each acknowledged one is there (above) and once,
    // each lane's in the order it published them; none but acknowledged or unknown ones.
    let fast_known: std::collections::BTreeSet<&String> = fast_acked.iter().chain(&fast.unknown).collect();
    for r in records.iter().filter(|r| r.starts_with("fast-")) {
        assert!(fast_known.contains(r), "{r} is in the ledger but was never sent, or was refused");
    }
    for lane in &fast.acked {
        let at: Vec<u64> = lane.iter().map(|r| offsets[r]).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "a lane's acknowledged records are out of order");
    }
    if !lines.is_empty() {
        // In the order they were fed (the order of their sequences: a replicated shard
        // refuses a batch ahead of its turn, on every replica alike), and a generation start
        // among them shows the leader was killed while the producer ran.
        let at: Vec<u64> = lines.iter().map(|l| offsets[l]).collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "the idempotent records are out of sequence order");
        let (lo, hi) = (at[0], at[at.len() - 1]);
        eprintln!("idempotent records at offsets {lo}..={hi}");
        assert!(
            hi - lo + 1 > lines.len() as u64,
            "a leader was killed while the idempotent producer ran (a generation start among its records)"
        );
    }
    let positions: Vec<usize> = acked.iter().map(|a| records.iter().position(|r| r == a).unwrap()).collect();
    assert!(positions.windows(2).all(|w| w[0] < w[1]), "acknowledged records out of order");
    // The subscriber saw the ledger exactly as it is: every record once, in offset order,
    // across every fail-over.
    wait_for("the subscriber printed the whole ledger", 60, || printed.lock().unwrap().len() >= records.len());
    drop(subscriber);
    let printed = printed.lock().unwrap().clone();
    assert!(printed.windows(2).all(|w| w[0].0 < w[1].0), "offsets only grow: {printed:?}");
    let seen: Vec<String> = printed.iter().map(|(_, p)| p.clone()).collect();
    assert_eq!(seen, records, "the subscriber saw every record once, in order");
    // `cluster status` on the leader shows its replica leading, every replica caught up. The
    // leader is looked up at each poll: once the restarted broker caught up the settled group
    // hands its leadership to its preferred replica, which may be that broker.
    wait_for("every replica caught up, as the leader's status says", 30, || {
        let Some(m) = leader(&nodes).and_then(|lead| nodes.iter().find(|n| n.name == lead)).map(|n| n.metrics) else {
            return false;
        };
        let out = Command::new(BIN).args(["cluster", "status", "--metrics", &m.to_string()]).output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines().any(|l| l.contains("default/default/ledger 0: leader") && l.matches(" lag 0").count() == 3)
    });
    failovers.sort();
    elections.sort();
    if let Some(said) = &idem {
        eprintln!("idempotent producer across a kill: {}", said.lines().last().unwrap_or(""));
    }
    eprintln!(
        "full-speed publisher: {} acknowledged in {fast_secs:.1} s ({:.0}/s), {} outcome unknown; its next acknowledgement after a kill: median {:?}, worst {:?}",
        fast_acked.len(),
        fast_acked.len() as f64 / fast_secs,
        fast.unknown.len(),
        fast_failovers.get(fast_failovers.len() / 2),
        fast_failovers.last()
    );
    eprintln!(
        "{kills} kills: {} acknowledged, {} outcome unknown, {} in the ledger; a new leader serving after median {:?}, worst {:?}; first acknowledged write through the CLI after median {:?}, worst {:?}",
        acked.len(),
        unknown.len(),
        records.len(),
        elections.get(elections.len() / 2),
        elections.last(),
        failovers.get(failovers.len() / 2),
        failovers.last()
    );
    assert_eq!(failovers.len(), kills, "a write was acknowledged after every kill");
    // A long-lived client is not held by the dead leader (QUIC's idle timeout is 30 s, a
    // forward's 10 s): it gives the silent connection up and finds the new leader.
    assert_eq!(fast_failovers.len(), kills, "the full-speed publisher was acknowledged after every kill");
    assert!(
        fast_failovers.last().is_some_and(|w| *w < Duration::from_secs(8)),
        "the full-speed publisher failed over within seconds after every kill: {fast_failovers:?}"
    );
}

#[test]
fn a_replicated_stream_keeps_every_acknowledged_record_across_ten_leader_kills() {
    kill_loop(10, 3, 30_000);
}

/// The long run (`cargo test --release -p felix-node --test quorum -- --ignored --nocapture`).
#[test]
#[ignore = "thirty SIGKILLs of the leader and 100,000 idempotent records, several minutes"]
fn a_replicated_stream_keeps_every_acknowledged_record_across_thirty_leader_kills() {
    kill_loop(30, 20, 100_000);
}

/// What a power failure of every broker at once left of an acknowledged publisher's records.
struct AfterPowerCut {
    /// Acknowledged before the power went.
    acked: Vec<String>,
    /// Sent, with no answer (in flight when it went).
    unknown: Vec<String>,
    /// The ledger read back after the restart (`None`: not readable within the bound).
    records: Option<Vec<String>>,
    /// Bytes the power cut took back (written, never synced), over the three brokers.
    dropped: u64,
}

/// Three brokers (`extra` arguments each) with a full-speed acknowledged publisher; once it
/// has `acks` acknowledgements, every broker loses power at once: all three are killed with
/// SIGKILL and each one's files are cut back to what its sync journal says reached the disk
/// (what was only in the page cache is gone, as in a coordinated power failure). Then all
/// three start again from what is left and the ledger is read back.
fn power_cut_every_broker(extra: &[&str], acks: usize, read_within: u64) -> AfterPowerCut {
    // A slow disk (every sync 20 ms longer): bytes stay unsynced for long enough that a broker
    // answering before its sync ended would be caught by the cut (it is, with the hold removed).
    let slow_disk = [(felix_driver_common::sync_journal::DELAY_ENV, "20")];
    let (_dirs, mut nodes, peers) = three_brokers_with(extra, &slow_disk, true);
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 16);
    load.wait_acks("the publisher is acknowledged", 0, acks);
    // The power goes: every broker at once, in the middle of the publisher's stream.
    for n in &mut nodes {
        n.kill();
    }
    let fast = load.finish();
    let mut dropped = 0;
    for n in &nodes {
        let journal = n.journal.as_ref().expect("a journal");
        let (files, bytes) = felix_driver_common::sync_journal::power_cut(journal).expect("the power cut");
        eprintln!("{}: the power cut took {bytes} bytes back from {files} file(s)", n.name);
        dropped += bytes;
    }
    for n in &mut nodes {
        n.start(&peers);
    }
    let mut records = None;
    let until = Instant::now() + Duration::from_secs(read_within);
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    while Instant::now() < until {
        let read = nodes.iter().find_map(|n| {
            let (ok, out, _) = cli(&n.client.to_string(), &any_dir, &["read", "ledger", "--from", "0", "--json"]);
            ok.then_some(out)
        });
        if let Some(out) = read {
            let got: Vec<String> = out
                .lines()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter_map(|v| v["payload"].as_str().map(str::to_owned))
                .collect();
            let have: std::collections::BTreeSet<&String> = got.iter().collect();
            let whole = acked.iter().all(|a| have.contains(a));
            records = Some(got);
            if whole {
                break;
            }
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    AfterPowerCut { acked, unknown: fast.unknown, records, dropped }
}

/// The default policy (appends synced before anything that depends on them): a power failure
/// of every broker at once, mid-stream, loses no acknowledged record, and writes none twice.
#[test]
fn a_power_cut_of_every_broker_loses_no_acknowledged_record() {
    let after = power_cut_every_broker(&[], 1_000, 60);
    let records = after.records.expect("the ledger is readable after the power cut");
    let have: std::collections::BTreeSet<&String> = records.iter().collect();
    let lost: Vec<&String> = after.acked.iter().filter(|a| !have.contains(a)).collect();
    assert!(
        lost.is_empty(),
        "{} of {} acknowledged records lost: {:?}",
        lost.len(),
        after.acked.len(),
        &lost[..lost.len().min(5)]
    );
    let mut seen = std::collections::BTreeSet::new();
    for r in &records {
        assert!(seen.insert(r), "{r} is in the ledger twice");
        assert!(
            r == "first" || after.acked.contains(r) || after.unknown.contains(r),
            "{r} is in the ledger but was never sent"
        );
    }
    eprintln!(
        "power cut: {} acknowledged, all kept; {} bytes written but never synced were taken back",
        after.acked.len(),
        after.dropped
    );
}

/// The control: with the lazy policy an operator must choose explicitly (`--fsync
/// interval:MS`, here longer than the run), the same power failure takes acknowledged records
/// back. This is what the default above prevents, and it shows the power cut is real.
#[test]
fn a_power_cut_takes_acknowledged_records_back_from_a_lazy_fsync_policy() {
    let after = power_cut_every_broker(&["--fsync", "interval:600000"], 500, 20);
    assert!(after.dropped > 0, "the power cut took nothing back");
    let have: std::collections::BTreeSet<&String> = after.records.iter().flatten().collect();
    let lost = after.acked.iter().filter(|a| !have.contains(a)).count();
    eprintln!("lazy policy: {lost} of {} acknowledged records lost to the power cut", after.acked.len());
    assert!(lost > 0, "every acknowledged record survived a power cut of unsynced writes");
}

/// Three brokers with a replicated cache (`--cache-replication 3`): values put through the
/// cluster while the cache's leader is killed with SIGKILL twice (restarted each time). Every
/// broker then reads every key's last acknowledged value (or a later put whose answer was lost
/// with a killed broker), with the same version everywhere.
#[test]
fn a_replicated_cache_keeps_every_acknowledged_value_across_leader_kills() {
    let (_dirs, mut nodes, peers) = three_brokers();
    let addrs = nodes.iter().map(|n| n.client.to_string()).collect::<Vec<_>>().join(",");
    let any_dir = nodes[0].dir.clone();
    // A put, retried while refused (nothing written); `true` once acknowledged, `false` when
    // its outcome is unknown (the broker died with it, or was deposed).
    let put = |key: &str, value: &str| -> bool {
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let (ok, _, err) =
                cli(&addrs, &any_dir, &["cache", "put", "sessions", key, value, "--close-timeout", "3s"]);
            if ok {
                return true;
            }
            let refused = refused_before_writing(&err);
            if !refused {
                eprintln!("{key}={value}: outcome unknown: {err}");
                return false;
            }
            assert!(Instant::now() < until, "no broker took {key}={value} for 30 s: {err}");
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    const KEYS: usize = 4;
    const KILLS: usize = 2;
    // A CLI watcher of every key from the start: it follows the cache through the kills (a
    // deposed or killed leader ends it; it watches again on the new one from where it was).
    assert!(put("k0", "first"), "the cache takes a first put");
    let mut watcher = Command::new(BIN)
        .env("FELIX_ADDR", &addrs)
        .env("FELIX_DATA_DIR", &any_dir)
        .env("FELIX_TOKEN", TOKEN)
        .args([
            "cache",
            "watch",
            "sessions",
            "--prefix",
            "k",
            "--from",
            "0",
            "--json",
            "--insecure-accept-any-certificate",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let watched = std::sync::Arc::new(std::sync::Mutex::new(Vec::<serde_json::Value>::new()));
    {
        let out = watcher.stdout.take().unwrap();
        let w = watched.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(out).lines().map_while(Result::ok) {
                if let Ok(v) = serde_json::from_str(&l) {
                    w.lock().unwrap().push(v);
                }
            }
        });
    }
    struct KillOnDrop(std::process::Child);
    impl Drop for KillOnDrop {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut watcher = KillOnDrop(watcher);
    let watch_err = watcher.0.stderr.take().unwrap();
    let watch_log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    {
        let log = watch_log.clone();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for l in std::io::BufReader::new(watch_err).lines().map_while(Result::ok) {
                let mut g = log.lock().unwrap();
                g.push_str(&l);
                g.push('\n');
            }
        });
    }
    wait_for("the watcher saw the first put", 30, || watched.lock().unwrap().iter().any(|v| v["value"] == "first"));
    // Per key: every value put, in order, and whether it was acknowledged.
    let mut puts: Vec<Vec<(String, bool)>> = vec![Vec::new(); KEYS];
    for round in 0..=KILLS {
        for (k, log) in puts.iter_mut().enumerate() {
            let v = format!("v{round}-{k}");
            let acked = put(&format!("k{k}"), &v);
            log.push((v, acked));
        }
        if round == KILLS {
            break;
        }
        let mut who = None;
        wait_for("the cache's leader is known", 30, || {
            who = leader_of(&nodes, "sessions");
            who.is_some()
        });
        let victim = nodes.iter().position(|n| Some(&n.name) == who.as_ref()).unwrap();
        nodes[victim].kill();
        wait_for("a survivor leads the cache", 30, || {
            nodes.iter().filter(|n| n.proc.is_some()).filter_map(|n| status(n.metrics)).any(|v| {
                v["replicas"]
                    .as_array()
                    .is_some_and(|r| r.iter().any(|r| r["name"] == "sessions" && r["role"] == "leader"))
            })
        });
        // Written while the victim is down: it catches up when it comes back.
        for (k, log) in puts.iter_mut().enumerate() {
            let v = format!("v{round}b-{k}");
            let acked = put(&format!("k{k}"), &v);
            log.push((v, acked));
        }
        nodes[victim].start(&peers);
    }
    // The watcher printed every acknowledged put, each once, in offset order, across the kills.
    let acked: Vec<String> = puts.iter().flatten().filter(|(_, a)| *a).map(|(v, _)| v.clone()).collect();
    wait_for("the watcher printed every acknowledged put", 60, || {
        let w = watched.lock().unwrap();
        acked.iter().all(|v| w.iter().any(|x| x["value"] == v.as_str()))
    });
    {
        let w = watched.lock().unwrap();
        let offsets: Vec<u64> = w.iter().filter_map(|x| x["offset"].as_u64()).collect();
        assert!(offsets.windows(2).all(|p| p[0] < p[1]), "no change twice, in order: {offsets:?}");
        let log = watch_log.lock().unwrap();
        assert!(log.contains("watching again from offset"), "it followed the cache: {log}");
    }
    drop(watcher);
    for (k, log) in puts.iter().enumerate() {
        let last_acked = log.iter().rposition(|(_, a)| *a).expect("some put of each key was acknowledged");
        let allowed: Vec<&str> = log[last_acked..].iter().map(|(v, _)| v.as_str()).collect();
        // Through every broker (followers forward to the leader): one value, one version.
        let mut seen = Vec::new();
        for n in &nodes {
            let mut got = None;
            wait_for("the key is readable through every broker", 30, || {
                let (ok, out, _) =
                    cli(&n.client.to_string(), &any_dir, &["cache", "get", "sessions", &format!("k{k}")]);
                got = ok.then(|| out.trim().to_owned());
                got.is_some()
            });
            seen.push(got.unwrap());
        }
        assert!(allowed.contains(&seen[0].as_str()), "k{k} reads {:?}; allowed {allowed:?}", seen[0]);
        assert!(seen.iter().all(|s| *s == seen[0]), "k{k} reads differently on different brokers: {seen:?}");
    }
}

/// One follower's replica log is damaged while it is down (a single bit flipped in the middle
/// of its file, as a failing disk does it): restarted, it finds the damage, sets the file aside,
/// says so in its status and metrics, grants no vote until the leader took it out of the group
/// and added it back, then catches up with every record. The leader is then killed: the
/// survivors, the healed replica among them, elect a leader that holds every acknowledged
/// record.
#[test]
fn a_follower_whose_replica_log_is_corrupted_rejoins_afresh_and_no_acknowledged_record_is_lost() {
    let (_dirs, mut nodes, peers) = three_brokers();
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    load.wait_acks("the publisher is acknowledged", 0, 500);
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    let lead = leader_index(&nodes);
    let f = (0..3).find(|i| *i != lead).unwrap();
    // Down, and one bit of its ledger replica's log flipped in the middle.
    nodes[f].kill();
    let replicas = nodes[f].dir.join("cluster").join("replicas");
    let file = std::fs::read_dir(&replicas)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_string_lossy().contains("~ledger~"))
        .expect("the ledger's replica log");
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(&file, &bytes).unwrap();
    nodes[f].start(&peers);
    // Found, set aside, said.
    wait_for("the damage is counted", 30, || metric(&nodes[f], "felix_replica_logs_damaged_total") == Some(1));
    let aside = std::fs::read_dir(replicas.join("damaged")).unwrap().count();
    assert_eq!(aside, 1, "the damaged file is kept aside");
    // Healed: taken out, added back, caught up to the leader's next offset.
    wait_for("the damaged replica rejoined and caught up", 60, || {
        let rejoined =
            status(nodes[f].metrics).is_some_and(|v| v["rejoining_replicas"].as_array().is_some_and(Vec::is_empty));
        rejoined && ledger_caught_up(&nodes[f], &nodes[lead])
    });
    assert_eq!(metric(&nodes[f], "felix_replica_rejoins_healed_total"), Some(1));
    assert_eq!(metric(&nodes[lead], "felix_replicas_readded_total"), Some(1));
    // The leader goes: every acknowledged record is read back from the two survivors.
    nodes[lead].kill();
    check_ledger(&nodes, &any_dir, &acked, &fast.unknown);
    eprintln!("corrupted follower: {} acknowledged, none lost or doubled", acked.len());
}

/// A metric of broker `n` (`None` while it does not answer).
fn metric(n: &Node, name: &str) -> Option<u64> {
    let body = common::http_get(n.metrics, "/metrics")?;
    body.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Whether broker `a`'s replica of the ledger is at broker `b`'s next offset.
fn ledger_caught_up(a: &Node, b: &Node) -> bool {
    let (Some(mine), Some(theirs)) = (status(a.metrics), status(b.metrics)) else { return false };
    let next = |v: &serde_json::Value| {
        v["replicas"].as_array()?.iter().find(|r| r["name"] == "ledger").map(|r| r["next_offset"].clone())
    };
    next(&mine).is_some() && next(&mine) == next(&theirs)
}

/// A replicated shard holds only its newest history in memory (budgets of 64 KiB here: the
/// broker's log of it, `--memory-bytes`, and each replica's Raft log, `--replica-entry-cache`).
/// A follower down while far more was written catches up from the entries its leader reads
/// back from its log files; then the leader is killed and every acknowledged record is read
/// back from offset 0 on the survivors, most of it from their files.
#[test]
fn a_follower_away_while_far_more_than_memory_was_written_catches_up_from_its_leaders_log_files() {
    let budgets = ["--memory-bytes", "65536", "--replica-entry-cache", "65536"];
    let (_dirs, mut nodes, peers) = three_brokers_with(&budgets, &[], false);
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    load.wait_acks("the publisher is acknowledged", 0, 500);
    let lead = leader_index(&nodes);
    let f = (0..3).find(|i| *i != lead).unwrap();
    nodes[f].kill();
    let from = load.count();
    load.wait_acks("acknowledged while the follower is down", from, 5_000);
    let on_disk = metric(&nodes[lead], "felix_replica_entries_on_disk").unwrap_or(0);
    assert!(on_disk > 1_000, "the leader's Raft log keeps {on_disk} entries on disk only");
    nodes[f].start(&peers);
    wait_for("the follower caught up", 60, || ledger_caught_up(&nodes[f], &nodes[lead]));
    let reads = metric(&nodes[lead], "felix_replica_log_reads_total").unwrap_or(0);
    assert!(reads > 0, "the entries the follower missed were read back from the leader's files");
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    nodes[lead].kill();
    let before: u64 =
        nodes.iter().filter(|n| n.proc.is_some()).filter_map(|n| metric(n, "felix_replica_log_reads_total")).sum();
    check_ledger(&nodes, &any_dir, &acked, &fast.unknown);
    let after: u64 =
        nodes.iter().filter(|n| n.proc.is_some()).filter_map(|n| metric(n, "felix_replica_log_reads_total")).sum();
    assert!(after > before, "history below memory was read back from the survivors' files");
    eprintln!(
        "{} acknowledged, {on_disk} entries on disk only on the leader, {reads} reads for the follower",
        acked.len()
    );
}

/// The leader is paused (SIGSTOP) for several seconds under a full-speed acked publisher, as a
/// stalled VM or a long GC pause would: the other two elect a leader and the publisher follows
/// it; resumed (SIGCONT), the old leader learns it was deposed and follows. Every acknowledged
/// record is in the stream once, nothing unsent is, and the publisher was acknowledged again
/// within a bound after the pause began.
#[test]
fn a_paused_leader_is_replaced_and_on_resuming_follows_with_no_acknowledged_record_lost_or_doubled() {
    let (_dirs, nodes, _peers) = three_brokers();
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    load.wait_acks("the publisher is acknowledged", 0, 300);
    let old = leader_index(&nodes);
    let pid = nodes[old].proc.as_ref().unwrap().0.id().to_string();
    let signal = |s: &str| assert!(Command::new("kill").args([s, &pid]).status().unwrap().success());
    signal("-STOP");
    let paused = Instant::now();
    // The others elect a leader; the publisher goes on through it.
    let others: Vec<usize> = (0..3).filter(|i| *i != old).collect();
    wait_for("another broker leads", 30, || others.iter().any(|i| ledger_role_is(&nodes[*i], "leader")));
    load.wait_acks("the publisher is acknowledged through the new leader", load.count(), 200);
    // Paused for at least five seconds in all, then resumed: it follows.
    while paused.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(100));
    }
    signal("-CONT");
    wait_for("the old leader follows", 30, || ledger_role_is(&nodes[old], "follower"));
    load.wait_acks("more acknowledgements after the resume", load.count(), 200);
    let gap = load.longest_gap(paused);
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    check_ledger(&nodes, &any_dir, &acked, &fast.unknown);
    eprintln!(
        "paused leader: {} acknowledged, none lost or doubled; longest stretch without an ack {gap:?}",
        acked.len()
    );
    assert!(gap < Duration::from_secs(10), "no acknowledged write for {gap:?} after the leader paused");
}

/// After broker n3's disk fault (the others carried on): 300 more acknowledged, n3 restarted
/// on a mended disk takes part again, 200 more, and the ledger holds every acknowledged
/// record once. Returns those.
fn mended_and_nothing_lost(nodes: &mut [Node], peers: &str, any_dir: &Path, load: Load) -> Vec<String> {
    load.wait_acks("the other two go on", load.count(), 300);
    nodes[2].proc = None;
    nodes[2].env.clear();
    nodes[2].start(peers);
    wait_for("it takes part again", 60, || {
        ledger_role_is(&nodes[2], "follower") || ledger_role_is(&nodes[2], "leader")
    });
    load.wait_acks("acknowledged after its restart", load.count(), 200);
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    check_ledger(nodes, any_dir, &acked, &fast.unknown);
    acked
}

/// One broker's disk starts failing its syncs under load (`FELIX_FAULT_SYNC_FAIL_AFTER`, `EIO`
/// after 200): it stops at once (exit 74) without carrying out what waited on the failed sync,
/// the other two go on taking writes, and once restarted on a mended disk it takes part again.
/// Nothing acknowledged is lost or written twice.
#[test]
fn a_broker_whose_fsync_fails_stops_and_the_others_go_on_losing_no_acknowledged_record() {
    let (_dirs, mut nodes) = three_nodes(&[], &[], false);
    nodes[2].env.push((felix_driver_common::sync_journal::FAIL_AFTER_ENV.into(), "200".into()));
    let peers = nodes.iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes {
        n.start(&peers);
    }
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    wait_for("the broker with the failing disk stops, exit 74", 60, || {
        let exited = nodes[2].proc.as_mut().and_then(|p| p.0.try_wait().ok().flatten());
        exited.is_some_and(|st| {
            assert_eq!(st.code(), Some(74), "a failed fsync ends the broker with EX_IOERR");
            true
        })
    });
    let acked = mended_and_nothing_lost(&mut nodes, &peers, &any_dir, load);
    eprintln!("failing fsync: the broker stopped (74); {} acknowledged, none lost or doubled", acked.len());
}

/// One broker's disk fills under load (`FELIX_FAULT_FULL_AFTER_BYTES`: its replica-log
/// appends fail `ENOSPC` after 400 kB): its replica stops (it acknowledges nothing it did not
/// keep) and says so in `cluster status`, the broker itself stays up, the other two go on
/// taking writes, and once restarted with room it catches up and takes part again. Nothing
/// acknowledged is lost or written twice.
#[test]
fn a_broker_whose_disk_fills_stops_that_replica_says_so_and_the_others_lose_nothing() {
    let (_dirs, mut nodes) = three_nodes(&[], &[], false);
    nodes[2].env.push((felix_driver_common::sync_journal::FULL_AFTER_ENV.into(), "400000".into()));
    let peers = nodes.iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes {
        n.start(&peers);
    }
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    let mut why = String::new();
    wait_for("the full broker's replica stops and says why", 60, || {
        let failed = status(nodes[2].metrics).and_then(|v| {
            v["failed_replicas"].as_array()?.iter().find(|r| r["name"] == "ledger").map(|r| r["failed"].to_string())
        });
        failed.is_some_and(|f| {
            why = f;
            true
        })
    });
    assert!(why.contains("No space left") || why.contains("28"), "{why}");
    assert!(nodes[2].proc.as_mut().is_some_and(|p| p.0.try_wait().ok().flatten().is_none()), "the broker stays up");
    let acked = mended_and_nothing_lost(&mut nodes, &peers, &any_dir, load);
    eprintln!("full disk: the replica stopped ({why}); {} acknowledged, none lost or doubled", acked.len());
}

/// A bridge: the leader and one follower cannot reach each other, the other follower reaches
/// both. Nothing acknowledged is lost or doubled, and writes go on (pre-vote keeps the cut-off
/// follower from deposing a leader the bridge still hears, or a new leader is elected through
/// the bridge).
#[test]
fn a_bridge_partition_loses_and_doubles_nothing_and_writes_go_on() {
    let r = under_a_fault(4, Duration::from_secs(8), false, |net, leader| {
        let cut = ["n1", "n2", "n3"].into_iter().find(|o| *o != leader).unwrap();
        let blocked = Link { blocked: true, ..Link::default() };
        net.set(leader, cut, blocked);
        net.set(cut, leader, blocked);
    });
    eprintln!(
        "bridge: {} acknowledged, none lost or doubled; rates {:.0?}/s; longest stretch without an ack {:?}",
        r.acked, r.rates, r.longest_gap
    );
    assert!(r.rates[1] > 0.0, "no write acknowledged through the bridge partition");
}

/// Five brokers and a stream replicated on all five (RF 5): the shard's leader and one of its
/// followers are killed (SIGKILL) at the same moment under a full-speed acknowledged publisher.
/// The three left are a majority: one of them leads and acknowledges writes again within a
/// bound; the two come back from their data directories and follow; every acknowledged record
/// is in the stream exactly once and nothing never sent is.
#[test]
fn an_rf5_stream_on_five_brokers_loses_no_acknowledged_record_when_two_are_killed_at_once() {
    let (_dirs, mut nodes, peers) = brokers(5, 5);
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    load.wait_acks("the publisher is acknowledged", 0, 300);
    let lead = leader_index(&nodes);
    // Replicated on all five, each of which the leader tracks.
    wait_for("the leader replicates to all five", 30, || {
        status(nodes[lead].metrics).is_some_and(|v| {
            v["replicas"].as_array().is_some_and(|r| {
                r.iter().any(|r| {
                    r["name"] == "ledger"
                        && r["role"] == "leader"
                        && r["replicas"].as_array().is_some_and(|f| f.len() == 5)
                        && r["followers"].as_array().is_some_and(|f| f.len() == 5)
                })
            })
        })
    });
    let follower = (lead + 1) % nodes.len();
    let killed = Instant::now();
    nodes[lead].kill();
    nodes[follower].kill();
    let survivors: Vec<usize> = (0..nodes.len()).filter(|i| *i != lead && *i != follower).collect();
    wait_for("one of the three left leads", 30, || survivors.iter().any(|i| ledger_role_is(&nodes[*i], "leader")));
    let elected = killed.elapsed();
    load.wait_acks("the three left acknowledge writes", load.count(), 300);
    let gap = load.longest_gap(killed);
    nodes[lead].start(&peers);
    nodes[follower].start(&peers);
    wait_for("both killed brokers follow again", 60, || {
        ledger_role_is(&nodes[lead], "follower") && ledger_role_is(&nodes[follower], "follower")
    });
    load.wait_acks("acknowledged with all five back", load.count(), 200);
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    check_ledger(&nodes, &any_dir, &acked, &fast.unknown);
    eprintln!(
        "RF 5, two of five killed at once: {} acknowledged, none lost or doubled; a survivor led after {elected:?}; \
         longest stretch without an ack {gap:?}",
        acked.len()
    );
    assert!(gap < Duration::from_secs(10), "no acknowledged write for {gap:?} after two brokers were killed");
}

/// Hibernation on real brokers: eight replicated streams go idle and their groups sleep on
/// every broker (`felix_replica_groups_sleeping`). One broker is killed with SIGKILL: every
/// group it led gets a leader among the two left (they notice its silence; nothing of the
/// sleeping groups ticked) within seconds, and an acknowledged publish to each of the eight
/// streams succeeds.
#[test]
fn sleeping_replicated_streams_get_new_leaders_within_seconds_of_a_sigkill() {
    let (_dirs, mut nodes, _peers) = brokers(3, 3);
    let addrs = nodes.iter().map(|n| n.client.to_string()).collect::<Vec<_>>().join(",");
    let dir = nodes[0].dir.clone();
    let streams: Vec<String> = (0..8).map(|i| format!("idle{i}")).collect();
    for s in &streams {
        wait_for("the stream is created", 60, || cli(&addrs, &dir, &["publish", s, "first", "--ack"]).0);
    }
    wait_for("every group sleeps on every broker", 60, || {
        nodes.iter().all(|n| metric(n, "felix_replica_groups_sleeping") == Some(8))
    });
    // Who leads what, from each broker's own view.
    let leaders = |nodes: &[Node]| -> Vec<(String, String)> {
        let mut out = Vec::new();
        for n in nodes.iter().filter(|n| n.proc.is_some()) {
            if let Some(v) = status(n.metrics) {
                for r in v["replicas"].as_array().into_iter().flatten() {
                    if r["role"] == "leader" {
                        out.push((r["name"].as_str().unwrap_or_default().to_owned(), n.name.clone()));
                    }
                }
            }
        }
        out
    };
    let before = leaders(&nodes);
    let victim =
        (0..3).max_by_key(|i| before.iter().filter(|(_, l)| *l == nodes[*i].name).count()).expect("three brokers");
    let led: Vec<String> = before.iter().filter(|(_, l)| *l == nodes[victim].name).map(|(s, _)| s.clone()).collect();
    assert!(!led.is_empty(), "{before:?}");
    let killed = Instant::now();
    nodes[victim].kill();
    wait_for("every group the killed broker led has a new leader", 30, || {
        let now = leaders(&nodes);
        led.iter().all(|s| now.iter().any(|(n, _)| n == s))
    });
    let elected = killed.elapsed();
    let addrs: String =
        nodes.iter().filter(|n| n.proc.is_some()).map(|n| n.client.to_string()).collect::<Vec<_>>().join(",");
    for s in &streams {
        wait_for("an acknowledged publish", 30, || cli(&addrs, &dir, &["publish", s, "after", "--ack"]).0);
    }
    let served = killed.elapsed();
    eprintln!(
        "hibernation: {} groups led by the killed broker had new leaders after {elected:?}; all 8 streams acknowledged \
         a publish after {served:?}",
        led.len()
    );
    assert!(elected < Duration::from_secs(10), "{elected:?}");
}

/// Brokers added to a loaded cluster take their share by themselves: three brokers hold the
/// ledger (under a full-speed acknowledged publisher throughout) and a second replicated
/// stream of eight shards with records on each; brokers 4 to 7 are started and added with
/// `cluster add`, every broker copying at most `--move-bandwidth` for moves. Without an
/// operator's move, the metadata leader moves replicas onto the new brokers until every broker
/// of the seven holds three or four of the 27, with the fewest moves (none between the first
/// three); the copies were paced (`felix_move_bytes_total`), the publisher was acknowledged
/// throughout, and every acknowledged record is in the ledger exactly once.
#[test]
fn brokers_four_to_seven_added_under_load_take_a_fair_share_of_the_replicas_with_nothing_lost() {
    let (_dirs, mut nodes) = nodes(7, 3, &["--move-bandwidth", "1MB/s"]);
    let founders = nodes[..3].iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes[..3] {
        n.start(&founders);
    }
    let addrs = nodes[..3].iter().map(|n| n.client.to_string()).collect::<Vec<_>>().join(",");
    let dir = nodes[0].dir.clone();
    let load = Load::start(&nodes[..3], 4);
    let (ok, _, err) = cli(&addrs, &dir, &["stream", "create", "wide", "--shards", "8", "--replication", "3"]);
    assert!(ok, "{err}");
    let lines: String = (0..2000).map(|i| format!("w{i}-{}\n", "x".repeat(1000))).collect();
    let file = dir.parent().unwrap().join("wide.txt");
    std::fs::write(&file, lines).unwrap();
    wait_for("the wide stream's records are acknowledged", 60, || {
        cli(&addrs, &dir, &["publish", "wide", "--file", file.to_str().unwrap(), "--ack"]).0
    });
    load.wait_acks("the publisher is acknowledged", 0, 300);
    let held = |n: &Node| -> Option<usize> { Some(status(n.metrics)?["replicas"].as_array()?.len()) };
    wait_for("the first three hold all 27 replicas", 30, || nodes[..3].iter().all(|n| held(n) == Some(9)));
    let started = Instant::now();
    for i in 3..7 {
        join_and_add(&mut nodes, i);
    }
    let mut counts = Vec::new();
    wait_for("every broker of the seven holds three or four replicas, no move left", 120, || {
        counts = nodes.iter().map(held).collect();
        let idle = status(nodes[0].metrics).is_some_and(|v| v["moves"].as_array().is_some_and(|m| m.is_empty()));
        idle && counts.iter().all(|c| matches!(c, Some(3 | 4))) && counts.iter().flatten().sum::<usize>() == 27
    });
    let balanced = started.elapsed();
    let moves: u64 = nodes.iter().filter_map(|n| metric(n, "felix_replica_balance_moves_total")).sum();
    let copied: u64 = nodes.iter().filter_map(|n| metric(n, "felix_move_bytes_total")).sum();
    let waited: u64 = nodes.iter().filter_map(|n| metric(n, "felix_move_bandwidth_waits_total")).sum();
    let gap = load.longest_gap(started);
    load.wait_acks("acknowledged on seven brokers", load.count(), 200);
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    check_ledger(&nodes, &dir, &acked, &fast.unknown);
    eprintln!(
        "brokers 4-7 added under load: balanced in {balanced:?} with {moves} moves, {copied} bytes copied ({waited} waits for the budget); \
         replicas per broker {counts:?}; {} acknowledged, none lost or doubled; longest stretch without an ack {gap:?}",
        acked.len()
    );
    // The fewest moves: one per replica the new brokers hold (nothing moved between the
    // first three, nor off a new broker once it had its share).
    let taken: usize = counts[3..].iter().flatten().sum();
    assert_eq!(moves, taken as u64, "one move per replica the new brokers took: {counts:?}");
    assert!(taken >= 12, "{counts:?}");
    assert!(copied >= 2000 * 1000, "the wide stream's records were copied: {copied} bytes");
    assert!(waited > 0, "copies waited for --move-bandwidth");
    assert!(gap < Duration::from_secs(10), "no acknowledged write for {gap:?} while the cluster rebalanced");
}

/// The metadata log compacted on disk (D62): three brokers that compact every 20 entries
/// take snapshots as 40 streams are created; one SIGKILLed and restarted restores its
/// metadata from the snapshot it kept in `raft.log` (and the entries after it), and a fourth
/// added later is sent the leader's snapshot, and both list every stream.
#[test]
fn a_compacted_metadata_log_restores_a_restarted_broker_and_is_sent_to_one_added_later() {
    let (_dirs, mut nodes) = nodes(4, 1, &["--metadata-snapshot-entries", "20"]);
    let founders = nodes[..3].iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes[..3] {
        n.start(&founders);
    }
    let addrs = nodes[..3].iter().map(|n| n.client.to_string()).collect::<Vec<_>>().join(",");
    let dir = nodes[0].dir.clone();
    let file = dir.parent().unwrap().join("streams.txt");
    std::fs::write(&file, (0..40).map(|i| format!("m{i:02} 1\n")).collect::<String>()).unwrap();
    wait_for("the 40 streams are created", 60, || {
        cli(&addrs, &dir, &["stream", "create", "--from-file", file.to_str().unwrap(), "--wait", "30s"]).0
    });
    let snapshots = |n: &Node| metric(n, "felix_metadata_snapshots_total").unwrap_or(0);
    wait_for("every broker took a metadata snapshot", 30, || nodes[..3].iter().all(|n| snapshots(n) > 0));
    let lists_all = |n: &Node| {
        let (ok, out, _) = cli(&n.client.to_string(), &dir, &["stream", "list"]);
        ok && (0..40).all(|i| out.contains(&format!("default/m{i:02}\t")))
    };
    // n2's raft.log is its snapshot and the entries after it.
    let log = std::fs::metadata(nodes[1].dir.join("cluster/raft.log")).unwrap().len();
    nodes[1].kill();
    nodes[1].start(&founders);
    wait_for("the restarted broker lists every stream", 30, || lists_all(&nodes[1]));
    assert!(metric(&nodes[1], "felix_metadata_log_entries").is_some_and(|e| e < 40), "{log} bytes of raft.log");
    // n4 joins: the leader's log no longer holds the start, so it is sent the snapshot.
    let members = join_and_add(&mut nodes, 3);
    wait_for("the added broker restored the metadata from a snapshot and lists every stream", 30, || {
        metric(&nodes[3], "felix_metadata_snapshots_received_total") == Some(1) && lists_all(&nodes[3])
    });
    // And it restarts from what it kept.
    nodes[3].kill();
    nodes[3].start(&members);
    wait_for("the added broker, restarted, lists every stream", 30, || lists_all(&nodes[3]));
}

/// Starts broker `i` joining the cluster of the brokers before it and adds it with `cluster
/// add` through the first (waiting until it is a voter); the `--peers` it was given.
fn join_and_add(nodes: &mut [Node], i: usize) -> String {
    let members = nodes[..=i].iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    nodes[i].extra.push("--join".into());
    nodes[i].start(&members);
    let out = Command::new(BIN)
        .args(["cluster", "add", &format!("{}={}", nodes[i].name, nodes[i].cluster)])
        .args(["--metrics", &nodes[0].metrics.to_string(), "--cluster-secret", "s", "--wait", "30s"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    members
}

/// A replicated cache's snapshot, several chunks large, is sent to a follower behind the
/// leader's compaction from the leader's log files a chunk at a time (issue 32), over QUIC
/// between three broker processes: the follower catches up from it, the leader read it back in
/// pieces and holds none of it, and once the leader is killed every value is served by the
/// survivors.
#[test]
fn a_follower_behind_a_compacted_cache_is_sent_the_snapshot_from_the_leaders_files_in_chunks() {
    let (_dirs, mut nodes, peers) = three_brokers();
    let seeds: Vec<SocketAddr> = nodes.iter().map(|n| n.client).collect();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let client = rt.block_on(async {
        let opts = ClientOptions::new("default", TOKEN, Trust::DangerAcceptAnyCertificate);
        ClusterClient::connect(&seeds, opts).await.expect("the client connects")
    });
    // 300 keys of 16 KiB (a 4.9 MB cache: five chunks), written over twice: past the 8 MiB of
    // entries after which a replica checkpoints, so the log is compacted to a snapshot.
    let value = |k: usize, round: usize| Bytes::from(vec![(k + round) as u8; 16 << 10]);
    let put = |k: usize, round: usize| {
        rt.block_on(async {
            let until = Instant::now() + Duration::from_secs(30);
            loop {
                let c = client.any().await;
                let r = match c {
                    Ok(c) => c.cache_put("default", "sessions", &format!("k{k}"), value(k, round), None).await,
                    Err(e) => Err(e),
                };
                match r {
                    Ok(()) => return,
                    Err(e) => {
                        assert!(Instant::now() < until, "k{k} not taken for 30 s: {e}");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        })
    };
    put(0, 0);
    let mut lead = None;
    wait_for("the cache has a leader", 30, || {
        lead = leader_of(&nodes, "sessions");
        lead.is_some()
    });
    let lead = nodes.iter().position(|n| Some(&n.name) == lead.as_ref()).unwrap();
    let f = (0..3).find(|i| *i != lead).unwrap();
    nodes[f].kill();
    for round in 0..2 {
        for k in 0..300 {
            put(k, round);
        }
    }
    let first_index = |n: &Node| {
        status(n.metrics).and_then(|v| {
            v["replicas"].as_array()?.iter().find(|r| r["name"] == "sessions").and_then(|r| r["first_index"].as_u64())
        })
    };
    wait_for("the leader compacted the cache's log", 30, || first_index(&nodes[lead]).is_some_and(|i| i > 2));
    let reads = metric(&nodes[lead], "felix_replica_snapshot_reads_total").unwrap_or(0);
    nodes[f].start(&peers);
    let caught_up = |a: &Node, b: &Node| {
        let next = |n: &Node| {
            status(n.metrics).and_then(|v| {
                v["replicas"].as_array()?.iter().find(|r| r["name"] == "sessions").map(|r| r["next_offset"].clone())
            })
        };
        next(a).is_some() && next(a) == next(b)
    };
    wait_for("the follower caught up", 60, || caught_up(&nodes[f], &nodes[lead]));
    let pieces = metric(&nodes[lead], "felix_replica_snapshot_reads_total").unwrap_or(0) - reads;
    assert!(pieces >= 5, "the snapshot was read back from the leader's files in {pieces} pieces");
    assert_eq!(metric(&nodes[lead], "felix_replica_snapshot_bytes"), Some(0), "the leader holds none of it");
    assert!(first_index(&nodes[f]).is_some_and(|i| i > 2), "the follower installed a snapshot");
    nodes[lead].kill();
    rt.block_on(async {
        let until = Instant::now() + Duration::from_secs(60);
        for k in 0..300 {
            loop {
                let got = match client.any().await {
                    Ok(c) => c.cache_get("default", "sessions", &format!("k{k}")).await,
                    Err(e) => Err(e),
                };
                match got {
                    Ok(v) => {
                        assert_eq!(v, Some(value(k, 1)), "k{k}");
                        break;
                    }
                    Err(e) => {
                        assert!(Instant::now() < until, "k{k} not served within 60 s: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        }
        client.close().await;
    });
}

/// A field of `/proc/PID/status` given in kB (`VmRSS:`, `VmHWM:`), in MB; 0 when unread.
fn proc_status_mb(pid: u32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(field))
        .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        .map_or(0, |kb: u64| kb / 1024)
}

/// The measurement behind docs/benchmarks.md's "A large commit state, compacted and sent":
/// three brokers (`FELIX_TEST_BIN` picks the build), a replicated stream retaining 2,000
/// records, `FELIX_STATE_KEYS` keys (default 10,000) of 4 KiB committed twice over by 8
/// writers while a follower is down; once the leader compacted, the follower starts again
/// behind and is sent the snapshot. Prints the leader's peak RSS before the send (compaction
/// encodes the state), its growth while sending, and how long the follower took; with
/// `FELIX_TRACE`, the leader's RSS and the snapshot pieces it read at each sample.
#[test]
#[ignore = "a measurement: run with --ignored --nocapture (FELIX_TEST_BIN=path for another build)"]
fn measure_a_large_commit_state_compacted_and_sent_to_a_follower_behind() {
    use felix_proto::client::CommitRequest;
    let keys: usize = std::env::var("FELIX_STATE_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(10_000);
    let (_dirs, mut nodes, peers) = three_brokers_with(&["--retention-records", "2000"], &[], false);
    let seeds: Vec<SocketAddr> = nodes.iter().map(|n| n.client).collect();
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
    let client = Arc::new(rt.block_on(async {
        let opts = ClientOptions::new("default", TOKEN, Trust::DangerAcceptAnyCertificate);
        ClusterClient::connect(&seeds, opts).await.expect("the client connects")
    }));
    let commit = |client: Arc<ClusterClient>, k: usize, round: usize| async move {
        let req = CommitRequest {
            namespace: "default".into(),
            stream: "ledger".into(),
            entity_key: Bytes::from_static(b"one"),
            event: Bytes::from(format!("k{k}/{round}")),
            changes: vec![(format!("k{k}"), Some(Bytes::from(vec![(k + round) as u8; 4096])))],
            expected_offset: None,
        };
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            let r = match client.any().await {
                Ok(c) => c.commit(req.clone()).await,
                Err(e) => Err(e),
            };
            match r {
                Ok(_) => return,
                Err(e) => {
                    assert!(Instant::now() < until, "k{k} not committed for 60 s: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
    };
    rt.block_on(commit(client.clone(), 0, 0));
    let lead = leader_index(&nodes);
    let f = (0..3).find(|i| *i != lead).unwrap();
    nodes[f].kill();
    let t0 = Instant::now();
    rt.block_on(async {
        let mut tasks = Vec::new();
        for w in 0..8 {
            let client = client.clone();
            tasks.push(tokio::spawn(async move {
                for round in 0..2 {
                    for k in (w..keys).step_by(8) {
                        commit(client.clone(), k, round).await;
                    }
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
    let committed = t0.elapsed();
    let first_index = |n: &Node| {
        status(n.metrics).and_then(|v| {
            v["replicas"].as_array()?.iter().find(|r| r["name"] == "ledger").and_then(|r| r["first_index"].as_u64())
        })
    };
    wait_for("the leader compacted the ledger's log", 60, || first_index(&nodes[lead]).is_some_and(|i| i > 2));
    let pid = nodes[lead].proc.as_ref().unwrap().0.id();
    let rss = |what: &str| proc_status_mb(pid, what);
    let (peak_before, before) = (rss("VmHWM:"), rss("VmRSS:"));
    let reads = metric(&nodes[lead], "felix_replica_snapshot_reads_total").unwrap_or(0);
    let log_reads = metric(&nodes[lead], "felix_replica_log_reads_total").unwrap_or(0);
    if std::env::var_os("FELIX_TRACE").is_some() {
        // The leader alone for 3 s first: what it does anyway, without a follower to catch up.
        let (mut alone, t) = (Vec::new(), Instant::now());
        while t.elapsed() < Duration::from_secs(3) {
            alone.push(format!("{}ms:{}MB", t.elapsed().as_millis(), rss("VmRSS:")));
            std::thread::sleep(Duration::from_millis(50));
        }
        println!("leader RSS before the follower returns: {}", alone.join(" "));
    }
    let t1 = Instant::now();
    nodes[f].start(&peers);
    let mut most = before;
    let mut trace = Vec::new();
    wait_for("the follower caught up", 120, || {
        let now = rss("VmRSS:");
        most = most.max(now);
        let pieces = metric(&nodes[lead], "felix_replica_snapshot_reads_total").unwrap_or(0).saturating_sub(reads);
        let queued = metric(&nodes[lead], "felix_peer_queued_bytes").unwrap_or(0) >> 20;
        trace.push(format!("{}ms:{now}MB/{pieces}/q{queued}", t1.elapsed().as_millis()));
        ledger_caught_up(&nodes[f], &nodes[lead])
    });
    if std::env::var_os("FELIX_TRACE").is_some() {
        println!(
            "leader RSS while the follower caught up (time: RSS/pieces read/MiB queued for peers): {}",
            trace.join(" ")
        );
    }
    let caught = t1.elapsed();
    // The follower started afresh: its peak is what taking the snapshot cost it.
    let follower_peak = proc_status_mb(nodes[f].proc.as_ref().unwrap().0.id(), "VmHWM:");
    let restored = metric(&nodes[f], "felix_replica_restores_in_pieces_total").unwrap_or(0);
    let reads = metric(&nodes[lead], "felix_replica_snapshot_reads_total").unwrap_or(0) - reads;
    let log_reads = metric(&nodes[lead], "felix_replica_log_reads_total").unwrap_or(0) - log_reads;
    println!("log reads while sending: {log_reads}");
    println!(
        "{keys} keys of 4 KiB, {} commits in {committed:.1?}; leader peak RSS before the send {peak_before} MB, \
         RSS {before} MB before and at most {most} MB while sending (+{} MB), {reads} snapshot reads; \
         the follower caught up in {caught:.2?}, its peak RSS {follower_peak} MB \
         ({restored} states read back from disk in pieces)",
        2 * keys,
        most - before
    );
    // Then the follower restarts (killed): its fold reads the kept snapshot, and its peak is
    // what restoring the state from it cost (read back in pieces with a large state).
    nodes[f].kill();
    let t2 = Instant::now();
    nodes[f].start(&peers);
    let restoring = |n: &Node| metric(n, "felix_replica_restoring");
    wait_for("the restarted follower restored its state and caught up", 120, || {
        restoring(&nodes[f]) == Some(0) && ledger_caught_up(&nodes[f], &nodes[lead])
    });
    let back = t2.elapsed();
    let restart_peak = proc_status_mb(nodes[f].proc.as_ref().unwrap().0.id(), "VmHWM:");
    let restored_again = metric(&nodes[f], "felix_replica_restores_in_pieces_total").unwrap_or(0);
    println!(
        "restarted, the follower restored its state and caught up in {back:.2?}, its peak RSS {restart_peak} MB \
         ({restored_again} states read back from disk in pieces)"
    );
    rt.block_on(client.close());
}
