//! Subscribers that fall behind, simulations replayed in another process, conformance against
//! the binary, the CLI's publishes (unacked, piped, unanswered), acks on enqueue on a full disk.

use super::*;

/// A subscriber whose broker-side queue holds a single batch falls behind under a burst; on a
/// durable stream `felix-node subscribe` resumes from the log and prints every record once, in
/// order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn subscribe_resumes_after_falling_behind_with_nothing_lost_or_repeated() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut broker = serve(dir.path(), addr, &["--queue-capacity", "1", "--queue-bytes-max", "1"]);
    const N: usize = 3000;
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "burst", "--tenant", "t1", "--from", "earliest", "--count", &N.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The stream does not exist yet: the command says it waits for it (and subscribes from
    // its start once the burst creates it). Its stderr is kept for the resume notices.
    let mut err = BufReader::new(sub.stderr.take().unwrap()).lines();
    let waiting = err.next().unwrap().unwrap();
    assert!(waiting.contains("does not exist yet"), "{waiting}");
    let notices = std::thread::spawn(move || err.map_while(Result::ok).collect::<Vec<_>>());
    // A guard, not a wait: a lost record would leave the subscriber waiting forever.
    let pid = sub.id();
    let (guard_tx, guard_rx) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        if guard_rx.recv_timeout(Duration::from_secs(120)).is_err() {
            let _ = Command::new("kill").arg(pid.to_string()).status();
        }
    });
    let client = connect(dir.path(), addr).await;
    let mut sent = tokio::task::JoinSet::new();
    for i in 0..N {
        let c = client.clone();
        sent.spawn(async move {
            // Large enough that the broker's writer credit (1 MiB) runs out during the burst.
            let p = Bytes::from(format!("r{i:05}{}", "x".repeat(4000)));
            c.publish("default", "burst", vec![p], PublishOptions::default()).await
        });
        if sent.len() >= 64 {
            sent.join_next().await.unwrap().unwrap().unwrap();
        }
    }
    while let Some(r) = sent.join_next().await {
        r.unwrap().unwrap();
    }
    let out = sub.wait_with_output().unwrap();
    let _ = guard_tx.send(());
    let notices = notices.join().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{notices:?} {} lines, last {:?}", text.lines().count(), text.lines().last());
    let offsets: Vec<u64> =
        String::from_utf8_lossy(&out.stdout).lines().map(|l| l.split('\t').next().unwrap().parse().unwrap()).collect();
    assert_eq!(offsets, (0..N as u64).collect::<Vec<_>>(), "every offset once, in order; {notices:?}");
    assert!(notices.first().is_some_and(|n| n.starts_with("subscribed to")), "{notices:?}");
    eprintln!("resume notices: {}", notices.iter().filter(|n| n.contains("resuming")).count());
    let _ = client.close().await;
    Command::new("kill").args(["-TERM", &broker.id().to_string()]).status().unwrap();
    broker.wait().unwrap();
}

/// A run of the simulation is a function of its seed: the same seed in two separate processes
/// (with their own hash seeds and allocators) prints the same trace digest.
#[test]
fn a_sim_seed_replays_to_the_same_trace_digest_in_another_process() {
    let digest = || {
        let out = Command::new(BIN).args(["sim", "--seed", "11", "--steps", "1500"]).output().unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        let stdout = String::from_utf8(out.stdout).unwrap();
        let line = stdout.lines().find(|l| l.starts_with("seed 11 ")).expect("a line for the seed").to_owned();
        assert!(line.contains(" digest "), "{line}");
        line
    };
    let (a, b) = (digest(), digest());
    assert_eq!(a, b);
}

/// `felix-node conformance --addr` against a stand-in for the released Felix broker (no ALPN,
/// `server_flags` 0x003F, no feature bits): every check that applies passes, and the ones about
/// features it does not advertise are reported skipped, not passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_conformance_against_the_released_broker_skips_what_it_does_not_advertise() {
    let legacy = felix_driver_tokio::testkit::LegacyBroker::start().await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let ca = dir.path().join("legacy.pem");
    std::fs::write(&ca, legacy.cert_pem()).unwrap();
    let out = tokio::process::Command::new(BIN)
        .args(["conformance", "--addr", &legacy.local_addr().to_string(), "--token", "any", "--tenant", "t1", "--ca"])
        .arg(&ca)
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{stdout}{}", String::from_utf8_lossy(&out.stderr));
    let summary = stdout.lines().last().unwrap_or_default();
    assert!(summary.ends_with("0 failed, 7 skipped"), "{stdout}");
    for skipped in ["error codes", "cache version", "publish_ok offset", "group record"] {
        assert!(stdout.lines().any(|l| l.starts_with("skip ") && l.contains(skipped)), "{skipped}: {stdout}");
    }
    assert!(stdout.contains("oversize frame refused on the header (the broker ended the stream)"), "{stdout}");
}

/// Every record of a stream, in offset order.
async fn read_all(c: &Client, stream: &str) -> Vec<Bytes> {
    let mut out = Vec::new();
    let mut from = 0;
    loop {
        let page = match c.stream_read("default", stream, 0, from, None, None).await {
            // Not created yet: nothing in it (a read creates no stream).
            Err(e) if e.code() == Some(&felix_proto::ErrorCode::NotFound) => return out,
            r => r.unwrap(),
        };
        if page.records.is_empty() {
            return out;
        }
        out.extend(page.records.into_iter().map(|r| r.payload.0));
        from = page.next_offset;
    }
}

/// Fire-and-forget from the command line loses nothing on a clean exit: 1,000 invocations of
/// `felix-node publish STREAM recN` (one record each, no --ack) all land. Before the client's
/// close waited for the broker, about a quarter of such records were lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_unacked_cli_publishes_all_land() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let started = std::time::Instant::now();
    let mut running = Vec::new();
    for i in 0..1000 {
        let mut cmd = tokio::process::Command::from(client_cmd(dir.path(), addr));
        cmd.env("FELIX_TENANT", "t1").args(["publish", "single", &format!("rec{i}")]);
        cmd.stdout(Stdio::null()).stderr(Stdio::piped());
        running.push(cmd.spawn().unwrap());
        if running.len() == 8 {
            for child in running.drain(..) {
                let out = child.wait_with_output().await.unwrap();
                assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
            }
        }
    }
    for child in running {
        assert!(child.wait_with_output().await.unwrap().status.success());
    }
    eprintln!("1000 invocations in {:?}", started.elapsed());
    let c = connect(dir.path(), addr).await;
    let mut got: Vec<String> = read_all(&c, "single").await.iter().map(|b| String::from_utf8_lossy(b).into()).collect();
    got.sort();
    let mut want: Vec<String> = (0..1000).map(|i| format!("rec{i}")).collect();
    want.sort();
    assert_eq!(got.len(), 1000, "{} of 1000 landed", got.len());
    assert_eq!(got, want);
}

/// `tail -f app.log | felix-node publish logs`: lines are sent as they come (after a short
/// linger, not 64 at a time), and Ctrl-C sends (and, with --ack, acknowledges) what was read
/// before the command exits with 130, saying how many records went. Both parts fail without
/// the change: three lines of a 64-line batch waited for more, and a held line was dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publishing_a_pipe_sends_lines_as_they_come_and_ctrl_c_sends_what_was_read() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let publisher = |stream: &str, extra: &[&str]| {
        let mut cmd = tokio::process::Command::from(client_cmd(dir.path(), addr));
        cmd.env("FELIX_TENANT", "t1")
            .args(["publish", stream, "--ack"])
            .args(extra)
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        cmd.spawn().unwrap()
    };
    let c = connect(dir.path(), addr).await;
    let wait_records = |stream: &'static str, n: usize| {
        let c = &c;
        async move {
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            loop {
                let got = read_all(c, stream).await;
                if got.len() >= n {
                    return got;
                }
                assert!(std::time::Instant::now() < deadline, "{stream}: {} of {n} records arrived", got.len());
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    };
    // Three lines, the pipe left open: they arrive without waiting for 61 more.
    let mut tail = publisher("piped", &[]);
    let mut stdin = tail.stdin.take().unwrap();
    stdin.write_all(b"one\ntwo\nthree\n").await.unwrap();
    assert_eq!(wait_records("piped", 3).await.len(), 3);
    drop(stdin);
    assert!(tail.wait().await.unwrap().success());
    // Batches of two that never linger: two lines arrive as a full batch (its signal handler
    // is in place by then); a third is held until Ctrl-C, which sends it.
    let mut held = publisher("held", &["--batch", "2", "--linger", "1h"]);
    let mut stdin = held.stdin.take().unwrap();
    stdin.write_all(b"a\nb\n").await.unwrap();
    assert_eq!(wait_records("held", 2).await.len(), 2);
    stdin.write_all(b"c\n").await.unwrap();
    let pid = held.id().unwrap().to_string();
    assert!(Command::new("kill").args(["-INT", &pid]).status().unwrap().success());
    let out = tokio::time::timeout(Duration::from_secs(20), held.wait_with_output()).await.unwrap().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{err}");
    assert!(err.contains("published 3 record(s)") && err.contains("interrupted"), "{err}");
    let got = wait_records("held", 3).await;
    assert_eq!(got.len(), 3, "each line once: {got:?}");
}

/// A publisher whose broker stops answering (here: SIGSTOP) exits saying what it could not get
/// confirmed, instead of claiming success.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_whose_broker_stops_answering_reports_what_was_not_confirmed() {
    use tokio::io::AsyncWriteExt;
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut broker = serve(dir.path(), addr, &[]);
    let mut cmd = tokio::process::Command::from(client_cmd(dir.path(), addr));
    cmd.env("FELIX_TENANT", "t1")
        .args(["publish", "stalled", "--batch", "1", "--close-timeout", "1s"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut publisher = cmd.spawn().unwrap();
    let mut stdin = publisher.stdin.take().unwrap();
    stdin.write_all(b"first\n").await.unwrap();
    // Connected once its first record is stored.
    let c = connect(dir.path(), addr).await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while read_all(&c, "stalled").await.is_empty() {
        assert!(std::time::Instant::now() < deadline, "the first record never arrived");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = broker.id().to_string();
    assert!(Command::new("kill").args(["-STOP", &pid]).status().unwrap().success());
    for i in 0..20 {
        stdin.write_all(format!("stalled-{i}\n").as_bytes()).await.unwrap();
    }
    drop(stdin);
    let out =
        tokio::time::timeout(Duration::from_secs(20), publisher.wait_with_output()).await.expect("exits").unwrap();
    let _ = Command::new("kill").args(["-CONT", &pid]).status();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("did not confirm receiving them") && stderr.contains("may not have been delivered"),
        "{stderr}"
    );
    broker.kill().unwrap();
    broker.wait().unwrap();
}

/// On a full disk, the faster mode (acknowledged on enqueue) stops acknowledging anything that is
/// not stored as soon as the broker learns a write failed for lack of space: publishes are then
/// refused `overloaded` (nothing written) while reads go on, and once space returns a probe write
/// succeeds and publishing resumes. Only batches acknowledged before the broker learned of the
/// failure can be missing, as docs/operations.md says of that mode.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_full_disk_acks_on_enqueue_stop_and_reads_go_on() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let broker = serve_limited(dir.path(), addr, 64, &["--fsync", "always"]);
    let certs = felix_driver_tokio::tls::load_certs(&dir.path().join("tls/cert.pem")).unwrap();
    let mut opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(certs));
    opts.config = opts.config.ack_on_enqueue();
    let c = Client::connect(addr, opts).await.unwrap();
    let acked_opts = PublishOptions { ack: true, ..Default::default() };
    let mut acked: Vec<(usize, Bytes)> = Vec::new();
    let mut first_refusal = None;
    for i in 0..200usize {
        let p = Bytes::from(format!("{i:05}{}", "e".repeat(995)));
        match c.publish("default", "enq", vec![p.clone()], acked_opts.clone()).await {
            Ok(_) => acked.push((i, p)),
            Err(e) => {
                let code = e.code().map(|c| c.name().into_owned());
                assert!(matches!(code.as_deref(), Some("overloaded" | "storage")), "{e}");
                if code.as_deref() == Some("overloaded") {
                    first_refusal.get_or_insert(i);
                }
            }
        }
        // Reads keep working whatever the disk does.
        if i % 50 == 49 {
            c.stream_read("default", "enq", 0, 0, None, Some(1)).await.unwrap();
        }
    }
    let first_refusal = first_refusal.expect("the full disk was noticed");
    let stored: std::collections::HashSet<Bytes> = read_all(&c, "enq").await.into_iter().collect();
    let lost: Vec<usize> = acked.iter().filter(|(_, p)| !stored.contains(p)).map(|(i, _)| *i).collect();
    // How many were in flight when the disk filled depends on how far storage lagged: not
    // bounded, but none acknowledged after the broker knew may be missing.
    assert!(lost.iter().all(|i| *i < first_refusal), "acknowledged after the broker knew, and lost: {lost:?}");
    eprintln!("{} acknowledged on enqueue and lost, all before the first refusal at {first_refusal}", lost.len());
    // Space returns: within about a second a probe write succeeds and publishing resumes.
    assert!(
        Command::new("prlimit")
            .args(["--pid", &broker.id().to_string(), "--fsize=unlimited"])
            .status()
            .unwrap()
            .success()
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match c.publish("default", "enq", vec![Bytes::from("after")], acked_opts.clone()).await {
            Ok(_) => break,
            Err(e) => assert!(std::time::Instant::now() < deadline, "never resumed: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    drop(broker);
}
