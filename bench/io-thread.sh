#!/usr/bin/env bash
# Instructions a packet of the service's threads with two workers, under callgrind
# (repeatable where timings are not): `dpuflow run PIPELINE --workers 2` over a capture of
# the benchmark's synthetic traffic (4096 flows, written by `dpuflow bench --write`)
# repeated REPEATS times, then the same with half as many; each run is stopped with
# SIGTERM once dpuflow_port_received_packets_total says every packet was read. The
# difference between the two runs, per packet of the difference, cancels the start and the
# idle wait: what the I/O thread (reading, dealing, writing) and the workers spend a packet.
# Needs valgrind and curl.
# Usage: [DPUFLOW=BIN] bench/io-thread.sh [PIPELINE PORT OUT] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
pipe=${1:-pipelines/vxlan-gateway.pipe}
port=${2:-host}
out=${3:-uplink}
repeats=${4:-50}
for t in valgrind curl; do
    command -v $t >/dev/null || { echo "$t not found" >&2; exit 1; }
done
dpuflow_bin
dir=$(mktemp -d)
trap 'pkill -f "$dir/" 2>/dev/null || true; rm -rf "$dir"' EXIT
"$bin" bench "$pipe" --port "$port" --flows 4096 --write "$dir/flows.pcap" >/dev/null
# The capture repeated N times, each copy later in time.
repeat() { # N FILE
    python3 - "$dir/flows.pcap" "$1" "$2" <<'PY'
import struct, sys
src, n, dst = sys.argv[1], int(sys.argv[2]), sys.argv[3]
data = open(src, 'rb').read()
frames, i = [], 24
while i < len(data):
    incl = struct.unpack('<I', data[i + 8:i + 12])[0]
    frames.append(data[i + 16:i + 16 + incl])
    i += 16 + incl
out, t = bytearray(data[:24]), 0
for _ in range(n):
    for f in frames:
        t += 1
        out += struct.pack('<IIII', t // 1000000, t % 1000000, len(f), len(f)) + f
open(dst, 'wb').write(out)
print(len(frames) * n)
PY
}
# Prints each thread's instructions, largest first.
run() { # N CAPTURE
    local metrics cg
    metrics=$(free_port)
    cg=$dir/cg.$1
    valgrind --tool=callgrind --separate-threads=yes --callgrind-out-file="$cg.%p" \
        "$bin" run "$pipe" --in "$port=$2" --out "$out=$dir/out.pcap" --workers 2 \
        --metrics "127.0.0.1:$metrics" >/dev/null 2>&1 &
    local pid=$!
    until curl -s "127.0.0.1:$metrics/metrics" 2>/dev/null |
        grep -q "^dpuflow_port_received_packets_total{port=\"$port\"} $1\$"; do
        sleep 1
    done
    kill -TERM "$pid"
    wait "$pid" || true
    for f in "$cg".*-*; do
        callgrind_annotate "$f" 2>/dev/null | sed -n 's/^\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' | tr -d ,
    done | sort -rn
}
long=$(repeat "$repeats" "$dir/long.pcap")
short=$(repeat $((repeats / 2)) "$dir/short.pcap")
mapfile -t a < <(run "$long" "$dir/long.pcap")
mapfile -t b < <(run "$short" "$dir/short.pcap")
n=$((long - short))
echo "$pipe, port $port, two workers: $long and $short packets"
echo "I/O thread: $(( (a[0] - b[0]) / n )) instructions a packet"
echo "workers: $(( (a[1] - b[1]) / n )) and $(( (a[2] - b[2]) / n )) instructions a packet of all (each takes about half)"
