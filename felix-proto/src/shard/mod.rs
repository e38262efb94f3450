//! What a shard is, below the broker and the cluster both: its identity ([`ShardId`], [`Kind`])
//! and, in [`replicated`], a replicated shard's write as its Raft log holds it and the answer
//! its group gives. The broker hosts shards and the cluster places and replicates them; both
//! name them with these types, which therefore depend on neither (the arrows go broker → shard
//! and cluster → shard, never between the two).

use serde::{Deserialize, Serialize};

pub mod bandwidth;
pub(crate) mod cache_op;
pub mod copy;
pub mod forward;
pub mod metadata;
pub(crate) mod moving;
pub mod page;
pub mod replicated;
pub(crate) mod view;

/// Stream or cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Kind {
    /// A stream.
    Stream,
    /// A cache.
    Cache,
}

/// One shard of a stream or cache.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ShardId {
    /// Stream or cache.
    pub kind: Kind,
    /// Tenant.
    pub tenant: String,
    /// Namespace.
    pub namespace: String,
    /// Name.
    pub name: String,
    /// Shard number.
    pub shard: u32,
}

impl ShardId {
    /// Shard `shard` of `kind` `name` in `tenant`/`namespace`.
    pub fn of(kind: Kind, tenant: &str, namespace: &str, name: &str, shard: u32) -> ShardId {
        ShardId { kind, tenant: tenant.to_owned(), namespace: namespace.to_owned(), name: name.to_owned(), shard }
    }

    /// The shard as one opaque string, `KIND~tenant~namespace~name~shard` with each name as a
    /// [`path_component`](crate::storage::path_component) (so `~` never appears inside one):
    /// the cursor a paged status names a shard by (D55). [`from_cursor`](Self::from_cursor)
    /// reads it back.
    pub fn cursor(&self) -> String {
        use crate::storage::path_component as pc;
        let kind = if self.kind == Kind::Cache { "cache" } else { "stream" };
        format!("{kind}~{}~{}~{}~{}", pc(&self.tenant), pc(&self.namespace), pc(&self.name), self.shard)
    }

    /// Reads a [`cursor`](Self::cursor); `None` for a string it could not have produced.
    pub fn from_cursor(s: &str) -> Option<ShardId> {
        use crate::storage::parse_path_component as pc;
        let parts: Vec<&str> = s.split('~').collect();
        let [kind, tenant, namespace, name, shard] = parts.as_slice() else { return None };
        let kind = match *kind {
            "stream" => Kind::Stream,
            "cache" => Kind::Cache,
            _ => return None,
        };
        let shard = shard.parse().ok().filter(|_| shard.bytes().all(|b| b.is_ascii_digit()))?;
        Some(ShardId { kind, tenant: pc(tenant)?, namespace: pc(namespace)?, name: pc(name)?, shard })
    }
}

/// The largest shard count of one stream or cache.
pub const MAX_SHARDS: u32 = 4096;
