//! Storage's tests: appends and group commit, reads and seeks, recovery from torn and damaged
//! files, deletes and truncation.

use super::*;
use felix_proto::Records;
use std::time::Duration;

fn req(token: u64, base: u64, payloads: &[&str]) -> PersistRequest {
    PersistRequest {
        key: None,
        token: WriteToken(token),
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "../orders".into(),
        shard: 0,
        base_offset: base,
        records: Records::from_payloads(payloads.iter().map(|p| p.as_bytes())).unwrap(),
        timestamp_micros: 5,
        publisher: None,
        generation_start: false,
        producer: None,
        state: None,
        fsync: None,
        stream_shards: 1,
    }
}

#[test]
fn write_recover_and_repair_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
    s.set_segment_bytes(60);
    let res = s.write(vec![req(1, 0, &["a", "b"]), req(2, 2, &["c"]), req(3, 3, &["d"])]);
    assert!(res.iter().all(|r| r.1 == WriteOutcome::Written));
    drop(s);
    // Tear the last segment's tail.
    let shard = dir.path().join("streams/t1/default/%2E.%2Forders/0");
    let segs = segments(&shard).unwrap();
    assert!(segs.len() >= 2, "segments roll at the size limit");
    let last = &segs.last().unwrap().1;
    let len = std::fs::metadata(last).unwrap().len();
    OpenOptions::new().write(true).open(last).unwrap().set_len(len - 3).unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
    let rec = s.recover().unwrap();
    assert_eq!(rec.len(), 1);
    assert_eq!(rec[0].stream, "../orders");
    let offsets: Vec<u64> = rec[0].batches.iter().map(|b| b.base_offset).collect();
    assert_eq!(offsets, vec![0, 2]);
    assert_eq!(rec[0].repairs.len(), 1);
    // After the repair, appending continues cleanly.
    assert_eq!(s.write(vec![req(4, 3, &["d"])])[0].1, WriteOutcome::Written);
    let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
    assert_eq!(rec[0].batches.len(), 3);
    assert!(rec[0].repairs.is_empty());
}

/// D60: a created stream's shard count is on disk before its first record, and recovery
/// hands it back as one empty shard carrying the count; a written stream's `meta` is kept.
#[test]
fn a_recorded_stream_is_recovered_with_its_shards_before_any_record() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
    s.record_stream(("t1", "default", "wide"), 8).unwrap();
    s.record_stream(("t1", "default", "wide"), 2).unwrap(); // a shard count never changes
    s.write(vec![req(1, 0, &["a"])]);
    s.record_stream(("t1", "default", "../orders"), 5).unwrap(); // written already: kept
    drop(s);
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Always).unwrap();
    let got = s.recover().unwrap();
    let wide = got.iter().find(|r| r.stream == "wide").expect("recovered unwritten");
    assert_eq!((wide.shard, wide.stream_shards, wide.batches.len()), (0, 8, 0));
    let orders = got.iter().find(|r| r.stream == "../orders").expect("written");
    assert_eq!(orders.batches.len(), 1);
    assert_ne!(orders.stream_shards, 5, "the meta its first write made stands");
}

#[test]
fn retention_deletes_whole_segments_below_the_start() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(1);
    // One batch per segment: bases 0, 2, 3, 4.
    s.write(vec![req(1, 0, &["a", "b"]), req(2, 2, &["c"]), req(3, 3, &["d"]), req(4, 4, &["e"])]);
    let name = ("t1", "default", "../orders");
    assert_eq!(s.truncate_before(name, 0, 3, &[], None), 2, "segments [0,2) and [2,3) go");
    assert_eq!(s.truncate_before(name, 0, 100, &[], None), 1, "the newest segment stays");
    let rec = s.recover().unwrap();
    assert_eq!(rec[0].batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![4]);
    assert!(rec[0].producer_watermarks.is_empty());
}

#[test]
fn retention_lists_a_shard_only_when_a_segment_can_go_and_sees_segments_started_since() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let name = ("t1", "default", "../orders");
    // One segment: nothing can go, whatever the start; listed once.
    s.write(vec![req(1, 0, &["a", "b"])]);
    for start in [1, 2, 50] {
        assert_eq!(s.truncate_before(name, 0, start, &[], None), 0);
    }
    assert_eq!(s.retention_listings(), 1, "a stream at its limit asks at every batch: one listing");
    // A segment started since (at 2): the first one can go now, and is seen to.
    s.set_segment_bytes(1);
    s.write(vec![req(2, 2, &["c"]), req(3, 3, &["d"])]);
    assert_eq!(s.truncate_before(name, 0, 2, &[], None), 1, "[0,2) goes");
    assert_eq!(s.retention_listings(), 2);
    // Bases 2 and 3 left: below 3 nothing can go, and no listing is made.
    assert_eq!(s.truncate_before(name, 0, 2, &[], None), 0);
    assert_eq!(s.retention_listings(), 2);
    assert_eq!(s.truncate_before(name, 0, 3, &[], None), 1, "[2,3) goes");
    let rec = s.recover().unwrap();
    assert_eq!(rec[0].batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![3]);
    // A shard reset and written again from 10 is listed afresh.
    s.reset_shard(name, 0).unwrap();
    s.write(vec![req(4, 10, &["e"]), req(5, 11, &["f"])]);
    assert_eq!(s.truncate_before(name, 0, 11, &[], None), 1, "[10,11) goes");
}

#[test]
fn streams_written_in_turns_each_keep_their_own_directory() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let on = |stream: &str, token: u64, base: u64| PersistRequest { stream: stream.into(), ..req(token, base, &["x"]) };
    // The storage keeps the last stream's directory; each turn must land in its own.
    s.write(vec![on("a", 1, 0), on("b", 2, 0), on("a", 3, 1), on("c", 4, 0), on("b", 5, 1), on("a", 6, 2)]);
    let mut got: Vec<(String, Vec<u64>)> = s
        .recover()
        .unwrap()
        .into_iter()
        .map(|r| (r.stream.clone(), r.batches.iter().map(|b| b.base_offset).collect()))
        .collect();
    got.sort();
    assert_eq!(got, vec![("a".into(), vec![0, 1, 2]), ("b".into(), vec![0, 1]), ("c".into(), vec![0])]);
}

#[test]
fn producer_watermarks_are_kept_beside_the_shard_and_survive_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(1);
    s.write(vec![req(1, 0, &["a"]), req(2, 1, &["b"]), req(3, 2, &["c"])]);
    let name = ("t1", "default", "../orders");
    s.truncate_before(name, 0, 1, &[(7, 4), (9, 1)], None);
    s.truncate_before(name, 0, 2, &[(7, 3), (8, 5)], None); // the highest per producer is kept
    let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
    assert_eq!(rec[0].producer_watermarks, vec![(7, 4), (8, 5), (9, 1)]);
    assert!(rec[0].repairs.is_empty());
    // A damaged file is reported and read as none; recovery goes on.
    let file = dir.path().join("streams").join("t1").join("default");
    let shard_dir = std::fs::read_dir(&file).unwrap().next().unwrap().unwrap().path().join("0");
    std::fs::write(shard_dir.join(WATERMARKS), b"FLXP garbage").unwrap();
    let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
    assert!(rec[0].producer_watermarks.is_empty());
    assert_eq!(rec[0].repairs.len(), 1, "{:?}", rec[0].repairs);
}

#[test]
fn history_reads_seek_to_the_batch_they_need() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(100);
    let reqs: Vec<_> = (0..20).map(|i| req(i + 1, i, &[&format!("payload-{i:02}")])).collect();
    s.write(reqs);
    let name = ("t1", "default", "../orders");
    let got: Vec<u64> = s.read_range(name, 0, 7, 12, 1 << 20).iter().map(|b| b.base_offset).collect();
    assert_eq!(got, (7..12).collect::<Vec<_>>());
    let capped = s.read_range(name, 0, 0, 20, 25);
    assert_eq!(capped.len(), 3, "stops once max_bytes is reached");
    // The same after a restart, from the index rebuilt by recovery.
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.recover().unwrap();
    let got: Vec<u64> = s.read_range(name, 0, 15, 100, 1 << 20).iter().map(|b| b.base_offset).collect();
    assert_eq!(got, (15..20).collect::<Vec<_>>());
    assert!(s.read_range(("t1", "default", "nope"), 0, 0, 10, 100).is_empty());
}

/// The reader beside the writer gives what the writer's own read gives, from any offset,
/// while the writer appends, across rolled segments, through the sparse seek points.
#[test]
fn the_history_reader_beside_the_writer_reads_what_the_writer_reads() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(4 << 10);
    let name = ("t1", "default", "../orders");
    let mut h = s.history_reader();
    let mut next = 0u64;
    for round in 0..6u64 {
        // 200 one-record batches a round: several segments, more than SPARSE_EVERY batches each.
        let reqs: Vec<_> = (0..200).map(|i| req(next + i + 1, next + i, &[&format!("r{round}-{i:03}")])).collect();
        next += 200;
        assert!(s.write(reqs).iter().all(|r| r.1 == WriteOutcome::Written));
        for from in [0, next / 3, next - 150, next - 1] {
            let theirs: Vec<u64> = s.read_range(name, 0, from, next, 1 << 20).iter().map(|b| b.base_offset).collect();
            let ours: Vec<u64> = h.read_range(name, 0, from, next, 1 << 20).iter().map(|b| b.base_offset).collect();
            assert_eq!(ours, (from..next).collect::<Vec<_>>(), "round {round}, from {from}");
            assert_eq!(ours, theirs);
        }
    }
    let capped = h.read_range(name, 0, 10, next, 25);
    assert_eq!(capped.len(), 5, "stops once max_bytes is reached (6-byte records)");
    assert_eq!(capped[0].records.slices().next().unwrap(), b"r0-010");
    assert!(h.read_range(("t1", "default", "nope"), 0, 0, 10, 100).is_empty());
    // From another thread, as the tokio driver runs it.
    let got = std::thread::spawn(move || h.read_range(name, 0, 700, 705, 1 << 20)).join().unwrap();
    assert_eq!(got.iter().map(|b| b.base_offset).collect::<Vec<_>>(), (700..705).collect::<Vec<_>>());
}

/// Segments removed behind the reader's back (retention) and a shard emptied and written
/// again (a copy moving here) are read as they are now, never through stale seek points.
#[test]
fn the_history_reader_follows_retention_and_a_shard_written_again() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(2 << 10);
    let name = ("t1", "default", "../orders");
    let mut h = s.history_reader();
    s.write((0..300).map(|i| req(i + 1, i, &[&format!("old-{i:03}")])).collect());
    assert_eq!(h.read_range(name, 0, 250, 300, 1 << 20).len(), 50);
    assert!(s.truncate_before(name, 0, 200, &[], None) > 0);
    let after: Vec<u64> = h.read_range(name, 0, 0, 300, 1 << 20).iter().map(|b| b.base_offset).collect();
    assert!(after[0] > 0 && after[0] <= 200, "retention removed the oldest segments: {}", after[0]);
    assert_eq!(*after.last().unwrap(), 299);
    // Emptied and written again from 0 with other contents and other batch sizes.
    s.reset_shard(name, 0).unwrap();
    s.write((0..100).map(|i| req(1000 + i, i * 3, &["new-a", "new-b", "new-c"])).collect());
    let got = h.read_range(name, 0, 151, 300, 1 << 20);
    assert_eq!(got.iter().map(|b| b.base_offset).collect::<Vec<_>>(), (50..100).map(|i| i * 3).collect::<Vec<_>>());
    assert_eq!(got[0].records.slices().next().unwrap(), b"new-a");
}

/// A segment rewritten in place (the same inode, as a file removed and made again may
/// get): seek points found before are checked against the file, not trusted.
#[test]
fn the_history_reader_checks_its_seek_points_against_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let name = ("t1", "default", "../orders");
    let mut h = s.history_reader();
    s.write((0..300).map(|i| req(i + 1, i, &[&format!("old-{i:03}")])).collect());
    assert_eq!(h.read_range(name, 0, 250, 300, 1 << 20)[0].base_offset, 250);
    drop(s);
    let shard = dir.path().join("streams/t1/default/%2E.%2Forders/0");
    let segs = segments(&shard).unwrap();
    assert_eq!(segs.len(), 1);
    let mut rewritten = BytesMut::new();
    for i in 0..200u64 {
        let b = StoredBatch {
            key: None,
            base_offset: i * 3,
            timestamp_micros: 5,
            generation_start: false,
            publisher: None,
            producer: None,
            state: None,
            records: Records::from_payloads([b"new-a".as_slice(), b"new-bb", b"new-ccc"]).unwrap(),
        };
        encode_batch(&b, &mut rewritten);
    }
    std::fs::write(&segs[0].1, &rewritten).unwrap();
    let got = h.read_range(name, 0, 201, 240, 1 << 20);
    assert_eq!(got.iter().map(|b| b.base_offset).collect::<Vec<_>>(), (67..80).map(|i| i * 3).collect::<Vec<_>>());
}

/// A commit in an old segment (known by its index only at start) still gives the broker its
/// state: recovery reads the commit batches whole.
#[test]
fn commits_in_summarized_segments_are_read_for_their_state() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(200);
    let mut first = req(1, 0, &["opened"]);
    first.state = felix_proto::storage::encode_state_changes(&[("balance".into(), Some(Bytes::from_static(b"10")))]);
    let mut reqs = vec![first];
    reqs.extend((1..60).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])));
    s.write(reqs);
    drop(s);
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let rec = s.recover_within(|_, _, _| 60).unwrap();
    assert!(rec[0].summaries.first().is_some_and(|e| e.base_offset == 0 && e.state), "the commit is summarized");
    assert_eq!(rec[0].state_batches.len(), 1);
    assert_eq!(rec[0].state_batches[0].base_offset, 0);
    assert_eq!(
        felix_proto::storage::decode_state_changes(rec[0].state_batches[0].state.as_ref().unwrap()).unwrap(),
        vec![("balance".to_string(), Some(Bytes::from_static(b"10")))]
    );
}

/// Retention's state checkpoint is on disk before any segment goes, comes back at
/// recovery, and spares recovery the commits it holds (only later ones are read). A
/// damaged one stops recovery with an error that names the file.
#[test]
fn a_state_checkpoint_is_kept_before_segments_go_and_bounds_what_recovery_reads() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(200);
    let commit = |token: u64, base: u64, key: &str| {
        let mut r = req(token, base, &["c"]);
        r.state = felix_proto::storage::encode_state_changes(&[(key.into(), Some(Bytes::from_static(b"v")))]);
        r
    };
    let mut reqs = vec![commit(1, 0, "old")];
    reqs.extend((1..30).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])));
    reqs.push(commit(31, 30, "mid"));
    reqs.extend((31..60).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])));
    s.write(reqs);
    let checkpoint = felix_proto::storage::StateCheckpoint {
        as_of: 30,
        values: vec![("mid".into(), Bytes::from_static(b"v"), 30), ("old".into(), Bytes::from_static(b"v"), 0)],
    };
    let file = felix_proto::storage::encode_state_checkpoint(&checkpoint).unwrap();
    // Retention below offset 20: the first commit's segment goes, the checkpoint stays.
    let name = ("t1", "default", "../orders");
    let ns = dir.path().join("streams").join("t1").join("default");
    let shard_dir = std::fs::read_dir(&ns).unwrap().next().unwrap().unwrap().path().join("0");
    // A truncation that deletes nothing writes nothing: every commit is still on disk.
    assert_eq!(s.truncate_before(name, 0, 1, &[], Some(&file)), 0);
    assert!(!shard_dir.join(STATE_CHECKPOINT).exists());
    assert!(s.truncate_before(name, 0, 20, &[], Some(&file)) > 0);
    assert_eq!(std::fs::read(shard_dir.join(STATE_CHECKPOINT)).unwrap(), file);
    drop(s);
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let rec = s.recover_within(|_, _, _| 60).unwrap();
    assert_eq!(rec[0].state_checkpoint.as_ref(), Some(&checkpoint));
    assert!(rec[0].summaries.iter().any(|e| e.base_offset == 30 && e.state), "the later commit is summarized");
    assert!(rec[0].state_batches.is_empty(), "the checkpoint holds every commit: none is read");
    // A flipped bit: recovery stops and says which file and what moving it aside costs.
    let mut damaged = file.to_vec();
    damaged[10] ^= 1;
    std::fs::write(shard_dir.join(STATE_CHECKPOINT), damaged).unwrap();
    drop(s);
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let e = s.recover_within(|_, _, _| 60).unwrap_err().to_string();
    assert!(e.contains("state.checkpoint") && e.contains("checksum") && e.contains("move it aside"), "{e}");
    // A shard holding no segment yet (a moved shard's copy, emptied for it) takes it.
    let empty = ("t1", "default", "fresh");
    s.truncate_before(empty, 0, 40, &[], Some(&file));
    let fresh = std::fs::read_dir(&ns).unwrap().flatten().map(|e| e.path()).find(|p| p.ends_with("fresh")).unwrap();
    assert_eq!(std::fs::read(fresh.join("0").join(STATE_CHECKPOINT)).unwrap(), file);
    std::fs::remove_dir_all(fresh).unwrap();
    // Moved aside: recovery goes on with the commits still on disk.
    std::fs::remove_file(shard_dir.join(STATE_CHECKPOINT)).unwrap();
    let rec = s.recover_within(|_, _, _| 60).unwrap();
    assert_eq!(rec[0].state_checkpoint, None);
    assert_eq!(rec[0].state_batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![30]);
}

/// Retention deletes no segment holding a commit the checkpoint on disk does not hold (nor
/// any after it), whatever the truncation asks: the broker hands its state over once a
/// second, not with every write. Across a restart too (the segments' commits come from
/// their indexes, the checkpoint's `as_of` from its file).
#[test]
fn retention_keeps_a_segment_with_a_commit_newer_than_the_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(1);
    let mut commit = req(3, 2, &["c"]);
    commit.state = felix_proto::storage::encode_state_changes(&[("k".into(), Some(Bytes::from_static(b"v")))]);
    // One batch per segment: 0, 1, the commit at 2, 3, 4.
    s.write(vec![req(1, 0, &["a"]), req(2, 1, &["b"]), commit, req(4, 3, &["d"]), req(5, 4, &["e"])]);
    let name = ("t1", "default", "../orders");
    assert_eq!(s.truncate_before(name, 0, 4, &[], None), 2, "0 and 1 go; the commit and what follows stay");
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let rec = s.recover().unwrap();
    assert_eq!(rec[0].batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![2, 3, 4]);
    assert_eq!(s.truncate_before(name, 0, 4, &[], None), 0, "still no checkpoint holding it");
    let older = felix_proto::storage::StateCheckpoint { as_of: 1, values: Vec::new() };
    let older = felix_proto::storage::encode_state_checkpoint(&older).unwrap();
    assert_eq!(s.truncate_before(name, 0, 4, &[], Some(&older)), 0, "a checkpoint before the commit");
    let holding =
        felix_proto::storage::StateCheckpoint { as_of: 2, values: vec![("k".into(), Bytes::from_static(b"v"), 2)] };
    let holding = felix_proto::storage::encode_state_checkpoint(&holding).unwrap();
    assert_eq!(s.truncate_before(name, 0, 4, &[], Some(&holding)), 2, "held by the checkpoint: it goes");
    let rec = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
    assert_eq!(rec[0].batches.iter().map(|b| b.base_offset).collect::<Vec<_>>(), vec![4]);
    assert_eq!(rec[0].state_checkpoint.as_ref().map(|c| c.as_of), Some(2));
}

#[test]
fn recovery_reads_indexes_not_old_segments_and_rebuilds_a_bad_index() {
    use felix_proto::broker::{Broker, BrokerConfig, StreamConfig};
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    s.set_segment_bytes(200);
    let mut producer_req = req(1000, 100, &["idem"]);
    producer_req.producer = Some((77, 0));
    let mut reqs: Vec<_> = (0..100).map(|i| req(i + 1, i, &[&format!("payload-{i:03}")])).collect();
    reqs.push(producer_req);
    s.write(reqs);
    drop(s);
    let shard = dir.path().join("streams/t1/default/%2E.%2Forders/0");
    let segs = segments(&shard).unwrap();
    assert!(segs.len() > 10);
    let sealed = &segs[..segs.len() - 1];
    assert!(sealed.iter().all(|(_, p)| index_path(p).exists()), "every sealed segment has an index");
    // Make an old segment unreadable: recovery must not need it (its index says enough).
    let victim = &sealed[1].1;
    let original = std::fs::read(victim).unwrap();
    let mut garbage = original.clone();
    garbage.iter_mut().skip(20).for_each(|b| *b = 0xAA);
    std::fs::write(victim, &garbage).unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let rec = s.recover_within(|_, _, _| 60).unwrap();
    assert!(rec[0].repairs.is_empty(), "{:?}", rec[0].repairs);
    let summarized: u64 = rec[0].summaries.iter().map(|e| e.count).sum();
    let whole: u64 = rec[0].batches.iter().map(|b| b.count()).sum();
    assert_eq!(summarized + whole, 101);
    assert!(whole <= 15 && summarized >= 85, "only the newest part is read whole: {whole}");
    assert_eq!(rec[0].batches.last().unwrap().producer, Some((77, 0)));
    // The broker rebuilds the same state from summaries as from whole batches.
    let restore = |rec: &RecoveredShard| {
        let cfg = BrokerConfig { history_reads: true, ..BrokerConfig::default() };
        let t0 = felix_proto::transport::WallClock::new(std::time::Instant::now(), 0); // test clock
        let mut b = Broker::new(cfg, t0);
        let now = std::time::Instant::now();
        let name = ("t1", "default", "../orders");
        b.restore_shard_summaries(name, StreamConfig::default(), 0, &rec.summaries, now);
        b.restore_shard(name, StreamConfig::default(), 0, rec.batches.clone(), now);
        b.shard_state("t1", "default", "../orders", 0)
    };
    std::fs::write(victim, &original).unwrap();
    let full = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover().unwrap();
    assert_eq!(restore(&rec[0]), restore(&full[0]));
    // A damaged index is rebuilt from its segment.
    let idx = index_path(&sealed[3].1);
    std::fs::write(&idx, b"FLXI nonsense").unwrap();
    let rec2 = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap().recover_within(|_, _, _| 60).unwrap();
    assert_eq!(rec2[0].summaries, rec[0].summaries);
    assert!(decode_index(&std::fs::read(&idx).unwrap(), std::fs::metadata(&sealed[3].1).unwrap().len()).is_ok());
    // The newest segment, continued after the restart, gets a whole index when it is sealed
    // (its entries from before the restart included).
    let newest = segs.last().unwrap().1.clone();
    let more: Vec<_> = (0..10).map(|i| req(2000 + i, 101 + i, &[&format!("later-{i:03}")])).collect();
    s.set_segment_bytes(200);
    assert!(s.write(more).iter().all(|r| r.1 == WriteOutcome::Written));
    let sealed_now =
        decode_index(&std::fs::read(index_path(&newest)).unwrap(), std::fs::metadata(&newest).unwrap().len())
            .expect("sealed with a sound index");
    let scanned = decode_segment(Bytes::from(std::fs::read(&newest).unwrap()));
    assert_eq!(sealed_now.len(), scanned.batches.len());
    assert_eq!(sealed_now.last().map(|e| e.base_offset), scanned.batches.last().map(|b| b.base_offset));
    // History reads still find old records through the recovered index.
    let got: Vec<u64> =
        s.read_range(("t1", "default", "../orders"), 0, 5, 8, 1 << 20).iter().map(|b| b.base_offset).collect();
    assert_eq!(got, vec![5, 6, 7]);
}

#[test]
fn each_stream_keeps_its_own_fsync_policy() {
    let dir = tempfile::tempdir().unwrap();
    let mut s = DiskStorage::open(dir.path(), FsyncMode::Never).unwrap();
    let mut always = req(1, 0, &["a"]);
    always.fsync = Some(felix_proto::broker::FsyncMode::Always);
    let mut plain = req(2, 0, &["b"]);
    plain.stream = "other".into();
    let res = s.write(vec![always, plain]);
    assert!(res.iter().all(|r| r.1 == WriteOutcome::Written));
    assert_eq!(s.syncs(), 1, "only the `always` stream's file was synced");
    let mut interval = req(3, 1, &["c"]);
    interval.fsync = Some(felix_proto::broker::FsyncMode::Interval(Duration::ZERO));
    s.write(vec![interval]);
    assert_eq!(s.syncs(), 2, "an interval of zero is due at once");
    let mut never = req(4, 1, &["d"]);
    never.stream = "other".into();
    s.write(vec![never]);
    s.sync_due();
    assert_eq!(s.syncs(), 2, "the storage default here is never");
}

#[test]
fn fsync_policy_parses() {
    assert_eq!("always".parse(), Ok(FsyncMode::Always));
    assert_eq!("interval:50".parse(), Ok(FsyncMode::Interval(Duration::from_millis(50))));
    assert!("sometimes".parse::<FsyncMode>().is_err());
    for m in [FsyncMode::Always, FsyncMode::Never, FsyncMode::Interval(Duration::from_millis(100))] {
        assert_eq!(m.to_string().parse(), Ok(m), "printed as it is written: {m}");
    }
}
