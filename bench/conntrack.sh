#!/usr/bin/env bash
# Connection tracking on one core, 64-byte UDP frames, a table of 1M connections:
# new connections per second (every packet creates one) and the fast path for packets of
# existing connections; then TCP (ACKs picking connections up, and conversations: each
# connection opened by a handshake, then in-order data and acknowledgements) with TCP
# windows checked and without, 1M tracked. Each case RUNS times (default 5), median printed.
# Usage: bench/conntrack.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
cargo build --release -q
bin=target/release/dpuflow
median() { sort -n | sed -n "$(((runs + 1) / 2))p"; }
rate() { sed -n 's/.*: \([0-9.]*\) Mpps.*/\1/p'; }

new=$(for _ in $(seq "$runs"); do
    $bin bench bench/conntrack.pipe --flows 1000000 --packets 1000000 | rate
done | median)
est=$(for _ in $(seq "$runs"); do
    $bin bench bench/conntrack.pipe --flows 1000000 --warmup 1000000 --packets 10000000 | rate
done | median)
small=$(for _ in $(seq "$runs"); do
    $bin bench bench/conntrack.pipe --flows 1000 --warmup 100000 --packets 10000000 | rate
done | median)
tcp() {
    for _ in $(seq "$runs"); do
        $bin bench "$1" --flows 1000000 --warmup "${2:-1000000}" --packets 10000000 "${@:3}" | rate
    done | median
}
tcp_plain=$(tcp bench/conntrack-tcp.pipe)
tcp_window=$(tcp bench/conntrack-tcp-window.pipe)
conv_plain=$(tcp bench/conversations.pipe 3000000 --conversations)
conv_window=$(tcp bench/conversations-window.pipe 3000000 --conversations)
printf 'new connections (1M flows, empty table):        %s M/s\n' "$new"
printf 'existing connections, 1M tracked:               %s Mpps\n' "$est"
printf 'existing connections, 1k tracked (in cache):    %s Mpps\n' "$small"
printf 'TCP, 1M tracked, windows not checked:           %s Mpps\n' "$tcp_plain"
printf 'TCP, 1M tracked, windows checked:               %s Mpps\n' "$tcp_window"
printf 'TCP conversations, 1M, windows not checked:     %s Mpps\n' "$conv_plain"
printf 'TCP conversations, 1M, windows checked:         %s Mpps\n' "$conv_window"
