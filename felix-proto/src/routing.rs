//! Which shard a routing key lands on (upstream `felix_wire::routing`).
//!
//! `h = mix(FNV-1a-64(key))`; a `modulo` stream takes `h mod shards`, a `jump_hash` stream the
//! Lamping–Veach jump consistent hash of `h`. No key, or one shard, is shard 0; an empty key is
//! still a key and is hashed.

use crate::message::Routing;

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a-64 of the key, then the splitmix64 finaliser.
pub fn key_hash(key: &[u8]) -> u64 {
    let mut h = FNV_OFFSET;
    for &b in key {
        h ^= u64::from(b);
        h = h.wrapping_mul(FNV_PRIME);
    }
    h ^= h >> 30;
    h = h.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    h ^= h >> 27;
    h = h.wrapping_mul(0x94d0_49bb_1331_11eb);
    h ^ (h >> 31)
}

/// Lamping–Veach jump consistent hash of `h` into `buckets` buckets (float arithmetic of the
/// paper).
pub fn jump_hash(mut h: u64, buckets: u32) -> u32 {
    let mut b: i64 = -1;
    let mut j: i64 = 0;
    while j < i64::from(buckets) {
        b = j;
        h = h.wrapping_mul(2_862_933_555_777_941_757).wrapping_add(1);
        j = ((b + 1) as f64 * ((1u64 << 31) as f64 / ((h >> 33) + 1) as f64)) as i64;
    }
    // b < buckets <= u32::MAX, and b >= 0 because the loop ran (buckets >= 1).
    b.max(0) as u32
}

/// The shard a key routes to on a stream of `shards` shards.
pub fn shard_for_key(key: Option<&[u8]>, shards: u32, routing: Routing) -> u32 {
    let Some(key) = key else { return 0 };
    if shards <= 1 {
        return 0;
    }
    let h = key_hash(key);
    match routing {
        Routing::Modulo => (h % u64::from(shards)) as u32,
        Routing::JumpHash => jump_hash(h, shards),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn upstream_pinned_modulo_values() {
        let cases: &[(&str, u32, u32)] = &[
            ("customer-0", 8, 0),
            ("customer-4", 8, 2),
            ("customer-1", 8, 3),
            ("customer-6", 8, 4),
            ("customer-2", 8, 6),
            ("k0", 12, 6),
            ("k1", 12, 10),
            ("", 4, 3),
        ];
        for &(k, n, want) in cases {
            assert_eq!(shard_for_key(Some(k.as_bytes()), n, Routing::Modulo), want, "{k} mod {n}");
        }
        assert_eq!(shard_for_key(None, 8, Routing::Modulo), 0);
        assert_eq!(shard_for_key(Some(b"x"), 1, Routing::JumpHash), 0);
    }

    #[test]
    fn jump_hash_is_in_range_and_moves_few_keys() {
        let mut moved = 0;
        for i in 0..1000u32 {
            let h = key_hash(format!("key-{i}").as_bytes());
            let a = jump_hash(h, 10);
            let b = jump_hash(h, 11);
            assert!(a < 10 && b < 11);
            if a != b {
                assert_eq!(b, 10, "a key only ever moves to the new bucket");
                moved += 1;
            }
        }
        assert!(moved > 40 && moved < 160, "about 1/11 of keys move, got {moved}");
    }
}
