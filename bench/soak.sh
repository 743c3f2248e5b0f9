#!/usr/bin/env bash
# A long run of the service as it is deployed, watched for what grows: a stateful firewall
# on live ports between two network namespaces (65536 flows offered by tcpreplay at PPS,
# every one committed to connection tracking, records exported to a collector that is not
# there), reloaded every 2 s and scraped every second. Prints, every EVERY seconds, the
# service's resident memory, open descriptors and threads; then the packets in and out,
# the reloads, what /healthz says and the exit status of a SIGTERM. Needs root, tcpreplay,
# ethtool and curl.
# Usage: [DPUFLOW=BIN] [DRIVER=af_packet|af_xdp] [PPS=N] [EVERY=S] bench/soak.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
seconds=${1:-300}
need tcpreplay tcpreplay
need ethtool ethtool
need curl curl
dpuflow_bin
tmp=$(mktemp -d)
c=dpfsoak$$c d=dpfsoak$$d s=dpfsoak$$s
cleanup() {
    kill "$(cat "$tmp/pid" 2>/dev/null)" ${helpers[@]+"${helpers[@]}"} 2>/dev/null || true
    for n in $c $d $s; do ip netns del $n 2>/dev/null || true; done
    rm -rf "$tmp"
}
trap cleanup EXIT
live_namespaces $c $d $s
driver=${DRIVER:-af_xdp}
{
    live_firewall "$driver"
    echo 'telemetry { ipfix 127.0.0.1:4739 }'
} >"$tmp/firewall.pipe"
"$bin" bench "$tmp/firewall.pipe" --port inside --flows 65536 --write "$tmp/udp.pcap" >/dev/null
ip netns exec $d "$bin" run "$tmp/firewall.pipe" --workers 2 --metrics 127.0.0.1:9464 \
    2>"$tmp/log" & echo $! >"$tmp/pid"
pid=$(cat "$tmp/pid")
sleep 1
helpers=()
ip netns exec $c tcpreplay -i c0 --pps "${PPS:-200000}" --loop 1000000 "$tmp/udp.pcap" >/dev/null 2>&1 &
helpers+=($!)
(while sleep 2; do kill -HUP "$pid" 2>/dev/null || break; done) &
helpers+=($!)
(while sleep 1; do ip netns exec $d curl -s -o /dev/null 127.0.0.1:9464/metrics || true; done) &
helpers+=($!)
printf '%-8s %-12s %-12s %s\n' seconds "RSS (KB)" descriptors threads
end=$((SECONDS + seconds))
while [ $SECONDS -lt $end ]; do
    printf '%-8s %-12s %-12s %s\n' $SECONDS "$(awk '/VmRSS/ {print $2}' /proc/$pid/status)" \
        "$(ls /proc/$pid/fd | wc -l)" "$(ls /proc/$pid/task | wc -l)"
    sleep "${EVERY:-30}"
done
kill "${helpers[@]}" 2>/dev/null || true
ip netns exec $d curl -s 127.0.0.1:9464/metrics |
    grep -E '^dpuflow_(port_(received|transmitted)_packets_total|pipeline_reloads_total)' || true
echo "/healthz: $(ip netns exec $d curl -s 127.0.0.1:9464/healthz)"
kill -TERM "$pid"
status=0
wait "$pid" || status=$?
echo "exit status after SIGTERM: $status"
