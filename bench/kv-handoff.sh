#!/usr/bin/env bash
# How fast a node hands keys to a node that joins its cluster: KEYS keys of SIZE-byte values
# on a node alone (its target a file on tmpfs, 4 KiB blocks), which is stopped and started
# again as the first of two nodes, the second already running. Prints the keys it handed
# over (about half: the second node's slots), the time from its start to its log line
# saying all are handed over, keys a second and MB of values a second. ROUNDS rounds, each
# on a fresh fill. TARGET=nbd puts each node's store behind a qemu-nbd of its own (where a
# value read costs a round trip) instead of the file itself; DPUFLOW=BIN runs another
# build; SHOW_LOG=1 also prints the first node's log of each round (when its hand-off began
# and ended). Needs redis-tools, and qemu-utils for TARGET=nbd.
# Usage: [TARGET=nbd] [DPUFLOW=BIN] [SHOW_LOG=1] bench/kv-handoff.sh [ROUNDS] [KEYS] [SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
keys=${2:-100000}
size=${3:-4096}
need redis-tools redis-cli
[ "${TARGET:-file}" = file ] || need qemu-utils qemu-nbd
dpuflow_bin
shm_scratch kv-handoff
capacity=$(( keys * ((size + 4095) / 4096) * 4096 * 3 / 2 / 1048576 + 64 ))

# The store of node NAME, a file of the capacity: into `target_NAME`, as the pipeline
# names it.
store() { # NAME
    truncate -s "$(( capacity + 1 ))M" "$dir/$1.img"
    if [ "${TARGET:-file}" = nbd ]; then
        start_nbd "$dir/$1.img"
        printf -v "target_$1" 'nbd://127.0.0.1:%s/kv' "$nbd_port"
    else
        printf -v "target_$1" 'file://%s' "$dir/$1.img"
    fi
}

# The pipeline of node NAME listening on PORT, a node of the cluster of PORTS…, into
# $dir/NAME.pipe.
pipeline() { # NAME PORT PORTS…
    local name=$1 port=$2 p target
    shift 2
    target=target_$name
    {
        echo "pipeline kv"
        echo "port fabric { driver pcap }"
        echo "service kvcache { listen 127.0.0.1:$port  target \"${!target}\""
        echo "    capacity ${capacity}MiB  block_size 4KiB"
        for p in "$@"; do echo "    cluster_node 127.0.0.1:$p"; done
        echo "}"
        echo "pipe from_fabric root from fabric {"
        echo "    rule kv { match tcp.dst $port  actions to kvcache }"
        echo "    default { actions drop }"
        echo "}"
    } >"$dir/$name.pipe"
}

# Runs node NAME in the background, logging to $dir/NAME.log; its pid into `node_pid`.
node() { # NAME PORT
    "$bin" run "$dir/$1.pipe" --metrics "127.0.0.1:$(free_port)" 2>"$dir/$1.log" >/dev/null &
    node_pid=$!
    pids+=("$node_pid")
    wait_port "$2" 60
}

python3 - "$keys" "$size" >"$dir/fill.resp" <<'PY'
import sys
out = sys.stdout.buffer
keys, size = int(sys.argv[1]), int(sys.argv[2])
for i in range(keys):
    k = b"chunk:%012d" % i
    v = (b"%016d" % i) * (size // 16) + b"v" * (size % 16)
    out.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(k), k, len(v), v))
PY

printf '%8s %8s %10s %10s %8s\n' round handed seconds keys/s MB/s
for round in $(seq "$rounds"); do
    rm -f "$dir"/*.img
    a=$(free_port)
    b=$(free_port)
    store a
    store b
    pipeline a "$a" "$a"
    node a "$a"
    redis-cli -p "$a" --pipe <"$dir/fill.resp" >/dev/null
    kill -TERM "$node_pid"
    wait "$node_pid" || true
    pipeline b "$b" "$a" "$b"
    node b "$b"
    pipeline a "$a" "$a" "$b"
    started=$(date +%s%N)
    node a "$a"
    until grep -q "every saved key of the slots other nodes serve is handed" "$dir/a.log"; do
        sleep 0.01
    done
    took=$(( $(date +%s%N) - started ))
    handed=$(redis-cli -p "$b" DBSIZE)
    awk -v r="$round" -v n="$handed" -v ns="$took" -v size="$size" 'BEGIN {
        s = ns / 1e9; printf "%8d %8d %10.2f %10.0f %8.1f\n", r, n, s, n / s, n * size / s / 1e6 }'
    [ -z "${SHOW_LOG:-}" ] || grep kvcache "$dir/a.log" >&2
    kill -TERM "${pids[@]}" 2>/dev/null || true
    wait 2>/dev/null || true
    pids=()
done
