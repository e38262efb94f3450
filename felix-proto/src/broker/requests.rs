//! Requests as they arrive on a control stream: authentication, the admission table (which request
//! is served, to whom, on which kind of stream), names and permissions.

use super::*;
use crate::binary::PublishBatch;
use crate::error_code::ErrorCode;
use crate::features::Features;
use crate::flags::{FlagError, Flags};
use crate::frame::Frame;
use crate::message::{self, Decoded, Direction, Message};
use crate::negotiate::{ClientOffer, broker_answer};
use crate::payload::PayloadKind;
use crate::transport::ConnId;
use bytes::Bytes;
use log::ShardLog;
use std::collections::HashMap;
use std::time::Instant;

impl Broker {
    pub(super) fn reject_flags(&mut self, conn: ConnId, st: &mut CtlStream, error: FlagError, payload: &[u8]) {
        let flags = match error {
            FlagError::Unknown { flags, .. }
            | FlagError::ConflictingKinds { flags }
            | FlagError::MissingBase { flags, .. }
            | FlagError::NotNegotiated { flags, .. } => Flags(flags),
        };
        let r = Refusal::new(ErrorCode::InvalidRequest, "unsupported frame flags");
        if st.session.is_none() {
            return self.refuse(conn, st, Refusal::new(ErrorCode::Unauthenticated, "authenticate first").closing());
        }
        // Decision D7: an acked publish is answered with its request id whatever else is wrong.
        // The id is read after the second flag word (D56) only on a stream that negotiated
        // one; from any other peer bit 15 is the reserved bit it knew, with nothing after it.
        let extended = Self::features_of(st).flags.contains(Flags::EXTENDED);
        let flags = flags.with(Flags::EXTENDED, extended && flags.contains(Flags::EXTENDED));
        match PublishBatch::peek_request_id(flags, payload) {
            Some(request_id) => {
                let offer = Self::features_of(st);
                let seq = self.owe(conn, st, Reply::Binary(request_id));
                let data = Self::publish_answer(&offer, Reply::Binary(request_id), Err(&r));
                self.answering().deliver_answer(conn, st, seq, data);
            }
            None => self.refuse(conn, st, r),
        }
    }

    pub(super) fn handle_frame(&mut self, conn: ConnId, st: &mut CtlStream, frame: Frame, now: Instant) {
        if st.session.is_none() {
            return self.handle_preauth(conn, st, frame, now);
        }
        match PayloadKind::of(frame.flags) {
            Some(PayloadKind::Json) => {
                self.stats.frames_in_json += 1;
                match message::decode(&frame.payload) {
                    Ok(Decoded::Message(m)) => self.handle_message(conn, st, m, now),
                    Ok(Decoded::Unknown(u)) => self.handle_unknown(conn, st, &u.type_name, u.request_id, None),
                    Err(e) => {
                        // JSON that does not decode is fatal to the stream (decision D16).
                        self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, e.to_string()).closing());
                    }
                }
            }
            Some(PayloadKind::Publish) => {
                self.stats.frames_in_binary += 1;
                self.handle_binary_publish(conn, st, frame, now)
            }
            // The decoder accepts only client-sendable flags, so nothing else reaches here.
            _ => self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, "unexpected frame kind").closing()),
        }
    }

    pub(super) fn handle_preauth(&mut self, conn: ConnId, st: &mut CtlStream, frame: Frame, now: Instant) {
        if !frame.flags.is_empty() {
            // A binary publish before auth: refused and the stream ends.
            return self.refuse(conn, st, Refusal::new(ErrorCode::Unauthenticated, "authenticate first").closing());
        }
        match message::decode(&frame.payload) {
            Ok(Decoded::Message(Message::Auth(a))) => self.handle_auth(conn, st, a, now),
            Ok(_) => self.refuse(conn, st, Refusal::new(ErrorCode::Unauthenticated, "authenticate first")),
            Err(e) => self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, e.to_string()).closing()),
        }
    }

    pub(super) fn handle_auth(&mut self, conn: ConnId, st: &mut CtlStream, a: message::Auth, now: Instant) {
        let offer = ClientOffer::from_auth(&a);
        if self.draining {
            // The reference's rule: `draining` (retry: connect elsewhere) to a client that
            // offered codes; nothing at all to one that did not, until the connection closes.
            self.stats.auths_refused_draining += 1;
            if offer.has(Features::ERROR_CODES) {
                let mut r = Refusal::new(ErrorCode::Draining, "the broker is shutting down: connect to another");
                r.retry = RetryClass::Retry;
                self.send(conn, st, json_frame(&Self::error_message(&offer, &r)));
            }
            return self.close_stream(conn, st);
        }
        let found = self
            .cfg
            .tokens
            .iter()
            .position(|t| t.token == a.token && t.tenant_id.as_ref().is_none_or(|tt| *tt == a.tenant_id));
        // Not a static token: a signed one, when the broker trusts signing keys.
        let signed = match (found, &self.cfg.jwt) {
            (None, Some(v)) if crate::jwt::Verifier::looks_like_jwt(&a.token) => {
                let secs = self.wall.micros(now) / 1_000_000;
                Some(v.verify(&a.token, secs).and_then(|(c, perms)| {
                    if c.tid != a.tenant_id {
                        Err(crate::jwt::JwtError::Malformed(format!("the token is for tenant {:?}", c.tid)))
                    } else if self.is_revoked(c.jti.as_deref(), &c.sub) {
                        Err(crate::jwt::JwtError::Revoked)
                    } else {
                        Ok((c, perms))
                    }
                }))
            }
            _ => None,
        };
        // No token at all: the connection's client certificate, when the driver verified one.
        let cert_names = self.conns.get(&conn).map(|c| c.cert_names.as_slice()).unwrap_or_default();
        let by_cert = (found.is_none() && a.token.is_empty() && !cert_names.is_empty())
            .then(|| {
                self.cfg.client_certs.iter().position(|g| {
                    cert_names.contains(&g.token) && g.tenant_id.as_ref().is_none_or(|t| *t == a.tenant_id)
                })
            })
            .flatten();
        let (token, jwt, principal) = match (found, signed, by_cert) {
            (Some(token), _, _) => (token, None, self.cfg.tokens[token].principal.clone()),
            (None, Some(Ok((claims, perms))), _) => {
                let credential = Credential { jti: claims.jti, sub: claims.sub.clone() };
                (0, Some(Box::new(SignedSession { perms, exp: claims.exp, credential })), claims.sub)
            }
            (None, None, Some(i)) => (i, None, self.cfg.client_certs[i].principal.clone()),
            (None, signed, _) => {
                // The broker reads the feature offer before answering, so even a refused auth
                // carries a code for a client that offered it.
                let why = match signed {
                    Some(Err(e)) => format!("invalid token: {e}"),
                    _ if a.token.is_empty() && !cert_names.is_empty() => format!(
                        "no credential: the client certificate ({}) is not granted tenant {}",
                        cert_names.join(", "),
                        a.tenant_id
                    ),
                    _ if a.token.is_empty() => "no credential: an empty token and no client certificate".to_string(),
                    _ => "invalid token".into(),
                };
                self.notice(Notice::LoginRefused { conn, tenant: a.tenant_id.clone(), reason: why.clone() });
                let r = Refusal::new(ErrorCode::Unauthenticated, why).closing();
                let m = Self::error_message(&offer, &r);
                self.send(conn, st, json_frame(&m));
                return self.close_stream(conn, st);
            }
        };
        // The tenant's connection quota: this connection counts from its first authenticated
        // stream; one more connection than allowed is refused, fatally.
        let counted = self.conns.get(&conn).is_some_and(|c| c.tenant.as_deref() == Some(a.tenant_id.as_str()));
        if let Some(max) = self.node.limits.max_connections(&a.tenant_id)
            && !counted
            && self.conns.values().filter(|c| c.tenant.as_deref() == Some(a.tenant_id.as_str())).count() >= max as usize
        {
            self.stats.quota_refusals += 1;
            let r = Refusal::new(
                ErrorCode::LimitExceeded,
                format!("tenant {} has its {max} connection(s) open already", a.tenant_id),
            )
            .closing();
            let m = Self::error_message(&offer, &r);
            self.send(conn, st, json_frame(&m));
            return self.close_stream(conn, st);
        }
        if let Some(c) = self.conns.get_mut(&conn)
            && c.tenant.is_none()
        {
            c.tenant = Some(a.tenant_id.clone());
        }
        let mut principal = principal.into_bytes();
        principal.truncate(255);
        let window =
            (offer.has(Features::PUBLISH_PIPELINE) && self.cfg.publish_window > 0).then_some(self.cfg.publish_window);
        let ack_on_commit = self.cfg.ack_on_commit || offer.has(Features::ACK_ON_COMMIT);
        st.session = Some(Session {
            tenant_id: a.tenant_id,
            principal: Bytes::from(principal),
            token,
            vouched: false,
            cert: by_cert.is_some() && found.is_none() && jwt.is_none(),
            jwt,
            offer,
            window,
            ack_on_commit,
            widths: HashMap::new(),
        });
        st.decoder.set_max_frame_len(self.cfg.max_frame_len);
        // Bit 15 only from a client that was shown it (D56): from any other it is refused as
        // not negotiated, as it was when it was reserved.
        let extended = offer.flags.contains(Flags::EXTENDED) && !self.cfg.server_flags_hi().is_empty();
        st.decoder
            .set_accepted_flags(Flags::CLIENT_SENDS.intersection(self.server_flags).with(Flags::EXTENDED, extended));
        if let Some(d) = st.auth_deadline.take() {
            self.timers.auth.remove(&(d, conn, st.id));
        }
        self.authenticated(conn);
        let answer = match broker_answer(
            &offer,
            self.server_flags,
            self.cfg.server_flags_hi(),
            self.server_features,
            self.cfg.publish_window,
        ) {
            Some(ok) => Message::AuthOk(ok),
            None => Message::Ok(message::OkMsg {}),
        };
        self.send(conn, st, json_frame(&answer));
    }

    pub(super) fn handle_unknown(
        &mut self,
        conn: ConnId,
        st: &mut CtlStream,
        type_name: &str,
        request_id: Option<u64>,
        extension: Option<String>,
    ) {
        let offer = Self::features_of(st);
        if offer.has(Features::UNSUPPORTED) && self.server_features.contains(Features::UNSUPPORTED) {
            let m = Message::Unsupported(message::Unsupported {
                request_type: type_name.to_owned(),
                request_id,
                extension,
            });
            self.send(conn, st, json_frame(&m));
        } else {
            // The old behaviour: the stream is closed.
            self.close_stream(conn, st);
        }
    }

    pub(super) fn handle_message(&mut self, conn: ConnId, st: &mut CtlStream, m: Message, now: Instant) {
        // A poll or seek may create its group: its name follows the grammar of new names.
        let creates = matches!(m, Message::GroupPoll(_) | Message::GroupSeek(_));
        if let Some(g) = group_name(&m)
            && let Err(r) =
                check_names(&[("group", g)]).and_then(|()| if creates { check_new_name("group", g) } else { Ok(()) })
        {
            return self.refuse(conn, st, r);
        }
        if st.uni && !matches!(m, Message::Publish(_) | Message::PublishBatch(_) | Message::PublishWidth(_)) {
            // A publish-only stream carries publishes only; anything else closes it.
            return self.close_stream(conn, st);
        }
        // Admission, from the table the client checks too: a request type this broker does not
        // advertise is answered like an unknown type.
        if let Some(bit) = crate::client::needs::request_feature(&m)
            && !self.server_features.contains(bit)
        {
            let rid = m.request_id();
            return self.handle_unknown(conn, st, m.type_name(), rid, None);
        }
        // In a cluster, cache and counter requests go to the cache's owner.
        if self.forward_cache_request(conn, st, &m, now) {
            return;
        }
        match m {
            Message::Auth(_) => self.refuse(conn, st, Refusal::new(ErrorCode::InvalidRequest, "already authenticated")),
            // A single publish is a batch of one.
            Message::Publish(p) => {
                let batch = message::PublishBatchMsg {
                    tenant_id: p.tenant_id,
                    namespace: p.namespace,
                    stream: p.stream,
                    payloads: vec![p.payload],
                    key: p.key,
                    shard: p.shard,
                    request_id: p.request_id,
                    ack: p.ack,
                    publish_width: p.publish_width,
                };
                self.publish_json(conn, st, batch, now);
            }
            Message::PublishBatch(p) => self.publish_json(conn, st, p, now),
            Message::PublishWidth(w) => {
                if let Some(s) = st.session.as_mut() {
                    s.widths.insert(key(&w.tenant_id, &w.namespace, &w.stream), w.width);
                }
            }
            Message::Subscribe(s) => self.subscribe(conn, st, s, now),
            Message::CachePut(p) => self.cache_put(conn, st, p, now),
            Message::CacheGet(g) => self.cache_get(conn, st, g, now),
            Message::CacheDelete(d) => self.cache_delete(conn, st, d, now),
            Message::CachePutIf(p) => self.cache_put_if(conn, st, p, now),
            Message::CacheDeleteIf(d) => self.cache_delete_if(conn, st, d, now),
            Message::StreamRead(r) => self.stream_read(conn, st, r),
            Message::CacheWatch(w) => match self.cache_watch_elsewhere(st, &w) {
                Some(answer) => self.send(conn, st, json_frame(&answer)),
                None => self.cache_watch(conn, st, w, now),
            },
            Message::ProducerInit(p) => {
                let producer_id = self.random();
                let m = Message::ProducerInitOk(message::ProducerInitOk { request_id: p.request_id, producer_id });
                self.send(conn, st, json_frame(&m));
            }
            Message::PublishIdempotent(p) => {
                self.stats.publishes_json += 1;
                let req = PublishReq {
                    idempotent: Some((p.producer_id, p.sequence)),
                    ..PublishReq::json(p.tenant_id, p.namespace, p.stream, p.payloads, p.key, None, p.publish_width)
                };
                self.publish(conn, st, req, Reply::Refusable(p.request_id), now);
            }
            Message::PublishIf(p) => {
                self.stats.publishes_json += 1;
                let req = PublishReq {
                    expected_offset: Some(p.expected_offset),
                    ..PublishReq::json(p.tenant_id, p.namespace, p.stream, p.payloads, p.key, p.shard, p.publish_width)
                };
                self.publish(conn, st, req, Reply::Refusable(p.request_id), now);
            }
            Message::Commit(c) => self.commit(conn, st, c, now),
            Message::StreamDelete(d) => self.stream_delete(conn, st, d, now),
            Message::StreamCreate(c) => self.stream_create(conn, st, c, now),
            Message::Topology(_) => self.topology(conn, st),
            Message::ShardOwners(q) => self.shard_owners(conn, st, q),
            Message::ShardInspect(q) => self.shard_inspect(conn, st, q),
            Message::ClusterStatus(q) => self.cluster_status(conn, st, q),
            Message::ShardMove(m) => self.shard_move(conn, st, m),
            Message::SubscriptionsList(q) => self.subscriptions_list(conn, st, q),
            Message::StateGet(g) => self.state_get(conn, st, g),
            Message::CounterAdd(a) => self.counter_add(conn, st, a, now),
            Message::CounterGet(g) => self.counter_get(conn, st, g, now),
            Message::GroupPoll(p) => self.group_poll(conn, st, p, now),
            Message::GroupAck(a) => self.group_ack(conn, st, a, now),
            Message::GroupNack(n) => self.group_nack(conn, st, n, now),
            Message::GroupExtend(e) => self.group_extend(conn, st, e, now),
            Message::GroupDeadLetter(a) => self.group_dead_letter(conn, st, a, now),
            Message::GroupDeadLetters(r) => self.group_dead_letters(conn, st, r, now),
            Message::GroupDiscard(a) => self.group_dead_letter_op(conn, st, a, false, now),
            Message::GroupRedrive(a) => self.group_dead_letter_op(conn, st, a, true, now),
            Message::GroupSeek(q) => self.group_seek(conn, st, q, now),
            Message::GroupDescribe(r) => self.group_describe(conn, st, r, now),
            Message::GroupList(q) => self.group_list(conn, st, q, now),
            Message::CacheKeys(q) => self.cache_keys(conn, st, q, now),
            Message::StreamList(q) => self.stream_list(conn, st, q),
            Message::StreamInfo(q) => self.stream_info(conn, st, q),
            Message::GroupDelete(r) => self.group_delete(conn, st, r, now),
            Message::OffsetForTime(q) => self.offset_for_time(conn, st, q),
            Message::StreamShards(q) => {
                // A question, never a creation: 0 is "no such stream" (REFERENCE.md), or one
                // still being created. Publishers ask it (to route keys) as well as readers, so
                // either permission answers; a token with neither is refused (D49), as before
                // it was answered 0, which a reader took for a missing stream.
                let (t, ns, s) = (&q.tenant_id, &q.namespace, &q.stream);
                let action = if self.authorize(st, t, ns, s, Action::Publish).is_ok() {
                    Action::Publish
                } else {
                    Action::Subscribe
                };
                let shards = match self.lookup_stream(st, t, ns, s, action, Missing::NotFound) {
                    Ok(n) => n,
                    Err(r) if matches!(r.code, ErrorCode::NotFound | ErrorCode::ShardUnavailable) => 0,
                    Err(r) => return self.refuse(conn, st, r),
                };
                let routing = self
                    .node
                    .streams
                    .get(KeyRef(&q.tenant_id, &q.namespace, &q.stream).q())
                    .map(|e| e.config.routing)
                    .filter(|r| *r == message::Routing::JumpHash);
                let m =
                    Message::StreamShardsView(message::StreamShardsView { shards, request_id: q.request_id, routing });
                self.send(conn, st, json_frame(&m));
            }
            Message::CacheShards(q) => {
                let known = self.node.caches.contains_key(KeyRef(&q.tenant_id, &q.namespace, &q.cache).q());
                let shards =
                    self.cluster_cache_shards(&q.tenant_id, &q.namespace, &q.cache).unwrap_or_else(|| u32::from(known));
                let m = Message::CacheShardsView(message::CacheShardsView { shards, request_id: q.request_id });
                self.send(conn, st, json_frame(&m));
            }
            Message::Extension(e) => self.handle_unknown(conn, st, "extension", Some(e.request_id), Some(e.name)),
            Message::Error(_) => self.close_stream(conn, st),
            other if other.direction() == Direction::ToClient => self.refuse(
                conn,
                st,
                Refusal::new(ErrorCode::InvalidRequest, format!("unexpected message type {}", other.type_name()))
                    .closing(),
            ),
            // A request of the catalogue this broker does not serve (it does not advertise its
            // feature bit): answered like an unknown type.
            other => {
                let rid = other.request_id();
                self.handle_unknown(conn, st, other.type_name(), rid, None)
            }
        }
    }

    pub(super) fn create_stream(&mut self, k: Key, config: StreamConfig) -> u32 {
        let shards = config.shards.max(1);
        // A replicated shard's older history is read back from its Raft log on disk (the
        // cluster node turns the read into one of the log), a durable shard's from its segments.
        let budget = (config.durable && self.cfg.history_reads).then_some(config.memory_bytes);
        let entry = StreamEntry {
            shards: (0..shards)
                .map(|_| {
                    let mut log = ShardLog::new(config.durable, config.retention);
                    log.set_memory_budget(budget);
                    Shard {
                        log,
                        subs: Vec::new(),
                        serving: Serving::Here,
                        paused: Vec::new(),
                        hold: None,
                        producers: Default::default(),
                        full: None,
                        state: Default::default(),
                        replicating: 0,
                        read_lease: None,
                    }
                })
                .collect(),
            config,
        };
        self.node.aged_streams += usize::from(entry.config.retention.max_age.is_some());
        if let Some(old) = self.node.streams.insert(k, entry) {
            self.node.aged_streams -= usize::from(old.config.retention.max_age.is_some());
        }
        shards
    }

    /// `revoked` when a signed token expired (by the broker's clock) or is on the revocation
    /// list; `None` while it stands.
    pub(super) fn credential_lapse(&self, j: &SignedSession) -> Option<Refusal> {
        let now = self.clock.last().unwrap_or_else(|| self.wall.anchor());
        if self.wall.micros(now) / 1_000_000 >= j.exp {
            return Some(Refusal::new(ErrorCode::Revoked, "the token this stream authenticated with expired"));
        }
        let c = &j.credential;
        self.is_revoked(c.jti.as_deref(), &c.sub)
            .then(|| Refusal::new(ErrorCode::Revoked, "the token this stream authenticated with was revoked"))
    }

    /// Whether the stream's credential may do `action` on `t`'s `ns/name`.
    pub(super) fn authorize(
        &self,
        st: &CtlStream,
        t: &str,
        ns: &str,
        name: &str,
        action: Action,
    ) -> Result<(), Refusal> {
        let Some(sess) = st.session.as_ref() else {
            return Err(Refusal::new(ErrorCode::Unauthenticated, "authenticate first"));
        };
        if sess.tenant_id != t {
            return Err(Refusal::new(ErrorCode::Forbidden, format!("token is not valid for tenant {t}")));
        }
        if let Some(j) = &sess.jwt {
            // What a session opened with it may do ends with its credential.
            if let Some(r) = self.credential_lapse(j) {
                return Err(r);
            }
            if !crate::jwt::allows(&j.perms, action, t, ns, name) {
                return Err(Refusal::new(
                    ErrorCode::Forbidden,
                    format!("not allowed to {} {ns}/{name}", action.name()),
                ));
            }
            return Ok(());
        }
        let grants = if sess.cert { &self.cfg.client_certs } else { &self.cfg.tokens };
        if !sess.vouched && !grants.get(sess.token).is_some_and(|t| t.allows(action, ns, name)) {
            return Err(Refusal::new(ErrorCode::Forbidden, format!("not allowed to {} {ns}/{name}", action.name())));
        }
        Ok(())
    }

    /// Asks the cluster to create a stream (the metadata group registers it and places its
    /// shards) and says so: `shard_unavailable` reason `creating`, retry in 200 ms.
    fn stream_creating(
        &mut self,
        t: &str,
        ns: &str,
        s: &str,
        shards: u32,
        ephemeral: bool,
        replication: u32,
    ) -> Refusal {
        self.out.push_back(BrokerOutput::Cluster(ClusterOutput::ProposeStream {
            tenant_id: t.to_owned(),
            namespace: ns.to_owned(),
            stream: s.to_owned(),
            shards,
            ephemeral,
            replication,
        }));
        let mut r = Refusal::new(
            ErrorCode::ShardUnavailable,
            format!("stream {ns}/{s} is being created in the cluster; retry"),
        );
        r.detail = Some(crate::binary::ErrorDetail { reason: Some("creating".into()), retry_after_ms: Some(200) });
        r.retry = RetryClass::Retry;
        r
    }

    /// Checks tenant and permission, then finds (or auto-creates) the stream. Returns its shard
    /// count.
    pub(super) fn lookup_stream(
        &mut self,
        st: &CtlStream,
        t: &str,
        ns: &str,
        s: &str,
        action: Action,
        missing: Missing,
    ) -> Result<u32, Refusal> {
        check_names(&[("tenant", t), ("namespace", ns), ("stream", s)])?;
        self.authorize(st, t, ns, s, action)?;
        if s.starts_with(syslog::SYS_PREFIX) {
            return Err(Refusal::new(
                ErrorCode::InvalidRequest,
                format!("stream names starting with {} are reserved for the broker", syslog::SYS_PREFIX),
            ));
        }
        if let Some(e) = self.node.streams.get(KeyRef(t, ns, s).q()) {
            // In a cluster a stream exists once the metadata says so: one this broker has from
            // its own configuration is proposed with that configuration first (every broker
            // would otherwise write its own copy).
            if self.membership.view.as_ref().is_some_and(|c| !c.knows_stream(t, ns, s)) {
                let (shards, durable, rf) = (e.shards.len() as u32, e.config.durable, e.config.replication);
                return Err(self.stream_creating(t, ns, s, shards, !durable, rf));
            }
            return Ok(e.shards.len() as u32);
        }
        // A configured stream deleted at run time comes back as configured when used again
        // (it exists as far as a reader is concerned: the configuration declares it).
        if let Some(spec) = self.cfg.streams.iter().find(|x| x.tenant_id == t && x.namespace == ns && x.name == s) {
            let cfg = spec.config.clone();
            return Ok(self.create_stream(key(t, ns, s), cfg));
        }
        if missing == Missing::NotFound {
            return Err(Refusal::new(ErrorCode::NotFound, format!("stream {ns}/{s} not found")));
        }
        check_new_name("tenant", t)?;
        check_new_name("namespace", ns)?;
        check_new_name("stream", s)?;
        if self.cfg.auto_create
            && let Some(max) = self.node.limits.max_streams(t, ns)
            && self.node.streams.keys().filter(|k| k.tenant() == t && k.namespace() == ns && !syslog::is_sys(k)).count()
                >= max as usize
        {
            self.stats.quota_refusals += 1;
            return Err(Refusal::new(
                ErrorCode::LimitExceeded,
                format!("namespace {t}/{ns} has its {max} stream(s) already: {s} is not created"),
            ));
        }
        if self.cfg.auto_create && self.membership.view.is_some() {
            // In a cluster a stream exists once the metadata group says so, with its owners.
            let d = &self.cfg.default_stream;
            let (shards, durable, rf) = (d.shards.max(1), d.durable, d.replication);
            return Err(self.stream_creating(t, ns, s, shards, !durable, rf));
        }
        if self.cfg.auto_create {
            let cfg = self.cfg.default_stream.clone();
            return Ok(self.create_stream(key(t, ns, s), cfg));
        }
        Err(Refusal::new(ErrorCode::NotFound, format!("stream {ns}/{s} not found")))
    }

    // -----------------------------------------------------------------------------------------
    // Publishing
}

/// What a request does with a stream that does not exist: a write (and a subscription, which
/// waits for writes) creates it where the broker auto-creates; a read or a question about it
/// never does (`read nosuchstream` must not leave a stream behind), it answers `not_found`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Missing {
    /// Created on first use (when `auto_create` is on).
    Create,
    /// Answered `not_found`.
    NotFound,
}

/// The group a consumer-group request names.
pub(super) fn group_name(m: &Message) -> Option<&str> {
    Some(match m {
        Message::GroupPoll(p) => &p.group,
        Message::GroupAck(a) | Message::GroupDeadLetter(a) | Message::GroupDiscard(a) | Message::GroupRedrive(a) => {
            &a.group
        }
        Message::GroupNack(n) => &n.group,
        Message::GroupExtend(e) => &e.group,
        Message::GroupSeek(s) => &s.group,
        Message::GroupDeadLetters(r) | Message::GroupDescribe(r) | Message::GroupDelete(r) => &r.group,
        _ => return None,
    })
}

/// The longest tenant, namespace, stream, cache or group name, in bytes. Names become file
/// names (escaped: a byte outside `[A-Za-z0-9_.-]` takes three), so the escaped form must also
/// fit a file name with room for a system log's prefix.
pub const MAX_NAME_BYTES: usize = 200;
pub(super) const MAX_ESCAPED_NAME: usize = 230;

/// Why `name` may not name a new tenant, namespace, stream, cache or group (D49), or `None`:
/// it must be 1 to [`MAX_NAME_BYTES`] bytes of ASCII letters, digits, `_`, `-` and `.`, and not
/// `.` or `..`: Kafka's topic grammar, so a name is its own file name and never a pattern
/// (`orders.*`), a path (`a/b`) or blank. Clients check it too, before sending.
pub fn name_problem(name: &str) -> Option<String> {
    let bad = name.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.')));
    let why = if name.is_empty() {
        "is empty".to_owned()
    } else if name == "." || name == ".." {
        format!("{name:?} is not a name")
    } else if name.len() > MAX_NAME_BYTES {
        format!("is {} bytes long", name.len())
    } else if let Some(c) = bad {
        format!("{name:?} holds {c:?}")
    } else {
        return None;
    };
    Some(format!("{why}: names are 1 to {MAX_NAME_BYTES} letters, digits, '_', '-' and '.'"))
}

/// [`name_problem`] as the broker's refusal. It is checked only where something would be
/// created: a stream or cache an older broker created under a name outside it stays reachable.
pub(super) fn check_new_name(what: &str, name: &str) -> Result<(), Refusal> {
    match name_problem(name) {
        None => Ok(()),
        Some(why) => Err(Refusal::new(ErrorCode::InvalidRequest, format!("{what} name {why}"))),
    }
}

pub(super) fn check_names(names: &[(&str, &str)]) -> Result<(), Refusal> {
    for (what, name) in names {
        let escaped = crate::storage::path_component_len(name);
        if name.len() > MAX_NAME_BYTES || escaped > MAX_ESCAPED_NAME {
            return Err(Refusal::new(
                ErrorCode::InvalidRequest,
                format!(
                    "{what} name is {} bytes ({escaped} as a file name); the most is {MAX_NAME_BYTES} ({MAX_ESCAPED_NAME})",
                    name.len()
                ),
            ));
        }
    }
    Ok(())
}
