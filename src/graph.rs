//! Graphviz DOT rendering of a program: ports, pipes and their rules, and the edges that
//! `from`, `goto`, `fwd`, `mirror` and `to` make.

use crate::ir::{Action, ActionList, PipeBody, Program};
use std::fmt::Write as _;

/// Pipes with more entries than this are drawn as one node with a count, not entry by entry.
const MAX_DRAWN_ENTRIES: usize = 40;

fn quote(s: &str) -> String {
    let mut q = String::with_capacity(s.len() + 2);
    q.push('"');
    for c in s.chars() {
        match c {
            '"' | '\\' => {
                q.push('\\');
                q.push(c);
            }
            '\n' => q.push_str("\\n"),
            _ => q.push(c),
        }
    }
    q.push('"');
    q
}

/// The program as a DOT digraph, ready for `dot -Tsvg`.
pub fn to_dot(p: &Program) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "digraph {} {{", quote(&p.name));
    out.push_str("  rankdir=LR;\n  node [fontname=\"Helvetica\", fontsize=10];\n  edge [fontname=\"Helvetica\", fontsize=9];\n");
    for port in &p.ports {
        let label = format!("{}\\n({})", port.name, port.driver.name());
        let _ = writeln!(
            out,
            "  {} [shape=box, style=\"rounded,filled\", fillcolor=\"#dde8f5\", label=\"{label}\"];",
            quote(&format!("port:{}", port.name))
        );
    }
    for s in &p.services {
        let _ = writeln!(
            out,
            "  {} [shape=component, label={}];",
            quote(&format!("service:{}", s.name)),
            quote(&s.name)
        );
    }
    let mut edges = String::new();
    for pipe in &p.pipes {
        let pid = format!("pipe:{}", pipe.name);
        let _ = writeln!(
            out,
            "  subgraph {} {{",
            quote(&format!("cluster_{}", pipe.name))
        );
        let kind = match &pipe.body {
            PipeBody::Rules(_) => "rules",
            PipeBody::Exact { .. } => "exact table",
            PipeBody::Lpm { .. } => "lpm table",
        };
        let _ = writeln!(
            out,
            "    label={};",
            quote(&format!("pipe {} ({kind})", pipe.name))
        );
        let _ = writeln!(out, "    {} [shape=point];", quote(&pid));
        for port in &pipe.from {
            let _ = writeln!(
                edges,
                "  {} -> {} [style=bold];",
                quote(&format!("port:{}", p.port(*port).name)),
                quote(&pid)
            );
        }
        let node = |out: &mut String,
                    edges: &mut String,
                    id: String,
                    label: String,
                    actions: &ActionList| {
            let _ = writeln!(
                out,
                "    {} [shape=box, label={}];",
                quote(&id),
                quote(&label)
            );
            let _ = writeln!(
                edges,
                "  {} -> {} [arrowhead=none, style=dotted];",
                quote(&pid),
                quote(&id)
            );
            action_edges(p, &id, actions, edges);
        };
        let n = pipe.body.len();
        if n > MAX_DRAWN_ENTRIES {
            // One node for all entries; its edges are the union of their targets.
            let id = format!("{pid}/entries");
            let _ = writeln!(
                out,
                "    {} [shape=box3d, label={}];",
                quote(&id),
                quote(&format!("{n} entries"))
            );
            let _ = writeln!(
                edges,
                "  {} -> {} [arrowhead=none, style=dotted];",
                quote(&pid),
                quote(&id)
            );
            let mut seen = std::collections::BTreeSet::new();
            for list in pipe.body.action_lists() {
                for a in &list.0 {
                    if let Some(target) = target(p, a) {
                        if seen.insert(target.clone()) {
                            let _ = writeln!(
                                edges,
                                "  {} -> {} [label={}];",
                                quote(&id),
                                quote(&target.0),
                                quote(&target.1)
                            );
                        }
                    }
                }
            }
        } else {
            match &pipe.body {
                PipeBody::Rules(rules) => {
                    for r in rules {
                        node(
                            &mut out,
                            &mut edges,
                            format!("{pid}/rule:{}", r.name),
                            format!("rule {}", r.name),
                            &r.actions,
                        );
                    }
                }
                PipeBody::Lpm { actions, .. } | PipeBody::Exact { actions, .. } => {
                    for (i, list) in actions.iter().enumerate() {
                        let label = pipe.entry_name(i);
                        node(&mut out, &mut edges, format!("{pid}/{label}"), label, list);
                    }
                }
            }
        }
        node(
            &mut out,
            &mut edges,
            format!("{pid}/default"),
            "default".into(),
            &pipe.miss,
        );
        out.push_str("  }\n");
    }
    out.push_str(&edges);
    out.push_str("}\n");
    out
}

/// The node an action leads to and the edge label, if it leads anywhere.
fn target(p: &Program, a: &Action) -> Option<(String, String)> {
    Some(match a {
        Action::Fwd(port) => (format!("port:{}", p.port(*port).name), "fwd".into()),
        Action::Mirror(port) => (format!("port:{}", p.port(*port).name), "mirror".into()),
        Action::Goto(pipe) => (format!("pipe:{}", p.pipe(*pipe).name), "goto".into()),
        Action::ToService(s) => (
            format!("service:{}", p.services[s.index()].name),
            "to".into(),
        ),
        _ => return None,
    })
}

fn action_edges(p: &Program, from: &str, actions: &ActionList, edges: &mut String) {
    for a in &actions.0 {
        if let Some((to, label)) = target(p, a) {
            let style = if label == "mirror" {
                ", style=dashed"
            } else {
                ""
            };
            let _ = writeln!(
                edges,
                "  {} -> {} [label={}{style}];",
                quote(from),
                quote(&to),
                quote(&label)
            );
        }
        if matches!(a, Action::Drop) {
            let _ = writeln!(edges, "  {} [color=\"#b03030\"];", quote(from));
        }
    }
}
