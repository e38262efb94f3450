//! Drains and moves under load with their subscribers, seen in the web view.

use super::*;

/// Three brokers n1..n3 forming a cluster (`extra(i)`: more `serve` arguments for broker i),
/// once all three see three members and one leader and none is fenced; and the `--peers` list.
pub(super) fn three_formed(extra: impl Fn(usize) -> Vec<String>) -> (Vec<Broker>, String) {
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
pub(super) fn certificates_of(brokers: &[Broker]) -> tempfile::NamedTempFile {
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
