#!/usr/bin/env bash
# How long a request waits while the KV-cache service's index fills: redis-benchmark SETs
# KEYS keys drawn from 10^8 (nearly all new; 3-byte values, kept in memory) over CLIENTS
# connections, 16 requests deep, into a service just started on a sparse file target
# in /dev/shm (blocks of 512 bytes, room for every key). Prints each build's SETs a second
# and the latencies redis-benchmark reports (p99 and max, in ms): the max is what a
# request waits behind a key that makes the index outgrow its table. Rounds run every
# build named in turn; the service is killed after each (its values are not written out).
# Needs redis-tools.
# Usage: [BUILDS="BIN …"] bench/kv-keys.sh [ROUNDS] [KEYS] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
keys=${2:-4000000}
clients=${3:-4}
need redis-tools redis-benchmark
builds_to_run
shm_scratch kv-keys
capacity=$((keys * 2 * 512 / 1048576 + 64))
for round in $(seq "$rounds"); do
    for b in "${!builds[@]}"; do
        port=$(free_port)
        rm -f "$dir/blocks.img"
        cat >"$dir/kv.pipe" <<PIPE
pipeline kv_keys
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  target "file://$dir/blocks.img"  capacity ${capacity}MiB  block_size 512 }
pipe p root from fabric { default { actions to kvcache } }
PIPE
        "${builds[$b]}" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        pid=$!
        pids+=("$pid")
        wait_port "$port" 30
        # "test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms","p99_latency_ms","max_latency_ms"
        line=$(redis-benchmark -p "$port" -t set -n "$keys" -r 100000000 -d 3 -c "$clients" -P 16 --csv | grep '^"SET"')
        kill -KILL "$pid"
        wait "$pid" 2>/dev/null || true
        IFS=, read -r _ rps _ _ _ _ p99 max <<<"${line//\"/}"
        echo "round $round, build $b (${builds[$b]}): $rps SET/s, p99 $p99 ms, max $max ms"
    done
done
