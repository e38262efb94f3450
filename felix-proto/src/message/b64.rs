//! Byte fields in JSON: standard base64 with padding (RFC 4648 §4), decoded strictly.

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use bytes::Bytes;
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// Bytes carried as a base64 string in a JSON message.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct B64(pub Bytes);

impl B64 {
    /// Wraps bytes.
    pub fn new(b: impl Into<Bytes>) -> B64 {
        B64(b.into())
    }
}

impl fmt::Debug for B64 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(&self.0) {
            Ok(s) if s.len() <= 64 => write!(f, "B64({s:?})"),
            _ => write!(f, "B64({} bytes)", self.0.len()),
        }
    }
}

impl From<&str> for B64 {
    fn from(s: &str) -> B64 {
        B64(Bytes::copy_from_slice(s.as_bytes()))
    }
}

impl From<Bytes> for B64 {
    fn from(b: Bytes) -> B64 {
        B64(b)
    }
}

impl std::ops::Deref for B64 {
    type Target = Bytes;
    fn deref(&self) -> &Bytes {
        &self.0
    }
}

impl Serialize for B64 {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        // Encode into a stack buffer for small values to avoid an allocation.
        let mut stack = [0u8; 512];
        let need = self.0.len().div_ceil(3) * 4;
        if need <= stack.len() {
            let n = STANDARD.encode_slice(&self.0, &mut stack).expect("buffer sized for the encoded length");
            let s_ = std::str::from_utf8(&stack[..n]).expect("base64 is ASCII");
            s.serialize_str(s_)
        } else {
            s.serialize_str(&STANDARD.encode(&self.0))
        }
    }
}

impl<'de> Deserialize<'de> for B64 {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<B64, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = B64;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a base64 string")
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<B64, E> {
                let mut out = Vec::with_capacity(v.len() / 4 * 3);
                STANDARD.decode_vec(v, &mut out).map_err(|e| E::custom(format_args!("invalid base64: {e}")))?;
                Ok(B64(Bytes::from(out)))
            }
        }
        d.deserialize_str(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strict_standard_alphabet_with_padding() {
        let ok: B64 = serde_json::from_str("\"aGVsbG8=\"").unwrap();
        assert_eq!(&ok.0[..], b"hello");
        assert!(serde_json::from_str::<B64>("\"aGVsbG8\"").is_err(), "unpadded");
        assert!(serde_json::from_str::<B64>("\"_-8=\"").is_err(), "url-safe");
        assert_eq!(serde_json::to_string(&B64::from("hello")).unwrap(), "\"aGVsbG8=\"");
        let big = B64(Bytes::from(vec![7u8; 2000]));
        let s = serde_json::to_string(&big).unwrap();
        assert_eq!(serde_json::from_str::<B64>(&s).unwrap(), big);
    }
}
