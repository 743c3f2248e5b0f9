#!/usr/bin/env bash
# The KV-cache service under redis-benchmark, next to redis-server in the same run: SET and
# GET of VALUE-byte values over KEYS random keys from CLIENTS connections. dpuflow stores
# the values on a target: a file on tmpfs (`file://`), and an NBD export of a tmpfs file
# served by qemu-nbd over loopback (`nbd://`); redis-server keeps them in its memory.
# Rounds alternate the three; the medians of the requests per second are printed, and
# beside them the NBD export's own rate (qemu-img bench). Needs redis-server, redis-tools
# and qemu-utils.
# KV_OPTIONS adds options to the service block (e.g. `connections 16`). STRIPED=1 adds the
# service on a store striped over two NBD exports, each served by a qemu-nbd of its own
# (`nbd2`), beside the one export. TLS=1 adds two
# contenders over TLS (a certificate openssl makes for the run): the service on the file
# target with `tls_cert`/`tls_key`, and redis-server on its `tls-port`.
# Usage: [DPUFLOW=BIN] [KV_OPTIONS=…] [STRIPED=1] [TLS=1] bench/kv.sh [ROUNDS] [REQUESTS] [VALUE] [CLIENTS] [KEYS]
set -euo pipefail
cd "$(dirname "$0")/.."
. bench/common.sh
rounds=${1:-3}
requests=${2:-20000}
value=${3:-65536}
clients=${4:-16}
keys=${5:-2000}
need "redis-server, redis-tools, qemu-utils" redis-server redis-benchmark qemu-nbd
dpuflow_bin
shm_scratch kv

capacity=$(( (keys * value * 2 / 1048576 + 64) ))
truncate -s "${capacity}M" "$dir/export.img"
start_nbd "$dir/export.img"
one_export=$nbd_port

start_dpuflow() { # NAME "TARGET…" [OPTIONS]; sets $port
    port=$(free_port)
    targets=$(printf 'target "%s"  ' $2)
    cat >"$dir/$1.pipe" <<PIPE
pipeline kv_bench
port fabric { driver pcap }
service kvcache { listen 127.0.0.1:$port  $targets capacity ${capacity}MiB  block_size 64KiB  ${KV_OPTIONS:-} ${3:-} }
pipe p root from fabric { default { actions to kvcache } }
PIPE
    "$bin" run "$dir/$1.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
    pids+=($!)
    wait_port "$port"
}
start_dpuflow file "file://$dir/blocks.img"
file_port=$port
start_dpuflow nbd "nbd://127.0.0.1:$one_export/kv"
nbdsvc_port=$port
redis_port=$(free_port)
redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no --daemonize no >/dev/null 2>&1 &
pids+=($!)
wait_port "$redis_port"
names=(redis file nbd)
if [ -n "${STRIPED:-}" ]; then
    # Half the store on each of two exports, each with a server process of its own.
    urls=""
    for half in a b; do
        truncate -s "$((capacity / 2 + 1))M" "$dir/export-$half.img"
        start_nbd "$dir/export-$half.img"
        urls+="nbd://127.0.0.1:$nbd_port/kv "
    done
    start_dpuflow nbd2 "$urls"
    nbd2_port=$port
    names+=(nbd2)
fi
if [ -n "${TLS:-}" ]; then
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 1 \
        -keyout "$dir/tls.key" -out "$dir/tls.pem" -subj /CN=127.0.0.1 \
        -addext subjectAltName=IP:127.0.0.1 2>/dev/null
    start_dpuflow file-tls "file://$dir/blocks-tls.img" "tls_cert \"$dir/tls.pem\"  tls_key \"$dir/tls.key\""
    filetls_port=$port
    redistls_port=$(free_port)
    redis-server --port 0 --tls-port "$redistls_port" --bind 127.0.0.1 --save '' --appendonly no \
        --tls-cert-file "$dir/tls.pem" --tls-key-file "$dir/tls.key" --tls-ca-cert-file "$dir/tls.pem" \
        --tls-auth-clients no --daemonize no >/dev/null 2>&1 &
    pids+=($!)
    wait_port "$redistls_port"
    names+=(redis-tls file-tls)
fi

run() { # PORT [TLS OPTIONS] -> "set get" requests per second
    redis-benchmark -p "$@" -t set,get -n "$requests" -d "$value" -r "$keys" -c "$clients" --csv 2>/dev/null |
        awk -F, '/^"SET"/ {gsub(/"/,"",$2); s=$2} /^"GET"/ {gsub(/"/,"",$2); g=$2} END {print s, g}'
}
declare -A sets gets
for r in $(seq "$rounds"); do
    for name in "${names[@]}"; do
        tls=()
        case $name in
            redis) p=$redis_port ;; file) p=$file_port ;; nbd) p=$nbdsvc_port ;; nbd2) p=$nbd2_port ;;
            redis-tls) p=$redistls_port; tls=(--tls --cacert "$dir/tls.pem") ;;
            file-tls) p=$filetls_port; tls=(--tls --cacert "$dir/tls.pem") ;;
        esac
        read -r s g < <(run "$p" "${tls[@]}")
        sets[$name]+="$s "; gets[$name]+="$g "
        echo "round $r $name: SET $s/s GET $g/s"
    done
done
# The NBD target alone, for reference: qemu-img's own NBD client reading and writing
# VALUE-byte blocks one at a time (more in flight stall on delayed ACKs in qemu-img 7.2).
target_rate() { # [-w] -> requests per second
    qemu-img bench -f raw -c 5000 -d 1 -s "$value" -S "$value" "$@" "nbd://127.0.0.1:$one_export/kv" 2>/dev/null |
        awk '/completed in/ {printf "%.2f", 5000 / $4}'
}
for r in $(seq "$rounds"); do
    w=$(target_rate -w); rd=$(target_rate)
    sets[target]+="$w "; gets[target]+="$rd "
    echo "round $r qemu-img bench on the NBD export: write $w/s read $rd/s"
done
echo "medians over $rounds rounds ($requests requests, $value-byte values, $clients clients, $keys keys):"
for name in "${names[@]}"; do
    printf '  %-9s SET %10s/s  GET %10s/s\n' "$name" "$(echo "${sets[$name]}" | median)" "$(echo "${gets[$name]}" | median)"
done
printf '  the NBD export alone (qemu-img bench, one at a time): write %s/s  read %s/s\n' \
    "$(echo "${sets[target]}" | median)" "$(echo "${gets[target]}" | median)"
