//! An NBD initiator (client): the fixed newstyle handshake with `NBD_OPT_GO`, then simple
//! read and write requests, a value's requests in flight together on a connection.
//! Spec: the NBD protocol, <https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>.

use super::storage::{self, write_parts, BlockTarget};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943; // "NBDMAGIC"
const OPT_MAGIC: u64 = 0x4948_4156_454f_5054; // "IHAVEOPT"
const OLDSTYLE_MAGIC: u64 = 0x0000_4202_8186_1253;
const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
const REQUEST_MAGIC: u32 = 0x2560_9513;
const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;

/// Handshake flags (server) and client flags.
const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
const FLAG_NO_ZEROES: u16 = 1 << 1;

const OPT_GO: u32 = 7;
const REP_ACK: u32 = 1;
const REP_INFO: u32 = 3;
const REP_ERROR_BIT: u32 = 1 << 31;
const INFO_EXPORT: u16 = 0;
const INFO_BLOCK_SIZE: u16 = 3;

/// Transmission flags.
const FLAG_READ_ONLY: u16 = 1 << 1;
const FLAG_SEND_FLUSH: u16 = 1 << 2;
const FLAG_SEND_TRIM: u16 = 1 << 5;

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;
const CMD_TRIM: u16 = 4;

/// Largest request a client may send to a server that states no limit.
const DEFAULT_MAX_PAYLOAD: u32 = 32 << 20;
/// Longest option reply this client reads (export names and messages are short).
const MAX_OPTION_REPLY: u32 = 64 << 10;

/// Why the handshake failed.
#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    /// the connection failed
    #[error("{0}")]
    Io(#[from] io::Error),
    /// the server is not a fixed-newstyle NBD server
    #[error("not a fixed-newstyle NBD server")]
    NotNewstyle,
    /// the server answered an option with an error
    #[error("the server refused export `{export}`: {message} (error {code:#x})")]
    Refused {
        export: String,
        code: u32,
        message: String,
    },
    /// the export is read-only
    #[error("export `{0}` is read-only")]
    ReadOnly(String),
    /// the server broke the protocol
    #[error("protocol violation: {0}")]
    Protocol(&'static str),
    /// the server took the connection but did not go through the handshake in time
    #[error(
        "the server took the connection but did not answer the handshake within {0:?}: it \
         may serve no more clients (qemu-nbd serves one unless started with --shared=N, and \
         a running service holds its `connections`)"
    )]
    Silent(Duration),
}

/// How long a server that took the connection may take over the handshake: one that
/// serves no more clients (qemu-nbd at its `--shared` limit) takes it and says nothing,
/// and a start or `dpuflow kv inspect` would otherwise wait out the request timeout and
/// report only that a read timed out.
const HANDSHAKE_WAIT: Duration = Duration::from_secs(5);

/// What `NBD_OPT_GO` told of the export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Export {
    pub size: u64,
    pub flags: u16,
    /// Offsets and lengths of requests are multiples of this.
    pub min_block: u32,
    pub max_payload: u32,
}

/// One connection to an NBD export, in the transmission phase.
#[derive(Debug)]
pub struct NbdClient<S: Write = TcpStream> {
    stream: S,
    export: Export,
    cookie: u64,
}

/// A connection that can acknowledge what it receives at once. With several requests in
/// flight, qemu-nbd's small replies wait (Nagle) for the acknowledgement of the one
/// before, which a receiver delays up to 40 ms: a write of scattered blocks took 44 ms
/// where one at a time took 3. Linux keeps this quick mode only for a while, so it is
/// asked for before each reply is read (a system call: only when a run has several
/// requests).
pub trait QuickAck {
    fn quick_ack(&self);
}

impl QuickAck for TcpStream {
    fn quick_ack(&self) {
        use std::os::fd::AsFd;
        crate::sys::quick_ack(self.as_fd());
    }
}

/// What a request moves.
enum Transfer<'a> {
    Read(&'a mut [u8]),
    Write(&'a [u8]),
    Flush,
    /// This many bytes no longer hold data.
    Trim(u32),
}

/// A request of a run ([`NbdClient::run`]).
struct Request<'a> {
    offset: u64,
    transfer: Transfer<'a>,
    done: bool,
}

impl<'a> Request<'a> {
    fn new(offset: u64, transfer: Transfer<'a>) -> Request<'a> {
        Request {
            offset,
            transfer,
            done: false,
        }
    }
}

/// Most requests sent ahead on a connection: a value's pieces travel together, so a
/// request waits about one round trip rather than one a piece. qemu-nbd serves up to 16
/// at once on a connection.
const MAX_IN_FLIGHT: usize = 16;

fn get<const N: usize>(r: &mut impl Read) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn u16_of(r: &mut impl Read) -> io::Result<u16> {
    Ok(u16::from_be_bytes(get(r)?))
}

fn u32_of(r: &mut impl Read) -> io::Result<u32> {
    Ok(u32::from_be_bytes(get(r)?))
}

fn u64_of(r: &mut impl Read) -> io::Result<u64> {
    Ok(u64::from_be_bytes(get(r)?))
}

/// The `NBD_OPT_GO` option asking for `export` and its block sizes.
fn go_option(export: &str) -> Vec<u8> {
    let name = export.as_bytes();
    let mut data = Vec::with_capacity(8 + name.len());
    data.extend_from_slice(&(name.len() as u32).to_be_bytes());
    data.extend_from_slice(name);
    data.extend_from_slice(&1u16.to_be_bytes());
    data.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
    let mut opt = Vec::with_capacity(16 + data.len());
    opt.extend_from_slice(&OPT_MAGIC.to_be_bytes());
    opt.extend_from_slice(&OPT_GO.to_be_bytes());
    opt.extend_from_slice(&(data.len() as u32).to_be_bytes());
    opt.extend_from_slice(&data);
    opt
}

/// Runs the handshake on `s` for `export`, up to the transmission phase.
fn handshake(s: &mut (impl Read + Write), export: &str) -> Result<Export, NbdError> {
    if u64_of(s)? != INIT_MAGIC {
        return Err(NbdError::NotNewstyle);
    }
    let magic = u64_of(s)?;
    if magic == OLDSTYLE_MAGIC || magic != OPT_MAGIC {
        return Err(NbdError::NotNewstyle);
    }
    let server_flags = u16_of(s)?;
    if server_flags & FLAG_FIXED_NEWSTYLE == 0 {
        return Err(NbdError::NotNewstyle);
    }
    let client_flags = FLAG_FIXED_NEWSTYLE | (server_flags & FLAG_NO_ZEROES);
    s.write_all(&u32::from(client_flags).to_be_bytes())?;
    s.write_all(&go_option(export))?;
    s.flush()?;
    let mut info = None;
    let (mut min_block, mut max_payload) = (1, DEFAULT_MAX_PAYLOAD);
    loop {
        if u64_of(s)? != OPT_REPLY_MAGIC {
            return Err(NbdError::Protocol("bad option reply magic"));
        }
        if u32_of(s)? != OPT_GO {
            return Err(NbdError::Protocol("a reply to an option not asked"));
        }
        let kind = u32_of(s)?;
        let len = u32_of(s)?;
        if len > MAX_OPTION_REPLY {
            return Err(NbdError::Protocol("option reply too long"));
        }
        let mut data = vec![0u8; len as usize];
        s.read_exact(&mut data)?;
        match kind {
            REP_ACK => break,
            REP_INFO if data.len() >= 2 => {
                let d = &mut &data[..];
                match u16_of(d)? {
                    INFO_EXPORT if len == 12 => info = Some((u64_of(d)?, u16_of(d)?)),
                    INFO_BLOCK_SIZE if len == 14 => {
                        min_block = u32_of(d)?.max(1);
                        let _preferred = u32_of(d)?;
                        max_payload = u32_of(d)?;
                    }
                    // Other information (names, descriptions) is not needed.
                    _ => {}
                }
            }
            k if k & REP_ERROR_BIT != 0 => {
                return Err(NbdError::Refused {
                    export: export.to_owned(),
                    code: k,
                    message: String::from_utf8_lossy(&data).into_owned(),
                })
            }
            _ => return Err(NbdError::Protocol("unexpected option reply")),
        }
    }
    // The server must have sent NBD_INFO_EXPORT before its ACK of NBD_OPT_GO.
    let (size, flags) = info.ok_or(NbdError::Protocol("no export information"))?;
    if flags & FLAG_READ_ONLY != 0 {
        return Err(NbdError::ReadOnly(export.to_owned()));
    }
    // A maximum below the minimum, or below 4 KiB, is not usable; keep a whole number of
    // minimum blocks.
    let max_payload = max_payload.max(min_block.max(4096)) / min_block * min_block;
    Ok(Export {
        size,
        flags,
        min_block,
        max_payload,
    })
}

impl NbdClient {
    /// Connects to `export` at `addr`; a request that waits longer than `io_timeout` for
    /// the server to answer it, or to take what is sent, fails.
    pub fn connect(
        addr: SocketAddr,
        export: &str,
        io_timeout: Duration,
    ) -> Result<NbdClient, NbdError> {
        NbdClient::connect_waiting(addr, export, HANDSHAKE_WAIT, io_timeout)
    }

    /// [`NbdClient::connect`], the handshake given `wait`.
    fn connect_waiting(
        addr: SocketAddr,
        export: &str,
        wait: Duration,
        io_timeout: Duration,
    ) -> Result<NbdClient, NbdError> {
        let mut stream = storage::target_stream(addr, wait)?;
        let export = handshake(&mut stream, export).map_err(|e| match e {
            NbdError::Io(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                NbdError::Silent(wait)
            }
            e => e,
        })?;
        // A target that stops answering, or taking what is sent, fails the request instead
        // of hanging it forever.
        storage::set_timeouts(&stream, io_timeout)?;
        Ok(NbdClient {
            stream,
            export,
            cookie: 0,
        })
    }

    pub fn export(&self) -> Export {
        self.export
    }
}

impl<S: Write> NbdClient<S> {
    /// Sends request `cookie`'s header (and `data` for a write).
    fn send(
        &mut self,
        cookie: u64,
        kind: u16,
        offset: u64,
        len: u32,
        data: &[u8],
    ) -> io::Result<()> {
        let mut h = [0u8; 28];
        h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h[6..8].copy_from_slice(&kind.to_be_bytes());
        h[8..16].copy_from_slice(&cookie.to_be_bytes());
        h[16..24].copy_from_slice(&offset.to_be_bytes());
        h[24..28].copy_from_slice(&len.to_be_bytes());
        write_parts(&mut self.stream, [&h, data])
    }
}

impl<S: Read + Write + QuickAck> NbdClient<S> {
    /// Reads a simple reply's header: the cookie of the request it answers, or the errno
    /// the server reports for it.
    fn reply(&mut self) -> io::Result<(u64, io::Result<()>)> {
        let r: [u8; 16] = get(&mut self.stream)?;
        let magic = u32::from_be_bytes([r[0], r[1], r[2], r[3]]);
        let error = u32::from_be_bytes([r[4], r[5], r[6], r[7]]);
        let cookie = u64::from_be_bytes([r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]]);
        if magic != SIMPLE_REPLY_MAGIC {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "not an NBD reply",
            ));
        }
        let status = match error {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e as i32)),
        };
        Ok((cookie, status))
    }

    /// Runs `requests` to their replies with up to [`MAX_IN_FLIGHT`] of them sent ahead;
    /// the server may answer them in any order (NBD protocol, "Transmission phase"), each
    /// reply naming its request's cookie. The first failure ends the run (and the
    /// connection's use: replies may still be on their way).
    fn run(&mut self, requests: &mut [Request<'_>]) -> io::Result<()> {
        let base = self.cookie + 1;
        self.cookie += requests.len() as u64;
        let (mut sent, mut done) = (0usize, 0usize);
        while done < requests.len() {
            while sent < requests.len() && sent - done < MAX_IN_FLIGHT {
                let r = &requests[sent];
                let cookie = base + sent as u64;
                match &r.transfer {
                    Transfer::Read(buf) => {
                        self.send(cookie, CMD_READ, r.offset, buf.len() as u32, &[])?
                    }
                    Transfer::Write(data) => {
                        self.send(cookie, CMD_WRITE, r.offset, data.len() as u32, data)?
                    }
                    Transfer::Flush => self.send(cookie, CMD_FLUSH, 0, 0, &[])?,
                    Transfer::Trim(len) => self.send(cookie, CMD_TRIM, r.offset, *len, &[])?,
                }
                sent += 1;
            }
            if requests.len() > 1 {
                self.stream.quick_ack();
            }
            let (cookie, status) = self.reply()?;
            let r = cookie
                .checked_sub(base)
                .and_then(|i| requests[..sent].get_mut(usize::try_from(i).ok()?))
                .filter(|r| !r.done)
                .ok_or_else(|| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        "NBD reply to no request in flight",
                    )
                })?;
            status?;
            if let Transfer::Read(buf) = &mut r.transfer {
                self.stream.read_exact(buf)?;
            }
            r.done = true;
            done += 1;
        }
        Ok(())
    }

    /// Checks that `[offset, offset + len)` is aligned to the export's minimum block and
    /// inside it.
    fn check(&self, offset: u64, len: usize) -> io::Result<()> {
        let m = u64::from(self.export.min_block);
        let end = offset.checked_add(len as u64);
        if offset % m != 0 || len as u64 % m != 0 || end.is_none_or(|e| e > self.export.size) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "NBD request outside the export or not aligned to its block size",
            ));
        }
        Ok(())
    }
}

impl<S: Read + Write + QuickAck + Send + std::fmt::Debug> BlockTarget for NbdClient<S> {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_many(&[(offset, data)])
    }

    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let mut requests = Vec::new();
        for (offset, buf) in reads.iter_mut() {
            let max = self.export.max_payload as usize;
            self.check(*offset, buf.len())?;
            for (i, chunk) in buf.chunks_mut(max.max(1)).enumerate() {
                requests.push(Request::new(
                    *offset + (i * max) as u64,
                    Transfer::Read(chunk),
                ));
            }
        }
        self.run(&mut requests)
    }

    fn write_many(&mut self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        let mut requests = Vec::new();
        for (offset, data) in writes {
            let max = self.export.max_payload as usize;
            self.check(*offset, data.len())?;
            for (i, chunk) in data.chunks(max.max(1)).enumerate() {
                requests.push(Request::new(
                    *offset + (i * max) as u64,
                    Transfer::Write(chunk),
                ));
            }
        }
        self.run(&mut requests)
    }

    fn size(&self) -> u64 {
        self.export.size
    }

    /// NBD_CMD_FLUSH, when the server takes it (a server that does not has no volatile
    /// cache to write out).
    fn flush(&mut self) -> io::Result<()> {
        if self.export.flags & FLAG_SEND_FLUSH == 0 {
            return Ok(());
        }
        self.run(&mut [Request::new(0, Transfer::Flush)])
    }

    fn alignment(&self) -> u64 {
        u64::from(self.export.min_block)
    }

    fn discards(&self) -> bool {
        self.export.flags & FLAG_SEND_TRIM != 0
    }

    /// NBD_CMD_TRIM for each range (in pieces a 32-bit length holds), sent together.
    fn discard(&mut self, ranges: &[(u64, u64)]) -> io::Result<()> {
        if !self.discards() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the NBD export takes no trims",
            ));
        }
        let min = u64::from(self.export.min_block).max(1);
        let most = u64::from(u32::MAX) / min * min;
        let mut requests = Vec::new();
        for &(offset, len) in ranges {
            self.check(offset, usize::try_from(len).unwrap_or(usize::MAX))?;
            for (at, n) in storage::pieces(offset, len, most) {
                requests.push(Request::new(at, Transfer::Trim(n as u32)));
            }
        }
        self.run(&mut requests)
    }
}

impl<S: Write> Drop for NbdClient<S> {
    fn drop(&mut self) {
        // NBD_CMD_DISC has no reply; a server gone already is fine.
        self.cookie += 1;
        let _ = self.send(self.cookie, CMD_DISC, 0, 0, &[]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvcache::Script;
    use proptest::prelude::*;

    fn reply(out: &mut Vec<u8>, kind: u32, data: &[u8]) {
        out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
        out.extend_from_slice(&OPT_GO.to_be_bytes());
        out.extend_from_slice(&kind.to_be_bytes());
        out.extend_from_slice(&(data.len() as u32).to_be_bytes());
        out.extend_from_slice(data);
    }

    fn greeting() -> Vec<u8> {
        let mut s = Vec::new();
        s.extend_from_slice(&INIT_MAGIC.to_be_bytes());
        s.extend_from_slice(&OPT_MAGIC.to_be_bytes());
        s.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
        s
    }

    /// A server that takes the connection and says nothing (qemu-nbd with every client it
    /// serves taken) fails the connect with a reason, after the wait, not the request
    /// timeout.
    #[test]
    fn a_silent_server_fails_the_handshake_in_time() {
        let (addr, held) = crate::kvcache::silent_peer();
        let wait = Duration::from_millis(200);
        let started = std::time::Instant::now();
        let Err(e) = NbdClient::connect_waiting(addr, "kv", wait, wait) else {
            panic!("a handshake with a server that said nothing");
        };
        assert!(matches!(e, NbdError::Silent(w) if w == wait), "{e}");
        assert!(started.elapsed() < Duration::from_secs(5));
        assert!(e.to_string().contains("--shared"), "{e}");
        drop(held.join());
    }

    #[test]
    fn go_learns_the_export_size_and_block_sizes() {
        let mut s = greeting();
        let mut export = INFO_EXPORT.to_be_bytes().to_vec();
        export.extend_from_slice(&(1u64 << 30).to_be_bytes());
        export.extend_from_slice(&0x0005u16.to_be_bytes());
        reply(&mut s, REP_INFO, &export);
        let mut sizes = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        for v in [512u32, 4096, 1 << 20] {
            sizes.extend_from_slice(&v.to_be_bytes());
        }
        reply(&mut s, REP_INFO, &sizes);
        reply(&mut s, REP_ACK, &[]);
        let mut script = Script::new(s);
        let e = handshake(&mut script, "kv").unwrap();
        assert_eq!(
            e,
            Export {
                size: 1 << 30,
                flags: 5,
                min_block: 512,
                max_payload: 1 << 20
            }
        );
        let mut expect = 3u32.to_be_bytes().to_vec();
        expect.extend_from_slice(&go_option("kv"));
        assert_eq!(script.from_client, expect);
    }

    #[test]
    fn refusals_and_strangers_are_errors() {
        let mut s = greeting();
        reply(&mut s, REP_ERROR_BIT | 6, b"no such export");
        let mut script = Script::new(s);
        let e = handshake(&mut script, "nope").unwrap_err();
        assert!(
            matches!(&e, NbdError::Refused { message, .. } if message == "no such export"),
            "{e}"
        );
        let mut script = Script::new(b"HTTP/1.1 400 Bad Request\r\n\r\n".to_vec());
        assert!(matches!(
            handshake(&mut script, "kv"),
            Err(NbdError::NotNewstyle)
        ));
    }

    /// A client in the transmission phase, talking to `script`.
    fn client(script: Vec<u8>) -> NbdClient<Script> {
        NbdClient {
            stream: Script::new(script),
            export: Export {
                size: 1 << 20,
                flags: 0,
                min_block: 1,
                max_payload: 4,
            },
            cookie: 0,
        }
    }

    /// A simple reply to request `cookie`, with `error` and a read's `data`.
    fn simple(cookie: u64, error: u32, data: &[u8]) -> Vec<u8> {
        let mut r = SIMPLE_REPLY_MAGIC.to_be_bytes().to_vec();
        r.extend_from_slice(&error.to_be_bytes());
        r.extend_from_slice(&cookie.to_be_bytes());
        r.extend_from_slice(data);
        r
    }

    #[test]
    fn trims_go_together_and_only_to_an_export_that_takes_them() {
        let mut c = client(Vec::new());
        assert!(!c.discards());
        assert_eq!(
            c.discard(&[(0, 4)]).unwrap_err().kind(),
            io::ErrorKind::Unsupported
        );
        let mut s = simple(2, 0, b"");
        s.extend(simple(1, 0, b""));
        let mut c = client(s);
        c.export.flags = FLAG_SEND_TRIM;
        // A trim carries no payload, so the export's largest payload does not split it.
        c.discard(&[(512, 4096), (8192, 512)]).unwrap();
        let sent = &c.stream.from_client;
        assert_eq!(sent.len(), 2 * 28);
        let field = |r: usize, at: usize, n: usize| {
            sent[r * 28 + at..r * 28 + at + n]
                .iter()
                .fold(0u64, |v, &b| v << 8 | u64::from(b))
        };
        for (r, (offset, len)) in [(512, 4096), (8192, 512)].into_iter().enumerate() {
            assert_eq!(field(r, 6, 2), u64::from(CMD_TRIM));
            assert_eq!((field(r, 16, 8), field(r, 24, 4)), (offset, len));
        }
        assert!(
            c.discard(&[((1 << 20) - 512, 1024)]).is_err(),
            "past the end"
        );
    }

    #[test]
    fn requests_travel_together_and_replies_come_in_any_order() {
        // Two values' pieces (the server takes at most 4 bytes a request): three reads,
        // answered last first.
        let mut s = simple(3, 0, b"ij");
        s.extend(simple(1, 0, b"abcd"));
        s.extend(simple(2, 0, b"efgh"));
        let mut c = client(s);
        let (mut a, mut b) = ([0u8; 8], [0u8; 2]);
        c.read_many(&mut [(8, &mut a[..]), (100, &mut b[..])])
            .unwrap();
        assert_eq!((&a, &b), (b"abcdefgh", b"ij"));
        // All three requests went before any reply was read: cookies 1–3, their offsets
        // and lengths.
        let sent = &c.stream.from_client;
        assert_eq!(sent.len(), 3 * 28);
        for (i, (offset, len)) in [(8u64, 4u32), (12, 4), (100, 2)].into_iter().enumerate() {
            let h = &sent[i * 28..(i + 1) * 28];
            assert_eq!(h[6..8], CMD_READ.to_be_bytes());
            assert_eq!(h[8..16], (i as u64 + 1).to_be_bytes());
            assert_eq!(h[16..24], offset.to_be_bytes());
            assert_eq!(h[24..28], len.to_be_bytes());
        }
        // A write's data follows its header; cookies go on from the last run.
        let mut c = client([simple(2, 0, &[]), simple(1, 0, &[])].concat());
        c.write_many(&[(0, b"12345")]).unwrap();
        let sent = &c.stream.from_client;
        assert_eq!(sent[8..16], 1u64.to_be_bytes());
        assert_eq!(sent[28..32], *b"1234");
        assert_eq!(sent[32 + 8..32 + 16], 2u64.to_be_bytes());
        assert_eq!(sent[32 + 28..], *b"5");
    }

    #[test]
    fn a_reply_to_nothing_or_an_error_fails_the_run() {
        let mut c = client(simple(7, 0, &[]));
        let e = c.write_at(0, b"1").unwrap_err();
        assert!(e.to_string().contains("no request in flight"), "{e}");
        let mut c = client([simple(1, 0, &[]), simple(1, 0, &[])].concat());
        assert!(c.write_at(0, b"12345").is_err(), "a request answered twice");
        let mut c = client(simple(1, 5, &[]));
        let e = c.read_at(0, &mut [0; 4]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(5));
    }

    proptest! {
        /// Whatever option replies a server sends, well framed or not, the handshake ends
        /// (in an export or an error) without panicking.
        #[test]
        fn any_server_reply_is_survived(
            replies in proptest::collection::vec(
                (
                    prop_oneof![Just(REP_ACK), Just(REP_INFO), Just(REP_ERROR_BIT | 1), any::<u32>()],
                    proptest::collection::vec(any::<u8>(), 0..24),
                ),
                0..5,
            ),
            noise in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut s = greeting();
            for (kind, data) in &replies {
                reply(&mut s, *kind, data);
            }
            s.extend_from_slice(&noise);
            let _ = handshake(&mut Script::new(s), "kv");
        }

        /// Whatever a server replies to requests in flight, well framed or not, the run
        /// ends (done or failed) without panicking or reading past its buffers.
        #[test]
        fn any_transmission_reply_is_survived(
            replies in proptest::collection::vec(
                (0u64..5, prop_oneof![Just(0u32), any::<u32>()], proptest::collection::vec(any::<u8>(), 0..6)),
                0..6,
            ),
            noise in proptest::collection::vec(any::<u8>(), 0..40),
        ) {
            let mut s = Vec::new();
            for (cookie, error, data) in &replies {
                s.extend(simple(*cookie, *error, data));
            }
            s.extend_from_slice(&noise);
            let mut c = client(s);
            let (mut a, mut b) = ([0u8; 6], [0u8; 3]);
            let _ = c.read_many(&mut [(0, &mut a[..]), (64, &mut b[..])]);
        }
    }
}
