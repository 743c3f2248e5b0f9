# Helpers the bench scripts source (`. bench/common.sh` from the project root).

# A TCP port free on 127.0.0.1 now.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

# Waits up to SECONDS (default 10) for something to listen on 127.0.0.1:PORT; fails the
# script otherwise.
wait_port() {
    for _ in $(seq $((${2:-10} * 10))); do
        (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return
        sleep 0.1
    done
    echo "nothing on $1" >&2
    exit 1
}

# Fails the script unless each TOOL is installed; FROM names the packages they come in.
# Usage: need FROM TOOL…
need() {
    local from=$1 t
    shift
    for t in "$@"; do
        command -v "$t" >/dev/null || { echo "$t not found ($from)" >&2; exit 1; }
    done
}

# A scratch directory in /dev/shm named for NAME, into `dir`: removed, and the processes
# of `pids` killed, when the script exits (see `stop_all`).
shm_scratch() {
    dir=$(mktemp -d "/dev/shm/dpuflow-$1.XXXXXX")
    trap stop_all EXIT
}

# The median of the numbers read (any whitespace between them); the lower of the two
# middle ones for an even count.
median() { tr -s ' \t' '\n' | grep . | sort -g | awk '{v[NR] = $1} END {print v[int((NR + 1) / 2)]}'; }

# The build to run, into `bin`: DPUFLOW=BIN (another build, to compare two), or this
# tree's release build.
dpuflow_bin() {
    if [ -n "${DPUFLOW:-}" ]; then
        bin=$(realpath "$DPUFLOW")
    else
        cargo build --release -q
        bin=$PWD/target/release/dpuflow
    fi
}

# Zeroes the superblock of the KV-cache store on disk image FILE, so the next service
# starts empty rather than with the index the last one saved (which a build of another
# index format would not read: builds compared would start unequal).
empty_store() { dd if=/dev/zero of="$1" bs=65536 count=1 conv=notrunc status=none; }

# The builds to compare: BUILDS ("BIN …"), or this tree's release build; into `builds`.
builds_to_run() {
    if [ -z "${BUILDS:-}" ]; then
        cargo build --release -q
        BUILDS=$PWD/target/release/dpuflow
    fi
    read -r -a builds <<<"$BUILDS"
}

# qemu-nbd exporting IMAGE (raw) as `kv` on a free port of 127.0.0.1, to up to 64
# clients, until the script exits; its port into `nbd_port`.
start_nbd() {
    nbd_port=$(free_port)
    qemu-nbd -f raw -x kv -b 127.0.0.1 -p "$nbd_port" --persistent --shared=64 "$1" >/dev/null 2>&1 &
    pids+=($!)
    wait_port "$nbd_port"
}

# Processes a script starts in the background (`pids+=($!)`) are killed when it exits
# (`trap stop_all EXIT`), and its scratch directory `$dir` removed.
pids=()
stop_all() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "${dir:?}"
}

# Network namespaces C, D and S for live ports: C's c0 linked to D's in0 and S's s0 to
# D's out0 (veth pairs, up, with segmentation and receive offloads off), D's loopback up.
# Further arguments go to both `ip link add` (queue counts).
# Usage: live_namespaces C D S [ARG…]
live_namespaces() {
    local c=$1 d=$2 s=$3 x ns dev n
    shift 3
    for n in "$c" "$d" "$s"; do ip netns add "$n"; done
    ip link add c0 netns "$c" "$@" type veth peer name in0 netns "$d" "$@"
    ip link add s0 netns "$s" "$@" type veth peer name out0 netns "$d" "$@"
    for x in "$c c0" "$d in0" "$d out0" "$s s0"; do
        read -r ns dev <<<"$x"
        ip -n "$ns" link set "$dev" up
        ip netns exec "$ns" ethtool -K "$dev" tso off gso off gro off >/dev/null 2>&1
    done
    ip -n "$d" link set lo up
}

# The pipeline of a stateful firewall between the live ports in0 (inside) and out0
# (outside) of `live_namespaces`, on DRIVER: every flow from inside committed to
# connection tracking, only tracked ones (and ARP) let in from outside.
# Usage: live_firewall DRIVER >FILE
live_firewall() {
    cat <<EOF
pipeline firewall
port inside  { driver $1  iface "in0" }
port outside { driver $1  iface "out0" }
conntrack { capacity 100000 }
pipe in  root from inside  {
    rule arp { match eth.type 0x0806  actions fwd outside }
    default { actions ct.commit, fwd outside }
}
pipe out root from outside {
    rule arp     { match eth.type 0x0806  actions fwd inside }
    rule tracked { match ct.state {established, related}  actions fwd inside }
    default { actions drop }
}
EOF
}

# A KV-cache service of build BIN with room for KEYS small values (512-byte blocks, no
# checkpoints) on a fresh sparse file in `dir`, listening on a free port of 127.0.0.1;
# its port into `port`, its process into `pid` (and `pids`). For the scripts that time
# requests against the index, with python3-redis as the client.
start_kv_index() {
    /usr/bin/python3 -c 'import redis' 2>/dev/null ||
        { echo "python3-redis not found: apt-get install python3-redis" >&2; exit 1; }
    port=$(free_port)
    rm -f "$dir/blocks.img"
    cat >"$dir/kv.pipe" <<PIPE
pipeline kv_index
service kvcache { listen 127.0.0.1:$port  target "file://$dir/blocks.img"  capacity $(($2 / 128 + 64))MiB  block_size 512  checkpoint off }
PIPE
    "$1" run "$dir/kv.pipe" --metrics 127.0.0.1:0 >/dev/null 2>&1 &
    pid=$!
    pids+=("$pid")
    wait_port "$port" 30
}
