//! Rust futures as asyncio futures, with no tokio thread ever taking the GIL.
//!
//! Each call creates an asyncio future on the running loop and runs the Rust future on the
//! client's tokio runtime. When it ends, its outcome goes into the loop's [`Completer`]: a
//! queue, and one byte written to a socket pair whose reading end the loop watches
//! (`loop.add_reader`). The loop's thread drains the queue, converts each outcome to Python
//! objects and completes the futures, under the GIL it already holds. Cancelling the asyncio
//! future (a timeout) aborts the Rust one.
//!
//! Why not take the GIL on the tokio thread and call `loop.call_soon_threadsafe`, as this
//! module first did: the loop's thread holds the GIL until it blocks in `epoll_wait`, so the
//! tokio thread waited for it, then the two threads passed it back and forth; one call's
//! hand-off cost 93–120 µs, a third of an acknowledged publish (docs/benchmarks.md). A byte on
//! a socket is one wake-up of the loop and no GIL wait on either side. It also makes interpreter
//! exit safe by construction: with `pyo3-async-runtimes`, a completion racing `Py_Finalize`
//! from a tokio thread crashed the process at exit (a segfault in `method_dealloc`); here no
//! tokio thread touches Python at all: a future aborted there drops its `Py` handle into
//! PyO3's deferred reference pool, which needs no interpreter.

use crate::errors::to_py;
use felix_driver_tokio::ClientError;
use pyo3::BoundObject;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use std::future::Future;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// Why a call failed, converted to a Python exception only under the GIL.
pub enum Fail {
    /// The client's error.
    Client(ClientError),
    /// Already a Python exception (lazily built: creating it needs no GIL).
    Py(PyErr),
    /// A subscription or watch ended.
    Ended(String),
}

impl From<ClientError> for Fail {
    fn from(e: ClientError) -> Fail {
        Fail::Client(e)
    }
}

impl From<PyErr> for Fail {
    fn from(e: PyErr) -> Fail {
        Fail::Py(e)
    }
}

impl Fail {
    fn into_py(self) -> PyErr {
        match self {
            Fail::Client(e) => to_py(e),
            Fail::Py(e) => e,
            Fail::Ended(reason) => crate::errors::ended(reason),
        }
    }
}

/// What a call's future yields.
pub type Out<T> = Result<T, Fail>;

static RUNTIME: OnceLock<tokio::runtime::Runtime> = OnceLock::new();

/// The client's runtime: one worker thread by default, `FELIX_PY_WORKERS` to change it.
///
/// Why one: the client is IO-bound and Python is one thread. A call wakes the runtime once;
/// with one worker the task it spawns, the connection's driver task and quinn's run on that
/// thread with no hand-off between threads. With two, an acknowledged publish cost four more
/// `futex` calls on the client (strace, 5,000 calls: 20,079 with two workers, 0 with one).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    RUNTIME.get_or_init(|| {
        let workers = std::env::var("FELIX_PY_WORKERS").ok().and_then(|v| v.parse().ok()).filter(|&n: &usize| n > 0);
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers.unwrap_or(1))
            .thread_name("felix-client")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("starting the client's tokio runtime: {e}"))
    })
}

/// Aborts the Rust future when its asyncio future is cancelled.
#[pyclass]
struct Canceller(tokio::task::AbortHandle);

#[pymethods]
impl Canceller {
    fn __call__(&self, fut: &Bound<'_, PyAny>) -> PyResult<()> {
        if fut.call_method0("cancelled")?.is_truthy()? {
            self.0.abort();
        }
        Ok(())
    }
}

/// A finished call: its asyncio future and how to make its outcome a Python object.
type Done = (Py<PyAny>, Box<dyn FnOnce(Python<'_>) -> (bool, Py<PyAny>) + Send>);

/// The completions of one event loop's calls.
struct Shared {
    queue: Mutex<Vec<Done>>,
    /// A byte is on the socket and the loop has not drained since: no second byte is needed.
    signaled: AtomicBool,
    tx: UnixStream,
    rx: UnixStream,
}

impl Shared {
    /// From any thread, without the GIL.
    fn push(&self, done: Done) {
        match self.queue.lock() {
            Ok(mut q) => q.push(done),
            Err(p) => p.into_inner().push(done),
        }
        if !self.signaled.swap(true, Ordering::AcqRel) {
            // Non-blocking; at most one byte is ever unread, so it cannot fill.
            let _ = (&self.tx).write(&[1]);
        }
    }
}

/// One event loop's completion queue; the loop calls `_drain` when its socket is readable.
#[pyclass]
pub struct Completer(Arc<Shared>);

#[pymethods]
impl Completer {
    /// The socket the loop watches.
    fn fileno(&self) -> i32 {
        self.0.rx.as_raw_fd()
    }

    /// Completes every finished call's future (on the loop's thread).
    fn _drain(&self, py: Python<'_>) {
        let mut buf = [0u8; 64];
        // The flag first, then the queue: a call finishing after the take writes a new byte.
        self.0.signaled.store(false, Ordering::Release);
        // One read: at most one byte is unread at a time (a byte written after it makes the
        // socket readable again, and costs an empty drain at worst).
        let _ = (&self.0.rx).read(&mut buf);
        let items = match self.0.queue.lock() {
            Ok(mut q) => std::mem::take(&mut *q),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        };
        for (fut, outcome) in items {
            let fut = fut.bind(py);
            // Already done: cancelled by its caller (a timeout); the outcome is dropped.
            if fut.call_method0("done").and_then(|d| d.is_truthy()).unwrap_or(true) {
                continue;
            }
            let (ok, value) = outcome(py);
            let _ = fut.call_method1(if ok { "set_result" } else { "set_exception" }, (value,));
        }
    }
}

/// The running loop's completer, made and registered with the loop on first use. Kept in a
/// `WeakKeyDictionary`, so a closed and dropped loop takes its completer (and socket) with it.
fn completer_for(py: Python<'_>, event_loop: &Bound<'_, PyAny>) -> PyResult<Arc<Shared>> {
    static COMPLETERS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let table = COMPLETERS.get_or_try_init(py, || -> PyResult<Py<PyAny>> {
        Ok(py.import("weakref")?.call_method0("WeakKeyDictionary")?.unbind())
    })?;
    let table = table.bind(py);
    if let Ok(c) = table.call_method1("get", (event_loop,))?.cast::<Completer>() {
        return Ok(c.borrow().0.clone());
    }
    let (tx, rx) =
        UnixStream::pair().map_err(|e| PyRuntimeError::new_err(format!("a socket pair for completions: {e}")))?;
    tx.set_nonblocking(true)
        .and_then(|_| rx.set_nonblocking(true))
        .map_err(|e| PyRuntimeError::new_err(format!("a socket pair for completions: {e}")))?;
    let shared = Arc::new(Shared { queue: Mutex::new(Vec::new()), signaled: AtomicBool::new(false), tx, rx });
    let c = Bound::new(py, Completer(shared.clone()))?;
    event_loop.call_method1("add_reader", (c.borrow().fileno(), c.getattr("_drain")?))?;
    table.set_item(event_loop, c)?;
    Ok(shared)
}

/// Runs `fut` on the runtime; an awaitable of its outcome.
pub fn spawn<'py, F, T>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Out<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let completer = completer_for(py, &event_loop)?;
    let pyfut = event_loop.call_method0("create_future")?;
    let f = pyfut.clone().unbind();
    let task = runtime().spawn(async move {
        let out = fut.await;
        completer.push((
            f,
            Box::new(move |py: Python<'_>| match out {
                Ok(v) => match v.into_pyobject(py) {
                    Ok(v) => (true, v.into_any().unbind()),
                    Err(e) => (false, Into::<PyErr>::into(e).into_value(py).into_any()),
                },
                Err(e) => (false, e.into_py().into_value(py).into_any()),
            }),
        ));
    });
    let cancel = Py::new(py, Canceller(task.abort_handle()))?;
    pyfut.call_method1("add_done_callback", (cancel,))?;
    Ok(pyfut)
}

/// An awaitable that completes at once on the runtime: what one call costs in hand-offs
/// between Python and the runtime, without the broker (`felix-py/bench`).
#[pyfunction]
pub fn _roundtrip(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    spawn(py, async { Ok(()) })
}
