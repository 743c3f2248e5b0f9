//! Geneve against scapy's Geneve layer (no kernel module here): dpuflow's encapsulation
//! must equal scapy's encoding of the same headers byte for byte, dpuflow must
//! decapsulate scapy's frames (with options) to the exact inner frames, and tshark must
//! dissect the output cleanly.

mod common;
use common::*;

const INNER: &str = r#"
inner = []
for i in range(4):
    p = Ether(src="02:00:00:00:00:aa", dst="02:00:00:00:00:bb")/IP(src="10.0.0.%d" % (i + 1), dst="10.1.0.%d" % (i + 7))/UDP(sport=41000 + i, dport=5001)/Raw(b"geneve %d" % i)
    p.time = 3000 + i; inner.append(p)
wrpcap("inner.pcap", inner)
"#;

/// Scapy's encoding of the outer headers dpuflow should have written; the UDP source
/// port (a hash of the inner flow) is taken from dpuflow's frame.
fn reference(dir: &Scratch, outer: &str) -> String {
    format!(
        r#"{INNER}
got = rdpcap("{got}")
ref = []
for g, f in zip(got, inner):
    sport = g[UDP].sport
    {outer}
    ref.append(r)
wrpcap("reference.pcap", ref)
"#,
        got = dir.path("uplink.pcap"),
    )
}

#[test]
fn geneve_gateway_encap_matches_scapy() {
    let dir = Scratch::new("geneve-encap");
    scapy(&dir.0, INNER);
    dpuflow_ok(&[
        "replay",
        "pipelines/geneve-gateway.pipe",
        "--in",
        &format!("host={}", dir.path("inner.pcap")),
        "--out",
        &format!("uplink={}", dir.path("uplink.pcap")),
    ]);
    scapy(
        &dir.0,
        &reference(
            &dir,
            r#"r = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")/IP(src="192.0.2.1", dst="192.0.2.11", ttl=64, flags="DF", id=0)/UDP(sport=sport, dport=6081, chksum=0)/GENEVE(vni=200, proto=0x6558)/f"#,
        ),
    );
    let got = frames(&dir.path("uplink.pcap"));
    assert_eq!(got.len(), 4);
    assert_eq!(got, frames(&dir.path("reference.pcap")));
    assert_tshark_clean(&dir.path("uplink.pcap"));
    let rows = tshark_fields(
        &dir.path("uplink.pcap"),
        &["geneve.vni", "ip.dst", "udp.dstport"],
    );
    assert!(
        rows.iter()
            .all(|r| r.starts_with("0x0000c8,192.0.2.11,10.1.0.") && r.contains(",6081,5001")),
        "{rows:?}"
    );
}

#[test]
fn geneve_options_over_ipv6_match_scapy() {
    let dir = Scratch::new("geneve-options");
    scapy(&dir.0, INNER);
    dpuflow_ok(&[
        "replay",
        "tests/data/geneve-options.pipe",
        "--in",
        &format!("host={}", dir.path("inner.pcap")),
        "--out",
        &format!("uplink={}", dir.path("uplink.pcap")),
    ]);
    scapy(
        &dir.0,
        &reference(
            &dir,
            // The flow label, like the source port, is the inner flow's hash's: taken
            // from what came out, and never 0.
            r#"assert g[IPv6].fl != 0; r = Ether(src="02:00:00:00:00:01", dst="02:00:00:00:00:02")/IPv6(src="2001:db8::1", dst="2001:db8::2", hlim=32, fl=g[IPv6].fl)/UDP(sport=sport, dport=6081)/GENEVE(vni=300, proto=0x6558, options=[GeneveOptions(classid=0x0102, type=0x01, data=b"\x00\x00\x00\x0a"), GeneveOptions(classid=0xff00, type=0x05, data=bytes(range(1, 9)))])/f"#,
        ),
    );
    // scapy computes the UDP checksum over IPv6 itself: equality checks ours too.
    assert_eq!(
        frames(&dir.path("uplink.pcap")),
        frames(&dir.path("reference.pcap"))
    );
    assert_tshark_clean(&dir.path("uplink.pcap"));
}

#[test]
fn geneve_decap_of_scapy_frames() {
    let dir = Scratch::new("geneve-decap");
    scapy(
        &dir.0,
        &format!(
            r#"{INNER}
outer = []
opts = [GeneveOptions(classid=0x0102, type=0x01, data=b"\x00\x00\x00\x0a")]
for n, f in enumerate(inner):
    p = Ether()/IPv6(src="2001:db8::2", dst="2001:db8::1")/UDP(sport=50000 + n, dport=6081)/GENEVE(vni=300, proto=0x6558, options=opts)/f
    p.time = 4000 + n; outer.append(p)
crit = Ether()/IPv6(src="2001:db8::2", dst="2001:db8::1")/UDP(sport=50000, dport=6081)/GENEVE(vni=300, proto=0x6558, critical=1, options=[GeneveOptions(classid=0x0102, type=0x81, data=b"\x00\x00\x00\x01")])/inner[0]
crit.time = 4010; outer.append(crit)
oversized = Ether()/IPv6(src="2001:db8::2", dst="2001:db8::1")/UDP(sport=50000, dport=6081)/Raw(bytes([0x3f, 0, 0x65, 0x58, 0, 1, 0x2c, 0]) + b"short")
oversized.time = 4011; outer.append(oversized)
wrpcap("uplink.pcap", outer)
"#
        ),
    );
    let out = dpuflow_ok(&[
        "replay",
        "tests/data/geneve-options.pipe",
        "--in",
        &format!("uplink={}", dir.path("uplink.pcap")),
        "--out",
        &format!("host={}", dir.path("host.pcap")),
        "--json",
    ]);
    let s: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    let uplink = &s["ports"][1];
    assert_eq!(uplink["drops"]["geneve_critical_option"], 1, "{s}");
    assert_eq!(uplink["drops"]["tunnel_malformed"], 1, "{s}");
    assert_eq!(
        frames(&dir.path("host.pcap")),
        frames(&dir.path("inner.pcap"))
    );
    assert_tshark_clean(&dir.path("host.pcap"));
}
