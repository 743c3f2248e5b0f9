//! A packet's connection key: the tuple it carries, canonical so that both directions
//! meet; ICMP queries keyed by their identifier, and ICMP errors by the packet they quote.

use super::{udplite_header_ok, Invalid};
use crate::engine::parse::{self, fragment_of, l4_fields, Layers, L3};
use crate::wire::{be16, icmp, ip_proto};

/// Canonical key: the smaller (address, port) endpoint first, so both directions agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Key {
    /// Addresses as two big-endian 64-bit halves (IPv4 in the low half), so comparing and
    /// hashing them is a few word operations.
    a: Addr,
    b: Addr,
    /// Both ports, the protocol, the zone and the address family in one word (see
    /// [`Key::new`]), so a key compares and hashes as five words. An ICMP query has no
    /// ports: its identifier and what tells queries apart take their place.
    rest: u64,
}

impl Key {
    /// The key of an empty slot (the slot's hash byte, not its key, tells it is empty).
    pub(super) const ZERO: Key = Key {
        a: [0; 2],
        b: [0; 2],
        rest: 0,
    };

    /// `kind` is [`Tuple::kind`]: the protocol, the address family (`v6` tells an IPv4
    /// address from the IPv6 address with the same low 32 bits, `::a.b.c.d`: they are
    /// different endpoints) and what tells ICMP queries of the same identifier apart.
    pub(super) fn new(a: Addr, port_a: u16, b: Addr, port_b: u16, kind: u64, zone: u16) -> Key {
        Key {
            a,
            b,
            rest: u64::from(port_a) << 48 | u64::from(port_b) << 32 | kind | u64::from(zone),
        }
    }

    /// The key as the five words it is hashed by.
    pub(super) fn words(&self) -> [u64; 5] {
        [self.a[0], self.a[1], self.b[0], self.b[1], self.rest]
    }

    /// Whether its addresses are IPv6, and its protocol.
    pub(super) fn family_and_protocol(&self) -> (bool, u8) {
        (self.rest >> 24 & 1 == 1, (self.rest >> 16) as u8)
    }

    /// Its two endpoints, address and port, in key order (an ICMP query's second "port"
    /// is its [`query_key`]).
    pub(super) fn endpoints(&self) -> [(Addr, u16); 2] {
        [
            (self.a, (self.rest >> 48) as u16),
            (self.b, (self.rest >> 32) as u16),
        ]
    }
}

/// [`Tuple::kind`] of a packet of protocol `proto` in family `v6`.
pub(super) fn tuple_kind(proto: u8, v6: bool) -> u64 {
    u64::from(v6) << 24 | u64::from(proto) << 16
}

/// [`Tuple::kind`]'s part for an ICMP query: its identifier and [`query_key`] where a
/// key's ports go (a query's ports are zero).
fn icmp_query_kind(id: u16, query: u16) -> u64 {
    u64::from(id) << 48 | u64::from(query) << 32
}

/// The fields conntrack keys on, read from the outer headers.
#[derive(Debug, Clone, Copy)]
pub(super) struct Tuple {
    pub(super) v6: bool,
    pub(super) src: Addr,
    pub(super) dst: Addr,
    pub(super) sport: u16,
    pub(super) dport: u16,
    pub(super) proto: u8,
    pub(super) tcp_flags: u8,
    /// What the connection key takes besides addresses, ports and zone, in one word
    /// ([`tuple_kind`], and an ICMP query's [`icmp_query_kind`]): a word written whole
    /// and read whole, where separate bytes read back together stalled each lookup (12 %).
    pub(super) kind: u64,
    /// An ICMP query that asks (a request), not one that answers.
    pub(super) icmp_request: bool,
    /// An ICMP message's type and code (type × 256 + code), for its flow record.
    pub(super) icmp_type_code: u16,
    /// For ICMP errors: where the quoted packet starts.
    pub(super) icmp_error: Option<u16>,
    /// For a fragment: whether it is its datagram's first (which carries the L4 header;
    /// the others take their ports from it, see
    /// [`Fragments`](crate::firewall::fragments::Fragments)).
    pub(super) fragment: Option<bool>,
}

impl Tuple {
    /// A tuple of protocol `proto` from `src` to `dst`, its ports and the rest still to
    /// be read.
    fn between(v6: bool, src: Addr, dst: Addr, proto: u8) -> Tuple {
        Tuple {
            v6,
            src,
            dst,
            sport: 0,
            dport: 0,
            proto,
            kind: tuple_kind(proto, v6),
            tcp_flags: 0,
            icmp_request: false,
            icmp_type_code: 0,
            icmp_error: None,
            fragment: None,
        }
    }
}

/// An IPv4 or IPv6 address as two big-endian 64-bit halves.
pub(super) type Addr = [u64; 2];

#[inline(always)]
fn addr(b: &[u8]) -> Addr {
    match b.len() {
        4 => [
            0,
            u64::from(u32::from_be_bytes(b.try_into().expect("4 bytes"))),
        ],
        _ => [
            u64::from_be_bytes(b[..8].try_into().expect("8 bytes")),
            u64::from_be_bytes(b[8..16].try_into().expect("8 bytes")),
        ],
    }
}

/// Inlined: returned through memory, the tuple's fields written one by one would be read
/// back at once by wider loads, which stall until the stores complete.
#[inline(always)]
pub(super) fn tuple(frame: &[u8], l: &Layers) -> Result<Tuple, NoTuple> {
    let l3 = usize::from(l.l3);
    let (src, dst) = match l.l3_kind {
        L3::V4 => (
            addr(&frame[l3 + 12..l3 + 16]),
            addr(&frame[l3 + 16..l3 + 20]),
        ),
        L3::V6 => (
            addr(&frame[l3 + 8..l3 + 24]),
            addr(&frame[l3 + 24..l3 + 40]),
        ),
        L3::None => return Err(NoTuple::Invalid(Invalid::Headers)),
    };
    let mut t = Tuple::between(l.l3_kind == L3::V6, src, dst, l.proto);
    let l4 = usize::from(l.l4);
    if l.fragment {
        let first = first_fragment(frame, l).ok_or(NoTuple::Invalid(Invalid::Headers))?;
        t.fragment = Some(first);
        if !first {
            return Ok(t);
        }
    } else if !l.l4_ok {
        return Ok(t);
    }
    match l.proto {
        ip_proto::TCP => {
            t.sport = be16(frame, l4);
            t.dport = be16(frame, l4 + 2);
            t.tcp_flags = frame[l4 + 13];
        }
        ip_proto::UDP | ip_proto::SCTP => {
            t.sport = be16(frame, l4);
            t.dport = be16(frame, l4 + 2);
        }
        ip_proto::ICMP | ip_proto::ICMPV6 => {
            let (kind, v6) = (frame[l4], l.proto == ip_proto::ICMPV6);
            t.icmp_type_code = be16(frame, l4);
            // One load says what the type is: branches on the type would be mispredicted
            // where queries of both families mix.
            let what = ICMP_TYPES[usize::from(v6)][usize::from(kind)];
            if what & ICMP_QUERY != 0 {
                // A query and its answer share a connection keyed by the identifier, the
                // query's kind and its code; the ports stay zero, so the canonical key is
                // the same either way.
                let query = query_key(usize::from(what & ICMP_KIND), frame[l4 + 1]);
                t.kind |= icmp_query_kind(be16(frame, l4 + 4), query);
                t.icmp_request = what & ICMP_REQUEST != 0;
            } else if what & ICMP_ERROR != 0 {
                t.icmp_error = Some(l.l4.saturating_add(icmp::HEADER_LEN as u16));
            } else if what & ICMP_UNTRACKED != 0 {
                return Err(NoTuple::Untracked);
            } else {
                return Err(NoTuple::Invalid(Invalid::IcmpType));
            }
        }
        // UDP-Lite in the arm of the rest: in an arm of its own, or UDP's, or checked in
        // `lookup` or out of line, it cost UDP and TCP 3 to 18 instructions a packet.
        _ if l.proto == ip_proto::UDPLITE => {
            if !udplite_header_ok(frame, l) {
                return Err(NoTuple::Invalid(Invalid::UdpliteHeader));
            }
            t.sport = be16(frame, l4);
            t.dport = be16(frame, l4 + 2);
        }
        _ => {}
    }
    Ok(t)
}

/// Why a packet has no connection tuple.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoTuple {
    Invalid(Invalid),
    /// It is not tracked ([`CtState::Untracked`](super::CtState::Untracked)).
    Untracked,
}

/// ICMP queries tracked as connections, as Linux tracks them (nf_conntrack_proto_icmp.c):
/// (request, reply) types of echo, timestamp and information (RFC 792) and address mask
/// (RFC 950).
const ICMP_QUERIES: [(u8, u8); 4] = [(8, 0), (13, 14), (15, 16), (17, 18)];

// What an ICMP type is, by family ([`ICMP_TYPES`]): a query (its kind in the low bits,
// and whether it asks), an error, or untracked.
const ICMP_KIND: u8 = 0b11;
const ICMP_REQUEST: u8 = 0x04;
const ICMP_QUERY: u8 = 0x08;
const ICMP_ERROR: u8 = 0x10;
const ICMP_UNTRACKED: u8 = 0x20;

/// [`ICMP_KIND`] and the rest for each ICMP type, IPv4 first: errors are destination
/// unreachable, source quench, redirect, time exceeded and parameter problem (RFC 792);
/// for ICMPv6 destination unreachable, packet too big, time exceeded and parameter
/// problem (RFC 4443).
const ICMP_TYPES: [[u8; 256]; 2] = {
    let mut t = [[0u8; 256]; 2];
    let mut v6 = 0;
    while v6 < 2 {
        let queries: &[(u8, u8)] = if v6 == 1 {
            &ICMPV6_QUERIES
        } else {
            &ICMP_QUERIES
        };
        let mut q = 0;
        while q < queries.len() {
            let (req, rep) = queries[q];
            t[v6][req as usize] = ICMP_QUERY | ICMP_REQUEST | q as u8;
            t[v6][rep as usize] = ICMP_QUERY | q as u8;
            q += 1;
        }
        v6 += 1;
    }
    let mut i = 0;
    while i < 256 {
        if icmp::is_error(false, i as u8) {
            t[0][i] = ICMP_ERROR;
        }
        if icmp::is_error(true, i as u8) {
            t[1][i] = ICMP_ERROR;
        }
        i += 1;
    }
    let mut i = 0;
    while i < UNTRACKED_ICMPV6.len() {
        t[1][UNTRACKED_ICMPV6[i] as usize] = ICMP_UNTRACKED;
        i += 1;
    }
    t
};

/// What besides the identifier tells ICMP queries apart, as Linux's tuple does with the
/// type and code: the kind `q` (an index into [`ICMP_QUERIES`] or [`ICMPV6_QUERIES`]) in
/// the low two bits, the code above. A reply whose code differs from its query's meets no
/// connection, as in Linux (a node information reply, say).
fn query_key(q: usize, code: u8) -> u16 {
    (q as u16 & 0b11) | u16::from(code) << 2
}

/// The type and code (type × 256 + code) of an ICMP query of [`query_key`] `query`: its
/// request's type, or its reply's.
pub(super) fn query_type_code(v6: bool, query: u16, request: bool) -> u16 {
    let queries: &[(u8, u8)] = if v6 { &ICMPV6_QUERIES } else { &ICMP_QUERIES };
    let (ask, answer) = queries
        .get(usize::from(query & 0b11))
        .copied()
        .unwrap_or_default();
    let kind = if request { ask } else { answer };
    u16::from(kind) << 8 | query >> 2
}

/// ICMPv6 queries tracked as connections (nf_conntrack_proto_icmpv6.c): echo (RFC 4443
/// §4) and node information (RFC 4620).
const ICMPV6_QUERIES: [(u8, u8); 2] = [(128, 129), (139, 140)];

/// ICMPv6 types Linux leaves untracked (nf_conntrack_proto_icmpv6.c, `noct_valid_new`):
/// multicast listener query, report and done (RFC 2710 §3), router and neighbour
/// solicitation and advertisement (RFC 4861 §4), MLDv2 report (RFC 3810 §5.2).
const UNTRACKED_ICMPV6: [u8; 8] = [130, 131, 132, 133, 134, 135, 136, 143];

/// Whether a fragment is its datagram's first; `None` for a first fragment without its
/// whole L4 header, which is judged by none (RFC 1858's tiny fragments): invalid. Out of
/// line: fragments are rare.
#[cold]
#[inline(never)]
pub(super) fn first_fragment(frame: &[u8], l: &Layers) -> Option<bool> {
    let (_, first) = fragment_of(frame, l)?;
    (!first || l4_fields(frame, l)).then_some(first)
}

/// The tuple of the packet an ICMP error quotes (its IP header and first 8 L4 bytes).
pub(super) fn quoted_tuple(frame: &[u8], l: &Layers, at: usize) -> Option<Tuple> {
    let quote = parse::quote_at(frame, l, at)?;
    let (q, proto) = (&frame[at..], quote.proto);
    let (src, dst) = match l.l3_kind {
        L3::V4 => (addr(&q[12..16]), addr(&q[16..20])),
        _ => (addr(&q[8..24]), addr(&q[24..40])),
    };
    let l4 = usize::from(quote.l4);
    let ports = frame[..usize::from(l.l3_end)].get(l4..l4 + 8)?;
    let mut t = Tuple::between(l.l3_kind == L3::V6, src, dst, proto);
    match proto {
        ip_proto::TCP | ip_proto::UDP | ip_proto::SCTP | ip_proto::UDPLITE => {
            t.sport = u16::from_be_bytes([ports[0], ports[1]]);
            t.dport = u16::from_be_bytes([ports[2], ports[3]]);
        }
        ip_proto::ICMP | ip_proto::ICMPV6 => {
            let id = u16::from_be_bytes([ports[4], ports[5]]);
            let what = ICMP_TYPES[usize::from(t.v6)][usize::from(ports[0])];
            t.kind |= icmp_query_kind(id, query_key(usize::from(what & ICMP_KIND), ports[1]));
        }
        _ => {}
    }
    Some(t)
}

#[inline(always)]
pub(super) fn canonical(t: &Tuple, zone: u16) -> (Key, bool) {
    let from_a = (t.src, t.sport) <= (t.dst, t.dport);
    let (a, pa, b, pb) = if from_a {
        (t.src, t.sport, t.dst, t.dport)
    } else {
        (t.dst, t.dport, t.src, t.sport)
    };
    (Key::new(a, pa, b, pb, t.kind, zone), from_a)
}
