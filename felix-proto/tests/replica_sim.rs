//! A replicated shard under faults (felix_proto::cluster::replica_sim): lost, duplicated,
//! delayed and partitioned messages, crashes between any two outputs (the leader mid-write,
//! with what it had not made durable lost), restarts from the kept Raft log, and idempotent
//! producers retrying. Over 1,000 seeds: one history, offsets only grow, one leader per term,
//! every acknowledged batch exactly once at its offset, progress once healed, and the hosts'
//! state the same at every offset, restored from snapshots included.

use felix_proto::cluster::replica_sim::{ReplicaReport, run};

fn seeds(range: std::ops::Range<u64>) -> ReplicaReport {
    let mut t = ReplicaReport::default();
    for seed in range {
        let r = run(seed, 600).unwrap_or_else(|v| panic!("{v}\nreplay: felix-node sim --replicated --seed {seed}"));
        t.absorb(&r);
    }
    eprintln!("{t:?}");
    t
}

#[test]
fn the_first_500_seeds_lose_no_acknowledged_record() {
    let t = seeds(0..500);
    // The faults happened, and retries met batches that had committed (a quiet run proves
    // nothing).
    assert!(t.crashes > 500 && t.elections > 500 && t.lost > 10_000, "{t:?}");
    assert!(t.outcome_unknown > 100 && t.duplicates > 10, "{t:?}");
    // Restarts replayed the committed front of their logs from disk, in reads that failed
    // now and then.
    assert!(t.replayed > 10_000, "{t:?}");
}

#[test]
fn the_next_500_seeds_lose_no_acknowledged_record() {
    let t = seeds(500..1000);
    assert!(t.acked > 5_000 && t.generations > 1_000, "{t:?}");
    // Logs were compacted, and replicas behind a compaction caught up from a snapshot.
    assert!(t.compactions > 1_000 && t.snapshots_installed > 50, "{t:?}");
    // Snapshots stayed on disk only: each one a follower was sent was read back first (in
    // reads that failed now and then).
    assert!(t.snapshot_reads > 50, "{t:?}");
    // Hosts restored their state from snapshots (written in place in even seeds, encoded at
    // compaction in odd ones), each the state every replica had at its offset.
    assert!(t.host_restores > 500, "{t:?}");
}

/// Seeds past the first 1,000 that once found a fault, with what each found.
const FOUND: &[(u64, &str)] =
    &[(99230, "a snapshot read answered in a replica's next life ran its engine during the replay")];

#[test]
fn seeds_that_found_faults_pass() {
    for (seed, found) in FOUND {
        run(*seed, 600).unwrap_or_else(|v| panic!("{v} (once: {found})"));
    }
}

#[test]
fn a_seed_replays_exactly() {
    for seed in [2, 77] {
        assert_eq!(run(seed, 600), run(seed, 600));
    }
}
