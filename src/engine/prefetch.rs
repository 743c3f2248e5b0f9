//! Software prefetch: a hint that starts loading a cache line early. It never faults and
//! has no effect on what the program computes, only on when memory arrives.
//!
//! The one place outside I/O drivers that needs `unsafe`: the intrinsics are marked unsafe
//! although a prefetch cannot misbehave.

#![allow(unsafe_code)]

/// Starts loading every cache line `*p` spans (its first and last byte: objects of up to
/// 64 bytes, or 128 when they start on a line, span at most two).
#[inline(always)]
pub fn prefetch_span<T>(p: &T) {
    prefetch(p);
    if size_of::<T>() > 1 {
        let last = (p as *const T)
            .cast::<u8>()
            .wrapping_add(size_of::<T>() - 1);
        prefetch_addr(last);
    }
}

/// Starts loading the cache line holding `*p` into all cache levels.
#[inline(always)]
pub fn prefetch<T>(p: &T) {
    prefetch_addr((p as *const T).cast::<u8>());
}

/// Starts loading the cache line holding address `p`, which need not be valid: a prefetch
/// never faults.
#[inline(always)]
fn prefetch_addr(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint: it reads nothing architecturally visible and cannot
    // fault, whatever the address.
    unsafe {
        core::arch::x86_64::_mm_prefetch::<{ core::arch::x86_64::_MM_HINT_T0 }>(p.cast::<i8>());
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: PRFM is a hint; it neither faults nor changes memory, registers or flags.
    unsafe {
        core::arch::asm!("prfm pldl1keep, [{0}]", in(reg) p, options(nostack, readonly, preserves_flags));
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = p;
}
