//! Disk faults (a failing fsync, a full disk), a bridge partition, two of five brokers killed at once.

use super::*;

/// One broker's disk starts failing its syncs under load (`FELIX_FAULT_SYNC_FAIL_AFTER`, `EIO`
/// after 200): it stops at once (exit 74) without carrying out what waited on the failed sync,
/// the other two go on taking writes, and once restarted on a mended disk it takes part again.
/// Nothing acknowledged is lost or written twice.
#[test]
fn a_broker_whose_fsync_fails_stops_and_the_others_go_on_losing_no_acknowledged_record() {
    let (_dirs, mut nodes) = three_nodes(&[], &[], false);
    nodes[2].env.push((felix_driver_common::sync_journal::FAIL_AFTER_ENV.into(), "200".into()));
    let peers = nodes.iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes {
        n.start(&peers);
    }
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    wait_for("the broker with the failing disk stops, exit 74", 60, || {
        let exited = nodes[2].proc.as_mut().and_then(|p| p.0.try_wait().ok().flatten());
        exited.is_some_and(|st| {
            assert_eq!(st.code(), Some(74), "a failed fsync ends the broker with EX_IOERR");
            true
        })
    });
    let acked = mended_and_nothing_lost(&mut nodes, &peers, &any_dir, load);
    eprintln!("failing fsync: the broker stopped (74); {} acknowledged, none lost or doubled", acked.len());
}

/// One broker's disk fills under load (`FELIX_FAULT_FULL_AFTER_BYTES`: its replica-log
/// appends fail `ENOSPC` after 400 kB): its replica stops (it acknowledges nothing it did not
/// keep) and says so in `cluster status`, the broker itself stays up, the other two go on
/// taking writes, and once restarted with room it catches up and takes part again. Nothing
/// acknowledged is lost or written twice.
#[test]
fn a_broker_whose_disk_fills_stops_that_replica_says_so_and_the_others_lose_nothing() {
    let (_dirs, mut nodes) = three_nodes(&[], &[], false);
    nodes[2].env.push((felix_driver_common::sync_journal::FULL_AFTER_ENV.into(), "400000".into()));
    let peers = nodes.iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes {
        n.start(&peers);
    }
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    let mut why = String::new();
    wait_for("the full broker's replica stops and says why", 60, || {
        let failed = status(nodes[2].metrics).and_then(|v| {
            v["failed_replicas"].as_array()?.iter().find(|r| r["name"] == "ledger").map(|r| r["failed"].to_string())
        });
        failed.is_some_and(|f| {
            why = f;
            true
        })
    });
    assert!(why.contains("No space left") || why.contains("28"), "{why}");
    assert!(nodes[2].proc.as_mut().is_some_and(|p| p.0.try_wait().ok().flatten().is_none()), "the broker stays up");
    let acked = mended_and_nothing_lost(&mut nodes, &peers, &any_dir, load);
    eprintln!("full disk: the replica stopped ({why}); {} acknowledged, none lost or doubled", acked.len());
}

/// A bridge: the leader and one follower cannot reach each other, the other follower reaches
/// both. Nothing acknowledged is lost or doubled, and writes go on (pre-vote keeps the cut-off
/// follower from deposing a leader the bridge still hears, or a new leader is elected through
/// the bridge).
#[test]
fn a_bridge_partition_loses_and_doubles_nothing_and_writes_go_on() {
    let r = under_a_fault(4, Duration::from_secs(8), false, |net, leader| {
        let cut = ["n1", "n2", "n3"].into_iter().find(|o| *o != leader).unwrap();
        let blocked = Link { blocked: true, ..Link::default() };
        net.set(leader, cut, blocked);
        net.set(cut, leader, blocked);
    });
    eprintln!(
        "bridge: {} acknowledged, none lost or doubled; rates {:.0?}/s; longest stretch without an ack {:?}",
        r.acked, r.rates, r.longest_gap
    );
    assert!(r.rates[1] > 0.0, "no write acknowledged through the bridge partition");
}

/// Five brokers and a stream replicated on all five (RF 5): the shard's leader and one of its
/// followers are killed (SIGKILL) at the same moment under a full-speed acknowledged publisher.
/// The three left are a majority: one of them leads and acknowledges writes again within a
/// bound; the two come back from their data directories and follow; every acknowledged record
/// is in the stream exactly once and nothing never sent is.
#[test]
fn an_rf5_stream_on_five_brokers_loses_no_acknowledged_record_when_two_are_killed_at_once() {
    let (_dirs, mut nodes, peers) = brokers(5, 5);
    let any_dir = nodes[0].dir.clone();
    let load = Load::start(&nodes, 8);
    load.wait_acks("the publisher is acknowledged", 0, 300);
    let lead = leader_index(&nodes);
    // Replicated on all five, each of which the leader tracks.
    wait_for("the leader replicates to all five", 30, || {
        status(nodes[lead].metrics).is_some_and(|v| {
            v["replicas"].as_array().is_some_and(|r| {
                r.iter().any(|r| {
                    r["name"] == "ledger"
                        && r["role"] == "leader"
                        && r["replicas"].as_array().is_some_and(|f| f.len() == 5)
                        && r["followers"].as_array().is_some_and(|f| f.len() == 5)
                })
            })
        })
    });
    let follower = (lead + 1) % nodes.len();
    let killed = Instant::now();
    nodes[lead].kill();
    nodes[follower].kill();
    let survivors: Vec<usize> = (0..nodes.len()).filter(|i| *i != lead && *i != follower).collect();
    wait_for("one of the three left leads", 30, || survivors.iter().any(|i| ledger_role_is(&nodes[*i], "leader")));
    let elected = killed.elapsed();
    load.wait_acks("the three left acknowledge writes", load.count(), 300);
    let gap = load.longest_gap(killed);
    nodes[lead].start(&peers);
    nodes[follower].start(&peers);
    wait_for("both killed brokers follow again", 60, || {
        ledger_role_is(&nodes[lead], "follower") && ledger_role_is(&nodes[follower], "follower")
    });
    load.wait_acks("acknowledged with all five back", load.count(), 200);
    let fast = load.finish();
    let acked: Vec<String> = fast.acked.iter().flatten().cloned().collect();
    check_ledger(&nodes, &any_dir, &acked, &fast.unknown);
    eprintln!(
        "RF 5, two of five killed at once: {} acknowledged, none lost or doubled; a survivor led after {elected:?}; \
         longest stretch without an ack {gap:?}",
        acked.len()
    );
    assert!(gap < Duration::from_secs(10), "no acknowledged write for {gap:?} after two brokers were killed");
}
