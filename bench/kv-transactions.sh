#!/usr/bin/env bash
# What a transaction costs against the same requests pipelined without one: redis-py
# sends N SETs of SIZE-byte values, then N GETs of them, as one pipeline (`pipeline(
# transaction=False)`) and as one transaction (`pipeline()`, redis-py's default: MULTI,
# the requests, EXEC), to a KV-cache service storing on an NBD export (qemu-nbd over
# loopback, where each round of writes or reads is a round trip). Prints each build's
# median milliseconds of 20 of each, ROUNDS rounds, builds in turn.
# Needs qemu-nbd and python3-redis.
# Usage: [BUILDS="BIN …"] bench/kv-transactions.sh [ROUNDS] [N] [SIZE]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
n=${2:-32}
size=${3:-65536}
need qemu-utils qemu-nbd
/usr/bin/python3 -c 'import redis' || { echo "python3-redis not found" >&2; exit 1; }
builds_to_run
shm_scratch kv-transactions
truncate -s 257M "$dir/disk.img"
start_nbd "$dir/disk.img"
kv_port=$(free_port)
cat >"$dir/kv.pipe" <<PIPE
pipeline kv_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$kv_port  target "nbd://127.0.0.1:$nbd_port/kv"  capacity 256MiB  block_size 64KiB }
pipe p root from fabric { default { actions to kvcache } }
PIPE
for round in $(seq "$rounds"); do
    for bin in "${builds[@]}"; do
        empty_store "$dir/disk.img"
        "$bin" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        pid=$!
        wait_port "$kv_port"
        /usr/bin/python3 - "$kv_port" "$n" "$size" <<'PY'
import os, statistics, sys, time, redis
port, n, size = (int(a) for a in sys.argv[1:])
r = redis.Redis(port=port)
values = {f"layer:{i}": os.urandom(size) for i in range(n)}
def run(transaction, write):
    p = r.pipeline(transaction=transaction)
    for k, v in values.items():
        if write:
            p.set(k, v)
        else:
            p.get(k)
    return p.execute()
def ms(f):
    t = []
    for _ in range(20):
        s = time.perf_counter(); f(); t.append((time.perf_counter() - s) * 1000)
    return statistics.median(t)
assert run(True, True) == [True] * n and run(True, False) == list(values.values())
print(f"pipelined SETs {ms(lambda: run(False, True)):.2f} ms, in a transaction {ms(lambda: run(True, True)):.2f} ms; "
      f"pipelined GETs {ms(lambda: run(False, False)):.2f} ms, in a transaction {ms(lambda: run(True, False)):.2f} ms")
PY
        kill "$pid"
        wait "$pid" 2>/dev/null || true
    done 2>&1 | paste -d' ' <(printf '%s\n' "${builds[@]}") - | sed "s#^#round $round, #"
done
