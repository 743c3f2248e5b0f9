#!/usr/bin/env bash
# An exact table of a million entries on (ipv4.dst, udp.dst), 64-byte frames, one core:
# the time to check it, then 4096 flows over it, then a million. Usage: bench/big-exact.sh [ENTRIES]
set -euo pipefail
cd "$(dirname "$0")/.."
entries=${1:-1000000}
cargo build --release -q
bin=target/release/dpuflow
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$entries" >"$dir/big-exact.pipe" <<'PY'
import sys
n = int(sys.argv[1])
print("pipeline big_exact\nport a { driver pcap }\nport b { driver pcap }\n")
print("pipe lookup root from a {\n    table exact ipv4.dst udp.dst {")
for i in range(n):
    print("        10.%d.%d.%d %d => fwd b" % ((i >> 16) & 255, (i >> 8) & 255, i & 255, 5000 + i % 1000))
print("    }\n    default { actions drop }\n}")
PY
printf 'check: '
/usr/bin/time -f '%e s, %M KB peak' "$bin" check "$dir/big-exact.pipe" 2>&1 >/dev/null
for flows in 4096 "$entries"; do
    printf '%8s flows: ' "$flows"
    "$bin" bench "$dir/big-exact.pipe" --port a --flows "$flows" --warmup 1000000 --packets 10000000 |
        sed -n 's/.*: \([0-9.]*\) Mpps, \([0-9.]*\) ns.*/\1 Mpps, \2 ns\/packet/p'
done
