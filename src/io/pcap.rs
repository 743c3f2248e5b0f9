//! Capture files: pcap and pcapng in, pcap out (Ethernet link type).

use pcap_file::pcap::{PcapHeader, PcapPacket, PcapReader, PcapWriter};
use pcap_file::pcapng::{Block, PcapNgReader};
use pcap_file::{DataLink, TsResolution};
use std::fs::File;
use std::io::{BufReader, BufWriter, Read};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Why a capture file could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// the file could not be opened or created
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    /// the file is not a pcap or pcapng capture, or is damaged
    #[error("{path}: {message}")]
    Format { path: PathBuf, message: String },
}

enum Kind {
    Pcap(PcapReader<BufReader<File>>),
    PcapNg(PcapNgReader<BufReader<File>>),
}

/// Reads Ethernet frames and their timestamps from a pcap or pcapng file.
pub struct CaptureReader {
    path: PathBuf,
    kind: Kind,
}

impl std::fmt::Debug for CaptureReader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureReader")
            .field("path", &self.path)
            .finish()
    }
}

const PCAPNG_MAGIC: [u8; 4] = [0x0a, 0x0d, 0x0d, 0x0a];

impl CaptureReader {
    pub fn open(path: &Path) -> Result<CaptureReader, CaptureError> {
        let io = |source| CaptureError::Io {
            path: path.to_owned(),
            source,
        };
        let format = |message: String| CaptureError::Format {
            path: path.to_owned(),
            message,
        };
        let mut magic = [0u8; 4];
        File::open(path)
            .and_then(|mut f| f.read_exact(&mut magic))
            .map_err(io)?;
        let file = BufReader::new(File::open(path).map_err(io)?);
        let kind = if magic == PCAPNG_MAGIC {
            Kind::PcapNg(PcapNgReader::new(file).map_err(|e| format(e.to_string()))?)
        } else {
            let r = PcapReader::new(file).map_err(|e| format(e.to_string()))?;
            if r.header().datalink != DataLink::ETHERNET {
                return Err(format(format!(
                    "link type {:?} is not Ethernet",
                    r.header().datalink
                )));
            }
            Kind::Pcap(r)
        };
        Ok(CaptureReader {
            path: path.to_owned(),
            kind,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Hands the next frame (timestamp in nanoseconds, bytes) to `f`; `None` at the end
    /// of the file.
    pub fn next_with<R>(
        &mut self,
        f: impl FnOnce(u64, &[u8]) -> R,
    ) -> Option<Result<R, CaptureError>> {
        let path = &self.path;
        let format = |message: String| CaptureError::Format {
            path: path.clone(),
            message,
        };
        match &mut self.kind {
            Kind::Pcap(r) => r.next_packet().map(|p| {
                p.map(|p| f(p.timestamp.as_nanos() as u64, &p.data))
                    .map_err(|e| format(e.to_string()))
            }),
            Kind::PcapNg(r) => loop {
                let block = match r.next_block()? {
                    Ok(b) => b,
                    Err(e) => return Some(Err(format(e.to_string()))),
                };
                match block {
                    Block::EnhancedPacket(p) => {
                        return Some(Ok(f(p.timestamp.as_nanos() as u64, &p.data)))
                    }
                    Block::SimplePacket(p) => return Some(Ok(f(0, &p.data))),
                    Block::InterfaceDescription(i) if i.linktype != DataLink::ETHERNET => {
                        return Some(Err(format(format!(
                            "link type {:?} is not Ethernet",
                            i.linktype
                        ))));
                    }
                    _ => continue,
                }
            },
        }
    }
}

/// Writes Ethernet frames to a pcap file (microsecond timestamps, the most widely read
/// variant).
pub struct CaptureWriter {
    path: PathBuf,
    writer: PcapWriter<BufWriter<File>>,
}

impl std::fmt::Debug for CaptureWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CaptureWriter")
            .field("path", &self.path)
            .finish()
    }
}

impl CaptureWriter {
    pub fn create(path: &Path) -> Result<CaptureWriter, CaptureError> {
        let file = File::create(path).map_err(|source| CaptureError::Io {
            path: path.to_owned(),
            source,
        })?;
        let header = PcapHeader {
            datalink: DataLink::ETHERNET,
            snaplen: 262_144,
            ts_resolution: TsResolution::MicroSecond,
            ..PcapHeader::default()
        };
        let writer = PcapWriter::with_header(BufWriter::new(file), header).map_err(|e| {
            CaptureError::Format {
                path: path.to_owned(),
                message: e.to_string(),
            }
        })?;
        Ok(CaptureWriter {
            path: path.to_owned(),
            writer,
        })
    }

    pub fn write(&mut self, ts_ns: u64, frame: &[u8]) -> Result<(), CaptureError> {
        let p = PcapPacket::new(Duration::from_nanos(ts_ns), frame.len() as u32, frame);
        self.writer
            .write_packet(&p)
            .map(|_| ())
            .map_err(|e| CaptureError::Format {
                path: self.path.clone(),
                message: e.to_string(),
            })
    }

    /// Flushes buffered frames to the file.
    pub fn finish(self) -> Result<(), CaptureError> {
        let path = self.path;
        let mut w = self.writer.into_writer();
        std::io::Write::flush(&mut w).map_err(|source| CaptureError::Io { path, source })
    }
}
