//! A replica the metadata no longer names lingers while its group may still count it a voter
//! (`felix_proto::cluster::node::LINGER_TICKS`): it keeps its log, answers its group, stands
//! for nothing and serves nothing, and goes once its group's leader took it out.

use super::*;

/// Five brokers; the ledger's group is three of them. A replica move brings a fourth broker in
/// as a voter; then the other two replicas are cut off, so no leader can take anyone out of
/// the group, and the move is cancelled (the metadata, three of five, still commits). The
/// target, no longer named, keeps its replica: the group of four counts it, and without it the
/// leader and the two cut off could never again make three of four. Once healed, the group's
/// leader takes it out, it drops its replica, and the ledger takes writes; nobody rejoined.
/// A restart while it lingers changes none of that. (Before lingering, the target dropped its replica as soon as it learnt of the cancel:
/// `felix-node sim --cluster --clients`, seed 545887, left a group without a leader so.)
#[test]
fn a_cancelled_replica_moves_target_keeps_its_replica_until_its_group_takes_it_out() {
    let mut c = five();
    create_ledger(&mut c);
    c.until("a replica leads and the metadata names it", |c| {
        leading(c).is_some_and(|l| c.nodes.values().all(|n| n.metadata().owner(&ledger()).unwrap().owner == l))
    });
    let leader = leading(&c).unwrap();
    publish_acked(&mut c, &leader, 1, "a", 5);
    let (group, target) = linger_a_cancelled_target(&mut c, &ledger(), &leader);
    let leader = leading(&c).unwrap();
    publish_acked(&mut c, &leader, 2, "b", 5);
    assert!(c.rejoin_notes.is_empty(), "{:?}", c.rejoin_notes);
    for n in &group {
        assert_eq!(history(&c, n).0.len(), 10, "{n}");
    }
    assert!(c.nodes[&target].replica_status().is_empty());
}

/// The same with a replicated cache, whose broker-side contents are the replica's: while the
/// target lingers (a restart included, which applies its kept log again) its broker serves the
/// cache as one it holds no replica of, not as a follower "electing" for good (the world
/// simulation, seed 562442); once it let its replica go, reads through it are the leader's.
#[test]
fn a_cancelled_replica_moves_target_of_a_replicated_cache_lingers_serving_nothing() {
    use quorum_cache::*;
    let mut c = five();
    create_sessions(&mut c);
    let leader = cache_leader(&c).unwrap();
    let cl = client(&mut c, &leader, 1);
    assert_eq!(
        ask(&mut c, &leader, cl, put("alice", "a1", None, 2)),
        Message::CacheOk(message::CacheOk { request_id: 2 })
    );
    let (_, target) = linger_a_cancelled_target(&mut c, &sessions(), &leader);
    let leader = cache_leader(&c).unwrap();
    let cl = client(&mut c, &leader, 3);
    assert_eq!(
        ask(&mut c, &leader, cl, put("bob", "b1", None, 4)),
        Message::CacheOk(message::CacheOk { request_id: 4 })
    );
    c.settle();
    for n in [&leader, &target] {
        assert_eq!(read(&mut c, n, "alice", 5).map(|v| v.0).as_deref(), Some("a1"), "{n}");
        assert_eq!(read(&mut c, n, "bob", 6).map(|v| v.0).as_deref(), Some("b1"), "{n}");
    }
    assert!(c.rejoin_notes.is_empty(), "{:?}", c.rejoin_notes);
}

fn five() -> Cluster {
    let five = ["n1", "n2", "n3", "n4", "n5"];
    let mut c = Cluster::new(&five);
    c.until("every broker joined", |c| c.nodes.values().all(|n| n.metadata().members().len() == 5));
    c
}

/// Brings a broker outside `shard`'s group in by a replica move, cuts the group's two other
/// replicas off, cancels the move, checks that the target lingers (through a restart), heals:
/// the group's replicas and the target.
fn linger_a_cancelled_target(c: &mut Cluster, shard: &ShardId, leader: &str) -> (Vec<String>, String) {
    let five = ["n1", "n2", "n3", "n4", "n5"];
    let group = c.nodes["n1"].metadata().replicas(shard).unwrap().to_vec();
    let others: Vec<String> = group.iter().filter(|n| *n != leader).cloned().collect();
    let outside: Vec<String> = five.iter().map(|n| n.to_string()).filter(|n| !group.contains(n)).collect();
    let (target, bystander) = (outside[0].clone(), outside[1].clone());
    let now = c.now;
    let mv = Command::MoveReplica { shard: shard.clone(), from: others[0].clone(), to: target.clone() };
    c.nodes.get_mut(leader).unwrap().propose(&mv, now);
    c.until("the target joined the group as a voter and knows it", |c| {
        c.nodes[&target].replica_voters(shard).is_some_and(|v| v.len() == 4 && v.contains(&target))
    });
    for o in &others {
        c.cut.insert(o.clone());
    }
    let now = c.now;
    c.nodes.get_mut(&bystander).unwrap().propose(&Command::CancelMove { shard: shard.clone() }, now);
    c.until("the target learnt that the move was cancelled", |c| c.nodes[&target].metadata().moving(shard).is_none());
    assert!(c.nodes[&target].metadata().replicas(shard).is_some_and(|r| !r.contains(&target)));
    // Five seconds on: the group (the leader and the target up, two cut off) counts it. Half
    // way, the target restarts: the replica its disk kept, which the metadata does not name,
    // starts again and lingers too.
    for i in 0..50 {
        if i == 25 {
            restart(c, &target);
            c.until("the restarted target started the replica its disk kept", |c| {
                c.nodes[&target].replica_status().iter().any(|(s, ..)| s == shard)
            });
        }
        assert!(
            c.nodes[&target].replica_status().iter().any(|(s, ..)| s == shard),
            "the target dropped a replica its group counts as a voter"
        );
        assert_eq!(c.nodes[&target].lingering_replicas(), 1);
        // Its broker serves the shard as any broker the metadata does not name.
        assert_eq!(c.nodes[&target].broker().replica_role(shard), None);
        c.tick();
    }
    c.cut.clear();
    c.until("healed: the group is the metadata's three again and the target let its replica go", |c| {
        let Some(l) = leader_of(c, shard) else { return false };
        let voters = c.nodes[&l].replica_voters(shard).unwrap_or_default();
        voters.len() == 3
            && voters.iter().all(|v| group.contains(v))
            && c.nodes[&target].replica_status().iter().all(|(s, ..)| s != shard)
    });
    assert_eq!(c.nodes[&target].lingering_replicas(), 0);
    (group, target)
}
