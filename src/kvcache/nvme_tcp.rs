//! An NVMe/TCP initiator (host). Each connection is a controller of its own: an admin
//! queue to connect, enable the controller and identify namespace 1, and one I/O queue
//! that reads and writes it, the commands of one request in flight together.
//!
//! Specs: NVMe/TCP Transport 1.0 (§3.3 PDU headers, §3.6 PDU layouts: ICReq/ICResp,
//! CapsuleCmd/CapsuleResp, H2CData/C2HData, R2T); NVMe over Fabrics 1.1 (§3.3 Connect, §3.4
//! Property Get/Set, §2.3 SGL descriptors); NVMe Base 2.0 (§3.1 CAP/CC/CSTS, §5.17
//! Identify, §5.27.1.5 Number of Queues); NVM Command Set 1.0 (§3.2.4 Read, §3.2.6 Write).
//! All fields are little-endian.

use super::storage::{self, write_parts, BlockTarget};
use crate::ir::NvmeDigests;
use crc32c::crc32c;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

/// PDU types (NVMe/TCP §3.6).
mod pdu {
    pub const IC_REQ: u8 = 0x00;
    pub const IC_RESP: u8 = 0x01;
    pub const C2H_TERM_REQ: u8 = 0x03;
    pub const CAPSULE_CMD: u8 = 0x04;
    pub const CAPSULE_RESP: u8 = 0x05;
    pub const H2C_DATA: u8 = 0x06;
    pub const C2H_DATA: u8 = 0x07;
    pub const R2T: u8 = 0x09;
    /// Flags of every PDU but ICReq, ICResp and the terminate requests: a header digest
    /// follows the header; a data digest follows the data.
    pub const HDGSTF: u8 = 0x01;
    pub const DDGSTF: u8 = 0x02;
    /// Flags of data PDUs: the last of a transfer; (C2H) no response capsule follows.
    pub const LAST_PDU: u8 = 0x04;
    pub const SUCCESS: u8 = 0x08;
}

const CH_LEN: usize = 8;
const SQE_LEN: usize = 64;
const CQE_LEN: usize = 16;
/// The header length of a CapsuleCmd (common header and command).
const CMD_HLEN: usize = CH_LEN + SQE_LEN;
/// The header length of data PDUs and R2T (common header and 16 bytes).
const DATA_HLEN: usize = 24;
/// A header or data digest: the CRC32C of what it covers (NVMe/TCP Transport 1.0, "PDU
/// Header and Data Digests"), sent least significant byte first.
const DIGEST_LEN: usize = 4;

fn digest(bytes: &[u8]) -> [u8; DIGEST_LEN] {
    crc32c(bytes).to_le_bytes()
}

const OPC_FABRICS: u8 = 0x7f;
const FCTYPE_PROPERTY_SET: u8 = 0x00;
const FCTYPE_CONNECT: u8 = 0x01;
const FCTYPE_PROPERTY_GET: u8 = 0x04;
const OPC_IDENTIFY: u8 = 0x06;
const OPC_SET_FEATURES: u8 = 0x09;
const OPC_FLUSH: u8 = 0x00;
const OPC_WRITE: u8 = 0x01;
const OPC_READ: u8 = 0x02;
const OPC_DATASET_MANAGEMENT: u8 = 0x09;
const FEATURE_NUMBER_OF_QUEUES: u32 = 0x07;
/// Command flags: PSDT 01b, SGLs (the only data pointers fabrics take).
const FLAGS_SGL: u8 = 0x40;
/// SGL identifiers: a data block at an offset in the capsule; data moved by the transport
/// (C2HData, or H2CData on R2T).
const SGL_IN_CAPSULE: u8 = 0x01;
const SGL_TRANSPORT: u8 = 0x5a;

/// Controller properties (NVMe Base §3.1).
const PROP_CAP: u32 = 0x00;
const PROP_CC: u32 = 0x14;
const PROP_CSTS: u32 = 0x1c;

/// The namespace the service stores into.
const NSID: u32 = 1;
/// Largest transfer of one command, whatever the controller allows.
const MAX_TRANSFER: usize = 1 << 20;
/// Most commands in flight on the I/O queue: a value's pieces travel together, so a
/// request waits about one round trip to the target rather than one a piece.
const MAX_IN_FLIGHT: usize = 32;

/// A 64-byte submission queue entry, built field by field.
#[derive(Clone, Copy)]
struct Sqe([u8; SQE_LEN]);

impl Sqe {
    fn new(opcode: u8) -> Sqe {
        let mut b = [0u8; SQE_LEN];
        b[0] = opcode;
        b[1] = FLAGS_SGL;
        Sqe(b)
    }

    fn fabrics(fctype: u8) -> Sqe {
        let mut s = Sqe::new(OPC_FABRICS);
        s.0[4] = fctype;
        s
    }

    fn u8_at(mut self, at: usize, v: u8) -> Sqe {
        self.0[at] = v;
        self
    }

    fn u16_at(mut self, at: usize, v: u16) -> Sqe {
        self.0[at..at + 2].copy_from_slice(&v.to_le_bytes());
        self
    }

    fn u32_at(mut self, at: usize, v: u32) -> Sqe {
        self.0[at..at + 4].copy_from_slice(&v.to_le_bytes());
        self
    }

    fn u64_at(mut self, at: usize, v: u64) -> Sqe {
        self.0[at..at + 8].copy_from_slice(&v.to_le_bytes());
        self
    }

    fn nsid(self, nsid: u32) -> Sqe {
        self.u32_at(4, nsid)
    }

    /// Command dword `n` (10–15).
    fn cdw(self, n: usize, v: u32) -> Sqe {
        self.u32_at(n * 4, v)
    }
}

/// Data moved by a command.
enum Data<'a> {
    None,
    /// Controller to host (C2HData).
    In(&'a mut [u8]),
    /// Host to controller, when the controller asks (R2T, then H2CData).
    Out(&'a [u8]),
    /// Host to controller inside the command capsule.
    Capsule(&'a [u8]),
}

/// A command of a run ([`Queue::run`]): what it asks, the data it moves, and its
/// completion's first two dwords once it has completed.
struct Command<'a> {
    sqe: Sqe,
    data: Data<'a>,
    result: Option<u64>,
}

impl<'a> Command<'a> {
    fn new(sqe: Sqe, data: Data<'a>) -> Command<'a> {
        Command {
            sqe,
            data,
            result: None,
        }
    }
}

/// A completion: its first two dwords (command specific) and status.
#[derive(Debug, Clone, Copy)]
struct Cqe {
    result: u64,
}

fn protocol(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, format!("NVMe/TCP: {what}"))
}

/// A read that found the connection closed, said as such: a controller ends a queue it
/// finds in error (a digest that does not match, a PDU it refuses) by closing it, and
/// logs why on its side.
fn closed(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::UnexpectedEof {
        io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "NVMe/TCP: the controller closed the connection (its log says why)",
        )
    } else {
        e
    }
}

/// One queue: a connection (TCP, or a test's script) in the state after ICReq/ICResp.
#[derive(Debug)]
struct Queue<S = TcpStream> {
    stream: S,
    /// Largest H2CData payload the controller takes.
    max_h2c: usize,
    cid: u16,
    /// The digests this connection's PDUs carry, as ICReq asked and ICResp agreed.
    digests: NvmeDigests,
}

impl Queue {
    /// Connects and exchanges ICReq/ICResp, asking for `digests`. A read or write that
    /// waits longer than `io_timeout` for the controller fails.
    fn open(addr: SocketAddr, digests: NvmeDigests, io_timeout: Duration) -> io::Result<Queue> {
        Queue::start(storage::target_stream(addr, io_timeout)?, digests)
    }
}

impl<S: Read + Write> Queue<S> {
    /// Exchanges ICReq/ICResp on `stream`: `digests` (DGST, byte 11: bit 0 header, bit 1
    /// data), data at any offset, one R2T outstanding. A controller that enables other
    /// digests than asked for is refused: asked-for integrity is not silently dropped.
    fn start(mut stream: S, digests: NvmeDigests) -> io::Result<Queue<S>> {
        let mut req = [0u8; 128];
        req[..8].copy_from_slice(&common_header(pdu::IC_REQ, 0, 128, 0, 128));
        let dgst = u8::from(digests.header) | u8::from(digests.data) << 1;
        req[11] = dgst;
        stream.write_all(&req)?;
        let mut resp = [0u8; 128];
        stream.read_exact(&mut resp).map_err(closed)?;
        let plen = u32::from_le_bytes([resp[4], resp[5], resp[6], resp[7]]);
        if resp[0] != pdu::IC_RESP || resp[2] != 128 || plen != 128 {
            return Err(protocol("not an ICResp"));
        }
        // pfv 0 (version 1.0), cpda 0 (data right after headers).
        if resp[8..11] != [0, 0, 0] {
            return Err(protocol("the controller wants another version or padding"));
        }
        if resp[11] != dgst {
            return Err(protocol(&format!(
                "digests asked for {dgst:#x} (bit 0 header, bit 1 data), the controller enabled {:#x}",
                resp[11]
            )));
        }
        let max_h2c = u32::from_le_bytes([resp[12], resp[13], resp[14], resp[15]]);
        Ok(Queue {
            stream,
            max_h2c: (max_h2c as usize).max(4096),
            cid: 0,
            digests,
        })
    }

    /// Runs one command to its completion.
    fn command(&mut self, sqe: Sqe, data: Data<'_>) -> io::Result<Cqe> {
        let mut one = [Command::new(sqe, data)];
        self.run(&mut one, 1)?;
        Ok(Cqe {
            result: one[0].result.unwrap_or(0),
        })
    }

    /// Runs `cmds` to their completions with up to `window` of them in flight: the next
    /// is sent as soon as one completes, and each PDU that comes back goes to the command
    /// its CID names, in whatever order the controller finishes them (NVMe/TCP §3.3:
    /// a queue's commands may complete out of order). The first failure ends the run;
    /// commands then still in flight leave the queue unusable, as any I/O error does.
    fn run(&mut self, cmds: &mut [Command<'_>], window: usize) -> io::Result<()> {
        let base = self.cid.wrapping_add(1);
        self.cid = self.cid.wrapping_add(cmds.len() as u16);
        let (mut sent, mut done) = (0usize, 0usize);
        while done < cmds.len() {
            while sent < cmds.len() && sent - done < window.max(1) {
                self.submit(base.wrapping_add(sent as u16), &cmds[sent])?;
                sent += 1;
            }
            if self.receive(&mut cmds[..sent], base)? {
                done += 1;
            }
        }
        Ok(())
    }

    /// Sends `cmd` as command `cid`: its capsule, with a write's data when it travels
    /// inside.
    fn submit(&mut self, cid: u16, cmd: &Command<'_>) -> io::Result<()> {
        let (len, sgl) = match &cmd.data {
            Data::None => (0, SGL_TRANSPORT),
            Data::In(b) => (b.len(), SGL_TRANSPORT),
            Data::Out(b) => (b.len(), SGL_TRANSPORT),
            Data::Capsule(b) => (b.len(), SGL_IN_CAPSULE),
        };
        // SGL1 (bytes 24–39): address 0 (offset 0 in the capsule), length, identifier.
        let sqe = cmd
            .sqe
            .u16_at(2, cid)
            .u64_at(24, 0)
            .u32_at(32, len as u32)
            .u8_at(39, sgl);
        let capsule: &[u8] = match &cmd.data {
            Data::Capsule(b) => b,
            _ => &[],
        };
        let (hd, dd) = self.digest_lens(!capsule.is_empty());
        let pdo = if capsule.is_empty() {
            0
        } else {
            (CMD_HLEN + hd) as u8
        };
        let plen = (CMD_HLEN + hd + capsule.len() + dd) as u32;
        let mut head = [0u8; CMD_HLEN + DIGEST_LEN];
        head[..CH_LEN].copy_from_slice(&common_header(
            pdu::CAPSULE_CMD,
            digest_flags(hd, dd),
            CMD_HLEN as u8,
            pdo,
            plen,
        ));
        head[CH_LEN..CMD_HLEN].copy_from_slice(&sqe.0);
        self.send_pdu(&mut head, CMD_HLEN, capsule)
    }

    /// The header and data digest lengths of a PDU sent or received on this connection,
    /// the data digest only for one that carries data.
    fn digest_lens(&self, has_data: bool) -> (usize, usize) {
        let len = |on: bool| if on { DIGEST_LEN } else { 0 };
        (len(self.digests.header), len(self.digests.data && has_data))
    }

    /// Sends a PDU: its header (the first `hlen` bytes of `head`, which has room for the
    /// header digest after it), then `data`, with the digests this connection carries.
    fn send_pdu(&mut self, head: &mut [u8], hlen: usize, data: &[u8]) -> io::Result<()> {
        let (hd, dd) = self.digest_lens(!data.is_empty());
        if hd > 0 {
            let d = digest(&head[..hlen]);
            head[hlen..hlen + hd].copy_from_slice(&d);
        }
        let data_digest = if dd > 0 {
            digest(data)
        } else {
            [0; DIGEST_LEN]
        };
        write_parts(
            &mut self.stream,
            [&head[..hlen + hd], data, &data_digest[..dd]],
        )
    }

    /// Reads one PDU and acts on it for the command it names among `cmds`, sent as CIDs
    /// from `base` on: data into a read's buffer, a write's data sent for an R2T, a
    /// completion noted. Whether it completed a command.
    fn receive(&mut self, cmds: &mut [Command<'_>], base: u16) -> io::Result<bool> {
        let ch: [u8; CH_LEN] = read_array(&mut self.stream).map_err(closed)?;
        let (kind, flags, hlen, pdo) = (ch[0], ch[1], usize::from(ch[2]), usize::from(ch[3]));
        let plen = u32::from_le_bytes([ch[4], ch[5], ch[6], ch[7]]) as usize;
        if hlen < CH_LEN || plen < hlen || (pdo != 0 && (pdo < hlen || pdo > plen)) {
            return Err(protocol("malformed PDU header"));
        }
        // Terminate requests carry no digest.
        let hd = match kind {
            pdu::C2H_TERM_REQ => 0,
            _ => self.digest_lens(false).0,
        };
        let mut header = vec![0u8; hlen + hd];
        header[..CH_LEN].copy_from_slice(&ch);
        self.stream.read_exact(&mut header[CH_LEN..])?;
        if hd > 0 && header[hlen..] != digest(&header[..hlen]) {
            return Err(protocol("header digest mismatch"));
        }
        let le16 = |at: usize| u16::from_le_bytes([header[at], header[at + 1]]);
        let le32 = |at: usize| {
            u32::from_le_bytes([header[at], header[at + 1], header[at + 2], header[at + 3]])
                as usize
        };
        // The command in flight a CID names.
        let pending = |cmds: &mut [Command<'_>], cid: u16| {
            let i = usize::from(cid.wrapping_sub(base));
            match cmds.get(i) {
                Some(c) if c.result.is_none() => Ok(i),
                _ => Err(protocol("a PDU for no command in flight")),
            }
        };
        match kind {
            pdu::CAPSULE_RESP if hlen == CH_LEN + CQE_LEN && plen == hlen + hd => {
                let cqe = &header[CH_LEN..CH_LEN + CQE_LEN];
                let i = pending(cmds, u16::from_le_bytes([cqe[12], cqe[13]]))?;
                let status = u16::from_le_bytes([cqe[14], cqe[15]]) >> 1;
                if status & 0x7ff != 0 {
                    return Err(io::Error::other(format!(
                        "NVMe command {:#04x} failed: status type {}, code {:#04x}",
                        cmds[i].sqe.0[0],
                        (status >> 8) & 7,
                        status & 0xff
                    )));
                }
                let mut result = [0u8; 8];
                result.copy_from_slice(&cqe[..8]);
                cmds[i].result = Some(u64::from_le_bytes(result));
                Ok(true)
            }
            pdu::C2H_DATA if hlen == DATA_HLEN => {
                let (offset, dlen) = (le32(12), le32(16));
                let i = pending(cmds, le16(8))?;
                let Data::In(buf) = &mut cmds[i].data else {
                    return Err(protocol("data for a command that reads none"));
                };
                let (_, dd) = self.digest_lens(true);
                let start = if pdo == 0 { hlen + hd } else { pdo };
                if start < hlen + hd || start + dlen + dd != plen || offset + dlen > buf.len() {
                    return Err(protocol("C2HData outside its command's buffer"));
                }
                skip(&mut self.stream, start - hlen - hd)?;
                let data = &mut buf[offset..offset + dlen];
                self.stream.read_exact(data)?;
                if dd > 0 && read_array::<DIGEST_LEN>(&mut self.stream)? != digest(data) {
                    return Err(protocol("data digest mismatch"));
                }
                // SUCCESS on the last PDU: the command completed, no response follows.
                if flags & pdu::SUCCESS != 0 && flags & pdu::LAST_PDU != 0 {
                    cmds[i].result = Some(0);
                    return Ok(true);
                }
                Ok(false)
            }
            pdu::R2T if hlen == DATA_HLEN && plen == hlen + hd => {
                let (ttag, offset, rlen) = (le16(10), le32(12), le32(16));
                let cid = le16(8);
                let i = pending(cmds, cid)?;
                let Data::Out(buf) = &cmds[i].data else {
                    return Err(protocol("R2T for a command that writes none"));
                };
                if offset + rlen > buf.len() {
                    return Err(protocol("R2T outside its command's buffer"));
                }
                let buf: &[u8] = buf;
                self.send_h2c(cid, ttag, offset, &buf[offset..offset + rlen])?;
                Ok(false)
            }
            pdu::C2H_TERM_REQ if hlen >= 10 => Err(protocol(&format!(
                "the controller ended the connection (error {:#x})",
                le16(8)
            ))),
            _ => Err(protocol(&format!("unexpected PDU type {kind:#04x}"))),
        }
    }

    /// Sends `data` (the transfer's bytes from `offset`) in H2CData PDUs no larger than the
    /// controller takes, the last flagged.
    fn send_h2c(&mut self, cid: u16, ttag: u16, offset: usize, data: &[u8]) -> io::Result<()> {
        let chunks = data.chunks(self.max_h2c);
        let n = chunks.len();
        for (i, chunk) in chunks.enumerate() {
            let flags = if i + 1 == n { pdu::LAST_PDU } else { 0 };
            let at = offset + i * self.max_h2c;
            let (hd, dd) = self.digest_lens(true);
            let mut head = [0u8; DATA_HLEN + DIGEST_LEN];
            head[..CH_LEN].copy_from_slice(&common_header(
                pdu::H2C_DATA,
                flags | digest_flags(hd, dd),
                DATA_HLEN as u8,
                (DATA_HLEN + hd) as u8,
                (DATA_HLEN + hd + chunk.len() + dd) as u32,
            ));
            head[8..10].copy_from_slice(&cid.to_le_bytes());
            head[10..12].copy_from_slice(&ttag.to_le_bytes());
            head[12..16].copy_from_slice(&(at as u32).to_le_bytes());
            head[16..20].copy_from_slice(&(chunk.len() as u32).to_le_bytes());
            self.send_pdu(&mut head, DATA_HLEN, chunk)?;
        }
        Ok(())
    }

    /// Fabrics Connect for queue `qid` of `sqsize` entries to controller `cntlid` (0xffff:
    /// any, for the admin queue); the controller's ID. Keep-alive off (KATO 0).
    fn connect(
        &mut self,
        host: &Host,
        subnqn: &str,
        qid: u16,
        sqsize: u16,
        cntlid: u16,
    ) -> io::Result<u16> {
        let mut data = [0u8; 1024];
        data[..16].copy_from_slice(&host.id);
        data[16..18].copy_from_slice(&cntlid.to_le_bytes());
        put_nqn(&mut data[256..512], subnqn)?;
        put_nqn(&mut data[512..768], &host.nqn)?;
        let sqe = Sqe::fabrics(FCTYPE_CONNECT)
            .u16_at(42, qid)
            .u16_at(44, sqsize.saturating_sub(1));
        let cqe = self.command(sqe, Data::Capsule(&data))?;
        Ok(cqe.result as u16)
    }

    fn property_get(&mut self, offset: u32, eight: bool) -> io::Result<u64> {
        let sqe = Sqe::fabrics(FCTYPE_PROPERTY_GET)
            .u8_at(40, u8::from(eight))
            .u32_at(44, offset);
        Ok(self.command(sqe, Data::None)?.result)
    }

    fn property_set(&mut self, offset: u32, value: u32) -> io::Result<()> {
        let sqe = Sqe::fabrics(FCTYPE_PROPERTY_SET)
            .u32_at(44, offset)
            .u64_at(48, u64::from(value));
        self.command(sqe, Data::None).map(|_| ())
    }
}

/// The flags that say a PDU carries a header digest (`hd` bytes of it) and a data digest.
fn digest_flags(hd: usize, dd: usize) -> u8 {
    (if hd > 0 { pdu::HDGSTF } else { 0 }) | (if dd > 0 { pdu::DDGSTF } else { 0 })
}

fn common_header(kind: u8, flags: u8, hlen: u8, pdo: u8, plen: u32) -> [u8; CH_LEN] {
    let p = plen.to_le_bytes();
    [kind, flags, hlen, pdo, p[0], p[1], p[2], p[3]]
}

fn read_array<const N: usize>(r: &mut impl Read) -> io::Result<[u8; N]> {
    let mut b = [0u8; N];
    r.read_exact(&mut b)?;
    Ok(b)
}

fn skip(r: &mut impl Read, n: usize) -> io::Result<()> {
    io::copy(&mut r.take(n as u64), &mut io::sink()).map(|_| ())
}

/// An NQN, NUL-padded into its 256-byte field.
fn put_nqn(field: &mut [u8], nqn: &str) -> io::Result<()> {
    if nqn.len() >= field.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "NQN too long"));
    }
    field[..nqn.len()].copy_from_slice(nqn.as_bytes());
    Ok(())
}

/// Who this host is to the controller: a random host ID, and the NQN made from it.
#[derive(Debug, Clone)]
struct Host {
    id: [u8; 16],
    nqn: String,
}

impl Host {
    /// One identity for the whole process: every connection is the same host.
    fn get() -> &'static Host {
        static HOST: std::sync::OnceLock<Host> = std::sync::OnceLock::new();
        HOST.get_or_init(|| {
            use std::hash::BuildHasher;
            let seed = std::collections::hash_map::RandomState::new();
            let mut id = [0u8; 16];
            id[..8].copy_from_slice(&seed.hash_one(1u8).to_le_bytes());
            id[8..].copy_from_slice(&seed.hash_one(2u8).to_le_bytes());
            // A version 4 UUID (RFC 9562 §5.4).
            id[6] = id[6] & 0x0f | 0x40;
            id[8] = id[8] & 0x3f | 0x80;
            let h: String = id.iter().map(|b| format!("{b:02x}")).collect();
            let nqn = format!(
                "nqn.2014-08.org.nvmexpress:uuid:{}-{}-{}-{}-{}",
                &h[..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..]
            );
            Host { id, nqn }
        })
    }
}

/// A controller on an NVMe/TCP target, with namespace 1 to read and write.
#[derive(Debug)]
pub struct NvmeTcpClient {
    /// Kept open: closing the admin queue ends the controller.
    _admin: Queue,
    io: Queue,
    lba: u64,
    size: u64,
    max_transfer: usize,
    /// Commands kept in flight on the I/O queue: one less than its entries (a full queue
    /// would look empty), at most [`MAX_IN_FLIGHT`].
    window: usize,
    /// Writes up to this long travel inside the command capsule (no R2T round trip, as
    /// Linux's host does; nvmet waits for such writes' data in the capsule).
    in_capsule: usize,
    volatile_cache: bool,
    /// The controller takes Dataset Management (ONCS bit 2), by which ranges are
    /// deallocated.
    deallocates: bool,
}

impl NvmeTcpClient {
    /// Connects to subsystem `nqn` at `addr`: admin queue, controller enabled, namespace 1
    /// identified, one I/O queue; a command that waits longer than `io_timeout` for the
    /// controller fails.
    pub fn connect(
        addr: SocketAddr,
        nqn: &str,
        digests: NvmeDigests,
        io_timeout: Duration,
    ) -> io::Result<NvmeTcpClient> {
        let host = Host::get();
        let mut admin = Queue::open(addr, digests, io_timeout)?;
        let cntlid = admin.connect(host, nqn, 0, 32, 0xffff)?;
        let cap = admin.property_get(PROP_CAP, true)?;
        let entries = (cap & 0xffff) + 1;
        let ready_within = Duration::from_millis(((cap >> 24) & 0xff).max(1) * 500);
        let page = 4096u64 << ((cap >> 48) & 0xf);
        // CC: EN, with 64-byte submission and 16-byte completion entries.
        admin.property_set(PROP_CC, 1 | 6 << 16 | 4 << 20)?;
        let since = Instant::now();
        while admin.property_get(PROP_CSTS, false)? & 1 == 0 {
            if since.elapsed() > ready_within {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    "the NVMe controller never became ready",
                ));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut id = vec![0u8; 4096];
        admin.command(Sqe::new(OPC_IDENTIFY).cdw(10, 1), Data::In(&mut id))?;
        let mdts = id[77];
        // VWC (byte 525, bit 0): a volatile write cache, which Flush writes out.
        let volatile_cache = id[525] & 1 != 0;
        // ONCS (bytes 520–521), bit 2: the Dataset Management command.
        let deallocates = id[520] & 1 << 2 != 0;
        // IOCCSZ (bytes 1792–1795): the I/O command capsule's size in 16-byte units, the
        // command included; the rest carries a write's data in the capsule.
        let ioccsz = u32::from_le_bytes([id[1792], id[1793], id[1794], id[1795]]) as usize;
        let in_capsule = (ioccsz * 16).saturating_sub(SQE_LEN);
        let max_transfer = match mdts {
            0 => MAX_TRANSFER,
            m => ((page << m.min(20)) as usize).min(MAX_TRANSFER),
        };
        admin.command(
            Sqe::new(OPC_IDENTIFY).nsid(NSID).cdw(10, 0),
            Data::In(&mut id),
        )?;
        let blocks = u64::from_le_bytes(id[..8].try_into().map_err(|_| protocol("identify"))?);
        if blocks == 0 {
            return Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("{nqn} has no namespace {NSID}"),
            ));
        }
        let format = usize::from(id[26] & 0x0f | (id[26] >> 1) & 0x30);
        let lbads = id[128 + 4 * format + 2];
        if !(9..=16).contains(&lbads) {
            return Err(protocol("unusable LBA size"));
        }
        let lba = 1u64 << lbads;
        // One I/O submission and completion queue (values are zero-based).
        admin.command(
            Sqe::new(OPC_SET_FEATURES)
                .cdw(10, FEATURE_NUMBER_OF_QUEUES)
                .cdw(11, 0),
            Data::None,
        )?;
        let mut io = Queue::open(addr, digests, io_timeout)?;
        let depth = entries.min(128) as u16;
        io.connect(host, nqn, 1, depth, cntlid)?;
        Ok(NvmeTcpClient {
            _admin: admin,
            io,
            lba,
            size: blocks * lba,
            max_transfer: max_transfer / lba as usize * lba as usize,
            window: usize::from(depth - 1).clamp(1, MAX_IN_FLIGHT),
            in_capsule,
            volatile_cache,
            deallocates,
        })
    }

    /// The first LBA and count of `len` bytes at `offset`, both whole LBAs.
    fn lbas(&self, offset: u64, len: usize) -> io::Result<(u64, u32)> {
        lbas_of(offset, len as u64, self.lba, self.size)
    }
}

/// The first LBA and count of `len` bytes at `offset` of a namespace of `size` bytes in
/// LBAs of `lba` bytes: whole LBAs, inside it, and a count a command can carry.
fn lbas_of(offset: u64, len: u64, lba: u64, size: u64) -> io::Result<(u64, u32)> {
    let end = offset.checked_add(len);
    if offset % lba != 0
        || len % lba != 0
        || end.is_none_or(|e| e > size)
        || len / lba > u64::from(u32::MAX)
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "NVMe I/O outside the namespace or not in whole LBAs",
        ));
    }
    Ok((offset / lba, (len / lba) as u32))
}

/// Most ranges a Dataset Management command carries (NR is 8 bits, zero-based).
const RANGES_PER_COMMAND: usize = 256;
/// A range's descriptor: context attributes, length in LBAs, starting LBA (NVM Command
/// Set §3.2.3, Figure "Dataset Management – Range Definition").
const RANGE_LEN: usize = 16;

/// The range lists of the Dataset Management commands that deallocate `ranges` (offset
/// and length in bytes) of a namespace of `size` bytes in LBAs of `lba` bytes: one list a
/// command, a range longer than a descriptor holds split.
fn deallocations(ranges: &[(u64, u64)], lba: u64, size: u64) -> io::Result<Vec<Vec<u8>>> {
    let mut descriptors = Vec::new();
    let most = u64::from(u32::MAX) * lba;
    for &(offset, len) in ranges {
        for (at, n) in storage::pieces(offset, len, most) {
            let (slba, count) = lbas_of(at, n, lba, size)?;
            let mut d = [0u8; RANGE_LEN];
            d[4..8].copy_from_slice(&count.to_le_bytes());
            d[8..16].copy_from_slice(&slba.to_le_bytes());
            descriptors.extend_from_slice(&d);
        }
    }
    Ok(descriptors
        .chunks(RANGES_PER_COMMAND * RANGE_LEN)
        .map(<[u8]>::to_vec)
        .collect())
}

impl BlockTarget for NvmeTcpClient {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_many(&[(offset, data)])
    }

    /// A Read command for each piece of at most the largest transfer, all in flight
    /// together up to the queue's depth.
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let mut cmds = Vec::new();
        for (offset, buf) in reads.iter_mut() {
            let mut at = *offset;
            for chunk in buf.chunks_mut(self.max_transfer) {
                let (slba, n) = self.lbas(at, chunk.len())?;
                at += chunk.len() as u64;
                let sqe = Sqe::new(OPC_READ)
                    .nsid(NSID)
                    .u64_at(40, slba)
                    .cdw(12, n - 1);
                cmds.push(Command::new(sqe, Data::In(chunk)));
            }
        }
        self.io.run(&mut cmds, self.window)
    }

    /// A Write command for each piece of at most the largest transfer, all in flight
    /// together up to the queue's depth; pieces that fit travel in their capsules.
    fn write_many(&mut self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        let mut cmds = Vec::new();
        for (offset, data) in writes {
            let mut at = *offset;
            for chunk in data.chunks(self.max_transfer) {
                let (slba, n) = self.lbas(at, chunk.len())?;
                at += chunk.len() as u64;
                let sqe = Sqe::new(OPC_WRITE)
                    .nsid(NSID)
                    .u64_at(40, slba)
                    .cdw(12, n - 1);
                let data = if chunk.len() <= self.in_capsule {
                    Data::Capsule(chunk)
                } else {
                    Data::Out(chunk)
                };
                cmds.push(Command::new(sqe, data));
            }
        }
        self.io.run(&mut cmds, self.window)
    }

    fn size(&self) -> u64 {
        self.size
    }

    /// Flush (NVM Command Set §3.2.2), when the controller has a volatile write cache.
    fn flush(&mut self) -> io::Result<()> {
        if !self.volatile_cache {
            return Ok(());
        }
        self.io
            .command(Sqe::new(OPC_FLUSH).nsid(NSID), Data::None)
            .map(|_| ())
    }

    fn alignment(&self) -> u64 {
        self.lba
    }

    fn discards(&self) -> bool {
        self.deallocates
    }

    /// Dataset Management with the Attribute – Deallocate bit (NVM Command Set §3.2.3),
    /// the commands (made by `deallocations`) in flight together.
    fn discard(&mut self, ranges: &[(u64, u64)]) -> io::Result<()> {
        if !self.deallocates {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "the NVMe controller takes no Dataset Management",
            ));
        }
        let lists = deallocations(ranges, self.lba, self.size)?;
        let mut cmds: Vec<Command<'_>> = lists
            .iter()
            .map(|list| {
                let sqe = Sqe::new(OPC_DATASET_MANAGEMENT)
                    .nsid(NSID)
                    .cdw(10, (list.len() / RANGE_LEN - 1) as u32)
                    .cdw(11, 1 << 2);
                let data = match list.len() <= self.in_capsule {
                    true => Data::Capsule(list),
                    false => Data::Out(list),
                };
                Command::new(sqe, data)
            })
            .collect();
        self.io.run(&mut cmds, self.window)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kvcache::Script;
    use proptest::prelude::*;

    /// An ICResp taking H2CData of up to `max_h2c` bytes.
    fn ic_resp(max_h2c: u32) -> Vec<u8> {
        let mut r = vec![0u8; 128];
        r[..8].copy_from_slice(&common_header(pdu::IC_RESP, 0, 128, 0, 128));
        r[12..16].copy_from_slice(&max_h2c.to_le_bytes());
        r
    }

    /// A data PDU or R2T: its 24-byte header (and `data` after it).
    fn data_pdu(
        kind: u8,
        flags: u8,
        cid: u16,
        ttag: u16,
        offset: u32,
        len: u32,
        data: &[u8],
    ) -> Vec<u8> {
        let pdo = if data.is_empty() { 0 } else { DATA_HLEN as u8 };
        let mut p = common_header(
            kind,
            flags,
            DATA_HLEN as u8,
            pdo,
            (DATA_HLEN + data.len()) as u32,
        )
        .to_vec();
        p.extend_from_slice(&cid.to_le_bytes());
        p.extend_from_slice(&ttag.to_le_bytes());
        p.extend_from_slice(&offset.to_le_bytes());
        p.extend_from_slice(&len.to_le_bytes());
        p.extend_from_slice(&[0; 4]);
        p.extend_from_slice(data);
        p
    }

    fn capsule_resp(cid: u16, status: u16) -> Vec<u8> {
        let mut p = common_header(pdu::CAPSULE_RESP, 0, 24, 0, 24).to_vec();
        let mut cqe = [0u8; CQE_LEN];
        cqe[0] = 0x2a;
        cqe[12..14].copy_from_slice(&cid.to_le_bytes());
        cqe[14..16].copy_from_slice(&(status << 1).to_le_bytes());
        p.extend_from_slice(&cqe);
        p
    }

    fn queue(script: Vec<u8>) -> Queue<Script> {
        let mut s = ic_resp(4096);
        s.extend_from_slice(&script);
        Queue::start(Script::new(s), NvmeDigests::default()).unwrap()
    }

    const BOTH: NvmeDigests = NvmeDigests {
        header: true,
        data: true,
    };

    /// `pdu` (a header of `hlen` bytes, then data) as it travels with both digests: the
    /// header digest inserted, the data offset and length moved past it, the data digest
    /// appended, the flags saying so.
    fn with_digests(pdu: &[u8]) -> Vec<u8> {
        let hlen = usize::from(pdu[2]);
        let (head, data) = pdu.split_at(hlen);
        let mut head = head.to_vec();
        let dd = if data.is_empty() { 0 } else { DIGEST_LEN };
        head[1] |= digest_flags(DIGEST_LEN, dd);
        if head[3] != 0 {
            head[3] += DIGEST_LEN as u8;
        }
        let plen = (hlen + DIGEST_LEN + data.len() + dd) as u32;
        head[4..8].copy_from_slice(&plen.to_le_bytes());
        let mut out = head.clone();
        out.extend_from_slice(&digest(&head));
        out.extend_from_slice(data);
        if dd > 0 {
            out.extend_from_slice(&digest(data));
        }
        out
    }

    /// A queue that asked for both digests, the controller agreeing, answering `script`.
    fn digest_queue(script: Vec<u8>) -> Queue<Script> {
        let mut s = ic_resp(4096);
        s[11] = 3;
        s.extend_from_slice(&script);
        Queue::start(Script::new(s), BOTH).unwrap()
    }

    /// A controller that takes the connection and never answers fails the connect once
    /// `io_timeout` has passed.
    #[test]
    fn a_silent_controller_fails_the_connect_after_the_io_timeout() {
        let (addr, held) = crate::kvcache::silent_peer();
        let io_timeout = Duration::from_millis(200);
        let started = Instant::now();
        let Err(e) = NvmeTcpClient::connect(addr, "nqn.x", NvmeDigests::default(), io_timeout)
        else {
            panic!("a connect to a controller that said nothing");
        };
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
        assert!(started.elapsed() >= io_timeout);
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(held.join());
    }

    /// A controller that stops answering once connected (its queue established, then a
    /// command left unanswered) fails that command once `io_timeout` has passed.
    #[test]
    fn a_command_left_unanswered_fails_after_the_io_timeout() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let controller = std::thread::spawn(move || -> io::Result<TcpStream> {
            let (mut c, _) = listener.accept()?;
            c.read_exact(&mut [0u8; 128])?;
            c.write_all(&ic_resp(4096))?;
            Ok(c)
        });
        let io_timeout = Duration::from_millis(200);
        let mut q = Queue::open(addr, NvmeDigests::default(), io_timeout).expect("ICResp");
        let started = Instant::now();
        let e = q
            .property_get(PROP_CAP, true)
            .expect_err("an answer from a controller that said nothing");
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock, "{e}");
        assert!(started.elapsed() >= io_timeout);
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(controller.join());
    }
    #[test]
    fn with_digests_every_pdu_is_checked_and_sent_checked() {
        // A read whose data comes in two PDUs, and a write the controller asks data for.
        let mut s = with_digests(&data_pdu(pdu::C2H_DATA, 0, 1, 0, 0, 4, b"1234"));
        s.extend(with_digests(&data_pdu(
            pdu::C2H_DATA,
            pdu::LAST_PDU,
            1,
            0,
            4,
            4,
            b"5678",
        )));
        s.extend(with_digests(&capsule_resp(1, 0)));
        s.extend(with_digests(&data_pdu(pdu::R2T, 0, 2, 5, 0, 6, &[])));
        s.extend(with_digests(&capsule_resp(2, 0)));
        let mut q = digest_queue(s);
        let mut buf = [0u8; 8];
        q.command(Sqe::new(OPC_READ), Data::In(&mut buf)).unwrap();
        assert_eq!(&buf, b"12345678");
        q.command(Sqe::new(OPC_WRITE), Data::Out(b"abcdef"))
            .unwrap();
        // ICReq asked for both; every PDU sent carries a header digest that matches, and
        // the H2CData its data's digest.
        let sent = &q.stream.from_client;
        assert_eq!(sent[11], 3);
        let mut at = 128;
        let mut kinds = Vec::new();
        while at < sent.len() {
            let (kind, flags, hlen) = (sent[at], sent[at + 1], usize::from(sent[at + 2]));
            let plen = u32::from_le_bytes(sent[at + 4..at + 8].try_into().unwrap()) as usize;
            let pdu = &sent[at..at + plen];
            assert_eq!(
                pdu[hlen..hlen + DIGEST_LEN],
                digest(&pdu[..hlen]),
                "header digest"
            );
            assert_ne!(flags & pdu::HDGSTF, 0);
            if kind == pdu::H2C_DATA {
                assert_eq!(flags & pdu::DDGSTF, pdu::DDGSTF);
                assert_eq!(
                    usize::from(pdu[3]),
                    hlen + DIGEST_LEN,
                    "data after the digest"
                );
                let data = &pdu[hlen + DIGEST_LEN..plen - DIGEST_LEN];
                assert_eq!(data, b"abcdef");
                assert_eq!(pdu[plen - DIGEST_LEN..], digest(data));
            }
            kinds.push(kind);
            at += plen;
        }
        assert_eq!(kinds, [pdu::CAPSULE_CMD, pdu::CAPSULE_CMD, pdu::H2C_DATA]);
    }

    #[test]
    fn a_wrong_digest_or_an_unagreed_one_is_an_error() {
        let mut bad = with_digests(&capsule_resp(1, 0));
        bad[CH_LEN + CQE_LEN] ^= 1;
        let e = digest_queue(bad)
            .command(Sqe::new(OPC_FLUSH), Data::None)
            .unwrap_err();
        assert!(e.to_string().contains("header digest"), "{e}");
        let mut bad = with_digests(&data_pdu(
            pdu::C2H_DATA,
            pdu::LAST_PDU | pdu::SUCCESS,
            1,
            0,
            0,
            4,
            b"1234",
        ));
        let n = bad.len();
        bad[n - DIGEST_LEN - 1] ^= 1; // a data byte
        let e = digest_queue(bad)
            .command(Sqe::new(OPC_READ), Data::In(&mut [0; 4]))
            .unwrap_err();
        assert!(e.to_string().contains("data digest"), "{e}");
        // The controller enables only the header digest of the two asked for.
        let mut s = ic_resp(4096);
        s[11] = 1;
        let e = Queue::start(Script::new(s), BOTH).unwrap_err();
        assert!(e.to_string().contains("digests asked for 0x3"), "{e}");
    }

    #[test]
    fn deallocations_describe_each_range_in_lbas_256_a_command() {
        let lists = deallocations(&[(4096, 8192), (0, 512)], 512, 1 << 20).unwrap();
        assert_eq!(lists.len(), 1);
        let list = &lists[0];
        assert_eq!(list.len(), 2 * RANGE_LEN);
        let field = |d: usize, at: usize, n: usize| {
            list[d * RANGE_LEN + at..d * RANGE_LEN + at + n]
                .iter()
                .rev()
                .fold(0u64, |v, &b| v << 8 | u64::from(b))
        };
        // Context attributes none; 16 LBAs from LBA 8; one from LBA 0.
        assert_eq!((field(0, 0, 4), field(0, 4, 4), field(0, 8, 8)), (0, 16, 8));
        assert_eq!((field(1, 0, 4), field(1, 4, 4), field(1, 8, 8)), (0, 1, 0));
        let many: Vec<(u64, u64)> = (0..300).map(|i| (i * 1024, 512)).collect();
        let lists = deallocations(&many, 512, 1 << 20).unwrap();
        let counts: Vec<usize> = lists.iter().map(|l| l.len() / RANGE_LEN).collect();
        assert_eq!(counts, [256, 44]);
        assert!(
            deallocations(&[(100, 512)], 512, 1 << 20).is_err(),
            "not whole LBAs"
        );
        assert!(
            deallocations(&[((1 << 20) - 512, 1024)], 512, 1 << 20).is_err(),
            "past the end"
        );
    }

    #[test]
    fn a_read_gathers_its_data_pdus() {
        let mut s = data_pdu(pdu::C2H_DATA, 0, 1, 0, 4, 4, b"5678");
        s.extend(data_pdu(pdu::C2H_DATA, pdu::LAST_PDU, 1, 0, 0, 4, b"1234"));
        s.extend(capsule_resp(1, 0));
        let mut q = queue(s);
        let mut buf = [0u8; 8];
        let cqe = q
            .command(Sqe::new(OPC_READ).nsid(1), Data::In(&mut buf))
            .unwrap();
        assert_eq!((&buf, cqe.result), (b"12345678", 0x2a));
        // ICReq, then the command: SGL of the transport, 8 bytes.
        let cmd = &q.stream.from_client[128..];
        assert_eq!(cmd.len(), CMD_HLEN);
        assert_eq!(cmd[..8], common_header(pdu::CAPSULE_CMD, 0, 72, 0, 72));
        assert_eq!(cmd[8 + 32..8 + 40], [8, 0, 0, 0, 0, 0, 0, 0x5a]);
    }

    #[test]
    fn a_write_answers_its_r2t_in_pieces_the_controller_takes() {
        let mut s = data_pdu(pdu::R2T, 0, 1, 7, 0, 10_000, &[]);
        s.extend(capsule_resp(1, 0));
        let mut q = queue(s);
        let data: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        q.command(Sqe::new(OPC_WRITE).nsid(1), Data::Out(&data))
            .unwrap();
        let mut sent = &q.stream.from_client[128 + CMD_HLEN..];
        let mut got = Vec::new();
        for (at, len, last) in [(0, 4096, false), (4096, 4096, false), (8192, 1808, true)] {
            let flags = if last { pdu::LAST_PDU } else { 0 };
            assert_eq!(
                sent[..8],
                common_header(pdu::H2C_DATA, flags, 24, 24, 24 + len)
            );
            assert_eq!(sent[8..12], [1, 0, 7, 0], "command and transfer tag");
            assert_eq!(
                sent[12..20],
                [(at as u32).to_le_bytes(), len.to_le_bytes()].concat()[..]
            );
            got.extend_from_slice(&sent[24..24 + len as usize]);
            sent = &sent[24 + len as usize..];
        }
        assert!(sent.is_empty());
        assert_eq!(got, data);
    }

    /// The CIDs of the command capsules a queue sent after its ICReq, in order.
    fn sent_cids(q: &Queue<Script>) -> Vec<u16> {
        let mut sent = &q.stream.from_client[128..];
        let mut cids = Vec::new();
        while sent.len() >= CH_LEN {
            let plen = u32::from_le_bytes([sent[4], sent[5], sent[6], sent[7]]) as usize;
            if sent[0] == pdu::CAPSULE_CMD {
                cids.push(u16::from_le_bytes([sent[CH_LEN + 2], sent[CH_LEN + 3]]));
            }
            sent = &sent[plen..];
        }
        cids
    }

    #[test]
    fn a_run_keeps_its_commands_in_flight_and_takes_them_back_in_any_order() {
        // The controller finishes the second read first, and asks for the second write's
        // data before the first's.
        let mut s = data_pdu(
            pdu::C2H_DATA,
            pdu::LAST_PDU | pdu::SUCCESS,
            2,
            0,
            0,
            4,
            b"efgh",
        );
        s.extend(data_pdu(pdu::R2T, 0, 4, 9, 0, 3, &[]));
        s.extend(data_pdu(pdu::C2H_DATA, pdu::LAST_PDU, 1, 0, 0, 4, b"abcd"));
        s.extend(capsule_resp(4, 0));
        s.extend(data_pdu(pdu::R2T, 0, 3, 8, 0, 3, &[]));
        s.extend(capsule_resp(1, 0));
        s.extend(capsule_resp(3, 0));
        let mut q = queue(s);
        let (mut a, mut b) = ([0u8; 4], [0u8; 4]);
        let mut cmds = [
            Command::new(Sqe::new(OPC_READ), Data::In(&mut a)),
            Command::new(Sqe::new(OPC_READ), Data::In(&mut b)),
            Command::new(Sqe::new(OPC_WRITE), Data::Out(b"xyz")),
            Command::new(Sqe::new(OPC_WRITE), Data::Out(b"uvw")),
        ];
        q.run(&mut cmds, 4).unwrap();
        assert!(cmds.iter().all(|c| c.result.is_some()));
        assert!(matches!(&cmds[0].data, Data::In(a) if a == b"abcd"));
        assert!(matches!(&cmds[1].data, Data::In(b) if b == b"efgh"));
        assert_eq!(sent_cids(&q), [1, 2, 3, 4]);
        // After the capsules, each write's data on its own R2T: the fourth's first.
        let data = &q.stream.from_client[128 + 4 * CMD_HLEN..];
        assert_eq!(data[8..12], [4, 0, 9, 0]);
        assert_eq!(data[24..27], *b"uvw");
        assert_eq!(data[27 + 8..27 + 12], [3, 0, 8, 0]);
        assert_eq!(data[27 + 24..], *b"xyz");
    }

    #[test]
    fn a_run_sends_no_more_than_its_window_and_refuses_stray_pdus() {
        // Window 1: the second command is not sent before the first completes, so an
        // answer to it then is an answer to nothing.
        let mut s = capsule_resp(2, 0);
        s.extend(capsule_resp(1, 0));
        let mut q = queue(s);
        let mut cmds = [
            Command::new(Sqe::new(OPC_FLUSH), Data::None),
            Command::new(Sqe::new(OPC_FLUSH), Data::None),
        ];
        let e = q.run(&mut cmds, 1).unwrap_err();
        assert!(e.to_string().contains("no command in flight"), "{e}");
        assert_eq!(sent_cids(&q), [1]);
        // Nor is a command completed twice.
        let mut s = capsule_resp(1, 0);
        s.extend(capsule_resp(1, 0));
        let mut q = queue(s);
        let mut cmds = [
            Command::new(Sqe::new(OPC_FLUSH), Data::None),
            Command::new(Sqe::new(OPC_FLUSH), Data::None),
        ];
        assert!(q.run(&mut cmds, 2).is_err());
        // CIDs go on from run to run.
        let mut s = capsule_resp(1, 0);
        s.extend(capsule_resp(2, 0));
        let mut q = queue(s);
        q.command(Sqe::new(OPC_FLUSH), Data::None).unwrap();
        q.command(Sqe::new(OPC_FLUSH), Data::None).unwrap();
        assert_eq!(sent_cids(&q), [1, 2]);
    }

    #[test]
    fn a_failed_command_says_its_status() {
        let mut q = queue(capsule_resp(1, 0x0180));
        let e = q.command(Sqe::new(OPC_READ), Data::None).unwrap_err();
        assert!(e.to_string().contains("status type 1, code 0x80"), "{e}");
        let mut q = queue(capsule_resp(9, 0));
        assert!(
            q.command(Sqe::new(OPC_READ), Data::None).is_err(),
            "another command's"
        );
        // No answer at all: the controller closed the queue.
        let e = queue(Vec::new())
            .command(Sqe::new(OPC_READ), Data::None)
            .unwrap_err();
        assert!(
            e.to_string().contains("controller closed the connection"),
            "{e}"
        );
    }

    proptest! {
        /// Whatever PDUs a controller answers with, framed or not, with digests or
        /// without, two commands in flight end in completions or an error, never a panic,
        /// and never write past their buffers.
        #[test]
        fn any_controller_reply_is_survived(
            pdus in proptest::collection::vec(
                (
                    prop_oneof![Just(pdu::C2H_DATA), Just(pdu::R2T), Just(pdu::CAPSULE_RESP), any::<u8>()],
                    any::<u8>(),
                    0u16..3,
                    0u32..40,
                    0u32..40,
                    proptest::collection::vec(any::<u8>(), 0..40),
                ),
                0..6,
            ),
            raw in proptest::collection::vec(
                (any::<[u8; CH_LEN]>(), proptest::collection::vec(any::<u8>(), 0..64)),
                0..3,
            ),
            noise in proptest::collection::vec(any::<u8>(), 0..40),
            write in any::<bool>(),
            digests in any::<bool>(),
        ) {
            let mut s = Vec::new();
            for (kind, flags, cid, offset, len, data) in &pdus {
                let pdu = if *kind == pdu::CAPSULE_RESP {
                    capsule_resp(*cid, u16::from(*flags & 1))
                } else {
                    data_pdu(*kind, *flags, *cid, 0, *offset, *len, data)
                };
                s.extend(if digests { with_digests(&pdu) } else { pdu });
            }
            for (header, rest) in &raw {
                s.extend_from_slice(header);
                s.extend_from_slice(rest);
            }
            s.extend_from_slice(&noise);
            let mut q = if digests { digest_queue(s) } else { queue(s) };
            let (mut a, mut b) = ([0u8; 16], [0u8; 8]);
            let mut cmds = if write {
                [
                    Command::new(Sqe::new(OPC_WRITE), Data::Out(&[1; 16])),
                    Command::new(Sqe::new(OPC_WRITE), Data::Capsule(&[2; 8])),
                ]
            } else {
                [
                    Command::new(Sqe::new(OPC_READ), Data::In(&mut a)),
                    Command::new(Sqe::new(OPC_READ), Data::In(&mut b)),
                ]
            };
            let _ = q.run(&mut cmds, 2);
        }
    }

    #[test]
    fn commands_put_fields_where_the_specs_say() {
        let s = Sqe::new(OPC_READ).nsid(1).u64_at(40, 0x1122).cdw(12, 7);
        assert_eq!(s.0[0], 0x02);
        assert_eq!(s.0[1], 0x40);
        assert_eq!(s.0[4..8], [1, 0, 0, 0]);
        assert_eq!(s.0[40..48], [0x22, 0x11, 0, 0, 0, 0, 0, 0]);
        assert_eq!(s.0[48..52], [7, 0, 0, 0]);
        let c = Sqe::fabrics(FCTYPE_CONNECT).u16_at(42, 1).u16_at(44, 31);
        assert_eq!((c.0[0], c.0[4]), (0x7f, 0x01));
        assert_eq!(c.0[42..46], [1, 0, 31, 0]);
        assert_eq!(
            common_header(pdu::H2C_DATA, pdu::LAST_PDU, 24, 24, 4120),
            [6, 4, 24, 24, 0x18, 0x10, 0, 0]
        );
    }

    #[test]
    fn the_host_nqn_is_a_uuid_nqn() {
        let h = Host::get();
        assert!(h.nqn.starts_with("nqn.2014-08.org.nvmexpress:uuid:"));
        assert_eq!(h.nqn.len(), 32 + 36);
        assert_eq!(h.id[6] >> 4, 4);
        assert!(std::ptr::eq(h, Host::get()));
    }
}
