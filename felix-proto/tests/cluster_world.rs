//! The whole cluster under faults (felix_proto::cluster::world): 3, 5 or 7 brokers (by seed)
//! holding 212 shards, and clients; lost, delayed and partitioned peer messages, brokers that crash
//! and restart from their kept Raft log, operators moving durable shards (copied, cut over, handed
//! over) and cancelling moves. Over 1,000 seeds: one owner per shard and generation, generations
//! only grow, only owners (and a moving shard's new owner, its copy) write and accept subscribers,
//! every request answered, progress once healed, every acknowledged durable record at its offset on
//! its final owner, no reader left on a broker that lost its shard, and subscribers that follow
//! every durable shard through its moves given every committed record once, in order.

mod support;

use felix_proto::cluster::world::{WorldReport, run};

fn seeds(range: std::ops::Range<u64>) -> WorldReport {
    let epoch = support::epoch();
    let mut t = WorldReport::default();
    for seed in range {
        let r = run(seed, epoch, 300).unwrap_or_else(|v| panic!("{v}"));
        t.absorb(&r);
    }
    eprintln!("{t:?}");
    t
}

/// Two halves, so the test harness runs them on both cores.
#[test]
fn the_first_500_seeds_keep_every_cluster_invariant() {
    let t = seeds(0..500);
    // The faults and every kind of answer happened (a quiet run proves nothing).
    assert!(t.crashes > 500 && t.lost > 5_000, "{t:?}");
    assert!(t.forwarded > 1_000 && t.redirected > 1_000 && t.unavailable > 100 && t.subscribed > 1_000, "{t:?}");
    assert!(t.lost_with_broker > 0 && t.cache_answers > 1_000, "{t:?}");
    // Operators moved durable shards (and cancelled moves) under all of it.
    assert!(t.moves_asked > 1_000 && t.moves_done > 1_000, "{t:?}");
    // Subscribers followed their shards through them, each record checked once and in order;
    // replicas of the replicated stream moved to other brokers.
    assert!(t.followed > 10_000 && t.follows > 500 && t.replica_moves > 10, "{t:?}");
    // Operators moved one broker's replica of it, followers' too (D61).
    assert!(t.follower_moves_asked > 50, "{t:?}");
    // The metadata log was compacted, and brokers behind it restored from a sent snapshot (D62).
    assert!(t.meta_snapshots > 1_000 && t.meta_snapshots_received > 20, "{t:?}");
}

#[test]
fn the_next_500_seeds_keep_every_cluster_invariant() {
    let t = seeds(500..1000);
    assert!(t.crashes > 500 && t.acked > 10_000, "{t:?}");
    // Retention kept few records, so replicas' logs were compacted (and restored) as they ran.
    assert!(t.snapshots > 1_000, "{t:?}");
    // Restarts replayed the committed front of replicas' logs from disk in reads.
    assert!(t.replayed > 1_000, "{t:?}");
    // Snapshots went to replicas behind in chunks (odd seeds), and whole to older brokers.
    assert!(t.snapshot_chunks > 1_000, "{t:?}");
    // In half the seeds snapshots were on disk only, read back for the replicas behind.
    assert!(t.snapshot_reads > 100, "{t:?}");
    // The replicated cache took writes through crashes and partitions, and adds to its
    // counters.
    assert!(t.qcache_acked > 1_000 && t.counter_adds_acked > 300, "{t:?}");
    // Commits to the replicated stream (in the seeds whose brokers offer them), their state
    // checked on every replica once healed.
    assert!(t.commits_acked > 500, "{t:?}");
    // A consumer group polled the replicated stream and acked what it was handed, through
    // fail-overs: nothing acked was handed out again (in the seeds that consume).
    assert!(t.group_records > 1_000 && t.group_acks_acked > 1_000, "{t:?}");
}

#[test]
fn a_seed_replays_exactly() {
    let epoch = support::epoch();
    for seed in [4, 91] {
        assert_eq!(run(seed, epoch, 300), run(seed, epoch, 300));
    }
}

/// Seeds that found a bug, each kept with what it was.
#[test]
fn seeds_that_once_failed() {
    let epoch = support::epoch();
    for (seed, what) in [
        (
            501_290,
            "two replicas with equal election ranks (made before a move changed the group) split the votes every term: no leader once healed",
        ),
        (
            503_908,
            "a replica added back empty voted for a member standing in a stale configuration, which won and overwrote a committed record",
        ),
        (
            506_623,
            "a move's target, made a follower that knows no leader again by a metadata change, was never told its group's leader: \"electing\" for good",
        ),
        (
            506_884,
            "a broker still recorded as a replicated cache's leader after its replica moved away served the cache as a plain one, acknowledging a put its group never saw",
        ),
        (
            511_375,
            "two equal-ranked replicas, each stand rejected at once by the third (its log longer), stood together every term while the third's timer was reset by their vote requests: no leader once healed",
        ),
        (
            545_887,
            "a replica move's target, added as a voter, dropped its replica when the move was cancelled (as another named replica had, losing what it acknowledged): a group of four with two voters, no leader once healed",
        ),
        (
            562_442,
            "a lingering replica of the replicated cache, restarted, applied its kept log into its broker's cache and so made the broker serve the cache as a follower that knows no leader: \"electing\" for good",
        ),
        (
            562_733,
            "a move given up after its target led and claimed put the shard back on the leaving replica, which a later move took out of the group; the leader's claims for its term were stale: no owner that leads, for good",
        ),
    ] {
        if let Err(v) = run(seed, epoch, 300) {
            panic!("seed {seed} ({what}): {v}");
        }
    }
}
