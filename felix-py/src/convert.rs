//! What crosses into Python: events, cache changes, group records (frozen classes whose
//! payloads become `bytes` when read), and what comes in: payloads, start positions.

use bytes::Bytes;
use felix_proto::binary::EventBatch;
use felix_proto::message::{self, StartPosition};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::PyBytes;

/// One record of a stream, as a subscription delivers it.
#[pyclass(frozen, module = "felix._felix")]
pub struct Event {
    /// Its offset in its shard (`None` from a stream without offsets, an in-memory one).
    #[pyo3(get)]
    pub offset: Option<u64>,
    /// The shard it was read from.
    #[pyo3(get)]
    pub shard: u32,
    /// When the broker appended it, in microseconds since the Unix epoch, when it says.
    #[pyo3(get)]
    pub timestamp_micros: Option<u64>,
    payload: Bytes,
    envelope: Option<Bytes>,
}

#[pymethods]
impl Event {
    /// The record's bytes.
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.payload)
    }

    /// The envelope the record's batch was published with (D58: end-to-end encryption's key id
    /// and algorithm), or `None`: with one, `payload` is ciphertext.
    #[getter]
    fn envelope<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.envelope.as_ref().map(|e| PyBytes::new(py, e))
    }

    fn __repr__(&self) -> String {
        format!("Event(offset={:?}, shard={}, payload=<{} bytes>)", self.offset, self.shard, self.payload.len())
    }
}

/// A batch's records as events.
pub fn events(batch: &EventBatch, shard: u32) -> Vec<Event> {
    batch
        .records
        .iter()
        .enumerate()
        .map(|(i, r)| Event {
            offset: batch.base_offset.map(|b| b + i as u64),
            shard,
            timestamp_micros: r.timestamp_micros,
            payload: r.payload,
            envelope: batch.records.envelope().cloned(),
        })
        .collect()
}

/// One change a cache watch delivers.
#[pyclass(frozen, module = "felix._felix")]
pub struct CacheChange {
    /// The key.
    #[pyo3(get)]
    pub key: String,
    /// The change's offset in the cache's log (resume after it with `from_offset`).
    #[pyo3(get)]
    pub offset: u64,
    /// When the value expires (milliseconds since the Unix epoch; 0: never).
    #[pyo3(get)]
    pub expires_at_millis: u64,
    value: Option<Bytes>,
}

#[pymethods]
impl CacheChange {
    /// The new value; `None` when the key was deleted or expired.
    #[getter]
    fn value<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.value.as_ref().map(|v| PyBytes::new(py, v))
    }

    fn __repr__(&self) -> String {
        format!("CacheChange(key={:?}, offset={}, deleted={})", self.key, self.offset, self.value.is_none())
    }
}

impl From<message::CacheEvent> for CacheChange {
    fn from(e: message::CacheEvent) -> CacheChange {
        CacheChange {
            key: e.key,
            offset: e.offset,
            expires_at_millis: e.expires_at_millis,
            value: e.value.map(|v| v.0),
        }
    }
}

/// A record a consumer group handed out: finish it with `group_ack`, or give it back.
#[pyclass(frozen, module = "felix._felix")]
pub struct GroupRecord {
    /// Its offset in the shard.
    #[pyo3(get)]
    pub offset: u64,
    /// How many times it was handed out (1 the first time).
    #[pyo3(get)]
    pub attempts: u32,
    /// When the broker appended it, when it says.
    #[pyo3(get)]
    pub timestamp_micros: Option<u64>,
    payload: Bytes,
}

#[pymethods]
impl GroupRecord {
    /// The record's bytes.
    #[getter]
    fn payload<'py>(&self, py: Python<'py>) -> Bound<'py, PyBytes> {
        PyBytes::new(py, &self.payload)
    }

    fn __repr__(&self) -> String {
        format!(
            "GroupRecord(offset={}, attempts={}, payload=<{} bytes>)",
            self.offset,
            self.attempts,
            self.payload.len()
        )
    }
}

impl From<message::GroupRecord> for GroupRecord {
    fn from(r: message::GroupRecord) -> GroupRecord {
        GroupRecord {
            offset: r.offset,
            attempts: r.attempts,
            timestamp_micros: r.timestamp_micros,
            payload: r.payload.0,
        }
    }
}

/// Python `bytes` as `Bytes` without copying: the Python object is kept alive by the `Bytes`.
pub fn payloads(list: Vec<PyBackedBytes>) -> Vec<Bytes> {
    list.into_iter().map(Bytes::from_owner).collect()
}

/// `"latest"`, `"earliest"` or an offset.
pub fn start(from: &Bound<'_, PyAny>) -> PyResult<Option<StartPosition>> {
    if from.is_none() {
        return Ok(None);
    }
    if let Ok(o) = from.extract::<u64>() {
        return Ok(Some(StartPosition::Offset(o)));
    }
    match from.extract::<String>().as_deref() {
        Ok("latest") => Ok(Some(StartPosition::Latest)),
        Ok("earliest") => Ok(Some(StartPosition::Earliest)),
        _ => Err(PyValueError::new_err(format!(
            "start must be \"latest\", \"earliest\" or an offset (an int >= 0), not {from}"
        ))),
    }
}
