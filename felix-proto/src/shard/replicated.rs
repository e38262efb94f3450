//! A replicated shard's write as its Raft log holds it ([`ReplicatedBatch`], byte layout on
//! [`ReplicatedBatch::encode`]) and what its group answers the broker that proposed it
//! ([`Answer`]). The engine that replicates them is [`crate::cluster::replica`]; the broker
//! builds and applies them without knowing it.

use crate::binary::{Reader, Records};
use bytes::{BufMut, Bytes};

/// A batch as replicated: everything a replica needs to hold the same batch as its leader
/// (the records block as published, the append time the leader gave it, the publisher), and,
/// for an idempotent producer, its sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicatedBatch {
    /// (producer id, sequence) of an idempotent producer.
    pub producer: Option<(u64, u64)>,
    /// Append time the leader gave it, microseconds since the Unix epoch.
    pub timestamp_micros: u64,
    /// Who published it (principal), when known.
    pub publisher: Option<Bytes>,
    /// The key it was published with (D57: what subscriptions' filters match; D59).
    pub key: Option<Bytes>,
    /// The records (an untimed block, as published), with their envelope (D58) and their
    /// compressed form (D56) when they came with them (D59).
    pub records: Records,
    /// A conditional publish (`publish_if`): written only if the shard's next offset is this
    /// when the entry is applied.
    pub expected_offset: Option<u64>,
    /// A commit's state changes (encoded as in a stored batch's state section), applied to the
    /// shard's state at the batch's offset when the entry is applied.
    pub state: Option<Bytes>,
    /// A side entry: its records are operations on the host's own state of the shard (a
    /// stream's consumer-group settlements), not records of the shard. It takes no offset and
    /// comes out as [`ReplicaOutput::Side`](crate::cluster::replica::ReplicaOutput::Side); it is answered [`Answer::Applied`]. Encoded as
    /// version 3, which a replica that predates side entries does not decode, and so skips
    /// (taking no offset for it) rather than delivering its operations as records.
    pub side: bool,
}

/// Why replicated bytes could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed replicated batch: {0}")]
pub struct BatchError(&'static str);

impl ReplicatedBatch {
    /// A batch of these payloads (tests and the simulation).
    pub fn from_payloads(producer: Option<(u64, u64)>, payloads: &[Bytes]) -> ReplicatedBatch {
        ReplicatedBatch {
            producer,
            timestamp_micros: 0,
            publisher: None,
            key: None,
            records: Records::from_payloads(payloads.iter()).unwrap_or_default(),
            expected_offset: None,
            state: None,
            side: false,
        }
    }

    /// A side entry (see [`side`](Self::side)) holding these operations.
    pub fn side_entry(timestamp_micros: u64, ops: &[Bytes]) -> ReplicatedBatch {
        ReplicatedBatch {
            timestamp_micros,
            side: true,
            records: Records::from_payloads(ops.iter()).unwrap_or_default(),
            ..ReplicatedBatch::from_payloads(None, &[])
        }
    }

    /// Its payloads, in order.
    pub fn payloads(&self) -> Vec<Bytes> {
        self.records.payloads().collect()
    }

    /// Whether it carries what only a replica that offered [`FEATURE_BATCH_META`] reads (a
    /// key, an envelope, a compressed block): encoded as version 4.
    ///
    /// [`FEATURE_BATCH_META`]: crate::cluster::peer::FEATURE_BATCH_META
    pub fn has_meta(&self) -> bool {
        !self.side && (self.key.is_some() || self.records.envelope().is_some() || self.records.stores_packed())
    }

    /// What a group with a replica that did not offer [`FEATURE_BATCH_META`] can take: the
    /// batch without its key and with its records plain (both only ever help: the key
    /// filters, the compressed form saves bytes). `None` for a batch with an envelope: its
    /// records are ciphertext that no subscriber could open without it, so it is refused
    /// rather than written without it.
    ///
    /// [`FEATURE_BATCH_META`]: crate::cluster::peer::FEATURE_BATCH_META
    pub fn without_meta(self) -> Option<ReplicatedBatch> {
        if self.records.envelope().is_some() {
            return None;
        }
        Some(ReplicatedBatch { key: None, records: self.records.plain(), ..self })
    }

    /// Its bytes in the Raft log: `u8 version` (2; 3 for a side entry, same layout; 4 for a
    /// batch that [`has_meta`](Self::has_meta)), `u8 flags` (0x1 producer, 0x2 publisher,
    /// 0x4 expected offset, 0x8 state), `u64 producer`, `u64 sequence`, `u64 timestamp_micros`,
    /// `u8 publisher_len` + publisher, `u64 expected_offset` (with 0x4 only), `u32 state_len` +
    /// state (with 0x8 only); version 4 then has `u8 meta` (0x1 key, 0x2 envelope, 0x4
    /// compressed), `u16 key_len` + key (0x1), `u16 envelope_len` + envelope (0x2); then the
    /// records block as in a publish batch (`u32 count`, each `u32 len` + payload), or with
    /// 0x4 compressed as in a stored batch (`u8 codec`, `u32 count`, `u32 raw_len`, the
    /// compressed bytes). A version 2 or 3 entry is byte-identical to what brokers before D59
    /// wrote; version 4 goes only to groups whose every replica offered `FEATURE_BATCH_META`.
    pub fn encode(&self) -> Vec<u8> {
        let publisher = self.publisher.as_ref().filter(|p| p.len() <= 255);
        let key = self.key.as_ref().filter(|k| k.len() <= usize::from(u16::MAX) && !self.side);
        let envelope = self.records.envelope().filter(|e| e.len() <= usize::from(u16::MAX) && !self.side);
        let packed = self.records.stores_packed() && !self.side;
        let meta = u8::from(key.is_some()) | (u8::from(envelope.is_some()) << 1) | (u8::from(packed) << 2);
        let mut b = Vec::with_capacity(
            48 + publisher.map_or(0, |p| p.len())
                + key.map_or(0, Bytes::len)
                + envelope.map_or(0, Bytes::len)
                + self.records.block_len(),
        );
        b.put_u8(if self.side {
            3
        } else if meta != 0 {
            4
        } else {
            2
        });
        let (pid, seq) = self.producer.unwrap_or((0, 0));
        b.put_u8(
            u8::from(self.producer.is_some())
                | (u8::from(publisher.is_some()) << 1)
                | (u8::from(self.expected_offset.is_some()) << 2)
                | (u8::from(self.state.is_some()) << 3),
        );
        b.put_u64(pid);
        b.put_u64(seq);
        b.put_u64(self.timestamp_micros);
        let p = publisher.map_or(&[][..], |p| p.as_ref());
        b.put_u8(p.len() as u8);
        b.extend_from_slice(p);
        if let Some(e) = self.expected_offset {
            b.put_u64(e);
        }
        if let Some(s) = &self.state {
            b.put_u32(s.len() as u32);
            b.extend_from_slice(s);
        }
        if meta != 0 {
            b.put_u8(meta);
            for f in [key, envelope].into_iter().flatten() {
                b.put_u16(f.len() as u16);
                b.extend_from_slice(f);
            }
        }
        if packed {
            self.records.put_block(&mut b);
        } else {
            b.put_u32(self.records.count());
            b.extend_from_slice(self.records.raw());
        }
        b
    }

    /// Reads [`encode`](Self::encode)'s bytes. Never panics.
    ///
    /// # Errors
    /// [`BatchError`] for bytes that are not a whole batch.
    pub fn decode(data: &[u8]) -> Result<ReplicatedBatch, BatchError> {
        Self::decode_shared(Bytes::copy_from_slice(data))
    }

    /// [`decode`](Self::decode) from shared bytes: the records are a slice of `data`, not a
    /// copy (the Raft log already holds the entry).
    ///
    /// # Errors
    /// As [`decode`](Self::decode).
    pub fn decode_shared(data: Bytes) -> Result<ReplicatedBatch, BatchError> {
        let mut r = Reader::new(data);
        let bad = |what: &'static str| move |_| BatchError(what);
        let version = r.u8("version").map_err(bad("version"))?;
        let side = match version {
            2 | 4 => false,
            3 => true,
            _ => return Err(BatchError("unknown version")),
        };
        let flags = r.u8("flags").map_err(bad("flags"))?;
        let pid = r.u64("producer").map_err(bad("producer"))?;
        let seq = r.u64("sequence").map_err(bad("sequence"))?;
        let timestamp_micros = r.u64("timestamp").map_err(bad("timestamp"))?;
        let plen = r.u8("publisher_len").map_err(bad("publisher length"))?;
        let publisher = r.bytes(usize::from(plen), "publisher").map_err(bad("publisher"))?;
        let expected_offset =
            if flags & 4 != 0 { Some(r.u64("expected_offset").map_err(bad("expected offset"))?) } else { None };
        let state = if flags & 8 != 0 {
            let len = r.u32("state_len").map_err(bad("state length"))?;
            Some(r.bytes(len as usize, "state").map_err(bad("state"))?)
        } else {
            None
        };
        let meta = if version == 4 { r.u8("meta").map_err(bad("meta"))? } else { 0 };
        let mut field = |bit: u8, what: &'static str| -> Result<Option<Bytes>, BatchError> {
            if meta & bit == 0 {
                return Ok(None);
            }
            let len = r.u16(what).map_err(bad(what))?;
            r.bytes(usize::from(len), what).map(Some).map_err(bad(what))
        };
        let key = field(1, "key")?;
        let envelope = field(2, "envelope")?;
        // The leader checked the block against its frame limit; a replica's bound is the
        // storage reader's, alike on every replica (an entry refused here is refused by all).
        let records =
            Records::read_block(&mut r, meta & 4 != 0, crate::storage::MAX_BATCH_BODY).map_err(bad("records"))?;
        let records = if envelope.is_some() { records.with_envelope(envelope) } else { records };
        Ok(ReplicatedBatch {
            producer: (flags & 1 != 0).then_some((pid, seq)),
            timestamp_micros,
            publisher: (flags & 2 != 0).then_some(publisher),
            key,
            records,
            expected_offset,
            state,
            side,
        })
    }
}

/// The answer to a proposed batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Answer {
    /// Committed: the first record's offset (a duplicate's original one).
    Appended {
        /// Offset of the first record.
        offset: u64,
        /// It was a duplicate of a batch applied before (nothing new was written).
        duplicate: bool,
    },
    /// This replica stopped leading, or a newer leader's entry took the index: the batch may
    /// or may not commit (outcome unknown; an idempotent producer sends it again).
    LeadershipLost,
    /// No majority confirmed it in time (outcome unknown).
    QuorumTimeout,
    /// A side entry committed and came out as [`ReplicaOutput::Side`](crate::cluster::replica::ReplicaOutput::Side) (before this answer).
    Applied,
    /// Not proposed: the leader is handing its leadership over (a move). Nothing was written;
    /// send it again (to the new leader, soon).
    NotProposed,
    /// Not proposed: the batch carries an envelope (D58) and a replica of the group runs a
    /// broker that did not offer [`FEATURE_BATCH_META`](crate::cluster::peer::FEATURE_BATCH_META),
    /// which would keep its ciphertext without the envelope that opens it (D59). Nothing was
    /// written.
    NoEnvelopes,
    /// Committed, and refused when applied (nothing written): an idempotent producer's batch
    /// out of its sequence order. Every replica refuses it alike, so a producer's batches land
    /// in sequence order whichever leader wrote them.
    Refused(ApplyRefusal),
}

/// Why a committed batch was not written when applied: an idempotent producer's batch out of
/// its sequence order (REFERENCE §10.3's refusals), or a conditional one whose offset was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ApplyRefusal {
    /// Ahead of the producer's next sequence (an earlier batch has not landed yet).
    Gap {
        /// The sequence expected.
        expected: u64,
    },
    /// Below the remembered window: whether it landed cannot be told.
    Expired,
    /// No batch of this producer landed and the sequence is not 0.
    UnknownProducer,
    /// A `publish_if` whose expected offset is not the shard's next one.
    OffsetMismatch {
        /// The shard's next offset.
        tail: u64,
    },
}

/// The role of this broker's replica of a replicated shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplicaRole {
    /// Leads, and its generation start committed: it serves.
    Leading,
    /// Leads, its generation-start record not committed yet: `not_ready`.
    Settling,
    /// Follows the leader it knows of (none while its group elects one).
    Following {
        /// The leader: node id, client address, generation.
        leader: Option<crate::binary::OwnerHint>,
    },
}
