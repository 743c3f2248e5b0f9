//! RESP, the Redis serialization protocol, as far as a key-value block store needs it:
//! requests are arrays of bulk strings (or inline commands typed by hand), replies are
//! simple strings, errors, integers, bulk strings and arrays, and in RESP3 (a connection
//! asks for it with `HELLO 3`) also nulls, maps and verbatim strings.
//! Spec: <https://redis.io/docs/latest/develop/reference/protocol-spec/> (RESP2 and RESP3).
//!
//! Sans-IO: [`parse`] finds one whole request at the start of a buffer and says where its
//! arguments are; the caller owns reading and writing.

use std::ops::Range;

/// Most arguments a request may have (Redis's own limit).
pub const MAX_ARGS: usize = 1024 * 1024;
/// Longest argument in bytes (Redis's `proto-max-bulk-len` default, 512 MiB); a server
/// passes [`parse`] a lower bound where it can (no value longer than its store).
pub const MAX_BULK: usize = 512 << 20;
/// Longest inline command or header line.
pub const MAX_LINE: usize = 64 << 10;

/// Why a request cannot be read; the connection is answered with the error and closed,
/// as Redis does, since what follows cannot be framed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ProtocolError {
    /// Protocol error: invalid multibulk length
    #[error("Protocol error: invalid multibulk length")]
    ArrayLength,
    /// Protocol error: invalid bulk length
    #[error("Protocol error: invalid bulk length")]
    BulkLength,
    /// Protocol error: expected '$', got the byte that came instead
    #[error("Protocol error: expected '$', got '{}'", char::from(*.0))]
    ExpectedBulk(u8),
    /// Protocol error: a bulk string not followed by CRLF
    #[error("Protocol error: bulk string not followed by CRLF")]
    MissingCrlf,
    /// Protocol error: too big inline request
    #[error("Protocol error: too big inline request")]
    LineTooLong,
    /// Protocol error: unbalanced quotes in inline request
    #[error("Protocol error: unbalanced quotes in request")]
    Quotes,
}

/// The position of the first CRLF-terminated line in `buf[from..]`: its end (excluding
/// CRLF) and the index after the CRLF; `None` if the line is not whole yet.
fn line(buf: &[u8], from: usize) -> Option<(usize, usize)> {
    let rest = buf.get(from..)?;
    let at = rest.windows(2).position(|w| w == b"\r\n")?;
    Some((from + at, from + at + 2))
}

/// A decimal length as RESP writes them (`-1` allowed where `signed`).
fn number(digits: &[u8]) -> Option<i64> {
    let (neg, digits) = match digits.split_first() {
        Some((b'-', rest)) => (true, rest),
        _ => (false, digits),
    };
    if digits.is_empty() || digits.len() > 18 || !digits.iter().all(u8::is_ascii_digit) {
        return None;
    }
    let n = digits
        .iter()
        .fold(0i64, |n, d| n * 10 + i64::from(d - b'0'));
    Some(if neg { -n } else { n })
}

/// Parses one request at the start of `buf`. `Ok(Some(n))`: a whole request of `n` bytes,
/// its arguments' ranges in `args`: into `buf` for an array, into `inline` for an inline
/// command ([`is_inline`]), whose arguments are unescaped there; `Ok(None)`: more bytes
/// are needed (`args` then holds those of its arguments that have arrived whole, the
/// command's name first; none of an inline command's); `Err`: the bytes are not RESP, or
/// an argument would be longer than `max_bulk` (refused before its bytes arrive, so a
/// client cannot make the server buffer more). An empty request (a blank inline line, or
/// `*0`) parses with no arguments.
pub fn parse(
    buf: &[u8],
    args: &mut Vec<Range<usize>>,
    inline: &mut Vec<u8>,
    max_bulk: usize,
) -> Result<Option<usize>, ProtocolError> {
    args.clear();
    match buf.first() {
        None => Ok(None),
        Some(b'*') => parse_array(buf, args, max_bulk.min(MAX_BULK)),
        Some(_) => parse_inline(buf, args, inline),
    }
}

/// Whether the request at the start of `buf` is an inline command (its arguments, as
/// [`parse`] gives them, are not in `buf`).
pub fn is_inline(buf: &[u8]) -> bool {
    buf.first().is_some_and(|&b| b != b'*')
}

/// What is known of a request still arriving ([`awaited`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Awaited {
    /// The length the request will have at least.
    pub len: usize,
    /// Where the bytes of the argument now arriving start.
    pub data: usize,
}

/// After [`parse`] found the request at the start of `buf` not whole, with `args` as it
/// left them: its least length and where the argument now arriving starts, once that
/// argument has announced its length; `None` before that (and for an inline command). A
/// server makes room for a large value once, rather than growing its buffer as the bytes
/// come, and can place the value where it wants it.
pub fn awaited(buf: &[u8], args: &[Range<usize>]) -> Option<Awaited> {
    if buf.first() != Some(&b'*') {
        return None;
    }
    let at = match args.last() {
        Some(r) => r.end + 2,
        None => line(buf, 1)?.1,
    };
    if buf.get(at) != Some(&b'$') {
        return None;
    }
    let (end, data) = line(buf, at + 1)?;
    let len = usize::try_from(number(&buf[at + 1..end])?).ok()?;
    Some(Awaited {
        len: data + len + 2,
        data,
    })
}

fn parse_array(
    buf: &[u8],
    args: &mut Vec<Range<usize>>,
    max_bulk: usize,
) -> Result<Option<usize>, ProtocolError> {
    let Some((end, mut at)) = line(buf, 1) else {
        return if buf.len() > MAX_LINE {
            Err(ProtocolError::ArrayLength)
        } else {
            Ok(None)
        };
    };
    let count = number(&buf[1..end]).ok_or(ProtocolError::ArrayLength)?;
    if count > MAX_ARGS as i64 {
        return Err(ProtocolError::ArrayLength);
    }
    for _ in 0..count.max(0) {
        match buf.get(at) {
            None => return Ok(None),
            Some(b'$') => {}
            Some(&other) => return Err(ProtocolError::ExpectedBulk(other)),
        }
        let Some((end, data)) = line(buf, at + 1) else {
            return if buf.len() - at > 32 {
                Err(ProtocolError::BulkLength)
            } else {
                Ok(None)
            };
        };
        let len = number(&buf[at + 1..end])
            .filter(|n| (0..=max_bulk as i64).contains(n))
            .ok_or(ProtocolError::BulkLength)? as usize;
        let stop = data + len;
        match buf.get(stop..stop + 2) {
            None => return Ok(None),
            Some(b"\r\n") => {}
            Some(_) => return Err(ProtocolError::MissingCrlf),
        }
        args.push(data..stop);
        at = stop + 2;
    }
    Ok(Some(at))
}

/// An inline command, ended by LF or CRLF, its words split and unescaped into `words` as
/// Redis's `sdssplitargs` does: words are separated by whitespace; a double-quoted part
/// takes `\xHH`, `\n`, `\r`, `\t`, `\b`, `\a` and a backslash before any other
/// byte (that byte), a single-quoted part only `\'`; quotes may begin inside a word but
/// a word ends where they close, which must be before whitespace or the line's end.
fn parse_inline(
    buf: &[u8],
    args: &mut Vec<Range<usize>>,
    words: &mut Vec<u8>,
) -> Result<Option<usize>, ProtocolError> {
    // Redis looks for the line's end with `strchr`, which stops at a NUL: a line with
    // one before its LF never ends.
    let Some(lf) = buf
        .iter()
        .position(|&b| b == b'\n' || b == 0)
        .filter(|&at| buf[at] == b'\n')
    else {
        return if buf.len() > MAX_LINE {
            Err(ProtocolError::LineTooLong)
        } else {
            Ok(None)
        };
    };
    if lf > MAX_LINE {
        return Err(ProtocolError::LineTooLong);
    }
    let end = if lf > 0 && buf[lf - 1] == b'\r' {
        lf - 1
    } else {
        lf
    };
    let line = &buf[..end];
    words.clear();
    let mut i = 0;
    loop {
        while line.get(i).is_some_and(|b| is_space(*b)) {
            i += 1;
        }
        if i == line.len() {
            return Ok(Some(lf + 1));
        }
        let start = words.len();
        i = split_word(line, i, words)?;
        args.push(start..words.len());
    }
}

/// The end of a word whose quotes closed just before `at`: the line's, or whitespace
/// (anything else leaves the quotes unbalanced).
fn closed(line: &[u8], at: usize) -> Result<usize, ProtocolError> {
    match line.get(at) {
        Some(&b) if !is_space(b) => Err(ProtocolError::Quotes),
        _ => Ok(at),
    }
}

/// C's `isspace`: what separates an inline command's words.
fn is_space(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\x0b' | b'\x0c' | b'\r')
}

/// Appends the word of `line` starting at `i` to `words`, unescaped (see
/// [`parse_inline`]); where it ends.
fn split_word(line: &[u8], mut i: usize, words: &mut Vec<u8>) -> Result<usize, ProtocolError> {
    loop {
        match line.get(i) {
            None | Some(b' ' | b'\t' | b'\r' | b'\n') => return Ok(i),
            Some(&quote @ (b'"' | b'\'')) => return quoted(line, i + 1, quote, words),
            Some(&c) => {
                words.push(c);
                i += 1;
            }
        }
    }
}

/// Appends the part of `line` inside `quote`s from `i` on to `words`, unescaped; where
/// the word ends, right after the closing quote.
fn quoted(
    line: &[u8],
    mut i: usize,
    quote: u8,
    words: &mut Vec<u8>,
) -> Result<usize, ProtocolError> {
    loop {
        let rest = &line[i.min(line.len())..];
        if rest.first() == Some(&quote) {
            return closed(line, i + 1);
        }
        let unit = match quote {
            b'"' => in_double_quotes(rest),
            _ => in_single_quotes(rest),
        };
        let (byte, len) = unit.ok_or(ProtocolError::Quotes)?;
        words.push(byte);
        i += len;
    }
}

/// The byte the start of `rest`, inside double quotes, stands for and how many bytes
/// say it: `\xHH`, C's escapes, any other byte after a backslash, or the byte itself;
/// `None` at the line's end.
fn in_double_quotes(rest: &[u8]) -> Option<(u8, usize)> {
    let hex = |b: &u8| char::from(*b).to_digit(16);
    match rest {
        [b'\\', b'x', h, l, ..] if hex(h).is_some() && hex(l).is_some() => {
            Some(((hex(h)? * 16 + hex(l)?) as u8, 4))
        }
        [b'\\', c, ..] => {
            let byte = match c {
                b'n' => b'\n',
                b'r' => b'\r',
                b't' => b'\t',
                b'b' => 0x08,
                b'a' => 0x07,
                c => *c,
            };
            Some((byte, 2))
        }
        [b'\\'] | [] => None,
        [c, ..] => Some((*c, 1)),
    }
}

/// [`in_double_quotes`] inside single quotes, where only `\'` is an escape.
fn in_single_quotes(rest: &[u8]) -> Option<(u8, usize)> {
    match rest {
        [b'\\', b'\'', ..] => Some((b'\'', 2)),
        [c, ..] => Some((*c, 1)),
        [] => None,
    }
}

/// The version of the protocol a connection's replies are in: RESP2 until the client
/// asks for RESP3 with `HELLO 3`. Requests read the same in both.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Proto {
    #[default]
    Resp2,
    Resp3,
}

impl Proto {
    /// Its number, as `HELLO` asks for it and `CLIENT LIST` shows it.
    pub fn version(self) -> u8 {
        match self {
            Proto::Resp2 => 2,
            Proto::Resp3 => 3,
        }
    }
}

/// Replies, appended to an output buffer.
pub mod reply {
    use super::Proto;
    use std::io::Write;

    pub fn simple(out: &mut Vec<u8>, s: &str) {
        out.push(b'+');
        out.extend_from_slice(s.as_bytes());
        out.extend_from_slice(b"\r\n");
    }

    /// An error reply; `msg` starts with its code (`ERR`, `WRONGTYPE`, …) as Redis's do.
    pub fn error(out: &mut Vec<u8>, msg: &str) {
        out.push(b'-');
        // An error is one line: a newline in it would frame the rest as a new reply.
        out.extend(
            msg.bytes()
                .map(|b| if b == b'\r' || b == b'\n' { b' ' } else { b }),
        );
        out.extend_from_slice(b"\r\n");
    }

    pub fn integer(out: &mut Vec<u8>, n: i64) {
        // Writing to a Vec cannot fail.
        let _ = write!(out, ":{n}\r\n");
    }

    pub fn bulk(out: &mut Vec<u8>, data: &[u8]) {
        bulk_header(out, data.len());
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    }

    /// The header of a bulk string of `len` bytes, for a caller that appends the bytes and
    /// the closing CRLF itself (reading them straight from storage).
    pub fn bulk_header(out: &mut Vec<u8>, len: usize) {
        let _ = write!(out, "${len}\r\n");
    }

    /// How long [`bulk_header`] is for `len` bytes: `$`, the digits, CRLF.
    pub fn bulk_header_len(len: usize) -> usize {
        1 + len.checked_ilog10().map_or(1, |d| d as usize + 1) + 2
    }

    /// No value (a missing key): RESP2's null bulk string, RESP3's null.
    pub fn null(out: &mut Vec<u8>, proto: Proto) {
        out.extend_from_slice(null_bytes(proto));
    }

    /// What [`null`] writes.
    pub fn null_bytes(proto: Proto) -> &'static [u8] {
        match proto {
            Proto::Resp2 => b"$-1\r\n",
            Proto::Resp3 => b"_\r\n",
        }
    }

    /// The header of `pairs` key-value pairs, which follow it: a RESP3 map, or in RESP2 an
    /// array of keys and values one after another.
    pub fn map(out: &mut Vec<u8>, pairs: usize, proto: Proto) {
        match proto {
            Proto::Resp2 => array(out, pairs * 2),
            Proto::Resp3 => {
                let _ = write!(out, "%{pairs}\r\n");
            }
        }
    }

    /// Text for people to read (`INFO`): a RESP3 verbatim string of format `txt`, or in
    /// RESP2 a bulk string.
    pub fn text(out: &mut Vec<u8>, text: &[u8], proto: Proto) {
        match proto {
            Proto::Resp2 => bulk(out, text),
            Proto::Resp3 => {
                let _ = write!(out, "={}\r\ntxt:", text.len() + 4);
                out.extend_from_slice(text);
                out.extend_from_slice(b"\r\n");
            }
        }
    }

    /// The header of a set of `len` items, which follow it: a RESP3 set, in RESP2 an array.
    pub fn set(out: &mut Vec<u8>, len: usize, proto: Proto) {
        match proto {
            Proto::Resp2 => array(out, len),
            Proto::Resp3 => {
                let _ = write!(out, "~{len}\r\n");
            }
        }
    }

    pub fn array(out: &mut Vec<u8>, len: usize) {
        let _ = write!(out, "*{len}\r\n");
    }

    /// `+OK`.
    pub fn ok(out: &mut Vec<u8>) {
        simple(out, "OK");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A whole request's length and arguments.
    type Words = Option<(usize, Vec<Vec<u8>>)>;

    fn words(buf: &[u8]) -> Result<Words, ProtocolError> {
        let (mut args, mut inline) = (Vec::new(), Vec::new());
        let n = parse(buf, &mut args, &mut inline, MAX_BULK)?;
        let from = if is_inline(buf) { &inline[..] } else { buf };
        Ok(n.map(|n| (n, args.iter().map(|r| from[r.clone()].to_vec()).collect())))
    }

    fn encode(args: &[Vec<u8>]) -> Vec<u8> {
        let mut out = Vec::new();
        reply::array(&mut out, args.len());
        for a in args {
            reply::bulk(&mut out, a);
        }
        out
    }

    #[test]
    fn arrays_of_bulk_strings() {
        let req = b"*3\r\n$3\r\nSET\r\n$1\r\nk\r\n$5\r\nv\r\nx!\r\n*1\r\n";
        let (n, w) = words(req).unwrap().unwrap();
        assert_eq!(n, 31);
        assert_eq!(w, [b"SET".to_vec(), b"k".to_vec(), b"v\r\nx!".to_vec()]);
        // Every proper prefix needs more bytes; the arguments that arrived whole are there.
        for cut in 0..n {
            assert_eq!(words(&req[..cut]), Ok(None), "cut at {cut}");
        }
        let mut args = Vec::new();
        assert_eq!(
            parse(&req[..20], &mut args, &mut Vec::new(), MAX_BULK),
            Ok(None)
        );
        assert_eq!(args, [8..11, 17..18]);
        // Once an argument's length has arrived, so has the request's least length.
        for (cut, known) in [
            (0, None),
            (4, None),
            (7, None),
            (8, Some((13, 8))),
            (22, None),
            (26, Some((31, 24))),
        ] {
            assert_eq!(
                parse(&req[..cut], &mut args, &mut Vec::new(), MAX_BULK),
                Ok(None)
            );
            let known = known.map(|(len, data)| Awaited { len, data });
            assert_eq!(awaited(&req[..cut], &args), known, "cut at {cut}");
        }
        assert_eq!(awaited(b"SET k", &[]), None);
    }

    #[test]
    fn inline_commands() {
        assert_eq!(
            words(b"set  k \"a b\"\r\nPING\n").unwrap().unwrap(),
            (14, vec![b"set".to_vec(), b"k".to_vec(), b"a b".to_vec()])
        );
        assert_eq!(
            words(b"PING\n").unwrap().unwrap(),
            (5, vec![b"PING".to_vec()])
        );
        assert_eq!(words(b"\r\n").unwrap().unwrap(), (2, vec![]));
        assert_eq!(words(b"PIN"), Ok(None));
        assert_eq!(words(b"GET \"k\n"), Err(ProtocolError::Quotes));
        // Escapes as Redis reads them: in double quotes C's and \xHH (else the byte
        // after the backslash), in single quotes only \'; quotes inside a word.
        let split = |line: &[u8]| words(line).map(|w| w.map(|(_, w)| w));
        assert_eq!(
            split(b"SET \"a\\tb\\x41\\x4g\\\"\\q\" 'it\\'s\\n'\n"),
            Ok(Some(vec![
                b"SET".to_vec(),
                b"a\tbAx4g\"q".to_vec(),
                b"it's\\n".to_vec()
            ]))
        );
        assert_eq!(
            split(b"a\"b c\"\x0bd'e'\n"),
            Ok(Some(vec![b"ab c".to_vec(), b"de".to_vec()]))
        );
        assert_eq!(split(b"\"\" ''\n"), Ok(Some(vec![vec![], vec![]])));
        // A NUL before the line's end: Redis never finds its end.
        assert_eq!(split(b"a\0b c\nPING\n"), Ok(None));
        for unbalanced in [
            &b"\"a\"b\n"[..],
            b"'a'b\n",
            b"\"a\\\"\n",
            b"'a\n",
            b"a\"b\"c\n",
        ] {
            assert_eq!(split(unbalanced), Err(ProtocolError::Quotes));
        }
    }

    #[test]
    fn malformed_requests() {
        assert_eq!(words(b"*x\r\n"), Err(ProtocolError::ArrayLength));
        assert_eq!(words(b"*2000000\r\n"), Err(ProtocolError::ArrayLength));
        assert_eq!(
            words(b"*1\r\n:3\r\n"),
            Err(ProtocolError::ExpectedBulk(b':'))
        );
        assert_eq!(
            ProtocolError::ExpectedBulk(b'+').to_string(),
            "Protocol error: expected '$', got '+'"
        );
        assert_eq!(words(b"*1\r\n$-1\r\n"), Err(ProtocolError::BulkLength));
        assert_eq!(
            words(b"*1\r\n$999999999999\r\n"),
            Err(ProtocolError::BulkLength)
        );
        assert_eq!(
            words(b"*1\r\n$1\r\nab\r\n"),
            Err(ProtocolError::MissingCrlf)
        );
        assert_eq!(
            words(&vec![b'a'; MAX_LINE + 1]),
            Err(ProtocolError::LineTooLong)
        );
    }

    #[test]
    fn replies() {
        let mut out = Vec::new();
        reply::ok(&mut out);
        reply::error(&mut out, "ERR two\r\nlines");
        reply::integer(&mut out, -3);
        reply::bulk(&mut out, b"hi");
        reply::null(&mut out, Proto::Resp2);
        reply::array(&mut out, 0);
        reply::map(&mut out, 1, Proto::Resp2);
        reply::text(&mut out, b"a:1\r\n", Proto::Resp2);
        assert_eq!(
            out,
            b"+OK\r\n-ERR two  lines\r\n:-3\r\n$2\r\nhi\r\n$-1\r\n*0\r\n*2\r\n$5\r\na:1\r\n\r\n"
        );
        // RESP3's own types, as redis-server 7 writes them after `HELLO 3`.
        let mut out = Vec::new();
        reply::null(&mut out, Proto::Resp3);
        reply::map(&mut out, 1, Proto::Resp3);
        reply::text(&mut out, b"a:1\r\n", Proto::Resp3);
        assert_eq!(out, b"_\r\n%1\r\n=9\r\ntxt:a:1\r\n\r\n");
    }

    proptest! {
        /// Any bytes: no panic, and a whole request never claims more than it was given.
        #[test]
        fn never_panics(buf in proptest::collection::vec(any::<u8>(), 0..200)) {
            let mut args = Vec::new();
            match parse(&buf, &mut args, &mut Vec::new(), 64) {
                Ok(Some(n)) => {
                    prop_assert!(n <= buf.len());
                    prop_assert!(args.iter().all(|r| r.end <= n));
                }
                Ok(None) => {
                    let _ = awaited(&buf, &args);
                }
                Err(_) => {}
            }
        }

        /// An encoded request parses back to its arguments, exactly its length, and needs
        /// more bytes when cut short, no more than it has in all.
        #[test]
        fn round_trip(
            args in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..40), 0..8),
            cut in any::<prop::sample::Index>(),
        ) {
            let req = encode(&args);
            prop_assert_eq!(words(&req).unwrap(), Some((req.len(), args)));
            let cut = cut.index(req.len());
            let mut parsed = Vec::new();
            prop_assert_eq!(parse(&req[..cut], &mut parsed, &mut Vec::new(), MAX_BULK), Ok(None));
            if let Some(a) = awaited(&req[..cut], &parsed) {
                prop_assert!(cut < a.len && a.len <= req.len());
                // The arriving argument's bytes, and its CRLF, are in the request.
                prop_assert!(a.data <= cut && a.data + 2 <= a.len);
            }
        }
    }
}
