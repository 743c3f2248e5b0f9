//! Reading match fields out of a parsed frame.

use super::parse::{ds_field, l4_fields, Layers, Meta, L3};
use crate::ir::{Field, FieldId};
use crate::wire::ethernet::ethertype;
use crate::wire::{arp, be128, be16, be32, be64, geneve, icmp, ip_proto, ndp};

/// Per-packet state the pipeline itself sets: the arrival port, the mark, the
/// connection-tracking verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketState {
    pub in_port: u16,
    pub mark: u32,
    /// One of the `ct.state` bits, 0 before any lookup.
    pub ct_state: u8,
    /// `clamp tcp.mss mtu` ran: the MSS is clamped where the packet leaves. (In the
    /// padding byte: a state of 12 bytes rather than 8 cost every packet 9 instructions.)
    pub clamp_mss_to_mtu: bool,
}

/// The value of `field` in `frame`, or `None` when the packet does not have that header
/// (a TCP field on a UDP packet, an inner field without a tunnel, an L4 field on a
/// fragment other than a datagram's first).
#[inline(always)]
pub fn read(frame: &[u8], meta: &Meta, st: &PacketState, field: Field) -> Option<u128> {
    match field.id {
        FieldId::Ipv6Src | FieldId::Ipv6Dst => {
            let l = layers(meta, field)?;
            let at = usize::from(l.l3) + if field.id == FieldId::Ipv6Src { 8 } else { 24 };
            (l.l3_kind == L3::V6).then(|| be128(frame, at))
        }
        FieldId::NdTarget => {
            let l = layers(meta, field)?;
            nd_message(frame, l).map(|at| be128(frame, at + 8))
        }
        _ => read_narrow(frame, meta, st, field).map(u128::from),
    }
}

/// The headers `field` is read from: the inner ones (`None` without a tunnel) or the outer.
#[inline(always)]
fn layers(meta: &Meta, field: Field) -> Option<&Layers> {
    if field.inner {
        meta.tunnel?;
        Some(&meta.inner)
    } else {
        Some(&meta.outer)
    }
}

/// Whether `field`'s values fit in 64 bits, so [`read_narrow`] reads it.
pub fn is_narrow(field: Field) -> bool {
    !matches!(
        field.id,
        FieldId::Ipv6Src
            | FieldId::Ipv6Dst
            | FieldId::NdTarget
            | FieldId::GeneveOptClass
            | FieldId::GeneveOptType
    )
}

/// [`read`] for the fields of at most 64 bits (see [`is_narrow`]; `None` for the others):
/// the value comes back in registers, where a `u128` in an `Option` goes through memory.
#[inline(always)]
pub fn read_narrow(frame: &[u8], meta: &Meta, st: &PacketState, field: Field) -> Option<u64> {
    let l = layers(meta, field)?;
    let l2 = usize::from(l.l2);
    let l3 = usize::from(l.l3);
    let l4 = usize::from(l.l4);
    let v4 = l.l3_kind == L3::V4;
    let v6 = l.l3_kind == L3::V6;
    let has_l4 = |proto: u8| l.proto == proto && l4_fields(frame, l);
    Some(match field.id {
        // Eight bytes read, the two beyond each address dropped (the Ethernet header
        // the parse found holds them).
        FieldId::EthDst => be64(frame, l2) >> 16,
        FieldId::EthSrc => be64(frame, l2 + 4) & 0xffff_ffff_ffff,
        FieldId::EthType => u64::from(l.ethertype),
        FieldId::VlanId if l.vlan != 0 => u64::from(be16(frame, usize::from(l.vlan)) & 0x0fff),
        FieldId::VlanPcp if l.vlan != 0 => u64::from(frame[usize::from(l.vlan)] >> 5),
        FieldId::Ipv4Src if v4 => u64::from(be32(frame, l3 + 12)),
        FieldId::Ipv4Dst if v4 => u64::from(be32(frame, l3 + 16)),
        FieldId::IpProto if v4 || v6 => u64::from(l.proto),
        FieldId::IpDscp if v4 || v6 => u64::from(ds_field(frame, l) >> 2),
        FieldId::IpEcn if v4 || v6 => u64::from(ds_field(frame, l) & 3),
        FieldId::IpTtl if v4 => u64::from(frame[l3 + 8]),
        FieldId::IpTtl if v6 => u64::from(frame[l3 + 7]),
        FieldId::L4Src if ip_proto::has_ports(l.proto) && l4_fields(frame, l) => {
            u64::from(be16(frame, l4))
        }
        FieldId::L4Dst if ip_proto::has_ports(l.proto) && l4_fields(frame, l) => {
            u64::from(be16(frame, l4 + 2))
        }
        FieldId::TcpSrc if has_l4(ip_proto::TCP) => u64::from(be16(frame, l4)),
        FieldId::TcpDst if has_l4(ip_proto::TCP) => u64::from(be16(frame, l4 + 2)),
        FieldId::TcpFlags if has_l4(ip_proto::TCP) => u64::from(frame[l4 + 13]),
        FieldId::UdpSrc if has_l4(ip_proto::UDP) => u64::from(be16(frame, l4)),
        FieldId::UdpDst if has_l4(ip_proto::UDP) => u64::from(be16(frame, l4 + 2)),
        FieldId::IcmpType if v4 && has_l4(ip_proto::ICMP) => u64::from(frame[l4]),
        FieldId::IcmpCode if v4 && has_l4(ip_proto::ICMP) => u64::from(frame[l4 + 1]),
        FieldId::Icmp6Type if v6 && has_l4(ip_proto::ICMPV6) => u64::from(frame[l4]),
        FieldId::Icmp6Code if v6 && has_l4(ip_proto::ICMPV6) => u64::from(frame[l4 + 1]),
        FieldId::ArpOp | FieldId::ArpSha | FieldId::ArpSpa | FieldId::ArpTpa => {
            let a = arp::Packet::new_checked(arp_packet(frame, l)?).ok()?;
            match field.id {
                FieldId::ArpOp => u64::from(a.op()),
                FieldId::ArpSha => a.sha().iter().fold(0, |v, &b| v << 8 | u64::from(b)),
                FieldId::ArpSpa => u64::from(u32::from(a.spa())),
                _ => u64::from(u32::from(a.tpa())),
            }
        }
        FieldId::VxlanVni => match meta.tunnel {
            Some(t) if t.kind == crate::ir::Tunnel::Vxlan => u64::from(t.vni),
            _ => return None,
        },
        FieldId::GeneveVni => match meta.tunnel {
            Some(t) if t.kind == crate::ir::Tunnel::Geneve => u64::from(t.vni),
            _ => return None,
        },
        FieldId::CtState => u64::from(st.ct_state),
        FieldId::InPort => u64::from(st.in_port),
        FieldId::MetaMark => u64::from(st.mark),
        // IPv6 addresses are wide (see `read`); Geneve options are a list (see
        // `geneve_options`).
        _ => return None,
    })
}

/// The bytes after the Ethernet header (and tags) of an ARP frame.
#[inline]
fn arp_packet<'a>(frame: &'a [u8], l: &Layers) -> Option<&'a [u8]> {
    (l.ethertype == ethertype::ARP).then(|| &frame[usize::from(l.l3)..usize::from(l.l3_end)])
}

/// Where a whole neighbour solicitation or advertisement starts in the frame, if it
/// carries one.
#[inline]
fn nd_message(frame: &[u8], l: &Layers) -> Option<usize> {
    let at = usize::from(l.l4);
    let whole = l.l3_kind == L3::V6
        && l.proto == ip_proto::ICMPV6
        && l.l4_ok
        && at + ndp::HEADER_LEN <= usize::from(l.l3_end);
    let kind = frame.get(at).copied().filter(|_| whole)?;
    matches!(
        kind,
        icmp::v6_type::NEIGHBOR_SOLICIT | icmp::v6_type::NEIGHBOR_ADVERT
    )
    .then_some(at)
}

/// `read` for one field, as a function with that field's header checks folded in, for
/// lookups that read a list of fields chosen at build time.
pub type Reader = fn(&[u8], &Meta, &PacketState) -> Option<u128>;

/// [`Reader`] for a field of at most 64 bits.
pub type NarrowReader = fn(&[u8], &Meta, &PacketState) -> Option<u64>;

/// Each field's own reader: `$read` with the field fixed, a function per field and depth.
macro_rules! readers {
    (($field:expr, $read:ident); $($id:ident),* $(,)?) => {
        match ($field.id, $field.inner) {
            $(
                (FieldId::$id, false) => |fr, m, st| $read(fr, m, st, Field { id: FieldId::$id, inner: false }),
                (FieldId::$id, true) => |fr, m, st| $read(fr, m, st, Field { id: FieldId::$id, inner: true }),
            )*
        }
    };
}

pub fn reader(field: Field) -> Reader {
    crate::ir::with_field_ids!(readers, (field, read))
}

/// The narrow reader of `field`, if it is narrow ([`is_narrow`]).
pub fn narrow_reader(field: Field) -> Option<NarrowReader> {
    if !is_narrow(field) {
        return None;
    }
    let read: NarrowReader = crate::ir::with_field_ids!(readers, (field, read_narrow));
    Some(read)
}

/// A field's reader chosen at build time: the narrow one where the field has one.
#[derive(Debug, Clone, Copy)]
pub enum FieldReader {
    Narrow(NarrowReader),
    Wide(Reader),
}

impl FieldReader {
    pub fn new(field: Field) -> FieldReader {
        narrow_reader(field).map_or_else(|| FieldReader::Wide(reader(field)), FieldReader::Narrow)
    }

    #[inline(always)]
    pub fn read(self, frame: &[u8], meta: &Meta, st: &PacketState) -> Option<u128> {
        match self {
            FieldReader::Narrow(read) => read(frame, meta, st).map(u128::from),
            FieldReader::Wide(read) => read(frame, meta, st),
        }
    }
}

/// Class and type of each Geneve option of the packet's tunnel, for matching
/// `geneve.opt.class` and `geneve.opt.type` (a match holds if any option matches).
pub fn geneve_options<'a>(frame: &'a [u8], meta: &Meta) -> impl Iterator<Item = (u16, u8)> + 'a {
    let header: &[u8] = match meta.tunnel {
        Some(t) if t.kind == crate::ir::Tunnel::Geneve => {
            &frame[usize::from(t.header)..usize::from(t.inner)]
        }
        _ => &[],
    };
    geneve::options_in(header)
        .filter_map(Result::ok)
        .map(|o| (o.class, o.kind))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::parse::{self, TunnelPorts};
    use crate::wire::testing::frame;

    fn outer(id: FieldId) -> Field {
        Field { id, inner: false }
    }

    /// The readers see the frame's own values: MACs, addresses, ports; a field the packet
    /// lacks reads as `None`, and the narrow readers cover every field but IPv6 addresses
    /// and Geneve options.
    #[test]
    fn readers_read_the_frame() {
        let src = 0x2001_0db8_0000_0000_0000_0000_0000_0001;
        let dst = 0xfe80_0000_0000_0000_1234_5678_9abc_def0;
        let f = frame(true, src, dst, ip_proto::UDP, 5353, 53, 0, 10);
        let meta = parse::parse(&f, &TunnelPorts::default()).expect("parsed");
        let st = PacketState::default();
        let read = |id| FieldReader::new(outer(id)).read(&f, &meta, &st);
        assert_eq!(read(FieldId::EthDst), Some(0x0200_0000_0002));
        assert_eq!(read(FieldId::EthSrc), Some(0x0200_0000_0001));
        assert_eq!(read(FieldId::Ipv6Src), Some(src));
        assert_eq!(read(FieldId::Ipv6Dst), Some(dst));
        assert_eq!(read(FieldId::UdpDst), Some(53));
        assert_eq!(read(FieldId::IpDscp), Some(10));
        assert_eq!(read(FieldId::IpEcn), Some(0));
        assert_eq!(read(FieldId::TcpDst), None);
        assert_eq!(read(FieldId::Ipv4Src), None);
        assert!(matches!(
            FieldReader::new(outer(FieldId::Ipv6Src)),
            FieldReader::Wide(_)
        ));
        assert!(narrow_reader(outer(FieldId::GeneveOptClass)).is_none());
        let v4 = frame(
            false,
            0xc000_0201,
            0x0a00_0001,
            ip_proto::TCP,
            1,
            443,
            0x12,
            0,
        );
        let meta = parse::parse(&v4, &TunnelPorts::default()).expect("parsed");
        let narrow = |id| narrow_reader(outer(id)).expect("narrow")(&v4, &meta, &st);
        assert_eq!(narrow(FieldId::Ipv4Src), Some(0xc000_0201));
        assert_eq!(narrow(FieldId::TcpFlags), Some(0x12));
        assert_eq!(narrow(FieldId::IpDscp), Some(0));
        // ECN in the low bits of the traffic class and of the TOS byte (RFC 3168 §5).
        let mut ce = f.clone();
        ce[15] |= 0x30;
        let meta6 = parse::parse(&ce, &TunnelPorts::default()).expect("parsed");
        let ecn = |f: &[u8], m: &Meta| read_narrow(f, m, &st, outer(FieldId::IpEcn));
        assert_eq!(ecn(&ce, &meta6), Some(3));
        assert_eq!(
            read_narrow(&ce, &meta6, &st, outer(FieldId::IpDscp)),
            Some(10)
        );
        let mut ect0 = v4.clone();
        ect0[15] |= 2;
        assert_eq!(ecn(&ect0, &meta), Some(2));
        assert_eq!(read_narrow(&v4, &meta, &st, outer(FieldId::Ipv6Dst)), None);
        assert_eq!(read(FieldId::VxlanVni), None);
    }

    /// ARP fields read from an Ethernet/IPv4 ARP frame, inside a VLAN tag too, and
    /// `nd.target` from a solicitation; on other frames they are absent.
    #[test]
    fn arp_and_neighbour_discovery_fields() {
        use crate::wire::{arp, ethernet};
        let st = PacketState::default();
        let mut f = vec![0u8; 60];
        f[..6].fill(0xff);
        f[6..12].copy_from_slice(&[2, 0, 0, 0, 0, 0x0a]);
        f[12..14].copy_from_slice(&[0x81, 0x00]);
        f[14..16].copy_from_slice(&7u16.to_be_bytes());
        f[16..18].copy_from_slice(&ethertype::ARP.to_be_bytes());
        arp::Repr {
            op: arp::op::REQUEST,
            sha: [2, 0, 0, 0, 0, 0x0a],
            spa: [192, 0, 2, 10].into(),
            tha: [0; 6],
            tpa: [192, 0, 2, 1].into(),
        }
        .emit(&mut f[ethernet::HEADER_LEN + 4..]);
        let meta = parse::parse(&f, &TunnelPorts::default()).expect("parsed");
        let read = |f: &[u8], meta: &Meta, id| FieldReader::new(outer(id)).read(f, meta, &st);
        assert_eq!(read(&f, &meta, FieldId::ArpOp), Some(1));
        assert_eq!(read(&f, &meta, FieldId::ArpSha), Some(0x0200_0000_000a));
        assert_eq!(read(&f, &meta, FieldId::ArpSpa), Some(0xc000_020a));
        assert_eq!(read(&f, &meta, FieldId::ArpTpa), Some(0xc000_0201));
        assert_eq!(read(&f, &meta, FieldId::NdTarget), None);
        // A hardware type other than Ethernet's: not ARP these fields describe.
        f[ethernet::HEADER_LEN + 5] = 6;
        assert_eq!(read(&f, &meta, FieldId::ArpTpa), None);
        let target = 0x2001_0db8_0000_0000_0000_0000_0000_0001u128;
        let mut ns = vec![icmp::v6_type::NEIGHBOR_SOLICIT, 0, 0, 0, 0, 0, 0, 0];
        ns.extend(target.to_be_bytes());
        let v6 = crate::wire::testing::ip_frame(true, 1, 2, ip_proto::ICMPV6, 0, &ns);
        let meta = parse::parse(&v6, &TunnelPorts::default()).expect("parsed");
        assert_eq!(read(&v6, &meta, FieldId::NdTarget), Some(target));
        assert_eq!(read(&v6, &meta, FieldId::ArpOp), None);
        let echo = crate::wire::testing::ip_frame(true, 1, 2, ip_proto::ICMPV6, 0, &[128; 24]);
        let meta = parse::parse(&echo, &TunnelPorts::default()).expect("parsed");
        assert_eq!(read(&echo, &meta, FieldId::NdTarget), None);
    }
}
