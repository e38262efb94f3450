//! The replica logs' tests: appends, reads, snapshots, restarts, damage and quarantine.

use super::*;
use felix_proto::cluster::meta::Entry;

/// A fresh data directory for one test (`tag` names it), the shard its logs are of, and
/// the logs opened there (lazily synced) with segments closed at `segment_bytes`.
fn ledger_logs(tag: &str, segment_bytes: u64) -> (std::path::PathBuf, ShardId, ReplicaLogs) {
    let dir = std::env::temp_dir().join(format!("felix-replica-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shard = ShardId::of(Kind::Stream, "t", "ns", "ledger", 0);
    let mut logs = ReplicaLogs::open(Some(&dir), Some(std::time::Duration::from_secs(1)), None).unwrap().logs;
    logs.segment_bytes = segment_bytes;
    (dir, shard, logs)
}

/// Entry `index` of `term`, 90 bytes of data.
fn entry(index: u64, term: u64) -> Entry {
    Entry { index, term, data: vec![index as u8; 90].into(), ..Entry::default() }
}

/// Entries are read back from the files by index, across segments, with an overwritten
/// tail giving its last write, after a snapshot deleted the oldest segments, and after a
/// restart (whose index is rebuilt by the fold). The index holds a point per segment, not
/// per record.
#[test]
fn a_replica_logs_entries_are_read_back_by_index_across_segments_and_restarts() {
    use felix_proto::cluster::meta::{HardState, Snapshot};
    let (dir, shard, mut logs) = ledger_logs("reads", 4000);
    for index in 1..=200u64 {
        let hs = HardState { term: 1, commit: index.saturating_sub(5), ..HardState::default() };
        logs.persist(&shard, &[entry(index, 1)], Some(&hs)).unwrap();
    }
    // A new leader (term 2) overwrote the uncommitted tail 196..=200.
    let tail: Vec<Entry> = (196..=203).map(|i| entry(i, 2)).collect();
    logs.persist(&shard, &tail, Some(&HardState { term: 2, commit: 203, ..HardState::default() })).unwrap();
    let read = |logs: &ReplicaLogs, low, high, max| -> Vec<(u64, u64)> {
        let job = logs.read_job(&shard, low, high, max).expect("kept");
        job.run().unwrap().iter().map(|e| (e.index, e.term)).collect()
    };
    let want =
        |low: u64, high: u64| -> Vec<(u64, u64)> { (low..high).map(|i| (i, if i >= 196 { 2 } else { 1 })).collect() };
    let segments = logs.segments(&shard).len();
    assert!(segments > 5, "rolled into {segments} segments");
    assert!(logs.shards[&shard].points.len() <= segments + 1, "{} points", logs.shards[&shard].points.len());
    for (low, high) in [(1, 4), (37, 120), (190, 204), (196, 199)] {
        assert_eq!(read(&logs, low, high, u64::MAX), want(low, high), "{low}..{high}");
    }
    assert_eq!(read(&logs, 10, 200, 400), want(10, 15), "about 400 bytes: five entries of 90");
    let mut snap = Snapshot::default();
    snap.mut_metadata().index = 100;
    snap.mut_metadata().term = 1;
    logs.persist_snapshot(&shard, &snap, None).unwrap();
    assert!(logs.segments(&shard).len() < segments, "a snapshot deleted segments");
    // The restart's first pass reads headers only, and finds what reading it all finds.
    let floors: Vec<u64> = logs
        .segments(&shard)
        .iter()
        .map(|seq| {
            let path = logs.dir.as_ref().expect("a directory").join(replica_file_name(&shard, *seq));
            let whole = felix_proto::cluster::meta::LogFold::snapshot_floor(&std::fs::read(&path).unwrap());
            assert_eq!(snapshot_floor_of(&path).unwrap(), whole, "{}", path.display());
            whole
        })
        .collect();
    assert!(floors.contains(&100), "{floors:?}");
    assert_eq!(read(&logs, 150, 160, u64::MAX), want(150, 160));
    drop(logs);
    let logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
    assert_eq!(read(&logs, 150, 160, u64::MAX), want(150, 160), "after a restart");
    assert_eq!(read(&logs, 190, 204, u64::MAX), want(190, 204), "after a restart");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A restart with a budget holds the newest committed entries within it and the
/// uncommitted tail; the committed entries before them are left on disk (their terms and
/// the configuration changes among them kept), readable by index as the replica replays
/// them. What it holds and what it left add up to the whole fold's log.
#[test]
fn a_restart_with_a_budget_leaves_the_committed_front_of_the_log_on_disk() {
    use felix_proto::cluster::meta::HardState;
    let (dir, shard, mut logs) = ledger_logs("spill", 3000);
    for index in 1..=300u64 {
        let term = 1 + index / 100;
        let hs = HardState { term, commit: index.saturating_sub(20), ..HardState::default() };
        logs.persist(&shard, &[entry(index, term)], Some(&hs)).unwrap();
    }
    drop(logs);
    let whole = ReplicaLogs::open(Some(&dir), None, None).unwrap().kept.remove(&shard).expect("kept");
    assert!(whole.spill.is_none() && whole.entries.len() == 300);
    let OpenedReplicaLogs { logs, mut kept, damaged, .. } = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
    assert!(damaged.is_empty());
    let part = kept.remove(&shard).expect("kept");
    let spill = part.spill.as_ref().expect("the committed front left on disk");
    assert_eq!(spill.first(), 1);
    assert_eq!(spill.end(), part.entries[0].index, "the log goes on in memory where the disk part ends");
    // 20 uncommitted entries stay whatever the budget, and about 2000 bytes of committed ones.
    let committed_held = part.entries.iter().filter(|e| e.index <= part.hard_state.commit).count();
    assert!(part.entries.len() >= 20 && committed_held <= 10, "{} held", part.entries.len());
    assert_eq!(part.hard_state, whole.hard_state);
    for e in &whole.entries {
        match spill.term(e.index) {
            Some(t) => assert_eq!(t, e.term, "{}", e.index),
            None => assert!(part.entries.iter().any(|p| p == e), "{}", e.index),
        }
    }
    // The replay's reads give the entries left on disk back, in bounded reads.
    let mut next = spill.first();
    let mut reads = 0;
    while next < spill.end() {
        let got = logs.read_job(&shard, next, spill.end(), 1000).expect("kept").run().unwrap();
        assert!(!got.is_empty() && got.len() < 20, "{} entries in one read", got.len());
        for e in got.iter().take_while(|e| e.index < spill.end()) {
            assert_eq!(e, &whole.entries[e.index as usize - 1]);
            next = e.index + 1;
        }
        reads += 1;
    }
    assert!(reads > 10);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Closed segments get a summary as they are closed; a restart with a budget folds the
/// older ones from it (their records unread) to the same log, the same disk part and the
/// same reads as a restart that reads every record, and gives summaries to segments that
/// had none. A record damaged in a segment folded from its summary is found when it is
/// read back (an error that says so, and the summary removed), and the restart after that
/// reads the segment whole and sets the log aside as damaged.
#[test]
fn a_restart_folds_closed_segments_from_their_summaries_to_the_same_log() {
    use felix_proto::cluster::meta::{HardState, Snapshot};
    let (dir, shard, mut logs) = ledger_logs("summary", 3000);
    let mut term = 1;
    for index in 1..=400u64 {
        // A new leader now and then overwrites the uncommitted tail.
        if index % 97 == 0 {
            term += 1;
            let from = index - 5;
            let es: Vec<Entry> = (from..index).map(|i| entry(i, term)).collect();
            logs.persist(&shard, &es, None).unwrap();
        }
        let hs = HardState { term, vote: 2, commit: index.saturating_sub(20), ..HardState::default() };
        logs.persist(&shard, &[entry(index, term)], Some(&hs)).unwrap();
        if index == 150 {
            let mut snap = Snapshot::default();
            snap.mut_metadata().index = 60;
            snap.mut_metadata().term = 1;
            snap.set_data(b"state".to_vec().into());
            logs.persist_snapshot(&shard, &snap, None).unwrap();
        }
    }
    drop(logs);
    let files = dir.join("cluster").join("replicas");
    let summary_files = || {
        std::fs::read_dir(&files)
            .unwrap()
            .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().ends_with(".sum"))
            .count()
    };
    let written = summary_files();
    assert!(written > 5, "summaries written as segments closed: {written}");
    let fast = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
    assert!(fast.damaged.is_empty());
    assert!(fast.summarised > 5, "{} folded from summaries", fast.summarised);
    let kept_fast = fast.kept.get(&shard).expect("kept").clone();
    // The same from every record (the summaries removed).
    for e in std::fs::read_dir(&files).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "sum") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let slow = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
    assert_eq!(slow.summarised, 0);
    assert_eq!(slow.kept.get(&shard), Some(&kept_fast), "the same log, disk part and all");
    assert_eq!(slow.logs.shards[&shard].points, fast.logs.shards[&shard].points, "the same index");
    let spill = kept_fast.spill.as_ref().expect("a disk part");
    for low in [spill.first(), spill.first() + 7, spill.end() - 3] {
        let a = fast.logs.read_job(&shard, low, spill.end(), 1500).unwrap().run().unwrap();
        let b = slow.logs.read_job(&shard, low, spill.end(), 1500).unwrap().run().unwrap();
        assert!(!a.is_empty() && a == b, "reads from {low}");
    }
    // That restart gave the segments their summaries back.
    assert_eq!(summary_files(), written);
    drop((fast, slow));
    // A bit flipped in the middle of an old segment's record (the second oldest: the
    // oldest holds the snapshot's entry, so it is read whole).
    let mut segs: Vec<_> = std::fs::read_dir(&files)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "log"))
        .collect();
    segs.sort();
    let first = segs[1].clone();
    let mut bytes = std::fs::read(&first).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0x10;
    std::fs::write(&first, &bytes).unwrap();
    let opened = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
    assert!(opened.damaged.is_empty(), "not read at the restart");
    let sp = opened.kept[&shard].spill.clone().expect("a disk part");
    let mut found = None;
    let mut next = sp.first();
    while next < sp.end() && found.is_none() {
        match opened.logs.read_job(&shard, next, sp.end(), 1500).unwrap().run() {
            Ok(got) => next = got.last().map_or(sp.end(), |e| e.index + 1),
            Err(e) => found = Some(e),
        }
    }
    let e = found.expect("the damaged record found when read");
    assert!(e.contains(DAMAGED_RECORD), "{e}");
    drop(opened);
    let again = ReplicaLogs::open(Some(&dir), None, Some(2000)).unwrap();
    assert!(again.damaged.contains_key(&shard), "set aside at the next restart");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_replica_log_rolls_segments_and_a_snapshot_deletes_the_ones_it_covers() {
    use felix_proto::cluster::meta::{Entry, HardState, Snapshot};
    let dir = std::env::temp_dir().join(format!("felix-replica-segments-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shard =
        ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "ledger".into(), shard: 0 };
    let OpenedReplicaLogs { mut logs, kept, .. } =
        ReplicaLogs::open(Some(&dir), Some(std::time::Duration::from_secs(1)), None).unwrap();
    assert!(kept.is_empty());
    logs.segment_bytes = 1000;
    let mut expect = felix_proto::cluster::meta::RaftLog::default();
    for index in 1..=100u64 {
        let e = vec![Entry { index, term: 1, data: vec![7; 50].into(), ..Entry::default() }];
        let hs = HardState { term: 1, commit: index, ..HardState::default() };
        logs.persist(&shard, &e, Some(&hs)).unwrap();
        expect.persist(&e, Some(&hs));
    }
    let before = logs.segments(&shard);
    assert!(before.len() > 5, "rolled: {before:?}");
    let mut snap = Snapshot::default();
    snap.mut_metadata().index = 80;
    snap.mut_metadata().term = 1;
    snap.set_data(b"state".to_vec().into());
    logs.persist_snapshot(&shard, &snap, None).unwrap();
    expect.persist_snapshot(&snap);
    let after = logs.segments(&shard);
    assert!(after.len() < before.len() / 2, "deleted: {before:?} -> {after:?}");
    let files = std::fs::read_dir(dir.join("cluster").join("replicas"))
        .unwrap()
        .filter(|e| e.as_ref().unwrap().path().extension().is_some_and(|x| x == "log"))
        .count();
    assert_eq!(files, after.len());
    // Written on after the snapshot, then read back: the same log.
    let e = vec![Entry { index: 101, term: 1, data: vec![8; 50].into(), ..Entry::default() }];
    logs.persist(&shard, &e, None).unwrap();
    expect.persist(&e, None);
    drop(logs);
    let kept = ReplicaLogs::open(Some(&dir), None, None).unwrap().kept;
    assert_eq!(kept.get(&shard), Some(&expect));
    let _ = std::fs::remove_dir_all(&dir);
}

/// A host's part of a snapshot kept apart (a stream's commit state) is encoded as it is
/// written: the record on disk is byte for byte the one of the whole data, reads back as
/// that snapshot (whole at a restart's fold, and in pieces for a follower), and a part that
/// gives other than the length it declared fails the write rather than leaving a record
/// that lies.
#[test]
fn a_snapshot_whose_host_part_is_written_piece_by_piece_reads_back_whole_and_in_pieces() {
    use felix_proto::cluster::meta::{Entry, HardState, Snapshot};
    use felix_proto::cluster::replica::{HostPart, SnapshotRest};
    #[derive(Debug)]
    struct Part(Vec<u8>, usize);
    impl HostPart for Part {
        fn encode_into(&self, out: &mut Vec<u8>) {
            out.extend_from_slice(&self.0);
        }
        fn encoded_len(&self) -> usize {
            self.1
        }
        fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
            // Small pieces and one past the write buffer's quarter, in order.
            let (a, b) = self.0.split_at(self.0.len() / 2);
            for piece in a.chunks(7) {
                each(piece);
            }
            each(b);
        }
    }
    let dir = std::env::temp_dir().join(format!("felix-replica-snapshot-rest-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shard = ShardId { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "s".into(), shard: 0 };
    let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
    for index in 1..=30 {
        let e = vec![Entry { index, term: 2, data: vec![7; 50].into(), ..Entry::default() }];
        logs.persist(&shard, &e, Some(&HardState { term: 2, commit: index, ..HardState::default() })).unwrap();
    }
    let mut head = Snapshot::default();
    head.mut_metadata().index = 20;
    head.mut_metadata().term = 2;
    // A replica's own state (version 1, next offset 9, no producers), the host's after it.
    let own = [&[1u8][..], &9u64.to_be_bytes(), &0u32.to_be_bytes()].concat();
    head.set_data(own.clone().into());
    let part: Vec<u8> = (0..(1 << 20) + 333).map(|i| (i % 241) as u8).collect();
    let rest = SnapshotRest::new(std::sync::Arc::new(Part(part.clone(), part.len())));
    logs.persist_snapshot(&shard, &head, Some(&rest)).unwrap();
    let mut whole = head.clone();
    rest.append_to(&mut whole);
    let mut data = Vec::new();
    while data.len() < whole.data.len() {
        let job = logs.snapshot_piece_job(&shard, 20, data.len() as u64, 300_000, data.is_empty()).unwrap();
        data.extend_from_slice(&job.run().unwrap().data);
    }
    assert_eq!(data, whole.data, "read back in pieces, the CRC checked");
    drop(logs);
    let opened = ReplicaLogs::open(Some(&dir), None, None).unwrap();
    assert_eq!(opened.kept[&shard].snapshot, Some(whole.clone()), "folded at a restart");
    drop(opened);
    // As `serve` opens it (with an entry budget): the host's state, 1 MiB or more, left on
    // disk for the replica to read back in pieces; the data kept, the group's own state.
    let opened = ReplicaLogs::open(Some(&dir), None, Some(1 << 20)).unwrap();
    let kept = &opened.kept[&shard];
    let want = felix_proto::cluster::meta::RestOnDisk { len: part.len() as u64, holds_commits: false };
    assert_eq!(kept.snapshot_rest_on_disk, Some(want));
    let mut cut = whole.clone();
    cut.set_data(own.clone().into());
    assert_eq!(kept.snapshot, Some(cut), "the group's own state alone");
    let job = opened.logs.snapshot_piece_job(&shard, 20, own.len() as u64, 4096, true).unwrap();
    assert_eq!(job.run().unwrap().data[..], part[..4096], "read back from where it stayed");
    // A part that says one length and gives another.
    let mut logs = opened.logs;
    let lying = SnapshotRest::new(std::sync::Arc::new(Part(part.clone(), part.len() + 1)));
    let mut next = head.clone();
    next.mut_metadata().index = 25;
    let e = logs.persist_snapshot(&shard, &next, Some(&lying)).unwrap_err();
    assert!(e.to_string().contains("declared"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A replica keeps its last snapshot in its log files only: the piece jobs find the last
/// snapshot record where it was written, and at a restart where the fold saw it (in the
/// last segment, read whole; in a closed one, from its summary), and read its data a piece
/// at a time; the first piece of a send checks the whole record's CRC.
#[test]
fn the_last_snapshot_is_read_back_in_pieces_from_where_it_was_written_and_after_a_restart() {
    use felix_proto::cluster::meta::{Entry, HardState, Snapshot};
    let dir = std::env::temp_dir().join(format!("felix-replica-snapshot-read-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shard = ShardId { kind: Kind::Cache, tenant: "t".into(), namespace: "ns".into(), name: "c".into(), shard: 0 };
    let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
    logs.segment_bytes = 1000;
    assert!(logs.snapshot_piece_job(&shard, 20, 0, 1000, true).is_none(), "nothing kept");
    // The data, as a send reads it: in pieces of 1,000 bytes, the first one checked.
    let read = |logs: &ReplicaLogs, index: u64| -> Result<Snapshot, String> {
        let mut data = Vec::new();
        loop {
            let job = logs.snapshot_piece_job(&shard, index, data.len() as u64, 1000, data.is_empty()).unwrap();
            let piece = job.run()?;
            data.extend_from_slice(&piece.data);
            if data.len() as u64 == piece.total {
                let mut s = Snapshot::default();
                s.mut_metadata().index = index;
                s.mut_metadata().term = 2;
                s.set_data(data.into());
                return Ok(s);
            }
        }
    };
    let write = |logs: &mut ReplicaLogs, from: u64, to: u64| {
        for index in from..=to {
            let e = vec![Entry { index, term: 2, data: vec![7; 50].into(), ..Entry::default() }];
            logs.persist(&shard, &e, Some(&HardState { term: 2, commit: index, ..HardState::default() })).unwrap();
        }
    };
    let snapshot = |index: u64, fill: u8| {
        let mut s = Snapshot::default();
        s.mut_metadata().index = index;
        s.mut_metadata().term = 2;
        s.set_data(vec![fill; 3000].into());
        s
    };
    write(&mut logs, 1, 30);
    logs.persist_snapshot(&shard, &snapshot(20, 1), None).unwrap();
    assert_eq!(read(&logs, 20), Ok(snapshot(20, 1)));
    write(&mut logs, 31, 32);
    logs.persist_snapshot(&shard, &snapshot(30, 2), None).unwrap();
    assert_eq!(read(&logs, 30), Ok(snapshot(30, 2)), "the newest");
    let e = read(&logs, 20).unwrap_err();
    assert!(e.contains("the snapshot kept is at index 30, not 20"), "{e}");
    drop(logs);
    // Restarted with the snapshot in the last segment (read whole).
    let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
    logs.segment_bytes = 1000;
    assert_eq!(read(&logs, 30), Ok(snapshot(30, 2)));
    // Written on until its segment is closed (with a summary), then restarted.
    write(&mut logs, 33, 80);
    assert!(logs.segments(&shard).len() > 3);
    drop(logs);
    let logs = ReplicaLogs::open(Some(&dir), None, Some(1 << 20)).unwrap();
    assert!(logs.summarised > 0, "closed segments folded from their summaries");
    assert_eq!(read(&logs.logs, 30), Ok(snapshot(30, 2)));
    assert_eq!(logs.kept[&shard].snapshot, Some(snapshot(30, 2)), "the one the fold kept");
    // A record that no longer reads (a bit flipped on disk) is an error, not a snapshot.
    let (seq, pos, _) = logs.logs.shards[&shard].snapshot.unwrap();
    assert_ne!(Some(seq), logs.logs.segments(&shard).last().copied(), "found in a closed segment's summary");
    let path = dir.join("cluster").join("replicas").join(replica_file_name(&shard, seq));
    let mut bytes = std::fs::read(&path).unwrap();
    bytes[pos as usize + 100] ^= 1;
    std::fs::write(&path, &bytes).unwrap();
    let e = read(&logs.logs, 30).unwrap_err();
    assert!(e.contains("not an intact snapshot record"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_damaged_replica_log_is_set_aside_and_said_while_a_torn_one_is_cut_and_kept() {
    use felix_proto::cluster::meta::{Entry, HardState};
    let dir = std::env::temp_dir().join(format!("felix-replica-damaged-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let shard = |name: &str| ShardId {
        kind: Kind::Stream,
        tenant: "t".into(),
        namespace: "ns".into(),
        name: name.into(),
        shard: 0,
    };
    let (damaged, torn) = (shard("damaged"), shard("torn"));
    let mut logs = ReplicaLogs::open(Some(&dir), None, None).unwrap().logs;
    for index in 1..=10u64 {
        let e = vec![Entry { index, term: 1, data: vec![7; 50].into(), ..Entry::default() }];
        let hs = HardState { term: 1, vote: 2, commit: index, ..HardState::default() };
        logs.persist(&damaged, &e, Some(&hs)).unwrap();
        logs.persist(&torn, &e, Some(&hs)).unwrap();
    }
    drop(logs);
    let replicas = dir.join("cluster").join("replicas");
    let path = |s: &ShardId| replicas.join(replica_file_name(s, 0));
    // One bit flipped in the middle of one log; the other's last record half written.
    let mut bytes = std::fs::read(path(&damaged)).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x04;
    std::fs::write(path(&damaged), &bytes).unwrap();
    let whole = std::fs::metadata(path(&torn)).unwrap().len();
    let mut f = std::fs::OpenOptions::new().append(true).open(path(&torn)).unwrap();
    std::io::Write::write_all(&mut f, &felix_proto::cluster::meta::encode_log_record(&[], None)[..7]).unwrap();
    drop(f);
    let opened = ReplicaLogs::open(Some(&dir), None, None).unwrap();
    // The torn one is cut back to its whole records and kept.
    assert_eq!(opened.kept.get(&torn).map(|l| l.entries.len()), Some(10));
    assert_eq!(std::fs::metadata(path(&torn)).unwrap().len(), whole);
    // The damaged one is neither kept nor left where it would be read again: it is in
    // `damaged/`, byte for byte, and said with its file and why.
    assert!(!opened.kept.contains_key(&damaged));
    let why = &opened.damaged[&damaged];
    assert!(why.contains(&replica_file_name(&damaged, 0)) && why.contains(", byte "), "{why}");
    assert!(!path(&damaged).exists());
    let aside: Vec<_> = std::fs::read_dir(replicas.join("damaged")).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(aside.len(), 1);
    assert_eq!(std::fs::read(&aside[0]).unwrap(), bytes);
    // Its replica starts a fresh log; the next open reads that, and leaves `damaged/` alone.
    let mut logs = opened.logs;
    let e = vec![Entry { index: 1, term: 3, data: vec![1].into(), ..Entry::default() }];
    logs.persist(&damaged, &e, Some(&HardState { term: 3, commit: 1, ..HardState::default() })).unwrap();
    drop(logs);
    let again = ReplicaLogs::open(Some(&dir), None, None).unwrap();
    assert!(again.damaged.is_empty());
    assert_eq!(again.kept.get(&damaged).map(|l| l.hard_state.term), Some(3));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn replica_file_names_round_trip_and_strangers_are_refused() {
    let s = ShardId {
        kind: Kind::Stream,
        tenant: "t.1".into(),
        namespace: "ns/x".into(),
        name: "or ders".into(),
        shard: 7,
    };
    assert_eq!(parse_replica_file_name(&replica_file_name(&s, 0)), Some((s.clone(), 0)));
    assert_eq!(parse_replica_file_name(&replica_file_name(&s, 12)), Some((s, 12)));
    for bad in ["x.log", "stream~a~b~c~d.log", "queue~a~b~c~1.log", "stream~a~b~c~1", "stream~a~b~c~1~2.log", ""] {
        assert_eq!(parse_replica_file_name(bad), None, "{bad}");
    }
}
