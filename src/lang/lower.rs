//! Semantic checks: the syntax tree becomes the IR, or diagnostics say why not.
//!
//! Order: declare every name (duplicates reported), lower the option blocks, lower each
//! pipe's rules, tables and actions (names resolved, values range-checked, action lists
//! checked for conflicts), then check the pipe graph (cycles, reachability) and look for
//! shadowed rules.

use super::ast::{self, BlockKind, Item, MatchValue, Opt, PipeItem, Word};
use super::classbench::{self, ClassBenchRule};
use super::diag::{did_you_mean, Diagnostic, FileId, SourceMap, Span};
use super::value;
use crate::ir::*;
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Read;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Shadowed rules reported one by one per file; the rest are counted in one warning.
const MAX_SHADOW_WARNINGS: usize = 20;
/// Most connections one worker's table may hold: it is allocated and written at start,
/// about 120 bytes a connection (30 GiB at this bound).
const MAX_CT_CAPACITY: u64 = 1 << 28;
/// Most flows one worker's IPFIX flow cache may hold (its vectors are reserved up front:
/// about 6.7 GB of address space at this bound).
const MAX_FLOW_CACHE: u64 = 1 << 26;
/// The least IPFIX path MTU: 576, the datagram every IPv4 host takes (RFC 791); less IP
/// and UDP headers it leaves room for the templates' message (512 bytes).
pub const MIN_IPFIX_MTU: u16 = 576;

/// Connections tracked when the `conntrack` block does not say.
const DEFAULT_CT_CAPACITY: u64 = 1 << 20;

/// Values a KV-cache service keeps in memory by default: a connector's metadata beside
/// its chunks, and small values generally, are served without a round trip to the
/// target. At most a 256th of a store of 64 KiB blocks, were every value that small.
const DEFAULT_INLINE_MAX: u64 = 256;
/// A service's stripe over several targets unless it says otherwise (rounded up to whole
/// blocks): a value of up to a few MiB, as KV-cache connectors write them, mostly on one
/// target, in one request there; values of different requests on different targets.
const DEFAULT_STRIPE: u64 = 1 << 20;
/// The most blocks a stripe may have: the superblock keeps the count in 16 bits.
const MAX_STRIPE_BLOCKS: u64 = u16::MAX as u64;
/// The most `inline_max` may be: memory for a value in every block.
const MAX_INLINE_MAX: u64 = 64 << 10;

/// How often a KV-cache service saves its index by default (Redis's default `save` points
/// save within a minute of many writes): a crash loses at most about this much.
const DEFAULT_CHECKPOINT: Duration = Duration::from_secs(60);
/// The shortest checkpoint interval: each one may write the whole index.
const MIN_CHECKPOINT: Duration = Duration::from_secs(1);

/// Largest rule file read; bigger ones are refused rather than exhausting memory.
const MAX_RULE_FILE_BYTES: u64 = 256 << 20;

/// Names of one kind (ports, pipes, …) in declaration order.
#[derive(Default)]
struct Names {
    ids: HashMap<String, u16>,
    spans: Vec<Span>,
    names: Vec<String>,
}

impl Names {
    fn declare(&mut self, what: &str, w: &Word, diags: &mut Vec<Diagnostic>) -> bool {
        if let Some(&id) = self.ids.get(w.as_str()) {
            diags.push(
                Diagnostic::error(w.span, format!("duplicate {what} `{}`", w.text))
                    .note(self.spans[id as usize], "first defined here")
                    .hint(format!("rename one of the two {what}s")),
            );
            return false;
        }
        self.ids.insert(w.text.to_string(), self.names.len() as u16);
        self.spans.push(w.span);
        self.names.push(w.text.to_string());
        true
    }

    fn get(&self, name: &str) -> Option<u16> {
        self.ids.get(name).copied()
    }
}

struct Lowerer<'a> {
    sources: &'a mut SourceMap,
    main: FileId,
    base_dir: &'a Path,
    diags: Vec<Diagnostic>,
    ports: Names,
    pipes: Names,
    meters: Names,
    services: Names,
    shadow_warnings: usize,
}

/// Where a rule came from, for shadowing reports.
struct RuleSite {
    span: Span,
}

/// Lowers a parsed file. Rule files named by `rules from` are read relative to `base_dir`
/// and added to `sources`. Returns the program only when there is no error.
pub fn lower(
    file: &ast::File,
    sources: &mut SourceMap,
    main: FileId,
    base_dir: &Path,
    mut diags: Vec<Diagnostic>,
) -> (Option<Program>, Vec<Diagnostic>) {
    let mut l = Lowerer {
        sources,
        main,
        base_dir,
        diags: Vec::new(),
        ports: Names::default(),
        pipes: Names::default(),
        meters: Names::default(),
        services: Names::default(),
        shadow_warnings: 0,
    };
    let program = l.program(file);
    diags.append(&mut l.diags);
    let failed = diags
        .iter()
        .any(|d| d.severity == super::diag::Severity::Error);
    (program.filter(|_| !failed), diags)
}

fn opt_value<'o, 'a>(opts: &'o [Opt<'a>], key: &str) -> Option<&'o Opt<'a>> {
    opts.iter().find(|o| o.key.text == key)
}

/// A storage target as a service's `target` names it.
fn parse_storage_target(text: &str) -> Option<StorageTarget> {
    let (scheme, rest) = text.split_once("://")?;
    match scheme {
        "nvme-tcp" => {
            let (addr, nqn) = rest.split_once('/')?;
            (!nqn.is_empty()).then_some(())?;
            Some(StorageTarget::NvmeTcp {
                addr: addr.parse().ok()?,
                nqn: nqn.to_owned(),
            })
        }
        "nbd" => {
            let (addr, export) = rest.split_once('/').unwrap_or((rest, ""));
            Some(StorageTarget::Nbd {
                addr: addr.parse().ok()?,
                export: export.to_owned(),
            })
        }
        "nvme" | "file" => rest.starts_with('/').then(|| StorageTarget::Local {
            path: PathBuf::from(rest),
        }),
        _ => None,
    }
}

/// Where a service block names `target` (the block's name when it does not).
fn target_span(b: &ast::NamedBlock, target: &StorageTarget) -> Span {
    b.options
        .iter()
        .filter(|o| o.key.text == "target")
        .find(|o| parse_storage_target(o.values[0].as_str()).as_ref() == Some(target))
        .map_or(b.name.span, |o| o.values[0].span)
}

impl Lowerer<'_> {
    fn err(&mut self, span: Span, msg: impl Into<String>) -> &mut Diagnostic {
        self.diags.push(Diagnostic::error(span, msg));
        self.diags.last_mut().expect("just pushed")
    }

    fn program(&mut self, file: &ast::File) -> Option<Program> {
        let mut name: Option<&Word> = None;
        let mut ports = Vec::new();
        let mut meters = Vec::new();
        let mut services = Vec::new();
        let mut pipes = Vec::new();
        let mut conntrack: Option<&ast::Settings> = None;
        let mut telemetry: Option<&ast::Settings> = None;
        for item in &file.items {
            match item {
                Item::Pipeline(w) => match name {
                    Some(first) => {
                        let first = first.span;
                        self.err(w.span, "a file declares one pipeline")
                            .add_note(first, "first declared here");
                    }
                    None => name = Some(w),
                },
                Item::Named(b) => {
                    let (names, list, what) = match b.kind {
                        BlockKind::Port => (&mut self.ports, &mut ports, "port"),
                        BlockKind::Meter => (&mut self.meters, &mut meters, "meter"),
                        _ => (&mut self.services, &mut services, "service"),
                    };
                    if names.declare(what, &b.name, &mut self.diags) {
                        list.push(b);
                    }
                }
                Item::Settings(s) => {
                    let slot = if s.kind == BlockKind::Conntrack {
                        &mut conntrack
                    } else {
                        &mut telemetry
                    };
                    match slot {
                        Some(first) => {
                            let first = first.keyword;
                            self.err(s.keyword, format!("duplicate `{}` block", s.kind.keyword()))
                                .add_note(first, "first defined here");
                        }
                        None => *slot = Some(s),
                    }
                }
                Item::Pipe(p) => {
                    if self.pipes.declare("pipe", &p.name, &mut self.diags) {
                        pipes.push(p);
                    }
                }
            }
        }
        let name = match name {
            Some(w) => w.text.to_string(),
            None => {
                let at = file_start(self.main, file);
                self.err(at, "missing `pipeline NAME`").hint =
                    Some("start the file with `pipeline my_pipeline`".into());
                String::new()
            }
        };
        let ports: Vec<Port> = ports.iter().filter_map(|b| self.port(b)).collect();
        let meters: Vec<Meter> = meters.iter().filter_map(|b| self.meter(b)).collect();
        let mut stored_on: HashMap<StorageTarget, &ast::NamedBlock> = HashMap::new();
        let mut lowered_services = Vec::new();
        for b in &services {
            let Some(service) = self.service(b) else {
                continue;
            };
            // Two services on one target would overwrite each other's blocks and index.
            let ServiceKind::KvCache(kv) = &service.kind;
            for target in &kv.targets {
                let Some(first) = stored_on.insert(target.clone(), b) else {
                    continue;
                };
                self.err(
                    target_span(b, target),
                    format!(
                        "services `{}` and `{}` store on the same target",
                        first.name.text, b.name.text
                    ),
                )
                .add_note(target_span(first, target), "first used here")
                .hint = Some("give each service a target of its own".into());
            }
            lowered_services.push(service);
        }
        let services = lowered_services;
        let conntrack = conntrack.and_then(|s| self.conntrack(s));
        let telemetry = self.telemetry(telemetry);
        let mut lowered = Vec::new();
        let mut gotos = Vec::new();
        let mut to_services = Vec::new();
        let mut feeders: HashMap<u16, Span> = HashMap::new();
        for p in &pipes {
            let (pipe, ctx) = self.pipe(p, &mut feeders);
            lowered.push(pipe);
            gotos.push(ctx.gotos);
            to_services.push(ctx.to_services);
        }
        self.check_graph(&pipes, &gotos);
        self.check_services_reachable(&ports, &pipes, &gotos, &to_services);
        let pipes: Vec<Pipe> = lowered.into_iter().collect::<Option<_>>()?;
        // A pipeline that tracks connections without a `conntrack` block gets the defaults.
        let conntrack = conntrack.or_else(|| {
            pipes.iter().any(uses_conntrack).then(|| Conntrack {
                capacity: DEFAULT_CT_CAPACITY,
                timeouts: CtTimeouts::default(),
                tcp_window: false,
                tcp_loose: true,
                checksum: false,
            })
        });
        Some(Program {
            name,
            ports,
            pipes,
            meters,
            services,
            conntrack,
            telemetry,
        })
    }

    // ---- option blocks -------------------------------------------------------------

    /// The value of a one-value option (the parser guarantees there is one).
    fn single<'o, 'a>(&mut self, o: &'o Opt<'a>) -> Option<&'o Word<'a>> {
        o.values.first()
    }

    /// An `on` or `off` option; `on_means` says what `on` does, for the hint.
    fn on_off(&mut self, o: &Opt, on_means: &str) -> Option<bool> {
        let w = self.single(o)?;
        match w.as_str() {
            "on" => Some(true),
            "off" => Some(false),
            _ => {
                let key = &o.key.text;
                self.err(
                    w.span,
                    format!("`{key}` is `on` or `off`, not `{}`", w.text),
                )
                .hint = Some(format!("`{key} on` {on_means}"));
                None
            }
        }
    }

    fn check_repeats(&mut self, opts: &[Opt], repeatable: &[&str]) {
        for (i, o) in opts.iter().enumerate() {
            if repeatable.contains(&o.key.as_str()) {
                continue;
            }
            if let Some(first) = opts[..i].iter().find(|p| p.key.text == o.key.text) {
                let first = first.key.span;
                self.err(o.key.span, format!("`{}` is given twice", o.key.text))
                    .add_note(first, "first given here");
            }
        }
    }

    fn parsed<T>(
        &mut self,
        w: &Word,
        what: &str,
        hint: &str,
        f: impl Fn(&str) -> Option<T>,
    ) -> Option<T> {
        let v = f(&w.text);
        if v.is_none() {
            self.err(w.span, format!("invalid {what} `{}`", w.text))
                .hint = Some(hint.into());
        }
        v
    }

    /// [`Lowerer::parsed`], then refused with an error (`refusal` says why) unless `valid`
    /// holds of the value.
    fn parsed_if<T: Copy>(
        &mut self,
        w: &Word,
        (what, hint): (&str, &str),
        f: impl Fn(&str) -> Option<T>,
        valid: impl Fn(T) -> bool,
        refusal: impl Fn(T) -> String,
    ) -> Option<T> {
        let v = self.parsed(w, what, hint, f)?;
        if !valid(v) {
            self.err(w.span, refusal(v));
            return None;
        }
        Some(v)
    }

    fn int_in(&mut self, w: &Word, what: &str, lo: u128, hi: u128) -> Option<u128> {
        let v = self.parsed(
            w,
            what,
            "write a decimal or 0x-hexadecimal integer",
            value::integer,
        )?;
        if v < lo || v > hi {
            self.err(w.span, format!("{what} {v} is out of range ({lo}-{hi})"));
            return None;
        }
        Some(v)
    }

    fn port(&mut self, b: &ast::NamedBlock) -> Option<Port> {
        self.check_repeats(&b.options, &[]);
        let mut port = Port {
            name: b.name.text.to_string(),
            driver: Driver::Pcap,
            iface: None,
            file: None,
            out: None,
            queues: 1,
            mtu: 1500,
        };
        let mut driver = None;
        let mut ok = true;
        for o in &b.options {
            let Some(w) = self.single(o) else {
                ok = false;
                continue;
            };
            match o.key.as_str() {
                "driver" => match Driver::ALL.iter().find(|(n, _)| *n == w.text) {
                    Some(&(_, d)) => driver = Some(d),
                    None => {
                        let hint = did_you_mean(&w.text, Driver::ALL.iter().map(|(n, _)| *n))
                            .unwrap_or_else(|| {
                                "drivers are pcap, af_packet, af_xdp and doca".into()
                            });
                        self.err(w.span, format!("unknown driver `{}`", w.text))
                            .hint = Some(hint);
                        ok = false;
                    }
                },
                "iface" => port.iface = Some(w.text.to_string()),
                "file" => port.file = Some(PathBuf::from(w.as_str())),
                "out" => port.out = Some(PathBuf::from(w.as_str())),
                "queues" => match self.int_in(w, "queue count", 1, 1024) {
                    Some(q) => port.queues = q as u16,
                    None => ok = false,
                },
                "mtu" => match self.int_in(w, "MTU", 68, 65535) {
                    Some(m) => port.mtu = m as u16,
                    None => ok = false,
                },
                _ => unreachable!("the parser accepts only port keys"),
            }
        }
        match driver {
            Some(d) => port.driver = d,
            None if !ok => return None,
            None => {
                self.err(b.name.span, format!("port `{}` has no driver", b.name.text))
                    .hint = Some(
                    "add `driver pcap`, `driver af_packet`, `driver af_xdp` or `driver doca`"
                        .into(),
                );
                return None;
            }
        }
        if port.mtu > port.driver.largest_mtu() {
            let at = b
                .options
                .iter()
                .find(|o| o.key.text == "mtu")
                .map_or(b.name.span, |o| o.key.span);
            self.err(
                at,
                format!(
                    "port `{}` uses driver {}, whose MTU is at most {}",
                    b.name.text,
                    port.driver.name(),
                    port.driver.largest_mtu()
                ),
            )
            .hint = Some(
                "AF_XDP puts a frame in one 4 KiB chunk; use driver af_packet for larger frames"
                    .into(),
            );
            ok = false;
        }
        if matches!(port.driver, Driver::AfPacket | Driver::AfXdp | Driver::Doca)
            && port.iface.is_none()
        {
            self.err(
                b.name.span,
                format!(
                    "port `{}` uses driver {} but names no interface",
                    b.name.text,
                    port.driver.name()
                ),
            )
            .hint = Some("add `iface \"NAME\"`".into());
            ok = false;
        }
        ok.then_some(port)
    }

    /// `rate 10000 pps` (number and unit may be one word or two).
    fn joined(&mut self, o: &Opt) -> (String, Span) {
        let text: String = o.values.iter().map(|w| w.as_str()).collect();
        let span = o.values[0].span.to(o.values[o.values.len() - 1].span);
        (text, span)
    }

    fn meter(&mut self, b: &ast::NamedBlock) -> Option<Meter> {
        self.check_repeats(&b.options, &[]);
        let rate_of = |l: &mut Self, key: &str| -> Option<Option<value::Rate>> {
            let Some(o) = opt_value(&b.options, key) else {
                return Some(None);
            };
            let (text, span) = l.joined(o);
            match value::rate(&text) {
                Some(value::Rate::Pps(0) | value::Rate::Bps(0)) => {
                    l.err(span, format!("{key} must be above zero"));
                    None
                }
                Some(r) => Some(Some(r)),
                None => {
                    l.err(span, format!("invalid rate `{text}`")).hint =
                        Some("write packets per second (`10000 pps`, `2 mpps`) or bits per second (`100 mbps`, `10 gbit/s`)".into());
                    None
                }
            }
        };
        let cir = rate_of(self, "rate")?;
        let pir = rate_of(self, "peak")?;
        let Some(cir) = cir else {
            self.err(b.name.span, format!("meter `{}` has no rate", b.name.text))
                .hint = Some("add `rate 10000 pps` or `rate 100 mbps`".into());
            return None;
        };
        let (unit, cir) = match cir {
            value::Rate::Pps(r) => (MeterRate::Packets, r),
            value::Rate::Bps(r) => (MeterRate::Bits, r),
        };
        let burst_of = |l: &mut Self, key: &str| -> Option<Option<u64>> {
            let Some(o) = opt_value(&b.options, key) else {
                return Some(None);
            };
            let (text, span) = l.joined(o);
            let v = match unit {
                MeterRate::Packets => value::count(&text),
                MeterRate::Bits => value::size(&text),
            };
            if v.is_none() {
                let what = if unit == MeterRate::Packets {
                    "packets (`1000`)"
                } else {
                    "bytes (`64KiB`, `1500 bytes`)"
                };
                l.err(span, format!("invalid {key} `{text}`")).hint =
                    Some(format!("this meter's bursts are in {what}"));
            }
            v.map(Some)
        };
        let cbs = burst_of(self, "burst")?;
        let ebs = burst_of(self, "excess_burst")?;
        let pbs = burst_of(self, "peak_burst")?;
        // A burst of one second at the committed rate (bytes for bit rates) when not given.
        let default_burst = match unit {
            MeterRate::Packets => cir,
            MeterRate::Bits => cir / 8,
        };
        let cbs = cbs.unwrap_or(default_burst);
        let algorithm = match pir {
            None => {
                if let Some(o) = opt_value(&b.options, "peak_burst") {
                    self.err(o.key.span, "`peak_burst` without `peak`").hint =
                        Some("add `peak RATE` for a two-rate meter (RFC 2698)".into());
                    return None;
                }
                MeterAlgorithm::SingleRate {
                    ebs: ebs.unwrap_or(cbs),
                }
            }
            Some(p) => {
                let pir = match (unit, p) {
                    (MeterRate::Packets, value::Rate::Pps(r))
                    | (MeterRate::Bits, value::Rate::Bps(r)) => r,
                    _ => {
                        let o =
                            opt_value(&b.options, "peak").map_or(b.name.span, |o| o.values[0].span);
                        self.err(
                            o,
                            "`peak` and `rate` must both be packet rates or both bit rates",
                        );
                        return None;
                    }
                };
                if let Some(o) = opt_value(&b.options, "excess_burst") {
                    self.err(o.key.span, "`excess_burst` belongs to single-rate meters")
                        .hint = Some("a two-rate meter (with `peak`) takes `peak_burst`".into());
                    return None;
                }
                if pir < cir {
                    let o = opt_value(&b.options, "peak").map_or(b.name.span, |o| o.values[0].span);
                    self.err(
                        o,
                        format!("peak rate {pir} is below the committed rate {cir}"),
                    )
                    .hint = Some("RFC 2698 requires PIR >= CIR".into());
                    return None;
                }
                MeterAlgorithm::TwoRate {
                    pir,
                    pbs: pbs.unwrap_or(cbs),
                }
            }
        };
        Some(Meter {
            name: b.name.text.to_string(),
            unit,
            cir,
            cbs,
            algorithm,
        })
    }

    fn service(&mut self, b: &ast::NamedBlock) -> Option<Service> {
        self.check_repeats(&b.options, &["target"]);
        let kind = match opt_value(&b.options, "type") {
            Some(o) => self.single(o)?.text.to_string(),
            None => b.name.text.to_string(),
        };
        if kind != "kvcache" {
            let at = opt_value(&b.options, "type").map_or(b.name.span, |o| o.values[0].span);
            self.err(at, format!("unknown service type `{kind}`")).hint = Some(
                did_you_mean(&kind, ["kvcache"])
                    .unwrap_or_else(|| "the service types are: kvcache".into()),
            );
            return None;
        }
        let mut listen = None;
        let mut targets: Vec<StorageTarget> = Vec::new();
        let mut capacity = None;
        let mut block_size = 65536;
        let mut stripe = None;
        let mut connections = 8;
        let mut inline_max = DEFAULT_INLINE_MAX;
        let mut checkpoint = Some(DEFAULT_CHECKPOINT);
        let mut nvme_digests = NvmeDigests::default();
        let mut page_cache = None;
        let mut discard = false;
        let mut password_file = None;
        let (mut tls_cert, mut tls_key, mut tls_client_ca) = (None, None, None);
        let mut ok = true;
        for o in &b.options {
            let (text, span) = self.joined(o);
            let w = &Word {
                text: text.into(),
                span,
                quoted: o.values[0].quoted,
            };
            match o.key.as_str() {
                "type" => {}
                "listen" => {
                    listen = self.parsed(
                        w,
                        "listen address",
                        "write IP:PORT, e.g. 127.0.0.1:6379",
                        value::socket_addr,
                    )
                }
                "target" => match self.storage_target(w) {
                    Some(t) if targets.contains(&t) => {
                        self.err(w.span, format!("target `{}` is given twice", w.text))
                            .add_note(target_span(b, &t), "first given here")
                            .hint = Some("list each target once: the store is striped over them in the order given".into());
                        ok = false;
                    }
                    Some(t) => targets.push(t),
                    None => ok = false,
                },
                "capacity" => {
                    capacity =
                        self.parsed(w, "capacity", "write a size such as `64GiB`", value::size)
                }
                "block_size" => match self.parsed_if(
                    w,
                    ("block size", "write a size such as `64KiB`"),
                    value::size,
                    |s| s >= 512 && s % 512 == 0,
                    |s| format!("block size {s} is not a multiple of 512 bytes"),
                ) {
                    Some(s) => block_size = s,
                    None => ok = false,
                },
                "stripe" => match self.parsed(
                    w,
                    "stripe size",
                    "write a size such as `1MiB`",
                    value::size,
                ) {
                    Some(n) => stripe = Some((n, w.span)),
                    None => ok = false,
                },
                "connections" => match self.parsed_if(
                    w,
                    ("connection count", "write a count from 1 to 256"),
                    value::count,
                    |n| (1..=256).contains(&n),
                    |n| format!("`connections` is 1 to 256, not {n}"),
                ) {
                    Some(n) => connections = n as usize,
                    None => ok = false,
                },
                "inline_max" => match self.parsed_if(
                    w,
                    (
                        "inline size",
                        "write a size such as `256B`, or 0 to keep every value on the target",
                    ),
                    value::size,
                    |n| n <= MAX_INLINE_MAX,
                    |n| format!("`inline_max` is at most {MAX_INLINE_MAX} bytes, not {n}"),
                ) {
                    Some(n) => inline_max = n,
                    None => ok = false,
                },
                "checkpoint" if w.as_str() == "off" => checkpoint = None,
                "checkpoint" => match self.parsed_if(
                    w,
                    (
                        "checkpoint interval",
                        "write a duration such as `30s`, or `off` to save the index only at a clean stop",
                    ),
                    value::duration,
                    |d| d >= MIN_CHECKPOINT,
                    |d| {
                        format!(
                            "`checkpoint` is at least {}s (each one may write the whole index), not {}ms",
                            MIN_CHECKPOINT.as_secs(),
                            d.as_millis()
                        )
                    },
                ) {
                    Some(d) => checkpoint = Some(d),
                    None => ok = false,
                },
                "nvme_digest" => {
                    let (header, data) = match w.as_str() {
                        "none" => (false, false),
                        "header" => (true, false),
                        "data" => (false, true),
                        "both" => (true, true),
                        other => {
                            self.err(
                                w.span,
                                format!(
                                    "`nvme_digest` is none, header, data or both, not `{other}`"
                                ),
                            );
                            ok = false;
                            (false, false)
                        }
                    };
                    nvme_digests = NvmeDigests { header, data };
                }
                "page_cache" => match w.as_str() {
                    "on" => page_cache = Some(true),
                    "off" => page_cache = Some(false),
                    other => {
                        self.err(w.span, format!("`page_cache` is on or off, not `{other}`"));
                        ok = false;
                    }
                },
                "discard" => match w.as_str() {
                    "on" => discard = true,
                    "off" => discard = false,
                    other => {
                        self.err(w.span, format!("`discard` is on or off, not `{other}`"));
                        ok = false;
                    }
                },
                "password_file" => password_file = Some(PathBuf::from(w.as_str())),
                "tls_cert" => tls_cert = Some(PathBuf::from(w.as_str())),
                "tls_key" => tls_key = Some(PathBuf::from(w.as_str())),
                "tls_client_ca" => tls_client_ca = Some(PathBuf::from(w.as_str())),
                _ => unreachable!("the parser accepts only service keys"),
            }
        }
        let missing = |l: &mut Self, what: &str, example: &str| {
            l.err(
                b.name.span,
                format!("service `{}` has no `{what}`", b.name.text),
            )
            .hint = Some(format!("add `{what} {example}`"));
        };
        if opt_value(&b.options, "listen").is_none() {
            missing(self, "listen", "127.0.0.1:6379");
        }
        if opt_value(&b.options, "target").is_none() {
            missing(
                self,
                "target",
                "\"nvme-tcp://127.0.0.1:4420/nqn.2014-08.org.example:kv\"",
            );
        }
        if opt_value(&b.options, "capacity").is_none() {
            missing(self, "capacity", "64GiB");
        }
        // TLS takes a certificate and its key; a client CA only with them.
        let tls = match (tls_cert, tls_key) {
            (Some(cert), Some(key)) => Some(TlsFiles {
                cert,
                key,
                client_ca: tls_client_ca,
            }),
            (None, None) if tls_client_ca.is_none() => None,
            (cert, _) => {
                let (has, lacks) = if cert.is_some() {
                    ("tls_cert", "tls_key")
                } else {
                    ("tls_key or tls_client_ca", "tls_cert")
                };
                self.err(
                    b.name.span,
                    format!("service `{}` has `{has}` but no `{lacks}`", b.name.text),
                )
                .hint = Some("TLS needs `tls_cert` and `tls_key` (PEM files) together".into());
                ok = false;
                None
            }
        };
        let stripe = match stripe {
            None => DEFAULT_STRIPE.div_ceil(block_size) * block_size,
            Some((n, at)) => {
                if n == 0 || n % block_size != 0 || n / block_size > MAX_STRIPE_BLOCKS {
                    self.err(
                        at,
                        format!(
                            "`stripe` is a whole number of blocks ({block_size} bytes each), from one to {MAX_STRIPE_BLOCKS}, not {n} bytes"
                        ),
                    )
                    .hint = Some(format!(
                        "a multiple of `block_size`, such as {}",
                        DEFAULT_STRIPE.div_ceil(block_size) * block_size
                    ));
                    ok = false;
                }
                n
            }
        };
        let (listen, capacity) = (listen?, capacity?);
        if targets.is_empty() {
            return None;
        }
        if nvme_digests != NvmeDigests::default()
            && !targets
                .iter()
                .all(|t| matches!(t, StorageTarget::NvmeTcp { .. }))
        {
            let at = opt_value(&b.options, "nvme_digest").map_or(b.name.span, |o| o.values[0].span);
            self.err(at, "`nvme_digest` applies to nvme-tcp:// targets only")
                .hint = Some("NBD and local targets have no digests; remove the option".into());
            ok = false;
        }
        if page_cache.is_some()
            && !targets
                .iter()
                .all(|t| matches!(t, StorageTarget::Local { .. }))
        {
            let at = opt_value(&b.options, "page_cache").map_or(b.name.span, |o| o.values[0].span);
            self.err(at, "`page_cache` applies to local targets only")
                .hint = Some(
                "nvme-tcp:// and nbd:// targets are reached over the network; remove the option"
                    .into(),
            );
            ok = false;
        }
        ok.then(|| Service {
            name: b.name.text.to_string(),
            kind: ServiceKind::KvCache(KvCache {
                listen,
                targets,
                capacity,
                block_size,
                stripe,
                connections,
                inline_max: inline_max.min(block_size),
                checkpoint,
                nvme_digests,
                page_cache,
                discard,
                password_file,
                tls,
            }),
        })
    }

    fn storage_target(&mut self, w: &Word) -> Option<StorageTarget> {
        let parsed = parse_storage_target(&w.text);
        if parsed.is_none() {
            self.err(w.span, format!("invalid storage target `{}`", w.text))
                .hint = Some("targets are nvme-tcp://HOST:PORT/NQN, nbd://HOST:PORT[/EXPORT], nvme:///dev/DEVICE and file:///PATH".into());
        }
        parsed
    }

    fn conntrack(&mut self, s: &ast::Settings) -> Option<Conntrack> {
        self.check_repeats(&s.options, &["timeout"]);
        let mut ct = Conntrack {
            capacity: DEFAULT_CT_CAPACITY,
            timeouts: CtTimeouts::default(),
            tcp_window: false,
            tcp_loose: true,
            checksum: false,
        };
        let mut ok = true;
        for o in &s.options {
            match o.key.as_str() {
                "capacity" => match self.single(o).and_then(|w| {
                    self.parsed(
                        w,
                        "capacity",
                        "write a connection count such as `1000000` or `1m`",
                        value::count,
                    )
                }) {
                    Some(c) if (1..=MAX_CT_CAPACITY).contains(&c) => ct.capacity = c,
                    Some(_) => {
                        let msg = format!(
                            "capacity is 1 to {MAX_CT_CAPACITY} connections (about 120 bytes each, \
                             all taken at start)"
                        );
                        self.err(o.values[0].span, msg);
                        ok = false;
                    }
                    None => ok = false,
                },
                "tcp_window" => match self.on_off(o, "checks TCP segments against their windows") {
                    Some(on) => ct.tcp_window = on,
                    None => ok = false,
                },
                "tcp_loose" => {
                    match self.on_off(o, "lets an ACK pick up a connection mid-stream") {
                        Some(on) => ct.tcp_loose = on,
                        None => ok = false,
                    }
                }
                "checksum" => match self.on_off(o, "verifies transport checksums") {
                    Some(on) => ct.checksum = on,
                    None => ok = false,
                },
                "timeout" => {
                    if o.values.len() != 2 {
                        self.err(o.key.span, "`timeout` takes a state and a duration")
                            .hint = Some("e.g. `timeout tcp_established 5d`".into());
                        ok = false;
                        continue;
                    }
                    let (state, dur) = (&o.values[0], &o.values[1]);
                    let Some(d) = self.parsed(
                        dur,
                        "duration",
                        "write a duration such as `30s`, `5m`, `2h` or `5d`",
                        value::duration,
                    ) else {
                        ok = false;
                        continue;
                    };
                    let mut names = ct.timeouts.by_name();
                    match names.iter_mut().find(|(n, _)| *n == state.text) {
                        Some((_, slot)) => **slot = d,
                        None => {
                            let all: Vec<&str> = names.iter().map(|(n, _)| *n).collect();
                            let hint = did_you_mean(&state.text, all.iter().copied())
                                .unwrap_or_else(|| format!("states are: {}", all.join(", ")));
                            self.err(
                                state.span,
                                format!("unknown conntrack state `{}`", state.text),
                            )
                            .hint = Some(hint);
                            ok = false;
                        }
                    }
                }
                _ => unreachable!("the parser accepts only conntrack keys"),
            }
        }
        ok.then_some(ct)
    }

    fn telemetry(&mut self, s: Option<&ast::Settings>) -> Telemetry {
        let mut t = Telemetry::default();
        let Some(s) = s else { return t };
        self.check_repeats(&s.options, &[]);
        const DUR: &str = "write a duration such as `10s` or `1m`";
        for o in &s.options {
            let Some(w) = self.single(o) else { continue };
            match o.key.as_str() {
                "prometheus" => {
                    t.prometheus = self.parsed(
                        w,
                        "address",
                        "write IP:PORT, e.g. 127.0.0.1:9464",
                        value::socket_addr,
                    )
                }
                "ipfix" => {
                    t.ipfix = self.parsed(
                        w,
                        "collector",
                        "write IP:PORT or NAME:PORT, e.g. 127.0.0.1:4739 or collector.example:4739",
                        value::host_port,
                    )
                }
                "interval" => {
                    t.active_timeout = self
                        .parsed(w, "duration", DUR, value::duration)
                        .unwrap_or(t.active_timeout)
                }
                "idle_timeout" => {
                    t.idle_timeout = self
                        .parsed(w, "duration", DUR, value::duration)
                        .unwrap_or(t.idle_timeout)
                }
                "template_refresh" => {
                    t.template_refresh = self
                        .parsed(w, "duration", DUR, value::duration)
                        .unwrap_or(t.template_refresh)
                }
                "max_rule_series" => {
                    if let Some(v) = self.int_in(w, "series count", 0, 1_000_000) {
                        t.max_rule_series = v as u32;
                    }
                }
                "sampling" => {
                    if let Some(v) = self.int_in(w, "sampling interval", 1, u32::MAX.into()) {
                        t.sampling = v as u32;
                    }
                }
                "ipfix_mtu" => {
                    let (lo, hi) = (u128::from(MIN_IPFIX_MTU), u128::from(u16::MAX));
                    if let Some(v) = self.int_in(w, "IPFIX path MTU", lo, hi) {
                        t.ipfix_mtu = v as u16;
                    }
                }
                "ipfix_rate" => {
                    if let Some(v) = self.int_in(w, "IPFIX message rate", 1, u32::MAX.into()) {
                        t.ipfix_rate = v as u32;
                    }
                }
                "observation_domain" => {
                    if let Some(v) = self.int_in(w, "observation domain", 0, u32::MAX.into()) {
                        t.observation_domain = v as u32;
                    }
                }
                "flow_cache" => {
                    let hint = "write a flow count such as `1000000` or `1m`";
                    match self.parsed(w, "flow count", hint, value::count) {
                        Some(n) if !(1..=MAX_FLOW_CACHE).contains(&n) => {
                            let msg = format!("`flow_cache` is 1 to {MAX_FLOW_CACHE} flows");
                            self.err(w.span, msg);
                        }
                        Some(n) => t.flow_cache = n,
                        None => {}
                    }
                }
                _ => unreachable!("the parser accepts only telemetry keys"),
            }
        }
        for (key, d) in [
            ("interval", t.active_timeout),
            ("idle_timeout", t.idle_timeout),
            ("template_refresh", t.template_refresh),
        ] {
            if d.is_zero() {
                if let Some(o) = opt_value(&s.options, key) {
                    self.err(o.values[0].span, format!("`{key}` must be above zero"));
                }
            }
        }
        t
    }

    // ---- pipes ---------------------------------------------------------------------

    /// Lowers one pipe; also returns what the pipe-graph checks need of it (its `goto`
    /// edges and `to` actions, with their spans).
    fn pipe(&mut self, p: &ast::Pipe, feeders: &mut HashMap<u16, Span>) -> (Option<Pipe>, PipeCtx) {
        let mut from = Vec::new();
        for w in &p.from {
            if let Some(id) = self.resolve_port(w) {
                if let Some(&other) = feeders.get(&id) {
                    self.err(
                        w.span,
                        format!("port `{}` already feeds another root pipe", w.text),
                    )
                    .add_note(other, "first bound here");
                } else {
                    feeders.insert(id, w.span);
                    from.push(PortId(id));
                }
            }
        }
        if let (Some(root), true) = (p.root, p.from.is_empty()) {
            self.err(root, format!("root pipe `{}` names no port", p.name.text))
                .hint = Some("write `root from PORT`".into());
        }
        let mut ctx = PipeCtx::default();
        let mut rules: Vec<(Rule, RuleSite)> = Vec::new();
        let mut table: Option<(PipeBody, Span)> = None;
        let mut miss: Option<(Option<ActionList>, Span)> = None;
        let mut rules_span: Option<Span> = None;
        let mut rule_names = Names::default();
        for item in &p.items {
            match item {
                PipeItem::Rule(r) => {
                    rules_span.get_or_insert(r.name.span);
                    if !rule_names.declare("rule", &r.name, &mut self.diags) {
                        ctx.failed = true;
                    } else if let Some(rule) = self.rule(r, &mut ctx) {
                        rules.push((rule, RuleSite { span: r.name.span }));
                    }
                }
                PipeItem::RulesFrom(rf) => {
                    rules_span.get_or_insert(rf.keyword);
                    self.rules_from(rf, &mut ctx, &mut rules);
                }
                PipeItem::Table(t) => {
                    if let Some((_, first)) = &table {
                        let first = *first;
                        self.err(t.keyword, "a pipe holds at most one table")
                            .add_note(first, "first table here")
                            .hint =
                            Some("put the second table in its own pipe and `goto` it".into());
                    } else if let Some(body) = self.table(t, &mut ctx) {
                        table = Some((body, t.keyword));
                    } else {
                        table = Some((PipeBody::Rules(Vec::new()), t.keyword));
                    }
                }
                PipeItem::Default { keyword, actions } => {
                    if let Some((_, first)) = &miss {
                        let first = *first;
                        self.err(*keyword, "duplicate `default`")
                            .add_note(first, "first `default` here");
                    } else {
                        let list = self.actions(actions, *keyword, &[], &mut ctx);
                        miss = Some((list, *keyword));
                    }
                }
            }
        }
        if let (Some((_, tspan)), Some(rspan)) = (&table, rules_span) {
            self.err(*tspan, format!("pipe `{}` mixes a table with rules", p.name.text))
                .add_note(rspan, "rule here")
                .hint = Some("a pipe holds either rules or one table; split them into two pipes joined by `goto`".into());
        }
        let miss = match miss {
            None => {
                self.err(
                    p.name.span,
                    format!(
                        "pipe `{}` has no `default`: packets that match nothing have no way out",
                        p.name.text
                    ),
                )
                .hint = Some("add `default { actions drop }` (or another terminal action)".into());
                None
            }
            Some((list, _)) => list,
        };
        let body = match table {
            Some((body, _)) => body,
            None => {
                self.check_shadowing(&p.name, &rules);
                PipeBody::Rules(rules.into_iter().map(|(r, _)| r).collect())
            }
        };
        let pipe = miss.filter(|_| !ctx.failed).map(|miss| Pipe {
            name: p.name.text.to_string(),
            from,
            body,
            miss,
        });
        (pipe, ctx)
    }

    fn resolve(&mut self, names_of: fn(&Self) -> &Names, what: &str, w: &Word) -> Option<u16> {
        let names = names_of(self);
        if let Some(id) = names.get(&w.text) {
            return Some(id);
        }
        let hint = did_you_mean(&w.text, names.names.iter().map(String::as_str));
        let hint = hint.or_else(|| match names.names.len() {
            0 => Some(format!("no {what} is defined")),
            _ => Some(format!("{what}s defined: {}", names.names.join(", "))),
        });
        self.err(w.span, format!("undefined {what} `{}`", w.text))
            .hint = hint;
        None
    }

    fn resolve_port(&mut self, w: &Word) -> Option<u16> {
        self.resolve(|l| &l.ports, "port", w)
    }

    fn rule(&mut self, r: &ast::Rule, ctx: &mut PipeCtx) -> Option<Rule> {
        let mut matches: Vec<FieldMatch> = Vec::new();
        let mut spans: Vec<Span> = Vec::new();
        let mut ok = true;
        for m in &r.matches {
            match self.field_match(m) {
                Some(fm) => {
                    if let Some(i) = matches.iter().position(|x| x.field == fm.field) {
                        let first = spans[i];
                        self.err(
                            m.field.span,
                            format!("`{}` is matched twice in this rule", m.field.text),
                        )
                        .add_note(first, "first match here")
                        .hint = Some(
                            "use a set `{a, b}` or a range `lo-hi` to match several values".into(),
                        );
                        ok = false;
                    } else {
                        matches.push(fm);
                        spans.push(m.field.span);
                    }
                }
                None => ok = false,
            }
        }
        matches.sort_by_key(|m| m.field);
        let actions = self.actions(&r.actions, r.name.span, &matches, ctx);
        match (ok, actions) {
            (true, Some(actions)) => Some(Rule {
                name: r.name.text.to_string(),
                matches,
                actions,
            }),
            _ => {
                ctx.failed = true;
                None
            }
        }
    }

    fn rules_from(
        &mut self,
        rf: &ast::RulesFrom,
        ctx: &mut PipeCtx,
        out: &mut Vec<(Rule, RuleSite)>,
    ) {
        let path = self.base_dir.join(rf.path.as_str());
        let text = match read_capped(&path) {
            Ok(t) => t,
            Err(e) => {
                self.err(
                    rf.path.span,
                    format!("cannot read rule file `{}`: {e}", rf.path.text),
                )
                .hint = Some(format!(
                    "the path is relative to the pipeline file's directory ({})",
                    self.base_dir.display()
                ));
                ctx.failed = true;
                return;
            }
        };
        let Some(actions) = self.actions(&rf.actions, rf.keyword, &[], ctx) else {
            ctx.failed = true;
            return;
        };
        let stem = Path::new(rf.path.as_str())
            .file_name()
            .map_or(rf.path.text.to_string(), |s| {
                s.to_string_lossy().into_owned()
            });
        let file = self.sources.add(path.display().to_string(), text);
        let text = &self.sources.file(file).text;
        let mut parsed = Vec::new();
        let mut errors = Vec::new();
        let mut offset = 0;
        for (n, line) in text.split('\n').enumerate() {
            let span = Span::new(file, offset, offset + line.trim_end_matches('\r').len());
            offset += line.len() + 1;
            if line.trim().is_empty() {
                continue;
            }
            match classbench::parse_line(line) {
                Ok(r) => parsed.push((n + 1, r, span)),
                Err(e) => {
                    if errors.len() < 20 {
                        errors.push(Diagnostic::error(span, e.to_string()).hint(
                            "ClassBench lines read `@SRC/LEN DST/LEN SPORT_LO : SPORT_HI DPORT_LO : DPORT_HI 0xPROTO/0xMASK [0xFLAGS/0xMASK]`",
                        ));
                    }
                }
            }
        }
        if !errors.is_empty() {
            ctx.failed = true;
            self.diags.append(&mut errors);
            return;
        }
        out.extend(parsed.into_iter().map(|(line, r, span)| {
            (
                Rule {
                    name: format!("{stem}:{line}"),
                    matches: classbench_matches(&r),
                    actions: actions.clone(),
                },
                RuleSite { span },
            )
        }));
    }

    fn table(&mut self, t: &ast::Table, ctx: &mut PipeCtx) -> Option<PipeBody> {
        let mut fields = Vec::new();
        for w in &t.fields {
            fields.push(self.field(w)?);
        }
        match t.kind.as_str() {
            "lpm" => {
                if fields.len() != 1
                    || !matches!(fields[0].kind(), ValueKind::Ipv4 | ValueKind::Ipv6)
                {
                    self.err(
                        t.fields[0].span.to(t.fields[t.fields.len() - 1].span),
                        "an lpm table is keyed by one address field",
                    )
                    .hint = Some("e.g. `table lpm ipv4.dst { … }`".into());
                    return None;
                }
                let field = fields[0];
                let mut actions = EntryActionsBuilder::with_capacity(t.entries.len());
                let mut keys = Vec::with_capacity(t.entries.len());
                let mut words = Vec::with_capacity(t.entries.len());
                for e in &t.entries {
                    if e.key.len() != 1 {
                        self.err(
                            e.key[0].span,
                            format!(
                                "this table has 1 key field; the entry gives {}",
                                e.key.len()
                            ),
                        );
                        ctx.failed = true;
                        continue;
                    }
                    let key = &e.key[0];
                    let Some((value, len)) = self.address(field, key, true) else {
                        ctx.failed = true;
                        continue;
                    };
                    keys.push(Prefix { value, len });
                    words.push(key);
                    let matched = [FieldMatch {
                        field,
                        pattern: Pattern::prefix(value, len, field.kind()),
                    }];
                    match self.actions(&e.actions, key.span, &matched, ctx) {
                        Some(list) => actions.push(list),
                        None => ctx.failed = true,
                    }
                }
                for (first, again) in duplicates(&keys) {
                    let (first, again) = (words[first], words[again]);
                    self.err(again.span, format!("duplicate table key `{}`", again.text))
                        .add_note(first.span, "first entry here");
                    ctx.failed = true;
                }
                Some(PipeBody::Lpm {
                    field,
                    prefixes: keys,
                    actions: actions.finish(),
                })
            }
            "exact" => {
                if fields.len() > 8 {
                    self.err(
                        t.fields[8].span,
                        "an exact table is keyed by at most 8 fields",
                    );
                    return None;
                }
                let mut keys = Vec::with_capacity(t.entries.len() * fields.len());
                let mut actions = EntryActionsBuilder::with_capacity(t.entries.len());
                let mut spans = Vec::with_capacity(t.entries.len());
                let mut matched = Vec::with_capacity(fields.len());
                for e in &t.entries {
                    if e.key.len() != fields.len() {
                        self.err(
                            e.key[0].span,
                            format!(
                                "this table has {} key fields; the entry gives {}",
                                fields.len(),
                                e.key.len()
                            ),
                        );
                        ctx.failed = true;
                        continue;
                    }
                    let start = keys.len();
                    for (&f, w) in fields.iter().zip(&e.key) {
                        keys.extend(self.exact_value(f, w));
                    }
                    if keys.len() - start != fields.len() {
                        keys.truncate(start);
                        ctx.failed = true;
                        continue;
                    }
                    matched.clear();
                    matched.extend(
                        fields
                            .iter()
                            .zip(&keys[start..])
                            .map(|(&f, &v)| FieldMatch {
                                field: f,
                                pattern: Pattern::exact(v, f.kind()),
                            }),
                    );
                    match self.actions(&e.actions, e.key[0].span, &matched, ctx) {
                        Some(list) => {
                            actions.push(list);
                            spans.push(e.key[0].span);
                        }
                        None => {
                            keys.truncate(start);
                            ctx.failed = true;
                        }
                    }
                }
                let entry_keys: Vec<&[u128]> = keys.chunks_exact(fields.len()).collect();
                for (first, again) in duplicates(&entry_keys) {
                    self.err(spans[again], "duplicate table key")
                        .add_note(spans[first], "first entry here");
                    ctx.failed = true;
                }
                Some(PipeBody::Exact {
                    fields,
                    keys,
                    actions: actions.finish(),
                })
            }
            other => {
                let hint = did_you_mean(other, ["exact", "lpm"])
                    .unwrap_or_else(|| "tables are `exact` or `lpm`".into());
                self.err(t.kind.span, format!("unknown table type `{other}`"))
                    .hint = Some(hint);
                None
            }
        }
    }

    // ---- fields and values ---------------------------------------------------------

    fn field(&mut self, w: &Word) -> Option<Field> {
        if let Some(f) = Field::parse(&w.text) {
            return Some(f);
        }
        let names: Vec<String> = Field::all_names().collect();
        let hint = did_you_mean(&w.text, names.iter().map(String::as_str));
        let msg = match w.text.strip_prefix("inner.").and_then(Field::parse) {
            Some(_) => format!("`{}` has no inner copy", &w.text["inner.".len()..]),
            None => format!("unknown field `{}`", w.text),
        };
        self.err(w.span, msg).hint = hint;
        None
    }

    fn field_match(&mut self, m: &ast::Match) -> Option<FieldMatch> {
        let field = self.field(&m.field)?;
        let pattern = match &m.value {
            MatchValue::One(w) => self.pattern(field, w)?,
            MatchValue::Set(ws, _) => {
                let ps: Option<Vec<Pattern>> = ws.iter().map(|w| self.pattern(field, w)).collect();
                let mut ps = ps?;
                if ps.len() == 1 {
                    ps.pop().expect("one element")
                } else {
                    Pattern::Any(ps)
                }
            }
        };
        Some(FieldMatch { field, pattern })
    }

    fn out_of_range(&mut self, field: Field, w: &Word, v: u128) {
        let max = field.kind().full_mask();
        let what = match field.id {
            FieldId::VxlanVni | FieldId::GeneveVni => "VNI".to_owned(),
            FieldId::IpDscp => "DSCP".to_owned(),
            _ => "value".to_owned(),
        };
        self.err(
            w.span,
            format!("{what} {v} is out of range for `{field}` (0-{max})"),
        );
    }

    /// An integer within the field's width.
    fn int_value(&mut self, field: Field, w: &Word, text: &str) -> Option<u128> {
        let Some(v) = value::integer(text) else {
            let hint = if value::is_negative_number(text) {
                "values are never negative"
            } else {
                "write a decimal or 0x-hexadecimal integer"
            };
            self.err(w.span, format!("invalid value `{text}` for `{field}`"))
                .hint = Some(hint.into());
            return None;
        };
        if v > field.kind().full_mask() {
            self.out_of_range(field, w, v);
            return None;
        }
        Some(v)
    }

    /// An address, optionally `/LEN`; returns the value and prefix length.
    fn address(&mut self, field: Field, w: &Word, allow_prefix: bool) -> Option<(u128, u8)> {
        let kind = field.kind();
        let (addr, len) = match value::prefix(&w.text) {
            Some((a, l)) if allow_prefix => (a, Some(l)),
            Some(_) => {
                self.err(
                    w.span,
                    format!("`{field}` takes a single address here, not a prefix"),
                );
                return None;
            }
            None => (w.as_str(), None),
        };
        let (v, bits) = match kind {
            // The other family is parsed only to explain an error.
            ValueKind::Ipv4 => match value::ipv4(addr).ok_or_else(|| value::ipv6(addr)) {
                Ok(a) => (u32::from(a) as u128, 32),
                Err(Some(_)) => {
                    let v6 = format!("ipv6.{}", &field.info().name[5..]);
                    self.err(
                        w.span,
                        format!("`{field}` takes an IPv4 address, found IPv6 `{addr}`"),
                    )
                    .hint = Some(format!(
                        "match IPv6 with `{}{v6}`",
                        if field.inner { "inner." } else { "" }
                    ));
                    return None;
                }
                Err(None) => {
                    self.err(
                        w.span,
                        format!("invalid IPv4 address `{addr}` for `{field}`"),
                    );
                    return None;
                }
            },
            _ => match value::ipv6(addr).ok_or_else(|| value::ipv4(addr)) {
                Ok(a) => (u128::from(a), 128),
                Err(Some(_)) => {
                    let v4 = format!("ipv4.{}", &field.info().name[5..]);
                    self.err(
                        w.span,
                        format!("`{field}` takes an IPv6 address, found IPv4 `{addr}`"),
                    )
                    .hint = Some(format!(
                        "match IPv4 with `{}{v4}`",
                        if field.inner { "inner." } else { "" }
                    ));
                    return None;
                }
                Err(None) => {
                    self.err(
                        w.span,
                        format!("invalid IPv6 address `{addr}` for `{field}`"),
                    );
                    return None;
                }
            },
        };
        let len = len.unwrap_or(bits);
        if len > bits {
            let fam = if bits == 32 { "an IPv4" } else { "an IPv6" };
            self.err(
                w.span,
                format!("prefix length {len} is out of range for {fam} address (0-{bits})"),
            );
            return None;
        }
        Some((v, len as u8))
    }

    /// A single value of the field's kind (no prefixes, ranges or masks).
    fn exact_value(&mut self, field: Field, w: &Word) -> Option<u128> {
        match field.kind() {
            ValueKind::Ipv4 | ValueKind::Ipv6 => self.address(field, w, false).map(|(v, _)| v),
            ValueKind::Mac => self.mac(field, w),
            ValueKind::Port => self.resolve_port(w).map(u128::from),
            ValueKind::CtState => self.names_value(field, w, CT_STATE_NAMES),
            ValueKind::TcpFlags => value::integer(&w.text)
                .filter(|&v| v <= 0xff)
                .or_else(|| value::bit_names(&w.text, TCP_FLAG_NAMES))
                .or_else(|| {
                    self.err(w.span, format!("invalid TCP flags `{}`", w.text))
                        .hint =
                        Some("write flag names joined by `+` (`syn+ack`) or a number".into());
                    None
                }),
            ValueKind::Int { .. } => self.int_value(field, w, &w.text),
        }
    }

    fn mac(&mut self, field: Field, w: &Word) -> Option<u128> {
        match value::mac(&w.text) {
            Some(b) => Some(b.iter().fold(0u128, |acc, &x| acc << 8 | u128::from(x))),
            None => {
                self.err(
                    w.span,
                    format!("invalid MAC address `{}` for `{field}`", w.text),
                )
                .hint = Some("write six hex bytes: 02:00:00:00:00:01".into());
                None
            }
        }
    }

    fn names_value(&mut self, field: Field, w: &Word, names: &[(&str, u128)]) -> Option<u128> {
        if let Some(&(_, v)) = names.iter().find(|(n, _)| *n == w.text) {
            return Some(v);
        }
        let hint = did_you_mean(&w.text, names.iter().map(|(n, _)| *n)).unwrap_or_else(|| {
            format!(
                "values are: {}",
                names.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
            )
        });
        self.err(w.span, format!("invalid `{field}` value `{}`", w.text))
            .hint = Some(hint);
        None
    }

    fn pattern(&mut self, field: Field, w: &Word) -> Option<Pattern> {
        let kind = field.kind();
        match kind {
            ValueKind::Ipv4 | ValueKind::Ipv6 => {
                if let Some((lo, hi)) = value::range(&w.text)
                    .filter(|_| kind == ValueKind::Ipv4 || !w.text.contains('/'))
                {
                    let lo_w = Word {
                        text: Cow::Borrowed(lo),
                        span: w.span,
                        quoted: w.quoted,
                    };
                    let hi_w = Word {
                        text: Cow::Borrowed(hi),
                        span: w.span,
                        quoted: w.quoted,
                    };
                    let lo = self.address(field, &lo_w, false)?.0;
                    let hi = self.address(field, &hi_w, false)?.0;
                    return self.range(field, w, lo, hi);
                }
                let (v, len) = self.address(field, w, true)?;
                Some(Pattern::prefix(v, len, kind))
            }
            ValueKind::Int { .. } => {
                if let Some((v, m)) = value::masked(&w.text) {
                    let (v, m) = (
                        self.int_value(field, w, &v.to_string())?,
                        self.int_value(field, w, &m.to_string())?,
                    );
                    return Some(Pattern::Masked {
                        value: v & m,
                        mask: m,
                    });
                }
                if let Some((lo, hi)) = value::range(&w.text) {
                    let lo = self.int_value(field, w, lo)?;
                    let hi = self.int_value(field, w, hi)?;
                    return self.range(field, w, lo, hi);
                }
                Some(Pattern::exact(self.int_value(field, w, &w.text)?, kind))
            }
            ValueKind::TcpFlags => {
                // `syn` means "SYN set"; `syn/syn+ack` means "SYN set and ACK clear".
                let (v, m) = match w.text.split_once('/') {
                    Some((v, m)) => {
                        let vw = Word {
                            text: Cow::Borrowed(v),
                            span: w.span,
                            quoted: w.quoted,
                        };
                        let mw = Word {
                            text: Cow::Borrowed(m),
                            span: w.span,
                            quoted: w.quoted,
                        };
                        (self.exact_value(field, &vw)?, self.exact_value(field, &mw)?)
                    }
                    None => {
                        let v = self.exact_value(field, w)?;
                        (v, v)
                    }
                };
                if v & !m != 0 {
                    self.err(
                        w.span,
                        format!("TCP flags `{}` set bits outside the mask", w.text),
                    );
                    return None;
                }
                Some(Pattern::Masked { value: v, mask: m })
            }
            _ => Some(Pattern::exact(self.exact_value(field, w)?, kind)),
        }
    }

    fn range(&mut self, field: Field, w: &Word, lo: u128, hi: u128) -> Option<Pattern> {
        if lo > hi {
            self.err(
                w.span,
                format!(
                    "range `{}` of `{field}` is empty: its low end is above its high end",
                    w.text
                ),
            )
            .hint = Some("write ranges as `LOW-HIGH`".into());
            return None;
        }
        Some(Pattern::Range { lo, hi })
    }

    // ---- actions -------------------------------------------------------------------

    /// Lowers an action list and checks it: one terminal action, last; encap followed by
    /// a forward; decap only of a tunnel the rule matches.
    fn actions(
        &mut self,
        list: &[ast::Action],
        owner: Span,
        matched: &[FieldMatch],
        ctx: &mut PipeCtx,
    ) -> Option<ActionList> {
        let mut out = Vec::with_capacity(list.len());
        let mut ok = true;
        let mut terminal: Option<&ast::Action> = None;
        let mut encap: Option<&ast::Action> = None;
        for a in list {
            if let Some(t) = terminal {
                let msg = if is_terminal_name(&a.name.text) {
                    format!(
                        "conflicting terminal actions: `{}` after `{}`",
                        a.name.text, t.name.text
                    )
                } else {
                    format!("`{}` after `{}` never runs", a.name.text, t.name.text)
                };
                self.err(a.span, msg)
                    .add_note(t.span, "the list ends here")
                    .hint =
                    Some("an action list ends with exactly one of fwd, goto, drop or to".into());
                ok = false;
                break;
            }
            match self.action(a, matched, ctx) {
                Some(action) => {
                    if action.is_terminal() {
                        terminal = Some(a);
                    }
                    if matches!(action, Action::Encap(_)) {
                        encap = Some(a);
                    }
                    out.push(action);
                }
                None => ok = false,
            }
        }
        if !ok {
            return None;
        }
        match (out.last(), encap) {
            (Some(t), _) if !t.is_terminal() => {
                self.err(owner, "action list has no terminal action").hint =
                    Some("end it with `fwd PORT`, `goto PIPE`, `drop` or `to SERVICE`".into());
                None
            }
            (Some(Action::Drop | Action::ToService(_)), Some(e)) => {
                self.err(
                    e.span,
                    format!(
                        "`{}` without a forward: the encapsulated packet is never sent",
                        e.name.text
                    ),
                )
                .hint = Some("end the list with `fwd PORT` or `goto PIPE`".into());
                None
            }
            _ => Some(ActionList(out)),
        }
    }

    fn action(
        &mut self,
        a: &ast::Action,
        matched: &[FieldMatch],
        ctx: &mut PipeCtx,
    ) -> Option<Action> {
        let name = a.name.as_str();
        Some(match name {
            "fwd" | "mirror" => {
                let id = PortId(self.resolve_port(arg(a, 0)?)?);
                if name == "fwd" {
                    Action::Fwd(id)
                } else {
                    Action::Mirror(id)
                }
            }
            "goto" => {
                let w = arg(a, 0)?;
                let id = self.resolve(|l| &l.pipes, "pipe", w)?;
                ctx.gotos.push((id, a.span));
                Action::Goto(PipeId(id))
            }
            "meter" => Action::Meter(MeterId(self.resolve(|l| &l.meters, "meter", arg(a, 0)?)?)),
            "to" => {
                ctx.to_services.push(a.span);
                Action::ToService(ServiceId(self.resolve(
                    |l| &l.services,
                    "service",
                    arg(a, 0)?,
                )?))
            }
            "drop" => Action::Drop,
            "count" => Action::Count,
            "mark" => Action::Mark(self.int_in(arg(a, 0)?, "mark", 0, u32::MAX.into())? as u32),
            "dec" => {
                let w = arg(a, 0)?;
                if w.text != "ttl" && w.text != "hop_limit" {
                    self.err(w.span, format!("cannot decrement `{}`", w.text))
                        .hint = Some("write `dec ttl` (IPv4 TTL or IPv6 hop limit)".into());
                    return None;
                }
                Action::DecTtl
            }
            "set" => {
                let fw = arg(a, 0)?;
                let field = self.field(fw)?;
                if !field.info().settable {
                    let settable: Vec<&str> = FIELDS
                        .iter()
                        .filter(|f| f.settable)
                        .map(|f| f.name)
                        .collect();
                    self.err(fw.span, format!("`{field}` cannot be set")).hint =
                        Some(format!("settable fields: {}", settable.join(", ")));
                    return None;
                }
                let value = self.exact_value(field, arg(a, 1)?)?;
                Action::Set { field, value }
            }
            "vlan.push" => {
                let (vid, pcp) = match &a.block {
                    Some(opts) => {
                        let mut vid = None;
                        let mut pcp = 0;
                        for o in opts {
                            let w = self.single(o)?;
                            match o.key.as_str() {
                                "id" => vid = Some(self.int_in(w, "VLAN id", 0, 4095)? as u16),
                                _ => pcp = self.int_in(w, "VLAN priority", 0, 7)? as u8,
                            }
                        }
                        let Some(vid) = vid else {
                            self.err(a.name.span, "`vlan.push` needs an `id`");
                            return None;
                        };
                        (vid, pcp)
                    }
                    None => (self.int_in(arg(a, 0)?, "VLAN id", 0, 4095)? as u16, 0),
                };
                Action::VlanPush { vid, pcp }
            }
            "vlan.pop" => Action::VlanPop,
            "vxlan.encap" => Action::Encap(Box::new(self.encap(a, Tunnel::Vxlan)?)),
            "geneve.encap" => Action::Encap(Box::new(self.encap(a, Tunnel::Geneve)?)),
            "vxlan.decap" | "geneve.decap" => {
                let tunnel = if name == "vxlan.decap" {
                    Tunnel::Vxlan
                } else {
                    Tunnel::Geneve
                };
                if !matches_tunnel(matched, tunnel) {
                    let vni = format!("{}.vni", tunnel.name());
                    self.err(a.span, format!("`{name}` of a tunnel this rule does not match")).hint = Some(format!(
                        "match `{vni}` or `udp.dst {}` in the same rule so only {} packets are decapsulated",
                        tunnel.default_port(),
                        tunnel.name().to_uppercase()
                    ));
                    return None;
                }
                Action::Decap(tunnel)
            }
            "ct.commit" => {
                let zone = match a.args.get(1) {
                    Some(w) => self.int_in(w, "zone", 0, 65535)? as u16,
                    None => 0,
                };
                Action::CtCommit { zone }
            }
            _ => unreachable!("the parser accepts only known actions"),
        })
    }

    fn encap(&mut self, a: &ast::Action, tunnel: Tunnel) -> Option<Encap> {
        let opts = a.block.as_deref().unwrap_or_default();
        self.check_repeats(opts, &["option"]);
        let mut vni = None;
        let mut src: Option<IpAddr> = None;
        let mut dst: Option<IpAddr> = None;
        let mut smac = None;
        let mut dmac = None;
        let mut udp_dst = tunnel.default_port();
        let mut ttl = 64;
        let mut options = Vec::new();
        let mut ok = true;
        let mac_field = Field {
            id: FieldId::EthSrc,
            inner: false,
        };
        for o in opts {
            if o.key.text == "option" {
                match self.geneve_option(o, tunnel) {
                    Some(opt) => options.push(opt),
                    None => ok = false,
                }
                continue;
            }
            let Some(w) = self.single(o) else {
                ok = false;
                continue;
            };
            let r = match o.key.as_str() {
                "vni" => self
                    .int_in(w, "VNI", 0, (1 << 24) - 1)
                    .map(|v| vni = Some(v as u32)),
                "src" | "dst" => self
                    .parsed(w, "IP address", "write an IPv4 or IPv6 address", |t| {
                        t.parse::<IpAddr>().ok()
                    })
                    .map(|ip| {
                        if o.key.text == "src" {
                            src = Some(ip)
                        } else {
                            dst = Some(ip)
                        }
                    }),
                "smac" => self.mac(mac_field, w).map(|m| smac = Some(m)),
                "dmac" => self.mac(mac_field, w).map(|m| dmac = Some(m)),
                "dport" => self
                    .int_in(w, "UDP port", 1, 65535)
                    .map(|p| udp_dst = p as u16),
                "ttl" => self.int_in(w, "TTL", 1, 255).map(|t| ttl = t as u8),
                _ => unreachable!("the parser accepts only encap keys"),
            };
            ok &= r.is_some();
        }
        for (key, missing) in [
            ("vni", vni.is_none()),
            ("src", src.is_none()),
            ("dst", dst.is_none()),
            ("smac", smac.is_none()),
            ("dmac", dmac.is_none()),
        ] {
            if missing && ok {
                self.err(a.name.span, format!("`{}` needs `{key}`", a.name.text)).hint =
                    Some("encapsulation takes vni, src, dst, smac and dmac (dport, ttl and option are optional)".into());
                ok = false;
            }
        }
        if !ok {
            return None;
        }
        let (src, dst) = (src?, dst?);
        if src.is_ipv4() != dst.is_ipv4() {
            let span = opt_value(opts, "dst").map_or(a.span, |o| o.values[0].span);
            self.err(span, "outer `src` and `dst` are of different IP versions");
            return None;
        }
        let total: usize = options
            .iter()
            .map(|o: &GeneveOption| 4 + o.data.len())
            .sum();
        if total > 252 {
            self.err(
                a.span,
                format!("Geneve options take {total} bytes; the header allows 252 (RFC 8926 §3.4)"),
            );
            return None;
        }
        Some(Encap {
            tunnel,
            vni: vni?,
            src,
            dst,
            smac: mac_bytes(smac?),
            dmac: mac_bytes(dmac?),
            udp_dst,
            ttl,
            options,
        })
    }

    /// `option CLASS TYPE DATA` (RFC 8926 §3.5); a type with its top bit set is critical.
    fn geneve_option(&mut self, o: &Opt, tunnel: Tunnel) -> Option<GeneveOption> {
        if tunnel != Tunnel::Geneve {
            self.err(o.key.span, "VXLAN has no options").hint =
                Some("options belong to `geneve.encap`".into());
            return None;
        }
        if o.values.len() != 3 {
            self.err(o.key.span, "`option` takes a class, a type and data")
                .hint = Some("e.g. `option 0x0102 0x80 0x0000000a`".into());
            return None;
        }
        let class = self.int_in(&o.values[0], "option class", 0, 0xffff)? as u16;
        let kind = self.int_in(&o.values[1], "option type", 0, 0xff)? as u8;
        let data = self.parsed(
            &o.values[2],
            "option data",
            "write 0x and a multiple of 8 hex digits",
            value::hex_bytes,
        )?;
        if data.len() % 4 != 0 || data.len() > 124 {
            self.err(
                o.values[2].span,
                format!(
                    "option data is {} bytes; it must be a multiple of 4, at most 124",
                    data.len()
                ),
            );
            return None;
        }
        Some(GeneveOption {
            class,
            kind,
            critical: kind & 0x80 != 0,
            data,
        })
    }

    // ---- whole-pipeline checks -----------------------------------------------------

    /// `goto` cycles are errors; pipes no root pipe reaches are warnings.
    fn check_graph(&mut self, pipes: &[&ast::Pipe], gotos: &[Vec<(u16, Span)>]) {
        #[derive(Clone, Copy, PartialEq)]
        enum Mark {
            New,
            Active,
            Done,
        }
        let n = pipes.len();
        let mut mark = vec![Mark::New; n];
        for start in 0..n {
            if mark[start] != Mark::New {
                continue;
            }
            // Iterative DFS; the stack holds (pipe, next edge index).
            let mut stack = vec![(start, 0usize)];
            mark[start] = Mark::Active;
            while let Some(&mut (p, ref mut next)) = stack.last_mut() {
                if let Some(&(to, span)) = gotos[p].get(*next) {
                    *next += 1;
                    let to = to as usize;
                    match mark[to] {
                        Mark::New => {
                            mark[to] = Mark::Active;
                            stack.push((to, 0));
                        }
                        Mark::Active => {
                            let from = stack.iter().position(|&(q, _)| q == to).unwrap_or(0);
                            let path: Vec<&str> = stack[from..]
                                .iter()
                                .map(|&(q, _)| pipes[q].name.as_str())
                                .chain([pipes[to].name.as_str()])
                                .collect();
                            self.err(span, format!("`goto` cycle: {}", path.join(" -> ")))
                                .hint = Some(
                                "the pipe graph must be acyclic: a packet may not re-enter a pipe"
                                    .into(),
                            );
                        }
                        Mark::Done => {}
                    }
                } else {
                    mark[p] = Mark::Done;
                    stack.pop();
                }
            }
        }
        let mut reached = vec![false; n];
        let mut work: Vec<usize> = (0..n).filter(|&i| !pipes[i].from.is_empty()).collect();
        while let Some(p) = work.pop() {
            if std::mem::replace(&mut reached[p], true) {
                continue;
            }
            work.extend(gotos[p].iter().map(|&(to, _)| to as usize));
        }
        for (i, p) in pipes.iter().enumerate() {
            if !reached[i] {
                self.diags.push(
                    Diagnostic::warning(p.name.span, format!("pipe `{}` is not reached from any root pipe", p.name.text))
                        .hint("feed it from a port with `root from PORT`, or `goto` it from a reached pipe"),
                );
            }
        }
    }

    /// Warns where packets from an af_xdp port can be sent `to` a local service: an AF_XDP
    /// port takes its interface's frames before the kernel's stack sees them, so they
    /// never reach the service's socket (an af_packet port leaves the stack its copy).
    fn check_services_reachable(
        &mut self,
        ports: &[Port],
        pipes: &[&ast::Pipe],
        gotos: &[Vec<(u16, Span)>],
        to_services: &[Vec<Span>],
    ) {
        for port in ports.iter().filter(|p| p.driver == Driver::AfXdp) {
            let mut reached = vec![false; pipes.len()];
            let mut work: Vec<usize> = (0..pipes.len())
                .filter(|&i| pipes[i].from.iter().any(|w| w.text == port.name))
                .collect();
            while let Some(p) = work.pop() {
                if std::mem::replace(&mut reached[p], true) {
                    continue;
                }
                work.extend(gotos[p].iter().map(|&(to, _)| to as usize));
            }
            let first = (0..pipes.len())
                .filter(|&i| reached[i])
                .find_map(|i| to_services[i].first());
            if let Some(&at) = first {
                self.diags.push(
                    Diagnostic::warning(
                        at,
                        format!(
                            "packets from port `{}` (driver af_xdp) sent here never reach the \
                             service: AF_XDP takes them away from the kernel's stack, where it \
                             listens",
                            port.name
                        ),
                    )
                    .hint(format!(
                        "give port `{}` driver af_packet, or reach the service through another interface",
                        port.name
                    )),
                );
            }
        }
    }

    /// Warns about each rule that an earlier rule of the same pipe fully covers.
    fn check_shadowing(&mut self, pipe: &Word, rules: &[(Rule, RuleSite)]) {
        let plain: Vec<&Rule> = rules.iter().map(|(r, _)| r).collect();
        let mut more = 0;
        for (j, covering) in shadowing(&plain).into_iter().enumerate() {
            if covering.is_some() && self.shadow_warnings == MAX_SHADOW_WARNINGS {
                more += 1;
            } else if let Some(i) = covering {
                self.shadow_warnings += 1;
                let (a, b) = (&rules[i].0.name, &rules[j].0.name);
                self.diags.push(
                    Diagnostic::warning(rules[j].1.span, format!("rule `{b}` is never used: rule `{a}` before it matches every packet it matches"))
                        .note(rules[i].1.span, format!("rule `{a}` is here"))
                        .hint("remove the rule, or move it above the broader one"),
                );
            }
        }
        if more > 0 {
            self.diags.push(Diagnostic::warning(
                pipe.span,
                format!("{more} more rules of pipe `{}` are never used (only the first {MAX_SHADOW_WARNINGS} are shown)", pipe.text),
            ));
        }
    }
}

#[derive(Default)]
struct PipeCtx {
    gotos: Vec<(u16, Span)>,
    /// Where the pipe's `to SERVICE` actions are.
    to_services: Vec<Span>,
    failed: bool,
}

/// An action's argument; the parser guarantees the count for each action.
/// Each key that an earlier one repeats, beside the earlier one: `(first, repeat)` as
/// indices into `keys`. Found by sorting rather than by a map of every key to where it was
/// written, which cost a hash and an allocation an entry on tables of a million entries.
fn duplicates<K: Ord>(keys: &[K]) -> Vec<(usize, usize)> {
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_unstable_by(|&a, &b| keys[a].cmp(&keys[b]).then(a.cmp(&b)));
    let mut found = Vec::new();
    let mut first = None;
    for pair in order.windows(2) {
        if keys[pair[0]] == keys[pair[1]] {
            found.push((*first.get_or_insert(pair[0]), pair[1]));
        } else {
            first = None;
        }
    }
    found
}

fn arg<'o, 'a>(a: &'o ast::Action<'a>, i: usize) -> Option<&'o Word<'a>> {
    a.args.get(i)
}

fn is_terminal_name(name: &str) -> bool {
    matches!(name, "fwd" | "goto" | "drop" | "to")
}

fn mac_bytes(v: u128) -> [u8; 6] {
    let b = v.to_be_bytes();
    b[10..16].try_into().expect("six bytes")
}

/// Whether any rule of the pipe commits to or matches on connection tracking.
fn uses_conntrack(p: &Pipe) -> bool {
    let lists = p.body.action_lists().chain(std::iter::once(&p.miss));
    let commits = lists
        .flat_map(|l| &l.0)
        .any(|a| matches!(a, Action::CtCommit { .. }));
    let matches = match &p.body {
        PipeBody::Rules(rules) => rules
            .iter()
            .flat_map(|r| &r.matches)
            .any(|m| m.field.id == FieldId::CtState),
        _ => false,
    };
    commits || matches
}

/// Whether the match list pins the packet to the given tunnel.
fn matches_tunnel(matched: &[FieldMatch], tunnel: Tunnel) -> bool {
    let port = tunnel.default_port() as u128;
    matched.iter().any(|m| match (tunnel, m.field.id) {
        (Tunnel::Vxlan, FieldId::VxlanVni) => !m.field.inner,
        (Tunnel::Geneve, FieldId::GeneveVni | FieldId::GeneveOptClass | FieldId::GeneveOptType) => {
            !m.field.inner
        }
        (_, FieldId::UdpDst | FieldId::L4Dst) => {
            !m.field.inner && m.pattern == Pattern::exact(port, m.field.kind())
        }
        _ => false,
    })
}

/// The match list of a ClassBench rule; wildcards are left out.
pub fn classbench_matches(r: &ClassBenchRule) -> Vec<FieldMatch> {
    let f = |id| Field { id, inner: false };
    let mut m = Vec::new();
    for (id, (addr, len)) in [(FieldId::Ipv4Src, r.src), (FieldId::Ipv4Dst, r.dst)] {
        if len > 0 {
            m.push(FieldMatch {
                field: f(id),
                pattern: Pattern::prefix(addr.into(), len, ValueKind::Ipv4),
            });
        }
    }
    if r.proto.1 != 0 {
        m.push(FieldMatch {
            field: f(FieldId::IpProto),
            pattern: Pattern::Masked {
                value: (r.proto.0 & r.proto.1).into(),
                mask: r.proto.1.into(),
            },
        });
    }
    for (id, (lo, hi)) in [(FieldId::L4Src, r.sport), (FieldId::L4Dst, r.dport)] {
        if (lo, hi) != (0, 65535) {
            m.push(FieldMatch {
                field: f(id),
                pattern: Pattern::Range {
                    lo: lo.into(),
                    hi: hi.into(),
                },
            });
        }
    }
    m.sort_by_key(|m| m.field);
    m
}

fn read_capped(path: &Path) -> std::io::Result<String> {
    let file = std::fs::File::open(path)?;
    if file.metadata()?.is_dir() {
        return Err(std::io::Error::other("it is a directory"));
    }
    let mut bytes = Vec::new();
    file.take(MAX_RULE_FILE_BYTES + 1).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > MAX_RULE_FILE_BYTES {
        return Err(std::io::Error::other(format!(
            "larger than {} MiB",
            MAX_RULE_FILE_BYTES >> 20
        )));
    }
    String::from_utf8(bytes).map_err(|e| {
        std::io::Error::other(format!(
            "not UTF-8 text (byte {})",
            e.utf8_error().valid_up_to()
        ))
    })
}

fn file_start(main: FileId, file: &ast::File) -> Span {
    match file.items.first() {
        Some(Item::Named(b)) => b.keyword,
        Some(Item::Settings(s)) => s.keyword,
        Some(Item::Pipe(p)) => p.name.span,
        Some(Item::Pipeline(w)) => w.span,
        None => Span::new(main, 0, 0),
    }
}

#[cfg(test)]
mod tests {
    use super::duplicates;

    #[test]
    fn each_repeat_is_paired_with_the_first_of_its_key() {
        let mut found = duplicates(&[3, 1, 3, 2, 3, 1]);
        found.sort();
        assert_eq!(found, [(0, 2), (0, 4), (1, 5)]);
        assert!(duplicates::<u8>(&[]).is_empty());
        assert!(duplicates(&[1, 2, 3]).is_empty());
    }
}
