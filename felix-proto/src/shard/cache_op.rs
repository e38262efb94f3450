//! One operation of a replicated cache's log ([`CacheOp`]): what a cache request becomes when
//! its cache is replicated, one record of a replicated batch, applied alike on every replica.
//! The bytes are the log's, so they stay as they are: a replica restarted on an older log, or
//! a follower of an older broker, reads them the same. Decoding never panics (the fuzzer feeds
//! it any bytes).

use crate::binary::Reader;
use bytes::{BufMut, Bytes};

/// One operation of a replicated cache's log: one record of a replicated batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum CacheOp {
    /// `cache_put`.
    Put { key: String, value: Bytes, ttl_ms: Option<u64> },
    /// `cache_put_if`: `condition` `None` is "absent", `Some(v)` "live at version v".
    PutIf { key: String, value: Bytes, ttl_ms: Option<u64>, condition: Option<u64> },
    /// `cache_delete`.
    Delete { key: String },
    /// `cache_delete_if`.
    DeleteIf { key: String, version: u64 },
    /// The leader's expiry pass: delete `key` if it is still at `version` and expired.
    Expire { key: String, version: u64 },
    /// `counter_add`.
    CounterAdd { key: String, delta: i64 },
}

impl CacheOp {
    /// Its bytes: `u8 op` (1 put, 2 put_if, 3 delete, 4 delete_if, 5 expire, 6 counter_add),
    /// `u8 flags` (0x1 a TTL, 0x2 a version condition), `u64 a` (TTL ms, or the delta),
    /// `u64 b` (the version), `u16 key_len` + key, then the value to the end.
    pub fn encode(&self) -> Bytes {
        let (op, flags, a, b, key, value) = match self {
            CacheOp::Put { key, value, ttl_ms } => {
                (1, u8::from(ttl_ms.is_some()), ttl_ms.unwrap_or(0), 0, key, Some(value))
            }
            CacheOp::PutIf { key, value, ttl_ms, condition } => (
                2,
                u8::from(ttl_ms.is_some()) | (u8::from(condition.is_some()) << 1),
                ttl_ms.unwrap_or(0),
                condition.unwrap_or(0),
                key,
                Some(value),
            ),
            CacheOp::Delete { key } => (3, 0, 0, 0, key, None),
            CacheOp::DeleteIf { key, version } => (4, 0, 0, *version, key, None),
            CacheOp::Expire { key, version } => (5, 0, 0, *version, key, None),
            CacheOp::CounterAdd { key, delta } => (6, 0, *delta as u64, 0, key, None),
        };
        let mut out = Vec::with_capacity(20 + key.len() + value.map_or(0, Bytes::len));
        out.put_u8(op);
        out.put_u8(flags);
        out.put_u64(a);
        out.put_u64(b);
        // Keys are checked to fit before an operation is made.
        out.put_u16(key.len().min(u16::MAX as usize) as u16);
        out.extend_from_slice(&key.as_bytes()[..key.len().min(u16::MAX as usize)]);
        if let Some(v) = value {
            out.extend_from_slice(v);
        }
        Bytes::from(out)
    }

    /// Reads [`encode`](Self::encode)'s bytes; `None` for anything else. Never panics.
    pub fn decode(b: &Bytes) -> Option<CacheOp> {
        let mut r = Reader::new(b.clone());
        let op = r.u8("op").ok()?;
        let flags = r.u8("flags").ok()?;
        let a = r.u64("a").ok()?;
        let v = r.u64("b").ok()?;
        let key = r.str16("key").ok()?;
        let ttl_ms = (flags & 1 != 0).then_some(a);
        let rest = r.rest();
        let empty = rest.is_empty();
        Some(match op {
            1 => CacheOp::Put { key, value: rest, ttl_ms },
            2 => CacheOp::PutIf { key, value: rest, ttl_ms, condition: (flags & 2 != 0).then_some(v) },
            3 if empty => CacheOp::Delete { key },
            4 if empty => CacheOp::DeleteIf { key, version: v },
            5 if empty => CacheOp::Expire { key, version: v },
            6 if empty => CacheOp::CounterAdd { key, delta: a as i64 },
            _ => return None,
        })
    }
}

/// The key an operation names.
pub(crate) fn op_key(op: &CacheOp) -> &str {
    match op {
        CacheOp::Put { key, .. }
        | CacheOp::PutIf { key, .. }
        | CacheOp::Delete { key }
        | CacheOp::DeleteIf { key, .. }
        | CacheOp::Expire { key, .. }
        | CacheOp::CounterAdd { key, .. } => key,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn operations_round_trip_and_junk_is_refused() {
        let ops = [
            CacheOp::Put { key: "k".into(), value: Bytes::from_static(b"v"), ttl_ms: Some(5) },
            CacheOp::Put { key: String::new(), value: Bytes::new(), ttl_ms: None },
            CacheOp::PutIf { key: "k".into(), value: Bytes::from_static(b"v2"), ttl_ms: None, condition: Some(9) },
            CacheOp::PutIf { key: "k".into(), value: Bytes::from_static(b"v2"), ttl_ms: Some(0), condition: None },
            CacheOp::Delete { key: "k".into() },
            CacheOp::DeleteIf { key: "k".into(), version: 3 },
            CacheOp::Expire { key: "k".into(), version: 4 },
            CacheOp::CounterAdd { key: "hits".into(), delta: -7 },
        ];
        for op in ops {
            let b = op.encode();
            assert_eq!(CacheOp::decode(&b), Some(op.clone()));
            for cut in 0..20 {
                assert_eq!(CacheOp::decode(&b.slice(..cut.min(b.len() - 1))), None, "{op:?} cut at {cut}");
            }
        }
        // Unknown operations, and a value on an operation that carries none.
        let mut unknown = CacheOp::Delete { key: "k".into() }.encode().to_vec();
        unknown[0] = 9;
        assert_eq!(CacheOp::decode(&Bytes::from(unknown)), None);
        let mut trailing = CacheOp::Delete { key: "k".into() }.encode().to_vec();
        trailing.push(1);
        assert_eq!(CacheOp::decode(&Bytes::from(trailing)), None);
        // A key that is not UTF-8.
        let mut bad = CacheOp::Delete { key: "kk".into() }.encode().to_vec();
        let n = bad.len();
        bad[n - 1] = 0xFF;
        assert_eq!(CacheOp::decode(&Bytes::from(bad)), None);
    }
}
