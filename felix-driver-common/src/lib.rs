//! felix-driver-common: the parts of a driver that are not about a runtime. Both drivers (the
//! tokio one and the blocking one) use them, so a broker's files and certificates are the same
//! whichever driver runs it.
//!
//! - [`data_dir`]: the certificate and development token a broker keeps in its data directory.
//! - [`storage`]: durable stream shards on disk in `felix_proto::storage`'s segment format
//!   (appends, group commit, fsync policies, recovery, retention, history reads).
//! - [`fault_clock`]: a broker's wall clock set off, for clock-fault tests.
//! - [`sync_journal`]: a record of what reached the disk, for power-cut tests.
//! - [`transport`]: the QUIC transport settings (MTU, windows, timeouts) tuned for throughput.
//! - [`tls`]: certificates, keys, the client's trust decision, the rustls configurations and
//!   the QUIC server crypto that serves clients with and without ALPN.

mod alpn;
pub mod data_dir;
pub mod fault_clock;
pub mod storage;
pub mod sync_journal;
pub mod tls;
pub mod transport;

pub use storage::{DiskStorage, FsyncMode};

/// Why a broker could not start (or its loop stopped): the same two causes for every driver.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// TLS setup failed.
    #[error(transparent)]
    Tls(#[from] tls::TlsError),
    /// A socket, the poller or storage failed.
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// The core's name for a client's address: IPv4 mapped into IPv6 (`::ffff:a.b.c.d`), so each
/// peer has one form (connections from one address share the unauthenticated-connection cap).
pub fn peer_addr(ip: std::net::IpAddr) -> felix_proto::broker::PeerAddr {
    let v6 = match ip {
        std::net::IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        std::net::IpAddr::V6(v6) => v6,
    };
    felix_proto::broker::PeerAddr(v6.octets())
}

/// Randomness for a broker's choices (producer ids; `BrokerConfig::random_seed`): felix-proto
/// draws none itself. From the process's hash keys (seeded by the OS) and the time.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos());
    h.finish()
}
pub use tls::{Identity, Trust};
