//! Consumer groups (FEATURE_CONSUMER_GROUP and the group feature family).

mod support;

use bytes::Bytes;
use felix_proto::broker::{Action, BrokerConfig, Grant, TokenGrant};
use felix_proto::features::Features;
use felix_proto::message::{self, GroupRecord, Message, StartPosition};
use felix_proto::sim::Sim;
use felix_proto::transport::StreamId;
use proptest::prelude::*;
use std::time::Duration;
use support::*;

fn durable_config() -> BrokerConfig {
    let mut c = config();
    c.history_reads = true;
    c
}

fn all_group_features() -> Features {
    Features::CONSUMER_GROUP
        | Features::GROUP_DEAD_LETTERS
        | Features::GROUP_CLAIM_CONTROL
        | Features::GROUP_CONSUMER
        | Features::GROUP_ADMIN
        | Features::ERROR_CODES
}

fn session(sim: &mut Sim, f: Features) -> (usize, StreamId) {
    let (p, s, _) = raw_session(sim, Some(0x0001), f.to_words(false).0);
    (p, s)
}

struct G<'a> {
    group: &'a str,
}

impl G<'_> {
    fn poll(&self, max: u32, wait_ms: u64, rid: u64, consumer: Option<&str>, reclaim: bool) -> Bytes {
        json(&Message::GroupPoll(message::GroupPoll {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "jobs".into(),
            shard: 0,
            group: self.group.into(),
            max_records: max,
            wait_ms,
            request_id: rid,
            consumer: consumer.map(Into::into),
            reclaim: reclaim.then_some(true),
            visibility_ms: None,
        }))
    }
    fn offset(&self, offset: u64, rid: u64) -> message::GroupOffset {
        message::GroupOffset {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "jobs".into(),
            shard: 0,
            group: self.group.into(),
            offset,
            request_id: rid,
        }
    }
    fn ack(&self, offset: u64, rid: u64) -> Bytes {
        json(&Message::GroupAck(self.offset(offset, rid)))
    }
    fn nack(&self, offset: u64, rid: u64, delay_ms: Option<u64>, attempts: Option<u32>) -> Bytes {
        json(&Message::GroupNack(message::GroupNack {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "jobs".into(),
            shard: 0,
            group: self.group.into(),
            offset,
            request_id: rid,
            delay_ms,
            attempts,
        }))
    }
    fn r(&self, rid: u64) -> message::GroupRef {
        message::GroupRef {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "jobs".into(),
            shard: 0,
            group: self.group.into(),
            request_id: rid,
        }
    }
    fn seek(&self, start: StartPosition, if_new: bool, rid: u64) -> Bytes {
        json(&Message::GroupSeek(message::GroupSeek {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "jobs".into(),
            shard: 0,
            group: self.group.into(),
            start,
            if_new,
            request_id: rid,
        }))
    }
}

const G1: G = G { group: "workers" };

fn publish(sim: &mut Sim, p: usize, s: StreamId, n: usize) {
    for i in 0..n {
        sim.raw_send(p, s, publish_binary("jobs", &[&format!("job{i}")], None, None), false);
    }
    sim.run();
}

fn records(m: &Message) -> Vec<(u64, u32)> {
    match m {
        Message::GroupRecords(r) => r.records.iter().map(|r| (r.offset, r.attempts)).collect(),
        other => panic!("expected group_records, got {other:?}"),
    }
}

fn full(m: &Message) -> &[GroupRecord] {
    match m {
        Message::GroupRecords(r) => &r.records,
        other => panic!("expected group_records, got {other:?}"),
    }
}

fn ok(rid: u64) -> Message {
    Message::CacheOk(message::CacheOk { request_id: rid })
}

fn code(m: &Message) -> (String, String) {
    match m {
        Message::Error(e) => (
            e.code.as_ref().map(|c| c.name().into_owned()).unwrap_or_default(),
            e.retry.map(|r| r.name().to_owned()).unwrap_or_default(),
        ),
        other => panic!("expected error, got {other:?}"),
    }
}

fn ask(sim: &mut Sim, p: usize, s: StreamId, b: Bytes) -> Vec<Message> {
    sim.raw_send(p, s, b, false);
    sim.run();
    messages(&sim.take_received(p, s))
}

#[test]
fn polls_hand_out_each_record_to_one_member_and_acks_move_the_cursor() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 5);
    let (a, sa) = session(&mut sim, all_group_features());
    let (b, sb) = session(&mut sim, all_group_features());
    assert_eq!(records(&ask(&mut sim, a, sa, G1.poll(2, 0, 1, None, false))[0]), [(0, 1), (1, 1)]);
    assert_eq!(records(&ask(&mut sim, b, sb, G1.poll(10, 0, 2, None, false))[0]), [(2, 1), (3, 1), (4, 1)]);
    assert_eq!(
        records(&ask(&mut sim, b, sb, G1.poll(10, 0, 3, None, false))[0]),
        [],
        "all claimed: empty is an answer"
    );
    // Ack 1 before 0: the cursor waits for the contiguous run.
    assert_eq!(ask(&mut sim, a, sa, G1.ack(1, 4)), [ok(4)]);
    let info = |sim: &mut Sim| match ask(sim, a, sa, json(&Message::GroupDescribe(G1.r(9))))[0].clone() {
        Message::GroupInfo(i) => (i.committed, i.tail, i.in_flight, i.owed),
        other => panic!("{other:?}"),
    };
    assert_eq!(info(&mut sim), (None, 5, 4, 0));
    assert_eq!(ask(&mut sim, a, sa, G1.ack(0, 5)), [ok(5)]);
    assert_eq!(info(&mut sim), (Some(2), 5, 3, 0));
    // A late duplicate ack is harmless; past the tail is invalid; never handed out is stale.
    assert_eq!(ask(&mut sim, a, sa, G1.ack(0, 6)), [ok(6)]);
    assert_eq!(code(&ask(&mut sim, a, sa, G1.ack(9, 7))[0]).0, "invalid_request");
    publish(&mut sim, p, s, 1);
    assert_eq!(code(&ask(&mut sim, a, sa, G1.ack(5, 8))[0]), ("stale_claim".into(), "retry".into()));
}

#[test]
fn lapsed_claims_come_back_and_run_out_into_dead_letters() {
    let mut cfg = durable_config();
    cfg.group_limits.visibility = Duration::from_secs(1);
    cfg.group_limits.max_attempts = 3;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 2);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(1, 0, 1, None, false))[0]), [(0, 1)]);
    sim.advance(Duration::from_millis(1500));
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(1, 0, 2, None, false))[0]), [(0, 2)], "owed first, attempt 2");
    sim.advance(Duration::from_millis(1500));
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(1, 0, 3, None, false))[0]), [(0, 3)]);
    sim.advance(Duration::from_millis(1500));
    // Third delivery lapsed: a dead letter, and the group moves on.
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(5, 0, 4, None, false))[0]), [(1, 1)]);
    let dl = ask(&mut sim, p, s, json(&Message::GroupDeadLetters(G1.r(5))));
    assert_eq!(dl, [Message::GroupDeadLetterList(message::GroupDeadLetterList { offsets: vec![0], request_id: 5 })]);
    // Redrive: owed again with its count reset; discard drops a listing.
    assert_eq!(ask(&mut sim, p, s, json(&Message::GroupRedrive(G1.offset(0, 6)))), [ok(6)]);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(5, 0, 7, None, false))[0]), [(0, 1)]);
    assert_eq!(code(&ask(&mut sim, p, s, json(&Message::GroupDiscard(G1.offset(0, 8))))[0]).0, "invalid_request");
    assert_eq!(ask(&mut sim, p, s, json(&Message::GroupDeadLetter(G1.offset(0, 9)))), [ok(9)]);
    assert_eq!(ask(&mut sim, p, s, json(&Message::GroupDiscard(G1.offset(0, 10)))), [ok(10)]);
    let dl = ask(&mut sim, p, s, json(&Message::GroupDeadLetters(G1.r(11))));
    assert_eq!(dl, [Message::GroupDeadLetterList(message::GroupDeadLetterList { offsets: vec![], request_id: 11 })]);
    assert_eq!(code(&ask(&mut sim, p, s, json(&Message::GroupDeadLetter(G1.offset(0, 12))))[0]).0, "invalid_request");
}

#[test]
fn nacks_delays_extensions_and_stale_claims() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 3);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(3, 0, 1, None, false))[0]), [(0, 1), (1, 1), (2, 1)]);
    assert_eq!(ask(&mut sim, p, s, G1.nack(0, 2, None, None)), [ok(2)]);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(3, 0, 3, None, false))[0]), [(0, 2)], "owed again at once");
    assert_eq!(ask(&mut sim, p, s, G1.nack(1, 4, Some(5_000), Some(1))), [ok(4)]);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(3, 0, 5, None, false))[0]), [], "delayed");
    // The same delivery handed back twice, or a wrong attempts value: stale_claim, fatal.
    assert_eq!(code(&ask(&mut sim, p, s, G1.nack(1, 6, None, Some(1)))[0]), ("stale_claim".into(), "fatal".into()));
    assert_eq!(code(&ask(&mut sim, p, s, G1.nack(2, 7, None, Some(9)))[0]), ("stale_claim".into(), "fatal".into()));
    sim.advance(Duration::from_secs(6));
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(3, 0, 8, None, false))[0]), [(1, 2)]);
    let extend = |offset, attempts, extend_ms, rid| {
        json(&Message::GroupExtend(message::GroupExtend {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "jobs".into(),
            shard: 0,
            group: "workers".into(),
            offset,
            attempts,
            extend_ms,
            request_id: rid,
        }))
    };
    assert_eq!(
        ask(&mut sim, p, s, extend(2, 1, 60_000, 9)),
        [Message::GroupExtended(message::GroupExtended { visible_ms: 60_000, request_id: 9 })]
    );
    assert_eq!(code(&ask(&mut sim, p, s, extend(2, 2, 1000, 10))[0]), ("stale_claim".into(), "fatal".into()));
    assert_eq!(code(&ask(&mut sim, p, s, extend(2, 1, 0, 11))[0]).0, "invalid_request");
    // Extended past the default 30 s: still held at 40 s.
    sim.advance(Duration::from_secs(40));
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(3, 0, 12, None, false))[0]), [(0, 3), (1, 3)]);
}

#[test]
fn a_long_poll_waits_for_records_or_its_deadline() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s) = session(&mut sim, all_group_features());
    let (c, cs) = session(&mut sim, all_group_features());
    sim.raw_send(c, cs, G1.poll(5, 10_000, 1, None, false), false);
    sim.run();
    assert!(sim.take_received(c, cs).is_empty(), "parked");
    assert!(sim.broker.poll_timeout().is_some(), "the broker wants a wake-up for it");
    publish(&mut sim, p, s, 2);
    assert_eq!(records(&messages(&sim.take_received(c, cs))[0]), [(0, 1)], "answered by the first commit");
    sim.raw_send(c, cs, G1.poll(5, 2_000, 2, None, false), false);
    sim.run();
    assert_eq!(records(&messages(&sim.take_received(c, cs))[0]), [(1, 1)]);
    sim.raw_send(c, cs, G1.poll(5, 2_000, 3, None, false), false);
    sim.run();
    assert!(sim.take_received(c, cs).is_empty());
    sim.advance(Duration::from_millis(2_100));
    assert_eq!(records(&messages(&sim.take_received(c, cs))[0]), [], "empty after the wait");
}

#[test]
fn seek_if_new_and_delete() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 4);
    let pos = |offset, moved, rid| Message::GroupPosition(message::GroupPosition { offset, moved, request_id: rid });
    assert_eq!(ask(&mut sim, p, s, G1.seek(StartPosition::Latest, true, 1)), [pos(4, true, 1)]);
    assert_eq!(ask(&mut sim, p, s, G1.seek(StartPosition::Earliest, true, 2)), [pos(4, false, 2)], "if_new: not new");
    publish(&mut sim, p, s, 1);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(5, 0, 3, None, false))[0]), [(4, 1)]);
    assert_eq!(ask(&mut sim, p, s, G1.seek(StartPosition::Offset(1), false, 4)), [pos(1, true, 4)]);
    // The seek voided the claim on 4: its ack is stale; delivery starts at 1 again.
    assert_eq!(code(&ask(&mut sim, p, s, G1.ack(4, 5))[0]).0, "stale_claim");
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(2, 0, 6, None, false))[0]), [(1, 1), (2, 1)]);
    assert_eq!(code(&ask(&mut sim, p, s, G1.seek(StartPosition::Offset(99), false, 7))[0]).0, "invalid_request");
    let del = |existed, rid| Message::GroupDeleted(message::GroupDeleted { existed, request_id: rid });
    assert_eq!(ask(&mut sim, p, s, json(&Message::GroupDelete(G1.r(8)))), [del(true, 8)]);
    assert_eq!(ask(&mut sim, p, s, json(&Message::GroupDelete(G { group: "never" }.r(9)))), [del(false, 9)]);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(2, 0, 10, None, false))[0]), [(0, 1), (1, 1)], "afresh at 0");
}

#[test]
fn a_member_reclaims_its_claims_on_reconnect() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 4);
    let (a, sa) = session(&mut sim, all_group_features());
    assert_eq!(records(&ask(&mut sim, a, sa, G1.poll(3, 0, 1, Some("w1"), false))[0]), [(0, 1), (1, 1), (2, 1)]);
    // The member comes back on a new connection and reclaims: its claims first, attempt 2.
    let (b, sb) = session(&mut sim, all_group_features());
    assert_eq!(
        records(&ask(&mut sim, b, sb, G1.poll(10, 0, 2, Some("w1"), true))[0]),
        [(0, 2), (1, 2), (2, 2), (3, 1)]
    );
    // Another member's reclaim takes nothing of w1's.
    let (c, cs) = session(&mut sim, all_group_features());
    assert_eq!(records(&ask(&mut sim, c, cs, G1.poll(10, 0, 3, Some("w2"), true))[0]), []);
}

#[test]
fn the_group_survives_a_restart_without_redelivering_acked_records() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 6);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(6, 0, 1, None, false))[0]).len(), 6);
    for (i, o) in [0u64, 1, 3, 5].iter().enumerate() {
        assert_eq!(ask(&mut sim, p, s, G1.ack(*o, 10 + i as u64)), [ok(10 + i as u64)]);
    }
    assert_eq!(ask(&mut sim, p, s, json(&Message::GroupDeadLetter(G1.offset(4, 20)))), [ok(20)]);
    sim.restart();
    let (p, s) = session(&mut sim, all_group_features());
    // Only 2 was never settled: it alone comes back.
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(10, 0, 1, None, false))[0]), [(2, 1)]);
    let dl = ask(&mut sim, p, s, json(&Message::GroupDeadLetters(G1.r(2))));
    assert_eq!(dl, [Message::GroupDeadLetterList(message::GroupDeadLetterList { offsets: vec![4], request_id: 2 })]);
    assert_eq!(ask(&mut sim, p, s, G1.ack(2, 3)), [ok(3)]);
    let info = ask(&mut sim, p, s, json(&Message::GroupDescribe(G1.r(4))));
    assert!(matches!(&info[0], Message::GroupInfo(i) if i.committed == Some(6)), "{info:?}");
}

/// An ack sent again while the first one's write is on its way is answered only once written:
/// answered `ok` at once, it was an acknowledgement the first write's failure took back, and the
/// record was handed out again after its ack was answered (the cluster's world simulation found
/// it on a replicated stream whose leader was deposed mid-write; a failed disk write is the same
/// on one broker).
#[test]
fn an_ack_repeated_while_the_first_is_written_is_answered_only_once_on_disk() {
    let mut sim = Sim::new(durable_config(), epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 2);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(2, 0, 1, None, false))[0]), [(0, 1), (1, 1)]);
    sim.storage = felix_proto::sim::StorageMode::Manual;
    sim.raw_send(p, s, G1.ack(0, 2), false);
    sim.run();
    let first = sim.pending_writes.last().map(|w| w.token).expect("the ack is written");
    sim.raw_send(p, s, G1.ack(0, 3), false);
    sim.run();
    assert!(sim.take_received(p, s).is_empty(), "neither ack is answered before a write is done");
    let second = sim.pending_writes.last().map(|w| w.token).expect("the repeated ack is written too");
    assert_ne!(first, second);
    // The first write fails: its ack is refused, the repeated one still waits.
    sim.complete_write(first, false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms.len(), 1, "{ms:?}");
    assert_eq!(code(&ms[0]).0, "storage");
    // The second is written: now, and only now, the ack is answered, and the record is done.
    sim.complete_write(second, true);
    sim.run();
    assert_eq!(messages(&sim.take_received(p, s)), [ok(3)]);
    sim.storage = felix_proto::sim::StorageMode::Immediate;
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(10, 0, 4, None, false))[0]), []);
    // Both writes failing leave the record owed: handed out again, never after an `ok`.
    sim.storage = felix_proto::sim::StorageMode::Manual;
    sim.raw_send(p, s, G1.ack(1, 5), false);
    sim.raw_send(p, s, G1.ack(1, 6), false);
    sim.run();
    let tokens: Vec<_> = sim.pending_writes.iter().map(|w| w.token).collect();
    assert_eq!(tokens.len(), 2, "one write per ack");
    for t in tokens {
        sim.complete_write(t, false);
    }
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert!(ms.len() == 2 && ms.iter().all(|m| code(m).0 == "storage"), "{ms:?}");
    sim.storage = felix_proto::sim::StorageMode::Immediate;
    let again = records(&ask(&mut sim, p, s, G1.poll(10, 0, 7, None, false))[0]);
    assert_eq!(again.iter().map(|r| r.0).collect::<Vec<_>>(), [1]);
}

#[test]
fn records_beyond_memory_are_read_back_and_optional_fields_follow_the_offer() {
    let mut cfg = durable_config();
    cfg.default_stream.memory_bytes = 100;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s) = session(&mut sim, all_group_features());
    for i in 0..20 {
        sim.raw_send(p, s, publish_binary("jobs", &[&format!("{i:02}{}", "x".repeat(40))], None, None), false);
        sim.run();
        if i == 4 {
            sim.broker.start_generation("t1", "default", "jobs", 0, sim.now);
            sim.run();
        }
    }
    let reads = sim.reads;
    let rich = all_group_features() | Features::GROUP_SKIPPED | Features::GROUP_PUBLISHER | Features::RECORD_TIMESTAMPS;
    let (a, sa) = session(&mut sim, rich);
    let m = ask(&mut sim, a, sa, G1.poll(7, 0, 1, None, false));
    let got = full(&m[0]);
    assert!(sim.reads > reads, "read back from storage");
    assert_eq!(got.iter().map(|r| r.offset).collect::<Vec<_>>(), [0, 1, 2, 3, 4, 6, 7]);
    assert!(got[0].payload.0.starts_with(b"00"));
    assert_eq!(got[5].skipped_before, Some(1), "the generation-start record at 5");
    assert_eq!(got[0].publisher.as_deref(), Some("dev"));
    assert!(got[0].timestamp_micros.is_some());
    // A client that offered none of those gets none of them.
    let (b, sb) = session(&mut sim, all_group_features());
    let m = ask(&mut sim, b, sb, G { group: "other" }.poll(7, 0, 1, None, false));
    let got = full(&m[0]);
    assert!(got.iter().all(|r| r.skipped_before.is_none() && r.publisher.is_none() && r.timestamp_micros.is_none()));
    assert_eq!(got.len(), 7);
}

#[test]
fn groups_need_storage_durable_streams_and_permissions() {
    // No storage: not offered, answered as an unknown request.
    let mut sim = Sim::new(config(), epoch());
    let (p, s) = session(&mut sim, all_group_features() | Features::UNSUPPORTED);
    let m = ask(&mut sim, p, s, G1.poll(1, 0, 1, None, false));
    assert!(matches!(&m[0], Message::Unsupported(u) if u.request_type == "group_poll"), "{m:?}");
    // In-memory streams have no log to consume.
    let mut cfg = durable_config();
    cfg.default_stream.durable = false;
    cfg.tokens.push(TokenGrant {
        token: "reader".into(),
        tenant_id: Some("t1".into()),
        principal: "reader".into(),
        grants: vec![Grant { action: Action::Subscribe, pattern: "*".into() }],
    });
    let mut sim = Sim::new(cfg, epoch());
    let (p, s) = session(&mut sim, all_group_features());
    assert_eq!(code(&ask(&mut sim, p, s, G1.poll(1, 0, 1, None, false))[0]).0, "invalid_request");
    let r = sim.connect_raw();
    let rs = sim.raw_open_bi(r);
    sim.raw_send(
        r,
        rs,
        json(&Message::Auth(message::Auth {
            tenant_id: "t1".into(),
            token: "reader".into(),
            client_flags: Some(1),
            client_flags_hi: None,
            client_features: all_group_features().to_words(false).0,
            client_features_hi: None,
        })),
        false,
    );
    sim.run();
    sim.take_received(r, rs);
    assert_eq!(code(&ask(&mut sim, r, rs, G1.poll(1, 0, 1, None, false))[0]).0, "forbidden");
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    /// Members polling, acking, nacking and letting claims lapse, in any order: every record is
    /// delivered to some member; no record is held by two members while a claim stands; exactly
    /// the records that ran out of attempts are dead letters; every other record ends acked.
    #[test]
    fn every_record_once_at_a_time_and_dead_letters_exactly_when_out_of_attempts(
        ops in proptest::collection::vec((0u8..6, 0usize..3, any::<u16>()), 1..150),
    ) {
        let mut cfg = durable_config();
        cfg.group_limits.visibility = Duration::from_secs(10);
        cfg.group_limits.max_attempts = 3;
        let mut sim = Sim::new(cfg, epoch());
        let (p, s) = session(&mut sim, all_group_features());
        publish(&mut sim, p, s, 12);
        let members: Vec<(usize, StreamId)> = (0..3).map(|_| session(&mut sim, all_group_features())).collect();
        // offset -> (member, attempts, claimed at)
        let mut held: std::collections::HashMap<u64, (usize, u32, Duration)> = Default::default();
        let mut delivered = std::collections::BTreeSet::new();
        let mut acked = std::collections::BTreeSet::new();
        let mut ran_out = std::collections::BTreeSet::new();
        let mut clock = Duration::ZERO;
        let mut rid = 0;
        for (op, m, n) in ops {
            rid += 1;
            let (mp, ms) = members[m];
            match op {
                0 | 1 => {
                    for (o, attempts) in records(&ask(&mut sim, mp, ms, G1.poll(u32::from(n % 4) + 1, 0, rid, None, false))[0]) {
                        if let Some((other, _, at)) = held.get(&o) {
                            prop_assert!(clock >= *at + Duration::from_secs(10), "offset {o} handed to {m} while {other} held it");
                        }
                        prop_assert!(!acked.contains(&o), "acked offset {o} redelivered");
                        held.insert(o, (m, attempts, clock));
                        delivered.insert(o);
                    }
                }
                2 => {
                    let mine: Vec<u64> = held.iter().filter(|(_, (h, _, at))| *h == m && clock < *at + Duration::from_secs(10)).map(|(o, _)| *o).collect();
                    if let Some(o) = mine.get(usize::from(n) % mine.len().max(1)) {
                        let a = ask(&mut sim, mp, ms, G1.ack(*o, rid));
                        prop_assert_eq!(&a[0], &ok(rid));
                        acked.insert(*o);
                        held.remove(o);
                    }
                }
                3 => {
                    let mine: Vec<(u64, u32)> = held.iter().filter(|(_, (h, _, at))| *h == m && clock < *at + Duration::from_secs(10)).map(|(o, (_, a, _))| (*o, *a)).collect();
                    if let Some((o, a)) = mine.get(usize::from(n) % mine.len().max(1)) {
                        let r = ask(&mut sim, mp, ms, G1.nack(*o, rid, None, Some(*a)));
                        prop_assert_eq!(&r[0], &ok(rid));
                        if *a >= 3 { ran_out.insert(*o); }
                        held.remove(o);
                    }
                }
                _ => {
                    let d = Duration::from_secs(u64::from(n % 15));
                    sim.advance(d);
                    clock += d;
                    let lapsed: Vec<u64> = held.iter().filter(|(_, (_, _, at))| clock >= *at + Duration::from_secs(10)).map(|(o, _)| *o).collect();
                    for o in lapsed {
                        if held[&o].1 >= 3 { ran_out.insert(o); }
                        held.remove(&o);
                    }
                }
            }
        }
        // Drain: one member polls and acks everything left.
        let (mp, ms) = members[0];
        for _ in 0..50 {
            sim.advance(Duration::from_secs(11));
            for o in held.keys().copied().collect::<Vec<_>>() {
                if held[&o].1 >= 3 { ran_out.insert(o); }
            }
            held.clear();
            rid += 1;
            let got = records(&ask(&mut sim, mp, ms, G1.poll(20, 0, rid, None, false))[0]);
            if got.is_empty() { break; }
            for (o, _) in got {
                prop_assert!(!acked.contains(&o));
                rid += 1;
                ask(&mut sim, mp, ms, G1.ack(o, rid));
                acked.insert(o);
                delivered.insert(o);
            }
        }
        rid += 1;
        let dl = ask(&mut sim, mp, ms, json(&Message::GroupDeadLetters(G1.r(rid))));
        let Message::GroupDeadLetterList(list) = &dl[0] else { panic!("{dl:?}") };
        let dead: std::collections::BTreeSet<u64> = list.offsets.iter().copied().collect();
        prop_assert_eq!(&dead, &ran_out);
        let all: std::collections::BTreeSet<u64> = (0..12).collect();
        prop_assert_eq!(&delivered, &all);
        let settled: std::collections::BTreeSet<u64> = acked.union(&dead).copied().collect();
        prop_assert_eq!(settled, all);
    }
}

/// A nack read only once its stream is read again (here: after a storage pause, on a write's
/// completion) hands its record to a poll parked on another connection at once, not at the
/// poll's deadline: what handling the nack asks of other streams runs at the end of every
/// input, not only of the inputs that bring stream data.
#[test]
fn a_nack_read_after_a_storage_pause_wakes_parked_polls_at_once() {
    let mut cfg = durable_config();
    cfg.max_pending_write_bytes = 1000;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s) = session(&mut sim, all_group_features());
    publish(&mut sim, p, s, 1);
    assert_eq!(records(&ask(&mut sim, p, s, G1.poll(1, 0, 1, None, false))[0]), [(0, 1)]);
    let (c, cs) = session(&mut sim, all_group_features());
    sim.raw_send(c, cs, G1.poll(5, 10_000, 2, None, false), false);
    sim.run();
    assert!(sim.take_received(c, cs).is_empty(), "parked: the only record is claimed");
    // Storage falls behind on another stream's writes: the broker stops reading `p`'s stream,
    // and the nack behind those publishes waits unread.
    sim.storage = felix_proto::sim::StorageMode::Manual;
    let payload = "z".repeat(100);
    for _ in 0..50 {
        sim.raw_send(p, s, publish_binary("orders", &[&payload], None, None), false);
    }
    sim.raw_send(p, s, G1.nack(0, 3, None, None), false);
    sim.run();
    assert!(!sim.pending_writes.is_empty());
    assert!(!messages(&sim.take_received(p, s)).contains(&ok(3)), "the nack is not read yet");
    sim.storage = felix_proto::sim::StorageMode::Immediate;
    while !sim.pending_writes.is_empty() {
        sim.complete_all_writes();
    }
    assert!(messages(&sim.take_received(p, s)).contains(&ok(3)), "the nack was read and answered");
    // No time passed: the parked poll got the record from the nack, not its deadline.
    let got = messages(&sim.take_received(c, cs));
    assert_eq!(got.len(), 1, "the parked poll is answered at once: {got:?}");
    assert_eq!(records(&got[0]), [(0, 2)]);
}
