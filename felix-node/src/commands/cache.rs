//! `cache` and `counter`: requests to a cache's owner, and `cache watch`.

use super::*;

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
