//! Cache state: values with an optional expiry, checked lazily against the time passed in.

use bytes::Bytes;
use std::collections::HashMap;
use std::time::Instant;

#[derive(Debug, Clone)]
struct Entry {
    value: Bytes,
    expires_at: Option<Instant>,
    version: u64,
}

/// One cache.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    entries: HashMap<String, Entry>,
    next_version: u64,
}

impl Cache {
    /// A cache whose versions start after `seed`. An in-memory cache seeds them from the wall
    /// clock in microseconds, so versions keep increasing across restarts.
    pub fn with_version_seed(seed: u64) -> Cache {
        Cache { entries: HashMap::new(), next_version: seed }
    }

    fn live_version(&mut self, key: &str, now: Instant) -> Option<u64> {
        self.get(key, now).map(|(_, v)| v)
    }

    /// Stores `value` only if the key's live entry matches `condition` (`None`: no live entry;
    /// `Some(v)`: the live entry has version `v`). Checking and writing are one step. Returns
    /// whether it applied, and the version written (applied) or the current one (not applied).
    pub fn put_if(
        &mut self,
        key: String,
        value: Bytes,
        expires_at: Option<Instant>,
        condition: Option<u64>,
        now: Instant,
    ) -> (bool, Option<u64>) {
        let current = self.live_version(&key, now);
        if current != condition {
            return (false, current);
        }
        (true, Some(self.put(key, value, expires_at)))
    }

    /// Deletes the key only if its live entry has version `version`. Returns whether it applied
    /// and the key's version afterwards (absent after an applied delete).
    pub fn delete_if(&mut self, key: &str, version: u64, now: Instant) -> (bool, Option<u64>) {
        let current = self.live_version(key, now);
        if current != Some(version) {
            return (false, current);
        }
        self.entries.remove(key);
        (true, None)
    }

    /// Stores a value; `ttl` of `None` never expires. Returns its version.
    pub fn put(&mut self, key: String, value: Bytes, expires_at: Option<Instant>) -> u64 {
        self.next_version += 1;
        let version = self.next_version;
        self.entries.insert(key, Entry { value, expires_at, version });
        version
    }

    /// The live value of `key` at `now`; an expired entry is removed on the way.
    pub fn get(&mut self, key: &str, now: Instant) -> Option<(Bytes, u64)> {
        let live = match self.entries.get(key) {
            None => return None,
            Some(e) => e.expires_at.is_none_or(|t| now < t),
        };
        if !live {
            self.entries.remove(key);
            return None;
        }
        self.entries.get(key).map(|e| (e.value.clone(), e.version))
    }

    /// Removes `key`, returning its live value (an expired value counts as absent).
    pub fn delete(&mut self, key: &str, now: Instant) -> Option<Bytes> {
        let e = self.entries.remove(key)?;
        e.expires_at.is_none_or(|t| now < t).then_some(e.value)
    }

    /// Number of stored entries (expired ones included until touched).
    #[cfg(test)]
    pub fn len(&self) -> usize {
        self.entries.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn lazy_expiry() {
        let t0 = crate::io::test_epoch();
        let mut c = Cache::default();
        c.put("a".into(), Bytes::from("1"), Some(t0 + Duration::from_millis(10)));
        c.put("b".into(), Bytes::from("2"), None);
        assert_eq!(c.get("a", t0).map(|v| v.0), Some(Bytes::from("1")));
        assert_eq!(c.get("a", t0 + Duration::from_millis(10)), None);
        assert_eq!(c.len(), 1, "expired entry removed on access");
        assert_eq!(c.delete("b", t0), Some(Bytes::from("2")));
        assert_eq!(c.delete("b", t0), None);
    }

    #[test]
    fn conditional_writes() {
        let t0 = crate::io::test_epoch();
        let mut c = Cache::with_version_seed(1000);
        let (applied, v1) = c.put_if("k".into(), Bytes::from("a"), None, None, t0);
        assert!(applied && v1 > Some(1000));
        assert_eq!(c.put_if("k".into(), Bytes::from("b"), None, None, t0), (false, v1), "absent no longer holds");
        let (applied, v2) = c.put_if("k".into(), Bytes::from("c"), None, v1, t0);
        assert!(applied && v2 > v1);
        assert_eq!(c.put_if("k".into(), Bytes::from("d"), None, v1, t0), (false, v2), "stale version");
        assert_eq!(c.delete_if("k", v1.unwrap(), t0), (false, v2));
        assert_eq!(c.delete_if("k", v2.unwrap(), t0), (true, None));
        assert!(c.get("k", t0).is_none());
    }
}
