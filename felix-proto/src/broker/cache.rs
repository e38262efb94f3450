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
}
