//! Frame flag bits: the `flags` field of the 12-byte header.
//!
//! A flag decides how a payload is parsed, so a receiver never masks off a bit it does not
//! understand: it rejects the frame instead (a masked bit 0x0008 would make the receiver read a
//! `request_id` as a `tenant_len`). [`Flags::validate`] is the single place that enforces which
//! bits exist and which bits need which others.

use std::fmt;

/// A set of frame flag bits. Any `u16` can be held; [`Flags::validate`] says whether it is a
/// combination a frame may carry.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Flags(pub u16);

macro_rules! flag_bits {
    ($( $(#[$doc:meta])* $name:ident = $value:expr, $wire:literal; )*) => {
        impl Flags {
            $( $(#[$doc])* pub const $name: Flags = Flags($value); )*
            /// Every named bit with its upstream constant name, lowest bit first.
            pub const NAMED: &'static [(Flags, &'static str)] = &[ $( (Flags($value), $wire), )* ];
        }
    };
}

flag_bits! {
    /// Bit 0: the payload is a binary publish batch (client → broker).
    BINARY_PUBLISH_BATCH = 0x0001, "FLAG_BINARY_PUBLISH_BATCH";
    /// Bit 1: legacy per-subscriber binary event batch (leading `subscription_id`).
    BINARY_EVENT_BATCH = 0x0002, "FLAG_BINARY_EVENT_BATCH";
    /// Bit 2: shared binary event batch, encoded once and sent to every subscriber.
    BINARY_EVENT_BATCH_SHARED = 0x0004, "FLAG_BINARY_EVENT_BATCH_SHARED";
    /// Bit 3: acked publish batch; prefixes the body with `request_id` and `ack_mode`.
    BINARY_PUBLISH_ACKED = 0x0008, "FLAG_BINARY_PUBLISH_ACKED";
    /// Bit 4: the payload is a binary publish acknowledgement (broker → client).
    BINARY_PUBLISH_ACK = 0x0010, "FLAG_BINARY_PUBLISH_ACK";
    /// Bit 5: event batch carries a `base_offset`.
    EVENT_BATCH_OFFSETS = 0x0020, "FLAG_EVENT_BATCH_OFFSETS";
    /// Bit 6: publish batch carries a routing key prefix.
    BINARY_PUBLISH_KEYED = 0x0040, "FLAG_BINARY_PUBLISH_KEYED";
    /// Bit 7: the ack names the shard's owner (the batch was forwarded).
    BINARY_PUBLISH_ACK_OWNER = 0x0080, "FLAG_BINARY_PUBLISH_ACK_OWNER";
    /// Bit 8: publish batch carries an idempotent producer's id and sequence.
    BINARY_PUBLISH_IDEMPOTENT = 0x0100, "FLAG_BINARY_PUBLISH_IDEMPOTENT";
    /// Bit 9: a failed ack carries an error code and retry class.
    BINARY_PUBLISH_ACK_CODE = 0x0200, "FLAG_BINARY_PUBLISH_ACK_CODE";
    /// Bit 10: a failed ack's code is followed by its detail (reason, suggested wait).
    BINARY_PUBLISH_ACK_DETAIL = 0x0400, "FLAG_BINARY_PUBLISH_ACK_DETAIL";
    /// Bit 11: event batch carries `skipped_before`.
    EVENT_BATCH_SKIPPED = 0x0800, "FLAG_EVENT_BATCH_SKIPPED";
    /// Bit 12: a successful ack ends with the offset of the batch's first record.
    BINARY_PUBLISH_ACK_OFFSET = 0x1000, "FLAG_BINARY_PUBLISH_ACK_OFFSET";
    /// Bit 13: event batch carries the publishing principal.
    EVENT_BATCH_PUBLISHER = 0x2000, "FLAG_EVENT_BATCH_PUBLISHER";
    /// Bit 14: each event is preceded by its record's append time.
    EVENT_BATCH_TIMESTAMPS = 0x4000, "FLAG_EVENT_BATCH_TIMESTAMPS";
    /// Bit 15 (D56): a second flag word ([`FlagsHi`]) opens the payload. Offered with
    /// `client_flags_hi`, advertised with `server_flags_hi`, and only to a client that set it.
    EXTENDED = 0x8000, "FLAG_EXTENDED";
}

impl Flags {
    /// No bits: a JSON control message.
    pub const EMPTY: Flags = Flags(0);
    /// Every bit this implementation understands: bits 0–14, and bit 15, which says a second
    /// word follows (D56).
    pub const KNOWN: Flags = Flags(0xFFFF);
    /// What an absent advertisement means: the bits that predate negotiation.
    ///
    /// Frozen forever. A peer that predates negotiation cannot be asked what it supports, so
    /// adding a bit here would make clients assume support that older brokers lack.
    pub const ORIGINAL_V1: Flags = Flags(0x0001 | 0x0002 | 0x0004);
    /// The "kind" bits: at most one of them selects the payload layout.
    pub const KINDS: Flags = Flags(0x0001 | 0x0002 | 0x0004 | 0x0010);
    /// Bits a client may put on a frame it sends (publish family).
    pub const CLIENT_SENDS: Flags = Flags(0x0001 | 0x0008 | 0x0040 | 0x0100 | 0x8000);
    /// Bits a broker may put on a frame it sends (acks and event batches).
    pub const BROKER_SENDS: Flags = Flags(!(0x0001 | 0x0008 | 0x0040 | 0x0100));
    /// Bits a broker sets toward a client only if that client offered them.
    pub const OFFER_GATED: Flags =
        Flags(0x0020 | 0x0080 | 0x0200 | 0x0400 | 0x0800 | 0x1000 | 0x2000 | 0x4000 | 0x8000);

    /// The raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }
    /// True when every bit of `other` is set here.
    pub const fn contains(self, other: Flags) -> bool {
        self.0 & other.0 == other.0
    }
    /// True when any bit of `other` is set here.
    pub const fn intersects(self, other: Flags) -> bool {
        self.0 & other.0 != 0
    }
    /// Bitwise union.
    pub const fn union(self, other: Flags) -> Flags {
        Flags(self.0 | other.0)
    }
    /// Bitwise intersection.
    pub const fn intersection(self, other: Flags) -> Flags {
        Flags(self.0 & other.0)
    }
    /// Bits of `self` not in `other`.
    pub const fn difference(self, other: Flags) -> Flags {
        Flags(self.0 & !other.0)
    }
    /// True when no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }
    /// `self` with `other` set or cleared.
    pub const fn with(self, other: Flags, on: bool) -> Flags {
        if on { self.union(other) } else { self.difference(other) }
    }

    /// The modifier dependencies: `(bit, any of these must also be set)`.
    pub const DEPENDENCIES: &'static [(Flags, Flags)] = &[
        (Flags::BINARY_PUBLISH_ACKED, Flags::BINARY_PUBLISH_BATCH),
        (Flags::BINARY_PUBLISH_KEYED, Flags::BINARY_PUBLISH_BATCH),
        (Flags::BINARY_PUBLISH_IDEMPOTENT, Flags::BINARY_PUBLISH_ACKED),
        (Flags::BINARY_PUBLISH_ACK_OWNER, Flags::BINARY_PUBLISH_ACK),
        (Flags::BINARY_PUBLISH_ACK_CODE, Flags::BINARY_PUBLISH_ACK),
        (Flags::BINARY_PUBLISH_ACK_DETAIL, Flags::BINARY_PUBLISH_ACK_CODE),
        (Flags::BINARY_PUBLISH_ACK_OFFSET, Flags::BINARY_PUBLISH_ACK),
        (Flags::EVENT_BATCH_OFFSETS, Flags(0x0002 | 0x0004)),
        (Flags::EVENT_BATCH_SKIPPED, Flags::EVENT_BATCH_OFFSETS),
        (Flags::EVENT_BATCH_PUBLISHER, Flags(0x0002 | 0x0004)),
        (Flags::EVENT_BATCH_TIMESTAMPS, Flags(0x0002 | 0x0004)),
        // A second word is defined for publish batches and shared event batches only.
        (Flags::EXTENDED, Flags(0x0001 | 0x0004)),
    ];

    /// Checks that this set is one a frame may carry: only known bits, at most one kind bit,
    /// and every modifier together with the bit it modifies.
    ///
    /// # Errors
    /// The first rule broken, as a [`FlagError`].
    pub fn validate(self) -> Result<Flags, FlagError> {
        let unknown = self.difference(Flags::KNOWN);
        if !unknown.is_empty() {
            return Err(FlagError::Unknown { flags: self.0, unknown: unknown.0 });
        }
        if self.intersection(Flags::KINDS).0.count_ones() > 1 {
            return Err(FlagError::ConflictingKinds { flags: self.0 });
        }
        for &(bit, requires) in Flags::DEPENDENCIES {
            if self.contains(bit) && !self.intersects(requires) {
                return Err(FlagError::MissingBase { flags: self.0, bit: bit.0, requires: requires.0 });
            }
        }
        Ok(self)
    }

    /// Bits that are not part of the frame's own layout selection but of what was offered.
    /// Used to word error messages.
    pub fn names(self) -> Vec<&'static str> {
        Flags::NAMED.iter().filter(|(f, _)| self.contains(*f)).map(|(_, n)| *n).collect()
    }
}

impl fmt::Debug for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Flags({:#06x})", self.0)
    }
}

impl fmt::Display for Flags {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:#06x}", self.0)
    }
}

impl std::ops::BitOr for Flags {
    type Output = Flags;
    fn bitor(self, rhs: Flags) -> Flags {
        self.union(rhs)
    }
}

impl std::ops::BitOrAssign for Flags {
    fn bitor_assign(&mut self, rhs: Flags) {
        *self = self.union(rhs);
    }
}

impl std::ops::BitAnd for Flags {
    type Output = Flags;
    fn bitand(self, rhs: Flags) -> Flags {
        self.intersection(rhs)
    }
}

/// The second flag word (D56): the payload's first two bytes when the header carries
/// [`Flags::EXTENDED`]; offered as `client_flags_hi` and advertised as `server_flags_hi`. Like
/// the first word it selects how the payload is parsed, so an unknown bit is refused, and a
/// frame never carries an all-zero second word (it would then not set [`Flags::EXTENDED`]).
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FlagsHi(pub u16);

impl FlagsHi {
    /// No bits.
    pub const EMPTY: FlagsHi = FlagsHi(0);
    /// 0x0001: the record block is compressed with zstd (publish batches and shared event
    /// batches; offered, it means "I decode zstd").
    pub const COMPRESSED_ZSTD: FlagsHi = FlagsHi(0x0001);
    /// 0x0002: the record block is compressed with lz4.
    pub const COMPRESSED_LZ4: FlagsHi = FlagsHi(0x0002);
    /// 0x0004 (D58): the batch carries an envelope (`u16 envelope_len, envelope`), opaque to
    /// the broker: end-to-end encryption's key id and algorithm, stored and delivered as sent.
    pub const ENVELOPE: FlagsHi = FlagsHi(0x0004);
    /// The codec bits: a frame carries at most one.
    pub const CODECS: FlagsHi = FlagsHi(0x0003);
    /// Every second-word bit this implementation understands.
    pub const KNOWN: FlagsHi = FlagsHi(0x0007);
    /// Every named bit with its constant name.
    pub const NAMED: &'static [(FlagsHi, &'static str)] = &[
        (FlagsHi(0x0001), "FLAG_HI_COMPRESSED_ZSTD"),
        (FlagsHi(0x0002), "FLAG_HI_COMPRESSED_LZ4"),
        (FlagsHi(0x0004), "FLAG_HI_ENVELOPE"),
    ];

    /// The raw bits.
    pub const fn bits(self) -> u16 {
        self.0
    }
    /// True when every bit of `other` is set here.
    pub const fn contains(self, other: FlagsHi) -> bool {
        self.0 & other.0 == other.0
    }
    /// Bitwise union.
    pub const fn union(self, other: FlagsHi) -> FlagsHi {
        FlagsHi(self.0 | other.0)
    }
    /// Bitwise intersection.
    pub const fn intersection(self, other: FlagsHi) -> FlagsHi {
        FlagsHi(self.0 & other.0)
    }
    /// True when no bit is set.
    pub const fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// Checks a second word read off a frame: non-zero, known bits only, at most one codec.
    ///
    /// # Errors
    /// The rule broken, as a [`FlagsHiError`].
    pub fn validate(self) -> Result<FlagsHi, FlagsHiError> {
        if self.is_empty() {
            return Err(FlagsHiError::Empty);
        }
        let unknown = self.0 & !FlagsHi::KNOWN.0;
        if unknown != 0 {
            return Err(FlagsHiError::Unknown { flags: self.0, unknown });
        }
        if (self.0 & FlagsHi::CODECS.0).count_ones() > 1 {
            return Err(FlagsHiError::TwoCodecs { flags: self.0 });
        }
        Ok(self)
    }
}

impl fmt::Debug for FlagsHi {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FlagsHi({:#06x})", self.0)
    }
}

impl std::ops::BitOr for FlagsHi {
    type Output = FlagsHi;
    fn bitor(self, rhs: FlagsHi) -> FlagsHi {
        self.union(rhs)
    }
}

/// Why a second flag word cannot be carried by a frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FlagsHiError {
    /// [`Flags::EXTENDED`] with an all-zero second word (a frame with nothing in its second
    /// word does not carry one).
    #[error("second flag word is empty")]
    Empty,
    /// A bit this implementation does not know.
    #[error("unsupported second flag word {flags:#06x}: unknown bits {unknown:#06x}")]
    Unknown {
        /// The word.
        flags: u16,
        /// The bits not recognised.
        unknown: u16,
    },
    /// Two codecs at once.
    #[error("second flag word {flags:#06x} names two codecs")]
    TwoCodecs {
        /// The word.
        flags: u16,
    },
}

/// Why a flag set cannot be carried by a frame. The frame's length is still trustworthy, so the
/// stream survives: the receiver skips the payload and answers `invalid_request`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FlagError {
    /// A bit outside [`Flags::KNOWN`] (bit 15 today).
    #[error("unsupported frame flags {flags:#06x}: unknown bits {unknown:#06x}")]
    Unknown {
        /// The header's flags.
        flags: u16,
        /// The bits not recognised.
        unknown: u16,
    },
    /// Two layout-selecting bits at once (e.g. 0x0001 with 0x0010, or 0x0002 with 0x0004).
    #[error("unsupported frame flags {flags:#06x}: more than one payload kind bit")]
    ConflictingKinds {
        /// The header's flags.
        flags: u16,
    },
    /// A modifier without the bit it modifies (e.g. 0x0400 without 0x0200).
    #[error("unsupported frame flags {flags:#06x}: bit {bit:#06x} requires {requires:#06x}")]
    MissingBase {
        /// The header's flags.
        flags: u16,
        /// The modifier bit.
        bit: u16,
        /// The bit (or any of the bits) it needs.
        requires: u16,
    },
    /// A known, well-formed bit that this side did not negotiate, or that the sender's role may
    /// not set (a broker never receives 0x0010; a client never receives 0x0001).
    #[error("unsupported frame flags {flags:#06x}: bits {bits:#06x} were not negotiated")]
    NotNegotiated {
        /// The header's flags.
        flags: u16,
        /// The offending bits.
        bits: u16,
    },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn original_v1_is_frozen() {
        assert_eq!(Flags::ORIGINAL_V1.bits(), 0x0007);
    }

    #[test]
    fn every_valid_publish_set_validates() {
        for bits in [0x0001, 0x0041, 0x0009, 0x0049, 0x0109, 0x0149] {
            assert_eq!(Flags(bits).validate(), Ok(Flags(bits)), "{bits:#x}");
        }
    }

    #[test]
    fn dependency_violations_are_rejected() {
        let cases = [
            (0x0008, 0x0008, 0x0001),
            (0x0040, 0x0040, 0x0001),
            (0x0101, 0x0100, 0x0008),
            (0x0410, 0x0400, 0x0200),
            (0x0804, 0x0800, 0x0020),
            (0x0020, 0x0020, 0x0006),
            (0x1000, 0x1000, 0x0010),
            (0x0080, 0x0080, 0x0010),
            (0x2000, 0x2000, 0x0006),
            (0x4000, 0x4000, 0x0006),
        ];
        for (flags, bit, requires) in cases {
            assert_eq!(Flags(flags).validate(), Err(FlagError::MissingBase { flags, bit, requires }), "{flags:#x}");
        }
    }

    #[test]
    fn unknown_and_conflicting_bits_are_rejected() {
        // Every bit of the first word is known since bit 15 became the second word's marker
        // (D56); a second word alone is not a frame.
        assert_eq!(Flags(0x8001).validate(), Ok(Flags(0x8001)));
        assert_eq!(
            Flags(0x8000).validate(),
            Err(FlagError::MissingBase { flags: 0x8000, bit: 0x8000, requires: 0x0005 })
        );
        assert_eq!(
            Flags(0x8010).validate(),
            Err(FlagError::MissingBase { flags: 0x8010, bit: 0x8000, requires: 0x0005 })
        );
        assert_eq!(FlagsHi(0).validate(), Err(FlagsHiError::Empty));
        assert_eq!(FlagsHi(0x0008).validate(), Err(FlagsHiError::Unknown { flags: 8, unknown: 8 }));
        assert_eq!(FlagsHi(0x0005).validate(), Ok(FlagsHi(0x0005)));
        assert_eq!(FlagsHi(0x0003).validate(), Err(FlagsHiError::TwoCodecs { flags: 3 }));
        assert_eq!(Flags(0x0006).validate(), Err(FlagError::ConflictingKinds { flags: 6 }));
        assert_eq!(Flags(0x0011).validate(), Err(FlagError::ConflictingKinds { flags: 0x11 }));
    }

    #[test]
    fn every_event_combination_validates() {
        for kind in [0x0002u16, 0x0004] {
            for extra in 0..16u16 {
                let mut f = kind;
                if extra & 1 != 0 {
                    f |= 0x0020;
                }
                if extra & 2 != 0 {
                    f |= 0x0800;
                }
                if extra & 4 != 0 {
                    f |= 0x2000;
                }
                if extra & 8 != 0 {
                    f |= 0x4000;
                }
                let ok = f & 0x0800 == 0 || f & 0x0020 != 0;
                assert_eq!(Flags(f).validate().is_ok(), ok, "{f:#x}");
            }
        }
    }
}
