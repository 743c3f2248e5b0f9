//! Pipeline files: text → tokens → syntax tree → checks → [`crate::ir::Program`].
//!
//! [`check_file`] and [`check_source`] are the entry points. They never panic on any
//! input: a file yields a program, or diagnostics that say what is wrong and where.

pub mod ast;
pub mod classbench;
pub mod diag;
mod lexer;
mod lower;
pub mod parser;
pub mod value;

pub use diag::{Diagnostic, Severity, SourceMap, Span};
pub use lower::{classbench_matches, MIN_IPFIX_MTU};

use crate::ir::Program;
use std::path::Path;

/// The outcome of checking one pipeline file.
#[derive(Debug)]
pub struct Checked {
    /// The pipeline file and every rule file it read, for rendering diagnostics.
    pub sources: SourceMap,
    /// Errors and warnings, in the order found.
    pub diagnostics: Vec<Diagnostic>,
    /// The program, when there is no error.
    pub program: Option<Program>,
}

impl Checked {
    pub fn has_errors(&self) -> bool {
        self.diagnostics
            .iter()
            .any(|d| d.severity == Severity::Error)
    }

    /// Every diagnostic rendered rustc-style, one after another.
    pub fn render(&self) -> String {
        self.diagnostics
            .iter()
            .map(|d| self.sources.render(d))
            .collect()
    }
}

/// Reads and checks a pipeline file. Only failing to read the file itself is an `Err`;
/// rule files it names are resolved relative to its directory.
pub fn check_file(path: &Path) -> std::io::Result<Checked> {
    let bytes = std::fs::read(path)?;
    let base = path.parent().unwrap_or(Path::new("."));
    Ok(check_bytes(&path.display().to_string(), &bytes, base))
}

/// Checks pipeline text given as bytes; invalid UTF-8 is an error at its first bad byte.
pub fn check_bytes(name: &str, bytes: &[u8], base_dir: &Path) -> Checked {
    match std::str::from_utf8(bytes) {
        Ok(text) => check_source(name, text, base_dir),
        Err(e) => {
            let mut sources = SourceMap::default();
            let at = e.valid_up_to();
            let file = sources.add(name, String::from_utf8_lossy(bytes).into_owned());
            let d = Diagnostic::error(
                Span::new(file, at, at + char::REPLACEMENT_CHARACTER.len_utf8()),
                "the file is not valid UTF-8 text",
            )
            .hint("pipeline files are UTF-8 text");
            Checked {
                sources,
                diagnostics: vec![d],
                program: None,
            }
        }
    }
}

/// Checks pipeline text; `base_dir` is where `rules from` paths are resolved.
pub fn check_source(name: &str, text: &str, base_dir: &Path) -> Checked {
    let mut sources = SourceMap::default();
    let file = sources.add(name, text.to_owned());
    let mut diags = Vec::new();
    let ast = parser::parse(file, text, &mut diags);
    let (program, mut diagnostics) = lower::lower(&ast, &mut sources, file, base_dir, diags);
    // Report in reading order: by file, then position.
    diagnostics.sort_by_key(|d| (d.span.file.0, d.span.start));
    Checked {
        sources,
        diagnostics,
        program,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{Action, Driver, PipeBody, Tunnel};

    fn program(text: &str) -> Program {
        let c = check_source("t.pipe", text, Path::new("."));
        assert!(!c.has_errors(), "{}", c.render());
        c.program.expect("valid")
    }

    #[test]
    fn conntrack_defaults_when_used_without_a_block() {
        let p = program("pipeline p\nport a { driver pcap }\npipe x from a { rule r { actions ct.commit, fwd a } default { actions drop } }");
        assert_eq!(p.conntrack.map(|c| c.capacity), Some(1 << 20));
        let p = program(
            "pipeline p\nport a { driver pcap }\npipe x from a { default { actions drop } }",
        );
        assert!(p.conntrack.is_none());
    }

    /// The KV-cache service of a pipeline whose service block has `option`.
    fn kvcache(option: &str) -> crate::ir::KvCache {
        let p = program(&format!(
            "pipeline p\nport a {{ driver pcap }}\n\
             service kvcache {{ listen 127.0.0.1:6379 target \"file:///tmp/kv\" capacity 1GiB {option} }}\n\
             pipe x root from a {{ default {{ actions to kvcache }} }}\n"
        ));
        let crate::ir::ServiceKind::KvCache(kv) = p.services[0].kind.clone();
        kv
    }

    #[test]
    fn kvcache_page_cache_is_left_to_the_target_unless_set() {
        assert_eq!(kvcache("").page_cache, None);
        assert_eq!(kvcache("page_cache on").page_cache, Some(true));
        assert_eq!(kvcache("page_cache off").page_cache, Some(false));
    }

    #[test]
    fn kvcache_stripes_over_its_targets_in_order() {
        let one = kvcache("");
        assert_eq!(one.targets.len(), 1);
        let two = kvcache("target \"nbd://127.0.0.1:10809/b\"");
        assert_eq!(
            two.targets[1],
            crate::ir::StorageTarget::Nbd {
                addr: "127.0.0.1:10809".parse().unwrap(),
                export: "b".into()
            }
        );
        assert_eq!(two.stripe, 1 << 20);
        assert_eq!(kvcache("stripe 256KiB").stripe, 256 << 10);
        // The default stripe is whole blocks.
        assert_eq!(kvcache("block_size 768KiB").stripe, 1536 << 10);
    }

    #[test]
    fn kvcache_discards_only_when_asked() {
        assert!(!kvcache("").discard);
        assert!(kvcache("discard on").discard);
        assert!(!kvcache("discard off").discard);
    }

    #[test]
    fn kvcache_checkpoints_default_to_a_minute_and_can_be_turned_off() {
        let checkpoint = |option: &str| kvcache(option).checkpoint;
        assert_eq!(checkpoint(""), Some(std::time::Duration::from_secs(60)));
        assert_eq!(
            checkpoint("checkpoint 5m"),
            Some(std::time::Duration::from_secs(300))
        );
        assert_eq!(checkpoint("checkpoint off"), None);
    }

    /// Packets an af_xdp port receives never reach a local service, through however many
    /// pipes: `to` is warned about where such packets can reach it, not where they cannot.
    #[test]
    fn services_behind_af_xdp_ports_are_warned_about() {
        let text = |driver: &str| {
            format!(
                "pipeline p\nport f {{ driver {driver} iface \"x\" }}\nport g {{ driver pcap }}\n\
                 service kvcache {{ listen 127.0.0.1:6379 target \"file:///tmp/kv\" capacity 1GiB }}\n\
                 pipe a root from f {{ rule r {{ match tcp.dst 6379 actions goto b }} default {{ actions drop }} }}\n\
                 pipe b {{ default {{ actions to kvcache }} }}\n\
                 pipe c root from g {{ default {{ actions to kvcache }} }}\n"
            )
        };
        let warned = |driver: &str| {
            let c = check_source("t.pipe", &text(driver), Path::new("."));
            assert!(!c.has_errors(), "{}", c.render());
            c.render()
                .lines()
                .filter(|l| l.contains("never reach the service"))
                .map(str::to_owned)
                .collect::<Vec<_>>()
        };
        let w = warned("af_xdp");
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].starts_with("t.pipe:6:"), "{w:?}");
        assert!(w[0].contains("port `f` (driver af_xdp)"), "{w:?}");
        assert!(warned("af_packet").is_empty());
    }

    #[test]
    fn lowers_encap_tables_and_ids() {
        let p = program(
            "pipeline p\nport h { driver af_xdp iface \"x\" }\nport u { driver pcap }\n\
             pipe a root from h { table lpm ipv4.dst { 10.1.0.0/16 => vxlan.encap { vni 100 src 192.0.2.1 dst 192.0.2.10 \
             smac 02:00:00:00:00:01 dmac 02:00:00:00:00:02 }, fwd u } default { actions drop } }",
        );
        assert_eq!(p.ports[0].driver, Driver::AfXdp);
        assert_eq!(p.root_of(crate::ir::PortId(0)), Some(crate::ir::PipeId(0)));
        let PipeBody::Lpm {
            prefixes, actions, ..
        } = &p.pipes[0].body
        else {
            panic!()
        };
        assert_eq!((prefixes[0].value, prefixes[0].len), (0x0a01_0000, 16));
        let Action::Encap(e) = &actions.get(0).unwrap().0[0] else {
            panic!()
        };
        assert_eq!(
            (e.tunnel, e.vni, e.udp_dst, e.ttl),
            (Tunnel::Vxlan, 100, 4789, 64)
        );
        assert_eq!(e.dmac, [2, 0, 0, 0, 0, 2]);
        assert_eq!(
            actions.get(0).unwrap().terminal(),
            &Action::Fwd(crate::ir::PortId(1))
        );
    }

    /// `clamp tcp.mss` takes an MSS of 536 or more, or `mtu`; nothing else.
    #[test]
    fn clamps_take_an_mss_or_the_mtu() {
        let text = |to: &str| {
            format!(
                "pipeline p\nport a {{ driver pcap }}\n\
                 pipe x root from a {{ default {{ actions clamp tcp.mss {to}, fwd a }} }}"
            )
        };
        let first = |to: &str| program(&text(to)).pipes[0].miss.0[0].clone();
        assert_eq!(first("1410"), Action::ClampMss(1410));
        assert_eq!(first("mtu"), Action::ClampMssToMtu);
        for (to, error) in [
            ("535", "MSS 535 is out of range (536-65535)"),
            ("pmtu", "MSS"),
        ] {
            let c = check_source("t.pipe", &text(to), Path::new("."));
            assert!(
                c.has_errors() && c.render().contains(error),
                "{}",
                c.render()
            );
        }
    }

    #[test]
    fn telemetry_block_sets_the_ipfix_settings() {
        let text =
            "pipeline p\nport a { driver pcap }\ntelemetry { ipfix 127.0.0.1:4739 sampling 100 }\n\
                    pipe x root from a { default { actions drop } }";
        assert_eq!(program(text).telemetry.sampling, 100);
        let named =
            "pipeline p\nport a { driver pcap }\ntelemetry { ipfix collector.example:4739 }\n\
                     pipe x root from a { default { actions drop } }";
        let collectors = program(named).telemetry.ipfix;
        assert_eq!(collectors.len(), 1);
        assert_eq!(collectors[0].to_string(), "collector.example:4739");
        let two = named.replace("ipfix", "ipfix 10.0.0.1:4739  ipfix");
        let collectors = program(&two).telemetry.ipfix;
        let names: Vec<String> = collectors.iter().map(ToString::to_string).collect();
        assert_eq!(names, ["10.0.0.1:4739", "collector.example:4739"]);
        let twice = named.replace("ipfix", "ipfix collector.example:4739  ipfix");
        let c = check_source("t.pipe", &twice, Path::new("."));
        assert!(
            (c.render()).contains("error: collector `collector.example:4739` is given twice"),
            "{}",
            c.render()
        );
        let sized = "pipeline p\nport a { driver pcap }\ntelemetry { flow_cache 64k }\n\
                     pipe x root from a { default { actions drop } }";
        assert_eq!(program(sized).telemetry.flow_cache, 64_000);
        let domain = "pipeline p\nport a { driver pcap }\ntelemetry { observation_domain 42 }\n\
                      pipe x root from a { default { actions drop } }";
        assert_eq!(program(domain).telemetry.observation_domain, 42);
        let jumbo = "pipeline p\nport a { driver pcap }\ntelemetry { ipfix_mtu 9000 }\n\
                     pipe x root from a { default { actions drop } }";
        assert_eq!(program(jumbo).telemetry.ipfix_mtu, 9000);
        let paced = "pipeline p\nport a { driver pcap }\ntelemetry { ipfix_rate 2500 }\n\
                     pipe x root from a { default { actions drop } }";
        assert_eq!(program(paced).telemetry.ipfix_rate, 2500);
        let https = "pipeline p\nport a { driver pcap }\n\
                     telemetry { tls_cert \"m.pem\" tls_key \"m.key\" tls_client_ca \"ca.pem\" }\n\
                     pipe x root from a { default { actions drop } }";
        let tls = program(https).telemetry.prometheus_tls.expect("TLS files");
        assert_eq!(tls.cert, Path::new("m.pem"));
        assert_eq!(tls.key, Path::new("m.key"));
        assert_eq!(tls.client_ca.as_deref(), Some(Path::new("ca.pem")));
        let users = https.replace("tls_client_ca", "basic_auth_file \"users\" tls_client_ca");
        let users = program(&users).telemetry.prometheus_users;
        assert_eq!(users.as_deref(), Some(Path::new("users")));
        // Basic auth only over TLS.
        let plain = "pipeline p\nport a { driver pcap }\ntelemetry { basic_auth_file \"users\" }\n\
                     pipe x root from a { default { actions drop } }";
        let c = check_source("t.pipe", plain, Path::new("."));
        assert!(
            c.render()
                .contains("error: `basic_auth_file` without TLS on the endpoint"),
            "{}",
            c.render()
        );
        let every =
            "pipeline p\nport a { driver pcap }\npipe x root from a { default { actions drop } }";
        assert_eq!(program(every).telemetry.sampling, 1);
        assert_eq!(program(every).telemetry.observation_domain, 1);
        assert_eq!(program(every).telemetry.ipfix_mtu, 1500);
        assert_eq!(program(every).telemetry.ipfix_rate, 10_000);
        assert_eq!(program(every).telemetry.prometheus_tls, None);
        assert_eq!(program(every).telemetry.prometheus_users, None);
    }
}
