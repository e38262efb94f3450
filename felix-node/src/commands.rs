//! `serve`, `publish`, `subscribe` and `cache`.

use crate::node::{BrokerSettings, DataDir, client_trust, start_broker};
use crate::{
    AdminArgs, CacheArgs, CacheOp, ClusterArgs, ClusterOp, ConnectArgs, CounterArgs, CounterOp, PublishArgs, ServeArgs,
    SimArgs, StreamArgs, StreamOp,
};
use bytes::Bytes;
use felix_driver_tokio::{Client, ClientOptions, PublishOptions, SubscriptionItem};
use felix_proto::Codec;
use felix_proto::client::EndReason;
use felix_proto::error_code::RetryClass;
use felix_proto::message::StartPosition;
use std::io::Write;
use std::process::ExitCode;

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

pub async fn connect(c: &ConnectArgs) -> Result<Client, String> {
    connect_with(c, |_| {}).await
}

/// The most redirects a command follows (the spec's bound), never to the same broker twice.
const MAX_REDIRECTS: usize = 3;

/// Runs `op` on a connection to `c.addr`; when a broker of a cluster answers that another one
/// owns the shard, connects there and runs it again (at most [`MAX_REDIRECTS`] hops, never to a
/// broker already asked, never back to an older generation). Returns the client that answered.
pub async fn with_redirects<T, F, Fut>(c: &ConnectArgs, mut op: F) -> Result<(Client, T), String>
where
    F: FnMut(Client) -> Fut,
    Fut: std::future::Future<Output = (Client, Result<T, felix_driver_tokio::ClientError>)>,
{
    let mut args = c.clone();
    // The brokers actually asked (of several seeds, the one that answered): a redirect to
    // another seed is followed, one back to a broker already asked is a view in flux.
    let mut asked: Vec<std::net::SocketAddr> = Vec::new();
    let mut newest = 0u64;
    let mut sent_by: Option<String> = None;
    loop {
        let client = match connect(&args).await {
            Ok(c) => c,
            // A redirect to a broker whose certificate is not trusted: say which and why it
            // has to be (a redirect is not something a user typed).
            Err(e) if e.contains(UNTRUSTED) && sent_by.is_some() => {
                let why = e.split_once("(rustls: ").and_then(|(_, w)| w.split_once(')')).map_or("", |(w, _)| w);
                return Err(format!(
                    "{}, where a redirect sent this request: {UNTRUSTED} (rustls: {why}). Requests \
                     follow redirects to the broker that owns each shard, so trust every broker's \
                     certificate: give --ca the cluster CA's ca.pem when the brokers share one \
                     (`serve --cluster-ca`), else put each broker's DATA_DIR/tls/cert.pem in one \
                     file and give that with --ca (docs/cluster.md)",
                    sent_by.as_deref().unwrap_or_default()
                ));
            }
            Err(e) => return Err(e),
        };
        asked.push(client.remote_address());
        let (client, r) = op(client).await;
        match r {
            Ok(v) => return Ok((client, v)),
            Err(felix_driver_tokio::ClientError::NotLeader { node_id, addr: Some(addr), generation })
                if asked.len() <= MAX_REDIRECTS && generation >= newest =>
            {
                let Ok(next) = addr.parse::<std::net::SocketAddr>() else {
                    return Err(format!("redirected to {node_id} at {addr:?}, which is not an address"));
                };
                if asked.contains(&next) {
                    return Err(format!(
                        "redirected back to {next} ({node_id}): the cluster's view is changing, retry"
                    ));
                }
                eprintln!("{node_id} owns it: asking {next}");
                sent_by = Some(format!("{next} ({node_id})"));
                let _ = client.close().await;
                newest = generation;
                args.addr = Addrs::one(next);
            }
            Err(e) => return Err(e.to_string()),
        }
    }
}

/// [`connect`], with the client options adjusted by `adjust` first.
/// `--compress`: a codec name.
pub fn parse_codec(s: &str) -> Result<Codec, String> {
    Codec::from_name(s).ok_or_else(|| format!("unknown codec {s:?}: zstd or lz4"))
}

/// `--compress` and `--level` checked together, before anything connects: the codec and the
/// level (the codec's default when none is given).
pub fn compression(codec: Option<Codec>, level: Option<i32>) -> Result<Option<(Codec, i32)>, String> {
    let Some(codec) = codec else { return Ok(None) };
    let level = level.unwrap_or(codec.default_level());
    felix_proto::Compressor::new(codec, level).map_err(|e| format!("--level: {e}"))?;
    Ok(Some((codec, level)))
}

pub async fn connect_with(c: &ConnectArgs, adjust: impl FnOnce(&mut ClientOptions)) -> Result<Client, String> {
    let opts = client_options(c, adjust)?;
    // Several addresses: tried in order, each given a head start of STAGGER before the next is
    // tried beside it, and the first that answers is used (so a dead seed costs a quarter of a
    // second, not a connect timeout).
    const STAGGER: std::time::Duration = std::time::Duration::from_millis(250);
    let wait = c.connect_timeout;
    let mut tries = tokio::task::JoinSet::new();
    for (i, addr) in c.addr.0.iter().copied().enumerate() {
        let opts = opts.clone();
        tries.spawn(async move {
            tokio::time::sleep(STAGGER * i as u32).await;
            (addr, tokio::time::timeout(wait, Client::connect(addr, opts)).await)
        });
    }
    let mut last = String::new();
    while let Some(r) = tries.join_next().await {
        match r {
            Ok((_, Ok(Ok(client)))) => return Ok(client),
            Ok((addr, Ok(Err(e)))) => last = format!("{addr}: {}", tidy_tls_error(&e.to_string())),
            Ok((addr, Err(_))) => last = no_answer(addr, wait),
            Err(e) => last = format!("connecting: {e}"),
        }
    }
    Err(last)
}

/// rustls says which names a certificate holds in Rust debug text (`DnsName("localhost")`,
/// `IpAddress(127.0.0.1)`); said as a user writes them, with what to do about it.
pub fn tidy_tls_error(e: &str) -> String {
    if let Some((_, why)) = e.split_once("invalid peer certificate: ")
        && !why.contains("only valid for")
        && !why.contains("not valid for name")
    {
        return format!(
            "{UNTRUSTED} (rustls: {why}): give the certificate that signed it with --ca (the broker's own DATA_DIR/tls/cert.pem for a self-signed one)"
        );
    }
    let Some((head, names)) = e.split_once("certificate is only valid for ") else { return e.to_owned() };
    let names: Vec<String> = names
        .split(", ")
        .flat_map(|n| n.split(" or "))
        .map(|n| {
            let n = n.trim();
            let inner = n.split_once('(').map_or(n, |(_, rest)| rest.trim_end_matches(')'));
            inner.trim_matches('"').replace("0::1", "::1")
        })
        .filter(|n| !n.is_empty())
        .collect();
    let head = head.trim_end_matches("; ").trim_end();
    format!(
        "{head}; it names {}: give one of them with --server-name (or --addr by that name), or trust the right certificate with --ca",
        names.join(", ")
    )
}

/// What a connection error says when the broker's certificate is not trusted.
const UNTRUSTED: &str = "its TLS certificate is not trusted";

/// A broker that did not answer within `--connect-timeout`.
pub fn no_answer(addr: std::net::SocketAddr, wait: std::time::Duration) -> String {
    format!("no answer from {addr} within {} (is the broker running? --connect-timeout waits longer)", humantime(wait))
}

/// A duration as the CLI's flags take it: `5s`, `250ms`, `2m`.
pub fn humantime(d: std::time::Duration) -> String {
    let ms = d.as_millis();
    match ms {
        0 => "0s".into(),
        ms if ms % 86_400_000 == 0 => format!("{}d", ms / 86_400_000),
        ms if ms % 3_600_000 == 0 => format!("{}h", ms / 3_600_000),
        ms if ms % 60_000 == 0 => format!("{}m", ms / 60_000),
        ms if ms % 1_000 == 0 => format!("{}s", ms / 1_000),
        ms => format!("{ms}ms"),
    }
}

/// The client options the connection arguments say.
fn client_options(c: &ConnectArgs, adjust: impl FnOnce(&mut ClientOptions)) -> Result<ClientOptions, String> {
    let trust = client_trust(c.ca.as_deref(), &c.data_dir, c.insecure_accept_any_certificate)?;
    let client_cert = match (&c.cert, &c.cert_key) {
        (Some(cert), Some(key)) => Some(std::sync::Arc::new(
            felix_driver_tokio::Identity::load(cert, key)
                .map_err(|e| format!("--cert/--cert-key: {e} (a PEM certificate chain and its PEM private key)"))?,
        )),
        _ => None,
    };
    let token = match &c.token {
        // `@FILE`: the token is read from a file (a minted token, kept out of shell history).
        Some(t) if t.starts_with('@') => {
            std::fs::read_to_string(&t[1..]).map(|s| s.trim().to_owned()).map_err(|e| format!("--token {t}: {e}"))?
        }
        Some(t) => t.clone(),
        // A client certificate is the credential: the token stays empty.
        None if client_cert.is_some() => String::new(),
        None => {
            std::fs::read_to_string(DataDir::new(&c.data_dir).token()).map(|t| t.trim().to_owned()).map_err(|e| {
                format!("no --token given and no dev token at {}: {e}", DataDir::new(&c.data_dir).token().display())
            })?
        }
    };
    let mut opts = ClientOptions::new(c.tenant.clone(), token, trust);
    // The name the certificate must hold: --server-name, else the host name --addr gave, else
    // localhost (what a broker's generated certificate names).
    opts.server_name = c.server_name.clone().or_else(|| c.addr.1.clone()).unwrap_or_else(|| "localhost".into());
    opts.alpn = c.alpn;
    opts.close_timeout = c.close_timeout;
    opts.client_cert = client_cert;
    // `@FILE`: a long-running command (subscribe, consume) reads the file again before a signed
    // token expires, so whoever renews the file keeps it working.
    if let Some(path) = c.token.as_deref().and_then(|t| t.strip_prefix('@')) {
        let path = std::path::PathBuf::from(path);
        opts.token_refresh = Some(felix_driver_tokio::TokenRefresh::new(move || {
            std::fs::read_to_string(&path).map(|s| s.trim().to_owned()).map_err(|e| format!("{}: {e}", path.display()))
        }));
    }
    adjust(&mut opts);
    Ok(opts)
}

/// How reading the lines to publish ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum InputEnd {
    /// The input ended (or the records were arguments).
    Done,
    /// Ctrl-C or SIGTERM: what was read was sent, nothing more is read.
    Interrupted,
}

/// The batches `publish` sends: the arguments as one batch, or lines of --file or standard
/// input, each handed to `send` in order. A batch goes once it holds `--batch` lines, or once
/// `--linger` passed with no further line (a pipe from `tail -f` is sent as it comes, not 64
/// lines at a time), or when the input ends. On Ctrl-C or SIGTERM what was read is sent and
/// nothing more is read: no line that was read is dropped.
async fn publish_batches<F, Fut>(a: &PublishArgs, mut send: F) -> Result<InputEnd, String>
where
    F: FnMut(Vec<Bytes>) -> Fut,
    Fut: std::future::Future<Output = Result<(), String>>,
{
    if !a.payloads.is_empty() {
        send(a.payloads.iter().map(|p| Bytes::from(p.clone())).collect()).await?;
        return Ok(InputEnd::Done);
    }
    // Lines are read on a thread of their own: a read of standard input cannot be cancelled,
    // and on tokio's blocking pool one still waiting (the writer of the pipe alive, as `tail
    // -f` is) would keep the command from exiting after Ctrl-C.
    let input: Box<dyn std::io::Read + Send> = match &a.file {
        Some(f) => {
            Box::new(std::io::BufReader::new(std::fs::File::open(f).map_err(|e| format!("{}: {e}", f.display()))?))
        }
        None => Box::new(std::io::BufReader::new(std::io::stdin())),
    };
    let (tx, mut lines) = tokio::sync::mpsc::channel::<std::io::Result<String>>(1024);
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(input)) {
            let failed = line.is_err();
            if tx.blocking_send(line).is_err() || failed {
                return;
            }
        }
    });
    let mut batch = Vec::new();
    // When the batch held goes even if no further line comes.
    let mut due: Option<tokio::time::Instant> = None;
    let stop = wait_for_shutdown();
    tokio::pin!(stop);
    loop {
        let at = due;
        let linger = async move {
            match at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            biased;
            () = &mut stop => {
                // Lines already waiting in the pipe were written before the signal: they are
                // read too (until the input pauses for the linger, at least 20 ms, or ends).
                let grace = a.linger.max(std::time::Duration::from_millis(20)).min(std::time::Duration::from_secs(1));
                while let Ok(Some(Ok(l))) = tokio::time::timeout(grace, lines.recv()).await {
                    batch.push(Bytes::from(l));
                }
                for chunk in batch.chunks(a.batch.max(1)) {
                    send(chunk.to_vec()).await?;
                }
                return Ok(InputEnd::Interrupted);
            }
            () = linger => {
                send(std::mem::take(&mut batch)).await?;
                due = None;
            }
            // Cancel-safe: a line not taken when another branch wins stays in the channel.
            line = lines.recv() => match line.transpose().map_err(|e| format!("reading input: {e}"))? {
                Some(l) => {
                    batch.push(Bytes::from(l));
                    due.get_or_insert_with(|| tokio::time::Instant::now() + a.linger);
                    if batch.len() >= a.batch.max(1) {
                        send(std::mem::take(&mut batch)).await?;
                        due = None;
                    }
                }
                None => {
                    if !batch.is_empty() {
                        send(std::mem::take(&mut batch)).await?;
                    }
                    return Ok(InputEnd::Done);
                }
            },
        }
    }
}

/// `publish --idempotent`: every batch through an idempotent producer, pipelined, then a wait
/// for all of them.
async fn publish_idempotent(a: PublishArgs, compress: Option<(Codec, i32)>) -> Result<ExitCode, String> {
    let opts = client_options(&a.conn, |o| o.config.compress = compress)?;
    let addr = a.conn.addr.first();
    let connect = felix_driver_tokio::IdempotentProducer::connect(addr, opts, &a.conn.namespace, &a.stream);
    let mut producer = tokio::time::timeout(a.conn.connect_timeout, connect)
        .await
        .map_err(|_| no_answer(addr, a.conn.connect_timeout))?
        .map_err(|e| format!("{addr}: {e}"))?;
    // In a cluster, the other brokers to go to when this one stops leading the stream's shard.
    producer.set_seeds(a.conn.addr.0.clone());
    let producer = std::sync::Arc::new(tokio::sync::Mutex::new(producer));
    let key = a.key.clone().map(Bytes::from);
    let mut sent = 0usize;
    let end = publish_batches(&a, |batch| {
        sent += batch.len();
        let (producer, key) = (producer.clone(), key.clone());
        async move { producer.lock().await.submit(batch, key).await.map(|_| ()).map_err(|e| e.to_string()) }
    })
    .await?;
    let mut producer = std::sync::Arc::try_unwrap(producer).map_err(|_| "producer still shared")?.into_inner();
    let done = producer.flush().await.map_err(|e| e.to_string())?;
    let id = producer.producer_id();
    producer.close().await.map_err(|e| e.to_string())?;
    match done.iter().filter_map(|(_, _, o)| *o).max() {
        Some(o) => {
            eprintln!("published {sent} record(s) exactly once (producer {id}); last batch starts at offset {o}")
        }
        None => eprintln!("published {sent} record(s) exactly once (producer {id})"),
    }
    Ok(exit_after(end))
}

/// The exit code once everything read was sent: 130 after Ctrl-C or SIGTERM (said), as other
/// command-line tools exit when interrupted.
fn exit_after(end: InputEnd) -> ExitCode {
    match end {
        InputEnd::Done => ExitCode::SUCCESS,
        InputEnd::Interrupted => {
            eprintln!("interrupted: stopped reading; every line read was sent");
            ExitCode::from(130)
        }
    }
}

pub async fn publish(mut a: PublishArgs) -> Result<ExitCode, String> {
    let compress = compression(a.compress, a.level)?;
    if a.idempotent {
        return publish_idempotent(a, compress).await;
    }
    a.ack |= a.ack_on_enqueue;
    let adjust = |o: &mut ClientOptions| {
        if a.ack_on_enqueue {
            o.config = o.config.clone().ack_on_enqueue();
        }
        o.config.compress = compress;
    };
    let mut cluster = None;
    let client = match &a.key {
        // A keyed publish goes straight to its shard's owner (a single broker: to it).
        Some(key) => {
            let seeds = &a.conn.addr.0;
            let wait = a.conn.connect_timeout * u32::try_from(seeds.len()).unwrap_or(u32::MAX);
            let cc = tokio::time::timeout(
                wait,
                felix_driver_tokio::ClusterClient::connect(seeds, client_options(&a.conn, adjust)?),
            )
            .await
            .map_err(|_| no_answer(a.conn.addr.first(), a.conn.connect_timeout))?
            .map_err(|e| e.to_string())?;
            let c = cc
                .client_for_key(&a.conn.namespace, &a.stream, Some(key.as_bytes()))
                .await
                .map_err(|e| e.to_string())?;
            cluster = Some(cc);
            c
        }
        None => connect_with(&a.conn, adjust).await?,
    };
    let ring = match &a.encrypt_key_file {
        Some(path) => Some(felix_driver_tokio::envelope::KeyRing::load(path).map_err(|e| e.to_string())?),
        None => None,
    };
    let opts = || PublishOptions { envelope: None, key: a.key.clone().map(Bytes::from), ack: a.ack, json: false };
    let mut sent = 0usize;
    let last_offset = std::sync::Arc::new(std::sync::Mutex::new(None));
    let end = publish_batches(&a, |batch| {
        sent += batch.len();
        let client = client.clone();
        let (ns, stream, mut o, last) = (a.conn.namespace.clone(), a.stream.clone(), opts(), last_offset.clone());
        // End to end (D58): sealed here, the key's id in the envelope.
        let sealed = ring.as_ref().map(|r| r.seal(&batch));
        async move {
            let batch = match sealed {
                Some(Ok((envelope, sealed))) => {
                    o.envelope = Some(envelope);
                    sealed
                }
                Some(Err(e)) => return Err(e.to_string()),
                None => batch,
            };
            // A shard that is refused for a moment (nothing written: the cluster is still
            // creating the stream, the shard is cutting over a move, the broker's view is one
            // move behind, it is fenced or electing) is sent again after the wait it asks for
            // (50 ms and doubling without one), a bounded number of times. Any other refusal (an owner that
            // is down) is reported at once.
            let mut tries = 0;
            let offset = loop {
                tries += 1;
                match client.publish(&ns, &stream, batch.clone(), o.clone()).await {
                    Err(e) if e.code() == Some(&felix_proto::ErrorCode::ShardUnavailable) => {
                        let Some(wait) = felix_driver_tokio::ClusterClient::retry_wait(&e, tries) else {
                            return Err(e.to_string());
                        };
                        tokio::time::sleep(wait).await;
                    }
                    r => break r.map_err(|e| e.to_string())?,
                }
            };
            if let (Some(o), Ok(mut last)) = (offset, last.lock()) {
                *last = Some(o);
            }
            Ok(())
        }
    })
    .await?;
    // Which shard the records went to: an unkeyed batch goes to shard 0, a keyed one to its
    // key's shard of the stream as it is now (asked again: the first publish may have created it).
    let shard = match (&cluster, &a.key) {
        (Some(cc), Some(key)) => {
            cc.forget(&a.conn.namespace, &a.stream);
            match cc.view(&a.conn.namespace, &a.stream).await {
                Ok(v) => format!("shard {} of {}", v.shard_for(Some(key.as_bytes())), v.shards),
                Err(_) => "the key's shard".to_owned(),
            }
        }
        _ => "shard 0".to_owned(),
    };
    let last_offset = last_offset.lock().ok().and_then(|l| *l);
    // Unacknowledged publishes are only handed to QUIC: the close waits until the broker
    // acknowledged receiving them, and says so when it cannot.
    if let Err(e) = client.close().await {
        return Err(match e {
            felix_driver_tokio::ClientError::Unconfirmed { publishes, reason, .. } if !a.ack => {
                let at_most = if publishes == 0 { sent as u64 } else { publishes.min(sent as u64) };
                format!(
                    "{sent} record(s) written, but the broker did not confirm receiving them ({reason}): up to {at_most} may not have been delivered"
                )
            }
            other => other.to_string(),
        });
    }
    let (ns, stream) = (&a.conn.namespace, &a.stream);
    match (a.ack, last_offset) {
        (true, Some(o)) => {
            eprintln!("published {sent} record(s) to {ns}/{stream} {shard}; last batch starts at offset {o}")
        }
        (true, None) => eprintln!("published {sent} record(s) to {ns}/{stream} {shard}, acknowledged"),
        _ => eprintln!("published {sent} record(s) to {ns}/{stream} {shard}, received by the broker"),
    }
    Ok(exit_after(end))
}

pub(crate) fn parse_start(s: &str) -> Result<StartPosition, String> {
    match s {
        "earliest" => Ok(StartPosition::Earliest),
        "latest" => Ok(StartPosition::Latest),
        n => n
            .parse::<u64>()
            .map(StartPosition::Offset)
            .map_err(|_| format!("--from {n:?}: expected earliest, latest or an offset")),
    }
}

/// Broker addresses to try, in order, and the host name the first was given by (the TLS
/// server name when `--server-name` is not given).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Addrs(pub Vec<std::net::SocketAddr>, pub Option<String>);

impl Addrs {
    /// One address, given as an address.
    pub fn one(addr: std::net::SocketAddr) -> Self {
        Self(vec![addr], None)
    }

    /// The first one (the one a single-broker command uses).
    pub fn first(&self) -> std::net::SocketAddr {
        self.0[0]
    }
}

impl std::fmt::Display for Addrs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let v: Vec<String> = self.0.iter().map(ToString::to_string).collect();
        f.write_str(&v.join(","))
    }
}

/// Parses `127.0.0.1:5001,broker-2.example:5002`: addresses, or host names resolved now (each
/// name's first address; a name is also what the broker's certificate is checked against).
pub fn parse_addrs(s: &str) -> Result<Addrs, String> {
    use std::net::ToSocketAddrs;
    let mut v = Vec::new();
    let mut host = None;
    for p in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        if let Ok(a) = p.parse::<std::net::SocketAddr>() {
            v.push(a);
            continue;
        }
        let Some((name, port)) = p.rsplit_once(':') else {
            return Err(format!("{p:?} is not HOST:PORT (like 127.0.0.1:5000 or localhost:5000)"));
        };
        if port.parse::<u16>().is_err() {
            return Err(format!("{p:?}: the port {port:?} is not a number from 0 to 65535"));
        }
        let found = p.to_socket_addrs().map_err(|e| format!("{p:?}: cannot resolve {name:?} ({e})"))?;
        // IPv4 first: a broker listening on 127.0.0.1 (the default) is not on ::1.
        let mut found: Vec<_> = found.collect();
        found.sort_by_key(|a| !a.is_ipv4());
        let a = found.first().ok_or_else(|| format!("{p:?}: {name:?} resolves to no address"))?;
        v.push(*a);
        if host.is_none() && v.len() == 1 {
            host = Some(name.trim_start_matches('[').trim_end_matches(']').to_owned());
        }
    }
    if v.is_empty() {
        return Err("no address given".into());
    }
    Ok(Addrs(v, host))
}

/// The brokers of a cluster: node id and cluster address of each.
#[derive(Debug, Clone)]
pub struct Peers(pub Vec<(String, std::net::SocketAddr)>);

/// Parses `n1=127.0.0.1:7001,n2=127.0.0.1:7002`.
pub fn parse_peers(s: &str) -> Result<Peers, String> {
    let mut out: Vec<(String, std::net::SocketAddr)> = Vec::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part.split_once('=').ok_or_else(|| format!("{part:?}: expected ID=HOST:PORT"))?;
        let addr =
            addr.parse().map_err(|e| format!("{part:?}: {addr:?} is not an address like 127.0.0.1:7001 ({e})"))?;
        if id.is_empty() || out.iter().any(|(n, _)| n == id) {
            return Err(format!("{part:?}: node ids must be non-empty and distinct"));
        }
        out.push((id.to_owned(), addr));
    }
    if out.is_empty() {
        return Err("no peers given".into());
    }
    Ok(Peers(out))
}

/// An offset: a whole number (0 is a shard's first record).
pub fn parse_offset(s: &str) -> Result<u64, String> {
    s.trim().parse().map_err(|_| format!("{s:?}: expected an offset, a whole number (0 is a shard's first record)"))
}

/// A stream, cache or group name, checked against the broker's grammar (docs/protocol.md D49)
/// before anything is sent.
pub fn parse_name(s: &str) -> Result<String, String> {
    match felix_proto::broker::name_problem(s) {
        None => Ok(s.to_owned()),
        Some(why) => Err(format!("the name {why}")),
    }
}

/// [`parse_duration`] for a flag that once took bare milliseconds (`--ttl`): a number without
/// a unit is refused rather than read as seconds, which would silently mean 1000 times longer.
pub fn parse_duration_with_unit(s: &str) -> Result<std::time::Duration, String> {
    if !s.trim().is_empty() && s.trim().bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("{s:?}: give a unit, like {s}ms or {s}s"));
    }
    parse_duration(s)
}

/// Parses a byte rate: `50MB/s`, `20MiB/s`, `1G`, `65536` (bytes a second; `/s` optional;
/// k/M/G and KB/MB/GB are powers of 1000, KiB/MiB/GiB of 1024; case does not matter).
pub fn parse_byte_rate(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let t = t.strip_suffix("/s").unwrap_or(t).trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected bytes a second, like 50MB/s or 20MiB/s"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" => 1_000,
        "m" | "mb" => 1_000_000,
        "g" | "gb" => 1_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use B, KB, MB, GB, KiB, MiB or GiB)")),
    };
    match n.checked_mul(mult) {
        Some(0) => Err(format!("{s:?}: a rate above zero (leave it out for no limit)")),
        Some(r) => Ok(r),
        None => Err(format!("{s:?}: too large")),
    }
}

/// Parses `90s`, `10m`, `2h`, `1d`, `500ms` (a bare number is seconds).
pub fn parse_duration(s: &str) -> Result<std::time::Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: u64 = num.parse().map_err(|_| format!("{s:?}: expected a number and a unit, like 10m"))?;
    let ms = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        other => return Err(format!("{s:?}: unknown unit {other:?} (use ms, s, m, h or d)")),
    };
    n.checked_mul(ms).map(std::time::Duration::from_millis).ok_or_else(|| format!("{s:?}: too long"))
}

/// Microseconds since the Unix epoch, `ago` before now.
pub(crate) fn micros_ago(ago: std::time::Duration) -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    u64::try_from(now.saturating_sub(ago).as_micros()).unwrap_or(u64::MAX)
}

/// Whether a subscription that ended so is followed to wherever its shard is served now: a
/// move or a fail-over (its broker said so, or went away), or a retryable refusal.
pub(crate) fn follows(reason: &EndReason) -> bool {
    match reason {
        EndReason::Moved(_) | EndReason::ConnectionLost(_) | EndReason::Finished | EndReason::Reset => true,
        EndReason::Error(e) => {
            matches!(e.retry, Some(RetryClass::Retry | RetryClass::RetryAfter | RetryClass::Redirect))
        }
        _ => false,
    }
}

pub(crate) fn ended(reason: &EndReason) -> String {
    match reason {
        EndReason::Moved(m) => format!("moved (to {})", m.node_id.as_deref().unwrap_or("a broker being chosen")),
        EndReason::ConnectionLost(why) => format!("lost its connection ({why})"),
        EndReason::Error(e) => format!("ended: {}", e.message),
        _ => "ended by the broker".into(),
    }
}

/// Runs a cache or counter request on its cache's owner: `not_leader` followed, and sent again
/// while the cache is being created or handed over by a move (a refusal that wrote nothing:
/// the wait it asks for, else 50 ms doubling, a bounded number of times).
async fn cache_request<T, F, Fut>(c: &ConnectArgs, op: F) -> Result<T, String>
where
    F: Fn(Client) -> Fut + Clone,
    Fut: std::future::Future<Output = Result<T, felix_driver_tokio::ClientError>>,
{
    let (client, v) = with_redirects(c, |client| {
        let op = op.clone();
        async move {
            let mut tries = 0u32;
            loop {
                tries += 1;
                match op(client.clone()).await {
                    Err(e) => match felix_driver_tokio::ClusterClient::retry_wait(&e, tries) {
                        Some(wait) => tokio::time::sleep(wait).await,
                        None => return (client, Err(e)),
                    },
                    r => return (client, r),
                }
            }
        }
    })
    .await?;
    let _ = client.close().await;
    Ok(v)
}

pub async fn cache(a: CacheArgs) -> Result<ExitCode, String> {
    let ns = a.conn.namespace.clone();
    let code = match a.op {
        CacheOp::Put { cache, key, value, ttl } => {
            let value = Bytes::from(value);
            cache_request(&a.conn, |c| {
                let (ns, cache, key, value) = (ns.clone(), cache.clone(), key.clone(), value.clone());
                async move {
                    c.cache_put(&ns, &cache, &key, value, ttl.map(|t| u64::try_from(t.as_millis()).unwrap_or(u64::MAX)))
                        .await
                }
            })
            .await?;
            eprintln!("stored {cache}/{key}");
            ExitCode::SUCCESS
        }
        CacheOp::Get { cache, key } => {
            let v = cache_request(&a.conn, |c| {
                let (ns, cache, key) = (ns.clone(), cache.clone(), key.clone());
                async move { c.cache_get(&ns, &cache, &key).await }
            })
            .await?;
            print_value(&cache, &key, v)
        }
        CacheOp::Keys { cache, prefix, max } => {
            // Page by page (1000 keys each), each page from the cache's owner.
            let mut after: Option<String> = None;
            let mut shown = 0u64;
            loop {
                let want = max.map_or(1000, |m| u32::try_from(m - shown).unwrap_or(1000).min(1000));
                if want == 0 {
                    break;
                }
                let (keys, next) = cache_request(&a.conn, |c| {
                    let (ns, cache, prefix, after) = (ns.clone(), cache.clone(), prefix.clone(), after.clone());
                    async move { c.cache_keys(&ns, &cache, prefix.as_deref(), after.as_deref(), Some(want)).await }
                })
                .await?;
                for k in &keys {
                    out!("{k}");
                }
                shown += keys.len() as u64;
                match next {
                    Some(n) => after = Some(n),
                    None => break,
                }
            }
            eprintln!("{shown} key(s) in {ns}/{cache}");
            ExitCode::SUCCESS
        }
        CacheOp::Delete { cache, key } => {
            let v = cache_request(&a.conn, |c| {
                let (ns, cache, key) = (ns.clone(), cache.clone(), key.clone());
                async move { c.cache_delete(&ns, &cache, &key).await }
            })
            .await?;
            print_value(&cache, &key, v)
        }
        CacheOp::Watch { cache, key, prefix, from, retained, json, count } => {
            let filter = match (key, prefix) {
                (Some(k), None) => felix_proto::client::WatchOn::Key(k),
                (None, Some(p)) => felix_proto::client::WatchOn::Prefix(p),
                _ => return Err("name a KEY or a --prefix (exactly one)".into()),
            };
            return watch(&a.conn, &ns, &cache, filter, from, retained, json, count).await;
        }
    };
    Ok(code)
}

pub async fn counter(a: CounterArgs) -> Result<ExitCode, String> {
    let ns = a.conn.namespace.clone();
    let code = match a.op {
        CounterOp::Add { cache, key, delta } => {
            let sum = cache_request(&a.conn, |c| {
                let (ns, cache, key) = (ns.clone(), cache.clone(), key.clone());
                async move { c.counter_add(&ns, &cache, &key, delta).await }
            })
            .await?;
            out!("{sum}");
            ExitCode::SUCCESS
        }
        CounterOp::Get { cache, key } => {
            let v = cache_request(&a.conn, |c| {
                let (ns, cache, key) = (ns.clone(), cache.clone(), key.clone());
                async move { c.counter_get(&ns, &cache, &key).await }
            })
            .await?;
            match v {
                Some(v) => {
                    out!("{v}");
                    ExitCode::SUCCESS
                }
                None => {
                    eprintln!("{cache}/{key}: never written");
                    ExitCode::from(1)
                }
            }
        }
    };
    Ok(code)
}

/// `cluster add|remove`: asks, then waits (showing progress) until every change is applied
/// as the asked broker sees it.
async fn cluster_change(
    add: Option<(String, String)>,
    node: String,
    force: bool,
    a: AdminArgs,
) -> Result<ExitCode, String> {
    let m = a.metrics;
    let addr = add.as_ref().map(|(_, addr)| addr.as_str());
    proposed(m, felix_driver_tokio::server::cluster_admin(m, addr, &node, force, &a.cluster_secret)).await?;
    let what = if add.is_some() { "added" } else { "removed" };
    eprintln!("proposed; waiting for {node} to be {what} (up to {:?})", a.wait);
    let start = std::time::Instant::now();
    let mut last = String::new();
    loop {
        let v = status_json(m).await;
        if let Some(v) = v {
            let voter = v["voters"].as_array().into_iter().flatten().any(|x| x == node.as_str());
            let state = v["members"]
                .as_array()
                .into_iter()
                .flatten()
                .find(|x| x["node_id"] == node.as_str())
                .and_then(|x| x["state"].as_str().map(str::to_owned));
            let done = match &add {
                Some(_) => voter && state.as_deref() == Some("active"),
                None => !voter && state.is_none(),
            };
            if done {
                let shards =
                    v["shards"].as_array().into_iter().flatten().filter(|x| x["owner"] == node.as_str()).count();
                match &add {
                    Some(_) => out!("{node} is a member, active, owning {shards} shard(s)"),
                    None => out!("{node} was removed; its shards went to the others"),
                }
                return Ok(ExitCode::SUCCESS);
            }
            let now = format!("voter: {voter}, member: {}", state.as_deref().unwrap_or("no"));
            if now != last {
                eprintln!("  {node}: {now}");
                last = now;
            }
        }
        if start.elapsed() >= a.wait {
            let hint = if add.is_some() {
                " (is the new broker running with --join, and can the members reach its cluster address?)"
            } else {
                ""
            };
            return Err(format!("{node} was not {what} within {:?}{hint}; see `felix-node cluster status`", a.wait));
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// A broker's `/cluster` status as JSON, if it answers within 2 s.
async fn status_json(m: std::net::SocketAddr) -> Option<serde_json::Value> {
    let text = tokio::time::timeout(std::time::Duration::from_secs(2), felix_driver_tokio::server::cluster_status(m))
        .await
        .ok()?
        .ok()?;
    serde_json::from_str(&text).ok()
}

/// Waits (5 s at most) for an admin request's answer: `Ok` when the broker proposed it, else
/// what it said, worded for the operator.
async fn proposed(
    m: std::net::SocketAddr,
    request: impl std::future::Future<Output = std::io::Result<(u16, String)>>,
) -> Result<(), String> {
    let (status, body) = tokio::time::timeout(std::time::Duration::from_secs(5), request)
        .await
        .map_err(|_| format!("no answer from {m} within 5 s"))?
        .map_err(|e| format!("{m}: {e} (is it a broker's --metrics-listen address?)"))?;
    let reason = serde_json::from_str::<serde_json::Value>(&body)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_owned))
        .unwrap_or_else(|| body.trim().to_owned());
    match status {
        202 => Ok(()),
        401 => Err(format!("{m}: refused: {reason} (pass the brokers' --cluster-secret)")),
        _ => Err(format!("{m}: refused ({status}): {reason}")),
    }
}

/// Whether a status entry (a shard, a move) is shard `shard` of the stream `(tenant,
/// namespace, name)`.
fn names_shard(x: &serde_json::Value, (tenant, namespace, name): (&str, &str, &str), shard: u32) -> bool {
    x["tenant"] == tenant && x["namespace"] == namespace && x["name"] == name && x["shard"] == shard
}

/// Proposes a shard move; a shard already moving (placement may have started it, e.g. onto a
/// broker just added) takes no second move, so this waits (within `wait`) for that one to end
/// and asks again. If the shard ended up where this move was going, the move is done.
async fn propose_when_not_moving<P, PF, M, MF>(
    propose: P,
    moving: M,
    to: Option<&str>,
    wait: std::time::Duration,
    poll: std::time::Duration,
    json: bool,
) -> Result<(), String>
where
    P: Fn() -> PF,
    PF: std::future::Future<Output = Result<(), String>>,
    M: Fn() -> MF,
    MF: std::future::Future<Output = bool>,
{
    let asked_at = std::time::Instant::now();
    let mut waited = false;
    loop {
        match propose().await {
            Ok(()) => return Ok(()),
            Err(e) if to.is_some() && e.contains("is already moving") && asked_at.elapsed() < wait => {
                if !json {
                    eprintln!("{e}: waiting for that move to end, then asking again");
                }
                waited = true;
                while asked_at.elapsed() < wait && moving().await {
                    tokio::time::sleep(poll).await;
                }
            }
            Err(e) if waited && to.is_some_and(|to| e.ends_with(&format!("is on {to} already"))) => return Ok(()),
            Err(e) => return Err(e),
        }
    }
}

/// Where a command reads the cluster's status: a broker's metrics listener, or a broker over
/// the client protocol (D52).
enum StatusSource {
    Metrics(std::net::SocketAddr),
    Client(Client),
}

impl StatusSource {
    /// The status document, or `None` when the broker did not answer in 2 s.
    async fn fetch(&self) -> Option<serde_json::Value> {
        match self {
            StatusSource::Metrics(m) => status_json(*m).await,
            StatusSource::Client(c) => {
                tokio::time::timeout(std::time::Duration::from_secs(2), c.cluster_status()).await.ok()?.ok()
            }
        }
    }
}

/// Shows the cluster's moves (as the broker asked sees them) until `done` says the operator's
/// change is complete; gives up after `--wait` without any progress.
async fn watch_moves(
    what: &str,
    json: bool,
    source: &StatusSource,
    wait: std::time::Duration,
    done: impl Fn(&serde_json::Value) -> bool,
) -> Result<ExitCode, String> {
    if !json {
        eprintln!("proposed: {what}");
    }
    let start = std::time::Instant::now();
    let mut progressed = std::time::Instant::now();
    let mut last = String::new();
    let mut polls = 0u32;
    loop {
        polls += 1;
        if let Some(v) = source.fetch().await {
            // What this broker knows of the copies it takes part in (bytes copied so far).
            let copied = |x: &serde_json::Value| {
                v["move_progress"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|p| {
                        p["direction"] == "in"
                            && p["name"] == x["name"]
                            && p["shard"] == x["shard"]
                            && p["namespace"] == x["namespace"]
                    })
                    .map(|p| (p["copied"].as_u64().unwrap_or(0), p["source_tail"].as_u64().unwrap_or(0)))
            };
            let lines: Vec<(String, serde_json::Value)> = v["moves"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|x| {
                    let phase = x["phase"].as_str().unwrap_or("?");
                    let mut text = format!(
                        "  {}/{} shard {}: {} → {}  {}",
                        x["namespace"].as_str().unwrap_or("?"),
                        x["name"].as_str().unwrap_or("?"),
                        x["shard"],
                        x["from"].as_str().unwrap_or("?"),
                        x["to"].as_str().unwrap_or("?"),
                        phase.replace('_', " ")
                    );
                    let mut j = x.clone();
                    if let Some((c, t)) = copied(x) {
                        text.push_str(&format!(" (offset {c} of {t})"));
                        j["copied"] = c.into();
                        j["source_tail"] = t.into();
                    }
                    if let Some(at) = x["at"].as_u64() {
                        text.push_str(&format!(" at offset {at}"));
                    }
                    (text, j)
                })
                .collect();
            let now: String = lines.iter().map(|(t, _)| t.as_str()).collect::<Vec<_>>().join("\n");
            if now != last {
                progressed = std::time::Instant::now();
                if json {
                    for (_, j) in &lines {
                        out!("{}", serde_json::json!({"move": j, "elapsed_ms": start.elapsed().as_millis() as u64}));
                    }
                } else if !now.is_empty() {
                    eprintln!("{} moves in progress ({:.1} s):\n{now}", lines.len(), start.elapsed().as_secs_f64());
                }
                last = now;
            }
            // A change just proposed may not be applied yet on the first look.
            if polls > 1 && done(&v) {
                let secs = start.elapsed().as_secs_f64();
                if json {
                    out!("{}", serde_json::json!({"done": what, "elapsed_ms": start.elapsed().as_millis() as u64}));
                } else {
                    out!("done: {what} ({secs:.1} s)");
                }
                return Ok(ExitCode::SUCCESS);
            }
        }
        if progressed.elapsed() >= wait {
            return Err(format!(
                "{what}: no progress for {wait:?}; see `felix-node cluster status` (cancel a stuck move with `cluster move STREAM SHARD --cancel`)"
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}

/// `cluster inspect`: one broker's own view of a shard, or the subscriptions it serves.
async fn cluster_inspect(
    name: Option<String>,
    shard: u32,
    cache: bool,
    subscriptions: bool,
    json: bool,
    conn: ConnectArgs,
) -> Result<ExitCode, String> {
    use felix_proto::message::ShardKind;
    let client = connect(&conn).await?;
    let ns = conn.namespace.clone();
    let explain = |e: felix_driver_tokio::ClientError| {
        let t = e.to_string();
        if t.contains("forbidden") {
            format!("{t} (diagnostics need a signed token with exactly node.view:cluster:*)")
        } else {
            t
        }
    };
    if subscriptions {
        let filter = felix_proto::message::SubscriptionFilter {
            namespace: name.as_ref().map(|_| ns.clone()),
            stream: name.clone(),
            ..Default::default()
        };
        let mut cursor = None;
        let mut all = Vec::new();
        let node = loop {
            let page = client.subscriptions_list(Some(filter.clone()), Some(1000), cursor).await.map_err(explain)?;
            let node = page.node_id;
            all.extend(page.subscriptions);
            match page.next_cursor {
                Some(c) => cursor = Some(c),
                None => break node,
            }
        };
        let _ = client.close().await;
        if json {
            out!("{}", serde_json::json!({"node_id": node, "subscriptions": all}));
        } else {
            out!("{} subscription(s) served by {}", all.len(), if node.is_empty() { "this broker" } else { &node });
            for s in &all {
                out!(
                    "  {}/{}/{} shard {}  id {}  queue {}/{}  dropped {}  at {}  tail {}",
                    s.tenant_id,
                    s.namespace,
                    s.stream,
                    s.shard,
                    s.subscriber_id,
                    s.depth,
                    s.capacity,
                    s.dropped,
                    s.position.map_or_else(|| "-".to_owned(), |p| p.to_string()),
                    s.tail
                );
            }
        }
        return Ok(ExitCode::SUCCESS);
    }
    let name = name.ok_or("name the stream (or --cache cache) to inspect, or pass --subscriptions")?;
    let kind = if cache { ShardKind::Cache } else { ShardKind::Stream };
    let v = client.shard_inspect(&ns, &name, kind, shard).await.map_err(explain)?;
    let _ = client.close().await;
    if json {
        out!("{}", serde_json::to_string(&v).unwrap_or_default());
        return Ok(ExitCode::SUCCESS);
    }
    out!(
        "{ns}/{name} shard {shard} as {} sees it ({} shard(s))",
        if v.node_id.is_empty() { "this broker" } else { &v.node_id },
        v.shards
    );
    out!(
        "  role {}, phase {}, {}",
        v.role,
        v.phase,
        if v.serving { "serving".to_owned() } else { format!("not serving ({})", v.reason.as_deref().unwrap_or("-")) }
    );
    if let Some(a) = &v.assignment {
        out!(
            "  assignment: generation {}, leader {}, replicas [{}]{}{}",
            a.generation,
            a.leader,
            a.replicas.join(", "),
            if a.draining { ", leader draining" } else { "" },
            if a.successor.is_empty() { String::new() } else { format!(", moving to {}", a.successor) }
        );
    }
    if let Some(t) = v.tail {
        out!("  tail {t}{}", v.committed.map(|c| format!(", readable up to {c}")).unwrap_or_default());
    }
    if let Some(d) = &v.detail {
        out!("  {d}");
    }
    Ok(ExitCode::SUCCESS)
}

/// `cluster revoke`: proposes the revocation, then waits until the broker asked lists it.
async fn cluster_revoke(jti: Option<String>, sub: Option<String>, a: AdminArgs) -> Result<ExitCode, String> {
    let m = a.metrics;
    proposed(m, felix_driver_tokio::server::cluster_revoke(m, jti.as_deref(), sub.as_deref(), &a.cluster_secret))
        .await?;
    let start = std::time::Instant::now();
    loop {
        let v = status_json(m).await;
        if let Some(v) = v {
            let listed = |what: &str, x: &Option<String>| {
                x.as_ref().is_none_or(|x| v["revoked"][what].as_array().into_iter().flatten().any(|y| y == x.as_str()))
            };
            if listed("jti", &jti) && listed("sub", &sub) {
                out!("revoked on every broker of the cluster (applied by the one at {m})");
                return Ok(ExitCode::SUCCESS);
            }
        }
        if start.elapsed() >= a.wait {
            return Err(format!(
                "the revocation was proposed but not applied within {:?}; see `felix-node cluster status --json`",
                a.wait
            ));
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
}

/// `cluster init-ca`: a new CA in `out`, never over an existing one.
fn init_ca(out: &std::path::Path, name: &str) -> Result<ExitCode, String> {
    use felix_driver_tokio::tls::{CA_CERT_FILE, CA_KEY_FILE, CertAuthority};
    if out.join(CA_CERT_FILE).exists() || out.join(CA_KEY_FILE).exists() {
        return Err(format!(
            "{} already holds a CA; its brokers use it with `serve --cluster-ca {}` (remove it first to make another, \
             and every broker's certificate with it)",
            out.display(),
            out.display()
        ));
    }
    let ca = CertAuthority::new(name).map_err(|e| e.to_string())?;
    ca.save(out).map_err(|e| e.to_string())?;
    let fp = felix_driver_tokio::tls::fingerprint(&ca.cert());
    out!("made the cluster CA \"{name}\" in {} (SHA-256 {fp})", out.display());
    out!("  {}  what clients trust: --ca {}", CA_CERT_FILE, out.join(CA_CERT_FILE).display());
    out!("  {}  private: copy the directory to each broker's host, and to no one else", CA_KEY_FILE);
    out!("Start every broker with --cluster-ca {} (or [tls] cluster_ca)", out.display());
    Ok(ExitCode::SUCCESS)
}

pub async fn cluster(a: ClusterArgs) -> Result<ExitCode, String> {
    let (metrics, json, conn) = match a.op {
        ClusterOp::Status { metrics, json, limit, after, conn } => {
            if limit.is_some() || after.is_some() {
                return cluster_status_one_page(metrics, json, limit.unwrap_or(STATUS_PAGE), after, conn).await;
            }
            (metrics, json, conn)
        }
        ClusterOp::InitCa { out, name } => return init_ca(&out, &name),
        ClusterOp::Add { member, admin } => {
            let (id, addr) = member
                .split_once('=')
                .filter(|(id, addr)| !id.is_empty() && addr.parse::<std::net::SocketAddr>().is_ok())
                .ok_or_else(|| format!("{member:?}: expected ID=HOST:PORT (the new broker's cluster listener)"))?;
            return cluster_change(Some((id.to_owned(), addr.to_owned())), id.to_owned(), false, admin).await;
        }
        ClusterOp::Remove { node, force, admin } => return cluster_change(None, node, force, admin).await,
        ClusterOp::Revoke { jti, sub, admin } => return cluster_revoke(jti, sub, admin).await,
        ClusterOp::Move { stream, shard, to, cancel, json, metrics, cluster_secret, wait, conn } => {
            let (tenant, namespace) = (conn.tenant.clone(), conn.namespace.clone());
            let name = (tenant.as_str(), namespace.as_str(), stream.as_str());
            let to = if cancel { None } else { to };
            let source = match metrics {
                Some(m) => StatusSource::Metrics(m),
                None => StatusSource::Client(connect(&conn).await?),
            };
            let propose = || async {
                match &source {
                    StatusSource::Metrics(m) => {
                        let asked =
                            felix_driver_tokio::server::cluster_move(*m, name, shard, to.as_deref(), &cluster_secret);
                        proposed(*m, asked).await
                    }
                    StatusSource::Client(client) => {
                        client.shard_move(&namespace, &stream, shard, to.as_deref()).await.map_err(|e| {
                            let t = e.to_string();
                            if t.contains("forbidden") {
                                format!("{t} (moving a shard needs the admin permission on its stream)")
                            } else {
                                t
                            }
                        })?;
                        Ok(())
                    }
                }
            };
            let this = move |x: &serde_json::Value| names_shard(x, name, shard);
            let moving =
                || async { source.fetch().await.is_none_or(|v| v["moves"].as_array().into_iter().flatten().any(this)) };
            let poll = std::time::Duration::from_millis(200);
            propose_when_not_moving(propose, moving, to.as_deref(), wait, poll, json).await?;
            let what = match &to {
                Some(to) => format!("{namespace}/{stream} shard {shard} → {to}"),
                None => format!("cancel the move of {namespace}/{stream} shard {shard}"),
            };
            let done = move |v: &serde_json::Value| {
                let this = |x: &serde_json::Value| names_shard(x, (&tenant, &namespace, &stream), shard);
                let moving = v["moves"].as_array().into_iter().flatten().any(&this);
                let owner = v["shards"].as_array().into_iter().flatten().find(|x| x["kind"] == "stream" && this(x));
                !moving && to.as_ref().is_none_or(|to| owner.is_some_and(|o| o["owner"] == to.as_str()))
            };
            return watch_moves(&what, json, &source, wait, done).await;
        }
        ClusterOp::Drain { node, json, admin } => {
            let m = admin.metrics;
            proposed(m, felix_driver_tokio::server::cluster_drain(m, Some(&node), &admin.cluster_secret)).await?;
            let what = format!("drain {node}");
            let done = move |v: &serde_json::Value| {
                let owns = v["shards"].as_array().into_iter().flatten().any(|x| x["owner"] == node.as_str());
                let moving = v["moves"].as_array().into_iter().flatten().any(|x| x["from"] == node.as_str());
                let draining = v["members"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|m| m["node_id"] == node.as_str() && m["state"] == "draining");
                draining && !owns && !moving
            };
            return watch_moves(&what, json, &StatusSource::Metrics(m), admin.wait, done).await;
        }
        ClusterOp::Inspect { name, shard, cache, subscriptions, json, conn } => {
            return cluster_inspect(name, shard, cache, subscriptions, json, conn).await;
        }
        ClusterOp::Rebalance { json, admin } => {
            let m = admin.metrics;
            proposed(m, felix_driver_tokio::server::cluster_drain(m, None, &admin.cluster_secret)).await?;
            let done = |v: &serde_json::Value| v["moves"].as_array().is_none_or(Vec::is_empty);
            return watch_moves("rebalance", json, &StatusSource::Metrics(m), admin.wait, done).await;
        }
    };
    // Page by page (D55), merged: no one answer has to hold every shard of a large cluster.
    let source = StatusPages::open(metrics, &conn).await?;
    let mut v = source.page(None, STATUS_PAGE).await?;
    let mut next = v["next"].as_str().map(str::to_owned);
    let mut pages = 1;
    while let Some(after) = next.take() {
        let p = source.page(Some(&after), STATUS_PAGE).await?;
        next = p["next"].as_str().map(str::to_owned).filter(|n| *n != after);
        merge_status_page(&mut v, p);
        pages += 1;
        if pages % 10 == 0 && !json {
            eprintln!("{pages} pages of {STATUS_PAGE} shards read…");
        }
    }
    if let Some(o) = v.as_object_mut() {
        o.remove("next");
    }
    if json {
        out!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    print_cluster_status(&v);
    Ok(ExitCode::SUCCESS)
}

/// Shards per page `cluster status` asks for (D55).
const STATUS_PAGE: u32 = 1_000;

/// The status lists a page holds part of (D55); everything else is on every page.
const STATUS_PAGE_LISTS: [&str; 6] =
    ["shards", "replicas", "moves", "move_progress", "failed_replicas", "rejoining_replicas"];

/// Appends a page's lists to the document of the pages before it.
fn merge_status_page(into: &mut serde_json::Value, page: serde_json::Value) {
    for key in STATUS_PAGE_LISTS {
        if let (Some(a), Some(b)) = (into[key].as_array_mut(), page[key].as_array()) {
            a.extend(b.iter().cloned());
        }
    }
}

/// Where `cluster status` reads pages from: a metrics listener, or a broker over the client
/// protocol (which answers whole when it offers no pages).
enum StatusPages {
    Metrics(std::net::SocketAddr),
    Client(Client),
}

impl StatusPages {
    async fn open(metrics: Option<std::net::SocketAddr>, conn: &ConnectArgs) -> Result<StatusPages, String> {
        Ok(match metrics {
            Some(m) => StatusPages::Metrics(m),
            None => StatusPages::Client(connect(conn).await?),
        })
    }

    /// One page; a broker older than pages answers the whole status (no `next`).
    async fn page(&self, after: Option<&str>, limit: u32) -> Result<serde_json::Value, String> {
        let wait = std::time::Duration::from_secs(5);
        match self {
            StatusPages::Metrics(m) => {
                let text =
                    tokio::time::timeout(wait, felix_driver_tokio::server::cluster_status_page(*m, after, limit))
                        .await
                        .map_err(|_| format!("no answer from {m} within 5 s"))?
                        .map_err(|e| format!("{m}: {e} (is it a broker's --metrics-listen address?)"))?;
                let v: serde_json::Value =
                    serde_json::from_str(&text).map_err(|e| format!("{m}: not a cluster status ({e})"))?;
                match v["error"].as_str() {
                    Some(e) => Err(format!("{m}: {e}")),
                    None => Ok(v),
                }
            }
            StatusPages::Client(c) => {
                let worded = |e: felix_driver_tokio::ClientError| {
                    let t = e.to_string();
                    if t.contains("forbidden") {
                        format!("{t} (or ask the metrics listener: --metrics HOST:PORT)")
                    } else {
                        t
                    }
                };
                let paged = c.negotiated().server_features.contains(felix_proto::features::Features::STATUS_PAGES);
                let asked = if paged {
                    tokio::time::timeout(wait, c.cluster_status_page(after, limit)).await
                } else if after.is_some() {
                    return Err("this broker gives its status whole, not in pages: leave --after out".into());
                } else {
                    tokio::time::timeout(wait, c.cluster_status()).await
                };
                asked.map_err(|_| "no answer within 5 s".to_string())?.map_err(worded)
            }
        }
    }
}

/// `cluster status --limit/--after`: one page, and how to ask for the next.
async fn cluster_status_one_page(
    metrics: Option<std::net::SocketAddr>,
    json: bool,
    limit: u32,
    after: Option<String>,
    conn: ConnectArgs,
) -> Result<ExitCode, String> {
    let source = StatusPages::open(metrics, &conn).await?;
    let v = source.page(after.as_deref(), limit).await?;
    if json {
        out!("{v}");
        return Ok(ExitCode::SUCCESS);
    }
    print_cluster_status(&v);
    match v["next"].as_str() {
        Some(n) => out!("next page: felix-node cluster status --limit {limit} --after '{n}'"),
        None => out!("(last page)"),
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a status document (or one page of it) for a reader.
fn print_cluster_status(v: &serde_json::Value) {
    if v["cluster"] != true {
        out!("not a cluster: this broker runs alone");
        return;
    }
    let s = |x: &serde_json::Value| x.as_str().unwrap_or("-").to_owned();
    if v["fenced"] == true {
        // On the first line, the one that is this broker's own.
        out!(
            "node     {}  FENCED: not in contact with the metadata leader (or not caught up): serves none of its shards",
            s(&v["node_id"])
        );
    } else {
        out!("node     {}", s(&v["node_id"]));
    }
    out!("leader   {}", s(&v["leader"]));
    out!("members");
    for m in v["members"].as_array().into_iter().flatten() {
        out!(
            "  {}\t{}\tclients {}\tcluster {}",
            s(&m["node_id"]),
            s(&m["state"]),
            s(&m["client_addr"]),
            s(&m["cluster_addr"])
        );
    }
    let revoked = |what: &str| {
        v["revoked"][what].as_array().into_iter().flatten().filter_map(|x| x.as_str()).collect::<Vec<_>>().join(", ")
    };
    if !revoked("jti").is_empty() || !revoked("sub").is_empty() {
        out!("revoked  jti: [{}]  sub: [{}]", revoked("jti"), revoked("sub"));
    }
    let moves = v["moves"].as_array().cloned().unwrap_or_default();
    if !moves.is_empty() {
        out!("moves");
        for x in &moves {
            out!(
                "  {}/{}/{} {}: {} -> {} {}{}",
                s(&x["tenant"]),
                s(&x["namespace"]),
                s(&x["name"]),
                x["shard"],
                s(&x["from"]),
                s(&x["to"]),
                s(&x["phase"]).replace('_', " "),
                x["at"].as_u64().map(|a| format!(" at {a}")).unwrap_or_default()
            );
        }
    }
    out!("shards (kind tenant/namespace/name shard: owner generation)");
    for sh in v["shards"].as_array().into_iter().flatten() {
        out!(
            "  {} {}/{}/{} {}: {} {}",
            s(&sh["kind"]),
            s(&sh["tenant"]),
            s(&sh["namespace"]),
            s(&sh["name"]),
            sh["shard"],
            s(&sh["owner"]),
            sh["generation"]
        );
    }
    let replicas = v["replicas"].as_array().cloned().unwrap_or_default();
    if !replicas.is_empty() {
        out!(
            "replicas on this broker (shard: role, leader, term, readable up to, committed index, log held from; on the leader each replica's lag in entries)"
        );
        for r in &replicas {
            let lag: Vec<String> = r["followers"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|f| format!("{} lag {}", s(&f["node_id"]), f["lag"]))
                .collect();
            out!(
                "  {}{}/{}/{} {}: {}, leader {}, term {}, next offset {}, committed {}, log from {}{}",
                if r["kind"] == "cache" { "cache " } else { "" },
                s(&r["tenant"]),
                s(&r["namespace"]),
                s(&r["name"]),
                r["shard"],
                s(&r["role"]),
                s(&r["leader"]),
                r["term"],
                r["next_offset"],
                r["committed_index"],
                r["first_index"],
                if lag.is_empty() { String::new() } else { format!("; {}", lag.join(", ")) }
            );
        }
    }
    for f in v["rejoining_replicas"].as_array().into_iter().flatten() {
        out!(
            "  {}{}/{}/{} {}: REJOINING, its log was damaged ({}): set aside, it grants no vote until its group takes it out and adds it back, then catches up",
            if f["kind"] == "cache" { "cache " } else { "" },
            s(&f["tenant"]),
            s(&f["namespace"]),
            s(&f["name"]),
            f["shard"],
            s(&f["damaged"])
        );
    }
    for f in v["failed_replicas"].as_array().into_iter().flatten() {
        out!(
            "  {}/{}/{} {}: STOPPED, {} (it rejoins when this broker restarts)",
            s(&f["tenant"]),
            s(&f["namespace"]),
            s(&f["name"]),
            f["shard"],
            s(&f["failed"])
        );
    }
}

pub async fn stream(a: StreamArgs) -> Result<ExitCode, String> {
    let (stream, yes) = match a.op {
        StreamOp::List { in_namespace, json } => return stream_list(&a.conn, in_namespace.as_deref(), json).await,
        StreamOp::Info { stream, shard, json } => return stream_info(&a.conn, &stream, shard, json).await,
        StreamOp::Delete { stream, yes } => (stream, yes),
        StreamOp::Create { streams, from_file, shards, replication, memory, wait, json } => {
            let mut list: Vec<felix_proto::message::NewStream> = streams
                .into_iter()
                .map(|stream| felix_proto::message::NewStream {
                    stream,
                    shards,
                    replication,
                    durable: memory.then_some(false),
                })
                .collect();
            if let Some(path) = from_file {
                list.extend(read_stream_list(&path, shards, replication, memory)?);
            }
            return stream_create(&a.conn, list, wait, json).await;
        }
    };
    let ns = a.conn.namespace.clone();
    if !yes {
        use std::io::IsTerminal;
        if !std::io::stdin().is_terminal() {
            return Err(format!("deleting {ns}/{stream} removes everything it holds: pass --yes to confirm"));
        }
        eprint!("delete {ns}/{stream} and everything it holds? [y/N] ");
        let mut answer = String::new();
        std::io::stdin().read_line(&mut answer).map_err(|e| e.to_string())?;
        if !matches!(answer.trim(), "y" | "Y" | "yes") {
            eprintln!("not deleted");
            return Ok(ExitCode::from(1));
        }
    }
    let client = connect(&a.conn).await?;
    let existed = client.stream_delete(&ns, &stream).await.map_err(|e| e.to_string())?;
    let _ = client.close().await;
    if existed {
        out!("deleted {ns}/{stream}");
        Ok(ExitCode::SUCCESS)
    } else {
        eprintln!("no stream {ns}/{stream}");
        Ok(ExitCode::from(1))
    }
}

/// Reads `stream create --from-file`: one stream per line, `NAME [SHARDS [REPLICATION]]`.
fn read_stream_list(
    path: &std::path::Path,
    shards: Option<u32>,
    replication: Option<u32>,
    memory: bool,
) -> Result<Vec<felix_proto::message::NewStream>, String> {
    let text = if path.as_os_str() == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s).map_err(|e| format!("standard input: {e}"))?;
        s
    } else {
        std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?
    };
    parse_stream_list(&text, shards, replication, memory).map_err(|e| format!("{}: {e}", path.display()))
}

/// The lines of a stream list (see [`read_stream_list`]); the first bad line is named.
pub fn parse_stream_list(
    text: &str,
    shards: Option<u32>,
    replication: Option<u32>,
    memory: bool,
) -> Result<Vec<felix_proto::message::NewStream>, String> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let at = |why: String| format!("line {}: {why}", i + 1);
        let mut words = line.split_whitespace();
        let name = words.next().unwrap_or("");
        let stream = parse_name(name).map_err(|e| at(format!("{name:?}: {e}")))?;
        let mut count = |what: &str, range: std::ops::RangeInclusive<u32>, default: Option<u32>| match words.next() {
            None => Ok(default),
            Some(w) => match w.parse::<u32>() {
                Ok(n) if range.contains(&n) => Ok(Some(n)),
                _ => Err(at(format!("{what} {w:?} is not a number from {} to {}", range.start(), range.end()))),
            },
        };
        let shards = count("shard count", 1..=4096, shards)?;
        let replication = count("replication", 1..=7, replication)?;
        if let Some(extra) = words.next() {
            return Err(at(format!("{extra:?} after the replication: a line is NAME [SHARDS [REPLICATION]]")));
        }
        out.push(felix_proto::message::NewStream { stream, shards, replication, durable: memory.then_some(false) });
    }
    Ok(out)
}

/// `stream create`: a thousand streams per request; then, until `wait`, the listing until it
/// shows every created one (in a cluster they exist once the metadata group committed them).
async fn stream_create(
    c: &ConnectArgs,
    list: Vec<felix_proto::message::NewStream>,
    wait: std::time::Duration,
    json: bool,
) -> Result<ExitCode, String> {
    if list.is_empty() {
        return Err("name at least one stream (or --from-file FILE)".into());
    }
    let mut seen = std::collections::BTreeSet::new();
    if let Some(dup) = list.iter().find(|s| !seen.insert(s.stream.as_str())) {
        return Err(format!("stream {} is named twice", dup.stream));
    }
    let ns = c.namespace.clone();
    let client = connect(c).await?;
    let total = list.len();
    let (mut created, mut existed) = (Vec::new(), Vec::new());
    let started = std::time::Instant::now();
    for chunk in list.chunks(1000) {
        let (c, e) = client.stream_create(&ns, chunk.to_vec()).await.map_err(|e| match e {
            felix_driver_tokio::ClientError::Unsupported(_) => {
                "this broker cannot create streams on request (it does not advertise FEATURE_STREAM_CREATE)".to_owned()
            }
            e => e.to_string(),
        })?;
        created.extend(c);
        existed.extend(e);
        if total > 1000 {
            eprintln!("asked for {} of {total} stream(s)", created.len() + existed.len());
        }
    }
    // Until every broker of a cluster knows them: the listing is the cluster's.
    let mut missing: std::collections::BTreeSet<&str> = created.iter().map(String::as_str).collect();
    let deadline = started + wait;
    let mut shown = std::time::Instant::now();
    while !missing.is_empty() {
        let mut after: Option<String> = None;
        loop {
            let (page, next) =
                client.stream_list(Some(&ns), after.as_deref(), Some(1000)).await.map_err(|e| e.to_string())?;
            for e in &page {
                missing.remove(e.stream.as_str());
            }
            match next {
                Some(n) if !missing.is_empty() => after = Some(n),
                _ => break,
            }
        }
        if missing.is_empty() {
            break;
        }
        if std::time::Instant::now() >= deadline {
            let _ = client.close().await;
            return Err(format!(
                "{} of {} stream(s) not created within {:?} (the cluster may still be creating them: `felix-node stream list`)",
                missing.len(),
                created.len(),
                wait
            ));
        }
        if shown.elapsed() >= std::time::Duration::from_secs(1) {
            eprintln!("created {} of {} stream(s)", created.len() - missing.len(), created.len());
            shown = std::time::Instant::now();
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    let _ = client.close().await;
    if json {
        let existed: Vec<_> =
            existed.iter().map(|e| serde_json::json!({"stream": e.stream, "shards": e.shards})).collect();
        out!("{}", serde_json::json!({"created": created, "existed": existed}));
    } else {
        out!("created {} stream(s) in {ns} in {:.2} s", created.len(), started.elapsed().as_secs_f64());
        for e in &existed {
            out!(
                "{ns}/{} existed already ({} shard{}), left as it is",
                e.stream,
                e.shards,
                if e.shards == 1 { "" } else { "s" }
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `stream list`: every page, in order.
async fn stream_list(c: &ConnectArgs, namespace: Option<&str>, json: bool) -> Result<ExitCode, String> {
    let client = connect(c).await?;
    let mut after: Option<String> = None;
    let mut out = std::io::stdout().lock();
    let mut n = 0usize;
    loop {
        let (page, next) = client.stream_list(namespace, after.as_deref(), Some(1000)).await.map_err(|e| match e {
            felix_driver_tokio::ClientError::Unsupported(_) => {
                "this broker cannot list streams (it does not advertise FEATURE_STREAM_INFO)".to_owned()
            }
            e => e.to_string(),
        })?;
        for e in &page {
            let line = if json {
                serde_json::json!({"namespace": e.namespace, "stream": e.stream, "shards": e.shards}).to_string()
            } else {
                format!("{}/{}\t{} shard{}", e.namespace, e.stream, e.shards, if e.shards == 1 { "" } else { "s" })
            };
            let _ = writeln!(out, "{line}");
        }
        n += page.len();
        match next {
            Some(next) => after = Some(next),
            None => break,
        }
    }
    drop(out);
    let _ = client.close().await;
    if n == 0 && !json {
        eprintln!("no streams{} this token may use", namespace.map(|ns| format!(" in {ns}")).unwrap_or_default());
    }
    Ok(ExitCode::SUCCESS)
}

/// `stream info`: the stream's configuration and every shard (or one), each asked of the
/// broker that serves it.
async fn stream_info(c: &ConnectArgs, stream: &str, shard: Option<u32>, json: bool) -> Result<ExitCode, String> {
    let ns = c.namespace.clone();
    let shards = crate::reading::shards_of(c, stream, shard, false).await?;
    let list = match shard {
        Some(s) => vec![s],
        None => shards.list.clone(),
    };
    let mut rows = Vec::new();
    for s in list {
        let (client, v) = with_redirects(c, |client| {
            let (ns, stream) = (ns.clone(), stream.to_owned());
            async move {
                let r = client.stream_info(&ns, &stream, s).await;
                (client, r)
            }
        })
        .await
        .map_err(|e| format!("shard {s}: {e}"))?;
        let _ = client.close().await;
        rows.push(v);
    }
    let Some(first) = rows.first() else { return Err(format!("{ns}/{stream} has no shards")) };
    let retention = |v: &felix_proto::message::StreamInfoView| {
        let mut r = Vec::new();
        if let Some(n) = v.retention_records {
            r.push(format!("{n} records"));
        }
        if let Some(b) = v.retention_bytes {
            r.push(format!("{} MiB", b >> 20));
        }
        if let Some(s) = v.retention_secs {
            r.push(humantime(std::time::Duration::from_secs(s)));
        }
        if r.is_empty() { "everything".to_owned() } else { r.join(" or ") }
    };
    let total = |f: fn(&felix_proto::message::StreamInfoView) -> u64| rows.iter().map(f).sum::<u64>();
    if json {
        let per: Vec<serde_json::Value> = rows
            .iter()
            .map(|v| {
                serde_json::json!({"shard": v.shard, "start": v.start, "next_offset": v.next_offset, "records": v.records,
                    "bytes": v.bytes, "subscribers": v.subscribers, "groups": v.groups})
            })
            .collect();
        out!(
            "{}",
            serde_json::json!({"namespace": ns, "stream": stream, "shards": first.shards, "durable": first.durable,
                "replication": first.replication, "retention_records": first.retention_records,
                "retention_bytes": first.retention_bytes, "retention_secs": first.retention_secs,
                "records": total(|v| v.records), "bytes": total(|v| v.bytes), "per_shard": per})
        );
        return Ok(ExitCode::SUCCESS);
    }
    let kept = if first.durable { "durable (on disk)" } else { "in memory only" };
    let copies = if first.replication > 1 { format!("{} replicas", first.replication) } else { "one copy".into() };
    out!("{ns}/{stream}: {} shard(s), {kept}, {copies}, retains {}", first.shards, retention(first));
    out!(
        "{:>6} {:>12} {:>12} {:>12} {:>14} {:>11} {:>7}",
        "shard",
        "start",
        "next offset",
        "records",
        "bytes",
        "subscribers",
        "groups"
    );
    for v in &rows {
        out!(
            "{:>6} {:>12} {:>12} {:>12} {:>14} {:>11} {:>7}",
            v.shard,
            v.start,
            v.next_offset,
            v.records,
            v.bytes,
            v.subscribers,
            v.groups
        );
    }
    if rows.len() > 1 {
        out!(
            "{:>6} {:>12} {:>12} {:>12} {:>14} {:>11} {:>7}",
            "all",
            "",
            "",
            total(|v| v.records),
            total(|v| v.bytes),
            total(|v| v.subscribers),
            total(|v| v.groups)
        );
    }
    Ok(ExitCode::SUCCESS)
}

/// Prints a cache's changes as they happen (offset, key, value or `<deleted>`). A watch whose
/// cache moved or failed over (`shard_moved`), or whose broker went away, is opened again on
/// the cache's owner from `max(last change + 1, resume_from)`: no change missed or repeated.
#[allow(clippy::too_many_arguments)] // the command's options
async fn watch(
    conn: &ConnectArgs,
    ns: &str,
    cache: &str,
    filter: felix_proto::client::WatchOn,
    from: Option<u64>,
    retained: bool,
    json: bool,
    count: Option<u64>,
) -> Result<ExitCode, String> {
    let open = |from: Option<u64>, retained: bool| {
        let filter = filter.clone();
        with_redirects(conn, move |client| {
            let (ns, cache, filter) = (ns.to_owned(), cache.to_owned(), filter.clone());
            async move {
                let r = client.cache_watch(&ns, &cache, filter, from, retained).await;
                (client, r)
            }
        })
    };
    let (mut client, mut w) = open(from, retained).await?;
    let mut note = format!("watching {ns}/{cache}; live from offset {}", w.resume_offset);
    if w.resnapshot {
        note.push_str(" (the history asked for was compacted: current values first)");
    }
    if let Some(n) = w.retained_count {
        note.push_str(&format!(" ({n} current value(s) first)"));
    }
    eprintln!("{note}");
    let mut seen = 0u64;
    let mut last: Option<u64> = None;
    let mut start = w.resume_offset;
    let mut code = ExitCode::SUCCESS;
    while count.is_none_or(|c| seen < c) {
        let item = tokio::select! {
            item = w.next() => item,
            _ = wait_for_shutdown() => {
                // Interrupted, as other command-line tools say it: 130.
                code = ExitCode::from(130);
                break;
            }
        };
        let resume_from = match item {
            Some(SubscriptionItem::CacheChange(e)) => {
                last = Some(e.offset);
                let text = e.value.as_ref().map(|v| String::from_utf8_lossy(&v.0).into_owned());
                let line = if json {
                    let mut o = serde_json::Map::new();
                    o.insert("offset".into(), e.offset.into());
                    o.insert("key".into(), e.key.clone().into());
                    o.insert("value".into(), text.map_or(serde_json::Value::Null, Into::into));
                    if e.expires_at_millis > 0 {
                        o.insert("expires_at_millis".into(), e.expires_at_millis.into());
                    }
                    serde_json::Value::Object(o).to_string()
                } else {
                    format!("{}\t{}\t{}", e.offset, e.key, text.as_deref().unwrap_or("<deleted>"))
                };
                if writeln!(std::io::stdout().lock(), "{line}").is_err() {
                    break;
                }
                seen += 1;
                continue;
            }
            Some(SubscriptionItem::End(EndReason::WatchLagged { resume_from })) => {
                eprintln!("the watch fell behind; resume with --from {resume_from}");
                return Ok(ExitCode::FAILURE);
            }
            Some(SubscriptionItem::End(EndReason::Moved(m))) => {
                eprintln!("the watch ended: {}", ended(&EndReason::Moved(m.clone())));
                m.resume_from
            }
            Some(SubscriptionItem::End(r)) if follows(&r) => {
                eprintln!("the watch ended: {}", ended(&r));
                None
            }
            Some(SubscriptionItem::End(other)) => {
                let why = match other {
                    EndReason::WatchLagged { resume_from } => {
                        format!("it fell behind; resume with --from {resume_from}")
                    }
                    EndReason::Deleted => "the cache was deleted".into(),
                    EndReason::Error(e) => e.message,
                    other => ended(&other),
                };
                eprintln!("the watch ended: {why}");
                return Ok(ExitCode::FAILURE);
            }
            Some(SubscriptionItem::Events(_)) => continue,
            None => {
                eprintln!("the watch's connection closed");
                None
            }
        };
        // Where to go on: after the last change printed, never before where the old owner
        // said its log ends.
        let after = last.map_or(start, |l| l + 1);
        let from = resume_from.map_or(after, |r| r.max(after));
        let _ = client.close().await;
        let until = std::time::Instant::now() + std::time::Duration::from_secs(60);
        let mut pause = std::time::Duration::from_millis(100);
        loop {
            match open(Some(from), false).await {
                Ok((c, nw)) => {
                    eprintln!("watching again from offset {from}");
                    client = c;
                    w = nw;
                    start = from;
                    break;
                }
                Err(e) if std::time::Instant::now() < until => {
                    eprintln!("watching again: {e}; retrying in {} ms", pause.as_millis());
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(std::time::Duration::from_secs(2));
                }
                Err(e) => return Err(format!("could not watch again from offset {from} for a minute: {e}")),
            }
        }
    }
    let _ = client.close().await;
    Ok(code)
}

/// Prints a value read (or removed); a miss exits 1.
fn print_value(cache: &str, key: &str, v: Option<Bytes>) -> ExitCode {
    match v {
        Some(v) => {
            out!("{}", String::from_utf8_lossy(&v));
            ExitCode::SUCCESS
        }
        None => {
            eprintln!("{cache}/{key}: not found");
            ExitCode::from(1)
        }
    }
}

/// `felix-node sim`: the fault simulation over many seeds.
/// `sim --cluster`: the metadata group's simulation over many seeds.
fn sim_cluster(a: &SimArgs) -> Result<ExitCode, String> {
    let first = a.seed.unwrap_or(0);
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let count = if single { 1 } else { a.seeds.unwrap_or(u64::MAX) };
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let steps = a.steps.map_or(300, |s| s as u64);
    let start = std::time::Instant::now();
    let (mut seeds, mut applied, mut crashes, mut elections, mut lost) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for seed in first..first.saturating_add(count) {
        if !single && a.seeds.is_none() && start.elapsed() >= budget {
            break;
        }
        match felix_proto::cluster::sim::run(seed, steps) {
            Ok(o) => {
                seeds += 1;
                (applied, crashes, elections, lost) =
                    (applied + o.applied, crashes + o.crashes, elections + o.elections, lost + o.lost);
                if !a.quiet {
                    out!("seed {seed}: {} brokers, {} applied, digest {:016x}", o.nodes, o.applied, o.digest);
                }
            }
            Err(v) => {
                out!("FAIL {v}");
                out!("replay: felix-node sim --cluster --seed {seed} --steps {steps}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    out!(
        "{seeds} seeds passed in {:.1} s: {applied} commands applied, {crashes} crashes, {elections} elections, {lost} messages lost",
        start.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// `sim --cluster --clients`: whole brokers and clients under faults, over many seeds.
fn sim_cluster_world(a: &SimArgs) -> Result<ExitCode, String> {
    let first = a.seed.unwrap_or(0);
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let count = if single { 1 } else { a.seeds.unwrap_or(u64::MAX) };
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let ticks = a.steps.map_or(300, |s| s.min(u32::MAX as usize) as u32);
    let start = std::time::Instant::now();
    let mut t = felix_proto::cluster::world::WorldReport::default();
    let mut seeds = 0u64;
    for seed in first..first.saturating_add(count) {
        if !single && a.seeds.is_none() && start.elapsed() >= budget {
            break;
        }
        match felix_proto::cluster::world::run(seed, start, ticks) {
            Ok(r) => {
                seeds += 1;
                t.absorb(&r);
                if !a.quiet {
                    out!(
                        "seed {seed}: {} brokers, {} requests ({} acked, {} redirected, {} unavailable), {} crashes, digest {:016x}",
                        r.nodes,
                        r.requests,
                        r.acked,
                        r.redirected,
                        r.unavailable,
                        r.crashes,
                        r.digest
                    );
                }
            }
            Err(v) => {
                out!("FAIL {v}");
                out!("replay: felix-node sim --cluster --clients --seed {seed} --steps {ticks}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    out!(
        "{seeds} seeds passed in {:.1} s: {} requests, {} acked ({} forwarded, {} commits), {} subscribed, {} cache answers, {} redirected, {} unavailable, {} crashes, {} peer messages lost, {} operator moves asked, {} durable shards moved, {} records given to following subscribers ({} moves followed), {} replicas moved to another broker, {} snapshots ({} with a host's part written beside them; in {} chunks, {} read back from disk for a replica behind, {} installed or kept states read back from disk in pieces, {} restores of a kept one started at a restart), {} entries replayed from disk at restarts, {} metadata snapshots ({} sent to a broker behind)",
        start.elapsed().as_secs_f64(),
        t.requests,
        t.acked,
        t.forwarded,
        t.commits_acked,
        t.subscribed,
        t.cache_answers,
        t.redirected,
        t.unavailable,
        t.crashes,
        t.lost,
        t.moves_asked,
        t.moves_done,
        t.followed,
        t.follows,
        t.replica_moves,
        t.snapshots,
        t.snapshots_with_rest,
        t.snapshot_chunks,
        t.snapshot_reads,
        t.restores_from_disk,
        t.restores_at_restart,
        t.replayed,
        t.meta_snapshots,
        t.meta_snapshots_received
    );
    Ok(ExitCode::SUCCESS)
}

/// `sim --replicated`: one replicated shard's Raft group under faults, over many seeds.
fn sim_replicated(a: &SimArgs) -> Result<ExitCode, String> {
    let first = a.seed.unwrap_or(0);
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let count = if single { 1 } else { a.seeds.unwrap_or(u64::MAX) };
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let steps = a.steps.map_or(600, |s| s as u64);
    let start = std::time::Instant::now();
    let mut t = felix_proto::cluster::replica_sim::ReplicaReport::default();
    let mut seeds = 0u64;
    for seed in first..first.saturating_add(count) {
        if !single && a.seeds.is_none() && start.elapsed() >= budget {
            break;
        }
        match felix_proto::cluster::replica_sim::run(seed, steps) {
            Ok(r) => {
                seeds += 1;
                t.absorb(&r);
                if !a.quiet {
                    out!(
                        "seed {seed}: {} replicas, {} batches acknowledged ({} duplicates answered), {} crashes, digest {:016x}",
                        r.replicas,
                        r.acked,
                        r.duplicates,
                        r.crashes,
                        r.digest
                    );
                }
            }
            Err(v) => {
                out!("FAIL {v}");
                out!("replay: felix-node sim --replicated --seed {seed} --steps {steps}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    out!(
        "{seeds} seeds passed in {:.1} s: {} batches acknowledged exactly once ({} retries answered as duplicates, {} outcome-unknown answers), {} crashes, {} elections, {} messages lost, {} compactions, {} snapshots installed ({} read back from disk for a replica behind), {} host states restored",
        start.elapsed().as_secs_f64(),
        t.acked,
        t.duplicates,
        t.outcome_unknown,
        t.crashes,
        t.elections,
        t.lost,
        t.compactions,
        t.snapshots_installed,
        t.snapshot_reads,
        t.host_restores
    );
    Ok(ExitCode::SUCCESS)
}

pub fn sim(a: &SimArgs) -> Result<ExitCode, String> {
    if a.replicated {
        return sim_replicated(a);
    }
    if a.clients {
        return sim_cluster_world(a);
    }
    if a.cluster {
        return sim_cluster(a);
    }
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let epoch = std::time::Instant::now();
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let first = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let limit = if single { Some(1) } else { a.seeds };
    let jobs = a.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let start = std::time::Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // (seeds passed, their counts, the failure if any)
    let shared = Arc::new(Mutex::new((0u64, felix_proto::chaos::ChaosReport::default(), None::<String>)));
    let steps_of = |seed: u64| a.steps.unwrap_or_else(|| felix_proto::chaos::steps_for_seed(seed));
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            let (next, stop, shared) = (next.clone(), stop.clone(), shared.clone());
            scope.spawn(move || {
                loop {
                    if stop.load(Ordering::SeqCst) || (limit.is_none() && start.elapsed() >= budget) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if limit.is_some_and(|n| i >= n) {
                        return;
                    }
                    let seed = first.wrapping_add(i);
                    let steps = steps_of(seed);
                    let result = felix_proto::chaos::run_seed(seed, epoch, steps);
                    let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
                    match result {
                        Ok(r) => {
                            if !a.quiet {
                                out!("seed {seed} steps {steps} digest {:016x} ok", r.digest);
                            }
                            g.0 += 1;
                            g.1.add(&r);
                            if g.0.is_multiple_of(10) && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                                let secs = start.elapsed().as_secs_f64();
                                eprint!("\r{} seeds, {:.0} seeds/hour, no failure   ", g.0, g.0 as f64 * 3600.0 / secs);
                            }
                        }
                        Err(e) => {
                            stop.store(true, Ordering::SeqCst);
                            if g.2.is_none() {
                                g.2 = Some(format!(
                                    "seed {seed} FAILED: {e}\nreplay with: felix-node sim --seed {seed} --steps {steps}"
                                ));
                            }
                            return;
                        }
                    }
                }
            });
        }
    });
    let (ran, total, failure) = {
        let g = shared.lock().unwrap_or_else(|e| e.into_inner());
        (g.0, g.1.clone(), g.2.clone())
    };
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    eprintln!();
    if let Some(f) = failure {
        eprintln!("{f}");
        return Ok(ExitCode::FAILURE);
    }
    let steps =
        a.steps.map_or_else(|| format!("{} steps in all (varied per seed)", total.steps), |s| format!("{s} steps"));
    out!(
        "{ran} seed(s) of {steps} passed in {secs:.1} s ({:.0} seeds/hour, from seed {first}, {jobs} job(s)): {} acknowledged records verified, {} deliveries, {} failed writes, {} lost connections, {} crashes, {} cache reads checked, {} idempotent resends, {} group deliveries, {} group acks, {} commits folded, {} state keys checked after crashes",
        ran as f64 * 3600.0 / secs,
        total.acked,
        total.delivered,
        total.failed_writes,
        total.lost_connections,
        total.crashes,
        total.cache_reads,
        total.idempotent_resends,
        total.group_deliveries,
        total.group_acks,
        total.commits,
        total.state_reads
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A move refused because placement is moving the shard already waits for that move to end
    /// and asks again; ending where it was asked to go is done; any other refusal is said.
    #[tokio::test]
    async fn a_move_of_a_shard_already_moving_waits_for_that_move_then_asks_again() {
        use std::cell::{Cell, RefCell};
        let run = |answers: Vec<Result<(), String>>, busy_polls: u32| async move {
            let answers = RefCell::new(answers.into_iter());
            let (asked, polled) = (Cell::new(0), Cell::new(0));
            let propose = || {
                asked.set(asked.get() + 1);
                let a = answers.borrow_mut().next().unwrap_or(Ok(()));
                async move { a }
            };
            let moving = || {
                polled.set(polled.get() + 1);
                let busy = polled.get() <= busy_polls;
                async move { busy }
            };
            let ms = std::time::Duration::from_millis;
            let r = propose_when_not_moving(propose, moving, Some("n4"), ms(5_000), ms(1), true).await;
            (r, asked.get(), polled.get())
        };
        let busy = || Err("127.0.0.1:1: refused (409): d/d/orders shard 0 is already moving (n2 → n4)".to_owned());
        // Placement's move ends on n4 as a replica: the operator's move (the lead) is proposed.
        assert_eq!(run(vec![busy(), Ok(())], 3).await, (Ok(()), 2, 4));
        // Placement's move ended with the shard on n4: nothing left to do.
        let there = Err("refused (409): d/d/orders shard 0 is on n4 already".to_owned());
        assert_eq!(run(vec![busy(), there.clone()], 0).await, (Ok(()), 2, 1));
        // Asked first, "already there" is the operator's mistake, and said.
        assert_eq!(run(vec![there.clone()], 0).await, (there, 1, 0));
        let other = Err("refused (409): n9 is not an active member".to_owned());
        assert_eq!(run(vec![busy(), other.clone()], 0).await, (other, 2, 1));
        // A move that never ends: the refusal is said once `wait` is spent.
        let ms = std::time::Duration::from_millis;
        let forever = propose_when_not_moving(|| async { busy() }, || async { true }, Some("n4"), ms(30), ms(1), true);
        assert!(forever.await.unwrap_err().contains("already moving"));
    }

    #[test]
    fn certificate_names_read_as_users_write_them() {
        let e = "connecting: the cryptographic handshake failed: error 42: invalid peer certificate: certificate not valid for name \"foo\"; certificate is only valid for DnsName(\"localhost\"), IpAddress(127.0.0.1) or IpAddress(0::1)";
        let t = tidy_tls_error(e);
        assert!(t.contains("it names localhost, 127.0.0.1, ::1: give one"), "{t}");
        assert!(!t.contains("DnsName"), "{t}");
        assert_eq!(tidy_tls_error("other"), "other");
    }

    #[test]
    fn addresses_may_be_host_names_whose_name_is_the_server_name() {
        let a = parse_addrs("localhost:5000").unwrap();
        assert_eq!(a.0, vec!["127.0.0.1:5000".parse().unwrap()], "IPv4 first: the default listener");
        assert_eq!(a.1.as_deref(), Some("localhost"));
        let b = parse_addrs("127.0.0.1:5001, localhost:5002").unwrap();
        assert_eq!(b.0.len(), 2);
        assert_eq!(b.1, None, "the first was an address: the default server name stays");
        assert!(parse_addrs("localhost").unwrap_err().contains("HOST:PORT"));
        assert!(parse_addrs("localhost:http").unwrap_err().contains("not a number"));
        assert!(parse_addrs(" , ").unwrap_err().contains("no address"));
    }

    #[test]
    fn durations_print_as_the_flags_take_them() {
        for s in ["5s", "250ms", "2m", "1h", "1d", "0s"] {
            assert_eq!(humantime(parse_duration(s).unwrap()), s);
        }
        assert_eq!(humantime(std::time::Duration::from_millis(1500)), "1500ms");
    }

    #[test]
    fn byte_rates_read_as_operators_write_them_and_bad_ones_are_named() {
        assert_eq!(parse_byte_rate("50MB/s"), Ok(50_000_000));
        assert_eq!(parse_byte_rate(" 20MiB/s "), Ok(20 << 20));
        assert_eq!(parse_byte_rate("1G"), Ok(1_000_000_000));
        assert_eq!(parse_byte_rate("3gib"), Ok(3 << 30));
        assert_eq!(parse_byte_rate("65536"), Ok(65_536));
        assert_eq!(parse_byte_rate("512 KiB/s"), Ok(512 << 10));
        assert!(parse_byte_rate("0MB/s").unwrap_err().contains("above zero"));
        assert!(parse_byte_rate("fast").unwrap_err().contains("like 50MB/s"));
        assert!(parse_byte_rate("5Mb/s").is_ok(), "case does not matter: bytes");
        assert!(parse_byte_rate("5 furlongs").unwrap_err().contains("unknown unit"));
        assert!(parse_byte_rate("99999999999GB").unwrap_err().contains("too large"));
        assert!(parse_byte_rate("-5MB").is_err());
    }
}
