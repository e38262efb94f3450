//! Three `felix-node serve` processes forming a cluster on loopback: they agree on members,
//! leader and owners; records published through every broker land once, on their shard's owner;
//! a read through a broker that does not own the shard is redirected; after one broker is
//! killed with SIGKILL the others keep serving their shards and what needs the dead one is
//! answered `shard_unavailable`, never a hang.

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_felix-node");
const TOKEN: &str = "cluster-test-token";

#[path = "../common/mod.rs"]
mod common;
use common::{free_tcp, free_udp, wait_for};

mod membership;
mod moves;
use moves::*;
mod clients;

/// A broker process, killed when dropped.
struct Broker {
    child: Child,
    name: String,
    client: SocketAddr,
    metrics: SocketAddr,
    dir: tempfile::TempDir,
}

impl Drop for Broker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start(name: &str, client: SocketAddr, cluster: SocketAddr, peers: &str) -> Broker {
    start_with(name, client, cluster, peers, &[])
}

fn start_with(name: &str, client: SocketAddr, cluster: SocketAddr, peers: &str, extra: &[&str]) -> Broker {
    let dir = tempfile::tempdir().unwrap();
    let metrics = free_tcp();
    let mut child = Command::new(BIN)
        .args(["serve", "--listen", &client.to_string(), "--data-dir"])
        .arg(dir.path())
        .args(["--dev-token", TOKEN, "--default-shards", "6", "--node-id", name])
        .args(["--cluster-listen", &cluster.to_string(), "--peers", peers, "--cluster-secret", "test-secret"])
        .args(["--metrics-listen", &metrics.to_string()])
        .args(extra)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_banner(&mut child);
    Broker { child, name: name.into(), client, metrics, dir }
}

/// `GET /cluster` on a broker's metrics listener.
fn status(b: &Broker) -> Option<serde_json::Value> {
    common::cluster_status(b.metrics)
}

/// A `felix_peer_*` metric's value for `peer` on a broker (`None`: not shown).
fn peer_metric(b: &Broker, name: &str, peer: &str) -> Option<u64> {
    let text = common::http_get(b.metrics, "/metrics")?;
    let series = format!("{name}{{peer=\"{peer}\"}} ");
    text.lines().find_map(|l| l.strip_prefix(&series)).and_then(|v| v.trim().parse().ok())
}

fn cli(b: &Broker, args: &[&str]) -> (bool, String, String) {
    cli_at(b.client, b.dir.path(), args)
}

fn cli_at(addr: SocketAddr, dir: &Path, args: &[&str]) -> (bool, String, String) {
    cli_at_addrs(&addr.to_string(), dir, args)
}

fn cli_at_addrs(addr: &str, dir: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(BIN).env("FELIX_ADDR", addr).env("FELIX_DATA_DIR", dir).args(args).output().unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Owner of each shard of `orders`, from one broker's status.
fn owners(v: &serde_json::Value) -> Vec<String> {
    let mut o: Vec<(u64, String)> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == "orders")
        .map(|s| (s["shard"].as_u64().unwrap(), s["owner"].as_str().unwrap().to_owned()))
        .collect();
    o.sort();
    o.into_iter().map(|(_, n)| n).collect()
}

/// (owner, generation) of each shard of `name`, from one broker's status.
fn homes(v: &serde_json::Value, name: &str) -> Vec<(String, u64)> {
    let mut o: Vec<(u64, String, u64)> = v["shards"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["name"] == name)
        .map(|s| {
            (s["shard"].as_u64().unwrap(), s["owner"].as_str().unwrap().to_owned(), s["generation"].as_u64().unwrap())
        })
        .collect();
    o.sort();
    o.into_iter().map(|(_, n, g)| (n, g)).collect()
}
