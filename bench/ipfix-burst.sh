#!/usr/bin/env bash
# Many flows ending at once, exported to nfcapd on loopback at each of several rates: a
# capture of FLOWS synthetic flows (one packet each) runs through the VXLAN gateway, every
# flow ends with the input, and the export goes out at `--ipfix-rate RATE` messages a
# second. Prints the messages sent, the datagrams the kernel dropped for a full receive
# buffer (`UdpRcvbufErrors` from nstat, on this host), the records nfdump then lists and
# the seconds from start until the export settled.
# Usage: bench/ipfix-burst.sh FLOWS RATE...      e.g. bench/ipfix-burst.sh 1000000 50000 10000
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
for tool in nfcapd nfdump nstat curl; do
    command -v "$tool" >/dev/null || { echo "$tool not found (packages nfdump, iproute2, curl)" >&2; exit 1; }
done
flows=$1
shift
dpuflow_bin
dir=$(mktemp -d)
nfcapd_pid=
cleanup() {
    [ -n "$nfcapd_pid" ] && kill "$nfcapd_pid" 2>/dev/null
    rm -rf "$dir"
}
trap cleanup EXIT
"$bin" bench pipelines/vxlan-gateway.pipe --port host --flows "$flows" --write "$dir/t.pcap" >/dev/null
collector=$((20000 + RANDOM % 20000))

messages() {
    curl -sf "http://$1/metrics" | sed -n 's/^dpuflow_ipfix_messages_total \([0-9]*\)$/\1/p'
}

printf '%-12s %10s %10s %10s %8s\n' rate messages dropped records seconds
for rate in "$@"; do
    rm -rf "$dir/store" && mkdir "$dir/store"
    nfcapd -b 127.0.0.1 -p "$collector" -w "$dir/store" -t 3600 >/dev/null 2>&1 &
    nfcapd_pid=$!
    sleep 0.5
    nstat -n
    addr=127.0.0.1:$(free_port)
    start=$(date +%s.%N)
    "$bin" run pipelines/vxlan-gateway.pipe --in "host=$dir/t.pcap" --metrics "$addr" \
        --ipfix "127.0.0.1:$collector" --ipfix-rate "$rate" 2>/dev/null &
    pid=$!
    # Settled: every flow's record made, and the count of messages unchanged for 0.2 s.
    last=
    while sleep 0.2; do
        now=$(messages "$addr" || true)
        records=$(curl -sf "http://$addr/metrics" | sed -n 's/^dpuflow_flow_records_total \([0-9]*\)$/\1/p' || true)
        [ -n "$now" ] && [ "${records:-0}" -ge "$flows" ] && [ "$now" = "$last" ] && break
        last=$now
    done
    end=$(date +%s.%N)
    kill -TERM "$pid"
    wait "$pid"
    dropped=$(nstat | awk '/UdpRcvbufErrors/ {print $2}')
    sleep 0.5
    kill "$nfcapd_pid"
    wait "$nfcapd_pid" 2>/dev/null || true
    nfcapd_pid=
    stored=$(nfdump -R "$dir/store" -q -o csv 2>/dev/null | grep -c , || true)
    printf '%-12s %10s %10s %10s %8.2f\n' "$rate" "$now" "${dropped:-0}" "$stored" \
        "$(echo "$end - $start" | bc -l)"
done
