//! `felix-node serve --config FILE`: the TOML configuration.
//!
//! ```toml
//! [broker]
//! listen = "127.0.0.1:5000"
//! data_dir = "./felix-data"
//! fsync = "always"                # always (default) | never | interval:MS (lazy: see docs/storage.md)
//! publish_window = 256
//! max_frame_bytes = 16777216
//! ack_on_commit = false
//! auto_create = true
//! require_alpn = false
//! auth_timeout_ms = 10000         # a control stream must authenticate within this
//! max_unauthenticated_connections = 1024
//! max_unauthenticated_per_address = 64
//! dev_token = true                # generate/keep the development token
//! subscriber_queue_capacity = 4096
//! subscriber_queue_capacity_max = 65536
//! subscriber_queue_bytes_max = 268435456  # bytes one subscriber's queue may hold
//! publisher_hold_ms = 1000        # in-memory streams: how long a slow subscriber may hold
//!                                 #   its publishers before it is left to drop (0: never)
//! max_records_per_read = 1000
//!
//! [[tokens]]
//! token = "s3cret"
//! tenant = "acme"                 # omit for any tenant
//! principal = "billing"
//! grants = [{ action = "publish", pattern = "orders/*" }, { action = "subscribe", pattern = "*" }]
//!
//! [tls]
//! client_ca = "clients-ca.pem"    # ask clients for certificates signed by this CA (mutual TLS)
//!
//! [[client_certs]]
//! name = "svc-orders"             # a client certificate's subject CN or subject alternative name
//! tenant = "acme"
//! principal = "orders-service"
//! grants = [{ action = "publish", pattern = "orders/*" }]
//!
//! [[streams]]
//! tenant = "acme"
//! namespace = "orders"
//! name = "created"
//! durable = true
//! shards = 4
//! routing = "modulo"              # modulo | jump_hash
//! retention = { max_records = 1000000, max_bytes = 268435456, max_age_secs = 86400 }
//! queue_capacity = 4096
//! memory_bytes = 67108864         # history kept in memory per shard; older is read from disk
//! fsync = "always"                # this stream's own policy (default: the broker's)
//! durability = "quorum"           # disk (default) | quorum: in a cluster, each shard a Raft
//! replication = 3                 #   group over this many brokers (1..=7, default 3; 1: one
//!                                 #   copy on its owner's disk, as durability = "disk")
//!
//! [[caches]]
//! tenant = "acme"
//! namespace = "default"
//! name = "sessions"
//! durable = true                  # values survive a restart (default: in memory only)
//!
//! [[caches]]
//! tenant = "acme"
//! namespace = "default"
//! name = "leases"
//! durability = "quorum"           # in a cluster: the cache's changes are a Raft group's log
//! replication = 3                 #   over this many brokers (1..=7, default 3; 1: not
//!                                 #   replicated, kept on its owner's disk)
//! ```
//!
//! Unknown keys are errors: a typo must not silently change nothing.

use felix_proto::broker::{Action, CacheSpec, Grant, Retention, StreamConfig, StreamSpec, TokenGrant};
use felix_proto::message::Routing;
use serde::Deserialize;
use std::path::Path;
use std::time::Duration;

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    #[serde(default)]
    pub broker: BrokerSection,
    #[serde(default)]
    pub tokens: Vec<TokenSection>,
    /// Client certificates (mutual TLS) mapped to credentials.
    #[serde(default)]
    pub client_certs: Vec<ClientCertSection>,
    #[serde(default)]
    pub streams: Vec<StreamSection>,
    #[serde(default)]
    pub caches: Vec<CacheSection>,
    /// Membership of a cluster (docs/cluster.md); flags and FELIX_* variables override it.
    #[serde(default)]
    pub cluster: ClusterSection,
    /// The broker's certificate (`serve --tls-cert/--tls-key`).
    #[serde(default)]
    pub tls: TlsSection,
    /// Per-tenant publish rate limits.
    #[serde(default)]
    pub limits: Vec<LimitSection>,
    /// Signed tokens (`serve --jwks`).
    #[serde(default)]
    pub auth: AuthSection,
}

/// `[auth]`: the JWK set signed tokens are checked against, and what they must say.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthSection {
    pub jwks: Option<String>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    /// Revoked token ids.
    #[serde(default)]
    pub revoked_jti: Vec<String>,
    /// Revoked principals.
    #[serde(default)]
    pub revoked_sub: Vec<String>,
}

/// `[[limits]]`: one tenant's publish rate limits.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitSection {
    pub tenant: String,
    /// One namespace of the tenant (its rates on top of the tenant's; its stream and retained
    /// quotas instead of the tenant's).
    pub namespace: Option<String>,
    /// Records per second.
    pub publish_records_per_s: Option<u64>,
    /// Payload bytes per second.
    pub publish_bytes_per_s: Option<u64>,
    /// Connections open at once.
    pub max_connections: Option<u32>,
    /// Streams per namespace.
    pub max_streams_per_namespace: Option<u32>,
    /// Subscriptions and cache watches per connection.
    pub max_subscriptions_per_connection: Option<u32>,
    /// Payload bytes of history a namespace retains.
    pub max_retained_bytes_per_namespace: Option<u64>,
    /// The tenant's share of the publish queue, in payload bytes waiting for storage.
    pub max_queued_publish_bytes: Option<u64>,
}

/// `[tls]`: an operator's certificate chain and key (PEM files).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSection {
    pub cert: Option<String>,
    pub key: Option<String>,
    /// CA certificates (PEM) client certificates must chain to: turns mutual TLS on.
    pub client_ca: Option<String>,
    /// The cluster's CA directory (`ca.pem`, `ca.key`): the broker's certificate is issued by
    /// it (`serve --cluster-ca`).
    pub cluster_ca: Option<String>,
}

/// `[[client_certs]]`: what a verified client certificate naming `name` may do.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientCertSection {
    /// The certificate's subject common name or one of its subject alternative names.
    pub name: String,
    pub tenant: String,
    pub principal: String,
    #[serde(default)]
    pub grants: Vec<GrantSection>,
}

/// `[cluster]`: the same settings as `serve --node-id/--cluster-listen/--peers/...`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    pub node_id: Option<String>,
    pub listen: Option<String>,
    /// `ID=HOST:PORT,...` or a list of `ID=HOST:PORT` strings.
    pub peers: Option<PeersSetting>,
    pub secret: Option<String>,
    pub name: Option<String>,
    pub advertise: Option<String>,
    pub default_shards: Option<u32>,
    /// Replicas per shard of a durable stream created on first use (1..=7).
    pub default_replication: Option<u32>,
    /// Replicas of a cache created on first use (1..=7).
    pub cache_replication: Option<u32>,
    /// Join a running cluster (`serve --join`).
    pub join: Option<bool>,
    /// `serve --move-bandwidth`: `"50MB/s"`, `"20MiB/s"`.
    pub move_bandwidth: Option<String>,
    /// `serve --metadata-snapshot-entries`.
    pub metadata_snapshot_entries: Option<u64>,
}

/// The peers of `[cluster]`, as one string or a list.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PeersSetting {
    /// `"n1=127.0.0.1:7001,n2=..."`.
    One(String),
    /// `["n1=127.0.0.1:7001", "n2=..."]`.
    Many(Vec<String>),
}

impl PeersSetting {
    /// As the flag's spelling.
    pub fn joined(&self) -> String {
        match self {
            PeersSetting::One(s) => s.clone(),
            PeersSetting::Many(v) => v.join(","),
        }
    }
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BrokerSection {
    pub listen: Option<String>,
    pub data_dir: Option<String>,
    pub fsync: Option<String>,
    pub publish_window: Option<u32>,
    pub max_frame_bytes: Option<u32>,
    pub ack_on_commit: Option<bool>,
    pub auto_create: Option<bool>,
    pub require_alpn: Option<bool>,
    pub auth_timeout_ms: Option<u64>,
    pub max_unauthenticated_connections: Option<usize>,
    pub max_unauthenticated_per_address: Option<usize>,
    pub dev_token: Option<bool>,
    pub ephemeral: Option<bool>,
    /// Caches created on first use keep their values across a restart.
    #[serde(default)]
    pub durable_caches: Option<bool>,
    pub subscriber_queue_capacity: Option<u32>,
    pub subscriber_queue_capacity_max: Option<u32>,
    pub subscriber_queue_bytes_max: Option<usize>,
    /// Streams kept in memory: how long a slow subscriber may hold its publishers, ms.
    pub publisher_hold_ms: Option<u64>,
    pub max_records_per_read: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenSection {
    pub token: String,
    pub tenant: Option<String>,
    pub principal: String,
    #[serde(default)]
    pub grants: Vec<GrantSection>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GrantSection {
    pub action: String,
    pub pattern: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StreamSection {
    pub tenant: String,
    pub namespace: String,
    pub name: String,
    #[serde(default = "yes")]
    pub durable: bool,
    #[serde(default = "one")]
    pub shards: u32,
    pub routing: Option<String>,
    pub retention: Option<RetentionSection>,
    pub queue_capacity: Option<u32>,
    /// Payload bytes of history kept in memory per shard (older history is read from disk).
    pub memory_bytes: Option<u64>,
    /// This stream's fsync policy: always | never | interval:MS (default: the broker's).
    pub fsync: Option<String>,
    /// `quorum`: in a cluster, every shard is replicated to `replication` brokers (default 3)
    /// and a write is acknowledged once a majority holds it. `disk` (the default for a
    /// durable stream) keeps a shard on its owner's disk only.
    pub durability: Option<String>,
    /// Replicas per shard of a `quorum` stream (1..=7; default 3). 1 means not replicated: one
    /// copy on its owner's disk, what `durability = "disk"` keeps.
    pub replication: Option<u32>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RetentionSection {
    pub max_records: Option<u64>,
    pub max_bytes: Option<u64>,
    pub max_age_secs: Option<u64>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CacheSection {
    pub tenant: String,
    pub namespace: String,
    pub name: String,
    /// Its values survive a restart (written before each change is answered).
    #[serde(default)]
    pub durable: bool,
    /// `quorum`: in a cluster, the cache's changes are the log of a Raft group over
    /// `replication` brokers (default 3), a write answered once a majority holds it.
    pub durability: Option<String>,
    /// Replicas of a `quorum` cache (1..=7; default 3). 1 means not replicated: its values
    /// kept on its owner's disk, as `durable = true` does.
    pub replication: Option<u32>,
}

/// A credential's grants (validated at parse time: an unknown action cannot reach here).
fn grants(sections: &[GrantSection]) -> Vec<Grant> {
    sections
        .iter()
        .filter_map(|g| Action::from_name(&g.action).map(|action| Grant { action, pattern: g.pattern.clone() }))
        .collect()
}

fn yes() -> bool {
    true
}
fn one() -> u32 {
    1
}

impl FileConfig {
    /// Reads and validates a configuration file.
    pub fn load(path: &Path) -> Result<FileConfig, String> {
        let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
        Self::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<FileConfig, String> {
        let cfg: FileConfig = toml::from_str(text).map_err(|e| e.to_string())?;
        for t in &cfg.tokens {
            if t.token.is_empty() {
                return Err(format!("token of principal {:?} is empty", t.principal));
            }
            for g in &t.grants {
                if Action::from_name(&g.action).is_none() {
                    return Err(format!(
                        "unknown action {:?} for principal {:?}: expected publish, subscribe, cache_read, cache_write, admin, group_consume or group_manage",
                        g.action, t.principal
                    ));
                }
            }
        }
        for c in &cfg.client_certs {
            if c.name.is_empty() || c.tenant.is_empty() {
                return Err(format!("client_certs of principal {:?}: name and tenant must not be empty", c.principal));
            }
            for g in &c.grants {
                if Action::from_name(&g.action).is_none() {
                    return Err(format!(
                        "unknown action {:?} for client certificate {:?}: expected publish, subscribe, cache_read, cache_write, admin, group_consume or group_manage",
                        g.action, c.name
                    ));
                }
            }
        }
        let mut limited = std::collections::BTreeSet::new();
        for l in &cfg.limits {
            if l.publish_records_per_s == Some(0) || l.publish_bytes_per_s == Some(0) {
                return Err(format!(
                    "limits for tenant {:?}: a rate of 0 would refuse everything; leave it out for no limit",
                    l.tenant
                ));
            }
            if l.publish_records_per_s.is_none()
                && l.publish_bytes_per_s.is_none()
                && l.max_connections.is_none()
                && l.max_streams_per_namespace.is_none()
                && l.max_subscriptions_per_connection.is_none()
                && l.max_retained_bytes_per_namespace.is_none()
                && l.max_queued_publish_bytes.is_none()
            {
                return Err(format!(
                    "limits for tenant {:?}: give at least one of publish_records_per_s, publish_bytes_per_s, max_connections, max_streams_per_namespace, max_subscriptions_per_connection, max_retained_bytes_per_namespace, max_queued_publish_bytes",
                    l.tenant
                ));
            }
            if l.max_connections == Some(0)
                || l.max_streams_per_namespace == Some(0)
                || l.max_subscriptions_per_connection == Some(0)
                || l.max_retained_bytes_per_namespace == Some(0)
                || l.max_queued_publish_bytes == Some(0)
            {
                return Err(format!("limits for tenant {:?}: a quota of 0 would refuse everything", l.tenant));
            }
            if let Some(ns) = &l.namespace
                && (l.max_connections.is_some()
                    || l.max_subscriptions_per_connection.is_some()
                    || l.max_queued_publish_bytes.is_some())
            {
                return Err(format!(
                    "limits for {}/{ns}: max_connections, max_subscriptions_per_connection and max_queued_publish_bytes are a tenant's, not a namespace's (leave namespace out)",
                    l.tenant
                ));
            }
            if !limited.insert((l.tenant.clone(), l.namespace.clone())) {
                return Err(match &l.namespace {
                    Some(ns) => format!("limits for namespace {}/{ns} given twice", l.tenant),
                    None => format!("limits for tenant {:?} given twice", l.tenant),
                });
            }
        }
        for s in &cfg.streams {
            if s.shards == 0 {
                return Err(format!("stream {}/{}: shards must be at least 1", s.namespace, s.name));
            }
            if let Some(r) = &s.routing
                && r != "modulo"
                && r != "jump_hash"
            {
                return Err(format!("stream {}/{}: routing {r:?}: expected modulo or jump_hash", s.namespace, s.name));
            }
            if let Some(f) = &s.fsync {
                f.parse::<felix_driver_tokio::FsyncMode>()
                    .map_err(|e| format!("stream {}/{}: fsync: {e}", s.namespace, s.name))?;
            }
            match s.durability.as_deref() {
                None | Some("disk") => {
                    if s.replication.is_some_and(|r| r > 1) {
                        return Err(format!(
                            "stream {}/{}: replication needs durability = \"quorum\"",
                            s.namespace, s.name
                        ));
                    }
                }
                Some("quorum") => {
                    if !s.durable {
                        return Err(format!(
                            "stream {}/{}: a quorum stream keeps a log: it cannot be durable = false",
                            s.namespace, s.name
                        ));
                    }
                    if let Some(r) = s.replication
                        && !(1..=7).contains(&r)
                    {
                        return Err(format!(
                            "stream {}/{}: replication {r}: expected 1..=7 (1: not replicated)",
                            s.namespace, s.name
                        ));
                    }
                }
                Some(other) => {
                    return Err(format!(
                        "stream {}/{}: durability {other:?}: expected disk or quorum",
                        s.namespace, s.name
                    ));
                }
            }
        }
        for c in &cfg.caches {
            match c.durability.as_deref() {
                None | Some("memory") | Some("disk") => {
                    if c.replication.is_some_and(|r| r > 1) {
                        return Err(format!(
                            "cache {}/{}: replication needs durability = \"quorum\"",
                            c.namespace, c.name
                        ));
                    }
                }
                Some("quorum") => {
                    if let Some(r) = c.replication
                        && !(1..=7).contains(&r)
                    {
                        return Err(format!(
                            "cache {}/{}: replication {r}: expected 1..=7 (1: not replicated)",
                            c.namespace, c.name
                        ));
                    }
                }
                Some(other) => {
                    return Err(format!(
                        "cache {}/{}: durability {other:?}: expected memory, disk or quorum",
                        c.namespace, c.name
                    ));
                }
            }
        }
        if let Some(r) = cfg.cluster.cache_replication
            && !(1..=7).contains(&r)
        {
            return Err(format!("cluster.cache_replication {r}: expected 1..=7"));
        }
        Ok(cfg)
    }

    /// The per-tenant publish rate limits.
    pub fn limits(&self) -> Vec<felix_proto::broker::TenantLimit> {
        self.limits
            .iter()
            .map(|l| felix_proto::broker::TenantLimit {
                tenant_id: l.tenant.clone(),
                namespace: l.namespace.clone(),
                records_per_s: l.publish_records_per_s,
                bytes_per_s: l.publish_bytes_per_s,
                max_connections: l.max_connections,
                max_streams_per_namespace: l.max_streams_per_namespace,
                max_subscriptions_per_connection: l.max_subscriptions_per_connection,
                max_retained_bytes_per_namespace: l.max_retained_bytes_per_namespace,
                max_queued_publish_bytes: l.max_queued_publish_bytes,
            })
            .collect()
    }

    pub fn tokens(&self) -> Vec<TokenGrant> {
        self.tokens
            .iter()
            .map(|t| TokenGrant {
                token: t.token.clone(),
                tenant_id: t.tenant.clone(),
                principal: t.principal.clone(),
                grants: grants(&t.grants),
            })
            .collect()
    }

    /// Client certificates as credentials (the certificate's name in `token`).
    pub fn client_certs(&self) -> Vec<TokenGrant> {
        self.client_certs
            .iter()
            .map(|c| TokenGrant {
                token: c.name.clone(),
                tenant_id: Some(c.tenant.clone()),
                principal: c.principal.clone(),
                grants: grants(&c.grants),
            })
            .collect()
    }

    pub fn streams(&self, default_queue: u32) -> Vec<StreamSpec> {
        self.streams
            .iter()
            .map(|s| StreamSpec {
                tenant_id: s.tenant.clone(),
                namespace: s.namespace.clone(),
                name: s.name.clone(),
                config: StreamConfig {
                    durable: s.durable,
                    shards: s.shards,
                    routing: if s.routing.as_deref() == Some("jump_hash") {
                        Routing::JumpHash
                    } else {
                        Routing::Modulo
                    },
                    retention: s.retention.as_ref().map_or(StreamConfig::default().retention, |r| Retention {
                        max_records: r.max_records,
                        max_bytes: r.max_bytes,
                        max_age: r.max_age_secs.map(Duration::from_secs),
                    }),
                    queue_capacity: s.queue_capacity.unwrap_or(default_queue),
                    memory_bytes: s.memory_bytes.unwrap_or(StreamConfig::default().memory_bytes),
                    fsync: s.fsync.as_deref().and_then(|f| f.parse::<felix_driver_tokio::FsyncMode>().ok()),
                    replication: if s.durability.as_deref() == Some("quorum") { s.replication.unwrap_or(3) } else { 1 },
                },
            })
            .collect()
    }

    pub fn caches(&self) -> Vec<CacheSpec> {
        self.caches
            .iter()
            .map(|c| CacheSpec {
                tenant_id: c.tenant.clone(),
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                // A quorum of one is the owner's disk alone.
                durable: c.durable
                    || c.durability.as_deref() == Some("disk")
                    || (c.durability.as_deref() == Some("quorum") && c.replication == Some(1)),
                replication: if c.durability.as_deref() == Some("quorum") { c.replication.unwrap_or(3) } else { 1 },
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// docs/felix.example.toml is accepted as it is, and says what it seems to.
    #[test]
    fn the_example_configuration_parses() {
        let cfg = FileConfig::parse(include_str!("../../docs/felix.example.toml")).unwrap();
        let streams = cfg.streams(1024);
        assert_eq!(streams.len(), 1);
        assert!(streams[0].config.durable && streams[0].config.shards == 4 && streams[0].config.replication == 1);
        assert!(cfg.caches()[0].durable);
        assert_eq!(cfg.limits()[0].records_per_s, Some(100_000));
    }

    #[test]
    fn the_documented_example_parses() {
        let doc = include_str!("config.rs");
        let example: String = doc
            .lines()
            .skip_while(|l| !l.contains("```toml"))
            .skip(1)
            .take_while(|l| !l.contains("```"))
            .map(|l| l.trim_start_matches("//!").trim_start_matches(' '))
            .collect::<Vec<_>>()
            .join("\n");
        let cfg = FileConfig::parse(&example).unwrap();
        assert_eq!(cfg.tokens().len(), 1);
        assert!(cfg.tokens()[0].allows(Action::Publish, "orders", "created"));
        assert!(!cfg.tokens()[0].allows(Action::CacheWrite, "orders", "created"));
        assert_eq!(cfg.streams(1024)[0].config.shards, 4);
        assert_eq!(cfg.caches().len(), 2);
        assert!(cfg.caches()[0].durable, "the example's cache is durable");
        assert_eq!(cfg.caches()[1].replication, 3, "and its second a quorum cache");
        let plain = FileConfig::parse("[[caches]]\ntenant = \"t\"\nnamespace = \"n\"\nname = \"c\"").unwrap();
        assert!(!plain.caches()[0].durable, "in memory unless asked");
        assert!(FileConfig::parse("[[caches]]\ntenant = \"t\"\nnamespace = \"n\"\nname = \"c\"\ndurable = 1").is_err());
    }

    #[test]
    fn the_cluster_section_takes_peers_as_one_string_or_a_list() {
        let c = FileConfig::parse(
            "[cluster]\nnode_id = \"n1\"\nlisten = \"127.0.0.1:7001\"\npeers = [\"n1=127.0.0.1:7001\", \"n2=127.0.0.1:7002\"]\nsecret = \"s\"",
        )
        .unwrap();
        assert_eq!(c.cluster.node_id.as_deref(), Some("n1"));
        assert_eq!(c.cluster.peers.unwrap().joined(), "n1=127.0.0.1:7001,n2=127.0.0.1:7002");
        let c = FileConfig::parse("[cluster]\npeers = \"n1=127.0.0.1:7001\"").unwrap();
        assert_eq!(c.cluster.peers.unwrap().joined(), "n1=127.0.0.1:7001");
        let e = FileConfig::parse("[cluster]\nnode = \"n1\"").unwrap_err();
        assert!(e.contains("unknown field") && e.contains("node"), "{e}");
    }

    #[test]
    fn bad_configs_are_clear_errors() {
        let e = FileConfig::parse("[broker]\nlisten_addr = \"x\"").unwrap_err();
        assert!(e.contains("unknown field") && e.contains("listen_addr"), "{e}");
        let e = FileConfig::parse(
            "[[tokens]]\ntoken = \"t\"\nprincipal = \"p\"\ngrants = [{action = \"fly\", pattern = \"*\"}]",
        )
        .unwrap_err();
        assert!(e.contains("unknown action \"fly\""), "{e}");
        let e =
            FileConfig::parse("[[streams]]\ntenant = \"t\"\nnamespace = \"n\"\nname = \"s\"\nshards = 0").unwrap_err();
        assert!(e.contains("shards must be at least 1"), "{e}");
        let stream = |extra: &str| format!("[[streams]]\ntenant = \"t\"\nnamespace = \"n\"\nname = \"s\"\n{extra}");
        let e = FileConfig::parse(&stream("durability = \"raid\"")).unwrap_err();
        assert!(e.contains("durability \"raid\": expected disk or quorum"), "{e}");
        let e = FileConfig::parse(&stream("replication = 3")).unwrap_err();
        assert!(e.contains("replication needs durability = \"quorum\""), "{e}");
        let e = FileConfig::parse(&stream("durability = \"quorum\"\nreplication = 9")).unwrap_err();
        assert!(e.contains("replication 9: expected 1..=7"), "{e}");
        let one = FileConfig::parse(&stream("durability = \"quorum\"\nreplication = 1")).unwrap();
        let one = &one.streams(1024)[0].config;
        assert!(one.replication == 1 && one.durable, "replication 1 is one copy on the owner's disk");
        let e = FileConfig::parse(&stream("durability = \"quorum\"\ndurable = false")).unwrap_err();
        assert!(e.contains("cannot be durable = false"), "{e}");
        let q = FileConfig::parse(&stream("durability = \"quorum\"")).unwrap();
        assert_eq!(q.streams(1024)[0].config.replication, 3, "quorum defaults to three replicas");
        let cache = |extra: &str| format!("[[caches]]\ntenant = \"t\"\nnamespace = \"n\"\nname = \"c\"\n{extra}");
        let e = FileConfig::parse(&cache("replication = 3")).unwrap_err();
        assert!(e.contains("cache n/c: replication needs durability = \"quorum\""), "{e}");
        let e = FileConfig::parse(&cache("durability = \"quorum\"\nreplication = 0")).unwrap_err();
        assert!(e.contains("replication 0: expected 1..=7 (1: not replicated)"), "{e}");
        let one = FileConfig::parse(&cache("durability = \"quorum\"\nreplication = 1")).unwrap();
        assert!(one.caches()[0].replication == 1 && one.caches()[0].durable, "a quorum of one is the owner's disk");
        let e = FileConfig::parse(&cache("durability = \"paper\"")).unwrap_err();
        assert!(e.contains("durability \"paper\": expected memory, disk or quorum"), "{e}");
        let q = FileConfig::parse(&cache("durability = \"quorum\"")).unwrap();
        assert_eq!(q.caches()[0].replication, 3, "a quorum cache defaults to three replicas");
        let d = FileConfig::parse(&cache("durability = \"disk\"")).unwrap();
        assert!(d.caches()[0].durable && d.caches()[0].replication == 1, "disk is durable = true");
        let e = FileConfig::parse("[cluster]\ncache_replication = 8").unwrap_err();
        assert!(e.contains("cache_replication 8: expected 1..=7"), "{e}");
        let c = FileConfig::parse("[[limits]]\ntenant = \"t1\"\npublish_records_per_s = 100").unwrap();
        assert_eq!(c.limits()[0].records_per_s, Some(100));
        let c = FileConfig::parse(
            "[[limits]]\ntenant = \"t1\"\nmax_subscriptions_per_connection = 8\nmax_retained_bytes_per_namespace = 1073741824\nmax_queued_publish_bytes = 8388608",
        )
        .unwrap();
        let c2 = FileConfig::parse(
            "[[limits]]\ntenant = \"t1\"\npublish_records_per_s = 1000\n[[limits]]\ntenant = \"t1\"\nnamespace = \"slow\"\npublish_records_per_s = 10",
        )
        .unwrap();
        let ls = c2.limits();
        assert_eq!((ls[0].namespace.as_deref(), ls[1].namespace.as_deref()), (None, Some("slow")));
        let l = &c.limits()[0];
        assert_eq!(
            (l.max_subscriptions_per_connection, l.max_retained_bytes_per_namespace, l.max_queued_publish_bytes),
            (Some(8), Some(1 << 30), Some(8 << 20))
        );
        for bad in [
            "[[limits]]\ntenant = \"t1\"\npublish_records_per_s = 0",
            "[[limits]]\ntenant = \"t1\"",
            "[[limits]]\ntenant = \"t1\"\npublish_bytes_per_s = 5\n[[limits]]\ntenant = \"t1\"\npublish_bytes_per_s = 6",
            "[[limits]]\ntenant = \"t1\"\npublish_records_per_s = -1",
            "[[limits]]\ntenant = \"t1\"\nmax_queued_publish_bytes = 0",
            "[[limits]]\ntenant = \"t1\"\nmax_retained_bytes_per_namespace = 0",
            "[[limits]]\ntenant = \"t1\"\nmax_subscriptions_per_connection = 0",
            "[[limits]]\ntenant = \"t1\"\nmax_retained_bytes = 5",
            "[[limits]]\ntenant = \"t1\"\nnamespace = \"n\"\nmax_connections = 5",
            "[[limits]]\ntenant = \"t1\"\nnamespace = \"n\"\npublish_records_per_s = 5\n[[limits]]\ntenant = \"t1\"\nnamespace = \"n\"\npublish_records_per_s = 6",
        ] {
            assert!(FileConfig::parse(bad).is_err(), "{bad}");
        }
        let c = FileConfig::parse(
            "[tls]\nclient_ca = \"ca.pem\"\n[[client_certs]]\nname = \"svc\"\ntenant = \"t1\"\nprincipal = \"p\"\ngrants = [{action = \"publish\", pattern = \"*\"}]",
        )
        .unwrap();
        let g = &c.client_certs()[0];
        assert_eq!((g.token.as_str(), g.tenant_id.as_deref()), ("svc", Some("t1")));
        assert!(g.allows(Action::Publish, "a", "b") && !g.allows(Action::Subscribe, "a", "b"));
        let e = FileConfig::parse(
            "[tls]\nclient_ca = \"ca.pem\"\n[[client_certs]]\nname = \"\"\ntenant = \"t1\"\nprincipal = \"p\"",
        )
        .unwrap_err();
        assert!(e.contains("must not be empty"), "{e}");
        let e = FileConfig::parse("[broker\n").unwrap_err();
        assert!(e.contains("line 1") || e.contains("TOML"), "{e}");
        let e = FileConfig::parse("[broker]\npublish_window = -1").unwrap_err();
        assert!(!e.is_empty());
    }
}
