//! The world's clients: the requests they send (publishes, subscribes, cache and group
//! operations, old and new clients alike) and how they read the brokers' answers into the
//! history the checks judge.

use super::*;

impl World {
    /// Reads what came back on a request's stream; an answer closes its connection.
    pub(super) fn answer(&mut self, name: &str, conn: ConnId) -> Result<(), Violation> {
        let key = (name.to_owned(), conn);
        let Some(p) = self.pending.get_mut(&key) else { return Ok(()) };
        let mut d = FrameDecoder::new();
        d.push(p.bytes.clone().freeze());
        let mut payloads = Vec::new();
        loop {
            match d.next_frame() {
                Ok(Some(f)) => match f.decode_payload() {
                    Ok(pl) => payloads.push(pl),
                    Err(e) => return Err(self.violation(format!("{name} sent an undecodable payload: {e}"))),
                },
                Ok(None) => break,
                Err(e) => return Err(self.violation(format!("{name} sent a bad frame: {e}"))),
            }
        }
        let (ask, shard, must, sent) = (p.ask, p.shard.clone(), p.must_succeed, p.sent);
        let mut it = payloads.into_iter();
        if !p.authed {
            match it.next() {
                Some(Payload::Json(Decoded::Message(Message::AuthOk(_)))) => {}
                None => return Ok(()),
                Some(other) => return Err(self.violation(format!("{name} answered auth with {other:?}"))),
            }
        }
        let Some(answer) = it.next() else { return Ok(()) };
        let said = format!("{answer:?}");
        self.pending.remove(&key);
        let refused = |code: &ErrorCode| -> Result<&'static str, String> {
            match code {
                ErrorCode::NotLeader => Ok("redirect"),
                ErrorCode::ShardUnavailable | ErrorCode::Unacknowledged => Ok("unavailable"),
                // A replicated shard's outcome-unknown answers (its leader deposed, or no
                // majority in time).
                ErrorCode::LeadershipLost | ErrorCode::QuorumTimeout
                    if shard.name == LEDGER || shard.name == QCACHE =>
                {
                    Ok("unknown")
                }
                // An ack of a record handed out before the group's state was rebuilt (a new
                // leader): the record is handed out again.
                ErrorCode::StaleClaim if ask == Ask::GroupAck => Ok("unavailable"),
                other => Err(format!("unexpected refusal {}", other.name())),
            }
        };
        // A client that did not offer codes gets the message alone.
        let legacy = |message: &str| -> Result<&'static str, String> {
            if message.contains("owned by") {
                Ok("redirect")
            } else if message.is_empty() {
                Err("a refusal that says nothing".into())
            } else {
                Ok("unavailable")
            }
        };
        let outcome: Result<&'static str, String> = match (ask, answer) {
            (Ask::Publish, Payload::Ack(a)) if a.status == AckStatus::Ok => {
                if a.owner.is_some() {
                    self.report.forwarded += 1;
                }
                if shard.name == ORDERS
                    && let (Some(offset), Some(p)) = (a.offset, self.quorum_payloads.get(&key))
                {
                    self.durable_acked.push((shard.shard, offset, p.clone()));
                }
                Ok("ok")
            }
            (Ask::Publish, Payload::Ack(a)) => match &a.code {
                Some((c, _)) => refused(c),
                None => legacy(&a.message),
            },
            (Ask::Subscribe, Payload::Json(Decoded::Message(Message::Subscribed(_)))) => {
                let owner = self.nodes.get(name).and_then(|n| n.metadata().owner(&shard)).map(|a| a.owner.clone());
                // A replicated shard is served by its Raft group's leader, which serves before
                // the metadata learns it leads.
                let leads = self.nodes.get(name).and_then(|n| n.broker.replica_role(&shard))
                    == Some(&crate::broker::ReplicaRole::Leading);
                if (shard.name != LEDGER && owner.as_deref() == Some(name)) || leads {
                    self.report.subscribed += 1;
                    Ok("ok")
                } else {
                    Err(format!("subscribed to {shard:?} owned by {owner:?}"))
                }
            }
            (Ask::Commit, Payload::Json(Decoded::Message(Message::CommitOk(_)))) => {
                self.report.commits_acked += 1;
                Ok("ok")
            }
            (Ask::CounterAdd, Payload::Json(Decoded::Message(Message::CounterValue(v)))) => {
                let counted = self.adding.get(&key).and_then(|k| self.counters.get_mut(k));
                match (v.value, counted) {
                    (Some(sum), Some(c)) => {
                        c.sums.push(sum);
                        self.report.counter_adds_acked += 1;
                        Ok("ok")
                    }
                    (None, _) => Err("an add answered with no sum".to_owned()),
                    (_, None) => Err("an add that was never sent answered".to_owned()),
                }
            }
            (Ask::GroupPoll, Payload::Json(Decoded::Message(Message::GroupRecords(r)))) => {
                self.handed_out(&shard, sent, &r.records)
            }
            (Ask::GroupAck, Payload::Json(Decoded::Message(Message::CacheOk(_)))) => {
                if let Some(at) = self.acking.get(&key).copied() {
                    self.handed.remove(&at);
                    self.group_acked.entry(at).or_insert(self.now);
                    self.report.group_acks_acked += 1;
                }
                Ok("ok")
            }
            (Ask::CachePut, Payload::Json(Decoded::Message(Message::CacheOk(_))))
            | (Ask::CacheGet, Payload::Json(Decoded::Message(Message::CacheValue(_)))) => {
                self.report.cache_answers += 1;
                Ok("ok")
            }
            (_, Payload::Json(Decoded::Message(Message::NotLeader(_)))) => Ok("redirect"),
            (_, Payload::Json(Decoded::Message(Message::Error(e)))) => match &e.code {
                Some(c) => refused(c),
                None => legacy(&e.message),
            },
            (_, other) => Err(format!("unexpected answer {other:?}")),
        };
        let outcome = outcome.map_err(|w| self.violation(format!("{name}, {ask:?} {shard:?}: {w}")))?;
        let payload = self.quorum_payloads.remove(&key);
        self.adding.remove(&key);
        self.acking.remove(&key);
        match outcome {
            "ok" => {
                if ask == Ask::CachePut
                    && shard.name == QCACHE
                    && let Some(put) = payload.as_ref().and_then(|p| self.qputs.get_mut(p))
                {
                    put.2 = Some(self.now);
                    self.report.qcache_acked += 1;
                }
                if ask == Ask::CachePut
                    && shard.name == CACHE
                    && let Some(put) = payload.as_ref().and_then(|p| self.cache_puts.get_mut(p))
                {
                    put.2 = Some(self.now);
                }
                if ask == Ask::Commit
                    && let Some(c) = payload.as_ref().and_then(|p| self.commits.get_mut(&shard.shard)?.get_mut(p))
                {
                    c.2 = Some(self.now);
                }
                if ask == Ask::Publish || ask == Ask::Commit {
                    self.report.acked += 1;
                    if let Some(p) = payload.filter(|_| shard.name == LEDGER) {
                        self.report.quorum_acked += 1;
                        self.quorum_acked.insert(p, shard.clone());
                    }
                }
            }
            "redirect" => self.report.redirected += 1,
            "unknown" => self.report.quorum_unknown += 1,
            _ => self.report.unavailable += 1,
        }
        if must && outcome != "ok" {
            let why = self.nodes.get(name).map(|n| {
                let md = n.metadata();
                format!(
                    "replicas {:?}, owner {:?}, moving {:?}, its replica: {:?}",
                    md.replicas(&shard),
                    md.owner(&shard),
                    md.moving(&shard),
                    n.replica_voters(&shard)
                )
            });
            let groups: Vec<String> = self
                .nodes
                .iter()
                .filter_map(|(n, node)| {
                    let (_, leader, term, _) = node.replica_status().into_iter().find(|r| r.0 == shard)?;
                    Some(format!(
                        "{n}: voters {:?}, role {:?}, leader {leader:?}, term {term}, fenced {}, moving {:?}, replicas {:?}",
                        node.replica_voters(&shard)?,
                        node.broker.replica_role(&shard),
                        node.broker.is_fenced(),
                        node.metadata().moving(&shard),
                        node.metadata().replicas(&shard)
                    ))
                })
                .collect();
            let roles: Vec<String> =
                self.nodes.iter().map(|(n, node)| format!("{n} {:?}", node.broker.replica_role(&shard))).collect();
            return Err(self.violation(format!(
                "{name}, healed, answered {ask:?} {shard:?} with {outcome}: {said} ({why:?}) [{}] roles {}",
                groups.join("; "),
                roles.join(", ")
            )));
        }
        self.mix(outcome.len() as u64);
        let now = self.now;
        if let Some(n) = self.nodes.get_mut(name) {
            n.broker.connection_closed(conn, now);
        }
        Ok(())
    }

    /// A client connects to `name` and sends one request.
    pub(super) fn request(
        &mut self,
        name: &str,
        ask: Ask,
        (stream, shard): (&str, u32),
        modern: bool,
        must: bool,
        rng: &mut Rng,
    ) {
        let now = self.now;
        // A publish to the replicated stream under faults is a commit where brokers offer
        // commits, when sent to the replica that leads (a commit is owner-only, never
        // forwarded: a client sends it where a redirect took it). No draw of its own, so the
        // seeds' other choices stay as they were. Not once healed, where every request must
        // succeed at whichever broker it reaches.
        let leads = || {
            self.nodes.get(name).and_then(|n| n.broker.replica_role(&shard_id(stream, shard)))
                == Some(&crate::broker::ReplicaRole::Leading)
        };
        // In the seeds that consume, half the publishes to the replicated stream under faults
        // that reach its leader are its group's polls and acks instead (no draw of their own):
        // an ack of a record handed out and not acked yet, every other time there is one.
        let group = ask == Ask::Publish
            && stream == LEDGER
            && !must
            && self.consumes()
            && self.report.requests % 2 == 1
            && leads();
        let acking = self.handed.range((shard, 0)..=(shard, u64::MAX)).next().map(|(k, _)| *k);
        let ask = match (group, acking) {
            (true, Some(_)) if self.report.requests % 4 == 3 => Ask::GroupAck,
            (true, _) => Ask::GroupPoll,
            // The group's own client asked for an ack with nothing to ack: it polls.
            (false, None) if ask == Ask::GroupAck => Ask::GroupPoll,
            (false, _) => ask,
        };
        let commit = ask == Ask::Publish && stream == LEDGER && !must && self.history_reads() && leads();
        let ask = if commit { Ask::Commit } else { ask };
        // In the seeds that count, a third of the puts to the replicated cache are adds to one
        // of its counters instead (no draw of its own either).
        let ask = if ask == Ask::CachePut && stream == QCACHE && self.counts() && self.report.requests % 3 == 2 {
            Ask::CounterAdd
        } else {
            ask
        };
        let Some(node) = self.nodes.get_mut(name) else { return };
        let mut addr = [0u8; 16];
        addr[..8].copy_from_slice(&rng.next().to_be_bytes());
        let Ok(conn) = node.broker.admit(PeerAddr(addr), now) else { return };
        let needs = match ask {
            Ask::Commit => Features::ATOMIC_COMMIT,
            Ask::GroupPoll | Ask::GroupAck => Features::CONSUMER_GROUP,
            _ => Features::NONE,
        };
        let features = if modern { Features::REDIRECT | needs } else { needs };
        let (lo, hi) = features.to_words(true);
        let flags = if modern {
            0x0001 | 0x0008 | 0x0020 | 0x0040 | 0x0080 | 0x0200 | 0x1000
        } else {
            0x0001 | 0x0008 | 0x0040
        };
        let mut out = BytesMut::new();
        encode_json(
            &Message::Auth(message::Auth {
                tenant_id: TENANT.into(),
                token: TOKEN.into(),
                client_flags: Some(flags),
                client_flags_hi: None,
                client_features: lo,
                client_features_hi: hi,
            }),
            &mut out,
        );
        let shards = STREAMS.iter().find(|s| s.0 == stream).map_or(1, |s| s.1);
        // Every record of the replicated stream is unique, so the checker can find it (and so
        // is every value put to the replicated cache).
        let cache = if stream == QCACHE { QCACHE } else { CACHE };
        let payload = if stream == LEDGER || stream == QCACHE || stream == ORDERS || ask == Ask::CachePut {
            // Half the seeds put values to the replicated cache large enough that its
            // checkpoints keep them aside rather than encoded (`Cache::freeze`).
            let pad = if cache == QCACHE && self.seed.is_multiple_of(2) { crate::broker::FREEZE_MIN_VALUE } else { 0 };
            Bytes::from(format!("{}-{}{:>pad$}", self.seed, self.report.requests, ""))
        } else {
            Bytes::from_static(b"record")
        };
        match ask {
            Ask::Publish => {
                // A key that routes to the shard wanted.
                let key = (0..10_000u32)
                    .map(|k| format!("k{k}"))
                    .find(|k| {
                        crate::routing::shard_for_key(Some(k.as_bytes()), shards, message::Routing::Modulo) == shard
                    })
                    .unwrap_or_default();
                let b = PublishBatch {
                    acked: Some(AckedPrefix { request_id: 1, ack_mode: AckMode::PerBatch }),
                    idempotent: None,
                    key: Some(Bytes::from(key)),
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    stream: stream.into(),
                    records: Records::from_payloads([payload.as_ref()]).unwrap_or_default(),
                };
                let _ = b.encode(&mut out);
            }
            Ask::Commit => encode_json(
                &Message::Commit(message::Commit {
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    stream: stream.into(),
                    entity_key: message::B64(Bytes::from_static(b"account")),
                    event: message::B64(payload.clone()),
                    changes: vec![message::StateChange::Put {
                        key: commit_key(self.report.requests),
                        value: message::B64(payload.clone()),
                    }],
                    shard: Some(shard),
                    request_id: 1,
                    expected_offset: None,
                }),
                &mut out,
            ),
            Ask::CachePut => encode_json(
                &Message::CachePut(message::CachePut {
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    cache: cache.into(),
                    key: format!("k{shard}"),
                    value: message::B64(payload.clone()),
                    request_id: Some(1),
                    ttl_ms: None,
                }),
                &mut out,
            ),
            Ask::CounterAdd => encode_json(
                &Message::CounterAdd(message::CounterAdd {
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    cache: QCACHE.into(),
                    key: format!("n{shard}"),
                    delta: 1,
                    request_id: 1,
                }),
                &mut out,
            ),
            Ask::GroupPoll => encode_json(
                &Message::GroupPoll(message::GroupPoll {
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    stream: stream.into(),
                    shard,
                    group: GROUP.into(),
                    max_records: 4,
                    wait_ms: 0,
                    request_id: 1,
                    consumer: None,
                    reclaim: None,
                    // Records not acked in time are handed out again within the run.
                    visibility_ms: Some(3_000),
                }),
                &mut out,
            ),
            Ask::GroupAck => encode_json(
                &Message::GroupAck(message::GroupOffset {
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    stream: stream.into(),
                    shard,
                    group: GROUP.into(),
                    offset: acking.map_or(0, |(_, o)| o),
                    request_id: 1,
                }),
                &mut out,
            ),
            Ask::CacheGet => encode_json(
                &Message::CacheGet(message::CacheGet {
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    cache: cache.into(),
                    key: format!("k{shard}"),
                    request_id: Some(1),
                }),
                &mut out,
            ),
            Ask::Subscribe => encode_json(
                &Message::Subscribe(message::Subscribe {
                    tenant_id: TENANT.into(),
                    namespace: NS.into(),
                    stream: stream.into(),
                    subscription_id: None,
                    start: Some(StartPosition::Latest),
                    shard: Some(shard),
                    queue_capacity: None,
                    filter: None,
                }),
                &mut out,
            ),
        }
        self.report.requests += 1;
        if ask == Ask::Commit {
            let key = commit_key(self.report.requests - 1);
            self.commits.entry(shard).or_default().insert(payload.clone(), (key, now, None));
            self.quorum_payloads.insert((name.to_owned(), conn), payload);
        } else if (stream == LEDGER || stream == ORDERS) && ask == Ask::Publish {
            self.quorum_payloads.insert((name.to_owned(), conn), payload);
        } else if ask == Ask::GroupAck
            && let Some(at) = acking
        {
            self.acking.insert((name.to_owned(), conn), at);
        } else if ask == Ask::CounterAdd {
            let key = format!("n{shard}");
            self.counters.entry(key.clone()).or_default().sent += 1;
            self.adding.insert((name.to_owned(), conn), key);
        } else if ask == Ask::CachePut {
            let puts = if stream == QCACHE { &mut self.qputs } else { &mut self.cache_puts };
            puts.insert(payload.clone(), (format!("k{shard}"), now, None));
            self.quorum_payloads.insert((name.to_owned(), conn), payload);
        }
        self.pending.insert(
            (name.to_owned(), conn),
            Pending {
                node: name.to_owned(),
                conn,
                ask,
                shard: match ask {
                    Ask::CachePut | Ask::CacheGet | Ask::CounterAdd => ShardId {
                        kind: Kind::Cache,
                        tenant: TENANT.into(),
                        namespace: NS.into(),
                        name: if ask == Ask::CounterAdd { QCACHE.into() } else { cache.into() },
                        shard: 0,
                    },
                    _ => shard_id(stream, shard),
                },
                sent: now,
                must_succeed: must,
                bytes: BytesMut::new(),
                authed: false,
            },
        );
        let st = StreamId::new(Side::Client, Dir::Bi, 0);
        if let Some(node) = self.nodes.get_mut(name) {
            node.broker.handle_stream_data(conn, st, out.freeze(), false, now);
        }
    }
}

/// The state key the commit sent as request `n` puts (four keys, so values are overwritten
/// while checkpoints hold older ones).
fn commit_key(n: u64) -> String {
    format!("c{}", n % 4)
}
