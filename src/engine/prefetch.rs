//! Software prefetch: a hint that starts loading a cache line early. It never faults and
//! has no effect on what the program computes, only on when memory arrives.
//!
//! The one place outside I/O drivers that needs `unsafe`: the intrinsics are marked unsafe
//! although a prefetch cannot misbehave.

#![allow(unsafe_code)]

/// Starts loading the cache line holding `*p` into all cache levels.
#[inline(always)]
pub fn prefetch<T>(p: &T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint; the address comes from a live reference and the
    // instruction reads nothing architecturally visible and cannot fault.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(
            (p as *const T).cast::<i8>(),
        );
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: PRFM is a hint; it neither faults nor changes memory, registers or flags.
    unsafe {
        core::arch::asm!("prfm pldl1keep, [{0}]", in(reg) p as *const T, options(nostack, readonly, preserves_flags));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
}
