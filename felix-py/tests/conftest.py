"""Brokers for the Python client's tests: `felix-node serve` processes the tests start and
always kill, on loopback ports of their own, with a cluster CA shared by a cluster's brokers.

The binary is $FELIX_NODE_BIN, else the workspace's target/debug/felix-node (built by
`cargo build -p felix-node`, which `.ci/run` does first).
"""

from __future__ import annotations

import os
import pathlib
import queue
import signal
import socket
import subprocess
import threading
import time
from typing import List, Optional

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
BIN = os.environ.get("FELIX_NODE_BIN", str(ROOT / "target" / "debug" / "felix-node"))
TOKEN = "py-test-token"


def free_port(kind: int = socket.SOCK_DGRAM) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Broker:
    """One `felix-node serve`; `kill()` is SIGKILL, `start()` starts it again on the same
    ports and data directory."""

    def __init__(self, data_dir: pathlib.Path, extra: Optional[List[str]] = None) -> None:
        self.dir = data_dir
        self.port = free_port()
        self.addr = f"127.0.0.1:{self.port}"
        self.extra = extra or []
        self.proc: Optional[subprocess.Popen] = None
        self.stderr: List[str] = []

    def start(self, timeout: float = 60.0) -> None:
        cmd = [BIN, "serve", "--listen", self.addr, "--data-dir", str(self.dir), "--dev-token", TOKEN] + self.extra
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        ready: "queue.Queue[bool]" = queue.Queue()

        def read_out(p: subprocess.Popen) -> None:
            for line in p.stdout:
                if line.startswith("Felix broker listening"):
                    ready.put(True)
            ready.put(False)

        def read_err(p: subprocess.Popen) -> None:
            for line in p.stderr:
                self.stderr.append(line)
                del self.stderr[:-40]

        threading.Thread(target=read_out, args=(self.proc,), daemon=True).start()
        threading.Thread(target=read_err, args=(self.proc,), daemon=True).start()
        try:
            ok = ready.get(timeout=timeout)
        except queue.Empty:
            ok = False
        if not ok:
            self.kill()
            raise RuntimeError(f"{cmd} did not start: {''.join(self.stderr)}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def cert(self) -> str:
        return str(self.dir / "tls" / "cert.pem")


@pytest.fixture
def broker(tmp_path: pathlib.Path):
    b = Broker(tmp_path / "data")
    b.start()
    yield b
    b.kill()


@pytest.fixture
def cluster(tmp_path: pathlib.Path):
    """Three brokers of one cluster with one CA (`--cluster-ca`), every stream replicated on
    all three: any one may be killed."""
    names = ["n1", "n2", "n3"]
    peers = ",".join(f"{n}=127.0.0.1:{free_port()}" for n in names)
    ca = tmp_path / "cluster-ca"
    brokers = []
    for n, p in zip(names, peers.split(",")):
        listen = p.split("=")[1]
        extra = [
            "--node-id", n, "--cluster-listen", listen, "--peers", peers, "--cluster-secret", "py-secret",
            "--cluster-ca", str(ca), "--default-shards", "1", "--default-replication", "3",
        ]
        brokers.append(Broker(tmp_path / n, extra))
    try:
        for b in brokers:
            b.start()
        yield brokers, str(ca / "ca.pem")
    finally:
        for b in brokers:
            b.kill()


def wait_until(what: str, check, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if check():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")
