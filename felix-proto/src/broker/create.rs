//! `stream_create` (D60): many streams in one request, each with its own shard count,
//! replication and durability. A single broker creates them at once and answers once storage
//! has recorded each durable one's shard count (so a restart brings it back with them, even
//! before its first record); a broker of a cluster proposes them to the metadata group, all in
//! one ready, and answers that they were proposed.

use super::*;
use crate::error_code::ErrorCode;
use crate::message::{self, Message, NewStream};
use crate::shard::MAX_SHARDS;
use crate::transport::{ConnId, WriteToken};
use std::collections::{BTreeMap, BTreeSet};
use std::time::Instant;

/// The most replicas a `stream_create` may ask for per shard (a Raft group larger than seven
/// costs every write more than it adds: Kafka and etcd stop at the same size).
pub const MAX_REPLICATION: u32 = 7;

/// `stream_create` requests waiting for storage to record their streams.
#[derive(Debug, Default)]
pub(super) struct Creates {
    next: u64,
    pending: BTreeMap<u64, PendingCreate>,
    /// Storage's token of each stream being recorded → its request.
    tokens: BTreeMap<WriteToken, u64>,
}

#[derive(Debug)]
struct PendingCreate {
    conn: ConnId,
    stream: crate::transport::StreamId,
    answer: message::StreamCreateOk,
    /// Streams storage has not recorded yet.
    waiting: usize,
    /// What storage said when it could not record one.
    failed: Option<String>,
}

impl Broker {
    /// Serves `stream_create`: checks every stream first (names, permission, shard count,
    /// replication, the namespace's quota), so a refused request creates nothing.
    pub(super) fn stream_create(&mut self, conn: ConnId, st: &mut CtlStream, c: message::StreamCreate, now: Instant) {
        let now = self.clock.advance(now);
        let new = match self.check_create(st, &c) {
            Ok(new) => new,
            Err(r) => return self.refuse(conn, st, r),
        };
        let mut answer = message::StreamCreateOk { request_id: c.request_id, created: Vec::new(), existed: Vec::new() };
        let d = self.cfg.default_stream.clone();
        let mut recording = Vec::new();
        for (s, existing) in c.streams.into_iter().zip(new) {
            if let Some(shards) = existing {
                answer.existed.push(message::ExistingStream { stream: s.stream, shards });
                continue;
            }
            let shards = s.shards.unwrap_or(d.shards).max(1);
            let durable = s.durable.unwrap_or(d.durable);
            let replication = s.replication.unwrap_or(d.replication).max(1);
            if self.membership.view.is_some() {
                // The cluster creates it on every broker once the metadata group commits it;
                // a create of a stream proposed meanwhile by another request is refused there
                // and changes nothing.
                self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ProposeStream {
                    tenant_id: c.tenant_id.clone(),
                    namespace: c.namespace.clone(),
                    stream: s.stream.clone(),
                    shards,
                    ephemeral: !durable,
                    replication,
                }));
            } else {
                let cfg = StreamConfig { shards, durable, replication: 1, ..d.clone() };
                self.create_stream(key(&c.tenant_id, &c.namespace, &s.stream), cfg);
                if durable {
                    let token = self.ids.write();
                    recording.push(token);
                    self.out.push_back(BrokerOutput::Storage(StorageOutput::CreateStream {
                        token,
                        tenant_id: c.tenant_id.clone(),
                        namespace: c.namespace.clone(),
                        stream: s.stream.clone(),
                        shards,
                    }));
                }
            }
            answer.created.push(s.stream);
        }
        let _ = now;
        if recording.is_empty() {
            return self.send(conn, st, json_frame(&Message::StreamCreateOk(answer)));
        }
        // Answered in its turn once storage recorded every durable stream it created.
        let id = self.node.creates.next;
        self.node.creates.next += 1;
        Self::hold(st, HeldFor::Create(id));
        for t in &recording {
            self.node.creates.tokens.insert(*t, id);
        }
        let waiting = recording.len();
        self.node.creates.pending.insert(id, PendingCreate { conn, stream: st.id, answer, waiting, failed: None });
    }

    /// Storage recorded (or could not record) a created stream's shard count
    /// ([`StorageOutput::CreateStream`]). The request is answered once every one of its
    /// streams is: `stream_create_ok`, or a `storage` error naming what failed (the streams
    /// are created in memory all the same; the failed ones are not brought back by a restart
    /// before their first record).
    pub fn handle_stream_recorded(&mut self, token: WriteToken, result: Result<(), String>, now: Instant) {
        self.clock.advance(now);
        let Some(id) = self.node.creates.tokens.remove(&token) else { return };
        let Some(p) = self.node.creates.pending.get_mut(&id) else { return };
        p.waiting = p.waiting.saturating_sub(1);
        if let Err(e) = result {
            p.failed.get_or_insert(e);
        }
        if p.waiting > 0 {
            return;
        }
        let Some(p) = self.node.creates.pending.remove(&id) else { return };
        let m = match p.failed {
            None => Message::StreamCreateOk(p.answer),
            Some(e) => {
                let r = Refusal::new(
                    ErrorCode::Storage,
                    format!("the streams were created, but storage could not record their shard counts: {e}"),
                );
                match self.conns.get(&p.conn).and_then(|c| c.streams.get(&p.stream)) {
                    Some(st) => Self::error_message(&Self::features_of(st), &r),
                    None => return,
                }
            }
        };
        self.fill_held(p.conn, p.stream, HeldFor::Create(id), json_frame(&m));
    }

    /// Checks a `stream_create` whole; for each stream, its shard count when it exists already.
    fn check_create(&self, st: &CtlStream, c: &message::StreamCreate) -> Result<Vec<Option<u32>>, Refusal> {
        let bad = |m: String| Refusal::new(ErrorCode::InvalidRequest, m);
        requests::check_names(&[("tenant", &c.tenant_id), ("namespace", &c.namespace)])?;
        if c.streams.is_empty() || c.streams.len() > message::MAX_STREAMS_PER_CREATE {
            return Err(bad(format!(
                "stream_create names {} streams: 1 to {} are accepted",
                c.streams.len(),
                message::MAX_STREAMS_PER_CREATE
            )));
        }
        let mut seen = BTreeSet::new();
        let mut existing = Vec::with_capacity(c.streams.len());
        let mut new = 0u64;
        for s in &c.streams {
            check_new_stream(s, self.membership.view.is_some())?;
            if !seen.insert(s.stream.as_str()) {
                return Err(bad(format!("stream {} is named twice", s.stream)));
            }
            self.authorize(st, &c.tenant_id, &c.namespace, &s.stream, Action::Admin)?;
            let shards = match &self.membership.view {
                Some(view) => view.shard_count(&crate::shard::ShardId::of(
                    crate::shard::Kind::Stream,
                    &c.tenant_id,
                    &c.namespace,
                    &s.stream,
                    0,
                )),
                None => self
                    .node
                    .streams
                    .get(KeyRef(&c.tenant_id, &c.namespace, &s.stream).q())
                    .map(|e| e.shards.len() as u32),
            };
            new += u64::from(shards.is_none());
            existing.push(shards);
        }
        if let Some(max) = self.node.limits.max_streams(&c.tenant_id, &c.namespace) {
            let have = self
                .node
                .streams
                .keys()
                .filter(|k| k.tenant() == c.tenant_id && k.namespace() == c.namespace && !syslog::is_sys(k))
                .count() as u64;
            if have + new > u64::from(max) {
                return Err(Refusal::new(
                    ErrorCode::LimitExceeded,
                    format!(
                        "namespace {}/{} has {have} of its {max} stream(s): {new} more are not created",
                        c.tenant_id, c.namespace
                    ),
                ));
            }
        }
        Ok(existing)
    }
}

/// One stream of a `stream_create`: a name a new stream may take, a shard count the cluster
/// takes, replication only where there are replicas to hold.
fn check_new_stream(s: &NewStream, clustered: bool) -> Result<(), Refusal> {
    let bad = |m: String| Refusal::new(ErrorCode::InvalidRequest, m);
    requests::check_names(&[("stream", &s.stream)])?;
    if s.stream.starts_with(syslog::SYS_PREFIX) {
        return Err(bad(format!("stream names starting with {} are reserved for the broker", syslog::SYS_PREFIX)));
    }
    requests::check_new_name("stream", &s.stream)?;
    if let Some(n) = s.shards
        && !(1..=MAX_SHARDS).contains(&n)
    {
        return Err(bad(format!("stream {} asks for {n} shards: 1 to {MAX_SHARDS} are accepted", s.stream)));
    }
    match s.replication {
        Some(r) if !(1..=MAX_REPLICATION).contains(&r) => Err(bad(format!(
            "stream {} asks for {r} replicas per shard: 1 to {MAX_REPLICATION} are accepted",
            s.stream
        ))),
        Some(r) if r > 1 && !clustered => {
            Err(bad(format!("stream {} asks for {r} replicas: a broker that runs alone keeps one", s.stream)))
        }
        Some(r) if r > 1 && s.durable == Some(false) => {
            Err(bad(format!("stream {}: a replicated stream is durable (its log is its replicas' log)", s.stream)))
        }
        _ => Ok(()),
    }
}
