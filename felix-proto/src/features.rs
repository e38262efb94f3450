//! Feature bits: which requests and answer types exist.
//!
//! Features live in their own number space, separate from frame flags. On the wire they are two
//! `u32` words: `client_features`/`server_features`, and, only when bit 31
//! ([`FEATURE_EXTENDED`](Features::EXTENDED_MARKER)) of the first word is set, a second word
//! `*_features_hi`. It is a separate field rather than a wider number because an older broker
//! decodes `client_features` as a `u32` and would fail the whole `auth` on anything larger.
//!
//! [`Features`] holds both words as one `u64`: bits 0–30 are the first word, bit 31 is never
//! stored (the marker is derived when encoding), bits 32–63 are the second word.

use std::fmt;

/// A set of feature bits (both words). An absent advertisement is [`Features::NONE`].
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Features(pub u64);

macro_rules! feature_bits {
    ($( $(#[$doc:meta])* $name:ident = $value:expr, $wire:literal; )*) => {
        impl Features {
            $( $(#[$doc])* pub const $name: Features = Features($value); )*
            /// Every named feature with its spec name, first word then second word.
            pub const NAMED: &'static [(Features, &'static str)] = &[ $( (Features($value), $wire), )* ];
        }
    };
}

feature_bits! {
    /// The broker answers `topology`.
    TOPOLOGY = 0x0001, "FEATURE_TOPOLOGY";
    /// The peer understands `not_leader`.
    REDIRECT = 0x0002, "FEATURE_REDIRECT";
    /// The broker accepts `cache_delete`.
    CACHE_DELETE = 0x0004, "FEATURE_CACHE_DELETE";
    /// The broker serves `group_poll`, `group_ack`, `group_nack`.
    CONSUMER_GROUP = 0x0008, "FEATURE_CONSUMER_GROUP";
    /// The broker serves `group_dead_letters`, `group_discard`, `group_redrive`.
    GROUP_DEAD_LETTERS = 0x0010, "FEATURE_GROUP_DEAD_LETTERS";
    /// The broker answers `stream_shards`.
    STREAM_SHARDS = 0x0020, "FEATURE_STREAM_SHARDS";
    /// The broker accepts `cache_watch`.
    CACHE_WATCH = 0x0040, "FEATURE_CACHE_WATCH";
    /// The broker serves retained delivery on a `cache_watch`.
    CACHE_WATCH_RETAINED = 0x0080, "FEATURE_CACHE_WATCH_RETAINED";
    /// The broker serves `counter_add` and `counter_get`.
    COUNTERS = 0x0100, "FEATURE_COUNTERS";
    /// The broker serves `producer_init` and `publish_idempotent`; the client reads `publish_refused`.
    IDEMPOTENT_PRODUCER = 0x0200, "FEATURE_IDEMPOTENT_PRODUCER";
    /// The broker answers `cache_shards`.
    CACHE_SHARDS = 0x0400, "FEATURE_CACHE_SHARDS";
    /// The client reads `code`, `retry` and `detail` on errors.
    ERROR_CODES = 0x0800, "FEATURE_ERROR_CODES";
    /// The client reads `shard_moved` at the end of an event stream.
    SHARD_MOVED = 0x1000, "FEATURE_SHARD_MOVED";
    /// Unknown requests are answered `unsupported` and the stream is kept.
    UNSUPPORTED = 0x2000, "FEATURE_UNSUPPORTED";
    /// The client reads `publish_refused` with reason `sequence_reused`.
    SEQUENCE_REUSED = 0x4000, "FEATURE_SEQUENCE_REUSED";
    /// Acked publishes are pipelined under a `publish_window`.
    PUBLISH_PIPELINE = 0x8000, "FEATURE_PUBLISH_PIPELINE";
    /// The broker accepts `commit` and `state_get` (upstream; the spec's table skips the bit).
    ATOMIC_COMMIT = 0x0001_0000, "FEATURE_ATOMIC_COMMIT";
    /// The `publish_window` is per stream rather than per connection.
    STREAM_PUBLISH_WINDOW = 0x0002_0000, "FEATURE_STREAM_PUBLISH_WINDOW";
    /// The broker answers `shard_owners`.
    SHARD_OWNERS = 0x0004_0000, "FEATURE_SHARD_OWNERS";
    /// Acked publishes are answered after the write, with offsets.
    ACK_ON_COMMIT = 0x0008_0000, "FEATURE_ACK_ON_COMMIT";
    /// A `group_poll` may name its consumer, with `reclaim`.
    GROUP_CONSUMER = 0x0010_0000, "FEATURE_GROUP_CONSUMER";
    /// The client reads `subscription_lagged`.
    SUBSCRIPTION_LAGGED = 0x0020_0000, "FEATURE_SUBSCRIPTION_LAGGED";
    /// The client reads `skipped_before` on group records.
    GROUP_SKIPPED = 0x0040_0000, "FEATURE_GROUP_SKIPPED";
    /// The client reads `publisher` on group records.
    GROUP_PUBLISHER = 0x0080_0000, "FEATURE_GROUP_PUBLISHER";
    /// The broker serves `group_seek`, `group_describe`, `group_delete`.
    GROUP_ADMIN = 0x0100_0000, "FEATURE_GROUP_ADMIN";
    /// Conditional cache writes; `version` on `cache_value`.
    CACHE_CONDITIONAL = 0x0200_0000, "FEATURE_CACHE_CONDITIONAL";
    /// `offset_for_time`; `timestamp_micros` on group records.
    RECORD_TIMESTAMPS = 0x0400_0000, "FEATURE_RECORD_TIMESTAMPS";
    /// `group_extend`, `group_dead_letter`, and the claim-control fields.
    GROUP_CLAIM_CONTROL = 0x0800_0000, "FEATURE_GROUP_CLAIM_CONTROL";
    /// `publish_if` and `expected_offset` on `commit`.
    PUBLISH_CONDITIONAL = 0x1000_0000, "FEATURE_PUBLISH_CONDITIONAL";
    /// `stream_read` → `stream_records`.
    STREAM_READ = 0x2000_0000, "FEATURE_STREAM_READ";
    /// `queue_capacity` on `subscribe`.
    SUBSCRIBE_QUEUE = 0x4000_0000, "FEATURE_SUBSCRIBE_QUEUE";
    /// Second word, bit 0x1: `shard_inspect` and `subscriptions_list`.
    INSPECT = 1 << 32, "FEATURE_INSPECT";
    /// Second word, bit 0x2: the client reads `stream_deleted`.
    STREAM_DELETED = 1 << 33, "FEATURE_STREAM_DELETED";
    /// Second word, bit 0x4: the broker takes `publish_width` and refuses stale widths.
    PUBLISH_WIDTH = 1 << 34, "FEATURE_PUBLISH_WIDTH";
    /// Second word, bit 0x8 (our decision, docs/protocol.md): the broker takes an explicit `shard`.
    EXPLICIT_SHARD = 1 << 35, "FEATURE_EXPLICIT_SHARD";
    /// Second word, bit 0x10 (our decision D43, docs/protocol.md): the broker serves
    /// `stream_delete` for a token with the admin permission.
    STREAM_ADMIN = 1 << 36, "FEATURE_STREAM_ADMIN";
    /// Second word, bit 0x20 (our decision D50, docs/protocol.md): the broker serves
    /// `group_list` and `cache_keys`.
    LISTING = 1 << 37, "FEATURE_LISTING";
    /// Second word, bit 0x40 (our decision D51, docs/protocol.md): the broker serves
    /// `stream_list` and `stream_info`.
    STREAM_INFO = 1 << 38, "FEATURE_STREAM_INFO";
    /// Second word, bit 0x80 (our decision D52, docs/protocol.md): the broker serves
    /// `cluster_status` and `shard_move`.
    CLUSTER_ADMIN = 1 << 39, "FEATURE_CLUSTER_ADMIN";
    /// Second word, bit 0x100 (our decision D55, docs/protocol.md): the broker answers a
    /// `cluster_status` with `after`/`limit` with one page of the status.
    STATUS_PAGES = 1 << 40, "FEATURE_STATUS_PAGES";
    /// Second word, bit 0x200 (our decision D57, docs/protocol.md): the broker takes a
    /// `filter` on `subscribe`, on record keys, and sends only the batches it matches.
    STREAM_FILTER = 1 << 41, "FEATURE_STREAM_FILTER";
    /// Second word, bit 0x400 (our decision D60, docs/protocol.md): the broker serves
    /// `stream_create`, many streams in one request.
    STREAM_CREATE = 1 << 42, "FEATURE_STREAM_CREATE";
}

impl Features {
    /// No features: what an absent advertisement means.
    pub const NONE: Features = Features(0);
    /// Bit 31 of the first word: "a second word follows". Not a feature; never stored.
    pub const EXTENDED_MARKER: u32 = 0x8000_0000;

    /// Builds a set from the two wire words. The second word counts only when the first has the
    /// extended marker, as the spec says a reader must.
    pub fn from_words(lo: Option<u32>, hi: Option<u32>) -> Features {
        let lo = lo.unwrap_or(0);
        let hi = if lo & Self::EXTENDED_MARKER != 0 { hi.unwrap_or(0) } else { 0 };
        Features(u64::from(lo & !Self::EXTENDED_MARKER) | (u64::from(hi) << 32))
    }

    /// The two wire words. The first carries the extended marker exactly when the second word is
    /// non-zero and `may_extend` (a broker extends only toward a client that set the marker).
    /// `None` for a word means "leave the field out".
    pub fn to_words(self, may_extend: bool) -> (Option<u32>, Option<u32>) {
        let lo = (self.0 & 0x7FFF_FFFF) as u32;
        let hi = (self.0 >> 32) as u32;
        if hi != 0 && may_extend {
            (Some(lo | Self::EXTENDED_MARKER), Some(hi))
        } else if lo != 0 {
            (Some(lo), None)
        } else {
            (None, None)
        }
    }

    /// True when every bit of `other` is set.
    pub const fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }
    /// Bitwise union.
    pub const fn union(self, other: Features) -> Features {
        Features(self.0 | other.0)
    }
    /// Bitwise intersection.
    pub const fn intersection(self, other: Features) -> Features {
        Features(self.0 & other.0)
    }
    /// Bits of `self` not in `other`.
    pub const fn difference(self, other: Features) -> Features {
        Features(self.0 & !other.0)
    }
    /// True when no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// Whether the set has any bit in the second word.
    pub const fn has_extended(self) -> bool {
        self.0 >> 32 != 0
    }
    /// Every feature this implementation knows a name for.
    pub fn known() -> Features {
        Features::NAMED.iter().fold(Features::NONE, |acc, (f, _)| acc.union(*f))
    }
    /// Names of the set's features, for logs and `--help`.
    pub fn names(self) -> Vec<&'static str> {
        Features::NAMED.iter().filter(|(f, _)| self.contains(*f)).map(|(_, n)| *n).collect()
    }
}

impl fmt::Debug for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Features({:#x})", self.0)
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        self.union(rhs)
    }
}

impl std::ops::BitOrAssign for Features {
    fn bitor_assign(&mut self, rhs: Features) {
        *self = self.union(rhs);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_example_words_round_trip() {
        // auth with EXTENDED | TOPOLOGY and hi word 1 (FEATURE_INSPECT).
        let f = Features::from_words(Some(2_147_483_649), Some(1));
        assert_eq!(f, Features::TOPOLOGY | Features::INSPECT);
        assert_eq!(f.to_words(true), (Some(2_147_483_649), Some(1)));
    }

    #[test]
    fn hi_word_counts_only_with_marker() {
        assert_eq!(Features::from_words(Some(1), Some(7)), Features::TOPOLOGY);
        assert_eq!(Features::from_words(None, Some(7)), Features::NONE);
    }

    #[test]
    fn no_extension_toward_a_peer_without_the_marker() {
        let f = Features::ERROR_CODES | Features::STREAM_DELETED;
        assert_eq!(f.to_words(false), (Some(0x0800), None));
        assert_eq!(Features::NONE.to_words(true), (None, None));
        assert_eq!(Features::INSPECT.to_words(false), (None, None));
    }

    #[test]
    fn upstream_standalone_example_decodes() {
        let f = Features::from_words(Some(196_132), None);
        for want in [
            Features::CACHE_DELETE,
            Features::STREAM_SHARDS,
            Features::IDEMPOTENT_PRODUCER,
            Features::CACHE_SHARDS,
            Features::ERROR_CODES,
            Features::SHARD_MOVED,
            Features::UNSUPPORTED,
            Features::SEQUENCE_REUSED,
            Features::PUBLISH_PIPELINE,
            Features::STREAM_PUBLISH_WINDOW,
        ] {
            assert!(f.contains(want), "{want:?}");
        }
        assert_eq!(f.names().len(), 10);
    }
}
