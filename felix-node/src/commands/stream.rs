//! `stream`: create (one or a list from a file), list and inspect streams.

use super::*;

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
