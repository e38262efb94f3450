//! The name of a stream, cache, counter set or group store: tenant, namespace, name.
//!
//! Keys are made once, when the thing they name is created, and shared after that (a clone is
//! a reference count). Maps keyed by [`StreamKey`] are looked up with borrowed strings through
//! [`KeyRef`], so routing a publish or a request allocates nothing.

use std::borrow::Borrow;
use std::cmp::Ordering;
use std::fmt;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

/// An owned key. Hash, equality and order are those of its three parts, in order, the same as
/// a [`KeyRef`] of the same strings.
#[derive(Clone)]
pub(crate) struct StreamKey(Arc<Parts>);

struct Parts {
    tenant: String,
    namespace: String,
    name: String,
}

impl StreamKey {
    pub fn new(tenant: &str, namespace: &str, name: &str) -> StreamKey {
        StreamKey(Arc::new(Parts { tenant: tenant.to_owned(), namespace: namespace.to_owned(), name: name.to_owned() }))
    }

    pub fn tenant(&self) -> &str {
        &self.0.tenant
    }

    pub fn namespace(&self) -> &str {
        &self.0.namespace
    }

    pub fn name(&self) -> &str {
        &self.0.name
    }

    /// The key as a map look-up argument.
    pub fn q(&self) -> &dyn KeyView {
        self
    }
}

/// A borrowed key, for look-ups.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct KeyRef<'a>(pub &'a str, pub &'a str, pub &'a str);

impl<'a> KeyRef<'a> {
    /// The key as a map look-up argument: `map.get(KeyRef(t, n, s).q())`.
    pub fn q(&self) -> &(dyn KeyView + 'a) {
        self
    }
}

/// Either kind of key, as the three strings it is made of.
pub(crate) trait KeyView {
    fn parts(&self) -> (&str, &str, &str);
}

impl KeyView for StreamKey {
    fn parts(&self) -> (&str, &str, &str) {
        (&self.0.tenant, &self.0.namespace, &self.0.name)
    }
}

impl KeyView for KeyRef<'_> {
    fn parts(&self) -> (&str, &str, &str) {
        (self.0, self.1, self.2)
    }
}

impl Hash for dyn KeyView + '_ {
    fn hash<H: Hasher>(&self, h: &mut H) {
        let (t, n, s) = self.parts();
        t.hash(h);
        n.hash(h);
        s.hash(h);
    }
}

impl PartialEq for dyn KeyView + '_ {
    fn eq(&self, other: &Self) -> bool {
        self.parts() == other.parts()
    }
}

impl Eq for dyn KeyView + '_ {}

impl PartialOrd for dyn KeyView + '_ {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for dyn KeyView + '_ {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl<'a> Borrow<dyn KeyView + 'a> for StreamKey {
    fn borrow(&self) -> &(dyn KeyView + 'a) {
        self
    }
}

impl Hash for StreamKey {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.q().hash(h)
    }
}

impl PartialEq for StreamKey {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0) || self.parts() == other.parts()
    }
}

impl Eq for StreamKey {}

impl PartialOrd for StreamKey {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for StreamKey {
    fn cmp(&self, other: &Self) -> Ordering {
        self.parts().cmp(&other.parts())
    }
}

impl fmt::Debug for StreamKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.0.tenant, self.0.namespace, self.0.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashMap};

    #[test]
    fn borrowed_lookups_find_owned_keys() {
        let mut h = HashMap::new();
        let mut b = BTreeMap::new();
        for (t, n, s) in [("t", "n", "s"), ("t", "n", "s2"), ("t", "ns", ""), ("", "", "")] {
            h.insert(StreamKey::new(t, n, s), (t, n, s));
            b.insert(StreamKey::new(t, n, s), (t, n, s));
        }
        for (t, n, s) in [("t", "n", "s"), ("t", "n", "s2"), ("t", "ns", ""), ("", "", "")] {
            assert_eq!(h.get(KeyRef(t, n, s).q()), Some(&(t, n, s)));
            assert_eq!(b.get(KeyRef(t, n, s).q()), Some(&(t, n, s)));
        }
        // The parts are hashed apart: moving a character across a boundary is another key.
        assert_eq!(h.get(KeyRef("t", "ns", "2").q()), None);
        assert_eq!(h.get(KeyRef("tn", "", "s").q()), None);
        assert_eq!(b.get(KeyRef("t", "n", "s3").q()), None);
    }

    #[test]
    fn order_is_the_order_of_the_parts() {
        let mut v = [StreamKey::new("b", "a", "a"), StreamKey::new("a", "b", "a"), StreamKey::new("a", "a", "b")];
        v.sort();
        let names: Vec<_> = v.iter().map(|k| format!("{k:?}")).collect();
        assert_eq!(names, ["a/a/b", "a/b/a", "b/a/a"]);
    }
}
