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
