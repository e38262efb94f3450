use super::*;

fn recs(n: usize) -> Records {
    Records::from_payloads((0..n).map(|i| format!("r{i}"))).unwrap()
}

/// A broker restarted with its clock set back (or handed a batch stamped by a clock behind)
/// gives no batch an older time than the last one: `offset_for_time` stays a search over
/// non-decreasing times. Without the clamp the batch after the restart was stamped 50.
#[test]
fn timestamps_never_go_back_whatever_the_clock_says() {
    let mut log = ShardLog::new(true, Retention::default());
    log.restore(crate::storage::StoredBatch {
        key: None,
        base_offset: 0,
        timestamp_micros: 100,
        generation_start: false,
        publisher: None,
        producer: None,
        state: None,
        records: recs(2),
    });
    assert_eq!(log.stamp(50), 100);
    let (base, _) = log.append(recs(1), 50, None, Some(WriteToken(1)));
    log.settle(WriteToken(1), true);
    assert_eq!(log.append_generation_start(10, WriteToken(2)), 3);
    log.settle(WriteToken(2), true);
    let (later, _) = log.append(recs(1), 300, None, Some(WriteToken(3)));
    log.settle(WriteToken(3), true);
    assert_eq!(
        log.append_committed(
            5,
            Committed { records: recs(1), timestamp_micros: 200, ..Committed::default() },
            false,
            0
        ),
        Some(6)
    );
    let times: Vec<u64> = log.committed.iter().map(|b| b.timestamp_micros).collect();
    assert_eq!(times, [100, 100, 100, 300, 300]);
    assert_eq!(log.offset_for_time(100), Some(0));
    assert_eq!(log.offset_for_time(101), Some(later));
    assert_eq!(base, 2);
    // A snapshot's time raises it; nothing lowers it.
    log.raise_timestamp(400);
    log.raise_timestamp(7);
    assert_eq!(log.last_timestamp(), 400);
}

#[test]
fn durable_offsets_become_visible_in_order() {
    let mut log = ShardLog::new(true, Retention::default());
    let (a, none) = log.append(recs(2), 1, None, Some(WriteToken(1)));
    assert!(none.is_none());
    let (b, _) = log.append(recs(3), 1, None, Some(WriteToken(2)));
    assert_eq!((a, b, log.next_offset()), (0, 2, 5));
    assert_eq!(log.committed_tail(), 0);
    // The second write finishes first: nothing is visible until the first does.
    let s = log.settle(WriteToken(2), true);
    assert!(s.committed.is_empty());
    let s = log.settle(WriteToken(1), true);
    assert_eq!(s.committed, vec![(0, 2), (2, 5)]);
    assert_eq!(log.committed_tail(), 5);
    assert_eq!(log.batch_at(3).unwrap().base, 2);
    assert!(log.batch_at(5).is_none());
}

#[test]
fn failed_write_leaves_a_gap_and_is_reported() {
    let mut log = ShardLog::new(true, Retention::default());
    log.append(recs(2), 1, None, Some(WriteToken(1)));
    log.append(recs(1), 1, None, Some(WriteToken(2)));
    let s = log.settle(WriteToken(1), false);
    assert_eq!(s.failed, vec![(WriteToken(1), 0, 2)]);
    let s = log.settle(WriteToken(2), true);
    assert_eq!(s.committed, vec![(2, 3)]);
    assert_eq!(log.retained_records(), 1);
}

#[test]
fn generation_start_is_skipped_and_counted() {
    let mut log = ShardLog::new(true, Retention::default());
    log.append(recs(2), 1, None, Some(WriteToken(1)));
    log.append_generation_start(0, WriteToken(2));
    assert_eq!(log.next_offset(), 3);
    log.settle(WriteToken(1), true);
    log.settle(WriteToken(2), true);
    assert_eq!(log.committed_tail(), 3);
    assert_eq!(log.readable_tail(), 2, "latest stops short of a trailing generation-start record");
    log.append(recs(1), 1, None, Some(WriteToken(3)));
    log.settle(WriteToken(3), true);
    let b = log.next_deliverable(2).unwrap();
    assert_eq!((b.base, b.skipped_before), (3, 1));
}

#[test]
fn retention_by_records() {
    let mut log = ShardLog::new(true, Retention { max_records: Some(3), max_bytes: None, max_age: None });
    for t in 0..4 {
        log.append(recs(2), 1, None, Some(WriteToken(t)));
        log.settle(WriteToken(t), true);
    }
    assert_eq!(log.enforce_retention(1), 6);
    assert_eq!(log.retained_records(), 2);
    assert!(log.batch_at(5).is_none());
    assert_eq!(log.batch_at(6).unwrap().base, 6);
}

#[test]
fn the_memory_budget_counts_each_batch_overhead_not_only_payload() {
    let mut log = ShardLog::new(true, Retention::default());
    // Room for four single-record batches ("r0": 2 payload bytes each) with their overhead;
    // counting payload alone would have kept all ten.
    log.set_memory_budget(Some(4 * (2 + BATCH_OVERHEAD)));
    for t in 0..10 {
        log.append(recs(1), 1, None, Some(WriteToken(t)));
        log.settle(WriteToken(t), true);
        log.trim_memory();
    }
    assert_eq!(log.memory_bytes(), 4 * (2 + BATCH_OVERHEAD));
    assert_eq!(log.memory_start(), 6, "the oldest six went to disk-only history");
    assert_eq!(log.retained_records(), 10, "eviction from memory is not retention");
}
