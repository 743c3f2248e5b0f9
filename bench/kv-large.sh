#!/usr/bin/env bash
# Large values through the KV-cache service to a real target: `redis-benchmark -t set,get
# -d VALUE -r KEYS` against `dpuflow run` with a service of CAPACITY MiB (default 64) in
# 64 KiB blocks on an NBD export (qemu-nbd, a file in /dev/shm) or, with TARGET=nvme, an
# NVMe/TCP namespace (the Linux kernel's nvmet-tcp, booted under QEMU by
# scripts/nvmet-target: its rates are the emulator's) or, with TARGET=nbd2, a store striped
# over two NBD exports, each half the disk, each served by a qemu-nbd of its own
# (STRIPE sets the service's `stripe`, default its own). KEYS defaults to twice what the
# capacity holds, so the service evicts as it goes; each run starts from an empty store.
# Round after round, each round runs every build named (a build before a change and one
# after, side by side); prints each build's median requests per second, the CPU time
# the service spent a request (user and system, both tests' requests together), and its
# peak resident size. PIPELINE=N has each client send N requests at a time (`-P N`).
# Needs redis-benchmark, qemu-nbd; for nvme qemu-system-x86, busybox-static, cpio.
# Usage: [BUILDS="BIN …"] [TARGET=nbd|nbd2|nvme] [STRIPE=SIZE] [CAPACITY=MiB] [KEYS=N] [PIPELINE=N]
#        bench/kv-large.sh [ROUNDS] [REQUESTS] [VALUE] [CLIENTS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
requests=${2:-2000}
value=${3:-1000000}
clients=${4:-1}
need redis-tools redis-benchmark
builds_to_run
shm_scratch kv-large

capacity=${CAPACITY:-64}
keys=${KEYS:-$((capacity * 1048576 * 2 / value + 1))}
truncate -s "$((capacity + 1))M" "$dir/disk.img"
target_port=$(free_port)
case ${TARGET:-nbd} in
nbd)
    need qemu-utils qemu-nbd
    start_nbd "$dir/disk.img"
    targets="target \"nbd://127.0.0.1:$nbd_port/kv\""
    disks=("$dir/disk.img")
    ;;
nbd2)
    need qemu-utils qemu-nbd
    targets=""
    disks=()
    for half in a b; do
        truncate -s "$((capacity / 2 + 1))M" "$dir/disk-$half.img"
        start_nbd "$dir/disk-$half.img"
        targets+="target \"nbd://127.0.0.1:$nbd_port/kv\"  "
        disks+=("$dir/disk-$half.img")
    done
    targets+="${STRIPE:+stripe $STRIPE}"
    ;;
nvme)
    scripts/nvmet-target "$target_port" "$dir/disk.img" >"$dir/target.log" 2>&1 &
    pids+=($!)
    until grep -q "nvmet ready" "$dir/target.log"; do
        sleep 1
        kill -0 "${pids[0]}" 2>/dev/null || { cat "$dir/target.log" >&2; exit 1; }
    done
    targets="target \"nvme-tcp://127.0.0.1:$target_port/nqn.2026-11.io.dpuflow:kv\""
    disks=("$dir/disk.img")
    ;;
*) echo "TARGET is nbd or nvme" >&2; exit 1 ;;
esac

declare -A sets gets cpus peaks
tick=$(getconf CLK_TCK)
for round in $(seq "$rounds"); do
    for i in "${!builds[@]}"; do
        port=$(free_port)
        cat >"$dir/kv.pipe" <<PIPE
pipeline kv_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  $targets  capacity ${capacity}MiB  block_size 64KiB }
pipe p root from fabric { default { actions to kvcache } }
PIPE
        for disk in "${disks[@]}"; do empty_store "$disk"; done
        "${builds[$i]}" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        pid=$!
        wait_port "$port"
        csv=$(redis-benchmark -p "$port" -t set,get -n "$requests" -d "$value" -r "$keys" -c "$clients" -P "${PIPELINE:-1}" --csv)
        cpu=$(awk -v t="$tick" -v n="$((2 * requests))" '{printf "%.1f", ($14 + $15) / t / n * 1e6}' "/proc/$pid/stat")
        peak=$(awk '/^VmHWM:/ {printf "%d", $2 / 1024}' "/proc/$pid/status")
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        set_rps=$(echo "$csv" | awk -F'"' '/^"SET"/ {print $4}')
        get_rps=$(echo "$csv" | awk -F'"' '/^"GET"/ {print $4}')
        echo "round $round, build $i (${builds[$i]}): SET $set_rps/s, GET $get_rps/s, CPU $cpu µs a request, peak $peak MiB"
        sets[$i]="${sets[$i]:-} $set_rps"
        gets[$i]="${gets[$i]:-} $get_rps"
        cpus[$i]="${cpus[$i]:-} $cpu"
        peaks[$i]="${peaks[$i]:-} $peak"
    done
done
for i in "${!builds[@]}"; do
    echo "build $i (${builds[$i]}): median SET $(echo "${sets[$i]}" | median)/s, GET $(echo "${gets[$i]}" | median)/s, CPU $(echo "${cpus[$i]}" | median) µs a request, peak $(echo "${peaks[$i]}" | median) MiB"
done
