//! The metadata group under faults (felix_proto::cluster::sim): lost, duplicated, delayed and
//! partitioned messages, crashes and restarts from the kept Raft log. Over 1,000 seeds: one
//! history, one owner per shard and generation, generations only grow, progress once healed.

use felix_proto::cluster::sim::run;

#[test]
fn a_thousand_seeds_keep_every_metadata_invariant() {
    let (mut applied, mut crashes, mut elections, mut lost) = (0, 0, 0, 0);
    for seed in 0..1000 {
        let o = run(seed, 300).unwrap_or_else(|v| panic!("{v}"));
        applied += o.applied;
        crashes += o.crashes;
        elections += o.elections;
        lost += o.lost;
    }
    // The faults happened (a quiet run proves nothing).
    assert!(crashes > 1000 && elections > 1000 && lost > 10_000, "{crashes} {elections} {lost}");
    assert!(applied > 50_000, "{applied}");
    eprintln!("1000 seeds: {applied} commands applied, {crashes} crashes, {elections} elections, {lost} messages lost");
}

#[test]
fn a_seed_replays_exactly() {
    for seed in [3, 77, 901] {
        assert_eq!(run(seed, 400), run(seed, 400));
    }
}
