//! `felix-node bench`: publish→deliver throughput and end-to-end latency, and cache ops/s.
//!
//! Publishers and subscribers each get their own QUIC connection. Every record carries the time
//! it was built (nanoseconds since the bench started, first 8 bytes), so each subscriber
//! measures publish→deliver latency per record into an HDR histogram.

use crate::node::{BrokerSettings, DataDir, client_trust, start_broker};
use bytes::{BufMut, Bytes, BytesMut};
use clap::Args;
use felix_driver_tokio::{Client, ClientOptions, FsyncMode, Identity, PublishOptions, SubscriptionItem, Trust};
use hdrhistogram::Histogram;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

mod late;
use late::*;
mod workloads;
use workloads::*;
mod baseline;
use baseline::*;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Benchmark a running broker instead of starting one in-process.
    #[arg(long)]
    pub(crate) addr: Option<SocketAddr>,
    /// Token for --addr (default: the dev token in --data-dir).
    #[arg(long)]
    pub(crate) token: Option<String>,
    /// Stream to publish to, in namespace `bench` (default: one named after this process). In
    /// a cluster, naming it lets a run go through its owner or through another broker.
    #[arg(long)]
    stream: Option<String>,
    /// Certificate for --addr (default: the one in --data-dir).
    #[arg(long)]
    pub(crate) ca: Option<PathBuf>,
    /// Data directory of the broker given with --addr.
    #[arg(long, default_value = "./felix-data")]
    pub(crate) data_dir: PathBuf,
    /// Publisher connections.
    #[arg(long, default_value_t = 1)]
    publishers: usize,
    /// Subscriber connections (fan-out).
    #[arg(long, default_value_t = 1)]
    subscribers: usize,
    /// Record size in bytes (at least 8: the send time rides in the first 8).
    #[arg(long, default_value_t = 256)]
    payload: usize,
    /// Records per published batch.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// What records hold after their 8-byte send time: `filler` (one repeated byte), `json`
    /// (JSON-like event records, as logs and click streams are: compressible) or `random`
    /// (incompressible bytes).
    #[arg(long, default_value = "filler", value_parser = ["filler", "json", "random"])]
    data: String,
    /// Publishers compress each batch with this codec (zstd or lz4; D56); subscribers take it
    /// as stored. The report gives the bytes on the wire per record.
    #[arg(long, value_parser = crate::commands::parse_codec)]
    compress: Option<felix_proto::Codec>,
    /// Compression level with --compress: zstd 1–19 (default 3).
    #[arg(long, requires = "compress")]
    level: Option<i32>,
    /// Publishers key their batches k0..k(N-1) in turn and subscriber i subscribes with a
    /// filter on key k(i mod N) (D57): each takes 1/N of the stream, filtered at the broker.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    filter_split: Option<u32>,
    /// Wait for an acknowledgement of every batch (pipelined), answered after the write.
    #[arg(long)]
    ack: bool,
    /// With --ack: a batch refused before anything was written (its shard moving, a leader
    /// being elected) is sent again after the wait the broker asks for, as a real publisher
    /// does, instead of ending the run (a run across a rebalance: scripts/rebalance-bench.sh).
    /// Off by default: the resends' bookkeeping costs the client CPU on every batch.
    #[arg(long, requires = "ack")]
    resend_refused: bool,
    /// Publish as JSON control messages (base64 payloads) instead of binary batches, as a
    /// plain client that implements only the JSON encoding does.
    #[arg(long)]
    json_publish: bool,
    /// With --ack: acknowledgements may come on enqueue, before the write (the faster mode;
    /// docs/operations.md says what each promises).
    #[arg(long)]
    ack_on_enqueue: bool,
    /// Use a durable stream (offsets, written to disk) instead of an ephemeral one.
    #[arg(long)]
    durable: bool,
    /// fsync policy of the in-process broker's durable streams.
    #[arg(long, default_value = "always")]
    fsync: FsyncMode,
    /// How long to publish (e.g. 5s, 1m; a bare number is seconds).
    #[arg(long, default_value = "5s", value_parser = crate::commands::parse_duration)]
    duration: Duration,
    /// The tenant to publish and subscribe as (with --addr and a token valid for it; the dev
    /// token is valid for any): two benches as two tenants show whether one slows the other.
    #[arg(long, default_value = "bench")]
    pub(crate) tenant: String,
    /// Target records per second across all publishers (0: as fast as possible).
    #[arg(long, default_value_t = 0)]
    rate: u64,
    /// Benchmark cache put/get instead of publish/subscribe.
    #[arg(long)]
    cache: bool,
    /// Concurrent cache requests (with --cache).
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Benchmark a consumer group instead: this many consumers (each its own connection) poll
    /// `--batch` records at a time and ack each, from a backlog published first (durable).
    #[arg(long)]
    group: Option<usize>,
    /// Benchmark cache-watch fan-out instead: this many watchers (each its own connection)
    /// follow a cache that `--concurrency` writers keep putting to.
    #[arg(long)]
    watchers: Option<usize>,
    /// Records published as the group's backlog (with --group).
    #[arg(long, default_value_t = 200_000)]
    backlog: u64,
    /// Measure raw QUIC instead: one stream of bulk bytes through quinn with the same TLS and
    /// transport settings (the ceiling publish→deliver is compared against). With `--rate`, the
    /// bytes `--rate` records of `--payload` bytes a second make, written `--batch` records'
    /// worth at a time (CPU per GB at a given load rather than flat out).
    #[arg(long)]
    raw_quinn: bool,
    /// With --raw-quinn: two hops through a relay that forwards one connection's stream to
    /// another connection (the shape of publish→deliver through a broker), the fair ceiling.
    #[arg(long)]
    relay: bool,
    /// Largest UDP payload MTU discovery may reach, bytes (1200..=65527), for every endpoint the
    /// bench makes (in-process broker, clients, raw quinn). Above 6550 the kernel refuses
    /// segmentation-offload batches (docs/operations.md).
    #[arg(long, default_value_t = felix_driver_tokio::DEFAULT_MAX_UDP_PAYLOAD, value_parser = clap::value_parser!(u16).range(1200..=65527))]
    max_udp_payload: u16,
    /// Ask every peer to acknowledge only every N+1 ack-eliciting packets (QUIC ACK-frequency
    /// extension) instead of every second one.
    #[arg(long)]
    ack_eliciting_threshold: Option<u32>,
    /// Before the publish/subscribe run, measure raw quinn (one stream of bulk bytes) and a bare
    /// quinn relay (two hops through one forwarding task) in this process with the same TLS and
    /// transport settings and duration, and report publish→deliver as a fraction of each, with
    /// the CPU each path spends per GB.
    #[arg(long)]
    baseline: bool,
    /// Print results as JSON.
    #[arg(long)]
    pub(crate) json: bool,
    /// No progress line.
    #[arg(long)]
    pub(crate) quiet: bool,
    /// Configure the in-process broker with a publish rate limit for the bench's tenant, in
    /// records/s (to measure what a limit far above the load costs).
    #[arg(long)]
    rate_limit: Option<u64>,
    /// Measure a reader that falls behind: once this many records were published, one more
    /// subscriber (its own connection) starts that many records behind the tail and reads
    /// while the publishers go on; the report says how fast it read, what retention removed
    /// before it got there, and whether (and when) it caught up with the live tail. Durable
    /// streams only (the in-process broker's stream is made durable).
    #[arg(long)]
    late_reader: Option<u64>,
    /// Records the in-process broker's streams retain per shard (its default otherwise): a
    /// late reader further behind than this loses what retention removes.
    #[arg(long)]
    retention_records: Option<u64>,
    /// History the in-process broker holds in memory per shard, bytes (its default
    /// otherwise): a late reader further behind than this reads from the segment files.
    #[arg(long)]
    memory_bytes: Option<u64>,
    /// Measure many connections instead: this many connect at once to a broker started as a
    /// child process (or --addr with --broker-pid), each subscribing to one in-memory stream;
    /// reports the connect storm's time and failures, the broker's memory per connection, its
    /// CPU while they sit idle, and fan-out to all of them. Needs a file-descriptor limit
    /// above N (`ulimit -n`): each connection is a UDP socket here.
    #[arg(long, help_heading = "Many connections")]
    pub(crate) connections: Option<usize>,
    /// With --connections: subscriptions each connection makes (0: connections alone).
    #[arg(long, default_value_t = 1, help_heading = "Many connections")]
    pub(crate) subscriptions_per_connection: usize,
    /// With --connections: handshakes in flight at once (a broker given with --addr must admit
    /// that many unauthenticated connections from this address:
    /// --max-unauthenticated-per-address).
    #[arg(long, default_value_t = 256, help_heading = "Many connections")]
    pub(crate) handshakes: usize,
    /// With --connections: how long to measure the broker's CPU while the connections idle.
    #[arg(long, value_parser = crate::commands::parse_duration, default_value = "10s", help_heading = "Many connections")]
    pub(crate) idle: Duration,
    /// With --connections: keep each client's liveness check as shipped (`default`: a client
    /// gives a silent broker up after 2 s, so it sends a keep-alive every 500 ms) or turn it
    /// `off` (QUIC's own keep-alive, every 5 s, only).
    #[arg(long, default_value = "default", value_parser = ["default", "off"], help_heading = "Many connections")]
    pub(crate) liveness: String,
    /// With --connections: the started broker's `--max-streams` (concurrent bidirectional
    /// streams a client may open; quinn keeps a table entry per allowed stream, so this sets
    /// most of an idle connection's memory) [default: the broker's, 128].
    #[arg(long, help_heading = "Many connections")]
    pub(crate) broker_max_streams: Option<u32>,
    /// With --connections and --addr: the broker's process id, for its memory and CPU.
    #[arg(long, help_heading = "Many connections")]
    pub(crate) broker_pid: Option<u32>,
}

impl BenchArgs {
    /// The transport settings of every endpoint the bench makes.
    pub(crate) fn tuning_pub(&self) -> felix_driver_tokio::TransportTuning {
        self.tuning()
    }

    /// The transport settings of every endpoint the bench makes.
    fn tuning(&self) -> felix_driver_tokio::TransportTuning {
        felix_driver_tokio::TransportTuning {
            max_udp_payload: self.max_udp_payload,
            ack_eliciting_threshold: self.ack_eliciting_threshold,
            ..Default::default()
        }
    }
}

struct Target {
    addr: SocketAddr,
    /// The tenant it publishes as.
    tenant: String,
    token: String,
    trust: Trust,
    tuning: felix_driver_tokio::TransportTuning,
    /// `--ack-on-enqueue`.
    ack_on_enqueue: bool,
    /// The in-process broker's metrics (its QUIC counters go in the report).
    metrics: Option<SocketAddr>,
    _server: Option<felix_driver_tokio::Server>,
    _dir: Option<tempfile::TempDir>,
}

async fn target(a: &BenchArgs) -> Result<Target, String> {
    if let Some(addr) = a.addr {
        let token = match &a.token {
            Some(t) => t.clone(),
            None => std::fs::read_to_string(DataDir::new(&a.data_dir).token())
                .map(|t| t.trim().to_owned())
                .map_err(|e| format!("no --token and no dev token in {}: {e}", a.data_dir.display()))?,
        };
        let trust = client_trust(a.ca.as_deref(), &a.data_dir, false)?;
        let ack_on_enqueue = a.ack_on_enqueue;
        return Ok(Target {
            tenant: a.tenant.clone(),
            addr,
            token,
            trust,
            tuning: a.tuning(),
            ack_on_enqueue,
            metrics: None,
            _server: None,
            _dir: None,
        });
    }
    let dir = tempfile::tempdir().map_err(|e| format!("temporary data dir: {e}"))?;
    let (identity, _, _) = Identity::self_signed(&["localhost"]).map_err(|e| e.to_string())?;
    let chain = identity.chain.clone();
    let server = start_broker(BrokerSettings {
        listen: "127.0.0.1:0".parse().expect("literal"),
        data_dir: Some(dir.path().to_path_buf()),
        token: Some("bench".into()),
        tokens: Vec::new(),
        client_certs: Vec::new(),
        client_ca: None,
        streams: Vec::new(),
        caches: Vec::new(),
        queue_capacity_max: 65_536,
        tenant_limits: a
            .rate_limit
            .map(|r| {
                vec![felix_proto::broker::TenantLimit {
                    tenant_id: a.tenant.clone(),
                    records_per_s: Some(r),
                    ..Default::default()
                }]
            })
            .unwrap_or_default(),
        jwt: None,
        queue_bytes_max: 256 << 20,
        publisher_hold_max: felix_proto::broker::DEFAULT_PUBLISHER_HOLD_MAX,
        identity,
        fsync: a.fsync,
        ephemeral: !a.durable && a.group.is_none() && a.late_reader.is_none(),
        default_shards: 1,
        default_replication: 1,
        cache_replication: 1,
        durable_caches: false,
        publish_window: 256,
        max_frame_bytes: 16 << 20,
        ack_on_commit: false,
        auto_create: true,
        queue_capacity: felix_proto::broker::DEFAULT_SUBSCRIBER_QUEUE_CAPACITY,
        max_records_per_read: 1000,
        retention_records: a.retention_records,
        memory_bytes: a.memory_bytes,
        group_limits: Default::default(),
        require_alpn: false,
        metrics_listen: Some("127.0.0.1:0".parse().expect("literal")),
        http: None,
        cluster: None,
        transport: a.tuning(),
        admission: crate::node::Admission::default(),
    })
    .await?;
    Ok(Target {
        tenant: a.tenant.clone(),
        addr: server.local_addr(),
        metrics: server.metrics_addr,
        token: "bench".into(),
        trust: Trust::Certificates(chain),
        tuning: a.tuning(),
        ack_on_enqueue: a.ack_on_enqueue,
        _server: Some(server),
        _dir: Some(dir),
    })
}

async fn connect(t: &Target) -> Result<Client, String> {
    connect_compressing(t, None).await
}

/// A client that compresses its publishes with `compress` (D56).
async fn connect_compressing(t: &Target, compress: Option<(felix_proto::Codec, i32)>) -> Result<Client, String> {
    let mut opts = ClientOptions::new(t.tenant.clone(), t.token.clone(), t.trust.clone());
    opts.transport = t.tuning.clone();
    opts.config.compress = compress;
    if t.ack_on_enqueue {
        opts.config = opts.config.ack_on_enqueue();
    }
    Client::connect(t.addr, opts).await.map_err(|e| e.to_string())
}

/// Whether the `\r` progress line is drawn: only on a terminal, as indicatif does; in a log
/// file or a pipe it would be a long line of carriage returns.
fn progress_shown() -> bool {
    use std::io::IsTerminal;
    std::io::stderr().is_terminal()
}

fn progress(quiet: bool, start: Instant, total: Duration, label: String) {
    if !quiet && progress_shown() {
        let elapsed = start.elapsed().as_secs_f64();
        eprint!(
            "\r{} {elapsed:>4.1}s/{}  {label}   ",
            bar(elapsed / total.as_secs_f64().max(1e-9)),
            crate::commands::humantime(total)
        );
    }
}

/// A 20-cell progress bar for a fraction done (clamped to 0..=1).
fn bar(done: f64) -> String {
    const CELLS: usize = 20;
    let filled = ((done.clamp(0.0, 1.0) * CELLS as f64).round() as usize).min(CELLS);
    format!("[{}{}]", "#".repeat(filled), "-".repeat(CELLS - filled))
}

pub async fn run(a: BenchArgs) -> Result<ExitCode, String> {
    if a.payload < 8 {
        return Err("--payload must be at least 8 bytes (the send time rides in the first 8)".into());
    }
    if a.publishers == 0 || a.batch == 0 || a.duration.is_zero() {
        return Err("--publishers, --batch and --duration must be positive".into());
    }
    let compress = crate::commands::compression(a.compress, a.level)?;
    if a.raw_quinn {
        return raw_quinn(&a).await;
    }
    if let Some(n) = a.connections {
        if n == 0 {
            return Err("--connections must be positive".into());
        }
        return crate::conn_bench::run(&a, n).await;
    }
    let plain = !a.cache && a.group.is_none() && a.watchers.is_none();
    if a.baseline && !plain {
        return Err("--baseline goes with the publish/subscribe bench, not --cache, --group or --watchers".into());
    }
    let baseline =
        if a.baseline { Some((raw_quinn_run(&a, false).await?, raw_quinn_run(&a, true).await?)) } else { None };
    let t = target(&a).await?;
    if a.cache {
        return cache_bench(&a, &t).await;
    }
    if let Some(n) = a.group {
        return group_bench(&a, &t, n.max(1)).await;
    }
    if let Some(n) = a.watchers {
        return watch_bench(&a, &t, n.max(1)).await;
    }
    let stream = a.stream.clone().unwrap_or_else(|| format!("bench-{}", std::process::id()));
    // In a cluster a new stream exists once the metadata group created it: publish one record
    // until it is taken (bounded), before anything is measured.
    let warm_offset;
    {
        let c = connect(&t).await?;
        let until = Instant::now() + Duration::from_secs(10);
        loop {
            let opts = PublishOptions { ack: true, ..Default::default() };
            match c.publish("bench", &stream, vec![Bytes::from_static(b"warm-up")], opts).await {
                Ok(o) => {
                    warm_offset = o;
                    break;
                }
                Err(e) if Instant::now() < until && e.to_string().contains("shard_unavailable") => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => return Err(format!("warm-up publish: {e}")),
            }
        }
        let _ = c.close().await;
    }
    let epoch = Instant::now();
    let published = Arc::new(AtomicU64::new(0));
    let delivered = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // Tells the subscribers to hand in their figures (a broker given with --addr keeps their
    // subscriptions open after the run).
    let (done_tx, done_rx) = tokio::sync::watch::channel(false);

    let mut subs = Vec::new();
    for i in 0..a.subscribers {
        let c = connect(&t).await?;
        let filter = a.filter_split.map(|n| felix_proto::message::KeyFilter {
            keys: vec![felix_proto::message::B64(Bytes::from(format!("k{}", i as u32 % n)))],
            key_prefixes: vec![],
        });
        let mut sub =
            c.subscribe_filtered("bench", &stream, None, None, filter.clone()).await.map_err(|e| e.to_string())?;
        let delivered = delivered.clone();
        let stream = stream.clone();
        let mut done = done_rx.clone();
        subs.push(tokio::spawn(async move {
            let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
            let mut last_offset: Option<u64> = None;
            let mut cursor = felix_proto::client::SubscriptionCursor::new();
            cursor.subscribed(sub.start_offset);
            let mut gaps = 0u64;
            let mut resumed = 0u64;
            loop {
                let item = tokio::select! {
                    item = sub.next() => item,
                    _ = done.wait_for(|d| *d) => None,
                };
                // A durable subscriber that fell behind reads on from the log, as a real
                // consumer would (felix-node subscribe does the same).
                if let Some(SubscriptionItem::End(reason @ felix_proto::client::EndReason::Lagged { .. })) = item {
                    let Some(start) = cursor.resume(&reason) else { break };
                    match c.subscribe_filtered("bench", &stream, Some(start), None, filter.clone()).await {
                        Ok(s) => {
                            sub = s;
                            cursor.subscribed(sub.start_offset);
                            resumed += 1;
                            continue;
                        }
                        Err(_) => break,
                    }
                }
                let Some(SubscriptionItem::Events(b)) = item else { break };
                cursor.delivered(&b);
                let now = epoch.elapsed().as_nanos() as u64;
                for (i, p) in b.records.slices().enumerate() {
                    if p.len() >= 8 {
                        let mut ts = [0u8; 8];
                        ts.copy_from_slice(&p[..8]);
                        let sent = u64::from_be_bytes(ts);
                        let _ = hist.record((now.saturating_sub(sent) / 1000).max(1));
                    }
                    if let Some(base) = b.base_offset {
                        let o = base + i as u64;
                        // Offsets a filter passed over are said, not missing.
                        let said = if i == 0 { b.skipped_before.unwrap_or(0) } else { 0 };
                        if let Some(l) = last_offset {
                            gaps += o.saturating_sub(l + 1 + said);
                        }
                        last_offset = Some(o);
                    }
                }
                delivered.fetch_add(u64::from(b.records.count()), Ordering::Relaxed);
            }
            let counts = c.quic_counts();
            drop(c);
            (hist, gaps, resumed, counts)
        }));
    }

    // Ends the late reader's measurement when the publishers stop.
    let (ended_tx, ended_rx) = tokio::sync::watch::channel(false);
    let late = match a.late_reader {
        Some(behind) => {
            let Some(first) = warm_offset else {
                return Err("--late-reader needs a durable stream (the warm-up record got no offset)".into());
            };
            let c = connect(&t).await?;
            let job = LateReader { stream: stream.clone(), next: first + 1, behind, epoch };
            Some(tokio::spawn(job.run(c, published.clone(), ended_rx)))
        }
        None => None,
    };

    let total = a.duration;
    let per_pub_rate = if a.rate == 0 { 0.0 } else { a.rate as f64 / a.publishers as f64 };
    // Records published per key (one key without --filter-split): what each subscriber is owed.
    let keys = a.filter_split.unwrap_or(1) as usize;
    let key_sent: Arc<Vec<AtomicU64>> = Arc::new((0..keys).map(|_| AtomicU64::new(0)).collect());
    let mut pubs = Vec::new();
    for p in 0..a.publishers {
        let c = connect_compressing(&t, compress).await?;
        let (published, stop, stream) = (published.clone(), stop.clone(), stream.clone());
        let (batch, size, ack, json) = (a.batch, a.payload, a.ack, a.json_publish);
        let resend = a.resend_refused;
        let data = RecordData::new(&a.data, size - 8, p as u64);
        let split = a.filter_split;
        let key_sent = key_sent.clone();
        pubs.push(tokio::spawn(async move {
            let started = Instant::now();
            let mut sent = 0u64;
            let mut inflight = tokio::task::JoinSet::new();
            while !stop.load(Ordering::Relaxed) {
                if per_pub_rate > 0.0 {
                    let due = started + Duration::from_secs_f64(sent as f64 / per_pub_rate);
                    tokio::time::sleep_until(tokio::time::Instant::from_std(due)).await;
                }
                let now = epoch.elapsed().as_nanos() as u64;
                // One buffer per batch, sliced into records: no allocation per record.
                let mut buf = BytesMut::with_capacity(batch * size);
                for i in 0..batch {
                    buf.put_u64(now);
                    buf.extend_from_slice(data.record(sent + i as u64));
                }
                let buf = buf.freeze();
                let payloads: Vec<Bytes> = (0..batch).map(|i| buf.slice(i * size..(i + 1) * size)).collect();
                let key = split.map(|n| Bytes::from(format!("k{}", (sent / batch as u64) % u64::from(n))));
                let opts = PublishOptions { ack, json, key, envelope: None };
                if ack {
                    // Keep many acked batches in flight: the client pipelines them under the
                    // broker's window.
                    let c2 = c.clone();
                    let stream2 = stream.clone();
                    // With --resend-refused, a refusal that wrote nothing (a shard moving or
                    // electing a leader: a rebalance under load) is sent again after the wait
                    // the broker asked for, as a real publisher would; anything else ends the
                    // run. (The resends live in their own boxed future; they slice the
                    // records again from the batch's one buffer.)
                    if resend {
                        let again = (buf.clone(), batch, size);
                        inflight.spawn(async move {
                            let resend = opts.clone();
                            match c2.publish("bench", &stream2, payloads, opts).await {
                                Err(e) if felix_driver_tokio::ClusterClient::retry_wait(&e, 1).is_some() => {
                                    Box::pin(resend_refused(c2, stream2, again, resend, e)).await
                                }
                                done => done,
                            }
                        });
                    } else {
                        inflight.spawn(async move { c2.publish("bench", &stream2, payloads, opts).await });
                    }
                    while inflight.len() >= 256 {
                        match inflight.join_next().await {
                            Some(Ok(Err(e))) => return Err(e.to_string()),
                            Some(Err(e)) => return Err(e.to_string()),
                            _ => {}
                        }
                    }
                } else if let Err(e) = c.publish("bench", &stream, payloads, opts).await {
                    // Unacked: completes when QUIC took the bytes (flow-control backpressure).
                    return Err(e.to_string());
                }
                key_sent[((sent / batch as u64) % key_sent.len() as u64) as usize]
                    .fetch_add(batch as u64, Ordering::Relaxed);
                sent += batch as u64;
                published.fetch_add(batch as u64, Ordering::Relaxed);
            }
            while let Some(r) = inflight.join_next().await {
                if let Ok(Err(e)) = r {
                    return Err(e.to_string());
                }
            }
            Ok(c)
        }));
    }

    let cpu0 = cpu_seconds();
    let steal0 = steal_seconds();
    let start = Instant::now();
    while start.elapsed() < total {
        tokio::time::sleep(Duration::from_millis(250)).await;
        let secs = start.elapsed().as_secs_f64();
        progress(
            a.quiet,
            start,
            total,
            format!(
                "published {:.0}/s  delivered {:.0}/s",
                published.load(Ordering::Relaxed) as f64 / secs,
                delivered.load(Ordering::Relaxed) as f64 / secs
            ),
        );
    }
    stop.store(true, Ordering::Relaxed);
    let _ = ended_tx.send(true);
    let late = match late {
        Some(j) => Some(j.await.map_err(|e| e.to_string())??),
        None => None,
    };
    // What arrived within the publishing window, the figure comparable with raw quinn's.
    let in_window = Throughput {
        mb_per_s: delivered.load(Ordering::Relaxed) as f64 * a.payload as f64
            / a.subscribers.max(1) as f64
            / start.elapsed().as_secs_f64()
            / 1e6,
        secs: start.elapsed().as_secs_f64(),
        cpu_s: cpu_seconds().zip(cpu0).map(|(b, a)| b - a),
    };
    // The share of the machine's CPU time the host took for others during the window.
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
    let stolen = steal_seconds().zip(steal0).map(|(b, a)| (b - a) / (in_window.secs * cores));
    let mut clients = Vec::new();
    for p in pubs {
        clients.push(p.await.map_err(|e| e.to_string())??);
    }
    let mut pub_counts = felix_driver_tokio::QuicCounts::default();
    for c in &clients {
        pub_counts += c.quic_counts();
    }
    let elapsed = start.elapsed();
    let sent = published.load(Ordering::Relaxed);
    let expected: u64 = (0..a.subscribers).map(|i| key_sent[i % keys].load(Ordering::Relaxed)).sum();
    // Let the subscribers catch up (bounded).
    let drain_start = Instant::now();
    while delivered.load(Ordering::Relaxed) < expected && drain_start.elapsed() < Duration::from_secs(10) {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    if !a.quiet && progress_shown() {
        eprintln!();
    }
    let got = delivered.load(Ordering::Relaxed);
    // The broker's QUIC counters while every connection is still open.
    let quic = match t.metrics {
        Some(m) => broker_quic(m).await,
        None => serde_json::Value::Null,
    };
    let _ = done_tx.send(true);
    for c in &clients {
        let _ = c.close().await;
    }
    let mut hist = Histogram::<u64>::new_with_bounds(1, 60_000_000, 3).expect("valid bounds");
    let (mut gaps, mut resumed) = (0, 0);
    let mut sub_counts = felix_driver_tokio::QuicCounts::default();
    for s in subs {
        if let Ok(Ok((h, g, r, counts))) = tokio::time::timeout(Duration::from_secs(5), s).await {
            let _ = hist.add(&h);
            gaps += g;
            resumed += r;
            sub_counts += counts;
        }
    }
    // What a record cost on the clients' wire, per record published (both directions).
    let per_record = |c: felix_driver_tokio::QuicCounts| {
        let n = sent.max(1) as f64;
        serde_json::json!({
            "datagrams_sent": c.datagrams_sent as f64 / n, "datagrams_received": c.datagrams_received as f64 / n,
            "send_calls": c.send_calls as f64 / n, "receive_calls": c.receive_calls as f64 / n,
            "acks_sent": c.acks_sent as f64 / n, "acks_received": c.acks_received as f64 / n,
            "bytes_sent": c.bytes_sent as f64 / n, "bytes_received": c.bytes_received as f64 / n,
        })
    };
    // Bytes on the wire per record: each publisher's sent, each subscriber's received.
    let wire_in = pub_counts.bytes_sent as f64 / sent.max(1) as f64;
    let wire_out = sub_counts.bytes_received as f64 / (sent.max(1) * a.subscribers.max(1) as u64) as f64;
    // Bytes on disk per record: the in-process broker's segment files.
    let disk = if a.durable || a.late_reader.is_some() {
        t._dir.as_ref().map(|d| dir_bytes(d.path()) as f64 / sent.max(1) as f64)
    } else {
        None
    };
    drop(t);
    let secs = elapsed.as_secs_f64();
    let mb = sent as f64 * a.payload as f64 / secs / 1e6;
    let q = |p: f64| hist.value_at_quantile(p);
    let mut result = serde_json::json!({
        "publishers": a.publishers, "subscribers": a.subscribers, "payload_bytes": a.payload,
        "batch": a.batch, "ack": a.ack, "durable": a.durable, "duration_s": secs,
        "published_msgs": sent, "publish_msgs_per_s": sent as f64 / secs, "publish_mb_per_s": mb,
        "delivered_events": got, "delivered_events_per_s": got as f64 / secs,
        "not_delivered": expected.saturating_sub(got), "offset_gaps": gaps, "resumed_after_lag": resumed,
        "latency_us": {"p50": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": hist.max(), "samples": hist.len()},
        "delivered_mb_per_s_per_subscriber": in_window.mb_per_s, "cpu_s_per_gb": in_window.cpu_s_per_gb(),
        "cpu_s": in_window.cpu_s,
        "cpu_us_per_record": in_window.cpu_s.map(|c| c * 1e6 / sent.max(1) as f64),
        "host_steal_fraction": stolen,
        "broker_quic": quic,
        "client_quic_per_record": {"publishers": per_record(pub_counts), "subscribers": per_record(sub_counts)},
        "json_publish": a.json_publish,
        "data": a.data, "compress": compress.map(|(c, l)| format!("{c}:{l}")),
        "wire_bytes_per_record": {"publish": wire_in, "deliver": wire_out}, "disk_bytes_per_record": disk,
    });
    if let Some(l) = &late {
        result["late_reader"] = l.json();
    }
    if let Some((single, relay)) = baseline {
        result["baseline"] = serde_json::json!({
            "raw_quinn_mb_per_s": single.mb_per_s, "raw_quinn_cpu_s_per_gb": single.cpu_s_per_gb(),
            "relay_mb_per_s": relay.mb_per_s, "relay_cpu_s_per_gb": relay.cpu_s_per_gb(),
            "fraction_of_raw_quinn": in_window.mb_per_s / single.mb_per_s,
            "fraction_of_relay": in_window.mb_per_s / relay.mb_per_s,
        });
    }
    if a.json {
        out!("{result}");
    } else {
        out!(
            "Felix bench: {} publisher(s), {} subscriber(s), {} B {} records, batch {}, {}, {}{}",
            a.publishers,
            a.subscribers,
            a.payload,
            a.data,
            a.batch,
            if a.ack { "acked" } else { "unacked" },
            if a.durable || a.late_reader.is_some() { "durable" } else { "ephemeral" },
            compress.map_or(String::new(), |(c, l)| format!(", {c} level {l}"))
        );
        out!("  {:<28} {:>14}", "published", format!("{sent} msgs"));
        out!("  {:<28} {:>14.0}", "publish msgs/s", sent as f64 / secs);
        out!("  {:<28} {:>14.1}", "publish MB/s (payload)", mb);
        out!("  {:<28} {:>14.0}", "delivered events/s (total)", got as f64 / secs);
        out!("  {:<28} {:>14}", "not delivered", expected.saturating_sub(got));
        if a.durable {
            out!("  {:<28} {:>14}", "offset gaps", gaps);
            out!("  {:<28} {:>14}", "resumed after falling behind", resumed);
        }
        out!("  {:<28} {:>14}", "latency p50 (µs)", q(0.5));
        out!("  {:<28} {:>14}", "latency p99 (µs)", q(0.99));
        out!("  {:<28} {:>14}", "latency p999 (µs)", q(0.999));
        out!("  {:<28} {:>14}", "latency max (µs)", hist.max());
        out!("  {:<28} {:>14.1}", "delivered MB/s (per sub)", in_window.mb_per_s);
        out!("  {:<28} {:>14.1}", "wire B/record, publish", wire_in);
        out!("  {:<28} {:>14.1}", "wire B/record, per sub", wire_out);
        if let Some(d) = disk {
            out!("  {:<28} {:>14.1}", "disk B/record", d);
        }
        out!(
            "  {:<28} {:>14.3}",
            "CPU µs per record",
            in_window.cpu_s.map_or(f64::NAN, |c| c * 1e6 / sent.max(1) as f64)
        );
        if let Some(l) = &late {
            l.print();
        }
        let cpu = |t: &Throughput| t.cpu_s_per_gb().map_or("-".to_owned(), |c| format!("{c:.2}"));
        out!("  {:<28} {:>14}", "CPU s per GB delivered", cpu(&in_window));
        if let Some(f) = stolen.filter(|f| *f >= 0.02) {
            out!(
                "  {:<28} {:>13.0}%  (the host was busy: latency figures are noisy)",
                "CPU time stolen by host",
                f * 100.0
            );
        }
        if let Some((single, relay)) = baseline {
            out!("Baseline, same process, TLS, transport settings and duration:");
            out!("  {:<28} {:>14}", "", "MB/s   CPU s/GB   Felix is");
            for (name, b) in [("raw quinn, one stream", single), ("quinn relay, two hops", relay)] {
                out!(
                    "  {name:<28} {:>8.1} {:>10} {:>9.1}%",
                    b.mb_per_s,
                    cpu(&b),
                    100.0 * in_window.mb_per_s / b.mb_per_s
                );
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// Bytes of every file under `dir`.
fn dir_bytes(dir: &std::path::Path) -> u64 {
    let Ok(entries) = std::fs::read_dir(dir) else { return 0 };
    entries
        .flatten()
        .map(|e| match e.file_type() {
            Ok(t) if t.is_dir() => dir_bytes(&e.path()),
            Ok(_) => e.metadata().map_or(0, |m| m.len()),
            Err(_) => 0,
        })
        .sum()
}

/// What the bench's records hold after their send time (`--data`): pre-made bodies, picked in
/// turn, so making a batch costs a copy whatever the kind.
struct RecordData {
    bodies: Vec<Vec<u8>>,
}

impl RecordData {
    /// Bodies of `len` bytes; `seed` varies them between publishers.
    fn new(kind: &str, len: usize, seed: u64) -> RecordData {
        let mut x = 0x9E37_79B9_7F4A_7C15u64 ^ seed.wrapping_mul(0xD1B5_4A32_D192_ED03);
        let mut next = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        };
        let bodies = match kind {
            "json" => (0..1024).map(|_| json_record(len, &mut next)).collect(),
            "random" => (0..1024).map(|_| (0..len).map(|_| next() as u8).collect()).collect(),
            _ => vec![vec![b'x'; len]],
        };
        RecordData { bodies }
    }

    fn record(&self, n: u64) -> &[u8] {
        &self.bodies[(n % self.bodies.len() as u64) as usize]
    }
}

/// A JSON-like event of exactly `len` bytes: the fields of a click stream or an access log,
/// values drawn from small vocabularies and random numbers, as such records are.
fn json_record(len: usize, next: &mut impl FnMut() -> u64) -> Vec<u8> {
    const EVENTS: [&str; 6] = ["page_view", "click", "add_to_cart", "checkout", "search", "login"];
    const PAGES: [&str; 8] =
        ["/", "/products", "/products/shoes", "/products/hats", "/cart", "/checkout", "/search", "/account"];
    const AGENTS: [&str; 3] = [
        "Mozilla/5.0 (X11; Linux x86_64) AppleWebKit/537.36 (KHTML, like Gecko) Chrome/124.0 Safari/537.36",
        "Mozilla/5.0 (iPhone; CPU iPhone OS 17_4 like Mac OS X) AppleWebKit/605.1.15 Mobile/15E148",
        "Mozilla/5.0 (Windows NT 10.0; Win64; x64; rv:125.0) Gecko/20100101 Firefox/125.0",
    ];
    let mut s = String::with_capacity(len + 64);
    let mut r = || next() as usize;
    s.push_str(&format!(
        "{{\"event\":\"{}\",\"user_id\":{},\"session\":\"{:016x}\",\"page\":\"{}\",\"status\":{},\"latency_ms\":{},\"agent\":\"{}\",\"items\":[",
        EVENTS[r() % EVENTS.len()],
        r() % 100_000,
        r() as u64,
        PAGES[r() % PAGES.len()],
        [200, 200, 200, 304, 404][r() % 5],
        r() % 900 + 3,
        AGENTS[r() % AGENTS.len()],
    ));
    let mut first = true;
    while s.len() + 80 < len {
        if !first {
            s.push(',');
        }
        first = false;
        s.push_str(&format!(
            "{{\"sku\":\"SKU-{:05}\",\"qty\":{},\"price\":{}.{:02}}}",
            r() % 5000,
            r() % 4 + 1,
            r() % 200,
            r() % 100
        ));
    }
    s.push_str("],\"pad\":\"");
    while s.len() + 2 < len {
        s.push('-');
    }
    s.push_str("\"}");
    let mut v = s.into_bytes();
    v.resize(len, b' ');
    v
}

/// Sends a bench batch again after a refusal that wrote nothing (`first`), waiting as the
/// broker asked, until it is taken or refused otherwise: the records are sliced again from
/// the batch's buffer (`buf`, `count` records of `size` bytes).
async fn resend_refused(
    c: felix_driver_tokio::Client,
    stream: String,
    (buf, count, size): (Bytes, usize, usize),
    opts: PublishOptions,
    first: felix_driver_tokio::ClientError,
) -> Result<Option<u64>, felix_driver_tokio::ClientError> {
    let mut last = first;
    let mut tries = 1;
    while let Some(wait) = felix_driver_tokio::ClusterClient::retry_wait(&last, tries) {
        tokio::time::sleep(wait).await;
        tries += 1;
        let records = (0..count).map(|i| buf.slice(i * size..(i + 1) * size)).collect();
        match c.publish("bench", &stream, records, opts.clone()).await {
            Err(e) => last = e,
            done => return done,
        }
    }
    Err(last)
}

#[cfg(test)]
mod tests {
    #[test]
    fn progress_bar_fills_with_the_fraction_done() {
        assert_eq!(super::bar(0.0), format!("[{}]", "-".repeat(20)));
        assert_eq!(super::bar(0.5), format!("[{}{}]", "#".repeat(10), "-".repeat(10)));
        assert_eq!(super::bar(1.7), format!("[{}]", "#".repeat(20)), "clamped");
        assert_eq!(super::bar(f64::NAN).len(), 22, "never panics");
    }
}
