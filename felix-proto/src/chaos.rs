//! Deterministic simulation with faults: one broker, several clients and storage in memory, a
//! seeded random workload, and random faults — lost connections, storage writes that fail or
//! complete late and out of order, slow readers, and broker crashes that drop everything not yet
//! persisted and restart from what was. Every run is a function of its seed, so a failure
//! replays exactly (`felix-node sim --seed N`).
//!
//! Invariants, checked as the run goes and at its end:
//! * every acknowledged record is in storage exactly once, at the offset it was answered with,
//!   across every crash;
//! * no record is ever stored twice, and a shard's stored offsets never go backwards;
//! * each subscriber sees offsets strictly increasing, each with the payload storage holds
//!   there, and a gap only where it was slow (a counted drop or `subscription_lagged`) or where
//!   storage holds nothing (a failed write);
//! * acknowledgements on a stream come in the order the publishes were sent;
//! * cache reads equal a reference model (reset by a crash: the cache is in memory);
//! * a consumer-group member never gets a record again once its ack was confirmed (crashes
//!   included), and every stored record reaches the group;
//! * an idempotent producer that resends every unanswered batch under the same sequence (after
//!   lost connections, failed writes and crashes) has each batch stored exactly once and never
//!   stops: the only refusal it meets is a gap behind an earlier batch that failed, which it
//!   sends again after that one;
//! * memory stays bounded: no subscriber queue holds more than its capacity;
//! * a stream's commit state (`commit`, `state_get`) after every crash is the fold of every
//!   commit storage held, in offset order, the ones retention deleted included: its retention
//!   keeps 20 records, so the state checkpoint carries most of it.
//!
//! Storage also stalls now and then (completes nothing for up to 3,000 steps), so that writes and answers
//! pile up and the idempotent producer runs into its window.

use crate::broker::{BrokerConfig, Retention, StreamConfig, TokenGrant, WriteOutcome};
use crate::client::producer::{Outcome, ProducerEvent, ProducerState, RetryPolicy, SendId};
use crate::client::{
    ClientConfig, ClientEvent, ClientStream, EndReason, PublishId, PublishRequest, Reply, SubscribeRequest,
};
use crate::message::StartPosition;
use crate::sim::{Sim, StorageMode};
use bytes::Bytes;
use std::collections::{BTreeSet, HashMap, HashSet};
use std::time::{Duration, Instant};

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChaosReport {
    /// Steps run.
    pub steps: usize,
    /// Records acknowledged (and verified in storage).
    pub acked: u64,
    /// Records delivered to subscribers (and verified).
    pub delivered: u64,
    /// Storage writes failed on purpose.
    pub failed_writes: u64,
    /// Connections lost on purpose.
    pub lost_connections: u64,
    /// Broker crashes.
    pub crashes: u64,
    /// Cache reads checked against the model.
    pub cache_reads: u64,
    /// Idempotent batches sent again (after a lost connection, a crash or a failed write).
    pub idempotent_resends: u64,
    /// Group records delivered to the consumer (first deliveries and redeliveries).
    pub group_deliveries: u64,
    /// Group acks confirmed.
    pub group_acks: u64,
    /// Idempotent batches refused as a gap behind an earlier one that failed (resent after it).
    pub gaps_after_failure: u64,
    /// Times storage stalled (completed nothing for 100 to 3,000 steps).
    pub storage_stalls: u64,
    /// New idempotent batches the producer held back because its window was full.
    pub producer_window_full: u64,
    /// Commits storage held (folded into the state model).
    pub commits: u64,
    /// Keys of the commit state checked after a crash.
    pub state_reads: u64,
    /// The run's trace digest ([`crate::sim::Trace`]); for a sum of runs, a digest of theirs in
    /// order.
    pub digest: u64,
}

/// A consumer-group member (client 2's role) on stream `beta`: it polls, acks some of what it
/// holds, and loses its connection or the broker like everyone else. A record whose ack was
/// confirmed must never be delivered again, not even after a crash; at the end every stored
/// record has been delivered.
#[derive(Default)]
struct Consumer {
    polls: HashSet<u64>,
    acks: HashMap<u64, u64>,
    claimed: BTreeSet<u64>,
    confirmed: BTreeSet<u64>,
    delivered: BTreeSet<u64>,
}

impl Consumer {
    fn forget_connection(&mut self) {
        self.polls.clear();
        self.acks.clear();
        self.claimed.clear();
    }
}

fn group_poll(max_records: u32) -> impl FnOnce(u64) -> crate::Message {
    move |request_id| {
        crate::Message::GroupPoll(crate::message::GroupPoll {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: STREAMS[1].into(),
            shard: 0,
            group: "g".into(),
            max_records,
            wait_ms: 0,
            request_id,
            consumer: None,
            reclaim: None,
            visibility_ms: None,
        })
    }
}

fn group_ack(offset: u64) -> impl FnOnce(u64) -> crate::Message {
    move |request_id| {
        crate::Message::GroupAck(crate::message::GroupOffset {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: STREAMS[1].into(),
            shard: 0,
            group: "g".into(),
            offset,
            request_id,
        })
    }
}

/// An idempotent producer (client 1's role) on stream `alpha`, shard 0: the client's own
/// [`ProducerState`] decides sequences, resends and its window; this keeps which publish of the
/// current connection carries which sequence.
struct Producer {
    state: ProducerState,
    /// Publish ids of the current connection → the send they carry.
    in_flight: HashMap<PublishId, SendId>,
}

impl Producer {
    /// The connection is gone: everything in flight goes again on the next one.
    fn connection_lost(&mut self) {
        self.in_flight.clear();
        self.state.handle_connection_lost();
    }
}

impl ChaosReport {
    /// Adds another run's counts to this one.
    pub fn add(&mut self, r: &ChaosReport) {
        self.steps += r.steps;
        self.acked += r.acked;
        self.delivered += r.delivered;
        self.failed_writes += r.failed_writes;
        self.lost_connections += r.lost_connections;
        self.crashes += r.crashes;
        self.cache_reads += r.cache_reads;
        self.idempotent_resends += r.idempotent_resends;
        self.group_deliveries += r.group_deliveries;
        self.group_acks += r.group_acks;
        self.producer_window_full += r.producer_window_full;
        self.storage_stalls += r.storage_stalls;
        self.gaps_after_failure += r.gaps_after_failure;
        self.commits += r.commits;
        self.state_reads += r.state_reads;
        self.digest = self.digest.rotate_left(7) ^ r.digest;
    }
}

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }
}

const STREAMS: [&str; 2] = ["alpha", "beta"];
/// The stream commits go to (its retention keeps 20 records: its state lives mostly in the
/// checkpoint), and the keys they write.
const STATE_STREAM: &str = "gamma";
const STATE_KEYS: u64 = 6;
const CLIENTS: usize = 3;
/// Records a shard keeps: a long run's history is cut by retention many times over, while the
/// idempotent producer's remembered window (64 of its batches, about 1,800 records of traffic)
/// stays inside it.
const RETAINED_RECORDS: u64 = 4000;
const TOKEN: &str = "chaos";

/// One client incarnation's bookkeeping (a new one after every lost connection or crash).
#[derive(Default)]
struct Party {
    idx: usize,
    /// Acked publishes of this connection: their stream and payloads.
    sent: HashMap<PublishId, (usize, Vec<Bytes>)>,
    order: Vec<PublishId>,
    answered: Vec<PublishId>,
    slow_ever: bool,
    subs: HashMap<u64, SubLog>,
    /// Cache requests not answered yet: request id → (key, what a write stores; `None` for a
    /// read).
    cache_ops: HashMap<u64, (String, CacheOp)>,
}

/// What one subscription received.
#[derive(Default)]
struct SubLog {
    stream: usize,
    got: Vec<(u64, Bytes)>,
    lagged: bool,
}

#[derive(Debug, Clone)]
enum CacheOp {
    Put(Bytes),
    Delete,
    Read,
}

/// The cache as clients were told it is. Only client 0 uses the cache, so its answers (in
/// request order) say exactly what the broker did; a key whose write's answer was lost with a
/// connection is unknown until written again.
#[derive(Default)]
struct Model {
    values: HashMap<String, Bytes>,
    unknown: HashSet<String>,
}

fn config() -> BrokerConfig {
    BrokerConfig {
        tokens: vec![TokenGrant::dev(TOKEN)],
        history_reads: true,
        history_read_bytes: 64,
        event_stream_inflight_bytes: 256,
        // History is bounded as in production, so long runs put retention under test too (and
        // an `earliest` subscriber replays a bounded log, not everything since step 0).
        default_stream: StreamConfig {
            memory_bytes: 64,
            queue_capacity: 4,
            retention: Retention { max_records: Some(RETAINED_RECORDS), ..Retention::default() },
            ..StreamConfig::default()
        },
        streams: vec![crate::broker::StreamSpec {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            name: STATE_STREAM.into(),
            config: StreamConfig {
                memory_bytes: 64,
                queue_capacity: 4,
                retention: Retention { max_records: Some(20), ..Retention::default() },
                ..StreamConfig::default()
            },
        }],
        ..BrokerConfig::default()
    }
}

/// The commit state as storage holds it: every commit to [`STATE_STREAM`] ever seen in storage,
/// by offset, less the ones a crash took back. Retention removes commits from storage, not from
/// here: their state must live on in the broker's checkpoint.
#[derive(Default)]
struct StateModel {
    commits: std::collections::BTreeMap<u64, Vec<crate::storage::StateChange>>,
}

impl StateModel {
    /// Takes in the commits storage completed since the last look (from the journal: retention
    /// may already have removed some of them from storage).
    fn observe(&mut self, fresh: &[crate::storage::PersistRequest], report: &mut ChaosReport) {
        for w in fresh.iter().filter(|w| w.stream == STATE_STREAM) {
            if let Some(changes) = w.state.as_ref().and_then(|s| crate::storage::decode_state_changes(s).ok()) {
                report.commits += 1;
                self.commits.insert(w.base_offset, changes);
            }
        }
    }

    /// After a crash: a write completed behind one that never did is gone from storage (a
    /// disk completes a shard's writes in order), and so from here, unless retention had
    /// removed it; then every key the restarted broker serves must be the model's.
    fn check_after_restart(&mut self, sim: &mut Sim, report: &mut ChaosReport) -> Result<(), String> {
        let below = truncated_below(sim, STATE_STREAM);
        let held: HashSet<u64> =
            sim.durable.iter().filter(|w| w.stream == STATE_STREAM).map(|w| w.base_offset).collect();
        self.commits.retain(|o, _| *o < below || held.contains(o));
        let mut want: HashMap<String, (Bytes, u64)> = HashMap::new();
        for (o, changes) in &self.commits {
            for (k, v) in changes {
                match v {
                    Some(v) => want.insert(k.clone(), (v.clone(), *o)),
                    None => want.remove(k),
                };
            }
        }
        let idx = sim.connect(client_config(0));
        sim.run();
        let mut asked = HashMap::new();
        for k in 0..STATE_KEYS {
            let key = format!("k{k}");
            let id = sim
                .client(idx)
                .state_get(ClientStream(0), "default", STATE_STREAM, Bytes::from_static(b"entity"), &key)
                .map_err(|e| format!("state_get: {e}"))?;
            asked.insert(id, key);
        }
        sim.run();
        for e in sim.take_events(idx) {
            let ClientEvent::Reply { request_id, reply } = e else { continue };
            let Some(key) = asked.remove(&request_id) else { continue };
            let Reply::State { value, version, .. } = reply else {
                return Err(format!("state_get of {key} answered {reply:?}"));
            };
            let want = want.get(&key).map(|(v, o)| (v.clone(), *o));
            if value.clone().zip(version) != want {
                return Err(format!(
                    "after a crash, state {key} is {value:?} at {version:?}; storage's commits make it {want:?} \
                     (retention removed commits below {below})"
                ));
            }
            report.state_reads += 1;
        }
        if !asked.is_empty() {
            return Err(format!("state_get unanswered after a crash: {asked:?}"));
        }
        sim.drop_connection(idx);
        sim.run();
        Ok(())
    }
}

/// Clients 0 and 1 have their acknowledgements after the write (the default); client 2's come
/// on enqueue, so both kinds are under test.
fn client_config(i: usize) -> ClientConfig {
    let c = ClientConfig::new("t1", TOKEN);
    if i == 2 { c.ack_on_enqueue() } else { c }
}

/// How many steps `felix-node sim` gives a seed when not told: a spread, so that a default run
/// covers short runs (most seeds) and long ones (the state a long run reaches: retention cutting
/// history, producers far past their first window, many crashes). 70% of seeds run 200–2,000
/// steps, 25% 2,000–8,000 and 5% 8,000–30,000 (about 3,000 on average). A function of the
/// seed, so a seed replays at its own length.
pub fn steps_for_seed(seed: u64) -> usize {
    let mut r = Rng(seed.rotate_left(29) ^ 0x9e37_79b9_7f4a_7c15 | 1);
    let (lo, span) = match r.below(100) {
        0..70 => (200, 1_800),
        70..95 => (2_000, 6_000),
        _ => (8_000, 22_000),
    };
    (lo + r.below(span)) as usize
}

/// Runs one seed for `steps` steps. `Err` names the broken invariant.
///
/// # Errors
/// The first invariant that does not hold, with enough context to debug it.
pub fn run_seed(seed: u64, epoch: Instant, steps: usize) -> Result<ChaosReport, String> {
    let mut rng = Rng(seed | 1);
    let mut sim = Sim::new(config(), epoch).with_random_chunks(seed, 31);
    sim.storage = StorageMode::Manual;
    // Each write storage completes, once, for the checks (retention may remove it from
    // `durable` before they look).
    sim.journal = Some(Vec::new());
    let mut report = ChaosReport { steps, ..ChaosReport::default() };
    let mut parties: Vec<Party> =
        (0..CLIENTS).map(|i| Party { idx: sim.connect(client_config(i)), ..Party::default() }).collect();
    let mut retired: Vec<Party> = Vec::new();
    sim.run();
    let mut counter = 0u64;
    let mut model = Model::default();
    let producer_id = seed.rotate_left(17) | 1;
    // The invariant is that it is never refused, so it never gives up either.
    let policy = RetryPolicy { attempts: u32::MAX, ..RetryPolicy::default() };
    let mut producer = Producer { state: ProducerState::new(producer_id, policy), in_flight: HashMap::new() };
    let mut consumer = Consumer::default();
    let mut storage_check = StorageCheck::default();
    let mut state = StateModel::default();
    // Every acknowledged record: payload → offset it was answered with (if any).
    let mut acked: HashMap<Bytes, (usize, u64)> = HashMap::new();
    // Storage completes nothing before this step (a stalled disk): writes, answers after the
    // write and idempotent batches pile up, and producers meet their windows.
    let mut stalled_until = 0usize;
    for step in 0..steps {
        let p = rng.below(CLIENTS as u64) as usize;
        let now = sim.now;
        match rng.below(100) {
            0..=2 => {
                // A commit: an event and its state changes, to the state stream.
                counter += 1;
                let key = format!("k{}", rng.below(STATE_KEYS));
                let change = if rng.chance(20) { None } else { Some(Bytes::from(format!("v{counter}"))) };
                let mut changes = vec![(key, change)];
                if rng.chance(25) {
                    changes.push((format!("k{}", rng.below(STATE_KEYS)), Some(Bytes::from(format!("w{counter}")))));
                }
                let req = crate::client::CommitRequest {
                    namespace: "default".into(),
                    stream: STATE_STREAM.into(),
                    entity_key: Bytes::from_static(b"entity"),
                    event: Bytes::from(format!("s{seed}-c{counter}")),
                    changes,
                    expected_offset: None,
                };
                let _ = sim.client(parties[p].idx).commit(ClientStream(0), req);
            }
            3..=34 => {
                let stream = rng.below(2) as usize;
                let n = 1 + rng.below(3) as usize;
                let payloads: Vec<Bytes> = (0..n)
                    .map(|_| {
                        counter += 1;
                        Bytes::from(format!("s{seed}-r{counter}"))
                    })
                    .collect();
                let mut req = PublishRequest::new("default", STREAMS[stream], payloads.clone());
                req.json = rng.chance(30);
                req.ack = rng.chance(70);
                if rng.chance(30) {
                    req.key = Some(Bytes::from(format!("k{}", rng.below(5))));
                }
                let party = &mut parties[p];
                if let Ok(id) = sim.client(party.idx).publish(ClientStream(0), req.clone(), now)
                    && req.ack
                {
                    party.sent.insert(id, (stream, payloads));
                    party.order.push(id);
                }
            }
            35..=39 => {
                let stream = rng.below(2) as usize;
                let start = match rng.below(3) {
                    0 => None,
                    1 => Some(StartPosition::Earliest),
                    _ => Some(StartPosition::Offset(rng.below(20))),
                };
                let req = SubscribeRequest {
                    namespace: "default".into(),
                    stream: STREAMS[stream].into(),
                    start,
                    shard: None,
                    queue_capacity: None,
                    filter: None,
                };
                if let Ok(sub) = sim.client(parties[p].idx).subscribe(ClientStream(0), req, now) {
                    parties[p].subs.insert(sub, SubLog { stream, ..SubLog::default() });
                }
            }
            40..=44 => {
                // The idempotent producer: a new batch (when its window has room), then whatever
                // it hands out (new batches and resends, in sequence order).
                producer.state.handle_timeout(now);
                if rng.chance(50) {
                    for _ in 0..1 + rng.below(2) {
                        counter += 1;
                        let payload = Bytes::from(format!("s{seed}-i{counter}"));
                        if producer.state.push(0, vec![payload], None).is_err() {
                            report.producer_window_full += 1;
                        }
                    }
                }
                let party = &mut parties[1];
                while let Some(send) = producer.state.poll_transmit() {
                    let mut req = PublishRequest::new("default", STREAMS[0], send.payloads.clone());
                    req.idempotent = Some((producer_id, send.id.sequence));
                    req.json = rng.chance(30);
                    match sim.client(party.idx).publish(ClientStream(0), req, now) {
                        Ok(id) => {
                            report.idempotent_resends += u64::from(send.id.attempt > 1);
                            producer.in_flight.insert(id, send.id);
                            party.sent.insert(id, (0, send.payloads));
                            party.order.push(id);
                        }
                        Err(_) => {
                            // Window full, not connected yet: it goes out on a later step.
                            producer.state.handle_outcome(send.id, Outcome::NotSent, now);
                            break;
                        }
                    }
                }
            }
            45..=54 => {
                let key = format!("c{}", rng.below(4));
                let party = &mut parties[0];
                let c = sim.client(party.idx);
                let (sent, op) = match rng.below(3) {
                    0 => {
                        counter += 1;
                        let v = Bytes::from(format!("v{counter}"));
                        (c.cache_put(ClientStream(0), "default", "chaos", &key, v.clone(), None), CacheOp::Put(v))
                    }
                    1 => (c.cache_delete(ClientStream(0), "default", "chaos", &key), CacheOp::Delete),
                    _ => (c.cache_get(ClientStream(0), "default", "chaos", &key), CacheOp::Read),
                };
                if let Ok(id) = sent {
                    party.cache_ops.insert(id, (key, op));
                }
            }
            55..=74 if step < stalled_until => {}
            55..=74 => {
                // Storage completes a few writes, in any order (publishes arrive faster than one
                // a step, and a starved store would leave the acknowledged path untested).
                for _ in 0..1 + rng.below(4) {
                    if sim.pending_writes.is_empty() {
                        break;
                    }
                    let i = rng.below(sim.pending_writes.len() as u64) as usize;
                    let token = sim.pending_writes[i].token;
                    // One write in ten fails; half of those for lack of space (the shard then
                    // refuses publishes until a write succeeds).
                    let outcome = match rng.below(20) {
                        0 => WriteOutcome::Failed,
                        1 => WriteOutcome::NoSpace,
                        _ => WriteOutcome::Written,
                    };
                    report.failed_writes += u64::from(outcome != WriteOutcome::Written);
                    sim.complete_write_with(token, outcome);
                }
            }
            75..=79 => {
                let on = rng.chance(50);
                parties[p].slow_ever |= on;
                sim.set_slow(parties[p].idx, on);
            }
            80 | 81 => {
                // A lost connection: the party starts over on a new one.
                report.lost_connections += 1;
                sim.drop_connection(parties[p].idx);
                if p == 2 {
                    consumer.forget_connection();
                }
                if p == 1 {
                    producer.connection_lost();
                }
                for (key, op) in parties[p].cache_ops.values() {
                    if !matches!(op, CacheOp::Read) {
                        model.unknown.insert(key.clone());
                    }
                }
                let old = std::mem::replace(
                    &mut parties[p],
                    Party { idx: sim.connect(client_config(p)), ..Party::default() },
                );
                retired.push(old);
            }
            82 | 83 if rng.chance(20) => {
                // A crash: what storage did not complete is gone; everyone reconnects.
                report.crashes += 1;
                collect(&mut sim, &mut parties, &mut acked, &mut model, &mut producer, &mut consumer, &mut report)?;
                let fresh = sim.take_journal();
                storage_check.check(&sim, &fresh)?;
                state.observe(&fresh, &mut report);
                sim.restart();
                state.check_after_restart(&mut sim, &mut report)?;
                model = Model::default();
                producer.connection_lost();
                consumer.forget_connection();
                for (i, party) in parties.iter_mut().enumerate() {
                    let old =
                        std::mem::replace(party, Party { idx: sim.connect(client_config(i)), ..Party::default() });
                    retired.push(old);
                }
            }
            82 | 83 if rng.chance(3) => {
                // Mostly short; one in four long enough for the producer to fill its window.
                report.storage_stalls += 1;
                let (lo, span) = if rng.chance(25) { (1_500, 1_500) } else { (100, 400) };
                stalled_until = stalled_until.max(step + lo + rng.below(span) as usize);
            }
            84..=89 => sim.advance(Duration::from_millis(rng.below(1500))),
            90..=94 => {
                // The group member: ack something it holds, or poll for more.
                let held: Vec<u64> = consumer.claimed.iter().copied().collect();
                let c = sim.client(parties[2].idx);
                if !held.is_empty() && rng.chance(60) {
                    let o = held[rng.below(held.len() as u64) as usize];
                    if let Ok(id) = c.request(ClientStream(0), group_ack(o)) {
                        consumer.acks.insert(id, o);
                        consumer.claimed.remove(&o);
                    }
                } else if let Ok(id) = c.request(ClientStream(0), group_poll(1 + rng.below(3) as u32)) {
                    consumer.polls.insert(id);
                }
            }
            _ => {
                sim.run();
            }
        }
        collect(&mut sim, &mut parties, &mut acked, &mut model, &mut producer, &mut consumer, &mut report)?;
        let fresh = sim.take_journal();
        storage_check.check(&sim, &fresh)?;
        state.observe(&fresh, &mut report);
        let bound = 64 * 1024 * (sim.clients.len() + 1);
        if sim.broker.queued_event_bytes() > bound {
            return Err(format!("subscriber queues hold {} bytes", sim.broker.queued_event_bytes()));
        }
    }
    // Drain: readers catch up, storage completes.
    for party in &parties {
        sim.set_slow(party.idx, false);
    }
    sim.run();
    sim.complete_all_writes();
    sim.run();
    collect(&mut sim, &mut parties, &mut acked, &mut model, &mut producer, &mut consumer, &mut report)?;
    let fresh = sim.take_journal();
    storage_check.check(&sim, &fresh)?;
    state.observe(&fresh, &mut report);
    // The member drains the group: claims lapse, everything left is polled and acked.
    for _ in 0..200 {
        sim.advance(Duration::from_secs(31));
        consumer.claimed.clear();
        let c = sim.client(parties[2].idx);
        if let Ok(id) = c.request(ClientStream(0), group_poll(100)) {
            consumer.polls.insert(id);
        }
        sim.run();
        sim.complete_all_writes();
        collect(&mut sim, &mut parties, &mut acked, &mut model, &mut producer, &mut consumer, &mut report)?;
        if consumer.claimed.is_empty() {
            break;
        }
        let held: Vec<u64> = consumer.claimed.iter().copied().collect();
        for o in held {
            if let Ok(id) = sim.client(parties[2].idx).request(ClientStream(0), group_ack(o)) {
                consumer.acks.insert(id, o);
            }
        }
        sim.run();
        sim.complete_all_writes();
        collect(&mut sim, &mut parties, &mut acked, &mut model, &mut producer, &mut consumer, &mut report)?;
    }
    let stored = stored(&sim);
    for (p, (stream, o)) in &stored {
        if stream == STREAMS[1] && !consumer.delivered.contains(o) {
            return Err(format!("stored record {p:?} at {o} never delivered to the group"));
        }
    }
    for (p, (stream, off)) in &acked {
        match stored.get(p) {
            Some((_, o)) if o != off => return Err(format!("{p:?} acknowledged at {off}, stored at {o}")),
            Some(_) => {}
            // Retention may remove what was acknowledged, and nothing else may.
            None if *off < truncated_below(&sim, STREAMS[*stream]) => {}
            None => return Err(format!("acknowledged record {p:?} lost")),
        }
        report.acked += 1;
    }
    for party in retired.iter().chain(&parties) {
        check_party(party, &stored, &sim, &mut report)?;
    }
    // Last, a crash with every write done: every seed's state comes back from its checkpoint.
    let fresh = sim.take_journal();
    storage_check.check(&sim, &fresh)?;
    state.observe(&fresh, &mut report);
    sim.restart();
    state.check_after_restart(&mut sim, &mut report)?;
    report.digest = sim.trace.value();
    Ok(report)
}

/// Stored records: payload → (stream, offset). Fails if one is stored twice.
fn stored(sim: &Sim) -> HashMap<Bytes, (String, u64)> {
    let mut out = HashMap::new();
    for w in &sim.durable {
        for (i, p) in w.records.payloads().enumerate() {
            out.insert(p, (w.stream.clone(), w.base_offset + i as u64));
        }
    }
    out
}

/// Checks that storage holds no record twice and no offset twice, incrementally: between
/// restarts storage only grows, or loses what retention removed (which may never come back), so
/// each step looks at the writes completed since the last look. A restart loses writes that a
/// producer may legitimately store again, so it starts the check over.
#[derive(Default)]
struct StorageCheck {
    seen: HashSet<Bytes>,
    offsets: HashSet<(String, u64)>,
    restarts: u32,
}

impl StorageCheck {
    /// `fresh`: the writes storage completed since the last look (the journal).
    fn check(&mut self, sim: &Sim, fresh: &[crate::storage::PersistRequest]) -> Result<(), String> {
        let writes = if sim.restarts != self.restarts {
            *self = StorageCheck { restarts: sim.restarts, ..StorageCheck::default() };
            &sim.durable[..]
        } else {
            fresh
        };
        for w in writes {
            for (i, p) in w.records.payloads().enumerate() {
                if !self.seen.insert(p.clone()) {
                    return Err(format!("record {p:?} stored twice"));
                }
                if !self.offsets.insert((w.stream.clone(), w.base_offset + i as u64)) {
                    return Err(format!("offset {} of {} stored twice", w.base_offset + i as u64, w.stream));
                }
            }
        }
        Ok(())
    }
}

/// Moves what the clients reported into the bookkeeping, checking acks and cache reads.
fn collect(
    sim: &mut Sim,
    parties: &mut [Party],
    acked: &mut HashMap<Bytes, (usize, u64)>,
    model: &mut Model,
    producer: &mut Producer,
    consumer: &mut Consumer,
    report: &mut ChaosReport,
) -> Result<(), String> {
    for (pi, party) in parties.iter_mut().enumerate() {
        // Publish ids are per connection: only client 1's are the producer's.
        let mine = pi == 1;
        let member = pi == 2;
        for e in sim.take_events(party.idx) {
            match e {
                ClientEvent::Reply { request_id, reply } if member && consumer.polls.remove(&request_id) => {
                    let Reply::GroupRecords(records) = reply else {
                        return Err(format!("a poll answered with {reply:?}"));
                    };
                    for rec in records {
                        if consumer.confirmed.contains(&rec.offset) {
                            return Err(format!(
                                "group record {} delivered again after its ack was confirmed",
                                rec.offset
                            ));
                        }
                        report.group_deliveries += 1;
                        consumer.delivered.insert(rec.offset);
                        consumer.claimed.insert(rec.offset);
                    }
                }
                ClientEvent::Reply { request_id, reply: Reply::Done }
                    if member && consumer.acks.contains_key(&request_id) =>
                {
                    if let Some(o) = consumer.acks.remove(&request_id) {
                        report.group_acks += 1;
                        consumer.confirmed.insert(o);
                    }
                }
                ClientEvent::RequestFailed { request_id, .. } if member => {
                    consumer.acks.remove(&request_id); // a stale claim: the record comes back
                    consumer.polls.remove(&request_id);
                }
                ClientEvent::PublishAcked { id, offset, .. } => {
                    party.answered.push(id);
                    if let Some(send) = mine.then(|| producer.in_flight.remove(&id)).flatten() {
                        if offset.is_none() {
                            return Err(format!("idempotent batch {} acknowledged without its offset", send.sequence));
                        }
                        producer.state.handle_outcome(send, Outcome::Appended { offset }, sim.now);
                    }
                    let (stream, payloads) = party.sent.get(&id).ok_or("ack for a publish never sent")?;
                    // Only an ack after the write (it carries the offset) promises durability;
                    // one on enqueue may be lost by a crash, as the spec says.
                    if let Some(o) = offset {
                        for (i, p) in payloads.iter().enumerate() {
                            acked.insert(p.clone(), (*stream, o + i as u64));
                        }
                    }
                }
                ClientEvent::PublishFailed { id, error } => {
                    party.answered.push(id);
                    if let Some(send) = mine.then(|| producer.in_flight.remove(&id)).flatten() {
                        producer.state.handle_outcome(send, Outcome::Failed(error), sim.now);
                    }
                }
                // A refusal is the producer's to judge: a gap behind an earlier batch that failed
                // is sent again after it; anything else stops the producer (checked below).
                ClientEvent::PublishRefused { id, reason, message } if mine => {
                    party.answered.push(id);
                    if let Some(send) = producer.in_flight.remove(&id) {
                        report.gaps_after_failure += 1;
                        producer.state.handle_outcome(send, Outcome::Refused { reason, message }, sim.now);
                    }
                }
                ClientEvent::Events { sub, batch } => {
                    let Some(s) = party.subs.get_mut(&sub) else { continue };
                    let base = batch.base_offset.ok_or("durable stream without offsets")?;
                    for (i, p) in batch.records.payloads().enumerate() {
                        s.got.push((base + i as u64, p));
                    }
                }
                ClientEvent::SubscriptionEnded { sub, reason: EndReason::Lagged { .. } } => {
                    if let Some(s) = party.subs.get_mut(&sub) {
                        s.lagged = true;
                    }
                }
                ClientEvent::Reply { request_id, reply: Reply::CacheValue { value, .. } } => {
                    cache_answer(party, model, report, request_id, value)?
                }
                ClientEvent::Reply { request_id, reply: Reply::Done } => {
                    cache_answer(party, model, report, request_id, None)?
                }
                _ => {}
            }
        }
    }
    while let Some(e) = producer.state.poll_event() {
        if let ProducerEvent::Stopped { error, .. } = e {
            return Err(format!("the idempotent producer stopped: {error}"));
        }
    }
    Ok(())
}

/// Applies a cache answer to the model, or checks a read against it.
fn cache_answer(
    party: &mut Party,
    model: &mut Model,
    report: &mut ChaosReport,
    request_id: u64,
    value: Option<Bytes>,
) -> Result<(), String> {
    let Some((key, op)) = party.cache_ops.remove(&request_id) else { return Ok(()) };
    match op {
        CacheOp::Read if !model.unknown.contains(&key) => {
            report.cache_reads += 1;
            let want = model.values.get(&key).cloned();
            if value != want {
                return Err(format!("cache read of {key}: got {value:?}, model {want:?}"));
            }
        }
        CacheOp::Read => {}
        CacheOp::Put(v) => {
            model.values.insert(key.clone(), v);
            model.unknown.remove(&key);
        }
        CacheOp::Delete => {
            model.values.remove(&key);
            model.unknown.remove(&key);
        }
    }
    Ok(())
}

/// Where retention has moved the start of `stream` (shard 0): records below it may be gone.
fn truncated_below(sim: &Sim, stream: &str) -> u64 {
    sim.truncations
        .iter()
        .filter(|(s, shard, _)| s == stream && *shard == 0)
        .map(|(_, _, start)| *start)
        .max()
        .unwrap_or(0)
}

fn check_party(
    party: &Party,
    stored: &HashMap<Bytes, (String, u64)>,
    sim: &Sim,
    report: &mut ChaosReport,
) -> Result<(), String> {
    // Acks in send order (those that came; a lost connection leaves the rest unknown).
    let sent_order: Vec<PublishId> = party.order.iter().copied().filter(|id| party.answered.contains(id)).collect();
    if sent_order != party.answered {
        return Err(format!("acks out of send order: sent {:?}, answered {:?}", party.order, party.answered));
    }
    let by_offset: HashMap<(&str, u64), &Bytes> = stored.iter().map(|(p, (s, o))| ((s.as_str(), *o), p)).collect();
    for (sub, SubLog { stream, got, lagged }) in &party.subs {
        let name = STREAMS[*stream];
        for w in got.windows(2) {
            if w[0].0 >= w[1].0 {
                return Err(format!("sub {sub}: offsets not increasing: {} then {}", w[0].0, w[1].0));
            }
            let missing: Vec<u64> = (w[0].0 + 1..w[1].0).filter(|o| by_offset.contains_key(&(name, *o))).collect();
            if !missing.is_empty() && !party.slow_ever && !lagged && sim.broker.stats().records_dropped == 0 {
                return Err(format!("sub {sub}: stored offsets {missing:?} skipped with no drop"));
            }
        }
        for (o, p) in got {
            match stored.get(p) {
                Some((s, so)) if s == name && so == o => report.delivered += 1,
                None if *o < truncated_below(sim, name) => report.delivered += 1,
                // Delivered, then lost by a crash before... cannot happen: only stored records
                // are delivered.
                other => return Err(format!("sub {sub}: delivered {p:?} at {o}, storage has {other:?}")),
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_run_is_a_function_of_its_seed() {
        let t0 = crate::transport::test_epoch();
        let a = run_seed(42, t0, 300);
        let b = run_seed(42, t0, 300);
        assert_eq!(a, b);
    }
}
