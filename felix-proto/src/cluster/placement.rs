//! Placement: which broker owns each shard. A pure function of the shards, the active brokers and
//! the current owners, so that every broker (and the simulation) computes the same assignment
//! from the same metadata, and so that it can be tested exhaustively.
//!
//! Three properties, in order of priority:
//! 1. **Complete**: every shard has an active owner (when there is at least one active broker).
//! 2. **Balanced**: owner counts differ by at most one.
//! 3. **Minimal movement**: a shard keeps its owner unless that owner is gone or holds more than
//!    its balanced share. Of the brokers, those holding the most get the `n mod m` shares of
//!    one extra shard, so the fewest shards move: a broker that leaves moves exactly its own
//!    shards, a broker that joins receives about `n / m` and nothing else moves.
//!
//! Ties are broken by order (shards and broker ids are `Ord`), never by hash or input order.

use std::collections::{BTreeMap, BTreeSet};

/// The owner of every shard, given the shards, the active brokers and the current owners
/// (shards absent from `current`, or owned by a broker not in `active`, are unplaced). Empty when
/// no broker is active.
pub fn place<S, N>(shards: &[S], active: &[N], current: &BTreeMap<S, N>) -> BTreeMap<S, N>
where
    S: Ord + Clone,
    N: Ord + Clone,
{
    let shards: BTreeSet<&S> = shards.iter().collect();
    let nodes: BTreeSet<&N> = active.iter().collect();
    let mut out = BTreeMap::new();
    if nodes.is_empty() {
        return out;
    }
    let (n, m) = (shards.len(), nodes.len());
    let (base, extra) = (n / m, n % m);
    // What each active broker holds now, in shard order.
    let mut held: BTreeMap<&N, Vec<&S>> = nodes.iter().map(|&node| (node, Vec::new())).collect();
    for &s in &shards {
        if let Some(owner) = current.get(s)
            && let Some(list) = held.get_mut(owner)
        {
            list.push(s);
        }
    }
    // The `extra` brokers holding the most get one more than `base` (ties: the lower id).
    let mut by_load: Vec<&N> = nodes.iter().copied().collect();
    by_load.sort_by(|a, b| held[b].len().cmp(&held[a].len()).then_with(|| a.cmp(b)));
    let quota: BTreeMap<&N, usize> =
        by_load.iter().enumerate().map(|(i, &node)| (node, base + usize::from(i < extra))).collect();
    // Keep what fits in each quota (the lowest shards first); the rest is unplaced.
    let mut unplaced: BTreeSet<&S> = shards.clone();
    let mut room: BTreeMap<&N, usize> = BTreeMap::new();
    for (&node, list) in &held {
        let q = quota[node];
        for &s in list.iter().take(q) {
            unplaced.remove(s);
            out.insert(s.clone(), node.clone());
        }
        room.insert(node, q.saturating_sub(list.len()));
    }
    // Fill the brokers with room, in id order, with the unplaced shards in shard order.
    let mut fill = room.into_iter().flat_map(|(node, r)| std::iter::repeat_n(node, r));
    for s in unplaced {
        if let Some(node) = fill.next() {
            out.insert(s.clone(), node.clone());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn moved(before: &BTreeMap<u32, u8>, after: &BTreeMap<u32, u8>) -> usize {
        after.iter().filter(|(s, o)| before.get(s) != Some(o)).count()
    }

    fn counts(p: &BTreeMap<u32, u8>, nodes: &[u8]) -> Vec<usize> {
        nodes.iter().map(|n| p.values().filter(|o| *o == n).count()).collect()
    }

    #[test]
    fn nothing_to_place_on() {
        let p = place(&[1u32, 2, 3], &[] as &[u8], &BTreeMap::new());
        assert!(p.is_empty());
    }

    #[test]
    fn a_leaving_broker_moves_exactly_its_shards_and_a_joining_one_takes_its_share() {
        let shards: Vec<u32> = (0..12).collect();
        let three = place(&shards, &[1u8, 2, 3], &BTreeMap::new());
        assert_eq!(counts(&three, &[1, 2, 3]), vec![4, 4, 4]);
        // Broker 2 leaves: its 4 shards move, nothing else.
        let two = place(&shards, &[1u8, 3], &three);
        assert_eq!(moved(&three, &two), 4);
        assert_eq!(counts(&two, &[1, 3]), vec![6, 6]);
        // Broker 4 joins: it takes 4 (12 / 3), taken from the others; nothing else moves.
        let again = place(&shards, &[1u8, 3, 4], &two);
        assert_eq!(moved(&two, &again), 4);
        assert_eq!(counts(&again, &[1, 3, 4]), vec![4, 4, 4]);
        // Placing again changes nothing.
        assert_eq!(place(&shards, &[1u8, 3, 4], &again), again);
    }

    proptest! {
        #[test]
        fn complete_balanced_deterministic_and_minimal(
            n in 0usize..60,
            nodes in proptest::collection::btree_set(0u8..12, 1..8),
            owners in proptest::collection::vec(proptest::option::of(0u8..14), 60),
            shuffle in any::<u64>(),
        ) {
            let shards: Vec<u32> = (0..n as u32).collect();
            let active: Vec<u8> = nodes.iter().copied().collect();
            let current: BTreeMap<u32, u8> =
                shards.iter().zip(&owners).filter_map(|(s, o)| o.map(|o| (*s, o))).collect();
            let p = place(&shards, &active, &current);
            // Complete, on active brokers only.
            prop_assert_eq!(p.len(), n);
            prop_assert!(p.values().all(|o| nodes.contains(o)));
            // Balanced.
            let c = counts(&p, &active);
            prop_assert!(c.iter().max().unwrap() - c.iter().min().unwrap() <= 1, "{:?}", c);
            // Deterministic whatever the order of the inputs.
            let mut s2 = shards.clone();
            let mut a2 = active.clone();
            let k = (shuffle % 7) as usize + 1;
            s2.reverse();
            let k = k.min(s2.len());
            s2.rotate_left(k);
            a2.reverse();
            prop_assert_eq!(&place(&s2, &a2, &current), &p);
            // Minimal: a shard with an active owner moves only off a broker above its share,
            // and the count moved equals the lower bound: every unowned shard, plus each
            // broker's surplus over the best quota assignment.
            let m = active.len();
            let (base, extra) = (n / m, n % m);
            let mut held: Vec<usize> = active.iter().map(|a| current.values().filter(|o| *o == a).count()).collect();
            held.sort_unstable_by(|a, b| b.cmp(a));
            let surplus: usize =
                held.iter().enumerate().map(|(i, h)| h.saturating_sub(base + usize::from(i < extra))).sum();
            let orphans = shards.iter().filter(|s| current.get(s).is_none_or(|o| !nodes.contains(o))).count();
            prop_assert_eq!(moved(&current, &p), orphans + surplus);
            // Stable: placing the result again moves nothing.
            prop_assert_eq!(place(&shards, &active, &p), p);
        }
    }
}
