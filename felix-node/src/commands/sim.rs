//! `sim`: the deterministic simulations (one broker, the metadata group, whole clusters with
//! clients, replicated shards) over many seeds.

use super::*;

/// `sim --cluster`: the metadata group's simulation over many seeds.
fn sim_cluster(a: &SimArgs) -> Result<ExitCode, String> {
    let first = a.seed.unwrap_or(0);
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let count = if single { 1 } else { a.seeds.unwrap_or(u64::MAX) };
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let steps = a.steps.map_or(300, |s| s as u64);
    let start = std::time::Instant::now();
    let (mut seeds, mut applied, mut crashes, mut elections, mut lost) = (0u64, 0u64, 0u64, 0u64, 0u64);
    for seed in first..first.saturating_add(count) {
        if !single && a.seeds.is_none() && start.elapsed() >= budget {
            break;
        }
        match felix_proto::cluster::sim::run(seed, steps) {
            Ok(o) => {
                seeds += 1;
                (applied, crashes, elections, lost) =
                    (applied + o.applied, crashes + o.crashes, elections + o.elections, lost + o.lost);
                if !a.quiet {
                    out!("seed {seed}: {} brokers, {} applied, digest {:016x}", o.nodes, o.applied, o.digest);
                }
            }
            Err(v) => {
                out!("FAIL {v}");
                out!("replay: felix-node sim --cluster --seed {seed} --steps {steps}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    out!(
        "{seeds} seeds passed in {:.1} s: {applied} commands applied, {crashes} crashes, {elections} elections, {lost} messages lost",
        start.elapsed().as_secs_f64()
    );
    Ok(ExitCode::SUCCESS)
}

/// `sim --cluster --clients`: whole brokers and clients under faults, over many seeds.
fn sim_cluster_world(a: &SimArgs) -> Result<ExitCode, String> {
    let first = a.seed.unwrap_or(0);
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let count = if single { 1 } else { a.seeds.unwrap_or(u64::MAX) };
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let ticks = a.steps.map_or(300, |s| s.min(u32::MAX as usize) as u32);
    let start = std::time::Instant::now();
    let mut t = felix_proto::cluster::world::WorldReport::default();
    let mut seeds = 0u64;
    for seed in first..first.saturating_add(count) {
        if !single && a.seeds.is_none() && start.elapsed() >= budget {
            break;
        }
        match felix_proto::cluster::world::run(seed, start, ticks) {
            Ok(r) => {
                seeds += 1;
                t.absorb(&r);
                if !a.quiet {
                    out!(
                        "seed {seed}: {} brokers, {} requests ({} acked, {} redirected, {} unavailable), {} crashes, digest {:016x}",
                        r.nodes,
                        r.requests,
                        r.acked,
                        r.redirected,
                        r.unavailable,
                        r.crashes,
                        r.digest
                    );
                }
            }
            Err(v) => {
                out!("FAIL {v}");
                out!("replay: felix-node sim --cluster --clients --seed {seed} --steps {ticks}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    out!(
        "{seeds} seeds passed in {:.1} s: {} requests, {} acked ({} forwarded, {} commits), {} subscribed, {} cache answers, {} redirected, {} unavailable, {} crashes, {} peer messages lost, {} operator moves asked, {} durable shards moved, {} records given to following subscribers ({} moves followed), {} replicas moved to another broker, {} snapshots ({} with a host's part written beside them; in {} chunks, {} read back from disk for a replica behind, {} installed or kept states read back from disk in pieces, {} restores of a kept one started at a restart), {} entries replayed from disk at restarts, {} metadata snapshots ({} sent to a broker behind)",
        start.elapsed().as_secs_f64(),
        t.requests,
        t.acked,
        t.forwarded,
        t.commits_acked,
        t.subscribed,
        t.cache_answers,
        t.redirected,
        t.unavailable,
        t.crashes,
        t.lost,
        t.moves_asked,
        t.moves_done,
        t.followed,
        t.follows,
        t.replica_moves,
        t.snapshots,
        t.snapshots_with_rest,
        t.snapshot_chunks,
        t.snapshot_reads,
        t.restores_from_disk,
        t.restores_at_restart,
        t.replayed,
        t.meta_snapshots,
        t.meta_snapshots_received
    );
    Ok(ExitCode::SUCCESS)
}

/// `sim --replicated`: one replicated shard's Raft group under faults, over many seeds.
fn sim_replicated(a: &SimArgs) -> Result<ExitCode, String> {
    let first = a.seed.unwrap_or(0);
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let count = if single { 1 } else { a.seeds.unwrap_or(u64::MAX) };
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let steps = a.steps.map_or(600, |s| s as u64);
    let start = std::time::Instant::now();
    let mut t = felix_proto::cluster::replica_sim::ReplicaReport::default();
    let mut seeds = 0u64;
    for seed in first..first.saturating_add(count) {
        if !single && a.seeds.is_none() && start.elapsed() >= budget {
            break;
        }
        match felix_proto::cluster::replica_sim::run(seed, steps) {
            Ok(r) => {
                seeds += 1;
                t.absorb(&r);
                if !a.quiet {
                    out!(
                        "seed {seed}: {} replicas, {} batches acknowledged ({} duplicates answered), {} crashes, digest {:016x}",
                        r.replicas,
                        r.acked,
                        r.duplicates,
                        r.crashes,
                        r.digest
                    );
                }
            }
            Err(v) => {
                out!("FAIL {v}");
                out!("replay: felix-node sim --replicated --seed {seed} --steps {steps}");
                return Ok(ExitCode::FAILURE);
            }
        }
    }
    out!(
        "{seeds} seeds passed in {:.1} s: {} batches acknowledged exactly once ({} retries answered as duplicates, {} outcome-unknown answers), {} crashes, {} elections, {} messages lost, {} compactions, {} snapshots installed ({} read back from disk for a replica behind), {} host states restored",
        start.elapsed().as_secs_f64(),
        t.acked,
        t.duplicates,
        t.outcome_unknown,
        t.crashes,
        t.elections,
        t.lost,
        t.compactions,
        t.snapshots_installed,
        t.snapshot_reads,
        t.host_restores
    );
    Ok(ExitCode::SUCCESS)
}

/// `felix-node sim`: the fault simulation over many seeds.
pub fn sim(a: &SimArgs) -> Result<ExitCode, String> {
    if a.replicated {
        return sim_replicated(a);
    }
    if a.clients {
        return sim_cluster_world(a);
    }
    if a.cluster {
        return sim_cluster(a);
    }
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};
    let epoch = std::time::Instant::now();
    let single = a.seed.is_some() && a.seeds.is_none() && a.duration.is_none();
    let first = a.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
    });
    let budget = a.duration.unwrap_or(std::time::Duration::from_secs(30));
    let limit = if single { Some(1) } else { a.seeds };
    let jobs = a.jobs.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())).max(1);
    let start = std::time::Instant::now();
    let next = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    // (seeds passed, their counts, the failure if any)
    let shared = Arc::new(Mutex::new((0u64, felix_proto::chaos::ChaosReport::default(), None::<String>)));
    let steps_of = |seed: u64| a.steps.unwrap_or_else(|| felix_proto::chaos::steps_for_seed(seed));
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            let (next, stop, shared) = (next.clone(), stop.clone(), shared.clone());
            scope.spawn(move || {
                loop {
                    if stop.load(Ordering::SeqCst) || (limit.is_none() && start.elapsed() >= budget) {
                        return;
                    }
                    let i = next.fetch_add(1, Ordering::SeqCst);
                    if limit.is_some_and(|n| i >= n) {
                        return;
                    }
                    let seed = first.wrapping_add(i);
                    let steps = steps_of(seed);
                    let result = felix_proto::chaos::run_seed(seed, epoch, steps);
                    let mut g = shared.lock().unwrap_or_else(|e| e.into_inner());
                    match result {
                        Ok(r) => {
                            if !a.quiet {
                                out!("seed {seed} steps {steps} digest {:016x} ok", r.digest);
                            }
                            g.0 += 1;
                            g.1.add(&r);
                            if g.0.is_multiple_of(10) && std::io::IsTerminal::is_terminal(&std::io::stderr()) {
                                let secs = start.elapsed().as_secs_f64();
                                eprint!("\r{} seeds, {:.0} seeds/hour, no failure   ", g.0, g.0 as f64 * 3600.0 / secs);
                            }
                        }
                        Err(e) => {
                            stop.store(true, Ordering::SeqCst);
                            if g.2.is_none() {
                                g.2 = Some(format!(
                                    "seed {seed} FAILED: {e}\nreplay with: felix-node sim --seed {seed} --steps {steps}"
                                ));
                            }
                            return;
                        }
                    }
                }
            });
        }
    });
    let (ran, total, failure) = {
        let g = shared.lock().unwrap_or_else(|e| e.into_inner());
        (g.0, g.1.clone(), g.2.clone())
    };
    let secs = start.elapsed().as_secs_f64().max(1e-9);
    eprintln!();
    if let Some(f) = failure {
        eprintln!("{f}");
        return Ok(ExitCode::FAILURE);
    }
    let steps =
        a.steps.map_or_else(|| format!("{} steps in all (varied per seed)", total.steps), |s| format!("{s} steps"));
    out!(
        "{ran} seed(s) of {steps} passed in {secs:.1} s ({:.0} seeds/hour, from seed {first}, {jobs} job(s)): {} acknowledged records verified, {} deliveries, {} failed writes, {} lost connections, {} crashes, {} cache reads checked, {} idempotent resends, {} group deliveries, {} group acks, {} commits folded, {} state keys checked after crashes",
        ran as f64 * 3600.0 / secs,
        total.acked,
        total.delivered,
        total.failed_writes,
        total.lost_connections,
        total.crashes,
        total.cache_reads,
        total.idempotent_resends,
        total.group_deliveries,
        total.group_acks,
        total.commits,
        total.state_reads
    );
    Ok(ExitCode::SUCCESS)
}
