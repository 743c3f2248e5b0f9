//! ICMP (RFC 792) and ICMPv6 (RFC 4443) share their first four bytes: type, code,
//! checksum. Echo messages then carry an identifier and a sequence number.

use super::{be16, checksum, need, Result};

pub const HEADER_LEN: usize = 8;

pub mod v4_type {
    pub const ECHO_REPLY: u8 = 0;
    pub const DEST_UNREACHABLE: u8 = 3;
    pub const ECHO_REQUEST: u8 = 8;
    pub const TIME_EXCEEDED: u8 = 11;
}

pub mod v6_type {
    pub const DEST_UNREACHABLE: u8 = 1;
    pub const PACKET_TOO_BIG: u8 = 2;
    pub const TIME_EXCEEDED: u8 = 3;
    pub const ECHO_REQUEST: u8 = 128;
    pub const ECHO_REPLY: u8 = 129;
    /// Neighbour discovery (RFC 4861 §4.3, §4.4).
    pub const NEIGHBOR_SOLICIT: u8 = 135;
    pub const NEIGHBOR_ADVERT: u8 = 136;
}

/// Whether a message of type `msg_type` is an error, which quotes the packet it is about:
/// destination unreachable, source quench, redirect, time exceeded and parameter problem
/// (RFC 792); for ICMPv6 destination unreachable, packet too big, time exceeded and
/// parameter problem (RFC 4443 §2.1: the error types are those below 128).
pub const fn is_error(v6: bool, msg_type: u8) -> bool {
    if v6 {
        matches!(msg_type, 1..=4)
    } else {
        matches!(msg_type, 3 | 4 | 5 | 11 | 12)
    }
}

view!(
    /// A view of an ICMP or ICMPv6 message.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn check_len(&self) -> Result<()> {
        need(self.buffer.as_ref(), HEADER_LEN)
    }

    pub fn msg_type(&self) -> u8 {
        self.buffer.as_ref()[0]
    }

    pub fn code(&self) -> u8 {
        self.buffer.as_ref()[1]
    }

    pub fn checksum(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    /// Echo identifier (meaningful for echo request and reply).
    pub fn echo_ident(&self) -> u16 {
        be16(self.buffer.as_ref(), 4)
    }

    pub fn echo_seq(&self) -> u16 {
        be16(self.buffer.as_ref(), 6)
    }

    /// For error messages: the quoted original packet.
    pub fn quoted(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }

    /// The MTU an ICMPv4 Fragmentation Needed (RFC 1191 §4: the low 16 bits of the
    /// second word) or an ICMPv6 Packet Too Big (RFC 4443 §3.2: the whole word) gives.
    pub fn next_hop_mtu(&self, v6: bool) -> u32 {
        let b = self.buffer.as_ref();
        match v6 {
            true => u32::from_be_bytes([b[4], b[5], b[6], b[7]]),
            false => u32::from(be16(b, 6)),
        }
    }
}

/// An error message about a packet, to build (its header; the quoted packet follows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorRepr {
    /// The packet was too big for the next hop: ICMP Destination Unreachable, code 4
    /// "fragmentation needed and DF set" (RFC 792) with the next-hop MTU (RFC 1191 §4),
    /// or ICMPv6 Packet Too Big (RFC 4443 §3.2).
    TooBig { v6: bool, mtu: u32 },
    /// Its TTL or hop limit ran out in transit: Time Exceeded, code 0 (RFC 792; RFC
    /// 4443 §3.3), the second word unused.
    TimeExceeded { v6: bool },
}

impl ErrorRepr {
    /// Writes the header into `msg`, whose bytes after [`HEADER_LEN`] are the quoted
    /// packet, and the checksum over all of `msg`: with the IPv6 pseudo-header's sum
    /// `pseudo` for ICMPv6 (RFC 4443 §2.3), none for ICMPv4 (`pseudo` 0).
    pub fn emit(&self, msg: &mut [u8], pseudo: u32) {
        let (kind, code, rest) = match *self {
            ErrorRepr::TooBig { v6: true, mtu } => (v6_type::PACKET_TOO_BIG, 0, mtu),
            ErrorRepr::TooBig { v6: false, mtu } => (v4_type::DEST_UNREACHABLE, 4, mtu & 0xffff),
            ErrorRepr::TimeExceeded { v6: true } => (v6_type::TIME_EXCEEDED, 0, 0),
            ErrorRepr::TimeExceeded { v6: false } => (v4_type::TIME_EXCEEDED, 0, 0),
        };
        let b = &mut msg[..HEADER_LEN];
        b[0] = kind;
        b[1] = code;
        b[2..4].fill(0);
        b[4..8].copy_from_slice(&rest.to_be_bytes());
        let c = !checksum::fold(checksum::sum(pseudo, msg));
        super::put16(msg, 2, c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// A message built reads back as built, and its checksum verifies (the sum of a
        /// message with its checksum, pseudo-header included, folds to all ones).
        #[test]
        fn error_messages_read_back(v6: bool, expired: bool, mtu: u32, quote in prop::collection::vec(any::<u8>(), 0..64), pseudo in 0u32..0x7fff_ffff) {
            let mut msg = vec![0xa5; HEADER_LEN];
            msg.extend_from_slice(&quote);
            let pseudo = if v6 { pseudo } else { 0 };
            let repr = if expired {
                ErrorRepr::TimeExceeded { v6 }
            } else {
                ErrorRepr::TooBig { v6, mtu }
            };
            repr.emit(&mut msg, pseudo);
            let p = Packet::new_checked(&msg[..]).unwrap();
            let (kind, code, rest) = match (expired, v6) {
                (true, true) => (v6_type::TIME_EXCEEDED, 0, 0),
                (true, false) => (v4_type::TIME_EXCEEDED, 0, 0),
                (false, true) => (v6_type::PACKET_TOO_BIG, 0, mtu),
                (false, false) => (v4_type::DEST_UNREACHABLE, 4, mtu & 0xffff),
            };
            prop_assert_eq!((p.msg_type(), p.code()), (kind, code));
            prop_assert!(is_error(v6, p.msg_type()));
            if expired {
                prop_assert_eq!(&msg[4..8], &[0u8; 4][..]);
            } else {
                prop_assert_eq!(p.next_hop_mtu(v6), rest);
            }
            prop_assert_eq!(p.quoted(), &quote[..]);
            prop_assert_eq!(checksum::fold(checksum::sum(pseudo, &msg)), 0xffff);
        }
    }
}
