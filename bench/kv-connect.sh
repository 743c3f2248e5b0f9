#!/usr/bin/env bash
# A burst of clients connecting at once, as all of a host's workers do when the service
# restarts: CLIENTS (at most the service's default `max_clients`, 1024) connections
# opened one after another without waiting for the service to accept them, timed
# together, and the slowest; then a PING on each. A connection the listener had no room
# for waits for its SYN to be sent again, a second later. Rounds run every build named
# in turn.
# Usage: [BUILDS="BIN …"] bench/kv-connect.sh [ROUNDS] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
clients=${2:-1000}
builds_to_run
shm_scratch kv-connect
trap stop_all EXIT
ulimit -n "$(ulimit -Hn)"
for round in $(seq "$rounds"); do
    for b in "${!builds[@]}"; do
        port=$(free_port)
        cat >"$dir/kv.pipe" <<PIPE
pipeline kv_connect
service kvcache { listen 127.0.0.1:$port  target "file://$dir/blocks.img"  capacity 64MiB  checkpoint off }
PIPE
        rm -f "$dir/blocks.img"
        "${builds[$b]}" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        pid=$!
        pids+=("$pid")
        wait_port "$port" 30
        said=$(python3 - "$port" "$clients" <<'PY'
import socket, sys, time
port, clients = (int(a) for a in sys.argv[1:])
socks, slowest = [], 0.0
start = time.monotonic()
for _ in range(clients):
    t = time.monotonic()
    socks.append(socket.create_connection(("127.0.0.1", port)))
    slowest = max(slowest, time.monotonic() - t)
connected = time.monotonic() - start
for s in socks:
    s.sendall(b"PING\r\n")
for s in socks:
    assert s.recv(16) == b"+PONG\r\n"
served = time.monotonic() - start
print(f"{clients} connected in {connected * 1000:.0f} ms (slowest {slowest * 1000:.1f} ms), all answered in {served * 1000:.0f} ms")
PY
)
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        echo "round $round, build $b (${builds[$b]}): $said"
    done
done
