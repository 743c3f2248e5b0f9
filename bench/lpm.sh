#!/usr/bin/env bash
# A longest-prefix-match table shaped like the public IPv4 routing table (most routes /24,
# the rest spread over /8 to /32, random addresses), 64-byte frames, one core: 4096 flows
# over it, then a million. Usage: bench/lpm.sh [ROUTES]
set -euo pipefail
cd "$(dirname "$0")/.."
routes=${1:-47000}
cargo build --release -q
bin=target/release/dpuflow
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$routes" >"$dir/routes.pipe" <<'PY'
import random, sys
random.seed(7)
# Share of routes by prefix length, roughly as in the public IPv4 table.
share = {8: 1, 9: 1, 10: 2, 11: 5, 12: 12, 13: 25, 14: 45, 15: 80, 16: 700, 17: 400,
         18: 700, 19: 1300, 20: 2100, 21: 2500, 22: 5300, 23: 5000, 24: 28000, 25: 200,
         26: 250, 27: 150, 28: 100, 29: 100, 30: 60, 31: 10, 32: 50}
scale = int(sys.argv[1]) / sum(share.values())
print("pipeline routes\nport a { driver pcap }\nport b { driver pcap }\n")
print("pipe lookup root from a {\n    table lpm ipv4.dst {")
seen = set()
for length, n in share.items():
    for _ in range(max(1, round(n * scale))):
        while True:
            a = random.getrandbits(32) & (0xffffffff << (32 - length)) & 0xffffffff
            if (a, length) not in seen:
                seen.add((a, length))
                break
        print("        %d.%d.%d.%d/%d => fwd b" % (a >> 24, a >> 16 & 255, a >> 8 & 255, a & 255, length))
print("    }\n    default { actions drop }\n}")
PY
"$bin" check "$dir/routes.pipe"
for flows in 4096 1000000; do
    printf '%8s flows: ' "$flows"
    "$bin" bench "$dir/routes.pipe" --port a --flows "$flows" --warmup 1000000 --packets 10000000 |
        sed -n 's/.*: \([0-9.]*\) Mpps, \([0-9.]*\) ns.*/\1 Mpps, \2 ns\/packet/p'
done
