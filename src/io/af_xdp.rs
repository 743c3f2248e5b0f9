//! Live ports through AF_XDP sockets: the interface's frames are steered by an XDP
//! program to a socket for each of its receive queues before the kernel's stack sees
//! them, and read from rings in memory shared with the kernel (zero-copy on drivers that
//! offer it, a copy in the kernel otherwise; `crate::sys::xdp`). Frames sent are queued
//! on a TX ring and handed over a batch at a time.
//!
//! XDP sees frames as the driver received them, before the kernel's stack: nothing is
//! taken out or left unfinished by the stack, but a NIC's own VLAN stripping, receive
//! offloads (LRO, GRO hardware) and, on a virtual link, the sender's checksum and
//! segmentation offloads must be off (docs/operations.md). A frame must fit a chunk of the
//! socket's memory (3840 bytes at most): a port of a larger MTU is refused.

use super::live::{Received, Sent};
use crate::engine::PacketBuf;
use crate::ir::PortId;
use crate::sys::xdp::{Queued, XdpSocket, XdpSteering};
use crate::wire::ethernet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

/// One port on one interface: a socket for each receive queue.
#[derive(Debug)]
pub struct XdpPort {
    port: PortId,
    iface: String,
    /// Declared first: detached before the sockets close.
    _steering: XdpSteering,
    sockets: Vec<XdpSocket>,
    /// Keeps the interface promiscuous while the port is open; asked whether it is up.
    promiscuous: OwnedFd,
    /// The socket read next, so that every queue gets its turn.
    turn: usize,
}

/// Room beyond the MTU for two VLAN tags of four bytes.
const VLAN_TAGS: usize = 8;

/// The largest frame a port carries, for its `mtu`.
fn largest_frame(mtu: u16) -> usize {
    usize::from(mtu) + ethernet::HEADER_LEN + VLAN_TAGS
}

impl XdpPort {
    /// Opens interface `index` (named `iface`) for a port whose largest IP packet is
    /// `mtu` bytes.
    pub fn open(port: PortId, iface: &str, index: u32, mtu: u16) -> std::io::Result<XdpPort> {
        let max_frame = largest_frame(mtu);
        let sockets = (0..receive_queues(iface))
            .map(|q| open_socket(index, q, max_frame))
            .collect::<std::io::Result<Vec<_>>>()?;
        let steering = XdpSteering::attach(index, &sockets)?;
        Ok(XdpPort {
            port,
            iface: iface.to_owned(),
            _steering: steering,
            sockets,
            promiscuous: crate::sys::promiscuous(index)?,
            turn: 0,
        })
    }

    /// How the port works, for the log: its receive queues, and whether the kernel hands
    /// their frames over in place (zero-copy) or copies them.
    pub fn mode(&self) -> String {
        let copies = if self.sockets.iter().all(XdpSocket::zero_copy) {
            "zero-copy"
        } else {
            "copy"
        };
        format!("{} queue(s), {copies}", self.sockets.len())
    }

    /// Whether the interface's receive queues are no longer those the port has a socket
    /// on (`ethtool -L` changed them): frames of a queue without one would go to the
    /// kernel's stack, around the pipeline.
    pub fn queues_changed(&self) -> bool {
        receive_queues(&self.iface) as usize != self.sockets.len()
    }

    /// The sockets to wait on for frames.
    pub fn fds(&self) -> impl Iterator<Item = BorrowedFd<'_>> {
        self.sockets.iter().map(XdpSocket::fd)
    }

    /// Frames the kernel dropped since the last call for want of room in a receive ring.
    pub fn ring_drops(&mut self) -> u64 {
        self.sockets
            .iter_mut()
            .map(|s| s.drops().unwrap_or(0))
            .sum()
    }

    /// Copies the next frame received (from any queue) into `slot`, stamped `ts_ns`;
    /// `None` when none waits.
    pub fn receive(&mut self, slot: &mut PacketBuf, ts_ns: u64) -> Option<Received> {
        let port = self.port;
        for _ in 0..self.sockets.len() {
            let q = self.turn;
            self.turn = (q + 1) % self.sockets.len();
            let got = self.sockets[q].receive(|frame| {
                let room = slot.room();
                if frame.len() > room.len() {
                    slot.received(0, port, ts_ns);
                    return Received::Oversize(frame.len());
                }
                room[..frame.len()].copy_from_slice(frame);
                slot.received(frame.len(), port, ts_ns);
                Received::Frame
            });
            if got.is_some() {
                return got;
            }
        }
        None
    }

    /// Queues a frame to be sent at the next [`XdpPort::flush`] (from the first queue's
    /// socket; any socket of the interface sends out of it).
    pub fn send(&mut self, frame: &[u8]) -> Sent {
        match self.sockets[0].send(frame) {
            Queued::Yes => Sent::Yes,
            Queued::Full => Sent::QueueFull,
            Queued::TooLong => Sent::Refused(std::io::Error::from_raw_os_error(libc::EMSGSIZE)),
        }
    }

    /// Has the kernel send the frames queued, or drops them while the interface is down:
    /// how many it dropped.
    pub fn flush(&mut self) -> std::io::Result<usize> {
        if !self.sockets[0].pending() {
            return Ok(0);
        }
        // Asked only when there is something to send: one system call a batch. An
        // interface that cannot be asked about (it is gone) is down.
        let up = crate::sys::interface_up(self.promiscuous.as_fd(), &self.iface).unwrap_or(false);
        self.sockets[0].flush(up)
    }
}

/// How long a queue that another socket holds is waited for: the kernel lets go of a
/// closed socket's queue a moment after the close (in deferred work), so a service
/// restarted at once can find its old self still there.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// [`XdpSocket::open`], tried again while the queue is busy, for up to [`RELEASE_WAIT`].
fn open_socket(index: u32, queue: u32, max_frame: usize) -> std::io::Result<XdpSocket> {
    let since = Instant::now();
    loop {
        match XdpSocket::open(index, queue, max_frame) {
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) && since.elapsed() < RELEASE_WAIT => {
                std::thread::sleep(Duration::from_millis(20));
            }
            r => return r,
        }
    }
}

/// The interface's receive queues (as /sys/class/net/IFACE/queues lists them; one where
/// it cannot be read).
fn receive_queues(iface: &str) -> u32 {
    std::fs::read_dir(format!("/sys/class/net/{iface}/queues"))
        .map(|d| {
            d.flatten()
                .filter(|e| e.file_name().to_string_lossy().starts_with("rx-"))
                .count() as u32
        })
        .unwrap_or(1)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::Driver;

    /// The check's bound on an af_xdp port's MTU is what a socket's chunks hold.
    #[test]
    fn the_largest_mtu_fills_a_chunk() {
        let mtu = Driver::AfXdp.largest_mtu();
        assert_eq!(crate::sys::xdp::chunk_for(largest_frame(mtu)), Some(4096));
        assert_eq!(crate::sys::xdp::chunk_for(largest_frame(mtu + 1)), None);
        assert_eq!(crate::sys::xdp::chunk_for(largest_frame(1500)), Some(2048));
    }
}
