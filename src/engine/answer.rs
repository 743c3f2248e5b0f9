//! Answering for addresses the pipeline owns: an ARP request (RFC 826), an IPv6
//! neighbour solicitation (RFC 4861 §7.2.4) or an ICMP or ICMPv6 echo request (RFC 792,
//! RFC 4443 §4.2) turned, where it lies in its buffer, into the reply its target would
//! send, for the pipeline to send back. A gateway so answers for its own tunnel endpoint
//! on the underlay, and for the overlay's addresses to its host (as OVN's ARP and ND
//! responders, and EVPN's ARP suppression, do), where nobody else on the link would.

use super::icmp_error;
use super::packet::PacketBuf;
use super::parse::{self, Layers, L3};
use super::DropReason;
use crate::ir::Announcement;
use crate::wire::ethernet::{self, ethertype};
use crate::wire::{arp, be16, checksum, icmp, ip_proto, ipv4, ipv6, ndp, put16};

/// An ARP request's reply from `mac`, to the requester's hardware address. A frame that
/// is not an Ethernet/IPv4 ARP request, or is an announcement (sender and target
/// addresses equal, RFC 5227 §2.3: nobody is asked), is not answered.
#[cold]
#[inline(never)]
pub fn reply_arp(frame: &mut [u8], l: &Layers, mac: ethernet::Address) -> Result<(), DropReason> {
    let at = usize::from(l.l3);
    let request = match frame.get(at..).map(arp::Packet::new_checked) {
        Some(Ok(p)) if l.ethertype == ethertype::ARP => arp::Repr::parse(&p),
        _ => return Err(DropReason::Unanswerable),
    };
    if request.op != arp::op::REQUEST || request.spa == request.tpa {
        return Err(DropReason::Unanswerable);
    }
    arp::Repr::reply_to(&request, mac).emit(&mut frame[at..]);
    set_macs(frame, l, request.sha, mac);
    Ok(())
}

/// A neighbour solicitation's advertisement from `mac` (RFC 4861 §7.2.4): to the
/// soliciting address, Solicited; or, answering duplicate address detection (a
/// solicitation from the unspecified address), to all nodes. Override is set, as OVN's
/// responder sets it: the answer is the one address the pipeline gives for the target.
/// A solicitation §7.1.1 says to discard is not answered.
#[cold]
#[inline(never)]
pub fn advertise(
    pkt: &mut PacketBuf,
    l: &Layers,
    mac: ethernet::Address,
    router: bool,
) -> Result<(), DropReason> {
    let solicitation = Solicitation::read(pkt.data(), l).ok_or(DropReason::Unanswerable)?;
    let l3 = usize::from(l.l3);
    // The advertisement follows the IPv6 header at once, whatever extension headers the
    // solicitation had.
    let len = l3 + ipv6::HEADER_LEN + ndp::ADVERT_LEN;
    if !pkt.set_len(len) {
        return Err(DropReason::Oversize);
    }
    let frame = pkt.data_mut();
    let (dst, eth_dst) = match solicitation.reply_to {
        Some((ip, mac)) => (ip, mac),
        None => (ALL_NODES, ALL_NODES_MAC),
    };
    ipv6::Repr {
        src: solicitation.target,
        dst,
        next_header: ip_proto::ICMPV6,
        hop_limit: 255,
        dscp: 0,
        flow_label: 0,
        payload_len: ndp::ADVERT_LEN as u16,
    }
    .emit(&mut frame[l3..]);
    let pseudo = checksum::pseudo_v6(
        &solicitation.target,
        &dst,
        ip_proto::ICMPV6,
        ndp::ADVERT_LEN as u32,
    );
    ndp::AdvertRepr {
        router,
        solicited: solicitation.reply_to.is_some(),
        override_cache: true,
        target: solicitation.target,
        target_mac: mac,
    }
    .emit(&mut frame[l3 + ipv6::HEADER_LEN..], pseudo);
    set_macs(frame, l, eth_dst, mac);
    Ok(())
}

/// An echo request's reply (RFC 792, RFC 4443 §4.2): the addresses swapped (Ethernet and
/// IP), the type made the reply's, TTL or hop limit 64, checksums updated (swapping the
/// addresses leaves the pseudo-header's sum as it was). Not answered: a request that is
/// not whole (a fragment, a bad checksum, a code other than 0), one to or from an
/// address that is not one host's (multicast, broadcast, unspecified, loopback: the
/// addresses the too-big answers refuse too; RFC 1122 §3.2.2.6 lets a host keep quiet
/// there), and over IPv6 one behind extension headers.
#[cold]
#[inline(never)]
pub fn reply_echo(frame: &mut [u8], l: &Layers) -> Result<(), DropReason> {
    let (l3, l4, end) = (usize::from(l.l3), usize::from(l.l4), usize::from(l.l3_end));
    let v6 = match (l.l3_kind, l.proto) {
        (L3::V4, ip_proto::ICMP) => false,
        (L3::V6, ip_proto::ICMPV6) if l4 == l3 + ipv6::HEADER_LEN => true,
        _ => return Err(DropReason::Unanswerable),
    };
    if !l.l4_ok || end < l4 + icmp::HEADER_LEN || end > frame.len() {
        return Err(DropReason::Unanswerable);
    }
    let (request, reply) = match v6 {
        true => (icmp::v6_type::ECHO_REQUEST, icmp::v6_type::ECHO_REPLY),
        false => (icmp::v4_type::ECHO_REQUEST, icmp::v4_type::ECHO_REPLY),
    };
    let one_host_each = match v6 {
        true => {
            let ip = ipv6::Packet::new_unchecked(&frame[l3..]);
            icmp_error::answerable_v6(&ip.src(), &ip.dst())
        }
        false => {
            let ip = ipv4::Packet::new_unchecked(&frame[l3..]);
            icmp_error::answerable_v4(ip.src(), ip.dst())
        }
    };
    let msg = &frame[l4..end];
    if !one_host_each || msg[0] != request || msg[1] != 0 || !icmp_checksum_ok(frame, l) {
        return Err(DropReason::Unanswerable);
    }
    let eth = ethernet::Frame::new_unchecked(&frame[usize::from(l.l2)..]);
    let (eth_src, eth_dst) = (eth.src(), eth.dst());
    if eth_dst[0] & 1 != 0 {
        // Sent to a group: the reply would come from one.
        return Err(DropReason::Unanswerable);
    }
    if v6 {
        let mut ip = ipv6::Packet::new_unchecked(&mut frame[l3..]);
        let (src, dst) = (ip.src(), ip.dst());
        ip.set_src(dst);
        ip.set_dst(src);
        ip.set_hop_limit(64);
    } else {
        let mut ip = ipv4::Packet::new_unchecked(&mut frame[l3..]);
        let (src, dst) = (ip.src(), ip.dst());
        // The header's checksum sums both addresses either way round.
        ip.set_src(dst);
        ip.set_dst(src);
        ip.set_ttl(64);
    }
    let old = be16(frame, l4);
    frame[l4] = reply;
    let c = checksum::update16(be16(frame, l4 + 2), old, be16(frame, l4));
    put16(frame, l4 + 2, c);
    set_macs(frame, l, eth_src, eth_dst);
    Ok(())
}

/// Whether the ICMP or ICMPv6 message of a whole packet sums right: over the message
/// (RFC 792), with the IPv6 pseudo-header (RFC 4443 §2.3).
fn icmp_checksum_ok(frame: &[u8], l: &Layers) -> bool {
    let msg = &frame[usize::from(l.l4)..usize::from(l.l3_end)];
    let pseudo = match l.l3_kind {
        L3::V6 => parse::pseudo_header(frame, l, ip_proto::ICMPV6, msg.len()),
        _ => Some(0),
    };
    pseudo.is_some_and(|p| checksum::fold(checksum::sum(p, msg)) == 0xffff)
}

/// The all-nodes multicast address, ff02::1, and its Ethernet group (RFC 2464 §7).
/// The frame that announces `a` (see [`crate::ir::Program::announcements`]): an ARP Announcement,
/// broadcast (RFC 5227 §2.3: a request whose sender and target addresses are both the
/// address, its target hardware address zero); or an unsolicited Neighbor Advertisement
/// from the address to all nodes, Override set and Solicited not (RFC 4861 §7.2.6),
/// Router as the rule answers. Padded to Ethernet's least frame, 60 bytes before the FCS.
pub fn announcement(a: &Announcement) -> Vec<u8> {
    let mut frame = vec![0u8; ethernet::HEADER_LEN];
    let (dst, src, kind) = match *a {
        Announcement::Arp { ip, mac } => {
            let mut request = [0u8; arp::LEN];
            arp::Repr {
                op: arp::op::REQUEST,
                sha: mac,
                spa: ip,
                tha: [0; 6],
                tpa: ip,
            }
            .emit(&mut request);
            frame.extend_from_slice(&request);
            ([0xff; 6], mac, ethertype::ARP)
        }
        Announcement::Nd { ip, mac, router } => {
            let target = ip.octets();
            let mut packet = [0u8; ipv6::HEADER_LEN + ndp::ADVERT_LEN];
            ipv6::Repr {
                src: target,
                dst: ALL_NODES,
                next_header: ip_proto::ICMPV6,
                hop_limit: 255,
                dscp: 0,
                flow_label: 0,
                payload_len: ndp::ADVERT_LEN as u16,
            }
            .emit(&mut packet);
            let len = ndp::ADVERT_LEN as u32;
            let pseudo = checksum::pseudo_v6(&target, &ALL_NODES, ip_proto::ICMPV6, len);
            ndp::AdvertRepr {
                router,
                solicited: false,
                override_cache: true,
                target,
                target_mac: mac,
            }
            .emit(&mut packet[ipv6::HEADER_LEN..], pseudo);
            frame.extend_from_slice(&packet);
            (ALL_NODES_MAC, mac, ethertype::IPV6)
        }
    };
    ethernet::Repr {
        src,
        dst,
        ethertype: kind,
    }
    .emit(&mut frame);
    frame.resize(frame.len().max(ethernet::HEADER_LEN + 46), 0);
    frame
}

const ALL_NODES: [u8; 16] = [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1];
const ALL_NODES_MAC: ethernet::Address = [0x33, 0x33, 0, 0, 0, 1];

fn set_macs(frame: &mut [u8], l: &Layers, dst: ethernet::Address, src: ethernet::Address) {
    let mut eth = ethernet::Frame::new_unchecked(&mut frame[usize::from(l.l2)..]);
    eth.set_dst(dst);
    eth.set_src(src);
}

/// What answering a valid solicitation takes from it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Solicitation {
    target: [u8; 16],
    /// The solicitor's address and hardware address; `None` for duplicate address
    /// detection.
    reply_to: Option<([u8; 16], ethernet::Address)>,
}

impl Solicitation {
    /// The solicitation in `frame`, if RFC 4861 §7.1.1 lets a node take it: hop limit
    /// 255 (it comes from the link), a correct checksum, code 0, at least 24 bytes, a
    /// target that is not multicast, well-formed options, and from the unspecified
    /// address only to a solicited-node group and without a source link-layer address.
    fn read(frame: &[u8], l: &Layers) -> Option<Solicitation> {
        if l.l3_kind != L3::V6 || l.proto != ip_proto::ICMPV6 || !l.l4_ok {
            return None;
        }
        let ip = ipv6::Packet::new_checked(&frame[usize::from(l.l3)..]).ok()?;
        let msg = &frame[usize::from(l.l4)..usize::from(l.l3_end)];
        let nd = ndp::Packet::new_checked(msg).ok()?;
        let (src, dst) = (ip.src(), ip.dst());
        let valid = ip.hop_limit() == 255
            && nd.msg_type() == icmp::v6_type::NEIGHBOR_SOLICIT
            && nd.code() == 0
            && icmp_checksum_ok(frame, l)
            && nd.target()[0] != 0xff;
        let source_mac = nd.link_addr(ndp::option::SOURCE_LINK_ADDR).ok()?;
        if !valid {
            return None;
        }
        let reply_to = if src == [0; 16] {
            let solicited_node = dst[..13] == [0xff, 2, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1, 0xff];
            if !solicited_node || source_mac.is_some() {
                return None;
            }
            None
        } else {
            let eth = ethernet::Frame::new_checked(&frame[usize::from(l.l2)..]).ok()?;
            Some((src, source_mac.unwrap_or(eth.src())))
        };
        Some(Solicitation {
            target: nd.target(),
            reply_to,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::parse::{self, TunnelPorts};
    use crate::ir::PortId;

    const GATEWAY: [u8; 6] = [2, 0, 0, 0, 1, 1];
    const HOST: [u8; 6] = [2, 0, 0, 0, 0, 0x0a];

    fn arp_frame(op: u16, spa: [u8; 4], tpa: [u8; 4]) -> Vec<u8> {
        let mut f = vec![0u8; 60];
        ethernet::Repr {
            src: HOST,
            dst: [0xff; 6],
            ethertype: ethertype::ARP,
        }
        .emit(&mut f);
        arp::Repr {
            op,
            sha: HOST,
            spa: spa.into(),
            tha: [0; 6],
            tpa: tpa.into(),
        }
        .emit(&mut f[ethernet::HEADER_LEN..]);
        f
    }

    fn answer_arp(frame: &mut [u8]) -> Result<(), DropReason> {
        let meta = parse::parse(frame, &TunnelPorts::default()).unwrap();
        reply_arp(frame, &meta.outer, GATEWAY)
    }

    #[test]
    fn an_arp_request_becomes_its_reply() {
        let mut f = arp_frame(arp::op::REQUEST, [192, 0, 2, 10], [192, 0, 2, 1]);
        answer_arp(&mut f).unwrap();
        let eth = ethernet::Frame::new_checked(&f[..]).unwrap();
        assert_eq!(
            (eth.dst(), eth.src(), eth.ethertype()),
            (HOST, GATEWAY, ethertype::ARP)
        );
        let r = arp::Repr::parse(&arp::Packet::new_checked(eth.payload()).unwrap());
        assert_eq!(
            r,
            arp::Repr {
                op: arp::op::REPLY,
                sha: GATEWAY,
                spa: [192, 0, 2, 1].into(),
                tha: HOST,
                tpa: [192, 0, 2, 10].into(),
            }
        );
        assert_eq!(f.len(), 60, "padding kept");
    }

    #[test]
    fn replies_announcements_and_other_frames_are_not_answered() {
        let reply = arp_frame(arp::op::REPLY, [192, 0, 2, 10], [192, 0, 2, 1]);
        let announcement = arp_frame(arp::op::REQUEST, [192, 0, 2, 1], [192, 0, 2, 1]);
        let mut short = arp_frame(arp::op::REQUEST, [192, 0, 2, 10], [192, 0, 2, 1]);
        short.truncate(ethernet::HEADER_LEN + arp::LEN - 1);
        let ip = crate::wire::testing::frame(false, 1, 2, ip_proto::UDP, 1, 2, 0, 0);
        for mut f in [reply, announcement, short, ip] {
            let before = f.clone();
            assert_eq!(answer_arp(&mut f), Err(DropReason::Unanswerable));
            assert_eq!(f, before, "left as it was");
        }
    }

    const HOST6: u128 = 0x2001_0db8_0000_0000_0000_0000_0000_000a;
    const TARGET: u128 = 0x2001_0db8_0000_0000_0000_0000_0000_0001;
    const SOLICITED_NODE: u128 = 0xff02_0000_0000_0000_0000_0001_ff00_0001;

    /// A solicitation for `TARGET` from `src` to `dst`, with `options` after its target.
    fn solicitation(src: u128, dst: u128, hop_limit: u8, options: &[u8]) -> Vec<u8> {
        let mut msg = vec![icmp::v6_type::NEIGHBOR_SOLICIT, 0, 0, 0, 0, 0, 0, 0];
        msg.extend(TARGET.to_be_bytes());
        msg.extend_from_slice(options);
        let (s, d) = (src.to_be_bytes(), dst.to_be_bytes());
        let pseudo = checksum::pseudo_v6(&s, &d, ip_proto::ICMPV6, msg.len() as u32);
        let c = !checksum::fold(checksum::sum(pseudo, &msg));
        msg[2..4].copy_from_slice(&c.to_be_bytes());
        let mut f = crate::wire::testing::ip_frame(true, src, dst, ip_proto::ICMPV6, 0, &msg);
        f[ethernet::HEADER_LEN + 7] = hop_limit;
        f[6..12].copy_from_slice(&HOST);
        f
    }

    fn answer_nd(frame: &[u8], router: bool) -> Result<Vec<u8>, DropReason> {
        let mut pkt = PacketBuf::new(256);
        assert!(pkt.load(frame, PortId(0), 0));
        let meta = parse::parse(frame, &TunnelPorts::default()).unwrap();
        advertise(&mut pkt, &meta.outer, GATEWAY, router)?;
        Ok(pkt.data().to_vec())
    }

    /// An advertisement's fields, as sent.
    #[derive(Debug, PartialEq, Eq)]
    struct Advert {
        eth_dst: [u8; 6],
        eth_src: [u8; 6],
        ip_src: u128,
        ip_dst: u128,
        hop_limit: u8,
        /// R, S and O.
        flags: u32,
        target: u128,
        target_mac: [u8; 6],
    }

    /// The advertisement in `f`, its checksum verified.
    fn read_advert(f: &[u8]) -> Advert {
        let eth = ethernet::Frame::new_checked(f).unwrap();
        let ip = ipv6::Packet::new_checked(eth.payload()).unwrap();
        assert_eq!(ip.next_header(), ip_proto::ICMPV6);
        assert_eq!(usize::from(ip.payload_len()), ndp::ADVERT_LEN);
        let msg = &eth.payload()[ipv6::HEADER_LEN..];
        assert_eq!(msg.len(), ndp::ADVERT_LEN);
        let pseudo = checksum::pseudo_v6(&ip.src(), &ip.dst(), ip_proto::ICMPV6, 32);
        assert_eq!(checksum::fold(checksum::sum(pseudo, msg)), 0xffff);
        let nd = ndp::Packet::new_checked(msg).unwrap();
        assert_eq!(nd.msg_type(), icmp::v6_type::NEIGHBOR_ADVERT);
        Advert {
            eth_dst: eth.dst(),
            eth_src: eth.src(),
            ip_src: u128::from_be_bytes(ip.src()),
            ip_dst: u128::from_be_bytes(ip.dst()),
            hop_limit: ip.hop_limit(),
            flags: nd.flags() >> 29,
            target: u128::from_be_bytes(nd.target()),
            target_mac: nd
                .link_addr(ndp::option::TARGET_LINK_ADDR)
                .unwrap()
                .unwrap(),
        }
    }

    /// What the gateway advertises for `TARGET`, to these addresses with these flags.
    fn advert(eth_dst: [u8; 6], ip_dst: u128, flags: u32) -> Advert {
        Advert {
            eth_dst,
            eth_src: GATEWAY,
            ip_src: TARGET,
            ip_dst,
            hop_limit: 255,
            flags,
            target: TARGET,
            target_mac: GATEWAY,
        }
    }

    /// An address's announcements: an ARP request from and for it, broadcast, which a
    /// gateway's own `arp.reply` leaves unanswered; an unsolicited advertisement of it to
    /// all nodes, Override set, Router as the rule says.
    #[test]
    fn announcements_are_an_arp_announcement_and_an_unsolicited_advertisement() {
        let ip = std::net::Ipv4Addr::new(192, 0, 2, 1);
        let frame = announcement(&Announcement::Arp { ip, mac: GATEWAY });
        assert_eq!(frame.len(), 60);
        let eth = ethernet::Frame::new_checked(&frame[..]).unwrap();
        assert_eq!(
            (eth.dst(), eth.src(), eth.ethertype()),
            ([0xff; 6], GATEWAY, ethertype::ARP)
        );
        let request = arp::Repr::parse(&arp::Packet::new_checked(eth.payload()).unwrap());
        let want = arp::Repr {
            op: arp::op::REQUEST,
            sha: GATEWAY,
            spa: ip,
            tha: [0; 6],
            tpa: ip,
        };
        assert_eq!(request, want);
        let l = parse::parse(&frame, &TunnelPorts::default()).unwrap().outer;
        let answered = reply_arp(&mut frame.clone(), &l, GATEWAY);
        assert_eq!(answered, Err(DropReason::Unanswerable));
        for router in [false, true] {
            let ip = std::net::Ipv6Addr::from(TARGET);
            let frame = announcement(&Announcement::Nd {
                ip,
                mac: GATEWAY,
                router,
            });
            let all_nodes = u128::from_be_bytes(ALL_NODES);
            let flags = 0b001 | u32::from(router) << 2;
            assert_eq!(read_advert(&frame), advert(ALL_NODES_MAC, all_nodes, flags));
        }
    }

    #[test]
    fn a_solicitation_becomes_its_advertisement() {
        let sll = [1, 1, 2, 0, 0, 0, 0, 0x0b];
        for (options, to_mac) in [(&sll[..], [2, 0, 0, 0, 0, 0x0b]), (&[][..], HOST)] {
            let f = solicitation(HOST6, SOLICITED_NODE, 255, options);
            let answer = answer_nd(&f, false).unwrap();
            assert_eq!(read_advert(&answer), advert(to_mac, HOST6, 0b011));
            let router = read_advert(&answer_nd(&f, true).unwrap()).flags;
            assert_eq!(router, 0b111);
        }
    }

    #[test]
    fn duplicate_address_detection_is_answered_to_all_nodes() {
        let f = solicitation(0, SOLICITED_NODE, 255, &[]);
        let all_nodes = u128::from_be_bytes(ALL_NODES);
        assert_eq!(
            read_advert(&answer_nd(&f, false).unwrap()),
            advert(ALL_NODES_MAC, all_nodes, 0b001)
        );
    }

    #[test]
    fn solicitations_a_node_discards_are_not_answered() {
        let sll = [1, 1, 2, 0, 0, 0, 0, 0x0b];
        let mut bad_checksum = solicitation(HOST6, SOLICITED_NODE, 255, &[]);
        let n = bad_checksum.len();
        bad_checksum[n - 1] ^= 1;
        let mut advert = solicitation(HOST6, SOLICITED_NODE, 255, &[]);
        advert[ethernet::HEADER_LEN + ipv6::HEADER_LEN] = icmp::v6_type::NEIGHBOR_ADVERT;
        for f in [
            solicitation(HOST6, SOLICITED_NODE, 64, &[]),
            solicitation(0, SOLICITED_NODE, 255, &sll),
            solicitation(0, HOST6, 255, &[]),
            solicitation(HOST6, SOLICITED_NODE, 255, &[1, 0, 0, 0, 0, 0, 0, 0]),
            bad_checksum,
            advert,
            crate::wire::testing::frame(true, 1, 2, ip_proto::UDP, 1, 2, 0, 0),
        ] {
            assert_eq!(answer_nd(&f, false), Err(DropReason::Unanswerable));
        }
    }

    /// An echo request from `src` to `dst`, its checksum right, sent from `HOST` to
    /// `eth_dst`.
    fn echo(v6: bool, src: u128, dst: u128, eth_dst: [u8; 6]) -> Vec<u8> {
        let kind = match v6 {
            true => icmp::v6_type::ECHO_REQUEST,
            false => icmp::v4_type::ECHO_REQUEST,
        };
        let mut msg = vec![kind, 0, 0, 0, 0x12, 0x34, 0, 7];
        msg.extend_from_slice(b"abcdefgh");
        let pseudo = match v6 {
            true => checksum::pseudo_v6(
                &src.to_be_bytes(),
                &dst.to_be_bytes(),
                ip_proto::ICMPV6,
                msg.len() as u32,
            ),
            false => 0,
        };
        let c = !checksum::fold(checksum::sum(pseudo, &msg));
        msg[2..4].copy_from_slice(&c.to_be_bytes());
        let proto = if v6 { ip_proto::ICMPV6 } else { ip_proto::ICMP };
        let mut f = crate::wire::testing::ip_frame(v6, src, dst, proto, 0, &msg);
        if !v6 {
            ipv4::Packet::new_unchecked(&mut f[ethernet::HEADER_LEN..]).fill_checksum();
        }
        f[..6].copy_from_slice(&eth_dst);
        f[6..12].copy_from_slice(&HOST);
        f
    }

    fn answer_echo(frame: &mut [u8]) -> Result<(), DropReason> {
        let meta = parse::parse(frame, &TunnelPorts::default()).unwrap();
        reply_echo(frame, &meta.outer)
    }

    #[test]
    fn an_echo_request_becomes_its_reply() {
        let (host4, me4) = (0xc000_020a, 0xc000_0201);
        for (v6, src, dst) in [(false, host4, me4), (true, HOST6, TARGET)] {
            let mut f = echo(v6, src, dst, GATEWAY);
            answer_echo(&mut f).unwrap();
            let meta = parse::parse(&f, &TunnelPorts::default()).unwrap();
            let l = meta.outer;
            let (l3, l4) = (usize::from(l.l3), usize::from(l.l4));
            let eth = ethernet::Frame::new_checked(&f[..]).unwrap();
            assert_eq!((eth.dst(), eth.src()), (HOST, GATEWAY));
            let msg = &f[l4..usize::from(l.l3_end)];
            let (addrs, ttl, pseudo, reply) = if v6 {
                let ip = ipv6::Packet::new_checked(&f[l3..]).unwrap();
                let sum =
                    checksum::pseudo_v6(&ip.src(), &ip.dst(), ip_proto::ICMPV6, msg.len() as u32);
                let addrs = (u128::from_be_bytes(ip.src()), u128::from_be_bytes(ip.dst()));
                (addrs, ip.hop_limit(), sum, icmp::v6_type::ECHO_REPLY)
            } else {
                let ip = ipv4::Packet::new_checked(&f[l3..]).unwrap();
                assert_eq!(checksum::checksum(&f[l3..l4]), 0, "IPv4 header checksum");
                let addrs = (
                    u128::from(u32::from_be_bytes(ip.src())),
                    u128::from(u32::from_be_bytes(ip.dst())),
                );
                (addrs, ip.ttl(), 0, icmp::v4_type::ECHO_REPLY)
            };
            assert_eq!((addrs, ttl), ((dst, src), 64));
            assert_eq!(checksum::fold(checksum::sum(pseudo, msg)), 0xffff);
            assert_eq!((msg[0], msg[1]), (reply, 0));
            assert_eq!(
                &msg[4..],
                b"\x12\x34\x00\x07abcdefgh",
                "identifier, sequence, data"
            );
        }
    }

    #[test]
    fn echo_requests_no_reply_can_answer_are_not_answered() {
        let (host4, me4) = (0xc000_020a, 0xc000_0201);
        let mut bad_checksum = echo(false, host4, me4, GATEWAY);
        let n = bad_checksum.len();
        bad_checksum[n - 1] ^= 1;
        let mut reply = echo(true, HOST6, TARGET, GATEWAY);
        let l4 = ethernet::HEADER_LEN + ipv6::HEADER_LEN;
        reply[l4] = icmp::v6_type::ECHO_REPLY;
        for mut f in [
            bad_checksum,
            reply,
            echo(false, host4, 0xffff_ffff, GATEWAY),
            echo(false, 0, me4, GATEWAY),
            echo(false, host4, 0xe000_0001, GATEWAY),
            echo(false, host4, me4, [0xff; 6]),
            echo(true, HOST6, 0xff02 << 112 | 1, [0x33, 0x33, 0, 0, 0, 1]),
            echo(true, 0, TARGET, GATEWAY),
            crate::wire::testing::frame(false, host4, me4, ip_proto::UDP, 1, 2, 0, 0),
        ] {
            let before = f.clone();
            assert_eq!(answer_echo(&mut f), Err(DropReason::Unanswerable));
            assert_eq!(f, before, "left as it was");
        }
    }
}
