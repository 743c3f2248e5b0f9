#!/usr/bin/env bash
# A KV-cache store whose targets are behind links that limit it: one NBD export (qemu-nbd
# in a network namespace, reached over a veth pair shaped to RATE each way by a token
# bucket, default 500mbit), against a store striped over two such
# exports, each behind a link of its own. Every one of KEYS keys (default as many as
# fill half of CAPACITY MiB) is given a value first, so every GET hits; then
# `redis-benchmark -t set,get -d VALUE -r KEYS` from CLIENTS connections. Round after
# round, each build named runs both stores; prints the medians of the requests per
# second. Needs root (network namespaces, tc), qemu-nbd and redis-tools.
# Usage: [BUILDS="BIN …"] [RATE=…] [CAPACITY=MiB] [STRIPE=SIZE]
#        bench/kv-striped.sh [ROUNDS] [REQUESTS] [VALUE] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
requests=${2:-100}
value=${3:-8000000}
clients=${4:-1}
rate=${RATE:-500mbit}
capacity=${CAPACITY:-128}
keys=${KEYS:-$((capacity * 1048576 / 2 / value))}
[ "$keys" -ge 1 ] || keys=1
need "qemu-utils, redis-tools, iproute2" qemu-nbd redis-benchmark redis-cli tc
builds_to_run
dir=$(mktemp -d /dev/shm/dpuflow-kv-striped.XXXXXX)
tag=kvs$$
cleanup() {
    stop_all
    for i in 1 2; do ip netns del "$tag-$i" 2>/dev/null || true; done
}
trap cleanup EXIT
head -c "$value" /dev/urandom >"$dir/value"

# Each export in a namespace of its own, 10.77.I.2, behind a veth shaped both ways.
for i in 1 2; do
    ns=$tag-$i
    ip netns add "$ns"
    ip link add "$tag$i" type veth peer name eth0 netns "$ns"
    ip addr add "10.77.$i.1/24" dev "$tag$i"
    ip link set "$tag$i" up
    ip -n "$ns" addr add "10.77.$i.2/24" dev eth0
    ip -n "$ns" link set eth0 up
    tc qdisc add dev "$tag$i" root tbf rate "$rate" burst 256kb latency 100ms
    ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 256kb latency 100ms
    truncate -s "$((capacity + 1))M" "$dir/disk-$i.img"
    ip netns exec "$ns" qemu-nbd -f raw -x kv -b "10.77.$i.2" -p 10809 --persistent --shared=64 \
        "$dir/disk-$i.img" >/dev/null 2>&1 &
    pids+=($!)
    for _ in $(seq 100); do
        (exec 3<>"/dev/tcp/10.77.$i.2/10809") 2>/dev/null && break
        sleep 0.1
    done
done

stores=(one striped)
declare -A sets gets
for round in $(seq "$rounds"); do
    for b in "${!builds[@]}"; do
        for store in "${stores[@]}"; do
            case $store in
                one) targets='target "nbd://10.77.1.2:10809/kv"' ;;
                striped) targets="target \"nbd://10.77.1.2:10809/kv\"  target \"nbd://10.77.2.2:10809/kv\"  ${STRIPE:+stripe $STRIPE}" ;;
            esac
            for i in 1 2; do empty_store "$dir/disk-$i.img"; done
            port=$(free_port)
            cat >"$dir/kv.pipe" <<PIPE
pipeline kv_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  $targets  capacity ${capacity}MiB  block_size 64KiB }
pipe p root from fabric { default { actions to kvcache } }
PIPE
            "${builds[$b]}" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
            pid=$!
            wait_port "$port"
            for k in $(seq 0 $((keys - 1))); do
                redis-cli -p "$port" -x SET "$(printf 'key:%012d' "$k")" <"$dir/value" >/dev/null
            done
            csv=$(redis-benchmark -p "$port" -t set,get -n "$requests" -d "$value" -r "$keys" -c "$clients" --csv)
            kill "$pid"
            wait "$pid" 2>/dev/null || true
            s=$(echo "$csv" | awk -F'"' '/^"SET"/ {print $4}')
            g=$(echo "$csv" | awk -F'"' '/^"GET"/ {print $4}')
            echo "round $round, build $b (${builds[$b]}), $store: SET $s/s, GET $g/s"
            sets[$b,$store]="${sets[$b,$store]:-} $s"
            gets[$b,$store]="${gets[$b,$store]:-} $g"
        done
    done
done
echo "medians over $rounds rounds ($requests requests, $value-byte values, $clients clients, links of $rate):"
for b in "${!builds[@]}"; do
    for store in "${stores[@]}"; do
        printf '  build %s, %-8s SET %8s/s  GET %8s/s\n' "$b" "$store" \
            "$(echo "${sets[$b,$store]}" | median)" "$(echo "${gets[$b,$store]}" | median)"
    done
done
