//! The subcommands that act on one named thing: streams, consumer groups, caches and counters.

use super::*;

#[derive(Args, Debug)]
pub(crate) struct CacheArgs {
    #[command(subcommand)]
    pub(crate) op: CacheOp,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}

#[derive(Args, Debug)]
pub(crate) struct CounterArgs {
    #[command(subcommand)]
    pub(crate) op: CounterOp,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
pub(crate) enum CounterOp {
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
pub(crate) struct StreamArgs {
    #[command(subcommand)]
    pub(crate) op: StreamOp,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
pub(crate) enum StreamOp {
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
    pub(crate) stream: String,
    /// Group name.
    #[arg(long, short = 'g', value_parser = commands::parse_name)]
    pub(crate) group: String,
    /// Shard [default: the stream's only shard; `consume` and `group describe`: every shard].
    #[arg(long)]
    pub(crate) shard: Option<u32>,
}

#[derive(Args, Debug)]
pub(crate) struct GroupArgs {
    #[command(subcommand)]
    pub(crate) op: GroupOp,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
pub(crate) enum GroupOp {
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
pub(crate) struct ConsumeArgs {
    #[command(flatten)]
    pub(crate) g: GroupName,
    /// Member name (default: this host's name and process id).
    #[arg(long)]
    pub(crate) consumer: Option<String>,
    /// Records per poll.
    #[arg(long, default_value_t = 100)]
    pub(crate) batch: u32,
    /// Print one JSON object per record.
    #[arg(long)]
    pub(crate) json: bool,
    /// Stop after this many records.
    #[arg(long)]
    pub(crate) count: Option<u64>,
    #[command(flatten)]
    pub(crate) conn: ConnectArgs,
}

#[derive(Subcommand, Debug)]
pub(crate) enum CacheOp {
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
