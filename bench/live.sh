#!/usr/bin/env bash
# Live ports between two network namespaces: tcpreplay offers 64-byte UDP frames (4096
# flows) to dpuflow's inside port at each rate; the outside host counts what arrives.
# Prints, per offered rate, the rate tcpreplay achieved, the share delivered, the CPU
# time dpuflow spent a frame offered and the cores its dataplane threads were busy (their
# CPU time less idle polling, from its metrics); then the round trip of 200 pings across dpuflow and
# across a kernel bridge in its place. DRIVER=af_xdp runs the ports on AF_XDP (default
# af_packet). RELOAD_EVERY=SECONDS sends dpuflow SIGHUP that often while the frames flow
# (each reloads the pipeline) and adds a column of the reloads done. TRACK=1 runs a
# stateful firewall instead of a plain bridge: every flow from inside committed to
# connection tracking, only tracked ones (and ARP) let in from outside. QUEUES=N gives
# the links N queues each (default 1; AF_XDP workers share a port by queue). FLAGS='…'
# adds flags to `dpuflow run` (--busy-poll, say). SYSCALLS=1 adds a column of the system
# calls dpuflow made a frame offered (perf stat on raw_syscalls:sys_enter). Needs root,
# tcpreplay and ethtool (and perf for SYSCALLS).
# A RATE of max offers them as fast as tcpreplay can (--topspeed).
# Usage: [DPUFLOW=BIN] [DRIVER=af_packet|af_xdp] [RELOAD_EVERY=S] [TRACK=1] [QUEUES=N] [FLAGS=…] [SYSCALLS=1] bench/live.sh [WORKERS] [RATE...]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
workers=${1:-1}
shift || true
rates=("${@:-100000 200000 300000 400000 1000000}")
# shellcheck disable=SC2206 # rates are words
rates=(${rates[*]})
# DPUFLOW=path runs another build (to compare two side by side).
if [ -z "${DPUFLOW:-}" ]; then
    cargo build --release -q
fi
bin=${DPUFLOW:-$PWD/target/release/dpuflow}
for tool in tcpreplay ethtool; do
    command -v $tool >/dev/null || { echo "$tool not found: apt-get install $tool" >&2; exit 1; }
done
tmp=$(mktemp -d)
c=dpflive$$c d=dpflive$$d s=dpflive$$s
cleanup() {
    kill "$(cat "$tmp/pid" 2>/dev/null)" 2>/dev/null || true
    for n in $c $d $s; do ip netns del $n 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
live_namespaces $c $d $s numrxqueues "${QUEUES:-1}" numtxqueues "${QUEUES:-1}"
driver=${DRIVER:-af_packet}
if [ -n "${TRACK:-}" ]; then
    live_firewall "$driver" >"$tmp/bridge.pipe"
else
    cat >"$tmp/bridge.pipe" <<EOF
pipeline bridge
port inside  { driver $driver  iface "in0" }
port outside { driver $driver  iface "out0" }
pipe in  root from inside  { default { actions fwd outside } }
pipe out root from outside { default { actions fwd inside } }
EOF
fi
"$bin" bench "$tmp/bridge.pipe" --port inside --flows 4096 --write "$tmp/udp64.pcap"
loops=50
offered=$((4096 * loops))
rx() { ip -n $s -s link show s0 | awk '/RX:/ {getline; print $2}'; }
# The dataplane threads' CPU seconds less their idle polling (--busy-poll), summed, so far.
busy() {
    ip netns exec $d curl -s 127.0.0.1:9464/metrics | awk '
        /^dpuflow_thread_cpu_seconds_total\{thread="(io|worker-[0-9]+)"\}/ {b += $2}
        /^dpuflow_thread_idle_seconds_total\{thread="(io|worker-[0-9]+)"\}/ {b -= $2}
        END {printf "%.3f", b}'
}
# CPU time (user and system, in clock ticks) of process $1 so far.
cpu() { awk '{print $14 + $15}' "/proc/$1/stat"; }
tick_us=$((1000000 / $(getconf CLK_TCK)))
printf '%-14s %-16s %-10s %-13s %-13s %s\n' "offered (pps)" "achieved (pps)" "delivered" "CPU µs/frame" \
    "busy (cores)" "${SYSCALLS:+syscalls/frame }${RELOAD_EVERY:+reloads}"
for pps in "${rates[@]}"; do
    # shellcheck disable=SC2086 # FLAGS are words
    ip netns exec $d "$bin" run "$tmp/bridge.pipe" --workers "$workers" --metrics 127.0.0.1:9464 \
        ${FLAGS:-} 2>"$tmp/log" & echo $! >"$tmp/pid"
    sleep 1
    before=$(rx)
    pid=$(cat "$tmp/pid")
    cpu_before=$(cpu "$pid")
    busy_before=$(busy)
    started=$(date +%s.%N)
    if [ -n "${RELOAD_EVERY:-}" ]; then
        (while sleep "$RELOAD_EVERY"; do kill -HUP "$pid" 2>/dev/null || break; done) &
        hupper=$!
    fi
    if [ -n "${SYSCALLS:-}" ]; then
        perf stat -x, -e raw_syscalls:sys_enter -p "$pid" -o "$tmp/syscalls" & perf=$!
        sleep 0.2
    fi
    pace=(--pps "$pps")
    [ "$pps" != max ] || pace=(--topspeed)
    achieved=$(ip netns exec $c tcpreplay -i c0 "${pace[@]}" --loop $loops "$tmp/udp64.pcap" 2>&1 |
        sed -n 's/.* \([0-9.]*\) pps.*/\1/p')
    cpu_after=$(cpu "$pid")
    busy_cores=$(echo "scale=2; ($(busy) - $busy_before) / ($(date +%s.%N) - $started)" | bc)
    [ -z "${hupper:-}" ] || kill "$hupper"
    sleep 0.5
    after=$(rx)
    syscalls=
    if [ -n "${SYSCALLS:-}" ]; then
        kill -INT $perf; wait $perf || true
        syscalls="$(echo "scale=3; $(awk -F, '/sys_enter/ {print $1}' "$tmp/syscalls") / $offered" | bc) "
    fi
    kill "$(cat "$tmp/pid")"; wait "$(cat "$tmp/pid")" 2>/dev/null || true
    [ -z "${LIVE_LOG:-}" ] || tail -3 "$tmp/log" >&2
    printf '%-14s %-16s %-10s %-13s %-13s %s\n' "$pps" "$achieved" "$(echo "scale=4; ($after - $before) / $offered" | bc)" \
        "$(echo "scale=2; ($cpu_after - $cpu_before) * $tick_us / $offered" | bc)" "$busy_cores" \
        "$syscalls${RELOAD_EVERY:+$(grep -c 'pipeline reloaded' "$tmp/log" || true)}"
done
ip -n $c addr add 10.9.0.1/24 dev c0
ip -n $s addr add 10.9.0.2/24 dev s0
rtt() { ip netns exec $c ping -c 200 -i 0.01 -q 10.9.0.2 | sed -n 's/^rtt.* = //p'; }
# shellcheck disable=SC2086 # FLAGS are words
ip netns exec $d "$bin" run "$tmp/bridge.pipe" --workers "$workers" --metrics 127.0.0.1:9464 \
    ${FLAGS:-} 2>"$tmp/log" & echo $! >"$tmp/pid"
sleep 1
echo "ping across dpuflow (min/avg/max/mdev):      $(rtt)"
kill "$(cat "$tmp/pid")"; wait "$(cat "$tmp/pid")" 2>/dev/null || true
ip -n $d link add br0 type bridge
ip -n $d link set in0 master br0
ip -n $d link set out0 master br0
ip -n $d link set br0 up
echo "ping across a kernel bridge (min/avg/max/mdev): $(rtt)"
