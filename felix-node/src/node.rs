//! What `serve`, `demo` and `bench` share: the data directory (certificate, dev token) and
//! starting a broker from command-line settings.

use felix_driver_tokio::{FsyncMode, Identity, Server, ServerOptions, TransportTuning, Trust};
use felix_proto::broker::{BrokerConfig, StreamConfig, TokenGrant};
use std::io::Read;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

/// Where the broker keeps its files.
pub struct DataDir {
    pub root: PathBuf,
}

impl DataDir {
    pub fn new(root: impl Into<PathBuf>) -> DataDir {
        DataDir { root: root.into() }
    }
    pub fn cert(&self) -> PathBuf {
        self.root.join("tls").join("cert.pem")
    }
    pub fn key(&self) -> PathBuf {
        self.root.join("tls").join("key.pem")
    }
    pub fn token(&self) -> PathBuf {
        self.root.join("dev-token")
    }

    /// The broker's certificate: loaded, or generated (for `localhost`) on first start.
    pub fn identity(&self) -> Result<(Identity, bool), String> {
        if self.cert().exists() && self.key().exists() {
            return Identity::load(&self.cert(), &self.key()).map(|i| (i, false)).map_err(|e| e.to_string());
        }
        let dir = self.root.join("tls");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let (id, cert, key) = Identity::self_signed(&["localhost", "127.0.0.1"]).map_err(|e| e.to_string())?;
        std::fs::write(self.cert(), cert).map_err(|e| format!("{}: {e}", self.cert().display()))?;
        write_private(&self.key(), key.as_bytes())?;
        Ok((id, true))
    }

    /// The development token: `given` (stored for clients to find), the stored one, or a new
    /// random one.
    pub fn dev_token(&self, given: Option<&str>) -> Result<String, String> {
        std::fs::create_dir_all(&self.root).map_err(|e| format!("{}: {e}", self.root.display()))?;
        if let Some(t) = given {
            write_private(&self.token(), t.as_bytes())?;
            return Ok(t.to_owned());
        }
        if let Ok(t) = std::fs::read_to_string(self.token()) {
            let t = t.trim().to_owned();
            if !t.is_empty() {
                return Ok(t);
            }
        }
        let t = random_token()?;
        write_private(&self.token(), t.as_bytes())?;
        Ok(t)
    }
}

fn write_private(path: &Path, data: &[u8]) -> Result<(), String> {
    use std::io::Write;
    let mut opts = std::fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        opts.mode(0o600);
    }
    let mut f = opts.open(path).map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(data).map_err(|e| format!("{}: {e}", path.display()))
}

fn random_token() -> Result<String, String> {
    let mut buf = [0u8; 16];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(|e| format!("reading /dev/urandom: {e}"))?;
    Ok(format!("dev-{}", buf.iter().map(|b| format!("{b:02x}")).collect::<String>()))
}

/// Settings to start a broker with.
pub struct BrokerSettings {
    pub listen: SocketAddr,
    pub data_dir: Option<PathBuf>,
    /// The development token, if one is in use.
    pub token: Option<String>,
    /// Tokens from the configuration file.
    pub tokens: Vec<TokenGrant>,
    pub streams: Vec<felix_proto::broker::StreamSpec>,
    pub caches: Vec<felix_proto::broker::CacheSpec>,
    pub queue_capacity_max: u32,
    pub queue_bytes_max: usize,
    pub identity: Identity,
    pub fsync: FsyncMode,
    pub ephemeral: bool,
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
        streams: s.streams,
        caches: s.caches,
        subscriber_queue_capacity_max: s.queue_capacity_max,
        subscriber_queue_bytes_max: s.queue_bytes_max,
        publish_window: s.publish_window,
        max_frame_len: s.max_frame_bytes,
        ack_on_commit: s.ack_on_commit,
        auto_create: s.auto_create,
        max_records_per_read: s.max_records_per_read,
        group_limits: s.group_limits,
        auth_timeout: s.admission.auth_timeout,
        max_unauthenticated_connections: s.admission.max_unauthenticated.max(1),
        max_unauthenticated_per_peer: s.admission.max_unauthenticated_per_address.max(1),
        default_stream: StreamConfig {
            durable: !s.ephemeral,
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
