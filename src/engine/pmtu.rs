//! Path MTU discovery through the pipeline's tunnels. A packet the pipeline encapsulated
//! that is then too big for its output port's MTU is dropped, and its sender is told the
//! MTU its packets have room for inside the tunnel: ICMP Fragmentation Needed with the
//! next-hop MTU (RFC 1191 §4) or ICMPv6 Packet Too Big (RFC 8201 §4, RFC 4443 §3.2), sent
//! back out of the port the packet came in by, as a tunnel's entry point reports its
//! MTU (RFC 4459; Linux's vxlan device does so for the bridge it serves). Without
//! it a host whose packets fill its own link sends into a black hole: its TCP
//! connections open, then stall at the first full-sized segment.
//!
//! The message quotes the packet as the sender sent it (the frame the tunnel carries)
//! and comes from the address that packet was for, so the sender's stack takes it as it
//! would a router's on the way there. Nobody is told about a packet that may be cut up
//! instead (IPv4 without DF), a fragment, an ICMP error, or one from or to an address
//! that cannot be answered (RFC 1122 §3.2.2, RFC 4443 §2.4 (e)); messages are limited
//! to [`PER_SECOND`] a worker (RFC 4443 §2.4 (f)).

use super::action::l3_offset;
use super::packet::{PacketBuf, HEADROOM};
use super::parse::{self, TunnelPorts};
use super::{DropReason, Verdict};
use crate::wire::ethernet::ethertype;
use crate::wire::{be16, checksum, icmp, ip_proto, ipv4, ipv6};
use std::net::{Ipv4Addr, Ipv6Addr};

/// ICMP errors a worker sends a second at most, and at once: a token bucket, Linux's
/// `icmp_msgs_per_sec` and `icmp_msgs_burst` by default.
pub const PER_SECOND: u64 = 1000;
pub const BURST: u64 = 50;
const NS_A_MESSAGE: u64 = 1_000_000_000 / PER_SECOND;

/// The longest Ethernet header with its VLAN tags a quoted frame may have (four tags).
const MAX_L2: usize = 30;

/// Hop limit of the messages (RFC 1700's default TTL).
const HOP_LIMIT: u8 = 64;
/// DSCP of the messages: CS6, internetwork control (RFC 1812 §4.3.2.5, RFC 4594).
const DSCP: u8 = 48;

/// How many messages may go now: a bucket of [`BURST`], filled at [`PER_SECOND`] by the
/// packets' own clock.
#[derive(Debug, Clone)]
pub struct Limiter {
    /// Credit in nanoseconds of filling, at most `BURST` messages' worth.
    credit_ns: u64,
    last_ns: Option<u64>,
}

impl Default for Limiter {
    fn default() -> Limiter {
        Limiter {
            credit_ns: BURST * NS_A_MESSAGE,
            last_ns: None,
        }
    }
}

impl Limiter {
    /// Takes a message's credit at time `now_ns`, if there is one.
    pub fn take(&mut self, now_ns: u64) -> bool {
        let since = self.last_ns.map_or(0, |t| now_ns.saturating_sub(t));
        self.last_ns = Some(now_ns.max(self.last_ns.unwrap_or(0)));
        self.credit_ns = (self.credit_ns.saturating_add(since)).min(BURST * NS_A_MESSAGE);
        let ok = self.credit_ns >= NS_A_MESSAGE;
        if ok {
            self.credit_ns -= NS_A_MESSAGE;
        }
        ok
    }
}

/// The length of the frame `pkt` carries in a tunnel the walk put in front of it as it
/// arrived: the tunnel's inner frame starts where the frame was received (a packet is
/// loaded [`HEADROOM`] into its buffer, and only an encapsulation puts a tunnel header in
/// front of it). None for a packet that arrived tunnelled, was decapsulated, or whose
/// frame was retagged before it was encapsulated.
pub fn encapsulated_as_arrived(pkt: &PacketBuf, tunnels: &TunnelPorts) -> Option<usize> {
    let t = parse::parse(pkt.data(), tunnels).ok()?.tunnel?;
    (pkt.headroom() + usize::from(t.inner) == HEADROOM).then(|| pkt.len() - usize::from(t.inner))
}

/// What an engine answers packets too big for a port with: the tunnels it knows (a copy
/// of its compiled program's, since actions see only the engine's runtime state; kept
/// in step on a reload), and its limit.
#[derive(Debug, Clone)]
pub struct Answering {
    pub(super) tunnels: TunnelPorts,
    limit: Limiter,
}

impl Answering {
    pub fn new(tunnels: TunnelPorts) -> Answering {
        Answering {
            tunnels,
            limit: Limiter::default(),
        }
    }

    /// A packet too big for a port of `mtu`: made the ICMP error out of the port it came in
    /// by ([`Verdict::TooBig`]) where the walk encapsulated it as it arrived and its sender
    /// can be told, rate permitting; else to be dropped.
    #[cold]
    #[inline(never)]
    pub fn answer(&mut self, pkt: &mut PacketBuf, mtu: u16) -> Result<Verdict, DropReason> {
        let arrived = encapsulated_as_arrived(pkt, &self.tunnels);
        let answer = arrived.and_then(|len| TooBig::of(pkt, len, mtu));
        match answer.filter(|_| self.limit.take(pkt.ts_ns)) {
            Some(a) if a.write(pkt) => Ok(Verdict::TooBig(pkt.port)),
            _ => Err(DropReason::MtuExceeded),
        }
    }
}

/// The message a too-big packet is answered with, worked out before anything is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooBig {
    /// Where the frame the pipeline encapsulated starts in the packet, and its Ethernet
    /// header's length (tags included).
    frame_at: usize,
    l2: usize,
    v6: bool,
    /// The MTU the sender's packets have room for.
    pub mtu: u32,
    /// How much of the sender's IP packet the message quotes.
    quote: usize,
    src: [u8; 16],
    dst: [u8; 16],
}

impl TooBig {
    /// The message for `pkt`, which does not fit an MTU of `mtu` bytes of IP packet and
    /// ends with the `inner_len` bytes of the frame a tunnel carries, when that frame's
    /// sender is to be told.
    pub fn of(pkt: &PacketBuf, inner_len: usize, mtu: u16) -> Option<TooBig> {
        let data = pkt.data();
        let frame_at = data.len().checked_sub(inner_len).filter(|&at| at > 0)?;
        let frame = &data[frame_at..];
        let l2 = l3_offset(frame);
        if l2 > MAX_L2 || frame.len() < l2 {
            return None;
        }
        let ip = &frame[l2..];
        // What the tunnel adds in front of the sender's IP packet, up to the outer one's.
        let overhead = (data.len() - l3_offset(data)).checked_sub(ip.len())?;
        let room = usize::from(mtu).checked_sub(overhead)?;
        let (v6, room, quote, src, dst) = match be16(frame, l2 - 2) {
            ethertype::IPV4 => {
                let p = ipv4::Packet::new_checked(ip).ok()?;
                let whole = p.dont_frag() && !p.more_frags() && p.frag_offset() == 0;
                let total = usize::from(p.total_len());
                // RFC 791's 68 bytes every link carries; the quote as much as fits 576
                // (RFC 1812 §4.3.2.3).
                if !whole || room < 68 || room >= total || !answerable_v4(p.src(), p.dst()) {
                    return None;
                }
                if p.protocol() == ip_proto::ICMP {
                    let kind = *p.payload().first()?;
                    if icmp::is_error(false, kind) {
                        return None;
                    }
                }
                let quote = total.min(576 - ipv4::MIN_HEADER_LEN - icmp::HEADER_LEN);
                (false, room, quote, mapped(p.src()), mapped(p.dst()))
            }
            ethertype::IPV6 => {
                let p = ipv6::Packet::new_checked(ip).ok()?;
                let total = ipv6::HEADER_LEN + usize::from(p.payload_len());
                // IPv6 links carry 1280 bytes (RFC 8200 §5); the quote as much as fits
                // them (RFC 4443 §3.2).
                if room < 1280 || room >= total || !answerable_v6(&p.src(), &p.dst()) {
                    return None;
                }
                let upper = p.upper_layer().ok()?;
                if upper.protocol == ip_proto::ICMPV6 {
                    let kind = *ip.get(upper.offset)?;
                    if upper.l4_present && icmp::is_error(true, kind) {
                        return None;
                    }
                }
                let quote = total.min(1280 - ipv6::HEADER_LEN - icmp::HEADER_LEN);
                (true, room, quote, p.src(), p.dst())
            }
            _ => return None,
        };
        Some(TooBig {
            frame_at,
            l2,
            v6,
            mtu: room as u32,
            quote,
            src,
            dst,
        })
    }

    /// Makes `pkt` this message, in place: the quoted bytes stay where they are, and the
    /// headers are written in front of them over the tunnel's. False when the packet
    /// lacks the headroom (it is left as it was).
    pub fn write(&self, pkt: &mut PacketBuf) -> bool {
        let ip_len = if self.v6 {
            ipv6::HEADER_LEN
        } else {
            ipv4::MIN_HEADER_LEN
        };
        let headers = ip_len + icmp::HEADER_LEN;
        // The sender's Ethernet header, its addresses swapped: the answer goes back.
        let mut l2 = [0u8; MAX_L2];
        l2[..self.l2].copy_from_slice(&pkt.data()[self.frame_at..self.frame_at + self.l2]);
        let (to, from) = l2.split_at_mut(6);
        to.swap_with_slice(&mut from[..6]);
        // The new frame starts `headers` before the frame's IP packet, less its L2.
        match self.frame_at.checked_sub(headers) {
            Some(extra) => pkt.pull_front(extra),
            None => {
                if !pkt.push_front(headers - self.frame_at) {
                    return false;
                }
            }
        }
        pkt.truncate(self.l2 + headers + self.quote);
        let b = pkt.data_mut();
        b[..self.l2].copy_from_slice(&l2[..self.l2]);
        let (ip, msg) = b[self.l2..].split_at_mut(ip_len);
        let msg_len = (icmp::HEADER_LEN + self.quote) as u16;
        let pseudo = if self.v6 {
            ipv6::Repr {
                src: self.dst,
                dst: self.src,
                next_header: ip_proto::ICMPV6,
                hop_limit: HOP_LIMIT,
                dscp: DSCP,
                flow_label: 0,
                payload_len: msg_len,
            }
            .emit(ip);
            checksum::pseudo_v6(&self.dst, &self.src, ip_proto::ICMPV6, msg_len.into())
        } else {
            ipv4::Repr {
                src: unmapped(&self.dst),
                dst: unmapped(&self.src),
                protocol: ip_proto::ICMP,
                ttl: HOP_LIMIT,
                dscp: DSCP,
                // An atomic datagram, whose identification may be 0 (RFC 6864 §4.1).
                dont_frag: true,
                payload_len: msg_len,
            }
            .emit(ip);
            0
        };
        icmp::TooBigRepr {
            v6: self.v6,
            mtu: self.mtu,
        }
        .emit(msg, pseudo);
        true
    }
}

/// An IPv4 packet whose sender can be answered from its destination: the source one
/// host's (not 0/8, loopback, multicast, reserved or broadcast) and the destination
/// not a multicast or broadcast group (RFC 1122 §3.2.2).
pub(super) fn answerable_v4(src: [u8; 4], dst: [u8; 4]) -> bool {
    let one_host = |a: [u8; 4]| !matches!(a[0], 0 | 127 | 224..=255);
    one_host(src) && one_host(dst)
}

/// An IPv6 packet whose sender can be answered from its destination: neither address
/// unspecified, loopback or multicast (RFC 4443 §2.4 (e)).
pub(super) fn answerable_v6(src: &[u8; 16], dst: &[u8; 16]) -> bool {
    let one_host = |a: &[u8; 16]| {
        let a = Ipv6Addr::from(*a);
        !(a.is_multicast() || a.is_loopback() || a.is_unspecified())
    };
    one_host(src) && one_host(dst)
}

fn mapped(a: [u8; 4]) -> [u8; 16] {
    Ipv4Addr::from(a).to_ipv6_mapped().octets()
}

fn unmapped(a: &[u8; 16]) -> [u8; 4] {
    [a[12], a[13], a[14], a[15]]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::PortId;
    use crate::wire::testing::ip_frame;

    #[test]
    fn the_limiter_lets_a_burst_through_then_one_a_millisecond() {
        let mut l = Limiter::default();
        let t = 5_000_000_000;
        assert_eq!((0..60).filter(|_| l.take(t)).count(), BURST as usize);
        assert!(!l.take(t + NS_A_MESSAGE / 2));
        assert!(l.take(t + NS_A_MESSAGE));
        assert!(!l.take(t + NS_A_MESSAGE));
        // A clock that steps back gives no credit, and takes none away.
        assert!(!l.take(t - 1_000_000_000));
        assert!(l.take(t + 2 * NS_A_MESSAGE));
        // A second's rest fills the bucket, no more.
        let later = t + 10_000_000_000;
        assert_eq!((0..60).filter(|_| l.take(later)).count(), BURST as usize);
    }

    /// `outer` bytes of tunnel (an Ethernet header saying IPv4, the rest zeros) in front
    /// of an IPv4 or IPv6 frame from `src` to `dst` of `ip_len` bytes of IP, with DF.
    fn tunnelled(
        outer: usize,
        v6: bool,
        src: u128,
        dst: u128,
        ip_len: usize,
    ) -> (PacketBuf, usize) {
        let header = if v6 { 40 } else { 20 };
        let mut frame = ip_frame(v6, src, dst, ip_proto::UDP, 0, &vec![7; ip_len - header]);
        if !v6 {
            frame[14 + 6] |= 0x40;
        }
        let mut bytes = vec![0u8; outer];
        if let Some(kind) = bytes.get_mut(12..14) {
            kind.copy_from_slice(&ethertype::IPV4.to_be_bytes());
        }
        bytes.extend_from_slice(&frame);
        let mut pkt = PacketBuf::new(9216);
        assert!(pkt.load(&bytes, PortId(0), 0));
        (pkt, frame.len())
    }

    #[test]
    fn only_senders_that_can_be_told_are_answered() {
        let host = 0x0a00_0001;
        let (v6_host, v6_group) = (0x2001_0db8 << 96 | 1, 0xff02 << 112 | 1);
        let mtu_of =
            |(pkt, inner): (PacketBuf, usize), mtu| TooBig::of(&pkt, inner, mtu).map(|t| t.mtu);
        assert_eq!(
            mtu_of(tunnelled(50, false, host, 0x0a01_0001, 1500), 1500),
            Some(1450)
        );
        assert_eq!(
            mtu_of(tunnelled(50, true, v6_host, v6_host + 1, 1500), 1500),
            Some(1450)
        );
        // Fits inside the tunnel after all: nothing to say.
        assert_eq!(
            mtu_of(tunnelled(50, false, host, 0x0a01_0001, 1450), 1500),
            None
        );
        // Below what the version's links must carry.
        assert_eq!(
            mtu_of(tunnelled(50, true, v6_host, v6_host + 1, 1500), 1320),
            None
        );
        assert_eq!(
            mtu_of(tunnelled(50, false, host, 0x0a01_0001, 1500), 100),
            None
        );
        // Sources and destinations that cannot be answered from.
        for (src, dst) in [
            (0, host),
            (0x7f00_0001, host),
            (host, 0xe000_0001),
            (host, u32::MAX.into()),
        ] {
            assert_eq!(
                mtu_of(tunnelled(50, false, src, dst, 1500), 1500),
                None,
                "{src:x} {dst:x}"
            );
        }
        assert_eq!(
            mtu_of(tunnelled(50, true, v6_host, v6_group, 1500), 1500),
            None
        );
        assert_eq!(mtu_of(tunnelled(50, true, 1, v6_host, 1500), 1500), None);
        // Not encapsulated by the walk.
        let (pkt, inner) = tunnelled(0, false, host, 0x0a01_0001, 1500);
        assert_eq!(TooBig::of(&pkt, inner, 1400), None);
        assert_eq!(TooBig::of(&pkt, 0, 1400), None);
        // IPv4 without DF may be cut up instead.
        let (mut pkt, inner) = tunnelled(50, false, host, 0x0a01_0001, 1500);
        pkt.data_mut()[50 + 14 + 6] = 0;
        assert_eq!(TooBig::of(&pkt, inner, 1500), None);
    }
}
