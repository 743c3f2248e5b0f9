#!/usr/bin/env bash
# A rule pipe of a ClassBench set through the engine, as IPv4 (`rules from`) and as IPv6
# (the same rules with each address prefix moved into 2001:db8::/32), so the two address
# families are compared on the same rule structure; each with synthetic flows and with the
# set's ClassBench trace (`dpuflow bench --trace`).
# Usage: bench/rule-pipes.sh [SET] [PACKETS]   (SET: a ClassBench file, acl1_1k by default)
set -euo pipefail
cd "$(dirname "$0")/.."
set_name=${1:-acl1_1k}
packets=${2:-2000000}
rules=$(realpath "../shared/classbench/$set_name")
cargo build --release -q
bin=${DPUFLOW_BIN:-target/release/dpuflow}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

header='pipeline rules
port a { driver pcap }
port b { driver pcap }
pipe acl root from a {'
{
    echo "$header"
    echo "    rules from \"$rules\" { actions fwd b }"
    echo '    default { actions drop }'
    echo '}'
} >"$tmp/v4.pipe"
{
    echo "$header"
    awk -F'\t' '
        function v6(p,   a, n, q) {
            split(p, a, "/"); split(a[1], q, ".")
            return sprintf("2001:db8:%02x%02x:%02x%02x::/%d", q[1], q[2], q[3], q[4], 32 + a[2])
        }
        function hex(s,   i, v) {
            v = 0
            for (i = 3; i <= length(s); i++) v = v * 16 + index("0123456789abcdef", substr(tolower(s), i, 1)) - 1
            return v
        }
        function ports(field, r,   a) {
            split(r, a, " : ")
            if (a[1] == 0 && a[2] == 65535) return ""
            return sprintf(" %s %d-%d", field, a[1], a[2])
        }
        NF >= 5 {
            sub(/^@/, "", $1)
            m = sprintf("ipv6.src %s  ipv6.dst %s", v6($1), v6($2)) ports("l4.src", $3) ports("l4.dst", $4)
            split($5, p, "/")
            if (tolower(p[2]) == "0xff") m = m sprintf(" ip.proto %d", hex(p[1]))
            printf "    rule r%d { match %s  actions fwd b }\n", NR, m
        }' "$rules"
    echo '    default { actions drop }'
    echo '}'
} >"$tmp/v6.pipe"

# The set's ClassBench trace (random points in random rules, and uniform packets), moved
# into 2001:db8::/32 for IPv6 as the rules are (the low 64 bits varied). IPv6 packets whose
# protocol number names an extension header (0, 43, 44, 60, ...) are dropped as malformed:
# what follows is no such header.
"$bin" acl gen-trace --rules "$rules" --count 100000 --seed 1 >"$tmp/v4.trace"
awk '{ printf "2001:db8:%x:%x:%x:%x:%x:%x %s %s %s\n", int($1 / 65536), $1 % 65536, NR % 65536, NR * 7 % 65536, NR * 13 % 65536, NR * 31 % 65536, "2001:db8:" sprintf("%x:%x::%x", int($2 / 65536), $2 % 65536, NR % 65536), $3 " " $4, $5 }' \
    "$tmp/v4.trace" >"$tmp/v6.trace"

# Each family with synthetic flows (one per rule, at its lowest corner) and with the trace.
for family in v4 v6; do
    size=64
    [ $family = v6 ] && size=86
    printf '%s %s: ' "$set_name" "$family"
    $bin bench "$tmp/$family.pipe" --port a --size $size --flows 10000 --packets "$packets" 2>/dev/null | grep -i mpps
    printf '%s %s, trace: ' "$set_name" "$family"
    $bin bench "$tmp/$family.pipe" --port a --size $size --trace "$tmp/$family.trace" --packets "$packets" 2>/dev/null | grep -i mpps
done
