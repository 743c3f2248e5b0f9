#!/usr/bin/env bash
# dpuflow against Open vSwitch's userspace datapath (OVS-DPDK), the same work on one core:
# forwarding between two ports, and the VXLAN gateway's two directions (pipelines/
# vxlan-gateway.pipe: IPv4 to 10.1.0.0/16 from the host encapsulated in VNI 100 towards
# 192.0.2.10; VNI 100 to 192.0.2.1 from the fabric decapsulated), and every packet through
# connection tracking (bench/conntrack.pipe; OVS's `ct(commit)`). OVS
# reads the traffic dpuflow synthesises (4096 flows, 64-byte frames) from a capture its
# pcap driver replays from memory and sends to null ports (which receive nothing); its rate
# is the packets its forwarding thread received over the window, read from
# `dpif-netdev/pmd-stats-show`.
# Rounds alternate the two, pinned to the same core; OVS is stopped while dpuflow runs.
# Needs root (hugepages, a network namespace for OVS's tunnel bridge),
# openvswitch-switch-dpdk and dpdk-testpmd (dpdk-dev). Usage: bench/vs-ovs.sh [ROUNDS] [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
rounds=${1:-5}
seconds=${2:-10}
vswitchd=/usr/lib/openvswitch-switch-dpdk/ovs-vswitchd-dpdk
[ -x "$vswitchd" ] || { echo "$vswitchd not found: apt-get install openvswitch-switch-dpdk" >&2; exit 1; }
cargo build --release -q
bin=$PWD/target/release/dpuflow
core=1

dir=$(mktemp -d)
ns=dpuflow-ovs-$$
export OVS_RUNDIR=$dir OVS_DBDIR=$dir OVS_LOGDIR=$dir OVS_SYSCONFDIR=$dir
vsctl() { ovs-vsctl --db="unix:$dir/db.sock" --timeout=30 "$@"; }
appctl() { ovs-appctl -t "$dir/ovs-vswitchd-dpdk.$(cat "$dir/vswitchd.pid").ctl" "$@"; }
stop_ovs() {
    local pid
    for p in vswitchd ovsdb-server; do
        [ -f "$dir/$p.pid" ] || continue
        pid=$(cat "$dir/$p.pid")
        kill -CONT "$pid" 2>/dev/null || true
        kill "$pid" 2>/dev/null || true
        rm -f "$dir/$p.pid"
    done
    sleep 1
}
hugepages=$(cat /proc/sys/vm/nr_hugepages)
cleanup() {
    stop_ovs
    ip netns del "$ns" 2>/dev/null || true
    rm -rf "$dir"
    echo "$hugepages" >/proc/sys/vm/nr_hugepages
}
trap cleanup EXIT

# OVS-DPDK and dpdk-testpmd take their packet memory from hugepages: 1 GiB and 512 MiB of
# 2 MiB pages, given back at exit.
if [ "$(awk '/HugePages_Free/ {print $2}' /proc/meminfo)" -lt 768 ]; then
    echo $((hugepages + 768)) >/proc/sys/vm/nr_hugepages
fi
mountpoint -q /dev/hugepages || { mkdir -p /dev/hugepages; mount -t hugetlbfs nodev /dev/hugepages; }
ip netns add "$ns"

for port in host uplink; do
    "$bin" bench pipelines/vxlan-gateway.pipe --port $port --flows 4096 --packets 8192 \
        --write "$dir/$port.pcap" >/dev/null
done
"$bin" bench bench/conntrack.pipe --port a --flows 4096 --packets 8192 --write "$dir/ct.pcap" >/dev/null

ovsdb-tool create "$dir/conf.db" /usr/share/openvswitch/vswitch.ovsschema
ovsdb-server "$dir/conf.db" --remote="punix:$dir/db.sock" --pidfile="$dir/ovsdb-server.pid" \
    --detach --log-file="$dir/ovsdb.log" -vconsole:off
vsctl --no-wait init
vsctl --no-wait set Open_vSwitch . other_config:dpdk-init=true other_config:dpdk-extra=--no-pci \
    other_config:dpdk-socket-mem=1024 other_config:dpdk-lcore-mask=0x1 \
    other_config:pmd-cpu-mask=$((1 << core))
ip netns exec "$ns" "$vswitchd" "unix:$dir/db.sock" --pidfile="$dir/vswitchd.pid" --detach \
    --log-file="$dir/vswitchd.log" -vconsole:off

# br-int: the host port, an output port, the VXLAN port. br-phy: the VXLAN port's underlay,
# its address the tunnel's source and its MAC the one the fabric's frames are sent to; its
# uplink, which only sends (a flow sends tunnelled packets straight to it). Each case adds
# the port its traffic comes in by, a capture replayed: `host`, or `fabric` on br-phy.
vsctl add-br br-int -- set bridge br-int datapath_type=netdev \
    -- add-port br-int out -- set Interface out type=dpdk options:dpdk-devargs=net_null0,no-rx=1 \
    -- add-port br-int vx0 -- set Interface vx0 type=vxlan options:remote_ip=192.0.2.10 \
       options:local_ip=192.0.2.1 options:key=100 \
    -- add-br br-phy -- set bridge br-phy datapath_type=netdev other_config:hwaddr=02:00:00:00:00:20 \
    -- add-port br-phy uplink -- set Interface uplink type=dpdk options:dpdk-devargs=net_null1,no-rx=1
ip netns exec "$ns" ip addr add 192.0.2.1/24 dev br-phy
ip netns exec "$ns" ip link set br-phy up
ip netns exec "$ns" ip link set lo up
appctl tnl/arp/set br-phy 192.0.2.10 02:00:00:00:00:02 >/dev/null

# The ports and OpenFlow rules of each case.
set_case() {
    vsctl -- --if-exists del-port host -- --if-exists del-port fabric -- clear Bridge br-int ipfix
    ovs-ofctl del-flows br-int
    ovs-ofctl del-flows br-phy
    ovs-ofctl add-flow br-phy "in_port=LOCAL,actions=output:uplink"
    case $1 in
        forward | vxlan-encap | vxlan-encap+ipfix | conntrack)
            local capture=host
            if [ "$1" = conntrack ]; then capture=ct; fi
            vsctl add-port br-int host -- set Interface host type=dpdk \
                "options:dpdk-devargs=net_pcap0,rx_pcap=$dir/$capture.pcap,infinite_rx=1" ;;
        vxlan-decap)
            # The synthetic fabric traffic comes from 10.0.0.1.
            vsctl set Interface vx0 options:remote_ip=10.0.0.1 \
                -- add-port br-phy fabric -- set Interface fabric type=dpdk \
                "options:dpdk-devargs=net_pcap1,rx_pcap=$dir/uplink.pcap,infinite_rx=1" ;;
    esac
    case $1 in
        forward) ovs-ofctl add-flow br-int "in_port=host,actions=output:out" ;;
        vxlan-encap)
            ovs-ofctl add-flow br-int "priority=10,in_port=host,ip,nw_dst=10.1.0.0/16,actions=output:vx0" ;;
        vxlan-encap+ipfix)
            # Flow records of every packet (OVS's per-bridge IPFIX, sampling 1 in 1) to a
            # collector address in the namespace, as `dpuflow bench --telemetry` keeps them.
            vsctl -- set Bridge br-int ipfix=@i -- --id=@i create IPFIX targets=\"127.0.0.1:4739\" \
                sampling=1 obs_domain_id=1 cache_active_timeout=60 cache_max_flows=65536 >/dev/null
            ovs-ofctl add-flow br-int "priority=10,in_port=host,ip,nw_dst=10.1.0.0/16,actions=output:vx0" ;;
        vxlan-decap)
            # Sent to br-phy's own port, VXLAN to its address leaves the tunnel (OVS's
            # userspace tunnel termination) and comes into br-int by vx0 with its VNI.
            ovs-ofctl add-flow br-phy "priority=10,in_port=fabric,actions=LOCAL"
            ovs-ofctl add-flow br-int "priority=10,in_port=vx0,actions=output:out" ;;
        # Every packet committed to OVS's userspace connection tracker, then forwarded.
        conntrack) ovs-ofctl add-flow br-int "priority=10,in_port=host,ip,actions=ct(commit),output:out" ;;
    esac
    ovs-ofctl add-flow br-int "priority=0,actions=drop"
    ovs-ofctl add-flow br-phy "priority=0,actions=drop"
}

# Packets OVS's forwarding thread received in `seconds`, as Mpps.
ovs_rate() {
    kill -CONT "$(cat "$dir/vswitchd.pid")"
    sleep 2
    appctl dpif-netdev/pmd-stats-clear >/dev/null
    local t0 t1 n
    t0=$(date +%s.%N)
    sleep "$seconds"
    n=$(appctl dpif-netdev/pmd-stats-show | awk '/core_id '"$core"':/ {p = 1} p && /packets received/ {print $3; exit}')
    t1=$(date +%s.%N)
    kill -STOP "$(cat "$dir/vswitchd.pid")"
    awk -v n="$n" -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", n / (b - a) / 1e6}'
}

dpuflow_rate() {
    # shellcheck disable=SC2086 # the flags are words
    taskset -c "$core" "$bin" bench "$1" --port "$2" --size 64 --flows 4096 \
        --packets $((seconds * 20000000)) $3 | sed -n 's/.*: \([0-9.]*\) Mpps.*/\1/p'
}

sleep 3
kill -STOP "$(cat "$dir/vswitchd.pid")"

# The floor under OVS's figures: dpdk-testpmd moving the same capture to a null port with
# the same drivers on the same core, no datapath between.
if command -v dpdk-testpmd >/dev/null; then
    timeout -s INT "$((seconds + 5))" dpdk-testpmd -l "0,$core" --no-pci -m 512 --file-prefix="dpuflow-testpmd-$$" \
        --vdev "net_pcap0,rx_pcap=$dir/host.pcap,infinite_rx=1" --vdev net_null0,no-rx=1 -- \
        --forward-mode=io --total-num-mbufs=32768 --stats-period 1 >"$dir/testpmd.log" 2>&1 || true
    printf 'drivers alone (dpdk-testpmd io, capture to null): %s Mpps\n' \
        "$(awk '/Rx-pps:/ && $2 > 0 {r = $2} END {printf "%.2f", r / 1e6}' "$dir/testpmd.log")"
fi
printf '%-17s %5s %12s %12s %7s\n' case round "OVS (Mpps)" "dpuflow" "ratio"
for c in "forward bench/forward.pipe a" "vxlan-encap pipelines/vxlan-gateway.pipe host" \
         "vxlan-decap pipelines/vxlan-gateway.pipe uplink" "conntrack bench/conntrack.pipe a" \
         "vxlan-encap+ipfix pipelines/vxlan-gateway.pipe host --telemetry"; do
    read -r name pipe port flags <<<"$c"
    kill -CONT "$(cat "$dir/vswitchd.pid")"
    set_case "$name"
    kill -STOP "$(cat "$dir/vswitchd.pid")"
    ratios=()
    for r in $(seq "$rounds"); do
        o=$(ovs_rate)
        d=$(dpuflow_rate "$pipe" "$port" "$flags")
        ratio=$(awk -v a="$d" -v b="$o" 'BEGIN {printf "%.2f", a / b}')
        ratios+=("$ratio")
        printf '%-17s %5s %12s %12s %7s\n' "$name" "$r" "$o" "$d" "$ratio"
    done
    printf '%-17s median ratio dpuflow / OVS: %s\n' "$name" \
        "$(printf '%s\n' "${ratios[@]}" | sort -n | awk '{a[NR] = $1} END {print a[int((NR + 1) / 2)]}')"
    # What OVS's datapath did with the case's packets (the tunnel header it pushed).
    kill -CONT "$(cat "$dir/vswitchd.pid")"
    appctl dpctl/dump-flows | awk -F'packets:' 'NF > 1 {split($2, n, ","); if (n[1] + 0 > max) {max = n[1] + 0; line = $0}} END {print line}' |
        grep -o 'actions:.*' | sed 's/^/  the busiest OVS datapath flow: /'

    kill -STOP "$(cat "$dir/vswitchd.pid")"
done
