//! Live ports on Linux network interfaces through AF_PACKET sockets (packet(7)): the
//! frames the interface receives arrive in a ring mapped from the kernel (TPACKET_V2, no
//! system call a frame) and are copied into packet buffers; the frames sent out of the
//! port are copied into a queue, which each flush sends with one sendmmsg(2) for every
//! [`crate::sys::FRAMES_A_CALL`]. The socket sees the interface promiscuously and not the frames
//! sent through it, so a port can sit in the path between two hosts (a bump in the
//! wire).
//!
//! The kernel hands a socket frames as its interface left them: the VLAN tag taken out
//! (put back here, from the ring's frame header), a checksum of a frame sent by this host
//! or across a virtual link left for hardware to finish (finished here, where the
//! virtio-net header the kernel puts before each frame says: the L4 header's, or an inner
//! one's in a tunnel), and, with receive offloads (GRO, LRO) or a virtual link's
//! segmentation offloads (TSO, GSO) on, merged or unsegmented frames larger than any wire
//! carries, which must be turned off (docs/operations.md).

use super::live::{Joined, Made, Received, Unsent, Why};
use crate::engine::PacketBuf;
use crate::ir::PortId;
use crate::sys::RxRing;
use crate::wire::ethernet;
use crate::wire::{checksum, put16};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::{Mutex, PoisonError};

/// Times a full transmit queue is tried again before the frame is given up.
const TX_RETRIES: usize = 3;

/// An 802.1Q tag's length: TPID and TCI.
const VLAN_TAG: usize = 4;

/// One port on one interface, through an AF_PACKET socket.
#[derive(Debug)]
pub struct PacketPort {
    port: PortId,
    /// The frames received, mapped (declared first: unmapped before the socket closes).
    ring: RxRing,
    fd: OwnedFd,
    /// The fanout group the socket is in, when it shares the port with other sockets.
    group: Option<Joined>,
    /// Frames sent, until the next flush.
    tx: TxQueue,
}

/// A port's fanout group, when each worker has a socket of its own on the port: the
/// kernel deals the interface's frames among them (see [`crate::sys::join_fanout`]), by
/// its flow hash or by a steering program whose result indexes the members in the order
/// they joined. So a group's sockets are all made at once, in member order, by whichever
/// member opens the port first (at start, and when the interface is removed and made
/// anew), and the others take theirs from it.
#[derive(Debug)]
pub struct Fanout {
    members: usize,
    state: Mutex<FanoutState>,
}

#[derive(Debug)]
struct FanoutState {
    /// The program that picks each frame's member (PACKET_FANOUT_EBPF), else the
    /// kernel's flow hash.
    program: Option<OwnedFd>,
    /// The group's sockets (its id the kernel's), and its first member's, for a new
    /// program to be set on it.
    group: Option<Made<PacketPort>>,
    anchor: Option<OwnedFd>,
}

impl Fanout {
    /// A group of `members` sockets a port, steered by `program` (a socket-filter
    /// program) or by the kernel's flow hash.
    pub fn new(members: usize, program: Option<BorrowedFd>) -> std::io::Result<Fanout> {
        let program = program.map(|p| p.try_clone_to_owned()).transpose()?;
        Ok(Fanout {
            members,
            state: Mutex::new(FanoutState {
                program,
                group: None,
                anchor: None,
            }),
        })
    }

    /// Steers the group by `program` from now on, and any group made later.
    pub fn steer(&self, program: BorrowedFd) -> std::io::Result<()> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(anchor) = state.group.as_ref().and(state.anchor.as_ref()) {
            crate::sys::steer_fanout(anchor.as_fd(), program)?;
        }
        state.program = Some(program.try_clone_to_owned()?);
        Ok(())
    }

    /// Member `member`'s socket on interface `ifindex`: the one made for it with the
    /// group, else (the first to open the port on this interface) a new group's.
    fn take(
        &self,
        member: usize,
        port: PortId,
        ifindex: u32,
        mtu: u16,
    ) -> std::io::Result<PacketPort> {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(own) = Made::take(&mut state.group, ifindex, member) {
            return Ok(own);
        }
        let steered = state.program.as_ref().map(AsFd::as_fd);
        let mut sockets = Vec::with_capacity(self.members);
        let mut id = None;
        for m in 0..self.members {
            let (fd, ring) = PacketPort::socket(mtu)?;
            // Bound, the socket would take every frame until it joins the group: copies
            // of what the members take. Until the group is whole, it takes none.
            crate::sys::refuse_frames(fd.as_fd(), true)?;
            crate::sys::bind_packet_socket(&fd, ifindex)?;
            let joined = crate::sys::join_fanout(fd.as_fd(), id, steered.is_some())?;
            id = Some(joined);
            sockets.push(Some(PacketPort {
                port,
                ring,
                fd,
                group: Some(Joined {
                    id: joined,
                    started: m == member,
                }),
                tx: TxQueue::new(),
            }));
        }
        let first = sockets.first().and_then(Option::as_ref);
        let (Some(first), Some(id)) = (first, id) else {
            return Err(std::io::Error::other("a fanout group of no members"));
        };
        if let Some(program) = steered {
            crate::sys::steer_fanout(first.fd(), program)?;
        }
        for s in sockets.iter().flatten() {
            crate::sys::refuse_frames(s.fd(), false)?;
        }
        state.anchor = Some(first.fd().try_clone_to_owned()?);
        state.group = Some(Made {
            ifindex,
            id,
            ports: sockets,
        });
        Made::take(&mut state.group, ifindex, member)
            .ok_or_else(|| std::io::Error::other("no such member of the fanout group"))
    }

    /// Notes that a socket of group `id` is closed because its interface is gone: `true`
    /// for the first of that group's (the port is closed from then on, for all of them).
    pub fn leave(&self, id: u16) -> bool {
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        let first = Made::leave(&mut state.group, id);
        if first {
            state.anchor = None;
        }
        first
    }
}

/// The memory of a port's receive ring: 4096 slots of standard frames, enough to ride out
/// a burst while the I/O thread is busy.
const RING_BYTES: usize = 8 << 20;

impl PacketPort {
    /// Opens interface `index` for a port whose largest IP packet is `mtu` bytes: the
    /// receive ring's slots hold such frames (two VLAN tags included); longer ones are cut
    /// short and dropped as oversize. With `fanout`, the socket is that member's of the
    /// port's group, and takes its share of the port's frames.
    pub fn open(
        port: PortId,
        index: u32,
        mtu: u16,
        fanout: Option<(&Fanout, usize)>,
    ) -> std::io::Result<PacketPort> {
        if let Some((fanout, member)) = fanout {
            return fanout.take(member, port, index, mtu);
        }
        let (fd, ring) = PacketPort::socket(mtu)?;
        crate::sys::bind_packet_socket(&fd, index)?;
        Ok(PacketPort {
            port,
            ring,
            fd,
            group: None,
            tx: TxQueue::new(),
        })
    }

    /// A packet socket, not yet bound, and its receive ring for frames of IP packets of
    /// `mtu` bytes.
    fn socket(mtu: u16) -> std::io::Result<(OwnedFd, RxRing)> {
        let fd = crate::sys::packet_socket()?;
        // A slot holds the ring's header (about 70 bytes with its alignment), then the
        // frame.
        let slot = (usize::from(mtu) + ethernet::HEADER_LEN + 2 * VLAN_TAG + 128)
            .next_power_of_two()
            .max(2048);
        let ring = RxRing::new(&fd, slot, RING_BYTES)?;
        Ok((fd, ring))
    }

    /// The fanout group the socket is in, if any.
    pub fn group(&self) -> Option<Joined> {
        self.group
    }

    /// Frames the kernel dropped since the last call because the receive ring was full.
    pub fn ring_drops(&self) -> u64 {
        crate::sys::ring_drops(self.fd.as_fd()).map_or(0, u64::from)
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Copies the next frame received into `slot`, stamped `ts_ns`; `None` when none
    /// waits. A VLAN tag the interface took out is put back, and a checksum the sender
    /// left for hardware is finished, so the pipeline sees the frame as it was on the wire.
    pub fn receive(&mut self, slot: &mut PacketBuf, ts_ns: u64) -> Option<Received> {
        // A frame the interface sent is not the port's to run: skipped.
        loop {
            if let Some(received) = self.take(slot, ts_ns)? {
                return Some(received);
            }
        }
    }

    /// [`PacketPort::receive`]'s next frame from the ring, `Some(None)` for one the
    /// interface sent.
    fn take(&mut self, slot: &mut PacketBuf, ts_ns: u64) -> Option<Option<Received>> {
        let port = self.port;
        self.ring.next(|frame, aux| {
            if aux.outgoing {
                return None;
            }
            // A tag the interface took out goes back after the addresses, as the frame
            // is copied: the frame starts where every received frame does, which the
            // ICMP errors about it look for (see `engine::pmtu`).
            let tag = aux.vlan.filter(|_| frame.len() >= 12);
            let len = frame.len() + if tag.is_some() { VLAN_TAG } else { 0 };
            let room = slot.room();
            if aux.len > frame.len() || len > room.len() {
                slot.received(0, port, ts_ns);
                return Some(Received::Oversize(aux.len));
            }
            match tag {
                Some((tpid, tci)) => {
                    room[..12].copy_from_slice(&frame[..12]);
                    put16(room, 12, tpid);
                    put16(room, 14, tci);
                    room[12 + VLAN_TAG..len].copy_from_slice(&frame[12..]);
                }
                None => room[..len].copy_from_slice(frame),
            }
            slot.received(len, port, ts_ns);
            if let Some((start, offset)) = aux.partial_checksum {
                // Counted from the frame as the kernel had it: before any tag put back.
                finish_checksum(slot.data_mut(), start + (len - frame.len()), offset);
            }
            Some(Received::Frame)
        })
    }

    /// Queues a copy of a frame to be sent at the next [`PacketPort::flush`] (at once,
    /// with those queued before it, when the queue has no room for it).
    pub fn send(&mut self, frame: &[u8]) -> Result<(), Why> {
        if !self.tx.has_room(frame.len()) {
            // What it did not send (and what earlier flushes did not) waits to be told.
            self.tx.unsent = self.flush();
        }
        match self.tx.push(frame) {
            true => Ok(()),
            false => Err(Why::Refused(std::io::Error::from_raw_os_error(
                libc::EMSGSIZE,
            ))),
        }
    }

    /// Sends the frames queued, [`crate::sys::FRAMES_A_CALL`] a system call, trying
    /// again a few times while the interface's transmit queue is full: what it did not
    /// send (with what a full queue made [`PacketPort::send`] flush).
    pub fn flush(&mut self) -> Unsent {
        let mut unsent = std::mem::take(&mut self.tx.unsent);
        let mut frames: [&[u8]; crate::sys::FRAMES_A_CALL] = [&[]; crate::sys::FRAMES_A_CALL];
        let (mut at, mut full, mut retried) = (0, 0, false);
        while at < self.tx.len() {
            let n = self.tx.frames(at, &mut frames);
            match crate::sys::send_frames(self.fd.as_fd(), &frames[..n]) {
                Ok(0) if full < TX_RETRIES => {
                    full += 1;
                    std::thread::yield_now();
                }
                Ok(0) => {
                    unsent.dropped += self.tx.len() - at;
                    unsent.why = Some(Why::QueueFull);
                    break;
                }
                Ok(sent) => {
                    at += sent;
                    full = 0;
                }
                // The first error may be an old one: the socket keeps its link's going
                // down as a pending error, which the next call reports (and clears). So
                // the same frames are tried again once.
                Err(_) if !retried => retried = true,
                // The first frame refused: dropped, and the next tried.
                Err(e) => {
                    at += 1;
                    unsent.dropped += 1;
                    unsent.why = Some(Why::Refused(e));
                }
            }
        }
        self.tx.clear();
        unsent
    }
}

/// Room for the frames one flush sends, copied: all a processed batch sends out of a port
/// fits, unless its frames are large.
const TX_BYTES: usize = 256 << 10;

/// The frames a port queues for its next flush, one after the other in one buffer.
#[derive(Debug)]
struct TxQueue {
    bytes: Vec<u8>,
    /// Where each frame ends in `bytes`.
    ends: Vec<usize>,
    /// What flushes made to make room did not send, for the next flush to report.
    unsent: Unsent,
}

impl TxQueue {
    fn new() -> TxQueue {
        TxQueue {
            bytes: Vec::with_capacity(TX_BYTES),
            ends: Vec::with_capacity(TX_BYTES / 64),
            unsent: Unsent::default(),
        }
    }

    fn len(&self) -> usize {
        self.ends.len()
    }

    /// Whether a frame of `len` bytes fits without the buffers growing.
    fn has_room(&self, len: usize) -> bool {
        self.bytes.len() + len <= self.bytes.capacity() && self.ends.len() < self.ends.capacity()
    }

    /// Queues a copy of `frame`; `false` for one larger than the whole queue.
    fn push(&mut self, frame: &[u8]) -> bool {
        if frame.len() > TX_BYTES {
            return false;
        }
        self.bytes.extend_from_slice(frame);
        self.ends.push(self.bytes.len());
        true
    }

    /// Fills `frames` with the frames queued from the `at`th on: how many.
    fn frames<'a>(&'a self, at: usize, frames: &mut [&'a [u8]]) -> usize {
        let mut n = 0;
        let mut start = at.checked_sub(1).map_or(0, |i| self.ends[i]);
        for (slot, &end) in frames.iter_mut().zip(&self.ends[at..]) {
            *slot = &self.bytes[start..end];
            start = end;
            n += 1;
        }
        n
    }

    fn clear(&mut self) {
        self.bytes.clear();
        self.ends.clear();
    }
}

/// Finishes a checksum the sender left for hardware (CHECKSUM_PARTIAL), as a NIC would:
/// the one's complement sum of the bytes from `start` to the frame's end, the field at
/// `start + offset` holding the pseudo-header's sum among them, complemented into that
/// field (RFC 1071; RFC 768: a UDP checksum computed as zero is sent as all ones, which
/// TCP reads the same). The kernel says where (its virtio-net header), so a checksum
/// inside a tunnel is finished as well as an outer one. A place outside the frame is left
/// alone.
fn finish_checksum(frame: &mut [u8], start: usize, offset: usize) {
    let Some(field) = start.checked_add(offset) else {
        return;
    };
    if field + 2 > frame.len() {
        return;
    }
    let c = !checksum::fold(checksum::sum(0, &frame[start..]));
    put16(frame, field, if c == 0 { 0xffff } else { c });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wire::{be16, ip_proto, ipv4, ipv6};
    use proptest::prelude::*;

    proptest! {
        /// The frames a flush hands the kernel, a call's worth from any place on, are the
        /// frames queued, whole and in order; the queue takes frames while it has room.
        #[test]
        fn queued_frames_come_out_as_they_went_in(
            lens in proptest::collection::vec(0usize..9000, 0..200),
            at in 0usize..200,
        ) {
            let mut q = TxQueue::new();
            let mut queued = Vec::new();
            for (i, len) in lens.into_iter().enumerate() {
                if !q.has_room(len) {
                    break;
                }
                let frame = vec![i as u8; len];
                prop_assert!(q.push(&frame));
                queued.push(frame);
            }
            let at = at.min(q.len());
            let mut frames: [&[u8]; crate::sys::FRAMES_A_CALL] = [&[]; crate::sys::FRAMES_A_CALL];
            let n = q.frames(at, &mut frames);
            prop_assert_eq!(n, (q.len() - at).min(crate::sys::FRAMES_A_CALL));
            for (got, want) in frames[..n].iter().zip(&queued[at..]) {
                prop_assert_eq!(got, &want.as_slice());
            }
        }

        /// A checksum left partial is finished as a NIC would: a TCP or UDP packet (IPv4
        /// or IPv6, tagged or not) whose checksum field holds its pseudo-header's sum comes
        /// out with the checksum a whole computation gives, and any place in any bytes is
        /// finished or left alone without a panic.
        #[test]
        fn finished_checksums_are_whole(
            v6 in any::<bool>(), tcp in any::<bool>(), tagged in any::<bool>(),
            payload in proptest::collection::vec(any::<u8>(), 0..64),
            junk in proptest::collection::vec(any::<u8>(), 0..120),
            start in any::<u16>(), offset in any::<u16>(),
        ) {
            let mut junk = junk;
            finish_checksum(&mut junk, usize::from(start % 130), usize::from(offset));
            let (src, dst) = (0x0a00_0001u128, 0x0a00_0002u128);
            let (src, dst) = if v6 { (src | 0x2001_0db8 << 96, dst | 0x2001_0db8 << 96) } else { (src, dst) };
            let proto = if tcp { ip_proto::TCP } else { ip_proto::UDP };
            let mut f = crate::wire::testing::frame(v6, src, dst, proto, 1000, 2000, 0x18, 0);
            let l3 = ethernet::HEADER_LEN;
            let l4 = l3 + if v6 { ipv6::HEADER_LEN } else { ipv4::MIN_HEADER_LEN };
            let offset = if tcp { 16 } else { 6 };
            f.extend_from_slice(&payload);
            let len = f.len() - l4;
            if v6 {
                put16(&mut f, l3 + 4, len as u16);
            } else {
                put16(&mut f, l3 + 2, (len + ipv4::MIN_HEADER_LEN) as u16);
            }
            if !tcp {
                put16(&mut f, l4 + 4, len as u16);
            }
            let pseudo = if v6 {
                checksum::pseudo_v6(&src.to_be_bytes(), &dst.to_be_bytes(), proto, len as u32)
            } else {
                checksum::pseudo_v4((src as u32).to_be_bytes(), (dst as u32).to_be_bytes(), proto, len as u16)
            };
            put16(&mut f, l4 + offset, 0);
            let whole = !checksum::fold(checksum::sum(pseudo, &f[l4..]));
            let whole = if whole == 0 { 0xffff } else { whole };
            // What the sender leaves: the pseudo-header's sum, folded.
            put16(&mut f, l4 + offset, checksum::fold(pseudo));
            let start = l4 + if tagged { 4 } else { 0 };
            if tagged {
                f.splice(12..12, [0x81, 0x00, 0x00, 0x64]);
            }
            finish_checksum(&mut f, start, offset);
            prop_assert_eq!(be16(&f, start + offset), whole);
        }
    }
}
