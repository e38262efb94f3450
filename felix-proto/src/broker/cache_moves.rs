//! Cache moves, this broker's part (the cache side of [`super::moves`]): a single-replica
//! cache's values, versions and counters go to its new owner before it changes hands, so a
//! drain or a rebalance neither empties a cache nor resets its versions, and a cache watch
//! resumes on the new owner with no gap.
//!
//! The new owner asks for the whole cache first (`cache_copy_request` without `from`); the
//! answer is every entry as cache records (the system log's encoding, a reset first), the
//! counters, and the cache's tail (the offset its next change takes). It then asks for the
//! changes since that tail: the old owner stops taking writes to the cache (`shard_unavailable`
//! reason `moving`, retry), and once its writes in flight landed it answers with what changed
//! (`cutting`) and proposes the cut-over at its tail. The new owner applies it, writes it to
//! its own system log when the cache is durable, and proposes the finish. The old owner then
//! ends its cache watches with `shard_moved` (`resume_from` the tail: the new owner's next
//! change takes it) and drops its copy of the cache, in memory and on disk; so does any broker
//! that finds itself holding a cache its view says is someone else's (a copy left behind by
//! a move that changed owner without one): stale values never come back.

use super::cache::{Cache, Change};
use super::syslog::{self, CacheRecord, Counters, SysPending};
use super::*;
use crate::broker::moves::InEvent;
use crate::shard::copy::{CopyAnswer, CopyBody, CopyMessage, CopyRequest};
use crate::shard::metadata::ClusterFacts;
use crate::shard::{Kind, ShardId};
use std::time::Instant;

fn cache_key(s: &ShardId) -> Key {
    key(&s.tenant, &s.namespace, &s.name)
}

impl Broker {
    /// Whether nothing a cache's answers wait on is in flight: its system logs (values and
    /// counters) have every write settled.
    pub(super) fn cache_settled(&self, k: &Key) -> bool {
        [syslog::cache_log_key(k), syslog::counters_key(k)].iter().all(|l| {
            self.node.streams.get(l).is_none_or(|e| e.shards[0].log.committed_tail() == e.shards[0].log.next_offset())
        })
    }

    /// The offset a cache's next change takes here (a cache never used here: a new one's).
    pub(super) fn cache_tail(&mut self, k: &Key) -> u64 {
        if !self.node.caches.contains_key(k) {
            let seed = self.wall.micros(self.clock.last().unwrap_or_else(|| self.wall.anchor()));
            let mut c = Cache::with_version_seed(seed);
            c.durable = self.cfg.durable_caches;
            self.node.caches.insert(k.clone(), c);
        }
        self.node.caches.get(k).map_or(0, Cache::tail)
    }

    /// The old owner: a new owner asks for a cache moving to it.
    pub(super) fn handle_cache_copy_request(&mut self, from: &str, q: CopyRequest, now: Instant) {
        let s = q.shard;
        if self.membership.moves_out.get(&s).is_none_or(|o| o.to() != from) {
            let why = format!("no move of cache {} to {from} here", s.name);
            let m = CopyMessage::Answer(CopyAnswer { shard: s, body: CopyBody::Refused(why) });
            return self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Copy { to: from.to_owned(), message: m }));
        }
        let k = cache_key(&s);
        let tail = self.cache_tail(&k);
        let c = self.node.caches.get(&k).expect("made above");
        // From `from` on when the cache's change log still holds it; else the whole cache.
        let changes: Option<Vec<Change>> = q.from.and_then(|f| c.changes_from(f).map(|it| it.cloned().collect()));
        let full = changes.is_none();
        let records: Vec<Bytes> = match changes {
            Some(ch) => ch.iter().map(|c| self.cache_record(c).encode()).collect(),
            None => std::iter::once(CacheRecord::Reset.encode())
                .chain(c.entries_sorted().iter().map(|e| self.cache_record(e).encode()))
                .collect(),
        };
        // Asked for what changed since a copy: the rest is small, so writes stop now, for
        // the cut-over.
        if !full && let Some(o) = self.membership.moves_out.get_mut(&s) {
            o.on(super::moves::OutEvent::Stop(now));
        }
        let settled = self.cache_settled(&k);
        let cutting = self.membership.moves_out.get(&s).is_some_and(|o| o.is_cutting()) && settled;
        let counters =
            self.node.counters.get(&k).map_or_else(|| vec![syslog::CounterOp::Reset.encode()], Counters::checkpoint);
        let message = CopyMessage::Answer(CopyAnswer {
            shard: s.clone(),
            body: CopyBody::Cache { tail, cutting, full, records, counters },
        });
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::Copy { to: from.to_owned(), message }));
        self.maybe_cut_over(&s, now);
    }

    /// The new owner: what the old owner sent of a cache moving here. Applied to the cache
    /// (a new one for the whole cache, at the old owner's versions), written to this broker's
    /// system logs when the cache is durable, then the next request (or the finish) goes out.
    pub(super) fn cache_copy_answer(&mut self, s: &ShardId, body: CopyBody, now: Instant) {
        let CopyBody::Cache { tail, full, records, counters, .. } = body else { return };
        let k = cache_key(s);
        let Some(i) = self.membership.moves_in.get_mut(s) else { return };
        i.source_tail = tail;
        if !full && i.next().is_none() {
            // Changes without the cache they change (an answer to an older request): ask for
            // the whole cache.
            return i.on(InEvent::Answered(Some(now)));
        }
        let wall = self.wall;
        // Kept on disk here as a cache of this name is (its configuration, else the default).
        let spec =
            self.cfg.caches.iter().find(|c| c.tenant_id == s.tenant && c.namespace == s.namespace && c.name == s.name);
        let kept = spec.map_or(self.cfg.durable_caches, |c| c.durable);
        let durable = kept && self.cfg.history_reads;
        if full {
            // Whatever this broker held of the cache before (an older stay here) goes.
            let mut c = Cache::with_version_seed(tail.saturating_sub(1));
            c.durable = kept;
            self.node.caches.insert(k.clone(), c);
        }
        let c = self.node.caches.entry(k.clone()).or_default();
        syslog::fold_cache_records(c, wall, records.iter().cloned());
        c.advance_tail(tail);
        let mut sums = Counters::default();
        sums.apply_payloads(counters.iter().cloned());
        self.node.counters.insert(k.clone(), sums);
        let mut writes = 0;
        if durable {
            // (The counters go whole every time: the log below them can go.)
            let values = SysPending::MoveCopy { shard: s.clone(), full };
            self.sys_append(&syslog::cache_log_key(&k), records, values, now);
            let sums = SysPending::MoveCopy { shard: s.clone(), full: true };
            self.sys_append(&syslog::counters_key(&k), counters, sums, now);
            writes = 2;
        }
        let Some(i) = self.membership.moves_in.get_mut(s) else { return };
        i.on(InEvent::Copied { next: tail, writes });
        if writes == 0 {
            i.on(InEvent::Answered(Some(crate::transport::after(now, super::moves::COPY_POLL))));
            self.maybe_finish_move(s, now);
        }
    }

    /// One of a move's system-log writes settled here: a copied cache's values or counters,
    /// or a moving stream shard's consumer groups (D65). The move goes on once none is left.
    pub(super) fn move_copy_written(&mut self, s: &ShardId, ok: bool, now: Instant) {
        let Some(i) = self.membership.moves_in.get_mut(s) else { return };
        i.on(InEvent::Written { ok });
        if i.writing() == 0 {
            self.ask_copy(s, now, true);
            self.maybe_finish_move(s, now);
        }
    }

    /// A cache this broker served is someone else's now: its watches end with `shard_moved`
    /// (`resume_from` the tail when it was handed over with its contents), and what this
    /// broker held of it goes, in memory and in storage.
    pub(super) fn cache_gone(&mut self, s: &ShardId, resume_from: Option<u64>, md: &impl ClusterFacts) {
        let k = cache_key(s);
        let owner = md.owner(s);
        let addr = owner.and_then(|a| md.members().get(&a.owner)).map(|m| m.client_addr.clone());
        for (conn, id) in self.node.cache_watchers.remove(&k).unwrap_or_default() {
            let Some(sub) = self.conns.get_mut(&conn).and_then(|c| c.subs.get_mut(&id)) else { continue };
            let m = message::ShardMoved {
                subscription_id: id,
                resume_from,
                node_id: owner.map(|a| a.owner.clone()),
                addr: addr.clone().filter(|a| !a.is_empty()),
                generation: owner.map_or(0, |a| a.generation),
            };
            sub.on(SubEvent::End(Ending::Moved(m)));
            self.pump(conn, id);
        }
        self.node.caches.remove(&k);
        self.node.counters.remove(&k);
        for log in [syslog::cache_log_key(&k), syslog::counters_key(&k)] {
            if self.node.streams.remove(&log).is_some() {
                self.out.push_back(BrokerOutput::Storage(StorageOutput::ResetShard {
                    tenant_id: log.tenant().to_owned(),
                    namespace: log.namespace().to_owned(),
                    stream: log.name().to_owned(),
                    shard: 0,
                }));
            }
        }
    }

    /// After the metadata changed: single-replica caches this broker holds but does not own
    /// (and is not receiving) are dropped, their watches ended.
    pub(super) fn note_caches(&mut self, md: &impl ClusterFacts, local: &str) {
        let stale: Vec<ShardId> = md
            .owners()
            .iter()
            .filter(|(s, a)| {
                s.kind == Kind::Cache
                    && a.owner != local
                    && md.replicas(s).is_none()
                    && !self.membership.moves_in.contains_key(*s)
                    && !self.membership.moves_out.contains_key(*s)
            })
            .map(|(s, _)| s.clone())
            .filter(|s| {
                let k = cache_key(s);
                self.node.caches.contains_key(&k) || self.node.cache_watchers.contains_key(&k)
            })
            .collect();
        for s in stale {
            self.cache_gone(&s, None, md);
        }
    }
}
