#!/usr/bin/env bash
# The framework ceiling next to dpuflow, in the same run: dpdk-testpmd forwarding between
# two null ports (macswap, one forwarding core) and dpuflow's forward pipeline on one core.
# Needs dpdk-testpmd (Debian package dpdk-dev). Usage: bench/vs-testpmd.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-10}
command -v dpdk-testpmd >/dev/null || { echo "dpdk-testpmd not found: apt-get install dpdk-dev" >&2; exit 1; }
cargo build --release -q

log=$(mktemp)
trap 'rm -f "$log"' EXIT
# Core 0 runs the main thread, core 1 forwards both ports; stats every second.
timeout -s INT "$((seconds + 5))" dpdk-testpmd -l 0-1 --no-huge --no-pci -m 1024 \
    --vdev=net_null0 --vdev=net_null1 --file-prefix="dpuflow-bench-$$" -- \
    --forward-mode=macswap --total-num-mbufs=16384 --stats-period 1 >"$log" 2>&1 || true
# Sum the two ports' Rx-pps of the last complete stats report.
testpmd_pps=$(grep -E '^\s+Rx-pps:' "$log" | tail -n 2 | awk '{s += $2} END {print s}')
[ -n "$testpmd_pps" ] && [ "$testpmd_pps" != 0 ] || { cat "$log" >&2; echo "testpmd reported no rate" >&2; exit 1; }

dpuflow_mpps=$(target/release/dpuflow bench bench/forward.pipe --size 64 --packets 50000000 |
    sed -n 's/.*: \([0-9.]*\) Mpps.*/\1/p')
testpmd_mpps=$(awk -v p="$testpmd_pps" 'BEGIN {printf "%.2f", p / 1e6}')
printf 'dpdk-testpmd macswap, 2 null ports, 1 core: %s Mpps\n' "$testpmd_mpps"
printf 'dpuflow bench/forward.pipe, 1 core:          %s Mpps\n' "$dpuflow_mpps"
awk -v a="$dpuflow_mpps" -v b="$testpmd_mpps" 'BEGIN {printf "ratio dpuflow / testpmd: %.2f\n", a / b}'
