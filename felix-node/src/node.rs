//! What `serve`, `demo` and `bench` share: the data directory (certificate, dev token) and
//! starting a broker from command-line settings.

use felix_driver_tokio::{FsyncMode, Identity, Server, ServerOptions, TransportTuning, Trust};
use felix_proto::broker::{BrokerConfig, StreamConfig, TokenGrant};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

pub use felix_driver_common::data_dir::DataDir;

/// Settings to start a broker with.
pub struct BrokerSettings {
    pub listen: SocketAddr,
    pub data_dir: Option<PathBuf>,
    /// The development token, if one is in use.
    pub token: Option<String>,
    /// Tokens from the configuration file.
    pub tokens: Vec<TokenGrant>,
    /// Client certificates (mutual TLS) as credentials, from the configuration file.
    pub client_certs: Vec<TokenGrant>,
    /// Per-tenant publish rate limits.
    pub tenant_limits: Vec<felix_proto::broker::TenantLimit>,
    /// Signed tokens accepted.
    pub jwt: Option<felix_proto::jwt::Verifier>,
    pub streams: Vec<felix_proto::broker::StreamSpec>,
    pub caches: Vec<felix_proto::broker::CacheSpec>,
    pub queue_capacity_max: u32,
    pub queue_bytes_max: usize,
    /// [`BrokerConfig::publisher_hold_max`].
    pub publisher_hold_max: std::time::Duration,
    pub identity: Identity,
    pub fsync: FsyncMode,
    pub ephemeral: bool,
    /// Caches created on first use survive a restart.
    pub durable_caches: bool,
    /// Shards of a stream created on first use (default 1).
    pub default_shards: u32,
    /// Replicas per shard of a durable stream created on first use, in a cluster (default 1).
    pub default_replication: u32,
    /// Replicas of a cache created on first use, in a cluster (default 1).
    pub cache_replication: u32,
    pub retention_records: Option<u64>,
    pub memory_bytes: Option<u64>,
    pub publish_window: u32,
    pub max_frame_bytes: u32,
    pub ack_on_commit: bool,
    pub auto_create: bool,
    pub queue_capacity: u32,
    pub max_records_per_read: u32,
    pub group_limits: felix_proto::broker::GroupLimits,
    pub require_alpn: bool,
    pub metrics_listen: Option<SocketAddr>,
    /// The operator web view's address and token (off when `None`).
    pub http: Option<(std::net::SocketAddr, String)>,
    /// Run as a broker of a cluster.
    pub cluster: Option<felix_driver_tokio::cluster::ClusterOptions>,
    /// CA certificates client certificates are verified against (mutual TLS), if any.
    pub client_ca: Option<Vec<felix_driver_tokio::tls::CertificateDer<'static>>>,
    pub transport: TransportTuning,
    /// Auth timeout per control stream, and the caps on unauthenticated connections (in all,
    /// per address).
    pub admission: Admission,
}

/// How connections that authenticated nothing yet are limited.
#[derive(Debug, Clone, Copy)]
pub struct Admission {
    pub auth_timeout: std::time::Duration,
    pub max_unauthenticated: usize,
    pub max_unauthenticated_per_address: usize,
}

impl Default for Admission {
    fn default() -> Self {
        let d = BrokerConfig::default();
        Admission {
            auth_timeout: d.auth_timeout,
            max_unauthenticated: d.max_unauthenticated_connections,
            max_unauthenticated_per_address: d.max_unauthenticated_per_peer,
        }
    }
}

pub async fn start_broker(s: BrokerSettings) -> Result<Server, String> {
    let mut tokens = s.tokens;
    if let Some(t) = s.token {
        tokens.push(TokenGrant::dev(t));
    }
    let broker = BrokerConfig {
        tokens,
        client_certs: s.client_certs,
        tenant_limits: s.tenant_limits,
        jwt: s.jwt,
        streams: s.streams,
        caches: s.caches,
        subscriber_queue_capacity_max: s.queue_capacity_max,
        subscriber_queue_bytes_max: s.queue_bytes_max,
        publisher_hold_max: s.publisher_hold_max,
        publish_window: s.publish_window,
        max_frame_len: s.max_frame_bytes,
        ack_on_commit: s.ack_on_commit,
        auto_create: s.auto_create,
        max_records_per_read: s.max_records_per_read,
        group_limits: s.group_limits,
        auth_timeout: s.admission.auth_timeout,
        max_unauthenticated_connections: s.admission.max_unauthenticated.max(1),
        max_unauthenticated_per_peer: s.admission.max_unauthenticated_per_address.max(1),
        durable_caches: s.durable_caches,
        cache_replication: s.cache_replication.clamp(1, 7),
        default_stream: StreamConfig {
            durable: !s.ephemeral,
            shards: s.default_shards.max(1),
            replication: s.default_replication.clamp(1, 7),
            retention: felix_proto::broker::Retention {
                max_records: s.retention_records.or(StreamConfig::default().retention.max_records),
                ..StreamConfig::default().retention
            },
            memory_bytes: s.memory_bytes.unwrap_or(StreamConfig::default().memory_bytes),
            queue_capacity: s.queue_capacity,
            ..StreamConfig::default()
        },
        ..BrokerConfig::default()
    };
    let opts = ServerOptions {
        listen: s.listen,
        broker,
        identity: s.identity,
        data_dir: s.data_dir,
        fsync: s.fsync,
        transport: s.transport,
        require_alpn: s.require_alpn,
        metrics_listen: s.metrics_listen,
        http: s.http,
        cluster: s.cluster,
        client_ca: s.client_ca,
    };
    Server::start(opts).await.map_err(|e| format!("starting the broker on {}: {e}", s.listen))
}

/// Trust for a client: `--ca`, the data directory's certificate, or (loudly) anything.
pub fn client_trust(ca: Option<&Path>, data_dir: &Path, insecure: bool) -> Result<Trust, String> {
    if insecure {
        eprintln!("WARNING: --insecure-accept-any-certificate: the broker's identity is NOT checked");
        return Ok(Trust::DangerAcceptAnyCertificate);
    }
    let path = match ca {
        Some(p) => p.to_path_buf(),
        None => DataDir::new(data_dir).cert(),
    };
    let certs = felix_driver_tokio::tls::load_certs(&path).map_err(|e| {
        format!("{e}\n  (pass --ca CERT.pem with the broker's certificate, or run from the directory where `felix-node serve` keeps ./felix-data)")
    })?;
    Ok(Trust::Certificates(certs))
}
