#!/usr/bin/env bash
# What a walk over the KV-cache service's keys (`SCAN`, as `redis-cli --scan` makes it)
# costs the requests served meanwhile: KEYS keys (1-byte values, kept in memory) put
# into a service on a sparse file target in /dev/shm, then a SCAN COUNT 10 from cursor 0
# timed five times (the median), then CALLS calls of a walk while another connection GETs
# one key in a loop: the walk's time and the GETs' median and longest wait; then the same
# for five `KEYS layer7:*` (the median call). With WHOLE=1,
# then a whole walk by redis-cli --scan, timed, and the keys it listed. Rounds run every
# build named in turn. Needs redis-tools and python3-redis.
# Usage: [BUILDS="BIN …"] [WHOLE=1] bench/kv-scan.sh [ROUNDS] [KEYS] [CALLS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
keys=${2:-200000}
calls=${3:-200}
need redis-tools redis-cli
builds_to_run
shm_scratch kv-scan
for round in $(seq "$rounds"); do
    for b in "${!builds[@]}"; do
        start_kv_index "${builds[$b]}" "$keys"
        walk=$(/usr/bin/python3 - "$port" "$keys" "$calls" <<'PY'
import redis, sys, threading, time
port, keys, calls = (int(a) for a in sys.argv[1:])
r = redis.Redis(port=port)
p = r.pipeline(transaction=False)
for i in range(keys):
    p.set(f"layer{i % 80}:chunk{i}", b"x")
    if i % 5000 == 4999:
        p.execute()
p.execute()
first = []
for _ in range(5):
    t = time.monotonic()
    r.scan(0, count=10)
    first.append(time.monotonic() - t)
waits, stop = [], threading.Event()
def get():
    g = redis.Redis(port=port)
    while not stop.is_set():
        t = time.monotonic()
        g.get("layer1:chunk1")
        waits.append(time.monotonic() - t)
getter = threading.Thread(target=get)
getter.start()
def meanwhile():
    # A copy: the getter goes on appending.
    w = sorted(waits)
    waits.clear()
    return f"GET meanwhile median {w[len(w) // 2] * 1000:.2f} ms, longest {w[-1] * 1000:.1f} ms"
t, cursor, n = time.monotonic(), 0, 0
while True:
    cursor, _ = r.scan(cursor, count=10)
    n += 1
    if cursor == 0 or n == calls:
        break
took = time.monotonic() - t
walk = meanwhile()
listing = []
for _ in range(5):
    t = time.monotonic()
    r.keys("layer7:*")
    listing.append(time.monotonic() - t)
stop.set()
getter.join()
print(f"SCAN from 0 {sorted(first)[2] * 1000:.2f} ms; {n} calls {took:.2f} s; {walk}; "
      f"KEYS layer7:* {sorted(listing)[2] * 1000:.1f} ms, {meanwhile()}")
PY
)
        if [ "${WHOLE:-}" = 1 ]; then
            start=$(date +%s%N)
            listed=$(redis-cli -p "$port" --scan | sort -u | wc -l)
            walk+="; redis-cli --scan $((($(date +%s%N) - start) / 1000000)) ms, $listed keys"
        fi
        kill -KILL "$pid"
        wait "$pid" 2>/dev/null || true
        echo "round $round, build $b (${builds[$b]}): $walk"
    done
done
