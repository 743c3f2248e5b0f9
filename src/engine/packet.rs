//! Packet buffers with headroom, so encapsulation prepends headers without moving the
//! payload. Buffers are allocated once per batch slot and reused.

use super::{DropReason, Verdict};
use crate::ir::PortId;

/// Bytes kept free in front of a received frame: outer Ethernet, IPv6, UDP and a Geneve
/// header with the largest option block (14 + 40 + 8 + 8 + 252 = 322), plus a VLAN tag.
pub const HEADROOM: usize = 384;

/// The largest frame a buffer holds by default (jumbo frames).
pub const DEFAULT_MAX_FRAME: usize = 9216;

/// One packet: its bytes, where it came from, when, and what the engine decided.
#[derive(Debug, Clone)]
pub struct PacketBuf {
    buf: Box<[u8]>,
    head: usize,
    len: usize,
    pub port: PortId,
    /// Capture or arrival time in nanoseconds; the engine's only clock.
    pub ts_ns: u64,
    pub verdict: Verdict,
}

impl PacketBuf {
    pub fn new(max_frame: usize) -> PacketBuf {
        PacketBuf {
            buf: vec![0; HEADROOM + max_frame].into_boxed_slice(),
            head: HEADROOM,
            len: 0,
            port: PortId(0),
            ts_ns: 0,
            verdict: Verdict::Drop(DropReason::NoPipe),
        }
    }

    /// Copies a received frame in, with full headroom. False (and an empty packet, with
    /// its port and time set) when it does not fit.
    #[inline]
    pub fn load(&mut self, frame: &[u8], port: PortId, ts_ns: u64) -> bool {
        self.port = port;
        self.ts_ns = ts_ns;
        self.verdict = Verdict::Drop(DropReason::NoPipe);
        self.head = HEADROOM;
        if frame.len() > self.buf.len() - HEADROOM {
            self.len = 0;
            return false;
        }
        self.len = frame.len();
        self.buf[HEADROOM..HEADROOM + frame.len()].copy_from_slice(frame);
        true
    }

    /// Where a driver that receives in place writes the next frame: everything after the
    /// headroom. [`PacketBuf::received`] then says how much it wrote.
    pub fn room(&mut self) -> &mut [u8] {
        &mut self.buf[HEADROOM..]
    }

    /// A frame of `len` bytes was written into [`PacketBuf::room`], received on `port` at
    /// `ts_ns`.
    pub fn received(&mut self, len: usize, port: PortId, ts_ns: u64) {
        self.port = port;
        self.ts_ns = ts_ns;
        self.verdict = Verdict::Drop(DropReason::NoPipe);
        self.head = HEADROOM;
        self.len = len.min(self.buf.len() - HEADROOM);
    }

    pub fn data(&self) -> &[u8] {
        &self.buf[self.head..self.head + self.len]
    }

    pub fn data_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.head..self.head + self.len]
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn headroom(&self) -> usize {
        self.head
    }

    /// What tells this buffer from every other one alive: its memory's address.
    pub fn id(&self) -> usize {
        self.buf.as_ptr() as usize
    }

    /// The bytes between where frames are loaded ([`HEADROOM`]) and where the packet now
    /// starts: the headers the walk took off its front (empty if it took none).
    pub fn taken_off(&self) -> &[u8] {
        self.buf.get(HEADROOM..self.head).unwrap_or(&[])
    }

    /// Grows the packet at the front by `n` bytes; false when the headroom is too small.
    pub fn push_front(&mut self, n: usize) -> bool {
        if n > self.head {
            return false;
        }
        self.head -= n;
        self.len += n;
        true
    }

    /// Removes `n` bytes from the front.
    pub fn pull_front(&mut self, n: usize) {
        let n = n.min(self.len);
        self.head += n;
        self.len -= n;
    }

    /// Makes the packet `len` bytes long, at the tail; false when the buffer is too
    /// small. Bytes it grows by hold whatever the buffer held: write them.
    pub fn set_len(&mut self, len: usize) -> bool {
        if len > self.buf.len() - self.head {
            return false;
        }
        self.len = len;
        true
    }

    /// Shortens the packet to `len` bytes (drops trailing padding).
    pub fn truncate(&mut self, len: usize) {
        self.len = self.len.min(len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headroom_push_and_pull() {
        let mut p = PacketBuf::new(64);
        assert!(p.load(&[1, 2, 3], PortId(1), 5));
        assert!(p.push_front(2));
        p.data_mut()[..2].copy_from_slice(&[9, 9]);
        assert_eq!(p.data(), &[9, 9, 1, 2, 3]);
        p.pull_front(3);
        assert_eq!(p.data(), &[2, 3]);
        assert!(!p.push_front(HEADROOM + 10));
        assert!(!p.load(&[0; 65], PortId(0), 0));
        assert!(p.set_len(4) && p.data()[..3] == [1, 2, 3]);
        assert!(!p.set_len(HEADROOM + 64));
    }
}
