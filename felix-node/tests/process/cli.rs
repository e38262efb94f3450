//! The command line as users meet it: the README's commands, bench reports, bad arguments.

use super::*;

/// `felix-node subscribe | head -n 1`: the subscriber writes its output a batch at a time, and
/// must still notice that its reader went away and exit, rather than read on for ever.
#[test]
fn subscribe_exits_once_its_output_is_closed() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let publish = |what: &str| {
        let p = client_cmd(dir.path(), addr).args(["publish", "orders", what, "--ack"]).output().unwrap();
        assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    };
    publish("first");
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    assert_eq!(lines.next().unwrap().unwrap(), "0\tfirst");
    drop(lines); // the reader goes away, as `head` does
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        // Something more to write: the write meets the closed pipe.
        publish("more");
        if let Some(s) = sub.try_wait().unwrap() {
            break s;
        }
        if std::time::Instant::now() > until {
            let _ = sub.kill();
            panic!("the subscriber went on with its output closed");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
}

#[test]
fn readme_commands_work_against_a_served_broker() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut broker = serve(dir.path(), addr, &[]);
    assert!(dir.path().join("tls/cert.pem").exists(), "certificate generated on first start");
    let publish = client_cmd(dir.path(), addr).args(["publish", "orders", "hello", "world", "--ack"]).output().unwrap();
    assert!(publish.status.success(), "{}", String::from_utf8_lossy(&publish.stderr));
    let sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest", "--count", "2"])
        .output()
        .unwrap();
    assert!(sub.status.success(), "{}", String::from_utf8_lossy(&sub.stderr));
    assert_eq!(String::from_utf8_lossy(&sub.stdout), "0\thello\n1\tworld\n");
    let json = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "1", "--count", "1", "--json"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&json.stdout).trim(), r#"{"offset":1,"payload":"world","shard":0}"#);
    // History without subscribing, and by time.
    let read = client_cmd(dir.path(), addr).args(["read", "orders", "--from", "1"]).output().unwrap();
    assert!(read.status.success(), "{}", String::from_utf8_lossy(&read.stderr));
    assert_eq!(String::from_utf8_lossy(&read.stdout), "1\tworld\n");
    let since =
        client_cmd(dir.path(), addr).args(["subscribe", "orders", "--since", "1h", "--count", "2"]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&since.stdout),
        "0\thello\n1\tworld\n",
        "{}",
        String::from_utf8_lossy(&since.stderr)
    );
    let add = client_cmd(dir.path(), addr).args(["counter", "add", "stats", "views", "5"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&add.stdout), "5\n", "{}", String::from_utf8_lossy(&add.stderr));
    let add = client_cmd(dir.path(), addr).args(["counter", "add", "stats", "views", "-7"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&add.stdout), "-2\n", "{}", String::from_utf8_lossy(&add.stderr));
    let never = client_cmd(dir.path(), addr).args(["counter", "get", "stats", "clicks"]).output().unwrap();
    assert_eq!(never.status.code(), Some(1), "never written exits 1");
    // Consumer groups: consume acks what it prints; the group's position follows.
    let consume =
        client_cmd(dir.path(), addr).args(["consume", "orders", "--group", "g1", "--count", "2"]).output().unwrap();
    assert_eq!(
        String::from_utf8_lossy(&consume.stdout),
        "0\t1\thello\n1\t1\tworld\n",
        "{}",
        String::from_utf8_lossy(&consume.stderr)
    );
    let describe = client_cmd(dir.path(), addr).args(["group", "describe", "orders", "-g", "g1"]).output().unwrap();
    assert!(
        String::from_utf8_lossy(&describe.stdout).starts_with("position\t2\ntail\t2\n"),
        "{}",
        String::from_utf8_lossy(&describe.stdout)
    );
    let seek = client_cmd(dir.path(), addr).args(["group", "seek", "orders", "-g", "g1", "earliest"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&seek.stdout), "0\n");
    let poll =
        client_cmd(dir.path(), addr).args(["group", "poll", "orders", "-g", "g1", "--max", "1"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&poll.stdout), "0\t1\thello\n");
    let ack = client_cmd(dir.path(), addr).args(["group", "ack", "orders", "-g", "g1", "5"]).output().unwrap();
    assert!(!ack.status.success(), "offset 5 was never written");
    assert!(
        String::from_utf8_lossy(&ack.stderr).contains("invalid_request"),
        "{}",
        String::from_utf8_lossy(&ack.stderr)
    );
    let put0 = client_cmd(dir.path(), addr).args(["cache", "put", "sessions", "user:1", "alice"]).output().unwrap();
    assert!(put0.status.success());
    // A watch prints the current value (--retained), then each change as it happens.
    let mut watch = client_cmd(dir.path(), addr)
        .args(["cache", "watch", "sessions", "user:1", "--retained", "--count", "2"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = std::io::BufRead::lines(std::io::BufReader::new(watch.stdout.take().unwrap()));
    let first = lines.next().unwrap().unwrap();
    assert!(first.ends_with("\tuser:1\talice"), "{first}");
    let del = client_cmd(dir.path(), addr).args(["cache", "delete", "sessions", "user:1"]).output().unwrap();
    assert!(del.status.success());
    let second = lines.next().unwrap().unwrap();
    assert!(second.ends_with("\tuser:1\t<deleted>"), "{second}");
    assert!(watch.wait().unwrap().success());
    let put = client_cmd(dir.path(), addr).args(["cache", "put", "sessions", "user:1", "alice"]).output().unwrap();
    assert!(put.status.success());
    let get = client_cmd(dir.path(), addr).args(["cache", "get", "sessions", "user:1"]).output().unwrap();
    assert_eq!(String::from_utf8_lossy(&get.stdout), "alice\n");
    let miss = client_cmd(dir.path(), addr).args(["cache", "get", "sessions", "nobody"]).output().unwrap();
    assert_eq!(miss.status.code(), Some(1), "a miss exits 1");
    // A bad token is a clear error, not a hang.
    let bad = client_cmd(dir.path(), addr).args(["--help"]).output().unwrap();
    assert!(bad.status.success());
    let bad = client_cmd(dir.path(), addr).args(["cache", "get", "s", "k", "--token", "nope"]).output().unwrap();
    assert!(!bad.status.success());
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("unauthenticated"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
    // The README's bench, briefly, against this broker.
    let bench = Command::new(BIN)
        .args(["bench", "--addr", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--subscribers", "2", "--duration", "1", "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(bench.status.success(), "{}", String::from_utf8_lossy(&bench.stderr));
    let v: serde_json::Value = serde_json::from_slice(&bench.stdout).unwrap();
    assert!(v["published_msgs"].as_u64().unwrap() > 0, "{v}");
    assert!(v["delivered_events"].as_u64().unwrap() > 0, "{v}");
    assert!(v["latency_us"]["samples"].as_u64().unwrap() > 0, "{v}");
    // Graceful shutdown on SIGTERM.
    let pid = broker.id().to_string();
    Command::new("kill").args(["-TERM", &pid]).status().unwrap();
    let status = broker.wait().unwrap();
    assert!(status.success(), "clean exit on SIGTERM: {status:?}");
}

#[test]
fn bench_baseline_reports_fractions_of_raw_quinn_and_the_relay() {
    let out = Command::new(BIN)
        .args(["bench", "--payload", "4096", "--duration", "1", "--baseline", "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let b = &v["baseline"];
    let (raw, relay) = (b["raw_quinn_mb_per_s"].as_f64().unwrap(), b["relay_mb_per_s"].as_f64().unwrap());
    assert!(raw > 0.0 && relay > 0.0, "{v}");
    let delivered = v["delivered_mb_per_s_per_subscriber"].as_f64().unwrap();
    assert!(delivered > 0.0, "{v}");
    assert!((b["fraction_of_raw_quinn"].as_f64().unwrap() - delivered / raw).abs() < 1e-9, "{v}");
    assert!((b["fraction_of_relay"].as_f64().unwrap() - delivered / relay).abs() < 1e-9, "{v}");
    if cfg!(target_os = "linux") {
        assert!(v["cpu_s_per_gb"].as_f64().unwrap() > 0.0, "CPU time is read from procfs: {v}");
        let wire = &v["client_quic_per_record"];
        assert!(wire["publishers"]["datagrams_sent"].as_f64().unwrap() > 0.0, "the publisher's datagrams: {v}");
        assert!(wire["subscribers"]["datagrams_received"].as_f64().unwrap() > 0.0, "the subscriber's: {v}");
        let stolen = v["host_steal_fraction"].as_f64().expect("the host's steal is read from /proc/stat");
        assert!((0.0..=1.0).contains(&stolen), "a fraction of the machine's CPU time: {v}");
    }
}

/// `bench --late-reader`: a subscriber that starts far behind a publisher that goes on reads
/// its backlog from the segment files (the broker keeps 1 MiB in memory) and catches up.
#[test]
fn bench_late_reader_reads_its_backlog_from_disk_and_catches_up() {
    let out = Command::new(BIN)
        .args(["bench", "--subscribers", "0", "--late-reader", "60000", "--memory-bytes", "1048576"])
        .args(["--rate", "40000", "--duration", "3", "--fsync", "never", "--json", "--quiet"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let l = &v["late_reader"];
    assert_eq!(l["skipped_by_retention"], 0, "nothing retention would remove: {v}");
    assert!(l["read"].as_u64().unwrap() >= 60_000, "read at least its backlog: {v}");
    assert!(l["caught_up_after_s"].as_f64().is_some(), "caught up with the live tail: {v}");
    assert!(l["read_per_s_while_behind"].as_f64().unwrap() > 40_000.0, "faster than the publisher: {v}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    let out = Command::new(BIN).args(["serve", "--fsync", "sometimes"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown fsync policy"));
    let out =
        Command::new(BIN).args(["subscribe", "s", "--from", "yesterday", "--addr", "127.0.0.1:1"]).output().unwrap();
    assert!(!out.status.success());
    let out = Command::new(BIN).args(["publish"]).output().unwrap();
    assert!(!out.status.success());
    let out = Command::new(BIN).args(["subscribe", "s", "--since", "10 fortnights"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown unit"), "{}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(BIN).args(["subscribe", "s", "--since", "1m", "--from", "earliest"]).output().unwrap();
    assert!(!out.status.success(), "--since and --from conflict");
    let out = Command::new(BIN).args(["cache", "get", "c", "k", "--data-dir", "/nonexistent-felix"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent-felix"), "names the missing file");
    let out = Command::new(BIN).args(["serve", "--worker-threads", "0"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--worker-threads"), "names the flag");
    let out = Command::new(BIN).args(["serve", "--max-udp-payload", "70000"]).output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--max-udp-payload"), "names the flag");
    let out = Command::new(BIN).args(["bench", "--cache", "--baseline"]).output().unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("--baseline goes with"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
