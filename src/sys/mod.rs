//! The system calls dpuflow makes, each through one function here, so the rest of the
//! crate stays free of `unsafe`.

#![allow(unsafe_code)]

#[cfg(target_os = "linux")]
pub mod bpf;
pub mod cgroup;
#[cfg(target_os = "linux")]
pub mod ring;
#[cfg(target_os = "linux")]
pub mod xdp;

/// A table of `n` copies of `value`, in memory the kernel is asked to back with
/// transparent huge pages, and all written now: large tables probed at random
/// (connections, flows) otherwise spend much of their time in TLB misses, and a packet
/// that touched a page first would wait for the kernel to fault it in.
pub fn huge_table<T: Clone>(n: usize, value: T) -> Vec<T> {
    let mut v = Vec::with_capacity(n);
    advise_huge_pages(&mut v);
    v.resize(n, value);
    v
}

/// Asks the kernel to back the allocation of `v` (its whole capacity) with transparent
/// huge pages, before anything is written to it. A hint: failure changes nothing but
/// speed.
fn advise_huge_pages<T>(v: &mut Vec<T>) {
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

/// Memory available for new allocations without swapping, in bytes: what the kernel says
/// the machine has, or less where the control groups this process is in leave less
/// ([`cgroup::memory_room`]: a container's limit, a systemd unit's `MemoryMax=`); `None`
/// where neither says.
pub fn available_memory() -> Option<u64> {
    match (machine_memory_available(), cgroup::memory_room()) {
        (Some(machine), Some(group)) => Some(machine.min(group)),
        (machine, group) => machine.or(group),
    }
}

/// `MemAvailable` in /proc/meminfo, in bytes.
fn machine_memory_available() -> Option<u64> {
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

/// The CPU time (user and system, in seconds) of each of this process's threads, by
/// thread name, from /proc/self/task/*/stat (proc(5): `utime` and `stime`, fields 14 and
/// 15, in clock ticks).
pub fn thread_cpu_seconds() -> Vec<(String, f64)> {
    // SAFETY: sysconf reads a configuration value; it has no preconditions.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return Vec::new();
    };
    let per_tick = 1.0 / ticks.max(1) as f64;
    tasks
        .flatten()
        .filter_map(|task| {
            let stat = std::fs::read_to_string(task.path().join("stat")).ok()?;
            // The name is between the first '(' and the last ')': it may hold either.
            let (head, rest) = stat.rsplit_once(')')?;
            let name = head.split_once('(')?.1.to_owned();
            let mut fields = rest.split_whitespace().skip(11);
            let utime: u64 = fields.next()?.parse().ok()?;
            let stime: u64 = fields.next()?.parse().ok()?;
            Some((name, (utime + stime) as f64 * per_tick))
        })
        .collect()
}

/// What Prometheus's client libraries report of a process as `process_*` metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct ProcessStats {
    /// User and system CPU time, in seconds.
    pub cpu_seconds: f64,
    pub resident_bytes: u64,
    pub virtual_bytes: u64,
    pub threads: u64,
    /// When the process started, in seconds since 1970.
    pub start_seconds: f64,
    pub open_fds: u64,
    /// The soft limit on open file descriptors.
    pub max_fds: u64,
}

/// This process's [`ProcessStats`], from /proc/self/stat (proc(5): `utime`, `stime`,
/// `num_threads`, `starttime`, `vsize`, `rss`: fields 14, 15, 20, 22, 23, 24), the boot
/// time in /proc/stat, /proc/self/fd and getrlimit(2); `None` where /proc does not say.
pub fn process_stats() -> Option<ProcessStats> {
    // SAFETY: sysconf reads configuration values; it has no preconditions.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let per_tick = 1.0 / ticks.max(1) as f64;
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the name, which is in parentheses and may hold anything: the first
    // of these is field 3.
    let fields: Vec<u64> = stat
        .rsplit_once(')')?
        .1
        .split_whitespace()
        .skip(1)
        .map(|f| f.parse().unwrap_or(0))
        .collect();
    let field = |n: usize| fields.get(n - 4).copied();
    let boot: u64 = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    let max_fds = open_file_limit().map_or(0, |l| l.rlim_cur);
    Some(ProcessStats {
        cpu_seconds: (field(14)? + field(15)?) as f64 * per_tick,
        resident_bytes: field(24)? * page.max(0) as u64,
        virtual_bytes: field(23)?,
        threads: field(20)?,
        start_seconds: boot as f64 + field(22)? as f64 * per_tick,
        // Less the one that reads the directory.
        open_fds: (std::fs::read_dir("/proc/self/fd").ok()?.count() as u64).saturating_sub(1),
        max_fds,
    })
}

/// This process's soft and hard limits on open file descriptors (getrlimit(2)).
fn open_file_limit() -> std::io::Result<libc::rlimit> {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes only the rlimit it is given, which lives on this stack.
    match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } {
        0 => Ok(limit),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// The logical sector size of the block device open as `file` (the `BLKSSZGET` ioctl):
/// the unit in which direct I/O to it must be aligned, in offset, length and memory.
#[cfg(target_os = "linux")]
pub fn logical_sector_size(file: &std::fs::File) -> std::io::Result<u32> {
    use std::os::fd::AsRawFd;
    let mut size: libc::c_int = 0;
    // SAFETY: BLKSSZGET writes one int, to `size` on this stack; the descriptor is open
    // for as long as `file` is borrowed.
    if unsafe { libc::ioctl(file.as_raw_fd(), libc::BLKSSZGET, &mut size) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    u32::try_from(size)
        .ok()
        .filter(|s| s.is_power_of_two())
        .ok_or_else(|| std::io::Error::other(format!("sector size {size}")))
}

/// Tells the block device open as `file` that `len` bytes at `offset` no longer hold data
/// (the `BLKDISCARD` ioctl: TRIM on an SSD, deallocation on a thin device); both must be
/// whole logical sectors.
#[cfg(target_os = "linux")]
pub fn discard_device_range(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    /// `_IO(0x12, 119)`, include/uapi/linux/fs.h
    const BLKDISCARD: libc::c_ulong = 0x1277;
    let range: [u64; 2] = [offset, len];
    // SAFETY: BLKDISCARD reads two u64s, start and length, from `range` on this stack; the
    // descriptor is open for as long as `file` is borrowed.
    if unsafe { libc::ioctl(file.as_raw_fd(), BLKDISCARD, &range) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Frees the file system's blocks under `len` bytes of `file` at `offset`, its length
/// unchanged (`fallocate(2)` with `FALLOC_FL_PUNCH_HOLE`): the range then reads as zeros.
#[cfg(target_os = "linux")]
pub fn punch_hole(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(len)) = (libc::off_t::try_from(offset), libc::off_t::try_from(len)) else {
        return Err(std::io::Error::from_raw_os_error(libc::EFBIG));
    };
    let mode = libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE;
    // SAFETY: fallocate takes only integers; the descriptor is open for as long as `file`
    // is borrowed.
    if unsafe { libc::fallocate(file.as_raw_fd(), mode, offset, len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The most bytes the block device open as `file` discards in one request
/// (`queue/discard_max_bytes` in sysfs): 0 when it takes no discards.
#[cfg(target_os = "linux")]
pub fn device_discard_max_bytes(file: &std::fs::File) -> std::io::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let rdev = file.metadata()?.rdev();
    let dev = format!("/sys/dev/block/{}:{}", libc::major(rdev), libc::minor(rdev));
    // A partition's queue is its disk's, the directory above.
    let mut path = format!("{dev}/queue/discard_max_bytes");
    if !std::path::Path::new(&path).exists() {
        path = format!("{dev}/../queue/discard_max_bytes");
    }
    let text = std::fs::read_to_string(&path)?;
    text.trim()
        .parse()
        .map_err(|_| std::io::Error::other(format!("{path}: {}", text.trim())))
}

/// What direct I/O (`O_DIRECT`) to the file open as `file` must be aligned to, in offset,
/// length and memory: the larger of the two alignments statx(2) reports
/// (`STATX_DIOALIGN`, Linux 6.1); `None` where its file system takes no direct I/O.
#[cfg(target_os = "linux")]
pub fn direct_io_alignment(file: &std::fs::File) -> std::io::Result<Option<u32>> {
    use std::os::fd::AsRawFd;
    /// include/uapi/linux/stat.h
    const STATX_DIOALIGN: libc::c_uint = 0x2000;
    // SAFETY: statx is plain data, for which all zeroes is a valid value.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: the path is a NUL-terminated empty string, which with AT_EMPTY_PATH names
    // the open descriptor itself; statx writes only the struct it is given, on this stack.
    let rc = unsafe {
        libc::statx(
            file.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH,
            STATX_DIOALIGN,
            &mut stx,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let align = stx.stx_dio_offset_align.max(stx.stx_dio_mem_align);
    Ok((stx.stx_mask & STATX_DIOALIGN != 0 && stx.stx_dio_offset_align != 0).then_some(align))
}

/// Hands the memory the allocator holds free back to the system (malloc_trim(3)): after a
/// reload has let go of a large program, whose many allocations the allocator would
/// otherwise keep for itself.
pub fn release_free_memory() {
    #[cfg(target_env = "gnu")]
    // SAFETY: malloc_trim only releases free memory of the allocator's own; it touches no
    // allocation in use.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Has the allocator give every allocation of `bytes` or more a mapping of its own, unmapped
/// when it is freed (mallopt(3) `M_MMAP_THRESHOLD`; setting it also stops glibc from
/// raising that bound by itself each time such a block is freed). Otherwise, once large
/// blocks have come and gone, glibc serves the next ones from its per-thread arenas and
/// keeps their memory when they are freed: the KV-cache's clients, a thread each, left
/// hundreds of MiB resident after a burst of large values.
pub fn map_large_allocations(bytes: usize) {
    #[cfg(target_env = "gnu")]
    // SAFETY: mallopt changes only where the allocator places later allocations; it
    // touches no allocation in use.
    unsafe {
        libc::mallopt(
            libc::M_MMAP_THRESHOLD,
            libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX),
        );
    }
    #[cfg(not(target_env = "gnu"))]
    let _ = bytes;
}

/// Raises this process's soft limit on open file descriptors to its hard limit
/// (getrlimit(2), setrlimit(2)) and returns the limit now in force. A soft limit of 1024
/// (systemd's and most shells' default) would run out before the KV-cache's clients did.
/// dpuflow waits with poll(2), never select(2), so descriptors past 1024 are safe.
pub fn raise_fd_limit() -> std::io::Result<u64> {
    let mut limit = open_file_limit()?;
    if limit.rlim_cur < limit.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: limit.rlim_max,
            ..limit
        };
        // SAFETY: setrlimit reads only the rlimit it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } != 0 {
            return Err(std::io::Error::last_os_error());
        }
        limit = raised;
    }
    Ok(limit.rlim_cur)
}

/// The CPUs the calling thread may run on (sched_getaffinity(2)), ascending.
#[cfg(target_os = "linux")]
pub fn allowed_cpus() -> std::io::Result<Vec<usize>> {
    // SAFETY: cpu_set_t is plain data, valid zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a writable cpu_set_t of the size passed; pid 0 is the caller.
    if unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let bits = 8 * size_of::<libc::cpu_set_t>();
    // SAFETY: CPU_ISSET reads bit `cpu` of `set`, below the set's size.
    Ok((0..bits)
        .filter(|&cpu| unsafe { libc::CPU_ISSET(cpu, &set) })
        .collect())
}

/// Lets the calling thread run on `cpus` only (sched_setaffinity(2)); threads it starts
/// afterwards inherit that.
#[cfg(target_os = "linux")]
pub fn bind_thread(cpus: &[usize]) -> std::io::Result<()> {
    // SAFETY: cpu_set_t is plain data, valid zeroed.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &cpu in cpus {
        if cpu >= 8 * size_of::<libc::cpu_set_t>() {
            return Err(std::io::Error::from_raw_os_error(libc::EINVAL));
        }
        // SAFETY: `cpu` is below the set's size (checked above).
        unsafe { libc::CPU_SET(cpu, &mut set) };
    }
    // SAFETY: `set` is a cpu_set_t of the size passed, read during the call; pid 0 is the
    // caller.
    if unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
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

/// Whether interface `name` defers its interrupts while its queues are busy-polled
/// (`napi_defer_hard_irqs` and `gro_flush_timeout` both nonzero in /sys/class/net/NAME:
/// Documentation/networking/napi.rst); `None` where the kernel has neither (before 5.11).
pub fn interrupts_deferred(name: &str) -> Option<bool> {
    let read = |what: &str| -> Option<u64> {
        let text = std::fs::read_to_string(format!("/sys/class/net/{name}/{what}")).ok()?;
        text.trim().parse().ok()
    };
    Some(read("napi_defer_hard_irqs")? > 0 && read("gro_flush_timeout")? > 0)
}

/// Whether interface `name` is up (administratively: IFF_UP, SIOCGIFFLAGS in netdevice(7)),
/// asked through `fd`, a socket of a family that answers interface requests (not AF_XDP).
#[cfg(target_os = "linux")]
pub fn interface_up(fd: std::os::fd::BorrowedFd, name: &str) -> std::io::Result<bool> {
    use std::os::fd::AsRawFd;
    // SAFETY: ifreq is plain data, valid zeroed.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    let bytes = name.as_bytes();
    if bytes.len() >= req.ifr_name.len() {
        return Err(std::io::Error::from_raw_os_error(libc::ENAMETOOLONG));
    }
    for (d, s) in req.ifr_name.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    // SAFETY: `req` is an ifreq with a NUL-terminated name, live and writable for the call.
    let r = unsafe { libc::ioctl(fd.as_raw_fd(), libc::SIOCGIFFLAGS, &raw mut req) };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS fills the union's flags member.
    let flags = unsafe { req.ifr_ifru.ifru_flags };
    Ok(flags & libc::IFF_UP as libc::c_short != 0)
}

/// A raw AF_PACKET socket (packet(7)), not yet bound to an interface (see
/// [`bind_packet_socket`]): it will send whole Ethernet frames, each behind a virtio-net
/// header, and not see the frames sent through its interface. Non-blocking.
#[cfg(target_os = "linux")]
pub fn packet_socket() -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
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
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor just returned to us and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    set_option(&fd, libc::SOL_PACKET, libc::PACKET_IGNORE_OUTGOING, &1i32)?;
    // Frames come and go with a virtio-net header (below), which says where a checksum
    // left for hardware is, tunnelled or not.
    set_option(&fd, libc::SOL_PACKET, PACKET_VNET_HDR, &1i32)?;
    Ok(fd)
}

/// Binds packet socket `fd` ([`packet_socket`]) to interface `ifindex` for frames of every
/// protocol, which it then receives promiscuously.
///
/// Done last, once the socket's ring is set: setting a ring takes a socket off its
/// interface for a while, and since the kernel's 2025 fix of a race between
/// packet_set_ring() and packet_notifier() (in the stable series too) an interface that
/// comes up meanwhile leaves a socket bound while it was down receiving nothing until the
/// next down and up.
#[cfg(target_os = "linux")]
pub fn bind_packet_socket(fd: &std::os::fd::OwnedFd, ifindex: u32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: sockaddr_ll is plain data, valid zeroed.
    let mut addr: libc::sockaddr_ll = unsafe { std::mem::zeroed() };
    addr.sll_family = libc::AF_PACKET as u16;
    addr.sll_protocol = (libc::ETH_P_ALL as u16).to_be();
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
        return Err(std::io::Error::last_os_error());
    }
    hold_promiscuous(fd, ifindex)
}

/// Puts bound packet socket `fd` in fanout group `id` of its interface (packet(7),
/// PACKET_FANOUT), or with `None` in a new group whose id the kernel picks
/// (PACKET_FANOUT_FLAG_UNIQUEID); returns the group's id. The members share the frames the
/// interface receives, each flow's to one member (PACKET_FANOUT_HASH, the kernel's flow
/// hash; or with `steered`, PACKET_FANOUT_EBPF, the member a program picks: see
/// [`steer_fanout`]), and none that it sends (PACKET_FANOUT_FLAG_IGNORE_OUTGOING: in a group, the
/// socket's own PACKET_IGNORE_OUTGOING no longer applies). A kernel that does not know the
/// flag refuses it; the group is then made without, and its members are handed those
/// frames, marked outgoing ([`FrameAux::outgoing`]).
#[cfg(target_os = "linux")]
pub fn join_fanout(
    fd: std::os::fd::BorrowedFd,
    id: Option<u16>,
    steered: bool,
) -> std::io::Result<u16> {
    let new = if id.is_none() {
        libc::PACKET_FANOUT_FLAG_UNIQUEID
    } else {
        0
    };
    let kind = if steered {
        libc::PACKET_FANOUT_EBPF
    } else {
        libc::PACKET_FANOUT_HASH
    };
    let join = |flags: u32| {
        let mode = kind | new | flags;
        set_option(
            fd,
            libc::SOL_PACKET,
            libc::PACKET_FANOUT,
            &(u32::from(id.unwrap_or(0)) | mode << 16),
        )
    };
    match join(libc::PACKET_FANOUT_FLAG_IGNORE_OUTGOING) {
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => join(0)?,
        joined => joined?,
    }
    let value: u32 = get_option(fd, libc::SOL_PACKET, libc::PACKET_FANOUT)?;
    // The group's id in the low 16 bits, its mode and flags above.
    Ok(value as u16)
}

/// Sets the program that picks the member of packet socket `fd`'s fanout group for each
/// frame (PACKET_FANOUT_DATA; the group made with `steered`): a socket-filter program,
/// whose result, modulo the members, indexes them in the order they joined.
#[cfg(target_os = "linux")]
pub fn steer_fanout(
    fd: std::os::fd::BorrowedFd,
    program: std::os::fd::BorrowedFd,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    set_option(
        fd,
        libc::SOL_PACKET,
        libc::PACKET_FANOUT_DATA,
        &(program.as_raw_fd() as u32),
    )
}

/// Makes packet socket `fd` take no frame (a classic BPF filter keeping none,
/// SO_ATTACH_FILTER), or with `false` every frame again (SO_DETACH_FILTER): a socket
/// joining a fanout group must be bound first, and between the two it would be handed
/// copies of frames the group's members already have.
#[cfg(target_os = "linux")]
pub fn refuse_frames(fd: std::os::fd::BorrowedFd, refuse: bool) -> std::io::Result<()> {
    if !refuse {
        return set_option(fd, libc::SOL_SOCKET, libc::SO_DETACH_FILTER, &0i32);
    }
    // BPF_RET | BPF_K with 0: keep no byte of the frame.
    let mut keep_none = [libc::sock_filter {
        code: 0x06,
        jt: 0,
        jf: 0,
        k: 0,
    }];
    let program = libc::sock_fprog {
        len: 1,
        filter: keep_none.as_mut_ptr(),
    };
    set_option(fd, libc::SOL_SOCKET, libc::SO_ATTACH_FILTER, &program)
}

/// The socket option that puts a virtio-net header before each frame received and
/// expects one before each frame sent (linux/if_packet.h).
#[cfg(target_os = "linux")]
const PACKET_VNET_HDR: i32 = 15;

/// struct virtio_net_hdr (linux/virtio_net.h; the virtio 1.x spec §5.1.6), in the host's
/// byte order as packet sockets use it: flags, GSO type, header length, GSO size, checksum
/// start and offset.
#[cfg(target_os = "linux")]
const VNET_HDR_LEN: usize = 10;

/// VIRTIO_NET_HDR_F_NEEDS_CSUM: the checksum at `csum_start + csum_offset` is to be
/// finished over the bytes from `csum_start` on.
#[cfg(target_os = "linux")]
const VNET_NEEDS_CSUM: u8 = 1;

/// Keeps interface `ifindex` promiscuous while the returned socket is open (the kernel
/// counts such holders and drops the mode with the last): a packet socket of protocol 0,
/// which receives nothing, with a promiscuous membership.
#[cfg(target_os = "linux")]
pub fn promiscuous(ifindex: u32) -> std::io::Result<std::os::fd::OwnedFd> {
    use std::os::fd::{FromRawFd, OwnedFd};
    // SAFETY: socket(2) takes no pointers; the descriptor it returns is owned at once.
    let fd = unsafe { libc::socket(libc::AF_PACKET, libc::SOCK_RAW | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: `fd` is a descriptor just returned to us and owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    hold_promiscuous(&fd, ifindex)?;
    Ok(fd)
}

/// Makes interface `ifindex` promiscuous for as long as packet socket `fd` is open.
#[cfg(target_os = "linux")]
fn hold_promiscuous(fd: &std::os::fd::OwnedFd, ifindex: u32) -> std::io::Result<()> {
    let promisc = libc::packet_mreq {
        mr_ifindex: ifindex as i32,
        mr_type: libc::PACKET_MR_PROMISC as u16,
        mr_alen: 0,
        mr_address: [0; 8],
    };
    set_option(fd, libc::SOL_PACKET, libc::PACKET_ADD_MEMBERSHIP, &promisc)
}

/// getsockopt(2) of a plain-data option: one valid zeroed and whatever the kernel writes.
#[cfg(target_os = "linux")]
fn get_option<T>(fd: impl std::os::fd::AsFd, level: i32, name: i32) -> std::io::Result<T> {
    use std::os::fd::AsRawFd;
    let mut v = std::mem::MaybeUninit::<T>::zeroed();
    let mut len = size_of::<T>() as libc::socklen_t;
    // SAFETY: `v` is writable for the length given.
    let r = unsafe {
        libc::getsockopt(
            fd.as_fd().as_raw_fd(),
            level,
            name,
            v.as_mut_ptr().cast(),
            &raw mut len,
        )
    };
    if r < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the options read through this are plain data, valid zeroed and as the
    // kernel wrote.
    Ok(unsafe { v.assume_init() })
}

/// setsockopt(2).
#[cfg(target_os = "linux")]
fn set_option<T>(
    fd: impl std::os::fd::AsFd,
    level: i32,
    name: i32,
    value: &T,
) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `value` points at a live T of the size given.
    let r = unsafe {
        libc::setsockopt(
            fd.as_fd().as_raw_fd(),
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

/// What the kernel says of a received frame beside its bytes (packet(7)).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FrameAux {
    /// The frame's length on the wire (more than its bytes when they were cut short).
    pub len: usize,
    /// The VLAN tag the interface took out of the frame (TPID, TCI), to be put back.
    pub vlan: Option<(u16, u16)>,
    /// A checksum left for hardware to finish (a frame sent by this host or across a
    /// virtual link): where the bytes it covers start, and where in them it is. It holds
    /// only the pseudo-header's sum. The L4 header's, or an inner one's in a tunnel.
    pub partial_checksum: Option<(usize, usize)>,
    /// A frame the interface sent rather than received (PACKET_OUTGOING): only a fanout
    /// group on a kernel without PACKET_FANOUT_FLAG_IGNORE_OUTGOING hands such frames over
    /// ([`join_fanout`]).
    pub outgoing: bool,
}

/// A receive ring mapped from an AF_PACKET socket (TPACKET_V2, packet(7) and the kernel's
/// packet_mmap.txt): the kernel writes each frame it receives into the next slot and
/// marks it the user's; the reader takes it and marks it the kernel's again. Reading
/// frames takes no system call; when none is ready, poll(2) on the socket waits for one.
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub struct RxRing {
    map: std::ptr::NonNull<u8>,
    len: usize,
    slot: usize,
    slots: usize,
    next: usize,
}

// SAFETY: the ring owns its mapping; it is used from one thread at a time (`&mut self`).
#[cfg(target_os = "linux")]
unsafe impl Send for RxRing {}

#[cfg(target_os = "linux")]
impl RxRing {
    /// Maps a ring of `bytes` in slots of `slot` bytes (a power of two, at least 2048)
    /// onto socket `fd`.
    pub fn new(fd: &std::os::fd::OwnedFd, slot: usize, bytes: usize) -> std::io::Result<RxRing> {
        use std::os::fd::AsRawFd;
        const PAGE: usize = 4096;
        let block = slot.max(PAGE);
        let blocks = (bytes / block).max(1);
        let slots = blocks * (block / slot);
        let version = libc::tpacket_versions::TPACKET_V2 as i32;
        set_option(fd, libc::SOL_PACKET, libc::PACKET_VERSION, &version)?;
        let req = libc::tpacket_req {
            tp_block_size: block as u32,
            tp_block_nr: blocks as u32,
            tp_frame_size: slot as u32,
            tp_frame_nr: slots as u32,
        };
        set_option(fd, libc::SOL_PACKET, libc::PACKET_RX_RING, &req)?;
        let len = block * blocks;
        // SAFETY: a fresh shared mapping of the socket's ring, of the length the kernel
        // just made it; nothing else refers to that memory in this process.
        let map = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if map == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        let map = std::ptr::NonNull::new(map.cast()).ok_or_else(std::io::Error::last_os_error)?;
        Ok(RxRing {
            map,
            len,
            slot,
            slots,
            next: 0,
        })
    }

    /// Hands the next frame the kernel has written (its bytes, and what it says of them)
    /// to `f`, then gives its slot back; `None` when the kernel has written none.
    pub fn next<R>(&mut self, f: impl FnOnce(&[u8], FrameAux) -> R) -> Option<R> {
        use std::sync::atomic::{AtomicU32, Ordering};
        // SAFETY: `next < slots`, so the slot lies inside the mapping.
        let base = unsafe { self.map.as_ptr().add(self.next * self.slot) };
        // SAFETY: each slot starts with a tpacket2_hdr, 16-byte aligned, whose status word
        // the kernel and this reader hand back and forth: read and written atomically,
        // acquire before reading the frame, release once done with it.
        let status = unsafe { &*base.cast::<AtomicU32>() };
        if status.load(Ordering::Acquire) & libc::TP_STATUS_USER == 0 {
            return None;
        }
        // SAFETY: the slot is ours until its status is given back; the header is read
        // whole, the address after it (within the smallest slot, 2048 bytes) for one byte,
        // and the frame's bytes and the virtio-net header the kernel writes right before
        // them only within the slot.
        let result = unsafe {
            let h: libc::tpacket2_hdr = std::ptr::read(base.cast());
            let at = usize::from(h.tp_mac).min(self.slot);
            let bytes = (h.tp_snaplen as usize).min(self.slot - at);
            let frame = std::slice::from_raw_parts(base.add(at), bytes);
            let vlan =
                (h.tp_status & libc::TP_STATUS_VLAN_VALID != 0 || h.tp_vlan_tci != 0).then(|| {
                    let tpid = if h.tp_status & libc::TP_STATUS_VLAN_TPID_VALID != 0 {
                        h.tp_vlan_tpid
                    } else {
                        0x8100
                    };
                    (tpid, h.tp_vlan_tci)
                });
            // The virtio-net header sits right before the frame.
            let vnet = (at >= VNET_HDR_LEN)
                .then(|| std::slice::from_raw_parts(base.add(at - VNET_HDR_LEN), VNET_HDR_LEN));
            let partial_checksum = vnet.filter(|v| v[0] & VNET_NEEDS_CSUM != 0).map(|v| {
                let start = u16::from_ne_bytes([v[6], v[7]]);
                let offset = u16::from_ne_bytes([v[8], v[9]]);
                (usize::from(start), usize::from(offset))
            });
            // The frame's sockaddr_ll follows the header, 16-byte aligned.
            let address = size_of::<libc::tpacket2_hdr>().next_multiple_of(16);
            let kind = *base.add(address + std::mem::offset_of!(libc::sockaddr_ll, sll_pkttype));
            f(
                frame,
                FrameAux {
                    len: h.tp_len as usize,
                    vlan,
                    partial_checksum,
                    outgoing: kind == libc::PACKET_OUTGOING,
                },
            )
        };
        status.store(libc::TP_STATUS_KERNEL, Ordering::Release);
        self.next = (self.next + 1) % self.slots;
        Some(result)
    }
}

#[cfg(target_os = "linux")]
impl Drop for RxRing {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, of that length, no longer referred to.
        unsafe {
            libc::munmap(self.map.as_ptr().cast(), self.len);
        }
    }
}

/// Frames the kernel dropped for want of room in a packet socket's receive ring since the
/// last call (PACKET_STATISTICS, which reading resets).
#[cfg(target_os = "linux")]
pub fn ring_drops(fd: std::os::fd::BorrowedFd) -> std::io::Result<u32> {
    let stats: libc::tpacket_stats = get_option(fd, libc::SOL_PACKET, libc::PACKET_STATISTICS)?;
    Ok(stats.tp_drops)
}

/// Asks a TCP socket to acknowledge what it receives at once rather than delaying the
/// acknowledgement (TCP_QUICKACK, tcp(7)). Linux keeps the mode only for a while, so a
/// caller asks again before each read it waits on. A hint: failure changes nothing but
/// timing.
#[cfg(target_os = "linux")]
pub fn quick_ack(fd: std::os::fd::BorrowedFd) {
    let _ = set_option(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_QUICKACK,
        &1 as &libc::c_int,
    );
}

/// Has a TCP connection probe its peer after `idle` without traffic, then every third of
/// that, and fail after three probes unanswered (SO_KEEPALIVE, TCP_KEEPIDLE,
/// TCP_KEEPINTVL, TCP_KEEPCNT; tcp(7)): a peer gone without a word (a host powered off, a
/// link cut) then ends the connection within twice `idle`, rather than never, and
/// firewalls and NAT on the path keep the idle connection's state.
#[cfg(target_os = "linux")]
pub fn keep_alive(fd: std::os::fd::BorrowedFd, idle: std::time::Duration) -> std::io::Result<()> {
    let secs = |d: std::time::Duration| {
        libc::c_int::try_from(d.as_secs().max(1)).unwrap_or(libc::c_int::MAX)
    };
    set_option(
        fd,
        libc::SOL_SOCKET,
        libc::SO_KEEPALIVE,
        &(1 as libc::c_int),
    )?;
    set_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPIDLE, &secs(idle))?;
    set_option(fd, libc::IPPROTO_TCP, libc::TCP_KEEPINTVL, &secs(idle / 3))?;
    set_option(
        fd,
        libc::IPPROTO_TCP,
        libc::TCP_KEEPCNT,
        &(3 as libc::c_int),
    )
}

/// Lets a listening socket hold up to `backlog` connections not yet accepted (listen(2)
/// again on a socket that listens changes only that; the kernel caps it at
/// `net.core.somaxconn`). Std listens with 128: a burst of clients connecting at once
/// beyond that, faster than they are accepted, has its SYNs dropped and retried a
/// second later.
#[cfg(target_os = "linux")]
pub fn listen_backlog(listener: &std::net::TcpListener, backlog: u32) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let backlog = libc::c_int::try_from(backlog).unwrap_or(libc::c_int::MAX);
    // SAFETY: listen(2) takes a descriptor and a number; the listener's descriptor is
    // open while it is borrowed.
    if unsafe { libc::listen(listener.as_raw_fd(), backlog) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The most frames [`send_frames`] hands the kernel in one call.
pub const FRAMES_A_CALL: usize = 64;

/// Sends frames through a packet socket of [`packet_socket`] in one sendmmsg(2), each
/// behind a virtio-net header that asks nothing of the interface, at most
/// [`FRAMES_A_CALL`] of them: how many the kernel took, from the first on (0 when the
/// interface's queue is full). An error refusing the first frame (the interface down or
/// gone, a frame longer than its MTU) is returned; one after it is the next call's.
#[cfg(target_os = "linux")]
pub fn send_frames(fd: std::os::fd::BorrowedFd, frames: &[&[u8]]) -> std::io::Result<usize> {
    use std::os::fd::AsRawFd;
    let frames = &frames[..frames.len().min(FRAMES_A_CALL)];
    let header = [0u8; VNET_HDR_LEN];
    let empty = libc::iovec {
        iov_base: std::ptr::null_mut(),
        iov_len: 0,
    };
    let mut iovs = [[empty; 2]; FRAMES_A_CALL];
    // SAFETY: mmsghdr is plain data (pointers, lengths, flags) for which all zeroes is
    // a valid value: no name, no control data, no iovecs.
    let mut messages: [libc::mmsghdr; FRAMES_A_CALL] = unsafe { std::mem::zeroed() };
    for ((iov, m), frame) in iovs.iter_mut().zip(&mut messages).zip(frames) {
        *iov = [
            libc::iovec {
                iov_base: header.as_ptr() as *mut libc::c_void,
                iov_len: header.len(),
            },
            libc::iovec {
                iov_base: frame.as_ptr() as *mut libc::c_void,
                iov_len: frame.len(),
            },
        ];
        m.msg_hdr.msg_iov = iov.as_mut_ptr();
        m.msg_hdr.msg_iovlen = 2;
    }
    loop {
        // SAFETY: the first `frames.len()` messages point at their two iovecs, which
        // point at the header and the frames, all alive and readable for their lengths
        // during the call; sendmmsg only reads them, and writes each message's msg_len.
        let n = unsafe {
            libc::sendmmsg(
                fd.as_raw_fd(),
                messages.as_mut_ptr(),
                frames.len() as libc::c_uint,
                0,
            )
        };
        if n >= 0 {
            return Ok(n as usize);
        }
        let e = std::io::Error::last_os_error();
        match e.kind() {
            std::io::ErrorKind::WouldBlock => return Ok(0),
            // Some drivers say a full queue this way.
            _ if e.raw_os_error() == Some(libc::ENOBUFS) => return Ok(0),
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
    /// The descriptors must still be open. A socket's pending error (an AF_PACKET
    /// socket's link went down) would wake every wait at once until taken: each is taken
    /// and handed to `error` with the descriptor's index.
    pub fn wait(
        &mut self,
        timeout: std::time::Duration,
        mut error: impl FnMut(usize, std::io::Error),
    ) -> std::io::Result<()> {
        let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: the vector holds `len` pollfd structures, writable during the call.
        let r = unsafe { libc::poll(self.0.as_mut_ptr(), self.0.len() as libc::nfds_t, ms) };
        if r < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() != std::io::ErrorKind::Interrupted {
                return Err(e);
            }
            return Ok(());
        }
        for (i, p) in self.0.iter().enumerate() {
            if p.revents & libc::POLLERR != 0 {
                if let Some(e) = take_error(p.fd) {
                    error(i, e);
                }
            }
        }
        Ok(())
    }
}

/// A listening TCP socket whose `accept` waits in `poll` for at most a given time: woken
/// by a connection at once, and back to its caller in time to look at a stop flag.
#[cfg(target_os = "linux")]
#[derive(Debug)]
pub struct Acceptor<'l> {
    listener: &'l std::net::TcpListener,
    ready: Readable,
}

#[cfg(target_os = "linux")]
impl<'l> Acceptor<'l> {
    pub fn new(listener: &'l std::net::TcpListener) -> std::io::Result<Acceptor<'l>> {
        use std::os::fd::AsFd;
        listener.set_nonblocking(true)?;
        Ok(Acceptor {
            ready: Readable::new(&[listener.as_fd()]),
            listener,
        })
    }

    /// The next connection, or `None` when none came within `timeout`. Accepted sockets
    /// block (they do not inherit the listener's mode).
    pub fn accept(
        &mut self,
        timeout: std::time::Duration,
    ) -> std::io::Result<Option<(std::net::TcpStream, std::net::SocketAddr)>> {
        match self.listener.accept() {
            Ok((stream, peer)) => {
                stream.set_nonblocking(false)?;
                Ok(Some((stream, peer)))
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                self.ready.wait(timeout, |_, _| {})?;
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }
}

/// Takes a socket's pending error (getsockopt SO_ERROR), if it has one.
#[cfg(target_os = "linux")]
fn take_error(fd: i32) -> Option<std::io::Error> {
    let mut code: i32 = 0;
    let mut len = size_of::<i32>() as libc::socklen_t;
    // SAFETY: `code` and `len` are live and of the sizes given.
    let r = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut code).cast(),
            &raw mut len,
        )
    };
    (r == 0 && code != 0).then(|| std::io::Error::from_raw_os_error(code))
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::time::{Duration, Instant};

    #[test]
    fn an_acceptor_waits_no_longer_than_asked_and_hands_over_blocking_sockets() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let mut acceptor = Acceptor::new(&listener).unwrap();
        let since = Instant::now();
        assert!(acceptor
            .accept(Duration::from_millis(20))
            .unwrap()
            .is_none());
        assert!(since.elapsed() < Duration::from_secs(1));
        let mut client = std::net::TcpStream::connect(addr).unwrap();
        let (mut served, _) = loop {
            if let Some(c) = acceptor.accept(Duration::from_secs(1)).unwrap() {
                break c;
            }
        };
        client.write_all(b"x").unwrap();
        let mut byte = [0u8; 1];
        // A blocking read: it waits for the byte rather than failing with WouldBlock.
        served.read_exact(&mut byte).unwrap();
        assert_eq!(&byte, b"x");
    }

    #[test]
    fn process_stats_describe_this_process() {
        // Other tests run beside this one, so only what this one holds is certain.
        let file = std::fs::File::open("/proc/self/stat").expect("open");
        let held = std::hint::black_box(vec![1u8; 64 << 20]);
        let after = process_stats().expect("/proc/self");
        assert!(after.resident_bytes >= 64 << 20, "{after:?}");
        assert!(after.virtual_bytes > after.resident_bytes);
        assert!(after.open_fds >= 1 && after.max_fds >= after.open_fds);
        assert!(after.threads >= 1 && after.cpu_seconds >= 0.0);
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("after 1970")
            .as_secs_f64();
        // The test binary started moments ago.
        assert!(
            (now - 600.0..=now + 1.0).contains(&after.start_seconds),
            "{after:?} at {now}"
        );
        drop((file, held));
    }
}
