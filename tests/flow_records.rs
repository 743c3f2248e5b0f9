//! Every packet is in exactly one flow record. Through the stateful firewall, records come
//! from connection entries (packets a connection counted) and from the flow cache (the
//! rest: drops before a commit, packets no connection takes); whatever the mix of
//! directions, TCP flags, batch boundaries and jumps in time (idle and active timeouts,
//! expiries met on lookup, TCP reopens), the records' packets and bytes per 5-tuple add up
//! to what was sent. Likewise where connections are tracked after decapsulation. With the
//! flow cache sampling one packet in N, it holds exactly that share of the rest.

use dpuflow::engine::{Engine, NoObserver, PacketBuf};
use dpuflow::ir::PortId;
use dpuflow::telemetry::flows::FlowRecord;
use dpuflow::wire::{ethernet, ip_proto, ipv4};
use proptest::prelude::*;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

/// (source, destination, source port, destination port, protocol)
type Tuple = (u32, u32, u16, u16, u8);

const INSIDE: PortId = PortId(0);
const OUTSIDE: PortId = PortId(1);

/// Connections inside may open (TCP 443, UDP 53) and traffic the firewall drops (a port it
/// does not allow, and a TCP SYN from outside).
fn conversation(n: usize) -> Tuple {
    let inside = 0x0a00_0001 + (n as u32 % 2);
    let outside = 0xc633_6401;
    match n % 4 {
        0 => (inside, outside, 40000, 443, ip_proto::TCP),
        1 => (inside, outside, 5353, 53, ip_proto::UDP),
        2 => (inside, outside, 999, 25, ip_proto::UDP),
        _ => (outside, inside, 1234, 22, ip_proto::TCP),
    }
}

/// An Ethernet/IPv4 frame of the tuple with a TCP (20-byte) or UDP header and `payload`
/// bytes; its IP length.
fn frame(t: Tuple, tcp_flags: u8, payload: usize) -> (Vec<u8>, u64) {
    let (src, dst, sport, dport, proto) = t;
    let l4_len = if proto == ip_proto::TCP { 20 } else { 8 };
    let ip_len = 20 + l4_len + payload;
    let mut f = vec![0u8; ethernet::HEADER_LEN + ip_len];
    ethernet::Repr {
        src: [2, 0, 0, 0, 0, 1],
        dst: [2, 0, 0, 0, 0, 2],
        ethertype: ethernet::ethertype::IPV4,
    }
    .emit(&mut f);
    ipv4::Repr {
        src: src.to_be_bytes(),
        dst: dst.to_be_bytes(),
        protocol: proto,
        ttl: 64,
        dscp: 0,
        dont_frag: false,
        payload_len: (l4_len + payload) as u16,
    }
    .emit(&mut f[ethernet::HEADER_LEN..]);
    let l4 = &mut f[ethernet::HEADER_LEN + 20..];
    l4[0..2].copy_from_slice(&sport.to_be_bytes());
    l4[2..4].copy_from_slice(&dport.to_be_bytes());
    if proto == ip_proto::TCP {
        l4[12] = 5 << 4;
        l4[13] = tcp_flags;
    } else {
        l4[4..6].copy_from_slice(&((8 + payload) as u16).to_be_bytes());
    }
    (f, ip_len as u64)
}

/// An inner frame in VXLAN (RFC 7348 §5) from the remote VTEP 192.0.2.10 to 192.0.2.1; its
/// outer tuple and IP length (what the flow cache keys and counts for it).
fn vxlan(inner: &[u8], vni: u32, sport: u16) -> (Vec<u8>, Tuple, u64) {
    let udp_len = 8 + 8 + inner.len();
    let ip_len = 20 + udp_len;
    let (src, dst) = (0xc000_020a_u32, 0xc000_0201_u32);
    let mut f = vec![0u8; ethernet::HEADER_LEN + ip_len];
    ethernet::Repr {
        src: [2, 0, 0, 0, 0, 3],
        dst: [2, 0, 0, 0, 0, 4],
        ethertype: ethernet::ethertype::IPV4,
    }
    .emit(&mut f);
    ipv4::Repr {
        src: src.to_be_bytes(),
        dst: dst.to_be_bytes(),
        protocol: ip_proto::UDP,
        ttl: 64,
        dscp: 0,
        dont_frag: false,
        payload_len: udp_len as u16,
    }
    .emit(&mut f[ethernet::HEADER_LEN..]);
    let udp = &mut f[ethernet::HEADER_LEN + 20..];
    udp[0..2].copy_from_slice(&sport.to_be_bytes());
    udp[2..4].copy_from_slice(&4789u16.to_be_bytes());
    udp[4..6].copy_from_slice(&(udp_len as u16).to_be_bytes());
    udp[8] = 0x08;
    udp[12..15].copy_from_slice(&vni.to_be_bytes()[1..]);
    udp[16..].copy_from_slice(inner);
    (f, (src, dst, sport, 4789, ip_proto::UDP), ip_len as u64)
}

/// The fragments of an Ethernet/IPv4 frame's datagram (RFC 791 §3.2) with identification
/// `ident`, each carrying up to `size` bytes (a multiple of 8) of its payload; their IP
/// lengths.
fn fragments(frame: &[u8], ident: u16, size: usize) -> Vec<(Vec<u8>, u64)> {
    let (head, payload) = frame.split_at(ethernet::HEADER_LEN + 20);
    payload
        .chunks(size)
        .enumerate()
        .map(|(n, part)| {
            let mut f = [head, part].concat();
            let ip = &mut f[ethernet::HEADER_LEN..];
            let more = (n + 1) * size < payload.len();
            let flags_offset = u16::from(more) << 13 | (n * size / 8) as u16;
            ip[2..4].copy_from_slice(&(20 + part.len() as u16).to_be_bytes());
            ip[4..6].copy_from_slice(&ident.to_be_bytes());
            ip[6..8].copy_from_slice(&flags_offset.to_be_bytes());
            ipv4::Packet::new_unchecked(ip).fill_checksum();
            (f, 20 + part.len() as u64)
        })
        .collect()
}

/// SYN, SYN-ACK, ACK, PSH-ACK, FIN-ACK, RST.
const TCP_FLAGS: [u8; 6] = [0x02, 0x12, 0x10, 0x18, 0x11, 0x04];

/// Time steps: within a burst, past the active timeout, past the idle ones.
const STEPS_NS: [u64; 4] = [1_000_000, 1_000_000, 3_000_000_000, 200_000_000_000];

/// What a record is keyed on: the packet's tuple as it arrived, and its VNI if tunnelled.
type Key = (Tuple, Option<u32>);

/// One packet to send: its port, frame, the key and IP length its record must show, how
/// far time moves before it, and how many packets make a batch.
struct Send {
    port: PortId,
    frame: Vec<u8>,
    key: Key,
    ip_len: u64,
    step: usize,
    flush_after: usize,
}

/// Runs `sends` through `pipeline` with flow records kept (2 s active, 5 s idle timeout,
/// 64 connections at most), taking the records made after every batch and flushing at the end,
/// and checks that the records' packets and bytes per key are what was sent.
///
/// With `sampling` N above 1 the flow cache counts one packet in each window of N of those
/// it is offered (connections still count all theirs): its records then hold one N-th of
/// the packets no connection counted (rounded either way: the last window is partial), and
/// no key more packets than were sent.
fn records_add_up(pipeline: &str, sends: Vec<Send>, sampling: u32) -> Result<(), TestCaseError> {
    let checked = dpuflow::lang::check_file(Path::new(pipeline)).expect("read");
    let mut program = checked.program.expect("valid pipeline");
    if let Some(ct) = &mut program.conntrack {
        ct.capacity = 64;
    }
    let mut engine = Engine::new(&program);
    program.telemetry.active_timeout = Duration::from_secs(2);
    program.telemetry.idle_timeout = Duration::from_secs(5);
    program.telemetry.sampling = sampling;
    program.telemetry.flow_cache = 1 << 10;
    engine.enable_flows(&program.telemetry);

    let mut sent: BTreeMap<Key, (u64, u64)> = BTreeMap::new();
    let mut records: Vec<FlowRecord> = Vec::new();
    let mut now = 1_000_000_000u64;
    let mut batch: Vec<PacketBuf> = Vec::new();
    let mut run = |engine: &mut Engine, batch: &mut Vec<PacketBuf>| {
        engine.process(batch, &mut NoObserver);
        batch.clear();
        engine.take_flow_records(&mut records);
    };
    for s in sends {
        now += STEPS_NS[s.step];
        let mut pkt = PacketBuf::new(512);
        prop_assert!(pkt.load(&s.frame, s.port, now));
        batch.push(pkt);
        let e = sent.entry(s.key).or_default();
        e.0 += 1;
        e.1 += s.ip_len;
        if batch.len() >= s.flush_after {
            run(&mut engine, &mut batch);
        }
    }
    run(&mut engine, &mut batch);
    engine.flush_flows(now, &mut records);

    // Packets per key: all records, and the sampled ones alone.
    let mut got: BTreeMap<Key, (u64, u64)> = BTreeMap::new();
    let mut sampled_packets = 0u64;
    for r in &records {
        let k = &r.key;
        let key = (
            (k.src as u32, k.dst as u32, k.sport, k.dport, k.proto),
            k.vni,
        );
        let e = got.entry(key).or_default();
        e.0 += r.packets;
        e.1 += r.bytes;
        prop_assert!(r.packets > 0, "an empty record: {:?}", r);
        prop_assert!(sampling > 1 || !r.sampled, "{:?}", r);
        if r.sampled {
            sampled_packets += r.packets;
        }
    }
    if sampling == 1 {
        prop_assert_eq!(got, sent);
    } else {
        for (key, (packets, _)) in &got {
            prop_assert!(sent.get(key).is_some_and(|s| s.0 >= *packets), "{:?}", key);
        }
        let all: u64 = sent.values().map(|s| s.0).sum();
        let offered = all - (got.values().map(|g| g.0).sum::<u64>() - sampled_packets);
        // One packet from each window of N, and perhaps one from the last, partial one.
        let n = u64::from(sampling);
        prop_assert!(
            sampled_packets == offered / n || sampled_packets == offered.div_ceil(n),
            "{} of {}",
            sampled_packets,
            offered
        );
    }
    let stats = engine.flow_stats().expect("flows kept");
    prop_assert_eq!(stats.records, records.len() as u64);
    prop_assert_eq!(stats.lost_records, 0);
    Ok(())
}

/// (conversation, reply, TCP flags, time step, payload, batch size)
fn packet() -> impl Strategy<Value = (usize, bool, usize, usize, usize, usize)> {
    (
        0usize..8,
        any::<bool>(),
        0..TCP_FLAGS.len(),
        0..STEPS_NS.len(),
        0usize..40,
        1usize..6,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn every_packet_is_in_one_record(
        packets in proptest::collection::vec(packet(), 1..300),
        sampling in prop_oneof![3 => Just(1u32), 1 => 2u32..5],
    ) {
        let sends = packets
            .into_iter()
            .map(|(n, reply, flags, step, payload, flush_after)| {
                let t = conversation(n);
                // A reply goes the other way, from the other side.
                let (t, port) = match (reply, t.0 >> 24 == 10) {
                    (false, inside) => (t, if inside { INSIDE } else { OUTSIDE }),
                    (true, inside) => ((t.1, t.0, t.3, t.2, t.4), if inside { OUTSIDE } else { INSIDE }),
                };
                let (frame, ip_len) = frame(t, TCP_FLAGS[flags], payload);
                Send { port, frame, key: (t, None), ip_len, step, flush_after }
            })
            .collect();
        records_add_up("pipelines/stateful-firewall.pipe", sends, sampling)?;
    }

    /// Connections tracked after decapsulation: their tunnelled packets are the flow
    /// cache's (keyed on the outer headers and the VNI), the host's replies the
    /// connection's; VNIs the pipeline does not take are dropped and still recorded.
    #[test]
    fn tunnelled_packets_are_recorded_as_they_arrived(
        packets in proptest::collection::vec((packet(), 0u16..3, any::<bool>()), 1..300),
        sampling in prop_oneof![3 => Just(1u32), 1 => 2u32..5],
    ) {
        let host = PortId(0);
        let uplink = PortId(1);
        let sends = packets
            .into_iter()
            .map(|((n, reply, flags, step, payload, flush_after), entropy, other_vni)| {
                let t = conversation(n % 2);
                if reply {
                    let t = (t.1, t.0, t.3, t.2, t.4);
                    let (frame, ip_len) = frame(t, TCP_FLAGS[flags], payload);
                    Send { port: host, frame, key: (t, None), ip_len, step, flush_after }
                } else {
                    let (inner, _) = frame(t, TCP_FLAGS[flags], payload);
                    let vni = if other_vni { 200 } else { 100 };
                    let (frame, outer, ip_len) = vxlan(&inner, vni, 49152 + entropy);
                    Send { port: uplink, frame, key: (outer, Some(vni)), ip_len, step, flush_after }
                }
            })
            .collect();
        records_add_up("tests/data/ct-after-decap.pipe", sends, sampling)?;
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A fragmented datagram counts in its flow, under the ports its first fragment carried
    /// (its later fragments carry none), through a stateless pipeline and through the
    /// stateful firewall (where connections count whole packets and the flow cache the
    /// fragments); also when the flow cache samples, and when a first fragment is not
    /// sampled but a later one is.
    #[test]
    fn fragments_count_in_their_datagrams_flow(
        packets in proptest::collection::vec((packet(), any::<bool>()), 1..200),
        stateful in any::<bool>(),
        sampling in prop_oneof![3 => Just(1u32), 1 => 2u32..5],
    ) {
        let mut ident = 0u16;
        let mut sends = Vec::new();
        for ((n, reply, flags, step, payload, flush_after), fragmented) in packets {
            let t = conversation(n);
            let (t, port) = match (reply, t.0 >> 24 == 10) {
                (false, inside) => (t, if inside { INSIDE } else { OUTSIDE }),
                (true, inside) => ((t.1, t.0, t.3, t.2, t.4), if inside { OUTSIDE } else { INSIDE }),
            };
            let port = if stateful { port } else { INSIDE };
            let (frame, ip_len) = frame(t, TCP_FLAGS[flags], payload);
            // A first fragment of 24 bytes holds a whole TCP or UDP header.
            let parts = if fragmented && ip_len > 20 + 24 {
                ident += 1;
                fragments(&frame, ident, 24)
            } else {
                vec![(frame, ip_len)]
            };
            for (i, (frame, ip_len)) in parts.into_iter().enumerate() {
                // A datagram's fragments come together, well within the reassembly time.
                let step = if i == 0 { step } else { 0 };
                sends.push(Send { port, frame, key: (t, None), ip_len, step, flush_after });
            }
        }
        let pipeline = if stateful {
            "pipelines/stateful-firewall.pipe"
        } else {
            "pipelines/vxlan-gateway.pipe"
        };
        records_add_up(pipeline, sends, sampling)?;
    }
}

/// Enough flows that the cache loads its lines ahead of each part (past 16k flows), with
/// every packet still counted in its own flow: 40k flows from the host through the VXLAN
/// gateway, each twice.
#[test]
fn many_flows_are_counted_exactly() {
    let checked =
        dpuflow::lang::check_file(Path::new("pipelines/vxlan-gateway.pipe")).expect("read");
    let mut program = checked.program.expect("valid pipeline");
    program.telemetry.idle_timeout = Duration::from_secs(60);
    let mut engine = Engine::new(&program);
    program.telemetry.flow_cache = 1 << 17;
    engine.enable_flows(&program.telemetry);
    const FLOWS: u32 = 40_000;
    let tuple = |i: u32| {
        (
            0x0a00_0001,
            0x0a01_0000 + (i >> 8),
            i as u16,
            80,
            ip_proto::UDP,
        )
    };
    let mut records = Vec::new();
    let mut now = 1_000_000_000u64;
    for _round in 0..2 {
        for first in (0..FLOWS).step_by(256) {
            let mut batch: Vec<PacketBuf> = (first..(first + 256).min(FLOWS))
                .map(|i| {
                    now += 100;
                    let mut pkt = PacketBuf::new(512);
                    assert!(pkt.load(&frame(tuple(i), 0, 10).0, PortId(0), now));
                    pkt
                })
                .collect();
            engine.process(&mut batch, &mut NoObserver);
            engine.take_flow_records(&mut records);
        }
    }
    engine.flush_flows(now, &mut records);
    let mut got: BTreeMap<Tuple, (u64, u64)> = BTreeMap::new();
    for r in &records {
        let k = &r.key;
        let e = got
            .entry((k.src as u32, k.dst as u32, k.sport, k.dport, k.proto))
            .or_default();
        e.0 += r.packets;
        e.1 += r.bytes;
    }
    let want: BTreeMap<Tuple, (u64, u64)> = (0..FLOWS).map(|i| (tuple(i), (2, 2 * 38))).collect();
    assert_eq!(got, want);
}

/// Engines sharing one compiled program, as the service's workers do, keep their own
/// connections and counters: the reply to a connection one of them saw open passes there
/// and is dropped by the other.
#[test]
fn engines_sharing_compiled_code_keep_their_own_state() {
    use dpuflow::engine::{Compiled, Verdict};
    use std::sync::Arc;
    let checked =
        dpuflow::lang::check_file(Path::new("pipelines/stateful-firewall.pipe")).expect("read");
    let program = checked.program.expect("valid pipeline");
    let code = Arc::new(Compiled::new(&program));
    let (mut a, mut b) = (Engine::sharing(Arc::clone(&code)), Engine::sharing(code));
    let send = |engine: &mut Engine, port: PortId, f: &[u8]| {
        let mut pkt = PacketBuf::new(512);
        assert!(pkt.load(f, port, 1_000_000_000));
        engine.process(std::slice::from_mut(&mut pkt), &mut NoObserver);
        pkt.verdict
    };
    let t = conversation(0);
    let reply = (t.1, t.0, t.3, t.2, t.4);
    assert!(matches!(
        send(&mut a, INSIDE, &frame(t, 0x02, 0).0),
        Verdict::Forward(_)
    ));
    let synack = frame(reply, 0x12, 0).0;
    assert!(matches!(
        send(&mut a, OUTSIDE, &synack),
        Verdict::Forward(_)
    ));
    assert!(matches!(send(&mut b, OUTSIDE, &synack), Verdict::Drop(_)));
    assert_eq!(a.stats().ports[INSIDE.index()].rx.packets, 1);
    assert_eq!(b.stats().ports[INSIDE.index()].rx.packets, 0);
}
