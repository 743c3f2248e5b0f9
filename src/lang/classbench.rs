//! ClassBench rule files: one 5-tuple rule a line, first match wins.
//!
//! `@SRC/LEN  DST/LEN  SPORT_LO : SPORT_HI  DPORT_LO : DPORT_HI  0xPROTO/0xMASK  0xFLAGS/0xMASK`
//! (tabs or spaces between fields; the trailing flags field is optional and, as in DPDK's
//! `dpdk-test-acl`, not used for matching).

use nom::bytes::complete::tag_no_case;
use nom::character::complete::{char, digit1, hex_digit1, space0, space1};
use nom::combinator::{all_consuming, map_res, opt};
use nom::sequence::{preceded, separated_pair, terminated, tuple};
use nom::IResult;
use std::net::Ipv4Addr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClassBenchRule {
    pub src: (u32, u8),
    pub dst: (u32, u8),
    pub sport: (u16, u16),
    pub dport: (u16, u16),
    /// Protocol value and mask.
    pub proto: (u8, u8),
}

fn dec<T: std::str::FromStr>(i: &str) -> IResult<&str, T> {
    map_res(digit1, str::parse)(i)
}

fn hex(i: &str) -> IResult<&str, u32> {
    map_res(preceded(tag_no_case("0x"), hex_digit1), |h| {
        u32::from_str_radix(h, 16)
    })(i)
}

fn prefix(i: &str) -> IResult<&str, (u32, u8)> {
    let addr = map_res(
        nom::bytes::complete::take_while1(|c: char| c.is_ascii_digit() || c == '.'),
        str::parse::<Ipv4Addr>,
    );
    let (i, (a, len)) = separated_pair(addr, char('/'), dec::<u8>)(i)?;
    Ok((i, (u32::from(a), len)))
}

fn port_range(i: &str) -> IResult<&str, (u16, u16)> {
    separated_pair(dec::<u16>, tuple((space0, char(':'), space0)), dec::<u16>)(i)
}

fn rule(i: &str) -> IResult<&str, ClassBenchRule> {
    let (i, (src, dst, sport, dport, (proto, mask), _flags)) = tuple((
        preceded(char('@'), prefix),
        preceded(space1, prefix),
        preceded(space1, port_range),
        preceded(space1, port_range),
        preceded(space1, separated_pair(hex, char('/'), hex)),
        terminated(
            opt(preceded(space1, separated_pair(hex, char('/'), hex))),
            space0,
        ),
    ))(i)?;
    let byte = |v: u32| {
        u8::try_from(v).map_err(|_| {
            nom::Err::Error(nom::error::Error::new(i, nom::error::ErrorKind::TooLarge))
        })
    };
    let proto = (byte(proto)?, byte(mask)?);
    Ok((
        i,
        ClassBenchRule {
            src,
            dst,
            sport,
            dport,
            proto,
        },
    ))
}

/// Why a line is not a rule.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LineError {
    /// the line is not in ClassBench format
    #[error("malformed ClassBench rule")]
    Syntax,
    /// a prefix length is over 32
    #[error("prefix length {0} is out of range for an IPv4 address (0-32)")]
    PrefixLength(u8),
    /// a port range whose low end is above its high end
    #[error("port range {0}:{1} is empty ({0} > {1})")]
    EmptyRange(u16, u16),
}

/// Parses one non-blank line.
pub fn parse_line(line: &str) -> Result<ClassBenchRule, LineError> {
    let (_, r) = all_consuming(rule)(line.trim_end_matches('\r')).map_err(|_| LineError::Syntax)?;
    for (_, len) in [r.src, r.dst] {
        if len > 32 {
            return Err(LineError::PrefixLength(len));
        }
    }
    for (lo, hi) in [r.sport, r.dport] {
        if lo > hi {
            return Err(LineError::EmptyRange(lo, hi));
        }
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_classbench_lines() {
        let r = parse_line("@176.19.181.33/32\t90.145.23.162/32\t0 : 65535\t1550 : 1550\t0x06/0xFF\t0x0000/0x0200\t").unwrap();
        assert_eq!(r.src, (u32::from(Ipv4Addr::new(176, 19, 181, 33)), 32));
        assert_eq!(r.sport, (0, 65535));
        assert_eq!(r.dport, (1550, 1550));
        assert_eq!(r.proto, (6, 0xff));
        assert!(parse_line("@1.2.3.4/32 1.2.3.4/32 0 : 1 2 : 3 0x00/0x00").is_ok());
        assert_eq!(
            parse_line("@1.2.3.4/33 1.2.3.4/32 0 : 1 2 : 3 0x00/0x00"),
            Err(LineError::PrefixLength(33))
        );
        assert_eq!(
            parse_line("@1.2.3.4/32 1.2.3.4/32 5 : 1 2 : 3 0x00/0x00"),
            Err(LineError::EmptyRange(5, 1))
        );
        assert_eq!(parse_line("1.2.3.4/32"), Err(LineError::Syntax));
    }

    use proptest::prelude::*;

    /// Blanks between fields, as ClassBench generators and hand edits leave them.
    fn blank() -> impl Strategy<Value = &'static str> {
        proptest::sample::select(vec![" ", "\t", "  ", " \t", "\t\t"])
    }

    proptest! {
        /// Any rule, written with any blanks, either case of `0x`, with or without the
        /// flags field and a trailing blank or CR, parses back to itself.
        #[test]
        fn rules_parse_back(
            src in (any::<u32>(), 0u8..=32), dst in (any::<u32>(), 0u8..=32),
            sport in (any::<u16>(), any::<u16>()), dport in (any::<u16>(), any::<u16>()),
            proto in (any::<u8>(), any::<u8>()),
            gaps in proptest::collection::vec(blank(), 5),
            upper in any::<bool>(), flags in any::<bool>(), end in proptest::sample::select(vec!["", "\t", " ", "\r"]),
        ) {
            let sport = (sport.0.min(sport.1), sport.0.max(sport.1));
            let dport = (dport.0.min(dport.1), dport.0.max(dport.1));
            let x = if upper { "0X" } else { "0x" };
            let flags = if flags { format!("{}{x}0000/{x}0200", gaps[4]) } else { String::new() };
            let line = format!(
                "@{}/{}{}{}/{}{}{} : {}{}{} : {}{}{x}{:02X}/{x}{:02x}{flags}{end}",
                Ipv4Addr::from(src.0), src.1, gaps[0], Ipv4Addr::from(dst.0), dst.1, gaps[1],
                sport.0, sport.1, gaps[2], dport.0, dport.1, gaps[3], proto.0, proto.1,
            );
            let want = ClassBenchRule { src, dst, sport, dport, proto };
            prop_assert_eq!(parse_line(&line), Ok(want), "{:?}", line);
        }

        /// Any line is a rule or an error, never a panic.
        #[test]
        fn any_line_parses_or_fails(line in "[@0-9a-fA-FxX./: \t\r-]{0,80}") {
            let _ = parse_line(&line);
        }
    }
}
