//! Geneve headers and options (RFC 8926 §3.4, §3.5).
//!
//! ```text
//! |Ver|  Opt Len  |O|C|    Rsvd.  |          Protocol Type        |
//! |        Virtual Network Identifier (VNI)       |    Reserved   |
//! |                    Variable-Length Options                    |
//! ```

use super::{be16, be32, need, put16, put32, Error, Result};

pub const BASE_LEN: usize = 8;
/// IANA-assigned UDP destination port.
pub const UDP_PORT: u16 = 6081;
/// Option types with this bit set are critical (RFC 8926 §3.5).
pub const CRITICAL: u8 = 0x80;

view!(
    /// A view of a Geneve header.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    /// The base header fits, the version is 0, and the options fit.
    pub fn check_len(&self) -> Result<()> {
        need(self.buffer.as_ref(), BASE_LEN)?;
        if self.version() != 0 {
            return Err(Error::Malformed);
        }
        need(self.buffer.as_ref(), self.header_len())
    }

    pub fn version(&self) -> u8 {
        self.buffer.as_ref()[0] >> 6
    }

    /// Length of the options in bytes.
    pub fn options_len(&self) -> usize {
        usize::from(self.buffer.as_ref()[0] & 0x3f) * 4
    }

    pub fn header_len(&self) -> usize {
        BASE_LEN + self.options_len()
    }

    /// O: a control packet for the tunnel endpoint, not to be forwarded as data.
    pub fn oam(&self) -> bool {
        self.buffer.as_ref()[1] & 0x80 != 0
    }

    /// C: at least one option is critical.
    pub fn critical(&self) -> bool {
        self.buffer.as_ref()[1] & 0x40 != 0
    }

    pub fn protocol(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    pub fn vni(&self) -> u32 {
        be32(self.buffer.as_ref(), 4) >> 8
    }

    /// The options, as (class, type, data); stops at the first one that overruns.
    pub fn options(&self) -> Options<'_> {
        Options {
            rest: &self.buffer.as_ref()[BASE_LEN..self.header_len()],
        }
    }

    pub fn payload(&self) -> &[u8] {
        &self.buffer.as_ref()[self.header_len()..]
    }
}

/// The options of a whole Geneve header (base header and options, as `header_len` gives).
pub fn options_in(header: &[u8]) -> Options<'_> {
    Options {
        rest: header.get(BASE_LEN..).unwrap_or_default(),
    }
}

/// Iterator over Geneve option TLVs.
#[derive(Debug, Clone)]
pub struct Options<'a> {
    rest: &'a [u8],
}

/// One option TLV.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Opt<'a> {
    pub class: u16,
    pub kind: u8,
    pub data: &'a [u8],
}

impl<'a> Iterator for Options<'a> {
    type Item = Result<Opt<'a>>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        if self.rest.len() < 4 {
            self.rest = &[];
            return Some(Err(Error::Truncated));
        }
        let len = 4 + usize::from(self.rest[3] & 0x1f) * 4;
        if self.rest.len() < len {
            self.rest = &[];
            return Some(Err(Error::Truncated));
        }
        let opt = Opt {
            class: be16(self.rest, 0),
            kind: self.rest[2],
            data: &self.rest[4..len],
        };
        self.rest = &self.rest[len..];
        Some(Ok(opt))
    }
}

/// A Geneve header to build; options are emitted from raw TLV bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Repr<'a> {
    pub vni: u32,
    pub protocol: u16,
    /// Encoded option TLVs, a multiple of 4 bytes, at most 252.
    pub options: &'a [u8],
    pub critical: bool,
}

impl Repr<'_> {
    pub fn header_len(&self) -> usize {
        BASE_LEN + self.options.len()
    }

    pub fn emit(&self, buf: &mut [u8]) {
        buf[0] = (self.options.len() / 4) as u8;
        buf[1] = if self.critical { 0x40 } else { 0 };
        put16(buf, 2, self.protocol);
        put32(buf, 4, self.vni << 8);
        buf[BASE_LEN..self.header_len()].copy_from_slice(self.options);
    }
}

/// Encodes one option TLV onto `out`.
pub fn encode_option(out: &mut Vec<u8>, class: u16, kind: u8, data: &[u8]) {
    out.extend_from_slice(&class.to_be_bytes());
    out.push(kind);
    out.push((data.len() / 4) as u8 & 0x1f);
    out.extend_from_slice(data);
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn options_round_trip() {
        let mut opts = Vec::new();
        encode_option(&mut opts, 0x0102, 0x80, &[0, 0, 0, 10]);
        encode_option(&mut opts, 0xffff, 0x01, &[]);
        let r = Repr {
            vni: 200,
            protocol: 0x6558,
            options: &opts,
            critical: true,
        };
        let mut buf = vec![0; r.header_len()];
        r.emit(&mut buf);
        let p = Packet::new_checked(&buf[..]).unwrap();
        assert_eq!(
            (p.vni(), p.protocol(), p.critical(), p.options_len()),
            (200, 0x6558, true, 12)
        );
        let got: Vec<_> = p.options().map(|o| o.unwrap()).collect();
        assert_eq!(
            got[0],
            Opt {
                class: 0x0102,
                kind: 0x80,
                data: &[0, 0, 0, 10]
            }
        );
        assert_eq!(got[1].class, 0xffff);
    }

    #[test]
    fn oversized_option_length_is_truncated() {
        // Opt Len says 8 bytes of options but only 4 follow.
        let buf = [0x02, 0, 0x65, 0x58, 0, 0, 200, 0, 1, 2, 3, 4];
        assert_eq!(Packet::new_checked(&buf[..]).err(), Some(Error::Truncated));
    }

    proptest! {
        #[test]
        fn never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..80)) {
            if let Ok(p) = Packet::new_checked(&bytes[..]) {
                let _ = (p.vni(), p.protocol(), p.oam(), p.critical(), p.payload().len());
                for o in p.options() { let _ = o; }
            }
        }
    }
}
