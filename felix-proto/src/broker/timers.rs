//! What comes due at a time of its own: each kind in a set ordered by deadline, so that
//! `poll_timeout` reads the first entry of each instead of scanning every stream, subscription
//! or shard (entries whose subject went away are removed when that happens, or skipped when
//! they come due), and the once-a-second sweep.

use super::{Credential, Key};
use crate::transport::{ConnId, StreamId};
use std::collections::BTreeSet;
use std::time::Instant;

#[derive(Debug, Default)]
pub(super) struct Timers {
    /// Authentication deadlines of control streams.
    pub(super) auth: BTreeSet<(Instant, ConnId, StreamId)>,
    /// Streams paused for their tenant's rate, and when they are read again.
    pub(super) rate: BTreeSet<(Instant, ConnId, StreamId)>,
    /// Subscriptions and watches opened with a signed token: (its expiry in seconds, connection,
    /// subscription, the token), ended `revoked` when it comes or the token is revoked.
    pub(super) expiries: BTreeSet<(u64, ConnId, u64, Credential)>,
    /// Shards holding their publishers for a slow subscriber, by deadline.
    pub(super) holds: BTreeSet<(Instant, Key, u32)>,
    /// The once-a-second sweep (retention by age, caches' expiries, retained-bytes quotas),
    /// set from the first connection on.
    pub(super) sweep: Option<Instant>,
    /// A shard's commit state is owed to storage (a write's truncation moved its start within a
    /// second of its last checkpoint): the sweep comes even on an otherwise idle broker, so the
    /// segments storage keeps for it go.
    pub(super) checkpoint_owed: bool,
}
