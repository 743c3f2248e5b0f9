#!/usr/bin/env bash
# The KV-cache service storing on a real NVMe/TCP target (the Linux kernel's nvmet-tcp,
# booted under QEMU by scripts/nvmet-target): `redis-benchmark -t set,get -d VALUE`
# against `dpuflow run` with a service on `nvme-tcp://`, round after round, each round
# running every build named (to compare them side by side: a build before a change and
# one after). Prints each build's median requests per second. The target runs in an
# emulated machine, so its rates are the emulator's; compare builds within one run.
# Needs redis-benchmark, qemu-system-x86, busybox-static, cpio.
# Usage: [BUILDS="BIN …"] bench/kv-nvme.sh [ROUNDS] [REQUESTS] [VALUE] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-3}
requests=${2:-2000}
value=${3:-1000000}
clients=${4:-1}
command -v redis-benchmark >/dev/null || { echo "redis-benchmark not found (redis-tools)" >&2; exit 1; }
if [ -z "${BUILDS:-}" ]; then
    cargo build --release -q
    BUILDS=$PWD/target/release/dpuflow
fi
read -r -a builds <<<"$BUILDS"
dir=$(mktemp -d /dev/shm/dpuflow-kv-large.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$dir"
}
trap cleanup EXIT
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
wait_port() { for _ in $(seq 300); do (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return; sleep 0.1; done; echo "nothing on $1" >&2; exit 1; }

capacity=${CAPACITY:-64}
keys=${KEYS:-$((capacity * 1048576 * 2 / value + 1))}
truncate -s "$((capacity + 1))M" "$dir/disk.img"
target_port=$(free_port)
case ${TARGET:-nbd} in
nbd)
    command -v qemu-nbd >/dev/null || { echo "qemu-nbd not found (qemu-utils)" >&2; exit 1; }
    qemu-nbd -f raw -x kv -b 127.0.0.1 -p "$target_port" --persistent --shared=64 "$dir/disk.img" >/dev/null 2>&1 &
    pids+=($!)
    wait_port "$target_port"
    url="nbd://127.0.0.1:$target_port/kv"
    ;;
nvme)
    scripts/nvmet-target "$target_port" "$dir/disk.img" >"$dir/target.log" 2>&1 &
    pids+=($!)
    until grep -q "nvmet ready" "$dir/target.log"; do
        sleep 1
        kill -0 "${pids[0]}" 2>/dev/null || { cat "$dir/target.log" >&2; exit 1; }
    done
    url="nvme-tcp://127.0.0.1:$target_port/nqn.2026-11.io.dpuflow:kv"
    ;;
*) echo "TARGET is nbd or nvme" >&2; exit 1 ;;
esac

declare -A sets gets
for round in $(seq "$rounds"); do
    for i in "${!builds[@]}"; do
        port=$(free_port)
        cat >"$dir/kv.pipe" <<PIPE
pipeline kv_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  target "$url"  capacity ${capacity}MiB  block_size 64KiB }
pipe p root from fabric { default { actions to kvcache } }
PIPE
        "${builds[$i]}" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        pid=$!
        wait_port "$port"
        csv=$(redis-benchmark -p "$port" -t set,get -n "$requests" -d "$value" -r "$keys" -c "$clients" --csv)
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        set_rps=$(echo "$csv" | awk -F'"' '/^"SET"/ {print $4}')
        get_rps=$(echo "$csv" | awk -F'"' '/^"GET"/ {print $4}')
        echo "round $round, build $i (${builds[$i]}): SET $set_rps/s, GET $get_rps/s"
        sets[$i]="${sets[$i]:-} $set_rps"
        gets[$i]="${gets[$i]:-} $get_rps"
    done
done
median() { tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END {print v[int((NR+1)/2)]}'; }
for i in "${!builds[@]}"; do
    echo "build $i (${builds[$i]}): median SET $(echo "${sets[$i]}" | median)/s, GET $(echo "${gets[$i]}" | median)/s"
done
