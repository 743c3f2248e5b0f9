#!/usr/bin/env bash
# Instructions per packet under callgrind (repeatable on a noisy machine): each case runs
# with 100k and 300k packets and the difference is divided by 200k, which cancels start-up.
# Cases marked +ipfix keep flow records (`--telemetry`), as `dpuflow run --ipfix` does.
# The conversations cases open their connections with handshakes in an untimed warmup.
# Usage: bench/instructions.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v valgrind >/dev/null || { echo "valgrind not found: apt-get install valgrind" >&2; exit 1; }
cargo build --release -q
bin=target/release/dpuflow
ir() {
    local out
    out=$(mktemp)
    # shellcheck disable=SC2086 # the flags are words
    valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" bench "$1" --port "$2" --size 64 --flows 4096 --packets "$3" $4 >/dev/null 2>&1
    callgrind_annotate "$out" 2>/dev/null | sed -n 's/^\([0-9,]*\) .*PROGRAM TOTALS.*/\1/p' | tr -d ,
    rm -f "$out"
}
printf '%-22s %14s\n' case "instr/packet"
for c in "forward bench/forward.pipe a" "exact-match-forward bench/exact-forward.pipe a" \
         "vxlan-encap pipelines/vxlan-gateway.pipe host" "vxlan-decap pipelines/vxlan-gateway.pipe uplink" \
         "geneve-encap pipelines/geneve-gateway.pipe host" "geneve-decap pipelines/geneve-gateway.pipe uplink" \
         "vni-stitch bench/vni-stitch.pipe uplink" \
         "vxlan-encap+ipfix pipelines/vxlan-gateway.pipe host --telemetry" \
         "conntrack bench/conntrack.pipe a" "conntrack+ipfix bench/conntrack.pipe a --telemetry" \
         "conntrack-tcp bench/conntrack-tcp.pipe a" "conntrack-tcp+window bench/conntrack-tcp-window.pipe a" \
         "conversations bench/conversations.pipe a --conversations --warmup 12288" \
         "conversations+window bench/conversations-window.pipe a --conversations --warmup 12288"; do
    read -r name pipe port flag <<<"$c"
    a=$(ir "$pipe" "$port" 100000 "$flag")
    b=$(ir "$pipe" "$port" 300000 "$flag")
    printf '%-22s %14s\n' "$name" "$(( (b - a) / 200000 ))"
done
