//! Rewriting actions on real frames: every output is checked by tshark (checksums
//! included, so the incremental updates are verified independently) and field by field.

mod common;
use common::*;

fn replay(dir: &Scratch) -> serde_json::Value {
    let out = dpuflow_ok(&[
        "replay",
        "tests/data/actions.pipe",
        "--in",
        &format!("in={}", dir.path("in.pcap")),
        "--out",
        &format!("out={}", dir.path("out.pcap")),
        "--out",
        &format!("copies={}", dir.path("copies.pcap")),
        "--json",
    ]);
    serde_json::from_str(&out).expect("JSON")
}

/// Replays the dir's in.pcap through `pipeline` (ports `in`, `out`); the output's path.
fn replay_through(dir: &Scratch, pipeline: &str) -> String {
    let out = dir.path("out.pcap");
    dpuflow_ok(&[
        "replay",
        pipeline,
        "--in",
        &format!("in={}", dir.path("in.pcap")),
        "--out",
        &format!("out={out}"),
    ]);
    out
}

/// Replays the dir's host.pcap (where there is one) and uplink.pcap through `pipeline`
/// (ports `host`, `uplink`), each port's output written to its own capture, which
/// tshark must read clean: the replay's JSON summary and the captures' paths.
fn replay_both_ports(dir: &Scratch, pipeline: &str) -> (serde_json::Value, String, String) {
    let (to_host, to_uplink) = (dir.path("to-host.pcap"), dir.path("to-uplink.pcap"));
    let mut args = vec!["replay".to_owned(), pipeline.to_owned()];
    for port in ["host", "uplink"] {
        let input = dir.path(&format!("{port}.pcap"));
        if std::path::Path::new(&input).exists() {
            args.extend(["--in".to_owned(), format!("{port}={input}")]);
        }
    }
    args.extend(["--out".to_owned(), format!("host={to_host}")]);
    args.extend([
        "--out".to_owned(),
        format!("uplink={to_uplink}"),
        "--json".to_owned(),
    ]);
    let out = dpuflow_ok(&args.iter().map(String::as_str).collect::<Vec<_>>());
    for path in [&to_host, &to_uplink] {
        assert_tshark_clean(path);
    }
    (
        serde_json::from_str(&out).expect("JSON"),
        to_host,
        to_uplink,
    )
}

#[test]
fn rewrites_keep_checksums_valid() {
    let dir = Scratch::new("actions");
    scapy(
        &dir.0,
        r#"
E = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
pkts = [
    E/IP(src="10.0.0.1", dst="10.9.1.1", ttl=20, tos=0x01)/UDP(sport=999, dport=7000)/Raw(b"a" * 30),
    E/IP(src="10.0.0.1", dst="10.0.0.2")/TCP(sport=5555, dport=7001, flags="PA", seq=1, ack=1)/Raw(b"b" * 30),
    E/IPv6(src="2001:db8::1", dst="2001:db8::2", hlim=9)/UDP(sport=999, dport=7002)/Raw(b"c" * 30),
    E/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=999, dport=7003)/Raw(b"d" * 30),
    E/Dot1Q(vlan=10, prio=3)/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=999, dport=5000)/Raw(b"e" * 30),
    E/Dot1Q(vlan=30)/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=999, dport=5000)/Raw(b"f" * 30),
    E/IP(src="10.0.0.1", dst="10.9.1.1", ttl=1)/UDP(sport=999, dport=7000)/Raw(b"g" * 30),
]
for i, p in enumerate(pkts):
    p.time = 100 + i
wrpcap("in.pcap", pkts)
"#,
    );
    let s = replay(&dir);
    assert_eq!(s["ports"][1]["tx_packets"], 6, "{s}");
    assert_eq!(s["ports"][0]["drops"]["ttl_expired"], 1, "{s}");
    assert_tshark_clean(&dir.path("out.pcap"));
    let rows = tshark_fields(
        &dir.path("out.pcap"),
        &[
            "eth.src",
            "vlan.id",
            "vlan.priority",
            "ip.src",
            "ip.dst",
            "ip.ttl",
            "ip.dsfield.dscp",
            "ipv6.src",
            "ipv6.hlim",
            "udp.srcport",
            "udp.dstport",
            "tcp.dstport",
        ],
    );
    assert_eq!(
        rows,
        [
            "02:00:00:00:00:77,,,172.16.0.1,10.9.1.1,19,46,,,1234,7000,",
            "02:00:00:00:00:aa,,,10.0.0.1,172.16.0.9,64,0,,,,,8001",
            "02:00:00:00:00:aa,,,,,,,2001:db8::99,8,999,9002,",
            "02:00:00:00:00:aa,42,5,10.0.0.1,10.0.0.2,64,0,,,999,7003,",
            "02:00:00:00:00:aa,20,3,10.0.0.1,10.0.0.2,64,0,,,999,5000,",
            "02:00:00:00:00:aa,,,10.0.0.1,10.0.0.2,64,0,,,999,5000,",
        ]
    );
}

#[test]
fn meters_police_by_capture_time() {
    let dir = Scratch::new("meter");
    // 2 pps with a burst of 2 and an excess burst of 1: of 6 packets in one instant,
    // 2 green, 1 yellow, 3 red; one second later 2 more tokens.
    scapy(
        &dir.0,
        r#"
pkts = []
for i in range(6):
    p = Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=1, dport=7004); p.time = 200.0; pkts.append(p)
for i in range(3):
    p = Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=1, dport=7004); p.time = 201.0; pkts.append(p)
wrpcap("in.pcap", pkts)
"#,
    );
    let s = replay(&dir);
    assert_eq!(s["ports"][1]["tx_packets"], 5, "{s}");
    assert_eq!(s["ports"][0]["drops"]["meter_red"], 4, "{s}");
}

#[test]
fn mirror_copies_and_marks_carry_across_pipes() {
    let dir = Scratch::new("mirror");
    scapy(
        &dir.0,
        r#"wrpcap("in.pcap", [Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=1, dport=7005)/Raw(b"m" * 20)] * 3)"#,
    );
    let s = replay(&dir);
    assert_eq!(
        s["ports"][1]["tx_packets"], 3,
        "marked packets reach `out` through pipe `marked`: {s}"
    );
    assert_eq!(s["ports"][2]["tx_packets"], 3, "{s}");
    assert_eq!(
        frames(&dir.path("copies.pcap")),
        frames(&dir.path("in.pcap"))
    );
    assert_tshark_clean(&dir.path("copies.pcap"));
    assert_tshark_clean(&dir.path("out.pcap"));
}

#[test]
fn oversized_packets_are_dropped_at_the_port_mtu() {
    let dir = Scratch::new("mtu");
    scapy(
        &dir.0,
        r#"wrpcap("in.pcap", [Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=1, dport=7003)/Raw(b"x" * n) for n in (1372, 1373)])"#,
    );
    // 20 + 8 + 1372 = 1400 bytes of IP fits the MTU of 1400; one byte more does not.
    let s = replay(&dir);
    assert_eq!(s["ports"][1]["tx_packets"], 1, "{s}");
    assert_eq!(s["ports"][0]["drops"]["mtu_exceeded"], 1, "{s}");
    assert_tshark_clean(&dir.path("out.pcap"));
}

#[test]
fn pipeline_capture_files_are_used_when_not_bound() {
    let dir = Scratch::new("pcap-driver");
    scapy(
        &dir.0,
        r#"wrpcap("in.pcap", [Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=1, dport=7003)])"#,
    );
    let pipe = dir.path("p.pipe");
    std::fs::write(
        &pipe,
        format!(
            "pipeline p\nport a {{ driver pcap  file \"{}\" }}\nport b {{ driver pcap  out \"{}\" }}\npipe x root from a {{ default {{ actions fwd b }} }}\n",
            dir.path("in.pcap"),
            dir.path("out.pcap")
        ),
    )
    .expect("write");
    dpuflow_ok(&["replay", &pipe]);
    assert_eq!(frames(&dir.path("out.pcap")), frames(&dir.path("in.pcap")));
    assert_tshark_clean(&dir.path("out.pcap"));
}

/// Rewriting an inner field of a tunnelled packet keeps every checksum valid: the inner
/// ones, and the outer UDP checksum, which covers the inner frame (it was left stale, and
/// receivers that check it dropped the packet). A zero outer checksum (none) stays zero.
#[test]
fn inner_rewrites_keep_the_outer_checksum_valid() {
    let dir = Scratch::new("inner-rewrite");
    scapy(
        &dir.0,
        r#"
inner = Ether()/IP(src="10.1.0.5", dst="10.0.0.1")/UDP(sport=33000, dport=33000)/Raw(b"req")
tun = UDP(sport=50000, dport=4789)/VXLAN(vni=100, flags=0x08)/inner
pkts = [
    Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/tun,
    Ether()/IPv6(src="2001:db8::10", dst="2001:db8::1")/tun,
    Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789, chksum=0)/VXLAN(vni=100, flags=0x08)/inner,
]
for i, p in enumerate(pkts):
    p.time = 100 + i
wrpcap("in.pcap", pkts)
"#,
    );
    let out = replay_through(&dir, "tests/data/inner-rewrite.pipe");
    assert_tshark_clean(&out);
    let rows = tshark_fields(&out, &["ip.dst", "udp.dstport", "udp.checksum"]);
    assert_eq!(rows.len(), 3, "{rows:?}");
    for row in &rows {
        assert!(
            row.contains("10.9.9.9") && row.contains("4789,33001"),
            "{row}"
        );
    }
    assert!(rows[2].contains(",0x0000,"), "{}", rows[2]);
}

/// An address rewrite on a fragmented datagram patches the L4 checksum its first
/// fragment carries (it covers the addresses of the whole datagram): tshark reassembles
/// each datagram, UDP and TCP over IPv4 and UDP over IPv6, and finds its checksum good.
#[test]
fn address_rewrites_keep_fragmented_datagrams_checksums_valid() {
    let dir = Scratch::new("fragment-rewrite");
    scapy(
        &dir.0,
        r#"
pkts = fragment(Ether()/IP(src="10.0.0.1", dst="10.0.0.2", id=7)/UDP(sport=1000, dport=2000)/(b"u" * 3000), fragsize=1200)
pkts += fragment(Ether()/IP(src="10.0.0.1", dst="10.0.0.2", id=8)/TCP(sport=1000, dport=2000, flags="PA")/(b"t" * 3000), fragsize=1200)
pkts += [Ether()/p for p in fragment6(IPv6(src="2001:db8::1", dst="2001:db8::2")/IPv6ExtHdrFragment(id=9)/UDP(sport=1000, dport=2000)/(b"v" * 3000), 1280)]
for i, p in enumerate(pkts):
    p.time = 100 + i
wrpcap("in.pcap", pkts)
"#,
    );
    let out = replay_through(&dir, "tests/data/fragment-rewrite.pipe");
    assert_eq!(frames(&out).len(), 9, "three datagrams of three fragments");
    let fields = tshark_table(
        &out,
        &[
            "-o",
            "udp.check_checksum:TRUE",
            "-o",
            "tcp.check_checksum:TRUE",
            "-Y",
            "udp || tcp",
        ],
        ';',
        &[
            "ip.dst",
            "ipv6.dst",
            "udp.checksum.status",
            "tcp.checksum.status",
        ],
    );
    // Checksum status 1: good (0: bad), on each reassembled datagram.
    let rows: Vec<&str> = fields.lines().collect();
    assert_eq!(
        rows,
        ["10.0.0.99;;1;", "10.0.0.99;;;1", ";2001:db8::99;1;"],
        "{fields}"
    );
}

/// A datagram's first fragment is matched by its ports, as iptables matches it: a pipe
/// that denies by port drops the first fragments of datagrams to those ports (their later
/// fragments, with no ports, go by the default) and forwards the rest whole.
#[test]
fn first_fragments_are_matched_by_their_ports() {
    let dir = Scratch::new("port-deny");
    scapy(
        &dir.0,
        r#"
E = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
pkts = fragment(E/IP(src="10.0.0.1", dst="10.0.0.2", id=1)/UDP(sport=1000, dport=9999)/(b"u" * 3000), fragsize=1200)
pkts += fragment(E/IP(src="10.0.0.1", dst="10.0.0.2", id=2)/UDP(sport=1000, dport=53)/(b"d" * 3000), fragsize=1200)
pkts += fragment(E/IP(src="10.0.0.1", dst="10.0.0.2", id=3)/TCP(sport=1000, dport=23, flags="PA")/(b"t" * 3000), fragsize=1200)
pkts += [E/IP(src="10.0.0.1", dst="10.0.0.2")/UDP(sport=1000, dport=9999)/b"whole"]
pkts += fragment6(IPv6(src="2001:db8::1", dst="2001:db8::2")/IPv6ExtHdrFragment(id=4)/UDP(sport=1000, dport=9999)/(b"v" * 3000), 1280)
pkts = [p if p.haslayer(Ether) else E/p for p in pkts]
for i, p in enumerate(pkts):
    p.time = 100 + i
wrpcap("in.pcap", pkts)
"#,
    );
    let out = frames(&replay_through(&dir, "tests/data/port-deny.pipe"));
    // Each forwarded frame: (IP identification, first fragment or whole packet).
    let kept: Vec<(u32, bool)> = out
        .iter()
        .map(|f| match f[12..14] {
            [0x08, 0x00] => (
                u32::from(u16::from_be_bytes([f[18], f[19]])),
                f[20..22] == [0x20, 0] || f[20..22] == [0, 0],
            ),
            _ => (
                u32::from_be_bytes(f[58..62].try_into().expect("fragment header")),
                f[56..58] == [0, 1],
            ),
        })
        .collect();
    assert_eq!(
        kept,
        [
            (1, false),
            (1, false),
            (2, true),
            (2, false),
            (2, false),
            (3, false),
            (3, false),
            (4, false),
            (4, false)
        ],
        "the first fragments to UDP 9999 and TCP 23 and the whole packet to UDP 9999 dropped"
    );
}

/// An IPv6 address rewrite on ICMPv6 patches its checksum (it covers the IPv6
/// pseudo-header), an SCTP port rewrite recomputes the packet's CRC32c, and address and
/// port rewrites on UDP-Lite patch its checksum (over the pseudo-header, of protocol 136,
/// and the bytes its coverage names: RFC 3828 §3.1): all were left stale. tshark
/// validates them (SCTP's CRC32c and UDP-Lite's checksum when asked).
#[test]
fn icmpv6_and_sctp_rewrites_keep_their_checksums_valid() {
    let dir = Scratch::new("pseudo-header-rewrite");
    scapy(
        &dir.0,
        r#"
pkts = [
    Ether()/IPv6(src="2001:db8::1", dst="2001:db8::2")/ICMPv6EchoRequest(id=7, seq=1, data=b"ping"),
    Ether()/IP(src="10.0.0.1", dst="10.0.0.2")/SCTP(sport=1000, dport=2000)/SCTPChunkData(data=b"chunk"),
    Ether()/IPv6(src="2001:db8::1", dst="2001:db8::2")/SCTP(sport=1000, dport=2000)/SCTPChunkData(data=b"chunk6"),
]
def udplite(v6, cov):
    import socket, struct
    src, dst = ("2001:db8::1", "2001:db8::2") if v6 else ("10.0.0.1", "10.0.0.2")
    h = struct.pack("!HHHH", 1000, 2000, cov, 0) + b"lite payload"
    if v6:
        pseudo = socket.inet_pton(socket.AF_INET6, src) + socket.inet_pton(socket.AF_INET6, dst) + struct.pack("!I3xB", len(h), 136)
        l3 = IPv6(src=src, dst=dst, nh=136)
    else:
        pseudo = socket.inet_aton(src) + socket.inet_aton(dst) + struct.pack("!xBH", 136, len(h))
        l3 = IP(src=src, dst=dst, proto=136)
    check = checksum(pseudo + h[:cov or len(h)]) or 0xffff
    return Ether()/l3/Raw(h[:6] + struct.pack("!H", check) + h[8:])
pkts += [udplite(False, 8), udplite(False, 0), udplite(True, 12)]
for i, p in enumerate(pkts):
    p.time = 100 + i
wrpcap("in.pcap", pkts)
"#,
    );
    let out = replay_through(&dir, "tests/data/pseudo-header-rewrite.pipe");
    let fields = tshark_table(
        &out,
        &[
            "-o",
            "sctp.checksum:CRC-32C",
            "-o",
            "udplite.check_checksum:TRUE",
        ],
        ';',
        &[
            "icmpv6.checksum.status",
            "sctp.checksum.status",
            "udp.checksum.status",
            "ip.dst",
            "ipv6.dst",
            "sctp.dstport",
            "udp.srcport",
            "udp.dstport",
        ],
    );
    // Checksum status 1: good.
    let rows: Vec<&str> = fields.lines().collect();
    assert_eq!(
        rows,
        [
            "1;;;;2001:db8::99;;;",
            ";1;;10.0.0.2;;9999;;",
            ";1;;;2001:db8::2;9999;;",
            ";;1;10.0.0.99;;;1000;9999",
            ";;1;10.0.0.99;;;1000;9999",
            ";;1;;2001:db8::99;;7777;2000",
        ],
        "{fields}"
    );
}

/// A gateway's host port with frames that fill its 1500-byte MTU: once encapsulated
/// they no longer fit the uplink's, and each sender that can be told is answered with the
/// MTU inside the tunnel (RFC 1191, RFC 8201), out of the port it sent from, its VLAN tag
/// kept; tshark reads the answers as the quoting ICMP errors they are.
#[test]
fn senders_of_packets_too_big_for_the_tunnel_are_told_its_mtu() {
    let dir = Scratch::new("too-big");
    let pipe = dir.path("gateway.pipe");
    std::fs::write(
        &pipe,
        "pipeline gateway\n\
         port host   { driver pcap }\n\
         port uplink { driver pcap }\n\
         pipe from_host root from host {\n\
             rule v4 { match ipv4.dst 10.1.0.0/16  actions vxlan.encap { vni 100  src 192.0.2.1  dst 192.0.2.10\n\
                       smac 02:00:00:00:00:01  dmac 02:00:00:00:00:02 }, fwd uplink }\n\
             rule v6 { match ipv6.dst 2001:db8:1::/48  actions vxlan.encap { vni 100  src 192.0.2.1  dst 192.0.2.10\n\
                       smac 02:00:00:00:00:01  dmac 02:00:00:00:00:02 }, fwd uplink }\n\
             default { actions drop }\n\
         }\n",
    )
    .expect("write pipeline");
    scapy(
        &dir.0,
        r#"
e = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
tcp = TCP(sport=40000, dport=80, seq=1000, flags="A")
wrpcap("in.pcap", [
    e/IP(src="10.0.0.1", dst="10.1.0.1", flags="DF")/tcp/Raw(b"a" * 1460),       # told: 1450
    e/IP(src="10.0.0.1", dst="10.1.0.1")/tcp/Raw(b"b" * 1460),                   # may be cut up: dropped
    e/IPv6(src="2001:db8::1", dst="2001:db8:1::1")/tcp/Raw(b"c" * 1440),         # told: 1450
    e/IP(src="10.0.0.1", dst="10.1.0.1", flags="DF")/tcp/Raw(b"d" * 1410),       # fits once encapsulated
    e/IP(src="10.0.0.1", dst="10.1.0.1", flags="DF")/ICMP(type=3, code=1)/Raw(b"e" * 1472),  # an error: dropped
    e/Dot1Q(vlan=7)/IP(src="10.0.0.2", dst="10.1.0.9", flags="DF")/tcp/Raw(b"f" * 1460),  # told, tagged
])
"#,
    );
    let out = dpuflow_ok(&[
        "replay",
        &pipe,
        "--in",
        &format!("host={}", dir.path("in.pcap")),
        "--out",
        &format!("host={}", dir.path("told.pcap")),
        "--out",
        &format!("uplink={}", dir.path("uplink.pcap")),
        "--json",
    ]);
    let s: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let drops = &s["ports"][0]["drops"];
    assert_eq!(drops["packet_too_big"], 3, "{s}");
    assert_eq!(drops["mtu_exceeded"], 2, "{s}");
    assert_eq!(s["ports"][1]["tx_packets"], 1, "{s}");
    assert_eq!(s["ports"][0]["tx_packets"], 3, "{s}");
    let told = dir.path("told.pcap");
    assert_tshark_clean(&told);
    let fields = [
        "eth.src",
        "eth.dst",
        "vlan.id",
        "ip.src",
        "ip.dst",
        "icmp.type",
        "icmp.code",
        "icmp.mtu",
        "icmp.checksum.status",
        "ipv6.src",
        "ipv6.dst",
        "icmpv6.type",
        "icmpv6.mtu",
        "icmpv6.checksum.status",
        "tcp.srcport",
        "frame.len",
    ];
    // The answer's own headers first, then the quoted packet's: the first of each.
    let rows = tshark_table(&told, &["-E", "occurrence=f"], ',', &fields);
    // Each answer from the address the packet was for, to its sender, quoting it: 576
    // bytes of IPv4 at most, 1280 of IPv6 (RFC 1812 §4.3.2.3, RFC 4443 §3.2). A tagged
    // frame's tag takes 4 of the tunnel's bytes too.
    assert_eq!(
        rows.lines().collect::<Vec<_>>(),
        [
            "02:00:00:00:00:bb,02:00:00:00:00:aa,,10.1.0.1,10.0.0.1,3,4,1450,1,,,,,,40000,590",
            "02:00:00:00:00:bb,02:00:00:00:00:aa,,,,,,,,2001:db8:1::1,2001:db8::1,2,1450,1,40000,1294",
            "02:00:00:00:00:bb,02:00:00:00:00:aa,7,10.1.0.9,10.0.0.2,3,4,1446,1,,,,,,40000,594",
        ],
        "{told}"
    );
}

/// `dec ttl` on a packet whose TTL runs out: its sender is sent ICMP Time Exceeded from
/// the address of the port it came in by (traceroute's answer from each hop), quoting
/// the packet as it came; not where the port has no address of its IP version, nor about
/// a packet the walk changed first, a later fragment, an ICMP error or a multicast.
#[test]
fn senders_of_packets_whose_ttl_runs_out_are_told_from_the_port_address() {
    let dir = Scratch::new("time-exceeded");
    let pipe = dir.path("router.pipe");
    std::fs::write(
        &pipe,
        "pipeline router\n\
         port host   { driver pcap  address 10.0.0.1  address 2001:db8::1 }\n\
         port uplink { driver pcap  address 192.0.2.1 }\n\
         pipe from_host root from host {\n\
             rule routed  { match ipv4.dst 198.51.100.0/24  actions count, dec ttl, fwd uplink }\n\
             rule routed6 { match ipv6.dst 2001:db8:2::/48  actions dec ttl, fwd uplink }\n\
             rule natted  { match ipv4.dst 203.0.113.0/24  actions set ipv4.dst 198.51.100.9, dec ttl, fwd uplink }\n\
             rule group   { match ipv4.dst 224.0.0.0/4  actions dec ttl, fwd uplink }\n\
             default { actions drop }\n\
         }\n\
         pipe from_uplink root from uplink {\n\
             rule back  { match ipv4.dst 10.0.0.0/8  actions dec ttl, fwd host }\n\
             rule back6 { match ipv6.dst 2001:db8::/48  actions dec ttl, fwd host }\n\
             default { actions drop }\n\
         }\n",
    )
    .expect("write pipeline");
    scapy(
        &dir.0,
        r#"
e = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
probe = UDP(sport=40000, dport=33434)/Raw(b"p" * 32)
wrpcap("host.pcap", [
    e/IP(src="10.0.0.2", dst="198.51.100.7", ttl=1)/probe,                 # told
    e/Dot1Q(vlan=7)/IP(src="10.0.0.2", dst="198.51.100.7", ttl=0)/probe,   # told, tagged
    e/IPv6(src="2001:db8::2", dst="2001:db8:2::7", hlim=1)/probe,          # told
    e/IP(src="10.0.0.2", dst="198.51.100.7", ttl=2)/probe,                 # forwarded
    e/IP(src="10.0.0.2", dst="198.51.100.7", ttl=1, frag=8)/Raw(b"q" * 40),  # a later fragment
    e/IP(src="10.0.0.2", dst="198.51.100.7", ttl=1)/ICMP(type=3, code=3)/Raw(b"r" * 28),  # an error
    e/IP(src="10.0.0.2", dst="203.0.113.7", ttl=1)/probe,                  # rewritten first
    e/IP(src="10.0.0.2", dst="239.1.1.1", ttl=1)/probe,                    # a group
])
wrpcap("uplink.pcap", [
    e/IP(src="192.0.2.9", dst="10.0.0.2", ttl=1)/probe,                    # told, from 192.0.2.1
    e/IPv6(src="2001:db8:2::9", dst="2001:db8::2", hlim=1)/probe,          # no IPv6 address: dropped
])
"#,
    );
    let (s, to_host, to_uplink) = replay_both_ports(&dir, &pipe);
    assert_eq!(s["ports"][0]["drops"]["ttl_expired"], 7, "{s}");
    assert_eq!(s["ports"][1]["drops"]["ttl_expired"], 2, "{s}");
    assert_eq!(s["ports"][0]["tx_packets"], 3, "{s}");
    assert_eq!(s["ports"][1]["tx_packets"], 2, "{s}");
    let fields = [
        "eth.src",
        "eth.dst",
        "vlan.id",
        "ip.src",
        "ip.dst",
        "ip.ttl",
        "ip.dsfield.dscp",
        "icmp.type",
        "icmp.code",
        "icmp.checksum.status",
        "ipv6.src",
        "ipv6.dst",
        "icmpv6.type",
        "icmpv6.code",
        "icmpv6.checksum.status",
        "udp.dstport",
        "frame.len",
    ];
    // The message's own headers, then the quoted packet's, as it came (TTL 1 or 0).
    let rows = |path: &str| {
        tshark_table(path, &["-o", "ip.check_checksum:TRUE"], ';', &fields)
            .lines()
            .map(String::from)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        rows(&to_host),
        [
            "02:00:00:00:00:bb;02:00:00:00:00:aa;;10.0.0.1,10.0.0.2;10.0.0.2,198.51.100.7;64,1;48,0;11;0;1;;;;;;33434;102",
            "02:00:00:00:00:bb;02:00:00:00:00:aa;7;10.0.0.1,10.0.0.2;10.0.0.2,198.51.100.7;64,0;48,0;11;0;1;;;;;;33434;106",
            "02:00:00:00:00:bb;02:00:00:00:00:aa;;;;;;;;;2001:db8::1,2001:db8::2;2001:db8::2,2001:db8:2::7;3;0;1;33434;142",
        ],
        "{to_host}"
    );
    let uplink = rows(&to_uplink);
    assert_eq!(uplink.len(), 2, "{to_uplink}");
    assert_eq!(
        uplink[1],
        "02:00:00:00:00:bb;02:00:00:00:00:aa;;192.0.2.1,192.0.2.9;192.0.2.9,10.0.0.2;64,1;48,0;11;0;1;;;;;;33434;102",
        "{to_uplink}"
    );
    assert!(uplink[0].contains(";198.51.100.7;1;"), "{to_uplink}");
}

/// The Ethernet, IP, UDP and tunnel fields of each frame of `pcap`, then `extra`, by
/// tshark with IPv4 and UDP checksums checked: a frame a line, its fields apart by `;`
/// (a field's occurrences, outer first, by `,`).
fn tunnel_rows(pcap: &str, extra: &[&str]) -> String {
    let checks = [
        "-o",
        "ip.check_checksum:TRUE",
        "-o",
        "udp.check_checksum:TRUE",
    ];
    let mut fields = vec![
        "eth.src",
        "eth.dst",
        "ip.src",
        "ip.dst",
        "ipv6.src",
        "ipv6.dst",
        "udp.srcport",
        "udp.dstport",
        "udp.checksum.status",
        "vxlan.vni",
        "geneve.vni",
        "geneve.option.length",
    ];
    fields.extend(extra);
    tshark_table(pcap, &checks, ';', &fields)
}

/// `dec ttl` after a decapsulation, and nothing else: the sender of a packet whose TTL
/// runs out is told through the tunnel it came in (the far side's traceroute names the
/// gateway): the tunnel's headers turned back (addresses swapped, the UDP ports, VNI and
/// Geneve options as they came, an IPv6 UDP checksum made anew, which tshark checks) in
/// front of Time Exceeded from the uplink's address of the inner packet's version. Not
/// where the walk also rewrote the packet, nor for a version the port has no address of.
#[test]
fn senders_in_a_tunnel_are_told_through_it() {
    let dir = Scratch::new("time-exceeded-tunnel");
    let pipe = dir.path("vtep.pipe");
    std::fs::write(
        &pipe,
        "pipeline vtep\n\
         port host   { driver pcap }\n\
         port uplink { driver pcap  address 192.0.2.1 }\n\
         pipe from_host root from host { default { actions drop } }\n\
         pipe from_uplink root from uplink {\n\
             rule vxlan  { match vxlan.vni 100  actions vxlan.decap, dec ttl, fwd host }\n\
             rule geneve { match geneve.vni 200  actions geneve.decap, count, goto routed }\n\
             rule natted { match vxlan.vni 300  actions vxlan.decap, set ipv4.dst 10.0.0.9, dec ttl, fwd host }\n\
             default { actions drop }\n\
         }\n\
         pipe routed { default { actions dec ttl, fwd host } }\n",
    )
    .expect("write pipeline");
    scapy(
        &dir.0,
        r#"
load_contrib("geneve")
o = Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")
inner = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
probe = UDP(sport=40000, dport=33434)/Raw(b"p" * 32)
v4 = inner/IP(src="10.0.0.2", dst="10.1.0.7", ttl=1)/probe
v6 = inner/IPv6(src="2001:db8::2", dst="2001:db8:1::7", hlim=1)/probe
opt = bytes([0x01, 0x02, 0x03, 0x01, 9, 9, 9, 9])  # class 0x0102, type 3, one word
wrpcap("uplink.pcap", [
    o/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789)/VXLAN(vni=100, flags=0x08)/v4,  # told
    o/IPv6(src="2001:db8:ff::10", dst="2001:db8:ff::1")/UDP(sport=50001, dport=6081)
        /GENEVE(vni=200, proto=0x6558, optionlen=2, options=opt)/v4,                                     # told
    o/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50002, dport=4789)/VXLAN(vni=100, flags=0x08)/v6,  # no IPv6 address
    o/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50003, dport=4789)/VXLAN(vni=300, flags=0x08)/v4,  # rewritten
])
"#,
    );
    let (s, _, to_uplink) = replay_both_ports(&dir, &pipe);
    assert_eq!(s["ports"][1]["drops"]["ttl_expired"], 4, "{s}");
    assert_eq!(s["ports"][1]["tx_packets"], 2, "{s}");
    let extra = [
        "ip.ttl",
        "ipv6.hlim",
        "icmp.type",
        "icmp.checksum.status",
        "frame.len",
    ];
    let rows = tunnel_rows(&to_uplink, &extra);
    // The outer headers, then the message's (from 192.0.2.1 to the inner sender, TTL 64),
    // then the quoted probe's, as it came (TTL 1). UDP checksums: none over IPv4 (3),
    // good (1) over IPv6 and the probe's.
    assert_eq!(
        rows.lines().collect::<Vec<_>>(),
        [
            "02:00:00:00:00:01,02:00:00:00:00:bb;02:00:00:00:00:02,02:00:00:00:00:aa;192.0.2.1,192.0.2.1,10.0.0.2;192.0.2.10,10.0.0.2,10.1.0.7;;;50000,40000;4789,33434;3,1;100;;;64,64,1;;11;1;152",
            "02:00:00:00:00:01,02:00:00:00:00:bb;02:00:00:00:00:02,02:00:00:00:00:aa;192.0.2.1,10.0.0.2;10.0.0.2,10.1.0.7;2001:db8:ff::1;2001:db8:ff::10;50001,40000;6081,33434;1,1;;0x0000c8;8,8;64,1;64;11;1;180",
        ],
        "{rows}"
    );
}

/// A gateway that carries packets from one tunnel into another (VNI 100 of VXLAN over
/// IPv4 into VNI 200 of Geneve with an option over IPv6, and Geneve back into VXLAN): a
/// packet the second tunnel makes too big for the uplink is answered with the MTU inside
/// that tunnel, sent back through the tunnel its sender used, headers turned back as
/// for Time Exceeded (tshark checks the IPv6 UDP checksum); not where the walk also
/// rewrote the packet.
#[test]
fn senders_across_two_tunnels_are_told_through_theirs() {
    let dir = Scratch::new("too-big-stitched");
    let pipe = dir.path("stitch.pipe");
    std::fs::write(
        &pipe,
        "pipeline stitch\n\
         port host   { driver pcap }\n\
         port uplink { driver pcap }\n\
         pipe from_host root from host { default { actions drop } }\n\
         pipe from_uplink root from uplink {\n\
             rule vxlan  { match vxlan.vni 100  actions vxlan.decap, count, goto into_geneve }\n\
             rule geneve { match geneve.vni 300  actions geneve.decap,\n\
                 vxlan.encap { vni 400  src 192.0.2.1  dst 192.0.2.40\n\
                               smac 02:00:00:00:00:01  dmac 02:00:00:00:00:04 }, fwd uplink }\n\
             rule natted { match vxlan.vni 500  actions vxlan.decap, set ipv4.dst 10.1.0.9,\n\
                 vxlan.encap { vni 600  src 2001:db8:ff::1  dst 2001:db8:ff::60\n\
                               smac 02:00:00:00:00:01  dmac 02:00:00:00:00:06 }, fwd uplink }\n\
             default { actions drop }\n\
         }\n\
         pipe into_geneve { default { actions\n\
             geneve.encap { vni 200  src 2001:db8:ff::1  dst 2001:db8:ff::20\n\
                            smac 02:00:00:00:00:01  dmac 02:00:00:00:00:20\n\
                            option 0x0102 0x03 0x09090909 }, fwd uplink } }\n",
    )
    .expect("write pipeline");
    scapy(
        &dir.0,
        r#"
load_contrib("geneve")
o = Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")
inner = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
tcp = TCP(sport=40000, dport=80, seq=1000, flags="A")
v4 = inner/IP(src="10.0.0.2", dst="10.1.0.7", flags="DF")/tcp/Raw(b"a" * 1410)  # 1450 bytes of IP
v6 = inner/IPv6(src="2001:db8::2", dst="2001:db8:1::7")/tcp/Raw(b"b" * 1400)    # 1460
opt = bytes([0x01, 0x02, 0x03, 0x01, 7, 7, 7, 7])
wrpcap("uplink.pcap", [
    o/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789)/VXLAN(vni=100, flags=0x08)/v4,  # told: 1422
    o/IPv6(src="2001:db8:ff::30", dst="2001:db8:ff::1")/UDP(sport=50001, dport=6081)
        /GENEVE(vni=300, proto=0x6558, optionlen=2, options=opt)/v6,                                     # told: 1450
    o/IP(src="192.0.2.50", dst="192.0.2.1")/UDP(sport=50002, dport=4789)/VXLAN(vni=500, flags=0x08)/v4,  # rewritten
    o/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50003, dport=4789)/VXLAN(vni=100, flags=0x08)
        /inner/IP(src="10.0.0.2", dst="10.1.0.7", flags="DF")/tcp/Raw(b"c" * 1000),                      # fits
])
"#,
    );
    let (s, _, to_uplink) = replay_both_ports(&dir, &pipe);
    let drops = &s["ports"][1]["drops"];
    assert_eq!(drops["packet_too_big"], 2, "{s}");
    assert_eq!(drops["mtu_exceeded"], 1, "{s}");
    assert_eq!(s["ports"][1]["tx_packets"], 3, "{s}");
    let extra = [
        "icmp.type",
        "icmp.mtu",
        "icmpv6.type",
        "icmpv6.mtu",
        "frame.len",
    ];
    let rows = tunnel_rows(&to_uplink, &extra);
    // The outer headers turned back, then the message's (from the address the packet
    // was for, to its sender), then the quoted packet's; 576 bytes of IPv4 message at
    // most, 1280 of IPv6. Last, the packet that fit, in the Geneve tunnel.
    assert_eq!(
        rows.lines().collect::<Vec<_>>(),
        [
            "02:00:00:00:00:01,02:00:00:00:00:bb;02:00:00:00:00:02,02:00:00:00:00:aa;192.0.2.1,10.1.0.7,10.0.0.2;192.0.2.10,10.0.0.2,10.1.0.7;;;50000;4789;3;100;;;3;1422;;;640",
            "02:00:00:00:00:01,02:00:00:00:00:bb;02:00:00:00:00:02,02:00:00:00:00:aa;;;2001:db8:ff::1,2001:db8:1::7,2001:db8::2;2001:db8:ff::30,2001:db8::2,2001:db8:1::7;50001;6081;1;;0x00012c;8,8;;;2;1450;1372",
            "02:00:00:00:00:01,02:00:00:00:00:aa;02:00:00:00:00:20,02:00:00:00:00:bb;10.0.0.2;10.1.0.7;2001:db8:ff::1;2001:db8:ff::20;62216;6081;1;;0x0000c8;8,8;;;;;1132",
        ],
        "{rows}"
    );
}

/// `clamp tcp.mss` before an encapsulation: SYNs and SYN-ACKs offering more come out of
/// the tunnel offering the clamp, with right checksums (tshark checks them inside the
/// VXLAN); lower offers, and segments that are not SYNs, come out as they went in.
#[test]
fn syns_offering_more_than_the_clamp_offer_the_clamp() {
    let dir = Scratch::new("clamp");
    scapy(
        &dir.0,
        r#"
e = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
v4 = IP(src="10.0.0.1", dst="10.1.0.1")
wrpcap("in.pcap", [
    e/v4/TCP(sport=40000, dport=80, flags="S", options=[("MSS", 1460), ("SAckOK", b""), ("WScale", 7)]),
    e/v4/TCP(sport=40001, dport=80, flags="S", options=[("MSS", 1200)]),
    e/v4/TCP(sport=80, dport=40002, flags="SA", options=[("NOP", None), ("MSS", 8960)]),
    e/v4/TCP(sport=40003, dport=80, flags="A", options=[("MSS", 1460)])/Raw(b"data"),
    e/IPv6(src="2001:db8::1", dst="2001:db8:1::1")/TCP(sport=40004, dport=80, flags="S", options=[("MSS", 1440)]),
])
"#,
    );
    let out = dir.path("uplink.pcap");
    dpuflow_ok(&[
        "replay",
        "tests/data/mss-clamp.pipe",
        "--in",
        &format!("host={}", dir.path("in.pcap")),
        "--out",
        &format!("uplink={out}"),
    ]);
    assert_tshark_clean(&out);
    let rows = tshark_table(
        &out,
        &["-o", "tcp.check_checksum:TRUE"],
        ',',
        &["tcp.srcport", "tcp.options.mss_val", "tcp.checksum.status"],
    );
    assert_eq!(
        rows.lines().collect::<Vec<_>>(),
        [
            "40000,1410,1",
            "40001,1200,1",
            "80,1410,1",
            "40003,1460,1",
            "40004,1410,1"
        ]
    );
}

/// ECN and DSCP across the tunnel, read back by tshark (IPv4 header checksums validated).
/// Into it, the outer header takes the inner packet's ECN field (RFC 6040 §4.1) and the
/// DSCP the pipeline gives, fixed (26) or the inner packet's (`inherit`); out of it, the
/// inner packet takes the mark the fabric left outside as RFC 6040's Figure 4 says, and a
/// packet marked CE whose transport is not ECN-capable is dropped (`ecn_not_ect`); a
/// frame that is not IP (ARP) leaves as it is. `set ip.ecn 0` before the tunnel makes a
/// packet Not-ECT inside and out.
#[test]
fn ecn_and_dscp_cross_the_tunnel_as_rfc_6040_says() {
    let dir = Scratch::new("ecn");
    scapy(
        &dir.0,
        r#"
from scapy.contrib.geneve import GENEVE
e = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")
u = UDP(sport=1000, dport=2000)/Raw(b"x" * 20)
wrpcap("host.pcap", [
    e/IP(src="10.0.0.1", dst="10.1.0.1", tos=46 << 2 | 2)/u,        # EF, ECT(0)
    e/IP(src="10.0.0.1", dst="10.1.0.1", tos=46 << 2 | 3)/u,        # EF, CE
    e/IP(src="10.0.0.1", dst="10.1.0.1", tos=46 << 2)/u,            # EF, Not-ECT
    e/IPv6(src="2001:db8::5", dst="2001:db8:1::1", tc=26 << 2 | 1)/u,  # AF31, ECT(1)
    e/IPv6(src="2001:db8::5", dst="2001:db8:1::1", tc=46 << 2 | 2)/u,  # EF, ECT(0)
    e/IP(src="10.0.0.1", dst="10.3.0.1", tos=46 << 2 | 2)/u,        # made Not-ECT first
])
o = Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")
def vxlan(ecn, inner):
    return o/IP(src="192.0.2.10", dst="192.0.2.1", tos=ecn)/UDP(sport=50000, dport=4789)/VXLAN(vni=100, flags=0x08)/inner
def geneve(ecn, inner):
    return o/IPv6(src="2001:db8::2", dst="2001:db8::1", tc=ecn)/UDP(sport=50000, dport=6081)/GENEVE(vni=200, proto=0x6558)/inner
h = Ether(src="02:00:00:00:00:bb", dst="02:00:00:00:00:aa")
v4 = lambda ecn: h/IP(src="10.1.0.1", dst="10.0.0.1", tos=10 << 2 | ecn)/u
v6 = lambda ecn: h/IPv6(src="2001:db8:1::1", dst="2001:db8::5", tc=10 << 2 | ecn)/u
wrpcap("uplink.pcap", [
    vxlan(3, v4(2)),    # CE outside ECT(0): CE
    vxlan(3, v4(0)),    # CE outside Not-ECT: dropped
    vxlan(1, v4(2)),    # ECT(1) outside ECT(0): ECT(1)
    vxlan(2, v4(0)),    # ECT(0) outside Not-ECT: Not-ECT
    geneve(3, v6(1)),   # CE outside ECT(1), IPv6 in Geneve over IPv6: CE
    vxlan(3, h/ARP(pdst="10.0.0.1")),  # not IP: as it is
    vxlan(1, v4(3)),    # ECT(1) outside CE: CE
])
"#,
    );
    let (s, to_host, to_uplink) = replay_both_ports(&dir, "tests/data/ecn.pipe");
    assert_eq!(s["ports"][1]["drops"]["ecn_not_ect"], 1, "{s}");
    // CE outside ECT(0) and ECT(1): the ARP frame's mark has nowhere to go.
    assert_eq!(s["ports"][1]["congestion_marked"], 2, "{s}");
    let checked = ["-o", "ip.check_checksum:TRUE", "-E", "occurrence=a"];
    // Outer, then inner: the DS field (DSCP << 2 | ECN) and the IPv4 checksums' status.
    let fields = ["ip.dsfield", "ipv6.tclass", "ip.checksum.status"];
    assert_eq!(
        tshark_table(&to_uplink, &checked, ';', &fields)
            .lines()
            .collect::<Vec<_>>(),
        [
            "0x6a,0xba;;1,1",
            "0x6b,0xbb;;1,1",
            "0x68,0xb8;;1,1",
            ";0x00000069,0x00000069;",
            ";0x000000ba,0x000000ba;",
            "0x00,0xb8;;1,1",
        ]
    );
    // Over IPv6 the outer flow label is the inner flow's: one flow, one label, not 0.
    let labels = tshark_table(&to_uplink, &["-E", "occurrence=f"], ';', &["ipv6.flow"]);
    let labels: Vec<_> = labels.lines().filter(|l| !l.is_empty()).collect();
    assert!(
        labels.len() == 2 && labels[0] == labels[1] && labels[0] != "0x00000000",
        "{labels:?}"
    );
    let fields = [
        "ip.dsfield",
        "ipv6.tclass",
        "ip.checksum.status",
        "arp.opcode",
    ];
    assert_eq!(
        tshark_table(&to_host, &checked, ';', &fields)
            .lines()
            .collect::<Vec<_>>(),
        [
            "0x2b;;1;",
            "0x29;;1;",
            "0x28;;1;",
            ";0x0000002b;;",
            ";;;1",
            "0x2b;;1;",
        ]
    );
}

/// Address resolution answered by the gateway, read back by tshark (ICMPv6 checksums
/// verified): ARP requests for the overlay's addresses and for the tunnel endpoint get
/// their replies out of the port they came in by (a VLAN tag kept), neighbour
/// solicitations their advertisements (Router flag where asked, Solicited but for
/// duplicate address detection, which goes to all nodes), pings of the tunnel endpoint
/// their echo replies; an announcement, a solicitation with a hop limit below 255 (not
/// from the link) and a ping with a bad checksum are not answered.
#[test]
fn address_resolution_and_pings_are_answered_by_the_gateway() {
    let dir = Scratch::new("neighbors");
    scapy(
        &dir.0,
        r#"
e = Ether(src="02:00:00:00:00:aa", dst="ff:ff:ff:ff:ff:ff")
sn = lambda a: "ff02::1:ff" + a[-7:-5] + ":" + a[-4:]
ns = lambda src, tgt, hlim=255: Ether(src="02:00:00:00:00:aa", dst="33:33:ff:00:00:05")/IPv6(src=src, dst="ff02::1:ff00:5", hlim=hlim)/ICMPv6ND_NS(tgt=tgt)
wrpcap("host.pcap", [
    e/ARP(op=1, hwsrc="02:00:00:00:00:aa", psrc="10.0.0.5", pdst="10.1.2.3"),
    e/Dot1Q(vlan=7)/ARP(op=1, hwsrc="02:00:00:00:00:aa", psrc="10.0.0.5", pdst="10.1.0.9"),
    e/ARP(op=1, hwsrc="02:00:00:00:00:aa", psrc="10.0.0.5", pdst="10.2.0.1"),   # not ours
    e/ARP(op=1, hwsrc="02:00:00:00:00:aa", psrc="10.1.0.7", pdst="10.1.0.7"),   # announcement
    e/ARP(op=2, hwsrc="02:00:00:00:00:aa", psrc="10.0.0.5", pdst="10.1.0.7"),   # a reply
    ns("2001:db8::5", "2001:db8:1::5")/ICMPv6NDOptSrcLLAddr(lladdr="02:00:00:00:00:ab"),
    ns("2001:db8::5", "2001:db8:1::5", hlim=64),                                 # routed
    ns("::", "2001:db8:1::5"),                                                   # DAD
])
u = Ether(src="02:00:00:00:00:02", dst="ff:ff:ff:ff:ff:ff")
wrpcap("uplink.pcap", [
    u/ARP(op=1, hwsrc="02:00:00:00:00:02", psrc="192.0.2.254", pdst="192.0.2.1"),
    Ether(src="02:00:00:00:00:02", dst="33:33:ff:00:00:01")/IPv6(src="fe80::2", dst="ff02::1:ff00:1", hlim=255)/ICMPv6ND_NS(tgt="2001:db8::1")/ICMPv6NDOptSrcLLAddr(lladdr="02:00:00:00:00:02"),
    Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")/IP(src="192.0.2.254", dst="192.0.2.1", ttl=3)/ICMP(id=9, seq=1)/Raw(b"ping"),
    Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")/IPv6(src="2001:db8::fe", dst="2001:db8::1")/ICMPv6EchoRequest(id=9, seq=2, data=b"ping6"),
    Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")/IP(src="192.0.2.254", dst="192.0.2.1")/ICMP(id=9, seq=3, chksum=1)/Raw(b"bad"),
])
"#,
    );
    let (s, to_host, to_uplink) = replay_both_ports(&dir, "tests/data/neighbors.pipe");
    // The announcement and the routed solicitation; the request for an address not
    // ours and the reply match no rule that answers; the ping with a bad checksum.
    assert_eq!(s["ports"][0]["drops"]["unanswerable"], 2, "{s}");
    assert_eq!(s["ports"][0]["drops"]["rule"], 2, "{s}");
    assert_eq!(s["ports"][1]["drops"]["unanswerable"], 1, "{s}");
    let arp = [
        "eth.dst",
        "eth.src",
        "vlan.id",
        "arp.opcode",
        "arp.src.hw_mac",
        "arp.src.proto_ipv4",
        "arp.dst.hw_mac",
        "arp.dst.proto_ipv4",
    ];
    let nd = [
        "eth.dst",
        "eth.src",
        "ipv6.src",
        "ipv6.dst",
        "ipv6.hlim",
        "icmpv6.type",
        "icmpv6.checksum.status",
        "icmpv6.nd.na.flag.r",
        "icmpv6.nd.na.flag.s",
        "icmpv6.nd.na.flag.o",
        "icmpv6.nd.na.target_address",
        "icmpv6.opt.linkaddr",
    ];
    let table = |path: &str, filter: &str, fields: &[&str]| {
        tshark_table(path, &["-Y", filter], ',', fields)
            .lines()
            .map(str::to_owned)
            .collect::<Vec<_>>()
    };
    assert_eq!(
        table(&to_host, "arp", &arp),
        [
            "02:00:00:00:00:aa,02:00:00:00:00:0e,,2,02:00:00:00:00:0e,10.1.2.3,02:00:00:00:00:aa,10.0.0.5",
            "02:00:00:00:00:aa,02:00:00:00:00:0e,7,2,02:00:00:00:00:0e,10.1.0.9,02:00:00:00:00:aa,10.0.0.5",
        ]
    );
    assert_eq!(
        table(&to_host, "icmpv6.type == 136", &nd),
        [
            "02:00:00:00:00:ab,02:00:00:00:00:0e,2001:db8:1::5,2001:db8::5,255,136,1,1,1,1,2001:db8:1::5,02:00:00:00:00:0e",
            "33:33:00:00:00:01,02:00:00:00:00:0e,2001:db8:1::5,ff02::1,255,136,1,1,0,1,2001:db8:1::5,02:00:00:00:00:0e",
        ]
    );
    assert_eq!(
        table(&to_uplink, "arp", &arp),
        ["02:00:00:00:00:02,02:00:00:00:00:01,,2,02:00:00:00:00:01,192.0.2.1,02:00:00:00:00:02,192.0.2.254"]
    );
    // `trace` says what was asked, what was answered and why an announcement was not.
    let trace = dpuflow_ok(&[
        "trace",
        "tests/data/neighbors.pipe",
        "--in",
        &format!("host={}", dir.path("host.pcap")),
    ]);
    for line in [
        "packet 1: in_port host, 42 bytes: ARP who-has 10.1.2.3 tell 10.0.0.5",
        "=> forwarded to host, 42 bytes: ARP 10.1.2.3 is-at 02:00:00:00:00:0e",
        "=> dropped: unanswerable (",
    ] {
        assert!(trace.contains(line), "{line}\n{trace}");
    }
    assert_eq!(
        table(&to_uplink, "icmpv6.type == 136", &nd),
        ["02:00:00:00:00:02,02:00:00:00:00:01,2001:db8::1,fe80::2,255,136,1,0,1,1,2001:db8::1,02:00:00:00:00:01"]
    );
    // The pings' replies, checksums verified: addresses swapped, TTL 64, the request's
    // identifier, sequence number and data.
    let echo = [
        "eth.dst",
        "eth.src",
        "ip.src",
        "ip.dst",
        "ip.ttl",
        "ip.checksum.status",
        "ipv6.src",
        "ipv6.dst",
        "ipv6.hlim",
        "icmp.type",
        "icmp.checksum.status",
        "icmp.seq",
        "icmpv6.type",
        "icmpv6.checksum.status",
        "icmpv6.echo.sequence_number",
        "data.data",
    ];
    let checked = [
        "-o",
        "ip.check_checksum:TRUE",
        "-Y",
        "icmp || icmpv6.type == 129",
    ];
    assert_eq!(
        tshark_table(&to_uplink, &checked, ',', &echo)
            .lines()
            .collect::<Vec<_>>(),
        [
            "02:00:00:00:00:02,02:00:00:00:00:01,192.0.2.1,192.0.2.254,64,1,,,,0,1,1,,,,70696e67",
            "02:00:00:00:00:02,02:00:00:00:00:01,,,,,2001:db8::1,2001:db8::fe,64,,,,129,1,2,70696e6736",
        ]
    );
}

/// The far side's hosts asking, through the tunnel, for an address of the host's side are
/// answered from the gateway, back through the tunnel, rather than flooding the host
/// (EVPN's ARP suppression): `inner.arp.*` matches the request inside, and the answer is
/// made after the decapsulation and encapsulated again. Read back by tshark: the outer
/// headers towards the far tunnel endpoint, the reply inside.
#[test]
fn requests_inside_the_tunnel_are_answered_back_through_it() {
    let dir = Scratch::new("tunnelled-arp");
    let pipe = dir.path("suppress.pipe");
    std::fs::write(
        &pipe,
        "pipeline suppress\n\
         port host   { driver pcap }\n\
         port uplink { driver pcap }\n\
         pipe from_uplink root from uplink {\n\
             rule arp_for_host { match udp.dst 4789  vxlan.vni 100  inner.arp.op 1  inner.arp.tpa 10.0.0.0/24\n\
                 actions vxlan.decap, arp.reply 02:00:00:00:00:aa,\n\
                         vxlan.encap { vni 100  src 192.0.2.1  dst 192.0.2.10\n\
                                       smac 02:00:00:00:00:01  dmac 02:00:00:00:00:02 },\n\
                         fwd uplink }\n\
             rule vni100 { match udp.dst 4789  vxlan.vni 100  actions vxlan.decap, fwd host }\n\
             default { actions drop }\n\
         }\n\
         pipe from_host root from host { default { actions drop } }\n",
    )
    .expect("write pipeline");
    scapy(
        &dir.0,
        r#"
o = Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789)/VXLAN(vni=100, flags=0x08)
wrpcap("uplink.pcap", [
    o/Ether(src="02:00:00:00:00:bb", dst="ff:ff:ff:ff:ff:ff")/ARP(op=1, hwsrc="02:00:00:00:00:bb", psrc="10.1.0.1", pdst="10.0.0.5"),
    o/Ether(src="02:00:00:00:00:bb", dst="ff:ff:ff:ff:ff:ff")/ARP(op=1, hwsrc="02:00:00:00:00:bb", psrc="10.1.0.1", pdst="10.9.0.5"),
])
"#,
    );
    let (_, to_host, to_uplink) = replay_both_ports(&dir, &pipe);
    let fields = [
        "ip.src",
        "ip.dst",
        "vxlan.vni",
        "eth.dst",
        "arp.opcode",
        "arp.src.hw_mac",
        "arp.src.proto_ipv4",
        "arp.dst.hw_mac",
        "arp.dst.proto_ipv4",
    ];
    let checked = ["-o", "ip.check_checksum:TRUE", "-E", "occurrence=l"];
    assert_eq!(
        tshark_table(&to_uplink, &checked, ',', &fields).trim(),
        "192.0.2.1,192.0.2.10,100,02:00:00:00:00:bb,2,02:00:00:00:00:aa,10.0.0.5,02:00:00:00:00:bb,10.1.0.1"
    );
    // The request for an address not of the host's side goes to the host, as it came.
    assert_eq!(
        tshark_table(&to_host, &[], ',', &["arp.opcode", "arp.dst.proto_ipv4"]).trim(),
        "1,10.9.0.5"
    );
}
