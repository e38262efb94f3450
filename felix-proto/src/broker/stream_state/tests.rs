use super::*;
use crate::broker::group::Durable;

/// [`decode_stream_state`] of bytes anywhere.
fn decode_stream_state(state: &[u8]) -> Option<(u64, Vec<GroupOp>, Option<crate::storage::StateCheckpoint>)> {
    super::decode_stream_state(&Bytes::copy_from_slice(state))
}

#[test]
fn a_stream_state_round_trips_and_garbage_changes_nothing() {
    let snap = |name: &str, cursor| GroupOp::Snapshot {
        group: name.into(),
        state: Durable { cursor: Some(cursor), dead: [3, 9].into(), ..Durable::default() },
    };
    let ops = vec![snap("a", 4), snap("b", 11)];
    let mut bytes = vec![STREAM_STATE_VERSION];
    bytes.extend_from_slice(&77u64.to_be_bytes());
    bytes.extend_from_slice(&2u32.to_be_bytes());
    for op in &ops {
        let e = op.encode();
        bytes.extend_from_slice(&(e.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&e);
    }
    assert_eq!(decode_stream_state(&bytes), Some((77, ops.clone(), None)));
    // With the commit-state section: read whole, or the state is not read at all.
    let commits =
        crate::storage::StateCheckpoint { as_of: 12, values: vec![("balance".into(), Bytes::from_static(b"25"), 12)] };
    let section = crate::storage::encode_state_checkpoint(&commits).unwrap();
    let mut with = bytes.clone();
    with.push(STREAM_STATE_COMMITS);
    with.extend_from_slice(&(section.len() as u32).to_be_bytes());
    with.extend_from_slice(&section);
    assert_eq!(decode_stream_state(&with), Some((77, ops.clone(), Some(commits))));
    // What a leader checks before sending a snapshot to an older replica, by lengths alone.
    assert!(stream_state_holds_commits(&with));
    assert!(!stream_state_holds_commits(&bytes), "no section");
    for cut in 0..=bytes.len() {
        assert!(!stream_state_holds_commits(&with[..cut]), "cut {cut}");
    }
    for cut in bytes.len() + 1..with.len() {
        assert_eq!(decode_stream_state(&with[..cut]), None, "cut {cut}");
    }
    let mut tag = with.clone();
    tag[bytes.len()] = 2;
    assert_eq!(decode_stream_state(&tag), None, "an unknown section");
    let mut flipped = with.clone();
    let last = flipped.len() - 6;
    flipped[last] ^= 1;
    assert_eq!(decode_stream_state(&flipped), None, "a damaged state");
    // Every cut, a wrong version, trailing bytes, an absurd count, an empty state: none.
    for cut in 0..bytes.len() {
        assert_eq!(decode_stream_state(&bytes[..cut]), None, "cut {cut}");
    }
    let mut v = bytes.clone();
    v[0] = 9;
    assert_eq!(decode_stream_state(&v), None);
    let mut t = bytes.clone();
    t.push(0);
    assert_eq!(decode_stream_state(&t), None);
    assert_eq!(decode_stream_state(&[1, 0, 0, 0, 0, 0, 0, 0, 0, 0xFF, 0xFF, 0xFF, 0xFF]), None);
    // A record that is not a checkpoint record does not belong in a state.
    let ack = GroupOp::Ack { group: "a".into(), offset: 1 }.encode();
    let mut a = vec![STREAM_STATE_VERSION, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
    a.extend_from_slice(&(ack.len() as u32).to_be_bytes());
    a.extend_from_slice(&ack);
    assert_eq!(decode_stream_state(&a), None);
    let none = [STREAM_STATE_VERSION, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0];
    assert_eq!(decode_stream_state(&none), Some((9, Vec::new(), None)));
}

/// A replicated stream's restored state hands its commit values over where the snapshot's
/// data holds them: the host copies them out once as it keeps them
/// ([`ShardState::restore_checkpoint`](crate::broker::state::ShardState)). A copy of the
/// whole section here as well held the state a third time while a snapshot was installed
/// (found with heaptrack: 41 MB for a 40 MiB state).
#[test]
fn a_stream_states_commit_values_are_read_where_the_snapshot_holds_them() {
    let values: Vec<(String, Bytes, u64)> =
        (0..4u64).map(|i| (format!("k{i}"), Bytes::from(vec![i as u8; 1000]), 10 + i)).collect();
    let commits = crate::storage::StateCheckpoint { as_of: 20, values };
    let section = crate::storage::encode_state_checkpoint(&commits).unwrap();
    let mut state = vec![STREAM_STATE_VERSION];
    state.extend_from_slice(&5u64.to_be_bytes());
    state.extend_from_slice(&0u32.to_be_bytes());
    state.push(STREAM_STATE_COMMITS);
    state.extend_from_slice(&(section.len() as u32).to_be_bytes());
    state.extend_from_slice(&section);
    let state = Bytes::from(state);
    let (ts, ops, read) = super::decode_stream_state(&state).expect("a whole state");
    assert_eq!((ts, ops.len()), (5, 0));
    let read = read.expect("its commit state");
    assert_eq!(read, commits);
    for (k, v, _) in &read.values {
        assert!(crate::broker::tests::within(v, &state), "{k}: copied out of the snapshot's data");
    }
}

/// A stream's state read a piece at a time, as a follower reads it back from disk, is what
/// reading it whole gives, wherever the pieces are cut (through the head, the section's tag
/// and length, a value); each value a copy of its own; bytes that are not a whole state give
/// nothing, as whole.
#[test]
fn a_stream_state_read_in_pieces_is_the_state_read_whole() {
    let snap = |name: &str, cursor| GroupOp::Snapshot {
        group: name.into(),
        state: Durable { cursor: Some(cursor), dead: [3].into(), ..Durable::default() },
    };
    let commits = crate::storage::StateCheckpoint {
        as_of: 20,
        values: (0..5u64).map(|i| (format!("k{i}"), Bytes::from(vec![i as u8; 100]), 10 + i)).collect(),
    };
    let section = crate::storage::encode_state_checkpoint(&commits).unwrap();
    let mut head = vec![STREAM_STATE_VERSION];
    head.extend_from_slice(&77u64.to_be_bytes());
    head.extend_from_slice(&2u32.to_be_bytes());
    for op in [snap("a", 4), snap("b", 11)] {
        let e = op.encode();
        head.extend_from_slice(&(e.len() as u32).to_be_bytes());
        head.extend_from_slice(&e);
    }
    let mut with = head.clone();
    with.push(STREAM_STATE_COMMITS);
    with.extend_from_slice(&(section.len() as u32).to_be_bytes());
    with.extend_from_slice(&section);
    let in_pieces = |bytes: &[u8], size: usize| {
        let mut r = StreamStateReader::default();
        for p in bytes.chunks(size.max(1)) {
            r.feed(p);
        }
        r.finish()
    };
    for state in [&head, &with] {
        let whole = decode_stream_state(state);
        assert!(whole.is_some());
        for size in [1, 2, 7, 13, 64, 300, state.len()] {
            assert_eq!(in_pieces(state, size), whole, "pieces of {size}");
        }
    }
    let (_, _, read) = in_pieces(&with, 9).unwrap();
    let state = Bytes::from(with.clone());
    assert!(read.unwrap().values.iter().all(|(_, v, _)| !crate::broker::tests::within(v, &state)));
    for cut in 0..with.len() {
        // (Cut right after the groups, it is a whole state without commits.)
        assert_eq!(in_pieces(&with[..cut], 5), decode_stream_state(&with[..cut]), "cut {cut}");
        assert_eq!(in_pieces(&with[..cut], 5).is_some(), cut == head.len(), "cut {cut}");
    }
    let mut longer = with.clone();
    longer.push(0);
    assert_eq!(in_pieces(&longer, 50), None, "a byte after the section");
    let mut flipped = with.clone();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    assert_eq!(in_pieces(&flipped, 50), None, "a damaged section");
    let mut holds = Vec::new();
    for p in with.chunks(3) {
        holds.push(Bytes::copy_from_slice(p));
    }
    assert!(stream_state_holds_commits_in(&holds));
    assert!(!stream_state_holds_commits_in(&[Bytes::from(head)]));
}
