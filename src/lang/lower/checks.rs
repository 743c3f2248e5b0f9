//! Checks of the whole program once lowered: the pipe graph, services reached, rules
//! shadowed.

use super::{Lowerer, RuleSite};
use crate::ir::*;
use crate::lang::ast::{self, Word};
use crate::lang::diag::{Diagnostic, Span};

/// Shadowed rules reported one by one per file; the rest are counted in one warning.
const MAX_SHADOW_WARNINGS: usize = 20;

impl Lowerer<'_> {
    /// `goto` cycles are errors; pipes no root pipe reaches are warnings.
    pub(super) fn check_graph(&mut self, pipes: &[&ast::Pipe], gotos: &[Vec<(u16, Span)>]) {
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
    pub(super) fn check_services_reachable(
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
    pub(super) fn check_shadowing(&mut self, pipe: &Word, rules: &[(Rule, RuleSite)]) {
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
