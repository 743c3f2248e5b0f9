//! A live port on a Linux network interface, through the driver its pipeline names:
//! AF_PACKET (`crate::io::af_packet`) or AF_XDP (`crate::io::af_xdp`). The service reads
//! and sends frames through this one type whichever it is.

use super::af_packet::{Fanout, PacketPort};
use super::af_xdp::{XdpPort, XdpShares};
use crate::engine::PacketBuf;
use crate::ir::{Driver, PortId};
use std::os::fd::BorrowedFd;

/// Why a live port could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// the interface does not exist
    #[error("interface {iface}: {source}")]
    Interface {
        iface: String,
        source: std::io::Error,
    },
    /// the socket could not be opened (it needs CAP_NET_RAW, and AF_XDP CAP_NET_ADMIN and
    /// CAP_BPF too), its rings mapped or, for AF_XDP, its XDP program attached
    #[error("interface {iface}: {driver} socket: {source}{hint}")]
    Socket {
        iface: String,
        driver: &'static str,
        source: std::io::Error,
        /// What to look at, for the failures that have a usual cause.
        hint: &'static str,
    },
}

/// How the workers share a port, each through sockets of its own: an AF_PACKET fanout
/// group, or an AF_XDP port's receive queues dealt among them.
#[derive(Debug)]
pub enum PortShares {
    Fanout(Fanout),
    Xdp(XdpShares),
}

impl PortShares {
    /// Notes that a port of sockets made together as `id` is closed because its interface
    /// is gone (or, AF_XDP, its queues changed): `true` for the first of them (the port is
    /// closed from then on, for every worker).
    pub fn leave(&self, id: u16) -> bool {
        match self {
            PortShares::Fanout(f) => f.leave(id),
            PortShares::Xdp(x) => x.leave(id),
        }
    }
}

/// The sockets a shared port has on an interface, one set a worker, made together by
/// whichever worker opened the port there first; each worker takes its own.
#[derive(Debug)]
pub(super) struct Made<P> {
    pub ifindex: u32,
    pub id: u16,
    /// Per worker, its sockets not yet taken.
    pub ports: Vec<Option<P>>,
}

impl<P> Made<P> {
    /// Worker `member`'s port, where `made` is on interface `ifindex` and it is not yet
    /// taken.
    pub fn take(made: &mut Option<Made<P>>, ifindex: u32, member: usize) -> Option<P> {
        made.as_mut()
            .filter(|m| m.ifindex == ifindex)
            .and_then(|m| m.ports.get_mut(member)?.take())
    }

    /// Forgets `made` if it is `id`'s: `true` for the first to ask.
    pub fn leave(made: &mut Option<Made<P>>, id: u16) -> bool {
        let first = made.as_ref().is_some_and(|m| m.id == id);
        if first {
            *made = None;
        }
        first
    }
}

/// A socket of a shared port: the id of the sockets made with it, and whether its worker
/// made them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joined {
    pub id: u16,
    pub started: bool,
}

/// What [`LivePort::flush`] did not send: frames dropped, and why the last of them was.
#[derive(Debug, Default)]
pub struct Unsent {
    pub dropped: usize,
    pub why: Option<Why>,
}

/// Why frames were not sent: a frame [`LivePort::send`] did not queue, or those
/// [`LivePort::flush`] did not hand over.
#[derive(Debug)]
pub enum Why {
    /// The port's or the interface's transmit queue stayed full: dropped.
    QueueFull,
    /// The interface is down: dropped (AF_XDP, whose kernel would send them stale once
    /// it is up).
    LinkDown,
    /// The interface refused a frame (it is down or gone, or the frame is longer than its
    /// MTU): dropped. The port stays open and sends again once it can.
    Refused(std::io::Error),
    /// The kernel could not be asked to send (AF_XDP): the frames wait in the port's
    /// queue for the next flush.
    Waiting(std::io::Error),
}

impl Unsent {
    /// `dropped` frames, dropped for `why`.
    pub fn dropped(dropped: usize, why: Why) -> Unsent {
        Unsent {
            dropped,
            why: Some(why),
        }
    }
}

/// What [`LivePort::receive`] took from the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// A frame, in the slot.
    Frame,
    /// A frame of this many bytes, longer than the ring's slots (the port's MTU) or the
    /// packet buffers hold: dropped.
    Oversize(usize),
}

/// One port on one interface.
#[derive(Debug)]
pub struct LivePort {
    iface: String,
    /// The interface's index when the port was opened.
    index: u32,
    socket: Socket,
}

#[derive(Debug)]
enum Socket {
    Packet(PacketPort),
    Xdp(XdpPort),
}

impl LivePort {
    /// Opens `iface` for port `port` of driver `driver` (af_packet or af_xdp), whose
    /// largest IP packet is `mtu` bytes. With `shares`, the port is shared by the workers
    /// and this is the given worker's part of it. With `busy_poll`, its reader polls
    /// without sleeping: an AF_XDP port then has the kernel do its queues' work in the
    /// sockets' own calls, up to that many frames a call (see
    /// [`crate::sys::xdp::XdpSocket::poll_busily`]); an AF_PACKET port's ring is filled by
    /// the kernel as before.
    pub fn open(
        port: PortId,
        iface: &str,
        driver: Driver,
        mtu: u16,
        shares: Option<(&PortShares, usize)>,
        busy_poll: Option<u16>,
    ) -> Result<LivePort, LiveError> {
        let index = crate::sys::interface_index(iface).map_err(|source| LiveError::Interface {
            iface: iface.to_owned(),
            source,
        })?;
        let name = if driver == Driver::AfXdp {
            "AF_XDP"
        } else {
            "AF_PACKET"
        };
        let failed = |source: std::io::Error| {
            let hint = match source.raw_os_error() {
                Some(libc::EPERM) if driver == Driver::AfXdp => {
                    " (run as root, or with CAP_NET_RAW, CAP_NET_ADMIN and CAP_BPF)"
                }
                Some(libc::EPERM) => " (run as root, or with CAP_NET_RAW)",
                Some(libc::EBUSY | libc::EEXIST) if driver == Driver::AfXdp => {
                    " (another XDP program or AF_XDP socket is on the interface)"
                }
                Some(libc::ENOPROTOOPT) => " (busy polling needs Linux 5.11 or later)",
                Some(libc::ENOSPC) if driver == Driver::AfXdp => {
                    " (the driver has too few queues for XDP; a veth takes it only with as \
                     many receive queues as its peer has transmit queues: ethtool -L)"
                }
                _ => "",
            };
            LiveError::Socket {
                iface: iface.to_owned(),
                driver: name,
                source,
                hint,
            }
        };
        let mut socket = match (driver, shares) {
            (Driver::AfXdp, Some((PortShares::Xdp(x), member))) => {
                Socket::Xdp(x.take(member, port, iface, index, mtu).map_err(failed)?)
            }
            (Driver::AfXdp, _) => {
                Socket::Xdp(XdpPort::open(port, iface, index, mtu).map_err(failed)?)
            }
            (_, Some((PortShares::Fanout(f), member))) => Socket::Packet(
                PacketPort::open(port, index, mtu, Some((f, member))).map_err(failed)?,
            ),
            _ => Socket::Packet(PacketPort::open(port, index, mtu, None).map_err(failed)?),
        };
        if let (Socket::Xdp(x), Some(budget)) = (&mut socket, busy_poll) {
            x.poll_busily(budget).map_err(failed)?;
        }
        Ok(LivePort {
            iface: iface.to_owned(),
            index,
            socket,
        })
    }

    pub fn iface(&self) -> &str {
        &self.iface
    }

    /// The sockets made with this port's, where the workers share the port.
    pub fn group(&self) -> Option<Joined> {
        match &self.socket {
            Socket::Packet(p) => p.group(),
            Socket::Xdp(x) => x.group(),
        }
    }

    /// Whether the interface the port was opened on is gone (removed, or another made
    /// under its name since). A link merely down is not: the port reads again once it is
    /// up.
    pub fn removed(&self) -> bool {
        crate::sys::interface_index(&self.iface).map_or(true, |i| i != self.index)
    }

    /// Whether the port no longer covers the interface's receive queues (an AF_XDP port
    /// whose interface's queues were changed, see [`XdpPort::queues_changed`]); an
    /// AF_PACKET socket reads every queue.
    pub fn queues_changed(&self) -> bool {
        match &self.socket {
            Socket::Packet(_) => false,
            Socket::Xdp(x) => x.queues_changed(),
        }
    }

    /// The socket family, as logs name it.
    pub fn driver(&self) -> &'static str {
        match self.socket {
            Socket::Packet(_) => "AF_PACKET",
            Socket::Xdp(_) => "AF_XDP",
        }
    }

    /// How the port works, for the log (AF_XDP: queues, zero-copy or copy).
    pub fn mode(&self) -> String {
        match &self.socket {
            Socket::Packet(_) => "mapped receive ring".to_owned(),
            Socket::Xdp(x) => x.mode(),
        }
    }

    /// The descriptors to wait on for frames.
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        match &self.socket {
            Socket::Packet(p) => vec![p.fd()],
            Socket::Xdp(x) => x.fds().collect(),
        }
    }

    /// Frames the kernel dropped since the last call because the receive ring was full.
    pub fn ring_drops(&mut self) -> u64 {
        match &mut self.socket {
            Socket::Packet(p) => p.ring_drops(),
            Socket::Xdp(x) => x.ring_drops(),
        }
    }

    /// Copies the next frame received into `slot`, stamped `ts_ns`; `None` when none
    /// waits. The pipeline sees the frame as it was on the wire.
    pub fn receive(&mut self, slot: &mut PacketBuf, ts_ns: u64) -> Option<Received> {
        match &mut self.socket {
            Socket::Packet(p) => p.receive(slot, ts_ns),
            Socket::Xdp(x) => x.receive(slot, ts_ns),
        }
    }

    /// Queues a frame to be sent out of the interface at the next [`LivePort::flush`];
    /// else it is dropped, for the reason given.
    pub fn send(&mut self, frame: &[u8]) -> Result<(), Why> {
        match &mut self.socket {
            Socket::Packet(p) => p.send(frame),
            Socket::Xdp(x) => x.send(frame),
        }
    }

    /// Hands the interface what [`LivePort::send`] queued: what it did not send.
    pub fn flush(&mut self) -> Unsent {
        match &mut self.socket {
            Socket::Packet(p) => p.flush(),
            Socket::Xdp(x) => match x.flush() {
                Ok(0) => Unsent::default(),
                Ok(dropped) => Unsent::dropped(dropped, Why::LinkDown),
                Err(e) => Unsent::dropped(0, Why::Waiting(e)),
            },
        }
    }
}
