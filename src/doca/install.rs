//! Installing a plan on the NIC: the DOCA Flow calls it takes, in order, made through a
//! [`Steering`] (the DOCA FFI on a BlueField; a recorder in tests). Everything a call
//! carries is decided here, in plain Rust: each pipe's match template and action
//! templates as images, its forward and miss resolved to pipes already created, every
//! entry's match (a table's from the program's keys and prefixes); the FFI only writes
//! them into DOCA's structures.

use super::image::{self, Image, ImageError};
use super::plan::{ActionTemplate, Entries, Fwd, HwId, HwPipe, PipeType, Plan, Role, Step};
use crate::ir::{Encap, Field, Meter, MeterId, PipeBody, PipeId, PortId, Program};

/// Where an entry or a miss sends packets, with pipes as the [`Steering`]'s handles.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target<P> {
    /// The DOCA port whose logical id (`doca_flow_port_cfg_set_port_id`) is the pipeline
    /// port's index.
    Port(PortId),
    Pipe(P),
    Drop,
    /// RSS to the Arm cores' queues; the action has set `meta.pkt_meta` to the pipeline
    /// pipe the software backend goes on from ([`software_pipe`]).
    Rss,
    /// The Arm cores' kernel stack (`DOCA_FLOW_TARGET_KERNEL`).
    Kernel,
}

/// One action template (`action_idx`) of a pipe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ActionSpec<'a, P> {
    /// Its steps: decap, VLAN pop and push, the shared encap they name.
    pub template: &'a ActionTemplate,
    /// The members its modify and add steps write, and `meta.pkt_meta` for a packet
    /// bound for software.
    pub rewrites: Image,
    pub fwd: Target<P>,
}

/// A pipe to create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PipeSpec<'a, P> {
    pub name: &'a str,
    pub kind: PipeType,
    pub is_root: bool,
    /// The match template and its mask (both from this image: an enumerator in both, a
    /// value member's mask bits in both); empty for control pipes, whose entries bring
    /// their own.
    pub template: Image,
    pub actions: Vec<ActionSpec<'a, P>>,
    pub miss: Target<P>,
    /// The entries it will hold (`doca_flow_pipe_cfg_set_nr_entries`).
    pub entries: usize,
}

/// An entry to add to a pipe.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntrySpec {
    /// Its place among the pipe's entries (a hash pipe's entry index).
    pub index: usize,
    /// A control pipe entry's priority, 0 first.
    pub priority: Option<u32>,
    /// Its match; the mask of a control or LPM entry is in the same image.
    pub matches: Image,
    /// Its action template.
    pub action: usize,
    /// What its counter counts, when its template has one.
    pub counts: Option<Counted>,
}

/// What a hardware counter counts, in the software engine's terms
/// (`engine::Stats`), so that the DOCA backend's metrics are the same series.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Counted {
    /// Matches of a pipeline pipe's entry `entry` (`Stats::entries`): a rule or a table
    /// entry by its index, the default after them.
    Entry { pipe: PipeId, entry: usize },
    /// A meter's packets of one colour, 0 green, 1 yellow, 2 red (`Stats::meters`).
    Meter { meter: MeterId, colour: usize },
    /// Packets `dec ttl` in a pipeline pipe dropped for an expiring TTL (hop limit). The
    /// engine counts them by ingress port, which this pipe does not know.
    TtlExpired { pipe: PipeId },
}

/// What entry `index` of pipe `at` counts, if its template has a counter.
fn counted(plan: &Plan, prog: &Program, at: HwId, index: usize, action: usize) -> Option<Counted> {
    let pipe = &plan.pipes[at.0];
    if !pipe.actions[action].counter {
        return None;
    }
    let of = pipe.of?;
    let default = prog.pipe(of).body.len();
    match (pipe.role, &pipe.entries) {
        (Role::Pipe | Role::PipeRest, Entries::Listed(es)) => Some(Counted::Entry {
            pipe: of,
            entry: es[index].rule.unwrap_or(default),
        }),
        (Role::Pipe, Entries::Table { .. }) => Some(Counted::Entry {
            pipe: of,
            entry: index,
        }),
        (Role::Default, _) => Some(Counted::Entry {
            pipe: of,
            entry: default,
        }),
        (Role::MeterColor, Entries::Listed(es)) => {
            // The meter whose pipe sends its packets here.
            let metering = plan.pipes.iter().find(|p| {
                p.role == Role::Meter && p.actions.iter().any(|a| a.fwd == Fwd::Pipe(at))
            })?;
            let id = metering.actions.iter().find_map(|a| a.meter)?;
            let colour = es[index].selectors.iter().find_map(|s| {
                ["GREEN", "YELLOW", "RED"]
                    .iter()
                    .position(|c| s.value == format!("DOCA_FLOW_METER_COLOR_{c}"))
            })?;
            Some(Counted::Meter {
                meter: plan.meters[id as usize],
                colour,
            })
        }
        (Role::DecTtl, _) => Some(Counted::TtlExpired { pipe: of }),
        _ => None,
    }
}

/// The DOCA Flow calls installing takes.
pub trait Steering {
    /// A created pipe.
    type Pipe: Copy;
    /// An added entry, whose counter can be read.
    type Entry;
    type Error: std::error::Error;

    /// Creates shared encapsulation resource `id` (`DOCA_FLOW_SHARED_RESOURCE_ENCAP`).
    fn encap(&mut self, id: u32, e: &Encap) -> Result<(), Self::Error>;
    /// Creates shared meter resource `id` (`DOCA_FLOW_SHARED_RESOURCE_METER`).
    fn meter(&mut self, id: u32, m: &Meter) -> Result<(), Self::Error>;
    fn pipe(&mut self, spec: &PipeSpec<'_, Self::Pipe>) -> Result<Self::Pipe, Self::Error>;
    fn entry(
        &mut self,
        pipe: Self::Pipe,
        kind: PipeType,
        e: &EntrySpec,
    ) -> Result<Self::Entry, Self::Error>;
    /// Waits until every entry added is in the hardware.
    fn flush(&mut self) -> Result<(), Self::Error>;
}

/// Why a plan was not installed.
#[derive(Debug, thiserror::Error)]
pub enum InstallError<E: std::error::Error> {
    /// pipe `{pipe}`: {source}
    #[error("pipe `{pipe}`: {source}")]
    Image {
        pipe: String,
        #[source]
        source: ImageError,
    },
    /// DOCA Flow refused `{what}`: {source}
    #[error("DOCA Flow refused {what}: {source}")]
    Steering {
        what: String,
        #[source]
        source: E,
    },
}

/// What was installed: the handle of each of the plan's pipes, by [`HwId`], and the
/// entries with counters, with what each counts.
#[derive(Debug)]
pub struct Installed<P, E> {
    pub pipes: Vec<P>,
    pub root: P,
    pub entries: usize,
    pub counters: Vec<(E, Counted)>,
}

/// What installing through `S` gives.
pub type Installation<S> = Result<
    Installed<<S as Steering>::Pipe, <S as Steering>::Entry>,
    InstallError<<S as Steering>::Error>,
>;

/// The `pkt_meta` value telling the software backend which pipeline pipe a packet goes
/// on from: the pipe's index.
pub fn software_pipe(pipe: PipeId) -> u32 {
    u32::from(pipe.0)
}

/// Creates the plan's shared resources, then its pipes in order (each after those it
/// forwards to), each followed by its entries; then waits for the entries.
pub fn install<S: Steering>(plan: &Plan, prog: &Program, hw: &mut S) -> Installation<S> {
    let refused = |what: String| move |source| InstallError::Steering { what, source };
    for (id, e) in plan.encaps.iter().enumerate() {
        hw.encap(id as u32, e)
            .map_err(refused(format!("shared encap {id}")))?;
    }
    for (id, m) in plan.meters.iter().enumerate() {
        let meter = &prog.meters[m.index()];
        hw.meter(id as u32, meter)
            .map_err(refused(format!("meter `{}`", meter.name)))?;
    }
    let mut pipes: Vec<S::Pipe> = Vec::with_capacity(plan.pipes.len());
    let (mut entries, mut counters) = (0, Vec::new());
    for (at, pipe) in plan.pipes.iter().enumerate() {
        let spec = pipe_spec(pipe, prog, &pipes).map_err(|source| InstallError::Image {
            pipe: pipe.name.clone(),
            source,
        })?;
        let handle = hw
            .pipe(&spec)
            .map_err(refused(format!("pipe `{}`", pipe.name)))?;
        for e in entry_specs(pipe, prog) {
            let mut e = e.map_err(|source| InstallError::Image {
                pipe: pipe.name.clone(),
                source,
            })?;
            e.counts = counted(plan, prog, HwId(at), e.index, e.action);
            let added = hw
                .entry(handle, pipe.kind, &e)
                .map_err(refused(format!("entry {} of `{}`", e.index, pipe.name)))?;
            if let Some(c) = e.counts {
                counters.push((added, c));
            }
            entries += 1;
        }
        pipes.push(handle);
    }
    hw.flush().map_err(refused("the entries".into()))?;
    Ok(Installed {
        root: pipes[plan.root.0],
        pipes,
        entries,
        counters,
    })
}

fn target<P: Copy>(fwd: Fwd, created: &[P]) -> Target<P> {
    match fwd {
        Fwd::Port(p) => Target::Port(p),
        // A plan creates a pipe after every pipe it forwards to.
        Fwd::Pipe(h) => Target::Pipe(created[h.0]),
        Fwd::Drop => Target::Drop,
        Fwd::Software(_) => Target::Rss,
        Fwd::Service(_) => Target::Kernel,
    }
}

/// The table fields of a pipe's template, in order: none but for a table.
fn table_fields<'p>(pipe: &HwPipe, prog: &'p Program) -> &'p [Field] {
    match (&pipe.entries, pipe.of.map(|of| &prog.pipe(of).body)) {
        (Entries::Table { .. }, Some(PipeBody::Exact { fields, .. })) => fields,
        (Entries::Table { .. }, Some(PipeBody::Lpm { field, .. })) => std::slice::from_ref(field),
        _ => &[],
    }
}

fn pipe_spec<'a, P: Copy>(
    pipe: &'a HwPipe,
    prog: &Program,
    created: &[P],
) -> Result<PipeSpec<'a, P>, ImageError> {
    let actions = pipe
        .actions
        .iter()
        .map(|a| {
            let mut steps = a.steps.clone();
            if let Fwd::Software(p) = a.fwd {
                steps.push(Step::Modify {
                    member: "meta.pkt_meta".into(),
                    value: u128::from(software_pipe(p)),
                    mask: u128::from(u32::MAX),
                });
            }
            Ok(ActionSpec {
                template: a,
                rewrites: image::rewrites(&steps)?,
                fwd: target(a.fwd, created),
            })
        })
        .collect::<Result<_, ImageError>>()?;
    Ok(PipeSpec {
        name: &pipe.name,
        kind: pipe.kind,
        is_root: pipe.root,
        template: image::template(pipe, table_fields(pipe, prog))?,
        actions,
        miss: target(pipe.miss, created),
        entries: pipe.entry_count(),
    })
}

/// The entries of a pipe, as images.
fn entry_specs<'a>(
    pipe: &'a HwPipe,
    prog: &'a Program,
) -> Box<dyn Iterator<Item = Result<EntrySpec, ImageError>> + 'a> {
    match &pipe.entries {
        Entries::Listed(es) => Box::new(es.iter().enumerate().map(|(index, e)| {
            Ok(EntrySpec {
                index,
                priority: e.priority,
                matches: image::entry_match(&e.selectors, &e.matches)?,
                action: e.action,
                counts: None,
            })
        })),
        Entries::Table { indices, .. } => {
            let body = &prog
                .pipe(pipe.of.expect("a table pipe is a pipeline pipe's"))
                .body;
            Box::new(indices.iter().enumerate().map(move |(index, &action)| {
                Ok(EntrySpec {
                    index,
                    priority: None,
                    matches: image::table_entry(pipe, body, index)?,
                    action: action as usize,
                    counts: None,
                })
            }))
        }
    }
}

/// A [`Steering`] that writes each call as text instead (`dpuflow plan --calls`): what
/// an installation hands DOCA Flow, member by member and byte by byte, without a NIC.
#[derive(Debug)]
pub struct Listing<'p, W> {
    out: W,
    pipes: usize,
    /// For the names of what counters count.
    prog: &'p Program,
}

impl<'p, W: std::io::Write> Listing<'p, W> {
    pub fn new(out: W, prog: &'p Program) -> Listing<'p, W> {
        Listing {
            out,
            pipes: 0,
            prog,
        }
    }

    /// The writer, with all the calls written.
    pub fn into_inner(self) -> W {
        self.out
    }
}

fn target_name(t: Target<usize>) -> String {
    match t {
        Target::Port(p) => format!("port {}", p.0),
        Target::Pipe(h) => format!("pipe {h}"),
        Target::Drop => "drop".into(),
        Target::Rss => "rss".into(),
        Target::Kernel => "kernel".into(),
    }
}

impl<W: std::io::Write> Steering for Listing<'_, W> {
    type Pipe = usize;
    type Entry = ();
    type Error = std::io::Error;

    fn encap(&mut self, id: u32, e: &Encap) -> Result<(), Self::Error> {
        writeln!(
            self.out,
            "shared encap {id}: {} vni {} {} -> {} udp {} ttl {} dscp {}",
            e.tunnel.name(),
            e.vni,
            e.src,
            e.dst,
            e.udp_dst,
            e.ttl,
            e.dscp
        )
    }

    fn meter(&mut self, id: u32, m: &Meter) -> Result<(), Self::Error> {
        writeln!(self.out, "shared meter {id}: {}", m.name)
    }

    fn pipe(&mut self, spec: &PipeSpec<'_, usize>) -> Result<usize, Self::Error> {
        let o = &mut self.out;
        writeln!(
            o,
            "pipe {} {} {}{} nr_entries {}",
            self.pipes,
            spec.name,
            spec.kind.c_name(),
            if spec.is_root { " root" } else { "" },
            spec.entries
        )?;
        if !spec.template.0.is_empty() {
            writeln!(o, "  match {}", spec.template)?;
        }
        for (i, a) in spec.actions.iter().enumerate() {
            let mut parts: Vec<String> = a
                .template
                .steps
                .iter()
                .filter_map(|s| match s {
                    Step::Decap(t) => Some(format!("decap {}", t.name())),
                    Step::PopVlan => Some("pop vlan".into()),
                    Step::PushVlan { vid, pcp } => Some(format!("push vlan {vid} pcp {pcp}")),
                    Step::Encap(id) => Some(format!("encap {id}")),
                    Step::Modify { .. } | Step::Add { .. } => None,
                })
                .collect();
            if !a.rewrites.0.is_empty() {
                parts.push(format!("modify {}", a.rewrites));
            }
            if a.template.counter {
                parts.push("counter".into());
            }
            if let Some(m) = a.template.meter {
                parts.push(format!("meter {m}"));
            }
            parts.push(format!("fwd {}", target_name(a.fwd)));
            writeln!(o, "  actions {i}: {}", parts.join(", "))?;
        }
        writeln!(o, "  miss {}", target_name(spec.miss))?;
        self.pipes += 1;
        Ok(self.pipes - 1)
    }

    fn entry(&mut self, pipe: usize, _: PipeType, e: &EntrySpec) -> Result<(), Self::Error> {
        let priority = e
            .priority
            .map(|p| format!(" priority {p}"))
            .unwrap_or_default();
        let matches = if e.matches.0.is_empty() {
            "any".to_string()
        } else {
            e.matches.to_string()
        };
        let p = self.prog;
        let counts = match e.counts {
            None => String::new(),
            Some(Counted::Entry { pipe, entry }) => {
                let pipe = p.pipe(pipe);
                format!(", counter: {} {}", pipe.name, pipe.entry_name(entry))
            }
            Some(Counted::Meter { meter, colour }) => format!(
                ", counter: meter {} {}",
                p.meters[meter.index()].name,
                ["green", "yellow", "red"][colour]
            ),
            Some(Counted::TtlExpired { pipe }) => {
                format!(", counter: {} ttl expired", p.pipe(pipe).name)
            }
        };
        writeln!(
            self.out,
            "  entry {pipe}.{}{priority}: {matches} -> actions {}{counts}",
            e.index, e.action
        )
    }

    fn flush(&mut self) -> Result<(), Self::Error> {
        writeln!(self.out, "process entries")?;
        self.out.flush()
    }
}
