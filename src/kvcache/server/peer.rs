//! A connection to another Redis-protocol server the service sends requests to as a
//! client: a node of its cluster it hands keys over to, or where `MIGRATE` sends them.
//! Replies are read with bounded memory: a bulk string is passed over as it comes, and a
//! line longer than any reply's is refused.

use rustls::pki_types::ServerName;
use rustls::ClientConfig;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

use crate::kvcache::resp::reply;

/// The longest reply line read (an error's text, say): servers send short ones.
const LONGEST_LINE: usize = 64 << 10;

/// What a server answered a request.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Answer {
    /// `+OK` (or any status or number).
    Done,
    /// The null reply: `SET … NX` of a key the node holds already.
    Null,
    Error(String),
}

pub(super) trait Duplex: Read + Write + Send {}
impl<T: Read + Write + Send> Duplex for T {}

/// A connection to another server, and the bytes of its replies read but not yet taken.
pub(super) struct Peer {
    pub(super) stream: Box<dyn Duplex>,
    /// The connection's socket (under TLS, the one `stream` speaks it over).
    socket: TcpStream,
    buf: Vec<u8>,
    /// Where the next reply starts in `buf`.
    at: usize,
}

impl Peer {
    /// A connection to `node`, over TLS when `tls` is given (with the name the node's
    /// certificate must carry), waiting at most `timeout` for it and for each read and
    /// write.
    pub(super) fn connect(
        node: SocketAddr,
        tls: Option<(Arc<ClientConfig>, ServerName<'static>)>,
        timeout: Duration,
    ) -> io::Result<Peer> {
        let tcp = TcpStream::connect_timeout(&node, timeout)?;
        tcp.set_nodelay(true)?;
        let socket = tcp.try_clone()?;
        let stream: Box<dyn Duplex> = match tls {
            Some((config, name)) => {
                let conn = rustls::ClientConnection::new(config, name).map_err(io::Error::other)?;
                Box::new(rustls::StreamOwned::new(conn, tcp))
            }
            None => Box::new(tcp),
        };
        let peer = Peer {
            stream,
            socket,
            buf: Vec::new(),
            at: 0,
        };
        peer.wait_at_most(timeout)?;
        Ok(peer)
    }

    /// Waits at most `timeout` for each read and write from now on.
    pub(super) fn wait_at_most(&self, timeout: Duration) -> io::Result<()> {
        self.socket.set_read_timeout(Some(timeout))?;
        self.socket.set_write_timeout(Some(timeout))
    }

    /// Sends `AUTH password`; an error unless the node takes it.
    pub(super) fn auth(&mut self, password: &[u8]) -> io::Result<()> {
        let mut out = Vec::new();
        request(&mut out, [&b"AUTH"[..], password]);
        self.stream.write_all(&out)?;
        match self.answer()? {
            Answer::Done => Ok(()),
            other => Err(io::Error::other(format!("AUTH answered {other:?}"))),
        }
    }

    /// The next reply (RESP2 or RESP3): a status, a number, a null or an error; a bulk
    /// string's bytes are passed over.
    pub(super) fn answer(&mut self) -> io::Result<Answer> {
        let end = loop {
            if let Some(i) = self.buf[self.at..].windows(2).position(|w| w == b"\r\n") {
                break self.at + i;
            }
            if self.buf.len() - self.at > LONGEST_LINE {
                return Err(io::Error::other("a reply line without its end"));
            }
            self.fill()?;
        };
        // The kind by its first byte: a text made of bytes that are not UTF-8 has no
        // first character one byte long.
        let (kind, rest) = match self.buf[self.at..end].split_first() {
            Some((&k, rest)) => (k, String::from_utf8_lossy(rest).into_owned()),
            None => (0, String::new()),
        };
        self.at = end + 2;
        Ok(match kind {
            b'+' | b':' => Answer::Done,
            b'_' => Answer::Null,
            b'-' => Answer::Error(rest),
            b'$' => match rest.parse::<i64>() {
                Ok(n) if n < 0 => Answer::Null,
                Ok(n) => {
                    // Passed over as it comes, not kept.
                    let mut skip = n as u64 + 2;
                    loop {
                        let here = (self.buf.len() - self.at) as u64;
                        if here >= skip {
                            self.at += skip as usize;
                            break;
                        }
                        skip -= here;
                        self.at = self.buf.len();
                        self.fill()?;
                    }
                    Answer::Done
                }
                Err(_) => return Err(io::Error::other(format!("a reply of `${rest}`"))),
            },
            _ => {
                return Err(io::Error::other(format!(
                    "an unexpected reply `{}{rest}`",
                    kind as char
                )))
            }
        })
    }

    /// Reads more of the replies into `buf`, dropping those taken.
    fn fill(&mut self) -> io::Result<()> {
        self.buf.drain(..self.at);
        self.at = 0;
        let had = self.buf.len();
        self.buf.resize(had + (64 << 10), 0);
        let n = self.stream.read(&mut self.buf[had..])?;
        self.buf.truncate(had + n);
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        Ok(())
    }
}

/// Appends a request of `words` to `out`.
pub(super) fn request<'w>(out: &mut Vec<u8>, words: impl IntoIterator<Item = &'w [u8]>) {
    let words: Vec<&[u8]> = words.into_iter().collect();
    reply::array(out, words.len());
    for w in words {
        reply::bulk(out, w);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// A node's replies, read at most `chunk` bytes at a time.
    struct Trickle {
        bytes: Vec<u8>,
        at: usize,
        chunk: usize,
    }

    impl Read for Trickle {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            let n = buf.len().min(self.chunk).min(self.bytes.len() - self.at);
            buf[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
            self.at += n;
            Ok(n)
        }
    }

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    fn peer_of(bytes: Vec<u8>, chunk: usize) -> Peer {
        // A socket to stand for the connection's, on loopback: not read or written.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let socket = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        Peer {
            stream: Box::new(Trickle {
                bytes,
                at: 0,
                chunk,
            }),
            socket,
            buf: Vec::new(),
            at: 0,
        }
    }

    proptest! {
        /// Whatever a node sends back, each reply is read or refused, never a panic.
        #[test]
        fn any_bytes_back_are_survived(bytes in proptest::collection::vec(any::<u8>(), 0..300), chunk in 1usize..9) {
            let mut p = peer_of(bytes, chunk);
            for _ in 0..50 {
                if p.answer().is_err() {
                    break;
                }
            }
        }

        /// Replies are read as sent, however the connection splits them.
        #[test]
        fn replies_are_read_as_sent(
            kinds in proptest::collection::vec(0u8..5, 0..40),
            chunk in 1usize..9,
        ) {
            let mut bytes = Vec::new();
            let mut expected = Vec::new();
            for (i, kind) in kinds.iter().enumerate() {
                let (text, answer): (String, Answer) = match kind {
                    0 => ("+OK\r\n".into(), Answer::Done),
                    1 => ("$-1\r\n".into(), Answer::Null),
                    2 => (format!("-MOVED {i} 10.0.0.1:6379\r\n"), Answer::Error(format!("MOVED {i} 10.0.0.1:6379"))),
                    3 => (format!("${}\r\n{}\r\n", i, "x".repeat(i)), Answer::Done),
                    _ => (format!(":{i}\r\n"), Answer::Done),
                };
                bytes.extend_from_slice(text.as_bytes());
                expected.push(answer);
            }
            let mut p = peer_of(bytes, chunk);
            for e in expected {
                prop_assert_eq!(p.answer().unwrap(), e);
            }
            prop_assert!(p.answer().is_err());
        }
    }

    #[test]
    fn replies_are_read_whole() {
        let replies =
            b"+OK\r\n$-1\r\n_\r\n-MOVED 3999 127.0.0.1:7001\r\n$5\r\nhello\r\n:1\r\n-ERR no\r\n";
        let mut peer = peer_of(replies.to_vec(), 64 << 10);
        let answers: Vec<Answer> = (0..7).map(|_| peer.answer().unwrap()).collect();
        assert_eq!(
            answers,
            [
                Answer::Done,
                Answer::Null,
                Answer::Null,
                Answer::Error("MOVED 3999 127.0.0.1:7001".into()),
                Answer::Done,
                Answer::Done,
                Answer::Error("ERR no".into()),
            ]
        );
        assert!(peer.answer().is_err(), "the end of the stream");
        // A line that does not end is refused once too long to be a reply's.
        let mut endless = peer_of(vec![b'-'; 3 * LONGEST_LINE], 64 << 10);
        let e = endless.answer().unwrap_err();
        assert!(e.to_string().contains("without its end"), "{e}");
    }
}
