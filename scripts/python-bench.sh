#!/usr/bin/env bash
# The Python client beside the nearest anchor, in one run on one machine: felix-py against
# felix-node (release) and nats-py against nats-server, 256-byte records, the shapes of
# felix-py/bench/bench.py, ROUNDS interleaved rounds; prints each run and the medians. Also the
# Rust client's rate for the batched shape (felix-node bench), for the binding's overhead.
#
#   scripts/python-bench.sh [ROUNDS]        (default 3)
#
# Needs: a release felix-node (cargo build --release -p felix-node), nats-server on PATH
# (Debian: apt-get install nats-server), python3 with venv. Makes target/py-bench-venv with the
# release wheel, nats-py from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-3}"
bin=target/release/felix-node
[ -x "$bin" ] || cargo build --release -p felix-node
command -v nats-server >/dev/null || { echo "needs nats-server (apt-get install nats-server)" >&2; exit 1; }
venv=target/py-bench-venv
[ -x "$venv/bin/python" ] || python3 -m venv "$venv"
"$venv/bin/pip" install -q --disable-pip-version-check "maturin>=1.5,<2" nats-py
CARGO_TARGET_DIR=target/py-release "$venv/bin/maturin" build --release -q -m felix-py/Cargo.toml -o target/py-wheels-release
"$venv/bin/pip" install -q --disable-pip-version-check --force-reinstall --no-deps target/py-wheels-release/felix_client-*.whl
py="$venv/bin/python"

tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
udp() { python3 -c 'import socket; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Felix: one broker with in-memory streams created on first use (as core NATS keeps nothing);
# for acknowledged publishes one with durable streams written as JetStream writes its file
# store by default (acknowledged once written, fsync on an interval: --fsync interval:2000, a
# power cut can take the last 2 s back) and one with the default fsync (always: acknowledged
# only once on disk), a stronger promise than JetStream's default makes. On a machine of 2 cores
# `serve` runs one runtime thread by default; one more durable broker with --worker-threads 2
# (a thread per core, the default on larger machines) shows what that is worth to an
# acknowledged publish.
fe=127.0.0.1:$(udp); fd=127.0.0.1:$(udp); fa=127.0.0.1:$(udp); fw=127.0.0.1:$(udp); na=127.0.0.1:$(port); nj=127.0.0.1:$(port)
"$bin" serve --listen "$fe" --data-dir "$tmp/fe" --dev-token t --ephemeral >"$tmp/fe.log" 2>&1 & pids+=($!)
"$bin" serve --listen "$fd" --data-dir "$tmp/fd" --dev-token t --fsync interval:2000 >"$tmp/fd.log" 2>&1 & pids+=($!)
"$bin" serve --listen "$fa" --data-dir "$tmp/fa" --dev-token t >"$tmp/fa.log" 2>&1 & pids+=($!)
"$bin" serve --listen "$fw" --data-dir "$tmp/fw" --dev-token t --fsync interval:2000 --worker-threads 2 >"$tmp/fw.log" 2>&1 & pids+=($!)
nats-server -a 127.0.0.1 -p "${na##*:}" >"$tmp/na.log" 2>&1 & pids+=($!)
nats-server -a 127.0.0.1 -p "${nj##*:}" -js -sd "$tmp/js" >"$tmp/nj.log" 2>&1 & pids+=($!)
for f in fe fd fa fw; do
  for _ in $(seq 1 100); do grep -q "listening on" "$tmp/$f.log" && break; sleep 0.1; done
done
sleep 0.5
ca_e="$tmp/fe/tls/cert.pem"; ca_d="$tmp/fd/tls/cert.pem"; ca_a="$tmp/fa/tls/cert.pem"; ca_w="$tmp/fw/tls/cert.pem"
run() { "$py" felix-py/bench/bench.py "$@"; }
out="$tmp/results.jsonl"
for r in $(seq 1 "$rounds"); do
  echo "== round $r" >&2
  run pub-one   --system felix --addr "$fe" --token t --ca "$ca_e" --stream "one$r" --n 300000 | tee -a "$out"
  run pub-one   --system nats  --addr "$na" --stream "one$r" --n 300000 | tee -a "$out"
  run pub-batch --system felix --addr "$fe" --token t --ca "$ca_e" --stream "bat$r" --n 1000000 | tee -a "$out"
  run pub-batch --system nats  --addr "$na" --stream "bat$r" --n 1000000 | tee -a "$out"
  run pub-ack   --system felix --addr "$fd" --token t --ca "$ca_d" --stream "ack$r" --n 5000 | tee -a "$out"
  run pub-ack   --system nats  --addr "$nj" --stream "ack$r" --n 5000 | tee -a "$out"
  run pub-ack   --system felix --addr "$fa" --token t --ca "$ca_a" --stream "acf$r" --n 5000 --label fsync-always | tee -a "$out"
  run pub-ack   --system felix --addr "$fw" --token t --ca "$ca_w" --stream "acw$r" --n 5000 --label two-threads | tee -a "$out"
  run sub       --system felix --addr "$fe" --token t --ca "$ca_e" --stream "sub$r" --n 500000 | tee -a "$out"
  run sub       --system nats  --addr "$na" --stream "sub$r" --n 500000 | tee -a "$out"
  run hop --system felix --addr "$fe" --n 20000 | tee -a "$out"
  # The Rust client: batches of 100 (pub-batch's shape), publishing only; one request at a time.
  "$bin" bench --addr "$fe" --token t --ca "$ca_e" --payload 256 --batch 100 --subscribers 0 --duration 5s --tenant default 2>/dev/null \
    | grep -i "publish" | head -3 | sed "s/^/rust round $r: /" >&2 || true
  "$bin" bench --addr "$fd" --token t --ca "$ca_d" --cache --concurrency 1 --duration 3s 2>/dev/null \
    | grep -E "ops/s|p50" | sed "s/^/rust round $r (cache, one at a time): /" >&2 || true
done
echo "== medians of $rounds rounds (records/s)"
"$py" - "$out" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
hops = [r["us_per_call"] for r in rows if r["shape"] == "hop"]
shapes = ["pub-one", "pub-batch", "pub-ack", "sub"]
print(f"{'shape':10} {'felix-py':>12} {'nats-py':>12} {'ratio':>7}")
for s in shapes:
    f = [r["records_per_s"] for r in rows if r["shape"] == s and r["system"] == "felix" and not r.get("label")]
    n = [r["records_per_s"] for r in rows if r["shape"] == s and r["system"] == "nats"]
    if f and n:
        mf, mn = statistics.median(f), statistics.median(n)
        print(f"{s:10} {mf:12,.0f} {mn:12,.0f} {mf / mn:7.2f}")
a = [r["records_per_s"] for r in rows if r.get("label") == "fsync-always"]
if a:
    print(f"pub-ack with --fsync always (acknowledged once on disk): felix-py {statistics.median(a):,.0f}")
w = [r["records_per_s"] for r in rows if r.get("label") == "two-threads"]
n = [r["records_per_s"] for r in rows if r["shape"] == "pub-ack" and r["system"] == "nats"]
if w and n:
    mw, mn = statistics.median(w), statistics.median(n)
    print(f"pub-ack, broker with --worker-threads 2: felix-py {mw:,.0f} ({mw / mn:.2f} of nats-py)")
if hops:
    print(f"binding hand-off per call (no broker): {statistics.median(hops):.0f} us")
lost = [r for r in rows if r["shape"] == "sub" and r["received"] < r["expected"]]
for r in lost:
    print(f"note: {r['system']} subscriber received {r['received']} of {r['expected']}")
EOF
