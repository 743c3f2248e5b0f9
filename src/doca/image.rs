//! What a plan's pipes and entries write into DOCA Flow's structures, member by member:
//! `struct doca_flow_match` (a template, an entry, a mask) and `struct doca_flow_actions`
//! of DOCA 3.0's `doca_flow.h` and `doca_flow_net.h`. A table's entries are made here from
//! the program's keys and prefixes, so what the executor hands the NIC is an image, not a
//! recipe.

use super::fields::Selector;
use super::plan::{EntryMatch, HwPipe, Step, TemplateItem};
use crate::ir::{Field, PipeBody};

/// How a member holds its bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Network byte order: `doca_be16_t`, `doca_be32_t`, and byte arrays (MACs, IPv6
    /// addresses as `doca_be32_t[4]`).
    Network,
    /// The CPU's: `parser_meta.port_id` is a `uint16_t`, the logical port id.
    Host,
}

/// A member's width in bytes and byte order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    pub width: u8,
    pub order: Order,
}

/// The layout of a value member the plan sets, by its C path; `None` for members the plan
/// never gives a value (enumerations are [`Selector`]s).
pub fn layout(member: &str) -> Option<Layout> {
    let net = |width| {
        Some(Layout {
            width,
            order: Order::Network,
        })
    };
    match member {
        "parser_meta.port_id" => Some(Layout {
            width: 2,
            order: Order::Host,
        }),
        // `pkt_meta` is a doca_be32_t; VXLAN's and Geneve's VNI sit in the high 24 bits of
        // a doca_be32_t, over the reserved byte (RFC 7348 §5, RFC 8926 §3.4).
        "meta.pkt_meta" | "tun.vxlan_tun_id" | "tun.geneve.vni" => net(4),
        m => match m
            .strip_prefix("outer.")
            .or_else(|| m.strip_prefix("inner."))?
        {
            "eth.src_mac" | "eth.dst_mac" => net(6),
            "ip4.src_ip" | "ip4.dst_ip" => net(4),
            "ip6.src_ip" | "ip6.dst_ip" => net(16),
            "eth_vlan[0].tci"
            | "tcp.l4_port.src_port"
            | "tcp.l4_port.dst_port"
            | "udp.l4_port.src_port"
            | "udp.l4_port.dst_port" => net(2),
            "ip4.next_proto" | "ip4.dscp_ecn" | "ip4.ttl" | "ip6.next_proto"
            | "ip6.traffic_class" | "ip6.hop_limit" | "tcp.flags" | "icmp.type" | "icmp.code" => {
                net(1)
            }
            _ => None,
        },
    }
}

/// A value member's bits and mask, right-aligned in the member's width.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bits {
    pub layout: Layout,
    pub value: u128,
    pub mask: u128,
}

impl Bits {
    /// The value's bytes most significant first, as many as the member is wide; a
    /// [`Order::Host`] member is written from them as a native integer.
    pub fn value_bytes(&self) -> ([u8; 16], usize) {
        bytes(self.value, self.layout.width)
    }

    pub fn mask_bytes(&self) -> ([u8; 16], usize) {
        bytes(self.mask, self.layout.width)
    }
}

fn bytes(v: u128, width: u8) -> ([u8; 16], usize) {
    let w = usize::from(width);
    let mut out = [0; 16];
    out[..w].copy_from_slice(&v.to_be_bytes()[16 - w..]);
    (out, w)
}

/// What one member is set to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Setting {
    /// An enumerator of `doca_flow.h`: a header type, a parser verdict, a meter colour.
    /// In a mask the member is all ones.
    Enum(&'static str),
    Bits(Bits),
}

/// The members a structure sets, each once, in the order first set.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Image(pub Vec<(String, Setting)>);

/// `member=NAME` for an enumerator; `member=VALUE/MASK` in hex bytes, most significant
/// first, for a value (a host-order member in decimal).
impl std::fmt::Display for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (member, setting)) in self.0.iter().enumerate() {
            let sep = if i == 0 { "" } else { " " };
            match setting {
                Setting::Enum(name) => write!(f, "{sep}{member}={name}")?,
                Setting::Bits(b) if b.layout.order == Order::Host => {
                    write!(f, "{sep}{member}={}/{}", b.value, b.mask)?
                }
                Setting::Bits(b) => {
                    write!(f, "{sep}{member}=")?;
                    let hex = |f: &mut std::fmt::Formatter<'_>, (bytes, n): ([u8; 16], usize)| {
                        bytes[..n].iter().try_for_each(|x| write!(f, "{x:02x}"))
                    };
                    hex(f, b.value_bytes())?;
                    f.write_str("/")?;
                    hex(f, b.mask_bytes())?;
                }
            }
        }
        Ok(())
    }
}

/// A member the image cannot hold as the plan asks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ImageError {
    /// `{0}` is not a member DOCA Flow's structures have a value in
    #[error("`{0}` is not a member DOCA Flow's structures have a value in")]
    UnknownMember(String),
    /// `{member}`: {value:#x} does not fit its {width} bytes
    #[error("`{member}`: {value:#x} does not fit its {width} bytes")]
    TooWide {
        member: String,
        value: u128,
        width: u8,
    },
    /// `{member}` is set to {first} and to {second}
    #[error("`{member}` is set to {first} and to {second}")]
    Conflict {
        member: String,
        first: String,
        second: String,
    },
}

impl Image {
    /// The setting of `member`, if the image has one.
    pub fn get(&self, member: &str) -> Option<&Setting> {
        self.0.iter().find(|(m, _)| m == member).map(|(_, s)| s)
    }

    fn select(&mut self, s: &Selector) -> Result<(), ImageError> {
        match self.get(&s.member) {
            None => {
                self.0.push((s.member.clone(), Setting::Enum(s.value)));
                Ok(())
            }
            Some(Setting::Enum(v)) if *v == s.value => Ok(()),
            Some(other) => Err(ImageError::Conflict {
                member: s.member.clone(),
                first: format!("{other:?}"),
                second: s.value.into(),
            }),
        }
    }

    /// Sets the bits of `mask` in `member` to those of `value`; fields sharing a member
    /// (a VLAN id and priority in the TCI, DSCP and ECN) each set their own bits.
    fn set(&mut self, member: &str, value: u128, mask: u128) -> Result<(), ImageError> {
        let layout = layout(member).ok_or_else(|| ImageError::UnknownMember(member.into()))?;
        let top = 8 * u32::from(layout.width);
        if top < 128 && (mask >> top != 0 || value >> top != 0) {
            return Err(ImageError::TooWide {
                member: member.into(),
                value: value | mask,
                width: layout.width,
            });
        }
        let value = value & mask;
        match self.0.iter_mut().find(|(m, _)| m == member) {
            None => self.0.push((
                member.into(),
                Setting::Bits(Bits {
                    layout,
                    value,
                    mask,
                }),
            )),
            Some((_, Setting::Bits(b))) if (b.value ^ value) & b.mask & mask == 0 => {
                b.value |= value;
                b.mask |= mask;
            }
            Some((_, other)) => {
                return Err(ImageError::Conflict {
                    member: member.into(),
                    first: format!("{other:?}"),
                    second: format!("{value:#x}/{mask:#x}"),
                })
            }
        }
        Ok(())
    }
}

/// A control-pipe (or plan-made) entry's match and mask: its selectors and the values of
/// its fields.
pub fn entry_match(selectors: &[Selector], matches: &[EntryMatch]) -> Result<Image, ImageError> {
    let mut image = Image::default();
    for s in selectors {
        image.select(s)?;
    }
    for m in matches {
        image.set(&m.member, m.value << m.shift, m.mask << m.shift)?;
    }
    Ok(image)
}

/// A basic or LPM pipe's match template: its fixed selectors, and the members its entries
/// set with the bits they may set (DOCA Flow's "changeable" fields; the mask of the
/// pipe's `match_mask`). `fields` are the pipe's table fields, in template order.
pub fn template(pipe: &HwPipe, fields: &[Field]) -> Result<Image, ImageError> {
    let mut image = Image::default();
    let mut fields = fields.iter();
    for item in &pipe.template {
        match item {
            TemplateItem::Fixed(s) => image.select(s)?,
            TemplateItem::PerEntry { member, shift } => {
                // The ports pipe's port id has no pipeline field: all of the member.
                let ones = fields
                    .next()
                    .map_or(u128::from(u16::MAX), |f| f.kind().full_mask());
                image.set(member, ones << shift, ones << shift)?;
            }
        }
    }
    Ok(image)
}

/// Entry `i` of a table pipe: its key's (or prefix's) bits in the template's per-entry
/// members, over the fixed selectors.
pub fn table_entry(pipe: &HwPipe, body: &PipeBody, i: usize) -> Result<Image, ImageError> {
    let per_entry = pipe.template.iter().filter_map(|t| match t {
        TemplateItem::PerEntry { member, shift } => Some((member, *shift)),
        TemplateItem::Fixed(_) => None,
    });
    let mut image = Image::default();
    for item in &pipe.template {
        if let TemplateItem::Fixed(s) = item {
            image.select(s)?;
        }
    }
    match body {
        PipeBody::Exact { fields, keys, .. } => {
            let key = &keys[i * fields.len()..][..fields.len()];
            for ((member, shift), (f, v)) in per_entry.zip(fields.iter().zip(key)) {
                let ones = f.kind().full_mask();
                image.set(member, v << shift, ones << shift)?;
            }
        }
        PipeBody::Lpm {
            field, prefixes, ..
        } => {
            let bits = u32::from(field.kind().bits());
            let p = prefixes[i];
            let len = u32::from(p.len);
            let mask = match len {
                0 => 0,
                _ => field.kind().full_mask() >> (bits - len) << (bits - len),
            };
            if let Some((member, shift)) = per_entry.into_iter().next() {
                image.set(member, p.value << shift, mask << shift)?;
            }
        }
        PipeBody::Rules(_) => {}
    }
    Ok(image)
}

/// An action template's rewrites of packet and metadata (`struct doca_flow_actions`),
/// with each member's mask: the bits a `Modify` sets, every bit an `Add` adds to.
pub fn rewrites(steps: &[Step]) -> Result<Image, ImageError> {
    let mut image = Image::default();
    for step in steps {
        match step {
            Step::Modify {
                member,
                value,
                mask,
            } => image.set(member, *value, *mask)?,
            Step::Add { member, value } => {
                let width = layout(member)
                    .ok_or_else(|| ImageError::UnknownMember(member.clone()))?
                    .width;
                image.set(member, *value, u128::MAX >> (128 - 8 * u32::from(width)))?
            }
            Step::Decap(_) | Step::PopVlan | Step::PushVlan { .. } | Step::Encap(_) => {}
        }
    }
    Ok(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(member: &str, value: u128, mask: u128, shift: u8) -> EntryMatch {
        EntryMatch {
            field: Field::parse("ip.dscp").unwrap(),
            member: member.into(),
            shift,
            value,
            mask,
        }
    }

    #[test]
    fn members_are_their_c_widths_in_network_order() {
        let b = |member: &str, value| {
            let img = entry_match(&[], &[m(member, value, 0xffff_ffff, 0)]);
            match img.map(|i| i.0[0].1.clone()) {
                Ok(Setting::Bits(b)) => b,
                other => panic!("{other:?}"),
            }
        };
        let dst = b("outer.ip4.dst_ip", 0x0a01_0203);
        let (bytes, width) = dst.value_bytes();
        assert_eq!(bytes[..width], [10, 1, 2, 3]);
        assert_eq!(layout("parser_meta.port_id").unwrap().order, Order::Host);
        assert_eq!(layout("inner.ip6.src_ip").unwrap().width, 16);
        assert!(layout("outer.ip4.version_ihl").is_none());
    }

    #[test]
    fn fields_sharing_a_member_set_their_own_bits() {
        let tci = "outer.eth_vlan[0].tci";
        let img = entry_match(&[], &[m(tci, 100, 0xfff, 0), m(tci, 5, 7, 13)]).unwrap();
        let Some(Setting::Bits(b)) = img.get(tci) else {
            panic!("{img:?}")
        };
        assert_eq!((b.value, b.mask), (5 << 13 | 100, 0xefff));
        let clash = entry_match(&[], &[m(tci, 1, 0xfff, 0), m(tci, 2, 0xfff, 0)]);
        assert!(matches!(clash, Err(ImageError::Conflict { .. })));
    }

    #[test]
    fn values_wider_than_their_member_are_refused() {
        let img = entry_match(&[], &[m("outer.ip4.ttl", 0x100, 0x1ff, 0)]);
        assert!(matches!(img, Err(ImageError::TooWide { .. })));
        let img = entry_match(&[], &[m("outer.ip9.ttl", 1, 1, 0)]);
        assert!(matches!(img, Err(ImageError::UnknownMember(_))));
    }

    #[test]
    fn an_add_takes_the_whole_member() {
        let img = rewrites(&[Step::Add {
            member: "outer.ip6.hop_limit".into(),
            value: 0xff,
        }])
        .unwrap();
        let Some(Setting::Bits(b)) = img.get("outer.ip6.hop_limit") else {
            panic!("{img:?}")
        };
        assert_eq!((b.value, b.mask), (0xff, 0xff));
    }
}
