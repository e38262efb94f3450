//! An independent checker over a recorded history: what clients did and were told, what
//! subscribers saw, and what each replica's files hold afterwards. It knows nothing of how the
//! brokers work; it judges only by what the protocol promises a client.
//!
//! - A stream: every acknowledged record exactly once, at the offset its acknowledgement gave;
//!   nothing that was never sent; never two different records at one offset on any replica.
//! - A subscriber: offsets strictly increasing, each record the one the stream holds at that
//!   offset, and no record of the stream skipped between its first and last.
//! - A replicated cache: each key's operations linearizable (Wing & Gong's search with Lowe's
//!   memo of visited configurations) against a register with versions and conditional puts. An
//!   operation whose answer was lost may have taken effect at any point after it was sent, or
//!   never. A read a deposed leader answered from what it held, after a newer leader took a
//!   write, is a stale read: no order of the operations explains it.

use std::collections::{BTreeMap, BTreeSet, HashSet};

/// A time in a history (nanoseconds since the run began).
pub type Nanos = u64;

/// A cache operation as a client sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheCall {
    Get,
    Put(String),
    /// `cache_put_if` the key is absent.
    PutIfAbsent(String),
    /// `cache_put_if` the key's live entry has this version.
    PutIfVersion(String, u64),
    Delete,
}

/// What the client was told.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CacheReturn {
    /// A get's value and its version (on a hit).
    Value(Option<(String, Option<u64>)>),
    /// A put's acknowledgement.
    Done,
    /// A conditional put: applied, and the version written (or the current one).
    Condition(bool, Option<u64>),
    /// A delete: the value it removed.
    Removed(Option<String>),
}

/// One operation on one key.
#[derive(Debug, Clone)]
pub struct CacheOp {
    pub client: usize,
    pub invoked: Nanos,
    /// When the answer came, and what it was; `None`: its outcome is unknown (the answer was
    /// lost, or the broker said it does not know whether it took effect).
    pub answered: Option<(Nanos, CacheReturn)>,
    pub call: CacheCall,
}

/// The register a key is: its value and, once some answer revealed it, the version of that
/// value (a plain put's version is not told to its writer).
type Register = Option<(String, Option<u64>)>;

fn same_version(a: Option<u64>, b: Option<u64>) -> bool {
    a.zip(b).is_none_or(|(a, b)| a == b)
}

/// The register after `call` took effect on `state` with answer `ret` (`None` for an unknown
/// outcome: any answer), or `None` when that answer is impossible from `state`.
fn step(state: &Register, call: &CacheCall, ret: Option<&CacheReturn>) -> Option<Register> {
    match (call, ret) {
        (CacheCall::Get, None) => Some(state.clone()),
        (CacheCall::Get, Some(CacheReturn::Value(got))) => match (state, got) {
            (None, None) => Some(None),
            (Some((v, ver)), Some((g, gver))) if v == g && same_version(*ver, *gver) => {
                Some(Some((v.clone(), ver.or(*gver))))
            }
            _ => None,
        },
        (CacheCall::Put(v), None | Some(CacheReturn::Done)) => Some(Some((v.clone(), None))),
        (CacheCall::PutIfAbsent(v), ret) => match (state, ret) {
            (None, None) => Some(Some((v.clone(), None))),
            (None, Some(CacheReturn::Condition(true, ver))) => Some(Some((v.clone(), *ver))),
            (Some(_), None) => Some(state.clone()),
            (Some((cv, cver)), Some(CacheReturn::Condition(false, ver))) if same_version(*cver, *ver) => {
                Some(Some((cv.clone(), cver.or(*ver))))
            }
            _ => None,
        },
        (CacheCall::PutIfVersion(v, want), ret) => {
            let holds = matches!(state, Some((_, ver)) if same_version(*ver, Some(*want)));
            match ret {
                None if holds => Some(Some((v.clone(), None))),
                None => Some(state.clone()),
                Some(CacheReturn::Condition(true, ver)) if holds => Some(Some((v.clone(), *ver))),
                Some(CacheReturn::Condition(false, ver)) => match state {
                    None => Some(None),
                    Some((cv, cver)) if *cver != Some(*want) && same_version(*cver, *ver) && *ver != Some(*want) => {
                        Some(Some((cv.clone(), cver.or(*ver))))
                    }
                    _ => None,
                },
                _ => None,
            }
        }
        (CacheCall::Delete, None) => Some(None),
        (CacheCall::Delete, Some(CacheReturn::Removed(r))) => {
            (state.as_ref().map(|(v, _)| v) == r.as_ref()).then_some(None)
        }
        _ => None,
    }
}

/// Whether one key's operations are linearizable, starting from an absent key. `Err` names the
/// first operation no order could place, with its neighbours, for a person to read.
pub fn linearizable(ops: &[CacheOp]) -> Result<(), String> {
    let n = ops.len();
    let words = n.div_ceil(64);
    let done = |set: &[u64], i: usize| set[i / 64] & (1 << (i % 64)) != 0;
    // Depth-first over "which operation takes effect next", from the start.
    struct Frame {
        set: Vec<u64>,
        state: Register,
        candidates: Vec<usize>,
        next: usize,
    }
    let candidates = |set: &[u64]| -> Vec<usize> {
        // Every operation not yet placed that was sent before the earliest answer of those not
        // yet placed may go next (that answered one must come before anything sent after it).
        let first_answer = (0..n)
            .filter(|i| !done(set, *i))
            .filter_map(|i| ops[i].answered.as_ref().map(|(t, _)| *t))
            .min()
            .unwrap_or(Nanos::MAX);
        (0..n).filter(|i| !done(set, *i) && ops[*i].invoked <= first_answer).collect()
    };
    let finished = |set: &[u64]| (0..n).all(|i| done(set, i) || ops[i].answered.is_none());
    let start = vec![0u64; words];
    if finished(&start) {
        return Ok(());
    }
    let mut seen: HashSet<(Vec<u64>, Register)> = HashSet::new();
    let mut stack = vec![Frame { candidates: candidates(&start), set: start, state: None, next: 0 }];
    // The deepest point reached (for the report).
    let mut deepest = 0;
    let mut deepest_at = Vec::new();
    while let Some(top) = stack.last_mut() {
        let Some(&i) = top.candidates.get(top.next) else {
            stack.pop();
            continue;
        };
        top.next += 1;
        let Some(state) = step(&top.state, &ops[i].call, ops[i].answered.as_ref().map(|(_, r)| r)) else { continue };
        let mut set = top.set.clone();
        set[i / 64] |= 1 << (i % 64);
        if finished(&set) {
            return Ok(());
        }
        let placed = set.iter().map(|w| w.count_ones() as usize).sum::<usize>();
        if placed > deepest {
            deepest = placed;
            deepest_at = set.clone();
        }
        if seen.insert((set.clone(), state.clone())) {
            stack.push(Frame { candidates: candidates(&set), set, state, next: 0 });
        }
    }
    let stuck: Vec<&CacheOp> = (0..n)
        .filter(|i| deepest_at.get(i / 64).is_none_or(|w| w & (1 << (i % 64)) == 0))
        .map(|i| &ops[i])
        .filter(|o| o.answered.is_some())
        .take(4)
        .collect();
    Err(format!("{} of {n} operations placed at most; the first that cannot be: {stuck:#?}", deepest))
}

/// What a stream's history shows wrong.
#[derive(Debug, Default)]
pub struct StreamVerdict {
    /// Acknowledged, not in the stream.
    pub lost: Vec<String>,
    /// In the stream more than once.
    pub duplicated: Vec<String>,
    /// Acknowledged at one offset, found at another: (record, acknowledged, found).
    pub misplaced: Vec<(String, u64, u64)>,
    /// In the stream, never sent.
    pub phantom: Vec<String>,
}

impl StreamVerdict {
    pub fn is_clean(&self) -> bool {
        self.lost.is_empty() && self.duplicated.is_empty() && self.misplaced.is_empty() && self.phantom.is_empty()
    }
}

/// Checks a stream read back whole (`log`: offset, payload) against what was acknowledged
/// (record, offset its acknowledgement gave, when it gave one) and what was sent with an
/// unknown outcome.
pub fn check_stream(
    log: &[(u64, String)],
    acked: &[(String, Option<u64>)],
    unknown: &BTreeSet<String>,
) -> StreamVerdict {
    let mut at: BTreeMap<&str, Vec<u64>> = BTreeMap::new();
    for (o, p) in log {
        at.entry(p.as_str()).or_default().push(*o);
    }
    let mut v = StreamVerdict::default();
    let acked_set: BTreeSet<&str> = acked.iter().map(|(p, _)| p.as_str()).collect();
    for (p, offsets) in &at {
        if offsets.len() > 1 {
            v.duplicated.push((*p).to_owned());
        }
        if !acked_set.contains(p) && !unknown.contains(*p) {
            v.phantom.push((*p).to_owned());
        }
    }
    for (p, offset) in acked {
        match at.get(p.as_str()) {
            None => v.lost.push(p.clone()),
            Some(found) => {
                if let Some(o) = offset
                    && !found.contains(o)
                {
                    v.misplaced.push((p.clone(), *o, found[0]));
                }
            }
        }
    }
    v
}

/// What a subscriber saw wrong against the stream read back whole: offsets not increasing, a
/// record other than the stream's at its offset, or a record of the stream skipped between
/// the first and last it saw.
pub fn check_subscriber(seen: &[(u64, String)], log: &[(u64, String)]) -> Vec<String> {
    let by_offset: BTreeMap<u64, &str> = log.iter().map(|(o, p)| (*o, p.as_str())).collect();
    let mut wrong = Vec::new();
    for w in seen.windows(2) {
        if w[1].0 <= w[0].0 {
            wrong.push(format!("offset {} after {}", w[1].0, w[0].0));
        }
    }
    for (o, p) in seen {
        match by_offset.get(o) {
            Some(q) if q == p => {}
            other => wrong.push(format!("saw {p:?} at {o}, the stream holds {other:?}")),
        }
    }
    if let (Some(first), Some(last)) = (seen.first(), seen.last()) {
        let got: BTreeSet<u64> = seen.iter().map(|(o, _)| *o).collect();
        for (o, p) in by_offset.range(first.0..=last.0) {
            if !got.contains(o) {
                wrong.push(format!("skipped {p:?} at {o}"));
            }
        }
    }
    wrong
}

/// One replica's Raft log as its files hold it: (index, term, data) of the entries it kept,
/// and its commit index.
#[derive(Debug, Clone)]
pub struct ReplicaLog {
    pub broker: String,
    pub entries: Vec<(u64, u64, Vec<u8>)>,
    pub commit: u64,
}

/// Indexes at which two replicas' committed entries differ: (index, one broker, the other).
pub fn divergent(logs: &[ReplicaLog]) -> Vec<(u64, String, String)> {
    let mut out = Vec::new();
    for (i, a) in logs.iter().enumerate() {
        for b in &logs[i + 1..] {
            let commit = a.commit.min(b.commit);
            let theirs: BTreeMap<u64, (u64, &[u8])> =
                b.entries.iter().filter(|e| e.0 <= commit).map(|e| (e.0, (e.1, e.2.as_slice()))).collect();
            for (index, term, data) in a.entries.iter().filter(|e| e.0 <= commit) {
                if theirs.get(index).is_some_and(|(t, d)| (t, *d) != (term, data.as_slice())) {
                    out.push((*index, a.broker.clone(), b.broker.clone()));
                }
            }
        }
    }
    out
}

/// What one consumer group was seen doing: each record it handed out (offset, payload, when
/// the poll was sent), each settlement acknowledged (offset, when its answer came), and the
/// offsets whose settlement's outcome is unknown.
#[derive(Debug, Default, Clone)]
pub struct GroupHistory {
    pub delivered: Vec<(u64, String, Nanos)>,
    pub acked: Vec<(u64, Nanos)>,
    pub ack_unknown: BTreeSet<u64>,
}

/// What a consumer group did wrong.
#[derive(Debug, Default)]
pub struct GroupVerdict {
    /// Handed out by a poll sent after its acknowledgement came: (offset, acked, polled).
    pub redelivered: Vec<(u64, Nanos, Nanos)>,
    /// In the stream, never settled (acknowledged or unknown) by the end.
    pub lost: Vec<u64>,
    /// Handed out with a payload the stream does not hold at that offset.
    pub phantom: Vec<(u64, String)>,
}

impl GroupVerdict {
    pub fn is_clean(&self) -> bool {
        self.redelivered.is_empty() && self.lost.is_empty() && self.phantom.is_empty()
    }
}

/// Checks a group's history against its stream read back whole (`log`: offset, payload):
/// nothing acknowledged handed out again (a poll sent after the acknowledgement came; one sent
/// before may legitimately race it), nothing in the stream left unsettled after the final
/// drain, nothing handed out that the stream does not hold there.
pub fn check_group(log: &[(u64, String)], g: &GroupHistory) -> GroupVerdict {
    let stream: BTreeMap<u64, &str> = log.iter().map(|(o, p)| (*o, p.as_str())).collect();
    let mut first_ack: BTreeMap<u64, Nanos> = BTreeMap::new();
    for (o, t) in &g.acked {
        let e = first_ack.entry(*o).or_insert(*t);
        *e = (*e).min(*t);
    }
    let mut v = GroupVerdict::default();
    for (o, p, polled) in &g.delivered {
        if stream.get(o) != Some(&p.as_str()) {
            v.phantom.push((*o, p.clone()));
        }
        if let Some(acked) = first_ack.get(o).filter(|a| *a < polled) {
            v.redelivered.push((*o, *acked, *polled));
        }
    }
    v.lost = stream.keys().filter(|o| !first_ack.contains_key(o) && !g.ack_unknown.contains(o)).copied().collect();
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn op(client: usize, invoked: Nanos, answered: Option<(Nanos, CacheReturn)>, call: CacheCall) -> CacheOp {
        CacheOp { client, invoked, answered, call }
    }

    fn value(v: &str, ver: u64) -> CacheReturn {
        CacheReturn::Value(Some((v.into(), Some(ver))))
    }

    #[test]
    fn a_sequential_history_is_linearizable_and_a_stale_read_is_not() {
        let good = [
            op(0, 0, Some((1, CacheReturn::Done)), CacheCall::Put("a".into())),
            op(1, 2, Some((3, value("a", 7))), CacheCall::Get),
            op(0, 4, Some((5, CacheReturn::Condition(true, Some(9)))), CacheCall::PutIfVersion("b".into(), 7)),
            op(1, 6, Some((7, value("b", 9))), CacheCall::Get),
        ];
        assert!(linearizable(&good).is_ok());
        // A read after `b` was acknowledged that still says `a`: what a deposed leader answers.
        let mut stale = good.to_vec();
        stale[3] = op(1, 6, Some((7, value("a", 7))), CacheCall::Get);
        assert!(linearizable(&stale).is_err());
    }

    #[test]
    fn concurrent_operations_may_take_effect_in_either_order() {
        // A put and a read overlap: the read may see the old or the new value.
        let h = |seen: &str| {
            [
                op(0, 0, Some((1, CacheReturn::Done)), CacheCall::Put("a".into())),
                op(0, 2, Some((10, CacheReturn::Done)), CacheCall::Put("b".into())),
                op(1, 3, Some((4, CacheReturn::Value(Some((seen.into(), None))))), CacheCall::Get),
            ]
        };
        assert!(linearizable(&h("a")).is_ok());
        assert!(linearizable(&h("b")).is_ok());
        assert!(linearizable(&h("c")).is_err());
    }

    #[test]
    fn an_unknown_outcome_may_have_taken_effect_late_or_never() {
        let lost = op(0, 0, None, CacheCall::Put("x".into()));
        let read = |at: Nanos, v: Option<&str>| {
            op(1, at, Some((at + 1, CacheReturn::Value(v.map(|v| (v.to_owned(), None))))), CacheCall::Get)
        };
        assert!(linearizable(&[lost.clone(), read(5, None)]).is_ok(), "never");
        assert!(linearizable(&[lost.clone(), read(5, None), read(9, Some("x"))]).is_ok(), "late");
        // Once seen, it cannot be unseen.
        assert!(linearizable(&[lost, read(5, Some("x")), read(9, None)]).is_err());
    }

    #[test]
    fn conditional_puts_follow_versions_and_two_cannot_both_win_one_version() {
        let base = op(0, 0, Some((1, CacheReturn::Condition(true, Some(3)))), CacheCall::PutIfAbsent("a".into()));
        let cas = |c: usize, v: &str, applied: bool, ver: u64| {
            op(c, 2, Some((5, CacheReturn::Condition(applied, Some(ver)))), CacheCall::PutIfVersion(v.into(), 3))
        };
        assert!(linearizable(&[base.clone(), cas(1, "b", true, 8), cas(2, "c", false, 8)]).is_ok());
        assert!(linearizable(&[base.clone(), cas(1, "b", true, 8), cas(2, "c", true, 9)]).is_err());
        // An absent-put that says it applied while the key was there is wrong.
        let again = op(1, 2, Some((3, CacheReturn::Condition(true, Some(4)))), CacheCall::PutIfAbsent("z".into()));
        assert!(linearizable(&[base, again]).is_err());
    }

    #[test]
    fn a_delete_removes_what_is_there() {
        let put = op(0, 0, Some((1, CacheReturn::Done)), CacheCall::Put("a".into()));
        let del = |r: Option<&str>| op(0, 2, Some((3, CacheReturn::Removed(r.map(str::to_owned)))), CacheCall::Delete);
        let miss = op(1, 4, Some((5, CacheReturn::Value(None))), CacheCall::Get);
        assert!(linearizable(&[put.clone(), del(Some("a")), miss.clone()]).is_ok());
        assert!(linearizable(&[put, del(None), miss]).is_err());
    }

    #[test]
    fn a_stream_check_finds_lost_doubled_misplaced_and_phantom_records() {
        let log: Vec<(u64, String)> =
            [(0, "a"), (1, "b"), (2, "b"), (4, "z")].into_iter().map(|(o, p)| (o, p.to_owned())).collect();
        let acked = vec![("a".to_owned(), Some(0)), ("b".to_owned(), Some(1)), ("c".to_owned(), Some(3))];
        let v = check_stream(&log, &acked, &BTreeSet::new());
        assert_eq!(v.lost, ["c"]);
        assert_eq!(v.duplicated, ["b"]);
        assert_eq!(v.phantom, ["z"]);
        assert!(v.misplaced.is_empty());
        let v = check_stream(&log[..2], &[("b".to_owned(), Some(0))], &BTreeSet::from(["a".to_owned()]));
        assert_eq!(v.misplaced, [("b".to_owned(), 0, 1)]);
        assert!(v.lost.is_empty() && v.phantom.is_empty());
    }

    #[test]
    fn a_subscriber_that_skips_repeats_or_misreads_is_caught() {
        let log: Vec<(u64, String)> = (0..5).map(|o| (o, format!("r{o}"))).collect();
        let seen = |os: &[u64]| os.iter().map(|o| (*o, format!("r{o}"))).collect::<Vec<_>>();
        assert!(check_subscriber(&seen(&[1, 2, 3]), &log).is_empty());
        assert_eq!(check_subscriber(&seen(&[1, 3]), &log).len(), 1, "skipped 2");
        assert!(!check_subscriber(&seen(&[1, 2, 2]), &log).is_empty(), "repeated");
        assert!(!check_subscriber(&[(1, "x".into())], &log).is_empty(), "misread");
    }

    #[test]
    fn replicas_whose_committed_entries_differ_are_divergent() {
        let log = |broker: &str, data: &[&[u8]], commit| ReplicaLog {
            broker: broker.into(),
            entries: data.iter().enumerate().map(|(i, d)| (i as u64 + 1, 1, d.to_vec())).collect(),
            commit,
        };
        let a = log("a", &[b"x", b"y", b"z"], 3);
        assert!(divergent(&[a.clone(), log("b", &[b"x", b"y"], 2)]).is_empty());
        // Past the commit both know, a difference is an uncommitted tail: allowed.
        assert!(divergent(&[a.clone(), log("b", &[b"x", b"y", b"q"], 2)]).is_empty());
        assert_eq!(divergent(&[a, log("b", &[b"x", b"q", b"z"], 3)]), [(2, "a".into(), "b".into())]);
    }

    #[test]
    fn a_group_that_redelivers_loses_or_invents_is_caught() {
        let log: Vec<(u64, String)> = (0..3).map(|o| (o, format!("r{o}"))).collect();
        let mut g = GroupHistory {
            delivered: vec![(0, "r0".into(), 1), (1, "r1".into(), 1), (2, "r2".into(), 1)],
            acked: vec![(0, 5), (1, 5)],
            ack_unknown: BTreeSet::from([2]),
        };
        assert!(check_group(&log, &g).is_clean());
        // Handed out again by a poll sent before the ack came: a race, allowed; after: not.
        g.delivered.push((0, "r0".into(), 4));
        assert!(check_group(&log, &g).is_clean());
        g.delivered.push((1, "r1".into(), 6));
        assert_eq!(check_group(&log, &g).redelivered, [(1, 5, 6)]);
        g.delivered.pop();
        // Never settled, or handed out with the wrong payload.
        g.ack_unknown.clear();
        assert_eq!(check_group(&log, &g).lost, [2]);
        g.delivered.push((2, "x".into(), 7));
        assert_eq!(check_group(&log, &g).phantom, [(2, "x".into())]);
    }
}
