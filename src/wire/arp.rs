//! ARP (RFC 826) for IPv4 over Ethernet: the only kind an Ethernet host resolves with it.

use super::ethernet::{self, ethertype};
use super::{be16, need, put16, Error, Result};
use std::net::Ipv4Addr;

/// An Ethernet/IPv4 ARP packet's length: the fixed 8 bytes, then two 6-byte hardware
/// and two 4-byte protocol addresses.
pub const LEN: usize = 28;

/// ARP opcodes (RFC 826; IANA "ARP Operation Codes").
pub mod op {
    pub const REQUEST: u16 = 1;
    pub const REPLY: u16 = 2;
}

/// Hardware type of Ethernet (RFC 826: `ares_hrd$Ethernet`).
const HTYPE_ETHERNET: u16 = 1;

view!(
    /// A view of an ARP packet resolving IPv4 addresses to Ethernet ones.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// Long enough, and of Ethernet and IPv4 with their address lengths: ARP of any
    /// other kind has its addresses elsewhere, and is `Malformed` here.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        need(b, LEN)?;
        let kinds = (be16(b, 0), be16(b, 2), b[4], b[5]);
        if kinds != (HTYPE_ETHERNET, ethertype::IPV4, 6, 4) {
            return Err(Error::Malformed);
        }
        Ok(())
    }

    pub fn op(&self) -> u16 {
        be16(self.buffer.as_ref(), 6)
    }

    /// Sender hardware address.
    pub fn sha(&self) -> ethernet::Address {
        self.mac(8)
    }

    /// Sender protocol address.
    pub fn spa(&self) -> Ipv4Addr {
        self.ip(14)
    }

    /// Target hardware address.
    pub fn tha(&self) -> ethernet::Address {
        self.mac(18)
    }

    /// Target protocol address.
    pub fn tpa(&self) -> Ipv4Addr {
        self.ip(24)
    }

    fn mac(&self, at: usize) -> ethernet::Address {
        self.buffer.as_ref()[at..at + 6]
            .try_into()
            .expect("checked length")
    }

    fn ip(&self, at: usize) -> Ipv4Addr {
        let b: [u8; 4] = self.buffer.as_ref()[at..at + 4]
            .try_into()
            .expect("checked length");
        Ipv4Addr::from(b)
    }
}

/// An Ethernet/IPv4 ARP packet, to read whole or build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub op: u16,
    pub sha: ethernet::Address,
    pub spa: Ipv4Addr,
    pub tha: ethernet::Address,
    pub tpa: Ipv4Addr,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Repr {
        Repr {
            op: p.op(),
            sha: p.sha(),
            spa: p.spa(),
            tha: p.tha(),
            tpa: p.tpa(),
        }
    }

    /// The reply a host owning the request's target address sends (RFC 826, "Packet
    /// reception": the sender's addresses become the target's, and its own go in as
    /// sender's), `mac` being that host's hardware address.
    pub fn reply_to(request: &Repr, mac: ethernet::Address) -> Repr {
        Repr {
            op: op::REPLY,
            sha: mac,
            spa: request.tpa,
            tha: request.sha,
            tpa: request.spa,
        }
    }

    /// Writes the packet into the first [`LEN`] bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..LEN];
        put16(b, 0, HTYPE_ETHERNET);
        put16(b, 2, ethertype::IPV4);
        b[4] = 6;
        b[5] = 4;
        put16(b, 6, self.op);
        b[8..14].copy_from_slice(&self.sha);
        b[14..18].copy_from_slice(&self.spa.octets());
        b[18..24].copy_from_slice(&self.tha);
        b[24..28].copy_from_slice(&self.tpa.octets());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A request as Linux sends it (`arping -I eth0 192.0.2.1` from 192.0.2.10).
    const REQUEST: [u8; LEN] = [
        0x00, 0x01, 0x08, 0x00, 0x06, 0x04, 0x00, 0x01, // Ethernet, IPv4, request
        0x02, 0x00, 0x00, 0x00, 0x00, 0x0a, 192, 0, 2, 10, // sender
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 192, 0, 2, 1, // target
    ];

    #[test]
    fn a_request_reads_and_its_reply_swaps_the_addresses() {
        let p = Packet::new_checked(&REQUEST[..]).unwrap();
        let req = Repr::parse(&p);
        assert_eq!(req.op, op::REQUEST);
        assert_eq!(req.sha, [2, 0, 0, 0, 0, 0x0a]);
        assert_eq!(req.spa, Ipv4Addr::new(192, 0, 2, 10));
        assert_eq!(req.tpa, Ipv4Addr::new(192, 0, 2, 1));
        let mac = [2, 0, 0, 0, 1, 1];
        let reply = Repr::reply_to(&req, mac);
        let mut b = [0u8; LEN];
        reply.emit(&mut b);
        let r = Repr::parse(&Packet::new_checked(&b[..]).unwrap());
        assert_eq!(r, reply);
        assert_eq!((r.op, r.sha, r.spa), (op::REPLY, mac, req.tpa));
        assert_eq!((r.tha, r.tpa), (req.sha, req.spa));
    }

    #[test]
    fn other_kinds_of_arp_are_refused() {
        assert_eq!(
            Packet::new_checked(&REQUEST[..LEN - 1]).err(),
            Some(Error::Truncated)
        );
        for (at, v) in [(1, 6), (2, 0x86), (4, 8), (5, 16)] {
            let mut b = REQUEST;
            b[at] = v;
            assert_eq!(Packet::new_checked(&b[..]).err(), Some(Error::Malformed));
        }
    }

    proptest! {
        /// Whatever is built reads back as built.
        #[test]
        fn built_packets_read_back(op: u16, sha: [u8; 6], spa: u32, tha: [u8; 6], tpa: u32) {
            let r = Repr { op, sha, spa: spa.into(), tha, tpa: tpa.into() };
            let mut b = [0u8; LEN + 4];
            r.emit(&mut b);
            prop_assert_eq!(Repr::parse(&Packet::new_checked(&b[..]).unwrap()), r);
        }
    }
}
