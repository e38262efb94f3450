//! `group ...` and `consume`: consumer groups from a terminal.

use crate::commands::connect;
use crate::reading::shards_of;
use crate::{ConnectArgs, ConsumeArgs, GroupArgs, GroupName, GroupOp};
use base64::Engine;
use felix_driver_tokio::{GroupTarget, PollOptions};
use felix_proto::message::{GroupRecord, StartPosition};
use std::io::Write;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::Duration;

fn target(ns: &str, g: &GroupName, shard: u32) -> GroupTarget {
    GroupTarget { namespace: ns.into(), stream: g.stream.clone(), shard, group: g.group.clone() }
}

/// The shard a group command works on: `--shard`, or the only shard of the stream. Offsets
/// are a shard's, so on a stream of several shards the user names one (listed in the error).
async fn one_shard(c: &ConnectArgs, g: &GroupName) -> Result<u32, String> {
    if let Some(s) = g.shard {
        return Ok(s);
    }
    let shards = shards_of(c, &g.stream, None, false).await?;
    match shards.list.as_slice() {
        [only] => Ok(*only),
        _ => Err(format!(
            "{}/{} has {} shards and a group's offsets are one shard's: name it with --shard (0 to {})",
            c.namespace,
            g.stream,
            shards.total,
            shards.total - 1
        )),
    }
}

/// One line of a claimed record: `OFFSET<TAB>ATTEMPTS<TAB>PAYLOAD` (`SHARD/OFFSET` when
/// several shards are consumed), or a JSON object with `shard`.
fn line(r: &GroupRecord, shard: Option<u32>, json: bool) -> String {
    let text = std::str::from_utf8(&r.payload.0).ok();
    if json {
        let mut o = serde_json::Map::new();
        if let Some(s) = shard {
            o.insert("shard".into(), s.into());
        }
        o.insert("offset".into(), r.offset.into());
        o.insert("attempts".into(), r.attempts.into());
        match text {
            Some(t) => o.insert("payload".into(), t.into()),
            None => {
                o.insert("payload_base64".into(), base64::engine::general_purpose::STANDARD.encode(&r.payload.0).into())
            }
        };
        if let Some(ts) = r.timestamp_micros {
            o.insert("timestamp_micros".into(), ts.into());
        }
        serde_json::Value::Object(o).to_string()
    } else {
        let p = text.map_or_else(|| format!("<{} bytes>", r.payload.0.len()), str::to_owned);
        match shard {
            Some(s) => format!("{s}/{}\t{}\t{p}", r.offset, r.attempts),
            None => format!("{}\t{}\t{p}", r.offset, r.attempts),
        }
    }
}

fn parse_start(s: &str) -> Result<StartPosition, String> {
    match s {
        "earliest" => Ok(StartPosition::Earliest),
        "latest" => Ok(StartPosition::Latest),
        n => n.parse().map(StartPosition::Offset).map_err(|_| format!("{n:?}: expected earliest, latest or an offset")),
    }
}

pub async fn group(a: GroupArgs) -> Result<ExitCode, String> {
    if let GroupOp::List { stream, shard, json } = &a.op {
        return group_list(&a.conn, stream, *shard, *json).await;
    }
    let ns = a.conn.namespace.clone();
    let err = |e: felix_driver_tokio::ClientError| e.to_string();
    // Describe covers every shard unless one is named; the others work on one shard.
    let describe_all = match &a.op {
        GroupOp::Describe { g, .. } if g.shard.is_none() => Some(shards_of(&a.conn, &g.stream, None, false).await?),
        _ => None,
    };
    let shard = match (&a.op, &describe_all) {
        (_, Some(_)) => 0,
        (
            GroupOp::Poll { g, .. }
            | GroupOp::Ack { g, .. }
            | GroupOp::Nack { g, .. }
            | GroupOp::Describe { g, .. }
            | GroupOp::Seek { g, .. }
            | GroupOp::DeadLetters { g }
            | GroupOp::Redrive { g, .. }
            | GroupOp::Discard { g, .. }
            | GroupOp::Delete { g },
            None,
        ) => one_shard(&a.conn, g).await?,
        (GroupOp::List { .. }, None) => 0, // answered above
    };
    let client = connect(&a.conn).await?;
    match a.op {
        GroupOp::Poll { g, max, wait, consumer, json } => {
            let opts = PollOptions { wait: wait.unwrap_or_default(), consumer, ..Default::default() };
            let records = client.group_poll(&target(&ns, &g, shard), max, opts).await.map_err(err)?;
            let mut out = std::io::stdout().lock();
            for r in &records {
                let _ = writeln!(out, "{}", line(r, json.then_some(shard), json));
            }
            eprintln!("{} record(s) claimed by {}; ack them with `felix-node group ack`", records.len(), g.group);
        }
        GroupOp::Ack { g, offsets } => {
            for o in &offsets {
                client.group_ack(&target(&ns, &g, shard), *o).await.map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("acked {} record(s)", offsets.len());
        }
        GroupOp::Nack { g, offsets, delay } => {
            for o in &offsets {
                client
                    .group_nack(&target(&ns, &g, shard), *o, delay, None)
                    .await
                    .map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("handed back {} record(s)", offsets.len());
        }
        GroupOp::Describe { g, json } => {
            let list = describe_all.map_or_else(|| vec![shard], |s| s.list);
            let mut rows = Vec::new();
            for &s in &list {
                rows.push((s, client.group_describe(&target(&ns, &g, s)).await.map_err(err)?));
            }
            print_describe(&g.group, &rows, json);
        }
        GroupOp::Seek { g, to, if_new } => {
            let start = parse_start(&to)?;
            let (offset, moved) = client.group_seek(&target(&ns, &g, shard), start, if_new).await.map_err(err)?;
            out!("{offset}");
            if !moved {
                eprintln!("not moved: the group already started (position {offset})");
            }
        }
        GroupOp::DeadLetters { g } => {
            for o in client.group_dead_letters(&target(&ns, &g, shard)).await.map_err(err)? {
                out!("{o}");
            }
        }
        GroupOp::Redrive { g, offsets } => {
            for o in &offsets {
                client.group_redrive(&target(&ns, &g, shard), *o).await.map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("redrove {} record(s)", offsets.len());
        }
        GroupOp::Discard { g, offsets } => {
            for o in &offsets {
                client.group_discard(&target(&ns, &g, shard), *o).await.map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("discarded {} dead letter(s)", offsets.len());
        }
        GroupOp::List { .. } => {}
        GroupOp::Delete { g } => {
            let existed = client.group_delete(&target(&ns, &g, shard)).await.map_err(err)?;
            eprintln!("{}", if existed { "deleted" } else { "there was no such group" });
        }
    }
    let _ = client.close().await;
    Ok(ExitCode::SUCCESS)
}

/// `group list`: every group of the stream's shards (or one), a line each:
/// `SHARD GROUP POSITION LAG IN_FLIGHT DEAD_LETTERS`, or JSON.
async fn group_list(c: &ConnectArgs, stream: &str, shard: Option<u32>, json: bool) -> Result<ExitCode, String> {
    let shards = shards_of(c, stream, shard, false).await?;
    let client = connect(c).await?;
    let mut rows = 0usize;
    if !json {
        out!("shard\tgroup\tposition\tlag\tin_flight\tdead_letters");
    }
    for &s in &shards.list {
        let groups = client.group_list(&c.namespace, stream, s).await.map_err(|e| format!("shard {s}: {e}"))?;
        for g in groups {
            rows += 1;
            if json {
                let v = serde_json::json!({"shard": s, "group": g.group, "position": g.position, "lag": g.lag,
                    "in_flight": g.in_flight, "dead_letters": g.dead_letters});
                out!("{v}");
            } else {
                let position = g.position.map_or_else(|| "none".to_owned(), |p| p.to_string());
                out!("{s}\t{}\t{position}\t{}\t{}\t{}", g.group, g.lag, g.in_flight, g.dead_letters);
            }
        }
    }
    eprintln!("{rows} group(s) on {} shard(s) of {}/{stream}", shards.list.len(), c.namespace);
    let _ = client.close().await;
    Ok(ExitCode::SUCCESS)
}

/// `group describe`: one shard as `name<TAB>value` lines; several as a table with a total
/// lag; `--json` as one object per shard.
fn print_describe(group: &str, rows: &[(u32, felix_proto::message::GroupInfo)], json: bool) {
    let lag = |i: &felix_proto::message::GroupInfo| i.tail.saturating_sub(i.committed.unwrap_or(0));
    if json {
        for (s, i) in rows {
            let v = serde_json::json!({
                "group": group,
                "shard": s,
                "position": i.committed,
                "tail": i.tail,
                "lag": lag(i),
                "in_flight": i.in_flight,
                "owed": i.owed,
                "dead_letters": i.dead_letters,
            });
            out!("{v}");
        }
        return;
    }
    if let [(_, i)] = rows {
        let committed = i.committed.map_or_else(|| "none".to_owned(), |c| c.to_string());
        out!("position\t{committed}");
        out!("tail\t{}", i.tail);
        out!("lag\t{}", lag(i));
        out!("in_flight\t{}", i.in_flight);
        out!("owed\t{}", i.owed);
        out!("dead_letters\t{}", i.dead_letters);
        return;
    }
    out!("shard\tposition\ttail\tlag\tin_flight\towed\tdead_letters");
    for (s, i) in rows {
        let committed = i.committed.map_or_else(|| "none".to_owned(), |c| c.to_string());
        out!("{s}\t{committed}\t{}\t{}\t{}\t{}\t{}", i.tail, lag(i), i.in_flight, i.owed, i.dead_letters);
    }
    let total: u64 = rows.iter().map(|(_, i)| lag(i)).sum();
    out!("total lag\t{total}");
}

/// Polls, prints and acks until Ctrl-C (or `--count`), on `--shard` or on every shard of the
/// stream at once (one long poll per shard). A record is acked only after its line is written,
/// so an interrupted consumer leaves it to be redelivered, never lost.
pub async fn consume(a: ConsumeArgs) -> Result<ExitCode, String> {
    let shards = shards_of(&a.conn, &a.g.stream, a.g.shard, false).await?;
    let client = connect(&a.conn).await?;
    let consumer = a.consumer.clone().unwrap_or_else(|| format!("felix-node-{}", std::process::id()));
    let which = match shards.list.as_slice() {
        [s] => format!("shard {s}"),
        l => format!("all {} shards", l.len()),
    };
    eprintln!("consuming {}/{} {which} as {consumer} in group {}", a.conn.namespace, a.g.stream, a.g.group);
    let state = Arc::new(Consumed {
        seen: Mutex::new(0),
        count: a.count,
        json: a.json,
        tagged: shards.tagged(),
        acking: tokio::sync::watch::Sender::new(0),
    });
    let mut tasks = tokio::task::JoinSet::new();
    for &shard in &shards.list {
        let (client, g, consumer, state) =
            (client.clone(), target(&a.conn.namespace, &a.g, shard), consumer.clone(), state.clone());
        tasks.spawn(consume_shard(client, g, consumer, a.batch, state));
    }
    // A shard's consumer returns only once --count is reached or stdout closed, or fails.
    let next = tokio::select! {
        n = tasks.join_next() => n,
        _ = crate::commands::wait_for_shutdown() => Some(Ok(Ok(false))),
    };
    let code = match next {
        Some(Ok(Ok(false))) => ExitCode::from(130),
        None | Some(Ok(Ok(true))) => ExitCode::SUCCESS,
        Some(Ok(Err(e))) => return Err(e),
        Some(Err(e)) => return Err(format!("a shard's consumer stopped: {e}")),
    };
    // A record printed by another shard's consumer may still have its ack in flight (it
    // counted the record that reached --count, and this one saw the count reached): wait for
    // those acks, bounded, before stopping the rest. Stopping one mid-ack would leave a record
    // printed here to be delivered again.
    let mut acking = state.acking.subscribe();
    let _ = tokio::time::timeout(Duration::from_secs(10), acking.wait_for(|n| *n == 0)).await;
    tasks.abort_all();
    eprintln!("consumed {} record(s)", state.seen());
    // Every ack was answered, so nothing written is at stake; the other shards' long polls are
    // still waiting at the broker, and a graceful close would wait for their answers (up to
    // the poll's 5 s). Whatever they would claim lapses and is delivered again.
    client.close_now();
    Ok(code)
}

/// What the shards' consumers share: the count over all of them, and standard output.
struct Consumed {
    seen: Mutex<u64>,
    count: Option<u64>,
    json: bool,
    tagged: bool,
    /// Acks sent and not yet answered, over every shard.
    acking: tokio::sync::watch::Sender<u64>,
}

impl Consumed {
    fn seen(&self) -> u64 {
        self.seen.lock().map_or(0, |s| *s)
    }
}

/// One shard's poll, print, ack loop. Returns once `--count` is reached (over every shard) or
/// standard output closed (the rest stays claimed, to lapse and be redelivered).
async fn consume_shard(
    client: felix_driver_tokio::Client,
    g: GroupTarget,
    consumer: String,
    batch: u32,
    state: Arc<Consumed>,
) -> Result<bool, String> {
    let mut reclaim = true;
    loop {
        let opts = PollOptions {
            wait: Duration::from_secs(5),
            consumer: Some(consumer.clone()),
            reclaim: std::mem::take(&mut reclaim),
            ..Default::default()
        };
        let left = state.count.map(|c| c.saturating_sub(state.seen()));
        if left == Some(0) {
            return Ok(true);
        }
        let want = left.map_or(batch, |l| u32::try_from(l).unwrap_or(u32::MAX).min(batch));
        let records = client.group_poll(&g, want, opts).await.map_err(|e| e.to_string())?;
        for r in &records {
            {
                // Counted and printed under one lock: --count holds over every shard.
                let Ok(mut seen) = state.seen.lock() else { return Ok(true) };
                if state.count.is_some_and(|c| *seen >= c) {
                    return Ok(true); // another shard reached the count: this claim lapses
                }
                let mut out = std::io::stdout().lock();
                let tag = (state.tagged || state.json).then_some(g.shard);
                if writeln!(out, "{}", line(r, tag, state.json)).and_then(|()| out.flush()).is_err() {
                    return Ok(true); // stdout closed: leave the rest claimed, to lapse
                }
                *seen += 1;
                // Counted under the same lock: whoever sees the count reached sees this ack.
                state.acking.send_modify(|n| *n += 1);
            }
            let acked = client.group_ack(&g, r.offset).await;
            state.acking.send_modify(|n| *n = n.saturating_sub(1));
            acked.map_err(|e| format!("ack {}: {e}", r.offset))?;
        }
    }
}
