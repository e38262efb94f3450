//! Installing a replicated shard's snapshot makes no copy of the host's state (a replicated
//! cache's values, a stream's commit state, as large as they are): it is handed over where the
//! snapshot's data holds it, whether the snapshot came from the leader or from the replica's
//! own log at a restart. Checked by where the bytes handed over live.

use bytes::Bytes;
use felix_proto::cluster::meta::{RaftLog, Snapshot};
use felix_proto::cluster::replica::{Replica, ReplicaOutput};
use felix_proto::shard::replicated::ReplicatedBatch;
use raft::eraftpb::{Message, MessageType};
use std::collections::VecDeque;

/// Whether `part` lies within `whole`'s memory.
fn within(part: &[u8], whole: &[u8]) -> bool {
    let (p, w) = (part.as_ptr() as usize, whole.as_ptr() as usize);
    p >= w && p + part.len() <= w + whole.len()
}

/// The host's state in this test.
const STATE: usize = 1 << 20;

/// Three replicas; `cut` drops every message to or from replica 3.
struct Group {
    replicas: Vec<Replica>,
    cut: bool,
    state: Bytes,
    snapshots: Vec<Snapshot>,
}

impl Group {
    fn settle(&mut self) {
        let mut queue: VecDeque<(u64, Message)> = VecDeque::new();
        loop {
            for r in &mut self.replicas {
                while let Some(o) = r.poll_output() {
                    match o {
                        ReplicaOutput::Send { to, message } => queue.push_back((to, message)),
                        ReplicaOutput::CheckpointDue { index } => r.complete_checkpoint(index, &self.state),
                        ReplicaOutput::PersistSnapshot { snapshot, .. } if r.id() == 1 => self.snapshots.push(snapshot),
                        _ => {}
                    }
                }
            }
            let Some((to, m)) = queue.pop_front() else { return };
            if self.cut && (to == 3 || m.from == 3) {
                continue;
            }
            self.replicas[to as usize - 1].step(m);
        }
    }

    fn tick(&mut self) {
        for r in &mut self.replicas {
            r.tick();
        }
        self.settle();
    }
}

fn restored(r: &mut Replica) -> Option<Bytes> {
    std::iter::from_fn(|| r.poll_output()).find_map(|o| match o {
        ReplicaOutput::Restored { state, .. } => Some(state),
        _ => None,
    })
}

#[test]
fn a_snapshot_is_installed_and_restored_without_a_copy_of_the_hosts_state() {
    let empty = RaftLog::default();
    let replicas = (1..=3)
        .map(|id| {
            // Replica 1 campaigns first (rank 0), so the leader is known.
            let mut r = Replica::new_hosting(id, &[1, 2, 3], &empty, Some(id as usize - 1), true).expect("replica");
            r.set_checkpoint_bytes(1);
            r
        })
        .collect();
    let mut g = Group { replicas, cut: true, state: Bytes::from(vec![7u8; STATE]), snapshots: Vec::new() };
    for _ in 0..200 {
        if g.replicas[0].is_leader() {
            break;
        }
        g.tick();
    }
    assert!(g.replicas[0].is_leader(), "replica 1 leads");
    // Replica 3 is cut off while the other two commit and replica 1 compacts its log.
    for token in 1..=3u64 {
        let b = ReplicatedBatch::from_payloads(None, &[Bytes::from(format!("x{token}"))]);
        g.replicas[0].propose(token, &b).expect("leads");
        g.settle();
    }
    assert!(g.replicas[0].compact_below(u64::MAX), "the leader compacts");
    g.settle();
    let snapshot = g.snapshots.last().cloned().expect("a snapshot");
    assert!(snapshot.get_data().len() > STATE, "it holds the host's state");

    // Replica 3 comes back behind the compaction: the leader sends it the snapshot. The engine
    // keeps the message's data; nothing else may copy it.
    g.cut = false;
    let mut sent = None;
    for _ in 0..50 {
        for r in &mut g.replicas {
            r.tick();
        }
        let mut queue = VecDeque::new();
        for r in &mut g.replicas {
            while let Some(o) = r.poll_output() {
                if let ReplicaOutput::Send { to, message } = o {
                    queue.push_back((to, message));
                }
            }
        }
        for (to, m) in queue {
            if to == 3 && m.get_msg_type() == MessageType::MsgSnapshot {
                sent = Some(m);
            } else {
                g.replicas[to as usize - 1].step(m);
            }
        }
        if sent.is_some() {
            break;
        }
    }
    let sent = sent.expect("the leader sends replica 3 its snapshot");
    let data = sent.get_snapshot().data.clone();
    let follower = &mut g.replicas[2];
    follower.step(sent);
    let state = restored(follower).expect("replica 3 restores the snapshot");
    assert_eq!(state, g.state, "the host's state comes back whole");
    assert!(within(&state, &data), "handed over where the message holds it, not copied");

    // A restart from a log whose snapshot holds the state: read, not copied again.
    let kept = RaftLog { snapshot: Some(snapshot), ..RaftLog::default() };
    let mut again = Replica::new_hosting(1, &[1, 2, 3], &kept, None, true).expect("restart");
    let state = restored(&mut again).expect("restored at the restart");
    assert_eq!(state, g.state);
    let kept_data = &kept.snapshot.as_ref().expect("kept").data;
    assert!(within(&state, kept_data), "handed over where the kept snapshot holds it, not copied");
}
