//! What survives a restart, and what is read from disk: history, caches and counters, commit
//! state, retention, deletes, idempotent producers, groups, watches, damage.

use super::*;

#[tokio::test]
async fn old_history_is_replayed_from_disk_not_memory() {
    let dir = tempfile::tempdir().unwrap();
    let small = || {
        let mut b = BrokerConfig::default();
        b.default_stream.memory_bytes = 2_000;
        b.history_read_bytes = 4_000;
        b
    };
    let payload = "y".repeat(100);
    {
        let (server, chain) = start_with(Some(dir.path()), small()).await;
        let c = connect(&server, &chain).await;
        for i in 0..300 {
            c.publish(
                "default",
                "hist",
                vec![Bytes::from(format!("{i:04}{payload}"))],
                PublishOptions { ack: true, ..Default::default() },
            )
            .await
            .unwrap();
        }
        let mut sub = c.subscribe("default", "hist", Some(StartPosition::Earliest), None).await.unwrap();
        let got = collect(&mut sub, 300).await;
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), (0..300).collect::<Vec<_>>());
        assert!(got[0].1.starts_with(b"0000"));
        server.shutdown().await;
    }
    // After a restart the broker holds only its budget in memory and still replays everything.
    let (server, chain) = start_with(Some(dir.path()), small()).await;
    assert_eq!(server.recovered_records, 300);
    let c = connect(&server, &chain).await;
    let mut sub = c.subscribe("default", "hist", Some(StartPosition::Offset(10)), None).await.unwrap();
    let got = collect(&mut sub, 290).await;
    assert_eq!(got.first().map(|g| g.0), Some(10));
    assert_eq!(got.last().map(|g| g.0), Some(299));
    assert!(got.windows(2).all(|w| w[1].0 == w[0].0 + 1));
    server.shutdown().await;
}

#[tokio::test]
async fn conditional_cache_writes_over_quic() {
    use felix_proto::message::CacheCondition;
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    let (applied, v1) =
        c.cache_put_if("default", "c", "lock", Bytes::from("me"), None, CacheCondition::Absent).await.unwrap();
    assert!(applied);
    let (again, current) =
        c.cache_put_if("default", "c", "lock", Bytes::from("you"), None, CacheCondition::Absent).await.unwrap();
    assert_eq!((again, current), (false, v1));
    assert_eq!(c.cache_get_versioned("default", "c", "lock").await.unwrap(), (Some(Bytes::from("me")), v1));
    assert_eq!(c.cache_delete_if("default", "c", "lock", v1.unwrap()).await.unwrap(), (true, None));
    server.shutdown().await;
}

#[tokio::test]
async fn history_reads_and_time_lookup_over_quic_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let small = || {
        let mut b = BrokerConfig::default();
        b.default_stream.memory_bytes = 2_000;
        b.max_records_per_read = 64;
        b
    };
    {
        let (server, chain) = start_with(Some(dir.path()), small()).await;
        let c = connect(&server, &chain).await;
        for i in 0..200 {
            let p = Bytes::from(format!("{i:04}{}", "z".repeat(60)));
            c.publish("default", "h", vec![p], PublishOptions { ack: true, ..Default::default() }).await.unwrap();
        }
        server.shutdown().await;
    }
    let (server, chain) = start_with(Some(dir.path()), small()).await;
    let c = connect(&server, &chain).await;
    // Page through everything: the old part comes from disk, the rest from memory.
    let mut all = Vec::new();
    let mut from = 0;
    loop {
        let page = c.stream_read("default", "h", 0, from, None, None).await.unwrap();
        assert!(page.records.len() <= 64, "the broker's cap holds");
        if page.records.is_empty() {
            assert_eq!(page.next_offset, from);
            break;
        }
        all.extend(page.records);
        from = page.next_offset;
    }
    assert_eq!(all.iter().map(|r| r.offset).collect::<Vec<_>>(), (0..200).collect::<Vec<_>>());
    assert!(all[150].payload.0.starts_with(b"0150"));
    assert!(all.windows(2).all(|w| w[0].timestamp_micros <= w[1].timestamp_micros), "append times recovered");
    // The first record appended at or after record 150's time.
    let at = all[150].timestamp_micros;
    let o = c.offset_for_time("default", "h", 0, at).await.unwrap().expect("a record that recent") as usize;
    assert!(o <= 150 && all[o].timestamp_micros >= at && (o == 0 || all[o - 1].timestamp_micros < at));
    assert_eq!(c.offset_for_time("default", "h", 0, u64::MAX).await.unwrap(), None);
    // Outside the retained range: a typed cursor error naming what is available.
    match c.stream_read("default", "h", 0, 500, None, None).await {
        Err(ClientError::Cursor(e)) => assert_eq!(e.available, 200),
        other => panic!("expected a cursor error, got {other:?}"),
    }
    // The connection is still in order after the refusal.
    assert_eq!(c.stream_read("default", "h", 0, 199, None, None).await.unwrap().records.len(), 1);
    server.shutdown().await;
}

#[tokio::test]
async fn counters_over_quic_survive_a_restart_and_need_storage() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (server, chain) = start(Some(dir.path())).await;
        let c = connect(&server, &chain).await;
        assert_eq!(c.counter_get("default", "stats", "views").await.unwrap(), None, "never written ≠ 0");
        let mut last = 0;
        for i in 1..=50 {
            last = c.counter_add("default", "stats", "views", i).await.unwrap();
        }
        assert_eq!(last, 1275);
        assert_eq!(c.counter_add("default", "stats", "views", -275).await.unwrap(), 1000);
        server.shutdown().await;
    }
    let (server, chain) = start(Some(dir.path())).await;
    let c = connect(&server, &chain).await;
    assert_eq!(c.counter_get("default", "stats", "views").await.unwrap(), Some(1000));
    server.shutdown().await;
    // A broker without storage does not offer counters: the client says so without asking.
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    assert!(matches!(c.counter_add("default", "stats", "views", 1).await, Err(ClientError::Unsupported(_))));
    server.shutdown().await;
}

/// Retention compacts a stream holding commit state: the driver writes the state checkpoint
/// beside the shard, a restart serves the state from it, and a damaged one stops the start
/// with an error naming the file (never a state silently missing values).
#[tokio::test]
async fn retention_checkpoints_commit_state_and_a_damaged_checkpoint_stops_the_start() {
    use felix_proto::client::CommitRequest;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = BrokerConfig::default();
    cfg.default_stream.retention.max_records = Some(2);
    let key = Bytes::from_static(b"account-7");
    let req = |i: u64| CommitRequest {
        namespace: "default".into(),
        stream: "accounts".into(),
        entity_key: key.clone(),
        event: Bytes::from(format!("event-{i}")),
        changes: vec![(format!("k{i}"), Some(Bytes::from(i.to_string())))],
        expected_offset: None,
    };
    {
        let (server, chain) = start_with(Some(dir.path()), cfg.clone()).await;
        let c = connect(&server, &chain).await;
        for i in 0..5 {
            assert_eq!(c.commit(req(i)).await.unwrap(), i);
        }
        server.shutdown().await;
    }
    // Three more records, each in a segment of its own (written through the storage layer:
    // a broker's segments are 64 MiB), so that retention has whole segments to delete.
    {
        let mut disk = felix_driver_tokio::storage::DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
        disk.recover().unwrap();
        disk.set_segment_bytes(1);
        let plain = |i: u64| felix_proto::storage::PersistRequest {
            key: None,
            token: felix_proto::transport::WriteToken(i),
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "accounts".into(),
            shard: 0,
            base_offset: i,
            records: felix_proto::Records::from_payloads([b"plain".as_slice()]).unwrap(),
            timestamp_micros: 1,
            publisher: None,
            generation_start: false,
            producer: None,
            state: None,
            fsync: None,
            stream_shards: 1,
        };
        disk.write((5..8).map(plain).collect());
    }
    let segments = |dir: &Path| walk(dir).into_iter().filter(|p| p.extension().is_some_and(|e| e == "seg")).count();
    assert_eq!(segments(dir.path()), 4);
    // The restart applies retention to what it recovered (two records kept): the segments
    // holding every commit go, the state checkpointed first.
    let (server, chain) = start_with(Some(dir.path()), cfg.clone()).await;
    let c = connect(&server, &chain).await;
    assert_eq!(
        c.state_get("default", "accounts", key.clone(), "k0").await.unwrap(),
        (Some(Bytes::from_static(b"0")), Some(0))
    );
    server.shutdown().await;
    assert_eq!(segments(dir.path()), 2, "the commits' segments were deleted");
    let checkpoints: Vec<std::path::PathBuf> =
        walk(dir.path()).into_iter().filter(|p| p.ends_with("state.checkpoint")).collect();
    assert_eq!(checkpoints.len(), 1, "one shard holds state: {checkpoints:?}");
    let (server, chain) = start_with(Some(dir.path()), cfg.clone()).await;
    let c = connect(&server, &chain).await;
    for i in [0u64, 4] {
        assert_eq!(
            c.state_get("default", "accounts", key.clone(), &format!("k{i}")).await.unwrap(),
            (Some(Bytes::from(i.to_string())), Some(i))
        );
    }
    server.shutdown().await;
    let mut damaged = std::fs::read(&checkpoints[0]).unwrap();
    damaged[12] ^= 1;
    std::fs::write(&checkpoints[0], damaged).unwrap();
    let (opts, _) = options("127.0.0.1:0".parse().unwrap(), Some(dir.path()), cfg, TransportTuning::default());
    let Err(e) = Server::start(opts).await else { panic!("a damaged checkpoint stops the start") };
    let e = e.to_string();
    assert!(e.contains("state.checkpoint") && e.contains("move it aside"), "{e}");
}

/// A long run (ignored in CI; `cargo test --release -p felix-driver-tokio --test quic --
/// --ignored commit_state_stream`): 4 KiB commits far past the retention limit. Before the
/// state checkpoint such a stream was exempt from retention and its disk grew with every
/// commit; now it stays within retention plus the open segment, and a restart reads the
/// checkpoint and the commits after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore]
async fn a_commit_state_stream_stays_within_retention_on_disk() {
    use felix_proto::client::CommitRequest;
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = BrokerConfig::default();
    cfg.default_stream.retention.max_records = None;
    cfg.default_stream.retention.max_bytes = Some(32 << 20);
    let key = Bytes::from_static(b"account-7");
    let commits: u64 = std::env::var("FELIX_COMMITS").ok().and_then(|v| v.parse().ok()).unwrap_or(60_000);
    // Distinct keys the commits write (FELIX_STATE_KEYS, default 1,000): the state's size.
    let keys: u64 = std::env::var("FELIX_STATE_KEYS").ok().and_then(|v| v.parse().ok()).unwrap_or(1_000);
    let event = Bytes::from(vec![b'e'; 4096]);
    let (server, chain) = start_with(Some(dir.path()), cfg.clone()).await;
    let c = connect(&server, &chain).await;
    let started = std::time::Instant::now();
    let mut sent = 0u64;
    while sent < commits {
        let mut set = tokio::task::JoinSet::new();
        for i in sent..(sent + 64).min(commits) {
            let (c, key, event) = (c.clone(), key.clone(), event.clone());
            set.spawn(async move {
                let req = CommitRequest {
                    namespace: "default".into(),
                    stream: "accounts".into(),
                    entity_key: key,
                    event,
                    changes: vec![(format!("k{}", i % keys), Some(Bytes::from(i.to_string())))],
                    expected_offset: None,
                };
                c.commit(req).await.unwrap()
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        sent = (sent + 64).min(commits);
    }
    let took = started.elapsed();
    let (v, version) = c.state_get("default", "accounts", key.clone(), "k0").await.unwrap();
    server.shutdown().await;
    let bytes = |dir: &Path| walk(dir).iter().filter_map(|p| std::fs::metadata(p).ok()).map(|m| m.len()).sum::<u64>();
    let on_disk = bytes(dir.path());
    eprintln!(
        "{commits} commits of 4 KiB in {:.1} s ({:.0}/s): {} MiB written, {} MiB on disk",
        took.as_secs_f64(),
        commits as f64 / took.as_secs_f64(),
        (commits * 4096) >> 20,
        on_disk >> 20
    );
    // A restart applies retention to what it recovered (the last second's sweep may not have
    // run): then the stream holds what retention keeps plus the open segment.
    let restarted = std::time::Instant::now();
    let (server, chain) = start_with(Some(dir.path()), cfg).await;
    let c = connect(&server, &chain).await;
    eprintln!("restart and first connection: {:.2} s", restarted.elapsed().as_secs_f64());
    assert_eq!(c.state_get("default", "accounts", key.clone(), "k0").await.unwrap(), (v.clone(), version));
    let last = (commits - 1) / keys * keys;
    assert_eq!(v, Some(Bytes::from(last.to_string())));
    server.shutdown().await;
    let on_disk = bytes(dir.path());
    eprintln!("after the restart: {} MiB on disk", on_disk >> 20);
    assert!(on_disk < (32 + 64 + 16) << 20, "retention (32 MiB) + the open segment (64 MiB): {on_disk}");
}

#[tokio::test]
async fn commits_over_quic_write_event_and_state_together_and_survive_a_restart() {
    use felix_proto::client::CommitRequest;
    let dir = tempfile::tempdir().unwrap();
    let key = Bytes::from_static(b"account-7");
    let req = |event: &'static [u8], changes: Vec<(String, Option<Bytes>)>, expected_offset| CommitRequest {
        namespace: "default".into(),
        stream: "accounts".into(),
        entity_key: key.clone(),
        event: Bytes::from_static(event),
        changes,
        expected_offset,
    };
    {
        let (server, chain) = start(Some(dir.path())).await;
        let c = connect(&server, &chain).await;
        let put = |v: &'static [u8]| vec![("balance".to_string(), Some(Bytes::from_static(v)))];
        assert_eq!(c.commit(req(b"opened", put(b"10"), None)).await.unwrap(), 0);
        assert_eq!(c.commit(req(b"deposit", put(b"15"), Some(1))).await.unwrap(), 1);
        // A stale expectation writes nothing and says where the shard is.
        match c.commit(req(b"late", put(b"99"), Some(1))).await {
            Err(ClientError::PublishRefused {
                reason: felix_proto::message::RefusedReason::OffsetMismatch { tail },
                ..
            }) => {
                assert_eq!(tail, 2)
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            c.state_get("default", "accounts", key.clone(), "balance").await.unwrap(),
            (Some(Bytes::from_static(b"15")), Some(1))
        );
        // The events are records of the stream like any other.
        let page = c.stream_read("default", "accounts", 0, 0, None, None).await.unwrap();
        let events: Vec<Bytes> = page.records.iter().map(|r| r.payload.0.clone()).collect();
        assert_eq!(events, [&b"opened"[..], b"deposit"]);
        server.shutdown().await;
    }
    let (server, chain) = start(Some(dir.path())).await;
    let c = connect(&server, &chain).await;
    assert_eq!(
        c.state_get("default", "accounts", key.clone(), "balance").await.unwrap(),
        (Some(Bytes::from_static(b"15")), Some(1)),
        "state is rebuilt from the log"
    );
    assert_eq!(c.state_get("default", "accounts", key.clone(), "never").await.unwrap(), (None, None));
    server.shutdown().await;
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    assert!(matches!(c.commit(req(b"e", vec![], None)).await, Err(ClientError::Unsupported(_))));
    server.shutdown().await;
}

#[tokio::test]
async fn a_deleted_stream_ends_its_subscribers_and_stays_gone_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (server, chain) = start(Some(dir.path())).await;
        let c = connect(&server, &chain).await;
        c.publish(
            "default",
            "orders",
            vec![Bytes::from_static(b"a")],
            PublishOptions { ack: true, ..Default::default() },
        )
        .await
        .unwrap();
        let mut sub = c.subscribe("default", "orders", Some(StartPosition::Earliest), None).await.unwrap();
        assert!(matches!(sub.next().await, Some(SubscriptionItem::Events(_))));
        assert!(c.stream_delete("default", "orders").await.unwrap());
        // Our client offers FEATURE_STREAM_DELETED: the subscription says why it ended.
        loop {
            match sub.next().await {
                Some(SubscriptionItem::End(felix_proto::client::EndReason::Deleted)) => break,
                Some(SubscriptionItem::Events(_)) => continue,
                other => panic!("{other:?}"),
            }
        }
        assert!(!c.stream_delete("default", "orders").await.unwrap(), "already gone");
        server.shutdown().await;
    }
    let (server, chain) = start(Some(dir.path())).await;
    let c = connect(&server, &chain).await;
    let offset = c
        .publish(
            "default",
            "orders",
            vec![Bytes::from_static(b"b")],
            PublishOptions { ack: true, ..Default::default() },
        )
        .await
        .unwrap();
    assert_eq!(offset, Some(0), "a new stream of the same name");
    server.shutdown().await;
}

#[tokio::test]
async fn an_idempotent_producer_pipelines_up_to_its_window_and_appends_each_batch_once() {
    use felix_driver_tokio::IdempotentProducer;
    let dir = tempfile::tempdir().unwrap();
    let (server, chain) = start(Some(dir.path())).await;
    let opts = ClientOptions::new("t1", TOKEN, Trust::Certificates(chain.clone()));
    let mut p = IdempotentProducer::connect(server.local_addr(), opts, "default", "pipe").await.unwrap();
    // 300 batches submitted without waiting: at most 64 are ever unanswered.
    for i in 0..300 {
        p.submit(vec![Bytes::from(format!("p{i}"))], None).await.unwrap();
        assert!(p.unanswered() <= 64, "{} unanswered", p.unanswered());
    }
    let done = p.flush().await.unwrap();
    let offsets: Vec<Option<u64>> = done.iter().map(|(_, _, o)| *o).collect();
    assert_eq!(offsets, (0..300).map(Some).collect::<Vec<_>>(), "each batch once, in order");
    let c = connect(&server, &chain).await;
    let page = c.stream_read("default", "pipe", 0, 0, None, Some(1000)).await.unwrap();
    assert_eq!(page.records.len(), 300);
    server.shutdown().await;
}

#[tokio::test]
async fn an_idempotent_producer_appends_exactly_once_across_a_broker_restart() {
    use felix_driver_tokio::IdempotentProducer;
    let dir = tempfile::tempdir().unwrap();
    let (server, chain) = start(Some(dir.path())).await;
    let addr = server.local_addr();
    // The restarted test broker generates a new certificate: trust any for this test.
    let _ = chain;
    let opts = ClientOptions::new("t1", TOKEN, Trust::DangerAcceptAnyCertificate);
    let mut p = IdempotentProducer::connect(addr, opts.clone(), "default", "idem").await.unwrap();
    let mut offsets = Vec::new();
    for i in 0..10 {
        offsets.push(p.send(vec![Bytes::from(format!("b{i}"))], None).await.unwrap());
    }
    server.shutdown().await;
    let (server, _) = start_at(addr, Some(dir.path()), BrokerConfig::default()).await;
    // The connection is gone: the producer reconnects and resends under the same sequence.
    for i in 10..15 {
        offsets.push(p.send(vec![Bytes::from(format!("b{i}"))], None).await.unwrap());
    }
    assert!(p.reconnects() >= 1);
    assert_eq!(offsets, (0..15).map(Some).collect::<Vec<_>>(), "every batch once, in order");
    // A batch whose answer was lost, sent again: the original offset, nothing appended.
    let c = Client::connect(addr, opts).await.unwrap();
    let dup = c.publish_idempotent("default", "idem", vec![Bytes::from("b7")], None, p.producer_id(), 7).await;
    assert_eq!(dup.unwrap(), Some(7));
    let gap = c.publish_idempotent("default", "idem", vec![Bytes::from("x")], None, p.producer_id(), 99).await;
    assert!(matches!(gap, Err(ClientError::PublishRefused { .. })), "{gap:?}");
    let page = c.stream_read("default", "idem", 0, 0, None, None).await.unwrap();
    assert_eq!(page.records.len(), 15);
    // Conditional publish: the tail is 15.
    assert_eq!(c.publish_if("default", "idem", vec![Bytes::from("c")], None, 15).await.unwrap(), Some(15));
    match c.publish_if("default", "idem", vec![Bytes::from("d")], None, 15).await {
        Err(ClientError::PublishRefused {
            reason: felix_proto::message::RefusedReason::OffsetMismatch { tail },
            ..
        }) => {
            assert_eq!(tail, 16)
        }
        other => panic!("{other:?}"),
    }
    server.shutdown().await;
}

#[tokio::test]
async fn consumer_groups_over_quic() {
    use felix_driver_tokio::{GroupTarget, PollOptions};
    let dir = tempfile::tempdir().unwrap();
    let g = GroupTarget::new("default", "work", "billing");
    {
        // Acks after the write, so what was published is committed (and pollable) at once.
        let (server, chain) =
            start_with(Some(dir.path()), BrokerConfig { ack_on_commit: true, ..Default::default() }).await;
        let c = connect(&server, &chain).await;
        for i in 0..6 {
            let p = PublishOptions { ack: true, ..Default::default() };
            c.publish("default", "work", vec![Bytes::from(format!("job{i}"))], p).await.unwrap();
        }
        let got = c.group_poll(&g, 4, PollOptions::default()).await.unwrap();
        assert_eq!(got.iter().map(|r| r.offset).collect::<Vec<_>>(), [0, 1, 2, 3]);
        assert_eq!(got[0].payload.0, Bytes::from("job0"));
        assert_eq!(got[0].attempts, 1);
        assert_eq!(got[0].publisher.as_deref(), Some("dev"), "our client reads the publisher");
        for r in &got[..3] {
            c.group_ack(&g, r.offset).await.unwrap();
        }
        c.group_nack(&g, 3, None, Some(1)).await.unwrap();
        c.group_dead_letter(&g, 4).await.unwrap();
        assert_eq!(c.group_dead_letters(&g).await.unwrap(), [4]);
        // A long poll on the group waits on its own stream: acks and publishes go on meanwhile.
        let again = c.group_poll(&g, 10, PollOptions::default()).await.unwrap();
        assert_eq!(again.iter().map(|r| (r.offset, r.attempts)).collect::<Vec<_>>(), [(3, 2), (5, 1)]);
        let waiter = {
            let c = c.clone();
            let g = g.clone();
            tokio::spawn(async move {
                c.group_poll(&g, 10, PollOptions { wait: Duration::from_secs(10), ..Default::default() }).await
            })
        };
        c.group_ack(&g, 3).await.unwrap();
        c.group_ack(&g, 5).await.unwrap();
        let p = PublishOptions { ack: true, ..Default::default() };
        c.publish("default", "work", vec![Bytes::from("late")], p).await.unwrap();
        let late = tokio::time::timeout(Duration::from_secs(5), waiter).await.unwrap().unwrap().unwrap();
        assert_eq!(late.iter().map(|r| r.offset).collect::<Vec<_>>(), [6]);
        let info = c.group_describe(&g).await.unwrap();
        assert_eq!((info.committed, info.tail, info.in_flight, info.dead_letters), (Some(6), 7, 1, 1));
        server.shutdown().await;
    }
    // After a restart: the position and dead letters are kept; the unacked record comes back.
    let (server, chain) = start(Some(dir.path())).await;
    let c = connect(&server, &chain).await;
    let got = c.group_poll(&g, 10, PollOptions::default()).await.unwrap();
    assert_eq!(got.iter().map(|r| r.offset).collect::<Vec<_>>(), [6]);
    assert_eq!(c.group_dead_letters(&g).await.unwrap(), [4]);
    assert_eq!(c.group_seek(&g, StartPosition::Earliest, false).await.unwrap(), (0, true));
    assert!(c.group_delete(&g).await.unwrap());
    server.shutdown().await;
}

#[tokio::test]
async fn cache_watches_over_quic() {
    use felix_proto::client::WatchOn;
    let (server, chain) = start(None).await;
    let c = connect(&server, &chain).await;
    c.cache_put("default", "sessions", "user:1", Bytes::from("a"), None).await.unwrap();
    let mut w = c.cache_watch("default", "sessions", WatchOn::Prefix("user:".into()), None, true).await.unwrap();
    assert_eq!(w.retained_count, Some(1));
    c.cache_put("default", "sessions", "user:2", Bytes::from("b"), Some(60_000)).await.unwrap();
    c.cache_put("default", "sessions", "other", Bytes::from("x"), None).await.unwrap();
    c.cache_delete("default", "sessions", "user:1").await.unwrap();
    let mut got = Vec::new();
    while got.len() < 3 {
        match tokio::time::timeout(Duration::from_secs(5), w.next()).await.expect("changes arrive") {
            Some(SubscriptionItem::CacheChange(e)) => got.push((e.key, e.value.map(|v| v.0), e.expires_at_millis > 0)),
            other => panic!("{other:?}"),
        }
    }
    assert_eq!(
        got,
        [
            ("user:1".into(), Some(Bytes::from("a")), false),
            ("user:2".into(), Some(Bytes::from("b")), true),
            ("user:1".into(), None, false),
        ]
    );
    match c.cache_watch("default", "sessions", WatchOn::Key("k".into()), Some(u64::MAX), false).await {
        Err(ClientError::Cursor(e)) => assert_eq!(e.reason, felix_proto::message::CursorErrorReason::InFuture),
        other => panic!("{other:?}"),
    }
    server.shutdown().await;
}

#[tokio::test]
async fn a_corrupted_byte_is_detected_reported_and_the_rest_served() {
    let dir = tempfile::tempdir().unwrap();
    {
        let (server, chain) = start(Some(dir.path())).await;
        let c = connect(&server, &chain).await;
        for i in 0..10 {
            let p = Bytes::from(format!("batch-{i}-{}", "q".repeat(50)));
            c.publish("default", "bits", vec![p], PublishOptions { ack: true, ..Default::default() }).await.unwrap();
        }
        server.shutdown().await;
    }
    // Flip one bit inside the payload of the fifth batch.
    let seg = walk(dir.path()).into_iter().find(|p| p.extension().is_some_and(|e| e == "seg")).unwrap();
    let mut bytes = std::fs::read(&seg).unwrap();
    let at = bytes.windows(7).position(|w| w == b"batch-4").unwrap() + 10;
    bytes[at] ^= 0x01;
    std::fs::write(&seg, &bytes).unwrap();
    let (server, chain) = start(Some(dir.path())).await;
    assert!(server.repairs.iter().any(|r| r.contains("checksum") && r.contains("skipped")), "{:?}", server.repairs);
    let c = connect(&server, &chain).await;
    let page = c.stream_read("default", "bits", 0, 0, None, None).await.unwrap();
    let offsets: Vec<u64> = page.records.iter().map(|r| r.offset).collect();
    assert_eq!(offsets, [0, 1, 2, 3, 5, 6, 7, 8, 9], "everything but the damaged batch");
    // Writing goes on after the damage.
    let p = PublishOptions { ack: true, ..Default::default() };
    c.publish("default", "bits", vec![Bytes::from("more")], p).await.unwrap();
    server.shutdown().await;
}
