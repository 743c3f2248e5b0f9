#!/usr/bin/env bash
# A longest-prefix-match table shaped like the public routing table of its family (IPv4:
# most routes /24, the rest over /8 to /32; IPv6: most /48, then /32, /40, /44, /29, over
# 26 lengths from /16 to /64), at random addresses, 64-byte frames, one core: 4096 flows
# over it, then a million.
# Usage: bench/lpm.sh [ipv4|ipv6] [ROUTES]   (defaults: ipv4 47000, ipv6 88000)
set -euo pipefail
cd "$(dirname "$0")/.."
family=${1:-ipv4}
case $family in
ipv4) routes=${2:-47000} ;;
ipv6) routes=${2:-88000} ;;
*) echo "usage: bench/lpm.sh [ipv4|ipv6] [ROUTES]" >&2; exit 2 ;;
esac
cargo build --release -q
bin=target/release/dpuflow
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python3 - "$family" "$routes" >"$dir/routes.pipe" <<'PY'
import ipaddress, random, sys
random.seed(7)
family, routes = sys.argv[1], int(sys.argv[2])
# Share of routes by prefix length, roughly as in the public tables.
if family == "ipv4":
    bits, field = 32, "ipv4.dst"
    share = {8: 1, 9: 1, 10: 2, 11: 5, 12: 12, 13: 25, 14: 45, 15: 80, 16: 700, 17: 400,
             18: 700, 19: 1300, 20: 2100, 21: 2500, 22: 5300, 23: 5000, 24: 28000, 25: 200,
             26: 250, 27: 150, 28: 100, 29: 100, 30: 60, 31: 10, 32: 50}
    address = lambda: random.getrandbits(32)
    text = lambda a: str(ipaddress.IPv4Address(a))
else:
    bits, field = 128, "ipv6.dst"
    share = {16: 5, 19: 5, 20: 30, 22: 10, 24: 100, 28: 400, 29: 4000, 30: 300, 31: 200,
             32: 9000, 33: 1000, 34: 1000, 35: 500, 36: 2000, 37: 300, 38: 500, 39: 300,
             40: 8000, 41: 300, 42: 1000, 43: 300, 44: 5000, 45: 500, 46: 1500, 47: 1500,
             48: 50000, 56: 300, 64: 200}
    # Global unicast, 2000::/3.
    address = lambda: 1 << 125 | random.getrandbits(125)
    text = lambda a: str(ipaddress.IPv6Address(a))
scale = routes / sum(share.values())
routes = set()
for length, n in share.items():
    for _ in range(max(1, round(n * scale))):
        while True:
            a = address() & ((1 << bits) - (1 << (bits - length)))
            if (a, length) not in routes:
                routes.add((a, length))
                break
# In random order: the benchmark spreads its flows over the entries in file order, so the
# first flows would otherwise all hit the shortest prefixes.
routes = sorted(routes)
random.shuffle(routes)
print("pipeline routes\nport a { driver pcap }\nport b { driver pcap }\n")
print("pipe lookup root from a {\n    table lpm %s {" % field)
for a, length in routes:
    print("        %s/%d => fwd b" % (text(a), length))
print("    }\n    default { actions drop }\n}")
PY
"$bin" check "$dir/routes.pipe"
for flows in 4096 1000000; do
    printf '%8s flows: ' "$flows"
    "$bin" bench "$dir/routes.pipe" --port a --flows "$flows" --warmup 1000000 --packets 10000000 |
        sed -n 's/.*: \([0-9.]*\) Mpps, \([0-9.]*\) ns.*/\1 Mpps, \2 ns\/packet/p'
done
