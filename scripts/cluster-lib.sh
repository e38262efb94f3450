# Shared by the cluster benchmark scripts (sourced, not run): the processes a run started and
# its temporary directory, removed when the script ends, and free loopback ports.
#
# A script appends each process it starts to `pids` and sets `tmp` to its data directory;
# `cleanup` kills them all (SIGKILL), waits for them and removes the directory, and runs on
# exit. It may also be called between runs.

pids=()
tmp=""
cleanup() {
  for p in "${pids[@]:-}"; do [ -n "$p" ] && kill -9 "$p" 2>/dev/null || true; done
  for p in "${pids[@]:-}"; do [ -n "$p" ] && wait "$p" 2>/dev/null || true; done
  pids=()
  [ -n "$tmp" ] && rm -rf "$tmp"
  tmp=""
}
trap cleanup EXIT

# A free port on loopback, of the given kind (udp or tcp).
free_port() {
  python3 -c "import socket,sys; s=socket.socket(socket.AF_INET, socket.SOCK_DGRAM if sys.argv[1]=='udp' else socket.SOCK_STREAM); s.bind(('127.0.0.1',0)); print(s.getsockname()[1])" "$1"
}

# Addresses for three brokers n1, n2, n3 on loopback: fills the caller's `names`, `client`,
# `cluster` and `metrics` arrays and its `peers` list (declare them `local` first; bash's
# dynamic scope makes this function fill the caller's).
pick_three() {
  names=(n1 n2 n3)
  client=()
  cluster=()
  metrics=()
  local n i
  for n in "${names[@]}"; do
    client+=("127.0.0.1:$(free_port udp)")
    cluster+=("127.0.0.1:$(free_port udp)")
    metrics+=("127.0.0.1:$(free_port tcp)")
  done
  peers=""
  for i in 0 1 2; do peers+="${names[$i]}=${cluster[$i]},"; done
  peers=${peers%,}
}

# Starts broker $1 (an index into the caller's `names`, `client`, `cluster` and `metrics`) of
# `$bin` with the caller's `tmp` and `peers`, and the further arguments: its output appended to
# `$tmp/NAME.out`, its pid in `pids`.
serve_one() {
  local i=$1
  shift
  "$bin" serve --listen "${client[$i]}" --data-dir "$tmp/${names[$i]}" --dev-token bench-token \
    --node-id "${names[$i]}" --cluster-listen "${cluster[$i]}" --peers "$peers" --cluster-secret s \
    --metrics-listen "${metrics[$i]}" "$@" >> "$tmp/${names[$i]}.out" 2>&1 &
  pids[i]=$!
}

# Waits (up to 30 s each) until every broker of the caller's `names` said it listens.
wait_listening() {
  local n
  for n in "${names[@]}"; do
    for _ in $(seq 1 300); do grep -q "listening" "$tmp/$n.out" && break; sleep 0.1; done
  done
}
