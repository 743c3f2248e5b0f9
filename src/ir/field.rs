//! The match and set fields a pipeline can name, with their widths and value kinds.

use std::fmt;

/// How a field's values are written and how wide they are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueKind {
    /// An unsigned integer of `bits` bits.
    Int {
        bits: u8,
    },
    Mac,
    Ipv4,
    Ipv6,
    /// TCP flag bits, by number or by name (`syn+ack`).
    TcpFlags,
    /// Connection-tracking state names; matched as a set of state bits.
    CtState,
    /// A port of the pipeline, by name.
    Port,
}

impl ValueKind {
    pub fn bits(self) -> u8 {
        match self {
            ValueKind::Int { bits } => bits,
            ValueKind::Mac => 48,
            ValueKind::Ipv4 => 32,
            ValueKind::Ipv6 => 128,
            ValueKind::TcpFlags => 8,
            ValueKind::CtState => 5,
            ValueKind::Port => 16,
        }
    }

    /// All ones over the field's width.
    pub fn full_mask(self) -> u128 {
        match self.bits() {
            128 => u128::MAX,
            b => (1u128 << b) - 1,
        }
    }
}

/// Calls macro `$m!` with every field id, in declaration order (after `$args`, if given):
/// the one list of fields, from which `FieldId` and the engine's per-field readers are
/// both made.
macro_rules! with_field_ids {
    ($m:ident $(, $args:tt)?) => {
        $m! {
            $($args;)?
            EthSrc,
            EthDst,
            EthType,
            VlanId,
            VlanPcp,
            Ipv4Src,
            Ipv4Dst,
            Ipv6Src,
            Ipv6Dst,
            IpProto,
            IpDscp,
            IpEcn,
            IpTtl,
            L4Src,
            L4Dst,
            TcpSrc,
            TcpDst,
            TcpFlags,
            UdpSrc,
            UdpDst,
            IcmpType,
            IcmpCode,
            Icmp6Type,
            Icmp6Code,
            ArpOp,
            ArpSha,
            ArpSpa,
            ArpTpa,
            NdTarget,
            VxlanVni,
            GeneveVni,
            GeneveOptClass,
            GeneveOptType,
            CtState,
            InPort,
            MetaMark,
        }
    };
}
pub(crate) use with_field_ids;

macro_rules! declare_field_id {
    ($($id:ident),* $(,)?) => {
        /// Header fields, plus metadata (`ct.state`, `in_port`, `meta.mark`).
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub enum FieldId {
            $($id),*
        }
    };
}
with_field_ids!(declare_field_id);

/// Static facts about one field.
#[derive(Debug, Clone, Copy)]
pub struct FieldInfo {
    pub id: FieldId,
    pub name: &'static str,
    pub kind: ValueKind,
    /// May be used with the `inner.` prefix (a header that also exists inside a tunnel).
    pub has_inner: bool,
    /// May be rewritten with `set`.
    pub settable: bool,
    pub doc: &'static str,
}

const fn f(
    id: FieldId,
    name: &'static str,
    kind: ValueKind,
    has_inner: bool,
    settable: bool,
    doc: &'static str,
) -> FieldInfo {
    FieldInfo {
        id,
        name,
        kind,
        has_inner,
        settable,
        doc,
    }
}

const fn int(bits: u8) -> ValueKind {
    ValueKind::Int { bits }
}

/// Every field, in the order the language documentation lists them.
pub const FIELDS: &[FieldInfo] = &[
    f(
        FieldId::EthSrc,
        "eth.src",
        ValueKind::Mac,
        true,
        true,
        "Ethernet source MAC",
    ),
    f(
        FieldId::EthDst,
        "eth.dst",
        ValueKind::Mac,
        true,
        true,
        "Ethernet destination MAC",
    ),
    f(
        FieldId::EthType,
        "eth.type",
        int(16),
        true,
        false,
        "EtherType after any VLAN tags",
    ),
    f(
        FieldId::VlanId,
        "vlan.id",
        int(12),
        true,
        true,
        "outermost 802.1Q VLAN id",
    ),
    f(
        FieldId::VlanPcp,
        "vlan.pcp",
        int(3),
        true,
        true,
        "outermost 802.1Q priority",
    ),
    f(
        FieldId::Ipv4Src,
        "ipv4.src",
        ValueKind::Ipv4,
        true,
        true,
        "IPv4 source address",
    ),
    f(
        FieldId::Ipv4Dst,
        "ipv4.dst",
        ValueKind::Ipv4,
        true,
        true,
        "IPv4 destination address",
    ),
    f(
        FieldId::Ipv6Src,
        "ipv6.src",
        ValueKind::Ipv6,
        true,
        true,
        "IPv6 source address",
    ),
    f(
        FieldId::Ipv6Dst,
        "ipv6.dst",
        ValueKind::Ipv6,
        true,
        true,
        "IPv6 destination address",
    ),
    f(
        FieldId::IpProto,
        "ip.proto",
        int(8),
        true,
        false,
        "IPv4 protocol / IPv6 next header after extension headers",
    ),
    f(
        FieldId::IpDscp,
        "ip.dscp",
        int(6),
        true,
        true,
        "DSCP (IPv4 TOS / IPv6 traffic class, upper 6 bits)",
    ),
    f(
        FieldId::IpEcn,
        "ip.ecn",
        int(2),
        true,
        true,
        "ECN (lower 2 bits of TOS / traffic class)",
    ),
    f(
        FieldId::IpTtl,
        "ip.ttl",
        int(8),
        true,
        true,
        "IPv4 TTL / IPv6 hop limit",
    ),
    f(
        FieldId::L4Src,
        "l4.src",
        int(16),
        true,
        true,
        "TCP, UDP, SCTP or UDP-Lite source port, whichever is present",
    ),
    f(
        FieldId::L4Dst,
        "l4.dst",
        int(16),
        true,
        true,
        "TCP, UDP, SCTP or UDP-Lite destination port, whichever is present",
    ),
    f(
        FieldId::TcpSrc,
        "tcp.src",
        int(16),
        true,
        true,
        "TCP source port",
    ),
    f(
        FieldId::TcpDst,
        "tcp.dst",
        int(16),
        true,
        true,
        "TCP destination port",
    ),
    f(
        FieldId::TcpFlags,
        "tcp.flags",
        ValueKind::TcpFlags,
        true,
        false,
        "TCP flags (fin syn rst psh ack urg ece cwr)",
    ),
    f(
        FieldId::UdpSrc,
        "udp.src",
        int(16),
        true,
        true,
        "UDP source port",
    ),
    f(
        FieldId::UdpDst,
        "udp.dst",
        int(16),
        true,
        true,
        "UDP destination port",
    ),
    f(
        FieldId::IcmpType,
        "icmp.type",
        int(8),
        true,
        false,
        "ICMP type",
    ),
    f(
        FieldId::IcmpCode,
        "icmp.code",
        int(8),
        true,
        false,
        "ICMP code",
    ),
    f(
        FieldId::Icmp6Type,
        "icmp6.type",
        int(8),
        true,
        false,
        "ICMPv6 type",
    ),
    f(
        FieldId::Icmp6Code,
        "icmp6.code",
        int(8),
        true,
        false,
        "ICMPv6 code",
    ),
    f(
        FieldId::ArpOp,
        "arp.op",
        int(16),
        true,
        false,
        "ARP operation: 1 request, 2 reply (RFC 826)",
    ),
    f(
        FieldId::ArpSha,
        "arp.sha",
        ValueKind::Mac,
        true,
        false,
        "ARP sender hardware address",
    ),
    f(
        FieldId::ArpSpa,
        "arp.spa",
        ValueKind::Ipv4,
        true,
        false,
        "ARP sender IPv4 address",
    ),
    f(
        FieldId::ArpTpa,
        "arp.tpa",
        ValueKind::Ipv4,
        true,
        false,
        "ARP target IPv4 address",
    ),
    f(
        FieldId::NdTarget,
        "nd.target",
        ValueKind::Ipv6,
        true,
        false,
        "target address of an IPv6 neighbour solicitation or advertisement (RFC 4861 §4.3, §4.4)",
    ),
    f(
        FieldId::VxlanVni,
        "vxlan.vni",
        int(24),
        false,
        false,
        "VXLAN network identifier (RFC 7348 §5)",
    ),
    f(
        FieldId::GeneveVni,
        "geneve.vni",
        int(24),
        false,
        false,
        "Geneve virtual network identifier (RFC 8926 §3.4)",
    ),
    f(
        FieldId::GeneveOptClass,
        "geneve.opt.class",
        int(16),
        false,
        false,
        "class of a Geneve option present in the header",
    ),
    f(
        FieldId::GeneveOptType,
        "geneve.opt.type",
        int(8),
        false,
        false,
        "type of a Geneve option present in the header",
    ),
    f(
        FieldId::CtState,
        "ct.state",
        ValueKind::CtState,
        false,
        false,
        "connection-tracking state: new, established, related, invalid, untracked",
    ),
    f(
        FieldId::InPort,
        "in_port",
        ValueKind::Port,
        false,
        false,
        "port the packet arrived on",
    ),
    f(
        FieldId::MetaMark,
        "meta.mark",
        int(32),
        false,
        true,
        "packet mark set by `mark`",
    ),
];

/// A field as used in a match or `set`: which one, and whether it is the copy inside a tunnel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Field {
    pub id: FieldId,
    pub inner: bool,
}

impl Field {
    pub fn info(self) -> &'static FieldInfo {
        info(self.id)
    }

    pub fn kind(self) -> ValueKind {
        self.info().kind
    }

    /// Looks up `ipv4.dst` or `inner.ipv4.dst`.
    pub fn parse(name: &str) -> Option<Field> {
        let (inner, base) = match name.strip_prefix("inner.") {
            Some(b) => (true, b),
            None => (false, name),
        };
        let i = FIELDS.iter().find(|i| i.name == base)?;
        (!inner || i.has_inner).then_some(Field { id: i.id, inner })
    }

    /// Every name `parse` accepts, for suggestions.
    pub fn all_names() -> impl Iterator<Item = String> {
        FIELDS.iter().flat_map(|i| {
            let inner = i.has_inner.then(|| format!("inner.{}", i.name));
            std::iter::once(i.name.to_owned()).chain(inner)
        })
    }
}

pub fn info(id: FieldId) -> &'static FieldInfo {
    // FIELDS is ordered like FieldId, which a test checks.
    &FIELDS[id as usize]
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.inner {
            f.write_str("inner.")?;
        }
        f.write_str(self.info().name)
    }
}

/// TCP flag names and bits (RFC 9293 §3.1, RFC 3168 §6.1 for ECE and CWR).
pub const TCP_FLAG_NAMES: &[(&str, u128)] = &[
    ("fin", 0x01),
    ("syn", 0x02),
    ("rst", 0x04),
    ("psh", 0x08),
    ("ack", 0x10),
    ("urg", 0x20),
    ("ece", 0x40),
    ("cwr", 0x80),
];

/// Connection-tracking states as bits of the `ct.state` field.
pub const CT_STATE_NAMES: &[(&str, u128)] = &[
    ("new", 0x1),
    ("established", 0x2),
    ("related", 0x4),
    ("invalid", 0x8),
    ("untracked", 0x10),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_indexed_by_id() {
        for (i, f) in FIELDS.iter().enumerate() {
            assert_eq!(f.id as usize, i, "{}", f.name);
        }
    }

    #[test]
    fn inner_only_where_allowed() {
        assert!(Field::parse("inner.ipv4.dst").is_some());
        assert!(Field::parse("inner.vxlan.vni").is_none());
        assert_eq!(
            Field::parse("udp.dst").map(|f| f.to_string()),
            Some("udp.dst".into())
        );
    }
}
