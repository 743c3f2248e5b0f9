//! Capture files: pcap and pcapng in, pcap out, Ethernet link type only.
//!
//! Formats: pcap as libpcap writes it (microsecond and nanosecond variants, either byte
//! order), and pcapng (draft-ietf-opsawg-pcapng) section header, interface description
//! (link type, `if_tsresol`, `if_tsoffset`), enhanced and simple packet blocks; other
//! blocks are skipped.

use std::fs::File;
use std::io::{BufRead, BufReader, BufWriter, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

/// Why a capture file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// the file could not be opened, read or written
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// the file is not a pcap or pcapng capture, or is damaged
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
}

const LINKTYPE_ETHERNET: u32 = 1;
const PCAP_MICRO: u32 = 0xa1b2_c3d4;
const PCAP_NANO: u32 = 0xa1b2_3c4d;
const PCAPNG_SHB: u32 = 0x0a0d_0d0a;
const PCAPNG_BYTE_ORDER: u32 = 0x1a2b_3c4d;
const PCAPNG_IDB: u32 = 1;
const PCAPNG_SPB: u32 = 3;
const PCAPNG_EPB: u32 = 6;
/// A pcap record header: seconds, fraction, captured and original length.
const PCAP_RECORD_HEADER: usize = 16;
/// Read buffer: a few thousand small records, so most are handed over from it in place.
const READ_BUFFER: usize = 256 << 10;
/// Write buffer: a system call for every few thousand small records rather than for a
/// hundred (a `BufWriter`'s default 8 KiB).
const WRITE_BUFFER: usize = 256 << 10;
const TRUNCATED: &str = "the file ends in the middle of a record (cut short as it was written?)";
/// Largest block or record accepted; bigger ones mean a damaged file.
const MAX_RECORD: usize = 16 << 20;

#[derive(Debug, Clone, Copy)]
struct Interface {
    linktype: u32,
    /// Timestamp units per second.
    units_per_sec: u64,
    offset_sec: u64,
}

#[derive(Debug)]
enum Format {
    Pcap { nanos: bool },
    PcapNg { interfaces: Vec<Interface> },
}

/// Reads Ethernet frames and their timestamps from a pcap or pcapng file.
#[derive(Debug)]
pub struct CaptureReader {
    path: PathBuf,
    file: BufReader<File>,
    big_endian: bool,
    format: Format,
    buf: Vec<u8>,
}

impl CaptureReader {
    pub fn open(path: &Path) -> Result<CaptureReader, CaptureError> {
        let file = File::open(path).map_err(|source| CaptureError::Io {
            path: path.to_owned(),
            source,
        })?;
        let mut r = CaptureReader {
            path: path.to_owned(),
            file: BufReader::with_capacity(READ_BUFFER, file),
            big_endian: false,
            format: Format::Pcap { nanos: false },
            buf: Vec::new(),
        };
        r.start()?;
        Ok(r)
    }

    /// Back to the first packet, keeping the buffers (a looped replay comes here once
    /// a pass).
    pub fn rewind(&mut self) -> Result<(), CaptureError> {
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(|source| CaptureError::Io {
                path: self.path.clone(),
                source,
            })?;
        self.start()
    }

    /// Reads the file's header (pcap) or first section header (pcapng).
    fn start(&mut self) -> Result<(), CaptureError> {
        self.big_endian = false;
        let mut head = [0u8; 24];
        self.read_exact(&mut head[..4])?;
        let magic_le = u32::from_le_bytes(head[..4].try_into().expect("4 bytes"));
        let magic_be = u32::from_be_bytes(head[..4].try_into().expect("4 bytes"));
        if magic_le == PCAPNG_SHB {
            self.format = Format::PcapNg {
                interfaces: Vec::new(),
            };
            return self.section_header();
        }
        let nanos = match (magic_le, magic_be) {
            (PCAP_MICRO, _) => false,
            (PCAP_NANO, _) => true,
            (_, PCAP_MICRO) => {
                self.big_endian = true;
                false
            }
            (_, PCAP_NANO) => {
                self.big_endian = true;
                true
            }
            _ => return Err(self.bad("not a pcap or pcapng file")),
        };
        self.read_exact(&mut head[4..24])?;
        let linktype = self.u32_at(&head, 20) & 0x0fff_ffff;
        if linktype != LINKTYPE_ETHERNET {
            return Err(self.bad(&format!("link type {linktype} is not Ethernet")));
        }
        self.format = Format::Pcap { nanos };
        Ok(())
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn bad(&self, message: &str) -> CaptureError {
        CaptureError::Format {
            path: self.path.clone(),
            message: message.to_owned(),
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> Result<(), CaptureError> {
        match self.file.read_exact(buf) {
            Ok(()) => Ok(()),
            // A capture whose writer was stopped mid-record (tcpdump killed, a full disk).
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Err(self.bad(TRUNCATED)),
            Err(source) => Err(CaptureError::Io {
                path: self.path.clone(),
                source,
            }),
        }
    }

    /// Reads exactly `buf.len()` bytes, or returns false at a clean end of file.
    fn read_or_eof(&mut self, buf: &mut [u8]) -> Result<bool, CaptureError> {
        let mut got = 0;
        while got < buf.len() {
            match self.file.read(&mut buf[got..]) {
                Ok(0) if got == 0 => return Ok(false),
                Ok(0) => return Err(self.bad(TRUNCATED)),
                Ok(n) => got += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(source) => {
                    return Err(CaptureError::Io {
                        path: self.path.clone(),
                        source,
                    })
                }
            }
        }
        Ok(true)
    }

    fn u32_at(&self, b: &[u8], at: usize) -> u32 {
        let w: [u8; 4] = b[at..at + 4].try_into().expect("4 bytes");
        if self.big_endian {
            u32::from_be_bytes(w)
        } else {
            u32::from_le_bytes(w)
        }
    }

    fn u16_at(&self, b: &[u8], at: usize) -> u16 {
        let w: [u8; 2] = b[at..at + 2].try_into().expect("2 bytes");
        if self.big_endian {
            u16::from_be_bytes(w)
        } else {
            u16::from_le_bytes(w)
        }
    }

    /// Reads the rest of a section header block (its type is already read).
    fn section_header(&mut self) -> Result<(), CaptureError> {
        let mut b = [0u8; 8];
        self.read_exact(&mut b)?;
        let bom = u32::from_le_bytes(b[4..8].try_into().expect("4 bytes"));
        self.big_endian = match bom {
            PCAPNG_BYTE_ORDER => false,
            _ if bom.swap_bytes() == PCAPNG_BYTE_ORDER => true,
            _ => return Err(self.bad("bad pcapng byte-order magic")),
        };
        let len = self.u32_at(&b, 0) as usize;
        if !(28..=MAX_RECORD).contains(&len) || len % 4 != 0 {
            return Err(self.bad("bad pcapng section header length"));
        }
        let mut rest = vec![0u8; len - 12];
        self.read_exact(&mut rest)?;
        if let Format::PcapNg { interfaces } = &mut self.format {
            interfaces.clear();
        }
        Ok(())
    }

    /// Hands the next frame (timestamp in nanoseconds, bytes) to `f`; `None` at the end
    /// of the file.
    pub fn next_with<R>(
        &mut self,
        f: impl FnOnce(u64, &[u8]) -> R,
    ) -> Option<Result<R, CaptureError>> {
        // A pcap record whole in the read buffer is handed over from there, not copied.
        if let Format::Pcap { nanos } = self.format {
            if let Some((ns, len)) = self.buffered_record(nanos) {
                let r = f(ns, &self.file.buffer()[PCAP_RECORD_HEADER..len]);
                self.file.consume(len);
                return Some(Ok(r));
            }
        }
        match self.next_frame() {
            Ok(Some((ts, range))) => Some(Ok(f(ts, &self.buf[range]))),
            Ok(None) => None,
            Err(e) => Some(Err(e)),
        }
    }

    /// The timestamp and whole length (header and frame) of the next pcap record, when it
    /// is all in the read buffer and sound; otherwise [`CaptureReader::next_frame`] reads it
    /// (and reports what is wrong with it).
    #[inline]
    fn buffered_record(&self, nanos: bool) -> Option<(u64, usize)> {
        let b = self.file.buffer();
        let (ns, caplen) = self.record_header(b.get(..PCAP_RECORD_HEADER)?, nanos);
        let len = PCAP_RECORD_HEADER + caplen;
        (caplen <= MAX_RECORD && len <= b.len()).then_some((ns, len))
    }

    /// A pcap record header's timestamp in nanoseconds and captured length.
    fn record_header(&self, h: &[u8], nanos: bool) -> (u64, usize) {
        let (sec, frac) = (self.u32_at(h, 0), self.u32_at(h, 4));
        let ns = u64::from(sec) * 1_000_000_000 + u64::from(frac) * if nanos { 1 } else { 1000 };
        (ns, self.u32_at(h, 8) as usize)
    }

    fn next_frame(&mut self) -> Result<Option<(u64, std::ops::Range<usize>)>, CaptureError> {
        match self.format {
            Format::Pcap { nanos } => {
                let mut h = [0u8; PCAP_RECORD_HEADER];
                if !self.read_or_eof(&mut h)? {
                    return Ok(None);
                }
                let (ns, caplen) = self.record_header(&h, nanos);
                if caplen > MAX_RECORD {
                    return Err(self.bad("record larger than 16 MiB"));
                }
                let mut buf = std::mem::take(&mut self.buf);
                buf.resize(caplen, 0);
                let r = self.read_exact(&mut buf);
                self.buf = buf;
                r?;
                Ok(Some((ns, 0..caplen)))
            }
            Format::PcapNg { .. } => loop {
                let mut h = [0u8; 8];
                if !self.read_or_eof(&mut h)? {
                    return Ok(None);
                }
                let kind = u32::from_le_bytes(h[..4].try_into().expect("4 bytes"));
                if kind == PCAPNG_SHB {
                    // A new section: re-read its byte order and forget the interfaces.
                    let len = h[4..8].to_vec();
                    let mut b = [0u8; 4];
                    self.read_exact(&mut b)?;
                    let bom = u32::from_le_bytes(b);
                    self.big_endian = bom != PCAPNG_BYTE_ORDER;
                    let len = self.u32_at(&len, 0) as usize;
                    if !(28..=MAX_RECORD).contains(&len) {
                        return Err(self.bad("bad pcapng section header length"));
                    }
                    let mut rest = vec![0u8; len - 12];
                    self.read_exact(&mut rest)?;
                    if let Format::PcapNg { interfaces } = &mut self.format {
                        interfaces.clear();
                    }
                    continue;
                }
                let kind = self.u32_at(&h, 0);
                let len = self.u32_at(&h, 4) as usize;
                if !(12..=MAX_RECORD).contains(&len) || len % 4 != 0 {
                    return Err(self.bad("bad pcapng block length"));
                }
                let mut body = std::mem::take(&mut self.buf);
                body.resize(len - 8, 0);
                let r = self.read_exact(&mut body);
                self.buf = body;
                r?;
                let body_len = len - 12;
                match kind {
                    PCAPNG_IDB => {
                        let iface = self.interface(body_len)?;
                        if let Format::PcapNg { interfaces } = &mut self.format {
                            interfaces.push(iface);
                        }
                    }
                    PCAPNG_EPB => {
                        if body_len < 20 {
                            return Err(self.bad("short enhanced packet block"));
                        }
                        let b = &self.buf;
                        let id = self.u32_at(b, 0) as usize;
                        let ts = u64::from(self.u32_at(b, 4)) << 32 | u64::from(self.u32_at(b, 8));
                        let caplen = self.u32_at(b, 12) as usize;
                        if 20 + caplen > body_len {
                            return Err(self.bad("packet overruns its block"));
                        }
                        let Format::PcapNg { interfaces } = &self.format else {
                            unreachable!()
                        };
                        let Some(iface) = interfaces.get(id).copied() else {
                            return Err(self.bad("packet names an undeclared interface"));
                        };
                        if iface.linktype != LINKTYPE_ETHERNET {
                            return Err(
                                self.bad(&format!("link type {} is not Ethernet", iface.linktype))
                            );
                        }
                        // In 128 bits: any resolution and offset a file declares fit, and
                        // what nanoseconds since 1970 cannot hold is an error.
                        let units = u128::from(iface.units_per_sec);
                        let (ts, offset) = (u128::from(ts), u128::from(iface.offset_sec));
                        let ns = (ts / units + offset) * 1_000_000_000
                            + ts % units * 1_000_000_000 / units;
                        let Ok(ns) = u64::try_from(ns) else {
                            return Err(self.bad("timestamp past the year 2554"));
                        };
                        return Ok(Some((ns, 20..20 + caplen)));
                    }
                    PCAPNG_SPB => {
                        if body_len < 4 {
                            return Err(self.bad("short simple packet block"));
                        }
                        let orig = self.u32_at(&self.buf, 0) as usize;
                        let caplen = orig.min(body_len - 4);
                        return Ok(Some((0, 4..4 + caplen)));
                    }
                    _ => {}
                }
            },
        }
    }

    /// Decodes the interface description block in `self.buf`.
    fn interface(&self, body_len: usize) -> Result<Interface, CaptureError> {
        let b = &self.buf[..body_len];
        if b.len() < 8 {
            return Err(self.bad("short interface description block"));
        }
        let mut iface = Interface {
            linktype: u32::from(self.u16_at(b, 0)),
            units_per_sec: 1_000_000,
            offset_sec: 0,
        };
        let mut at = 8;
        while at + 4 <= b.len() {
            let (code, len) = (self.u16_at(b, at), usize::from(self.u16_at(b, at + 2)));
            let v = &b[(at + 4).min(b.len())..(at + 4 + len).min(b.len())];
            match (code, v.len()) {
                (0, _) => break,
                // if_tsresol: a power of 10, or of 2 when the top bit is set.
                (9, 1) => {
                    let e = u32::from(v[0] & 0x7f);
                    let base: u64 = if v[0] & 0x80 != 0 { 2 } else { 10 };
                    iface.units_per_sec = base
                        .checked_pow(e)
                        .filter(|&u| u > 0)
                        .ok_or_else(|| self.bad("bad if_tsresol"))?;
                }
                // if_tsoffset: seconds added to every timestamp.
                (14, 8) => {
                    let w: [u8; 8] = v.try_into().expect("8 bytes");
                    iface.offset_sec = if self.big_endian {
                        u64::from_be_bytes(w)
                    } else {
                        u64::from_le_bytes(w)
                    };
                }
                _ => {}
            }
            at += 4 + len.div_ceil(4) * 4;
        }
        Ok(iface)
    }
}

/// Writes Ethernet frames to a pcap file (microsecond timestamps, the most widely read
/// variant).
#[derive(Debug)]
pub struct CaptureWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl CaptureWriter {
    pub fn create(path: &Path) -> Result<CaptureWriter, CaptureError> {
        let file = File::create(path).map_err(|source| CaptureError::Io {
            path: path.to_owned(),
            source,
        })?;
        let mut w = CaptureWriter {
            path: path.to_owned(),
            out: BufWriter::with_capacity(WRITE_BUFFER, file),
        };
        let mut h = Vec::with_capacity(24);
        h.extend_from_slice(&PCAP_MICRO.to_le_bytes());
        h.extend_from_slice(&2u16.to_le_bytes());
        h.extend_from_slice(&4u16.to_le_bytes());
        h.extend_from_slice(&[0; 8]);
        h.extend_from_slice(&262_144u32.to_le_bytes());
        h.extend_from_slice(&LINKTYPE_ETHERNET.to_le_bytes());
        w.put(&h)?;
        Ok(w)
    }

    fn put(&mut self, b: &[u8]) -> Result<(), CaptureError> {
        self.out.write_all(b).map_err(|source| CaptureError::Io {
            path: self.path.clone(),
            source,
        })
    }

    pub fn write(&mut self, ts_ns: u64, frame: &[u8]) -> Result<(), CaptureError> {
        let mut h = [0u8; 16];
        h[0..4].copy_from_slice(&((ts_ns / 1_000_000_000) as u32).to_le_bytes());
        h[4..8].copy_from_slice(&((ts_ns % 1_000_000_000 / 1000) as u32).to_le_bytes());
        h[8..12].copy_from_slice(&(frame.len() as u32).to_le_bytes());
        h[12..16].copy_from_slice(&(frame.len() as u32).to_le_bytes());
        self.put(&h)?;
        self.put(frame)
    }

    /// Flushes buffered frames to the file.
    pub fn finish(mut self) -> Result<(), CaptureError> {
        self.out.flush().map_err(|source| CaptureError::Io {
            path: self.path.clone(),
            source,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A capture path of its own for a test.
    fn scratch(name: &str) -> PathBuf {
        std::env::temp_dir().join(format!("dpuflow-{name}-{}.pcap", std::process::id()))
    }

    #[test]
    fn writes_then_reads_back() {
        let path = scratch("pcap");
        let mut w = CaptureWriter::create(&path).unwrap();
        w.write(1_500_000_123_456, &[1, 2, 3]).unwrap();
        w.write(1_500_000_124_000, &[4; 60]).unwrap();
        w.finish().unwrap();
        let mut r = CaptureReader::open(&path).unwrap();
        assert_eq!(
            r.next_with(|ts, d| (ts, d.to_vec())).unwrap().unwrap(),
            (1_500_000_123_000, vec![1, 2, 3])
        );
        assert_eq!(
            r.next_with(|ts, d| (ts, d.len())).unwrap().unwrap(),
            (1_500_000_124_000, 60)
        );
        assert!(r.next_with(|_, _| ()).is_none());
        // A looped replay starts again from the first record.
        r.rewind().unwrap();
        assert_eq!(
            r.next_with(|ts, d| (ts, d.to_vec())).unwrap().unwrap(),
            (1_500_000_123_000, vec![1, 2, 3])
        );
        std::fs::remove_file(path).unwrap();
    }

    /// Records of every size up to a jumbo frame, over several read buffers: those that
    /// straddle the buffer's end are read by copying, the rest handed over in place, and
    /// all come back whole and in order.
    #[test]
    fn reads_records_across_buffer_ends() {
        let path = scratch("pcap-big");
        let mut w = CaptureWriter::create(&path).unwrap();
        let frame = |i: usize| -> Vec<u8> { (0..i % 9001).map(|b| (b ^ i) as u8).collect() };
        let n = 3 * READ_BUFFER / 1000;
        let mut total = 0;
        for i in 0..n {
            w.write(i as u64 * 1000, &frame(i * 37)).unwrap();
            total += PCAP_RECORD_HEADER + (i * 37) % 9001;
        }
        w.finish().unwrap();
        assert!(total > 3 * READ_BUFFER);
        let mut r = CaptureReader::open(&path).unwrap();
        for i in 0..n {
            let (ts, ok) = r
                .next_with(|ts, d| (ts, d == frame(i * 37).as_slice()))
                .unwrap()
                .unwrap();
            assert_eq!(ts, i as u64 * 1000);
            assert!(ok, "record {i}");
        }
        assert!(r.next_with(|_, _| ()).is_none());
        std::fs::remove_file(path).unwrap();
    }

    /// A capture cut short (its writer stopped mid-record) reads up to its last whole
    /// record, then says so, whether the cut falls in a record's header or its frame.
    #[test]
    fn a_capture_cut_short_says_so_after_its_whole_records() {
        let path = scratch("pcap-cut");
        let mut w = CaptureWriter::create(&path).unwrap();
        w.write(1_000, &[7; 60]).unwrap();
        w.write(2_000, &[8; 60]).unwrap();
        w.finish().unwrap();
        let whole = std::fs::read(&path).unwrap();
        let second = 24 + PCAP_RECORD_HEADER + 60;
        for cut in [second + 5, second + PCAP_RECORD_HEADER + 30] {
            std::fs::write(&path, &whole[..cut]).unwrap();
            let mut r = CaptureReader::open(&path).unwrap();
            assert_eq!(
                r.next_with(|ts, d| (ts, d.len())).unwrap().unwrap(),
                (1_000, 60)
            );
            match r.next_with(|_, _| ()) {
                Some(Err(CaptureError::Format { message, .. })) => {
                    assert_eq!(message, TRUNCATED, "cut at {cut}")
                }
                other => panic!("cut at {cut}: {other:?}"),
            }
        }
        std::fs::remove_file(path).unwrap();
    }

    /// Every frame and timestamp of a capture read until its end or its first error, or
    /// the error opening it.
    fn read_all(bytes: &[u8], name: &str) -> Result<Vec<(u64, Vec<u8>)>, CaptureError> {
        let path = scratch(name);
        std::fs::write(&path, bytes).unwrap();
        let read = CaptureReader::open(&path).and_then(|mut r| frames_left(&mut r));
        std::fs::remove_file(path).unwrap();
        read
    }

    fn frames_left(r: &mut CaptureReader) -> Result<Vec<(u64, Vec<u8>)>, CaptureError> {
        let mut frames = Vec::new();
        while let Some(f) = r.next_with(|ts, d| (ts, d.to_vec())) {
            frames.push(f?);
        }
        Ok(frames)
    }

    /// A pcapng capture read to its end and rewound reads the same again: its interfaces
    /// (and their timestamp resolutions) are learnt afresh.
    #[test]
    fn a_rewound_pcapng_capture_reads_the_same_again() {
        let path = scratch("pcapng-rewind");
        let frames = [(1_000, vec![1; 60]), (2_000, vec![2; 61])];
        std::fs::write(&path, pcapng(&[(9, vec![3])], &frames)).unwrap();
        let mut r = CaptureReader::open(&path).unwrap();
        let first = frames_left(&mut r).unwrap();
        assert_eq!(first.len(), 2);
        r.rewind().unwrap();
        assert_eq!(frames_left(&mut r).unwrap(), first);
        std::fs::remove_file(path).unwrap();
    }

    /// A pcapng section (little-endian) with one Ethernet interface whose options are
    /// `options` (code, value), then one enhanced packet block per frame.
    fn pcapng(options: &[(u16, Vec<u8>)], frames: &[(u64, Vec<u8>)]) -> Vec<u8> {
        fn block(out: &mut Vec<u8>, kind: u32, body: &[u8]) {
            let len = 12 + body.len().div_ceil(4) * 4;
            out.extend_from_slice(&kind.to_le_bytes());
            out.extend_from_slice(&(len as u32).to_le_bytes());
            out.extend_from_slice(body);
            out.resize(out.len() + body.len().div_ceil(4) * 4 - body.len(), 0);
            out.extend_from_slice(&(len as u32).to_le_bytes());
        }
        let mut out = Vec::new();
        let mut shb = PCAPNG_BYTE_ORDER.to_le_bytes().to_vec();
        shb.extend_from_slice(&[1, 0, 0, 0]); // version 1.0
        shb.extend_from_slice(&u64::MAX.to_le_bytes()); // section length unknown
        block(&mut out, PCAPNG_SHB, &shb);
        let mut idb = vec![1, 0, 0, 0, 0, 0, 4, 0]; // Ethernet, snaplen 262144
        for (code, value) in options {
            idb.extend_from_slice(&code.to_le_bytes());
            idb.extend_from_slice(&(value.len() as u16).to_le_bytes());
            idb.extend_from_slice(value);
            idb.resize(idb.len().div_ceil(4) * 4, 0);
        }
        block(&mut out, PCAPNG_IDB, &idb);
        for (ts, frame) in frames {
            let mut epb = 0u32.to_le_bytes().to_vec();
            epb.extend_from_slice(&((ts >> 32) as u32).to_le_bytes());
            epb.extend_from_slice(&(*ts as u32).to_le_bytes());
            epb.extend_from_slice(&(frame.len() as u32).to_le_bytes());
            epb.extend_from_slice(&(frame.len() as u32).to_le_bytes());
            epb.extend_from_slice(frame);
            block(&mut out, PCAPNG_EPB, &epb);
        }
        out
    }

    use proptest::prelude::*;

    proptest! {
        #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

        /// Any bytes after any of the formats' openings read to an end or an error,
        /// never a panic.
        #[test]
        fn any_bytes_read_without_panicking(
            opening in 0usize..5,
            tail in proptest::collection::vec(any::<u8>(), 0..600),
        ) {
            let mut bytes = match opening {
                0 => pcapng(&[], &[]),
                1 => {
                    let mut h = PCAP_NANO.to_be_bytes().to_vec();
                    h.extend_from_slice(&[0, 2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 0, 0, 0, 0, 1]);
                    h
                }
                2 => {
                    let mut h = PCAP_MICRO.to_le_bytes().to_vec();
                    h.extend_from_slice(&[2, 0, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 4, 0, 1, 0, 0, 0]);
                    h
                }
                3 => PCAPNG_SHB.to_le_bytes().to_vec(),
                _ => Vec::new(),
            };
            bytes.extend_from_slice(&tail);
            let _ = read_all(&bytes, "prop-any");
        }

        /// Any interface timestamp resolution and offset, and any packet timestamp: read as
        /// the format defines it (units of 10^-n or 2^-n seconds, plus the offset in
        /// seconds), or an error when that is past what nanoseconds since 1970 hold.
        #[test]
        fn pcapng_timestamps_of_any_resolution(
            resolution in any::<u8>(),
            offset in any::<u64>(),
            ts in any::<u64>(),
        ) {
            let options = [(9, vec![resolution]), (14, offset.to_le_bytes().to_vec())];
            let read = read_all(&pcapng(&options, &[(ts, vec![1; 60])]), "prop-ts");
            let base: u128 = if resolution & 0x80 != 0 { 2 } else { 10 };
            let units = base.checked_pow(u32::from(resolution & 0x7f)).filter(|&u| u <= u128::from(u64::MAX));
            let want = units.and_then(|u| {
                let ns = (u128::from(ts / u as u64) + u128::from(offset)) * 1_000_000_000
                    + u128::from(ts % u as u64) * 1_000_000_000 / u;
                u64::try_from(ns).ok()
            });
            match (read, want) {
                (Ok(frames), Some(ns)) => prop_assert_eq!(frames, vec![(ns, vec![1; 60])]),
                (Err(CaptureError::Format { .. }), None) => {}
                (read, want) => prop_assert!(false, "read {:?}, want {:?}", read, want),
            }
        }

        /// Frames written are read back whole, in order, with their timestamps to the
        /// microsecond.
        #[test]
        fn written_frames_read_back(
            frames in proptest::collection::vec(
                (0u64..u64::from(u32::MAX) * 1_000_000_000, proptest::collection::vec(any::<u8>(), 0..200)),
                0..20,
            ),
        ) {
            let path = scratch("prop-write");
            let mut w = CaptureWriter::create(&path).unwrap();
            for (ts, f) in &frames {
                w.write(*ts, f).unwrap();
            }
            w.finish().unwrap();
            let bytes = std::fs::read(&path).unwrap();
            std::fs::remove_file(&path).unwrap();
            let read = read_all(&bytes, "prop-write-read").unwrap();
            let want: Vec<(u64, Vec<u8>)> = frames.into_iter().map(|(ts, f)| (ts / 1000 * 1000, f)).collect();
            prop_assert_eq!(read, want);
        }
    }
}
