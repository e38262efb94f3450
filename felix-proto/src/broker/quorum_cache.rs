//! Replicated (`quorum`) caches: a cache whose changes are the entries of its own Raft group
//! ([`crate::cluster::replica::Replica`], hosted by the cluster node like a replicated stream's
//! shard), so its values, versions and watch offsets survive the loss of any minority of its
//! replicas and every restart.
//!
//! The leader never changes the cache itself. A write becomes an operation ([`CacheOp`]: a put,
//! conditional put, delete, conditional delete, counter add, or an expiry) proposed to the group
//! with the leader's wall-clock time; every replica, the leader included, applies the committed
//! operations in log order ([`Broker::apply_replicated_cache`]). An operation's outcome (applied
//! or not, the version written, the value removed, the sum) depends only on the log: conditions
//! and TTLs are decided on the entry's wall time, versions are the offsets the group gives, so
//! every replica holds the same cache. The leader answers the client once its operation
//! committed and was applied; `leadership_lost` and `quorum_timeout` are outcome unknown, like a
//! replicated publish.
//!
//! Reads (`cache_get`, `counter_get`, watches) are served by the leader from what committed
//! (a leader deposed by a partition it has not noticed may answer a read an election timeout
//! old). Expiry deletes are operations too: the leader's once-a-second pass proposes one per due
//! key. A cache's state is part of its group's snapshots (its values are the fold of the whole
//! log), which bounds its size: [`MAX_QUORUM_CACHE_BYTES`] of keys and values.

use super::*;
use crate::binary::Records;
use crate::error_code::{ErrorCode, RetryClass};
use crate::message::{self, B64, Message};
use crate::shard::metadata::ClusterFacts;
use crate::shard::replicated::{Answer, ReplicatedBatch};
use crate::shard::{Kind, ShardId};
use crate::transport::{ConnId, StreamId, WriteToken};
use bytes::{BufMut, Bytes};
use std::time::Instant;

pub(crate) use crate::shard::cache_op::{CacheOp, op_key};

/// A replicated cache's checkpoint kept unencoded ([`Broker::quorum_cache_state`]): the cache
/// frozen, its values shared with the live cache, and its counters' bytes (small: a name and
/// a sum each).
#[derive(Debug, Clone)]
pub(crate) struct CacheSection {
    cache: super::cache::FrozenCache,
    counters: Vec<u8>,
}

impl CacheSection {
    /// Appends the state's bytes, as [`Broker::quorum_cache_state`] appends them when it
    /// encodes the state whole.
    pub(crate) fn encode_into(&self, b: &mut Vec<u8>) {
        self.cache.encode_into(b);
        b.extend_from_slice(&self.counters);
    }

    /// [`encode_into`](Self::encode_into)'s bytes handed to `each` in pieces, each value from
    /// where it is.
    pub(crate) fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        self.cache.encode_pieces(each);
        each(&self.counters);
    }

    /// The bytes [`encode_into`](Self::encode_into) appends, exactly.
    pub(crate) fn encoded_len(&self) -> usize {
        self.cache.encoded_len() + self.counters.len()
    }
}

/// Key and value bytes a replicated cache may hold: its whole state travels in one snapshot
/// message to a follower that fell behind, under the peer frame limit.
pub const MAX_QUORUM_CACHE_BYTES: usize = 32 << 20;

/// Expiry deletes the leader proposes per cache per pass.
const EXPIRIES_PER_PASS: usize = 1024;

/// Outcomes remembered per cache for answers not given yet (the group answers in log order,
/// right after applying, so only a handful are ever waiting).
const MAX_RESULTS: usize = 4096;

/// What applying one operation did (on every replica alike).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Outcome {
    /// A conditional write's condition held (always for the others).
    applied: bool,
    /// The version written, or (not applied) the key's live version.
    version: Option<u64>,
    /// The value a delete removed.
    removed: Option<Bytes>,
    /// The sum after a counter add.
    sum: Option<i64>,
    /// Refused: the cache would pass [`MAX_QUORUM_CACHE_BYTES`].
    full: bool,
}

/// The answer a client waits for, by request.
#[derive(Debug, Clone)]
pub(super) enum CacheReply {
    /// `cache_ok` (with a request id) or `ok`.
    Put { request_id: Option<u64> },
    /// `cache_condition_result`.
    Condition { request_id: u64 },
    /// `cache_value` with the removed value.
    Delete { tenant_id: String, namespace: String, cache: String, key: String, request_id: Option<u64> },
    /// `counter_value`.
    Counter { request_id: u64 },
}

/// A proposed operation waiting for its group.
#[derive(Debug)]
pub(super) struct CacheWrite {
    cache: Key,
    /// Who is answered, with what (none for an expiry).
    to: Option<(ConnId, StreamId, ClientOffer, CacheReply)>,
}

/// The shard id of a cache's one shard.
fn cache_shard(k: &Key) -> ShardId {
    ShardId {
        kind: Kind::Cache,
        tenant: k.tenant().to_owned(),
        namespace: k.namespace().to_owned(),
        name: k.name().to_owned(),
        shard: 0,
    }
}

impl Broker {
    /// Whether the cache is replicated (this broker holds one of its replicas).
    pub(super) fn is_quorum_cache(&self, k: &Key) -> bool {
        self.node.caches.get(k).is_some_and(|c| c.replica.is_some())
    }

    /// The cache of a replicated cache's shard this broker serves as one of its replicas,
    /// created (empty, following) on first sight: a replica starts before any client named the
    /// cache here.
    fn quorum_cache(&mut self, shard: &ShardId) -> &mut Cache {
        let c = self.quorum_cache_data(shard);
        if c.replica.is_none() {
            c.replica = Some(ReplicaRole::Following { leader: None });
        }
        c
    }

    /// The contents of a replicated cache's shard as a replica here applies its group's log,
    /// whether or not this broker serves it: a replica the metadata no longer names lingers
    /// while its group may still count it, applying what commits, and is named again with its
    /// log (and these contents) whole, or dropped ([`Broker::forget_replica_state`]).
    fn quorum_cache_data(&mut self, shard: &ShardId) -> &mut Cache {
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let c = self.node.caches.entry(k).or_default();
        if !c.group {
            // Everything it holds comes from the group's log from now on, versions included:
            // not the wall-clock seed a configured cache starts its versions after, which
            // differs from broker to broker (every replica must give a change one version).
            c.empty_keeping_role(true);
        }
        c
    }

    /// This broker's replica of a replicated shard was dropped (the shard deleted, or its
    /// group let it go): a cache's contents, which that replica's log made, go with it (a
    /// replica started here again builds them afresh from its group).
    pub(crate) fn forget_replica_state(&mut self, shard: &ShardId) {
        if shard.kind != Kind::Cache {
            return;
        }
        if let Some(c) = self.node.caches.get_mut(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())
            && c.group
        {
            c.empty_keeping_role(false);
        }
    }

    /// Marks the caches whose replicas this broker holds, as the metadata names them.
    pub(super) fn note_quorum_caches(&mut self, md: &impl ClusterFacts, local: &str) {
        let mine: Vec<ShardId> = md
            .replicated_shards()
            .filter(|(s, r)| s.kind == Kind::Cache && r.iter().any(|n| n == local))
            .map(|(s, _)| s.clone())
            .collect();
        for s in mine {
            self.quorum_cache(&s);
        }
        // And stops serving those it is no longer named a replica of (a replica move took its
        // place): the cache is now served by its group's leader elsewhere, not by the role its
        // replica here last had (a follower without a leader said "electing" for ever; found by
        // the world simulation once replicas moved by themselves). Its contents stay while the
        // replica lingers ([`Broker::forget_replica_state`] once it goes).
        let left: Vec<Key> = self
            .node
            .caches
            .iter()
            .filter(|(k, c)| {
                let s = cache_shard(k);
                c.replica.is_some()
                    && md.replicas(&s).is_some_and(|r| !r.iter().any(|n| n == local))
                    && md.moving(&s).is_none_or(|m| m.to != local)
            })
            .map(|(k, _)| k.clone())
            .collect();
        for k in left {
            if let Some(c) = self.node.caches.get_mut(&k) {
                c.replica = None;
                c.read_lease = None;
                c.results.clear();
            }
        }
    }

    /// Proposes a client's write to a replicated cache this broker leads; the client's answer
    /// waits (in its turn on its stream) for the group.
    pub(super) fn propose_cache_op(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        k: &Key,
        op: CacheOp,
        reply: CacheReply,
        now: Instant,
    ) {
        if op_key(&op).len() > u16::MAX as usize {
            return self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, "cache key longer than 65535 bytes"));
        }
        let token = self.propose_cache_ops(k, &[op], now);
        self.node
            .cache_writes
            .insert(token, CacheWrite { cache: k.clone(), to: Some((conn, st.id, Self::features_of(st), reply)) });
        Self::hold(st, HeldFor::Write(token));
    }

    /// Proposes operations as one batch; the token its answer comes with.
    fn propose_cache_ops(&mut self, k: &Key, ops: &[CacheOp], now: Instant) -> WriteToken {
        let token = self.ids.write();
        let payloads: Vec<Bytes> = ops.iter().map(CacheOp::encode).collect();
        let batch = ReplicatedBatch {
            key: None,
            producer: None,
            timestamp_micros: self.wall.micros(now),
            publisher: None,
            records: Records::from_payloads(payloads.iter()).unwrap_or_default(),
            expected_offset: None,
            state: None,
            side: false,
        };
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Replicate { token, shard: cache_shard(k), batch }));
        token
    }

    /// The leader's expiry pass over its replicated caches: one expiry operation per due key
    /// (applied only if the key is still at that version and expired at the entry's time, so a
    /// repeated or late one changes nothing).
    pub(super) fn quorum_cache_sweep(&mut self, now: Instant) {
        let mut due: Vec<(Key, Vec<CacheOp>)> = self
            .node
            .caches
            .iter()
            .filter(|(_, c)| c.replica == Some(ReplicaRole::Leading) && c.has_expiring())
            .map(|(k, c)| {
                let ops =
                    c.due(now, EXPIRIES_PER_PASS).into_iter().map(|(key, version)| CacheOp::Expire { key, version });
                (k.clone(), ops.collect::<Vec<_>>())
            })
            .filter(|(_, ops)| !ops.is_empty())
            .collect();
        due.sort_by(|a, b| a.0.cmp(&b.0));
        for (k, ops) in due {
            let token = self.propose_cache_ops(&k, &ops, now);
            self.node.cache_writes.insert(token, CacheWrite { cache: k, to: None });
        }
    }

    /// Committed operations of a replicated cache (on every replica, in log order), the first
    /// at `offset`: applied to the cache, watchers told, outcomes kept for the leader's answers.
    pub(super) fn apply_replicated_cache(
        &mut self,
        shard: &ShardId,
        offset: u64,
        batch: ReplicatedBatch,
        now: Instant,
    ) {
        let wall = batch.timestamp_micros;
        let clock = self.wall;
        let expiry = |ttl: Option<u64>| {
            ttl.map(|ms| {
                let w = wall.saturating_add(ms.saturating_mul(1000));
                (clock.instant_at(w), w)
            })
        };
        let ops: Vec<(u64, Option<CacheOp>)> =
            batch.records.payloads().enumerate().map(|(i, p)| (offset + i as u64, CacheOp::decode(&p))).collect();
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let mut sums = Vec::new();
        for (at, op) in ops {
            let expires = match &op {
                Some(CacheOp::Put { ttl_ms, .. } | CacheOp::PutIf { ttl_ms, .. }) => expiry(*ttl_ms),
                _ => None,
            };
            let c = self.quorum_cache_data(shard);
            let fits = |c: &Cache, key: &str, value: &Bytes| {
                c.bytes() - c.entry_bytes(key) + key.len() + value.len() <= MAX_QUORUM_CACHE_BYTES
            };
            let outcome = match op {
                // Only this crate proposes; an operation that does not read changes nothing on
                // any replica alike.
                None => Outcome::default(),
                Some(CacheOp::Put { key, value, .. }) => {
                    if !fits(c, &key, &value) {
                        Outcome { full: true, ..Outcome::default() }
                    } else {
                        let v = c.put_at(at, key, value, expires);
                        Outcome { applied: true, version: Some(v), ..Outcome::default() }
                    }
                }
                Some(CacheOp::PutIf { key, value, condition, .. }) => {
                    let current = c.live_at(&key, wall);
                    if current != condition {
                        Outcome { applied: false, version: current, ..Outcome::default() }
                    } else if !fits(c, &key, &value) {
                        Outcome { full: true, ..Outcome::default() }
                    } else {
                        let v = c.put_at(at, key, value, expires);
                        Outcome { applied: true, version: Some(v), ..Outcome::default() }
                    }
                }
                Some(CacheOp::Delete { key }) => {
                    let live = c.live_at(&key, wall).is_some();
                    let removed = c.remove_at(at, &key).filter(|_| live);
                    Outcome { applied: true, removed, ..Outcome::default() }
                }
                Some(CacheOp::DeleteIf { key, version }) => {
                    let current = c.live_at(&key, wall);
                    if current == Some(version) {
                        c.remove_at(at, &key);
                        Outcome { applied: true, ..Outcome::default() }
                    } else {
                        Outcome { applied: false, version: current, ..Outcome::default() }
                    }
                }
                Some(CacheOp::Expire { key, version }) => {
                    // Still the version the pass saw, and no longer live at the entry's time.
                    if c.version_of(&key) == Some(version) && c.live_at(&key, wall).is_none() {
                        c.remove_at(at, &key);
                    }
                    Outcome::default()
                }
                Some(CacheOp::CounterAdd { key, delta }) => {
                    sums.push((at, key, delta));
                    continue;
                }
            };
            self.keep_outcome(&k, at, outcome);
        }
        for (at, key_name, delta) in sums {
            let counters = self.node.counters.entry(k.clone()).or_default();
            counters.apply(syslog::CounterOp::Add { key: key_name.clone(), delta });
            let sum = counters.sums.get(&key_name).copied();
            self.keep_outcome(&k, at, Outcome { applied: true, sum, ..Outcome::default() });
        }
        self.cache_fanout(&k, now);
    }

    /// Keeps an operation's outcome for the answer the leader owes (a follower owes none).
    fn keep_outcome(&mut self, k: &Key, at: u64, outcome: Outcome) {
        let Some(c) = self.node.caches.get_mut(k) else { return };
        if !matches!(c.replica, Some(ReplicaRole::Leading | ReplicaRole::Settling)) {
            return;
        }
        c.results.insert(at, outcome);
        while c.results.len() > MAX_RESULTS {
            c.results.pop_first();
        }
    }

    /// The group's answer to a proposed cache operation: `Some(())` when `token` was one.
    pub(super) fn handle_cache_answer(&mut self, token: WriteToken, answer: &Answer) -> Option<()> {
        let w = self.node.cache_writes.remove(&token)?;
        let outcome = match answer {
            Answer::Appended { offset, .. } => {
                self.node.caches.get_mut(&w.cache).and_then(|c| c.results.remove(offset))
            }
            _ => None,
        };
        // An expiry pass's proposal: nobody waits for it.
        let Some((conn, stream, offer, reply)) = w.to else { return Some(()) };
        let refusal = |code, message: &str| Err(Refusal::new(code, message));
        let result = match (answer, outcome) {
            (Answer::Appended { .. }, Some(o)) if o.full => {
                let mut r = Refusal::new(
                    ErrorCode::LimitExceeded,
                    format!(
                        "the replicated cache is full: it holds at most {MAX_QUORUM_CACHE_BYTES} bytes of keys and values"
                    ),
                );
                r.retry = RetryClass::Fatal;
                Err(r)
            }
            (Answer::Appended { .. }, Some(o)) => Ok(o),
            (Answer::Appended { .. }, None) => refusal(
                ErrorCode::Unacknowledged,
                "the write committed but its outcome was not kept here; read the key to see it",
            ),
            (Answer::LeadershipLost, _) => refusal(
                ErrorCode::LeadershipLost,
                "this broker stopped leading the cache before a majority confirmed the write: it may or may not be applied",
            ),
            (Answer::QuorumTimeout, _) => refusal(
                ErrorCode::QuorumTimeout,
                "no majority of the cache's replicas confirmed the write in time: it may or may not be applied",
            ),
            (Answer::Refused(_) | Answer::Applied | Answer::NoEnvelopes, _) => {
                refusal(ErrorCode::Internal, "the cache's group refused the write")
            }
            (Answer::NotProposed, _) => Err(Unavailable::Moving.refusal(0, "another of its replicas")),
        };
        let m = match result {
            Err(r) => Self::error_message(&offer, &r),
            Ok(o) => match reply {
                CacheReply::Put { request_id: Some(request_id) } => Message::CacheOk(message::CacheOk { request_id }),
                CacheReply::Put { request_id: None } => Message::Ok(message::OkMsg {}),
                CacheReply::Condition { request_id } => Message::CacheConditionResult(message::CacheConditionResult {
                    applied: o.applied,
                    version: o.version,
                    request_id,
                }),
                CacheReply::Delete { tenant_id, namespace, cache, key, request_id } => {
                    Message::CacheValue(message::CacheValue {
                        tenant_id,
                        namespace,
                        cache,
                        key,
                        value: o.removed.map(B64),
                        request_id,
                        version: None,
                    })
                }
                CacheReply::Counter { request_id } => {
                    Message::CounterValue(message::CounterValue { value: o.sum, request_id })
                }
            },
        };
        self.fill_held(conn, stream, HeldFor::Write(token), json_frame(&m));
        Some(())
    }

    /// A replicated cache's state for its group's checkpoint: its values and its counters,
    /// appended to `b`; or, when its values are worth keeping aside
    /// ([`super::cache::Cache::freeze`]), nothing appended and the whole state returned
    /// unencoded, its values shared with the live cache: the checkpoint then holds no copy
    /// of them, and a compaction writes them into the snapshot on disk from where they are.
    pub(super) fn quorum_cache_state(&self, shard: &ShardId, b: &mut Vec<u8>) -> Option<CacheSection> {
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let frozen = self.node.caches.get(&k).and_then(|c| c.freeze());
        if frozen.is_none() {
            match self.node.caches.get(&k) {
                Some(c) => c.encode_state_into(b),
                None => Cache::default().encode_state_into(b),
            }
        }
        let mut counters = Vec::new();
        let mut sums: Vec<(&String, &i64)> =
            self.node.counters.get(&k).map(|c| c.sums.iter().collect()).unwrap_or_default();
        sums.sort_unstable();
        counters.put_u32(sums.len() as u32);
        for (key, sum) in sums {
            counters.put_u16(key.len() as u16);
            counters.extend_from_slice(key.as_bytes());
            counters.put_u64(*sum as u64);
        }
        match frozen {
            Some(cache) => Some(CacheSection { cache, counters }),
            None => {
                b.extend_from_slice(&counters);
                None
            }
        }
    }

    /// A replicated cache's replica was restored from a snapshot: the cache and its counters
    /// become the snapshot's. Its watchers (a follower has none) resume elsewhere.
    pub(super) fn restore_quorum_cache(&mut self, shard: &ShardId, state: &Bytes) {
        let mut r = CacheStateReader::default();
        r.feed(state);
        self.restore_quorum_cache_read(shard, r);
    }

    /// [`restore_quorum_cache`](Self::restore_quorum_cache) of a state read a piece at a time
    /// (from the snapshot on disk), whole now.
    pub(super) fn restore_quorum_cache_read(&mut self, shard: &ShardId, state: CacheStateReader) {
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        let wall = self.wall;
        let (cache, sums) = state.finish();
        let read = self.quorum_cache_data(shard).restore_state(cache, |w| wall.instant_at(w));
        self.node.counters.entry(k).or_default().sums = if read { sums } else { HashMap::new() };
    }

    /// The role of this broker's replica of a replicated cache changed: a broker that stops
    /// leading ends the cache's watches (after what they were sent: they resume on the new
    /// leader at the next offset, which every replica gives the same change) and forgets the
    /// outcomes it kept.
    pub(super) fn set_cache_replica_role(&mut self, shard: &ShardId, role: ReplicaRole) {
        let leading = role == ReplicaRole::Leading;
        let hint = match &role {
            ReplicaRole::Following { leader: Some(h) } => Some(h.clone()),
            _ => None,
        };
        let c = self.quorum_cache(shard);
        if c.replica.as_ref() == Some(&role) {
            return;
        }
        c.replica = Some(role);
        if leading {
            return;
        }
        c.results.clear();
        let resume_from = Some(c.tail());
        let k = key(&shard.tenant, &shard.namespace, &shard.name);
        for (conn, id) in self.node.cache_watchers.remove(&k).unwrap_or_default() {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            let m = message::ShardMoved {
                subscription_id: id,
                resume_from,
                node_id: hint.as_ref().map(|h| h.node_id.clone()).filter(|n| !n.is_empty()),
                addr: hint.as_ref().and_then(|h| h.addr.clone()),
                generation: hint.as_ref().map_or(0, |h| h.generation),
            };
            sub.on(SubEvent::End(Ending::Moved(m)));
            self.pump(conn, id);
        }
    }

    /// How long this broker's replica of a replicated cache may answer reads
    /// ([`crate::cluster::replica::Replica::read_lease`]; `None`: not now).
    pub(crate) fn set_read_lease(&mut self, shard: &ShardId, until: Option<Instant>) {
        if shard.kind == Kind::Cache {
            // (Only on a replica the metadata names: a lingering one serves nothing.)
            if let Some(c) = self
                .node
                .caches
                .get_mut(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())
                .filter(|c| c.replica.is_some())
            {
                c.read_lease = until;
            }
        } else if let Some(sh) = self
            .node
            .streams
            .get_mut(KeyRef(&shard.tenant, &shard.namespace, &shard.name).q())
            .and_then(|e| e.shards.get_mut(shard.shard as usize))
        {
            sh.read_lease = until;
        }
    }

    /// Whether this broker's replica of `shard` needs a read lease: always for a cache; for a
    /// stream, while it has consumer groups here (their polls are served only within one).
    pub(crate) fn wants_read_lease(&self, shard: &ShardId) -> bool {
        shard.kind == Kind::Cache
            || self.node.groups.contains_key(&(key(&shard.tenant, &shard.namespace, &shard.name), shard.shard))
    }

    /// `Err` when a read of replicated cache `k` may not be answered here now: its replica
    /// leads but holds no read lease (a majority has not confirmed it leads lately: it may
    /// have been deposed by a partition it has not noticed). Retried, the read finds a
    /// confirmed leader, here or elsewhere.
    pub(super) fn quorum_read_allowed(&self, k: &Key, now: Instant) -> Result<(), Refusal> {
        let Some(c) = self.node.caches.get(k).filter(|c| c.replica.is_some()) else { return Ok(()) };
        if c.read_lease.is_some_and(|until| now < until) {
            return Ok(());
        }
        Err(Unavailable::ConfirmingLeader.refusal(0, ""))
    }

    /// Where a request for a replicated cache whose replica is here goes: `None` to serve it
    /// here (this replica leads), else the refusal or the leader to send it to.
    pub(super) fn quorum_cache_home(&self, k: &Key) -> Option<Result<crate::binary::OwnerHint, Refusal>> {
        match self.node.caches.get(k)?.replica.as_ref()? {
            ReplicaRole::Leading => None,
            ReplicaRole::Settling => Some(Err(Unavailable::NotReady.refusal(0, ""))),
            ReplicaRole::Following { leader: None } => Some(Err(Unavailable::NoLeader.refusal(0, ""))),
            ReplicaRole::Following { leader: Some(h) } => Some(Ok(h.clone())),
        }
    }

    /// A `cache_put` for a replicated cache.
    pub(super) fn quorum_put(&mut self, conn: ConnId, st: &mut CtlStream, k: &Key, p: message::CachePut, now: Instant) {
        let op = CacheOp::Put { key: p.key, value: p.value.0, ttl_ms: p.ttl_ms };
        self.propose_cache_op(conn, st, k, op, CacheReply::Put { request_id: p.request_id }, now);
    }
}

/// Fuzzing: any bytes as a replicated cache's entry (a batch of operations) and as the cache
/// state of its snapshot. Never a panic; an operation that decodes encodes to one that decodes
/// to it again.
#[cfg(any(test, fuzzing, feature = "testkit"))]
pub(crate) fn fuzz_cache_entry(data: &[u8], t0: Instant) {
    // The same bytes as a stream replica's groups state: read whole or not at all, and read
    // in pieces (cut where the first byte says) as whole.
    let whole = super::stream_state::decode_stream_state(&Bytes::copy_from_slice(data));
    if let Some((_, ops, _)) = &whole {
        assert!(ops.iter().all(|op| matches!(op, super::group::GroupOp::Snapshot { .. })));
    }
    let cut = data.first().map_or(0, |b| usize::from(*b) % (data.len() + 1));
    let mut pieces = super::StreamStateReader::default();
    pieces.feed(&data[..cut]);
    pieces.feed(&data[cut..]);
    assert_eq!(pieces.finish(), whole, "read in pieces as whole");
    if let Ok(batch) = ReplicatedBatch::decode(data) {
        for p in batch.records.payloads() {
            if let Some(op) = CacheOp::decode(&p) {
                assert_eq!(CacheOp::decode(&op.encode()), Some(op));
            }
        }
    }
    let mut c = Cache::default();
    let whole = Cache::read_state(data);
    // Read in pieces (cut where the second byte says), as whole.
    let cut = data.get(1).map_or(0, |b| usize::from(*b) % (data.len() + 1));
    let mut pieces = CacheStateReader::default();
    pieces.feed(&data[..cut]);
    pieces.feed(&data[cut..]);
    assert_eq!(pieces.finish(), whole, "a cache's state read in pieces as whole");
    if c.restore_state(whole.0, |_| t0) {
        // What it took, it writes back the same way.
        let mut again = Cache::default();
        assert!(again.restore_state(Cache::read_state(&c.encode_state()).0, |_| t0));
        assert_eq!(again.encode_state(), c.encode_state());
    }
}

/// Fuzzing seeds: a replicated cache's entry holding one operation of each kind, and the
/// snapshot state of a cache holding two keys (one expiring).
#[cfg(any(test, fuzzing, feature = "testkit"))]
pub(crate) fn cache_entry_samples(t0: Instant) -> (Vec<u8>, Vec<u8>) {
    let ops = [
        CacheOp::Put { key: "k".into(), value: Bytes::from_static(b"v"), ttl_ms: Some(5) },
        CacheOp::PutIf { key: "k".into(), value: Bytes::from_static(b"w"), ttl_ms: None, condition: Some(3) },
        CacheOp::Delete { key: "k".into() },
        CacheOp::DeleteIf { key: "k".into(), version: 4 },
        CacheOp::Expire { key: "k".into(), version: 5 },
        CacheOp::CounterAdd { key: "n".into(), delta: -2 },
    ];
    let payloads: Vec<Bytes> = ops.iter().map(CacheOp::encode).collect();
    let batch = ReplicatedBatch {
        key: None,
        producer: None,
        timestamp_micros: 1_700_000_000_000_000,
        publisher: None,
        records: Records::from_payloads(payloads.iter()).unwrap_or_default(),
        expected_offset: None,
        state: None,
        side: false,
    };
    let mut c = Cache::default();
    c.put_at(7, "a".into(), Bytes::from_static(b"1"), None);
    c.put_at(9, "b".into(), Bytes::from_static(b"2"), Some((t0, 1_700_000_000_000_000)));
    (batch.encode(), c.encode_state())
}
