//! IPv6 neighbour discovery's solicitations and advertisements (RFC 4861 §4.3, §4.4):
//! the ICMPv6 messages by which an IPv6 host asks for, and is told, the link-layer
//! address of a neighbour.

use super::{be32, checksum, ethernet, icmp, need, put32, Error, Result};

/// Type, code, checksum, a reserved or flags word, and the target address.
pub const HEADER_LEN: usize = 24;

/// Option types (RFC 4861 §4.6).
pub mod option {
    pub const SOURCE_LINK_ADDR: u8 = 1;
    pub const TARGET_LINK_ADDR: u8 = 2;
}

/// An advertisement with its target link-layer address option: the header and one
/// 8-byte option.
pub const ADVERT_LEN: usize = HEADER_LEN + 8;

view!(
    /// A view of a neighbour solicitation or advertisement, options included.
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

    /// Router, Solicited and Override flags of an advertisement, as the word's top bits.
    pub fn flags(&self) -> u32 {
        be32(self.buffer.as_ref(), 4)
    }

    /// The address asked about (solicitation) or told of (advertisement).
    pub fn target(&self) -> [u8; 16] {
        self.buffer.as_ref()[8..24]
            .try_into()
            .expect("checked length")
    }

    /// The link-layer address option of `kind`, if the message has it: `Err` when the
    /// options are malformed (one of length zero, or running past the message), which
    /// makes the whole message invalid (RFC 4861 §7.1.1, §7.1.2).
    pub fn link_addr(&self, kind: u8) -> Result<Option<ethernet::Address>> {
        let mut found = None;
        let mut rest = &self.buffer.as_ref()[HEADER_LEN..];
        while !rest.is_empty() {
            let len = match rest.get(1) {
                Some(&units) if units > 0 => usize::from(units) * 8,
                _ => return Err(Error::Malformed),
            };
            let opt = rest.get(..len).ok_or(Error::Truncated)?;
            if opt[0] == kind && found.is_none() && len == 8 {
                found = Some(opt[2..8].try_into().expect("eight-byte option"));
            }
            rest = &rest[len..];
        }
        Ok(found)
    }
}

/// A neighbour advertisement carrying the target's link-layer address, to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AdvertRepr {
    /// The sender is a router (R).
    pub router: bool,
    /// It answers a solicitation sent to a unicast address of the sender's (S).
    pub solicited: bool,
    /// It should replace a link-layer address the receiver has cached (O).
    pub override_cache: bool,
    pub target: [u8; 16],
    pub target_mac: ethernet::Address,
}

impl AdvertRepr {
    /// Writes the advertisement into the first [`ADVERT_LEN`] bytes of `msg` with its
    /// checksum, `pseudo` being the sum of its IPv6 pseudo-header (RFC 4443 §2.3).
    pub fn emit(&self, msg: &mut [u8], pseudo: u32) {
        let b = &mut msg[..ADVERT_LEN];
        b[0] = icmp::v6_type::NEIGHBOR_ADVERT;
        b[1] = 0;
        b[2..4].fill(0);
        let flags = u32::from(self.router) << 31
            | u32::from(self.solicited) << 30
            | u32::from(self.override_cache) << 29;
        put32(b, 4, flags);
        b[8..24].copy_from_slice(&self.target);
        b[24] = option::TARGET_LINK_ADDR;
        b[25] = 1;
        b[26..32].copy_from_slice(&self.target_mac);
        let c = !checksum::fold(checksum::sum(pseudo, b));
        super::put16(b, 2, c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn options_are_found_and_bad_ones_refused() {
        let mut m = vec![icmp::v6_type::NEIGHBOR_SOLICIT, 0, 0, 0, 0, 0, 0, 0];
        m.extend([0xfe; 16]);
        let p = |m: &[u8]| Packet::new_checked(m.to_vec()).unwrap().link_addr(1);
        assert_eq!(p(&m), Ok(None));
        // A nonce option (RFC 7527) of 8 bytes, then the source's address.
        m.extend([14, 1, 1, 2, 3, 4, 5, 6]);
        m.extend([1, 1, 2, 0, 0, 0, 0, 9]);
        assert_eq!(p(&m), Ok(Some([2, 0, 0, 0, 0, 9])));
        let mut zero = m.clone();
        zero[HEADER_LEN + 1] = 0;
        assert_eq!(p(&zero), Err(Error::Malformed));
        assert_eq!(p(&m[..m.len() - 1]), Err(Error::Truncated));
    }

    proptest! {
        /// An advertisement built reads back as built, its checksum verifies, and its
        /// option gives the address.
        #[test]
        fn adverts_read_back(router: bool, solicited: bool, override_cache: bool,
                             target: [u8; 16], target_mac: [u8; 6], pseudo in 0u32..0x7fff_ffff) {
            let a = AdvertRepr { router, solicited, override_cache, target, target_mac };
            let mut m = [0xa5u8; ADVERT_LEN];
            a.emit(&mut m, pseudo);
            let p = Packet::new_checked(&m[..]).unwrap();
            prop_assert_eq!((p.msg_type(), p.code()), (icmp::v6_type::NEIGHBOR_ADVERT, 0));
            let flags = p.flags();
            prop_assert_eq!((flags >> 31 == 1, flags >> 30 & 1 == 1, flags >> 29 & 1 == 1),
                            (router, solicited, override_cache));
            prop_assert_eq!(flags & 0x1fff_ffff, 0);
            prop_assert_eq!(p.target(), target);
            prop_assert_eq!(p.link_addr(option::TARGET_LINK_ADDR), Ok(Some(target_mac)));
            prop_assert_eq!(checksum::fold(checksum::sum(pseudo, &m)), 0xffff);
        }

        /// Whatever the bytes, reading options does not panic.
        #[test]
        fn options_of_any_bytes(bytes in prop::collection::vec(any::<u8>(), HEADER_LEN..96)) {
            let p = Packet::new_checked(&bytes[..]).unwrap();
            let _ = (p.link_addr(1), p.target(), p.flags());
        }
    }
}
