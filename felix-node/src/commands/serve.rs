//! `serve`: a broker (single or a cluster's member) from flags and its config file, its
//! certificates and tokens reloaded when their files change.

use super::*;

pub async fn serve(a: ServeArgs) -> Result<ExitCode, String> {
    let file = match &a.config {
        Some(p) => crate::config::FileConfig::load(p)?,
        None => crate::config::FileConfig::default(),
    };
    let b = &file.broker;
    // Precedence: flag or FELIX_* variable, then the file, then the built-in default.
    let listen: std::net::SocketAddr = match (a.listen, &b.listen) {
        (Some(l), _) => l,
        (None, Some(l)) => l.parse().map_err(|e| format!("config broker.listen {l:?}: {e}"))?,
        (None, None) => "127.0.0.1:5000".parse().expect("literal"),
    };
    let data_dir =
        a.data_dir.clone().or_else(|| b.data_dir.as_ref().map(Into::into)).unwrap_or_else(|| "./felix-data".into());
    let fsync = match (a.fsync, &b.fsync) {
        (Some(f), _) => f,
        (None, Some(f)) => f.parse().map_err(|e| format!("config broker.fsync: {e}"))?,
        // Nothing is acknowledged that a power cut could take back unless the operator chose a
        // lazy policy (docs/storage.md: what each loses; group commit keeps throughput).
        (None, None) => felix_driver_tokio::FsyncMode::Always,
    };
    let queue_capacity = a
        .queue_capacity
        .or(b.subscriber_queue_capacity)
        .unwrap_or(felix_proto::broker::DEFAULT_SUBSCRIBER_QUEUE_CAPACITY);
    let cluster_opts = {
        let c = &file.cluster;
        let node_id = a.node_id.clone().or_else(|| c.node_id.clone());
        let listen = match (a.cluster_listen, &c.listen) {
            (Some(l), _) => Some(l),
            (None, Some(l)) => Some(l.parse().map_err(|e| format!("config cluster.listen {l:?}: {e}"))?),
            (None, None) => None,
        };
        let peers = match (&a.peers, &c.peers) {
            (Some(p), _) => Some(p.clone()),
            (None, Some(p)) => Some(parse_peers(&p.joined()).map_err(|e| format!("config cluster.peers: {e}"))?),
            (None, None) => None,
        };
        match (node_id, listen, peers) {
            (Some(id), Some(listen), Some(peers)) => {
                let peers = peers.0;
                let join = a.join || c.join.unwrap_or(false);
                if !join && !peers.iter().any(|(n, _)| *n == id) {
                    return Err(format!("--peers must list this broker ({id}) too, with its cluster address"));
                }
                let secret = match a.cluster_secret.clone().or_else(|| c.secret.clone()) {
                    Some(s) => s,
                    None => {
                        eprintln!(
                            "warning: no --cluster-secret (FELIX_CLUSTER_SECRET, cluster.secret): using the development secret; any broker that knows it can join"
                        );
                        "felix-dev-cluster-secret".into()
                    }
                };
                Some(felix_driver_tokio::cluster::ClusterOptions {
                    node_id: id,
                    listen,
                    peers,
                    name: a.cluster_name.clone().or_else(|| c.name.clone()).unwrap_or_else(|| "felix".into()),
                    secret,
                    advertise: a.advertise.clone().or_else(|| c.advertise.clone()),
                    join,
                    replica_entry_cache: a.replica_entry_cache,
                    move_bandwidth: match (a.move_bandwidth, &c.move_bandwidth) {
                        (Some(r), _) => Some(r),
                        (None, Some(r)) => {
                            Some(parse_byte_rate(r).map_err(|e| format!("config cluster.move_bandwidth: {e}"))?)
                        }
                        (None, None) => None,
                    },
                    metadata_snapshot_entries: a.metadata_snapshot_entries.or(c.metadata_snapshot_entries),
                })
            }
            (None, None, None) => None,
            _ => {
                return Err(
                    "a cluster needs all of node id, cluster listen address and peers (flags or [cluster])".into()
                );
            }
        }
    };
    // Bind first: a port already taken is said before anything is written (a new data
    // directory, its certificate and token), not after.
    probe_ports(listen, cluster_opts.as_ref().map(|c| c.listen), [a.metrics_listen, a.http])?;
    let dir = DataDir::new(&data_dir);
    // The operator's certificate, or the data directory's (generated on first start for the
    // names the broker is reached at).
    let tls_cert = a.tls_cert.clone().or_else(|| file.tls.cert.as_ref().map(Into::into));
    let tls_key = a.tls_key.clone().or_else(|| file.tls.key.as_ref().map(Into::into));
    let cluster_ca = a.cluster_ca.clone().or_else(|| file.tls.cluster_ca.as_ref().map(Into::into));
    let names = || {
        let mut names: Vec<String> = Vec::new();
        if !listen.ip().is_unspecified() {
            names.push(listen.ip().to_string());
        }
        if let Some(adv) = a.advertise.clone().or_else(|| file.cluster.advertise.clone()) {
            names.push(adv.rsplit_once(':').map_or(adv.clone(), |(h, _)| h.trim_matches(['[', ']']).to_owned()));
        }
        names
    };
    let (identity, generated, cert_path) = match (cluster_ca.clone(), tls_cert, tls_key) {
        (Some(ca_dir), None, None) => {
            let (ca, made) = felix_driver_tokio::tls::CertAuthority::load_or_create(&ca_dir, "Felix cluster CA")
                .map_err(|e| format!("--cluster-ca: {e}"))?;
            if made {
                eprintln!(
                    "made the cluster CA in {}: give every other broker the same directory (--cluster-ca)",
                    ca_dir.display()
                );
            }
            let (id, generated) = dir.identity_from_ca(&ca, &names())?;
            (id, generated, dir.cert())
        }
        (Some(_), _, _) => {
            return Err("give either a cluster CA (--cluster-ca, [tls] cluster_ca) or the broker's own certificate \
                        (--tls-cert, [tls] cert), not both"
                .into());
        }
        (None, Some(c), Some(k)) => {
            let id = felix_driver_tokio::Identity::load(&c, &k)
                .map_err(|e| format!("--tls-cert/--tls-key: {e} (a PEM certificate chain and its PEM private key)"))?;
            (id, false, c)
        }
        (None, None, None) => {
            let (id, generated) = dir.identity_for(&names())?;
            (id, generated, dir.cert())
        }
        _ => return Err("give both --tls-cert and --tls-key (or [tls] cert and key), or neither".into()),
    };
    let fingerprint = identity.chain.first().map(felix_driver_tokio::tls::fingerprint).unwrap_or_default();
    let token = if a.dev_token.is_some() || b.dev_token.unwrap_or(true) {
        Some(dir.dev_token(a.dev_token.as_deref())?)
    } else {
        None
    };
    let banner = cluster_opts.as_ref().map(|c| (c.node_id.clone(), c.name.clone()));
    let server = start_broker(BrokerSettings {
        listen,
        data_dir: Some(data_dir.clone()),
        token: token.clone(),
        tokens: file.tokens(),
        client_certs: file.client_certs(),
        client_ca: client_ca(&a, &file)?,
        tenant_limits: file.limits(),
        jwt: load_jwt(&a, &file)?,
        streams: file.streams(queue_capacity),
        caches: file.caches(),
        queue_capacity_max: b.subscriber_queue_capacity_max.unwrap_or(65_536),
        queue_bytes_max: a.queue_bytes_max.or(b.subscriber_queue_bytes_max).unwrap_or(256 << 20),
        publisher_hold_max: a
            .publisher_hold_ms
            .or(b.publisher_hold_ms)
            .map_or(felix_proto::broker::DEFAULT_PUBLISHER_HOLD_MAX, std::time::Duration::from_millis),
        identity,
        fsync,
        ephemeral: a.ephemeral || b.ephemeral.unwrap_or(false),
        durable_caches: a.durable_caches || b.durable_caches.unwrap_or(false),
        default_shards: a.default_shards.or(file.cluster.default_shards).unwrap_or(1),
        default_replication: a.default_replication.or(file.cluster.default_replication).unwrap_or(1),
        cache_replication: a.cache_replication.or(file.cluster.cache_replication).unwrap_or(1),
        retention_records: a.retention_records,
        memory_bytes: a.memory_bytes,
        publish_window: a.publish_window.or(b.publish_window).unwrap_or(256),
        max_frame_bytes: a.max_frame_bytes.or(b.max_frame_bytes).unwrap_or(16 << 20),
        ack_on_commit: a.ack_on_commit || b.ack_on_commit.unwrap_or(false),
        auto_create: !a.no_auto_create && b.auto_create.unwrap_or(true),
        queue_capacity,
        max_records_per_read: a.max_records_per_read.or(b.max_records_per_read).unwrap_or(1000),
        group_limits: {
            let d = felix_proto::broker::GroupLimits::default();
            let ms = std::time::Duration::from_millis;
            felix_proto::broker::GroupLimits {
                visibility: a.group_visibility_ms.map_or(d.visibility, ms),
                max_visibility: a.group_max_visibility_ms.map_or(d.max_visibility, ms),
                max_wait: a.group_max_wait_ms.map_or(d.max_wait, ms),
                max_attempts: a.group_max_attempts.unwrap_or(d.max_attempts).max(1),
                max_in_flight: a.group_max_in_flight.unwrap_or(d.max_in_flight).max(1),
                ..d
            }
        },
        require_alpn: a.require_alpn || b.require_alpn.unwrap_or(false),
        admission: {
            let d = crate::node::Admission::default();
            crate::node::Admission {
                auth_timeout: a
                    .auth_timeout_ms
                    .or(b.auth_timeout_ms)
                    .map_or(d.auth_timeout, |ms| std::time::Duration::from_millis(ms.max(1))),
                max_unauthenticated: a
                    .max_unauthenticated_connections
                    .or(b.max_unauthenticated_connections)
                    .unwrap_or(d.max_unauthenticated),
                max_unauthenticated_per_address: a
                    .max_unauthenticated_per_address
                    .or(b.max_unauthenticated_per_address)
                    .unwrap_or(d.max_unauthenticated_per_address),
            }
        },
        metrics_listen: a.metrics_listen,
        http: match a.http {
            Some(addr) => Some((
                addr,
                a.http_token
                    .clone()
                    .or_else(|| token.clone())
                    .ok_or("--http needs a token: pass --http-token (FELIX_HTTP_TOKEN), or keep the dev token")?,
            )),
            None => None,
        },
        cluster: cluster_opts,
        transport: felix_driver_tokio::TransportTuning {
            max_bi_streams: a.max_streams,
            max_uni_streams: a.max_uni_streams,
            stream_receive_window: a.stream_receive_window,
            receive_window: a.receive_window,
            idle_timeout: std::time::Duration::from_millis(a.idle_timeout_ms),
            // Keep-alives must come well inside the idle timeout.
            keep_alive: std::time::Duration::from_millis((a.idle_timeout_ms / 2).clamp(100, 5_000)),
            udp_buffer_bytes: a.udp_buffer_bytes,
            max_udp_payload: a.max_udp_payload,
            ..felix_driver_tokio::TransportTuning::default()
        },
    })
    .await?;
    for r in &server.repairs {
        eprintln!("storage repaired: {r}");
    }
    let data = data_dir.display();
    out!("Felix broker listening on {} (QUIC, TLS 1.3, ALPN felix/1 or none)", server.local_addr());
    out!("  data dir     {data} ({} records recovered)", server.recovered_records);
    out!(
        "  certificate  {}{}",
        cert_path.display(),
        if generated { " (generated now: self-signed for localhost and the addresses listened on)" } else { "" }
    );
    out!("               sha256 {fingerprint}");
    match &token {
        Some(token) => out!(
            "  dev token    {token}   (stored in {}; valid for any tenant, every permission: development only)",
            dir.token().display()
        ),
        None => out!("  dev token    none (broker.dev_token = false)"),
    }
    out!("  tokens       {} from the configuration", file.tokens.len());
    match fsync {
        felix_driver_tokio::FsyncMode::Always => out!("  fsync        always (acknowledged once on disk)"),
        lazy => out!("  fsync        {lazy} (lazy: a power failure can take acknowledged writes back)"),
    }
    if let (Some(c), Some((id, name))) = (server.cluster_addr, &banner) {
        out!("  cluster      node {id}, peers on {c} (cluster {name:?})");
    }
    if let Some(h) = server.http_addr {
        // A link that opens: with the dev token (printed above anyway) it logs the browser in
        // (a cookie) and leaves the token out of the address; an operator's --http-token is
        // not printed, the page asks for it once.
        match (&a.http_token, &token) {
            (None, Some(t)) => {
                out!("  web view     http://{h}/?token={}", felix_driver_tokio::server::percent_encode_pub(t))
            }
            _ => out!("  web view     http://{h}/  (log in once with the --http-token)"),
        }
    }
    if let Some(m) = server.metrics_addr {
        out!("  metrics      http://{m}/metrics");
    }
    let hint = client_hint(
        server.local_addr(),
        &data_dir,
        token.is_some(),
        (!generated && a.tls_cert.is_some()).then_some(&cert_path),
    );
    if let Some(ca) = cluster_ca.as_ref().filter(|_| banner.is_some()) {
        // One CA signed every broker: the data directory's cert.pem carries it, so the
        // default trust follows redirects; other hosts give ca.pem.
        out!("  trust        {} (the cluster CA; clients elsewhere: --ca it)", ca.join("ca.pem").display());
        out!("Try, from this directory:");
        out!("  felix-node subscribe orders --from earliest{hint}");
        out!("  felix-node publish orders hello world --ack{hint}");
    } else if banner.is_some() && a.tls_cert.is_none() {
        // Each broker of a cluster made its own certificate: a command redirected to another
        // broker must trust it too (docs/cluster.md, "Clients": --ca with every broker's
        // certificate). For a first try on this machine:
        out!("Try, from this directory (a cluster: requests are redirected to other brokers, whose generated");
        out!(
            "certificates this one does not vouch for; give --ca a file with every broker's cert.pem, or for a first try):"
        );
        let hint = format!("{hint} --insecure-accept-any-certificate");
        out!("  felix-node subscribe orders --from earliest{hint}");
        out!("  felix-node publish orders hello world --ack{hint}");
    } else {
        out!("Try, from this directory:");
        out!("  felix-node subscribe orders --from earliest{hint}");
        out!("  felix-node publish orders hello world --ack{hint}");
    }
    out!("Ctrl-C or SIGTERM stops the broker cleanly (draining first); SIGHUP reloads the JWK set and revocations.");
    tokio::select! {
        () = wait_for_shutdown() => {}
        () = reload_auth_forever(&a, &server) => {}
    }
    eprintln!(
        "draining: new connections and control streams refused, finishing what is in flight (up to {:?}; a second signal stops at once)",
        a.drain_grace
    );
    let left = tokio::select! {
        left = server.drain(a.drain_grace) => left,
        () = wait_for_shutdown() => {
            eprintln!("stopping at once");
            return Ok(ExitCode::SUCCESS);
        }
    };
    if left == 0 {
        eprintln!("drained: nothing in flight; storage flushed, connections closed");
    } else {
        eprintln!("stopped after {:?} with {left} operation(s) still in flight (cut short)", a.drain_grace);
    }
    Ok(ExitCode::SUCCESS)
}

/// What a client command needs besides its defaults to reach this broker from the directory it
/// was started in: the address unless it is the default one, the data directory (for the
/// certificate and dev token) unless it is ./felix-data, an operator's certificate, and a
/// token when there is no dev token. The hint must work as printed.
fn client_hint(
    addr: std::net::SocketAddr,
    data_dir: &std::path::Path,
    dev_token: bool,
    cert: Option<&std::path::PathBuf>,
) -> String {
    let mut hint = String::new();
    // A broker listening on every interface is reached on loopback from here.
    let reach = if addr.ip().is_unspecified() {
        std::net::SocketAddr::new(std::net::Ipv4Addr::LOCALHOST.into(), addr.port())
    } else {
        addr
    };
    if reach.to_string() != "127.0.0.1:5000" {
        hint.push_str(&format!(" --addr {reach}"));
    }
    if data_dir != std::path::Path::new("./felix-data") {
        hint.push_str(&format!(" --data-dir {}", data_dir.display()));
    }
    if let Some(c) = cert {
        hint.push_str(&format!(" --ca {}", c.display()));
    }
    if !dev_token {
        hint.push_str(" --token TOKEN");
    }
    hint
}

/// Binds each address the broker will listen on, and lets it go: a port in use is an error
/// before the data directory is touched (there is a moment between this and the real bind,
/// in which another process could take the port; the real bind then fails as before).
fn probe_ports(
    listen: std::net::SocketAddr,
    cluster: Option<std::net::SocketAddr>,
    http: [Option<std::net::SocketAddr>; 2],
) -> Result<(), String> {
    let in_use = |what: &str, addr: std::net::SocketAddr, e: std::io::Error| {
        format!("cannot listen on {addr} ({what}): {e}; is another broker running there? nothing was written")
    };
    std::net::UdpSocket::bind(listen).map_err(|e| in_use("QUIC, --listen", listen, e))?;
    if let Some(c) = cluster {
        std::net::UdpSocket::bind(c).map_err(|e| in_use("cluster, --cluster-listen", c, e))?;
    }
    for h in http.into_iter().flatten() {
        std::net::TcpListener::bind(h).map_err(|e| in_use("HTTP, --metrics-listen or --http", h, e))?;
    }
    Ok(())
}

/// The CA certificates client certificates are verified against (`--tls-client-ca` or `[tls]
/// client_ca`), if mutual TLS is on.
fn client_ca(
    a: &ServeArgs,
    file: &crate::config::FileConfig,
) -> Result<Option<Vec<felix_driver_tokio::tls::CertificateDer<'static>>>, String> {
    let Some(p) = a.tls_client_ca.clone().or_else(|| file.tls.client_ca.as_ref().map(Into::into)) else {
        if !file.client_certs.is_empty() {
            return Err(
                "[[client_certs]] needs --tls-client-ca or [tls] client_ca: the CA client certificates are verified against"
                    .into(),
            );
        }
        return Ok(None);
    };
    let cas = felix_driver_tokio::tls::load_certs(&p).map_err(|e| format!("--tls-client-ca: {e}"))?;
    if file.client_certs.is_empty() {
        eprintln!(
            "warning: --tls-client-ca without [[client_certs]]: client certificates are verified but grant nothing"
        );
    }
    Ok(Some(cas))
}

/// The signed-token configuration: the JWK set (`--jwks` or `[auth] jwks`) with `[auth]`'s
/// issuer, audience and revocations. `None` without a JWK set.
fn load_jwt(a: &ServeArgs, file: &crate::config::FileConfig) -> Result<Option<felix_proto::jwt::Verifier>, String> {
    let Some(p) = a.jwks.clone().or_else(|| file.auth.jwks.as_ref().map(Into::into)) else { return Ok(None) };
    let bytes = std::fs::read(&p).map_err(|e| format!("--jwks {}: {e}", p.display()))?;
    let keys = felix_proto::jwt::Jwks::parse(&bytes).map_err(|e| format!("--jwks {}: {e}", p.display()))?;
    let mut v = felix_proto::jwt::Verifier::new(keys);
    if let Some(i) = &file.auth.issuer {
        v.issuer = i.clone();
    }
    if let Some(aud) = &file.auth.audience {
        v.audience = aud.clone();
    }
    v.revoked_jti = file.auth.revoked_jti.iter().cloned().collect();
    v.revoked_sub = file.auth.revoked_sub.iter().cloned().collect();
    Ok(Some(v))
}

/// The operator's certificate and key files (`--tls-cert/--tls-key` or `[tls]`), if given.
fn tls_files(
    a: &ServeArgs,
    file: Option<&crate::config::FileConfig>,
) -> Option<(std::path::PathBuf, std::path::PathBuf)> {
    let cert = a.tls_cert.clone().or_else(|| file.and_then(|f| f.tls.cert.as_ref().map(Into::into)))?;
    let key = a.tls_key.clone().or_else(|| file.and_then(|f| f.tls.key.as_ref().map(Into::into)))?;
    Some((cert, key))
}

/// The files the reloadable configuration comes from (the configuration file, the JWK set, the
/// operator's certificate and key), with when each last changed.
fn auth_files_stamp(a: &ServeArgs) -> Vec<Option<std::time::SystemTime>> {
    let file = a.config.as_ref().and_then(|p| crate::config::FileConfig::load(p).ok());
    let jwks = a.jwks.clone().or_else(|| file.as_ref().and_then(|f| f.auth.jwks.as_ref().map(Into::into)));
    let (cert, key) = tls_files(a, file.as_ref()).unzip();
    [a.config.clone(), jwks, cert, key]
        .into_iter()
        .map(|p| p.and_then(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok()))
        .collect()
}

/// Reloads the signed-token configuration (JWK set and revocations) and the operator's
/// certificate into the running broker, on SIGHUP or when their files change; a file that no
/// longer parses keeps what was loaded, saying so. A renewed certificate is served to new
/// connections; open ones are not dropped.
async fn reload_auth_forever(a: &ServeArgs, server: &felix_driver_tokio::Server) {
    let mut stamp = auth_files_stamp(a);
    #[cfg(unix)]
    let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
    loop {
        #[cfg(unix)]
        let signalled = async {
            match hup.as_mut() {
                Some(h) => {
                    h.recv().await;
                }
                None => std::future::pending::<()>().await,
            }
        };
        #[cfg(not(unix))]
        let signalled = std::future::pending::<()>();
        tokio::select! {
            () = signalled => {}
            () = tokio::time::sleep(std::time::Duration::from_secs(2)) => {
                if auth_files_stamp(a) == stamp {
                    continue;
                }
            }
        }
        stamp = auth_files_stamp(a);
        let file = match &a.config {
            Some(p) => match crate::config::FileConfig::load(p) {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("reload: {e}; keeping the tokens configuration loaded before");
                    continue;
                }
            },
            None => crate::config::FileConfig::default(),
        };
        if let Some((cert, key)) = tls_files(a, Some(&file)) {
            match felix_driver_tokio::Identity::load(&cert, &key) {
                Ok(id) => {
                    let fp = id.chain.first().map(felix_driver_tokio::tls::fingerprint).unwrap_or_default();
                    match server.set_identity(id).await {
                        Ok(()) => eprintln!("reload: certificate {} (sha256 {fp}) for new connections", cert.display()),
                        Err(e) => eprintln!("reload: certificate {}: {e}; keeping the one served", cert.display()),
                    }
                }
                Err(e) => eprintln!("reload: {e}; keeping the certificate served"),
            }
        }
        match load_jwt(a, &file) {
            Ok(v) => {
                let what = v.as_ref().map_or("no JWK set".to_string(), |v| {
                    format!(
                        "JWK set reloaded, {} revoked token id(s), {} revoked principal(s)",
                        v.revoked_jti.len(),
                        v.revoked_sub.len()
                    )
                });
                server.set_jwt(v);
                eprintln!("reload: {what}");
            }
            Err(e) => eprintln!("reload: {e}; keeping the tokens configuration loaded before"),
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM (a broker's drain, a publisher's last send).
pub(crate) async fn wait_for_shutdown() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        if let Ok(mut term) = signal(SignalKind::terminate()) {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
            return;
        }
    }
    let _ = tokio::signal::ctrl_c().await;
}
