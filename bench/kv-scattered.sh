#!/usr/bin/env bash
# How long a value stored in scattered blocks takes to read and write: the KV-cache
# service stores on an NBD export (qemu-nbd over loopback, one target connection);
# redis-py fills the store with 64 KiB values, deletes every other one, then sets a value
# of RUNS blocks, which lands in RUNS separate blocks (a request to the target for each),
# and times GET and SET of it, an MGET of the RUNS 64 KiB values left, the same GETs sent
# as one redis-py pipeline, and an MSET and a pipeline of SETs of RUNS other keys' values
# of VALUE bytes (default 4096; medians of 20).
# Each build named runs in turn, ROUNDS times; prints each build's median milliseconds.
# Needs qemu-nbd and python3-redis.
# Usage: [BUILDS="BIN …"] [VALUE=BYTES] bench/kv-scattered.sh [ROUNDS] [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
runs=${2:-24}
value=${VALUE:-4096}
command -v qemu-nbd >/dev/null || { echo "qemu-nbd not found (qemu-utils)" >&2; exit 1; }
/usr/bin/python3 -c 'import redis' || { echo "python3-redis not found" >&2; exit 1; }
builds_to_run
dir=$(mktemp -d /dev/shm/dpuflow-kvs.XXXXXX)
trap stop_all EXIT

truncate -s 65M "$dir/disk.img"
start_nbd "$dir/disk.img"
kv_port=$(free_port)
cat >"$dir/kv.pipe" <<PIPE
pipeline kv_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$kv_port  target "nbd://127.0.0.1:$nbd_port/kv"  capacity 64MiB  block_size 64KiB  connections 1 }
pipe p root from fabric { default { actions to kvcache } }
PIPE
declare -A gets sets mgets pipes msets psets
for round in $(seq "$rounds"); do
    for i in "${!builds[@]}"; do
        empty_store "$dir/disk.img"
        "${builds[$i]}" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        pid=$!
        wait_port "$kv_port"
        read -r get set mget piped mset pset < <(/usr/bin/python3 - "$runs" "$kv_port" "$value" <<'PY'
import os, statistics, sys, time, redis
runs = int(sys.argv[1])
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[2]))
small = os.urandom(65536)
for k in range(2 * runs):
    r.set(f"s{k}", small)
for k in range(0, 2 * runs, 2):
    r.delete(f"s{k}")
big = os.urandom(65536 * runs)
r.set("big", big)
assert r.get("big") == big
def ms(f):
    t = []
    for _ in range(20):
        s = time.perf_counter(); f(); t.append((time.perf_counter() - s) * 1000)
    return statistics.median(t)
# Each SET puts the value back over the blocks it frees, so it stays scattered.
left = [f"s{k}" for k in range(1, 2 * runs, 2)]
assert r.mget(left) == [small] * runs
def pipelined():
    p = r.pipeline(transaction=False)
    for k in left:
        p.get(k)
    return p.execute()
assert pipelined() == [small] * runs
written = {f"w{k}": os.urandom(int(sys.argv[3])) for k in range(runs)}
def pipelined_sets():
    p = r.pipeline(transaction=False)
    for k, v in written.items():
        p.set(k, v)
    return p.execute()
assert pipelined_sets() == [True] * runs
print(f'{ms(lambda: r.get("big")):.2f} {ms(lambda: r.set("big", big)):.2f} {ms(lambda: r.mget(left)):.2f} '
      f'{ms(pipelined):.2f} {ms(lambda: r.mset(written)):.2f} {ms(pipelined_sets):.2f}')
assert r.mget(list(written)) == list(written.values())
PY
        )
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        echo "round $round, build $i (${builds[$i]}): GET $get ms, SET $set ms, MGET $mget ms, pipelined GETs $piped ms, MSET $mset ms, pipelined SETs $pset ms"
        gets[$i]="${gets[$i]:-} $get"
        sets[$i]="${sets[$i]:-} $set"
        mgets[$i]="${mgets[$i]:-} $mget"
        pipes[$i]="${pipes[$i]:-} $piped"
        msets[$i]="${msets[$i]:-} $mset"
        psets[$i]="${psets[$i]:-} $pset"
    done
done
for i in "${!builds[@]}"; do
    echo "build $i (${builds[$i]}): median GET $(echo "${gets[$i]}" | median) ms, SET $(echo "${sets[$i]}" | median) ms ($runs scattered blocks), MGET $(echo "${mgets[$i]}" | median) ms, pipelined GETs $(echo "${pipes[$i]}" | median) ms, MSET $(echo "${msets[$i]}" | median) ms, pipelined SETs $(echo "${psets[$i]}" | median) ms ($runs values of $value bytes)"
done
