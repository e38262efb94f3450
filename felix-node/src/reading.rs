//! `subscribe` and `read`: every shard of a stream unless `--shard` names one, merged into one
//! output. Reading shard 0 alone by default showed a user about a sixth of a six-shard stream
//! without a word.

use crate::commands::{Addrs, connect, ended, follows, micros_ago, parse_start, with_redirects};
use crate::{ConnectArgs, ReadArgs, SubscribeArgs};
use base64::Engine;
use felix_driver_tokio::{Client, ClientError, SubscriptionItem};
use felix_proto::binary::EventBatch;
use felix_proto::client::{EndReason, SubscriptionCursor};
use felix_proto::message::StartPosition;
use std::io::Write;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A start position as a user writes it (`--from 2`), not as Rust debug text (`Offset(2)`).
pub fn position(p: &StartPosition) -> String {
    match p {
        StartPosition::Earliest => "the earliest record".into(),
        StartPosition::Latest => "the latest".into(),
        StartPosition::Offset(o) => format!("offset {o}"),
    }
}

/// The shards a command covers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shards {
    /// The ones to read, in order.
    pub list: Vec<u32>,
    /// How many the stream has (1 against a broker that cannot say).
    pub total: u32,
    /// The stream did not exist when the command started and was waited for.
    pub waited: bool,
}

impl Shards {
    /// Whether output lines name their shard: more than one is read.
    pub fn tagged(&self) -> bool {
        self.list.len() > 1
    }
}

/// Asks how many shards `stream` has, without creating it (`stream_shards`: 0 is no such
/// stream). `--shard` is checked against the count; without it every shard is covered. A stream
/// that does not exist is an error, or with `wait`, waited for (the caller races Ctrl-C).
pub async fn shards_of(c: &ConnectArgs, stream: &str, shard: Option<u32>, wait: bool) -> Result<Shards, String> {
    let client = connect(c).await?;
    let ns = &c.namespace;
    let mut waited = false;
    let total = loop {
        match client.stream_shards(ns, stream).await {
            Ok((0, _)) if wait => {
                if !waited {
                    eprintln!("{ns}/{stream} does not exist yet: waiting for its first record (Ctrl-C to stop)");
                }
                waited = true;
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
            Ok((0, _)) => {
                let _ = client.close().await;
                return Err(format!(
                    "there is no stream {ns}/{stream} (nothing was published to it; names are case-sensitive)"
                ));
            }
            Ok((n, _)) => break n,
            // A broker from before FEATURE_STREAM_SHARDS: its streams have one shard unless
            // the operator configured more, which the user then names with --shard.
            Err(ClientError::Unsupported(_)) => break shard.map_or(1, |s| s + 1),
            Err(e) => return Err(e.to_string()),
        }
    };
    let _ = client.close().await;
    let list = match shard {
        Some(s) if s >= total => {
            return Err(format!(
                "{ns}/{stream} has {total} shard(s), 0 to {}: there is no shard {s}",
                total.saturating_sub(1)
            ));
        }
        Some(s) => vec![s],
        None => (0..total).collect(),
    };
    Ok(Shards { list, total, waited })
}

/// One line of a record: `OFFSET<TAB>PAYLOAD` (a shard's offset prefixed by `SHARD/` when
/// several shards are read), or with `--json` an object with `shard`, `offset` and `payload`
/// (`payload_base64` when it is not UTF-8).
fn record_line(shard: Option<u32>, offset: Option<u64>, payload: &[u8], json: bool) -> String {
    let text = std::str::from_utf8(payload).ok();
    if json {
        let mut o = serde_json::Map::new();
        if let Some(s) = shard {
            o.insert("shard".into(), s.into());
        }
        if let Some(off) = offset {
            o.insert("offset".into(), off.into());
        }
        match text {
            Some(t) => o.insert("payload".into(), t.into()),
            None => o.insert("payload_base64".into(), base64::engine::general_purpose::STANDARD.encode(payload).into()),
        };
        return serde_json::Value::Object(o).to_string();
    }
    let body = text.map_or_else(|| format!("<{} bytes>", payload.len()), str::to_owned);
    match (shard, offset) {
        (Some(s), Some(o)) => format!("{s}/{o}\t{body}"),
        (Some(s), None) => format!("{s}/\t{body}"),
        (None, Some(o)) => format!("{o}\t{body}"),
        (None, None) => body,
    }
}

/// What printing a batch came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Printed {
    More,
    /// `--count` reached.
    Done,
    /// Standard output closed (piped to `head`).
    Closed,
}

/// Standard output shared by the shards' tasks: a batch is written whole under the lock, so
/// lines never interleave, and `--count` counts over every shard.
/// A batch's records decrypted with the keys of --encrypt-key-file, when it carries an
/// envelope (D58); a clear error, never ciphertext printed as records, when they cannot be.
fn open_batch(ring: Option<&felix_driver_tokio::envelope::KeyRing>, batch: EventBatch) -> Result<EventBatch, String> {
    let Some(envelope) = batch.records.envelope().cloned() else { return Ok(batch) };
    let at = batch.base_offset.map_or(String::new(), |o| format!(" from offset {o}"));
    let Some(ring) = ring else {
        let key = felix_driver_tokio::envelope::key_id_of(&envelope).unwrap_or_else(|e| e.to_string());
        return Err(format!("the records{at} are encrypted end to end (key {key}): give --encrypt-key-file"));
    };
    let mut opened = Vec::with_capacity(batch.records.count() as usize);
    for r in batch.records.iter() {
        let plain = ring.open(&envelope, &r.payload).map_err(|e| format!("records{at}: {e}"))?;
        opened.push((r.timestamp_micros, plain));
    }
    let records = if batch.records.is_timed() {
        felix_proto::Records::from_timed(opened.into_iter().map(|(t, p)| (t.unwrap_or(0), p)))
    } else {
        felix_proto::Records::from_payloads(opened.into_iter().map(|(_, p)| p))
    }
    .map_err(|e| e.to_string())?;
    Ok(EventBatch { records, ..batch })
}

struct Output {
    json: bool,
    tagged: bool,
    count: Option<u64>,
    seen: Mutex<u64>,
}

impl Output {
    fn batch(&self, shard: u32, batch: &EventBatch) -> Printed {
        let Ok(mut seen) = self.seen.lock() else { return Printed::Closed };
        // Buffered per batch: stdout alone is line-buffered, one write system call per record,
        // which held a catch-up read to about a million lines a second.
        let mut out = std::io::BufWriter::with_capacity(64 << 10, std::io::stdout().lock());
        let tag = (self.tagged || self.json).then_some(shard);
        for (i, r) in batch.records.iter().enumerate() {
            let offset = batch.base_offset.map(|b| b + i as u64);
            if writeln!(out, "{}", record_line(tag, offset, &r.payload, self.json)).is_err() {
                return Printed::Closed;
            }
            *seen += 1;
            if self.count.is_some_and(|c| *seen >= c) {
                return if out.flush().is_err() { Printed::Closed } else { Printed::Done };
            }
        }
        if out.flush().is_err() { Printed::Closed } else { Printed::More }
    }

    fn seen(&self) -> u64 {
        self.seen.lock().map_or(0, |s| *s)
    }
}

/// How a shard's subscription stopped.
#[derive(Debug)]
enum Stop {
    Done,
    Closed,
    /// It ended for good (said on standard error).
    Failed,
}

pub async fn subscribe(mut a: SubscribeArgs) -> Result<ExitCode, String> {
    if let Some(path) = &a.encrypt_key_file {
        a.keyring = Some(Arc::new(felix_driver_tokio::envelope::KeyRing::load(path).map_err(|e| e.to_string())?));
    }
    let mut first = parse_start(&a.from)?;
    let shards = tokio::select! {
        s = shards_of(&a.conn, &a.stream, a.shard, true) => s?,
        _ = crate::commands::wait_for_shutdown() => {
            eprintln!("stopped before {}/{} existed", a.conn.namespace, a.stream);
            return Ok(ExitCode::from(130));
        }
    };
    if shards.waited {
        // Everything published since the command started is in it: read from the start.
        first = StartPosition::Earliest;
    }
    if shards.list.len() > 1 {
        eprintln!(
            "subscribing to all {} shards of {}/{} (lines are SHARD/OFFSET; --shard N for one)",
            shards.total, a.conn.namespace, a.stream
        );
    }
    let out = Arc::new(Output { json: a.json, tagged: shards.tagged(), count: a.count, seen: Mutex::new(0) });
    let a = Arc::new(a);
    let mut tasks = tokio::task::JoinSet::new();
    for &shard in &shards.list {
        tasks.spawn(follow_shard(a.clone(), shard, first, out.clone()));
    }
    // The first shard to stop decides: --count reached or stdout closed (0), a subscription
    // that ended for good (1), an error; Ctrl-C or SIGTERM is 130.
    let next = tokio::select! {
        n = tasks.join_next() => n,
        _ = crate::commands::wait_for_shutdown() => {
            eprintln!("stopped after {} event(s)", out.seen());
            return Ok(ExitCode::from(130));
        }
    };
    let code = match next {
        None | Some(Ok(Ok(Stop::Done | Stop::Closed))) => ExitCode::SUCCESS,
        Some(Ok(Ok(Stop::Failed))) => ExitCode::FAILURE,
        Some(Ok(Err(e))) => return Err(e),
        Some(Err(e)) => return Err(format!("a shard's subscription stopped: {e}")),
    };
    tasks.abort_all();
    Ok(code)
}

/// Subscribes to one shard and prints what arrives, following it through moves, fail-overs
/// and lost connections (unless `--no-resume`) from right after the last record printed.
async fn follow_shard(
    a: Arc<SubscribeArgs>,
    shard: u32,
    first: StartPosition,
    out: Arc<Output>,
) -> Result<Stop, String> {
    let ns = &a.conn.namespace;
    // Subscribing finds the shard's owner (following redirects in a cluster).
    let (mut client, mut sub) = with_redirects(&a.conn, |client| {
        let (ns, stream, since, filter) = (ns.clone(), a.stream.clone(), a.since, a.filter());
        async move {
            let mut start = first;
            if let Some(since) = since {
                start = match client.offset_for_time(&ns, &stream, shard, micros_ago(since)).await {
                    Ok(Some(o)) => StartPosition::Offset(o),
                    // Nothing that recent: everything from now on.
                    Ok(None) => StartPosition::Latest,
                    Err(e) => return (client, Err(e)),
                };
            }
            let r = client.subscribe_filtered(&ns, &stream, Some(start), Some(shard), filter).await;
            (client, r)
        }
    })
    .await?;
    match (sub.start_offset, sub.live_offset) {
        (Some(s), Some(l)) => {
            eprintln!("subscribed to {ns}/{} shard {shard} from offset {s} (live from {l})", a.stream)
        }
        _ => eprintln!("subscribed to {ns}/{} shard {shard}", a.stream),
    }
    if a.count == Some(0) {
        let _ = client.close().await;
        return Ok(Stop::Done);
    }
    // What was printed, and so where to resume without a gap or a duplicate.
    let mut cursor = SubscriptionCursor::new();
    cursor.subscribed(sub.start_offset);
    loop {
        match sub.next().await {
            Some(SubscriptionItem::Events(batch)) => {
                cursor.delivered(&batch);
                let batch = open_batch(a.keyring.as_deref(), batch)?;
                match out.batch(shard, &batch) {
                    Printed::More => {}
                    Printed::Done => {
                        let _ = client.close().await;
                        return Ok(Stop::Done);
                    }
                    Printed::Closed => return Ok(Stop::Closed),
                }
            }
            Some(SubscriptionItem::CacheChange(_)) => {} // never on a stream subscription
            Some(SubscriptionItem::End(reason @ EndReason::Lagged { resume_from })) if !a.no_resume => {
                // A durable stream keeps what we missed: read on from the log, no gap.
                let Some(from) = cursor.resume(&reason) else { return Ok(Stop::Failed) };
                eprintln!(
                    "shard {shard} fell behind (the broker dropped from offset {resume_from}); resuming from {}",
                    position(&from)
                );
                sub = client
                    .subscribe_filtered(ns, &a.stream, Some(from), Some(shard), a.filter())
                    .await
                    .map_err(|e| format!("resuming shard {shard} at {}: {e}", position(&from)))?;
                cursor.subscribed(sub.start_offset);
            }
            Some(SubscriptionItem::End(reason)) if !a.no_resume && follows(&reason) => {
                // The shard's leader changed (fail-over, a move) or its broker went away: resume
                // where the last printed event ends, wherever the shard is served now.
                let Some(from) = cursor.resume(&reason) else { return Ok(Stop::Failed) };
                eprintln!("shard {shard}: subscription {}; resuming from {}", ended(&reason), position(&from));
                let _ = client.close().await;
                // Straight to the broker the move named, when it did (one connection less).
                let hint = match &reason {
                    EndReason::Moved(m) => m.addr.as_deref().and_then(|a| a.parse::<std::net::SocketAddr>().ok()),
                    _ => None,
                };
                (client, sub) = resubscribe(&a, shard, from, hint).await?;
                cursor.subscribed(sub.start_offset);
            }
            Some(SubscriptionItem::End(reason)) => {
                let resume = cursor.resume(&reason).map(|p| match p {
                    StartPosition::Offset(o) => format!("; resume with --shard {shard} --from {o}"),
                    _ => String::new(),
                });
                let what = match reason {
                    EndReason::Lagged { resume_from } => format!("fell behind (dropped from offset {resume_from})"),
                    EndReason::Moved(m) => {
                        format!("its shard moved to {}", m.addr.as_deref().unwrap_or("a broker being chosen"))
                    }
                    EndReason::Deleted => "the stream was deleted".into(),
                    EndReason::Error(e) => format!("ended: {}", e.message),
                    EndReason::Finished | EndReason::Reset => "ended by the broker".into(),
                    EndReason::WatchLagged { resume_from } => format!("fell behind at {resume_from}"),
                    EndReason::ConnectionLost(why) => format!("connection lost: {why}"),
                };
                eprintln!("shard {shard}: subscription {what}{}", resume.unwrap_or_default());
                return Ok(Stop::Failed);
            }
            None if !a.no_resume => {
                let from = cursor.resume(&EndReason::ConnectionLost("closed".into())).unwrap_or(StartPosition::Latest);
                eprintln!("shard {shard}: connection closed; resuming from {}", position(&from));
                (client, sub) = resubscribe(&a, shard, from, None).await?;
                cursor.subscribed(sub.start_offset);
            }
            None => return Err(format!("shard {shard}: connection closed")),
        }
    }
}

/// Subscribes again from `from` (asking `first`, the new owner a move named, before the
/// seeds; following redirects), retrying refusals and unreachable brokers with a growing
/// pause, for at most a minute.
async fn resubscribe(
    a: &SubscribeArgs,
    shard: u32,
    from: StartPosition,
    first: Option<std::net::SocketAddr>,
) -> Result<(Client, felix_driver_tokio::Subscription), String> {
    let until = std::time::Instant::now() + Duration::from_secs(60);
    let mut pause = Duration::from_millis(100);
    let mut first = first;
    loop {
        let mut conn = a.conn.clone();
        if let Some(addr) = first.take() {
            conn.addr = Addrs::one(addr);
        }
        let r = with_redirects(&conn, |client| {
            let (ns, stream, filter) = (a.conn.namespace.clone(), a.stream.clone(), a.filter());
            async move {
                let r = client.subscribe_filtered(&ns, &stream, Some(from), Some(shard), filter).await;
                (client, r)
            }
        })
        .await;
        match r {
            Ok(v) => return Ok(v),
            Err(e) if std::time::Instant::now() < until => {
                eprintln!("shard {shard}: resubscribing: {e}; retrying in {} ms", pause.as_millis());
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(Duration::from_secs(2));
            }
            Err(e) => {
                return Err(format!("shard {shard}: could not resubscribe from {} for a minute: {e}", position(&from)));
            }
        }
    }
}

/// What `read --replica-local` says of a broker that keeps no copy of a shard.
const NO_COPY: &str = "keeps no copy (only the replicas of a replicated stream do)";

pub async fn read(a: ReadArgs) -> Result<ExitCode, String> {
    let shards = shards_of(&a.conn, &a.stream, a.shard, false).await?;
    let (ns, stream) = (a.conn.namespace.clone(), a.stream.clone());
    let tag = shards.tagged();
    let mut total = 0u64;
    let mut nexts = Vec::new();
    for &shard in &shards.list {
        let left = a.count.map(|c| c.saturating_sub(total));
        if left == Some(0) {
            break;
        }
        let (n, next, closed) = match read_shard(&a, shard, tag, left).await {
            // --replica-local over every shard: those this broker keeps no copy of are not read.
            Err(e) if a.replica_local && a.shard.is_none() && e.contains(NO_COPY) => {
                eprintln!("{e}: passed over");
                continue;
            }
            r => r?,
        };
        total += n;
        nexts.push((shard, next));
        if closed {
            return Ok(ExitCode::SUCCESS); // stdout closed (e.g. piped to head)
        }
    }
    match nexts.as_slice() {
        [(shard, next)] => eprintln!("read {total} record(s) of {ns}/{stream} shard {shard}; next offset {next}"),
        _ => {
            let v: Vec<String> = nexts.iter().map(|(s, n)| format!("{s}:{n}")).collect();
            eprintln!(
                "read {total} record(s) of {ns}/{stream} ({} shards); next offsets (shard:offset) {}",
                nexts.len(),
                v.join(" ")
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Reads one shard from `--from` to `--to` (or its committed tail), page by page, at most
/// `left` records. Returns the records printed, the next offset, and whether standard output
/// closed.
async fn read_shard(a: &ReadArgs, shard: u32, tag: bool, left: Option<u64>) -> Result<(u64, u64, bool), String> {
    let (ns, stream) = (a.conn.namespace.clone(), a.stream.clone());
    let (client, first) = if a.replica_local {
        // This broker's own copy: no redirect is followed.
        let c = connect(&a.conn).await?;
        match c.stream_read_replica(&ns, &stream, shard, a.from, a.to, a.page).await {
            Ok(p) => (c, p),
            Err(ClientError::NotLeader { .. }) => {
                let at = c.remote_address();
                let _ = c.close().await;
                return Err(format!("shard {shard}: {at} {NO_COPY} of {ns}/{stream}"));
            }
            Err(e) => return Err(e.to_string()),
        }
    } else {
        // The first page finds the shard's owner (following redirects in a cluster).
        with_redirects(&a.conn, |c| {
            let (ns, stream) = (ns.clone(), stream.clone());
            async move {
                let r = c.stream_read(&ns, &stream, shard, a.from, a.to, a.page).await;
                (c, r)
            }
        })
        .await
        .map_err(|e| if tag { format!("shard {shard}: {e}") } else { e })?
    };
    let mut first = Some(first);
    let mut from = a.from;
    let mut total = 0u64;
    let stdout = std::io::stdout();
    loop {
        if a.to.is_some_and(|to| from >= to) {
            break;
        }
        let page = match first.take() {
            Some(p) => p,
            None if a.replica_local => {
                client.stream_read_replica(&ns, &stream, shard, from, a.to, a.page).await.map_err(|e| e.to_string())?
            }
            None => client.stream_read(&ns, &stream, shard, from, a.to, a.page).await.map_err(|e| e.to_string())?,
        };
        // A page at a time, not a system call per line (stdout alone is line-buffered).
        let mut out = std::io::BufWriter::with_capacity(64 << 10, stdout.lock());
        let room = left.map_or(usize::MAX, |l| usize::try_from(l - total).unwrap_or(usize::MAX));
        let records = &page.records[..page.records.len().min(room)];
        for r in records {
            let line = if a.json {
                let mut o = serde_json::Map::new();
                o.insert("shard".into(), shard.into());
                o.insert("offset".into(), r.offset.into());
                match std::str::from_utf8(&r.payload.0) {
                    Ok(t) => o.insert("payload".into(), t.into()),
                    Err(_) => o.insert(
                        "payload_base64".into(),
                        base64::engine::general_purpose::STANDARD.encode(&r.payload.0).into(),
                    ),
                };
                if let Some(p) = &r.publisher {
                    o.insert("publisher".into(), p.clone().into());
                }
                o.insert("timestamp_micros".into(), r.timestamp_micros.into());
                serde_json::Value::Object(o).to_string()
            } else {
                record_line(tag.then_some(shard), Some(r.offset), &r.payload.0, false)
            };
            if writeln!(out, "{line}").is_err() {
                return Ok((total, from, true));
            }
        }
        if out.flush().is_err() {
            return Ok((total, from, true));
        }
        total += records.len() as u64;
        if records.len() < page.records.len() || left.is_some_and(|l| total >= l) {
            from = records.last().map_or(from, |r| r.offset + 1);
            break; // --count reached
        }
        // An empty page that did not move means nothing more is committed: the range is done.
        if page.records.is_empty() && page.next_offset == from {
            break;
        }
        from = page.next_offset;
    }
    let _ = client.close().await;
    Ok((total, from, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_name_their_shard_only_when_several_are_read() {
        assert_eq!(record_line(None, Some(4), b"hi", false), "4\thi");
        assert_eq!(record_line(Some(2), Some(4), b"hi", false), "2/4\thi");
        assert_eq!(record_line(Some(2), None, b"hi", false), "2/\thi");
        assert_eq!(record_line(None, None, &[0xff, 0], false), "<2 bytes>");
        assert_eq!(record_line(Some(1), Some(0), b"x", true), r#"{"offset":0,"payload":"x","shard":1}"#);
        assert_eq!(record_line(None, Some(0), &[0xff], true), r#"{"offset":0,"payload_base64":"/w=="}"#);
    }

    #[test]
    fn positions_read_as_a_user_writes_them() {
        assert_eq!(position(&StartPosition::Offset(2)), "offset 2");
        assert_eq!(position(&StartPosition::Earliest), "the earliest record");
    }
}
