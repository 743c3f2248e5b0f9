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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// The VID and the PCP are set apart: each keeps the other, the drop eligible bit
        /// between them (IEEE 802.1Q §6.9.3) and the EtherType after them.
        #[test]
        fn vid_and_pcp_are_set_apart(tag in any::<[u8; 4]>(), vid in any::<u16>(), pcp in any::<u8>()) {
            let mut buf = tag;
            let before = Tag::new_checked(&tag[..]).expect("a whole tag");
            let mut t = Tag::new_unchecked(&mut buf[..]);
            t.set_vid(vid);
            prop_assert_eq!((t.vid(), t.pcp()), (vid & 0x0fff, before.pcp()));
            t.set_pcp(pcp);
            prop_assert_eq!((t.vid(), t.pcp()), (vid & 0x0fff, pcp & 7));
            prop_assert_eq!(t.tci() & 0x1000, before.tci() & 0x1000);
            prop_assert_eq!(t.ethertype(), before.ethertype());
        }
    }
}
