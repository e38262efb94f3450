//! A replicated stream's state as its checkpoints and snapshots carry it, besides its records:
//! its log's last timestamp, its consumer groups' durable state and its commit state (D63);
//! written ([`Broker::replicated_stream_state_head`], [`CommitSection`]), read whole
//! ([`decode_stream_state`]) or a piece at a time from disk ([`StreamStateReader`]).

use super::group::GroupOp;
use super::{Broker, Key};
use crate::storage::{StateCheckpoint, StateCheckpointReader};
use bytes::Bytes;

/// Version of [`Broker::replicated_stream_state_head`]'s bytes.
pub(super) const STREAM_STATE_VERSION: u8 = 1;

/// Tag of the commit-state section of [`Broker::replicated_stream_state_head`]'s bytes (D63).
pub(super) const STREAM_STATE_COMMITS: u8 = 1;

/// The commit-state section of a replicated stream shard's checkpoint (D63), as of the
/// checkpoint: `u8 tag (1)`, `u32 len`, the state's checkpoint encoding. Nothing when the
/// state cannot be encoded (a key over 65,535 bytes), as before it was held unencoded.
#[derive(Debug, Clone)]
pub(crate) struct CommitSection(super::state::FrozenState);

impl CommitSection {
    /// Appends the section, written in place behind its tag and length, the length filled in
    /// after.
    pub(crate) fn encode_into(&self, b: &mut Vec<u8>) {
        let at = b.len();
        b.push(STREAM_STATE_COMMITS);
        b.extend_from_slice(&[0; 4]);
        match self.0.checkpoint_into(b) {
            Some(()) => {
                let len = (b.len() - at - 5) as u32;
                b[at + 1..at + 5].copy_from_slice(&len.to_be_bytes());
            }
            None => b.truncate(at),
        }
    }

    /// [`encode_into`](Self::encode_into)'s bytes handed to `each` in pieces, each value from
    /// where it is: a snapshot's commit section written to disk without encoding the state
    /// whole first.
    pub(crate) fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        let mut head = [STREAM_STATE_COMMITS, 0, 0, 0, 0];
        head[1..].copy_from_slice(&(self.0.encoded_len() as u32).to_be_bytes());
        each(&head);
        self.0.checkpoint_pieces(each);
    }

    /// The bytes [`encode_into`](Self::encode_into) appends, exactly.
    pub(crate) fn encoded_len(&self) -> usize {
        5 + self.0.encoded_len()
    }
}

impl Broker {
    /// What a replicated stream shard's checkpoints carry of its broker's state, up to its
    /// commit state: its log's last timestamp and its groups' durable state. `u8 version (1)`,
    /// `u64 last_timestamp_micros`, `u32 count`, then per group (in name order) `u32 len` + a
    /// checkpoint record ([`GroupOp::Snapshot`]). The commit state's section, the end, is
    /// returned unencoded ([`CommitSection`], sharing the live state's keys and values) when
    /// the shard holds any: a checkpoint keeps it so while it waits for retention, and encodes
    /// it only if it becomes a snapshot.
    pub(super) fn replicated_stream_state_head(&self, k: &Key, shard: u32, b: &mut Vec<u8>) -> Option<CommitSection> {
        b.push(STREAM_STATE_VERSION);
        let ts =
            self.node.streams.get(k).and_then(|e| e.shards.get(shard as usize)).map_or(0, |s| s.log.last_timestamp());
        b.extend_from_slice(&ts.to_be_bytes());
        let mut records: Vec<Bytes> = Vec::new();
        if let Some(groups) = self.node.groups.get(&(k.clone(), shard)) {
            let mut names: Vec<_> = groups.keys().collect();
            names.sort();
            for name in names {
                let state = groups[name].durable.clone();
                records.push(GroupOp::Snapshot { group: name.clone(), state }.encode());
            }
        }
        b.extend_from_slice(&(records.len() as u32).to_be_bytes());
        for r in records {
            b.extend_from_slice(&(r.len() as u32).to_be_bytes());
            b.extend_from_slice(&r);
        }
        // The commit state, when the shard holds any (D63): once retention compacted the log,
        // the commits that wrote it are gone, and a snapshot is the only place it lives. A
        // shard that holds none writes the bytes it always did.
        let sh = self.node.streams.get(k).and_then(|e| e.shards.get(shard as usize))?;
        sh.state.freeze().map(CommitSection)
    }

    /// A replicated shard's replica was restored from a snapshot: its groups become the ones
    /// the snapshot holds, and its timestamps go on from the snapshot's. Bytes that do not
    /// read whole change nothing (an empty state is a snapshot from before groups were
    /// replicated: the log's side entries carry them).
    pub(super) fn restore_replicated_stream(&mut self, k: &Key, shard: u32, state: &Bytes) {
        let Some((ts, ops, commits)) = decode_stream_state(state) else { return };
        self.apply_stream_state(k, shard, ts, ops, commits.map(Restored::Shared));
    }

    /// [`restore_replicated_stream`](Self::restore_replicated_stream) of a state read from disk
    /// a piece at a time ([`StreamStateReader`]): its values were copied out as they came, so
    /// they are kept as they are.
    pub(super) fn restore_replicated_stream_read(&mut self, k: &Key, shard: u32, state: StreamStateReader) {
        let Some((ts, ops, commits)) = state.finish() else { return };
        self.apply_stream_state(k, shard, ts, ops, commits.map(Restored::Owned));
    }

    fn apply_stream_state(&mut self, k: &Key, shard: u32, ts: u64, ops: Vec<GroupOp>, commits: Option<Restored>) {
        if let Some(sh) = self.node.streams.get_mut(k).and_then(|e| e.shards.get_mut(shard as usize)) {
            sh.log.raise_timestamp(ts);
            // (A snapshot without the section leaves the state to the entries, as before D63.)
            match commits {
                Some(Restored::Shared(c)) => sh.state.restore_checkpoint(&c),
                Some(Restored::Owned(c)) => sh.state.restore_checkpoint_owned(c),
                None => {}
            }
        }
        let groups = self.node.groups.entry((k.clone(), shard)).or_default();
        for g in groups.values_mut() {
            g.apply(&GroupOp::Reset);
        }
        for op in ops {
            groups.entry(op.group_name().to_owned()).or_default().apply(&op);
        }
        groups.retain(|_, g| g.exists() || !g.parked.is_empty());
    }
}

/// Reads [`Broker::replicated_stream_state_head`]'s bytes: the last timestamp, the checkpoint
/// records it holds and the commit state (the optional section after them: `u8 1`, `u32`
/// length + [`crate::storage::encode_state_checkpoint`]), or `None` for bytes that are not a
/// whole state (an empty one included). The commit state's values are slices of `state`
/// (its host copies them out once, as it keeps them: a copy here as well held a snapshot's
/// state three times at once while it was installed). Never panics.
pub(crate) fn decode_stream_state(
    state: &Bytes,
) -> Option<(u64, Vec<GroupOp>, Option<crate::storage::StateCheckpoint>)> {
    let (head, section) = stream_state_parts(state)?;
    let section = section.map(|s| state.slice_ref(s));
    let commits = match section {
        Some(s) => Some(crate::storage::decode_state_checkpoint(&s).ok()?),
        None => None,
    };
    Some((head.0, head.1, commits))
}

/// [`decode_stream_state`]'s timestamp and checkpoint records, and where its commit-state
/// section lies in `state` (within it).
#[allow(clippy::type_complexity)]
fn stream_state_parts(state: &[u8]) -> Option<((u64, Vec<GroupOp>), Option<&[u8]>)> {
    match stream_state_head(state).ok()? {
        (ts, ops, None) => Some(((ts, ops), None)),
        // Nothing after the section.
        (ts, ops, Some((start, len))) => (state.len() == start + len).then(|| ((ts, ops), state.get(start..))),
    }
}

/// The head of a stream state at the start of `b`: its timestamp, its checkpoint records and,
/// when the commit-state section's tag and length are in `b`, where the section starts and
/// its length (`None` when `b` ends right after the records: the whole state, or the start of
/// one). `Err(true)`: `b` is the start of a head, cut short; `Err(false)`: not a stream state.
#[allow(clippy::type_complexity)]
fn stream_state_head(b: &[u8]) -> Result<(u64, Vec<GroupOp>, Option<(usize, usize)>), bool> {
    let (&version, mut rest) = b.split_first().ok_or(true)?;
    if version != STREAM_STATE_VERSION {
        return Err(false);
    }
    let mut take = |n: usize| -> Result<&[u8], bool> {
        let (a, after) = rest.split_at_checked(n).ok_or(true)?;
        rest = after;
        Ok(a)
    };
    let word = |w: &[u8]| u32::from_be_bytes([w[0], w[1], w[2], w[3]]);
    let ts = take(8)?.iter().fold(0u64, |v, x| v << 8 | u64::from(*x));
    let count = word(take(4)?);
    // Each record takes at least its length: a count beyond what is left is not an allocation.
    let mut ops = Vec::with_capacity((count as usize).min(b.len() / 4));
    for _ in 0..count {
        let len = word(take(4)?) as usize;
        match GroupOp::decode(take(len)?).ok_or(false)? {
            op @ GroupOp::Snapshot { .. } => ops.push(op),
            _ => return Err(false),
        }
    }
    match take(1) {
        Err(_) => return Ok((ts, ops, None)),
        Ok(&[STREAM_STATE_COMMITS]) => {}
        Ok(_) => return Err(false),
    }
    let len = word(take(4)?) as usize;
    Ok((ts, ops, Some((b.len() - rest.len(), len))))
}

/// [`stream_state_holds_commits`] of a state held in pieces (a received snapshot's chunks):
/// its head gathered until it tells.
pub(crate) fn stream_state_holds_commits_in(pieces: &[Bytes]) -> bool {
    let mut head = Vec::new();
    for p in pieces {
        head.extend_from_slice(p);
        match stream_state_head(&head) {
            Ok((_, _, Some(_))) => return true,
            Err(false) => return false,
            Ok((_, _, None)) | Err(true) => {}
        }
    }
    false
}

/// Whether a replicated stream's checkpoint state (as [`decode_stream_state`] reads it) holds
/// a commit-state section (D63), found by its lengths alone: nothing is decoded or copied.
pub(crate) fn stream_state_holds_commits(state: &[u8]) -> bool {
    let walk = || -> Option<bool> {
        let (&version, rest) = state.split_first()?;
        if version != STREAM_STATE_VERSION {
            return None;
        }
        let (_ts, rest) = rest.split_at_checked(8)?;
        let (count, mut rest) = rest.split_at_checked(4)?;
        for _ in 0..u32::from_be_bytes(count.try_into().ok()?) {
            let (len, after) = rest.split_at_checked(4)?;
            rest = after.get(u32::from_be_bytes(len.try_into().ok()?) as usize..)?;
        }
        Some(rest.first() == Some(&STREAM_STATE_COMMITS))
    };
    walk().unwrap_or(false)
}

/// A commit state restored: sliced out of a snapshot's data in hand (its values are copied out
/// as they are kept), or read from disk a piece at a time (each value already a copy of its own).
enum Restored {
    Shared(StateCheckpoint),
    Owned(StateCheckpoint),
}

/// [`decode_stream_state`] of a state handed over a piece at a time, as a follower reads the
/// snapshot it installed back from disk: the head (timestamp, checkpoint records) is gathered
/// whole, then the commit-state section is read as it comes ([`StateCheckpointReader`]),
/// each value copied out once and the piece it came in let go.
///
/// Why: holding the snapshot's data whole while the state was built from it kept the state
/// in memory twice at the peak of the install.
#[derive(Debug, Default)]
pub(crate) struct StreamStateReader {
    /// The bytes so far, until the head is whole (all of them for a state with no section).
    head: Vec<u8>,
    /// The head, once whole, with the section's bytes still to come.
    found: Option<(u64, Vec<GroupOp>, usize)>,
    section: StateCheckpointReader,
    /// The bytes do not read as a state: nothing is restored.
    failed: bool,
}

impl StreamStateReader {
    /// Takes the next bytes of the state.
    pub(crate) fn feed(&mut self, piece: &[u8]) {
        if self.failed {
            return;
        }
        if self.found.is_some() {
            return self.feed_section(piece);
        }
        self.head.extend_from_slice(piece);
        match stream_state_head(&self.head) {
            Err(true) | Ok((_, _, None)) => {}
            Err(false) => self.fail(),
            Ok((ts, ops, Some((start, len)))) => {
                self.found = Some((ts, ops, len));
                let head = std::mem::take(&mut self.head);
                self.feed_section(head.get(start..).unwrap_or_default());
            }
        }
    }

    fn feed_section(&mut self, b: &[u8]) {
        let Some((_, _, left)) = self.found.as_mut() else { return };
        match left.checked_sub(b.len()) {
            Some(l) if self.section.feed(b).is_ok() => *left = l,
            _ => self.fail(),
        }
    }

    fn fail(&mut self) {
        *self = StreamStateReader { failed: true, ..StreamStateReader::default() };
    }

    /// Bytes it holds besides the values read (the head gathered, an item cut by a piece's
    /// end).
    pub(crate) fn held(&self) -> usize {
        self.head.capacity() + self.section.held()
    }

    /// The state, once every byte was fed: as [`decode_stream_state`] reads the same bytes
    /// whole (`None` for bytes that are not a whole state).
    #[allow(clippy::type_complexity)]
    pub(crate) fn finish(self) -> Option<(u64, Vec<GroupOp>, Option<StateCheckpoint>)> {
        if self.failed {
            return None;
        }
        match self.found {
            None => match stream_state_parts(&self.head)? {
                ((ts, ops), None) => Some((ts, ops, None)),
                // (A section would have been found as the head was fed.)
                ((_, _), Some(_)) => None,
            },
            Some((ts, ops, 0)) => Some((ts, ops, Some(self.section.finish().ok()?))),
            Some(_) => None,
        }
    }
}

#[cfg(test)]
mod tests;
