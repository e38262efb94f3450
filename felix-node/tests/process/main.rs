//! Tests against a real `felix-node serve` process: the README's client commands, and crash
//! safety (SIGKILL under acked load, then restart).

use bytes::Bytes;
use felix_driver_tokio::{Client, ClientOptions, PublishOptions, SubscriptionItem, Trust};
use felix_proto::message::StartPosition;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::net::{SocketAddr, UdpSocket};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

mod cli;
mod durability;
use durability::*;
mod publishing;
mod security;
use security::*;
mod data;
mod operator;

const BIN: &str = env!("CARGO_BIN_EXE_felix-node");

const TOKEN: &str = "process-test-token";

fn free_port() -> SocketAddr {
    let s = UdpSocket::bind("127.0.0.1:0").unwrap();
    s.local_addr().unwrap()
}

/// A broker process that is killed when dropped, so a failing test leaves no broker behind.
struct Broker(Child);

impl std::ops::Deref for Broker {
    type Target = Child;
    fn deref(&self) -> &Child {
        &self.0
    }
}

impl std::ops::DerefMut for Broker {
    fn deref_mut(&mut self) -> &mut Child {
        &mut self.0
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        // Already gone after a clean stop or a kill in the test; otherwise stop it now.
        if matches!(self.0.try_wait(), Ok(None)) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// Starts `felix-node serve` and waits for its "listening" banner.
fn serve(data: &Path, addr: SocketAddr, extra: &[&str]) -> Broker {
    serve_with_env(data, addr, extra, &[])
}

/// As [`serve`], with more environment variables.
fn serve_with_env(data: &Path, addr: SocketAddr, extra: &[&str], env: &[(&str, &str)]) -> Broker {
    let child = Command::new(BIN)
        .args(["serve", "--listen", &addr.to_string(), "--data-dir"])
        .arg(data)
        .args(["--dev-token", TOKEN])
        .args(extra)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    wait_for_banner(child)
}

/// Waits for the broker's "listening" banner, then keeps draining its stdout so it never
/// blocks on a full pipe.
fn wait_for_banner(mut child: Child) -> Broker {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("broker printed its banner").unwrap();
        if line.starts_with("Felix broker listening") {
            break;
        }
    }
    std::thread::spawn(move || for _ in lines {});
    Broker(child)
}

fn client_cmd(data: &Path, addr: SocketAddr) -> Command {
    let mut c = Command::new(BIN);
    c.env("FELIX_ADDR", addr.to_string()).env("FELIX_DATA_DIR", data);
    c
}

/// Runs a client command against `addr`: its exit code, standard output and standard error.
fn run_cli(data: &Path, addr: SocketAddr, args: &[&str]) -> (Option<i32>, String, String) {
    let out = client_cmd(data, addr).args(args).output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}
