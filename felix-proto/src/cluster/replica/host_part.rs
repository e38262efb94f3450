//! A host's part of a replica's checkpoints and snapshots, kept unencoded ([`HostPart`],
//! [`SnapshotRest`]).

use super::*;

/// The end of a host's state as of a checkpoint, held in a form that shares memory with the
/// host's live state (e.g. a commit state's keys and values) and encoded only when the
/// checkpoint is compacted into a snapshot.
///
/// Why: a stream's checkpoint waits for retention to pass its records before the log can be
/// compacted to it, which takes as long as the retention window. Encoded when taken, it held
/// the whole state a second time all that while; a view that shares the live state's values
/// holds only what changed since. A cache's checkpoint is compacted to at once, but encoded
/// it was the whole cache a second time at each compaction.
///
/// With the snapshot on disk by reference ([`Replica::set_snapshot_by_reference`]) it is not
/// encoded into the snapshot's data at all: it goes out beside it ([`SnapshotRest`]) and is
/// written to disk piece by piece ([`encode_pieces`](Self::encode_pieces)), so the state is
/// never whole in memory a second time at compaction either.
pub trait HostPart: std::fmt::Debug + Send + Sync {
    /// Appends its encoded bytes, the end of the snapshot's data.
    fn encode_into(&self, out: &mut Vec<u8>);
    /// How many bytes [`encode_into`](Self::encode_into) appends, exactly: what the
    /// checkpoint stands for, counted against [`MAX_CHECKPOINT_MEMORY`] as if it were
    /// encoded (a value the live state overwrote since is held by the view alone), and the
    /// length a snapshot record written piece by piece declares before its pieces.
    fn encoded_len(&self) -> usize;
    /// Hands its encoded bytes to `each`, in order, in pieces (the same bytes as
    /// [`encode_into`](Self::encode_into)); by default encoded whole and handed over once.
    fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        let mut b = Vec::with_capacity(self.encoded_len());
        self.encode_into(&mut b);
        each(&b);
    }
    /// Whether it is state a peer from before commit state must not be sent (a stream's
    /// commit state, D63); by default, as every part was one before caches had parts.
    fn holds_commits(&self) -> bool {
        true
    }
}

/// The end of a snapshot's data, still unencoded (a host's part: a stream's commit state, a
/// cache's values), beside a [`ReplicaOutput::PersistSnapshot`]: the snapshot's data is its
/// `data` followed by these bytes. Whoever persists it writes them piece by piece
/// ([`crate::cluster::meta::write_snapshot_record`]); a keeper of snapshots in memory puts
/// them together ([`SnapshotRest::append_to`]).
#[derive(Clone)]
pub struct SnapshotRest(pub(super) std::sync::Arc<dyn HostPart>);

impl SnapshotRest {
    /// A host's part, to go beside a snapshot.
    pub fn new(part: std::sync::Arc<dyn HostPart>) -> SnapshotRest {
        SnapshotRest(part)
    }

    /// Its length in bytes.
    pub fn len(&self) -> u64 {
        self.0.encoded_len() as u64
    }

    /// Whether it has no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Whether it holds a stream's commit state ([`HostPart::holds_commits`]).
    pub fn holds_commits(&self) -> bool {
        !self.is_empty() && self.0.holds_commits()
    }

    /// Hands its bytes to `each`, in order, in pieces.
    pub fn pieces(&self, each: &mut dyn FnMut(&[u8])) {
        self.0.encode_pieces(each)
    }

    /// Puts it at the end of `snapshot`'s data (whole in memory: for simulations and tests).
    pub fn append_to(&self, snapshot: &mut Snapshot) {
        let mut data = Vec::with_capacity(snapshot.data.len() + self.len() as usize);
        data.extend_from_slice(&snapshot.data);
        self.0.encode_into(&mut data);
        snapshot.set_data(data.into());
    }
}

impl std::fmt::Debug for SnapshotRest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SnapshotRest({} bytes)", self.len())
    }
}

impl PartialEq for SnapshotRest {
    fn eq(&self, other: &SnapshotRest) -> bool {
        std::sync::Arc::ptr_eq(&self.0, &other.0)
    }
}
