//! System logs: durable logs the broker keeps for its own state (counters, consumer groups).
//!
//! A system log is an ordinary durable shard under a reserved stream name (`$kind.name`; user
//! streams may not start with `$`), so it reuses the storage format, recovery and truncation of
//! every other log. State is the fold of the committed log, in offset order: an operation is
//! applied — and answered — only once its write is on disk, so a restart that replays the log
//! rebuilds exactly what clients were told. A checkpoint batch (the whole state, written when
//! nothing else is in flight) lets the log be truncated below it.

use super::config::{Retention, StreamConfig};
use super::{Broker, BrokerOutput, ConnId, HeldFor, Key, PersistRequest, StorageOutput, StreamId, WriteCtx, key};
use crate::binary::Records;
use crate::transport::WriteToken;
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::HashMap;
use std::time::Instant;

/// First character of every system log's stream name (refused in user stream names).
pub(crate) const SYS_PREFIX: char = '$';

/// Deltas folded since the last checkpoint before another is written.
const CHECKPOINT_EVERY: u64 = 4096;

/// The stream configuration of a system log: one durable shard, no retention (truncated by
/// checkpoints only), no history kept in memory (state is folded).
pub(crate) fn sys_stream_config() -> StreamConfig {
    StreamConfig {
        durable: true,
        shards: 1,
        retention: Retention::default(),
        queue_capacity: 1,
        memory_bytes: 0,
        ..StreamConfig::default()
    }
}

/// Whether a stream key names a system log.
pub(crate) fn is_sys(k: &Key) -> bool {
    k.name().starts_with(SYS_PREFIX)
}

/// The system log of a cache's counters.
pub(crate) fn counters_key(cache: &Key) -> Key {
    key(cache.tenant(), cache.namespace(), &format!("{SYS_PREFIX}counters.{}", cache.name()))
}

/// The system log of a durable cache's values.
pub(crate) fn cache_log_key(cache: &Key) -> Key {
    key(cache.tenant(), cache.namespace(), &format!("{SYS_PREFIX}cache.{}", cache.name()))
}

/// One record of a durable cache's system log.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CacheRecord {
    /// `key` holds `value` from version `version` on (until `expires_micros`, Unix µs, when
    /// not 0).
    Put { version: u64, key: String, value: Bytes, expires_micros: u64 },
    /// `key` was deleted (or expired) at version `version`.
    Remove { version: u64, key: String },
    /// Start of a checkpoint: forget every entry.
    Reset,
}

impl CacheRecord {
    const PUT: u8 = 1;
    const REMOVE: u8 = 2;
    const RESET: u8 = 3;

    /// `u8 1`, `u64 version`, key (`u16` length + bytes), `u64 expires_micros`, the value (the
    /// rest); `u8 2`, `u64 version`, key; `u8 3`.
    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        match self {
            CacheRecord::Put { version, key, value, expires_micros } => {
                b.put_u8(Self::PUT);
                b.put_u64(*version);
                put_key(&mut b, key);
                b.put_u64(*expires_micros);
                b.put_slice(value);
            }
            CacheRecord::Remove { version, key } => {
                b.put_u8(Self::REMOVE);
                b.put_u64(*version);
                put_key(&mut b, key);
            }
            CacheRecord::Reset => b.put_u8(Self::RESET),
        }
        b.freeze()
    }

    /// `None` for bytes this version did not write (skipped, never trusted).
    pub fn decode(b: &Bytes) -> Option<CacheRecord> {
        let (&tag, rest) = b.split_first()?;
        if tag == Self::RESET {
            return rest.is_empty().then_some(CacheRecord::Reset);
        }
        let version = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
        let (key, rest) = take_key(&rest[8..])?;
        match tag {
            Self::PUT => {
                let expires_micros = u64::from_be_bytes(rest.get(..8)?.try_into().ok()?);
                let at = b.len() - rest.len() + 8;
                Some(CacheRecord::Put { version, key, value: b.slice(at..), expires_micros })
            }
            Self::REMOVE => rest.is_empty().then_some(CacheRecord::Remove { version, key }),
            _ => None,
        }
    }
}

/// What waits on a system-log write.
#[derive(Debug)]
pub(crate) enum SysPending {
    /// A durable cache's changes: the answer to the request that made them (if any) is
    /// delivered once they are on disk.
    CacheChanges { answer: Option<(ConnId, StreamId, Bytes)> },
    /// A `counter_add`: answered with the sum once the delta is folded.
    CounterAdd { conn: ConnId, stream: StreamId, request_id: u64, key: String },
    /// A checkpoint: once on disk, the log below it can go.
    Checkpoint,
    /// A copy of a cache moving here ([`super::cache_moves`]), or of a moving shard's consumer
    /// groups (D65): once on disk, the move goes on; `full` (a reset first): the log below it
    /// can go.
    MoveCopy { shard: crate::shard::ShardId, full: bool },
    /// A consumer-group operation: folded, then answered.
    Group {
        conn: ConnId,
        stream: StreamId,
        data: Key,
        shard: u32,
        op: super::group::GroupOp,
        answer: super::consume::GroupAnswer,
    },
}

/// One counter record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CounterOp {
    /// Add `delta` to `key`.
    Add { key: String, delta: i64 },
    /// Start of a checkpoint: forget everything.
    Reset,
    /// Part of a checkpoint: `key` holds `value`.
    Set { key: String, value: i64 },
}

impl CounterOp {
    const ADD: u8 = 1;
    const RESET: u8 = 2;
    const SET: u8 = 3;

    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        match self {
            CounterOp::Add { key, delta } => {
                b.put_u8(Self::ADD);
                put_key(&mut b, key);
                b.put_i64(*delta);
            }
            CounterOp::Reset => b.put_u8(Self::RESET),
            CounterOp::Set { key, value } => {
                b.put_u8(Self::SET);
                put_key(&mut b, key);
                b.put_i64(*value);
            }
        }
        b.freeze()
    }

    /// `None` for bytes this version did not write (a record is skipped, never trusted).
    pub fn decode(b: &[u8]) -> Option<CounterOp> {
        let (&tag, rest) = b.split_first()?;
        if tag == Self::RESET {
            return rest.is_empty().then_some(CounterOp::Reset);
        }
        let (key, rest) = take_key(rest)?;
        let n = i64::from_be_bytes(rest.try_into().ok()?);
        match tag {
            Self::ADD => Some(CounterOp::Add { key, delta: n }),
            Self::SET => Some(CounterOp::Set { key, value: n }),
            _ => None,
        }
    }
}

fn put_key(b: &mut BytesMut, key: &str) {
    // Keys are cut at u16::MAX bytes by the caller's validation; stored with their length.
    let k = &key.as_bytes()[..key.len().min(u16::MAX as usize)];
    b.put_u16(k.len() as u16);
    b.put_slice(k);
}

fn take_key(b: &[u8]) -> Option<(String, &[u8])> {
    let len = u16::from_be_bytes(b.get(..2)?.try_into().ok()?) as usize;
    let key = std::str::from_utf8(b.get(2..2 + len)?).ok()?.to_owned();
    Some((key, &b[2 + len..]))
}

/// The counters of one cache: the fold of its system log.
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub sums: HashMap<String, i64>,
    since_checkpoint: u64,
}

impl Counters {
    /// Applies one committed record. Sums saturate at the ends of i64 (deterministically, so a
    /// replay agrees with what was answered).
    pub fn apply(&mut self, op: CounterOp) {
        match op {
            CounterOp::Add { key, delta } => {
                let v = self.sums.entry(key).or_insert(0);
                *v = v.saturating_add(delta);
                self.since_checkpoint += 1;
            }
            CounterOp::Reset => {
                self.sums.clear();
                self.since_checkpoint = 0;
            }
            CounterOp::Set { key, value } => {
                self.sums.insert(key, value);
            }
        }
    }

    /// Folds a batch's records.
    pub fn apply_records(&mut self, records: &Records) {
        self.apply_payloads(records.payloads());
    }

    /// Folds records given one by one (a moved cache's counters).
    pub fn apply_payloads(&mut self, records: impl Iterator<Item = Bytes>) {
        for p in records {
            if let Some(op) = CounterOp::decode(&p) {
                self.apply(op);
            }
        }
    }

    fn wants_checkpoint(&self) -> bool {
        self.since_checkpoint >= CHECKPOINT_EVERY && self.since_checkpoint > 2 * self.sums.len() as u64
    }

    pub fn checkpoint(&self) -> Vec<Bytes> {
        let mut v = vec![CounterOp::Reset.encode()];
        let mut keys: Vec<_> = self.sums.iter().collect();
        keys.sort();
        v.extend(keys.into_iter().map(|(k, &value)| CounterOp::Set { key: k.clone(), value }.encode()));
        v
    }
}

impl Broker {
    /// The system log `k`, created on first use.
    fn sys_log(&mut self, k: &Key) {
        if !self.node.streams.contains_key(k) {
            self.create_stream(k.clone(), sys_stream_config());
        }
    }

    /// Appends records to a system log and asks storage to persist them; `pending` says what
    /// to do once they are on disk.
    pub(super) fn sys_append(
        &mut self,
        k: &Key,
        payloads: Vec<Bytes>,
        pending: SysPending,
        now: Instant,
    ) -> WriteToken {
        self.sys_log(k);
        let token = self.ids.write();
        let records = Records::from_payloads(payloads).unwrap_or_default();
        let ts = self.wall.micros(now);
        let entry = self.node.streams.get_mut(k).expect("created above");
        let (base, _) = entry.shards[0].log.append(records.clone(), ts, None, Some(token));
        self.out.push_back(BrokerOutput::Storage(StorageOutput::Persist(PersistRequest {
            key: None,
            token,
            tenant_id: k.tenant().to_owned(),
            namespace: k.namespace().to_owned(),
            stream: k.name().to_owned(),
            shard: 0,
            base_offset: base,
            records,
            timestamp_micros: ts,
            publisher: None,
            generation_start: false,
            producer: None,
            state: None,
            fsync: None,
            stream_shards: 1,
        })));
        self.node.writes.insert(token, WriteCtx { sys: Some(pending), ..WriteCtx::new(k.clone(), 0) });
        token
    }

    /// A system-log write settled: fold it (if it landed) and answer what waited on it.
    pub(super) fn sys_settled(
        &mut self,
        token: WriteToken,
        k: &Key,
        base: Option<u64>,
        pending: SysPending,
        now: Instant,
    ) {
        if let SysPending::MoveCopy { shard, full } = pending {
            // The copy already set the state in memory: nothing to fold.
            if let (Some(base), true) = (base, full) {
                self.sys_truncate(k, base);
            }
            return self.move_copy_written(&shard, base.is_some(), now);
        }
        if let Some((data, shard)) = super::consume::parse_groups_key(k) {
            match pending {
                SysPending::Group { conn, stream, data, shard, op, answer } => {
                    let ok = base.is_some();
                    let settled = if ok {
                        super::consume::Settled::Written
                    } else {
                        let mut r = super::Refusal::new(
                            crate::error_code::ErrorCode::Storage,
                            "the write failed; the group is unchanged",
                        );
                        r.retry = crate::error_code::RetryClass::Retry;
                        super::consume::Settled::Failed(r)
                    };
                    let w = super::consume::GroupProposal { conn, stream, data, shard, op, answer };
                    self.group_settled(HeldFor::Write(token), w, settled, now);
                    if ok {
                        *self.node.group_ops.entry(k.clone()).or_default() += 1;
                    }
                }
                SysPending::Checkpoint => {
                    if let Some(base) = base {
                        self.sys_truncate(k, base);
                    }
                }
                SysPending::CounterAdd { .. } | SysPending::CacheChanges { .. } | SysPending::MoveCopy { .. } => {}
            }
            return self.maybe_checkpoint_groups(k, &data, shard, now);
        }
        if let Some(cache) = k.name().strip_prefix("$cache.").map(|c| key(k.tenant(), k.namespace(), c)) {
            match pending {
                SysPending::CacheChanges { answer: Some((conn, stream, data)) } => {
                    let data = if base.is_some() {
                        data
                    } else {
                        let why = "the write failed: the change is in memory but will not survive a restart";
                        let Some(data) = self.write_failed_frame(conn, stream, why) else { return };
                        data
                    };
                    self.fill_held(conn, stream, HeldFor::Write(token), data);
                }
                SysPending::Checkpoint => {
                    if let Some(base) = base {
                        self.sys_truncate(k, base);
                    }
                }
                _ => {}
            }
            return self.maybe_checkpoint_cache(k, &cache, now);
        }
        let Some(cache) = k.name().strip_prefix("$counters.").map(|c| key(k.tenant(), k.namespace(), c)) else {
            return;
        };
        if let Some(base) = base {
            let records = self
                .node
                .streams
                .get_mut(k)
                .and_then(|e| e.shards[0].log.batch_at(base).map(|b| b.records.clone()))
                .unwrap_or_default();
            self.node.counters.entry(cache.clone()).or_default().apply_records(&records);
        }
        match pending {
            SysPending::CounterAdd { conn, stream, request_id, key } => {
                let data = match base {
                    Some(_) => {
                        let value = self.node.counters.get(&cache).and_then(|c| c.sums.get(&key).copied());
                        super::json_frame(&crate::message::Message::CounterValue(crate::message::CounterValue {
                            value,
                            request_id,
                        }))
                    }
                    None => {
                        let why = "the write failed; the counter is unchanged";
                        let Some(data) = self.write_failed_frame(conn, stream, why) else {
                            return self.maybe_checkpoint(k, &cache, now);
                        };
                        data
                    }
                };
                self.fill_held(conn, stream, HeldFor::Write(token), data);
            }
            SysPending::Checkpoint => {
                if let Some(base) = base {
                    self.sys_truncate(k, base);
                }
            }
            SysPending::Group { .. } | SysPending::CacheChanges { .. } | SysPending::MoveCopy { .. } => {}
        }
        self.maybe_checkpoint(k, &cache, now);
    }

    /// The answer to a request whose system-log write failed (`storage`, retry), worded for
    /// what its stream offered; `None` when the stream is gone.
    fn write_failed_frame(&self, conn: ConnId, stream: StreamId, why: &str) -> Option<Bytes> {
        let offer = self.conns.get(&conn).and_then(|c| c.streams.get(&stream)).map(|s| Self::features_of(s))?;
        let mut r = super::Refusal::new(crate::error_code::ErrorCode::Storage, why);
        r.retry = crate::error_code::RetryClass::Retry;
        Some(super::json_frame(&Self::error_message(&offer, &r)))
    }

    /// Writes a durable cache's changes to its system log; the token of the write, to hold an
    /// answer on (`None` for a cache kept in memory, or no change).
    pub(super) fn cache_persist(
        &mut self,
        cache: &Key,
        changes: &[super::cache::Change],
        now: Instant,
    ) -> Option<WriteToken> {
        // Without storage (a broker that cannot read history back) a cache stays in memory.
        let has_storage = self.cfg.history_reads;
        let c = self.node.caches.get_mut(cache).filter(|c| c.durable && has_storage)?;
        if changes.is_empty() {
            return None;
        }
        c.since_checkpoint += changes.len() as u64;
        let records: Vec<Bytes> = changes.iter().map(|ch| self.cache_record(ch).encode()).collect();
        Some(self.sys_append(&cache_log_key(cache), records, SysPending::CacheChanges { answer: None }, now))
    }

    pub(super) fn cache_record(&self, c: &super::cache::Change) -> CacheRecord {
        match &c.value {
            Some(value) => CacheRecord::Put {
                version: c.offset,
                key: c.key.clone(),
                value: value.clone(),
                expires_micros: c.expires_at.map_or(0, |t| self.wall.micros(t).max(1)),
            },
            None => CacheRecord::Remove { version: c.offset, key: c.key.clone() },
        }
    }

    /// Holds `answer` until the write `token` of a durable cache's changes settles.
    pub(super) fn hold_cache_answer(
        &mut self,
        token: WriteToken,
        conn: ConnId,
        st: &mut super::CtlStream,
        answer: Bytes,
    ) {
        if let Some(ctx) = self.node.writes.get_mut(&token)
            && let Some(SysPending::CacheChanges { answer: slot }) = ctx.sys.as_mut()
        {
            *slot = Some((conn, st.id, answer));
            Self::hold(st, HeldFor::Write(token));
        }
    }

    /// Writes a checkpoint of a durable cache (every entry) when enough changes piled up and
    /// nothing else is in flight on its log, so the log below it can go.
    fn maybe_checkpoint_cache(&mut self, k: &Key, cache: &Key, now: Instant) {
        let Some(c) = self.node.caches.get(cache) else { return };
        let idle =
            self.node.streams.get(k).is_some_and(|e| e.shards[0].log.committed_tail() == e.shards[0].log.next_offset());
        if !idle || c.since_checkpoint < CHECKPOINT_EVERY || c.since_checkpoint <= 2 * c.len() as u64 {
            return;
        }
        let mut records = vec![CacheRecord::Reset.encode()];
        records.extend(c.entries_sorted().iter().map(|e| self.cache_record(e).encode()));
        if let Some(c) = self.node.caches.get_mut(cache) {
            c.since_checkpoint = 0;
        }
        self.sys_append(k, records, SysPending::Checkpoint, now);
    }

    /// Writes a checkpoint of a cache's counters when enough deltas piled up and nothing else
    /// is in flight on its log (so the checkpoint is exactly the fold below it).
    fn maybe_checkpoint(&mut self, k: &Key, cache: &Key, now: Instant) {
        let Some(c) = self.node.counters.get(cache) else { return };
        let idle =
            self.node.streams.get(k).is_some_and(|e| e.shards[0].log.committed_tail() == e.shards[0].log.next_offset());
        if idle && c.wants_checkpoint() {
            let records = c.checkpoint();
            if let Some(c) = self.node.counters.get_mut(cache) {
                c.since_checkpoint = 0;
            }
            self.sys_append(k, records, SysPending::Checkpoint, now);
        }
    }

    /// Writes a checkpoint of a shard's groups (every group's durable state) when enough
    /// operations piled up and nothing else is in flight on its log.
    fn maybe_checkpoint_groups(&mut self, k: &Key, data: &Key, shard: u32, now: Instant) {
        let ops = self.node.group_ops.get(k).copied().unwrap_or(0);
        let idle =
            self.node.streams.get(k).is_some_and(|e| e.shards[0].log.committed_tail() == e.shards[0].log.next_offset());
        if !idle || ops < CHECKPOINT_EVERY {
            return;
        }
        self.node.group_ops.insert(k.clone(), 0);
        let records = self.group_records(data, shard);
        self.sys_append(k, records, SysPending::Checkpoint, now);
    }

    /// A checkpoint of stream shard `data`/`shard`'s consumer groups: a reset, then each
    /// group's durable state, by name.
    fn group_records(&self, data: &Key, shard: u32) -> Vec<Bytes> {
        let mut records = vec![super::group::GroupOp::Reset.encode()];
        if let Some(groups) = self.node.groups.get(&(data.clone(), shard)) {
            let mut names: Vec<_> = groups.keys().collect();
            names.sort();
            for name in names {
                let state = groups[name].durable.clone();
                records.push(super::group::GroupOp::Snapshot { group: name.clone(), state }.encode());
            }
        }
        records
    }

    /// What a moving shard's copy carries of its consumer groups (D65): their checkpoint, when
    /// the shard has any group holding something.
    pub(super) fn groups_checkpoint(&self, data: &Key, shard: u32) -> Option<Vec<Bytes>> {
        let groups = self.node.groups.get(&(data.clone(), shard))?;
        groups.values().any(|g| g.durable != super::group::Durable::default()).then(|| self.group_records(data, shard))
    }

    /// A moving shard's consumer groups arrived with its copy's final answer (D65): they
    /// replace whatever this broker held of them (an older stay), in memory now and in its
    /// `$groups` log, whose write the move waits for ([`SysPending::MoveCopy`]).
    pub(super) fn take_copied_groups(
        &mut self,
        data: &Key,
        s: &crate::shard::ShardId,
        records: Vec<Bytes>,
        now: Instant,
    ) {
        let groups = self.node.groups.entry((data.clone(), s.shard)).or_default();
        for p in &records {
            match super::group::GroupOp::decode(p) {
                Some(super::group::GroupOp::Reset) => groups.clear(),
                Some(op) => {
                    let name = op.group_name().to_owned();
                    groups.entry(name).or_default().apply(&op);
                }
                None => {}
            }
        }
        let pending = SysPending::MoveCopy { shard: s.clone(), full: true };
        self.sys_append(&super::consume::groups_key(data, s.shard), records, pending, now);
    }

    /// Drops a system log below a committed checkpoint (memory and, through storage, disk).
    fn sys_truncate(&mut self, k: &Key, start: u64) {
        if let Some(e) = self.node.streams.get_mut(k) {
            e.shards[0].log.truncate_before(start);
            self.out.push_back(BrokerOutput::Storage(StorageOutput::Truncate {
                tenant_id: k.tenant().to_owned(),
                namespace: k.namespace().to_owned(),
                stream: k.name().to_owned(),
                shard: 0,
                start,
                producers_forgotten: Vec::new(),
                state_checkpoint: None,
            }));
        }
    }

    /// Rebuilds a system log's state from what storage recovered (in offset order).
    pub(super) fn sys_restore(&mut self, k: &Key, batches: &[crate::storage::StoredBatch]) {
        if let Some((data, shard)) = super::consume::parse_groups_key(k) {
            let groups = self.node.groups.entry((data, shard)).or_default();
            for b in batches.iter().filter(|b| !b.generation_start) {
                for p in b.records.payloads() {
                    match super::group::GroupOp::decode(&p) {
                        Some(super::group::GroupOp::Reset) => groups.clear(),
                        Some(op) => {
                            let name = op.group_name().to_owned();
                            groups.entry(name).or_default().apply(&op);
                        }
                        None => {}
                    }
                }
            }
            return;
        }
        if let Some(cache) = k.name().strip_prefix("$cache.").map(|c| key(k.tenant(), k.namespace(), c)) {
            let wall = self.wall;
            let c = self.node.caches.entry(cache).or_default();
            c.durable = true;
            for b in batches.iter().filter(|b| !b.generation_start) {
                fold_cache_records(c, wall, b.records.payloads());
            }
            return;
        }
        if let Some(cache) = k.name().strip_prefix("$counters.").map(|c| key(k.tenant(), k.namespace(), c)) {
            let c = self.node.counters.entry(cache).or_default();
            for b in batches.iter().filter(|b| !b.generation_start) {
                c.apply_records(&b.records);
            }
        }
    }
}

/// Folds cache records (read back from a system log, or copied from a cache's old owner)
/// into `c`: each entry as written, at its version; expiries mapped to instants by `wall`.
/// Records this version did not write are skipped.
pub(super) fn fold_cache_records(
    c: &mut super::cache::Cache,
    wall: crate::transport::WallClock,
    records: impl Iterator<Item = Bytes>,
) {
    for p in records {
        match CacheRecord::decode(&p) {
            Some(CacheRecord::Reset) => c.clear(),
            Some(CacheRecord::Put { version, key, value, expires_micros }) => {
                let expires_at = (expires_micros != 0).then(|| wall.instant_at(expires_micros));
                c.restore(super::cache::Change { offset: version, key, value: Some(value), expires_at });
            }
            Some(CacheRecord::Remove { version, key }) => {
                c.restore(super::cache::Change { offset: version, key, value: None, expires_at: None });
            }
            None => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_and_junk_is_skipped() {
        for op in [
            CounterOp::Add { key: "k".into(), delta: -5 },
            CounterOp::Reset,
            CounterOp::Set { key: String::new(), value: i64::MAX },
        ] {
            assert_eq!(CounterOp::decode(&op.encode()), Some(op));
        }
        for junk in [&b""[..], b"\x01", b"\x01\x00\x05ab", b"\x02x", b"\x09\x00\x00\x00\x00\x00\x00\x00\x00\x00\x00"] {
            assert_eq!(CounterOp::decode(junk), None);
        }
    }

    #[test]
    fn a_checkpoint_folds_to_the_same_state() {
        let mut c = Counters::default();
        for i in 0..10_000i64 {
            c.apply(CounterOp::Add { key: format!("k{}", i % 7), delta: i });
        }
        assert!(c.wants_checkpoint());
        let mut replay = Counters::default();
        replay.apply(CounterOp::Add { key: "stale".into(), delta: 1 });
        for r in c.checkpoint() {
            replay.apply(CounterOp::decode(&r).unwrap());
        }
        assert_eq!(replay.sums, c.sums);
        assert!(!replay.wants_checkpoint());
    }

    #[test]
    fn sums_saturate() {
        let mut c = Counters::default();
        c.apply(CounterOp::Add { key: "k".into(), delta: i64::MAX });
        c.apply(CounterOp::Add { key: "k".into(), delta: 1 });
        assert_eq!(c.sums["k"], i64::MAX);
    }
}
