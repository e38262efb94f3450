#!/usr/bin/env bash
# Acked publish throughput through a replicated stream's leader: three `felix-node serve`
# brokers on loopback, a fresh cluster per run, then `felix-node bench --ack` against the leader.
#
#   scripts/replication-bench.sh [--replication N] [--payload BYTES] [--duration SECS]
#                                [--fsync POLICY] [--bin PATH] [--runs N]
#                                [--retain-records N] [--rss] [--restart-follower [--no-summaries]]
#                                [--late-reader N] [--cpu] [--forwarded] [--subscribers0]
#                                [--bench-args "ARGS"] [--disk] [--follower-down]
#
# Prints one line per run: replication, payload, fsync policy, records/s, MB/s; with --rss, each
# broker's peak and current resident memory after the run. --retain-records N configures the
# bench stream (a [[streams]] entry) to retain N records (and N x 4 x payload bytes), so a long
# run keeps far more than memory budgets hold. --restart-follower then kills a follower
# (SIGKILL), starts it again on its data, and says how long until it listened and until its
# replica was caught up with the leader, and its peak RSS; --no-summaries removes the follower's
# segment summaries (`*.sum`) first, so its restart reads every record, to compare. Everything it starts is killed when
# it ends (or is interrupted); data lives in a temporary directory. --late-reader N replaces the
# live subscriber with one that starts N records behind the tail once N were published
# (`bench --late-reader`) and says how fast it read and whether it caught up; give
# --retain-records above N so retention keeps what it has to read. --cpu prints the CPU time each
# broker (leader first) and the bench client spent per published record during the run
# (user + system, from /proc), so replication's cost can be split per broker. --forwarded
# publishes through a broker that is not the shard's leader (it forwards every batch), with no
# subscriber; --subscribers0 runs the direct case the same way, to compare. --bench-args passes
# more arguments to `felix-node bench` (e.g. "--compress zstd --data json"); --disk prints the
# bytes each broker's replica logs hold per published record once the run is over (D59: a
# compressed batch stays compressed in every replica's log). --follower-down kills a follower
# (SIGKILL) before the run and starts it again after, as --restart-follower does: with a short
# --retain-records the leader compacts its log meanwhile, so the follower catches up from its
# snapshot, which the leader reads back from its files (the leader's snapshot reads are printed).
set -euo pipefail

replication=3
payload=256
duration=5
fsync=""
runs=1
retain=""
rss=""
restart=""
nosum=""
late=""
cpu=""
forwarded=""
nosub=""
bench_args=""
disk=""
down=""
bin="target/release/felix-node"
while [ $# -gt 0 ]; do
  case "$1" in
    --replication) replication="$2"; shift 2 ;;
    --payload) payload="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --fsync) fsync="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    --runs) runs="$2"; shift 2 ;;
    --retain-records) retain="$2"; shift 2 ;;
    --rss) rss=1; shift ;;
    --restart-follower) restart=1; shift ;;
    --no-summaries) nosum=1; shift ;;
    --late-reader) late="$2"; shift 2 ;;
    --cpu) cpu=1; shift ;;
    --forwarded) forwarded=1; shift ;;
    --subscribers0) nosub=1; shift ;;
    --bench-args) bench_args="$2"; shift 2 ;;
    --disk) disk=1; shift ;;
    --follower-down) down=1; shift ;;
    -h|--help) sed -n 2,24p "$0"; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
[ -x "$bin" ] || { echo "$bin is not built: cargo build --release -p felix-node" >&2; exit 1; }

# shellcheck source=scripts/cluster-lib.sh
source "$(dirname "$0")/cluster-lib.sh"

one_run() {
  tmp=$(mktemp -d)
  local names=() client=() cluster=() metrics=() peers=""
  pick_three
  local extra=()
  [ -n "$fsync" ] && extra+=(--fsync "$fsync")
  if [ -n "$retain" ]; then
    local quorum=""
    [ "$replication" != 1 ] && quorum=$'durability = "quorum"\nreplication = '"$replication"
    cat > "$tmp/streams.toml" <<TOML
[[streams]]
tenant = "bench"
namespace = "bench"
name = "b1"
shards = 1
retention = { max_records = $retain, max_bytes = $((retain * 4 * payload)) }
$quorum
TOML
    extra+=(--config "$tmp/streams.toml")
  fi
  start_one() { serve_one "$1" --default-shards 1 --default-replication "$replication" "${extra[@]}"; }
  for i in 0 1 2; do start_one "$i"; done
  wait_listening
  # Create the stream (the first publish is retried until the metadata group took it).
  local ok=""
  for _ in $(seq 1 100); do
    if "$bin" publish --addr "${client[0]}" --token bench-token --tenant bench --namespace bench \
         --insecure-accept-any-certificate b1 warm-up --ack >/dev/null 2>&1; then ok=1; break; fi
    # A redirect to the leader is a success for creation; try the others too.
    for i in 1 2; do
      if "$bin" publish --addr "${client[$i]}" --token bench-token --tenant bench --namespace bench \
           --insecure-accept-any-certificate b1 warm-up --ack >/dev/null 2>&1; then ok=1; break 2; fi
    done
    sleep 0.1
  done
  [ -n "$ok" ] || { echo "the stream was never created" >&2; cat "$tmp"/n1.out >&2; return 1; }
  # The leader: the broker whose status lists a leading replica of b1.
  local leader="" leader_dir=""
  for _ in $(seq 1 100); do
    for i in 0 1 2; do
      if python3 - "${metrics[$i]}" <<'PY'
import json, sys, urllib.request
body = json.load(urllib.request.urlopen(f"http://{sys.argv[1]}/cluster", timeout=2))
sys.exit(0 if any(r.get("name") == "b1" and r.get("role") == "leader" for r in body.get("replicas", [])) else 1)
PY
      then leader="${client[$i]}"; leader_dir="$tmp/${names[$i]}"; break 2; fi
    done
    [ "$replication" = 1 ] && break
    sleep 0.1
  done
  if [ -z "$leader" ]; then
    # One replica (or an old broker): the owner the metadata names.
    leader=$(python3 - "${metrics[0]}" <<'PY'
import json, sys, urllib.request
body = json.load(urllib.request.urlopen(f"http://{sys.argv[1]}/cluster", timeout=2))
owner = next(s["owner"] for s in body["shards"] if s["name"] == "b1")
print(next(m["client_addr"] for m in body["members"] if m["node_id"] == owner), owner)
PY
)
    leader_dir="$tmp/${leader#* }"
    leader="${leader% *}"
  fi
  local target="$leader"
  if [ -n "$forwarded" ]; then
    for i in 0 1 2; do
      [ "${client[$i]}" != "$leader" ] && { target="${client[$i]}"; leader_dir="$tmp/${names[$i]}"; break; }
    done
  fi
  # CPU ticks (user + system) of each broker, to split the run's cost per broker.
  ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }
  local before=()
  for i in 0 1 2; do before[i]=$(ticks "${pids[$i]}"); done
  # PERF_PIDS_FILE=F (for profiling): each broker's role and pid are written to F.
  if [ -n "${PERF_PIDS_FILE:-}" ]; then
    for i in 0 1 2; do
      r=follower; [ "${client[$i]}" = "$leader" ] && r=leader
      echo "$r ${pids[$i]}" >> "$PERF_PIDS_FILE"
    done
  fi
  local f="" l=""
  for i in 0 1 2; do
    if [ "${client[$i]}" = "$leader" ]; then l=$i; elif [ -z "$f" ]; then f=$i; fi
  done
  if [ -n "$down" ] && [ "$replication" != 1 ]; then
    kill -9 "${pids[$f]}"
    wait "${pids[$f]}" 2>/dev/null || true
  fi
  local out readers=(--subscribers 1)
  [ -n "$late" ] && readers=(--subscribers 0 --late-reader "$late")
  # A subscriber must read from the leader: a forwarded run publishes only.
  [ -n "$forwarded$nosub" ] && readers=(--subscribers 0)
  local more=()
  # shellcheck disable=SC2206
  [ -n "$bench_args" ] && more=($bench_args)
  out=$("$bin" bench --addr "$target" --token bench-token --stream b1 --ack "${readers[@]}" "${more[@]}" \
        --duration "$duration" --payload "$payload" --data-dir "$leader_dir" --tenant bench --json --quiet 2>/dev/null)
  local split=""
  if [ -n "$cpu" ]; then
    local hz
    hz=$(getconf CLK_TCK)
    for i in 0 1 2; do
      local role=follower
      [ "${client[$i]}" = "$leader" ] && role=leader
      [ "$replication" = 1 ] && [ "$role" = follower ] && role=idle
      [ "${client[$i]}" = "$target" ] && [ "$role" != leader ] && role=forwarding
      split+="${names[$i]}:$role:$(( $(ticks "${pids[$i]}") - before[i] )):$hz "
    done
  fi
  python3 - "$replication" "$payload" "${fsync:-default}" "$out" "$split" <<'PY'
import json, sys
r, p, f, out, split = sys.argv[1:]
v = json.loads(out.strip().splitlines()[-1])
rps = v["publish_msgs_per_s"]
print(f"replication={r} payload={p} fsync={f} records/s={rps:.0f} MB/s={rps*int(p)/1e6:.1f}")
if split:
    n = max(v["published_msgs"], 1)
    parts = []
    for item in sorted(split.split(), key=lambda x: x.split(":")[1] != "leader"):
        name, role, t, hz = item.split(":")
        parts.append(f"{name} ({role}) {int(t) / int(hz) * 1e6 / n:.2f}")
    bench = v.get("cpu_us_per_record")
    print("  CPU µs per record: " + ", ".join(parts) + (f", bench client {bench:.2f}" if bench else ""))
l = v.get("late_reader")
if l:
    caught = f"caught up after {l['caught_up_after_s']:.2f} s" if l["caught_up_after_s"] is not None else f"not caught up ({l['last_record_age_s']:.1f} s behind at the end)"
    print(f"  late reader {l['behind']} behind: {l['read_per_s_while_behind']:.0f} records/s while behind, {caught}, {l['skipped_by_retention']} skipped by retention")
PY
  if [ -n "$disk" ]; then
    local n
    n=$(python3 -c "import json,sys; print(json.loads(sys.argv[1].strip().splitlines()[-1])['published_msgs'])" "$out")
    sleep 1
    for i in 0 1 2; do
      local b
      b=$(du -sb "$tmp/${names[$i]}/cluster/replicas" 2>/dev/null | cut -f1)
      python3 -c "import sys; print(f'  {sys.argv[1]}: replica logs {int(sys.argv[2] or 0) / max(int(sys.argv[3]), 1):.1f} bytes per record')" "${names[$i]}" "${b:-0}" "$n"
    done
  fi
  if [ -n "$rss" ]; then
    for i in 0 1 2; do
      [ -e "/proc/${pids[$i]}/status" ] || continue # (a follower kept down, --follower-down)
      awk -v n="${names[$i]}" '/^VmHWM|^VmRSS/ {v[$1]=$2} END {printf "  %s: peak RSS %.0f MB, now %.0f MB\n", n, v["VmHWM:"]/1024, v["VmRSS:"]/1024}' "/proc/${pids[$i]}/status"
    done
  fi
  if [ -n "$restart$down" ] && [ "$replication" != 1 ]; then
    if [ -z "$down" ]; then
      kill -9 "${pids[$f]}"
      wait "${pids[$f]}" 2>/dev/null || true
    fi
    local lines
    lines=$(wc -l < "$tmp/${names[$f]}.out")
    if [ -n "$nosum" ]; then
      # The closed segments' summaries removed: the restart reads every record (as before them).
      find "$tmp/${names[$f]}/cluster/replicas" -name '*.sum' -delete
    fi
    local t0
    t0=$(date +%s.%N)
    start_one "$f"
    python3 - "${metrics[$f]}" "${metrics[$l]}" "$t0" "$tmp/${names[$f]}.out" "$lines" "${pids[$f]}" "${pids[$l]}" <<'PY'
import json, sys, time, urllib.request
mine, leader, t0, out, skip, pid, lpid = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4], int(sys.argv[5]), sys.argv[6], sys.argv[7]
def rss_mb(p):
    try:
        return next(int(l.split()[1]) for l in open(f"/proc/{p}/status") if l.startswith("VmRSS")) / 1024
    except Exception:
        return 0
def queued(addr):
    try:
        body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=2).read().decode()
    except Exception:
        return 0
    return next((int(l.split()[1]) for l in body.splitlines() if l.split()[:1] == ["felix_peer_queued_bytes"]), 0)
leader_before = rss_mb(lpid)
leader_most, queued_most = leader_before, 0
def next_offset(addr):
    try:
        body = json.load(urllib.request.urlopen(f"http://{addr}/cluster", timeout=2))
    except Exception:
        return None
    return next((r.get("next_offset") for r in body.get("replicas", []) if r.get("name") == "b1"), None)
listening = None
deadline = time.time() + 300
while time.time() < deadline:
    if listening is None and any("listening" in l for l in open(out).readlines()[skip:]):
        listening = time.time() - t0
    a, b = next_offset(mine), next_offset(leader)
    leader_most, queued_most = max(leader_most, rss_mb(lpid)), max(queued_most, queued(leader))
    if a is not None and a == b:
        caught = time.time() - t0
        time.sleep(2)
        st = {l.split(":")[0]: int(l.split()[1]) for l in open(f"/proc/{pid}/status") if l.startswith(("VmHWM", "VmRSS"))}
        summary = next((l.strip() for l in open(out).readlines()[skip:] if "replica logs read back" in l), "")
        if summary:
            print("  " + summary[summary.index("replica logs read back"):])
        print(f"  restarted follower: listening after {listening or 0:.2f} s, caught up (next offset {a}) after {caught:.2f} s, peak RSS {st['VmHWM'] / 1024:.0f} MB, {st['VmRSS'] / 1024:.0f} MB 2 s later")
        def metrics(addr):
            body = urllib.request.urlopen(f"http://{addr}/metrics", timeout=2).read().decode()
            return {l.split()[0]: l.split()[1] for l in body.splitlines() if l.startswith("felix_replica_snapshot")}
        m = metrics(leader)
        print(f"  leader: {m.get('felix_replica_snapshot_reads_total', '?')} snapshot reads, {m.get('felix_replica_snapshot_bytes', '?')} bytes of snapshot data in memory")
        print(f"  leader while the follower caught up: RSS {leader_before:.0f} MB before, at most {leader_most:.0f} MB (+{leader_most - leader_before:.0f} MB); at most {queued_most / 1048576:.1f} MiB queued for peers")
        sys.exit(0)
    time.sleep(0.05)
print("  restarted follower: not caught up within 300 s")
PY
  fi
  cleanup
}

for _ in $(seq 1 "$runs"); do one_run; done
