#!/usr/bin/env bash
# Instructions the KV-cache service spends on a SET and on a GET of VALUE bytes, under
# callgrind (steadier than rates on a shared machine): `dpuflow run` with a service on a
# file in /dev/shm, first given every one of the N keys redis-benchmark will use (with
# redis-cli, so that every SET measured replaces a value and every GET finds one), then
# redis-benchmark sending N and then 3N SETs or GETs of them; the difference per request,
# which cancels the start, the keys given and the stop. The system calls' own work in the
# kernel is not counted; callgrind counts a `rep movsb` or `rep stosb` copy or fill a byte
# at a time. Each build named is measured in turn. DIR puts the file elsewhere (a disk's
# file system, to read and write it directly with KV_OPTIONS="page_cache off");
# KV_OPTIONS adds options to the service block; CLUSTER=1 makes the service a cluster of
# one node (every slot its own: what finding each key's slot costs). Needs valgrind,
# redis-benchmark and redis-cli.
# Usage: [BUILDS="BIN …"] [DIR=/dev/shm] [KV_OPTIONS=…] [CLUSTER=1] bench/kv-instructions.sh [N] [VALUE]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
n=${1:-10}
value=${2:-4000000}
for t in valgrind redis-benchmark redis-cli; do
    command -v $t >/dev/null || { echo "$t not found" >&2; exit 1; }
done
builds_to_run
dir=$(mktemp -d "${DIR:-/dev/shm}/dpuflow-kv-instr.XXXXXX")
trap stop_all EXIT
# Total instructions of a service that served `requests` SETs or GETs (TEST) of the values.
run() { # BIN TEST REQUESTS
    local port out pid
    port=$(free_port)
    out=$dir/cg.out
    rm -f "$dir/blocks.img"
    cat >"$dir/kv.pipe" <<PIPE
pipeline kv_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  target "file://$dir/blocks.img"  capacity 256MiB  block_size 64KiB  ${KV_OPTIONS:-} ${CLUSTER:+cluster_node 127.0.0.1:$port} }
pipe p root from fabric { default { actions to kvcache } }
PIPE
    valgrind --tool=callgrind --callgrind-out-file="$out" "$1" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
    pid=$!
    wait_port "$port" 60 # valgrind starts slowly
    # Every key redis-benchmark draws (`key:` and 12 digits, below N), given a value.
    for k in $(seq 0 $((n - 1))); do
        head -c "$value" /dev/zero | redis-cli -p "$port" -x SET "$(printf 'key:%012d' "$k")" >/dev/null
    done
    redis-benchmark -p "$port" -t "$2" -n "$3" -r "$n" -d "$value" -c 1 -q >/dev/null
    kill "$pid"
    wait "$pid" 2>/dev/null || true
    callgrind_annotate "$out" 2>/dev/null | sed -n 's/^\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' | tr -d ,
}
for b in "${builds[@]}"; do
    set_1=$(run "$b" set "$n"); set_3=$(run "$b" set $((3 * n)))
    get_1=$(run "$b" get "$n"); get_3=$(run "$b" get $((3 * n)))
    set_each=$(( (set_3 - set_1) / (2 * n) ))
    get_each=$(( (get_3 - get_1) / (2 * n) ))
    echo "$b: $set_each instructions a SET, $get_each a GET of $value bytes"
done
