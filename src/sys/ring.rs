//! Reads and writes of one file kept in flight together, through io_uring(7): a request's
//! pieces scattered over a device (a value's runs of blocks) go to it at once, where
//! `pread`/`pwrite` would wait for each in turn. Made for direct I/O (`O_DIRECT`): the
//! kernel reads and writes only the ring's own aligned slots, and the data is copied
//! between them and the caller's buffers, which may lie at any address.

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
    /// `DEPTH` slots of `SLOT` bytes from `skew`, aligned as direct I/O needs.
    arena: Vec<u8>,
    skew: usize,
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

impl Ring {
    /// A ring whose slots are aligned to `align` bytes (a power of two, at most
    /// 64 KiB, a slot); an error where the kernel has no io_uring or refuses it.
    pub fn new(align: usize) -> io::Result<Ring> {
        if !align.is_power_of_two() || align > SLOT {
            return Err(io::Error::other(format!("alignment {align}")));
        }
        let ring = io_uring::IoUring::new(DEPTH as u32)?;
        let arena = vec![0u8; DEPTH * SLOT + align];
        let skew = arena.as_ptr().align_offset(align);
        Ok(Ring { ring, arena, skew })
    }

    /// Fills each buffer from its offset in `file`.
    pub fn read(&mut self, file: &File, pieces: &mut [(u64, &mut [u8])]) -> io::Result<()> {
        let parts = parts(pieces.iter().map(|(o, b)| (*o, b.len())));
        self.run(
            file,
            &parts,
            false,
            |_, _| {},
            |p, slot| pieces[p.piece].1[p.at..p.at + p.len].copy_from_slice(slot),
        )
    }

    /// Writes each piece at its offset in `file`.
    pub fn write(&mut self, file: &File, pieces: &[(u64, &[u8])]) -> io::Result<()> {
        let parts = parts(pieces.iter().map(|(o, d)| (*o, d.len())));
        self.run(
            file,
            &parts,
            true,
            |p, slot| slot.copy_from_slice(&pieces[p.piece].1[p.at..p.at + p.len]),
            |_, _| {},
        )
    }

    /// Runs `parts`, up to `DEPTH` at a time: `fill` puts a write's bytes in its slot
    /// before it is sent, `take` copies a read's out once it is done. Returns once none
    /// is in flight, the first error if there was one (nothing more is sent after it).
    fn run(
        &mut self,
        file: &File,
        parts: &[Part],
        write: bool,
        mut fill: impl FnMut(&Part, &mut [u8]),
        mut take: impl FnMut(&Part, &[u8]),
    ) -> io::Result<()> {
        if self.arena.is_empty() {
            return Err(io::Error::other("io_uring ring abandoned after an error"));
        }
        let fd = io_uring::types::Fd(file.as_raw_fd());
        let mut free: Vec<usize> = (0..DEPTH).rev().collect();
        // Per slot: the part it carries and how many of its bytes are done.
        let mut carrying = [(0usize, 0usize); DEPTH];
        let mut done = Vec::with_capacity(DEPTH);
        let (mut next, mut in_flight, mut failed) = (0, 0, None);
        loop {
            while failed.is_none() && next < parts.len() {
                let Some(slot) = free.pop() else { break };
                let part = &parts[next];
                let start = self.skew + slot * SLOT;
                if write {
                    fill(part, &mut self.arena[start..start + part.len]);
                }
                carrying[slot] = (next, 0);
                if let Err(e) = self.send(fd, slot, part, 0, write) {
                    return Err(match in_flight {
                        0 => e,
                        _ => self.abandon(e),
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
                return Err(self.abandon(e));
            }
            done.extend(self.ring.completion().map(|c| (c.user_data(), c.result())));
            for (slot, result) in done.drain(..) {
                let slot = slot as usize;
                let (i, before) = carrying[slot];
                let part = &parts[i];
                let moved = match usize::try_from(result) {
                    Err(_) => Err(io::Error::from_raw_os_error(-result)),
                    Ok(0) => Err(io::Error::from(if write {
                        io::ErrorKind::WriteZero
                    } else {
                        io::ErrorKind::UnexpectedEof
                    })),
                    Ok(n) => Ok(before + n),
                };
                match moved {
                    Ok(n) if n < part.len => {
                        // A short transfer: the rest from where it stopped.
                        carrying[slot].1 = n;
                        if let Err(e) = self.send(fd, slot, part, n, write) {
                            return Err(self.abandon(e));
                        }
                        continue;
                    }
                    Ok(_) if !write => {
                        let start = self.skew + slot * SLOT;
                        take(part, &self.arena[start..start + part.len]);
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

    /// Queues the rest of `part` after its first `done` bytes, between the file and
    /// `slot`'s memory.
    fn send(
        &mut self,
        fd: io_uring::types::Fd,
        slot: usize,
        part: &Part,
        done: usize,
        write: bool,
    ) -> io::Result<()> {
        use io_uring::opcode::{Read, Write};
        let start = self.skew + slot * SLOT + done;
        let memory = &mut self.arena[start..start + part.len - done];
        let (buf, len) = (memory.as_mut_ptr(), memory.len() as u32);
        let offset = part.offset + done as u64;
        let entry = match write {
            true => Write::new(fd, buf, len).offset(offset).build(),
            false => Read::new(fd, buf, len).offset(offset).build(),
        };
        let entry = entry.user_data(slot as u64);
        // SAFETY: the entry names `len` bytes of the arena, which this ring owns and never
        // reallocates, and which no other transfer in flight uses (one per slot); `run`
        // returns only once every transfer it sent is complete, or leaks the arena, so the
        // kernel never touches it once freed. `fd` is open while `run` borrows its file.
        unsafe { self.ring.submission().push(&entry) }
            .map_err(|_| io::Error::other("io_uring submission queue full"))
    }

    /// Gives up on the transfers in flight after `e`: the arena they may still write is
    /// leaked rather than freed, and the ring refuses any further work.
    fn abandon(&mut self, e: io::Error) -> io::Error {
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
