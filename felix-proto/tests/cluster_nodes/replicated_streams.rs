//! Replicated streams: fail-over with every acknowledged record, memory bounded by reads from
//! the log, snapshots in chunks, votes after a restart, disk faults, compaction.

use super::*;

/// Which of `others` leads `shard` (its replica's generation start committed).
pub(super) fn leading_among<'a>(c: &Cluster, others: &'a [String], shard: &ShardId) -> Option<&'a String> {
    use felix_proto::broker::ReplicaRole;
    others.iter().find(|n| c.nodes[*n].broker().replica_role(shard) == Some(&ReplicaRole::Leading))
}

pub(super) fn ledger() -> ShardId {
    ShardId { kind: Kind::Stream, tenant: "t1".into(), namespace: "default".into(), name: "ledger".into(), shard: 0 }
}

/// The broker whose replica of `shard` leads (its generation start committed).
pub(super) fn leader_of(c: &Cluster, shard: &ShardId) -> Option<String> {
    use felix_proto::broker::ReplicaRole;
    c.nodes.iter().find(|(_, n)| n.broker().replica_role(shard) == Some(&ReplicaRole::Leading)).map(|(k, _)| k.clone())
}

pub(super) fn leading(c: &Cluster) -> Option<String> {
    leader_of(c, &ledger())
}

/// Every payload a broker holds committed of the ledger, in offset order, and its
/// generation-start offsets.
pub(super) fn history(c: &Cluster, node: &str) -> (Vec<(u64, Bytes)>, Vec<u64>) {
    let (mut records, mut starts) = (Vec::new(), Vec::new());
    for (base, generation_start, payloads) in c.nodes[node].broker().committed_batches(&ledger(), 0) {
        if generation_start {
            starts.push(base);
        }
        for (i, p) in payloads.into_iter().enumerate() {
            records.push((base + i as u64, p));
        }
    }
    (records, starts)
}

#[test]
fn a_replicated_stream_fails_over_to_a_follower_with_every_acknowledged_record() {
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    c.until("a replica leads and the metadata names it", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let first = leading(&c).unwrap();
    assert_eq!(c.nodes[&first].metadata().replicas(&ledger()).map(<[String]>::len), Some(3));
    // Twenty acked records through the leader (offsets offered): each acknowledged once a
    // majority holds it, at the offset every replica gives it.
    let flags = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;
    let (conn, st) = c.client(&first, flags, 1);
    for k in 0..20u64 {
        c.send(&first, conn, st, publish_binary("ledger", &[&format!("a{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(&first, conn, st)));
    assert_eq!(a.len(), 20);
    assert!(a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
    // Nothing of it went to segment storage: the Raft log is the stream's log.
    assert!(c.stored.is_empty(), "{:?}", c.stored);
    c.settle();
    let (before, starts) = history(&c, &first);
    assert_eq!(before.len(), 20);
    assert_eq!(starts.len(), 1, "the first leader's generation start");
    for n in NAMES {
        assert_eq!(history(&c, n).0, before, "{n} holds the same history");
    }
    // The leader dies (keeping only what it persisted). A follower takes over: its own
    // generation start takes the next offset, and it serves once that committed.
    c.nodes.remove(&first);
    c.until("a follower leads", |c| leading(c).is_some());
    let second = leading(&c).unwrap();
    assert_ne!(second, first);
    let (conn, st) = c.client(&second, flags, 2);
    for k in 0..10u64 {
        c.send(&second, conn, st, publish_binary("ledger", &[&format!("b{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(&second, conn, st)));
    assert!(a.len() == 10 && a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
    let (after, starts) = history(&c, &second);
    assert_eq!(starts.len(), 2, "a second generation start: {starts:?}");
    assert_eq!(&after[..20], &before[..], "every record acknowledged before the fail-over, in order");
    assert_eq!(after.len(), 30);
    assert!(after.windows(2).all(|w| w[0].0 < w[1].0), "offsets only grow");
    // The old leader comes back from its kept logs and catches up to the same history.
    restart(&mut c, &first);
    c.until("the old leader caught up", |c| history(c, &first).0 == history(c, &second).0);
    // A subscriber on a follower is sent to the leader.
    let follower = NAMES.iter().find(|n| **n != second).unwrap();
    let (conn, st) = c.client(follower, 1, 3);
    let sub = json(&Message::Subscribe(message::Subscribe {
        tenant_id: "t1".into(),
        namespace: "default".into(),
        stream: "ledger".into(),
        subscription_id: None,
        start: Some(StartPosition::Earliest),
        shard: Some(0),
        queue_capacity: None,
        filter: None,
    }));
    c.send(follower, conn, st, sub);
    let ms = messages(&c.take(follower, conn, st));
    assert!(
        matches!(&ms[0], Message::Error(e) if e.message.contains(second.as_str()) || e.message.contains("owned by")),
        "{ms:?}"
    );
}

/// Three brokers that read back what they kept (as `serve` with a data directory), with 4 KiB
/// budgets for a stream's history and a replica's entries in memory, and the ledger; its
/// leader.
fn memory_bounded_ledger() -> (Cluster, String) {
    let mut c = Cluster::with(&NAMES, true);
    c.memory = Some((4096, 4096));
    let now = c.now;
    for name in NAMES {
        c.start(name, &RaftLog::default(), now);
    }
    create_ledger(&mut c);
    let leader = leading(&c).unwrap();
    (c, leader)
}

/// What a subscriber to the ledger from offset 0 on `node` is given (client `index`).
fn ledger_from_start(c: &mut Cluster, node: &str, index: u64) -> Vec<(u64, String)> {
    let (sc, ss) = c.client_with(node, MOVED_SUB_FLAGS, 0x1000, index);
    c.send(node, sc, ss, subscribe_shard_of("ledger", 0, 0));
    assert!(matches!(messages(&c.take(node, sc, ss))[0], Message::Subscribed(_)));
    c.settle();
    c.stream_events(node, sc).0
}

/// With history reads (a driver that reads back what it kept, as `serve` with a data
/// directory) a replicated shard holds only its newest batches and Raft entries in memory;
/// older ones are read back from the replica's kept log: by a subscriber from the start, and
/// by the leader for a follower that was cut off while they were written. Then the leader
/// dies, and the follower that caught up from read-back entries serves the same history.
/// Without the bound every record stays in memory (the first assertions fail).
#[test]
fn a_replicated_shard_keeps_only_its_newest_records_in_memory_and_reads_older_ones_back_from_its_log() {
    let (mut c, leader) = memory_bounded_ledger();
    let away = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    c.cut.insert(away.clone());
    // 300 acked records of 100 bytes, one batch each: about 30 KB of payload (and 150 KB
    // counting what each batch costs in memory), against budgets of 4 KiB.
    let pad = "x".repeat(96);
    publish_acked(&mut c, &leader, 1, &pad, 300);
    c.settle();
    let held = c.nodes[&leader].broker().committed_batches(&ledger(), 0).len();
    assert!(held < 20, "the leader's log holds {held} of 300 batches in memory");
    let (bytes, on_disk) = c.nodes[&leader].replica_entry_memory();
    assert!(
        bytes <= 4096 + 512 && on_disk > 250,
        "the leader's Raft log: {bytes} bytes in memory, {on_disk} entries on disk only"
    );
    // The follower comes back 300 entries behind: the leader reads them back to send them.
    let reads = c.replica_reads;
    c.cut.clear();
    let tail = |c: &Cluster, n: &str| c.nodes[n].replica_status().iter().find(|r| r.0 == ledger()).map(|r| r.3);
    c.until("the follower that was away caught up", |c| tail(c, &away) == tail(c, &leader));
    assert!(c.replica_reads > reads, "the entries it missed were read back from the leader's log");
    // A subscriber from the start gets every record in order, most read back from the log.
    let expect: Vec<(u64, String)> = (0..300u64).map(|k| (k + 1, format!("{pad}{k}"))).collect();
    let subscribe_all = |c: &mut Cluster, node: &str, index: u64| {
        let reads = c.replica_reads;
        let got = ledger_from_start(c, node, index);
        assert!(c.replica_reads > reads, "{node}: history was read back from the replica log");
        got
    };
    assert_eq!(subscribe_all(&mut c, &leader, 2), expect, "offset 0 is the generation start");
    // The leader dies; the follower that was away may lead, and serves the same history.
    c.nodes.remove(&leader);
    c.until("another replica leads", |c| leading(c).is_some());
    let second = leading(&c).unwrap();
    assert_eq!(subscribe_all(&mut c, &second, 3), expect);
}

/// A leader reads entries back for a follower behind only while the links to other brokers
/// have room (issue 32): with the driver saying [`CATCH_UP_QUEUE_LIMIT`] bytes are queued for
/// peers, the leader holds its reads and the follower stays behind (unbounded, a follower 3M
/// records behind had 83 MiB of appends queued for it on the leader); once the driver says
/// the links drained, the held reads go out at once and the follower catches up. Links that
/// stay full do not starve it: a read is held at most [`CATCH_UP_HOLD_MAX`].
#[test]
fn a_leader_reads_entries_for_a_follower_behind_only_while_the_links_have_room() {
    use felix_proto::cluster::node::{CATCH_UP_HOLD_MAX, CATCH_UP_QUEUE_LIMIT, TICK};
    let (mut c, leader) = memory_bounded_ledger();
    let away = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    let tail = |c: &Cluster, n: &str| c.nodes[n].replica_status().iter().find(|r| r.0 == ledger()).map(|r| r.3);
    let hold_ticks = (CATCH_UP_HOLD_MAX.as_millis() / TICK.as_millis()) as usize;
    let pad = "x".repeat(96);
    for (round, drained) in [(1, true), (2, false)] {
        c.cut.insert(away.clone());
        publish_acked(&mut c, &leader, round, &pad, 300);
        c.settle();
        c.nodes.get_mut(&leader).unwrap().set_peer_queued(CATCH_UP_QUEUE_LIMIT);
        let reads = c.replica_reads;
        c.cut.clear();
        for _ in 0..hold_ticks / 2 {
            c.tick();
        }
        assert!(tail(&c, &away) < tail(&c, &leader), "round {round}: behind while the links are full");
        assert_eq!(c.replica_reads, reads, "round {round}: nothing read back while the links are full");
        let (ever, now) = c.nodes[&leader].catch_up_reads_held();
        assert!(ever >= 1 && now >= 1, "round {round}: the leader holds its reads: {ever} ever, {now} now");
        if drained {
            c.nodes.get_mut(&leader).unwrap().set_peer_queued(CATCH_UP_QUEUE_LIMIT - 1);
            c.settle();
            assert!(c.replica_reads > reads, "the held reads went out as the links drained");
        }
        let mut ticks = hold_ticks / 2;
        while tail(&c, &away) != tail(&c, &leader) {
            assert!(ticks < 300, "round {round}: the follower never caught up");
            c.tick();
            ticks += 1;
        }
        if !drained {
            assert!(ticks >= hold_ticks, "links full: a read waits its hold out ({ticks} ticks)");
            assert!(c.replica_reads > reads, "links full all along: the follower caught up all the same");
        }
        c.nodes.get_mut(&leader).unwrap().set_peer_queued(0);
        assert_eq!(c.nodes[&leader].catch_up_reads_held().1, 0);
    }
}

/// Brokers restarted on long replica logs hold only the newest part of them in memory: the
/// committed entries before it (left on disk, as `serve`'s fold does past its entry cache)
/// are replayed from the kept logs in reads of about the entry cache's size before each
/// replica takes part again. The whole cluster restarts (a power cut): every replica comes
/// back with the offsets it had, a subscriber from the start gets every record, and writes
/// go on at the next offset.
#[test]
fn restarted_replicas_replay_the_committed_log_left_on_disk_in_bounded_reads() {
    let (mut c, leader) = memory_bounded_ledger();
    let pad = "x".repeat(96);
    publish_acked(&mut c, &leader, 1, &pad, 300);
    c.until("every replica holds the same history", |c| same_history_everywhere(c, &leader));
    let before: BTreeMap<String, _> = NAMES.iter().map(|n| (n.to_string(), history(&c, n).0)).collect();
    c.spill_on_start = Some(2048);
    let mut spilled = c.kept_replicas[&leader][&ledger()].clone();
    spilled.spill_committed(2048);
    let on_disk = spilled.spill.as_ref().map_or(0, |s| s.end() - s.first());
    assert!(on_disk > 250 && spilled.entries.len() < 30, "{on_disk} entries left on disk");
    let reads = c.replica_reads;
    for name in NAMES {
        restart(&mut c, name);
    }
    c.until("every restarted replica replayed its log and one leads", |c| {
        NAMES.iter().all(|n| {
            c.nodes[*n].replaying_replicas() == 0 && c.nodes[*n].replica_status().iter().any(|r| r.0 == ledger())
        }) && leading(c).is_some()
    });
    // Three logs of 300 entries of about 160 bytes, in reads of about 4 KiB.
    assert!(c.replica_reads - reads >= 30, "{} reads", c.replica_reads - reads);
    for name in NAMES {
        assert_eq!(history(&c, name).0, before[name], "{name}: the records it held in memory, at their offsets");
    }
    let second = leading(&c).unwrap();
    let expect: Vec<(u64, String)> = (0..300u64).map(|k| (k + 1, format!("{pad}{k}"))).collect();
    assert_eq!(ledger_from_start(&mut c, &second, 2)[..300], expect[..], "every record from the start");
    let flags = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;
    let (conn, st) = c.client(&second, flags, 3);
    c.send(&second, conn, st, publish_binary("ledger", &["later"], Some(1), None));
    let a = acks(&payloads(&c.take(&second, conn, st)));
    assert!(a.len() == 1 && a[0].status == AckStatus::Ok, "{a:?}");
    assert!(a[0].offset.is_some_and(|o| o > 300), "written after the records replayed: {a:?}");
}

/// A snapshot with more data than a chunk goes to a follower behind the leader's compaction
/// in `snapshot_chunk`s (kind 14), put together there and installed, and the follower catches
/// up. To a broker playing a version without the hello bit it goes whole in `shard_raft`, as
/// before, and that one catches up too.
#[test]
fn a_snapshot_larger_than_a_chunk_goes_in_chunks_to_a_peer_that_reads_them_and_whole_to_one_that_does_not() {
    for old in [false, true] {
        let mut c = Cluster::new(&NAMES);
        c.retain = Some(30);
        c.history = true;
        c.chunk_bytes = Some(4);
        let now = c.now;
        for name in NAMES {
            c.start(name, &RaftLog::default(), now);
        }
        create_ledger(&mut c);
        let leader = leading(&c).unwrap();
        let behind = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
        c.nodes.remove(&behind);
        publish_acked(&mut c, &leader, 1, "r", 300);
        for _ in 0..3 {
            c.tick();
        }
        if old {
            c.old_peers.insert(behind.clone());
        }
        // With history reads the leader's snapshot is on disk only (its data is the host's
        // state, which the host holds): read back for the follower behind, held by nobody after.
        assert_eq!(c.nodes[&leader].replica_snapshot_memory(), 0);
        let reads = c.snapshot_reads;
        restart(&mut c, &behind);
        c.until("the follower caught up", |c| history(c, &behind).0 == history(c, &leader).0);
        assert!(c.kept_replicas[&behind][&ledger()].snapshot.is_some(), "it installed a snapshot");
        assert!(c.snapshot_reads > reads, "the snapshot was read back from the leader's kept log");
        for n in [&leader, &behind] {
            assert_eq!(c.nodes[n].replica_snapshot_memory(), 0, "{n} holds no snapshot data");
        }
        let sent = c.nodes[&leader].snapshot_chunk_counts().0;
        let assembled = c.nodes[&behind].snapshot_chunk_counts().1;
        if old {
            assert_eq!((sent, assembled), (0, 0), "no chunk to an older broker");
        } else {
            assert!(sent >= 3 && assembled >= 1, "{sent} chunks sent, {assembled} snapshots put together");
        }
    }
}

/// Chunks that do not make a snapshot are dropped, whatever a peer sends: a chunk with no
/// first one before it, a first one whose message is not the snapshot it names, a claim past
/// the limit, a chunk that skips ahead or runs past its total. Nothing is stepped, nothing
/// panics, and the group goes on.
#[test]
fn snapshot_chunks_that_do_not_make_a_snapshot_are_dropped() {
    use felix_proto::cluster::meta::encode_message;
    use felix_proto::cluster::node::MAX_SNAPSHOT_BYTES;
    use felix_proto::cluster::peer::{PeerMessage, SnapshotChunk};
    use raft::eraftpb::{Message, MessageType};
    let mut c = Cluster::new(&NAMES);
    let now = c.now;
    for name in NAMES {
        c.start(name, &RaftLog::default(), now);
    }
    create_ledger(&mut c);
    let leader = leading(&c).unwrap();
    let follower = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    let mut snap = Message::default();
    snap.set_msg_type(MessageType::MsgSnapshot);
    snap.mut_snapshot().mut_metadata().index = 5;
    snap.mut_snapshot().mut_metadata().term = 1;
    let header = Bytes::from(encode_message(&snap));
    let chunk = |offset: u64, total: u64, header: Bytes, data: &'static [u8]| {
        PeerMessage::SnapshotChunk(SnapshotChunk {
            shard: ledger(),
            index: 5,
            term: 1,
            total,
            offset,
            header,
            data: Bytes::from_static(data),
        })
    };
    let mut other = snap.clone();
    other.set_msg_type(MessageType::MsgAppend);
    for m in [
        chunk(4, 8, Bytes::new(), b"efgh"),
        chunk(0, 8, Bytes::from(encode_message(&other)), b"abcd"),
        chunk(0, 8, Bytes::from_static(b"\xff\xff garbage"), b"abcd"),
        chunk(0, MAX_SNAPSHOT_BYTES + 1, header.clone(), b"abcd"),
        chunk(0, 8, header.clone(), b"abcd"),
        chunk(6, 8, Bytes::new(), b"gh"),
        chunk(4, 8, Bytes::new(), b"efgh"),
        chunk(0, 4, header.clone(), b"abcdefgh"),
    ] {
        let n = c.nodes.get_mut(&follower).unwrap();
        n.handle_peer(&leader, m, now);
    }
    assert_eq!(c.nodes[&follower].snapshot_chunk_counts().1, 0, "no snapshot was put together");
    // A snapshot from the leader whose data is not a replica's state (none at all, as a
    // message whose data was to follow from disk; or bytes that do not read): dropped, not
    // installed over the follower's log.
    let history_before = history(&c, &follower).0;
    let mut bare = snap.clone();
    bare.from = felix_proto::cluster::node::raft_id(&leader);
    bare.to = felix_proto::cluster::node::raft_id(&follower);
    bare.term = 1_000;
    bare.mut_snapshot().mut_metadata().index = 1_000;
    bare.mut_snapshot().mut_metadata().term = 1_000;
    let mut junk = bare.clone();
    junk.mut_snapshot().set_data(Bytes::from_static(b"\x07 not a state"));
    for m in [bare, junk] {
        let raft = PeerMessage::ShardRaft(vec![(ledger(), Bytes::from(encode_message(&m)).into())]);
        c.nodes.get_mut(&follower).unwrap().handle_peer(&leader, raft, now);
    }
    assert_eq!(c.nodes[&follower].snapshots_refused(), 2);
    assert_eq!(history(&c, &follower).0, history_before, "nothing installed");
    publish_acked(&mut c, &leader, 1, "after", 3);
    c.until("every replica holds the same history", |c| same_history_everywhere(c, &leader));
}

/// Whether every broker holds the same ledger history as `leader`.
pub(super) fn same_history_everywhere(c: &Cluster, leader: &str) -> bool {
    NAMES.iter().all(|n| history(c, n).0 == history(c, leader).0)
}

pub(super) fn create_ledger(c: &mut Cluster) {
    c.create(Kind::Stream, "ledger", 1, 3);
    c.until("a replica leads", |c| leading(c).is_some());
}

pub(super) fn restart(c: &mut Cluster, name: &str) {
    let (kept, now) = (c.kept[name].clone(), c.now);
    c.start(name, &kept, now);
}

/// A broker that restarts forgot which leader it heard, so for `VOTE_HOLD` after it starts its
/// replicas grant no vote nor pre-vote (a read lease may still count on what it heard). The
/// ledger's leader is cut off; most of an election timeout later one follower restarts: the
/// other, standing first, is elected only once the hold is over. Tried with each follower
/// restarting (without the hold, the one whose timer runs first would win at once).
#[test]
fn a_restarted_broker_grants_no_replica_vote_for_an_election_timeout() {
    use felix_proto::broker::ReplicaRole;
    use felix_proto::cluster::node::VOTE_HOLD;
    for pick in 0..2 {
        let mut c = Cluster::new(&NAMES);
        create_ledger(&mut c);
        let old = leading(&c).unwrap();
        let others: Vec<String> = NAMES.iter().filter(|n| **n != old).map(|n| n.to_string()).collect();
        c.cut.insert(old.clone());
        for _ in 0..8 {
            c.tick();
        }
        restart(&mut c, &others[pick]);
        let restarted = c.now;
        c.until("a survivor leads", |c| {
            others.iter().any(|n| c.nodes[n].broker().replica_role(&ledger()) == Some(&ReplicaRole::Leading))
        });
        let after = c.now - restarted;
        assert!(after >= VOTE_HOLD, "restarting {}: a leader {after:?} after the restart", others[pick]);
    }
}

#[test]
fn a_replica_whose_disk_fails_stops_and_the_group_carries_on_without_losing_a_record() {
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    let leader = leading(&c).unwrap();
    let flags = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;
    // A follower's disk fills: its replica stops (it acknowledges nothing it did not keep), and
    // the leader and the other follower, a majority, go on acknowledging.
    let follower = NAMES.iter().find(|n| **n != leader).unwrap().to_string();
    c.failing_disks.insert(follower.clone());
    let (conn, st) = c.client(&leader, flags, 1);
    for k in 0..10u64 {
        c.send(&leader, conn, st, publish_binary("ledger", &[&format!("a{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(&leader, conn, st)));
    assert!(a.len() == 10 && a.iter().all(|a| a.status == AckStatus::Ok), "{a:?}");
    assert!(c.nodes[&follower].failed_replicas().contains_key(&ledger()), "the follower's replica stopped");
    // Now the leader's disk fails too: it stops; the last healthy replica cannot commit alone,
    // so a publish is not acknowledged `ok` (outcome unknown or refused), never lost silently.
    c.failing_disks.insert(leader.clone());
    c.send(&leader, conn, st, publish_binary("ledger", &["lost?"], Some(11), None));
    let a = acks(&payloads(&c.take(&leader, conn, st)));
    assert!(a.iter().all(|a| a.status != AckStatus::Ok), "{a:?}");
    // Both disks mended and brokers restarted: the group has its majority back, every
    // acknowledged record is there once, and it takes writes again.
    c.failing_disks.clear();
    restart(&mut c, &follower);
    restart(&mut c, &leader);
    c.until("a replica leads again", |c| leading(c).is_some());
    let now_leader = leading(&c).unwrap();
    let (conn, st) = c.client(&now_leader, flags, 2);
    c.send(&now_leader, conn, st, publish_binary("ledger", &["after"], Some(1), None));
    let a = acks(&payloads(&c.take(&now_leader, conn, st)));
    assert!(a.len() == 1 && a[0].status == AckStatus::Ok, "{a:?}");
    let (records, _) = history(&c, &now_leader);
    let payloads: Vec<&[u8]> = records.iter().map(|(_, p)| p.as_ref()).collect();
    for k in 0..10 {
        let p = format!("a{k}");
        assert_eq!(payloads.iter().filter(|x| **x == p.as_bytes()).count(), 1, "{p} exactly once: {payloads:?}");
    }
    assert_eq!(payloads.last().copied(), Some(&b"after"[..]));
    c.until("every replica holds the same history", |c| same_history_everywhere(c, &now_leader));
}

#[test]
fn a_replicas_log_is_compacted_to_what_retention_keeps_and_a_follower_behind_it_catches_up_from_a_snapshot() {
    // One follower is down while 300 records are written (acknowledged by the other two).
    let (mut c, leader, behind) = ledger_with_a_follower_down();
    let flags = 0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x1000;
    let (conn, st) = c.client(&leader, flags, 1);
    for k in 0..300u64 {
        c.send(&leader, conn, st, publish_binary("ledger", &[&format!("r{k}")], Some(k + 1), None));
    }
    let a = acks(&payloads(&c.take(&leader, conn, st)));
    assert!(a.len() == 300 && a.iter().all(|a| a.status == AckStatus::Ok), "{:?}", a.len());
    for _ in 0..3 {
        c.tick();
    }
    // The leader holds the last 30 records, and its Raft log no longer holds the entries of
    // the ones retention dropped: memory and disk stay bounded by retention.
    let (held, _) = history(&c, &leader);
    assert!(held.len() <= 31 && held.last().map(|(_, p)| p.as_ref()) == Some(&b"r299"[..]), "{held:?}");
    let report = c.nodes[&leader].replica_report();
    let first = report[0].first_index;
    assert!(first > 200, "compacted: the log starts at {first} of {}", report[0].last_index);
    let kept = &c.kept_replicas[&leader][&ledger()];
    assert!(kept.snapshot.is_some() && kept.entries.len() < 100, "{} entries kept", kept.entries.len());
    // The follower comes back with its old log: the entries it lacks are gone, so it is sent
    // a snapshot and then the entries after it; it ends holding what the leader holds.
    restart(&mut c, &behind);
    c.until("the follower caught up", |c| history(c, &behind).0 == history(c, &leader).0);
    assert!(c.kept_replicas[&behind][&ledger()].snapshot.is_some(), "it installed a snapshot");
    // Restarted from their compacted logs, the leader and the follower come back with the same
    // records, and writes go on at the next offsets.
    let before = history(&c, &leader).0;
    restart(&mut c, &leader);
    restart(&mut c, &behind);
    c.until("a replica leads again", |c| leading(c).is_some());
    let now_leader = leading(&c).unwrap();
    let after = history(&c, &now_leader).0;
    assert_eq!(&after[..before.len().min(after.len())], &before[..before.len().min(after.len())]);
    let (conn, st) = c.client(&now_leader, flags, 2);
    c.send(&now_leader, conn, st, publish_binary("ledger", &["after"], Some(1), None));
    let a = acks(&payloads(&c.take(&now_leader, conn, st)));
    assert!(a.len() == 1 && a[0].status == AckStatus::Ok, "{a:?}");
    let offset = a[0].offset.unwrap_or(0);
    assert!(offset > before.last().map_or(0, |(o, _)| *o), "offsets go on: {offset}");
    c.until("every replica holds the same records", |c| same_history_everywhere(c, &now_leader));
}

#[test]
fn a_conditional_publish_on_a_replicated_stream_is_written_only_at_its_expected_offset() {
    use felix_proto::features::Features;
    use felix_proto::message::{B64, RefusedReason};
    let mut c = Cluster::new(&NAMES);
    create_ledger(&mut c);
    let leader = leading(&c).unwrap();
    let n = c.nodes.get_mut(&leader).unwrap();
    let conn = n.inputs().admit(PeerAddr([9; 16]), c.now).unwrap();
    let st = StreamId::new(Side::Client, Dir::Bi, 9);
    let features = (Features::PUBLISH_CONDITIONAL.union(Features::ERROR_CODES)).to_words(false).0;
    n.inputs().handle_stream_data(conn, st, auth(Some(0x0001 | 0x0080 | 0x1000), features, None), false, c.now);
    c.settle();
    c.take(&leader, conn, st);
    let publish_if = |expected_offset, request_id, payload: &'static str| {
        json(&Message::PublishIf(message::PublishIf {
            tenant_id: "t1".into(),
            namespace: "default".into(),
            stream: "ledger".into(),
            payloads: vec![B64(Bytes::from_static(payload.as_bytes()))],
            key: None,
            expected_offset,
            shard: Some(0),
            request_id,
            publish_width: None,
        }))
    };
    // The tail after the leader's generation start.
    let tail = c.nodes[&leader].broker().replicated_start(&ledger()).unwrap()
        + history(&c, &leader).1.len() as u64
        + history(&c, &leader).0.len() as u64;
    c.send(&leader, conn, st, publish_if(tail, 1, "first"));
    c.send(&leader, conn, st, publish_if(tail, 2, "second"));
    let ms = messages(&c.take(&leader, conn, st));
    assert!(matches!(&ms[0], Message::PublishOk(ok) if ok.request_id == 1 && ok.offset == Some(tail)), "{ms:?}");
    assert!(
        matches!(&ms[1], Message::PublishRefused(r) if r.request_id == 2
            && r.reason == RefusedReason::OffsetMismatch { tail: tail + 1 }),
        "{ms:?}"
    );
    // Every replica wrote the first and not the second.
    c.settle();
    for n in NAMES {
        let (records, _) = history(&c, n);
        let payloads: Vec<&[u8]> = records.iter().map(|(_, p)| p.as_ref()).collect();
        assert_eq!(payloads, vec![&b"first"[..]], "{n}");
    }
}
