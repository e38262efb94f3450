use super::*;

#[test]
fn a_batch_round_trips_and_garbage_is_refused() {
    let mut b = ReplicatedBatch::from_payloads(Some((7, 9)), &[Bytes::from_static(b"a"), Bytes::new()]);
    b.publisher = Some(Bytes::from_static(b"alice"));
    b.timestamp_micros = 42;
    assert_eq!(ReplicatedBatch::decode(&b.encode()), Ok(b.clone()));
    b.state = Some(Bytes::from_static(b"changes"));
    b.expected_offset = Some(3);
    assert_eq!(ReplicatedBatch::decode(&b.encode()), Ok(b.clone()));
    let bytes = b.encode();
    for cut in 0..bytes.len() {
        assert!(ReplicatedBatch::decode(&bytes[..cut]).is_err(), "cut {cut}");
    }
    assert!(ReplicatedBatch::decode(&[1]).is_err());
    let mut huge = vec![2u8, 0];
    huge.extend_from_slice(&[0; 24]);
    huge.extend_from_slice(&[0, 0xFF, 0xFF, 0xFF, 0xFF]);
    assert!(ReplicatedBatch::decode(&huge).is_err());
}

/// D59: a batch with a key, an envelope or a compressed block is a version 4 entry that
/// keeps all three; one with none of them is the version 2 entry brokers before D59 wrote,
/// byte for byte; and what a group with an older replica is proposed drops the key and
/// the compressed form, never the envelope.
#[test]
fn a_batch_with_a_key_envelope_or_compressed_block_is_version_4_and_keeps_them() {
    let plain = ReplicatedBatch::from_payloads(Some((7, 9)), &[Bytes::from_static(b"a")]);
    let v2 = plain.encode();
    assert_eq!(v2[0], 2);
    // A key alone changes nothing but the version, the meta byte and the key.
    let keyed = ReplicatedBatch { key: Some(Bytes::from_static(b"eu-7")), ..plain.clone() };
    assert!(keyed.has_meta());
    let v4 = keyed.encode();
    assert_eq!(v4[0], 4);
    assert_eq!(v4.len(), v2.len() + 1 + 2 + 4);
    assert_eq!(ReplicatedBatch::decode(&v4), Ok(keyed.clone()));
    assert_eq!(keyed.clone().without_meta().map(|b| b.encode()), Some(v2.clone()));

    for codec in crate::binary::Codec::ALL {
        let packed = crate::samples::packed_records(codec);
        let b = ReplicatedBatch {
            key: Some(Bytes::from_static(b"eu-7")),
            records: packed.with_envelope(Some(Bytes::from_static(b"\x01\x01\x02k1"))),
            ..plain.clone()
        };
        let bytes = b.encode();
        assert!(bytes.len() < packed.raw().len(), "{codec}: the entry holds the compressed block");
        let back = ReplicatedBatch::decode(&bytes).expect("decodes");
        assert_eq!(back, b);
        assert_eq!(back.records.payloads().collect::<Vec<_>>(), packed.payloads().collect::<Vec<_>>());
        for cut in 0..bytes.len() {
            assert!(ReplicatedBatch::decode(&bytes[..cut]).is_err(), "{codec}: cut {cut}");
        }
        // Without the envelope it goes to an older group as the plain version 2 entry.
        assert_eq!(b.clone().without_meta(), None, "an envelope is never dropped");
        let open = ReplicatedBatch { records: b.records.with_envelope(None), ..b };
        let old = open.without_meta().expect("no envelope");
        assert!(!old.has_meta());
        assert_eq!(old.encode()[0], 2);
        assert_eq!(ReplicatedBatch::decode(&old.encode()).map(|b| b.payloads()), Ok(packed.payloads().collect()));
    }
    // An unknown codec byte in a version 4 entry is refused, not misread.
    let mut bad =
        ReplicatedBatch { records: crate::samples::packed_records(crate::binary::Codec::Zstd), ..plain }.encode();
    let at = bad.len() - crate::samples::packed_records(crate::binary::Codec::Zstd).block_len();
    bad[at] = 9;
    assert!(ReplicatedBatch::decode(&bad).is_err());
}

/// A one-replica group ticked until it leads; its outputs collected.
/// `r`, a one-replica group, once it elected itself (its outputs not taken).
fn elected_alone(mut r: Replica) -> Replica {
    for _ in 0..100 {
        if r.is_leader() {
            break;
        }
        r.tick();
    }
    assert!(r.is_leader(), "a one-replica group elects itself");
    r
}

fn leading_alone() -> Replica {
    let mut r = elected_alone(Replica::new(1, &[1], &RaftLog::default()).expect("replica"));
    while r.poll_output().is_some() {}
    r
}

/// A one-replica group whose host keeps state of its own, a checkpoint after every entry,
/// leading (its outputs, the generation start's checkpoint among them, not taken).
fn hosting_alone() -> Replica {
    let mut r = Replica::new_hosting(1, &[1], &RaftLog::default(), None, true).expect("replica");
    r.set_checkpoint_bytes(1);
    elected_alone(r)
}

fn propose(r: &mut Replica, token: u64, producer: (u64, u64)) -> Answer {
    let b = ReplicatedBatch::from_payloads(Some(producer), &[Bytes::from_static(b"x"), Bytes::from_static(b"y")]);
    r.propose(token, &b).expect("leads");
    let mut answer = None;
    while let Some(o) = r.poll_output() {
        if let ReplicaOutput::Answer { token: t, answer: a } = o {
            assert_eq!(t, token);
            answer = Some(a);
        }
    }
    answer.expect("a one-replica group commits at once")
}

#[test]
fn an_idempotent_producers_batches_land_in_sequence_order_or_are_refused() {
    let mut r = leading_alone();
    let first = propose(&mut r, 1, (7, 0));
    let Answer::Appended { offset, duplicate: false } = first else { panic!("{first:?}") };
    // Ahead of its turn (sequence 1 has not landed): refused, nothing written.
    let next = r.next_offset();
    assert_eq!(propose(&mut r, 2, (7, 2)), Answer::Refused(ApplyRefusal::Gap { expected: 1 }));
    assert_eq!(r.next_offset(), next);
    assert_eq!(propose(&mut r, 3, (7, 1)), Answer::Appended { offset: next, duplicate: false });
    assert_eq!(propose(&mut r, 4, (7, 2)), Answer::Appended { offset: next + 2, duplicate: false });
    // A resend is answered with where it landed.
    assert_eq!(propose(&mut r, 5, (7, 0)), Answer::Appended { offset, duplicate: true });
    // A producer never seen whose first batch is not 0.
    assert_eq!(propose(&mut r, 6, (8, 3)), Answer::Refused(ApplyRefusal::UnknownProducer));
    // Past the remembered window.
    for seq in 3..3 + PRODUCER_WINDOW as u64 {
        assert!(matches!(propose(&mut r, 10 + seq, (7, seq)), Answer::Appended { duplicate: false, .. }));
    }
    assert_eq!(propose(&mut r, 9, (7, 1)), Answer::Refused(ApplyRefusal::Expired));
}

#[test]
fn a_host_states_checkpoint_carries_it_and_compacting_to_the_last_entry_keeps_the_log_usable() {
    let mut r = hosting_alone();
    // Every entry is a checkpoint here: each asks the host for its state.
    let mut due = Vec::new();
    let mut snapshots = Vec::new();
    for token in 1..=3u64 {
        let b = ReplicatedBatch::from_payloads(None, &[Bytes::from(format!("x{token}"))]);
        r.propose(token, &b).expect("leads");
        while let Some(o) = r.poll_output() {
            match o {
                ReplicaOutput::CheckpointDue { index } => {
                    due.push(index);
                    r.complete_checkpoint(index, format!("host@{index}").as_bytes());
                }
                ReplicaOutput::PersistSnapshot { snapshot, .. } => snapshots.push(snapshot),
                _ => {}
            }
        }
        // Compacted right up to the last entry it applied: the next proposal still lands
        // after the committed index (the in-memory log keeps its last entry).
        assert!(r.compact_below(u64::MAX), "compacts to the checkpoint just made");
        while let Some(o) = r.poll_output() {
            if let ReplicaOutput::PersistSnapshot { snapshot, .. } = o {
                snapshots.push(snapshot);
            }
        }
    }
    assert_eq!(due.len(), 3 + 1, "the generation start and three batches: {due:?}");
    let last = snapshots.last().expect("snapshots");
    let data = last.get_data();
    assert!(data.ends_with(format!("host@{}", last.get_metadata().index).as_bytes()), "{data:?}");
    let host = format!("host@{}", last.get_metadata().index);
    assert_eq!(Replica::host_state_of(data), Some(host.as_bytes()), "found by lengths alone");
    for cut in 0..data.len() - host.len() {
        assert!(Replica::host_state_of(&data[..cut]).is_none(), "cut {cut}");
    }
    // Restarted from the snapshot alone: the host's state comes back with the offsets.
    let kept = RaftLog { snapshot: Some(last.clone()), ..RaftLog::default() };
    let mut again = Replica::new_hosting(1, &[1], &kept, None, true).expect("restart");
    let restored = std::iter::from_fn(|| again.poll_output()).find_map(|o| match o {
        ReplicaOutput::Restored { next_offset, state, .. } => Some((next_offset, state)),
        _ => None,
    });
    let (next, state) = restored.expect("restored");
    assert_eq!(next, r.next_offset());
    assert_eq!(state.as_ref(), format!("host@{}", last.get_metadata().index).as_bytes());
    // Handed over where the snapshot holds it, not copied (a cache's snapshot is its size).
    let (base, len) = (last.data.as_ptr() as usize, last.data.len());
    let at = state.as_ptr() as usize;
    assert!(at >= base && at + state.len() <= base + len, "the host's state shares the snapshot's memory");
}

/// The host's state is written into the checkpoint in place: what it appends to
/// `checkpoint_due`'s data is the checkpoint, after the group's own state, and a checkpoint
/// not due takes nothing.
#[test]
fn a_host_appends_its_state_to_the_checkpoint_in_place() {
    let mut r = hosting_alone();
    let b = ReplicatedBatch::from_payloads(None, &[Bytes::from_static(b"x")]);
    r.propose(1, &b).expect("leads");
    let mut dues = Vec::new();
    while let Some(o) = r.poll_output() {
        if let ReplicaOutput::CheckpointDue { index } = o {
            dues.push(index);
        }
    }
    let index = *dues.last().expect("a checkpoint is due");
    assert!(r.checkpoint_due(index + 1).is_none(), "only the one due");
    let data = r.checkpoint_due(index).expect("due");
    let head = data.len();
    data.extend_from_slice(b"host-state");
    r.finish_checkpoint(index);
    assert!(r.checkpoint_due(index).is_none(), "taken");
    let cp = r.checkpoints.back().expect("kept");
    assert_eq!(cp.index, index);
    assert_eq!(&cp.data[head..], b"host-state");
    assert_eq!(Replica::host_state_of(&cp.data), Some(&b"host-state"[..]));
}

/// A host with a large state does not have it copied into every checkpoint waiting for
/// retention's floor: past the memory bound no checkpoint is taken (the host is not even
/// asked) until compaction consumed the older ones; then they are taken again.
#[test]
fn checkpoints_of_a_large_host_state_wait_for_compaction_rather_than_pile_up() {
    let mut r = hosting_alone();
    r.set_checkpoint_memory(2_500);
    while r.poll_output().is_some() {} // (the leader's first entry's checkpoint is not completed)
    let big = vec![7u8; 1_000];
    let mut asked = 0;
    let mut propose = |r: &mut Replica, token: u64| {
        let b = ReplicatedBatch::from_payloads(None, &[Bytes::from(format!("x{token}"))]);
        r.propose(token, &b).expect("leads");
        while let Some(o) = r.poll_output() {
            if let ReplicaOutput::CheckpointDue { index } = o {
                asked += 1;
                r.complete_checkpoint(index, &big);
            }
        }
    };
    for token in 1..=10 {
        propose(&mut r, token);
    }
    let held: usize = r.checkpoints.iter().map(|c| c.data.len()).sum();
    assert_eq!(r.checkpoints.len(), 3, "three fill the bound (2,500 bytes), the rest are not taken");
    assert!(held < 2_500 + 1_100, "{held}");
    assert!(r.compact_below(u64::MAX), "compaction consumes what was kept");
    assert!(r.checkpoints.is_empty());
    propose(&mut r, 11);
    assert_eq!(r.checkpoints.len(), 1, "taken again once there is room");
    assert_eq!(asked, 3 + 1, "the host was asked only for the checkpoints kept");
}

/// The end of a host's state given unencoded ([`HostPart`]) is counted against the memory
/// bound by the size it stands for, is not held as checkpoint data, and is encoded into the
/// snapshot's data, after what the host wrote in place, only when the log is compacted to it.
#[test]
fn a_host_part_is_encoded_only_when_its_checkpoint_becomes_a_snapshot() {
    #[derive(Debug)]
    struct Part(Arc<AtomicU32>);
    impl HostPart for Part {
        fn encode_into(&self, out: &mut Vec<u8>) {
            self.0.fetch_add(1, Ordering::Relaxed);
            out.extend_from_slice(&[9u8; 1_000]);
        }
        fn encoded_len(&self) -> usize {
            1_000
        }
    }
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};
    let encoded = Arc::new(AtomicU32::new(0));
    let mut r = hosting_alone();
    r.set_checkpoint_memory(2_500);
    while r.poll_output().is_some() {}
    let mut asked = 0;
    for token in 1..=10 {
        let b = ReplicatedBatch::from_payloads(None, &[Bytes::from(format!("x{token}"))]);
        r.propose(token, &b).expect("leads");
        while let Some(o) = r.poll_output() {
            if let ReplicaOutput::CheckpointDue { index } = o {
                asked += 1;
                r.checkpoint_due(index).expect("due").extend_from_slice(b"head");
                r.finish_checkpoint_with(index, Some(Box::new(Part(encoded.clone()))));
            }
        }
    }
    assert_eq!((r.checkpoints.len(), asked), (3, 3), "the parts count against the bound (2,500 bytes)");
    assert!(r.checkpoint_memory() < 3 * 200, "held as data: the heads only, {}", r.checkpoint_memory());
    assert_eq!(encoded.load(Ordering::Relaxed), 0, "nothing encoded while waiting");
    assert!(r.compact_below(u64::MAX));
    assert_eq!(encoded.load(Ordering::Relaxed), 1, "the one compacted to, once");
    let mut persisted = None;
    while let Some(o) = r.poll_output() {
        if let ReplicaOutput::PersistSnapshot { snapshot, .. } = o {
            persisted = Some(snapshot);
        }
    }
    let snapshot = persisted.expect("compacted into a snapshot");
    let host = Replica::host_state_of(snapshot.get_data()).expect("reads");
    assert_eq!(&host[..4], b"head");
    assert_eq!(&host[4..], &[9u8; 1_000][..]);
    assert_eq!(r.checkpoint_memory(), 0);

    // With the snapshot on disk by reference the part is not encoded into the data at all: it
    // goes beside the snapshot, to be written piece by piece, and the whole is the same.
    let mut r = hosting_alone();
    r.set_snapshot_by_reference(true);
    while r.poll_output().is_some() {}
    let encoded = Arc::new(AtomicU32::new(0));
    for token in 1..=3 {
        let b = ReplicatedBatch::from_payloads(None, &[Bytes::from(format!("x{token}"))]);
        r.propose(token, &b).expect("leads");
        while let Some(o) = r.poll_output() {
            if let ReplicaOutput::CheckpointDue { index } = o {
                r.checkpoint_due(index).expect("due").extend_from_slice(b"head");
                r.finish_checkpoint_with(index, Some(Box::new(Part(encoded.clone()))));
            }
        }
    }
    assert!(r.compact_below(u64::MAX));
    let mut persisted = None;
    while let Some(o) = r.poll_output() {
        if let ReplicaOutput::PersistSnapshot { snapshot, rest } = o {
            persisted = Some((snapshot, rest));
        }
    }
    let (mut snapshot, rest) = persisted.expect("compacted into a snapshot");
    let rest = rest.expect("the part beside it");
    assert_eq!(encoded.load(Ordering::Relaxed), 0, "not encoded into the data");
    assert_eq!(Replica::host_state_of(snapshot.get_data()), Some(&b"head"[..]));
    assert_eq!(rest.len(), 1_000);
    assert_eq!(r.snapshot_memory(), 0, "the engine keeps none of it");
    rest.append_to(&mut snapshot);
    let host = Replica::host_state_of(snapshot.get_data()).expect("reads");
    assert_eq!((&host[..4], &host[4..]), (&b"head"[..], &[9u8; 1_000][..]));
}

#[test]
fn a_conditional_batch_is_written_only_at_its_expected_offset() {
    let mut r = leading_alone();
    let answer = |r: &mut Replica, token, expected| {
        let mut b = ReplicatedBatch::from_payloads(None, &[Bytes::from_static(b"x")]);
        b.expected_offset = Some(expected);
        assert_eq!(ReplicatedBatch::decode(&b.encode()), Ok(b.clone()));
        r.propose(token, &b).expect("leads");
        let mut a = None;
        while let Some(o) = r.poll_output() {
            if let ReplicaOutput::Answer { answer, .. } = o {
                a = Some(answer);
            }
        }
        a.expect("answered")
    };
    let tail = r.next_offset();
    assert_eq!(answer(&mut r, 1, tail), Answer::Appended { offset: tail, duplicate: false });
    // Written at `tail`: the same expectation again is refused with the new tail.
    assert_eq!(answer(&mut r, 2, tail), Answer::Refused(ApplyRefusal::OffsetMismatch { tail: tail + 1 }));
    assert_eq!(r.next_offset(), tail + 1);
    assert_eq!(answer(&mut r, 3, tail + 1), Answer::Appended { offset: tail + 1, duplicate: false });
}

/// A side entry (a consumer group's settlements) comes out in log order with the records,
/// takes no offset, and is answered `Applied`; its bytes are version 3, which a replica
/// from before side entries refuses to decode (and so skips) rather than taking its
/// operations for records.
#[test]
fn a_side_entry_takes_no_offset_and_comes_out_in_log_order() {
    let mut r = leading_alone();
    let side = ReplicatedBatch::side_entry(5, &[Bytes::from_static(b"op1"), Bytes::from_static(b"op2")]);
    let bytes = side.encode();
    assert_eq!(bytes[0], 3);
    assert_eq!(ReplicatedBatch::decode(&bytes), Ok(side.clone()));
    let mut plain = bytes.clone();
    plain[0] = 2;
    assert!(!ReplicatedBatch::decode(&plain).is_ok_and(|b| b.side), "version 2 is never a side entry");
    let tail = r.next_offset();
    let records = ReplicatedBatch::from_payloads(None, &[Bytes::from_static(b"x")]);
    r.propose(1, &records).expect("leads");
    r.propose(2, &side).expect("leads");
    r.propose(3, &records).expect("leads");
    let outs: Vec<ReplicaOutput> = std::iter::from_fn(|| r.poll_output()).collect();
    let seen: Vec<String> = outs
        .iter()
        .filter_map(|o| match o {
            ReplicaOutput::Delivered { offset, .. } => Some(format!("records@{offset}")),
            ReplicaOutput::Side { batch } => Some(format!("side{:?}", batch.payloads())),
            ReplicaOutput::Answer { token, answer } => Some(format!("{token}:{answer:?}")),
            _ => None,
        })
        .collect();
    let want = [
        format!("records@{tail}"),
        format!("1:{:?}", Answer::Appended { offset: tail, duplicate: false }),
        format!("side{:?}", side.payloads()),
        "2:Applied".to_owned(),
        format!("records@{}", tail + 1),
        format!("3:{:?}", Answer::Appended { offset: tail + 1, duplicate: false }),
    ];
    assert_eq!(seen, want);
    assert_eq!(r.next_offset(), tail + 2);
}

/// A replica replaying its kept log after a restart takes no answer to a read of its snapshot
/// (asked by its earlier life): the engine is held until the replay ends, and running it then
/// would deliver the entries kept in memory before the ones still to be replayed from disk,
/// at the wrong offsets. (The replica simulation found it: seed 99230.)
#[test]
fn a_snapshot_read_answered_while_replaying_is_not_taken() {
    let mut r = hosting_alone();
    r.set_snapshot_on_disk(true);
    let mut kept = RaftLog::default();
    let keep = |r: &mut Replica, kept: &mut RaftLog| {
        while let Some(o) = r.poll_output() {
            match o {
                ReplicaOutput::Persist { entries, hard_state } => kept.persist(&entries, hard_state.as_ref()),
                ReplicaOutput::PersistSnapshot { snapshot, .. } => kept.persist_snapshot(&snapshot),
                ReplicaOutput::CheckpointDue { index } => r.complete_checkpoint(index, b"host"),
                _ => {}
            }
        }
    };
    for token in 1..=3u64 {
        r.propose(token, &ReplicatedBatch::from_payloads(None, &[Bytes::from_static(b"before")])).expect("leads");
        keep(&mut r, &mut kept);
    }
    assert!(r.compact_below(u64::MAX));
    keep(&mut r, &mut kept);
    let snapshot = kept.snapshot.clone().expect("compacted");
    assert_eq!(r.snapshot_memory(), 0, "on disk only");
    for token in 4..=12u64 {
        r.propose(token, &ReplicatedBatch::from_payloads(None, &[Bytes::from(vec![7; 100])])).expect("leads");
        keep(&mut r, &mut kept);
    }
    // Restarted with the front of its committed entries on disk and the newest in memory.
    // (A lone member learns its commits without a hard state to persist; a later write's
    // would carry them.)
    kept.hard_state.commit = kept.last_index();
    kept.spill_committed(300);
    assert!(kept.spill.is_some() && !kept.entries.is_empty());
    let mut again = Replica::new_hosting(1, &[1], &kept, None, true).expect("restart");
    // Its data on disk, however many times that is said: the engine knows it let the data go
    // (said twice, it forgot, and sent the snapshot to a follower with no data at all).
    assert!(again.snapshot_memory() > 0);
    for _ in 0..2 {
        again.set_snapshot_on_disk(true);
        assert_eq!(again.offloaded_snapshot(), Some(snapshot.get_metadata().index));
        assert_eq!(again.snapshot_memory(), 0);
    }
    again.set_snapshot_by_reference(true);
    assert_eq!(again.offloaded_snapshot(), Some(snapshot.get_metadata().index));
    assert!(again.replaying());
    while again.poll_output().is_some() {}
    let index = snapshot.get_metadata().index;
    assert!(!again.handle_snapshot_read(index, Ok(snapshot)), "not taken while replaying");
    assert!(again.replaying());
    let delivered: Vec<u64> = std::iter::from_fn(|| again.poll_output())
        .filter_map(|o| match o {
            ReplicaOutput::Delivered { offset, .. } => Some(offset),
            _ => None,
        })
        .collect();
    assert_eq!(delivered, Vec::<u64>::new(), "nothing delivered ahead of the replay");
}
