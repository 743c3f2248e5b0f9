//! Semantic checks: the syntax tree becomes the IR, or diagnostics say why not.
//!
//! Order: declare every name (duplicates reported), lower the option blocks, lower each
//! pipe's rules, tables and actions (names resolved, values range-checked, action lists
//! checked for conflicts), then check the pipe graph (cycles, reachability) and look for
//! shadowed rules.
//!
//! Here: names, pipes, rules and tables. The blocks beside the pipes are lowered in
//! `settings` (ports, meters, connection tracking, telemetry) and `service`; rules' parts
//! in `matches` and `actions`; the whole program's checks in `checks`.

use super::ast::{self, BlockKind, Item, Opt, PipeItem, Word};
use super::classbench::{self, ClassBenchRule};
use super::diag::{did_you_mean, Diagnostic, FileId, SourceMap, Span};
use super::value;
use crate::ir::*;
use std::collections::HashMap;
use std::io::Read;
use std::path::{Path, PathBuf};

mod actions;
mod checks;
mod matches;
mod service;
mod settings;

use service::target_span;
use settings::DEFAULT_CT_CAPACITY;

/// The least IPFIX path MTU: 576, the datagram every IPv4 host takes (RFC 791); less IP
/// and UDP headers it leaves room for the templates' message (512 bytes).
pub const MIN_IPFIX_MTU: u16 = 576;

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
        let mut program = Program {
            name,
            ports,
            pipes,
            meters,
            services,
            conntrack,
            telemetry,
        };
        program.note_arrivals();
        Some(program)
    }

    // ---- option blocks -------------------------------------------------------------

    /// The value of a one-value option (the parser guarantees there is one).
    /// The TLS files of a listener (of `owner`, written at `at`): a certificate and its
    /// key together, a client CA only with them; none at all is no TLS. `Err` once
    /// reported.
    fn tls_files(
        &mut self,
        cert: Option<PathBuf>,
        key: Option<PathBuf>,
        client_ca: Option<PathBuf>,
        at: Span,
        owner: &str,
    ) -> Result<Option<TlsFiles>, ()> {
        match (cert, key) {
            (Some(cert), Some(key)) => Ok(Some(TlsFiles {
                cert,
                key,
                client_ca,
            })),
            (None, None) if client_ca.is_none() => Ok(None),
            (cert, _) => {
                let (has, lacks) = if cert.is_some() {
                    ("tls_cert", "tls_key")
                } else {
                    ("tls_key or tls_client_ca", "tls_cert")
                };
                self.err(at, format!("{owner} has `{has}` but no `{lacks}`"))
                    .hint = Some("TLS needs `tls_cert` and `tls_key` (PEM files) together".into());
                Err(())
            }
        }
    }

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

    /// `rate 10000 pps` (number and unit may be one word or two).
    fn joined(&mut self, o: &Opt) -> (String, Span) {
        let text: String = o.values.iter().map(|w| w.as_str()).collect();
        let span = o.values[0].span.to(o.values[o.values.len() - 1].span);
        (text, span)
    }

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
