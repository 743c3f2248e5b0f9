//! pipelines/stateful-firewall.pipe under `dpuflow replay` with crafted sessions from both
//! sides, merged by capture time: what inside opens gets its replies; nothing else from
//! outside gets in.

mod common;
use common::*;

/// Builds in.pcap (inside) and out.pcap (outside); `expect.txt` lists, for every packet in
/// time order, its side and whether it must pass.
const SESSIONS: &str = r#"
C, S = "10.0.0.5", "203.0.113.10"
EC = Ether(src="02:00:00:00:00:c1", dst="02:00:00:00:00:f1")
ES = Ether(src="02:00:00:00:00:51", dst="02:00:00:00:00:f2")
BIG = DNS(qr=1, qd=DNSQR(qname="example.org", qtype="TXT"),
          an=DNSRR(rrname="example.org", type="TXT", rdata=[b"x" * 200] * 15))
seq = [
  # TCP 443: handshake, data, teardown.
  ("in",  True,  EC/IP(src=C, dst=S)/TCP(sport=40001, dport=443, flags="S", seq=100)),
  ("out", True,  ES/IP(src=S, dst=C)/TCP(sport=443, dport=40001, flags="SA", seq=900, ack=101)),
  ("in",  True,  EC/IP(src=C, dst=S)/TCP(sport=40001, dport=443, flags="A", seq=101, ack=901)),
  ("in",  True,  EC/IP(src=C, dst=S)/TCP(sport=40001, dport=443, flags="PA", seq=101, ack=901)/Raw(b"GET /")),
  ("out", True,  ES/IP(src=S, dst=C)/TCP(sport=443, dport=40001, flags="PA", seq=901, ack=106)/Raw(b"200 OK")),
  # An off-path RST (its sequence number far past the window): invalid, dropped, and the
  # connection goes on.
  ("out", False, ES/IP(src=S, dst=C)/TCP(sport=443, dport=40001, flags="R", seq=50000)),
  ("in",  True,  EC/IP(src=C, dst=S)/TCP(sport=40001, dport=443, flags="FA", seq=106, ack=907)),
  ("out", True,  ES/IP(src=S, dst=C)/TCP(sport=443, dport=40001, flags="FA", seq=907, ack=107)),
  ("in",  True,  EC/IP(src=C, dst=S)/TCP(sport=40001, dport=443, flags="A", seq=107, ack=908)),
  # A port inside may not open, and a SYN from outside.
  ("in",  False, EC/IP(src=C, dst=S)/TCP(sport=40002, dport=8080, flags="S", seq=1)),
  ("out", False, ES/IP(src=S, dst=C)/TCP(sport=5555, dport=22, flags="S", seq=1)),
  # DNS over UDP, and a reply on a port nobody asked.
  ("in",  True,  EC/IP(src=C, dst=S)/UDP(sport=53001, dport=53)/DNS(rd=1, qd=DNSQR(qname="example.org"))),
  ("out", True,  ES/IP(src=S, dst=C)/UDP(sport=53, dport=53001)/DNS(qr=1, qd=DNSQR(qname="example.org"))),
  ("out", False, ES/IP(src=S, dst=C)/UDP(sport=53, dport=53999)/DNS(qr=1, qd=DNSQR(qname="example.org"))),
  # A DNS answer too big for one packet (BIG): its fragments follow its first in (the later
  # ones take their ports from it); unsolicited, none passes; a fragment ahead of its
  # datagram's first has no ports to go by and is dropped, the rest pass. IPv6 too.
  *[("out", True, f) for f in fragment(ES/IP(src=S, dst=C, id=77)/UDP(sport=53, dport=53001)/BIG, fragsize=1200)],
  *[("out", False, f) for f in fragment(ES/IP(src=S, dst=C, id=78)/UDP(sport=53, dport=53999)/BIG, fragsize=1200)],
  *[("out", i == 0, f) for i, f in enumerate(fragment(ES/IP(src=S, dst=C, id=79)/UDP(sport=53, dport=53001)/BIG, fragsize=1200))][::-1],
  ("in",  True,  EC/IPv6(src="2001:db8::5", dst="2001:db8:1::10")/UDP(sport=53002, dport=53)/DNS(rd=1, qd=DNSQR(qname="example.org"))),
  *[("out", True, ES/f) for f in fragment6(IPv6(src="2001:db8:1::10", dst="2001:db8::5")/IPv6ExtHdrFragment(id=80)/UDP(sport=53, dport=53002)/BIG, 1280)],
  # Options after the fragment header: the later fragments name those, not UDP.
  *[("out", True, ES/f) for f in fragment6(IPv6(src="2001:db8:1::10", dst="2001:db8::5")/IPv6ExtHdrFragment(id=81)/IPv6ExtHdrDestOpt()/UDP(sport=53, dport=53002)/BIG, 1280)],
  # Ping, and an unsolicited echo reply.
  ("in",  True,  EC/IP(src=C, dst=S)/ICMP(type=8, id=7, seq=1)),
  ("out", True,  ES/IP(src=S, dst=C)/ICMP(type=0, id=7, seq=1)),
  ("out", False, ES/IP(src=S, dst=C)/ICMP(type=0, id=99, seq=1)),
  # An ICMP error quoting the DNS flow is related; one quoting nothing known is not.
  ("out", True,  ES/IP(src=S, dst=C)/ICMP(type=3, code=3)/IP(src=C, dst=S)/UDP(sport=53001, dport=53)),
  ("out", False, ES/IP(src=S, dst=C)/ICMP(type=3, code=3)/IP(src=C, dst=S)/UDP(sport=53002, dport=53)),
]
inside, outside, lines = [], [], []
for i, (side, passes, p) in enumerate(seq):
    p.time = 1000 + i * 0.01
    (inside if side == "in" else outside).append(p)
    lines.append("%s %d" % (side, passes))
wrpcap("in.pcap", inside)
wrpcap("out.pcap", outside)
open("expect.txt", "w").write("\n".join(lines))
"#;

#[test]
fn stateful_firewall_contract() {
    let dir = Scratch::new("stateful");
    scapy(&dir.0, SESSIONS);
    let trace = dpuflow_ok(&[
        "trace",
        "pipelines/stateful-firewall.pipe",
        "--in",
        &format!("inside={}", dir.path("in.pcap")),
        "--in",
        &format!("outside={}", dir.path("out.pcap")),
    ]);
    let fates: Vec<bool> = trace
        .lines()
        .filter_map(|l| l.strip_prefix("  => "))
        .map(|l| l.starts_with("forwarded"))
        .collect();
    let expect: Vec<bool> = std::fs::read_to_string(dir.0.join("expect.txt"))
        .expect("expect")
        .lines()
        .map(|l| l.ends_with('1'))
        .collect();
    assert_eq!(fates, expect, "trace:\n{trace}");
    assert!(
        trace.contains("conntrack zone 0: invalid (tcp_seq: "),
        "the trace says why the RST is invalid:\n{trace}"
    );

    // The same through replay: outputs hold exactly the passing packets, dissected clean.
    let out = dpuflow_ok(&[
        "replay",
        "pipelines/stateful-firewall.pipe",
        "--in",
        &format!("inside={}", dir.path("in.pcap")),
        "--in",
        &format!("outside={}", dir.path("out.pcap")),
        "--out",
        &format!("inside={}", dir.path("to-inside.pcap")),
        "--out",
        &format!("outside={}", dir.path("to-outside.pcap")),
        "--json",
    ]);
    let s: serde_json::Value = serde_json::from_str(&out).expect("JSON");
    // The off-path RST is the one packet out of its window.
    assert_eq!(s["conntrack"]["invalid"]["tcp_seq"], 1, "{s}");
    let passing_in = expect
        .iter()
        .zip(
            std::fs::read_to_string(dir.0.join("expect.txt"))
                .expect("e")
                .lines(),
        )
        .filter(|(p, l)| **p && l.starts_with("in"))
        .count();
    assert_eq!(
        frames(&dir.path("to-outside.pcap")).len(),
        passing_in,
        "{s}"
    );
    assert_eq!(
        frames(&dir.path("to-inside.pcap")).len(),
        expect.iter().filter(|p| **p).count() - passing_in,
        "{s}"
    );
    assert_tshark_clean(&dir.path("to-outside.pcap"));
    assert_tshark_clean(&dir.path("to-inside.pcap"));
}

/// A connection committed after `vxlan.decap` is keyed on the inner headers (not on the
/// outer ones the batch was looked at first), so the host's replies find it: UDP, and TCP
/// in UDP (keyed on the outer protocol, the TCP SYN was once tracked as UDP and the host's
/// SYN-ACK found nothing).
#[test]
fn conntrack_after_decap_tracks_the_inner_flow() {
    let dir = Scratch::new("ct-decap");
    scapy(
        &dir.0,
        r#"
inner = Ether()/IP(src="10.1.0.5", dst="10.0.0.1")/UDP(sport=5001, dport=3000)/Raw(b"req")
up = Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789)/VXLAN(vni=100, flags=0x08)/inner
up.time = 1.0
reply = Ether()/IP(src="10.0.0.1", dst="10.1.0.5")/UDP(sport=3000, dport=5001)/Raw(b"resp")
reply.time = 2.0
stranger = Ether()/IP(src="10.0.0.1", dst="10.1.0.6")/UDP(sport=3000, dport=5001)/Raw(b"no")
stranger.time = 3.0
syn = Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50001, dport=4789)/VXLAN(vni=100, flags=0x08)/Ether()/IP(src="10.1.0.5", dst="10.0.0.1")/TCP(sport=6001, dport=80, flags="S", seq=1)
syn.time = 4.0
synack = Ether()/IP(src="10.0.0.1", dst="10.1.0.5")/TCP(sport=80, dport=6001, flags="SA", seq=9, ack=2)
synack.time = 5.0
wrpcap("up.pcap", [up, syn]); wrpcap("host.pcap", [reply, stranger, synack])
"#,
    );
    // The second pipeline looks each uplink packet up on its outer headers first (its root
    // matches `ct.state`): the commit after the decapsulation once reused that lookup and
    // tracked the outer flow.
    for pipeline in [
        "tests/data/ct-after-decap.pipe",
        "tests/data/ct-state-before-decap.pipe",
    ] {
        let trace = dpuflow_ok(&[
            "trace",
            pipeline,
            "--in",
            &format!("uplink={}", dir.path("up.pcap")),
            "--in",
            &format!("host={}", dir.path("host.pcap")),
        ]);
        let fates: Vec<&str> = trace
            .lines()
            .filter_map(|l| l.strip_prefix("  => "))
            .map(|l| l.split([',', '(']).next().unwrap_or(l).trim_end())
            .collect();
        assert_eq!(
            fates,
            [
                "forwarded to host",
                "forwarded to uplink",
                "dropped: rule",
                "forwarded to host",
                "forwarded to uplink"
            ],
            "{pipeline}: {trace}"
        );
    }
}
