//! Replicated caches across leader kills; followers corrupted, far behind, paused.

use super::*;

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
pub(super) fn metric(n: &Node, name: &str) -> Option<u64> {
    let body = common::http_get(n.metrics, "/metrics")?;
    body.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
}

/// Whether broker `a`'s replica of the ledger is at broker `b`'s next offset.
pub(super) fn ledger_caught_up(a: &Node, b: &Node) -> bool {
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
pub(super) fn mended_and_nothing_lost(nodes: &mut [Node], peers: &str, any_dir: &Path, load: Load) -> Vec<String> {
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
