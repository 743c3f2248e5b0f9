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
