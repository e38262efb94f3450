//! `felix-node`: the Felix broker and its command-line client.

/// `println!` for the CLI's output: a closed stdout (`felix-node sim | head`) ends the process
/// quietly, as it ends `cat` or `grep`, instead of panicking.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let mut o = std::io::stdout().lock();
        if writeln!(o, $($arg)*).and_then(|()| o.flush()).is_err() {
            std::process::exit(0);
        }
    }};
}

mod bench;
mod commands;
mod config;
mod conformance;
mod conn_bench;
mod demo;
mod groups;
mod live;
mod node;
mod reading;
mod soak;
mod tokens;

use clap::{Args, Parser, Subcommand};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

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
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Threads of the async runtime (default: one per core; `serve` on a machine of 2 cores or
    /// fewer: 1). On a small machine shared with its clients, 1 halves the broker's CPU per
    /// record at moderate rates and its tail latency (docs/benchmarks.md); more help many
    /// connections on many cores.
    #[arg(long, global = true, env = "FELIX_WORKER_THREADS",
        value_parser = clap::value_parser!(u16).range(1..=1024))]
    worker_threads: Option<u16>,
}

#[derive(Subcommand, Debug)]
enum Command {
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
struct ServeArgs {
    /// A TOML configuration file (tokens, streams, caches, limits; see docs/operations.md).
    /// Flags and FELIX_* variables override it.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_CONFIG")]
    config: Option<PathBuf>,
    /// UDP address to listen on [default: 127.0.0.1:5000].
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_LISTEN")]
    listen: Option<SocketAddr>,
    /// Where durable streams, the TLS certificate and the dev token live [default: ./felix-data].
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// Development token (valid for any tenant, every permission). Default: generated on first
    /// start and stored in the data directory.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_DEV_TOKEN")]
    dev_token: Option<String>,
    /// When appends reach the disk, for durable streams and replicated shards alike: always
    /// (acknowledged only once on disk, group commit), or a lazy interval:MILLISECONDS or never
    /// that a power cut can take acknowledged records back from (docs/storage.md) [default: always].
    #[arg(help_heading = "Storage", long, env = "FELIX_FSYNC")]
    fsync: Option<felix_driver_tokio::FsyncMode>,
    /// Auto-created streams keep no history (no offsets, nothing on disk).
    #[arg(help_heading = "Storage", long, env = "FELIX_EPHEMERAL")]
    ephemeral: bool,
    /// Caches created on first use keep their values across a restart: every change is written
    /// (on the --fsync policy) before it is answered. Without it they live in memory only;
    /// `[[caches]] durable = true` makes one named cache durable.
    #[arg(help_heading = "Storage", long, env = "FELIX_DURABLE_CACHES")]
    durable_caches: bool,
    /// Pipelined-publish window per stream, 0 disables pipelining [default: 256].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_PUBLISH_WINDOW")]
    publish_window: Option<u32>,
    /// Largest frame payload accepted after authentication, in bytes [default: 16 MiB].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_MAX_FRAME_BYTES")]
    max_frame_bytes: Option<u32>,
    /// Answer every acked publish only after its write, with offsets.
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_ACK_ON_COMMIT")]
    ack_on_commit: bool,
    /// Answer not_found for streams and caches that do not exist instead of creating them.
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_NO_AUTO_CREATE")]
    no_auto_create: bool,
    /// Default subscriber queue capacity, in published batches [default: 4096].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_QUEUE_CAPACITY")]
    queue_capacity: Option<u32>,
    /// Bytes one subscriber's queue may hold, whatever its capacity in batches; past it a
    /// slow subscriber's batches are dropped [default: 256 MiB].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_QUEUE_BYTES_MAX")]
    queue_bytes_max: Option<usize>,
    /// Streams kept in memory: how long publishers may be held (not read) for a subscriber
    /// whose queue is over half full before it is left behind to drop, ms; 0 drops at once
    /// [default: 1000].
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_PUBLISHER_HOLD_MS")]
    publisher_hold_ms: Option<u64>,
    /// Consumer groups: claim duration when a poll names none, ms [default: 30000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_VISIBILITY_MS")]
    group_visibility_ms: Option<u64>,
    /// Consumer groups: longest claim, extension or nack delay, ms [default: 43200000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_VISIBILITY_MS")]
    group_max_visibility_ms: Option<u64>,
    /// Consumer groups: longest long poll, ms [default: 30000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_WAIT_MS")]
    group_max_wait_ms: Option<u64>,
    /// Consumer groups: deliveries before a record is dead-lettered [default: 5].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_ATTEMPTS")]
    group_max_attempts: Option<u32>,
    /// Consumer groups: records handed out and unsettled per group per shard [default: 10000].
    #[arg(help_heading = "Consumer groups", long, env = "FELIX_GROUP_MAX_IN_FLIGHT")]
    group_max_in_flight: Option<usize>,
    /// Auto-created streams keep at most this many records per shard [default: 1000000].
    #[arg(help_heading = "Storage", long, env = "FELIX_RETENTION_RECORDS")]
    retention_records: Option<u64>,
    /// Auto-created durable streams keep this many payload bytes of history per shard in
    /// memory; older history is read from disk [default: 64 MiB].
    #[arg(help_heading = "Storage", long, env = "FELIX_MEMORY_BYTES")]
    memory_bytes: Option<u64>,
    /// Most records one stream_read page returns [default: 1000].
    #[arg(help_heading = "Storage", long, env = "FELIX_MAX_RECORDS_PER_READ")]
    max_records_per_read: Option<u32>,
    /// Refuse clients that offer no ALPN (existing clients offer none).
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_REQUIRE_ALPN")]
    require_alpn: bool,
    /// A control stream must authenticate within this many milliseconds or is ended
    /// (`unauthenticated`); its connection stays [default: 10000].
    #[arg(help_heading = "Admission", long, env = "FELIX_AUTH_TIMEOUT_MS")]
    auth_timeout_ms: Option<u64>,
    /// Connections that authenticated no stream yet, in all; past it, one unauthenticated for
    /// longer than the auth timeout is closed to make room, else the new one is refused
    /// [default: 1024].
    #[arg(help_heading = "Admission", long, env = "FELIX_MAX_UNAUTHENTICATED_CONNECTIONS")]
    max_unauthenticated_connections: Option<usize>,
    /// Connections that authenticated no stream yet, per client address [default: 64].
    #[arg(help_heading = "Admission", long, env = "FELIX_MAX_UNAUTHENTICATED_PER_ADDRESS")]
    max_unauthenticated_per_address: Option<usize>,
    /// Serve Prometheus metrics over HTTP on this TCP address (off by default). With a cluster,
    /// `GET /cluster` there answers the cluster's state (`felix-node cluster status`).
    #[arg(help_heading = "Observability", long, env = "FELIX_METRICS_LISTEN")]
    metrics_listen: Option<SocketAddr>,
    /// Serve the operator web view on this TCP address (off by default): brokers, shards and
    /// their owners, replica lag, moves in progress, the subscriptions served here; read-only,
    /// refreshed every 2 s. Open http://ADDR/?token=TOKEN (the banner prints the address).
    #[arg(help_heading = "Observability", long, env = "FELIX_HTTP")]
    http: Option<SocketAddr>,
    /// The web view's token [default: the dev token; without one, --http needs this].
    #[arg(help_heading = "Observability", long, env = "FELIX_HTTP_TOKEN", hide_env_values = true)]
    http_token: Option<String>,
    /// Shards of a stream created on first use (1..=4096) [default: 1]. Keyed records spread over them by
    /// key; in a cluster the shards are spread over the brokers.
    #[arg(help_heading = "Streams and subscribers", long, env = "FELIX_DEFAULT_SHARDS", value_parser = clap::value_parser!(u32).range(1..=4096))]
    default_shards: Option<u32>,
    /// In a cluster: replicas per shard of a durable stream created on first use (1..=7)
    /// [default: 1]. 3 makes each shard a Raft group over three brokers (`quorum` durability):
    /// a write is acknowledged once two hold it, and the shard fails over when one dies.
    #[arg(help_heading = "Cluster", long, env = "FELIX_DEFAULT_REPLICATION", value_parser = clap::value_parser!(u32).range(1..=7))]
    default_replication: Option<u32>,
    /// In a cluster: replicas of a cache created on first use (1..=7) [default: 1]. 3 makes the
    /// cache's changes the log of a Raft group over three brokers: a write is answered once two
    /// hold it, and values, versions and watch offsets survive the loss of one.
    #[arg(help_heading = "Cluster", long, env = "FELIX_CACHE_REPLICATION", value_parser = clap::value_parser!(u32).range(1..=7))]
    cache_replication: Option<u32>,
    /// Join a cluster as this node id (with --cluster-listen and --peers). Without it the broker
    /// runs alone, as always.
    #[arg(help_heading = "Cluster", long, env = "FELIX_NODE_ID")]
    node_id: Option<String>,
    /// On SIGTERM or Ctrl-C: how long to finish what is in flight (writes not yet on disk,
    /// forwards not yet answered) before stopping; meanwhile no new work is taken (new
    /// connections refused, new control streams answered `draining`). A second signal stops at
    /// once.
    #[arg(help_heading = "Admission", long, env = "FELIX_DRAIN_GRACE", value_parser = commands::parse_duration, default_value = "10s")]
    drain_grace: std::time::Duration,
    /// Trust signed tokens (JWT, EdDSA) whose key is in this JWK set (`felix-node token keygen`
    /// makes one), besides the static tokens. Also `[auth] jwks`, with `issuer` and `audience`.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_JWKS")]
    jwks: Option<std::path::PathBuf>,
    /// The broker's TLS certificate chain (PEM), for a certificate an operator issued
    /// [default: DATA_DIR/tls/cert.pem, self-signed and generated on first start]. With
    /// --tls-key; clients then trust it with --ca (its CA, or the chain itself).
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<std::path::PathBuf>,
    /// The private key (PEM) of --tls-cert.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<std::path::PathBuf>,
    /// A cluster's certificate authority: a directory holding `ca.pem` and `ca.key` (made by
    /// `felix-node cluster init-ca`, or here by the first broker given an empty or missing
    /// one). The broker's certificate is issued by it, so clients trust every broker with
    /// one file: `--ca DIR/ca.pem`. Every broker of the cluster is given the same CA (copy
    /// the directory to each host). Also `[tls] cluster_ca`.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_CLUSTER_CA", conflicts_with = "tls_cert")]
    cluster_ca: Option<std::path::PathBuf>,
    /// Mutual TLS: ask clients for a certificate and verify it against these CA certificates
    /// (PEM). A verified certificate authenticates an `auth` with an empty token as the
    /// `[[client_certs]]` entry naming it (its subject CN or a subject alternative name);
    /// clients without one still authenticate with tokens. Also `[tls] client_ca`.
    #[arg(help_heading = "Listening and TLS", long, env = "FELIX_TLS_CLIENT_CA")]
    tls_client_ca: Option<std::path::PathBuf>,
    /// Join a running cluster (after an operator's `felix-node cluster add`) instead of
    /// founding one: --peers then lists the members it knows of. Every broker added after the
    /// cluster first started runs with --join; only the founding brokers go without it.
    #[arg(help_heading = "Cluster", long, env = "FELIX_JOIN")]
    join: bool,
    /// Cluster: bytes of its Raft log each replica of a replicated shard keeps in memory once
    /// applied; older entries are read back from its log files when a follower behind or a
    /// reader needs them [default: 8388608 (8 MiB)].
    #[arg(help_heading = "Cluster", long, env = "FELIX_REPLICA_ENTRY_CACHE")]
    replica_entry_cache: Option<u64>,
    /// Cluster: the most bytes a second that moves copy to and from this broker (a durable
    /// shard's copy, a replicated shard's log sent to a broker joining its group), so that a
    /// rebalance, a drain or an operator's moves leave publishers their share. Like 50MB/s,
    /// 20MiB/s or 1G (decimal and binary units, bytes). A move slower than its shard is
    /// written to never finishes: size it above the busiest moving shard's write rate
    /// [default: unlimited]. Also `[cluster] move_bandwidth`.
    #[arg(help_heading = "Cluster", long, env = "FELIX_MOVE_BANDWIDTH", value_parser = commands::parse_byte_rate)]
    move_bandwidth: Option<u64>,
    /// Cluster: compact the metadata Raft log into a snapshot of the metadata once it holds
    /// this many entries past the last one, so a restart replays, and a broker added later is
    /// sent, a snapshot and a short log rather than everything since the cluster began. 0:
    /// never [default: 10000]. Also `[cluster] metadata_snapshot_entries`.
    #[arg(help_heading = "Cluster", long, env = "FELIX_METADATA_SNAPSHOT_ENTRIES")]
    metadata_snapshot_entries: Option<u64>,
    /// Where this broker listens for the other brokers (never the client listener).
    #[arg(help_heading = "Cluster", long, env = "FELIX_CLUSTER_LISTEN")]
    cluster_listen: Option<SocketAddr>,
    /// Every broker of the cluster, this one included: ID=HOST:PORT of each cluster listener,
    /// comma-separated (the same list on every broker).
    #[arg(help_heading = "Cluster", long, env = "FELIX_PEERS", value_parser = commands::parse_peers)]
    peers: Option<commands::Peers>,
    /// The secret the brokers of the cluster share; a broker that does not know it is refused.
    /// [default: a development secret, with a warning]
    #[arg(help_heading = "Cluster", long, env = "FELIX_CLUSTER_SECRET", hide_env_values = true)]
    cluster_secret: Option<String>,
    /// The cluster's name: brokers of another cluster are refused [default: felix].
    #[arg(help_heading = "Cluster", long, env = "FELIX_CLUSTER_NAME")]
    cluster_name: Option<String>,
    /// The client address this broker gives clients (redirects, topology) [default: --listen].
    #[arg(help_heading = "Cluster", long, env = "FELIX_ADVERTISE")]
    advertise: Option<String>,
    /// Concurrent bidirectional streams (control and cache streams) a client may open. Past it
    /// a client waits for QUIC to grant more as its streams end; nothing fails. A connection
    /// starts with 8 and is granted more as it uses them (QUIC keeps a table entry per stream
    /// allowed, so an idle connection costs the same whatever this is; docs/benchmarks.md).
    /// At least 8: a client holds a few long-lived streams (requests, long polls) and needs
    /// room beside them to ask for a subscription.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_MAX_STREAMS", default_value_t = 128,
        value_parser = clap::value_parser!(u32).range(8..))]
    max_streams: u32,
    /// Concurrent unidirectional (publish-only) streams a client may open (2 at first, more
    /// as it uses them). Felix's own clients open none: they publish on control streams.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_MAX_UNI_STREAMS", default_value_t = 32)]
    max_uni_streams: u32,
    /// Per-stream QUIC receive window, bytes.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_STREAM_RECEIVE_WINDOW", default_value_t = 8 << 20)]
    stream_receive_window: u32,
    /// Per-connection QUIC receive window, bytes.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_RECEIVE_WINDOW", default_value_t = 32 << 20)]
    receive_window: u32,
    /// UDP socket buffers to ask the kernel for, bytes (capped by net.core.rmem_max/wmem_max).
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_UDP_BUFFER_BYTES", default_value_t = 4 << 20)]
    udp_buffer_bytes: usize,
    /// Close connections idle this long, milliseconds.
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_IDLE_TIMEOUT_MS", default_value_t = 30_000)]
    idle_timeout_ms: u64,
    /// Largest UDP payload MTU discovery may reach, bytes (1200..=65527). Discovery settles on
    /// what the path carries (about 1452 on Ethernet); loopback peers get it from the first
    /// packet. Above 6550 the kernel refuses segmentation-offload batches (docs/operations.md).
    #[arg(help_heading = "QUIC transport", long, env = "FELIX_MAX_UDP_PAYLOAD", default_value_t = felix_driver_tokio::DEFAULT_MAX_UDP_PAYLOAD,
        value_parser = clap::value_parser!(u16).range(1200..=65527))]
    max_udp_payload: u16,
}

/// How a client command reaches the broker.
#[derive(Args, Debug, Clone)]
#[command(next_help_heading = "Connection (every client command)")]
pub struct ConnectArgs {
    /// Broker address (HOST:PORT, a name or an IP address); several, comma-separated, for a
    /// cluster (the first that answers is used, and requests follow redirects to the owner of
    /// their shard).
    #[arg(long, global = true, env = "FELIX_ADDR", default_value = "127.0.0.1:5000", value_parser = commands::parse_addrs)]
    addr: commands::Addrs,
    /// Tenant.
    #[arg(long, global = true, env = "FELIX_TENANT", default_value = "default")]
    tenant: String,
    /// Token (default: the dev token in --data-dir).
    #[arg(long, global = true, env = "FELIX_TOKEN")]
    token: Option<String>,
    /// The broker's certificate (default: the one in --data-dir).
    #[arg(long, global = true, env = "FELIX_CA")]
    ca: Option<PathBuf>,
    /// Where a local broker keeps its certificate and dev token.
    #[arg(long, global = true, env = "FELIX_DATA_DIR", default_value = "./felix-data")]
    data_dir: PathBuf,
    /// Name the broker's certificate must hold [default: the host name of --addr, or localhost
    /// for an IP address].
    #[arg(long, global = true, env = "FELIX_SERVER_NAME")]
    server_name: Option<String>,
    /// Accept any certificate. For development only: the broker's identity is not checked.
    #[arg(long, global = true)]
    insecure_accept_any_certificate: bool,
    /// A client certificate (PEM chain) to present to a broker that asks for one (mutual TLS);
    /// with it, no token is needed where the broker maps the certificate to a credential.
    #[arg(long, global = true, env = "FELIX_CERT", requires = "cert_key")]
    cert: Option<PathBuf>,
    /// The private key (PEM) of --cert (`--key` is a publish's routing key).
    #[arg(long, global = true, env = "FELIX_CERT_KEY", requires = "cert")]
    cert_key: Option<PathBuf>,
    /// Namespace.
    #[arg(long, short = 'n', global = true, default_value = "default")]
    namespace: String,
    /// ALPN to offer: auto (felix/1, and none if the broker refuses it: released Felix brokers
    /// know no ALPN id), felix/1 (a broker that requires it), or none (as existing clients).
    #[arg(long, global = true, env = "FELIX_ALPN", default_value = "auto")]
    alpn: felix_driver_tokio::tls::AlpnOffer,
    /// How long to wait for a broker to answer a connection (e.g. 5s, 500ms) before saying it
    /// does not; with several --addr, for each.
    #[arg(long, global = true, env = "FELIX_CONNECT_TIMEOUT", default_value = "5s", value_parser = commands::parse_duration)]
    connect_timeout: std::time::Duration,
    /// On exit, how long to wait for the broker to confirm it received everything written
    /// (e.g. 10s, 500ms); past it the command says what may not have been delivered.
    #[arg(long, global = true, env = "FELIX_CLOSE_TIMEOUT", default_value = "10s", value_parser = commands::parse_duration)]
    close_timeout: std::time::Duration,
}

#[derive(Args, Debug)]
struct PublishArgs {
    /// Stream to publish to.
    #[arg(value_parser = commands::parse_name)]
    stream: String,
    /// Messages (each one record). Without any, lines of --file or of standard input.
    payloads: Vec<String>,
    /// Read messages from this file, one per line.
    #[arg(long, short = 'f')]
    file: Option<PathBuf>,
    /// Routing key.
    #[arg(long, short = 'k')]
    key: Option<String>,
    /// Wait for the broker's acknowledgement of each batch: it comes once the batch is stored
    /// (written, per the stream's fsync policy), with its offset.
    #[arg(long)]
    ack: bool,
    /// The faster mode (implies --ack): a batch may be acknowledged once the broker queued it
    /// for storage, before the write; such an acknowledgement survives neither a broker crash
    /// nor a failed write (docs/operations.md, "What an acknowledgement promises").
    #[arg(long)]
    ack_on_enqueue: bool,
    /// Exactly once (implies --ack): publish as an idempotent producer, so a batch resent after
    /// a lost answer or a reconnect is appended once. Batches are pipelined (up to 64 per shard
    /// unanswered).
    #[arg(long, conflicts_with = "ack_on_enqueue")]
    idempotent: bool,
    /// Records per batch when reading lines.
    #[arg(long, default_value_t = 64)]
    batch: usize,
    /// When reading lines: send a batch that is not full once no line came for this long
    /// (e.g. 5ms, 100ms), so `tail -f app.log | felix-node publish logs` sends as lines come.
    /// On Ctrl-C or SIGTERM what was read is sent (and acknowledged, with --ack) before the
    /// command exits with 130.
    #[arg(long, default_value = "5ms", value_parser = commands::parse_duration)]
    linger: std::time::Duration,
    /// Compress each batch with this codec (zstd or lz4), when the broker takes it and the
    /// batch shrinks; it is stored and sent on compressed (docs/protocol.md, D56).
    #[arg(long, value_parser = commands::parse_codec)]
    compress: Option<felix_proto::Codec>,
    /// Compression level with --compress: zstd 1–19 (default 3); lz4 has one level.
    #[arg(long, requires = "compress", allow_negative_numbers = true)]
    level: Option<i32>,
    /// Encrypt each record end to end with AES-256-GCM under the last key of this file (lines
    /// `KEY_ID HEX`, 32-byte keys); the broker stores ciphertext and the key id (D58).
    #[arg(long, conflicts_with = "idempotent")]
    encrypt_key_file: Option<PathBuf>,
    #[command(flatten)]
    conn: ConnectArgs,
}

#[derive(Args, Debug)]
struct SubscribeArgs {
    /// Stream to read.
    #[arg(value_parser = commands::parse_name)]
    stream: String,
    /// Where to start: earliest, latest, or an offset.
    #[arg(long, default_value = "latest", conflicts_with = "since")]
    from: String,
    /// Start with the first record appended this long ago or later (e.g. 90s, 10m, 2h, 1d),
    /// found with offset_for_time. Durable streams only.
    #[arg(long, value_parser = commands::parse_duration)]
    since: Option<std::time::Duration>,
    /// Shard to read [default: every shard of the stream, merged; lines then read
    /// SHARD/OFFSET].
    #[arg(long)]
    shard: Option<u32>,
    /// Print one JSON object per event (shard, offset, payload as text or base64).
    #[arg(long)]
    json: bool,
    /// Stop after this many events.
    #[arg(long)]
    count: Option<u64>,
    /// Exit when the subscription ends (this subscriber fell behind, its shard moved or failed
    /// over, its broker went away) instead of subscribing again, wherever the shard is served
    /// now, right after the last event printed (no gap, no duplicate; retried for up to a
    /// minute).
    #[arg(long)]
    no_resume: bool,
    /// Only records published with this key (repeatable; with --key-prefix, either matches).
    /// Filtered at the broker: the rest never crosses the network (docs/protocol.md, D57).
    #[arg(long = "key", value_name = "KEY")]
    keys: Vec<String>,
    /// Only records whose key starts with this (repeatable).
    #[arg(long = "key-prefix", value_name = "PREFIX")]
    key_prefixes: Vec<String>,
    /// Decrypt end-to-end encrypted records with the keys of this file (lines `KEY_ID HEX`;
    /// several for rotated keys): each batch names the key it was sealed with (D58).
    #[arg(long)]
    encrypt_key_file: Option<PathBuf>,
    /// The keys read from --encrypt-key-file.
    #[arg(skip)]
    keyring: Option<std::sync::Arc<felix_driver_tokio::envelope::KeyRing>>,
    #[command(flatten)]
    conn: ConnectArgs,
}

impl SubscribeArgs {
    /// The filter `--key` and `--key-prefix` make, if either was given.
    fn filter(&self) -> Option<felix_proto::message::KeyFilter> {
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
struct SimArgs {
    /// Run only this seed (to replay a failure), or start from it.
    #[arg(long)]
    seed: Option<u64>,
    /// How many seeds to run [default: as many as --duration allows].
    #[arg(long)]
    seeds: Option<u64>,
    /// How long to keep running seeds (e.g. 60s, 10m) [default: 30s, or one seed with --seed].
    #[arg(long, value_parser = commands::parse_duration)]
    duration: Option<std::time::Duration>,
    /// Workload steps per seed [default: a spread drawn from each seed, 200 to 30,000 steps,
    /// about 3,000 on average; printed with each seed so it replays at its own length].
    #[arg(long)]
    steps: Option<usize>,
    /// Seeds run at once, on this many threads [default: the machine's cores].
    #[arg(long)]
    jobs: Option<usize>,
    /// Print only the summary, not a line per seed.
    #[arg(long, short)]
    quiet: bool,
    /// Simulate the cluster's metadata group instead (3 or 5 brokers: message loss,
    /// duplication, delay, partitions, crashes and restarts from the kept Raft log), checking
    /// one history, one owner per shard and generation, growing generations and progress.
    #[arg(long)]
    cluster: bool,
    /// With --cluster: simulate whole brokers and their clients (3, 5 or 7 brokers, 212 shards, keyed
    /// publishes and subscribes through random brokers, forwards and redirects under lost,
    /// delayed and cut links and crashes), checking one owner per generation, writes only on
    /// owners, every request answered and progress once healed. --steps is fault ticks of
    /// 100 ms each [default: 300].
    #[arg(long, requires = "cluster")]
    clients: bool,
    /// Simulate one replicated (quorum) shard instead: 3 or 5 replicas of its Raft group,
    /// idempotent producers retrying, loss, duplication, delay, partitions and crashes between
    /// any two outputs, checking one history, exactly-once acknowledged batches, one leader per
    /// term and progress once healed. --steps per seed [default: 600].
    #[arg(long, conflicts_with_all = ["cluster", "clients"])]
    replicated: bool,
}

#[derive(Args, Debug)]
struct ReadArgs {
    /// Stream to read (durable).
    #[arg(value_parser = commands::parse_name)]
    stream: String,
    /// First offset to read (of each shard read).
    #[arg(long, default_value_t = 0, value_parser = commands::parse_offset)]
    from: u64,
    /// Stop before this offset [default: the committed tail when the read starts].
    #[arg(long, value_parser = commands::parse_offset)]
    to: Option<u64>,
    /// Stop after this many records (over every shard read).
    #[arg(long)]
    count: Option<u64>,
    /// Shard to read [default: every shard of the stream, one after the other; lines then
    /// read SHARD/OFFSET].
    #[arg(long)]
    shard: Option<u32>,
    /// Records per request (the broker caps it too).
    #[arg(long)]
    page: Option<u32>,
    /// Print one JSON object per record (shard, offset, payload, publisher, timestamp_micros).
    #[arg(long)]
    json: bool,
    /// Read the copy the broker given with --addr keeps of a replicated stream, follower or
    /// leader, instead of following redirects to the leader: run it against each replica and
    /// compare, to check that they agree. Shards it keeps no copy of are passed over.
    #[arg(long)]
    replica_local: bool,
    #[command(flatten)]
    conn: ConnectArgs,
}

#[derive(Args, Debug)]
struct CacheArgs {
    #[command(subcommand)]
    op: CacheOp,
    #[command(flatten)]
    conn: ConnectArgs,
}

#[derive(Args, Debug)]
struct CounterArgs {
    #[command(subcommand)]
    op: CounterOp,
    #[command(flatten)]
    conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
enum CounterOp {
    /// Add DELTA (default 1; negative to subtract) and print the new sum.
    Add {
        /// Cache the counter lives in.
        #[arg(value_parser = commands::parse_name)]
        cache: String,
        /// Counter key.
        key: String,
        /// Amount to add.
        #[arg(default_value_t = 1, allow_negative_numbers = true)]
        delta: i64,
    },
    /// Print a counter's sum (exit code 1 when it was never written).
    Get {
        /// Cache the counter lives in.
        #[arg(value_parser = commands::parse_name)]
        cache: String,
        /// Counter key.
        key: String,
    },
}

#[derive(Args, Debug)]
struct ClusterArgs {
    #[command(subcommand)]
    op: ClusterOp,
}

#[derive(Subcommand, Debug)]
enum ClusterOp {
    /// Make the cluster's certificate authority: DIR/ca.pem (what clients trust) and
    /// DIR/ca.key (private; what brokers sign their certificates with). Give the directory to
    /// every broker with `serve --cluster-ca DIR`; clients then need only `--ca DIR/ca.pem`,
    /// whichever broker a redirect sends them to.
    InitCa {
        /// Where to write the CA (refused if it already holds one).
        #[arg(long, default_value = "./felix-cluster-ca")]
        out: std::path::PathBuf,
        /// The CA certificate's common name.
        #[arg(long, default_value = "Felix cluster CA")]
        name: String,
    },
    /// Print members, the metadata leader, and every shard's owner and generation, as one
    /// broker of the cluster sees them (ask several: they agree once the metadata settled).
    ///
    /// Asked over the client protocol (--addr, with a token holding the admin permission on
    /// the whole tenant, as the development token does: that tenant's shards; or
    /// node.view:cluster:*: everything), or with --metrics from the metrics listener.
    ///
    /// A large cluster's status is fetched in pages of 1,000 shards (from brokers that offer
    /// pages) and shown whole; --limit or --after shows one page and the command for the next.
    Status {
        /// Ask the broker's metrics listener (its --metrics-listen) instead of --addr.
        #[arg(long, env = "FELIX_METRICS")]
        metrics: Option<SocketAddr>,
        /// Print the JSON as the broker gave it (pages merged into one document, unless one
        /// page was asked for).
        #[arg(long)]
        json: bool,
        /// Show one page of at most this many shards (1 to 5,000).
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=5000))]
        limit: Option<u32>,
        /// Show the page after this shard: the cursor a page's "next page" line (or JSON `next`) gave.
        #[arg(long)]
        after: Option<String>,
        #[command(flatten)]
        conn: ConnectArgs,
    },
    /// Add a broker to the cluster (a Raft configuration change), then wait until it is a
    /// member. Start it first with `serve --join --node-id ID --cluster-listen HOST:PORT
    /// --peers <the members>`.
    Add {
        /// The new broker: ID=HOST:PORT of its cluster listener.
        member: String,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Revoke a signed token on every broker of the cluster, by its id (--jti) and/or every
    /// token of a principal (--sub): it goes through the metadata group, so each broker ends
    /// what the token opened (`revoked`) and refuses it from then on, whatever its own files
    /// say. Waits until the broker asked has applied it.
    Revoke {
        /// The token's id (its `jti` claim).
        #[arg(long, required_unless_present = "sub")]
        jti: Option<String>,
        /// A principal (the `sub` claim): every token it holds.
        #[arg(long)]
        sub: Option<String>,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Move one shard of a stream to another broker, and show the move until it is done. A
    /// durable shard's records are copied to the new owner while the old one serves on; then
    /// writes pause for a moment (refused `moving`, retried by clients), the new owner takes
    /// over, and subscribers follow it with no gap. An in-memory shard changes owner at once.
    /// The shard stays there until moved again (`cluster rebalance` lets placement decide).
    /// A shard already moving (placement moves shards onto a broker just added, or off one
    /// draining) is moved once that move ends, within --wait.
    Move {
        /// The stream.
        stream: String,
        /// The shard number.
        shard: u32,
        /// The broker it goes to (its node id).
        #[arg(long, required_unless_present = "cancel")]
        to: Option<String>,
        /// Give the shard's move up instead: it stays with its owner.
        #[arg(long, conflicts_with = "to")]
        cancel: bool,
        /// Progress as JSON lines.
        #[arg(long)]
        json: bool,
        /// Ask through this broker's metrics listener (its --metrics-listen) with the cluster
        /// secret, instead of over the client protocol (--addr and a token with the admin
        /// permission on the stream).
        #[arg(long, env = "FELIX_METRICS")]
        metrics: Option<SocketAddr>,
        /// With --metrics: the cluster's shared secret (the brokers' --cluster-secret).
        #[arg(long, env = "FELIX_CLUSTER_SECRET", hide_env_values = true, default_value = "felix-dev-cluster-secret")]
        cluster_secret: String,
        /// How long to wait without any progress.
        #[arg(long, value_parser = commands::parse_duration, default_value = "30s")]
        wait: std::time::Duration,
        #[command(flatten)]
        conn: ConnectArgs,
    },
    /// Drain a broker: it takes no more shards and leaves the topology view, and its shards
    /// move to the others (durable ones copied first, a few at a time); it answers
    /// `not_leader` with their new owners meanwhile. Shows the moves until it owns nothing;
    /// then `cluster remove` it without --force.
    Drain {
        /// Its node id.
        node: String,
        /// Progress as JSON lines.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Ask one broker (`--addr`) for its own view of a shard: whether it serves it, why not,
    /// its assignment, generation, tail, the move in progress; or (--subscriptions) the
    /// subscriptions it serves with their queue depth and drops. The token must be a signed
    /// one holding exactly `node.view:cluster:*` (`felix-node token mint --perm
    /// node.view:cluster:*`); every other token is refused `forbidden`.
    Inspect {
        /// The stream (or with --cache, the cache).
        name: Option<String>,
        /// The shard.
        #[arg(default_value_t = 0)]
        shard: u32,
        /// NAME is a cache.
        #[arg(long)]
        cache: bool,
        /// List the subscriptions the broker serves (of NAME, when given) instead.
        #[arg(long)]
        subscriptions: bool,
        /// Print the broker's answer as JSON.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        conn: ConnectArgs,
    },
    /// Let placement move every shard again (also those operators placed or cancelled moves
    /// left), and show the moves until none is left.
    Rebalance {
        /// Progress as JSON lines.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
    /// Remove a broker from the cluster (a Raft configuration change): its shards go to the
    /// others. A broker owning durable shards holds records no other broker has: drain it
    /// first, or removing it needs --force and loses them.
    Remove {
        /// Its node id.
        node: String,
        /// Remove it even though the records only it holds (its durable shards) are lost.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        admin: AdminArgs,
    },
}

#[derive(Args, Debug)]
struct AdminArgs {
    /// A broker's metrics listener (its --metrics-listen), where the change is asked.
    #[arg(long, env = "FELIX_METRICS")]
    metrics: SocketAddr,
    /// The cluster's shared secret (the brokers' --cluster-secret).
    #[arg(long, env = "FELIX_CLUSTER_SECRET", hide_env_values = true, default_value = "felix-dev-cluster-secret")]
    cluster_secret: String,
    /// How long to wait for the change to be applied (for a move, drain or rebalance: how
    /// long to wait without any progress).
    #[arg(long, value_parser = commands::parse_duration, default_value = "30s")]
    wait: std::time::Duration,
}

#[derive(Args, Debug)]
struct StreamArgs {
    #[command(subcommand)]
    op: StreamOp,
    #[command(flatten)]
    conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
enum StreamOp {
    /// Create streams, each with its shard count and replication: names on the command line,
    /// or thousands from a file (one request per thousand). A stream that exists is left as
    /// it is and reported with its shard count. In a cluster, waits (showing progress) until
    /// every broker knows them.
    Create {
        /// Stream names.
        #[arg(value_parser = commands::parse_name)]
        streams: Vec<String>,
        /// A file with one stream per line, `NAME [SHARDS [REPLICATION]]` (`#` starts a
        /// comment; `-` reads standard input). Lines without a count take --shards and
        /// --replication.
        #[arg(long, value_name = "FILE")]
        from_file: Option<std::path::PathBuf>,
        /// Shards per stream [default: the broker's default].
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=4096))]
        shards: Option<u32>,
        /// Replicas per shard, in a cluster (a `quorum` stream) [default: the broker's default].
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=7))]
        replication: Option<u32>,
        /// Keep the streams in memory only, not on disk [default: the broker's default].
        #[arg(long)]
        memory: bool,
        /// How long to wait for a cluster to create them.
        #[arg(long, default_value = "60s", value_parser = commands::parse_duration)]
        wait: std::time::Duration,
        /// One JSON object: {"created": [...], "existed": [{"stream", "shards"}]}.
        #[arg(long)]
        json: bool,
    },
    /// List the tenant's streams this token may publish to or read, with their shard counts
    /// (every namespace unless --in names one; any broker of a cluster lists them all).
    List {
        /// Only this namespace.
        #[arg(long = "in", value_name = "NAMESPACE")]
        in_namespace: Option<String>,
        /// One JSON object per stream.
        #[arg(long)]
        json: bool,
    },
    /// Describe a stream: shards, durability, replication, retention, and per shard its
    /// offsets, what it retains, subscribers and consumer groups (asked of each shard's owner).
    Info {
        /// The stream.
        #[arg(value_parser = commands::parse_name)]
        stream: String,
        /// Only this shard.
        #[arg(long)]
        shard: Option<u32>,
        /// One JSON object.
        #[arg(long)]
        json: bool,
    },
    /// Delete a stream: its records, consumer groups and files are removed, its subscribers
    /// told `stream_deleted`. Exit code 1 when there was no such stream. A stream declared in
    /// the configuration file comes back empty, with its configured shards, when next used or
    /// at the next start; remove it from the file to keep it gone.
    Delete {
        /// The stream.
        stream: String,
        /// Skip the confirmation (required when standard input is not a terminal).
        #[arg(long)]
        yes: bool,
    },
}

/// Which group, on which stream and shard.
#[derive(Args, Debug, Clone)]
pub struct GroupName {
    /// Stream the group consumes.
    #[arg(value_parser = commands::parse_name)]
    stream: String,
    /// Group name.
    #[arg(long, short = 'g', value_parser = commands::parse_name)]
    group: String,
    /// Shard [default: the stream's only shard; `consume` and `group describe`: every shard].
    #[arg(long)]
    shard: Option<u32>,
}

#[derive(Args, Debug)]
struct GroupArgs {
    #[command(subcommand)]
    op: GroupOp,
    #[command(flatten)]
    conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
enum GroupOp {
    /// Claim up to --max records and print them (offset, attempts, payload); they stay claimed
    /// until acked, nacked or their visibility timeout lapses.
    Poll {
        #[command(flatten)]
        g: GroupName,
        /// Most records.
        #[arg(long, default_value_t = 10)]
        max: u32,
        /// Wait this long for records (e.g. 5s).
        #[arg(long, value_parser = commands::parse_duration)]
        wait: Option<std::time::Duration>,
        /// Member name (claims are recorded as this member's).
        #[arg(long)]
        consumer: Option<String>,
        /// Print one JSON object per record.
        #[arg(long)]
        json: bool,
    },
    /// Finish records.
    Ack {
        #[command(flatten)]
        g: GroupName,
        /// Offsets.
        #[arg(required = true)]
        offsets: Vec<u64>,
    },
    /// Hand records back (owed again now, or after --delay).
    Nack {
        #[command(flatten)]
        g: GroupName,
        /// Offsets.
        #[arg(required = true)]
        offsets: Vec<u64>,
        /// Owed again only after this delay (e.g. 30s).
        #[arg(long, value_parser = commands::parse_duration)]
        delay: Option<std::time::Duration>,
    },
    /// Show the group's position, the shard's tail, its lag, and what is in flight, owed and
    /// dead (every shard of the stream unless --shard names one).
    Describe {
        #[command(flatten)]
        g: GroupName,
        /// One JSON object per shard.
        #[arg(long)]
        json: bool,
    },
    /// Move the group's position: earliest, latest or an offset.
    Seek {
        #[command(flatten)]
        g: GroupName,
        /// earliest, latest or an offset.
        to: String,
        /// Only move a group that never started.
        #[arg(long)]
        if_new: bool,
    },
    /// List the offsets the group gave up on.
    DeadLetters {
        #[command(flatten)]
        g: GroupName,
    },
    /// Make dead letters owed again (attempts reset).
    Redrive {
        #[command(flatten)]
        g: GroupName,
        /// Offsets.
        #[arg(required = true)]
        offsets: Vec<u64>,
    },
    /// Drop dead letters from the list (the records stay in the log).
    Discard {
        #[command(flatten)]
        g: GroupName,
        /// Offsets.
        #[arg(required = true)]
        offsets: Vec<u64>,
    },
    /// List a stream's consumer groups with their position, lag, in flight and dead letters
    /// (every shard unless --shard names one).
    List {
        /// Stream.
        #[arg(value_parser = commands::parse_name)]
        stream: String,
        /// Shard [default: every shard].
        #[arg(long)]
        shard: Option<u32>,
        /// One JSON object per group and shard.
        #[arg(long)]
        json: bool,
    },
    /// Delete the group: position, dead letters and claims.
    Delete {
        #[command(flatten)]
        g: GroupName,
    },
}

#[derive(Args, Debug)]
struct ConsumeArgs {
    #[command(flatten)]
    g: GroupName,
    /// Member name (default: this host's name and process id).
    #[arg(long)]
    consumer: Option<String>,
    /// Records per poll.
    #[arg(long, default_value_t = 100)]
    batch: u32,
    /// Print one JSON object per record.
    #[arg(long)]
    json: bool,
    /// Stop after this many records.
    #[arg(long)]
    count: Option<u64>,
    #[command(flatten)]
    conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
enum CacheOp {
    /// Store a value.
    Put {
        /// Cache name.
        #[arg(value_parser = commands::parse_name)]
        cache: String,
        /// Key.
        key: String,
        /// Value.
        value: String,
        /// Time to live, with a unit (e.g. 500ms, 60s, 2h).
        #[arg(long, value_parser = commands::parse_duration_with_unit)]
        ttl: Option<std::time::Duration>,
    },
    /// Read a value (exit code 1 when missing).
    Get {
        /// Cache name.
        #[arg(value_parser = commands::parse_name)]
        cache: String,
        /// Key.
        key: String,
    },
    /// List the cache's live keys in byte order (paged from the broker, 1000 at a time).
    Keys {
        /// Cache name.
        #[arg(value_parser = commands::parse_name)]
        cache: String,
        /// Only keys starting with this.
        #[arg(long)]
        prefix: Option<String>,
        /// Stop after this many keys.
        #[arg(long)]
        max: Option<u64>,
    },
    /// Delete a value and print what was removed.
    Delete {
        /// Cache name.
        #[arg(value_parser = commands::parse_name)]
        cache: String,
        /// Key.
        key: String,
    },
    /// Watch a key (or every key with --prefix) and print each change: offset, key, value
    /// (`<deleted>` for deletes and expiries). Ctrl-C to stop.
    Watch {
        /// Cache name.
        #[arg(value_parser = commands::parse_name)]
        cache: String,
        /// Key to watch.
        key: Option<String>,
        /// Watch every key starting with this instead (empty: the whole cache).
        #[arg(long, conflicts_with = "key")]
        prefix: Option<String>,
        /// Replay changes from this offset first (a printed offset + 1 resumes without a gap).
        #[arg(long, conflicts_with = "retained")]
        from: Option<u64>,
        /// Print each matching key's current value first.
        #[arg(long)]
        retained: bool,
        /// One JSON object per change.
        #[arg(long)]
        json: bool,
        /// Stop after this many changes.
        #[arg(long)]
        count: Option<u64>,
    },
}

/// Environment variables renamed to follow their flag (`--http` is `FELIX_HTTP`), old name
/// first: the old name still works, with a warning, so no deployment breaks.
const RENAMED_ENV: &[(&str, &str)] = &[
    ("FELIX_SUBSCRIBER_QUEUE_CAPACITY", "FELIX_QUEUE_CAPACITY"),
    ("FELIX_SUBSCRIBER_QUEUE_BYTES_MAX", "FELIX_QUEUE_BYTES_MAX"),
    ("FELIX_GROUP_VISIBILITY_TIMEOUT_MS", "FELIX_GROUP_VISIBILITY_MS"),
    ("FELIX_DEFAULT_RETENTION_RECORDS", "FELIX_RETENTION_RECORDS"),
    ("FELIX_DEFAULT_MEMORY_BYTES", "FELIX_MEMORY_BYTES"),
    ("FELIX_DURABLE_MAX_RECORDS_PER_READ", "FELIX_MAX_RECORDS_PER_READ"),
    ("FELIX_TLS_REQUIRE_ALPN", "FELIX_REQUIRE_ALPN"),
    ("FELIX_HTTP_LISTEN", "FELIX_HTTP"),
    ("FELIX_METRICS_ADDR", "FELIX_METRICS"),
];

/// Reads each renamed variable under its old name when the new one is not set: the flags
/// that read the new name read the old one instead (the environment itself is left alone).
fn adopt_renamed_env(mut cmd: clap::Command) -> clap::Command {
    for (old, new) in RENAMED_ENV {
        if std::env::var_os(old).is_some() && std::env::var_os(new).is_none() {
            eprintln!("warning: {old} is now {new}; the old name still works for now");
            cmd = read_env_from(cmd, new, old);
        }
    }
    cmd
}

/// Every argument of `cmd` and its subcommands that reads `new` reads `old` instead.
fn read_env_from(mut cmd: clap::Command, new: &str, old: &'static str) -> clap::Command {
    let ids: Vec<clap::Id> = cmd
        .get_arguments()
        .filter(|a| a.get_env() == Some(std::ffi::OsStr::new(new)))
        .map(|a| a.get_id().clone())
        .collect();
    for id in ids {
        cmd = cmd.mut_arg(id, |a| a.env(old));
    }
    let subs: Vec<String> = cmd.get_subcommands().map(|s| s.get_name().to_owned()).collect();
    for sub in subs {
        cmd = cmd.mut_subcommand(sub, |sc| read_env_from(sc, new, old));
    }
    cmd
}

/// `-h` short, `--help` whole: an argument whose help says more than one sentence shows its
/// first sentence (and its `[default: ...]`) under `-h`. Clap does that for doc comments of
/// several paragraphs; ours are one paragraph each, so `-h` printed all of it.
fn short_help(mut cmd: clap::Command) -> clap::Command {
    let ids: Vec<(clap::Id, String)> =
        cmd.get_arguments().filter_map(|a| Some((a.get_id().clone(), a.get_help()?.to_string()))).collect();
    for (id, help) in ids {
        if let Some(short) = first_sentence(&help) {
            cmd = cmd.mut_arg(id, |a| a.help(short).long_help(help));
        }
    }
    let subs: Vec<String> = cmd.get_subcommands().map(|s| s.get_name().to_owned()).collect();
    for sub in subs {
        cmd = cmd.mut_subcommand(sub, short_help);
    }
    cmd
}

/// `serve`'s runtime threads when `--worker-threads` is not given: one on a machine of two
/// cores or fewer, else tokio's default (one per core).
///
/// Why: a broker with two runtime threads on two cores, beside its own storage threads and
/// usually its clients, has its idle worker woken to search for work on every packet. One
/// worker halved its CPU per record at 10,000 records/s and its p99 (0.84 → 0.47 ms), lost
/// nothing at saturation, and answered one-at-a-time acknowledged publishes from Python 1.2–1.3×
/// as fast (docs/benchmarks.md). Other commands keep tokio's default: `bench` without `--addr`
/// runs a broker and its clients in one process.
fn default_serve_workers(command: &Command, cores: usize) -> Option<usize> {
    (matches!(command, Command::Serve(_)) && cores <= 2).then_some(1)
}

/// `--worker-threads` is global (every command runs on the async runtime), but it means
/// nothing to a user of `cluster status`, `token mint` or `completions`: their help leaves it
/// out. A hidden copy of the flag in those commands takes its place (clap gives a subcommand
/// the global flag only when it has none of that name), so it is still accepted there.
fn hide_runtime_flag(mut cmd: clap::Command) -> clap::Command {
    let hidden = || {
        clap::Arg::new("worker_threads")
            .long("worker-threads")
            .value_parser(clap::value_parser!(u16).range(1..=1024))
            .env("FELIX_WORKER_THREADS")
            .global(true)
            .hide(true)
    };
    for name in ["cluster", "token", "completions", "man", "conformance"] {
        cmd = cmd.mut_subcommand(name, |c| c.arg(hidden()));
    }
    cmd
}

/// The first sentence of `help` with its `[default: ...]`, when there is more to it.
fn first_sentence(help: &str) -> Option<String> {
    let end = help.match_indices(". ").map(|(i, _)| i).find(|&i| {
        // Not an abbreviation like "e.g. " or "i.e. ".
        !help[..i].ends_with("e.g") && !help[..i].ends_with("i.e")
    })?;
    let mut short = help[..end].to_owned();
    if let Some(d) = help.find("[default:").filter(|&d| d > end) {
        let close = help[d..].find(']').map_or(help.len(), |c| d + c + 1);
        short.push(' ');
        short.push_str(&help[d..close]);
    }
    Some(short)
}

/// `felix-node man`: the pages clap_mangen renders from the same definitions `--help` shows.
fn man_pages(cmd: clap::Command, out: Option<&std::path::Path>) -> ExitCode {
    let done = match out {
        Some(dir) => std::fs::create_dir_all(dir)
            .and_then(|()| clap_mangen::generate_to(cmd, dir))
            .map(|()| eprintln!("man pages written to {}", dir.display()))
            .map_err(|e| format!("writing man pages to {}: {e}", dir.display())),
        None => {
            let mut page = Vec::new();
            match clap_mangen::Man::new(cmd).render(&mut page) {
                Ok(()) => return print_all(&page),
                Err(e) => Err(e.to_string()),
            }
        }
    };
    match done {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Writes `bytes` to standard output; a reader that went away (`| head`) is not an error.
fn print_all(bytes: &[u8]) -> ExitCode {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    match out.write_all(bytes).and_then(|()| out.flush()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: writing to standard output: {e}");
            ExitCode::FAILURE
        }
    }
}

fn init_tracing() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn,felix=info".into());
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn main() -> ExitCode {
    let cmd = short_help(hide_runtime_flag(adopt_renamed_env(<Cli as clap::CommandFactory>::command())));
    let cli = <Cli as clap::FromArgMatches>::from_arg_matches(&cmd.clone().get_matches()).unwrap_or_else(|e| e.exit());
    init_tracing();
    match &cli.command {
        Command::Completions { shell } => {
            // Into a buffer first: clap_complete panics on a failed write (a closed pipe).
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut cmd.clone(), "felix-node", &mut script);
            return print_all(&script);
        }
        Command::Man { out } => return man_pages(cmd, out.as_deref()),
        _ => {}
    }
    if let Command::Sim(a) = &cli.command {
        return commands::sim(a).unwrap_or(ExitCode::FAILURE);
    }
    if let Command::Conformance { dirs, verbose, addr: None, .. } = cli.command {
        let dirs = if dirs.is_empty() { vec![PathBuf::from("vectors")] } else { dirs };
        return conformance::run(&dirs, verbose);
    }
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    let cores = std::thread::available_parallelism().map(usize::from).unwrap_or(1);
    if let Some(n) = cli.worker_threads.map(usize::from).or_else(|| default_serve_workers(&cli.command, cores)) {
        builder.worker_threads(n);
    }
    let rt = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async move {
        match cli.command {
            Command::Serve(a) => commands::serve(*a).await,
            Command::Demo { cluster: false } => demo::run().await,
            Command::Demo { cluster: true } => demo::run_cluster().await,
            Command::Publish(a) => commands::publish(a).await,
            Command::Subscribe(a) => reading::subscribe(a).await,
            Command::Read(a) => reading::read(a).await,
            Command::Cache(a) => commands::cache(a).await,
            Command::Counter(a) => commands::counter(a).await,
            Command::Cluster(a) => commands::cluster(a).await,
            Command::Token(a) => tokens::run(a),
            Command::Stream(a) => commands::stream(a).await,
            Command::Group(a) => groups::group(a).await,
            Command::Consume(a) => groups::consume(a).await,
            Command::Bench(a) => bench::run(a).await,
            Command::Soak(a) => soak::run(a).await,
            Command::Conformance {
                addr: Some(addr),
                tenant,
                token,
                ca,
                data_dir,
                server_name,
                insecure_accept_any_certificate,
                alpn,
                ..
            } => {
                let trust = node::client_trust(ca.as_deref(), &data_dir, insecure_accept_any_certificate)?;
                let token = match token {
                    Some(t) => t,
                    None => std::fs::read_to_string(node::DataDir::new(&data_dir).token())
                        .map(|t| t.trim().to_owned())
                        .map_err(|e| format!("no --token and no dev token in {}: {e}", data_dir.display()))?,
                };
                Ok(live::run(live::Target { addr, trust, server_name, tenant, token, alpn }).await)
            }
            Command::Conformance { addr: None, .. }
            | Command::Sim(_)
            | Command::Completions { .. }
            | Command::Man { .. } => unreachable!("handled above"),
        }
    });
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serve_on_a_small_machine_runs_one_runtime_thread_unless_told_otherwise() {
        let parse = |args: &[&str]| Cli::try_parse_from(args).map(|c| c.command).map_err(|e| e.to_string());
        let serve = parse(&["felix-node", "serve"]).expect("serve parses");
        assert_eq!(default_serve_workers(&serve, 1), Some(1));
        assert_eq!(default_serve_workers(&serve, 2), Some(1));
        assert_eq!(default_serve_workers(&serve, 4), None, "larger machines keep one per core");
        let bench = parse(&["felix-node", "bench"]).expect("bench parses");
        assert_eq!(default_serve_workers(&bench, 2), None, "an in-process bench runs broker and clients");
    }
}
