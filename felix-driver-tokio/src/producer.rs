//! An idempotent producer: batches appended exactly once, whatever the network does.
//!
//! It keeps one sequence per shard (from 0, +1 per answered batch), resends an unanswered or
//! retryable batch under the **same** sequence — reconnecting first when the connection is gone,
//! so a batch whose answer was lost is never appended twice — and stops on a refusal (a
//! `sequence_gap` or `sequence_reused` means the producer's own state is wrong).

use crate::client::{Client, ClientError, ClientOptions};
use bytes::Bytes;
use felix_proto::error_code::RetryClass;
use felix_proto::message::Routing;
use felix_proto::routing::shard_for_key;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

/// How an [`IdempotentProducer`] retries.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Attempts per batch, the first included.
    pub attempts: u32,
    /// Wait before the first retry; doubled each time, up to `max_backoff`.
    pub backoff: Duration,
    /// Longest wait between attempts.
    pub max_backoff: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy { attempts: 20, backoff: Duration::from_millis(20), max_backoff: Duration::from_secs(2) }
    }
}

/// A producer whose batches are appended exactly once (FEATURE_IDEMPOTENT_PRODUCER).
#[derive(Debug)]
pub struct IdempotentProducer {
    addr: SocketAddr,
    opts: ClientOptions,
    client: Client,
    namespace: String,
    stream: String,
    producer_id: u64,
    shards: u32,
    routing: Routing,
    next: HashMap<u32, u64>,
    policy: RetryPolicy,
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
            opts,
            client,
            namespace: namespace.into(),
            stream: stream.into(),
            producer_id,
            shards: shards.max(1),
            routing,
            next: HashMap::new(),
            policy: RetryPolicy::default(),
            reconnects: 0,
        })
    }

    /// Changes how batches are retried.
    pub fn set_retry_policy(&mut self, policy: RetryPolicy) {
        self.policy = policy;
    }

    /// The broker-chosen producer id.
    pub fn producer_id(&self) -> u64 {
        self.producer_id
    }

    /// How many times the producer reconnected.
    pub fn reconnects(&self) -> u64 {
        self.reconnects
    }

    /// The sequence the next batch to `shard` will carry.
    pub fn next_sequence(&self, shard: u32) -> u64 {
        self.next.get(&shard).copied().unwrap_or(0)
    }

    /// Sends one batch and waits until it is appended (exactly once). Returns the first
    /// record's offset when the broker gives offsets.
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] (the producer must stop: its sequence state disagrees
    /// with the broker's), a fatal refusal, or the last error once the attempts are used up.
    pub async fn send(&mut self, payloads: Vec<Bytes>, key: Option<Bytes>) -> Result<Option<u64>, ClientError> {
        let shard = shard_for_key(key.as_deref(), self.shards, self.routing);
        let sequence = self.next_sequence(shard);
        let mut wait = self.policy.backoff;
        let mut attempt = 0;
        loop {
            attempt += 1;
            let r = self
                .client
                .publish_idempotent(
                    &self.namespace,
                    &self.stream,
                    payloads.clone(),
                    key.clone(),
                    self.producer_id,
                    sequence,
                )
                .await;
            let err = match r {
                Ok(offset) => {
                    self.next.insert(shard, sequence + 1);
                    return Ok(offset);
                }
                Err(e) => e,
            };
            let reconnect = matches!(err, ClientError::Closed(_) | ClientError::Connect(_));
            let retryable = reconnect
                || matches!(err.retry(), Some(RetryClass::Retry | RetryClass::RetryAfter | RetryClass::OutcomeUnknown));
            if !retryable || attempt >= self.policy.attempts {
                return Err(err);
            }
            tracing::debug!("idempotent batch {sequence} on shard {shard}: {err}; retrying");
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(self.policy.max_backoff);
            if reconnect {
                // The outcome is unknown: the same sequence on a new connection is appended
                // only if the first copy never was.
                if let Ok(c) = Client::connect(self.addr, self.opts.clone()).await {
                    self.client = c;
                    self.reconnects += 1;
                }
            }
        }
    }

    /// Closes the connection.
    pub fn close(&self) {
        self.client.close();
    }
}
