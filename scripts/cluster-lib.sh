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
