#!/usr/bin/env bash
# The service with telemetry off and on, side by side: `dpuflow run` loops a capture of
# the benchmark's synthetic traffic through one worker while this script scrapes
# /metrics every second; the rate is the growth of dpuflow_port_received_packets_total
# over the measured seconds. "On" adds IPFIX export (to a UDP sink on 127.0.0.1).
# Beside the rate, the worker thread's CPU time a packet (user and system, from
# /proc/PID/task/*/stat over the same seconds), compared as off/on: when it is about
# 1 s over the rate, the worker is what limits the service (its waits for the I/O thread
# count too: crossbeam's receive spins before it sleeps).
# Also prints the engine alone (`dpuflow bench` with and without --telemetry).
# The default pipeline keeps its flows in the flow cache; bench/conntrack.pipe (port a)
# tracks connections, whose entries then hold the flow records. With SAMPLING N the flow
# cache counts one packet in N (`--ipfix-sampling N`). FLOWS sets the flows of the
# traffic (4096 by default; the engine alone then runs twice as many packets untimed
# first, so the flows are held before it is timed).
# Usage: [FLOWS=N] bench/telemetry.sh [ROUNDS] [SECONDS] [PIPELINE PORT] [SAMPLING]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
seconds=${2:-10}
pipe=${3:-pipelines/vxlan-gateway.pipe}
port=${4:-host}
sampling=${5:-1}
flows=${FLOWS:-4096}
cargo build --release -q
bin=target/release/dpuflow
dir=$(mktemp -d)
sink_pid=
cleanup() {
    [ -n "$sink_pid" ] && kill "$sink_pid" 2>/dev/null
    pkill -f "$dir/traffic.pcap" 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
"$bin" bench "$pipe" --port "$port" --flows "$flows" --write "$dir/traffic.pcap"
python3 -c '
import socket
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.1", 0))
print(s.getsockname()[1], flush=True)
while True:
    s.recv(65535)
' >"$dir/sink.port" &
sink_pid=$!
while [ ! -s "$dir/sink.port" ]; do sleep 0.1; done
ipfix=127.0.0.1:$(cat "$dir/sink.port")

received() {
    curl -sf "http://$1/metrics" |
        sed -n "s/^dpuflow_port_received_packets_total{port=\"$port\"} \\([0-9]*\\)\$/\\1/p"
}

# CPU clock ticks (user and system) the worker threads of process $1 have used.
worker_ticks() {
    local t sum=0
    for t in /proc/"$1"/task/*; do
        case $(cat "$t/comm" 2>/dev/null) in
        worker-*) sum=$((sum + $(awk '{print $14 + $15}' "$t/stat"))) ;;
        esac
    done
    echo "$sum"
}

# Prints the service's packets per second over `seconds`, after two seconds of warm-up,
# and its workers' CPU nanoseconds a packet.
service() {
    local addr=127.0.0.1:$((20000 + RANDOM % 20000)) extra=("$@") pid a b ta tb
    "$bin" run "$pipe" --in "$port=$dir/traffic.pcap" --loop --workers 1 \
        --metrics "$addr" "${extra[@]}" 2>/dev/null &
    pid=$!
    until received "$addr" >/dev/null 2>&1; do sleep 0.1; done
    sleep 2
    a=$(received "$addr")
    ta=$(worker_ticks "$pid")
    for _ in $(seq "$seconds"); do
        sleep 1
        b=$(received "$addr")
    done
    tb=$(worker_ticks "$pid")
    kill -TERM "$pid"
    wait "$pid"
    echo $(( (b - a) / seconds )) "$(echo "($tb - $ta) * 1000000000 / $(getconf CLK_TCK) / ($b - $a)" | bc -l)"
}

engine() {
    "$bin" bench "$pipe" --port "$port" --flows "$flows" --warmup $((2 * flows)) \
        --packets 20000000 "$@" |
        sed -n 's/.*: \([0-9.]*\) Mpps.*/\1/p'
}

printf '%-6s %14s %14s %7s %9s %9s %7s %12s %12s %7s\n' round "service off" "service on" \
    ratio "worker ns/pkt off" "on" ratio "engine off" "engine on" ratio
for r in $(seq "$rounds"); do
    read -r off noff <<<"$(service)"
    read -r on non <<<"$(service --ipfix "$ipfix" --ipfix-sampling "$sampling")"
    eoff=$(engine)
    eon=$(engine --telemetry --ipfix-sampling "$sampling")
    printf '%-6s %14s %14s %7.3f %9.2f %9.2f %7.3f %12s %12s %7.3f\n' "$r" "$off" "$on" \
        "$(echo "$on / $off" | bc -l)" "$noff" "$non" "$(echo "$noff / $non" | bc -l)" \
        "$eoff" "$eon" "$(echo "$eon / $eoff" | bc -l)"
done
