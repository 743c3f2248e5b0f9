//! The validated program both backends consume.
//!
//! Everything here has been resolved and checked by [`crate::lang`]: names are ids, values
//! are in range, every action list ends in exactly one terminal action, the pipe graph is
//! acyclic. Nothing here knows about syntax or source locations.

mod announce;
mod field;

pub use announce::Announcement;

pub(crate) use field::with_field_ids;
pub use field::{
    info as field_info, Field, FieldId, FieldInfo, ValueKind, CT_STATE_NAMES, FIELDS,
    TCP_FLAG_NAMES,
};

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

macro_rules! id_type {
    ($($name:ident),*) => {$(
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(pub u16);
        impl $name {
            pub fn index(self) -> usize {
                self.0 as usize
            }
        }
    )*};
}
id_type!(PortId, PipeId, MeterId, ServiceId);

#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    pub name: String,
    pub ports: Vec<Port>,
    pub pipes: Vec<Pipe>,
    pub meters: Vec<Meter>,
    pub services: Vec<Service>,
    pub conntrack: Option<Conntrack>,
    pub telemetry: Telemetry,
}

impl Program {
    pub fn port(&self, id: PortId) -> &Port {
        &self.ports[id.index()]
    }

    pub fn pipe(&self, id: PipeId) -> &Pipe {
        &self.pipes[id.index()]
    }

    /// Notes what the actions before each `dec ttl` did to every packet reaching it
    /// ([`Arrival`]): in its list, and before the `goto` in every pipe a walk to it
    /// passes. An ICMP error about a packet as it came can quote it and go back to where
    /// it came from; about one only taken out of its tunnel, back through that tunnel.
    pub fn note_arrivals(&mut self) {
        let entered = self.arrivals();
        for (pipe, entered) in self.pipes.iter_mut().zip(entered) {
            let Pipe { body, miss, .. } = pipe;
            for list in body.action_lists_mut().chain([miss]) {
                let mut state = entered;
                for a in &mut list.0 {
                    if let Action::DecTtl { seen } = a {
                        *seen = state;
                    }
                    state = state.after(a);
                }
            }
        }
    }

    /// What every walk entering each pipe has done to the packet, by pipe: a port's root
    /// pipe has it as it came; a pipe no walk enters, [`Arrival::Changed`].
    pub fn arrivals(&self) -> Vec<Arrival> {
        let n = self.pipes.len();
        // How walks enter each pipe (`None`: none seen yet). The goto graph is acyclic
        // and a pipe's state only falls, so a few passes for each pipe settle it.
        let mut entered: Vec<Option<Arrival>> = (self.pipes.iter())
            .map(|p| (!p.from.is_empty()).then_some(Arrival::AsArrived))
            .collect();
        for _ in 0..3 * n {
            let mut changed = false;
            for from in 0..n {
                let Some(state) = entered[from] else {
                    continue;
                };
                let pipe = &self.pipes[from];
                for list in pipe.body.action_lists().chain([&pipe.miss]) {
                    if let Some((Action::Goto(to), before)) = list.0.split_last() {
                        let arrives = before.iter().fold(state, Arrival::after);
                        let met = entered[to.index()].map_or(arrives, |e| e.meet(arrives));
                        if entered[to.index()] != Some(met) {
                            entered[to.index()] = Some(met);
                            changed = true;
                        }
                    }
                }
            }
            if !changed {
                break;
            }
        }
        entered
            .into_iter()
            .map(|e| e.unwrap_or(Arrival::Changed))
            .collect()
    }

    /// The root pipe fed by a port, if any.
    pub fn root_of(&self, port: PortId) -> Option<PipeId> {
        self.pipes
            .iter()
            .position(|p| p.from.contains(&port))
            .map(|i| PipeId(i as u16))
    }

    /// An action as the language writes it.
    pub fn describe(&self, a: &Action) -> String {
        let mac = |m: &[u8; 6]| {
            display_value(
                m.iter().fold(0u128, |acc, &x| acc << 8 | u128::from(x)),
                ValueKind::Mac,
            )
        };
        match a {
            Action::Count => "count".into(),
            Action::Meter(m) => format!("meter {}", self.meters[m.index()].name),
            Action::Mirror(p) => format!("mirror {}", self.port(*p).name),
            Action::Set { field, value } => {
                format!("set {field} {}", display_value(*value, field.kind()))
            }
            Action::DecTtl { .. } => "dec ttl".into(),
            Action::ClampMss(mss) => format!("clamp tcp.mss {mss}"),
            Action::ClampMssToMtu => "clamp tcp.mss mtu".into(),
            Action::ArpReply(m) => format!("arp.reply {}", mac(m)),
            Action::EchoReply => "echo.reply".into(),
            Action::NdAdvert { mac: m, router } => {
                format!(
                    "nd.advert {}{}",
                    mac(m),
                    if *router { " router" } else { "" }
                )
            }
            Action::VlanPush { vid, pcp } => format!("vlan.push {{ id {vid} pcp {pcp} }}"),
            Action::VlanPop => "vlan.pop".into(),
            Action::Encap(e) => format!(
                "{}.encap {{ vni {} src {} dst {} smac {} dmac {} dport {} ttl {} dscp {}{} }}",
                e.tunnel.name(),
                e.vni,
                e.src,
                e.dst,
                mac(&e.smac),
                mac(&e.dmac),
                e.udp_dst,
                e.ttl,
                e.dscp,
                e.options
                    .iter()
                    .map(|o| format!(
                        " option {:#06x} {:#04x} ({} bytes)",
                        o.class,
                        o.kind,
                        o.data.len()
                    ))
                    .collect::<String>()
            ),
            Action::Decap(t) => format!("{}.decap", t.name()),
            Action::CtCommit { zone } => format!("ct.commit zone {zone}"),
            Action::Mark(m) => format!("mark {m}"),
            Action::Fwd(p) => format!("fwd {}", self.port(*p).name),
            Action::Goto(p) => format!("goto {}", self.pipe(*p).name),
            Action::Drop => "drop".into(),
            Action::ToService(s) => format!("to {}", self.services[s.index()].name),
        }
    }

    /// Total number of rules and table entries.
    pub fn entry_count(&self) -> usize {
        self.pipes.iter().map(|p| p.body.len()).sum()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Driver {
    Pcap,
    AfPacket,
    AfXdp,
    Doca,
}

impl Driver {
    pub const ALL: &'static [(&'static str, Driver)] = &[
        ("pcap", Driver::Pcap),
        ("af_packet", Driver::AfPacket),
        ("af_xdp", Driver::AfXdp),
        ("doca", Driver::Doca),
    ];

    /// The largest MTU a port of this driver carries. AF_XDP without multi-buffer puts a
    /// frame in one chunk of the socket's memory, 4096 bytes less the 256 the kernel keeps
    /// ahead of it: 3840 bytes of frame, an Ethernet header and two VLAN tags included.
    pub fn largest_mtu(self) -> u16 {
        match self {
            Driver::AfXdp => 3840 - 14 - 8,
            _ => u16::MAX,
        }
    }

    pub fn name(self) -> &'static str {
        Driver::ALL
            .iter()
            .find(|(_, d)| *d == self)
            .map_or("?", |(n, _)| n)
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Port {
    pub name: String,
    pub driver: Driver,
    /// Interface name (af_packet, af_xdp) or DOCA device representor.
    pub iface: Option<String>,
    /// Capture file the pcap driver reads.
    pub file: Option<PathBuf>,
    /// Capture file the pcap driver writes.
    pub out: Option<PathBuf>,
    pub queues: u16,
    /// Largest IP packet the port sends, in bytes (the L3 MTU).
    pub mtu: u16,
    /// The port's own addresses, which ICMP errors it sends come from.
    pub ipv4: Option<std::net::Ipv4Addr>,
    pub ipv6: Option<std::net::Ipv6Addr>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Pipe {
    pub name: String,
    /// Ports whose received packets enter here (a DOCA root pipe when non-empty).
    pub from: Vec<PortId>,
    pub body: PipeBody,
    /// What happens to a packet no rule or entry matched.
    pub miss: ActionList,
}

impl Pipe {
    /// A name for every counted entry: rule names, table keys, then `default`. Unique
    /// within the pipe, so counters follow an entry by name across a reload.
    pub fn entry_names(&self) -> Vec<String> {
        (0..=self.body.len()).map(|i| self.entry_name(i)).collect()
    }

    /// The name of counted entry `i` (see [`Pipe::entry_names`]): past the entries,
    /// `default`.
    pub fn entry_name(&self, i: usize) -> String {
        match &self.body {
            PipeBody::Rules(rules) => rules.get(i).map(|r| r.name.clone()),
            PipeBody::Lpm {
                field, prefixes, ..
            } => prefixes
                .get(i)
                .map(|p| display_prefix(p.value, p.len, field.kind())),
            PipeBody::Exact { fields, .. } => self.body.exact_key(i).map(|key| {
                fields
                    .iter()
                    .zip(key)
                    .map(|(f, v)| display_value(*v, f.kind()))
                    .collect::<Vec<_>>()
                    .join(" ")
            }),
        }
        .unwrap_or_else(|| "default".into())
    }
}

/// What a pipe matches packets against. Tables hold their entries flat, keys in one array
/// and action lists by index (see [`EntryActions`]): a million-entry table is a few
/// allocations rather than millions, which a service keeps for as long as it runs.
#[derive(Debug, Clone, PartialEq)]
pub enum PipeBody {
    /// Ordered rules, first match wins (a DOCA control or ACL pipe).
    Rules(Vec<Rule>),
    /// Exact match on a tuple of fields (a DOCA basic pipe with a hash of entries).
    Exact {
        fields: Vec<Field>,
        /// Entry `i`'s key is `keys[i * fields.len()..][..fields.len()]`, one value per
        /// field in the table's field order.
        keys: Vec<u128>,
        actions: EntryActions,
    },
    /// Longest-prefix match on one address field (a DOCA LPM pipe).
    Lpm {
        field: Field,
        prefixes: Vec<Prefix>,
        actions: EntryActions,
    },
}

impl PipeBody {
    pub fn len(&self) -> usize {
        match self {
            PipeBody::Rules(r) => r.len(),
            PipeBody::Exact { actions, .. } | PipeBody::Lpm { actions, .. } => actions.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The actions of entry `i`.
    pub fn action_list(&self, i: usize) -> Option<&ActionList> {
        match self {
            PipeBody::Rules(r) => r.get(i).map(|r| &r.actions),
            PipeBody::Exact { actions, .. } | PipeBody::Lpm { actions, .. } => actions.get(i),
        }
    }

    /// Every action list in the body, without the miss list: each rule's, and each of a
    /// table's distinct lists once.
    pub fn action_lists(&self) -> Box<dyn Iterator<Item = &ActionList> + '_> {
        match self {
            PipeBody::Rules(r) => Box::new(r.iter().map(|r| &r.actions)),
            PipeBody::Exact { actions, .. } | PipeBody::Lpm { actions, .. } => {
                Box::new(actions.distinct().iter())
            }
        }
    }

    fn action_lists_mut(&mut self) -> Box<dyn Iterator<Item = &mut ActionList> + '_> {
        match self {
            PipeBody::Rules(r) => Box::new(r.iter_mut().map(|r| &mut r.actions)),
            PipeBody::Exact { actions, .. } | PipeBody::Lpm { actions, .. } => {
                Box::new(actions.distinct_mut().iter_mut())
            }
        }
    }

    /// The key of an exact table's entry `i`.
    pub fn exact_key(&self, i: usize) -> Option<&[u128]> {
        match self {
            PipeBody::Exact { fields, keys, .. } => keys.chunks_exact(fields.len().max(1)).nth(i),
            _ => None,
        }
    }
}

/// A table's action lists by entry, each distinct list kept once: the million entries of a
/// table that all forward to one port hold one list and a million indices. Built by
/// [`EntryActionsBuilder`] or collected from each entry's list.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct EntryActions {
    /// Entry `i` runs `lists[of[i]]`.
    of: Vec<u32>,
    lists: Vec<ActionList>,
}

impl EntryActions {
    pub fn len(&self) -> usize {
        self.of.len()
    }

    pub fn is_empty(&self) -> bool {
        self.of.is_empty()
    }

    /// Entry `i`'s list.
    pub fn get(&self, i: usize) -> Option<&ActionList> {
        self.lists.get(*self.of.get(i)? as usize)
    }

    /// Each entry's list, in entry order.
    pub fn iter(&self) -> impl Iterator<Item = &ActionList> {
        self.of.iter().map(|&i| &self.lists[i as usize])
    }

    /// Each entry's index into [`EntryActions::distinct`].
    pub fn indices(&self) -> &[u32] {
        &self.of
    }

    /// The distinct lists, in the order their first entries came.
    pub fn distinct(&self) -> &[ActionList] {
        &self.lists
    }

    fn distinct_mut(&mut self) -> &mut [ActionList] {
        &mut self.lists
    }
}

impl FromIterator<ActionList> for EntryActions {
    fn from_iter<I: IntoIterator<Item = ActionList>>(lists: I) -> EntryActions {
        let mut b = EntryActionsBuilder::default();
        lists.into_iter().for_each(|l| b.push(l));
        b.finish()
    }
}

/// Gathers [`EntryActions`] entry by entry, finding each list among those seen.
#[derive(Debug, Default)]
pub struct EntryActionsBuilder {
    actions: EntryActions,
    seen: std::collections::HashMap<ActionList, u32>,
}

impl EntryActionsBuilder {
    /// Room for `n` entries.
    pub fn with_capacity(n: usize) -> EntryActionsBuilder {
        EntryActionsBuilder {
            actions: EntryActions {
                of: Vec::with_capacity(n),
                lists: Vec::new(),
            },
            seen: Default::default(),
        }
    }

    /// Gives the next entry `list`.
    pub fn push(&mut self, list: ActionList) {
        let lists = &mut self.actions.lists;
        let i = *self.seen.entry(list).or_insert_with_key(|list| {
            lists.push(list.clone());
            u32::try_from(lists.len() - 1).expect("fewer than 2^32 distinct lists")
        });
        self.actions.of.push(i);
    }

    pub fn finish(self) -> EntryActions {
        self.actions
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    pub name: String,
    /// All must hold; at most one pattern per field.
    pub matches: Vec<FieldMatch>,
    pub actions: ActionList,
}

impl Rule {
    /// True when every packet `other` matches, `self` matches too: each field `self`
    /// matches, `other` matches within it. Conservative, as [`Pattern::covers`].
    pub fn covers(&self, other: &Rule) -> bool {
        self.matches.iter().all(|m| {
            other
                .matches
                .iter()
                .find(|o| o.field == m.field)
                .is_some_and(|o| m.pattern.covers(&o.pattern, m.field.kind()))
        })
    }
}

/// Each rule's patterns as one interval per field, over the fields any of the rules
/// matches (in `Field` order; the full range where a rule does not match the field), or
/// `None` for a rule with a pattern that is no interval (a set, a mask not a prefix): rules
/// compared as boxes cost a few integer comparisons a pair, so 10k-rule files stay fast.
pub fn interval_boxes(rules: &[&Rule]) -> Vec<Option<Vec<(u128, u128)>>> {
    let mut fields: Vec<Field> = rules
        .iter()
        .flat_map(|r| r.matches.iter().map(|m| m.field))
        .collect();
    fields.sort();
    fields.dedup();
    rules
        .iter()
        .map(|r| {
            fields
                .iter()
                .map(|f| match r.matches.iter().find(|m| m.field == *f) {
                    None => Some((0, f.kind().full_mask())),
                    Some(m) => m.pattern.interval(f.kind()),
                })
                .collect()
        })
        .collect()
}

/// For each rule, an earlier one that covers it, if any: a rule so covered never matches
/// (first match wins).
pub fn shadowing(rules: &[&Rule]) -> Vec<Option<usize>> {
    let boxes = interval_boxes(rules);
    (0..rules.len())
        .map(|j| {
            (0..j).find(|&i| match (&boxes[i], &boxes[j]) {
                (Some(a), Some(b)) => a
                    .iter()
                    .zip(b)
                    .all(|(&(alo, ahi), &(blo, bhi))| alo <= blo && bhi <= ahi),
                _ => rules[i].covers(rules[j]),
            })
        })
        .collect()
}

/// An LPM table entry's prefix: its first `len` bits, right-aligned in `value` as a
/// [`Pattern`]'s values are.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Prefix {
    pub value: u128,
    pub len: u8,
}

#[derive(Debug, Clone, PartialEq)]
pub struct FieldMatch {
    pub field: Field,
    pub pattern: Pattern,
}

/// A set of values of one field. Values are right-aligned in a `u128` (an IPv4 address is
/// its 32-bit number, a MAC its 48-bit number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    /// `value & mask == value`: exact values, prefixes and bit masks.
    Masked { value: u128, mask: u128 },
    /// `lo <= v <= hi`.
    Range { lo: u128, hi: u128 },
    /// Any of these patterns (each a `Masked` or a `Range`).
    Any(Vec<Pattern>),
}

impl Pattern {
    pub fn exact(value: u128, kind: ValueKind) -> Pattern {
        Pattern::Masked {
            value,
            mask: kind.full_mask(),
        }
    }

    pub fn prefix(value: u128, len: u8, kind: ValueKind) -> Pattern {
        let full = kind.full_mask();
        let mask = match len {
            0 => 0,
            l if l >= kind.bits() => full,
            l => full & !(full >> l),
        };
        Pattern::Masked {
            value: value & mask,
            mask,
        }
    }

    pub fn matches(&self, v: u128) -> bool {
        match self {
            Pattern::Masked { value, mask } => v & mask == *value,
            Pattern::Range { lo, hi } => (*lo..=*hi).contains(&v),
            Pattern::Any(ps) => ps.iter().any(|p| p.matches(v)),
        }
    }

    /// The pattern as an inclusive interval, when it is one (ranges and prefix masks).
    pub fn interval(&self, kind: ValueKind) -> Option<(u128, u128)> {
        match *self {
            Pattern::Range { lo, hi } => Some((lo, hi)),
            Pattern::Masked { value, mask } => {
                let host = !mask & kind.full_mask();
                // A prefix mask has all its host bits below its network bits.
                (host & host.wrapping_add(1) == 0).then_some((value, value | host))
            }
            Pattern::Any(_) => None,
        }
    }

    /// Whether some value matches both patterns. Conservative: it may answer true for
    /// patterns that share none (a non-prefix mask against a range), never false wrongly.
    pub fn intersects(&self, other: &Pattern, kind: ValueKind) -> bool {
        match (self, other) {
            (Pattern::Any(xs), _) => xs.iter().any(|x| x.intersects(other, kind)),
            (_, Pattern::Any(ys)) => ys.iter().any(|y| self.intersects(y, kind)),
            (Pattern::Masked { value: v, mask: m }, Pattern::Masked { value: w, mask: n }) => {
                (v ^ w) & m & n == 0
            }
            _ => match (self.interval(kind), other.interval(kind)) {
                (Some((lo, hi)), Some((olo, ohi))) => lo <= ohi && olo <= hi,
                _ => true,
            },
        }
    }

    /// True when every value `other` matches, `self` matches too. Conservative: it may
    /// answer false for exotic combinations (a set jointly covering a range, a range
    /// covering a non-prefix mask), never true wrongly.
    pub fn covers(&self, other: &Pattern, kind: ValueKind) -> bool {
        if let Pattern::Any(others) = other {
            return others.iter().all(|o| self.covers(o, kind));
        }
        if let Pattern::Any(mine) = self {
            return mine.iter().any(|m| m.covers(other, kind));
        }
        if let (Some((lo, hi)), Some((olo, ohi))) = (self.interval(kind), other.interval(kind)) {
            return lo <= olo && ohi <= hi;
        }
        match (self, other) {
            (
                Pattern::Masked { value, mask },
                Pattern::Masked {
                    value: ov,
                    mask: om,
                },
            ) => mask & om == *mask && ov & mask == *value,
            (Pattern::Masked { .. }, Pattern::Range { lo, hi }) => {
                hi - lo < 256 && (*lo..=*hi).all(|v| self.matches(v))
            }
            _ => false,
        }
    }
}

/// One action. Terminal actions (`fwd`, `goto`, `drop`, `to`) end a list.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Action {
    Count,
    Meter(MeterId),
    Mirror(PortId),
    Set {
        field: Field,
        value: u128,
    },
    /// Decrement IPv4 TTL or IPv6 hop limit; the packet is dropped at zero. `seen`: what
    /// the actions before it, in every walk reaching it, did to the packet, so whether
    /// its sender can be told (see [`Program::note_arrivals`]).
    DecTtl {
        seen: Arrival,
    },
    /// Lower the MSS option of a TCP SYN segment to this where it is larger.
    ClampMss(u16),
    /// Lower it, where the packet leaves, to what a segment may carry to fill the output
    /// port's MTU behind every header then in front of its TCP header (a tunnel's too).
    ClampMssToMtu,
    /// Turn an ARP request into the reply of the host owning its target address,
    /// whose hardware address this is.
    ArpReply([u8; 6]),
    /// Turn an IPv6 neighbour solicitation into the advertisement of its target, at
    /// this hardware address, from a router or not.
    NdAdvert {
        mac: [u8; 6],
        router: bool,
    },
    /// Turn an ICMP or ICMPv6 echo request into its echo reply.
    EchoReply,
    VlanPush {
        vid: u16,
        pcp: u8,
    },
    VlanPop,
    Encap(Box<Encap>),
    Decap(Tunnel),
    CtCommit {
        zone: u16,
    },
    Mark(u32),
    Fwd(PortId),
    Goto(PipeId),
    Drop,
    ToService(ServiceId),
}

/// What a walk's actions have done to a packet, up to a point in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Arrival {
    /// Nothing: it is as it came.
    AsArrived,
    /// Taken out of the tunnel it came in, and nothing else: the tunnel's headers lie
    /// in front of it as they came.
    Decapsulated,
    /// Anything else, or not the same in every walk.
    #[default]
    Changed,
}

impl Arrival {
    /// The state after action `a`.
    pub fn after(self, a: &Action) -> Arrival {
        match (self, a) {
            (state, a) if a.keeps_packet() => state,
            (Arrival::AsArrived, Action::Decap(_)) => Arrival::Decapsulated,
            _ => Arrival::Changed,
        }
    }

    /// The state of a pipe walks enter in `self` and in `other`.
    fn meet(self, other: Arrival) -> Arrival {
        if self == other {
            self
        } else {
            Arrival::Changed
        }
    }
}

impl Action {
    /// Whether the action leaves the packet's addresses, protocol, ports and headers as
    /// they are (it may count, meter, copy, mark, track or decrement the TTL).
    pub fn keeps_packet(&self) -> bool {
        matches!(
            self,
            Action::Count
                | Action::Meter(_)
                | Action::Mirror(_)
                | Action::Mark(_)
                | Action::CtCommit { .. }
                | Action::DecTtl { .. }
                | Action::ClampMss(_)
                | Action::ClampMssToMtu
        )
    }

    pub fn is_terminal(&self) -> bool {
        matches!(
            self,
            Action::Fwd(_) | Action::Goto(_) | Action::Drop | Action::ToService(_)
        )
    }
}

/// A list of actions whose last element, and only it, is terminal.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ActionList(pub Vec<Action>);

impl ActionList {
    pub fn terminal(&self) -> &Action {
        self.0
            .last()
            .expect("validated action lists end in a terminal action")
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Tunnel {
    Vxlan,
    Geneve,
}

impl Tunnel {
    /// IANA-assigned UDP destination ports (RFC 7348 §5, RFC 8926 §3.3).
    pub fn default_port(self) -> u16 {
        match self {
            Tunnel::Vxlan => 4789,
            Tunnel::Geneve => 6081,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Tunnel::Vxlan => "vxlan",
            Tunnel::Geneve => "geneve",
        }
    }
}

/// Outer headers to prepend: Ethernet, IPv4 or IPv6, UDP, then VXLAN or Geneve.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Encap {
    pub tunnel: Tunnel,
    pub vni: u32,
    pub src: IpAddr,
    pub dst: IpAddr,
    pub smac: [u8; 6],
    pub dmac: [u8; 6],
    pub udp_dst: u16,
    pub ttl: u8,
    pub dscp: OuterDscp,
    /// Geneve options (RFC 8926 §3.5); empty for VXLAN.
    pub options: Vec<GeneveOption>,
}

/// The DSCP of an encapsulation's outer header (RFC 2983 §3). Its ECN field is always
/// the inner packet's (RFC 6040 §4.1, normal mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum OuterDscp {
    /// This value, whatever the inner packet's ("pipe" model): the default, 0.
    Fixed(u8),
    /// The inner packet's DSCP, 0 for a frame that is not IP ("uniform" model; Linux's
    /// vxlan `tos inherit`), so the fabric queues the tunnel's packets by their class.
    Inherit,
}

impl fmt::Display for OuterDscp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            OuterDscp::Fixed(d) => write!(f, "{d}"),
            OuterDscp::Inherit => f.write_str("inherit"),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GeneveOption {
    pub class: u16,
    pub kind: u8,
    pub critical: bool,
    /// A multiple of 4 bytes, at most 124.
    pub data: Vec<u8>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MeterRate {
    Packets,
    Bits,
}

/// A two-rate or single-rate three-colour meter; rates and bursts in packets or in
/// bits/s and bytes, as `unit` says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Meter {
    pub name: String,
    pub unit: MeterRate,
    /// Committed information rate (per second).
    pub cir: u64,
    /// Committed burst size.
    pub cbs: u64,
    pub algorithm: MeterAlgorithm,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MeterAlgorithm {
    /// RFC 2697: excess burst size.
    SingleRate { ebs: u64 },
    /// RFC 2698: peak rate and peak burst size.
    TwoRate { pir: u64, pbs: u64 },
}

/// Connection-tracking table settings; timeouts default to Linux nf_conntrack's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Conntrack {
    pub capacity: u64,
    pub timeouts: CtTimeouts,
    /// TCP segments are checked against their connection's windows (Linux's default,
    /// `nf_conntrack_tcp_be_liberal=0`); off, they are judged by flags and state only.
    pub tcp_window: bool,
    /// A TCP connection may be picked up mid-stream, opened by a plain ACK (Linux's
    /// default, `nf_conntrack_tcp_loose=1`); off, only a SYN opens one.
    pub tcp_loose: bool,
    /// Transport checksums are verified, a packet with a wrong one `invalid` (Linux's
    /// default, `nf_conntrack_checksum=1`); off, they are not read.
    pub checksum: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CtTimeouts {
    pub tcp_syn_sent: Duration,
    pub tcp_syn_recv: Duration,
    pub tcp_established: Duration,
    pub tcp_fin_wait: Duration,
    pub tcp_close_wait: Duration,
    pub tcp_last_ack: Duration,
    pub tcp_time_wait: Duration,
    pub tcp_close: Duration,
    /// The cap on a TCP connection's timeout while it has unacknowledged data (with window
    /// tracking) or, picked up mid-stream, no answer yet (Linux
    /// `nf_conntrack_tcp_timeout_unacknowledged`).
    pub tcp_unacknowledged: Duration,
    /// With window tracking: the cap while segments are retransmitted (three times alike)
    /// or the last advertised window was zero (Linux `nf_conntrack_tcp_timeout_max_retrans`).
    pub tcp_max_retrans: Duration,
    pub udp: Duration,
    pub udp_stream: Duration,
    pub icmp: Duration,
    /// GRE (Linux `nf_conntrack_gre_timeout`), and once answered (`_stream`).
    pub gre: Duration,
    pub gre_stream: Duration,
    /// Any other protocol (Linux `nf_conntrack_generic_timeout`).
    pub generic: Duration,
    /// SCTP association states (Linux `nf_conntrack_sctp_timeout_*`).
    pub sctp_closed: Duration,
    pub sctp_cookie_wait: Duration,
    pub sctp_cookie_echoed: Duration,
    pub sctp_established: Duration,
    pub sctp_shutdown_sent: Duration,
    pub sctp_shutdown_recd: Duration,
    pub sctp_shutdown_ack_sent: Duration,
    /// An association picked up by a heartbeat, until it is answered.
    pub sctp_heartbeat_sent: Duration,
}

impl Default for CtTimeouts {
    /// Linux's `nf_conntrack_*_timeout*` sysctl defaults (SCTP's as revised in 2023: an
    /// established association 210 s, where it had been 5 days).
    fn default() -> Self {
        let s = Duration::from_secs;
        CtTimeouts {
            tcp_syn_sent: s(120),
            tcp_syn_recv: s(60),
            tcp_established: s(432_000),
            tcp_fin_wait: s(120),
            tcp_close_wait: s(60),
            tcp_last_ack: s(30),
            tcp_time_wait: s(120),
            tcp_close: s(10),
            tcp_unacknowledged: s(300),
            tcp_max_retrans: s(300),
            udp: s(30),
            udp_stream: s(120),
            icmp: s(30),
            gre: s(30),
            gre_stream: s(180),
            generic: s(600),
            sctp_closed: s(10),
            sctp_cookie_wait: s(3),
            sctp_cookie_echoed: s(3),
            sctp_established: s(210),
            sctp_shutdown_sent: s(3),
            sctp_shutdown_recd: s(3),
            sctp_shutdown_ack_sent: s(3),
            sctp_heartbeat_sent: s(30),
        }
    }
}

impl CtTimeouts {
    /// Names as written in the `conntrack` block, with a mutable reference to each.
    pub fn by_name(&mut self) -> [(&'static str, &mut Duration); 24] {
        [
            ("tcp_syn_sent", &mut self.tcp_syn_sent),
            ("tcp_syn_recv", &mut self.tcp_syn_recv),
            ("tcp_established", &mut self.tcp_established),
            ("tcp_fin_wait", &mut self.tcp_fin_wait),
            ("tcp_close_wait", &mut self.tcp_close_wait),
            ("tcp_last_ack", &mut self.tcp_last_ack),
            ("tcp_time_wait", &mut self.tcp_time_wait),
            ("tcp_close", &mut self.tcp_close),
            ("tcp_unacknowledged", &mut self.tcp_unacknowledged),
            ("tcp_max_retrans", &mut self.tcp_max_retrans),
            ("udp", &mut self.udp),
            ("udp_stream", &mut self.udp_stream),
            ("icmp", &mut self.icmp),
            ("gre", &mut self.gre),
            ("gre_stream", &mut self.gre_stream),
            ("generic", &mut self.generic),
            ("sctp_closed", &mut self.sctp_closed),
            ("sctp_cookie_wait", &mut self.sctp_cookie_wait),
            ("sctp_cookie_echoed", &mut self.sctp_cookie_echoed),
            ("sctp_established", &mut self.sctp_established),
            ("sctp_shutdown_sent", &mut self.sctp_shutdown_sent),
            ("sctp_shutdown_recd", &mut self.sctp_shutdown_recd),
            ("sctp_shutdown_ack_sent", &mut self.sctp_shutdown_ack_sent),
            ("sctp_heartbeat_sent", &mut self.sctp_heartbeat_sent),
        ]
    }
}

/// Where a collector listens, as written: an IP address or a host name, and a UDP port.
/// A name is resolved when the service starts, and again now and then (see
/// [`crate::telemetry::collector`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostPort {
    pub host: String,
    pub port: u16,
}

impl HostPort {
    /// The first address the host resolves to (the system resolver; none for an address).
    pub fn resolve(&self) -> std::io::Result<SocketAddr> {
        use std::net::ToSocketAddrs;
        (self.host.as_str(), self.port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| std::io::Error::other("the name has no address"))
    }
}

impl std::str::FromStr for HostPort {
    type Err = &'static str;

    /// `IP:PORT` (an IPv6 address in brackets) or `NAME:PORT`, NAME a DNS name (RFC 1123
    /// §2.1: labels of letters, digits and inner hyphens, at most 63 bytes, 253 in all);
    /// PORT 1 to 65535 (nothing can be sent to port 0).
    fn from_str(s: &str) -> Result<HostPort, &'static str> {
        const NO_PORT_ZERO: &str = "the port is 0: a collector listens on 1 to 65535";
        if let Ok(a) = s.parse::<SocketAddr>() {
            if a.port() == 0 {
                return Err(NO_PORT_ZERO);
            }
            return Ok(HostPort {
                host: a.ip().to_string(),
                port: a.port(),
            });
        }
        let (host, port) = s.rsplit_once(':').ok_or("no port: write HOST:PORT")?;
        let port = match port.parse() {
            Ok(0) => return Err(NO_PORT_ZERO),
            Ok(p) => p,
            Err(_) => return Err("the port is not a number up to 65535"),
        };
        let label_ok = |l: &str| {
            (1..=63).contains(&l.len())
                && l.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        let host = host.strip_suffix('.').unwrap_or(host);
        if host.len() > 253 || !host.split('.').all(label_ok) {
            return Err("not an IP address or a host name");
        }
        Ok(HostPort {
            host: host.to_owned(),
            port,
        })
    }
}

impl fmt::Display for HostPort {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.host.contains(':') {
            write!(f, "[{}]:{}", self.host, self.port)
        } else {
            write!(f, "{}:{}", self.host, self.port)
        }
    }
}

/// Telemetry settings; both exporters are off unless an address is given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Telemetry {
    pub prometheus: Option<SocketAddr>,
    /// IPFIX collectors, each sent every message (none: no export).
    pub ipfix: Vec<HostPort>,
    /// IPFIX active timeout: a long flow is exported at least this often.
    pub active_timeout: Duration,
    /// IPFIX idle timeout: a flow silent this long is exported and forgotten.
    pub idle_timeout: Duration,
    /// How often IPFIX templates are sent again (RFC 7011 §8.4).
    pub template_refresh: Duration,
    /// Rules with their own Prometheus series; the rest are summed into one.
    pub max_rule_series: u32,
    /// The flow cache counts one packet in this many (1: every packet).
    pub sampling: u32,
    /// Flows each worker's IPFIX flow cache holds (about 116 bytes each, all taken at start).
    pub flow_cache: u64,
    /// IPFIX Observation Domain ID: collectors tell exporters apart by address and domain,
    /// so instances sharing an address need their own (RFC 7011 §3.1).
    pub observation_domain: u32,
    /// The path MTU towards the IPFIX collector: each message, with its IP and UDP
    /// headers, fits in it, so none is fragmented on the way.
    pub ipfix_mtu: u16,
    /// IPFIX messages sent a second at most: what the collector's receive buffer and the
    /// path have to absorb when many flows are exported at once.
    pub ipfix_rate: u32,
    /// TLS on the metrics endpoint, when configured.
    pub prometheus_tls: Option<TlsFiles>,
    /// The htpasswd file (bcrypt) of the users the metrics endpoint admits to `/metrics`
    /// (basic auth, over its TLS only); `None`: anyone who reaches it.
    pub prometheus_users: Option<PathBuf>,
}

impl Default for Telemetry {
    fn default() -> Self {
        Telemetry {
            prometheus: None,
            ipfix: Vec::new(),
            active_timeout: Duration::from_secs(60),
            idle_timeout: Duration::from_secs(15),
            template_refresh: Duration::from_secs(600),
            max_rule_series: 1000,
            sampling: 1,
            flow_cache: 1 << 20,
            observation_domain: 1,
            ipfix_mtu: 1500,
            ipfix_rate: 10_000,
            prometheus_tls: None,
            prometheus_users: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Service {
    pub name: String,
    pub kind: ServiceKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ServiceKind {
    KvCache(KvCache),
}

/// Client connections a KV-cache service serves at once unless its `max_clients` says
/// otherwise: each has a thread and a descriptor.
pub const DEFAULT_MAX_CLIENTS: u64 = 1024;

/// Requests a KV-cache service keeps in its slow log unless its `slowlog` says otherwise:
/// those of 10 ms or more (Redis's `slowlog-log-slower-than`).
pub const DEFAULT_SLOWLOG: Duration = Duration::from_millis(10);

/// The KV-cache block service: where it listens and where it stores blocks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvCache {
    pub listen: SocketAddr,
    /// Where the blocks live: one target, or several with the store striped over them in
    /// this order (the first holds the superblock).
    pub targets: Vec<StorageTarget>,
    /// Bytes of the store, over all its targets, that the index may allocate.
    pub capacity: u64,
    /// Allocation unit in bytes (a multiple of 512).
    pub block_size: u64,
    /// With several targets, how many bytes of the store's address space go to one
    /// target before the next (`stripe`, a multiple of `block_size`).
    pub stripe: u64,
    /// Connections kept to the target: how many reads and writes are in flight at once.
    pub connections: usize,
    /// Values of at most this many bytes are kept in memory as well as charged a block:
    /// read without going to the target, written to it only when the index is saved.
    pub inline_max: u64,
    /// How often the index is saved on the target while the service runs, so a start
    /// after a crash finds it (`checkpoint`); `None`: only at a clean stop.
    pub checkpoint: Option<Duration>,
    /// CRC32C digests on an NVMe/TCP target's PDUs (`nvme_digest`).
    pub nvme_digests: NvmeDigests,
    /// Whether a local target's reads and writes go through the page cache
    /// (`page_cache`); `None`: as its kind has it, a block device's directly and a
    /// file's through it.
    pub page_cache: Option<bool>,
    /// Whether the target is told of blocks freed (`discard`): TRIM, NBD trim or NVMe
    /// deallocation, before the blocks are used again.
    pub discard: bool,
    /// How long a network target may keep a request waiting, for its answer or to take
    /// what is sent, before the request fails (`io_timeout`).
    pub io_timeout: Duration,
    /// Client connections served at once (`max_clients`); more are answered with an
    /// error and closed.
    pub max_clients: u64,
    /// Requests that take at least this long are kept in the slow log (`slowlog`);
    /// `None`: none are.
    pub slowlog: Option<Duration>,
    /// The file holding the password clients must give (`AUTH`), if any; read when the
    /// service starts.
    pub password_file: Option<PathBuf>,
    /// TLS on `listen`, if configured.
    pub tls: Option<TlsFiles>,
    /// The services of a Redis Cluster this one is a node of (`cluster_node`), in the
    /// order that deals out the hash slots, `listen` among them unless it is leaving;
    /// empty: standalone.
    pub cluster: Vec<SocketAddr>,
    /// This node is leaving the cluster of `cluster` (`cluster_leaving on`): it serves no
    /// slot, and hands its keys to the nodes listed.
    pub cluster_leaving: bool,
}

/// A TLS server's PEM files, read when the service starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, the service's own first.
    pub cert: PathBuf,
    pub key: PathBuf,
    /// CA certificates a client's certificate must chain to; without, clients present none.
    pub client_ca: Option<PathBuf>,
}

/// Which NVMe/TCP digests a connection asks for (NVMe/TCP Transport §3.6.1): a CRC32C of
/// each PDU's header, of each PDU's data.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NvmeDigests {
    pub header: bool,
    pub data: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum StorageTarget {
    /// `nvme-tcp://HOST:PORT/NQN`
    NvmeTcp { addr: SocketAddr, nqn: String },
    /// `nbd://HOST:PORT[/EXPORT]`
    Nbd { addr: SocketAddr, export: String },
    /// `nvme:///dev/nvme0n1` or `file:///path`: a local block device or file.
    Local { path: PathBuf },
}

/// A value written the way the language writes it for its kind.
pub fn display_value(v: u128, kind: ValueKind) -> String {
    match kind {
        ValueKind::Ipv4 => std::net::Ipv4Addr::from(v as u32).to_string(),
        ValueKind::Ipv6 => std::net::Ipv6Addr::from(v).to_string(),
        ValueKind::Mac => {
            let b = v.to_be_bytes();
            b[10..]
                .iter()
                .map(|x| format!("{x:02x}"))
                .collect::<Vec<_>>()
                .join(":")
        }
        _ => v.to_string(),
    }
}

/// `ADDR/LEN`.
pub fn display_prefix(v: u128, len: u8, kind: ValueKind) -> String {
    format!("{}/{len}", display_value(v, kind))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `dec ttl` sees the packet as it came unless an action before it, in its list or
    /// on any way to its pipe, changes the packet; as only taken out of its tunnel where
    /// a decapsulation is all that did, in every walk to it.
    #[test]
    fn ttl_decrements_know_what_became_of_the_packet() {
        let text = "pipeline t\nport a { driver pcap }\nport b { driver pcap }\n\
            pipe p root from a {\n\
              rule counted { match udp.dst 1 actions count, mark 3, goto q }\n\
              rule plain   { match udp.dst 2 actions dec ttl, fwd b }\n\
              rule late    { match udp.dst 3 actions set ip.dscp 10, dec ttl, fwd b }\n\
              rule tagged  { match udp.dst 4 actions vlan.push { id 7 }, goto r }\n\
              rule decap   { match vxlan.vni 1 actions vxlan.decap, count, dec ttl, fwd b }\n\
              rule decap_set { match vxlan.vni 2 actions vxlan.decap, set ip.dscp 1, dec ttl, fwd b }\n\
              rule into_s  { match geneve.vni 3 actions geneve.decap, goto s }\n\
              rule into_t  { match vxlan.vni 4 actions vxlan.decap, goto t }\n\
              default { actions goto r }\n\
            }\n\
            pipe q { default { actions dec ttl, fwd b } }\n\
            pipe r { default { actions dec ttl, fwd b } }\n\
            pipe s { default { actions dec ttl, fwd b } }\n\
            pipe t { rule rewritten { match udp.dst 6 actions set ip.dscp 1, goto s }\n\
                     default { actions dec ttl, fwd b } }\n\
            pipe u root from b { default { actions goto t } }\n";
        let checked = crate::lang::check_source("t.pipe", text, std::path::Path::new("."));
        let p = checked.program.expect("valid");
        let seen = |list: &ActionList| {
            list.0.iter().find_map(|a| match a {
                Action::DecTtl { seen } => Some(*seen),
                _ => None,
            })
        };
        let PipeBody::Rules(rules) = &p.pipes[0].body else {
            panic!("rules")
        };
        use Arrival::*;
        assert_eq!(seen(&rules[1].actions), Some(AsArrived));
        assert_eq!(seen(&rules[2].actions), Some(Changed));
        assert_eq!(seen(&rules[4].actions), Some(Decapsulated));
        assert_eq!(seen(&rules[5].actions), Some(Changed));
        assert_eq!(seen(&p.pipes[1].miss), Some(AsArrived));
        // r is reached once tagged, though its other way in keeps the packet.
        assert_eq!(seen(&p.pipes[2].miss), Some(Changed));
        // s is reached decapsulated from p, and rewritten from t.
        assert_eq!(seen(&p.pipes[3].miss), Some(Changed));
        // t is reached decapsulated from p and as it came from u.
        assert_eq!(seen(&p.pipes[4].miss), Some(Changed));
    }

    #[test]
    fn collectors_are_addresses_or_host_names() {
        let hp = |s: &str| s.parse::<HostPort>();
        let named = |host: &str, port| {
            Ok(HostPort {
                host: host.into(),
                port,
            })
        };
        assert_eq!(hp("192.0.2.7:4739"), named("192.0.2.7", 4739));
        assert_eq!(hp("[2001:db8::7]:4739"), named("2001:db8::7", 4739));
        assert_eq!(
            hp("collector.example:4739"),
            named("collector.example", 4739)
        );
        assert_eq!(
            hp("collector.example.:2055"),
            named("collector.example", 2055)
        );
        assert_eq!(hp("ipfix-1:4739"), named("ipfix-1", 4739));
        for bad in [
            "collector",
            "collector:",
            "collector:70000",
            "collector:0",
            "192.0.2.7:0",
            "[2001:db8::7]:0",
            ":4739",
            "a..b:4739",
            "-a:4739",
            "a-:4739",
            "under_score:4739",
            "2001:db8::7:4739",
        ] {
            assert!(hp(bad).is_err(), "{bad}");
        }
        assert_eq!(
            hp("[2001:db8::7]:4739").unwrap().to_string(),
            "[2001:db8::7]:4739"
        );
        assert_eq!(
            hp("192.0.2.7:4739").unwrap().resolve().ok(),
            Some(SocketAddr::from(([192, 0, 2, 7], 4739)))
        );
    }

    proptest::proptest! {
        /// Any host name or address with a port reads back as written; no text panics.
        #[test]
        fn collectors_read_back_as_written(
            labels in proptest::collection::vec("[a-z0-9]([a-z0-9-]{0,20}[a-z0-9])?", 1..5),
            v4 in proptest::prelude::any::<[u8; 4]>(),
            v6 in proptest::prelude::any::<[u16; 8]>(),
            port in 1..=u16::MAX,
            noise in "\\PC{0,40}",
        ) {
            let v6 = std::net::Ipv6Addr::from(v6).to_string();
            for host in [labels.join("."), std::net::Ipv4Addr::from(v4).to_string(), v6] {
                let hp = HostPort { host, port };
                proptest::prop_assert_eq!(hp.to_string().parse::<HostPort>(), Ok(hp.clone()));
            }
            let _ = noise.parse::<HostPort>();
        }
    }

    const IP4: ValueKind = ValueKind::Ipv4;
    const PORT: ValueKind = ValueKind::Int { bits: 16 };

    #[test]
    fn prefix_masks() {
        assert_eq!(
            Pattern::prefix(0x0a01_0203, 16, IP4),
            Pattern::Masked {
                value: 0x0a01_0000,
                mask: 0xffff_0000
            }
        );
        assert_eq!(
            Pattern::prefix(5, 0, IP4),
            Pattern::Masked { value: 0, mask: 0 }
        );
        assert_eq!(
            Pattern::prefix(1, 128, ValueKind::Ipv6),
            Pattern::Masked {
                value: 1,
                mask: u128::MAX
            }
        );
    }

    #[test]
    fn coverage() {
        let p8 = Pattern::prefix(0x0a00_0000, 8, IP4);
        let p16 = Pattern::prefix(0x0a01_0000, 16, IP4);
        assert!(p8.covers(&p16, IP4));
        assert!(!p16.covers(&p8, IP4));
        let r = Pattern::Range {
            lo: 1024,
            hi: 65535,
        };
        assert!(r.covers(&Pattern::exact(8080, PORT), PORT));
        assert!(!r.covers(&Pattern::exact(80, PORT), PORT));
        let set = Pattern::Any(vec![Pattern::exact(80, PORT), Pattern::exact(443, PORT)]);
        assert!(r.covers(&Pattern::exact(2000, PORT), PORT));
        assert!(set.covers(&Pattern::exact(443, PORT), PORT));
        assert!(!Pattern::exact(443, PORT).covers(&set, PORT));
        assert!(Pattern::Masked { value: 0, mask: 0 }.covers(&r, PORT));
        assert!(Pattern::Range { lo: 0, hi: 65535 }.covers(&set, PORT));
    }

    /// Patterns of an 8-bit field: masks, ranges and sets of them.
    fn pattern8() -> impl proptest::strategy::Strategy<Value = Pattern> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            (any::<u8>(), any::<u8>()).prop_map(|(v, m)| Pattern::Masked {
                value: u128::from(v & m),
                mask: u128::from(m)
            }),
            (any::<u8>(), any::<u8>()).prop_map(|(a, b)| Pattern::Range {
                lo: u128::from(a.min(b)),
                hi: u128::from(a.max(b))
            }),
        ];
        prop_oneof![
            leaf.clone(),
            proptest::collection::vec(leaf, 1..4).prop_map(Pattern::Any)
        ]
    }

    proptest::proptest! {
        /// Two patterns said not to intersect share no value, and a pattern that covers
        /// another matches every value it does.
        #[test]
        fn intersects_and_covers_never_answer_wrongly(a in pattern8(), b in pattern8()) {
            let kind = ValueKind::Int { bits: 8 };
            let shared = (0..256u128).any(|v| a.matches(v) && b.matches(v));
            if !a.intersects(&b, kind) {
                proptest::prop_assert!(!shared);
            }
            proptest::prop_assert_eq!(a.intersects(&b, kind), b.intersects(&a, kind));
            if a.covers(&b, kind) {
                proptest::prop_assert!((0..256u128).all(|v| !b.matches(v) || a.matches(v)));
            }
        }
    }

    proptest::proptest! {
        /// A table's action lists come back entry by entry as they were given, each
        /// distinct list is kept once, and in the order its first entry came.
        #[test]
        fn entry_actions_keep_each_entrys_list(picks in proptest::collection::vec(0u8..6, 0..200)) {
            let list = |p: u8| ActionList(vec![Action::Mark(u32::from(p)), Action::Drop]);
            let actions: EntryActions = picks.iter().map(|&p| list(p)).collect();
            proptest::prop_assert_eq!(actions.len(), picks.len());
            for (i, &p) in picks.iter().enumerate() {
                proptest::prop_assert_eq!(actions.get(i), Some(&list(p)));
            }
            proptest::prop_assert!(actions.iter().eq(picks.iter().map(|&p| list(p)).collect::<Vec<_>>().iter()));
            let mut firsts: Vec<u8> = Vec::new();
            for &p in &picks {
                if !firsts.contains(&p) {
                    firsts.push(p);
                }
            }
            let want: Vec<ActionList> = firsts.into_iter().map(list).collect();
            proptest::prop_assert_eq!(actions.distinct(), &want[..]);
            proptest::prop_assert_eq!(actions.get(picks.len()), None);
        }
    }
}
