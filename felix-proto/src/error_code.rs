//! Error codes and retry classes, with their wire names (JSON) and numbers (binary acks).
//!
//! A client must accept a code it does not know: unknown codes are kept (as a name or a number),
//! never rejected, and the retry class is what the client acts on.

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

macro_rules! error_codes {
    ($( $(#[$doc:meta])* $name:ident = $num:literal, $wire:literal, $retry:ident; )*) => {
        /// A protocol error code (`error.code`, `publish_error.code`, binary ack `u16 code`).
        #[derive(Clone, PartialEq, Eq, Hash)]
        #[non_exhaustive]
        pub enum ErrorCode {
            $( $(#[$doc])* $name, )*
            /// A number this implementation does not know (binary acks). Named `code_<n>`.
            UnknownNumber(u16),
            /// A name this implementation does not know (JSON). Its number is 0 (never sent).
            UnknownName(String),
        }

        impl ErrorCode {
            /// Every known code, in number order.
            pub const ALL: &'static [ErrorCode] = &[ $( ErrorCode::$name, )* ];

            /// The wire name.
            pub fn name(&self) -> std::borrow::Cow<'static, str> {
                match self {
                    $( ErrorCode::$name => std::borrow::Cow::Borrowed($wire), )*
                    ErrorCode::UnknownNumber(n) => std::borrow::Cow::Owned(format!("code_{n}")),
                    ErrorCode::UnknownName(s) => std::borrow::Cow::Owned(s.clone()),
                }
            }

            /// The binary ack number. `0` for an unknown name (never sent).
            pub fn number(&self) -> u16 {
                match self {
                    $( ErrorCode::$name => $num, )*
                    ErrorCode::UnknownNumber(n) => *n,
                    ErrorCode::UnknownName(_) => 0,
                }
            }

            /// Looks a code up by number; unknown numbers are kept.
            pub fn from_number(n: u16) -> ErrorCode {
                match n {
                    $( $num => ErrorCode::$name, )*
                    other => ErrorCode::UnknownNumber(other),
                }
            }

            /// Looks a code up by name; unknown names are kept (`code_<n>` maps back to its number).
            pub fn from_name(s: &str) -> ErrorCode {
                match s {
                    $( $wire => ErrorCode::$name, )*
                    other => match other.strip_prefix("code_").and_then(|n| n.parse::<u16>().ok()) {
                        Some(n) if n != 0 => ErrorCode::from_number(n),
                        _ => ErrorCode::UnknownName(other.to_owned()),
                    },
                }
            }

            /// The class a broker sends by default for this code.
            pub fn default_retry(&self) -> RetryClass {
                match self {
                    $( ErrorCode::$name => RetryClass::$retry, )*
                    _ => RetryClass::Fatal,
                }
            }
        }
    };
}

error_codes! {
    /// Stream not authenticated, or the credential was refused.
    Unauthenticated = 1, "unauthenticated", Fatal;
    /// The credential does not grant this operation.
    Forbidden = 2, "forbidden", Fatal;
    /// Tenant, namespace, stream, cache or group not known here.
    NotFound = 3, "not_found", RetryAfter;
    /// Can never succeed as sent.
    InvalidRequest = 4, "invalid_request", Fatal;
    /// Nobody can serve the shard right now; `detail.reason` says why.
    ShardUnavailable = 5, "shard_unavailable", Retry;
    /// Another broker owns the shard.
    NotLeader = 6, "not_leader", Redirect;
    /// A majority did not confirm the write in time.
    QuorumTimeout = 7, "quorum_timeout", OutcomeUnknown;
    /// Leadership moved between the write and the majority.
    LeadershipLost = 8, "leadership_lost", OutcomeUnknown;
    /// The broker stopped waiting for the write's outcome.
    Unacknowledged = 9, "unacknowledged", OutcomeUnknown;
    /// The broker is shedding load.
    Overloaded = 10, "overloaded", RetryAfter;
    /// Exceeds a configured limit.
    LimitExceeded = 11, "limit_exceeded", Fatal;
    /// The broker is shutting down and takes no new work.
    Draining = 12, "draining", Retry;
    /// Something failed inside the broker.
    Internal = 13, "internal", OutcomeUnknown;
    /// The storage layer failed.
    Storage = 14, "storage", OutcomeUnknown;
    /// The group has no record of handing this offset out.
    StaleClaim = 15, "stale_claim", Retry;
    /// The credential the request (or subscription) was opened with was revoked.
    Revoked = 16, "revoked", Fatal;
    /// A keyed batch was routed by a width the stream does not have.
    StaleWidth = 17, "stale_width", Retry;
}

impl fmt::Debug for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "ErrorCode({})", self.name())
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.name())
    }
}

impl Serialize for ErrorCode {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl<'de> Deserialize<'de> for ErrorCode {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(ErrorCode::from_name(&s))
    }
}

/// What a client may do after a failure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RetryClass {
    /// Nothing was applied; sending again is safe.
    Retry,
    /// Nothing was applied; wait first.
    RetryAfter,
    /// Nothing was applied; send it to the broker that owns the shard.
    Redirect,
    /// It may have been applied; only an idempotent request may be resent.
    OutcomeUnknown,
    /// Sending it again will fail the same way.
    Fatal,
}

impl RetryClass {
    /// Every class, in number order.
    pub const ALL: [RetryClass; 5] = [
        RetryClass::Retry,
        RetryClass::RetryAfter,
        RetryClass::Redirect,
        RetryClass::OutcomeUnknown,
        RetryClass::Fatal,
    ];
    /// The JSON spelling.
    pub const fn name(self) -> &'static str {
        match self {
            RetryClass::Retry => "retry",
            RetryClass::RetryAfter => "retry_after",
            RetryClass::Redirect => "redirect",
            RetryClass::OutcomeUnknown => "outcome_unknown",
            RetryClass::Fatal => "fatal",
        }
    }
    /// The binary ack byte.
    pub const fn number(self) -> u8 {
        match self {
            RetryClass::Retry => 1,
            RetryClass::RetryAfter => 2,
            RetryClass::Redirect => 3,
            RetryClass::OutcomeUnknown => 4,
            RetryClass::Fatal => 5,
        }
    }
    /// Reads the binary byte. An unknown byte is `Fatal`: the one reading that can never
    /// duplicate a write.
    pub const fn from_number(n: u8) -> RetryClass {
        match n {
            1 => RetryClass::Retry,
            2 => RetryClass::RetryAfter,
            3 => RetryClass::Redirect,
            4 => RetryClass::OutcomeUnknown,
            _ => RetryClass::Fatal,
        }
    }
    /// Reads the JSON name; unknown names are `Fatal`.
    pub fn from_name(s: &str) -> RetryClass {
        RetryClass::ALL.into_iter().find(|c| c.name() == s).unwrap_or(RetryClass::Fatal)
    }
}

impl fmt::Display for RetryClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl Serialize for RetryClass {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.name())
    }
}

impl<'de> Deserialize<'de> for RetryClass {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = std::borrow::Cow::<'de, str>::deserialize(d)?;
        Ok(RetryClass::from_name(&s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_and_names_round_trip() {
        for (i, code) in ErrorCode::ALL.iter().enumerate() {
            assert_eq!(code.number() as usize, i + 1);
            assert_eq!(ErrorCode::from_number(code.number()), *code);
            assert_eq!(ErrorCode::from_name(&code.name()), *code);
        }
        assert_eq!(ErrorCode::Revoked.number(), 16);
        assert_eq!(ErrorCode::StaleWidth.number(), 17);
    }

    #[test]
    fn unknown_codes_are_kept() {
        let c = ErrorCode::from_number(99);
        assert_eq!(c.name(), "code_99");
        assert_eq!(ErrorCode::from_name("code_99"), c);
        let n = ErrorCode::from_name("brand_new");
        assert_eq!(n.number(), 0);
        assert_eq!(n.name(), "brand_new");
    }

    #[test]
    fn unknown_retry_is_fatal() {
        assert_eq!(RetryClass::from_number(0), RetryClass::Fatal);
        assert_eq!(RetryClass::from_number(200), RetryClass::Fatal);
        assert_eq!(RetryClass::from_name("later"), RetryClass::Fatal);
        for c in RetryClass::ALL {
            assert_eq!(RetryClass::from_number(c.number()), c);
        }
    }
}
