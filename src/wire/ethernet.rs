//! Ethernet II frames (IEEE 802.3 clause 3.2.6 with an EtherType).

use super::{be16, need, put16, Result};

pub const HEADER_LEN: usize = 14;

/// EtherTypes (IEEE "EtherType" registry).
pub mod ethertype {
    pub const IPV4: u16 = 0x0800;
    pub const ARP: u16 = 0x0806;
    pub const VLAN: u16 = 0x8100;
    pub const IPV6: u16 = 0x86dd;
    pub const QINQ: u16 = 0x88a8;
    /// Transparent Ethernet bridging: an Ethernet frame inside Geneve (RFC 8926 §3.4).
    pub const TEB: u16 = 0x6558;
}

pub type Address = [u8; 6];

view!(
    /// A view of an Ethernet frame.
    Frame
);

impl<T: AsRef<[u8]>> Frame<T> {
    pub fn check_len(&self) -> Result<()> {
        need(self.buffer.as_ref(), HEADER_LEN)
    }

    pub fn dst(&self) -> Address {
        self.buffer.as_ref()[0..6]
            .try_into()
            .expect("checked length")
    }

    pub fn src(&self) -> Address {
        self.buffer.as_ref()[6..12]
            .try_into()
            .expect("checked length")
    }

    pub fn ethertype(&self) -> u16 {
        be16(self.buffer.as_ref(), 12)
    }

    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Frame<T> {
    pub fn set_dst(&mut self, a: Address) {
        self.buffer.as_mut()[0..6].copy_from_slice(&a);
    }

    pub fn set_src(&mut self, a: Address) {
        self.buffer.as_mut()[6..12].copy_from_slice(&a);
    }

    pub fn set_ethertype(&mut self, t: u16) {
        put16(self.buffer.as_mut(), 12, t);
    }
}

/// An Ethernet header to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub src: Address,
    pub dst: Address,
    pub ethertype: u16,
}

impl Repr {
    pub fn parse<T: AsRef<[u8]>>(f: &Frame<T>) -> Repr {
        Repr {
            src: f.src(),
            dst: f.dst(),
            ethertype: f.ethertype(),
        }
    }

    /// Writes the header into the first [`HEADER_LEN`] bytes of `buf`.
    pub fn emit(&self, buf: &mut [u8]) {
        let mut f = Frame::new_unchecked(buf);
        f.set_dst(self.dst);
        f.set_src(self.src);
        f.set_ethertype(self.ethertype);
    }
}
