use super::*;

/// A kept log's voters start from its snapshot's configuration: the changes after it are
/// changes to that group. Read from nothing, a replica that joined by a snapshot and was
/// then re-added (a move given up and undone) restarted as its group's only voter, elected
/// itself alone and committed an entry the group never had (world simulation, seed 473).
#[test]
fn a_kept_logs_voters_start_from_its_snapshots_configuration() {
    use protobuf::Message as _;
    let change = |index: u64, add: bool, id: u64| {
        let mut cc = ConfChange::default();
        cc.set_change_type(if add { ConfChangeType::AddNode } else { ConfChangeType::RemoveNode });
        cc.set_node_id(id);
        let mut e = Entry { index, term: 4, ..Entry::default() };
        e.set_entry_type(EntryType::EntryConfChange);
        e.data = cc.write_to_bytes().unwrap().into();
        e
    };
    let mut snapshot = Snapshot::default();
    snapshot.mut_metadata().index = 10;
    snapshot.mut_metadata().term = 3;
    snapshot.mut_metadata().set_conf_state(ConfState::from((vec![1, 2, 3], vec![])));
    let mut log = RaftLog { snapshot: Some(snapshot), ..RaftLog::default() };
    log.hard_state.commit = 12;
    assert_eq!(log.voters(), Some(vec![1, 2, 3]), "the snapshot's alone");
    log.entries = vec![change(11, false, 3), change(12, true, 3)];
    assert_eq!(log.voters(), Some(vec![1, 2, 3]), "3 removed, then added back");
    log.entries.push(change(13, true, 4));
    assert_eq!(log.voters(), Some(vec![1, 2, 3]), "an uncommitted change counts for nothing");
    log.hard_state.commit = 13;
    assert_eq!(log.voters(), Some(vec![1, 2, 3, 4]));
    // A founding log (no snapshot): its own changes from the first entry.
    let founding = RaftLog::founding(&[(5, Vec::new()), (6, Vec::new())]);
    assert_eq!(founding.voters(), Some(vec![5, 6]));
}

/// `persist` appends, and a write from an index already held replaces the log from there
/// (a new leader overwrote an unconfirmed tail), wherever in the log it lands; folding a
/// long log one entry at a time keeps every entry once, in order.
#[test]
fn persist_appends_and_overwrites_a_tail_at_the_right_place() {
    let entry = |index: u64, term: u64| Entry { index, term, ..Entry::default() };
    let mut log = RaftLog::default();
    for i in 1..=200_000u64 {
        log.persist(&[entry(i, 1)], None);
    }
    assert_eq!(log.entries.len(), 200_000);
    log.persist(&[entry(199_998, 2), entry(199_999, 2)], None);
    let tail: Vec<(u64, u64)> = log.entries[199_995..].iter().map(|e| (e.index, e.term)).collect();
    assert_eq!(tail, vec![(199_996, 1), (199_997, 1), (199_998, 2), (199_999, 2)]);
    log.persist(&[entry(3, 3)], None);
    assert_eq!(log.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(), vec![(1, 1), (2, 1), (3, 3)]);
    log.persist(&[entry(4, 3)], None);
    assert_eq!(log.entries.len(), 4);
}

#[test]
fn an_append_only_log_folds_back_and_stops_at_a_torn_record() {
    let e = |index: u64, term: u64, data: &[u8]| Entry { index, term, data: data.to_vec().into(), ..Entry::default() };
    let hs = |term: u64, commit: u64| HardState { term, vote: 1, commit, ..HardState::default() };
    let mut file = Vec::new();
    file.extend(encode_log_record(&[e(1, 1, b"a"), e(2, 1, b"b"), e(3, 1, b"c")], Some(&hs(1, 1))));
    // A new leader overwrote the tail from index 3; no hard state change in this one.
    file.extend(encode_log_record(&[e(3, 2, b"x")], None));
    file.extend(encode_log_record(&[], Some(&hs(2, 3))));
    let whole = file.len();
    let (log, len) = fold_log_records(&file);
    assert_eq!(len, whole);
    assert_eq!(log.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(), vec![(1, 1), (2, 1), (3, 2)]);
    assert_eq!(log.hard_state, hs(2, 3));
    // Torn anywhere in the last record: the records before it stand.
    let last = encode_log_record(&[e(4, 2, b"y")], None);
    for cut in 0..last.len() {
        let mut torn = file.clone();
        torn.extend_from_slice(&last[..cut]);
        let (l, n) = fold_log_records(&torn);
        assert_eq!((l.entries.len(), n), (3, whole), "cut at {cut}");
    }
    // A damaged byte inside a record ends the file there, and is said to be damage.
    let mut bad = file.clone();
    bad[whole - 3] ^= 0x10;
    assert!(fold_log_records(&bad).1 < whole);
    assert_eq!(fold_log_segments_checked(&[&bad]).2.map(|d| d.kind), Some(DamageKind::Checksum));
    // A record that would leave a gap is refused.
    let mut gap = file.clone();
    gap.extend(encode_log_record(&[e(9, 2, b"z")], None));
    assert_eq!(fold_log_records(&gap).1, whole);
    assert_eq!(fold_log_segments_checked(&[&gap]).2.map(|d| d.kind), Some(DamageKind::Gap));
    assert_eq!(fold_log_records(&[0xFF; 7]).1, 0);
}

/// Three records as a replica writes them: entries with a hard state, entries without,
/// entries with a newer hard state (a vote in term 2).
fn three_records() -> (Vec<u8>, [usize; 3]) {
    let hs = |term, commit| HardState { term, vote: 2, commit, ..HardState::default() };
    let mut file = encode_log_record(&entries(1..=3, 1), Some(&hs(1, 1)));
    let a = file.len();
    file.extend(encode_log_record(&entries(4..=5, 1), None));
    let b = file.len();
    file.extend(encode_log_record(&entries(6..=6, 2), Some(&hs(2, 5))));
    (file.clone(), [a, b, file.len()])
}

#[test]
fn every_single_bit_flip_in_a_replica_log_is_found_as_damage_never_taken_for_a_torn_tail() {
    let (file, _) = three_records();
    assert_eq!(fold_log_segments_checked(&[&file]).2, None);
    for at in 0..file.len() {
        for bit in 0..8 {
            let mut bad = file.clone();
            bad[at] ^= 1 << bit;
            let (_, _, damage) = fold_log_segments_checked(&[&bad]);
            assert!(damage.is_some(), "a flip of bit {bit} of byte {at} passed as intact or torn");
        }
    }
}

#[test]
fn a_tail_torn_anywhere_is_cut_without_damage_and_what_came_before_stands() {
    let (file, [a, b, end]) = three_records();
    for cut in 0..end {
        let (log, infos, damage) = fold_log_segments_checked(&[&file[..cut]]);
        assert_eq!(damage, None, "cut at {cut}");
        let kept = if cut >= b {
            b
        } else if cut >= a {
            a
        } else {
            0
        };
        assert_eq!(infos[0].whole, kept, "cut at {cut}");
        assert_eq!(log.entries.len(), [0, 3, 5][[0, a, b].iter().position(|k| *k == kept).unwrap()]);
    }
    // Zeros after the last record (space the filesystem gave but the write never filled)
    // are a torn tail too.
    let mut zeros = file.clone();
    zeros.extend_from_slice(&[0; 100]);
    let (log, infos, damage) = fold_log_segments_checked(&[&zeros]);
    assert_eq!((damage, infos[0].whole, log.hard_state.term), (None, end, 2));
}

/// The shared fold gives the same log, index and verdict as the copying one, and its
/// entries' data lie in the segment buffers (nothing copied), damage included.
#[test]
fn a_shared_fold_gives_the_same_log_with_entries_in_the_segment_buffers() {
    let (file, [a, ..]) = three_records();
    let hs = HardState { term: 2, vote: 2, commit: 6, ..HardState::default() };
    let next = encode_log_record(&entries(7..=8, 2), Some(&hs));
    let segments = [bytes::Bytes::from(file.clone()), bytes::Bytes::from(next.clone())];
    let (log, infos, damage, _) = fold_log_segments_shared(&segments);
    let (copied, copied_infos, copied_damage, _) = fold_log_segments_indexed(&[&file, &next]);
    assert_eq!((&log, &infos, &damage), (&copied, &copied_infos, &copied_damage));
    assert_eq!(log.entries.len(), 8);
    let within = |e: &Entry| {
        segments.iter().any(|s| {
            let (p, d) = (s.as_ptr() as usize, e.data.as_ptr() as usize);
            !e.data.is_empty() && d >= p && d + e.data.len() <= p + s.len()
        })
    };
    assert!(log.entries.iter().filter(|e| !e.data.is_empty()).all(within), "entries share the buffers");
    // A flipped bit is damage the same way.
    let mut bad = file.clone();
    bad[a / 2] ^= 1;
    let (_, _, d, _) = fold_log_segments_shared(&[bytes::Bytes::from(bad.clone())]);
    assert_eq!(d, fold_log_segments_checked(&[&bad]).2);
    assert!(d.is_some());
}

/// A restart's fold keeps the configuration changes among the entries it leaves on disk, and
/// the segment's summary keeps them too, for as long as they matter: copies, not slices of the
/// segment buffer, which they would otherwise keep alive whole (up to 64 MiB) for ever.
#[test]
fn configuration_changes_kept_from_a_shared_fold_do_not_keep_its_buffer() {
    let mut es = entries(1..=6, 1);
    for e in &mut es[..3] {
        e.set_entry_type(raft::eraftpb::EntryType::EntryConfChange);
        e.data = vec![9; 40].into();
    }
    let hs = HardState { term: 1, vote: 1, commit: 6, ..HardState::default() };
    let buffer = bytes::Bytes::from(encode_log_record(&es, Some(&hs)));
    let mut fold = LogFold::new(0, Some(0));
    assert!(fold.feed(&buffer, Some(&buffer), true));
    let builders = fold.take_builders();
    let (log, _, damage, _) = fold.finish();
    assert_eq!(damage, None);
    let spill = log.spill.as_ref().expect("committed entries left on disk");
    assert_eq!(spill.conf.len(), 3);
    let inside = |e: &Entry| {
        let (p, d) = (buffer.as_ptr() as usize, e.data.as_ptr() as usize);
        d >= p && d < p + buffer.len()
    };
    assert!(spill.conf.iter().all(|e| e.data.len() == 40 && !inside(e)), "the spill's copies");
    let summary = builders.into_iter().next().flatten().and_then(|b| b.finish()).expect("a summary");
    let conf = summary.conf_entries();
    assert_eq!(conf.len(), 3);
    assert!(conf.iter().all(|e| e.data.len() == 40 && !inside(e)), "the summary's copies");
}

#[test]
fn damage_in_a_closed_segment_or_a_commit_past_the_entries_kept_is_found() {
    let (file, [a, ..]) = three_records();
    let hs = HardState { term: 2, vote: 2, commit: 6, ..HardState::default() };
    let next = encode_log_record(&entries(7..=8, 2), Some(&hs));
    // The first segment cut short (its tail lost) while the next one goes on.
    let (_, _, damage) = fold_log_segments_checked(&[&file[..a + 5], &next]);
    assert_eq!(damage.map(|d| (d.segment, d.offset, d.kind)), Some((0, a, DamageKind::ClosedSegmentShort)));
    // Whole, but the next segment's entries do not follow the first's.
    let (_, _, damage) = fold_log_segments_checked(&[&file[..a], &next]);
    assert_eq!(damage.map(|d| (d.segment, d.kind)), Some((1, DamageKind::Gap)));
    // A record framing break in the middle with whole records after it.
    let mut broken = file.clone();
    broken[a..a + 4].copy_from_slice(&u32::MAX.to_be_bytes());
    let (log, _, damage) = fold_log_segments_checked(&[&broken]);
    assert_eq!(damage.map(|d| d.kind), Some(DamageKind::RecordsAfterBreak));
    assert_eq!(log.entries.len(), 3, "what came before the damage is what the fold returns");
    // A hard state that says more was committed than the entries left.
    let mut past = encode_log_record(&entries(1..=2, 1), None);
    past.extend(encode_log_record(&[], Some(&HardState { term: 1, commit: 4, ..HardState::default() })));
    assert_eq!(fold_log_segments_checked(&[&past]).2.map(|d| d.kind), Some(DamageKind::CommitPastEntries));
    // Every kind of damage says where it is.
    let d = LogDamage { segment: 1, offset: 40, kind: DamageKind::Length };
    assert_eq!(d.to_string(), "segment 1, byte 40: a record's length field is damaged");
}

fn entries(range: std::ops::RangeInclusive<u64>, term: u64) -> Vec<Entry> {
    range.map(|index| Entry { index, term, data: vec![index as u8].into(), ..Entry::default() }).collect()
}

fn snapshot_at(index: u64, term: u64) -> Snapshot {
    let mut s = Snapshot::default();
    s.mut_metadata().index = index;
    s.mut_metadata().term = term;
    s.set_data(b"state".to_vec().into());
    s
}

#[test]
fn a_record_encoded_into_a_reused_buffer_is_the_same_bytes() {
    let hs = HardState { term: 3, commit: 2, ..HardState::default() };
    let mut buf = b"left over".to_vec();
    buf.clear();
    encode_log_record_into(&mut buf, &entries(1..=3, 1), Some(&hs));
    assert_eq!(buf, encode_log_record(&entries(1..=3, 1), Some(&hs)));
    let mut two = encode_log_record(&entries(1..=2, 1), None);
    let first = two.len();
    encode_log_record_into(&mut two, &entries(3..=3, 1), Some(&hs));
    assert_eq!(&two[first..], &encode_log_record(&entries(3..=3, 1), Some(&hs))[..]);
}

#[test]
fn segments_fold_from_the_last_snapshot_even_with_older_segments_deleted() {
    let hs = |commit| HardState { term: 1, commit, ..HardState::default() };
    let mut a = encode_log_record(&entries(1..=10, 1), Some(&hs(10)));
    a.extend_from_slice(&encode_log_record(&entries(11..=12, 1), None));
    let mut b = encode_log_record(&[], Some(&hs(12)));
    b.extend_from_slice(&encode_log_record(&entries(13..=20, 1), Some(&hs(20))));
    b.extend_from_slice(&encode_snapshot_record(&snapshot_at(15, 1)));
    b.extend_from_slice(&encode_log_record(&entries(21..=22, 1), Some(&hs(22))));
    // Both segments: the snapshot stands for 1..=15, entries 16..=22 follow.
    let (log, infos) = fold_log_segments(&[&a, &b]);
    assert_eq!(log.snapshot.as_ref().map(|s| s.get_metadata().index), Some(15));
    assert_eq!(log.entries.iter().map(|e| e.index).collect::<Vec<_>>(), (16..=22).collect::<Vec<_>>());
    assert_eq!(log.hard_state.commit, 22);
    assert_eq!(infos.iter().map(|i| i.max_index).collect::<Vec<_>>(), vec![12, 22]);
    assert_eq!(infos[1].whole, b.len());
    // The first segment deleted (all its entries are below the snapshot): the same log.
    let (alone, _) = fold_log_segments(&[&b]);
    assert_eq!(alone, log);
    // A snapshot from the leader that does not match the log replaces it whole.
    let mut c = encode_log_record(&entries(1..=10, 1), Some(&hs(5)));
    c.extend_from_slice(&encode_snapshot_record(&snapshot_at(8, 2)));
    c.extend_from_slice(&encode_log_record(&entries(9..=9, 2), None));
    let (log, _) = fold_log_records(&c);
    assert_eq!(log.entries.iter().map(|e| (e.index, e.term)).collect::<Vec<_>>(), vec![(9, 2)]);
    assert_eq!((log.hard_state.commit, log.hard_state.term), (8, 2));
    // A torn snapshot record ends the file there.
    let cut = c.len() - encode_log_record(&entries(9..=9, 2), None).len() - 3;
    let (log, whole) = fold_log_records(&c[..cut]);
    assert!(log.snapshot.is_none() && whole < cut);
}

/// A snapshot record written in pieces is the record the generated protobuf code writes, byte
/// for byte, whatever the data's size (one- and multi-byte lengths, none) and with or without
/// metadata; its index reads from the metadata alone; and read back from the buffer it lies
/// in, its data shares that buffer.
#[test]
fn a_snapshot_record_in_pieces_is_the_generated_record_and_reads_back_uncopied() {
    use protobuf::Message as _;
    fn generated(snapshot: &Snapshot) -> Vec<u8> {
        let mut out = vec![0; 4];
        out.push(2);
        out.extend_from_slice(b"FLXS");
        out.extend_from_slice(&[0; 4]);
        snapshot.write_to_vec(&mut out).expect("encodes");
        let n = (out.len() - 13) as u32;
        out[9..13].copy_from_slice(&n.to_be_bytes());
        let crc = crate::storage::crc32c(&out[5..]);
        out.extend_from_slice(&crc.to_be_bytes());
        let len = (out.len() - 4) as u32;
        out[..4].copy_from_slice(&len.to_be_bytes());
        out
    }
    for size in [0usize, 1, 127, 128, 300, 16_384, 70_000] {
        for with_metadata in [true, false] {
            let mut s = if with_metadata { snapshot_at(9 + size as u64, 3) } else { Snapshot::default() };
            s.set_data((0..size).map(|i| i as u8).collect::<Vec<u8>>().into());
            let r = SnapshotRecord::new(&s);
            let whole: Vec<u8> = r.pieces().concat();
            assert_eq!(whole, generated(&s), "size {size}, metadata {with_metadata}");
            assert_eq!(r.len(), whole.len());
            assert_eq!(encode_snapshot_record(&s), whole);
            let index = if with_metadata { 9 + size as u64 } else { 0 };
            assert_eq!(snapshot_record_index(&whole[5..]), Some(index));
            let buffer = bytes::Bytes::from(whole);
            let body = &buffer[4..];
            let back = match decode_body_in(body, Some(&buffer)) {
                Ok(Ok(snap)) => snap,
                other => panic!("size {size}: {other:?}"),
            };
            assert_eq!(back, s);
            if size > 0 {
                let at = (back.data.as_ptr() as usize).checked_sub(buffer.as_ptr() as usize);
                assert!(at.is_some_and(|at| at + size <= buffer.len()), "the data shares the buffer it was read from");
            }
            // Read back alone, as a driver reads the last one for a follower behind: the same
            // snapshot, its data in the record's buffer.
            let alone = decode_snapshot_record_alone(&buffer).expect("reads alone");
            assert_eq!(alone, s);
            if size > 0 {
                let at = (alone.data.as_ptr() as usize).checked_sub(buffer.as_ptr() as usize);
                assert!(at.is_some_and(|at| at + size <= buffer.len()), "read alone, uncopied");
            }
            // Cut, or with bytes after it, it is not a record read alone.
            assert_eq!(decode_snapshot_record_alone(&buffer.slice(..buffer.len() - 1)), None);
            let mut longer = buffer.to_vec();
            longer.push(0);
            assert_eq!(decode_snapshot_record_alone(&bytes::Bytes::from(longer)), None);
            // Damage anywhere is no index (and no snapshot).
            let mut bad = buffer.to_vec();
            let last = bad.len() - 1;
            bad[last] ^= 1;
            assert_eq!(snapshot_record_index(&bad[5..]), None);
            assert_eq!(decode_snapshot_record_alone(&bytes::Bytes::from(bad)), None);
        }
    }
}

/// A snapshot's index read alone agrees with the snapshot parsed whole on protobufs the
/// encoder never writes but a file could hold under a valid CRC: unknown fields of every wire
/// type, a known field of the wrong wire type, a repeated metadata field (the last one wins).
#[test]
fn a_snapshots_index_read_alone_agrees_with_the_whole_parse_on_odd_protobufs() {
    use protobuf::Message as _;
    let meta = |index: u64| {
        let mut m = raft::eraftpb::SnapshotMetadata::new();
        m.index = index;
        m.term = 2;
        m.write_to_bytes().expect("encodes")
    };
    let field = |key: u8, payload: &[u8]| {
        let mut f = vec![key, payload.len() as u8];
        f.extend_from_slice(payload);
        f
    };
    let bodies: Vec<Vec<u8>> = vec![
        [field(0x0a, b"data"), field(0x12, &meta(7))].concat(),
        [field(0x12, &meta(7)), field(0x12, &meta(9))].concat(),
        [field(0x0a, b"da"), field(0x12, &meta(7)), field(0x0a, b"ta"), field(0x12, &meta(9))].concat(),
        [field(0x12, &meta(7)), vec![0x18, 0x05], field(0x0a, b"d")].concat(), // field 3, varint
        [vec![0x21], vec![0; 8], field(0x12, &meta(4))].concat(),              // field 4, 64-bit
        [vec![0x2d], vec![0; 4], field(0x12, &meta(4))].concat(),              // field 5, 32-bit
        [vec![0x08, 0x01], field(0x12, &meta(4))].concat(),                    // field 1 as a varint
        [field(0x12, &meta(4)), vec![0x10, 0x01]].concat(),                    // field 2 as a varint
        [field(0x12, &meta(4)), vec![0x0a, 0x09, 1]].concat(),                 // data cut short
        [vec![0x33, 0x34], field(0x12, &meta(4))].concat(),                    // an unclosed group
        vec![],
    ];
    for (i, proto) in bodies.iter().enumerate() {
        let mut body = b"FLXS".to_vec();
        body.extend_from_slice(&(proto.len() as u32).to_be_bytes());
        body.extend_from_slice(proto);
        let crc = crate::storage::crc32c(&body);
        body.extend_from_slice(&crc.to_be_bytes());
        let whole = decode_snapshot_record(&body, None).map(|s| s.get_metadata().index);
        assert_eq!(snapshot_record_index(&body), whole, "body {i}");
    }
}
