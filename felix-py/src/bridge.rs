//! Rust futures as asyncio futures, safe at interpreter exit.
//!
//! Each call creates an asyncio future on the running loop and runs the Rust future on the
//! client's tokio runtime, without the GIL. Its outcome is converted to Python objects only
//! when it is handed over (`loop.call_soon_threadsafe`), under the GIL, so the futures never
//! touch Python while they run. Cancelling the asyncio future (a timeout) aborts the Rust one.
//!
//! Why not `pyo3-async-runtimes`: it completes futures from tokio threads with no regard for
//! interpreter shutdown, and a completion racing `Py_Finalize` crashed the process at exit
//! (a segfault in `method_dealloc`, seen about one exit in five after an acknowledged publish).
//! Here an `atexit` hook ([`shutdown`]) raises a flag and waits for completions in progress; a
//! completion that starts after the flag drops its result without touching Python.

use crate::errors::to_py;
use felix_driver_tokio::ClientError;
use pyo3::BoundObject;
use pyo3::prelude::*;
use std::future::Future;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

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
static SHUTTING_DOWN: AtomicBool = AtomicBool::new(false);
static COMPLETING: AtomicUsize = AtomicUsize::new(0);

/// The client's runtime: two worker threads (the client is IO-bound; Python is one thread).
pub fn runtime() -> &'static tokio::runtime::Runtime {
    RUNTIME.get_or_init(|| {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("felix-client")
            .enable_all()
            .build()
            .unwrap_or_else(|e| panic!("starting the client's tokio runtime: {e}"))
    })
}

/// Hands a future's outcome to its asyncio future, unless it is already done (cancelled).
#[pyfunction]
fn _complete(fut: &Bound<'_, PyAny>, ok: bool, value: Bound<'_, PyAny>) -> PyResult<()> {
    if fut.call_method0("done")?.is_truthy()? {
        return Ok(());
    }
    if ok {
        fut.call_method1("set_result", (value,))?;
    } else {
        fut.call_method1("set_exception", (value,))?;
    }
    Ok(())
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

/// Runs `fut` on the runtime; an awaitable of its outcome.
pub fn spawn<'py, F, T>(py: Python<'py>, fut: F) -> PyResult<Bound<'py, PyAny>>
where
    F: Future<Output = Out<T>> + Send + 'static,
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    let event_loop = py.import("asyncio")?.call_method0("get_running_loop")?;
    let pyfut = event_loop.call_method0("create_future")?;
    let (l, f) = (event_loop.unbind(), pyfut.clone().unbind());
    let task = runtime().spawn(async move {
        let out = fut.await;
        COMPLETING.fetch_add(1, Ordering::SeqCst);
        if !SHUTTING_DOWN.load(Ordering::SeqCst) {
            Python::attach(|py| {
                let (ok, value) = match out {
                    Ok(v) => match v.into_pyobject(py) {
                        Ok(v) => (true, v.into_any().unbind()),
                        Err(e) => (false, Into::<PyErr>::into(e).into_value(py).into_any()),
                    },
                    Err(e) => (false, e.into_py().into_value(py).into_any()),
                };
                if let Ok(complete) = wrap_pyfunction!(_complete, py) {
                    let _ = l.bind(py).call_method1("call_soon_threadsafe", (complete, f.bind(py), ok, value));
                }
                drop((l, f));
            });
        }
        COMPLETING.fetch_sub(1, Ordering::SeqCst);
    });
    let cancel = Py::new(py, Canceller(task.abort_handle()))?;
    pyfut.call_method1("add_done_callback", (cancel,))?;
    Ok(pyfut)
}

/// The `atexit` hook: no completion touches Python from now on; waits (at most `timeout`
/// seconds, without the GIL) for those in progress.
#[pyfunction]
pub fn shutdown(py: Python<'_>, timeout: f64) {
    SHUTTING_DOWN.store(true, Ordering::SeqCst);
    let until = Instant::now() + Duration::from_secs_f64(timeout.clamp(0.0, 60.0));
    py.detach(|| {
        while COMPLETING.load(Ordering::SeqCst) > 0 && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(1));
        }
    });
}

/// An awaitable that completes at once on the runtime: what one call costs in hand-offs
/// between Python and the runtime, without the broker (`felix-py/bench`).
#[pyfunction]
pub fn _roundtrip(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    spawn(py, async { Ok(()) })
}
