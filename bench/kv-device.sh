#!/usr/bin/env bash
# The KV-cache service on a local block device: a loop device standing in for a DPU's
# local NVMe, itself doing direct I/O to its backing file on this machine's disk (so what
# reaches the device reaches the disk). Each round runs each build twice, reading and
# writing the device directly (`page_cache off`, the default for a device) and through
# the page cache (`page_cache on`), or as CACHES lists; each time redis-benchmark SETs,
# then GETs, VALUE-byte values over KEYS random keys from CLIENTS connections. Prints the
# requests per second of each, then how much of the device the page cache holds
# (scripts/page-cached), the service's CPU time (user and system) a SET and a GET, and its
# resident memory. The device's page cache is dropped before each run
# (`blockdev --flushbufs`). MEMORY=MiB runs each service in a memory cgroup of that limit,
# which the page cache its reads and writes fill counts against, as it would against a
# DPU's memory: a store larger than the memory it may use.
# KV_OPTIONS adds options to the service block (e.g. `connections 16`). BUILDS="BIN …"
# compares builds.
# Needs root, redis-tools and util-linux (losetup, blockdev).
# Usage: [BUILDS=…] [CACHES="off on"] [MEMORY=MiB] [KV_OPTIONS=…] bench/kv-device.sh [ROUNDS] [REQUESTS] [VALUE] [CLIENTS] [KEYS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
requests=${2:-20000}
value=${3:-65536}
clients=${4:-16}
keys=${5:-4000}
need "redis-tools, util-linux" redis-benchmark losetup blockdev
builds_to_run
# On the disk, not tmpfs: the device's reads and writes are the disk's.
dir=$(mktemp -d /var/tmp/dpuflow-kv-device.XXXXXX)
device=""
cgroup=""
detach() {
    [ -z "$device" ] || losetup --detach "$device"
    stop_all
    [ -z "$cgroup" ] || rmdir "$cgroup"
}
trap detach EXIT

capacity=$(( keys * value * 2 / 1048576 + 64 ))
truncate -s "${capacity}M" "$dir/device.img"
device=$(losetup --find --show --direct-io=on "$dir/device.img")

# The command that starts a service: in the memory cgroup, with MEMORY.
in_memory_limit=()
if [ -n "${MEMORY:-}" ]; then
    if [ -d /sys/fs/cgroup/memory ]; then # cgroup v1
        cgroup=/sys/fs/cgroup/memory/dpuflow-kv-device.$$
        mkdir "$cgroup"
        echo $((MEMORY << 20)) >"$cgroup/memory.limit_in_bytes"
    else
        cgroup=/sys/fs/cgroup/dpuflow-kv-device.$$
        mkdir "$cgroup"
        echo $((MEMORY << 20)) >"$cgroup/memory.max"
    fi
    in_memory_limit=(sh -c 'echo $$ >"$0/cgroup.procs" && exec "$@"' "$cgroup")
fi
rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }
# User and system CPU time of process PID, in clock ticks (proc(5), fields 14 and 15).
cpu_ticks() { sed 's/.*) //' "/proc/$1/stat" | awk '{print $12 + $13}'; }
ticks_per_s=$(getconf CLK_TCK)

printf '%-6s %-28s %-10s %9s %9s %14s %9s %9s %12s\n' round build page_cache "SET/s" "GET/s" \
    "device cached" "CPU/SET" "CPU/GET" "service RSS"
for round in $(seq "$rounds"); do
    for bin in "${builds[@]}"; do
    for cache in ${CACHES:-off on}; do
        empty_store "$device"
        blockdev --flushbufs "$device"
        port=$(free_port)
        cat >"$dir/kv.pipe" <<PIPE
pipeline kv_device
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  target "nvme://$device"  capacity ${capacity}MiB  block_size 64KiB  checkpoint off  page_cache $cache  ${KV_OPTIONS:-} }
pipe p root from fabric { default { actions to kvcache } }
PIPE
        "${in_memory_limit[@]}" "$bin" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
        pid=$!
        pids+=("$pid")
        wait_port "$port"
        rps() { # TEST
            redis-benchmark -p "$port" -t "$1" -n "$requests" -d "$value" -r "$keys" -c "$clients" --csv \
                | awk -F'"' -v t="${1^^}" '$2 == t {print $4}'
        }
        # The CPU time of what ran since tick count $1, a request, in µs.
        cpu_us() { echo $(( ($(cpu_ticks "$pid") - $1) * 1000000 / ticks_per_s / requests )); }
        ticks=$(cpu_ticks "$pid")
        set_rps=$(rps set)
        set_cpu=$(cpu_us "$ticks")
        ticks=$(cpu_ticks "$pid")
        get_rps=$(rps get)
        get_cpu=$(cpu_us "$ticks")
        held=$(scripts/page-cached "$device")
        rss=$(( $(rss_kib "$pid") / 1024 ))
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        printf '%-6s %-28s %-10s %9s %9s %11s MB %6s µs %6s µs %9s MB\n' "$round" "$bin" "$cache" \
            "$set_rps" "$get_rps" "$(( held / 1048576 ))" "$set_cpu" "$get_cpu" "$rss"
    done
    done
done
