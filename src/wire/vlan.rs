//! 802.1Q and 802.1ad (QinQ) tags: the 4 bytes after the MAC addresses are a TPID
//! (0x8100 or 0x88a8) and a TCI; here a tag is viewed from its TCI, with the EtherType
//! (or next TPID) after it.

use super::{be16, need, put16, Result};

pub const TAG_LEN: usize = 4;

view!(
    /// A view of a tag's TCI and the EtherType that follows it.
    Tag
);

impl<T: AsRef<[u8]>> Tag<T> {
    pub fn check_len(&self) -> Result<()> {
        need(self.buffer.as_ref(), TAG_LEN)
    }

    pub fn tci(&self) -> u16 {
        be16(self.buffer.as_ref(), 0)
    }

    /// Priority code point (IEEE 802.1Q §6.9.3).
    pub fn pcp(&self) -> u8 {
        (self.tci() >> 13) as u8
    }

    pub fn vid(&self) -> u16 {
        self.tci() & 0x0fff
    }

    pub fn ethertype(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Tag<T> {
    pub fn set_vid(&mut self, vid: u16) {
        let tci = (self.tci() & 0xf000) | (vid & 0x0fff);
        put16(self.buffer.as_mut(), 0, tci);
    }

    pub fn set_pcp(&mut self, pcp: u8) {
        let tci = (self.tci() & 0x1fff) | (u16::from(pcp & 7) << 13);
        put16(self.buffer.as_mut(), 0, tci);
    }
}
