//! Where values' bytes live: a storage target addressed by byte offset, through one
//! initiator connection each, or several targets with the store striped over them
//! ([`Striped`]). The service keeps a few connections ([`Pool`]) and each request takes
//! one for its I/O, so requests from different hosts proceed side by side.

use super::nbd::{self, NbdClient};
use super::nvme_tcp::NvmeTcpClient;
use crate::ir::{KvCache, NvmeDigests, StorageTarget};
use crate::sys::ring::Ring;
use std::fs::{File, OpenOptions};
use std::io::{self, IoSlice, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

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
    /// How its bytes travel, for the log: over the network, through this machine's page
    /// cache, or directly to a device.
    fn io_path(&self) -> &'static str {
        "network"
    }
    /// Whether it makes its own connections afresh after a failure (a striped store, each
    /// of its targets'), so the pool keeps it rather than replacing it whole.
    fn mends_itself(&self) -> bool {
        false
    }
    /// Whether the target can be told that ranges no longer hold data
    /// ([`BlockTarget::discard`]).
    fn discards(&self) -> bool {
        false
    }
    /// Tells the target that each range, (offset, length) in whole units of
    /// [`BlockTarget::alignment`], no longer holds data: a flash device can erase them
    /// ahead of its next writes, a thin or sparse one can give the space back. They may
    /// read afterwards as zeros or as they were.
    fn discard(&mut self, _ranges: &[(u64, u64)]) -> io::Result<()> {
        Err(no_discards())
    }
}

/// `len` bytes at `offset` as consecutive pieces of at most `most` bytes (at least one
/// byte), each its offset and length: a range split for requests that hold less.
pub fn pieces(offset: u64, len: u64, most: u64) -> impl Iterator<Item = (u64, u64)> {
    let most = most.max(1);
    (offset..offset + len)
        .step_by(usize::try_from(most).unwrap_or(usize::MAX))
        .map(move |at| (at, most.min(offset + len - at)))
}

/// The error of a discard sent to a target that takes none.
fn no_discards() -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, "the target takes no discards")
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
    /// `discard on`, and the target cannot be told of freed blocks
    #[error("{target} takes no discards (an NBD export without trim, an NVMe controller without Dataset Management, a device whose queue takes none): remove `discard on`")]
    NoDiscards { target: String },
    /// the target is smaller than the part of the service's capacity it must hold
    #[error("{target} holds {size} bytes, less than the {capacity} the service keeps there")]
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

/// What a service's targets are called in messages: the one, or all in stripe order.
pub fn describe_all(targets: &[StorageTarget]) -> String {
    targets.iter().map(describe).collect::<Vec<_>>().join(", ")
}

/// The bytes each of `targets` holds of a store of `capacity` striped over them in
/// stripes of `stripe` bytes: a whole number of stripes, the same on each.
fn share(capacity: u64, stripe: u64, targets: usize) -> u64 {
    match targets {
        0 | 1 => capacity,
        n => capacity.div_ceil(stripe).div_ceil(n as u64) * stripe,
    }
}

/// How long after a failed connection to a target the next is tried. Requests that need
/// one meanwhile fail at once, rather than each waiting out a connect or handshake that
/// is bound to fail (a target host down, a server hung: seconds each), as Linux's NVMe
/// host fails I/O fast between its reconnects.
pub const RECONNECT_DELAY: Duration = Duration::from_secs(2);

/// What failed on each of a store's targets, in the order the service names them, over
/// all its connections: I/O counted (after the one more try on a fresh connection), and
/// when a connection may be tried again after one failed.
#[derive(Debug)]
pub struct Failures(Vec<TargetFailures>);

#[derive(Debug)]
struct TargetFailures {
    name: String,
    io: AtomicU64,
    /// Set when a connection failed: the next is tried from then on.
    retry_at: Mutex<Option<Instant>>,
}

impl Failures {
    pub fn of(targets: &[StorageTarget]) -> Arc<Failures> {
        Arc::new(Failures::named(targets.iter().map(describe)))
    }

    fn named(names: impl Iterator<Item = String>) -> Failures {
        Failures(
            names
                .map(|name| TargetFailures {
                    name,
                    io: AtomicU64::new(0),
                    retry_at: Mutex::new(None),
                })
                .collect(),
        )
    }

    fn count(&self, target: usize) {
        self.0[target].io.fetch_add(1, Relaxed);
    }

    /// Each target's name and count.
    pub fn counts(&self) -> impl Iterator<Item = (&str, u64)> {
        self.0.iter().map(|t| (t.name.as_str(), t.io.load(Relaxed)))
    }

    /// Waits until every target may be connected to again ([`RECONNECT_DELAY`] after a
    /// failed connection), at most that long.
    pub fn until_reconnect(&self) {
        let latest = self
            .0
            .iter()
            .filter_map(|t| *t.retry_at.lock().unwrap_or_else(PoisonError::into_inner))
            .max();
        if let Some(at) = latest {
            std::thread::sleep(at.saturating_duration_since(Instant::now()));
        }
    }

    /// `connect` to `target`, unless a connection to it failed less than
    /// [`RECONNECT_DELAY`] ago: then an error at once. Once the delay is over one caller
    /// tries (the others go on failing at once until it knows); success clears it.
    fn connecting<T>(
        &self,
        target: usize,
        connect: impl FnOnce() -> io::Result<T>,
    ) -> io::Result<T> {
        let t = &self.0[target];
        let retry_at = || t.retry_at.lock().unwrap_or_else(PoisonError::into_inner);
        {
            let mut at = retry_at();
            let now = Instant::now();
            match *at {
                Some(when) if now < when => {
                    return Err(io::Error::new(
                        io::ErrorKind::NotConnected,
                        format!(
                            "its last connection failed; the next is tried in {} ms",
                            (when - now).as_millis()
                        ),
                    ))
                }
                Some(_) => *at = Some(now + RECONNECT_DELAY),
                None => {}
            }
        }
        let made = connect();
        *retry_at() = made.is_err().then(|| Instant::now() + RECONNECT_DELAY);
        made
    }
}

/// How long a connection to a network target may be idle before it is probed: one whose
/// target went away without closing it fails within two minutes, before a request
/// waits `io_timeout` on it, and firewalls and NAT on the path keep its state.
pub const TARGET_KEEP_ALIVE: Duration = Duration::from_secs(60);

/// A TCP connection to a network target at `addr` (made within 5 s): without Nagle's
/// delay, kept alive ([`TARGET_KEEP_ALIVE`]), and each read or send failing once it has
/// waited `timeout`.
pub fn target_stream(addr: SocketAddr, timeout: Duration) -> io::Result<TcpStream> {
    let stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_nodelay(true)?;
    crate::sys::keep_alive(stream.as_fd(), TARGET_KEEP_ALIVE)?;
    set_timeouts(&stream, timeout)?;
    Ok(stream)
}

/// Has each read and send on `stream` fail once it has waited `timeout`.
pub fn set_timeouts(stream: &TcpStream, timeout: Duration) -> io::Result<()> {
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))
}

/// What a service's block says about each connection to a target.
#[derive(Debug, Clone, Copy)]
pub struct Reach {
    /// NVMe/TCP digests (`nvme_digest`).
    pub digests: NvmeDigests,
    /// A local target through the page cache or not (`page_cache`; `None`: as its kind
    /// has it, [`LocalTarget::open`]).
    pub page_cache: Option<bool>,
    /// How long a network target may keep a request waiting (`io_timeout`).
    pub io_timeout: Duration,
}

impl Reach {
    pub fn of(config: &KvCache) -> Reach {
        Reach {
            digests: config.nvme_digests,
            page_cache: config.page_cache,
            io_timeout: config.io_timeout,
        }
    }
}

/// One connection to each of a service's targets, striped when there are several
/// ([`Striped`]), whose targets count their failures in `failures`.
pub fn connect_store(
    config: &KvCache,
    failures: &Arc<Failures>,
) -> Result<Box<dyn BlockTarget>, TargetError> {
    let reach = Reach::of(config);
    match config.targets.as_slice() {
        [one] => connect(one, config.capacity, reach),
        many => {
            let each = share(config.capacity, config.stripe, many.len());
            let members = many
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    let first = connect(t, each, reach)?;
                    let (t, failures) = (t.clone(), Arc::clone(failures));
                    let remake: Remake = Box::new(move || {
                        failures
                            .connecting(i, || connect(&t, each, reach).map_err(io::Error::other))
                    });
                    Ok((first, remake))
                })
                .collect::<Result<Vec<_>, TargetError>>()?;
            Ok(Box::new(Striped::new(
                members,
                config.stripe,
                Arc::clone(failures),
            )))
        }
    }
}

/// Opens one connection to `target`, as `reach` says. A local file that does not exist is
/// created, sparse, `capacity` bytes long; a device or NBD export must already hold
/// `capacity` bytes.
pub fn connect(
    target: &StorageTarget,
    capacity: u64,
    reach: Reach,
) -> Result<Box<dyn BlockTarget>, TargetError> {
    let name = describe(target);
    let t: Box<dyn BlockTarget> = match target {
        StorageTarget::Local { path } => Box::new(
            LocalTarget::open(path, capacity, reach.page_cache).map_err(|source| {
                TargetError::Open {
                    target: name.clone(),
                    source,
                }
            })?,
        ),
        StorageTarget::Nbd { addr, export } => Box::new(
            NbdClient::connect(*addr, export, reach.io_timeout).map_err(|source| {
                TargetError::Nbd {
                    target: name.clone(),
                    source,
                }
            })?,
        ),
        StorageTarget::NvmeTcp { addr, nqn } => Box::new(
            NvmeTcpClient::connect(*addr, nqn, reach.digests, reach.io_timeout).map_err(
                |source| TargetError::Open {
                    target: name.clone(),
                    source,
                },
            )?,
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

/// A local block device or file. A block device is read and written directly
/// (`O_DIRECT`, through an io_uring) unless the service asks for the page cache: values
/// go between the service's buffers and the device without a copy in the page cache,
/// which would otherwise fill the DPU's memory with blocks the index already accounts
/// for (and serve stale bytes if the device changed under it). A file goes through the
/// page cache (`pread`/`pwrite`) unless the service asks otherwise, and then needs a file
/// system that takes direct I/O.
#[derive(Debug)]
pub struct LocalTarget {
    file: File,
    size: u64,
    direct: Option<Direct>,
    /// A block device's largest discard in bytes (0: it takes none); `None` for a file,
    /// whose ranges are discarded by punching holes in it.
    device_discard: Option<u64>,
}

/// What direct I/O needs: every offset, length and buffer address a multiple of `sector`
/// (the device's logical sector size, or what the file system asks). The kernel reads
/// and writes only aligned memory of the target's own, copied to and from the caller's.
#[derive(Debug)]
struct Direct {
    sector: usize,
    io: DirectIo,
}

/// How direct transfers are made.
#[derive(Debug)]
enum DirectIo {
    /// Through io_uring, a request's pieces in flight together.
    Ring(Box<Ring>),
    /// One after another through an aligned buffer of [`BOUNCE`] bytes (where the kernel
    /// refuses io_uring).
    Bounce(Vec<u8>),
}

/// The most bytes copied through the aligned buffer of [`DirectIo::Bounce`] at a time.
const BOUNCE: usize = 1 << 20;

impl LocalTarget {
    /// Opens `path`, first creating it as a sparse file of `capacity` bytes if it does not
    /// exist; through the page cache if `page_cache` says so, or by default for a file
    /// but not for a block device.
    pub fn open(path: &Path, capacity: u64, page_cache: Option<bool>) -> io::Result<LocalTarget> {
        let mut options = OpenOptions::new();
        options.read(true).write(true);
        let file = match options.open(path) {
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                let f = options.clone().create_new(true).open(path)?;
                f.set_len(capacity)?;
                f
            }
            other => other?,
        };
        let device = file.metadata()?.file_type().is_block_device();
        let device_discard = match device {
            // A kernel without the sysfs file: taken as no discards.
            true => Some(crate::sys::device_discard_max_bytes(&file).unwrap_or(0)),
            false => None,
        };
        if page_cache.unwrap_or(!device) {
            let size = io::Seek::seek(&mut &file, io::SeekFrom::End(0))?;
            return Ok(LocalTarget {
                file,
                size,
                direct: None,
                device_discard,
            });
        }
        let sector = if device {
            crate::sys::logical_sector_size(&file)?
        } else {
            crate::sys::direct_io_alignment(&file)?.ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::Unsupported,
                    "its file system does not take direct I/O (`page_cache off`)",
                )
            })?
        };
        let direct = options.custom_flags(libc::O_DIRECT).open(path)?;
        LocalTarget::direct(direct, sector as usize, device_discard)
    }

    /// A target on `file`, opened with `O_DIRECT`, in units of `sector` bytes.
    fn direct(file: File, sector: usize, device_discard: Option<u64>) -> io::Result<LocalTarget> {
        // A block device's length is where seeking to its end lands, not its metadata's.
        let size = io::Seek::seek(&mut &file, io::SeekFrom::End(0))?;
        let io = match Ring::new(sector) {
            Ok(ring) => DirectIo::Ring(Box::new(ring)),
            Err(e) => {
                tracing::debug!(error = %e, "no io_uring: direct I/O one transfer at a time");
                DirectIo::Bounce(vec![0; BOUNCE + sector])
            }
        };
        Ok(LocalTarget {
            file,
            size,
            direct: Some(Direct { sector, io }),
            device_discard,
        })
    }
}

impl Direct {
    /// Refuses I/O that is not whole sectors, which the kernel would refuse less clearly
    /// (`EINVAL`).
    fn check(&self, offset: u64, len: usize) -> io::Result<()> {
        if offset % self.sector as u64 == 0 && len % self.sector == 0 {
            return Ok(());
        }
        Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "direct I/O of {len} bytes at {offset}: not whole {}-byte sectors",
                self.sector
            ),
        ))
    }

    fn read(&mut self, file: &File, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        for (offset, buf) in reads.iter() {
            self.check(*offset, buf.len())?;
        }
        let bounce = match &mut self.io {
            DirectIo::Ring(ring) => return ring.read(file, reads),
            DirectIo::Bounce(bounce) => aligned(bounce, self.sector),
        };
        for (offset, buf) in reads.iter_mut() {
            // Whole sectors each: BOUNCE is a multiple of any sector size.
            for (i, part) in buf.chunks_mut(BOUNCE).enumerate() {
                let bounced = &mut bounce[..part.len()];
                file.read_exact_at(bounced, *offset + (i * BOUNCE) as u64)?;
                part.copy_from_slice(bounced);
            }
        }
        Ok(())
    }

    fn write(&mut self, file: &File, writes: &[(u64, &[u8])]) -> io::Result<()> {
        for (offset, data) in writes {
            self.check(*offset, data.len())?;
        }
        let bounce = match &mut self.io {
            DirectIo::Ring(ring) => return ring.write(file, writes),
            DirectIo::Bounce(bounce) => aligned(bounce, self.sector),
        };
        for (offset, data) in writes {
            for (i, part) in data.chunks(BOUNCE).enumerate() {
                let bounced = &mut bounce[..part.len()];
                bounced.copy_from_slice(part);
                file.write_all_at(bounced, *offset + (i * BOUNCE) as u64)?;
            }
        }
        Ok(())
    }
}

/// The [`BOUNCE`] bytes of `buf` from its first address aligned to `align`.
fn aligned(buf: &mut [u8], align: usize) -> &mut [u8] {
    let skew = buf.as_ptr().align_offset(align);
    &mut buf[skew..skew + BOUNCE]
}

impl BlockTarget for LocalTarget {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_many(&[(offset, data)])
    }

    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        match &mut self.direct {
            Some(direct) => direct.read(&self.file, reads),
            None => reads
                .iter_mut()
                .try_for_each(|(offset, buf)| self.file.read_exact_at(buf, *offset)),
        }
    }

    fn write_many(&mut self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        match &mut self.direct {
            Some(direct) => direct.write(&self.file, writes),
            None => writes
                .iter()
                .try_for_each(|(offset, data)| self.file.write_all_at(data, *offset)),
        }
    }

    fn size(&self) -> u64 {
        self.size
    }

    fn flush(&mut self) -> io::Result<()> {
        self.file.sync_data()
    }

    fn alignment(&self) -> u64 {
        self.direct.as_ref().map_or(1, |d| d.sector as u64)
    }

    fn io_path(&self) -> &'static str {
        match self.direct.as_ref().map(|d| &d.io) {
            None => "page cache",
            Some(DirectIo::Ring(_)) => "direct, io_uring",
            Some(DirectIo::Bounce(_)) => "direct, one transfer at a time",
        }
    }

    /// A file always (its file system may still refuse holes: the discard then fails); a
    /// block device when its queue takes discards.
    fn discards(&self) -> bool {
        self.device_discard != Some(0)
    }

    /// `BLKDISCARD` on a block device, in pieces of at most what its queue takes; holes
    /// punched in a file, so it takes no more of its file system than the values held.
    fn discard(&mut self, ranges: &[(u64, u64)]) -> io::Result<()> {
        for &(offset, len) in ranges {
            match self.device_discard {
                Some(0) => return Err(no_discards()),
                Some(most) => {
                    let step = most.max(self.alignment()) / self.alignment() * self.alignment();
                    for (at, n) in pieces(offset, len, step) {
                        crate::sys::discard_device_range(&self.file, at, n)?;
                    }
                }
                None => crate::sys::punch_hole(&self.file, offset, len)?,
            }
        }
        Ok(())
    }
}

/// Writes `parts` one after another as one stream, in as few system calls as the kernel
/// takes (one, usually): a request's header, data and digest leave together rather than
/// as separate segments.
pub fn write_parts<const N: usize>(w: &mut impl Write, mut parts: [&[u8]; N]) -> io::Result<()> {
    while parts.iter().any(|p| !p.is_empty()) {
        let mut n = match w.write_vectored(&parts.map(IoSlice::new)) {
            // A send with a timeout ends so when the process is stopped and continued
            // (signal(7)).
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            r => r?,
        };
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

/// A store striped over several targets, as RAID 0 stripes a volume over disks: its
/// bytes go `stripe` at a time to each target in turn (stripe `s` to target `s mod n`, at
/// `s div n` stripes into it), so the values of different requests land on different
/// targets and the store has the room of all of them. A request's pieces on different
/// targets go to them at once, each on the connection to it.
#[derive(Debug)]
pub struct Striped {
    members: Vec<Member>,
    stripe: u64,
}

/// How a [`Striped`] store connects to one of its targets again.
pub type Remake = Box<dyn Fn() -> io::Result<Box<dyn BlockTarget>> + Send + Sync>;

/// One target of a [`Striped`] store. A connection whose I/O failed is dropped and made
/// again when next needed, so a target that goes away fails only the requests that
/// touch it, and the store is whole again once it is back.
struct Member {
    /// What it is called in errors: a failed request says which target failed.
    name: String,
    /// Its place in the store's targets, and where its failures are counted.
    index: usize,
    failures: Arc<Failures>,
    conn: Option<Box<dyn BlockTarget>>,
    remake: Remake,
    /// What the first connection said, for when there is none.
    size: u64,
    alignment: u64,
    io_path: &'static str,
    discards: bool,
}

impl std::fmt::Debug for Member {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Member")
            .field("name", &self.name)
            .field("connected", &self.conn.is_some())
            .finish()
    }
}

impl Member {
    /// `e`, saying that it happened on this target.
    fn named(&self, e: io::Error) -> io::Error {
        io::Error::new(e.kind(), format!("{}: {e}", self.name))
    }

    /// `io` on the connection to the target, made first if there is none; a failure
    /// drops it. A connection that served before and fails is tried once more afresh
    /// ([`again_on_fresh`]).
    fn run<T>(
        &mut self,
        mut io: impl FnMut(&mut dyn BlockTarget) -> io::Result<T>,
    ) -> io::Result<T> {
        let done = match self.conn.take() {
            Some(mut c) => match io(c.as_mut()) {
                Ok(v) => Ok((v, c)),
                Err(e) => again_on_fresh(e, &self.remake, &mut io),
            },
            None => (self.remake)().and_then(|mut c| io(c.as_mut()).map(|v| (v, c))),
        };
        match done {
            Ok((v, c)) => {
                self.conn = Some(c);
                Ok(v)
            }
            Err(e) => {
                self.failures.count(self.index);
                Err(self.named(e))
            }
        }
    }
}

impl Striped {
    /// `members`, each a connection and how to make another, in stripe order, with
    /// `stripe` bytes a stripe (a multiple of each member's alignment); `failures` names
    /// them, in the same order, and counts what fails on each.
    pub fn new(
        members: Vec<(Box<dyn BlockTarget>, Remake)>,
        stripe: u64,
        failures: Arc<Failures>,
    ) -> Striped {
        assert!(
            !members.is_empty() && stripe > 0 && failures.0.len() == members.len(),
            "a stripe over some targets, each named"
        );
        let members = members
            .into_iter()
            .enumerate()
            .map(|(index, (conn, remake))| Member {
                name: failures.0[index].name.clone(),
                index,
                failures: Arc::clone(&failures),
                size: conn.size(),
                alignment: conn.alignment(),
                io_path: conn.io_path(),
                discards: conn.discards(),
                conn: Some(conn),
                remake,
            })
            .collect();
        Striped { members, stripe }
    }

    /// Where the store's byte `at` lives: the member and the offset in it.
    fn locate(&self, at: u64) -> (usize, u64) {
        let n = self.members.len() as u64;
        let (stripe, within) = (at / self.stripe, at % self.stripe);
        ((stripe % n) as usize, stripe / n * self.stripe + within)
    }

    /// `len` bytes at the store's `offset` in pieces that each stay within a stripe: the
    /// piece's member, its offset there and its length.
    fn split(&self, offset: u64, len: u64) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
        let end = offset + len;
        let mut at = offset;
        std::iter::from_fn(move || {
            (at < end).then(|| {
                let n = (self.stripe - at % self.stripe).min(end - at);
                let (member, there) = self.locate(at);
                at += n;
                (member, there, n)
            })
        })
    }

    /// Runs `io` on each member that has pieces in `per`, the members at once when there
    /// are several (a thread for each but the first: a request's pieces on different
    /// targets are in flight together, as its pieces on one target are); the first error.
    /// Work whose thread has not taken it when this thread is done (or could not be
    /// started: the process at its limit) runs here.
    fn on_each<B: Send>(
        &mut self,
        per: Vec<Vec<(u64, B)>>,
        io: impl Fn(&mut dyn BlockTarget, &mut Vec<(u64, B)>) -> io::Result<()> + Sync,
    ) -> io::Result<()> {
        let work: Vec<Mutex<Option<_>>> = self
            .members
            .iter_mut()
            .zip(per)
            .filter(|(_, pieces)| !pieces.is_empty())
            .map(|w| Mutex::new(Some(w)))
            .collect();
        let run = |slot: &Mutex<Option<MemberWork<B>>>| {
            let taken = slot.lock().unwrap_or_else(PoisonError::into_inner).take();
            taken.map_or(Ok(()), |(member, mut pieces)| {
                member.run(|t| io(t, &mut pieces))
            })
        };
        let Some((first, others)) = work.split_first() else {
            return Ok(());
        };
        std::thread::scope(|s| {
            let started: Vec<_> = others
                .iter()
                .filter_map(|slot| {
                    std::thread::Builder::new()
                        .spawn_scoped(s, move || run(slot))
                        .ok()
                })
                .collect();
            let mut done = run(first);
            for slot in others {
                done = done.and(run(slot));
            }
            for t in started {
                let theirs = t
                    .join()
                    .unwrap_or_else(|_| Err(io::Error::other("a target's I/O thread panicked")));
                done = done.and(theirs);
            }
            done
        })
    }

    /// Buffers at store offsets as each member's pieces of them.
    fn by_member<B: Piece>(&self, parts: impl Iterator<Item = (u64, B)>) -> Vec<Vec<(u64, B)>> {
        let mut per: Vec<Vec<(u64, B)>> = (0..self.members.len()).map(|_| Vec::new()).collect();
        for (offset, mut rest) in parts {
            for (member, there, n) in self.split(offset, rest.len() as u64) {
                let (piece, after) = rest.cut(n as usize);
                per[member].push((there, piece));
                rest = after;
            }
        }
        per
    }
}

/// One member's part of a striped request: the member and its pieces.
type MemberWork<'a, B> = (&'a mut Member, Vec<(u64, B)>);

/// After `failed`, the error of `io` on a connection that had served before, `io` once
/// more on a connection `connect` makes afresh: a target that restarted (an NBD server,
/// an NVMe/TCP controller) left the connection dead, and the request need not fail for
/// it. The I/O is whole writes and reads at fixed offsets, so doing it twice is safe.
/// The fresh connection with what it did, or the error.
fn again_on_fresh<T>(
    failed: io::Error,
    connect: impl FnOnce() -> io::Result<Box<dyn BlockTarget>>,
    io: &mut impl FnMut(&mut dyn BlockTarget) -> io::Result<T>,
) -> io::Result<(T, Box<dyn BlockTarget>)> {
    tracing::debug!(error = %failed, "storage connection failed; trying a fresh one");
    let mut fresh = connect().map_err(|_| failed)?;
    let v = io(fresh.as_mut())?;
    Ok((v, fresh))
}

/// A buffer a striped request cuts into pieces: read into or written from.
trait Piece: Sized {
    fn len(&self) -> usize;
    /// The first `n` bytes and the rest.
    fn cut(self, n: usize) -> (Self, Self);
}

impl Piece for &[u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn cut(self, n: usize) -> (Self, Self) {
        self.split_at(n)
    }
}

impl Piece for &mut [u8] {
    fn len(&self) -> usize {
        <[u8]>::len(self)
    }
    fn cut(self, n: usize) -> (Self, Self) {
        self.split_at_mut(n)
    }
}

impl BlockTarget for Striped {
    fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.read_many(&mut [(offset, buf)])
    }

    fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
        self.write_many(&[(offset, data)])
    }

    fn read_many(&mut self, reads: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let per = self.by_member(reads.iter_mut().map(|(at, buf)| (*at, &mut **buf)));
        self.on_each(per, |member, pieces| member.read_many(pieces))
    }

    fn write_many(&mut self, writes: &[(u64, &[u8])]) -> io::Result<()> {
        let per = self.by_member(writes.iter().copied());
        self.on_each(per, |member, pieces| member.write_many(pieces))
    }

    /// Whole stripes of the smallest member, on each.
    fn size(&self) -> u64 {
        let smallest = self.members.iter().map(|m| m.size).min();
        let smallest = smallest.unwrap_or(0);
        smallest / self.stripe * self.stripe * self.members.len() as u64
    }

    fn flush(&mut self) -> io::Result<()> {
        self.members
            .iter_mut()
            .try_for_each(|m| m.run(|t| t.flush()))
    }

    fn alignment(&self) -> u64 {
        self.members.iter().map(|m| m.alignment).max().unwrap_or(1)
    }

    fn io_path(&self) -> &'static str {
        let first = self.members[0].io_path;
        match self.members.iter().all(|m| m.io_path == first) {
            true => first,
            false => "several ways",
        }
    }

    fn mends_itself(&self) -> bool {
        true
    }

    fn discards(&self) -> bool {
        self.members.iter().all(|m| m.discards)
    }

    /// Each range as its members' ranges, a member's consecutive stripes joined.
    fn discard(&mut self, ranges: &[(u64, u64)]) -> io::Result<()> {
        let mut per: Vec<Vec<(u64, u64)>> = vec![Vec::new(); self.members.len()];
        for &(offset, len) in ranges {
            for (member, there, n) in self.split(offset, len) {
                match per[member].last_mut() {
                    Some((at, l)) if *at + *l == there => *l += n,
                    _ => per[member].push((there, n)),
                }
            }
        }
        for (member, ranges) in self.members.iter_mut().zip(per) {
            if !ranges.is_empty() {
                member.run(|t| t.discard(&ranges))?;
            }
        }
        Ok(())
    }
}

/// A few connections to a service's store (each one connection to each of its targets),
/// each used by one request at a time. A connection whose I/O failed is dropped and made
/// afresh by the next request that needs it, so the service carries on once a restarted
/// target is back.
pub struct Pool {
    idle: Mutex<Vec<Option<Box<dyn BlockTarget>>>>,
    returned: Condvar,
    /// What the connections are made from.
    config: KvCache,
    failures: Arc<Failures>,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("targets", &describe_all(&self.config.targets))
            .finish()
    }
}

impl Pool {
    /// The service's `connections` connections to its store, all made now: a target that
    /// cannot be reached fails the service's start.
    pub fn connect(config: &KvCache) -> Result<Pool, TargetError> {
        let failures = Failures::of(&config.targets);
        let conns = (0..config.connections.max(1))
            .map(|_| connect_store(config, &failures).map(Some))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Pool {
            idle: Mutex::new(conns),
            returned: Condvar::new(),
            config: config.clone(),
            failures,
        })
    }

    /// What failed on each target.
    pub fn failures(&self) -> &Failures {
        &self.failures
    }

    /// Counts a failure of a store of one target (a striped store's targets count their
    /// own).
    fn failed(&self) {
        if self.config.targets.len() == 1 {
            self.failures.count(0);
        }
    }

    /// How the target's bytes travel ([`BlockTarget::io_path`]).
    pub fn io_path(&self) -> &'static str {
        let idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        idle.iter()
            .flatten()
            .map(|c| c.io_path())
            .next()
            .unwrap_or("unknown")
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
            let fresh = self
                .fresh()
                .and_then(|mut fresh| fresh.flush().map(|()| fresh));
            match fresh {
                Ok(fresh) => *slot = Some(fresh),
                Err(e) => {
                    self.failed();
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// A fresh connection to the store; to a store of one target, none within
    /// [`RECONNECT_DELAY`] of one that failed (a striped store's targets each keep their
    /// own delay).
    fn fresh(&self) -> io::Result<Box<dyn BlockTarget>> {
        let connect = || connect_store(&self.config, &self.failures).map_err(io::Error::other);
        match self.config.targets.len() {
            1 => self.failures.connecting(0, connect),
            _ => connect(),
        }
    }

    /// `e` as the client is told it: a socket's timeout (EAGAIN) named as what it is.
    fn said(&self, e: io::Error) -> io::Error {
        match e.kind() {
            io::ErrorKind::WouldBlock => io::Error::new(
                io::ErrorKind::TimedOut,
                format!(
                    "the target kept the request waiting longer than {:?} (io_timeout)",
                    self.config.io_timeout
                ),
            ),
            _ => e,
        }
    }

    /// Runs `f` with a connection, waiting for one to be free; where the connection had
    /// served before and `f` fails, once more on a fresh one (a restarted target left
    /// the old one dead).
    pub fn with<T>(
        &self,
        mut f: impl FnMut(&mut dyn BlockTarget) -> io::Result<T>,
    ) -> io::Result<T> {
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
        let connect = || self.fresh();
        let (out, conn) = match slot {
            Some(mut c) => match f(c.as_mut()) {
                Ok(v) => (Ok(v), Some(c)),
                // A striped store makes its targets' connections afresh itself.
                Err(e) if c.mends_itself() => (Err(e), Some(c)),
                Err(e) => match again_on_fresh(e, connect, &mut f) {
                    Ok((v, fresh)) => (Ok(v), Some(fresh)),
                    Err(e) => (Err(e), None),
                },
            },
            None => match connect() {
                Ok(mut c) => match f(c.as_mut()) {
                    Ok(v) => (Ok(v), Some(c)),
                    Err(e) => (Err(e), None),
                },
                Err(e) => {
                    tracing::debug!(error = %e, "storage target still unreachable");
                    let targets = describe_all(&self.config.targets);
                    let e = io::Error::new(
                        io::ErrorKind::NotConnected,
                        format!("cannot reach {targets}"),
                    );
                    (Err(e), None)
                }
            },
        };
        let out = out.map_err(|e| {
            self.failed();
            self.said(e)
        });
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

    /// A failed connection holds the next off for [`RECONNECT_DELAY`] without trying it,
    /// until [`Failures::until_reconnect`] has waited it out; a target that never failed
    /// is connected to by every caller.
    #[test]
    fn after_a_failed_connection_the_next_waits_its_delay() {
        let failures = Failures::named(["a".to_owned(), "b".to_owned()].into_iter());
        let mut tries = 0;
        let refused = failures.connecting(0, || {
            tries += 1;
            Err::<(), _>(io::Error::from(io::ErrorKind::ConnectionRefused))
        });
        assert_eq!(
            refused.unwrap_err().kind(),
            io::ErrorKind::ConnectionRefused
        );
        let held = failures.connecting(0, || {
            tries += 1;
            Ok(())
        });
        assert_eq!(held.unwrap_err().kind(), io::ErrorKind::NotConnected);
        assert_eq!(tries, 1);
        // What a stop waits for before saving the index: then the next is tried.
        failures.until_reconnect();
        let tried = failures.connecting(0, || {
            tries += 1;
            Ok(())
        });
        assert!(tried.is_ok() && tries == 2);
        for _ in 0..2 {
            failures
                .connecting(1, || Ok(()))
                .expect("a target that never failed");
        }
    }

    /// How a service with `page_cache` reaches a local target.
    fn local(page_cache: Option<bool>) -> Reach {
        Reach {
            digests: NvmeDigests::default(),
            page_cache,
            io_timeout: Duration::from_secs(30),
        }
    }

    #[test]
    fn a_range_comes_in_pieces_of_at_most_so_many_bytes() {
        let all: Vec<_> = pieces(4096, 10_000, 4096).collect();
        assert_eq!(all, [(4096, 4096), (8192, 4096), (12288, 1808)]);
        assert_eq!(pieces(0, 512, u64::MAX).collect::<Vec<_>>(), [(0, 512)]);
        assert_eq!(pieces(7, 0, 4096).count(), 0);
    }

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

    /// Whether descriptor `fd` of this process is open with `O_DIRECT` (proc(5): the
    /// `flags` line of /proc/self/fdinfo, in octal).
    fn opened_direct(fd: i32) -> bool {
        let info = std::fs::read_to_string(format!("/proc/self/fdinfo/{fd}")).unwrap();
        let flags = info
            .lines()
            .find_map(|l| l.strip_prefix("flags:"))
            .map(|f| i32::from_str_radix(f.trim(), 8).unwrap())
            .unwrap();
        flags & libc::O_DIRECT != 0
    }

    /// Direct I/O of whole 4096-byte sectors from memory at any address, scattered
    /// pieces together, through io_uring and through the bounce buffer alike.
    #[test]
    fn direct_io_takes_memory_at_any_address_and_refuses_partial_sectors() {
        use std::os::fd::AsRawFd;
        for ring in [true, false] {
            let path =
                std::env::temp_dir().join(format!("dpuflow-direct-{ring}-{}", std::process::id()));
            File::create(&path).unwrap().set_len(8 << 20).unwrap();
            let file = OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
                .unwrap();
            let fd = file.as_raw_fd();
            let mut t = LocalTarget::direct(file, 4096, None).unwrap();
            assert!(opened_direct(fd));
            let direct = t.direct.as_mut().unwrap();
            assert!(matches!(direct.io, DirectIo::Ring(_)), "no io_uring here");
            if !ring {
                direct.io = DirectIo::Bounce(vec![0; BOUNCE + 4096]);
            }
            let path_taken = ["direct, one transfer at a time", "direct, io_uring"];
            assert_eq!(t.io_path(), path_taken[usize::from(ring)]);
            assert_eq!((t.alignment(), t.size()), (4096, 8 << 20));
            // Longer than the bounce buffer, and one byte past an allocation's alignment.
            let len = 2 * BOUNCE + 2 * 4096;
            let bytes: Vec<u8> = (0..=len).map(|i| (i * 7 + i / 4096) as u8).collect();
            let data = &bytes[1..];
            assert!(data.as_ptr().align_offset(4096) != 0);
            t.write_at(8192, data).unwrap();
            let mut back = vec![0u8; len + 1];
            t.read_at(8192, &mut back[1..]).unwrap();
            assert!(back[1..] == *data);
            assert!(std::fs::read(&path).unwrap()[8192..8192 + len] == *data);
            // Many pieces, scattered, written and read back together.
            let pieces: Vec<(u64, &[u8])> = (0..100u64)
                .map(|i| ((7 << 20) - i * 8192, &data[(i as usize) * 4096..][..4096]))
                .collect();
            t.write_many(&pieces).unwrap();
            let mut bufs = vec![vec![0u8; 4097]; 100];
            let mut reads: Vec<(u64, &mut [u8])> = bufs
                .iter_mut()
                .zip(&pieces)
                .map(|(b, (offset, _))| (*offset, &mut b[1..]))
                .collect();
            t.read_many(&mut reads).unwrap();
            assert!(bufs.iter().zip(&pieces).all(|(b, (_, d))| b[1..] == **d));
            let refused = |r: io::Result<()>| r.unwrap_err().kind() == io::ErrorKind::InvalidInput;
            assert!(refused(t.write_at(512, &data[..4096])));
            assert!(refused(t.write_at(4096, &data[..100])));
            assert!(refused(t.read_at(0, &mut back[..4097])));
            // Past the end: an error, and the target goes on working.
            assert!(t.read_at(8 << 20, &mut back[..4096]).is_err());
            t.read_at(8192, &mut back[..4096]).unwrap();
            assert!(back[..4096] == data[..4096]);
            drop(t);
            std::fs::remove_file(&path).unwrap();
        }
    }

    #[test]
    fn a_file_kept_out_of_the_page_cache_is_read_and_written_directly() {
        let path = std::env::temp_dir().join(format!("dpuflow-uncached-{}", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let target = StorageTarget::Local { path: path.clone() };
        let mut t = connect(&target, 1 << 20, local(Some(false))).unwrap();
        let align = t.alignment() as usize;
        assert!(align >= 512 && align.is_power_of_two());
        assert_eq!(t.io_path(), "direct, io_uring");
        // The descriptor open on the file (the only one: created by this test).
        let fds = std::fs::read_dir("/proc/self/fd").unwrap().flatten();
        let fd = fds
            .filter(|e| std::fs::read_link(e.path()).is_ok_and(|l| l == path))
            .map(|e| e.file_name().to_str().unwrap().parse().unwrap())
            .collect::<Vec<i32>>();
        assert!(fd.len() == 1 && opened_direct(fd[0]), "{fd:?}");
        let block: Vec<u8> = (0..2 * align).map(|i| i as u8).collect();
        t.write_at(align as u64, &block).unwrap();
        let mut back = vec![0u8; 2 * align];
        t.read_at(align as u64, &mut back).unwrap();
        assert_eq!(back, block);
        drop(t);
        let t = connect(&target, 1 << 20, local(Some(true))).unwrap();
        assert_eq!((t.alignment(), t.io_path()), (1, "page cache"));
        drop(t);
        std::fs::remove_file(&path).unwrap();
    }

    #[test]
    fn a_missing_file_is_created_sparse_and_holds_what_is_written() {
        let dir = std::env::temp_dir().join(format!("dpuflow-local-{}", std::process::id()));
        let _ = std::fs::remove_file(&dir);
        let target = StorageTarget::Local { path: dir.clone() };
        let mut t = connect(&target, 1 << 20, local(None)).unwrap();
        assert_eq!(
            (t.size(), t.alignment(), t.io_path()),
            (1 << 20, 1, "page cache")
        );
        t.write_at(4096, b"block").unwrap();
        let mut back = [0u8; 5];
        t.read_at(4096, &mut back).unwrap();
        assert_eq!(&back, b"block");
        assert!(t.read_at(1 << 20, &mut back).is_err());
        drop(t);
        assert!(matches!(
            connect(&target, 2 << 20, local(None)),
            Err(TargetError::TooSmall { size, .. }) if size == 1 << 20
        ));
        std::fs::remove_file(&dir).unwrap();
    }

    /// A target in memory, counting the requests it is sent; clones share it.
    #[derive(Debug, Default, Clone)]
    struct Memory(Arc<Mutex<Held>>);

    #[derive(Debug, Default)]
    struct Held {
        bytes: Vec<u8>,
        requests: usize,
        discarded: Vec<(u64, u64)>,
        /// Every request fails, as on a target that went away.
        down: bool,
    }

    impl Memory {
        fn of(len: usize) -> Memory {
            Memory(Arc::new(Mutex::new(Held {
                bytes: vec![0; len],
                ..Held::default()
            })))
        }

        fn held(&self) -> std::sync::MutexGuard<'_, Held> {
            self.0.lock().unwrap()
        }
    }

    impl Held {
        fn range(&self, offset: u64, len: usize) -> io::Result<std::ops::Range<usize>> {
            if self.down {
                return Err(io::Error::new(io::ErrorKind::ConnectionReset, "down"));
            }
            let at = usize::try_from(offset).map_err(io::Error::other)?;
            (at + len <= self.bytes.len())
                .then_some(at..at + len)
                .ok_or_else(|| io::Error::other("past the end"))
        }
    }

    impl BlockTarget for Memory {
        fn read_at(&mut self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
            let mut h = self.held();
            h.requests += 1;
            let r = h.range(offset, buf.len())?;
            buf.copy_from_slice(&h.bytes[r]);
            Ok(())
        }
        fn write_at(&mut self, offset: u64, data: &[u8]) -> io::Result<()> {
            let mut h = self.held();
            h.requests += 1;
            let r = h.range(offset, data.len())?;
            h.bytes[r].copy_from_slice(data);
            Ok(())
        }
        fn size(&self) -> u64 {
            self.held().bytes.len() as u64
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
        fn discards(&self) -> bool {
            true
        }
        fn discard(&mut self, ranges: &[(u64, u64)]) -> io::Result<()> {
            let mut h = self.held();
            for &(offset, len) in ranges {
                let r = h.range(offset, len as usize)?;
                h.bytes[r].fill(0);
                h.discarded.push((offset, len));
            }
            Ok(())
        }
    }

    /// A target striped over `members` in stripes of `stripe` bytes.
    fn striped(members: &[Memory], stripe: u64) -> Striped {
        let boxed = members
            .iter()
            .map(|m| {
                let again = m.clone();
                let remake: Remake = Box::new(move || Ok(Box::new(again.clone())));
                let first: Box<dyn BlockTarget> = Box::new(m.clone());
                (first, remake)
            })
            .collect();
        let names = (0..members.len()).map(|i| format!("memory {i}"));
        Striped::new(boxed, stripe, Arc::new(Failures::named(names)))
    }

    /// The store's stripes go to the targets in turn, each target's stripes one after
    /// another in it; a target's consecutive stripes are discarded in one range.
    #[test]
    fn stripes_go_to_the_targets_in_turn() {
        let m = [Memory::of(4096), Memory::of(4096), Memory::of(4096)];
        let mut t = striped(&m, 1024);
        assert_eq!(t.size(), 3 * 4096);
        let data: Vec<u8> = (0..5000u32).map(|i| (i % 251) as u8).collect();
        // From the middle of stripe 0 to the middle of stripe 5.
        t.write_at(700, &data).unwrap();
        let bytes = |i: usize, r: std::ops::Range<usize>| m[i].held().bytes[r].to_vec();
        assert_eq!(bytes(0, 700..1024), data[..324]);
        assert_eq!(bytes(1, 0..1024), data[324..1348]);
        assert_eq!(bytes(2, 0..1024), data[1348..2372]);
        assert_eq!(bytes(0, 1024..2048), data[2372..3396]);
        assert_eq!(bytes(1, 1024..2048), data[3396..4420]);
        assert_eq!(bytes(2, 1024..1604), data[4420..]);
        let requests: Vec<_> = m.iter().map(|m| m.held().requests).collect();
        assert_eq!(requests, [2, 2, 2]);
        let mut back = vec![0u8; 5000];
        t.read_at(700, &mut back).unwrap();
        assert_eq!(back, data);
        // Stripes 0 to 8 whole: each target's three stripes are one range of it.
        t.discard(&[(0, 9 * 1024)]).unwrap();
        for m in &m {
            assert_eq!(m.held().discarded, [(0, 3 * 1024)]);
        }
        // Past the end is an error, as on one target, naming the target it fell on (the
        // bytes after the store's last stripe would be the first target's fifth).
        let past = t.read_at(3 * 4096 - 10, &mut back[..20]).unwrap_err();
        assert!(past.to_string().starts_with("memory 0: "), "{past}");
    }

    /// A target that goes away fails the requests that touch it, naming it, and no
    /// other; once it is back, its connection is made again and the store is whole.
    #[test]
    fn a_target_that_goes_away_fails_only_what_touches_it() {
        let m = [Memory::of(4096), Memory::of(4096)];
        let mut t = striped(&m, 1024);
        t.write_at(0, &[7; 2048]).unwrap();
        m[1].held().down = true;
        let mut back = [0u8; 1024];
        let failed = t.read_at(1024, &mut back).unwrap_err();
        assert!(failed.to_string().starts_with("memory 1: "), "{failed}");
        assert!(
            t.read_at(0, &mut back).is_ok(),
            "the other target serves on"
        );
        assert!(t.write_at(2048, &[8; 1024]).is_ok());
        assert!(t.read_at(3072, &mut back).is_err());
        m[1].held().down = false;
        t.read_at(1024, &mut back).unwrap();
        assert_eq!(back, [7; 1024]);
        assert!(t.mends_itself());
    }

    #[test]
    fn a_store_over_several_targets_gives_each_a_whole_number_of_stripes() {
        assert_eq!(share(10 << 20, 1 << 20, 1), 10 << 20);
        assert_eq!(share(10 << 20, 1 << 20, 2), 5 << 20);
        assert_eq!(share(10 << 20, 1 << 20, 3), 4 << 20);
        assert_eq!(share((10 << 20) + 1, 1 << 20, 2), 6 << 20);
        // Each holds its share: the store is at least the capacity.
        for n in 2..6 {
            assert!(share(10 << 20, 65536, n) * n as u64 >= 10 << 20);
        }
    }

    proptest::proptest! {
        /// Whatever is written, read and discarded, a store striped over targets reads
        /// as one target of its size would.
        #[test]
        fn a_striped_store_reads_as_one_target(
            targets in 1usize..5,
            stripe_sectors in 1u64..5,
            ops in proptest::collection::vec((0u8..3, 0u64..64, 1u64..24, proptest::prelude::any::<u8>()), 1..40),
        ) {
            let (sector, stripe) = (512u64, stripe_sectors * 512);
            let each = 4 * stripe;
            let members: Vec<_> = (0..targets).map(|_| Memory::of(each as usize)).collect();
            let mut striped = striped(&members, stripe);
            let size = each * targets as u64;
            let mut flat = Memory::of(size as usize);
            proptest::prop_assert_eq!(striped.size(), size);
            for (op, at, len, fill) in ops {
                let (at, len) = (at * sector % size, len * sector);
                let len = len.min(size - at);
                match op {
                    0 => {
                        let data = vec![fill; len as usize];
                        striped.write_many(&[(at, &data[..])]).unwrap();
                        flat.write_at(at, &data).unwrap();
                    }
                    1 => {
                        striped.discard(&[(at, len)]).unwrap();
                        flat.discard(&[(at, len)]).unwrap();
                    }
                    _ => {
                        let (mut a, mut b) = (vec![0u8; len as usize / 2], vec![0u8; len as usize - len as usize / 2]);
                        let half = len / 2;
                        striped.read_many(&mut [(at, &mut a[..]), (at + half, &mut b[..])]).unwrap();
                        let mut want = vec![0u8; len as usize];
                        flat.read_at(at, &mut want).unwrap();
                        proptest::prop_assert_eq!(&a[..], &want[..half as usize]);
                        proptest::prop_assert_eq!(&b[..], &want[half as usize..]);
                    }
                }
            }
        }
    }
}
