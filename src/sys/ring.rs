//! Reads and writes of one file kept in flight together, through io_uring(7): a request's
//! pieces scattered over a device (a value's runs of blocks) go to it at once, where
//! `pread`/`pwrite` would wait for each in turn. Made for direct I/O (`O_DIRECT`): a
//! transfer whose memory is aligned goes between the device and the caller's buffer; any
//! other through an aligned slot of the ring's own, copied to or from the caller's.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// Transfers in flight at once.
const DEPTH: usize = 32;

/// The most bytes of one transfer: larger pieces go as several.
const SLOT: usize = 64 << 10;

/// An io_uring instance and the memory its transfers use.
pub struct Ring {
    ring: io_uring::IoUring,
    /// `DEPTH` slots of `SLOT` bytes from `skew`, aligned to `align`.
    arena: Vec<u8>,
    skew: usize,
    align: usize,
}

impl std::fmt::Debug for Ring {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Ring").field("depth", &DEPTH).finish()
    }
}

/// A transfer: `len` bytes at `offset` in the file, `at` bytes into piece `piece`.
#[derive(Debug, Clone, Copy)]
struct Part {
    piece: usize,
    at: usize,
    len: usize,
    offset: u64,
}

/// Where a transfer in flight goes to or comes from.
#[derive(Debug, Clone, Copy, Default)]
struct Carried {
    /// Its part.
    part: usize,
    /// Its bytes done so far.
    done: usize,
    /// The caller's memory itself (aligned), rather than the slot's.
    in_place: bool,
}

impl Ring {
    /// A ring for transfers aligned to `align` bytes (a power of two, at most 64 KiB, a
    /// slot); an error where the kernel has no io_uring or refuses it.
    pub fn new(align: usize) -> io::Result<Ring> {
        if !align.is_power_of_two() || align > SLOT {
            return Err(io::Error::other(format!("alignment {align}")));
        }
        let ring = io_uring::IoUring::new(DEPTH as u32)?;
        let arena = vec![0u8; DEPTH * SLOT + align];
        let skew = arena.as_ptr().align_offset(align);
        Ok(Ring {
            ring,
            arena,
            skew,
            align,
        })
    }

    /// Fills each buffer from its offset in `file`.
    pub fn read(&mut self, file: &File, pieces: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let parts = parts(pieces.iter().map(|(o, b)| (*o, b.len())));
        // From here on the buffers are reached only through these pointers (the kernel
        // writes some, the copies out of slots the others).
        let bases: Vec<*mut u8> = pieces.iter_mut().map(|(_, b)| b.as_mut_ptr()).collect();
        self.run(file, &parts, &bases, false)
    }

    /// Writes each piece at its offset in `file`.
    pub fn write(&mut self, file: &File, pieces: &[(u64, &[u8])]) -> io::Result<()> {
        let parts = parts(pieces.iter().map(|(o, d)| (*o, d.len())));
        // Only ever read through (by the kernel, or copied into slots).
        let bases: Vec<*mut u8> = pieces.iter().map(|(_, d)| d.as_ptr().cast_mut()).collect();
        self.run(file, &parts, &bases, true)
    }

    /// Runs `parts` of the buffers at `bases`, up to `DEPTH` at a time. Returns once none
    /// is in flight, the first error if there was one (nothing more is sent after it).
    fn run(
        &mut self,
        file: &File,
        parts: &[Part],
        bases: &[*mut u8],
        write: bool,
    ) -> io::Result<()> {
        if self.arena.is_empty() {
            return Err(io::Error::other("io_uring ring abandoned after an error"));
        }
        let fd = io_uring::types::Fd(file.as_raw_fd());
        // The caller's bytes of a part.
        let caller = |p: &Part| bases[p.piece].wrapping_add(p.at);
        let mut free: Vec<usize> = (0..DEPTH).rev().collect();
        let mut carrying = [Carried::default(); DEPTH];
        let mut done = Vec::with_capacity(DEPTH);
        let (mut next, mut in_flight, mut failed) = (0, 0, None);
        loop {
            while failed.is_none() && next < parts.len() {
                let Some(slot) = free.pop() else { break };
                let part = &parts[next];
                let in_place = caller(part) as usize % self.align == 0;
                if write && !in_place {
                    // SAFETY: the part's bytes lie inside its piece, which the caller
                    // lends for the whole call; the slot is the arena's, free until now.
                    unsafe {
                        std::ptr::copy_nonoverlapping(caller(part), self.slot(slot), part.len)
                    };
                }
                carrying[slot] = Carried {
                    part: next,
                    done: 0,
                    in_place,
                };
                let memory = if in_place {
                    caller(part)
                } else {
                    self.slot(slot)
                };
                if let Err(e) = self.send(fd, slot, memory, part, 0, write) {
                    free.push(slot);
                    return Err(match in_flight {
                        0 => e,
                        _ => self.abandon(e, &carrying, &free),
                    });
                }
                (next, in_flight) = (next + 1, in_flight + 1);
            }
            if in_flight == 0 {
                return failed.map_or(Ok(()), Err);
            }
            if let Err(e) = self.ring.submit_and_wait(1) {
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR | libc::EAGAIN | libc::EBUSY)
                ) {
                    continue;
                }
                return Err(self.abandon(e, &carrying, &free));
            }
            done.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            for (slot, result) in done.drain(..) {
                let slot = slot as usize;
                let carried = carrying[slot];
                let part = &parts[carried.part];
                let moved = match usize::try_from(result) {
                    Err(_) => Err(io::Error::from_raw_os_error(-result)),
                    Ok(0) => Err(io::Error::from(if write {
                        io::ErrorKind::WriteZero
                    } else {
                        io::ErrorKind::UnexpectedEof
                    })),
                    Ok(n) => Ok(carried.done + n),
                };
                match moved {
                    Ok(n) if n < part.len => {
                        // A short transfer: the rest from where it stopped.
                        carrying[slot].done = n;
                        let memory = match carried.in_place {
                            true => caller(part),
                            false => self.slot(slot),
                        };
                        if let Err(e) = self.send(fd, slot, memory, part, n, write) {
                            free.push(slot);
                            return Err(self.abandon(e, &carrying, &free));
                        }
                        continue;
                    }
                    Ok(_) if !write && !carried.in_place => {
                        // SAFETY: as for the copy into a slot before a write, the other
                        // way; the kernel is done with the slot.
                        unsafe {
                            std::ptr::copy_nonoverlapping(self.slot(slot), caller(part), part.len)
                        };
                    }
                    Ok(_) => {}
                    Err(e) => {
                        failed.get_or_insert(e);
                    }
                }
                free.push(slot);
                in_flight -= 1;
            }
        }
    }

    /// The first byte of `slot` in the arena.
    fn slot(&mut self, slot: usize) -> *mut u8 {
        self.arena[self.skew + slot * SLOT..].as_mut_ptr()
    }

    /// Queues the rest of `part` after its first `done` bytes, between the file and the
    /// part's memory at `memory`.
    fn send(
        &mut self,
        fd: io_uring::types::Fd,
        slot: usize,
        memory: *mut u8,
        part: &Part,
        done: usize,
        write: bool,
    ) -> io::Result<()> {
        use io_uring::opcode::{Read, Write};
        let (buf, len) = (memory.wrapping_add(done), (part.len - done) as u32);
        let offset = part.offset + done as u64;
        let entry = match write {
            true => Write::new(fd, buf, len).offset(offset).build(),
            false => Read::new(fd, buf, len).offset(offset).build(),
        };
        let entry = entry.user_data(slot as u64);
        // SAFETY: the entry names `len` bytes either of the arena, which this ring owns
        // and never reallocates, in a slot no other transfer in flight uses, or of the
        // piece the caller lends for the whole of `run` (pieces read into are distinct
        // `&mut` slices, so no two transfers share bytes). `run` returns only once every
        // transfer it sent is complete, or abandons them (the arena leaked, the process
        // ended if the caller's memory is in flight), so the kernel never touches memory
        // once freed. `fd` is open while `run` borrows its file.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))
    }

    /// Gives up on the transfers in flight after `e` (the slots not `free` carry one):
    /// the arena they may still write is leaked rather than freed, and the ring refuses
    /// any further work. If one is in the caller's memory, which its owner will free or
    /// reuse, the process ends here: nothing else keeps the kernel from writing into it.
    /// (An error submitting is not expected at all: the ring never holds more than it
    /// has room for.)
    fn abandon(&mut self, e: io::Error, carrying: &[Carried; DEPTH], free: &[usize]) -> io::Error {
        let busy = (0..DEPTH).filter(|s| !free.contains(s));
        if busy.into_iter().any(|s| carrying[s].in_place) {
            tracing::error!(error = %e, "io_uring failed with transfers in flight; stopping");
            std::process::abort();
        }
        std::mem::forget(std::mem::take(&mut self.arena));
        e
    }
}

/// `pieces` (offset, length) as transfers of at most [`SLOT`] bytes.
fn parts(pieces: impl Iterator<Item = (u64, usize)>) -> Vec<Part> {
    let mut out = Vec::new();
    for (piece, (offset, len)) in pieces.enumerate() {
        for at in (0..len).step_by(SLOT) {
            out.push(Part {
                piece,
                at,
                len: SLOT.min(len - at),
                offset: offset + at as u64,
            });
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::OpenOptionsExt;

    fn direct_file(name: &str, len: u64) -> (std::path::PathBuf, File) {
        let path = std::env::temp_dir().join(format!("dpuflow-ring-{name}-{}", std::process::id()));
        File::create(&path).unwrap().set_len(len).unwrap();
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_DIRECT)
            .open(&path)
            .unwrap();
        (path, file)
    }

    /// Aligned memory is read and written where it is; other memory through the slots.
    #[test]
    fn aligned_memory_is_used_in_place() {
        let (path, file) = direct_file("in-place", 1 << 20);
        let mut ring = Ring::new(4096).unwrap();
        let mut room = vec![0u8; 3 * SLOT];
        let skew = room.as_ptr().align_offset(4096);
        let aligned = &mut room[skew..skew + 2 * SLOT];
        aligned
            .iter_mut()
            .enumerate()
            .for_each(|(i, b)| *b = (i % 251) as u8 | 1);
        let data = aligned.to_vec();
        ring.write(&file, &[(4096, &aligned[..])]).unwrap();
        aligned.fill(0);
        ring.read(&file, &mut [(4096, &mut aligned[..])]).unwrap();
        assert!(*aligned == data[..]);
        assert!(ring.arena.iter().all(|&b| b == 0), "a slot was used");
        let mut odd = vec![0u8; SLOT + 1];
        ring.read(&file, &mut [(4096, &mut odd[1..])]).unwrap();
        assert!(odd[1..] == data[..SLOT]);
        assert!(ring.arena.iter().any(|&b| b != 0), "no slot was used");
        std::fs::remove_file(&path).unwrap();
    }

    /// A read that fails among others: the error is returned once the rest are done, a
    /// transfer cut short by the end of the file is taken up where it stopped (and then
    /// fails there), and the ring goes on working.
    #[test]
    fn a_failed_transfer_is_reported_after_the_others_and_the_ring_goes_on() {
        let (path, file) = direct_file("errors", 1 << 20);
        let mut ring = Ring::new(4096).unwrap();
        let data: Vec<u8> = (0..(1usize << 20)).map(|i| (i / 4096 + i) as u8).collect();
        ring.write(&file, &[(0, &data[..])]).unwrap();
        let mut bufs = vec![vec![0u8; 3 * SLOT]; 4];
        let mut reads: Vec<(u64, &mut [u8])> = bufs
            .iter_mut()
            .enumerate()
            .map(|(i, b)| ((i * 3 * SLOT) as u64, &mut b[..]))
            .collect();
        // The fourth piece runs past the end, which falls 4 KiB into its last transfer.
        reads[3].0 = (1 << 20) - 2 * SLOT as u64 - 4096;
        let e = ring.read(&file, &mut reads).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::UnexpectedEof);
        for (i, b) in bufs[..3].iter().enumerate() {
            assert!(b[..] == data[i * 3 * SLOT..][..3 * SLOT], "piece {i}");
        }
        // Misaligned for direct I/O: the kernel's EINVAL.
        let mut odd = vec![0u8; 4096];
        let e = ring.read(&file, &mut [(100, &mut odd[..])]).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
        ring.read(&file, &mut [(4096, &mut odd[..])]).unwrap();
        assert!(odd[..] == data[4096..8192]);
        std::fs::remove_file(&path).unwrap();
    }
}
