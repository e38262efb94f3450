//! What the broker asks of storage, and what storage answers: defined here, on the floor below
//! the broker, so storage never imports the broker's types (the broker names them too).

use crate::binary::Records;
use crate::transport::{ReadToken, WriteToken};
use bytes::Bytes;

/// When a stream's appends reach the disk (carried to storage with each write).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsyncMode {
    /// Before each write is reported (an ack on commit then means "on disk").
    Always,
    /// At most this long after a write.
    Interval(std::time::Duration),
    /// When the operating system decides.
    Never,
}

/// As users write it (`always`, `never`, `interval:MS`): what [`FromStr`](std::str::FromStr)
/// reads back.
impl std::fmt::Display for FsyncMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FsyncMode::Always => f.write_str("always"),
            FsyncMode::Interval(d) => write!(f, "interval:{}", d.as_millis()),
            FsyncMode::Never => f.write_str("never"),
        }
    }
}

/// `always`, `never` or `interval:MS` (the CLI's and config file's spelling).
impl std::str::FromStr for FsyncMode {
    type Err = String;
    fn from_str(s: &str) -> Result<FsyncMode, String> {
        match s {
            "always" => Ok(FsyncMode::Always),
            "never" => Ok(FsyncMode::Never),
            other => match other.strip_prefix("interval:").or_else(|| other.strip_prefix("interval=")) {
                Some(ms) => ms
                    .trim_end_matches("ms")
                    .parse::<u64>()
                    .map(|ms| FsyncMode::Interval(std::time::Duration::from_millis(ms)))
                    .map_err(|_| format!("bad interval in {other:?}: expected interval:MILLISECONDS")),
                None => Err(format!("unknown fsync policy {other:?}: expected always, never or interval:MS")),
            },
        }
    }
}

/// A storage write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PersistRequest {
    /// Reported back on completion.
    pub token: WriteToken,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard.
    pub shard: u32,
    /// Offset of the first record.
    pub base_offset: u64,
    /// The records (empty for a generation-start record).
    pub records: Records,
    /// Append time, microseconds since the Unix epoch.
    pub timestamp_micros: u64,
    /// The publishing principal.
    pub publisher: Option<Bytes>,
    /// A generation-start record (one offset, never delivered).
    pub generation_start: bool,
    /// The idempotent producer that wrote it: `(producer_id, sequence)`, kept with the batch so
    /// producer state survives a restart.
    pub producer: Option<(u64, u64)>,
    /// A `commit`'s state changes (`storage::encode_state_changes`), stored with its record.
    pub state: Option<Bytes>,
    /// The stream's fsync policy (`None`: storage's default).
    pub fsync: Option<FsyncMode>,
    /// How many shards the stream has (for the storage layer's metadata).
    pub stream_shards: u32,
    /// The key it was published with (D57), stored with it.
    pub key: Option<Bytes>,
}

impl PersistRequest {
    /// The batch as storage keeps it.
    pub fn to_stored(&self) -> crate::storage::StoredBatch {
        crate::storage::StoredBatch {
            base_offset: self.base_offset,
            timestamp_micros: self.timestamp_micros,
            generation_start: self.generation_start,
            publisher: self.publisher.clone(),
            producer: self.producer,
            state: self.state.clone(),
            key: self.key.clone(),
            records: self.records.clone(),
        }
    }
}

/// A history read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadRequest {
    /// Reported back on completion.
    pub token: ReadToken,
    /// Tenant.
    pub tenant_id: String,
    /// Namespace.
    pub namespace: String,
    /// Stream.
    pub stream: String,
    /// Shard.
    pub shard: u32,
    /// First offset wanted.
    pub from: u64,
    /// Stop before this offset (the start of what the broker holds in memory).
    pub end: u64,
    /// About how many payload bytes to return at most.
    pub max_bytes: usize,
}

/// How a write ended ([`crate::broker::Broker::handle_write_result`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WriteOutcome {
    /// On storage (as far as the stream's fsync policy promises).
    Written,
    /// Failed; nothing of it is stored.
    Failed,
    /// Failed for lack of space (a full disk, a quota, a file-size limit); nothing of it is
    /// stored. The shard refuses publishes until a write succeeds again.
    NoSpace,
}
