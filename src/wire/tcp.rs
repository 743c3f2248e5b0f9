//! TCP headers (RFC 9293 §3.1).

use super::{be16, be32, need, put16, Error, Result};

pub const MIN_HEADER_LEN: usize = 20;

pub mod flags {
    pub const FIN: u8 = 0x01;
    pub const SYN: u8 = 0x02;
    pub const RST: u8 = 0x04;
    pub const PSH: u8 = 0x08;
    pub const ACK: u8 = 0x10;
    pub const URG: u8 = 0x20;
}

view!(
    /// A view of a TCP segment.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// The fixed header fits, the data offset is at least 5 words and the options fit.
    pub fn check_len(&self) -> Result<()> {
        let b = self.buffer.as_ref();
        need(b, MIN_HEADER_LEN)?;
        if self.header_len() < MIN_HEADER_LEN {
            return Err(Error::Malformed);
        }
        need(b, self.header_len())
    }

    pub fn src_port(&self) -> u16 {
        be16(self.buffer.as_ref(), 0)
    }

    pub fn dst_port(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    pub fn seq(&self) -> u32 {
        be32(self.buffer.as_ref(), 4)
    }

    pub fn ack(&self) -> u32 {
        be32(self.buffer.as_ref(), 8)
    }

    pub fn header_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[12] >> 4) * 4
    }

    pub fn flags(&self) -> u8 {
        self.buffer.as_ref()[13]
    }

    pub fn window(&self) -> u16 {
        be16(self.buffer.as_ref(), 14)
    }

    pub fn checksum(&self) -> u16 {
        be16(self.buffer.as_ref(), 16)
    }

    /// Where the value of the Maximum Segment Size option is in the header, if it has
    /// one (RFC 9293 §3.2: kind 2, length 4). Options are walked as §3.1 lays them out:
    /// kind 0 ends the list, kind 1 is one byte of padding, any other kind gives its
    /// length; a length under 2 or past the header ends the walk. Needs
    /// [`Packet::check_len`].
    pub fn mss_at(&self) -> Option<usize> {
        let b = &self.buffer.as_ref()[..self.header_len()];
        let mut at = MIN_HEADER_LEN;
        while let Some(&kind) = b.get(at) {
            match kind {
                option::END => return None,
                option::NOP => at += 1,
                _ => {
                    let len = usize::from(*b.get(at + 1)?);
                    if len < 2 || at + len > b.len() {
                        return None;
                    }
                    if kind == option::MSS && len == 4 {
                        return Some(at + 2);
                    }
                    at += len;
                }
            }
        }
        None
    }
}

/// TCP option kinds (RFC 9293 §3.2).
pub mod option {
    pub const END: u8 = 0;
    pub const NOP: u8 = 1;
    pub const MSS: u8 = 2;
}

impl<T: AsRef<[u8]> + AsMut<[u8]>> Packet<T> {
    pub fn set_src_port(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 0, v);
    }

    pub fn set_dst_port(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 2, v);
    }

    pub fn set_checksum(&mut self, v: u16) {
        put16(self.buffer.as_mut(), 16, v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Whatever the option bytes, the walk stays within the header; an MSS option
        /// placed after any run of padding and other options is found where it is.
        #[test]
        fn the_mss_option_is_found_where_it_is(
            noise in prop::collection::vec(any::<u8>(), 0..40),
            before in prop::collection::vec((2u8..30, 0usize..6), 0..4),
            nops in 0usize..4,
        ) {
            let mut buf = vec![0u8; 20];
            buf.extend_from_slice(&noise);
            buf.resize(20 + noise.len().div_ceil(4) * 4, 0);
            buf[12] = ((buf.len() / 4) as u8) << 4;
            if let Ok(p) = Packet::new_checked(&buf[..]) {
                if let Some(at) = p.mss_at() {
                    prop_assert!(at + 2 <= p.header_len());
                }
            }
            let mut opts = vec![option::NOP; nops];
            for (kind, len) in before {
                let kind = if kind == option::MSS { 3 } else { kind };
                opts.extend([kind, len as u8 + 2]);
                opts.extend(std::iter::repeat_n(9, len));
            }
            let at = 20 + opts.len() + 2;
            opts.extend([option::MSS, 4, 0x05, 0xb4]);
            opts.resize(opts.len().div_ceil(4) * 4, option::END);
            let mut seg = vec![0u8; 20];
            seg.extend_from_slice(&opts);
            seg[12] = ((seg.len() / 4) as u8) << 4;
            let p = Packet::new_checked(&seg[..]).unwrap();
            prop_assert_eq!(p.mss_at(), Some(at));
            prop_assert_eq!(be16(&seg, at), 1460);
        }

        /// The data offset is checked against the fixed header and the buffer (RFC 9293
        /// §3.1: at least 5 words, options included).
        #[test]
        fn check_len_takes_exactly_the_offsets_that_fit(buf_len in 0usize..72, offset in 0u8..16) {
            let mut buf = vec![0u8; buf_len];
            if buf_len > 12 {
                buf[12] = offset << 4;
            }
            let header = usize::from(offset) * 4;
            let fits = buf_len >= MIN_HEADER_LEN && header >= MIN_HEADER_LEN && header <= buf_len;
            prop_assert_eq!(Packet::new_checked(&buf[..]).is_ok(), fits);
        }

        /// Ports and checksum set read back, and the rest of the header is left alone.
        #[test]
        fn fields_read_back_as_set(
            header in proptest::array::uniform20(any::<u8>()),
            src in any::<u16>(),
            dst in any::<u16>(),
            checksum in any::<u16>(),
        ) {
            let mut before = header;
            before[12] = 5 << 4;
            let mut buf = before;
            let mut p = Packet::new_unchecked(&mut buf[..]);
            p.set_src_port(src);
            p.set_dst_port(dst);
            p.set_checksum(checksum);
            let p = Packet::new_checked(&buf[..]).expect("a whole header");
            prop_assert_eq!((p.src_port(), p.dst_port(), p.checksum()), (src, dst, checksum));
            prop_assert_eq!(&buf[4..16], &before[4..16]);
            prop_assert_eq!(&buf[18..], &before[18..]);
        }
    }
}
