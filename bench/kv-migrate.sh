#!/usr/bin/env bash
# How fast keys move with MIGRATE between a redis-server and the service, against between
# two redis-servers: KEYS keys of SIZE-byte random values in a source redis-server,
# migrated (COPY REPLACE, BATCH keys a command, one command at a time) to another
# redis-server, to the service, then from the service to that redis-server, round after
# round; prints each move's median seconds, keys a second and MB a second. The service
# stores on a file on tmpfs (64 KiB blocks, or whole blocks of SIZE rounded up), or with
# TARGET=nbd on a qemu-nbd export of it (where each write is a round trip); everything
# shares the machine's cores. DPUFLOW=BIN runs another build. Needs redis-server,
# redis-tools and python3-redis, and qemu-utils for TARGET=nbd.
# Usage: [DPUFLOW=BIN] [TARGET=nbd] bench/kv-migrate.sh [ROUNDS] [KEYS] [SIZE] [BATCH]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
keys=${2:-20000}
size=${3:-65536}
batch=${4:-100}
need redis-server redis-server
need redis-tools redis-cli
dpuflow_bin
shm_scratch kv-migrate
block=$(( size < 65536 ? 4096 : 65536 ))
capacity=$(( keys * ((size + block - 1) / block) * block * 3 / 2 / 1048576 + 64 ))

# A redis-server on a free port, keeping nothing on disk; its port into `redis_port`.
redis() {
    redis_port=$(free_port)
    redis-server --port "$redis_port" --bind 127.0.0.1 --save "" --appendonly no \
        --dir "$dir" >/dev/null &
    pids+=($!)
    wait_port "$redis_port"
}

redis
source_port=$redis_port
redis
plain_port=$redis_port
kv_port=$(free_port)
truncate -s "$(( capacity + 1 ))M" "$dir/kv.img"
target="file://$dir/kv.img"
if [ "${TARGET:-file}" = nbd ]; then
    need qemu-utils qemu-nbd
    start_nbd "$dir/kv.img"
    target="nbd://127.0.0.1:$nbd_port/kv"
fi
cat >"$dir/kv.pipe" <<PIPE
pipeline kv
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$kv_port  target "$target"
    capacity ${capacity}MiB  block_size $block }
pipe from_fabric root from fabric {
    rule kv { match tcp.dst $kv_port  actions to kvcache }
    default { actions drop }
}
PIPE
"$bin" run "$dir/kv.pipe" --metrics "127.0.0.1:$(free_port)" 2>"$dir/kv.log" >/dev/null &
pids+=($!)
wait_port "$kv_port"

/usr/bin/python3 - "$source_port" "$keys" "$size" <<'PY'
import os, sys, redis
port, keys, size = (int(a) for a in sys.argv[1:])
r = redis.Redis(port=port)
p = r.pipeline(transaction=False)
for i in range(keys):
    p.set(f"chunk:{i}", os.urandom(size))
    if i % 256 == 255:
        p.execute()
p.execute()
PY

# Seconds the server on port FROM takes to migrate every key to port TO.
migrate() { # FROM TO
    /usr/bin/python3 - "$1" "$2" "$keys" "$batch" <<'PY'
import sys, time, redis
source, target, keys, batch = (int(a) for a in sys.argv[1:])
r = redis.Redis(port=source)
names = [f"chunk:{i}" for i in range(keys)]
began = time.monotonic()
for at in range(0, keys, batch):
    r.migrate("127.0.0.1", target, names[at:at + batch], 0, 60000, copy=True, replace=True)
print(f"{time.monotonic() - began:.3f}")
PY
}

# The moves timed: source and target ports, by name.
declare -A moves=(
    ["redis-server to redis-server"]="$source_port $plain_port"
    ["redis-server to dpuflow"]="$source_port $kv_port"
    ["dpuflow to redis-server"]="$kv_port $plain_port"
)
order=("redis-server to redis-server" "redis-server to dpuflow" "dpuflow to redis-server")
declare -A took
for round in $(seq "$rounds"); do
    line="round $round:"
    # In this order: the service holds the keys before it sends them.
    for move in "${order[@]}"; do
        # shellcheck disable=SC2086 # two ports
        s=$(migrate ${moves[$move]})
        took[$move]+="$s "
        line+=" $move ${s}s,"
    done
    echo "${line%,}" >&2
done
mb=$(( keys * size / 1000000 ))
for move in "${order[@]}"; do
    s=$(echo "${took[$move]}" | median)
    awk -v t="$move" -v s="$s" -v k="$keys" -v mb="$mb" \
        'BEGIN {printf "%-28s median %.3f s  %8.0f keys/s  %7.1f MB/s\n", t, s, k / s, mb / s}'
done
