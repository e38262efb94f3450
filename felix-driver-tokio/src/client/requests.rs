//! [`Client`]'s requests: publishes, subscriptions, caches and counters, reads, streams and the
//! cluster's operator calls, each a command to the task and an answer awaited.

use super::*;

impl Client {
    /// Publishes one batch of an idempotent producer (see [`crate::IdempotentProducer`], which
    /// keeps the sequences and retries): appended once however often it is sent. Returns the
    /// first record's offset (the original one for a duplicate) when the broker gives offsets.
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] with the sequence's problem; the broker's error; a
    /// closed connection (the outcome is then unknown: send again with the same sequence).
    pub async fn publish_idempotent(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        key: Option<Bytes>,
        producer_id: u64,
        sequence: u64,
    ) -> Result<Option<u64>, ClientError> {
        self.start_publish_idempotent(namespace, stream, payloads, key, producer_id, sequence).await
    }

    /// [`publish_idempotent`](Self::publish_idempotent), queued on the connection now (not
    /// when the returned future is first polled): batches started one after another go out in
    /// that order, which an idempotent producer needs (a batch that overtakes an earlier one
    /// of its shard is refused `sequence_gap`).
    pub fn start_publish_idempotent(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        key: Option<Bytes>,
        producer_id: u64,
        sequence: u64,
    ) -> impl std::future::Future<Output = Result<Option<u64>, ClientError>> + Send + 'static {
        let mut req = PublishRequest::new(namespace, stream, payloads);
        req.key = key;
        req.ack = true;
        req.idempotent = Some((producer_id, sequence));
        let (reply, rx) = oneshot::channel();
        let queued = self.tx.send(Input::Cmd(Cmd::Publish { req, reply })).is_ok();
        let me = self.clone();
        async move {
            if !queued {
                return Err(me.closed_error());
            }
            rx.await.map_err(|_| me.closed_error())?
        }
    }

    /// Appends a batch only if the shard's next offset is `expected_offset` (`publish_if`).
    /// Returns the offset it landed at (when the broker gives offsets).
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] with `offset_mismatch { tail }` when another write got
    /// there first; [`ClientError::Unsupported`] without FEATURE_PUBLISH_CONDITIONAL.
    pub async fn publish_if(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        key: Option<Bytes>,
        expected_offset: u64,
    ) -> Result<Option<u64>, ClientError> {
        let mut req = PublishRequest::new(namespace, stream, payloads);
        req.key = key;
        req.ack = true;
        req.expected_offset = Some(expected_offset);
        self.call(|reply| Cmd::Publish { req, reply }).await
    }

    /// A new producer id from the broker (FEATURE_IDEMPOTENT_PRODUCER).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn producer_init(&self) -> Result<u64, ClientError> {
        match self.request(|_, request_id| Message::ProducerInit(message::ProducerInit { request_id })).await? {
            core::Reply::ProducerId(id) => Ok(id),
            other => Err(unexpected(&other)),
        }
    }

    /// How many shards a stream has and how keys map to them.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_STREAM_SHARDS.
    pub async fn stream_shards(&self, namespace: &str, stream: &str) -> Result<(u32, Routing), ClientError> {
        let (namespace, stream) = (namespace.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamShards(message::StreamShards { tenant_id, namespace, stream, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamShards { shards, routing } => Ok((shards, routing)),
            other => Err(unexpected(&other)),
        }
    }

    /// Who owns each shard of a stream, in shard order (FEATURE_SHARD_OWNERS: a broker of a
    /// cluster). An empty list: the cluster does not know the stream.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker outside a cluster.
    pub async fn shard_owners(&self, namespace: &str, stream: &str) -> Result<Vec<message::ShardOwner>, ClientError> {
        let (namespace, name) = (namespace.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::ShardOwners(message::ShardOwners {
                    tenant_id,
                    namespace,
                    name,
                    kind: message::ShardKind::Stream,
                    request_id,
                })
            })
            .await?;
        match r {
            core::Reply::ShardOwners(owners) => Ok(owners),
            other => Err(unexpected(&other)),
        }
    }

    /// The broker's own view of one shard (FEATURE_INSPECT; the token must hold exactly
    /// `node.view:cluster:*`).
    ///
    /// # Errors
    /// `forbidden` for any other token; [`ClientError::Unsupported`] against a broker without
    /// the feature.
    pub async fn shard_inspect(
        &self,
        namespace: &str,
        name: &str,
        kind: message::ShardKind,
        shard: u32,
    ) -> Result<message::InspectView, ClientError> {
        let (namespace, name) = (namespace.to_owned(), name.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::ShardInspect(message::ShardInspect { tenant_id, namespace, name, kind, shard, request_id })
            })
            .await?;
        match r {
            core::Reply::ShardInspect(v) => Ok(*v),
            other => Err(unexpected(&other)),
        }
    }

    /// One page of the subscriptions the broker serves (FEATURE_INSPECT, as
    /// [`shard_inspect`](Self::shard_inspect)).
    ///
    /// # Errors
    /// As [`shard_inspect`](Self::shard_inspect).
    pub async fn subscriptions_list(
        &self,
        filter: Option<message::SubscriptionFilter>,
        limit: Option<u32>,
        cursor: Option<message::SubscriptionCursor>,
    ) -> Result<message::SubscriptionsListInfo, ClientError> {
        let r = self
            .request(move |_, request_id| {
                Message::SubscriptionsList(message::SubscriptionsList { request_id, filter, limit, cursor })
            })
            .await?;
        match r {
            core::Reply::Subscriptions(l) => Ok(*l),
            other => Err(unexpected(&other)),
        }
    }

    /// Publishes a batch. With `ack`, waits for the broker and returns the first record's
    /// offset when the broker gave one; without, returns once the batch is handed to QUIC.
    ///
    /// # Errors
    /// The broker's refusal (with code and retry class), or a closed connection.
    pub async fn publish(
        &self,
        namespace: &str,
        stream: &str,
        payloads: Vec<Bytes>,
        opts: PublishOptions,
    ) -> Result<Option<u64>, ClientError> {
        let mut req = PublishRequest::new(namespace, stream, payloads);
        req.key = opts.key;
        req.envelope = opts.envelope;
        req.ack = opts.ack;
        req.json = opts.json;
        self.call(|reply| Cmd::Publish { req, reply }).await
    }

    /// Subscribes to one shard of a stream.
    ///
    /// # Errors
    /// The broker's refusal (a cursor error names what is available), or a closed connection.
    pub async fn subscribe(
        &self,
        namespace: &str,
        stream: &str,
        start: Option<StartPosition>,
        shard: Option<u32>,
    ) -> Result<Subscription, ClientError> {
        self.subscribe_filtered(namespace, stream, start, shard, None).await
    }

    /// [`subscribe`](Self::subscribe), delivering only the batches whose key `filter` matches
    /// (D57); the offsets passed over show as `skipped_before` and gaps.
    ///
    /// # Errors
    /// As [`subscribe`](Self::subscribe), and `NotNegotiated` from a broker that does not
    /// filter (a broker in a cluster, or an older one).
    pub async fn subscribe_filtered(
        &self,
        namespace: &str,
        stream: &str,
        start: Option<StartPosition>,
        shard: Option<u32>,
        filter: Option<felix_proto::message::KeyFilter>,
    ) -> Result<Subscription, ClientError> {
        let req = SubscribeRequest {
            filter,
            namespace: namespace.into(),
            stream: stream.into(),
            start,
            shard,
            queue_capacity: None,
        };
        self.call(|reply| Cmd::Subscribe { req, reply }).await
    }

    /// Stores a value (with an optional TTL in milliseconds).
    ///
    /// # Errors
    /// The broker's refusal, or a closed connection.
    pub async fn cache_put(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
    ) -> Result<(), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CachePut(message::CachePut {
                    tenant_id,
                    namespace,
                    cache,
                    key,
                    value: B64(value),
                    request_id: Some(request_id),
                    ttl_ms,
                })
            })
            .await?;
        match r {
            core::Reply::Done => Ok(()),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a value; `None` on a miss or after expiry.
    ///
    /// # Errors
    /// The broker's refusal, or a closed connection.
    pub async fn cache_get(&self, ns: &str, cache: &str, key: &str) -> Result<Option<Bytes>, ClientError> {
        Ok(self.cache_get_versioned(ns, cache, key).await?.0)
    }

    /// A page of a cache's live keys in byte order (FEATURE_LISTING): those starting with
    /// `prefix`, after `after`, at most `limit` (the broker caps it at 1000); and the key to
    /// continue after when more follow.
    ///
    /// # Errors
    /// `not_found` for a cache that does not exist; [`ClientError::Unsupported`] against a
    /// broker without the feature.
    pub async fn cache_keys(
        &self,
        ns: &str,
        cache: &str,
        prefix: Option<&str>,
        after: Option<&str>,
        limit: Option<u32>,
    ) -> Result<(Vec<String>, Option<String>), ClientError> {
        let (namespace, cache) = (ns.to_owned(), cache.to_owned());
        let (prefix, after) = (prefix.map(str::to_owned), after.map(str::to_owned));
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheKeys(message::CacheKeys { tenant_id, namespace, cache, prefix, after, limit, request_id })
            })
            .await?;
        match r {
            core::Reply::CacheKeys { keys, next } => Ok((keys, next)),
            other => Err(unexpected(&other)),
        }
    }

    /// A page of the tenant's streams this token may publish to or read (FEATURE_STREAM_INFO),
    /// in `namespace/stream` order: `namespace` narrows it, `after` is the previous page's
    /// `next`. Any broker of a cluster lists every stream of the cluster.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn stream_list(
        &self,
        namespace: Option<&str>,
        after: Option<&str>,
        limit: Option<u32>,
    ) -> Result<(Vec<message::StreamEntry>, Option<String>), ClientError> {
        let (namespace, after) = (namespace.map(str::to_owned), after.map(str::to_owned));
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamList(message::StreamList { tenant_id, namespace, after, limit, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamList { streams, next } => Ok((streams, next)),
            other => Err(unexpected(&other)),
        }
    }

    /// The cluster as this broker sees it (FEATURE_CLUSTER_ADMIN, D52): the document `GET
    /// /cluster` serves on the metrics listener, limited to the token's tenant unless the
    /// token holds `node.view:cluster:*`; `{"cluster": false}` from a broker that runs alone.
    ///
    /// # Errors
    /// `forbidden` without the admin permission on the whole tenant;
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn cluster_status(&self) -> Result<serde_json::Value, ClientError> {
        let r = self
            .request(move |_, request_id| {
                Message::ClusterStatus(message::ClusterStatus { after: None, limit: None, request_id })
            })
            .await?;
        match r {
            core::Reply::ClusterStatus(v) => Ok(*v),
            other => Err(unexpected(&other)),
        }
    }

    /// One page of [`Client::cluster_status`] (FEATURE_STATUS_PAGES, D55): the shards after
    /// `after` (the `next` of the page before; `None`: from the first), `limit` of them with
    /// an owner (at most 5,000), and every list about them; the document's `next` is the next
    /// page's `after` when more follow. Paging through shows each shard once.
    ///
    /// # Errors
    /// As [`Client::cluster_status`]; [`ClientError::Unsupported`] against a broker without
    /// pages (ask it for the whole status); `invalid_request` for an `after` no page gave.
    pub async fn cluster_status_page(&self, after: Option<&str>, limit: u32) -> Result<serde_json::Value, ClientError> {
        let after = after.map(str::to_owned);
        let r = self
            .request(move |_, request_id| {
                Message::ClusterStatus(message::ClusterStatus { after, limit: Some(limit), request_id })
            })
            .await?;
        match r {
            core::Reply::ClusterStatus(v) => Ok(*v),
            other => Err(unexpected(&other)),
        }
    }

    /// Moves one shard of a stream to broker `to`, or (`to` absent) gives its move up
    /// (FEATURE_CLUSTER_ADMIN, D52); what was proposed. The move's progress shows in
    /// [`Client::cluster_status`]'s `moves`.
    ///
    /// # Errors
    /// `forbidden` without the admin permission on the stream; `invalid_request` with the
    /// metadata's reason (no such shard, not a member, already there, not moving).
    pub async fn shard_move(
        &self,
        ns: &str,
        stream: &str,
        shard: u32,
        to: Option<&str>,
    ) -> Result<String, ClientError> {
        let (namespace, stream, to) = (ns.to_owned(), stream.to_owned(), to.map(str::to_owned));
        let r = self
            .request(move |tenant_id, request_id| {
                let cancel = to.is_none();
                Message::ShardMove(message::ShardMove { tenant_id, namespace, stream, shard, to, cancel, request_id })
            })
            .await?;
        match r {
            core::Reply::ShardMoveProposed(what) => Ok(what),
            other => Err(unexpected(&other)),
        }
    }

    /// One shard of a stream described by the broker that serves it (FEATURE_STREAM_INFO):
    /// configuration, offsets, retained records and bytes, subscribers, groups.
    ///
    /// # Errors
    /// `not_found` for a stream that does not exist; [`ClientError::NotLeader`] from a broker
    /// of a cluster that does not serve the shard.
    pub async fn stream_info(
        &self,
        ns: &str,
        stream: &str,
        shard: u32,
    ) -> Result<message::StreamInfoView, ClientError> {
        let (namespace, stream) = (ns.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamInfo(message::StreamInfo { tenant_id, namespace, stream, shard, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamInfo(i) => Ok(*i),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes a value, returning what was removed.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_CACHE_DELETE.
    pub async fn cache_delete(&self, ns: &str, cache: &str, key: &str) -> Result<Option<Bytes>, ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheDelete(message::CacheDelete {
                    tenant_id,
                    namespace,
                    cache,
                    key,
                    request_id: Some(request_id),
                })
            })
            .await?;
        match r {
            core::Reply::CacheValue { value, .. } => Ok(value),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a value and its version (FEATURE_CACHE_CONDITIONAL brokers send one on a hit).
    ///
    /// # Errors
    /// The broker's refusal, or a closed connection.
    pub async fn cache_get_versioned(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
    ) -> Result<(Option<Bytes>, Option<u64>), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheGet(message::CacheGet { tenant_id, namespace, cache, key, request_id: Some(request_id) })
            })
            .await?;
        match r {
            core::Reply::CacheValue { value, version } => Ok((value, version)),
            other => Err(unexpected(&other)),
        }
    }

    /// Stores a value only if the key's live entry matches `condition`; returns whether it
    /// applied and the version written (or the current one).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_CACHE_CONDITIONAL.
    pub async fn cache_put_if(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
        value: Bytes,
        ttl_ms: Option<u64>,
        condition: CacheCondition,
    ) -> Result<(bool, Option<u64>), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CachePutIf(message::CachePutIf {
                    tenant_id,
                    namespace,
                    cache,
                    key,
                    value: B64(value),
                    ttl_ms,
                    condition,
                    request_id,
                })
            })
            .await?;
        condition_result(r)
    }

    /// Deletes a key only if its live entry has `version`.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_CACHE_CONDITIONAL.
    pub async fn cache_delete_if(
        &self,
        ns: &str,
        cache: &str,
        key: &str,
        version: u64,
    ) -> Result<(bool, Option<u64>), ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CacheDeleteIf(message::CacheDeleteIf { tenant_id, namespace, cache, key, version, request_id })
            })
            .await?;
        condition_result(r)
    }

    /// Reads a bounded page of a durable shard without subscribing: records from `from` up to
    /// `end` (the committed tail when `None`), within the broker's caps (and `max_records`
    /// when given).
    ///
    /// # Errors
    /// [`ClientError::Cursor`] when `from` is outside the retained range;
    /// [`ClientError::Unsupported`] against a broker without FEATURE_STREAM_READ.
    pub async fn stream_read(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: u64,
        end: Option<u64>,
        max_records: Option<u32>,
    ) -> Result<Page, ClientError> {
        self.read_page(namespace, stream, shard, from, end, max_records, false).await
    }

    /// [`stream_read`](Self::stream_read) of this broker's own copy of a replicated shard,
    /// follower or not (D51): what an operator compares to check that replicas agree.
    ///
    /// # Errors
    /// [`ClientError::NotLeader`] from a broker that keeps no copy of the shard;
    /// [`ClientError::Unsupported`] against a broker without FEATURE_STREAM_INFO.
    pub async fn stream_read_replica(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: u64,
        end: Option<u64>,
        max_records: Option<u32>,
    ) -> Result<Page, ClientError> {
        self.read_page(namespace, stream, shard, from, end, max_records, true).await
    }

    #[allow(clippy::too_many_arguments)] // the request's fields
    async fn read_page(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        from: u64,
        end: Option<u64>,
        max_records: Option<u32>,
        replica_local: bool,
    ) -> Result<Page, ClientError> {
        let req = StreamReadRequest {
            namespace: namespace.into(),
            stream: stream.into(),
            shard,
            from,
            end,
            max_records,
            max_bytes: None,
            replica_local,
        };
        let r = self
            .request(move |tenant_id, request_id| felix_proto::client::stream_read_message(tenant_id, req, request_id))
            .await?;
        match r {
            core::Reply::StreamRecords { records, next_offset } => Ok(Page { records, next_offset }),
            other => Err(unexpected(&other)),
        }
    }

    /// The first offset of a durable shard appended at or after `at_micros` (microseconds
    /// since the Unix epoch); `None` when no record is that recent.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_RECORD_TIMESTAMPS.
    pub async fn offset_for_time(
        &self,
        namespace: &str,
        stream: &str,
        shard: u32,
        at_micros: u64,
    ) -> Result<Option<u64>, ClientError> {
        let (namespace, stream) = (namespace.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::OffsetForTime(message::OffsetForTime {
                    tenant_id,
                    namespace,
                    stream,
                    shard,
                    at_micros,
                    request_id,
                })
            })
            .await?;
        match r {
            core::Reply::OffsetValue(o) => Ok(o),
            other => Err(unexpected(&other)),
        }
    }

    /// Adds `delta` (negative to subtract) to a counter and returns the sum including it, once
    /// it is durable. A retry after a lost answer counts twice (counters are at-least-once).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_COUNTERS (brokers without
    /// storage do not offer it).
    pub async fn counter_add(&self, ns: &str, cache: &str, key: &str, delta: i64) -> Result<i64, ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CounterAdd(message::CounterAdd { tenant_id, namespace, cache, key, delta, request_id })
            })
            .await?;
        match r {
            core::Reply::CounterValue(Some(v)) => Ok(v),
            other => Err(unexpected(&other)),
        }
    }

    /// Deletes a stream and everything it holds (FEATURE_STREAM_ADMIN; needs the admin
    /// permission): its subscribers are told `stream_deleted`, its files removed. Returns
    /// whether there was such a stream.
    ///
    /// # Errors
    /// `forbidden` without the permission; [`ClientError::Unsupported`] against a broker
    /// without the feature.
    pub async fn stream_delete(&self, ns: &str, stream: &str) -> Result<bool, ClientError> {
        let (namespace, stream) = (ns.to_owned(), stream.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamDelete(message::StreamDelete { tenant_id, namespace, stream, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamDeleted(existed) => Ok(existed),
            other => Err(unexpected(&other)),
        }
    }

    /// Creates streams in namespace `ns` (FEATURE_STREAM_CREATE, D60; needs the admin
    /// permission on each), at most [`message::MAX_STREAMS_PER_CREATE`] in one request.
    /// Returns the names created (in a cluster: proposed, created on every broker once the
    /// metadata group commits them) and the streams that existed already, left as they are.
    ///
    /// # Errors
    /// `invalid_request` (nothing created) for a bad name, shard count or replication, or a
    /// name given twice; `forbidden`; `limit_exceeded` past the namespace's stream quota;
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn stream_create(
        &self,
        ns: &str,
        streams: Vec<message::NewStream>,
    ) -> Result<(Vec<String>, Vec<message::ExistingStream>), ClientError> {
        let namespace = ns.to_owned();
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StreamCreate(message::StreamCreate { tenant_id, namespace, streams, request_id })
            })
            .await?;
        match r {
            core::Reply::StreamsCreated { created, existed } => Ok((created, existed)),
            other => Err(unexpected(&other)),
        }
    }

    /// Commits an event and state changes as one record (FEATURE_ATOMIC_COMMIT; brokers with
    /// storage offer it) and returns its offset (the version of every key it wrote), once
    /// durable.
    ///
    /// # Errors
    /// [`ClientError::PublishRefused`] with `offset_mismatch { tail }` when `expected_offset`
    /// was set and another write got there first (nothing written); the broker's error;
    /// [`ClientError::Unsupported`] against a broker without the feature.
    pub async fn commit(&self, req: core::CommitRequest) -> Result<u64, ClientError> {
        let r = self.request(move |tenant_id, request_id| core::commit_message(tenant_id, req, request_id)).await?;
        match r {
            core::Reply::Committed(offset) => Ok(offset),
            core::Reply::Refused { reason, message } => Err(ClientError::PublishRefused { reason, message }),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads one key of the state of the shard `entity_key` routes to: its value (`None`: never
    /// written or deleted) and the offset of the commit that wrote it.
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_ATOMIC_COMMIT.
    pub async fn state_get(
        &self,
        ns: &str,
        stream: &str,
        entity_key: Bytes,
        key: &str,
    ) -> Result<(Option<Bytes>, Option<u64>), ClientError> {
        let (namespace, stream, key) = (ns.to_owned(), stream.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::StateGet(message::StateGet {
                    tenant_id,
                    namespace,
                    stream,
                    entity_key: B64(entity_key),
                    key,
                    shard: None,
                    request_id,
                })
            })
            .await?;
        match r {
            core::Reply::State { value, version, .. } => Ok((value, version)),
            other => Err(unexpected(&other)),
        }
    }

    /// Reads a counter; `None` when it was never written (which is not the same as 0).
    ///
    /// # Errors
    /// [`ClientError::Unsupported`] against a broker without FEATURE_COUNTERS.
    pub async fn counter_get(&self, ns: &str, cache: &str, key: &str) -> Result<Option<i64>, ClientError> {
        let (namespace, cache, key) = (ns.to_owned(), cache.to_owned(), key.to_owned());
        let r = self
            .request(move |tenant_id, request_id| {
                Message::CounterGet(message::CounterGet { tenant_id, namespace, cache, key, request_id })
            })
            .await?;
        match r {
            core::Reply::CounterValue(v) => Ok(v),
            other => Err(unexpected(&other)),
        }
    }

    /// Watches a cache key or prefix: from now, from a change offset (`from_offset`, a previous
    /// change's offset + 1), or starting with current values (`retained`).
    ///
    /// # Errors
    /// [`ClientError::Cursor`] for a `from_offset` past the tail; the broker's refusal (both
    /// `retained` and `from_offset`...); [`ClientError::Unsupported`] without FEATURE_CACHE_WATCH.
    pub async fn cache_watch(
        &self,
        namespace: &str,
        cache: &str,
        filter: WatchOn,
        from_offset: Option<u64>,
        retained: bool,
    ) -> Result<CacheWatch, ClientError> {
        let req = CacheWatchRequest { namespace: namespace.into(), cache: cache.into(), filter, from_offset, retained };
        self.call(|reply| Cmd::Watch { req, reply }).await
    }

    /// Closes the connection without losing what was written: every control stream is finished,
    /// and the close waits (up to `ClientOptions::close_timeout`) until the broker finished its
    /// side of each, which it does only after it processed everything written on it (QUIC
    /// discards data the broker has not read when a connection closes). A fire-and-forget
    /// publish means "no answer", not "may be dropped on a clean exit". Acked publishes and
    /// requests still waiting for an answer fail.
    ///
    /// # Errors
    /// [`ClientError::Unconfirmed`] with how many fire-and-forget publishes (at most) may not
    /// have reached the broker: the wait timed out or the connection was lost first.
    pub async fn close(&self) -> Result<(), ClientError> {
        let r = self.call(|reply| Cmd::Close { reply }).await;
        match r {
            // Already closed, with nothing left to confirm.
            Err(ClientError::Closed(_)) => Ok(()),
            other => other,
        }
    }

    /// Closes the connection at once, without waiting for anything written to be acknowledged
    /// (data in flight may be lost).
    pub fn close_now(&self) {
        self.quic.close(quinn::VarInt::from_u32(0), b"client closing");
    }
}
