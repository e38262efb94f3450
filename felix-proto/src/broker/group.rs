//! Consumer groups: the state of one group on one shard, and its durable log records.
//!
//! Durable (folded from the shard's `$groups` system log, so it survives a restart): the cursor,
//! the finished offsets above it (acks and dead letters, written before they are answered), the
//! dead-letter list and redriven offsets. In memory only (rebuilt after a restart from the
//! durable part, as the spec allows): claims, records owed again, delivery counts, parked polls.
//!
//! The cursor only advances over a contiguous run of finished offsets, so a group restarted from
//! it redelivers only what was never acknowledged.

use super::log::{ShardLog, Slot};
use crate::transport::{ConnId, StreamId};
use bytes::{BufMut, Bytes, BytesMut};
use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::time::{Duration, Instant};

/// Limits of consumer groups (FELIX_GROUP_* settings).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GroupLimits {
    /// Claim duration when a poll names none (FELIX_GROUP_VISIBILITY_MS).
    pub visibility: Duration,
    /// Longest claim, extension or nack delay (FELIX_GROUP_MAX_VISIBILITY_MS).
    pub max_visibility: Duration,
    /// Longest long poll (FELIX_GROUP_MAX_WAIT_MS).
    pub max_wait: Duration,
    /// Deliveries before a record is dead-lettered (FELIX_GROUP_MAX_ATTEMPTS).
    pub max_attempts: u32,
    /// Records handed out and unsettled per group per shard (FELIX_GROUP_MAX_IN_FLIGHT).
    pub max_in_flight: usize,
    /// Most records one poll returns.
    pub max_records: u32,
}

impl Default for GroupLimits {
    fn default() -> Self {
        GroupLimits {
            visibility: Duration::from_secs(30),
            max_visibility: Duration::from_secs(12 * 3600),
            max_wait: Duration::from_secs(30),
            max_attempts: 5,
            max_in_flight: 10_000,
            max_records: 1000,
        }
    }
}

/// One durable group operation (a record of the `$groups` system log).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum GroupOp {
    Ack {
        group: String,
        offset: u64,
    },
    DeadLetter {
        group: String,
        offset: u64,
    },
    Discard {
        group: String,
        offset: u64,
    },
    Redrive {
        group: String,
        offset: u64,
    },
    Seek {
        group: String,
        offset: u64,
    },
    Delete {
        group: String,
    },
    /// Start of a checkpoint: forget every group.
    Reset,
    /// Part of a checkpoint: one group's durable state.
    Snapshot {
        group: String,
        state: Durable,
    },
}

const ACK: u8 = 1;
const DEAD: u8 = 2;
const DISCARD: u8 = 3;
const REDRIVE: u8 = 4;
const SEEK: u8 = 5;
const DELETE: u8 = 6;
const RESET: u8 = 7;
const SNAPSHOT: u8 = 8;

fn put_str(b: &mut BytesMut, s: &str) {
    let s = &s.as_bytes()[..s.len().min(u16::MAX as usize)];
    b.put_u16(s.len() as u16);
    b.put_slice(s);
}

fn put_set(b: &mut BytesMut, s: &BTreeSet<u64>) {
    b.put_u32(s.len() as u32);
    for o in s {
        b.put_u64(*o);
    }
}

struct Cur<'a>(&'a [u8]);

impl Cur<'_> {
    fn take(&mut self, n: usize) -> Option<&[u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<String> {
        let n = u16::from_be_bytes(self.take(2)?.try_into().ok()?) as usize;
        std::str::from_utf8(self.take(n)?).ok().map(str::to_owned)
    }
    fn set(&mut self) -> Option<BTreeSet<u64>> {
        let n = self.u32()? as usize;
        if n > self.0.len() / 8 {
            return None; // a count the bytes cannot hold
        }
        (0..n).map(|_| self.u64()).collect()
    }
}

impl GroupOp {
    /// The group it names (empty for `Reset`).
    pub fn group_name(&self) -> &str {
        match self {
            GroupOp::Ack { group, .. }
            | GroupOp::DeadLetter { group, .. }
            | GroupOp::Discard { group, .. }
            | GroupOp::Redrive { group, .. }
            | GroupOp::Seek { group, .. }
            | GroupOp::Delete { group }
            | GroupOp::Snapshot { group, .. } => group,
            GroupOp::Reset => "",
        }
    }

    pub fn encode(&self) -> Bytes {
        let mut b = BytesMut::new();
        let with = |b: &mut BytesMut, tag: u8, group: &str, offset: u64| {
            b.put_u8(tag);
            put_str(b, group);
            b.put_u64(offset);
        };
        match self {
            GroupOp::Ack { group, offset } => with(&mut b, ACK, group, *offset),
            GroupOp::DeadLetter { group, offset } => with(&mut b, DEAD, group, *offset),
            GroupOp::Discard { group, offset } => with(&mut b, DISCARD, group, *offset),
            GroupOp::Redrive { group, offset } => with(&mut b, REDRIVE, group, *offset),
            GroupOp::Seek { group, offset } => with(&mut b, SEEK, group, *offset),
            GroupOp::Delete { group } => {
                b.put_u8(DELETE);
                put_str(&mut b, group);
            }
            GroupOp::Reset => b.put_u8(RESET),
            GroupOp::Snapshot { group, state } => {
                b.put_u8(SNAPSHOT);
                put_str(&mut b, group);
                match state.cursor {
                    Some(c) => {
                        b.put_u8(1);
                        b.put_u64(c);
                    }
                    None => b.put_u8(0),
                }
                put_set(&mut b, &state.finished);
                put_set(&mut b, &state.dead);
                put_set(&mut b, &state.redriven);
            }
        }
        b.freeze()
    }

    /// `None` for bytes this version did not write (skipped, never trusted).
    pub fn decode(bytes: &[u8]) -> Option<GroupOp> {
        let mut c = Cur(bytes);
        let tag = c.u8()?;
        let op = match tag {
            RESET => GroupOp::Reset,
            DELETE => GroupOp::Delete { group: c.str()? },
            SNAPSHOT => {
                let group = c.str()?;
                let cursor = match c.u8()? {
                    0 => None,
                    1 => Some(c.u64()?),
                    _ => return None,
                };
                let state = Durable { cursor, finished: c.set()?, dead: c.set()?, redriven: c.set()? };
                GroupOp::Snapshot { group, state }
            }
            ACK | DEAD | DISCARD | REDRIVE | SEEK => {
                let (group, offset) = (c.str()?, c.u64()?);
                match tag {
                    ACK => GroupOp::Ack { group, offset },
                    DEAD => GroupOp::DeadLetter { group, offset },
                    DISCARD => GroupOp::Discard { group, offset },
                    REDRIVE => GroupOp::Redrive { group, offset },
                    _ => GroupOp::Seek { group, offset },
                }
            }
            _ => return None,
        };
        c.0.is_empty().then_some(op)
    }
}

/// The durable part of a group.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Durable {
    /// Every offset below it is finished; `None` until the group first finishes something.
    pub cursor: Option<u64>,
    /// Finished offsets at or above the cursor.
    pub finished: BTreeSet<u64>,
    /// Offsets the group gave up on.
    pub dead: BTreeSet<u64>,
    /// Dead letters made owed again (they may lie below the cursor).
    pub redriven: BTreeSet<u64>,
}

/// Who holds a claim.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Member {
    pub consumer: String,
    pub principal: Bytes,
}

#[derive(Debug, Clone)]
struct Claim {
    attempts: u32,
    deadline: Instant,
    /// A nack with a delay: counted in flight, held by nobody, owed at `deadline`.
    delayed: bool,
    conn: ConnId,
    member: Option<Member>,
    /// Reserved for this connection by a reclaim.
    reserved: bool,
}

/// A poll waiting for records.
#[derive(Debug, Clone)]
pub(crate) struct Parked {
    pub id: u64,
    pub conn: ConnId,
    pub stream: StreamId,
    pub request: PollRequest,
    pub deadline: Instant,
}

/// What a poll asks for, after the broker applied its caps.
#[derive(Debug, Clone)]
pub(crate) struct PollRequest {
    pub request_id: u64,
    pub max_records: u32,
    pub visibility: Duration,
    pub member: Option<Member>,
    pub reclaim: bool,
    pub skipped: bool,
    pub publisher: bool,
    pub timestamps: bool,
}

/// One record handed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Delivery {
    pub offset: u64,
    pub attempts: u32,
    pub skipped_before: u64,
}

/// How a settle request went.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Settle {
    /// Answer ok now (nothing to write).
    Done,
    /// Write this operation; answer once it is durable.
    Write(GroupOp),
    /// Refused: `stale_claim` (with the retry class the spec gives that case).
    Stale { fatal: bool, why: String },
    /// Refused: `invalid_request`.
    Invalid(String),
}

/// One consumer group on one shard.
#[derive(Debug, Default)]
pub(crate) struct Group {
    pub durable: Durable,
    claims: BTreeMap<u64, Claim>,
    owed: BTreeSet<u64>,
    attempts: HashMap<u64, u32>,
    /// First offset never handed out (`None`: from the position).
    next: Option<u64>,
    /// Acks and dead letters on their way to disk: not handed out again meanwhile.
    writing: BTreeSet<u64>,
    /// The newest connection that reclaimed, per member name.
    reclaimed: HashMap<String, ConnId>,
    pub parked: VecDeque<Parked>,
    /// Offsets that ran out of attempts during a poll or a lapse: the broker writes them as
    /// dead letters.
    pub to_dead_letter: Vec<u64>,
}

/// Whether `bytes` is a record of a `$groups` checkpoint (a reset, or one group's state):
/// what a moving shard's copy carries of its groups (D65), checked before it is kept.
pub(crate) fn is_group_record(bytes: &[u8]) -> bool {
    matches!(GroupOp::decode(bytes), Some(GroupOp::Reset | GroupOp::Snapshot { .. }))
}

/// A `$groups` checkpoint's two kinds of record, encoded: a reset, and a group's state (peer
/// codec tests).
#[cfg(test)]
pub(crate) fn group_record_samples() -> (Bytes, Bytes) {
    let state = Durable { cursor: Some(4), finished: [6].into(), dead: [5].into(), redriven: BTreeSet::new() };
    (GroupOp::Reset.encode(), GroupOp::Snapshot { group: "g".into(), state }.encode())
}

impl Group {
    /// Applies one committed operation.
    pub fn apply(&mut self, op: &GroupOp) {
        let d = &mut self.durable;
        match op {
            GroupOp::Ack { offset, .. } => {
                self.writing.remove(offset);
                d.redriven.remove(offset);
                if d.cursor.is_none_or(|c| *offset >= c) {
                    d.finished.insert(*offset);
                }
                self.forget(*offset);
            }
            GroupOp::DeadLetter { offset, .. } => {
                self.writing.remove(offset);
                d.redriven.remove(offset);
                d.dead.insert(*offset);
                if d.cursor.is_none_or(|c| *offset >= c) {
                    d.finished.insert(*offset);
                }
                self.forget(*offset);
            }
            GroupOp::Discard { offset, .. } => {
                d.dead.remove(offset);
            }
            GroupOp::Redrive { offset, .. } => {
                if d.dead.remove(offset) {
                    d.redriven.insert(*offset);
                    d.finished.remove(offset);
                    self.owed.insert(*offset);
                    self.attempts.remove(offset);
                }
            }
            GroupOp::Seek { offset, .. } => {
                d.cursor = Some(*offset);
                d.finished.clear();
                self.claims.clear();
                self.owed.clear();
                self.attempts.clear();
                self.writing.clear();
                self.next = Some(*offset);
                self.owed.extend(d.redriven.iter().copied());
            }
            GroupOp::Delete { .. } | GroupOp::Reset => {
                *self = Group { parked: std::mem::take(&mut self.parked), ..Group::default() }
            }
            GroupOp::Snapshot { state, .. } => {
                self.durable = state.clone();
                self.owed.extend(state.redriven.iter().copied());
            }
        }
    }

    fn forget(&mut self, offset: u64) {
        self.claims.remove(&offset);
        self.owed.remove(&offset);
        self.attempts.remove(&offset);
    }

    /// The group's position: everything below it is finished. Moves the cursor over finished
    /// runs, and over what holds no record (generation-start records, offsets a failed write
    /// left empty, history retention removed).
    pub fn position(&mut self, log: &ShardLog) -> u64 {
        let tail = log.committed_tail();
        let d = &mut self.durable;
        let mut pos = d.cursor.unwrap_or(0).max(log.start());
        let mut moved = false;
        loop {
            match d.finished.first() {
                Some(&f) if f < pos => {
                    d.finished.pop_first();
                    continue;
                }
                Some(&f) if f == pos => {
                    d.finished.pop_first();
                    pos += 1;
                    moved = true;
                    continue;
                }
                _ => {}
            }
            match log.slot(pos) {
                Slot::Skip { end } if pos < tail => pos = end.min(tail).max(pos + 1),
                _ => break,
            }
        }
        if moved || d.cursor.is_some() {
            d.cursor = Some(pos);
        }
        if self.next.is_none_or(|n| n < pos) {
            self.next = Some(pos);
        }
        pos
    }

    /// Whether the group holds anything worth keeping (for `group_delete`'s `existed`).
    pub fn exists(&self) -> bool {
        self.durable != Durable::default() || !self.claims.is_empty() || self.next.is_some()
    }

    /// Claims whose time ran out become owed (or dead letters, at the attempt bound); delayed
    /// nacks whose delay passed become owed.
    pub fn expire(&mut self, now: Instant, limits: &GroupLimits) {
        let lapsed: Vec<u64> = self.claims.iter().filter(|(_, c)| c.deadline <= now).map(|(o, _)| *o).collect();
        for o in lapsed {
            let Some(c) = self.claims.remove(&o) else { continue };
            self.attempts.insert(o, c.attempts);
            if !c.delayed && c.attempts >= limits.max_attempts {
                self.to_dead_letter.push(o);
                self.writing.insert(o);
            } else {
                self.owed.insert(o);
            }
        }
    }

    /// The earliest moment something changes by itself (a claim lapses, a delay ends, a parked
    /// poll gives up).
    pub fn next_deadline(&self) -> Option<Instant> {
        let c = self.claims.values().map(|c| c.deadline).min();
        let p = self.parked.iter().map(|p| p.deadline).min();
        match (c, p) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Records in flight and owed: `(in_flight, owed)`.
    pub fn counts(&self) -> (u64, u64) {
        (self.claims.len() as u64, self.owed.len() as u64)
    }

    /// Hands out up to `max` records: reclaimed ones first, then owed ones, then new ones.
    pub fn poll(
        &mut self,
        conn: ConnId,
        req: &PollRequest,
        log: &ShardLog,
        now: Instant,
        limits: &GroupLimits,
    ) -> Vec<Delivery> {
        self.expire(now, limits);
        let pos = self.position(log);
        let tail = log.committed_tail();
        let mut out = Vec::new();
        let deadline = crate::transport::after(now, req.visibility);
        let max = req.max_records.min(limits.max_records).max(1) as usize;
        // Reclaim: this member's claims from older connections come back first.
        if let (true, Some(m)) = (req.reclaim, &req.member) {
            let newest = self.reclaimed.get(&m.consumer).copied();
            if newest.is_none_or(|c| conn.0 > c.0) {
                self.reclaimed.insert(m.consumer.clone(), conn);
                let mine: Vec<u64> = self
                    .claims
                    .iter()
                    .filter(|(_, c)| !c.delayed && c.conn != conn && c.member.as_ref() == Some(m))
                    .map(|(o, _)| *o)
                    .collect();
                for o in mine {
                    let Some(c) = self.claims.get_mut(&o) else { continue };
                    if out.len() >= max {
                        // Held for this connection until it polls again or the claim lapses.
                        c.conn = conn;
                        c.reserved = true;
                        continue;
                    }
                    if c.attempts >= limits.max_attempts {
                        self.claims.remove(&o);
                        self.to_dead_letter.push(o);
                        self.writing.insert(o);
                        continue;
                    }
                    c.attempts += 1;
                    c.deadline = deadline;
                    c.conn = conn;
                    c.reserved = false;
                    out.push(Delivery { offset: o, attempts: c.attempts, skipped_before: 0 });
                }
            }
        }
        // Claims reserved for this connection by an earlier reclaim.
        let reserved: Vec<u64> =
            self.claims.iter().filter(|(_, c)| c.reserved && c.conn == conn).map(|(o, _)| *o).collect();
        for o in reserved {
            if out.len() >= max {
                break;
            }
            if let Some(c) = self.claims.get_mut(&o) {
                c.attempts += 1;
                c.deadline = deadline;
                c.reserved = false;
                out.push(Delivery { offset: o, attempts: c.attempts, skipped_before: 0 });
            }
        }
        let room = |g: &Group, out: &Vec<Delivery>| out.len() < max && g.claims.len() < limits.max_in_flight;
        // Owed again, lowest first.
        let owed: Vec<u64> = self.owed.iter().copied().collect();
        for o in owed {
            if !room(self, &out) {
                break;
            }
            self.owed.remove(&o);
            if self.writing.contains(&o) || (o < pos && !self.durable.redriven.contains(&o)) || o >= tail {
                continue;
            }
            if !matches!(log.slot(o), Slot::Record) {
                continue; // retention removed it meanwhile
            }
            let attempts = self.attempts.remove(&o).unwrap_or(0) + 1;
            self.claim(o, attempts, deadline, conn, req);
            out.push(Delivery { offset: o, attempts, skipped_before: 0 });
        }
        // New records.
        let mut o = self.next.unwrap_or(pos).max(pos);
        let mut skipped = 0u64;
        while o < tail && room(self, &out) {
            if self.durable.finished.contains(&o) || self.writing.contains(&o) || self.claims.contains_key(&o) {
                o += 1;
                continue;
            }
            match log.slot(o) {
                Slot::Skip { end } => {
                    // Settled without delivering (the position steps over it the same way).
                    let end = end.min(tail).max(o + 1);
                    skipped += end - o;
                    o = end;
                }
                Slot::Record => {
                    self.claim(o, 1, deadline, conn, req);
                    out.push(Delivery { offset: o, attempts: 1, skipped_before: skipped });
                    skipped = 0;
                    o += 1;
                }
            }
        }
        self.next = Some(o);
        out.sort_by_key(|d| d.offset);
        out
    }

    fn claim(&mut self, offset: u64, attempts: u32, deadline: Instant, conn: ConnId, req: &PollRequest) {
        let claim = Claim { attempts, deadline, delayed: false, conn, member: req.member.clone(), reserved: false };
        self.claims.insert(offset, claim);
    }

    /// A record handed out could not be read back (retention removed it): settled.
    pub fn lost(&mut self, offset: u64) {
        self.claims.remove(&offset);
        self.durable.finished.insert(offset);
    }

    /// Whether `offset` is something the group has in play.
    fn in_play(&self, offset: u64, pos: u64) -> bool {
        self.claims.contains_key(&offset)
            || self.owed.contains(&offset)
            || self.durable.redriven.contains(&offset)
            || (offset >= pos && self.next.is_some_and(|n| offset < n) && !self.durable.finished.contains(&offset))
    }

    /// `group_ack`.
    pub fn ack(&mut self, group: &str, offset: u64, log: &ShardLog) -> Settle {
        if offset >= log.next_offset() {
            return Settle::Invalid(format!("offset {offset} is past the log tail: never handed out"));
        }
        let pos = self.position(log);
        if self.writing.contains(&offset) {
            // The same ack (or a dead letter) is on its way, and may yet fail (a replicated
            // shard's leader deposed, a failed write). Answering `ok` now would acknowledge an
            // ack a failure takes back: the record handed out again after its ack was answered
            // (the world simulation found it). It is written again, answered once on disk;
            // applying an ack twice changes nothing.
            return Settle::Write(GroupOp::Ack { group: group.into(), offset });
        }
        if !self.in_play(offset, pos) {
            if offset < pos || self.durable.finished.contains(&offset) {
                return Settle::Done; // a harmless duplicate
            }
            return Settle::Stale {
                fatal: false,
                why: format!("offset {offset} was not handed out since the group's state was rebuilt"),
            };
        }
        self.writing.insert(offset);
        self.claims.remove(&offset);
        self.owed.remove(&offset);
        Settle::Write(GroupOp::Ack { group: group.into(), offset })
    }

    /// An ack or dead letter failed to reach the disk: the record is owed again.
    pub fn write_failed(&mut self, offset: u64) {
        if self.writing.remove(&offset) {
            self.owed.insert(offset);
        }
    }

    /// `group_nack`. `claim_control`: the broker honours `delay_ms` and `attempts`.
    #[allow(clippy::too_many_arguments)] // the nack's fields and the clock
    pub fn nack(
        &mut self,
        group: &str,
        offset: u64,
        delay: Option<Duration>,
        attempts: Option<u32>,
        log: &ShardLog,
        now: Instant,
        limits: &GroupLimits,
    ) -> Settle {
        if offset >= log.next_offset() {
            return Settle::Invalid(format!("offset {offset} is past the log tail: never handed out"));
        }
        let pos = self.position(log);
        let stands = self.claims.get(&offset).is_some_and(|c| !c.delayed && attempts.is_none_or(|a| a == c.attempts));
        if !stands {
            if attempts.is_some() {
                return Settle::Stale { fatal: true, why: format!("the claim on offset {offset} no longer stands") };
            }
            if offset < pos
                || self.owed.contains(&offset)
                || self.durable.finished.contains(&offset)
                || self.writing.contains(&offset)
            {
                return Settle::Done;
            }
            if !self.in_play(offset, pos) {
                return Settle::Stale { fatal: false, why: format!("offset {offset} was not handed out") };
            }
            return Settle::Done;
        }
        let Some(mut c) = self.claims.remove(&offset) else { return Settle::Done };
        if c.attempts >= limits.max_attempts {
            self.writing.insert(offset);
            return Settle::Write(GroupOp::DeadLetter { group: group.into(), offset });
        }
        match delay.filter(|d| !d.is_zero()) {
            Some(d) => {
                c.delayed = true;
                c.member = None;
                c.deadline = crate::transport::after(now, d.min(limits.max_visibility));
                self.claims.insert(offset, c);
            }
            None => {
                self.attempts.insert(offset, c.attempts);
                self.owed.insert(offset);
            }
        }
        Settle::Done
    }

    /// `group_extend`: the granted extension.
    pub fn extend(
        &mut self,
        offset: u64,
        attempts: u32,
        extend: Duration,
        now: Instant,
        limits: &GroupLimits,
    ) -> Result<Duration, Settle> {
        if extend.is_zero() {
            return Err(Settle::Invalid("extend_ms must be more than 0".into()));
        }
        match self.claims.get_mut(&offset) {
            Some(c) if !c.delayed && c.attempts == attempts && c.deadline > now => {
                let d = extend.min(limits.max_visibility);
                c.deadline = crate::transport::after(now, d);
                Ok(d)
            }
            _ => Err(Settle::Stale { fatal: true, why: format!("the claim on offset {offset} no longer stands") }),
        }
    }

    /// `group_dead_letter`.
    pub fn dead_letter(&mut self, group: &str, offset: u64, log: &ShardLog) -> Settle {
        if offset >= log.committed_tail() {
            return Settle::Invalid(format!("offset {offset} is past the log tail"));
        }
        let pos = self.position(log);
        // Any record at or above the position that is not finished is in play, handed out or
        // not yet (a consumer may give up on a record it knows it cannot process).
        let finished =
            (offset < pos && !self.durable.redriven.contains(&offset)) || self.durable.finished.contains(&offset);
        if self.writing.contains(&offset) || finished {
            return Settle::Invalid(format!("offset {offset} is already finished"));
        }
        self.writing.insert(offset);
        self.claims.remove(&offset);
        self.owed.remove(&offset);
        Settle::Write(GroupOp::DeadLetter { group: group.into(), offset })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ops_round_trip_and_junk_is_skipped() {
        let state = Durable { cursor: Some(9), finished: [11, 12].into(), dead: [3].into(), redriven: [4].into() };
        for op in [
            GroupOp::Ack { group: "g".into(), offset: 5 },
            GroupOp::DeadLetter { group: "g".into(), offset: 6 },
            GroupOp::Discard { group: "".into(), offset: 7 },
            GroupOp::Redrive { group: "g".into(), offset: 8 },
            GroupOp::Seek { group: "g".into(), offset: 0 },
            GroupOp::Delete { group: "g".into() },
            GroupOp::Reset,
            GroupOp::Snapshot { group: "g".into(), state },
        ] {
            assert_eq!(GroupOp::decode(&op.encode()), Some(op));
        }
        for junk in [&b""[..], b"\x01", b"\x01\x00\x01g", b"\x07x", b"\x08\x00\x01g\x00\xff\xff\xff\xff", b"\x63"] {
            assert_eq!(GroupOp::decode(junk), None);
        }
    }

    fn log_of(n: u64) -> ShardLog {
        let mut log = ShardLog::new(true, crate::broker::Retention::default());
        for i in 0..n {
            let b = crate::storage::StoredBatch {
                key: None,
                base_offset: i,
                timestamp_micros: 0,
                generation_start: false,
                publisher: None,
                producer: None,
                state: None,
                records: crate::Records::from_payloads([&b"x"[..]]).unwrap(),
            };
            log.restore(b);
        }
        log
    }

    #[test]
    fn the_cursor_advances_only_over_a_contiguous_finished_run() {
        let log = log_of(10);
        let mut g = Group::default();
        g.apply(&GroupOp::Ack { group: "g".into(), offset: 4 });
        assert_eq!(g.position(&log), 0);
        assert_eq!(g.durable.cursor, None, "no cursor until something at the position finishes");
        for o in 0..4 {
            g.apply(&GroupOp::Ack { group: "g".into(), offset: o });
        }
        assert_eq!(g.position(&log), 5);
        assert_eq!(g.durable.cursor, Some(5));
        g.apply(&GroupOp::Ack { group: "g".into(), offset: 2 });
        assert_eq!(g.position(&log), 5, "never backwards on a late ack");
    }
}
