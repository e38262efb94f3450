#!/usr/bin/env bash
# Memory of a replicated (quorum) cache's replicas, before and after a follower's restart:
# three `felix-node serve` brokers on loopback (`--cache-replication 3`), `felix-node bench
# --cache` putting values of --payload bytes over 16,000 keys for --duration seconds (the
# replicas checkpoint and compact every 8 MiB of entries), then each broker's resident memory
# and the snapshot data its engines hold; then a follower is SIGKILLed and started again on its
# data, and its resident memory is read once its replica of the cache caught up.
#
# With --behind the follower is SIGKILLed before the puts instead, so it comes back behind the
# leader's compaction and is sent the cache's snapshot: the leader's resident memory is sampled
# while it sends it (its growth over what it held just before is what the send costs it), and
# the pieces of snapshot it read back from its files are counted.
#
#   scripts/cache-restart-bench.sh [--bin PATH] [--payload BYTES] [--duration SECS] [--runs N] [--behind]
#
# Everything it starts is killed when it ends (or is interrupted); data lives in a temporary
# directory.
set -euo pipefail

payload=1500
duration=8
runs=1
behind=""
bin="target/release/felix-node"
while [ $# -gt 0 ]; do
  case "$1" in
    --bin) bin="$2"; shift 2 ;;
    --payload) payload="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --behind) behind=1; shift ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "$bin is not built: cargo build --release -p felix-node" >&2; exit 1; }

# shellcheck source=scripts/cluster-lib.sh
source "$(dirname "$0")/cluster-lib.sh"

# Resident memory of process $1: "peak now" in MB.
rss() { awk '/^VmHWM|^VmRSS/ {v[$1]=$2} END {printf "%.0f %.0f\n", v["VmHWM:"]/1024, v["VmRSS:"]/1024}' "/proc/$1/status"; }

# The cache replica's role and next offset on the broker with metrics at $1 ("- -": none yet).
replica() {
  python3 - "$1" <<'PY'
import json, sys, urllib.request
try:
    body = json.load(urllib.request.urlopen(f"http://{sys.argv[1]}/cluster", timeout=2))
except Exception:
    print("- -"); sys.exit(0)
r = next((r for r in body.get("replicas", []) if r.get("name") == "cache"), None)
print(f"{r.get('role', '-')} {r.get('next_offset', '-')}" if r else "- -")
PY
}

# A metric of the broker with metrics at $1 (0 when it does not answer).
metric() {
  python3 - "$1" "$2" <<'PY'
import sys, urllib.request
try:
    body = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=2).read().decode()
except Exception:
    print(0); sys.exit(0)
print(next((l.split()[1] for l in body.splitlines() if l.split()[:1] == [sys.argv[2]]), 0))
PY
}

one_run() {
  tmp=$(mktemp -d)
  local names=() client=() cluster=() metrics=() peers=""
  pick_three
  start_one() { serve_one "$1" --cache-replication 3; }
  for i in 0 1 2; do start_one "$i"; done
  wait_listening
  # The first put creates the cache (retried until the metadata group took it).
  local ok=""
  for _ in $(seq 1 100); do
    if "$bin" cache --addr "${client[0]}" --token bench-token --tenant bench --namespace bench \
         --insecure-accept-any-certificate put cache warm-up v >/dev/null 2>&1; then ok=1; break; fi
    sleep 0.1
  done
  [ -n "$ok" ] || { echo "the cache was never created" >&2; cat "$tmp"/n1.out >&2; return 1; }
  local l="" f=""
  if [ -n "$behind" ]; then
    # A follower goes down before the puts (n1 takes them; any other replica will do).
    for _ in $(seq 1 100); do
      for i in 0 1 2; do
        read -r role _ < <(replica "${metrics[$i]}")
        if [ "$role" = leader ]; then l=$i; fi
      done
      [ -n "$l" ] && break
      sleep 0.1
    done
    for i in 1 2; do [ "$i" != "$l" ] && { f=$i; break; }; done
    kill -9 "${pids[$f]}"
    wait "${pids[$f]}" 2>/dev/null || true
  fi
  local out
  out=$("$bin" bench --addr "${client[0]}" --token bench-token --tenant bench --cache --concurrency 16 \
        --data-dir "$tmp/${names[0]}" --payload "$payload" --duration "$duration" --json --quiet 2>"$tmp/bench.err") || { echo "the bench failed:" >&2; cat "$tmp/bench.err" >&2; cleanup; return 1; }
  python3 -c "import json,sys; v=json.loads(sys.argv[1].strip().splitlines()[-1]); print(f'payload={sys.argv[2]} cache ops/s={v[\"ops_per_s\"]:.0f}')" "$out" "$payload"
  sleep 2
  if [ -z "$behind" ]; then
    for i in 0 1 2; do
      read -r role _ < <(replica "${metrics[$i]}")
      if [ "$role" = leader ]; then l=$i; elif [ -z "$f" ]; then f=$i; fi
    done
  fi
  for i in 0 1 2; do
    [ -n "$behind" ] && [ "$i" = "$f" ] && continue
    read -r peak now < <(rss "${pids[$i]}")
    echo "  ${names[$i]}$([ "$i" = "$l" ] && echo ' (leader)'): peak RSS $peak MB, now $now MB, snapshot data held $(metric "${metrics[$i]}" felix_replica_snapshot_bytes) bytes"
  done
  [ -n "$l" ] || { echo "  no leader of the cache found" >&2; cleanup; return 1; }
  if [ -z "$behind" ]; then
    kill -9 "${pids[$f]}"
    wait "${pids[$f]}" 2>/dev/null || true
  fi
  local before_rss most_rss pieces_before
  read -r _ before_rss < <(rss "${pids[$l]}")
  most_rss=$before_rss
  pieces_before=$(metric "${metrics[$l]}" felix_replica_snapshot_reads_total)
  local t0
  t0=$(date +%s.%N)
  start_one "$f"
  local caught=""
  for _ in $(seq 1 1200); do
    read -r _ a < <(replica "${metrics[$f]}")
    read -r _ b < <(replica "${metrics[$l]}")
    read -r _ r < <(rss "${pids[$l]}")
    [ "$r" -gt "$most_rss" ] && most_rss=$r
    if [ "$a" != "-" ] && [ "$a" = "$b" ]; then caught=$(python3 -c "import sys,time; print(f'{time.time() - float(sys.argv[1]):.2f}')" "$t0"); break; fi
    sleep 0.02
  done
  echo "  leader ${names[$l]} while the follower caught up: RSS $before_rss MB before, at most $most_rss MB (+$((most_rss - before_rss)) MB); snapshot pieces read $(( $(metric "${metrics[$l]}" felix_replica_snapshot_reads_total) - pieces_before ))"
  sleep 3
  read -r peak now < <(rss "${pids[$f]}")
  echo "  restarted follower ${names[$f]}: caught up after ${caught:-(not within 60 s)} s, peak RSS $peak MB, now $now MB, snapshot data held $(metric "${metrics[$f]}" felix_replica_snapshot_bytes) bytes"
  cleanup
}

for _ in $(seq 1 "$runs"); do one_run; done
