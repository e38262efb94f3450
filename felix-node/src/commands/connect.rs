//! Connecting a client subcommand to a broker: options from the flags, `not_leader` redirects
//! followed, TLS errors worded for the operator.

use super::*;

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

/// The client options the connection arguments say.
pub(super) fn client_options(
    c: &ConnectArgs,
    adjust: impl FnOnce(&mut ClientOptions),
) -> Result<ClientOptions, String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn certificate_names_read_as_users_write_them() {
        let e = "connecting: the cryptographic handshake failed: error 42: invalid peer certificate: certificate not valid for name \"foo\"; certificate is only valid for DnsName(\"localhost\"), IpAddress(127.0.0.1) or IpAddress(0::1)";
        let t = tidy_tls_error(e);
        assert!(t.contains("it names localhost, 127.0.0.1, ::1: give one"), "{t}");
        assert!(!t.contains("DnsName"), "{t}");
        assert_eq!(tidy_tls_error("other"), "other");
    }
}
