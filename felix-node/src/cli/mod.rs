//! The command line as clap reads it: every subcommand and its flags, with the help text
//! `--help` prints.

use crate::{bench, commands, soak, tokens};
use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;

mod cluster;
pub(crate) use cluster::*;
mod ops;
pub(crate) use ops::*;

/// Felix: a QUIC pub/sub and cache broker.
///
/// Start a broker with `felix-node serve` (no flags needed: it listens on 127.0.0.1:5000, keeps
/// data in ./felix-data, generates a TLS certificate and a development token on first start).
/// From the same directory the client commands find both automatically.
///
/// Logs go to standard error; RUST_LOG sets what is logged (default `warn,felix=info`: failed
/// logins, brokers joining and leaving, elections; `RUST_LOG=debug` for more). Durations take a
/// unit: 500ms, 10s, 5m, 2h, 1d. Ctrl-C ends a command with exit code 130.
#[derive(Parser, Debug)]
#[command(
    name = "felix-node",
    version,
    about,
    long_about,
    after_help = "Logs: RUST_LOG (default warn,felix=info). Durations: 500ms, 10s, 5m, 2h, 1d."
)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Threads of the async runtime (default: one per core; `serve` on a machine of 2 cores or
    /// fewer: 1). On a small machine shared with its clients, 1 halves the broker's CPU per
    /// record at moderate rates and its tail latency (docs/benchmarks.md); more help many
    /// connections on many cores.
    #[arg(long, global = true, env = "FELIX_WORKER_THREADS",
        value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub(crate) worker_threads: Option<u16>,
}

#[derive(Subcommand, Debug)]
pub(crate) enum Command {
    /// Run a broker.
    #[command(
        after_help = "Logs go to standard error; RUST_LOG sets what is logged (default warn,felix=info).\nEvery flag has the FELIX_* variable named after it (--http is FELIX_HTTP)."
    )]
    Serve(Box<ServeArgs>),
    /// Start a broker in-process on a free port and show publish, subscribe, replay and cache
    /// (`--cluster`: three brokers forming a cluster, with routing, forwards and a redirect).
    Demo {
        /// Three brokers on loopback forming a cluster instead of one.
        #[arg(long)]
        cluster: bool,
    },
    /// Publish messages: the arguments, the lines of --file, or the lines of standard input.
    Publish(PublishArgs),
    /// Subscribe to a stream (every shard, or --shard) and print what arrives (Ctrl-C to stop).
    Subscribe(SubscribeArgs),
    /// Read a range of a durable stream without subscribing (pages of FEATURE_STREAM_READ).
    Read(ReadArgs),
    /// Cache operations.
    Cache(CacheArgs),
    /// Durable counters (brokers with storage): add a delta, read a sum.
    Counter(CounterArgs),
    /// The cluster: members, leader, every shard's owner and generation.
    Cluster(ClusterArgs),
    /// Signed tokens: make a signing key and its JWK set, mint tokens.
    Token(tokens::TokenArgs),
    /// Stream administration: delete a stream and everything it holds (admin permission).
    Stream(StreamArgs),
    /// Consumer groups: poll, ack, nack, describe, seek, dead letters, redrive, delete.
    Group(GroupArgs),
    /// Consume a stream through a consumer group: poll, print, ack, until Ctrl-C.
    Consume(ConsumeArgs),
    /// Run the deterministic fault simulation (broker, clients and storage in memory; lost
    /// connections, failed and late writes, crashes) over many seeds, checking every invariant.
    /// A failure prints its seed; `--seed N` replays exactly that run.
    Sim(SimArgs),
    /// Soak a real broker process: many connections churning (connect, subscribe, publish,
    /// leave, some abruptly) for a while; checks RSS stays flat, leak gauges return to
    /// baseline and p99 stays stable.
    Soak(soak::SoakArgs),
    /// Measure publish→deliver throughput and latency, and cache operations.
    Bench(bench::BenchArgs),
    /// Print a shell completion script, e.g. `felix-node completions bash >
    /// ~/.local/share/bash-completion/completions/felix-node` (zsh: into a directory of
    /// `$fpath` as `_felix-node`; fish: `~/.config/fish/completions/felix-node.fish`).
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Write man pages: `felix-node.1` and one per subcommand (`felix-node-serve.1`, ...) into
    /// --out, or print the main page (`felix-node man | man -l -`).
    Man {
        /// A directory to write every page into (created if missing).
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Check conformance vectors byte for byte, or (with --addr) a running broker's behaviour.
    ///
    /// Vectors: for each NAME.json + NAME.hex pair the frame is decoded and compared with what
    /// the JSON says it means, then re-encoded and compared with the bytes. One line per failure.
    ///
    /// --addr: behavioural checks over QUIC against any broker (negotiation rows, legacy frames,
    /// error codes only when offered, unknown flags and types, malformed acked publishes,
    /// oversize frames), one line per check.
    ///
    /// Vectors end with `N passed, M failed`; --addr with `N passed, M failed, K skipped` (a
    /// check about a feature the broker does not advertise is skipped, not passed). Both exit
    /// non-zero on any failure.
    Conformance {
        /// Directories holding vectors (default: ./vectors).
        dirs: Vec<PathBuf>,
        /// Also print a line for every vector that passes.
        #[arg(short, long)]
        verbose: bool,
        /// Check a running broker at this address instead of vectors.
        #[arg(long)]
        addr: Option<SocketAddr>,
        /// Tenant for --addr.
        #[arg(long, default_value = "conformance")]
        tenant: String,
        /// Token for --addr (default: the dev token in --data-dir).
        #[arg(long)]
        token: Option<String>,
        /// The broker's certificate for --addr (default: the one in --data-dir).
        #[arg(long)]
        ca: Option<PathBuf>,
        /// Where a local broker keeps its certificate and dev token.
        #[arg(long, default_value = "./felix-data")]
        data_dir: PathBuf,
        /// Name the broker's certificate must hold.
        #[arg(long, default_value = "localhost")]
        server_name: String,
        /// Accept any certificate (development only).
        #[arg(long)]
        insecure_accept_any_certificate: bool,
        /// ALPN to offer for --addr: auto (felix/1, then none if the broker refuses it),
        /// felix/1, or none.
        #[arg(long, default_value = "auto")]
        alpn: felix_driver_tokio::tls::AlpnOffer,
    },
}

#[derive(Args, Debug)]
pub(crate) struct ServeArgs {
    /// A TOML configuration file (tokens, streams, caches, limits; see docs/operations.md).
    /// Flags and FELIX_* variables override it.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_CONFIG")]
    pub(crate) config: Option<PathBuf>,
    /// UDP address to listen on [default: 127.0.0.1:5000].
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_LISTEN")]
    pub(crate) listen: Option<SocketAddr>,
    /// Where durable streams, the TLS certificate and the dev token live [default: ./felix-data].
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_DATA_DIR")]
    pub(crate) data_dir: Option<PathBuf>,
    /// Development token (valid for any tenant, every permission). Default: generated on first
    /// start and stored in the data directory.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_DEV_TOKEN")]
    pub(crate) dev_token: Option<String>,
    /// When appends reach the disk, for durable streams and replicated shards alike: always
    /// (acknowledged only once on disk, group commit), or a lazy interval:MILLISECONDS or never
    /// that a power cut can take acknowledged records back from (docs/storage.md) [default: always].
    #[arg(help_heading = "Storage", long, env = "FELIX_FSYNC")]
    pub(crate) fsync: Option<felix_driver_tokio::FsyncMode>,
    /// Auto-created streams keep no history (no offsets, nothing on disk).
    #[arg(help_heading = "Storage", long, env = "FELIX_EPHEMERAL")]
    pub(crate) ephemeral: bool,
    /// Caches created on first use keep their values across a restart: every change is written
    /// (on the --fsync policy) before it is answered. Without it they live in memory only;
    /// `[[caches]] durable = true` makes one named cache durable.
    #[arg(help_heading = "Storage", long, env = "FELIX_DURABLE_CACHES")]
    pub(crate) durable_caches: bool,
    /// Pipelined-publish window per stream, 0 disables pipelining [default: 256].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_PUBLISH_WINDOW")]
    pub(crate) publish_window: Option<u32>,
    /// Largest frame payload accepted after authentication, in bytes [default: 16 MiB].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_MAX_FRAME_BYTES")]
    pub(crate) max_frame_bytes: Option<u32>,
    /// Answer every acked publish only after its write, with offsets.
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_ACK_ON_COMMIT")]
    pub(crate) ack_on_commit: bool,
    /// Answer not_found for streams and caches that do not exist instead of creating them.
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_NO_AUTO_CREATE")]
    pub(crate) no_auto_create: bool,
    /// Default subscriber queue capacity, in published batches [default: 4096].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_QUEUE_CAPACITY")]
    pub(crate) queue_capacity: Option<u32>,
    /// Bytes one subscriber's queue may hold, whatever its capacity in batches; past it a
    /// slow subscriber's batches are dropped [default: 256 MiB].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_QUEUE_BYTES_MAX")]
    pub(crate) queue_bytes_max: Option<usize>,
    /// Streams kept in memory: how long publishers may be held (not read) for a subscriber
    /// whose queue is over half full before it is left behind to drop, ms; 0 drops at once
    /// [default: 1000].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_PUBLISHER_HOLD_MS")]
    pub(crate) publisher_hold_ms: Option<u64>,
    /// Consumer groups: claim duration when a poll names none, ms [default: 30000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_VISIBILITY_MS")]
    pub(crate) group_visibility_ms: Option<u64>,
    /// Consumer groups: longest claim, extension or nack delay, ms [default: 43200000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_VISIBILITY_MS")]
    pub(crate) group_max_visibility_ms: Option<u64>,
    /// Consumer groups: longest long poll, ms [default: 30000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_WAIT_MS")]
    pub(crate) group_max_wait_ms: Option<u64>,
    /// Consumer groups: deliveries before a record is dead-lettered [default: 5].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_ATTEMPTS")]
    pub(crate) group_max_attempts: Option<u32>,
    /// Consumer groups: records handed out and unsettled per group per shard [default: 10000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_IN_FLIGHT")]
    pub(crate) group_max_in_flight: Option<usize>,
    /// Auto-created streams keep at most this many records per shard [default: 1000000].
    #[arg(help_heading = "Storage", long, env = "FELIX_RETENTION_RECORDS")]
    pub(crate) retention_records: Option<u64>,
    /// Auto-created durable streams keep this many payload bytes of history per shard in
    /// memory; older history is read from disk [default: 64 MiB].
    #[arg(help_heading = "Storage", long, env = "FELIX_MEMORY_BYTES")]
    pub(crate) memory_bytes: Option<u64>,
    /// Most records one stream_read page returns [default: 1000].
    #[arg(help_heading = "Storage", long, env = "FELIX_MAX_RECORDS_PER_READ")]
    pub(crate) max_records_per_read: Option<u32>,
    /// Refuse clients that offer no ALPN (existing clients offer none).
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_REQUIRE_ALPN")]
    pub(crate) require_alpn: bool,
    /// A control stream must authenticate within this many milliseconds or is ended
    /// (`unauthenticated`); its connection stays [default: 10000].
    #[arg(help_heading = "Admission", long, env = "FELIX_AUTH_TIMEOUT_MS")]
    pub(crate) auth_timeout_ms: Option<u64>,
    /// Connections that authenticated no stream yet, in all; past it, one unauthenticated for
    /// longer than the auth timeout is closed to make room, else the new one is refused
    /// [default: 1024].
    #[arg(help_heading = "Admission", long, env = "FELIX_MAX_UNAUTHENTICATED_CONNECTIONS")]
    pub(crate) max_unauthenticated_connections: Option<usize>,
    /// Connections that authenticated no stream yet, per client address [default: 64].
    #[arg(help_heading = "Admission", long, env = "FELIX_MAX_UNAUTHENTICATED_PER_ADDRESS")]
    pub(crate) max_unauthenticated_per_address: Option<usize>,
    /// Serve Prometheus metrics over HTTP on this TCP address (off by default). With a cluster,
    /// `GET /cluster` there answers the cluster's state (`felix-node cluster status`).
    #[arg(help_heading = "Observability", long, env = "FELIX_METRICS_LISTEN")]
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// Serve the operator web view on this TCP address (off by default): brokers, shards and
    /// their owners, replica lag, moves in progress, the subscriptions served here; read-only,
    /// refreshed every 2 s. Open http://ADDR/?token=TOKEN (the banner prints the address).
    #[arg(help_heading = "Observability", long, env = "FELIX_HTTP")]
    pub(crate) http: Option<SocketAddr>,
    /// The web view's token [default: the dev token; without one, --http needs this].
    #[arg(help_heading = "Observability", long, env = "FELIX_HTTP_TOKEN", hide_env_values = true)]
    pub(crate) http_token: Option<String>,
    /// Shards of a stream created on first use (1..=4096) [default: 1]. Keyed records spread over them by
    /// key; in a cluster the shards are spread over the brokers.
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_DEFAULT_SHARDS", value_parser = clap::value_parser!(u32).range(1..=4096))]
    pub(crate) default_shards: Option<u32>,
    /// In a cluster: replicas per shard of a durable stream created on first use (1..=7)
    /// [default: 1]. 3 makes each shard a Raft group over three brokers (`quorum` durability):
    /// a write is acknowledged once two hold it, and the shard fails over when one dies.
    #[arg(help_heading = "Cluster", long, env = "FELIX_DEFAULT_REPLICATION", value_parser = clap::value_parser!(u32).range(1..=7))]
    pub(crate) default_replication: Option<u32>,
    /// In a cluster: replicas of a cache created on first use (1..=7) [default: 1]. 3 makes the
    /// cache's changes the log of a Raft group over three brokers: a write is answered once two
    /// hold it, and values, versions and watch offsets survive the loss of one.
    #[arg(help_heading = "Cluster", long, env = "FELIX_CACHE_REPLICATION", value_parser = clap::value_parser!(u32).range(1..=7))]
    pub(crate) cache_replication: Option<u32>,
    /// Join a cluster as this node id (with --cluster-listen and --peers). Without it the broker
    /// runs alone, as always.
    #[arg(help_heading = "Cluster", long, env = "FELIX_NODE_ID")]
    pub(crate) node_id: Option<String>,
    /// On SIGTERM or Ctrl-C: how long to finish what is in flight (writes not yet on disk,
    /// forwards not yet answered) before stopping; meanwhile no new work is taken (new
    /// connections refused, new control streams answered `draining`). A second signal stops at
    /// once.
    #[arg(help_heading = "Admission", long, env = "FELIX_DRAIN_GRACE", value_parser = commands::parse_duration, default_value = "10s")]
    pub(crate) drain_grace: std::time::Duration,
    /// Trust signed tokens (JWT, EdDSA) whose key is in this JWK set (`felix-node token keygen`
    /// makes one), besides the static tokens. Also `[auth] jwks`, with `issuer` and `audience`.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_JWKS")]
    pub(crate) jwks: Option<std::path::PathBuf>,
    /// The broker's TLS certificate chain (PEM), for a certificate an operator issued
    /// [default: DATA_DIR/tls/cert.pem, self-signed and generated on first start]. With
    /// --tls-key; clients then trust it with --ca (its CA, or the chain itself).
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_TLS_CERT", requires = "tls_key")]
    pub(crate) tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_TLS_KEY", requires = "tls_cert")]
    pub(crate) tls_key: Option<std::path::PathBuf>,
    /// A cluster's certificate authority: a directory holding `ca.pem` and `ca.key` (made by
    /// `felix-node cluster init-ca`, or here by the first broker given an empty or missing
    /// one). The broker's certificate is issued by it, so clients trust every broker with
    /// one file: `--ca DIR/ca.pem`. Every broker of the cluster is given the same CA (copy
    /// the directory to each host). Also `[tls] cluster_ca`.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_CLUSTER_CA", conflicts_with = "tls_cert")]
    pub(crate) cluster_ca: Option<std::path::PathBuf>,
    /// Mutual TLS: ask clients for a certificate and verify it against these CA certificates
    /// (PEM). A verified certificate authenticates an `auth` with an empty token as the
    /// `[[client_certs]]` entry naming it (its subject CN or a subject alternative name);
    /// clients without one still authenticate with tokens. Also `[tls] client_ca`.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_TLS_CLIENT_CA")]
    pub(crate) tls_client_ca: Option<std::path::PathBuf>,
    /// Join a running cluster (after an operator's `felix-node cluster add`) instead of
    /// founding one: --peers then lists the members it knows of. Every broker added after the
    /// cluster first started runs with --join; only the founding brokers go without it.
    #[arg(help_heading = "Cluster", long, env = "FELIX_JOIN")]
    pub(crate) join: bool,
    /// Cluster: bytes of its Raft log each replica of a replicated shard keeps in memory once
    /// applied; older entries are read back from its log files when a follower behind or a
    /// reader needs them [default: 8388608 (8 MiB)].
    #[arg(help_heading = "Cluster", long, env = "FELIX_REPLICA_ENTRY_CACHE")]
    pub(crate) replica_entry_cache: Option<u64>,
    /// Cluster: the most bytes a second that moves copy to and from this broker (a durable
    /// shard's copy, a replicated shard's log sent to a broker joining its group), so that a
    /// rebalance, a drain or an operator's moves leave publishers their share. Like 50MB/s,
    /// 20MiB/s or 1G (decimal and binary units, bytes). A move slower than its shard is
    /// written to never finishes: size it above the busiest moving shard's write rate
    /// [default: unlimited]. Also `[cluster] move_bandwidth`.
    #[arg(help_heading = "Cluster", long, env = "FELIX_MOVE_BANDWIDTH", value_parser = commands::parse_byte_rate)]
    pub(crate) move_bandwidth: Option<u64>,
    /// Cluster: compact the metadata Raft log into a snapshot of the metadata once it holds
    /// this many entries past the last one, so a restart replays, and a broker added later is
    /// sent, a snapshot and a short log rather than everything since the cluster began. 0:
    /// never [default: 10000]. Also `[cluster] metadata_snapshot_entries`.
    #[arg(help_heading = "Cluster", long, env = "FELIX_METADATA_SNAPSHOT_ENTRIES")]
    pub(crate) metadata_snapshot_entries: Option<u64>,
    /// Where this broker listens for the other brokers (never the client listener).
    #[arg(help_heading = "Cluster", long, env = "FELIX_CLUSTER_LISTEN")]
    pub(crate) cluster_listen: Option<SocketAddr>,
    /// Every broker of the cluster, this one included: ID=HOST:PORT of each cluster listener,
    /// comma-separated (the same list on every broker).
    #[arg(help_heading = "Cluster", long, env = "FELIX_PEERS", value_parser = commands::parse_peers)]
    pub(crate) peers: Option<commands::Peers>,
    /// The secret the brokers of the cluster share; a broker that does not know it is refused.
    /// [default: a development secret, with a warning]
    #[arg(help_heading = "Cluster", long, env = "FELIX_CLUSTER_SECRET", hide_env_values = true)]
    pub(crate) cluster_secret: Option<String>,
    /// The cluster's name: brokers of another cluster are refused [default: felix].
    #[arg(help_heading = "Cluster", long, env = "FELIX_CLUSTER_NAME")]
    pub(crate) cluster_name: Option<String>,
    /// The client address this broker gives clients (redirects, topology) [default: --listen].
    #[arg(help_heading = "Cluster", long, env = "FELIX_ADVERTISE")]
    pub(crate) advertise: Option<String>,
    /// Concurrent bidirectional streams (control and cache streams) a client may open. Past it
    /// a client waits for QUIC to grant more as its streams end; nothing fails. A connection
    /// starts with 8 and is granted more as it uses them (QUIC keeps a table entry per stream
    /// allowed, so an idle connection costs the same whatever this is; docs/benchmarks.md).
    /// At least 8: a client holds a few long-lived streams (requests, long polls) and needs
    /// room beside them to ask for a subscription.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_MAX_STREAMS", default_value_t = 128,
        value_parser = clap::value_parser!(u32).range(8..))]
    pub(crate) max_streams: u32,
    /// Concurrent unidirectional (publish-only) streams a client may open (2 at first, more
    /// as it uses them). Felix's own clients open none: they publish on control streams.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_MAX_UNI_STREAMS", default_value_t = 32)]
    pub(crate) max_uni_streams: u32,
    /// Per-stream QUIC receive window, bytes.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_STREAM_RECEIVE_WINDOW", default_value_t = 8 << 20)]
    pub(crate) stream_receive_window: u32,
    /// Per-connection QUIC receive window, bytes.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_RECEIVE_WINDOW", default_value_t = 32 << 20)]
    pub(crate) receive_window: u32,
    /// UDP socket buffers to ask the kernel for, bytes (capped by net.core.rmem_max/wmem_max).
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_UDP_BUFFER_BYTES", default_value_t = 4 << 20)]
    pub(crate) udp_buffer_bytes: usize,
    /// Close connections idle this long, milliseconds.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_IDLE_TIMEOUT_MS", default_value_t = 30_000)]
    pub(crate) idle_timeout_ms: u64,
    /// Largest UDP payload MTU discovery may reach, bytes (1200..=65527). Discovery settles on
    /// what the path carries (about 1452 on Ethernet); loopback peers get it from the first
    /// packet. Above 6550 the kernel refuses segmentation-offload batches (docs/operations.md).
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_MAX_UDP_PAYLOAD", default_value_t = felix_driver_tokio::DEFAULT_MAX_UDP_PAYLOAD,
        value_parser = clap::value_parser!(u16).range(1200..=65527))]
    pub(crate) max_udp_payload: u16,
}

/// How a client command reaches the broker.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Connection (every client command)")]
pub struct ConnectArgs {
    /// Broker address (HOST:PORT, a name or an IP address); several, comma-separated, for a
    /// cluster (the first that answers is used, and requests follow redirects to the owner of
    /// their shard).
    #[arg(long, global = true, env = "FELIX_ADDR", default_value = "127.0.0.1:5000", value_parser = commands::parse_addrs)]
    pub(crate) addr: commands::Addrs,
    /// Tenant.
    #[arg(long, global = true, env = "FELIX_TENANT", default_value = "default")]
    pub(crate) tenant: String,
    /// Token (default: the dev token in --data-dir).
    #[arg(long, global = true, env = "FELIX_TOKEN")]
    pub(crate) token: Option<String>,
    /// The broker's certificate (default: the one in --data-dir).
    #[arg(long, global = true, env = "FELIX_CA")]
    pub(crate) ca: Option<PathBuf>,
    /// Where a local broker keeps its certificate and dev token.
    #[arg(long, global = true, env = "FELIX_DATA_DIR", default_value = "./felix-data")]
    pub(crate) data_dir: PathBuf,
    /// Name the broker's certificate must hold [default: the host name of --addr, or localhost
    /// for an IP address].
    #[arg(long, global = true, env = "FELIX_SERVER_NAME")]
    pub(crate) server_name: Option<String>,
    /// Accept any certificate. For development only: the broker's identity is not checked.
    #[arg(long, global = true)]
    pub(crate) insecure_accept_any_certificate: bool,
    /// A client certificate (PEM chain) to present to a broker that asks for one (mutual TLS);
    /// with it, no token is needed where the broker maps the certificate to a credential.
    #[arg(long, global = true, env = "FELIX_CERT", requires = "cert_key")]
    pub(crate) cert: Option<PathBuf>,
    /// The private key (PEM) of --cert (`--key` is a publish's routing key).
    #[arg(long, global = true, env = "FELIX_CERT_KEY", requires = "cert")]
    pub(crate) cert_key: Option<PathBuf>,
    /// Namespace.
    #[arg(long, short = 'n', global = true, default_value = "default")]
    pub(crate) namespace: String,
    /// ALPN to offer: auto (felix/1, and none if the broker refuses it: released Felix brokers
    /// know no ALPN id), felix/1 (a broker that requires it), or none (as existing clients).
    #[arg(long, global = true, env = "FELIX_ALPN", default_value = "auto")]
    pub(crate) alpn: felix_driver_tokio::tls::AlpnOffer,
    /// How long to wait for a broker to answer a connection (e.g. 5s, 500ms) before saying it
    /// does not; with several --addr, for each.
    #[arg(long, global = true, env = "FELIX_CONNECT_TIMEOUT", default_value = "5s", value_parser = commands::parse_duration)]
    pub(crate) connect_timeout: std::time::Duration,
    /// On exit, how long to wait for the broker to confirm it received everything written
    /// (e.g. 10s, 500ms); past it the command says what may not have been delivered.
    #[arg(long, global = true, env = "FELIX_CLOSE_TIMEOUT", default_value = "10s", value_parser = commands::parse_duration)]
    pub(crate) close_timeout: std::time::Duration,
}

#[derive(Args, Debug)]
pub(crate) struct PublishArgs {
    /// Stream to publish to.
    #[arg(value_parser = commands::parse_name)]
    pub(crate) stream: String,
    /// Messages (each one record). Without any, lines of --file or of standard input.
    pub(crate) payloads: Vec<String>,
    /// Read messages from this file, one per line.
    #[arg(long, short = 'f')]
    pub(crate) file: Option<PathBuf>,
    /// Routing key.
    #[arg(long, short = 'k')]
    pub(crate) key: Option<String>,
    /// Wait for the broker's acknowledgement of each batch: it comes once the batch is stored
    /// (written, per the stream's fsync policy), with its offset.
    #[arg(long)]
    pub(crate) ack: bool,
    /// The faster mode (implies --ack): a batch may be acknowledged once the broker queued it
    /// for storage, before the write; such an acknowledgement survives neither a broker crash
    /// nor a failed write (docs/operations.md, "What an acknowledgement promises").
    #[arg(long)]
    pub(crate) ack_on_enqueue: bool,
    /// Exactly once (implies --ack): publish as an idempotent producer, so a batch resent after
    /// a lost answer or a reconnect is appended once. Batches are pipelined (up to 64 per shard
    /// unanswered).
    #[arg(long, conflicts_with = "ack_on_enqueue")]
    pub(crate) idempotent: bool,
    /// Records per batch when reading lines.
    #[arg(long, default_value_t = 64)]
    pub(crate) batch: usize,
    /// When reading lines: send a batch that is not full once no line came for this long
    /// (e.g. 5ms, 100ms), so `tail -f app.log | felix-node publish logs` sends as lines come.
    /// On Ctrl-C or SIGTERM what was read is sent (and acknowledged, with --ack) before the
    /// command exits with 130.
    #[arg(long, default_value = "5ms", value_parser = commands::parse_duration)]
    pub(crate) linger: std::time::Duration,
    /// Compress each batch with this codec (zstd or lz4), when the broker takes it and the
    /// batch shrinks; it is stored and sent on compressed (docs/protocol.md, D56).
    #[arg(long, value_parser = commands::parse_codec)]
    pub(crate) compress: Option<felix_proto::Codec>,
    /// Compression level with --compress: zstd 1–19 (default 3); lz4 has one level.
    #[arg(long, requires = "compress", allow_negative_numbers = true)]
    pub(crate) level: Option<i32>,
    /// Encrypt each record end to end with AES-256-GCM under the last key of this file (lines
    /// `KEY_ID HEX`, 32-byte keys); the broker stores ciphertext and the key id (D58).
    #[arg(long, conflicts_with = "idempotent")]
    pub(crate) encrypt_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}

#[derive(Args, Debug)]
pub(crate) struct SubscribeArgs {
    /// Stream to read.
    #[arg(value_parser = commands::parse_name)]
    pub(crate) stream: String,
    /// Where to start: earliest, latest, or an offset.
    #[arg(long, default_value = "latest", conflicts_with = "since")]
    pub(crate) from: String,
    /// Start with the first record appended this long ago or later (e.g. 90s, 10m, 2h, 1d),
    /// found with offset_for_time. Durable streams only.
    #[arg(long, value_parser = commands::parse_duration)]
    pub(crate) since: Option<std::time::Duration>,
    /// Shard to read [default: every shard of the stream, merged; lines then read
    /// SHARD/OFFSET].
    #[arg(long)]
    pub(crate) shard: Option<u32>,
    /// Print one JSON object per event (shard, offset, payload as text or base64).
    #[arg(long)]
    pub(crate) json: bool,
    /// Stop after this many events.
    #[arg(long)]
    pub(crate) count: Option<u64>,
    /// Exit when the subscription ends (this subscriber fell behind, its shard moved or failed
    /// over, its broker went away) instead of subscribing again, wherever the shard is served
    /// now, right after the last event printed (no gap, no duplicate; retried for up to a
    /// minute).
    #[arg(long)]
    pub(crate) no_resume: bool,
    /// Only records published with this key (repeatable; with --key-prefix, either matches).
    /// Filtered at the broker: the rest never crosses the network (docs/protocol.md, D57).
    #[arg(long = "key", value_name = "KEY")]
    pub(crate) keys: Vec<String>,
    /// Only records whose key starts with this (repeatable).
    #[arg(long = "key-prefix", value_name = "PREFIX")]
    pub(crate) key_prefixes: Vec<String>,
    /// Decrypt end-to-end encrypted records with the keys of this file (lines `KEY_ID HEX`;
    /// several for rotated keys): each batch names the key it was sealed with (D58).
    #[arg(long)]
    pub(crate) encrypt_key_file: Option<PathBuf>,
    /// The keys read from --encrypt-key-file.
    #[arg(skip)]
    pub(crate) keyring: Option<std::sync::Arc<felix_driver_tokio::envelope::KeyRing>>,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}

impl SubscribeArgs {
    /// The filter `--key` and `--key-prefix` make, if either was given.
    pub(crate) fn filter(&self) -> Option<felix_proto::message::KeyFilter> {
        if self.keys.is_empty() && self.key_prefixes.is_empty() {
            return None;
        }
        let b64 = |s: &String| felix_proto::message::B64(bytes::Bytes::copy_from_slice(s.as_bytes()));
        Some(felix_proto::message::KeyFilter {
            keys: self.keys.iter().map(b64).collect(),
            key_prefixes: self.key_prefixes.iter().map(b64).collect(),
        })
    }
}

#[derive(Args, Debug)]
pub(crate) struct SimArgs {
    /// Run only this seed (to replay a failure), or start from it.
    #[arg(long)]
    pub(crate) seed: Option<u64>,
    /// How many seeds to run [default: as many as --duration allows].
    #[arg(long)]
    pub(crate) seeds: Option<u64>,
    /// How long to keep running seeds (e.g. 60s, 10m) [default: 30s, or one seed with --seed].
    #[arg(long, value_parser = commands::parse_duration)]
    pub(crate) duration: Option<std::time::Duration>,
    /// Workload steps per seed [default: a spread drawn from each seed, 200 to 30,000 steps,
    /// about 3,000 on average; printed with each seed so it replays at its own length].
    #[arg(long)]
    pub(crate) steps: Option<usize>,
    /// Seeds run at once, on this many threads [default: the machine's cores].
    #[arg(long)]
    pub(crate) jobs: Option<usize>,
    /// Print only the summary, not a line per seed.
    #[arg(long, short)]
    pub(crate) quiet: bool,
    /// Simulate the cluster's metadata group instead (3 or 5 brokers: message loss,
    /// duplication, delay, partitions, crashes and restarts from the kept Raft log), checking
    /// one history, one owner per shard and generation, growing generations and progress.
    #[arg(long)]
    pub(crate) cluster: bool,
    /// With --cluster: simulate whole brokers and their clients (3, 5 or 7 brokers, 212 shards, keyed
    /// publishes and subscribes through random brokers, forwards and redirects under lost,
    /// delayed and cut links and crashes), checking one owner per generation, writes only on
    /// owners, every request answered and progress once healed. --steps is fault ticks of
    /// 100 ms each [default: 300].
    #[arg(long, requires = "cluster")]
    pub(crate) clients: bool,
    /// Simulate one replicated (quorum) shard instead: 3 or 5 replicas of its Raft group,
    /// idempotent producers retrying, loss, duplication, delay, partitions and crashes between
    /// any two outputs, checking one history, exactly-once acknowledged batches, one leader per
    /// term and progress once healed. --steps per seed [default: 600].
    #[arg(long, conflicts_with_all = ["cluster", "clients"])]
    pub(crate) replicated: bool,
}

#[derive(Args, Debug)]
pub(crate) struct ReadArgs {
    /// Stream to read (durable).
    #[arg(value_parser = commands::parse_name)]
    pub(crate) stream: String,
    /// First offset to read (of each shard read).
    #[arg(long, default_value_t = 0, value_parser = commands::parse_offset)]
    pub(crate) from: u64,
    /// Stop before this offset [default: the committed tail when the read starts].
    #[arg(long, value_parser = commands::parse_offset)]
    pub(crate) to: Option<u64>,
    /// Stop after this many records (over every shard read).
    #[arg(long)]
    pub(crate) count: Option<u64>,
    /// Shard to read [default: every shard of the stream, one after the other; lines then
    /// read SHARD/OFFSET].
    #[arg(long)]
    pub(crate) shard: Option<u32>,
    /// Records per request (the broker caps it too).
    #[arg(long)]
    pub(crate) page: Option<u32>,
    /// Print one JSON object per record (shard, offset, payload, publisher, timestamp_micros).
    #[arg(long)]
    pub(crate) json: bool,
    /// Read the copy the broker given with --addr keeps of a replicated stream, follower or
    /// leader, instead of following redirects to the leader: run it against each replica and
    /// compare, to check that they agree. Shards it keeps no copy of are passed over.
    #[arg(long)]
    pub(crate) replica_local: bool,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}
