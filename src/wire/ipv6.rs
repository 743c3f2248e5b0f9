//! IPv6 headers (RFC 8200) and the walk over common extension headers (§4).

use super::{be16, be32, ip_proto, need, put16, Error, Result};

pub const HEADER_LEN: usize = 40;

/// Extension headers are followed at most this many times; a longer chain is malformed
/// (bounds the work an attacker can cause per packet).
const MAX_EXTENSION_HEADERS: usize = 8;

view!(
    /// A view of an IPv6 packet.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// Version 6 and the buffer holds the header and the payload length.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        need(b, HEADER_LEN)?;
        if self.version() != 6 {
            return Err(Error::Malformed);
        }
        need(b, HEADER_LEN + usize::from(self.payload_len()))
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[0] >> 4
    }

    pub fn traffic_class(&self) -> u8 {
        ((be16(self.buffer.as_ref(), 0) >> 4) & 0xff) as u8
    }

    pub fn dscp(&self) -> u8 {
        self.traffic_class() >> 2
    }

    pub fn ecn(&self) -> u8 {
        self.traffic_class() & 3
    }

    pub fn flow_label(&self) -> u32 {
        be32(self.buffer.as_ref(), 0) & 0x000f_ffff
    }

    pub fn payload_len(&self) -> u16 {
        be16(self.buffer.as_ref(), 4)
    }

    pub fn next_header(&self) -> u8 {
        self.buffer.as_ref()[6]
    }

    pub fn hop_limit(&self) -> u8 {
        self.buffer.as_ref()[7]
    }

    pub fn src(&self) -> [u8; 16] {
        self.buffer.as_ref()[8..24]
            .try_into()
            .expect("checked length")
    }

    pub fn dst(&self) -> [u8; 16] {
        self.buffer.as_ref()[24..40]
            .try_into()
            .expect("checked length")
    }

    /// Skips hop-by-hop, routing, fragment and destination-options headers and returns
    /// the upper-layer protocol, its offset from the start of the IPv6 header, and whether
    /// the packet is a fragment. Reads no further than the buffer holds, so the packet an
    /// ICMPv6 error quotes, cut short (RFC 4443 §3.1), is walked as far as it goes; the
    /// buffer must hold the fixed header.
    pub fn upper_layer(&self) -> Result<UpperLayer> {
        let b = self.buffer.as_ref();
        let end = (HEADER_LEN + usize::from(self.payload_len())).min(b.len());
        let mut next = self.next_header();
        let mut at = HEADER_LEN;
        let (mut fragment, mut ident) = (false, 0);
        for _ in 0..MAX_EXTENSION_HEADERS {
            match next {
                ip_proto::HOP_BY_HOP | ip_proto::IPV6_ROUTING | ip_proto::IPV6_DEST_OPTS => {
                    need(&b[..end], at + 2)?;
                    let len = (usize::from(b[at + 1]) + 1) * 8;
                    next = b[at];
                    at += len;
                }
                ip_proto::IPV6_FRAGMENT => {
                    need(&b[..end], at + 8)?;
                    let off_flags = be16(b, at + 2);
                    fragment = true;
                    // RFC 8200 §4.5: the datagram's identification.
                    ident = u32::from_be_bytes(b[at + 4..at + 8].try_into().expect("checked"));
                    // Only a first fragment can be parsed further, and it is not a whole
                    // L4 packet; later fragments carry no L4 header at all.
                    if off_flags & 0xfff8 != 0 {
                        return Ok(UpperLayer {
                            protocol: b[at],
                            offset: at + 8,
                            fragment,
                            ident,
                            l4_present: false,
                        });
                    }
                    next = b[at];
                    at += 8;
                }
                ip_proto::AH => {
                    need(&b[..end], at + 2)?;
                    let len = (usize::from(b[at + 1]) + 2) * 4;
                    next = b[at];
                    at += len;
                }
                _ => {
                    need(&b[..end], at)?;
                    return Ok(UpperLayer {
                        protocol: next,
                        offset: at,
                        fragment,
                        ident,
                        l4_present: true,
                    });
                }
            }
        }
        Err(Error::Malformed)
    }
}

/// Where the upper-layer header of an IPv6 packet is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UpperLayer {
    pub protocol: u8,
    /// Offset from the start of the IPv6 header.
    pub offset: usize,
    pub fragment: bool,
    /// A fragment's datagram identification (0 for a whole packet).
    pub ident: u32,
    /// The L4 header is in this packet (false for non-first fragments).
    pub l4_present: bool,
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_payload_len(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 4, v);
    }

    pub fn set_hop_limit(&mut self, v: u8) {
        self.buffer.as_mut()[7] = v;
    }

    pub fn set_dscp(&mut self, dscp: u8) {
        let b = self.buffer.as_mut();
        let tc = (dscp << 2) | (((be16(b, 0) >> 4) & 3) as u8);
        let w = (be16(b, 0) & 0xf00f) | (u16::from(tc) << 4);
        put16(b, 0, w);
    }

    pub fn set_ecn(&mut self, ecn: u8) {
        let b = self.buffer.as_mut();
        b[1] = (b[1] & !0x30) | ((ecn & 3) << 4);
    }

    pub fn set_src(&mut self, a: [u8; 16]) {
        self.buffer.as_mut()[8..24].copy_from_slice(&a);
    }

    pub fn set_dst(&mut self, a: [u8; 16]) {
        self.buffer.as_mut()[24..40].copy_from_slice(&a);
    }
}

/// An IPv6 header without extension headers, to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub src: [u8; 16],
    pub dst: [u8; 16],
    pub next_header: u8,
    pub hop_limit: u8,
    pub dscp: u8,
    pub flow_label: u32,
    pub payload_len: u16,
}

impl Repr {
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..HEADER_LEN];
        let w = (6u32 << 28) | (u32::from(self.dscp) << 22) | (self.flow_label & 0x000f_ffff);
        b[0..4].copy_from_slice(&w.to_be_bytes());
        put16(b, 4, self.payload_len);
        b[6] = self.next_header;
        b[7] = self.hop_limit;
        b[8..24].copy_from_slice(&self.src);
        b[24..40].copy_from_slice(&self.dst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(next: u8, payload: &[u8]) -> Vec<u8> {
        let r = Repr {
            src: [1; 16],
            dst: [2; 16],
            next_header: next,
            hop_limit: 64,
            dscp: 10,
            flow_label: 7,
            payload_len: payload.len() as u16,
        };
        let mut v = vec![0; HEADER_LEN];
        r.emit(&mut v);
        v.extend_from_slice(payload);
        v
    }

    #[test]
    fn skips_extension_headers() {
        // Hop-by-hop (8 bytes) then destination options (8 bytes) then UDP.
        let mut payload = vec![ip_proto::IPV6_DEST_OPTS, 0, 0, 0, 0, 0, 0, 0];
        payload.extend([ip_proto::UDP, 0, 0, 0, 0, 0, 0, 0]);
        payload.extend([0; 8]);
        let v = header(ip_proto::HOP_BY_HOP, &payload);
        let p = Packet::new_checked(&v[..]).unwrap();
        assert_eq!((p.dscp(), p.flow_label()), (10, 7));
        assert_eq!(
            p.upper_layer().unwrap(),
            UpperLayer {
                protocol: ip_proto::UDP,
                offset: 56,
                fragment: false,
                ident: 0,
                l4_present: true
            }
        );
    }

    #[test]
    fn later_fragments_have_no_l4() {
        let payload = [ip_proto::TCP, 0, 0x05, 0x00, 0, 0, 0, 1, 0xde, 0xad];
        let v = header(ip_proto::IPV6_FRAGMENT, &payload);
        let u = Packet::new_checked(&v[..]).unwrap().upper_layer().unwrap();
        assert!(u.fragment && !u.l4_present);
        assert_eq!(u.ident, 1);
    }

    proptest! {
        /// Each field set reads back; the DSCP keeps the ECN bits and the flow label beside
        /// it, and the ECN the DSCP (RFC 8200 §3, RFC 2474 §3).
        #[test]
        fn fields_read_back_as_set(
            header in proptest::array::uniform32(any::<u8>()),
            payload_len in any::<u16>(),
            hop_limit in any::<u8>(),
            dscp in 0u8..64,
            ecn in 0u8..4,
            src in any::<[u8; 16]>(),
            dst in any::<[u8; 16]>(),
        ) {
            let mut buf = [header, header].concat();
            buf[0] = 0x60 | buf[0] & 0x0f;
            buf[4..6].fill(0);
            let before = Packet::new_checked(buf.clone()).expect("a whole header");
            let mut p = Packet::new_unchecked(&mut buf[..]);
            p.set_payload_len(payload_len);
            p.set_hop_limit(hop_limit);
            p.set_dscp(dscp);
            p.set_src(src);
            p.set_dst(dst);
            prop_assert_eq!((p.payload_len(), p.hop_limit(), p.dscp()), (payload_len, hop_limit, dscp));
            prop_assert_eq!((p.src(), p.dst()), (src, dst));
            prop_assert_eq!((p.version(), p.ecn(), p.flow_label()), (6, before.ecn(), before.flow_label()));
            prop_assert_eq!(p.next_header(), before.next_header());
            p.set_ecn(ecn);
            prop_assert_eq!((p.dscp(), p.ecn(), p.flow_label()), (dscp, ecn, before.flow_label()));
        }

        #[test]
        fn walk_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..120)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                let _ = (p.upper_layer(), p.traffic_class(), p.src(), p.dst(), p.hop_limit());
            }
        }
    }
}
