#!/usr/bin/env bash
# Software-engine throughput on one core, 64-byte frames, in memory: each case run
# RUNS times (default 5), median Mpps printed. Usage: bench/engine.sh [RUNS] [PACKETS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
packets=${2:-20000000}
cargo build --release -q
bin=target/release/dpuflow

cases=(
    "forward                bench/forward.pipe              a"
    "exact-match-forward    bench/exact-forward.pipe        a"
    "vxlan-encap            pipelines/vxlan-gateway.pipe    host"
    "vxlan-decap            pipelines/vxlan-gateway.pipe    uplink"
    "geneve-encap           pipelines/geneve-gateway.pipe   host"
    "geneve-decap           pipelines/geneve-gateway.pipe   uplink"
)
printf '%-22s %10s %12s\n' case "Mpps" "ns/packet"
for c in "${cases[@]}"; do
    read -r name pipe port <<<"$c"
    results=()
    for _ in $(seq "$runs"); do
        results+=("$($bin bench "$pipe" --port "$port" --size 64 --flows 4096 --packets "$packets" --batch 32 |
            sed -n 's/.*: \([0-9.]*\) Mpps, \([0-9.]*\) ns.*/\1 \2/p')")
    done
    median=$(printf '%s\n' "${results[@]}" | sort -n | sed -n "$(((runs + 1) / 2))p")
    printf '%-22s %10s %12s\n' "$name" $median
done
