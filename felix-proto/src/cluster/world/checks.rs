//! What the world simulation checks, independently of how the brokers got there: every
//! acknowledged record kept where its ack said (the history and the durable stream, healed), the
//! metadata's invariants, and what the caches answer.

use super::*;

impl World {
    /// Checks what every live broker holds committed of the replicated stream against the
    /// history seen so far: one record per offset, ever.
    pub(super) fn check_history(&mut self) -> Result<(), Violation> {
        let mut bad = None;
        let orders_shards = STREAMS.iter().find(|s| s.0 == ORDERS).map_or(0, |s| s.1);
        for (name, node) in &self.nodes {
            let replicated = node.replica_status().into_iter().map(|(s, ..)| s);
            for shard in replicated.chain((0..orders_shards).map(|i| shard_id(ORDERS, i))) {
                let from = self.checked.get(&(name.clone(), shard.clone())).copied().unwrap_or(0);
                let mut upto = from;
                for (base, generation_start, payloads) in node.broker.committed_batches(&shard, from) {
                    let records: Vec<Bytes> = if generation_start { vec![Bytes::new()] } else { payloads };
                    for (i, p) in records.into_iter().enumerate() {
                        let at = base + i as u64;
                        if at < from {
                            continue;
                        }
                        self.report.quorum_checked += 1;
                        let seen = self.history.entry((shard.clone(), at)).or_insert_with(|| p.clone());
                        if *seen != p {
                            bad = Some(format!(
                                "{name} holds {p:?} committed at {shard:?} offset {at}, where {seen:?} was committed before"
                            ));
                        }
                        upto = at + 1;
                    }
                }
                self.checked.insert((name.clone(), shard), upto);
            }
        }
        match bad {
            Some(b) => Err(self.violation(b)),
            None => Ok(()),
        }
    }

    /// A group poll's records, sent at `sent`: none of them one the group's ack of which was
    /// answered before the poll was sent (an acknowledged ack is never undone, whatever leader
    /// answers the poll), each the record the stream holds committed at its offset.
    pub(super) fn handed_out(
        &mut self,
        shard: &ShardId,
        sent: Instant,
        records: &[message::GroupRecord],
    ) -> Result<&'static str, String> {
        for r in records {
            let at = (shard.shard, r.offset);
            if let Some(acked) = self.group_acked.get(&at)
                && *acked < sent
            {
                return Err(format!(
                    "the group handed offset {} out again in a poll sent {:?} after its ack was answered",
                    r.offset,
                    sent - *acked
                ));
            }
            if let Some(held) = self.history.get(&(shard.clone(), r.offset))
                && *held != r.payload.0
            {
                return Err(format!(
                    "the group handed out {:?} at offset {}, which holds {held:?}",
                    r.payload.0, r.offset
                ));
            }
            self.handed.insert(at, r.payload.0.clone());
            self.handed_log.push((shard.shard, r.offset, r.payload.0.clone()));
        }
        self.report.group_records += records.len() as u64;
        Ok("ok")
    }

    /// Once healed: every record the group handed out is the one the stream holds committed at
    /// its offset (where the history saw it).
    pub(super) fn check_group(&self) -> Result<(), Violation> {
        for (shard, offset, payload) in &self.handed_log {
            if let Some(held) = self.history.get(&(shard_id(LEDGER, *shard), *offset))
                && held != payload
            {
                return Err(self.violation(format!(
                    "the group handed out {payload:?} at shard {shard} offset {offset}, which holds {held:?}"
                )));
            }
        }
        Ok(())
    }

    /// One owner per shard and generation; generations only grow within a life.
    pub(super) fn check_metadata(&mut self) -> Result<(), Violation> {
        let mut bad = None;
        for (name, node) in &self.nodes {
            // The same view as last time: nothing new to check (a restart starts the count
            // again, and `start` forgets the old one).
            let changes = node.metadata_changes();
            if self.meta_checked.insert(name.clone(), changes) == Some(changes) {
                continue;
            }
            let life = self.generations.entry(name.clone()).or_default();
            for (s, a) in node.metadata().owners() {
                let seen = self.owners.entry((s.clone(), a.generation)).or_insert_with(|| a.owner.clone());
                if *seen != a.owner {
                    bad = Some(format!(
                        "{s:?} generation {}: {name} says {}, another said {seen}",
                        a.generation, a.owner
                    ));
                }
                let last = life.entry(s.clone()).or_insert(a.generation);
                if a.generation < *last {
                    bad = Some(format!("{name}: {s:?} went back from generation {last} to {}", a.generation));
                }
                *last = a.generation;
            }
        }
        match bad {
            Some(b) => Err(self.violation(b)),
            None => Ok(()),
        }
    }

    /// The replicated cache, healed: every replica holds the same state, and every key holds
    /// a value that was put to it, no older than its last acknowledged put: a put sent after
    /// another was acknowledged was applied after it.
    pub(super) fn check_quorum_cache(
        &mut self,
        md: &crate::cluster::metadata::Metadata,
        rng: &mut Rng,
    ) -> Result<(), Violation> {
        let shard =
            ShardId { kind: Kind::Cache, tenant: TENANT.into(), namespace: NS.into(), name: QCACHE.into(), shard: 0 };
        let Some(replicas) = md.replicas(&shard).map(<[String]>::to_vec) else {
            return Err(self.violation(format!("{QCACHE} has no replicas")));
        };
        // The commit index reaches followers with the next append or heartbeat.
        for _ in 0..10 {
            self.tick(rng, false)?;
        }
        let states: Vec<(String, Vec<u8>)> = replicas
            .iter()
            .filter_map(|r| Some((r.clone(), self.nodes.get(r)?.broker.replicated_state(&shard))))
            .collect();
        if let Some((a, b)) = states.iter().zip(states.iter().skip(1)).find(|(a, b)| a.1 != b.1) {
            return Err(
                self.violation(format!("healed, but {QCACHE}'s replicas {} and {} hold different caches", a.0, b.0))
            );
        }
        let Some((holder, _)) = states.first() else {
            return Err(self.violation(format!("no replica of {QCACHE} is up")));
        };
        let holder = holder.clone();
        for k in 0..QKEYS {
            let key = format!("k{k}");
            let value = self.nodes[&holder].broker.cache_peek(TENANT, NS, QCACHE, &key).map(|(v, _)| v);
            self.check_value(QCACHE, &key, value, true)?;
        }
        self.check_counters(&holder)
    }

    /// The replicated cache's counters, healed: each holds at least the adds acknowledged and
    /// at most those sent (an add whose outcome was unknown may or may not have landed; none
    /// lands twice), and each acknowledged add was answered a sum of its own (every add is of
    /// one, so no two applied adds make the same sum), no greater than the final one.
    fn check_counters(&self, holder: &str) -> Result<(), Violation> {
        for (key, c) in &self.counters {
            let sum = self.nodes[holder].broker.counter_peek(TENANT, NS, QCACHE, key).unwrap_or(0);
            let acked = c.sums.len() as u64;
            if sum < 0 || (sum as u64) < acked || sum as u64 > c.sent {
                return Err(self.violation(format!(
                    "{QCACHE} counter {key} holds {sum} after {} adds of one sent, {acked} of them acknowledged",
                    c.sent
                )));
            }
            let mut sums = c.sums.clone();
            sums.sort_unstable();
            if let Some(w) = sums.windows(2).find(|w| w[0] == w[1]) {
                return Err(
                    self.violation(format!("{QCACHE} counter {key}: two acknowledged adds both answered {}", w[0]))
                );
            }
            if let Some(s) = sums.iter().find(|s| **s < 1 || **s > sum) {
                return Err(self.violation(format!("{QCACHE} counter {key}: an add answered {s}, but it holds {sum}")));
            }
        }
        Ok(())
    }

    /// What a key holds once healed, against every put to it: a value some client put to
    /// that key, and no older than the last acknowledged put (a put sent after another was
    /// acknowledged was applied after it: an old value never comes back). `kept`: an
    /// acknowledged put is never lost (a replicated cache; a single-replica one loses what
    /// its owner held in memory when it crashes).
    pub(super) fn check_value(
        &self,
        cache: &str,
        key: &str,
        value: Option<Bytes>,
        kept: bool,
    ) -> Result<(), Violation> {
        let puts = if cache == QCACHE { &self.qputs } else { &self.cache_puts };
        self.check_value_of(puts, cache, key, value, kept)
    }

    /// [`check_value`](Self::check_value) against `puts`, said of `cache` (a cache, or a
    /// shard's commit state).
    fn check_value_of(
        &self,
        puts: &Puts,
        cache: &str,
        key: &str,
        value: Option<Bytes>,
        kept: bool,
    ) -> Result<(), Violation> {
        let acked = |p: &&(String, Instant, Option<Instant>)| p.0 == key && p.2.is_some();
        let last_sent_acked = puts.values().filter(acked).map(|p| p.1).max();
        let Some(v) = value else {
            if let Some(sent) = last_sent_acked.filter(|_| kept) {
                return Err(self
                    .violation(format!("{cache} {key}'s put sent at {sent:?} was acknowledged and the key is empty")));
            }
            return Ok(());
        };
        let Some(put) = puts.get(&v).cloned() else {
            return Err(self.violation(format!("{cache} {key} holds {v:?}, which no client put")));
        };
        if put.0 != key {
            return Err(self.violation(format!("{cache} {key} holds {v:?}, put to {}", put.0)));
        }
        if let Some(acked_at) = put.2
            && let Some(later) = puts.iter().find(|(p, x)| **p != v && x.0 == key && x.2.is_some() && x.1 > acked_at)
        {
            return Err(self.violation(format!(
                "{cache} {key} holds {v:?} (acknowledged at {acked_at:?}), but {:?}, sent after that, was acknowledged too",
                later.0
            )));
        }
        Ok(())
    }

    /// The replicated stream's commit state (D63), healed: the replicas of each shard hold the
    /// same state (their checkpoints' encoding of it, as a snapshot would carry it), and every
    /// key a value some commit put to it, no older than its last acknowledged commit; an
    /// acknowledged commit is never lost, through crashes, fail-overs, compactions into
    /// snapshots (its checkpoints shared with the live state) and replica moves.
    pub(super) fn check_commit_state(&mut self, md: &crate::cluster::metadata::Metadata) -> Result<(), Violation> {
        for (shard, puts) in &self.commits {
            let id = shard_id(LEDGER, *shard);
            let Some(replicas) = md.replicas(&id) else {
                return Err(self.violation(format!("{id:?} has no replicas")));
            };
            let states: Vec<(&String, Vec<u8>)> = replicas
                .iter()
                .filter_map(|r| Some((r, self.nodes.get(r)?.broker.replicated_commit_state(&id))))
                .collect();
            if let Some((a, b)) = states.iter().zip(states.iter().skip(1)).find(|(a, b)| a.1 != b.1) {
                return Err(
                    self.violation(format!("healed, but {id:?}'s replicas {} and {} hold different states", a.0, b.0))
                );
            }
            // Their consumer group agrees on every record each of them holds.
            let bounds: Vec<(u64, u64)> =
                replicas.iter().filter_map(|r| self.nodes.get(r)?.broker.log_bounds(&id)).collect();
            let common = (bounds.iter().map(|b| b.0).max().unwrap_or(0), bounds.iter().map(|b| b.1).min().unwrap_or(0));
            let finished: Vec<(&String, Vec<u64>)> = replicas
                .iter()
                .filter_map(|r| Some((r, self.nodes.get(r)?.broker.group_finished(&id, GROUP, common))))
                .collect();
            if let Some((a, b)) = finished.iter().zip(finished.iter().skip(1)).find(|(a, b)| a.1 != b.1) {
                return Err(self.violation(format!(
                    "healed, but {id:?}'s replicas {} and {} disagree on what its group finished in {common:?}: {:?} against {:?}",
                    a.0, b.0, a.1, b.1
                )));
            }
            let Some((holder, _)) = states.first() else {
                return Err(self.violation(format!("no replica of {id:?} is up")));
            };
            let keys: BTreeSet<&String> = puts.values().map(|p| &p.0).collect();
            for key in keys {
                let value = self.nodes[*holder].broker.commit_state_peek(&id, key);
                self.check_value_of(puts, &format!("{id:?}"), key, value, true)?;
            }
        }
        Ok(())
    }

    /// The single-replica cache, healed: every key its owner holds is a value put to it and
    /// no older than its last acknowledged put, whichever moves (copied) and crashes (lost
    /// with the owner's memory) it went through.
    pub(super) fn check_cache(&mut self, md: &crate::cluster::metadata::Metadata) -> Result<(), Violation> {
        let shard =
            ShardId { kind: Kind::Cache, tenant: TENANT.into(), namespace: NS.into(), name: CACHE.into(), shard: 0 };
        let Some(owner) = md.owner(&shard).map(|a| a.owner.clone()) else {
            return Err(self.violation(format!("{CACHE} has no owner")));
        };
        let keys: BTreeSet<String> = self.cache_puts.values().map(|p| p.0.clone()).collect();
        for key in keys {
            let value =
                self.nodes.get(&owner).and_then(|n| n.broker.cache_peek(TENANT, NS, CACHE, &key)).map(|(v, _)| v);
            self.check_value(CACHE, &key, value, false)?;
        }
        Ok(())
    }

    /// The durable stream, healed: its owner holds every acknowledged record at the offset its
    /// ack named (what retention kept of it), whichever moves, crashes and cancels its shard
    /// went through, and no broker serves a reader of a shard it does not own.
    pub(super) fn check_durable(&mut self, md: &crate::cluster::metadata::Metadata) -> Result<(), Violation> {
        for (name, node) in &self.nodes {
            for shard in 0..STREAMS.iter().find(|s| s.0 == ORDERS).map_or(0, |s| s.1) {
                let id = shard_id(ORDERS, shard);
                let owner = md.owner(&id).map(|a| a.owner.as_str());
                if node.broker.subscribers_of(&id) > 0 && owner != Some(name.as_str()) {
                    return Err(self.violation(format!("{name} serves readers of {id:?}, owned by {owner:?}")));
                }
            }
        }
        let mut logs: BTreeMap<u32, (u64, BTreeMap<u64, Bytes>)> = BTreeMap::new();
        for (shard, offset, payload) in self.durable_acked.clone() {
            let id = shard_id(ORDERS, shard);
            let Some(owner) = md.owner(&id).map(|a| a.owner.clone()) else { continue };
            let Some(node) = self.nodes.get(&owner) else { continue };
            let (start, log) = logs.entry(shard).or_insert_with(|| {
                let batches = node.broker.committed_batches(&id, 0);
                let start = batches.first().map_or(u64::MAX, |b| b.0);
                let mut log = BTreeMap::new();
                for (base, _, payloads) in batches {
                    for (i, p) in payloads.into_iter().enumerate() {
                        log.insert(base + i as u64, p);
                    }
                }
                (start, log)
            });
            if offset < *start {
                continue; // retention dropped it
            }
            if log.get(&offset) != Some(&payload) {
                return Err(self.violation(format!(
                    "{payload:?} was acknowledged at {id:?} offset {offset}; its owner {owner} holds {:?} there",
                    log.get(&offset)
                )));
            }
        }
        Ok(())
    }
}
