//! The software backend: a program compiled from the IR, run over batches of packets to
//! completion on one core.
//!
//! Per packet: parse once into [`parse::Meta`], walk the pipes from the input port's root
//! pipe (the IR guarantees the walk ends), look up each pipe's body, run the chosen entry's
//! actions, and record a [`Verdict`]. No allocation, lock or log line happens per packet:
//! counters are plain arrays indexed by port, pipe entry and drop reason.

mod action;
mod answer;
pub mod field;
pub mod icmp_error;
mod lpm;
mod meter;
pub mod packet;
pub mod parse;
pub mod pmtu;
pub mod prefetch;
mod reload;
pub mod table;

pub use action::EncapTemplate;
pub use answer::announcement;
pub use meter::Color;
pub use packet::{PacketBuf, DEFAULT_MAX_FRAME, HEADROOM};
pub use reload::Renumbering;

use crate::firewall::conntrack::{Conntrack, Lookup, Probe};
use crate::ir::{
    self, Action, ActionList, EntryActions, PipeBody, PipeId, PortId, ServiceId, Telemetry,
};
use crate::telemetry::flows::{FlowCache, FlowProbe, FlowRecord, FlowStats};
use crate::telemetry::sampling::Sampler;
use field::PacketState;
use lpm::LpmTable;
use meter::MeterState;
pub use meter::SharedMeter;
use parse::{Meta, TunnelPorts};
use std::sync::Arc;
use table::{ExactTable, LinearScan, PacketView, RuleClassifier, TREE_MIN_RULES};

reasons! {
    /// Why a packet was dropped. Every drop is counted under one of these.
    pub enum DropReason {
        NoPipe => "no_pipe", "the input port feeds no root pipe";
        Rule => "rule", "a `drop` action";
        MalformedL2 => "malformed_l2", "shorter than an Ethernet header, or a truncated VLAN tag";
        MalformedL3 => "malformed_l3", "a bad IPv4 or IPv6 header (version, length, extension headers)";
        MalformedL4 => "malformed_l4", "a truncated or bad TCP, UDP or ICMP header";
        TunnelMalformed => "tunnel_malformed", "a truncated or bad VXLAN or Geneve header, or inner frame";
        VxlanInvalid => "vxlan_invalid", "VXLAN without the I flag or with reserved bits set";
        GeneveCriticalOption => "geneve_critical_option", "a Geneve option marked critical that dpuflow does not know";
        GeneveOam => "geneve_oam", "a Geneve OAM frame, not data";
        EcnNotCapable => "ecn_not_ect", "decapsulated from an outer header marked Congestion Experienced, but not ECN-capable inside: the mark may be neither lost nor passed on (RFC 6040 §4.2)";
        Unanswerable => "unanswerable", "`arp.reply` of a frame that is not an ARP request for another host's address (a reply, an announcement, ARP not of IPv4 over Ethernet), `nd.advert` of one that is not a neighbour solicitation a node may take (RFC 4861 §7.1.1), or `echo.reply` of one that is not a whole echo request between unicast addresses";
        NotTunnelled => "not_tunnelled", "decapsulation of a packet that carries no such tunnel";
        TtlExpired => "ttl_expired", "TTL or hop limit reached zero; where the port it came in by has an address, its sender is sent an ICMP Time Exceeded (through the tunnel it came in, where the walk only took it out)";
        MeterRed => "meter_red", "a meter marked the packet red";
        MtuExceeded => "mtu_exceeded", "larger than the output port's MTU";
        PacketTooBig => "packet_too_big", "encapsulated, then larger than the output port's MTU: its sender was sent an ICMP Fragmentation Needed or ICMPv6 Packet Too Big with the MTU inside the tunnel";
        NoHeadroom => "no_headroom", "no room in front of the packet to add headers";
        Oversize => "oversize", "larger than the engine's packet buffers";
        CtFull => "ct_full", "a new connection found the connection table full";
        MirrorOverflow => "mirror_overflow", "a mirror copy found no free buffer in this batch";
        RingFull => "ring_full", "the live port's receive ring was full: the kernel dropped the frame before dpuflow saw it (not in the received counts)";
    }
}

/// What happened to a packet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Forward(PortId),
    Drop(DropReason),
    /// Handed to a local service's queue.
    Service(ServiceId),
    /// Dropped for this reason ([`DropReason::PacketTooBig`], [`DropReason::TtlExpired`]);
    /// the packet is now the ICMP error telling its sender so, sent out of this port, the
    /// one it came in by (see [`icmp_error`]).
    Told(PortId, DropReason),
}

impl Verdict {
    /// The port the packet leaves by, if it leaves.
    #[inline]
    pub fn sent_to(self) -> Option<PortId> {
        match self {
            Verdict::Forward(p) | Verdict::Told(p, _) => Some(p),
            Verdict::Drop(_) | Verdict::Service(_) => None,
        }
    }
}

/// Packet and byte counts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counter {
    pub packets: u64,
    pub bytes: u64,
}

impl Counter {
    #[inline]
    fn add(&mut self, bytes: usize) {
        self.packets += 1;
        self.bytes += bytes as u64;
    }
}

#[derive(Debug, Default, PartialEq, Eq)]
pub struct PortStats {
    pub rx: Counter,
    pub tx: Counter,
    /// Drops of packets received on this port, indexed by `DropReason as usize`.
    pub drops: Vec<u64>,
    /// Tunnelled packets received on this port whose outer header the fabric marked
    /// Congestion Experienced, decapsulated with the mark carried inside (RFC 6040 §4.2).
    pub congestion_marked: u64,
}

/// By hand for `clone_from`, which copies into the vectors already there: a worker
/// publishes its counts every 100 ms into the copy it published last, allocating nothing.
impl Clone for PortStats {
    fn clone(&self) -> Self {
        PortStats {
            rx: self.rx,
            tx: self.tx,
            drops: self.drops.clone(),
            congestion_marked: self.congestion_marked,
        }
    }

    fn clone_from(&mut self, source: &Self) {
        (self.rx, self.tx) = (source.rx, source.tx);
        self.drops.clone_from(&source.drops);
        self.congestion_marked = source.congestion_marked;
    }
}

impl PortStats {
    /// Counts `packets` frames (of `bytes` in all) too large for the packet buffers: received,
    /// and dropped before the engine.
    pub fn count_oversize(&mut self, packets: u64, bytes: u64) {
        self.rx.packets += packets;
        self.rx.bytes += bytes;
        self.drops[DropReason::Oversize as usize] += packets;
    }
}

/// Everything the engine counts.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Stats {
    pub ports: Vec<PortStats>,
    /// Per pipe: one counter per rule or table entry, then one for the default.
    pub entries: Vec<Vec<Counter>>,
    /// Per meter: green, yellow, red packets.
    pub meters: Vec<[u64; 3]>,
    pub services: Vec<Counter>,
}

/// By hand for `clone_from` (see [`PortStats`]'s).
impl Clone for Stats {
    fn clone(&self) -> Self {
        Stats {
            ports: self.ports.clone(),
            entries: self.entries.clone(),
            meters: self.meters.clone(),
            services: self.services.clone(),
        }
    }

    fn clone_from(&mut self, source: &Self) {
        self.ports.clone_from(&source.ports);
        self.entries.clone_from(&source.entries);
        self.meters.clone_from(&source.meters);
        self.services.clone_from(&source.services);
    }
}

/// Watches a packet's walk through the pipeline (`dpuflow trace`). The engine is generic
/// over it, so the default no-op observer costs nothing.
pub trait Observer {
    /// A packet is about to enter the pipeline.
    fn begin(&mut self, _pkt: &PacketBuf) {}
    fn pipe(&mut self, _pipe: PipeId) {}
    /// The entry that matched, or `None` for the pipe's default.
    fn entry(&mut self, _pipe: PipeId, _entry: Option<usize>) {}
    /// An action ran (index into the entry's action list).
    fn action(&mut self, _pipe: PipeId, _entry: Option<usize>, _index: usize) {}
    /// Connection tracking looked the packet up in `zone`.
    fn conntrack(&mut self, _zone: u16, _lookup: &Lookup) {}
    /// The packet's fate, with the packet as it leaves.
    fn verdict(&mut self, _v: Verdict, _pkt: &PacketBuf) {}
}

/// Observes nothing.
#[derive(Debug, Default, Clone, Copy)]
pub struct NoObserver;

impl Observer for NoObserver {}

#[derive(Debug)]
enum Body {
    /// Rules too few for trees, scanned in order: inlined where the packet runs, where a
    /// call cost more than a short scan's work (see docs/benchmarks.md).
    Scan(LinearScan),
    /// Rules in decision trees.
    Rules(Box<dyn RuleClassifier>),
    Exact(ExactTable),
    Lpm(LpmTable),
}

/// An action as the engine runs it: the IR's, with encapsulations prebuilt.
#[derive(Debug, Clone)]
enum Op {
    Ir(Action),
    Encap(usize),
    /// An encapsulation of a packet the walk only took out of the tunnel it came in:
    /// that tunnel's headers are kept first, so a packet the new tunnel makes too big
    /// is answered through the tunnel its sender used.
    Retunnel(usize),
}

#[derive(Debug)]
struct CompiledPipe {
    body: Body,
    /// Each entry's action list, as an index into `lists`.
    entry_list: Vec<u32>,
    /// The distinct action lists of the entries, each kept once: a table of a million
    /// entries that all `fwd` the same way holds one list, not a million allocations a
    /// lookup must each load from memory.
    lists: Vec<Box<[Op]>>,
    miss: Box<[Op]>,
    /// Its lookup reads `ct.state`, so the packet goes through conntrack first.
    reads_ct: bool,
}

/// Engine settings.
#[derive(Debug, Clone)]
pub struct Config {
    /// Largest frame accepted.
    pub max_frame: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            max_frame: DEFAULT_MAX_FRAME,
        }
    }
}

/// Mirror copies one batch may make.
const MIRROR_POOL: usize = 256;

/// Buffers for the copies `mirror` actions make.
fn mirror_pool() -> Vec<PacketBuf> {
    (0..MIRROR_POOL)
        .map(|_| PacketBuf::new(DEFAULT_MAX_FRAME))
        .collect()
}

/// Packets parsed ahead and run as one part: a larger batch is processed in parts this
/// size. Larger parts put more table lines in flight than the core keeps, and lines
/// prefetched for the first packets are evicted before they run (a million tracked
/// connections: 8.9 Mpps in parts of 32, 6.4 in parts of 256), while callers that hand
/// over larger batches save their own per-batch costs (the service's channels).
pub const STAGE: usize = 32;
// A part's packets are a bit each in a u32 (the packets the flow cache counts).
const _: () = assert!(STAGE <= 32);

/// One worker's engine: a compiled program, which engines may share, and its own state.
#[derive(Debug)]
pub struct Engine {
    /// Parse results of the current batch, when it is staged: the layers, valid where
    /// `parsed` says so (kept apart so a parse writes straight into its slot).
    metas: Box<[Meta; STAGE]>,
    parsed: Box<[Result<(), DropReason>; STAGE]>,
    /// Connection hashes of the current batch, when it is staged.
    ct_hints: Box<[Option<Probe>; STAGE]>,
    /// The probes of the staged packets the flow cache counts (those no connection counts),
    /// by packet.
    flow_probes: Box<[FlowProbe; STAGE]>,
    /// Each staged packet's entry in its root pipe, when classified with the batch.
    root_entries: Box<[Option<Option<usize>>; STAGE]>,
    code: Arc<Compiled>,
    rt: Runtime,
}

/// A program compiled for the engine: pipes, their tables and action lists, encapsulation
/// templates. Nothing in it changes while packets run, so the workers of a service share
/// one: a large table is built once and held once, not once per worker.
#[derive(Debug)]
pub struct Compiled {
    pipes: Vec<CompiledPipe>,
    roots: Vec<Option<PipeId>>,
    /// Root pipes on rule trees or large exact or LPM tables whose lookup reads nothing the
    /// pipeline sets (`ct.state`): the keys of a part's packets are looked up together.
    batch_roots: Vec<PipeId>,
    /// The state a packet arriving on each port starts with.
    port_states: Box<[PacketState]>,
    encaps: Vec<EncapTemplate>,
    tunnels: TunnelPorts,
    /// Each port's own addresses, which the Time Exceeded it sends come from.
    addresses: icmp_error::PortAddresses,
    /// What each engine's own state starts from.
    fresh: Fresh,
}

/// The program's settings an engine's [`Runtime`] is made from.
#[derive(Debug)]
struct Fresh {
    mtus: Vec<u16>,
    meters: Vec<MeterState>,
    /// Zeroed counters of the right shape.
    stats: Stats,
    /// Some action mirrors (the engine keeps buffers for the copies).
    mirrors: bool,
    /// Connection table capacity and timeouts, when the program tracks connections.
    conntrack: Option<ir::Conntrack>,
}

/// The mutable state actions touch.
#[derive(Debug)]
struct Runtime {
    mtus: Vec<u16>,
    meters: Vec<MeterState>,
    stats: Stats,
    /// Copies made by `mirror` in the current batch; the first `mirrored` are valid.
    mirrors: Vec<PacketBuf>,
    mirrored: usize,
    ct: Option<Conntrack>,
    /// Flow cache for IPFIX, when enabled.
    flows: Option<FlowCache>,
    /// What sending ICMP errors about dropped packets takes.
    errors: Box<icmp_error::Errors>,
}

impl Compiled {
    /// Buckets for each of the program's meters, full, for engines that share them
    /// ([`Engine::share_meters`]).
    pub fn shared_meters(&self) -> Vec<Arc<SharedMeter>> {
        self.fresh
            .meters
            .iter()
            .map(|m| Arc::new(m.shared()))
            .collect()
    }

    /// The UDP ports whose packets the engine parses as tunnelled.
    pub fn tunnels(&self) -> &TunnelPorts {
        &self.tunnels
    }

    pub fn new(p: &ir::Program) -> Compiled {
        let mut encaps = Vec::new();
        let mut tunnels = TunnelPorts::default();
        // What each pipe's walks did to the packet before it.
        let arrivals = p.arrivals();
        let mut compile_list = |list: &ActionList, entered: ir::Arrival| -> Box<[Op]> {
            let mut state = entered;
            list.0
                .iter()
                .map(|a| {
                    let op = match a {
                        Action::Encap(e) => {
                            tunnels.add(e.udp_dst, e.tunnel);
                            encaps.push(EncapTemplate::new(e));
                            match state {
                                ir::Arrival::Decapsulated => Op::Retunnel(encaps.len() - 1),
                                _ => Op::Encap(encaps.len() - 1),
                            }
                        }
                        other => Op::Ir(other.clone()),
                    };
                    state = state.after(a);
                    op
                })
                .collect()
        };
        let mut pipes = Vec::new();
        for (pipe, &entered) in p.pipes.iter().zip(&arrivals) {
            // Rules' lists are found among the distinct ones here; tables come with theirs.
            let rule_actions: EntryActions;
            let (body, actions) = match &pipe.body {
                PipeBody::Rules(rules) => {
                    rule_actions = rules.iter().map(|r| r.actions.clone()).collect();
                    let body = match (rules.len() >= TREE_MIN_RULES)
                        .then(|| table::rule_trees(rules))
                        .flatten()
                    {
                        Some(c) => Body::Rules(c),
                        None => Body::Scan(LinearScan::new(rules)),
                    };
                    (body, &rule_actions)
                }
                PipeBody::Exact {
                    fields,
                    keys,
                    actions,
                } => (
                    Body::Exact(ExactTable::new(fields, keys.chunks_exact(fields.len()))),
                    actions,
                ),
                PipeBody::Lpm {
                    field,
                    prefixes,
                    actions,
                } => (
                    Body::Lpm(LpmTable::new(
                        *field,
                        prefixes.iter().map(|p| (p.value, p.len)),
                    )),
                    actions,
                ),
            };
            let miss = compile_list(&pipe.miss, entered);
            let reads_ct = match &pipe.body {
                PipeBody::Rules(rules) => rules
                    .iter()
                    .flat_map(|r| &r.matches)
                    .any(|m| m.field.id == ir::FieldId::CtState),
                PipeBody::Exact { fields, .. } => {
                    fields.iter().any(|f| f.id == ir::FieldId::CtState)
                }
                PipeBody::Lpm { .. } => false,
            };
            let lists = (actions.distinct().iter())
                .map(|l| compile_list(l, entered))
                .collect();
            pipes.push(CompiledPipe {
                body,
                entry_list: actions.indices().to_vec(),
                lists,
                miss,
                reads_ct,
            });
        }

        let stats = Stats {
            ports: p
                .ports
                .iter()
                .map(|_| PortStats {
                    drops: vec![0; DropReason::COUNT],
                    ..PortStats::default()
                })
                .collect(),
            entries: p
                .pipes
                .iter()
                .map(|pp| vec![Counter::default(); pp.body.len() + 1])
                .collect(),
            meters: vec![[0; 3]; p.meters.len()],
            services: vec![Counter::default(); p.services.len()],
        };
        let mirrors = p.pipes.iter().any(|pp| {
            pp.body
                .action_lists()
                .chain([&pp.miss])
                .any(|l| l.0.iter().any(|a| matches!(a, Action::Mirror(_))))
        });
        let roots: Vec<Option<PipeId>> = (0..p.ports.len())
            .map(|i| p.root_of(PortId(i as u16)))
            .collect();
        let mut batch_roots: Vec<PipeId> = roots
            .iter()
            .flatten()
            .copied()
            .filter(|r| {
                let cp = &pipes[r.index()];
                let batches = match &cp.body {
                    Body::Rules(c) => c.batches(),
                    Body::Scan(_) => false,
                    Body::Exact(t) => t.batches(),
                    Body::Lpm(t) => t.batches(),
                };
                batches && !cp.reads_ct
            })
            .collect();
        batch_roots.sort_unstable_by_key(|r| r.index());
        batch_roots.dedup();
        Compiled {
            pipes,
            roots,
            batch_roots,
            port_states: (0..p.ports.len())
                .map(|i| PacketState {
                    in_port: i as u16,
                    ..PacketState::default()
                })
                .collect(),
            encaps,
            tunnels,
            addresses: p.ports.iter().map(|port| (port.ipv4, port.ipv6)).collect(),
            fresh: Fresh {
                mtus: p.ports.iter().map(|port| port.mtu).collect(),
                meters: p.meters.iter().map(MeterState::new).collect(),
                stats,
                mirrors,
                conntrack: p.conntrack.clone(),
            },
        }
    }
}

impl Engine {
    /// An engine for `p`, compiled for it alone.
    pub fn new(p: &ir::Program) -> Engine {
        Engine::sharing(Arc::new(Compiled::new(p)))
    }

    /// An engine running compiled code other engines may run too, with state of its own
    /// (counters, meters, connections, flows).
    pub fn sharing(code: Arc<Compiled>) -> Engine {
        let f = &code.fresh;
        let rt = Runtime {
            mtus: f.mtus.clone(),
            meters: f.meters.clone(),
            stats: f.stats.clone(),
            mirrors: if f.mirrors { mirror_pool() } else { Vec::new() },
            mirrored: 0,
            errors: Box::new(icmp_error::Errors::new(
                code.tunnels.clone(),
                code.addresses.clone(),
            )),
            ct: f.conntrack.as_ref().map(|c| {
                let capacity = usize::try_from(c.capacity).unwrap_or(usize::MAX);
                let mut ct = Conntrack::new(capacity, c.timeouts.clone());
                if c.tcp_window {
                    ct.track_windows();
                }
                if !c.tcp_loose {
                    ct.open_by_syn_only();
                }
                if c.checksum {
                    ct.verify_checksums();
                }
                ct
            }),
            flows: None,
        };
        Engine {
            metas: Box::new([Meta::default(); STAGE]),
            parsed: Box::new([Err(DropReason::NoPipe); STAGE]),
            ct_hints: Box::new([None; STAGE]),
            flow_probes: Box::new([FlowProbe::default(); STAGE]),
            root_entries: Box::new([None; STAGE]),
            code,
            rt,
        }
    }

    pub fn stats(&self) -> &Stats {
        &self.rt.stats
    }

    /// Makes this engine one of `workers` that meter against the same buckets, `shared`
    /// (from [`Compiled::shared_meters`]): each meter then holds its rate over all their
    /// packets, not over each engine's.
    pub fn share_meters(&mut self, shared: &[Arc<SharedMeter>], workers: usize) {
        for (m, s) in self.rt.meters.iter_mut().zip(shared) {
            m.lease_from(Arc::clone(s), workers);
        }
    }

    /// Keeps flow records of every packet, for IPFIX export: in the connection that
    /// counts the packet where the pipeline tracks connections (the lookup is made anyway),
    /// else in a flow cache. Connections note ports in a byte each, so a pipeline of more
    /// than 255 ports keeps all its flows in the cache.
    ///
    /// The cache holds `t.flow_cache` flows and counts one packet in `t.sampling`, chosen
    /// at random (connections count all theirs).
    pub fn enable_flows(&mut self, t: &Telemetry) {
        let ns = |d: std::time::Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let (active, idle) = (ns(t.active_timeout), ns(t.idle_timeout));
        let capacity = usize::try_from(t.flow_cache).unwrap_or(usize::MAX);
        let sampler = Sampler::seeded_randomly(t.sampling);
        let cache = FlowCache::new(capacity, active, idle).sampling(sampler);
        self.rt.flows = Some(cache);
        if let Some(ct) = self.rt.ct.as_mut().filter(|_| self.rt.mtus.len() <= 255) {
            ct.enable_export(active);
        }
    }

    /// Flow records made (as timeouts came due, paced by packet time) and not yet taken.
    pub fn flow_records_waiting(&self) -> usize {
        self.rt.flows.as_ref().map_or(0, FlowCache::records_waiting)
            + self.rt.ct.as_ref().map_or(0, Conntrack::records_waiting)
    }

    /// Moves the flow records made so far to `out`.
    pub fn take_flow_records(&mut self, out: &mut Vec<FlowRecord>) {
        if let Some(f) = &mut self.rt.flows {
            f.take_records(out);
        }
        if let Some(ct) = &mut self.rt.ct {
            ct.take_records(out);
        }
    }

    /// Ends every flow at `now` (at shutdown): moves all records to `out`.
    pub fn flush_flows(&mut self, now: u64, out: &mut Vec<FlowRecord>) {
        if let Some(f) = &mut self.rt.flows {
            f.flush(now, out);
        }
        if let Some(ct) = &mut self.rt.ct {
            ct.take_records(out);
            ct.report_all(now, out);
        }
    }

    /// The flow records' counts, when flows are kept.
    pub fn flow_stats(&self) -> Option<FlowStats> {
        let mut s = self.rt.flows.as_ref().map(FlowCache::stats)?;
        if let Some(r) = self.rt.ct.as_ref().and_then(Conntrack::record_stats) {
            s.records += r.made;
            s.lost_records += r.dropped;
        }
        Some(s)
    }

    /// The connection table, when the pipeline tracks connections.
    pub fn conntrack(&self) -> Option<&Conntrack> {
        self.rt.ct.as_ref()
    }

    /// The copies `mirror` actions made during the last [`Engine::process`]; each has a
    /// `Forward` verdict to its mirror port.
    pub fn mirrors(&self) -> &[PacketBuf] {
        &self.rt.mirrors[..self.rt.mirrored]
    }

    /// Runs every packet of the batch through the pipeline and sets its verdict.
    pub fn process<O: Observer>(&mut self, batch: &mut [PacketBuf], obs: &mut O) {
        self.rt.mirrored = 0;
        for part in batch.chunks_mut(STAGE) {
            self.process_part(part, obs);
        }
    }

    /// Parses a part's packets into their slots and makes each one's lookups ahead: its
    /// connection's slot, and the flow cache's probe of the packets it counts (those no
    /// connection counts; with sampling, those selected); which are staged, as bits.
    #[inline(always)]
    fn stage(&mut self, batch: &[PacketBuf]) -> u32 {
        let mut flow_staged = 0u32;
        for (i, pkt) in batch.iter().enumerate() {
            let frame = pkt.data();
            self.parsed[i] = parse::parse_into(frame, &self.code.tunnels, &mut self.metas[i]);
            let meta = staged_meta(&self.metas, &self.parsed, i).ok();
            let mut reports = false;
            if let Some(ct) = &mut self.rt.ct {
                let hint = &mut self.ct_hints[i];
                match meta {
                    Some(m) => ct.prefetch(frame, m, pkt.port.0, pkt.ts_ns, hint),
                    None => *hint = None,
                }
                reports = hint.as_ref().is_some_and(Probe::reports);
            }
            if let (Some(flows), Some(m)) = (&mut self.rt.flows, meta) {
                // A packet a connection will count needs no flow-cache key (and in the
                // rare case none does, conntrack's probe gives it).
                if !reports
                    && flows.selects()
                    && flows.probe(frame, m, pkt.port.0, &mut self.flow_probes[i])
                {
                    flow_staged |= 1 << i;
                }
                if m.outer.fragment && !reports {
                    flows.probe_fragment(frame, &m.outer, pkt.ts_ns, &mut self.flow_probes[i]);
                }
            }
        }
        flow_staged
    }

    /// [`Engine::stage`] for a flow cache that samples, with no connection tracking: the
    /// packets it counts, `picked` for the whole part at once, are probed after the parse,
    /// so the others cost it nothing.
    #[inline(always)]
    fn stage_sampled(&mut self, batch: &[PacketBuf], picked: u32) -> u32 {
        for (i, pkt) in batch.iter().enumerate() {
            self.parsed[i] = parse::parse_into(pkt.data(), &self.code.tunnels, &mut self.metas[i]);
        }
        let Some(flows) = &mut self.rt.flows else {
            return 0;
        };
        let mut staged = 0u32;
        // Every fragment, counted or not, notes its first one's ports for the later ones.
        for (i, pkt) in batch.iter().enumerate() {
            if let Some(m) = staged_meta(&self.metas, &self.parsed, i)
                .ok()
                .filter(|m| m.outer.fragment)
            {
                flows.probe_fragment(pkt.data(), &m.outer, pkt.ts_ns, &mut self.flow_probes[i]);
            }
        }
        for i in staged_packets(picked) {
            let (pkt, probe) = (&batch[i], &mut self.flow_probes[i]);
            let Ok(m) = staged_meta(&self.metas, &self.parsed, i) else {
                continue;
            };
            if flows.probe(pkt.data(), m, pkt.port.0, probe) {
                if m.outer.fragment {
                    flows.probe_fragment(pkt.data(), &m.outer, pkt.ts_ns, probe);
                }
                staged |= 1 << i;
            }
        }
        staged
    }

    /// [`Engine::process`] for at most [`STAGE`] packets. The whole part is parsed
    /// first, each packet's connection slot and flow prefetched (so the tables' cache
    /// misses overlap instead of queueing) and batched root pipes looked up for all their
    /// packets at once; each packet's parse result is read long after it was
    /// written (a copy straight after the write stalls on store forwarding). Then the
    /// packets run, and their flows are counted.
    fn process_part<O: Observer>(&mut self, batch: &mut [PacketBuf], obs: &mut O) {
        // At most STAGE packets (the caller's chunks), said so the compiler knows every
        // packet's index is within the staging arrays and checks none.
        debug_assert!(batch.len() <= STAGE);
        let n = batch.len().min(STAGE);
        let batch = &mut batch[..n];
        let sampled_picks = match (&mut self.rt.flows, &self.rt.ct) {
            (Some(flows), None) => flows.samples_of(n),
            _ => None,
        };
        let mut flow_staged = match sampled_picks {
            Some(picked) => self.stage_sampled(batch, picked),
            None => self.stage(batch),
        };
        if let Some(ct) = &self.rt.ct {
            for probe in self.ct_hints[..batch.len()].iter().flatten() {
                ct.prefetch_slot(probe);
            }
        }
        self.classify_roots(batch);
        if let Some(flows) = self.rt.flows.as_ref().filter(|f| f.prefetches()) {
            for i in staged_packets(flow_staged) {
                flows.prefetch_flow(&self.flow_probes[i]);
            }
        }
        for (i, pkt) in batch.iter_mut().enumerate() {
            obs.begin(pkt);
            let v = self.run(pkt, i, obs);
            let port = pkt.port.index();
            match v {
                Verdict::Forward(out) => self.rt.stats.ports[out.index()].tx.add(pkt.len()),
                Verdict::Drop(r) => self.rt.stats.ports[port].drops[r as usize] += 1,
                Verdict::Told(back, r) => {
                    let ports = &mut self.rt.stats.ports;
                    ports[port].drops[r as usize] += 1;
                    ports[back.index()].tx.add(pkt.len());
                }
                Verdict::Service(s) => self.rt.stats.services[s.index()].add(pkt.len()),
            }
            pkt.verdict = v;
            obs.verdict(v, pkt);
            // A packet a connection counted for the flow records is not the flow cache's;
            // one expected to be, but that no connection took, is.
            if let (Some(ct), Some(flows)) = (&mut self.rt.ct, &mut self.rt.flows) {
                if !ct.note_fate(|| fate(v)) {
                    let hint = self.ct_hints[i].as_ref().filter(|h| h.reports());
                    if let Some(h) = hint.filter(|_| flows.selects()) {
                        let (key, tcp_flags) = h.arrival_flow();
                        let ip_bytes = staged_meta(&self.metas, &self.parsed, i)
                            .map_or(0, |m| m.outer.l3_end - m.outer.l3);
                        self.flow_probes[i] = flows.probe_key(&key, tcp_flags, ip_bytes);
                        flow_staged |= 1 << i;
                    }
                }
            }
        }
        // Flows are counted once the batch's fates are known, in one tight pass over what
        // each packet's probe noted as it arrived.
        if let Some(flows) = &mut self.rt.flows {
            flows.count_staged(&self.flow_probes[..], flow_staged, |i| {
                let pkt = &batch[i];
                let (out, denied) = fate(pkt.verdict);
                (pkt.ts_ns, out, denied)
            });
        }
        if let Some(last) = batch.last() {
            self.sweep(last.ts_ns, crate::sweep::MAX_SLOTS);
        }
        // What was kept of the part's packets is theirs alone.
        self.rt.errors.forget_arrival();
    }

    /// Time is `now` (in the packets' clock) though no packet came: what timed out in the
    /// connection table and the flow cache ends, as after a batch. A live service calls
    /// this while its ports are quiet; with no batch to hold up, the sweep is not capped.
    pub fn advance(&mut self, now: u64) {
        self.sweep(now, usize::MAX);
    }

    /// Sweeps the connection table and the flow cache as far as their pace says at `now`,
    /// `most` slots of each at most.
    fn sweep(&mut self, now: u64, most: usize) {
        if let Some(ct) = &mut self.rt.ct {
            ct.sweep_due(now, most);
        }
        if let Some(flows) = &mut self.rt.flows {
            flows.sweep_due(now, most);
        }
    }

    /// Classifies the staged packets of each root pipe in `batch_roots` together, their
    /// keys taken as they arrived (the state a root pipe sees), into `root_entries`.
    fn classify_roots(&mut self, batch: &[PacketBuf]) {
        // Entries are only ever set here (and cleared by a reload): with no batched root
        // there is nothing to clear.
        if self.code.batch_roots.is_empty() {
            return;
        }
        self.root_entries[..batch.len()].fill(None);
        for &root in &self.code.batch_roots {
            let cp = &self.code.pipes[root.index()];
            let counters = &self.rt.stats.entries[root.index()];
            let view = |i: usize| {
                let pkt = &batch[i];
                staged_meta(&self.metas, &self.parsed, i)
                    .ok()
                    .map(|meta| PacketView {
                        frame: pkt.data(),
                        meta,
                        state: &self.code.port_states[pkt.port.index()],
                    })
            };
            let mut waiting = batch
                .iter()
                .enumerate()
                .filter(|(_, pkt)| self.code.roots[pkt.port.index()] == Some(root))
                .filter_map(|(i, _)| view(i).map(|v| (i, v)));
            let Some((i, first)) = waiting.next() else {
                continue;
            };
            // A part holds at most STAGE packets.
            let (mut idx, mut views, mut found) = ([i; STAGE], [first; STAGE], [None; STAGE]);
            let mut n = 1;
            for (i, view) in waiting {
                (idx[n], views[n]) = (i, view);
                n += 1;
            }
            match &cp.body {
                Body::Scan(c) => c.classify_batch(&views[..n], &mut found[..n]),
                Body::Rules(c) => c.classify_batch(&views[..n], &mut found[..n]),
                Body::Exact(t) => t.lookup_batch(&views[..n], &mut found[..n]),
                Body::Lpm(t) => t.lookup_batch(&views[..n], &mut found[..n]),
            }
            for (&i, &e) in idx[..n].iter().zip(&found[..n]) {
                self.root_entries[i] = Some(e);
                // The entry's counter and action list are read when the packet runs.
                if let Some(e) = e {
                    prefetch::prefetch(&counters[e]);
                    prefetch::prefetch(&cp.entry_list[e]);
                }
            }
        }
    }

    /// Counts a packet that never reached the engine (too large for its buffers).
    pub fn count_oversize(&mut self, port: PortId, len: usize) {
        self.rt.stats.ports[port.index()].count_oversize(1, len as u64);
    }

    fn run<O: Observer>(&mut self, pkt: &mut PacketBuf, staged_at: usize, obs: &mut O) -> Verdict {
        let code = &*self.code;
        self.rt.stats.ports[pkt.port.index()].rx.add(pkt.len());
        let Some(mut pipe) = code.roots[pkt.port.index()] else {
            return Verdict::Drop(DropReason::NoPipe);
        };
        let mut meta = match staged_meta(&self.metas, &self.parsed, staged_at) {
            Ok(m) => *m,
            Err(r) => return Verdict::Drop(r),
        };
        let mut ct_hint = self.ct_hints[staged_at].as_ref();
        // The root pipe's entry, when the batch was classified together.
        let mut root_entry = self.root_entries[staged_at];
        let mut state = code.port_states[pkt.port.index()];
        // The packet's conntrack lookup, done when first needed.
        let mut ct: Option<CtLookup> = None;
        // The pipe graph is acyclic, so a walk visits each pipe at most once.
        for _ in 0..code.pipes.len() {
            obs.pipe(pipe);
            let cp = &code.pipes[pipe.index()];
            if cp.reads_ct && ct.is_none() {
                if let Some(table) = &mut self.rt.ct {
                    let l = table.lookup(pkt.data(), &meta, 0, pkt.ts_ns, ct_hint);
                    state.ct_state = l.state.bit();
                    obs.conntrack(0, &l);
                    ct = Some(CtLookup {
                        zone: 0,
                        current: true,
                        result: l,
                    });
                }
            }
            let view = PacketView {
                frame: pkt.data(),
                meta: &meta,
                state: &state,
            };
            let entry = match (root_entry.take(), &cp.body) {
                (Some(e), _) => e,
                (None, Body::Scan(s)) => s.classify(&view),
                (None, Body::Rules(c)) => c.classify(&view),
                (None, Body::Exact(t)) => t.lookup(&view),
                (None, Body::Lpm(t)) => t.lookup(&view),
            };
            obs.entry(pipe, entry);
            let counter = entry.unwrap_or(cp.entry_list.len());
            self.rt.stats.entries[pipe.index()][counter].add(pkt.len());
            let ops = match entry {
                Some(i) => &cp.lists[cp.entry_list[i] as usize],
                None => &cp.miss,
            };
            let mut stale = false;
            for (i, op) in ops.iter().enumerate() {
                obs.action(pipe, entry, i);
                if stale && needs_meta(op) {
                    meta = match parse::parse(pkt.data(), &code.tunnels) {
                        Ok(m) => m,
                        Err(r) => return Verdict::Drop(r),
                    };
                    stale = false;
                }
                // A commit looks the packet up unless the lookup it has is of its zone.
                let commit_looks_up = matches!(op, Op::Ir(Action::CtCommit { zone })
                    if !matches!(&ct, Some(c) if c.zone == *zone && c.current));
                let step = match op {
                    Op::Encap(t) => {
                        stale = true;
                        encapsulate(&code.encaps[*t], pkt, &meta)
                    }
                    Op::Retunnel(t) => {
                        self.rt.errors.keep_arrival(pkt, &self.metas[staged_at]);
                        stale = true;
                        encapsulate(&code.encaps[*t], pkt, &meta)
                    }
                    Op::Ir(a) => exec(
                        a,
                        pkt,
                        &mut meta,
                        &mut state,
                        (&mut ct, ct_hint),
                        &mut stale,
                        &mut self.rt,
                    ),
                };
                if commit_looks_up {
                    if let Some(c) = &ct {
                        obs.conntrack(c.zone, &c.result);
                    }
                }
                // The precomputed conntrack probe describes the packet as it arrived, and a
                // lookup the packet as it was then: `ct.state` keeps its answer, but a
                // commit after the tuple changed (decapsulated, rewritten) looks again.
                if !keeps_tuple(op) {
                    ct_hint = None;
                    if let Some(c) = &mut ct {
                        c.current = false;
                    }
                }
                match step {
                    Err(r) => return Verdict::Drop(r),
                    Ok(None) => {}
                    Ok(Some(Next::Done(v))) => return v,
                    Ok(Some(Next::Goto(p))) => {
                        pipe = p;
                        if stale {
                            meta = match parse::parse(pkt.data(), &code.tunnels) {
                                Ok(m) => m,
                                Err(r) => return Verdict::Drop(r),
                            };
                        }
                        break;
                    }
                }
            }
        }
        unreachable!(
            "validated pipelines are acyclic and every action list ends in a terminal action"
        )
    }
}

/// The parse of staged packet `i` (see [`Engine::metas`]).
#[inline(always)]
fn staged_meta<'a>(
    metas: &'a [Meta; STAGE],
    parsed: &[Result<(), DropReason>; STAGE],
    i: usize,
) -> Result<&'a Meta, DropReason> {
    parsed[i].map(|()| &metas[i])
}

/// A packet's conntrack lookup, kept for its walk.
struct CtLookup {
    zone: u16,
    /// Of the packet as it is now: no action since changed the addresses, protocol or
    /// ports it was keyed on.
    current: bool,
    result: Lookup,
}

enum Next {
    Goto(PipeId),
    Done(Verdict),
}

/// The packets whose bits are set in `staged`, in order.
pub(crate) fn staged_packets(mut staged: u32) -> impl Iterator<Item = usize> {
    std::iter::from_fn(move || {
        let i = staged.trailing_zeros() as usize;
        staged &= staged.wrapping_sub(1);
        (i < 32).then_some(i)
    })
}

/// What a flow record notes of a verdict: the egress port, and whether it was a drop.
fn fate(v: Verdict) -> (Option<u16>, bool) {
    match v {
        Verdict::Forward(p) => (Some(p.0), false),
        Verdict::Drop(_) | Verdict::Told(..) => (None, true),
        Verdict::Service(_) => (None, false),
    }
}

/// Puts `pkt`, parsed as `meta`, in the tunnel `e` makes.
#[inline(always)]
fn encapsulate(
    e: &EncapTemplate,
    pkt: &mut PacketBuf,
    meta: &Meta,
) -> Result<Option<Next>, DropReason> {
    let frame = pkt.data();
    let hash = parse::flow_hash(frame, &meta.outer);
    let ds = parse::ds_field(frame, &meta.outer);
    e.apply(pkt, hash, ds).map(|()| None)
}

/// Whether an op leaves the addresses, protocol and ports conntrack keys on unchanged.
fn keeps_tuple(op: &Op) -> bool {
    matches!(op, Op::Ir(a) if a.keeps_packet())
}

/// Whether an op reads header offsets (and so needs fresh metadata after a rewrite). A
/// commit looks the connection up: after `vxlan.decap` in the same list it once took the
/// outer headers' protocol for the inner packet's.
fn needs_meta(op: &Op) -> bool {
    matches!(
        op,
        Op::Encap(_)
            | Op::Retunnel(_)
            | Op::Ir(
                Action::DecTtl { .. }
                    | Action::Set { .. }
                    | Action::ClampMss(_)
                    | Action::ClampMssToMtu
                    | Action::ArpReply(_)
                    | Action::NdAdvert { .. }
                    | Action::EchoReply
                    | Action::Decap(_)
                    | Action::CtCommit { .. }
            )
    )
}

#[inline]
fn exec(
    a: &Action,
    pkt: &mut PacketBuf,
    meta: &mut Meta,
    state: &mut PacketState,
    (ct, ct_hint): (&mut Option<CtLookup>, Option<&Probe>),
    stale: &mut bool,
    rt: &mut Runtime,
) -> Result<Option<Next>, DropReason> {
    match a {
        Action::Count => {}
        Action::CtCommit { zone } => {
            if let Some(table) = &mut rt.ct {
                if !matches!(ct, Some(c) if c.zone == *zone && c.current) {
                    let l = table.lookup(pkt.data(), meta, *zone, pkt.ts_ns, ct_hint);
                    state.ct_state = l.state.bit();
                    *ct = Some(CtLookup {
                        zone: *zone,
                        current: true,
                        result: l,
                    });
                }
                if let Some(pending) = ct.as_mut().and_then(|c| c.result.pending.take()) {
                    if !table.commit(&pending, pkt.ts_ns) {
                        return Err(DropReason::CtFull);
                    }
                }
            }
        }
        Action::Mirror(port) => match rt.mirrors.get_mut(rt.mirrored) {
            Some(copy) => {
                copy.load(pkt.data(), pkt.port, pkt.ts_ns);
                copy.verdict = Verdict::Forward(*port);
                rt.mirrored += 1;
                rt.stats.ports[port.index()].tx.add(pkt.len());
            }
            None => {
                rt.stats.ports[pkt.port.index()].drops[DropReason::MirrorOverflow as usize] += 1
            }
        },
        Action::Meter(m) => {
            let c = rt.meters[m.index()].mark(pkt.ts_ns, pkt.len());
            rt.stats.meters[m.index()][c as usize] += 1;
            if c == Color::Red {
                return Err(DropReason::MeterRed);
            }
        }
        Action::Set { field, value } => {
            if field.id == ir::FieldId::MetaMark {
                state.mark = *value as u32;
            } else {
                action::set_field(pkt.data_mut(), meta, *field, *value);
            }
        }
        Action::Mark(m) => state.mark = *m,
        Action::DecTtl { seen } => {
            if let Err(r) = action::dec_ttl(pkt.data_mut(), &meta.outer) {
                return match seen {
                    ir::Arrival::AsArrived => Ok(Some(Next::Done(rt.errors.time_exceeded(pkt)))),
                    ir::Arrival::Decapsulated => {
                        Ok(Some(Next::Done(rt.errors.time_exceeded_in_tunnel(pkt))))
                    }
                    ir::Arrival::Changed => Err(r),
                };
            }
        }
        Action::ClampMss(mss) => action::clamp_mss(pkt.data_mut(), &meta.outer, *mss),
        Action::ClampMssToMtu => state.clamp_mss_to_mtu |= action::carries_syn(pkt.data(), meta),
        Action::ArpReply(mac) => {
            answer::reply_arp(pkt.data_mut(), &meta.outer, *mac)?;
            *stale = true;
        }
        Action::NdAdvert { mac, router } => {
            answer::advertise(pkt, &meta.outer, *mac, *router)?;
            *stale = true;
        }
        Action::EchoReply => {
            answer::reply_echo(pkt.data_mut(), &meta.outer)?;
            *stale = true;
        }
        Action::VlanPush { vid, pcp } => {
            action::vlan_push(pkt, *vid, *pcp)?;
            *stale = true;
        }
        Action::VlanPop => {
            action::vlan_pop(pkt);
            *stale = true;
        }
        Action::Decap(t) => {
            if action::decap(pkt, meta, *t)? == action::OuterMark::Ce {
                rt.stats.ports[pkt.port.index()].congestion_marked += 1;
            }
            *stale = true;
        }
        Action::Encap(_) => unreachable!("compiled to Op::Encap"),
        Action::Fwd(port) => {
            if state.clamp_mss_to_mtu {
                clamp_mss_leaving(pkt, meta, *stale, state.in_port, *port, rt)?;
            }
            let mtu = rt.mtus[port.index()];
            let l3_len = pkt.len().saturating_sub(action::l3_offset(pkt.data()));
            if l3_len > usize::from(mtu) {
                return rt.errors.too_big(pkt, mtu).map(|v| Some(Next::Done(v)));
            }
            return Ok(Some(Next::Done(Verdict::Forward(*port))));
        }
        Action::Goto(p) => return Ok(Some(Next::Goto(*p))),
        Action::Drop => return Err(DropReason::Rule),
        Action::ToService(s) => return Ok(Some(Next::Done(Verdict::Service(*s)))),
    }
    Ok(None)
}

/// `clamp tcp.mss mtu` of a packet leaving by `out`, having come in by `in_port`. Out of
/// line: only the packets of rules that clamp come here, and inline its code cost every
/// packet a few instructions.
#[cold]
#[inline(never)]
fn clamp_mss_leaving(
    pkt: &mut PacketBuf,
    meta: &mut Meta,
    stale: bool,
    in_port: u16,
    out: PortId,
    rt: &Runtime,
) -> Result<(), DropReason> {
    if stale {
        *meta = parse::parse(pkt.data(), &rt.errors.tunnels)?;
    }
    let (mtu, back) = (rt.mtus[out.index()], rt.mtus[usize::from(in_port)]);
    action::clamp_mss_to_mtu(pkt, meta, mtu, back);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A publish copies the counts into the vectors of the last one, whatever their shape
    /// (a reload changes the pipes and their entries): the copy equals the counts.
    #[test]
    fn stats_copied_over_another_shape_equal_their_source() {
        let counter = |n| Counter {
            packets: n,
            bytes: 64 * n,
        };
        let port = PortStats {
            rx: counter(3),
            tx: counter(2),
            drops: vec![1, 0, 4],
            congestion_marked: 6,
        };
        let source = Stats {
            ports: vec![port.clone(), PortStats::default()],
            entries: vec![vec![counter(1), counter(5)], vec![counter(7)]],
            meters: vec![[1, 2, 3]],
            services: vec![counter(9)],
        };
        let mut last = Stats {
            ports: vec![PortStats::default(), port.clone(), port],
            entries: vec![vec![counter(0); 4]],
            meters: vec![],
            services: vec![counter(1); 2],
        };
        last.clone_from(&source);
        assert_eq!(last, source);
        let mut first = Stats::default();
        first.clone_from(&source);
        assert_eq!(first, source);
    }
}
