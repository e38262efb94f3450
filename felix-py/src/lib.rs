//! `felix._felix`: the Felix client for Python, as bindings over `felix-driver-tokio`.
//!
//! Every protocol rule (negotiation, publish windows, redirects and retries, idempotent
//! producers, following a moved shard) stays in the one Rust client: this crate only converts
//! arguments and results and turns the driver's futures into asyncio awaitables. The futures
//! run on tokio's threads, so no Python thread holds the GIL while a request waits for the
//! broker. The Python package (`felix-py/python/felix`) adds the asyncio API people write
//! against, batching of fire-and-forget publishes, and a synchronous wrapper.

mod bridge;
mod convert;
mod errors;
mod raw;
mod streams;

use pyo3::prelude::*;

#[pymodule]
fn _felix(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<raw::RawClient>()?;
    m.add_class::<raw::RawProducer>()?;
    m.add_class::<streams::RawSubscription>()?;
    m.add_class::<streams::RawWatch>()?;
    m.add_class::<convert::Event>()?;
    m.add_class::<convert::CacheChange>()?;
    m.add_class::<convert::GroupRecord>()?;
    errors::register(m)?;
    m.add_function(wrap_pyfunction!(bridge::_roundtrip, m)?)?;
    Ok(())
}
