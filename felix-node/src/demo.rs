//! `felix-node demo`: a broker in-process on a free port, then the main features end to end.

use crate::node::{BrokerSettings, start_broker};
use bytes::Bytes;
use felix_driver_tokio::{Client, ClientOptions, FsyncMode, Identity, PublishOptions, SubscriptionItem, Trust};
use felix_proto::message::StartPosition;
use std::process::ExitCode;
use std::time::Duration;

async fn next_events(
    sub: &mut felix_driver_tokio::Subscription,
    n: usize,
) -> Result<Vec<(Option<u64>, String)>, String> {
    let mut out = Vec::new();
    while out.len() < n {
        match tokio::time::timeout(Duration::from_secs(10), sub.next()).await {
            Ok(Some(SubscriptionItem::Events(b))) => {
                for (i, p) in b.records.payloads().enumerate() {
                    out.push((b.base_offset.map(|o| o + i as u64), String::from_utf8_lossy(&p).into_owned()));
                }
            }
            Ok(other) => return Err(format!("subscription ended early: {other:?}")),
            Err(_) => return Err("no events within 10 s".into()),
        }
    }
    Ok(out)
}

/// The demo brokers' settings: fsync always, acks after the write, everything else default.
fn demo_settings(
    listen: std::net::SocketAddr,
    data_dir: std::path::PathBuf,
    token: String,
    identity: Identity,
    default_shards: u32,
    metrics_listen: Option<std::net::SocketAddr>,
    cluster: Option<felix_driver_tokio::cluster::ClusterOptions>,
) -> BrokerSettings {
    BrokerSettings {
        listen,
        http: None,
        data_dir: Some(data_dir),
        token: Some(token),
        tokens: Vec::new(),
        client_certs: Vec::new(),
        client_ca: None,
        streams: Vec::new(),
        caches: Vec::new(),
        queue_capacity_max: 65_536,
        tenant_limits: Vec::new(),
        jwt: None,
        queue_bytes_max: 256 << 20,
        publisher_hold_max: felix_proto::broker::DEFAULT_PUBLISHER_HOLD_MAX,
        identity,
        fsync: FsyncMode::Always,
        ephemeral: false,
        default_shards,
        default_replication: 1,
        cache_replication: 1,
        durable_caches: false,
        publish_window: 256,
        max_frame_bytes: 16 << 20,
        ack_on_commit: true,
        auto_create: true,
        queue_capacity: felix_proto::broker::DEFAULT_SUBSCRIBER_QUEUE_CAPACITY,
        max_records_per_read: 1000,
        retention_records: None,
        memory_bytes: None,
        group_limits: Default::default(),
        require_alpn: false,
        metrics_listen,
        cluster,
        transport: felix_driver_tokio::TransportTuning::default(),
        admission: crate::node::Admission::default(),
    }
}

pub async fn run() -> Result<ExitCode, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temporary data dir: {e}"))?;
    let (identity, _, _) = Identity::self_signed(&["localhost"]).map_err(|e| e.to_string())?;
    let chain = identity.chain.clone();
    let token = "demo-token".to_string();
    let server = start_broker(demo_settings(
        "127.0.0.1:0".parse().expect("literal"),
        dir.path().to_path_buf(),
        token.clone(),
        identity,
        1,
        None,
        None,
    ))
    .await?;
    let addr = server.local_addr();
    out!("== Felix demo");
    out!("broker: {addr} (in-process, data in {}, fsync always, ack on commit)", dir.path().display());

    let client = Client::connect(addr, ClientOptions::new("demo", token, Trust::Certificates(chain)))
        .await
        .map_err(|e| e.to_string())?;
    let n = client.negotiated();
    out!(
        "connected: server_flags {:#06x}, {} features, publish window {}",
        n.server_flags.bits(),
        n.server_features.names().len(),
        n.publish_window.map_or_else(|| "none".to_owned(), |w| w.to_string())
    );

    out!("\n-- publish and subscribe");
    let mut live = client.subscribe("default", "orders", None, None).await.map_err(|e| e.to_string())?;
    out!("subscribed live from offset {}", offset(live.start_offset));
    for (i, item) in ["apple", "banana", "cherry"].iter().enumerate() {
        let key = format!("customer-{i}");
        let off = client
            .publish(
                "default",
                "orders",
                vec![Bytes::from(*item)],
                PublishOptions { envelope: None, key: Some(Bytes::from(key.clone())), ack: true, json: false },
            )
            .await
            .map_err(|e| e.to_string())?;
        out!("published {item:?} (key {key}) -> acknowledged at offset {}", off.map_or("-".into(), |o| o.to_string()));
    }
    let batch: Vec<Bytes> = (1..=5).map(|i| Bytes::from(format!("batch-{i}"))).collect();
    let off = client
        .publish("default", "orders", batch, PublishOptions { ack: true, ..Default::default() })
        .await
        .map_err(|e| e.to_string())?;
    out!("published a batch of 5 -> first record at offset {}", off.map_or("-".into(), |o| o.to_string()));
    for (off, p) in next_events(&mut live, 8).await? {
        out!("  live event  offset {:>2}  {p}", off.map_or("-".into(), |o| o.to_string()));
    }

    out!("\n-- replay from earliest");
    let mut replay =
        client.subscribe("default", "orders", Some(StartPosition::Earliest), None).await.map_err(|e| e.to_string())?;
    let events = next_events(&mut replay, 8).await?;
    out!("replayed {} events, offsets {}..={}", events.len(), offset(events[0].0), offset(events[events.len() - 1].0));

    out!("\n-- cache");
    client.cache_put("default", "sessions", "user:1", Bytes::from("alice"), None).await.map_err(|e| e.to_string())?;
    client
        .cache_put("default", "sessions", "temp", Bytes::from("short-lived"), Some(200))
        .await
        .map_err(|e| e.to_string())?;
    let v = client.cache_get("default", "sessions", "user:1").await.map_err(|e| e.to_string())?;
    out!("get user:1 -> {}", value(v.as_ref()));
    let t = client.cache_get("default", "sessions", "temp").await.map_err(|e| e.to_string())?;
    out!("get temp (ttl 200 ms) -> {}", value(t.as_ref()));
    tokio::time::sleep(Duration::from_millis(300)).await;
    let t = client.cache_get("default", "sessions", "temp").await.map_err(|e| e.to_string())?;
    out!("get temp after 300 ms -> {} (expired)", value(t.as_ref()));
    let d = client.cache_delete("default", "sessions", "user:1").await.map_err(|e| e.to_string())?;
    out!("delete user:1 -> removed {}", value(d.as_ref()));

    out!("\n-- a consumer group, a range read, a counter");
    let g = felix_driver_tokio::GroupTarget::new("default", "orders", "billing");
    let claimed =
        client.group_poll(&g, 3, felix_driver_tokio::PollOptions::default()).await.map_err(|e| e.to_string())?;
    for r in &claimed {
        client.group_ack(&g, r.offset).await.map_err(|e| e.to_string())?;
    }
    let info = client.group_describe(&g).await.map_err(|e| e.to_string())?;
    out!(
        "group billing: claimed and acked offsets {}; position {} of tail {}",
        claimed.iter().map(|r| r.offset.to_string()).collect::<Vec<_>>().join(", "),
        offset(info.committed),
        info.tail
    );
    let page = client.stream_read("default", "orders", 0, 2, Some(5), None).await.map_err(|e| e.to_string())?;
    out!(
        "read offsets 2..5 -> {}",
        page.records.iter().map(|r| String::from_utf8_lossy(&r.payload.0).into_owned()).collect::<Vec<_>>().join(", ")
    );
    let views = client.counter_add("default", "stats", "views", 3).await.map_err(|e| e.to_string())?;
    out!("counter views += 3 -> {views}");

    out!("\n-- errors carry codes");
    let bad = client.subscribe("default", "orders", Some(StartPosition::Offset(1000)), None).await;
    out!("subscribe at offset 1000 -> {}", bad.err().map_or("accepted?".into(), |e| e.to_string()));

    let _ = client.close().await;
    server.shutdown().await;
    out!("\ndemo done: broker stopped cleanly");
    Ok(ExitCode::SUCCESS)
}

/// `felix-node demo --cluster`: three brokers in-process on loopback forming a cluster, then
/// routing, a forward and a redirect shown end to end.
pub async fn run_cluster() -> Result<ExitCode, String> {
    let dir = tempfile::tempdir().map_err(|e| format!("temporary data dir: {e}"))?;
    let token = "demo-token".to_string();
    let free_udp = || -> Result<std::net::SocketAddr, String> {
        std::net::UdpSocket::bind("127.0.0.1:0").and_then(|s| s.local_addr()).map_err(|e| e.to_string())
    };
    let free_tcp = || -> Result<std::net::SocketAddr, String> {
        std::net::TcpListener::bind("127.0.0.1:0").and_then(|s| s.local_addr()).map_err(|e| e.to_string())
    };
    let names = ["n1", "n2", "n3"];
    let mut addrs = Vec::new();
    for _ in names {
        addrs.push((free_udp()?, free_udp()?, free_tcp()?));
    }
    let peers: Vec<(String, std::net::SocketAddr)> =
        names.iter().zip(&addrs).map(|(n, (_, c, _))| (n.to_string(), *c)).collect();
    out!("== Felix cluster demo: three brokers on loopback");
    let mut servers = Vec::new();
    let mut chains = Vec::new();
    for (i, n) in names.iter().enumerate() {
        let (identity, _, _) = Identity::self_signed(&["localhost"]).map_err(|e| e.to_string())?;
        chains.push(identity.chain.clone());
        let (client, cluster, metrics) = addrs[i];
        let options = felix_driver_tokio::cluster::ClusterOptions {
            node_id: n.to_string(),
            listen: cluster,
            peers: peers.clone(),
            name: "demo".into(),
            secret: "demo-secret".into(),
            advertise: None,
            join: false,
            replica_entry_cache: None,
            move_bandwidth: None,
            metadata_snapshot_entries: None,
        };
        let server = start_broker(demo_settings(
            client,
            dir.path().join(n),
            token.clone(),
            identity,
            3,
            Some(metrics),
            Some(options),
        ))
        .await?;
        out!("{n}: clients {client}, peers {cluster}, status http://{metrics}/cluster");
        servers.push(server);
    }
    let status = |i: usize| {
        let m = addrs[i].2;
        async move {
            let text = felix_driver_tokio::server::cluster_status(m).await.map_err(|e| e.to_string())?;
            serde_json::from_str::<serde_json::Value>(&text).map_err(|e| e.to_string())
        }
    };
    let until = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        let v = status(0).await?;
        if v["members"].as_array().is_some_and(|m| m.len() == 3) && !v["leader"].is_null() {
            out!("\n-- formed: leader {}, members n1 n2 n3 (metadata on tikv's raft)", v["leader"]);
            break;
        }
        if std::time::Instant::now() > until {
            return Err("the cluster did not form within 20 s".into());
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let connect = |i: usize| {
        let opts = ClientOptions::new("demo", token.clone(), Trust::Certificates(chains[i].clone()));
        Client::connect(addrs[i].0, opts)
    };
    let c1 = connect(0).await.map_err(|e| e.to_string())?;
    // The first use creates the stream through the metadata group.
    let started = std::time::Instant::now();
    loop {
        let opts = PublishOptions { ack: true, key: Some(Bytes::from_static(b"k0")), ..Default::default() };
        match c1.publish("default", "orders", vec![Bytes::from_static(b"first")], opts).await {
            Ok(_) => break,
            Err(e) if e.to_string().contains("shard_unavailable") && started.elapsed() < Duration::from_secs(10) => {
                tokio::time::sleep(Duration::from_millis(20)).await
            }
            Err(e) => return Err(e.to_string()),
        }
    }
    out!("\n-- stream default/orders created in the cluster in {} ms (3 shards)", started.elapsed().as_millis());
    let v = status(0).await?;
    let mut owners = Vec::new();
    for s in v["shards"].as_array().into_iter().flatten().filter(|s| s["name"] == "orders") {
        out!("shard {}: owner {} (generation {})", s["shard"], s["owner"].as_str().unwrap_or("?"), s["generation"]);
        owners.push(s["owner"].as_str().unwrap_or("?").to_owned());
    }
    out!("\n-- publishing 30 keyed records, all through n1 (a forward for every shard n1 does not own)");
    for k in 0..30 {
        let opts = PublishOptions { ack: true, key: Some(Bytes::from(format!("key-{k}"))), ..Default::default() };
        c1.publish("default", "orders", vec![Bytes::from(format!("record-{k}"))], opts)
            .await
            .map_err(|e| e.to_string())?;
    }
    for (shard, owner) in owners.iter().enumerate() {
        let i = names.iter().position(|n| n == owner).unwrap_or(0);
        let c = connect(i).await.map_err(|e| e.to_string())?;
        let page = c.stream_read("default", "orders", shard as u32, 0, None, None).await.map_err(|e| e.to_string())?;
        out!("shard {shard} on {owner}: {} records", page.records.len());
    }
    if let Some((shard, owner)) = owners.iter().enumerate().find(|(_, o)| *o != "n1") {
        out!("\n-- reading shard {shard} through n1, which does not own it:");
        match c1.stream_read("default", "orders", shard as u32, 0, None, None).await {
            Ok(_) => out!("served (unexpected)"),
            Err(e) => out!("{e}   <- a redirect to {owner}"),
        }
    }
    out!("\nRun your own with three `felix-node serve --node-id ...` processes: docs/cluster.md.");
    for s in servers {
        s.shutdown().await;
    }
    Ok(ExitCode::SUCCESS)
}

/// An offset as a user reads it: the number, or `-` where the stream keeps none.
fn offset(o: Option<u64>) -> String {
    o.map_or_else(|| "-".to_owned(), |o| o.to_string())
}

/// A cache value as a user reads it: quoted text, or `(none)`.
fn value(v: Option<&Bytes>) -> String {
    v.map_or_else(|| "(none)".to_owned(), |b| format!("{:?}", String::from_utf8_lossy(b)))
}
