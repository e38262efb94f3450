//! The HTTP side: the metrics and operator endpoint and the web UI's listener (requests parsed
//! and checked here, answered by the broker task), and the client functions the CLI reaches them with.

use super::*;

/// An operator's change of the cluster's members, from the metrics listener.
#[derive(Debug)]
pub(crate) enum AdminRequest {
    Add { node: String, addr: String },
    Remove { node: String, force: bool },
    Revoke { jti: Option<String>, sub: Option<String> },
    Move { shard: felix_proto::cluster::metadata::ShardId, to: Option<String> },
    Drain { node: String },
    Rebalance,
}

/// [`percent_decode`], for the web view.
pub(crate) fn percent_decode_pub(v: &str) -> String {
    percent_decode(v)
}

/// `percent_encode`, for the web view's cookie and the banner's link.
pub fn percent_encode_pub(v: &str) -> String {
    percent_encode(v)
}

/// Decodes `%XX` escapes of a query value (anything malformed is kept as it is).
fn percent_decode(v: &str) -> String {
    let b = v.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let hex = |c: u8| (c as char).to_digit(16);
        match (b[i], b.get(i + 1).copied().and_then(hex), b.get(i + 2).copied().and_then(hex)) {
            (b'%', Some(h), Some(l)) => {
                out.push((h * 16 + l) as u8);
                i += 3;
            }
            (c, _, _) => {
                out.push(c);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Encodes a query value: unreserved characters as they are, everything else `%XX`.
fn percent_encode(v: &str) -> String {
    v.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || b"._-:[]".contains(&b) {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

/// Reads `POST /cluster/add?node=N&addr=A`, `POST /cluster/remove?node=N[&force=1]` or `POST
/// /cluster/revoke?jti=J&sub=S` (either or both, percent-encoded) with `Authorization: Bearer
/// <cluster secret>`. Anything else is a status and a reason.
fn admin_request(head: &str, secret: Option<&str>) -> Result<AdminRequest, (u16, String)> {
    let mut lines = head.lines();
    let line = lines.next().unwrap_or_default();
    let target = line.strip_prefix("POST ").and_then(|r| r.split(' ').next()).unwrap_or_default();
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let Some(secret) = secret else { return Err((404, "not a cluster member".into())) };
    let given = lines
        .filter_map(|l| l.split_once(':'))
        .find(|(k, _)| k.trim().eq_ignore_ascii_case("authorization"))
        .and_then(|(_, v)| v.trim().strip_prefix("Bearer ").map(str::trim).map(str::to_owned));
    if !given.is_some_and(|g| crate::cluster::same_secret(&g, secret)) {
        return Err((401, "the cluster secret is missing or wrong (Authorization: Bearer <secret>)".into()));
    }
    let arg = |name: &str| {
        query.split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == name).map(|(_, v)| percent_decode(v))
    };
    if path == "/cluster/rebalance" {
        return Ok(AdminRequest::Rebalance);
    }
    if path == "/cluster/move" {
        let stream = arg("stream").ok_or((400, "stream=NAME is required".to_string()))?;
        let shard = arg("shard")
            .and_then(|s| s.parse::<u32>().ok())
            .ok_or((400, "shard=N (a shard number) is required".to_string()))?;
        let to = arg("to");
        if to.is_none() && arg("cancel").is_none_or(|c| c != "1") {
            return Err((400, "to=NODE (or cancel=1) is required".into()));
        }
        let shard = felix_proto::cluster::metadata::ShardId {
            kind: felix_proto::cluster::metadata::Kind::Stream,
            tenant: arg("tenant").unwrap_or_else(|| "default".into()),
            namespace: arg("namespace").unwrap_or_else(|| "default".into()),
            name: stream,
            shard,
        };
        return Ok(AdminRequest::Move { shard, to });
    }
    if path == "/cluster/revoke" {
        let (jti, sub) = (arg("jti"), arg("sub"));
        if jti.is_none() && sub.is_none() {
            return Err((400, "jti=TOKEN_ID and/or sub=PRINCIPAL is required".into()));
        }
        return Ok(AdminRequest::Revoke { jti, sub });
    }
    let node = arg("node").ok_or((400, "node=ID is required".to_string()))?;
    match path {
        "/cluster/add" => {
            let addr = arg("addr").ok_or((400, "addr=HOST:PORT (its cluster listener) is required".to_string()))?;
            Ok(AdminRequest::Add { node, addr })
        }
        "/cluster/remove" => Ok(AdminRequest::Remove { node, force: arg("force").is_some_and(|f| f == "1") }),
        "/cluster/drain" => Ok(AdminRequest::Drain { node }),
        _ => Err((404, format!("no such admin path {path}"))),
    }
}

/// The web view's listener: `GET /` with the token gets the page; anything else 401 or 404.
pub(super) async fn web_loop(listener: tokio::net::TcpListener, tx: mpsc::UnboundedSender<Input>, token: String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { return };
        let tx = tx.clone();
        let token = token.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            let n = tokio::time::timeout(Duration::from_secs(2), sock.read(&mut buf)).await.ok().and_then(Result::ok);
            let head = n.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned()).unwrap_or_default();
            let path = head.split(' ').nth(1).unwrap_or_default().split('?').next().unwrap_or_default().to_owned();
            let mut extra = String::new();
            let (status, body) = if !head.starts_with("GET ") {
                (405, "GET only (the view is read-only)\n".to_string())
            } else if crate::web::token_in_query(&head, &token) {
                // A login: the cookie keeps the browser logged in, and the address it is sent
                // to has no token in it (out of the address bar, history and screenshots).
                extra = format!(
                    "Set-Cookie: {}={}; HttpOnly; SameSite=Strict; Path=/\r\nLocation: /\r\n",
                    crate::web::COOKIE,
                    crate::server::percent_encode_pub(&token)
                );
                (303, "logged in\n".to_string())
            } else if !crate::web::authorized(&head, &token) {
                (401, crate::web::login_page())
            } else if path != "/" {
                (404, "not found\n".to_string())
            } else {
                let (rtx, rrx) = oneshot::channel();
                let after = head
                    .split(' ')
                    .nth(1)
                    .and_then(|t| t.split_once('?'))
                    .and_then(|(_, q)| q.split('&').find_map(|kv| kv.strip_prefix("after=")))
                    .and_then(|a| felix_proto::cluster::metadata::ShardId::from_cursor(&percent_decode(a)));
                if tx.send(Input::WebView(after, rtx)).is_err() {
                    return;
                }
                let Ok(page) = rrx.await else { return };
                (200, page)
            };
            let reason = match status {
                200 => "OK",
                303 => "See Other",
                401 => "Unauthorized",
                404 => "Not Found",
                _ => "Method Not Allowed",
            };
            let kind = if status == 200 || status == 401 { "text/html; charset=utf-8" } else { "text/plain" };
            let head = format!(
                "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\n{extra}Cache-Control: no-store\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

pub(super) async fn metrics_loop(
    listener: tokio::net::TcpListener,
    tx: mpsc::UnboundedSender<Input>,
    secret: Option<String>,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    loop {
        let Ok((mut sock, _)) = listener.accept().await else { return };
        let tx = tx.clone();
        let secret = secret.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 2048];
            let n = tokio::time::timeout(Duration::from_secs(2), sock.read(&mut buf)).await.ok().and_then(Result::ok);
            let head = n.map(|n| String::from_utf8_lossy(&buf[..n]).into_owned()).unwrap_or_default();
            let cluster = head.starts_with("GET /cluster");
            let (status, kind, body) = if head.starts_with("POST ") {
                let (rtx, rrx) = oneshot::channel();
                let answer = match admin_request(&head, secret.as_deref()) {
                    Ok(req) => {
                        if tx.send(Input::ClusterAdmin(req, rtx)).is_err() {
                            return;
                        }
                        let Ok(a) = rrx.await else { return };
                        a
                    }
                    Err(e) => e,
                };
                (answer.0, "application/json", answer.1)
            } else if cluster {
                let (rtx, rrx) = oneshot::channel();
                match status_page_of(&head) {
                    Ok(page) => {
                        if tx.send(Input::ClusterStatus(page, rtx)).is_err() {
                            return;
                        }
                        match rrx.await {
                            Ok(Ok(body)) => (200, "application/json", body),
                            Ok(Err(e)) => (400, "application/json", format!("{}\n", serde_json::json!({"error": e}))),
                            Err(_) => return,
                        }
                    }
                    Err(e) => (400, "application/json", format!("{}\n", serde_json::json!({"error": e}))),
                }
            } else {
                let (rtx, rrx) = oneshot::channel();
                if tx.send(Input::Metrics(rtx)).is_err() {
                    return;
                }
                let Ok(body) = rrx.await else { return };
                (200, "text/plain; version=0.0.4", body)
            };
            let reason = match status {
                200 => "OK",
                202 => "Accepted",
                400 => "Bad Request",
                401 => "Unauthorized",
                404 => "Not Found",
                _ => "Conflict",
            };
            let head = format!(
                "HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            let _ = sock.write_all(head.as_bytes()).await;
            let _ = sock.write_all(body.as_bytes()).await;
            let _ = sock.shutdown().await;
        });
    }
}

/// Reads the metrics a broker serves on `addr` (its `metrics_listen`): the Prometheus text,
/// without the HTTP head. For tests and tools.
///
/// # Errors
/// Connection and read failures.
pub async fn scrape(addr: SocketAddr) -> std::io::Result<String> {
    http_get(addr, "/metrics").await
}

/// A broker's cluster state (`GET /cluster` on its metrics listener), as JSON text.
///
/// # Errors
/// Connection and read failures.
pub async fn cluster_status(addr: SocketAddr) -> std::io::Result<String> {
    http_get(addr, "/cluster").await
}

/// One page of a broker's cluster state (`GET /cluster?limit=N&after=CURSOR`, D55): the shards
/// after `after` (a `next` of the page before), `limit` of them. A broker older than pages
/// answers the whole state, without `next`.
///
/// # Errors
/// Connection and read failures.
pub async fn cluster_status_page(addr: SocketAddr, after: Option<&str>, limit: u32) -> std::io::Result<String> {
    let after = after.map(|a| format!("&after={}", percent_encode(a))).unwrap_or_default();
    http_get(addr, &format!("/cluster?limit={limit}{after}")).await
}

/// The page a `GET /cluster` asks for (D55): `None` for the whole status; a reason for a
/// `limit` that is not a number or an `after` that is not a cursor a page gave.
fn status_page_of(head: &str) -> Result<Option<felix_proto::cluster::status::StatusPage>, String> {
    use felix_proto::cluster::{metadata::ShardId, status::StatusPage};
    let target = head.lines().next().and_then(|l| l.split(' ').nth(1)).unwrap_or_default();
    let Some((_, query)) = target.split_once('?') else { return Ok(None) };
    let arg = |name: &str| {
        query.split('&').filter_map(|kv| kv.split_once('=')).find(|(k, _)| *k == name).map(|(_, v)| percent_decode(v))
    };
    let (limit, after) = (arg("limit"), arg("after"));
    if limit.is_none() && after.is_none() {
        return Ok(None);
    }
    let limit = match limit {
        None => felix_proto::broker::cluster_admin::DEFAULT_STATUS_PAGE,
        Some(l) => l.parse::<usize>().map_err(|_| format!("limit={l:?} is not a number of shards"))?,
    };
    let after = match after {
        None => None,
        Some(a) => Some(ShardId::from_cursor(&a).ok_or_else(|| format!("after={a:?} is not a cursor a page gave"))?),
    };
    Ok(Some(StatusPage { after, limit: limit.clamp(1, felix_proto::cluster::status::STATUS_PAGE_MAX) }))
}

/// Asks a broker of the cluster (at its metrics listener) to change the members:
/// `add` (`node`, its cluster address `addr`) or remove (`node`, `force`). Answers the HTTP
/// status and body: 202 when proposed, 401 for a wrong secret, 409 with the reason when refused.
pub async fn cluster_admin(
    metrics: SocketAddr,
    add: Option<&str>,
    node: &str,
    force: bool,
    secret: &str,
) -> std::io::Result<(u16, String)> {
    let enc = percent_encode;
    let path = match add {
        Some(addr) => format!("/cluster/add?node={}&addr={}", enc(node), enc(addr)),
        None => format!("/cluster/remove?node={}{}", enc(node), if force { "&force=1" } else { "" }),
    };
    admin_post(metrics, &path, secret).await
}

/// Asks a broker of the cluster (at its metrics listener) to move a stream shard to `to`, or
/// with `to` `None` to cancel its move. Answers as [`cluster_admin`].
pub async fn cluster_move(
    metrics: SocketAddr,
    (tenant, namespace, stream): (&str, &str, &str),
    shard: u32,
    to: Option<&str>,
    secret: &str,
) -> std::io::Result<(u16, String)> {
    let enc = percent_encode;
    let what = match to {
        Some(to) => format!("to={}", enc(to)),
        None => "cancel=1".into(),
    };
    let path = format!(
        "/cluster/move?tenant={}&namespace={}&stream={}&shard={shard}&{what}",
        enc(tenant),
        enc(namespace),
        enc(stream)
    );
    admin_post(metrics, &path, secret).await
}

/// Asks a broker of the cluster to drain broker `node` (its shards move to the others), or
/// with `node` `None` to rebalance every shard. Answers as [`cluster_admin`].
pub async fn cluster_drain(metrics: SocketAddr, node: Option<&str>, secret: &str) -> std::io::Result<(u16, String)> {
    let path = match node {
        Some(n) => format!("/cluster/drain?node={}", percent_encode(n)),
        None => "/cluster/rebalance".into(),
    };
    admin_post(metrics, &path, secret).await
}

/// Asks a broker of the cluster (at its metrics listener) to revoke a signed token on every
/// broker, by token id and/or principal. Answers as [`cluster_admin`].
pub async fn cluster_revoke(
    metrics: SocketAddr,
    jti: Option<&str>,
    sub: Option<&str>,
    secret: &str,
) -> std::io::Result<(u16, String)> {
    let mut q = Vec::new();
    if let Some(j) = jti {
        q.push(format!("jti={}", percent_encode(j)));
    }
    if let Some(s) = sub {
        q.push(format!("sub={}", percent_encode(s)));
    }
    admin_post(metrics, &format!("/cluster/revoke?{}", q.join("&")), secret).await
}

async fn admin_post(metrics: SocketAddr, path: &str, secret: &str) -> std::io::Result<(u16, String)> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(metrics).await?;
    s.write_all(
        format!("POST {path} HTTP/1.0\r\nAuthorization: Bearer {secret}\r\nContent-Length: 0\r\n\r\n").as_bytes(),
    )
    .await?;
    let mut text = String::new();
    s.read_to_string(&mut text).await?;
    let status = text.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    Ok((status, text.split_once("\r\n\r\n").map_or(text.clone(), |(_, b)| b.to_owned())))
}

async fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::TcpStream::connect(addr).await?;
    s.write_all(format!("GET {path} HTTP/1.0\r\n\r\n").as_bytes()).await?;
    let mut body = String::new();
    s.read_to_string(&mut body).await?;
    Ok(body.split_once("\r\n\r\n").map_or(body.clone(), |(_, b)| b.to_owned()))
}

#[cfg(test)]
mod admin_tests {
    use super::*;

    pub(super) fn post(target: &str, secret: &str) -> String {
        format!("POST {target} HTTP/1.0\r\nAuthorization: Bearer {secret}\r\n")
    }

    #[test]
    pub(super) fn status_pages_are_read_from_the_query() {
        use felix_proto::cluster::metadata::{Kind, ShardId};
        let get = |t: &str| format!("GET {t} HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(status_page_of(&get("/cluster")), Ok(None));
        let p = status_page_of(&get("/cluster?limit=20")).unwrap().unwrap();
        assert_eq!((p.after, p.limit), (None, 20));
        let s = ShardId::of(Kind::Cache, "t 1", "ns", "a~b", 3);
        let p = status_page_of(&get(&format!("/cluster?after={}", percent_encode(&s.cursor())))).unwrap().unwrap();
        assert_eq!(p.after, Some(s));
        assert_eq!(p.limit, felix_proto::broker::cluster_admin::DEFAULT_STATUS_PAGE);
        assert_eq!(status_page_of(&get("/cluster?limit=99999")).unwrap().unwrap().limit, 5_000);
        assert!(status_page_of(&get("/cluster?limit=ten")).is_err());
        assert!(status_page_of(&get("/cluster?after=nonsense")).is_err());
    }

    #[test]
    pub(super) fn admin_requests_are_read_with_their_secret_and_percent_decoded() {
        let ok = |t: &str| admin_request(&post(t, "s"), Some("s"));
        assert!(
            matches!(ok("/cluster/add?node=n4&addr=h:7004"), Ok(AdminRequest::Add { node, addr }) if node == "n4" && addr == "h:7004")
        );
        assert!(matches!(ok("/cluster/remove?node=n4&force=1"), Ok(AdminRequest::Remove { force: true, .. })));
        let j = format!("/cluster/revoke?jti={}", percent_encode("a b/c%"));
        assert!(matches!(ok(&j), Ok(AdminRequest::Revoke { jti: Some(j), sub: None }) if j == "a b/c%"));
        assert!(
            matches!(ok("/cluster/revoke?sub=alice"), Ok(AdminRequest::Revoke { jti: None, sub: Some(s) }) if s == "alice")
        );
        assert_eq!(ok("/cluster/revoke").err().map(|e| e.0), Some(400));
        assert_eq!(ok("/cluster/remove").err().map(|e| e.0), Some(400));
        assert_eq!(ok("/cluster/nope?node=x").err().map(|e| e.0), Some(404));
        assert_eq!(admin_request(&post("/cluster/revoke?sub=a", "wrong"), Some("s")).err().map(|e| e.0), Some(401));
        assert_eq!(admin_request(&post("/cluster/revoke?sub=a", "s"), None).err().map(|e| e.0), Some(404));
        assert_eq!(percent_decode("%zz%4"), "%zz%4", "malformed escapes are kept");
    }
}
