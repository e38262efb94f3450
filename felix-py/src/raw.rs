//! `RawClient`: one `ClusterClient` (which serves a single broker as well as a cluster: keyed
//! publishes go to their shard's owner, owner-only requests follow redirects), its methods as
//! awaitables; and `RawProducer`, the idempotent producer. The Python package wraps both.

use crate::bridge::{Fail, spawn as future_into_py};
use crate::convert::{self, GroupRecord};
use crate::errors::to_py;
use crate::streams::{RawSubscription, RawWatch};
use bytes::Bytes;
use felix_driver_tokio::client::ClientOptions;
use felix_driver_tokio::{ClusterClient, GroupTarget, IdempotentProducer, PollOptions, PublishOptions, Trust};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A connection to a Felix broker or cluster (see the module doc).
#[pyclass(frozen, module = "felix._felix")]
pub struct RawClient {
    cc: Arc<ClusterClient>,
    seeds: Vec<SocketAddr>,
    opts: ClientOptions,
    publisher: Publisher,
}

/// What the publishing task is asked, in order.
enum PubItem {
    /// A fire-and-forget batch.
    Publish { namespace: String, stream: String, payloads: Vec<Bytes>, key: Option<Bytes>, bytes: usize },
    /// Answered once everything before it was handed to the connection.
    Flush(tokio::sync::oneshot::Sender<()>),
}

/// Fire-and-forget publishes, queued from Python without an awaitable each and handed to the
/// client in the order queued by one task: batches to one stream keep their order (tasks
/// spawned per call would race), and Python pays one channel send per batch, not a thread
/// hand-off and an event-loop wake-up.
struct Publisher {
    tx: tokio::sync::mpsc::UnboundedSender<PubItem>,
    /// Payload bytes queued and not yet handed over.
    queued: Arc<std::sync::atomic::AtomicUsize>,
    /// The first failure, raised by the next call.
    error: Arc<std::sync::Mutex<Option<felix_driver_tokio::ClientError>>>,
}

impl Publisher {
    /// Starts the task (on the runtime the caller runs on).
    fn start(cc: Arc<ClusterClient>) -> Publisher {
        use std::sync::atomic::Ordering;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<PubItem>();
        let queued = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let error = Arc::new(std::sync::Mutex::new(None));
        let (q, err) = (queued.clone(), error.clone());
        tokio::spawn(async move {
            while let Some(item) = rx.recv().await {
                match item {
                    PubItem::Publish { namespace, stream, payloads, key, bytes } => {
                        let opts = PublishOptions { envelope: None, key, ack: false, json: false };
                        if let Err(e) = cc.publish(&namespace, &stream, payloads, opts).await
                            && let Ok(mut g) = err.lock()
                            && g.is_none()
                        {
                            *g = Some(e);
                        }
                        q.fetch_sub(bytes, Ordering::Relaxed);
                    }
                    PubItem::Flush(done) => {
                        let _ = done.send(());
                    }
                }
            }
        });
        Publisher { tx, queued, error }
    }

    fn take_error(&self) -> PyResult<()> {
        match self.error.lock().ok().and_then(|mut g| g.take()) {
            Some(e) => Err(to_py(e)),
            None => Ok(()),
        }
    }
}

/// Resolves `host:port` addresses (names too), in order, each to its first address.
async fn resolve(addrs: &[String]) -> PyResult<Vec<SocketAddr>> {
    let mut out = Vec::with_capacity(addrs.len());
    for a in addrs {
        let mut found = tokio::net::lookup_host(a.as_str())
            .await
            .map_err(|e| PyValueError::new_err(format!("{a}: not a broker address (HOST:PORT): {e}")))?;
        let first = found.next().ok_or_else(|| PyValueError::new_err(format!("{a}: resolves to no address")))?;
        out.push(first);
    }
    if out.is_empty() {
        return Err(PyValueError::new_err("no broker address given"));
    }
    Ok(out)
}

fn ms(seconds: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err(format!("{seconds}: not a duration in seconds")))
}

impl RawClient {
    /// Runs `op` on a connection to any broker (caches and counters: every broker forwards
    /// them to their owner); an awaitable of its outcome.
    fn on_any<'py, T, F, Fut>(&self, py: Python<'py>, op: F) -> PyResult<Bound<'py, PyAny>>
    where
        F: FnOnce(felix_driver_tokio::Client) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T, felix_driver_tokio::ClientError>> + Send,
        T: for<'a> IntoPyObject<'a> + Send + 'static,
    {
        let cc = self.cc.clone();
        future_into_py(py, async move { Ok(op(cc.any().await?).await?) })
    }
}

#[pymethods]
impl RawClient {
    /// Connects to the first of `addrs` that answers (each within `connect_timeout` seconds).
    /// `ca` is a PEM file of certificates to trust (a broker's `cert.pem`, or the cluster CA's
    /// `ca.pem`); `insecure` accepts any certificate (development only).
    #[staticmethod]
    #[pyo3(signature = (addrs, tenant, token, ca=None, insecure=false, server_name=None, connect_timeout=5.0, subscription_buffer_bytes=None))]
    #[allow(clippy::too_many_arguments)]
    fn connect(
        py: Python<'_>,
        addrs: Vec<String>,
        tenant: String,
        token: String,
        ca: Option<std::path::PathBuf>,
        insecure: bool,
        server_name: Option<String>,
        connect_timeout: f64,
        subscription_buffer_bytes: Option<usize>,
    ) -> PyResult<Bound<'_, PyAny>> {
        let trust = match (&ca, insecure) {
            (_, true) => Trust::DangerAcceptAnyCertificate,
            (Some(p), false) => Trust::Certificates(
                felix_driver_tokio::tls::load_certs(p).map_err(|e| crate::errors::TlsError::new_err(e.to_string()))?,
            ),
            (None, false) => {
                return Err(PyValueError::new_err(
                    "give ca= (the broker's cert.pem or the cluster CA's ca.pem), or insecure=True for development",
                ));
            }
        };
        let timeout = ms(connect_timeout)?;
        future_into_py(py, async move {
            let seeds = resolve(&addrs).await?;
            let mut opts = ClientOptions::new(tenant, token, trust);
            opts.server_name = server_name.unwrap_or_else(|| {
                addrs[0]
                    .rsplit_once(':')
                    .map(|(h, _)| h.trim_matches(['[', ']']).to_owned())
                    .filter(|h| h.parse::<std::net::IpAddr>().is_err())
                    .unwrap_or_else(|| "localhost".into())
            });
            if let Some(b) = subscription_buffer_bytes {
                opts.subscription_buffer_bytes = b;
            }
            let all = timeout * u32::try_from(seeds.len()).unwrap_or(u32::MAX);
            let cc = tokio::time::timeout(all, ClusterClient::connect(&seeds, opts.clone()))
                .await
                .map_err(|_| {
                    crate::errors::ConnectError::new_err(format!("no broker of {addrs:?} answered within {all:?}"))
                })?
                .map_err(Fail::from)?;
            let cc = Arc::new(cc);
            let publisher = Publisher::start(cc.clone());
            Ok(RawClient { cc, seeds, opts, publisher })
        })
    }

    /// Publishes a batch to `namespace/stream` (to the shard of `key`); with `ack`, waits until
    /// it is stored and returns its first offset.
    #[pyo3(signature = (namespace, stream, payloads, key=None, ack=false))]
    fn publish<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        stream: String,
        payloads: Vec<PyBackedBytes>,
        key: Option<PyBackedBytes>,
        ack: bool,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cc = self.cc.clone();
        let payloads = convert::payloads(payloads);
        let opts = PublishOptions { envelope: None, key: key.map(Bytes::from_owner), ack, json: false };
        future_into_py(py, async move { cc.publish(&namespace, &stream, payloads, opts).await.map_err(Fail::from) })
    }

    /// Queues a fire-and-forget batch, in order behind every batch queued before it; returns
    /// the payload bytes queued and not yet handed to the connection (the caller waits with
    /// `flush` when that grows). An earlier batch's failure is raised by `take_error` or
    /// `flush`, never here: this batch is always queued.
    #[pyo3(signature = (namespace, stream, payloads, key=None))]
    fn publish_nowait(
        &self,
        namespace: String,
        stream: String,
        payloads: Vec<PyBackedBytes>,
        key: Option<PyBackedBytes>,
    ) -> PyResult<usize> {
        use std::sync::atomic::Ordering;
        let payloads = convert::payloads(payloads);
        let bytes: usize = payloads.iter().map(Bytes::len).sum();
        let queued = self.publisher.queued.fetch_add(bytes, Ordering::Relaxed) + bytes;
        let item = PubItem::Publish { namespace, stream, payloads, key: key.map(Bytes::from_owner), bytes };
        self.publisher.tx.send(item).map_err(|_| crate::errors::ConnectionClosed::new_err("the client is closed"))?;
        Ok(queued)
    }

    /// Waits until every queued fire-and-forget batch was handed to the connection; raises the
    /// first failure among them.
    fn flush<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (tx, error) = (self.publisher.tx.clone(), self.publisher.error.clone());
        future_into_py(py, async move {
            let (done, wait) = tokio::sync::oneshot::channel();
            if tx.send(PubItem::Flush(done)).is_ok() {
                let _ = wait.await;
            }
            match error.lock().ok().and_then(|mut g| g.take()) {
                Some(e) => Err(Fail::Client(e)),
                None => Ok(()),
            }
        })
    }

    /// Raises the first failure of a fire-and-forget batch since the last call, if any.
    fn take_error(&self) -> PyResult<()> {
        self.publisher.take_error()
    }

    /// Subscribes to one shard, following it if it moves or its broker fails.
    #[pyo3(signature = (namespace, stream, start, shard=0, buffer_batches=64))]
    fn subscribe<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        stream: String,
        start: &Bound<'py, PyAny>,
        shard: u32,
        buffer_batches: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let start = convert::start(start)?;
        RawSubscription::start(py, self.cc.clone(), namespace, stream, start, shard, buffer_batches)
    }

    /// Watches a cache key (or every key starting with `prefix`).
    #[pyo3(signature = (namespace, cache, key=None, prefix=None, from_offset=None, retained=false, buffer=1024))]
    #[allow(clippy::too_many_arguments)]
    fn cache_watch<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        cache: String,
        key: Option<String>,
        prefix: Option<String>,
        from_offset: Option<u64>,
        retained: bool,
        buffer: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        let on = match (key, prefix) {
            (Some(k), None) => felix_proto::client::WatchOn::Key(k),
            (None, p) => felix_proto::client::WatchOn::Prefix(p.unwrap_or_default()),
            (Some(_), Some(_)) => return Err(PyValueError::new_err("watch a key or a prefix, not both")),
        };
        RawWatch::start(py, self.cc.clone(), namespace, cache, on, from_offset, retained, buffer)
    }

    /// Stores a value (optionally expiring after `ttl_ms`).
    #[pyo3(signature = (namespace, cache, key, value, ttl_ms=None))]
    fn cache_put<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        cache: String,
        key: String,
        value: PyBackedBytes,
        ttl_ms: Option<u64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let value = Bytes::from_owner(value);
        self.on_any(py, move |c| async move { c.cache_put(&namespace, &cache, &key, value, ttl_ms).await })
    }

    /// A value, or `None`.
    fn cache_get<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        cache: String,
        key: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.on_any(py, move |c| async move { Ok(c.cache_get(&namespace, &cache, &key).await?.map(|b| b.to_vec())) })
    }

    /// Deletes a key; the value it held, or `None`.
    fn cache_delete<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        cache: String,
        key: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.on_any(py, move |c| async move { Ok(c.cache_delete(&namespace, &cache, &key).await?.map(|b| b.to_vec())) })
    }

    /// Adds `delta` to a counter; its new value.
    fn counter_add<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        cache: String,
        key: String,
        delta: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.on_any(py, move |c| async move { c.counter_add(&namespace, &cache, &key, delta).await })
    }

    /// A counter's value, or `None` when it was never set.
    fn counter_get<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        cache: String,
        key: String,
    ) -> PyResult<Bound<'py, PyAny>> {
        self.on_any(py, move |c| async move { c.counter_get(&namespace, &cache, &key).await })
    }

    /// Claims up to `max_records` records of consumer group `group` on one shard, waiting up
    /// to `wait` seconds for some.
    #[pyo3(signature = (namespace, stream, group, shard=0, max_records=100, wait=0.0, consumer=None, visibility=0.0))]
    #[allow(clippy::too_many_arguments)]
    fn group_poll<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        stream: String,
        group: String,
        shard: u32,
        max_records: u32,
        wait: f64,
        consumer: Option<String>,
        visibility: f64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cc = self.cc.clone();
        let g = GroupTarget { namespace: namespace.clone(), stream: stream.clone(), shard, group };
        let opts = PollOptions { wait: ms(wait)?, consumer, reclaim: false, visibility: ms(visibility)? };
        future_into_py(py, async move {
            let records = cc
                .owner_only(&namespace, &stream, shard, |c| {
                    let (g, opts) = (g.clone(), opts.clone());
                    async move { c.group_poll(&g, max_records, opts).await }
                })
                .await
                .map_err(Fail::from)?;
            Ok(records.into_iter().map(GroupRecord::from).collect::<Vec<_>>())
        })
    }

    /// Finishes a group record.
    #[pyo3(signature = (namespace, stream, group, offset, shard=0))]
    fn group_ack<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        stream: String,
        group: String,
        offset: u64,
        shard: u32,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cc = self.cc.clone();
        let g = GroupTarget { namespace: namespace.clone(), stream: stream.clone(), shard, group };
        future_into_py(py, async move {
            cc.owner_only(&namespace, &stream, shard, |c| {
                let g = g.clone();
                async move { c.group_ack(&g, offset).await }
            })
            .await
            .map_err(Fail::from)
        })
    }

    /// Gives a group record back, to be handed out again (after `delay` seconds).
    #[pyo3(signature = (namespace, stream, group, offset, shard=0, delay=None))]
    #[allow(clippy::too_many_arguments)]
    fn group_nack<'py>(
        &self,
        py: Python<'py>,
        namespace: String,
        stream: String,
        group: String,
        offset: u64,
        shard: u32,
        delay: Option<f64>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let cc = self.cc.clone();
        let g = GroupTarget { namespace: namespace.clone(), stream: stream.clone(), shard, group };
        let delay = delay.map(ms).transpose()?;
        future_into_py(py, async move {
            cc.owner_only(&namespace, &stream, shard, |c| {
                let g = g.clone();
                async move { c.group_nack(&g, offset, delay, None).await }
            })
            .await
            .map_err(Fail::from)
        })
    }

    /// The tenant's streams: `(namespace, stream, shards)` tuples, every page.
    #[pyo3(signature = (namespace=None))]
    fn stream_list<'py>(&self, py: Python<'py>, namespace: Option<String>) -> PyResult<Bound<'py, PyAny>> {
        let cc = self.cc.clone();
        future_into_py(py, async move {
            let c = cc.any().await.map_err(Fail::from)?;
            let mut out = Vec::new();
            let mut after: Option<String> = None;
            loop {
                let (page, next) =
                    c.stream_list(namespace.as_deref(), after.as_deref(), Some(1000)).await.map_err(Fail::from)?;
                out.extend(page.into_iter().map(|e| (e.namespace, e.stream, e.shards)));
                match next {
                    Some(n) => after = Some(n),
                    None => return Ok(out),
                }
            }
        })
    }

    /// The cluster's status document as JSON text (D52).
    fn cluster_status<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        self.on_any(py, |c| async move { Ok(c.cluster_status().await?.to_string()) })
    }

    /// An idempotent producer for `namespace/stream`: every batch it sends is appended exactly
    /// once, across reconnections and fail-overs to the other brokers given at connect.
    fn producer<'py>(&self, py: Python<'py>, namespace: String, stream: String) -> PyResult<Bound<'py, PyAny>> {
        let (seeds, opts) = (self.seeds.clone(), self.opts.clone());
        future_into_py(py, async move {
            let mut last = None;
            for s in &seeds {
                match IdempotentProducer::connect(*s, opts.clone(), &namespace, &stream).await {
                    Ok(mut p) => {
                        p.set_seeds(seeds.clone());
                        return Ok(RawProducer { inner: Arc::new(tokio::sync::Mutex::new(Some(p))) });
                    }
                    Err(e) => last = Some(e),
                }
            }
            Err(last.map_or_else(|| Fail::Py(PyRuntimeError::new_err("no broker")), Fail::Client))
        })
    }

    /// Closes every connection, waiting (up to the close timeout) for the brokers to confirm
    /// what was written.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let cc = self.cc.clone();
        future_into_py(py, async move {
            cc.close().await;
            Ok(())
        })
    }
}

/// An idempotent producer (one stream): each batch appended exactly once.
#[pyclass(frozen, module = "felix._felix")]
pub struct RawProducer {
    inner: Arc<tokio::sync::Mutex<Option<IdempotentProducer>>>,
}

#[pymethods]
impl RawProducer {
    /// Sends a batch and waits until it is appended; its first offset.
    #[pyo3(signature = (payloads, key=None))]
    fn send<'py>(
        &self,
        py: Python<'py>,
        payloads: Vec<PyBackedBytes>,
        key: Option<PyBackedBytes>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner.clone();
        let payloads = convert::payloads(payloads);
        let key = key.map(Bytes::from_owner);
        future_into_py(py, async move {
            let mut g = inner.lock().await;
            let p = g.as_mut().ok_or_else(|| crate::errors::ConnectionClosed::new_err("the producer is closed"))?;
            p.send(payloads, key).await.map_err(Fail::from)
        })
    }

    /// Queues a batch without waiting for it to be appended (at most a few per shard are
    /// unanswered; this waits for room). `flush` waits for all of them.
    #[pyo3(signature = (payloads, key=None))]
    fn submit<'py>(
        &self,
        py: Python<'py>,
        payloads: Vec<PyBackedBytes>,
        key: Option<PyBackedBytes>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner.clone();
        let payloads = convert::payloads(payloads);
        let key = key.map(Bytes::from_owner);
        future_into_py(py, async move {
            let mut g = inner.lock().await;
            let p = g.as_mut().ok_or_else(|| crate::errors::ConnectionClosed::new_err("the producer is closed"))?;
            p.submit(payloads, key).await.map(|_| ()).map_err(Fail::from)
        })
    }

    /// Waits until every queued batch is appended.
    fn flush<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner.clone();
        future_into_py(py, async move {
            let mut g = inner.lock().await;
            let p = g.as_mut().ok_or_else(|| crate::errors::ConnectionClosed::new_err("the producer is closed"))?;
            p.flush().await.map(|_| ()).map_err(Fail::from)
        })
    }

    /// The producer id the broker assigned.
    fn producer_id<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner.clone();
        future_into_py(py, async move { Ok(inner.lock().await.as_ref().map(IdempotentProducer::producer_id)) })
    }

    /// Flushes, then closes its connection.
    fn close<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inner = self.inner.clone();
        future_into_py(py, async move {
            let p = inner.lock().await.take();
            match p {
                Some(p) => p.close().await.map_err(Fail::from),
                None => Ok(()),
            }
        })
    }
}
