//! The deterministic fault simulation (see `felix_proto::chaos`) over a spread of seeds and run
//! lengths: many short runs, and some long ones, since some failures only appear in the state a
//! long run reaches (an idempotent producer past its first window, retention cutting history,
//! many crashes). `felix-node sim` runs as many seeds as time allows and prints a failing one to
//! replay.

mod support;

use felix_proto::chaos::{ChaosReport, run_seed};
use support::epoch;

fn run(seeds: impl IntoIterator<Item = (u64, usize)>) -> ChaosReport {
    let mut total = ChaosReport::default();
    for (seed, steps) in seeds {
        match run_seed(seed, epoch(), steps) {
            Ok(r) => total.add(&r),
            Err(e) => {
                panic!("seed {seed} broke an invariant (replay: felix-node sim --seed {seed} --steps {steps}): {e}")
            }
        }
    }
    total
}

#[test]
fn short_runs_keep_every_invariant_under_faults() {
    // 40 seeds of 300 to 1,500 steps.
    let total = run((1..=40u64).map(|seed| (seed, 300 + (seed as usize * 97) % 1200)));
    // The runs did exercise what they claim to.
    assert!(total.acked > 2000, "{total:?}");
    assert!(total.delivered > 2000, "{total:?}");
    assert!(total.failed_writes > 100 && total.lost_connections > 100 && total.crashes > 20, "{total:?}");
    assert!(total.cache_reads > 200, "{total:?}");
    assert!(total.idempotent_resends > 50, "the producer retried: {total:?}");
    assert!(total.group_deliveries > 1000 && total.group_acks > 500, "the group member worked: {total:?}");
}

#[test]
fn long_runs_keep_every_invariant_under_faults() {
    // Long enough for retention to cut the history several times (4,000 records a shard) and
    // for the idempotent producer to run hundreds of batches past its first window.
    let total = run([(7u64, 12_000usize), (42, 8_000)]);
    assert!(total.acked > 1500, "{total:?}");
    assert!(total.crashes > 30, "{total:?}");
    assert!(total.idempotent_resends > 100, "{total:?}");
    assert!(total.storage_stalls > 2 && total.producer_window_full > 0, "the producer met its window: {total:?}");
}

/// Seeds `felix-node sim` once failed on, kept so the fix stays fixed.
#[test]
fn seeds_that_once_failed() {
    let seeds = [
        // An idempotent producer's sequence 0 failed to write, later ones landed, the broker
        // crashed: the resend of 0 was refused sequence_expired although it never landed.
        (1_795_994_640_296_538_020u64, 1000usize),
        // The simulated producer kept more than 64 batches unanswered, so a resend fell out of
        // the broker's remembered window and was refused sequence_expired. The producer's core
        // (client::producer) now never hands out a sequence 64 or more past its oldest
        // unanswered one.
        (2, 5000),
        (3, 5000),
        // Batches pipelined behind a failed one were refused as gaps only after the producer had
        // already sent the failed one again: still gaps behind it, not a reason to stop.
        (44, 5000),
        // The producer's first batch failed, so the broker did not know the producer when the
        // next arrived: `unknown_producer`, still a gap behind the failure.
        (502, 5000),
    ];
    run(seeds);
}
