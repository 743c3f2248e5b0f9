//! The system calls dpuflow makes, each through one function here, so the rest of the
//! crate stays free of `unsafe`.

#![allow(unsafe_code)]

/// Asks the kernel to back the allocation of `v` (its whole capacity) with transparent
/// huge pages, before anything is written to it. A hint: failure changes nothing but
/// speed. Large tables probed at random (connection tracking) otherwise spend much of
/// their time in TLB misses.
pub fn advise_huge_pages<T>(v: &mut Vec<T>) {
    #[cfg(target_os = "linux")]
    {
        const PAGE: usize = 4096;
        let start = v.as_mut_ptr() as usize;
        let end = start + v.capacity() * size_of::<T>();
        let aligned = start.next_multiple_of(PAGE);
        if end > aligned + PAGE {
            // SAFETY: the range lies inside `v`'s allocation, which `v` owns and keeps
            // alive; madvise(MADV_HUGEPAGE) changes only how the kernel backs the pages,
            // never their contents or validity.
            unsafe {
                libc::madvise(
                    aligned as *mut libc::c_void,
                    end - aligned,
                    libc::MADV_HUGEPAGE,
                );
            }
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = v;
}

/// Lets SIGPIPE end the process, as command-line tools do: `dpuflow acl classify … | head`
/// then stops quietly when `head` exits, instead of failing on its next write. Not for the
/// service, whose sockets must see EPIPE rather than die with a client.
pub fn die_on_broken_pipe() {
    #[cfg(unix)]
    // SAFETY: resetting a signal's disposition to the default affects no memory; no
    // handler of ours is installed for SIGPIPE.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// Memory the kernel says is available for new allocations without swapping
/// (`MemAvailable` in /proc/meminfo), in bytes; `None` where it does not say.
pub fn available_memory() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kib = info
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))?
        .trim()
        .strip_suffix("kB")?
        .trim()
        .parse::<u64>()
        .ok()?;
    Some(kib * 1024)
}

/// The index of network interface `name` (if_nametoindex(3)).
#[cfg(target_os = "linux")]
pub fn interface_index(name: &str) -> std::io::Result<u32> {
    let c = std::ffi::CString::new(name)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "NUL in a name"))?;
    // SAFETY: `c` is a NUL-terminated string that outlives the call.
    match unsafe { libc::if_nametoindex(c.as_ptr()) } {
        0 => Err(std::io::Error::last_os_error()),
        i => Ok(i),
    }
}

/// A raw AF_PACKET socket (packet(7)) bound to interface `ifindex`: it receives every frame
/// the interface receives (promiscuous; not the frames sent through it, by this socket or
/// the host) and sends whole Ethernet frames out of it. Non-blocking.
#[cfg(target_os = "linux")]
pub fn packet_socket(ifindex: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    let last = std::io::Error::last_os_error;
    // Protocol 0 until bound: a socket made for ETH_P_ALL would take in frames of every
    // interface until `bind` narrows it to one.
    // SAFETY: socket(2) takes no pointers; the descriptor it returns is owned at once.
    let fd = unsafe {
        libc::socket(
            libc::AF_PACKET,
            libc::SOCK_RAW | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        )
    };
    if fd < 0 {
        return Err(last());
    }
    // SAFETY: `fd` is a descriptor just returned to us and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let all = (libc::ETH_P_ALL as u16).to_be();
    // SAFETY: sockaddr_ll is plain data, valid zeroed.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = all;
    addr.sll_ifindex = ifindex as i32;
    // SAFETY: `addr` is a sockaddr_ll of the length given, alive for the call.
    let bound = unsafe {
        libc::bind(
            fd.as_raw_fd(),
            (&raw const addr).cast(),
            size_of::<libc::sockaddr_ll>() as u32,
        )
    };
    if bound < 0 {
        return Err(last());
    }
    let promisc = libc::packet_mreq {
        mr_ifindex: ifindex as i32,
        mr_type: libc::PACKET_MR_PROMISC as u16,
        mr_alen: 0,
        mr_address: [0; 8],
    };
    set_option(&fd, libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, &promisc)?;
    set_option(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &1i32)?;
    // What the interface took out of each frame or left unfinished (see `receive`).
    set_option(&fd, libc::SOL_PACKET, libc::PACKET_AUXDATA, &1i32)?;
    // Room for bursts while the I/O thread is busy: the default holds a few hundred
    // small frames. Past net.core.rmem_max only with CAP_NET_ADMIN; else up to it.
    let room = RECEIVE_BUFFER;
    if set_option(&fd, libc::SOL_SOCKET, libc::SO_RCVBUFFORCE, &room).is_err() {
        set_option(&fd, libc::SOL_SOCKET, libc::SO_RCVBUF, &room)?;
    }
    Ok(fd)
}

/// The receive buffer asked for a live port's socket, in bytes (the kernel counts each
/// frame's whole buffer: about 5000 small frames).
#[cfg(target_os = "linux")]
const RECEIVE_BUFFER: i32 = 4 << 20;

/// setsockopt(2).
#[cfg(target_os = "linux")]
fn set_option<T>(
    fd: &std::os::fd::OwnedFd,
    level: i32,
    name: i32,
    value: &T,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `value` points at a live T of the size given.
    let r = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (value as *const T).cast(),
            size_of::<T>() as u32,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// What the kernel says of a frame beside its bytes (PACKET_AUXDATA, packet(7)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameAux {
    /// The VLAN tag the interface took out of the frame (TPID, TCI), to be put back.
    pub vlan: Option<(u16, u16)>,
    /// The L4 checksum was left for hardware to finish (a frame sent by this host or
    /// across a virtual link): it holds only the pseudo-header's sum.
    pub checksum_partial: bool,
}

/// Receives one frame into `buf`: its whole length (more than `buf` holds when it was cut
/// short) and what the kernel says of it, or `None` when none waits.
#[cfg(target_os = "linux")]
pub fn receive(
    fd: std::os::fd::BorrowedFd,
    buf: &mut [u8],
) -> std::io::Result<Option<(usize, FrameAux)>> {
    use std::os::fd::AsRawFd;
    // Room for one control message holding a tpacket_auxdata.
    #[repr(C, align(8))]
    struct Control([u8; 64]);
    let mut control = Control([0; 64]);
    loop {
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: msghdr is plain data, valid zeroed.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &raw mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = control.0.len();
        // SAFETY: `msg` points at `iov` (describing `buf`, writable for its length) and at
        // `control`, both alive and unaliased during the call.
        let n = unsafe { libc::recvmsg(fd.as_raw_fd(), &raw mut msg, libc::MSG_TRUNC) };
        if n >= 0 {
            return Ok(Some((n as usize, frame_aux(&msg))));
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(None),
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
}

/// The PACKET_AUXDATA control message of a received frame, read.
#[cfg(target_os = "linux")]
fn frame_aux(msg: &libc::msghdr) -> FrameAux {
    let mut aux = FrameAux::default();
    // SAFETY: `msg` was filled by recvmsg(2); the CMSG macros walk its control buffer
    // within `msg_controllen`, and the auxdata is read unaligned from a message of its
    // level and type.
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(msg);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_PACKET && (*c).cmsg_type == libc::PACKET_AUXDATA {
                let a: libc::tpacket_auxdata = std::ptr::read_unaligned(libc::CMSG_DATA(c).cast());
                // A tag of 0 with TCI 0 is "none" on kernels without the VALID bit.
                if a.tp_status & libc::TP_STATUS_VLAN_VALID != 0 || a.tp_vlan_tci != 0 {
                    let tpid = if a.tp_status & libc::TP_STATUS_VLAN_TPID_VALID != 0 {
                        a.tp_vlan_tpid
                    } else {
                        0x8100
                    };
                    aux.vlan = Some((tpid, a.tp_vlan_tci));
                }
                aux.checksum_partial = a.tp_status & libc::TP_STATUS_CSUMNOTREADY != 0;
            }
            c = libc::CMSG_NXTHDR(msg, c);
        }
    }
    aux
}

/// Sends one frame; false when the interface's queue is full (the frame is not sent).
#[cfg(target_os = "linux")]
pub fn send(fd: std::os::fd::BorrowedFd, frame: &[u8]) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    loop {
        // SAFETY: `frame` is readable for its length during the call.
        let n = unsafe { libc::send(fd.as_raw_fd(), frame.as_ptr().cast(), frame.len(), 0) };
        if n >= 0 {
            return Ok(true);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(false),
            std::io::ErrorKind::Interrupted => {}
            _ => return Err(e),
        }
    }
}

/// Descriptors to wait on until one has something to read (poll(2)), kept between waits
/// so that waiting allocates nothing.
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub struct Readable(Vec<libc::pollfd>);

#[cfg(target_os = "linux")]
impl Readable {
    pub fn new(fds: &[std::os::fd::BorrowedFd]) -> Readable {
        use std::os::fd::AsRawFd;
        Readable(
            fds.iter()
                .map(|fd| libc::pollfd {
                    fd: fd.as_raw_fd(),
                    events: libc::POLLIN,
                    revents: 0,
                })
                .collect(),
        )
    }

    /// Waits until one of the descriptors has something to read, or `timeout` passes.
    /// The descriptors must still be open.
    pub fn wait(&mut self, timeout: std::time::Duration) -> std::io::Result<()> {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: the vector holds `len` pollfd structures, writable during the call.
        let r = unsafe { libc::poll(self.0.as_mut_ptr(), self.0.len() as libc::nfds_t, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
        }
        Ok(())
    }
}
