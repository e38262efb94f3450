//! The bench's other workloads: cache puts and gets, consumer groups, cache watches.

use super::*;

pub(super) async fn cache_bench(a: &BenchArgs, t: &Target) -> Result<ExitCode, String> {
    let c = connect(t).await?;
    let ops = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let value = Bytes::from(vec![b'v'; a.payload]);
    let mut tasks = Vec::new();
    for w in 0..a.concurrency.max(1) {
        let (c, ops, stop, value) = (c.clone(), ops.clone(), stop.clone(), value.clone());
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
            let mut i = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let key = format!("k{w}-{}", i % 1000);
                let t0 = Instant::now();
                if i.is_multiple_of(2) {
                    c.cache_put("bench", "cache", &key, value.clone(), None).await.map_err(|e| e.to_string())?;
                } else {
                    c.cache_get("bench", "cache", &key).await.map_err(|e| e.to_string())?;
                }
                let _ = hist.record((t0.elapsed().as_micros() as u64).max(1));
                ops.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<_, String>(hist)
        }));
    }
    let total = a.duration;
    let start = Instant::now();
    while start.elapsed() < total {
        tokio::time::sleep(Duration::from_millis(250)).await;
        progress(
            a.quiet,
            start,
            total,
            format!("{:.0} ops/s", ops.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64()),
        );
    }
    stop.store(true, Ordering::Relaxed);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    for t in tasks {
        let _ = hist.add(&t.await.map_err(|e| e.to_string())??);
    }
    if !a.quiet && progress_shown() {
        eprintln!();
    }
    let secs = start.elapsed().as_secs_f64();
    let n = ops.load(Ordering::Relaxed);
    let result = serde_json::json!({
        "cache_ops": n, "ops_per_s": n as f64 / secs, "concurrency": a.concurrency, "value_bytes": a.payload,
        "latency_us": {"p50": hist.value_at_quantile(0.5), "p99": hist.value_at_quantile(0.99), "max": hist.max()},
    });
    if a.json {
        out!("{result}");
    } else {
        out!("Felix cache bench: {} concurrent, {} B values, 50% put / 50% get", a.concurrency, a.payload);
        out!("  {:<20} {:>12.0}", "ops/s", n as f64 / secs);
        out!("  {:<20} {:>12}", "latency p50 (µs)", hist.value_at_quantile(0.5));
        out!("  {:<20} {:>12}", "latency p99 (µs)", hist.value_at_quantile(0.99));
    }
    let _ = c.close().await;
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn group_bench(a: &BenchArgs, t: &Target, consumers: usize) -> Result<ExitCode, String> {
    use felix_driver_tokio::{GroupTarget, PollOptions};
    let stream = format!("group-bench-{}", std::process::id());
    let p = connect(t).await?;
    let payload = Bytes::from(vec![b'g'; a.payload]);
    let mut sent = 0u64;
    let start = Instant::now();
    let mut inflight = tokio::task::JoinSet::new();
    while sent < a.backlog {
        let n = (a.backlog - sent).min(a.batch as u64) as usize;
        let (p, stream, batch) = (p.clone(), stream.clone(), vec![payload.clone(); n]);
        inflight.spawn(async move {
            p.publish("bench", &stream, batch, PublishOptions { ack: true, ..Default::default() }).await
        });
        sent += n as u64;
        if inflight.len() >= 128 {
            inflight.join_next().await.map(|r| r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())).transpose()?;
        }
        if sent.is_multiple_of(a.batch as u64 * 200) {
            progress(a.quiet, start, a.duration, format!("backlog {sent}/{}", a.backlog));
        }
    }
    while let Some(r) = inflight.join_next().await {
        r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
    }
    let g = GroupTarget::new("bench", stream.clone(), "bench-group");
    let acked = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..consumers {
        let c = connect(t).await?;
        let (g, acked, stop, batch) = (g.clone(), acked.clone(), stop.clone(), a.batch as u32);
        tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
            let opts = PollOptions { consumer: Some(format!("c{i}")), ..Default::default() };
            while !stop.load(Ordering::Relaxed) {
                let t0 = Instant::now();
                let records = c.group_poll(&g, batch, opts.clone()).await.map_err(|e| e.to_string())?;
                if records.is_empty() {
                    break; // the backlog is drained
                }
                let mut acks = tokio::task::JoinSet::new();
                for r in records {
                    let (c, g) = (c.clone(), g.clone());
                    acks.spawn(async move { c.group_ack(&g, r.offset).await });
                }
                while let Some(r) = acks.join_next().await {
                    r.map_err(|e| e.to_string())?.map_err(|e| e.to_string())?;
                    acked.fetch_add(1, Ordering::Relaxed);
                }
                let _ = hist.record((t0.elapsed().as_micros() as u64).max(1));
            }
            let _ = c.close().await;
            Ok::<_, String>(hist)
        }));
    }
    let total = a.duration;
    let start = Instant::now();
    while start.elapsed() < total && !tasks.iter().all(|t| t.is_finished()) {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let rate = acked.load(Ordering::Relaxed) as f64 / start.elapsed().as_secs_f64();
        progress(a.quiet, start, total, format!("{rate:.0} records/s polled and acked"));
    }
    stop.store(true, Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    let n = acked.load(Ordering::Relaxed);
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    for t in tasks {
        let _ = hist.add(&t.await.map_err(|e| e.to_string())??);
    }
    if !a.quiet && progress_shown() {
        eprintln!();
    }
    let result = serde_json::json!({
        "group_consumers": consumers, "records_acked": n, "records_per_s": n as f64 / secs,
        "batch": a.batch, "payload_bytes": a.payload,
        "poll_and_ack_batch_us": {"p50": hist.value_at_quantile(0.5), "p99": hist.value_at_quantile(0.99), "max": hist.max()},
    });
    if a.json {
        out!("{result}");
    } else {
        out!("Felix consumer-group bench: {consumers} consumer(s), polls of {}, {} B records", a.batch, a.payload);
        out!("  {:<28} {:>12.0}", "records/s (poll + ack)", n as f64 / secs);
        out!("  {:<28} {:>12}", "batch poll+ack p50 (µs)", hist.value_at_quantile(0.5));
        out!("  {:<28} {:>12}", "batch poll+ack p99 (µs)", hist.value_at_quantile(0.99));
    }
    let _ = p.close().await;
    Ok(ExitCode::SUCCESS)
}

pub(super) async fn watch_bench(a: &BenchArgs, t: &Target, watchers: usize) -> Result<ExitCode, String> {
    use felix_proto::client::WatchOn;
    let delivered = Arc::new(AtomicU64::new(0));
    let written = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut watch_tasks = Vec::new();
    for _ in 0..watchers {
        let c = connect(t).await?;
        let mut w = c
            .cache_watch("bench", "watched", WatchOn::Prefix(String::new()), None, false)
            .await
            .map_err(|e| e.to_string())?;
        let (delivered, stop) = (delivered.clone(), stop.clone());
        watch_tasks.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
            while !stop.load(Ordering::Relaxed) {
                match tokio::time::timeout(Duration::from_millis(200), w.next()).await {
                    Ok(Some(SubscriptionItem::CacheChange(e))) => {
                        // The value carries the write time (ns since the bench epoch).
                        if let Some(v) = e.value.as_ref().filter(|v| v.0.len() >= 8) {
                            let sent = u64::from_be_bytes(v.0[..8].try_into().expect("8 bytes"));
                            let now = BENCH_EPOCH.elapsed().as_nanos() as u64;
                            let _ = hist.record((now.saturating_sub(sent) / 1000).max(1));
                        }
                        delivered.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Some(SubscriptionItem::End(r))) => return Err(format!("watch ended: {r:?}")),
                    Ok(_) => {}
                    Err(_) => {}
                }
            }
            let _ = c.close().await;
            Ok::<_, String>(hist)
        }));
    }
    let w = connect(t).await?;
    let mut writers = Vec::new();
    for i in 0..a.concurrency.max(1) {
        let (w, written, stop, size) = (w.clone(), written.clone(), stop.clone(), a.payload.max(8));
        writers.push(tokio::spawn(async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let mut v = BytesMut::with_capacity(size);
                v.put_u64(BENCH_EPOCH.elapsed().as_nanos() as u64);
                v.resize(size, b'w');
                w.cache_put("bench", "watched", &format!("k{i}-{}", n % 100), v.freeze(), None)
                    .await
                    .map_err(|e| e.to_string())?;
                written.fetch_add(1, Ordering::Relaxed);
                n += 1;
            }
            Ok::<_, String>(())
        }));
    }
    let total = a.duration;
    let start = Instant::now();
    while start.elapsed() < total {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let secs = start.elapsed().as_secs_f64();
        progress(
            a.quiet,
            start,
            total,
            format!("{:.0} changes/s delivered", delivered.load(Ordering::Relaxed) as f64 / secs),
        );
    }
    stop.store(true, Ordering::Relaxed);
    let secs = start.elapsed().as_secs_f64();
    for t in writers {
        t.await.map_err(|e| e.to_string())??;
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    for t in watch_tasks {
        let _ = hist.add(&t.await.map_err(|e| e.to_string())??);
    }
    if !a.quiet && progress_shown() {
        eprintln!();
    }
    let (d, wr) = (delivered.load(Ordering::Relaxed), written.load(Ordering::Relaxed));
    let result = serde_json::json!({
        "watchers": watchers, "writes": wr, "writes_per_s": wr as f64 / secs,
        "changes_delivered": d, "changes_delivered_per_s": d as f64 / secs,
        "latency_us": {"p50": hist.value_at_quantile(0.5), "p99": hist.value_at_quantile(0.99), "max": hist.max()},
    });
    if a.json {
        out!("{result}");
    } else {
        out!("Felix cache-watch bench: {watchers} watchers, {} writers, {} B values", a.concurrency, a.payload);
        out!("  {:<28} {:>12.0}", "writes/s", wr as f64 / secs);
        out!("  {:<28} {:>12.0}", "changes delivered/s", d as f64 / secs);
        out!("  {:<28} {:>12}", "write→watcher p50 (µs)", hist.value_at_quantile(0.5));
        out!("  {:<28} {:>12}", "write→watcher p99 (µs)", hist.value_at_quantile(0.99));
    }
    let _ = w.close().await;
    Ok(ExitCode::SUCCESS)
}
