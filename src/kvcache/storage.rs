//! Where values' bytes live: a storage target addressed by byte offset, through one
//! initiator connection each. The service keeps a few connections ([`Pool`]) and each
//! request takes one for its I/O, so requests from different hosts proceed side by side.

use super::nbd::{self, NbdClient};
use super::nvme_tcp::NvmeTcpClient;
use crate::ir::{KvCache, NvmeDigests, StorageTarget};
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Condvar, Mutex, PoisonError};

/// One connection to a storage target.
pub trait BlockTarget: Send + std::fmt::Debug {
    /// Fills `buf` from the target at `offset`.
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
    /// Writes `data` to the target at `offset`.
    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()>;
    /// Fills each buffer from its offset: the pieces of one value, which a target that
    /// can keep several requests in flight on a connection sends together.
    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (offset, buf) in reads.iter_mut() {
            self.read_at(*offset, buf)?;
        }
        Ok(())
    }
    /// Writes each piece at its offset, as [`BlockTarget::read_many`] reads.
    fn write_many(&mut self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        for (offset, data) in writes {
            self.write_at(*offset, data)?;
        }
        Ok(())
    }
    /// The target's size in bytes.
    fn size(&self) -> u64;
    /// Makes what was written durable: the target's volatile cache written out.
    fn flush(&mut self) -> io::Result<()>;
    /// Offsets and lengths of I/O are multiples of this many bytes.
    fn alignment(&self) -> u64 {
        1
    }
}

/// Why a storage target cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum TargetError {
    /// the target could not be opened, connected to, or set up (NVMe/TCP)
    #[error("{target}: {source}")]
    Open { target: String, source: io::Error },
    /// the NBD server refused or broke the handshake
    #[error("{target}: {source}")]
    Nbd {
        target: String,
        source: nbd::NbdError,
    },
    /// the service's blocks are not whole sectors of the target
    #[error("{target} reads and writes in units of {align} bytes: block_size {block_size} is not a multiple")]
    Misaligned {
        target: String,
        block_size: u64,
        align: u64,
    },
    /// the target is smaller than the service's capacity
    #[error("{target} holds {size} bytes, less than the capacity of {capacity}")]
    TooSmall {
        target: String,
        size: u64,
        capacity: u64,
    },
}

/// What a target is called in messages.
pub fn describe(target: &StorageTarget) -> String {
    match target {
        StorageTarget::NvmeTcp { addr, nqn } => format!("nvme-tcp://{addr}/{nqn}"),
        StorageTarget::Nbd { addr, export } => format!("nbd://{addr}/{export}"),
        StorageTarget::Local { path } => path.display().to_string(),
    }
}

/// Opens one connection to `target`. A local file that does not exist is created, sparse,
/// `capacity` bytes long; a device or NBD export must already hold `capacity` bytes.
pub fn connect(
    target: &StorageTarget,
    capacity: u64,
    digests: NvmeDigests,
) -> Result<Box<dyn BlockTarget>, TargetError> {
    let name = describe(target);
    let t: Box<dyn BlockTarget> = match target {
        StorageTarget::Local { path } => Box::new(LocalTarget::open(path, capacity).map_err(
            |source| TargetError::Open {
                target: name.clone(),
                source,
            },
        )?),
        StorageTarget::Nbd { addr, export } => Box::new(
            NbdClient::connect(*addr, export).map_err(|source| TargetError::Nbd {
                target: name.clone(),
                source,
            })?,
        ),
        StorageTarget::NvmeTcp { addr, nqn } => Box::new(
            NvmeTcpClient::connect(*addr, nqn, digests).map_err(|source| TargetError::Open {
                target: name.clone(),
                source,
            })?,
        ),
    };
    if t.size() < capacity {
        return Err(TargetError::TooSmall {
            target: name,
            size: t.size(),
            capacity,
        });
    }
    Ok(t)
}

/// A local block device or file, read and written with `pread`/`pwrite`.
#[derive(Debug)]
pub struct LocalTarget {
    file: File,
    size: u64,
}

impl LocalTarget {
    pub fn open(path: &Path, capacity: u64) -> io::Result<LocalTarget> {
        let file = match OpenOptions::new().read(true).write(true).open(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let f = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .open(path)?;
                f.set_len(capacity)?;
                f
            }
            other => other?,
        };
        // A block device's length is where seeking to its end lands, not its metadata's.
        let size = io::Seek::seek(&mut &file, io::SeekFrom::End(0))?;
        Ok(LocalTarget { file, size })
    }
}

impl BlockTarget for LocalTarget {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.file.read_exact_at(buf, offset)
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.file.write_all_at(data, offset)
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }
}

/// Writes `parts` one after another as one stream, in as few system calls as the kernel
/// takes (one, usually): a request's header, data and digest leave together rather than
/// as separate segments.
pub fn write_parts<const N: usize>(w: &mut impl Write, mut parts: [&[u8]; N]) -> io::Result<()> {
    while parts.iter().any(|p| !p.is_empty()) {
        let mut n = w.write_vectored(&parts.map(IoSlice::new))?;
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        for p in &mut parts {
            let taken = n.min(p.len());
            *p = &p[taken..];
            n -= taken;
        }
    }
    Ok(())
}

/// A few connections to one target, each used by one request at a time. A connection
/// whose I/O failed is dropped and made afresh by the next request that needs it, so the
/// service carries on once a restarted target is back.
pub struct Pool {
    idle: Mutex<Vec<Option<Box<dyn BlockTarget>>>>,
    returned: Condvar,
    target: StorageTarget,
    capacity: u64,
    digests: NvmeDigests,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("target", &describe(&self.target))
            .finish()
    }
}

impl Pool {
    /// The service's `connections` connections to its target, all made now: a target that
    /// cannot be reached fails the service's start.
    pub fn connect(config: &KvCache) -> Result<Pool, TargetError> {
        let (target, capacity, digests) = (&config.target, config.capacity, config.nvme_digests);
        let conns = (0..config.connections.max(1))
            .map(|_| connect(target, capacity, digests).map(Some))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pool {
            idle: Mutex::new(conns),
            returned: Condvar::new(),
            target: target.clone(),
            capacity,
            digests,
        })
    }

    /// The largest I/O alignment of the connections.
    pub fn alignment(&self) -> u64 {
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.iter()
            .flatten()
            .map(|c| c.alignment())
            .max()
            .unwrap_or(1)
    }

    /// Flushes every idle connection (an NBD server may make durable only what came on
    /// the connection flushed). A connection that cannot (its target restarted since it
    /// was last used) is made afresh and flushed: what it wrote went with the old one.
    pub fn flush_all(&self) -> io::Result<()> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        for slot in idle.iter_mut() {
            if slot.as_mut().is_some_and(|c| c.flush().is_ok()) {
                continue;
            }
            let mut fresh =
                connect(&self.target, self.capacity, self.digests).map_err(io::Error::other)?;
            fresh.flush()?;
            *slot = Some(fresh);
        }
        Ok(())
    }

    /// Runs `f` with a connection, waiting for one to be free.
    pub fn with<T>(&self, f: impl FnOnce(&mut dyn BlockTarget) -> io::Result<T>) -> io::Result<T> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let slot = loop {
            match idle.pop() {
                Some(c) => break c,
                None => {
                    idle = self
                        .returned
                        .wait(idle)
                        .unwrap_or_else(PoisonError::into_inner)
                }
            }
        };
        drop(idle);
        let mut conn = match slot {
            Some(c) => Some(c),
            None => connect(&self.target, self.capacity, self.digests)
                .map_err(|e| tracing::debug!(error = %e, "storage target still unreachable"))
                .ok(),
        };
        let out = match conn.as_mut() {
            Some(c) => f(c.as_mut()),
            None => Err(io::Error::new(
                io::ErrorKind::NotConnected,
                format!("cannot reach {}", describe(&self.target)),
            )),
        };
        if out.is_err() {
            conn = None;
        }
        self.idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(conn);
        self.returned.notify_one();
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A writer taking at most three bytes a call.
    struct Trickle(Vec<u8>);

    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(3);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            let first = bufs
                .iter()
                .find(|b| !b.is_empty())
                .map_or(&[][..], |b| &b[..]);
            self.write(first)
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn header_and_data_arrive_whole_and_in_order() {
        let mut w = Trickle(Vec::new());
        write_parts(&mut w, [&b"head"[..], b"and the body", b"!"]).unwrap();
        assert_eq!(w.0, b"headand the body!");
        let mut w = Trickle(Vec::new());
        write_parts(&mut w, [&b""[..], b"body"]).unwrap();
        assert_eq!(w.0, b"body");
    }

    #[test]
    fn a_missing_file_is_created_sparse_and_holds_what_is_written() {
        let dir = std::env::temp_dir().join(format!("dpuflow-local-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let target = StorageTarget::Local { path: dir.clone() };
        let mut t = connect(&target, 1 << 20, NvmeDigests::default()).unwrap();
        assert_eq!(t.size(), 1 << 20);
        t.write_at(4096, b"block").unwrap();
        let mut back = [0u8; 5];
        t.read_at(4096, &mut back).unwrap();
        assert_eq!(&back, b"block");
        assert!(t.read_at(1 << 20, &mut back).is_err());
        drop(t);
        assert!(matches!(
            connect(&target, 2 << 20, NvmeDigests::default()),
            Err(TargetError::TooSmall { size, .. }) if size == 1 << 20
        ));
        std::fs::remove_file(&dir).unwrap();
    }
}
