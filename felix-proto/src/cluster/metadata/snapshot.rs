//! The metadata group's snapshot: what a broker holds after applying the metadata log up to an
//! index, so the log before it can go (D62). Without it the metadata log only grew: every
//! `Create`, every `Lead` of thousands of replicated shards' elections, kept in memory and in
//! `raft.log`, replayed whole at every restart and sent whole to every broker added later.
//!
//! It holds the [`Metadata`] and what the broker learnt from the log besides it: the name of
//! every Raft id, the cluster address each voter added by `cluster add` was given, and the
//! voters that were removed (their brokers are refused). JSON (a stored file and a peer
//! message a person may need to read), versioned, with shards grouped under their stream or
//! cache so a shard costs a few bytes rather than its whole name: 10,000 replicated and
//! 10,000 single shards take about 0.8 MB (docs/cluster.md, "Sizing").
//!
//! A snapshot that does not decode, names a version this build does not read, or breaks the
//! metadata's own limits is refused with a [`SnapshotError`], never taken in half.

use super::{Assignment, Kind, MAX_REPLICATION, MAX_SHARDS, Member, Metadata, Move, Name, ShardId};
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// The snapshot format this build writes and reads.
pub const SNAPSHOT_VERSION: u32 = 1;

/// Why a snapshot was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SnapshotError {
    /// The bytes are not a snapshot (damaged, or not JSON of this shape).
    #[error("the metadata snapshot does not decode: {0}")]
    Decode(String),
    /// A newer (or unknown) format.
    #[error("the metadata snapshot is version {0}; this build reads version {SNAPSHOT_VERSION}")]
    Version(u32),
    /// It decodes but holds what the metadata never does.
    #[error("the metadata snapshot is inconsistent: {0}")]
    Invalid(String),
}

/// What a broker holds at a log index, beyond its log.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetaSnapshot {
    /// The state machine.
    pub metadata: Metadata,
    /// Every Raft id the log named, with its broker's node id.
    pub names: BTreeMap<u64, String>,
    /// The cluster address of each voter added with one (`cluster add`), by node id.
    pub addrs: BTreeMap<String, String>,
    /// Node ids removed from the voters (and not added back).
    pub removed: BTreeSet<String>,
}

#[derive(Serialize, Deserialize)]
struct Wire {
    version: u32,
    #[serde(default)]
    names: Vec<(u64, String)>,
    #[serde(default)]
    addrs: Vec<(String, String)>,
    #[serde(default)]
    removed: Vec<String>,
    #[serde(default)]
    members: Vec<Member>,
    #[serde(default)]
    names_of: Vec<Named>,
    #[serde(default)]
    revoked_jti: Vec<String>,
    #[serde(default)]
    revoked_sub: Vec<String>,
}

/// One stream or cache name and everything the metadata holds of its shards.
#[derive(Serialize, Deserialize)]
struct Named {
    kind: Kind,
    tenant: String,
    namespace: String,
    name: String,
    /// Its shard count, when it is registered.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    shards: Option<u32>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    ephemeral: bool,
    /// Its replication factor, when replicated.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    replication: Option<u32>,
    /// `[shard, owner, generation]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    owners: Vec<(u32, String, u64)>,
    /// `[shard, replicas, newest leader term]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    replicas: Vec<(u32, Vec<String>, u64)>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    moves: Vec<(u32, Move)>,
    /// `[shard, broker]`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pins: Vec<(u32, String)>,
}

impl MetaSnapshot {
    /// The snapshot's bytes (deterministic: every map is ordered).
    pub fn encode(&self) -> Vec<u8> {
        Self::encode_state(&self.metadata, &self.names, &self.addrs, &self.removed)
    }

    /// [`encode`](Self::encode) of the parts, borrowed (a broker's metadata is not copied to
    /// be written).
    pub fn encode_state(
        md: &Metadata,
        names: &BTreeMap<u64, String>,
        addrs: &BTreeMap<String, String>,
        removed: &BTreeSet<String>,
    ) -> Vec<u8> {
        let mut named: BTreeMap<Name, Named> = BTreeMap::new();
        fn entry<'a>(
            named: &'a mut BTreeMap<Name, Named>,
            kind: Kind,
            tenant: &str,
            namespace: &str,
            name: &str,
        ) -> &'a mut Named {
            named.entry((kind, tenant.to_owned(), namespace.to_owned(), name.to_owned())).or_insert_with(|| Named {
                kind,
                tenant: tenant.to_owned(),
                namespace: namespace.to_owned(),
                name: name.to_owned(),
                shards: None,
                ephemeral: false,
                replication: None,
                owners: Vec::new(),
                replicas: Vec::new(),
                moves: Vec::new(),
                pins: Vec::new(),
            })
        }
        let n = &mut named;
        for ((k, t, ns, nm), shards) in &md.registry {
            entry(n, *k, t, ns, nm).shards = Some(*shards);
        }
        for (k, t, ns, nm) in &md.ephemeral {
            entry(n, *k, t, ns, nm).ephemeral = true;
        }
        for ((k, t, ns, nm), rf) in &md.replication {
            entry(n, *k, t, ns, nm).replication = Some(*rf);
        }
        for (s, a) in &md.owners {
            entry(n, s.kind, &s.tenant, &s.namespace, &s.name).owners.push((s.shard, a.owner.clone(), a.generation));
        }
        for (s, (r, term)) in &md.replicas {
            entry(n, s.kind, &s.tenant, &s.namespace, &s.name).replicas.push((s.shard, r.clone(), *term));
        }
        for (s, m) in &md.moves {
            entry(n, s.kind, &s.tenant, &s.namespace, &s.name).moves.push((s.shard, m.clone()));
        }
        for (s, to) in &md.pins {
            entry(n, s.kind, &s.tenant, &s.namespace, &s.name).pins.push((s.shard, to.clone()));
        }
        let wire = Wire {
            version: SNAPSHOT_VERSION,
            names: names.iter().map(|(id, n)| (*id, n.clone())).collect(),
            addrs: addrs.iter().map(|(n, a)| (n.clone(), a.clone())).collect(),
            removed: removed.iter().cloned().collect(),
            members: md.members.values().cloned().collect(),
            names_of: named.into_values().collect(),
            revoked_jti: md.revoked_jti.iter().cloned().collect(),
            revoked_sub: md.revoked_sub.iter().cloned().collect(),
        };
        // Plain data with string keys only: serialising cannot fail.
        serde_json::to_vec(&wire).unwrap_or_default()
    }

    /// Reads a snapshot [`encode`](Self::encode) wrote.
    ///
    /// # Errors
    /// [`SnapshotError`]: not a snapshot, another version, or a state the metadata never holds
    /// (a shard count or replication factor out of range, a shard past its stream's count, a
    /// member listed twice).
    pub fn decode(bytes: &[u8]) -> Result<MetaSnapshot, SnapshotError> {
        #[derive(Deserialize)]
        struct Versioned {
            version: u32,
        }
        let v: Versioned = serde_json::from_slice(bytes).map_err(|e| SnapshotError::Decode(e.to_string()))?;
        if v.version != SNAPSHOT_VERSION {
            return Err(SnapshotError::Version(v.version));
        }
        let wire: Wire = serde_json::from_slice(bytes).map_err(|e| SnapshotError::Decode(e.to_string()))?;
        let invalid = |why: String| Err(SnapshotError::Invalid(why));
        let mut md = Metadata::default();
        for m in wire.members {
            let id = m.id.clone();
            if md.members.insert(id.clone(), m).is_some() {
                return invalid(format!("member {id} is listed twice"));
            }
        }
        for n in wire.names_of {
            let label = format!("{}/{}/{}", n.tenant, n.namespace, n.name);
            let key: Name = (n.kind, n.tenant, n.namespace, n.name);
            if md.registry.contains_key(&key) || md.replication.contains_key(&key) || md.ephemeral.contains(&key) {
                return invalid(format!("{label} is listed twice"));
            }
            if let Some(shards) = n.shards {
                if shards == 0 || shards > MAX_SHARDS {
                    return invalid(format!("{label} has {shards} shards (1..={MAX_SHARDS})"));
                }
                md.registry.insert(key.clone(), shards);
            }
            if let Some(rf) = n.replication {
                if !(2..=MAX_REPLICATION).contains(&rf) {
                    return invalid(format!("{label} has replication factor {rf} (2..={MAX_REPLICATION})"));
                }
                md.replication.insert(key.clone(), rf);
            }
            if n.ephemeral {
                md.ephemeral.insert(key.clone());
            }
            let shard = |s: u32| -> Result<ShardId, SnapshotError> {
                if n.shards.is_some_and(|count| s >= count) || s >= MAX_SHARDS {
                    return Err(SnapshotError::Invalid(format!("{label} has no shard {s}")));
                }
                Ok(ShardId {
                    kind: key.0,
                    tenant: key.1.clone(),
                    namespace: key.2.clone(),
                    name: key.3.clone(),
                    shard: s,
                })
            };
            for (s, owner, generation) in n.owners {
                if md.owners.insert(shard(s)?, Assignment { owner, generation }).is_some() {
                    return invalid(format!("{label} shard {s} has two owners"));
                }
            }
            for (s, replicas, term) in n.replicas {
                if replicas.len() > MAX_REPLICATION as usize {
                    return invalid(format!("{label} shard {s} has {} replicas", replicas.len()));
                }
                if md.replicas.insert(shard(s)?, (replicas, term)).is_some() {
                    return invalid(format!("{label} shard {s} has two replica sets"));
                }
            }
            for (s, m) in n.moves {
                if md.moves.insert(shard(s)?, m).is_some() {
                    return invalid(format!("{label} shard {s} has two moves"));
                }
            }
            for (s, to) in n.pins {
                if md.pins.insert(shard(s)?, to).is_some() {
                    return invalid(format!("{label} shard {s} is pinned twice"));
                }
            }
        }
        md.revoked_jti = wire.revoked_jti.into_iter().collect();
        md.revoked_sub = wire.revoked_sub.into_iter().collect();
        let mut names = BTreeMap::new();
        for (id, n) in wire.names {
            if id == 0 || names.insert(id, n).is_some() {
                return invalid(format!("raft id {id} is named twice (or is 0)"));
            }
        }
        Ok(MetaSnapshot {
            metadata: md,
            names,
            addrs: wire.addrs.into_iter().collect(),
            removed: wire.removed.into_iter().collect(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::{Command, MemberState};
    use super::*;

    fn member(id: &str) -> Member {
        Member {
            id: id.into(),
            client_addr: format!("{id}:7000"),
            cluster_addr: format!("{id}:7001"),
            state: MemberState::Active,
            incarnation: format!("inc-{id}"),
        }
    }

    /// Metadata with every kind of thing it holds: members in each state, registered streams
    /// and caches (ephemeral, replicated), owners, replicas with leader terms, a move, a pin
    /// and revocations.
    fn busy() -> Metadata {
        let mut md = Metadata::default();
        for id in ["n1", "n2", "n3", "n4"] {
            md.apply(&Command::Join { member: member(id) }).unwrap();
        }
        let create = |kind, name: &str, shards, ephemeral, replication| Command::Create {
            kind,
            tenant: "t".into(),
            namespace: "ns".into(),
            name: name.into(),
            shards,
            ephemeral,
            replication,
        };
        md.apply(&create(Kind::Stream, "plain", 4, false, 1)).unwrap();
        md.apply(&create(Kind::Stream, "mem", 2, true, 1)).unwrap();
        md.apply(&create(Kind::Stream, "quorum", 3, false, 3)).unwrap();
        md.apply(&create(Kind::Cache, "c", 2, false, 1)).unwrap();
        let q0 = ShardId::of(Kind::Stream, "t", "ns", "quorum", 0);
        let leader = md.replicas(&q0).unwrap()[1].clone();
        md.apply(&Command::Lead { shard: q0, node: leader, term: 7 }).unwrap();
        let p1 = ShardId::of(Kind::Stream, "t", "ns", "plain", 1);
        let to = ["n1", "n2", "n3", "n4"].into_iter().find(|n| md.owner(&p1).unwrap().owner != *n).unwrap();
        md.apply(&Command::MoveShard { shard: p1, to: to.into() }).unwrap();
        md.apply(&Command::Drain { id: "n4".into() }).unwrap();
        md.apply(&Command::MarkDown { id: "n3".into() }).unwrap();
        md.apply(&Command::Revoke { jti: Some("j1".into()), sub: Some("alice".into()) }).unwrap();
        md
    }

    fn snapshot(md: Metadata) -> MetaSnapshot {
        MetaSnapshot {
            metadata: md,
            names: [(1, "n1".into()), (2, "n2".into()), (9, "gone".into())].into(),
            addrs: [("n4".into(), "n4:7001".into())].into(),
            removed: ["gone".into()].into(),
        }
    }

    #[test]
    fn a_snapshot_reads_back_as_the_metadata_it_was_taken_of() {
        let md = busy();
        assert!(!md.moves().is_empty() && !md.pins().is_empty() && !md.revoked_jti().is_empty());
        let s = snapshot(md);
        let bytes = s.encode();
        assert_eq!(MetaSnapshot::decode(&bytes).unwrap(), s);
        // Deterministic: the same state, the same bytes.
        assert_eq!(snapshot(busy()).encode(), bytes);
        // And what follows applies to the restored copy as to the original.
        let mut a = s.metadata.clone();
        let mut b = MetaSnapshot::decode(&bytes).unwrap().metadata;
        for c in [
            Command::Delete { kind: Kind::Stream, tenant: "t".into(), namespace: "ns".into(), name: "plain".into() },
            Command::Join { member: member("n5") },
            Command::Rebalance,
        ] {
            assert_eq!(a.apply(&c), b.apply(&c));
        }
        assert_eq!(a, b);
    }

    #[test]
    fn an_empty_snapshot_reads_back_empty() {
        let s = MetaSnapshot::default();
        assert_eq!(MetaSnapshot::decode(&s.encode()).unwrap(), s);
    }

    #[test]
    fn a_damaged_newer_or_inconsistent_snapshot_is_refused_with_its_reason() {
        let bytes = snapshot(busy()).encode();
        // Damaged: cut short, or not JSON.
        assert!(matches!(MetaSnapshot::decode(&bytes[..bytes.len() / 2]), Err(SnapshotError::Decode(_))));
        assert!(matches!(MetaSnapshot::decode(b"\xff\x00"), Err(SnapshotError::Decode(_))));
        assert!(matches!(MetaSnapshot::decode(b"{}"), Err(SnapshotError::Decode(_))));
        // A newer format.
        let text = String::from_utf8(bytes.clone()).unwrap();
        let newer = text.replacen("\"version\":1", "\"version\":2", 1);
        assert_eq!(MetaSnapshot::decode(newer.as_bytes()), Err(SnapshotError::Version(2)));
        // Limits the metadata keeps.
        let bad = |from: &str, to: &str| {
            assert!(text.contains(from), "{from}");
            let t = text.replacen(from, to, 1);
            match MetaSnapshot::decode(t.as_bytes()) {
                Err(SnapshotError::Invalid(why)) => why,
                other => panic!("{from} -> {to}: {other:?}"),
            }
        };
        assert!(bad("\"shards\":4", "\"shards\":0").contains("0 shards"));
        assert!(bad("\"shards\":4", "\"shards\":99999").contains("99999 shards"));
        assert!(bad("\"replication\":3", "\"replication\":9").contains("replication factor 9"));
        assert!(bad("\"owners\":[[0,", "\"owners\":[[7,").contains("no shard 7"));
        assert!(bad("[[1,\"n1\"]", "[[0,\"n1\"]").contains("raft id 0"));
    }
}
