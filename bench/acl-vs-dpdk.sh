#!/usr/bin/env bash
# The rule classifier next to DPDK's rte_acl, same rule and trace files, one core, same run:
# dpdk-test-acl (Debian dpdk-dev) with the given algorithm, then `dpuflow acl bench`.
# Usage: bench/acl-vs-dpdk.sh [ALG] [SETS...]   (ALG: avx2 by default; SETS: ClassBench files)
set -euo pipefail
cd "$(dirname "$0")/.."
alg=${1:-avx2}
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
printf '%-10s %16s %14s %14s %8s %12s %10s\n' set "rte_acl(default)" "rte_acl Mpps" "dpuflow Mpps" ratio "dpuflow MiB" "build ms"
for s in "${sets[@]}"; do
    $bin acl gen-trace --rules "$dir/$s" --count 100000 --seed 1 >"$tmp/$s.trace"
    run_dpdk() {
        dpdk-test-acl -l 0 --no-huge --no-pci -m 1024 --file-prefix="dpuflow-acl-$$" -- \
            --rulesf="$dir/$s" --tracef="$tmp/$s.trace" --tracenum=100000 --tracestep=32 \
            --alg="$alg" --iter=10 "$@" 2>/dev/null | sed -n 's/.* \([0-9.]*\) pkt\/sec.*/\1/p' | tail -n 1
    }
    dpdk_default=$(run_dpdk | awk '{printf "%.2f", $1 / 1e6}')
    dpdk=$(run_dpdk --verbose=0)
    ours=$($bin acl bench --rules "$dir/$s" --trace "$tmp/$s.trace" --batch 32 --iter 10)
    mpps=$(sed -n 's/^lookups: .*: \([0-9.]*\) Mpps.*/\1/p' <<<"$ours")
    mib=$(sed -n 's/.*memory \([0-9.]*\) MiB.*/\1/p' <<<"$ours")
    build=$(sed -n 's/.*build \([0-9.]*\) ms.*/\1/p' <<<"$ours")
    dpdk_mpps=$(awk -v p="$dpdk" 'BEGIN {printf "%.2f", p / 1e6}')
    ratio=$(awk -v a="$mpps" -v b="$dpdk_mpps" 'BEGIN {printf "%.2f", a / b}')
    printf '%-10s %16s %14s %14s %8s %12s %10s\n' "$s" "$dpdk_default" "$dpdk_mpps" "$mpps" "$ratio" "$mib" "$build"
done
