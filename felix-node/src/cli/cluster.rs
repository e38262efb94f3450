//! `cluster`'s operations and the flags every operator request shares.

use super::*;

#[derive(Args, Debug)]
pub(crate) struct ClusterArgs {
    #[command(subcommand)]
    pub(crate) op: ClusterOp,
}

#[derive(Subcommand, Debug)]
pub(crate) enum ClusterOp {
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
pub(crate) struct AdminArgs {
    /// A broker's metrics listener (its --metrics-listen), where the change is asked.
    #[arg(long, env = "FELIX_METRICS")]
    pub(crate) metrics: SocketAddr,
    /// The cluster's shared secret (the brokers' --cluster-secret).
    #[arg(long, env = "FELIX_CLUSTER_SECRET", hide_env_values = true, default_value = "felix-dev-cluster-secret")]
    pub(crate) cluster_secret: String,
    /// How long to wait for the change to be applied (for a move, drain or rebalance: how
    /// long to wait without any progress).
    #[arg(long, value_parser = commands::parse_duration, default_value = "30s")]
    pub(crate) wait: std::time::Duration,
}
