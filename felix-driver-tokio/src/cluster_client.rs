//! A client of a whole cluster: several bootstrap addresses, a view of who owns each shard
//! (`stream_shards` + `shard_owners`), keyed publishes and owner-only requests sent straight to
//! the owner, `not_leader` followed with bounded hops, and the view refreshed whenever a broker
//! says it is wrong.
//!
//! The rules (the reference's): at most [`MAX_HOPS`] redirects per request, never the same
//! broker twice per attempt, and a redirect naming an older generation than one already
//! followed is stale (ignored: the request fails rather than going back). A request for a shard
//! whose owner is not known (a single broker, a stream the cluster is still creating, a view
//! not fetched) goes to any broker: brokers forward publishes and redirect the rest, so routing
//! here only saves a hop.
//!
//! Against a single broker (no FEATURE_SHARD_OWNERS) everything goes to it, as with [`Client`].

use crate::client::{Client, ClientError, ClientOptions, Page, PublishOptions, Subscription};
use bytes::Bytes;
use felix_proto::message::{Routing, StartPosition};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Redirects followed per request at most.
pub const MAX_HOPS: usize = 3;

/// Sends of one publish at most when brokers refuse it because the view was wrong or the
/// stream is being created (a refusal wrote nothing, so sending again cannot duplicate).
pub const PUBLISH_TRIES: u32 = 20;

/// How long a connection to one broker may take before the next one is tried (a dead broker
/// would otherwise hold a request for QUIC's whole idle timeout).
pub const CONNECT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// How long a broker whose connection was just lost, or that did not take one, is passed over
/// for the others (a killed broker would otherwise cost a whole [`CONNECT_TIMEOUT`] on every
/// request the view still sends to it).
pub const LOST_BACKOFF: std::time::Duration = std::time::Duration::from_secs(2);

/// How long [`ClusterClient::any`] keeps trying the seeds when none takes a connection (every
/// broker draining or restarting).
pub const RECONNECT_WAIT: std::time::Duration = std::time::Duration::from_secs(15);

/// One shard's owner as last seen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardHome {
    /// The owner's node id (`None`: unavailable, or not known).
    pub node_id: Option<String>,
    /// Its client address, when given and parseable.
    pub addr: Option<SocketAddr>,
    /// The ownership generation.
    pub generation: u64,
}

/// What the client knows of a stream's shards.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StreamView {
    /// Shard count.
    pub shards: u32,
    /// How keys map to shards.
    pub routing: Routing,
    /// Owner per shard (empty: no owners known, a single broker).
    pub owners: Vec<ShardHome>,
}

impl StreamView {
    /// The shard a key goes to.
    pub fn shard_for(&self, key: Option<&[u8]>) -> u32 {
        felix_proto::routing::shard_for_key(key, self.shards.max(1), self.routing)
    }

    /// The owner's address of a shard, when known.
    pub fn owner_addr(&self, shard: u32) -> Option<SocketAddr> {
        self.owners.get(shard as usize).and_then(|o| o.addr)
    }
}

/// Counters, for tests and metrics.
#[derive(Debug, Default)]
pub struct ClusterClientStats {
    /// Redirects followed.
    pub redirects: AtomicU64,
    /// Views fetched (first time or refreshed).
    pub view_fetches: AtomicU64,
    /// Requests sent straight to a shard's owner.
    pub routed_to_owner: AtomicU64,
}

/// A broker's connection, once made ([`ClusterClient::at`] holds it while dialling).
type Slot = Arc<tokio::sync::Mutex<Option<Client>>>;

/// A client of a cluster (or of a single broker).
#[derive(Debug)]
pub struct ClusterClient {
    opts: ClientOptions,
    seeds: Vec<SocketAddr>,
    /// One slot per broker, each holding its connection once made. A dial holds its broker's
    /// slot only, for up to [`CONNECT_TIMEOUT`]: a broker that does not answer (paused, cut
    /// off) holds up the requests bound for it, never those for the others. (One lock over
    /// every connection, held across the dial, stalled every lane of a client while one broker
    /// was paused: 16 s without an acknowledged write in one of the chaos schedule's pauses,
    /// 74 ms with a slot per broker.)
    conns: std::sync::Mutex<BTreeMap<SocketAddr, Slot>>,
    views: std::sync::Mutex<BTreeMap<(String, String), Arc<StreamView>>>,
    /// Brokers whose connection was lost or could not be made, and when ([`LOST_BACKOFF`]).
    lost: std::sync::Mutex<BTreeMap<SocketAddr, std::time::Instant>>,
    /// Views forgotten after a refusal: each one moves [`any`](Self::any) on to the next seed,
    /// so a broker whose own view is stale (cut off from the others, it still names itself the
    /// owner) is not the one asked again and again.
    turn: std::sync::atomic::AtomicUsize,
    /// Counters.
    pub stats: ClusterClientStats,
}

impl ClusterClient {
    /// Connects to the first of `seeds` that answers.
    ///
    /// # Errors
    /// The last connection error when none answers; [`ClientError::Invalid`] for no seeds.
    pub async fn connect(seeds: &[SocketAddr], opts: ClientOptions) -> Result<ClusterClient, ClientError> {
        if seeds.is_empty() {
            return Err(ClientError::Invalid("no broker address".into()));
        }
        let c = ClusterClient {
            opts,
            seeds: seeds.to_vec(),
            conns: std::sync::Mutex::new(BTreeMap::new()),
            views: std::sync::Mutex::new(BTreeMap::new()),
            lost: std::sync::Mutex::new(BTreeMap::new()),
            turn: std::sync::atomic::AtomicUsize::new(0),
            stats: ClusterClientStats::default(),
        };
        c.any().await?;
        Ok(c)
    }

    /// A connection to some broker: one already open, else the first seed that answers.
    ///
    /// # Errors
    /// The last connection error when no broker answers.
    ///
    /// A broker that is draining (it refuses connections, or answers `auth` with `draining`)
    /// or does not answer is passed over for the next seed; when none takes the connection the
    /// client waits and tries them all again (250 ms, doubling to 2 s) for up to
    /// [`RECONNECT_WAIT`], so a client of a single broker rides out its restart. A refusal that
    /// retrying cannot cure (a bad credential) is returned at once.
    pub async fn any(&self) -> Result<Client, ClientError> {
        // After a refusal: the seeds in turn, from the next one on (a broker passed over for a
        // lost connection is skipped by `at`).
        let turn = self.turn.load(Ordering::Relaxed);
        if turn > 0 {
            let n = self.seeds.len();
            for k in 0..n {
                if let Ok(c) = self.at(self.seeds[(turn + k) % n]).await {
                    return Ok(c);
                }
            }
        }
        // Brokers whose connection closed (drained, stopped) are tried after the others: a
        // stopped broker costs a whole connect timeout.
        // (A broker being dialled is neither: its slot is busy.)
        let seeds: Vec<SocketAddr> = {
            let known = self.known();
            if let Some(c) = known.iter().filter_map(|(_, c)| c.as_ref()).find(|c| !c.is_closed()) {
                return Ok(c.clone());
            }
            let (gone, rest): (Vec<SocketAddr>, Vec<SocketAddr>) = self
                .seeds
                .iter()
                .partition(|s| known.iter().any(|(a, c)| a == *s && c.as_ref().is_some_and(Client::is_closed)));
            rest.into_iter().chain(gone).collect()
        };
        let start = std::time::Instant::now();
        let mut pause = std::time::Duration::from_millis(250);
        loop {
            let mut last = None;
            for s in &seeds {
                match self.at(*s).await {
                    Ok(c) => return Ok(c),
                    Err(e) if !Self::worth_reconnecting(&e) => return Err(e),
                    Err(e) => last = Some(e),
                }
            }
            let e = last.unwrap_or_else(|| ClientError::Connect("no broker answered".into()));
            if start.elapsed() + pause > RECONNECT_WAIT {
                return Err(e);
            }
            tracing::debug!("no broker took the connection ({e}); trying again in {pause:?}");
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(std::time::Duration::from_secs(2));
        }
    }

    /// A connection failure that another broker, or the same one a moment later, may not have:
    /// no answer, a refused or lost connection, `draining`, or any refusal the broker marked
    /// retryable.
    fn worth_reconnecting(e: &ClientError) -> bool {
        use felix_proto::error_code::RetryClass;
        match e {
            ClientError::Connect(_) | ClientError::Closed(_) => true,
            ClientError::Refused(i) => {
                i.code == Some(felix_proto::ErrorCode::Draining)
                    || matches!(i.retry, Some(RetryClass::Retry | RetryClass::RetryAfter))
            }
            _ => false,
        }
    }

    /// The connection to the broker at `addr` (opened on first use, again after it closed).
    /// A broker whose connection was lost, or that did not take one, less than
    /// [`LOST_BACKOFF`] ago is not dialled again yet (the caller goes to another broker).
    ///
    /// # Errors
    /// The connection error.
    pub async fn at(&self, addr: SocketAddr) -> Result<Client, ClientError> {
        let slot = match self.conns.lock() {
            Ok(mut conns) => conns.entry(addr).or_default().clone(),
            Err(_) => return Err(ClientError::Closed("the client's connection table was poisoned".into())),
        };
        // Waits only for a dial to this same broker.
        let mut conn = slot.lock().await;
        match conn.as_ref() {
            Some(c) if !c.is_closed() => return Ok(c.clone()),
            Some(_) => {
                *conn = None;
                self.note_lost(addr);
            }
            None => {}
        }
        if let Some(ago) = self.lost_since(addr)
            && ago < LOST_BACKOFF
        {
            return Err(ClientError::Connect(format!(
                "{addr}: lost or refused a connection {} ms ago, passed over for {LOST_BACKOFF:?}",
                ago.as_millis()
            )));
        }
        let c = tokio::time::timeout(CONNECT_TIMEOUT, Client::connect(addr, self.opts.clone()))
            .await
            .map_err(|_| ClientError::Connect(format!("{addr} did not answer within {CONNECT_TIMEOUT:?}")))
            .and_then(|r| r);
        match c {
            Ok(c) => {
                if let Ok(mut l) = self.lost.lock() {
                    l.remove(&addr);
                }
                *conn = Some(c.clone());
                Ok(c)
            }
            Err(ClientError::Connect(m)) if m.contains("invalid peer certificate") => {
                // Not worth dialling again soon: the same certificate would be refused again.
                Err(ClientError::Connect(format!(
                    "{addr}: its TLS certificate is not trusted ({m}); a cluster client reaches every broker \
                     that serves a shard it uses, so its trust must hold each broker's certificate, or the \
                     CA that signed them (the cluster CA's ca.pem when the brokers run with --cluster-ca)"
                )))
            }
            Err(e) => {
                if Self::worth_reconnecting(&e) {
                    self.note_lost(addr);
                }
                Err(e)
            }
        }
    }

    /// The connections known, by broker, without waiting: `None` for one not made yet or being
    /// dialled now.
    fn known(&self) -> Vec<(SocketAddr, Option<Client>)> {
        let slots: Vec<(SocketAddr, Slot)> = match self.conns.lock() {
            Ok(conns) => conns.iter().map(|(a, s)| (*a, s.clone())).collect(),
            Err(_) => return Vec::new(),
        };
        slots.into_iter().map(|(a, s)| (a, s.try_lock().ok().and_then(|c| c.clone()))).collect()
    }

    fn note_lost(&self, addr: SocketAddr) {
        if let Ok(mut l) = self.lost.lock() {
            l.insert(addr, std::time::Instant::now());
        }
    }

    fn lost_since(&self, addr: SocketAddr) -> Option<std::time::Duration> {
        self.lost.lock().ok()?.get(&addr).map(std::time::Instant::elapsed)
    }

    /// The view of a stream: cached, or fetched from any broker.
    ///
    /// # Errors
    /// The broker's errors (a single broker's missing FEATURE_SHARD_OWNERS is not one).
    pub async fn view(&self, ns: &str, stream: &str) -> Result<Arc<StreamView>, ClientError> {
        if let Some(v) = self.views.lock().ok().and_then(|v| v.get(&(ns.to_owned(), stream.to_owned())).cloned()) {
            return Ok(v);
        }
        let c = self.any().await?;
        let (shards, routing) = c.stream_shards(ns, stream).await?;
        let owners = match c.shard_owners(ns, stream).await {
            Ok(o) => o
                .into_iter()
                .map(|o| ShardHome {
                    addr: o.addr.as_deref().and_then(|a| a.parse().ok()).filter(|_| o.unavailable.is_none()),
                    node_id: o.node_id,
                    generation: o.generation,
                })
                .collect(),
            Err(ClientError::Unsupported(_)) => Vec::new(),
            Err(e) => return Err(e),
        };
        self.stats.view_fetches.fetch_add(1, Ordering::Relaxed);
        let v = Arc::new(StreamView { shards, routing, owners });
        // Cached only once complete: a stream still being created is asked again next time.
        if shards > 0
            && (v.owners.is_empty() || v.owners.len() == shards as usize)
            && let Ok(mut views) = self.views.lock()
        {
            views.insert((ns.to_owned(), stream.to_owned()), v.clone());
        }
        Ok(v)
    }

    /// Takes a view learnt elsewhere (or a stale one, to test what happens). It is used until a
    /// broker says it is wrong.
    pub fn prime(&self, ns: &str, stream: &str, view: StreamView) {
        if let Ok(mut v) = self.views.lock() {
            v.insert((ns.to_owned(), stream.to_owned()), Arc::new(view));
        }
    }

    /// Forgets the view of a stream (a broker said it is wrong): the next request fetches it.
    pub fn forget(&self, ns: &str, stream: &str) {
        if let Ok(mut v) = self.views.lock() {
            v.remove(&(ns.to_owned(), stream.to_owned()));
        }
        self.turn.fetch_add(1, Ordering::Relaxed);
    }

    /// The connection a publish with `key` should use: the owner of the key's shard (shard 0
    /// without a key) when the view knows it, else any broker (which forwards). For a caller
    /// that keeps one connection for a run of publishes to one key (the CLI).
    ///
    /// # Errors
    /// As [`view`](Self::view), or no broker answering.
    pub async fn client_for_key(&self, ns: &str, stream: &str, key: Option<&[u8]>) -> Result<Client, ClientError> {
        let view = self.view(ns, stream).await?;
        let shard = Some(view.shard_for(key));
        self.route(ns, stream, shard).await
    }

    /// Where a request for `shard` goes first: its owner when known, else any broker.
    async fn route(&self, ns: &str, stream: &str, shard: Option<u32>) -> Result<Client, ClientError> {
        let view = self.view(ns, stream).await?;
        if let Some(addr) = shard.and_then(|s| view.owner_addr(s)) {
            if let Ok(c) = self.at(addr).await {
                self.stats.routed_to_owner.fetch_add(1, Ordering::Relaxed);
                return Ok(c);
            }
            // The owner does not answer: any broker says what to do (forwards, or
            // `shard_unavailable`).
            self.forget(ns, stream);
        }
        self.any().await
    }

    /// Publishes a batch, straight to the owner of the key's shard. A broker that refuses it
    /// because the view is wrong (`not_leader`) or the stream is still being created makes the
    /// client refresh the view and send it again, up to [`PUBLISH_TRIES`] times, after the
    /// pause the broker asked for; any other `shard_unavailable` gets one fresh view. Only
    /// refusals are retried: a batch whose outcome is unknown (lost in flight) is reported,
    /// never sent twice.
    ///
    /// # Errors
    /// As [`Client::publish`].
    pub async fn publish(
        &self,
        ns: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        opts: PublishOptions,
    ) -> Result<Option<u64>, ClientError> {
        let mut tries = 0;
        // Where the last `not_leader` pointed: asked next, before the view (which may still
        // name the old owner for a moment after a fail-over).
        let mut hint: Option<SocketAddr> = None;
        loop {
            tries += 1;
            let view = self.view(ns, stream).await?;
            // An unkeyed publish goes to shard 0, as brokers route it.
            let shard = Some(view.shard_for(opts.key.as_deref()));
            let c = match hint.take() {
                Some(a) => match self.at(a).await {
                    Ok(c) => c,
                    Err(_) => self.route(ns, stream, shard).await?,
                },
                None => self.route(ns, stream, shard).await?,
            };
            let e = match c.publish(ns, stream, payloads.clone(), opts.clone()).await {
                // Told the view is wrong, or refused for a moment (the stream being created,
                // the shard cutting over a move, electing): worth another go. Another refusal
                // (an owner that is down) is worth one fresh view at most.
                Err(e) if Self::view_was_wrong(&e) && (tries < 2 || Self::transient(&e)) && tries < PUBLISH_TRIES => e,
                // Outcome unknown (never sent again), but the broker lost the lead, could not
                // reach a majority, or forwarded to an owner that did not answer: whoever the
                // view names is not serving the shard. The next publish asks again, of another
                // broker. (Found by the one-way fault test: kept, the view sent every lane back
                // to a deposed leader that forwarded each batch into a dead link for 10 s.)
                Err(e) if Self::leader_suspect(&e) => {
                    self.forget(ns, stream);
                    return Err(e);
                }
                r => return r,
            };
            // Refused, so nothing was written: refresh and send again, after the pause the
            // broker asked for (a stream being created says 200 ms, a cut-over 50 ms), else
            // 50 ms doubling.
            self.forget(ns, stream);
            if let ClientError::NotLeader { addr: Some(a), .. } = &e {
                hint = a.parse().ok();
            }
            if let Some(wait) = Self::retry_wait(&e, tries) {
                tokio::time::sleep(wait).await;
            } else if hint.is_none() && matches!(e, ClientError::NotLeader { .. }) {
                // A redirect naming no address (the broker knows no leader yet): a moment.
                tokio::time::sleep(std::time::Duration::from_millis(20u64 << tries.min(5))).await;
            }
        }
    }

    /// Subscribes to one shard on its owner, following redirects.
    ///
    /// # Errors
    /// As [`Client::subscribe`]; a refusal after [`MAX_HOPS`] redirects, or a redirect back to a
    /// broker already asked or to an older generation.
    pub async fn subscribe(
        &self,
        ns: &str,
        stream: &str,
        start: Option<StartPosition>,
        shard: u32,
    ) -> Result<Subscription, ClientError> {
        self.owner_only(ns, stream, shard, |c| {
            let (ns, stream) = (ns.to_owned(), stream.to_owned());
            async move { c.subscribe(&ns, &stream, start, Some(shard)).await }
        })
        .await
    }

    /// Reads a page of one shard on its owner, following redirects.
    ///
    /// # Errors
    /// As [`Client::stream_read`]; as [`subscribe`](Self::subscribe) for redirects.
    pub async fn stream_read(
        &self,
        ns: &str,
        stream: &str,
        shard: u32,
        from: u64,
        max_records: Option<u32>,
    ) -> Result<Page, ClientError> {
        self.owner_only(ns, stream, shard, |c| {
            let (ns, stream) = (ns.to_owned(), stream.to_owned());
            async move { c.stream_read(&ns, &stream, shard, from, None, max_records).await }
        })
        .await
    }

    /// Runs an owner-only request: first where the view says, then wherever `not_leader`
    /// points, at most [`MAX_HOPS`] times, never to a broker twice, never to an older
    /// generation. Every redirect refreshes the view.
    ///
    /// # Errors
    /// The request's own error, or [`ClientError::Refused`] when the redirects run out.
    pub async fn owner_only<T, F, Fut>(&self, ns: &str, stream: &str, shard: u32, op: F) -> Result<T, ClientError>
    where
        F: Fn(Client) -> Fut,
        Fut: std::future::Future<Output = Result<T, ClientError>>,
    {
        let mut client = self.route(ns, stream, Some(shard)).await?;
        let mut asked: Vec<SocketAddr> = vec![client.remote_address()];
        let mut newest = 0u64;
        let mut hop = 0;
        loop {
            match op(client.clone()).await {
                Err(ClientError::NotLeader { node_id, addr, generation }) => {
                    self.forget(ns, stream);
                    let next = addr.as_deref().and_then(|a| a.parse::<SocketAddr>().ok());
                    let why = match next {
                        _ if hop == MAX_HOPS => format!("still redirected after {MAX_HOPS} hops (last to {node_id})"),
                        _ if generation < newest => {
                            format!(
                                "redirected to {node_id} at generation {generation}, older than {newest} already seen"
                            )
                        }
                        None => format!("redirected to {node_id}, whose address is not known"),
                        Some(a) if asked.contains(&a) => {
                            format!("redirected back to {a} ({node_id}): the cluster's view is changing, retry")
                        }
                        Some(a) => {
                            newest = generation;
                            hop += 1;
                            asked.push(a);
                            self.stats.redirects.fetch_add(1, Ordering::Relaxed);
                            client = self.at(a).await?;
                            continue;
                        }
                    };
                    return Err(ClientError::Refused(felix_proto::client::ErrorInfo {
                        message: why,
                        code: Some(felix_proto::ErrorCode::NotLeader),
                        retry: Some(felix_proto::error_code::RetryClass::Retry),
                        detail: None,
                    }));
                }
                Err(e) => {
                    if Self::view_was_wrong(&e) {
                        self.forget(ns, stream);
                    }
                    return Err(e);
                }
                Ok(v) => return Ok(v),
            }
        }
    }

    /// A refusal that passes by itself in a moment, having written nothing: a redirect, a
    /// stream being created, a shard cutting over a move, a broker whose view is a move behind
    /// (`stale`), fenced until it confirmed its view, or a replicated shard settling or
    /// electing (and a forwarded refusal, whose reason the forward does not carry). An owner
    /// that is down is not: it may stay down.
    pub fn transient(e: &ClientError) -> bool {
        match e {
            ClientError::NotLeader { .. } => true,
            ClientError::Refused(i) => {
                let reason = i.detail.as_ref().and_then(|d| d.reason.as_deref());
                i.code == Some(felix_proto::ErrorCode::NotLeader)
                    || reason == Some("creating")
                    || (i.code == Some(felix_proto::ErrorCode::ShardUnavailable)
                        && matches!(reason, None | Some("moving" | "stale" | "fenced" | "not_ready" | "no_leader")))
            }
            _ => false,
        }
    }

    /// How long to wait before sending again a request refused for a moment (see
    /// [`transient`](Self::transient)) after `tries` sends: the wait the broker asked for, else
    /// 50 ms doubling, at most 2 s; `None` for another error, or after [`PUBLISH_TRIES`] sends.
    pub fn retry_wait(e: &ClientError, tries: u32) -> Option<std::time::Duration> {
        let ClientError::Refused(i) = e else { return None };
        if tries >= PUBLISH_TRIES || !Self::transient(e) {
            return None;
        }
        let asked = i.detail.as_ref().and_then(|d| d.retry_after_ms);
        let ms = asked.unwrap_or(50u64 << tries.saturating_sub(1).min(5)).min(2_000);
        Some(std::time::Duration::from_millis(ms))
    }

    /// Whether an error means the view this client routed by is out of date.
    /// An outcome-unknown answer that says the broker asked is not (or no longer) serving the
    /// shard: `leadership_lost`, `quorum_timeout`, `unacknowledged`.
    fn leader_suspect(e: &ClientError) -> bool {
        use felix_proto::ErrorCode as C;
        matches!(e, ClientError::Refused(i) if matches!(i.code, Some(C::LeadershipLost | C::QuorumTimeout | C::Unacknowledged)))
    }

    fn view_was_wrong(e: &ClientError) -> bool {
        match e {
            ClientError::NotLeader { .. } => true,
            ClientError::Refused(i) => matches!(
                i.code,
                Some(felix_proto::ErrorCode::NotLeader) | Some(felix_proto::ErrorCode::ShardUnavailable)
            ),
            _ => false,
        }
    }

    /// Closes every connection.
    pub async fn close(&self) {
        let slots = match self.conns.lock() {
            Ok(mut conns) => std::mem::take(&mut *conns),
            Err(_) => return,
        };
        // (A slot being dialled holds no connection yet: the request dialling gets it.)
        for slot in slots.into_values() {
            let c = slot.try_lock().ok().and_then(|mut c| c.take());
            if let Some(c) = c {
                let _ = c.close().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use felix_proto::binary::ErrorDetail;
    use felix_proto::client::ErrorInfo;
    use std::time::Duration;

    fn unavailable(reason: &str, retry_after_ms: Option<u64>) -> ClientError {
        ClientError::Refused(ErrorInfo {
            message: "x".into(),
            code: Some(felix_proto::ErrorCode::ShardUnavailable),
            retry: Some(felix_proto::error_code::RetryClass::RetryAfter),
            detail: Some(ErrorDetail { reason: Some(reason.into()), retry_after_ms }),
        })
    }

    #[test]
    fn a_passing_refusal_is_sent_again_after_the_wait_asked_for_else_doubling_and_not_forever() {
        assert_eq!(ClusterClient::retry_wait(&unavailable("moving", Some(50)), 1), Some(Duration::from_millis(50)));
        assert_eq!(ClusterClient::retry_wait(&unavailable("fenced", None), 1), Some(Duration::from_millis(50)));
        assert_eq!(ClusterClient::retry_wait(&unavailable("fenced", None), 3), Some(Duration::from_millis(200)));
        assert_eq!(ClusterClient::retry_wait(&unavailable("no_leader", None), 19), Some(Duration::from_millis(1600)));
        assert_eq!(ClusterClient::retry_wait(&unavailable("moving", Some(50)), PUBLISH_TRIES), None);
        // An owner that is down may stay down; a bad request never passes.
        assert_eq!(ClusterClient::retry_wait(&unavailable("down", None), 1), None);
        assert_eq!(ClusterClient::retry_wait(&ClientError::Invalid("x".into()), 1), None);
    }
}
