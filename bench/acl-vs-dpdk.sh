#!/usr/bin/env bash
# The rule classifier next to DPDK's rte_acl, same rule and trace files, one core, same run:
# dpdk-test-acl (Debian dpdk-dev) with the given algorithm, then `dpuflow acl bench`.
# With --ipv6, every rule and packet is first moved into 2001:db8::/32 (prefixes 32 bits
# longer, packets with varied low bits) and both run their IPv6 classifiers.
# Each set runs both classifiers in turn ROUNDS times (5 by default) and prints the medians
# and the median and range of the pairs' ratios.
# Usage: [ROUNDS=N] bench/acl-vs-dpdk.sh [--ipv6] [ALG] [SETS...]   (ALG: avx2 by default; SETS: ClassBench files)
set -euo pipefail
cd "$(dirname "$0")/.."
v6=()
if [ "${1:-}" = --ipv6 ]; then
    v6=(--ipv6)
    shift
fi
alg=${1:-avx2}
rounds=${ROUNDS:-5}
shift || true
dir=../shared/classbench
sets=("$@")
[ ${#sets[@]} -gt 0 ] || sets=(acl1_1k fw1_1k ipc1_1k acl1_10k fw1_10k ipc1_10k)
command -v dpdk-test-acl >/dev/null || { echo "dpdk-test-acl not found: apt-get install dpdk-dev" >&2; exit 1; }
cargo build --release -q
bin=target/release/dpuflow
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# rte_acl twice: with dpdk-test-acl's default verbosity, which prints every result inside
# its timed loop (as the command documented for this comparison runs it), and with
# --verbose=0, classification alone. The ratio is against the latter.
printf '%-10s %16s %14s %14s %8s %12s %12s %10s\n' set "rte_acl(default)" "rte_acl Mpps" "dpuflow Mpps" ratio "ratios" "dpuflow MiB" "build ms"
# IPv4 a.b.c.d as 2001:db8:aabb:ccdd plus four more groups, all eight written out.
to_v6_rules() {
    awk '
        function net(p,   a, q) {
            split(p, a, "/"); split(a[1], q, ".")
            return sprintf("2001:db8:%x:%x:0:0:0:0/%d", q[1] * 256 + q[2], q[3] * 256 + q[4], a[2] + 32)
        }
        NF >= 9 { sub(/^@/, "", $1); printf "@%s %s %s %s %s %s %s %s %s\n", net($1), net($2), $3, $4, $5, $6, $7, $8, $9 }' "$1"
}
to_v6_trace() {
    awk '
        function addr(v, low) {
            return sprintf("2001:db8:%x:%x:%x:%x:%x:%x", int(v / 65536), v % 65536,
                low % 65536, (low * 7) % 65536, (low * 13) % 65536, (low * 31) % 65536)
        }
        { printf "%s %s %s %s %s\n", addr($1, NR), addr($2, NR * 3), $3, $4, $5 }' "$1"
}

for s in "${sets[@]}"; do
    rules="$dir/$s"
    $bin acl gen-trace --rules "$rules" --count 100000 --seed 1 >"$tmp/$s.trace"
    if [ ${#v6[@]} -gt 0 ]; then
        to_v6_rules "$rules" >"$tmp/$s.rules6"
        rules="$tmp/$s.rules6"
        to_v6_trace "$tmp/$s.trace" >"$tmp/$s.trace6"
        mv "$tmp/$s.trace6" "$tmp/$s.trace"
    fi
    run_dpdk() {
        dpdk-test-acl -l 0 --no-huge --no-pci -m 1024 --file-prefix="dpuflow-acl-$$" -- \
            --rulesf="$rules" --tracef="$tmp/$s.trace" --tracenum=100000 --tracestep=32 \
            --alg="$alg" --iter=10 ${v6[@]+"${v6[@]}"} "$@" 2>/dev/null | sed -n 's/.* \([0-9.]*\) pkt\/sec.*/\1/p' | tail -n 1
    }
    dpdk_default=$(run_dpdk | awk '{printf "%.2f", $1 / 1e6}')
    # Both in turn, $rounds times: medians of each and of the pairs' ratios, and the
    # ratios' range (either side's figure moves from run to run on a shared machine).
    pairs=()
    for _ in $(seq "$rounds"); do
        dpdk=$(run_dpdk --verbose=0)
        ours=$($bin acl bench --rules "$rules" --trace "$tmp/$s.trace" --batch 32 --iter 10 ${v6[@]+"${v6[@]}"})
        mpps=$(sed -n 's/^lookups: .*: \([0-9.]*\) Mpps.*/\1/p' <<<"$ours")
        pairs+=("$(awk -v p="$dpdk" -v a="$mpps" 'BEGIN {printf "%.2f %.2f %.3f", p / 1e6, a, a / (p / 1e6)}')")
    done
    mib=$(sed -n 's/.*memory \([0-9.]*\) MiB.*/\1/p' <<<"$ours")
    build=$(sed -n 's/.*build \([0-9.]*\) ms.*/\1/p' <<<"$ours")
    median() { sort -n | awk '{v[NR] = $1} END {print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2}'; }
    dpdk_mpps=$(printf '%s\n' "${pairs[@]}" | cut -d' ' -f1 | median)
    mpps=$(printf '%s\n' "${pairs[@]}" | cut -d' ' -f2 | median)
    ratio=$(printf '%s\n' "${pairs[@]}" | cut -d' ' -f3 | median)
    range=$(printf '%s\n' "${pairs[@]}" | cut -d' ' -f3 | sort -n | sed -n '1p;$p' | paste -sd-)
    printf '%-10s %16s %14s %14s %8s %12s %12s %10s\n' "$s" "$dpdk_default" "$dpdk_mpps" "$mpps" "$ratio" "$range" "$mib" "$build"
done
