//! Subscriptions and cache watches: a tokio task follows the subscription (through moves and
//! fail-overs, `ClusterClient::follow`) and hands batches to Python over a bounded channel.
//! When Python reads slower than the broker sends, the channel fills, the task stops taking
//! batches, the client stops reading the event stream past its buffer, and QUIC flow control
//! holds the broker: nothing is buffered without bound, and a subscription the broker ends
//! for lagging is reported as an error, not hidden.

use crate::bridge::{Fail, spawn as future_into_py};
use crate::convert::{self, CacheChange, Event};
use felix_driver_tokio::{ClientError, ClusterClient, SubscriptionItem};
use felix_proto::binary::EventBatch;
use felix_proto::client::WatchOn;
use felix_proto::message::StartPosition;
use pyo3::prelude::*;
use std::sync::Arc;
use tokio::sync::{Mutex, mpsc, oneshot};

/// Batches taken from the channel at once when more are waiting.
const DRAIN: usize = 64;

type Batches = mpsc::Receiver<Result<EventBatch, ClientError>>;

/// A channel's receiving end, and an error taken from it behind items not yet handed over.
struct Inbox<T, E> {
    rx: mpsc::Receiver<Result<T, E>>,
    pending: Option<E>,
}

/// A subscription to one shard of a stream.
#[pyclass(frozen, module = "felix._felix")]
pub struct RawSubscription {
    rx: Arc<Mutex<Inbox<EventBatch, ClientError>>>,
    task: tokio::task::AbortHandle,
    /// How many times it had to subscribe again, and why the last time.
    resumed: Arc<std::sync::Mutex<(u64, Option<String>)>>,
    /// The shard it reads.
    #[pyo3(get)]
    shard: u32,
}

impl RawSubscription {
    /// Subscribes (the awaitable fails with the broker's refusal), then follows.
    pub fn start<'py>(
        py: Python<'py>,
        cc: Arc<ClusterClient>,
        namespace: String,
        stream: String,
        start: Option<StartPosition>,
        shard: u32,
        buffer_batches: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        future_into_py(py, async move {
            let (tx, rx) = mpsc::channel(buffer_batches.max(1));
            let (ready_tx, ready_rx) = oneshot::channel::<Result<(), ClientError>>();
            let resumed = Arc::new(std::sync::Mutex::new((0u64, None::<String>)));
            let told = resumed.clone();
            let task = tokio::spawn(async move {
                let mut f = match cc.follow(&namespace, &stream, shard, start).await {
                    Ok(f) => {
                        let _ = ready_tx.send(Ok(()));
                        f
                    }
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                loop {
                    let r = f.next().await;
                    if f.resumes() > 0
                        && let Ok(mut t) = told.lock()
                        && t.0 != f.resumes()
                    {
                        *t = (f.resumes(), f.last_end().map(str::to_owned));
                    }
                    let last = r.is_err();
                    if tx.send(r).await.is_err() || last {
                        return;
                    }
                }
            });
            match ready_rx.await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(Fail::Client(e)),
                Err(_) => return Err(Fail::Ended("the subscription's task stopped".into())),
            }
            let rx: Batches = rx;
            Ok(RawSubscription {
                rx: Arc::new(Mutex::new(Inbox { rx, pending: None })),
                task: task.abort_handle(),
                resumed,
                shard,
            })
        })
    }
}

#[pymethods]
impl RawSubscription {
    /// The next events (one batch or more, as many as are waiting); `None` once closed.
    fn next_events<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let (inbox, shard) = (self.rx.clone(), self.shard);
        future_into_py(py, async move {
            let mut inbox = inbox.lock().await;
            if let Some(e) = inbox.pending.take() {
                return Err(Fail::Client(e));
            }
            let Some(first) = inbox.rx.recv().await else { return Ok(None) };
            let mut events: Vec<Event> = convert::events(&first.map_err(Fail::from)?, shard);
            for _ in 0..DRAIN {
                match inbox.rx.try_recv() {
                    Ok(Ok(b)) => events.extend(convert::events(&b, shard)),
                    // An error behind events: those first, the error on the next call.
                    Ok(Err(e)) => {
                        inbox.pending = Some(e);
                        break;
                    }
                    Err(_) => break,
                }
            }
            Ok(Some(events))
        })
    }

    /// How many times the subscription had to be made again (its shard moved, its broker
    /// failed, it fell behind and resumed where it left off).
    #[getter]
    fn resumes(&self) -> u64 {
        self.resumed.lock().map_or(0, |r| r.0)
    }

    /// Why it was last made again, for a person to read.
    #[getter]
    fn last_end(&self) -> Option<String> {
        self.resumed.lock().ok().and_then(|r| r.1.clone())
    }

    /// Ends the subscription.
    fn close(&self) {
        self.task.abort();
    }
}

impl Drop for RawSubscription {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A cache watch.
#[pyclass(frozen, module = "felix._felix")]
pub struct RawWatch {
    rx: Arc<Mutex<Inbox<CacheChange, String>>>,
    task: tokio::task::AbortHandle,
}

impl RawWatch {
    /// Starts the watch on the cache's owner (following one redirect), then relays it.
    #[allow(clippy::too_many_arguments)]
    pub fn start<'py>(
        py: Python<'py>,
        cc: Arc<ClusterClient>,
        namespace: String,
        cache: String,
        on: WatchOn,
        from_offset: Option<u64>,
        retained: bool,
        buffer: usize,
    ) -> PyResult<Bound<'py, PyAny>> {
        future_into_py(py, async move {
            let c = cc.any().await.map_err(Fail::from)?;
            let mut w = match c.cache_watch(&namespace, &cache, on.clone(), from_offset, retained).await {
                Err(ClientError::NotLeader { addr: Some(a), .. }) => {
                    let a = a
                        .parse()
                        .map_err(|_| Fail::Py(crate::errors::ConnectError::new_err(format!("{a}: bad address"))))?;
                    let c = cc.at(a).await.map_err(Fail::from)?;
                    c.cache_watch(&namespace, &cache, on, from_offset, retained).await.map_err(Fail::from)?
                }
                r => r.map_err(Fail::from)?,
            };
            let (tx, rx) = mpsc::channel(buffer.max(1));
            let task = tokio::spawn(async move {
                loop {
                    let item = match w.next().await {
                        Some(SubscriptionItem::CacheChange(e)) => Ok(CacheChange::from(e)),
                        Some(SubscriptionItem::End(reason)) => Err(format!("{reason:?}")),
                        Some(SubscriptionItem::Events(_)) => continue,
                        None => Err("the connection closed".to_owned()),
                    };
                    let last = item.is_err();
                    if tx.send(item).await.is_err() || last {
                        return;
                    }
                }
            });
            Ok(RawWatch { rx: Arc::new(Mutex::new(Inbox { rx, pending: None })), task: task.abort_handle() })
        })
    }
}

#[pymethods]
impl RawWatch {
    /// The next changes (as many as are waiting); `None` once closed.
    fn next_changes<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let inbox = self.rx.clone();
        future_into_py(py, async move {
            let mut inbox = inbox.lock().await;
            if let Some(e) = inbox.pending.take() {
                return Err(Fail::Ended(e));
            }
            let Some(first) = inbox.rx.recv().await else { return Ok(None) };
            let mut out = vec![first.map_err(Fail::Ended)?];
            while out.len() < DRAIN * 16 {
                match inbox.rx.try_recv() {
                    Ok(Ok(c)) => out.push(c),
                    Ok(Err(e)) => {
                        inbox.pending = Some(e);
                        break;
                    }
                    Err(_) => break,
                }
            }
            Ok(Some(out))
        })
    }

    /// Ends the watch.
    fn close(&self) {
        self.task.abort();
    }
}

impl Drop for RawWatch {
    fn drop(&mut self) {
        self.task.abort();
    }
}
