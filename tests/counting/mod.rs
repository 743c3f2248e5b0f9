//! The system allocator with a hook on every allocation, for the tests that count what a
//! path allocates (each decides what to count: one thread's or the whole process's).

// A global allocator is an `unsafe impl`: this module exists to count allocations.
#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};

/// The system allocator, calling its function on each allocation and reallocation. The
/// function must not allocate.
pub struct Counting(pub fn());

// SAFETY: every call is passed to the system allocator unchanged; the hook allocates
// nothing (its contract).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        (self.0)();
        // SAFETY: the caller's guarantees for `layout` are the system allocator's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        (self.0)();
        // SAFETY: as for `alloc`.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        (self.0)();
        // SAFETY: `ptr` came from this allocator, which is the system's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, which is the system's.
        unsafe { System.dealloc(ptr, layout) }
    }
}
