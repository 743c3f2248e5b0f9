//! Parsing a frame once into [`Meta`]: where each layer starts, what it is, the tunnel it
//! carries, and a flow hash. Field reads then index the frame directly.

use super::DropReason;
use crate::ir::Tunnel;
use crate::wire::ethernet::{self, ethertype};
use crate::wire::{
    be128, be16, be32, be64, checksum, geneve, icmp, ip_proto, ipv4, ipv6, tcp, udp, vlan, vxlan,
};

/// VLAN tags followed at most (802.1ad + 802.1Q, and one more to be lenient).
const MAX_VLAN_TAGS: usize = 3;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum L3 {
    #[default]
    None,
    V4,
    V6,
}

/// Where one stack of headers (outer, or inner after a tunnel) lies in the frame.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Layers {
    /// Offset of the Ethernet header.
    pub l2: u16,
    /// Offset of the outermost VLAN tag's TCI, or 0 when untagged.
    pub vlan: u16,
    /// EtherType after any VLAN tags.
    pub ethertype: u16,
    pub l3: u16,
    pub l3_kind: L3,
    /// End of the IP packet (frames may carry padding after it).
    pub l3_end: u16,
    /// IPv4 protocol or IPv6 upper-layer protocol.
    pub proto: u8,
    pub fragment: bool,
    pub l4: u16,
    /// The L4 header (TCP, UDP, ICMP, ICMPv6) is present and whole.
    pub l4_ok: bool,
}

/// The tunnel a packet carries, when its outer UDP port is a tunnel port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TunnelInfo {
    pub kind: Tunnel,
    pub vni: u32,
    /// Offset of the tunnel header (VXLAN or Geneve).
    pub header: u16,
    /// Offset of the inner Ethernet frame.
    pub inner: u16,
}

/// Per-packet metadata.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Meta {
    pub outer: Layers,
    pub tunnel: Option<TunnelInfo>,
    /// Valid when `tunnel` is set.
    pub inner: Layers,
}

/// Which UDP destination ports carry which tunnel: the IANA ports, plus any other port
/// an encapsulation of the pipeline uses.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TunnelPorts {
    extra: Vec<(u16, Tunnel)>,
}

impl TunnelPorts {
    pub fn add(&mut self, port: u16, kind: Tunnel) {
        if port != kind.default_port() && !self.extra.iter().any(|&(p, _)| p == port) {
            self.extra.push((port, kind));
        }
    }

    /// Every port that carries a tunnel, and which.
    pub fn ports(&self) -> impl Iterator<Item = (u16, Tunnel)> + '_ {
        [Tunnel::Vxlan, Tunnel::Geneve]
            .into_iter()
            .map(|k| (k.default_port(), k))
            .chain(self.extra.iter().copied())
    }

    #[inline]
    fn kind(&self, port: u16) -> Option<Tunnel> {
        match port {
            4789 => Some(Tunnel::Vxlan),
            6081 => Some(Tunnel::Geneve),
            _ if self.extra.is_empty() => None,
            _ => self
                .extra
                .iter()
                .find(|&&(p, _)| p == port)
                .map(|&(_, k)| k),
        }
    }
}

/// Parses `frame` (starting at offset 0).
pub fn parse(frame: &[u8], tunnels: &TunnelPorts) -> Result<Meta, DropReason> {
    let mut meta = Meta::default();
    parse_into(frame, tunnels, &mut meta).map(|()| meta)
}

/// [`parse`] into `meta` where it lies, each field stored as it is found. A parse returned
/// by value lives in two dozen registers, more than there are: they spilled to the stack
/// and were copied from there into place, some 70 instructions a packet. On error `meta`
/// holds part of the frame's layers.
#[inline(always)]
pub fn parse_into(frame: &[u8], tunnels: &TunnelPorts, meta: &mut Meta) -> Result<(), DropReason> {
    layers(frame, 0, &mut meta.outer)?;
    meta.tunnel = None;
    meta.inner = Layers::default();
    let outer = &meta.outer;
    if outer.l4_ok && outer.proto == ip_proto::UDP {
        let u = udp::Packet::new_unchecked(&frame[usize::from(outer.l4)..]);
        if let Some(kind) = tunnels.kind(u.dst_port()) {
            let at = usize::from(outer.l4) + udp::HEADER_LEN;
            let end = usize::from(outer.l3_end);
            let t = &frame[at..end];
            let (vni, inner) = match kind {
                Tunnel::Vxlan => {
                    let v =
                        vxlan::Packet::new_checked(t).map_err(|_| DropReason::TunnelMalformed)?;
                    (v.vni(), at + vxlan::HEADER_LEN)
                }
                Tunnel::Geneve => {
                    let g =
                        geneve::Packet::new_checked(t).map_err(|_| DropReason::TunnelMalformed)?;
                    if g.protocol() != ethertype::TEB {
                        return Err(DropReason::TunnelMalformed);
                    }
                    (g.vni(), at + g.header_len())
                }
            };
            meta.tunnel = Some(TunnelInfo {
                kind,
                vni,
                header: at as u16,
                inner: inner as u16,
            });
            layers(&frame[..end], inner, &mut meta.inner)
                .map_err(|_| DropReason::TunnelMalformed)?;
        }
    }
    Ok(())
}

/// Parses Ethernet, VLAN tags, IP and the L4 header starting at `at` into `l`.
#[inline(always)]
fn layers(frame: &[u8], at: usize, l: &mut Layers) -> Result<(), DropReason> {
    let eth = ethernet::Frame::new_checked(&frame[at..]).map_err(|_| DropReason::MalformedL2)?;
    *l = Layers {
        l2: at as u16,
        ethertype: eth.ethertype(),
        ..Layers::default()
    };
    let mut off = at + ethernet::HEADER_LEN;
    for _ in 0..MAX_VLAN_TAGS {
        if l.ethertype != ethertype::VLAN && l.ethertype != ethertype::QINQ {
            break;
        }
        let tag = vlan::Tag::new_checked(&frame[off..]).map_err(|_| DropReason::MalformedL2)?;
        if l.vlan == 0 {
            l.vlan = off as u16;
        }
        l.ethertype = tag.ethertype();
        off += vlan::TAG_LEN;
    }
    l.l3 = off as u16;
    match l.ethertype {
        ethertype::IPV4 => {
            let p =
                ipv4::Packet::new_checked(&frame[off..]).map_err(|_| DropReason::MalformedL3)?;
            l.l3_kind = L3::V4;
            l.l3_end = (off + usize::from(p.total_len())) as u16;
            l.proto = p.protocol();
            l.fragment = p.is_fragment();
            l.l4 = (off + p.header_len()) as u16;
            l.l4_ok = !l.fragment;
        }
        ethertype::IPV6 => {
            let p =
                ipv6::Packet::new_checked(&frame[off..]).map_err(|_| DropReason::MalformedL3)?;
            let up = p.upper_layer().map_err(|_| DropReason::MalformedL3)?;
            l.l3_kind = L3::V6;
            l.l3_end = (off + ipv6::HEADER_LEN + usize::from(p.payload_len())) as u16;
            l.proto = up.protocol;
            l.fragment = up.fragment;
            l.l4 = (off + up.offset) as u16;
            l.l4_ok = up.l4_present && !up.fragment;
        }
        _ => {
            l.l3_end = frame.len() as u16;
            return Ok(());
        }
    }
    if l.l4_ok {
        let seg = &frame[usize::from(l.l4)..usize::from(l.l3_end)];
        let whole = match l.proto {
            ip_proto::TCP => tcp::Packet::new_checked(seg).is_ok(),
            ip_proto::UDP => udp::Packet::new_checked(seg).is_ok(),
            proto => other_l4_whole(proto, seg),
        };
        if !whole {
            return Err(DropReason::MalformedL4);
        }
    }
    Ok(())
}

/// Whether `seg` holds as much of a transport header other than TCP's and UDP's as a
/// whole packet of `proto` needs. Out of line: in the packet loop, each arm more for these
/// cost TCP and UDP instructions.
#[inline(never)]
fn other_l4_whole(proto: u8, seg: &[u8]) -> bool {
    match proto {
        ip_proto::ICMP | ip_proto::ICMPV6 => icmp::Packet::new_checked(seg).is_ok(),
        // SCTP: only the 4 port bytes are read.
        ip_proto::SCTP => seg.len() >= 12,
        // UDP-Lite with its ports whole but the rest of its header cut short is connection
        // tracking's to refuse, as Linux does (`udplite_header`); with the ports cut, the
        // flow hash, the flow cache and port matches could not read them.
        ip_proto::UDPLITE => seg.len() >= 4,
        _ => true,
    }
}

/// Whether the L4 fields rules match (ports, TCP flags, ICMP type and code) are in the
/// packet: in a whole L4 packet, or in a datagram's first fragment long enough for its L4
/// header (as iptables matches a first fragment's ports; later fragments have none).
#[inline(always)]
pub fn l4_fields(frame: &[u8], l: &Layers) -> bool {
    l.l4_ok || (l.fragment && first_fragment_head(frame, l))
}

/// Whether a fragment is its datagram's first and holds the whole L4 header (a TCP
/// header's 20 bytes, UDP's and UDP-Lite's 8, SCTP's common header, ICMP's 8). Out of line: fragments
/// are rare.
#[cold]
#[inline(never)]
fn first_fragment_head(frame: &[u8], l: &Layers) -> bool {
    let needs = match l.proto {
        ip_proto::TCP => 20,
        ip_proto::UDP | ip_proto::UDPLITE => udp::HEADER_LEN,
        ip_proto::SCTP => 12,
        ip_proto::ICMP | ip_proto::ICMPV6 => icmp::HEADER_LEN,
        _ => 0,
    };
    fragment_of(frame, l).is_some_and(|(_, first)| first)
        && usize::from(l.l4) + needs <= usize::from(l.l3_end)
}

/// A datagram, as its fragments all say: addresses, identification (RFC 791 §3.2, RFC
/// 8200 §4.5), family and, for IPv4, protocol (IPv6 numbers datagrams per address pair,
/// IPv4 per pair and protocol: RFC 6864 §4).
pub type Datagram = [u64; 5];

/// The datagram a fragment (`l.fragment`) belongs to, and whether it is the first (which
/// carries the L4 header).
pub fn fragment_of(frame: &[u8], l: &Layers) -> Option<(Datagram, bool)> {
    let l3 = usize::from(l.l3);
    let ip = frame.get(l3..)?;
    let (addresses, ident, first, proto) = match l.l3_kind {
        L3::V4 => {
            let p = ipv4::Packet::new_unchecked(ip);
            let a = [
                u64::from(be32(frame, l3 + 12)),
                u64::from(be32(frame, l3 + 16)),
                0,
                0,
            ];
            (a, u32::from(p.ident()), p.frag_offset() == 0, l.proto)
        }
        L3::V6 => {
            let up = ipv6::Packet::new_unchecked(ip).upper_layer().ok()?;
            let a = [8, 16, 24, 32].map(|at| be64(frame, l3 + at));
            (a, up.ident, up.l4_present, 0)
        }
        L3::None => return None,
    };
    let v6 = l.l3_kind == L3::V6;
    let tag = u64::from(v6) << 40 | u64::from(proto) << 32 | u64::from(ident);
    let [a, b, c, d] = addresses;
    Some(([a, b, c, d, tag], first))
}

/// The packet an ICMP error quotes (RFC 792: its IP header and the first 8 bytes of its
/// payload; RFC 4443 §2.4: as much as fits), as layers of the same frame, so that an error
/// is steered as the quoted packet's flow is: the worker that holds the quoted packet's
/// connection is the one that can find the error related to it. `None` for other packets
/// and for quotes too short to read. An IPv6 quote's extension headers are not walked
/// (conntrack does not walk them either).
pub fn quoted_layers(frame: &[u8], l: &Layers) -> Option<Layers> {
    if !l.l4_ok || !ip_proto::is_icmp(l.proto) {
        return None;
    }
    if !icmp::is_error(l.l3_kind == L3::V6, frame[usize::from(l.l4)]) {
        return None;
    }
    quote_at(frame, l, usize::from(l.l4) + icmp::HEADER_LEN)
}

/// The layers of a quoted packet whose IP header starts at `at` (of `l`'s family), up to
/// `l`'s end: what [`quoted_layers`] and conntrack's related-error lookup both read. An
/// IPv6 quote's extension headers are skipped to its upper layer, a first fragment's
/// included. A quoted later fragment has no L4 header to read, so no tuple: `None`, and
/// the error relates to nothing, as in Linux (`ipv4_get_l4proto` and `ipv6_get_l4proto`
/// refuse a nonzero fragment offset).
pub fn quote_at(frame: &[u8], l: &Layers, at: usize) -> Option<Layers> {
    let end = usize::from(l.l3_end);
    let q = frame.get(at..end)?;
    let (proto, header) = match l.l3_kind {
        L3::V6 => {
            if q.len() < ipv6::HEADER_LEN || q[0] >> 4 != 6 {
                return None;
            }
            let up = ipv6::Packet::new_unchecked(q).upper_layer().ok()?;
            up.l4_present.then_some((up.protocol, up.offset))?
        }
        L3::V4 => {
            let header = usize::from(q.first()? & 0x0f) * 4;
            let first = q.len() >= header
                && header >= ipv4::MIN_HEADER_LEN
                && q[0] >> 4 == 4
                && be16(q, 6) & 0x1fff == 0;
            first.then(|| (q[9], header))?
        }
        L3::None => return None,
    };
    let l4 = at + header;
    Some(Layers {
        l3: at as u16,
        proto,
        fragment: false,
        l4: l4 as u16,
        // The ports, when the quote holds them, are all the hash reads of the L4 header.
        l4_ok: l4 + 4 <= end,
        ..*l
    })
}

/// The sum of the pseudo-header a transport checksum of `l`'s packet covers (RFC 768,
/// RFC 9293 §3.1, RFC 8200 §8.1): its addresses, `proto` and the segment's `len`; `None`
/// for a packet that is not IP.
pub fn pseudo_header(frame: &[u8], l: &Layers, proto: u8, len: usize) -> Option<u32> {
    let ip = &frame[usize::from(l.l3)..];
    match l.l3_kind {
        L3::V4 => {
            let ip = ipv4::Packet::new_unchecked(ip);
            Some(checksum::pseudo_v4(ip.src(), ip.dst(), proto, len as u16))
        }
        L3::V6 => {
            let ip = ipv6::Packet::new_unchecked(ip);
            Some(checksum::pseudo_v6(&ip.src(), &ip.dst(), proto, len as u32))
        }
        L3::None => None,
    }
}

/// A symmetric hash of addresses, protocol and ports: both directions of a flow hash the
/// same, so a flow and its replies can be steered to the same worker. Computed on demand
/// (encapsulation needs it; plain forwarding does not).
pub fn flow_hash(frame: &[u8], l: &Layers) -> u32 {
    flow_hash_of(frame, l, l.l4_ok)
}

/// [`flow_hash`], with the ports read where `ports` says they are (a datagram's first
/// fragment has them, though it is no whole L4 packet).
pub fn flow_hash_of(frame: &[u8], l: &Layers, ports: bool) -> u32 {
    let l3 = usize::from(l.l3);
    // Each address folded to 32 bits (IPv6 by xoring its four words).
    let fold = |a: u128| (a >> 96) as u32 ^ (a >> 64) as u32 ^ (a >> 32) as u32 ^ a as u32;
    let (x, y) = match l.l3_kind {
        L3::V4 => (be32(frame, l3 + 12), be32(frame, l3 + 16)),
        L3::V6 => (fold(be128(frame, l3 + 8)), fold(be128(frame, l3 + 24))),
        L3::None => return u32::from(l.ethertype),
    };
    let (p, q) = if ports && ip_proto::has_ports(l.proto) {
        let ports = be32(frame, usize::from(l.l4));
        (ports >> 16, ports & 0xffff)
    } else {
        (0, 0)
    };
    let h = u64::from(x.min(y)) << 32 | u64::from(x.max(y));
    let ports = u64::from(p.min(q)) << 16 | u64::from(p.max(q)) | u64::from(l.proto) << 40;
    let m = mix(h ^ ports.rotate_left(17));
    (m >> 32) as u32 ^ m as u32
}

/// The DS field, DSCP and ECN (RFC 2474 §3, RFC 3168 §5), of the IP packet `l`
/// describes; 0, Not-ECT, for a frame that is not IP. Read where needed (an
/// encapsulation, a decapsulation) rather than kept in [`Layers`] by every parse: a byte
/// more there made each packet's parse 9 instructions dearer, by callgrind.
#[inline(always)]
pub fn ds_field(frame: &[u8], l: &Layers) -> u8 {
    let at = usize::from(l.l3);
    let Some(&second) = frame.get(at + 1) else {
        return 0;
    };
    match l.l3_kind {
        L3::V4 => second,
        L3::V6 => (frame[at] << 4) | (second >> 4),
        L3::None => 0,
    }
}

/// The odd constant the flow hash multiplies by in its mix (2^64 over the golden ratio).
pub const MIX_MULTIPLIER: u64 = 0x9e37_79b9_7f4a_7c15;

/// Folds the high half into the low before multiplying, and the product's high bits back
/// down after: callers take the low bits (a worker, the outer UDP source port). A lone
/// multiply left those depending on the low input bits only, so flows that differed in a
/// port alone — many connections between two hosts — went 4039 to 57 over two workers.
fn mix(mut z: u64) -> u64 {
    z ^= z >> 32;
    z = z.wrapping_mul(MIX_MULTIPLIER);
    z ^ (z >> 29)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::testing::{frame, ip_frame};
    use crate::wire::{ethernet, ip_proto};

    fn hash(src: u32, dst: u32, sport: u16, dport: u16) -> u32 {
        let f = frame(
            false,
            src.into(),
            dst.into(),
            ip_proto::UDP,
            sport,
            dport,
            0,
            0,
        );
        let m = parse(&f, &TunnelPorts::default()).expect("parses");
        flow_hash(&f, &m.outer)
    }

    /// A destination unreachable (ICMP, or ICMPv6 when `v6`) from `src` to `dst` quoting
    /// `quote`.
    fn unreachable(v6: bool, src: u128, dst: u128, quote: &[u8]) -> Vec<u8> {
        let (proto, kind) = if v6 {
            (ip_proto::ICMPV6, icmp::v6_type::DEST_UNREACHABLE)
        } else {
            (ip_proto::ICMP, icmp::v4_type::DEST_UNREACHABLE)
        };
        // Type, code 3 (port unreachable), checksum, unused; then the quote.
        let mut icmp = vec![kind, 3, 0, 0, 0, 0, 0, 0];
        icmp.extend_from_slice(quote);
        ip_frame(v6, src, dst, proto, 0, &icmp)
    }

    /// An ICMP error hashes as the packet it quotes, so it is steered to the worker that
    /// holds that packet's connection: a port unreachable from the server about a client's
    /// datagram hashes as the datagram and its replies do, not as its own addresses.
    #[test]
    fn an_icmp_error_hashes_as_the_packet_it_quotes() {
        let (client, server) = (0x0a00_0002u32, 0xc633_6435u32);
        let datagram = frame(
            false,
            client.into(),
            server.into(),
            ip_proto::UDP,
            5353,
            53,
            0,
            0,
        );
        let quote = &datagram[ethernet::HEADER_LEN..ethernet::HEADER_LEN + 28];
        let mut error = unreachable(false, server.into(), client.into(), quote);
        let m = parse(&error, &TunnelPorts::default()).expect("parses");
        let quoted = quoted_layers(&error, &m.outer).expect("an error quoting a datagram");
        assert_eq!(quoted.proto, ip_proto::UDP);
        assert_eq!(
            flow_hash_of(&error, &quoted, quoted.l4_ok),
            hash(server, client, 53, 5353)
        );
        // Not an error: an echo request quotes nothing; nor does a cut-short quote.
        error[ethernet::HEADER_LEN + 20] = icmp::v4_type::ECHO_REQUEST;
        assert_eq!(quoted_layers(&error, &m.outer), None);
        error[ethernet::HEADER_LEN + 20] = icmp::v4_type::DEST_UNREACHABLE;
        let cut = Layers {
            l3_end: m.outer.l4 + 8 + 12,
            ..m.outer
        };
        assert_eq!(quoted_layers(&error, &cut), None);
    }

    /// A quoted first fragment is read to its L4 header (behind the fragment header in
    /// IPv6) and steered and related as its datagram; a quoted later fragment has no L4
    /// header, so no quote is read from it (Linux relates such an error to nothing).
    #[test]
    fn a_quoted_fragment_is_read_only_when_it_is_a_first() {
        for v6 in [false, true] {
            let (client, server) = (0x0a00_0002u128, 0xc633_6435u128);
            let datagram = frame(v6, client, server, ip_proto::UDP, 5353, 53, 0, 0);
            let ip = &datagram[ethernet::HEADER_LEN..];
            for (offset, readable) in [(0u16, true), (185, false)] {
                // More fragments follow; `offset` in 8-byte units.
                let mut quote = ip.to_vec();
                if v6 {
                    quote.truncate(ipv6::HEADER_LEN + 8);
                    quote[6] = ip_proto::IPV6_FRAGMENT;
                    let off = (offset << 3 | 1).to_be_bytes();
                    let header = [ip_proto::UDP, 0, off[0], off[1], 0, 0, 0x30, 0x39];
                    quote.splice(ipv6::HEADER_LEN..ipv6::HEADER_LEN, header);
                } else {
                    quote.truncate(ipv4::MIN_HEADER_LEN + 8);
                    quote[6..8].copy_from_slice(&(0x2000 | offset).to_be_bytes());
                }
                let error = unreachable(v6, server, client, &quote);
                let m = parse(&error, &TunnelPorts::default()).expect("parses");
                let quoted = quoted_layers(&error, &m.outer);
                assert_eq!(quoted.is_some(), readable, "v6 {v6}, offset {offset}");
                if let Some(q) = quoted {
                    assert_eq!((q.proto, q.l4_ok), (ip_proto::UDP, true));
                    let whole = parse(&datagram, &TunnelPorts::default()).expect("parses");
                    assert_eq!(
                        flow_hash_of(&error, &q, true),
                        flow_hash(&datagram, &whole.outer)
                    );
                }
            }
        }
    }

    proptest::proptest! {
        /// Whatever an ICMP or ICMPv6 error quotes, reading the quote and hashing it
        /// never panics, and a quote is found only where an IP header of the error's
        /// family fits.
        #[test]
        fn any_quote_is_read_without_panicking(
            v6 in proptest::bool::ANY,
            quote in proptest::collection::vec(proptest::num::u8::ANY, 0..80),
        ) {
            let error = unreachable(v6, 1, 2, &quote);
            let m = parse(&error, &TunnelPorts::default()).expect("parses");
            if let Some(q) = quoted_layers(&error, &m.outer) {
                let header = if v6 { ipv6::HEADER_LEN } else { ipv4::MIN_HEADER_LEN };
                proptest::prop_assert!(quote.len() >= header);
                proptest::prop_assert_eq!(quote[0] >> 4, if v6 { 6 } else { 4 });
                flow_hash_of(&error, &q, q.l4_ok);
            }
        }
    }

    /// Many connections between two hosts, differing in the client's port alone, spread
    /// over workers and over the outer source port's low bits (which underlay ECMP and
    /// RSS hash) like random numbers, and each direction hashes the same.
    #[test]
    fn flows_differing_in_one_port_spread_evenly() {
        let (client, server) = (0x0a00_0001, 0x0a01_0001);
        let hashes: Vec<u32> = (1024..1024 + 4096)
            .map(|p| hash(client, server, p, 5001))
            .collect();
        for (p, h) in (1024..).zip(&hashes).take(16) {
            assert_eq!(*h, hash(server, client, 5001, p));
        }
        for buckets in [2usize, 4, 16] {
            let mut n = vec![0usize; buckets];
            for h in &hashes {
                n[*h as usize % buckets] += 1;
            }
            let share = hashes.len() / buckets;
            assert!(
                n.iter().all(|&k| k > share * 8 / 10 && k < share * 12 / 10),
                "{buckets} buckets: {n:?}"
            );
        }
    }
}
