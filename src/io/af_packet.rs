//! Live ports on Linux network interfaces through AF_PACKET sockets (packet(7)): every
//! frame the interface receives is read into a packet buffer (one recv(2) each), every
//! frame sent out of the port is one send(2). The socket sees the interface
//! promiscuously and not the frames sent through it, so a port can sit in the path
//! between two hosts (a bump in the wire).
//!
//! What the kernel does to frames before a socket sees them matters: receive offloads
//! (GRO) hand over merged frames, VLAN acceleration takes tags out of the frame, and
//! virtual interfaces pass checksums left for the hardware to fill. On interfaces that
//! do any of these, turn them off (`ethtool -K IFACE gro off rxvlan off`, and `tx off` on
//! the senders of virtual links); docs/operations.md says more.

use crate::engine::PacketBuf;
use crate::ir::PortId;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

/// Why a live port could not be opened or used.
#[derive(Debug, thiserror::Error)]
pub enum LiveError {
    /// the interface does not exist
    #[error("interface {iface}: {source}")]
    Interface {
        iface: String,
        source: std::io::Error,
    },
    /// the socket could not be opened (it needs CAP_NET_RAW)
    #[error("interface {iface}: AF_PACKET socket: {source}")]
    Socket {
        iface: String,
        source: std::io::Error,
    },
    /// receiving or sending failed
    #[error("interface {iface}: {source}")]
    Io {
        iface: String,
        source: std::io::Error,
    },
}

/// What [`LivePort::receive`] took from the interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Received {
    /// A frame, in the slot.
    Frame,
    /// A frame of this many bytes, larger than the packet buffers: dropped.
    Oversize(usize),
}

/// One port on one interface.
#[derive(Debug)]
pub struct LivePort {
    port: PortId,
    iface: String,
    fd: OwnedFd,
}

impl LivePort {
    pub fn open(port: PortId, iface: &str) -> Result<LivePort, LiveError> {
        let index = crate::sys::interface_index(iface).map_err(|source| LiveError::Interface {
            iface: iface.to_owned(),
            source,
        })?;
        let fd = crate::sys::packet_socket(index).map_err(|source| LiveError::Socket {
            iface: iface.to_owned(),
            source,
        })?;
        Ok(LivePort {
            port,
            iface: iface.to_owned(),
            fd,
        })
    }

    pub fn iface(&self) -> &str {
        &self.iface
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Reads the next frame waiting into `slot`, received at `ts_ns`; `None` when none
    /// waits.
    pub fn receive(&self, slot: &mut PacketBuf, ts_ns: u64) -> Result<Option<Received>, LiveError> {
        let room = slot.room();
        let fits = room.len();
        match crate::sys::receive(self.fd.as_fd(), room).map_err(|e| self.failed(e))? {
            None => Ok(None),
            Some(len) if len > fits => {
                slot.received(0, self.port, ts_ns);
                Ok(Some(Received::Oversize(len)))
            }
            Some(len) => {
                slot.received(len, self.port, ts_ns);
                Ok(Some(Received::Frame))
            }
        }
    }

    /// Sends a frame out of the interface; false when its queue was full and the frame
    /// was not sent.
    pub fn send(&self, frame: &[u8]) -> Result<bool, LiveError> {
        crate::sys::send(self.fd.as_fd(), frame).map_err(|e| self.failed(e))
    }

    fn failed(&self, source: std::io::Error) -> LiveError {
        LiveError::Io {
            iface: self.iface.clone(),
            source,
        }
    }
}
