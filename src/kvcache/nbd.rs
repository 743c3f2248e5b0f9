//! An NBD initiator (client): the fixed newstyle handshake with `NBD_OPT_GO`, then simple
//! read and write requests, one at a time per connection.
//! Spec: the NBD protocol, <https://github.com/NetworkBlockDevice/nbd/blob/master/doc/proto.md>.

use super::storage::{write_both, BlockTarget};
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

const CMD_READ: u16 = 0;
const CMD_WRITE: u16 = 1;
const CMD_DISC: u16 = 2;
const CMD_FLUSH: u16 = 3;

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
}

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
pub struct NbdClient {
    stream: TcpStream,
    export: Export,
    cookie: u64,
}

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
    pub fn connect(addr: SocketAddr, export: &str) -> Result<NbdClient, NbdError> {
        let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
        stream.set_nodelay(true)?;
        // A target that stops answering fails the request instead of hanging it forever.
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        let export = handshake(&mut stream, export)?;
        Ok(NbdClient {
            stream,
            export,
            cookie: 0,
        })
    }

    pub fn export(&self) -> Export {
        self.export
    }

    /// Sends one request header (and `data` for a write).
    fn request(&mut self, kind: u16, offset: u64, len: u32, data: &[u8]) -> io::Result<u64> {
        self.cookie += 1;
        let mut h = [0u8; 28];
        h[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        h[6..8].copy_from_slice(&kind.to_be_bytes());
        h[8..16].copy_from_slice(&self.cookie.to_be_bytes());
        h[16..24].copy_from_slice(&offset.to_be_bytes());
        h[24..28].copy_from_slice(&len.to_be_bytes());
        write_both(&mut self.stream, &h, data)?;
        Ok(self.cookie)
    }

    /// Reads the simple reply to request `cookie`; an error the server reports becomes the
    /// errno it names.
    fn reply(&mut self, cookie: u64) -> io::Result<()> {
        let r: [u8; 16] = get(&mut self.stream)?;
        let magic = u32::from_be_bytes([r[0], r[1], r[2], r[3]]);
        let error = u32::from_be_bytes([r[4], r[5], r[6], r[7]]);
        let got = u64::from_be_bytes([r[8], r[9], r[10], r[11], r[12], r[13], r[14], r[15]]);
        if magic != SIMPLE_REPLY_MAGIC || got != cookie {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "NBD reply out of step",
            ));
        }
        match error {
            0 => Ok(()),
            e => Err(io::Error::from_raw_os_error(e as i32)),
        }
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

impl BlockTarget for NbdClient {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.check(offset, buf.len())?;
        let max = self.export.max_payload as usize;
        let mut at = offset;
        for chunk in buf.chunks_mut(max) {
            let cookie = self.request(CMD_READ, at, chunk.len() as u32, &[])?;
            self.reply(cookie)?;
            self.stream.read_exact(chunk)?;
            at += chunk.len() as u64;
        }
        Ok(())
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.check(offset, data.len())?;
        let max = self.export.max_payload as usize;
        let mut at = offset;
        for chunk in data.chunks(max) {
            let cookie = self.request(CMD_WRITE, at, chunk.len() as u32, chunk)?;
            self.reply(cookie)?;
            at += chunk.len() as u64;
        }
        Ok(())
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
        let cookie = self.request(CMD_FLUSH, 0, 0, &[])?;
        self.reply(cookie)
    }

    fn alignment(&self) -> u64 {
        u64::from(self.export.min_block)
    }
}

impl Drop for NbdClient {
    fn drop(&mut self) {
        // NBD_CMD_DISC has no reply; a server gone already is fine.
        let _ = self.request(CMD_DISC, 0, 0, &[]);
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
    }
}
