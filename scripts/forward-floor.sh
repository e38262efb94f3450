#!/usr/bin/env bash
# What a forwarded publish costs the brokers against a direct one, and against the floor a
# bare quinn relay sets at the same load.
#
#   scripts/forward-floor.sh [--rounds N] [--payload BYTES] [--duration SECS] [--bin PATH]
#
# Each round, on this machine, one after another:
#   1. direct: `replication-bench.sh --replication 1 --subscribers0 --cpu` (the client publishes
#      to the shard's owner);
#   2. forwarded: the same through a broker that is not the owner (`--forwarded`);
#   3. `bench --raw-quinn` and `bench --raw-quinn --relay` paced at the forwarded run's records/s
#      (`--rate`): the same bytes per second through one bare quinn hop, then through two with a
#      relay between them. The relay's CPU minus one hop's is what a second hop costs at that
#      load: the least a forwarding broker can spend, since it receives and sends every byte.
# It prints, per round and as medians: the brokers' CPU per record direct and forwarded (owner
# + forwarder), the forwarded/direct ratio, the bare hop's cost per record, the floor ratio
# (direct + bare hop) / direct, and the forwarder against the bare hop.
#
# CPU per GB at a third of a core's worth of traffic is not CPU per GB flat out: a path run at
# full speed amortises each wake-up, system call and ACK over more bytes, which is why the relay
# is paced at the forwarded run's rate rather than run flat out (docs/benchmarks.md).
set -euo pipefail

rounds=3 payload=256 duration=8 bin=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --payload) payload="$2"; shift 2 ;;
    --duration) duration="$2"; shift 2 ;;
    --bin) bin="$2"; shift 2 ;;
    -h|--help) sed -n '2,22p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "forward-floor.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
here="$(cd "$(dirname "$0")" && pwd)"
if [ -z "$bin" ]; then
  (cd "$here/.." && cargo build --release -q -p felix-node)
  bin="$here/../target/release/felix-node"
fi
[ -x "$bin" ] || { echo "forward-floor.sh: no felix-node binary at $bin" >&2; exit 2; }

rows=()
for r in $(seq 1 "$rounds"); do
  common=(--replication 1 --cpu --payload "$payload" --duration "$duration" --bin "$bin")
  d=$("$here/replication-bench.sh" --subscribers0 "${common[@]}" 2>&1 | tr '\n' ' ')
  f=$("$here/replication-bench.sh" --forwarded "${common[@]}" 2>&1 | tr '\n' ' ')
  direct=$(grep -o '(leader) [0-9.]*' <<<"$d" | awk '{print $2}')
  owner=$(grep -o '(leader) [0-9.]*' <<<"$f" | awk '{print $2}')
  fwd=$(grep -o '(forwarding) [0-9.]*' <<<"$f" | awk '{print $2}')
  rate=$(grep -o 'records/s=[0-9]*' <<<"$f" | cut -d= -f2)
  if [ -z "$direct" ] || [ -z "$owner" ] || [ -z "$fwd" ] || [ -z "$rate" ]; then
    echo "forward-floor.sh: round $r: a broker run gave no figures:" >&2
    echo "  direct: $d" >&2
    echo "  forwarded: $f" >&2
    exit 1
  fi
  one=$("$bin" bench --raw-quinn --payload "$payload" --rate "$rate" --duration "$duration" --json --quiet | tail -1)
  two=$("$bin" bench --raw-quinn --relay --payload "$payload" --rate "$rate" --duration "$duration" --json --quiet | tail -1)
  g1=$(grep -o '"cpu_s_per_gb":[0-9.]*' <<<"$one" | cut -d: -f2)
  g2=$(grep -o '"cpu_s_per_gb":[0-9.]*' <<<"$two" | cut -d: -f2)
  # CPU-s per GB is ns per byte: the second hop's cost per record of `payload` bytes, in µs.
  row=$(awk -v r="$r" -v d="$direct" -v o="$owner" -v f="$fwd" -v g1="$g1" -v g2="$g2" -v p="$payload" -v rate="$rate" 'BEGIN {
    hop = (g2 - g1) * p / 1000
    printf "%s %.2f %.2f %.2f %.3f %.3f %.3f %.3f %d\n", r, d, o, f, (o + f) / d, hop, (d + hop) / d, f / hop, rate }')
  rows+=("$row")
  echo "round $r: direct $direct µs, forwarded $owner + $fwd µs at $rate records/s; bare hop at that rate $(cut -d' ' -f6 <<<"$row") µs" >&2
done

printf '%s\n' "${rows[@]}" | awk -v p="$payload" '
  function median(a, n,   i, j, t) {
    for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (a[j] < a[i]) { t = a[i]; a[i] = a[j]; a[j] = t }
    return n % 2 ? a[(n + 1) / 2] : (a[n / 2] + a[n / 2 + 1]) / 2
  }
  BEGIN {
    printf "%-6s %9s %9s %9s %10s %8s %11s %12s %10s\n", "round", "direct", "owner", "forwarder", "fwd/direct", "bare hop", "floor ratio", "fwder/hop", "records/s"
  }
  {
    n++; d[n] = $2; o[n] = $3; f[n] = $4; ra[n] = $5; h[n] = $6; fl[n] = $7; fh[n] = $8
    printf "%-6s %9.2f %9.2f %9.2f %10.3f %8.3f %11.3f %12.3f %10d\n", $1, $2, $3, $4, $5, $6, $7, $8, $9
  }
  END {
    printf "%-6s %9.2f %9.2f %9.2f %10.3f %8.3f %11.3f %12.3f\n", "median", median(d, n), median(o, n), median(f, n), median(ra, n), median(h, n), median(fl, n), median(fh, n)
    printf "(µs of broker CPU per %d B record; floor ratio = (direct + bare hop) / direct)\n", p
  }'
