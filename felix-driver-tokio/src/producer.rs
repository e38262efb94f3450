//! An idempotent producer: batches appended exactly once, whatever the network does.
//!
//! Every decision is felix-proto's [`ProducerState`]: sequences per shard, which batch goes
//! (again) when, the window of at most [`MAX_IN_FLIGHT`](felix_proto::client::producer::MAX_IN_FLIGHT) unanswered batches per shard that keeps
//! every resend inside what the broker remembers, backoff (honouring the broker's
//! `retry_after_ms`), and when to stop. This file only carries its sends over a [`Client`],
//! reconnecting when the connection is gone (an unanswered batch is then sent again under the
//! same sequence, and appended only if the first copy never was).

use crate::client::{Client, ClientError, ClientOptions};
use bytes::Bytes;
use felix_proto::client::producer::{Outcome, ProducerError, ProducerEvent, ProducerState, SendId};
use felix_proto::message::Routing;
use felix_proto::routing::shard_for_key;
use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use tokio::task::JoinSet;

pub use felix_proto::client::producer::RetryPolicy;

/// A producer whose batches are appended exactly once (FEATURE_IDEMPOTENT_PRODUCER).
///
/// [`send`](Self::send) waits for its batch; [`submit`](Self::submit) queues one and returns
/// at once (up to [`MAX_IN_FLIGHT`](felix_proto::client::producer::MAX_IN_FLIGHT) unanswered per shard, then it waits for room), and
/// [`flush`](Self::flush) waits for everything submitted.
#[derive(Debug)]
pub struct IdempotentProducer {
    addr: SocketAddr,
    /// Other brokers of a cluster to go to when this one stops leading the shard or is gone.
    seeds: Vec<SocketAddr>,
    opts: ClientOptions,
    client: Client,
    /// Bumped on every reconnect: a send's failure on an older connection is not news.
    generation: u64,
    namespace: String,
    stream: String,
    shards: u32,
    routing: Routing,
    state: ProducerState,
    in_flight: JoinSet<(SendId, u64, Result<Option<u64>, ClientError>)>,
    /// Sends on the current connection, in the order they went out: their answers are fed to
    /// the state machine in that order (the broker's order), whichever task finishes first.
    sent: VecDeque<SendId>,
    /// Answers on the current connection that arrived ahead of an earlier send's.
    early: HashMap<SendId, Result<Option<u64>, ClientError>>,
    /// Appended batches the caller has not collected: `(shard, sequence)` → offset.
    appended: HashMap<(u32, u64), Option<u64>>,
    reconnects: u64,
}

impl IdempotentProducer {
    /// Connects, asks the broker for a producer id and learns the stream's shards.
    ///
    /// # Errors
    /// Connection failures; [`ClientError::Unsupported`] against a broker without idempotent
    /// producers.
    pub async fn connect(
        addr: SocketAddr,
        opts: ClientOptions,
        namespace: &str,
        stream: &str,
    ) -> Result<IdempotentProducer, ClientError> {
        let client = Client::connect(addr, opts.clone()).await?;
        let producer_id = client.producer_init().await?;
        let (shards, routing) = client.stream_shards(namespace, stream).await?;
        Ok(IdempotentProducer {
            addr,
            seeds: vec![addr],
            opts,
            client,
            generation: 0,
            namespace: namespace.into(),
            stream: stream.into(),
            shards: shards.max(1),
            routing,
            state: ProducerState::new(producer_id, RetryPolicy::default()),
            in_flight: JoinSet::new(),
            sent: VecDeque::new(),
            early: HashMap::new(),
            appended: HashMap::new(),
            reconnects: 0,
        })
    }

    /// The brokers of a cluster this producer may go to: when its broker is gone, or refuses a
    /// batch because another broker leads its shard (a replicated shard's fail-over), it
    /// reconnects to the next one (or the leader named), and resends the unanswered batches
    /// under their sequences: each is still appended once.
    pub fn set_seeds(&mut self, seeds: Vec<SocketAddr>) {
        self.seeds = seeds;
        if !self.seeds.contains(&self.addr) {
            self.seeds.insert(0, self.addr);
        }
    }

    /// Changes how batches are retried (before the first send).
    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.state = ProducerState::new(self.state.producer_id(), policy);
    }

    /// The broker-chosen producer id.
    pub fn producer_id(&self) -> u64 {
        self.state.producer_id()
    }

    /// How many times the producer reconnected.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// The sequence the next batch to `shard` will carry.
    pub fn next_sequence(&self, shard: u32) -> u64 {
        self.state.next_sequence(shard)
    }

    /// Batches submitted and not yet appended.
    pub fn unanswered(&self) -> usize {
        self.state.unanswered()
    }

    /// Sends one batch and waits until it is appended (exactly once). Returns the first
    /// record's offset when the broker gives offsets.
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] (the producer stops: its sequence state disagrees with
    /// the broker's), a fatal refusal, or the last error once the attempts are used up.
    pub async fn send(&mut self, payloads: Vec<Bytes>, key: Option<Bytes>) -> Result<Option<u64>, ClientError> {
        let at = self.submit(payloads, key).await?;
        loop {
            if let Some(offset) = self.appended.remove(&at) {
                return Ok(offset);
            }
            self.step().await?;
        }
    }

    /// Queues a batch and returns `(shard, sequence)` without waiting for it, once the shard has
    /// room (fewer than [`MAX_IN_FLIGHT`](felix_proto::client::producer::MAX_IN_FLIGHT) unanswered from its oldest).
    ///
    /// # Errors
    /// As [`send`](Self::send), for this batch or an earlier one.
    pub async fn submit(&mut self, payloads: Vec<Bytes>, key: Option<Bytes>) -> Result<(u32, u64), ClientError> {
        let shard = shard_for_key(key.as_deref(), self.shards, self.routing);
        while !self.state.has_room(shard) {
            if let Some(e) = self.state.stopped() {
                return Err(stopped(e));
            }
            self.step().await?;
        }
        let sequence = self.state.push(shard, payloads, key).map_err(|e| stopped(&e))?;
        self.pump();
        Ok((shard, sequence))
    }

    /// Waits until every submitted batch is appended; returns `(shard, sequence, offset)` of
    /// each appended since the last collection, in sequence order per shard.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    pub async fn flush(&mut self) -> Result<Vec<(u32, u64, Option<u64>)>, ClientError> {
        while self.state.unanswered() > 0 {
            self.step().await?;
        }
        let mut out: Vec<(u32, u64, Option<u64>)> = self.appended.drain().map(|((s, q), o)| (s, q, o)).collect();
        out.sort_unstable();
        Ok(out)
    }

    /// Waits for every submitted batch to be appended, then closes the connection.
    ///
    /// # Errors
    /// As [`flush`](Self::flush).
    pub async fn close(mut self) -> Result<(), ClientError> {
        self.flush().await?;
        self.client.close().await
    }

    /// Sends whatever the state machine hands out.
    fn pump(&mut self) {
        while let Some(send) = self.state.poll_transmit() {
            let (generation, id) = (self.generation, send.id);
            // Queued on the connection here, in the order handed out (a task's first poll
            // would not keep it); the task only waits for the answer.
            let answer = self.client.start_publish_idempotent(
                &self.namespace,
                &self.stream,
                send.payloads,
                send.key,
                self.state.producer_id(),
                id.sequence,
            );
            self.sent.push_back(id);
            self.in_flight.spawn(async move { (id, generation, answer.await) });
        }
    }

    /// Waits for one answer or one timer, feeds it to the state machine, and acts on what it
    /// says.
    async fn step(&mut self) -> Result<(), ClientError> {
        self.pump();
        let deadline = self.state.poll_timeout();
        let joined = tokio::select! {
            j = self.in_flight.join_next(), if !self.in_flight.is_empty() => j,
            () = sleep_until(deadline), if deadline.is_some() => None,
        };
        let now = tokio::time::Instant::now().into_std();
        match joined {
            Some(Ok((id, generation, result))) if generation != self.generation => {
                self.outcome(id, generation, result, now).await?;
            }
            Some(Ok((id, generation, result))) => {
                // In send order: a gap refusal must not be read after the appended answer of
                // the batch it waited for (which the broker sent after it).
                self.early.insert(id, result);
                while let Some(front) = self.sent.front().copied() {
                    let Some(result) = self.early.remove(&front) else { break };
                    self.sent.pop_front();
                    self.outcome(front, generation, result, now).await?;
                    if generation != self.generation {
                        // Reconnected: what is left belongs to the connection given up on.
                        for (id, result) in std::mem::take(&mut self.early) {
                            self.outcome(id, generation, result, now).await?;
                        }
                        break;
                    }
                }
            }
            Some(Err(e)) => return Err(ClientError::Closed(format!("a send task failed: {e}"))),
            None => self.state.handle_timeout(now),
        }
        while let Some(e) = self.state.poll_event() {
            match e {
                ProducerEvent::Appended { shard, sequence, offset } => {
                    self.appended.insert((shard, sequence), offset);
                }
                ProducerEvent::Stopped { error, .. } => return Err(stopped(&error)),
            }
        }
        self.pump();
        Ok(())
    }

    async fn outcome(
        &mut self,
        id: SendId,
        generation: u64,
        result: Result<Option<u64>, ClientError>,
        now: std::time::Instant,
    ) -> Result<(), ClientError> {
        let outcome = match result {
            Ok(offset) => Outcome::Appended { offset },
            Err(ClientError::PublishRefused {
                reason: felix_proto::message::RefusedReason::NotLeader(hint),
                message,
            }) => {
                // Sent to a broker that does not lead the shard (a fail-over moved it): the
                // batch goes again under its sequence, to the leader named (or the next seed).
                let next = hint.addr.as_deref().and_then(|a| a.parse().ok());
                let reason = felix_proto::message::RefusedReason::NotLeader(hint);
                self.state.handle_outcome(id, Outcome::Refused { reason, message }, now);
                if generation == self.generation {
                    match next {
                        Some(a) if a != self.addr => self.addr = a,
                        _ => self.next_seed(),
                    }
                    self.reconnect().await?;
                }
                return Ok(());
            }
            Err(ClientError::PublishRefused { reason, message }) => Outcome::Refused { reason, message },
            Err(ClientError::NotLeader { node_id, addr, .. }) => {
                // Another broker leads the shard: the batch goes again there (same sequence),
                // after the usual backoff (a shard electing a new leader names the old one for
                // a moment).
                let info = felix_proto::client::ErrorInfo {
                    message: format!("{node_id} leads the shard"),
                    code: Some(felix_proto::ErrorCode::NotLeader),
                    retry: Some(felix_proto::RetryClass::Redirect),
                    detail: None,
                };
                self.state.handle_outcome(id, Outcome::Failed(info), now);
                if generation == self.generation {
                    match addr.and_then(|a| a.parse().ok()) {
                        Some(a) if a != self.addr => self.addr = a,
                        _ => self.next_seed(),
                    }
                    self.reconnect().await?;
                }
                return Ok(());
            }
            Err(ClientError::Refused(info)) => {
                // A follower, or a shard whose replicas are electing: after the backoff the
                // batch goes again, to the next broker.
                let elsewhere = matches!(
                    info.code,
                    Some(felix_proto::ErrorCode::NotLeader | felix_proto::ErrorCode::ShardUnavailable)
                );
                self.state.handle_outcome(id, Outcome::Failed(info), now);
                if elsewhere && generation == self.generation && self.seeds.len() > 1 {
                    self.next_seed();
                    self.reconnect().await?;
                }
                return Ok(());
            }
            Err(ClientError::Closed(_) | ClientError::Connect(_)) => {
                // The outcome is unknown: every batch in flight on that connection goes again,
                // under the same sequence, on a new one (once per connection lost).
                if generation == self.generation {
                    self.state.handle_connection_lost();
                    self.next_seed();
                    self.reconnect().await?;
                }
                return Ok(());
            }
            Err(e) => return Err(e),
        };
        self.state.handle_outcome(id, outcome, now);
        Ok(())
    }

    /// Moves on to the next seed (the same broker when there is only one).
    fn next_seed(&mut self) {
        if let Some(i) = self.seeds.iter().position(|s| *s == self.addr) {
            self.addr = self.seeds[(i + 1) % self.seeds.len()];
        }
    }

    async fn reconnect(&mut self) -> Result<(), ClientError> {
        let policy = self.state.policy();
        let mut wait = policy.backoff;
        let mut last = None;
        for attempt in 0..policy.attempts.max(1) {
            tokio::time::sleep(wait).await;
            if attempt > 0 {
                self.next_seed();
            }
            let connect = Client::connect(self.addr, self.opts.clone());
            // A dead seed must not hold the producer for a whole connect timeout.
            let each = if self.seeds.len() > 1 {
                std::time::Duration::from_secs(2)
            } else {
                std::time::Duration::from_secs(15)
            };
            let r = tokio::time::timeout(each, connect)
                .await
                .unwrap_or_else(|_| Err(ClientError::Connect(format!("no answer from {} within {each:?}", self.addr))));
            match r {
                Ok(c) => {
                    self.client = c;
                    self.generation += 1;
                    self.sent.clear();
                    self.reconnects += 1;
                    return Ok(());
                }
                Err(e) => {
                    tracing::debug!("idempotent producer: reconnecting: {e}");
                    last = Some(e);
                }
            }
            wait = (wait * 2).min(policy.max_backoff);
        }
        Err(last.unwrap_or_else(|| ClientError::Closed("could not reconnect".into())))
    }
}

/// The client error for a producer that stopped (or refused a batch).
fn stopped(e: &ProducerError) -> ClientError {
    match e {
        ProducerError::Refused { reason, message, .. } => {
            ClientError::PublishRefused { reason: reason.clone(), message: message.clone() }
        }
        ProducerError::Fatal { error, .. } => ClientError::Refused(error.clone()),
        ProducerError::Stopped(inner) => stopped(inner),
        other => ClientError::Closed(other.to_string()),
    }
}

async fn sleep_until(deadline: Option<std::time::Instant>) {
    match deadline {
        Some(d) => tokio::time::sleep_until(d.into()).await,
        None => std::future::pending().await,
    }
}
