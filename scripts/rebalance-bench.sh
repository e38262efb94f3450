#!/usr/bin/env bash
# Publishers during a rebalance: three `felix-node serve` brokers hold replicated (RF 3)
# streams with data; an acknowledged publisher runs throughout, measured in consecutive
# windows; brokers 4 to 7 are started and added (`cluster add`) after the first windows, and
# the metadata leader moves replicas onto them by itself. Each window is marked steady (no move
# in progress at any time during it) or rebalancing, and the script prints both medians and
# their ratio, how long the rebalance took and how many bytes the moves copied.
#
#   scripts/rebalance-bench.sh [--move-bandwidth RATE] [--streams N] [--preload MB]
#                              [--payload BYTES] [--rate N] [--window SECS] [--steady N]
#                              [--add N] [--bin PATH]
#
# --move-bandwidth is given to every broker (`serve --move-bandwidth`, e.g. 20MB/s; default
# unlimited). --streams N single-shard RF 3 streams (default 12) are each filled with --preload
# MiB (default 20, 1 KiB records) before the measured publisher starts: what the moves copy.
# The publisher is `felix-node bench --ack --payload BYTES` (default 256) to the leader of its
# own RF 3 stream `live` (looked up before each window; it retains 64 MiB, so its own moves
# copy a bounded log), as fast as it goes or offering --rate records/s, --window seconds a run
# (default 2), --steady runs (default 4) before the brokers are added and as many after the
# last move; --add brokers (default 4: n4..n7) join. Windows are reported before, during and
# after the rebalance. Moves run at most four at a time (the balancer's own limit). Everything it starts is killed when
# it ends; data lives in a temporary directory.
set -euo pipefail

bandwidth=""
streams=12
preload=20
payload=256
rate=0
window=2
steady=4
add=4
bin="target/release/felix-node"
while [ $# -gt 0 ]; do
  case "$1" in
    --move-bandwidth) bandwidth="$2"; shift 2 ;;
    --streams) streams="$2"; shift 2 ;;
    --preload) preload="$2"; shift 2 ;;
    --payload) payload="$2"; shift 2 ;;
    --rate) rate="$2"; shift 2 ;;
    --window) window="$2"; shift 2 ;;
    --steady) steady="$2"; shift 2 ;;
    --add) add="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n 2,20p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "$bin is not built: cargo build --release -p felix-node" >&2; exit 1; }
[ "$add" -ge 1 ] && [ "$add" -le 4 ] || { echo "--add takes 1 to 4" >&2; exit 2; }

# shellcheck source=scripts/cluster-lib.sh
source "$(dirname "$0")/cluster-lib.sh"

tmp=$(mktemp -d)
# The brokers the adder (a subshell) starts are not in `pids`: killed from the file.
kill_listed() {
  if [ -n "$tmp" ] && [ -f "$tmp/pids" ]; then
    while read -r p; do kill -9 "$p" 2>/dev/null || true; done < "$tmp/pids"
  fi
}
trap 'kill_listed; cleanup' EXIT
total=$((3 + add))
names=() client=() cluster=() metrics=()
for i in $(seq 1 "$total"); do
  names+=("n$i")
  client+=("127.0.0.1:$(free_port udp)")
  cluster+=("127.0.0.1:$(free_port udp)")
  metrics+=("127.0.0.1:$(free_port tcp)")
done
founders="${names[0]}=${cluster[0]},${names[1]}=${cluster[1]},${names[2]}=${cluster[2]}"
cat > "$tmp/live.toml" <<TOML
[[streams]]
tenant = "bench"
namespace = "bench"
name = "live"
shards = 1
durability = "quorum"
replication = 3
retention = { max_bytes = 67108864 }
TOML
extra=(--config "$tmp/live.toml")
[ -n "$bandwidth" ] && extra+=(--move-bandwidth "$bandwidth")

start_one() {
  local i=$1 peers=$2
  shift 2
  "$bin" serve --listen "${client[$i]}" --data-dir "$tmp/${names[$i]}" --dev-token bench-token \
    --node-id "${names[$i]}" --default-shards 1 --default-replication 3 \
    --cluster-listen "${cluster[$i]}" --peers "$peers" --cluster-secret s \
    --metrics-listen "${metrics[$i]}" "${extra[@]}" "$@" >> "$tmp/${names[$i]}.out" 2>&1 &
  pids[i]=$!
  # (Started by the adder in a subshell too: listed for the exit trap.)
  echo "$!" >> "$tmp/pids"
  for _ in $(seq 1 300); do grep -q "listening" "$tmp/${names[$i]}.out" && return 0; sleep 0.1; done
  echo "${names[$i]} did not start" >&2
  cat "$tmp/${names[$i]}.out" >&2
  exit 1
}
for i in 0 1 2; do start_one "$i" "$founders"; done

cli() { "$bin" "$@" --addr "${client[0]}" --token bench-token --tenant bench --namespace bench --insecure-accept-any-certificate; }
stream_names=()
for s in $(seq 1 "$streams"); do stream_names+=("w$s"); done
for _ in $(seq 1 100); do
  cli stream create "${stream_names[@]}" --shards 1 --replication 3 >/dev/null 2>&1 && break
  sleep 0.2
done
# The client address of the broker leading `live` now (as n1's metadata names it), so the
# publisher writes to its leader directly, as a cluster client does, before and after moves.
live_leader() {
  python3 - "${metrics[0]}" "${client[0]}" <<'PY' 2>/dev/null || echo "${client[0]}"
import json, sys, urllib.request
body = json.load(urllib.request.urlopen(f"http://{sys.argv[1]}/cluster", timeout=2))
owner = next((s["owner"] for s in body.get("shards", []) if s.get("name") == "live"), None)
print(next((m["client_addr"] for m in body.get("members", []) if m.get("node_id") == owner), sys.argv[2]))
PY
}
bench() {
  local at="${client[0]}"
  [ "${1:-}" = "--at" ] && { at="$2"; shift 2; }
  # Every broker's certificate, the ones started since too.
  cat "$tmp"/n*/tls/cert.pem > "$tmp/certs.pem"
  "$bin" bench --addr "$at" --token bench-token --tenant bench --ca "$tmp/certs.pem" --ack \
    --subscribers 0 --json --quiet "$@" 2>> "$tmp/bench.err" | tail -n 1
}
echo "preloading $streams streams with $preload MiB each" >&2
for s in "${stream_names[@]}"; do
  bench --stream "$s" --payload 1024 --duration 1 --rate $((preload * 1024)) >/dev/null
done

# Moves in progress, polled: one line per poll, `SECONDS.NANOS COUNT`.
poll_moves() {
  while true; do
    python3 - "${metrics[0]}" <<'PY' || true
import json, sys, time, urllib.request
try:
    body = json.load(urllib.request.urlopen(f"http://{sys.argv[1]}/cluster", timeout=2))
    print(f"{time.time():.3f} {len(body.get('moves', []))}", flush=True)
except Exception:
    pass
PY
    sleep 0.2
  done
}
poll_moves >> "$tmp/moves.log" &
pids+=($!)

add_brokers() {
  local i members="$founders"
  for i in $(seq 3 $((total - 1))); do
    members+=",${names[$i]}=${cluster[$i]}"
    start_one "$i" "$members" --join
    "$bin" cluster add "${names[$i]}=${cluster[$i]}" --metrics "${metrics[0]}" --cluster-secret s --wait 30s >/dev/null
  done
  date +%s.%N > "$tmp/added"
}

# The publisher's windows: `START END RECORDS/S`.
: > "$tmp/windows"
run_window() {
  local a b out
  a=$(date +%s.%N)
  local offered=()
  [ "$rate" != 0 ] && offered=(--rate "$rate")
  out=$(bench --at "$(live_leader)" --stream live --payload "$payload" --duration "$window" --resend-refused "${offered[@]}" || true)
  b=$(date +%s.%N)
  if [ -z "$out" ]; then
    # The run failed: said, and counted as a window with nothing acknowledged.
    echo "a publisher run failed: $(tail -n 1 "$tmp/bench.err")" >&2
    echo "$a $b 0" >> "$tmp/windows"
    return
  fi
  echo "$a $b $(python3 -c 'import json,sys; print(round(json.loads(sys.argv[1])["publish_msgs_per_s"]))' "$out")" >> "$tmp/windows"
}
for _ in $(seq 1 "$steady"); do run_window; done
add_brokers &
adder=$!
pids+=("$adder")
# Until the adds are done and no move has been seen for as many windows as before them.
quiet=0
for _ in $(seq 1 200); do
  run_window
  if [ -f "$tmp/added" ] && [ "$(tail -n 1 "$tmp/moves.log" | awk '{print $2}')" = 0 ]; then
    quiet=$((quiet + 1))
    [ "$quiet" -ge "$steady" ] && break
  else
    quiet=0
  fi
done
wait "$adder" 2>/dev/null || true

copied=0
for i in $(seq 0 $((total - 1))); do
  c=$(python3 -c 'import sys, urllib.request; print(next((l.split()[1] for l in urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=2).read().decode().splitlines() if l.startswith("felix_move_bytes_total ")), 0))' "${metrics[$i]}" 2>/dev/null || echo 0)
  copied=$((copied + ${c:-0}))
done
python3 - "$tmp/windows" "$tmp/moves.log" "$tmp/added" "${bandwidth:-unlimited}" "$copied" "$payload" "$rate" <<'PY'
import statistics, sys
windows_f, moves_f, added_f, bw, copied, payload, rate = sys.argv[1:]
windows = [tuple(float(x) for x in l.split()) for l in open(windows_f) if l.strip()]
polls = [tuple(float(x) for x in l.split()) for l in open(moves_f) if l.strip()]
busy = [t for t, n in polls if n > 0]
first, last = (min(busy), max(busy)) if busy else (None, None)
before, moving, after = [], [], []
for a, b, rps in windows:
    if any(a <= t <= b for t in busy):
        moving.append(rps)
    elif first is None or b < first:
        before.append(rps)
    else:
        after.append(rps)
steady = before + after
offered = "as fast as it goes" if rate == "0" else f"offering {rate}/s"
print(f"move-bandwidth={bw} payload={payload} {offered}: {len(before)} windows before, {len(moving)} rebalancing, {len(after)} after")
for label, xs in (("before (3 brokers)", before), ("rebalancing", moving), ("after (7 brokers)", after)):
    if xs:
        print(f"  {label} records/s: median {statistics.median(xs):.0f}, lowest {min(xs):.0f} ({', '.join(f'{r:.0f}' for r in xs)})")
if steady and moving:
    m = statistics.median(moving)
    print(f"  rebalancing / steady (before and after): median {m / statistics.median(steady):.2f}, lowest window {min(moving) / statistics.median(steady):.2f}")
    if after:
        print(f"  rebalancing / after: median {m / statistics.median(after):.2f}")
if busy:
    print(f"  moves in progress for {last - first:.1f} s; {int(copied) / 1e6:.1f} MB copied by moves")
PY
