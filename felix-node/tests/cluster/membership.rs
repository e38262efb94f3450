//! A cluster formed, a broker killed, the demo, a half-configured cluster refused, the
//! simulation from the CLI, brokers added and removed, a wiped broker refused then re-added.

use super::*;

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
