//! Idempotent producers (FEATURE_IDEMPOTENT_PRODUCER, FEATURE_SEQUENCE_REUSED) and conditional
//! publishes (FEATURE_PUBLISH_CONDITIONAL).

mod support;

use bytes::{Bytes, BytesMut};
use felix_proto::binary::{AckMode, AckedPrefix, IdempotentPrefix, OwnerHint, PublishBatch};
use felix_proto::client::{ClientConfig, ClientEvent, ClientStream, PublishRequest, Reply};
use felix_proto::features::Features;
use felix_proto::message::{self, Message, RefusedReason};
use felix_proto::sim::{Sim, StorageMode};
use felix_proto::{Payload, Records};
use proptest::prelude::*;
use support::*;

const OFFSETS: u16 = 0x1000 | 0x0001;

fn idem(payloads: &[&str], producer_id: u64, sequence: u64, request_id: u64) -> Bytes {
    json(&Message::PublishIdempotent(message::PublishIdempotent {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        payloads: payloads.iter().map(|p| message::B64::from(*p)).collect(),
        key: None,
        request_id,
        producer_id,
        sequence,
        publish_width: None,
    }))
}

fn idem_binary(payloads: &[&str], producer_id: u64, sequence: u64, request_id: u64) -> Bytes {
    let b = PublishBatch {
        acked: Some(AckedPrefix { request_id, ack_mode: AckMode::PerBatch }),
        idempotent: Some(IdempotentPrefix { producer_id, sequence }),
        key: None,
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "orders".into(),
        records: Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).unwrap(),
    };
    let mut out = BytesMut::new();
    b.encode(&mut out).unwrap();
    out.freeze()
}

fn ok(request_id: u64, offset: Option<u64>) -> Message {
    Message::PublishOk(message::PublishOk { request_id, offset })
}

fn refused(m: &Message) -> (u64, RefusedReason) {
    match m {
        Message::PublishRefused(r) => (r.request_id, r.reason.clone()),
        other => panic!("expected publish_refused, got {other:?}"),
    }
}

fn features(f: Features) -> Option<u32> {
    f.to_words(false).0
}

fn appended(sim: &Sim) -> Vec<String> {
    sim.durable
        .iter()
        .filter(|w| w.stream == "orders")
        .flat_map(|w| w.records.payloads().map(|p| String::from_utf8_lossy(&p).into_owned()).collect::<Vec<_>>())
        .collect()
}

#[test]
fn the_table_of_answers_for_a_client_that_offered_everything() {
    let mut sim = Sim::new(config(), epoch());
    // Pipelined: answers come in request order.
    let f = Features::IDEMPOTENT_PRODUCER | Features::SEQUENCE_REUSED | Features::PUBLISH_PIPELINE;
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(f));
    sim.raw_send(p, s, json(&Message::ProducerInit(message::ProducerInit { request_id: 1 })), false);
    sim.run();
    let Message::ProducerInitOk(init) = messages(&sim.take_received(p, s)).remove(0) else { panic!() };
    let pid = init.producer_id;
    sim.raw_send(p, s, idem(&["a", "b"], pid, 0, 2), false); // new
    sim.raw_send(p, s, idem(&["a", "b"], pid, 0, 3), false); // retry: same answer, nothing written
    sim.raw_send(p, s, idem(&["c"], pid, 1, 4), false); // next
    sim.raw_send(p, s, idem(&["x"], pid, 0, 5), false); // reused with other payloads
    sim.raw_send(p, s, idem(&["d"], pid, 3, 6), false); // gap
    sim.raw_send(p, s, idem(&["e"], pid ^ 1, 4, 7), false); // unknown producer
    sim.raw_send(p, s, idem(&["f"], pid ^ 1, 0, 8), false); // a new producer may start at 0
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms[0], ok(2, Some(0)));
    assert_eq!(ms[1], ok(3, Some(0)), "the duplicate reports the original offset");
    assert_eq!(ms[2], ok(4, Some(2)));
    assert_eq!(refused(&ms[3]), (5, RefusedReason::SequenceReused));
    assert_eq!(refused(&ms[4]), (6, RefusedReason::SequenceGap { expected: 2 }));
    assert_eq!(refused(&ms[5]), (7, RefusedReason::UnknownProducer));
    assert_eq!(ms[6], ok(8, Some(3)));
    assert_eq!(appended(&sim), ["a", "b", "c", "f"]);
    // Older than the 64 remembered batches: cannot tell whether it landed.
    for seq in 2..70 {
        sim.raw_send(p, s, idem(&[&format!("n{seq}")], pid, seq, 100 + seq), false);
    }
    sim.raw_send(p, s, idem(&["c"], pid, 1, 9), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(refused(ms.last().unwrap()), (9, RefusedReason::SequenceExpired));
}

#[test]
fn reused_sequences_are_silently_dropped_for_a_client_that_cannot_read_the_reason() {
    let mut sim = Sim::new(config(), epoch());
    let f = Features::IDEMPOTENT_PRODUCER | Features::PUBLISH_PIPELINE;
    let (p, s, _) = raw_session(&mut sim, Some(0x0001), features(f));
    sim.raw_send(p, s, idem(&["a"], 42, 0, 1), false);
    sim.raw_send(p, s, idem(&["other"], 42, 0, 2), false);
    sim.run();
    // No offsets (0x1000 not offered) and no sequence_reused: publish_ok, nothing written.
    assert_eq!(messages(&sim.take_received(p, s)), vec![ok(1, None), ok(2, None)]);
    assert_eq!(appended(&sim), ["a"]);
}

#[test]
fn binary_idempotent_frames_are_answered_in_json() {
    let mut sim = Sim::new(config(), epoch());
    let f = Features::IDEMPOTENT_PRODUCER | Features::SEQUENCE_REUSED | Features::PUBLISH_PIPELINE;
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS | 0x0008 | 0x0100), features(f));
    sim.raw_send(p, s, idem_binary(&["a"], 9, 0, 1), false);
    sim.raw_send(p, s, idem_binary(&["a"], 9, 0, 2), false);
    sim.raw_send(p, s, idem_binary(&["b"], 9, 5, 3), false);
    sim.run();
    let got = payloads(&sim.take_received(p, s));
    assert!(got.iter().all(|p| matches!(p, Payload::Json(_))), "never a binary ack: {got:?}");
    let ms: Vec<Message> = got
        .into_iter()
        .map(|p| match p {
            Payload::Json(felix_proto::Decoded::Message(m)) => m,
            other => panic!("{other:?}"),
        })
        .collect();
    assert_eq!(ms[0], ok(1, Some(0)));
    assert_eq!(ms[1], ok(2, Some(0)));
    assert_eq!(refused(&ms[2]), (3, RefusedReason::SequenceGap { expected: 1 }));
    assert_eq!(appended(&sim), ["a"]);
}

#[test]
fn a_retry_while_the_first_copy_is_writing_gets_the_same_answer_at_the_same_time() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::IDEMPOTENT_PRODUCER));
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, idem(&["a"], 5, 0, 1), false);
    sim.raw_send(p, s, idem(&["a"], 5, 0, 2), false);
    sim.run();
    assert!(sim.take_received(p, s).is_empty(), "both wait for the disk");
    assert_eq!(sim.pending_writes.len(), 1, "written once");
    sim.complete_all_writes();
    assert_eq!(messages(&sim.take_received(p, s)), vec![ok(1, Some(0)), ok(2, Some(0))]);
}

#[test]
fn a_failed_write_may_be_sent_again_under_the_same_sequence() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::IDEMPOTENT_PRODUCER));
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, idem(&["a"], 5, 0, 1), false);
    sim.run();
    let w = sim.pending_writes[0].token;
    sim.complete_write(w, false);
    let ms = messages(&sim.take_received(p, s));
    assert!(matches!(&ms[0], Message::PublishError(e) if e.request_id == 1), "{ms:?}");
    sim.raw_send(p, s, idem(&["a"], 5, 0, 2), false);
    sim.run();
    sim.complete_all_writes();
    assert_eq!(messages(&sim.take_received(p, s)), vec![ok(2, Some(1))], "appended after the gap the failure left");
    assert_eq!(appended(&sim), ["a"]);
}

#[test]
fn producer_state_survives_a_restart() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::IDEMPOTENT_PRODUCER));
    for seq in 0..3 {
        sim.raw_send(p, s, idem(&[&format!("r{seq}")], 77, seq, seq), false);
    }
    sim.run();
    sim.restart();
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::IDEMPOTENT_PRODUCER));
    sim.raw_send(p, s, idem(&["r2"], 77, 2, 10), false); // answer lost before the crash: retried
    sim.raw_send(p, s, idem(&["r4"], 77, 4, 11), false);
    sim.raw_send(p, s, idem(&["r3"], 77, 3, 12), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(ms[0], ok(10, Some(2)));
    assert_eq!(refused(&ms[1]), (11, RefusedReason::SequenceGap { expected: 3 }));
    assert_eq!(ms[2], ok(12, Some(3)));
    assert_eq!(appended(&sim), ["r0", "r1", "r2", "r3"]);
}

#[test]
fn only_the_leader_accepts() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::IDEMPOTENT_PRODUCER));
    sim.raw_send(p, s, idem(&["a"], 5, 0, 1), false);
    sim.run();
    sim.take_received(p, s);
    let owner = OwnerHint { node_id: "b2".into(), addr: Some("10.0.0.2:5000".into()), generation: 2 };
    sim.broker.move_shard("t1", "default", "orders", 0, owner, sim.now);
    sim.raw_send(p, s, idem(&["b"], 5, 1, 2), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert_eq!(
        refused(&ms[0]),
        (2, RefusedReason::NotLeader(message::LeaderHint { node_id: "b2".into(), addr: Some("10.0.0.2:5000".into()) }))
    );
}

fn publish_if(stream: &str, payload: &str, expected_offset: u64, request_id: u64) -> Bytes {
    json(&Message::PublishIf(message::PublishIf {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: stream.into(),
        payloads: vec![message::B64::from(payload)],
        key: None,
        expected_offset,
        shard: None,
        request_id,
        publish_width: None,
    }))
}

#[test]
fn of_two_conditional_publishes_at_one_offset_exactly_one_lands() {
    let mut sim = Sim::new(config(), epoch());
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::PUBLISH_CONDITIONAL));
    let (q, qs, _) = raw_session(&mut sim, Some(0x0001), None);
    sim.storage = StorageMode::Manual;
    sim.raw_send(p, s, publish_if("orders", "mine", 0, 1), false);
    sim.raw_send(q, qs, publish_if("orders", "yours", 0, 2), false);
    sim.run();
    sim.complete_all_writes();
    assert_eq!(messages(&sim.take_received(p, s)), vec![ok(1, Some(0))]);
    let mq = messages(&sim.take_received(q, qs));
    assert_eq!(refused(&mq[0]), (2, RefusedReason::OffsetMismatch { tail: 1 }), "the loser learns the tail");
    assert_eq!(appended(&sim), ["mine"]);
    // A refused batch consumes no offset.
    sim.raw_send(q, qs, publish_if("orders", "yours", 1, 3), false);
    sim.run();
    sim.complete_all_writes();
    assert_eq!(messages(&sim.take_received(q, qs)), vec![ok(3, None)], "no offset: 0x1000 not offered");
    // A stream with no log cannot be written conditionally.
    let mut cfg = ephemeral_config();
    cfg.tokens = config().tokens;
    let mut sim = Sim::new(cfg, epoch());
    let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::ERROR_CODES));
    sim.raw_send(p, s, publish_if("ticks", "x", 0, 4), false);
    sim.run();
    let ms = messages(&sim.take_received(p, s));
    assert!(
        matches!(&ms[0], Message::PublishError(e) if e.code.as_ref().is_some_and(|c| c.name() == "invalid_request")),
        "{ms:?}"
    );
}

#[test]
fn the_client_state_machine_publishes_idempotently() {
    let mut sim = Sim::new(config(), epoch());
    let mut cfg = ClientConfig::new("t1", TOKEN);
    cfg.features |= Features::SEQUENCE_REUSED;
    let c = sim.connect(cfg);
    sim.run();
    sim.take_events(c);
    let r = sim.client(c).producer_init(ClientStream(0)).unwrap();
    sim.run();
    let ev = sim.take_events(c);
    let Some(ClientEvent::Reply { request_id, reply: Reply::ProducerId(producer_id) }) = ev.first() else {
        panic!("{ev:?}")
    };
    assert_eq!(*request_id, r);
    let req = |seq: u64, payload: &str| PublishRequest {
        idempotent: Some((*producer_id, seq)),
        ..PublishRequest::new("default", "orders", vec![Bytes::copy_from_slice(payload.as_bytes())])
    };
    let now = sim.now;
    let a = sim.client(c).publish(ClientStream(0), req(0, "a"), now).unwrap();
    let b = sim.client(c).publish(ClientStream(0), req(0, "a"), now).unwrap();
    let x = sim.client(c).publish(ClientStream(0), req(0, "x"), now).unwrap();
    sim.run();
    let ev = sim.take_events(c);
    assert!(matches!(ev[0], ClientEvent::PublishAcked { id, offset: Some(0), .. } if id == a), "{ev:?}");
    assert!(matches!(ev[1], ClientEvent::PublishAcked { id, offset: Some(0), .. } if id == b), "{ev:?}");
    assert!(
        matches!(&ev[2], ClientEvent::PublishRefused { id, reason: RefusedReason::SequenceReused, .. } if *id == x),
        "{ev:?}"
    );
    // The broker advertises 0x0100, so the client used binary frames.
    assert!(sim.writes.iter().all(|w| w.producer == Some((*producer_id, 0))));
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    /// Under random retries, duplicates, storage failures and completion orders, every batch a
    /// producer sends is appended exactly once.
    #[test]
    fn retried_batches_are_appended_exactly_once(ops in proptest::collection::vec((0u8..6, any::<u16>()), 1..120)) {
        let mut sim = Sim::new(config(), epoch());
        let (p, s, _) = raw_session(&mut sim, Some(OFFSETS), features(Features::IDEMPOTENT_PRODUCER));
        sim.storage = StorageMode::Manual;
        let pid = 1234;
        let mut next_new = 0u64;
        let mut acked = std::collections::BTreeSet::new();
        let mut rid = 0u64;
        let mut answers = std::collections::HashMap::new();
        let send = |sim: &mut Sim, seq: u64, rid: &mut u64, answers: &mut std::collections::HashMap<u64, u64>| {
            *rid += 1;
            answers.insert(*rid, seq);
            sim.raw_send(p, s, idem(&[&format!("b{seq}")], pid, seq, *rid), false);
        };
        let settle = |sim: &mut Sim, acked: &mut std::collections::BTreeSet<u64>, answers: &std::collections::HashMap<u64, u64>| {
            sim.run();
            for m in messages(&sim.take_received(p, s)) {
                if let Message::PublishOk(o) = m {
                    acked.insert(answers[&o.request_id]);
                }
            }
        };
        for (op, n) in ops {
            match op {
                0 | 1 if next_new < 60 => {
                    send(&mut sim, next_new, &mut rid, &mut answers);
                    next_new += 1;
                }
                2 if next_new > 0 => {
                    let seq = u64::from(n) % next_new;
                    send(&mut sim, seq, &mut rid, &mut answers);
                }
                3 if !sim.pending_writes.is_empty() => {
                    let i = usize::from(n) % sim.pending_writes.len();
                    let t = sim.pending_writes[i].token;
                    sim.complete_write(t, n % 5 != 0);
                }
                _ => sim.complete_all_writes(),
            }
            settle(&mut sim, &mut acked, &answers);
        }
        // The producer resends whatever is unanswered (in order) until everything is acked.
        for _ in 0..200 {
            sim.complete_all_writes();
            settle(&mut sim, &mut acked, &answers);
            let Some(missing) = (0..next_new).find(|q| !acked.contains(q)) else { break };
            send(&mut sim, missing, &mut rid, &mut answers);
            sim.complete_all_writes();
            settle(&mut sim, &mut acked, &answers);
        }
        let mut got = appended(&sim);
        got.sort();
        let mut want: Vec<String> = (0..next_new).map(|q| format!("b{q}")).collect();
        want.sort();
        prop_assert_eq!(got, want);
    }
}
