//! Bad packets: dropped with the right reason, never a panic. Property tests over
//! arbitrary bytes and truncations, and a capture of crafted cases checked one by one.

mod common;
use common::*;
use dpuflow::engine::{DropReason, Engine, NoObserver, PacketBuf, Verdict};
use dpuflow::ir::{PortId, Program};
use proptest::prelude::*;
use std::path::Path;

fn program(path: &str) -> Program {
    let c = dpuflow::lang::check_file(Path::new(path)).expect("read");
    let mut p = c.program.expect("valid pipeline");
    // A small connection table and flow cache: these tests build thousands of engines,
    // and each writes its tables whole.
    if let Some(ct) = &mut p.conntrack {
        ct.capacity = 1024;
    }
    p.telemetry.flow_cache = 1024;
    p
}

fn run(engine: &mut Engine, port: PortId, frame: &[u8]) -> Verdict {
    let mut pkt = PacketBuf::new(9216);
    assert!(pkt.load(frame, port, 1));
    engine.process(std::slice::from_mut(&mut pkt), &mut NoObserver);
    pkt.verdict
}

const PIPELINES: &[&str] = &[
    "pipelines/vxlan-gateway.pipe",
    "pipelines/geneve-gateway.pipe",
    "pipelines/stateful-firewall.pipe",
    "pipelines/kv-offload.pipe",
    "tests/data/geneve-options.pipe",
];

proptest! {
    #![proptest_config(ProptestConfig { cases: 3000, ..ProptestConfig::default() })]

    /// With flow records on: the flow cache reads each packet's headers too.
    #[test]
    fn arbitrary_frames_never_panic(which in 0..PIPELINES.len(), port in 0u16..2, bytes in proptest::collection::vec(any::<u8>(), 0..300)) {
        let p = program(PIPELINES[which]);
        let mut engine = Engine::new(&p);
        engine.enable_flows(&p.telemetry);
        let _ = run(&mut engine, PortId(port), &bytes);
    }

    /// Valid tunnelled frames with a few bytes overwritten: whatever happens, no panic,
    /// and a forwarded packet is still a whole frame.
    #[test]
    fn corrupted_tunnel_frames(which in 0..2usize, flips in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6)) {
        let p = program(PIPELINES[which]);
        let frames = dpuflow::traffic::generate(&p, PortId(1), 128, 4);
        let mut f = frames[0].clone();
        for (at, v) in flips {
            let n = f.len();
            f[at % n] = v;
        }
        let mut engine = Engine::new(&p);
        let _ = run(&mut engine, PortId(1), &f);
    }
}

proptest! {
    /// First fragments whose L4 header is cut anywhere, their addresses rewritten
    /// (tests/data/fragment-rewrite.pipe): no panic, and only the IPv4 header and, where
    /// the fragment holds it, the L4 checksum change; through a pipe that denies by port,
    /// dropped exactly when they hold the whole L4 header and its port is denied.
    #[test]
    fn rewritten_first_fragments_of_any_length(proto in prop_oneof![Just(6u8), Just(17u8)], mut l4 in proptest::collection::vec(any::<u8>(), 0..40), aim in any::<bool>()) {
        // Half of them to the port the deny pipe below drops.
        if aim && l4.len() >= 4 {
            let port: u16 = if proto == 6 { 23 } else { 9999 };
            l4[2..4].copy_from_slice(&port.to_be_bytes());
        }
        let p = program("tests/data/fragment-rewrite.pipe");
        let mut engine = Engine::new(&p);
        let mut frame = vec![0u8; 12];
        frame.extend_from_slice(&0x0800u16.to_be_bytes());
        let total = (20 + l4.len()) as u16;
        frame.extend_from_slice(&[0x45, 0]);
        frame.extend_from_slice(&total.to_be_bytes());
        // Identification, then more fragments set at offset 0: a first fragment.
        frame.extend_from_slice(&[0, 7, 0x20, 0, 64, proto, 0, 0, 10, 0, 0, 1, 10, 0, 0, 2]);
        frame.extend_from_slice(&l4);
        let mut pkt = PacketBuf::new(9216);
        assert!(pkt.load(&frame, PortId(0), 1));
        engine.process(std::slice::from_mut(&mut pkt), &mut NoObserver);
        prop_assert!(matches!(pkt.verdict, Verdict::Forward(_)));
        let out = pkt.data();
        prop_assert_eq!(out.len(), frame.len());
        prop_assert_eq!(&out[30..34], &[10, 0, 0, 99]);
        let checksum_at = 34 + if proto == 6 { 16 } else { 6 };
        for (i, (a, b)) in frame.iter().zip(out).enumerate().skip(34) {
            if a != b {
                prop_assert!(i == checksum_at || i == checksum_at + 1, "byte {} changed", i);
            }
        }
        // Matched by their ports (tests/data/port-deny.pipe drops UDP 9999 and TCP 23)
        // when they hold the whole L4 header, forwarded when they do not: never a panic.
        let deny = program("tests/data/port-deny.pipe");
        let mut engine = Engine::new(&deny);
        let mut pkt = PacketBuf::new(9216);
        assert!(pkt.load(&frame, PortId(0), 1));
        engine.process(std::slice::from_mut(&mut pkt), &mut NoObserver);
        let port = (l4.len() >= 4).then(|| u16::from_be_bytes([l4[2], l4[3]]));
        let whole = l4.len() >= if proto == 6 { 20 } else { 8 };
        let denied = whole && port == Some(if proto == 6 { 23 } else { 9999 });
        prop_assert_eq!(matches!(pkt.verdict, Verdict::Drop(_)), denied);
    }
}

/// An IPv4 or IPv6 frame to `dst` (the VXLAN gateway's overlay, 10.1.0.1 or 2001:db8::1)
/// of protocol `proto` whose transport header holds `l4` bytes.
fn cut_transport(v6: bool, proto: u8, l4: usize) -> Vec<u8> {
    let mut f = vec![2, 0, 0, 0, 0, 1, 2, 0, 0, 0, 0, 2];
    if v6 {
        f.extend_from_slice(&[0x86, 0xdd, 0x60, 0, 0, 0]);
        f.extend_from_slice(&(l4 as u16).to_be_bytes());
        f.extend_from_slice(&[proto, 64]);
        f.extend_from_slice(&[0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2]);
        f.extend_from_slice(&[0x20, 1, 0xd, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1]);
    } else {
        f.extend_from_slice(&[0x08, 0, 0x45, 0]);
        f.extend_from_slice(&(20 + l4 as u16).to_be_bytes());
        f.extend_from_slice(&[0, 1, 0, 0, 64, proto, 0, 0, 10, 0, 0, 9, 10, 1, 0, 1]);
    }
    // Ports 1000 and 2000, then a UDP-Lite coverage of 8 and a nonzero checksum.
    let header = [3, 0xe8, 7, 0xd0, 0, 8, 0x12, 0x34];
    f.extend((0..l4).map(|i| header.get(i).copied().unwrap_or(0)));
    f
}

/// Every transport protocol's header cut short after each of its bytes, on every port of
/// every example pipeline and one verifying checksums, with flow records on: never a
/// panic, and a header too short for its ports is malformed. UDP-Lite cut inside its
/// ports once made the flow hash and the flow cache read past the packet, and cut inside
/// its checksum coverage, the checksum check.
#[test]
fn transport_headers_cut_anywhere_never_panic() {
    for path in PIPELINES.iter().chain(&["tests/data/ct-count.pipe"]) {
        let p = program(path);
        let mut engine = Engine::new(&p);
        engine.enable_flows(&p.telemetry);
        for port in 0..p.ports.len() as u16 {
            for v6 in [false, true] {
                for proto in [1, 6, 17, 58, 132, 136] {
                    for l4 in 0..24 {
                        let v = run(&mut engine, PortId(port), &cut_transport(v6, proto, l4));
                        if proto == 136 && l4 < 4 {
                            assert_eq!(
                                v,
                                Verdict::Drop(DropReason::MalformedL4),
                                "{path}: UDP-Lite of {l4} bytes"
                            );
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn truncation_at_every_offset_is_dropped_as_malformed() {
    for (path, port) in [
        ("pipelines/vxlan-gateway.pipe", 1u16),
        ("pipelines/geneve-gateway.pipe", 1),
        ("pipelines/vxlan-gateway.pipe", 0),
    ] {
        let p = program(path);
        let frame = dpuflow::traffic::generate(&p, PortId(port), 110, 1).remove(0);
        let mut engine = Engine::new(&p);
        assert!(
            matches!(run(&mut engine, PortId(port), &frame), Verdict::Forward(_)),
            "{path}: the whole frame is forwarded"
        );
        for len in 0..frame.len() {
            let v = run(&mut engine, PortId(port), &frame[..len]);
            assert!(
                matches!(
                    v,
                    Verdict::Drop(
                        DropReason::MalformedL2
                            | DropReason::MalformedL3
                            | DropReason::MalformedL4
                            | DropReason::TunnelMalformed
                    )
                ),
                "{path}: frame cut to {len} of {} bytes: {v:?}",
                frame.len()
            );
        }
    }
}

#[test]
fn crafted_cases_drop_with_the_right_reason() {
    let dir = Scratch::new("crafted");
    // Each case: (expected fate, packet). Received on the uplink of vxlan-gateway, whose
    // rule decapsulates VXLAN VNI 100 to 192.0.2.1.
    scapy(
        &dir.0,
        r#"
inner = Ether(src="02:00:00:00:00:0a", dst="02:00:00:00:00:0b")/IP(src="10.1.0.1", dst="10.0.0.1")/UDP(sport=5001, dport=5002)/Raw(b"x" * 8)
def outer(vx):
    return Ether(dst="02:00:00:00:00:01")/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(sport=50000, dport=4789)/vx
good = outer(VXLAN(vni=100, flags=0x08)/inner)
cases = [
    ("forwarded", good),
    ("malformed_l2", Raw(bytes(good)[:10])),
    ("malformed_l2", Ether(dst="02:00:00:00:00:01", type=0x8100)/Raw(b"\x00")),
    ("malformed_l3", Raw(bytes(good)[:14] + bytes([0x55]) + bytes(good)[15:])),                 # IP version 5
    ("malformed_l3", Raw(bytes(good)[:14] + bytes([0x44]) + bytes(good)[15:])),                 # IHL 4
    ("malformed_l3", Ether()/IP(src="192.0.2.10", dst="192.0.2.1", len=1400)/UDP(dport=4789)),  # total length past the frame
    ("malformed_l3", Ether()/IPv6(nh=0)/Raw(b"\x11\x09")),                                     # extension header past the packet
    ("malformed_l4", Ether()/IP(src="192.0.2.10", dst="192.0.2.1", proto=6)/Raw(b"\x00" * 12)),# TCP header cut short
    ("malformed_l4", Ether()/IP(src="192.0.2.10", dst="192.0.2.1")/UDP(dport=4789, len=4)/Raw(b"\x00" * 8)),  # UDP length < 8
    ("tunnel_malformed", outer(Raw(b"\x08\x00\x00"))),                                         # VXLAN header cut short
    ("vxlan_invalid", outer(VXLAN(vni=100, flags=0x0c)/inner)),                                # reserved flag bit
    ("vxlan_invalid", outer(Raw(bytes([0x08, 0, 0, 1, 0, 0, 100, 0])) / inner)),               # reserved field not zero
    ("vxlan_invalid", outer(VXLAN(vni=100, flags=0x00)/inner)),                                # I flag clear
    ("rule", outer(VXLAN(vni=101, flags=0x08)/inner)),                                         # another VNI
    ("rule", Ether()/IP(src="192.0.2.10", dst="192.0.2.1", flags="MF")/UDP(sport=1, dport=4789)/VXLAN(vni=100)/inner),  # a fragment is not L4
    ("rule", Ether()/ARP()),
]
pkts = []
for i, (_, p) in enumerate(cases):
    p.time = 5000 + i
    pkts.append(p)
wrpcap("crafted.pcap", pkts)
open("expected.txt", "w").write("\n".join(c for c, _ in cases))
"#,
    );
    let out = dpuflow_ok(&[
        "trace",
        "pipelines/vxlan-gateway.pipe",
        "--in",
        &format!("uplink={}", dir.path("crafted.pcap")),
    ]);
    let fates: Vec<String> = out
        .lines()
        .filter_map(|l| l.strip_prefix("  => "))
        .map(|l| {
            if l.starts_with("forwarded") {
                "forwarded".to_owned()
            } else {
                let reason = l.trim_start_matches("dropped: ");
                reason.split(" (").next().unwrap_or(reason).to_owned()
            }
        })
        .collect();
    let expected: Vec<String> = std::fs::read_to_string(dir.0.join("expected.txt"))
        .expect("expected")
        .lines()
        .map(str::to_owned)
        .collect();
    assert_eq!(fates, expected, "trace:\n{out}");
}
