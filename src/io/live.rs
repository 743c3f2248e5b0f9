//! A live port on a Linux network interface, through the driver its pipeline names:
//! AF_PACKET (`crate::io::af_packet`) or AF_XDP (`crate::io::af_xdp`). The service reads
//! and sends frames through this one type whichever it is.

use super::af_packet::{Fanout, Joined, PacketPort};
use super::af_xdp::XdpPort;
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

/// What became of a frame sent ([`LivePort::send`]).
#[derive(Debug)]
pub enum Sent {
    /// Handed to the interface (AF_XDP: queued until [`LivePort::flush`]).
    Yes,
    /// The interface's transmit queue stayed full: the frame was dropped.
    QueueFull,
    /// The interface refused the frame (it is down or gone, or the frame is longer than
    /// its MTU): dropped. The port stays open and sends again once it can.
    Refused(std::io::Error),
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
    /// largest IP packet is `mtu` bytes. With `fanout` (af_packet only), the port's frames
    /// are shared with the other sockets of its group: the socket is that member's.
    pub fn open(
        port: PortId,
        iface: &str,
        driver: Driver,
        mtu: u16,
        fanout: Option<(&Fanout, usize)>,
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
        let socket = if driver == Driver::AfXdp {
            Socket::Xdp(XdpPort::open(port, iface, index, mtu).map_err(failed)?)
        } else {
            Socket::Packet(PacketPort::open(port, index, mtu, fanout).map_err(failed)?)
        };
        Ok(LivePort {
            iface: iface.to_owned(),
            index,
            socket,
        })
    }

    pub fn iface(&self) -> &str {
        &self.iface
    }

    /// The fanout group the port's socket is in, if it shares the port.
    pub fn group(&self) -> Option<Joined> {
        match &self.socket {
            Socket::Packet(p) => p.group(),
            Socket::Xdp(_) => None,
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

    /// Sends a frame out of the interface (AF_XDP: at the next [`LivePort::flush`]).
    pub fn send(&mut self, frame: &[u8]) -> Sent {
        match &mut self.socket {
            Socket::Packet(p) => p.send(frame),
            Socket::Xdp(x) => x.send(frame),
        }
    }

    /// Hands the interface what [`LivePort::send`] queued, or drops it while the
    /// interface is down: how many frames were dropped.
    pub fn flush(&mut self) -> std::io::Result<usize> {
        match &mut self.socket {
            Socket::Packet(_) => Ok(0),
            Socket::Xdp(x) => x.flush(),
        }
    }
}
