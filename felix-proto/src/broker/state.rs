//! Atomic commits (`commit`, `state_get`; FEATURE_ATOMIC_COMMIT): an event and the state
//! changes it makes, as one record of a durable shard.
//!
//! Why it is one record: the event and its state changes travel to storage in one batch
//! (the state in the batch's state section), so a crash keeps both or neither, and the changes
//! are applied to the shard's state in the same step that makes the event visible to readers
//! (when storage confirms the write), so no reader sees one without the other. `state_get`
//! reads that state: `version` is the offset of the commit that wrote the value, `as_of` the
//! offset of the last commit applied.
//!
//! The state is rebuilt at start from a checkpoint and the commits after it. Retention of a
//! shard that holds state first hands storage a checkpoint of the whole state (with its
//! `Truncate`), which storage keeps on disk before it deletes the segments whose commits wrote
//! it; recovery restores the checkpoint and replays only the commits after its `as_of` (older
//! ones, still in segments retention has not reached, are skipped by their offsets). A
//! replicated stream's state rides in its replicas' checkpoints (Raft snapshots) instead, and
//! such a shard is compacted only while every member reads it there (D63).

use super::*;
use crate::binary::Records;
use crate::error_code::ErrorCode;
use crate::message::{self, Message, StateChange as WireChange};
use crate::routing::shard_for_key;
use crate::storage::{StateChange, StateCheckpoint, decode_state_changes, encode_state_changes};
use crate::transport::ConnId;
use bytes::Bytes;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

/// How often, at most, a write's truncation hands storage the state (the sweep may sooner).
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_secs(1);

/// One shard's state: key → (value, offset of the commit that wrote it).
#[derive(Debug, Default)]
pub(super) struct ShardState {
    /// Keys are shared (`Arc<str>`) and values are immutable `Bytes` of their own, so a
    /// replicated shard's checkpoint can hold the state as it was ([`FrozenState`]) without a
    /// copy of either.
    values: BTreeMap<Arc<str>, (Bytes, u64)>,
    /// Offset of the last commit applied.
    as_of: Option<u64>,
    /// The log's start when the state was last handed to storage as a checkpoint, and when.
    checkpointed_at: u64,
    checkpointed_when: Option<Instant>,
}

impl ShardState {
    /// Applies a commit's changes, made at `offset`.
    pub(super) fn apply(&mut self, offset: u64, changes: &[StateChange]) {
        for (key, value) in changes {
            match value {
                Some(v) => {
                    let value = (owned(v), offset);
                    match self.values.get_mut(key.as_str()) {
                        Some(kept) => *kept = value,
                        None => {
                            self.values.insert(key.as_str().into(), value);
                        }
                    }
                }
                None => {
                    self.values.remove(key.as_str());
                }
            }
        }
        self.as_of = Some(self.as_of.map_or(offset, |a| a.max(offset)));
    }

    /// Applies a stored commit batch (recovery, a move's copy). Undecodable state was refused
    /// when the segment was read, so nothing is skipped silently here; a commit at or below
    /// `as_of` is already part of the state (a checkpoint holds it) and changes nothing.
    pub(super) fn apply_stored(&mut self, b: &crate::storage::StoredBatch) {
        if self.as_of.is_some_and(|a| b.base_offset <= a) {
            return;
        }
        if let Some(changes) = b.state.as_ref().and_then(|s| decode_state_changes(s).ok()) {
            self.apply(b.base_offset, &changes);
        }
    }

    /// The value `key` holds.
    #[cfg(any(test, feature = "testkit"))]
    pub(super) fn peek(&self, key: &str) -> Option<&Bytes> {
        self.values.get(key).map(|(v, _)| v)
    }

    /// Whether any commit was applied (retention then checkpoints the state first).
    pub(super) fn holds_state(&self) -> bool {
        self.as_of.is_some()
    }

    /// The state as a checkpoint for a truncation to `start`, when it holds any and retention
    /// moved the start since the last one, at most once a second unless `now_anyway`: storage
    /// deletes no segment holding a commit its checkpoint on disk does not hold, so this need
    /// not come with every truncation (every write moves the start of a full stream).
    pub(super) fn due_checkpoint(&mut self, start: u64, now: Instant, now_anyway: bool) -> Option<Bytes> {
        if start <= self.checkpointed_at {
            return None;
        }
        let recent = self.checkpointed_when.is_some_and(|t| now.saturating_duration_since(t) < CHECKPOINT_EVERY);
        if recent && !now_anyway {
            return None;
        }
        let c = self.checkpoint()?;
        self.checkpointed_at = start;
        self.checkpointed_when = Some(now);
        Some(c)
    }

    /// Retention moved the start to `start` since the state was last handed to storage.
    pub(super) fn checkpoint_owed(&self, start: u64) -> bool {
        self.holds_state() && start > self.checkpointed_at
    }

    /// The whole state as a checkpoint, encoded ([`crate::storage::encode_state_checkpoint`]);
    /// `None` while no commit was applied.
    pub(super) fn checkpoint(&self) -> Option<Bytes> {
        let mut out = Vec::new();
        self.checkpoint_into(&mut out)?;
        Some(out.into())
    }

    /// [`checkpoint`](Self::checkpoint) appended to `out`, the values copied once, into it;
    /// `None` (and `out` as it was) when it holds no state.
    pub(super) fn checkpoint_into(&self, out: &mut Vec<u8>) -> Option<()> {
        let as_of = self.as_of?;
        let values = self.values.iter().map(|(k, (v, version))| (&**k, v.as_ref(), *version));
        crate::storage::encode_state_checkpoint_into(as_of, values, out)
    }

    /// The state as it is now, sharing its keys and values (nothing copied): what a replicated
    /// shard's checkpoint keeps until it becomes a snapshot. `None` while no commit was applied.
    /// `None` too for a state that cannot be encoded (a key over 65,535 bytes: commits refuse
    /// them), so a frozen state's length is exact.
    pub(super) fn freeze(&self) -> Option<FrozenState> {
        let as_of = self.as_of?;
        let mut encoded_len = 20;
        let mut fits = u32::try_from(self.values.len()).is_ok();
        let values = self
            .values
            .iter()
            .map(|(k, (v, version))| {
                encoded_len += 14 + k.len() + v.len();
                fits &= k.len() <= usize::from(u16::MAX) && u32::try_from(v.len()).is_ok();
                (k.clone(), v.clone(), *version)
            })
            .collect();
        fits.then_some(FrozenState { as_of, values, encoded_len })
    }

    /// The state a checkpoint holds, replacing this one's. Commits after its `as_of` are then
    /// applied on top; older ones are skipped ([`apply_stored`](Self::apply_stored)).
    pub(super) fn restore_checkpoint(&mut self, c: &StateCheckpoint) {
        self.values = c.values.iter().map(|(k, v, version)| (k.as_str().into(), (owned(v), *version))).collect();
        self.as_of = Some(c.as_of);
    }

    /// [`restore_checkpoint`](Self::restore_checkpoint) of a checkpoint whose values are
    /// allocations of their own already (read from disk a piece at a time,
    /// [`crate::storage::StateCheckpointReader`]): kept as they are, not copied again.
    pub(super) fn restore_checkpoint_owned(&mut self, c: StateCheckpoint) {
        self.values = c.values.into_iter().map(|(k, v, version)| (Arc::from(k), (v, version))).collect();
        self.as_of = Some(c.as_of);
    }
}

/// A shard's commit state as of one point ([`ShardState::freeze`]): its keys and values shared
/// with the live state, in key order. A value the live state overwrites or deletes later stays
/// here, so it encodes the state as it was, byte for byte what
/// [`ShardState::checkpoint_into`] wrote then.
#[derive(Debug, Clone)]
pub(crate) struct FrozenState {
    as_of: u64,
    values: Vec<(Arc<str>, Bytes, u64)>,
    encoded_len: usize,
}

impl FrozenState {
    /// Appends the state's checkpoint encoding (as [`ShardState::checkpoint_into`]); `None`
    /// (and `out` as it was) when it cannot be encoded (a key over 65,535 bytes).
    pub(crate) fn checkpoint_into(&self, out: &mut Vec<u8>) -> Option<()> {
        let values = self.values.iter().map(|(k, v, version)| (&**k, v.as_ref(), *version));
        crate::storage::encode_state_checkpoint_into(self.as_of, values, out)
    }

    /// [`checkpoint_into`](Self::checkpoint_into)'s bytes handed to `each` in pieces, the
    /// values from where they are ([`crate::storage::encode_state_checkpoint_pieces`]).
    pub(crate) fn checkpoint_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        let values = self.values.iter().map(|(k, v, version)| (&**k, v.as_ref(), *version));
        // (`freeze` made only states that encode.)
        let _ = crate::storage::encode_state_checkpoint_pieces(self.as_of, values, each);
    }

    /// The bytes [`checkpoint_into`](Self::checkpoint_into) appends, exactly.
    pub(crate) fn encoded_len(&self) -> usize {
        self.encoded_len
    }
}

impl Broker {
    pub(super) fn commit(&mut self, conn: ConnId, st: &mut CtlStream, c: message::Commit, now: Instant) {
        self.stats.publishes_json += 1;
        let reply = Reply::Commit(c.request_id);
        let changes: Vec<StateChange> = c
            .changes
            .into_iter()
            .map(|ch| match ch {
                WireChange::Put { key, value } => (key, Some(value.0)),
                WireChange::Delete { key } => (key, None),
            })
            .collect();
        let Some(state) = encode_state_changes(&changes) else {
            let r = Refusal::new(ErrorCode::InvalidRequest, "a state key is longer than 65535 bytes");
            return self.answer_now(conn, st, reply, Err(&r));
        };
        // Names, permission (a commit writes: publish), the shard (explicit, or by entity key).
        let shards =
            match self.lookup_stream(st, &c.tenant_id, &c.namespace, &c.stream, Action::Publish, Missing::Create) {
                Ok(n) => n,
                Err(r) => return self.answer_now(conn, st, reply, Err(&r)),
            };
        // Owner-only and never forwarded: a shard owned elsewhere is a redirect.
        if let Some(entry) = self.node.streams.get(KeyRef(&c.tenant_id, &c.namespace, &c.stream).q()) {
            let shard = c.shard.unwrap_or_else(|| shard_for_key(Some(&c.entity_key.0), shards, entry.config.routing));
            if let Some(m) = entry.shards.get(shard as usize).and_then(|s| s.serving.away()) {
                let msg = Self::not_leader_answer(self.server_features, &Self::features_of(st), m, shard);
                return self.send(conn, st, json_frame(&msg));
            }
        }
        let durable =
            self.node.streams.get(KeyRef(&c.tenant_id, &c.namespace, &c.stream).q()).is_some_and(|e| e.config.durable);
        if !durable {
            let r = Refusal::new(
                ErrorCode::InvalidRequest,
                "commit needs a durable stream: its state lives in the stream's log",
            );
            return self.answer_now(conn, st, reply, Err(&r));
        }
        let Ok(records) = Records::from_payloads([c.event.0]) else {
            let r = Refusal::new(ErrorCode::InvalidRequest, "the event does not fit a record");
            return self.answer_now(conn, st, reply, Err(&r));
        };
        let req = PublishReq {
            tenant_id: c.tenant_id,
            namespace: c.namespace,
            stream: c.stream,
            key: Some(c.entity_key.0),
            shard: c.shard,
            width: None,
            records,
            idempotent: None,
            expected_offset: c.expected_offset,
            state: Some(state),
        };
        self.publish(conn, st, req, reply, now);
    }

    pub(super) fn state_get(&mut self, conn: ConnId, st: &mut CtlStream, g: message::StateGet) {
        let shards =
            match self.lookup_stream(st, &g.tenant_id, &g.namespace, &g.stream, Action::Subscribe, Missing::NotFound) {
                Ok(n) => n,
                Err(r) => return self.refuse(conn, st, r),
            };
        let Some(entry) = self.node.streams.get(KeyRef(&g.tenant_id, &g.namespace, &g.stream).q()) else { return };
        let shard = match g.shard {
            Some(s) if s >= shards => {
                let r = Refusal::new(ErrorCode::InvalidRequest, format!("stream has no shard {s} (it has {shards})"));
                return self.refuse(conn, st, r);
            }
            Some(s) => s,
            None => shard_for_key(Some(&g.entity_key.0), shards, entry.config.routing),
        };
        let sh = &entry.shards[shard as usize];
        if let Some(m) = sh.serving.away() {
            let msg = Self::not_leader_answer(self.server_features, &Self::features_of(st), m, shard);
            return self.send(conn, st, json_frame(&msg));
        }
        let found = sh.state.values.get(g.key.as_str());
        let m = Message::StateValue(message::StateValue {
            value: found.map(|(v, _)| message::B64(v.clone())),
            version: found.map(|(_, o)| *o),
            as_of: sh.state.as_of,
            request_id: g.request_id,
        });
        self.send(conn, st, json_frame(&m));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A write's truncation hands the state over at most once a second, the sweep at once, and
    /// neither while the start stayed where the last checkpoint was taken.
    #[test]
    fn the_state_goes_to_storage_at_most_once_a_second_from_writes() {
        let t0 = crate::transport::test_epoch();
        let at = |ms| t0 + std::time::Duration::from_millis(ms);
        let mut s = ShardState::default();
        assert_eq!(s.due_checkpoint(5, t0, true), None, "no state, no checkpoint");
        s.apply(3, &[("k".into(), Some(Bytes::from_static(b"v")))]);
        let c = s.due_checkpoint(5, t0, false).expect("the first one");
        let c = crate::storage::decode_state_checkpoint(&c).unwrap();
        assert_eq!((c.as_of, c.values.len()), (3, 1));
        assert_eq!(s.due_checkpoint(5, at(2_000), true), None, "the start did not move");
        assert_eq!(s.due_checkpoint(6, at(500), false), None, "a write within the second");
        assert!(s.checkpoint_owed(6), "owed: the broker asks for its sweep");
        assert!(s.due_checkpoint(6, at(500), true).is_some(), "the sweep at once");
        assert!(!s.checkpoint_owed(6));
        assert_eq!(s.due_checkpoint(7, at(1_400), false), None);
        assert!(s.due_checkpoint(7, at(1_500), false).is_some(), "a write a second later");
    }

    /// A frozen state shares the live state's keys and values (nothing copied) and encodes the
    /// state as it was when frozen, byte for byte, whatever the live state did since:
    /// overwrote a key, deleted one, added one.
    #[test]
    fn a_frozen_state_shares_its_values_and_encodes_the_state_as_it_was() {
        let mut s = ShardState::default();
        assert!(s.freeze().is_none(), "no commit applied, nothing to freeze");
        let put = |k: &str, v: &[u8]| (k.to_owned(), Some(Bytes::copy_from_slice(v)));
        s.apply(3, &[put("a", &[1; 4096]), put("b", b"two"), put("c", b"three")]);
        s.apply(4, &[put("b", b"2")]);
        let mut then = Vec::new();
        s.checkpoint_into(&mut then).expect("encodes");
        let frozen = s.freeze().expect("holds state");
        for (key, (value, _)) in &s.values {
            let (k, v, _) = frozen.values.iter().find(|(k, _, _)| k == key).expect("every key");
            assert!(Arc::ptr_eq(k, key), "{key}: the key is shared");
            assert_eq!(v.as_ptr(), value.as_ptr(), "{key}: the value is shared");
        }
        assert_eq!(frozen.encoded_len(), then.len(), "its size is the encoding's");
        s.apply(5, &[put("a", b"new"), (String::from("c"), None), put("d", b"four")]);
        let mut later = Vec::new();
        frozen.checkpoint_into(&mut later).expect("encodes");
        assert_eq!(later, then, "the state as it was when frozen");
        let c = crate::storage::decode_state_checkpoint(&Bytes::from(later.clone())).expect("reads");
        assert_eq!(c.as_of, 4);
        let long = "k".repeat(70_000);
        s.apply(6, &[(long, Some(Bytes::from_static(b"v")))]);
        assert!(s.freeze().is_none(), "a key too long to encode: no frozen state claims a length it cannot give");
        let mut pieces = Vec::new();
        frozen.checkpoint_pieces(&mut |p| pieces.extend_from_slice(p));
        assert_eq!(pieces, then, "in pieces, the same bytes");
    }

    /// A value the state keeps does not keep the buffer it arrived in (a commit's encoded
    /// changes, a peer frame, a segment read at a restart): it is copied out, so what the state
    /// holds is what it counts.
    #[test]
    fn kept_values_do_not_keep_the_buffer_they_came_in() {
        let buffer = Bytes::from(vec![7u8; 64 << 10]);
        let inside = |v: &Bytes| super::super::tests::within(v, &buffer);
        let mut s = ShardState::default();
        s.apply(3, &[("k".into(), Some(buffer.slice(100..110)))]);
        let (v, version) = &s.values["k"];
        assert_eq!((&v[..], *version), (&[7u8; 10][..], 3));
        assert!(!inside(v), "applied: copied out of the commit's buffer");
        let c = StateCheckpoint { as_of: 9, values: vec![("j".into(), buffer.slice(5..9), 8)] };
        s.restore_checkpoint(&c);
        let (v, version) = &s.values["j"];
        assert_eq!((&v[..], *version), (&[7u8; 4][..], 8));
        assert!(!inside(v), "restored: copied out of the checkpoint's buffer");
    }
}
