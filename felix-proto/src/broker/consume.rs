//! The consumer-group requests: checks, claims, durable settles, long polls, answers.
//!
//! A group's durable changes (acks, dead letters, seeks, deletes...) go through the shard's
//! `$groups.SHARD.STREAM` system log and are answered once folded (see `syslog`). On a
//! replicated (`quorum`) shard they are side entries of the shard's own Raft log instead
//! (proposed by the leader, folded on every replica in log order with the records, carried in
//! its checkpoints), so a new leader knows every settlement the old one answered and
//! redelivers only what was never settled. Claims and long polls live in memory (the leader's:
//! a fail-over hands out again what was claimed and not settled). Records handed out below what the shard holds in memory are read back
//! from storage before the answer leaves (the answer's slot is held meanwhile, so a stream's
//! answers stay in order).

use super::group::{Delivery, Group, GroupOp, Member, Parked, PollRequest, Settle};
use super::requests::Missing;
use super::syslog::SysPending;
use super::{
    Broker, BrokerOutput, ClusterOutput, CtlStream, HeldFor, Key, ReadFor, ReadRequest, Refusal, StorageOutput,
    json_frame, key,
};
use crate::broker::auth::Action;
use crate::error_code::{ErrorCode, RetryClass};
use crate::features::Features;
use crate::message::{self, B64, Message, StartPosition};
use crate::shard::replicated::{Answer, ReplicatedBatch};
use crate::storage::StoredBatch;
use crate::transport::{ConnId, ReadToken, StreamId, WriteToken};
use bytes::Bytes;
use std::time::{Duration, Instant};

/// The system log holding the groups of one shard.
pub(crate) fn groups_key(k: &Key, shard: u32) -> Key {
    key(k.tenant(), k.namespace(), &format!("$groups.{shard}.{}", k.name()))
}

/// The stream and shard a `$groups` system log belongs to.
pub(crate) fn parse_groups_key(k: &Key) -> Option<(Key, u32)> {
    let rest = k.name().strip_prefix("$groups.")?;
    let (shard, stream) = rest.split_once('.')?;
    Some((key(k.tenant(), k.namespace(), stream), shard.parse().ok()?))
}

/// The answer a durable group operation owes once it is folded.
#[derive(Debug, Clone)]
pub(crate) enum GroupAnswer {
    /// `cache_ok`.
    Ok(u64),
    /// `group_position` (seek).
    Position { request_id: u64, offset: u64 },
    /// `group_deleted`.
    Deleted { request_id: u64, existed: bool },
    /// Nobody waits (a dead letter after the last attempt lapsed).
    None,
}

/// A group operation on its way to being durable (proposed to a replicated shard, or written
/// to the `$groups` system log), and whom it answers.
#[derive(Debug)]
pub(crate) struct GroupProposal {
    pub(super) conn: ConnId,
    pub(super) stream: StreamId,
    pub(super) data: Key,
    pub(super) shard: u32,
    pub(super) op: GroupOp,
    pub(super) answer: GroupAnswer,
}

/// How a group operation's write ended.
pub(super) enum Settled {
    /// On disk in the `$groups` system log: fold it, then answer.
    Written,
    /// Committed as a side entry of the replicated shard: already folded (it came out of the
    /// log before its answer); answer.
    Applied,
    /// Not written, or not known to be: the refusal to answer with.
    Failed(Refusal),
}

/// A group poll whose records are partly on disk.
#[derive(Debug)]
pub(crate) struct PollFill {
    conn: ConnId,
    stream: StreamId,
    /// The answer's held slot (`None`: the poll is being answered synchronously, and the
    /// first read takes a slot named by its token).
    slot: Option<HeldFor>,
    data: Key,
    shard: u32,
    group: String,
    request: PollRequest,
    deliveries: Vec<Delivery>,
    records: Vec<Option<message::GroupRecord>>,
}

/// A poll's answer: ready, or waiting for a storage read.
pub(crate) enum Filled {
    Ready(Bytes),
    Reading(ReadToken),
}

fn stale(fatal: bool, why: String) -> Refusal {
    let mut r = Refusal::new(ErrorCode::StaleClaim, why);
    if fatal {
        r.retry = RetryClass::Fatal;
    }
    r
}

impl Broker {
    /// The checks of a group request (see `durable_shard`); a refusal is answered here.
    fn group_target(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        (t, ns, s): (&str, &str, &str),
        shard: u32,
        action: Action,
        missing: Missing,
    ) -> Option<Key> {
        match self.durable_shard(st, t, ns, s, shard, action, missing, "a consumer group") {
            Ok(k) => Some(k),
            Err(d) => {
                self.deny(conn, st, d);
                None
            }
        }
    }

    /// [`group_target`](Self::group_target) for a request on a group that must already have
    /// its stream (everything but poll and seek): a missing stream is `not_found`.
    fn existing_group(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        (t, ns, s, shard): (&str, &str, &str, u32),
        action: Action,
    ) -> Option<Key> {
        self.group_target(conn, st, (t, ns, s), shard, action, Missing::NotFound)
    }

    fn group_mut(&mut self, k: &Key, shard: u32, name: &str) -> &mut Group {
        self.node.groups.entry((k.clone(), shard)).or_default().entry(name.to_owned()).or_default()
    }

    fn cache_ok(request_id: u64) -> Bytes {
        json_frame(&Message::CacheOk(message::CacheOk { request_id }))
    }

    /// Writes a group operation; `answer` is sent once it is on disk (in the slot held here).
    #[allow(clippy::too_many_arguments)] // the request's parts
    fn group_write(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        k: &Key,
        shard: u32,
        op: GroupOp,
        answer: GroupAnswer,
        now: Instant,
    ) {
        let token = self.group_persist(conn, st.id, k, shard, op, answer, now);
        Self::hold(st, HeldFor::Write(token));
    }

    /// Makes a group operation durable: a side entry of a replicated shard's log, or a record
    /// of the shard's `$groups` system log. Returns the write's token (its answer's slot).
    #[allow(clippy::too_many_arguments)] // the request's parts
    fn group_persist(
        &mut self,
        conn: ConnId,
        stream: StreamId,
        k: &Key,
        shard: u32,
        op: GroupOp,
        answer: GroupAnswer,
        now: Instant,
    ) -> WriteToken {
        let replicated =
            self.node.streams.get(k).and_then(|e| e.shards.get(shard as usize)).is_some_and(|s| s.serving.is_replica());
        if !replicated {
            let pending = SysPending::Group { conn, stream, data: k.clone(), shard, op: op.clone(), answer };
            return self.sys_append(&groups_key(k, shard), vec![op.encode()], pending, now);
        }
        let token = self.ids.write();
        let batch = ReplicatedBatch::side_entry(self.wall.micros(now), &[op.encode()]);
        let id = super::replicated::stream_shard(k, shard);
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Replicate { token, shard: id, batch }));
        self.node.group_proposals.insert(token, GroupProposal { conn, stream, data: k.clone(), shard, op, answer });
        token
    }

    /// Writes the dead letters a poll or a lapse produced (nobody waits for them).
    fn flush_dead_letters(&mut self, k: &Key, shard: u32, name: &str, now: Instant) {
        let dead = std::mem::take(&mut self.group_mut(k, shard, name).to_dead_letter);
        for offset in dead {
            let op = GroupOp::DeadLetter { group: name.to_owned(), offset };
            self.group_persist(ConnId(0), StreamId(0), k, shard, op, GroupAnswer::None, now);
        }
    }

    /// Committed group operations of a replicated shard (a side entry), folded in log order on
    /// every replica. Checkpoint records are never proposed; bytes that do not decode change
    /// nothing, on any replica alike.
    pub(super) fn fold_group_ops(&mut self, k: &Key, shard: u32, ops: impl Iterator<Item = Bytes>) {
        if self.node.streams.get(k).is_none_or(|e| e.shards.len() <= shard as usize) {
            return;
        }
        for p in ops {
            match GroupOp::decode(&p) {
                None | Some(GroupOp::Reset | GroupOp::Snapshot { .. }) => {}
                Some(op) => {
                    let name = op.group_name().to_owned();
                    self.group_mut(k, shard, &name).apply(&op);
                }
            }
        }
    }

    /// A group operation proposed to a replicated shard was answered.
    pub(super) fn group_answered(&mut self, token: WriteToken, p: GroupProposal, answer: Answer, now: Instant) {
        // Outcome unknown (the codes' own retry class): the entry may still commit.
        let unknown = |code, why: &str| Refusal::new(code, format!("{why}: the group's change may or may not be made"));
        let settled = match answer {
            Answer::Applied => Settled::Applied,
            Answer::LeadershipLost => {
                Settled::Failed(unknown(ErrorCode::LeadershipLost, "this broker stopped leading the shard"))
            }
            Answer::QuorumTimeout => {
                Settled::Failed(unknown(ErrorCode::QuorumTimeout, "no majority of the shard's replicas confirmed it"))
            }
            Answer::NotProposed => {
                Settled::Failed(super::Unavailable::Moving.refusal(p.shard, "another of its replicas"))
            }
            Answer::Appended { .. } | Answer::Refused(_) | Answer::NoEnvelopes => {
                Settled::Failed(Refusal::new(ErrorCode::Internal, "the shard's group took the change as records"))
            }
        };
        self.group_settled(HeldFor::Write(token), p, settled, now);
    }

    /// `Err` when a replicated shard's groups may not be read here now: its replica leads but
    /// holds no read lease (a majority has not confirmed it leads lately: a partition it has
    /// not noticed may have deposed it, and a newer leader may have settled what it would hand
    /// out). The shard is marked as having groups, so the lease is asked for; retried, the
    /// request finds a confirmed leader, here or elsewhere.
    fn group_read_allowed(&mut self, k: &Key, shard: u32, now: Instant) -> Result<(), Refusal> {
        let Some(sh) = self.node.streams.get(k).and_then(|e| e.shards.get(shard as usize)) else { return Ok(()) };
        if !sh.serving.is_replica() || sh.read_lease.is_some_and(|until| now < until) {
            return Ok(());
        }
        self.node.groups.entry((k.clone(), shard)).or_default();
        Err(super::Unavailable::ConfirmingLeader.refusal(shard, ""))
    }

    /// [`group_target`](Self::group_target), and for a read of a replicated shard's groups,
    /// its read lease.
    fn group_read_target(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        target: (&str, &str, &str),
        shard: u32,
        missing: Missing,
        now: Instant,
    ) -> Option<Key> {
        let k = self.group_target(conn, st, target, shard, Action::GroupConsume, missing)?;
        match self.group_read_allowed(&k, shard, now) {
            Ok(()) => Some(k),
            Err(r) => {
                self.refuse(conn, st, r);
                None
            }
        }
    }

    pub(super) fn group_poll(&mut self, conn: ConnId, st: &mut CtlStream, p: message::GroupPoll, now: Instant) {
        let Some(k) =
            self.group_read_target(conn, st, (&p.tenant_id, &p.namespace, &p.stream), p.shard, Missing::Create, now)
        else {
            return;
        };
        if p.consumer.as_ref().is_some_and(|c| c.is_empty() || c.len() > 128) {
            let r = Refusal::new(ErrorCode::InvalidRequest, "consumer names are 1 to 128 bytes");
            return self.refuse(conn, st, r);
        }
        let offer = Self::features_of(st);
        let limits = self.cfg.group_limits;
        let principal = st.session.as_ref().map(|s| s.principal.clone()).unwrap_or_default();
        let visibility = match p.visibility_ms.filter(|v| *v > 0) {
            Some(ms) => Duration::from_millis(ms).min(limits.max_visibility),
            None => limits.visibility,
        };
        let request = PollRequest {
            request_id: p.request_id,
            max_records: p.max_records,
            visibility,
            member: p.consumer.map(|consumer| Member { consumer, principal }),
            reclaim: p.reclaim.unwrap_or(false),
            skipped: offer.has(Features::GROUP_SKIPPED),
            publisher: offer.has(Features::GROUP_PUBLISHER),
            timestamps: offer.has(Features::RECORD_TIMESTAMPS),
        };
        let deliveries = self.poll_now(conn, &k, p.shard, &p.group, &request, now);
        if deliveries.is_empty() && p.wait_ms > 0 {
            let id = self.ids.poll();
            Self::hold(st, HeldFor::Poll(id));
            let mut deadline = crate::transport::after(now, Duration::from_millis(p.wait_ms).min(limits.max_wait));
            // A poll opened with a signed token is woken when the token expires, to end it
            // `revoked` then rather than at the end of its wait.
            if let Some(j) = st.session.as_ref().and_then(|s| s.jwt.as_ref()) {
                deadline = deadline.min(self.wall.instant_at(j.exp.saturating_mul(1_000_000)));
            }
            let parked = Parked { id, conn, stream: st.id, request, deadline };
            self.group_mut(&k, p.shard, &p.group).parked.push_back(parked);
            return;
        }
        let fill = PollFill {
            conn,
            stream: st.id,
            slot: None,
            data: k,
            shard: p.shard,
            group: p.group,
            request,
            deliveries,
            records: Vec::new(),
        };
        match self.answer_poll(fill) {
            Filled::Ready(data) => self.send(conn, st, data),
            Filled::Reading(token) => Self::hold(st, HeldFor::Read(token)),
        }
    }

    fn poll_now(
        &mut self,
        conn: ConnId,
        k: &Key,
        shard: u32,
        name: &str,
        req: &PollRequest,
        now: Instant,
    ) -> Vec<Delivery> {
        let limits = self.cfg.group_limits;
        // A parked poll waits on while the lease is out (it is asked for meanwhile).
        if self.group_read_allowed(k, shard, now).is_err() {
            return Vec::new();
        }
        let Some(log) = self.node.streams.get(k).map(|e| &e.shards[shard as usize].log) else { return Vec::new() };
        let group = self.node.groups.entry((k.clone(), shard)).or_default().entry(name.to_owned()).or_default();
        let out = group.poll(conn, req, log, now, &limits);
        self.flush_dead_letters(k, shard, name, now);
        out
    }

    /// Builds `group_records` for the poll's deliveries (`fill.records` is filled here): from
    /// memory, or after reading storage.
    fn answer_poll(&mut self, mut fill: PollFill) -> Filled {
        fill.records = match self.node.streams.get(&fill.data) {
            None => fill.deliveries.iter().map(|_| None).collect(),
            Some(e) => {
                let log = &e.shards[fill.shard as usize].log;
                fill.deliveries
                    .iter()
                    .map(|d| {
                        log.record_at(d.offset)
                            .map(|(p, publisher, ts)| group_record(&fill.request, d, p, publisher.as_ref(), ts))
                    })
                    .collect()
            }
        };
        self.continue_fill(fill)
    }

    /// Reads the next missing records of a poll, or builds its answer when none are missing.
    fn continue_fill(&mut self, mut fill: PollFill) -> Filled {
        let missing = fill.records.iter().zip(&fill.deliveries).find(|(r, _)| r.is_none()).map(|(_, d)| d.offset);
        let memory_start =
            self.node.streams.get(&fill.data).map_or(0, |e| e.shards[fill.shard as usize].log.memory_start());
        match missing {
            Some(from) if from < memory_start => {
                let token = self.ids.read();
                self.out.push_back(BrokerOutput::Storage(StorageOutput::Read(ReadRequest {
                    token,
                    tenant_id: fill.data.tenant().to_owned(),
                    namespace: fill.data.namespace().to_owned(),
                    stream: fill.data.name().to_owned(),
                    shard: fill.shard,
                    from,
                    end: memory_start,
                    max_bytes: self.cfg.history_read_bytes,
                })));
                fill.slot.get_or_insert(HeldFor::Read(token));
                self.node.reads.insert(token, ReadFor::Poll(Box::new(fill)));
                Filled::Reading(token)
            }
            _ => {
                // Whatever is still missing is gone (retention removed it meanwhile): settled.
                let PollFill { data, shard, group, request, deliveries, records, .. } = fill;
                let g = self.group_mut(&data, shard, &group);
                for (d, r) in deliveries.iter().zip(&records) {
                    if r.is_none() {
                        g.lost(d.offset);
                    }
                }
                let records: Vec<_> = records.into_iter().flatten().collect();
                let m = Message::GroupRecords(message::GroupRecords { records, request_id: request.request_id });
                Filled::Ready(json_frame(&m))
            }
        }
    }

    /// Storage answered a poll's read.
    pub(super) fn poll_read_complete(&mut self, mut fill: PollFill, batches: Vec<StoredBatch>) {
        let mut progressed = false;
        for (d, r) in fill.deliveries.iter().zip(fill.records.iter_mut()) {
            if r.is_some() {
                continue;
            }
            let Some(b) = batches
                .iter()
                .find(|b| !b.generation_start && b.base_offset <= d.offset && d.offset < b.base_offset + b.count())
            else {
                continue;
            };
            let Some(payload) = b.records.payloads().nth((d.offset - b.base_offset) as usize) else { continue };
            *r = Some(group_record(&fill.request, d, payload, b.publisher.as_ref(), b.timestamp_micros));
            progressed = true;
        }
        if !progressed {
            // Storage had none of what is missing: give up on those below memory.
            let memory_start =
                self.node.streams.get(&fill.data).map_or(0, |e| e.shards[fill.shard as usize].log.memory_start());
            let g = self.group_mut(&fill.data, fill.shard, &fill.group);
            let mut kept_d = Vec::new();
            let mut kept_r = Vec::new();
            for (d, r) in fill.deliveries.drain(..).zip(fill.records.drain(..)) {
                if r.is_none() && d.offset < memory_start {
                    g.lost(d.offset);
                } else {
                    kept_d.push(d);
                    kept_r.push(r);
                }
            }
            fill.deliveries = kept_d;
            fill.records = kept_r;
        }
        let (conn, stream, slot) = (fill.conn, fill.stream, fill.slot);
        if let (Filled::Ready(data), Some(slot)) = (self.continue_fill(fill), slot) {
            self.fill_held(conn, stream, slot, data);
        }
    }

    /// Serves the parked polls of one shard's groups that can be served now: records arrived,
    /// records became owed again, or their wait ran out (answered empty).
    pub(super) fn wake_groups(&mut self, k: &Key, shard: u32, now: Instant) {
        let Some(names) = self
            .node
            .groups
            .get(&(k.clone(), shard))
            .map(|g| g.iter().filter(|(_, g)| !g.parked.is_empty()).map(|(n, _)| n.clone()).collect::<Vec<_>>())
        else {
            return;
        };
        // In name order: the answers this writes must not depend on the map's order.
        let mut names = names;
        names.sort_unstable();
        for name in names {
            let parked = std::mem::take(&mut self.group_mut(k, shard, &name).parked);
            let mut keep = std::collections::VecDeque::new();
            for p in parked {
                let Some(st) = self.conns.get(&p.conn).and_then(|c| c.streams.get(&p.stream)) else { continue };
                // Its credential expired or was revoked: the poll ends `revoked`, like every
                // later request of its stream.
                let lapse = st.session.as_ref().and_then(|s| s.jwt.as_deref()).and_then(|j| self.credential_lapse(j));
                if let Some(r) = lapse {
                    let data = json_frame(&Self::error_message(&Self::features_of(st), &r));
                    self.fill_held(p.conn, p.stream, HeldFor::Poll(p.id), data);
                    continue;
                }
                let moved = self.node.streams.get(k).is_none_or(|e| !e.shards[shard as usize].serving.here());
                let deliveries =
                    if moved { Vec::new() } else { self.poll_now(p.conn, k, shard, &name, &p.request, now) };
                if deliveries.is_empty() && p.deadline > now && !moved {
                    keep.push_back(p);
                    continue;
                }
                let slot = HeldFor::Poll(p.id);
                let fill = PollFill {
                    conn: p.conn,
                    stream: p.stream,
                    slot: Some(slot),
                    data: k.clone(),
                    shard,
                    group: name.clone(),
                    request: p.request,
                    deliveries,
                    records: Vec::new(),
                };
                if let Filled::Ready(data) = self.answer_poll(fill) {
                    self.fill_held(p.conn, p.stream, slot, data);
                }
            }
            let g = self.group_mut(k, shard, &name);
            keep.extend(g.parked.drain(..));
            g.parked = keep;
        }
    }

    /// Lapsed claims, ended delays and long polls whose wait ran out, on every group.
    pub(super) fn groups_timeout(&mut self, now: Instant) {
        let limits = self.cfg.group_limits;
        let due: Vec<(Key, u32)> = self
            .node
            .groups
            .iter()
            .filter(|(_, gs)| gs.values().any(|g| g.next_deadline().is_some_and(|d| d <= now)))
            .map(|(k, _)| k.clone())
            .collect();
        // Sorted, here and below: the writes and answers this makes must come in the same order
        // in every run, whatever order the maps hold them in.
        let mut due = due;
        due.sort_unstable();
        for (k, shard) in due {
            let mut names: Vec<String> =
                self.node.groups.get(&(k.clone(), shard)).map(|g| g.keys().cloned().collect()).unwrap_or_default();
            names.sort_unstable();
            for name in &names {
                self.group_mut(&k, shard, name).expire(now, &limits);
                self.flush_dead_letters(&k, shard, name, now);
            }
            self.wake_groups(&k, shard, now);
        }
    }

    /// Wakes every group with parked polls (after a revocation: those opened with a revoked
    /// token end `revoked`), in key order.
    pub(super) fn wake_all_groups(&mut self, now: Instant) {
        let mut keys: Vec<(Key, u32)> = self
            .node
            .groups
            .iter()
            .filter(|(_, gs)| gs.values().any(|g| !g.parked.is_empty()))
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort_unstable();
        for (k, shard) in keys {
            self.wake_groups(&k, shard, now);
        }
    }

    /// When a group next needs the clock.
    pub(super) fn groups_deadline(&self) -> Option<Instant> {
        self.node.groups.values().flat_map(|gs| gs.values()).filter_map(Group::next_deadline).min()
    }

    pub(super) fn group_ack(&mut self, conn: ConnId, st: &mut CtlStream, a: message::GroupOffset, now: Instant) {
        let Some(k) =
            self.existing_group(conn, st, (&a.tenant_id, &a.namespace, &a.stream, a.shard), Action::GroupConsume)
        else {
            return;
        };
        let Some(log) = self.node.streams.get(&k).map(|e| &e.shards[a.shard as usize].log) else { return };
        let g = self.node.groups.entry((k.clone(), a.shard)).or_default().entry(a.group.clone()).or_default();
        let settle = g.ack(&a.group, a.offset, log);
        self.settle(conn, st, &k, a.shard, settle, GroupAnswer::Ok(a.request_id), now);
    }

    /// Answers a settle request: at once, after its write, or with its refusal.
    #[allow(clippy::too_many_arguments)] // the request's parts
    fn settle(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        k: &Key,
        shard: u32,
        settle: Settle,
        answer: GroupAnswer,
        now: Instant,
    ) {
        match settle {
            Settle::Done => {
                if let GroupAnswer::Ok(id) = answer {
                    self.send(conn, st, Self::cache_ok(id));
                }
            }
            Settle::Write(op) => self.group_write(conn, st, k, shard, op, answer, now),
            Settle::Stale { fatal, why } => self.refuse(conn, st, stale(fatal, why)),
            Settle::Invalid(why) => self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, why)),
        }
    }

    pub(super) fn group_nack(&mut self, conn: ConnId, st: &mut CtlStream, n: message::GroupNack, now: Instant) {
        let Some(k) =
            self.existing_group(conn, st, (&n.tenant_id, &n.namespace, &n.stream, n.shard), Action::GroupConsume)
        else {
            return;
        };
        let limits = self.cfg.group_limits;
        let Some(log) = self.node.streams.get(&k).map(|e| &e.shards[n.shard as usize].log) else { return };
        let g = self.node.groups.entry((k.clone(), n.shard)).or_default().entry(n.group.clone()).or_default();
        let delay = n.delay_ms.map(Duration::from_millis);
        let settle = g.nack(&n.group, n.offset, delay, n.attempts, log, now, &limits);
        self.settle(conn, st, &k, n.shard, settle, GroupAnswer::Ok(n.request_id), now);
        // Parked polls may take the record now, once this stream's answer is out.
        self.events.raise(super::events::Event::GroupsMayTake(k, n.shard));
    }

    pub(super) fn group_extend(&mut self, conn: ConnId, st: &mut CtlStream, e: message::GroupExtend, now: Instant) {
        let Some(k) =
            self.existing_group(conn, st, (&e.tenant_id, &e.namespace, &e.stream, e.shard), Action::GroupConsume)
        else {
            return;
        };
        let limits = self.cfg.group_limits;
        let g = self.group_mut(&k, e.shard, &e.group);
        match g.extend(e.offset, e.attempts, Duration::from_millis(e.extend_ms), now, &limits) {
            Ok(d) => {
                let visible_ms = u64::try_from(d.as_millis()).unwrap_or(u64::MAX);
                let m = Message::GroupExtended(message::GroupExtended { visible_ms, request_id: e.request_id });
                self.send(conn, st, json_frame(&m));
            }
            Err(s) => self.settle(conn, st, &k, e.shard, s, GroupAnswer::None, now),
        }
    }

    pub(super) fn group_dead_letter(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        a: message::GroupOffset,
        now: Instant,
    ) {
        let Some(k) =
            self.existing_group(conn, st, (&a.tenant_id, &a.namespace, &a.stream, a.shard), Action::GroupConsume)
        else {
            return;
        };
        let Some(log) = self.node.streams.get(&k).map(|e| &e.shards[a.shard as usize].log) else { return };
        let g = self.node.groups.entry((k.clone(), a.shard)).or_default().entry(a.group.clone()).or_default();
        let settle = g.dead_letter(&a.group, a.offset, log);
        self.settle(conn, st, &k, a.shard, settle, GroupAnswer::Ok(a.request_id), now);
    }

    pub(super) fn group_dead_letters(&mut self, conn: ConnId, st: &mut CtlStream, r: message::GroupRef, now: Instant) {
        let Some(k) =
            self.group_read_target(conn, st, (&r.tenant_id, &r.namespace, &r.stream), r.shard, Missing::NotFound, now)
        else {
            return;
        };
        let offsets = self
            .node
            .groups
            .get(&(k, r.shard))
            .and_then(|g| g.get(&r.group))
            .map(|g| g.durable.dead.iter().copied().collect())
            .unwrap_or_default();
        let m = Message::GroupDeadLetterList(message::GroupDeadLetterList { offsets, request_id: r.request_id });
        self.send(conn, st, json_frame(&m));
    }

    /// `group_discard` and `group_redrive`.
    pub(super) fn group_dead_letter_op(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        a: message::GroupOffset,
        redrive: bool,
        now: Instant,
    ) {
        let Some(k) =
            self.existing_group(conn, st, (&a.tenant_id, &a.namespace, &a.stream, a.shard), Action::GroupConsume)
        else {
            return;
        };
        let listed = self
            .node
            .groups
            .get(&(k.clone(), a.shard))
            .and_then(|g| g.get(&a.group))
            .is_some_and(|g| g.durable.dead.contains(&a.offset));
        if !listed {
            let r = Refusal::new(
                ErrorCode::InvalidRequest,
                format!("offset {} is not a dead letter of {}", a.offset, a.group),
            );
            return self.refuse(conn, st, r);
        }
        let op = if redrive {
            GroupOp::Redrive { group: a.group.clone(), offset: a.offset }
        } else {
            GroupOp::Discard { group: a.group.clone(), offset: a.offset }
        };
        self.group_write(conn, st, &k, a.shard, op, GroupAnswer::Ok(a.request_id), now);
    }

    pub(super) fn group_seek(&mut self, conn: ConnId, st: &mut CtlStream, s: message::GroupSeek, now: Instant) {
        let Some(k) = self.group_target(
            conn,
            st,
            (&s.tenant_id, &s.namespace, &s.stream),
            s.shard,
            Action::GroupManage,
            Missing::Create,
        ) else {
            return;
        };
        let Some(log) = self.node.streams.get(&k).map(|e| &e.shards[s.shard as usize].log) else { return };
        let (earliest, latest) = (log.start(), log.committed_tail());
        let target = match s.start {
            StartPosition::Earliest => earliest,
            StartPosition::Latest => latest,
            StartPosition::Offset(n) if (earliest..=latest).contains(&n) => n,
            StartPosition::Offset(n) => {
                let r =
                    Refusal::new(ErrorCode::InvalidRequest, format!("offset {n} is outside [{earliest}, {latest}]"));
                return self.refuse(conn, st, r);
            }
        };
        let g = self.node.groups.entry((k.clone(), s.shard)).or_default().entry(s.group.clone()).or_default();
        if s.if_new && g.exists() {
            let offset = g.position(log);
            let m = Message::GroupPosition(message::GroupPosition { offset, moved: false, request_id: s.request_id });
            return self.send(conn, st, json_frame(&m));
        }
        let op = GroupOp::Seek { group: s.group.clone(), offset: target };
        let answer = GroupAnswer::Position { request_id: s.request_id, offset: target };
        self.group_write(conn, st, &k, s.shard, op, answer, now);
    }

    pub(super) fn group_describe(&mut self, conn: ConnId, st: &mut CtlStream, r: message::GroupRef, now: Instant) {
        let Some(k) =
            self.group_read_target(conn, st, (&r.tenant_id, &r.namespace, &r.stream), r.shard, Missing::NotFound, now)
        else {
            return;
        };
        let Some(log) = self.node.streams.get(&k).map(|e| &e.shards[r.shard as usize].log) else { return };
        let tail = log.committed_tail();
        let (committed, in_flight, owed, dead) =
            match self.node.groups.get_mut(&(k, r.shard)).and_then(|g| g.get_mut(&r.group)) {
                Some(g) => {
                    g.position(log);
                    let (f, o) = g.counts();
                    (g.durable.cursor, f, o, g.durable.dead.len() as u64)
                }
                None => (None, 0, 0, 0),
            };
        let m = Message::GroupInfo(message::GroupInfo {
            committed,
            tail,
            in_flight,
            owed,
            dead_letters: dead,
            request_id: r.request_id,
        });
        self.send(conn, st, json_frame(&m));
    }

    /// `group_list` (D50): the shard's groups by name, with position, lag and what is in
    /// flight and dead. Never creates the stream.
    pub(super) fn group_list(&mut self, conn: ConnId, st: &mut CtlStream, q: message::GroupList, now: Instant) {
        let Some(k) =
            self.group_read_target(conn, st, (&q.tenant_id, &q.namespace, &q.stream), q.shard, Missing::NotFound, now)
        else {
            return;
        };
        let Some(log) = self.node.streams.get(&k).map(|e| &e.shards[q.shard as usize].log) else { return };
        let tail = log.committed_tail();
        let mut groups: Vec<message::GroupSummary> = self
            .node
            .groups
            .get_mut(&(k, q.shard))
            .into_iter()
            .flatten()
            .filter(|(_, g)| g.exists())
            .map(|(name, g)| {
                g.position(log);
                let (in_flight, _) = g.counts();
                let position = g.durable.cursor;
                message::GroupSummary {
                    group: name.clone(),
                    position,
                    lag: tail.saturating_sub(position.unwrap_or(log.start())),
                    in_flight,
                    dead_letters: g.durable.dead.len() as u64,
                }
            })
            .collect();
        groups.sort_by(|a, b| a.group.cmp(&b.group));
        let m = Message::GroupListView(message::GroupListView { groups, request_id: q.request_id });
        self.send(conn, st, json_frame(&m));
    }

    pub(super) fn group_delete(&mut self, conn: ConnId, st: &mut CtlStream, r: message::GroupRef, now: Instant) {
        let Some(k) =
            self.existing_group(conn, st, (&r.tenant_id, &r.namespace, &r.stream, r.shard), Action::GroupManage)
        else {
            return;
        };
        let existed =
            self.node.groups.get(&(k.clone(), r.shard)).and_then(|g| g.get(&r.group)).is_some_and(Group::exists);
        let op = GroupOp::Delete { group: r.group.clone() };
        self.group_write(conn, st, &k, r.shard, op, GroupAnswer::Deleted { request_id: r.request_id, existed }, now);
    }

    /// A `$groups` write settled: fold it (if it landed) and answer.
    pub(super) fn group_settled(&mut self, slot: HeldFor, w: GroupProposal, settled: Settled, now: Instant) {
        let GroupProposal { conn, stream, data, shard, op, answer } = w;
        let name = op.group_name().to_owned();
        let failed = match settled {
            Settled::Written => {
                self.group_mut(&data, shard, &name).apply(&op);
                None
            }
            Settled::Applied => None,
            Settled::Failed(r) => {
                if let GroupOp::Ack { offset, .. } | GroupOp::DeadLetter { offset, .. } = op {
                    self.group_mut(&data, shard, &name).write_failed(offset);
                }
                Some(r)
            }
        };
        let data_bytes = if failed.is_none() {
            match answer {
                GroupAnswer::Ok(id) => Some(Self::cache_ok(id)),
                GroupAnswer::Position { request_id, offset } => {
                    Some(json_frame(&Message::GroupPosition(message::GroupPosition {
                        offset,
                        moved: true,
                        request_id,
                    })))
                }
                GroupAnswer::Deleted { request_id, existed } => {
                    Some(json_frame(&Message::GroupDeleted(message::GroupDeleted { existed, request_id })))
                }
                GroupAnswer::None => None,
            }
        } else if matches!(answer, GroupAnswer::None) {
            None
        } else {
            let offer = self.conns.get(&conn).and_then(|c| c.streams.get(&stream)).map(|s| Self::features_of(s));
            offer.zip(failed).map(|(offer, r)| json_frame(&Self::error_message(&offer, &r)))
        };
        if let Some(d) = data_bytes {
            self.fill_held(conn, stream, slot, d);
        }
        self.wake_groups(&data, shard, now);
    }
}

fn group_record(
    req: &PollRequest,
    d: &Delivery,
    payload: Bytes,
    publisher: Option<&Bytes>,
    ts: u64,
) -> message::GroupRecord {
    message::GroupRecord {
        offset: d.offset,
        payload: B64(payload),
        attempts: d.attempts,
        skipped_before: (req.skipped && d.skipped_before > 0).then_some(d.skipped_before),
        publisher: publisher.filter(|_| req.publisher).map(|p| String::from_utf8_lossy(p).into_owned()),
        timestamp_micros: req.timestamps.then_some(ts),
    }
}
