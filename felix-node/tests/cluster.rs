//! Three `felix-node serve` processes forming a cluster on loopback: they agree on members,
//! leader and owners; records published through every broker land once, on their shard's owner;
//! a read through a broker that does not own the shard is redirected; after one broker is
//! killed with SIGKILL the others keep serving their shards and what needs the dead one is
//! answered `shard_unavailable`, never a hang.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_felix-node");
const TOKEN: &str = "cluster-test-token";

mod common;
use common::{free_tcp, free_udp, wait_for};

/// A broker process, killed when dropped.
struct Broker {
    child: Child,
    name: String,
    client: SocketAddr,
    metrics: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(name: &str, client: SocketAddr, cluster: SocketAddr, peers: &str) -> Broker {
    start_with(name, client, cluster, peers, &[])
}

fn start_with(name: &str, client: SocketAddr, cluster: SocketAddr, peers: &str, extra: &[&str]) -> Broker {
    let dir = tempfile::tempdir().unwrap();
    let metrics = free_tcp();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &client.to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--dev-token", TOKEN, "--default-shards", "6", "--node-id", name])
        .args(["--cluster-listen", &cluster.to_string(), "--peers", peers, "--cluster-secret", "test-secret"])
        .args(["--metrics-listen", &metrics.to_string()])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_banner(&mut child);
    Broker { child, name: name.into(), client, metrics, dir }
}

/// `GET /cluster` on a broker's metrics listener.
fn status(b: &Broker) -> Option<serde_json::Value> {
    common::cluster_status(b.metrics)
}

/// A `felix_peer_*` metric's value for `peer` on a broker (`None`: not shown).
fn peer_metric(b: &Broker, name: &str, peer: &str) -> Option<u64> {
    let text = common::http_get(b.metrics, "/metrics")?;
    let series = format!("{name}{{peer=\"{peer}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&series)).and_then(|v| v.trim().parse().ok())
}

fn cli(b: &Broker, args: &[&str]) -> (bool, String, String) {
    cli_at(b.client, b.dir.path(), args)
}

fn cli_at(addr: SocketAddr, dir: &Path, args: &[&str]) -> (bool, String, String) {
    cli_at_addrs(&addr.to_string(), dir, args)
}

fn cli_at_addrs(addr: &str, dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).env("FELIX_ADDR", addr).env("FELIX_DATA_DIR", dir).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Owner of each shard of `orders`, from one broker's status.
fn owners(v: &serde_json::Value) -> Vec<String> {
    let mut o: Vec<(u64, String)> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == "orders")
        .map(|s| (s["shard"].as_u64().unwrap(), s["owner"].as_str().unwrap().to_owned()))
        .collect();
    o.sort();
    o.into_iter().map(|(_, n)| n).collect()
}

/// (owner, generation) of each shard of `name`, from one broker's status.
fn homes(v: &serde_json::Value, name: &str) -> Vec<(String, u64)> {
    let mut o: Vec<(u64, String, u64)> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == name)
        .map(|s| {
            (s["shard"].as_u64().unwrap(), s["owner"].as_str().unwrap().to_owned(), s["generation"].as_u64().unwrap())
        })
        .collect();
    o.sort();
    o.into_iter().map(|(_, n, g)| (n, g)).collect()
}

#[test]
fn three_brokers_share_a_stream_and_survive_a_sigkill() {
    let names = ["n1", "n2", "n3"];
    let clients: Vec<SocketAddr> = names.iter().map(|_| free_udp()).collect();
    let clusters: Vec<SocketAddr> = names.iter().map(|_| free_udp()).collect();
    let peers = names.iter().zip(&clusters).map(|(n, a)| format!("{n}={a}")).collect::<Vec<_>>().join(",");
    // "ticks" is configured in memory only: its shards move when their owner dies.
    let conf = tempfile::tempdir().unwrap();
    let conf_file = conf.path().join("felix.toml");
    std::fs::write(
        &conf_file,
        "[[streams]]\ntenant = \"default\"\nnamespace = \"default\"\nname = \"ticks\"\ndurable = false\nshards = 6\n",
    )
    .unwrap();
    let conf_arg = conf_file.to_str().unwrap().to_owned();
    let mut brokers: Vec<Broker> = names
        .iter()
        .enumerate()
        .map(|(i, n)| start_with(n, clients[i], clusters[i], &peers, &["--config", &conf_arg]))
        .collect();
    wait_for("three members and one leader, seen by all", 30, || {
        let s: Vec<_> = brokers.iter().map(status).collect();
        s.iter().all(|v| v.as_ref().is_some_and(|v| v["members"].as_array().is_some_and(|m| m.len() == 3)))
            && s.iter().all(|v| v.as_ref().unwrap()["leader"] == s[0].as_ref().unwrap()["leader"])
            && !s[0].as_ref().unwrap()["leader"].is_null()
    });

    // Keyed records through every broker; the first publish creates the stream in the cluster
    // (shard_unavailable until its owners are known: retried, bounded).
    let mut published = 0;
    for (i, b) in brokers.iter().enumerate() {
        for k in 0..10 {
            let key = format!("key-{i}-{k}");
            let mut tries = 0;
            loop {
                let (ok, _, err) = cli(b, &["publish", "orders", &format!("r-{i}-{k}"), "--ack", "--key", &key]);
                if ok {
                    break;
                }
                tries += 1;
                assert!(err.contains("shard_unavailable") && tries < 100, "{err}");
                std::thread::sleep(Duration::from_millis(50));
            }
            published += 1;
        }
    }
    wait_for("every broker knows the same owners", 10, || {
        let o: Vec<_> = brokers.iter().map(|b| status(b).map(|v| owners(&v))).collect();
        o.iter().all(|x| x.as_ref().is_some_and(|x| x.len() == 6)) && o.iter().all(|x| *x == o[0])
    });
    let owner_of = owners(&status(&brokers[0]).unwrap());
    // `cluster status` agrees on all three (all but the line naming the broker asked).
    let printed: Vec<String> = brokers
        .iter()
        .map(|b| {
            let out =
                Command::new(BIN).args(["cluster", "status", "--metrics", &b.metrics.to_string()]).output().unwrap();
            assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            String::from_utf8_lossy(&out.stdout).lines().skip(1).collect::<Vec<_>>().join("\n")
        })
        .collect();
    assert!(printed.iter().all(|p| *p == printed[0]), "{printed:#?}");
    assert!(printed[0].contains("leader") && printed[0].contains("stream default/default/orders 5:"), "{}", printed[0]);
    for n in names {
        assert!(owner_of.iter().any(|o| o == n), "{n} owns a share: {owner_of:?}");
    }

    // Each shard read on its owner: every record once, in total.
    fn by_name<'a>(brokers: &'a [Broker], n: &str) -> &'a Broker {
        brokers.iter().find(|b| b.name == n).unwrap()
    }
    let mut seen = Vec::new();
    for (shard, owner) in owner_of.iter().enumerate() {
        let (ok, out, err) =
            cli(by_name(&brokers, owner), &["read", "orders", "--shard", &shard.to_string(), "--from", "0"]);
        assert!(ok, "{err}");
        seen.extend(out.lines().map(|l| l.split('\t').nth(1).unwrap().to_owned()));
    }
    seen.sort();
    let before = seen.len();
    seen.dedup();
    assert_eq!((before, seen.len()), (published, published), "every record once: {seen:?}");
    // A read through a broker that does not own the shard: without trust in the owner's
    // certificate the redirect names the owner and stops; trusting every broker (one CA file
    // with the three certificates) the CLI follows it and reads the shard from its owner.
    let (shard, owner) = owner_of.iter().enumerate().find(|(_, o)| *o != "n1").unwrap();
    let (ok, _, err) = cli(by_name(&brokers, "n1"), &["read", "orders", "--shard", &shard.to_string()]);
    assert!(!ok && err.contains(owner.as_str()), "{err}");
    let bundle = by_name(&brokers, "n1").dir.path().join("all-brokers.pem");
    let pems: String =
        brokers.iter().map(|b| std::fs::read_to_string(b.dir.path().join("tls/cert.pem")).unwrap()).collect();
    std::fs::write(&bundle, pems).unwrap();
    let (ok, out, err) = cli(
        by_name(&brokers, "n1"),
        &["read", "orders", "--shard", &shard.to_string(), "--from", "0", "--ca", bundle.to_str().unwrap()],
    );
    assert!(ok && !out.is_empty(), "{err}");
    assert!(err.contains(&format!("{owner} owns it: asking")), "{err}");
    // A subscribe through a non-owner follows it too.
    let (ok, out, err) = cli(
        by_name(&brokers, "n1"),
        &[
            "subscribe",
            "orders",
            "--shard",
            &shard.to_string(),
            "--from",
            "earliest",
            "--count",
            "1",
            "--ca",
            bundle.to_str().unwrap(),
        ],
    );
    assert!(ok && out.lines().count() == 1, "{out}{err}");
    // Without --shard, one command through one broker covers every shard, each from its
    // owner (redirects followed per shard): every record once, the shard on each line.
    let ca = ["--ca", bundle.to_str().unwrap()];
    let (ok, out, err) = cli(by_name(&brokers, "n1"), &[&["read", "orders", "--from", "0"][..], &ca].concat());
    assert!(ok, "{err}");
    let mut all: Vec<&str> = out.lines().map(|l| l.split('\t').nth(1).unwrap()).collect();
    all.sort_unstable();
    assert_eq!(all, seen, "read: every record of the six shards once");
    assert!(out.lines().all(|l| l.contains('/')), "SHARD/OFFSET: {out}");
    let count = published.to_string();
    let (ok, out, err) = cli(
        by_name(&brokers, "n1"),
        &[&["subscribe", "orders", "--from", "earliest", "--count", &count, "--json"][..], &ca].concat(),
    );
    assert!(ok, "{err}");
    let mut subscribed: Vec<String> = out
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["payload"].as_str().unwrap().to_owned())
        .collect();
    subscribed.sort();
    assert_eq!(subscribed, seen, "subscribe: every record of the six shards once");

    // The configured in-memory stream is registered in the cluster like any other (its first
    // publish waits out the creation), its shards spread.
    let (ok, _, err) = cli(&brokers[0], &["publish", "ticks", "t0", "--ack", "--key", "k"]);
    assert!(ok, "{err}");
    wait_for("every broker knows the owners of ticks", 10, || {
        brokers.iter().all(|b| status(b).is_some_and(|v| homes(&v, "ticks").len() == 6))
    });
    let ticks_before = homes(&status(&brokers[0]).unwrap(), "ticks");
    assert!(ticks_before.iter().any(|(o, _)| o == "n3"), "n3 owns some of ticks: {ticks_before:?}");
    // Every link is up in the metrics, with messages both ways (Raft, at least) and one
    // connection made each.
    for b in &brokers {
        for p in names.iter().filter(|p| **p != b.name) {
            let m = |name: &str| peer_metric(b, name, p);
            assert_eq!(m("felix_peer_link_up"), Some(1), "{} → {p}", b.name);
            assert_eq!(m("felix_peer_connects_total"), Some(1), "{} → {p}", b.name);
            assert_eq!(m("felix_peer_links_lost_total"), Some(0), "{} → {p}", b.name);
            assert!(m("felix_peer_bytes_sent_total") > Some(0), "{} → {p}", b.name);
            assert!(m("felix_peer_bytes_received_total") > Some(0), "{} → {p}", b.name);
            assert!(m("felix_peer_datagrams_sent_total") > Some(0), "{} → {p}", b.name);
            assert!(m("felix_peer_rtt_micros").is_some(), "{} → {p}: a round trip while up", b.name);
        }
    }
    // SIGKILL n3: the others keep serving their own shards; a write that needs n3 is answered
    // shard_unavailable (forwarding cannot reach it), not left hanging.
    let dead = brokers.iter().position(|b| b.name == "n3").unwrap();
    let mut victim = brokers.remove(dead);
    victim.child.kill().unwrap();
    victim.child.wait().unwrap();
    let live_shard = owner_of.iter().position(|o| o == "n1").unwrap();
    let killed = Instant::now();
    wait_for("the survivors declare n3 down", 15, || {
        brokers.iter().all(|b| {
            status(b).is_some_and(|v| {
                v["members"].as_array().is_some_and(|m| m.iter().any(|m| m["node_id"] == "n3" && m["state"] == "down"))
            })
        })
    });
    eprintln!("n3 declared down {:?} after SIGKILL", killed.elapsed());
    // The survivors' links to n3 went down (its idle timeout, 2 s), and stay down while it is
    // dialled again; theirs to each other stay up.
    wait_for("the survivors' links to n3 are down", 15, || {
        brokers.iter().all(|b| {
            peer_metric(b, "felix_peer_link_up", "n3") == Some(0)
                && peer_metric(b, "felix_peer_links_lost_total", "n3") == Some(1)
        })
    });
    for b in &brokers {
        assert_eq!(peer_metric(b, "felix_peer_rtt_micros", "n3"), None, "no round trip to a dead peer");
        let other = if b.name == "n1" { "n2" } else { "n1" };
        assert_eq!(peer_metric(b, "felix_peer_link_up", other), Some(1), "{} → {other}", b.name);
        assert_eq!(peer_metric(b, "felix_peer_links_lost_total", other), Some(0), "{} → {other}", b.name);
    }
    // Its in-memory shards have new owners (a newer generation), everywhere; nothing else moved.
    wait_for("n3's in-memory shards moved", 10, || {
        brokers.iter().all(|b| {
            status(b).is_some_and(|v| {
                let now = homes(&v, "ticks");
                now.len() == 6
                    && now
                        .iter()
                        .zip(&ticks_before)
                        .all(|((o, g), (was, wg))| if was == "n3" { o != "n3" && g > wg } else { o == was && g == wg })
            })
        })
    });
    eprintln!("n3's in-memory shards had new owners {:?} after SIGKILL", killed.elapsed());
    let (ok, _, err) = cli(&brokers[0], &["publish", "ticks", "after", "--ack", "--key", "k"]);
    assert!(ok, "an in-memory stream keeps taking writes: {err}");
    let n2 = by_name(&brokers, "n2");
    // Keys until one lands on a (durable) shard n3 owned: it waits for n3, and says so at once.
    let mut refused = None;
    for k in 0..60 {
        let started = Instant::now();
        let (ok, _, err) = cli(n2, &["publish", "orders", "after-kill", "--ack", "--key", &format!("late-{k}")]);
        assert!(started.elapsed() < Duration::from_secs(5), "answered at once, not left hanging");
        if !ok {
            refused = Some(err);
            break;
        }
    }
    let err = refused.expect("some key routes to a shard n3 owned");
    assert!(err.contains("shard_unavailable"), "{err}");
    // Several bootstrap addresses, the first one dead: the next one serves.
    let n1 = by_name(&brokers, "n1");
    let both = format!("{},{}", victim.client, n1.client);
    let (ok, out, err) =
        cli_at_addrs(&both, n1.dir.path(), &["read", "orders", "--shard", &live_shard.to_string(), "--from", "0"]);
    assert!(ok && !out.is_empty(), "{err}");
    let (ok, out, err) =
        cli(by_name(&brokers, "n1"), &["read", "orders", "--shard", &live_shard.to_string(), "--from", "0"]);
    assert!(ok && !out.is_empty(), "n1 still serves its shard: {err}");
    // n3 comes back with its data directory: active again, it serves its shards with everything
    // it had before the kill.
    let n3_shard = owner_of.iter().position(|o| o == "n3").unwrap();
    let dir = std::mem::replace(&mut victim.dir, tempfile::tempdir().unwrap());
    let (client, metrics) = (victim.client, victim.metrics);
    drop(victim);
    let child = Command::new(BIN)
        .args(["serve", "--listen", &client.to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--dev-token", TOKEN, "--default-shards", "6", "--node-id", "n3"])
        .args(["--cluster-listen", &clusters[2].to_string(), "--peers", &peers, "--cluster-secret", "test-secret"])
        .args(["--metrics-listen", &metrics.to_string()])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Killed when dropped, whatever happens below.
    let back = Broker { child, name: "n3".into(), client, metrics, dir };
    // (Its own view is the log it replayed until the leader confirmed it caught up: fenced
    // until then, whatever that view says.)
    wait_for("n3 active again, for everyone, and n3 caught up", 20, || {
        brokers.iter().chain([&back]).all(|b| {
            status(b).is_some_and(|v| {
                v["members"]
                    .as_array()
                    .is_some_and(|m| m.iter().any(|m| m["node_id"] == "n3" && m["state"] == "active"))
                    && v["fenced"] == false
            })
        })
    });
    let (ok, out, err) = cli(&back, &["read", "orders", "--shard", &n3_shard.to_string(), "--from", "0"]);
    assert!(ok && out.lines().count() >= 1, "n3 serves what it had: {err}");
    let records: Vec<&str> = out.lines().map(|l| l.split('\t').nth(1).unwrap()).collect();
    assert!(records.iter().all(|r| seen.iter().any(|s| s == r)), "{records:?}");
}

/// `felix-node demo --cluster`: three brokers in-process, every record stored on its owner, the
/// redirect shown.
#[test]
fn the_cluster_demo_runs() {
    let out = Command::new(BIN).args(["demo", "--cluster"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{text}{}", String::from_utf8_lossy(&out.stderr));
    let stored: usize = text
        .lines()
        .filter(|l| l.starts_with("shard ") && l.ends_with(" records"))
        .map(|l| l.rsplit(' ').nth(1).unwrap().parse::<usize>().unwrap())
        .sum();
    assert_eq!(stored, 31, "the first record and 30 more, each once: {text}");
    assert!(text.contains("not_leader"), "{text}");
}

/// Half a cluster configuration is an error before anything starts.
#[test]
fn half_a_cluster_configuration_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--listen", &free_udp().to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--node-id", "n1"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("a cluster needs all of node id, cluster listen address and peers"), "{err}");
    let out = Command::new(BIN)
        .args(["serve", "--listen", &free_udp().to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--node-id", "n9", "--cluster-listen", &free_udp().to_string(), "--peers", "n1=127.0.0.1:7001"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("must list this broker (n9)"));
    let out = Command::new(BIN).args(["serve", "--peers", "n1=nowhere"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("is not an address"));
    // A move bandwidth that is not a rate, as a flag or in the file, is named.
    let out = Command::new(BIN).args(["serve", "--move-bandwidth", "fast"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("like 50MB/s"));
    let cluster = free_udp();
    let config = dir.path().join("cluster.toml");
    std::fs::write(
        &config,
        format!("[cluster]\nnode_id = \"n1\"\nlisten = \"{cluster}\"\npeers = \"n1={cluster}\"\nmove_bandwidth = \"0MB/s\"\n"),
    )
    .unwrap();
    let out = Command::new(BIN)
        .args(["serve", "--listen", &free_udp().to_string(), "--data-dir"])
        .arg(dir.path())
        .arg("--config")
        .arg(&config)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("config cluster.move_bandwidth") && err.contains("above zero"), "{err}");
}

/// `felix-node sim --cluster`: the metadata group's simulation from the command line, and a seed
/// that replays to the same digest.
#[test]
fn the_cluster_simulation_runs_from_the_command_line() {
    let out = Command::new(BIN).args(["sim", "--cluster", "--seeds", "20", "--quiet"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("20 seeds passed"), "{text}");
    let once = || {
        let out = Command::new(BIN).args(["sim", "--cluster", "--seed", "7"]).output().unwrap();
        String::from_utf8_lossy(&out.stdout).lines().next().unwrap_or_default().to_owned()
    };
    let first = once();
    assert!(first.contains("digest"), "{first}");
    assert_eq!(first, once());
}

#[test]
fn an_operator_adds_a_fourth_broker_and_removes_it_with_force() {
    let (brokers, peers) = three_formed(|_| Vec::new());
    let publish = |b: &Broker, key: &str| {
        for _ in 0..100 {
            let (ok, _, err) = cli(b, &["publish", "orders", key, "--ack", "--key", key]);
            if ok {
                return;
            }
            assert!(err.contains("shard_unavailable"), "{err}");
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("publish through {} never acknowledged", b.name);
    };
    publish(&brokers[0], "first");
    // n4 starts joining; nothing changes until an operator adds it.
    let (c4, k4) = (free_udp(), free_udp());
    let n4 = start_with("n4", c4, k4, &peers, &["--join"]);
    let admin = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["cluster"])
            .args(args)
            .args(["--metrics", &brokers[1].metrics.to_string(), "--wait", "30s"])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let member = format!("n4={k4}");
    let (ok, _, err) = admin(&["add", &member, "--cluster-secret", "wrong"]);
    assert!(!ok && err.contains("secret"), "{err}");
    let (ok, _, err) = admin(&["add", "n4-no-address"]);
    assert!(!ok && err.contains("ID=HOST:PORT"), "{err}");
    let (ok, out, err) = admin(&["add", &member, "--cluster-secret", "test-secret"]);
    assert!(ok, "{err}");
    assert!(out.contains("n4 is a member, active"), "{out}");
    wait_for("n4 sees four voters and the whole metadata", 20, || {
        status(&n4).is_some_and(|v| {
            v["voters"].as_array().is_some_and(|m| m.len() == 4)
                && v["members"].as_array().is_some_and(|m| m.len() == 4)
                && owners(&v).len() == 6
        })
    });
    // Its share of the durable shards is copied to it, then handed over.
    wait_for("n4 took a share", 20, || status(&brokers[0]).is_some_and(|v| owners(&v).iter().any(|o| o == "n4")));
    publish(&n4, "through-n4");
    // It owns durable shards: removing it is refused without --force, done with it.
    let (ok, _, err) = admin(&["remove", "n4", "--cluster-secret", "test-secret"]);
    assert!(!ok && err.contains("durable shard") && err.contains("force"), "{err}");
    let (ok, out, err) = admin(&["remove", "n4", "--force", "--cluster-secret", "test-secret"]);
    assert!(ok, "{err}");
    assert!(out.contains("n4 was removed"), "{out}");
    wait_for("the three see three voters and own everything", 20, || {
        brokers.iter().all(|b| {
            status(b).is_some_and(|v| {
                v["voters"].as_array().is_some_and(|m| m.len() == 3) && owners(&v).iter().all(|o| o != "n4")
            })
        })
    });
    publish(&brokers[2], "after");
    drop(n4);
    // A revocation asked of one broker is applied by every broker (through the metadata group).
    let (ok, _, err) = admin(&["revoke", "--cluster-secret", "test-secret"]);
    assert!(!ok && err.contains("--jti"), "names nothing: {err}");
    let (ok, out, err) = admin(&["revoke", "--jti", "leaked token/1", "--cluster-secret", "test-secret"]);
    assert!(ok && out.contains("revoked on every broker"), "{out}{err}");
    wait_for("every broker lists the revocation", 20, || {
        brokers.iter().all(|b| {
            status(b).is_some_and(|v| {
                v["revoked"]["jti"].as_array().is_some_and(|j| j.iter().any(|x| x == "leaked token/1"))
            })
        })
    });
}

#[test]
fn a_broker_restarted_with_a_wiped_data_directory_is_refused_then_re_added() {
    let names = ["n1", "n2", "n3"];
    let clients: Vec<SocketAddr> = names.iter().map(|_| free_udp()).collect();
    let clusters: Vec<SocketAddr> = names.iter().map(|_| free_udp()).collect();
    let peers = names.iter().zip(&clusters).map(|(n, a)| format!("{n}={a}")).collect::<Vec<_>>().join(",");
    let mut brokers: Vec<Broker> =
        names.iter().enumerate().map(|(i, n)| start(n, clients[i], clusters[i], &peers)).collect();
    wait_for("three members", 30, || {
        brokers.iter().all(|b| status(b).is_some_and(|v| v["members"].as_array().is_some_and(|m| m.len() == 3)))
    });
    let state_of = |b: &Broker, n: &str| {
        status(b).and_then(|v| {
            v["members"]
                .as_array()?
                .iter()
                .find(|m| m["node_id"] == n)
                .map(|m| m["state"].as_str().unwrap_or("").to_owned())
        })
    };
    // n3 is killed and started again on an empty data directory.
    drop(brokers.pop());
    let wiped = start("n3", clients[2], clusters[2], &peers);
    wait_for("the others declare n3 down and keep it so", 20, || {
        brokers.iter().all(|b| state_of(b, "n3").as_deref() == Some("down"))
    });
    // It is refused: however long it runs, it does not become active again.
    let until = Instant::now() + Duration::from_secs(3);
    while Instant::now() < until {
        assert!(brokers.iter().all(|b| state_of(b, "n3").as_deref() == Some("down")), "a wiped broker was let back in");
        std::thread::sleep(Duration::from_millis(200));
    }
    // The operator removes it and adds it back, joining.
    drop(wiped);
    let out = Command::new(BIN)
        .args(["cluster", "remove", "n3", "--force", "--cluster-secret", "test-secret", "--metrics"])
        .arg(brokers[0].metrics.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let back = start_with("n3", clients[2], clusters[2], &peers, &["--join"]);
    let out = Command::new(BIN)
        .args(["cluster", "add", &format!("n3={}", clusters[2]), "--cluster-secret", "test-secret", "--metrics"])
        .arg(brokers[1].metrics.to_string())
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    wait_for("n3 active again, seen by all three", 20, || {
        brokers.iter().chain([&back]).all(|b| state_of(b, "n3").as_deref() == Some("active"))
    });
}

/// Three brokers n1..n3 forming a cluster (`extra(i)`: more `serve` arguments for broker i),
/// once all three see three members and one leader and none is fenced; and the `--peers` list.
fn three_formed(extra: impl Fn(usize) -> Vec<String>) -> (Vec<Broker>, String) {
    let names = ["n1", "n2", "n3"];
    let clients: Vec<SocketAddr> = names.iter().map(|_| free_udp()).collect();
    let clusters: Vec<SocketAddr> = names.iter().map(|_| free_udp()).collect();
    let peers = names.iter().zip(&clusters).map(|(n, a)| format!("{n}={a}")).collect::<Vec<_>>().join(",");
    let brokers: Vec<Broker> = names
        .iter()
        .enumerate()
        .map(|(i, n)| {
            let more = extra(i);
            let more: Vec<&str> = more.iter().map(String::as_str).collect();
            start_with(n, clients[i], clusters[i], &peers, &more)
        })
        .collect();
    wait_for("three members, one leader, none fenced", 30, || {
        brokers.iter().all(|b| {
            status(b).is_some_and(|v| {
                v["members"].as_array().is_some_and(|m| m.len() == 3) && !v["leader"].is_null() && v["fenced"] == false
            })
        })
    });
    (brokers, peers)
}

/// One file holding every broker's certificate (each made its own), for `--ca`.
fn certificates_of(brokers: &[Broker]) -> tempfile::NamedTempFile {
    let certs = tempfile::NamedTempFile::new().unwrap();
    let pem: String =
        brokers.iter().map(|b| std::fs::read_to_string(b.dir.path().join("tls/cert.pem")).unwrap()).collect();
    std::fs::write(certs.path(), pem).unwrap();
    certs
}

/// A child killed (and reaped) when dropped.
struct Kill(Child);

impl Drop for Kill {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts `cmd` with its stdout read line by line and its stderr gathered as it comes.
#[allow(clippy::type_complexity)]
fn spawn_lines(
    cmd: &mut Command,
) -> (std::sync::Arc<std::sync::Mutex<Vec<String>>>, std::sync::Arc<std::sync::Mutex<String>>, Kill) {
    let mut child = cmd.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap();
    let lines = std::sync::Arc::new(std::sync::Mutex::new(Vec::<String>::new()));
    let errs = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
    let (stdout, mut stderr) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let seen = lines.clone();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for l in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            seen.lock().unwrap().push(l);
        }
    });
    let e2 = errs.clone();
    std::thread::spawn(move || {
        use std::io::Read;
        let mut buf = [0u8; 512];
        while let Ok(n) = stderr.read(&mut buf) {
            if n == 0 {
                break;
            }
            e2.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
        }
    });
    (lines, errs, Kill(child))
}

/// `cluster drain` under load: the drained broker's durable shards and its cache are copied to
/// the others and handed over while records and cache puts keep coming; a CLI subscriber on
/// one of its shards and a CLI cache watcher of its cache follow them to their new owners and
/// print every record and every change once, in order; the drained broker ends owning
/// nothing, and can then be removed without --force.
#[test]
fn a_broker_drained_under_load_hands_its_shards_over_with_every_record_and_a_subscriber_follows() {
    let (brokers, _) = three_formed(|_| Vec::new());
    let publish = |b: &Broker, payload: &str, key: &str| {
        for _ in 0..200 {
            let (ok, _, err) = cli(b, &["publish", "orders", payload, "--ack", "--key", key]);
            if ok {
                return;
            }
            assert!(err.contains("shard_unavailable") || err.contains("moving"), "{err}");
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{payload} never acknowledged");
    };
    // Every broker's certificate, for clients that follow a redirect.
    let bundle_dir = tempfile::tempdir().unwrap();
    let bundle = bundle_dir.path().join("all-brokers.pem");
    let pems: String =
        brokers.iter().map(|b| std::fs::read_to_string(b.dir.path().join("tls/cert.pem")).unwrap()).collect();
    std::fs::write(&bundle, pems).unwrap();
    let ca = bundle.to_str().unwrap().to_owned();
    // Cache puts (the CLI waits out a cache being created or handed over, and follows a
    // redirect from its old owner).
    let cache_put = |b: &Broker, key: &str, value: &str| {
        for _ in 0..200 {
            let (ok, _, err) = cli(b, &["cache", "put", "sessions", key, value, "--ca", &ca]);
            if ok {
                return;
            }
            assert!(err.contains("created") || err.contains("shard_unavailable") || err.contains("moving"), "{err}");
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{key}={value} never stored");
    };
    publish(&brokers[0], "first", "k0");
    cache_put(&brokers[0], "warm", "w0");
    let cache_owner = |v: &serde_json::Value| {
        v["shards"].as_array().and_then(|a| {
            a.iter()
                .find(|s| s["kind"] == "cache" && s["name"] == "sessions")
                .and_then(|s| s["owner"].as_str().map(str::to_owned))
        })
    };
    wait_for("every broker knows the owners", 10, || {
        brokers.iter().all(|b| status(b).is_some_and(|v| owners(&v).len() == 6 && cache_owner(&v).is_some()))
    });
    // The victim owns the cache and a shard of the stream.
    let st = status(&brokers[0]).unwrap();
    let owner_of = owners(&st);
    let victim = brokers.iter().find(|b| Some(&b.name) == cache_owner(&st).as_ref()).unwrap();
    let shard = owner_of.iter().position(|o| *o == victim.name).expect("the victim owns a shard") as u32;
    let shard_arg = shard.to_string();
    let other = brokers.iter().find(|b| b.name != victim.name).unwrap();
    // Keys of the victim's shard.
    let keys: Vec<String> = (0..1000)
        .map(|k| format!("key-{k}"))
        .filter(|k| {
            felix_proto::routing::shard_for_key(Some(k.as_bytes()), 6, felix_proto::message::Routing::Modulo) == shard
        })
        .take(3)
        .collect();
    let mut expected = Vec::new();
    for i in 0..30 {
        let p = format!("before-{i}");
        publish(other, &p, &keys[i % 3]);
        expected.push(p);
    }
    // A subscriber on the victim from the start, trusting every broker (it follows the move).
    let (lines, errs, _sub) =
        spawn_lines(
            Command::new(BIN)
                .env("FELIX_ADDR", victim.client.to_string())
                .env("FELIX_DATA_DIR", victim.dir.path())
                .args(["subscribe", "orders", "--shard", &shard_arg, "--from", "0", "--ca", bundle.to_str().unwrap()]),
        );
    wait_for("the subscriber printed what was there", 20, || lines.lock().unwrap().len() >= expected.len());
    // A cache watcher on the victim, of the whole cache.
    let (watched, watch_errs, _watch) =
        spawn_lines(
            Command::new(BIN)
                .env("FELIX_ADDR", victim.client.to_string())
                .env("FELIX_DATA_DIR", victim.dir.path())
                .args(["cache", "watch", "sessions", "--prefix", "", "--ca", bundle.to_str().unwrap()]),
        );
    wait_for("the watch started", 20, || watch_errs.lock().unwrap().contains("watching"));
    let mut expected_cache = Vec::new();
    for i in 0..10 {
        let v = format!("cv-before-{i}");
        cache_put(other, &format!("c{}", i % 4), &v);
        expected_cache.push(v);
    }
    // Drain the victim while records keep coming through another broker.
    let drain = {
        let metrics = victim.metrics.to_string();
        let name = victim.name.clone();
        std::thread::spawn(move || {
            let started = Instant::now();
            let out = Command::new(BIN)
                .args(["cluster", "drain", &name, "--metrics", &metrics, "--cluster-secret", "test-secret"])
                .output()
                .unwrap();
            (out, started.elapsed())
        })
    };
    let mut i = 0;
    while !drain.is_finished() {
        let p = format!("during-{i}");
        publish(other, &p, &keys[i % 3]);
        expected.push(p);
        let v = format!("cv-during-{i}");
        cache_put(other, &format!("c{}", i % 4), &v);
        expected_cache.push(v);
        i += 1;
    }
    let (out, took) = drain.join().unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    eprintln!("drained in {took:?} with {i} records published meanwhile");
    assert!(String::from_utf8_lossy(&out.stdout).contains("done"));
    for k in 0..5 {
        let p = format!("after-{k}");
        publish(other, &p, &keys[k % 3]);
        expected.push(p);
        let v = format!("cv-after-{k}");
        cache_put(other, &format!("c{}", k % 4), &v);
        expected_cache.push(v);
    }
    // The drained broker owns nothing, everyone agrees, and it leaves without --force.
    wait_for("the drained broker owns nothing, for everyone", 10, || {
        brokers.iter().all(|b| {
            status(b).is_some_and(|v| {
                owners(&v).iter().all(|o| *o != victim.name) && v["moves"].as_array().is_some_and(Vec::is_empty)
            })
        })
    });
    // The subscriber followed: every record once, in the order published.
    wait_for("the subscriber printed every record", 30, || lines.lock().unwrap().len() >= expected.len());
    let got: Vec<String> = lines.lock().unwrap().iter().map(|l| l.split('\t').nth(1).unwrap_or(l).to_owned()).collect();
    let got: Vec<String> = got.into_iter().filter(|p| p != "first").collect();
    assert_eq!(got, expected, "subscriber stderr: {}", errs.lock().unwrap());
    assert!(errs.lock().unwrap().contains("moved"), "{}", errs.lock().unwrap());
    // The cache watcher followed the cache to its new owner: every change once, in order, at
    // offsets that only grow.
    wait_for("the watcher printed every change", 30, || watched.lock().unwrap().len() >= expected_cache.len());
    let changes: Vec<(u64, String)> = watched
        .lock()
        .unwrap()
        .iter()
        .map(|l| {
            let f: Vec<&str> = l.split('\t').collect();
            (f[0].parse().unwrap(), f[2].to_owned())
        })
        .collect();
    let values: Vec<String> = changes.iter().map(|c| c.1.clone()).collect();
    assert_eq!(values, expected_cache, "watch stderr: {}", watch_errs.lock().unwrap());
    assert!(changes.windows(2).all(|w| w[0].0 < w[1].0), "{changes:?}");
    assert!(watch_errs.lock().unwrap().contains("watching again"), "{}", watch_errs.lock().unwrap());
    // ... and the new owner holds the values (the one put before the watch too).
    let (ok, out, _) = cli(other, &["cache", "get", "sessions", "warm"]);
    assert!(ok && out.trim() == "w0", "{out}");
    let new_owner = owners(&status(other).unwrap())[shard as usize].clone();
    let new_owner = brokers.iter().find(|b| b.name == new_owner).unwrap();
    let (ok, out, err) = cli(new_owner, &["read", "orders", "--shard", &shard_arg, "--from", "0"]);
    assert!(ok, "{err}");
    assert!(out.lines().count() >= expected.len(), "the new owner holds every record: {out}");
    let removed = Command::new(BIN)
        .args([
            "cluster",
            "remove",
            &victim.name,
            "--metrics",
            &other.metrics.to_string(),
            "--cluster-secret",
            "test-secret",
        ])
        .output()
        .unwrap();
    assert!(removed.status.success(), "{}", String::from_utf8_lossy(&removed.stderr));
}

/// The operator web view (`serve --http`), driven in headless Chromium as a person would open
/// it: after `cluster move`, the page shows the three brokers, the moved shard on its new owner
/// at a newer generation, no move left in progress; without its token the page is refused.
#[test]
fn the_web_view_shows_a_moved_shard_on_its_new_owner_in_a_browser() {
    let chromium = ["chromium", "chromium-browser", "google-chrome"]
        .into_iter()
        .find(|c| Command::new(c).arg("--version").output().is_ok_and(|o| o.status.success()))
        .expect("the web view's test drives Chromium: apt-get install chromium (.ci/run installs it)");
    let names = ["n1", "n2", "n3"];
    let web = free_tcp();
    let (brokers, _) = three_formed(|i| {
        if i == 0 {
            vec!["--http".into(), web.to_string(), "--http-token".into(), "look-token".into()]
        } else {
            Vec::new()
        }
    });
    for _ in 0..100 {
        if cli(&brokers[0], &["publish", "orders", "x", "--ack", "--key", "k"]).0 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    wait_for("the owners are known", 10, || status(&brokers[0]).is_some_and(|v| owners(&v).len() == 6));
    let before = homes(&status(&brokers[0]).unwrap(), "orders");
    let (from, generation) = before[2].clone();
    let to = names.iter().find(|n| **n != from).unwrap().to_string();
    let out = Command::new(BIN)
        .args(["cluster", "move", "orders", "2", "--to", &to, "--metrics", &brokers[0].metrics.to_string()])
        .args(["--cluster-secret", "test-secret"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("done"), "{}", String::from_utf8_lossy(&out.stdout));
    let dump = |url: &str| {
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(chromium)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--dump-dom"])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(url)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let started = Instant::now();
        loop {
            if child.try_wait().unwrap().is_some() {
                break;
            }
            if started.elapsed() > Duration::from_secs(60) {
                let _ = child.kill();
                panic!("chromium did not finish within 60 s");
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let mut s = String::new();
        use std::io::Read;
        child.stdout.take().unwrap().read_to_string(&mut s).unwrap();
        s
    };
    // The token once in the address: the broker answers with a cookie and the clean address,
    // which the browser then loads logged in.
    let page = dump(&format!("http://{web}/?token=look-token"));
    assert!(page.contains("id=\"health\"") && page.contains("badge ok"), "health at a glance: {page}");
    assert!(page.contains("version ") && page.contains("id=\"uptime\""), "{page}");
    assert!(page.contains("<table id=\"streams\">"), "streams held here: {page}");
    // What a person sees: every broker, active; the moved shard on its new owner, one
    // generation on; nothing moving any more.
    for n in names {
        assert!(page.contains(&format!("<td>{n}</td><td>active</td>")), "{n} listed active: {page}");
    }
    // And how this broker's link to each of the others stands.
    assert!(page.contains("<td>this broker</td>") && page.matches("<td>up · ").count() == 2, "links: {page}");
    let row = format!("<td>stream</td><td>default/default/orders</td><td>2</td><td>{to}</td><td>");
    let at = page.find(&row).unwrap_or_else(|| panic!("shard 2 on {to}: {page}"));
    let shown: u64 = page[at + row.len()..].split('<').next().unwrap().parse().unwrap();
    assert!(shown > generation, "generation {shown} after {generation}");
    assert!(page.contains("<p id=\"moves\">none</p>"), "{page}");
    // Without the token: the login form, nothing else.
    let refused = dump(&format!("http://{web}/"));
    assert!(refused.contains("needs its token") && !refused.contains("orders"), "{refused}");
    // A screenshot check: the page renders (styled tables, colours) to far more than a blank
    // page of the same size does.
    let shot = |url: &str| {
        let profile = tempfile::tempdir().unwrap();
        let png = profile.path().join("shot.png");
        let status = Command::new(chromium)
            .args(["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars"])
            .arg("--window-size=1280,900")
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg(format!("--screenshot={}", png.display()))
            .arg(url)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        let bytes = std::fs::read(&png).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "a PNG");
        // IHDR: width and height, big-endian, at bytes 16..24.
        let dim = |at: usize| u32::from_be_bytes(bytes[at..at + 4].try_into().unwrap());
        assert_eq!((dim(16), dim(20)), (1280, 900));
        bytes.len()
    };
    let blank = shot("about:blank");
    let rendered = shot(&format!("http://{web}/?token=look-token"));
    assert!(rendered > blank * 5, "the page rendered {rendered} bytes of PNG, a blank page {blank}");
}

/// `cluster move` of a replicated shard to a broker outside its Raft group, on real processes:
/// the fourth broker joins the shard's group, takes the lead and the old leader's place, and
/// serves every record acknowledged before the move.
#[test]
fn a_replicated_shard_moves_to_a_fourth_broker_with_every_acknowledged_record() {
    let replicated = || vec!["--default-replication".to_owned(), "3".to_owned()];
    let (brokers, peers) = three_formed(|_| replicated());
    let key = (0..1000)
        .map(|k| format!("key-{k}"))
        .find(|k| {
            felix_proto::routing::shard_for_key(Some(k.as_bytes()), 6, felix_proto::message::Routing::Modulo) == 0
        })
        .unwrap();
    let publish = |b: &Broker, payload: &str| {
        for _ in 0..200 {
            let (ok, _, err) = cli(b, &["publish", "orders", payload, "--ack", "--key", &key]);
            if ok {
                return;
            }
            assert!(err.contains("shard_unavailable") || err.contains("not_leader"), "{err}");
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("{payload} never acknowledged");
    };
    let mut expected = Vec::new();
    for i in 0..10 {
        let p = format!("r{i}");
        publish(&brokers[0], &p);
        expected.push(p);
    }
    let (c4, k4) = (free_udp(), free_udp());
    let n4 = start_with("n4", c4, k4, &peers, &["--join", "--default-replication", "3"]);
    let admin = |args: &[&str]| {
        let out = Command::new(BIN)
            .args(["cluster"])
            .args(args)
            .args(["--metrics", &brokers[1].metrics.to_string(), "--cluster-secret", "test-secret", "--wait", "30s"])
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, _, err) = admin(&["add", &format!("n4={k4}")]);
    assert!(ok, "{err}");
    let (ok, out, err) = admin(&["move", "orders", "0", "--to", "n4"]);
    assert!(ok && out.contains("done"), "{out}{err}");
    let group = |v: &serde_json::Value| {
        v["replicas"].as_array().and_then(|a| {
            a.iter().find(|r| r["name"] == "orders" && r["shard"] == 0).and_then(|r| r["replicas"].as_array().cloned())
        })
    };
    wait_for("n4 leads shard 0 in a group of three it joined", 30, || {
        status(&n4).is_some_and(|v| {
            homes(&v, "orders").first().is_some_and(|h| h.0 == "n4")
                && group(&v).is_some_and(|g| g.len() == 3 && g.iter().any(|n| n == "n4"))
        })
    });
    // Every record acknowledged before the move is there, read from n4; writes go on.
    for i in 10..15 {
        let p = format!("r{i}");
        publish(&brokers[2], &p);
        expected.push(p);
    }
    let (ok, out, err) = cli(&n4, &["read", "orders", "--shard", "0", "--from", "0"]);
    assert!(ok, "{err}");
    let got: Vec<String> = out.lines().map(|l| l.split('\t').nth(1).unwrap_or(l).to_owned()).collect();
    assert_eq!(got, expected);
}

/// One cluster CA: `cluster init-ca` makes it (and refuses to overwrite it), three brokers given
/// it with `--cluster-ca` take certificates it signed, and a client trusting only `ca.pem` (or
/// only the broker's own `cert.pem`, which carries the CA) follows a redirect to any of them.
#[test]
fn brokers_sharing_a_cluster_ca_are_trusted_through_one_file() {
    let ca_root = tempfile::tempdir().unwrap();
    let ca = ca_root.path().join("ca");
    let ca_arg = ca.to_str().unwrap().to_owned();
    let made = Command::new(BIN).args(["cluster", "init-ca", "--out", &ca_arg]).output().unwrap();
    assert!(made.status.success(), "{}", String::from_utf8_lossy(&made.stderr));
    assert!(String::from_utf8_lossy(&made.stdout).contains("--cluster-ca"), "says what to do next");
    let again = Command::new(BIN).args(["cluster", "init-ca", "--out", &ca_arg]).output().unwrap();
    assert!(!again.status.success(), "an existing CA is not overwritten");
    assert!(String::from_utf8_lossy(&again.stderr).contains("already holds a CA"));
    let ca_pem = std::fs::read(ca.join("ca.pem")).unwrap();
    let (brokers, _) = three_formed(|_| vec!["--cluster-ca".into(), ca_arg.clone()]);
    for b in &brokers {
        let chain = std::fs::read_to_string(b.dir.path().join("tls/cert.pem")).unwrap();
        assert_eq!(chain.matches("BEGIN CERTIFICATE").count(), 2, "leaf and CA");
        assert!(chain.ends_with(std::str::from_utf8(&ca_pem).unwrap()), "the CA is the file's");
    }
    let shard = shard_away_from_n1(&brokers).0.to_string();
    // The data directory's cert.pem (the CLI's default trust) carries the CA: redirects work.
    let (ok, _, err) = cli(&brokers[0], &["read", "orders", "--shard", &shard, "--count", "1"]);
    assert!(ok, "trusting one broker's cert.pem trusts its peers: {err}");
    // A client elsewhere, with ca.pem and the token only.
    let elsewhere = tempfile::tempdir().unwrap();
    let token = std::fs::read_to_string(brokers[0].dir.path().join("dev-token")).unwrap();
    let ca_file = ca.join("ca.pem");
    let args = ["read", "orders", "--shard", &shard, "--count", "1", "--ca", ca_file.to_str().unwrap()];
    let out = Command::new(BIN)
        .env("FELIX_ADDR", brokers[1].client.to_string())
        .env("FELIX_DATA_DIR", elsewhere.path())
        .env("FELIX_TOKEN", token.trim())
        .args(args)
        .output()
        .unwrap();
    assert!(out.status.success(), "ca.pem alone is enough: {}", String::from_utf8_lossy(&out.stderr));
}

/// `cluster status` and `cluster move` over the client protocol (D52): the client address and
/// the development token, as every other command, instead of the metrics listener and the
/// cluster secret; the move is shown until done and the status agrees with the metrics one.
#[test]
fn cluster_status_and_move_work_with_the_client_address_and_token() {
    let (brokers, _) = three_formed(|_| Vec::new());
    let (ok, _, err) = cli(&brokers[0], &["publish", "orders", "x", "--ack"]);
    assert!(ok, "{err}");
    wait_for("the shards of orders have owners", 30, || status(&brokers[0]).is_some_and(|v| owners(&v).len() == 6));
    let (ok, out, err) = cli(&brokers[1], &["cluster", "status"]);
    assert!(ok, "{err}");
    assert!(out.contains("node     n2") && out.contains("leader") && out.contains("orders"), "{out}");
    let (ok, out, err) = cli(&brokers[1], &["cluster", "status", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(owners(&v), owners(&status(&brokers[1]).unwrap()), "the same owners as GET /cluster");
    // In pages (D55): four shards, then the rest, each shown once; the same from the metrics
    // listener's pages.
    let (ok, out, err) = cli(&brokers[1], &["cluster", "status", "--limit", "4"]);
    assert!(ok, "{err}");
    let next = out.lines().find_map(|l| l.strip_prefix("next page: felix-node cluster status --limit 4 --after '"));
    let cursor = next.and_then(|n| n.strip_suffix('\'')).unwrap_or_else(|| panic!("a next page: {out}")).to_owned();
    let shard_lines = |out: &str| out.lines().filter(|l| l.starts_with("  stream ")).count();
    assert_eq!(shard_lines(&out), 4, "{out}");
    let (ok, rest, err) = cli(&brokers[1], &["cluster", "status", "--limit", "4", "--after", &cursor]);
    assert!(ok, "{err}");
    assert!(rest.contains("(last page)"), "{rest}");
    assert_eq!(shard_lines(&out) + shard_lines(&rest), owners(&v).len(), "{out}{rest}");
    let metrics = brokers[1].metrics.to_string();
    let (ok, page, err) = cli(&brokers[1], &["cluster", "status", "--metrics", &metrics, "--limit", "4", "--json"]);
    assert!(ok, "{err}");
    let page: serde_json::Value = serde_json::from_str(&page).unwrap();
    assert_eq!(page["next"].as_str(), Some(cursor.as_str()), "the same cursor from both");
    let (ok, whole, err) = cli(&brokers[1], &["cluster", "status", "--metrics", &metrics, "--json"]);
    assert!(ok, "{err}");
    let whole: serde_json::Value = serde_json::from_str(&whole).unwrap();
    assert_eq!(owners(&whole), owners(&v));
    let (ok, _, err) = cli(&brokers[1], &["cluster", "status", "--after", "nonsense"]);
    assert!(!ok && err.contains("cursor"), "a bad cursor is refused: {err}");
    let (from, _) = homes(&v, "orders")[3].clone();
    let to = ["n1", "n2", "n3"].into_iter().find(|n| *n != from).unwrap();
    let (ok, out, err) = cli(&brokers[2], &["cluster", "move", "orders", "3", "--to", to]);
    assert!(ok, "{err}");
    assert!(out.contains("done"), "{out}");
    assert_eq!(homes(&status(&brokers[0]).unwrap(), "orders")[3].0, to);
    let (ok, _, err) = cli(&brokers[2], &["cluster", "move", "orders", "3", "--to", "nosuch"]);
    assert!(!ok && err.contains("nosuch"), "the metadata's reason: {err}");
}

/// Creates `orders` through n1 (one acknowledged publish) and waits until its six shards have
/// owners; a shard n1 does not own, and its owner.
fn shard_away_from_n1(brokers: &[Broker]) -> (usize, String) {
    let (ok, _, err) = cli(&brokers[0], &["publish", "orders", "x", "--ack"]);
    assert!(ok, "{err}");
    let mut away = None;
    wait_for("the shards of orders have owners", 30, || {
        let Some(v) = status(&brokers[0]) else { return false };
        let o = owners(&v);
        away = o.iter().position(|n| n != "n1").map(|s| (s, o[s].clone()));
        o.len() == 6 && away.is_some()
    });
    away.unwrap()
}

/// A client that trusts only the broker it dials, sent by a redirect to another broker, is told
/// which broker's certificate it does not trust and how to fix it; with both certificates in
/// one `--ca` file the same read works.
#[test]
fn a_redirect_to_an_untrusted_broker_names_it_and_says_how_to_trust_it() {
    let (brokers, _) = three_formed(|_| Vec::new());
    let (shard, owner) = shard_away_from_n1(&brokers);
    let owner = brokers.iter().find(|b| b.name == owner).unwrap();
    let (ok, _, err) = cli(&brokers[0], &["read", "orders", "--shard", &shard.to_string(), "--count", "1"]);
    assert!(!ok, "the owner's certificate is not trusted");
    assert!(err.contains(&owner.client.to_string()), "names the broker: {err}");
    assert!(err.contains("not trusted") && err.contains("--ca"), "says how to fix it: {err}");
    let both = tempfile::NamedTempFile::new().unwrap();
    let mut pem = std::fs::read_to_string(brokers[0].dir.path().join("tls/cert.pem")).unwrap();
    pem.push_str(&std::fs::read_to_string(owner.dir.path().join("tls/cert.pem")).unwrap());
    std::fs::write(both.path(), pem).unwrap();
    let ca = both.path().to_str().unwrap();
    let (ok, _, err) = cli(&brokers[0], &["read", "orders", "--shard", &shard.to_string(), "--ca", ca]);
    assert!(ok, "trusting both, the redirect is followed: {err}");
    // Every broker lists the cluster's streams, and `stream info` asks each shard's owner.
    let mut pem = String::new();
    for b in &brokers {
        pem.push_str(&std::fs::read_to_string(b.dir.path().join("tls/cert.pem")).unwrap());
    }
    std::fs::write(both.path(), pem).unwrap();
    for i in 0..5 {
        let (ok, _, err) =
            cli(&brokers[1], &["publish", "orders", &format!("r{i}"), "--key", &format!("k{i}"), "--ack", "--ca", ca]);
        assert!(ok, "{err}");
    }
    let (ok, out, err) = cli(&brokers[2], &["stream", "list"]);
    assert!(ok, "{err}");
    assert_eq!(out, "default/orders\t6 shards\n");
    let (ok, out, err) = cli(&brokers[0], &["stream", "info", "orders", "--json", "--ca", ca]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["records"], 6, "the first record and five keyed ones, from every owner: {v}");
    assert_eq!(v["per_shard"].as_array().unwrap().len(), 6);
}

/// `read --replica-local` reads each broker's own copy of a replicated stream, follower or
/// leader: on three brokers holding every shard, the three copies agree with the leaders' read.
#[test]
fn read_replica_local_shows_every_replicas_copy_and_they_agree() {
    let (brokers, _) = three_formed(|_| vec!["--default-replication".into(), "3".into()]);
    let certs = certificates_of(&brokers);
    let ca = certs.path().to_str().unwrap();
    let mut published = false;
    wait_for("the replicated stream takes writes", 30, || {
        published = cli(&brokers[0], &["publish", "ledger", "first", "--ack", "--ca", ca]).0;
        published
    });
    for i in 0..6 {
        let (ok, _, err) =
            cli(&brokers[0], &["publish", "ledger", &format!("r{i}"), "--key", &format!("k{i}"), "--ack", "--ca", ca]);
        assert!(ok, "{err}");
    }
    let (ok, leaders, err) = cli(&brokers[0], &["read", "ledger", "--ca", ca]);
    assert!(ok, "{err}");
    assert_eq!(leaders.lines().count(), 7, "{leaders}");
    for b in &brokers {
        let mut copy = String::new();
        wait_for("this replica applied every record", 30, || {
            let (ok, out, _) = cli(b, &["read", "ledger", "--replica-local"]);
            copy = out;
            ok && copy == leaders
        });
        assert_eq!(copy, leaders, "{}'s own copy", b.name);
    }
}

/// D59 from the command line: on a replicated stream of a three-broker cluster, records
/// published through any broker (forwarded to their shards' leaders) keep their keys, their
/// envelopes and their compressed form: a filtered subscriber through another broker reads
/// only its keys and opens them with its key file, and every replica's log on disk holds the
/// ciphertext and the compressed block, never the plain text.
#[test]
fn filters_envelopes_and_compression_work_across_a_replicated_cluster() {
    let (brokers, _) = three_formed(|_| vec!["--default-replication".into(), "3".into()]);
    let certs = certificates_of(&brokers);
    let ca = certs.path().to_str().unwrap();
    let keys = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(keys.path(), format!("k1 {}\n", "11".repeat(32))).unwrap();
    let key_file = keys.path().to_str().unwrap();
    wait_for("the replicated stream takes writes", 30, || {
        cli(&brokers[0], &["publish", "warmup", "first", "--ack", "--ca", ca]).0
    });
    // Sealed records, keyed by region, through every broker.
    for (i, region) in ["eu-1", "us-1", "eu-2", "ap-1", "eu-3", "us-2"].iter().enumerate() {
        let b = &brokers[i % 3];
        let body = format!("secret for {region}");
        let (ok, _, err) =
            cli(b, &["publish", "vault", &body, "--key", region, "--ack", "--encrypt-key-file", key_file, "--ca", ca]);
        assert!(ok, "{}: {err}", b.name);
    }
    let (ok, out, err) = cli(
        &brokers[2],
        &[
            "subscribe",
            "vault",
            "--from",
            "earliest",
            "--key-prefix",
            "eu-",
            "--count",
            "3",
            "--no-resume",
            "--encrypt-key-file",
            key_file,
            "--ca",
            ca,
        ],
    );
    assert!(ok, "{err}");
    let mut got: Vec<&str> = out.lines().filter_map(|l| l.split('\t').nth(1)).collect();
    got.sort_unstable();
    assert_eq!(got, ["secret for eu-1", "secret for eu-2", "secret for eu-3"], "{out}");
    // One compressed batch of twenty alike records.
    let body = "{\"region\":\"eu-9\",\"action\":\"click\",\"page\":\"/checkout/confirm\",\"amount\":1234}";
    let mut args = vec!["publish", "orders"];
    args.extend(std::iter::repeat_n(body, 20));
    args.extend(["--key", "eu-9", "--ack", "--compress", "zstd", "--ca", ca]);
    let (ok, _, err) = cli(&brokers[1], &args);
    assert!(ok, "{err}");
    let (ok, out, err) = cli(
        &brokers[0],
        &["subscribe", "orders", "--from", "earliest", "--key", "eu-9", "--count", "20", "--no-resume", "--ca", ca],
    );
    assert!(ok, "{err}");
    assert_eq!(out.lines().filter(|l| l.ends_with(body)).count(), 20, "{out}");
    // Every replica applied them; what each holds on disk is ciphertext and the compressed block.
    for b in &brokers {
        wait_for("this replica applied the batch", 30, || {
            let (ok, out, _) = cli(b, &["read", "orders", "--replica-local"]);
            ok && out.lines().count() == 20
        });
        let mut stored = Vec::new();
        let mut stack = vec![b.dir.path().to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap().flatten() {
                if e.file_type().unwrap().is_dir() {
                    stack.push(e.path());
                } else {
                    stored.extend(std::fs::read(e.path()).unwrap_or_default());
                }
            }
        }
        assert!(!stored.windows(10).any(|w| w == b"secret for"), "{}: no plaintext on disk", b.name);
        assert!(stored.windows(5).any(|w| w == b"\x01\x01\x02k1"), "{}: the envelopes are kept", b.name);
        let copies = stored.windows(body.len()).filter(|w| *w == body.as_bytes()).count();
        assert!(copies <= 2, "{}: {copies} plain copies of the record on disk (twenty if stored plain)", b.name);
    }
}
