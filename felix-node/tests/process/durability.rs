//! Power cuts and SIGKILL of a single broker, config-file permissions, a full disk, a soak.

use super::*;

pub(super) async fn connect(data: &Path, addr: SocketAddr) -> Client {
    let certs = felix_driver_tokio::tls::load_certs(&data.join("tls/cert.pem")).unwrap();
    Client::connect(addr, ClientOptions::new("t1", TOKEN, Trust::Certificates(certs))).await.unwrap()
}

/// A single broker's acknowledged records (offset → payload) before a power cut, and what its
/// stream holds after it.
async fn power_cut_single_broker(extra: &[&str]) -> (BTreeMap<u64, Bytes>, BTreeMap<u64, Bytes>, u64) {
    use felix_driver_common::sync_journal;
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("data");
    let journal = dir.path().join("sync-journal");
    let journal_s = journal.to_string_lossy().into_owned();
    // A slow disk (20 ms a sync): a broker answering before its sync would be caught.
    let env = [(sync_journal::ENV, journal_s.as_str()), (sync_journal::DELAY_ENV, "20")];
    let addr = free_port();
    let mut broker = serve_with_env(&data, addr, extra, &env);
    let client = connect(&data, addr).await;
    let (acks_tx, mut acks_rx) = tokio::sync::watch::channel(0u64);
    let acks_tx = std::sync::Arc::new(acks_tx);
    let mut tasks = tokio::task::JoinSet::new();
    for t in 0..8u64 {
        let (c, acks_tx) = (client.clone(), acks_tx.clone());
        tasks.spawn(async move {
            let mut ok = Vec::new();
            for i in 0.. {
                let p = Bytes::from(format!("p{t}-{i}"));
                let opts = PublishOptions { ack: true, ..Default::default() };
                match c.publish("default", "power", vec![p.clone()], opts).await {
                    Ok(Some(off)) => ok.push((off, p)),
                    Ok(None) => panic!("an ack after the write carries an offset"),
                    Err(_) => break, // the power went
                }
                acks_tx.send_modify(|n| *n += 1);
            }
            ok
        });
    }
    tokio::time::timeout(Duration::from_secs(60), acks_rx.wait_for(|n| *n >= 400)).await.expect("acks").unwrap();
    broker.kill().unwrap();
    broker.wait().unwrap();
    let _ = client.close().await;
    let mut acked = BTreeMap::new();
    while let Some(r) = tasks.join_next().await {
        acked.extend(r.unwrap());
    }
    let (_, dropped) = sync_journal::power_cut(&journal).unwrap();
    let mut broker = serve_with_env(&data, addr, extra, &env);
    let client = connect(&data, addr).await;
    let mut stored = BTreeMap::new();
    let mut sub = client.subscribe("default", "power", Some(StartPosition::Earliest), None).await.unwrap();
    // Everything there is arrives in one go after the restart; a quiet second ends it.
    while let Ok(Some(SubscriptionItem::Events(b))) = tokio::time::timeout(Duration::from_secs(1), sub.next()).await {
        for (i, p) in b.records.payloads().enumerate() {
            stored.insert(b.base_offset.unwrap() + i as u64, p);
        }
    }
    broker.kill().unwrap();
    let _ = broker.wait();
    (acked, stored, dropped)
}

/// A single broker under the default policy (`--fsync always`: a write is answered once
/// synced) loses no acknowledged record to a power cut mid-load.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_loses_no_acknowledged_record_of_a_single_broker() {
    let (acked, stored, dropped) = power_cut_single_broker(&[]).await;
    for (off, p) in &acked {
        assert_eq!(stored.get(off), Some(p), "the acknowledged record at {off} survived the power cut");
    }
    eprintln!("{} acknowledged, all kept; the cut took {dropped} unsynced bytes back", acked.len());
}

/// The control: under the lazy `interval:MS` policy an operator must choose, the same power
/// cut takes acknowledged records back (docs/storage.md says how much).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_power_cut_takes_acknowledged_records_of_a_lazy_single_broker_back() {
    let (acked, stored, dropped) = power_cut_single_broker(&["--fsync", "interval:600000"]).await;
    let lost = acked.iter().filter(|(off, p)| stored.get(off) != Some(p)).count();
    eprintln!("lazy: {lost} of {} acknowledged lost ({dropped} bytes)", acked.len());
    assert!(lost > 0, "a power cut of a lazily synced broker lost nothing");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_under_acked_load_loses_and_duplicates_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let args = ["--fsync", "always", "--ack-on-commit"];
    // acked offset -> payload, across every run
    let mut acked: BTreeMap<u64, Bytes> = BTreeMap::new();
    let mut counter = 0u64;
    for round in 0..3u64 {
        let mut broker = serve(dir.path(), addr, &args);
        let client = connect(dir.path(), addr).await;
        // Publish acked batches from several tasks; kill the broker while they are in flight,
        // as soon as a round-dependent number of acks has landed.
        let (acks_tx, mut acks_rx) = tokio::sync::watch::channel(0u64);
        let acks_tx = std::sync::Arc::new(acks_tx);
        let mut tasks = tokio::task::JoinSet::new();
        for t in 0..4 {
            let c = client.clone();
            let acks_tx = acks_tx.clone();
            let base = counter + t * 1_000_000;
            tasks.spawn(async move {
                let mut ok = Vec::new();
                for i in 0..1_000_000u64 {
                    let p = Bytes::from(format!("r{round}-{}", base + i));
                    match c
                        .publish(
                            "default",
                            "crash",
                            vec![p.clone()],
                            PublishOptions { ack: true, ..Default::default() },
                        )
                        .await
                    {
                        Ok(Some(off)) => ok.push((off, p)),
                        Ok(None) => panic!("ack on commit always carries an offset"),
                        Err(_) => break, // the broker died
                    }
                    acks_tx.send_modify(|n| *n += 1);
                }
                ok
            });
        }
        counter += 4_000_000;
        let target = 200 + 300 * round;
        tokio::time::timeout(Duration::from_secs(60), acks_rx.wait_for(|n| *n >= target))
            .await
            .expect("acks arrive")
            .unwrap();
        broker.kill().unwrap(); // SIGKILL, mid-load
        broker.wait().unwrap();
        // The dead broker sends no close; end our side now instead of waiting for the idle timeout.
        let _ = client.close().await;
        let before = acked.len();
        while let Some(r) = tasks.join_next().await {
            for (off, p) in r.unwrap() {
                assert!(acked.insert(off, p).is_none(), "offset {off} acknowledged twice");
            }
        }
        eprintln!("round {round}: {} acks before SIGKILL", acked.len() - before);
    }
    assert!(acked.len() > 100, "the load ran: {} acks", acked.len());
    // Restart and read everything back.
    let mut broker = serve(dir.path(), addr, &args);
    let client = connect(dir.path(), addr).await;
    let mut sub = client.subscribe("default", "crash", Some(StartPosition::Earliest), None).await.unwrap();
    let tail = *acked.keys().last().unwrap();
    let mut stored: BTreeMap<u64, Bytes> = BTreeMap::new();
    let mut next_expected = None;
    while stored.keys().last().is_none_or(|l| *l < tail) {
        let item = tokio::time::timeout(Duration::from_secs(20), sub.next()).await.expect("replay arrives");
        let Some(SubscriptionItem::Events(b)) = item else { panic!("{item:?}") };
        for (i, p) in b.records.payloads().enumerate() {
            let off = b.base_offset.unwrap() + i as u64;
            if let Some(n) = next_expected {
                assert_eq!(off, n, "offsets are continuous");
            }
            next_expected = Some(off + 1);
            assert!(stored.insert(off, p).is_none(), "offset {off} stored twice");
        }
    }
    for (off, p) in &acked {
        assert_eq!(stored.get(off), Some(p), "acknowledged record at {off} survived");
    }
    eprintln!("{} acknowledged records all present once among {} stored", acked.len(), stored.len());
    let mut payloads: Vec<&Bytes> = stored.values().collect();
    payloads.sort();
    payloads.dedup();
    assert_eq!(payloads.len(), stored.len(), "no record stored twice");
    broker.kill().unwrap();
    let _ = broker.wait();
}

#[test]
fn config_file_tokens_and_permissions_are_enforced() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = dir.path().join("felix.toml");
    std::fs::write(
        &cfg,
        r#"

[broker]

dev_token = false

[[tokens]]

token = "reader-token"

tenant = "acme"

principal = "reader"

grants = [{ action = "subscribe", pattern = "default/*" }, { action = "cache_read", pattern = "*" }]

[[streams]]

tenant = "acme"

namespace = "default"

name = "orders"

shards = 2

"#,
    )
    .unwrap();
    let addr = free_port();
    let mut broker = {
        let mut child = Command::new(BIN)
            .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
            .arg(dir.path())
            .arg("--config")
            .arg(&cfg)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let mut banner = Vec::new();
        loop {
            let l = lines.next().unwrap().unwrap();
            banner.push(l.clone());
            if l.contains("dev token") {
                assert!(l.contains("none"), "no dev token when the config says so: {l}");
                break;
            }
        }
        std::thread::spawn(move || for _ in lines {});
        child
    };
    let run = |args: &[&str]| {
        client_cmd(dir.path(), addr).args(args).args(["--tenant", "acme", "--token", "reader-token"]).output().unwrap()
    };
    let publish = run(&["publish", "orders", "x", "--ack"]);
    assert!(!publish.status.success());
    assert!(
        String::from_utf8_lossy(&publish.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&publish.stderr)
    );
    let sub = run(&["subscribe", "orders", "--shard", "1", "--count", "0"]);
    assert!(sub.status.success(), "{}", String::from_utf8_lossy(&sub.stderr));
    let sub = run(&["subscribe", "orders", "--shard", "2"]);
    assert!(!sub.status.success(), "the configured stream has 2 shards");
    let other_tenant = client_cmd(dir.path(), addr)
        .args(["cache", "get", "c", "k", "--tenant", "other", "--token", "reader-token"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&other_tenant.stderr).contains("unauthenticated"));
    broker.kill().unwrap();
    let _ = broker.wait();
    // A typo in the file is a clear error at start.
    std::fs::write(&cfg, "[broker]\nlisen = \"127.0.0.1:1\"\n").unwrap();
    let out =
        Command::new(BIN).args(["serve", "--data-dir"]).arg(dir.path()).arg("--config").arg(&cfg).output().unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("lisen") && err.contains("felix.toml"), "{err}");
}

/// Starts `felix-node serve` under a file-size limit (`ulimit -f`, with SIGXFSZ ignored, so a
/// write past it fails with EFBIG exactly as on a full disk).
pub(super) fn serve_limited(data: &Path, addr: SocketAddr, limit_kib: u64, extra: &[&str]) -> Broker {
    let script = format!(
        "trap '' XFSZ; ulimit -S -f {limit_kib}; exec \"$0\" serve --listen {addr} --data-dir \"$1\" --dev-token {TOKEN} {}",
        extra.join(" ")
    );
    let child = Command::new("bash")
        .args(["-c", &script, BIN])
        .arg(data)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_banner(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_refuses_writes_acks_nothing_unwritten_and_recovers_when_space_returns() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    // The broker's default (acks on enqueue allowed): the client asks for acks after the write by
    // default, which is what makes an acknowledgement mean "stored".
    let args = ["--fsync", "always"];
    let mut broker = serve_limited(dir.path(), addr, 64, &args);
    let c = connect(dir.path(), addr).await;
    let acked_opts = || PublishOptions { ack: true, ..Default::default() };
    let mut acked: BTreeMap<u64, Bytes> = BTreeMap::new();
    let mut refused = 0;
    for i in 0..200u64 {
        let p = Bytes::from(format!("{i:05}{}", "d".repeat(995)));
        match c.publish("default", "full", vec![p.clone()], acked_opts()).await {
            Ok(Some(off)) => {
                acked.insert(off, p);
            }
            Ok(None) => panic!("ack on commit carries an offset"),
            Err(e) => {
                // The write that met the full disk fails (`storage`, nothing stored); from then
                // on the broker writes nothing and says so (`overloaded`, wait suggested).
                use felix_proto::error_code::RetryClass;
                match e.code().map(|c| c.name().into_owned()).as_deref() {
                    Some("storage") => assert_eq!(e.retry(), Some(RetryClass::Retry)),
                    Some("overloaded") => assert_eq!(e.retry(), Some(RetryClass::RetryAfter)),
                    other => panic!("{other:?}: {e}"),
                }
                refused += 1;
            }
        }
    }
    assert!(refused > 100 && acked.len() > 20, "{} acked, {refused} refused", acked.len());
    // Space returns: within about a second a probe write succeeds and the broker writes again.
    let pid = broker.id().to_string();
    assert!(Command::new("prlimit").args(["--pid", &pid, "--fsize=unlimited"]).status().unwrap().success());
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    for i in 0..20u64 {
        let p = Bytes::from(format!("after-{i}"));
        let off = loop {
            match c.publish("default", "full", vec![p.clone()], acked_opts()).await {
                Ok(off) => break off.unwrap(),
                Err(e) if std::time::Instant::now() < deadline => {
                    assert_eq!(e.code().map(|c| c.name().into_owned()).as_deref(), Some("overloaded"), "{e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("writes never resumed: {e}"),
            }
        };
        acked.insert(off, p);
    }
    // Everything acknowledged is there, once, and nothing else: now, and after a restart.
    for round in 0..2 {
        let c = connect(dir.path(), addr).await;
        let mut got = BTreeMap::new();
        let mut from = 0;
        loop {
            let page = c.stream_read("default", "full", 0, from, None, None).await.unwrap();
            if page.records.is_empty() {
                break;
            }
            for r in page.records {
                assert!(got.insert(r.offset, r.payload.0).is_none());
            }
            from = page.next_offset;
        }
        assert_eq!(got.keys().collect::<Vec<_>>(), acked.keys().collect::<Vec<_>>(), "round {round}: offsets");
        assert!(got == acked, "round {round}: exactly the acknowledged records");
        if round == 0 {
            broker.kill().unwrap();
            broker.wait().unwrap();
            broker = serve(dir.path(), addr, &args);
        }
    }
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// A short soak (the full one is `felix-node soak --duration 5m`): connections churn, some die
/// by SIGKILL, and every leak gauge of the broker comes back to where it started.
#[test]
fn a_short_soak_leaks_no_connection_stream_or_task() {
    let out = Command::new(BIN)
        .args(["soak", "--duration", "12s", "--connections", "8", "--streams", "20", "--interval", "3", "--json"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    let v: serde_json::Value = serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{e}: {text}"));
    assert_eq!(v["leaks"], serde_json::json!([]), "{v}");
    assert!(v["sessions"].as_u64().unwrap() > 10, "{v}");
    assert!(v["delivered"].as_u64().unwrap() > 100, "{v}");
}
