//! The flow cache behind IPFIX export, like VPP's flowprobe: every flow the pipeline sees,
//! keyed by ingress port, addresses, protocol, transport ports and VNI, with packet and
//! byte counts since its last export. Time is the packets' own.

use crate::engine::parse::{self, Layers, Meta, L3};
use crate::engine::prefetch::prefetch;
use crate::engine::staged_packets;
use crate::firewall::fragments::Fragments;
use crate::hash::KeyedHash;
use crate::sweep::Pace;
use crate::telemetry::sampling::Sampler;
use crate::wire::{be128, be32, be64, ip_proto};

/// What identifies a flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct FlowKey {
    pub in_port: u16,
    pub v6: bool,
    /// Addresses as big-endian integers; IPv4 in the low 32 bits. Integers, not byte
    /// arrays, so a key is built and hashed in registers.
    pub src: u128,
    pub dst: u128,
    pub proto: u8,
    pub sport: u16,
    /// The destination port; for ICMP and ICMPv6, which have no ports, the type and code
    /// (type × 256 + code), exported as icmpTypeCodeIPv4 or icmpTypeCodeIPv6 (RFC 7012):
    /// an echo reply and a destination unreachable are two flows.
    pub dport: u16,
    /// The VNI of the tunnel the packet arrived in, if any.
    pub vni: Option<u32>,
}

/// A flow key as the cache keeps it: six words, compared by [`FlowCache::holds`]. The first
/// holds ports, protocol, family and ingress port; the second the VNI, with bit 31 telling
/// VNI 0 from no tunnel (VNIs are 24 bits); then the addresses: an IPv4 source and
/// destination together in the third word (the rest zero in the cache, and never read: a
/// probe's may be stale), IPv6 ones in the last four. An IPv4 key is hashed by its nonzero
/// words only: two multiplies, where six words took four. No `==`: it would read the stale
/// words.
#[derive(Debug, Clone, Copy, Default)]
struct Packed([u64; 6]);

const V6_BIT: u64 = 1 << 16;

impl Packed {
    /// Writes the key of a parsed packet, from its outer headers, to `self`; `false` for
    /// non-IP packets. An IPv4 key's last three words are left as they were: nothing reads
    /// them (see [`FlowCache::holds`]), and a key is written for every packet. A fragment's
    /// ports are left zero (see [`FlowCache::probe_fragment`]).
    #[inline(always)]
    fn write(&mut self, frame: &[u8], meta: &Meta, in_port: u16) -> bool {
        let l = &meta.outer;
        let l3 = usize::from(l.l3);
        let ports = if l.l4_ok {
            u64::from(ports_of(frame, l))
        } else {
            0
        };
        let vni = meta.tunnel.map_or(0, |t| u64::from(t.vni) | 1 << 31);
        let rest = ports << 32 | u64::from(l.proto) << 24 | u64::from(in_port);
        let w = &mut self.0;
        match l.l3_kind {
            L3::V4 => {
                w[0] = rest;
                w[1] = vni;
                w[2] = be64(frame, l3 + 12);
            }
            L3::V6 => {
                let (src, dst) = (be128(frame, l3 + 8), be128(frame, l3 + 24));
                *w = [
                    rest | V6_BIT,
                    vni,
                    (src >> 64) as u64,
                    src as u64,
                    (dst >> 64) as u64,
                    dst as u64,
                ];
            }
            L3::None => return false,
        }
        true
    }

    /// Puts `ports` (source in the high half) and `proto` in the key.
    fn set_transport(&mut self, ports: u32, proto: u8) {
        self.0[0] = self.0[0] & 0xff_ffff | u64::from(ports) << 32 | u64::from(proto) << 24;
    }

    /// The key with the words its family does not use zeroed.
    fn trimmed(mut self) -> Packed {
        if self.0[0] & V6_BIT == 0 {
            self.0[3..].fill(0);
        }
        self
    }

    fn from_key(k: &FlowKey) -> Packed {
        let rest = u64::from(k.sport) << 48
            | u64::from(k.dport) << 32
            | u64::from(k.proto) << 24
            | if k.v6 { V6_BIT } else { 0 }
            | u64::from(k.in_port);
        let vni = k.vni.map_or(0, |v| u64::from(v) | 1 << 31);
        if k.v6 {
            let (s, d) = (k.src, k.dst);
            Packed([
                rest,
                vni,
                (s >> 64) as u64,
                s as u64,
                (d >> 64) as u64,
                d as u64,
            ])
        } else {
            Packed([
                rest,
                vni,
                (k.src as u64) << 32 | (k.dst as u64 & 0xffff_ffff),
                0,
                0,
                0,
            ])
        }
    }

    /// Equal keys take the same branch, so each always gets the same hash.
    #[inline(always)]
    fn hash(&self, h: &KeyedHash) -> u32 {
        let w = &self.0;
        (if w[0] & V6_BIT != 0 {
            h.hash(*w)
        } else if w[1] == 0 {
            h.hash([w[0], w[2]])
        } else {
            h.hash([w[0], w[1], w[2]])
        }) as u32
    }

    /// The words a [`Flow`] keeps beside its counts: all of an IPv4 key.
    #[inline(always)]
    fn head(&self) -> [u64; 3] {
        [self.0[0], self.0[1], self.0[2]]
    }

    /// An IPv6 key's last three words (kept in [`Rest`]).
    #[inline(always)]
    fn tail(&self) -> [u64; 3] {
        [self.0[3], self.0[4], self.0[5]]
    }

    fn is_v6(&self) -> bool {
        self.0[0] & V6_BIT != 0
    }

    /// The key whose words are `head` and `tail`.
    fn join(head: [u64; 3], tail: [u64; 3]) -> Packed {
        let [a, b, c] = head;
        let [d, e, f] = tail;
        Packed([a, b, c, d, e, f])
    }

    fn unpack(&self) -> FlowKey {
        let w = &self.0;
        let v6 = w[0] & V6_BIT != 0;
        let (src, dst) = if v6 {
            (
                u128::from(w[2]) << 64 | u128::from(w[3]),
                u128::from(w[4]) << 64 | u128::from(w[5]),
            )
        } else {
            (u128::from(w[2] >> 32), u128::from(w[2] as u32))
        };
        FlowKey {
            in_port: w[0] as u16,
            v6,
            src,
            dst,
            proto: (w[0] >> 24) as u8,
            sport: (w[0] >> 48) as u16,
            dport: (w[0] >> 32) as u16,
            vni: (w[1] & 1 << 31 != 0).then_some(w[1] as u32 & 0x00ff_ffff),
        }
    }
}

/// How a protocol's first four L4 bytes make a flow key's ports, as (mask, shift): whole
/// for TCP, UDP and SCTP; for ICMP and ICMPv6 the type and code, moved to the low half
/// (see [`FlowKey::dport`]); none for the rest. One load, where a test for each kind of
/// protocol cost 7 instructions more a packet.
const TRANSPORT: [(u32, u8); 256] = {
    let mut t = [(0, 0); 256];
    let mut p = 0;
    while p < 256 {
        if ip_proto::has_ports(p as u8) {
            t[p] = (u32::MAX, 0);
        } else if ip_proto::is_icmp(p as u8) {
            t[p] = (0xffff_0000, 16);
        }
        p += 1;
    }
    t
};

/// The transport ports of a packet whose L4 header is in the frame, source in the high
/// half; for ICMP the type and code in the low half; 0 for another protocol.
#[inline(always)]
fn ports_of(frame: &[u8], l: &Layers) -> u32 {
    let (mask, shift) = TRANSPORT[usize::from(l.proto)];
    if mask == 0 {
        return 0;
    }
    (be32(frame, usize::from(l.l4)) & mask) >> shift
}

/// The TCP flags of a packet whose L4 header is in the frame; 0 for another protocol.
#[inline(always)]
fn tcp_flags_of(frame: &[u8], l: &Layers) -> u8 {
    if l.proto == ip_proto::TCP {
        frame.get(usize::from(l.l4) + 13).copied().unwrap_or(0)
    } else {
        0
    }
}

/// What a flow cache reports to metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FlowStats {
    /// Flows held now.
    pub flows: u64,
    /// Packets of flows the cache had no room for (those flows are not exported), and
    /// their IP bytes.
    pub full_packets: u64,
    pub full_bytes: u64,
    /// Records produced for export (by the cache and by connections).
    pub records: u64,
    /// Records connections made but could not keep until the worker took them.
    pub lost_records: u64,
}

/// Why a record was exported (IPFIX flowEndReason, RFC 5102).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum EndReason {
    Idle = 1,
    Active = 2,
    /// A TCP connection closed (its record comes from conntrack).
    EndOfFlow = 3,
    Forced = 4,
    /// Removed to make room (a full connection table dropped it early).
    LackOfResources = 5,
}

/// One exported record: a flow's counts since its previous export.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FlowRecord {
    pub key: FlowKey,
    pub first_ns: u64,
    pub last_ns: u64,
    pub packets: u64,
    /// IP bytes (header and payload), as IPFIX counts octets.
    pub bytes: u64,
    pub tcp_flags: u8,
    /// Port the flow's packets went out of, if any.
    pub out_port: Option<u16>,
    /// The pipeline dropped the flow's packets.
    pub denied: bool,
    pub reason: EndReason,
    /// The counts are of the packets the flow cache's [`Sampler`] selected, not all.
    pub sampled: bool,
}

/// What a packet's flow record needs of it that the pipeline may rewrite, taken as it
/// arrives by [`FlowCache::probe`]: its key, the key's hash, its IP length and TCP flags.
#[derive(Debug, Clone, Copy, Default)]
pub struct FlowProbe {
    key: Packed,
    hash: u32,
    ip_bytes: u16,
    tcp_flags: u8,
}

/// A flow as each of its packets updates it, in one cache line: the first three words of
/// its key (all of an IPv4 key) beside its counts, so the line a lookup compares is the
/// line the count then writes.
#[derive(Debug, Clone, Copy, Default)]
#[repr(align(64))]
struct Flow {
    key: [u64; 3],
    packets: u64,
    bytes: u64,
    /// When the current record's first packet came (flowStartMilliseconds, RFC 7012).
    first_ns: u64,
    last_ns: u64,
    /// Port index the packets went out of, `u16::MAX` for none.
    out_port: u16,
    tcp_flags: u8,
    denied: bool,
    /// The slot holds a flow (free slots are listed in `free`).
    live: bool,
}

/// The rest of a flow: an IPv6 key's last three words (zero for IPv4), read by IPv6
/// lookups only, and what only the sweep reads.
#[derive(Debug, Clone, Copy, Default)]
struct Rest {
    key: [u64; 3],
    /// When the current reporting interval began (for the active timeout).
    since_ns: u64,
}

const NO_PORT: u16 = u16::MAX;

/// Room for `n` items, a [`crate::sys::huge_table`] emptied: the cache fills it without
/// reallocating (nor copying) or faulting. A million flows in 4 KiB pages missed the TLB
/// on every packet; a fresh huge page took up to 25 ms to fault in, in a VM here, and the
/// index's doublings, when it grew with the flows, up to 90 ms at 524,288 flows.
fn room<T: Default + Clone>(n: usize) -> Vec<T> {
    let mut v = crate::sys::huge_table(n, T::default());
    v.clear();
    v
}

/// Flows held from which lookups prefetch their lines ahead. A flow takes about 120 bytes
/// (index, counts, key): fewer stay in a core's own cache, where prefetching only costs
/// instructions (34 a packet). Measured on a core with 2 MiB of L2: prefetching is 3 %
/// slower at 4096 flows, even at 32k, 8 % faster at 64k, 50 % at 1M; the bound is lower
/// than that break-even for cores with less L2 (BlueField-3: 512 KiB).
const PREFETCH_FROM: usize = 16_384;

/// Records a cache keeps for the worker to take; past that, due flows wait in the cache for
/// the sweep's next pass (nothing is lost).
pub const RECORDS_KEPT: usize = 16_384;

/// A worker's flow cache, bounded. The index is open addressing with linear probing over
/// (hash, slot + 1) pairs, at most half full, with deletion by backward shift (no
/// tombstones): a lookup compares 32-bit hashes and reads a flow's key only on a match.
/// All its memory is taken and written when it is made, so no packet waits for a page
/// fault or a rehash: the index is sized for the bound, twice as many buckets (in huge
/// pages a few thousand flows spread over them run as fast as in an index of their own
/// size), and never grows.
///
/// Timeouts are found by a sweep paced by packet time, a slice of the flows after each
/// batch, rather than a scan of them all now and then: a million flows took 3 ms to scan,
/// a stall a dataplane cannot take.
#[derive(Debug)]
pub struct FlowCache {
    buckets: Vec<(u32, u32)>,
    mask: usize,
    hasher: KeyedHash,
    len: usize,
    flows: Vec<Flow>,
    rest: Vec<Rest>,
    free: Vec<u32>,
    capacity: usize,
    active_ns: u64,
    idle_ns: u64,
    /// Packets of flows not tracked because the cache was full, and their IP bytes.
    overflow: u64,
    overflow_bytes: u64,
    /// Records produced.
    records: u64,
    /// Records the sweep produced, for [`FlowCache::take_records`].
    due: Vec<FlowRecord>,
    /// Which packets are counted (`None`: all).
    sampler: Option<Sampler>,
    /// The ports and protocol recent datagrams' first fragments carried, for their later
    /// fragments: a datagram's fragments count in its flow, not in one keyed without ports.
    fragments: Fragments<(u32, u8)>,
    /// The next slot the sweep examines.
    sweep_at: usize,
    pace: Pace,
}

impl FlowCache {
    /// The memory a cache of `capacity` flows takes (all of it from the start).
    pub fn table_bytes(capacity: usize) -> u64 {
        let per_flow = size_of::<Flow>() + size_of::<Rest>() + size_of::<u32>();
        (Self::buckets_for(capacity) * size_of::<(u32, u32)>() + capacity.max(1) * per_flow) as u64
    }

    /// The index's buckets for `capacity` flows: it is at most half full.
    fn buckets_for(capacity: usize) -> usize {
        (capacity.max(1) * 2).next_power_of_two()
    }

    /// A cache of at most `capacity` flows that counts every packet.
    pub fn new(capacity: usize, active_ns: u64, idle_ns: u64) -> FlowCache {
        let buckets = Self::buckets_for(capacity);
        FlowCache {
            buckets: crate::sys::huge_table(buckets, (0, 0)),
            mask: buckets - 1,
            hasher: KeyedHash::new(),
            len: 0,
            flows: room(capacity),
            rest: room(capacity),
            free: room(capacity),
            capacity,
            active_ns,
            idle_ns,
            overflow: 0,
            overflow_bytes: 0,
            records: 0,
            due: Vec::with_capacity(RECORDS_KEPT),
            sampler: None,
            fragments: Fragments::default(),
            sweep_at: 0,
            pace: Pace::every(Self::sweep_period(active_ns, idle_ns)),
        }
    }

    /// How often the sweep visits every flow: an eighth of the shorter timeout, so a flow's
    /// record leaves at most that late, but no more often than once a second. With the
    /// default timeouts (15 s idle) every 1.875 s: a sweep of a million flows once a
    /// second read 116 MB a second a worker and cost 3 % of the packet rate.
    fn sweep_period(active_ns: u64, idle_ns: u64) -> u64 {
        (active_ns.min(idle_ns) / 8).max(crate::sweep::PERIOD_NS)
    }

    /// Counts only the packets `sampler` selects (all when its interval is 1).
    pub fn sampling(self, sampler: Sampler) -> FlowCache {
        FlowCache {
            sampler: (sampler.interval() > 1).then_some(sampler),
            ..self
        }
    }

    /// Whether the packet offered now is to be counted (see [`FlowCache::sampling`]);
    /// the caller offers each packet it would count once.
    #[inline(always)]
    pub fn selects(&mut self) -> bool {
        self.sampler.as_mut().is_none_or(Sampler::selects)
    }

    /// When it samples, which of a batch of `n` packets (at most 32) it counts, as bits
    /// (packet `i` bit `i`): for a batch offered whole, in place of
    /// [`FlowCache::selects`] for each packet. `None` when it counts every packet.
    #[inline]
    pub fn samples_of(&mut self, n: usize) -> Option<u32> {
        self.sampler.as_mut().map(|s| s.selects_of(n as u32))
    }

    /// Writes the probe of a parsed packet to `probe` (`false` for non-IP packets): its
    /// key and hash, and starts loading its index bucket. The first step of a lookup, done
    /// for a whole batch before any of it is processed so the cache misses overlap; the
    /// probe is written in place, as the engine keeps one per staged packet. A fragment's
    /// probe is completed by [`FlowCache::probe_fragment`].
    #[inline(always)]
    pub fn probe(&self, frame: &[u8], meta: &Meta, in_port: u16, probe: &mut FlowProbe) -> bool {
        if !probe.key.write(frame, meta, in_port) {
            return false;
        }
        probe.hash = probe.key.hash(&self.hasher);
        if self.prefetches() {
            prefetch(&self.buckets[probe.hash as usize & self.mask]);
        }
        let l = &meta.outer;
        probe.ip_bytes = l.l3_end - l.l3;
        probe.tcp_flags = if l.l4_ok { tcp_flags_of(frame, l) } else { 0 };
        true
    }

    /// Gives the probe of a fragment that arrived at `now` its datagram's ports and
    /// protocol, as the datagram's first fragment carried them, and the TCP flags the
    /// fragment carries (only a first has them): a first fragment notes its own for the
    /// later ones, which have no L4 header (and in IPv6 may name an extension header as
    /// their protocol). A fragment whose first has not come (a fragment ahead of it, or one
    /// whose first was lost) keeps ports zero. Called for every fragment, counted or not,
    /// so a counted fragment finds its first when sampling passed that by; the probe is
    /// then unused. Out of line: fragments are rare.
    #[cold]
    #[inline(never)]
    pub fn probe_fragment(&mut self, frame: &[u8], l: &Layers, now: u64, probe: &mut FlowProbe) {
        let Some((ports, proto, tcp_flags)) = self.fragment_transport(frame, l, now) else {
            return;
        };
        probe.key.set_transport(ports, proto);
        probe.tcp_flags = tcp_flags;
        probe.hash = probe.key.hash(&self.hasher);
    }

    /// What [`FlowCache::probe_fragment`] gives a fragment's probe, if known.
    fn fragment_transport(&mut self, frame: &[u8], l: &Layers, now: u64) -> Option<(u32, u8, u8)> {
        let (datagram, first) = parse::fragment_of(frame, l)?;
        if !first {
            let (ports, proto) = self.fragments.first(&datagram, now)?;
            return Some((ports, proto, 0));
        }
        if !parse::l4_fields(frame, l) {
            return None;
        }
        let ports = ports_of(frame, l);
        self.fragments.note(datagram, (ports, l.proto), now);
        Some((ports, l.proto, tcp_flags_of(frame, l)))
    }

    /// The probe of a packet of `ip_bytes` whose key was taken elsewhere (by conntrack, as
    /// it arrived).
    pub fn probe_key(&self, key: &FlowKey, tcp_flags: u8, ip_bytes: u16) -> FlowProbe {
        let key = Packed::from_key(key);
        FlowProbe {
            key,
            hash: key.hash(&self.hasher),
            ip_bytes,
            tcp_flags,
        }
    }

    /// Whether lookups load their lines ahead ([`FlowCache::probe`] its bucket,
    /// [`FlowCache::prefetch_flow`] its flow): only when the flows held outgrow a core's
    /// cache.
    #[inline]
    pub fn prefetches(&self) -> bool {
        self.len >= PREFETCH_FROM
    }

    /// The second step: with the bucket loaded, starts loading the flow it names.
    #[inline]
    pub fn prefetch_flow(&self, probe: &FlowProbe) {
        let (_, slot) = self.buckets[probe.hash as usize & self.mask];
        if let Some(i) = (slot as usize).checked_sub(1) {
            prefetch(&self.flows[i]);
            if probe.key.is_v6() {
                prefetch(&self.rest[i]);
            }
        }
    }

    /// Counts the probed packet, sent out of `out_port` or dropped (`denied`) at `now`,
    /// into its flow, a new one if the flow is new (not when the cache is full: that is
    /// counted in `overflow`).
    pub fn count(&mut self, probe: &FlowProbe, now: u64, out_port: Option<u16>, denied: bool) {
        let slot = match self.find(&probe.key, probe.hash) {
            Ok((_, slot)) => slot,
            Err(empty) => match self.insert(probe, empty, now) {
                Some(slot) => slot,
                None => return,
            },
        };
        self.bump(slot, probe, now, out_port, denied);
    }

    /// [`FlowCache::count`] for the packets whose bits are set in `staged`: packet `i`
    /// by `probes[i]`, at the time and with the fate `packet(i)` gives. Packets of flows
    /// held are counted in one pass that starts none, so the index and flows stay in
    /// registers; those of new flows after it.
    #[inline]
    pub fn count_staged(
        &mut self,
        probes: &[FlowProbe],
        staged: u32,
        packet: impl Fn(usize) -> (u64, Option<u16>, bool),
    ) {
        let mut new = 0u32;
        for i in staged_packets(staged) {
            let Some(probe) = probes.get(i) else {
                continue;
            };
            match self.find(&probe.key, probe.hash) {
                Ok((_, slot)) => {
                    let (now, out_port, denied) = packet(i);
                    self.bump(slot, probe, now, out_port, denied);
                }
                Err(_) => new |= 1 << i,
            }
        }
        // A new flow's packets are all here (it was held by none of the first pass), in
        // their order.
        for i in staged_packets(new) {
            if let Some(probe) = probes.get(i) {
                let (now, out_port, denied) = packet(i);
                self.count(probe, now, out_port, denied);
            }
        }
    }

    /// Adds the probed packet to the flow in `slot`.
    #[inline(always)]
    fn bump(&mut self, slot: usize, probe: &FlowProbe, now: u64, out: Option<u16>, denied: bool) {
        let Some(f) = self.flows.get_mut(slot) else {
            return;
        };
        // The first packet of an interval starts it.
        if f.packets == 0 {
            f.first_ns = now;
        }
        f.packets += 1;
        f.bytes += u64::from(probe.ip_bytes);
        f.last_ns = f.last_ns.max(now);
        f.tcp_flags |= probe.tcp_flags;
        if let Some(p) = out {
            f.out_port = p;
        }
        f.denied |= denied;
    }

    /// Starts a flow for the probed packet in bucket `empty`; `None` when the cache is full
    /// (counted in `overflow`).
    #[cold]
    fn insert(&mut self, probe: &FlowProbe, empty: usize, now: u64) -> Option<usize> {
        if self.len >= self.capacity {
            self.overflow += 1;
            self.overflow_bytes += u64::from(probe.ip_bytes);
            return None;
        }
        let key = probe.key.trimmed();
        let flow = Flow {
            key: key.head(),
            last_ns: now,
            out_port: NO_PORT,
            live: true,
            ..Flow::default()
        };
        let rest = Rest {
            key: key.tail(),
            since_ns: now,
        };
        let i = match self.free.pop() {
            Some(i) => {
                self.flows[i as usize] = flow;
                self.rest[i as usize] = rest;
                i
            }
            None => {
                self.flows.push(flow);
                self.rest.push(rest);
                (self.flows.len() - 1) as u32
            }
        };
        self.buckets[empty] = (probe.hash, i + 1);
        self.len += 1;
        Some(i as usize)
    }

    /// The bucket and slot holding `key` (`Ok`), or the empty bucket ending its probe
    /// (`Err`).
    #[inline(always)]
    fn find(&self, key: &Packed, hash: u32) -> Result<(usize, usize), usize> {
        let mut b = hash as usize & self.mask;
        loop {
            let (h, slot) = self.buckets[b];
            let Some(slot) = (slot as usize).checked_sub(1) else {
                return Err(b);
            };
            if h == hash && self.holds(slot, key) {
                return Ok((b, slot));
            }
            b = (b + 1) & self.mask;
        }
    }

    /// Whether the flow in `slot` has `key`, without a branch per word. IPv4 keys are
    /// compared on their first three words only (a probe's others may be stale); the
    /// first word holds the family.
    #[inline(always)]
    fn holds(&self, slot: usize, key: &Packed) -> bool {
        let (a, f) = (&key.0, &self.flows[slot].key);
        let head = (a[0] ^ f[0]) | (a[1] ^ f[1]) | (a[2] ^ f[2]);
        head == 0 && (!key.is_v6() || self.rest[slot].key == key.tail())
    }

    /// Empties bucket `hole`, moving later entries of the probe run back so every
    /// probe still reaches its entry before an empty bucket.
    fn remove_bucket(&mut self, mut hole: usize) {
        let mut b = (hole + 1) & self.mask;
        loop {
            let (h, slot) = self.buckets[b];
            if slot == 0 {
                break;
            }
            let home = h as usize & self.mask;
            // Movable when its home is not cyclically within (hole, b].
            if (b.wrapping_sub(home) & self.mask) >= (b.wrapping_sub(hole) & self.mask) {
                self.buckets[hole] = (h, slot);
                hole = b;
            }
            b = (b + 1) & self.mask;
        }
        self.buckets[hole] = (0, 0);
        self.len -= 1;
    }

    /// Examines the flows due by `now`: all of them once a second of packet time, spread
    /// over the batches, at most `most` a call (see [`crate::sweep`]).
    pub fn sweep_due(&mut self, now: u64, most: usize) {
        let due = self.pace.due(now, self.flows.len(), most);
        if due > 0 {
            self.sweep(now, due);
        }
    }

    /// Examines `slots` flows from where the sweep stands: idle ones are removed with a
    /// record, those past the active timeout report and restart their counts. Stops early
    /// when [`RECORDS_KEPT`] records wait.
    pub fn sweep(&mut self, now: u64, slots: usize) {
        let mut due = std::mem::take(&mut self.due);
        for _ in 0..slots.min(self.flows.len()) {
            if due.len() >= RECORDS_KEPT {
                break;
            }
            if self.sweep_at >= self.flows.len() {
                self.sweep_at = 0;
            }
            self.expire_slot(self.sweep_at, now, false, &mut due);
            self.sweep_at += 1;
        }
        self.due = due;
    }

    /// Records waiting for [`FlowCache::take_records`].
    pub fn records_waiting(&self) -> usize {
        self.due.len()
    }

    /// Moves the records the sweep made to `out`.
    pub fn take_records(&mut self, out: &mut Vec<FlowRecord>) {
        out.append(&mut self.due);
    }

    /// Ends every flow (forced end, at shutdown): moves their records, and those waiting,
    /// to `out`.
    pub fn flush(&mut self, now: u64, out: &mut Vec<FlowRecord>) {
        self.take_records(out);
        for i in 0..self.flows.len() {
            self.expire_slot(i, now, true, out);
        }
    }

    /// Reports the flow in slot `i` to `out` if it is due at `now` (every flow with `all`):
    /// idle flows and, with `all`, every flow are removed; flows past the active timeout
    /// restart their counts.
    fn expire_slot(&mut self, i: usize, now: u64, all: bool, out: &mut Vec<FlowRecord>) {
        let (f, r) = (self.flows[i], self.rest[i]);
        if !f.live {
            return;
        }
        let reason = if all {
            EndReason::Forced
        } else if now.saturating_sub(f.last_ns) >= self.idle_ns {
            EndReason::Idle
        } else if now.saturating_sub(r.since_ns) >= self.active_ns && f.packets > 0 {
            EndReason::Active
        } else {
            return;
        };
        let key = Packed::join(f.key, r.key);
        // A flow whose counts went out at its last active timeout ends without a record:
        // an empty one would say nothing.
        if f.packets > 0 {
            self.records += 1;
            out.push(FlowRecord {
                key: key.unpack(),
                first_ns: f.first_ns,
                last_ns: f.last_ns,
                packets: f.packets,
                bytes: f.bytes,
                tcp_flags: f.tcp_flags,
                out_port: (f.out_port != NO_PORT).then_some(f.out_port),
                denied: f.denied,
                reason,
                sampled: self.sampler.is_some(),
            });
        }
        if reason == EndReason::Active {
            // The next record starts at its first packet (see `count`).
            self.flows[i] = Flow {
                key: f.key,
                last_ns: f.last_ns,
                out_port: f.out_port,
                live: true,
                ..Flow::default()
            };
            self.rest[i].since_ns = now;
        } else {
            let hash = key.hash(&self.hasher);
            if let Ok((b, _)) = self.find(&key, hash) {
                self.remove_bucket(b);
            }
            self.flows[i].live = false;
            self.free.push(i as u32);
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn stats(&self) -> FlowStats {
        FlowStats {
            flows: self.len as u64,
            full_packets: self.overflow,
            full_bytes: self.overflow_bytes,
            records: self.records,
            lost_records: 0,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn probe(c: &FlowCache, k: &FlowKey) -> FlowProbe {
        c.probe_key(k, 0, 100)
    }

    #[test]
    fn keys_unpack_as_packed() {
        let k = FlowKey {
            in_port: 7,
            v6: true,
            src: u128::MAX - 5,
            dst: 1 << 100 | 9,
            proto: 6,
            sport: 65535,
            dport: 1,
            vni: Some(0),
        };
        assert_eq!(Packed::from_key(&k).unpack(), k);
        let none = FlowKey { vni: None, ..k };
        assert_eq!(Packed::from_key(&none).unpack(), none);
        let v4 = FlowKey {
            v6: false,
            src: 0xc000_0201,
            dst: 0xffff_fffe,
            ..k
        };
        assert_eq!(Packed::from_key(&v4).unpack(), v4);
        // The last differs from the first in a word IPv4 keys do not use.
        let low = FlowKey {
            dst: k.dst ^ 1,
            ..k
        };
        let mut c = FlowCache::new(4, u64::MAX, u64::MAX);
        for k in [k, none, v4, low, k] {
            c.count(&probe(&c, &k), 0, None, false);
        }
        assert_eq!(
            c.len(),
            4,
            "VNI, family and an address's low bits set flows apart"
        );
    }

    fn key(n: u16) -> FlowKey {
        FlowKey {
            in_port: n % 3,
            src: u128::from(n % 17),
            dst: u128::from(n / 17),
            proto: 17,
            sport: n,
            dport: 53,
            ..FlowKey::default()
        }
    }

    /// An Ethernet/IPv6 fragment (RFC 8200 §4.5) of datagram 7 from 2001:db8::1 to
    /// 2001:db8::2 at byte `offset` of its fragmentable part, which starts with a
    /// destination options header (so a later fragment's next header names it, not UDP).
    fn ipv6_fragment(offset: u16, more: bool, part: &[u8]) -> Vec<u8> {
        let mut f = vec![0; 14];
        f[12..14].copy_from_slice(&0x86ddu16.to_be_bytes());
        let mut ip = [0u8; 40];
        ip[0] = 0x60;
        ip[4..6].copy_from_slice(&(8 + part.len() as u16).to_be_bytes());
        ip[6] = ip_proto::IPV6_FRAGMENT;
        ip[7] = 64;
        ip[8..10].copy_from_slice(&[0x20, 0x01]);
        ip[10..12].copy_from_slice(&[0x0d, 0xb8]);
        ip[23] = 1;
        ip[24..28].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
        ip[39] = 2;
        f.extend(ip);
        f.extend([ip_proto::IPV6_DEST_OPTS, 0]);
        f.extend((offset | u16::from(more)).to_be_bytes());
        f.extend(7u32.to_be_bytes());
        f.extend(part);
        f
    }

    #[test]
    fn fragments_count_in_their_datagrams_flow() {
        let tunnels = parse::TunnelPorts::default();
        // Destination options (padding only), then UDP 5000 → 53 and 24 bytes of data.
        let mut datagram = vec![ip_proto::UDP, 0, 1, 4, 0, 0, 0, 0];
        datagram.extend([0x13, 0x88, 0, 53, 0, 32, 0, 0]);
        datagram.extend([0xab; 24]);
        let (first, rest) = datagram.split_at(24);
        let frames = [
            ipv6_fragment(0, true, first),
            ipv6_fragment(24, false, rest),
        ];
        let mut cache = FlowCache::new(16, u64::MAX, u64::MAX);
        for (i, frame) in frames.iter().enumerate() {
            let meta = parse::parse(frame, &tunnels).expect("parsed");
            assert!(meta.outer.fragment);
            let mut p = FlowProbe::default();
            assert!(cache.probe(frame, &meta, 1, &mut p));
            cache.probe_fragment(frame, &meta.outer, 10 + i as u64, &mut p);
            cache.count(&p, 10 + i as u64, None, false);
        }
        let mut records = Vec::new();
        cache.flush(20, &mut records);
        let [r] = records[..] else {
            panic!("one flow, not {records:?}")
        };
        let k = r.key;
        assert_eq!((k.sport, k.dport, k.proto), (5000, 53, ip_proto::UDP));
        assert_eq!(
            (r.packets, r.bytes),
            (2, 2 * (40 + 8) + datagram.len() as u64)
        );
    }

    /// A full cache keeps every flow it holds and counts the packets of the next one as
    /// overflow.
    #[test]
    fn a_full_cache_keeps_its_flows_and_counts_the_rest_as_overflow() {
        let n = 5000u16;
        let mut c = FlowCache::new(usize::from(n), u64::MAX, u64::MAX);
        for round in 0..2 {
            for i in 0..=n {
                c.count(&probe(&c, &key(i)), round, None, false);
            }
        }
        assert_eq!(c.len(), usize::from(n));
        assert_eq!((c.stats().full_packets, c.stats().full_bytes), (2, 200));
        let mut out = Vec::new();
        c.flush(0, &mut out);
        assert_eq!(out.len(), usize::from(n));
        assert!(out.iter().all(|r| r.packets == 2));
    }

    /// A flow reported at its active timeout starts its next record with the next packet:
    /// flowStart is that packet's time, not the last one's before the report.
    #[test]
    fn records_after_an_active_report_start_at_their_first_packet() {
        let second = 1_000_000_000;
        let mut c = FlowCache::new(16, 10 * second, 100 * second);
        let k = key(1);
        c.count(&probe(&c, &k), second, None, false);
        c.count(&probe(&c, &k), 2 * second, None, false);
        c.sweep(12 * second, usize::MAX);
        c.count(&probe(&c, &k), 30 * second, None, false);
        c.count(&probe(&c, &k), 31 * second, None, false);
        let mut out = Vec::new();
        c.flush(40 * second, &mut out);
        let times: Vec<(u64, u64, u64, EndReason)> = out
            .iter()
            .map(|r| (r.first_ns / second, r.last_ns / second, r.packets, r.reason))
            .collect();
        assert_eq!(
            times,
            [(1, 2, 2, EndReason::Active), (30, 31, 2, EndReason::Forced)]
        );
    }

    /// The sweep examines every flow once a second of packet time, a slice per call; when
    /// the records it keeps are full, due flows wait in the cache for the next pass.
    #[test]
    fn sweeps_are_paced_and_never_lose_records() {
        let second = 1_000_000_000;
        let mut c = FlowCache::new(1 << 20, u64::MAX, 5 * second);
        let n = RECORDS_KEPT as u16 + 3000;
        for i in 0..n {
            c.count(&probe(&c, &key(i)), second, Some(1), false);
        }
        c.sweep_due(2 * second, crate::sweep::MAX_SLOTS);
        assert_eq!(c.sweep_at, 0, "the first call only starts the clock");
        // A hundredth of a second: a hundredth of the flows.
        c.sweep_due(2 * second + second / 100, crate::sweep::MAX_SLOTS);
        assert_eq!(c.sweep_at, usize::from(n) / 100);
        assert_eq!(c.records_waiting(), 0, "nothing is due yet");
        // Long after the idle timeout, all are due; the sweep stops when its records fill.
        c.sweep(60 * second, usize::MAX);
        assert_eq!(c.records_waiting(), RECORDS_KEPT);
        assert_eq!(c.len(), usize::from(n) - RECORDS_KEPT);
        let mut out = Vec::new();
        c.take_records(&mut out);
        c.sweep(60 * second, usize::MAX);
        c.take_records(&mut out);
        assert_eq!(out.len(), usize::from(n));
        assert!(c.is_empty());
        assert!(out
            .iter()
            .all(|r| r.reason == EndReason::Idle && r.packets == 1));
    }

    proptest! {
        /// Counting a part's packets together gives the records counting them one by one
        /// gives: every flow's counts, times and last egress port, new flows and held
        /// ones mixed in a part, through a full cache.
        #[test]
        fn counting_a_part_is_counting_its_packets_in_turn(
            parts in proptest::collection::vec(
                proptest::collection::vec((0u16..12, any::<u16>(), 0u8..4), 1..32),
                1..8,
            )
        ) {
            let (mut together, mut in_turn) =
                (FlowCache::new(8, u64::MAX, u64::MAX), FlowCache::new(8, u64::MAX, u64::MAX));
            let mut now = 0;
            for part in parts {
                let probes = |c: &FlowCache| -> Vec<FlowProbe> {
                    part.iter().map(|&(n, len, _)| c.probe_key(&key(n), 0, len)).collect()
                };
                let fates: Vec<(u64, Option<u16>, bool)> = part
                    .iter()
                    .enumerate()
                    .map(|(i, &(_, _, f))| (now + i as u64, (f > 0).then_some(u16::from(f)), f == 0))
                    .collect();
                let staged = (1u32 << part.len()) - 1;
                together.count_staged(&probes(&together), staged, |i| fates[i]);
                for (probe, &(t, out, denied)) in probes(&in_turn).iter().zip(&fates) {
                    in_turn.count(probe, t, out, denied);
                }
                now += 100;
            }
            let (mut a, mut b) = (Vec::new(), Vec::new());
            together.flush(now, &mut a);
            in_turn.flush(now, &mut b);
            let order = |r: &FlowRecord| r.key.sport;
            a.sort_by_key(order);
            b.sort_by_key(order);
            prop_assert_eq!(a, b);
            prop_assert_eq!(together.stats(), in_turn.stats());
        }

        /// Counts, idle expiry and the capacity bound agree with a plain map, through
        /// removals that shift probe runs (a small table keeps runs long).
        #[test]
        fn cache_counts_like_a_map(ops in proptest::collection::vec((0u16..40, 0u8..10), 1..400)) {
            const IDLE: u64 = 50;
            let mut c = FlowCache::new(24, u64::MAX, IDLE);
            let mut model: HashMap<FlowKey, (u64, u64)> = HashMap::new();
            let mut out = Vec::new();
            for (now, (n, op)) in ops.into_iter().enumerate() {
                let now = now as u64 * 3;
                if op == 0 {
                    out.clear();
                    c.sweep(now, usize::MAX);
                    c.take_records(&mut out);
                    let idle: Vec<FlowKey> = model
                        .iter()
                        .filter(|(_, (_, last))| now - last >= IDLE)
                        .map(|(k, _)| *k)
                        .collect();
                    let mut got: Vec<(u16, u64)> = out.iter().map(|r| (r.key.sport, r.packets)).collect();
                    let mut want: Vec<(u16, u64)> = idle.iter().map(|k| (k.sport, model[k].0)).collect();
                    got.sort_unstable();
                    want.sort_unstable();
                    prop_assert_eq!(got, want);
                    for k in idle {
                        model.remove(&k);
                    }
                } else {
                    let k = key(n);
                    c.count(&probe(&c, &k), now, Some(1), false);
                    if let Some(e) = model.get_mut(&k) {
                        *e = (e.0 + 1, now);
                    } else if model.len() < 24 {
                        model.insert(k, (1, now));
                    }
                }
                prop_assert_eq!(c.len(), model.len());
            }
            out.clear();
            c.flush(u64::MAX, &mut out);
            let mut got: Vec<(u16, u64)> = out.iter().map(|r| (r.key.sport, r.packets)).collect();
            let mut want: Vec<(u16, u64)> = model.iter().map(|(k, (p, _))| (k.sport, *p)).collect();
            got.sort_unstable();
            want.sort_unstable();
            prop_assert_eq!(got, want);
        }
    }
}
