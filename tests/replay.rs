//! Replay of captures built with scapy through the example pipelines, checked with tshark
//! and against scapy's own encoding.

mod common;
use common::*;

const HOST_TRAFFIC: &str = r#"
pkts = []
t = 1000.0
for i in range(6):
    p = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")/IP(src="10.0.0.%d" % (i + 1), dst="10.1.%d.%d" % (i, i + 10))/UDP(sport=40000 + i, dport=5001)/Raw(b"payload-%d" % i)
    p.time = t + i * 0.001; pkts.append(p)
p = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")/IP(src="10.0.0.9", dst="10.1.2.3")/TCP(sport=33000, dport=8080, flags="S")
p.time = t + 0.010; pkts.append(p)
p = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")/IP(src="10.0.0.9", dst="10.1.2.4")/ICMP()/Raw(b"ping")
p.time = t + 0.011; pkts.append(p)
p = Ether()/IP(src="10.0.0.1", dst="10.2.0.1")/UDP(dport=5001)          # not in the overlay prefix
p.time = t + 0.012; pkts.append(p)
p = Ether()/ARP(pdst="10.1.0.1")                                         # not IPv4
p.time = t + 0.013; pkts.append(p)
wrpcap("host.pcap", pkts)
wrpcapng("host.pcapng", pkts)
"#;

fn json(out: &str) -> serde_json::Value {
    serde_json::from_str(out).expect("JSON summary")
}

fn port<'a>(summary: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    summary["ports"]
        .as_array()
        .expect("ports")
        .iter()
        .find(|p| p["name"] == name)
        .expect("port")
}

#[test]
fn vxlan_encap_is_clean_for_tshark_and_exact() {
    let dir = Scratch::new("vxlan-encap");
    scapy(&dir.0, HOST_TRAFFIC);
    let out = dpuflow_ok(&[
        "replay",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("host={}", dir.path("host.pcap")),
        "--out",
        &format!("uplink={}", dir.path("uplink.pcap")),
        "--json",
    ]);
    let s = json(&out);
    assert_eq!(port(&s, "host")["rx_packets"], 10);
    assert_eq!(port(&s, "uplink")["tx_packets"], 8);
    assert_eq!(port(&s, "host")["drops"]["rule"], 2);
    assert_tshark_clean(&dir.path("uplink.pcap"));
    let rows = tshark_fields(
        &dir.path("uplink.pcap"),
        &[
            "eth.src",
            "eth.dst",
            "ip.src",
            "ip.dst",
            "ip.ttl",
            "ip.flags.df",
            "udp.srcport",
            "udp.dstport",
            "udp.checksum",
            "vxlan.vni",
        ],
    );
    assert_eq!(rows.len(), 8);
    for row in &rows {
        let f: Vec<&str> = row.split(',').collect();
        // Outer then inner values for the repeated fields.
        assert_eq!(
            &f[0..2],
            ["02:00:00:00:00:01", "02:00:00:00:00:aa"],
            "{row}"
        );
        assert_eq!(
            &f[2..4],
            ["02:00:00:00:00:02", "02:00:00:00:00:bb"],
            "{row}"
        );
        assert_eq!(f[4], "192.0.2.1", "{row}");
        assert_eq!(f[6], "192.0.2.10", "{row}");
        assert_eq!(f[8], "64", "{row}");
        assert!(f.contains(&"4789"), "{row}");
        assert_eq!(f.last(), Some(&"100"), "{row}");
    }
    // Every inner frame is the original, untouched; the outer UDP source port is in the
    // ephemeral range and the same for packets of the same flow.
    let inner_in = frames(&dir.path("host.pcap"));
    let outer = frames(&dir.path("uplink.pcap"));
    for (o, i) in outer.iter().zip(&inner_in) {
        assert_eq!(&o[50..], &i[..], "inner frame changed");
        let sport = u16::from_be_bytes([o[34], o[35]]);
        assert!(sport >= 49152, "source port {sport}");
        assert_eq!(&o[40..42], &[0, 0], "UDP checksum zero over IPv4");
        assert_eq!(o[20] & 0x40, 0x40, "DF set");
    }
}

#[test]
fn replay_is_deterministic_and_reads_pcapng() {
    let dir = Scratch::new("determinism");
    scapy(&dir.0, HOST_TRAFFIC);
    for (input, out) in [
        ("host.pcap", "a.pcap"),
        ("host.pcap", "b.pcap"),
        ("host.pcapng", "c.pcap"),
    ] {
        dpuflow_ok(&[
            "replay",
            "pipelines/vxlan-gateway.pipe",
            "--in",
            &format!("host={}", dir.path(input)),
            "--out",
            &format!("uplink={}", dir.path(out)),
        ]);
    }
    let a = std::fs::read(dir.path("a.pcap")).expect("a");
    assert_eq!(
        a,
        std::fs::read(dir.path("b.pcap")).expect("b"),
        "same input, different output"
    );
    assert_eq!(
        a,
        std::fs::read(dir.path("c.pcap")).expect("c"),
        "pcapng input gives a different output"
    );
}

#[test]
fn vxlan_decap_yields_the_inner_frames() {
    let dir = Scratch::new("vxlan-decap");
    scapy(
        &dir.0,
        r#"
inner = [Ether(src="02:00:00:00:00:0a", dst="02:00:00:00:00:0b")/IP(src="10.1.0.%d" % i, dst="10.0.0.1")/UDP(sport=5001, dport=40000 + i)/Raw(b"reply")
         for i in range(1, 5)]
outer = []
for n, f in enumerate(inner):
    p = Ether(src="02:00:00:00:00:02", dst="02:00:00:00:00:01")/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000 + n, dport=4789)/VXLAN(vni=100, flags=0x08)/f
    p.time = 2000 + n; outer.append(p)
bad = Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789)/VXLAN(vni=101, flags=0x08)/inner[0]
bad.time = 2010; outer.append(bad)
rsv = Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789)/VXLAN(vni=100, flags=0x0c)/inner[0]
rsv.time = 2011; outer.append(rsv)
wrpcap("uplink.pcap", outer)
wrpcap("inner.pcap", inner)
"#,
    );
    let out = dpuflow_ok(&[
        "replay",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("uplink={}", dir.path("uplink.pcap")),
        "--out",
        &format!("host={}", dir.path("host.pcap")),
        "--json",
    ]);
    let s = json(&out);
    assert_eq!(port(&s, "host")["tx_packets"], 4);
    assert_eq!(
        port(&s, "uplink")["drops"]["rule"],
        1,
        "wrong VNI falls to the default"
    );
    assert_eq!(
        port(&s, "uplink")["drops"]["vxlan_invalid"],
        1,
        "reserved flag bit set"
    );
    assert_eq!(
        frames(&dir.path("host.pcap")),
        frames(&dir.path("inner.pcap"))
    );
    assert_tshark_clean(&dir.path("host.pcap"));
}

#[test]
fn inputs_merge_in_timestamp_order() {
    let dir = Scratch::new("merge");
    scapy(
        &dir.0,
        r#"
def pkt(t, n):
    p = Ether()/IP(src="10.0.0.1", dst="10.1.0.%d" % n)/UDP(sport=1, dport=5001)
    p.time = t
    return p
wrpcap("a.pcap", [pkt(1.0, 1), pkt(3.0, 3), pkt(5.0, 5)])
wrpcap("b.pcap", [pkt(2.0, 2), pkt(3.0, 4), pkt(6.0, 6)])
"#,
    );
    // One pipeline port per input would be natural; here both inputs feed the host port.
    dpuflow_ok(&[
        "replay",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("host={}", dir.path("a.pcap")),
        "--in",
        &format!("host={}", dir.path("b.pcap")),
        "--out",
        &format!("uplink={}", dir.path("out.pcap")),
    ]);
    // The inner IPv4 destination's last byte is the packet's number: 3.0 ties go to a.pcap.
    let order: Vec<u8> = frames(&dir.path("out.pcap"))
        .iter()
        .map(|f| f[50 + 33])
        .collect();
    assert_tshark_clean(&dir.path("out.pcap"));
    assert_eq!(order, [1, 2, 3, 4, 5, 6]);
}

#[test]
fn replay_rejects_unknown_ports_and_missing_files() {
    let out = dpuflow(&[
        "replay",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        "hots=x.pcap",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("did you mean `host`?"));
    let out = dpuflow(&[
        "replay",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        "host=/nonexistent.pcap",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent.pcap"));
}

#[test]
fn trace_shows_the_walk() {
    let dir = Scratch::new("trace");
    scapy(&dir.0, HOST_TRAFFIC);
    let out = dpuflow_ok(&[
        "trace",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("host={}", dir.path("host.pcap")),
        "--packet",
        "9",
    ]);
    assert_eq!(
        out,
        "packet 9: in_port host, 42 bytes: 10.0.0.1 > 10.2.0.1 UDP 53 > 5001\n  pipe from_host\n    no match: default\n      count\n      drop\n  => dropped: rule (a `drop` action)\n"
    );
    let out = dpuflow_ok(&[
        "trace",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("host={}", dir.path("host.pcap")),
        "--packet",
        "1",
    ]);
    assert!(
        out.contains(
            "    match 10.1.0.0/16\n      vxlan.encap { vni 100 src 192.0.2.1 dst 192.0.2.10"
        ),
        "{out}"
    );
    assert!(
        out.contains("  => forwarded to uplink, 101 bytes: 192.0.2.1 > 192.0.2.10 UDP"),
        "{out}"
    );
    assert!(
        out.contains("vxlan vni 100 [10.0.0.1 > 10.1.0.10 UDP 40000 > 5001]"),
        "{out}"
    );
}

#[test]
fn every_example_replays_traces_and_benches() {
    let dir = Scratch::new("examples");
    for entry in std::fs::read_dir("pipelines").expect("pipelines") {
        let path = entry.expect("entry").path();
        if path.extension().is_none_or(|e| e != "pipe") {
            continue;
        }
        let pipe = path.display().to_string();
        let text = std::fs::read_to_string(&path).expect("read");
        let ports: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("port "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        for port in ports {
            let out = dpuflow_ok(&[
                "bench",
                &pipe,
                "--port",
                port,
                "--packets",
                "20000",
                "--flows",
                "64",
            ]);
            assert!(out.contains("Mpps"), "{out}");
            // The bench's own traffic, written out, replays and traces the same way.
            let pcap = dir.path(&format!("{port}.pcap"));
            bench_capture(&pipe, port, 64, &pcap);
            assert_tshark_clean(&pcap);
            let out = dpuflow_ok(&["replay", &pipe, "--in", &format!("{port}={pcap}"), "--json"]);
            assert_eq!(json(&out)["packets"], 64, "{pipe} {port}");
            let out = dpuflow_ok(&["trace", &pipe, "--in", &format!("{port}={pcap}")]);
            assert_eq!(out.matches("=> ").count(), 64, "{pipe} {port}: {out}");
        }
    }
}

/// `bench --trace` takes its frames from a ClassBench trace, one per line in order, IPv4
/// (addresses as integers, as dpdk-test-acl reads them) or IPv6: tshark reads back each
/// line's addresses, ports and protocol.
#[test]
fn bench_frames_from_a_trace_carry_its_packets() {
    let dir = Scratch::new("bench-trace");
    let v4 = [
        (
            "167772161 3221225991 1234 80 6",
            "10.0.0.1 192.0.2.7 1234 80 6",
        ),
        (
            "3325256713 167838211 53 40000 17",
            "198.51.100.9 10.1.2.3 53 40000 17",
        ),
        ("16909060 84281096 0 0 253", "1.2.3.4 5.6.7.8 0 0 253"),
    ];
    let v6 = [
        (
            "2001:db8::1 2001:db8:1::2 1234 443 6",
            "2001:db8::1 2001:db8:1::2 1234 443 6",
        ),
        (
            "2001:db8::3 2001:db8::4 5353 53 17",
            "2001:db8::3 2001:db8::4 5353 53 17",
        ),
    ];
    for (name, lines) in [("v4", &v4[..]), ("v6", &v6[..])] {
        let path = dir.path(&format!("{name}.trace"));
        let trace: String = lines.iter().map(|(l, _)| format!("{l}\n")).collect();
        std::fs::write(&path, trace).expect("write trace");
        let pcap = dir.path(&format!("{name}.pcap"));
        let pipe = "pipelines/stateful-firewall.pipe";
        dpuflow_ok(&[
            "bench", pipe, "--trace", &path, "--size", "128", "--write", &pcap,
        ]);
        assert_tshark_clean(&pcap);
        let (src, dst, proto) = if name == "v4" {
            ("ip.src", "ip.dst", "ip.proto")
        } else {
            ("ipv6.src", "ipv6.dst", "ipv6.nxt")
        };
        let fields = [
            src,
            dst,
            "tcp.srcport",
            "tcp.dstport",
            "udp.srcport",
            "udp.dstport",
            proto,
        ];
        let got: Vec<String> = tshark_fields(&pcap, &fields)
            .iter()
            .map(|r| {
                let f: Vec<&str> = r.split(',').collect();
                // Ports from TCP or UDP; a protocol tshark does not decode shows none.
                let (sp, dp) = match (f[2], f[4]) {
                    ("", "") => ("0", "0"),
                    ("", _) => (f[4], f[5]),
                    _ => (f[2], f[3]),
                };
                format!("{} {} {sp} {dp} {}", f[0], f[1], f[6])
            })
            .collect();
        let want: Vec<&str> = lines.iter().map(|(_, w)| *w).collect();
        assert_eq!(got, want, "{name}");
    }
}

/// `bench --conversations` makes each flow a TCP connection: tshark follows every one
/// through its handshake and in-order segments with no analysis flag (no retransmission,
/// duplicate ACK, unseen segment or window problem), and window tracking passes them all,
/// written out and replayed as in the benchmark itself, IPv4 and IPv6 (an entry that takes
/// both ends).
#[test]
fn bench_conversations_are_in_order_tcp() {
    let dir = Scratch::new("bench-conversations");
    let v4 = "bench/conversations-window.pipe";
    let v6_text = std::fs::read_to_string(v4).expect("read").replace(
        "match ip.proto 6",
        "match ipv6.dst 2001:db8::/64  ip.proto 6",
    );
    let v6 = dir.path("v6.pipe");
    std::fs::write(&v6, v6_text).expect("write");
    for (name, pipe) in [("v4", v4), ("v6", v6.as_str())] {
        let pcap = dir.path(&format!("{name}.pcap"));
        let bench = |more: &[&str]| {
            let mut args = vec!["bench", pipe, "--conversations", "--flows", "64"];
            args.extend_from_slice(&["--size", "100"]);
            args.extend_from_slice(more);
            dpuflow_ok(&args)
        };
        bench(&["--write", &pcap]);
        assert_tshark_clean(&pcap);
        let flagged = tshark_table(&pcap, &["-Y", "tcp.analysis.flags"], ',', &["frame.number"]);
        assert_eq!(flagged, "", "{name}: tshark flags these frames");
        let streams = tshark_fields(&pcap, &["tcp.stream"]);
        assert_eq!(streams.len(), 64 * 5, "{name}");
        assert_eq!(
            streams
                .iter()
                .collect::<std::collections::HashSet<_>>()
                .len(),
            64
        );
        let s = json(&dpuflow_ok(&[
            "replay",
            pipe,
            "--in",
            &format!("a={pcap}"),
            "--json",
        ]));
        assert_eq!(port(&s, "b")["tx_packets"], 64 * 5, "{name}: {s}");
        assert_eq!(s["conntrack"]["entries"], 64, "{name}: {s}");
        let invalid = s["conntrack"]["invalid"].as_object().expect("invalid");
        assert!(invalid.values().all(|v| v == 0), "{name}: {s}");
        let out = bench(&["--warmup", "192", "--packets", "20000"]);
        assert!(
            out.contains("forwarded 20000, dropped 0")
                && out.contains(
                    "connections: 64 tracked, 64 created, 0 dropped early, 0 refused, 0 invalid"
                ),
            "{name}: {out}"
        );
    }
    // Entries that do not take plain TCP are refused, with the reason.
    let out = dpuflow(&["bench", "pipelines/vxlan-gateway.pipe", "--conversations"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("plain TCP"), "{err}");
}

/// The captures shipped for trying dpuflow out (README) replay as documented.
#[test]
fn shipped_captures_replay() {
    let out = dpuflow_ok(&[
        "replay",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        "host=pipelines/captures/host.pcap",
        "--in",
        "uplink=pipelines/captures/uplink.pcap",
        "--json",
    ]);
    let s = json(&out);
    assert_eq!(port(&s, "host")["rx_packets"], 200);
    assert_eq!(port(&s, "uplink")["tx_packets"], 180);
    assert_eq!(port(&s, "host")["tx_packets"], 45);
}
