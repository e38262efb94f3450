//! The workload's clients, each recording what it asked and what it was told into the history:
//! publishers (plain, idempotent, conditional), jobs and commits, a consumer group, a
//! subscriber, cache clients.

use super::*;

/// An acknowledged publisher lane (odd lanes keyed), paced a little: a record refused before
/// it was written is sent again; one whose outcome is unknown is noted (never resent).
pub(super) async fn publisher(cc: Arc<ClusterClient>, lane: usize, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let p = format!("p{lane}-{n}");
        n += 1;
        let key = (lane % 2 == 1).then(|| Bytes::from(format!("key-{}", n % 7)));
        loop {
            let o = PublishOptions { ack: true, key: key.clone(), ..PublishOptions::default() };
            match cc.publish("default", STREAM, vec![Bytes::from(p.clone())], o).await {
                Ok(offset) => {
                    let mut h = h.lock().unwrap();
                    h.acked.push((p, offset));
                    h.ack_times.push(Instant::now());
                }
                Err(e) if refused(&e) && !stop.load(Ordering::Relaxed) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Err(_) => {
                    h.lock().unwrap().unknown.insert(p);
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// An idempotent producer: each record sent until appended (exactly once); a producer that
/// gives up leaves its record unknown and a new one (a new producer id) goes on.
pub(super) async fn idempotent(brokers: Vec<SocketAddr>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
    let mut n = 0u64;
    let mut producer: Option<IdempotentProducer> = None;
    while !stop.load(Ordering::Relaxed) {
        if producer.is_none() {
            let at = brokers[n as usize % brokers.len()];
            match IdempotentProducer::connect(at, opts(), "default", STREAM).await {
                Ok(mut p) => {
                    p.set_seeds(brokers.clone());
                    producer = Some(p);
                }
                Err(_) => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    n += 1;
                    continue;
                }
            }
        }
        let Some(p) = producer.as_mut() else { continue };
        let r = format!("idem-{n}");
        n += 1;
        match p.send(vec![Bytes::from(r.clone())], None).await {
            Ok(offset) => {
                let mut h = h.lock().unwrap();
                h.acked.push((r, offset));
                h.ack_times.push(Instant::now());
            }
            Err(_) => {
                h.lock().unwrap().unknown.insert(r);
                producer = None;
            }
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// A conditional writer (`publish_if`): each record names the offset it must land at (the tail
/// it last learnt); a mismatch tells the tail and the record is sent again there.
pub(super) async fn conditional(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
    use felix_proto::message::RefusedReason;
    let mut expected = 0u64;
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let r = format!("cond-{n}");
        n += 1;
        loop {
            let at = expected;
            let p = Bytes::from(r.clone());
            let res = cc
                .owner_only("default", COND, 0, |c| {
                    let p = p.clone();
                    async move { c.publish_if("default", COND, vec![p], None, at).await }
                })
                .await;
            match res {
                Ok(offset) => {
                    let mut h = h.lock().unwrap();
                    if offset != Some(at) {
                        h.cond_misplaced.push(format!("{r}: asked {at}, acknowledged at {offset:?}"));
                    }
                    h.cond_acked.push((r, offset));
                    expected = at + 1;
                }
                Err(ClientError::PublishRefused { reason: RefusedReason::OffsetMismatch { tail }, .. }) => {
                    expected = tail;
                    continue;
                }
                // Refused with another typed reason (a `not_leader` in the refusal): nothing
                // was written either.
                Err(e)
                    if (refused(&e) || matches!(e, ClientError::PublishRefused { .. }))
                        && !stop.load(Ordering::Relaxed) =>
                {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Err(e) => {
                    if std::env::var_os("FELIX_FAULT_DEBUG").is_some() {
                        eprintln!("conditional {r}: unknown: {e}");
                    }
                    h.lock().unwrap().cond_unknown.insert(r);
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// The jobs' producer: acknowledged publishes, a record refused before it was written sent
/// again, one whose outcome is unknown noted.
pub(super) async fn jobs(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let p = format!("job-{n}");
        n += 1;
        loop {
            let o = PublishOptions { ack: true, ..PublishOptions::default() };
            match cc.publish("default", JOBS, vec![Bytes::from(p.clone())], o).await {
                Ok(offset) => h.lock().unwrap().jobs_acked.push((p, offset)),
                Err(e) if refused(&e) && !stop.load(Ordering::Relaxed) => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Err(_) => {
                    h.lock().unwrap().jobs_unknown.insert(p);
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(15)).await;
    }
}

/// The committer: each commit writes an event and sets the one key to that event, together;
/// refused before it was written, it is sent again; an unknown outcome is noted.
pub(super) async fn committer(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let ev = format!("commit-{n}");
        n += 1;
        loop {
            let req = felix_proto::client::CommitRequest {
                namespace: "default".into(),
                stream: ACCOUNTS.into(),
                entity_key: Bytes::from_static(b"acct"),
                event: Bytes::from(ev.clone()),
                changes: vec![("balance".into(), Some(Bytes::from(ev.clone())))],
                expected_offset: None,
            };
            let res = cc
                .owner_only("default", ACCOUNTS, 0, |c| {
                    let req = req.clone();
                    async move { c.commit(req).await }
                })
                .await;
            match res {
                Ok(offset) => h.lock().unwrap().commits_acked.push((ev, Some(offset))),
                Err(e) if refused(&e) && !stop.load(Ordering::Relaxed) => {
                    if std::env::var_os("FELIX_FAULT_DEBUG").is_some() {
                        eprintln!("commit {ev}: sent again after {e:?}");
                    }
                    tokio::time::sleep(Duration::from_millis(20)).await;
                    continue;
                }
                Err(_) => {
                    h.lock().unwrap().commits_unknown.insert(ev);
                }
            }
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The committed state's one key read back: its value and the offset of the commit that
/// wrote it.
pub(super) fn read_state(brokers: &[SocketAddr]) -> (Option<String>, Option<u64>) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(brokers, opts()).await.expect("the state reader connects");
        let until = Instant::now() + Duration::from_secs(60);
        let got = loop {
            let r = cc
                .owner_only("default", ACCOUNTS, 0, |c| async move {
                    c.state_get("default", ACCOUNTS, Bytes::from_static(b"acct"), "balance").await
                })
                .await;
            match r {
                Ok((v, version)) => break (v.map(|v| String::from_utf8_lossy(&v).into_owned()), version),
                Err(e) => {
                    assert!(Instant::now() < until, "the state is not readable: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        };
        cc.close().await;
        got
    })
}

/// Whether a settlement's error says it was not carried out: refused with a class other than
/// outcome unknown (`stale_claim` for a job its leader did not hand out, `shard_unavailable`),
/// redirected, or never sent.
fn not_settled(e: &ClientError) -> bool {
    match e {
        ClientError::Refused(i) => i.retry.is_some() && i.retry != Some(RetryClass::OutcomeUnknown),
        e => refused(e),
    }
}

/// The consumer group's member: polls the jobs' leader, acks what it is handed (one first
/// delivery in ten left to lapse and come back), until stopped.
pub(super) async fn consumer(cc: Arc<ClusterClient>, t0: Instant, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
    let g = GroupTarget::new("default", JOBS, GROUP);
    let mut rng = Rng(0x5DEE_CE66_D1CE_4E5B);
    while !stop.load(Ordering::Relaxed) {
        consume_round(&cc, &g, t0, &h, Some(&mut rng)).await;
    }
}

/// One poll and the settlement of what it handed out, each recorded with when the poll was
/// sent and when each ack came back; `skip` leaves a first delivery unacknowledged now and
/// then. How many it was handed (`None`: the poll failed).
async fn consume_round(
    cc: &ClusterClient,
    g: &GroupTarget,
    t0: Instant,
    h: &Mutex<History>,
    mut skip: Option<&mut Rng>,
) -> Option<usize> {
    let opts = PollOptions { wait: Duration::from_millis(300), visibility: VISIBILITY, ..PollOptions::default() };
    let polled = elapsed(t0);
    let poll = cc.owner_only("default", JOBS, 0, |c| {
        let (g, o) = (g.clone(), opts.clone());
        async move { c.group_poll(&g, 20, o).await }
    });
    let records = match tokio::time::timeout(Duration::from_secs(10), poll).await {
        Ok(Ok(records)) => records,
        _ => {
            h.lock().unwrap().polls_failed += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
            return None;
        }
    };
    {
        let mut h = h.lock().unwrap();
        for r in &records {
            h.group.delivered.push((r.offset, String::from_utf8_lossy(&r.payload.0).into_owned(), polled));
        }
    }
    for r in &records {
        if r.attempts <= 1 && skip.as_mut().is_some_and(|rng| rng.below(10) == 0) {
            continue;
        }
        let ack = cc.owner_only("default", JOBS, 0, |c| {
            let g = g.clone();
            async move { c.group_ack(&g, r.offset).await }
        });
        let res = tokio::time::timeout(Duration::from_secs(10), ack).await;
        let answered = elapsed(t0);
        let mut h = h.lock().unwrap();
        match res {
            Ok(Ok(())) => h.group.acked.push((r.offset, answered)),
            Ok(Err(e)) if not_settled(&e) => {}
            _ => {
                h.group.ack_unknown.insert(r.offset);
            }
        }
    }
    Some(records.len())
}

/// After the workload: the group worked to the end (every claim left lapses and comes back),
/// and its dead letters (jobs whose claim lapsed five times) read. Returns those.
pub(super) fn drain_group(brokers: &[SocketAddr], t0: Instant, h: &Mutex<History>) -> BTreeSet<u64> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(brokers, opts()).await.expect("the drain connects");
        let g = GroupTarget::new("default", JOBS, GROUP);
        let until = Instant::now() + Duration::from_secs(120);
        // Empty polls for longer than a claim lasts: nothing is left to come back.
        let mut quiet_since = Instant::now();
        while quiet_since.elapsed() < VISIBILITY + Duration::from_secs(1) {
            assert!(Instant::now() < until, "the group does not drain");
            if consume_round(&cc, &g, t0, h, None).await != Some(0) {
                quiet_since = Instant::now();
            }
        }
        let dead = loop {
            let list = cc.owner_only("default", JOBS, 0, |c| {
                let g = g.clone();
                async move { c.group_dead_letters(&g).await }
            });
            match list.await {
                Ok(d) => break d,
                Err(e) => {
                    assert!(Instant::now() < until, "the dead letters are not readable: {e}");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
            }
        };
        cc.close().await;
        dead.into_iter().collect()
    })
}

/// A subscriber following the stream from its start, wherever it is served.
pub(super) async fn subscriber(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
    let mut f = loop {
        match cc.follow("default", STREAM, 0, Some(StartPosition::Earliest)).await {
            Ok(f) => break f,
            Err(_) if !stop.load(Ordering::Relaxed) => tokio::time::sleep(Duration::from_millis(100)).await,
            Err(_) => return,
        }
    };
    while !stop.load(Ordering::Relaxed) {
        let batch = tokio::select! {
            b = f.next() => b,
            () = tokio::time::sleep(Duration::from_millis(200)) => continue,
        };
        let Ok(batch) = batch else { panic!("the subscriber gave up: {:?}", batch.err()) };
        let Some(base) = batch.base_offset else { panic!("a batch without offsets") };
        let mut h = h.lock().unwrap();
        for (i, p) in batch.records.payloads().enumerate() {
            h.seen.push((base + i as u64, String::from_utf8_lossy(&p).into_owned()));
        }
    }
}

/// One cache client, on one broker throughout (it forwards to the cache's leader, or answers
/// itself if it thinks it leads): reads, puts, conditional puts and deletes on this episode's
/// keys, each with when it was sent and what came back.
pub(super) async fn cache_client(
    me: usize,
    addr: SocketAddr,
    t0: Instant,
    stop: Arc<AtomicBool>,
    episode: Arc<AtomicU64>,
    h: Arc<Mutex<History>>,
) {
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ (me as u64 + 1));
    let mut client: Option<Client> = None;
    // The last version this client saw of each key.
    let mut versions: BTreeMap<String, u64> = BTreeMap::new();
    let mut n = 0u64;
    while !stop.load(Ordering::Relaxed) {
        let Some(c) = client.as_ref() else {
            match tokio::time::timeout(Duration::from_secs(2), Client::connect(addr, opts())).await {
                Ok(Ok(c)) => client = Some(c),
                _ => tokio::time::sleep(Duration::from_millis(100)).await,
            }
            continue;
        };
        let ep = episode.load(Ordering::Relaxed);
        let key = format!("e{ep}-k{}", rng.below(KEYS as u64));
        n += 1;
        let value = format!("c{me}-{n}");
        let call = match rng.below(20) {
            0..=7 => CacheCall::Get,
            8..=12 => CacheCall::Put(value.clone()),
            13..=15 => CacheCall::PutIfAbsent(value.clone()),
            16..=18 => CacheCall::PutIfVersion(value.clone(), versions.get(&key).copied().unwrap_or(1)),
            _ => CacheCall::Delete,
        };
        let invoked = elapsed(t0);
        let b = |v: &str| Bytes::from(v.to_owned());
        let text = |v: Option<Bytes>| v.map(|v| String::from_utf8_lossy(&v).into_owned());
        let answer = tokio::time::timeout(Duration::from_secs(15), async {
            match &call {
                CacheCall::Get => c
                    .cache_get_versioned("default", CACHE, &key)
                    .await
                    .map(|(v, ver)| CacheReturn::Value(text(v).map(|v| (v, ver)))),
                CacheCall::Put(v) => c.cache_put("default", CACHE, &key, b(v), None).await.map(|()| CacheReturn::Done),
                CacheCall::PutIfAbsent(v) => c
                    .cache_put_if("default", CACHE, &key, b(v), None, CacheCondition::Absent)
                    .await
                    .map(|(a, ver)| CacheReturn::Condition(a, ver)),
                CacheCall::PutIfVersion(v, want) => c
                    .cache_put_if("default", CACHE, &key, b(v), None, CacheCondition::Version(*want))
                    .await
                    .map(|(a, ver)| CacheReturn::Condition(a, ver)),
                CacheCall::Delete => {
                    c.cache_delete("default", CACHE, &key).await.map(|v| CacheReturn::Removed(text(v)))
                }
            }
        })
        .await;
        let answered = elapsed(t0);
        {
            let mut h = h.lock().unwrap();
            let record = |h: &mut History, answered| {
                h.cache.entry(key.clone()).or_default().push(CacheOp {
                    client: me,
                    invoked,
                    answered,
                    call: call.clone(),
                })
            };
            match answer {
                Ok(Ok(ret)) => {
                    if let CacheReturn::Value(Some((_, Some(v)))) | CacheReturn::Condition(_, Some(v)) = &ret {
                        versions.insert(key.clone(), *v);
                    }
                    h.cache_answered += 1;
                    record(&mut h, Some((answered, ret)));
                }
                // Refused before it took effect (or a read that failed): it did nothing.
                Ok(Err(e)) if refused(&e) || call == CacheCall::Get => {
                    h.cache_refused += 1;
                    if !matches!(e, ClientError::Refused(_) | ClientError::NotLeader { .. }) {
                        client = None;
                    }
                }
                // Sent, no answer: it may have taken effect.
                Ok(Err(_)) | Err(_) => {
                    if call != CacheCall::Get {
                        record(&mut h, None);
                    }
                    client = None;
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
