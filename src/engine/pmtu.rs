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
//! instead (IPv4 without DF), nor about those no ICMP error is sent for
//! ([`super::icmp_error`], which builds the message and limits how many go).

use super::icmp_error::{Message, Offender};
use super::packet::{PacketBuf, HEADROOM};
use super::parse::{self, TunnelPorts};
use crate::wire::icmp;

/// The length of the frame `pkt` carries in a tunnel the walk put in front of it as it
/// arrived: the tunnel's inner frame starts where the frame was received (a packet is
/// loaded [`HEADROOM`] into its buffer, and only an encapsulation puts a tunnel header in
/// front of it). None for a packet that arrived tunnelled, was decapsulated, or whose
/// frame was retagged before it was encapsulated.
pub fn encapsulated_as_arrived(pkt: &PacketBuf, tunnels: &TunnelPorts) -> Option<usize> {
    let t = parse::parse(pkt.data(), tunnels).ok()?.tunnel?;
    (pkt.headroom() + usize::from(t.inner) == HEADROOM).then(|| pkt.len() - usize::from(t.inner))
}

/// The message for `pkt`, which does not fit an MTU of `mtu` bytes of IP packet and
/// ends with the `inner_len` bytes of the frame a tunnel carries, when that frame's
/// sender is to be told: it comes from the address the frame was for.
pub fn too_big(pkt: &PacketBuf, inner_len: usize, mtu: u16) -> Option<Message> {
    let data = pkt.data();
    let frame_at = data.len().checked_sub(inner_len).filter(|&at| at > 0)?;
    // A datagram that may be cut up instead is not told of (IPv4 without DF).
    let o = Offender::of(data, frame_at, true).filter(|o| o.v6 || o.dont_frag)?;
    // What the tunnel adds in front of the sender's IP packet, up to the outer one's.
    let overhead = (data.len() - super::action::l3_offset(data)).checked_sub(o.total)?;
    let room = usize::from(mtu).checked_sub(overhead)?;
    // The least MTU links of the version carry: RFC 791's 68 bytes, RFC 8200 §5's 1280.
    let least = if o.v6 { 1280 } else { 68 };
    if room < least || room >= o.total {
        return None;
    }
    let repr = icmp::ErrorRepr::TooBig {
        v6: o.v6,
        mtu: room as u32,
    };
    Some(o.message(repr, o.dst()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::PortId;
    use crate::wire::ethernet::ethertype;
    use crate::wire::ip_proto;
    use crate::wire::testing::ip_frame;

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
        let mtu_of = |(pkt, inner): (PacketBuf, usize), mtu| match too_big(&pkt, inner, mtu)?.repr {
            icmp::ErrorRepr::TooBig { mtu, .. } => Some(mtu),
            icmp::ErrorRepr::TimeExceeded { .. } => None,
        };
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
        assert_eq!(too_big(&pkt, inner, 1400), None);
        assert_eq!(too_big(&pkt, 0, 1400), None);
        // IPv4 without DF may be cut up instead.
        let (mut pkt, inner) = tunnelled(50, false, host, 0x0a01_0001, 1500);
        pkt.data_mut()[50 + 14 + 6] = 0;
        assert_eq!(too_big(&pkt, inner, 1500), None);
    }
}
