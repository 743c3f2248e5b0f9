#!/usr/bin/env bash
# What many keys passing one deadline together cost the request that comes next: KEYS keys
# (1-byte values, kept in memory) put with one deadline (`PXAT`, a few seconds ahead)
# into a service on a sparse file target in /dev/shm, plus one key without; once the
# deadline has passed, the first GET of that key is timed, then the next, then DBSIZE
# (which must be 1). Rounds run every build named in turn. Needs python3-redis.
# Usage: [BUILDS="BIN …"] bench/kv-expiry.sh [ROUNDS] [KEYS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
keys=${2:-200000}
builds_to_run
shm_scratch kv-expiry
for round in $(seq "$rounds"); do
    for b in "${!builds[@]}"; do
        start_kv_index "${builds[$b]}" "$keys"
        said=$(/usr/bin/python3 - "$port" "$keys" <<'PY'
import redis, sys, time
port, keys = (int(a) for a in sys.argv[1:])
r = redis.Redis(port=port)
at = int(time.time() * 1000) + 2000 + keys // 50
p = r.pipeline(transaction=False)
for i in range(keys):
    p.set(f"layer{i % 80}:chunk{i}", b"x", pxat=at)
    if i % 5000 == 4999:
        p.execute()
p.execute()
r.set("live", b"y")
left = at - time.time() * 1000
if left < 0:
    sys.exit(f"the keys took {-left:.0f} ms longer to put than their deadline allowed")
time.sleep(left / 1000 + 0.2)
def timed():
    t = time.monotonic()
    assert r.get("live") == b"y"
    return (time.monotonic() - t) * 1000
first, second = timed(), timed()
print(f"first GET after the deadline {first:.2f} ms, the next {second:.2f} ms, DBSIZE {r.dbsize()}")
PY
)
        kill -KILL "$pid"
        wait "$pid" 2>/dev/null || true
        echo "round $round, build $b (${builds[$b]}): $said"
    done
done
