//! A schedule of faults against three `felix-node serve` processes under a concurrent workload,
//! judged afterwards by an independent checker over what was recorded ([`common::history`]).
//!
//! The brokers' peer traffic goes through a fault network ([`FaultNet`]); clients reach the
//! brokers directly, so a partitioned leader is still asked by clients. Each episode applies
//! one fault for a few seconds and heals it: a partitioned leader, one-way loss from a leader,
//! lossy, duplicating, reordering links, a bridge, a paused leader (SIGSTOP), a killed leader
//! (SIGKILL, restarted), a power cut of one broker (what it wrote but had not synced is taken
//! back), a follower's replica log with a bit flipped while it is down, and a clock jump (the
//! leader restarts with its wall clock an hour behind or ten minutes ahead, then again with it
//! right: a broker reads the system clock only at start). The fault's target alternates between
//! the stream's leader and the cache's.
//!
//! The workload throughout: acknowledged publishes (plain and keyed lanes through the cluster
//! client, an idempotent producer), conditional appends (`publish_if`) to a second stream, a
//! subscriber following the stream, and one cache client per broker doing reads, puts,
//! conditional puts and deletes on keys of their own per episode; a third stream of jobs (an
//! acknowledged producer) worked through by a consumer group (polls, acks, one first delivery
//! in ten left to lapse and come back), drained to the end after the last episode; and a
//! committer writing an event and the state key it sets together (`commit`) to a fourth.
//!
//! Afterwards: every acknowledged record once, at the offset its acknowledgement gave, and on
//! every replica's disk; nothing unsent; the subscriber's sequence gap-free against the stream;
//! no two replicas with different committed entries at one index; every key's history
//! linearizable (a stale read fails it); the group never handed out a job after its ack came
//! back, nor something the stream does not hold, and settled every job by the end. The short schedule runs in CI; the long one
//! (`FELIX_CHAOS_EPISODES`, default 200) is ignored and run by hand.

use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::process::Command;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use felix_driver_tokio::{
    Client, ClientError, ClientOptions, ClusterClient, GroupTarget, IdempotentProducer, PollOptions, PublishOptions,
    Trust,
};
use felix_proto::RetryClass;
use felix_proto::message::{CacheCondition, StartPosition};

mod common;
use common::brokers::*;
use common::faultnet::{FaultNet, Link};
use common::history::{
    CacheCall, CacheOp, CacheReturn, GroupHistory, ReplicaLog, check_group, check_stream, check_subscriber, divergent,
    linearizable,
};
use common::{cluster_status as status, wait_for};

/// The kinds of fault, in the order a schedule goes through them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Fault {
    Partition,
    OneWayLoss,
    LossyLinks,
    Bridge,
    Pause,
    Kill,
    PowerCut,
    CorruptFollower,
    ClockJump,
}

const KINDS: [Fault; 9] = [
    Fault::Partition,
    Fault::OneWayLoss,
    Fault::LossyLinks,
    Fault::Bridge,
    Fault::Pause,
    Fault::Kill,
    Fault::PowerCut,
    Fault::CorruptFollower,
    Fault::ClockJump,
];

/// The stream and the cache the workload uses.
const STREAM: &str = "ledger";
/// The stream the conditional writer appends to (one writer: each append names the offset it
/// must land at).
const COND: &str = "cond";
const CACHE: &str = "sessions";
/// The stream of jobs and the consumer group working through it.
const JOBS: &str = "jobs";
const GROUP: &str = "workers";
/// The stream a committer writes events and state to together (`commit`): one key, whose
/// value is the event that wrote it.
const ACCOUNTS: &str = "accounts";
/// How long a job handed out stays claimed (one left unacknowledged comes back after it).
const VISIBILITY: Duration = Duration::from_secs(3);
/// Keys per episode.
const KEYS: usize = 3;

/// xorshift64*: the schedule replays for a seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        (self.0.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 33) % n.max(1)
    }
}

/// What the workload recorded.
#[derive(Default)]
struct History {
    /// Acknowledged publishes: the record and the offset its acknowledgement gave.
    acked: Vec<(String, Option<u64>)>,
    /// When each acknowledgement came.
    ack_times: Vec<Instant>,
    /// Published with an unknown outcome.
    unknown: BTreeSet<String>,
    /// What the subscriber saw: (offset, record).
    seen: Vec<(u64, String)>,
    /// The conditional writer's appends acknowledged (record, offset), those whose outcome is
    /// unknown, and any acknowledged at another offset than the one it named.
    cond_acked: Vec<(String, Option<u64>)>,
    cond_unknown: BTreeSet<String>,
    cond_misplaced: Vec<String>,
    /// Each key's cache operations.
    cache: BTreeMap<String, Vec<CacheOp>>,
    /// Cache operations answered, and refused before taking effect.
    cache_answered: u64,
    cache_refused: u64,
    /// The jobs acknowledged (record, offset) and those whose outcome is unknown.
    jobs_acked: Vec<(String, Option<u64>)>,
    jobs_unknown: BTreeSet<String>,
    /// What the consumer group handed out and settled.
    group: GroupHistory,
    /// Polls refused or failed.
    polls_failed: u64,
    /// Commits acknowledged (event, offset), and those whose outcome is unknown.
    commits_acked: Vec<(String, Option<u64>)>,
    commits_unknown: BTreeSet<String>,
}

struct Workload {
    stop: Arc<AtomicBool>,
    /// The episode whose keys the cache clients use.
    episode: Arc<AtomicU64>,
    history: Arc<Mutex<History>>,
    thread: std::thread::JoinHandle<()>,
}

fn opts() -> ClientOptions {
    ClientOptions::new("default", TOKEN, Trust::DangerAcceptAnyCertificate)
}

/// Whether a refusal or error says the operation did not take effect.
fn refused(e: &ClientError) -> bool {
    not_written(e)
}

fn elapsed(t0: Instant) -> u64 {
    t0.elapsed().as_nanos() as u64
}

impl Workload {
    fn start(brokers: Vec<SocketAddr>, t0: Instant) -> Workload {
        let stop = Arc::new(AtomicBool::new(false));
        let episode = Arc::new(AtomicU64::new(0));
        let history = Arc::new(Mutex::new(History::default()));
        let (s, e, h) = (stop.clone(), episode.clone(), history.clone());
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            rt.block_on(async move {
                let cc = Arc::new(ClusterClient::connect(&brokers, opts()).await.expect("the workload connects"));
                let mut tasks = Vec::new();
                for lane in 0..4 {
                    tasks.push(tokio::spawn(publisher(cc.clone(), lane, s.clone(), h.clone())));
                }
                tasks.push(tokio::spawn(idempotent(brokers.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(subscriber(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(conditional(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(jobs(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(committer(cc.clone(), s.clone(), h.clone())));
                tasks.push(tokio::spawn(consumer(cc.clone(), t0, s.clone(), h.clone())));
                for (i, addr) in brokers.iter().enumerate() {
                    tasks.push(tokio::spawn(cache_client(i, *addr, t0, s.clone(), e.clone(), h.clone())));
                }
                for t in tasks {
                    t.await.expect("a workload task");
                }
                cc.close().await;
            });
        });
        Workload { stop, episode, history, thread }
    }

    fn acks(&self) -> usize {
        self.history.lock().unwrap().acked.len()
    }

    fn finish(self) -> History {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.join().expect("the workload");
        Arc::try_unwrap(self.history).ok().expect("the workload's tasks ended").into_inner().unwrap()
    }
}

/// An acknowledged publisher lane (odd lanes keyed), paced a little: a record refused before
/// it was written is sent again; one whose outcome is unknown is noted (never resent).
async fn publisher(cc: Arc<ClusterClient>, lane: usize, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
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
async fn idempotent(brokers: Vec<SocketAddr>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
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
async fn conditional(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
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
async fn jobs(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
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
async fn committer(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
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
fn read_state(brokers: &[SocketAddr]) -> (Option<String>, Option<u64>) {
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
async fn consumer(cc: Arc<ClusterClient>, t0: Instant, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
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
fn drain_group(brokers: &[SocketAddr], t0: Instant, h: &Mutex<History>) -> BTreeSet<u64> {
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
async fn subscriber(cc: Arc<ClusterClient>, stop: Arc<AtomicBool>, h: Arc<Mutex<History>>) {
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
async fn cache_client(
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

/// What one episode measured.
struct Episode {
    kind: Fault,
    /// From the heal (restart, resume) to the next acknowledged publish.
    unavailable_after_heal: Duration,
    /// The longest stretch without an acknowledged publish, from the fault's start until the
    /// cluster settled after the heal.
    longest_gap: Duration,
}

/// Flips one bit in the middle of `node`'s replica log of the stream (while it is down).
fn flip_a_bit(node: &Node) {
    let replicas = node.dir.join("cluster").join("replicas");
    let file = std::fs::read_dir(&replicas)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.is_file())
        .find(|p| p.file_name().unwrap().to_string_lossy().contains(&format!("~{STREAM}~")))
        .expect("the stream's replica log");
    let mut bytes = std::fs::read(&file).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x10;
    std::fs::write(&file, &bytes).unwrap();
}

/// The broker leading replicated shard `name`, by its own status.
fn leading(nodes: &[Node], name: &str) -> Option<usize> {
    nodes.iter().position(|n| {
        n.proc.is_some()
            && status(n.metrics).is_some_and(|v| {
                v["replicas"].as_array().is_some_and(|r| r.iter().any(|r| r["name"] == name && r["role"] == "leader"))
            })
    })
}

/// Every broker up and its replicas of the stream and the cache leading or following.
fn settled(nodes: &[Node]) -> bool {
    nodes.iter().all(|n| {
        status(n.metrics).is_some_and(|v| {
            let role = |name: &str| {
                v["replicas"].as_array().is_some_and(|r| {
                    r.iter().any(|r| r["name"] == name && (r["role"] == "leader" || r["role"] == "follower"))
                })
            };
            role(STREAM) && role(CACHE)
        })
    })
}

fn signal(node: &Node, s: &str) {
    let pid = node.proc.as_ref().expect("running").0.id().to_string();
    assert!(Command::new("kill").args([s, &pid]).status().unwrap().success());
}

/// Applies `kind` to the broker `target` for `hold`, then heals it.
fn apply(
    kind: Fault,
    nodes: &mut [Node],
    net: &FaultNet,
    peers: &BTreeMap<String, String>,
    target: usize,
    hold: Duration,
) {
    let name = nodes[target].name.clone();
    let other = (0..nodes.len()).find(|i| *i != target).unwrap();
    let hold_then = |f: &mut dyn FnMut()| {
        std::thread::sleep(hold);
        f();
    };
    match kind {
        Fault::Partition => {
            net.isolate(&name);
            hold_then(&mut || net.heal());
        }
        Fault::OneWayLoss => {
            for o in nodes.iter().filter(|o| o.name != name) {
                net.set(&name, &o.name, Link { blocked: true, ..Link::default() });
            }
            hold_then(&mut || net.heal());
        }
        Fault::LossyLinks => {
            net.set_all(Link { loss: 150, duplicate: 50, delay_ms: (0, 25), ..Link::default() });
            hold_then(&mut || net.heal());
        }
        Fault::Bridge => {
            let cut = nodes[other].name.clone();
            net.set(&name, &cut, Link { blocked: true, ..Link::default() });
            net.set(&cut, &name, Link { blocked: true, ..Link::default() });
            hold_then(&mut || net.heal());
        }
        Fault::Pause => {
            signal(&nodes[target], "-STOP");
            hold_then(&mut || signal(&nodes[target], "-CONT"));
        }
        Fault::Kill => {
            nodes[target].kill();
            std::thread::sleep(hold);
            nodes[target].start(&peers[&name]);
        }
        Fault::PowerCut => {
            nodes[target].kill();
            let journal = nodes[target].journal.clone().expect("a journal");
            felix_driver_common::sync_journal::power_cut(&journal).expect("the power cut");
            std::thread::sleep(hold);
            nodes[target].start(&peers[&name]);
        }
        Fault::ClockJump => {
            // Stepped back an hour, or ahead ten minutes (the hold's parity picks), then right.
            let off = if hold.as_millis().is_multiple_of(2) { "-3600000" } else { "600000" };
            let env = (felix_driver_common::fault_clock::WALL_OFFSET_ENV.to_owned(), off.to_owned());
            nodes[target].kill();
            nodes[target].env.push(env.clone());
            nodes[target].start(&peers[&name]);
            // It leads the stream while its clock is off (the stream's leadership handed to it;
            // bounded: a move that cannot finish is given up).
            let metrics = nodes[other].metrics.to_string();
            let mut why = String::new();
            let moved = (0..5).any(|_| {
                if leading(nodes, STREAM) == Some(target) {
                    return true;
                }
                std::thread::sleep(Duration::from_millis(500));
                let out = std::process::Command::new("timeout")
                    .arg("15")
                    .arg(BIN)
                    .args(["cluster", "move", STREAM, "0", "--to", &name, "--metrics", &metrics])
                    .args(["--cluster-secret", "s"])
                    .output();
                why = out.as_ref().map(|o| String::from_utf8_lossy(&o.stderr).into_owned()).unwrap_or_default();
                out.is_ok_and(|o| o.status.success())
            });
            if !moved {
                eprintln!("  (the stream's leadership did not move to {name}: {})", why.trim());
            }
            std::thread::sleep(hold);
            nodes[target].kill();
            nodes[target].env.retain(|e| *e != env);
            nodes[target].start(&peers[&name]);
        }
        Fault::CorruptFollower => {
            // A follower of the stream (the target may lead it).
            let lead = leading(nodes, STREAM);
            let f = (0..nodes.len()).find(|i| Some(*i) != lead).unwrap();
            let fname = nodes[f].name.clone();
            nodes[f].kill();
            flip_a_bit(&nodes[f]);
            std::thread::sleep(hold);
            nodes[f].start(&peers[&fname]);
        }
    }
}

/// The stream read back whole through the cluster: (offset, record), and the offsets whose
/// timestamp is older than the record's before them (timestamps never go back).
fn read_stream(brokers: &[SocketAddr], stream: &str) -> (Vec<(u64, String)>, Vec<u64>) {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let cc = ClusterClient::connect(brokers, opts()).await.expect("the reader connects");
        let mut out = Vec::new();
        let (mut back, mut last_ts) = (Vec::new(), 0);
        let mut from = 0;
        let until = Instant::now() + Duration::from_secs(60);
        loop {
            match cc.stream_read("default", stream, 0, from, Some(10_000)).await {
                Ok(page) if page.records.is_empty() => break,
                Ok(page) => {
                    for r in page.records {
                        if r.timestamp_micros < last_ts {
                            back.push(r.offset);
                        }
                        last_ts = last_ts.max(r.timestamp_micros);
                        out.push((r.offset, String::from_utf8_lossy(&r.payload.0).into_owned()));
                    }
                    from = page.next_offset;
                }
                Err(e) => {
                    assert!(Instant::now() < until, "the stream is not readable: {e}");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                }
            }
        }
        cc.close().await;
        (out, back)
    })
}

/// Each key's final value read through every broker, after everything healed: one more
/// operation per broker at the end of each key's history.
fn final_reads(brokers: &[SocketAddr], t0: Instant, keys: &[String]) -> Vec<(String, CacheOp)> {
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    rt.block_on(async {
        let mut out = Vec::new();
        for (i, addr) in brokers.iter().enumerate() {
            let c = Client::connect(*addr, opts()).await.expect("a final reader connects");
            for k in keys {
                let until = Instant::now() + Duration::from_secs(30);
                loop {
                    let invoked = elapsed(t0);
                    match c.cache_get_versioned("default", CACHE, k).await {
                        Ok((v, ver)) => {
                            let ret = CacheReturn::Value(v.map(|v| (String::from_utf8_lossy(&v).into_owned(), ver)));
                            let op = CacheOp {
                                client: 100 + i,
                                invoked,
                                answered: Some((elapsed(t0), ret)),
                                call: CacheCall::Get,
                            };
                            out.push((k.clone(), op));
                            break;
                        }
                        Err(e) => {
                            assert!(Instant::now() < until, "{k} is not readable through {addr}: {e}");
                            tokio::time::sleep(Duration::from_millis(100)).await;
                        }
                    }
                }
            }
            let _ = c.close().await;
        }
        out
    })
}

/// Each broker's replica log of the stream, as its files hold it (read with the brokers
/// stopped).
fn replica_logs(nodes: &[Node]) -> Vec<ReplicaLog> {
    nodes
        .iter()
        .map(|n| {
            let dir = n.dir.join("cluster").join("replicas");
            let mut files: Vec<std::path::PathBuf> = std::fs::read_dir(&dir)
                .unwrap()
                .map(|e| e.unwrap().path())
                .filter(|p| p.is_file() && p.file_name().unwrap().to_string_lossy().contains(&format!("~{STREAM}~")))
                .collect();
            files.sort();
            let datas: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(f).unwrap()).collect();
            let views: Vec<&[u8]> = datas.iter().map(Vec::as_slice).collect();
            let (log, _, damage) = felix_proto::cluster::meta::fold_log_segments_checked(&views);
            assert!(damage.is_none(), "{}: its replica log is damaged: {damage:?}", n.name);
            ReplicaLog {
                broker: n.name.clone(),
                entries: log.entries.iter().map(|e| (e.index, e.term, e.data.to_vec())).collect(),
                commit: log.hard_state.commit,
            }
        })
        .collect()
}

/// The records a replica's committed entries hold.
fn committed_records(log: &ReplicaLog) -> BTreeSet<String> {
    log.entries
        .iter()
        .filter(|e| e.0 <= log.commit && !e.2.is_empty())
        .filter_map(|e| felix_proto::cluster::replica::ReplicatedBatch::decode(&e.2).ok())
        .flat_map(|b| b.payloads())
        .map(|p| String::from_utf8_lossy(&p).into_owned())
        .collect()
}

/// Runs `episodes` faults (kinds in turn, holds and targets from `seed`) and checks the
/// history. Returns the report.
fn schedule(episodes: usize, seed: u64) -> String {
    // `FELIX_CHAOS_KINDS` (names, comma-separated) keeps only those kinds.
    let only = std::env::var("FELIX_CHAOS_KINDS").unwrap_or_default();
    let kinds: Vec<Fault> =
        KINDS.into_iter().filter(|k| only.is_empty() || only.split(',').any(|o| o == format!("{k:?}"))).collect();
    assert!(!kinds.is_empty(), "FELIX_CHAOS_KINDS names no kind of {KINDS:?}");
    let (_dirs, mut nodes, net, peers) = three_brokers_through_faults_with(seed, true);
    let clients: Vec<SocketAddr> = nodes.iter().map(|n| n.client).collect();
    let addrs = clients.iter().map(SocketAddr::to_string).collect::<Vec<_>>().join(",");
    let any_dir = nodes[0].dir.clone();
    // The stream and the cache exist before the workload starts.
    wait_for("the stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", STREAM, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the conditional stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", COND, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the jobs' stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", JOBS, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the committed stream is created", 60, || {
        cli(&addrs, &any_dir, &["publish", ACCOUNTS, "first", "--ack", "--close-timeout", "3s"]).0
    });
    wait_for("the cache is created", 60, || {
        cli(&addrs, &any_dir, &["cache", "put", CACHE, "warm", "up", "--close-timeout", "3s"]).0
    });
    wait_for("the cluster settles", 60, || settled(&nodes));
    let t0 = Instant::now();
    let load = Workload::start(clients.clone(), t0);
    wait_for("the workload is acknowledged", 60, || load.acks() >= 100);
    let mut rng = Rng(seed.wrapping_mul(0x9E37_79B9) | 1);
    let mut done = Vec::new();
    for ep in 0..episodes {
        load.episode.store(ep as u64, Ordering::Relaxed);
        std::thread::sleep(Duration::from_millis(800));
        let kind = kinds[ep % kinds.len()];
        // Each kind is aimed at the stream's leader and the cache's in turn.
        let shard = if (ep % kinds.len() + ep / kinds.len()).is_multiple_of(2) { STREAM } else { CACHE };
        let mut target = None;
        wait_for("a leader to aim at", 60, || {
            target = leading(&nodes, shard);
            target.is_some()
        });
        let hold = Duration::from_millis(1500 + rng.below(3500));
        // A paused leader stays stopped 1 to 20 s (a VM stall, a long GC pause): the same draw,
        // spread wider.
        let hold = match kind {
            Fault::Pause => Duration::from_millis(1000 + (hold.as_millis() as u64 - 1500) * 19_000 / 3_500),
            _ => hold,
        };
        eprintln!("episode {ep}: {kind:?} on {} (leads {shard}) for {hold:?}", nodes[target.unwrap()].name);
        let began = Instant::now();
        apply(kind, &mut nodes, &net, &peers, target.unwrap(), hold);
        let healed = Instant::now();
        let before = load.acks();
        wait_for("a publish is acknowledged after the heal", 90, || load.acks() > before);
        let first = load.history.lock().unwrap().ack_times.iter().filter(|t| **t > healed).min().copied();
        wait_for("the cluster settles after the heal", 120, || settled(&nodes));
        let longest_gap = {
            let h = load.history.lock().unwrap();
            let mut times: Vec<Instant> = h.ack_times.iter().filter(|t| **t > began).copied().collect();
            times.sort();
            std::iter::once(began).chain(times).collect::<Vec<_>>().windows(2).map(|w| w[1] - w[0]).max()
        };
        done.push(Episode {
            kind,
            unavailable_after_heal: first.map(|t| t - healed).unwrap_or_default(),
            longest_gap: longest_gap.unwrap_or_default(),
        });
    }
    net.heal();
    std::thread::sleep(Duration::from_secs(1));
    let h = load.finish();
    let h = Mutex::new(h);
    let dead = drain_group(&clients, t0, &h);
    let mut h = h.into_inner().unwrap();
    // Dead letters are settled (by the group, after five lapsed claims).
    h.group.ack_unknown.extend(dead.iter().copied());
    // The final word: the streams read back, each key read through every broker.
    let (log, back) = read_stream(&clients, STREAM);
    let (cond_log, cond_back) = read_stream(&clients, COND);
    let (jobs_log, jobs_back) = read_stream(&clients, JOBS);
    let (accounts_log, accounts_back) = read_stream(&clients, ACCOUNTS);
    let times_back = back.len() + cond_back.len() + jobs_back.len() + accounts_back.len();
    let state = read_state(&clients);
    let keys: Vec<String> = h.cache.keys().cloned().collect();
    let mut cache = h.cache.clone();
    for (k, op) in final_reads(&clients, t0, &keys) {
        cache.entry(k).or_default().push(op);
    }
    // Let followers apply what the leader committed last, then stop every broker and read its
    // files.
    std::thread::sleep(Duration::from_secs(2));
    for n in &mut nodes {
        n.kill();
    }
    let replicas = replica_logs(&nodes);

    // The verdicts.
    let mut unknown = h.unknown.clone();
    unknown.insert("first".into());
    let stream = check_stream(&log, &h.acked, &unknown);
    let subscriber = check_subscriber(&h.seen, &log);
    let mut cond_unknown = h.cond_unknown.clone();
    cond_unknown.insert("first".into());
    let cond = check_stream(&cond_log, &h.cond_acked, &cond_unknown);
    let mut jobs_unknown = h.jobs_unknown.clone();
    jobs_unknown.insert("first".into());
    let jobs = check_stream(&jobs_log, &h.jobs_acked, &jobs_unknown);
    let group = check_group(&jobs_log, &h.group);
    let mut commits_unknown = h.commits_unknown.clone();
    commits_unknown.insert("first".into());
    let commits = check_stream(&accounts_log, &h.commits_acked, &commits_unknown);
    // The state is the last commit's, at its offset: event and state went together.
    let last_commit = accounts_log.iter().rev().find(|(_, p)| p.starts_with("commit-"));
    let state_ok = state == (last_commit.map(|(_, p)| p.clone()), last_commit.map(|(o, _)| *o));
    let diverged = divergent(&replicas);
    let mut missing_on_disk = Vec::new();
    for r in &replicas {
        let held = committed_records(r);
        let missing = h.acked.iter().filter(|(p, _)| !held.contains(p)).count();
        if missing > 0 {
            missing_on_disk.push(format!("{}: {missing} acknowledged records not in its committed log", r.broker));
        }
    }
    let mut stale = Vec::new();
    let mut ops = 0;
    for (k, history) in &cache {
        ops += history.len();
        if let Err(why) = linearizable(history) {
            stale.push(format!("{k}: {why}"));
        }
    }
    let mut by_kind: BTreeMap<Fault, (Vec<Duration>, Vec<Duration>)> = BTreeMap::new();
    for e in &done {
        let k = by_kind.entry(e.kind).or_default();
        k.0.push(e.unavailable_after_heal);
        k.1.push(e.longest_gap);
    }
    let mut report = format!(
        "{} episodes; {} records acknowledged, {} unknown; lost {}, duplicated {}, misplaced {}, phantom {}; \
         subscriber saw {} with {} faults; {} divergent indexes; {} not on every replica's disk; \
         cache: {} keys, {} operations ({} answered, {} refused), {} keys not linearizable; \
         conditional appends: {} acknowledged, {} unknown, {} not at their offset, clean: {}; \
         jobs: {} acknowledged, {} unknown, clean: {}; group: {} handed out, {} acks ({} unknown), \
         {} dead letters, {} polls failed, {} handed out after their ack, {} never settled, {} phantom; \
         {} records older than the one before; commits: {} acknowledged, {} unknown, clean: {}, \
         state is the last commit's: {}\n",
        done.len(),
        h.acked.len(),
        h.unknown.len(),
        stream.lost.len(),
        stream.duplicated.len(),
        stream.misplaced.len(),
        stream.phantom.len(),
        h.seen.len(),
        subscriber.len(),
        diverged.len(),
        missing_on_disk.len(),
        cache.len(),
        ops,
        h.cache_answered,
        h.cache_refused,
        stale.len(),
        h.cond_acked.len(),
        h.cond_unknown.len(),
        h.cond_misplaced.len(),
        cond.is_clean(),
        h.jobs_acked.len(),
        h.jobs_unknown.len(),
        jobs.is_clean(),
        h.group.delivered.len(),
        h.group.acked.len(),
        h.group.ack_unknown.len() - dead.len().min(h.group.ack_unknown.len()),
        dead.len(),
        h.polls_failed,
        group.redelivered.len(),
        group.lost.len(),
        group.phantom.len(),
        times_back,
        h.commits_acked.len(),
        h.commits_unknown.len(),
        commits.is_clean(),
        state_ok,
    );
    for (kind, (after, gaps)) in &mut by_kind {
        after.sort();
        gaps.sort();
        report.push_str(&format!(
            "  {kind:?}: {} episodes; heal to the next acknowledged write: median {:.0?}, worst {:.0?}; \
             longest stretch without one from the fault's start: median {:.0?}, worst {:.0?}\n",
            after.len(),
            after[after.len() / 2],
            after[after.len() - 1],
            gaps[gaps.len() / 2],
            gaps[gaps.len() - 1]
        ));
    }
    eprintln!("{report}");
    assert!(stream.is_clean(), "the stream: {stream:?}");
    assert!(cond.is_clean() && h.cond_misplaced.is_empty(), "conditional appends: {cond:?} {:?}", h.cond_misplaced);
    assert!(subscriber.is_empty(), "the subscriber: {:?}", &subscriber[..subscriber.len().min(10)]);
    assert!(jobs.is_clean(), "the jobs: {jobs:?}");
    assert!(commits.is_clean(), "the commits: {commits:?}");
    assert!(state_ok, "the state {state:?} is not the last commit's {last_commit:?}");
    assert!(times_back == 0, "timestamps go back at {back:?} {cond_back:?} {jobs_back:?}");
    assert!(group.is_clean(), "the consumer group: {group:?}");
    assert!(diverged.is_empty(), "replicas diverge: {diverged:?}");
    assert!(missing_on_disk.is_empty(), "{missing_on_disk:?}");
    assert!(stale.is_empty(), "not linearizable: {}", stale.join("\n"));
    report
}

/// Two episodes of each kind of fault (CI).
#[test]
fn a_short_fault_schedule_loses_doubles_and_reads_nothing_stale() {
    // Each kind twice: once at the stream's leader, once at the cache's.
    schedule(2 * KINDS.len(), 1);
}

/// The long schedule: `FELIX_CHAOS_EPISODES` episodes (default 200), `FELIX_CHAOS_SEED`.
#[test]
#[ignore = "long: about a minute per eight episodes; run by hand and reported"]
fn a_long_fault_schedule_loses_doubles_and_reads_nothing_stale() {
    let n = std::env::var("FELIX_CHAOS_EPISODES").ok().and_then(|v| v.parse().ok()).unwrap_or(200);
    let seed = std::env::var("FELIX_CHAOS_SEED").ok().and_then(|v| v.parse().ok()).unwrap_or(7);
    schedule(n, seed);
}
