#!/usr/bin/env bash
# The service's packet rate, builds side by side: `dpuflow run PIPELINE --loop --workers
# WORKERS` loops a capture of the benchmark's synthetic traffic (4096 flows, written by
# `dpuflow bench --write`) in on PORT and writes what leaves OUT to /dev/null (OUT `none`:
# nothing written, so with one worker no packet is dealt or written back); the rate is
# the growth of dpuflow_port_received_packets_total over SECONDS, after two seconds of
# warm-up. Each round runs every build named in turn; prints each build's rates and
# median. Needs curl.
# Usage: [BUILDS="BIN …"] bench/service.sh [ROUNDS] [SECONDS] [WORKERS] [PIPELINE PORT OUT]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-5}
seconds=${2:-5}
workers=${3:-2}
pipe=${4:-pipelines/vxlan-gateway.pipe}
port=${5:-host}
out=${6:-uplink}
need curl curl
builds_to_run
dir=$(mktemp -d)
trap 'pkill -f "$dir/traffic.pcap" 2>/dev/null || true; rm -rf "$dir"' EXIT
"${builds[0]}" bench "$pipe" --port "$port" --flows 4096 --write "$dir/traffic.pcap" >/dev/null

received() {
    curl -sf "http://$1/metrics" |
        sed -n "s/^dpuflow_port_received_packets_total{port=\"$port\"} \\([0-9]*\\)\$/\\1/p"
}

declare -A rates
for round in $(seq "$rounds"); do
    for i in "${!builds[@]}"; do
        addr=127.0.0.1:$(free_port)
        output=(--out "$out=/dev/null")
        [ "$out" = none ] && output=()
        "${builds[$i]}" run "$pipe" --in "$port=$dir/traffic.pcap" "${output[@]}" \
            --loop --workers "$workers" --metrics "$addr" 2>/dev/null &
        pid=$!
        until received "$addr" >/dev/null 2>&1; do sleep 0.1; done
        sleep 2
        a=$(received "$addr")
        sleep "$seconds"
        b=$(received "$addr")
        kill -TERM "$pid"
        wait "$pid" || true
        rate=$(( (b - a) / seconds ))
        echo "round $round, build $i (${builds[$i]}): $rate packets/s"
        rates[$i]="${rates[$i]:-} $rate"
    done
done
for i in "${!builds[@]}"; do
    echo "build $i (${builds[$i]}): median $(echo "${rates[$i]}" | median) packets/s ($workers workers)"
done
