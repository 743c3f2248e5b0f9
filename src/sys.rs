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
