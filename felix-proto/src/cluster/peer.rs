//! What brokers of a cluster say to each other on the cluster transport, and its bytes. The
//! transport is QUIC on a listener of its own (never the client listener); this module is its
//! sans-IO codec: [`encode`] a [`PeerMessage`], feed received bytes to a [`PeerDecoder`].
//!
//! ```text
//! frame: u32 body_len, u8 kind, body
//!   1 hello          u16+utf8 cluster, u16+utf8 node_id, u16+utf8 secret
//!                    [, u16+utf8 incarnation: absent from a broker that keeps none
//!                    [, u64 features: absent from a broker older than them]]
//!   2 raft           a Raft message (protobuf, `meta::encode_message`), to the end
//!   3 forward        u64 id, u16+utf8 tenant, namespace, stream, u32 shard, u64 generation,
//!                    u8 flags (0x1 acked; with [`FEATURE_BATCH_META`] 0x2 key, 0x4 envelope,
//!                    0x8 compressed), u8 publisher_len + publisher, u16 key_len + key (0x2),
//!                    u16 envelope_len + envelope (0x4), then to the end u32 count + records,
//!                    or with 0x8 u8 codec (1 zstd, 2 lz4), u32 count, u32 raw_len, the
//!                    compressed block
//!   4 forward_answer u64 id, u8 status; 0 appended: u8 has_offset, u64 offset;
//!                    1 refused: u16 code, u8 retry, u16+utf8 message
//!   5 propose        a metadata command (JSON) for the leader to propose, to the end
//!   6 request        u64 id, u16+utf8 tenant, u8 principal_len + principal, u16 flags,
//!                    u64 features, the request (one client JSON frame) to the end
//!   7 request_answer u64 id, the answer (client frames, built for the client) to the end
//!   8 shard_raft     u32 count, then per message: u8 kind (0 stream, 1 cache),
//!                    u16+utf8 tenant, namespace, name, u32 shard, u32 len + a Raft message
//!                    of that shard's group (every group's messages to one peer in one frame)
//!   9 heartbeats     u16 names, each u8 kind (0 stream, 1 cache), u16+utf8 tenant,
//!                    namespace, name; u32 count, each u16 name index, u32 shard,
//!                    u8 type (0 heartbeat, 1 response), u64 term, u64 commit: the shard
//!                    groups' heartbeats to one peer, coalesced (sent only to a peer whose
//!                    hello offered [`FEATURE_COALESCED_HEARTBEATS`])
//!  10 copy_request   u16+utf8 tenant, namespace, stream, u32 shard, u8 has_from, u64 from,
//!                    u32 max_bytes: a moving shard's new owner asks the old one for its
//!                    records from `from` (none yet: from its start)
//!  11 copy_answer    u16+utf8 tenant, namespace, stream, u32 shard, u8 status;
//!                    0: u64 start, u64 tail, u8 cutting, then stored batches (the segment
//!                    format, `storage::encode_batch`) to the end; 1 refused: u16+utf8 message;
//!                    2 (only to a peer whose hello offered [`FEATURE_COMMIT_STATE`]): as 0 with
//!                    u32 len + the shard's commit state (`storage::encode_state_checkpoint`)
//!                    after `cutting`; bit 0x4 (only to a peer whose hello offered
//!                    [`FEATURE_GROUP_COPY`], D65): u32 count + (u32 len + a `$groups`
//!                    record) each, after the state, the shard's consumer groups (status 4,
//!                    or 6 with the state)
//!                    (10 and 11 only to a peer whose hello offered [`FEATURE_SHARD_COPY`])
//!  12 cache_copy_request  as 10, for a cache (u16+utf8 tenant, namespace, cache, u32 shard,
//!                    u8 has_from, u64 from, u32 max_bytes): `from` is the cache-log offset
//!                    the new owner holds everything below (none yet: the whole cache)
//!  13 cache_copy_answer   u16+utf8 tenant, namespace, cache, u32 shard, u8 status;
//!                    0: u64 tail (the offset its next change takes), u8 cutting, u8 full,
//!                    u32 count, each u32 len + a cache record (the system log's format:
//!                    put, remove, or reset first when `full`), u32 count, each u32 len + a
//!                    counter record (reset, then every counter's value); 1 refused:
//!                    u16+utf8 message
//!                    (12 and 13 only to a peer whose hello offered [`FEATURE_CACHE_COPY`])
//!  14 snapshot_chunk u8 kind (0 stream, 1 cache), u16+utf8 tenant, namespace, name,
//!                    u32 shard, u64 index, u64 term (the snapshot's), u64 total (its data's
//!                    length), u64 offset (of this chunk's data in it), u32 len + the Raft
//!                    `MsgSnapshot` with empty data (in the chunk at offset 0 only; else 0),
//!                    then this chunk's data to the end: a shard group's snapshot too large
//!                    for one frame, in order (only to a peer whose hello offered
//!                    [`FEATURE_SNAPSHOT_CHUNKS`])
//!  15 forward_batch  u32 count (2 or more), then per publish u32 len + a `forward` body
//!                    (kind 3's, as above): the publishes forwarded to one owner meanwhile,
//!                    in one frame (only to a peer whose hello offered
//!                    [`FEATURE_FORWARD_BATCH`]; a single one goes as kind 3)
//!  16 forward_answers u32 count (2 or more), then per answer u32 len + a `forward_answer`
//!                    body (kind 4's): the answers to one origin meanwhile, in one frame (only
//!                    to a peer whose hello offered [`FEATURE_FORWARD_BATCH`])
//! ```
//!
//! Hibernation ([`FEATURE_HIBERNATION`]) adds no kind: a settled group's leader sends each
//! follower a `shard_raft` heartbeat with the context `felix:quiet` and stops ticking the
//! group; a follower holding the whole log stops too. Any other message of the group wakes
//! it; so does its leader's broker going silent (every broker sends each peer that offered
//! the bit an empty `heartbeats` every heartbeat interval).
//!
//! The first frame on a connection must be `hello` with the cluster's name and secret; a peer
//! whose hello does not match is refused before anything else it sent is read.

use crate::binary::{PayloadError, Reader, Records};
use crate::cluster::metadata::{Kind, ShardId};
use crate::error_code::{ErrorCode, RetryClass};
use crate::shard::forward::{ForwardOutcome, ForwardedPublish, ForwardedRequest};
use bytes::{BufMut, Bytes, BytesMut};

pub use crate::shard::copy::{CopyAnswer, CopyBody, CopyMessage, CopyRequest};

mod forward;
use forward::{forward_chunks, forward_hint, put_answer, put_forward, put_list, read_answer, read_forward, read_list};

/// A peer's hello bit: it reads `heartbeats` (kind 9).
pub const FEATURE_COALESCED_HEARTBEATS: u64 = 0x1;

/// A peer's hello bit: it copies moving shards (`copy_request`, `copy_answer`: kinds 10, 11).
pub const FEATURE_SHARD_COPY: u64 = 0x2;

/// A peer's hello bit: it copies moving caches (`cache_copy_request`, `cache_copy_answer`:
/// kinds 12, 13).
pub const FEATURE_CACHE_COPY: u64 = 0x4;

/// A peer's hello bit: its shard groups hibernate. It reads a leader's "sleep" heartbeat (a
/// `shard_raft` heartbeat whose context is `felix:quiet`) as leave to stop ticking a settled
/// group, and sends an empty `heartbeats` (kind 9) to each such peer every heartbeat interval,
/// so a peer that goes silent wakes the groups it led. A group hibernates only when every one of
/// its replicas' brokers offered this: an older follower would stand for election as soon as
/// its leader stopped sending heartbeats.
pub const FEATURE_HIBERNATION: u64 = 0x8;

/// A peer's hello bit: it reads `snapshot_chunk` (kind 14), so a shard group's snapshot
/// larger than a chunk is sent to it in chunks rather than in one `shard_raft` message (which
/// a snapshot over the frame limit, a large cache's, could never fit).
pub const FEATURE_SNAPSHOT_CHUNKS: u64 = 0x10;

/// A peer's hello bit (D59): it reads a batch's key, envelope and compressed block where they
/// travel between brokers: in `forward` (kind 3: bits 0x2, 0x4 and 0x8 of its `flags` byte) and
/// in replicated shards' Raft entries (version 4, see
/// [`ReplicatedBatch::encode`](crate::cluster::replica::ReplicatedBatch::encode)). A peer that
/// did not offer it is forwarded the plain block without key, and a group with such a replica
/// is proposed version 2 entries; a batch with an envelope is refused rather than sent to it
/// without one.
pub const FEATURE_BATCH_META: u64 = 0x20;

/// Peer hello bit: this broker reads [`crate::cluster::metadata::Command::MoveReplica`] in the
/// metadata log (a follower's replica moved to balance replicas, D61). The metadata leader
/// proposes one only when every member offered it.
pub const FEATURE_REPLICA_MOVES: u64 = 0x40;

/// Peer hello bit (D62): this broker restores its metadata from a snapshot of the metadata
/// group (in a `raft` message, kind 1, `MsgSnapshot`; the data a
/// [`MetaSnapshot`](crate::cluster::metadata::snapshot::MetaSnapshot)). An older broker would
/// take such a snapshot into its log and leave its metadata behind, so a broker compacts the
/// metadata log only while every voter offered this, and a metadata leader never sends a
/// snapshot to a peer that did not.
pub const FEATURE_META_SNAPSHOTS: u64 = 0x80;

/// Peer hello bit (D63): this broker takes a shard's commit state where it travels: in a copy
/// answer (kind 11, status 2), and in a replicated stream's snapshots (the commit-state section
/// of its checkpoint state). A shard holding state whose retention deleted commits cannot be
/// copied without it: the old owner refuses such a copy to a new owner that did not offer
/// this. A replicated shard holding state is compacted only while every member offered it: an
/// older follower sent a snapshot would read none of it.
pub const FEATURE_COMMIT_STATE: u64 = 0x100;

/// Peer hello bit (D64): this broker reads `forward_batch` and `forward_answers` (kinds 15
/// and 16), so the publishes a broker forwards to it while it handles one round of input go in
/// one frame, and its answers to them in one frame back, instead of a frame each. A peer that
/// did not offer it is sent kinds 3 and 4, one per publish, byte for byte as before.
pub const FEATURE_FORWARD_BATCH: u64 = 0x200;

/// Peer hello bit (D65): this broker takes a moving durable shard's consumer groups in its
/// copy's final answer (kind 11, status bit 0x4) and keeps them before it finishes the move.
/// Without it the groups stay behind and their acks are lost to the new owner, so an answer
/// carrying groups to a peer that did not offer this is refused instead (the move goes no
/// further; the shard stays where it is).
pub const FEATURE_GROUP_COPY: u64 = 0x400;

/// What this implementation offers its peers in its hello.
pub const PEER_FEATURES: u64 = FEATURE_COALESCED_HEARTBEATS
    | FEATURE_SHARD_COPY
    | FEATURE_CACHE_COPY
    | FEATURE_HIBERNATION
    | FEATURE_SNAPSHOT_CHUNKS
    | FEATURE_BATCH_META
    | FEATURE_REPLICA_MOVES
    | FEATURE_META_SNAPSHOTS
    | FEATURE_COMMIT_STATE
    | FEATURE_FORWARD_BATCH
    | FEATURE_GROUP_COPY;

/// One part of a shard group's snapshot (kind 14): the Raft message in the first, the data
/// in order. The receiver puts the data together and steps the message once it holds it all.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SnapshotChunk {
    /// The shard whose group it is.
    pub shard: ShardId,
    /// The snapshot's index and term (the chunks of one snapshot name the same).
    pub index: u64,
    /// The snapshot's term.
    pub term: u64,
    /// The length of the snapshot's whole data.
    pub total: u64,
    /// Where this chunk's data starts in it.
    pub offset: u64,
    /// The `MsgSnapshot` with its data left out (`meta::encode_message`), in the first chunk
    /// only (empty in the others).
    pub header: Bytes,
    /// This chunk's part of the data.
    pub data: Bytes,
}

impl From<CopyMessage> for PeerMessage {
    fn from(m: CopyMessage) -> PeerMessage {
        match m {
            CopyMessage::Request(q) => PeerMessage::CopyRequest(q),
            CopyMessage::Answer(a) => PeerMessage::CopyAnswer(a),
        }
    }
}

/// One Raft message's bytes, possibly in pieces: a leader's entries are not copied into one
/// buffer per follower ([`crate::cluster::meta::encode_message_parts`]); the transport sends the
/// pieces as they are ([`encode_chunks`]) and a receiver gets them contiguous.
#[derive(Debug, Clone, Default)]
pub struct RaftBytes {
    parts: Vec<Bytes>,
}

impl RaftBytes {
    /// From its pieces, in order.
    pub fn from_parts(parts: Vec<Bytes>) -> RaftBytes {
        RaftBytes { parts }
    }

    /// Its length in bytes.
    pub fn len(&self) -> usize {
        self.parts.iter().map(Bytes::len).sum()
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Its pieces.
    pub fn parts(&self) -> &[Bytes] {
        &self.parts
    }

    /// Its bytes in one buffer (shared, not copied, when it is in one piece).
    pub fn to_bytes(&self) -> Bytes {
        match self.parts.as_slice() {
            [] => Bytes::new(),
            [one] => one.clone(),
            many => {
                let mut b = BytesMut::with_capacity(self.len());
                for p in many {
                    b.extend_from_slice(p);
                }
                b.freeze()
            }
        }
    }
}

impl From<Bytes> for RaftBytes {
    fn from(b: Bytes) -> RaftBytes {
        RaftBytes { parts: vec![b] }
    }
}

impl PartialEq for RaftBytes {
    fn eq(&self, other: &RaftBytes) -> bool {
        self.len() == other.len() && self.to_bytes() == other.to_bytes()
    }
}

/// One shard group's heartbeat or heartbeat response, without what the pair of brokers
/// already says (who sends, to whom: the replicas' ids are their brokers'), nor a context
/// (heartbeats with one go as whole Raft messages).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// A response to a heartbeat (else a heartbeat).
    pub response: bool,
    /// The sender's term.
    pub term: u64,
    /// The commit index it carries.
    pub commit: u64,
}

/// The largest peer frame a decoder accepts (a forwarded batch is bounded by the client frame
/// limit; Raft messages by the engine's batch size).
pub const MAX_PEER_FRAME: usize = 64 << 20;

/// One message between brokers.
#[derive(Debug, Clone, PartialEq)]
pub enum PeerMessage {
    /// The first frame of a connection: who is speaking, and the cluster's shared secret.
    Hello {
        /// The cluster's name.
        cluster: String,
        /// The speaker's node id.
        node_id: String,
        /// The shared secret.
        secret: String,
        /// The speaker's incarnation (its data directory's life; empty when it keeps none).
        incarnation: String,
        /// What the speaker reads besides the first eight kinds ([`PEER_FEATURES`]; 0 from a
        /// broker older than them).
        features: u64,
    },
    /// A metadata Raft message.
    Raft(Bytes),
    /// A publish forwarded to its shard's owner.
    Forward(ForwardedPublish),
    /// The owner's answer to a forwarded publish.
    ForwardAnswer {
        /// The forward id the origin named it by.
        id: u64,
        /// Appended or refused.
        outcome: ForwardOutcome,
    },
    /// A metadata command for the leader to propose (sent by a follower).
    Propose(Bytes),
    /// A cache or counter request forwarded to the cache's owner.
    Request(ForwardedRequest),
    /// The owner's answer to a forwarded request.
    RequestAnswer {
        /// The forward id the origin named it by.
        id: u64,
        /// The answer frames.
        data: Bytes,
    },
    /// Raft messages of replicated shards' groups, every group's in one message (one flow
    /// per pair of brokers, not per group).
    ShardRaft(Vec<(ShardId, RaftBytes)>),
    /// Shard groups' heartbeats to one peer, coalesced: a few bytes each instead of a Raft
    /// message and a shard name each.
    Heartbeats(Vec<(ShardId, Beat)>),
    /// A moving shard's new owner asks for records.
    CopyRequest(CopyRequest),
    /// The old owner's records.
    CopyAnswer(CopyAnswer),
    /// A part of a shard group's snapshot.
    SnapshotChunk(SnapshotChunk),
    /// Publishes forwarded to one owner, in one frame (kind 15; [`FEATURE_FORWARD_BATCH`]).
    ForwardBatch(Vec<ForwardedPublish>),
    /// Answers to forwarded publishes, in one frame (kind 16; [`FEATURE_FORWARD_BATCH`]).
    ForwardAnswers(Vec<(u64, ForwardOutcome)>),
}

/// Why peer bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PeerError {
    /// A frame longer than [`MAX_PEER_FRAME`].
    #[error("peer frame of {0} bytes is over the limit")]
    TooLong(usize),
    /// A kind this version does not know.
    #[error("unknown peer message kind {0}")]
    UnknownKind(u8),
    /// A body that does not parse.
    #[error("malformed peer message: {0}")]
    Malformed(#[from] PayloadError),
    /// A field too long for its length prefix (encoding).
    #[error("{0} is too long for the peer encoding")]
    FieldTooLong(&'static str),
    /// A message whose parts do not go together (encoding): a copy answer whose body is not
    /// for its shard's kind.
    #[error("{0}")]
    Mismatched(&'static str),
}

fn put_str16(out: &mut BytesMut, s: &str, what: &'static str) -> Result<(), PeerError> {
    out.put_u16(u16::try_from(s.len()).map_err(|_| PeerError::FieldTooLong(what))?);
    out.extend_from_slice(s.as_bytes());
    Ok(())
}

/// Appends one framed message to `out`.
///
/// # Errors
/// [`PeerError::FieldTooLong`] for a name or message over 65,535 bytes or a publisher over 255.
pub fn encode(m: &PeerMessage, out: &mut BytesMut) -> Result<(), PeerError> {
    // The body is written in place after a header patched at the end: a large message (a
    // forwarded batch, every group's Raft messages) is copied once, not twice.
    let hint = size_hint(m);
    encode_reserved(m, out, hint)
}

/// About how many bytes `m` takes encoded (what a transport's queue holds for it).
pub fn size_hint(m: &PeerMessage) -> usize {
    match m {
        PeerMessage::ShardRaft(list) => list.iter().map(|(s, b)| b.len() + s.name.len() + 64).sum(),
        PeerMessage::Forward(p) => forward_hint(p),
        PeerMessage::ForwardBatch(list) => list.iter().map(forward_hint).sum(),
        PeerMessage::ForwardAnswers(list) => list.len() * 24,
        PeerMessage::Raft(b) | PeerMessage::Propose(b) => b.len(),
        PeerMessage::SnapshotChunk(c) => c.header.len() + c.data.len() + c.shard.name.len() + 96,
        PeerMessage::CopyAnswer(CopyAnswer { body: CopyBody::Batches { batches, .. }, .. }) => {
            batches.iter().map(|b| b.records.raw().len() + 64).sum()
        }
        _ => 64,
    }
}

/// The body of [`encode`], with room for about `hint` bytes reserved.
fn encode_reserved(m: &PeerMessage, out: &mut BytesMut, hint: usize) -> Result<(), PeerError> {
    out.reserve(5 + hint);
    let header = out.len();
    out.put_u32(0);
    out.put_u8(0);
    let mut body = out.split_off(out.len());
    let kind = match write_body(m, &mut body) {
        Ok(kind) => kind,
        Err(e) => {
            out.truncate(header);
            return Err(e);
        }
    };
    if body.len() + 1 > MAX_PEER_FRAME {
        out.truncate(header);
        return Err(PeerError::TooLong(body.len() + 1));
    }
    let len = (body.len() + 1) as u32;
    out.unsplit(body);
    out[header..header + 4].copy_from_slice(&len.to_be_bytes());
    out[header + 4] = kind;
    Ok(())
}

/// Pieces at least this long go to the transport as they are (shared, not copied).
const CHUNK_MIN: usize = 4096;

/// [`encode`] as a list of pieces for a transport that sends pieces without copying them
/// (QUIC `write_all_chunks`): the Raft messages of a `shard_raft` message, and the entries in
/// them, are not copied into one frame. The same bytes as [`encode`], in pieces.
///
/// # Errors
/// As [`encode`].
pub fn encode_chunks(m: &PeerMessage, out: &mut Vec<Bytes>) -> Result<(), PeerError> {
    let list = match m {
        PeerMessage::ShardRaft(list) => list,
        PeerMessage::Forward(p) => return forward_chunks(std::slice::from_ref(p), false, out),
        PeerMessage::ForwardBatch(list) => return forward_chunks(list, true, out),
        PeerMessage::SnapshotChunk(c) => return snapshot_chunk_pieces(c, out),
        _ => {
            let mut b = BytesMut::new();
            encode(m, &mut b)?;
            out.push(b.freeze());
            return Ok(());
        }
    };
    let mut body_len: usize = 4;
    for (s, r) in list {
        body_len += 1 + 6 + s.tenant.len() + s.namespace.len() + s.name.len() + 4 + 4 + r.len();
    }
    if body_len + 1 > MAX_PEER_FRAME {
        return Err(PeerError::TooLong(body_len + 1));
    }
    let mut small = BytesMut::with_capacity(64 + 32 * list.len());
    small.put_u32((body_len + 1) as u32);
    small.put_u8(8);
    small.put_u32(u32::try_from(list.len()).map_err(|_| PeerError::FieldTooLong("shard messages"))?);
    for (shard, r) in list {
        small.put_u8(u8::from(shard.kind == Kind::Cache));
        put_str16(&mut small, &shard.tenant, "tenant")?;
        put_str16(&mut small, &shard.namespace, "namespace")?;
        put_str16(&mut small, &shard.name, "name")?;
        small.put_u32(shard.shard);
        small.put_u32(u32::try_from(r.len()).map_err(|_| PeerError::FieldTooLong("raft message"))?);
        for p in r.parts() {
            put_piece(&mut small, out, p);
        }
    }
    if !small.is_empty() {
        out.push(small.freeze());
    }
    Ok(())
}

/// Adds `piece` to a message being written in pieces: a large one goes to `out` as it is
/// (shared, after the small bytes gathered before it), a small one is gathered in `small`.
fn put_piece(small: &mut BytesMut, out: &mut Vec<Bytes>, piece: &Bytes) {
    if piece.len() >= CHUNK_MIN {
        if !small.is_empty() {
            out.push(small.split().freeze());
        }
        out.push(piece.clone());
    } else {
        small.extend_from_slice(piece);
    }
}

/// A snapshot chunk's fields before its Raft message's header and its data: shard, index,
/// term, total, offset, the header's length.
fn put_snapshot_chunk_head(body: &mut BytesMut, c: &SnapshotChunk) -> Result<(), PeerError> {
    body.put_u8(u8::from(c.shard.kind == Kind::Cache));
    put_str16(body, &c.shard.tenant, "tenant")?;
    put_str16(body, &c.shard.namespace, "namespace")?;
    put_str16(body, &c.shard.name, "name")?;
    body.put_u32(c.shard.shard);
    body.put_u64(c.index);
    body.put_u64(c.term);
    body.put_u64(c.total);
    body.put_u64(c.offset);
    body.put_u32(u32::try_from(c.header.len()).map_err(|_| PeerError::FieldTooLong("snapshot message"))?);
    Ok(())
}

/// A snapshot chunk in pieces ([`encode_chunks`]): its data, up to a chunk of a snapshot the
/// size of a cache, goes to the transport as it is, once per follower sent it, not copied into
/// a frame first.
fn snapshot_chunk_pieces(c: &SnapshotChunk, out: &mut Vec<Bytes>) -> Result<(), PeerError> {
    let mut small = BytesMut::with_capacity(64 + c.shard.tenant.len() + c.shard.namespace.len() + c.shard.name.len());
    small.put_u32(0);
    small.put_u8(14);
    put_snapshot_chunk_head(&mut small, c)?;
    let body_len = small.len() - 5 + c.header.len() + c.data.len();
    if body_len + 1 > MAX_PEER_FRAME {
        return Err(PeerError::TooLong(body_len + 1));
    }
    small[..4].copy_from_slice(&((body_len + 1) as u32).to_be_bytes());
    put_piece(&mut small, out, &c.header);
    put_piece(&mut small, out, &c.data);
    if !small.is_empty() {
        out.push(small.freeze());
    }
    Ok(())
}

/// Writes a message's body; its kind.
fn write_body(m: &PeerMessage, body: &mut BytesMut) -> Result<u8, PeerError> {
    Ok(match m {
        PeerMessage::Hello { cluster, node_id, secret, incarnation, features } => {
            put_str16(body, cluster, "cluster")?;
            put_str16(body, node_id, "node_id")?;
            put_str16(body, secret, "secret")?;
            if !incarnation.is_empty() || *features != 0 {
                put_str16(body, incarnation, "incarnation")?;
            }
            if *features != 0 {
                body.put_u64(*features);
            }
            1
        }
        PeerMessage::Raft(b) => {
            body.extend_from_slice(b);
            2
        }
        PeerMessage::Forward(p) => {
            put_forward(body, p)?;
            3
        }
        PeerMessage::ForwardAnswer { id, outcome } => {
            put_answer(body, *id, outcome)?;
            4
        }
        PeerMessage::ForwardBatch(list) => {
            put_list(body, list, "forward batch", put_forward)?;
            15
        }
        PeerMessage::ForwardAnswers(list) => {
            put_list(body, list, "forward answers", |b, (id, outcome)| put_answer(b, *id, outcome))?;
            16
        }
        PeerMessage::Propose(b) => {
            body.extend_from_slice(b);
            5
        }
        PeerMessage::Request(q) => {
            body.put_u64(q.id);
            put_str16(body, &q.tenant_id, "tenant")?;
            body.put_u8(u8::try_from(q.principal.len()).map_err(|_| PeerError::FieldTooLong("principal"))?);
            body.extend_from_slice(&q.principal);
            body.put_u16(q.flags);
            body.put_u64(q.features);
            body.extend_from_slice(&q.request);
            6
        }
        PeerMessage::RequestAnswer { id, data } => {
            body.put_u64(*id);
            body.extend_from_slice(data);
            7
        }
        PeerMessage::ShardRaft(list) => {
            body.put_u32(u32::try_from(list.len()).map_err(|_| PeerError::FieldTooLong("shard messages"))?);
            for (shard, m) in list {
                body.put_u8(u8::from(shard.kind == Kind::Cache));
                put_str16(body, &shard.tenant, "tenant")?;
                put_str16(body, &shard.namespace, "namespace")?;
                put_str16(body, &shard.name, "name")?;
                body.put_u32(shard.shard);
                body.put_u32(u32::try_from(m.len()).map_err(|_| PeerError::FieldTooLong("raft message"))?);
                for p in m.parts() {
                    body.extend_from_slice(p);
                }
            }
            8
        }
        PeerMessage::Heartbeats(list) => {
            // The names once each (most groups of one stream share one), then the beats.
            let mut names: Vec<(Kind, &str, &str, &str)> = Vec::new();
            let mut index = std::collections::BTreeMap::new();
            for (s, _) in list {
                let k = (s.kind, s.tenant.as_str(), s.namespace.as_str(), s.name.as_str());
                if let std::collections::btree_map::Entry::Vacant(e) = index.entry(k) {
                    e.insert(names.len());
                    names.push(k);
                }
            }
            body.put_u16(u16::try_from(names.len()).map_err(|_| PeerError::FieldTooLong("heartbeat names"))?);
            for (kind, tenant, namespace, name) in &names {
                body.put_u8(u8::from(*kind == Kind::Cache));
                put_str16(body, tenant, "tenant")?;
                put_str16(body, namespace, "namespace")?;
                put_str16(body, name, "name")?;
            }
            body.put_u32(u32::try_from(list.len()).map_err(|_| PeerError::FieldTooLong("heartbeats"))?);
            for (s, b) in list {
                let k = (s.kind, s.tenant.as_str(), s.namespace.as_str(), s.name.as_str());
                body.put_u16(index.get(&k).copied().unwrap_or(0) as u16);
                body.put_u32(s.shard);
                body.put_u8(u8::from(b.response));
                body.put_u64(b.term);
                body.put_u64(b.commit);
            }
            9
        }
        PeerMessage::CopyRequest(q) => {
            put_stream_shard(body, &q.shard)?;
            body.put_u8(u8::from(q.from.is_some()));
            body.put_u64(q.from.unwrap_or(0));
            body.put_u32(q.max_bytes);
            if q.shard.kind == Kind::Cache { 12 } else { 10 }
        }
        PeerMessage::CopyAnswer(a) if a.shard.kind == Kind::Cache => {
            put_stream_shard(body, &a.shard)?;
            match &a.body {
                CopyBody::Cache { tail, cutting, full, records, counters } => {
                    body.put_u8(0);
                    body.put_u64(*tail);
                    body.put_u8(u8::from(*cutting));
                    body.put_u8(u8::from(*full));
                    for list in [records, counters] {
                        body.put_u32(u32::try_from(list.len()).map_err(|_| PeerError::FieldTooLong("records"))?);
                        for r in list {
                            body.put_u32(u32::try_from(r.len()).map_err(|_| PeerError::FieldTooLong("record"))?);
                            body.extend_from_slice(r);
                        }
                    }
                }
                CopyBody::Refused(why) => {
                    body.put_u8(1);
                    put_str16(body, why, "message")?;
                }
                CopyBody::Batches { .. } => {
                    return Err(PeerError::Mismatched("a cache's copy cannot carry stream batches"));
                }
            }
            13
        }
        PeerMessage::SnapshotChunk(c) => {
            put_snapshot_chunk_head(body, c)?;
            body.extend_from_slice(&c.header);
            body.extend_from_slice(&c.data);
            14
        }
        PeerMessage::CopyAnswer(a) => {
            put_stream_shard(body, &a.shard)?;
            match &a.body {
                CopyBody::Batches { start, tail, cutting, batches, state, groups } => {
                    body.put_u8(if state.is_some() { 2 } else { 0 } | if groups.is_some() { 4 } else { 0 });
                    body.put_u64(*start);
                    body.put_u64(*tail);
                    body.put_u8(u8::from(*cutting));
                    if let Some(state) = state {
                        body.put_u32(u32::try_from(state.len()).map_err(|_| PeerError::FieldTooLong("state"))?);
                        body.extend_from_slice(state);
                    }
                    if let Some(groups) = groups {
                        body.put_u32(u32::try_from(groups.len()).map_err(|_| PeerError::FieldTooLong("groups"))?);
                        for g in groups {
                            body.put_u32(u32::try_from(g.len()).map_err(|_| PeerError::FieldTooLong("group"))?);
                            body.extend_from_slice(g);
                        }
                    }
                    for b in batches {
                        crate::storage::encode_batch(b, body);
                    }
                }
                CopyBody::Refused(why) => {
                    body.put_u8(1);
                    put_str16(body, why, "message")?;
                }
                CopyBody::Cache { .. } => {
                    return Err(PeerError::Mismatched("a stream's copy cannot carry cache records"));
                }
            }
            11
        }
    })
}

fn put_stream_shard(body: &mut BytesMut, s: &ShardId) -> Result<(), PeerError> {
    put_str16(body, &s.tenant, "tenant")?;
    put_str16(body, &s.namespace, "namespace")?;
    put_str16(body, &s.name, "stream")?;
    body.put_u32(s.shard);
    Ok(())
}

fn stream_shard(r: &mut Reader) -> Result<ShardId, PeerError> {
    Ok(ShardId {
        kind: Kind::Stream,
        tenant: r.str16("tenant")?,
        namespace: r.str16("namespace")?,
        name: r.str16("stream")?,
        shard: r.u32("shard")?,
    })
}

fn decode_body(kind: u8, body: Bytes) -> Result<PeerMessage, PeerError> {
    let mut r = Reader::new(body);
    let m = match kind {
        1 => PeerMessage::Hello {
            cluster: r.str16("cluster")?,
            node_id: r.str16("node_id")?,
            secret: r.str16("secret")?,
            incarnation: if r.remaining() > 0 { r.str16("incarnation")? } else { String::new() },
            features: if r.remaining() >= 8 { r.u64("features")? } else { 0 },
        },
        2 => PeerMessage::Raft(r.rest()),
        3 => PeerMessage::Forward(read_forward(&mut r)?),
        4 => {
            let (id, outcome) = read_answer(&mut r)?;
            PeerMessage::ForwardAnswer { id, outcome }
        }
        15 => PeerMessage::ForwardBatch(read_list(&mut r, read_forward)?),
        16 => PeerMessage::ForwardAnswers(read_list(&mut r, read_answer)?),
        5 => PeerMessage::Propose(r.rest()),
        6 => {
            let id = r.u64("id")?;
            let tenant_id = r.str16("tenant")?;
            let plen = r.u8("principal_len")? as usize;
            let principal = r.bytes(plen, "principal")?;
            let flags = r.u16("flags")?;
            let features = r.u64("features")?;
            PeerMessage::Request(ForwardedRequest { id, tenant_id, principal, flags, features, request: r.rest() })
        }
        7 => PeerMessage::RequestAnswer { id: r.u64("id")?, data: r.rest() },
        8 => {
            let count = r.u32("count")?;
            // Each takes at least 15 bytes: a count beyond that is a lie.
            if count as usize > r.remaining() / 15 {
                return Err(PeerError::Malformed(PayloadError::CountTooLarge { count, remaining: r.remaining() }));
            }
            let mut list = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let kind = if r.u8("kind")? == 1 { Kind::Cache } else { Kind::Stream };
                let tenant = r.str16("tenant")?;
                let namespace = r.str16("namespace")?;
                let name = r.str16("name")?;
                let shard = r.u32("shard")?;
                let len = r.u32("len")? as usize;
                let m = r.bytes(len, "raft message")?;
                list.push((ShardId { kind, tenant, namespace, name, shard }, RaftBytes::from(m)));
            }
            PeerMessage::ShardRaft(list)
        }
        9 => {
            let n = r.u16("names")?;
            if usize::from(n) > r.remaining() / 7 {
                return Err(PeerError::Malformed(PayloadError::CountTooLarge {
                    count: u32::from(n),
                    remaining: r.remaining(),
                }));
            }
            let mut names = Vec::with_capacity(usize::from(n));
            for _ in 0..n {
                let kind = if r.u8("kind")? == 1 { Kind::Cache } else { Kind::Stream };
                names.push((kind, r.str16("tenant")?, r.str16("namespace")?, r.str16("name")?));
            }
            let count = r.u32("count")?;
            if count as usize > r.remaining() / 23 {
                return Err(PeerError::Malformed(PayloadError::CountTooLarge { count, remaining: r.remaining() }));
            }
            let mut list = Vec::with_capacity(count as usize);
            for _ in 0..count {
                let i = usize::from(r.u16("name index")?);
                let (kind, tenant, namespace, name) = names
                    .get(i)
                    .cloned()
                    .ok_or(PeerError::Malformed(PayloadError::Incomplete { field: "name index" }))?;
                let shard = r.u32("shard")?;
                let response = match r.u8("type")? {
                    0 => false,
                    1 => true,
                    _ => return Err(PeerError::Malformed(PayloadError::Incomplete { field: "heartbeat type" })),
                };
                let beat = Beat { response, term: r.u64("term")?, commit: r.u64("commit")? };
                list.push((ShardId { kind, tenant, namespace, name, shard }, beat));
            }
            PeerMessage::Heartbeats(list)
        }
        10 => {
            let shard = stream_shard(&mut r)?;
            let has = r.u8("has_from")? != 0;
            let from = r.u64("from")?;
            PeerMessage::CopyRequest(CopyRequest { shard, from: has.then_some(from), max_bytes: r.u32("max_bytes")? })
        }
        12 => {
            let shard = ShardId { kind: Kind::Cache, ..stream_shard(&mut r)? };
            let has = r.u8("has_from")? != 0;
            let from = r.u64("from")?;
            PeerMessage::CopyRequest(CopyRequest { shard, from: has.then_some(from), max_bytes: r.u32("max_bytes")? })
        }
        13 => {
            let shard = ShardId { kind: Kind::Cache, ..stream_shard(&mut r)? };
            let body = match r.u8("status")? {
                0 => {
                    let tail = r.u64("tail")?;
                    let cutting = r.u8("cutting")? != 0;
                    let full = r.u8("full")? != 0;
                    let mut lists = [Vec::new(), Vec::new()];
                    for list in &mut lists {
                        let n = r.u32("count")?;
                        for _ in 0..n {
                            let len = r.u32("record_len")? as usize;
                            list.push(r.bytes(len, "record")?);
                        }
                    }
                    let [records, counters] = lists;
                    CopyBody::Cache { tail, cutting, full, records, counters }
                }
                _ => CopyBody::Refused(r.str16("message")?),
            };
            PeerMessage::CopyAnswer(CopyAnswer { shard, body })
        }
        11 => {
            let shard = stream_shard(&mut r)?;
            let body = match r.u8("status")? {
                status @ (0 | 2 | 4 | 6) => {
                    let start = r.u64("start")?;
                    let tail = r.u64("tail")?;
                    let cutting = r.u8("cutting")? != 0;
                    let state = if status & 2 != 0 {
                        let len = r.u32("state_len")? as usize;
                        let state = r.bytes(len, "state")?;
                        // Taken as the new owner's whole state: it must read back whole.
                        crate::storage::decode_state_checkpoint(&state)
                            .map_err(|_| PeerError::Malformed(PayloadError::Incomplete { field: "state" }))?;
                        Some(state)
                    } else {
                        None
                    };
                    let groups = if status & 4 != 0 {
                        let n = r.u32("groups")?;
                        let mut groups = Vec::new();
                        for _ in 0..n {
                            let len = r.u32("group_len")? as usize;
                            let g = r.bytes(len, "group")?;
                            // Written to the new owner's `$groups` log as they are: each must
                            // be a group record it reads.
                            if !crate::broker::is_group_record(&g) {
                                return Err(PeerError::Malformed(PayloadError::Incomplete { field: "group" }));
                            }
                            groups.push(g);
                        }
                        Some(groups)
                    } else {
                        None
                    };
                    // The batches in the segment format: every one passed its checksum, in
                    // strictly increasing offsets; anything else is a malformed answer.
                    let seg = crate::storage::decode_segment(r.rest());
                    if seg.problem.is_some() || !seg.damaged.is_empty() {
                        return Err(PeerError::Malformed(PayloadError::Incomplete { field: "copied batches" }));
                    }
                    CopyBody::Batches { start, tail, cutting, batches: seg.batches, state, groups }
                }
                _ => CopyBody::Refused(r.str16("message")?),
            };
            PeerMessage::CopyAnswer(CopyAnswer { shard, body })
        }
        14 => {
            let kind = if r.u8("kind")? == 1 { Kind::Cache } else { Kind::Stream };
            let tenant = r.str16("tenant")?;
            let namespace = r.str16("namespace")?;
            let name = r.str16("name")?;
            let shard = ShardId { kind, tenant, namespace, name, shard: r.u32("shard")? };
            let (index, term, total, offset) = (r.u64("index")?, r.u64("term")?, r.u64("total")?, r.u64("offset")?);
            let len = r.u32("header_len")? as usize;
            let header = r.bytes(len, "snapshot message")?;
            let data = r.rest();
            PeerMessage::SnapshotChunk(SnapshotChunk { shard, index, term, total, offset, header, data })
        }
        other => return Err(PeerError::UnknownKind(other)),
    };
    r.finish()?;
    Ok(m)
}

/// Reads framed peer messages from a byte stream, whatever the chunking. Never panics.
///
/// The received chunks are kept as they came (the queue the client frame decoder reads too): a
/// message inside one is a slice of it, one spread over several is copied once.
#[derive(Debug, Default)]
pub struct PeerDecoder {
    chunks: crate::frame::chunks::Chunks,
}

impl PeerDecoder {
    /// Bytes received (copied; [`push_chunk`](Self::push_chunk) takes them as they are).
    pub fn push(&mut self, data: &[u8]) {
        self.push_chunk(Bytes::copy_from_slice(data));
    }

    /// Bytes received, uncopied.
    pub fn push_chunk(&mut self, data: Bytes) {
        self.chunks.push(data);
    }

    /// The next whole message, `Ok(None)` when more bytes are needed.
    ///
    /// # Errors
    /// [`PeerError`]: the stream cannot be trusted after it (close the connection).
    pub fn next_message(&mut self) -> Result<Option<PeerMessage>, PeerError> {
        let mut prefix = [0u8; 4];
        if !self.chunks.peek(&mut prefix) {
            return Ok(None);
        }
        let len = u32::from_be_bytes(prefix) as usize;
        if len > MAX_PEER_FRAME {
            return Err(PeerError::TooLong(len));
        }
        if len == 0 {
            return Err(PeerError::Malformed(PayloadError::Incomplete { field: "kind" }));
        }
        if self.chunks.len() < 4 + len {
            return Ok(None);
        }
        self.chunks.skip(4);
        let Some(frame) = self.chunks.take(len) else { return Ok(None) };
        decode_body(frame[0], frame.slice(1..)).map(Some)
    }
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod heartbeat_size {
    use super::*;
    use raft::eraftpb::{Message, MessageType};

    /// What coalescing saves: one heartbeat round of 100 groups of one stream to one peer.
    #[test]
    fn a_hundred_groups_heartbeats_take_a_fraction_of_the_bytes_coalesced() {
        let shard = |i: u32| ShardId {
            kind: Kind::Stream,
            tenant: "acme".into(),
            namespace: "payments".into(),
            name: "ledger".into(),
            shard: i,
        };
        let whole: Vec<(ShardId, RaftBytes)> = (0..100)
            .map(|i| {
                let mut m = Message::default();
                m.set_msg_type(MessageType::MsgHeartbeat);
                m.from = crate::cluster::node::raft_id("n1");
                m.to = crate::cluster::node::raft_id("n2");
                m.term = 12;
                m.commit = 1_000_000 + u64::from(i);
                (shard(i), RaftBytes::from(Bytes::from(crate::cluster::meta::encode_message(&m))))
            })
            .collect();
        let beats: Vec<(ShardId, Beat)> = (0..100)
            .map(|i| (shard(i), Beat { response: false, term: 12, commit: 1_000_000 + u64::from(i) }))
            .collect();
        let (mut a, mut b) = (BytesMut::new(), BytesMut::new());
        encode(&PeerMessage::ShardRaft(whole), &mut a).unwrap();
        encode(&PeerMessage::Heartbeats(beats), &mut b).unwrap();
        eprintln!("100 heartbeats: {} bytes as Raft messages, {} coalesced", a.len(), b.len());
        assert!(b.len() * 2 < a.len(), "{} vs {}", b.len(), a.len());
    }
}
