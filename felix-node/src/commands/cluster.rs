//! `cluster`: membership changes, moves (waiting on placement's), drains, inspection,
//! revocations, a CA for the cluster's certificates, and `cluster status` read page by page.

use super::*;

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
}
