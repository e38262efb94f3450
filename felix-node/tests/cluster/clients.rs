//! What clients and operators meet: a cluster CA, status and moves through the client address,
//! redirects to an untrusted broker, replica-local reads, filters, envelopes and compression.

use super::*;

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
