//! Where each pipeline field lives in DOCA Flow's match and action structures
//! (`struct doca_flow_match`, `struct doca_flow_actions` of DOCA 3.0's `doca_flow.h`).
//!
//! A member such as `outer.ip4.dst_ip` is only read by DOCA Flow together with the
//! members that say which header it is in (`outer.l3_type`, `outer.l4_type_ext`,
//! `tun.type`): a field's [`Place`] carries those selectors, and a field whose header
//! the rest of its rule leaves open (`ip.ttl` without an IPv4 or IPv6 field) has no place.

use crate::ir::{Field, FieldId, Pattern, Tunnel};

/// The member a field's value goes in, the selectors it needs beside it, and the bits it
/// takes of the member (a VLAN id and priority share the TCI).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Place {
    /// The member, as C names it: `outer.ip4.dst_ip`.
    pub member: String,
    /// Constant members telling DOCA Flow which header the member is in.
    pub selectors: Vec<Selector>,
    /// The field's value goes in the member shifted left by this much.
    pub shift: u8,
}

/// A member set to a constant (an enumerator of `doca_flow.h`) so another member is read.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Selector {
    pub member: String,
    pub value: &'static str,
}

impl Selector {
    fn new(member: impl Into<String>, value: &'static str) -> Selector {
        Selector {
            member: member.into(),
            value,
        }
    }
}

/// IP version of a header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Family {
    V4,
    V6,
}

/// What the other fields of a rule (or the fields of a table) pin down about the headers
/// one field is read from: its IP version, its transport protocol, the tunnel around it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Headers {
    pub family: Option<Family>,
    /// IANA protocol number, when one value is matched exactly.
    pub proto: Option<u8>,
    /// Whether the header is sure to be neither IPv4 nor IPv6: an ARP field, or an
    /// `eth.type` of another protocol, is matched.
    pub not_ip: bool,
}

/// The headers, outer and inner, that a set of matched fields pins down; `exact` gives a
/// field's value where it is matched exactly (`ip.proto 6`), `None` otherwise.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Context {
    pub outer: Headers,
    pub inner: Headers,
    pub tunnel: Option<Tunnel>,
}

impl Context {
    pub fn of(fields: impl IntoIterator<Item = (Field, Option<u128>)>) -> Context {
        let mut c = Context::default();
        for (f, exact) in fields {
            let h = if f.inner { &mut c.inner } else { &mut c.outer };
            match f.id {
                FieldId::EthType if exact == Some(ETHERTYPE_IPV4) => h.family = Some(Family::V4),
                FieldId::EthType if exact == Some(ETHERTYPE_IPV6) => h.family = Some(Family::V6),
                FieldId::Ipv4Src | FieldId::Ipv4Dst => h.family = Some(Family::V4),
                FieldId::Ipv6Src | FieldId::Ipv6Dst => h.family = Some(Family::V6),
                FieldId::EthType if exact.is_some() => h.not_ip = true,
                FieldId::ArpOp | FieldId::ArpSha | FieldId::ArpSpa | FieldId::ArpTpa => {
                    h.not_ip = true
                }
                FieldId::IpProto => h.proto = exact.and_then(|v| u8::try_from(v).ok()),
                FieldId::TcpSrc | FieldId::TcpDst | FieldId::TcpFlags => h.proto = Some(6),
                FieldId::UdpSrc | FieldId::UdpDst => h.proto = Some(17),
                FieldId::IcmpType | FieldId::IcmpCode => {
                    h.family = Some(Family::V4);
                    h.proto = Some(1);
                }
                // A neighbour discovery target is in an ICMPv6 message.
                FieldId::Icmp6Type | FieldId::Icmp6Code | FieldId::NdTarget => {
                    h.family = Some(Family::V6);
                    h.proto = Some(58);
                }
                FieldId::VxlanVni => c.tunnel = Some(Tunnel::Vxlan),
                FieldId::GeneveVni => c.tunnel = Some(Tunnel::Geneve),
                _ => {}
            }
        }
        c
    }
}

/// Where field `f` is matched, or why it cannot be in this context.
pub fn match_place(f: Field, cx: &Context) -> Result<Place, String> {
    place(f, cx, false)
}

/// The selectors of a header (`layer`: "outer" or "inner") of IP version `family`: its
/// type, which selects the union member a match reads, and the parser's verdict, which is
/// what makes a packet of another version miss.
pub fn family_selectors(layer: &str, family: Family) -> [Selector; 2] {
    let (ty, meta) = match family {
        Family::V4 => ("DOCA_FLOW_L3_TYPE_IP4", "DOCA_FLOW_L3_META_IPV4"),
        Family::V6 => ("DOCA_FLOW_L3_TYPE_IP6", "DOCA_FLOW_L3_META_IPV6"),
    };
    [
        Selector::new(format!("{layer}.l3_type"), ty),
        Selector::new(format!("parser_meta.{layer}_l3_type"), meta),
    ]
}

/// The selector of the tunnel an inner field `f` is inside, which its rule must match.
fn inner_tunnel(f: Field, cx: &Context) -> Result<Selector, String> {
    let tun = cx.tunnel.ok_or_else(|| {
        format!("{f}: the tunnel it is inside is not matched (vxlan.vni or geneve.vni)")
    })?;
    Ok(tunnel_selector(tun))
}

const ETHERTYPE_IPV4: u128 = 0x0800;
const ETHERTYPE_IPV6: u128 = 0x86dd;

/// A rule's `eth.type` (`f`) of `value` as DOCA Flow matches it: no member holds the
/// EtherType after VLAN tags, but the parser's verdict on that header does, for IPv4 and
/// IPv6.
pub fn ethertype_gate(f: Field, value: u128, cx: &Context) -> Result<Vec<Selector>, String> {
    let layer = if f.inner { "inner" } else { "outer" };
    let family = match value {
        ETHERTYPE_IPV4 => Family::V4,
        ETHERTYPE_IPV6 => Family::V6,
        _ => {
            return Err(format!(
                "{f} {value:#06x}: DOCA Flow matches the EtherType after VLAN tags only as \
                 the parser's IPv4 (0x0800) or IPv6 (0x86dd) verdict"
            ))
        }
    };
    let [_, verdict] = family_selectors(layer, family);
    let mut gate = vec![verdict];
    if f.inner {
        gate.push(inner_tunnel(f, cx)?);
    }
    Ok(gate)
}

/// What DOCA Flow can still check of a field it cannot match (`f` by `pattern`): the
/// header types every packet the field matches is sure to have. An ARP field's packet
/// is no IP one to the parser, a neighbour discovery target's is ICMPv6, a Geneve
/// option's is in Geneve; an `eth.type` that no IP packet has is no IP one either.
/// Matching these instead of the field takes more packets, never fewer.
pub fn implied_selectors(f: Field, pattern: &Pattern, cx: &Context) -> Vec<Selector> {
    let layer = if f.inner { "inner" } else { "outer" };
    let tunnel = || inner_tunnel(f, cx).ok().filter(|_| f.inner);
    let not_ip = || {
        let verdict = Selector::new(format!("parser_meta.{layer}_l3_type"), L3_META_NONE);
        [verdict].into_iter().chain(tunnel()).collect()
    };
    match f.id {
        FieldId::ArpOp | FieldId::ArpSha | FieldId::ArpSpa | FieldId::ArpTpa => not_ip(),
        FieldId::EthType
            if !pattern.matches(ETHERTYPE_IPV4) && !pattern.matches(ETHERTYPE_IPV6) =>
        {
            not_ip()
        }
        FieldId::NdTarget => {
            let icmp6 = Field {
                id: FieldId::Icmp6Type,
                inner: f.inner,
            };
            match_place(icmp6, cx).map_or_else(|_| Vec::new(), |p| p.selectors)
        }
        FieldId::GeneveOptClass | FieldId::GeneveOptType => {
            vec![tunnel_selector(Tunnel::Geneve)]
        }
        _ => match_place(f, cx).map_or_else(|_| Vec::new(), |p| p.selectors),
    }
}

/// The parser's verdict on an L3 header that is neither IPv4 nor IPv6.
const L3_META_NONE: &str = "DOCA_FLOW_L3_META_NONE";

/// Where `set` writes field `f` in a `doca_flow_actions`, or why it cannot.
pub fn set_place(f: Field, cx: &Context) -> Result<Place, String> {
    if f.inner {
        return Err(format!(
            "`set {f}`: DOCA Flow actions rewrite the outer and tunnel headers only"
        ));
    }
    place(f, cx, true)
}

fn place(f: Field, cx: &Context, setting: bool) -> Result<Place, String> {
    let layer = if f.inner { "inner" } else { "outer" };
    let h = if f.inner { cx.inner } else { cx.outer };
    let mut selectors = Vec::new();
    if f.inner {
        selectors.push(inner_tunnel(f, cx)?);
    }
    // As with the IP version (see [`family_selectors`]): the header type and the
    // parser's verdict.
    let l3 = |family: Family| family_selectors(layer, family);
    let l4 = |ty: &'static str, meta: &'static str| {
        [
            Selector::new(format!("{layer}.l4_type_ext"), ty),
            Selector::new(format!("parser_meta.{layer}_l4_type"), meta),
        ]
    };
    let ip = |v4: &str, v6: &str| -> Result<(String, [Selector; 2]), String> {
        match h.family {
            Some(Family::V4) => Ok((format!("{layer}.ip4.{v4}"), l3(Family::V4))),
            Some(Family::V6) => Ok((format!("{layer}.ip6.{v6}"), l3(Family::V6))),
            None => Err(format!(
                "{f}: DOCA Flow reads it from the IPv4 or the IPv6 header, and nothing beside \
                 it says which (add an ipv4 or ipv6 field)"
            )),
        }
    };
    let tcp = || l4("DOCA_FLOW_L4_TYPE_EXT_TCP", "DOCA_FLOW_L4_META_TCP");
    let udp = || l4("DOCA_FLOW_L4_TYPE_EXT_UDP", "DOCA_FLOW_L4_META_UDP");
    let mut shift = 0;
    let member = match f.id {
        FieldId::EthSrc => format!("{layer}.eth.src_mac"),
        FieldId::EthDst => format!("{layer}.eth.dst_mac"),
        FieldId::EthType => {
            return Err(format!(
                "{f} is the EtherType after any VLAN tags, which no one DOCA Flow member \
                 holds: a rule matches 0x0800 and 0x86dd as the parser's IPv4 and IPv6 \
                 verdicts, no other value, and a table no value"
            ))
        }
        FieldId::VlanId | FieldId::VlanPcp => {
            selectors.push(Selector::new(
                format!("{layer}.l2_valid_headers"),
                "DOCA_FLOW_L2_VALID_HEADER_VLAN_0",
            ));
            if f.id == FieldId::VlanPcp {
                shift = 13;
            }
            format!("{layer}.eth_vlan[0].tci")
        }
        FieldId::Ipv4Src => {
            selectors.extend(l3(Family::V4));
            format!("{layer}.ip4.src_ip")
        }
        FieldId::Ipv4Dst => {
            selectors.extend(l3(Family::V4));
            format!("{layer}.ip4.dst_ip")
        }
        FieldId::Ipv6Src => {
            selectors.extend(l3(Family::V6));
            format!("{layer}.ip6.src_ip")
        }
        FieldId::Ipv6Dst => {
            selectors.extend(l3(Family::V6));
            format!("{layer}.ip6.dst_ip")
        }
        FieldId::IpProto => {
            let (m, s) = ip("next_proto", "next_proto")?;
            selectors.extend(s);
            m
        }
        FieldId::IpDscp | FieldId::IpEcn => {
            let (m, s) = ip("dscp_ecn", "traffic_class")?;
            selectors.extend(s);
            if f.id == FieldId::IpDscp {
                shift = 2;
            }
            m
        }
        FieldId::IpTtl => {
            let (m, s) = ip("ttl", "hop_limit")?;
            selectors.extend(s);
            m
        }
        FieldId::L4Src | FieldId::L4Dst => {
            let end = if f.id == FieldId::L4Src { "src" } else { "dst" };
            match h.proto {
                Some(6) => {
                    selectors.extend(tcp());
                    format!("{layer}.tcp.l4_port.{end}_port")
                }
                Some(17) => {
                    selectors.extend(udp());
                    format!("{layer}.udp.l4_port.{end}_port")
                }
                _ => {
                    return Err(format!(
                        "{f} is the port of any protocol with ports (SCTP, DCCP and UDP-Lite \
                         too), where DOCA Flow parses TCP's and UDP's: match ip.proto 6 or \
                         17 beside it, or use tcp.{end} or udp.{end}"
                    ))
                }
            }
        }
        FieldId::TcpSrc | FieldId::TcpDst | FieldId::TcpFlags => {
            selectors.extend(tcp());
            match f.id {
                FieldId::TcpSrc => format!("{layer}.tcp.l4_port.src_port"),
                FieldId::TcpDst => format!("{layer}.tcp.l4_port.dst_port"),
                _ => format!("{layer}.tcp.flags"),
            }
        }
        FieldId::UdpSrc | FieldId::UdpDst => {
            selectors.extend(udp());
            let end = if f.id == FieldId::UdpSrc {
                "src"
            } else {
                "dst"
            };
            format!("{layer}.udp.l4_port.{end}_port")
        }
        FieldId::IcmpType | FieldId::IcmpCode => {
            // parser_meta has one ICMP type for both versions: the IP version tells them apart.
            selectors.extend(l3(Family::V4));
            selectors.extend(l4("DOCA_FLOW_L4_TYPE_EXT_ICMP", "DOCA_FLOW_L4_META_ICMP"));
            let m = if f.id == FieldId::IcmpType {
                "type"
            } else {
                "code"
            };
            format!("{layer}.icmp.{m}")
        }
        FieldId::Icmp6Type | FieldId::Icmp6Code => {
            selectors.extend(l3(Family::V6));
            selectors.extend(l4("DOCA_FLOW_L4_TYPE_EXT_ICMP6", "DOCA_FLOW_L4_META_ICMP"));
            let m = if f.id == FieldId::Icmp6Type {
                "type"
            } else {
                "code"
            };
            format!("{layer}.icmp.{m}")
        }
        FieldId::VxlanVni => {
            selectors.push(tunnel_selector(Tunnel::Vxlan));
            // The VNI is the top 24 bits of the VXLAN header's second word (RFC 7348 §5).
            shift = 8;
            "tun.vxlan_tun_id".into()
        }
        FieldId::GeneveVni => {
            selectors.push(tunnel_selector(Tunnel::Geneve));
            // As VXLAN's: the high 24 bits of the header's second word (RFC 8926 §3.4).
            shift = 8;
            "tun.geneve.vni".into()
        }
        FieldId::ArpOp
        | FieldId::ArpSha
        | FieldId::ArpSpa
        | FieldId::ArpTpa
        | FieldId::NdTarget => {
            return Err(format!(
                "{f}: DOCA Flow parses neither ARP nor the body of neighbour discovery \
                 messages"
            ))
        }
        FieldId::GeneveOptClass | FieldId::GeneveOptType => {
            return Err(format!(
                "{f}: Geneve options are matched through a TLV parser \
                 (doca_flow_parser_geneve_opt_create), which is not planned yet"
            ))
        }
        FieldId::CtState => {
            return Err(
                "ct.state: connection tracking runs on the Arm cores (DOCA Flow CT is not \
                 planned yet)"
                    .into(),
            )
        }
        FieldId::InPort if !setting => "parser_meta.port_id".into(),
        FieldId::InPort => return Err("in_port cannot be set".into()),
        FieldId::MetaMark => "meta.pkt_meta".into(),
    };
    Ok(Place {
        member,
        selectors,
        shift,
    })
}

fn tunnel_selector(t: Tunnel) -> Selector {
    Selector::new(
        "tun.type",
        match t {
            Tunnel::Vxlan => "DOCA_FLOW_TUN_VXLAN",
            Tunnel::Geneve => "DOCA_FLOW_TUN_GENEVE",
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field(name: &str) -> Field {
        Field::parse(name).unwrap()
    }

    #[test]
    fn family_fields_bring_their_selector() {
        let cx = Context::default();
        let p = match_place(field("ipv4.dst"), &cx).unwrap();
        assert_eq!(p.member, "outer.ip4.dst_ip");
        assert_eq!(p.selectors[0].value, "DOCA_FLOW_L3_TYPE_IP4");
        assert_eq!(p.selectors[1].member, "parser_meta.outer_l3_type");
    }

    #[test]
    fn fields_of_either_family_need_it_pinned() {
        let ttl = field("ip.ttl");
        assert!(match_place(ttl, &Context::default()).is_err());
        let cx = Context::of([(field("ipv6.src"), None)]);
        assert_eq!(match_place(ttl, &cx).unwrap().member, "outer.ip6.hop_limit");
    }

    #[test]
    fn l4_ports_need_tcp_or_udp_pinned() {
        let dst = field("l4.dst");
        assert!(match_place(dst, &Context::default()).is_err());
        let cx = Context::of([(field("ip.proto"), Some(17)), (field("ipv4.src"), None)]);
        assert_eq!(
            match_place(dst, &cx).unwrap().member,
            "outer.udp.l4_port.dst_port"
        );
        let sctp = Context::of([(field("ip.proto"), Some(132))]);
        assert!(match_place(dst, &sctp).is_err());
    }

    #[test]
    fn inner_fields_need_their_tunnel() {
        let f = field("inner.ipv4.dst");
        assert!(match_place(f, &Context::default()).is_err());
        let cx = Context::of([(field("vxlan.vni"), Some(100))]);
        let p = match_place(f, &cx).unwrap();
        assert_eq!(p.member, "inner.ip4.dst_ip");
        assert!(p.selectors.iter().any(|s| s.value == "DOCA_FLOW_TUN_VXLAN"));
        assert!(set_place(f, &cx).is_err());
    }

    #[test]
    fn vlan_priority_shares_the_tci() {
        let p = match_place(field("vlan.pcp"), &Context::default()).unwrap();
        assert_eq!((p.member.as_str(), p.shift), ("outer.eth_vlan[0].tci", 13));
    }
}
