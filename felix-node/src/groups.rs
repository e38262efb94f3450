//! `group ...` and `consume`: consumer groups from a terminal.

use crate::commands::connect;
use crate::{ConsumeArgs, GroupArgs, GroupName, GroupOp};
use base64::Engine;
use felix_driver_tokio::{GroupTarget, PollOptions};
use felix_proto::message::{GroupRecord, StartPosition};
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

fn target(ns: &str, g: &GroupName) -> GroupTarget {
    GroupTarget { namespace: ns.into(), stream: g.stream.clone(), shard: g.shard, group: g.group.clone() }
}

fn line(r: &GroupRecord, json: bool) -> String {
    let text = std::str::from_utf8(&r.payload.0).ok();
    if json {
        let mut o = serde_json::Map::new();
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
        format!("{}\t{}\t{p}", r.offset, r.attempts)
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
    let client = connect(&a.conn).await?;
    let ns = a.conn.namespace.clone();
    let err = |e: felix_driver_tokio::ClientError| e.to_string();
    match a.op {
        GroupOp::Poll { g, max, wait, consumer, json } => {
            let opts = PollOptions { wait: wait.unwrap_or_default(), consumer, ..Default::default() };
            let records = client.group_poll(&target(&ns, &g), max, opts).await.map_err(err)?;
            let mut out = std::io::stdout().lock();
            for r in &records {
                let _ = writeln!(out, "{}", line(r, json));
            }
            eprintln!("{} record(s) claimed by {}; ack them with `felix-node group ack`", records.len(), g.group);
        }
        GroupOp::Ack { g, offsets } => {
            for o in &offsets {
                client.group_ack(&target(&ns, &g), *o).await.map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("acked {} record(s)", offsets.len());
        }
        GroupOp::Nack { g, offsets, delay } => {
            for o in &offsets {
                client.group_nack(&target(&ns, &g), *o, delay, None).await.map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("handed back {} record(s)", offsets.len());
        }
        GroupOp::Describe { g } => {
            let i = client.group_describe(&target(&ns, &g)).await.map_err(err)?;
            let committed = i.committed.map_or_else(|| "none".to_owned(), |c| c.to_string());
            out!("position\t{committed}");
            out!("tail\t{}", i.tail);
            out!("lag\t{}", i.tail.saturating_sub(i.committed.unwrap_or(0)));
            out!("in_flight\t{}", i.in_flight);
            out!("owed\t{}", i.owed);
            out!("dead_letters\t{}", i.dead_letters);
        }
        GroupOp::Seek { g, to, if_new } => {
            let start = parse_start(&to)?;
            let (offset, moved) = client.group_seek(&target(&ns, &g), start, if_new).await.map_err(err)?;
            out!("{offset}");
            if !moved {
                eprintln!("not moved: the group already started (position {offset})");
            }
        }
        GroupOp::DeadLetters { g } => {
            for o in client.group_dead_letters(&target(&ns, &g)).await.map_err(err)? {
                out!("{o}");
            }
        }
        GroupOp::Redrive { g, offsets } => {
            for o in &offsets {
                client.group_redrive(&target(&ns, &g), *o).await.map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("redrove {} record(s)", offsets.len());
        }
        GroupOp::Discard { g, offsets } => {
            for o in &offsets {
                client.group_discard(&target(&ns, &g), *o).await.map_err(|e| format!("offset {o}: {e}"))?;
            }
            eprintln!("discarded {} dead letter(s)", offsets.len());
        }
        GroupOp::Delete { g } => {
            let existed = client.group_delete(&target(&ns, &g)).await.map_err(err)?;
            eprintln!("{}", if existed { "deleted" } else { "there was no such group" });
        }
    }
    let _ = client.close().await;
    Ok(ExitCode::SUCCESS)
}

/// Polls, prints and acks until Ctrl-C (or `--count`). A record is acked only after its line
/// is written, so an interrupted consumer leaves it to be redelivered, never lost.
pub async fn consume(a: ConsumeArgs) -> Result<ExitCode, String> {
    let client = connect(&a.conn).await?;
    let g = target(&a.conn.namespace, &a.g);
    let consumer = a.consumer.clone().unwrap_or_else(|| format!("felix-node-{}", std::process::id()));
    eprintln!("consuming {}/{} shard {} as {consumer} in group {}", g.namespace, g.stream, g.shard, g.group);
    let mut seen = 0u64;
    let mut reclaim = true;
    loop {
        let opts = PollOptions {
            wait: Duration::from_secs(5),
            consumer: Some(consumer.clone()),
            reclaim: std::mem::take(&mut reclaim),
            ..Default::default()
        };
        let want = a.count.map_or(a.batch, |c| u32::try_from(c - seen).unwrap_or(u32::MAX).min(a.batch));
        let records = tokio::select! {
            r = client.group_poll(&g, want, opts) => r.map_err(|e| e.to_string())?,
            _ = tokio::signal::ctrl_c() => break,
        };
        for r in &records {
            let mut out = std::io::stdout().lock();
            if writeln!(out, "{}", line(r, a.json)).and_then(|()| out.flush()).is_err() {
                let _ = client.close().await;
                return Ok(ExitCode::SUCCESS); // stdout closed: leave the rest claimed, to lapse
            }
            client.group_ack(&g, r.offset).await.map_err(|e| format!("ack {}: {e}", r.offset))?;
            seen += 1;
        }
        if a.count.is_some_and(|c| seen >= c) {
            break;
        }
    }
    eprintln!("consumed {seen} record(s)");
    let _ = client.close().await;
    Ok(ExitCode::SUCCESS)
}
