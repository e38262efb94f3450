//! A durable single-replica shard's consumer groups move with it (D65): what they acked on the
//! old owner is never handed out again by the new one, and an older new owner, which could not
//! take them, is refused the move rather than given the shard without them.

use super::*;

fn orders_poll(shard: u32, rid: u64) -> Bytes {
    billing_poll("orders", shard, 100, rid)
}

fn orders_ack(shard: u32, offset: u64, rid: u64) -> Bytes {
    json(&Message::GroupAck(billing_offset("orders", shard, offset, rid)))
}

/// Six records on `shard` of `orders` through its owner; a group takes all six there and
/// acks the first four. The client it used, and the owner.
fn six_records_four_acked(c: &mut Cluster, shard: u32) -> String {
    let from = owner(c, shard);
    let key = key_for(shard, 3);
    let (pc, ps) = c.client(&from, 0x0001 | 0x0008 | 0x0040 | 0x0200 | 0x0400 | 0x1000, 1);
    for i in 0..6u64 {
        c.send(&from, pc, ps, publish_binary("orders", &[&format!("r{i}")], Some(i + 1), Some(&key)));
        assert_eq!(acks(&payloads(&c.take(&from, pc, ps)))[0].status, AckStatus::Ok);
    }
    let (gc, gs) = c.client_with(&from, 1, group_features(), 5);
    c.send(&from, gc, gs, orders_poll(shard, 1));
    assert_eq!(offsets_handed(&messages(&c.take(&from, gc, gs))), [0, 1, 2, 3, 4, 5]);
    for o in 0..4 {
        c.send(&from, gc, gs, orders_ack(shard, o, 10 + o));
        c.tick();
        assert!(matches!(messages(&c.take(&from, gc, gs))[..], [Message::CacheOk(_)]), "ack {o}");
    }
    from
}

fn offsets_handed(ms: &[Message]) -> Vec<u64> {
    ms.iter()
        .flat_map(|m| match m {
            Message::GroupRecords(r) => r.records.iter().map(|r| r.offset).collect::<Vec<u64>>(),
            other => panic!("not group_records: {other:?}"),
        })
        .collect()
}

/// Moves `shard` of `orders` to `to`; whether the move finished there within `ticks`.
fn move_to(c: &mut Cluster, shard: u32, to: &str, ticks: usize) -> bool {
    let from = owner(c, shard);
    let now = c.now;
    c.nodes.get_mut(&from).unwrap().propose(&Command::MoveShard { shard: orders_shard(shard), to: to.into() }, now);
    for _ in 0..ticks {
        let md = c.nodes["n1"].metadata();
        if md.moving(&orders_shard(shard)).is_none() && md.owner(&orders_shard(shard)).is_some_and(|a| a.owner == to) {
            return true;
        }
        c.tick();
    }
    false
}

/// Polls `shard`'s group on `node` (a fresh client) and acks nothing: the offsets handed out.
fn poll_on(c: &mut Cluster, node: &str, shard: u32, index: u64) -> Vec<u64> {
    let (gc, gs) = c.client_with(node, 1, group_features(), index);
    c.send(node, gc, gs, orders_poll(shard, 99));
    offsets_handed(&messages(&c.take(node, gc, gs)))
}

/// Found 2026-12-07: the groups' acks lived in the old owner's `$groups` log, which a move left
/// behind, so the new owner handed out all six records again, the four acknowledged ones too
/// (a drain did the same to every shard of the broker). Fails without D65 at the first assert.
#[test]
fn a_durable_shards_consumer_groups_move_with_it_and_nothing_acked_is_handed_out_again() {
    let mut c = Cluster::with(&NAMES, true);
    c.create(Kind::Stream, "orders", 3, 0);
    let from = six_records_four_acked(&mut c, 0);
    let to = NAMES.iter().find(|n| **n != from).unwrap().to_string();
    assert!(move_to(&mut c, 0, &to, 300), "the move finishes");
    assert_eq!(poll_on(&mut c, &to, 0, 6), [4, 5], "only what was never acked is handed out");
    // The new owner wrote the groups to its own `$groups` log (a reset, then the group's
    // state), so a restart there reads them back: the same fold does.
    let log = &c.sys_writes[&(to.clone(), "$groups.0.orders".to_owned())];
    assert_eq!(log.first().map(|r| r[0]), Some(7), "a reset first: {log:?}");
    assert!(log.iter().any(|r| r.first() == Some(&8) && r.windows(7).any(|w| w == b"billing")), "{log:?}");
    // A shard with no group moves as before: no `$groups` log is made for it.
    let other = owner(&c, 1);
    let to1 = NAMES.iter().find(|n| **n != other).unwrap().to_string();
    assert!(move_to(&mut c, 1, &to1, 300));
    assert!(!c.sys_writes.contains_key(&(to1, "$groups.1.orders".to_owned())));
}

/// A new owner that does not take groups (an older broker, no `FEATURE_GROUP_COPY`) is refused
/// the copy's final answer, so the move of a shard with groups goes no further and the shard
/// stays with its groups where it was; a shard without groups still moves to it as before.
#[test]
fn a_shard_with_groups_does_not_move_to_an_older_broker_that_would_lose_them() {
    use felix_proto::cluster::peer::{FEATURE_GROUP_COPY, PEER_FEATURES};
    let mut c = Cluster::with(&NAMES, true);
    c.features.insert("n3".into(), PEER_FEATURES & !FEATURE_GROUP_COPY);
    c.hellos("n3");
    c.create(Kind::Stream, "orders", 3, 0);
    let shard = (0..3).find(|s| owner(&c, *s) != "n3").expect("a shard n3 does not own");
    let from = six_records_four_acked(&mut c, shard);
    assert!(!move_to(&mut c, shard, "n3", 400), "refused: the shard stays");
    for _ in 0..100 {
        c.tick();
    }
    assert_eq!(owner(&c, shard), from);
    assert!(c.nodes["n1"].metadata().moving(&orders_shard(shard)).is_none(), "the move was given up");
    // Its groups are intact where it stayed: 0 to 3 acked, 4 and 5 still claimed by the
    // consumer that took them.
    assert_eq!(poll_on(&mut c, &from, shard, 6), Vec::<u64>::new());
    let free = (0..3).find(|s| *s != shard && owner(&c, *s) != "n3").expect("another shard");
    assert!(move_to(&mut c, free, "n3", 300), "a shard without groups still moves to it");
}
