//! Cache watches (FEATURE_CACHE_WATCH, FEATURE_CACHE_WATCH_RETAINED): a key or prefix of a cache,
//! delivered as `cache_event` frames on a broker-opened event stream, like a subscription.
//!
//! A watch starts from now, from an offset of the cache's change log (replayed, or the current
//! state when that history was compacted: `resnapshot`), or with the current state of every
//! matching key (`retained`). Live changes are filtered at fan-out; a watch whose queue fills
//! gets `cache_watch_lagged` with the first change it missed, and ends.

use super::cache::Change;
use super::{Broker, BrokerOutput, CtlStream, Ending, Key, Refusal, Sub, SubEvent, TransportOutput, json_frame};
use crate::broker::auth::Action;
use crate::error_code::ErrorCode;
use crate::features::Features;
use crate::message::{self, B64, Message};
use crate::transport::ConnId;
use bytes::Bytes;
use std::collections::VecDeque;
use std::time::Instant;

/// What a watch follows: one key, or every key with a prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum WatchFilter {
    Key(String),
    Prefix(String),
}

impl WatchFilter {
    pub fn accepts(&self, key: &str) -> bool {
        match self {
            WatchFilter::Key(k) => k == key,
            WatchFilter::Prefix(p) => key.starts_with(p.as_str()),
        }
    }
}

impl Broker {
    /// The `cache_event` frame of a change.
    fn event_frame(&self, c: &Change) -> [Bytes; 2] {
        let expires_at_millis = c.expires_at.map_or(0, |t| self.wall.micros(t) / 1000);
        let m = Message::CacheEvent(message::CacheEvent {
            key: c.key.clone(),
            value: c.value.clone().map(B64),
            offset: c.offset,
            expires_at_millis,
        });
        [json_frame(&m), Bytes::new()]
    }

    pub(super) fn cache_watch(&mut self, conn: ConnId, st: &mut CtlStream, w: message::CacheWatch, now: Instant) {
        let k = match self.cache_entry(st, &w.tenant_id, &w.namespace, &w.cache, Action::CacheRead) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let invalid = |m: &str| Refusal::new(ErrorCode::InvalidRequest, m);
        let filter = match (w.key, w.prefix) {
            (Some(k), None) => WatchFilter::Key(k),
            (None, Some(p)) => {
                if w.shard.is_some_and(|s| s != 0) {
                    return self.refuse(conn, st, invalid("the cache has one shard: shard must be 0"));
                }
                WatchFilter::Prefix(p)
            }
            _ => return self.refuse(conn, st, invalid("a watch names exactly one of key and prefix")),
        };
        if w.retained && w.from_offset.is_some() {
            return self.refuse(conn, st, invalid("retained and from_offset cannot be combined"));
        }
        if w.retained && !self.server_features.contains(Features::CACHE_WATCH_RETAINED) {
            return self.refuse(conn, st, invalid("retained delivery is not served"));
        }
        let cache = self.node.caches.get_mut(&k).expect("cache_entry created it");
        // Expired entries are written as deletes before the tail is read (a replicated cache's
        // come from its log).
        if cache.replica.is_none() && !cache.group {
            cache.expire(now, usize::MAX);
        }
        let tail = cache.tail();
        if let Some(from) = w.from_offset
            && from > tail
        {
            let m = Message::SubscribeCursorError(message::SubscribeCursorError {
                reason: message::CursorErrorReason::InFuture,
                requested: from,
                available: tail,
            });
            return self.send(conn, st, json_frame(&m));
        }
        let (initial, resnapshot, retained_count) = if w.retained {
            let snap = cache.snapshot(now, |key| filter.accepts(key));
            let n = snap.len() as u64;
            (snap, false, Some(n))
        } else if let Some(from) = w.from_offset {
            match cache.changes_from(from) {
                Some(changes) => (changes.filter(|c| filter.accepts(&c.key)).cloned().collect(), false, None),
                None => (cache.snapshot(now, |key| filter.accepts(key)), true, None),
            }
        } else {
            (Vec::new(), false, None)
        };
        self.cache_fanout(&k, now);
        let max_subs = self.max_subscriptions(st);
        let Some(c) = self.conns.get_mut(&conn) else { return };
        if c.subs.len() >= max_subs {
            let r = Refusal::new(ErrorCode::LimitExceeded, format!("at most {max_subs} subscriptions per connection"));
            return self.refuse(conn, st, r);
        }
        let id = match c.claim_sub_id(w.subscription_id) {
            Ok(id) => id,
            Err(id) => return self.refuse(conn, st, invalid(&format!("subscription {id} already exists"))),
        };
        let queue: VecDeque<[Bytes; 2]> = initial.iter().map(|ch| self.event_frame(ch)).collect();
        let replayed = queue.len();
        let token = self.ids.open();
        let offer = Self::features_of(st);
        if let Some(j) = st.session.as_ref().and_then(|s| s.jwt.as_ref()) {
            self.timers.expiries.insert((j.exp, conn, id, j.credential.clone()));
        }
        let Some(c) = self.conns.get_mut(&conn) else { return };
        c.opens.insert(token, id);
        c.subs.insert(
            id,
            Sub {
                queue,
                // The replay is not counted against `subscriber_queue_bytes_max` (as it is not
                // against the capacity): it is bounded by the cache's change log.
                queued_bytes: 0,
                // Live changes a watch may have queued before it lags (a replay at the start is
                // queued whole): the default subscriber queue capacity.
                capacity: self.cfg.default_stream.queue_capacity.max(1) as usize + replayed,
                watch: Some(filter),
                ..Sub::new(id, k.clone(), 0, Default::default(), offer, None)
            },
        );
        self.node.cache_watchers.entry(k).or_default().push((conn, id));
        let m = Message::CacheWatchStarted(message::CacheWatchStarted {
            subscription_id: id,
            resume_offset: tail,
            resnapshot,
            retained_count,
        });
        self.send(conn, st, json_frame(&m));
        self.out.push_back(BrokerOutput::Transport(TransportOutput::OpenUni { conn, token }));
    }

    /// Hands a cache's new changes to its watchers.
    /// A durable cache's changes are also written to its system log: the write's token comes
    /// back, for the answer of the request that made them to wait on.
    pub(super) fn cache_fanout(&mut self, k: &Key, now: Instant) -> Option<crate::transport::WriteToken> {
        let cache = self.node.caches.get_mut(k)?;
        let changes = cache.take_new();
        if changes.is_empty() {
            return None;
        }
        let token = self.cache_persist(k, &changes, now);
        let Some(watchers) = self.node.cache_watchers.get(k).cloned() else { return token };
        let frames: Vec<[Bytes; 2]> = changes.iter().map(|c| self.event_frame(c)).collect();
        for (conn, id) in watchers {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            let Some(filter) = sub.watch.clone() else { continue };
            for (c, f) in changes.iter().zip(&frames) {
                if sub.ending() || !filter.accepts(&c.key) {
                    continue;
                }
                if sub.full(f[0].len() + f[1].len(), self.cfg.subscriber_queue_bytes_max) {
                    // Delivers what is queued, then says where to resume (gapless).
                    self.stats.lagged += 1;
                    sub.on(SubEvent::End(Ending::WatchLagged { resume_from: c.offset }));
                    continue;
                }
                sub.push(f.clone());
            }
            self.pump(conn, id);
        }
        token
    }

    /// The once-a-second pass: writes deletes for expired entries (at most 1024 per cache), which
    /// watchers receive.
    pub(super) fn cache_sweep(&mut self, now: Instant) {
        self.quorum_cache_sweep(now);
        let mut keys: Vec<Key> = self
            .node
            .caches
            .iter()
            .filter(|(_, c)| c.has_expiring() && c.replica.is_none() && !c.group)
            .map(|(k, _)| k.clone())
            .collect();
        keys.sort_unstable(); // the deletes it writes come in the same order in every run
        for k in keys {
            if let Some(c) = self.node.caches.get_mut(&k) {
                c.expire(now, 1024);
            }
            self.cache_fanout(&k, now);
        }
    }
}
