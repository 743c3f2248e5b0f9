//! Which worker a packet goes to when several run: by a symmetric hash of its flow, so
//! that both directions of a connection meet in one worker's connection table. A tunnelled
//! packet goes by the flow inside (a pipeline that decapsulates tracks that flow, whose
//! other direction may arrive untunnelled); an ICMP error by the packet it quotes (to that
//! packet's connection); a datagram's later fragments, which carry no ports, where its
//! first went.
//!
//! The choice is made in two places that must agree: [`pick`], where the I/O thread
//! deals packets to the workers, and [`KernelSteering`], the same choice as an eBPF
//! program that the kernel runs for each frame of a port whose workers each hold a socket
//! in its fanout group (PACKET_FANOUT_EBPF, packet(7)): the program's result indexes the
//! group's members in the order they joined, worker 0 first. A test runs the program
//! against [`pick`] over many frames (BPF_PROG_TEST_RUN).

use crate::engine::parse::{self, fragment_of, Meta, TunnelPorts};
use crate::firewall::fragments::{self, Fragments};
use crate::ir::Tunnel;
use crate::sys::bpf::{self, Alu, Asm, Cond, Label, MapType, ProgType, Size, Src};
use crate::sys::bpf::{FP, R0, R1, R2, R3, R4, R6, R7, R8, R9};
use crate::wire::{ethernet::ethertype, icmp, ip_proto};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// The worker of a flow hash: the hash scaled onto `0..workers` with one multiply, where
/// a remainder by a count known only at run time is a division, tens of cycles a packet.
pub fn worker_of(hash: u32, workers: usize) -> usize {
    ((u64::from(hash) * workers as u64) >> 32) as usize
}

/// The worker of `workers` for the packet `frame`, parsed into `meta`, at time `now_ns`;
/// `fragments` holds where recent datagrams' first fragments went.
pub fn pick(
    frame: &[u8],
    meta: &Meta,
    fragments: &mut Fragments<u16>,
    now_ns: u64,
    workers: usize,
) -> usize {
    let flow = if meta.tunnel.is_some() {
        &meta.inner
    } else {
        &meta.outer
    };
    let by_hash = |ports: bool| worker_of(parse::flow_hash_of(frame, flow, ports), workers);
    if !flow.fragment {
        // An ICMP error goes where the packet it quotes would, to that packet's
        // connection (hashed on its own addresses, it met it once in the number of
        // workers, and a related error found no connection: invalid).
        if let Some(quoted) = parse::quoted_layers(frame, flow) {
            return worker_of(parse::flow_hash_of(frame, &quoted, quoted.l4_ok), workers);
        }
        return by_hash(flow.l4_ok);
    }
    // A first fragment goes by its flow, ports included (where it holds them), as the
    // flow's whole packets do.
    match fragment_of(frame, flow) {
        Some((datagram, true)) => {
            let ports = usize::from(flow.l4) + 4 <= usize::from(flow.l3_end);
            let w = by_hash(ports);
            fragments.note(datagram, w as u16, now_ns);
            w
        }
        Some((datagram, false)) => fragments
            .first(&datagram, now_ns)
            .map_or_else(|| by_hash(false), usize::from),
        None => by_hash(false),
    }
}

/// Datagrams whose first fragment's worker the program remembers at once (the least
/// recently used gives way).
const FRAGMENT_ENTRIES: u32 = 4096;

/// [`pick`] as an eBPF socket-filter program for a fanout group of `workers` members, with
/// its map of first fragments. Packets [`pick`] never sees (those the parser refuses, which
/// the engine drops) may go to any worker.
#[derive(Debug)]
pub struct KernelSteering {
    program: OwnedFd,
    _fragments: OwnedFd,
}

impl KernelSteering {
    /// Writes and loads the program for `workers` workers and the pipeline's tunnel ports.
    pub fn load(workers: usize, tunnels: &TunnelPorts) -> std::io::Result<KernelSteering> {
        let fragments = bpf::create_map(
            MapType::LruHash,
            KEY_LEN as u32,
            16,
            FRAGMENT_ENTRIES,
            "dpuflow_frags",
        )?;
        let code = program(workers, tunnels, fragments.as_fd());
        let program = bpf::load(ProgType::SocketFilter, &code, "dpuflow_fanout")?;
        Ok(KernelSteering {
            program,
            _fragments: fragments,
        })
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.program.as_fd()
    }
}

// The program's variables: 8-byte slots below the frame pointer, each written before it
// is read (the verifier refuses a read of stack never written).
/// The packet's length from its network header.
const LEN: i16 = -8;
/// EtherType after any VLAN tags.
const ET: i16 = -16;
/// The flow's layers (outer, or inner after a tunnel), as offsets from the network
/// header of the outer packet: IP header, its kind (4, 6 or 0 for not IP), end, upper
/// protocol, whether a fragment, L4 header, a fragment's identification and whether the
/// L4 header is present (not a later fragment).
const L3: i16 = -24;
const KIND: i16 = -32;
const END: i16 = -40;
const PROTO: i16 = -48;
const FRAG: i16 = -56;
const L4: i16 = -64;
const IDENT: i16 = -72;
const PRESENT: i16 = -80;
/// Where the layers being parsed must end (the packet's, or a tunnel's outer end).
const BUFEND: i16 = -88;
/// What the hash reads: IP header, protocol, L4 header, and whether to read ports.
const H_L3: i16 = -96;
const H_PROTO: i16 = -104;
const H_L4: i16 = -112;
const H_PORTS: i16 = -120;
/// Whether the worker is noted for a first fragment's datagram.
const NOTE: i16 = -128;
/// Where an IPv6 header chain's walk must end.
const WEND: i16 = -136;
/// Scratch: a walk's step, a quoted packet's fragment fields.
const TMP: i16 = -144;
const Q_FRAG: i16 = -152;
const Q_IDENT: i16 = -160;
const Q_PRESENT: i16 = -168;
/// The fragments map's key (addresses as eight words, then identification, protocol
/// and family) and value (worker, time noted).
const KEY: i16 = -208;
const KEY_LEN: usize = 40;
const VALUE: i16 = -224;
/// The hashed packet's addresses, as they are in the packet.
const ADDRESSES: i16 = -264;
/// Where the common frame's headers are copied so that its addresses land on
/// `ADDRESSES`: an IPv4 header of 20 bytes and its ports, or an IPv6 header and its ports.
const V4_COPY: i16 = ADDRESSES - 12;
const V6_COPY: i16 = ADDRESSES - 8;
/// Where the hashed ports are: in the packet at `H_L4` (0), or copied after an IPv4
/// (1) or IPv6 (2) header.
const PORTS_AT: i16 = -280;
/// Where a VXLAN frame's inner Ethernet header is copied, so that the IPv4 header after
/// it lands on `V4_COPY` (over `PORTS_AT`, which is set after the copy).
const INNER_COPY: i16 = V4_COPY - 14;
const STACK: i16 = PORTS_AT;

/// Where a walk of an IPv6 header chain puts what it found.
struct WalkOut {
    proto: i16,
    l4: i16,
    frag: i16,
    ident: i16,
    present: i16,
}

/// Writes the program. Registers: R6 the context (packet loads need it there), R7–R9
/// working values; R0–R5 are clobbered by every packet load and call.
fn program(workers: usize, tunnels: &TunnelPorts, fragments: BorrowedFd) -> Vec<bpf::Insn> {
    let mut a = Asm::default();
    let refuse = a.label();
    a.mov(R6, Src::X(R1));
    // struct __sk_buff: len at 0, protocol (network byte order) at 16.
    a.load(Size::W, R0, R6, 0);
    a.store(Size::DW, FP, LEN, Src::X(R0));
    a.load(Size::W, R0, R6, 16);
    a.from_be(R0, 16);
    a.store(Size::DW, FP, ET, Src::X(R0));
    let (general, copied) = (a.label(), a.label());
    common_frame(&mut a, tunnels, general, copied);
    a.bind(general);
    // The general path's slots zeroed (the verifier refuses a read of stack never
    // written), but for the length and EtherType set above.
    for slot in (STACK..ET).step_by(8) {
        a.store(Size::DW, FP, slot, Src::K(0));
    }
    a.load(Size::DW, R0, FP, LEN);
    a.store(Size::DW, FP, BUFEND, Src::X(R0));
    a.mov(R7, Src::K(0));
    layers(&mut a, refuse);

    // A tunnel: the outer packet is a whole UDP datagram to a tunnel port.
    let flow = a.label();
    a.load(Size::DW, R0, FP, KIND);
    a.jump_if(Cond::Eq, R0, Src::K(0), flow);
    a.load(Size::DW, R0, FP, FRAG);
    a.jump_if(Cond::Ne, R0, Src::K(0), flow);
    a.load(Size::DW, R0, FP, PROTO);
    a.jump_if(Cond::Ne, R0, Src::K(i32::from(ip_proto::UDP)), flow);
    a.load(Size::DW, R7, FP, L4);
    a.load_packet(Size::H, R7, 2);
    let (vxlan, geneve) = (a.label(), a.label());
    for (port, kind) in tunnels.ports() {
        let to = if kind == Tunnel::Vxlan { vxlan } else { geneve };
        a.jump_if(Cond::Eq, R0, Src::K(i32::from(port)), to);
    }
    a.goto(flow);
    let inner = a.label();
    a.bind(vxlan);
    // RFC 7348 §5: UDP header, VXLAN header (8 bytes), inner Ethernet.
    a.mov(R8, Src::X(R7));
    a.alu(Alu::Add, R8, Src::K(16));
    a.goto(inner);
    a.bind(geneve);
    // RFC 8926 §3.4: version (0) and options length in 4-byte words, then the protocol
    // of the payload, which must be Ethernet.
    a.load_packet(Size::B, R7, 8);
    a.mov(R8, Src::X(R0));
    a.alu(Alu::Rsh, R8, Src::K(6));
    a.jump_if(Cond::Ne, R8, Src::K(0), refuse);
    a.alu(Alu::And, R0, Src::K(0x3f));
    a.alu(Alu::Lsh, R0, Src::K(2));
    a.mov(R8, Src::X(R7));
    a.alu(Alu::Add, R8, Src::X(R0));
    a.alu(Alu::Add, R8, Src::K(16));
    a.load_packet(Size::H, R7, 10);
    a.jump_if(Cond::Ne, R0, Src::K(i32::from(ethertype::TEB)), refuse);
    a.bind(inner);
    // The inner frame, within the outer packet: R8 its Ethernet header.
    a.load(Size::DW, R0, FP, END);
    a.store(Size::DW, FP, BUFEND, Src::X(R0));
    a.load_packet(Size::H, R8, 12);
    a.store(Size::DW, FP, ET, Src::X(R0));
    a.mov(R7, Src::X(R8));
    a.alu(Alu::Add, R7, Src::K(14));
    a.store(Size::DW, FP, FRAG, Src::K(0));
    layers(&mut a, refuse);

    a.bind(flow);
    let (hash, worker, plain, quote, fragment) =
        (a.label(), a.label(), a.label(), a.label(), a.label());
    let not_ip = a.label();
    a.load(Size::DW, R0, FP, KIND);
    a.jump_if(Cond::Eq, R0, Src::K(0), not_ip);
    a.load(Size::DW, R0, FP, FRAG);
    a.jump_if(Cond::Ne, R0, Src::K(0), fragment);
    // An ICMP error (RFC 792, RFC 4443 §2.1) goes by the packet it quotes.
    a.load(Size::DW, R0, FP, PROTO);
    let icmp_type = a.label();
    a.jump_if(Cond::Eq, R0, Src::K(i32::from(ip_proto::ICMP)), icmp_type);
    a.jump_if(Cond::Ne, R0, Src::K(i32::from(ip_proto::ICMPV6)), plain);
    a.bind(icmp_type);
    a.load(Size::DW, R7, FP, L4);
    a.load_packet(Size::B, R7, 0);
    let v6_type = a.label();
    a.load(Size::DW, R1, FP, KIND);
    a.jump_if(Cond::Eq, R1, Src::K(6), v6_type);
    for t in (0..=255u8).filter(|&t| icmp::is_error(false, t)) {
        a.jump_if(Cond::Eq, R0, Src::K(i32::from(t)), quote);
    }
    a.goto(plain);
    a.bind(v6_type);
    for t in (0..=255u8).filter(|&t| icmp::is_error(true, t)) {
        a.jump_if(Cond::Eq, R0, Src::K(i32::from(t)), quote);
    }
    a.bind(plain);
    // The flow's own addresses and ports.
    hash_the_flow(&mut a);
    a.store(Size::DW, FP, H_PORTS, Src::K(1));
    a.goto(hash);

    a.bind(not_ip);
    // Not IP: by its EtherType, as `flow_hash_of` hashes it.
    a.load(Size::DW, R9, FP, ET);
    a.goto(worker);

    quoted(&mut a, quote, plain, hash);
    first_fragments(&mut a, fragment, hash, fragments);
    flow_hash(&mut a, hash, copied, refuse);
    a.bind(worker);
    a.alu(Alu::Mul, R9, Src::K(workers as i32));
    a.alu(Alu::Rsh, R9, Src::K(32));
    let done = a.label();
    a.load(Size::DW, R0, FP, NOTE);
    a.jump_if(Cond::Eq, R0, Src::K(0), done);
    // A first fragment: its datagram's later fragments follow it.
    a.store(Size::DW, FP, VALUE, Src::X(R9));
    a.call(bpf::KTIME_GET_NS);
    a.store(Size::DW, FP, VALUE + 8, Src::X(R0));
    a.map(R1, fragments);
    a.mov(R2, Src::X(FP));
    a.alu(Alu::Add, R2, Src::K(i32::from(KEY)));
    a.mov(R3, Src::X(FP));
    a.alu(Alu::Add, R3, Src::K(i32::from(VALUE)));
    a.mov(R4, Src::K(0));
    a.call(bpf::MAP_UPDATE_ELEM);
    a.bind(done);
    a.mov(R0, Src::X(R9));
    a.exit();

    // A packet the parser refuses is dropped by whichever worker has it.
    a.bind(refuse);
    a.mov(R0, Src::K(0));
    a.exit();
    a.finish()
}

/// The common frame, hashed from one copy of its headers (a load apiece is a call
/// apiece): an IPv4 header of 20 bytes or an IPv6 header with no extension header, not a
/// fragment, not ICMP, to no tunnel port, whose transport header's first word is within
/// the packet (IPv6: of TCP, UDP, SCTP or UDP-Lite); and such a packet in VXLAN or
/// Geneve over such an IPv4 or IPv6 one, from one or two more copies. Jumps to `copied` in the hash with its
/// slots set; anything else, or a frame the parser would refuse in a way this does not
/// look for (it goes to any worker then), to `general`.
fn common_frame(a: &mut Asm, tunnels: &TunnelPorts, general: Label, copied: Label) {
    let (v6, transport) = (a.label(), a.label());
    let (vxlan, geneve) = (a.label(), a.label());
    a.load(Size::DW, R7, FP, ET);
    a.jump_if(Cond::Eq, R7, Src::K(i32::from(ethertype::IPV6)), v6);
    a.jump_if(Cond::Ne, R7, Src::K(i32::from(ethertype::IPV4)), general);
    copy_headers(a, Src::K(0), V4_COPY, 24, general);
    // Its 24 bytes within the packet's length too.
    copied_v4(a, R8, general);
    a.load(Size::DW, R1, FP, LEN);
    a.jump_if(Cond::Gt, R8, Src::X(R1), general);
    a.store(Size::DW, FP, KIND, Src::K(4));
    a.store(Size::DW, FP, PORTS_AT, Src::K(1));
    a.load(Size::H, R0, FP, V4_COPY + 22);
    a.goto(transport);

    a.bind(v6);
    copy_headers(a, Src::K(0), V6_COPY, 44, general);
    // Within the packet's length too.
    copied_v6(a, R8, general);
    a.load(Size::DW, R1, FP, LEN);
    a.jump_if(Cond::Gt, R8, Src::X(R1), general);
    a.store(Size::DW, FP, KIND, Src::K(6));
    a.store(Size::DW, FP, PORTS_AT, Src::K(2));
    a.load(Size::H, R0, FP, V6_COPY + 42);

    // R0: the destination port (as copied), R9: the protocol, R8 an IPv4 packet's length.
    a.bind(transport);
    a.from_be(R0, 16);
    let hashed = a.label();
    a.jump_if(Cond::Ne, R9, Src::K(i32::from(ip_proto::UDP)), hashed);
    for (port, kind) in tunnels.ports() {
        let to = match kind {
            Tunnel::Vxlan => vxlan,
            Tunnel::Geneve => geneve,
        };
        a.jump_if(Cond::Eq, R0, Src::K(i32::from(port)), to);
    }
    a.bind(hashed);
    a.store(Size::DW, FP, H_PROTO, Src::X(R9));
    a.store(Size::DW, FP, H_PORTS, Src::K(1));
    a.store(Size::DW, FP, NOTE, Src::K(0));
    a.goto(copied);

    // A tunnel carrying IP as the common frame has it, within the outer packet: hashed
    // by the inner flow from one more copy.
    let tunnel = a.label();
    a.bind(vxlan);
    // RFC 7348 §5: UDP and VXLAN headers, 8 bytes each, then the inner Ethernet frame.
    a.mov(R9, Src::K(8 + 8));
    a.goto(tunnel);
    a.bind(geneve);
    // RFC 8926 §3.4: after the UDP header, version (0) and options length in 4-byte
    // words, then the payload's protocol, which must be Ethernet; 8 bytes and the
    // options.
    outer_header_len(a);
    a.alu(Alu::Add, R7, Src::K(8));
    copy_headers(a, Src::X(R7), TMP, 4, general);
    a.load(Size::B, R9, FP, TMP);
    a.jump_if(Cond::Gt, R9, Src::K(0x3f), general);
    a.alu(Alu::Lsh, R9, Src::K(2));
    a.alu(Alu::Add, R9, Src::K(8 + 8));
    a.load(Size::H, R0, FP, TMP + 2);
    a.from_be(R0, 16);
    a.jump_if(Cond::Ne, R0, Src::K(i32::from(ethertype::TEB)), general);
    a.bind(tunnel);
    // R9: the UDP and tunnel headers' length, after which the inner frame starts.
    outer_header_len(a);
    a.alu(Alu::Add, R7, Src::X(R9));
    tunnelled(a, general, hashed);
}

/// The outer IP header's length, 20 or 40 as the copied header's family, into R7.
fn outer_header_len(a: &mut Asm) {
    let v4 = a.label();
    a.mov(R7, Src::K(20));
    a.load(Size::DW, R0, FP, KIND);
    a.jump_if(Cond::Eq, R0, Src::K(4), v4);
    a.mov(R7, Src::K(40));
    a.bind(v4);
}

/// The IP packet in the tunnel's inner Ethernet frame at R7 (R8 the outer packet's
/// length), copied and checked as the common frame is, within the outer packet; jumps
/// to `hashed` with its slots set, or to `general`.
fn tunnelled(a: &mut Asm, general: Label, hashed: Label) {
    // As much as an IPv4 packet needs (a short one is common); an IPv6 one is copied
    // again, whole, where its addresses land on `ADDRESSES`.
    copy_headers(a, Src::X(R7), INNER_COPY, 14 + 24, general);
    a.alu(Alu::Add, R7, Src::K(14));
    let v6 = a.label();
    a.load(Size::H, R0, FP, INNER_COPY + 12);
    a.from_be(R0, 16);
    a.jump_if(Cond::Eq, R0, Src::K(i32::from(ethertype::IPV6)), v6);
    a.jump_if(Cond::Ne, R0, Src::K(i32::from(ethertype::IPV4)), general);
    copied_v4(a, R0, general);
    inner_copied(a, 4, general, hashed);
    a.bind(v6);
    copy_headers(a, Src::X(R7), V6_COPY, 44, general);
    copied_v6(a, R0, general);
    inner_copied(a, 6, general, hashed);
}

/// The inner packet of IP version `kind`, its length in R0 from R7, within the outer
/// packet's R8: hashed from its copy, or to `general`.
fn inner_copied(a: &mut Asm, kind: i32, general: Label, hashed: Label) {
    a.alu(Alu::Add, R0, Src::X(R7));
    a.jump_if(Cond::Gt, R0, Src::X(R8), general);
    a.store(Size::DW, FP, KIND, Src::K(kind));
    // The ports copied after an IPv4 header (1) or an IPv6 one (2).
    let ports_at = if kind == 4 { 1 } else { 2 };
    a.store(Size::DW, FP, PORTS_AT, Src::K(ports_at));
    a.goto(hashed);
}

/// Checks the IPv6 header copied to `V6_COPY` as the short path takes it: version 6, the
/// transport header next (TCP, UDP, SCTP or UDP-Lite, its protocol into R9) and its first
/// word within the payload; the packet's length into `len`. Jumps to `general` otherwise.
fn copied_v6(a: &mut Asm, len: bpf::Reg, general: Label) {
    a.load(Size::B, R0, FP, V6_COPY);
    a.alu(Alu::Rsh, R0, Src::K(4));
    a.jump_if(Cond::Ne, R0, Src::K(6), general);
    a.load(Size::B, R9, FP, V6_COPY + 6);
    let ported = a.label();
    for p in (0..=255u8).filter(|&p| ip_proto::has_ports(p)) {
        a.jump_if(Cond::Eq, R9, Src::K(i32::from(p)), ported);
    }
    a.goto(general);
    a.bind(ported);
    a.load(Size::H, len, FP, V6_COPY + 4);
    a.from_be(len, 16);
    a.jump_if(Cond::Lt, len, Src::K(4), general);
    a.alu(Alu::Add, len, Src::K(40));
}

/// Checks the IPv4 header copied to `V4_COPY` as the short path takes it: version 4 and
/// 20 bytes, not a fragment, at least 24 bytes long (its length into `len`), not ICMP
/// (its protocol into R9); jumps to `general` otherwise.
fn copied_v4(a: &mut Asm, len: bpf::Reg, general: Label) {
    a.load(Size::B, R0, FP, V4_COPY);
    a.jump_if(Cond::Ne, R0, Src::K(0x45), general);
    a.load(Size::H, R0, FP, V4_COPY + 6);
    a.from_be(R0, 16);
    a.jump_if(Cond::Set, R0, Src::K(0x3fff), general);
    a.load(Size::H, len, FP, V4_COPY + 2);
    a.from_be(len, 16);
    a.jump_if(Cond::Lt, len, Src::K(24), general);
    a.load(Size::B, R9, FP, V4_COPY + 9);
    a.jump_if(Cond::Eq, R9, Src::K(i32::from(ip_proto::ICMP)), general);
    a.jump_if(Cond::Eq, R9, Src::K(i32::from(ip_proto::ICMPV6)), general);
}

/// Copies `bytes` of the packet from `from` bytes past its network header to `to`;
/// jumps to `general` where it is shorter.
fn copy_headers(a: &mut Asm, from: Src, to: i16, bytes: i32, general: Label) {
    a.mov(R2, from);
    a.mov(R1, Src::X(R6));
    a.mov(R3, Src::X(FP));
    a.alu(Alu::Add, R3, Src::K(i32::from(to)));
    a.mov(R4, Src::K(bytes));
    a.call(bpf::SKB_LOAD_BYTES);
    a.jump_if(Cond::Ne, R0, Src::K(0), general);
}

/// Points the hash at the flow's own headers (whether it reads ports is the caller's).
fn hash_the_flow(a: &mut Asm) {
    for (from, to) in [(L3, H_L3), (PROTO, H_PROTO), (L4, H_L4)] {
        a.load(Size::DW, R0, FP, from);
        a.store(Size::DW, FP, to, Src::X(R0));
    }
}

/// Has the hash read ports where the first word at `H_L4` lies within the flow's `END`
/// (a quote or a first fragment may be cut before them).
fn ports_within(a: &mut Asm) {
    let cut = a.label();
    a.store(Size::DW, FP, H_PORTS, Src::K(0));
    a.load(Size::DW, R0, FP, H_L4);
    a.alu(Alu::Add, R0, Src::K(4));
    a.load(Size::DW, R1, FP, END);
    a.jump_if(Cond::Gt, R0, Src::X(R1), cut);
    a.store(Size::DW, FP, H_PORTS, Src::K(1));
    a.bind(cut);
}

/// One stack of layers, as `parse::layers` reads it: R7 at the first byte after the
/// Ethernet header, `ET` its EtherType; VLAN tags, then IPv4 or IPv6 into the flow's
/// slots, within `BUFEND`. A header the parser would refuse jumps to `refuse`.
fn layers(a: &mut Asm, refuse: Label) {
    let tags_done = a.label();
    for _ in 0..3 {
        let tag = a.label();
        a.load(Size::DW, R0, FP, ET);
        a.jump_if(Cond::Eq, R0, Src::K(i32::from(ethertype::VLAN)), tag);
        a.jump_if(Cond::Ne, R0, Src::K(i32::from(ethertype::QINQ)), tags_done);
        a.bind(tag);
        a.load_packet(Size::H, R7, 2);
        a.store(Size::DW, FP, ET, Src::X(R0));
        a.alu(Alu::Add, R7, Src::K(4));
    }
    a.bind(tags_done);
    a.store(Size::DW, FP, L3, Src::X(R7));
    let (v4, v6, done) = (a.label(), a.label(), a.label());
    a.load(Size::DW, R0, FP, ET);
    a.jump_if(Cond::Eq, R0, Src::K(i32::from(ethertype::IPV4)), v4);
    a.jump_if(Cond::Eq, R0, Src::K(i32::from(ethertype::IPV6)), v6);
    a.store(Size::DW, FP, KIND, Src::K(0));
    a.goto(done);

    // RFC 791 §3.1: version, header length and total length in the first word;
    // fragment field and protocol in the word from byte 6.
    a.bind(v4);
    a.load_packet(Size::W, R7, 0);
    a.mov(R9, Src::X(R0));
    a.alu(Alu::And, R9, Src::K(0xffff));
    a.mov(R8, Src::X(R0));
    a.alu(Alu::Rsh, R8, Src::K(24));
    a.alu(Alu::Rsh, R0, Src::K(28));
    a.jump_if(Cond::Ne, R0, Src::K(4), refuse);
    a.alu(Alu::And, R8, Src::K(0x0f));
    a.alu(Alu::Lsh, R8, Src::K(2));
    a.jump_if(Cond::Lt, R8, Src::K(20), refuse);
    a.jump_if(Cond::Lt, R9, Src::X(R8), refuse);
    a.alu(Alu::Add, R9, Src::X(R7));
    a.load(Size::DW, R1, FP, BUFEND);
    a.jump_if(Cond::Gt, R9, Src::X(R1), refuse);
    a.store(Size::DW, FP, END, Src::X(R9));
    a.alu(Alu::Add, R8, Src::X(R7));
    a.store(Size::DW, FP, L4, Src::X(R8));
    a.store(Size::DW, FP, KIND, Src::K(4));
    a.load_packet(Size::W, R7, 6);
    a.mov(R1, Src::X(R0));
    a.alu(Alu::And, R1, Src::K(0xff));
    a.store(Size::DW, FP, PROTO, Src::X(R1));
    // More fragments, or an offset: a fragment.
    a.alu(Alu::Rsh, R0, Src::K(16));
    a.alu(Alu::And, R0, Src::K(0x3fff));
    let whole = a.label();
    a.store(Size::DW, FP, FRAG, Src::K(0));
    a.jump_if(Cond::Eq, R0, Src::K(0), whole);
    a.store(Size::DW, FP, FRAG, Src::K(1));
    a.bind(whole);
    a.goto(done);

    // RFC 8200 §3.
    a.bind(v6);
    a.mov(R0, Src::X(R7));
    a.alu(Alu::Add, R0, Src::K(40));
    a.load(Size::DW, R1, FP, BUFEND);
    a.jump_if(Cond::Gt, R0, Src::X(R1), refuse);
    a.load_packet(Size::B, R7, 0);
    a.alu(Alu::Rsh, R0, Src::K(4));
    a.jump_if(Cond::Ne, R0, Src::K(6), refuse);
    a.load_packet(Size::H, R7, 4);
    a.alu(Alu::Add, R0, Src::X(R7));
    a.alu(Alu::Add, R0, Src::K(40));
    a.load(Size::DW, R1, FP, BUFEND);
    a.jump_if(Cond::Gt, R0, Src::X(R1), refuse);
    a.store(Size::DW, FP, END, Src::X(R0));
    a.store(Size::DW, FP, WEND, Src::X(R0));
    a.store(Size::DW, FP, KIND, Src::K(6));
    let out = WalkOut {
        proto: PROTO,
        l4: L4,
        frag: FRAG,
        ident: IDENT,
        present: PRESENT,
    };
    walk_v6(a, L3, &out, refuse, done);
    a.bind(done);
}

/// Walks the IPv6 header chain of the header at slot `base`, within `WEND`, as
/// `ipv6::Packet::upper_layer` does (hop-by-hop, routing, destination options, fragment
/// and AH headers, eight at most), into `out`; then jumps to `done`, or to `fail` where
/// the walk fails.
fn walk_v6(a: &mut Asm, base: i16, out: &WalkOut, fail: Label, done: Label) {
    a.store(Size::DW, FP, out.frag, Src::K(0));
    a.store(Size::DW, FP, out.ident, Src::K(0));
    a.load(Size::DW, R8, FP, base);
    a.load_packet(Size::B, R8, 6);
    a.mov(R9, Src::X(R0));
    a.alu(Alu::Add, R8, Src::K(40));
    // R8: where the next header starts; R9: its protocol number.
    for _ in 0..8 {
        let (options, fragment, ah, next) = (a.label(), a.label(), a.label(), a.label());
        for p in [
            ip_proto::HOP_BY_HOP,
            ip_proto::IPV6_ROUTING,
            ip_proto::IPV6_DEST_OPTS,
        ] {
            a.jump_if(Cond::Eq, R9, Src::K(i32::from(p)), options);
        }
        a.jump_if(
            Cond::Eq,
            R9,
            Src::K(i32::from(ip_proto::IPV6_FRAGMENT)),
            fragment,
        );
        a.jump_if(Cond::Eq, R9, Src::K(i32::from(ip_proto::AH)), ah);
        // The upper layer.
        a.load(Size::DW, R1, FP, WEND);
        a.jump_if(Cond::Gt, R8, Src::X(R1), fail);
        a.store(Size::DW, FP, out.proto, Src::X(R9));
        a.store(Size::DW, FP, out.l4, Src::X(R8));
        a.store(Size::DW, FP, out.present, Src::K(1));
        a.goto(done);

        // Options headers: (length + 1) × 8 bytes (RFC 8200 §4.3–4.6).
        a.bind(options);
        skip_sized(a, 1, 3, fail);
        a.goto(next);

        // Authentication header: (length + 2) × 4 bytes (RFC 4302 §2.2).
        a.bind(ah);
        skip_sized(a, 2, 2, fail);
        a.goto(next);

        // Fragment header (RFC 8200 §4.5): a later fragment's chain ends here.
        a.bind(fragment);
        need(a, 8, fail);
        a.store(Size::DW, FP, out.frag, Src::K(1));
        a.load_packet(Size::W, R8, 4);
        a.store(Size::DW, FP, out.ident, Src::X(R0));
        a.load_packet(Size::H, R8, 2);
        let later = a.label();
        a.jump_if(Cond::Set, R0, Src::K(0xfff8), later);
        a.store(Size::DW, FP, TMP, Src::K(8));
        step(a);
        a.goto(next);
        a.bind(later);
        a.load_packet(Size::B, R8, 0);
        a.store(Size::DW, FP, out.proto, Src::X(R0));
        a.alu(Alu::Add, R8, Src::K(8));
        a.store(Size::DW, FP, out.l4, Src::X(R8));
        a.store(Size::DW, FP, out.present, Src::K(0));
        a.goto(done);
        a.bind(next);
    }
    a.goto(fail);
}

/// Steps the walk over the header at R8 whose second byte says its length: (that + `plus`)
/// << `shift` bytes. Jumps to `fail` where the two bytes are not within `WEND`.
fn skip_sized(a: &mut Asm, plus: i32, shift: i32, fail: Label) {
    need(a, 2, fail);
    a.load_packet(Size::B, R8, 1);
    a.alu(Alu::Add, R0, Src::K(plus));
    a.alu(Alu::Lsh, R0, Src::K(shift));
    a.store(Size::DW, FP, TMP, Src::X(R0));
    step(a);
}

/// Jumps to `fail` unless `bytes` from R8 lie within `WEND`.
fn need(a: &mut Asm, bytes: i32, fail: Label) {
    a.mov(R0, Src::X(R8));
    a.alu(Alu::Add, R0, Src::K(bytes));
    a.load(Size::DW, R1, FP, WEND);
    a.jump_if(Cond::Gt, R0, Src::X(R1), fail);
}

/// Steps the walk over the header at R8 of `TMP` bytes: R9 the next protocol, from the
/// header's first byte.
fn step(a: &mut Asm) {
    a.load_packet(Size::B, R8, 0);
    a.mov(R9, Src::X(R0));
    a.load(Size::DW, R0, FP, TMP);
    a.alu(Alu::Add, R8, Src::X(R0));
}

/// At `quote`: an ICMP error's quoted packet, as `parse::quote_at` reads it, into the
/// hash's slots; `plain` where it has none.
fn quoted(a: &mut Asm, quote: Label, plain: Label, hash: Label) {
    a.bind(quote);
    let (v6, found) = (a.label(), a.label());
    // R8: the quote's IP header, after the ICMP header's 8 bytes; R9: the flow's end.
    a.load(Size::DW, R8, FP, L4);
    a.alu(Alu::Add, R8, Src::K(8));
    a.load(Size::DW, R9, FP, END);
    a.store(Size::DW, FP, H_L3, Src::X(R8));
    a.load(Size::DW, R0, FP, KIND);
    a.jump_if(Cond::Eq, R0, Src::K(6), v6);
    // IPv4: a whole header, and a first fragment (or a whole datagram).
    a.jump_if(Cond::Ge, R8, Src::X(R9), plain);
    a.load_packet(Size::B, R8, 0);
    a.mov(R1, Src::X(R0));
    a.alu(Alu::Rsh, R1, Src::K(4));
    a.jump_if(Cond::Ne, R1, Src::K(4), plain);
    a.alu(Alu::And, R0, Src::K(0x0f));
    a.alu(Alu::Lsh, R0, Src::K(2));
    a.jump_if(Cond::Lt, R0, Src::K(20), plain);
    a.mov(R1, Src::X(R9));
    a.alu(Alu::Sub, R1, Src::X(R8));
    a.jump_if(Cond::Lt, R1, Src::X(R0), plain);
    a.alu(Alu::Add, R0, Src::X(R8));
    a.store(Size::DW, FP, H_L4, Src::X(R0));
    a.load_packet(Size::H, R8, 6);
    a.jump_if(Cond::Set, R0, Src::K(0x1fff), plain);
    a.load_packet(Size::B, R8, 9);
    a.store(Size::DW, FP, H_PROTO, Src::X(R0));
    a.goto(found);

    // IPv6: a whole fixed header, its chain walked within the quote.
    a.bind(v6);
    a.mov(R0, Src::X(R8));
    a.alu(Alu::Add, R0, Src::K(40));
    a.jump_if(Cond::Gt, R0, Src::X(R9), plain);
    a.load_packet(Size::B, R8, 0);
    a.alu(Alu::Rsh, R0, Src::K(4));
    a.jump_if(Cond::Ne, R0, Src::K(6), plain);
    a.load_packet(Size::H, R8, 4);
    a.alu(Alu::Add, R0, Src::X(R8));
    a.alu(Alu::Add, R0, Src::K(40));
    let within = a.label();
    a.load(Size::DW, R1, FP, END);
    a.jump_if(Cond::Le, R0, Src::X(R1), within);
    a.mov(R0, Src::X(R1));
    a.bind(within);
    a.store(Size::DW, FP, WEND, Src::X(R0));
    let out = WalkOut {
        proto: H_PROTO,
        l4: H_L4,
        frag: Q_FRAG,
        ident: Q_IDENT,
        present: Q_PRESENT,
    };
    let walked = a.label();
    walk_v6(a, H_L3, &out, plain, walked);
    a.bind(walked);
    a.load(Size::DW, R0, FP, Q_PRESENT);
    a.jump_if(Cond::Eq, R0, Src::K(0), plain);

    a.bind(found);
    // Its ports, where the quote holds them.
    ports_within(a);
    a.goto(hash);
}

/// At `fragment`: the flow's datagram as its key in the fragments map; a first fragment
/// goes by its flow (ports included where it holds them) and is noted, a later one where
/// its first went, or by its addresses.
fn first_fragments(a: &mut Asm, fragment: Label, hash: Label, map: BorrowedFd) {
    a.bind(fragment);
    let (v6, keyed, later, unknown) = (a.label(), a.label(), a.label(), a.label());
    a.load(Size::DW, R7, FP, L3);
    a.load(Size::DW, R0, FP, KIND);
    a.jump_if(Cond::Eq, R0, Src::K(6), v6);
    // IPv4 (RFC 791 §3.2, RFC 6864 §4): addresses, protocol and identification.
    for (i, at) in [12, 16].into_iter().enumerate() {
        a.load_packet(Size::W, R7, at);
        a.store(Size::W, FP, KEY + 4 * i as i16, Src::X(R0));
    }
    a.load_packet(Size::H, R7, 4);
    a.load(Size::DW, R1, FP, PROTO);
    a.alu(Alu::Lsh, R1, Src::K(32));
    a.alu(Alu::Or, R0, Src::X(R1));
    a.store(Size::DW, FP, KEY + 32, Src::X(R0));
    a.load_packet(Size::H, R7, 6);
    a.jump_if(Cond::Set, R0, Src::K(0x1fff), later);
    a.goto(keyed);
    // IPv6 (RFC 8200 §4.5): addresses and identification.
    a.bind(v6);
    for i in 0..8 {
        a.load_packet(Size::W, R7, 8 + 4 * i);
        a.store(Size::W, FP, KEY + 4 * i as i16, Src::X(R0));
    }
    a.load(Size::DW, R0, FP, IDENT);
    a.mov(R1, Src::K(1));
    a.alu(Alu::Lsh, R1, Src::K(40));
    a.alu(Alu::Or, R0, Src::X(R1));
    a.store(Size::DW, FP, KEY + 32, Src::X(R0));
    a.load(Size::DW, R0, FP, PRESENT);
    a.jump_if(Cond::Eq, R0, Src::K(0), later);

    a.bind(keyed);
    // The first fragment.
    hash_the_flow(a);
    ports_within(a);
    a.store(Size::DW, FP, NOTE, Src::K(1));
    a.goto(hash);

    a.bind(later);
    a.map(R1, map);
    a.mov(R2, Src::X(FP));
    a.alu(Alu::Add, R2, Src::K(i32::from(KEY)));
    a.call(bpf::MAP_LOOKUP_ELEM);
    a.jump_if(Cond::Eq, R0, Src::K(0), unknown);
    a.load(Size::DW, R8, R0, 0);
    a.load(Size::DW, R9, R0, 8);
    a.call(bpf::KTIME_GET_NS);
    a.jump_if(Cond::Lt, R0, Src::X(R9), unknown);
    a.alu(Alu::Sub, R0, Src::X(R9));
    // As long as the dealer remembers one.
    a.imm64(R1, fragments::TIMEOUT_NS);
    a.jump_if(Cond::Gt, R0, Src::X(R1), unknown);
    a.mov(R0, Src::X(R8));
    a.exit();
    a.bind(unknown);
    hash_the_flow(a);
    a.store(Size::DW, FP, H_PORTS, Src::K(0));
    a.goto(hash);
}

/// At `hash`: `parse::flow_hash_of` of the hash's slots, into R9; falls through to the
/// worker's choice.
fn flow_hash(a: &mut Asm, hash: Label, copied: Label, refuse: Label) {
    a.bind(hash);
    let (v6, mixed, ordered, no_ports, ports_ordered) =
        (a.label(), a.label(), a.label(), a.label(), a.label());
    // The addresses copied out in one call (a load apiece is a call apiece).
    let (at, bytes) = (a.label(), a.label());
    a.load(Size::DW, R2, FP, H_L3);
    a.load(Size::DW, R0, FP, KIND);
    a.mov(R4, Src::K(32));
    a.alu(Alu::Add, R2, Src::K(8));
    a.jump_if(Cond::Eq, R0, Src::K(6), at);
    a.mov(R4, Src::K(8));
    a.alu(Alu::Add, R2, Src::K(4));
    a.bind(at);
    a.mov(R1, Src::X(R6));
    a.mov(R3, Src::X(FP));
    a.alu(Alu::Add, R3, Src::K(i32::from(ADDRESSES)));
    a.call(bpf::SKB_LOAD_BYTES);
    a.jump_if(Cond::Ne, R0, Src::K(0), refuse);
    a.bind(copied);
    a.load(Size::DW, R0, FP, KIND);
    a.jump_if(Cond::Eq, R0, Src::K(6), v6);
    a.load(Size::W, R8, FP, ADDRESSES);
    a.load(Size::W, R9, FP, ADDRESSES + 4);
    a.goto(bytes);
    // Each IPv6 address folded to a word by xoring its four (in either byte order).
    a.bind(v6);
    for (reg, at) in [(R8, ADDRESSES), (R9, ADDRESSES + 16)] {
        a.load(Size::W, reg, FP, at);
        for k in 1..4 {
            a.load(Size::W, R0, FP, at + 4 * k);
            a.alu(Alu::Xor, reg, Src::X(R0));
        }
    }
    a.bind(bytes);
    a.from_be(R8, 32);
    a.from_be(R9, 32);
    a.bind(mixed);
    // The addresses ordered, so both directions hash the same.
    a.jump_if(Cond::Le, R8, Src::X(R9), ordered);
    a.mov(R1, Src::X(R8));
    a.mov(R8, Src::X(R9));
    a.mov(R9, Src::X(R1));
    a.bind(ordered);
    a.alu(Alu::Lsh, R8, Src::K(32));
    a.alu(Alu::Or, R8, Src::X(R9));
    // The ports, ordered likewise, where they are read.
    a.mov(R9, Src::K(0));
    a.load(Size::DW, R0, FP, H_PORTS);
    a.jump_if(Cond::Eq, R0, Src::K(0), no_ports);
    a.load(Size::DW, R0, FP, H_PROTO);
    let has_ports = a.label();
    for p in (0..=255u8).filter(|&p| ip_proto::has_ports(p)) {
        a.jump_if(Cond::Eq, R0, Src::K(i32::from(p)), has_ports);
    }
    a.goto(no_ports);
    a.bind(has_ports);
    let (word, v6_word) = (a.label(), a.label());
    a.load(Size::DW, R0, FP, PORTS_AT);
    a.jump_if(Cond::Eq, R0, Src::K(2), v6_word);
    a.jump_if(Cond::Eq, R0, Src::K(1), word);
    a.load(Size::DW, R7, FP, H_L4);
    a.load_packet(Size::W, R7, 0);
    let loaded = a.label();
    a.goto(loaded);
    a.bind(v6_word);
    a.load(Size::W, R0, FP, ADDRESSES + 32);
    a.from_be(R0, 32);
    a.goto(loaded);
    a.bind(word);
    a.load(Size::W, R0, FP, ADDRESSES + 8);
    a.from_be(R0, 32);
    a.bind(loaded);
    a.mov(R1, Src::X(R0));
    a.alu(Alu::Rsh, R1, Src::K(16));
    a.mov(R2, Src::X(R0));
    a.alu(Alu::And, R2, Src::K(0xffff));
    a.jump_if(Cond::Le, R1, Src::X(R2), ports_ordered);
    a.mov(R3, Src::X(R1));
    a.mov(R1, Src::X(R2));
    a.mov(R2, Src::X(R3));
    a.bind(ports_ordered);
    a.alu(Alu::Lsh, R1, Src::K(16));
    a.alu(Alu::Or, R1, Src::X(R2));
    a.mov(R9, Src::X(R1));
    a.bind(no_ports);
    a.load(Size::DW, R0, FP, H_PROTO);
    a.alu(Alu::Lsh, R0, Src::K(40));
    a.alu(Alu::Or, R9, Src::X(R0));
    // rotate_left(17), then `parse::mix`, folded to 32 bits.
    a.mov(R1, Src::X(R9));
    a.alu(Alu::Lsh, R1, Src::K(17));
    a.alu(Alu::Rsh, R9, Src::K(47));
    a.alu(Alu::Or, R9, Src::X(R1));
    a.alu(Alu::Xor, R8, Src::X(R9));
    a.mov(R1, Src::X(R8));
    a.alu(Alu::Rsh, R1, Src::K(32));
    a.alu(Alu::Xor, R8, Src::X(R1));
    a.imm64(R1, parse::MIX_MULTIPLIER);
    a.alu(Alu::Mul, R8, Src::X(R1));
    a.mov(R1, Src::X(R8));
    a.alu(Alu::Rsh, R1, Src::K(29));
    a.alu(Alu::Xor, R8, Src::X(R1));
    a.mov(R1, Src::X(R8));
    a.alu(Alu::Rsh, R1, Src::K(32));
    a.alu(Alu::Lsh, R8, Src::K(32));
    a.alu(Alu::Rsh, R8, Src::K(32));
    a.alu(Alu::Xor, R8, Src::X(R1));
    a.mov(R9, Src::X(R8));
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::{frame, ip_frame};
    use proptest::prelude::*;
    use std::sync::{Mutex, OnceLock, PoisonError};

    #[test]
    fn flows_spread_evenly_over_workers() {
        let hashes: Vec<u32> = (1024u16..1024 + 4096)
            .map(|p| {
                let f = frame(
                    false,
                    0x0a00_0001,
                    0x0a01_0001,
                    ip_proto::UDP,
                    p,
                    5001,
                    0,
                    0,
                );
                let m = parse::parse(&f, &Default::default()).expect("parses");
                parse::flow_hash(&f, &m.outer)
            })
            .collect();
        for workers in [2usize, 3, 4, 7, 16] {
            let mut n = vec![0usize; workers];
            for h in &hashes {
                n[worker_of(*h, workers)] += 1;
            }
            let share = hashes.len() / workers;
            assert!(
                n.iter().all(|&k| k > share * 8 / 10 && k < share * 12 / 10),
                "{workers} workers: {n:?}"
            );
        }
    }

    /// The transport header of a test packet: ports for the protocols that have them.
    fn transport(proto: u8, sport: u16, dport: u16) -> Vec<u8> {
        let mut h = vec![0u8; if proto == ip_proto::TCP { 20 } else { 12 }];
        h[0..2].copy_from_slice(&sport.to_be_bytes());
        h[2..4].copy_from_slice(&dport.to_be_bytes());
        match proto {
            ip_proto::TCP => h[12] = 0x50,
            ip_proto::UDP | ip_proto::UDPLITE => h[4..6].copy_from_slice(&12u16.to_be_bytes()),
            // An echo request (RFC 792, RFC 4443 §4.1).
            ip_proto::ICMP => h[0] = 8,
            ip_proto::ICMPV6 => h[0] = 128,
            _ => {}
        }
        h
    }

    /// A UDP datagram carrying `payload`.
    fn udp(sport: u16, dport: u16, payload: &[u8]) -> Vec<u8> {
        let mut h = vec![0u8; 8];
        h[0..2].copy_from_slice(&sport.to_be_bytes());
        h[2..4].copy_from_slice(&dport.to_be_bytes());
        h[4..6].copy_from_slice(&(8 + payload.len() as u16).to_be_bytes());
        h.extend_from_slice(payload);
        h
    }

    /// How a test packet is wrapped, inside out.
    #[derive(Debug, Clone)]
    struct Shape {
        v6: bool,
        src: u128,
        dst: u128,
        proto: u8,
        sport: u16,
        dport: u16,
        /// IPv6 extension headers before the transport header: none, hop-by-hop,
        /// destination options and routing, AH.
        extensions: u8,
        /// Not a fragment, a first fragment then a later one, or a later one alone.
        fragment: u8,
        ident: u16,
        /// Quoted by an ICMP error (or other ICMP message) of this type, cut to so many
        /// bytes.
        quoted: Option<(u8, usize)>,
        /// Carried in VXLAN, Geneve (with so many words of options) or VXLAN on the
        /// pipeline's own port, over IPv6 or IPv4.
        tunnel: Option<(u8, u8, bool)>,
        tags: usize,
        /// A byte overwritten, anywhere.
        mutation: Option<(usize, u8)>,
    }

    /// The frames of a shape, in the order they arrive.
    fn frames(s: &Shape) -> Vec<Vec<u8>> {
        let l4 = transport(s.proto, s.sport, s.dport);
        // IPv6 extension headers: (next header, bytes) in order.
        let mut chain: Vec<(u8, Vec<u8>)> = Vec::new();
        if s.v6 {
            match s.extensions % 4 {
                1 => chain.push((ip_proto::HOP_BY_HOP, vec![0; 8])),
                2 => {
                    chain.push((
                        ip_proto::IPV6_DEST_OPTS,
                        vec![0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
                    ));
                    chain.push((ip_proto::IPV6_ROUTING, vec![0; 8]));
                }
                3 => chain.push((ip_proto::AH, vec![0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0])),
                _ => {}
            }
        }
        let packet = |fragment: Option<(bool, &[u8])>| -> Vec<u8> {
            let mut chain = chain.clone();
            let mut body = l4.clone();
            let mut v4_frag = None;
            if let Some((first, data)) = fragment {
                if !first {
                    body = data.to_vec();
                }
                if s.v6 {
                    let offset: u16 = if first { 1 } else { 8 << 3 | 1 };
                    let mut h = vec![0u8; 8];
                    h[2..4].copy_from_slice(&offset.to_be_bytes());
                    h[4..8].copy_from_slice(&u32::from(s.ident).to_be_bytes());
                    chain.push((ip_proto::IPV6_FRAGMENT, h));
                } else {
                    v4_frag = Some(if first { 0x2000u16 } else { 0x2008 });
                }
            }
            // Each header's first byte names the next.
            let mut payload = Vec::new();
            let first_proto = chain.first().map_or(s.proto, |c| c.0);
            for (i, (_, h)) in chain.iter().enumerate() {
                let mut h = h.clone();
                h[0] = chain.get(i + 1).map_or(s.proto, |c| c.0);
                payload.extend_from_slice(&h);
            }
            payload.extend_from_slice(&body);
            let mut f = ip_frame(s.v6, s.src, s.dst, first_proto, 0, &payload);
            if let Some(field) = v4_frag {
                f[14 + 4..14 + 6].copy_from_slice(&s.ident.to_be_bytes());
                f[14 + 6..14 + 8].copy_from_slice(&field.to_be_bytes());
            }
            f
        };
        let mut out = match s.fragment % 3 {
            1 => vec![packet(Some((true, &[]))), packet(Some((false, &[7; 16])))],
            2 => vec![packet(Some((false, &[7; 16])))],
            _ => vec![packet(None)],
        };
        for f in &mut out {
            if let Some((kind, cut)) = s.quoted {
                // From a router, to the packet's source.
                let mut icmp = vec![kind, 0, 0, 0, 0, 0, 0, 0];
                let ip = &f[14..];
                icmp.extend_from_slice(&ip[..cut.min(ip.len())]);
                let proto = if s.v6 {
                    ip_proto::ICMPV6
                } else {
                    ip_proto::ICMP
                };
                *f = ip_frame(s.v6, s.dst ^ 0xff, s.src, proto, 0, &icmp);
            }
            if let Some((kind, options, outer_v6)) = s.tunnel {
                let (port, header) = match kind % 3 {
                    0 => (4789, vec![0x08, 0, 0, 0, 0, 0, 0x2a, 0]),
                    1 => {
                        let mut h = vec![options % 4, 0, 0x65, 0x58, 0, 0, 0x2a, 0];
                        h.extend(std::iter::repeat_n(0u8, usize::from(options % 4) * 4));
                        (6081, h)
                    }
                    _ => (8472, vec![0x08, 0, 0, 0, 0, 0, 0x2a, 0]),
                };
                let mut inner = header;
                inner.extend_from_slice(f);
                let datagram = udp(s.sport ^ 0x5555, port, &inner);
                *f = ip_frame(
                    outer_v6,
                    0xc0a8_0001,
                    0xc0a8_0002,
                    ip_proto::UDP,
                    0,
                    &datagram,
                );
            }
            for _ in 0..s.tags {
                f.splice(12..12, [0x81, 0x00, 0x00, 0x64]);
            }
            if let Some((at, byte)) = s.mutation {
                let at = at % f.len();
                f[at] = byte;
            }
        }
        out
    }

    fn shapes() -> impl Strategy<Value = Shape> {
        let protos = prop::sample::select(vec![
            ip_proto::TCP,
            ip_proto::UDP,
            ip_proto::SCTP,
            ip_proto::UDPLITE,
            ip_proto::ICMP,
            ip_proto::ICMPV6,
            ip_proto::GRE,
        ]);
        let kinds = prop::sample::select(vec![3u8, 11, 0, 8, 1, 2, 4, 128, 129]);
        (
            (
                any::<bool>(),
                any::<u128>(),
                any::<u128>(),
                protos,
                any::<u16>(),
                any::<u16>(),
            ),
            (0..4u8, 0..3u8, any::<u16>()),
            prop::option::of((kinds, 0..80usize)),
            prop::option::of((any::<u8>(), any::<u8>(), any::<bool>())),
            0..3usize,
            prop::option::weighted(0.3, (any::<usize>(), any::<u8>())),
        )
            .prop_map(
                |(
                    (v6, src, dst, proto, sport, dport),
                    (extensions, fragment, ident),
                    quoted,
                    tunnel,
                    tags,
                    mutation,
                )| {
                    let (src, dst) = if v6 {
                        (src, dst)
                    } else {
                        (src & 0xffff_ffff, dst & 0xffff_ffff)
                    };
                    Shape {
                        v6,
                        src,
                        dst,
                        proto,
                        sport,
                        dport,
                        extensions,
                        fragment,
                        ident,
                        quoted,
                        tunnel,
                        tags,
                        mutation,
                    }
                },
            )
    }

    /// The tunnel ports of the tests' pipeline: the IANA ports and VXLAN on 8472.
    fn tunnels() -> TunnelPorts {
        let mut t = TunnelPorts::default();
        t.add(8472, Tunnel::Vxlan);
        t
    }

    /// Per worker count, the program and the dealer's memory of first fragments, kept
    /// across cases as a service keeps them across packets.
    type Pair = (usize, KernelSteering, Fragments<u16>);

    fn steered(workers: usize, frame: &[u8]) -> Option<(usize, usize)> {
        static PAIRS: OnceLock<Mutex<Vec<Pair>>> = OnceLock::new();
        let pairs = PAIRS.get_or_init(|| {
            let pairs = [2, 3, 4, 7].map(|n| {
                let k = KernelSteering::load(n, &tunnels())
                    .expect("the steering program loads (as root)");
                (n, k, Fragments::default())
            });
            Mutex::new(pairs.into())
        });
        let mut pairs = pairs.lock().unwrap_or_else(PoisonError::into_inner);
        let (_, kernel, fragments) = pairs.iter_mut().find(|p| p.0 == workers)?;
        let ran = bpf::test_run(kernel.fd(), frame).expect("the program runs");
        let meta = parse::parse(frame, &tunnels()).ok()?;
        Some((pick(frame, &meta, fragments, 1, workers), ran as usize))
    }

    /// The short path's tunnels, which the random shapes meet only now and then: VXLAN
    /// (on its port and the pipeline's) and Geneve with 0 to 3 words of options, over
    /// either family carrying either, for many flows.
    #[test]
    fn tunnelled_frames_go_where_the_dealer_sends_them() {
        for i in 0..960u32 {
            let x = u128::from(i.wrapping_mul(0x9e37_79b9));
            let (outer_v6, v6) = (i % 2 == 1, i / 2 % 2 == 1);
            let shape = Shape {
                v6,
                src: if v6 { x << 64 | x } else { x & 0xffff_ffff },
                dst: if v6 { !x } else { !x & 0xffff_ffff },
                proto: [ip_proto::TCP, ip_proto::UDP][(i / 4 % 2) as usize],
                sport: i as u16,
                dport: (i >> 3) as u16 ^ 0x1f90,
                extensions: 0,
                fragment: 0,
                ident: 0,
                quoted: None,
                tunnel: Some(((i / 8 % 3) as u8, (i / 24 % 4) as u8, outer_v6)),
                tags: 0,
                mutation: None,
            };
            for f in frames(&shape) {
                for workers in [2, 3, 4, 7] {
                    let (dealt, kernel) = steered(workers, &f).expect("parsed");
                    assert_eq!(dealt, kernel, "frame {f:02x?}");
                }
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(2000))]

        /// The kernel's program sends every packet the engine parses where the dealer
        /// would: tunnelled or not, tagged, fragmented, quoted by ICMP errors, with IPv6
        /// extension headers, and with any byte changed.
        #[test]
        fn the_kernel_steers_as_the_dealer_does(shape in shapes(), workers in prop::sample::select(vec![2usize, 3, 4, 7])) {
            for f in frames(&shape) {
                // A frame the parser refuses (the engine drops it) may still be noted as
                // a first fragment by the kernel, not by the dealer: the later fragments
                // of its datagram go where either likes.
                let Some((dealt, kernel)) = steered(workers, &f) else {
                    break;
                };
                prop_assert_eq!(dealt, kernel, "frame {:02x?}", f);
            }
        }
    }
}
