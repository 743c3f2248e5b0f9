//! UDP headers (RFC 768).

use super::{be16, need, put16, Error, Result};

pub const HEADER_LEN: usize = 8;

view!(
    /// A view of a UDP datagram.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// The header fits, and its length field covers the header and fits the buffer.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        need(b, HEADER_LEN)?;
        let len = usize::from(self.len());
        if len < HEADER_LEN {
            return Err(Error::Malformed);
        }
        need(b, len)
    }

    pub fn src_port(&self) -> u16 {
        be16(self.buffer.as_ref(), 0)
    }

    pub fn dst_port(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    pub fn len(&self) -> u16 {
        be16(self.buffer.as_ref(), 4)
    }

    pub fn is_empty(&self) -> bool {
        usize::from(self.len()) == HEADER_LEN
    }

    pub fn checksum(&self) -> u16 {
        be16(self.buffer.as_ref(), 6)
    }

    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..usize::from(self.len())]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_src_port(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 0, v);
    }

    pub fn set_dst_port(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 2, v);
    }

    pub fn set_len(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 4, v);
    }

    pub fn set_checksum(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 6, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The length field is checked against the header and the buffer (RFC 768: it
        /// counts the header and the data).
        #[test]
        fn check_len_takes_exactly_the_lengths_that_fit(buf_len in 0usize..40, len in any::<u16>()) {
            let mut buf = vec![0u8; buf_len];
            if buf_len >= HEADER_LEN {
                Packet::new_unchecked(&mut buf[..]).set_len(len);
            }
            let fits = buf_len >= HEADER_LEN
                && usize::from(len) >= HEADER_LEN
                && usize::from(len) <= buf_len;
            prop_assert_eq!(Packet::new_checked(&buf[..]).is_ok(), fits);
        }

        /// Each field set reads back, the others as they were; the data is what the
        /// length says, whatever follows it in the buffer.
        #[test]
        fn fields_read_back_as_set(
            src in any::<u16>(),
            dst in any::<u16>(),
            checksum in any::<u16>(),
            data in 0usize..32,
            trailer in 0usize..8,
        ) {
            let mut buf = vec![0xa5u8; HEADER_LEN + data + trailer];
            let mut p = Packet::new_unchecked(&mut buf[..]);
            p.set_src_port(src);
            p.set_dst_port(dst);
            p.set_len((HEADER_LEN + data) as u16);
            p.set_checksum(checksum);
            let p = Packet::new_checked(&buf[..]).expect("a whole datagram");
            prop_assert_eq!((p.src_port(), p.dst_port(), p.checksum()), (src, dst, checksum));
            prop_assert_eq!(p.payload().len(), data);
            prop_assert_eq!(p.is_empty(), data == 0);
        }
    }
}
