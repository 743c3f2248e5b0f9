//! The DOCA Flow plan (`dpuflow plan`): the example pipelines' plans against their golden
//! files, plan shapes for the cases DOCA Flow constrains, every plan well formed by DOCA
//! Flow's rules, and the plan's hardware pipes run as DOCA Flow would run them
//! (priorities, masks, header types, misses) choosing the same entries as the software
//! engine, pipe after pipe, for random pipelines and packets and ClassBench firewalls.
//!
//! The plans are also installed, through a recorder of the DOCA Flow calls, and the
//! installed entries run byte by byte (each member read from the packet where the NIC's
//! parser finds it) against the plan's walk.
//!
//! After an intended change of the plans, regenerate the golden files with
//! `DPUFLOW_BLESS=1 cargo test --test doca_plan`.

use dpuflow::doca::image::{Image, Setting};
use dpuflow::doca::install::{self, Counted, EntrySpec, Steering, Target};
use dpuflow::doca::plan::{Entries, Fwd, HwId, PipeType, Plan, Role};
use dpuflow::doca::Selector;
use dpuflow::engine::field::{read, PacketState};
use dpuflow::engine::packet::PacketBuf;
use dpuflow::engine::parse::{TunnelPorts, L3};
use dpuflow::engine::{parse, Compiled, Engine, Observer, Verdict};
use dpuflow::ir::{Action, PipeBody, PipeId, PortId, Program, ServiceId};
use dpuflow::{doca, lang};
use proptest::prelude::*;
use std::path::Path;

fn program(text: &str) -> Program {
    let checked = lang::check_source("test.pipe", text, Path::new("."));
    match checked.program {
        Some(p) => p,
        None => panic!("{}\n{text}", checked.render()),
    }
}

const EXAMPLES: [&str; 4] = [
    "vxlan-gateway",
    "geneve-gateway",
    "stateful-firewall",
    "kv-offload",
];

fn example(name: &str) -> Program {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("pipelines/{name}.pipe"));
    program(&std::fs::read_to_string(&path).expect("example pipeline"))
}

#[test]
fn example_plans_match_their_golden_files() {
    let bless = std::env::var_os("DPUFLOW_BLESS").is_some();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    for name in EXAMPLES {
        let prog = example(name);
        let plan = doca::plan(&prog);
        // The plan, and the calls installing it makes (`dpuflow plan --calls`).
        let mut calls = install::Listing::new(Vec::new(), &prog);
        doca::install(&plan, &prog, &mut calls).expect("the plan installs");
        let calls = String::from_utf8(calls.into_inner()).expect("text");
        for (text, ext) in [(plan.to_string(), "plan"), (calls, "calls")] {
            let golden = root.join(format!("tests/data/plans/{name}.{ext}"));
            if bless {
                std::fs::write(&golden, &text).expect("golden file written");
            }
            let want = std::fs::read_to_string(&golden)
                .unwrap_or_else(|e| panic!("{}: {e}", golden.display()));
            assert_eq!(text, want, "{name}: differs from {}", golden.display());
        }
    }
}

const PORTS: &str = "pipeline t\nport a { driver pcap }\nport b { driver pcap }\n\
                     meter m { rate 1000000 pps burst 1000000 }\n";

fn plan_of(pipes: &str) -> Plan {
    let plan = doca::plan(&program(&format!("{PORTS}{pipes}")));
    assert_well_formed(&plan);
    plan
}

/// The plan of a pipe of one rule (and a default that drops) fed by port a.
fn one_rule(rule: &str) -> Plan {
    plan_of(&format!(
        "pipe p root from a {{\n{rule}\ndefault {{ actions drop }}\n}}"
    ))
}

/// Why the pipe, or one of its rules, is left to software.
fn software_reason(plan: &Plan, pipe: u16) -> Option<&str> {
    let whole = plan.software.iter().find(|(id, _)| id.0 == pipe);
    let rule = plan.software_rules.iter().find(|r| r.pipe.0 == pipe);
    whole
        .map(|(_, why)| why.as_str())
        .or(rule.map(|r| r.why.as_str()))
}

/// What DOCA Flow requires of a plan: a pipe created after every pipe it forwards to (an
/// entry names its next pipe by handle), misses only to a pipe or a drop, control entries
/// within the eight priorities and other pipes' entries without one, action indices
/// within their pipe's templates, flooding pipes of a power-of-two number of entries, one
/// root, created last.
fn assert_well_formed(plan: &Plan) {
    for (i, pipe) in plan.pipes.iter().enumerate() {
        let fwds = pipe.actions.iter().map(|a| a.fwd).chain([pipe.miss]);
        for fwd in fwds {
            if let Fwd::Pipe(HwId(next)) = fwd {
                assert!(
                    next < i,
                    "{} forwards to {}, created after it\n{plan}",
                    pipe.name,
                    plan.pipes[next].name
                );
            }
        }
        assert!(
            matches!(pipe.miss, Fwd::Pipe(_) | Fwd::Drop),
            "{}: miss {:?}",
            pipe.name,
            pipe.miss
        );
        assert_eq!(pipe.root, i == plan.root.0, "{}\n{plan}", pipe.name);
        if let Entries::Listed(entries) = &pipe.entries {
            for e in entries {
                assert!(
                    e.action < pipe.actions.len(),
                    "{}: action {}",
                    pipe.name,
                    e.action
                );
                match pipe.kind {
                    PipeType::Control => assert!(
                        e.priority
                            .is_some_and(|p| (p as usize) < doca::plan::CONTROL_PRIORITIES),
                        "{}: priority {:?}",
                        pipe.name,
                        e.priority
                    ),
                    _ => assert_eq!(e.priority, None, "{}", pipe.name),
                }
            }
        }
        if pipe.kind == PipeType::Flooding {
            assert!(pipe.entry_count().is_power_of_two(), "{}", pipe.name);
        }
        if let Entries::Table { indices, .. } = &pipe.entries {
            assert!(
                indices.iter().all(|&a| (a as usize) < pipe.actions.len()),
                "{}",
                pipe.name
            );
        }
    }
    assert_eq!(plan.root.0, plan.pipes.len() - 1, "{plan}");
}

#[test]
fn rules_past_eight_priorities_go_on_in_chained_control_pipes() {
    // Each rule overlaps those before it (ranges all holding port 1000) without being
    // covered by one (which would make it one that never matches, planned nowhere), so
    // each needs a priority after theirs.
    let rules = |n: usize| {
        (0..n)
            .map(|i| {
                format!(
                    "rule r{i} {{ match udp.dst {i}-{} actions fwd b }}\n",
                    1000 + i
                )
            })
            .collect::<String>()
    };
    let eight = plan_of(&format!(
        "pipe p root from a {{\n{}default {{ actions drop }}\n}}",
        rules(8)
    ));
    assert_eq!(
        eight
            .pipes
            .iter()
            .filter(|x| x.of == Some(PipeId(0)))
            .count(),
        1,
        "{eight}"
    );
    // A default that counts takes a priority of its own, the ninth: in a second pipe.
    let nine = plan_of(&format!(
        "pipe p root from a {{\n{}default {{ actions count, drop }}\n}}",
        rules(8)
    ));
    let second = nine
        .pipes
        .iter()
        .find(|x| x.role == Role::PipeRest)
        .expect("p.1");
    assert_eq!(second.entry_count(), 1, "{nine}");
    let first = nine.pipes.iter().find(|x| x.name == "p").expect("p");
    assert_eq!(
        nine.pipes[match first.miss {
            Fwd::Pipe(h) => h.0,
            other => panic!("{other:?}"),
        }]
        .name,
        "p.1"
    );
    let deep = plan_of(&format!(
        "pipe p root from a {{\n{}default {{ actions drop }}\n}}",
        rules(129)
    ));
    let why = software_reason(&deep, 0).expect("in software");
    assert!(why.contains("more than 16 control pipes"), "{why}");
}

#[test]
fn rules_no_packet_matches_together_share_a_priority() {
    let p = plan_of(
        "pipe p root from a {
            rule web   { match tcp.dst {80, 443}  actions fwd b }
            rule dns   { match udp.dst 53         actions fwd b }
            rule ping  { match icmp.type 8        actions fwd b }
            rule ping6 { match icmp6.type 128     actions fwd b }
            rule ssh   { match tcp.dst 22         actions fwd b }
            rule any   { match ipv4.dst 10.0.0.0/8 actions drop }
            default    { actions count, drop }
        }",
    );
    let control = p.pipes.iter().find(|x| x.name == "p").expect("pipe p");
    let Entries::Listed(entries) = &control.entries else {
        panic!("{p}")
    };
    let priorities: Vec<_> = entries
        .iter()
        .map(|e| (e.label.as_str(), e.priority))
        .collect();
    assert_eq!(
        priorities,
        [
            ("web", Some(0)),
            ("web", Some(0)),
            ("dns", Some(0)),
            ("ping", Some(0)),
            ("ping6", Some(0)),
            ("ssh", Some(0)),
            // It overlaps web, dns, ping and ssh (IPv4 packets to 10/8).
            ("any", Some(1)),
            ("default", Some(2)),
        ]
    );
}

#[test]
fn rules_that_never_match_take_no_entries() {
    let p = plan_of(
        "pipe p root from a {
            rule web  { match tcp.dst 1-1000 actions fwd b }
            rule http { match tcp.dst 80     actions drop }
            default   { actions drop }
        }",
    );
    let control = p.pipes.iter().find(|x| x.name == "p").expect("pipe p");
    let Entries::Listed(entries) = &control.entries else {
        panic!("{p}")
    };
    assert!(entries.iter().all(|e| e.label == "web"), "{p}");
}

#[test]
fn an_action_list_out_of_doca_order_stays_in_software() {
    // A rewrite after the encapsulation rewrites the new outer header: DOCA Flow modifies
    // before it encapsulates.
    let p = one_rule(
        "rule r { match ipv4.src 10.0.0.0/8 udp.dst 53 actions vxlan.encap { vni 1 src 192.0.2.1 dst 192.0.2.2 smac 02:00:00:00:00:01 dmac 02:00:00:00:00:02 }, set ipv4.dst 10.0.0.1, fwd b }",
    );
    let why = software_reason(&p, 0).expect("in software");
    assert!(why.contains("set ipv4.dst"), "{why}");
    // The other way round is one pipe: modify, then encap.
    let p = one_rule(
        "rule r { match ipv4.src 10.0.0.0/8 udp.dst 53 actions set ipv4.dst 10.0.0.1, vxlan.encap { vni 1 src 192.0.2.1 dst 192.0.2.2 smac 02:00:00:00:00:01 dmac 02:00:00:00:00:02 }, fwd b }",
    );
    assert!(p.software.is_empty(), "{p}");
    assert_eq!(p.encaps.len(), 1);
    // A mark is metadata: it may come anywhere in the list.
    let p = one_rule(
        "rule r { match ipv4.src 10.0.0.0/8 udp.dst 53 actions set ipv4.dst 10.0.0.1, mark 7, fwd b }",
    );
    assert!(p.software.is_empty(), "{p}");
}

#[test]
fn meters_mirrors_and_ttls_take_pipes_of_their_own() {
    let p = plan_of(
        "pipe p root from a {
            table lpm ipv4.dst {
                10.0.0.0/8  => dec ttl, fwd b
                10.9.0.0/16 => meter m, mirror a, count, fwd b
            }
            default { actions drop }
        }",
    );
    assert!(p.software.is_empty(), "{p}");
    let roles: Vec<Role> = p.pipes.iter().map(|x| x.role).collect();
    for role in [Role::DecTtl, Role::Mirror, Role::MeterColor, Role::Meter] {
        assert!(roles.contains(&role), "{role:?}\n{p}");
    }
    assert_eq!(p.meters.len(), 1);
    // A byte meter measures the packet as DOCA Flow has it when every rewrite is done:
    // an encapsulation after the meter would be counted.
    let p = one_rule(
        "rule r { match udp.dst 53 actions meter m, vxlan.encap { vni 1 src 192.0.2.1 dst 192.0.2.2 smac 02:00:00:00:00:01 dmac 02:00:00:00:00:02 }, fwd b }",
    );
    assert!(
        software_reason(&p, 0)
            .expect("in software")
            .contains("after a meter"),
        "{p}"
    );
}

#[test]
fn rewrites_are_planned_for_packets_sure_to_have_the_header() {
    // udp.dst 53 takes IPv6 packets too, where the engine leaves ipv4.dst alone.
    let p = one_rule("rule r { match udp.dst 53 actions set ipv4.dst 10.0.0.1, fwd b }");
    assert!(software_reason(&p, 0)
        .expect("in software")
        .contains("may lack the header"));
    // In an IPv4 table, every packet has it; after a decapsulation, no header is sure.
    let p = plan_of(
        "pipe p root from a {
            table lpm ipv4.dst { 10.0.0.0/8 => set ipv4.dst 10.0.0.1, fwd b }
            default { actions drop }
        }",
    );
    assert!(p.software.is_empty(), "{p}");
    let p = one_rule(
        "rule r { match ipv4.dst 192.0.2.1 vxlan.vni 7 actions vxlan.decap, set ipv4.dst 10.0.0.1, fwd b }",
    );
    assert!(software_reason(&p, 0)
        .expect("in software")
        .contains("may lack the header"));
}

#[test]
fn a_rewrite_of_either_ip_version_gets_a_template_for_each() {
    // DSCP marking on a TCP port: IPv4 and IPv6 packets, each version's entry rewriting
    // its own header.
    let p = one_rule("rule web { match tcp.dst 80 actions set ip.dscp 46, fwd b }");
    assert!(p.software.is_empty(), "{p}");
    let text = p.to_string();
    assert!(
        text.contains("modify outer.ip4.dscp_ecn=0xb8/0xfc"),
        "{text}"
    );
    assert!(
        text.contains("modify outer.ip6.traffic_class=0xb8/0xfc"),
        "{text}"
    );
    // The ECN field is the same byte's two low bits, the DSCP left as it is.
    let p = one_rule("rule bleach { match udp.dst 4791 actions set ip.ecn 0, fwd b }");
    let text = p.to_string();
    assert!(text.contains("modify outer.ip4.dscp_ecn=0x0/0x3"), "{text}");
    assert!(
        text.contains("modify outer.ip6.traffic_class=0x0/0x3"),
        "{text}"
    );
}

#[test]
fn ports_of_any_protocol_need_tcp_or_udp_pinned() {
    let p = one_rule("rule r { match l4.dst 80 actions fwd b }");
    assert!(software_reason(&p, 0)
        .expect("in software")
        .contains("SCTP"));
    let p = one_rule("rule r { match ip.proto 6 ipv4.dst 10.0.0.1 l4.dst 80 actions fwd b }");
    assert!(p.software.is_empty(), "{p}");
    assert!(p
        .to_string()
        .contains("outer.tcp.l4_port.dst_port=0x50/0xffff"));
}

#[test]
fn a_software_pipe_is_reached_through_rss_from_the_hardware_before_it() {
    let p = plan_of(
        "pipe p root from a {
            rule web { match tcp.dst 80 actions count, goto q }
            default { actions drop }
        }
        pipe q {
            rule r { match eth.src 02:00:00:00:00:01 actions set ip.dscp 10, fwd b }
            default { actions set ip.dscp 12, goto r }
        }
        pipe r {
            rule s { match udp.dst 53 actions fwd b }
            default { actions drop }
        }",
    );
    // r could be in hardware, but only q, in software, sends it packets.
    assert!(software_reason(&p, 2)
        .expect("r in software")
        .contains("no port's packets"));
    assert!(!p.pipes.iter().any(|x| x.of == Some(PipeId(2))), "{p}");
    // ip.dscp of a packet that may not be IP: neither IP version's member can be set.
    assert!(software_reason(&p, 1)
        .expect("in software")
        .contains("IPv4 or the IPv6"));
    let control = p.pipes.iter().find(|x| x.name == "p").expect("pipe p");
    assert_eq!(control.actions[0].fwd, Fwd::Software(PipeId(1)));
    assert!(control.actions[0].counter);
}

#[test]
fn a_rule_the_nic_cannot_decide_sends_what_it_may_take_to_software() {
    // ARP fields are not parsed, but ARP is no IP packet to the parser; an answer is no
    // DOCA Flow action, but its rule's fields are all matched. The rest stays in the NIC.
    let p = plan_of(
        "pipe p root from a {
            rule web  { match tcp.dst 80 actions count, fwd b }
            rule arp  { match arp.op 1 arp.tpa 192.0.2.1 actions arp.reply 02:00:00:00:00:01, fwd a }
            rule ping { match ipv4.dst 192.0.2.1 icmp.type 8 actions echo.reply, fwd a }
            rule nd   { match nd.target 2001:db8::1 actions nd.advert 02:00:00:00:00:01, fwd a }
            default   { actions count, drop }
        }",
    );
    assert!(p.software.is_empty(), "{p}");
    let rules: Vec<&str> = p.software_rules.iter().map(|r| r.rule.as_str()).collect();
    assert_eq!(rules, ["arp", "ping", "nd"], "{p}");
    assert!(p.software_rules[0].why.contains("ARP"), "{p}");
    let control = p.pipes.iter().find(|x| x.name == "p").expect("pipe p");
    let Entries::Listed(entries) = &control.entries else {
        panic!("{p}")
    };
    let action_of = |label: &str| {
        let e = entries.iter().find(|e| e.label == label).expect(label);
        &control.actions[e.action]
    };
    assert_eq!(action_of("arp").fwd, Fwd::Software(PipeId(0)));
    assert_eq!(action_of("ping").fwd, Fwd::Software(PipeId(0)));
    assert!(!action_of("arp").counter && action_of("web").counter, "{p}");
    assert_eq!(action_of("default").fwd, Fwd::Drop);
    let arp = entries.iter().find(|e| e.label == "arp").expect("arp");
    assert!(arp.matches.is_empty(), "{p}");
    assert!(
        arp.selectors
            .iter()
            .any(|s| s.value == "DOCA_FLOW_L3_META_NONE"),
        "{p}"
    );
    let ping = entries.iter().find(|e| e.label == "ping").expect("ping");
    assert_eq!(ping.matches.len(), 2, "{p}");
    // No packet is two of ARP, TCP, ICMP and ICMPv6 (where a neighbour discovery target
    // is): the four share a priority.
    let web = entries.iter().find(|e| e.label == "web").expect("web");
    let nd = entries.iter().find(|e| e.label == "nd").expect("nd");
    assert_eq!(
        [web.priority, arp.priority, ping.priority, nd.priority],
        [Some(0); 4],
        "{p}"
    );

    // A rule the NIC can check nothing of takes every packet from its priority on:
    // rules before it stay in hardware, and nothing after it is planned.
    let p = plan_of(
        "pipe p root from a {
            rule dns  { match udp.dst 53 actions fwd b }
            rule any  { match nd.target 2001:db8::1 actions fwd b }
            rule all  { match ct.state established actions fwd b }
            rule late { match tcp.dst 80 actions meter m, fwd b }
            default   { actions drop }
        }",
    );
    assert!(p.software.is_empty(), "{p}");
    assert!(p.meters.is_empty(), "{p}");
    let control = p.pipes.iter().find(|x| x.name == "p").expect("pipe p");
    let Entries::Listed(entries) = &control.entries else {
        panic!("{p}")
    };
    let labels: Vec<&str> = entries.iter().map(|e| e.label.as_str()).collect();
    assert_eq!(labels, ["dns", "any", "all"], "{p}");
    assert_eq!(control.miss, Fwd::Drop);
    // nd.target is read from ICMPv6 only.
    assert!(entries[1]
        .selectors
        .iter()
        .any(|s| s.value == "DOCA_FLOW_L4_META_ICMP"));

    // A mark made in hardware would be lost where a later pipe hands the packet to
    // software (pkt_meta names the pipe to go on from): the marking rule is software's.
    let p = plan_of(
        "pipe p root from a {
            rule tag  { match udp.dst 53 actions mark 3, goto q }
            rule web  { match tcp.dst 80 actions mark 4, goto r }
            default   { actions drop }
        }
        pipe q {
            rule arp { match arp.op 1 actions arp.reply 02:00:00:00:00:01, fwd a }
            default  { actions fwd b }
        }
        pipe r {
            rule m { match meta.mark 4 actions fwd b }
            default { actions drop }
        }",
    );
    let rules: Vec<(u16, &str)> = p
        .software_rules
        .iter()
        .map(|r| (r.pipe.0, r.rule.as_str()))
        .collect();
    assert_eq!(rules, [(0, "tag")], "{p}");
    assert!(p.software_rules[0].why.contains("mark"), "{p}");
    // q's packets now all come through software, so q is the software's; r is reached
    // by a mark made in the NIC, and reads it there.
    assert!(software_reason(&p, 1)
        .expect("q in software")
        .contains("no port's packets"));
    assert!(p.pipes.iter().any(|x| x.of == Some(PipeId(2))), "{p}");

    // When the NIC would decide nothing, the pipe is software's, whole.
    let p = one_rule("rule all { match ct.state established actions fwd b }");
    assert!(software_reason(&p, 0)
        .expect("in software")
        .contains("rule all: ct.state"));
    assert!(p.software_rules.is_empty(), "{p}");
}

#[test]
fn tables_share_action_templates_by_index() {
    let p = plan_of(
        "pipe p root from a {
            table exact ipv4.dst udp.dst {
                10.0.0.1 53 => fwd b
                10.0.0.2 53 => count, fwd b
                10.0.0.3 53 => fwd b
            }
            default { actions goto q }
        }
        pipe q {
            table lpm ipv6.dst { 2001:db8::/32 => fwd b }
            default { actions fwd a }
        }",
    );
    assert!(p.software.is_empty(), "{p}");
    let exact = p.pipes.iter().find(|x| x.name == "p").expect("pipe p");
    assert_eq!(exact.actions.len(), 2);
    let Entries::Table { indices, first } = &exact.entries else {
        panic!("{p}")
    };
    assert_eq!(indices, &[0, 1, 0]);
    assert_eq!(first, &["10.0.0.1 53", "10.0.0.2 53", "10.0.0.3 53"]);
    assert_eq!(p.counters(), 1);
    // Its default is a goto: the miss goes straight to q's pipe, created before it.
    let Fwd::Pipe(HwId(q)) = exact.miss else {
        panic!("{p}")
    };
    assert_eq!(p.pipes[q].name, "q");
    // q's default forwards, which fwd_miss cannot: a pipe of its own does.
    assert!(p.pipes.iter().any(|x| x.name == "q.default"));
}

/// A packet's walk: each pipeline pipe it went through with the entry that took it
/// (`None`: the default), and where it ended.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Walk {
    steps: Vec<(PipeId, Option<usize>)>,
    end: End,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum End {
    Port(PortId),
    Drop,
    Service(ServiceId),
    /// Handed to the software backend from this pipe on (plan only).
    Software(PipeId),
}

#[derive(Default)]
struct Recorder {
    steps: Vec<(PipeId, Option<usize>)>,
    verdict: Option<Verdict>,
}

impl Observer for Recorder {
    fn entry(&mut self, pipe: PipeId, entry: Option<usize>) {
        self.steps.push((pipe, entry));
    }
    fn verdict(&mut self, v: Verdict, _pkt: &PacketBuf) {
        self.verdict = Some(v);
    }
}

fn engine_walk(engine: &mut Engine, frame: &[u8], port: PortId) -> Walk {
    let mut batch = vec![PacketBuf::new(4096)];
    assert!(batch[0].load(frame, port, 1));
    let mut rec = Recorder::default();
    engine.process(&mut batch, &mut rec);
    let end = match rec.verdict.expect("a verdict") {
        Verdict::Forward(p) => End::Port(p),
        Verdict::Drop(_) | Verdict::Told(..) => End::Drop,
        Verdict::Service(s) => End::Service(s),
    };
    Walk {
        steps: rec.steps,
        end,
    }
}

/// The walk the plan's hardware pipes give a packet that no action rewrites, run as DOCA
/// Flow runs them: an entry matches when every field it names is in the packet (its
/// header types and the parser's verdict) with the value under the mask; a control
/// pipe's entries are tried by priority; a table's by key or longest prefix.
fn plan_walk(
    prog: &Program,
    plan: &Plan,
    tunnels: &TunnelPorts,
    frame: &[u8],
    port: PortId,
) -> Walk {
    let meta = parse::parse(frame, tunnels).expect("test packets parse");
    let st = PacketState {
        in_port: port.0,
        ..PacketState::default()
    };
    walk_pipes(plan, |at| {
        let pipe = &plan.pipes[at.0];
        match (&pipe.entries, pipe.role) {
            // Packets are metered green (the test's meters never run out); the packet,
            // not its copy, goes on from a mirror.
            (Entries::Listed(entries), Role::MeterColor) => entries
                .iter()
                .find(|e| e.selectors.iter().any(|s| s.value.ends_with("GREEN"))),
            (Entries::Listed(entries), Role::Mirror) => entries.first(),
            (Entries::Listed(entries), _) => {
                let hits = entries.iter().filter(|e| {
                    e.selectors.iter().all(|s| selector_holds(s, &meta))
                        && e.matches.iter().all(|m| {
                            read(frame, &meta, &st, m.field).is_some_and(|v| v & m.mask == m.value)
                        })
                });
                first_priority(
                    hits,
                    |e| (e.priority, e.action),
                    || format!("{plan}\n{}\nframe {frame:02x?}", pipe.name),
                )
            }
            (Entries::Table { .. }, _) => None,
        }
        .map(|e| (e.rule, e.action))
        .or_else(|| match &pipe.entries {
            Entries::Table { indices, .. } => {
                let of = pipe.of.expect("a table's pipe");
                table_hit(prog, of, frame, &meta, &st).map(|i| (Some(i), indices[i] as usize))
            }
            Entries::Listed(_) => None,
        })
    })
}

/// Of the entries a packet matches, the one of the first priority; DOCA Flow leaves the
/// order of entries of one priority open, so two there that differ must not both match.
fn first_priority<'e, E>(
    hits: impl Iterator<Item = &'e E>,
    key: impl Fn(&E) -> (Option<u32>, usize),
    context: impl Fn() -> String,
) -> Option<&'e E> {
    let hits: Vec<&E> = hits.collect();
    let first = hits.iter().map(|e| key(e).0).min()?;
    let mut best = hits.into_iter().filter(|e| key(e).0 == first);
    let chosen = best.next()?;
    if best.any(|b| key(b).1 != key(chosen).1) {
        panic!("{}: two entries of one priority match", context());
    }
    Some(chosen)
}

/// A packet's walk through the plan's pipes from the root: `choose` gives the entry a
/// pipe takes it by (the pipeline rule or table entry, and the action template), none
/// on a miss.
fn walk_pipes(plan: &Plan, mut choose: impl FnMut(HwId) -> Option<(Option<usize>, usize)>) -> Walk {
    let mut steps = Vec::new();
    let mut at = plan.root;
    loop {
        let pipe = &plan.pipes[at.0];
        // An entry sending the packet to software from its own pipe decides nothing
        // there: the software backend runs that pipe from its start.
        let undecided = |fwd: Fwd| pipe.of.is_some_and(|of| fwd == Fwd::Software(of));
        let fwd = match choose(at) {
            Some((entry, action)) => {
                let fwd = pipe.actions[action].fwd;
                match pipe.role {
                    _ if undecided(fwd) => {}
                    Role::Pipe | Role::PipeRest => {
                        steps.push((pipe.of.expect("a pipeline pipe"), entry))
                    }
                    Role::Default => steps.push((pipe.of.expect("a pipeline pipe"), None)),
                    _ => {}
                }
                fwd
            }
            None => {
                // A miss: to the default's own pipe (which records it), else the default
                // is a bare drop or goto, recorded here.
                let to_default = matches!(pipe.miss, Fwd::Pipe(h) if matches!(plan.pipes[h.0].role, Role::Default | Role::PipeRest));
                if !to_default {
                    steps.push((pipe.of.expect("only pipeline pipes miss"), None));
                }
                pipe.miss
            }
        };
        let end = match fwd {
            Fwd::Pipe(next) => {
                at = next;
                continue;
            }
            Fwd::Port(p) => End::Port(p),
            Fwd::Drop => End::Drop,
            Fwd::Software(p) => End::Software(p),
            Fwd::Service(s) => End::Service(s),
        };
        return Walk { steps, end };
    }
}

/// A plan as installed: what each DOCA Flow call carried (a pipe's handle is its index),
/// checked as the calls come: a pipe forwards only to pipes made before it, entries
/// come after their pipe and before the flush, control entries have priorities 0 to 7.
#[derive(Debug, Default)]
struct Nic {
    pipes: Vec<NicPipe>,
    encaps: u32,
    meters: u32,
    flushed: bool,
}

#[derive(Debug)]
struct NicPipe {
    kind: PipeType,
    root: bool,
    template: Image,
    actions: Vec<(Image, Target<usize>)>,
    declared: usize,
    entries: Vec<EntrySpec>,
}

impl Steering for Nic {
    type Pipe = usize;
    type Entry = (usize, usize);
    type Error = std::fmt::Error;

    fn encap(&mut self, id: u32, _: &dpuflow::ir::Encap) -> Result<(), Self::Error> {
        assert_eq!(id, self.encaps, "shared encaps by id");
        self.encaps += 1;
        Ok(())
    }

    fn meter(&mut self, id: u32, _: &dpuflow::ir::Meter) -> Result<(), Self::Error> {
        assert_eq!(id, self.meters, "shared meters by id");
        self.meters += 1;
        Ok(())
    }

    fn pipe(&mut self, spec: &install::PipeSpec<'_, usize>) -> Result<usize, Self::Error> {
        assert!(!self.flushed);
        let made = self.pipes.len();
        let fwds = spec.actions.iter().map(|a| a.fwd).chain([spec.miss]);
        for f in fwds {
            assert!(
                !matches!(f, Target::Pipe(h) if h >= made),
                "{}: {f:?}",
                spec.name
            );
        }
        if spec.kind == PipeType::Control {
            assert!(spec.template.0.is_empty(), "{}", spec.name);
        }
        self.pipes.push(NicPipe {
            kind: spec.kind,
            root: spec.is_root,
            template: spec.template.clone(),
            actions: spec
                .actions
                .iter()
                .map(|a| (a.rewrites.clone(), a.fwd))
                .collect(),
            declared: spec.entries,
            entries: Vec::new(),
        });
        Ok(made)
    }

    fn entry(
        &mut self,
        pipe: usize,
        kind: PipeType,
        e: &EntrySpec,
    ) -> Result<(usize, usize), Self::Error> {
        assert!(!self.flushed);
        let p = &mut self.pipes[pipe];
        assert_eq!((kind, e.index), (p.kind, p.entries.len()));
        assert!(e.action < p.actions.len());
        if kind == PipeType::Control {
            assert!(e.priority.is_some_and(|x| x < 8), "{e:?}");
        }
        p.entries.push(e.clone());
        Ok((pipe, e.index))
    }

    fn flush(&mut self) -> Result<(), Self::Error> {
        self.flushed = true;
        Ok(())
    }
}

impl Nic {
    /// Installs `plan` and checks the calls against it: every pipe's entries and
    /// forwards, and the `pkt_meta` of a packet bound for software naming its pipe.
    fn install(plan: &Plan, prog: &Program) -> Nic {
        let mut nic = Nic::default();
        let done = doca::install(plan, prog, &mut nic).expect("the plan installs");
        assert!(nic.flushed);
        assert_eq!(done.root, plan.root.0);
        for ((pipe, entry), counts) in &done.counters {
            assert_eq!(nic.pipes[*pipe].entries[*entry].counts, Some(*counts));
        }
        for (i, (pipe, np)) in plan.pipes.iter().zip(&nic.pipes).enumerate() {
            assert_eq!(np.root, i == plan.root.0, "{}", pipe.name);
            assert_eq!(np.entries.len(), np.declared, "{}", pipe.name);
            assert_eq!(np.declared, pipe.entry_count(), "{}", pipe.name);
            for (a, (rewrites, target)) in pipe.actions.iter().zip(&np.actions) {
                let expected = match a.fwd {
                    Fwd::Port(p) => Target::Port(p),
                    Fwd::Pipe(h) => Target::Pipe(h.0),
                    Fwd::Drop => Target::Drop,
                    Fwd::Software(_) => Target::Rss,
                    Fwd::Service(_) => Target::Kernel,
                };
                assert_eq!(*target, expected, "{}", pipe.name);
                if let Fwd::Software(p) = a.fwd {
                    let Some(Setting::Bits(b)) = rewrites.get("meta.pkt_meta") else {
                        panic!("{}: no pkt_meta for software", pipe.name)
                    };
                    assert_eq!((b.value, b.mask), (u128::from(p.0), 0xffff_ffff));
                }
            }
        }
        nic
    }

    /// The walk of a packet no action rewrites through the installed pipes, matched
    /// byte by byte: each member's bytes read from the packet where DOCA Flow's parser
    /// finds them, against the entries' values under their masks.
    /// `counted` gets what the counters of the entries the packet took count.
    fn walk(
        &self,
        plan: &Plan,
        tunnels: &TunnelPorts,
        frame: &[u8],
        port: PortId,
        counted: &mut Vec<Counted>,
    ) -> Walk {
        let meta = parse::parse(frame, tunnels).expect("test packets parse");
        let holds = |img: &Image, template: bool| {
            img.0.iter().all(|(member, setting)| match setting {
                Setting::Enum(value) => selector_holds(
                    &Selector {
                        member: member.clone(),
                        value,
                    },
                    &meta,
                ),
                // A template's value members are the bits its entries set.
                Setting::Bits(_) if template => true,
                Setting::Bits(b) => {
                    member_value(frame, &meta, port, member).is_some_and(|v| v & b.mask == b.value)
                }
            })
        };
        walk_pipes(plan, |at| {
            let (pipe, np) = (&plan.pipes[at.0], &self.pipes[at.0]);
            let chosen = match pipe.role {
                Role::MeterColor => np.entries.iter().find(|e| {
                    matches!(e.matches.get("parser_meta.meter_color"),
                        Some(Setting::Enum(v)) if v.ends_with("GREEN"))
                }),
                Role::Mirror => np.entries.first(),
                _ if !holds(&np.template, true) => None,
                _ => {
                    let hits = np.entries.iter().filter(|e| holds(&e.matches, false));
                    match np.kind {
                        PipeType::Lpm => hits.max_by_key(|e| {
                            e.matches
                                .0
                                .iter()
                                .map(|(_, s)| match s {
                                    Setting::Bits(b) => b.mask.count_ones(),
                                    Setting::Enum(_) => 0,
                                })
                                .sum::<u32>()
                        }),
                        _ => first_priority(
                            hits,
                            |e| (e.priority, e.action),
                            || format!("{plan}\n{} installed\nframe {frame:02x?}", pipe.name),
                        ),
                    }
                }
            };
            chosen.map(|e| {
                counted.extend(e.counts);
                let rule = match &pipe.entries {
                    Entries::Listed(es) => es[e.index].rule,
                    Entries::Table { .. } => Some(e.index),
                };
                (rule, e.action)
            })
        })
    }
}

/// The value of a DOCA Flow match member in a packet, read where the NIC's parser finds
/// it (RFC 791, 8200, 793, 768, 792, 7348 §5, 8926 §3 layouts); `None` when the packet
/// lacks the header.
fn member_value(frame: &[u8], meta: &parse::Meta, port: PortId, member: &str) -> Option<u128> {
    let be = |at: u16, n: usize| -> Option<u128> {
        let at = usize::from(at);
        let b = frame.get(at..at + n)?;
        Some(b.iter().fold(0, |v, &x| v << 8 | u128::from(x)))
    };
    let (l, rest) = if let Some(rest) = member.strip_prefix("outer.") {
        (&meta.outer, rest)
    } else if let Some(rest) = member.strip_prefix("inner.") {
        meta.tunnel?;
        (&meta.inner, rest)
    } else {
        return match member {
            "parser_meta.port_id" => Some(u128::from(port.0)),
            "meta.pkt_meta" => Some(0),
            "tun.vxlan_tun_id" | "tun.geneve.vni" => {
                let t = meta.tunnel?;
                let kind = if member == "tun.vxlan_tun_id" {
                    "vxlan"
                } else {
                    "geneve"
                };
                (t.kind.name() == kind).then(|| be(t.header + 4, 4))?
            }
            m => panic!("member {m} not simulated"),
        };
    };
    let v4 = l.l3_kind == L3::V4;
    let v6 = l.l3_kind == L3::V6;
    let l4 = |proto: &[u8]| l.l4_ok && proto.contains(&l.proto);
    match rest {
        "eth.dst_mac" => be(l.l2, 6),
        "eth.src_mac" => be(l.l2 + 6, 6),
        "eth_vlan[0].tci" => (l.vlan != 0).then(|| be(l.vlan, 2))?,
        "ip4.dscp_ecn" if v4 => be(l.l3 + 1, 1),
        "ip4.ttl" if v4 => be(l.l3 + 8, 1),
        "ip4.next_proto" if v4 => be(l.l3 + 9, 1),
        "ip4.src_ip" if v4 => be(l.l3 + 12, 4),
        "ip4.dst_ip" if v4 => be(l.l3 + 16, 4),
        "ip6.traffic_class" if v6 => be(l.l3, 2).map(|w| w >> 4 & 0xff),
        "ip6.next_proto" if v6 => be(l.l3 + 6, 1),
        "ip6.hop_limit" if v6 => be(l.l3 + 7, 1),
        "ip6.src_ip" if v6 => be(l.l3 + 8, 16),
        "ip6.dst_ip" if v6 => be(l.l3 + 24, 16),
        "tcp.l4_port.src_port" if l4(&[6]) => be(l.l4, 2),
        "tcp.l4_port.dst_port" if l4(&[6]) => be(l.l4 + 2, 2),
        "tcp.flags" if l4(&[6]) => be(l.l4 + 13, 1),
        "udp.l4_port.src_port" if l4(&[17]) => be(l.l4, 2),
        "udp.l4_port.dst_port" if l4(&[17]) => be(l.l4 + 2, 2),
        "icmp.type" if l4(&[1, 58]) => be(l.l4, 1),
        "icmp.code" if l4(&[1, 58]) => be(l.l4 + 1, 1),
        _ if rest.starts_with("ip")
            || rest.contains("l4_port")
            || rest.starts_with("icmp")
            || rest == "tcp.flags" =>
        {
            None
        }
        m => panic!("member {m} not simulated"),
    }
}

/// Whether a packet passes an entry's selector as DOCA Flow's parser would see it: the
/// parser's verdicts (`parser_meta.*_type`) and the tunnel and VLAN presence decide; the
/// header types (`outer.l3_type`) only choose which union member the match reads.
fn selector_holds(s: &Selector, meta: &parse::Meta) -> bool {
    let l3 = |l: &parse::Layers, v: &str| match v {
        "DOCA_FLOW_L3_META_IPV4" => l.l3_kind == L3::V4,
        "DOCA_FLOW_L3_META_IPV6" => l.l3_kind == L3::V6,
        "DOCA_FLOW_L3_META_NONE" => l.l3_kind == L3::None,
        _ => panic!("unknown L3 type {v}"),
    };
    let l4 = |l: &parse::Layers, v: &str| {
        l.l4_ok
            && match v {
                "DOCA_FLOW_L4_META_TCP" => l.proto == 6,
                "DOCA_FLOW_L4_META_UDP" => l.proto == 17,
                "DOCA_FLOW_L4_META_ICMP" => l.proto == 1 || l.proto == 58,
                _ => panic!("unknown L4 type {v}"),
            }
    };
    let tunnelled = meta.tunnel.is_some();
    match s.member.as_str() {
        "parser_meta.outer_l3_type" => l3(&meta.outer, s.value),
        "parser_meta.inner_l3_type" => tunnelled && l3(&meta.inner, s.value),
        "parser_meta.outer_l4_type" => l4(&meta.outer, s.value),
        "parser_meta.inner_l4_type" => tunnelled && l4(&meta.inner, s.value),
        "tun.type" => meta
            .tunnel
            .is_some_and(|t| s.value.ends_with(&t.kind.name().to_ascii_uppercase())),
        "outer.l2_valid_headers" => meta.outer.vlan != 0,
        "inner.l2_valid_headers" => tunnelled && meta.inner.vlan != 0,
        m if m.ends_with(".l3_type") || m.ends_with(".l4_type_ext") => true,
        m => panic!("selector {m} not simulated"),
    }
}

fn table_hit(
    prog: &Program,
    pipe: PipeId,
    frame: &[u8],
    meta: &parse::Meta,
    st: &PacketState,
) -> Option<usize> {
    match &prog.pipe(pipe).body {
        PipeBody::Exact { fields, keys, .. } => {
            let key: Vec<u128> = fields
                .iter()
                .map(|f| read(frame, meta, st, *f))
                .collect::<Option<_>>()?;
            keys.chunks_exact(fields.len()).position(|k| k == key)
        }
        PipeBody::Lpm {
            field, prefixes, ..
        } => {
            let v = read(frame, meta, st, *field)?;
            let bits = field.kind().bits();
            prefixes
                .iter()
                .enumerate()
                .filter(|(_, p)| p.len == 0 || v >> (bits - p.len) == p.value >> (bits - p.len))
                .max_by_key(|(_, p)| p.len)
                .map(|(i, _)| i)
        }
        PipeBody::Rules(_) => unreachable!("tables only"),
    }
}

/// A pipeline, its plan, and the software engine running it.
struct Both<'p> {
    prog: &'p Program,
    plan: Plan,
    tunnels: TunnelPorts,
    engine: Engine,
    nic: Nic,
}

impl<'p> Both<'p> {
    fn new(prog: &'p Program) -> Both<'p> {
        let plan = doca::plan(prog);
        assert_well_formed(&plan);
        Both {
            prog,
            nic: Nic::install(&plan, prog),
            plan,
            tunnels: Compiled::new(prog).tunnels().clone(),
            engine: Engine::new(prog),
        }
    }

    /// The plan's walk agrees with the engine's: the same entries pipe after pipe and the
    /// same end; where the plan hands the packet to software, the engine's walk goes on
    /// from there.
    fn assert_same_walk(&mut self, frame: &[u8], port: PortId) {
        let plan = &self.plan;
        let hw = plan_walk(self.prog, plan, &self.tunnels, frame, port);
        let mut counted = Vec::new();
        let installed = self
            .nic
            .walk(plan, &self.tunnels, frame, port, &mut counted);
        assert_eq!(installed, hw, "{plan}\ninstalled\nframe {frame:02x?}");
        // The hardware counts, entry by entry, what the engine counts of the rules with
        // `count` that the packet met in the hardware's part of its walk.
        let mut counts: Vec<(u16, usize)> = counted
            .iter()
            .filter_map(|c| match c {
                Counted::Entry { pipe, entry } => Some((pipe.0, *entry)),
                _ => None,
            })
            .collect();
        let mut expected: Vec<(u16, usize)> = hw
            .steps
            .iter()
            .filter_map(|&(p, entry)| {
                let pipe = self.prog.pipe(p);
                let entry = entry.unwrap_or(pipe.body.len());
                let list = pipe.body.action_list(entry).unwrap_or(&pipe.miss);
                list.0.contains(&Action::Count).then_some((p.0, entry))
            })
            .collect();
        counts.sort_unstable();
        expected.sort_unstable();
        assert_eq!(counts, expected, "{plan}\ncounters\nframe {frame:02x?}");
        let sw = engine_walk(&mut self.engine, frame, port);
        match hw.end {
            End::Software(from) => {
                let n = hw.steps.len();
                assert_eq!(hw.steps[..], sw.steps[..n], "{plan}\nframe {frame:02x?}");
                assert_eq!(sw.steps.get(n).map(|s| s.0), Some(from), "{plan}");
            }
            _ => assert_eq!(hw, sw, "{plan}\nframe {frame:02x?}"),
        }
    }
}

// Packets: a few values per field, so rules and packets meet often.
const V4: [[u8; 4]; 4] = [[10, 0, 0, 1], [10, 0, 0, 2], [10, 0, 1, 9], [192, 0, 2, 1]];
const V6_LAST: [u8; 3] = [1, 2, 0x80];
const L4_PORTS: [u16; 6] = [53, 80, 443, 1000, 1005, 4000];

#[derive(Debug, Clone)]
struct Pkt {
    vlan: Option<u16>,
    v6: bool,
    src: usize,
    dst: usize,
    ttl: u8,
    dscp: u8,
    /// 0 TCP, 1 UDP, 2 ICMP (v4) or ICMPv6 echo request, 3 SCTP (ports, not TCP or UDP),
    /// 4 an ARP request (reply when `flags` has SYN clear), 5 an IPv6 neighbour
    /// solicitation (IPv4: an echo reply).
    l4: u8,
    sport: usize,
    dport: usize,
    flags: u8,
    /// Inside VXLAN with this VNI.
    vxlan: Option<u32>,
}

fn pkt() -> impl Strategy<Value = Pkt> {
    (
        prop::option::of(prop_oneof![Just(10u16), Just(20)]),
        any::<bool>(),
        0..4usize,
        0..4usize,
        prop_oneof![Just(1u8), Just(64)],
        prop_oneof![Just(0u8), Just(46)],
        0..6u8,
        0..6usize,
        0..6usize,
        prop_oneof![Just(0x02u8), Just(0x12), Just(0x10), Just(0x04)],
        prop::option::of(prop_oneof![Just(100u32), Just(200)]),
    )
        .prop_map(
            |(vlan, v6, src, dst, ttl, dscp, l4, sport, dport, flags, vxlan)| Pkt {
                vlan,
                v6,
                src,
                dst,
                ttl,
                dscp,
                l4,
                sport,
                dport,
                flags,
                vxlan,
            },
        )
}

fn checksum(bytes: &[u8]) -> u16 {
    let mut sum: u32 = bytes
        .chunks(2)
        .map(|c| u32::from(u16::from_be_bytes([c[0], *c.get(1).unwrap_or(&0)])))
        .sum();
    while sum > 0xffff {
        sum = (sum & 0xffff) + (sum >> 16);
    }
    !(sum as u16)
}

/// An IPv4 or IPv6 packet (no Ethernet) carrying `l4` bytes of protocol `proto`.
fn ip(v6: bool, src: usize, dst: usize, ttl: u8, dscp: u8, proto: u8, l4: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    if v6 {
        let tc = u32::from(dscp) << 2;
        out.extend((6u32 << 28 | tc << 20).to_be_bytes());
        out.extend((l4.len() as u16).to_be_bytes());
        out.extend([proto, ttl]);
        for i in [src, dst] {
            let mut a = [0u8; 16];
            a[..4].copy_from_slice(&[0x20, 0x01, 0x0d, 0xb8]);
            a[15] = V6_LAST[i % 3];
            out.extend(a);
        }
    } else {
        out.extend([0x45, dscp << 2]);
        out.extend((20 + l4.len() as u16).to_be_bytes());
        out.extend([0, 1, 0, 0, ttl, proto, 0, 0]);
        out.extend(V4[src]);
        out.extend(V4[dst]);
        let c = checksum(&out);
        out[10..12].copy_from_slice(&c.to_be_bytes());
    }
    out.extend(l4);
    out
}

fn ethernet(vlan: Option<u16>, ethertype: u16, payload: &[u8]) -> Vec<u8> {
    let mut out = vec![2, 0, 0, 0, 0, 2, 2, 0, 0, 0, 0, 1];
    if let Some(id) = vlan {
        out.extend([0x81, 0x00]);
        out.extend(id.to_be_bytes());
    }
    out.extend(ethertype.to_be_bytes());
    out.extend(payload);
    out
}

fn frame(p: &Pkt) -> Vec<u8> {
    let (sport, dport) = (L4_PORTS[p.sport], L4_PORTS[p.dport]);
    let ports = [sport.to_be_bytes(), dport.to_be_bytes()].concat();
    let (proto, l4) = match p.l4 {
        0 => {
            let mut t = ports.clone();
            t.extend([
                0, 0, 0, 1, 0, 0, 0, 0, 0x50, p.flags, 0xff, 0xff, 0, 0, 0, 0,
            ]);
            (6, t)
        }
        1 => {
            let mut u = ports.clone();
            u.extend([0, 12, 0, 0, 1, 2, 3, 4]);
            (17, u)
        }
        2 if p.v6 => (58, vec![128, 0, 0, 0, 0, 1, 0, 1]),
        2 => (1, vec![8, 0, 0, 0, 0, 1, 0, 1]),
        4 => (0, Vec::new()),
        5 if p.v6 => {
            // RFC 4861 §4.3: type 135, the target one of the addresses.
            let mut ns = vec![135, 0, 0, 0, 0, 0, 0, 0, 0x20, 0x01, 0x0d, 0xb8];
            ns.extend([0; 11]);
            ns.push(V6_LAST[p.dst % 3]);
            (58, ns)
        }
        5 => (1, vec![0, 0, 0, 0, 0, 1, 0, 1]),
        _ => {
            let mut s = ports.clone();
            s.extend([0u8; 8]);
            (132, s)
        }
    };
    let inner = if p.l4 == 4 {
        // RFC 826 over Ethernet and IPv4: request or reply, from one address for another.
        let op: u16 = if p.flags & 0x02 != 0 { 1 } else { 2 };
        let mut arp = vec![0, 1, 8, 0, 6, 4];
        arp.extend(op.to_be_bytes());
        arp.extend([2, 0, 0, 0, 0, 1]);
        arp.extend(V4[p.src]);
        arp.extend([0; 6]);
        arp.extend(V4[p.dst]);
        ethernet(p.vlan, 0x0806, &arp)
    } else {
        let ethertype = if p.v6 { 0x86dd } else { 0x0800 };
        ethernet(
            p.vlan,
            ethertype,
            &ip(p.v6, p.src, p.dst, p.ttl, p.dscp, proto, &l4),
        )
    };
    let Some(vni) = p.vxlan else {
        return inner;
    };
    // VXLAN (RFC 7348 §5) to UDP port 4789 over IPv4 between two of the addresses.
    let mut udp = [1234u16.to_be_bytes(), 4789u16.to_be_bytes()].concat();
    udp.extend((16 + inner.len() as u16).to_be_bytes());
    udp.extend([0, 0, 0x08, 0, 0, 0]);
    udp.extend((vni << 8).to_be_bytes());
    udp.extend(&inner);
    ethernet(None, 0x0800, &ip(false, p.dst, p.src, 64, 0, 17, &udp))
}

// Pipelines: rules over a menu of fields and patterns, exact and LPM tables, gotos to
// later pipes only (the pipe graph is acyclic).
const MATCHES: &[&str] = &[
    "ipv4.dst 10.0.0.1",
    "ipv4.dst 10.0.0.0/30",
    "ipv4.src 10.0.0.0-10.0.0.2",
    "ipv4.src {10.0.0.2, 192.0.2.1}",
    "ipv6.dst 2001:db8::/32",
    "ipv6.src 2001:db8::1",
    "ip.proto 6",
    "ip.proto 17",
    "tcp.dst 80",
    "tcp.dst 1000-1010",
    "tcp.flags 0x02/0x12",
    "udp.dst {53, 443}",
    "udp.src 1000-4095",
    "icmp.type 8",
    "icmp6.type 128",
    "vlan.id 10",
    "eth.src 02:00:00:00:00:01",
    "vxlan.vni 100",
    "ipv4.dst 10.0.0.2 inner.ipv4.dst 10.0.0.1 vxlan.vni 200",
    "ip.ttl 1 ipv4.dst 10.0.0.0/24",
    "ip.dscp 46 ipv6.dst 2001:db8::/32",
    "ip.proto 17 ipv4.dst 10.0.0.0/8 l4.dst 53",
    "ip.ttl 1",
    "eth.type 0x0800",
    "eth.type 0x86dd ip.ttl 1",
    "eth.type {0x0800, 0x86dd}",
    "eth.type 0x0806",
    // Fields sharing a member (the TCI; DSCP and ECN), and inner headers.
    "vlan.id 10 vlan.pcp 0",
    "ip.dscp 46 ip.ecn 0 ipv4.dst 10.0.0.0/24",
    "ipv6.src 2001:db8::1 ip.dscp 46",
    "vxlan.vni 100 inner.ipv4.dst 10.0.0.1",
    "vxlan.vni 200 inner.tcp.dst 80",
    "vxlan.vni 100 inner.udp.dst {53, 443} inner.ip.ttl 64",
    // Fields DOCA Flow does not parse: the NIC sends what may match them to software.
    "arp.op 1 arp.tpa 192.0.2.1",
    "arp.spa 10.0.0.0/30",
    "eth.type 0x0806 arp.op 2",
    "icmp6.type 135 nd.target 2001:db8::1",
    "nd.target 2001:db8::2",
    "vxlan.vni 100 inner.arp.op 1",
    "vlan.id 10 eth.type {0x0800, 0x0806}",
];

#[derive(Debug, Clone)]
enum PipeSpec {
    Rules(Vec<(Vec<usize>, u8)>, u8),
    Exact(Vec<(usize, usize)>, u8),
    Lpm(Vec<(usize, u8)>, u8),
}

fn pipe_spec() -> impl Strategy<Value = PipeSpec> {
    let fate = 0..14u8;
    prop_oneof![
        4 => (prop::collection::vec((prop::collection::vec(0..MATCHES.len(), 0..3), fate.clone()), 1..16), fate.clone())
            .prop_map(|(r, d)| PipeSpec::Rules(r, d)),
        1 => (prop::collection::vec((0..4usize, 0..6usize), 1..5), fate.clone())
            .prop_map(|(e, d)| PipeSpec::Exact(e, d)),
        1 => (prop::collection::vec((0..4usize, prop_oneof![Just(8u8), Just(24), Just(30), Just(32)]), 1..5), fate)
            .prop_map(|(e, d)| PipeSpec::Lpm(e, d)),
    ]
}

/// Actions ending in a fate: forward, count and forward, drop, count and drop, meter,
/// mirror or decrement the TTL and forward, rewrite (or tag, or encapsulate, or answer:
/// software's) and forward, or a goto to a later pipe (forward out of the last).
/// Rewrites end the walk, so the plan's pipes are always run on the packet as it came.
fn actions(fate: u8, i: usize, pipes: usize) -> String {
    match fate {
        0 => "fwd b".into(),
        1 => "count, fwd a".into(),
        2 => "drop".into(),
        3 => "count, drop".into(),
        4 => "meter m, count, fwd b".into(),
        5 => "mirror a, fwd b".into(),
        6 => "dec ttl, count, fwd a".into(),
        7 => "set ip.dscp 10, mark 3, fwd b".into(),
        8 => "vlan.push { id 7 pcp 1 }, set eth.dst 02:00:00:00:00:09, fwd a".into(),
        9 => "vxlan.encap { vni 5 src 192.0.2.1 dst 192.0.2.2 smac 02:00:00:00:00:01 \
              dmac 02:00:00:00:00:02 }, count, fwd b"
            .into(),
        10 => "arp.reply 02:00:00:00:00:09, count, fwd a".into(),
        11 => "echo.reply, fwd b".into(),
        _ if i + 1 < pipes => format!("goto p{}", i + 1 + usize::from(fate) % (pipes - i - 1)),
        _ => "fwd b".into(),
    }
}

fn pipeline(specs: &[PipeSpec]) -> String {
    let mut text = String::from(PORTS);
    let n = specs.len();
    for (i, spec) in specs.iter().enumerate() {
        let head = match i {
            0 => " root from a",
            1 => " root from b",
            _ => "",
        };
        text += &format!("pipe p{i}{head} {{\n");
        let default = match spec {
            PipeSpec::Rules(rules, d) => {
                for (j, (ms, fate)) in rules.iter().enumerate() {
                    let mut fields = std::collections::HashSet::new();
                    let m: Vec<&str> = ms
                        .iter()
                        .map(|&k| MATCHES[k])
                        // A field once per rule.
                        .filter(|m| {
                            m.split_whitespace()
                                .step_by(2)
                                .all(|f| fields.insert(f.to_owned()))
                        })
                        .collect();
                    let m = if m.is_empty() {
                        String::new()
                    } else {
                        format!("match {} ", m.join(" "))
                    };
                    text += &format!("  rule r{j} {{ {m}actions {} }}\n", actions(*fate, i, n));
                }
                d
            }
            PipeSpec::Exact(entries, d) => {
                // Keys most IPv4 packets meet: an address and a DSCP (which sits two
                // bits up its member).
                text += "  table exact ipv4.dst ip.dscp {\n";
                let mut seen = std::collections::HashSet::new();
                for (j, &(a, dscp)) in entries.iter().enumerate() {
                    let dscp = [0, 46][dscp % 2];
                    if seen.insert((a, dscp)) {
                        let [w, x, y, z] = V4[a];
                        text += &format!(
                            "    {w}.{x}.{y}.{z} {dscp} => {}\n",
                            actions(j as u8 % 14, i, n)
                        );
                    }
                }
                text += "  }\n";
                d
            }
            PipeSpec::Lpm(entries, d) => {
                text += "  table lpm ipv4.dst {\n";
                let mut seen = std::collections::HashSet::new();
                for (j, &(a, len)) in entries.iter().enumerate() {
                    let v = u32::from_be_bytes(V4[a]) & (u32::MAX << (32 - u32::from(len)));
                    if seen.insert((v, len)) {
                        let [w, x, y, z] = v.to_be_bytes();
                        text += &format!(
                            "    {w}.{x}.{y}.{z}/{len} => {}\n",
                            actions(j as u8 % 14, i, n)
                        );
                    }
                }
                text += "  }\n";
                d
            }
        };
        text += &format!("  default {{ actions {} }}\n}}\n", actions(*default, i, n));
    }
    text
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn hardware_pipes_choose_as_the_engine_does(
        specs in prop::collection::vec(pipe_spec(), 1..4),
        packets in prop::collection::vec((pkt(), any::<bool>()), 1..40),
    ) {
        let text = pipeline(&specs);
        let prog = program(&text);
        let mut both = Both::new(&prog);
        for (p, from_b) in &packets {
            let port = PortId(u16::from(*from_b && specs.len() > 1));
            both.assert_same_walk(&frame(p), port);
        }
    }
}

#[test]
fn example_pipelines_choose_as_the_engine_does_at_their_roots() {
    // The example files, and the pipelines the language documentation shows.
    let doc = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/pipeline-language.md"),
    )
    .expect("docs/pipeline-language.md");
    let documented = doc
        .split("```pipe\n")
        .skip(1)
        .filter_map(|b| b.split("```").next())
        .map(program);
    for prog in EXAMPLES.iter().map(|name| example(name)).chain(documented) {
        let mut both = Both::new(&prog);
        for (i, _) in prog.ports.iter().enumerate() {
            let port = PortId(i as u16);
            for frame in dpuflow::traffic::generate(&prog, port, 128, 64) {
                both.assert_same_walk(&frame, port);
            }
        }
    }
}

#[test]
fn classbench_firewalls_choose_as_the_engine_does() {
    let dir = std::env::temp_dir().join(format!("dpuflow-plan-cb-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    for set in ["acl1_1k", "fw1_1k", "ipc1_1k"] {
        let rules = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../shared/classbench")
            .join(set);
        assert!(rules.exists(), "ClassBench set {} missing", rules.display());
        let prog = program(&format!(
            "{PORTS}pipe acl root from a {{\n  rules from \"{}\" {{ actions count, fwd b }}\n  \
             default {{ actions drop }}\n}}\n",
            rules.display()
        ));
        let mut both = Both::new(&prog);
        assert!(
            both.plan.software.is_empty(),
            "{set}: {:?}",
            both.plan.software
        );
        let keys = dpuflow::firewall::acl::gen_trace(
            &dpuflow::firewall::acl::load_rules(&rules).expect("rules"),
            2000,
            7,
        );
        let trace = dir.join(format!("{set}.trace"));
        let lines: String = keys
            .iter()
            .map(|k| {
                let [s, d, sp, dp, p] = k.0;
                format!("{s} {d} {sp} {dp} {p}\n")
            })
            .collect();
        std::fs::write(&trace, lines).expect("trace written");
        for frame in dpuflow::traffic::from_trace(&trace, 128).expect("frames") {
            both.assert_same_walk(&frame, PortId(0));
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
