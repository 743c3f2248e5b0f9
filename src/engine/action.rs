//! Packet-rewriting actions: field sets with incremental checksum updates (RFC 1624),
//! TTL decrement, VLAN push and pop, tunnel encapsulation and decapsulation.

use super::packet::{PacketBuf, HEADROOM};
use super::parse::{self, ds_field, Layers, Meta, L3};
use super::DropReason;
use crate::ir::{Encap, Field, FieldId, OuterDscp, Tunnel};
use crate::wire::ethernet::{self, ethertype};
use crate::wire::{
    be16, be32, checksum, ecn, geneve, ip_proto, ipv4, ipv6, put16, sctp, tcp, udp, vxlan,
};
use std::net::IpAddr;

/// Outer headers of one `*.encap` action, built once; per packet only lengths, the UDP
/// source port, the DS field's bits the inner packet gives and checksums are filled in.
#[derive(Debug, Clone)]
pub struct EncapTemplate {
    bytes: Box<[u8]>,
    v6: bool,
    /// Sum of the outer IPv4 header with total length, checksum and the inner packet's
    /// bits of the DS field zero.
    ip_sum: u32,
    /// The bits of the inner packet's DS field the outer one takes: its ECN field
    /// always (RFC 6040 §4.1, normal mode), its DSCP too with `dscp inherit`.
    ds_inherited: u8,
    /// `bytes` again when they are [`SHORT_V4`] long, the common shape: copied and filled
    /// in at places fixed when compiled, with no length to check.
    short_v4: Option<[u8; SHORT_V4]>,
}

const IP_AT: usize = ethernet::HEADER_LEN;
/// Outer headers over IPv4 with a tunnel header of 8 bytes (VXLAN, or Geneve without
/// options).
const SHORT_V4: usize = IP_AT + ipv4::MIN_HEADER_LEN + udp::HEADER_LEN + 8;

impl EncapTemplate {
    pub fn new(e: &Encap) -> EncapTemplate {
        let v6 = e.dst.is_ipv6();
        let (dscp, ds_inherited) = match e.dscp {
            OuterDscp::Fixed(d) => (d, ecn::MASK),
            OuterDscp::Inherit => (0, 0xff),
        };
        let ip_len = if v6 {
            ipv6::HEADER_LEN
        } else {
            ipv4::MIN_HEADER_LEN
        };
        let mut options = Vec::new();
        for o in &e.options {
            geneve::encode_option(&mut options, o.class, o.kind, &o.data);
        }
        let tunnel_len = match e.tunnel {
            Tunnel::Vxlan => vxlan::HEADER_LEN,
            Tunnel::Geneve => geneve::BASE_LEN + options.len(),
        };
        let mut b = vec![0u8; IP_AT + ip_len + udp::HEADER_LEN + tunnel_len];
        ethernet::Repr {
            src: e.smac,
            dst: e.dmac,
            ethertype: if v6 { ethertype::IPV6 } else { ethertype::IPV4 },
        }
        .emit(&mut b);
        match (e.src, e.dst) {
            (IpAddr::V4(s), IpAddr::V4(d)) => ipv4::Repr {
                src: s.octets(),
                dst: d.octets(),
                protocol: ip_proto::UDP,
                ttl: e.ttl,
                dscp,
                dont_frag: true,
                payload_len: 0,
            }
            .emit(&mut b[IP_AT..]),
            (s, d) => ipv6::Repr {
                src: to_v6(s),
                dst: to_v6(d),
                next_header: ip_proto::UDP,
                hop_limit: e.ttl,
                dscp,
                flow_label: 0,
                payload_len: 0,
            }
            .emit(&mut b[IP_AT..]),
        }
        let udp_at = IP_AT + ip_len;
        put16(&mut b, udp_at + 2, e.udp_dst);
        let t = &mut b[udp_at + udp::HEADER_LEN..];
        match e.tunnel {
            Tunnel::Vxlan => vxlan::Repr { vni: e.vni }.emit(t),
            Tunnel::Geneve => geneve::Repr {
                vni: e.vni,
                protocol: ethertype::TEB,
                options: &options,
                critical: e.options.iter().any(|o| o.critical),
            }
            .emit(t),
        }
        let mut ip_sum = 0;
        if !v6 {
            put16(&mut b, IP_AT + 2, 0);
            put16(&mut b, IP_AT + 10, 0);
            ip_sum = checksum::sum(0, &b[IP_AT..IP_AT + ipv4::MIN_HEADER_LEN]);
        }
        EncapTemplate {
            short_v4: if v6 { None } else { b[..].try_into().ok() },
            bytes: b.into_boxed_slice(),
            v6,
            ip_sum,
            ds_inherited,
        }
    }

    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.bytes.is_empty()
    }

    /// Prepends the outer headers. `hash` is the inner flow's hash, spread over the
    /// ephemeral range 49152–65535 as the UDP source port (RFC 7348 §5, RFC 8926 §3.3);
    /// `inner_ds` the inner packet's DS field ([`parse::ds_field`]).
    #[inline(always)]
    pub fn apply(&self, pkt: &mut PacketBuf, hash: u32, inner_ds: u8) -> Result<(), DropReason> {
        let ds = inner_ds & self.ds_inherited;
        match &self.short_v4 {
            Some(head) => self.apply_short_v4(head, pkt, hash, ds),
            None => self.apply_any(pkt, hash, ds),
        }
    }

    /// [`EncapTemplate::apply`] for any outer headers; `ds` the DS field's bits taken
    /// from the inner packet.
    #[inline(never)]
    fn apply_any(&self, pkt: &mut PacketBuf, hash: u32, ds: u8) -> Result<(), DropReason> {
        if !pkt.push_front(self.bytes.len()) {
            return Err(DropReason::NoHeadroom);
        }
        let total = pkt.len();
        let b = pkt.data_mut();
        b[..self.bytes.len()].copy_from_slice(&self.bytes);
        let ip_len = if self.v6 {
            ipv6::HEADER_LEN
        } else {
            ipv4::MIN_HEADER_LEN
        };
        let udp_at = IP_AT + ip_len;
        let udp_len = total - udp_at;
        if total - IP_AT > usize::from(u16::MAX) {
            return Err(DropReason::MtuExceeded);
        }
        put16(b, udp_at, 0xc000 | (hash as u16 & 0x3fff));
        put16(b, udp_at + 4, udp_len as u16);
        if self.v6 {
            // Version, traffic class and flow label share the first word (RFC 8200 §3).
            // The label is the inner flow's too, from other bits of its hash than the
            // port's, never 0 ("no label"), so fabrics that spread flows by addresses and
            // label alone spread the tunnel's (RFC 6438 §3, RFC 6437 §3).
            let label = ((hash >> 12) & 0x000f_ffff).max(1);
            let first = be32(b, IP_AT) | (u32::from(ds) << 20) | label;
            b[IP_AT..IP_AT + 4].copy_from_slice(&first.to_be_bytes());
            put16(b, IP_AT + 4, udp_len as u16);
            // UDP over IPv6 carries a real checksum (RFC 8200 §8.1; RFC 6935/6936 allow a
            // zero one only under conditions this dataplane does not check).
            let src: [u8; 16] = b[IP_AT + 8..IP_AT + 24].try_into().expect("IPv6 header");
            let dst: [u8; 16] = b[IP_AT + 24..IP_AT + 40].try_into().expect("IPv6 header");
            let sum = checksum::sum(
                checksum::pseudo_v6(&src, &dst, ip_proto::UDP, udp_len as u32),
                &b[udp_at..],
            );
            let c = !checksum::fold(sum);
            put16(b, udp_at + 6, if c == 0 { 0xffff } else { c });
        } else {
            let ip_total = (total - IP_AT) as u16;
            b[IP_AT + 1] |= ds;
            put16(b, IP_AT + 2, ip_total);
            put16(
                b,
                IP_AT + 10,
                !checksum::fold(self.ip_sum + u32::from(ds) + u32::from(ip_total)),
            );
            // UDP checksum zero over IPv4 (RFC 7348 §5).
        }
        Ok(())
    }

    /// [`EncapTemplate::apply`] for outer headers of the common shape, `head`.
    #[inline(always)]
    fn apply_short_v4(
        &self,
        head: &[u8; SHORT_V4],
        pkt: &mut PacketBuf,
        hash: u32,
        ds: u8,
    ) -> Result<(), DropReason> {
        const UDP_AT: usize = IP_AT + ipv4::MIN_HEADER_LEN;
        if !pkt.push_front(SHORT_V4) {
            return Err(DropReason::NoHeadroom);
        }
        let ip_total = u16::try_from(pkt.len() - IP_AT).map_err(|_| DropReason::MtuExceeded)?;
        let Some(b) = pkt.data_mut().first_chunk_mut::<SHORT_V4>() else {
            return Err(DropReason::NoHeadroom);
        };
        *b = *head;
        let udp_len = ip_total - ipv4::MIN_HEADER_LEN as u16;
        b[UDP_AT..UDP_AT + 2].copy_from_slice(&(0xc000 | (hash as u16 & 0x3fff)).to_be_bytes());
        b[UDP_AT + 4..UDP_AT + 6].copy_from_slice(&udp_len.to_be_bytes());
        b[IP_AT + 1] |= ds;
        b[IP_AT + 2..IP_AT + 4].copy_from_slice(&ip_total.to_be_bytes());
        let sum = !checksum::fold(self.ip_sum + u32::from(ds) + u32::from(ip_total));
        b[IP_AT + 10..IP_AT + 12].copy_from_slice(&sum.to_be_bytes());
        // UDP checksum zero over IPv4 (RFC 7348 §5).
        Ok(())
    }
}

/// The ECN field a decapsulated packet leaves with, from its inner and outer ones
/// (RFC 6040 §4.2, Figure 4; RFC 9601 extends RFC 6040 to tunnels with a shim header
/// between the IP headers, VXLAN's and Geneve's), or `None` where it must be dropped: a
/// congestion mark on a packet whose transport does not understand one (Not-ECT inside
/// CE) may not be lost or passed on. The Linux kernel's vxlan device answers all sixteen
/// cases the same (tests/kernel_vxlan.rs).
#[inline(always)]
fn decapsulated_ecn(inner: u8, outer: u8) -> Option<u8> {
    match (inner, outer) {
        (ecn::NOT_ECT, ecn::CE) => None,
        (ecn::NOT_ECT, _) => Some(ecn::NOT_ECT),
        (_, ecn::CE) => Some(ecn::CE),
        (_, ecn::ECT1) if inner != ecn::CE => Some(ecn::ECT1),
        _ => Some(inner),
    }
}

fn to_v6(a: IpAddr) -> [u8; 16] {
    match a {
        IpAddr::V6(a) => a.octets(),
        IpAddr::V4(a) => a.to_ipv6_mapped().octets(),
    }
}

/// What a decapsulation found of the outer header's ECN field.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OuterMark {
    /// Anything but the below.
    Unmarked,
    /// Congestion Experienced: the fabric marked the packet, and the mark went inside.
    Ce,
}

/// Removes the outer headers of `tunnel`, checking the header first: VXLAN needs the I
/// flag and zero reserved bits; Geneve may not carry critical options dpuflow does not
/// know (it knows none, RFC 8926 §3.5.1) and may not be an OAM frame. The outer ECN
/// field's mark goes inside (RFC 6040 §4.2).
#[inline]
pub fn decap(pkt: &mut PacketBuf, meta: &Meta, tunnel: Tunnel) -> Result<OuterMark, DropReason> {
    let Some(t) = meta.tunnel.filter(|t| t.kind == tunnel) else {
        return Err(DropReason::NotTunnelled);
    };
    let frame = pkt.data();
    let header = &frame[usize::from(t.header)..usize::from(t.inner)];
    match tunnel {
        Tunnel::Vxlan => {
            if !vxlan::Packet::new_unchecked(header).is_strictly_valid() {
                return Err(DropReason::VxlanInvalid);
            }
        }
        Tunnel::Geneve => {
            let g = geneve::Packet::new_unchecked(header);
            if g.oam() {
                return Err(DropReason::GeneveOam);
            }
            if geneve::options_in(header)
                .any(|o| o.map_or(true, |o| o.kind & geneve::CRITICAL != 0))
            {
                return Err(DropReason::GeneveCriticalOption);
            }
        }
    }
    // Only ECT(1) and CE outside change what is inside (RFC 6040 §4.2).
    let outer_ecn = ds_field(frame, &meta.outer) & ecn::MASK;
    let mut outer = OuterMark::Unmarked;
    if outer_ecn & ecn::ECT1 != 0 {
        outer = carry_ecn(pkt.data_mut(), &meta.inner, outer_ecn)?;
    }
    pkt.truncate(usize::from(meta.outer.l3_end));
    pkt.pull_front(usize::from(t.inner));
    Ok(outer)
}

/// Gives the inner packet `inner` describes the ECN field RFC 6040 asks for when its
/// tunnel's outer header carried `outer_ecn`; a frame that is not IP is left as it is,
/// as Linux leaves it.
#[cold]
fn carry_ecn(frame: &mut [u8], inner: &Layers, outer_ecn: u8) -> Result<OuterMark, DropReason> {
    if inner.l3_kind == L3::None {
        return Ok(OuterMark::Unmarked);
    }
    let before = ds_field(frame, inner) & ecn::MASK;
    let after = decapsulated_ecn(before, outer_ecn).ok_or(DropReason::EcnNotCapable)?;
    if after != before {
        let l3 = &mut frame[usize::from(inner.l3)..];
        if inner.l3_kind == L3::V4 {
            ipv4::Packet::new_unchecked(l3).set_ecn(after);
        } else {
            ipv6::Packet::new_unchecked(l3).set_ecn(after);
        }
    }
    Ok(if outer_ecn == ecn::CE {
        OuterMark::Ce
    } else {
        OuterMark::Unmarked
    })
}

/// Offset of the L3 header after Ethernet and any VLAN tags.
pub fn l3_offset(frame: &[u8]) -> usize {
    let mut at = ethernet::HEADER_LEN;
    while frame.len() >= at && matches!(be16(frame, at - 2), ethertype::VLAN | ethertype::QINQ) {
        at += 4;
    }
    at
}

/// Pushes an 802.1Q tag (802.1ad when the frame is already tagged).
pub fn vlan_push(pkt: &mut PacketBuf, vid: u16, pcp: u8) -> Result<(), DropReason> {
    if !pkt.push_front(4) {
        return Err(DropReason::NoHeadroom);
    }
    let b = pkt.data_mut();
    b.copy_within(4..16, 0);
    let inner = be16(b, 16);
    let tpid = if matches!(inner, ethertype::VLAN | ethertype::QINQ) {
        ethertype::QINQ
    } else {
        ethertype::VLAN
    };
    put16(b, 12, tpid);
    put16(b, 14, (u16::from(pcp & 7) << 13) | (vid & 0x0fff));
    Ok(())
}

/// Pops the outermost VLAN tag, if there is one.
pub fn vlan_pop(pkt: &mut PacketBuf) {
    let b = pkt.data_mut();
    if matches!(be16(b, 12), ethertype::VLAN | ethertype::QINQ) && b.len() >= 18 {
        b.copy_within(0..12, 4);
        pkt.pull_front(4);
    }
}

/// Lowers the Maximum Segment Size a TCP SYN segment offers (RFC 9293 §3.7.1) to `mss`
/// where it offers more, patching the TCP checksum (RFC 1624); anything else, a fragment
/// included, is left as it is. A SYN without the option offers the default 536 (IPv4;
/// 1220 over IPv6), under any clamp.
pub fn clamp_mss(frame: &mut [u8], l: &Layers, mss: u16) {
    if !l.l4_ok || l.proto != ip_proto::TCP {
        return;
    }
    let Some(seg) = frame.get_mut(usize::from(l.l4)..usize::from(l.l3_end)) else {
        return;
    };
    let Ok(tcp) = tcp::Packet::new_checked(&*seg) else {
        return;
    };
    let Some(at) = tcp.mss_at().filter(|_| tcp.flags() & tcp::flags::SYN != 0) else {
        return;
    };
    if be16(seg, at) <= mss {
        return;
    }
    // The option need not be aligned: the checksum is patched over the aligned four
    // bytes that hold its value (the segment starts on a word of the checksummed data; a
    // last odd byte is summed as if followed by a zero, RFC 9293 §3.1).
    let first = at & !1;
    let window =
        |s: &[u8]| -> [u8; 4] { std::array::from_fn(|i| s.get(first + i).copied().unwrap_or(0)) };
    let old = window(seg);
    put16(seg, at, mss);
    let c = checksum::update_bytes(be16(seg, 16), &old, &window(seg));
    put16(seg, 16, c);
}

/// Whether the packet carries a TCP SYN, outside or inside its tunnel: what
/// [`clamp_mss_to_mtu`] may clamp where it leaves, so that others are not looked at again.
pub fn carries_syn(frame: &[u8], meta: &Meta) -> bool {
    let syn = |l: &Layers| {
        l.l4_ok
            && l.proto == ip_proto::TCP
            && frame
                .get(usize::from(l.l4) + 13)
                .is_some_and(|f| f & tcp::flags::SYN != 0)
    };
    syn(&meta.outer) || meta.tunnel.is_some() && syn(&meta.inner)
}

/// Lowers the MSS a leaving TCP SYN offers to what fits both ways (RFC 9293 §3.7.1): out
/// of a port of `mtu` bytes of IP packet, behind every header now in front of the
/// segment's IP header (a tunnel's, when the packet carries one), and back in by the port
/// of `back` bytes it arrived by, behind every header that was in front of that IP header
/// there (a tunnel's, when the walk took it out); less the fixed IP and TCP headers. So
/// nftables' `tcp option maxseg size set rt mtu` does with the MTUs of the route out and
/// of the route back to the source, a tunnel device's being its link's less the tunnel.
/// Where the packet arrived is read from where its frame started in its buffer, as if
/// its Ethernet header was untagged: behind a tagged one, 4 bytes are left to spare.
/// The segment inside a tunnel is clamped as it is on its own: the checksum patch keeps
/// the segment's sum, so an outer UDP checksum over it stays right. Left as it is when an
/// MTU has no room for the headers.
pub fn clamp_mss_to_mtu(pkt: &mut PacketBuf, meta: &Meta, mtu: u16, back: u16) {
    let l = match meta.tunnel {
        Some(_) => &meta.inner,
        None => &meta.outer,
    };
    let fixed = match l.l3_kind {
        L3::V4 => ipv4::MIN_HEADER_LEN + tcp::MIN_HEADER_LEN,
        L3::V6 => ipv6::HEADER_LEN + tcp::MIN_HEADER_LEN,
        L3::None => return,
    };
    let ip = usize::from(l.l3);
    let in_front_now = ip.saturating_sub(usize::from(meta.outer.l3));
    let in_front_then = (pkt.headroom() + ip).saturating_sub(HEADROOM + ethernet::HEADER_LEN);
    let out = usize::from(mtu).checked_sub(in_front_now);
    let back = usize::from(back).checked_sub(in_front_then);
    let room = out.zip(back).map(|(out, back)| out.min(back));
    if let Some(mss) = room.and_then(|r| r.checked_sub(fixed)) {
        clamp_mss(pkt.data_mut(), l, mss as u16);
    }
}

/// Decrements the IPv4 TTL or IPv6 hop limit; a packet that would reach zero is dropped.
pub fn dec_ttl(frame: &mut [u8], l: &Layers) -> Result<(), DropReason> {
    let at = usize::from(l.l3);
    match l.l3_kind {
        L3::V4 => {
            let mut p = ipv4::Packet::new_unchecked(&mut frame[at..]);
            if p.ttl() <= 1 {
                return Err(DropReason::TtlExpired);
            }
            p.set_ttl(p.ttl() - 1);
        }
        L3::V6 => {
            let mut p = ipv6::Packet::new_unchecked(&mut frame[at..]);
            if p.hop_limit() <= 1 {
                return Err(DropReason::TtlExpired);
            }
            p.set_hop_limit(p.hop_limit() - 1);
        }
        L3::None => {}
    }
    Ok(())
}

/// Offset of the L4 checksum field for the layers' protocol, when the segment has one
/// that must be kept right (a UDP checksum of zero over IPv4 means "none"). A datagram's
/// first fragment has its checksum too: it covers the reassembled datagram, and an
/// address rewrite changes it as it would a whole one (RFC 1624's update needs only the
/// old sum and the changed words), where it lies within the fragment.
fn l4_checksum_at(frame: &[u8], l: &Layers) -> Option<usize> {
    if !parse::l4_fields(frame, l) {
        return None;
    }
    let l4 = usize::from(l.l4);
    let at = match l.proto {
        ip_proto::TCP => l4 + 16,
        ip_proto::UDP if l.l3_kind == L3::V6 || frame.get(l4 + 6..l4 + 8)? != [0, 0] => l4 + 6,
        // UDP-Lite's checksum always covers the pseudo-header and the header (RFC 3828
        // §3.1), whatever else its coverage leaves out.
        ip_proto::UDPLITE => l4 + 6,
        // ICMPv6 covers the IPv6 pseudo-header (RFC 4443 §2.3); ICMP for IPv4 does not.
        ip_proto::ICMPV6 if l.l3_kind == L3::V6 => l4 + 2,
        _ => return None,
    };
    (at + 2 <= usize::from(l.l3_end)).then_some(at)
}

fn patch_l4(frame: &mut [u8], l: &Layers, old: &[u8], new: &[u8]) {
    if let Some(at) = l4_checksum_at(frame, l) {
        let c = checksum::update_bytes(be16(frame, at), old, new);
        // A computed UDP or UDP-Lite checksum of zero is sent as all ones (RFC 768, RFC
        // 3828 §3.1).
        let c = if c == 0 && matches!(l.proto, ip_proto::UDP | ip_proto::UDPLITE) {
            0xffff
        } else {
            c
        };
        put16(frame, at, c);
    }
}

/// Recomputes a tunnel's outer UDP checksum once its payload, the inner frame, has changed
/// (it covers it: RFC 768). A zero checksum, none sent (allowed over IPv4; RFC 6935 over
/// IPv6 for tunnels), stays zero.
pub(super) fn refresh_outer_udp_checksum(frame: &mut [u8], outer: &Layers) {
    if !(outer.l4_ok && outer.proto == ip_proto::UDP) {
        return;
    }
    let (udp_at, end) = (usize::from(outer.l4), usize::from(outer.l3_end));
    let at = udp_at + 6;
    if be16(frame, at) == 0 {
        return;
    }
    let Some(pseudo) = parse::pseudo_header(frame, outer, ip_proto::UDP, end - udp_at) else {
        return;
    };
    put16(frame, at, 0);
    let c = !checksum::fold(checksum::sum(pseudo, &frame[udp_at..end]));
    // A computed checksum of zero is sent as all ones (RFC 768).
    put16(frame, at, if c == 0 { 0xffff } else { c });
}

/// Rewrites one field; headers the packet lacks are left alone. An inner field's rewrite
/// also fixes the tunnel's outer UDP checksum, which covers the inner frame.
pub fn set_field(frame: &mut [u8], meta: &Meta, field: Field, value: u128) {
    if field.inner {
        if meta.tunnel.is_some() {
            rewrite(frame, &meta.inner, field, value);
            refresh_outer_udp_checksum(frame, &meta.outer);
        }
    } else {
        rewrite(frame, &meta.outer, field, value);
    }
}

/// Rewrites `field` in the headers `l`, with the checksums inside them.
fn rewrite(frame: &mut [u8], l: &Layers, field: Field, value: u128) {
    let (l2, l3, l4) = (usize::from(l.l2), usize::from(l.l3), usize::from(l.l4));
    let bytes = value.to_be_bytes();
    let port_at = |proto_ok: bool, off: usize| (l.l4_ok && proto_ok).then_some(l4 + off);
    let is = |p: u8| l.proto == p;
    match field.id {
        FieldId::EthDst => frame[l2..l2 + 6].copy_from_slice(&bytes[10..]),
        FieldId::EthSrc => frame[l2 + 6..l2 + 12].copy_from_slice(&bytes[10..]),
        FieldId::VlanId | FieldId::VlanPcp if l.vlan != 0 => {
            let at = usize::from(l.vlan);
            let tci = be16(frame, at);
            let tci = if field.id == FieldId::VlanId {
                (tci & 0xf000) | (value as u16 & 0x0fff)
            } else {
                (tci & 0x1fff) | ((value as u16 & 7) << 13)
            };
            put16(frame, at, tci);
        }
        FieldId::Ipv4Src | FieldId::Ipv4Dst if l.l3_kind == L3::V4 => {
            let at = l3 + if field.id == FieldId::Ipv4Src { 12 } else { 16 };
            let old: [u8; 4] = frame[at..at + 4].try_into().expect("IPv4 header");
            let new: [u8; 4] = bytes[12..].try_into().expect("4 bytes");
            let mut p = ipv4::Packet::new_unchecked(&mut frame[l3..]);
            if field.id == FieldId::Ipv4Src {
                p.set_src(new);
            } else {
                p.set_dst(new);
            }
            patch_l4(frame, l, &old, &new);
        }
        FieldId::Ipv6Src | FieldId::Ipv6Dst if l.l3_kind == L3::V6 => {
            let at = l3 + if field.id == FieldId::Ipv6Src { 8 } else { 24 };
            let old: [u8; 16] = frame[at..at + 16].try_into().expect("IPv6 header");
            frame[at..at + 16].copy_from_slice(&bytes);
            patch_l4(frame, l, &old, &bytes);
        }
        FieldId::IpDscp if l.l3_kind == L3::V4 => {
            ipv4::Packet::new_unchecked(&mut frame[l3..]).set_dscp(value as u8)
        }
        FieldId::IpDscp if l.l3_kind == L3::V6 => {
            ipv6::Packet::new_unchecked(&mut frame[l3..]).set_dscp(value as u8)
        }
        FieldId::IpEcn if l.l3_kind == L3::V4 => {
            ipv4::Packet::new_unchecked(&mut frame[l3..]).set_ecn(value as u8)
        }
        FieldId::IpEcn if l.l3_kind == L3::V6 => {
            ipv6::Packet::new_unchecked(&mut frame[l3..]).set_ecn(value as u8)
        }
        FieldId::IpTtl if l.l3_kind == L3::V4 => {
            ipv4::Packet::new_unchecked(&mut frame[l3..]).set_ttl(value as u8)
        }
        FieldId::IpTtl if l.l3_kind == L3::V6 => {
            ipv6::Packet::new_unchecked(&mut frame[l3..]).set_hop_limit(value as u8)
        }
        FieldId::L4Src
        | FieldId::L4Dst
        | FieldId::TcpSrc
        | FieldId::TcpDst
        | FieldId::UdpSrc
        | FieldId::UdpDst => {
            let ok = match field.id {
                FieldId::TcpSrc | FieldId::TcpDst => is(ip_proto::TCP),
                FieldId::UdpSrc | FieldId::UdpDst => is(ip_proto::UDP),
                _ => ip_proto::has_ports(l.proto),
            };
            let off = if matches!(field.id, FieldId::L4Src | FieldId::TcpSrc | FieldId::UdpSrc) {
                0
            } else {
                2
            };
            if let Some(at) = port_at(ok, off) {
                let old = [frame[at], frame[at + 1]];
                frame[at..at + 2].copy_from_slice(&bytes[14..]);
                if is(ip_proto::SCTP) {
                    // A CRC over the whole packet, not a sum to patch.
                    let packet = &mut frame[l4..usize::from(l.l3_end)];
                    if let Some(c) = sctp::checksum(packet) {
                        packet[sctp::CHECKSUM_AT..sctp::HEADER_LEN].copy_from_slice(&c);
                    }
                } else {
                    patch_l4(frame, l, &old, &bytes[14..]);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::PortId;
    use proptest::prelude::*;

    /// RFC 6040 §4.2, Figure 4, as written there: rows the arriving inner header, columns
    /// the arriving outer header, each Not-ECT, ECT(0), ECT(1), CE; `None` a drop.
    fn figure_4(inner: u8, outer: u8) -> Option<u8> {
        const NOT_ECT: Option<u8> = Some(0);
        const ECT_0: Option<u8> = Some(2);
        const ECT_1: Option<u8> = Some(1);
        const CE_: Option<u8> = Some(3);
        const FIGURE: [[Option<u8>; 4]; 4] = [
            [NOT_ECT, NOT_ECT, NOT_ECT, None],
            [ECT_0, ECT_0, ECT_1, CE_],
            [ECT_1, ECT_1, ECT_1, CE_],
            [CE_, CE_, CE_, CE_],
        ];
        // The figure's order of codepoints, by their value (RFC 3168 §5).
        let place = |ecn: u8| [0, 2, 1, 3][usize::from(ecn)];
        FIGURE[place(inner)][place(outer)]
    }

    /// An encapsulation in VNI 100 between documentation addresses of IPv4 or IPv6, to
    /// the tunnel's own UDP port, without options.
    fn encap_between(tunnel: Tunnel, v6: bool, dscp: OuterDscp) -> Encap {
        let (src, dst) = if v6 {
            let ip = |last| IpAddr::from([0x2001, 0xdb8, 0, 0, 0, 0, 0, last]);
            (ip(1), ip(2))
        } else {
            (IpAddr::from([192, 0, 2, 1]), IpAddr::from([192, 0, 2, 2]))
        };
        Encap {
            tunnel,
            vni: 100,
            src,
            dst,
            smac: [2, 0, 0, 0, 0, 1],
            dmac: [2, 0, 0, 0, 0, 2],
            udp_dst: tunnel.default_port(),
            ttl: 64,
            dscp,
            options: Vec::new(),
        }
    }

    /// An IPv4 or IPv6 frame of a TCP segment, a SYN or an ACK, offering `offered` as its
    /// MSS after `nops` NOP options, with `payload`, its checksum right; and its layers.
    fn tcp_frame(
        v6: bool,
        nops: usize,
        offered: u16,
        syn: bool,
        payload: &[u8],
    ) -> (Vec<u8>, Layers) {
        let mut seg = vec![0u8; 20];
        seg.extend(std::iter::repeat_n(tcp::option::NOP, nops));
        seg.extend([tcp::option::MSS, 4]);
        seg.extend(offered.to_be_bytes());
        seg.resize(seg.len().div_ceil(4) * 4, tcp::option::END);
        seg[12] = ((seg.len() / 4) as u8) << 4;
        seg[13] = if syn {
            tcp::flags::SYN
        } else {
            tcp::flags::ACK
        };
        seg.extend(payload);
        let mut frame = crate::wire::testing::ip_frame(v6, 1 << 40 | 7, 9, ip_proto::TCP, 0, &seg);
        let l = parse::parse(&frame, &parse::TunnelPorts::default())
            .unwrap()
            .outer;
        let at = usize::from(l.l4);
        let pseudo = parse::pseudo_header(&frame, &l, ip_proto::TCP, seg.len()).unwrap();
        let c = !checksum::fold(checksum::sum(pseudo, &frame[at..usize::from(l.l3_end)]));
        put16(&mut frame, at + 16, c);
        (frame, l)
    }

    #[test]
    fn decapsulation_follows_rfc_6040_figure_4() {
        for inner in 0..4 {
            for outer in 0..4 {
                assert_eq!(
                    decapsulated_ecn(inner, outer),
                    figure_4(inner, outer),
                    "inner {inner:#04b}, outer {outer:#04b}"
                );
            }
        }
    }

    /// A tunnelled frame that is not IP has no ECN field to carry a mark into: it is
    /// decapsulated as it is, whatever the outer header says (as Linux does).
    #[test]
    fn a_frame_that_is_not_ip_leaves_the_tunnel_as_it_is() {
        let arp = [[0xff; 6], [2, 0, 0, 0, 0, 1]].concat();
        let inner = [&arp[..], &[0x08, 0x06], &[0; 28]].concat();
        let mut udp = vec![0xc3, 0x50, 0x12, 0xb5, 0, 0, 0, 0];
        udp.extend([0x08, 0, 0, 0, 0, 0, 100, 0]);
        udp.extend(&inner);
        let len = udp.len() as u16;
        udp[4..6].copy_from_slice(&len.to_be_bytes());
        let mut frame = crate::wire::testing::ip_frame(false, 1, 2, ip_proto::UDP, 0, &udp);
        let l = parse::parse(&frame, &parse::TunnelPorts::default())
            .unwrap()
            .outer;
        ipv4::Packet::new_unchecked(&mut frame[usize::from(l.l3)..]).set_ecn(ecn::CE);
        let mut pkt = PacketBuf::new(2048);
        pkt.load(&frame, PortId(0), 0);
        let meta = parse::parse(pkt.data(), &parse::TunnelPorts::default()).unwrap();
        assert_eq!(meta.inner.l3_kind, L3::None);
        assert_eq!(
            decap(&mut pkt, &meta, Tunnel::Vxlan),
            Ok(OuterMark::Unmarked)
        );
        assert_eq!(pkt.data(), &inner[..]);
    }

    proptest! {
        /// The common shape's fixed path writes what the general one does.
        #[test]
        fn the_short_path_writes_the_same_headers(
            geneve in any::<bool>(),
            vni in 0u32..1 << 24,
            src in any::<[u8; 4]>(),
            dst in any::<[u8; 4]>(),
            ttl in 1u8..=255,
            dscp in prop_oneof![(0u8..64).prop_map(OuterDscp::Fixed), Just(OuterDscp::Inherit)],
            inner in 14usize..9000,
            hash in any::<u32>(),
            ds in any::<u8>(),
        ) {
            let e = Encap {
                tunnel: if geneve { Tunnel::Geneve } else { Tunnel::Vxlan },
                vni,
                src: IpAddr::from(src),
                dst: IpAddr::from(dst),
                smac: [2, 0, 0, 0, 0, 1],
                dmac: [2, 0, 0, 0, 0, 2],
                udp_dst: if geneve { 6081 } else { 4789 },
                ttl,
                dscp,
                options: Vec::new(),
            };
            let t = EncapTemplate::new(&e);
            let head = t.short_v4.expect("IPv4 without options is the short shape");
            let frame: Vec<u8> = (0..inner).map(|i| i as u8).collect();
            let (mut short, mut any) = (PacketBuf::new(9000), PacketBuf::new(9000));
            short.load(&frame, PortId(0), 0);
            any.load(&frame, PortId(0), 0);
            prop_assert_eq!(
                t.apply_short_v4(&head, &mut short, hash, ds),
                t.apply_any(&mut any, hash, ds)
            );
            prop_assert_eq!(short.data(), any.data());
        }

        /// Over IPv6 the outer header's first word holds the version, the template's
        /// DSCP with the inner ECN field, and a flow label from the inner flow's hash
        /// that is never 0; flows whose hashes differ in the label's bits differ in it.
        #[test]
        fn an_ipv6_outer_header_labels_the_inner_flow(
            hash in any::<u32>(),
            dscp in 0u8..64,
            ecn in 0u8..4,
        ) {
            let e = encap_between(Tunnel::Vxlan, true, OuterDscp::Fixed(dscp));
            let frame = crate::wire::testing::frame(false, 1, 2, ip_proto::UDP, 1000, 2000, 0, 0);
            let mut pkt = PacketBuf::new(2048);
            pkt.load(&frame, PortId(0), 0);
            EncapTemplate::new(&e).apply(&mut pkt, hash, ecn).unwrap();
            let outer = ipv6::Packet::new_checked(&pkt.data()[IP_AT..]).unwrap();
            prop_assert_eq!((outer.version(), outer.dscp(), outer.ecn()), (6, dscp, ecn));
            let label = outer.flow_label();
            prop_assert!(label != 0);
            prop_assert!(label == (hash >> 12) & 0xf_ffff || (hash >> 12) & 0xf_ffff == 0);
        }

        /// The outer header takes the inner packet's ECN field, and its DSCP with
        /// `inherit`, its checksum right; decapsulated, the inner packet is given the ECN
        /// field Figure 4 of RFC 6040 gives it for the outer one the fabric left, or
        /// dropped, its own checksum right.
        #[test]
        fn ecn_crosses_the_tunnel_both_ways(
            v6_outer in any::<bool>(),
            v6_inner in any::<bool>(),
            dscp in prop_oneof![(0u8..64).prop_map(OuterDscp::Fixed), Just(OuterDscp::Inherit)],
            inner_dscp in 0u8..64,
            inner_ecn in 0u8..4,
            fabric_ecn in 0u8..4,
            geneve in any::<bool>(),
        ) {
            let tunnel = if geneve { Tunnel::Geneve } else { Tunnel::Vxlan };
            let e = encap_between(tunnel, v6_outer, dscp);
            let mut frame = crate::wire::testing::frame(v6_inner, 1, 2, ip_proto::UDP, 1000, 2000, 0, inner_dscp);
            let l = parse::parse(&frame, &parse::TunnelPorts::default()).unwrap().outer;
            let l3 = &mut frame[usize::from(l.l3)..];
            if v6_inner {
                ipv6::Packet::new_unchecked(l3).set_ecn(inner_ecn);
            } else {
                let mut p = ipv4::Packet::new_unchecked(l3);
                p.fill_checksum();
                p.set_ecn(inner_ecn);
            }
            let ds = ds_field(&frame, &l);
            prop_assert_eq!(ds, inner_dscp << 2 | inner_ecn);

            let mut pkt = PacketBuf::new(2048);
            pkt.load(&frame, PortId(0), 0);
            EncapTemplate::new(&e).apply(&mut pkt, 7, ds).unwrap();
            let meta = parse::parse(pkt.data(), &parse::TunnelPorts::default()).unwrap();
            let outer = ds_field(pkt.data(), &meta.outer);
            let want_dscp = match dscp {
                OuterDscp::Fixed(d) => d,
                OuterDscp::Inherit => inner_dscp,
            };
            prop_assert_eq!(outer, want_dscp << 2 | inner_ecn);
            let outer_l3 = &mut pkt.data_mut()[usize::from(meta.outer.l3)..];
            if v6_outer {
                ipv6::Packet::new_unchecked(outer_l3).set_ecn(fabric_ecn);
            } else {
                prop_assert!(ipv4::Packet::new_unchecked(&*outer_l3).verify_checksum());
                ipv4::Packet::new_unchecked(outer_l3).set_ecn(fabric_ecn);
            }

            let meta = parse::parse(pkt.data(), &parse::TunnelPorts::default()).unwrap();
            let r = decap(&mut pkt, &meta, tunnel);
            match figure_4(inner_ecn, fabric_ecn) {
                None => prop_assert_eq!(r, Err(DropReason::EcnNotCapable)),
                Some(want) => {
                    let marked = if fabric_ecn == ecn::CE { OuterMark::Ce } else { OuterMark::Unmarked };
                    prop_assert_eq!(r, Ok(marked));
                    let l = parse::parse(pkt.data(), &parse::TunnelPorts::default()).unwrap().outer;
                    prop_assert_eq!(ds_field(pkt.data(), &l), inner_dscp << 2 | want);
                    let l3 = &pkt.data()[usize::from(l.l3)..];
                    prop_assert!(v6_inner || ipv4::Packet::new_unchecked(l3).verify_checksum());
                }
            }
        }

        /// A SYN's MSS comes down to the clamp and no lower, wherever the option sits
        /// (aligned or not), and its checksum stays right; other segments are left alone.
        #[test]
        fn a_clamp_lowers_only_a_syns_larger_mss(
            v6 in any::<bool>(),
            nops in 0usize..4,
            offered in any::<u16>(),
            clamp in 536u16..,
            syn in any::<bool>(),
            payload in prop::collection::vec(any::<u8>(), 0..9),
        ) {
            let (mut frame, l) = tcp_frame(v6, nops, offered, syn, &payload);
            let at = usize::from(l.l4);
            let pseudo = parse::pseudo_header(&frame, &l, ip_proto::TCP, usize::from(l.l3_end) - at).unwrap();
            let before = frame.clone();
            clamp_mss(&mut frame, &l, clamp);
            let mss = be16(&frame, at + 20 + nops + 2);
            prop_assert_eq!(mss, if syn { offered.min(clamp) } else { offered });
            prop_assert_eq!(checksum::fold(checksum::sum(pseudo, &frame[at..usize::from(l.l3_end)])), 0xffff);
            let changed = (0..frame.len()).filter(|&i| frame[i] != before[i]).count();
            prop_assert!(changed <= 4);
        }

        /// Clamped to the MTUs where it leaves and where it came in, a SYN offers at most
        /// what fills the smaller behind the headers in front of it there: the fixed IP and
        /// TCP ones and, where it is in a tunnel (encapsulated on the way, or arrived so and
        /// decapsulated), the tunnel's (50 bytes for VXLAN over IPv4, 70 over IPv6; Geneve
        /// the same without options). Its checksum stays right, and so does an outer UDP
        /// checksum over it (IPv6).
        #[test]
        fn a_clamp_to_the_mtu_leaves_room_for_every_header(
            v6_inner in any::<bool>(),
            tunnel in prop::option::of((any::<bool>(), any::<bool>(), any::<bool>())),
            offered in any::<u16>(),
            mtu in 60u16..9216,
            back in 60u16..9216,
        ) {
            let (frame, _) = tcp_frame(v6_inner, 1, offered, true, b"data");
            let mut pkt = PacketBuf::new(2048);
            pkt.load(&frame, PortId(0), 0);
            let (mut out_overhead, mut back_overhead) = (0, 0);
            if let Some((v6_outer, geneve, arrived)) = tunnel {
                let kind = if geneve { Tunnel::Geneve } else { Tunnel::Vxlan };
                let e = encap_between(kind, v6_outer, OuterDscp::Inherit);
                EncapTemplate::new(&e).apply(&mut pkt, 7, 0).unwrap();
                let overhead = if v6_outer { 70 } else { 50 };
                if arrived {
                    let tunnelled = pkt.data().to_vec();
                    pkt.load(&tunnelled, PortId(0), 0);
                    let meta = parse::parse(pkt.data(), &parse::TunnelPorts::default()).unwrap();
                    decap(&mut pkt, &meta, kind).unwrap();
                    back_overhead = overhead;
                } else {
                    out_overhead = overhead;
                }
            }
            let meta = parse::parse(pkt.data(), &parse::TunnelPorts::default()).unwrap();
            clamp_mss_to_mtu(&mut pkt, &meta, mtu, back);
            let l = if meta.tunnel.is_some() { meta.inner } else { meta.outer };
            let b = pkt.data();
            let at = usize::from(l.l4);
            let fixed = if v6_inner { 60 } else { 40 };
            let room = usize::from(mtu).checked_sub(out_overhead)
                .zip(usize::from(back).checked_sub(back_overhead))
                .and_then(|(out, back)| out.min(back).checked_sub(fixed));
            let want = room.map_or(offered, |r| offered.min(r as u16));
            prop_assert_eq!(be16(b, at + 20 + 1 + 2), want);
            let segment = |l: &Layers| {
                let pseudo = parse::pseudo_header(b, l, l.proto, usize::from(l.l3_end - l.l4)).unwrap();
                checksum::fold(checksum::sum(pseudo, &b[usize::from(l.l4)..usize::from(l.l3_end)]))
            };
            prop_assert_eq!(segment(&l), 0xffff);
            if meta.tunnel.is_some() && meta.outer.l3_kind == L3::V6 {
                prop_assert_eq!(segment(&meta.outer), 0xffff);
            }
        }
    }
}
