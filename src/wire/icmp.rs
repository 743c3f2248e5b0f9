//! ICMP (RFC 792) and ICMPv6 (RFC 4443) share their first four bytes: type, code,
//! checksum. Echo messages then carry an identifier and a sequence number.

use super::{be16, need, Result};

pub const HEADER_LEN: usize = 8;

pub mod v4_type {
    pub const ECHO_REPLY: u8 = 0;
    pub const DEST_UNREACHABLE: u8 = 3;
    pub const ECHO_REQUEST: u8 = 8;
    pub const TIME_EXCEEDED: u8 = 11;
}

pub mod v6_type {
    pub const DEST_UNREACHABLE: u8 = 1;
    pub const PACKET_TOO_BIG: u8 = 2;
    pub const TIME_EXCEEDED: u8 = 3;
    pub const ECHO_REQUEST: u8 = 128;
    pub const ECHO_REPLY: u8 = 129;
}

/// Whether a message of type `msg_type` is an error, which quotes the packet it is about:
/// destination unreachable, source quench, redirect, time exceeded and parameter problem
/// (RFC 792); for ICMPv6 destination unreachable, packet too big, time exceeded and
/// parameter problem (RFC 4443 §2.1: the error types are those below 128).
pub const fn is_error(v6: bool, msg_type: u8) -> bool {
    if v6 {
        matches!(msg_type, 1..=4)
    } else {
        matches!(msg_type, 3 | 4 | 5 | 11 | 12)
    }
}

view!(
    /// A view of an ICMP or ICMPv6 message.
    Packet
);

impl<T: AsRef<[u8]>> Packet<T> {
    pub fn check_len(&self) -> Result<()> {
        need(self.buffer.as_ref(), HEADER_LEN)
    }

    pub fn msg_type(&self) -> u8 {
        self.buffer.as_ref()[0]
    }

    pub fn code(&self) -> u8 {
        self.buffer.as_ref()[1]
    }

    pub fn checksum(&self) -> u16 {
        be16(self.buffer.as_ref(), 2)
    }

    /// Echo identifier (meaningful for echo request and reply).
    pub fn echo_ident(&self) -> u16 {
        be16(self.buffer.as_ref(), 4)
    }

    pub fn echo_seq(&self) -> u16 {
        be16(self.buffer.as_ref(), 6)
    }

    /// For error messages: the quoted original packet.
    pub fn quoted(&self) -> &[u8] {
        &self.buffer.as_ref()[HEADER_LEN..]
    }
}
