//! Cache and counter requests.

use super::*;
use crate::error_code::ErrorCode;
use crate::features::Features;
use crate::message::{self, B64, Message};
use crate::transport::ConnId;
use cache::Cache;
use quorum_cache::{CacheOp, CacheReply};
use std::time::Instant;

impl Broker {
    pub(super) fn cache_entry(
        &mut self,
        st: &CtlStream,
        t: &str,
        ns: &str,
        c: &str,
        action: Action,
    ) -> Result<Key, Refusal> {
        check_names(&[("tenant", t), ("namespace", ns), ("cache", c)])?;
        self.authorize(st, t, ns, c, action)?;
        if let Some((k, _)) = self.node.caches.get_key_value(KeyRef(t, ns, c).q()) {
            return Ok(k.clone());
        }
        if !self.cfg.auto_create {
            return Err(Refusal::new(ErrorCode::NotFound, format!("cache {ns}/{c} not found")));
        }
        check_new_name("tenant", t)?;
        check_new_name("namespace", ns)?;
        check_new_name("cache", c)?;
        let k = key(t, ns, c);
        let seed = self.wall.micros(self.clock.last().unwrap_or_else(|| self.wall.anchor()));
        let mut cache = Cache::with_version_seed(seed);
        cache.durable = self.cfg.durable_caches;
        self.node.caches.insert(k.clone(), cache);
        Ok(k)
    }

    /// `cache_keys` (D50): a page of live keys in byte order, never creating the cache.
    pub(super) fn cache_keys(&mut self, conn: ConnId, st: &mut CtlStream, q: message::CacheKeys, now: Instant) {
        /// Keys one page holds at most, and when the request names no limit.
        const MAX: u32 = 1000;
        const DEFAULT: u32 = 100;
        let (t, ns, c) = (&q.tenant_id, &q.namespace, &q.cache);
        if let Err(r) = check_names(&[("tenant", t), ("namespace", ns), ("cache", c)])
            .and_then(|()| self.authorize(st, t, ns, c, Action::CacheRead))
        {
            return self.refuse(conn, st, r);
        }
        let Some(cache) = self.node.caches.get(KeyRef(t, ns, c).q()) else {
            return self.refuse(conn, st, Refusal::new(ErrorCode::NotFound, format!("cache {ns}/{c} not found")));
        };
        let limit = q.limit.unwrap_or(DEFAULT).clamp(1, MAX) as usize;
        let (keys, more) = cache.keys_page(now, q.prefix.as_deref().unwrap_or(""), q.after.as_deref(), limit);
        let next = if more { keys.last().cloned() } else { None };
        let m = Message::CacheKeysView(message::CacheKeysView { keys, next, request_id: q.request_id });
        self.send(conn, st, json_frame(&m));
    }

    pub(super) fn counter_add(&mut self, conn: ConnId, st: &mut CtlStream, a: message::CounterAdd, now: Instant) {
        let k = match self.cache_entry(st, &a.tenant_id, &a.namespace, &a.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        if a.key.len() > u16::MAX as usize {
            return self.refuse(
                conn,
                st,
                Refusal::new(ErrorCode::InvalidRequest, "counter key longer than 65535 bytes"),
            );
        }
        if self.is_quorum_cache(&k) {
            let op = CacheOp::CounterAdd { key: a.key, delta: a.delta };
            return self.propose_cache_op(conn, st, &k, op, CacheReply::Counter { request_id: a.request_id }, now);
        }
        let record = syslog::CounterOp::Add { key: a.key.clone(), delta: a.delta }.encode();
        let pending = syslog::SysPending::CounterAdd { conn, stream: st.id, request_id: a.request_id, key: a.key };
        let token = self.sys_append(&syslog::counters_key(&k), vec![record], pending, now);
        Self::hold(st, HeldFor::Write(token));
    }

    pub(super) fn counter_get(&mut self, conn: ConnId, st: &mut CtlStream, g: message::CounterGet, now: Instant) {
        let k = match self
            .cache_entry(st, &g.tenant_id, &g.namespace, &g.cache, Action::CacheRead)
            .and_then(|k| self.quorum_read_allowed(&k, now).map(|()| k))
        {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let value = self.node.counters.get(&k).and_then(|c| c.sums.get(&g.key).copied());
        let m = Message::CounterValue(message::CounterValue { value, request_id: g.request_id });
        self.send(conn, st, json_frame(&m));
    }

    pub(super) fn cache_put_if(&mut self, conn: ConnId, st: &mut CtlStream, p: message::CachePutIf, now: Instant) {
        let k = match self.cache_entry(st, &p.tenant_id, &p.namespace, &p.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let expires = p.ttl_ms.map(|ms| crate::transport::after(now, std::time::Duration::from_millis(ms)));
        let condition = match p.condition {
            message::CacheCondition::Absent => None,
            message::CacheCondition::Version(v) => Some(v),
        };
        if self.is_quorum_cache(&k) {
            let op = CacheOp::PutIf { key: p.key, value: p.value.0, ttl_ms: p.ttl_ms, condition };
            return self.propose_cache_op(conn, st, &k, op, CacheReply::Condition { request_id: p.request_id }, now);
        }
        let (applied, version) =
            self.node.caches.get_mut(&k).expect("created").put_if(p.key, p.value.0, expires, condition, now);
        let token = self.cache_fanout(&k, now);
        let m =
            Message::CacheConditionResult(message::CacheConditionResult { applied, version, request_id: p.request_id });
        self.cache_reply(conn, st, token, json_frame(&m));
    }

    pub(super) fn cache_delete_if(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        d: message::CacheDeleteIf,
        now: Instant,
    ) {
        let k = match self.cache_entry(st, &d.tenant_id, &d.namespace, &d.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        if self.is_quorum_cache(&k) {
            let op = CacheOp::DeleteIf { key: d.key, version: d.version };
            return self.propose_cache_op(conn, st, &k, op, CacheReply::Condition { request_id: d.request_id }, now);
        }
        let (applied, version) = self.node.caches.get_mut(&k).expect("created").delete_if(&d.key, d.version, now);
        let token = self.cache_fanout(&k, now);
        let m =
            Message::CacheConditionResult(message::CacheConditionResult { applied, version, request_id: d.request_id });
        self.cache_reply(conn, st, token, json_frame(&m));
    }

    pub(super) fn cache_put(&mut self, conn: ConnId, st: &mut CtlStream, p: message::CachePut, now: Instant) {
        let k = match self.cache_entry(st, &p.tenant_id, &p.namespace, &p.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        if self.is_quorum_cache(&k) {
            return self.quorum_put(conn, st, &k, p, now);
        }
        let expires = p.ttl_ms.map(|ms| crate::transport::after(now, std::time::Duration::from_millis(ms)));
        self.node.caches.get_mut(&k).expect("created").put(p.key, p.value.0, expires);
        let token = self.cache_fanout(&k, now);
        let answer = match p.request_id {
            Some(request_id) => Message::CacheOk(message::CacheOk { request_id }),
            None => Message::Ok(message::OkMsg {}),
        };
        self.cache_reply(conn, st, token, json_frame(&answer));
    }

    pub(super) fn cache_get(&mut self, conn: ConnId, st: &mut CtlStream, g: message::CacheGet, now: Instant) {
        let k = match self
            .cache_entry(st, &g.tenant_id, &g.namespace, &g.cache, Action::CacheRead)
            .and_then(|k| self.quorum_read_allowed(&k, now).map(|()| k))
        {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        let hit = if self.is_quorum_cache(&k) {
            // What committed; its expiries are entries of its log, not side effects of reads.
            self.node.caches.get(&k).and_then(|c| c.peek(&g.key, now))
        } else {
            let hit = self.node.caches.get_mut(&k).expect("created").get(&g.key, now);
            self.cache_fanout(&k, now); // a lazy expiry is a change too
            hit
        };
        if hit.is_some() {
            self.stats.cache_hits += 1;
        } else {
            self.stats.cache_misses += 1;
        }
        // `version` only on a hit, and only for a client that offered FEATURE_CACHE_CONDITIONAL.
        let offered = Self::features_of(st).has(Features::CACHE_CONDITIONAL);
        let version = hit.as_ref().map(|(_, v)| *v).filter(|_| offered);
        let m = Message::CacheValue(message::CacheValue {
            tenant_id: g.tenant_id,
            namespace: g.namespace,
            cache: g.cache,
            key: g.key,
            value: hit.map(|(v, _)| B64(v)),
            request_id: g.request_id,
            version,
        });
        self.send(conn, st, json_frame(&m));
    }

    pub(super) fn cache_delete(&mut self, conn: ConnId, st: &mut CtlStream, d: message::CacheDelete, now: Instant) {
        let k = match self.cache_entry(st, &d.tenant_id, &d.namespace, &d.cache, Action::CacheWrite) {
            Ok(k) => k,
            Err(r) => return self.refuse(conn, st, r),
        };
        if self.is_quorum_cache(&k) {
            let reply = CacheReply::Delete {
                tenant_id: d.tenant_id,
                namespace: d.namespace,
                cache: d.cache,
                key: d.key.clone(),
                request_id: d.request_id,
            };
            return self.propose_cache_op(conn, st, &k, CacheOp::Delete { key: d.key }, reply, now);
        }
        let removed = self.node.caches.get_mut(&k).expect("created").delete(&d.key, now);
        let token = self.cache_fanout(&k, now);
        let m = Message::CacheValue(message::CacheValue {
            tenant_id: d.tenant_id,
            namespace: d.namespace,
            cache: d.cache,
            key: d.key,
            value: removed.map(B64),
            request_id: d.request_id,
            version: None,
        });
        self.cache_reply(conn, st, token, json_frame(&m));
    }

    /// Answers a cache write: at once for a cache kept in memory, once its changes are on disk
    /// for a durable one.
    fn cache_reply(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        token: Option<crate::transport::WriteToken>,
        data: Bytes,
    ) {
        match token {
            Some(t) => self.hold_cache_answer(t, conn, st, data),
            None => self.send(conn, st, data),
        }
    }
}
