//! A value as Redis serializes one for `DUMP` and takes it back in `RESTORE` (and as
//! `MIGRATE` carries it between servers): the object as an RDB file holds it, then the
//! RDB version (2 bytes, little-endian) and a CRC-64 of everything before (8 bytes,
//! little-endian; Redis's `crc64.c`, the Jones polynomial, reflected). Only string
//! objects: the one type the service holds.
//!
//! The RDB format has no published specification; what is read here is what Redis 7's
//! `rdb.c` writes for a string: type 0, then either a length and the bytes, or a
//! special encoding, an integer of 8, 16 or 32 bits or an LZF-compressed string (which
//! Redis writes for strings over 20 bytes that compress).

use crc::{Crc, Table, CRC_64_REDIS};
use std::borrow::Cow;

/// The RDB version written into payloads: Redis checks only that a payload's is not
/// newer than its own, and strings are encoded the same from version 9 (Redis 5.0) on,
/// so payloads made here restore into Redis 5.0 and later.
pub const WRITTEN_VERSION: u16 = 9;

/// Bytes after the object: the version and the checksum.
const FOOTER: usize = 10;

/// `RDB_TYPE_STRING`: the object type byte of a string.
const STRING: u8 = 0;

/// The most bytes LZF can make of one byte of its input: a back reference of the
/// longest kind, 264 bytes from 3.
const LZF_MOST_PER_BYTE: u64 = 88;

static CRC64: Crc<u64, Table<16>> = Crc::<u64, Table<16>>::new(&CRC_64_REDIS);

/// Why a payload was not taken. The messages are Redis's own, for those it has.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PayloadError {
    /// shorter than its footer, or its checksum does not match its bytes
    #[error("DUMP payload version or checksum are wrong")]
    Checksum,
    /// not an object as RDB encodes one
    #[error("Bad data format")]
    Format,
    /// an object of a type other than string (lists, hashes, …), which is not held here
    #[error("Bad data format: an object of RDB type {0}, and only strings are held")]
    NotString(u8),
    /// a value longer than the limit it is read under
    #[error("the value ({len} bytes) is larger than the store ({limit} bytes)")]
    TooLarge { len: u64, limit: u64 },
}

/// The payload of `value` as `DUMP` answers it (never compressed: KV-cache blocks do not
/// compress, and Redis takes a plain string as readily).
pub fn encode(value: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(value.len() + 9 + 1 + FOOTER);
    out.push(STRING);
    put_len(&mut out, value.len() as u64);
    out.extend_from_slice(value);
    out.extend_from_slice(&WRITTEN_VERSION.to_le_bytes());
    let crc = CRC64.checksum(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// The string value a payload holds, borrowed from it unless it had to be expanded; a
/// value longer than `limit` bytes is refused before any room is taken for it. Any RDB
/// version is read, as string encoding has not changed with them.
pub fn decode(payload: &[u8], limit: u64) -> Result<Cow<'_, [u8]>, PayloadError> {
    let body_len = payload
        .len()
        .checked_sub(FOOTER)
        .ok_or(PayloadError::Checksum)?;
    let (covered, crc) = payload.split_at(payload.len() - 8);
    let crc = u64::from_le_bytes(crc.try_into().expect("8 bytes"));
    if CRC64.checksum(covered) != crc {
        return Err(PayloadError::Checksum);
    }
    let mut body = Reader(&payload[..body_len]);
    match body.byte()? {
        STRING => {}
        other => return Err(PayloadError::NotString(other)),
    }
    // Bytes left after the object are not looked at, as Redis does not.
    let within = |len: u64| match len > limit {
        true => Err(PayloadError::TooLarge { len, limit }),
        false => Ok(()),
    };
    match body.len()? {
        Len::Plain(len) => {
            within(len)?;
            Ok(Cow::Borrowed(body.take(len)?))
        }
        Len::Int(n) => Ok(Cow::Owned(n.to_string().into_bytes())),
        Len::Lzf => {
            let (Len::Plain(packed), Len::Plain(len)) = (body.len()?, body.len()?) else {
                return Err(PayloadError::Format);
            };
            within(len)?;
            if len > packed.saturating_mul(LZF_MOST_PER_BYTE) {
                return Err(PayloadError::Format);
            }
            let packed = body.take(packed)?;
            lzf_expand(packed, len as usize)
                .map(Cow::Owned)
                .ok_or(PayloadError::Format)
        }
    }
}

/// Appends `len` in RDB's length encoding: 6 bits in one byte, 14 in two, then a
/// marker byte and 32 or 64 bits, big-endian.
fn put_len(out: &mut Vec<u8>, len: u64) {
    match len {
        0..0x40 => out.push(len as u8),
        0x40..0x4000 => out.extend_from_slice(&(0x4000 | len as u16).to_be_bytes()),
        _ => match u32::try_from(len) {
            Ok(l) => {
                out.push(0x80);
                out.extend_from_slice(&l.to_be_bytes());
            }
            Err(_) => {
                out.push(0x81);
                out.extend_from_slice(&len.to_be_bytes());
            }
        },
    }
}

/// What RDB's length encoding gave: a length, or a string written specially.
#[derive(Debug, PartialEq, Eq)]
enum Len {
    Plain(u64),
    /// An integer of 8, 16 or 32 bits, little-endian, standing for its decimal digits.
    Int(i32),
    /// An LZF-compressed string: its packed length, its length, the packed bytes.
    Lzf,
}

/// The bytes of an object not yet read.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: u64) -> Result<&'a [u8], PayloadError> {
        let n = usize::try_from(n).map_err(|_| PayloadError::Format)?;
        if n > self.0.len() {
            return Err(PayloadError::Format);
        }
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        Ok(taken)
    }

    fn byte(&mut self) -> Result<u8, PayloadError> {
        Ok(self.take(1)?[0])
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], PayloadError> {
        Ok(self.take(N as u64)?.try_into().expect("N bytes"))
    }

    fn len(&mut self) -> Result<Len, PayloadError> {
        let first = self.byte()?;
        let low = first & 0x3f;
        Ok(match first >> 6 {
            0 => Len::Plain(u64::from(low)),
            1 => Len::Plain(u64::from(low) << 8 | u64::from(self.byte()?)),
            2 => match first {
                0x80 => Len::Plain(u64::from(u32::from_be_bytes(self.array()?))),
                0x81 => Len::Plain(u64::from_be_bytes(self.array()?)),
                _ => return Err(PayloadError::Format),
            },
            _ => match low {
                0 => Len::Int(i32::from(self.byte()? as i8)),
                1 => Len::Int(i32::from(i16::from_le_bytes(self.array()?))),
                2 => Len::Int(i32::from_le_bytes(self.array()?)),
                3 => Len::Lzf,
                _ => return Err(PayloadError::Format),
            },
        })
    }
}

/// LZF's expansion (liblzf's `lzf_d.c` format): a control byte under 32 starts a run of
/// that many plus one literal bytes; any other holds a length in its top 3 bits (7: add
/// the next byte) and the high bits of a distance back, its next byte the low ones; the
/// reference copies length + 2 bytes from distance + 1 back, overlapping as it goes.
/// `None` unless the input makes exactly `len` bytes.
fn lzf_expand(packed: &[u8], len: usize) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(len);
    let mut rest = packed;
    while let Some((&control, after)) = rest.split_first() {
        rest = after;
        let control = usize::from(control);
        if control < 32 {
            let (literal, after) = rest.split_at_checked(control + 1)?;
            if out.len() + literal.len() > len {
                return None;
            }
            out.extend_from_slice(literal);
            rest = after;
            continue;
        }
        let mut n = control >> 5;
        if n == 7 {
            let (&more, after) = rest.split_first()?;
            n += usize::from(more);
            rest = after;
        }
        let (&low, after) = rest.split_first()?;
        rest = after;
        let distance = ((control & 0x1f) << 8 | usize::from(low)) + 1;
        let from = out.len().checked_sub(distance)?;
        let n = n + 2;
        if out.len() + n > len {
            return None;
        }
        for at in from..from + n {
            out.push(out[at]);
        }
    }
    (out.len() == len).then_some(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Payloads redis-server 7.0 gave for `DUMP` (RDB version 10).
    const FROM_REDIS: [(&[u8], &[u8]); 5] = [
        (b"\x00\x05hello\n\x00cr\xdfve4 \n", b"hello"),
        (b"\x00\xc190\n\x00\x9d\x94\xea'\x93\xfc\x08\xb9", b"12345"),
        (b"\x00\xc0\xfb\n\x00I\xc4\xc6\xf4\xd7&?h", b"-5"),
        (b"\x00\x00\n\x00]\x9b\\@\x0f\x7f\xa2\xda", b""),
        (
            b"\x00\xc3\t@e\x01xx\xe0X\x00\x01x\n\n\x00w\x0b\x80\xffNrm\x14",
            b"xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n",
        ),
    ];

    #[test]
    fn redis_payloads_are_read() {
        for (payload, value) in FROM_REDIS {
            assert_eq!(decode(payload, 1 << 20).as_deref(), Ok(value));
        }
    }

    #[test]
    fn the_checksum_is_redis_crc64() {
        // The check value of CRC-64/Jones as Redis's crc64.c tests it.
        assert_eq!(CRC64.checksum(b"123456789"), 0xe9c6_d914_c4b8_d9ca);
    }

    #[test]
    fn a_changed_byte_fails_the_checksum() {
        let mut payload = encode(b"hello");
        payload[3] ^= 1;
        assert_eq!(decode(&payload, 1 << 20), Err(PayloadError::Checksum));
        assert_eq!(decode(&payload[..9], 1 << 20), Err(PayloadError::Checksum));
    }

    /// `payload` with its checksum made right for its bytes.
    fn sealed(mut body: Vec<u8>) -> Vec<u8> {
        body.extend_from_slice(&10u16.to_le_bytes());
        let crc = CRC64.checksum(&body);
        body.extend_from_slice(&crc.to_le_bytes());
        body
    }

    #[test]
    fn other_types_and_broken_objects_are_refused() {
        // A list (RDB type 18, a quicklist) from a newer Redis, and a string cut short.
        assert_eq!(
            decode(&sealed(vec![18, 1, 2, 3]), 1 << 20),
            Err(PayloadError::NotString(18))
        );
        assert_eq!(
            decode(&sealed(vec![0, 5, b'a']), 1 << 20),
            Err(PayloadError::Format)
        );
        // An LZF string claiming more than its bytes could ever make.
        let claim = sealed(vec![0, 0xc3, 2, 0x81, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
        assert_eq!(decode(&claim, u64::MAX), Err(PayloadError::Format));
        assert_eq!(
            decode(&encode(&[7; 100]), 99),
            Err(PayloadError::TooLarge {
                len: 100,
                limit: 99
            })
        );
    }

    #[test]
    fn lengths_take_the_shortest_encoding() {
        for (len, head) in [
            (0u64, &[0u8][..]),
            (63, &[63]),
            (64, &[0x40, 64]),
            (16383, &[0x7f, 0xff]),
            (16384, &[0x80, 0, 0, 0x40, 0]),
            (1 << 32, &[0x81, 0, 0, 0, 1, 0, 0, 0, 0]),
        ] {
            let mut out = Vec::new();
            put_len(&mut out, len);
            assert_eq!(out, head, "{len}");
            assert_eq!(Reader(&out).len(), Ok(Len::Plain(len)));
        }
    }

    /// A greedy LZF compressor of the format [`lzf_expand`] reads, to test it on more
    /// than Redis's samples: references found by looking back over every distance.
    fn lzf_pack(input: &[u8]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut literal: Vec<u8> = Vec::new();
        let flush = |out: &mut Vec<u8>, literal: &mut Vec<u8>| {
            for run in literal.chunks(32) {
                out.push(run.len() as u8 - 1);
                out.extend_from_slice(run);
            }
            literal.clear();
        };
        let mut at = 0;
        while at < input.len() {
            let best = (1..=at.min(8192))
                .map(|d| {
                    let n = (0..264.min(input.len() - at))
                        .take_while(|&k| input[at + k] == input[at - d + k])
                        .count();
                    (n, d)
                })
                .max();
            match best {
                Some((n, d)) if n >= 3 => {
                    flush(&mut out, &mut literal);
                    let (len, off) = (n - 2, d - 1);
                    if len < 7 {
                        out.push((len << 5 | off >> 8) as u8);
                    } else {
                        out.push((7 << 5 | off >> 8) as u8);
                        out.push((len - 7) as u8);
                    }
                    out.push(off as u8);
                    at += n;
                }
                _ => {
                    literal.push(input[at]);
                    at += 1;
                }
            }
        }
        flush(&mut out, &mut literal);
        out
    }

    /// A payload of `value` LZF-compressed, as Redis writes a string that compresses.
    fn compressed(value: &[u8]) -> Vec<u8> {
        let packed = lzf_pack(value);
        let mut body = vec![STRING, 0xc3];
        put_len(&mut body, packed.len() as u64);
        put_len(&mut body, value.len() as u64);
        body.extend_from_slice(&packed);
        sealed(body)
    }

    proptest! {
        #[test]
        fn any_value_comes_back(value in prop::collection::vec(any::<u8>(), 0..20_000)) {
            let payload = encode(&value);
            prop_assert_eq!(decode(&payload, u64::MAX), Ok(Cow::from(&value[..])));
        }

        #[test]
        fn compressed_values_come_back(
            pieces in prop::collection::vec((prop::collection::vec(any::<u8>(), 1..6), 1..300usize), 0..40)
        ) {
            // Repetitive, so that the compressor finds references of every length.
            let value: Vec<u8> = pieces.iter().flat_map(|(p, n)| p.iter().cycle().take(*n).copied()).collect();
            let payload = compressed(&value);
            prop_assert_eq!(decode(&payload, u64::MAX), Ok(Cow::from(&value[..])));
        }

        #[test]
        fn any_sealed_bytes_are_survived(body in prop::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&sealed(body), 1 << 16);
        }

        #[test]
        fn any_lzf_stream_is_survived(packed in prop::collection::vec(any::<u8>(), 0..200), len in 0..4000usize) {
            if let Some(out) = lzf_expand(&packed, len) {
                prop_assert_eq!(out.len(), len);
            }
        }
    }
}
