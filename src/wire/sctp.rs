//! The SCTP common header's checksum: CRC32c (RFC 9260 §6.8, Appendix A), which unlike the
//! Internet checksum covers no pseudo-header, so only a rewrite of the ports changes it.

/// Where the checksum lies in the common header (after the two ports and the
/// verification tag), and the header's length.
pub const CHECKSUM_AT: usize = 8;
pub const HEADER_LEN: usize = 12;

/// The CRC32c of `data` (RFC 9260 Appendix A).
pub fn crc32c(data: &[u8]) -> u32 {
    crc32c::crc32c(data)
}

/// The checksum field's bytes for `packet` (common header and chunks), computed with the
/// field itself taken as zero; the CRC goes on the wire least significant byte first.
/// `None` for a packet shorter than the common header.
pub fn checksum(packet: &[u8]) -> Option<[u8; 4]> {
    let chunks = packet.get(HEADER_LEN..)?;
    let header = crc32c::crc32c_append(crc32c(&packet[..CHECKSUM_AT]), &[0; 4]);
    Some(crc32c::crc32c_append(header, chunks).to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// RFC 3720 §B.4's CRC32c test patterns.
    #[test]
    fn known_values() {
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8a91_36aa);
        assert_eq!(crc32c(&[0xffu8; 32]), 0x62a8_ab43);
        let ascending: Vec<u8> = (0..32).collect();
        assert_eq!(crc32c(&ascending), 0x46dd_794e);
    }

    /// The checksum is the CRC of the packet with a zero field, whatever the field held.
    #[test]
    fn checksum_ignores_the_field() {
        let mut p = vec![
            0x03, 0xe8, 0x07, 0xd0, 1, 2, 3, 4, 0xaa, 0xbb, 0xcc, 0xdd, 9, 9, 9, 9,
        ];
        let c = checksum(&p).expect("long enough");
        p[CHECKSUM_AT..HEADER_LEN].fill(0);
        assert_eq!(c, crc32c(&p).to_le_bytes());
        assert_eq!(checksum(&p[..11]), None);
    }
}
