//! Connection tracking: one entry per connection, keyed by zone and 5-tuple, found from
//! either direction; a TCP state machine after Linux nf_conntrack's; UDP and ICMP
//! pseudo-states; ICMP errors matched to the connection they quote.
//!
//! The table is a fixed array of slots, sized once from the configured capacity, with
//! linear probing and backward-shift deletion: it never grows; when it holds `capacity`
//! connections, a new one takes the place of an unconfirmed one near its home (Linux's
//! early drop), else it is refused, either counted. Beside the slots, a byte per
//! slot holds a fragment of its key's hash (0: empty), so a probe scans a few bytes of one
//! cache line and compares whole keys only on a fragment match. Slots are found through
//! a hash keyed with random keys per table, so nobody can aim collisions at a bucket. Expiry is
//! lazy (an expired entry found on a probe is removed then) plus a bounded sweep of a few
//! slots per batch, so no packet ever pays for a scan of the table.
//!
//! Multi-core: each worker owns its table; packets are steered to workers by a symmetric
//! flow hash, so both directions of a connection meet in the same table without locks.
//!
//! With IPFIX export on, connections are the flow records of the packets they count: an
//! entry keeps per direction the packets, bytes, TCP flags and ports since its last report,
//! the sweep reports connections past the active timeout, and a removed connection reports
//! its last counts (into a bounded buffer the worker drains). A packet counts here only when
//! it was looked up as it arrived and did not arrive tunnelled, so the records describe the
//! packets as they arrived, like the flow cache's, and no packet is in both.
//!
//! With TCP window tracking on, a side array parallel to the slots holds each
//! connection's windows (`tcp_window`), moved with its entry. Invalid packets carry their
//! reason ([`Invalid`]), counted by reason.
//!
//! Here: the table, its entries and records. How a packet's key is found is in `key.rs`,
//! the TCP state machine in `tcp_states.rs`.

use crate::engine::parse::{self, fragment_of, Layers, Meta};
use crate::engine::prefetch::{prefetch, prefetch_span};
use crate::firewall::fragments::Fragments;
use crate::firewall::sctp::{self, Assoc, Associations};
use crate::firewall::tcp_window::{Cap, Segment, Window};
use crate::hash::KeyedHash;
use crate::ir::{CtTimeouts, CT_STATE_NAMES};
use crate::sweep::Pace;
use crate::telemetry::flows::{EndReason, FlowKey, FlowRecord};
use crate::wire::{be16, ip_proto, tcp};
use std::time::Duration;

mod key;
mod tcp_states;

use key::{canonical, query_type_code, quoted_tuple, tuple, Addr, Key, NoTuple, Tuple};
use tcp_states::{is_tcp, tcp_flags_valid, tcp_transition, tcp_transition_new};

/// The `ct.state` of a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CtState {
    New,
    Established,
    Related,
    Invalid,
    /// A packet conntrack leaves alone, as Linux does: IPv6 neighbour discovery and
    /// multicast listener messages (RFC 4861, RFC 3810), which belong to a link, not a
    /// connection.
    Untracked,
}

reasons! {
    /// Why conntrack found a packet invalid: the `reason` of
    /// `dpuflow_conntrack_invalid_packets_total`, and what `dpuflow trace` says.
    pub enum Invalid {
        Headers => "headers", "its IP or transport header could not be read";
        Fragment => "fragment", "a fragment whose datagram's first fragment was not seen, or took no connection";
        IcmpError => "icmp_error", "an ICMP error quoting no tracked connection";
        IcmpReply => "icmp_reply", "an ICMP message that neither asks nor answers a tracked one";
        IcmpType => "icmp_type", "an ICMP message of a type that opens no connection and answers none";
        TcpFlags => "tcp_flags", "a combination of TCP flags no segment may carry";
        TcpState => "tcp_state", "a TCP segment its connection's state does not allow";
        TcpOpen => "tcp_open", "a TCP segment that opens no connection (neither a SYN nor an ACK)";
        TcpHeader => "tcp_header", "a TCP header cut short";
        TcpSeq => "tcp_seq", "a TCP segment starting past what the receiver's window allows";
        TcpAck => "tcp_ack", "a TCP acknowledgement of data never sent";
        TcpRst => "tcp_rst", "a TCP RST before what its peer acknowledged";
        Checksum => "checksum", "a TCP, UDP, UDP-Lite, ICMP, ICMPv6 or SCTP checksum that is wrong (verified with `checksum on`)";
        UdpliteHeader => "udplite_header", "a UDP-Lite header cut short, or whose checksum coverage is shorter than the header or longer than the datagram, or that has no checksum (RFC 3828 §3.1)";
        SctpChunks => "sctp_chunks", "an SCTP packet without chunks, or with one misplaced (INIT, INIT ACK and SHUTDOWN COMPLETE go alone, COOKIE ECHO and COOKIE ACK first) or of length zero";
        SctpVtag => "sctp_vtag", "an SCTP packet whose verification tag is not the one its association expects";
        SctpState => "sctp_state", "an SCTP chunk that opens no association, or that its association's state does not allow";
    }
}

impl CtState {
    /// As `match ct.state` names it.
    pub fn name(self) -> &'static str {
        match self {
            CtState::New => "new",
            CtState::Established => "established",
            CtState::Related => "related",
            CtState::Invalid => "invalid",
            CtState::Untracked => "untracked",
        }
    }

    /// The bit `match ct.state` tests.
    pub fn bit(self) -> u8 {
        CT_STATE_NAMES
            .iter()
            .find(|(n, _)| *n == self.name())
            .map_or(0, |&(_, b)| b as u8)
    }
}

/// TCP connection states (Linux `tcp_conntrack`), plus the pseudo-states of other protocols.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ConnState {
    TcpSynSent,
    TcpSynRecv,
    TcpEstablished,
    TcpFinWait,
    TcpCloseWait,
    TcpLastAck,
    TcpTimeWait,
    TcpClose,
    /// Simultaneous open: a SYN seen from both sides.
    TcpSynSent2,
    Udp,
    Icmp,
    Gre,
    /// Any other IP protocol.
    Other,
    /// SCTP association states (Linux `sctp_conntrack`, see `sctp`), in this order.
    SctpClosed,
    SctpCookieWait,
    SctpCookieEchoed,
    SctpEstablished,
    SctpShutdownSent,
    SctpShutdownRecd,
    SctpShutdownAckSent,
    SctpHeartbeatSent,
}

fn is_sctp(s: ConnState) -> bool {
    (ConnState::SctpClosed as u8..=ConnState::SctpHeartbeatSent as u8).contains(&(s as u8))
}

/// One connection: 96 bytes. Arrays are per direction, original then reply; the counts
/// are those not yet reported (kept only while exporting).
#[derive(Debug, Clone, Copy)]
struct Entry {
    key: Key,
    state: ConnState,
    /// [`ORIG_FROM_A`], [`SEEN_REPLY`], `DENIED << direction` and, in the top three
    /// bits, the packets seen counted in unary up to three (UDP timeouts depend on it).
    flags: u8,
    /// TCP: the flags each direction carried since the last report. SCTP: where the
    /// association is in [`Conntrack::sctp`] (see [`Entry::association`]).
    l4: [u8; 2],
    /// Port indices, [`NO_PORT`] when unknown.
    in_port: [u8; 2],
    out_port: [u8; 2],
    /// When the connection, or the interval since its last report, began.
    first_ns: u64,
    last_ns: u64,
    packets: [u64; 2],
    bytes: [u64; 2],
}

/// The connection's first packet went from endpoint `a` to `b`.
const ORIG_FROM_A: u8 = 1;
const SEEN_REPLY: u8 = 2;
/// Shifted left by the direction: the pipeline dropped a counted packet.
const DENIED: u8 = 4;
/// TCP windows tracked, and the last segment called for a shorter timeout (its window's
/// [`Window::capped`] says which).
const CAPPED: u8 = 0x10;
/// A first, second and third packet seen.
const SEEN_1: u8 = 0x20;
const SEEN_2: u8 = 0x40;
const SEEN_3: u8 = 0x80;
/// A UDP connection that saw a reply and more than two packets is a stream.
const UDP_STREAM: u8 = SEEN_REPLY | SEEN_3;
const NO_PORT: u8 = u8::MAX;

const EMPTY: Entry = Entry {
    key: Key::ZERO,
    state: ConnState::Other,
    flags: 0,
    l4: [0; 2],
    in_port: [NO_PORT; 2],
    out_port: [NO_PORT; 2],
    first_ns: 0,
    last_ns: 0,
    packets: [0; 2],
    bytes: [0; 2],
};

impl Entry {
    /// Notes one more packet seen (and whether it was a reply).
    fn seen(&mut self, reply: bool) {
        let f = self.flags;
        self.flags = f | SEEN_1 | (f & (SEEN_1 | SEEN_2)) << 1 | (u8::from(reply) * SEEN_REPLY);
    }

    fn seen_reply(&self) -> bool {
        self.flags & SEEN_REPLY != 0
    }

    fn orig_from_a(&self) -> bool {
        self.flags & ORIG_FROM_A != 0
    }

    /// Counts a packet into direction `dir` at `now` for the flow records; the first of an
    /// interval starts it (flowStartMilliseconds is the first packet's time, RFC 7012).
    fn count(&mut self, dir: usize, bytes: u64, tcp_flags: u8, in_port: u8, now: u64) {
        if self.packets[0] | self.packets[1] == 0 {
            self.first_ns = now;
        }
        self.packets[dir] += 1;
        self.bytes[dir] += bytes;
        self.l4[dir] |= tcp_flags;
        self.in_port[dir] = in_port;
    }

    /// Where an SCTP connection's association is in the table's [`Associations`].
    fn association(&self) -> u16 {
        u16::from_ne_bytes(self.l4)
    }

    /// The TCP flags direction `dir` carried since the last report (none for another
    /// protocol).
    fn tcp_flags(&self, dir: usize) -> u8 {
        if is_sctp(self.state) {
            0
        } else {
            self.l4[dir]
        }
    }

    /// The flow record of direction `dir` (0 original, 1 reply).
    fn record(&self, dir: usize, reason: EndReason) -> FlowRecord {
        let (v6, proto) = self.key.family_and_protocol();
        let [a, b] = self.key.endpoints();
        let (src, dst) = if self.orig_from_a() == (dir == 0) {
            (a, b)
        } else {
            (b, a)
        };
        // An ICMP query's record takes the type its direction sends (only a request opens
        // a connection) and the code, where the destination port goes.
        let dst = if ip_proto::is_icmp(proto) {
            (dst.0, query_type_code(v6, b.1, dir == 0))
        } else {
            dst
        };
        FlowRecord {
            key: flow_key(u16::from(self.in_port[dir]), v6, src, dst, proto),
            first_ns: self.first_ns,
            last_ns: self.last_ns,
            packets: self.packets[dir],
            bytes: self.bytes[dir],
            tcp_flags: self.tcp_flags(dir),
            out_port: (self.out_port[dir] != NO_PORT).then_some(u16::from(self.out_port[dir])),
            denied: self.flags & DENIED << dir != 0,
            reason,
            sampled: false,
        }
    }

    /// A record for each direction that counted packets.
    fn records(&self, reason: EndReason) -> impl Iterator<Item = FlowRecord> + '_ {
        (0..2)
            .filter(|&d| self.packets[d] > 0)
            .map(move |d| self.record(d, reason))
    }

    /// Starts a new reporting interval at `now`.
    fn reported(&mut self, now: u64) {
        self.first_ns = now;
        self.packets = [0; 2];
        self.bytes = [0; 2];
        if !is_sctp(self.state) {
            self.l4 = [0; 2];
        }
        self.flags &= !(DENIED | DENIED << 1);
    }
}

/// A flow key as the flow cache keys a packet that arrived untunnelled: ports only for
/// protocols that have them (ICMP's identifier is no port), and for ICMP the type and code
/// given as `dst`'s port (see [`FlowKey::dport`]).
fn flow_key(in_port: u16, v6: bool, src: (Addr, u16), dst: (Addr, u16), proto: u8) -> FlowKey {
    let wide = |a: Addr| u128::from(a[0]) << 64 | u128::from(a[1]);
    let ports = ip_proto::has_ports(proto);
    FlowKey {
        in_port,
        v6,
        src: wide(src.0),
        dst: wide(dst.0),
        proto,
        sport: if ports { src.1 } else { 0 },
        dport: if ports || ip_proto::is_icmp(proto) {
            dst.1
        } else {
            0
        },
        vni: None,
    }
}

/// Why a connection's last record ends it: a TCP connection closed by FIN or RST ended
/// (RFC 5102 "end of flow detected"), as did an SCTP association closed by SHUTDOWN
/// COMPLETE or ABORT (closed once answered: an unanswered INIT leaves `SctpClosed` too);
/// anything else went idle.
fn end_reason(e: &Entry) -> EndReason {
    match e.state {
        ConnState::TcpTimeWait | ConnState::TcpClose => EndReason::EndOfFlow,
        ConnState::SctpClosed if e.seen_reply() => EndReason::EndOfFlow,
        _ => EndReason::Idle,
    }
}

/// Where connection records wait for the worker, bounded so a burst of removals allocates
/// nothing: past `RECORDS_KEPT`, records are counted and lost.
#[derive(Debug)]
struct Export {
    active_ns: u64,
    records: Vec<FlowRecord>,
    made: u64,
    dropped: u64,
}

/// The configured timeouts in nanoseconds, as lookups compare them.
#[derive(Debug)]
struct Timeouts {
    /// By [`ConnState`] and whether the connection saw a reply and a third packet
    /// ([`Timeouts::of`]): one load a lookup.
    by_state: [[u64; 4]; 21],
    unacknowledged: u64,
    max_retrans: u64,
}

impl Timeouts {
    fn new(t: &CtTimeouts) -> Timeouts {
        use ConnState::*;
        let (unacknowledged, stream) = (ns(t.tcp_unacknowledged), ns(t.udp_stream));
        let mut by_state = [[0; 4]; 21];
        for (state, d) in [
            (TcpSynSent, t.tcp_syn_sent),
            (TcpSynRecv, t.tcp_syn_recv),
            (TcpEstablished, t.tcp_established),
            (TcpFinWait, t.tcp_fin_wait),
            (TcpCloseWait, t.tcp_close_wait),
            (TcpLastAck, t.tcp_last_ack),
            (TcpTimeWait, t.tcp_time_wait),
            (TcpClose, t.tcp_close),
            (TcpSynSent2, t.tcp_syn_sent),
            (Udp, t.udp),
            (Icmp, t.icmp),
            (Gre, t.gre),
            (Other, t.generic),
            (SctpClosed, t.sctp_closed),
            (SctpCookieWait, t.sctp_cookie_wait),
            (SctpCookieEchoed, t.sctp_cookie_echoed),
            (SctpEstablished, t.sctp_established),
            (SctpShutdownSent, t.sctp_shutdown_sent),
            (SctpShutdownRecd, t.sctp_shutdown_recd),
            (SctpShutdownAckSent, t.sctp_shutdown_ack_sent),
            (SctpHeartbeatSent, t.sctp_heartbeat_sent),
        ] {
            by_state[state as usize] = [ns(d); 4];
        }
        // A UDP flow with a reply and a third packet is a stream; a TCP connection picked up
        // mid-stream and never answered waits at most `tcp_unacknowledged` (as in Linux).
        by_state[Udp as usize][3] = stream;
        // GRE likewise: Linux extends its timeout for packets that come once a reply was
        // seen, so not for the reply itself.
        by_state[Gre as usize][3] = ns(t.gre_stream);
        let established = &mut by_state[TcpEstablished as usize];
        for unanswered in [0, 2] {
            established[unanswered] = established[unanswered].min(unacknowledged);
        }
        Timeouts {
            by_state,
            unacknowledged,
            max_retrans: ns(t.tcp_max_retrans),
        }
    }

    /// The timeout of connection `e` by its state and what it saw.
    #[inline]
    fn of(&self, e: &Entry) -> u64 {
        let seen = usize::from(e.flags & SEEN_REPLY != 0) | usize::from(e.flags & SEEN_3 != 0) << 1;
        self.by_state[e.state as usize][seen]
    }
}

/// Records a connection table keeps for the worker to drain.
pub const RECORDS_KEPT: usize = 16_384;

/// A connection the lookup found to be new, to be created if the pipeline commits it.
#[derive(Debug, Clone, Copy)]
pub struct Pending {
    key: Key,
    hash: u64,
    orig_from_a: bool,
    state: ConnState,
    bytes: u64,
    tcp_flags: u8,
    /// The ingress port index, when the packet counts for the flow records.
    report: Option<u8>,
    /// The opening TCP segment, when windows are tracked.
    segment: Option<Segment>,
    /// An SCTP connection's association.
    assoc: Assoc,
}

/// What a lookup decided for one packet.
#[derive(Debug, Clone, Copy)]
pub struct Lookup {
    pub state: CtState,
    pub pending: Option<Pending>,
    /// Why the packet is invalid, when it is.
    pub invalid: Option<Invalid>,
}

/// Counters for telemetry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CtStats {
    pub entries: u64,
    pub inserts: u64,
    pub expirations: u64,
    /// New connections refused because the table was full.
    pub drops_full: u64,
    /// Unconfirmed connections removed from a full table to make room for new ones.
    pub early_drops: u64,
    /// Invalid packets by [`Invalid`].
    pub invalid: [u64; Invalid::COUNT],
}

/// One worker's connection table.
#[derive(Debug)]
pub struct Conntrack {
    slots: Box<[Entry]>,
    /// Per slot: 0 when empty, else a fragment of the key's hash with the top bit set.
    tags: Box<[u8]>,
    capacity: usize,
    timeouts: Timeouts,
    seed: KeyedHash,
    sweep_at: usize,
    pace: Pace,
    pub stats: CtStats,
    /// Set while connections are the source of flow records.
    export: Option<Export>,
    /// The slot and direction that counted the current packet, for [`Conntrack::note_fate`].
    counted: Option<(usize, usize)>,
    /// An entry was removed (others may have moved) since `counted` was set.
    moved: bool,
    /// The ports and [`Tuple::kind`] (protocol, family, ICMP query) of datagrams whose
    /// first fragment passed, for their other fragments.
    fragments: Fragments<(u16, u16, u64, u16)>,
    /// Each slot's TCP windows, when they are tracked.
    windows: Option<Box<[Window]>>,
    /// The SCTP connections' associations (their verification tags).
    sctp: Associations,
    /// A plain ACK may open a TCP connection (loose pick-up).
    loose: bool,
    /// Transport checksums are verified.
    checksums: bool,
}

/// What [`Conntrack`] reports of its flow records.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RecordStats {
    pub made: u64,
    /// Lost because the worker had not drained the buffer.
    pub dropped: u64,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Conntrack {
    /// Slots of a table for `capacity` connections: at most 4/5 full (probes scan tag
    /// bytes, so they stay cheap); not rounded to a power of two, so memory per connection
    /// is 5/4 of an entry and its tag.
    fn slots_for(capacity: usize) -> usize {
        (capacity * 5 / 4).max(capacity + 1).max(16)
    }

    /// Bytes the table for `capacity` connections takes (all allocated and written when
    /// it is made).
    pub fn table_bytes(capacity: usize, windows: bool) -> u64 {
        let window = if windows { Self::WINDOW_BYTES } else { 0 };
        let slot = size_of::<Entry>() + 1 + window;
        (Self::slots_for(capacity.max(1)) * slot + Associations::bytes(capacity.max(1))) as u64
    }

    pub fn new(capacity: usize, timeouts: CtTimeouts) -> Conntrack {
        let capacity = capacity.max(1);
        let slots = Self::slots_for(capacity);
        let table = crate::sys::huge_table(slots, EMPTY);
        Conntrack {
            slots: table.into_boxed_slice(),
            tags: vec![0; slots].into_boxed_slice(),
            capacity,
            timeouts: Timeouts::new(&timeouts),
            seed: KeyedHash::new(),
            sweep_at: 0,
            pace: Pace::default(),
            stats: CtStats::default(),
            export: None,
            counted: None,
            moved: false,
            fragments: Fragments::default(),
            windows: None,
            sctp: Associations::new(capacity),
            loose: true,
            checksums: false,
        }
    }

    /// Takes a reloaded pipeline's timeouts and TCP pick-up rule: each connection's next
    /// packet, or the sweep, judges it by them. (Capacity and window tracking shape the
    /// table; a pipeline that changes them needs a restart.)
    pub fn retune(&mut self, c: &crate::ir::Conntrack) {
        self.timeouts = Timeouts::new(&c.timeouts);
        self.loose = c.tcp_loose;
        self.checksums = c.checksum;
    }

    /// Verifies transport checksums from now on (Linux `nf_conntrack_checksum=1`): a
    /// packet whose checksum is wrong is `invalid`.
    pub fn verify_checksums(&mut self) {
        self.checksums = true;
    }

    /// Only a SYN opens a TCP connection from now on: no pick-up mid-stream (Linux
    /// `nf_conntrack_tcp_loose=0`). A segment that opens nothing is `invalid`.
    pub fn open_by_syn_only(&mut self) {
        self.loose = false;
    }

    /// Checks TCP segments against their connection's windows from now on (see
    /// `tcp_window`), for connections opened from now on; the windows take
    /// [`Conntrack::WINDOW_BYTES`] a slot more.
    pub fn track_windows(&mut self) {
        let windows = crate::sys::huge_table(self.slots.len(), Window::default());
        self.windows = Some(windows.into_boxed_slice());
    }

    /// Bytes a slot's TCP windows take when tracked.
    pub const WINDOW_BYTES: usize = size_of::<Window>();

    /// Makes connections the source of flow records for the packets they count, with
    /// records at least every `active_ns` for a connection that stays busy.
    pub fn enable_export(&mut self, active_ns: u64) {
        self.export = Some(Export {
            active_ns,
            records: Vec::with_capacity(RECORDS_KEPT),
            made: 0,
            dropped: 0,
        });
    }

    /// Records waiting for [`Conntrack::take_records`].
    pub fn records_waiting(&self) -> usize {
        self.export.as_ref().map_or(0, |x| x.records.len())
    }

    pub fn record_stats(&self) -> Option<RecordStats> {
        self.export.as_ref().map(|x| RecordStats {
            made: x.made,
            dropped: x.dropped,
        })
    }

    /// Moves the records made so far to `out`.
    pub fn take_records(&mut self, out: &mut Vec<FlowRecord>) {
        if let Some(x) = &mut self.export {
            out.append(&mut x.records);
        }
    }

    /// Reports every connection's counts now (forced end, at shutdown) into `out`.
    pub fn report_all(&mut self, now: u64, out: &mut Vec<FlowRecord>) {
        let Some(x) = &mut self.export else { return };
        for (e, _) in self
            .slots
            .iter_mut()
            .zip(self.tags.iter())
            .filter(|(_, t)| **t != 0)
        {
            let before = out.len();
            out.extend(e.records(EndReason::Forced));
            x.made += (out.len() - before) as u64;
            e.reported(now);
        }
    }

    /// Queues the records of an entry's counts (one per direction that has any).
    fn report(&mut self, e: &Entry, reason: EndReason) {
        let Some(x) = &mut self.export else { return };
        for r in e.records(reason) {
            if x.records.len() < RECORDS_KEPT {
                x.records.push(r);
                x.made += 1;
            } else {
                x.dropped += 1;
            }
        }
    }

    /// Counts the current packet into direction `dir` of the connection in `slot`, for the
    /// flow records, and notes that it did for [`Conntrack::note_fate`].
    fn count_in(&mut self, slot: usize, dir: usize, packet: (u64, u8, u8), now: u64) {
        let (bytes, tcp_flags, in_port) = packet;
        self.slots[slot].count(dir, bytes, tcp_flags, in_port, now);
        self.counted = Some((slot, dir));
        self.moved = false;
    }

    /// Once the packet's walk has ended: notes its fate — the port it went out of, or
    /// that it was dropped, from `fate` — in the connection direction that counted it for
    /// the flow records. False when no connection counted it (the packet then needs a
    /// record of its own).
    #[inline]
    pub fn note_fate(&mut self, fate: impl FnOnce() -> (Option<u16>, bool)) -> bool {
        let Some((slot, dir)) = self.counted.take() else {
            return false;
        };
        // A removal during the packet's walk may have shifted the entry: the fate of this
        // one packet goes unnoted.
        if let Some(e) = self.slots.get_mut(slot).filter(|_| !self.moved) {
            let (out_port, denied) = fate();
            if denied {
                e.flags |= DENIED << dir;
            }
            if let Some(p) = out_port {
                e.out_port[dir] = u8::try_from(p).unwrap_or(NO_PORT);
            }
        }
        true
    }

    pub fn len(&self) -> usize {
        self.stats.entries as usize
    }

    pub fn is_empty(&self) -> bool {
        self.stats.entries == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes of table memory (fixed at creation).
    pub fn memory_bytes(&self) -> usize {
        size_of_val(&*self.slots)
            + size_of_val(&*self.tags)
            + self.windows.as_ref().map_or(0, |w| size_of_val(&**w))
            + self.sctp.memory_bytes()
    }

    fn hash(&self, k: &Key) -> u64 {
        self.seed.hash(k.words())
    }

    /// The home slot of a hash: mapped onto the table by multiply-shift.
    fn home_of(&self, h: u64) -> usize {
        ((u128::from(h) * self.slots.len() as u128) >> 64) as usize
    }

    fn tag_of(h: u64) -> u8 {
        // The low bits (the home slot uses the high ones), never zero.
        (h as u8) | 0x80
    }

    fn next(&self, i: usize) -> usize {
        if i + 1 == self.slots.len() {
            0
        } else {
            i + 1
        }
    }

    /// The idle timeout of the connection in slot `i`. As in Linux, a TCP connection picked
    /// up mid-stream and never answered waits at most `tcp_unacknowledged`, so a stray ACK
    /// does not hold an entry for days; with window tracking, so does one with
    /// unacknowledged data, and the other caps of [`Cap`] apply.
    fn timeout(&self, i: usize) -> u64 {
        let e = &self.slots[i];
        let d = self.timeouts.of(e);
        if e.flags & CAPPED != 0 {
            self.capped_timeout(i, d)
        } else {
            d
        }
    }

    /// `d` capped as the window of the connection in slot `i` says.
    #[cold]
    fn capped_timeout(&self, i: usize, d: u64) -> u64 {
        let t = &self.timeouts;
        match self.windows.as_ref().and_then(|w| w[i].capped()) {
            Some(Cap::Unacknowledged) => d.min(t.unacknowledged),
            Some(Cap::Retransmitting) => d.min(t.max_retrans),
            Some(Cap::Reset) => d.min(t.by_state[ConnState::TcpClose as usize][0]),
            None => d,
        }
    }

    fn expired(&self, i: usize, now: u64) -> bool {
        now > self.slots[i].last_ns.saturating_add(self.timeout(i))
    }

    /// Finds the slot of `key` (whose hash is `h`), removing expired entries met on the
    /// way; `Err` is the empty slot where it would go.
    fn find(&mut self, key: &Key, h: u64, now: u64) -> Result<usize, usize> {
        let tag = Self::tag_of(h);
        let mut i = self.home_of(h);
        loop {
            let t = self.tags[i];
            if t == 0 {
                return Err(i);
            }
            if t == tag && self.slots[i].key == *key {
                if self.expired(i, now) {
                    self.remove(i);
                    self.stats.expirations += 1;
                    // The slot now holds whatever shifted back into it; look again.
                    continue;
                }
                return Ok(i);
            }
            i = self.next(i);
        }
    }

    /// Backward-shift deletion (linear probing stays valid without tombstones).
    fn remove(&mut self, hole: usize) {
        let reason = end_reason(&self.slots[hole]);
        self.remove_for(hole, reason);
    }

    /// [`Conntrack::remove`], its last records ending for `reason`.
    fn remove_for(&mut self, mut hole: usize, reason: EndReason) {
        self.discard(hole, reason);
        self.slots[hole] = EMPTY;
        self.tags[hole] = 0;
        self.stats.entries -= 1;
        let n = self.slots.len();
        let mut i = self.next(hole);
        while self.tags[i] != 0 {
            let home = self.home_of(self.hash(&self.slots[i].key));
            // Move the entry back if its home is not in the cyclic range (hole, i].
            let dist_i = (i + n - home) % n;
            let dist_hole = (hole + n - home) % n;
            if dist_hole < dist_i {
                self.slots[hole] = self.slots[i];
                self.tags[hole] = self.tags[i];
                if let Some(w) = &mut self.windows {
                    w[hole] = w[i];
                }
                self.slots[i] = EMPTY;
                self.tags[i] = 0;
                hole = i;
            }
            i = self.next(i);
        }
    }

    /// Examines `slots` slots, removes the idle connections among them and, when
    /// exporting, reports those past the active timeout.
    pub fn sweep(&mut self, now: u64, slots: usize) {
        let active_ns = self.export.as_ref().map(|x| x.active_ns);
        for _ in 0..slots {
            let i = self.sweep_at;
            self.sweep_at = self.next(i);
            if self.tags[i] == 0 {
                continue;
            }
            let e = &self.slots[i];
            if self.expired(i, now) {
                self.remove(i);
                self.stats.expirations += 1;
            } else if active_ns.is_some_and(|a| now.saturating_sub(e.first_ns) >= a)
                && e.packets != [0; 2]
            {
                let e = *e;
                self.report(&e, EndReason::Active);
                self.slots[i].reported(now);
            }
        }
    }

    /// Sweeps the slots due by `now`: the whole table once a second of packet time, spread
    /// over the batches, at most `most` slots a call (1024 after a batch). Lookups already remove the expired
    /// entries they meet; the sweep reclaims those nobody asks for again, and timeouts of ten
    /// seconds and more make a second's delay immaterial. Paced by time rather than by
    /// packets, it costs a packet less the faster packets come (at 8 Mpps, five slots a
    /// batch of 32 for a 1M-connection table, not 32).
    pub fn sweep_due(&mut self, now: u64, most: usize) {
        let due = self.pace.due(now, self.slots.len(), most);
        if due > 0 {
            self.sweep(now, due);
        }
    }

    /// Prefetches the tags where the packet's connection would start its probe, so that
    /// [`Conntrack::prefetch_slot`] and then [`Conntrack::lookup`] find them in cache, and
    /// returns the hash for it. Batches call this for every packet first: the misses then
    /// overlap.
    /// `in_port` is where the packet arrived at `now`: when exporting, the connection that
    /// counts the packet notes it. A fragment's datagram is resolved here, in the order the
    /// packets came: a first fragment notes its ports, a later one takes them (`None` when
    /// its first has not come; see `Fragments`). The probe is written into `hint` where
    /// it is kept (a probe returned by value was copied there, 128 bytes a packet).
    pub fn prefetch(
        &mut self,
        frame: &[u8],
        meta: &Meta,
        in_port: u16,
        now: u64,
        hint: &mut Option<Probe>,
    ) {
        let Ok(mut t) = tuple(frame, &meta.outer) else {
            *hint = None;
            return;
        };
        if t.fragment.is_some() {
            match self.fragment(&t, frame, &meta.outer, now) {
                Some(whole) => t = whole,
                None => {
                    *hint = None;
                    return;
                }
            }
        }
        let (key, from_a) = canonical(&t, 0);
        let hash = self.hash(&key);
        prefetch(&self.tags[self.home_of(hash)]);
        let report = if self.export.is_some() && meta.tunnel.is_none() {
            u8::try_from(in_port).ok().filter(|&p| p != NO_PORT)
        } else {
            None
        };
        *hint = Some(Probe {
            t,
            key,
            from_a,
            hash,
            report,
        });
    }

    /// A fragment's tuple: a first notes its ports and protocol for the others, which take
    /// them (`None` when their first has not come). Out of line: fragments are rare.
    #[cold]
    #[inline(never)]
    fn fragment(&mut self, t: &Tuple, frame: &[u8], l: &Layers, now: u64) -> Option<Tuple> {
        let (datagram, first) = fragment_of(frame, l)?;
        if first {
            let transport = (t.sport, t.dport, t.kind, t.icmp_type_code);
            self.fragments.note(datagram, transport, now);
            return Some(*t);
        }
        let (sport, dport, kind, icmp_type_code) = self.fragments.first(&datagram, now)?;
        Some(Tuple {
            sport,
            dport,
            proto: (kind >> 16) as u8,
            kind,
            icmp_type_code,
            ..*t
        })
    }

    /// The second step, once the tags have arrived: prefetches the slot whose tag matches
    /// the probe's or, for a new connection, the empty slot it would take. At 4/5 full an
    /// entry sits a few slots past its home, often in another cache line than the home
    /// slot, so the tags say which slot to load.
    pub fn prefetch_slot(&self, probe: &Probe) {
        let tag = Self::tag_of(probe.hash);
        let mut i = self.home_of(probe.hash);
        // A probe run is short at this load; a long one is left to the lookup.
        for _ in 0..16 {
            let t = self.tags[i];
            if t == 0 || t == tag {
                // An entry (96 bytes) spans two cache lines.
                prefetch_span(&self.slots[i]);
                if let Some(w) = &self.windows {
                    prefetch_span(&w[i]);
                }
                return;
            }
            i = self.next(i);
        }
    }

    /// Looks the packet up, advancing an existing connection's state, and says what the
    /// packet is; a new connection is only described (`pending`), for [`Conntrack::commit`].
    /// `probe` is what [`Conntrack::prefetch`] computed for this packet (zone 0), so the
    /// tuple and hash are not computed twice; given only while the packet's tuple is as it
    /// arrived, it also tells whether the packet counts for the flow records.
    pub fn lookup(
        &mut self,
        frame: &[u8],
        meta: &Meta,
        zone: u16,
        now: u64,
        probe: Option<&Probe>,
    ) -> Lookup {
        let l = &meta.outer;
        if self.checksums && !checksum_ok(frame, l) {
            return self.invalid(Invalid::Checksum);
        }
        // Borrowed from the probe, not copied out of it.
        let computed;
        let t = match probe {
            Some(p) => &p.t,
            None => match tuple(frame, l) {
                Ok(t) => {
                    computed = t;
                    &computed
                }
                Err(NoTuple::Invalid(why)) => return self.invalid(why),
                Err(NoTuple::Untracked) => {
                    return Lookup {
                        state: CtState::Untracked,
                        pending: None,
                        invalid: None,
                    }
                }
            },
        };
        // A fragment: the first notes its datagram's ports and protocol, the others take
        // them (and, with no L4 header of their own, never change a connection's state).
        // A probe's tuple was resolved when it was taken.
        let resolved;
        let (t, later_fragment) = match t.fragment {
            None => (t, false),
            Some(first) if probe.is_some() => (t, !first),
            Some(_) => match self.fragment(t, frame, l, now) {
                Some(r) => {
                    resolved = r;
                    (&resolved, resolved.fragment == Some(false))
                }
                None => return self.invalid(Invalid::Fragment),
            },
        };
        if let Some(quoted) = t.icmp_error {
            // Related if the quoted packet belongs to a tracked connection.
            let Some(q) = quoted_tuple(frame, l, usize::from(quoted)) else {
                return self.invalid(Invalid::IcmpError);
            };
            let (key, _) = canonical(&q, zone);
            let h = self.hash(&key);
            return match self.find(&key, h, now) {
                Ok(i) => {
                    let e = &mut self.slots[i];
                    e.last_ns = now;
                    Lookup {
                        state: CtState::Related,
                        pending: None,
                        invalid: None,
                    }
                }
                Err(_) => self.invalid(Invalid::IcmpError),
            };
        }
        let (key, from_a, h) = match probe {
            Some(p) if zone == 0 => (p.key, p.from_a, p.hash),
            _ => {
                let (key, from_a) = canonical(t, zone);
                (key, from_a, self.hash(&key))
            }
        };
        let len = u64::from(l.l3_end) - u64::from(l.l3);
        // A packet counts in one connection at most (a second zone's lookup does not).
        let report = probe
            .and_then(|p| p.report)
            .filter(|_| self.counted.is_none());
        match self.find(&key, h, now) {
            Ok(i) => {
                // Two fields read, not the 96-byte entry copied.
                let (state, flags) = (self.slots[i].state, self.slots[i].flags);
                let reply = from_a != (flags & ORIG_FROM_A != 0);
                let dir = usize::from(reply);
                let next = match state {
                    _ if later_fragment => Step::Ignore,
                    s if is_tcp(s) && !tcp_flags_valid(t.tcp_flags) => {
                        Step::Invalid(Invalid::TcpFlags)
                    }
                    // A first fragment's segment length is not known before its datagram
                    // is whole (Linux reassembles first), so it is judged by flags and
                    // state only, unless it is a RST: a RST's checks hang on its sequence
                    // number, and an off-path RST must not close a connection by coming
                    // in fragments.
                    s if is_tcp(s)
                        && self.windows.is_some()
                        && (t.fragment.is_none() || t.tcp_flags & tcp::flags::RST != 0) =>
                    {
                        let step = tcp_transition(s, t.tcp_flags, reply);
                        self.judge_window(i, frame, l, (s, step), dir)
                    }
                    s if is_tcp(s) => tcp_transition(s, t.tcp_flags, reply),
                    s if is_sctp(s) => self.sctp_step(i, frame, l, dir),
                    s => Step::To(s),
                };
                match next {
                    Step::Invalid(why) => self.invalid(why),
                    Step::Reopen => {
                        // A new SYN on a closed connection starts it afresh (as Linux does).
                        self.remove(i);
                        Lookup {
                            state: CtState::New,
                            pending: Some(Pending {
                                key,
                                hash: h,
                                orig_from_a: from_a,
                                state: ConnState::TcpSynSent,
                                bytes: len,
                                tcp_flags: t.tcp_flags,
                                report,
                                segment: self.opening_segment(frame, l),
                                assoc: Assoc::default(),
                            }),
                            invalid: None,
                        }
                    }
                    Step::To(s) => {
                        let e = &mut self.slots[i];
                        e.state = s;
                        e.last_ns = now;
                        e.seen(reply);
                        let seen_reply = e.seen_reply();
                        if let Some(port) = report {
                            self.count_in(i, dir, (len, t.tcp_flags, port), now);
                        }
                        Lookup {
                            state: if seen_reply {
                                CtState::Established
                            } else {
                                CtState::New
                            },
                            pending: None,
                            invalid: None,
                        }
                    }
                    Step::Ignore => {
                        // Passes as part of the connection without changing its state or
                        // timer; a reply still shows the connection answered (as Linux
                        // sets SEEN_REPLY for every reply it lets pass).
                        if reply {
                            self.slots[i].flags |= SEEN_REPLY;
                        }
                        if let Some(port) = report {
                            self.count_in(i, dir, (len, t.tcp_flags, port), now);
                        }
                        Lookup {
                            state: if reply || flags & SEEN_REPLY != 0 {
                                CtState::Established
                            } else {
                                CtState::New
                            },
                            pending: None,
                            invalid: None,
                        }
                    }
                }
            }
            Err(_) => {
                if later_fragment {
                    // Its first fragment passed, but no connection took it.
                    return self.invalid(Invalid::Fragment);
                }
                let mut segment = None;
                let mut assoc = Assoc::default();
                let first = match t.proto {
                    // A first fragment opens its connection's windows too: its header is
                    // whole (see `first_fragment`).
                    ip_proto::TCP if self.windows.is_some() => {
                        let opening = tcp_flags_valid(t.tcp_flags)
                            .then(|| tcp_transition_new(t.tcp_flags, self.loose))
                            .flatten();
                        let Some(s) = opening else {
                            return self.invalid(Invalid::TcpOpen);
                        };
                        let Some(seg) = self.opening_segment(frame, l) else {
                            return self.invalid(Invalid::TcpHeader);
                        };
                        segment = Some(seg);
                        s
                    }
                    ip_proto::TCP => match tcp_flags_valid(t.tcp_flags)
                        .then(|| tcp_transition_new(t.tcp_flags, self.loose))
                        .flatten()
                    {
                        Some(s) => s,
                        None => return self.invalid(Invalid::TcpOpen),
                    },
                    // UDP-Lite takes UDP's states and timeouts, as in Linux.
                    ip_proto::UDP | ip_proto::UDPLITE => ConnState::Udp,
                    ip_proto::GRE => ConnState::Gre,
                    ip_proto::SCTP => match sctp::open(transport(frame, l)) {
                        Ok((a, s)) => {
                            assoc = a;
                            s
                        }
                        Err(why) => return self.invalid(why),
                    },
                    ip_proto::ICMP | ip_proto::ICMPV6 => {
                        if !t.icmp_request {
                            return self.invalid(Invalid::IcmpReply);
                        }
                        ConnState::Icmp
                    }
                    _ => ConnState::Other,
                };
                Lookup {
                    state: CtState::New,
                    pending: Some(Pending {
                        key,
                        hash: h,
                        orig_from_a: from_a,
                        state: first,
                        bytes: len,
                        tcp_flags: t.tcp_flags,
                        report,
                        segment,
                        assoc,
                    }),
                    invalid: None,
                }
            }
        }
    }

    /// The step a TCP segment takes in the connection in `slot` once its windows are
    /// judged: `state` and the step the state table gives (out of line, so lookups without
    /// window tracking keep their registers).
    #[inline(never)]
    fn judge_window(
        &mut self,
        slot: usize,
        frame: &[u8],
        l: &Layers,
        (state, step): (ConnState, Step),
        dir: usize,
    ) -> Step {
        let seen_reply = self.slots[slot].seen_reply();
        let (Some(w), Some(seg)) = (
            &mut self.windows,
            Segment::read(frame, usize::from(l.l4), usize::from(l.l3_end)),
        ) else {
            return Step::Invalid(Invalid::TcpHeader);
        };
        let w = &mut w[slot];
        let step = w.judge(state, step, dir, &seg, seen_reply);
        if let Step::To(_) = step {
            let e = &mut self.slots[slot];
            e.flags = e.flags & !CAPPED | if w.capped().is_some() { CAPPED } else { 0 };
        }
        step
    }

    /// The step an SCTP packet sent in direction `dir` takes in the connection in `slot`:
    /// its chunks move the association's state (set here) and may be refused; one that
    /// passes without restarting the timer (see `sctp::advance`) is an `Ignore`. Out of
    /// line: SCTP is rare beside TCP and UDP.
    #[inline(never)]
    fn sctp_step(&mut self, slot: usize, frame: &[u8], l: &Layers, dir: usize) -> Step {
        let e = &mut self.slots[slot];
        let assoc = self.sctp.get_mut(e.association());
        match sctp::advance(assoc, &mut e.state, dir, transport(frame, l)) {
            Ok(true) => Step::To(e.state),
            Ok(false) => Step::Ignore,
            Err(why) => Step::Invalid(why),
        }
    }

    /// The TCP segment of a packet that opens a connection, when windows are tracked.
    #[inline(never)]
    fn opening_segment(&self, frame: &[u8], l: &Layers) -> Option<Segment> {
        self.windows.as_ref()?;
        Segment::read(frame, usize::from(l.l4), usize::from(l.l3_end))
    }

    /// Makes room in a full table for a connection of `hash` whose probe ends at the empty
    /// slot `empty`, as Linux's early drop does: drops the first connection that is not
    /// confirmed (or has expired) among the [`EARLY_DROP_RANGE`] slots from the home of
    /// `hash`, the slots the new connection's probe scans. Unconfirmed are TCP connections
    /// whose handshake has not completed, that were never answered, or that are closing;
    /// UDP flows that are not yet streams; ICMP exchanges; so a flood of SYNs or of
    /// one-way datagrams cannot lock answered connections out. Where the victim sits
    /// before `empty`, the new connection takes its slot (no probe sequence changes), else
    /// it is removed and the new connection goes where its probe now ends. `None` when
    /// none qualifies.
    #[cold]
    fn drop_early(&mut self, p: &Pending, empty: usize, now: u64) -> Option<usize> {
        let mut i = self.home_of(p.hash);
        let mut before_empty = true;
        for _ in 0..EARLY_DROP_RANGE {
            before_empty &= i != empty;
            if self.tags[i] != 0 {
                let reason = if self.expired(i, now) {
                    self.stats.expirations += 1;
                    end_reason(&self.slots[i])
                } else if !confirmed(&self.slots[i]) {
                    self.stats.early_drops += 1;
                    EndReason::LackOfResources
                } else {
                    i = self.next(i);
                    continue;
                };
                if before_empty {
                    self.discard(i, reason);
                    self.stats.entries -= 1;
                    return Some(i);
                }
                self.remove_for(i, reason);
                return self.find(&p.key, p.hash, now).err();
            }
            i = self.next(i);
        }
        None
    }

    /// What ends with the connection in `slot`, which is about to be overwritten: its last
    /// records, ending for `reason`, and its SCTP association.
    fn discard(&mut self, slot: usize, reason: EndReason) {
        if self.export.is_some() {
            let e = self.slots[slot];
            self.report(&e, reason);
        }
        let e = &self.slots[slot];
        if is_sctp(e.state) {
            self.sctp.release(e.association());
        }
        self.moved = true;
    }

    /// The lookup of a packet found invalid for `why`, counted. Out of line: the lookup's
    /// own paths stay short.
    #[cold]
    #[inline(never)]
    fn invalid(&mut self, why: Invalid) -> Lookup {
        self.stats.invalid[why as usize] += 1;
        Lookup {
            state: CtState::Invalid,
            pending: None,
            invalid: Some(why),
        }
    }

    /// Creates the connection a lookup found new, in a full table in the place of an
    /// unconfirmed one (as Linux's early drop does). False when the table is full of
    /// confirmed connections there (the packet should be dropped and is counted).
    pub fn commit(&mut self, p: &Pending, now: u64) -> bool {
        let slot = match self.find(&p.key, p.hash, now) {
            Ok(_) => return true,
            Err(slot) => slot,
        };
        // An SCTP connection's association first: a full pool refuses it as a full table
        // would, before any connection is dropped to make room.
        let association = if is_sctp(p.state) {
            let Some(i) = self.sctp.keep(p.assoc) else {
                self.stats.drops_full += 1;
                return false;
            };
            Some(i)
        } else {
            None
        };
        let slot = if self.len() < self.capacity {
            slot
        } else if let Some(slot) = self.drop_early(p, slot, now) {
            slot
        } else {
            if let Some(i) = association {
                self.sctp.release(i);
            }
            self.stats.drops_full += 1;
            return false;
        };
        let l4 = association.map_or([0; 2], u16::to_ne_bytes);
        self.tags[slot] = Self::tag_of(p.hash);
        let mut e = Entry {
            key: p.key,
            state: p.state,
            flags: if p.orig_from_a { ORIG_FROM_A } else { 0 },
            l4,
            first_ns: now,
            last_ns: now,
            ..EMPTY
        };
        e.seen(false);
        self.slots[slot] = e;
        if let (Some(w), Some(seg)) = (&mut self.windows, &p.segment) {
            w[slot] = Window::opened(seg, p.state);
            if w[slot].capped().is_some() {
                self.slots[slot].flags |= CAPPED;
            }
        }
        if let Some(port) = p.report.filter(|_| self.counted.is_none()) {
            self.count_in(slot, 0, (p.bytes, p.tcp_flags, port), now);
        }
        self.stats.entries += 1;
        self.stats.inserts += 1;
        true
    }
}

/// Slots a full table scans for a connection to drop early (Linux: 8 entries of its hash
/// chains; a linear probe's neighbours are denser, so twice that).
const EARLY_DROP_RANGE: usize = 16;

/// Whether a connection is worth keeping over a new one (Linux's ASSURED, near enough): a
/// TCP connection established and answered, a UDP stream. Closing TCP connections are
/// not (Linux drops those early too).
fn confirmed(e: &Entry) -> bool {
    match e.state {
        ConnState::TcpEstablished => e.seen_reply(),
        ConnState::Udp => e.flags & UDP_STREAM == UDP_STREAM,
        ConnState::Gre => e.seen_reply(),
        ConnState::SctpEstablished => true,
        _ => false,
    }
}

/// Whether a packet's transport checksum is right, as Linux's conntrack checks it
/// (`nf_conntrack_checksum`): TCP, UDP and ICMPv6 over their pseudo-header (RFC 9293
/// §3.1, RFC 768, RFC 4443 §2.3), ICMP over its message (RFC 792), SCTP's CRC32c (RFC 9260
/// §6.8). A UDP checksum of zero is none, not checked: in IPv4 it means none (RFC 768),
/// and in IPv6, where RFC 8200 §8.1 forbids it, tunnels may use it (RFC 6935) and Linux
/// lets it pass. A
/// fragment's checksum covers its whole datagram, which is never gathered here: not
/// checked, nor is a header cut short (judged elsewhere). Out of line: it reads the whole
/// payload, and is opt-in.
#[inline(never)]
fn checksum_ok(frame: &[u8], l: &Layers) -> bool {
    use crate::wire::{checksum, sctp};
    if l.fragment || !l.l4_ok {
        return true;
    }
    let segment = transport(frame, l);
    let whole = |start: u32| checksum::fold(checksum::sum(start, segment)) == 0xffff;
    match l.proto {
        ip_proto::UDP if segment.get(6..8) == Some(&[0, 0]) => true,
        ip_proto::TCP | ip_proto::UDP | ip_proto::ICMPV6 => {
            parse::pseudo_header(frame, l, l.proto, segment.len()).is_some_and(whole)
        }
        // A header cut short, or a coverage it cannot have, is the tuple's to refuse
        // (`udplite_header_ok`), as Linux judges it before the checksum.
        ip_proto::UDPLITE if !udplite_header_ok(frame, l) => true,
        // RFC 3828 §3.1: over the pseudo-header (of the whole datagram's length) and the
        // first `coverage` bytes, 0 meaning all of them.
        ip_proto::UDPLITE => {
            let covered = match usize::from(be16(segment, 4)) {
                0 => segment,
                c => segment.get(..c).unwrap_or(segment),
            };
            parse::pseudo_header(frame, l, l.proto, segment.len())
                .is_some_and(|start| checksum::fold(checksum::sum(start, covered)) == 0xffff)
        }
        ip_proto::ICMP => whole(0),
        ip_proto::SCTP => sctp::checksum(segment)
            .is_some_and(|c| segment[sctp::CHECKSUM_AT..sctp::HEADER_LEN] == c),
        _ => true,
    }
}

/// Whether a UDP-Lite header is one Linux tracks (RFC 3828 §3.1): its checksum coverage 0
/// (the whole datagram) or at least the header and at most the datagram, and a checksum
/// (UDP-Lite has no "none"). A fragment's coverage is checked against the header only: its
/// datagram's length is not known here.
fn udplite_header_ok(frame: &[u8], l: &Layers) -> bool {
    let segment = transport(frame, l);
    let (Some(&[c0, c1]), Some(check)) = (segment.get(4..6), segment.get(6..8)) else {
        return false;
    };
    let coverage = usize::from(u16::from_be_bytes([c0, c1]));
    let covers = coverage == 0
        || (coverage >= crate::wire::udp::HEADER_LEN && (l.fragment || coverage <= segment.len()));
    covers && check != [0, 0]
}

/// The transport header and payload (an SCTP packet's common header and chunks), as far as
/// the frame holds them.
fn transport<'a>(frame: &'a [u8], l: &Layers) -> &'a [u8] {
    frame
        .get(usize::from(l.l4)..usize::from(l.l3_end))
        .unwrap_or(&[])
}

/// A packet's connection key and hash, computed once ahead of its lookup.
#[derive(Debug, Clone, Copy)]
pub struct Probe {
    t: Tuple,
    key: Key,
    from_a: bool,
    hash: u64,
    /// The ingress port index, when the packet counts for the flow records.
    report: Option<u8>,
}

impl Probe {
    /// Whether the connection that takes the packet counts it for the flow records.
    pub fn reports(&self) -> bool {
        self.report.is_some()
    }

    /// The flow key of a packet that [`Probe::reports`] (it arrived untunnelled on a port
    /// below 255), as the flow cache keys it, and its TCP flags: for when no connection
    /// took it after all.
    pub fn arrival_flow(&self) -> (FlowKey, u8) {
        let t = &self.t;
        let in_port = self.report.map_or(0, u16::from);
        let dport = if ip_proto::is_icmp(t.proto) {
            t.icmp_type_code
        } else {
            t.dport
        };
        let key = flow_key(in_port, t.v6, (t.src, t.sport), (t.dst, dport), t.proto);
        (key, t.tcp_flags)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Step {
    To(ConnState),
    Invalid(Invalid),
    /// Possibly out of sync (Linux `sIG`): the packet passes as part of the connection but
    /// does not change its state.
    Ignore,
    Reopen,
}

#[cfg(test)]
mod tests {
    use super::key::tuple_kind;
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashSet;

    fn key(n: u16) -> Key {
        Key::new([1; 2], n, [2; 2], 80, tuple_kind(6, false), 0)
    }

    fn pending(ct: &Conntrack, n: u16) -> Pending {
        Pending {
            key: key(n),
            hash: ct.hash(&key(n)),
            orig_from_a: true,
            state: ConnState::Udp,
            bytes: 64,
            tcp_flags: 0,
            report: None,
            segment: None,
            assoc: Assoc::default(),
        }
    }

    proptest! {
        /// Inserts and removals in any order leave exactly the model's keys findable:
        /// backward-shift deletion keeps every probe sequence intact. (The connections are
        /// confirmed UDP streams, which a full table keeps.)
        #[test]
        fn table_agrees_with_a_set(ops in proptest::collection::vec((any::<bool>(), 0u16..40), 0..300)) {
            let mut ct = Conntrack::new(24, CtTimeouts::default());
            let mut model = HashSet::new();
            for (insert, n) in ops {
                if insert {
                    let ok = ct.commit(&pending(&ct, n), 1);
                    if model.len() < 24 || model.contains(&n) {
                        prop_assert!(ok);
                        model.insert(n);
                        let i = ct.find(&key(n), ct.hash(&key(n)), 1).expect("inserted");
                        ct.slots[i].flags |= UDP_STREAM;
                    } else {
                        prop_assert!(!ok, "a full table refuses new connections");
                    }
                } else if let Ok(i) = ct.find(&key(n), ct.hash(&key(n)), 1) {
                    ct.remove(i);
                    model.remove(&n);
                }
                prop_assert_eq!(ct.len(), model.len());
            }
            for n in 0..40 {
                prop_assert_eq!(ct.find(&key(n), ct.hash(&key(n)), 1).is_ok(), model.contains(&n), "key {}", n);
            }
        }
    }

    /// A full table makes room for a new connection by dropping an unconfirmed one near
    /// where the new one goes (a flood of SYNs cannot lock new connections out), and
    /// refuses it when those are all confirmed; the dropped one's record says why.
    #[test]
    fn a_full_table_drops_unconfirmed_connections_early() {
        let mut ct = Conntrack::new(16, CtTimeouts::default());
        ct.enable_export(60_000_000_000);
        // Each connection counts its first packet, from port 0.
        let commit = |ct: &mut Conntrack, n, now| {
            let ok = ct.commit(
                &Pending {
                    report: Some(0),
                    ..pending(ct, n)
                },
                now,
            );
            ct.note_fate(|| (None, false));
            ok
        };
        for n in 0..16 {
            assert!(commit(&mut ct, n, 1));
        }
        // Sixteen unconfirmed (one-way UDP): a new connection takes the place of one.
        assert!(commit(&mut ct, 100, 2));
        assert_eq!(
            (ct.len(), ct.stats.early_drops, ct.stats.drops_full),
            (16, 1, 0)
        );
        let mut out = Vec::new();
        ct.take_records(&mut out);
        assert_eq!(out.len(), 1);
        assert_eq!(out[0].reason, EndReason::LackOfResources);
        // All confirmed: refused.
        for i in 0..ct.slots.len() {
            if ct.tags[i] != 0 {
                ct.slots[i].flags |= UDP_STREAM;
            }
        }
        assert!(!commit(&mut ct, 101, 3));
        assert_eq!(
            (ct.len(), ct.stats.early_drops, ct.stats.drops_full),
            (16, 1, 1)
        );
    }

    /// A UDP frame between two addresses (IPv4 in the low 32 bits of `src` and `dst`
    /// unless `v6`) and its parse.
    fn udp(v6: bool, src: u128, dst: u128, sport: u16, dport: u16) -> (Vec<u8>, Meta) {
        let f = crate::wire::testing::frame(v6, src, dst, ip_proto::UDP, sport, dport, 0, 0);
        let meta = parse::parse(&f, &Default::default()).expect("valid frame");
        (f, meta)
    }

    /// An IPv6 packet between `::10.0.0.2` and `::10.0.0.1` (IPv4-compatible addresses) is
    /// not the reply of an IPv4 connection between 10.0.0.1 and 10.0.0.2.
    #[test]
    fn address_families_do_not_share_connections() {
        let mut ct = Conntrack::new(100, CtTimeouts::default());
        let (a, b) = (0x0a00_0001u128, 0x0a00_0002u128);
        let (f, m) = udp(false, a, b, 1000, 53);
        let l = ct.lookup(&f, &m, 0, 1, None);
        assert_eq!(l.state, CtState::New);
        assert!(ct.commit(&l.pending.expect("a new connection"), 1));
        let (f, m) = udp(false, b, a, 53, 1000);
        assert_eq!(ct.lookup(&f, &m, 0, 2, None).state, CtState::Established);
        let (f, m) = udp(true, b, a, 53, 1000);
        assert_eq!(ct.lookup(&f, &m, 0, 3, None).state, CtState::New);
    }

    /// A reply answers a query of its own code only, all eight bits of it, as Linux's
    /// tuple holds the code: an echo request of code 40 is not answered by a reply of
    /// code 8 (the same in the low five bits).
    #[test]
    fn icmp_query_codes_are_part_of_the_key() {
        let mut ct = Conntrack::new(100, CtTimeouts::default());
        let (a, b) = (0x0a00_0001u128, 0x0a00_0002u128);
        let icmp = |src, dst, kind: u8, code: u8| {
            let type_code = u16::from_be_bytes([kind, code]);
            let f =
                crate::wire::testing::frame(false, src, dst, ip_proto::ICMP, type_code, 0, 0, 0);
            let meta = parse::parse(&f, &Default::default()).expect("valid frame");
            (f, meta)
        };
        let (f, m) = icmp(a, b, 8, 40);
        let l = ct.lookup(&f, &m, 0, 1, None);
        assert_eq!(l.state, CtState::New);
        assert!(ct.commit(&l.pending.expect("a new connection"), 1));
        let (f, m) = icmp(b, a, 0, 8);
        assert_ne!(ct.lookup(&f, &m, 0, 2, None).state, CtState::Established);
        let (f, m) = icmp(b, a, 0, 40);
        assert_eq!(ct.lookup(&f, &m, 0, 3, None).state, CtState::Established);
    }

    /// The sweep examines the whole table once a second of packet time: a few slots for a
    /// short step, the whole table (up to its cap a call) for a long one.
    #[test]
    fn sweeps_are_paced_by_packet_time() {
        let t = CtTimeouts {
            udp: Duration::from_secs(30),
            ..CtTimeouts::default()
        };
        let mut ct = Conntrack::new(400, t);
        let slots = ct.slots.len();
        for n in 0..300 {
            assert!(ct.commit(&pending(&ct, n), 1_000_000_000));
        }
        let late = 40_000_000_000;
        ct.sweep_due(late, crate::sweep::MAX_SLOTS);
        assert_eq!(ct.sweep_at, 0, "the first call only starts the clock");
        // 1/100 of a second: 1/100 of the table.
        ct.sweep_due(late + 10_000_000, crate::sweep::MAX_SLOTS);
        assert_eq!(ct.sweep_at, slots / 100);
        let before = ct.len();
        ct.sweep_due(late + 2_000_000_000, crate::sweep::MAX_SLOTS);
        assert!(ct.len() < before);
        ct.sweep_due(late + 4_000_000_000, crate::sweep::MAX_SLOTS);
        assert_eq!(
            ct.len(),
            0,
            "two seconds later every idle connection is gone"
        );
    }

    #[test]
    fn idle_connections_expire_lazily_and_by_sweep() {
        let t = CtTimeouts {
            udp: Duration::from_secs(30),
            ..CtTimeouts::default()
        };
        let mut ct = Conntrack::new(100, t);
        for n in 0..50 {
            assert!(ct.commit(&pending(&ct, n), 1_000_000_000));
        }
        assert_eq!(ct.len(), 50);
        let later = 1_000_000_000 + 31_000_000_000;
        assert!(ct.find(&key(7), ct.hash(&key(7)), later).is_err());
        assert_eq!(ct.stats.expirations, 1);
        ct.sweep(later, 1000);
        assert_eq!(ct.len(), 0);
        assert_eq!(ct.stats.expirations, 50);
    }

    #[test]
    fn tcp_state_table_follows_linux() {
        use tcp::flags::*;
        use ConnState::*;
        for (from, flags, reply, to) in [
            (TcpSynSent, SYN | ACK, true, Step::To(TcpSynRecv)),
            (TcpSynRecv, ACK, false, Step::To(TcpEstablished)),
            (TcpEstablished, FIN | ACK, false, Step::To(TcpFinWait)),
            (TcpFinWait, ACK, true, Step::To(TcpCloseWait)),
            (TcpCloseWait, FIN | ACK, true, Step::To(TcpLastAck)),
            (TcpLastAck, ACK, false, Step::To(TcpTimeWait)),
            (TcpEstablished, RST, true, Step::To(TcpClose)),
            (TcpSynSent, ACK, false, Step::Invalid(Invalid::TcpState)),
            (TcpEstablished, SYN, false, Step::Ignore),
            (TcpTimeWait, SYN, false, Step::Reopen),
        ] {
            assert_eq!(
                tcp_transition(from, flags, reply),
                to,
                "{from:?}, flags {flags:#04x}, reply {reply}"
            );
        }
        assert_eq!(tcp_transition_new(SYN | ACK, true), None);
        assert_eq!(tcp_transition_new(ACK, true), Some(TcpEstablished));
        assert_eq!(tcp_transition_new(ACK, false), None);
        assert_eq!(tcp_transition_new(SYN, false), Some(TcpSynSent));
        assert!(!tcp_flags_valid(SYN | FIN));
        assert!(!tcp_flags_valid(FIN));
        assert!(tcp_flags_valid(PSH | ACK));
    }

    /// One packet through conntrack as the engine sends it: probed as it arrived on
    /// `in_port`, looked up, committed when new, then its fate noted; whether a connection
    /// counted it.
    fn pass(ct: &mut Conntrack, frame: &[u8], in_port: u16, now: u64, out: u16) -> bool {
        let meta = parse::parse(frame, &Default::default()).expect("valid frame");
        let mut probe = None;
        ct.prefetch(frame, &meta, in_port, now, &mut probe);
        let l = ct.lookup(frame, &meta, 0, now, probe.as_ref());
        if let Some(p) = l.pending {
            assert!(ct.commit(&p, now));
        }
        ct.note_fate(|| (Some(out), false))
    }

    /// The `ct.state` of a packet looked up at `now`, its connection committed when new.
    fn tracked_state(ct: &mut Conntrack, f: &[u8], now: u64) -> CtState {
        let meta = parse::parse(f, &Default::default()).expect("valid frame");
        let l = ct.lookup(f, &meta, 0, now, None);
        if let Some(p) = l.pending {
            assert!(ct.commit(&p, now));
        }
        l.state
    }

    /// A TCP segment between 10.0.0.1:`port` (the client) and 10.0.0.2:80, with a window
    /// of 65535.
    fn segment(port: u16, reply: bool, flags: u8, seq: u32, ack: u32) -> Vec<u8> {
        let (a, b) = (0x0a00_0001u128, 0x0a00_0002u128);
        let (src, dst, sport, dport) = if reply {
            (b, a, 80, port)
        } else {
            (a, b, port, 80)
        };
        let mut f =
            crate::wire::testing::frame(false, src, dst, ip_proto::TCP, sport, dport, flags, 0);
        let l4 = 14 + 20;
        f[l4 + 4..l4 + 8].copy_from_slice(&seq.to_be_bytes());
        f[l4 + 8..l4 + 12].copy_from_slice(&ack.to_be_bytes());
        f[l4 + 14..l4 + 16].copy_from_slice(&0xffffu16.to_be_bytes());
        f
    }

    /// A connection picked up mid-stream waits for an answer at most
    /// `tcp_unacknowledged`; once answered, its established timeout holds, with windows
    /// tracked or not.
    #[test]
    fn unanswered_and_unacknowledged_connections_time_out_sooner() {
        use tcp::flags::*;
        let s = 1_000_000_000u64;
        for windows in [false, true] {
            let mut ct = Conntrack::new(16, CtTimeouts::default());
            if windows {
                ct.track_windows();
            }
            let mut state = |f: &[u8], now: u64| tracked_state(&mut ct, f, now);
            // Picked up, unanswered for longer than 300 s: the reply finds nothing.
            state(&segment(1, false, ACK, 7000, 9000), 0);
            assert_eq!(
                state(&segment(1, true, ACK, 9000, 7000), 301 * s),
                CtState::New
            );
            // Answered: still there an hour later.
            state(&segment(2, false, ACK, 7000, 9000), 0);
            assert_eq!(
                state(&segment(2, true, ACK, 9000, 7000), s),
                CtState::Established
            );
            assert_eq!(
                state(&segment(2, false, ACK, 7000, 9000), 3600 * s),
                CtState::Established
            );
        }
    }

    proptest! {
        /// Any TCP segments, among a few connections of a table smaller than they are, with
        /// time jumping past timeouts: with windows tracked or not, lookups and commits
        /// never panic, the table never holds more than its capacity, and every entry it
        /// holds is reachable from its home.
        #[test]
        fn any_tcp_traffic_keeps_the_table_whole(
            windows in any::<bool>(),
            segments in proptest::collection::vec(
                (0u16..12, any::<bool>(), tcp_flags(), 0u32..5_000, 0u32..5_000, 0u64..400),
                1..200,
            ),
        ) {
            let mut ct = Conntrack::new(8, CtTimeouts::default());
            if windows {
                ct.track_windows();
            }
            let mut now = 0u64;
            for (port, reply, flags, seq, ack, secs) in segments {
                now += secs * 1_000_000_000;
                let f = segment(port, reply, flags, seq, ack);
                let _ = tracked_state_or_full(&mut ct, &f, now);
                prop_assert!(ct.len() <= ct.capacity());
                let held = ct.tags.iter().filter(|&&t| t != 0).count();
                prop_assert_eq!(held, ct.len());
                // Linear probing's invariant: no empty slot between an entry's home and it.
                for i in (0..ct.slots.len()).filter(|&i| ct.tags[i] != 0) {
                    let mut j = ct.home_of(ct.hash(&ct.slots[i].key));
                    while j != i {
                        prop_assert!(ct.tags[j] != 0, "slot {} is cut off from its home", i);
                        j = ct.next(j);
                    }
                }
            }
        }
    }

    proptest! {
        /// Any SCTP packets (chunks of any kind, flags and tag, tags drawn from a few so that
        /// some match) among a few associations of a table smaller than they are, with time
        /// jumping past timeouts: lookups and commits never panic, and every SCTP entry
        /// holds its own association, none shared and none lost (held and free ones make
        /// up the pool).
        #[test]
        fn any_sctp_traffic_keeps_every_association_accounted(
            packets in proptest::collection::vec(
                (0u16..12, any::<bool>(), 0u32..4, proptest::collection::vec((0u8..16, any::<u8>(), 0u32..4), 0..3), 0u64..20),
                1..150,
            ),
        ) {
            use crate::firewall::sctp::tests::packet;
            let mut ct = Conntrack::new(8, CtTimeouts::default());
            let pool = 5;
            ct.sctp = Associations::new(pool);
            let mut now = 0u64;
            for (port, reply, tag, chunks, secs) in packets {
                now += secs * 1_000_000_000;
                let values: Vec<[u8; 16]> = chunks.iter().map(|&(_, _, t)| {
                    let mut v = [0u8; 16];
                    v[..4].copy_from_slice(&(0x100 + t).to_be_bytes());
                    v
                }).collect();
                let chunks: Vec<(u8, u8, &[u8])> = chunks.iter().zip(&values)
                    .map(|(&(kind, flags, _), v)| (kind, flags, &v[..]))
                    .collect();
                let mut p = packet(0x100 + tag, &chunks);
                if tag == 0 {
                    p[4..8].fill(0);
                }
                let (from, to, sport, dport) = if reply { (2, 1, 38412, 1000 + port) } else { (1, 2, 1000 + port, 38412) };
                p[0..2].copy_from_slice(&sport.to_be_bytes());
                p[2..4].copy_from_slice(&dport.to_be_bytes());
                let f = crate::wire::testing::ip_frame(false, from, to, ip_proto::SCTP, 0, &p);
                let _ = tracked_state_or_full(&mut ct, &f, now);
                prop_assert!(ct.len() <= ct.capacity());
                let held: Vec<u16> = (0..ct.slots.len())
                    .filter(|&i| ct.tags[i] != 0 && is_sctp(ct.slots[i].state))
                    .map(|i| ct.slots[i].association())
                    .collect();
                let distinct: HashSet<u16> = held.iter().copied().collect();
                prop_assert_eq!(distinct.len(), held.len(), "an association shared");
                prop_assert_eq!(held.len() + ct.sctp.free(), pool, "an association lost");
            }
        }
    }

    /// TCP flags, mostly the combinations segments carry.
    fn tcp_flags() -> impl Strategy<Value = u8> {
        use tcp::flags::*;
        prop_oneof![
            Just(SYN),
            Just(SYN | ACK),
            Just(ACK),
            Just(PSH | ACK),
            Just(FIN | ACK),
            Just(RST),
            Just(RST | ACK),
            any::<u8>(),
        ]
    }

    /// [`tracked_state`], where a full table may refuse the connection.
    fn tracked_state_or_full(ct: &mut Conntrack, f: &[u8], now: u64) -> CtState {
        let meta = parse::parse(f, &Default::default()).expect("valid frame");
        let l = ct.lookup(f, &meta, 0, now, None);
        if let Some(p) = l.pending {
            ct.commit(&p, now);
        }
        l.state
    }

    /// Each connection keeps its own windows while removals shift entries: after half of a
    /// full table expires, every remaining connection still refuses a RST far out of its
    /// window and takes the one at its exact sequence number.
    #[test]
    fn windows_move_with_their_connections() {
        use tcp::flags::*;
        let timeouts = CtTimeouts {
            tcp_established: Duration::from_secs(20),
            ..CtTimeouts::default()
        };
        let mut ct = Conntrack::new(16, timeouts);
        ct.track_windows();
        let s = 1_000_000_000u64;
        let state = tracked_state;
        let isn = |port: u16| {
            (
                u32::from(port) * 100_000,
                3_000_000_000 + u32::from(port) * 100_000,
            )
        };
        for port in 1..=16u16 {
            let now = if port <= 8 { 0 } else { 10 * s };
            let (c, v) = isn(port);
            state(&mut ct, &segment(port, false, SYN, c, 0), now);
            state(&mut ct, &segment(port, true, SYN | ACK, v, c + 1), now);
            assert_eq!(
                state(&mut ct, &segment(port, false, ACK, c + 1, v + 1), now),
                CtState::Established
            );
        }
        ct.sweep(25 * s, 100);
        assert_eq!(ct.len(), 8);
        for port in 9..=16u16 {
            let (_, v) = isn(port);
            let far = segment(port, true, RST, v.wrapping_add(1 + 50_000_000), 0);
            assert_eq!(
                state(&mut ct, &far, 26 * s),
                CtState::Invalid,
                "port {port}"
            );
            let exact = segment(port, true, RST, v + 1, 0);
            assert_eq!(
                state(&mut ct, &exact, 26 * s),
                CtState::Established,
                "port {port}"
            );
        }
    }

    /// `frame` (an IPv4 segment of [`segment`]) as the first fragment of its datagram.
    fn first_fragment(mut frame: Vec<u8>) -> Vec<u8> {
        let ip = &mut frame[14..34];
        ip[6] |= 0x20; // more fragments
        ip[10..12].fill(0);
        let check = crate::wire::checksum::checksum(ip);
        ip[10..12].copy_from_slice(&check.to_be_bytes());
        frame
    }

    /// With windows tracked, a first fragment opens its connection's windows (a SYN in
    /// fragments), and a RST in fragments is judged by them: one far from the window is
    /// invalid and closes nothing, the exact one passes.
    #[test]
    fn fragmented_segments_meet_the_windows() {
        use tcp::flags::*;
        let mut ct = Conntrack::new(16, CtTimeouts::default());
        ct.track_windows();
        let state = |ct: &mut Conntrack, f: Vec<u8>| tracked_state(ct, &f, 0);
        let (c, v) = (1000, 5000);
        let syn = first_fragment(segment(1, false, SYN, c, 0));
        assert_eq!(state(&mut ct, syn), CtState::New);
        let synack = segment(1, true, SYN | ACK, v, c + 1);
        assert_eq!(state(&mut ct, synack), CtState::Established);
        let ack = segment(1, false, ACK, c + 1, v + 1);
        assert_eq!(state(&mut ct, ack), CtState::Established);
        let far = first_fragment(segment(1, true, RST, v + 1 + 50_000_000, 0));
        assert_eq!(state(&mut ct, far), CtState::Invalid);
        assert_eq!(ct.stats.invalid[Invalid::TcpSeq as usize], 1);
        let data = segment(1, false, ACK | PSH, c + 1, v + 1);
        assert_eq!(state(&mut ct, data), CtState::Established);
        let exact = first_fragment(segment(1, true, RST, v + 1, 0));
        assert_eq!(state(&mut ct, exact), CtState::Established);
        let closed = (0..ct.slots.len()).filter(|&i| ct.tags[i] != 0);
        let states: Vec<ConnState> = closed.map(|i| ct.slots[i].state).collect();
        assert_eq!(states, [ConnState::TcpClose]);
    }

    /// With export on, a TCP connection reports each direction's packets, bytes, flags and
    /// ports: after the active timeout, and at its end (flowEndReason 3 once closed).
    #[test]
    fn connections_report_their_directions() {
        use tcp::flags::*;
        let mut ct = Conntrack::new(100, CtTimeouts::default());
        let s = 1_000_000_000u64;
        ct.enable_export(60 * s);
        let (a, b) = (0x0a00_0001u128, 0x0a00_0002u128);
        let tcp = |from_a: bool, flags: u8| {
            let (src, dst, sp, dp) = if from_a {
                (a, b, 40000, 443)
            } else {
                (b, a, 443, 40000)
            };
            crate::wire::testing::frame(false, src, dst, ip_proto::TCP, sp, dp, flags, 0)
        };
        // 40 bytes of IP each (20 + 20).
        assert!(pass(&mut ct, &tcp(true, SYN), 0, s, 1));
        assert!(pass(&mut ct, &tcp(false, SYN | ACK), 1, 2 * s, 0));
        assert!(pass(&mut ct, &tcp(true, ACK), 0, 3 * s, 1));
        ct.sweep_due(3 * s, crate::sweep::MAX_SLOTS);
        ct.sweep_due(70 * s, crate::sweep::MAX_SLOTS);
        let mut out = Vec::new();
        ct.take_records(&mut out);
        assert_eq!(out.len(), 2, "{out:?}");
        let orig = out
            .iter()
            .find(|r| r.key.src == a)
            .expect("original direction");
        assert_eq!(
            (orig.packets, orig.bytes, orig.tcp_flags),
            (2, 80, SYN | ACK)
        );
        assert_eq!((orig.key.in_port, orig.out_port), (0, Some(1)));
        assert_eq!(
            (orig.key.sport, orig.key.dport, orig.key.dst),
            (40000, 443, b)
        );
        assert_eq!((orig.first_ns, orig.last_ns), (s, 3 * s));
        assert_eq!(orig.reason, EndReason::Active);
        let reply = out
            .iter()
            .find(|r| r.key.src == b)
            .expect("reply direction");
        assert_eq!(
            (reply.packets, reply.key.in_port, reply.out_port),
            (1, 1, Some(0))
        );
        // The connection closes; its last packets are reported when it is swept.
        assert!(pass(&mut ct, &tcp(false, RST), 1, 71 * s, 0));
        ct.sweep_due(200 * s, crate::sweep::MAX_SLOTS);
        out.clear();
        ct.take_records(&mut out);
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!((out[0].packets, out[0].reason), (1, EndReason::EndOfFlow));
        // The interval began with its first packet, not with the report before it.
        assert_eq!((out[0].first_ns, out[0].last_ns), (71 * s, 71 * s));
        assert_eq!(ct.record_stats().map(|r| r.made), Some(3));
        assert!(ct.is_empty());
    }

    /// An SCTP association's records end with "end of flow" once it shut down, and with
    /// "idle" when an INIT went unanswered.
    #[test]
    fn sctp_records_end_as_their_associations_do() {
        use crate::firewall::sctp::tests::{init, packet};
        let s = 1_000_000_000u64;
        let sctp = |from_a: bool, p: Vec<u8>| {
            let (src, dst, sport, dport) = if from_a {
                (1, 2, 5000u16, 38412u16)
            } else {
                (2, 1, 38412, 5000)
            };
            let mut p = p;
            p[0..2].copy_from_slice(&sport.to_be_bytes());
            p[2..4].copy_from_slice(&dport.to_be_bytes());
            crate::wire::testing::ip_frame(false, src, dst, ip_proto::SCTP, 0, &p)
        };
        let (a, b) = (init(0x11), init(0x22));
        let association = [
            sctp(true, packet(0, &[(1, 0, &a)])),
            sctp(false, packet(0x11, &[(2, 0, &b)])),
            sctp(true, packet(0x22, &[(10, 0, b"cookie")])),
            sctp(false, packet(0x11, &[(11, 0, b"")])),
            sctp(true, packet(0x22, &[(7, 0, &[0; 4])])),
            sctp(false, packet(0x11, &[(8, 0, b"")])),
            sctp(true, packet(0x22, &[(14, 0, b"")])),
        ];
        for (packets, want) in [
            (&association[..], EndReason::EndOfFlow),
            (&association[..1], EndReason::Idle),
        ] {
            let mut ct = Conntrack::new(100, CtTimeouts::default());
            ct.enable_export(60 * s);
            for (n, f) in packets.iter().enumerate() {
                assert!(pass(&mut ct, f, (n % 2) as u16, s, 0), "packet {n}");
            }
            ct.sweep(100 * s, ct.slots.len());
            let mut out = Vec::new();
            ct.take_records(&mut out);
            assert!(
                !out.is_empty() && out.iter().all(|r| r.reason == want),
                "{out:?}"
            );
        }
    }

    /// A packet that arrived tunnelled, or whose tuple the pipeline changed before the
    /// lookup (no probe), is left to the flow cache; with export off nothing is counted.
    #[test]
    fn only_packets_looked_up_as_they_arrived_count() {
        let mut ct = Conntrack::new(100, CtTimeouts::default());
        let f = crate::wire::testing::frame(false, 1, 2, ip_proto::UDP, 1, 2, 0, 0);
        assert!(!pass(&mut ct, &f, 0, 1, 1), "export is off");
        ct.enable_export(u64::MAX);
        let meta = parse::parse(&f, &Default::default()).expect("valid frame");
        ct.lookup(&f, &meta, 0, 2, None);
        assert!(
            !ct.note_fate(|| (Some(1), false)),
            "no probe: the tuple was rewritten"
        );
        assert!(pass(&mut ct, &f, 0, 3, 1));
        let mut out = Vec::new();
        ct.report_all(4, &mut out);
        assert_eq!(out.len(), 1);
        assert_eq!((out[0].packets, out[0].reason), (1, EndReason::Forced));
    }

    /// IPv6 connections give IPv6 records, each direction with its own addresses.
    #[test]
    fn ipv6_connections_report_ipv6_flows() {
        let mut ct = Conntrack::new(10, CtTimeouts::default());
        ct.enable_export(u64::MAX);
        let (a, b) = (0x2001_0db8_u128 << 96 | 1, 0x2001_0db8_u128 << 96 | 2);
        let f = crate::wire::testing::frame(true, a, b, ip_proto::UDP, 5000, 53, 0, 0);
        let r = crate::wire::testing::frame(true, b, a, ip_proto::UDP, 53, 5000, 0, 0);
        assert!(pass(&mut ct, &f, 0, 1, 1));
        assert!(pass(&mut ct, &r, 1, 2, 0));
        let mut out = Vec::new();
        ct.report_all(3, &mut out);
        out.sort_by_key(|r| r.key.src);
        let keys: Vec<_> = out
            .iter()
            .map(|r| (r.key.v6, r.key.src, r.key.dst, r.key.sport))
            .collect();
        assert_eq!(keys, [(true, a, b, 5000), (true, b, a, 53)]);
        // 40-byte header and 8 bytes of UDP.
        assert!(out.iter().all(|r| r.packets == 1 && r.bytes == 48));
    }

    /// A UDP connection becomes a stream (the longer timeout) once it has seen a reply and
    /// more than two packets, in either order.
    #[test]
    fn udp_streams_need_a_reply_and_three_packets() {
        let t = CtTimeouts {
            udp: Duration::from_secs(30),
            udp_stream: Duration::from_secs(120),
            ..CtTimeouts::default()
        };
        for replies_first in [true, false] {
            let mut ct = Conntrack::new(10, t.clone());
            let out = crate::wire::testing::frame(false, 1, 2, ip_proto::UDP, 5, 6, 0, 0);
            let back = crate::wire::testing::frame(false, 2, 1, ip_proto::UDP, 6, 5, 0, 0);
            let order = if replies_first {
                [&out, &back, &out]
            } else {
                [&out, &out, &back]
            };
            let mut timeouts = Vec::new();
            for (n, f) in order.into_iter().enumerate() {
                pass(&mut ct, f, 0, n as u64 + 1, 1);
                let i = (0..ct.slots.len())
                    .find(|&i| ct.tags[i] != 0)
                    .expect("tracked");
                timeouts.push(ct.timeout(i) / 1_000_000_000);
            }
            assert_eq!(timeouts, [30, 30, 120], "replies first: {replies_first}");
        }
    }

    /// SCTP connections keep their associations while entries move around them and give
    /// them back as they end, whichever way: many more associations than the pool holds
    /// come and go through a small table (timed out, dropped early to make room), each
    /// still judged by its own tags; a pool with none free refuses a new one as a full
    /// table does.
    #[test]
    fn sctp_associations_follow_their_connections() {
        use crate::firewall::sctp::tests::{init, packet};
        // Three connections at most, and room for four associations: one leaked would
        // soon leave none.
        let mut ct = Conntrack::new(3, CtTimeouts::default());
        ct.sctp = Associations::new(4);
        let sctp = |from: u128, to: u128, sport: u16, dport: u16, p: Vec<u8>| {
            let mut p = p;
            p[0..2].copy_from_slice(&sport.to_be_bytes());
            p[2..4].copy_from_slice(&dport.to_be_bytes());
            crate::wire::testing::ip_frame(false, from, to, ip_proto::SCTP, 0, &p)
        };
        let state = |ct: &mut Conntrack, f: &[u8], now: u64| {
            let meta = parse::parse(f, &Default::default()).expect("valid frame");
            let l = ct.lookup(f, &meta, 0, now, None);
            let committed = l.pending.map(|p| ct.commit(&p, now));
            (l.state, committed)
        };
        let second = 1_000_000_000;
        for round in 0..40u16 {
            let now = u64::from(round) * 20 * second;
            if round % 10 == 0 {
                ct.sweep(now, ct.slots.len());
            }
            let port = 1000 + round;
            let tag = 0x100 + u32::from(round);
            // The handshake's INIT and INIT ACK: by the next round each association is
            // past its timeout (3 s), and is swept, or dropped early from the full table.
            let init_chunk = init(tag);
            let opened = sctp(1, 2, port, 38412, packet(0, &[(1, 0, &init_chunk)]));
            assert_eq!(state(&mut ct, &opened, now), (CtState::New, Some(true)));
            let ack = init(tag + 1);
            let answer = sctp(2, 1, 38412, port, packet(tag, &[(2, 0, &ack)]));
            assert_eq!(state(&mut ct, &answer, now).0, CtState::Established);
            let forged = sctp(
                1,
                2,
                port,
                38412,
                packet(tag ^ 0xffff_0000, &[(0, 0, b"x")]),
            );
            assert_eq!(state(&mut ct, &forged, now).0, CtState::Invalid);
            let data = sctp(1, 2, port, 38412, packet(tag + 1, &[(0, 0, b"x")]));
            assert_eq!(state(&mut ct, &data, now).0, CtState::Established);
        }
        assert!(ct.stats.expirations > 30, "{:?}", ct.stats);
        // An entry's association index is no TCP flags of its records.
        let mut sctp_entries = ct.slots.iter().filter(|e| is_sctp(e.state));
        assert!(sctp_entries.clone().any(|e| e.association() != 0));
        assert!(sctp_entries.all(|e| e.record(0, EndReason::Idle).tcp_flags == 0));
        // Four held at once (the pool's size): a fifth waits for one to end.
        let mut ct = Conntrack::new(8, CtTimeouts::default());
        ct.sctp = Associations::new(4);
        for port in 0..5u16 {
            let init_chunk = init(7);
            let opened = sctp(1, 2, 2000 + port, 38412, packet(0, &[(1, 0, &init_chunk)]));
            let meta = parse::parse(&opened, &Default::default()).expect("valid frame");
            let p = ct.lookup(&opened, &meta, 0, 0, None).pending.expect("new");
            assert_eq!(ct.commit(&p, 0), port < 4, "association {port}");
        }
        assert_eq!((ct.len(), ct.stats.drops_full), (4, 1));
    }

    /// With `checksum on`, a packet whose transport checksum is wrong is invalid, and one
    /// whose checksum is right, or a UDP datagram without one, is tracked; off, checksums
    /// are not read. (The kernel comparison checks the sums against Linux's.)
    #[test]
    fn wrong_checksums_are_invalid_when_verified() {
        use crate::wire::checksum;
        for v6 in [false, true] {
            for proto in [ip_proto::TCP, ip_proto::UDP] {
                let mut f = crate::wire::testing::frame(v6, 1, 2, proto, 5, 6, tcp::flags::SYN, 0);
                let meta = parse::parse(&f, &Default::default()).expect("valid frame");
                let l4 = usize::from(meta.outer.l4);
                let pseudo = parse::pseudo_header(&f, &meta.outer, proto, f.len() - l4).unwrap();
                let at = l4 + if proto == ip_proto::TCP { 16 } else { 6 };
                let sum = !checksum::fold(checksum::sum(pseudo, &f[l4..]));
                f[at..at + 2].copy_from_slice(&sum.to_be_bytes());
                let mut wrong = f.clone();
                wrong[l4] ^= 1;
                for (frame, verify, want) in [
                    (&f, true, CtState::New),
                    (&wrong, true, CtState::Invalid),
                    (&wrong, false, CtState::New),
                ] {
                    let mut ct = Conntrack::new(16, CtTimeouts::default());
                    if verify {
                        ct.verify_checksums();
                    }
                    assert_eq!(
                        tracked_state(&mut ct, frame, 1),
                        want,
                        "v6 {v6} proto {proto}"
                    );
                }
                if proto == ip_proto::UDP {
                    wrong[at..at + 2].fill(0);
                    let mut ct = Conntrack::new(16, CtTimeouts::default());
                    ct.verify_checksums();
                    assert_eq!(tracked_state(&mut ct, &wrong, 1), CtState::New);
                }
            }
        }
    }

    /// A UDP-Lite checksum covers the pseudo-header (protocol 136, the whole datagram's
    /// length) and the bytes its coverage says, no more (RFC 3828 §3.1): a byte past the
    /// coverage may change, one within may not, and a sum over a pseudo-header of protocol
    /// 17 (what Linux's conntrack computes) is wrong.
    #[test]
    fn udplite_checksums_cover_what_the_header_says() {
        use crate::wire::checksum;
        for v6 in [false, true] {
            let datagram = [[0x13, 0x88, 0x1b, 0x59, 0, 8, 0, 0].as_slice(), b"payload"].concat();
            let f = crate::wire::testing::ip_frame(v6, 1, 2, ip_proto::UDPLITE, 0, &datagram);
            let meta = parse::parse(&f, &Default::default()).expect("valid frame");
            let l4 = usize::from(meta.outer.l4);
            let summed = |proto: u8| {
                let pseudo = parse::pseudo_header(&f, &meta.outer, proto, f.len() - l4).unwrap();
                let mut g = f.clone();
                let sum = !checksum::fold(checksum::sum(pseudo, &f[l4..l4 + 8]));
                g[l4 + 6..l4 + 8].copy_from_slice(&sum.to_be_bytes());
                g
            };
            let right = summed(ip_proto::UDPLITE);
            let mut past_coverage = right.clone();
            past_coverage[l4 + 9] ^= 1;
            let mut within = right.clone();
            within[l4] ^= 1;
            for (frame, want) in [
                (&right, CtState::New),
                (&past_coverage, CtState::New),
                (&within, CtState::Invalid),
                (&summed(ip_proto::UDP), CtState::Invalid),
            ] {
                let mut ct = Conntrack::new(16, CtTimeouts::default());
                ct.verify_checksums();
                assert_eq!(tracked_state(&mut ct, frame, 1), want, "v6 {v6}");
            }
        }
    }

    #[test]
    fn at_most_128_bytes_per_connection() {
        assert!(size_of::<Entry>() <= 96, "{}", size_of::<Entry>());
        let ct = Conntrack::new(1_000_000, CtTimeouts::default());
        assert!(
            ct.memory_bytes() <= 128 * 1_000_000,
            "{}",
            ct.memory_bytes()
        );
    }
}
