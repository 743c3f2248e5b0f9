//! Zero-copy views and builders for the headers the dataplane reads and writes.
//!
//! Each header has a `Packet<T: AsRef<[u8]>>` view over a buffer. `new_checked` runs
//! `check_len` first; after it succeeds no accessor panics, whatever the bytes are. Headers
//! that dpuflow builds also have a `Repr`, a plain struct with `parse` and `emit`.

/// Declares a zero-copy view over a buffer with `new_unchecked`, `new_checked` (which
/// runs the view's own `check_len`) and `into_inner`.
macro_rules! view {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone)]
        pub struct $name<T: AsRef<[u8]>> {
            buffer: T,
        }

        impl<T: AsRef<[u8]>> $name<T> {
            pub fn new_unchecked(buffer: T) -> Self {
                $name { buffer }
            }

            /// The view, once `check_len` has made sure every accessor is in bounds.
            pub fn new_checked(buffer: T) -> $crate::wire::Result<Self> {
                let v = Self::new_unchecked(buffer);
                v.check_len()?;
                Ok(v)
            }

            pub fn into_inner(self) -> T {
                self.buffer
            }
        }
    };
}

pub mod arp;
pub mod checksum;
pub mod ethernet;
pub mod geneve;
pub mod icmp;
pub mod ipv4;
pub mod ipv6;
pub mod ndp;
pub mod sctp;
pub mod tcp;
pub mod udp;
pub mod vlan;
pub mod vxlan;

/// Why a header could not be read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// the buffer is shorter than the header says it is
    #[error("truncated header")]
    Truncated,
    /// a field holds a value the header's specification does not allow
    #[error("malformed header")]
    Malformed,
}

pub type Result<T> = std::result::Result<T, Error>;

/// ECN codepoints: the low two bits of the IPv4 TOS byte and the IPv6 traffic class
/// (RFC 3168 §5).
pub mod ecn {
    pub const MASK: u8 = 3;
    pub const NOT_ECT: u8 = 0;
    pub const ECT1: u8 = 1;
    pub const CE: u8 = 3;
}

/// IP protocol numbers (IANA "Assigned Internet Protocol Numbers").
pub mod ip_proto {
    pub const HOP_BY_HOP: u8 = 0;
    pub const ICMP: u8 = 1;
    pub const TCP: u8 = 6;
    pub const UDP: u8 = 17;
    pub const GRE: u8 = 47;
    pub const IPV6_ROUTING: u8 = 43;
    pub const IPV6_FRAGMENT: u8 = 44;
    pub const ESP: u8 = 50;
    pub const AH: u8 = 51;
    pub const ICMPV6: u8 = 58;
    pub const IPV6_NO_NEXT: u8 = 59;
    pub const IPV6_DEST_OPTS: u8 = 60;
    pub const SCTP: u8 = 132;
    /// UDP-Lite (RFC 3828): UDP's header, its length field the checksum's coverage.
    pub const UDPLITE: u8 = 136;

    /// Whether the protocol's header starts with source and destination ports (TCP, UDP,
    /// SCTP, UDP-Lite): the transport ports of a 5-tuple.
    pub const fn has_ports(proto: u8) -> bool {
        // A table: one load, where the comparisons cost an exact-match lookup 6
        // instructions a packet.
        const PORTS: [bool; 256] = {
            let mut t = [false; 256];
            t[TCP as usize] = true;
            t[UDP as usize] = true;
            t[SCTP as usize] = true;
            t[UDPLITE as usize] = true;
            t
        };
        PORTS[proto as usize]
    }

    /// ICMP (RFC 792) or ICMPv6 (RFC 4443): a header that starts with a type and a code.
    pub const fn is_icmp(proto: u8) -> bool {
        matches!(proto, ICMP | ICMPV6)
    }
}

#[inline]
pub(crate) fn be16(b: &[u8], at: usize) -> u16 {
    // One range check and one load, where indexing each byte costs a check apiece.
    u16::from_be_bytes(b[at..at + 2].try_into().expect("two bytes"))
}

#[inline]
pub(crate) fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes(b[at..at + 4].try_into().expect("four bytes"))
}

/// Eight bytes from `at` (an IPv4 source and destination) as one big-endian integer.
#[inline]
pub(crate) fn be64(b: &[u8], at: usize) -> u64 {
    u64::from_be_bytes(b[at..at + 8].try_into().expect("eight bytes"))
}

/// Sixteen bytes from `at` as one big-endian integer (an IPv6 address).
#[inline]
pub(crate) fn be128(b: &[u8], at: usize) -> u128 {
    let bytes: [u8; 16] = b[at..at + 16].try_into().expect("sixteen bytes");
    u128::from_be_bytes(bytes)
}

#[inline]
pub(crate) fn put16(b: &mut [u8], at: usize, v: u16) {
    b[at..at + 2].copy_from_slice(&v.to_be_bytes());
}

#[inline]
pub(crate) fn put32(b: &mut [u8], at: usize, v: u32) {
    b[at..at + 4].copy_from_slice(&v.to_be_bytes());
}

/// Checks that `buf` holds at least `len` bytes.
#[inline]
pub(crate) fn need(buf: &[u8], len: usize) -> Result<()> {
    if buf.len() < len {
        Err(Error::Truncated)
    } else {
        Ok(())
    }
}

/// Frames for the tests of the layers above.
#[cfg(test)]
pub(crate) mod testing {
    use super::{ethernet, ip_proto, ipv4, ipv6};

    /// An Ethernet frame carrying IPv4 (addresses in the low 32 bits of `src` and `dst`) or
    /// IPv6, and a TCP (with `tcp_flags`), UDP or other L4 header of 20 or 8 bytes.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn frame(
        v6: bool,
        src: u128,
        dst: u128,
        proto: u8,
        sport: u16,
        dport: u16,
        tcp_flags: u8,
        dscp: u8,
    ) -> Vec<u8> {
        let mut l4 = vec![0u8; if proto == ip_proto::TCP { 20 } else { 8 }];
        l4[0..2].copy_from_slice(&sport.to_be_bytes());
        l4[2..4].copy_from_slice(&dport.to_be_bytes());
        if proto == ip_proto::UDP {
            l4[4..6].copy_from_slice(&8u16.to_be_bytes());
        }
        if proto == ip_proto::TCP {
            l4[12] = 0x50;
            l4[13] = tcp_flags;
        }
        ip_frame(v6, src, dst, proto, dscp, &l4)
    }

    /// An Ethernet frame carrying IPv4 (addresses in the low 32 bits of `src` and `dst`) or
    /// IPv6 with protocol `proto` and `payload` after the IP header.
    pub(crate) fn ip_frame(
        v6: bool,
        src: u128,
        dst: u128,
        proto: u8,
        dscp: u8,
        payload: &[u8],
    ) -> Vec<u8> {
        let l3_len = if v6 { ipv6::HEADER_LEN } else { 20 };
        let mut f = vec![0u8; ethernet::HEADER_LEN + l3_len];
        ethernet::Repr {
            src: [2, 0, 0, 0, 0, 1],
            dst: [2, 0, 0, 0, 0, 2],
            ethertype: if v6 {
                ethernet::ethertype::IPV6
            } else {
                ethernet::ethertype::IPV4
            },
        }
        .emit(&mut f);
        let l3 = &mut f[ethernet::HEADER_LEN..];
        let payload_len = payload.len() as u16;
        if v6 {
            ipv6::Repr {
                src: src.to_be_bytes(),
                dst: dst.to_be_bytes(),
                next_header: proto,
                hop_limit: 64,
                dscp,
                flow_label: 0,
                payload_len,
            }
            .emit(l3);
        } else {
            ipv4::Repr {
                src: (src as u32).to_be_bytes(),
                dst: (dst as u32).to_be_bytes(),
                protocol: proto,
                ttl: 64,
                dscp,
                dont_frag: false,
                payload_len,
            }
            .emit(l3);
        }
        f.extend_from_slice(payload);
        f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// After `new_checked` succeeds, no accessor of any view panics, whatever the bytes.
        #[test]
        fn no_accessor_panics_after_check(
            mut bytes in proptest::collection::vec(any::<u8>(), 0..96),
            udp_len_fits in any::<bool>(),
        ) {
            // Half the time a UDP length that fits, which random bytes rarely hold.
            if udp_len_fits && bytes.len() >= 6 {
                let len = bytes.len() as u16;
                bytes[4..6].copy_from_slice(&len.to_be_bytes());
            }
            let b = &bytes[..];
            if let Ok(f) = ethernet::Frame::new_checked(b) {
                let _ = (f.src(), f.dst(), f.ethertype(), f.payload().len());
            }
            if let Ok(t) = vlan::Tag::new_checked(b) {
                let _ = (t.tci(), t.pcp(), t.vid(), t.ethertype());
            }
            if let Ok(u) = udp::Packet::new_checked(b) {
                let _ = (u.src_port(), u.dst_port(), u.len(), u.checksum(), u.payload().len());
            }
            if let Ok(t) = tcp::Packet::new_checked(b) {
                let _ = (t.src_port(), t.dst_port(), t.seq(), t.ack(), t.flags(), t.window(), t.checksum());
            }
            if let Ok(i) = icmp::Packet::new_checked(b) {
                let _ = (i.msg_type(), i.code(), i.checksum(), i.echo_ident(), i.echo_seq(), i.quoted().len());
            }
            if let Ok(v) = vxlan::Packet::new_checked(b) {
                let _ = (v.flags(), v.vni(), v.is_strictly_valid(), v.payload().len());
            }
            if let Ok(a) = arp::Packet::new_checked(b) {
                let _ = arp::Repr::parse(&a);
            }
            if let Ok(n) = ndp::Packet::new_checked(b) {
                let _ = (n.msg_type(), n.code(), n.flags(), n.target(), n.link_addr(1));
            }
            let _ = geneve::options_in(b).count();
        }
    }
}
