#!/usr/bin/env bash
# What a checkpoint of a large index costs the requests: the KV-cache service on a file
# target (tmpfs, 512-byte blocks) holding KEYS keys of 16-byte values, under GETs of random
# keys from CLIENTS connections (redis-benchmark), once with nothing else going on and once
# with a `SAVE` (a checkpoint, answered once durable) sent a second into the run. Prints,
# per run, redis-benchmark's GET latencies (mean, p99 and max, in ms) and how long the SAVE
# took. Then, with nothing else going on, CHANGED keys at a time written again (values of
# 300 bytes, on the target before the SAVE) and a SAVE: how long it took and what the
# service wrote meanwhile (`wchar` of /proc/PID/io: the checkpoint's copy of the index and
# its superblock). Last, the service is stopped and started again on the index its stop
# saved, and one key changed and a SAVE show what the first checkpoint after a start
# writes. BUILDS="BIN …" compares builds, each round running them in turn.
# Needs redis-server and redis-tools.
# Usage: [BUILDS=…] [CHANGED="1 10000 …"] bench/kv-checkpoint.sh [ROUNDS] [KEYS] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
keys=${2:-1000000}
clients=${3:-8}
need redis-tools redis-benchmark redis-cli
builds_to_run
shm_scratch kv-checkpoint

# The keys redis-benchmark's `-r` names (key:000000000042), as one SET each.
python3 - "$keys" >"$dir/fill.resp" <<'PY'
import sys
out = sys.stdout.buffer
for i in range(int(sys.argv[1])):
    k = b"key:%012d" % i
    out.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$16\r\n%016d\r\n" % (len(k), k, i))
PY
capacity=$(( keys * 512 * 5 / 4 / 1048576 + 64 ))

# GETs for a few seconds; with `save`, a SAVE a second in. Prints the latencies and the
# SAVE's milliseconds (0 without).
get_run() { # PORT [save]
    local took=0 started
    redis-benchmark -p "$1" -t get -r "$keys" -n $(( 60000 * clients )) -c "$clients" --csv \
        >"$dir/get.csv" 2>/dev/null &
    local bench=$!
    if [ "${2:-}" = save ]; then
        sleep 1
        started=$(date +%s%N)
        [ "$(redis-cli -p "$1" SAVE)" = OK ] || { echo "SAVE failed" >&2; exit 1; }
        took=$(( ($(date +%s%N) - started) / 1000000 ))
    fi
    wait "$bench"
    # "GET","rps","avg","min","p50","p95","p99","max"
    tail -1 "$dir/get.csv" | tr -d '"' | awk -F, -v took="$took" \
        '{printf "%10.0f GET/s  mean %6.3f  p99 %6.3f  max %7.3f ms  SAVE %5d ms\n", $2, $3, $7, $8, took}'
}

# N keys spread over the KEYS written again, then a SAVE: its milliseconds and the MB the
# service wrote.
changed_save() { # PORT PID N
    python3 - "$keys" "$3" <<'PY' | redis-cli -p "$1" --pipe >/dev/null
import sys
out = sys.stdout.buffer
keys, n = int(sys.argv[1]), int(sys.argv[2])
value = b"v" * 300
for i in range(0, keys, max(keys // n, 1))[:n]:
    k = b"key:%012d" % i
    out.write(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$300\r\n%s\r\n" % (len(k), k, value))
PY
    local before started took after saved
    before=$(awk '/^wchar/ {print $2}' "/proc/$2/io")
    started=$(date +%s%N)
    saved=$(redis-cli -p "$1" SAVE)
    [ "$saved" = OK ] || { echo "SAVE failed: $saved" >&2; exit 1; }
    took=$(( ($(date +%s%N) - started) / 1000000 ))
    after=$(awk '/^wchar/ {print $2}' "/proc/$2/io")
    awk -v n="$3" -v took="$took" -v w=$(( after - before )) \
        'BEGIN {printf "  SAVE after %7d keys changed: %5d ms  %8.2f MB written\n", n, took, w / 1e6}'
}

for round in $(seq "$rounds"); do
    for b in "${builds[@]}"; do
        port=$(free_port)
        cat >"$dir/kv.pipe" <<PIPE
pipeline kv_checkpoint_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  target "file://$dir/blocks.img"  capacity ${capacity}MiB  block_size 512  checkpoint 3600s }
pipe p root from fabric { default { actions to kvcache } }
PIPE
        rm -f "$dir/blocks.img"
        "$b" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        svc=$!
        pids+=("$svc")
        wait_port "$port" 60
        redis-cli -p "$port" --pipe <"$dir/fill.resp" >/dev/null
        # The first checkpoint also writes every value kept in memory: out of the runs.
        redis-cli -p "$port" SAVE >/dev/null
        echo "round $round  $b  $(redis-cli -p "$port" DBSIZE) keys"
        printf '  no checkpoint  '
        get_run "$port"
        redis-cli -p "$port" SET changed 1 >/dev/null
        printf '  checkpoint     '
        get_run "$port" save
        for n in ${CHANGED:-1 10000 50000}; do
            changed_save "$port" "$svc" "$n"
        done
        kill "$svc"
        wait "$svc" 2>/dev/null || true
        # Started again on the index its stop saved: the first SAVE after one key changed.
        "$b" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        svc=$!
        pids+=("$svc")
        wait_port "$port" 60
        printf '  restarted, %s keys restored\n' "$(redis-cli -p "$port" DBSIZE)"
        changed_save "$port" "$svc" 1
        kill "$svc"
        wait "$svc" 2>/dev/null || true
    done
done
