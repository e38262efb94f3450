//! Cache state: values with an optional expiry, checked against the time passed in, and the
//! cache's change log (what cache watches replay and follow).
//!
//! Every change takes the next offset of the cache's log: a put (its offset is also the value's
//! version), a delete, an expiry. Offsets start after a seed the broker takes from the wall
//! clock, so they keep increasing across restarts of this in-memory cache; a watch resuming from
//! before the oldest retained change is answered with the current state instead (`resnapshot`).

use bytes::Bytes;
use std::collections::{HashMap, VecDeque};
use std::time::Instant;

/// Changes kept for replay; older ones are compacted away (a watch from there resnapshots).
const LOG_MAX_CHANGES: usize = 100_000;
/// Payload bytes of changes kept for replay.
const LOG_MAX_BYTES: usize = 64 << 20;

/// The average value size from which a checkpoint keeps a replicated cache's values aside
/// rather than encoding them ([`Cache::freeze`]): about what an entry kept aside costs (its
/// key copied, a value handle, its version and expiry, the list's slot).
pub const FREEZE_MIN_VALUE: usize = 96;

/// A replicated cache's state as of one checkpoint ([`Cache::freeze`]), in key order, its
/// values shared with the live cache. A value the cache overwrites or drops later stays here,
/// so it encodes the state as it was, byte for byte what [`Cache::encode_state_into`] wrote
/// then.
#[derive(Debug, Clone)]
pub struct FrozenCache {
    next_version: u64,
    /// Key, value, version, wall-clock expiry (0: none).
    entries: Vec<(Box<str>, Bytes, u64, u64)>,
    encoded_len: usize,
}

impl FrozenCache {
    /// Appends [`Cache::encode_state_into`]'s bytes as of the freeze.
    pub fn encode_into(&self, b: &mut Vec<u8>) {
        b.reserve(self.encoded_len);
        self.encode_pieces(&mut |piece| b.extend_from_slice(piece));
    }

    /// [`encode_into`](Self::encode_into)'s bytes handed to `each` in pieces, each value from
    /// where it is.
    pub fn encode_pieces(&self, each: &mut dyn FnMut(&[u8])) {
        let mut head = [1u8; 13];
        head[1..9].copy_from_slice(&self.next_version.to_be_bytes());
        head[9..].copy_from_slice(&(self.entries.len() as u32).to_be_bytes());
        each(&head);
        for (key, value, version, expires_wall) in &self.entries {
            each(&(key.len() as u16).to_be_bytes());
            each(key.as_bytes());
            let mut after = [0u8; 20];
            after[..8].copy_from_slice(&version.to_be_bytes());
            after[8..16].copy_from_slice(&expires_wall.to_be_bytes());
            after[16..].copy_from_slice(&(value.len() as u32).to_be_bytes());
            each(&after);
            each(value);
        }
    }

    /// The bytes [`encode_into`](Self::encode_into) appends, exactly.
    pub fn encoded_len(&self) -> usize {
        self.encoded_len
    }
}

#[derive(Debug, Clone)]
struct Entry {
    value: Bytes,
    expires_at: Option<Instant>,
    version: u64,
    /// A replicated cache's expiry in wall-clock microseconds (0: none), what its replicas
    /// decide by: every replica maps wall time to its own instants, so only this is alike on
    /// all of them.
    expires_wall: u64,
}

impl Entry {
    /// The entry as the put that wrote it.
    fn change(&self, key: &str) -> Change {
        Change {
            offset: self.version,
            key: key.to_owned(),
            value: Some(self.value.clone()),
            expires_at: self.expires_at,
        }
    }
}

/// One change of a cache: a put (`value`), or a delete or expiry (`None`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Change {
    pub offset: u64,
    pub key: String,
    pub value: Option<Bytes>,
    pub expires_at: Option<Instant>,
}

/// One cache.
#[derive(Debug, Default)]
pub(crate) struct Cache {
    entries: HashMap<String, Entry>,
    next_version: u64,
    log: VecDeque<Change>,
    log_bytes: usize,
    /// Changes recorded and not yet handed to watchers.
    unsent: usize,
    /// Entries with an expiry (the broker sweeps expiries only when there are some).
    ttl_entries: usize,
    /// Its changes are written to its system log (`$cache.NAME`) and survive a restart.
    pub durable: bool,
    /// Changes written since the last checkpoint of its system log.
    pub since_checkpoint: u64,
    /// Key and value bytes stored.
    bytes: usize,
    /// A replicated (`quorum`) cache: the role of this broker's replica in its Raft group,
    /// while the metadata names this broker one (it then serves the cache by that role).
    pub replica: Option<crate::shard::replicated::ReplicaRole>,
    /// Its contents are a replicated cache's, made only by applying its group's committed log
    /// (by a replica here that serves it, or lingers): never by this broker's own expiry.
    pub group: bool,
    /// A replicated cache's leader answers reads until then (its read lease).
    pub read_lease: Option<std::time::Instant>,
    /// On its leader: what applying each entry did, by offset, until the proposal's answer
    /// comes out of the group.
    pub results: std::collections::BTreeMap<u64, super::quorum_cache::Outcome>,
}

impl Cache {
    /// Empties it (contents, versions, log) but for the role it is served by, marked as holding
    /// a replicated cache's contents (`group`) or not.
    pub(crate) fn empty_keeping_role(&mut self, group: bool) {
        let replica = self.replica.take();
        *self = Cache { replica, group, ..Cache::default() };
    }

    /// A cache whose versions (and log offsets) start after `seed`. An in-memory cache seeds them
    /// from the wall clock in microseconds, so they keep increasing across restarts.
    pub fn with_version_seed(seed: u64) -> Cache {
        Cache { next_version: seed, ..Cache::default() }
    }

    fn record(&mut self, key: &str, value: Option<Bytes>, expires_at: Option<Instant>) -> u64 {
        self.next_version += 1;
        let offset = self.next_version;
        self.log_bytes += value.as_ref().map_or(0, Bytes::len) + key.len();
        self.log.push_back(Change { offset, key: key.to_owned(), value, expires_at });
        self.unsent += 1;
        while self.log.len() > LOG_MAX_CHANGES || self.log_bytes > LOG_MAX_BYTES {
            let Some(c) = self.log.pop_front() else { break };
            self.log_bytes -= c.value.as_ref().map_or(0, Bytes::len) + c.key.len();
            self.unsent = self.unsent.min(self.log.len());
        }
        offset
    }

    fn remove(&mut self, key: &str) -> Option<Entry> {
        let e = self.entries.remove(key)?;
        self.bytes -= key.len() + e.value.len();
        if e.expires_at.is_some() {
            self.ttl_entries -= 1;
        }
        self.record(key, None, None);
        Some(e)
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
        self.remove(key);
        (true, None)
    }

    /// Stores a value; `ttl` of `None` never expires. Returns its version.
    pub fn put(&mut self, key: String, value: Bytes, expires_at: Option<Instant>) -> u64 {
        self.put_wall(key, value, expires_at, 0)
    }

    fn put_wall(&mut self, key: String, value: Bytes, expires_at: Option<Instant>, expires_wall: u64) -> u64 {
        let value = super::owned(&value);
        let version = self.record(&key, Some(value.clone()), expires_at);
        if expires_at.is_some() {
            self.ttl_entries += 1;
        }
        self.bytes += key.len() + value.len();
        if let Some(old) = self.entries.insert(key.clone(), Entry { value, expires_at, version, expires_wall }) {
            self.bytes -= key.len() + old.value.len();
            if old.expires_at.is_some() {
                self.ttl_entries -= 1;
            }
        }
        version
    }

    /// Key and value bytes stored (expired entries included until removed).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Key and value bytes `key`'s entry takes (0 without one).
    pub fn entry_bytes(&self, key: &str) -> usize {
        self.entries.get(key).map_or(0, |e| key.len() + e.value.len())
    }

    /// The version of `key`'s entry, live or not.
    pub fn version_of(&self, key: &str) -> Option<u64> {
        self.entries.get(key).map(|e| e.version)
    }

    /// The changes of a replicated cache come from its log: the next one takes `offset`
    /// (offsets grow; one that did not change anything leaves a gap).
    fn at(&mut self, offset: u64) {
        self.next_version = self.next_version.max(offset.saturating_sub(1));
    }

    /// A replicated cache's live version of `key` at wall time `wall` (microseconds): what
    /// its conditions are decided by, alike on every replica.
    pub fn live_at(&self, key: &str, wall: u64) -> Option<u64> {
        self.entries.get(key).filter(|e| e.expires_wall == 0 || wall < e.expires_wall).map(|e| e.version)
    }

    /// Applies a replicated put at `offset` (its version), expiring at `expires` (the
    /// instant here and the wall time it stands for).
    pub fn put_at(&mut self, offset: u64, key: String, value: Bytes, expires: Option<(Instant, u64)>) -> u64 {
        self.at(offset);
        self.put_wall(key, value, expires.map(|e| e.0), expires.map_or(0, |e| e.1.max(1)))
    }

    /// Applies a replicated delete at `offset`: the value it removed, if any (live or not).
    pub fn remove_at(&mut self, offset: u64, key: &str) -> Option<Bytes> {
        self.at(offset);
        self.remove(key).map(|e| e.value)
    }

    /// The value of `key` if live at `now`, changing nothing (a replicated cache's expiries
    /// are entries of its log, not side effects of a read).
    pub fn peek(&self, key: &str, now: Instant) -> Option<(Bytes, u64)> {
        self.entries.get(key).filter(|e| e.expires_at.is_none_or(|t| now < t)).map(|e| (e.value.clone(), e.version))
    }

    /// Up to `max` entries past their expiry at `now`, earliest first, with their versions.
    pub fn due(&self, now: Instant, max: usize) -> Vec<(String, u64)> {
        if self.ttl_entries == 0 {
            return Vec::new();
        }
        let mut due: Vec<(Instant, &String, u64)> = self
            .entries
            .iter()
            .filter_map(|(k, e)| e.expires_at.filter(|t| *t <= now).map(|t| (t, k, e.version)))
            .collect();
        due.sort_unstable();
        due.into_iter().take(max).map(|(_, k, v)| (k.clone(), v)).collect()
    }

    /// A replicated cache's state as a snapshot holds it: `u8 version (1)`, `u64 next_version`,
    /// `u32 n`, each entry (in key order) `u16 key_len` + key, `u64 version`,
    /// `u64 expires_wall` (0: none), `u32 value_len` + value.
    #[cfg(any(test, feature = "testkit"))]
    pub fn encode_state(&self) -> Vec<u8> {
        let mut b = Vec::new();
        self.encode_state_into(&mut b);
        b
    }

    /// [`encode_state`](Self::encode_state), appended to `b` (a checkpoint's data: the cache's
    /// values are copied once, into it).
    pub fn encode_state_into(&self, b: &mut Vec<u8>) {
        use bytes::BufMut;
        let mut keys: Vec<&String> = self.entries.keys().collect();
        keys.sort_unstable();
        b.reserve(13 + self.bytes + 22 * keys.len());
        b.put_u8(1);
        b.put_u64(self.next_version);
        b.put_u32(keys.len() as u32);
        for k in keys {
            let e = &self.entries[k];
            b.put_u16(k.len() as u16);
            b.extend_from_slice(k.as_bytes());
            b.put_u64(e.version);
            b.put_u64(e.expires_wall);
            b.put_u32(e.value.len() as u32);
            b.extend_from_slice(&e.value);
        }
    }

    /// The state [`encode_state_into`](Self::encode_state_into) would write now, its values
    /// shared with this cache rather than copied: a replicated cache's checkpoint, written
    /// into its snapshot on disk piece by piece ([`FrozenCache::encode_pieces`]) without its
    /// values ever put together in one buffer. `None` when values average under
    /// [`FREEZE_MIN_VALUE`] bytes: there an entry kept aside (its key copied, its value's
    /// handle) costs more than the value it saves copying, and the caller encodes it whole.
    pub fn freeze(&self) -> Option<FrozenCache> {
        let values: usize = self.entries.values().map(|e| e.value.len()).sum();
        if values < FREEZE_MIN_VALUE * self.entries.len() || self.entries.is_empty() {
            return None;
        }
        let mut entries: Vec<(Box<str>, Bytes, u64, u64)> =
            self.entries.iter().map(|(k, e)| (k.as_str().into(), e.value.clone(), e.version, e.expires_wall)).collect();
        entries.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        let encoded_len = 13 + entries.iter().map(|(k, v, ..)| 22 + k.len() + v.len()).sum::<usize>();
        Some(FrozenCache { next_version: self.next_version, entries, encoded_len })
    }

    /// Takes the state [`encode_state`](Self::encode_state) wrote (a snapshot installed or a
    /// restart from a compacted log): every entry as it was, expiries mapped to instants
    /// here by `instant_at`. The change log starts over (a watch from before resnapshots).
    /// Bytes that do not read leave the cache empty rather than half-restored.
    pub(crate) fn restore_state(
        &mut self,
        state: super::cache_state::CacheState,
        instant_at: impl Fn(u64) -> Instant,
    ) -> bool {
        self.entries.clear();
        self.ttl_entries = 0;
        self.bytes = 0;
        self.log.clear();
        self.log_bytes = 0;
        self.unsent = 0;
        self.results.clear();
        if let Some(v) = state.next_version {
            self.next_version = self.next_version.max(v);
        }
        let Some(entries) = state.entries else { return false };
        for (key, value, version, expires_wall) in entries {
            // (The value is a copy of its own already: read out of the snapshot's bytes.)
            let expires_at = (expires_wall != 0).then(|| instant_at(expires_wall));
            if expires_at.is_some() {
                self.ttl_entries += 1;
            }
            self.bytes += key.len() + value.len();
            if let Some(old) = self.entries.insert(key.clone(), Entry { value, expires_at, version, expires_wall }) {
                self.bytes -= key.len() + old.value.len();
                self.ttl_entries -= usize::from(old.expires_at.is_some());
            }
        }
        true
    }

    /// The live value of `key` at `now`; an expired entry is removed on the way (a change
    /// watchers see as a delete).
    pub fn get(&mut self, key: &str, now: Instant) -> Option<(Bytes, u64)> {
        let live = match self.entries.get(key) {
            None => return None,
            Some(e) => e.expires_at.is_none_or(|t| now < t),
        };
        if !live {
            self.remove(key);
            return None;
        }
        self.entries.get(key).map(|e| (e.value.clone(), e.version))
    }

    /// Removes `key`, returning its live value (an expired value counts as absent).
    pub fn delete(&mut self, key: &str, now: Instant) -> Option<Bytes> {
        let e = self.remove(key)?;
        e.expires_at.is_none_or(|t| now < t).then_some(e.value)
    }

    /// Writes deletes for up to `max` entries past their expiry (the once-a-second pass).
    pub fn expire(&mut self, now: Instant, max: usize) -> usize {
        if self.ttl_entries == 0 {
            return 0;
        }
        // The earliest expiries first, then by key: which entries go (and the change offsets
        // their deletes take) must not depend on the map's order.
        let mut due: Vec<(Instant, String)> = self
            .entries
            .iter()
            .filter_map(|(k, e)| e.expires_at.filter(|t| *t <= now).map(|t| (t, k.clone())))
            .collect();
        due.sort_unstable();
        let due: Vec<String> = due.into_iter().take(max).map(|(_, k)| k).collect();
        for k in &due {
            self.remove(k);
        }
        due.len()
    }

    /// Whether any entry has an expiry.
    pub fn has_expiring(&self) -> bool {
        self.ttl_entries > 0
    }

    /// Changes from here on take offsets from `tail` at least (a moved cache continues at its
    /// old owner's tail).
    pub fn advance_tail(&mut self, tail: u64) {
        self.next_version = self.next_version.max(tail.saturating_sub(1));
    }

    /// The offset the next change will take.
    pub fn tail(&self) -> u64 {
        self.next_version + 1
    }

    /// The oldest change still kept for replay (the tail when none is).
    pub fn log_start(&self) -> u64 {
        self.log.front().map_or_else(|| self.tail(), |c| c.offset)
    }

    /// The changes from `from` on, or `None` when some of them were compacted away, or when
    /// `from` lies past the tail: whoever asks holds more than this cache ever had, so its
    /// history is another one (this cache started afresh, say its broker restarted without
    /// it while a copy was under way) and only the whole cache is an answer.
    pub fn changes_from(&self, from: u64) -> Option<impl Iterator<Item = &Change>> {
        if from < self.log_start() || from > self.tail() {
            return None;
        }
        let i = self.log.partition_point(|c| c.offset < from);
        Some(self.log.range(i..))
    }

    /// The current value of every live key `filter` accepts, as changes at the offsets of the
    /// writes that produced them, in offset order.
    pub fn snapshot(&self, now: Instant, filter: impl Fn(&str) -> bool) -> Vec<Change> {
        let mut v: Vec<Change> = self
            .entries
            .iter()
            .filter(|(k, e)| filter(k) && e.expires_at.is_none_or(|t| now < t))
            .map(|(k, e)| e.change(k))
            .collect();
        v.sort_by_key(|c| c.offset);
        v
    }

    /// A page of live keys starting with `prefix`, after `after`, in byte order: at most
    /// `limit`, and whether more follow. (Sorted here: the entries are a hash map.)
    pub fn keys_page(&self, now: Instant, prefix: &str, after: Option<&str>, limit: usize) -> (Vec<String>, bool) {
        let mut keys: Vec<&String> = self
            .entries
            .iter()
            .filter(|(k, e)| {
                k.starts_with(prefix) && after.is_none_or(|a| k.as_str() > a) && e.expires_at.is_none_or(|t| now < t)
            })
            .map(|(k, _)| k)
            .collect();
        keys.sort_unstable();
        let more = keys.len() > limit;
        (keys.into_iter().take(limit).cloned().collect(), more)
    }

    /// The changes recorded since the last call (for the watchers).
    pub fn take_new(&mut self) -> Vec<Change> {
        let n = std::mem::take(&mut self.unsent).min(self.log.len());
        self.log.range(self.log.len() - n..).cloned().collect()
    }

    /// Number of stored entries (expired ones included until touched).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Every entry (expired ones included until swept), in version order: a checkpoint.
    /// (Version order, not key order: folded back, the entries are the change log a watch
    /// replays from, which is searched by offset.)
    pub fn entries_sorted(&self) -> Vec<Change> {
        let mut v: Vec<Change> = self.entries.iter().map(|(k, e)| e.change(k)).collect();
        v.sort_by_key(|c| c.offset);
        v
    }

    /// Folds one change read back from the cache's system log (a restart): the entry as it
    /// was written, at its version, and in the change log for watches resuming there.
    pub fn restore(&mut self, mut c: Change) {
        c.value = c.value.as_ref().map(super::owned);
        self.next_version = self.next_version.max(c.offset);
        if let Some(old) = self.entries.remove(&c.key) {
            self.bytes -= c.key.len() + old.value.len();
            if old.expires_at.is_some() {
                self.ttl_entries -= 1;
            }
        }
        if let Some(value) = c.value.clone() {
            if c.expires_at.is_some() {
                self.ttl_entries += 1;
            }
            self.bytes += c.key.len() + value.len();
            let e = Entry { value, expires_at: c.expires_at, version: c.offset, expires_wall: 0 };
            self.entries.insert(c.key.clone(), e);
        }
        self.log_bytes += c.value.as_ref().map_or(0, Bytes::len) + c.key.len();
        self.log.push_back(c);
        while self.log.len() > LOG_MAX_CHANGES || self.log_bytes > LOG_MAX_BYTES {
            let Some(c) = self.log.pop_front() else { break };
            self.log_bytes -= c.value.as_ref().map_or(0, Bytes::len) + c.key.len();
        }
    }

    /// Forgets every entry (a checkpoint's start when its system log is read back); versions
    /// keep growing.
    pub fn clear(&mut self) {
        self.entries.clear();
        self.ttl_entries = 0;
        self.bytes = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn lazy_expiry() {
        let t0 = crate::transport::test_epoch();
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
    fn every_change_takes_an_offset_and_replays_fold_to_the_state() {
        let t0 = crate::transport::test_epoch();
        let mut c = Cache::with_version_seed(100);
        assert_eq!(c.tail(), 101);
        let v = c.put("a".into(), Bytes::from("1"), None);
        assert_eq!(v, 101);
        c.put("b".into(), Bytes::from("2"), Some(t0 + Duration::from_secs(1)));
        c.delete("a", t0);
        assert_eq!(c.expire(t0 + Duration::from_secs(2), 1024), 1);
        let all: Vec<_> =
            c.changes_from(101).unwrap().map(|ch| (ch.offset, ch.key.clone(), ch.value.is_some())).collect();
        assert_eq!(
            all,
            [(101, "a".into(), true), (102, "b".into(), true), (103, "a".into(), false), (104, "b".into(), false)]
        );
        assert_eq!(c.take_new().len(), 4);
        assert!(c.take_new().is_empty());
        assert!(c.changes_from(50).is_none(), "before the log: compacted");
        assert_eq!(c.changes_from(105).unwrap().count(), 0, "at the tail: nothing yet");
        // Asked from past the tail: the asker holds another history (this cache started
        // afresh): only the whole cache answers it. (Found by the world simulation, seed 853:
        // a cache's old owner restarted empty during a move, answered "no changes", and the
        // new owner finished holding a value older than one acknowledged since.)
        assert!(c.changes_from(106).is_none(), "past the tail: another history");
        assert!(!c.has_expiring());
    }

    #[test]
    fn conditional_writes() {
        let t0 = crate::transport::test_epoch();
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

    /// A value the cache keeps does not keep the buffer it arrived in: a put's frame, a Raft
    /// entry sharing a peer frame with other shards' entries, a snapshot, a segment read at a
    /// restart. The cache's limits count key and value bytes, and that is what it holds.
    #[test]
    fn kept_values_do_not_keep_the_buffer_they_came_in() {
        let t0 = crate::transport::test_epoch();
        let buffer = Bytes::from(vec![9u8; 64 << 10]);
        let inside = |v: &Bytes| super::super::tests::within(v, &buffer);
        let value_of = |c: &Cache, k: &str| c.peek(k, t0).expect("kept").0;
        let mut c = Cache::default();
        c.put("put".into(), buffer.slice(0..10), None);
        c.put_if("put_if".into(), buffer.slice(10..20), None, None, t0);
        c.put_at(50, "put_at".into(), buffer.slice(20..30), None);
        for k in ["put", "put_if", "put_at"] {
            let v = value_of(&c, k);
            assert_eq!(&v[..], &[9u8; 10][..]);
            assert!(!inside(&v), "{k}: copied out of the buffer it came in");
        }
        assert!(c.log.iter().filter_map(|ch| ch.value.as_ref()).all(|v| !inside(v)), "the change log shares the copy");

        // A snapshot's state, restored.
        let mut state = Vec::new();
        c.encode_state_into(&mut state);
        let state = Bytes::from(state);
        let mut restored = Cache::default();
        assert!(restored.restore_state(Cache::read_state(&state).0, |_| t0));
        for k in ["put", "put_if", "put_at"] {
            let v = value_of(&restored, k);
            assert_eq!(&v[..], &[9u8; 10][..]);
            assert!(!super::super::tests::within(&v, &state), "{k}: copied out of the snapshot");
        }

        // A change read back from a durable cache's system log.
        let mut folded = Cache::default();
        folded.restore(Change { offset: 4, key: "k".into(), value: Some(buffer.slice(40..48)), expires_at: None });
        let v = value_of(&folded, "k");
        assert_eq!((&v[..], folded.version_of("k")), (&[9u8; 8][..], Some(4)));
        assert!(!inside(&v), "restored from its log: copied out of the segment's buffer");
    }

    /// A frozen cache encodes, whole or in pieces, byte for byte what the cache encoded when
    /// frozen, whatever the cache does after; its values are handed over from where the cache
    /// keeps them; and a cache of small values is not frozen (encoded whole by the caller).
    #[test]
    fn a_frozen_cache_encodes_the_state_as_it_was_its_values_from_where_they_are() {
        let t0 = crate::transport::test_epoch();
        let mut c = Cache::default();
        for i in 0..5u64 {
            let ttl = (i % 2 == 0).then(|| (t0 + std::time::Duration::from_secs(60), 1_000_000 + i));
            c.put_at(10 + i, format!("k{}", 4 - i), Bytes::from(vec![i as u8; 200 + i as usize]), ttl);
        }
        let mut whole = Vec::new();
        c.encode_state_into(&mut whole);
        let frozen = c.freeze().expect("values of 200 bytes are kept aside");
        assert_eq!(frozen.encoded_len(), whole.len());
        let mut into = Vec::new();
        frozen.encode_into(&mut into);
        assert_eq!(into, whole, "encoded whole");
        let (mut pieces, mut shared) = (Vec::new(), 0);
        let values: Vec<Bytes> = (0..5).map(|i| c.peek(&format!("k{i}"), t0).expect("kept").0).collect();
        frozen.encode_pieces(&mut |p| {
            shared += usize::from(values.iter().any(|v| v.as_ptr() == p.as_ptr() && v.len() == p.len()));
            pieces.extend_from_slice(p);
        });
        assert_eq!(pieces, whole, "in pieces");
        assert_eq!(shared, 5, "every value handed over from where the cache keeps it");
        // The cache changes; the frozen state does not.
        c.put_at(20, "k0".into(), Bytes::from_static(b"new"), None);
        c.put_at(21, "k9".into(), Bytes::from(vec![7; 300]), None);
        let mut again = Vec::new();
        frozen.encode_into(&mut again);
        assert_eq!(again, whole, "as of the freeze");
        // Small values: not frozen.
        let mut small = Cache::default();
        small.put_at(1, "k".into(), Bytes::from_static(b"v"), None);
        assert!(small.freeze().is_none());
        assert!(Cache::default().freeze().is_none());
    }
}
