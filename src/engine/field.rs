//! Reading match fields out of a parsed frame.

use super::parse::{Layers, Meta, L3};
use crate::ir::{Field, FieldId};
use crate::wire::{be16, be32, geneve, ip_proto};

/// Per-packet state the pipeline itself sets: the arrival port, the mark, the
/// connection-tracking verdict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PacketState {
    pub in_port: u16,
    pub mark: u32,
    /// One of the `ct.state` bits, 0 before any lookup.
    pub ct_state: u8,
}

fn bytes_be(b: &[u8]) -> u128 {
    b.iter().fold(0u128, |acc, &x| acc << 8 | u128::from(x))
}

/// The value of `field` in `frame`, or `None` when the packet does not have that header
/// (a TCP field on a UDP packet, an inner field without a tunnel, an L4 field on a
/// fragment).
#[inline]
pub fn read(frame: &[u8], meta: &Meta, st: &PacketState, field: Field) -> Option<u128> {
    let l: &Layers = if field.inner {
        meta.tunnel?;
        &meta.inner
    } else {
        &meta.outer
    };
    let l2 = usize::from(l.l2);
    let l3 = usize::from(l.l3);
    let l4 = usize::from(l.l4);
    let v4 = l.l3_kind == L3::V4;
    let v6 = l.l3_kind == L3::V6;
    let has_l4 = |proto: u8| l.l4_ok && l.proto == proto;
    Some(match field.id {
        FieldId::EthDst => bytes_be(&frame[l2..l2 + 6]),
        FieldId::EthSrc => bytes_be(&frame[l2 + 6..l2 + 12]),
        FieldId::EthType => u128::from(l.ethertype),
        FieldId::VlanId if l.vlan != 0 => u128::from(be16(frame, usize::from(l.vlan)) & 0x0fff),
        FieldId::VlanPcp if l.vlan != 0 => u128::from(frame[usize::from(l.vlan)] >> 5),
        FieldId::Ipv4Src if v4 => u128::from(be32(frame, l3 + 12)),
        FieldId::Ipv4Dst if v4 => u128::from(be32(frame, l3 + 16)),
        FieldId::Ipv6Src if v6 => bytes_be(&frame[l3 + 8..l3 + 24]),
        FieldId::Ipv6Dst if v6 => bytes_be(&frame[l3 + 24..l3 + 40]),
        FieldId::IpProto if v4 || v6 => u128::from(l.proto),
        FieldId::IpDscp if v4 => u128::from(frame[l3 + 1] >> 2),
        FieldId::IpDscp if v6 => u128::from((be16(frame, l3) >> 6) & 0x3f),
        FieldId::IpEcn if v4 => u128::from(frame[l3 + 1] & 3),
        FieldId::IpEcn if v6 => u128::from((be16(frame, l3) >> 4) & 3),
        FieldId::IpTtl if v4 => u128::from(frame[l3 + 8]),
        FieldId::IpTtl if v6 => u128::from(frame[l3 + 7]),
        FieldId::L4Src if l.l4_ok && ip_proto::has_ports(l.proto) => u128::from(be16(frame, l4)),
        FieldId::L4Dst if l.l4_ok && ip_proto::has_ports(l.proto) => {
            u128::from(be16(frame, l4 + 2))
        }
        FieldId::TcpSrc if has_l4(ip_proto::TCP) => u128::from(be16(frame, l4)),
        FieldId::TcpDst if has_l4(ip_proto::TCP) => u128::from(be16(frame, l4 + 2)),
        FieldId::TcpFlags if has_l4(ip_proto::TCP) => u128::from(frame[l4 + 13]),
        FieldId::UdpSrc if has_l4(ip_proto::UDP) => u128::from(be16(frame, l4)),
        FieldId::UdpDst if has_l4(ip_proto::UDP) => u128::from(be16(frame, l4 + 2)),
        FieldId::IcmpType if v4 && has_l4(ip_proto::ICMP) => u128::from(frame[l4]),
        FieldId::IcmpCode if v4 && has_l4(ip_proto::ICMP) => u128::from(frame[l4 + 1]),
        FieldId::Icmp6Type if v6 && has_l4(ip_proto::ICMPV6) => u128::from(frame[l4]),
        FieldId::Icmp6Code if v6 && has_l4(ip_proto::ICMPV6) => u128::from(frame[l4 + 1]),
        FieldId::VxlanVni => match meta.tunnel {
            Some(t) if t.kind == crate::ir::Tunnel::Vxlan => u128::from(t.vni),
            _ => return None,
        },
        FieldId::GeneveVni => match meta.tunnel {
            Some(t) if t.kind == crate::ir::Tunnel::Geneve => u128::from(t.vni),
            _ => return None,
        },
        FieldId::CtState => u128::from(st.ct_state),
        FieldId::InPort => u128::from(st.in_port),
        FieldId::MetaMark => u128::from(st.mark),
        // Geneve options are a list; see `geneve_options`.
        _ => return None,
    })
}

/// `read` for one field, as a function with that field's header checks folded in, for
/// lookups that read a list of fields chosen at build time.
pub type Reader = fn(&[u8], &Meta, &PacketState) -> Option<u128>;

pub fn reader(field: Field) -> Reader {
    macro_rules! readers {
        ($($id:ident),* $(,)?) => {
            match (field.id, field.inner) {
                $(
                    (FieldId::$id, false) => |fr, m, st| read(fr, m, st, Field { id: FieldId::$id, inner: false }),
                    (FieldId::$id, true) => |fr, m, st| read(fr, m, st, Field { id: FieldId::$id, inner: true }),
                )*
            }
        };
    }
    crate::ir::with_field_ids!(readers)
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
