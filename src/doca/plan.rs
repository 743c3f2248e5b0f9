//! A validated program lowered to DOCA Flow: the pipes to create on the NIC, each with its
//! match template, action templates, entries and forwarding, in the order they are
//! created (a pipe after every pipe it forwards to); and the pipeline's pipes that stay
//! with the software backend on the Arm cores, each with the reason.
//!
//! A rule the NIC cannot decide (a field DOCA Flow does not parse, an action it does not
//! have) does not take its whole pipe to software: its entries match what the NIC can
//! check of it, a superset of its packets, and send those to the Arm cores, where the
//! software backend runs the pipe from its start. The rest of the pipe (rules before and
//! after, the default) stays in hardware: a gateway answering ARP on the Arm cores still
//! drops, in the NIC, the packets nothing takes.
//!
//! The shapes follow DOCA Flow 3.0 in switch mode, as a BlueField runs it: every port's
//! packets enter one root pipe on the switch port, which sends each to its port's root
//! pipe by `parser_meta.port_id`; a pipe's miss goes to another pipe or drops (`fwd_miss`
//! takes nothing else, so a `default` that does more becomes a pipe of its own, or a
//! control pipe's last entry); a pipe's actions apply in a fixed order (decap, pop, meta,
//! outer modify, tunnel modify, push, encap), so an action list rewriting the packet in
//! another order does not fit one pipe (metadata goes anywhere); `meter`, `mirror` and `dec ttl` each take pipes of their own, where the
//! rest of the action list goes on.

use std::fmt::{self, Write as _};

use super::fields::{
    ethertype_gate, family_selectors, implied_selectors, match_place, set_place, Context, Family,
    Headers, Place, Selector,
};
use crate::ir::{
    Action, ActionList, Encap, Field, FieldId, MeterId, OuterDscp, Pattern, PipeBody, PipeId,
    PortId, Program, ServiceId, Tunnel,
};

/// A control pipe's priorities: 0 (first) to 7 (last), as NVIDIA documents them.
pub const CONTROL_PRIORITIES: usize = 8;

/// Control pipes a rule pipe may take, chained by their misses: 128 priority levels.
pub const MAX_CHAINED: usize = 16;

/// A table pipe's entries `dpuflow plan` names; the rest it counts.
const SHOWN_ENTRIES: usize = 16;

/// Entries one rule may expand to (sets, ranges as prefixes, both IP versions).
pub const ENTRIES_PER_RULE: usize = 64;

/// The index of a pipe in [`Plan::pipes`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct HwId(pub usize);

#[derive(Debug, Clone, PartialEq)]
pub struct Plan {
    pub name: String,
    /// In creation order: each after every pipe it forwards to.
    pub pipes: Vec<HwPipe>,
    /// The root pipe, last created: an entry a port, to its pipeline root.
    pub root: HwId,
    /// The pipeline's pipes the software backend runs, and why each is not in hardware.
    pub software: Vec<(PipeId, String)>,
    /// Rules of pipes in hardware that the software backend decides, and why.
    pub software_rules: Vec<SoftwareRule>,
    /// Shared encapsulation resources (`DOCA_FLOW_SHARED_RESOURCE_ENCAP`), by id.
    pub encaps: Vec<Encap>,
    /// Shared meter resources (`DOCA_FLOW_SHARED_RESOURCE_METER`), by id: the pipeline's
    /// meters that hardware pipes use.
    pub meters: Vec<MeterId>,
    /// Things an operator should know that are not errors.
    pub notes: Vec<String>,
    /// The pipeline's port, pipe and service names, by id, for people.
    names: Names,
}

/// A rule (a table's entries of one action list, a default) of a pipe in hardware that
/// the NIC cannot decide: its entries send the packets it may take to the Arm cores.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SoftwareRule {
    pub pipe: PipeId,
    /// The rule's name, `default`, or a table entry's key.
    pub rule: String,
    pub why: String,
}

#[derive(Debug, Clone, PartialEq)]
struct Names {
    ports: Vec<String>,
    pipes: Vec<String>,
    services: Vec<String>,
    meters: Vec<String>,
}

impl Plan {
    /// Which of the pipeline's `n` pipes have hardware pipes the root reaches.
    fn reached(&self, n: usize) -> Vec<bool> {
        let mut seen = vec![false; self.pipes.len()];
        let mut reached = vec![false; n];
        let mut todo = vec![self.root];
        while let Some(h) = todo.pop() {
            if std::mem::replace(&mut seen[h.0], true) {
                continue;
            }
            let pipe = &self.pipes[h.0];
            if let Some(of) = pipe.of {
                reached[of.index()] = true;
            }
            let fwds = pipe.actions.iter().map(|a| a.fwd).chain([pipe.miss]);
            todo.extend(fwds.filter_map(|f| match f {
                Fwd::Pipe(next) => Some(next),
                _ => None,
            }));
        }
        reached
    }

    /// Non-shared counters the entries use (`doca_flow_cfg_set_nr_counters`).
    pub fn counters(&self) -> usize {
        self.pipes.iter().map(HwPipe::counters).sum()
    }
}

/// DOCA Flow pipe types (`enum doca_flow_pipe_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PipeType {
    Basic,
    Control,
    Lpm,
    /// A hash pipe with the flooding algorithm: every packet goes to each of its entries.
    Flooding,
}

impl PipeType {
    pub fn c_name(self) -> &'static str {
        match self {
            PipeType::Basic => "DOCA_FLOW_PIPE_BASIC",
            PipeType::Control => "DOCA_FLOW_PIPE_CONTROL",
            PipeType::Lpm => "DOCA_FLOW_PIPE_LPM",
            PipeType::Flooding => "DOCA_FLOW_PIPE_HASH",
        }
    }
}

/// What a pipe is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The root: a port's packets to its pipeline root.
    Ports,
    /// A pipeline pipe's rules or table.
    Pipe,
    /// More of a rule pipe's rules, past the first control pipe's eight priorities: the
    /// pipe before misses to it.
    PipeRest,
    /// A pipeline pipe's `default`, when `fwd_miss` cannot be it.
    Default,
    /// Meters the packets of an action list (its monitor's shared meter)...
    Meter,
    /// ...and this one drops those it coloured red, counting each colour.
    MeterColor,
    /// `dec ttl`: drops a packet whose TTL (hop limit) would reach zero, else decrements.
    DecTtl,
    /// `mirror`: entry 0 the packet goes on, entry 1 the copy to the mirror port.
    Mirror,
}

#[derive(Debug, Clone, PartialEq)]
pub struct HwPipe {
    pub name: String,
    pub kind: PipeType,
    pub role: Role,
    pub root: bool,
    /// The pipeline pipe this is (part of); none for the root pipe.
    pub of: Option<PipeId>,
    /// The match template: members fixed for the whole pipe and members each entry sets
    /// (all ones in the template, DOCA Flow's "changeable"). Control pipes have none:
    /// each entry brings its own match and mask.
    pub template: Vec<TemplateItem>,
    /// Action templates, by `action_idx`.
    pub actions: Vec<ActionTemplate>,
    pub entries: Entries,
    /// `fwd_miss`: another pipe or drop.
    pub miss: Fwd,
}

impl HwPipe {
    fn counters(&self) -> usize {
        match &self.entries {
            Entries::Listed(es) => es.iter().filter(|e| self.actions[e.action].counter).count(),
            Entries::Table { indices, .. } => indices
                .iter()
                .filter(|&&i| self.actions[i as usize].counter)
                .count(),
        }
    }

    pub fn entry_count(&self) -> usize {
        match &self.entries {
            Entries::Listed(es) => es.len(),
            Entries::Table { indices, .. } => indices.len(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TemplateItem {
    Fixed(Selector),
    /// Set by each entry: for a table's entries, from its key's fields in the table's
    /// order (an LPM entry's with its prefix length).
    PerEntry {
        member: String,
        shift: u8,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub enum Entries {
    /// Entries given here: a rule pipe's, and the plan's own.
    Listed(Vec<Entry>),
    /// The pipeline table's entries, in its order: entry `i` sets the template's
    /// per-entry members from its key (or prefix) and runs action template `indices[i]`
    /// (the table's distinct action lists are the pipe's action templates). `first`
    /// names the first few, for people.
    Table {
        indices: Vec<u32>,
        first: Vec<String>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// A control pipe entry's priority (0 first).
    pub priority: Option<u32>,
    /// The header types the entry's members are read in, and the members it matches.
    pub selectors: Vec<Selector>,
    pub matches: Vec<EntryMatch>,
    /// Its action template.
    pub action: usize,
    /// The pipeline rule it comes from (its index), if one.
    pub rule: Option<usize>,
    /// What it is, for people: the rule's name, `default`, a port's name.
    pub label: String,
}

/// A member an entry matches: the pipeline field's value and mask, which go in the
/// member shifted left by `shift`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryMatch {
    pub field: Field,
    pub member: String,
    pub shift: u8,
    pub value: u128,
    pub mask: u128,
}

/// What an entry does: steps in DOCA Flow's order, a counter, where the packet goes.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ActionTemplate {
    pub steps: Vec<Step>,
    /// A non-shared counter in the entry's monitor.
    pub counter: bool,
    /// The shared meter (an id into [`Plan::meters`]) in the entry's monitor.
    pub meter: Option<u32>,
    pub fwd: Fwd,
}

impl ActionTemplate {
    /// Only a forward.
    fn to(fwd: Fwd) -> ActionTemplate {
        ActionTemplate {
            steps: Vec::new(),
            counter: false,
            meter: None,
            fwd,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Step {
    /// `decap_cfg` with `is_l2`: the inner Ethernet frame goes on.
    Decap(Tunnel),
    PopVlan,
    /// A member of `doca_flow_actions` (`outer.*`, `meta.pkt_meta`) set to a value, in the
    /// bits of `mask`.
    Modify {
        member: String,
        value: u128,
        mask: u128,
    },
    /// A member of `doca_flow_actions` added to, modulo its width: an action descriptor
    /// of type `DOCA_FLOW_ACTION_ADD` (`dec ttl` adds 0xff to the 8-bit TTL).
    Add {
        member: String,
        value: u128,
    },
    PushVlan {
        vid: u16,
        pcp: u8,
    },
    /// The shared encapsulation resource of this id.
    Encap(u32),
}

impl Step {
    /// Where the step falls in DOCA Flow's fixed order within a pipe; none for metadata,
    /// which no rewrite of the packet depends on, so its place in a list is free.
    fn stage(&self) -> Option<u8> {
        match self {
            Step::Decap(_) => Some(0),
            Step::PopVlan => Some(1),
            Step::Modify { member, .. } if member.starts_with("meta.") => None,
            Step::Modify { .. } | Step::Add { .. } => Some(3),
            Step::PushVlan { .. } => Some(5),
            Step::Encap(_) => Some(6),
        }
    }
}

/// Where an entry sends a packet (`struct doca_flow_fwd`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Fwd {
    Port(PortId),
    Pipe(HwId),
    Drop,
    /// RSS to the Arm cores, where the software backend takes the packet on from this
    /// pipeline pipe (named in the packet's `pkt_meta`).
    Software(PipeId),
    /// To the Arm cores' kernel network stack, where the service's socket is
    /// (`DOCA_FLOW_FWD_TARGET` of `DOCA_FLOW_TARGET_KERNEL`).
    Service(ServiceId),
}

/// Lowers `p` to DOCA Flow. Every port is planned as a DOCA port; those of another driver
/// are noted.
pub fn plan(p: &Program) -> Plan {
    let all = lower(p, &vec![true; p.pipes.len()]);
    // A pipe whose packets all come through pipes in software is the software's: planned
    // again without it.
    let reached = all.reached(p.pipes.len());
    let lowered = |i: usize| all.software.iter().all(|(id, _)| id.index() != i);
    let wanted: Vec<bool> = (0..p.pipes.len())
        .map(|i| reached[i] || !lowered(i))
        .collect();
    if wanted.iter().all(|&w| w) {
        return all;
    }
    lower(p, &wanted)
}

/// The plan with the pipeline pipes of `wanted` in hardware where they can be.
fn lower(p: &Program, wanted: &[bool]) -> Plan {
    let mut planner = Planner {
        p,
        hw: vec![None; p.pipes.len()],
        software: Vec::new(),
        software_rules: Vec::new(),
        pipes: Vec::new(),
        encaps: Vec::new(),
        meters: Vec::new(),
        decaps: Vec::new(),
    };
    for i in post_order(p) {
        let id = PipeId(i as u16);
        if !wanted[i] {
            planner.software.push((
                id,
                "no port's packets reach it through pipes in hardware".into(),
            ));
            continue;
        }
        match planner.lower(id) {
            Ok(entry) => planner.hw[i] = Some(entry),
            Err(why) => planner.software.push((id, why)),
        }
    }
    let mut notes = Vec::new();
    let mut actions = Vec::new();
    let mut entries = Vec::new();
    for (i, port) in p.ports.iter().enumerate() {
        let id = PortId(i as u16);
        if port.driver != crate::ir::Driver::Doca {
            notes.push(format!(
                "port {} has driver {}: planned as the DOCA port it would be",
                port.name,
                port.driver.name()
            ));
        }
        let Some(root) = p.root_of(id) else {
            continue;
        };
        actions.push(ActionTemplate::to(planner.fwd(&Action::Goto(root))));
        entries.push(Entry {
            matches: vec![EntryMatch {
                field: Field {
                    id: FieldId::InPort,
                    inner: false,
                },
                member: "parser_meta.port_id".into(),
                shift: 0,
                value: i as u128,
                mask: 0xffff,
            }],
            label: port.name.clone(),
            ..match_all(actions.len() - 1)
        });
    }
    // Packets of a port no pipe takes are dropped, as the software engine drops them.
    let root = planner.push(HwPipe {
        name: "ports".into(),
        kind: PipeType::Basic,
        role: Role::Ports,
        root: true,
        of: None,
        template: vec![TemplateItem::PerEntry {
            member: "parser_meta.port_id".into(),
            shift: 0,
        }],
        actions,
        entries: Entries::Listed(entries),
        miss: Fwd::Drop,
    });
    // What the software engine's decapsulation checks that DOCA Flow's does not.
    for t in &planner.decaps {
        notes.push(match t {
            Tunnel::Vxlan => "vxlan.decap in hardware also takes VXLAN headers with reserved \
                              bits set, which the software engine drops (vxlan_invalid)"
                .into(),
            Tunnel::Geneve => "geneve.decap in hardware also takes Geneve OAM frames and \
                               critical options, which the software engine drops"
                .into(),
        });
    }
    // ECN across the tunnel (RFC 6040) is the software engine's: the plan has no step
    // that reads one header's ECN field into the other's.
    if !planner.decaps.is_empty() {
        notes.push(
            "decapsulation in hardware leaves the inner packet's ECN field as it is: a \
             Congestion Experienced mark on the outer header is lost, where the software \
             engine copies it inside (or drops the packet if it is not ECN-capable, RFC \
             6040 §4.2)"
                .into(),
        );
    }
    // The software engine answers a packet its encapsulation made too big for the port;
    // the NIC drops it.
    if !planner.encaps.is_empty() {
        notes.push(
            "an encapsulation in hardware sends the outer header Not-ECT (RFC 6040 \
             compatibility mode), where the software engine copies the inner packet's ECN \
             field (normal mode): the fabric drops those packets where it would have \
             marked them"
                .into(),
        );
        notes.push(
            "a packet an encapsulation in hardware makes too big for its port's MTU is \
             dropped by the NIC: its sender is not told the MTU inside the tunnel, as the \
             software engine tells it (ICMP Fragmentation Needed, ICMPv6 Packet Too Big)"
                .into(),
        );
    }
    // The software engine tells a packet's sender its TTL ran out, from the address of
    // the port it came in by; the NIC drops it.
    let expires = planner.pipes.iter().any(|x| x.role == Role::DecTtl);
    if expires && p.ports.iter().any(|x| x.ipv4.is_some() || x.ipv6.is_some()) {
        notes.push(
            "a packet whose TTL (hop limit) runs out in a `dec ttl` in hardware is dropped \
             by the NIC: its sender is not sent the ICMP Time Exceeded the software engine \
             sends from its port's address"
                .into(),
        );
    }
    // The flow cache and connection entries that make IPFIX records are the software
    // engine's: a packet the NIC forwards never meets them.
    if planner.hw.iter().any(Option::is_some) {
        notes.push(
            "IPFIX flow records (`--ipfix`) count only packets that reach the Arm cores: \
             those the pipes in hardware forward or drop are in their counters, in no flow \
             record"
                .into(),
        );
    }
    planner.software.sort_by_key(|(id, _)| *id);
    Plan {
        name: p.name.clone(),
        pipes: planner.pipes,
        root,
        software: planner.software,
        software_rules: planner.software_rules,
        encaps: planner.encaps,
        meters: planner.meters,
        notes,
        names: Names {
            ports: p.ports.iter().map(|x| x.name.clone()).collect(),
            pipes: p.pipes.iter().map(|x| x.name.clone()).collect(),
            services: p.services.iter().map(|x| x.name.clone()).collect(),
            meters: p.meters.iter().map(|x| x.name.clone()).collect(),
        },
    }
}

/// The pipeline's pipes, each after every pipe it goes to (the graph is acyclic).
fn post_order(p: &Program) -> Vec<usize> {
    fn visit(p: &Program, i: usize, seen: &mut [bool], out: &mut Vec<usize>) {
        if std::mem::replace(&mut seen[i], true) {
            return;
        }
        let pipe = &p.pipes[i];
        for list in pipe.body.action_lists().chain([&pipe.miss]) {
            if let Action::Goto(next) = list.terminal() {
                visit(p, next.index(), seen, out);
            }
        }
        out.push(i);
    }
    let mut seen = vec![false; p.pipes.len()];
    let mut out = Vec::with_capacity(p.pipes.len());
    for i in 0..p.pipes.len() {
        visit(p, i, &mut seen, &mut out);
    }
    out
}

struct Planner<'p> {
    p: &'p Program,
    /// The hardware pipe each pipeline pipe starts at, once lowered.
    hw: Vec<Option<HwId>>,
    software: Vec<(PipeId, String)>,
    software_rules: Vec<SoftwareRule>,
    pipes: Vec<HwPipe>,
    encaps: Vec<Encap>,
    meters: Vec<MeterId>,
    /// Tunnels some hardware pipe decapsulates.
    decaps: Vec<Tunnel>,
}

/// The lengths of what a [`Planner`] has made.
#[derive(Debug, Clone, Copy)]
struct Checkpoint {
    pipes: usize,
    encaps: usize,
    meters: usize,
    decaps: usize,
    software_rules: usize,
}

/// What a rule pipe's rules are planned from.
struct RuleSet<'r> {
    rules: &'r [crate::ir::Rule],
    /// What each rule's fields pin down of the headers.
    contexts: Vec<Context>,
    /// Whether a rule can match at all: one an earlier rule covers never does (the
    /// checker warns of it) and takes no entries.
    live: Vec<bool>,
    /// The contexts each rule's entries are made in (see [`families`]).
    variants: Vec<Vec<Context>>,
    /// Which of each rule's fields the NIC matches, and why not the others (see
    /// [`matchable`]).
    kept: Vec<(Vec<bool>, Option<String>)>,
    /// Each rule's priority level (see [`priority_levels`]).
    levels: Vec<u32>,
}

impl<'r> RuleSet<'r> {
    fn of(rules: &'r [crate::ir::Rule]) -> RuleSet<'r> {
        let contexts: Vec<Context> = rules
            .iter()
            .map(|r| {
                Context::of(
                    r.matches
                        .iter()
                        .map(|m| (m.field, exact(m.field, &m.pattern))),
                )
            })
            .collect();
        let plain: Vec<&crate::ir::Rule> = rules.iter().collect();
        let live: Vec<bool> = crate::ir::shadowing(&plain)
            .iter()
            .map(Option::is_none)
            .collect();
        let variants: Vec<Vec<Context>> = rules
            .iter()
            .zip(&contexts)
            .map(|(r, cx)| families(r, cx))
            .collect();
        let kept: Vec<(Vec<bool>, Option<String>)> = rules
            .iter()
            .zip(&variants)
            .map(|(r, v)| matchable(r, v))
            .collect();
        // Priorities by what the entries match: a rule's superset comes after every
        // earlier rule it overlaps, so no two entries of one priority take one packet.
        let widened: Vec<crate::ir::Rule> = rules
            .iter()
            .zip(&kept)
            .map(|(r, (keep, _))| crate::ir::Rule {
                matches: r
                    .matches
                    .iter()
                    .zip(keep)
                    .filter(|(_, &k)| k)
                    .map(|(m, _)| m.clone())
                    .collect(),
                ..r.clone()
            })
            .collect();
        let levels = priority_levels(&widened, &contexts, &live);
        RuleSet {
            rules,
            contexts,
            live,
            variants,
            kept,
            levels,
        }
    }
}

impl Planner<'_> {
    fn push(&mut self, pipe: HwPipe) -> HwId {
        self.pipes.push(pipe);
        HwId(self.pipes.len() - 1)
    }

    /// Plans pipeline pipe `id`, returning the hardware pipe packets enter it by; on
    /// failure, nothing is planned.
    fn lower(&mut self, id: PipeId) -> Result<HwId, String> {
        let before = self.checkpoint();
        let lowered = match &self.p.pipe(id).body {
            PipeBody::Rules(_) => self.lower_rules(id),
            PipeBody::Exact { .. } | PipeBody::Lpm { .. } => self.lower_table(id),
        };
        if lowered.is_err() {
            self.rollback(before);
        }
        lowered
    }

    /// How much the planner has made, to go back to when a part fails.
    fn checkpoint(&self) -> Checkpoint {
        Checkpoint {
            pipes: self.pipes.len(),
            encaps: self.encaps.len(),
            meters: self.meters.len(),
            decaps: self.decaps.len(),
            software_rules: self.software_rules.len(),
        }
    }

    fn rollback(&mut self, to: Checkpoint) {
        self.pipes.truncate(to.pipes);
        self.encaps.truncate(to.encaps);
        self.meters.truncate(to.meters);
        self.decaps.truncate(to.decaps);
        self.software_rules.truncate(to.software_rules);
    }

    /// The template of `list` in pipeline pipe `of`, or where it cannot be one, the
    /// software's: what the list made before it failed is undone, and the reason noted
    /// against the rule `rule` names (asked only then).
    fn template_or_software(
        &mut self,
        of: PipeId,
        rule: impl FnOnce() -> String,
        list: &ActionList,
        cx: &Context,
        has: &[Selector],
    ) -> ActionTemplate {
        let before = self.checkpoint();
        self.template(of, list, cx, has).unwrap_or_else(|why| {
            self.rollback(before);
            self.leave_to_software(of, &rule(), why)
        })
    }

    /// An action template sending packets to the software backend from pipeline pipe
    /// `of`, for `rule`, which the NIC cannot decide because of `why`.
    fn leave_to_software(&mut self, of: PipeId, rule: &str, why: String) -> ActionTemplate {
        self.software_rules.push(SoftwareRule {
            pipe: of,
            rule: rule.into(),
            why,
        });
        ActionTemplate::to(Fwd::Software(of))
    }

    /// Whether a packet entering hardware pipe `h` may be handed to the software backend
    /// further on (which overwrites `pkt_meta` with the pipe to go on from).
    fn may_reach_software(&self, h: HwId) -> bool {
        let mut seen = vec![false; self.pipes.len()];
        let mut todo = vec![h];
        while let Some(h) = todo.pop() {
            if std::mem::replace(&mut seen[h.0], true) {
                continue;
            }
            let pipe = &self.pipes[h.0];
            for fwd in pipe.actions.iter().map(|a| a.fwd).chain([pipe.miss]) {
                match fwd {
                    Fwd::Software(_) => return true,
                    Fwd::Pipe(next) => todo.push(next),
                    _ => {}
                }
            }
        }
        false
    }

    /// The action templates of a rule whose entries for each of `variants` are
    /// `expanded`, pushed to `actions`: the index of each variant's.
    fn rule_templates(
        &mut self,
        id: PipeId,
        rule: &crate::ir::Rule,
        cx: &Context,
        variants: &[Context],
        expanded: &[Vec<EntryKey>],
        actions: &mut Vec<ActionTemplate>,
    ) -> Result<Vec<usize>, String> {
        let per_variant = variants.len() > 1
            && rule
                .actions
                .0
                .iter()
                .any(|a| matches!(a, Action::Set { .. }));
        if !per_variant {
            let all: Vec<EntryKey> = expanded.iter().flatten().cloned().collect();
            actions.push(self.template(id, &rule.actions, cx, &common_selectors(&all))?);
            return Ok(vec![actions.len() - 1; variants.len()]);
        }
        variants
            .iter()
            .zip(expanded)
            .map(|(fcx, variant)| {
                let has = common_selectors(variant);
                actions.push(self.template(id, &rule.actions, fcx, &has)?);
                Ok(actions.len() - 1)
            })
            .collect()
    }

    /// The action templates and entries of a rule pipe's rules, those at priority levels
    /// up to `upto` (all without). A rule the NIC cannot decide gets entries matching
    /// what it can check of it, sending those packets to software from pipe `id`.
    fn plan_rules(
        &mut self,
        id: PipeId,
        set: &RuleSet,
        upto: Option<u32>,
    ) -> (Vec<ActionTemplate>, Vec<Entry>) {
        let mut actions = Vec::with_capacity(set.rules.len() + 1);
        let mut entries = Vec::new();
        for (i, rule) in set.rules.iter().enumerate() {
            if !set.live[i] || upto.is_some_and(|u| set.levels[i] > u) {
                continue;
            }
            // Entries for each IP version the rule's fields or rewrites need told apart,
            // each version's with its own template when the rule rewrites the packet (a
            // rewrite is planned only for headers its entries make sure of).
            let (keep, unmatchable) = &set.kept[i];
            let variants = &set.variants[i];
            let expanded: Vec<Vec<EntryKey>> = variants
                .iter()
                .map(|fcx| rule_entries(rule, keep, fcx, variants.len() > 1))
                .collect();
            let before = (self.checkpoint(), actions.len());
            let planned = match unmatchable {
                Some(why) => Err(why.clone()),
                None => {
                    let cx = &set.contexts[i];
                    self.rule_templates(id, rule, cx, variants, &expanded, &mut actions)
                }
            };
            let chosen = planned.unwrap_or_else(|why| {
                self.rollback(before.0);
                actions.truncate(before.1);
                let to = self.leave_to_software(id, &rule.name, why);
                let a = actions.iter().position(|a| *a == to).unwrap_or_else(|| {
                    actions.push(to);
                    actions.len() - 1
                });
                vec![a; expanded.len()]
            });
            for (variant, action) in expanded.into_iter().zip(chosen) {
                for (selectors, matches) in variant {
                    entries.push(Entry {
                        priority: Some(set.levels[i]),
                        selectors,
                        matches,
                        action,
                        rule: Some(i),
                        label: rule.name.clone(),
                    });
                }
            }
        }
        (actions, entries)
    }

    /// A rule pipe as a control pipe: each rule expanded to an entry per combination of its
    /// fields' alternatives, at a priority after every earlier rule it overlaps (see
    /// [`priority_levels`]); a `default` with more than a drop or a goto as a last,
    /// match-all entry. A rule the NIC cannot decide sends what it may take to software
    /// (see [`matchable`]); the pipe is left to software whole when the NIC would decide
    /// no packet in it.
    fn lower_rules(&mut self, id: PipeId) -> Result<HwId, String> {
        let pipe = self.p.pipe(id);
        let PipeBody::Rules(rules) = &pipe.body else {
            unreachable!("lower_rules takes rule pipes");
        };
        let set = RuleSet::of(rules);
        let first_software = self.software_rules.len();
        let start = self.checkpoint();
        let (mut actions, mut entries) = self.plan_rules(id, &set, None);
        // From a rule the NIC can check nothing of, every packet goes to software: what
        // comes after it is never reached, and is planned again without it.
        let software = Fwd::Software(id);
        let cut = entries
            .iter()
            .filter(|e| actions[e.action].fwd == software)
            .filter(|e| e.selectors.is_empty() && e.matches.is_empty())
            .filter_map(|e| e.priority)
            .min();
        if let Some(c) = cut.filter(|&c| entries.iter().any(|e| e.priority > Some(c))) {
            self.rollback(start);
            (actions, entries) = self.plan_rules(id, &set, Some(c));
        }
        let mut decided = entries
            .iter()
            .any(|e| actions[e.action].fwd != software && cut.is_none_or(|c| e.priority < Some(c)));
        // The default overlaps every rule: it comes after them all.
        let mut used = match cut {
            Some(c) => c + 1,
            None => set.levels.iter().max().map_or(0, |l| l + 1),
        };
        let miss = match (cut, self.miss_fwd(&pipe.miss)) {
            (Some(_), _) => Fwd::Drop,
            (None, Some(fwd)) => {
                decided = true;
                fwd
            }
            (None, None) => {
                let a = self.template_or_software(
                    id,
                    || "default".into(),
                    &pipe.miss,
                    &Context::default(),
                    &[],
                );
                decided |= a.fwd != software;
                actions.push(a);
                entries.push(Entry {
                    priority: Some(used),
                    ..match_all(actions.len() - 1)
                });
                used += 1;
                Fwd::Drop
            }
        };
        if !decided {
            return Err(self.software_rules.get(first_software).map_or_else(
                || "the NIC would decide none of its packets".into(),
                |r| match r.rule.as_str() {
                    "default" => format!("default: {}", r.why),
                    name => format!("rule {name}: {}", r.why),
                },
            ));
        }
        // Eight priorities a control pipe: deeper rules go on in control pipes chained by
        // their misses, each taking the next eight levels. A packet reaches a level only
        // if it matched nothing at the levels before, which is what priority gives.
        let chained = (used as usize).div_ceil(CONTROL_PRIORITIES).max(1);
        if chained > MAX_CHAINED {
            return Err(format!(
                "{used} priorities (rules that overlap one another, and a default that does \
                 more than drop or go to a pipe): more than {MAX_CHAINED} control pipes of \
                 {CONTROL_PRIORITIES}"
            ));
        }
        let mut by_pipe: Vec<Vec<Entry>> = vec![Vec::new(); chained];
        for mut e in entries {
            let level = e.priority.unwrap_or(0) as usize;
            e.priority = Some((level % CONTROL_PRIORITIES) as u32);
            by_pipe[level / CONTROL_PRIORITIES].push(e);
        }
        let mut next = miss;
        for (k, mut entries) in by_pipe.into_iter().enumerate().rev() {
            // Each pipe holds the templates its entries use.
            let mut used: Vec<Option<usize>> = vec![None; actions.len()];
            let mut own = Vec::new();
            for e in &mut entries {
                e.action = *used[e.action].get_or_insert_with(|| {
                    own.push(actions[e.action].clone());
                    own.len() - 1
                });
            }
            next = Fwd::Pipe(self.push(HwPipe {
                name: if k == 0 {
                    pipe.name.clone()
                } else {
                    format!("{}.{k}", pipe.name)
                },
                kind: PipeType::Control,
                role: if k == 0 { Role::Pipe } else { Role::PipeRest },
                root: false,
                of: Some(id),
                template: Vec::new(),
                actions: own,
                entries: Entries::Listed(entries),
                miss: next,
            }));
        }
        match next {
            Fwd::Pipe(first) => Ok(first),
            _ => unreachable!("at least one control pipe"),
        }
    }

    /// An exact table as a basic pipe, an LPM table as an LPM pipe.
    fn lower_table(&mut self, id: PipeId) -> Result<HwId, String> {
        let pipe = self.p.pipe(id);
        let (fields, actions, kind) = match &pipe.body {
            PipeBody::Exact {
                fields, actions, ..
            } => (fields.clone(), actions, PipeType::Basic),
            PipeBody::Lpm { field, actions, .. } => (vec![*field], actions, PipeType::Lpm),
            PipeBody::Rules(_) => unreachable!("lower_table takes tables"),
        };
        let cx = Context::of(fields.iter().map(|f| (*f, None)));
        let mut selectors = Vec::new();
        let mut per_entry = Vec::new();
        for f in &fields {
            let Place {
                member,
                selectors: s,
                shift,
            } = match_place(*f, &cx)?;
            selectors.extend(s);
            per_entry.push(TemplateItem::PerEntry { member, shift });
        }
        selectors.sort();
        selectors.dedup();
        let indices = actions.indices();
        let templates: Vec<ActionTemplate> = actions
            .distinct()
            .iter()
            .enumerate()
            .map(|(k, l)| {
                // Named for people by the entries taking it.
                let label = || {
                    let mut users = (0..indices.len()).filter(|&i| indices[i] as usize == k);
                    let first = users
                        .next()
                        .map_or_else(String::new, |i| pipe.entry_name(i));
                    match users.count() {
                        0 => first,
                        more => format!("{first} and {more} more entries with its actions"),
                    }
                };
                self.template_or_software(id, label, l, &cx, &selectors)
            })
            .collect();
        let miss = self.miss(id);
        let software = Fwd::Software(id);
        let miss_decided = match miss {
            Fwd::Pipe(h) => {
                self.pipes[h.0].role != Role::Default || self.pipes[h.0].actions[0].fwd != software
            }
            _ => true,
        };
        if !miss_decided && templates.iter().all(|t| t.fwd == software) {
            return Err(self
                .software_rules
                .last()
                .map_or_else(String::new, |r| format!("default: {}", r.why)));
        }
        let template = selectors
            .into_iter()
            .map(TemplateItem::Fixed)
            .chain(per_entry)
            .collect();
        Ok(self.push(HwPipe {
            name: pipe.name.clone(),
            kind,
            role: Role::Pipe,
            root: false,
            of: Some(id),
            template,
            actions: templates,
            entries: Entries::Table {
                indices: actions.indices().to_vec(),
                first: (0..actions.len().min(SHOWN_ENTRIES))
                    .map(|i| pipe.entry_name(i))
                    .collect(),
            },
            miss,
        }))
    }

    /// Where a table's misses go: its `default` as `fwd_miss` when that is a drop or a
    /// goto, else a basic pipe of one match-all entry running it.
    fn miss(&mut self, id: PipeId) -> Fwd {
        let pipe = self.p.pipe(id);
        if let Some(fwd) = self.miss_fwd(&pipe.miss) {
            return fwd;
        }
        let template = self.template_or_software(
            id,
            || "default".into(),
            &pipe.miss,
            &Context::default(),
            &[],
        );
        Fwd::Pipe(self.push(HwPipe {
            name: format!("{}.default", pipe.name),
            kind: PipeType::Basic,
            role: Role::Default,
            root: false,
            of: Some(id),
            template: Vec::new(),
            actions: vec![template],
            entries: Entries::Listed(vec![match_all(0)]),
            miss: Fwd::Drop,
        }))
    }

    /// The `fwd_miss` a `default` is by itself, if it is one DOCA Flow takes (a drop, or
    /// a goto to a hardware pipe).
    fn miss_fwd(&self, list: &ActionList) -> Option<Fwd> {
        if list.0.len() > 1 {
            return None;
        }
        match self.fwd(list.terminal()) {
            fwd @ (Fwd::Drop | Fwd::Pipe(_)) => Some(fwd),
            _ => None,
        }
    }

    fn fwd(&self, terminal: &Action) -> Fwd {
        match terminal {
            Action::Fwd(port) => Fwd::Port(*port),
            Action::Goto(next) => self.hw[next.index()].map_or(Fwd::Software(*next), Fwd::Pipe),
            Action::ToService(s) => Fwd::Service(*s),
            _ => Fwd::Drop,
        }
    }

    /// An action list as pipeline pipe `of`'s entries apply it, or why they cannot.
    /// `has`: the header types (selectors) every packet the entries take is sure to have.
    fn template(
        &mut self,
        of: PipeId,
        list: &ActionList,
        cx: &Context,
        has: &[Selector],
    ) -> Result<ActionTemplate, String> {
        let (actions, terminal) = list.0.split_at(list.0.len() - 1);
        let scope = Scope {
            cx,
            has: has.to_vec(),
            marked: false,
        };
        let mut first = self.stage(of, actions, &terminal[0], scope)?;
        // `count` counts the rule's matches, as the engine does, wherever it stands in
        // the list: on the rule's own entries, before a meter or a TTL check drops some.
        first.counter = actions.contains(&Action::Count);
        Ok(first)
    }

    /// `actions` then `terminal` as a template: the steps one pipe applies up to the first
    /// action that takes a pipe of its own (`meter`, `mirror`, `dec ttl`), whose pipes
    /// take the rest.
    fn stage(
        &mut self,
        of: PipeId,
        actions: &[Action],
        terminal: &Action,
        mut scope: Scope,
    ) -> Result<ActionTemplate, String> {
        let cx = scope.cx;
        let mut steps: Vec<Step> = Vec::new();
        for (k, a) in actions.iter().enumerate() {
            let rest = &actions[k + 1..];
            let step = match a {
                // Counted on the rule's entries (see `template`).
                Action::Count => continue,
                Action::Decap(t) => Step::Decap(*t),
                Action::VlanPop => Step::PopVlan,
                Action::VlanPush { vid, pcp } => Step::PushVlan {
                    vid: *vid,
                    pcp: *pcp,
                },
                Action::Mark(m) => Step::Modify {
                    member: "meta.pkt_meta".into(),
                    value: u128::from(*m),
                    mask: u128::from(u32::MAX),
                },
                Action::Set { field, value } => {
                    let (step, needs) = modify(*field, *value, cx)?;
                    // The engine leaves a packet without the header as it is; a rewrite
                    // in hardware is planned only for packets sure to have it.
                    if !needs.iter().all(|n| scope.has.contains(n)) {
                        return Err(format!(
                            "`{}` on packets that may lack the header it rewrites (the \
                             engine leaves those as they are): match a field of that \
                             header too",
                            self.p.describe(a)
                        ));
                    }
                    step
                }
                Action::Encap(e) if e.dscp == OuterDscp::Inherit => {
                    return Err(format!(
                        "`{}.encap {{ dscp inherit }}`: a DOCA Flow encapsulation's outer \
                         header is fixed, so the inner packet's DSCP is copied into it on \
                         the Arm cores",
                        e.tunnel.name()
                    ))
                }
                Action::Encap(e) => Step::Encap(self.encap(e)),
                Action::Meter(_) | Action::Mirror(_) | Action::DecTtl { .. } => {
                    scope.marked |= marks(&steps);
                    let next = match a {
                        Action::Meter(m) => self.meter(of, *m, rest, terminal, scope)?,
                        Action::Mirror(port) => self.mirror(of, *port, rest, terminal, scope)?,
                        _ => self.dec_ttl(of, rest, terminal, scope)?,
                    };
                    return Ok(ActionTemplate {
                        steps,
                        counter: false,
                        meter: None,
                        fwd: Fwd::Pipe(next),
                    });
                }
                Action::CtCommit { .. } => {
                    return Err(
                        "`ct.commit`: connection tracking runs on the Arm cores (DOCA \
                         Flow CT is not planned yet)"
                            .into(),
                    )
                }
                Action::ClampMss(_) | Action::ClampMssToMtu => {
                    return Err("`clamp tcp.mss`: DOCA Flow does not rewrite TCP options".into())
                }
                Action::ArpReply(_) | Action::NdAdvert { .. } | Action::EchoReply => {
                    return Err(format!(
                        "`{}`: DOCA Flow does not turn a request into its answer",
                        self.p.describe(a)
                    ))
                }
                Action::Fwd(_) | Action::Goto(_) | Action::Drop | Action::ToService(_) => {
                    unreachable!("only the last action is terminal")
                }
            };
            let latest = steps.iter().filter_map(Step::stage).max();
            if let (Some(latest), Some(stage)) = (latest, step.stage()) {
                if latest > stage {
                    return Err(format!(
                        "`{}` comes after an action DOCA Flow applies later in a pipe \
                         (decap, pop, meta, modify, push, encap)",
                        self.p.describe(a)
                    ));
                }
            }
            match step {
                // The packet's headers are then its inner ones, or without the tag.
                Step::Decap(t) => {
                    scope.has.clear();
                    if !self.decaps.contains(&t) {
                        self.decaps.push(t);
                    }
                }
                Step::PopVlan => scope
                    .has
                    .retain(|s| !s.member.ends_with("l2_valid_headers")),
                _ => {}
            }
            steps.push(step);
        }
        let fwd = self.fwd(terminal);
        let to_software = match fwd {
            Fwd::Software(_) => true,
            Fwd::Pipe(next) => self.may_reach_software(next),
            _ => false,
        };
        if (scope.marked || marks(&steps)) && to_software {
            return Err(
                "a mark on a packet that may go on to the Arm cores: pkt_meta carries where \
                 the software backend takes it on"
                    .into(),
            );
        }
        Ok(ActionTemplate {
            steps,
            counter: false,
            meter: None,
            fwd,
        })
    }

    /// `meter m` and what follows it: a pipe whose monitor meters with the shared meter,
    /// then one that drops what it coloured red and sends the rest on, each colour's
    /// packets counted by their own entry (`parser_meta.meter_color`).
    fn meter(
        &mut self,
        of: PipeId,
        m: MeterId,
        rest: &[Action],
        terminal: &Action,
        scope: Scope,
    ) -> Result<HwId, String> {
        // The hardware meters once the entry's actions are applied: one that changes the
        // packet's size after the meter would change what a byte meter measures.
        if let Some(a) = rest.iter().find(|a| resizes(a)) {
            return Err(format!(
                "`{}` after a meter: DOCA Flow meters once every rewrite is done",
                self.p.describe(a)
            ));
        }
        let name = &self.p.meters[m.index()].name;
        let id = match self.meters.iter().position(|x| *x == m) {
            Some(i) => i,
            None => {
                self.meters.push(m);
                self.meters.len() - 1
            }
        } as u32;
        let mut pass = self.stage(of, rest, terminal, scope)?;
        pass.counter = true;
        // The colours are disjoint: one priority.
        let colour = |value| Entry {
            priority: Some(0),
            selectors: vec![Selector {
                member: "parser_meta.meter_color".into(),
                value,
            }],
            ..match_all(usize::from(value != "DOCA_FLOW_METER_COLOR_RED"))
        };
        let pipe_name = &self.p.pipe(of).name;
        let colours = self.push(HwPipe {
            name: format!("{pipe_name}.meter_{name}.color"),
            kind: PipeType::Control,
            role: Role::MeterColor,
            root: false,
            of: Some(of),
            template: Vec::new(),
            actions: vec![
                ActionTemplate {
                    counter: true,
                    ..ActionTemplate::to(Fwd::Drop)
                },
                pass,
            ],
            entries: Entries::Listed(vec![
                Entry {
                    label: "red".into(),
                    ..colour("DOCA_FLOW_METER_COLOR_RED")
                },
                Entry {
                    label: "yellow".into(),
                    ..colour("DOCA_FLOW_METER_COLOR_YELLOW")
                },
                Entry {
                    label: "green".into(),
                    ..colour("DOCA_FLOW_METER_COLOR_GREEN")
                },
            ]),
            miss: Fwd::Drop,
        });
        Ok(self.push(HwPipe {
            name: format!("{pipe_name}.meter_{name}"),
            kind: PipeType::Basic,
            role: Role::Meter,
            root: false,
            of: Some(of),
            template: Vec::new(),
            actions: vec![ActionTemplate {
                meter: Some(id),
                ..ActionTemplate::to(Fwd::Pipe(colours))
            }],
            entries: Entries::Listed(vec![Entry {
                label: "meter".into(),
                ..match_all(0)
            }]),
            miss: Fwd::Drop,
        }))
    }

    /// `mirror port` and what follows it: a flooding hash pipe whose entry 0 takes the
    /// packet on (the rest of its actions) and entry 1 sends the copy, as it is at the
    /// mirror, out of `port`. Entry 0 is the one whose packets DOCA Flow keeps in order.
    fn mirror(
        &mut self,
        of: PipeId,
        port: PortId,
        rest: &[Action],
        terminal: &Action,
        scope: Scope,
    ) -> Result<HwId, String> {
        let on = self.stage(of, rest, terminal, scope)?;
        let entry = |i: usize| Entry {
            label: if i == 0 { "packet" } else { "copy" }.into(),
            ..match_all(i)
        };
        Ok(self.push(HwPipe {
            name: format!("{}.mirror_{}", self.p.pipe(of).name, self.p.port(port).name),
            kind: PipeType::Flooding,
            role: Role::Mirror,
            root: false,
            of: Some(of),
            template: Vec::new(),
            actions: vec![on, ActionTemplate::to(Fwd::Port(port))],
            entries: Entries::Listed(vec![entry(0), entry(1)]),
            miss: Fwd::Drop,
        }))
    }

    /// `dec ttl` and what follows it: a control pipe that drops an IPv4 packet whose TTL,
    /// or an IPv6 one whose hop limit, is 0 or 1, decrements the others', and leaves
    /// other packets be, as the software engine does; the rest of the actions after.
    fn dec_ttl(
        &mut self,
        of: PipeId,
        rest: &[Action],
        terminal: &Action,
        scope: Scope,
    ) -> Result<HwId, String> {
        let on = self.stage(of, rest, terminal, scope)?;
        if on.steps.iter().any(|s| s.stage().is_some_and(|x| x < 3)) {
            return Err(
                "a decap or a VLAN pop after `dec ttl`: DOCA Flow applies those before it \
                 modifies"
                    .into(),
            );
        }
        let ttl = Field {
            id: FieldId::IpTtl,
            inner: false,
        };
        let mut actions = vec![ActionTemplate {
            counter: true,
            ..ActionTemplate::to(Fwd::Drop)
        }];
        let mut entries = Vec::new();
        for family in [Family::V4, Family::V6] {
            let cx = Context {
                outer: Headers {
                    family: Some(family),
                    ..Headers::default()
                },
                ..Context::default()
            };
            let place = match_place(ttl, &cx)?;
            let expiring = EntryMatch {
                field: ttl,
                member: place.member.clone(),
                shift: 0,
                value: 0,
                mask: 0xfe,
            };
            entries.push(Entry {
                priority: Some(0),
                selectors: place.selectors.clone(),
                matches: vec![expiring],
                label: "expiring".into(),
                ..match_all(0)
            });
            let mut decrement = on.clone();
            decrement.steps.insert(
                0,
                Step::Add {
                    member: place.member,
                    value: 0xff,
                },
            );
            actions.push(decrement);
            entries.push(Entry {
                priority: Some(1),
                selectors: place.selectors,
                label: "decrement".into(),
                ..match_all(actions.len() - 1)
            });
        }
        actions.push(on);
        entries.push(Entry {
            priority: Some(2),
            label: "not ip".into(),
            ..match_all(actions.len() - 1)
        });
        Ok(self.push(HwPipe {
            name: format!("{}.dec_ttl", self.p.pipe(of).name),
            kind: PipeType::Control,
            role: Role::DecTtl,
            root: false,
            of: Some(of),
            template: Vec::new(),
            actions,
            entries: Entries::Listed(entries),
            miss: Fwd::Drop,
        }))
    }

    /// The id of the shared encapsulation resource for `e`, created on first use.
    fn encap(&mut self, e: &Encap) -> u32 {
        let i = match self.encaps.iter().position(|x| x == e) {
            Some(i) => i,
            None => {
                self.encaps.push(e.clone());
                self.encaps.len() - 1
            }
        };
        i as u32
    }
}

/// The contexts a rule's entries are made in: its own, or, when nothing pins the IP
/// version and the rule matches a field of either version (`ip.proto`, `ip.ttl`, …) or,
/// matching IP packets only, rewrites one (`set ip.dscp`), one for each: DOCA Flow reads
/// and writes the field in the IPv4 or the IPv6 header.
fn families(rule: &crate::ir::Rule, cx: &Context) -> Vec<Context> {
    let either = |f: &Field| {
        !f.inner
            && matches!(
                f.id,
                FieldId::IpProto | FieldId::IpDscp | FieldId::IpEcn | FieldId::IpTtl
            )
    };
    let matches_either = rule.matches.iter().any(|m| either(&m.field));
    let ip_only = matches_either
        || cx.outer.proto.is_some()
        || rule
            .matches
            .iter()
            .any(|m| !m.field.inner && matches!(m.field.id, FieldId::L4Src | FieldId::L4Dst));
    let sets_either = rule
        .actions
        .0
        .iter()
        .any(|a| matches!(a, Action::Set { field, .. } if either(field)));
    if cx.outer.family.is_some() || !(matches_either || sets_either && ip_only) {
        return vec![*cx];
    }
    [Family::V4, Family::V6]
        .into_iter()
        .map(|family| Context {
            outer: Headers {
                family: Some(family),
                ..cx.outer
            },
            ..*cx
        })
        .collect()
}

/// The selectors every one of `entries` has: the headers a packet any of them takes is
/// sure to have.
fn common_selectors(entries: &[EntryKey]) -> Vec<Selector> {
    entries.first().map_or(Vec::new(), |(first, _)| {
        first
            .iter()
            .filter(|s| entries.iter().all(|(other, _)| other.contains(s)))
            .cloned()
            .collect()
    })
}

/// Whether the steps set `pkt_meta`.
fn marks(steps: &[Step]) -> bool {
    steps
        .iter()
        .any(|s| matches!(s, Step::Modify { member, .. } if member == "meta.pkt_meta"))
}

/// Whether an action changes a packet's length.
fn resizes(a: &Action) -> bool {
    matches!(
        a,
        Action::Encap(_) | Action::Decap(_) | Action::VlanPush { .. } | Action::VlanPop
    )
}

/// `set field value` as a step, and the header types a packet needs for it.
fn modify(field: Field, value: u128, cx: &Context) -> Result<(Step, Vec<Selector>), String> {
    let place = set_place(field, cx)?;
    let mask = field.kind().full_mask() << place.shift;
    let step = Step::Modify {
        member: place.member,
        value: value << place.shift,
        mask,
    };
    Ok((step, place.selectors))
}

/// What an action list's stages know as they are planned: the match context, the header
/// types every packet they take is sure to have, whether an earlier stage set `pkt_meta`.
#[derive(Debug, Clone)]
struct Scope<'c> {
    cx: &'c Context,
    has: Vec<Selector>,
    marked: bool,
}

/// An entry matching every packet, running action template `action`.
fn match_all(action: usize) -> Entry {
    Entry {
        priority: None,
        selectors: Vec::new(),
        matches: Vec::new(),
        action,
        rule: None,
        label: "default".into(),
    }
}

/// A priority for each rule that can match (`live`), 0 first: one after the highest of
/// the earlier such rules it overlaps. First match wins only between rules some packet
/// matches both of, so rules no packet can match together share a priority, and a
/// control pipe's eight take many more than eight rules (the firewall's rules on
/// different ports or protocols, a gateway's on different VNIs, are all at 0). Rules
/// overlap unless their headers are disjoint or a field both match has disjoint values.
fn priority_levels(rules: &[crate::ir::Rule], contexts: &[Context], live: &[bool]) -> Vec<u32> {
    let plain: Vec<&crate::ir::Rule> = rules.iter().collect();
    let boxes = crate::ir::interval_boxes(&plain);
    let overlap = |j: usize, i: usize| {
        !disjoint_headers(&contexts[j], &contexts[i])
            && match (&boxes[j], &boxes[i]) {
                (Some(a), Some(b)) => a
                    .iter()
                    .zip(b)
                    .all(|(&(alo, ahi), &(blo, bhi))| alo <= bhi && blo <= ahi),
                _ => fields_overlap(&rules[j], &rules[i]),
            }
    };
    let mut levels: Vec<u32> = Vec::with_capacity(rules.len());
    for i in 0..rules.len() {
        let level = (0..i)
            .filter(|&j| live[i] && live[j] && overlap(j, i))
            .map(|j| levels[j] + 1)
            .max()
            .unwrap_or(0);
        levels.push(level);
    }
    levels
}

/// Whether two rules' fields pin different IP versions, transport protocols or tunnels:
/// no packet has both a TCP and a UDP header, nor an ARP and an IP one.
fn disjoint_headers(a: &Context, b: &Context) -> bool {
    fn differ<T: PartialEq>(x: Option<T>, y: Option<T>) -> bool {
        matches!((x, y), (Some(x), Some(y)) if x != y)
    }
    let ip = |h: &Headers| h.family.is_some() || h.proto.is_some();
    [(a.outer, b.outer), (a.inner, b.inner)]
        .iter()
        .any(|(x, y)| {
            differ(x.family, y.family)
                || differ(x.proto, y.proto)
                || x.not_ip && ip(y)
                || y.not_ip && ip(x)
        })
        || differ(a.tunnel, b.tunnel)
}

/// Whether some packet may match both rules' patterns: `false` only when a field both
/// match has disjoint ones.
fn fields_overlap(a: &crate::ir::Rule, b: &crate::ir::Rule) -> bool {
    a.matches.iter().all(|ma| {
        b.matches
            .iter()
            .find(|mb| mb.field == ma.field)
            .is_none_or(|mb| ma.pattern.intersects(&mb.pattern, ma.field.kind()))
    })
}

/// The value `field` is matched with exactly, if one.
fn exact(field: Field, p: &Pattern) -> Option<u128> {
    match *p {
        Pattern::Masked { value, mask } if mask == field.kind().full_mask() => Some(value),
        _ => None,
    }
}

/// What an entry of a control pipe matches: the header types its members are read in,
/// and the members.
type EntryKey = (Vec<Selector>, Vec<EntryMatch>);

/// Which of a rule's fields the NIC matches in every one of its `variants` (contexts),
/// and why it cannot match the first it does not: a field DOCA Flow does not parse, or
/// one whose values would take the rule past [`ENTRIES_PER_RULE`] entries. Entries
/// without the others take a superset of the rule's packets.
fn matchable(rule: &crate::ir::Rule, variants: &[Context]) -> (Vec<bool>, Option<String>) {
    let mut keep = Vec::with_capacity(rule.matches.len());
    let mut why = None;
    let mut entries = 1;
    for m in &rule.matches {
        let alternatives = variants
            .iter()
            .map(|cx| field_alternatives(m.field, &m.pattern, cx).map(|a| a.len()))
            .try_fold(0, |most, n| n.map(|n| most.max(n)));
        let fits = match alternatives {
            Ok(n) if entries * n <= ENTRIES_PER_RULE => {
                entries *= n.max(1);
                true
            }
            Ok(_) => {
                why.get_or_insert_with(|| {
                    format!("its fields' values need more than {ENTRIES_PER_RULE} entries")
                });
                false
            }
            Err(e) => {
                why.get_or_insert(e);
                false
            }
        };
        keep.push(fits);
    }
    (keep, why)
}

/// The entries a rule's matches expand to in context `cx`: each a choice of one
/// (value, mask) per field it `keep`s, with the header types the others imply (see
/// [`implied_selectors`]); `split`: the rule has entries for each IP version, these
/// taking only packets of `cx`'s.
fn rule_entries(rule: &crate::ir::Rule, keep: &[bool], cx: &Context, split: bool) -> Vec<EntryKey> {
    let mut entries: Vec<EntryKey> = vec![(Vec::new(), Vec::new())];
    for (m, &kept) in rule.matches.iter().zip(keep) {
        let implied = || vec![(implied_selectors(m.field, &m.pattern, cx), Vec::new())];
        let alternatives = if kept {
            field_alternatives(m.field, &m.pattern, cx).unwrap_or_else(|_| implied())
        } else {
            implied()
        };
        entries = entries
            .into_iter()
            .flat_map(|(selectors, matches)| {
                alternatives.iter().map(move |(more, m)| {
                    let mut s = selectors.clone();
                    s.extend(more.iter().cloned());
                    let mut ms = matches.clone();
                    ms.extend(m.iter().cloned());
                    (s, ms)
                })
            })
            .collect();
    }
    for (selectors, _) in &mut entries {
        if let (true, Some(family)) = (split, cx.outer.family) {
            selectors.extend(family_selectors("outer", family));
        }
        selectors.sort();
        selectors.dedup();
    }
    entries.retain(|key| !contradictory(key));
    entries
}

/// Whether an entry's (sorted, deduplicated) selectors or its matches set one member to
/// two values: `ipv4.dst` with `eth.type 0x86dd`, `udp.dst 443` with `l4.dst 53`. No
/// packet has both, and no entry can hold both.
fn contradictory((selectors, matches): &EntryKey) -> bool {
    let at = |m: &EntryMatch| (m.value << m.shift, m.mask << m.shift);
    selectors.windows(2).any(|w| w[0].member == w[1].member)
        || matches.iter().enumerate().any(|(i, a)| {
            matches[i + 1..].iter().any(|b| {
                let ((av, am), (bv, bm)) = (at(a), at(b));
                a.member == b.member && (av ^ bv) & am & bm != 0
            })
        })
}

/// The ways an entry can match `field` by `pattern`: each some selectors and at most one
/// member. `eth.type` of IPv4 or IPv6 is a selector alone (the parser's verdict).
fn field_alternatives(
    field: Field,
    pattern: &Pattern,
    cx: &Context,
) -> Result<Vec<EntryKey>, String> {
    let too_many = || format!("{field}: its values need more than {ENTRIES_PER_RULE} entries");
    let alternatives = masks(pattern, field.kind().bits()).ok_or_else(too_many)?;
    if field.id == FieldId::EthType {
        return alternatives
            .into_iter()
            .map(|(value, mask)| {
                if mask != field.kind().full_mask() {
                    return Err(format!("{field}: DOCA Flow matches whole EtherTypes only"));
                }
                Ok((ethertype_gate(field, value, cx)?, Vec::new()))
            })
            .collect();
    }
    let place = match_place(field, cx)?;
    Ok(alternatives
        .into_iter()
        .map(|(value, mask)| {
            let m = EntryMatch {
                field,
                member: place.member.clone(),
                shift: place.shift,
                value,
                mask,
            };
            (place.selectors.clone(), vec![m])
        })
        .collect())
}

/// A pattern on a `bits`-wide field as (value, mask) pairs whose union it is: ranges
/// split into prefixes; `None` past [`ENTRIES_PER_RULE`].
fn masks(p: &Pattern, bits: u8) -> Option<Vec<(u128, u128)>> {
    let mut out = Vec::new();
    let add = |p: &Pattern, out: &mut Vec<(u128, u128)>| match *p {
        Pattern::Masked { value, mask } => out.push((value, mask)),
        Pattern::Range { lo, hi } => range_prefixes(lo, hi, bits, out),
        Pattern::Any(_) => unreachable!("sets are flat"),
    };
    match p {
        Pattern::Any(ps) => ps.iter().for_each(|p| add(p, &mut out)),
        p => add(p, &mut out),
    }
    (out.len() <= ENTRIES_PER_RULE).then_some(out)
}

/// Splits `lo..=hi` into the fewest aligned prefixes, as (value, mask) on `bits` bits.
fn range_prefixes(mut lo: u128, hi: u128, bits: u8, out: &mut Vec<(u128, u128)>) {
    let full = if bits >= 128 {
        u128::MAX
    } else {
        (1u128 << bits) - 1
    };
    while lo <= hi {
        // The largest block starting at `lo` that is aligned and stays within `hi`.
        let mut size_log = if lo == 0 {
            u32::from(bits)
        } else {
            lo.trailing_zeros()
        };
        while size_log > 0 && (size_log >= 128 || lo + ((1u128 << size_log) - 1) > hi) {
            size_log -= 1;
        }
        let host = if size_log >= 128 {
            u128::MAX
        } else {
            (1u128 << size_log) - 1
        };
        out.push((lo, full & !host));
        match (lo | host).checked_add(1) {
            Some(next) if lo | host < hi => lo = next,
            _ => break,
        }
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let entries: usize = self.pipes.iter().map(HwPipe::entry_count).sum();
        writeln!(
            f,
            "plan {}: {} DOCA Flow pipes, {entries} entries, {} counters, {} shared encaps, \
             {} shared meters; {} pipeline pipes and {} rules in software",
            self.name,
            self.pipes.len(),
            self.counters(),
            self.encaps.len(),
            self.meters.len(),
            self.software.len(),
            self.software_rules.len()
        )?;
        for note in &self.notes {
            writeln!(f, "note: {note}")?;
        }
        for (i, e) in self.encaps.iter().enumerate() {
            writeln!(
                f,
                "encap {i}: {} vni {} {} -> {}, udp dst {}, ttl {}, dscp {}{}",
                e.tunnel.name(),
                e.vni,
                e.src,
                e.dst,
                e.udp_dst,
                e.ttl,
                e.dscp,
                if e.options.is_empty() {
                    String::new()
                } else {
                    format!(", {} options", e.options.len())
                }
            )?;
        }
        for (i, m) in self.meters.iter().enumerate() {
            writeln!(f, "meter {i}: {}", self.names.meters[m.index()])?;
        }
        for (id, why) in &self.software {
            writeln!(f, "software pipe {}: {why}", self.names.pipes[id.index()])?;
        }
        for r in &self.software_rules {
            writeln!(
                f,
                "software rule {}.{}: {} (the NIC sends the packets it may take to the Arm \
                 cores)",
                self.names.pipes[r.pipe.index()],
                r.rule,
                r.why
            )?;
        }
        for (i, pipe) in self.pipes.iter().enumerate() {
            writeln!(f)?;
            self.fmt_pipe(f, i, pipe)?;
        }
        Ok(())
    }
}

impl Plan {
    fn fmt_pipe(&self, f: &mut fmt::Formatter<'_>, i: usize, pipe: &HwPipe) -> fmt::Result {
        let n = pipe.entry_count();
        writeln!(
            f,
            "pipe {i} {} {}{}, {n} {}{}",
            pipe.name,
            pipe.kind.c_name(),
            if pipe.root { " root" } else { "" },
            if n == 1 { "entry" } else { "entries" },
            match (&pipe.entries, pipe.of) {
                (Entries::Table { .. }, Some(of)) =>
                    format!(" (table {})", self.names.pipes[of.index()]),
                _ => String::new(),
            }
        )?;
        for item in &pipe.template {
            match item {
                TemplateItem::Fixed(s) => writeln!(f, "  match {} = {}", s.member, s.value)?,
                TemplateItem::PerEntry { member, shift } => writeln!(
                    f,
                    "  match {member} per entry{}",
                    if *shift > 0 {
                        format!(" (<< {shift})")
                    } else {
                        String::new()
                    }
                )?,
            }
        }
        for (i, a) in pipe.actions.iter().enumerate() {
            writeln!(f, "  actions {i}: {}", self.describe(a))?;
        }
        if let Entries::Table { indices, first } = &pipe.entries {
            for (name, action) in first.iter().zip(indices) {
                writeln!(f, "  entry ({name}) -> actions {action}")?;
            }
            if indices.len() > first.len() {
                writeln!(f, "  ... {} more entries", indices.len() - first.len())?;
            }
        }
        if let Entries::Listed(entries) = &pipe.entries {
            for e in entries {
                let mut line = String::from("  entry");
                if let Some(p) = e.priority {
                    let _ = write!(line, " priority {p}");
                }
                let _ = write!(line, " ({})", e.label);
                for s in &e.selectors {
                    let _ = write!(line, " {}={}", s.member, s.value);
                }
                for m in &e.matches {
                    let (v, mask) = (m.value << m.shift, m.mask << m.shift);
                    let _ = write!(line, " {}={v:#x}/{mask:#x}", m.member);
                }
                if e.matches.is_empty() && e.selectors.is_empty() {
                    line.push_str(" any");
                }
                writeln!(f, "{line} -> actions {}", e.action)?;
            }
        }
        writeln!(f, "  miss {}", self.fwd_name(pipe.miss))
    }

    fn describe(&self, a: &ActionTemplate) -> String {
        let mut parts: Vec<String> = a
            .steps
            .iter()
            .map(|s| match s {
                Step::Decap(t) => format!("decap {} (l2)", t.name()),
                Step::PopVlan => "pop vlan".into(),
                Step::Modify {
                    member,
                    value,
                    mask,
                } => format!("modify {member}={value:#x}/{mask:#x}"),
                Step::Add { member, value } => format!("add {member}+={value:#x}"),
                Step::PushVlan { vid, pcp } => format!("push vlan {vid} pcp {pcp}"),
                Step::Encap(id) => format!("encap shared {id}"),
            })
            .collect();
        if a.counter {
            parts.push("counter".into());
        }
        if let Some(m) = a.meter {
            parts.push(format!("meter shared {m}"));
        }
        parts.push(format!("fwd {}", self.fwd_name(a.fwd)));
        parts.join(", ")
    }

    fn fwd_name(&self, fwd: Fwd) -> String {
        match fwd {
            Fwd::Port(p) => format!("port {}", self.names.ports[p.index()]),
            Fwd::Pipe(h) => format!("pipe {}", self.pipes[h.0].name),
            Fwd::Drop => "drop".into(),
            Fwd::Software(p) => format!("rss to software from {}", self.names.pipes[p.index()]),
            Fwd::Service(s) => format!(
                "kernel (service {} listens there)",
                self.names.services[s.index()]
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn prefixes(lo: u128, hi: u128, bits: u8) -> Vec<(u128, u128)> {
        let mut out = Vec::new();
        range_prefixes(lo, hi, bits, &mut out);
        out
    }

    #[test]
    fn ranges_split_into_aligned_prefixes() {
        assert_eq!(prefixes(0, 65535, 16), vec![(0, 0)]);
        assert_eq!(prefixes(80, 80, 16), vec![(80, 0xffff)]);
        assert_eq!(
            prefixes(1024, 2047, 16),
            vec![(1024, 0xffff & !1023)],
            "one aligned block"
        );
        // 1..=6: 1, 2-3, 4-5, 6.
        assert_eq!(
            prefixes(1, 6, 16),
            vec![(1, 0xffff), (2, 0xfffe), (4, 0xfffe), (6, 0xffff)]
        );
        assert_eq!(prefixes(65535, 65535, 16), vec![(65535, 0xffff)]);
    }

    proptest::proptest! {
        /// The prefixes cover exactly the range: every value in it matches one, none
        /// outside matches any.
        #[test]
        fn prefixes_cover_the_range_exactly(a in 0u128..4096, b in 0u128..4096, v in 0u128..4096) {
            let (lo, hi) = (a.min(b), a.max(b));
            let ps = prefixes(lo, hi, 12);
            let hits = ps.iter().filter(|(value, mask)| v & mask == *value).count();
            proptest::prop_assert_eq!(hits, usize::from((lo..=hi).contains(&v)));
            proptest::prop_assert!(ps.len() <= 2 * 12);
        }
    }
}
