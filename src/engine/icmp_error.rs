//! ICMP errors the pipeline sends about the packets it drops: a packet too big for the
//! tunnel (see [`super::pmtu`]) and one whose TTL or hop limit `dec ttl` finds run out
//! (ICMP Time Exceeded, RFC 792 and RFC 4443 §3.3, which traceroute reads each hop's
//! address from). Each is the dropped packet itself made into the message, in place, and
//! sent back out of the port it came in by, to the Ethernet address it came from; a
//! Time Exceeded about a packet the walk only took out of its tunnel, and a too-big
//! message about one it only moved from that tunnel into another, go back through that
//! tunnel.
//!
//! Nobody is told about a fragment other than a datagram's first, an ICMP error, or a
//! packet from or to an address that cannot be answered (RFC 1122 §3.2.2, RFC 1812
//! §4.3.2.7, RFC 4443 §2.4 (e)); messages are limited to [`PER_SECOND`] a worker (RFC
//! 4443 §2.4 (f)).

use super::action::{l3_offset, refresh_outer_udp_checksum};
use super::packet::{PacketBuf, HEADROOM};
use super::parse::{self, Layers, Meta, TunnelPorts, L3};
use super::pmtu;
use super::{DropReason, Verdict};
use crate::wire::ethernet::ethertype;
use crate::wire::{be16, checksum, icmp, ip_proto, ipv4, ipv6, udp};
use std::net::{Ipv4Addr, Ipv6Addr};
use std::sync::Arc;

/// ICMP errors a worker sends a second at most, and at once: a token bucket, Linux's
/// `icmp_msgs_per_sec` and `icmp_msgs_burst` by default.
pub const PER_SECOND: u64 = 1000;
pub const BURST: u64 = 50;
const NS_A_MESSAGE: u64 = 1_000_000_000 / PER_SECOND;

/// The longest Ethernet header with its VLAN tags a quoted frame may have (four tags).
const MAX_L2: usize = 30;

/// The most tunnel headers a message goes back through: Ethernet with its tags, IPv6,
/// UDP, and Geneve with the most options (RFC 8926 §3.4: 252 bytes).
const MAX_TUNNEL: usize = MAX_L2 + ipv6::HEADER_LEN + 8 + 8 + 252;

/// Hop limit of the messages (RFC 1700's default TTL).
const HOP_LIMIT: u8 = 64;
/// DSCP of the messages: CS6, internetwork control (RFC 1812 §4.3.2.5, RFC 4594). An
/// IPv4 one keeps the RFC 1349 TOS bits of the packet it is about, as RFC 1812 §4.3.2.5
/// asks and Linux does (its ECN field stays Not-ECT).
const DSCP: u8 = 48;
/// The bits of an IPv4 DSCP that were RFC 1349's TOS, below the precedence.
const TOS_BITS: u8 = 0x07;

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

/// Each port's own addresses, by port id.
pub type PortAddresses = Arc<[(Option<Ipv4Addr>, Option<Ipv6Addr>)]>;

/// What an engine sends ICMP errors with: the tunnels it knows and its ports' addresses
/// (its compiled program's, since actions see only the engine's runtime state; kept in
/// step on a reload), and its limit.
#[derive(Debug, Clone)]
pub struct Errors {
    pub(super) tunnels: TunnelPorts,
    pub(super) addresses: PortAddresses,
    limit: Limiter,
    /// The tunnel a packet of the part being run came in, where it was put in another
    /// ([`Errors::keep_arrival`]).
    arrival: ArrivalTunnel,
}

/// A tunnel's headers as they came, their layers, and the packet they are of.
#[derive(Debug, Clone)]
struct ArrivalTunnel {
    headers: [u8; MAX_TUNNEL],
    len: usize,
    layers: Layers,
    /// The [`PacketBuf::id`] of the packet, if one's are kept.
    of: Option<usize>,
}

impl Errors {
    pub fn new(tunnels: TunnelPorts, addresses: PortAddresses) -> Errors {
        Errors {
            tunnels,
            addresses,
            limit: Limiter::default(),
            arrival: ArrivalTunnel {
                headers: [0; MAX_TUNNEL],
                len: 0,
                layers: Layers::default(),
                of: None,
            },
        }
    }

    /// Keeps the headers of the tunnel `pkt` came in, which the walk took off it and
    /// nothing else, before it is put in another: `arrived` is its parse as it came.
    /// Kept where they are the headers taken off, until [`Errors::forget_arrival`]: the
    /// engine forgets them after each part of a batch, whose packets each have their own
    /// buffer, so they are never taken for another packet's.
    #[inline(never)]
    pub fn keep_arrival(&mut self, pkt: &PacketBuf, arrived: &Meta) {
        let taken = pkt.taken_off();
        let tunnel = arrived.tunnel.map(|t| usize::from(t.inner));
        if tunnel != Some(taken.len()) || taken.len() > MAX_TUNNEL {
            return;
        }
        let a = &mut self.arrival;
        a.headers[..taken.len()].copy_from_slice(taken);
        a.len = taken.len();
        a.layers = arrived.outer;
        a.of = Some(pkt.id());
    }

    /// Forgets the tunnel [`Errors::keep_arrival`] kept, if any.
    pub fn forget_arrival(&mut self) {
        self.arrival.of = None;
    }

    /// A packet too big for a port of `mtu`: made the ICMP error out of the port it came in
    /// by where the walk encapsulated it as it arrived and its sender can be told, rate
    /// permitting; else to be dropped. Where the walk took it out of the tunnel it came
    /// in and put it in another (VNI to VNI, VXLAN to Geneve), having kept the first's
    /// headers ([`Errors::keep_arrival`]), the message goes back through that tunnel, as
    /// [`Errors::time_exceeded_in_tunnel`] sends its.
    #[cold]
    #[inline(never)]
    pub fn too_big(&mut self, pkt: &mut PacketBuf, mtu: u16) -> Result<Verdict, DropReason> {
        if self.arrival.of == Some(pkt.id()) {
            return self
                .too_big_in_tunnel(pkt, mtu)
                .ok_or(DropReason::MtuExceeded);
        }
        let arrived = pmtu::encapsulated_as_arrived(pkt, &self.tunnels);
        let message = arrived.and_then(|len| pmtu::too_big(pkt, len, mtu));
        self.send(pkt, message, DropReason::PacketTooBig)
            .ok_or(DropReason::MtuExceeded)
    }

    /// [`Errors::too_big`] about a packet carried from the tunnel it came in to another,
    /// the first's headers kept: where the frame it carries is where it lay when it
    /// came (no action since moved it), the message about it, with those headers turned
    /// back in front.
    fn too_big_in_tunnel(&mut self, pkt: &mut PacketBuf, mtu: u16) -> Option<Verdict> {
        let now = parse::parse(pkt.data(), &self.tunnels).ok()?.tunnel?;
        let inner = usize::from(now.inner);
        if pkt.headroom() + inner != HEADROOM + self.arrival.len {
            return None;
        }
        let message = pmtu::too_big(pkt, pkt.len() - inner, mtu);
        let told = self.send(pkt, message, DropReason::PacketTooBig)?;
        let a = &self.arrival;
        // The message starts a little before where the frame it is about lay, and the
        // tunnel's headers lay in front of that frame: there is room for them.
        if !pkt.push_front(a.len) {
            return None;
        }
        turn_back(pkt.data_mut(), &a.headers[..a.len], &a.layers);
        Some(told)
    }

    /// A packet whose TTL or hop limit ran out, as it arrived (no action of its walk has
    /// changed its headers): made ICMP Time Exceeded from the address of its IP version
    /// of the port it came in by, where the port has one and its sender can be told,
    /// rate permitting; else dropped.
    #[cold]
    #[inline(never)]
    pub fn time_exceeded(&mut self, pkt: &mut PacketBuf) -> Verdict {
        let message = self.expired(pkt, 0);
        self.send(pkt, message, DropReason::TtlExpired)
            .unwrap_or(Verdict::Drop(DropReason::TtlExpired))
    }

    /// A packet whose TTL or hop limit ran out after its walk took it out of the tunnel
    /// it came in, and did nothing else to it: made ICMP Time Exceeded as
    /// [`Errors::time_exceeded`] makes it, and sent back through that tunnel, out of the
    /// port it came in by, so a traceroute from the far side of the tunnel sees this hop.
    /// In front of the message go the tunnel's headers as they came (they still lie in
    /// front of the packet), turned back: Ethernet and IP addresses swapped, lengths
    /// and checksums made anew (an IPv4 UDP checksum zero, as RFC 7348 §5 and RFC 8926
    /// §3.3 allow), TTL or hop limit 64, ECN Not-ECT; the UDP ports, and the tunnel's
    /// header with its VNI and any options, as they were: the far end sent to this
    /// port from that one.
    #[cold]
    #[inline(never)]
    pub fn time_exceeded_in_tunnel(&mut self, pkt: &mut PacketBuf) -> Verdict {
        let expired = Verdict::Drop(DropReason::TtlExpired);
        let tunnel = pkt.headroom().checked_sub(HEADROOM);
        let Some(tunnel) = tunnel.filter(|n| (1..=MAX_TUNNEL).contains(n)) else {
            return expired;
        };
        // The frame as it came.
        if !pkt.push_front(tunnel) {
            return expired;
        }
        let came = parse::parse(pkt.data(), &self.tunnels).ok();
        let Some(outer) = came.filter(|m| m.tunnel.is_some_and(|t| usize::from(t.inner) == tunnel))
        else {
            pkt.pull_front(tunnel);
            return expired;
        };
        let mut headers = [0u8; MAX_TUNNEL];
        headers[..tunnel].copy_from_slice(&pkt.data()[..tunnel]);
        let message = self.expired(pkt, tunnel);
        if self.send(pkt, message, DropReason::TtlExpired).is_none() {
            pkt.pull_front(tunnel);
            return expired;
        }
        if !pkt.push_front(tunnel) {
            return expired;
        }
        turn_back(pkt.data_mut(), &headers[..tunnel], &outer.outer);
        Verdict::Told(pkt.port, DropReason::TtlExpired)
    }

    /// The Time Exceeded message about the frame at `frame_at` of `pkt`, from the address
    /// of its IP version of the port it came in by, where the port has one and its
    /// sender can be told.
    fn expired(&self, pkt: &PacketBuf, frame_at: usize) -> Option<Message> {
        let from = self.addresses[pkt.port.index()];
        let o = Offender::of(pkt.data(), frame_at, false)?;
        let source = match o.v6 {
            false => from.0.map(|a| a.to_ipv6_mapped().octets()),
            true => from.1.map(|a| a.octets()),
        };
        Some(o.message(icmp::ErrorRepr::TimeExceeded { v6: o.v6 }, source?))
    }

    /// Makes `pkt` `message`, if there is one and the limit lets it go.
    fn send(
        &mut self,
        pkt: &mut PacketBuf,
        message: Option<Message>,
        reason: DropReason,
    ) -> Option<Verdict> {
        let m = message.filter(|_| self.limit.take(pkt.ts_ns))?;
        m.write(pkt).then_some(Verdict::Told(pkt.port, reason))
    }
}

/// The packet an error is about, as its sender sent it: where its frame starts in the
/// buffer, its Ethernet header's length (tags included), its IP version, length and
/// addresses (IPv4 ones mapped into IPv6's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Offender {
    frame_at: usize,
    l2: usize,
    pub v6: bool,
    /// The IP packet's length.
    pub total: usize,
    /// IPv4's DF flag (false for IPv6, which routers never fragment).
    pub dont_frag: bool,
    /// The DSCP the message has.
    dscp: u8,
    src: [u8; 16],
    dst: [u8; 16],
}

impl Offender {
    /// The frame starting at `frame_at` of `data`, when its sender can be told of it:
    /// IPv4 or IPv6 from and to one host's address, not an ICMP error; not a fragment
    /// other than the first, and with `whole`, no fragment at all.
    pub fn of(data: &[u8], frame_at: usize, whole: bool) -> Option<Offender> {
        let frame = data.get(frame_at..)?;
        let l2 = l3_offset(frame);
        if l2 > MAX_L2 || frame.len() < l2 {
            return None;
        }
        let ip = &frame[l2..];
        let (v6, total, dont_frag, dscp, src, dst) = match be16(frame, l2 - 2) {
            ethertype::IPV4 => {
                let p = ipv4::Packet::new_checked(ip).ok()?;
                let first = p.frag_offset() == 0 && !(whole && p.more_frags());
                if !first || !answerable_v4(p.src(), p.dst()) {
                    return None;
                }
                if p.protocol() == ip_proto::ICMP {
                    let kind = *p.payload().first()?;
                    if icmp::is_error(false, kind) {
                        return None;
                    }
                }
                let (src, dst) = (mapped(p.src()), mapped(p.dst()));
                let dscp = DSCP | (p.dscp() & TOS_BITS);
                (
                    false,
                    usize::from(p.total_len()),
                    p.dont_frag(),
                    dscp,
                    src,
                    dst,
                )
            }
            ethertype::IPV6 => {
                let p = ipv6::Packet::new_checked(ip).ok()?;
                if !answerable_v6(&p.src(), &p.dst()) {
                    return None;
                }
                let upper = p.upper_layer().ok()?;
                if upper.protocol == ip_proto::ICMPV6 {
                    let kind = *ip.get(upper.offset)?;
                    if upper.l4_present && icmp::is_error(true, kind) {
                        return None;
                    }
                }
                let total = ipv6::HEADER_LEN + usize::from(p.payload_len());
                (true, total, false, DSCP, p.src(), p.dst())
            }
            _ => return None,
        };
        Some(Offender {
            frame_at,
            l2,
            v6,
            total,
            dont_frag,
            dscp,
            src,
            dst,
        })
    }

    /// The error `repr` about this packet to its sender, from `from`, quoting as much
    /// of it as fits the least MTU of its IP version: 576 bytes for IPv4 (RFC 1812
    /// §4.3.2.3), 1280 for IPv6 (RFC 4443 §2.4 (c)).
    pub fn message(&self, repr: icmp::ErrorRepr, from: [u8; 16]) -> Message {
        let room = match self.v6 {
            true => 1280 - ipv6::HEADER_LEN,
            false => 576 - ipv4::MIN_HEADER_LEN,
        };
        Message {
            frame_at: self.frame_at,
            l2: self.l2,
            v6: self.v6,
            repr,
            quote: self.total.min(room - icmp::HEADER_LEN),
            dscp: self.dscp,
            from,
            to: self.src,
        }
    }

    /// The address the packet was for.
    pub fn dst(&self) -> [u8; 16] {
        self.dst
    }
}

/// An ICMP error worked out before anything is written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Message {
    frame_at: usize,
    l2: usize,
    v6: bool,
    pub repr: icmp::ErrorRepr,
    /// How much of the sender's IP packet the message quotes.
    quote: usize,
    dscp: u8,
    from: [u8; 16],
    to: [u8; 16],
}

impl Message {
    /// Makes `pkt` this message, in place: the quoted bytes stay where they are, and the
    /// headers are written in front of them (over a tunnel's, if one). False when the
    /// packet lacks the headroom (it is left as it was).
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
                src: self.from,
                dst: self.to,
                next_header: ip_proto::ICMPV6,
                hop_limit: HOP_LIMIT,
                dscp: self.dscp,
                flow_label: 0,
                payload_len: msg_len,
            }
            .emit(ip);
            checksum::pseudo_v6(&self.from, &self.to, ip_proto::ICMPV6, msg_len.into())
        } else {
            ipv4::Repr {
                src: unmapped(&self.from),
                dst: unmapped(&self.to),
                protocol: ip_proto::ICMP,
                ttl: HOP_LIMIT,
                dscp: self.dscp,
                // An atomic datagram, whose identification may be 0 (RFC 6864 §4.1).
                dont_frag: true,
                payload_len: msg_len,
            }
            .emit(ip);
            0
        };
        self.repr.emit(msg, pseudo);
        true
    }
}

/// Writes `headers`, a tunnel's headers as they came (their layers `l`), turned back
/// (see [`Errors::time_exceeded_in_tunnel`]) in front of what `frame` carries after them.
fn turn_back(frame: &mut [u8], headers: &[u8], l: &Layers) {
    let (l3, l4) = (usize::from(l.l3), usize::from(l.l4));
    let len = frame.len();
    frame[..headers.len()].copy_from_slice(headers);
    let (to, from) = frame.split_at_mut(6);
    to.swap_with_slice(&mut from[..6]);
    let mut udp = udp::Packet::new_unchecked(&mut frame[l4..]);
    udp.set_len((len - l4) as u16);
    match l.l3_kind {
        L3::V4 => {
            udp.set_checksum(0);
            let mut ip = ipv4::Packet::new_unchecked(&mut frame[l3..]);
            let (src, dst) = (ip.src(), ip.dst());
            ip.set_src(dst);
            ip.set_dst(src);
            ip.set_total_len((len - l3) as u16);
            ip.set_ttl(HOP_LIMIT);
            ip.set_ecn(0);
            ip.fill_checksum();
        }
        L3::V6 => {
            let mut ip = ipv6::Packet::new_unchecked(&mut frame[l3..]);
            let (src, dst) = (ip.src(), ip.dst());
            ip.set_src(dst);
            ip.set_dst(src);
            ip.set_payload_len((len - l3 - ipv6::HEADER_LEN) as u16);
            ip.set_hop_limit(HOP_LIMIT);
            ip.set_ecn(0);
        }
        L3::None => return,
    }
    // The UDP checksum over the message, where there is one (IPv6).
    refresh_outer_udp_checksum(
        frame,
        &Layers {
            l3_end: len as u16,
            ..*l
        },
    );
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
}
