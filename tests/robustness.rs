//! Any byte string given as a pipeline file yields diagnostics or a program (and a DOCA
//! plan): never a panic or a hang. Property tests over arbitrary bytes, over soups of the
//! language's own tokens, and over mutations (deleted, duplicated and swapped tokens) of
//! the example pipelines.

use dpuflow::lang;
use proptest::prelude::*;
use std::path::Path;

const EXAMPLES: &[&str] = &[
    include_str!("../pipelines/vxlan-gateway.pipe"),
    include_str!("../pipelines/geneve-gateway.pipe"),
    include_str!("../pipelines/stateful-firewall.pipe"),
    include_str!("../pipelines/kv-offload.pipe"),
];

/// Words and punctuation the language uses, so random sequences reach deep into the parser.
const VOCABULARY: &[&str] = &[
    "pipeline",
    "port",
    "meter",
    "service",
    "conntrack",
    "telemetry",
    "pipe",
    "root",
    "from",
    "rule",
    "default",
    "table",
    "rules",
    "match",
    "actions",
    "lpm",
    "exact",
    "driver",
    "iface",
    "pcap",
    "af_xdp",
    "rate",
    "burst",
    "peak",
    "pps",
    "mbps",
    "10",
    "0",
    "65536",
    "16777216",
    "capacity",
    "timeout",
    "udp",
    "5d",
    "listen",
    "target",
    "\"nvme-tcp://127.0.0.1:4420/nqn.x\"",
    "127.0.0.1:9464",
    "prometheus",
    "ipfix",
    "interval",
    "{",
    "}",
    ",",
    "=>",
    "ipv4.dst",
    "ipv6.src",
    "inner.ipv4.src",
    "tcp.dst",
    "udp.dst",
    "tcp.flags",
    "ct.state",
    "in_port",
    "vxlan.vni",
    "geneve.vni",
    "10.0.0.0/8",
    "10.0.0.0/33",
    "2001:db8::/32",
    "1024-65535",
    "2000-1000",
    "syn+ack",
    "syn/syn+ack",
    "02:00:00:00:00:01",
    "{80, 443}",
    "established",
    "fwd",
    "goto",
    "drop",
    "count",
    "to",
    "mirror",
    "set",
    "dec",
    "ttl",
    "mark",
    "vlan.push",
    "vlan.pop",
    "vxlan.encap",
    "vxlan.decap",
    "geneve.encap",
    "geneve.decap",
    "ct.commit",
    "zone",
    "vni",
    "src",
    "dst",
    "smac",
    "dmac",
    "option",
    "0x0102",
    "0x80",
    "0xdeadbeef",
    "a",
    "b",
    "host",
    "uplink",
    "kvcache",
    "#",
    "\"",
    "\n",
    "x\"y",
];

fn check(text: &str) {
    let checked = lang::check_source("fuzz.pipe", text, Path::new("pipelines"));
    // Rendering walks every span: it must not panic either.
    let _ = checked.render();
    for d in &checked.diagnostics {
        let _ = checked.sources.json(d);
    }
    assert_eq!(checked.program.is_some(), !checked.has_errors());
    // Whatever the checker accepts, the DOCA backend plans (in hardware or in software),
    // and every structure of the plan's calls can be written.
    if let Some(p) = &checked.program {
        let plan = dpuflow::doca::plan(p);
        let _ = plan.to_string();
        let mut calls = dpuflow::doca::install::Listing::new(std::io::sink(), p);
        if let Err(e) = dpuflow::doca::install(&plan, p, &mut calls) {
            panic!("{e}\n{text}");
        }
    }
}

/// Splits text into tokens and the whitespace between them, keeping both.
fn pieces(text: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut cur = String::new();
    for c in text.chars() {
        let boundary = c.is_whitespace() || "{},".contains(c);
        if boundary {
            if !cur.is_empty() {
                out.push(std::mem::take(&mut cur));
            }
            out.push(c.to_string());
        } else {
            cur.push(c);
        }
    }
    if !cur.is_empty() {
        out.push(cur);
    }
    out
}

#[derive(Debug, Clone)]
enum Mutation {
    Delete(usize),
    Duplicate(usize),
    Swap(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        any::<usize>().prop_map(Mutation::Delete),
        any::<usize>().prop_map(Mutation::Duplicate),
        (any::<usize>(), any::<usize>()).prop_map(|(a, b)| Mutation::Swap(a, b)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 5000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        let checked = lang::check_bytes("fuzz.pipe", &bytes, Path::new("pipelines"));
        let _ = checked.render();
    }

    #[test]
    fn token_soup(words in proptest::collection::vec(proptest::sample::select(VOCABULARY), 0..200)) {
        check(&words.join(" "));
    }

    #[test]
    fn mutated_examples(which in 0..EXAMPLES.len(), muts in proptest::collection::vec(mutation(), 1..8)) {
        let mut p = pieces(EXAMPLES[which]);
        for m in muts {
            let n = p.len();
            if n == 0 {
                break;
            }
            match m {
                Mutation::Delete(i) => {
                    p.remove(i % n);
                }
                Mutation::Duplicate(i) => {
                    let t = p[i % n].clone();
                    p.insert(i % n, t);
                }
                Mutation::Swap(a, b) => p.swap(a % n, b % n),
            }
        }
        check(&p.concat());
    }
}

#[test]
fn examples_check_clean() {
    for text in EXAMPLES {
        let checked = lang::check_source("example.pipe", text, Path::new("pipelines"));
        assert!(checked.diagnostics.is_empty(), "{}", checked.render());
    }
}
