//! VXLAN headers (RFC 7348 §5).
//!
//! ```text
//! |R|R|R|R|I|R|R|R|            Reserved                           |
//! |                VXLAN Network Identifier (VNI) |   Reserved    |
//! ```

use super::{be32, need, put32, Result};

pub const HEADER_LEN: usize = 8;
/// The I flag: the VNI is valid (RFC 7348 §5: must be set).
pub const FLAG_I: u8 = 0x08;
/// IANA-assigned UDP destination port.
pub const UDP_PORT: u16 = 4789;

view!(
    /// A view of a VXLAN header.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn check_len(&self) -> Result<()> {
        need(self.buffer.as_ref(), HEADER_LEN)
    }

    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[0]
    }

    pub fn vni(&self) -> u32 {
        be32(self.buffer.as_ref(), 4) >> 8
    }

    /// The I flag is set and every reserved bit is zero. RFC 7348 says receivers ignore
    /// reserved bits; dpuflow's decapsulation is stricter and drops such packets.
    pub fn is_strictly_valid(&self) -> bool {
        let b = self.buffer.as_ref();
        b[0] == FLAG_I && b[1..4] == [0, 0, 0] && b[7] == 0
    }

    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}

/// A VXLAN header to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr {
    pub vni: u32,
}

impl Repr {
    pub fn emit(&self, buf: &mut [u8]) {
        put32(buf, 0, u32::from(FLAG_I) << 24);
        put32(buf, 4, self.vni << 8);
    }
}
