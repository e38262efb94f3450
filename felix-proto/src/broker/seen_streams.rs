//! Which of a client's streams (of one direction) a connection has seen.

use std::collections::BTreeMap;

/// The stream indexes of one direction a connection has seen, so that bytes arriving after a
/// stream was closed (still in flight from the driver when the broker dropped its state) are
/// told apart from a new stream's.
///
/// Why not only the highest index seen: a client opens streams in order, but their first bytes
/// come in any order. Packets are lost and reordered, and a driver reads each stream on its own
/// (the tokio driver in one task per stream). Taking every index at or below the highest for a
/// closed stream dropped the first request of a stream overtaken by a later one, and the client
/// waited for an answer for ever (40 streams opened at once lost one in two runs of three).
///
/// The indexes skipped so far are kept as ranges, so a peer naming a far index costs one
/// entry, not one per index skipped.
#[derive(Debug, Default)]
pub(super) struct SeenStreams {
    /// Every index from here on is unseen.
    next: u64,
    /// Unseen indexes below `next`, as `start -> end` (exclusive), ranges apart.
    gaps: BTreeMap<u64, u64>,
}

impl SeenStreams {
    /// Whether `index` is seen for the first time (a new stream); it is seen from now on.
    pub(super) fn first_sight(&mut self, index: u64) -> bool {
        if index >= self.next {
            if index > self.next {
                self.gaps.insert(self.next, index);
            }
            self.next = index.saturating_add(1);
            return true;
        }
        let Some((&start, &end)) = self.gaps.range(..=index).next_back() else { return false };
        if index >= end {
            return false;
        }
        self.gaps.remove(&start);
        if start < index {
            self.gaps.insert(start, index);
        }
        if index + 1 < end {
            self.gaps.insert(index + 1, end);
        }
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_stream_overtaken_by_a_later_one_is_still_new_and_a_closed_one_is_not() {
        let mut s = SeenStreams::default();
        assert!(s.first_sight(0));
        assert!(s.first_sight(3), "1 and 2 skipped");
        assert!(s.first_sight(2), "overtaken by 3, still new");
        assert!(!s.first_sight(2), "seen");
        assert!(!s.first_sight(0));
        assert!(!s.first_sight(3));
        assert!(s.first_sight(1));
        assert!(s.gaps.is_empty());
        assert!(s.first_sight(4));
    }

    #[test]
    fn a_far_index_costs_one_range() {
        // A stream id is at most 2^62 - 1 (a QUIC varint), its index a quarter of that.
        let last = (1u64 << 60) - 1;
        let mut s = SeenStreams::default();
        assert!(s.first_sight(last - 1));
        assert_eq!(s.gaps.len(), 1);
        assert!(s.first_sight(1 << 40));
        assert_eq!(s.gaps.len(), 2);
        assert!(s.first_sight(last), "the last index");
        assert!(!s.first_sight(last), "and only once");
        assert!(!s.first_sight(1 << 40));
    }

    proptest! {
        /// Any order of first sights: each index is new exactly once.
        #[test]
        fn each_index_is_new_exactly_once_in_any_order(order in Just((0u64..64).collect::<Vec<_>>()).prop_shuffle(), again in proptest::collection::vec(0u64..64, 0..32)) {
            let mut s = SeenStreams::default();
            for i in &order {
                prop_assert!(s.first_sight(*i), "{i} new");
            }
            for i in again {
                prop_assert!(!s.first_sight(i), "{i} seen");
            }
            prop_assert!(s.gaps.is_empty());
        }
    }
}
