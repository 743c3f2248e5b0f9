//! Literal values inside words: integers, addresses, prefixes, ranges, durations, rates
//! and sizes. Each parser takes a whole word and fails unless all of it is consumed.

use crate::ir::HostPort;
use nom::branch::alt;
use nom::bytes::complete::{tag_no_case, take_while1, take_while_m_n};
use nom::character::complete::{char, digit1, hex_digit1};
use nom::combinator::{all_consuming, map_res, opt, recognize};
use nom::multi::separated_list1;
use nom::sequence::{pair, preceded, separated_pair};
use nom::IResult;
use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::time::Duration;

fn number(i: &str) -> IResult<&str, u128> {
    alt((
        map_res(preceded(tag_no_case("0x"), hex_digit1), |h| {
            u128::from_str_radix(h, 16)
        }),
        map_res(digit1, str::parse::<u128>),
    ))(i)
}

fn whole<'a, T>(word: &'a str, p: impl FnMut(&'a str) -> IResult<&'a str, T>) -> Option<T> {
    all_consuming(p)(word).ok().map(|(_, v)| v)
}

/// A decimal or `0x` hexadecimal integer.
pub fn integer(word: &str) -> Option<u128> {
    whole(word, number)
}

pub fn ipv4(word: &str) -> Option<Ipv4Addr> {
    word.parse()
        .ok()
        .filter(|_| word.bytes().all(|b| b.is_ascii_digit() || b == b'.'))
}

pub fn ipv6(word: &str) -> Option<Ipv6Addr> {
    word.parse().ok()
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn mac(word: &str) -> Option<[u8; 6]> {
    let byte = map_res(take_while_m_n(2, 2, |c: char| c.is_ascii_hexdigit()), |h| {
        u8::from_str_radix(h, 16)
    });
    let bytes = whole(word, separated_list1(char(':'), byte))?;
    bytes.try_into().ok()
}

/// `ADDR/LEN` split into its parts; the length is not range-checked here.
pub fn prefix(word: &str) -> Option<(&str, u128)> {
    let (addr, len) = word.rsplit_once('/')?;
    Some((addr, integer(len)?))
}

/// `LO-HI`, with both parts still words.
pub fn range(word: &str) -> Option<(&str, &str)> {
    let (lo, hi) = word.split_once('-')?;
    (!lo.is_empty() && !hi.is_empty()).then_some((lo, hi))
}

fn unit_number<'a>(
    units: &'a [(&'a str, u128)],
) -> impl FnMut(&'a str) -> IResult<&'a str, u128> + 'a {
    move |i| {
        let (i, n) = number(i)?;
        let (i, u) = take_while1(|c: char| c.is_ascii_alphabetic() || c == '/')(i)?;
        let mult = units
            .iter()
            .find(|(name, _)| name.eq_ignore_ascii_case(u))
            .map(|&(_, m)| m)
            .ok_or(nom::Err::Error(nom::error::Error::new(
                i,
                nom::error::ErrorKind::Tag,
            )))?;
        let v = n
            .checked_mul(mult)
            .ok_or(nom::Err::Error(nom::error::Error::new(
                i,
                nom::error::ErrorKind::TooLarge,
            )))?;
        Ok((i, v))
    }
}

const DURATION_UNITS: &[(&str, u128)] = &[
    ("ms", 1),
    ("s", 1_000),
    ("m", 60_000),
    ("h", 3_600_000),
    ("d", 86_400_000),
];

/// `500ms`, `30s`, `5m`, `2h`, `5d`.
pub fn duration(word: &str) -> Option<Duration> {
    let ms = whole(word, unit_number(DURATION_UNITS))?;
    Some(Duration::from_millis(u64::try_from(ms).ok()?))
}

/// A meter rate: packets per second or bits per second.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rate {
    Pps(u64),
    Bps(u64),
}

const PACKET_RATE_UNITS: &[(&str, u128)] = &[("pps", 1), ("kpps", 1_000), ("mpps", 1_000_000)];
const BIT_RATE_UNITS: &[(&str, u128)] = &[
    ("bps", 1),
    ("bit/s", 1),
    ("kbps", 1_000),
    ("kbit/s", 1_000),
    ("mbps", 1_000_000),
    ("mbit/s", 1_000_000),
    ("gbps", 1_000_000_000),
    ("gbit/s", 1_000_000_000),
];

/// `10000pps`, `2kpps`, `100mbps`, `10gbit/s` (the number and unit may be separate words,
/// which the caller joins).
pub fn rate(word: &str) -> Option<Rate> {
    if let Some(v) = whole(word, unit_number(PACKET_RATE_UNITS)) {
        return Some(Rate::Pps(u64::try_from(v).ok()?));
    }
    whole(word, unit_number(BIT_RATE_UNITS)).and_then(|v| Some(Rate::Bps(u64::try_from(v).ok()?)))
}

const SIZE_UNITS: &[(&str, u128)] = &[
    ("b", 1),
    ("bytes", 1),
    ("kb", 1_000),
    ("mb", 1_000_000),
    ("gb", 1_000_000_000),
    ("tb", 1_000_000_000_000),
    ("kib", 1 << 10),
    ("mib", 1 << 20),
    ("gib", 1 << 30),
    ("tib", 1 << 40),
];

/// A byte count: `4096`, `64KiB`, `1GiB`, `10gb`.
pub fn size(word: &str) -> Option<u64> {
    let v = integer(word).or_else(|| whole(word, unit_number(SIZE_UNITS)))?;
    u64::try_from(v).ok()
}

/// `127.0.0.1:9464` or `[::1]:9464`.
pub fn socket_addr(word: &str) -> Option<SocketAddr> {
    word.parse().ok()
}

/// `IP:PORT` or `NAME:PORT`.
pub fn host_port(word: &str) -> Option<HostPort> {
    word.parse().ok()
}

/// A packet count with an optional `k`/`m` multiplier or `pkts` unit: `1000`, `64k`.
pub fn count(word: &str) -> Option<u64> {
    const UNITS: &[(&str, u128)] = &[("k", 1_000), ("m", 1_000_000), ("pkts", 1), ("packets", 1)];
    let v = integer(word).or_else(|| whole(word, unit_number(UNITS)))?;
    u64::try_from(v).ok()
}

/// Bytes written as hex: `0xdeadbeef`.
pub fn hex_bytes(word: &str) -> Option<Vec<u8>> {
    let digits = whole(word, preceded(tag_no_case("0x"), recognize(hex_digit1)))?;
    if digits.len() % 2 != 0 {
        return None;
    }
    (0..digits.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&digits[i..i + 2], 16).ok())
        .collect()
}

/// `NAME+NAME…` over a fixed table of bit names (TCP flags).
pub fn bit_names(word: &str, names: &[(&str, u128)]) -> Option<u128> {
    let parts = whole(
        word,
        separated_list1(
            char('+'),
            take_while1(|c: char| c.is_ascii_alphanumeric() || c == '_'),
        ),
    )?;
    parts.iter().try_fold(0u128, |acc, p| {
        names
            .iter()
            .find(|(n, _)| n.eq_ignore_ascii_case(p))
            .map(|&(_, b)| acc | b)
    })
}

/// `VALUE/MASK` with both parts integers (`0x06/0xff`).
pub fn masked(word: &str) -> Option<(u128, u128)> {
    whole(word, separated_pair(number, char('/'), number))
}

/// An optionally signed decimal; used only to give better messages for negative values.
pub fn is_negative_number(word: &str) -> bool {
    whole(word, recognize(pair(char('-'), opt(digit1)))).is_some()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn literals() {
        assert_eq!(integer("0x1F"), Some(31));
        assert_eq!(integer("12a"), None);
        assert_eq!(ipv4("10.0.0.1"), Some(Ipv4Addr::new(10, 0, 0, 1)));
        assert_eq!(ipv4("::1"), None);
        assert_eq!(mac("02:00:00:00:00:0a"), Some([2, 0, 0, 0, 0, 10]));
        assert_eq!(mac("02:00:00:00:00"), None);
        assert_eq!(prefix("2001:db8::/32"), Some(("2001:db8::", 32)));
        assert_eq!(range("1024-65535"), Some(("1024", "65535")));
        assert_eq!(duration("5d"), Some(Duration::from_secs(432_000)));
        assert_eq!(duration("250ms"), Some(Duration::from_millis(250)));
        assert_eq!(rate("10000pps"), Some(Rate::Pps(10_000)));
        assert_eq!(rate("10gbit/s"), Some(Rate::Bps(10_000_000_000)));
        assert_eq!(size("64KiB"), Some(65536));
        assert_eq!(count("64k"), Some(64_000));
        assert_eq!(hex_bytes("0xdeadbeef"), Some(vec![0xde, 0xad, 0xbe, 0xef]));
        assert_eq!(bit_names("syn+ack", &[("syn", 2), ("ack", 16)]), Some(18));
        assert_eq!(masked("0x06/0xff"), Some((6, 255)));
        assert_eq!(integer("999999999999999999999999999999999999999999"), None);
    }
}
