//! VXLAN headers (RFC 7348 §5).
//!
//! ```text
//! |R|R|R|R|I|R|R|R|            Reserved                           |
//! |                VXLAN Network Identifier (VNI) |   Reserved    |
//! ```

use super::{be32, be64, need, put32, Result};

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
        // Flags, the reserved 24 bits, the VNI (any), the last reserved byte.
        const FIXED: u64 = 0xffff_ffff_0000_00ff;
        be64(self.buffer.as_ref(), 0) & FIXED == u64::from(FLAG_I) << 56
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Valid exactly when the I flag alone is set and the reserved bytes are zero
        /// (RFC 7348 §5), whatever the VNI.
        #[test]
        fn strictly_valid_is_the_i_flag_and_zero_reserved_bits(b in any::<[u8; 8]>()) {
            let byte_by_byte = b[0] == FLAG_I && b[1..4] == [0, 0, 0] && b[7] == 0;
            prop_assert_eq!(Packet::new_unchecked(&b[..]).is_strictly_valid(), byte_by_byte);
            let mut valid = b;
            (valid[0], valid[1], valid[2], valid[3], valid[7]) = (FLAG_I, 0, 0, 0, 0);
            prop_assert!(Packet::new_unchecked(&valid[..]).is_strictly_valid());
        }
    }
}
