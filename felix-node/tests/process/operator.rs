//! What an operator meets: the banner's hint, help and renamed variables, logs of failed logins,
//! listings, the example configuration, completions and man pages, many connections, streams
//! created from a file.

use super::*;

/// The banner's "Try, from this directory" commands work as printed for a broker on another
/// port and data directory (they named ./felix-data and 127.0.0.1:5000 whatever the broker
/// used), and a second broker on a port in use fails before it writes anything (it used to
/// create a data directory, a certificate and a token first).
#[test]
fn the_banners_hint_works_as_printed_and_a_port_in_use_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut child = Command::new(BIN)
        .current_dir(dir.path())
        .env_remove("FELIX_ADDR")
        .env_remove("FELIX_DATA_DIR")
        .args(["serve", "--listen", &addr.to_string(), "--data-dir", "data"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut hints = Vec::new();
    for line in lines.by_ref() {
        let line = line.unwrap();
        if let Some(cmd) = line.trim().strip_prefix("felix-node ") {
            hints.push(cmd.split_whitespace().map(str::to_owned).collect::<Vec<_>>());
        }
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    let _broker = Broker(child);
    std::thread::spawn(move || for _ in lines {});
    assert_eq!(hints.len(), 2, "{hints:?}");
    let run = |args: &[String], more: &[&str]| {
        let out = Command::new(BIN)
            .current_dir(dir.path())
            .env_remove("FELIX_ADDR")
            .env_remove("FELIX_DATA_DIR")
            .args(args)
            .args(more)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let publish = hints.iter().find(|h| h[0] == "publish").unwrap();
    let (ok, _, err) = run(publish, &[]);
    assert!(ok, "{publish:?}: {err}");
    let subscribe = hints.iter().find(|h| h[0] == "subscribe").unwrap();
    let (ok, out, err) = run(subscribe, &["--count", "2"]);
    assert!(ok, "{subscribe:?}: {err}");
    assert_eq!(out, "0\thello\n1\tworld\n");
    // The same port again, with a data directory that does not exist yet.
    let second = Command::new(BIN)
        .current_dir(dir.path())
        .args(["serve", "--listen", &addr.to_string(), "--data-dir", "second"])
        .output()
        .unwrap();
    assert!(!second.status.success());
    let err = String::from_utf8_lossy(&second.stderr);
    assert!(err.contains("cannot listen on") && err.contains("nothing was written"), "{err}");
    assert!(!dir.path().join("second").exists(), "no data directory, certificate or token written");
}

/// `bench` draws its `\r` progress line only on a terminal: into a pipe or a log it wrote a
/// long line of carriage returns. Its summary still comes.
#[test]
fn bench_progress_is_drawn_only_on_a_terminal() {
    let out = Command::new(BIN).args(["bench", "--duration", "1", "--subscribers", "1"]).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!out.stderr.contains(&b'\r'), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(!out.stdout.is_empty(), "the summary");
}

/// Help a new user can read: `-h` short and `--help` whole, serve's flags under headings, the
/// connection flags under one; durations with units (`--ttl 500` is refused, not read as 500 s);
/// offsets explained; a variable renamed to follow its flag still read under its old name.
#[test]
fn help_is_grouped_durations_take_units_and_old_variable_names_still_work() {
    let run = |args: &[&str]| {
        let out = Command::new(BIN).args(args).output().unwrap();
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (_, short, _) = run(&["serve", "-h"]);
    let (_, long, _) = run(&["serve", "--help"]);
    assert!(
        short.lines().count() * 2 < long.lines().count(),
        "-h {} lines, --help {}",
        short.lines().count(),
        long.lines().count()
    );
    for heading in ["Listening and TLS:", "Storage:", "Cluster:", "QUIC transport:", "RUST_LOG"] {
        assert!(short.contains(heading), "{heading} in serve -h");
    }
    let (_, read_help, _) = run(&["read", "--help"]);
    assert!(read_help.contains("Connection (every client command):"), "{read_help}");
    let (code, _, err) = run(&["cache", "put", "c", "k", "v", "--ttl", "500"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("give a unit, like 500ms or 500s"), "{err}");
    let (code, _, err) = run(&["read", "orders", "--from", "garbage"]);
    assert_eq!(code, Some(2));
    assert!(err.contains("expected an offset"), "{err}");
    // FELIX_HTTP_LISTEN is FELIX_HTTP now; the old name still opens the web view.
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &free_port().to_string(), "--data-dir"])
        .arg(dir.path())
        .env("FELIX_HTTP_LISTEN", "127.0.0.1:0")
        .env_remove("FELIX_HTTP")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut web = false;
    for line in lines {
        let line = line.unwrap();
        web |= line.contains("web view");
        if line.starts_with("Ctrl-C") {
            break;
        }
    }
    let _ = child.kill();
    let out = child.wait_with_output().unwrap();
    assert!(web, "the old variable opened the web view");
    assert!(String::from_utf8_lossy(&out.stderr).contains("FELIX_HTTP_LISTEN is now FELIX_HTTP"));
}

/// A failed login is in the broker's log at the default level, with the client's address.
#[test]
fn a_failed_login_is_logged_with_its_address() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .env_remove("RUST_LOG")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    assert!(lines.any(|l| l.unwrap().starts_with("Ctrl-C")), "banner");
    let out =
        client_cmd(dir.path(), addr).args(["publish", "orders", "x", "--token", "not-the-token"]).output().unwrap();
    assert!(!out.status.success());
    Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap();
    let out = child.wait_with_output().unwrap();
    let log = String::from_utf8_lossy(&out.stderr);
    assert!(log.contains("login refused (tenant default): invalid token (from 127.0.0.1:"), "{log}");
}

/// `cache keys` lists a cache's live keys in order (paged from the broker), `group list` a
/// stream's groups with their lag: what a user looks for first (issue 37).
#[test]
fn cache_keys_and_group_list_show_what_is_there() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &[]);
    let run = |args: &[&str]| {
        let out = client_cmd(dir.path(), addr).args(args).output().unwrap();
        assert!(out.status.success(), "{args:?}: {}", String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    for k in ["user:2", "user:1", "cart:7"] {
        run(&["cache", "put", "sessions", k, "v"]);
    }
    assert_eq!(run(&["cache", "keys", "sessions"]), "cart:7\nuser:1\nuser:2\n");
    assert_eq!(run(&["cache", "keys", "sessions", "--prefix", "user:", "--max", "1"]), "user:1\n");
    run(&["publish", "orders", "a", "b", "c", "--ack"]);
    run(&["consume", "orders", "--group", "billing", "--count", "2", "--batch", "2"]);
    run(&["group", "seek", "orders", "--group", "audit", "earliest"]);
    let list = run(&["group", "list", "orders"]);
    let rows: Vec<Vec<&str>> = list.lines().skip(1).map(|l| l.split('\t').collect()).collect();
    assert_eq!(rows, [vec!["0", "audit", "0", "3", "0", "0"], vec!["0", "billing", "2", "1", "0", "0"]], "{list}");
    let missing = client_cmd(dir.path(), addr).args(["cache", "keys", "nosuch"]).output().unwrap();
    assert!(!missing.status.success() && String::from_utf8_lossy(&missing.stderr).contains("not found"));
}

/// docs/felix.example.toml starts a broker as it is (only the address and directory given on
/// the command line, which win over the file), and its token works as the comments say.
#[test]
fn the_example_configuration_starts_a_broker() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let example = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/felix.example.toml");
    let _broker = serve(dir.path(), addr, &["--config", example]);
    let out = Command::new(BIN)
        .args(["publish", "--addr", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .args([
            "--tenant",
            "acme",
            "--namespace",
            "orders",
            "--token",
            "change-me-billing",
            "created",
            "hi",
            "--ack",
            "--key",
            "k1",
        ])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("of 4"), "the configured 4 shards: {said}");
}

/// `stream list` and `stream info`: what a new user asks first, answered over the client
/// protocol (D51).
#[test]
fn stream_list_and_info_show_what_the_broker_holds() {
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let _broker = serve(dir.path(), addr, &["--default-shards", "2"]);
    let run = |args: &[&str]| {
        let out = client_cmd(dir.path(), addr).args(args).output().unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    for (ns, stream, n) in [("default", "orders", 3), ("audit", "logins", 1)] {
        for i in 0..n {
            let (ok, _, err) =
                run(&["publish", "--namespace", ns, stream, &format!("r{i}"), "--ack", "--key", &format!("k{i}")]);
            assert!(ok, "{err}");
        }
    }
    let (ok, out, err) = run(&["stream", "list"]);
    assert!(ok, "{err}");
    assert_eq!(out, "audit/logins\t2 shards\ndefault/orders\t2 shards\n");
    let (ok, out, _) = run(&["stream", "list", "--in", "default", "--json"]);
    assert!(ok);
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!((v["stream"].as_str(), v["shards"].as_u64()), (Some("orders"), Some(2)));
    let (ok, out, err) = run(&["stream", "info", "orders", "--json"]);
    assert!(ok, "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["shards"], 2);
    assert_eq!(v["durable"], true);
    assert_eq!(v["records"], 3, "every shard's records: {v}");
    assert_eq!(v["bytes"], 6);
    assert_eq!(v["per_shard"].as_array().unwrap().len(), 2);
    let next: u64 = v["per_shard"].as_array().unwrap().iter().map(|s| s["next_offset"].as_u64().unwrap()).sum();
    assert_eq!(next, 3);
    let (ok, out, _) = run(&["stream", "info", "orders"]);
    assert!(ok);
    assert!(out.starts_with("default/orders: 2 shard(s), durable (on disk), one copy, retains"), "{out}");
    let (ok, _, err) = run(&["stream", "info", "nosuch"]);
    assert!(!ok);
    assert!(err.contains("no stream default/nosuch"), "{err}");
}

/// Shell completions and man pages come from the same definitions as `--help`: a bash script
/// bash accepts that knows the subcommands, a page per subcommand; a reader that stops early
/// (`| head`) is no error.
#[test]
fn completions_and_man_pages_are_generated() {
    let out = Command::new(BIN).args(["completions", "bash"]).output().unwrap();
    assert!(out.status.success());
    let script = String::from_utf8(out.stdout).unwrap();
    assert!(
        script.contains("felix__node__subcmd__stream__subcmd__info") && script.contains("--connect-timeout"),
        "subcommands and flags"
    );
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("felix-node.bash");
    std::fs::write(&file, &script).unwrap();
    let check = Command::new("bash").arg("-n").arg(&file).output().unwrap();
    assert!(check.status.success(), "bash accepts it: {}", String::from_utf8_lossy(&check.stderr));
    for shell in ["zsh", "fish"] {
        assert!(Command::new(BIN).args(["completions", shell]).output().unwrap().status.success());
    }
    let bad = Command::new(BIN).args(["completions", "tcsh"]).output().unwrap();
    assert!(!bad.status.success() && String::from_utf8_lossy(&bad.stderr).contains("possible values"));
    let pages = dir.path().join("man");
    assert!(Command::new(BIN).args(["man", "--out"]).arg(&pages).output().unwrap().status.success());
    for page in ["felix-node.1", "felix-node-serve.1", "felix-node-stream-info.1"] {
        let text = std::fs::read_to_string(pages.join(page)).unwrap_or_else(|e| panic!("{page}: {e}"));
        assert!(text.starts_with(".ie") && text.contains(".TH"), "{page} is a man page");
    }
    // A reader that takes a few bytes and goes away.
    let mut child = Command::new(BIN).args(["completions", "bash"]).stdout(Stdio::piped()).spawn().unwrap();
    let mut first = [0u8; 8];
    std::io::Read::read_exact(child.stdout.as_mut().unwrap(), &mut first).unwrap();
    drop(child.stdout.take());
    assert!(child.wait().unwrap().success(), "a closed pipe ends it quietly");
}

/// `--worker-threads` is offered where the runtime matters and left out of the help of
/// commands where it does not (`cluster status`), yet still accepted and checked there.
#[test]
fn worker_threads_is_left_out_of_help_where_it_means_nothing() {
    let help = |args: &[&str]| String::from_utf8(Command::new(BIN).args(args).output().unwrap().stdout).unwrap();
    assert!(help(&["serve", "--help"]).contains("--worker-threads"));
    assert!(help(&["subscribe", "--help"]).contains("--worker-threads"));
    for cmd in [&["cluster", "status", "--help"][..], &["token", "mint", "--help"], &["completions", "--help"]] {
        assert!(!help(cmd).contains("worker-threads"), "{cmd:?}");
    }
    let out = Command::new(BIN)
        .args(["cluster", "status", "--worker-threads", "0", "--metrics", "127.0.0.1:1"])
        .output()
        .unwrap();
    assert!(String::from_utf8_lossy(&out.stderr).contains("0 is not in 1..=1024"), "still checked");
}

/// `bench --connections`: a broker started as a child process takes a burst of connections
/// (more than its default per-address cap of 64 unauthenticated at once, which the bench
/// raises), each with two subscriptions; the report gives the broker's own memory and CPU from
/// /proc and every subscription receives the fan-out.
#[test]
fn bench_connections_measures_many_connections_on_a_child_broker() {
    let out = Command::new(BIN)
        .args(["bench", "--connections", "150", "--subscriptions-per-connection", "2", "--idle", "1s", "--json"])
        .args(["--quiet", "--liveness", "off"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["connected"], 150, "{v}");
    assert_eq!(v["failures"], 0, "{v}");
    assert_eq!(v["fanout_deliveries"], v["fanout_expected"], "{v}");
    assert_eq!(v["fanout_expected"], 500 * 150 * 2, "{v}");
    assert!(v["broker_rss_per_connection_kb"].as_f64().is_some_and(|k| k > 0.0), "{v}");
    assert!(v["broker_idle_cpu_share_of_a_core"].as_f64().is_some(), "{v}");
}

/// `stream create` (D60): names on the command line and thousands from a file, each with its
/// shard count; a stream that exists is reported and left as it is; a bad line of the file is
/// named before anything is created; a restart brings the created streams back with their
/// shards before any record was written.
#[test]
fn streams_created_from_the_command_line_and_a_file_survive_a_restart_unwritten() {
    let dir = tempfile::tempdir().unwrap();
    let data = dir.path().join("broker");
    let addr = free_port();
    let broker = serve(&data, addr, &[]);
    let run = |args: &[&str]| run_cli(&data, addr, args);
    let (code, out, err) = run(&["stream", "create", "orders", "payments", "--shards", "3"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.starts_with("created 2 stream(s) in default"), "{out}");
    let list = dir.path().join("streams.txt");
    let mut text = String::from("# name shards\n");
    for i in 0..2500 {
        text.push_str(&format!("bulk{i:04} {}\n", 1 + i % 4));
    }
    text.push_str("orders 5\n");
    std::fs::write(&list, &text).unwrap();
    let (code, out, err) = run(&["stream", "create", "--from-file", list.to_str().unwrap(), "--json"]);
    assert_eq!(code, Some(0), "{err}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["created"].as_array().map(Vec::len), Some(2500), "{out}");
    assert_eq!(v["existed"], serde_json::json!([{"stream": "orders", "shards": 3}]), "left as it is");
    assert!(err.contains("asked for 2501 of 2501 stream(s)"), "progress: {err}");
    // A bad line is named; nothing of the file is created.
    std::fs::write(&list, "fresh1 2\nfresh2 zero\n").unwrap();
    let (code, _, err) = run(&["stream", "create", "--from-file", list.to_str().unwrap()]);
    assert_ne!(code, Some(0));
    assert!(err.contains("line 2: shard count \"zero\" is not a number from 1 to 4096"), "{err}");
    let (code, _, err) = run(&["stream", "create", "x", "--shards", "0"]);
    assert_ne!(code, Some(0));
    assert!(err.contains("--shards"), "{err}");
    // Restarted: the unwritten streams are back with their shards.
    drop(broker);
    let _broker = serve(&data, addr, &[]);
    let (code, out, err) = run(&["stream", "list"]);
    assert_eq!(code, Some(0), "{err}");
    assert!(out.lines().any(|l| l == "default/orders\t3 shards"), "{out}");
    assert!(out.lines().any(|l| l == "default/bulk0002\t3 shards"), "{out}");
    assert!(!out.contains("fresh1"), "{out}");
    assert_eq!(out.lines().filter(|l| l.starts_with("default/bulk")).count(), 2500);
}
