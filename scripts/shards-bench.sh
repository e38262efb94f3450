#!/usr/bin/env bash
# Many shards on a three-broker cluster: what declaring them costs and what they cost at rest.
# Each run starts three `felix-node serve` brokers on loopback with a configuration declaring
# STREAMS streams of SHARDS shards each (`[[streams]]`, durability "quorum" with replication RF,
# or one copy on disk with RF 1), and reports:
#   - how long until every broker's view (`/cluster`) names an owner for every shard;
#   - each broker's resident memory then, against a run with no streams (same script, same
#     machine): memory per shard, summed over the three brokers;
#   - each broker's CPU while everything sits idle for IDLE seconds (% of one core).
#
#   scripts/shards-bench.sh [--streams N] [--shards N] [--rf N] [--idle SECS] [--bin PATH]
#                           [--hold SECS] [--kill] [--kill-which I] [--via-cli]
#                           [--metadata-snapshot-entries N]
#
# --via-cli creates the streams at run time instead, with one `felix-node stream create
# --from-file` through the first broker once the three have formed (D60), and times from there.
#
# After the idle time it also says, per broker, what the metadata log holds: entries since the
# last metadata snapshot, snapshots taken, the last one's size, and the size of raft.log.
# --metadata-snapshot-entries passes that flag to every broker (0: never compact, the A/B).
#
# --hold keeps the cluster running that long after the measurement (to look at it: each
# broker's /cluster and /metrics), and skips the baseline run. --kill then SIGKILLs the first
# broker (--kill-which 1 or 2: the second or third) and says, of the shards it owned (led), how
# long until both survivors named another leader: from their own logs (median, 90th and 99th
# percentiles, the slowest), and when their /cluster views last changed (polled; a busy broker
# answers late, so that is an upper bound), how many had none within 60 s, and which broker led
# the metadata group (its death means an election there first).
#
# Defaults: 250 streams x 4 shards, RF 3, 10 s idle. Everything it starts is killed when it
# ends; data lives in a temporary directory.
set -euo pipefail

streams=250
shards=4
rf=3
idle=10
bin="target/release/felix-node"
hold=0
kill=""
which=0
via_cli=""
meta_every=()
while [ $# -gt 0 ]; do
  case "$1" in
    --streams) streams="$2"; shift 2 ;;
    --shards) shards="$2"; shift 2 ;;
    --rf) rf="$2"; shift 2 ;;
    --idle) idle="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --hold) hold="$2"; shift 2 ;;
    --kill) kill=1; shift ;;
    --kill-which) kill=1; which="$2"; shift 2 ;;
    --via-cli) via_cli=1; shift ;;
    --metadata-snapshot-entries) meta_every=(--metadata-snapshot-entries "$2"); shift 2 ;;
    -h|--help) sed -n 2,28p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "$bin is not built: cargo build --release -p felix-node" >&2; exit 1; }

# shellcheck source=scripts/cluster-lib.sh
source "$(dirname "$0")/cluster-lib.sh"
rss_kib() { awk '/^VmRSS/ {print $2}' "/proc/$1/status"; }
cpu_ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# "sleeping/groups" of a broker's replicated shards' Raft groups, from its metrics.
sleeping() {
  python3 - "$1" <<'PY'
import sys, urllib.request
try:
    body = urllib.request.urlopen(f"http://{sys.argv[1]}/metrics", timeout=5).read().decode()
except Exception:
    print("-"); sys.exit(0)
vals = {}
for line in body.splitlines():
    parts = line.split()
    if len(parts) == 2 and parts[0] in ("felix_replica_groups", "felix_replica_groups_sleeping"):
        vals[parts[0]] = parts[1]
print(f"{vals['felix_replica_groups_sleeping']}/{vals['felix_replica_groups']}" if len(vals) == 2 else "-")
PY
}

# SIGKILLs broker $1 (pid $2) and reports how long until the survivors ($3, $4: metrics
# addresses; $5, $6: their logs) both name another owner for each shard it owned. The times
# are read from the survivors' own logs ("X leads SHARD", logged as the metadata applies it):
# their /cluster answers, on the same busy task, came seconds late while thousands of groups
# elected, and timing the polls measured that instead. The polls are once a second (each
# renders the whole status), so that column is an upper bound to within a second.
kill_first() {
  python3 - "$@" <<'PY'
import datetime, json, os, re, signal, sys, time, urllib.request
victim, pid, survivors, logs = sys.argv[1], int(sys.argv[2]), sys.argv[3:5], sys.argv[5:7]
def cluster(addr):
    return json.load(urllib.request.urlopen(f"http://{addr}/cluster", timeout=5))
def owners(addr):
    body = cluster(addr)
    return {(s["name"], s["shard"]): s.get("owner") for s in body.get("shards", []) if s.get("tenant") == "bench"}
led = {k for k, o in owners(survivors[0]).items() if o == victim}
meta_leader = cluster(survivors[0]).get("leader")
def leads(addr):
    body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    for line in body.splitlines():
        if line.startswith("felix_metadata_leads_applied_total "):
            return int(line.split()[1])
    return None
base = [leads(a) for a in survivors]
steps = []
t0 = time.time()
os.kill(pid, signal.SIGKILL)
moved = {}
applied_at = [None, None]
polls = 0
while time.time() - t0 < 60 and (len(moved) < len(led) or (None not in base and None in applied_at)):
    now = time.time() - t0
    # Ten times a second, each survivor's count of leadership claims its metadata applied
    # (cheap): all of the dead broker's shards have their new owner there once it grew by
    # as many.
    for i, a in enumerate(survivors):
        try:
            n = leads(a)
        except Exception:
            n = None
        if applied_at[i] is None and n is not None and base[i] is not None and n - base[i] >= len(led):
            applied_at[i] = now
    # Once a second the whole views: each poll renders the status of 10,000 shards on the
    # survivor's task, and ten a second took 43% of its CPU while it failed over (perf): the
    # poller slowed what it timed.
    if polls % 10 == 0 and len(moved) < len(led):
        try:
            views = [owners(a) for a in survivors]
            for k in led:
                if k not in moved and all(v.get(k) not in (None, victim) for v in views):
                    moved[k] = now
        except Exception:
            pass
    if not steps or steps[-1][1] != len(moved):
        steps.append((now, len(moved)))
    polls += 1
    time.sleep(0.1)
# When each survivor's metadata applied a new owner for each shard, from its log.
line = re.compile(r"^(\S+Z) .*cluster: (\S+) leads bench/bench/(s\d+)#(\d+) \(term")
ansi = re.compile(r"\x1b\[[0-9;]*m")
applied = []
for path in logs:
    first = {}
    for raw in open(path, errors="replace"):
        m = line.match(ansi.sub("", raw))
        if not m or m.group(2) == victim:
            continue
        at = datetime.datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp() - t0
        k = (m.group(3), int(m.group(4)))
        if at > 0 and k in led and k not in first:
            first[k] = at
    applied.append(first)
polled = sorted(moved.values())
from_logs = [k for k in moved if all(k in a for a in applied)]
ts = sorted(max(a[k] for a in applied) for k in from_logs)
pct = lambda p: ts[min(len(ts) - 1, int(p * len(ts)))] if ts else float("nan")
print(f"  SIGKILL of {victim}, which owned {len(led)} shards: every survivor's /cluster named another owner "
      f"for {len(polled)} of them, the last seen {polled[-1] if polled else float('nan'):.2f} s after the kill "
      f"(polls of the busy brokers lag); {len(led) - len(polled)} without one after 60 s")
print(f"  from the survivors' logs (both named the new leader), for {len(ts)} of them: median {pct(0.5):.2f} s, "
      f"p90 {pct(0.9):.2f} s, p99 {pct(0.99):.2f} s, slowest {ts[-1] if ts else float('nan'):.2f} s "
      f"(the metadata group's leader was {meta_leader})")
if None not in base:
    said = ", ".join("not within 60 s" if t is None else f"{t:.2f} s" for t in applied_at)
    print(f"  each survivor's metadata applied a new owner for all {len(led)} (its count of applied "
          f"leadership claims, polled ten times a second): {said} after the kill")
PY
}

# One cluster with $1 streams; prints "seconds rss1 rss2 rss3 cpu1 cpu2 cpu3 sleep1 sleep2 sleep3".
one_run() {
  local n_streams=$1
  tmp=$(mktemp -d)
  local names=() client=() cluster=() metrics=() peers=""
  pick_three
  python3 - "$n_streams" "$shards" "$rf" > "$tmp/streams.toml" <<'PY'
import sys
n, shards, rf = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    print("[[streams]]")
    print('tenant = "bench"\nnamespace = "bench"')
    print(f'name = "s{i}"\nshards = {shards}')
    if rf > 1:
        print(f'durability = "quorum"\nreplication = {rf}')
    else:
        print("durable = true")
    print()
PY
  local started config=(--config "$tmp/streams.toml")
  [ -z "$via_cli" ] || config=()
  started=$(date +%s.%N)
  for i in 0 1 2; do
    "$bin" serve --listen "${client[$i]}" --data-dir "$tmp/${names[$i]}" --dev-token bench-token \
      --node-id "${names[$i]}" --cluster-listen "${cluster[$i]}" --peers "$peers" --cluster-secret s \
      --metrics-listen "${metrics[$i]}" "${config[@]}" "${meta_every[@]}" >> "$tmp/${names[$i]}.out" 2>&1 &
    pids[i]=$!
  done
  if [ -n "$via_cli" ] && [ "$n_streams" != 0 ]; then
    # Formed first (three members, a leader), then one command creates every stream.
    for _ in $(seq 1 300); do
      python3 - "${metrics[@]}" <<'PY' && break
import json, sys, urllib.request
for m in sys.argv[1:]:
    try:
        body = json.load(urllib.request.urlopen(f"http://{m}/cluster", timeout=5))
    except Exception:
        sys.exit(1)
    if len(body.get("members", [])) < 3 or body.get("leader") is None:
        sys.exit(1)
sys.exit(0)
PY
      sleep 0.2
    done
    python3 - "$n_streams" "$shards" "$rf" > "$tmp/streams.txt" <<'PY'
import sys
n, shards, rf = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
for i in range(n):
    print(f"s{i} {shards} {rf}")
PY
    started=$(date +%s.%N)
    FELIX_DATA_DIR="$tmp/${names[0]}" "$bin" stream create --from-file "$tmp/streams.txt" --addr "${client[0]}" \
      --tenant bench --namespace bench --token bench-token --wait 600s > "$tmp/create.out" 2>> "$tmp/create.err" \
      || { echo "stream create failed:" >&2; tail -5 "$tmp/create.err" >&2; return 1; }
    echo "  stream create: $(head -1 "$tmp/create.out")" >&2
  fi
  local want=$((n_streams * shards))
  local done_at=""
  for _ in $(seq 1 3000); do
    if python3 - "$want" "${metrics[@]}" <<'PY'
import json, sys, urllib.request
want = int(sys.argv[1])
for m in sys.argv[2:]:
    try:
        body = json.load(urllib.request.urlopen(f"http://{m}/cluster", timeout=5))
    except Exception:
        sys.exit(1)
    owned = [s for s in body.get("shards", []) if s.get("tenant", "bench") == "bench" and s.get("owner")]
    if len(owned) < want or len(body.get("members", [])) < 3:
        sys.exit(1)
sys.exit(0)
PY
    then done_at=$(date +%s.%N); break; fi
    sleep 0.2
  done
  [ -n "$done_at" ] || { echo "not every shard had an owner within 10 minutes" >&2; tail -5 "$tmp/n1.out" >&2; return 1; }
  # Settle (elections, first heartbeats), then measure at rest: with hibernation, once every
  # broker's groups sleep (at most 120 s more; a build without the metrics waits 3 s).
  sleep 3
  local asleep_at=""
  for _ in $(seq 1 600); do
    local all=1
    for i in 0 1 2; do
      local sg
      sg=$(sleeping "${metrics[$i]}")
      if [ "$sg" = "-" ]; then all=2; break; fi
      [ "${sg%/*}" = "${sg#*/}" ] || all=0
    done
    [ "$all" = 2 ] && break
    if [ "$all" = 1 ]; then asleep_at=$(date +%s.%N); break; fi
    sleep 0.2
  done
  if [ -n "$asleep_at" ]; then
    echo "  every group asleep $(python3 -c "print(f'{$asleep_at - $done_at:.1f}')") s after every owner was known" >&2
  fi
  local before=() after=()
  for i in 0 1 2; do before+=("$(cpu_ticks "${pids[$i]}")"); done
  sleep "$idle"
  for i in 0 1 2; do after+=("$(cpu_ticks "${pids[$i]}")"); done
  local hz
  hz=$(getconf CLK_TCK)
  local line
  line=$(python3 -c "print(f'{$done_at - $started:.2f}')")
  for i in 0 1 2; do line+=" $(rss_kib "${pids[$i]}")"; done
  for i in 0 1 2; do line+=" $(python3 -c "print(f'{(${after[$i]} - ${before[$i]}) / $hz / $idle * 100:.1f}')")"; done
  # How many of each broker's Raft groups sleep (hibernation), as "sleeping/groups"; "-" from
  # a broker without the metrics (older builds).
  for i in 0 1 2; do line+=" $(sleeping "${metrics[$i]}")"; done
  echo "$line"
  if [ "$n_streams" != 0 ]; then
    for i in 0 1 2; do
      python3 - "${names[$i]}" "${metrics[$i]}" "$tmp/${names[$i]}/cluster/raft.log" >&2 <<'PY'
import os, sys, urllib.request
name, addr, path = sys.argv[1:4]
try:
    body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
except Exception:
    body = ""
vals = {}
for line in body.splitlines():
    parts = line.split()
    if len(parts) == 2 and parts[0].startswith("felix_metadata_"):
        vals[parts[0]] = int(float(parts[1]))
size = os.path.getsize(path) if os.path.exists(path) else 0
print(f"  {name} metadata log: {vals.get('felix_metadata_log_entries', '-')} entries held, "
      f"{vals.get('felix_metadata_snapshots_total', '-')} snapshots taken (the last {vals.get('felix_metadata_snapshot_bytes', 0) / 1e6:.2f} MB), "
      f"raft.log {size / 1e6:.2f} MB")
PY
    done
  fi
  if [ "$hold" != 0 ] && [ "$n_streams" != 0 ]; then
    echo "  holding the cluster for $hold s: metrics at ${metrics[*]}" >&2
    sleep "$hold"
  fi
  if [ -n "$kill" ] && [ "$n_streams" != 0 ]; then
    local others=() logs=()
    for i in 0 1 2; do
      [ "$i" = "$which" ] || { others+=("${metrics[$i]}"); logs+=("$tmp/${names[$i]}.out"); }
    done
    kill_first "${names[$which]}" "${pids[$which]}" "${others[@]}" "${logs[@]}" >&2
  fi
  cleanup
}

if [ "$hold" = 0 ]; then
  echo "baseline: three brokers, no streams" >&2
  read -r _ b1 b2 b3 c1 c2 c3 _ _ _ <<< "$(one_run 0)"
  echo "  resident ${b1} / ${b2} / ${b3} KiB, idle CPU ${c1}% / ${c2}% / ${c3}% of a core" >&2
else
  b1=0 b2=0 b3=0
fi
echo "$streams streams x $shards shards, RF $rf" >&2
read -r secs r1 r2 r3 d1 d2 d3 s1 s2 s3 <<< "$(one_run "$streams")"
total=$((streams * shards))
python3 - "$total" "$secs" "$b1" "$b2" "$b3" "$r1" "$r2" "$r3" "$d1" "$d2" "$d3" "$rf" "$s1" "$s2" "$s3" <<'PY'
import sys
total, secs = int(sys.argv[1]), float(sys.argv[2])
base = [int(x) for x in sys.argv[3:6]]
rss = [int(x) for x in sys.argv[6:9]]
cpu = [float(x) for x in sys.argv[9:12]]
rf = int(sys.argv[12])
grown = sum(r - b for r, b in zip(rss, base))
print(f"{total} shards (RF {rf}) owned on every broker after {secs:.1f} s")
print(f"resident per broker: {' / '.join(f'{r / 1024:.1f}' for r in rss)} MiB "
      f"(no streams: {' / '.join(f'{b / 1024:.1f}' for b in base)})")
print(f"memory per shard, three brokers together: {grown / total:.1f} KiB "
      f"(per replica: {grown / total / rf:.1f} KiB)")
print(f"idle CPU per broker: {' / '.join(f'{c:.1f}%' for c in cpu)} of a core")
print(f"Raft groups asleep per broker (sleeping/groups, after the idle time): {' / '.join(sys.argv[13:16])}")
PY
