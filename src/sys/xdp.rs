//! AF_XDP sockets and the XDP program that steers an interface's frames to them (the
//! kernel's Documentation/networking/af_xdp.rst). A socket owns a UMEM, an area of
//! frames it shares with the kernel, and four rings of descriptors into it: the fill ring
//! hands the kernel empty frames to receive into, the RX ring hands them back full, the TX
//! ring hands it frames to send and the completion ring returns them once sent. No system
//! call is made a frame received; sending takes one a batch.
//!
//! The program is six eBPF instructions that redirect every frame to the socket of the
//! queue it arrived on, through an XSKMAP, and let it pass to the kernel's stack when that
//! queue has none. It is attached by a BPF link, which the kernel takes away when the
//! process ends, however it ends: a crash leaves no program behind on the interface.

use super::bpf::{self, Asm, Insn, MapType, ProgType, Size, Src, R1, R2, R3};
use super::{get_option, set_option};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

/// A mapping of memory, unmapped when dropped.
#[derive(Debug)]
struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
}

impl Mapping {
    /// `len` bytes of zeroed private memory, populated up front (frames the kernel fills
    /// are never faulted in on the receive path).
    fn anonymous(len: usize) -> io::Result<Mapping> {
        // SAFETY: a fresh anonymous mapping; no memory of ours is named.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_POPULATE,
                -1,
                0,
            )
        };
        Mapping::made(p, len)
    }

    /// The `len` bytes the kernel keeps for socket `fd` at `offset` (a ring).
    fn of_socket(fd: &OwnedFd, len: usize, offset: u64) -> io::Result<Mapping> {
        // SAFETY: a fresh shared mapping of the socket's ring; the kernel checks the
        // offset and length against the ring it made.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                fd.as_raw_fd(),
                offset as libc::off_t,
            )
        };
        Mapping::made(p, len)
    }

    fn made(p: *mut libc::c_void, len: usize) -> io::Result<Mapping> {
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast()).ok_or_else(io::Error::last_os_error)?;
        Ok(Mapping { ptr, len })
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `made`, of that length, no longer referred to.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// One of a socket's rings: entries of `T` (a power of two of them) between a producer
/// and a consumer index, both free-running. One side produces, the other consumes; `local`
/// is this side's index, published to the kernel by [`Ring::publish`].
#[derive(Debug)]
struct Ring<T> {
    map: Mapping,
    producer: usize,
    consumer: usize,
    flags: usize,
    desc: usize,
    mask: u32,
    local: u32,
    /// This side is the producer.
    produces: bool,
    entry: std::marker::PhantomData<T>,
}

impl<T: Copy> Ring<T> {
    /// Maps the ring of `size` entries at page offset `pgoff` whose layout is `off`.
    fn map(
        fd: &OwnedFd,
        size: u32,
        pgoff: u64,
        off: &libc::xdp_ring_offset,
        produces: bool,
    ) -> io::Result<Ring<T>> {
        let len = off.desc as usize + size as usize * size_of::<T>();
        let mut ring = Ring {
            map: Mapping::of_socket(fd, len, pgoff)?,
            producer: off.producer as usize,
            consumer: off.consumer as usize,
            flags: off.flags as usize,
            desc: off.desc as usize,
            mask: size - 1,
            local: 0,
            produces,
            entry: std::marker::PhantomData,
        };
        // The indices are where the kernel left them (zero on a fresh socket).
        ring.local = if produces {
            ring.index(ring.producer).load(Ordering::Relaxed)
        } else {
            ring.index(ring.consumer).load(Ordering::Relaxed)
        };
        Ok(ring)
    }

    fn index(&self, at: usize) -> &AtomicU32 {
        debug_assert!(at + 4 <= self.map.len);
        // SAFETY: the kernel's offsets place each index, 4-byte aligned, inside the
        // mapping; both sides access it atomically.
        unsafe { &*self.map.ptr.as_ptr().add(at).cast::<AtomicU32>() }
    }

    fn slot(&self, i: u32) -> *mut T {
        // SAFETY: `i & mask` is below the ring's size, so the entry lies inside the
        // mapping (`desc` plus `size` entries); entries are aligned for `T`.
        unsafe {
            self.map
                .ptr
                .as_ptr()
                .add(self.desc)
                .cast::<T>()
                .add((i & self.mask) as usize)
        }
    }

    /// Entries the kernel produced that this side has not consumed.
    fn ready(&self) -> u32 {
        self.index(self.producer)
            .load(Ordering::Acquire)
            .wrapping_sub(self.local)
    }

    /// The `i`th entry not consumed (`i < ready()`).
    fn peek(&self, i: u32) -> T {
        // SAFETY: an entry the kernel produced and released; it stays ours until the
        // consumer index passes it.
        unsafe { self.slot(self.local.wrapping_add(i)).read_volatile() }
    }

    /// Writes the next entry (the caller knows the ring has room); the kernel sees it once
    /// published.
    fn push(&mut self, v: T) {
        // SAFETY: with room, the slot is one the kernel has consumed and does not read
        // until the producer index passes it.
        unsafe { self.slot(self.local).write_volatile(v) };
        self.local = self.local.wrapping_add(1);
    }

    /// Marks `n` ready entries consumed (not yet published).
    fn consume(&mut self, n: u32) {
        self.local = self.local.wrapping_add(n);
    }

    /// Tells the kernel how far this side has come.
    fn publish(&self) {
        let at = if self.produces {
            self.producer
        } else {
            self.consumer
        };
        self.index(at).store(self.local, Ordering::Release);
    }

    /// Entries this (producing) side wrote and has not published, oldest first.
    fn unpublished(&self) -> impl Iterator<Item = T> + '_ {
        let published = self.index(self.producer).load(Ordering::Relaxed);
        (published..self.local).map(|i| {
            // SAFETY: slots this side wrote and the kernel has not been shown.
            unsafe { self.slot(i).read_volatile() }
        })
    }

    /// Takes back the entries not yet published.
    fn unwrite(&mut self) {
        self.local = self.index(self.producer).load(Ordering::Relaxed);
    }

    /// The kernel asks to be woken (by a system call) to go on with this ring.
    fn needs_wakeup(&self) -> bool {
        self.index(self.flags).load(Ordering::Relaxed) & libc::XDP_RING_NEED_WAKEUP != 0
    }
}

/// Frames a socket receives into: as many as its fill and RX rings hold.
const RX_FRAMES: u32 = 2048;
/// Frames a socket sends from: as many as its TX and completion rings hold.
const TX_FRAMES: u32 = 1024;
/// Headroom the kernel keeps before a received frame in its chunk (XDP_PACKET_HEADROOM).
const KERNEL_HEADROOM: usize = 256;

/// The chunk size (2 or 4 KiB) whose chunks hold frames of `max_frame` bytes after the
/// kernel's headroom; `None` when none does.
pub fn chunk_for(max_frame: usize) -> Option<usize> {
    [2048, 4096]
        .into_iter()
        .find(|c| max_frame + KERNEL_HEADROOM <= *c)
}

/// What [`XdpSocket::send`] did with a frame.
#[derive(Debug, PartialEq, Eq)]
pub enum Queued {
    /// Written to the TX ring; [`XdpSocket::flush`] shows it to the kernel.
    Yes,
    /// Every TX frame is in flight: not queued.
    Full,
    /// Longer than a frame of the UMEM: not queued.
    TooLong,
}

/// An AF_XDP socket bound to one receive queue of an interface, with its own UMEM.
/// Received frames are lent to a closure and their chunks given back to the kernel at
/// once; frames sent are copied into chunks of their own.
#[derive(Debug)]
pub struct XdpSocket {
    rx: Ring<libc::xdp_desc>,
    tx: Ring<libc::xdp_desc>,
    fill: Ring<u64>,
    completion: Ring<u64>,
    fd: OwnedFd,
    umem: Mapping,
    chunk: usize,
    /// TX chunks not in flight.
    free_tx: Vec<u64>,
    /// Frames shown to the kernel that it has not been asked to send.
    unsent: bool,
    /// XDP_STATISTICS' drops when last read (the kernel's counts only grow).
    drops_seen: u64,
    /// The kernel processes the queue in this socket's system calls
    /// ([`XdpSocket::poll_busily`]), so an empty ring calls to have it look.
    busy_poll: bool,
}

// SAFETY: the socket owns its mappings; it is used from one thread at a time (`&mut self`
// for everything that touches the rings).
unsafe impl Send for XdpSocket {}

impl XdpSocket {
    /// A socket on queue `queue` of interface `ifindex`, for frames of up to `max_frame`
    /// bytes. Zero-copy where the driver offers it, else the kernel copies.
    pub fn open(ifindex: u32, queue: u32, max_frame: usize) -> io::Result<XdpSocket> {
        let chunk = chunk_for(max_frame).ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("frames of {max_frame} bytes do not fit an AF_XDP chunk (3840 at most)"),
            )
        })?;
        // SAFETY: socket(2) takes no pointers; the descriptor is owned at once.
        let raw = unsafe { libc::socket(libc::AF_XDP, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
        if raw < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a descriptor just returned to us and owned by nothing else.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let frames = (RX_FRAMES + TX_FRAMES) as usize;
        let umem = Mapping::anonymous(frames * chunk)?;
        let reg = libc::xdp_umem_reg {
            addr: umem.ptr.as_ptr() as u64,
            len: umem.len as u64,
            chunk_size: chunk as u32,
            headroom: 0,
            flags: 0,
            tx_metadata_len: 0,
        };
        set_option(&fd, libc::SOL_XDP, libc::XDP_UMEM_REG, &reg)?;
        set_option(&fd, libc::SOL_XDP, libc::XDP_UMEM_FILL_RING, &RX_FRAMES)?;
        set_option(&fd, libc::SOL_XDP, libc::XDP_RX_RING, &RX_FRAMES)?;
        set_option(
            &fd,
            libc::SOL_XDP,
            libc::XDP_UMEM_COMPLETION_RING,
            &TX_FRAMES,
        )?;
        set_option(&fd, libc::SOL_XDP, libc::XDP_TX_RING, &TX_FRAMES)?;
        let off: libc::xdp_mmap_offsets = get_option(&fd, libc::SOL_XDP, libc::XDP_MMAP_OFFSETS)?;
        let mut s = XdpSocket {
            rx: Ring::map(
                &fd,
                RX_FRAMES,
                libc::XDP_PGOFF_RX_RING as u64,
                &off.rx,
                false,
            )?,
            tx: Ring::map(
                &fd,
                TX_FRAMES,
                libc::XDP_PGOFF_TX_RING as u64,
                &off.tx,
                true,
            )?,
            fill: Ring::map(
                &fd,
                RX_FRAMES,
                libc::XDP_UMEM_PGOFF_FILL_RING,
                &off.fr,
                true,
            )?,
            completion: Ring::map(
                &fd,
                TX_FRAMES,
                libc::XDP_UMEM_PGOFF_COMPLETION_RING,
                &off.cr,
                false,
            )?,
            fd,
            umem,
            chunk,
            free_tx: (RX_FRAMES..RX_FRAMES + TX_FRAMES)
                .map(|i| u64::from(i) * chunk as u64)
                .collect(),
            unsent: false,
            drops_seen: 0,
            busy_poll: false,
        };
        for i in 0..RX_FRAMES {
            s.fill.push(u64::from(i) * chunk as u64);
        }
        s.fill.publish();
        let addr = libc::sockaddr_xdp {
            sxdp_family: libc::AF_XDP as u16,
            sxdp_flags: libc::XDP_USE_NEED_WAKEUP,
            sxdp_ifindex: ifindex,
            sxdp_queue_id: queue,
            sxdp_shared_umem_fd: 0,
        };
        // SAFETY: `addr` is a sockaddr_xdp of the length given, alive for the call.
        let bound = unsafe {
            libc::bind(
                s.fd.as_raw_fd(),
                (&raw const addr).cast(),
                size_of::<libc::sockaddr_xdp>() as u32,
            )
        };
        if bound < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(s)
    }

    /// Whether the kernel hands frames over in place (the driver's zero-copy AF_XDP)
    /// rather than copying them (XDP_OPTIONS).
    pub fn zero_copy(&self) -> bool {
        get_option::<libc::xdp_options>(&self.fd, libc::SOL_XDP, libc::XDP_OPTIONS)
            .is_ok_and(|o| o.flags & libc::XDP_OPTIONS_ZEROCOPY != 0)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.fd.as_fd()
    }

    /// Has the kernel run the driver's receive and transmit work for this socket's queue in
    /// the socket's own system calls, taking up to `budget` frames a call, in preference to
    /// its interrupts (preferred busy polling, Linux 5.11: Documentation/networking/napi.rst
    /// "Busy polling"). The caller then polls without sleeping: [`XdpSocket::receive`] on
    /// an empty ring and [`XdpSocket::flush`] each make the call. Interrupts stay off while
    /// the calls come, where the interface defers them (`napi_defer_hard_irqs`,
    /// `gro_flush_timeout`; see [`crate::sys::interrupts_deferred`]).
    pub fn poll_busily(&mut self, budget: u16) -> io::Result<()> {
        // How long one call may spin in the driver for frames: the calls never wait
        // (MSG_DONTWAIT), so this only has to be nonzero for the kernel to poll at all.
        const SPIN_US: i32 = 20;
        set_option(&self.fd, libc::SOL_SOCKET, libc::SO_PREFER_BUSY_POLL, &1i32)?;
        set_option(&self.fd, libc::SOL_SOCKET, libc::SO_BUSY_POLL, &SPIN_US)?;
        let budget = i32::from(budget);
        set_option(
            &self.fd,
            libc::SOL_SOCKET,
            libc::SO_BUSY_POLL_BUDGET,
            &budget,
        )?;
        self.busy_poll = true;
        Ok(())
    }

    /// Lends the next frame received to `f`, then gives its chunk back to the kernel;
    /// `None` when none waits.
    pub fn receive<R>(&mut self, f: impl FnOnce(&[u8]) -> R) -> Option<R> {
        if self.rx.ready() == 0 {
            // The kernel stops filling when it ran out of chunks and waits to be told
            // there are more (the chunks are back; the wakeup was missed). Busy polling,
            // nothing fills it but these calls.
            if self.busy_poll || self.fill.needs_wakeup() {
                self.wake_receive();
            }
            return None;
        }
        let d = self.rx.peek(0);
        let (at, len) = (d.addr as usize, d.len as usize);
        let r = (at + len <= self.umem.len).then(|| {
            // SAFETY: the kernel wrote the frame into our UMEM, inside it (checked), and
            // gave it to us; nothing writes the chunk until it is back on the fill ring.
            f(unsafe { std::slice::from_raw_parts(self.umem.ptr.as_ptr().add(at), len) })
        });
        self.rx.consume(1);
        self.rx.publish();
        // RX chunks number as many as the fill ring holds, so it has room for this one.
        self.fill.push(d.addr - d.addr % self.chunk as u64);
        self.fill.publish();
        r
    }

    /// Queues `frame` for sending at the next [`XdpSocket::flush`].
    pub fn send(&mut self, frame: &[u8]) -> Queued {
        if frame.len() > self.chunk {
            return Queued::TooLong;
        }
        // A batch's frames fit the TX chunks with room to spare: they run short only when
        // the kernel has not sent the last batches yet.
        self.reclaim();
        let Some(at) = self.free_tx.pop() else {
            return Queued::Full;
        };
        // SAFETY: the chunk is a TX chunk not in flight (off the free list), inside the
        // UMEM; the kernel reads it only once its descriptor is published below.
        unsafe {
            std::ptr::copy_nonoverlapping(
                frame.as_ptr(),
                self.umem.ptr.as_ptr().add(at as usize),
                frame.len(),
            );
        }
        // TX chunks number as many as the TX ring holds.
        self.tx.push(libc::xdp_desc {
            addr: at,
            len: frame.len() as u32,
            options: 0,
        });
        Queued::Yes
    }

    /// Frames queued or shown to the kernel and not yet sent.
    pub fn pending(&self) -> bool {
        self.unsent || self.tx.unpublished().next().is_some()
    }

    /// Has the kernel send the frames queued, or, when the interface is not `up`, drops
    /// them (a kernel shown frames while its interface is down would keep them and send
    /// them, stale, once it is up): how many it dropped. Errors are the interface's (gone):
    /// the frames shown stay for the next flush.
    pub fn flush(&mut self, up: bool) -> io::Result<usize> {
        if !up {
            let free = self.free_tx.len();
            self.free_tx.extend(self.tx.unpublished().map(|d| d.addr));
            self.tx.unwrite();
            return Ok(self.free_tx.len() - free);
        }
        if self.tx.unpublished().next().is_some() {
            self.tx.publish();
            self.unsent = true;
        }
        if !self.unsent {
            return Ok(0);
        }
        // The kernel sends at most a few dozen frames a call (then says EAGAIN), and a
        // zero-copy driver needs no call unless it asks.
        for _ in 0..=(TX_FRAMES / 16) {
            if !self.busy_poll && !self.tx.needs_wakeup() {
                break;
            }
            // SAFETY: sendto(2) with no data and no address only wakes the kernel.
            let r = unsafe {
                libc::sendto(
                    self.fd.as_raw_fd(),
                    std::ptr::null(),
                    0,
                    libc::MSG_DONTWAIT,
                    std::ptr::null(),
                    0,
                )
            };
            if r >= 0 {
                break;
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN | libc::EBUSY | libc::EINTR) => {}
                // No buffers now: the rest go at the next flush.
                Some(libc::ENOBUFS) => return Ok(0),
                _ => return Err(e),
            }
        }
        self.unsent = false;
        Ok(0)
    }

    /// Takes back the TX chunks the kernel has sent.
    fn reclaim(&mut self) {
        let n = self.completion.ready();
        for i in 0..n {
            self.free_tx.push(self.completion.peek(i));
        }
        if n > 0 {
            self.completion.consume(n);
            self.completion.publish();
        }
    }

    /// Wakes the kernel to receive (recvfrom(2) with nothing to take).
    fn wake_receive(&self) {
        // SAFETY: recvfrom(2) into no buffer, with no address.
        unsafe {
            libc::recvfrom(
                self.fd.as_raw_fd(),
                std::ptr::null_mut(),
                0,
                libc::MSG_DONTWAIT,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
            );
        }
    }

    /// Frames the kernel dropped since the last call: for want of room in the RX ring or
    /// of a chunk to copy into (XDP_STATISTICS; its count of empty fill-ring reads is of
    /// attempts, not frames, and left out).
    pub fn drops(&mut self) -> io::Result<u64> {
        let s: libc::xdp_statistics = get_option(&self.fd, libc::SOL_XDP, libc::XDP_STATISTICS)?;
        let total = s.rx_dropped + s.rx_ring_full;
        let new = total.saturating_sub(self.drops_seen);
        self.drops_seen = total;
        Ok(new)
    }
}

/// The steering program: `return bpf_redirect_map(&xsks, ctx->rx_queue_index, XDP_PASS)`.
fn steering_program(map: BorrowedFd) -> Vec<Insn> {
    const RX_QUEUE_INDEX: i16 = 16; // offsetof(struct xdp_md, rx_queue_index)
    const XDP_PASS: i32 = 2;
    let mut a = Asm::default();
    a.load(Size::W, R2, R1, RX_QUEUE_INDEX);
    a.map(R1, map);
    // The low bits of the flags are the action when the queue has no socket.
    a.mov(R3, Src::K(XDP_PASS));
    a.call(bpf::REDIRECT_MAP);
    a.exit();
    a.finish()
}

/// The steering program attached to an interface, with its map of sockets by queue. The
/// program stays attached while this lives.
#[derive(Debug)]
pub struct XdpSteering {
    _link: OwnedFd,
    _program: OwnedFd,
    _map: OwnedFd,
}

impl XdpSteering {
    /// Attaches steering to interface `ifindex`, sending frames of queue `q` to
    /// `sockets[q]`. In the driver's own XDP hook where it has one, else the kernel's
    /// generic one.
    pub fn attach(ifindex: u32, sockets: &[XdpSocket]) -> io::Result<XdpSteering> {
        let entries = sockets.len().max(1) as u32;
        let map = bpf::create_map(MapType::XskMap, 4, 4, entries, "dpuflow_xsks")?;
        for (q, s) in sockets.iter().enumerate() {
            bpf::update_map(map.as_fd(), &(q as u32), &(s.fd.as_raw_fd() as u32))?;
        }
        let code = steering_program(map.as_fd());
        let program = bpf::load(ProgType::Xdp, &code, "dpuflow_steer")?;
        let link = bpf::attach_xdp(program.as_fd(), ifindex)?;
        Ok(XdpSteering {
            _link: link,
            _program: program,
            _map: map,
        })
    }
}
