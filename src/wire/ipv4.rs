//! IPv4 headers (RFC 791), options included.

use super::{be16, be32, checksum, need, put16, put32, Error, Result};

pub const MIN_HEADER_LEN: usize = 20;

view!(
    /// A view of an IPv4 packet.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// Version 4, IHL of at least 5 words, and the buffer holds the header and the total
    /// length (the buffer may be longer: Ethernet padding).
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        need(b, MIN_HEADER_LEN)?;
        if self.version() != 4 {
            return Err(Error::Malformed);
        }
        let hl = self.header_len();
        let total = usize::from(self.total_len());
        if hl < MIN_HEADER_LEN || total < hl {
            return Err(Error::Malformed);
        }
        need(b, total)
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[0] >> 4
    }

    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[0] & 0x0f) * 4
    }

    pub fn dscp(&self) -> u8 {
        self.buffer.as_ref()[1] >> 2
    }

    pub fn ecn(&self) -> u8 {
        self.buffer.as_ref()[1] & 3
    }

    pub fn total_len(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    pub fn ident(&self) -> u16 {
        be16(self.buffer.as_ref(), 4)
    }

    pub fn dont_frag(&self) -> bool {
        self.buffer.as_ref()[6] & 0x40 != 0
    }

    pub fn more_frags(&self) -> bool {
        self.buffer.as_ref()[6] & 0x20 != 0
    }

    /// Fragment offset in bytes.
    pub fn frag_offset(&self) -> u16 {
        (be16(self.buffer.as_ref(), 6) & 0x1fff) * 8
    }

    /// Part of a fragmented datagram: only the first fragment carries the L4 header, and
    /// even it is not treated as a whole L4 packet. More-fragments set or an offset
    /// (RFC 791 §3.1): one test of the flags-and-offset word, inlined into the parser.
    #[inline]
    pub fn is_fragment(&self) -> bool {
        be16(self.buffer.as_ref(), 6) & 0x3fff != 0
    }

    pub fn ttl(&self) -> u8 {
        self.buffer.as_ref()[8]
    }

    pub fn protocol(&self) -> u8 {
        self.buffer.as_ref()[9]
    }

    pub fn checksum(&self) -> u16 {
        be16(self.buffer.as_ref(), 10)
    }

    pub fn src(&self) -> [u8; 4] {
        self.buffer.as_ref()[12..16]
            .try_into()
            .expect("checked length")
    }

    pub fn dst(&self) -> [u8; 4] {
        self.buffer.as_ref()[16..20]
            .try_into()
            .expect("checked length")
    }

    pub fn verify_checksum(&self) -> bool {
        checksum::checksum(&self.buffer.as_ref()[..self.header_len()]) == 0
    }

    /// The payload up to the total length.
    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..usize::from(self.total_len())]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_total_len(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 2, v);
    }

    /// Sets the TTL, updating the header checksum incrementally.
    pub fn set_ttl(&mut self, ttl: u8) {
        let old = be16(self.buffer.as_ref(), 8);
        self.buffer.as_mut()[8] = ttl;
        self.patch_checksum(old, be16(self.buffer.as_ref(), 8));
    }

    /// Sets DSCP, keeping ECN, updating the header checksum incrementally.
    pub fn set_dscp(&mut self, dscp: u8) {
        let old = be16(self.buffer.as_ref(), 0);
        let b = self.buffer.as_mut();
        b[1] = (dscp << 2) | (b[1] & 3);
        self.patch_checksum(old, be16(self.buffer.as_ref(), 0));
    }

    /// Sets ECN, keeping DSCP, updating the header checksum incrementally.
    pub fn set_ecn(&mut self, ecn: u8) {
        let old = be16(self.buffer.as_ref(), 0);
        let b = self.buffer.as_mut();
        b[1] = (b[1] & !3) | (ecn & 3);
        self.patch_checksum(old, be16(self.buffer.as_ref(), 0));
    }

    pub fn set_src(&mut self, a: [u8; 4]) {
        let old = be32(self.buffer.as_ref(), 12);
        put32(self.buffer.as_mut(), 12, u32::from_be_bytes(a));
        let c = checksum::update32(self.checksum(), old, u32::from_be_bytes(a));
        put16(self.buffer.as_mut(), 10, c);
    }

    pub fn set_dst(&mut self, a: [u8; 4]) {
        let old = be32(self.buffer.as_ref(), 16);
        put32(self.buffer.as_mut(), 16, u32::from_be_bytes(a));
        let c = checksum::update32(self.checksum(), old, u32::from_be_bytes(a));
        put16(self.buffer.as_mut(), 10, c);
    }

    fn patch_checksum(&mut self, old: u16, new: u16) {
        let c = checksum::update16(self.checksum(), old, new);
        put16(self.buffer.as_mut(), 10, c);
    }

    /// Recomputes the header checksum from scratch.
    pub fn fill_checksum(&mut self) {
        put16(self.buffer.as_mut(), 10, 0);
        let hl = self.header_len();
        let c = checksum::checksum(&self.buffer.as_ref()[..hl]);
        put16(self.buffer.as_mut(), 10, c);
    }
}

/// An option-less IPv4 header to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub src: [u8; 4],
    pub dst: [u8; 4],
    pub protocol: u8,
    pub ttl: u8,
    pub dscp: u8,
    pub dont_frag: bool,
    /// Payload length in bytes.
    pub payload_len: u16,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(p: &Packet<T>) -> Repr {
        Repr {
            src: p.src(),
            dst: p.dst(),
            protocol: p.protocol(),
            ttl: p.ttl(),
            dscp: p.dscp(),
            dont_frag: p.dont_frag(),
            payload_len: p.total_len() - p.header_len() as u16,
        }
    }

    /// Writes a 20-byte header with its checksum into `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        let b = &mut buf[..MIN_HEADER_LEN];
        b[0] = 0x45;
        b[1] = self.dscp << 2;
        put16(b, 2, self.payload_len + MIN_HEADER_LEN as u16);
        put16(b, 4, 0);
        put16(b, 6, if self.dont_frag { 0x4000 } else { 0 });
        b[8] = self.ttl;
        b[9] = self.protocol;
        put16(b, 10, 0);
        b[12..16].copy_from_slice(&self.src);
        b[16..20].copy_from_slice(&self.dst);
        let c = checksum::checksum(b);
        put16(b, 10, c);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn emit_then_parse() {
        let r = Repr {
            src: [192, 0, 2, 1],
            dst: [192, 0, 2, 10],
            protocol: 17,
            ttl: 64,
            dscp: 0,
            dont_frag: true,
            payload_len: 8,
        };
        let mut buf = [0u8; 28];
        r.emit(&mut buf);
        let p = Packet::new_checked(&buf[..]).unwrap();
        assert!(p.verify_checksum());
        assert_eq!(Repr::parse(&p), r);
    }

    #[test]
    fn incremental_updates_keep_checksum_valid() {
        let r = Repr {
            src: [10, 0, 0, 1],
            dst: [10, 0, 0, 2],
            protocol: 6,
            ttl: 64,
            dscp: 0,
            dont_frag: false,
            payload_len: 0,
        };
        let mut buf = [0u8; 20];
        r.emit(&mut buf);
        let mut p = Packet::new_checked(&mut buf[..]).unwrap();
        p.set_ttl(63);
        p.set_dscp(46);
        p.set_src([172, 16, 0, 9]);
        p.set_dst([172, 16, 0, 10]);
        assert!(p.verify_checksum());
        assert_eq!((p.ttl(), p.dscp()), (63, 46));
    }

    #[test]
    fn fragments_by_flag_or_offset() {
        let with = |flags_offset: u16| {
            let mut buf = [0u8; 20];
            buf[0] = 0x45;
            buf[2..4].copy_from_slice(&20u16.to_be_bytes());
            buf[6..8].copy_from_slice(&flags_offset.to_be_bytes());
            Packet::new_checked(buf).expect("header").is_fragment()
        };
        assert!(!with(0), "whole datagram");
        assert!(!with(0x4000), "don't fragment alone");
        assert!(with(0x2000), "first fragment: more to come");
        assert!(with(0x0001), "a later fragment (offset 8)");
        assert!(with(0x1fff), "the last fragment at the largest offset");
    }

    proptest! {
        /// The one-word fragment test agrees with the flag and the offset read apart.
        #[test]
        fn fragment_test_agrees_with_flag_and_offset(flags_offset in any::<u16>()) {
            let mut buf = [0u8; 20];
            buf[0] = 0x45;
            buf[2..4].copy_from_slice(&20u16.to_be_bytes());
            buf[6..8].copy_from_slice(&flags_offset.to_be_bytes());
            let p = Packet::new_checked(buf).expect("header");
            prop_assert_eq!(p.is_fragment(), p.more_frags() || p.frag_offset() != 0);
        }

        /// The payload is what the total length says, whatever follows it in the buffer
        /// (an Ethernet frame's padding); a DSCP set keeps the ECN bits and an ECN set
        /// the DSCP (RFC 2474 §3, RFC 3168 §5), each with the checksum kept right.
        #[test]
        fn payload_ends_at_the_total_length(
            data in 0usize..40,
            trailer in 0usize..8,
            tos in any::<u8>(),
            dscp in 0u8..64,
            ecn in 0u8..4,
        ) {
            let mut buf = vec![0u8; MIN_HEADER_LEN + data + trailer];
            buf[0] = 0x45;
            buf[1] = tos;
            let mut p = Packet::new_unchecked(&mut buf[..]);
            p.set_total_len((MIN_HEADER_LEN + data) as u16);
            p.fill_checksum();
            p.set_dscp(dscp);
            prop_assert_eq!((p.dscp(), p.ecn()), (dscp, tos & 3));
            p.set_ecn(ecn);
            let p = Packet::new_checked(&buf[..]).expect("a whole datagram");
            prop_assert_eq!(p.payload().len(), data);
            prop_assert_eq!((p.dscp(), p.ecn()), (dscp, ecn));
            prop_assert!(p.verify_checksum());
        }

        #[test]
        fn accessors_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                let _ = (p.version(), p.dscp(), p.ecn(), p.ident(), p.is_fragment(), p.ttl(), p.protocol());
                let _ = (p.src(), p.dst(), p.verify_checksum(), p.payload().len());
            }
        }
    }
}
