//! `publish`: records from arguments or standard input, batched, acknowledged, idempotent
//! on request.

use super::*;

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
