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

use super::live::{Joined, Made, Received, Why};
use crate::engine::PacketBuf;
use crate::ir::PortId;
use crate::sys::xdp::{Queued, XdpSocket, XdpSteering};
use crate::wire::ethernet;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// One port on one interface: a socket for each receive queue, or for the queues of one
/// worker's share.
#[derive(Debug)]
pub struct XdpPort {
    port: PortId,
    iface: String,
    /// Declared first: detached (once no worker's share holds it) before the sockets
    /// close.
    _steering: Arc<XdpSteering>,
    sockets: Vec<XdpSocket>,
    /// The interface's receive queues when the port was opened.
    queues: u32,
    /// The workers sharing the port, and the sockets made with this share's.
    shared_by: usize,
    group: Option<Joined>,
    /// Keeps the interface promiscuous while the port is open; asked whether it is up.
    promiscuous: OwnedFd,
    link: LinkState,
    /// The socket read next, so that every queue gets its turn.
    turn: usize,
}

/// Whether the interface is up, as last asked, and when: asked again only after
/// [`LinkState::FRESH`], not on every flush (a system call a batch, where a zero-copy
/// driver needs none to send).
#[derive(Debug, Default)]
struct LinkState {
    up: bool,
    asked: Option<Instant>,
}

impl LinkState {
    /// How long an answer holds: frames sent this long after the interface went down are
    /// shown to the kernel, which sends them once it is up again.
    const FRESH: Duration = Duration::from_millis(1);

    fn up(&mut self, fd: BorrowedFd, iface: &str) -> bool {
        let now = Instant::now();
        if self
            .asked
            .is_none_or(|t| now.duration_since(t) >= Self::FRESH)
        {
            // An interface that cannot be asked about (it is gone) is down.
            self.up = crate::sys::interface_up(fd, iface).unwrap_or(false);
            self.asked = Some(now);
        }
        self.up
    }
}

/// A port's receive queues dealt among the workers, each reading and sending through its
/// own: worker `w` takes queues `w`, `w + workers`, and so on. The NIC's receive hash picks
/// a frame's queue, so a flow's frames stay with one worker (not both directions of a
/// connection: the hash is not symmetric). The sockets are made at once, with the XDP
/// program that steers each queue's frames to its socket, by whichever worker opens the
/// port first on an interface; the others take theirs.
#[derive(Debug)]
pub struct XdpShares {
    workers: usize,
    /// The shares made (numbered here), and the number of the last.
    made: Mutex<(Option<Made<XdpPort>>, u16)>,
}

impl XdpShares {
    pub fn new(workers: usize) -> XdpShares {
        XdpShares {
            workers,
            made: Mutex::new((None, 0)),
        }
    }

    /// Worker `member`'s share of interface `index` (named `iface`) for a port whose
    /// largest IP packet is `mtu` bytes: the one made for it, else (the first to open the
    /// port on this interface) all the shares made anew. An interface of fewer receive
    /// queues than workers is refused: a worker without a queue could not send.
    pub fn take(
        &self,
        member: usize,
        port: PortId,
        iface: &str,
        index: u32,
        mtu: u16,
    ) -> std::io::Result<XdpPort> {
        let mut made = self.made.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(own) = Made::take(&mut made.0, index, member) {
            return Ok(own);
        }
        let queues = receive_queues(iface);
        if (queues as usize) < self.workers {
            return Err(std::io::Error::other(format!(
                "{queues} receive queue(s), fewer than the {} workers that share the port \
                 (ethtool -L {iface} combined {})",
                self.workers, self.workers
            )));
        }
        let sockets = open_sockets(index, queues, mtu)?;
        let steering = Arc::new(XdpSteering::attach(index, &sockets)?);
        let id = made.1.wrapping_add(1);
        let mut shares: Vec<Vec<XdpSocket>> = (0..self.workers).map(|_| Vec::new()).collect();
        for (q, s) in sockets.into_iter().enumerate() {
            shares[q % self.workers].push(s);
        }
        let ports = shares
            .into_iter()
            .enumerate()
            .map(|(w, sockets)| {
                Ok(Some(XdpPort {
                    port,
                    iface: iface.to_owned(),
                    _steering: Arc::clone(&steering),
                    sockets,
                    queues,
                    shared_by: self.workers,
                    group: Some(Joined {
                        id,
                        started: w == member,
                    }),
                    promiscuous: crate::sys::promiscuous(index)?,
                    link: LinkState::default(),
                    turn: 0,
                }))
            })
            .collect::<std::io::Result<Vec<_>>>()?;
        *made = (
            Some(Made {
                ifindex: index,
                id,
                ports,
            }),
            id,
        );
        Made::take(&mut made.0, index, member)
            .ok_or_else(|| std::io::Error::other("no such worker's share"))
    }

    /// Notes that a share made as `id` is closed: `true` for the first (see
    /// [`super::live::PortShares::leave`]).
    pub fn leave(&self, id: u16) -> bool {
        let mut made = self.made.lock().unwrap_or_else(PoisonError::into_inner);
        Made::leave(&mut made.0, id)
    }
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
        let queues = receive_queues(iface);
        let sockets = open_sockets(index, queues, mtu)?;
        let steering = XdpSteering::attach(index, &sockets)?;
        Ok(XdpPort {
            port,
            iface: iface.to_owned(),
            _steering: Arc::new(steering),
            sockets,
            queues,
            shared_by: 1,
            group: None,
            promiscuous: crate::sys::promiscuous(index)?,
            link: LinkState::default(),
            turn: 0,
        })
    }

    /// How the port works, for the log: its receive queues (and the workers sharing
    /// them), and whether the kernel hands their frames over in place (zero-copy) or
    /// copies them.
    pub fn mode(&self) -> String {
        let copies = if self.sockets.iter().all(XdpSocket::zero_copy) {
            "zero-copy"
        } else {
            "copy"
        };
        match self.shared_by {
            1 => format!("{} queue(s), {copies}", self.queues),
            n => format!("{} queue(s) shared by {n} workers, {copies}", self.queues),
        }
    }

    /// The shares made with this one, where the workers share the port.
    pub fn group(&self) -> Option<Joined> {
        self.group
    }

    /// Whether the interface's receive queues are no longer those the port was opened on
    /// (`ethtool -L` changed them): frames of a queue without a socket would go to the
    /// kernel's stack, around the pipeline.
    pub fn queues_changed(&self) -> bool {
        receive_queues(&self.iface) != self.queues
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

    /// Has the kernel do the port's queues' work in the sockets' own calls (see
    /// [`XdpSocket::poll_busily`]), taking up to `budget` frames a call.
    pub fn poll_busily(&mut self, budget: u16) -> std::io::Result<()> {
        self.sockets
            .iter_mut()
            .try_for_each(|s| s.poll_busily(budget))
    }

    /// Queues a frame to be sent at the next [`XdpPort::flush`] (from the first queue's
    /// socket; any socket of the interface sends out of it).
    pub fn send(&mut self, frame: &[u8]) -> Result<(), Why> {
        match self.sockets[0].send(frame) {
            Queued::Yes => Ok(()),
            Queued::Full => Err(Why::QueueFull),
            Queued::TooLong => Err(Why::Refused(std::io::Error::from_raw_os_error(
                libc::EMSGSIZE,
            ))),
        }
    }

    /// Has the kernel send the frames queued, or drops them while the interface is down:
    /// how many it dropped.
    pub fn flush(&mut self) -> std::io::Result<usize> {
        if !self.sockets[0].pending() {
            return Ok(0);
        }
        let up = self.link.up(self.promiscuous.as_fd(), &self.iface);
        self.sockets[0].flush(up)
    }
}

/// How long a queue that another socket holds is waited for: the kernel lets go of a
/// closed socket's queue a moment after the close (in deferred work), so a service
/// restarted at once can find its old self still there.
const RELEASE_WAIT: Duration = Duration::from_secs(2);

/// A socket on each of the interface's first `queues` receive queues, for frames of IP
/// packets of `mtu` bytes.
fn open_sockets(index: u32, queues: u32, mtu: u16) -> std::io::Result<Vec<XdpSocket>> {
    let max_frame = largest_frame(mtu);
    (0..queues)
        .map(|q| open_socket(index, q, max_frame))
        .collect()
}

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
pub fn receive_queues(iface: &str) -> u32 {
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
