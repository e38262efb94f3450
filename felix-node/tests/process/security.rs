//! Certificates served, renewed and refused; minted tokens; revocation on SIGHUP; client
//! certificates.

use super::*;

/// An operator's certificate (`--tls-cert/--tls-key`): served instead of the data directory's,
/// clients trust it with `--ca`; half a pair or a bad file is a clear error before anything
/// starts.
#[test]
fn an_operators_certificate_is_served_and_bad_ones_are_refused() {
    // A certificate made by one broker's first start, used by another as "the operator's".
    let issued = tempfile::tempdir().unwrap();
    let first = serve(issued.path(), free_port(), &[]);
    drop(first);
    let (cert, key) = (issued.path().join("tls/cert.pem"), issued.path().join("tls/key.pem"));
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--dev-token", TOKEN, "--tls-cert"])
        .arg(&cert)
        .arg("--tls-key")
        .arg(&key)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut banner = Vec::new();
    loop {
        let line = lines.next().expect("a banner").unwrap();
        let done = line.trim_start().starts_with("sha256");
        banner.push(line);
        if done {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    let _broker = Broker(child);
    let text = banner.join("\n");
    assert!(text.contains(&cert.display().to_string()), "{text}");
    let fp = banner.last().unwrap().trim().trim_start_matches("sha256 ").to_owned();
    assert_eq!(fp.len(), 32 * 3 - 1, "{fp}");
    assert!(!dir.path().join("tls/cert.pem").exists(), "no certificate generated when one is given");
    // Trusted through --ca; the data directory's (absent) certificate is not needed.
    let ok =
        client_cmd(dir.path(), addr).args(["publish", "orders", "x", "--ack", "--ca"]).arg(&cert).output().unwrap();
    assert!(ok.status.success(), "{}", String::from_utf8_lossy(&ok.stderr));
    // Half a pair, a missing file, a file that is not PEM: refused at once, saying why.
    let bad = |extra: &[&std::ffi::OsStr]| {
        let out = Command::new(BIN)
            .args(["serve", "--listen", &free_port().to_string(), "--data-dir"])
            .arg(dir.path())
            .args(extra)
            .output()
            .unwrap();
        assert!(!out.status.success());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let e = bad(&["--tls-cert".as_ref(), cert.as_os_str()]);
    assert!(e.contains("--tls-key"), "{e}");
    let e = bad(&["--tls-cert".as_ref(), "/nonexistent.pem".as_ref(), "--tls-key".as_ref(), key.as_os_str()]);
    assert!(e.contains("nonexistent.pem"), "{e}");
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let e = bad(&["--tls-cert".as_ref(), junk.as_os_str(), "--tls-key".as_ref(), key.as_os_str()]);
    assert!(e.contains("junk.pem"), "{e}");
}

/// Signed tokens end to end: `token keygen` makes a key and its JWK set, `serve --jwks` trusts
/// it, `token mint` makes a token a client uses with `--token @FILE`; what its permissions do not
/// cover is `forbidden`, a token for another tenant or with a bad permission is refused.
#[test]
fn a_minted_token_is_accepted_within_its_permissions() {
    let keys = tempfile::tempdir().unwrap();
    let out = Command::new(BIN).args(["token", "keygen", "--out"]).arg(keys.path()).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let again = Command::new(BIN).args(["token", "keygen", "--out"]).arg(keys.path()).output().unwrap();
    assert!(!again.status.success(), "an existing key is never overwritten");
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let jwks = keys.path().join("jwks.json");
    let _broker = serve(dir.path(), addr, &["--jwks", jwks.to_str().unwrap()]);
    let mint = |tenant: &str, perms: &[&str]| {
        let mut c = Command::new(BIN);
        c.args(["token", "mint", "--key"]).arg(keys.path().join("signing-key.pk8")).args(["--tenant", tenant]);
        for p in perms {
            c.args(["--perm", p]);
        }
        let out = c.output().unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).trim().to_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (ok, token, err) = mint("acme", &["stream.publish:stream:acme/default/*"]);
    assert!(ok, "{err}");
    let token_file = keys.path().join("token");
    std::fs::write(&token_file, &token).unwrap();
    let as_acme = |args: &[&str]| {
        client_cmd(dir.path(), addr)
            .args(args)
            .args(["--tenant", "acme", "--token", &format!("@{}", token_file.display())])
            .output()
            .unwrap()
    };
    let p = as_acme(&["publish", "orders", "signed", "--ack"]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let r = as_acme(&["read", "orders", "--from", "0"]);
    assert!(
        !r.status.success() && String::from_utf8_lossy(&r.stderr).contains("forbidden"),
        "{}",
        String::from_utf8_lossy(&r.stderr)
    );
    // The same token for another tenant: refused.
    let other = client_cmd(dir.path(), addr)
        .args(["publish", "orders", "x", "--ack", "--tenant", "globex", "--token", &token])
        .output()
        .unwrap();
    assert!(!other.status.success() && String::from_utf8_lossy(&other.stderr).contains("unauthenticated"));
    let (ok, _, err) = mint("acme", &["stream.publish:cache:acme/x/y"]);
    assert!(!ok && err.contains("bad permission"), "{err}");
}

/// A revocation added to the configuration and reloaded with SIGHUP ends a live subscription
/// opened with the revoked token (`revoked`), while the broker keeps serving.
#[test]
fn sighup_reloads_revocations_and_ends_what_the_revoked_token_opened() {
    let keys = tempfile::tempdir().unwrap();
    let out = Command::new(BIN).args(["token", "keygen", "--out"]).arg(keys.path()).output().unwrap();
    assert!(out.status.success());
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("felix.toml");
    let jwks = keys.path().join("jwks.json");
    std::fs::write(&conf, format!("[auth]\njwks = {:?}\n", jwks.to_str().unwrap())).unwrap();
    let addr = free_port();
    let broker = serve(dir.path(), addr, &["--config", conf.to_str().unwrap()]);
    let token = Command::new(BIN)
        .args(["token", "mint", "--key"])
        .arg(keys.path().join("signing-key.pk8"))
        .args(["--tenant", "acme", "--jti", "leaked", "--perm", "stream.subscribe:stream:acme/*/*"])
        .args(["--perm", "stream.publish:stream:acme/*/*"])
        .output()
        .unwrap();
    let token = String::from_utf8_lossy(&token.stdout).trim().to_owned();
    let p = client_cmd(dir.path(), addr)
        .args(["publish", "orders", "first", "--ack", "--tenant", "acme", "--token", &token])
        .output()
        .unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest", "--tenant", "acme", "--token", &token])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().ends_with("first"), "the subscriber is live");
    std::fs::write(&conf, format!("[auth]\njwks = {:?}\nrevoked_jti = [\"leaked\"]\n", jwks.to_str().unwrap()))
        .unwrap();
    Command::new("kill").args(["-HUP", &broker.0.id().to_string()]).status().unwrap();
    // The subscriber ends, saying why, within a bounded time.
    let until = std::time::Instant::now() + Duration::from_secs(20);
    let status = loop {
        if let Some(s) = sub.try_wait().unwrap() {
            break s;
        }
        assert!(std::time::Instant::now() < until, "the revoked subscription did not end");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut sub.stderr.take().unwrap(), &mut err).unwrap();
    assert!(!status.success() && err.contains("revoked"), "{status:?} {err}");
    // The token no longer authenticates; the broker goes on serving.
    let p = client_cmd(dir.path(), addr)
        .args(["publish", "orders", "again", "--ack", "--tenant", "acme", "--token", &token])
        .output()
        .unwrap();
    assert!(!p.status.success() && String::from_utf8_lossy(&p.stderr).contains("revoked"));
    let ok = client_cmd(dir.path(), addr).args(["publish", "orders", "dev", "--ack"]).output().unwrap();
    assert!(ok.status.success());
}

/// A renewed certificate is served after SIGHUP to new connections, and a subscriber connected
/// with the old one is not dropped.
#[test]
fn a_renewed_certificate_is_served_after_sighup_without_dropping_connections() {
    // Two certificates, made by two brokers' first starts.
    let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    drop(serve(a.path(), free_port(), &[]));
    drop(serve(b.path(), free_port(), &[]));
    let live = tempfile::tempdir().unwrap();
    let (cert, key) = (live.path().join("cert.pem"), live.path().join("key.pem"));
    std::fs::copy(a.path().join("tls/cert.pem"), &cert).unwrap();
    std::fs::copy(a.path().join("tls/key.pem"), &key).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let addr = free_port();
    let broker = serve(dir.path(), addr, &["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()]);
    let ca_a = a.path().join("tls/cert.pem");
    let ca_b = b.path().join("tls/cert.pem");
    let p =
        client_cmd(dir.path(), addr).args(["publish", "orders", "one", "--ack", "--ca"]).arg(&ca_a).output().unwrap();
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let mut sub = client_cmd(dir.path(), addr)
        .args(["subscribe", "orders", "--from", "earliest", "--count", "2", "--ca"])
        .arg(&ca_a)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(sub.stdout.take().unwrap()).lines();
    assert!(lines.next().unwrap().unwrap().ends_with("one"));
    // Renewed: B's certificate at the same paths, then SIGHUP.
    std::fs::copy(b.path().join("tls/key.pem"), &key).unwrap();
    std::fs::copy(b.path().join("tls/cert.pem"), &cert).unwrap();
    Command::new("kill").args(["-HUP", &broker.0.id().to_string()]).status().unwrap();
    // New connections get B (a client trusting only A is refused once the reload landed).
    let until = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let p = client_cmd(dir.path(), addr)
            .args(["publish", "orders", "two", "--ack", "--ca"])
            .arg(&ca_b)
            .output()
            .unwrap();
        if p.status.success() {
            break;
        }
        assert!(
            std::time::Instant::now() < until,
            "the renewed certificate was not served: {}",
            String::from_utf8_lossy(&p.stderr)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let old =
        client_cmd(dir.path(), addr).args(["publish", "orders", "x", "--ack", "--ca"]).arg(&ca_a).output().unwrap();
    assert!(!old.status.success(), "the old certificate is no longer served to new connections");
    // The subscriber connected with A was not dropped: it gets the record published through B.
    assert!(lines.next().unwrap().unwrap().ends_with("two"));
    assert!(sub.wait().unwrap().success());
}

/// Mutual TLS from the command line: `serve --tls-client-ca` with `[[client_certs]]` in the
/// configuration; `publish --cert --cert-key` with no token authenticates as the mapped principal
/// within its grants; a read outside them is `forbidden`; without a certificate (and no token)
/// the client is told it has no credential; `[[client_certs]]` without a client CA stops the
/// start with the reason.
#[test]
fn a_client_certificate_authenticates_cli_commands() {
    let ca = felix_driver_tokio::tls::CertAuthority::new("clients").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let (_, cert_pem, key_pem) = ca.issue("svc-orders", &[]).unwrap();
    let (ca_file, cert, key) = (dir.path().join("ca.pem"), dir.path().join("svc.pem"), dir.path().join("svc.key"));
    std::fs::write(&ca_file, ca.cert_pem()).unwrap();
    std::fs::write(&cert, cert_pem).unwrap();
    std::fs::write(&key, key_pem).unwrap();
    let conf = dir.path().join("felix.toml");
    std::fs::write(
        &conf,
        "[[client_certs]]\nname = \"svc-orders\"\ntenant = \"acme\"\nprincipal = \"orders\"\ngrants = [{ action = \"publish\", pattern = \"default/*\" }]\n",
    )
    .unwrap();
    // Without the client CA: refused at start.
    let out = Command::new(BIN)
        .args(["serve", "--listen", &free_port().to_string(), "--data-dir"])
        .arg(dir.path().join("data-refused"))
        .arg("--config")
        .arg(&conf)
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("client_ca"));
    let addr = free_port();
    let data = dir.path().join("data");
    let _broker =
        serve(&data, addr, &["--config", conf.to_str().unwrap(), "--tls-client-ca", ca_file.to_str().unwrap()]);
    let with_cert = |args: &[&str]| {
        client_cmd(&data, addr)
            .args(args)
            .args(["--tenant", "acme", "--cert", cert.to_str().unwrap(), "--cert-key", key.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let p = with_cert(&["publish", "orders", "by-cert", "--ack"]);
    assert!(p.status.success(), "{}", String::from_utf8_lossy(&p.stderr));
    let r = with_cert(&["read", "orders", "--from", "0"]);
    assert!(!r.status.success() && String::from_utf8_lossy(&r.stderr).contains("forbidden"), "{r:?}");
    let none = client_cmd(&data, addr)
        .args(["publish", "orders", "x", "--ack", "--tenant", "acme", "--token", ""])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&none.stderr);
    assert!(!none.status.success() && err.contains("no client certificate"), "{err}");
    // The dev token still reads what the certificate wrote, recorded with its principal.
    let r = client_cmd(&data, addr).args(["read", "orders", "--from", "0", "--tenant", "acme"]).output().unwrap();
    assert!(String::from_utf8_lossy(&r.stdout).contains("by-cert"), "{r:?}");
}

/// Records the broker at `metrics` appended so far (its Prometheus counter).
pub(super) fn records_appended(metrics: SocketAddr) -> u64 {
    use std::io::{Read, Write};
    let Ok(mut s) = std::net::TcpStream::connect_timeout(&metrics, Duration::from_secs(2)) else { return 0 };
    let _ = s.write_all(b"GET /metrics HTTP/1.0\r\n\r\n");
    let mut body = String::new();
    let _ = s.read_to_string(&mut body);
    body.lines()
        .find_map(|l| l.strip_prefix("felix_records_appended_total "))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}
