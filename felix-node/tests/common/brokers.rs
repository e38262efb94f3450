//! Brokers of the multi-process cluster tests: `felix-node serve` children (killed when
//! dropped) with their addresses and data directories, the CLI run against them, and who leads.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use felix_driver_tokio::ClientError;
use felix_proto::error_code::RetryClass;

use super::faultnet::FaultNet;
use super::{cluster_status as status, free_tcp, free_udp};

pub const BIN: &str = env!("CARGO_BIN_EXE_felix-node");
pub const TOKEN: &str = "quorum-test-token";

/// A broker process, killed (SIGKILL) when dropped.
pub struct Proc(pub Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

pub struct Node {
    pub name: String,
    pub client: SocketAddr,
    pub cluster: SocketAddr,
    pub metrics: SocketAddr,
    pub dir: PathBuf,
    pub proc: Option<Proc>,
    /// More `serve` arguments (an fsync policy).
    pub extra: Vec<String>,
    /// Where this broker journals what reached its disk (`FELIX_SYNC_JOURNAL`), if it does.
    pub journal: Option<PathBuf>,
    /// Environment for the broker (a slow disk).
    pub env: Vec<(String, String)>,
    /// Replicas of each stream and cache created without saying (`--default-replication`).
    pub replication: u8,
}

impl Node {
    /// Starts the broker: this build's binary, or `FELIX_TEST_BIN`'s (to measure another
    /// build in the same test, side by side).
    pub fn start(&mut self, peers: &str) {
        let bin = std::env::var("FELIX_TEST_BIN").unwrap_or_else(|_| BIN.to_owned());
        let mut child = Command::new(bin)
            .args(["serve", "--listen", &self.client.to_string(), "--data-dir"])
            .arg(&self.dir)
            .args(["--dev-token", TOKEN, "--node-id", &self.name])
            .args(["--default-shards", "1"])
            .args(["--default-replication", &self.replication.to_string()])
            .args(["--cache-replication", &self.replication.to_string()])
            .args(["--cluster-listen", &self.cluster.to_string(), "--peers", peers, "--cluster-secret", "s"])
            .args(["--metrics-listen", &self.metrics.to_string()])
            .args(&self.extra)
            .envs(self.journal.iter().map(|j| (felix_driver_common::sync_journal::ENV, j)))
            .envs(self.env.iter().cloned())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        super::wait_for_banner(&mut child);
        self.proc = Some(Proc(child));
    }

    pub fn kill(&mut self) {
        self.proc = None;
    }
}

pub fn cli(addrs: &str, dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN)
        .env("FELIX_ADDR", addrs)
        .env("FELIX_DATA_DIR", dir)
        .env("FELIX_TOKEN", TOKEN)
        .args(args)
        .arg("--insecure-accept-any-certificate")
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The ledger's leader: the live broker whose replica leads it (its own status says so), else
/// the owner the metadata names (it learns of a new leader a moment after).
pub fn leader(nodes: &[Node]) -> Option<String> {
    leader_of(nodes, "ledger")
}

/// The leader of the replicated stream or cache `name`, as [`leader`].
pub fn leader_of(nodes: &[Node], name: &str) -> Option<String> {
    let leading = nodes.iter().filter(|n| n.proc.is_some()).find(|n| {
        status(n.metrics).is_some_and(|v| {
            v["replicas"].as_array().is_some_and(|r| r.iter().any(|r| r["name"] == name && r["role"] == "leader"))
        })
    });
    if let Some(n) = leading {
        return Some(n.name.clone());
    }
    nodes.iter().filter(|n| n.proc.is_some()).find_map(|n| {
        let v = status(n.metrics)?;
        v["shards"].as_array()?.iter().find(|s| s["name"] == name).and_then(|s| s["owner"].as_str().map(str::to_owned))
    })
}

/// Whether a CLI error says the request was refused before anything was written (retry it),
/// rather than that its outcome is unknown.
pub fn refused_before_writing(err: &str) -> bool {
    ["shard_unavailable", "not_leader", "owned by", "electing", "settling", "being created"]
        .iter()
        .any(|w| err.contains(w))
}

/// Three brokers started on loopback, each with a data directory of its own (kept while the
/// returned directories live), and the `--peers` list they were given.
pub fn three_brokers() -> (Vec<tempfile::TempDir>, Vec<Node>, String) {
    three_brokers_with(&[], &[], false)
}

/// As [`three_brokers`], each started with `extra` arguments and `env` and, with `journal`,
/// keeping a sync journal beside its data directory (for power cuts).
pub fn three_brokers_with(
    extra: &[&str],
    env: &[(&str, &str)],
    journal: bool,
) -> (Vec<tempfile::TempDir>, Vec<Node>, String) {
    let (dirs, mut nodes) = three_nodes(extra, env, journal);
    let peers = nodes.iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes {
        n.start(&peers);
    }
    (dirs, nodes, peers)
}

/// Three brokers' addresses and data directories (kept while the directories live), not
/// started.
pub fn three_nodes(extra: &[&str], env: &[(&str, &str)], journal: bool) -> (Vec<tempfile::TempDir>, Vec<Node>) {
    nodes_named(&["n1", "n2", "n3"], 3, extra, env, journal)
}

/// `count` brokers started on loopback (n1, n2, …), streams and caches replicated on
/// `replication` of them by default, and the `--peers` list they were given.
pub fn brokers(count: usize, replication: u8) -> (Vec<tempfile::TempDir>, Vec<Node>, String) {
    let names: Vec<String> = (1..=count).map(|i| format!("n{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let (dirs, mut nodes) = nodes_named(&names, replication, &[], &[], false);
    let peers = nodes.iter().map(|n| format!("{}={}", n.name, n.cluster)).collect::<Vec<_>>().join(",");
    for n in &mut nodes {
        n.start(&peers);
    }
    (dirs, nodes, peers)
}

/// `count` brokers' addresses and data directories (n1, n2, …), started with `extra`
/// arguments and streams replicated on `replication` by default: none started yet.
pub fn nodes(count: usize, replication: u8, extra: &[&str]) -> (Vec<tempfile::TempDir>, Vec<Node>) {
    let names: Vec<String> = (1..=count).map(|i| format!("n{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    nodes_named(&names, replication, extra, &[], false)
}

fn nodes_named(
    names: &[&str],
    replication: u8,
    extra: &[&str],
    env: &[(&str, &str)],
    journal: bool,
) -> (Vec<tempfile::TempDir>, Vec<Node>) {
    let dirs: Vec<tempfile::TempDir> = names.iter().map(|_| tempfile::tempdir().unwrap()).collect();
    let nodes: Vec<Node> = names
        .iter()
        .zip(&dirs)
        .map(|(n, d)| Node {
            name: n.to_string(),
            client: free_udp(),
            cluster: free_udp(),
            metrics: free_tcp(),
            dir: d.path().join("data"),
            proc: None,
            extra: extra.iter().map(|a| a.to_string()).collect(),
            journal: journal.then(|| d.path().join("sync-journal")),
            env: env.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
            replication,
        })
        .collect();
    (dirs, nodes)
}

/// Three brokers whose peer traffic all goes through a [`FaultNet`] (clients reach them
/// directly), and the network.
pub fn three_brokers_through_faults(seed: u64) -> (Vec<tempfile::TempDir>, Vec<Node>, FaultNet) {
    let (dirs, nodes, net, _) = three_brokers_through_faults_with(seed, false);
    (dirs, nodes, net)
}

/// As [`three_brokers_through_faults`], each broker keeping a sync journal with `journal`
/// (for power cuts); also the `--peers` list each was started with (to restart it).
pub fn three_brokers_through_faults_with(
    seed: u64,
    journal: bool,
) -> (Vec<tempfile::TempDir>, Vec<Node>, FaultNet, std::collections::BTreeMap<String, String>) {
    let (dirs, mut nodes) = three_nodes(&[], &[], journal);
    let brokers: Vec<(String, SocketAddr)> = nodes.iter().map(|n| (n.name.clone(), n.cluster)).collect();
    let (net, peers) = FaultNet::new(&brokers, seed);
    for n in &mut nodes {
        let p = peers[&n.name].clone();
        n.start(&p);
    }
    (dirs, nodes, net, peers)
}

/// Whether a publish error says nothing was written (so the same record may be sent again).
pub fn not_written(e: &ClientError) -> bool {
    match e {
        ClientError::NotLeader { .. } | ClientError::Connect(_) => true,
        ClientError::Refused(i) => {
            matches!(i.retry, Some(RetryClass::Retry | RetryClass::RetryAfter | RetryClass::Redirect))
        }
        _ => false,
    }
}
